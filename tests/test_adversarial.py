"""Bad input never touches another sequence: every public transition and reader, fed out-of-range
slots, layers, page ids and positions, either raises `ValueError` (host values) or sets its error bit / returns a
flagged (NaN) result inside jit -- and every other sequence stays bitwise unchanged (raw table / pool bytes and
staged bytes compared), on the reference and the Pallas (interpret mode on CPU) backends.

Rule and bits: `jmixedkv.checks`."""
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmixedkv as jm
from helpers import assert_trees_bit_equal, bits, poisoned_state
from jmixedkv import checks, offload, speculative as sp
from jmixedkv.checks import (ERR_BAD_CORRECTION, ERR_BAD_LAYER, ERR_BAD_PAGE, ERR_BAD_POSITION, ERR_BAD_SLOT,
                             ERR_SHARED_PAGE)

L, H, D, S = 2, 2, 32, 4
CFG = jm.KVCacheConfig("mixed_nvfp4_bf16", first_n=3, last_n=5, page_size=4, max_draft_len=2)
LENS = (9, 14, 5)        # slots 0..2 filled, slot 3 free
BACKENDS = ["reference", "pallas"]

_stage_all = jax.jit(lambda st: jnp.stack([jm.stage_reference(st, l, jnp.arange(S, dtype=jnp.int32))
                                           for l in range(L)]))


def _rows(rng, n, layers=L):
    return jnp.asarray(rng.normal(size=(layers, n, H, D)), jnp.bfloat16)


def _k_2k(rng, shape, dtype):
    k = jnp.asarray(rng.normal(size=shape), dtype)
    return k, k * 2


@functools.lru_cache(maxsize=None)
def _filled_cached():
    """`poisoned_state` of LENS in slots 0..2 (V = 2 K), slot 3 free; 24 low pages, tables 8 wide."""
    return jax.device_get(poisoned_state(CFG, jm.GroupSpec(L, H, D), LENS, num_seqs=S, width=8, num_pages=24,
                                         idle=(3,), rows=_k_2k))


def filled():
    return jax.tree.map(jnp.asarray, _filled_cached())


def staged(state):
    return np.asarray(_stage_all(state)).view(np.uint8)            # [L, S, kv, H, Smax, D] bytes


def raw_bytes(x):
    return np.asarray(x).view(np.uint8)


def assert_refused(before, after, bit):
    """The error bit is set and every leaf but ``error`` is bitwise unchanged (all-or-nothing)."""
    code = int(after.error)
    assert code & bit, f"expected {checks.describe_error(bit)}, got {checks.describe_error(code)}"
    assert_trees_bit_equal(dataclasses.replace(after, error=before.error), before)


def assert_others_unchanged(before, after, touched):
    """Slots not in ``touched``: table rows, lengths and staged bytes unchanged."""
    a, b = staged(before), staged(after)
    for s in range(S):
        if s in touched:
            continue
        np.testing.assert_array_equal(a[:, s], b[:, s], err_msg=f"slot {s} staged bytes changed")
        for f in ("page_table", "high_table", "kv_lens", "active", "written"):
            np.testing.assert_array_equal(raw_bytes(getattr(before, f))[s], raw_bytes(getattr(after, f))[s],
                                          err_msg=f"slot {s} {f} changed")


def jit_append(state, k, v, seq, pos, layer=None, backend="reference"):
    return jm.append(state, None if layer is None else jnp.int32(layer), k, v, jnp.asarray(seq, jnp.int32),
                     jnp.asarray(pos, jnp.int32), backend=backend)


# ------------------------------------------------------------------------------------------------ append
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["slot_past_end", "slot_minus_2", "old_position", "gap", "duplicate",
                                  "negative_position", "rewrite_short_of_end", "mixed_batch_one_bad",
                                  "inactive_slot"])
def test_append_refusals_inside_jit(case, backend):
    state = filled()
    rng = np.random.default_rng(5)
    seq, pos, bit = {
        "slot_past_end": ([S], [0], ERR_BAD_SLOT),                     # used to write into slot S-1's pages
        "slot_minus_2": ([-2], [0], ERR_BAD_SLOT),
        "old_position": ([1], [2], ERR_BAD_POSITION),                  # re-append far below kv_len (14)
        "gap": ([0], [LENS[0] + 1], ERR_BAD_POSITION),
        "duplicate": ([2, 2], [5, 5], ERR_BAD_POSITION),
        "negative_position": ([0], [-3], ERR_BAD_POSITION),
        "rewrite_short_of_end": ([1, 1], [11, 12], ERR_BAD_POSITION),  # kv_len 14: stops before 13
        "mixed_batch_one_bad": ([0, 1], [LENS[0], 3], ERR_BAD_POSITION),
        "inactive_slot": ([3], [0], ERR_BAD_SLOT),
    }[case]
    k = _rows(rng, len(seq))
    after = jit_append(state, k, k, seq, pos, backend=backend)
    assert_refused(state, after, bit)


@pytest.mark.parametrize("backend", BACKENDS)
def test_append_bad_traced_layer_writes_nothing_and_keeps_lengths(backend):
    state = filled()
    k = _rows(np.random.default_rng(1), 1, layers=1)[0]
    after = jit_append(state, k, k, [0], [LENS[0]], layer=7, backend=backend)
    assert_refused(state, after, ERR_BAD_LAYER)
    after = jit_append(state, k, k, [0], [LENS[0]], layer=-1, backend=backend)
    assert_refused(state, after, ERR_BAD_LAYER)


def test_append_host_values_raise_naming_the_value():
    state = filled()
    k = _rows(np.random.default_rng(1), 1)
    with pytest.raises(ValueError, match=r"seq_slots\[0\]=4 out of range \[-1, 4\)"):
        jm.append(state, None, k, k, [S], [0], backend="reference")
    with pytest.raises(ValueError, match=r"positions\[0\]=4294967298 out of range"):
        jm.append(state, None, k, k, [0], np.array([2 ** 32 + 2], np.int64), backend="reference")
    with pytest.raises(ValueError, match="seq_slots must be integers, got dtype float"):
        jm.append(state, None, k, k, [0.0], [9], backend="reference")
    with pytest.raises(ValueError, match=r"positions\[0\]=-1 is negative"):
        jm.append(state, None, k, k, [0], [-1], backend="reference")
    with pytest.raises(ValueError, match=r"layer=7 out of range \[0, 2\)"):
        jm.append(state, 7, k[0], k[0], [0], [9], backend="reference")
    with pytest.raises(ValueError, match="integer array"):
        jm.append(state, None, k, k, jnp.array([0.0]), jnp.array([9]), backend="reference")


@pytest.mark.parametrize("backend", BACKENDS)
def test_legal_rewrites_per_layer_and_suffix(backend):
    """Positive control: the rule admits per-layer appends of the same tokens and suffix rewrites."""
    state = filled()
    rng = np.random.default_rng(3)
    k0, k1 = _rows(rng, 3, 1)[0], _rows(rng, 3, 1)[0]
    st1 = jit_append(state, k0, k0, [2, 2, 2], [5, 6, 7], layer=0, backend=backend)
    st2 = jit_append(st1, k1, k1, [2, 2, 2], [5, 6, 7], layer=1, backend=backend)
    assert int(st2.error) == 0 and int(st2.kv_lens[2]) == 8 and int(st2.written[2]) == 8
    assert_others_unchanged(state, st2, touched={2})
    # a suffix rewrite reaching kv_len - 1 (re-verification) rewrites low and twin rows together
    k2 = _rows(rng, 2)
    st3 = jit_append(st2, k2, k2, [2, 2], [6, 7], backend=backend)
    assert int(st3.error) == 0 and int(st3.kv_lens[2]) == 8
    got = np.asarray(jm.stage_reference(st3, 1, jnp.array([2], jnp.int32)))[0, 0, :, 6:8]
    want = np.asarray(jnp.swapaxes(k2[1], 0, 1)).astype(np.float32)         # retained (last_n=5): the twin rows
    np.testing.assert_array_equal(bits(got), bits(jnp.asarray(want, jnp.bfloat16)))
    assert_others_unchanged(st2, st3, touched={2})


@pytest.mark.parametrize("backend", BACKENDS)
def test_append_into_page_shared_by_fork_is_refused(backend):
    state = filled()
    forked = jax.jit(jm.fork)(state, 1, 3)          # slot 3 shares slot 1's full pages 0..2
    assert int(forked.error) == 0
    k = _rows(np.random.default_rng(4), 14)
    # dst rewrites its whole history (a suffix reaching kv_len, legal by position) -> shared pages: refused
    after = jit_append(forked, k, k, [3] * 14, list(range(14)), backend=backend)
    assert_refused(forked, after, ERR_SHARED_PAGE)
    # source too: its full pages are shared with the fork
    after = jit_append(forked, k, k, [1] * 14, list(range(14)), backend=backend)
    assert_refused(forked, after, ERR_SHARED_PAGE)
    # appending from kv_len is fine for both (partial last page was copied at fork time)
    k1 = _rows(np.random.default_rng(5), 2)
    ok = jit_append(forked, k1, k1, [1, 3], [14, 14], backend=backend)
    assert int(ok.error) == 0
    assert_others_unchanged(forked, ok, touched={1, 3})


# ------------------------------------------------------------------------------------------------ admit / release
def test_admit_release_out_of_range():
    state = filled()
    for fn in (jm.admit, jm.release):
        for bad in (S, 100, -2):
            assert_refused(state, jax.jit(fn)(state, bad), ERR_BAD_SLOT)
            with pytest.raises(ValueError, match=f"seq_slot={bad} out of range"):
                fn(state, bad)
        assert_trees_bit_equal(jax.jit(fn)(state, -1), state)      # -1 = no-op
    with pytest.raises(ValueError, match="must be an integer"):
        jm.admit(state, 1.0)


# ------------------------------------------------------------------------------------------------ fork / prefix
@pytest.mark.parametrize("src,dst", [(0, S), (0, -5), (S, 3), (7, 3), (0, 0), (0, 1), (3, 0)])
def test_fork_bad_slots(src, dst):
    state = filled()
    after = jax.jit(jm.fork)(state, src, dst)
    assert_refused(state, after, ERR_BAD_SLOT)
    if not (-1 <= src < S and -1 <= dst < S):
        with pytest.raises(ValueError, match="out of range"):
            jm.fork(state, src, dst)


def test_fork_minus_one_is_a_noop():
    state = filled()
    for src, dst in ((0, -1), (-1, 3)):
        assert_trees_bit_equal(jax.jit(jm.fork)(state, src, dst), state)


def _prefix_args(state, slot=1, pages=2):
    row = np.asarray(state.page_table)[slot].copy()
    low = np.full_like(row, -1)
    low[:pages] = row[:pages]
    fixed = np.full((CFG.num_fixed_pages,), -1, np.int32)
    return low, fixed, pages * CFG.page_size


@pytest.mark.parametrize("case", ["slot_out_of_range", "slot_active", "page_out_of_range", "page_free",
                                  "page_twice", "length_past_pages", "hole_in_pages", "fixed_partial"])
def test_admit_with_prefix_refusals(case):
    state = filled()
    low, fixed, length = _prefix_args(state)
    slot = 3
    free_page = int(np.asarray(state.alloc.free)[0])
    bit = ERR_BAD_PAGE
    if case == "slot_out_of_range":
        slot, bit = S + 2, ERR_BAD_SLOT
    elif case == "slot_active":
        slot, bit = 0, ERR_BAD_SLOT
    elif case == "page_out_of_range":
        low[0] = 999
    elif case == "page_free":
        low[0] = free_page
    elif case == "page_twice":
        low[1] = low[0]
    elif case == "length_past_pages":
        length = 3 * CFG.page_size
    elif case == "hole_in_pages":
        low[0] = -1
    elif case == "fixed_partial":
        fixed[0] = int(np.asarray(state.high_table)[1, 0])
        length = 2
        low[1] = -1
    after = jax.jit(jm.admit_with_prefix)(state, jnp.int32(slot), jnp.asarray(low), jnp.asarray(fixed),
                                          jnp.int32(length))
    assert_refused(state, after, bit)


def test_admit_with_prefix_host_values_raise():
    state = filled()
    low, fixed, length = _prefix_args(state)
    with pytest.raises(ValueError, match="seq_slot=9 out of range"):
        jm.admit_with_prefix(state, 9, low, fixed, length)
    bad = low.copy()
    bad[0] = 999
    with pytest.raises(ValueError, match=r"low_pages\[0\]=999 out of range"):
        jm.admit_with_prefix(state, 3, bad, fixed, length)
    with pytest.raises(ValueError, match="length=1000 out of range"):
        jm.admit_with_prefix(state, 3, low, fixed, 1000)
    ok = jm.admit_with_prefix(state, 3, low, fixed, length)
    assert int(ok.error) == 0 and int(ok.written[3]) == length
    assert_others_unchanged(state, ok, touched={3})


@pytest.mark.parametrize("case", ["dst_shared", "dst_out_of_range", "src_out_of_range", "dst_twice"])
def test_copy_and_scatter_pages_refusals(case):
    from jmixedkv.prefix import copy_pages
    state = jax.jit(jm.fork)(filled(), 1, 3)
    row = np.asarray(state.page_table)[1]
    src, dst, bit = {
        "dst_shared": ([int(row[3])], [int(row[0])], ERR_SHARED_PAGE),
        "dst_out_of_range": ([int(row[0])], [50], ERR_BAD_PAGE),
        "src_out_of_range": ([-7], [int(row[3])], ERR_BAD_PAGE),
        "dst_twice": ([int(row[0]), int(row[1])], [int(row[3]), int(row[3])], ERR_BAD_PAGE),
    }[case]
    none = jnp.full((len(src),), -1, jnp.int32)
    after = jax.jit(copy_pages)(state, jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32), none, none)
    assert_refused(state, after, bit)
    if case != "src_out_of_range":
        payload = offload.gather_pages(state, jnp.asarray([max(s, 0) for s in src], jnp.int32), none)
        after = jax.jit(offload.scatter_pages)(state, jnp.asarray(dst, jnp.int32), none, payload)
        assert_refused(state, after, bit)


def test_gather_pages_bad_ids_are_poisoned_not_another_page():
    state = filled()
    payload = jax.jit(offload.gather_pages)(state, jnp.array([99, -3], jnp.int32), jnp.array([-9, 500], jnp.int32))
    for group in payload:
        for name, arr in group.items():
            a = np.asarray(arr)
            if a.dtype == np.uint8:
                assert (a == 0x77).all(), name
            else:
                assert np.isnan(a.astype(np.float32)).all(), name
    with pytest.raises(ValueError, match=r"low_ids\[0\]=99 out of range"):
        offload.gather_pages(state, [99], [0])


# ------------------------------------------------------------------------------------------------ speculative
def test_trim_padding_and_out_of_range():
    state = filled()
    assert_trees_bit_equal(jax.jit(sp.trim)(state, jnp.array([-1], jnp.int32)), state)   # used to trim slot S-1
    assert_refused(state, jax.jit(sp.trim)(state, jnp.array([S], jnp.int32)), ERR_BAD_SLOT)
    assert_refused(state, jax.jit(sp.trim)(state, jnp.array([0, -4], jnp.int32)), ERR_BAD_SLOT)
    with pytest.raises(ValueError, match=r"seq_slots\[0\]=4 out of range"):
        sp.trim(state, [S])


def test_rewinds_cannot_accumulate_past_written_minus_draft_len():
    state = filled()
    off = np.zeros(S, np.int32)
    off[1] = -2                                    # max_draft_len = 2: 14 -> 12 is fine
    once = sp.correct_kv_lens(state, jnp.asarray(off))
    assert int(once.error) == 0 and int(once.kv_lens[1]) == 12
    correct = jax.jit(sp.correct_kv_lens)
    twice = correct(once, jnp.asarray(off))                  # 12 -> 10 < written (14) - 2: refused
    assert_refused(once, twice, ERR_BAD_CORRECTION)
    with pytest.raises(ValueError, match=r"slot 1: offset -2 \(allowed \[0, 0\]\)"):
        sp.correct_kv_lens(once, off)                        # concrete: checked on the host
    # positive offsets, idle slots
    for slot, o in ((3, -1), (0, 1)):
        off = np.zeros(S, np.int32)
        off[slot] = o
        assert_refused(state, correct(state, jnp.asarray(off)), ERR_BAD_CORRECTION)


def test_accept_bad_slots_inside_jit():
    state = filled()
    acc = jax.jit(sp.accept)
    assert_refused(state, acc(state, jnp.array([S], jnp.int32), jnp.array([0]), jnp.array([0])), ERR_BAD_SLOT)
    assert_refused(state, acc(state, jnp.array([1, 1], jnp.int32), jnp.array([0, 0]), jnp.array([1, 1])),
                   ERR_BAD_SLOT)
    assert_refused(state, acc(state, jnp.array([1], jnp.int32), jnp.array([0]), jnp.array([5])), ERR_BAD_CORRECTION)


# ------------------------------------------------------------------------------------------------ init_state
@pytest.mark.parametrize("kwargs,match", [
    (dict(gs=0.0), "gs must be finite and > 0"), (dict(gs=-1.0), "gs must be finite and > 0"),
    (dict(gs=float("nan")), "gs must be finite and > 0"), (dict(gs=float("inf")), "gs must be finite"),
    (dict(high_scale=0.0), "high_scale must be finite and > 0"),
    (dict(page_order=[0, 1, 1, 3, 4, 5, 6, 7]), r"duplicate ids \[1\]"),
    (dict(page_order=[0, 1, 2, 3, 4, 5, 6, 9]), r"ids out of range \[9\]"),
    (dict(page_order=[0, 1, 2]), "permutation of range"),
    (dict(max_pages_per_seq=0), r"max_pages_per_seq=0 out of range"),
    (dict(num_pages=0), r"num_pages=0 out of range"), (dict(max_seqs=0), r"max_seqs=0 out of range"),
    (dict(num_pages=8.0), "num_pages must be an integer"),
    (dict(num_high_pages=-1), "num_high_pages=-1 out of range"),
    (dict(max_pages_per_seq=2 ** 30), "max_pages_per_seq=1073741824 out of range"),
])
def test_init_state_validates_arguments(kwargs, match):
    args = dict(num_pages=8, max_seqs=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        jm.init_state(CFG, jm.GroupSpec(L, H, D), **args)


# ------------------------------------------------------------------------------------------------ readers
def _q(b, tq=1, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(b, tq, H, D)), CFG.attention_dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_attention_bad_slot_or_layer_is_flagged(backend):
    state = filled()
    q = _q(3)
    fn = jax.jit(functools.partial(jm.decode_attention, backend=backend))
    good_out, good_lse = fn(state, jnp.int32(0), q, jnp.array([0, 1, 2], jnp.int32))
    out, lse = fn(state, jnp.int32(0), q, jnp.array([0, 5, 2], jnp.int32))     # 5 >= S: used to read slot 3
    assert np.isnan(np.asarray(out[1], np.float32)).all() and np.isnan(np.asarray(lse[1])).all()
    for b in (0, 2):
        np.testing.assert_array_equal(bits(out[b]), bits(good_out[b]))
        np.testing.assert_array_equal(bits(lse[b]), bits(good_lse[b]))
    out, lse = fn(state, jnp.int32(7), q, jnp.array([0, 1, 2], jnp.int32))
    assert np.isnan(np.asarray(out, np.float32)).all() and np.isnan(np.asarray(lse)).all()
    with pytest.raises(ValueError, match=r"seq_slots\[1\]=5 out of range \[-1, 4\)"):
        jm.decode_attention(state, 0, q, np.array([0, 5, 2], np.int32), backend=backend)
    with pytest.raises(ValueError, match="layer=7 out of range"):
        jm.decode_attention(state, 7, q, np.array([0, 1, 2], np.int32), backend=backend)
    with pytest.raises(ValueError, match="integer"):
        jm.decode_attention(state, 0, q, np.array([0.0, 1.0, 2.0]), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_key_propagates_to_its_head(backend):
    """A NaN key is never hidden: its KV head's output and LSE are NaN, other heads / sequences are finite."""
    state = filled()
    k = np.asarray(_rows(np.random.default_rng(9), 1), np.float32)
    k[:, 0, 0, 3] = np.nan                         # head 0 of the new row, every layer
    k = jnp.asarray(k, jnp.bfloat16)
    state = jit_append(state, k, jnp.nan_to_num(k), [0], [LENS[0]])
    assert int(state.error) == 0
    out, lse = jm.decode_attention(state, 0, _q(2), jnp.array([0, 1], jnp.int32), backend=backend)
    o = np.asarray(out, np.float32)
    assert np.isnan(o[0, :, 0]).all() and np.isnan(np.asarray(lse)[0, :, 0]).all()
    assert np.isfinite(o[0, :, 1]).all() and np.isfinite(o[1]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_stage_bad_slot_or_layer_is_flagged(backend):
    state = filled()
    fn = jax.jit(functools.partial(jm.stage, backend=backend, validate=False))
    good = fn(state, jnp.int32(1), jnp.array([0, 2], jnp.int32))
    got = fn(state, jnp.int32(1), jnp.array([0, 9, 2], jnp.int32))
    page = CFG.page_size
    assert int(got.kv_lens[1]) == page
    bad_page = int(got.page_table[1, 0])
    assert np.isnan(np.asarray(got.pages[bad_page], np.float32)).all()
    for b_good, b_got in ((0, 0), (1, 2)):
        a, c = good.to_dense(), got.to_dense()
        np.testing.assert_array_equal(bits(a[b_good]), bits(c[b_got]))
    whole = fn(state, jnp.int32(5), jnp.array([0, 2], jnp.int32))
    used = np.asarray(whole.page_table)[:, 0]
    assert np.isnan(np.asarray(whole.pages, np.float32)[used]).all()
    with pytest.raises(ValueError, match=r"seq_slots\[1\]=9 out of range"):
        jm.stage(state, 1, np.array([0, 9]), backend=backend)
    with pytest.raises(ValueError, match="layer=5 out of range"):
        jm.stage(state, 5, np.array([0]), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fp8", [False, True])
def test_gather_and_overlay_bad_slot_layer_index_are_flagged(backend, fp8):
    state = filled()
    scratch_dtype = "fp8" if fp8 else None
    fn = jax.jit(functools.partial(jm.gather_rows, backend=backend, validate=False, scratch_dtype=scratch_dtype))
    idx = jnp.array([[0, 4, 8, -1], [1, 13, 2, 3], [0, 1, 2, 4]], jnp.int32)
    good, _ = fn(state, jnp.int32(0), jnp.array([0, 1, 2], jnp.int32), idx)
    got, _ = fn(state, jnp.int32(0), jnp.array([0, S, 2], jnp.int32), idx)
    g = np.asarray(got.astype(jnp.float32))
    assert np.isnan(g[1]).all()
    np.testing.assert_array_equal(bits(got[0]), bits(good[0]))
    np.testing.assert_array_equal(bits(got[2]), bits(good[2]))
    # an index at or past kv_len (or below -1): NaN entry, the rest untouched
    bad_idx = idx.at[0, 1].set(LENS[0]).at[2, 0].set(-2)
    got, _ = fn(state, jnp.int32(0), jnp.array([0, 1, 2], jnp.int32), bad_idx)
    g = np.asarray(got.astype(jnp.float32))
    assert np.isnan(g[0, 1]).all() and np.isnan(g[2, 0]).all()
    np.testing.assert_array_equal(bits(got[1]), bits(good[1]))
    assert (np.asarray(got.astype(jnp.float32))[0, 3] == 0).all()        # -1 padding stays zero
    got, _ = fn(state, jnp.int32(2), jnp.array([0, 1, 2], jnp.int32), idx)
    assert np.isnan(np.asarray(got.astype(jnp.float32))).all()
    if not fp8:
        ov = jax.jit(functools.partial(jm.overlay_retained_rows, backend=backend, validate=False))
        scratch, _ = jm.gather_rows(state, 0, np.array([0, 1, 2]), np.asarray(idx), overlay=False, backend=backend)
        out = ov(state, jnp.int32(0), scratch, jnp.array([0, -7, 2], jnp.int32), idx)
        assert np.isnan(np.asarray(out[1], np.float32)).all()
        ref = ov(state, jnp.int32(0), scratch, jnp.array([0, 1, 2], jnp.int32), idx)
        np.testing.assert_array_equal(bits(out[0]), bits(ref[0]))
    with pytest.raises(ValueError, match="out of range"):
        jm.gather_rows(state, 0, np.array([0, S, 2]), np.asarray(idx), backend=backend)


def test_stage_reference_and_rows_reference_flag_bad_input():
    state = filled()
    got = jax.jit(jm.stage_reference)(state, jnp.int32(0), jnp.array([1, S, -1, -3], jnp.int32))
    g = np.asarray(got, np.float32)
    assert np.isnan(g[1]).all() and np.isnan(g[3]).all() and (g[2] == 0).all() and np.isfinite(g[0, ..., :14, :]).all()
    assert np.isnan(np.asarray(jax.jit(jm.stage_reference)(state, jnp.int32(2), jnp.array([0], jnp.int32)),
                               np.float32)).all()
    with pytest.raises(ValueError, match="layer=2 out of range"):
        jm.stage_reference(state, 2, jnp.array([0]))


def test_validate_read_uses_the_allocator_page_count():
    """Pool arrays may carry padding pages past num_pages; a page id there is still out of range."""
    state = filled()
    pt = np.asarray(state.page_table).copy()
    pt[0, 0] = state.alloc.num_pages                 # a padding page (or past the pool)
    bad = dataclasses.replace(state, page_table=jnp.asarray(pt))
    with pytest.raises(ValueError, match=r"page_table\[0, 0\]=24 out of range \[0, 24\)"):
        jm.stage(bad, 0, np.array([0]), backend="reference")


# ------------------------------------------------------------------------------------------------ CacheManager
def test_manager_refuses_what_the_device_would_and_mirrors_it():
    mgr = jm.CacheManager(CFG, jm.GroupSpec(L, H, D), num_pages=16, max_seqs=2, max_pages_per_seq=6,
                          backend="reference")
    a, b = mgr.admit(), mgr.admit()
    k = _rows(np.random.default_rng(0), 6)
    mgr.append(None, k, k, [a] * 6, range(6))
    before = jax.device_get(mgr.state)
    k1 = _rows(np.random.default_rng(1), 1)
    with pytest.raises(ValueError, match=r"slot 0 has kv_len 6; positions \[8, 8\]"):
        mgr.append(None, k1, k1, [a], [8])                                   # a gap: used to be accepted
    with pytest.raises(ValueError, match=r"positions \[2, 2\]"):
        mgr.append(None, k1, k1, [a], [2])                                   # old position
    with pytest.raises(ValueError, match="distinct and contiguous"):
        mgr.append(None, _rows(np.random.default_rng(1), 2), _rows(np.random.default_rng(1), 2), [a, a], [6, 6])
    with pytest.raises(ValueError, match="seq_slots must be integers, got dtype float"):
        mgr.append(None, k1, k1, [0.0], [6])
    with pytest.raises(ValueError, match=r"layer=7 out of range"):
        mgr.append(7, k1[0], k1[0], [a], [6])
    with pytest.raises(ValueError, match=r"seq_slots\[0\]=5 out of range"):
        mgr.append(None, k1, k1, [5], [0])
    with pytest.raises(ValueError, match="slot=1.5|must be an integer"):
        mgr.admit(1.5)
    assert_trees_bit_equal(jax.device_get(mgr.state), before)
    # per-layer appends of the same tokens, then the mirror equals the device exactly
    for layer in range(L):
        mgr.append(layer, k1[layer], k1[layer], [a], [6])
    mgr.append(None, k1, k1, [b], [0])
    assert mgr.can_append([a] * 2, [7, 8])
    mgr.check()
    np.testing.assert_array_equal(mgr._lens, np.asarray(mgr.state.kv_lens))
    np.testing.assert_array_equal(mgr._written, np.asarray(mgr.state.written))
    np.testing.assert_array_equal(mgr._pages_held, (np.asarray(mgr.state.page_table) >= 0).sum(1))
    assert mgr.free_pages == int(mgr.state.alloc.num_free)
    with pytest.raises(ValueError, match="differ from the device"):
        mgr.set_lengths([0, 0])


# ------------------------------------------------------------------------------------------------ sharded states
@pytest.fixture(scope="module")
def mesh2():
    assert len(jax.devices()) >= 2, "conftest forces 4 CPU devices"
    from jmixedkv import sharding
    return sharding.make_mesh(2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sharded_append_refusals(mesh2, backend):
    from jmixedkv import sharding
    state = sharding.shard_state(filled(), mesh2)
    fn = jax.jit(functools.partial(sharding.sharded_append, mesh2, backend=backend))
    rng = np.random.default_rng(0)
    k = _rows(rng, 1)
    for seq, pos, layer, bit in (([S], [0], None, ERR_BAD_SLOT), ([1], [2], None, ERR_BAD_POSITION),
                                 ([0], [LENS[0]], 9, ERR_BAD_LAYER)):
        kk = k if layer is None else k[0]
        after = fn(state, None if layer is None else jnp.int32(layer), kk, kk, jnp.asarray(seq, jnp.int32),
                   jnp.asarray(pos, jnp.int32))
        assert_refused(jax.device_get(state), jax.device_get(after), bit)
        # replicated leaves (error bits, tables) agree on every shard
        for leaf in (after.error, after.kv_lens, after.page_table):
            copies = [np.asarray(s.data) for s in leaf.addressable_shards]
            for c in copies[1:]:
                np.testing.assert_array_equal(c, copies[0])
    with pytest.raises(ValueError, match=r"seq_slots\[0\]=4 out of range"):
        sharding.sharded_append(mesh2, state, None, k, k, [S], [0], backend=backend)
    with pytest.raises(ValueError, match="layer=9 out of range"):
        sharding.sharded_append(mesh2, state, 9, k[0], k[0], [0], [9], backend=backend)
    ok = fn(state, None, k, k, jnp.array([0], jnp.int32), jnp.array([LENS[0]], jnp.int32))
    assert int(ok.error) == 0
    assert_others_unchanged(jax.device_get(state), jax.device_get(ok), touched={0})


@pytest.mark.parametrize("backend", BACKENDS)
def test_sharded_readers_flag_bad_slots(mesh2, backend):
    from jmixedkv import sharding
    base = filled()
    state = sharding.shard_state(base, mesh2)
    q = _q(3)
    out, lse = jax.jit(functools.partial(sharding.sharded_decode_attention, mesh2, backend=backend))(
        state, jnp.int32(0), q, jnp.array([0, S + 1, 2], jnp.int32))
    ref_out, ref_lse = jm.decode_attention(base, 0, q, jnp.array([0, 1, 2], jnp.int32), backend=backend)
    assert np.isnan(np.asarray(out[1], np.float32)).all() and np.isnan(np.asarray(lse[1])).all()
    np.testing.assert_array_equal(bits(out[0]), bits(ref_out[0]))
    np.testing.assert_array_equal(bits(out[2]), bits(ref_out[2]))
    got = jax.jit(functools.partial(sharding.sharded_stage, mesh2, backend=backend))(
        state, jnp.int32(1), jnp.array([0, -5], jnp.int32))
    assert np.isnan(np.asarray(got.pages[int(got.page_table[1, 0])], np.float32)).all()
    idx = jnp.array([[0, 1], [2, 3]], jnp.int32)
    rows, _ = jax.jit(functools.partial(sharding.sharded_gather_rows, mesh2, backend=backend))(
        state, jnp.int32(0), jnp.array([1, S], jnp.int32), idx)
    assert np.isnan(np.asarray(rows[1], np.float32)).all() and np.isfinite(np.asarray(rows[0], np.float32)).all()
    with pytest.raises(ValueError, match=r"seq_slots\[1\]=9 out of range"):
        sharding.sharded_decode_attention(mesh2, state, 0, q, np.array([0, 9, 2], np.int32), backend=backend)
    with pytest.raises(ValueError, match="layer=4 out of range"):
        sharding.sharded_stage(mesh2, state, 4, np.array([0], np.int32), backend=backend)


def test_merge_attention_propagates_nan():
    o = jnp.ones((2, 4), jnp.float32)
    lse1 = jnp.array([jnp.nan, -jnp.inf])
    lse2 = jnp.array([0.5, -jnp.inf])
    out, lse = jm.merge_attention(o, lse1, o, lse2)
    assert np.isnan(np.asarray(out[0])).all() and np.isnan(float(lse[0]))
    assert (np.asarray(out[1]) == 0).all() and float(lse[1]) == -np.inf


def test_manager_refuses_writes_into_shared_pages_after_fork():
    mgr = jm.CacheManager(CFG, jm.GroupSpec(L, H, D), num_pages=16, max_seqs=2, max_pages_per_seq=6,
                          backend="reference")
    a = mgr.admit()
    k = _rows(np.random.default_rng(0), 9)
    mgr.append(None, k, k, [a] * 9, range(9))
    mgr.replace_state(jax.jit(jm.fork)(mgr.state, a, 1))           # pages 0, 1 shared, page 2 copied
    before = jax.device_get(mgr.state)
    with pytest.raises(ValueError, match="shared"):
        mgr.append(None, k, k, [1] * 9, range(9))                         # a legal suffix by position, but shared pages
    assert_trees_bit_equal(jax.device_get(mgr.state), before)
    k1 = _rows(np.random.default_rng(1), 2)
    mgr.append(None, k1, k1, [a, 1], [9, 9])                              # from kv_len: the copied page, fine
    mgr.check()
    mgr.release(a)                                                  # slot 1 now owns pages 0, 1 alone
    mgr.append(None, k[:, :9], k[:, :9], [1] * 9, range(1, 10))
    mgr.check()
    assert int(mgr.state.kv_lens[1]) == 10


@pytest.mark.parametrize("group", [1, -1, "0", 0.0, None])
def test_bad_group_raises_naming_it_in_every_entry_point(group):
    """One rule (`checks.check_group`) for a host group index that is not an int in ``[0, num_groups)``: every
    reader, `CacheManager.append` and the sharded entry points raise `ValueError` naming the value and the range
    before any device work, and the manager's state is bitwise unchanged."""
    from jmixedkv import sharding
    st = filled()
    slots = jnp.arange(S, dtype=jnp.int32)
    idx = jnp.zeros((S, 2), jnp.int32)
    k = _rows(np.random.default_rng(0), 1, layers=1)[0]
    mesh = sharding.make_mesh(1)
    calls = {
        "append": lambda: jm.append(st, 0, k, k, np.array([3], np.int32), np.array([0], np.int32), group=group),
        "stage": lambda: jm.stage(st, 0, slots, group=group, backend="reference"),
        "gather_rows": lambda: jm.gather_rows(st, 0, slots, idx, group=group, backend="reference"),
        "decode_attention": lambda: jm.decode_attention(st, 0, _q(S), slots, group=group, backend="reference"),
        "sharded_stage": lambda: sharding.sharded_stage(mesh, st, 0, slots, group=group, backend="reference"),
        "sharded_append": lambda: sharding.sharded_append(mesh, st, 0, k, k, np.array([3], np.int32),
                                                          np.array([0], np.int32), group=group),
    }
    want = re.escape(f"group={group!r} out of range [0, 1)")
    for op, call in calls.items():
        with pytest.raises(ValueError, match=want):
            call()
    mgr = jm.CacheManager(CFG, jm.GroupSpec(L, H, D), num_pages=24, max_seqs=S, max_pages_per_seq=8,
                          backend="reference")
    mgr.admit(0)
    before = jax.device_get(mgr.state)
    with pytest.raises(ValueError, match=r"append: " + want):
        mgr.append(0, k, k, np.array([0], np.int32), np.array([0], np.int32), group=group)
    assert_trees_bit_equal(jax.device_get(mgr.state), before, "a refused append leaves the state unchanged")


# ------------------------------------------------------------------------------------------------ idle slots
@pytest.mark.parametrize("backend", BACKENDS)
def test_readers_flag_a_never_admitted_slot(backend):
    """Slot 3 was never admitted: decode_attention and stage give it the flagged NaN row an out-of-range slot
    gets (not an empty sequence: zeros, LSE -inf); the other rows are bitwise those of a batch without it."""
    state = filled()
    q = _q(3)
    fn = jax.jit(functools.partial(jm.decode_attention, backend=backend))
    good_out, good_lse = fn(state, jnp.int32(0), q, jnp.array([0, 1, 2], jnp.int32))
    out, lse = fn(state, jnp.int32(0), q, jnp.array([0, 3, 2], jnp.int32))
    assert np.isnan(np.asarray(out[1], np.float32)).all() and np.isnan(np.asarray(lse[1])).all()
    for b in (0, 2):
        np.testing.assert_array_equal(bits(out[b]), bits(good_out[b]))
        np.testing.assert_array_equal(bits(lse[b]), bits(good_lse[b]))
    sfn = jax.jit(functools.partial(jm.stage, backend=backend, validate=False))
    good = sfn(state, jnp.int32(0), jnp.array([0, 2], jnp.int32))
    got = sfn(state, jnp.int32(0), jnp.array([0, 3, 2], jnp.int32))
    assert np.isnan(np.asarray(got.pages[got.page_table[1, 0]], np.float32)).all()
    for b_good, b_got in ((0, 0), (1, 2)):
        n = int(good.kv_lens[b_good])
        assert int(got.kv_lens[b_got]) == n
        for j in range(-(-n // CFG.page_size)):
            np.testing.assert_array_equal(bits(got.pages[got.page_table[b_got, j]]),
                                          bits(good.pages[good.page_table[b_good, j]]))
    with pytest.raises(ValueError, match=r"seq_slots\[1\]=3 is not admitted"):
        jm.stage(state, 0, np.array([0, 3, 2], np.int32), backend=backend)


# ------------------------------------------------------------------------------------------------ construction
@pytest.mark.parametrize("make,match", [
    (lambda: jm.KVCacheConfig("bf16", block_scale="4over6"), "no NVFP4 pool"),
    (lambda: jm.GroupSpec(num_layers=2.5, num_kv_heads=1, head_dim=16), r"num_layers must be an integer >= 1, got 2.5"),
    (lambda: jm.GroupSpec(num_layers=True, num_kv_heads=1, head_dim=16), "num_layers must be an integer"),
    (lambda: jm.init_state(CFG, jm.GroupSpec(L, H, D), num_pages=8, max_seqs=2, num_high_pages=0),
     "num_high_pages=0 cannot hold one sequence's twin"),
    (lambda: jm.init_state(jm.KVCacheConfig("mixed_nvfp4_bf16", first_n=2, last_n=2, page_size=4,
                                            rotation="hadamard"), jm.GroupSpec(1, 1, 48), num_pages=8, max_seqs=2),
     "power-of-two head_dim; group 'attn' has head_dim=48"),
    (lambda: offload.HostTier(1.5), "capacity_pages must be an integer >= 0 or None, got 1.5"),
])
def test_construction_refuses(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_append_refuses_integer_v():
    state = filled()
    k = jnp.ones((L, 1, H, D), jnp.bfloat16)
    with pytest.raises(ValueError, match="v must be a float array, got int32"):
        jm.append(state, None, k, jnp.ones((L, 1, H, D), jnp.int32), np.array([3], np.int32), np.array([0]))


@pytest.mark.parametrize("gs", [0.0, -1.0, float("nan"), float("inf"), [1.0, 0.0]])
def test_nvfp4_codec_refuses_bad_global_scale(gs):
    x = jnp.ones((2, 16), jnp.float32)
    with pytest.raises(ValueError, match="global_scale must be finite and > 0"):
        jm.nvfp4.quantize(x, gs, backend="reference")
    packed, scales = jm.nvfp4.quantize(x, 1.0, backend="reference")
    with pytest.raises(ValueError, match="global_scale must be finite and > 0"):
        jm.nvfp4.dequantize(packed, scales, jnp.asarray(gs, jnp.float32), backend="reference")


def test_host_index_arrays_fast_and_slow_paths_agree():
    """`checks.index_array` on host int32 arrays (the host mirrors' fast path) returns a copy and refuses what the
    general path refuses, naming the first offending entry."""
    x = np.array([-1, 0, 7], np.int32)
    out = checks.index_array(x, "seq_slots", "op", -1, 8, host=True)
    assert out.dtype == np.int32 and out.tolist() == [-1, 0, 7] and out is not x
    out[0] = 5
    assert x[0] == -1                                                    # a copy: the caller's array is untouched
    for bad, msg in ((np.array([0, 8, 9], np.int32), r"seq_slots\[1\]=8 out of range \[-1, 8\)"),
                     (np.array([3, -2], np.int32), r"seq_slots\[1\]=-2 out of range \[-1, 8\)")):
        for arr in (bad, bad.astype(np.int64), bad.tolist()):
            with pytest.raises(ValueError, match=msg):
                checks.index_array(arr, "seq_slots", "op", -1, 8, host=True)
    assert checks.index_array(np.zeros(0, np.int32), "p", "op", 0, 1, host=True).shape == (0,)
