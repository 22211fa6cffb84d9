"""Cache state: DESIGN.md invariants 1, 2 and 4 after every transition, against a dense float model.

The dense model keeps every sequence's K/V rows as appended. A reader must see, at position p < n, the row
itself (rounded to the twin dtype) when p is retained and its NVFP4 round trip otherwise; rows past n are never
read (pools are NaN-poisoned, so any such read shows).
"""
import dataclasses

import chex  # noqa: F401  (assert_max_traces)
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import jmixedkv as jm
from conftest import assert_trees_bit_equal, bits
from jmixedkv import nvfp4
from jmixedkv.state import ERR_BAD_SLOT, ERR_HIGH_OOM, ERR_LOW_OOM, ERR_TOO_LONG

L, H, D = 2, 2, 32
T_PAD = 16  # every append is padded to this many tokens (one compile per config)

_append = jax.jit(jm.append, static_argnames=("group", "rope", "backend"))
_admit = jax.jit(jm.admit)
_release = jax.jit(jm.release)
_stage = jax.jit(jm.stage_reference, static_argnames=("group",))


def expected_rows(cfg, rows, n, gs=1.0):
    """What a reader must see for one sequence: rows f32[n, L, kv, H, D] -> [L, kv, H, n, D] bits."""
    att = cfg.attention_dtype
    stored = jnp.asarray(rows, jnp.float32).astype(jnp.bfloat16)   # appends are bf16
    low = nvfp4.dequantize(*nvfp4.quantize(stored, gs), gs, att)
    if cfg.dtype in ("bf16", "fp16"):
        out = stored.astype(att)
    elif cfg.dtype == "nvfp4":
        out = low
    else:
        p = np.arange(n)
        keep = (p < cfg.first_n) | (p >= n - cfg.last_n)
        out = jnp.where(keep[:, None, None, None, None], stored.astype(att), low)
    return np.transpose(np.asarray(out), (1, 2, 3, 0, 4))


def check_invariant_1_2(state, dense, cfg):
    for slot, rows in dense.items():
        n = len(rows)
        assert int(state.kv_lens[slot]) == n
        if n == 0:
            continue
        for layer in range(L):
            got = np.asarray(_stage(state, layer, jnp.array([slot], jnp.int32)))[0][..., :n, :]
            want = expected_rows(cfg, np.stack(rows), n)[layer]
            np.testing.assert_array_equal(bits(got), bits(want), err_msg=f"slot {slot} layer {layer}")


def check_invariant_4(state):
    for table, alloc in ((state.page_table, state.alloc), (state.high_table, state.high_alloc)):
        table, free = np.asarray(table), np.asarray(alloc.free)[: int(alloc.num_free)]
        used = table[table >= 0]
        assert len(set(used.tolist())) == len(used), "a page is owned twice"
        assert not set(used.tolist()) & set(free.tolist()), "a used page is on the free stack"
        assert len(set(free.tolist())) == len(free)
        if table is state.page_table or len(used) or int(alloc.num_free) < alloc.num_pages:
            assert len(used) + len(free) == alloc.num_pages or table.shape[1] == 0
        refc = np.asarray(alloc.refcount)
        assert (refc[used] == 1).all() and (refc[free] == 0).all()


def padded(seq, pos):
    seq, pos = list(seq), list(pos)
    assert len(seq) <= T_PAD
    return (jnp.array(seq + [-1] * (T_PAD - len(seq)), jnp.int32),
            jnp.array(pos + [0] * (T_PAD - len(pos)), jnp.int32))


CONFIGS = [
    dict(dtype="mixed_nvfp4_bf16", first_n=3, last_n=5, page_size=4, max_draft_len=2),
    dict(dtype="mixed_nvfp4_bf16", first_n=8, last_n=8, page_size=8, max_draft_len=0),
    dict(dtype="mixed_nvfp4_fp16", first_n=0, last_n=9, page_size=4, max_draft_len=3),
    dict(dtype="mixed_nvfp4_bf16", first_n=5, last_n=0, page_size=8),
    dict(dtype="mixed_nvfp4_bf16", first_n=0, last_n=0, page_size=4),
    dict(dtype="nvfp4", page_size=4),
    dict(dtype="bf16", page_size=8),
]


class CacheMachine(RuleBasedStateMachine):
    """admit / append prefill / append decode / release against a dense model."""

    @initialize(ci=st.integers(0, len(CONFIGS) - 1), perm_seed=st.integers(0, 2**16))
    def setup(self, ci, perm_seed):
        self.cfg = jm.KVCacheConfig(**CONFIGS[ci])
        rng = np.random.default_rng(perm_seed)
        self.num_pages, self.max_seqs, self.max_pages = 24, 3, 8
        nh = self.max_seqs * self.cfg.num_high_pages_per_seq
        self.state = jm.init_state(self.cfg, jm.GroupSpec(L, H, D), self.num_pages, self.max_seqs, self.max_pages,
                                   poison=True, page_order=rng.permutation(self.num_pages),
                                   high_page_order=rng.permutation(max(nh, 1)))
        self.dense = {}
        self.rng = rng

    def _rows(self, n):
        return self.rng.normal(size=(n, L, 2, H, D)).astype(np.float32) * self.rng.choice([0.01, 1.0, 30.0])

    def _append(self, seq, pos, rows):
        s, p = padded(seq, pos)
        x = np.zeros((T_PAD, L, 2, H, D), np.float32)
        x[: len(rows)] = rows
        k = jnp.asarray(np.transpose(x[:, :, 0], (1, 0, 2, 3)), jnp.bfloat16)
        v = jnp.asarray(np.transpose(x[:, :, 1], (1, 0, 2, 3)), jnp.bfloat16)
        before = self.state
        self.state = _append(self.state, k, v, s, p, None, backend="reference")
        return before

    @rule(slot=st.integers(0, 2))
    def admit(self, slot):
        before = self.state
        self.state = _admit(self.state, slot)
        if slot in self.dense or int(before.high_alloc.num_free) < self.cfg.num_high_pages_per_seq:
            assert int(self.state.error) & (ERR_BAD_SLOT | ERR_HIGH_OOM)
            self.state = dataclasses.replace(self.state, error=before.error)
            assert_trees_bit_equal(self.state, before)
        else:
            self.dense[slot] = []

    @precondition(lambda self: self.dense)
    @rule(data=st.data())
    def append_prefill(self, data):
        slot = data.draw(st.sampled_from(sorted(self.dense)))
        n0 = len(self.dense[slot])
        count = data.draw(st.integers(1, T_PAD))
        rows = self._rows(count)
        before = self._append([slot] * count, range(n0, n0 + count), rows)
        self._settle(before, {slot: rows})

    @precondition(lambda self: self.dense)
    @rule(data=st.data())
    def append_decode(self, data):
        tokens = data.draw(st.integers(1, self.cfg.max_draft_len + 1))
        seqs, poss, new = [], [], {}
        for slot in sorted(self.dense):
            n0 = len(self.dense[slot])
            seqs += [slot] * tokens
            poss += list(range(n0, n0 + tokens))
            new[slot] = self._rows(tokens)
        before = self._append(seqs, poss, np.concatenate(list(new.values())))
        self._settle(before, new)

    def _settle(self, before, new):
        err = int(self.state.error) & ~int(before.error)
        held = np.asarray(before.page_table) >= 0
        need = 0
        too_long = False
        for slot, rows in new.items():
            last = len(self.dense[slot]) + len(rows) - 1
            too_long |= last // self.cfg.page_size >= self.max_pages
            need += max(0, last // self.cfg.page_size + 1 - held[slot].sum())
        if too_long or need > int(before.alloc.num_free):
            assert err & (ERR_TOO_LONG | ERR_LOW_OOM), err
            # all-or-nothing: every leaf but the error flag is unchanged
            assert_trees_bit_equal(dataclasses.replace(self.state, error=before.error), before)
            self.state = dataclasses.replace(self.state, error=before.error)
            return
        assert err == 0, jm.describe_error(err)
        for slot, rows in new.items():
            self.dense[slot].extend(list(rows))

    @precondition(lambda self: self.dense)
    @rule(data=st.data())
    def release(self, data):
        slot = data.draw(st.sampled_from(sorted(self.dense)))
        self.state = _release(self.state, slot)
        del self.dense[slot]

    @invariant()
    def invariants(self):
        if not hasattr(self, "state"):
            return
        check_invariant_4(self.state)
        check_invariant_1_2(self.state, self.dense, self.cfg)


CacheMachine.TestCase.settings = settings(max_examples=14, stateful_step_count=10, deadline=None,
                                          suppress_health_check=list(HealthCheck))
test_cache_state_machine = CacheMachine.TestCase


def _fill(cfg, lens, seed=0, group=None):
    """A state with one sequence per entry of lens, appended in one prefill call per sequence."""
    rng = np.random.default_rng(seed)
    state = jm.init_state(cfg, group or jm.GroupSpec(L, H, D), 64, len(lens), 16, poison=True)
    rows = {}
    for slot, n in enumerate(lens):
        state = _admit(state, slot)
        x = rng.normal(size=(2, L, n, H, D)).astype(np.float32)
        k, v = jnp.asarray(x[0], jnp.bfloat16), jnp.asarray(x[1], jnp.bfloat16)
        state = _append(state, k, v, jnp.full((n,), slot, jnp.int32), jnp.arange(n, dtype=jnp.int32), None,
                        backend="reference")
        rows[slot] = x
    assert int(state.error) == 0
    return state


@pytest.mark.parametrize("lens", [[1, 7, 16, 17, 33]])
def test_all_high_equals_plain_cache(lens):
    mixed = _fill(jm.KVCacheConfig("mixed_nvfp4_bf16", first_n=20, last_n=20, page_size=8), lens)
    plain = _fill(jm.KVCacheConfig("bf16", page_size=8), lens)
    seq = jnp.arange(len(lens))
    for layer in range(L):
        a, b = _stage(mixed, layer, seq), _stage(plain, layer, seq)
        np.testing.assert_array_equal(bits(a), bits(b))


@pytest.mark.parametrize("lens", [[1, 7, 16, 17, 33]])
def test_all_low_equals_plain_nvfp4_cache(lens):
    mixed = _fill(jm.KVCacheConfig("mixed_nvfp4_bf16", page_size=8), lens)
    low = _fill(jm.KVCacheConfig("nvfp4", page_size=8), lens)
    seq = jnp.arange(len(lens))
    for layer in range(L):
        a, b = _stage(mixed, layer, seq), _stage(low, layer, seq)
        np.testing.assert_array_equal(bits(a), bits(b))
    assert mixed.pools[0].high is None  # first_n = last_n = 0: no twin at all


def test_fp8_twin_rows():
    cfg = jm.KVCacheConfig("mixed_nvfp4_fp8", first_n=4, last_n=4, page_size=8)
    st_ = _fill(cfg, [12], seed=3)
    st_ = dataclasses.replace(st_)  # still a valid pytree
    got = np.asarray(jm.stage_reference(st_, 0, jnp.array([0])))[0][..., :12, :]
    x = np.random.default_rng(3).normal(size=(2, L, 12, H, D)).astype(np.float32)
    stored = jnp.asarray(x[:, 0], jnp.bfloat16)  # [kv, n, H, D]
    twin = jnp.clip(stored.astype(jnp.float32), -448, 448).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    want_high = np.transpose(np.asarray(twin.astype(jnp.bfloat16)), (0, 2, 1, 3))
    for p in list(range(4)) + list(range(8, 12)):
        np.testing.assert_array_equal(bits(got[:, :, p]), bits(want_high[:, :, p]))


def test_mla_latent_group():
    cfg = jm.KVCacheConfig("mixed_nvfp4_bf16", first_n=2, last_n=2, page_size=4)
    g = jm.GroupSpec(1, 1, 576, kv_factor=1, name="mla")
    state = jm.admit(jm.init_state(cfg, g, 8, 1, 4, poison=True), 0)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 6, 1, 576)), jnp.bfloat16)
    state = jm.append(state, x, None, jnp.zeros(6, jnp.int32), jnp.arange(6), backend="reference")
    got = jm.stage_reference(state, 0, jnp.array([0]))[0, 0, 0, :6]
    np.testing.assert_array_equal(bits(got[:2]), bits(x[0, :2, 0]))
    np.testing.assert_array_equal(bits(got[4:6]), bits(x[0, 4:6, 0]))
    low = nvfp4.dequantize(*nvfp4.quantize(x[0, 2:4, 0]), 1.0, jnp.bfloat16)
    np.testing.assert_array_equal(bits(got[2:4]), bits(low))
    with pytest.raises(ValueError, match="MLA latent"):
        jm.append(state, x, x, jnp.zeros(6, jnp.int32), jnp.arange(6))


def test_oom_inside_jit_sets_flag_and_changes_nothing():
    cfg = jm.KVCacheConfig("mixed_nvfp4_bf16", first_n=4, last_n=4, page_size=4)
    state = jm.init_state(cfg, jm.GroupSpec(L, H, D), num_pages=3, max_seqs=2, max_pages_per_seq=8)
    state = _admit(_admit(state, 0), 1)
    k = jnp.ones((L, T_PAD, H, D), jnp.bfloat16)
    s, p = padded([0] * 8, range(8))
    state = _append(state, k, k, s, p, None, backend="reference")  # 2 pages
    assert int(state.error) == 0
    s, p = padded([0] * 4 + [1] * 4, list(range(8, 12)) + list(range(4)))  # needs 2, 1 free
    after = _append(state, k, k, s, p, None, backend="reference")
    assert int(after.error) == ERR_LOW_OOM
    assert_trees_bit_equal(dataclasses.replace(after, error=state.error), state)
    # the host API refuses the same request up front, naming the shortfall
    mgr = jm.CacheManager(cfg, jm.GroupSpec(L, H, D), num_pages=3, max_seqs=2, max_pages_per_seq=8)
    a, b = mgr.admit(), mgr.admit()
    mgr.append(k[:, :8], k[:, :8], [a] * 8, range(8))
    with pytest.raises(jm.CacheCapacityError, match=r"needs 2 new low pages but only 1 are free \(short by 1"):
        mgr.append(k[:, :8], k[:, :8], [a] * 4 + [b] * 4, list(range(8, 12)) + list(range(4)))
    assert not mgr.can_append([a] * 4 + [b] * 4, list(range(8, 12)) + list(range(4)))
    assert mgr.can_append([b] * 4, range(4))
    with pytest.raises(jm.CacheCapacityError, match="past the page table"):
        mgr.append(k[:, :1], k[:, :1], [a], [40])
    with pytest.raises(ValueError, match=r"slots \[7\] are not admitted"):
        mgr.append(k[:, :1], k[:, :1], [7], [0])
    mgr.check()


def test_host_errors_for_slots_and_high_pages():
    cfg = jm.KVCacheConfig("mixed_nvfp4_bf16", first_n=4, last_n=4, page_size=4)
    mgr = jm.CacheManager(cfg, jm.GroupSpec(L, H, D), num_pages=8, max_seqs=2, num_high_pages=3)
    mgr.admit(0)
    with pytest.raises(ValueError, match="already admitted"):
        mgr.admit(0)
    with pytest.raises(jm.CacheCapacityError, match="needs 3 high .* only 0 are free"):
        mgr.admit(1)
    mgr.release(0)
    assert mgr.admit() == 0
    # inside jit: admitting an active slot sets the flag and changes nothing
    before = mgr.state
    after = jm.admit(before, 0)
    assert int(after.error) == ERR_BAD_SLOT


def test_release_returns_every_page():
    cfg = jm.KVCacheConfig("mixed_nvfp4_bf16", first_n=4, last_n=4, page_size=4)
    state = _fill(cfg, [13, 5])
    total_low, total_high = state.alloc.num_pages, state.high_alloc.num_pages
    state = _release(_release(state, 0), 1)
    assert int(state.alloc.num_free) == total_low and int(state.high_alloc.num_free) == total_high
    assert (np.asarray(state.alloc.refcount) == 0).all() and (np.asarray(state.page_table) == -1).all()


def test_decode_loop_compiles_once():
    """200 jitted steps with changing lengths, page tables and batch membership: one trace."""
    cfg = jm.KVCacheConfig("mixed_nvfp4_bf16", first_n=4, last_n=6, page_size=4, max_draft_len=1)
    state = jm.init_state(cfg, jm.GroupSpec(1, H, D), num_pages=64, max_seqs=4, max_pages_per_seq=16)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(state, k, v, seq, pos, admit_slot, release_slot):
        state = jm.release(state, release_slot)
        state = jm.admit(state, admit_slot)
        state = jm.append(state, k, v, seq, pos, 0, backend="reference")
        return state, jm.stage_reference(state, 0, seq[:4])

    rng = np.random.default_rng(0)
    lens = np.zeros(4, int)
    active = np.zeros(4, bool)
    for i in range(200):
        slot_out = -1
        if active.any() and (lens.max() >= 40 or rng.random() < 0.05):
            slot_out = int(np.argmax(np.where(active, lens, -1)))
            active[slot_out], lens[slot_out] = False, 0
        slot_in = int(np.flatnonzero(~active)[0]) if (~active).any() and rng.random() < 0.3 else -1
        if slot_in >= 0:
            active[slot_in] = True
        seq = np.where(active, np.arange(4), -1)
        pos = lens.copy()
        lens = np.where(active, lens + 1, lens)
        k = jnp.asarray(rng.normal(size=(4, H, D)), jnp.bfloat16)
        state, staged = step(state, k, k, jnp.asarray(seq, jnp.int32), jnp.asarray(pos, jnp.int32),
                             jnp.int32(slot_in), jnp.int32(slot_out))
        assert int(state.error) == 0, jm.describe_error(int(state.error))
        np.testing.assert_array_equal(np.asarray(state.kv_lens), lens)
        np.testing.assert_array_equal(np.asarray(state.active), active)


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 40), first_n=st.integers(0, 12), last_n=st.integers(0, 12), page=st.sampled_from([1, 4, 8]),
       draft=st.integers(0, 3))
def test_retained_set_is_exact(n, first_n, last_n, page, draft):
    """Rows read from the twin are exactly {p < first_n} U {n - last_n <= p < n}: planted markers show it."""
    cfg = jm.KVCacheConfig("mixed_nvfp4_bf16", first_n=first_n, last_n=last_n, page_size=page, max_draft_len=draft)
    g = jm.GroupSpec(1, 1, 16)
    state = jm.admit(jm.init_state(cfg, g, 64, 1, 64), 0)
    # a value NVFP4 cannot represent exactly: high rows differ from low rows
    x = jnp.full((n, 1, 16), 1.1, jnp.bfloat16) * (1 + jnp.arange(n, dtype=jnp.bfloat16)[:, None, None] / 64)
    for t in range(0, n, 5):  # several appends: the ring wraps
        m = min(5, n - t)
        state = _append(state, x[t:t + m], x[t:t + m], jnp.zeros(m, jnp.int32), jnp.arange(t, t + m), 0,
                        backend="reference")
    got = np.asarray(jm.stage_reference(state, 0, jnp.array([0]))[0, 0, 0, :n, 0], np.float32)
    exact = got == np.asarray(x[:, 0, 0], np.float32)
    p = np.arange(n)
    retained = (p < first_n) | (p >= n - last_n)
    assert (exact[retained]).all()
    low = np.asarray(nvfp4.dequantize(*nvfp4.quantize(x[:, 0]), 1.0, jnp.float32))[:, 0]
    np.testing.assert_array_equal(got[~retained], low[~retained])
