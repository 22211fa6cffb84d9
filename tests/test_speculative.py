"""Speculative decoding transitions (`jmixedkv.speculative`): draft layers, accept / correct_kv_lens, trim, the draft
swap, and docs/DESIGN.md §3 invariant 3 (speculative equivalence) as a hypothesis property against a state that appended
only the accepted tokens."""
import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from helpers import assert_bits_equal, assert_trees_bit_equal, poisoned_state

from jmixedkv import GroupSpec, KVCacheConfig, admit, append, init_state, release, rows_reference, stage_reference
from jmixedkv import nvfp4
from jmixedkv import speculative as spec
from jmixedkv.pools import LowPool, RowPool
from jmixedkv.state import write_slots

D_HEAD = 16
# (config, prefill chunk max): windows not page multiples, fp8 / fp16 twins, a plain (no twin) cache
# (each config costs one compile of append / accept / correct / stage: keep the list short)
CONFIGS = [
    KVCacheConfig("mixed_nvfp4_bf16", first_n=3, last_n=5, page_size=4, max_draft_len=3, speculative_mode="mtp"),
    KVCacheConfig("mixed_nvfp4_fp8", first_n=9, last_n=7, page_size=8, max_draft_len=5, speculative_mode="eagle"),
]
MAX_STEPS = 6


def _tseq(cfg):
    return max(cfg.max_draft_len + 1, 2 * cfg.page_size + 1)


_accept = jax.jit(spec.accept)
_correct = jax.jit(spec.correct_kv_lens)
_stage = jax.jit(stage_reference, static_argnames=("group",))
_rows = jax.jit(rows_reference, static_argnames=("group",))


def _put(state, k, v, seq, pos, group=0, width=None):
    """Jitted append padded to ``width`` tokens (default the property's shape, so compiles are shared)."""
    width = width or 2 * _tseq(state.config)
    seq, pos = np.asarray(seq), np.asarray(pos)
    pad = width - seq.shape[0]
    lead = k.shape[:-3]
    padrows = lambda x: jnp.concatenate([jnp.asarray(x, jnp.float32),  # noqa: E731
                                         jnp.zeros(lead + (pad,) + x.shape[-2:], jnp.float32)], axis=-3)
    layer = jnp.int32(0) if not lead else None
    return append(state, layer, padrows(k), padrows(v), jnp.asarray(np.pad(seq, (0, pad), constant_values=-1),
                  jnp.int32), jnp.asarray(np.pad(pos, (0, pad)), jnp.int32), group=group)


def _fresh(cfg, seed, num_seqs=2, groups=None):
    """Empty admitted slots of a `poisoned_state` with room for ``MAX_STEPS`` steps (global scale 1, FP8 scale 0.5:
    states built with different seeds read alike)."""
    mp = -(-MAX_STEPS * _tseq(cfg) // cfg.page_size) + 2
    return poisoned_state(cfg, groups or [GroupSpec(1, 1, D_HEAD)], [], num_seqs=num_seqs, width=mp,
                          num_pages=num_seqs * mp + 2, seed=seed, gs=1.0, high_scale=0.5)


def _assert_same_readable(a, b, num_seqs=2, group=0):
    np.testing.assert_array_equal(np.asarray(a.kv_lens), np.asarray(b.kv_lens))
    seq = jnp.arange(num_seqs, dtype=jnp.int32)
    sa, sb = _stage(a, 0, seq, group=group), _stage(b, 0, seq, group=group)
    assert_bits_equal(sa, sb)
    assert not np.isnan(np.asarray(sa, np.float32)).any()


def run_plan(cfg, plan, seed, overlap):
    """plan: list of steps; a step is one action per sequence: ("v", k, a) verify k drafts accept a, or ("p", c).

    Runs the speculative state (all k + 1 rows appended in one mixed batch, then accept / correct) beside a
    reference that appends only the accepted rows, checking invariant 3 after every step."""
    rng = np.random.default_rng(seed)
    sp, ref = _fresh(cfg, seed), _fresh(cfg, seed + 1)
    tseq, n = _tseq(cfg), np.zeros(2, np.int64)
    for step in plan:
        t = 2 * tseq
        seq_s, pos_s, seq_r = np.full(t, -1), np.zeros(t), np.full(t, -1)
        acc_seq, acc_a, acc_k = np.full(2, -1), np.zeros(2), np.zeros(2)
        for s, act in enumerate(step):
            m = act[1] + 1 if act[0] == "v" else act[1]
            keep = act[2] + 1 if act[0] == "v" else act[1]
            lo = s * tseq
            seq_s[lo:lo + m] = s
            pos_s[lo:lo + m] = n[s] + np.arange(m)
            seq_r[lo:lo + keep] = s
            if act[0] == "v":
                acc_seq[s], acc_a[s], acc_k[s] = s, act[2], act[1]
            n[s] += keep
        k = jnp.asarray(rng.normal(size=(t, 1, D_HEAD)) * 3, jnp.float32)
        v = jnp.asarray(rng.normal(size=(t, 1, D_HEAD)), jnp.float32)
        i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
        sp = append(sp, jnp.int32(0), k, v, i32(seq_s), i32(pos_s))
        ref = append(ref, jnp.int32(0), k, v, i32(seq_r), i32(pos_s))
        if overlap:   # the host staged full acceptance; the device adds a - k <= 0 per slot
            off = np.zeros(2)
            off[acc_seq >= 0] = (acc_a - acc_k)[acc_seq >= 0]
            sp = _correct(sp, i32(off))
        else:
            sp = _accept(sp, i32(acc_seq), i32(acc_a), i32(acc_k))
        np.testing.assert_array_equal(np.asarray(sp.kv_lens), n)
        assert int(sp.error) == 0 and int(ref.error) == 0
        _assert_same_readable(sp, ref)
    return sp, ref


@st.composite
def plans(draw):
    ci = draw(st.integers(0, len(CONFIGS) - 1))
    cfg = CONFIGS[ci]
    dmax, cmax = cfg.max_draft_len, _tseq(cfg)

    def action():
        return st.one_of(
            st.integers(0, dmax).flatmap(lambda k: st.tuples(st.just("v"), st.just(k), st.integers(0, k))),
            st.tuples(st.just("p"), st.integers(1, cmax)))
    first = st.tuples(st.tuples(st.just("p"), st.integers(1, cmax)), action())
    steps = draw(st.lists(st.tuples(action(), action()), min_size=1, max_size=MAX_STEPS - 1))
    return ci, [draw(first)] + steps, draw(st.integers(0, 2 ** 16)), draw(st.booleans())


@settings(max_examples=30, deadline=None)
@given(plans())
def test_speculative_equivalence_property(case):
    ci, plan, seed, overlap = case
    run_plan(CONFIGS[ci], plan, seed, overlap)


EDGE_PLANS = [
    # page 4, last_n 5, D 3, ring R = 3: verify crosses page 8, reject all (rewind across the ring page)
    [(("p", 6), ("p", 1)), (("v", 3, 0), ("v", 3, 3)), (("v", 3, 1), ("v", 3, 0)), (("v", 3, 3), ("v", 2, 1)),
     (("v", 0, 0), ("p", 9))],
    # window partly overwritten by rejected drafts, then re-grown over the same ring slots
    [(("p", 8), ("p", 3)), (("v", 3, 0), ("v", 3, 0)), (("v", 3, 0), ("v", 3, 2)), (("v", 3, 3), ("v", 3, 3)),
     (("v", 3, 0), ("v", 1, 0))],
    # empty-ish sequences: verify from length 1 (inside first_n), rewind inside the fixed pages
    [(("p", 1), ("p", 2)), (("v", 3, 0), ("v", 3, 1)), (("v", 3, 2), ("v", 3, 0))],
]


@pytest.mark.parametrize("plan", EDGE_PLANS)
@pytest.mark.parametrize("overlap", [False, True])
def test_speculative_equivalence_edges(plan, overlap):
    sp, _ = run_plan(CONFIGS[0], plan, 7, overlap)
    # the twin is really in use: the last-N window reads the exact bf16 rows, not NVFP4
    cfg, n = CONFIGS[0], int(sp.kv_lens[0])
    pos = jnp.arange(max(0, n - cfg.last_n), n, dtype=jnp.int32)
    rows = _rows(sp, 0, jnp.zeros_like(pos), pos)
    hp = sp.high_table[0, cfg.twin.high_column(pos)]
    assert_bits_equal(rows, sp.pools[0].high.rows[0, hp, :, :, pos % cfg.page_size])


def test_accept_lengths_and_validation():
    cfg = CONFIGS[0]
    state = _fresh(cfg, 0)
    state = _put(state, jnp.ones((6, 1, D_HEAD)), jnp.ones((6, 1, D_HEAD)), [0] * 5 + [1],
                 [0, 1, 2, 3, 4, 0])                                            # n0 = 5, 1
    seq, pos = spec.verify_tokens(state, jnp.array([0, 1]), 4)                   # k = 3 drafts + verified token
    np.testing.assert_array_equal(np.asarray(pos), [5, 6, 7, 8, 1, 2, 3, 4])
    state = _put(state, jnp.ones((8, 1, D_HEAD)), jnp.ones((8, 1, D_HEAD)), seq, pos)
    assert state.kv_lens.tolist() == [9, 5]
    out = spec.accept(state, jnp.array([0, 1]), jnp.array([1, 3]), 3)
    assert out.kv_lens.tolist() == [5 + 1 + 1, 1 + 1 + 3]                        # n0 + 1 + num_accepted
    same = spec.correct_kv_lens(state, jnp.array([-2, 0], jnp.int32))
    assert same.kv_lens.tolist() == out.kv_lens.tolist()
    with pytest.raises(ValueError, match="num_accepted=4"):
        spec.accept(state, jnp.array([0, 1]), jnp.array([4, 0]), 3)
    with pytest.raises(ValueError, match="max_draft_len"):
        spec.accept(state, jnp.array([0, -1]), 0, 4)
    with pytest.raises(ValueError, match="distinct"):
        spec.accept(state, jnp.array([0, 0]), 0, 1)
    with pytest.raises(ValueError, match="slot 0: offset 1"):
        spec.correct_kv_lens(state, jnp.array([1, 0], jnp.int32))
    with pytest.raises(ValueError, match=r"slot 1: offset -4 \(allowed \[-3, 0\]\)"):
        spec.correct_kv_lens(state, jnp.array([0, -4], jnp.int32))
    with pytest.raises(ValueError, match="offsets must be i32"):
        spec.correct_kv_lens(state, jnp.array([0], jnp.int32))
    # traced: error bit set and nothing changes (all-or-nothing, jmixedkv.checks)
    bad = _correct(state, jnp.array([2, -9], jnp.int32))
    assert bad.kv_lens.tolist() == [9, 5] and int(bad.error) == spec.ERR_BAD_CORRECTION
    bad = _accept(state, jnp.array([0, 1]), jnp.array([5, -1]), jnp.array([3, 3]))
    assert bad.kv_lens.tolist() == [9, 5] and int(bad.error) & spec.ERR_BAD_CORRECTION
    # idle slot: nonzero offset is an error
    idle = release(state, 1)
    with pytest.raises(ValueError, match="slot 1"):
        spec.correct_kv_lens(idle, jnp.array([0, -1], jnp.int32))
    # host-staged positions corrected on the device equal positions read from the corrected lengths
    off = jnp.array([-2, -1], jnp.int32)
    staged = spec.verify_tokens(state, jnp.array([0, 1]), 4)[1]
    np.testing.assert_array_equal(np.asarray(spec.offset_positions(staged, seq, off)),
                                  np.asarray(spec.verify_tokens(spec.correct_kv_lens(state, off), jnp.array([0, 1]),
                                                                4)[1]))


def test_dynamic_tree_rejected():
    with pytest.raises(ValueError, match="dynamic-tree drafting relocates accepted KV rows"):
        KVCacheConfig("mixed_nvfp4_bf16", first_n=4, last_n=4, max_draft_len=3, speculative_mode="dynamic_tree")
    plain_tree = KVCacheConfig("bf16", page_size=4, max_draft_len=3, speculative_mode="dynamic_tree")
    state = _fresh(plain_tree, 0)
    for call in (lambda: spec.draft_config(plain_tree), lambda: spec.correct_kv_lens(state, jnp.zeros(2, jnp.int32)),
                 lambda: spec.accept(state, jnp.array([0]), 0, 0), lambda: spec.draft_view(state),
                 lambda: spec.verify_tokens(state, jnp.array([0]), 2),
                 lambda: spec.draft_group_spec(plain_tree, 1, 1, 16)):
        with pytest.raises(ValueError, match="dynamic_tree.*relocates accepted KV rows"):
            call()
    linear = _fresh(CONFIGS[0], 0)
    with pytest.raises(ValueError, match="draft tree.*twin"):
        spec.accept(linear, jnp.array([0]), 0, 0, draft_tree=jnp.array([-1, 0, 0]))


@pytest.mark.parametrize("dtype,want", [("mixed_nvfp4_bf16", "bf16"), ("mixed_nvfp4_fp16", "fp16"),
                                        ("mixed_nvfp4_fp8", "fp8"), ("fp8", "fp8"), ("bf16", "bf16"),
                                        ("fp16", "fp16"), ("nvfp4", "bf16")])
def test_draft_config_rule(dtype, want):
    mixed = dtype.startswith("mixed")
    cfg = KVCacheConfig(dtype, first_n=4 * mixed, last_n=4 * mixed, page_size=4, max_draft_len=2,
                        speculative_mode="eagle")
    assert spec.draft_dtype(cfg) == want
    dcfg = spec.draft_config(cfg)
    assert dcfg.dtype == want and not dcfg.is_mixed and not dcfg.has_low and dcfg.page_size == 4
    assert dcfg.max_draft_len == 2 and dcfg.num_high_pages_per_seq == 0 and dcfg.speculative_mode == "eagle"


@pytest.mark.parametrize("dtype,row_dtype", [("mixed_nvfp4_bf16", jnp.bfloat16),
                                             ("mixed_nvfp4_fp8", jnp.float8_e4m3fn)])
def test_appended_draft_layers_stay_plain(dtype, row_dtype):
    cfg = KVCacheConfig(dtype, first_n=4, last_n=4, page_size=4, max_draft_len=2)
    # appended to the target: a RowPool in the retained dtype, never a LowPool
    groups = [GroupSpec(2, 1, D_HEAD), spec.draft_group_spec(cfg, 1, 2, 32)]
    state = admit(init_state(cfg, groups, 8, 2, 4, poison=True), 0)
    assert state.kinds == ("mixed", "plain")
    pools = state.pools[1]
    assert pools.low is None and pools.high is None and isinstance(pools.plain, RowPool)
    assert isinstance(state.pools[0].low, LowPool)
    assert pools.plain.rows.dtype == row_dtype and pools.plain.rows.shape == (1, 8, 2, 2, 4, 32)
    k = jnp.asarray(np.random.default_rng(0).normal(size=(1, 5, 2, 32)), jnp.float32)
    out = append(state, None, k, k * 2, jnp.zeros(5, jnp.int32), jnp.arange(5, dtype=jnp.int32), group=1)
    for a, b in zip(jax.tree.leaves(out.pools[0]), jax.tree.leaves(state.pools[0])):
        assert_bits_equal(a, b)          # target layers untouched
    got = _rows(out, 0, jnp.zeros(5, jnp.int32), jnp.arange(5), group=1)
    want_rows = k[0].astype(row_dtype).astype(jnp.float32).astype(cfg.attention_dtype)   # scale 1.0
    assert_bits_equal(got[:, 0], want_rows)
    # a separate draft state: plain too
    dcfg = spec.draft_config(cfg)
    dstate = init_state(dcfg, spec.draft_group_spec(dcfg, 1, 1, D_HEAD), 8, 2)
    assert dstate.kinds == ("plain",) and dstate.pools[0].plain.rows.dtype == row_dtype
    assert dstate.pools[0].low is None and dstate.pools[0].high is None


def test_draft_group_spec_needs_row_dtype():
    cfg = KVCacheConfig("nvfp4", page_size=4, max_draft_len=2)
    with pytest.raises(ValueError, match="separate draft state.*'bf16'"):
        spec.draft_group_spec(cfg, 1, 1, 16)
    assert spec.draft_config(cfg).dtype == "bf16"
    with pytest.raises(ValueError, match="no plain draft cache dtype"):
        spec.draft_dtype(KVCacheConfig("nvfp4", compute_dtype="float32"))


def test_draft_swap_identity_and_isolation():
    cfg = CONFIGS[0]
    groups = [GroupSpec(1, 1, D_HEAD), spec.draft_group_spec(cfg, 1, 1, D_HEAD)]
    state = _fresh(cfg, 3, groups=groups)
    rng = np.random.default_rng(1)
    k = jnp.asarray(rng.normal(size=(7, 1, D_HEAD)), jnp.float32)
    state = _put(state, k, k, [0] * 7, np.arange(7))
    view = spec.draft_view(state)
    assert view.kinds == ("low", "plain") and view.pools[0].high is None and view.high_table.shape == (2, 0)
    assert_trees_bit_equal(spec.restore(state, view), state)                       # identity, every leaf bit-equal
    assert spec.restore(state, view).kinds == state.kinds
    # through the view: no twin store (high slots all -1), reads are pure NVFP4 (no overlay)
    s, p = spec.verify_tokens(view, jnp.array([0]), 4)
    assert (np.asarray(jax.jit(write_slots)(view, s, p)[1]) == -1).all()
    pos = jnp.arange(7)
    seen = _rows(view, 0, jnp.zeros(7, jnp.int32), pos)
    lp = state.page_table[0, pos // 4]
    low = state.pools[0].low
    want = nvfp4.dequantize_reference(low.data[0, lp, :, :, pos % 4], low.scales[0, lp, :, :, pos % 4],
                            low.gs[0][:, None], cfg.attention_dtype)
    assert_bits_equal(seen, want)
    # a draft forward through the view writes the draft layers only; restore gives the twin back unchanged
    dk = jnp.asarray(rng.normal(size=(1, 4, 1, D_HEAD)), jnp.float32)
    view = _put(view, dk, dk, s, p, group=1)
    back = spec.restore(state, view)
    assert_trees_bit_equal(back.pools[0], state.pools[0])
    assert_trees_bit_equal((back.high_table, back.high_alloc), (state.high_table, state.high_alloc))
    assert back.kv_lens.tolist() == [11, 0] and back.kinds == state.kinds
    got = _rows(back, 0, jnp.zeros(4, jnp.int32), p, group=1)
    assert_bits_equal(got[:, 0], dk[0].astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="draft_view"):
        spec.restore(state, state)


def test_accept_keeps_pages_trim_releases():
    cfg = CONFIGS[0]                                     # page 4, D 3
    state = _fresh(cfg, 5)
    total = state.alloc.num_pages
    ones = lambda t: jnp.ones((t, 1, D_HEAD), jnp.float32)  # noqa: E731
    state = _put(state, ones(6), ones(6), [0] * 6, np.arange(6))                                  # pages 0, 1
    s, p = spec.verify_tokens(state, jnp.array([0]), 4)                                         # 6..9: page 2
    state = _put(state, ones(4), ones(4), s, p)
    extra = int(state.page_table[0, 2])
    assert extra >= 0 and int(state.alloc.refcount[extra]) == 1
    free_before = int(state.alloc.num_free)
    state = spec.accept(state, jnp.array([0]), 0, 3)                                            # n = 7: page 2 unused
    assert int(state.kv_lens[0]) == 7 and int(state.page_table[0, 2]) == extra
    assert int(state.alloc.refcount[extra]) == 1 and int(state.alloc.num_free) == free_before
    used = int((np.asarray(state.alloc.refcount) > 0).sum())
    assert used + int(state.alloc.num_free) == total
    nxt = _put(state, ones(4), ones(4), *spec.verify_tokens(state, jnp.array([0]), 4))          # reuses page 2
    assert int(nxt.alloc.num_free) == free_before and int(nxt.page_table[0, 2]) == extra
    # trim: pages wholly past ceil(n / page) are released (here none: 7 -> pages 0, 1; page 2 goes)
    trimmed = spec.trim(state)
    assert int(trimmed.page_table[0, 2]) == -1 and int(trimmed.alloc.refcount[extra]) == 0
    assert int(trimmed.alloc.num_free) == free_before + 1
    assert int(trimmed.page_table[0, 1]) >= 0
    _assert_same_readable(trimmed, state)
    # shared page (refcount 2) survives a trim with one reference left; trimming an exact page multiple keeps all
    from jmixedkv.allocator import retain_pages
    shared = dataclasses.replace(state, alloc=retain_pages(state.alloc, jnp.array([extra])))
    assert int(spec.trim(shared, jnp.array([0])).alloc.refcount[extra]) == 1
    # a second rewind would accumulate past max_draft_len (written = 10, n = 7 -> 4 < 10 - 3): refused
    with pytest.raises(ValueError, match=r"slot 0: offset -3 \(allowed \[0, 0\]\)"):
        spec.correct_kv_lens(state, jnp.array([-3, 0], jnp.int32))
    seven = _put(_fresh(cfg, 5), ones(7), ones(7), [0] * 7, np.arange(7))                      # written = 7
    exact = spec.correct_kv_lens(seven, jnp.array([-3, 0], jnp.int32))                      # n = 4
    assert (np.asarray(spec.trim(exact).page_table[0, :3]) >= 0).tolist() == [True, False, False]
    # release returns everything
    gone = release(release(spec.trim(state), 0), 1)
    assert int(gone.alloc.num_free) == total and int(np.asarray(gone.alloc.refcount).sum()) == 0


def test_jitted_speculative_loop_compiles_once():
    cfg = KVCacheConfig("mixed_nvfp4_bf16", first_n=4, last_n=6, page_size=8, max_draft_len=3, speculative_mode="mtp")
    kd = 3
    t = kd + 1
    groups = [GroupSpec(1, 1, D_HEAD), spec.draft_group_spec(cfg, 1, 1, D_HEAD)]
    mk = lambda: admit(admit(init_state(cfg, groups, 128, 2, 64, poison=True), 0), 1)  # noqa: E731
    state, ref = mk(), mk()
    seq = jnp.array([0, 1], jnp.int32)

    def rows(key):
        kdr, kt = jax.random.split(key)
        return (jax.random.normal(kdr, (1, 2 * t, 1, D_HEAD)),
                jax.random.normal(kt, (2, 2 * t, 1, D_HEAD)) * 2)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(state, key, a, pending):
        # slot 0 accepts synchronously; slot 1 runs the overlap scheduler: its correction lands next step
        state = spec.correct_kv_lens(state, pending)
        s, p = spec.verify_tokens(state, seq, t)
        dk, tk = rows(key)
        view = spec.draft_view(state)                                   # draft forward: twin off
        view = append(view, None, dk, dk, s, p, group=1)
        state = spec.restore(state, view)                               # twin back
        state = append(state, 0, tk[0], tk[1], s, p)              # verify k + 1 rows
        state = spec.accept(state, seq, jnp.stack([a[0], kd]), kd)
        return state, jnp.zeros(2, jnp.int32).at[1].set(a[1] - kd)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def ref_step(ref, key, a):
        s, p = spec.verify_tokens(ref, seq, t)
        _, tk = rows(key)
        s = jnp.where(jnp.arange(2 * t) % t <= a[s], s, -1)             # only the accepted rows
        return append(ref, 0, tk[0], tk[1], s, p)

    keys = jax.random.split(jax.random.key(0), 100)
    acc = np.random.default_rng(0).integers(0, kd + 1, (100, 2)).astype(np.int32)
    pending = jnp.zeros(2, jnp.int32)
    for i in range(100):
        state, pending = step(state, keys[i], jnp.asarray(acc[i]), pending)
        ref = ref_step(ref, keys[i], jnp.asarray(acc[i]))
    state = spec.correct_kv_lens(state, pending)
    assert state.kv_lens.tolist() == (100 + acc.sum(0)).tolist()
    assert int(state.error) == 0 and int(ref.error) == 0
    _assert_same_readable(state, ref)


def test_manager_accept_updates_host_mirror():
    from jmixedkv import CacheManager
    cfg = CONFIGS[0]
    m = CacheManager(cfg, GroupSpec(1, 1, D_HEAD), 12, 2, 6, backend="reference")
    m.admit(0)
    ones = jnp.ones((7, 1, D_HEAD), jnp.float32)
    m.append(0, ones, ones, np.zeros(7, np.int32), np.arange(7))            # n0 = 7
    m.append(0, ones[:4], ones[:4], np.zeros(4, np.int32), np.arange(7, 11))  # verified token + 3 drafts
    assert m.kv_len(0) == 11 and m.free_pages == 12 - 3
    m.accept([0], [0], [3])                                                        # keep pages
    assert m.kv_len(0) == 8 and m.free_pages == 12 - 3
    m.accept([0], [0], [0], trim_pages=True)                                       # no rewind, drop page 2
    assert m.kv_len(0) == 8 and m.free_pages == 12 - 2
    assert m.pages_needed([0] * 4, np.arange(8, 12)) == {0: 1}
    with pytest.raises(ValueError, match="num_accepted=2"):
        m.accept([0], [2], [1])
    m.check()


@pytest.mark.gpu
def test_speculative_equivalence_gpu():
    """On the H200: the same equivalence with ``backend="auto"`` (the Pallas write kernel) for every edge plan."""
    assert jax.default_backend() == "gpu"
    for cfg in CONFIGS:
        for plan in EDGE_PLANS:
            run_plan(cfg, plan, 11, overlap=False)
            run_plan(cfg, plan, 12, overlap=True)
    test_readers_follow_corrected_lengths("pallas")
    test_jitted_speculative_loop_compiles_once()


def test_error_bit_is_named():
    from jmixedkv import describe_error
    assert "bad speculative length correction" in describe_error(spec.ERR_BAD_CORRECTION)


def test_readers_follow_corrected_lengths(backend="pallas"):
    """stage, gather_rows and the fused decode (Pallas kernels; interpret mode on CPU) on a rewound state equal the
    same readers on the state that appended only the accepted tokens. (The reference readers are
    `stage_reference` / `rows_reference`, covered by the property above.)"""
    from jmixedkv.decode import decode_attention
    from jmixedkv.gather import gather_rows
    from jmixedkv.staging import stage
    sp, ref = run_plan(CONFIGS[0], EDGE_PLANS[0][:3], 5, overlap=True)          # last step rewinds both slots
    seq = jnp.arange(2, dtype=jnp.int32)
    a, b = stage(sp, 0, seq, backend=backend), stage(ref, 0, seq, backend=backend)
    np.testing.assert_array_equal(np.asarray(a.kv_lens), np.asarray(b.kv_lens))
    assert_bits_equal(a.to_dense(), b.to_dense())
    n = np.asarray(sp.kv_lens)
    raw = np.stack([np.arange(8), np.arange(8)[::-1] + 2])
    with pytest.raises(ValueError, match=f"kv_len {n[1]}"):                    # a rejected draft's row: refused
        gather_rows(sp, 0, seq, jnp.asarray(raw, jnp.int32), backend=backend)
    idx = jnp.asarray(np.where(raw < n[:, None], raw, -1), jnp.int32)
    ga, gb = (gather_rows(s, 0, seq, idx, backend=backend) for s in (sp, ref))
    assert_trees_bit_equal(ga, gb)
    q = jnp.asarray(np.random.default_rng(0).normal(size=(2, 2, 2, D_HEAD)), CONFIGS[0].attention_dtype)
    (oa, la), (ob, lb) = (decode_attention(s, 0, q, seq, backend=backend) for s in (sp, ref))
    assert_bits_equal(oa, ob)
    np.testing.assert_array_equal(np.asarray(la), np.asarray(lb))


# ------------------------------------------------------------------------------------------- unjustified rewinds
# accept / correct_kv_lens must be justified by the state: a verify block of exactly k + 1 rows that every layer
# wrote, not a prefill chunk, not between two layers' appends, not accepted already.
CFG_J = KVCacheConfig("mixed_nvfp4_bf16", first_n=2, last_n=4, page_size=4, max_draft_len=2)


def _two_layers(chunk=5, layers=(0, 1)):
    """Slot 0: a prefill chunk of ``chunk`` rows on both layers, then a verify block [chunk, chunk + 2] (k = 2)
    written by ``layers``; slot 1: 3 rows (the bystander)."""
    state = init_state(CFG_J, GroupSpec(2, 1, D_HEAD), num_pages=16, max_seqs=2)
    state = admit(admit(state, 0), 1)
    k = jnp.ones((2, chunk, 1, D_HEAD), jnp.float32)
    state = append(state, None, k, k, np.zeros(chunk, np.int32), np.arange(chunk))
    state = append(state, None, k[:, :3], k[:, :3], np.ones(3, np.int32), np.arange(3))
    for layer in layers:
        kk = jnp.full((3, 1, D_HEAD), 2.0 + layer, jnp.float32)
        state = append(state, layer, kk, kk, np.zeros(3, np.int32), chunk + np.arange(3))
    assert int(state.error) == 0
    return state


def _refused(state, fn, match):
    """Host values: `ValueError` matching ``match``; traced: ERR_BAD_CORRECTION and every other leaf unchanged."""
    with pytest.raises(ValueError, match=match):
        fn(state, host=True)
    out = fn(state, host=False)
    assert int(out.error) == spec.ERR_BAD_CORRECTION
    assert_trees_bit_equal(dataclasses.replace(out, error=state.error), state)


def _accept_fn(k, a):
    return lambda s, host: (spec.accept(s, np.array([0]), np.array([a]), np.array([k])) if host else
                            _accept(s, jnp.array([0]), jnp.array([a]), jnp.array([k])))


def _correct_fn(off):
    return lambda s, host: (spec.correct_kv_lens(s, np.array([off, 0], np.int32)) if host else
                            _correct(s, jnp.array([off, 0], jnp.int32)))


def test_accept_between_two_layers_of_one_verify_step_is_refused():
    state = _two_layers(layers=(0,))                     # layer 1 has not appended the verify block yet
    _refused(state, _accept_fn(2, 0), "between two layers")
    _refused(state, _correct_fn(-1), "between two layers")
    done = append(state, 1, jnp.ones((3, 1, D_HEAD)), jnp.ones((3, 1, D_HEAD)), np.zeros(3, np.int32),
                  5 + np.arange(3))
    out = spec.accept(done, np.array([0]), np.array([0]), np.array([2]))
    assert int(out.error) == 0 and np.asarray(out.kv_lens).tolist() == [6, 3]


def test_accept_right_after_a_prefill_chunk_is_refused():
    state = _two_layers(layers=())                       # the last step of slot 0 is its 5-row prefill chunk
    _refused(state, _accept_fn(2, 0), "verify block of 3 rows")
    assert int(spec.accept(state, np.array([0]), np.array([2]), np.array([2])).error) == 0   # no rewind: fine


def test_accept_twice_is_refused():
    state = spec.accept(_two_layers(), np.array([0]), np.array([1]), np.array([2]))
    assert int(state.error) == 0 and int(state.kv_lens[0]) == 7
    _refused(state, _accept_fn(2, 0), "no open append step")


def test_rewinds_within_the_floor_still_work_after_accept():
    """A rewind the floor allows (written - max_draft_len) stays legal after accept: HF's crop, a fork's rewind."""
    state = spec.accept(_two_layers(), np.array([0]), np.array([2]), np.array([2]))     # kv_len 8, written 8
    out = spec.correct_kv_lens(state, np.array([-2, 0], np.int32))
    assert int(out.error) == 0 and int(out.kv_lens[0]) == 6
    _refused(state, _correct_fn(-3), "offset -3")


def test_torch_correct_kv_lens_refuses_duplicate_slots():
    from interop.torch_cache import TorchKVCache
    cache = TorchKVCache(CFG_J, 1, 1, D_HEAD, num_pages=8, max_seqs=2, backend="reference")
    with pytest.raises(ValueError, match=r"slots \[1\] more than once"):
        cache.correct_kv_lens(np.array([-1, -1]), np.array([1, 1]))


def test_torch_reserve_null_page_needs_a_usable_page():
    from interop.torch_cache import TorchKVCache
    with pytest.raises(ValueError, match="num_pages=1, leaving no usable page"):
        TorchKVCache(CFG_J, 1, 1, D_HEAD, num_pages=1, max_seqs=1, backend="reference", reserve_null_page=True)
