"""Mosaic GPU decode attention (`pallas_kernels.decode.mosaic_sm90`) against float32 `attention_reference` over
`stage_reference` (the cache a reader must see), on the poisoned caches of `helpers.decode_state`.

What CPU CI checks: the kernel body's semantics in the Mosaic GPU interpreter (``interpret=True``: TMA ring,
barriers, wgmma on shared-memory operands, page-table indexing, masks, split-K merge, the retained-row / causal
edge path, out-of-bounds reads raise) with the dequantization in jnp, and that the compiled form (inline-PTX
dequantization, register-A wgmma, swizzled tiles) lowers for CUDA. What it cannot check: ptxas, TMA descriptors and
runtime faults, the inline PTX's arithmetic, timing; those run under the ``gpu`` marker on the H200.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmixedkv.decode import decode_attention
from jmixedkv.compat import cross_lower_cuda, on_gpu
from jmixedkv.layout import TwinGeometry
from jmixedkv.pools import kernel_arrays
from pallas_kernels import decode as dispatch
from pallas_kernels.decode import common, config as dcfg, mosaic_sm90 as mosaic
from pallas_kernels.decode.common import f16_queries
from pallas_kernels.decode.config import MosaicConfig
from pallas_kernels.decode.mosaic_sm90 import supported
from helpers import decode_queries as queries, decode_reference as reference, decode_state as make_state
from helpers import rel_l2, zero_decode_operands



def _lse_close(lse, ref_lse, atol=1e-4):
    lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
    same_inf = np.isinf(lse) & (lse == ref_lse)
    with np.errstate(invalid="ignore"):
        close = np.abs(lse - ref_lse) <= atol + 1e-5 * np.abs(ref_lse)
    assert np.all(same_inf | close), (lse, ref_lse)


_CONFIG_FIELDS = {f.name for f in dataclasses.fields(MosaicConfig)}


def paged_decode_attention_mgpu(*args, partials_only=False, edge_splits=None, edge_block_k=None, edge_warps=None,
                                **kw):
    """The Mosaic GPU backend with the tuning fields of ``kw`` as its `MosaicConfig` (``edge_*``: its edge
    `TritonConfig`'s ``num_splits``, ``block_k``, ``num_warps``); ``partials_only``: the kernel's raw partials
    (`kernel_partials`)."""
    edge = dataclasses.replace(MosaicConfig().edge, num_splits=edge_splits, **{
        k: v for k, v in (("block_k", edge_block_k), ("num_warps", edge_warps)) if v is not None})
    config = MosaicConfig(edge=edge, **{k: kw.pop(k) for k in list(kw) if k in _CONFIG_FIELDS})
    return (mosaic.kernel_partials if partials_only else mosaic.paged_decode_attention)(*args, config=config, **kw)


def preferred(**kw):
    """Whether the entry point without a config runs the Mosaic GPU kernel (`choose_backend`)."""
    return dispatch.choose_backend(**kw) == "mosaic"


def _run(st, q, layer, **kw):
    cfg, pools = st.config, st.pools[0]
    mixed = st.kinds[0] == "mixed"
    return paged_decode_attention_mgpu(
        q, st.page_table, st.kv_lens, layer, kernel_arrays(pools.low), kernel_arrays(pools.high) if mixed else None,
        st.high_table if mixed else None, geom=cfg.twin if mixed else None, **kw)


# ------------------------------------------------------------------------------------------ interpret mode
@pytest.mark.parametrize("edge_splits,edge_block_k", [(1, 64), (3, 64), (2, 32), (1, 16)])
def test_interpret_mixed_page16_splits_poisoned_float32(edge_splits, edge_block_k):
    """Lengths 0, 1, page-1, page, page+1, long (retained windows overlap for the short rows); 2 splits, NaN-poisoned
    rows past n and outside the retained set; float32 output against the float32 reference. Queries on M (the
    default form above `KEYS_ON_M_ROWS` rows, forced here). The edge blocks' Triton kernel in 1 or 3 splits (the
    other tests run `default_edge_splits`: 2 at this batch), in steps of 64 / 32 / 16 tokens (the interior it skips is
    counted in the kernel's 64-token blocks)."""
    st = make_state(lens=(0, 1, 15, 16, 17, 150), first_n=5, last_n=20, d=128, heads=1, max_draft_len=2)
    q = queries(st, 1, 4)
    seq = jnp.arange(st.max_seqs, dtype=jnp.int32)
    ref_o, ref_lse = reference(st, 1, q, seq)
    out, lse = _run(st, q, 1, num_splits=2, interpret=True, out_dtype=jnp.float32, keys_on_m=False,
                    edge_splits=edge_splits, edge_block_k=edge_block_k)
    assert np.isfinite(np.asarray(out)).all()
    assert rel_l2(out, ref_o) < 1e-4
    _lse_close(lse, ref_lse)
    assert (np.asarray(out[0]) == 0).all() and np.isneginf(np.asarray(lse[0])).all()   # length 0: no key


@pytest.mark.parametrize("pad", ["scales", "data"])
def test_interpret_pools_of_different_page_counts(pad):
    """`jmixedkv.state` pads the data and the scale pool past the offset hole each on its own, so they can hold
    different page counts (32832 vs 65537 pages at the whole-step benchmark's 32 x 64 x 8k cache). Layer 1 of pools
    where one of them has 3 extra NaN-poisoned pages: each pool is indexed by its own page count."""
    import dataclasses
    st = make_state(lens=(1, 17, 150), first_n=5, last_n=20, d=128, heads=2, max_draft_len=2)
    pools = st.pools[0]
    arr = getattr(pools.low, pad)
    poison = jnp.full(arr.shape[:1] + (3,) + arr.shape[2:], 0x7F, jnp.uint8)
    if arr.dtype != jnp.uint8:
        poison = jax.lax.bitcast_convert_type(poison, arr.dtype)                 # e4m3 0x7F: NaN
    low = dataclasses.replace(pools.low, **{pad: jnp.concatenate([arr, poison], axis=1)})
    assert low.data.shape[1] != low.scales.shape[1]
    st = dataclasses.replace(st, pools=(dataclasses.replace(pools, low=low),))
    q = queries(st, 1, 8)
    seq = jnp.arange(st.max_seqs, dtype=jnp.int32)
    ref_o, ref_lse = reference(st, 1, q, seq)
    out, lse = _run(st, q, 1, num_splits=2, interpret=True, out_dtype=jnp.float32)
    assert rel_l2(out, ref_o) < 1e-4
    _lse_close(lse, ref_lse)


def test_interpret_page_table_copy_at_the_table_end():
    """A page table whose width is a multiple of 4 ids and at least the kernel's page-id copy (64 ids here) goes in
    unpadded; a split whose pages lie past the table's last 64 columns copies those last columns (the copy is
    clamped so it never leaves the table) and indexes them from there. Width 72, 4 splits of ~1100 tokens: splits
    2 and 3 start past column 8. Against the float32 reference, with -1 in the unused columns."""
    st = make_state(lens=(1, 700, 1100), first_n=5, last_n=20, d=128, heads=2, max_draft_len=2)
    width = 72
    assert st.page_table.shape[1] <= width and -(-1100 // 16) > width - 64 + 32     # pages past the clamp
    pt = jnp.pad(st.page_table, ((0, 0), (0, width - st.page_table.shape[1])), constant_values=-1)
    q = queries(st, 1, 4)
    seq = jnp.arange(st.max_seqs, dtype=jnp.int32)
    ref_o, ref_lse = reference(st, 1, q, seq)
    cfg, pools = st.config, st.pools[0]
    out, lse = paged_decode_attention_mgpu(
        q, pt, st.kv_lens, 1, kernel_arrays(pools.low), kernel_arrays(pools.high), st.high_table, geom=cfg.twin,
        num_splits=4, interpret=True, out_dtype=jnp.float32)
    assert rel_l2(out, ref_o) < 1e-4
    _lse_close(lse, ref_lse)


@pytest.mark.parametrize("tq,hq", [(1, 4), (2, 8), (3, 8)])
def test_interpret_keys_on_m_matches_reference(tq, hq):
    """The keys-on-M form (``S^T = K Q^T``, query rows on wgmma's N side: 8 for Tq 1 x GQA 4 (`MIN_KM_ROWS`), 16 for
    Tq 2 x GQA 8, 32 for Tq 3 x GQA 8) on the poisoned page-16 cache with overlapping retained windows, 2 splits,
    float32 output."""
    st = make_state(lens=(0, 1, 15, 16, 17, 150), first_n=5, last_n=20, d=128, heads=1, max_draft_len=2)
    q = queries(st, tq, hq)
    seq = jnp.arange(st.max_seqs, dtype=jnp.int32)
    ref_o, ref_lse = reference(st, 1, q, seq)
    out, lse = _run(st, q, 1, num_splits=2, interpret=True, out_dtype=jnp.float32, keys_on_m=True)
    assert np.isfinite(np.asarray(out)).all()
    assert rel_l2(out, ref_o) < 1e-4
    _lse_close(lse, ref_lse)
    assert (np.asarray(out[0]) == 0).all() and np.isneginf(np.asarray(lse[0])).all()   # length 0: no key


@pytest.mark.parametrize("tq,hq", [(1, 8), (4, 8)])
def test_interpret_keys_on_m_rows_of_unequal_magnitude(tq, hq):
    """The keys-on-M form's query rows share one power-of-two shift into f16 (the largest row's; one row multiplier
    per CTA): rows 2^-10 and 2^-14 times the largest (and one all zero) still match the float64 reference, each head
    judged on its own output; `f16_queries` with ``rows_share_shift`` gives one shift per group of rows, the group's
    largest element scaled into ``[2^7, 2^8)``."""
    st = make_state(lens=(0, 1, 15, 16, 17, 150), first_n=5, last_n=20, d=128, heads=1, max_draft_len=3)
    q = queries(st, tq, hq)
    row_scale = np.ones(hq, np.float32)
    row_scale[1], row_scale[2], row_scale[3] = 2.0 ** -10, 2.0 ** -14, 0.0
    q = (q.astype(jnp.float32) * row_scale[None, None, :, None]).astype(q.dtype)
    seq = jnp.arange(st.max_seqs, dtype=jnp.int32)
    ref_o, ref_lse = reference(st, 1, q, seq)
    out, lse = _run(st, q, 1, num_splits=2, interpret=True, out_dtype=jnp.float32, keys_on_m=True)
    for h in range(hq):      # each head on its own: a small row's error is judged against its own output
        assert rel_l2(out[1:, :, h], ref_o[1:, :, h]) < 1e-4, h
    _lse_close(lse, ref_lse)
    q16, shift = f16_queries(jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 8, 128)), jnp.float32)
                             * jnp.asarray(2.0 ** np.arange(8), jnp.float32)[:, None], rows_share_shift=True)
    assert (shift == shift[..., :1]).all() and (np.abs(np.asarray(q16, np.float32)).max(axis=(-2, -1)) < 256).all()
    assert (np.abs(np.asarray(q16, np.float32)).max(axis=(-2, -1)) >= 128).all()


@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")   # the bad rows' own inf * 0
def test_interpret_keys_on_m_nonfinite_row_stays_in_its_row():
    """A query row holding inf / NaN (bad input) under the keys-on-M form's shared shift: the rows beside it in its
    CTA (the other heads of its KV group, its other query tokens) still match the reference, also with |q| > 256
    (a shift taken over the non-finite row too would scale them past f16's range: inf logits, NaN outputs); other
    sequences are bitwise unchanged against a run without the bad row."""
    st = make_state(lens=(0, 1, 15, 16, 17, 150), first_n=5, last_n=20, d=128, heads=1, max_draft_len=3)
    tq, hq = 2, 8
    q = queries(st, tq, hq).astype(jnp.float32) * 100.0                        # |q| up to a few hundred
    assert float(jnp.max(jnp.abs(q))) > 256
    seq = jnp.arange(st.max_seqs, dtype=jnp.int32)
    ref_o, _ = reference(st, 1, q.astype(jnp.bfloat16), seq)
    kw = dict(num_splits=2, interpret=True, out_dtype=jnp.float32, keys_on_m=True)
    clean, clean_lse = _run(st, q.astype(jnp.bfloat16), 1, **kw)
    bad = q.at[5, 0, 1].set(jnp.inf).at[5, 1, 2, 5].set(jnp.nan).astype(jnp.bfloat16)   # sequence 5 only
    out, lse = _run(st, bad, 1, **kw)
    ok = np.ones((tq, hq), bool)
    ok[0, 1] = ok[1, 2] = False
    o5, r5 = np.asarray(out[5]), np.asarray(ref_o[5])         # 150 tokens: interior blocks in the Mosaic kernel
    assert np.isfinite(o5[ok]).all()
    assert rel_l2(o5[ok], r5[ok]) < 1e-4
    others = np.arange(st.max_seqs) != 5
    np.testing.assert_array_equal(np.asarray(out)[others], np.asarray(clean)[others])
    np.testing.assert_array_equal(np.asarray(lse)[others], np.asarray(clean_lse)[others])


@pytest.mark.parametrize("min_rows", [8, 16])
@pytest.mark.parametrize("tq,hq", [(1, 4), (2, 4), (1, 8)])
def test_interpret_keys_on_m_min_rows(tq, hq, min_rows):
    """``min_km_rows``: up to 8 query rows (GQA 4 Tq 1-2, GQA 8 Tq 1) on wgmma's N side as 8 (`MIN_KM_ROWS`, the
    default) or 16 (the kernel's partials have that many rows), against the reference on the poisoned page-16 cache,
    2 splits, float32 output. The interpreter runs the N = 8 softmax and wgmma shapes; the compiled form's
    transposed store of P (`_store_keys_minor`) is checked by `test_keys_on_m_cross_lowers_for_cuda` here and on the
    H200 by `test_gpu_keys_on_m_matches_reference` (``min_rows`` 8)."""
    st = make_state(lens=(0, 1, 15, 16, 17, 150), first_n=5, last_n=20, d=128, heads=1, max_draft_len=2)
    q = queries(st, tq, hq)
    seq = jnp.arange(st.max_seqs, dtype=jnp.int32)
    ref_o, ref_lse = reference(st, 1, q, seq)
    kw = dict(num_splits=2, interpret=True, keys_on_m=True, min_km_rows=min_rows)
    out, lse = _run(st, q, 1, out_dtype=jnp.float32, **kw)
    assert rel_l2(out, ref_o) < 1e-4
    _lse_close(lse, ref_lse)
    o_part, m_part, _ = _run(st, q, 1, partials_only=True, **kw)
    assert m_part.shape[-1] == min_rows and o_part.shape[1:] == (min_rows, 2, 64), (o_part.shape, m_part.shape)


@pytest.mark.parametrize("page,edge_block_k,km", [(32, 32, True), (64, 16, False), (128, 32, True)])
def test_interpret_pages_32_to_128(page, edge_block_k, km):
    """Pages of 32 / 64 / 128 tokens: first_n = 64 puts the interior's first block at 1, so split starts fall on
    page-table columns that are not a multiple of 4 (the page ids are copied from the aligned column at or below: a
    copy from such a column faulted on the H200); 3 splits, lengths 0, 1, page-1, page, page+1, long; NaN-poisoned
    rows. At page 128 the interior is counted in 128-token blocks (the edge kernel's block is a whole page)."""
    st = make_state(lens=(0, 1, page - 1, page, page + 1, 700), first_n=64, last_n=20, page=page, d=128, heads=1,
                    max_draft_len=2)
    q = queries(st, 1, 4)
    seq = jnp.arange(st.max_seqs, dtype=jnp.int32)
    ref_o, ref_lse = reference(st, 1, q, seq)
    out, lse = _run(st, q, 1, num_splits=3, interpret=True, out_dtype=jnp.float32, keys_on_m=km,
                    edge_block_k=edge_block_k)
    assert np.isfinite(np.asarray(out)).all()
    assert rel_l2(out, ref_o) < 1e-4
    _lse_close(lse, ref_lse)


@pytest.mark.parametrize("page,tq,hq,km,twin", [(16, 1, 3, True, True), (16, 2, 8, None, True),
                                                (64, 2, 4, False, False), (128, 1, 7, None, True)])
def test_interpret_head_dim_64_as_token_pairs(page, tq, hq, km, twin):
    """head_dim 64 read as head_dim 128 over token pairs (`as_token_pairs`): pages of 16 (8-row TMA boxes with
    64-byte scale rows), 64 and 128 tokens; GQA 3 (SmolLM2), 4, 7 and 8; keys on M and queries on M; with and
    without a twin; lengths 0, 1, page-1, page, page+1, odd and long ones (an interior that starts and ends on a
    pair); 3 splits; NaN-poisoned rows; float32 output against the float32 reference."""
    st = make_state("mixed_nvfp4_bf16" if twin else "nvfp4", lens=(0, 1, page - 1, page, page + 1, 701, 1200),
                    first_n=64 if twin else 0, last_n=20 if twin else 0, page=page, d=64, heads=1, max_draft_len=2)
    q = queries(st, tq, hq)
    seq = jnp.arange(st.max_seqs, dtype=jnp.int32)
    ref_o, ref_lse = reference(st, 1, q, seq)
    kw = {} if km is None else dict(keys_on_m=km)
    out, lse = _run(st, q, 1, num_splits=3, interpret=True, out_dtype=jnp.float32, **kw)
    assert np.isfinite(np.asarray(out)).all()
    assert rel_l2(out, ref_o) < 1e-4
    _lse_close(lse, ref_lse)
    if page == 16 and tq == 1:       # the kernel attended keys itself: its partials hold mass for the long rows
        _, _, l = _run(st, q, 1, num_splits=3, interpret=True, partials_only=True, **kw)
        assert float(jnp.asarray(l).sum()) > 0


@pytest.mark.parametrize("page,tq,hq,twin,config", [(16, 1, 2, True, {}), (64, 1, 4, False, dict(qk_in_turn=True)),
                                                    (32, 4, 8, True, dict(v_in_turn=False))])
def test_interpret_head_dim_256_in_column_blocks(page, tq, hq, twin, config):
    """head_dim 256 as two column blocks of 128 (`dim_blocks`: each block's halves dequantized from its 64 bytes and
    8 scales of the 128-byte row, its Q K^T products summed into one score tile, its own two P V accumulators; scale
    rows of 8 tokens, `scale_box`): Gemma-2's GQA 2 at Tq 1 (N = 8), plain NVFP4 with K's halves in turn, Tq 4 x
    GQA 8 (N = 32, the most the form takes) with a pair of V tiles per block (not `MosaicConfig.v_in_turn`'s one pair);
    pages 16 / 32 / 64; lengths 0, 1, page-1, page, page+1, long; 3 splits; NaN-poisoned rows; float32 output against
    the float32 reference, and (page 16) the kernel attended keys itself (its partials hold mass)."""
    st = make_state("mixed_nvfp4_bf16" if twin else "nvfp4", lens=(0, 1, page - 1, page, page + 1, 700),
                    first_n=64 if twin else 0, last_n=20 if twin else 0, page=page, d=256, heads=1, max_draft_len=3)
    q = queries(st, tq, hq)
    seq = jnp.arange(st.max_seqs, dtype=jnp.int32)
    ref_o, ref_lse = reference(st, 1, q, seq)
    out, lse = _run(st, q, 1, num_splits=3, interpret=True, out_dtype=jnp.float32, **config)
    assert np.isfinite(np.asarray(out)).all()
    assert rel_l2(out, ref_o) < 1e-4
    _lse_close(lse, ref_lse)
    if page == 16:
        o, _, l = _run(st, q, 1, num_splits=3, interpret=True, partials_only=True, **config)
        assert o.shape[2:] == (4, 64) and float(jnp.asarray(l).sum()) > 0


def test_kernel_columns_by_head_dim():
    """`kernel_columns`: the output's natural columns from the kernel's ``[parts, 64]`` partials, a permutation;
    at head_dim 256 each column block of 128 maps into its own two parts as head_dim 128 does."""
    c128, c256 = mosaic.kernel_columns(128), mosaic.kernel_columns(256)
    assert sorted(c256) == list(range(256)) and sorted(c128) == list(range(128))
    assert (c256[:128] == c128).all() and (c256[128:] == c128 + 128).all()
    assert [mosaic.dim_blocks(d) for d in (64, 128, 256)] == [1, 1, 2]
    assert mosaic.scale_box(64, 16) == (8, 128) and mosaic.scale_box(16, 16) == (2, 128)
    assert mosaic.scale_box(64) == (4, 128) and mosaic.scale_box(8) == (1, 64)


def test_as_token_pairs_views_without_copy():
    """`as_token_pairs`: the pools' pair view is a reshape of the same bytes (row ``i`` = tokens ``2 i, 2 i + 1``) and
    each query row becomes ``[q, 0]`` and ``[0, q]`` as consecutive heads."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 1, 6, 64)), jnp.bfloat16)
    data = jnp.asarray(rng.integers(0, 256, (1, 3, 2, 2, 16, 32)), jnp.uint8)
    scales = jnp.asarray(rng.integers(0, 256, (1, 3, 2, 2, 16, 4)), jnp.uint8)
    q2, d2, s2 = mosaic.as_token_pairs(q, data, scales)
    assert q2.shape == (2, 1, 12, 128) and d2.shape == (1, 3, 2, 2, 8, 64) and s2.shape == (1, 3, 2, 2, 8, 8)
    np.testing.assert_array_equal(np.asarray(d2[..., 3, 32:]), np.asarray(data[..., 7, :]))
    np.testing.assert_array_equal(np.asarray(s2[..., 3, :4]), np.asarray(scales[..., 6, :]))
    np.testing.assert_array_equal(np.asarray(q2[:, :, 1::2, 64:]), np.asarray(q))
    np.testing.assert_array_equal(np.asarray(q2[:, :, 0::2, :64]), np.asarray(q))
    assert not np.asarray(q2[:, :, 0::2, 64:], np.float32).any() and not np.asarray(q2[:, :, 1::2, :64],
                                                                                   np.float32).any()


@pytest.mark.parametrize("stages", [2, 3])
def test_interpret_keys_on_m_ring_wraps(stages):
    """Keys on M over many interior blocks in one split (up to 15 blocks of 64 tokens), so the TMA ring of 2 or 3
    slots wraps several times: the next block's copy is issued after the key maximum's barrier, into the slot the
    previous block read."""
    st = make_state(lens=(0, 450, 1000), first_n=5, last_n=20, d=128, heads=1, max_draft_len=2)
    q = queries(st, 1, 4)
    seq = jnp.arange(st.max_seqs, dtype=jnp.int32)
    ref_o, ref_lse = reference(st, 1, q, seq)
    out, lse = _run(st, q, 1, num_splits=1, stages=stages, interpret=True, out_dtype=jnp.float32, keys_on_m=True)
    assert rel_l2(out, ref_o) < 1e-4
    _lse_close(lse, ref_lse)


def test_interpret_through_public_entry_nvfp4_verify(monkeypatch):
    """``JMIXEDKV_DECODE_KERNEL=mgpu`` routes `decode_attention` to this kernel: plain NVFP4 pages (no twin),
    Tq = 2 (causal among the new tokens, handled on the edge path), GQA 8, lengths 1 < Tq..., page +- 1."""
    monkeypatch.setenv(dispatch.KERNEL_ENV, "mgpu")
    calls = []
    real = mosaic.paged_decode_attention
    monkeypatch.setattr(mosaic, "paged_decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    jax.clear_caches()                    # the kernel choice is made at trace time
    st = make_state("nvfp4", first_n=0, last_n=0, lens=(1, 15, 17, 100), page=16, d=128, heads=1, max_draft_len=1)
    q = queries(st, 2, 8)
    seq = jnp.arange(st.max_seqs, dtype=jnp.int32)
    out, lse = decode_attention(st, 0, q, seq, backend="pallas", num_splits=2)
    jax.clear_caches()
    assert calls, "decode_attention did not run the Mosaic GPU kernel"
    ref_o, ref_lse = reference(st, 0, q, seq)
    assert out.dtype == st.config.attention_dtype and out.shape == q.shape
    assert rel_l2(np.asarray(out, np.float32), np.asarray(ref_o.astype(out.dtype), np.float32)) < 1e-3
    _lse_close(lse, ref_lse)


def test_supported_and_dispatch_choice(monkeypatch):
    assert supported(head_dim=128, page=16, tq=1, group=4)
    assert supported(head_dim=128, page=16, tq=4, group=16, high_dtype=jnp.bfloat16)
    # head_dim 64 as token pairs: twice the query rows
    assert supported(head_dim=64, page=16, tq=1, group=3) and supported(head_dim=64, page=128, tq=4, group=8)
    assert not supported(head_dim=64, page=16, tq=8, group=8)            # 2 x 64 query rows > 64
    assert not supported(head_dim=32, page=16, tq=1, group=4) and not supported(head_dim=512, page=16, tq=1, group=4)
    # head_dim 256 as two column blocks: keys on M only (<= 32 query rows)
    assert supported(head_dim=256, page=16, tq=1, group=2) and supported(head_dim=256, page=64, tq=4, group=8)
    assert not supported(head_dim=256, page=16, tq=5, group=8)
    assert supported(head_dim=256, page=128, tq=1, group=2)              # its edge kernel unpipelined (edge_config)
    assert not supported(head_dim=128, page=8, tq=1, group=4)
    for page in (32, 64, 128):        # run on the H200 since the page-table copy starts at an aligned column
        assert supported(head_dim=128, page=page, tq=1, group=4)
    assert not supported(head_dim=128, page=256, tq=1, group=4)
    assert not supported(head_dim=128, page=16, tq=5, group=16)          # 80 query rows > 64
    assert not supported(head_dim=128, page=16, tq=1, group=4, high_dtype=jnp.float8_e4m3fn)
    assert not supported(head_dim=128, page=16, tq=1, group=4, sliding_window=128)
    assert not supported(head_dim=128, page=16, tq=1, group=4, soft_cap=30.0)
    # the edge blocks' Triton kernel: 2 splits while one program per (row, KV head) leaves SMs idle
    assert [dcfg.mosaic_edge_splits(b, 8) for b in (1, 16, 17, 64)] == [2, 2, 1, 1]
    # split-K: ~4 CTAs per SM, at most MAX_SPLIT_BLOCKS (128) 64-token blocks per CTA (64 x 32k: 4, 16 x 128k: 16)
    assert [dcfg.mosaic_num_splits(b, 8, blocks) for b, blocks in
            ((1, 2048), (16, 512), (64, 128), (64, 512), (16, 2048), (64, 2048), (1, 8))] == [64, 8, 2, 4, 16, 16, 8]
    # auto (the default): this kernel on Hopper wherever supported, compiled
    monkeypatch.delenv(dispatch.KERNEL_ENV, raising=False)
    assert not preferred(head_dim=128, page=16, tq=4, group=8)           # not on a Hopper GPU here
    monkeypatch.setattr(dispatch, "on_hopper", lambda: True)
    assert preferred(head_dim=128, page=16, tq=1, group=4)
    assert preferred(head_dim=128, page=16, tq=1, group=16)
    assert preferred(head_dim=128, page=16, tq=4, group=8, high_dtype=jnp.bfloat16)
    assert not preferred(head_dim=128, page=16, tq=4, group=8, interpret=True)
    assert preferred(head_dim=128, page=64, tq=4, group=8)
    assert preferred(head_dim=64, page=16, tq=1, group=3)
    assert preferred(head_dim=256, page=16, tq=1, group=2)
    assert not preferred(head_dim=256, page=16, tq=8, group=8)           # 64 rows: keys on M only at head_dim 256
    assert not preferred(head_dim=128, page=8, tq=4, group=8)            # unsupported: Triton
    monkeypatch.setenv(dispatch.KERNEL_ENV, "triton")
    assert not preferred(head_dim=128, page=16, tq=4, group=8)
    monkeypatch.setattr(dispatch, "on_hopper", lambda: False)
    monkeypatch.setenv(dispatch.KERNEL_ENV, "mgpu")                   # wherever supported, interpret too
    assert preferred(head_dim=128, page=16, tq=1, group=4, interpret=True)
    assert not preferred(head_dim=128, page=16, tq=1, group=4, soft_cap=5.0)
    monkeypatch.setenv(dispatch.KERNEL_ENV, "cuda")
    with pytest.raises(ValueError, match="JMIXEDKV_DECODE_KERNEL='cuda'"):
        preferred(head_dim=128, page=16, tq=1, group=4)


@pytest.mark.parametrize("tq,hq,km", [(1, 4, True), (4, 4, True), (2, 8, True), (3, 8, True), (4, 8, True),
                                       (3, 16, False), (4, 16, False)])
def test_default_form_by_query_rows(tq, hq, km):
    """``keys_on_m=None``: keys on M for Tq x GQA <= `KEYS_ON_M_ROWS` query rows, queries on M above (the raw
    partials are ``[N rows, 2 halves, 64 dims]`` per CTA for keys on M, N the rows padded to a power of two >=
    `MIN_KM_ROWS` = 8, ``[64 rows, 2, 64]`` for queries on M)."""
    st = make_state(lens=(3, 40), first_n=4, last_n=8, d=128, heads=1, max_draft_len=3)
    q = queries(st, tq, hq)
    o, _, _ = jax.eval_shape(lambda q: _run(st, q, 1, num_splits=1, interpret=True, partials_only=True), q)
    assert dcfg.MIN_KM_ROWS == 8
    rows = max(8, 1 << (tq * hq - 1).bit_length())
    assert o.shape[1:] == ((rows, 2, 64) if km else (64, 2, 64))
    assert (tq * hq <= dcfg.KEYS_ON_M_ROWS) == km


def test_edge_steps_default_and_16(monkeypatch):
    """The edge kernel runs `EDGE_BLOCK_K` (32) token steps by default at every shape, where its programs (B x H)
    outnumber the SMs too (the 16-token rule went with the twin's split loads, bench/RESULTS.md, '32-token edge
    steps everywhere'); ``edge_block_k=16`` runs 16-token steps (the kernel's name carries its step, ``_k16_``).
    Both float32 outputs against the reference, with `common.num_sms` lowered to 4 so that a batch of 6 has more
    programs than SMs."""
    assert dcfg.EDGE_BLOCK_K == 32
    monkeypatch.setattr(common, "num_sms", lambda: 4)
    st = make_state(lens=(0, 1, 15, 17, 40, 150), first_n=5, last_n=20, d=128, heads=1, max_draft_len=2)
    q = queries(st, 1, 4)
    seq = jnp.arange(st.max_seqs, dtype=jnp.int32)
    ref_o, ref_lse = reference(st, 1, q, seq)
    jax.clear_caches()                   # (traces hold `num_sms`-dependent defaults: none made here may leak out)
    try:
        for step, name in ((None, "_k32_"), (16, "_k16_")):
            call = lambda q, step=step: _run(st, q, 1, interpret=True, out_dtype=jnp.float32,  # noqa: E731
                                             edge_block_k=step)
            assert name in str(jax.make_jaxpr(call)(q)), step
            out, lse = call(q)
            assert rel_l2(out, ref_o) < 1e-4, step
            _lse_close(lse, ref_lse)
    finally:
        jax.clear_caches()


def test_wide_column_order():
    """`to_wide` is the `WIDE_COLUMNS` gather (a thread's WGMMA columns ``2 (lane % 4) + 8 j + e`` <- its 16 contiguous
    bytes ``16 (lane % 4) + 2 j + e``) and `from_wide` its inverse."""
    cols = mosaic.WIDE_COLUMNS
    assert sorted(cols) == list(range(64))
    for lane in range(32):
        quad = lane % 4
        held = [2 * quad + 8 * j + e for j in range(8) for e in range(2)]
        assert sorted(cols[held]) == list(range(16 * quad, 16 * quad + 16))
    x = jnp.arange(3 * 64).reshape(3, 64)
    np.testing.assert_array_equal(mosaic.to_wide(x), np.asarray(x)[:, cols])
    np.testing.assert_array_equal(mosaic.from_wide(mosaic.to_wide(x)), x)
    np.testing.assert_array_equal(mosaic.to_wide(x, gather=True), np.asarray(x)[:, cols])


@pytest.mark.parametrize("splits,edge_splits,rows,r_pad", [(1, 1, 1, 8), (3, 2, 5, 8), (8, 1, 32, 32), (2, 2, 6, 64)])
def test_merge_with_edge_matches_float64(splits, edge_splits, rows, r_pad):
    """`_merge_with_edge` (the kernel's partials summed over its splits in the layout it writes, then permuted)
    against a float64 merge of the same partials in natural column order: the kernel's ``o [S, B, H, R, 2, 64]``
    (`WIDE_COLUMNS` order, low domain, ``m`` in base 2) and the edge kernel's ``[Se, B, H, R', 128]``. Random
    maxima over a wide range; a row with no key in any split (0 and -inf), rows with keys in one kernel only, padding
    rows holding NaN."""
    rng = np.random.default_rng(splits * 10 + rows)
    b, h, d = 2, 3, 128
    o = rng.normal(size=(splits, b, h, r_pad, 2, 64)).astype(np.float32)
    m2 = rng.uniform(-30, 30, size=(splits, b, h, r_pad)).astype(np.float32)
    l = rng.uniform(0.5, 40, size=(splits, b, h, r_pad)).astype(np.float32)
    oe = rng.normal(size=(edge_splits, b, h, r_pad, d)).astype(np.float32)
    me = rng.uniform(-20, 20, size=(edge_splits, b, h, r_pad)).astype(np.float32)
    le = rng.uniform(0.5, 40, size=(edge_splits, b, h, r_pad)).astype(np.float32)
    for a in (m2, me):                                   # (b 0, h 0, row 0): no key anywhere
        a[:, 0, 0, 0] = -1e30
    l[:, 0, 0, 0] = le[:, 0, 0, 0] = 0
    o[:, 0, 0, 0] = oe[:, 0, 0, 0] = 0
    m2[:, 1, 0], l[:, 1, 0], o[:, 1, 0] = -1e30, 0, 0    # (b 1, h 0): the edge kernel's keys only
    me[:, 1, 1], le[:, 1, 1], oe[:, 1, 1] = -1e30, 0, 0  # (b 1, h 1): the kernel's keys only
    o[:, :, :, rows:] = np.nan                           # padding rows are never read
    oe[..., rows:, :] = np.nan
    for a in (m2, l, me, le):
        a[..., rows:] = np.nan
    vmul = np.float32(0.37 * 2 ** -7)
    out, lse = mosaic._merge_with_edge(jnp.asarray(o), jnp.asarray(m2), jnp.asarray(l), jnp.asarray(oe),
                                            jnp.asarray(me), jnp.asarray(le), rows=rows, vmul=vmul)
    # float64 reference: natural columns (byte t of half c is column 2 t + c), natural log, one concatenated merge
    nat = np.zeros((splits, b, h, rows, d))
    nat[..., 2 * mosaic.WIDE_COLUMNS] = o[:, :, :, :rows, 0].astype(np.float64)
    nat[..., 2 * mosaic.WIDE_COLUMNS + 1] = o[:, :, :, :rows, 1].astype(np.float64)
    all_o = np.concatenate([nat * np.float64(vmul), oe[..., :rows, :]], 0)
    all_m = np.concatenate([m2[..., :rows] / np.log2(np.e), me[..., :rows]], 0).astype(np.float64)
    all_l = np.concatenate([l[..., :rows], le[..., :rows]], 0).astype(np.float64)
    m_g = all_m.max(0)
    w = np.exp(all_m - m_g)
    l_g = (w * all_l).sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        ref = np.where(l_g[..., None] > 0, (w[..., None] * all_o).sum(0) / l_g[..., None], 0.0)
        ref_lse = np.where(l_g > 0, m_g + np.log(l_g), -np.inf)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=2e-5, atol=1e-6)
    _lse_close(lse, ref_lse, atol=1e-5)
    assert (np.asarray(out[0, 0, 0]) == 0).all() and np.isneginf(np.asarray(lse[0, 0, 0]))


@pytest.mark.parametrize("splits,rows,r_pad", [(1, 3, 8), (3, 4, 8), (2, 16, 32)])
def test_merge_with_edge_token_pairs_matches_float64(splits, rows, r_pad):
    """`_merge_with_edge` with ``pairs``: the kernel's rows ``2 r`` and ``2 r + 1`` are query row ``r``'s two halves
    (even / odd tokens); each contributes the 64 columns of its token's V (columns 0-63 of row ``2 r``, 64-127 of row
    ``2 r + 1``), merged as two more splits with the edge kernel's head_dim-64 partials (float64 reference)."""
    rng = np.random.default_rng(splits + rows)
    b, h, d = 2, 2, 64
    o = rng.normal(size=(splits, b, h, r_pad, 2, 64)).astype(np.float32)
    m2 = rng.uniform(-30, 30, size=(splits, b, h, r_pad)).astype(np.float32)
    l = rng.uniform(0.5, 40, size=(splits, b, h, r_pad)).astype(np.float32)
    oe = rng.normal(size=(2, b, h, r_pad, d)).astype(np.float32)
    me = rng.uniform(-20, 20, size=(2, b, h, r_pad)).astype(np.float32)
    le = rng.uniform(0.5, 40, size=(2, b, h, r_pad)).astype(np.float32)
    m2[:, 1, 0], l[:, 1, 0], o[:, 1, 0] = -1e30, 0, 0    # (b 1, h 0): the edge kernel's keys only
    o[:, :, :, 2 * rows:] = np.nan                       # padding rows are never read
    m2[..., 2 * rows:] = l[..., 2 * rows:] = np.nan
    vmul = np.float32(0.37 * 2 ** -7)
    out, lse = mosaic._merge_with_edge(*(jnp.asarray(x) for x in (o, m2, l, oe, me, le)), rows=rows, vmul=vmul,
                                       pairs=True)
    nat = np.zeros((splits, b, h, 2 * rows, 128))
    nat[..., 2 * mosaic.WIDE_COLUMNS] = o[:, :, :, :2 * rows, 0].astype(np.float64)
    nat[..., 2 * mosaic.WIDE_COLUMNS + 1] = o[:, :, :, :2 * rows, 1].astype(np.float64)
    halves = np.concatenate([nat[..., 0::2, :64], nat[..., 1::2, 64:]], 0)        # [2 S, B, H, rows, 64]
    mk = m2[..., :2 * rows] / np.log2(np.e)
    all_o = np.concatenate([halves * np.float64(vmul), oe[..., :rows, :]], 0)
    all_m = np.concatenate([mk[..., 0::2], mk[..., 1::2], me[..., :rows]], 0).astype(np.float64)
    all_l = np.concatenate([l[..., 0:2 * rows:2], l[..., 1:2 * rows:2], le[..., :rows]], 0).astype(np.float64)
    m_g = all_m.max(0)
    w = np.exp(all_m - m_g)
    l_g = (w * all_l).sum(0)
    ref = (w[..., None] * all_o).sum(0) / l_g[..., None]
    np.testing.assert_allclose(np.asarray(out), ref, rtol=2e-5, atol=1e-6)
    _lse_close(lse, m_g + np.log(l_g), atol=1e-5)


def test_refuses_unsupported_configuration():
    st = make_state(lens=(3, 9), d=32, heads=1)
    q = queries(st, 1, 2)
    with pytest.raises(ValueError, match="D=32"):
        _run(st, q, 0)
    st = make_state(lens=(3, 9), d=256, heads=1)
    with pytest.raises(ValueError, match="head_dim 256 runs with keys on M only, got keys_on_m=False"):
        _run(st, queries(st, 1, 2), 0, interpret=True, keys_on_m=False)
    st = make_state(lens=(3, 9), d=128, heads=1)
    with pytest.raises(ValueError, match="v_in_turn=1 must be a bool"):
        MosaicConfig(v_in_turn=1)
    with pytest.raises(ValueError, match="min_km_rows=12 must be 8 or 16"):
        _run(st, queries(st, 1, 2), 0, interpret=True, min_km_rows=12)


# ------------------------------------------------------------------------------------------ CUDA cross-lowering
@pytest.mark.parametrize("page,tq,hq,twin", [(16, 1, 32, "bf16"), (16, 3, 16, "bf16"), (16, 1, 16, None),
                                             (16, 2, 16, "fp16"), (32, 1, 32, "bf16"), (64, 3, 16, "bf16"),
                                             (128, 1, 16, None)])
def test_cross_lowers_for_cuda(page, tq, hq, twin):
    """The compiled form (inline PTX dequantization, register-A wgmma, TMA ring) lowers for CUDA."""
    operands = zero_decode_operands(128, page, tq=tq, hq=hq, twin=twin)

    def fn(q, pt, lens, ht, low, high):
        return paged_decode_attention_mgpu(q, pt, lens, 1, low, high, ht if twin else None,
                                           geom=TwinGeometry(page, 5, 7, 1, 3), num_splits=2)
    text = cross_lower_cuda(fn, *operands)
    assert "mosaic_gpu" in text


def _lowered_with_twin(D, page, tq, hq, **config):
    """The Mosaic GPU backend cross-lowered for CUDA (its text) over zero pools of head_dim ``D`` with a bf16 twin:
    2 layers, 16 pages, 2 KV heads, batch 2, 2 splits, the `MosaicConfig` fields ``config``."""
    operands = zero_decode_operands(D, page, tq=tq, hq=hq)

    def fn(q, pt, lens, ht, low, high):
        return paged_decode_attention_mgpu(q, pt, lens, 1, low, high, ht, geom=TwinGeometry(page, 5, 7, 1, 3),
                                           num_splits=2, **config)
    return cross_lower_cuda(fn, *operands)


@pytest.mark.parametrize("page,tq,hq,km", [(16, 1, 6, None), (16, 4, 8, None), (32, 1, 8, True), (128, 2, 16, None)])
def test_head_dim_64_cross_lowers_for_cuda(page, tq, hq, km):
    """head_dim 64 as token pairs lowers for CUDA: 8-token TMA boxes with 64-byte scale rows at pages of 16; keys on
    M (N = 8 / 16 / 32 pair rows) and queries on M (64)."""
    assert "mosaic_gpu" in _lowered_with_twin(64, page, tq, hq, keys_on_m=km)


@pytest.mark.parametrize("page,tq,hq,config", [(16, 1, 2, {}), (16, 1, 8, dict(min_km_rows=16)), (16, 4, 8, {}),
                                               (64, 2, 4, dict(qk_in_turn=True)), (64, 1, 16, dict(qk_in_turn=False)),
                                               (32, 1, 4, dict(stages=3)), (16, 1, 2, dict(v_in_turn=False)),
                                               (16, 4, 8, dict(v_in_turn=False)), (128, 1, 4, {})])
def test_head_dim_256_cross_lowers_for_cuda(page, tq, hq, config):
    """head_dim 256 in two column blocks lowers for CUDA: 128-byte rows and scale rows of 8 tokens in the TMA boxes,
    N = 8 / 16 / 32 query rows, K's halves in turn and not, pages 16-128, a 3-stage ring, the blocks' V in turn (the
    default) and not."""
    assert "mosaic_gpu" in _lowered_with_twin(256, page, tq, hq, **config)


@pytest.mark.parametrize("D", [128, 64, 256])
def test_cross_lowers_for_cuda_under_shard_map(D):
    """The compiled kernel inside `jax.shard_map` over 4 devices, `jmixedkv.sharding`'s layout (pools and query
    heads sharded over KV heads: one KV head and its 4 query heads per shard), page 32, bf16 twin, lowers for CUDA
    with per-shard operands, at head_dim 128, 64 (token pairs) and 256 (column blocks). What this cannot check: a
    run on several GPUs (none lent) — and the interpreter cannot run it on several CPU devices (its barrier check is
    global across devices; README, Multi-GPU)."""
    from jax.sharding import PartitionSpec as P
    from jmixedkv import sharding
    assert len(jax.devices()) >= 4, "conftest forces 4 CPU devices"
    mesh = sharding.make_mesh(4)
    page, L, Pg, kv, H, B = 32, 2, 16, 2, 4, 2
    low = (jnp.zeros((L, Pg, kv, H, page, D // 2), jnp.uint8),
           jnp.zeros((L, Pg, kv, H, page, D // 16), jnp.float8_e4m3fn), jnp.ones((L, kv)))
    high = (jnp.zeros((L, 8, kv, H, page, D), jnp.bfloat16), jnp.ones((L, kv)))
    q = jnp.zeros((B, 1, 4 * H, D), jnp.bfloat16)
    pt, lens, ht = jnp.zeros((B, 12), jnp.int32), jnp.ones((B,), jnp.int32), jnp.zeros((B, 4), jnp.int32)
    heads = P(None, None, None, sharding.AXIS)
    qspec = P(None, None, sharding.AXIS)

    def per_shard(q, pt, lens, ht, data, scales, gs, rows, rs):
        return paged_decode_attention_mgpu(q, pt, lens, 1, (data, scales, gs), (rows, rs), ht,
                                           geom=TwinGeometry(page, 5, 7, 1, 3), num_splits=2)
    fn = jax.shard_map(per_shard, mesh=mesh, in_specs=(qspec, P(), P(), P(), heads, heads, P(), heads, P()),
                       out_specs=(qspec, qspec), check_vma=False)
    text = cross_lower_cuda(fn, q, pt, lens, ht, *low, *high)
    assert "mosaic_gpu" in text and "sdy.manual_computation" in text
    assert f"tensor<2x1x4x{D}xbf16>" in text            # one shard's query heads (4 of 16)


@pytest.mark.parametrize("width", [13, 14, 15])
def test_cross_lowers_for_any_page_table_width(width):
    """A page table whose row is not a multiple of 16 bytes (513 pages for 8193 tokens, say) lowers: TMA needs such
    strides, so the wrapper pads the table (it failed at trace time with widths not a multiple of 4 before)."""
    page, L, P, kv, H, D, B = 16, 2, 16, 2, 2, 128, 2
    low = (jnp.zeros((L, P, kv, H, page, D // 2), jnp.uint8),
           jnp.zeros((L, P, kv, H, page, D // 16), jnp.float8_e4m3fn), jnp.ones((L, kv)))
    q = jnp.zeros((B, 1, 32, D), jnp.bfloat16)
    pt, lens = jnp.zeros((B, width), jnp.int32), jnp.ones((B,), jnp.int32)

    def fn(q, pt, lens, low):
        return paged_decode_attention_mgpu(q, pt, lens, 1, low, num_splits=2)
    assert "mosaic_gpu" in cross_lower_cuda(fn, q, pt, lens, low)


@pytest.mark.parametrize("tq,hq,min_rows,in_turn,page", [
    (1, 32, 16, None, 16), (3, 16, 16, None, 16), (4, 32, 16, None, 16), (1, 8, 8, None, 16), (2, 8, 8, None, 16),
    (1, 16, 8, None, 16), (1, 8, 8, True, 16), (4, 32, 16, False, 16), (4, 32, 16, None, 64)])
def test_keys_on_m_cross_lowers_for_cuda(tq, hq, min_rows, in_turn, page):
    """The compiled keys-on-M form (register-A wgmma on the dequantized K, transposed V^T view, P^T and V tiles at
    the swizzle of 2 N bytes, one row multiplier per CTA, `_l_update_inline`) lowers for CUDA with N = 16, 32 and 64
    query rows; with ``min_km_rows`` = 8 at N = 8 (``Q^T`` and ``P^T`` through transposed views at the 128-byte
    swizzle, V's tile with it, P stored transposed by `_store_keys_minor`); K's halves dequantized in turn (the
    default at N = 32 and page 16, `default_qk_in_turn`; forced at N = 8) and not (forced at N = 32; page 64)."""
    assert "mosaic_gpu" in _lowered_with_twin(128, page, tq, hq, keys_on_m=True, min_km_rows=min_rows,
                                              qk_in_turn=in_turn)


@pytest.mark.parametrize("n_rows,page,want", [(32, 16, True), (32, 32, True), (32, 64, False), (32, 128, False),
                                              (16, 16, False), (8, 16, False), (64, 16, True)])
def test_default_qk_in_turn(n_rows, page, want):
    """`default_qk_in_turn`: K's halves in turn at >= `IN_TURN_ROWS` (32) query rows and pages <= `IN_TURN_MAX_PAGE`
    (32), where ptxas then fit 4 CTAs per SM on the H200 (bench/RESULTS.md, 'N = 32 form ... register-bound')."""
    assert dcfg.mosaic_qk_in_turn(n_rows, page) is want


# ------------------------------------------------------------------------------------------ GPU (H200)
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tq,hq,page", [
    ("mixed_nvfp4_bf16", 1, 32, 16),
    ("mixed_nvfp4_bf16", 3, 64, 16),
    ("mixed_nvfp4_bf16", 2, 16, 16),
    ("nvfp4", 1, 32, 16),
    ("mixed_nvfp4_fp16", 2, 16, 16),
])
def test_gpu_matches_reference(dtype, tq, hq, page):
    """Queries on M (forced; `test_gpu_keys_on_m_matches_reference` runs the other form)."""
    assert on_gpu(), "gpu tests need a GPU"
    mixed = dtype.startswith("mixed")
    lens = (1, page - 1, page, page + 1, 200, 1000, 3000, 4096)
    st = make_state(dtype, first_n=64 if mixed else 0, last_n=64 if mixed else 0, page=page, lens=lens,
                    heads=8, d=128, layers=2, max_draft_len=3, gs=0.01)
    q = queries(st, tq, hq)
    seq = jnp.arange(st.max_seqs, dtype=jnp.int32)
    ref_o, ref_lse = reference(st, 1, q, seq)
    for splits in (None, 8):
        out, lse = _run(st, q, 1, num_splits=splits, out_dtype=jnp.float32, keys_on_m=False)
        assert np.isfinite(np.asarray(out)).all()
        assert rel_l2(out, ref_o) < 1e-4
        assert rel_l2(np.asarray(out.astype(q.dtype), np.float32), np.asarray(ref_o.astype(q.dtype), np.float32)) < 1e-3
        _lse_close(lse, ref_lse)
    jax.block_until_ready(out)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tq,hq,min_rows", [
    ("mixed_nvfp4_bf16", 1, 32, 16), ("mixed_nvfp4_bf16", 4, 64, 16), ("nvfp4", 2, 16, 16),
    ("mixed_nvfp4_bf16", 1, 32, 8), ("mixed_nvfp4_bf16", 2, 32, 8), ("nvfp4", 1, 64, 8)])
def test_gpu_keys_on_m_matches_reference(dtype, tq, hq, min_rows):
    """The keys-on-M form on the H200: output in the attention dtype against the reference rounded to it (< 1e-3),
    LSE within 1e-3; default and 8 splits (the checks of bench/RESULTS.md, 'The keys-on-M form of the Mosaic GPU
    kernel'). With ``min_km_rows`` = 8 (N = 8: the transposed store of P) also bitwise equal to the 16-row form (same
    products in the same order)."""
    assert on_gpu(), "gpu tests need a GPU"
    mixed = dtype.startswith("mixed")
    st = make_state(dtype, first_n=64 if mixed else 0, last_n=64 if mixed else 0, page=16,
                    lens=(1, 15, 16, 17, 200, 1000, 3000, 4096), heads=8, d=128, layers=2, max_draft_len=3, gs=0.01)
    q = queries(st, tq, hq)
    seq = jnp.arange(st.max_seqs, dtype=jnp.int32)
    ref_o, ref_lse = reference(st, 1, q, seq)
    for splits in (None, 8):
        out, lse = _run(st, q, 1, num_splits=splits, keys_on_m=True, min_km_rows=min_rows)
        assert out.dtype == q.dtype and np.isfinite(np.asarray(out, np.float32)).all()
        assert rel_l2(np.asarray(out, np.float32), np.asarray(ref_o.astype(q.dtype), np.float32)) < 1e-3
        _lse_close(lse, ref_lse, atol=1e-3)
    if min_rows == 8:                                  # 8 splits, N = 8 vs N = 16: two traces, same products
        o16, lse16 = _run(st, q, 1, num_splits=8, keys_on_m=True, min_km_rows=16)
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(o16, np.float32))
        np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse16))
    # K's halves dequantized in turn or together (`default_qk_in_turn`; on at N = 32): the same products in order
    turn = dcfg.mosaic_qk_in_turn(max(min_rows, 1 << (tq * hq // 8 - 1).bit_length()), 16)
    o_t, lse_t = _run(st, q, 1, num_splits=8, keys_on_m=True, min_km_rows=min_rows, qk_in_turn=not turn)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(o_t, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse_t))


@pytest.mark.gpu
@pytest.mark.parametrize("page", [32, 64, 128])
def test_gpu_pages_32_to_128(page):
    """Pages of 32 / 64 / 128 tokens on the H200 (they faulted before the page-table copy started at an aligned
    column): bf16 twin at Tq 1 x GQA 4 and Tq 3 x GQA 8 (keys on M, 8 and 32 rows on wgmma's N side) and Tq 4 x
    GQA 16 (queries on M), plain NVFP4 at Tq 2 x GQA 2; lengths 1, page-1, page, page+1 .. 4096; default and 8
    splits; float32 output against the float32 reference."""
    assert on_gpu(), "gpu tests need a GPU"
    for dtype, tq, hq in (("mixed_nvfp4_bf16", 1, 32), ("mixed_nvfp4_bf16", 3, 64), ("mixed_nvfp4_bf16", 4, 128),
                          ("nvfp4", 2, 16)):
        _gpu_splits_match_reference(dtype, page, 128, tq, hq, lens=(1, page - 1, page, page + 1, 200, 1000, 3000, 4096))


def _gpu_splits_match_reference(dtype, page, d, tq, hq, lens, **config):
    """A model-shaped cache (8 KV heads, 2 layers, twin (64, 64) when ``dtype`` is mixed) and queries: this backend's
    float32 output (`MosaicConfig` fields ``config``) at the default splits and at 8 against the float32 reference.
    -> ``(st, q, seq, ref_o, ref_lse)``."""
    mixed = dtype.startswith("mixed")
    st = make_state(dtype, first_n=64 if mixed else 0, last_n=64 if mixed else 0, page=page, lens=lens, heads=8,
                    d=d, layers=2, max_draft_len=3, gs=0.01)
    q = queries(st, tq, hq)
    seq = jnp.arange(st.max_seqs, dtype=jnp.int32)
    ref_o, ref_lse = reference(st, 1, q, seq)
    for splits in (None, 8):
        out, lse = _run(st, q, 1, num_splits=splits, out_dtype=jnp.float32, **config)
        assert rel_l2(out, ref_o) < 1e-4, (dtype, page, d, tq, hq, splits)
        _lse_close(lse, ref_lse)
    return st, q, seq, ref_o, ref_lse


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 32, 128])
def test_gpu_head_dim_64(page):
    """head_dim 64 (token pairs) on the GPU. Pages of 16: bf16 twin at Tq 1 x GQA 3 (SmolLM2) and 4, Tq 2 x GQA 7,
    Tq 4 x GQA 8 (queries on M), plain NVFP4 at Tq 1 x GQA 1; other pages: Tq 1 x GQA 3 twin, Tq 2 x GQA 4 plain;
    lengths 1, page-1, page, page+1 .. 4097; default and 8 splits; float32 output against the float32 reference, and
    through `decode_attention`'s default dispatch."""
    _gpu_cases_match_reference(64, page, (
        ("mixed_nvfp4_bf16", 1, 24), ("mixed_nvfp4_bf16", 2, 56), ("mixed_nvfp4_bf16", 4, 64), ("nvfp4", 1, 8),
        ("mixed_nvfp4_bf16", 1, 32)) if page == 16 else (("mixed_nvfp4_bf16", 1, 24), ("nvfp4", 2, 32)))


def _gpu_cases_match_reference(d, page, cases):
    """Each ``(dtype, tq, hq)`` of ``cases`` at head_dim ``d``: `_gpu_splits_match_reference` over lengths 1, page-1,
    page, page+1 .. 4097, then `decode_attention`'s default dispatch (the attention dtype) within 1e-3."""
    assert on_gpu(), "gpu tests need a GPU"
    for dtype, tq, hq in cases:
        st, q, seq, ref_o, ref_lse = _gpu_splits_match_reference(
            dtype, page, d, tq, hq, lens=(1, page - 1, page, page + 1, 201, 1000, 3001, 4097))
        out, lse = decode_attention(st, 1, q, seq, backend="pallas")
        assert rel_l2(np.asarray(out, np.float32), np.asarray(ref_o.astype(out.dtype), np.float32)) < 1e-3
        _lse_close(lse, ref_lse, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 32, 64, 128])
def test_gpu_head_dim_256(page):
    """head_dim 256 (two column blocks) on the GPU: bf16 twin at Tq 1 x GQA 2 (Gemma-2) and 4, Tq 4 x GQA 8 (32 query
    rows, the most the form takes), plain NVFP4 at Tq 2 x GQA 1; lengths 1, page-1, page, page+1 .. 4097; default and
    8 splits; float32 output against the float32 reference, and through `decode_attention`'s default dispatch."""
    _gpu_cases_match_reference(256, page, (
        ("mixed_nvfp4_bf16", 1, 16), ("mixed_nvfp4_bf16", 1, 32), ("mixed_nvfp4_bf16", 4, 64), ("nvfp4", 2, 8))
        if page == 16 else (("mixed_nvfp4_bf16", 1, 16), ("nvfp4", 2, 32)))


@pytest.mark.gpu
def test_gpu_head_dim_256_v_tiles_per_block():
    """`MosaicConfig(v_in_turn=False)` on the GPU: a pair of V tiles per column block (the default, one pair for both
    blocks with a `wgmma_wait` and a barrier between their ``P V``, runs these same cases in `test_gpu_head_dim_256`
    at pages of 16): bf16 twin at Tq 1 x GQA 2 and Tq 4 x GQA 8, pages of 16, lengths 1 .. 4097, default and 8
    splits, float32 output against the float32 reference."""
    assert on_gpu(), "gpu tests need a GPU"
    for tq, hq in ((1, 16), (4, 64)):
        _gpu_splits_match_reference("mixed_nvfp4_bf16", 16, 256, tq, hq, lens=(1, 15, 16, 17, 201, 1000, 3001, 4097),
                                    v_in_turn=False)


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 32])
def test_gpu_edge_steps_at_batch_24(page):
    """Edge steps of 16 and 32 tokens on the H200 at 24 rows x 8 KV heads (192 edge programs > 132 SMs, where
    a rule by program count would pick 16): Tq 1 x GQA 4, Tq 2 x GQA 8 and Tq 4 x GQA 8; each step's float32 output
    against the float32 reference, and the default call bitwise equal to `EDGE_BLOCK_K`-token steps. (At page 32 a step
    is whole pages, `pages_per_block`: both requests run 32-token steps there.)"""
    assert on_gpu(), "gpu tests need a GPU"
    lens = (1, 15, 16, 17, 63, 64, 65, 200, 1000, 3000, 4096, 777) * 2
    st = make_state(first_n=64, last_n=64, page=page, lens=lens, heads=8, d=128, layers=2, max_draft_len=3, gs=0.01)
    seq = jnp.arange(st.max_seqs, dtype=jnp.int32)
    for tq, hq in ((1, 32), (2, 64), (4, 64)):
        q = queries(st, tq, hq)
        ref_o, ref_lse = reference(st, 1, q, seq)
        outs = {}
        for step in (16, 32):
            outs[step] = _run(st, q, 1, out_dtype=jnp.float32, edge_block_k=step)
            assert rel_l2(outs[step][0], ref_o) < 1e-4, (tq, hq, step)
            _lse_close(outs[step][1], ref_lse)
        pick = dcfg.EDGE_BLOCK_K
        out, lse = _run(st, q, 1, out_dtype=jnp.float32)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(outs[pick][0]))
        np.testing.assert_array_equal(np.asarray(lse), np.asarray(outs[pick][1]))


@pytest.mark.gpu
def test_gpu_any_page_table_width():
    """Page tables 1-3 columns wider than a multiple of 4 (unused columns -1): the page ids' TMA rows are padded to a
    16-byte stride by the wrapper (such widths failed at trace time before); the output matches the reference."""
    assert on_gpu(), "gpu tests need a GPU"
    st = make_state(first_n=64, last_n=64, page=16, lens=(1, 17, 300, 4096), heads=8, d=128, layers=2,
                    max_draft_len=3, gs=0.01)
    q = queries(st, 1, 32)
    seq = jnp.arange(st.max_seqs, dtype=jnp.int32)
    ref_o, ref_lse = reference(st, 1, q, seq)
    pools = st.pools[0]
    width = st.page_table.shape[1]
    for extra in [e for e in range(1, 8) if (width + e) % 4][:3]:        # widths 1, 2, 3 past a multiple of 4
        pt = jnp.pad(st.page_table, ((0, 0), (0, extra)), constant_values=-1)
        assert pt.shape[1] % 4, pt.shape
        out, lse = paged_decode_attention_mgpu(q, pt, st.kv_lens, 1, kernel_arrays(pools.low),
                                               kernel_arrays(pools.high), st.high_table, geom=st.config.twin,
                                               out_dtype=jnp.float32)
        assert rel_l2(out, ref_o) < 1e-4, extra
        _lse_close(lse, ref_lse)


@pytest.mark.gpu
def test_gpu_public_entry_auto_dispatch(monkeypatch):
    """With `KERNEL_ENV` unset, `decode_attention` runs this kernel on the H200 for a verify step (Tq 4 x GQA 8 = 32
    query rows) and a decode step (Tq 1 x GQA 4), bf16 twin, at pages of 16 and 64, and the Triton kernel for an
    FP8 twin (not `supported`); all match the reference."""
    assert on_gpu(), "gpu tests need a GPU"
    monkeypatch.delenv(dispatch.KERNEL_ENV, raising=False)
    calls = []
    real = mosaic.paged_decode_attention
    monkeypatch.setattr(mosaic, "paged_decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    for dtype, page, tq, hq, want in (("mixed_nvfp4_bf16", 16, 4, 64, 1), ("mixed_nvfp4_bf16", 16, 1, 32, 1),
                                      ("mixed_nvfp4_bf16", 64, 1, 32, 1), ("mixed_nvfp4_fp8", 16, 1, 32, 0)):
        st = make_state(dtype, first_n=64, last_n=64, page=page, lens=(1, 15, 17, 300, 4096), heads=8,
                        d=128, layers=2, max_draft_len=3, gs=0.01)
        seq = jnp.arange(st.max_seqs, dtype=jnp.int32)
        calls.clear()
        jax.clear_caches()
        q = queries(st, tq, hq)
        out, lse = decode_attention(st, 1, q, seq, backend="pallas")
        assert len(calls) == want, (page, tq, hq, calls)
        ref_o, ref_lse = reference(st, 1, q, seq)
        assert rel_l2(np.asarray(out, np.float32), np.asarray(ref_o.astype(out.dtype), np.float32)) < 1e-3
        _lse_close(lse, ref_lse, atol=1e-3)
    jax.clear_caches()
