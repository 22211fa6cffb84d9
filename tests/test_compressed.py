"""Compressed-history groups (`jmixedkv.compressed`): geometry, the twin's row mask with a released page and
rows past the table's width, reference write + read vs a numpy model, and the Pallas gather over compressed rows."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmixedkv import compressed as cz
from jmixedkv import nvfp4
from jmixedkv.config import KVCacheConfig
from test_stage import assert_bitexact

CFG = KVCacheConfig("mixed_nvfp4_bf16", first_n=64, last_n=100, page_size=8, max_draft_len=4)
D = 64
# NB: jitted and eager `nvfp4.quantize` differ on CPU (XLA reassociates ``(1/gs) * (amax/6)``); the reference
# write runs jitted, so the expected rows use the jitted codec too.
_quantize = jax.jit(nvfp4.quantize)


def test_geometry():
    g4, g128 = cz.compressed_geometry(CFG, 4), cz.compressed_geometry(CFG, 128)
    assert (g4.first_c, g4.last_c, g4.num_fixed, g4.num_ring) == (16, 25, 2, 5)
    assert (g128.first_c, g128.last_c, g128.num_fixed, g128.num_ring) == (1, 1, 1, 2)
    g = cz.compressed_geometry(KVCacheConfig("mixed_nvfp4_bf16", first_n=5, page_size=8), 4)
    assert (g.first_c, g.last_c, g.num_fixed, g.num_ring) == (2, 0, 1, 0)
    with pytest.raises(ValueError, match="ratio must be an integer >= 1"):
        cz.compressed_geometry(CFG, 0)


def make_cache(ratios=(4, 128), seed=0):
    rng = np.random.default_rng(seed)
    cache = cz.init_compressed(CFG, ratios, num_layers=2, num_kv_heads=1, head_dim=D, kv_factor=1, num_pages=20,
                               max_seqs=2, max_pages_per_seq=8, gs=0.02, poison=True)
    for r in ratios:
        geom = cache.geometry(r)
        low = rng.permutation(20)[:16].reshape(2, 8)
        twin = rng.permutation(2 * geom.twin_width).reshape(2, geom.twin_width)
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
    retained = (cpos < geom.first_c) | (cpos >= n_c[seqs] - geom.last_c)
    gs = np.asarray(cache.levels[4].low.gs)
    for layer in (0, 1):
        got = cz.read_compressed_reference(cache, 4, layer, jnp.asarray(seqs), jnp.asarray(cpos))
        data, sc = _quantize(x[layer], gs[layer][None, :, None])   # jitted, like the write
        deq = nvfp4.dequantize(data, sc, gs[layer][None, :, None], jnp.bfloat16)
        want = np.where((retained & held)[:, None, None, None], np.asarray(x[layer]), np.asarray(deq))
        assert_bitexact(got, want)
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
        assert_bitexact(got, ref)
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
    assert_bitexact(x[1:], twin[ht[1, 0], 0, 0, jnp.array([0, 1])][:, None, None])   # both on fixed page 0


def test_pure_and_jittable():
    cache = make_cache()
    before = jax.tree.map(np.asarray, cache)
    f = jax.jit(lambda c, x, s, p: cz.write_compressed_reference(c, 4, x, 0, s, p))
    out = f(cache, jnp.ones((3, 1, 1, D), jnp.bfloat16), jnp.array([0, 0, 1]), jnp.array([0, 1, 0]))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a).view(np.uint8),
                                                            np.asarray(b).view(np.uint8)), cache, before)
    assert jax.tree.structure(out) == jax.tree.structure(cache)


@pytest.mark.gpu
@pytest.mark.skipif(not jax.default_backend() == "gpu", reason="needs a GPU")
def test_compressed_gather_on_gpu_bitexact():
    rng = np.random.default_rng(5)
    cache = make_cache()
    cache, _, _, _ = _write_all(cache, 4, [240, 36], rng)
    cache = cz.release_twin_page(cache, 4, 0, 1)
    idx = np.sort(rng.choice(60, (2, 32)), axis=1).astype(np.int32)
    idx[1] = np.where(idx[1] < 9, idx[1], -1)
    ref = cz.gather_compressed(cache, 4, 1, np.array([0, 1]), idx, backend="reference")
    got = cz.gather_compressed(cache, 4, 1, np.array([0, 1]), idx, backend="pallas")
    assert_bitexact(got, ref)
