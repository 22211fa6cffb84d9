"""Compressed-history groups (`jmixedkv.compressed`): geometry, the twin's row mask with a released page and
rows past the table's width, reference write + read vs a numpy model, and the Pallas gather over compressed rows."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_bits_equal, assert_trees_bit_equal, bits
from jmixedkv import compressed as cz
from jmixedkv import nvfp4
from jmixedkv.config import KVCacheConfig

CFG = KVCacheConfig("mixed_nvfp4_bf16", first_n=64, last_n=100, page_size=8, max_draft_len=4)
D = 64
# NB: jitted and eager `nvfp4.quantize_reference` differ on CPU (XLA reassociates ``(1/gs) * (amax/6)``); the reference
# write runs jitted, so the expected rows use the jitted codec too.
_quantize = jax.jit(nvfp4.quantize_reference)


def test_geometry():
    g4, g128 = cz.compressed_geometry(CFG, 4), cz.compressed_geometry(CFG, 128)
    assert (g4.first_n, g4.last_n, g4.num_fixed, g4.num_ring) == (16, 25, 2, 5)
    assert (g128.first_n, g128.last_n, g128.num_fixed, g128.num_ring) == (1, 1, 1, 2)
    g = cz.compressed_geometry(KVCacheConfig("mixed_nvfp4_bf16", first_n=5, page_size=8), 4)
    assert (g.first_n, g.last_n, g.num_fixed, g.num_ring) == (2, 0, 1, 0)
    with pytest.raises(ValueError, match="ratio must be an integer >= 1"):
        cz.compressed_geometry(CFG, 0)


def make_cache(ratios=(4, 128), seed=0):
    rng = np.random.default_rng(seed)
    cache = cz.init_compressed(CFG, ratios, num_layers=2, num_kv_heads=1, head_dim=D, kv_factor=1, num_pages=20,
                               max_seqs=2, max_pages_per_seq=8, gs=0.02, poison=True)
    for r in ratios:
        geom = cache.geometry(r)
        low = rng.permutation(20)[:16].reshape(2, 8)
        twin = rng.permutation(2 * geom.width).reshape(2, geom.width)
        cache = cz.with_tables(cache, r, page_table=low, twin_table=twin)
    return cache


def expected_mask(table, seqs, cpos, geom):
    out = np.zeros(len(seqs), bool)
    for t, (s, c) in enumerate(zip(seqs, cpos)):
        q = c // geom.page
        col = q if q < geom.num_fixed else (geom.num_fixed + q % geom.num_ring if geom.num_ring else -1)
        out[t] = 0 <= col < table.shape[1] and table[s, col] != -1
    return out


def test_row_mask_released_page_and_out_of_width():
    cache = make_cache()
    cache = cz.release_twin_page(cache, 4, 0, 1)                   # request 0's second page entry released
    geom = cache.geometry(4)
    table = np.asarray(cache.levels[4].twin_table)
    assert table[0, 1] == -1
    seqs = np.repeat([0, 1], 64)
    cpos = np.tile(np.arange(64), 2)
    mask = np.asarray(cz.twin_row_mask(cache, 4, jnp.asarray(seqs), jnp.asarray(cpos)))
    np.testing.assert_array_equal(mask, expected_mask(table, seqs, cpos, geom))
    assert not mask[8:16].any() and mask[:8].all() and mask[64 + 8:64 + 16].all()
    # a table narrower than F + R: columns past its width are not held (never the last column)
    narrow = cz.with_tables(cache, 4, twin_table=table[:, :3])
    m2 = np.asarray(cz.twin_row_mask(narrow, 4, jnp.asarray(seqs), jnp.asarray(cpos)))
    np.testing.assert_array_equal(m2, expected_mask(table[:, :3], seqs, cpos, geom))
    q = cpos // 8
    cols = np.where(q < 2, q, 2 + q % 5)
    assert not m2[cols >= 3].any() and m2[(seqs == 1) & (cols < 3)].all()
    # padding rows and negative positions are not held
    assert not np.asarray(cz.twin_row_mask(cache, 4, jnp.array([-1, 0]), jnp.array([0, -1]))).any()


def _write_all(cache, ratio, raw_lens, rng, layer=None):
    n_c = [n // ratio for n in raw_lens]
    seqs = np.concatenate([[s] * n for s, n in enumerate(n_c)]).astype(np.int32)
    cpos = np.concatenate([np.arange(n) for n in n_c]).astype(np.int32)
    x = jnp.asarray(rng.normal(size=(2, len(seqs), 1, 1, D)) * 4, jnp.bfloat16)
    cache = cz.set_lengths(cache, jnp.asarray(raw_lens, jnp.int32))
    return cz.write_compressed_reference(cache, ratio, x, layer, seqs, cpos), seqs, cpos, x


@pytest.mark.parametrize("release_before_write", [True, False])
def test_write_read_with_released_page(release_before_write):
    rng = np.random.default_rng(1)
    cache = make_cache()
    raw_lens = [203, 37]
    if release_before_write:
        cache = cz.release_twin_page(cache, 4, 0, 1)
    cache, seqs, cpos, x = _write_all(cache, 4, raw_lens, rng)
    if not release_before_write:
        cache = cz.release_twin_page(cache, 4, 0, 1)
    geom = cache.geometry(4)
    table = np.asarray(cache.levels[4].twin_table)
    held = expected_mask(table, seqs, cpos, geom)
    n_c = np.array(raw_lens) // 4
    retained = (cpos < geom.first_n) | (cpos >= n_c[seqs] - geom.last_n)
    gs = np.asarray(cache.levels[4].low.gs)
    for layer in (0, 1):
        got = cz.read_compressed_reference(cache, 4, layer, jnp.asarray(seqs), jnp.asarray(cpos))
        data, sc = _quantize(x[layer], gs[layer][None, :, None])   # jitted, like the write
        deq = nvfp4.dequantize_reference(data, sc, gs[layer][None, :, None], jnp.bfloat16)
        want = np.where((retained & held)[:, None, None, None], np.asarray(x[layer]), np.asarray(deq))
        assert_bits_equal(got, want)
        assert (retained & ~held)[(seqs == 0) & (cpos >= 8) & (cpos < 16)].all()   # retained, read from NVFP4
    # twin rows were written exactly where the write mask held (the rest of the poisoned twin stays NaN)
    twin = np.asarray(cache.levels[4].twin.rows[0], np.float32)
    written = (~np.isnan(twin[..., 0])).sum()
    expect = int(held.sum()) if release_before_write else int(expected_mask(
        np.asarray(make_cache().levels[4].twin_table), seqs, cpos, geom).sum())
    assert written == expect
    # past the compressed length, padding: zeros
    z = cz.read_compressed_reference(cache, 4, 0, jnp.array([1, -1, 0]), jnp.array([n_c[1], 0, 63]))
    assert not np.asarray(z, np.float32).any()


def test_ratio_128_group_and_pallas_gather():
    rng = np.random.default_rng(2)
    cache = make_cache()
    raw_lens = [240, 300]                                       # ratio 4: 60 / 75 rows; ratio 128: 1 / 2 rows
    cache, _, _, _ = _write_all(cache, 128, raw_lens, rng)
    cache, _, _, _ = _write_all(cache, 4, [240, 36], rng)       # sequence 1 has only 9 compressed rows written
    cache = cz.set_lengths(cache, jnp.asarray([240, 36], jnp.int32))
    cache = cz.release_twin_page(cache, 4, 0, 1)
    idx = np.array([[0, 5, 9, 12, 15, 40, 60, 61, 62, -1, 30, 20, 8, 1, 2, 3],
                    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, -1, -1, -1, -1, -1, -1]], np.int32)
    for ratio in (4, 128):
        ix = np.where(idx < (np.array([240, 36]) // ratio)[:, None], idx, -1)
        ref = cz.gather_compressed(cache, ratio, 1, np.array([0, 1]), ix, backend="reference")
        got = cz.gather_compressed(cache, ratio, 1, np.array([0, 1]), ix, backend="pallas")
        assert_bits_equal(got, ref)
        assert not np.isnan(np.asarray(got, np.float32)).any()
    with pytest.raises(ValueError, match=r"indices\[1, 0\]=9 out of range \[-1, 9\) for sequence slot 1"):
        cz.gather_compressed(cache, 4, 1, np.array([0, 1]), np.array([[0], [9]], np.int32))
    bad = cz.with_tables(cache, 4, page_table=cache.levels[4].page_table.at[0, 0].set(-1))
    with pytest.raises(ValueError, match=r"page_table\[0, 0\]=-1 is not a valid page"):
        cz.gather_compressed(bad, 4, 1, np.array([0]), np.array([[3]], np.int32))
    # the ratio-128 twin holds compressed row 0 (first_c = 1) and the last row
    twin_dict = cache.twins
    assert set(twin_dict) == {4, 128}
    cache = cz.set_lengths(cache, jnp.asarray(raw_lens, jnp.int32))
    x = cz.read_compressed_reference(cache, 128, 0, jnp.array([0, 1, 1]), jnp.array([0, 0, 1]))
    assert np.asarray(cz.twin_row_mask(cache, 128, jnp.array([0, 1, 1]), jnp.array([0, 0, 1]))).all()
    twin = cache.levels[128].twin.rows[0]
    ht = np.asarray(cache.levels[128].twin_table)
    assert_bits_equal(x[1:], twin[ht[1, 0], 0, 0, jnp.array([0, 1])][:, None, None])   # both on fixed page 0


def test_pure_and_jittable():
    cache = make_cache()
    before = jax.tree.map(np.asarray, cache)
    f = jax.jit(lambda c, x, s, p: cz.write_compressed_reference(c, 4, x, 0, s, p))
    out = f(cache, jnp.ones((3, 1, 1, D), jnp.bfloat16), jnp.array([0, 0, 1]), jnp.array([0, 1, 0]))
    assert_trees_bit_equal(cache, before, "the input cache")
    assert jax.tree.structure(out) == jax.tree.structure(cache)


@pytest.mark.gpu
def test_compressed_gather_on_gpu_bitexact():
    assert jax.default_backend() == "gpu", "gpu tests need a GPU"
    rng = np.random.default_rng(5)
    cache = make_cache()
    cache, _, _, _ = _write_all(cache, 4, [240, 36], rng)
    cache = cz.release_twin_page(cache, 4, 0, 1)
    idx = np.sort(rng.choice(60, (2, 32)), axis=1).astype(np.int32)
    idx[1] = np.where(idx[1] < 9, idx[1], -1)
    ref = cz.gather_compressed(cache, 4, 1, np.array([0, 1]), idx, backend="reference")
    got = cz.gather_compressed(cache, 4, 1, np.array([0, 1]), idx, backend="pallas")
    assert_bits_equal(got, ref)


# ---------------------------------------------------------------------------------------------- bad input
import dataclasses  # noqa: E402
import functools  # noqa: E402

from jmixedkv import checks  # noqa: E402

_write4 = jax.jit(lambda c, x, layer, s, p: cz.write_compressed_reference(c, 4, x, layer, s, p))
_read4 = jax.jit(lambda c, layer, s, p: cz.read_compressed_reference(c, 4, layer, s, p))
_tables4 = jax.jit(lambda c, pt, tt: cz.with_tables(c, 4, page_table=pt, twin_table=tt))
_release4 = jax.jit(lambda c, s, col: cz.release_twin_page(c, 4, s, col))
_lengths = jax.jit(cz.set_lengths)


@functools.lru_cache(maxsize=1)
def _written(seed=3):
    """make_cache() with every complete ratio-4 row written: sequence 0 has 60 rows, sequence 1 has 9 (immutable,
    built once)."""
    cache = _write_all(make_cache(), 4, [240, 36], np.random.default_rng(seed))[0]
    assert int(cache.error) == 0
    return cache


def _no_error(cache):
    return dataclasses.replace(cache, error=jnp.int32(0))


def assert_cache_unchanged(a, b):
    assert_trees_bit_equal(_no_error(a), _no_error(b))


def _all_rows(cache):
    seqs = np.repeat([0, 1], 64)
    cpos = np.tile(np.arange(64), 2)
    return np.asarray(_read4(cache, 0, jnp.asarray(seqs), jnp.asarray(cpos)))


def test_old_row_rewrite_cannot_clobber_the_twin_window():
    """Rewriting compressed row 17 of a 60-row sequence used to store it into the twin ring slot that holds row 57
    (retained): a reader of row 57 then saw row 17's data. Such a write (it stops short of the end) is refused."""
    cache = _written()
    before = _all_rows(cache)
    x1 = jnp.full((1, 1, 1, D), 3.0, jnp.bfloat16)
    out = _write4(cache, x1, 0, jnp.array([0]), jnp.array([17]))
    assert int(out.error) == checks.ERR_BAD_POSITION
    assert_cache_unchanged(out, cache)
    # a gap past n_c and a duplicate row are refused the same way
    out = _write4(cache, x1, 0, jnp.array([1]), jnp.array([10]))
    assert int(out.error) == checks.ERR_BAD_POSITION
    x2 = jnp.full((2, 1, 1, D), 3.0, jnp.bfloat16)
    out = _write4(cache, x2, 0, jnp.array([1, 1]), jnp.array([9, 9]))
    assert int(out.error) == checks.ERR_BAD_POSITION
    assert_cache_unchanged(out, cache)
    # a rewrite that reaches the end (a re-verified suffix) is legal: only those rows change
    out = _write4(cache, x2, 0, jnp.array([0, 0]), jnp.array([59, 58]))
    assert int(out.error) == 0
    after = _all_rows(out)
    changed = np.flatnonzero((bits(before).reshape(128, -1) != bits(after).reshape(128, -1)).any(axis=1))
    assert changed.tolist() == [58, 59]
    # an extension from n_c (sequence 1: rows 9, 10) is legal and leaves sequence 0 alone
    out = _write4(cache, x2, 0, jnp.array([1, 1]), jnp.array([9, 10]))
    assert int(out.error) == 0
    assert_bits_equal(_all_rows(out)[:64], before[:64])


def test_host_validation_names_the_value():
    cache = _written()
    x1 = jnp.ones((1, 1, 1, D), jnp.bfloat16)
    pt = np.asarray(cache.levels[4].page_table)
    tt = np.asarray(cache.levels[4].twin_table)
    cases = [
        (lambda: cz.write_compressed_reference(cache, 4, x1, 0, [2], [60]), r"seq\[0\]=2 out of range \[-1, 2\)"),
        (lambda: cz.write_compressed_reference(cache, 4, x1, 0, [-2], [60]), r"seq\[0\]=-2 out of range"),
        (lambda: cz.write_compressed_reference(cache, 4, x1, 2, [0], [60]), r"layer=2 out of range \[0, 2\)"),
        (lambda: cz.write_compressed_reference(cache, 4, x1, -1, [0], [60]), r"layer=-1 out of range"),
        (lambda: cz.write_compressed_reference(cache, 4, x1, 0, [0.0], [60]), "must be integers"),
        (lambda: cz.write_compressed_reference(cache, 4, x1, 0, [0], [2 ** 32 + 60]), r"cpos\[0\]=4294967356"),
        (lambda: cz.write_compressed_reference(cache, 4, x1[:, 0], 0, [0], [60]), "x must be"),
        (lambda: cz.with_tables(cache, 4, page_table=np.where(pt == pt[0, 0], 20, pt)),
         r"page_table\[0\]=20 out of range \[-1, 20\)"),
        (lambda: cz.with_tables(cache, 4, page_table=np.where(pt == pt[1, 3], -2, pt)), "=-2 out of range"),
        (lambda: cz.with_tables(cache, 4, page_table=np.where(pt == pt[1, 3], pt[1, 0], pt)),
         f"page_table row 1 lists page {pt[1, 0]} more than once"),
        (lambda: cz.with_tables(cache, 4, twin_table=np.where(tt == tt[1, 3], tt[0, 0], tt)),
         f"twin_table lists page {tt[0, 0]} more than once"),
        (lambda: cz.with_tables(cache, 4, twin_table=tt + 1), r"twin_table\[\d+\]=14 out of range \[-1, 14\)"),
        (lambda: cz.with_tables(cache, 4, page_table=pt[:1]), "must have 2 rows"),
        (lambda: cz.with_tables(cache, 5, page_table=pt), r"no compressed group with ratio 5"),
        (lambda: cz.release_twin_page(cache, 4, 2, 0), r"seq_slot=2 out of range \[-1, 2\)"),
        (lambda: cz.release_twin_page(cache, 4, 0, 7), r"column=7 out of range \[0, 7\)"),
        (lambda: cz.release_twin_page(cache, 6, 0, 0), r"no compressed group with ratio 6"),
        (lambda: cz.set_lengths(cache, [240, -1]), r"kv_lens\[1\]=-1 out of range"),
        (lambda: cz.set_lengths(cache, [240]), r"must be i32\[2\]"),
        (lambda: cz.read_compressed_reference(cache, 4, 0, [0, 5], [0, 0]), r"seq\[1\]=5 out of range"),
        (lambda: cz.read_compressed_reference(cache, 4, 3, [0], [0]), r"layer=3 out of range"),
        (lambda: cz.gather_compressed(cache, 4, 2, np.array([0]), np.array([[0]])), r"layer=2 out of range"),
        (lambda: cz.gather_compressed(cache, 4, 0, np.array([3]), np.array([[0]])), r"seq_slots\[0\]=3 out of"),
    ]
    for fn, msg in cases:
        with pytest.raises(ValueError, match=msg):
            fn()


def test_refusals_inside_jit_leave_every_sequence_unchanged():
    cache = _written()
    x1 = jnp.ones((1, 1, 1, D), jnp.bfloat16)
    writes = [((0, [2], [60]), checks.ERR_BAD_SLOT), ((0, [-2], [60]), checks.ERR_BAD_SLOT),
              ((2, [0], [60]), checks.ERR_BAD_LAYER), ((-1, [0], [60]), checks.ERR_BAD_LAYER),
              ((0, [0], [-1]), checks.ERR_BAD_POSITION),
              ((0, [1], [64]), checks.ERR_TOO_LONG)]                     # row 64 is past the 8-page table
    for (layer, seq, cpos), bit in writes:
        out = _write4(cache, x1, jnp.int32(layer), jnp.array(seq, jnp.int32), jnp.array(cpos, jnp.int32))
        assert int(out.error) & bit, (layer, seq, cpos, int(out.error))
        assert_cache_unchanged(out, cache)
    # a row whose low page is not held (-1) or whose page id points outside the pool
    for bad_id in (-1, 20, 1000):
        lv = cache.levels[4]
        broken = cz._replace_level(cache, 4, page_table=lv.page_table.at[1, 1].set(bad_id))
        out = _write4(broken, x1, jnp.int32(0), jnp.array([1]), jnp.array([9]))
        assert int(out.error) == checks.ERR_BAD_PAGE, bad_id
        assert_cache_unchanged(out, broken)
    pt, tt = cache.levels[4].page_table, cache.levels[4].twin_table
    for new_pt, new_tt in ((pt.at[0, 0].set(20), tt), (pt.at[0, 0].set(-3), tt), (pt.at[0, 0].set(pt[0, 1]), tt),
                           (pt, tt.at[1, 2].set(14)), (pt, tt.at[1, 2].set(tt[0, 0]))):
        out = _tables4(cache, new_pt, new_tt)
        assert int(out.error) == checks.ERR_BAD_PAGE
        assert_cache_unchanged(out, cache)
    for slot, col, bit in ((2, 0, checks.ERR_BAD_SLOT), (-2, 0, checks.ERR_BAD_SLOT), (0, 7, checks.ERR_BAD_PAGE),
                           (0, -1, checks.ERR_BAD_PAGE)):
        out = _release4(cache, jnp.int32(slot), jnp.int32(col))
        assert int(out.error) == bit
        assert_cache_unchanged(out, cache)
    out = _release4(cache, jnp.int32(-1), jnp.int32(0))                  # -1: no-op
    assert int(out.error) == 0
    assert_cache_unchanged(out, cache)
    # sequences may share a low page (a common prefix), but nobody writes into it
    shared = _tables4(cache, pt.at[1, 1].set(pt[0, 0]), tt)
    assert int(shared.error) == 0
    out = _write4(shared, x1, jnp.int32(0), jnp.array([1]), jnp.array([9]))
    assert int(out.error) == checks.ERR_SHARED_PAGE
    assert_cache_unchanged(out, shared)
    out = _lengths(cache, jnp.array([240, -4], jnp.int32))
    assert int(out.error) == checks.ERR_BAD_POSITION
    assert_cache_unchanged(out, cache)


def test_readers_flag_bad_slot_layer_and_page():
    cache = _written()
    good = _read4(cache, jnp.int32(1), jnp.array([0, 1]), jnp.array([57, 3]))
    got = _read4(cache, jnp.int32(1), jnp.array([0, 2, -1, -3, 1, 7]), jnp.array([57, 3, 3, 3, 3, 0]))
    assert_bits_equal(got[0], good[0])
    assert_bits_equal(got[4], good[1])
    assert not np.asarray(got[2], np.float32).any()                      # padding: zero
    for row in (1, 3, 5):                                                # bad slots: NaN, never sequence 1's rows
        assert np.isnan(np.asarray(got[row], np.float32)).all()
    assert np.isnan(np.asarray(_read4(cache, jnp.int32(2), jnp.array([0, 1]), jnp.array([0, 0])), np.float32)).all()
    # a page id outside the pool (a table built by hand): NaN rows, not the last page's rows
    lv = cache.levels[4]
    broken = cz._replace_level(cache, 4, page_table=lv.page_table.at[1, 0].set(25))
    got = np.asarray(_read4(broken, jnp.int32(0), jnp.array([1, 1, 0]), jnp.array([2, 8, 2])), np.float32)
    assert np.isnan(got[0]).all() and not np.isnan(got[1:]).any()
    # masks: a slot >= S is not held (no clipping onto the last slot's table row)
    assert not np.asarray(cz.twin_row_mask(cache, 4, jnp.array([2, 5]), jnp.array([0, 0]))).any()


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_gather_flags_bad_slot_and_layer(backend):
    cache = _written()
    f = jax.jit(lambda c, layer, s, i: cz.gather_compressed(c, 4, layer, s, i, backend=backend))
    idx = jnp.array([[0, 20, 59, -1], [0, 4, 8, -1], [1, 2, 3, -1], [0, 1, 2, 3]], jnp.int32)
    got = np.asarray(f(cache, jnp.int32(1), jnp.array([0, 1, -1, 2]), idx), np.float32)
    want = np.asarray(cz.gather_compressed(cache, 4, 1, np.array([0, 1]), np.asarray(idx[:2]), backend="reference"),
                      np.float32)
    np.testing.assert_array_equal(got[:2], want)
    assert not got[2].any() and np.isnan(got[3]).all()
    assert np.isnan(np.asarray(f(cache, jnp.int32(5), jnp.array([0, 1, -1, 0]), idx), np.float32)).all()
