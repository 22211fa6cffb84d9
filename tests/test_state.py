"""Cache state: docs/DESIGN.md §3 invariants 1, 2 and 4 after every transition, against a dense float model.

The dense model keeps every sequence's K/V rows as appended. A reader must see, at position p < n, the row
itself (rounded to the twin dtype) when p is retained and its NVFP4 round trip otherwise; rows past n are never
read (pools are NaN-poisoned, so any such read shows).
"""
import dataclasses
import functools

import chex  # noqa: F401  (assert_max_traces)
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import jmixedkv as jm
from helpers import assert_trees_bit_equal, bits, poisoned_state
from jmixedkv import nvfp4
from jmixedkv.state import (ERR_BAD_LAYER, ERR_BAD_POSITION, ERR_BAD_SLOT, ERR_HIGH_OOM, ERR_LOW_OOM,
                            ERR_TOO_LONG)

L, H, D = 2, 2, 32
T_PAD = 16  # every append is padded to this many tokens (one compile per config)
ROWS_PAD = 64  # the longest sequence a CacheMachine config holds (max_pages 8 x page 8)

_admit = jax.jit(jm.admit)
_release = jax.jit(jm.release)
_stage = jax.jit(jm.stage_reference, static_argnames=("group",))


@functools.partial(jax.jit, static_argnames="att")
def _round_trip(stored, gs, att):
    """NVFP4 round trip of ``stored`` (per 16-element block, so row by row), decoded to ``att``."""
    return nvfp4.dequantize_reference(*nvfp4.quantize_reference(stored, gs), gs, att)


def expected_rows(cfg, rows, n, gs=1.0):
    """What a reader must see for one sequence: rows f32[n, L, kv, H, D] -> [L, kv, H, n, D] bits.

    The round trip runs jitted on the rows padded to a fixed count (it is row by row, so the first ``n`` rows do
    not depend on the padding): one compile per attention dtype, not one per sequence length."""
    att = cfg.attention_dtype
    stored = np.asarray(rows, np.float32).astype(jnp.bfloat16)   # appends are bf16
    padded_rows = np.zeros((ROWS_PAD, *stored.shape[1:]), stored.dtype)
    padded_rows[:n] = stored
    low = np.asarray(_round_trip(padded_rows, gs, jnp.dtype(att)))[:n]
    if cfg.dtype in ("bf16", "fp16"):
        out = stored.astype(att)
    elif cfg.dtype == "nvfp4":
        out = low
    else:
        p = np.arange(n)
        keep = (p < cfg.first_n) | (p >= n - cfg.last_n)
        out = np.where(keep[:, None, None, None, None], stored.astype(att), low)
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
        self.state = jm.append(self.state, None, k, v, s, p, backend="reference")
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

    @rule(data=st.data())
    def bad_append(self, data):
        """Out-of-range slot / layer, backwards, gapped or duplicate positions: refused, every leaf unchanged (the
        dense-model invariants then confirm no sequence moved)."""
        active = sorted(self.dense)
        kind = data.draw(st.sampled_from(["slot", "layer", "backwards", "gap", "dup"] if active else ["slot"]))
        slot = data.draw(st.sampled_from(active)) if active else 0
        n = len(self.dense.get(slot, []))
        layer = None
        if kind == "slot":
            seq, pos, bit = [data.draw(st.sampled_from([-2, self.max_seqs, self.max_seqs + 5]))], [n], ERR_BAD_SLOT
        elif kind == "layer":
            seq, pos, bit = [slot], [n], ERR_BAD_LAYER
            layer = data.draw(st.sampled_from([-1, L, L + 3]))
        elif kind == "backwards" and n >= 2:
            p0 = data.draw(st.integers(0, n - 2))
            seq, pos, bit = [slot], [p0], ERR_BAD_POSITION                     # stops short of kv_len - 1
        elif kind == "gap":
            seq, pos, bit = [slot], [n + data.draw(st.integers(1, 5))], ERR_BAD_POSITION
        else:
            seq, pos, bit = [slot, slot], [n, n], ERR_BAD_POSITION
        s, p = padded(seq, pos)
        before = self.state
        if layer is None:
            k = jnp.ones((L, T_PAD, H, D), jnp.bfloat16)
            after = jm.append(before, None, k, k, s, p, backend="reference")
        else:
            k = jnp.ones((T_PAD, H, D), jnp.bfloat16)
            after = jm.append(before, jnp.int32(layer), k, k, s, p, backend="reference")
        assert int(after.error) & bit, jm.describe_error(int(after.error))
        assert_trees_bit_equal(dataclasses.replace(after, error=before.error), before)

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


def _kv_rows(seed, _rng, shape, dtype):
    """``(k, v)`` of ``shape [L, T, H, D]`` drawn from ``seed`` alone, token-major: the same rows for every config
    and every padded length ``T`` (the leading tokens do not depend on ``T``)."""
    x = np.random.default_rng(seed).normal(size=(shape[1], 2, shape[0], *shape[2:])).swapaxes(0, 2)  # [L, 2, T..]
    return jnp.asarray(x[:, 0], dtype), jnp.asarray(x[:, 1], dtype)


def _fill(cfg, lens, seed=0, group=None):
    """`poisoned_state` with one sequence per entry of lens, the K/V rows of `_kv_rows` (``seed``), FP8 scale 1."""
    return poisoned_state(cfg, group or jm.GroupSpec(L, H, D), lens, seed=seed, high_scale=1.0,
                          rows=functools.partial(_kv_rows, seed))


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
    stored = jnp.stack([a[0] for a in _kv_rows(3, None, (L, 12, H, D), jnp.bfloat16)])  # [kv, n, H, D]
    twin = jnp.clip(stored.astype(jnp.float32), -448, 448).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    want_high = np.transpose(np.asarray(twin.astype(jnp.bfloat16)), (0, 2, 1, 3))
    for p in list(range(4)) + list(range(8, 12)):
        np.testing.assert_array_equal(bits(got[:, :, p]), bits(want_high[:, :, p]))


def test_mla_latent_group():
    cfg = jm.KVCacheConfig("mixed_nvfp4_bf16", first_n=2, last_n=2, page_size=4)
    g = jm.GroupSpec(1, 1, 576, kv_factor=1, name="mla")
    state = jm.admit(jm.init_state(cfg, g, 8, 1, 4, poison=True), 0)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 6, 1, 576)), jnp.bfloat16)
    state = jm.append(state, None, x, None, jnp.zeros(6, jnp.int32), jnp.arange(6), backend="reference")
    got = jm.stage_reference(state, 0, jnp.array([0]))[0, 0, 0, :6]
    np.testing.assert_array_equal(bits(got[:2]), bits(x[0, :2, 0]))
    np.testing.assert_array_equal(bits(got[4:6]), bits(x[0, 4:6, 0]))
    low = nvfp4.dequantize_reference(*nvfp4.quantize_reference(x[0, 2:4, 0]), 1.0, jnp.bfloat16)
    np.testing.assert_array_equal(bits(got[2:4]), bits(low))
    with pytest.raises(ValueError, match="MLA latent"):
        jm.append(state, None, x, x, jnp.zeros(6, jnp.int32), jnp.arange(6))


def test_oom_inside_jit_sets_flag_and_changes_nothing():
    cfg = jm.KVCacheConfig("mixed_nvfp4_bf16", first_n=4, last_n=4, page_size=4)
    state = jm.init_state(cfg, jm.GroupSpec(L, H, D), num_pages=3, max_seqs=2, max_pages_per_seq=8)
    state = _admit(_admit(state, 0), 1)
    k = jnp.ones((L, T_PAD, H, D), jnp.bfloat16)
    s, p = padded([0] * 8, range(8))
    state = jm.append(state, None, k, k, s, p, backend="reference")  # 2 pages
    assert int(state.error) == 0
    s, p = padded([0] * 4 + [1] * 4, list(range(8, 12)) + list(range(4)))  # needs 2, 1 free
    after = jm.append(state, None, k, k, s, p, backend="reference")
    assert int(after.error) == ERR_LOW_OOM
    assert_trees_bit_equal(dataclasses.replace(after, error=state.error), state)
    # the host API refuses the same request up front, naming the shortfall
    mgr = jm.CacheManager(cfg, jm.GroupSpec(L, H, D), num_pages=3, max_seqs=2, max_pages_per_seq=8)
    a, b = mgr.admit(), mgr.admit()
    mgr.append(None, k[:, :8], k[:, :8], [a] * 8, range(8))
    with pytest.raises(jm.CacheCapacityError, match=r"needs 2 new low pages but only 1 are free \(short by 1"):
        mgr.append(None, k[:, :8], k[:, :8], [a] * 4 + [b] * 4, list(range(8, 12)) + list(range(4)))
    assert not mgr.can_append([a] * 4 + [b] * 4, list(range(8, 12)) + list(range(4)))
    assert mgr.can_append([b] * 4, range(4))
    with pytest.raises(jm.CacheCapacityError, match="past the page table"):
        mgr.append(None, k[:, :1], k[:, :1], [a], [40])
    with pytest.raises(ValueError, match=r"seq_slots\[0\]=7 out of range \[-1, 2\)"):
        mgr.append(None, k[:, :1], k[:, :1], [7], [0])
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
        state = jm.append(state, 0, k, v, seq, pos, backend="reference")
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
    """Rows read from the twin are exactly {p < first_n} U {n - last_n <= p < n}: planted markers show it.

    Each append call is padded to 5 tokens (slot -1) and the readers are jitted: one compile per config."""
    cfg = jm.KVCacheConfig("mixed_nvfp4_bf16", first_n=first_n, last_n=last_n, page_size=page, max_draft_len=draft)
    g = jm.GroupSpec(1, 1, 16)
    state = _admit(jm.init_state(cfg, g, 64, 1, 64), 0)
    x, low = _retained_markers()
    x, low = x[:n], low[:n]
    for t in range(0, n, 5):  # several appends: the ring wraps
        m = min(5, n - t)
        rows = np.zeros((5, 1, 16), x.dtype)
        rows[:m] = x[t:t + m]
        seq, pos = np.full(5, -1, np.int32), np.zeros(5, np.int32)
        seq[:m], pos[:m] = 0, np.arange(t, t + m)
        state = jm.append(state, 0, rows, rows, seq, pos, backend="reference")
    got = np.asarray(_stage(state, 0, jnp.array([0], jnp.int32))[0, 0, 0, :n, 0], np.float32)
    exact = got == np.asarray(x[:, 0, 0], np.float32)
    p = np.arange(n)
    retained = (p < first_n) | (p >= n - last_n)
    assert (exact[retained]).all()
    np.testing.assert_array_equal(got[~retained], low[~retained])


@functools.lru_cache(maxsize=None)
def _retained_markers(n=40):
    """``(x, low)`` of `test_retained_set_is_exact` for its longest sequence (row ``i`` does not depend on ``n``):
    x bf16[n, 1, 16], a value NVFP4 cannot represent exactly (high rows differ from low rows), and low,
    its NVFP4 round trip (first element of each row, f32[n])."""
    x = jnp.full((n, 1, 16), 1.1, jnp.bfloat16) * (1 + jnp.arange(n, dtype=jnp.bfloat16)[:, None, None] / 64)
    low = np.asarray(nvfp4.dequantize_reference(*nvfp4.quantize_reference(x[:, 0]), 1.0, jnp.float32))[:, 0]
    return np.asarray(x), low


# ------------------------------------------------------------------------------------------------ adversarial machine
# Bad input: the machine also draws out-of-range slots and layers, backwards / gapped / duplicate positions, forks
# and speculative rewinds. After every step it checks (1) the exact error code a host model of the rule in
# `jmixedkv.checks` predicts, and (2) that a refused step changed no leaf but ``error`` and an accepted one changed
# no other sequence (table rows, lengths and staged bytes compared). Tiny shapes, reference backend, one compile per
# transition and config, so it runs >= 2000 steps in CI.
from hypothesis.stateful import run_state_machine_as_test  # noqa: E402

from jmixedkv import speculative as spec_mod  # noqa: E402
from jmixedkv.checks import ERR_BAD_CORRECTION, ERR_BAD_LAYER, ERR_BAD_POSITION, ERR_SHARED_PAGE  # noqa: E402

AL, AH, AD, AS, AT = 2, 1, 16, 3, 6           # layers, heads, head_dim, slots, tokens per append call
ADV_CONFIGS = [dict(dtype="mixed_nvfp4_bf16", first_n=2, last_n=3, page_size=4, max_draft_len=2),
               dict(dtype="nvfp4", page_size=4, max_draft_len=1)]
ADV_PAGES, ADV_MAX_PAGES = 10, 4
_adv_fork = jax.jit(jm.fork)
_adv_correct = jax.jit(spec_mod.correct_kv_lens)
_adv_accept = jax.jit(spec_mod.accept)
_adv_trim = jax.jit(spec_mod.trim)
_adv_stage = jax.jit(lambda st: jnp.stack([jm.stage_reference(st, l, jnp.arange(AS, dtype=jnp.int32))
                                           for l in range(AL)]))
ADV_STEPS = [0, 0]          # steps, refused steps
ADV_DONE = {}               # accepted steps per kind: forks, rewinds, accepts that drop drafts, appends after a rewind


class AdversarialMachine(RuleBasedStateMachine):
    @initialize(ci=st.integers(0, len(ADV_CONFIGS) - 1), seed=st.integers(0, 2 ** 16))
    def setup(self, ci, seed):
        self.cfg = jm.KVCacheConfig(**ADV_CONFIGS[ci])
        rng = np.random.default_rng(seed)
        self.rng = rng
        nh = AS * self.cfg.num_high_pages_per_seq
        self.state = jm.init_state(self.cfg, jm.GroupSpec(AL, AH, AD), ADV_PAGES, AS, ADV_MAX_PAGES, poison=True,
                                   page_order=rng.permutation(ADV_PAGES), high_page_order=rng.permutation(max(nh, 1)))
        # host model of the rewind bookkeeping (independent of the state's fields): the rewind floor, the open
        # append step's first row (-1 = none) and the layers that wrote all of it
        self.floor = [0] * AS
        self.step = [(-1, frozenset())] * AS

    def _done(self, kind):
        ADV_DONE[kind] = ADV_DONE.get(kind, 0) + 1

    def _step_complete(self, s):
        lo, layers = self.step[s]
        return lo < 0 or not layers or layers == frozenset(range(AL))

    # --------------------------------------------------------------- host model of the rule (from the pre-state)
    def _h(self, name):
        return np.asarray(getattr(self.state, name))

    def _check(self, before, after, expected, touched):
        ADV_STEPS[0] += 1
        got = int(after.error)
        assert got == expected, f"error {jm.describe_error(got)} != expected {jm.describe_error(expected)}"
        if expected:
            ADV_STEPS[1] += 1
            assert_trees_bit_equal(dataclasses.replace(after, error=before.error), before)
            self.state = before
            return
        a, b = np.asarray(_adv_stage(before)).view(np.uint8), np.asarray(_adv_stage(after)).view(np.uint8)
        for s in range(AS):
            if s in touched:
                continue
            np.testing.assert_array_equal(a[:, s], b[:, s], err_msg=f"slot {s} staged bytes")
            for f in ("page_table", "high_table", "kv_lens", "active", "written"):
                np.testing.assert_array_equal(bits(getattr(before, f))[s], bits(getattr(after, f))[s], err_msg=f)
        self.state = after

    @rule(slot=st.sampled_from([-3, -1, AS, AS + 1] + list(range(AS)) * 4), admit=st.sampled_from([True] * 3 + [False]))
    def admit_release(self, slot, admit):
        before = self.state
        active = self._h("active")
        if slot == -1:
            exp = 0
        elif not 0 <= slot < AS or active[slot] == admit:
            exp = ERR_BAD_SLOT
        elif admit and int(before.high_alloc.num_free) < self.cfg.num_high_pages_per_seq:
            exp = ERR_HIGH_OOM
        else:
            exp = 0
        after = (_admit if admit else _release)(before, jnp.int32(slot))
        self._check(before, after, exp, {slot})
        if not exp and slot >= 0:
            self.floor[slot], self.step[slot] = 0, (-1, frozenset())

    @rule(data=st.data())
    def append(self, data):
        before, cfg = self.state, self.cfg
        page = cfg.page_size
        lens, active, table = self._h("kv_lens"), self._h("active"), self._h("page_table")
        refc = np.asarray(before.alloc.refcount)
        hrefc, htable = np.asarray(before.high_alloc.refcount), self._h("high_table")
        seqs, poss = [], []
        for _ in range(data.draw(st.sampled_from([1, 1, 1, 2]))):
            live_slots = [s for s in range(AS) if active[s]] or list(range(AS))
            slot = data.draw(st.sampled_from([-2, -1, AS, AS + 3] + live_slots * 6))
            n = int(lens[slot]) if 0 <= slot < AS else 0
            mode = data.draw(st.sampled_from(["extend"] * 6 + ["suffix"] * 2 + ["old", "gap", "dup", "neg", "far"]))
            c = data.draw(st.integers(1, AT // 2))
            p0 = {"extend": n, "suffix": max(n - c, 0), "old": max(n - c - data.draw(st.integers(1, 6)), 0),
                  "gap": n + data.draw(st.integers(1, 3)), "dup": n, "neg": -1 - c, "far": 2 ** 20}[mode]
            pos = list(range(p0, p0 + c)) if mode != "dup" else [p0] * c
            seqs += [slot] * c
            poss += pos
        layer = data.draw(st.sampled_from([None] * 4 + [0, 1] * 2 + [-1, AL, 5]))
        self._do_append(seqs, poss, layer)

    def _do_append(self, seqs, poss, layer):
        """One append, its expected code from the model, and the model's update; returns the code."""
        before, cfg = self.state, self.cfg
        page = cfg.page_size
        lens, active, table = self._h("kv_lens"), self._h("active"), self._h("page_table")
        refc = np.asarray(before.alloc.refcount)
        hrefc, htable = np.asarray(before.high_alloc.refcount), self._h("high_table")
        t = len(seqs)
        # expected code (jmixedkv.checks / state._write_errors), computed from the pre-state
        pad = [s == -1 for s in seqs]
        bad_slot = any(not p and not (0 <= s < AS and active[s]) for s, p in zip(seqs, pad))
        exp = ERR_BAD_SLOT if bad_slot else 0
        if layer is not None and not 0 <= layer < AL:
            exp |= ERR_BAD_LAYER
        live = [(s, p) for s, p in zip(seqs, poss) if s >= 0] if not bad_slot else []
        bad_pos = any(p < 0 for _, p in live)
        for s in {s for s, _ in live}:
            ps = sorted(p for s_, p in live if s_ == s)
            bad_pos |= any(b - a != 1 for a, b in zip(ps, ps[1:]))
            bad_pos |= not (ps[0] <= lens[s] <= ps[-1] + 1)
        exp |= ERR_BAD_POSITION if bad_pos else 0
        too_long = any(p >= 0 and p // page >= ADV_MAX_PAGES for _, p in live)
        exp |= ERR_TOO_LONG if too_long else 0
        shared = False
        for s, p in live:
            q = max(p, 0) // page
            if q < ADV_MAX_PAGES and table[s, q] >= 0 and refc[table[s, q]] > 1:
                shared = True
            if htable.shape[1]:
                col = int(cfg.twin.high_column(max(p, 0)))
                if col >= 0 and htable[s, min(col, htable.shape[1] - 1)] >= 0 and \
                        hrefc[htable[s, min(col, htable.shape[1] - 1)]] > 1:
                    shared = True
        exp |= ERR_SHARED_PAGE if shared else 0
        if not exp:
            need = {(s, p // page) for s, p in live if table[s, p // page] < 0}
            if len(need) > int(before.alloc.num_free):
                exp = ERR_LOW_OOM
        seq_a = jnp.asarray(seqs + [-1] * (AT - t), jnp.int32)
        pos_a = jnp.asarray(poss + [0] * (AT - t), jnp.int32)
        x = jnp.asarray(self.rng.normal(size=(AL, AT, AH, AD)), jnp.bfloat16)
        if layer is None:
            after = jm.append(before, None, x, x, seq_a, pos_a, backend="reference")
        else:
            after = jm.append(before, jnp.int32(layer), x[0], x[0], seq_a, pos_a, backend="reference")
        self._check(before, after, exp, {s for s, _ in live})
        if not exp:
            mine = frozenset(range(AL)) if layer is None else frozenset([layer])
            for s in {s for s, _ in live}:
                if int(before.written[s]) > lens[s]:
                    self._done("re-append over rewound rows")
                ps = [p for s_, p in live if s_ == s]
                first, last = min(ps), max(ps)
                self.floor[s] = max(self.floor[s], last + 1 - cfg.max_draft_len)
                lo, layers = self.step[s]
                if last + 1 > lens[s]:
                    self.step[s] = (first, mine)
                elif lo >= 0 and first <= lo:
                    self.step[s] = (lo, layers | mine)
        return exp

    @rule(src=st.sampled_from([-2, -1, 0, 1, 2, AS, AS + 1]), dst=st.sampled_from([-2, -1, 0, 1, 2, AS]))
    def fork(self, src, dst):
        self._do_fork(src, dst)

    def _do_fork(self, src, dst):
        before = self.state
        active, lens = self._h("active"), self._h("kv_lens")
        if src == -1 or dst == -1:
            exp = 0
        elif not (0 <= src < AS and 0 <= dst < AS) or not active[src] or active[dst] or src == dst:
            exp = ERR_BAD_SLOT
        else:
            # copy-on-write covers every page a legal rewind can write: only pages wholly below the floor are shared
            n, page, floor = int(lens[src]), self.cfg.page_size, self.floor[src]
            row, hrow = self._h("page_table")[src], self._h("high_table")[src]
            need_low = sum(1 for j in range(ADV_MAX_PAGES) if row[j] >= 0 and (j + 1) * page > floor and j * page < n)
            nf = self.cfg.num_fixed_pages
            share_high = [(j < nf) and ((j + 1) * page <= floor) and hrow[j] >= 0 for j in range(len(hrow))]
            need_high = sum(1 for j in range(len(hrow)) if hrow[j] >= 0 and not share_high[j])
            exp = ((ERR_LOW_OOM if need_low > int(before.alloc.num_free) else 0)
                   | (ERR_HIGH_OOM if need_high > int(before.high_alloc.num_free) else 0))
        after = _adv_fork(before, jnp.int32(src), jnp.int32(dst))
        self._check(before, after, exp, {dst})
        if not exp and src >= 0 and dst >= 0:
            self._done("fork")
            self.floor[dst], self.step[dst] = self.floor[src], self.step[src]
            staged_ = np.asarray(_adv_stage(after)).view(np.uint8)           # dst reads exactly what src reads
            np.testing.assert_array_equal(staged_[:, dst], staged_[:, src])
        return exp

    @rule(slot=st.integers(0, AS - 1), off=st.sampled_from([-4, -2, -1, -1, 0, 0, 1]), trim=st.booleans())
    def rewind(self, slot, off, trim):
        self._do_rewind(slot, off, trim)

    def _do_rewind(self, slot, off, trim=False):
        before = self.state
        active, lens, written = self._h("active"), self._h("kv_lens"), self._h("written")
        offs = np.zeros(AS, np.int32)
        offs[slot] = off
        floor = self.floor[slot] if active[slot] else int(lens[slot])
        assert floor >= int(written[slot]) - self.cfg.max_draft_len
        bad = off > 0 or lens[slot] + off < floor or (off < 0 and not self._step_complete(slot))
        exp = ERR_BAD_CORRECTION if bad else 0
        after = _adv_correct(before, jnp.asarray(offs))
        if trim and not exp:
            after = _adv_trim(after, jnp.asarray([slot, -1], jnp.int32))
        self._check(before, after, exp, {slot})
        if not exp and off:
            self._done("rewind")
            self.step[slot] = (-1, frozenset())
        return exp

    @rule(slot=st.integers(0, AS - 1), k=st.integers(0, 3), a=st.integers(0, 3))
    def accept(self, slot, k, a):
        self._do_accept(slot, k, a)

    def _do_accept(self, slot, k, a):
        """accept is justified only right after a complete verify block of exactly k + 1 rows."""
        before = self.state
        active, lens = self._h("active"), self._h("kv_lens")
        lo, _ = self.step[slot]
        n = int(lens[slot])
        if a > k or k > self.cfg.max_draft_len:
            bad = True
        elif a == k:
            bad = False
        else:
            floor = self.floor[slot] if active[slot] else n
            bad = (lo < 0 or n - lo != k + 1 or not self._step_complete(slot) or n + a - k < floor)
        exp = ERR_BAD_CORRECTION if bad else 0
        after = _adv_accept(before, jnp.asarray([slot], jnp.int32), jnp.asarray([a], jnp.int32),
                            jnp.asarray([k], jnp.int32))
        self._check(before, after, exp, {slot})
        if not exp and a < k:
            self._done("accept dropping drafts")
            self.step[slot] = (-1, frozenset())
        return exp

    @rule(data=st.data())
    def speculative_story(self, data):
        """Valid work, so it is exercised often: a verify block written layer by layer (an accept drawn between
        the layers is refused), accept, fork, a legal rewind of either copy and its re-append; every step goes
        through the same model as the random rules above."""
        active, lens = self._h("active"), self._h("kv_lens")
        live = [s for s in range(AS) if active[s]]
        free = [s for s in range(AS) if not active[s]]
        if not live:
            if free:
                self.admit_release(free[0], True)
            return
        src = data.draw(st.sampled_from(live))
        n, mdl = int(lens[src]), self.cfg.max_draft_len
        k = data.draw(st.integers(0, mdl))
        seqs, poss = [src] * (k + 1), list(range(n, n + k + 1))
        per_layer = data.draw(st.booleans())
        if self._do_append(seqs, poss, 0 if per_layer else None):
            return
        if per_layer:
            if data.draw(st.booleans()) and k:
                self._do_accept(src, k, 0)                    # between the layers: refused by the model
            self._do_append(seqs, poss, 1)
        self._do_accept(src, k, data.draw(st.integers(0, k)))
        if free and data.draw(st.booleans()):
            self._do_fork(src, free[0])
        pick = data.draw(st.sampled_from([src] + ([free[0]] if free and self._h("active")[free[0]] else [])))
        r = data.draw(st.integers(1, max(mdl, 1)))
        if not self._do_rewind(pick, -r):
            m = int(self._h("kv_lens")[pick])
            self._do_append([pick] * r, list(range(m, m + r)), None)

    @invariant()
    def allocator_consistent(self):
        if hasattr(self, "state"):
            st_ = self.state
            used = np.asarray(st_.page_table)
            used = used[used >= 0]
            refc = np.asarray(st_.alloc.refcount)
            counts = np.bincount(used, minlength=ADV_PAGES) if used.size else np.zeros(ADV_PAGES, int)
            np.testing.assert_array_equal(refc, counts)          # no index here: refcount = table references
            assert int(st_.alloc.num_free) == int((refc == 0).sum())
            lens, written = np.asarray(st_.kv_lens), np.asarray(st_.written)
            assert (lens <= written).all() and (written <= lens + self.cfg.max_draft_len).all()


def test_adversarial_state_machine_2000_steps():
    import time
    ADV_STEPS[:] = [0, 0]
    ADV_DONE.clear()
    t0 = time.perf_counter()
    run_state_machine_as_test(AdversarialMachine, settings=settings(
        max_examples=130, stateful_step_count=20, deadline=None, suppress_health_check=list(HealthCheck)))
    elapsed = time.perf_counter() - t0
    print(f"adversarial machine: {ADV_STEPS[0]} steps ({ADV_STEPS[1]} refused) in {elapsed:.1f}s; {ADV_DONE}")
    assert ADV_STEPS[0] >= 2000, ADV_STEPS[0]
    for kind in ("fork", "rewind", "accept dropping drafts", "re-append over rewound rows"):
        assert ADV_DONE.get(kind, 0) >= 20, ADV_DONE                  # valid forks / rewinds / re-appends ran
    assert 0.2 < ADV_STEPS[1] / ADV_STEPS[0] < 0.85, ADV_STEPS     # both refusals and accepted steps exercised


# ------------------------------------------------------------------------------------------------ the position rule
from jmixedkv import checks as checks_mod  # noqa: E402

_jit_rule = jax.jit(lambda s, p, n: checks_mod.position_rule(s, p, n, 3))
_jit_any = jax.jit(lambda s, p, n: checks_mod.position_rule(s, p, n, 3, per_slot=False)[0])


@settings(max_examples=60, deadline=None)
@given(toks=st.lists(st.tuples(st.integers(-1, 2), st.integers(0, 9)), min_size=1, max_size=7),
       lens=st.lists(st.integers(0, 9), min_size=3, max_size=3))
def test_position_rule_one_definition_host_and_jit(toks, lens):
    """`checks.position_rule` is the rule for both the host mirror (NumPy; its one-token-per-slot shortcut
    included) and the jitted append (jnp): the two agree with each other and with a plain per-slot reading of the
    rule."""
    seq = np.array([t[0] for t in toks], np.int32)
    pos = np.array([t[1] for t in toks], np.int32)
    n = np.array(lens, np.int32)
    host = checks_mod.position_rule(seq, pos, n, 3, np)
    dev = _jit_rule(jnp.asarray(seq), jnp.asarray(pos), jnp.asarray(n))
    for h, d in zip(host, dev):
        np.testing.assert_array_equal(h, np.asarray(d))
    assert bool(_jit_any(jnp.asarray(seq), jnp.asarray(pos), jnp.asarray(n))) == bool(host[0].any())
    assert bool(checks_mod.position_rule(seq, pos, n, 3, np, per_slot=False)[0]) == bool(host[0].any())
    for s in range(3):
        p = np.sort(pos[seq == s])
        assert host[0][s] == bool(p.size and (np.diff(p) != 1).any())
        assert host[1][s] == bool(p.size and not p[0] <= n[s] <= p[-1] + 1)


def _pool_sized_ops(fn, *args):
    """Equations of ``fn``'s jaxpr (nested ones included) that make a pool-sized array by select or copy."""
    state = args[0]
    pool_shapes = {x.shape for x in jax.tree.leaves(state.pools) if x.size > 1024}
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("select_n", "copy", "copy_p") and any(
                    getattr(v.aval, "shape", None) in pool_shapes for v in eqn.outvars):
                found.append(str(eqn)[:120])
            for p in eqn.params.values():          # nested programs (pjit, cond, while, custom calls)
                if hasattr(p, "jaxpr") and hasattr(p.jaxpr, "eqns"):
                    walk(p.jaxpr)
                elif hasattr(p, "eqns"):
                    walk(p)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


@pytest.mark.parametrize("kind", ["bf16", "mixed_nvfp4_bf16"])
def test_table_transitions_never_select_a_pool(kind):
    """admit / release / accept / trim / correct_kv_lens change tables only, and fork copies only the pages it must:
    no pool goes whole through a select or copy of itself (on the GPU a 40 GiB pool selected against itself
    allocated a second 40 GiB in `release`)."""
    cfg = jm.KVCacheConfig(kind, first_n=4, last_n=16, page_size=8, max_draft_len=3) if kind != "bf16" else \
        jm.KVCacheConfig(kind, page_size=8, max_draft_len=3)
    state = jm.init_state(cfg, jm.GroupSpec(2, 2, 64), num_pages=64, max_seqs=4, max_pages_per_seq=8)
    state = jm.admit(state, 0)
    slots = jnp.arange(2, dtype=jnp.int32)
    cases = dict(admit=(jm.admit, state, 1), release=(jm.release, state, 0), fork=(jm.fork, state, 0, 1),
                 accept=(jm.speculative.accept, state, slots, jnp.ones(2, jnp.int32), jnp.full(2, 3, jnp.int32)),
                 trim=(jm.speculative.trim, state), correct=(jm.speculative.correct_kv_lens, state,
                                                             jnp.zeros(4, jnp.int32)))
    for name, (fn, *args) in cases.items():
        assert _pool_sized_ops(fn, *args) == [], name


@pytest.mark.parametrize("kind", ["bf16", "mixed_nvfp4_bf16"])
def test_manager_and_prefix_transitions_keep_the_pool_arrays(kind):
    """`CacheManager` / `PrefixCache` admit, release and page-reference updates hand back the very pool arrays
    they were given (no program output, so no copy on any device), and `tables_only` refuses a pool change."""
    cfg = jm.KVCacheConfig(kind, first_n=4, last_n=16, page_size=8) if kind != "bf16" else \
        jm.KVCacheConfig(kind, page_size=8)
    m = jm.CacheManager(cfg, jm.GroupSpec(2, 2, 64), num_pages=64, max_seqs=4, max_pages_per_seq=8)
    pools = jax.tree.leaves(m.state.pools)
    same = lambda: all(a is b for a, b in zip(jax.tree.leaves(m.state.pools), pools, strict=True))  # noqa: E731
    slot = m.admit()
    assert same() and m.state.active[slot]
    m.release(slot)
    assert same() and not bool(m.state.active[slot])
    prefix = jm.PrefixCache(m.state, host_capacity_pages=0)
    tokens = np.arange(20, dtype=np.int32)
    prefix.admit(0, tokens)
    prefix.release(0)
    assert all(a is b for a, b in zip(jax.tree.leaves(prefix.manager.state.pools), pools, strict=True))

    def writes_pool(state, slot):
        return dataclasses.replace(state, pools=jax.tree.map(lambda x: x + 0 if x.ndim else x, state.pools))
    with pytest.raises(TypeError, match="writes_pool changed a pool"):
        jm.state.tables_only(writes_pool)(m.state, np.int32(0))
