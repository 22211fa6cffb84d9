"""Fused paged decode attention (`pallas_kernels.decode.triton`, `jmixedkv.decode`) against float32
`attention_reference` over `stage_reference` (the cache a reader must see).

States are `helpers.decode_state` (`helpers.poisoned_state`: permuted page ids, one ragged reference `append`), so
every row past a sequence's length decodes to NaN: a kernel that reads one shows. Kernels run in interpret mode on CPU,
are cross-lowered for CUDA, and run for real under the ``gpu`` marker.

Error metric: relative L2 of the kernel's output against the float32 reference rounded to the output dtype
(< 1e-3), plus the float32-output kernel against the unrounded reference (< 1e-4) and LSE (abs < 1e-4).
"""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import jmixedkv as jm
from jmixedkv.decode import decode_attention, merge_attention
from jmixedkv.compat import cross_lower_cuda, on_gpu
from jmixedkv.layout import TwinGeometry
from jmixedkv.pools import kernel_arrays
from pallas_kernels.decode import triton as tk
from pallas_kernels.decode.common import merge_partials, num_sms
from pallas_kernels.decode.config import TritonConfig, triton_num_splits as default_num_splits
from helpers import check_kernel, rel_l2
from helpers import decode_queries as queries, decode_reference as reference, decode_state as make_state

_CONFIG_FIELDS = {f.name for f in dataclasses.fields(TritonConfig)}


def paged_decode_attention(*args, partials_only=False, skip_interior=False, **kw):
    """The Triton backend with the tuning fields of ``kw`` as its `TritonConfig`; ``partials_only``: its split
    partials (`paged_decode_partials`, ``skip_interior`` there)."""
    config = TritonConfig(**{k: kw.pop(k) for k in list(kw) if k in _CONFIG_FIELDS})
    if partials_only:
        return tk.paged_decode_partials(*args, config=config, skip_interior=skip_interior, **kw)
    assert not skip_interior
    return tk.paged_decode_attention(*args, config=config, **kw)


def _decode(st, layer, q, seq, **kw):
    return decode_attention(st, layer, q, seq, backend="pallas", **kw)


def _decode_expected(st, layer, q, seq, **kw):
    """`reference` with the output rounded to the attention dtype (what the kernel returns)."""
    out, lse = reference(st, layer, q, seq, **kw)
    return out.astype(st.config.attention_dtype), lse


def check(st, tq, hq, layer=1, num_splits=None, **kw):
    """The Pallas kernel through `decode_attention` (jitted, run twice) vs the float32 reference: relative L2 of
    the output < 1e-3 against the reference rounded to the output dtype, < 4e-3 against float32; LSE within 1e-4."""
    q = queries(st, tq, hq)
    seq = jnp.arange(st.max_seqs, dtype=jnp.int32)
    (out, lse), _ = check_kernel(_decode, _decode_expected, (st, layer, q, seq), kernel_kw=dict(num_splits=num_splits,
                                 **kw), reference_kw=kw, tol=(1e-3, 1e-4), msg=f"decode {kw}")
    ref_o, ref_lse = reference(st, layer, q, seq, **kw)
    assert out.dtype == st.config.attention_dtype and out.shape == q.shape and lse.shape == q.shape[:3]
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert rel_l2(np.asarray(out, np.float32), ref_o) < 4e-3          # bf16 rounding bound vs float32
    np.testing.assert_allclose(lse, ref_lse, atol=1e-4, rtol=1e-5)
    return q, out, lse


# ------------------------------------------------------------------------------------------ interpret mode
def test_mixed_lengths_overlapping_windows_gqa4_split():
    """Lengths 1, page-1, page, page+1, long; first-N/last-N windows overlap for short rows; split-K."""
    st = make_state()
    check(st, tq=1, hq=8, num_splits=2)


def test_causal_verify_gqa8_window_softcap():
    st = make_state(lens=(3, 17, 40), max_draft_len=2)
    check(st, tq=3, hq=16, num_splits=1, sliding_window=20, soft_cap=5.0)


def test_fp8_twin_gqa1_all_high():
    """mixed_nvfp4_fp8 twin (scale 0.02); first_n + last_n >= n for every row: all reads come from the twin."""
    st = make_state("mixed_nvfp4_fp8", first_n=24, last_n=16, lens=(1, 16, 33), d=32)
    check(st, tq=1, hq=2)


def _tuple(t):
    return tuple(t[k] for k in ("block_k", "num_warps", "per_sm"))


def test_default_tuning_rules():
    """Which default the kernel takes: the wide-grid tunings only for NVFP4 pages <= 32 tokens with batch x KV heads
    >= NUM_SMS / 2, `WIDE_GRID_TUNING` only with <= 8 real query rows (column groups), `VERIFY_GRID_TUNING` with
    17..32; everything else the format's default."""
    from pallas_kernels.decode.config import (TRITON_BLOCK_K as DEFAULT_BLOCK_K, TRITON_NUM_WARPS as
                                              DEFAULT_NUM_WARPS, VERIFY_GRID_TUNING, WIDE_GRID_TUNING,
                                              triton_tuning as default_tuning)
    wide_b = -(-(num_sms() // 2) // 8)                       # batch with batch x 8 heads >= NUM_SMS / 2
    base = (DEFAULT_BLOCK_K["nvfp4"], DEFAULT_NUM_WARPS["nvfp4"], 4)
    assert default_tuning("nvfp4", wide_b, 8, 16, 16, 4) == _tuple(WIDE_GRID_TUNING)
    assert default_tuning("nvfp4", wide_b, 8, 32, 16, 8) == _tuple(WIDE_GRID_TUNING)
    assert default_tuning("nvfp4", wide_b, 8, 16, 16, 16) == base          # Tq 4 x GQA 4: no padding rows
    assert default_tuning("nvfp4", wide_b, 8, 16, 16) == base              # rows default to m_rows
    assert default_tuning("nvfp4", wide_b, 8, 16, 32, 32) == _tuple(VERIFY_GRID_TUNING)
    assert default_tuning("nvfp4", wide_b, 8, 16, 32, 24) == _tuple(VERIFY_GRID_TUNING)
    assert default_tuning("nvfp4", wide_b, 8, 16, 64, 64) == base
    assert default_tuning("nvfp4", wide_b - 1, 8, 16, 16, 4) == base       # narrow grid
    assert default_tuning("nvfp4", wide_b, 8, 64, 16, 4) == base           # pages of 64
    assert default_tuning("plain", wide_b, 8, 16, 16, 4) == (DEFAULT_BLOCK_K["plain"], DEFAULT_NUM_WARPS["plain"], 4)
    assert WIDE_GRID_TUNING["block_k"] != DEFAULT_BLOCK_K["nvfp4"] != VERIFY_GRID_TUNING["block_k"]


def test_wide_grid_tuning_batch9_heads8():
    """batch x KV heads >= NUM_SMS / 2 with page 16: the kernel's wide-grid defaults (32-token steps, ~4 programs
    per SM, V read after the softmax; 1 warp with one query row per head, 2 warps with Tq 4 x GQA 8 = 32 rows)."""
    lens = (1, 15, 16, 17, 33, 2, 31, 48, 9)
    assert len(lens) * 8 >= num_sms() // 2
    st = make_state(lens=lens, heads=8, d=32, layers=1, first_n=3, last_n=9, max_draft_len=3)
    check(st, tq=1, hq=8, layer=0)
    check(st, tq=4, hq=64, layer=0)


def test_all_low_nvfp4():
    st = make_state("nvfp4", first_n=0, last_n=0, lens=(5, 31, 33), page=32)
    check(st, tq=2, hq=4, num_splits=2)


def test_plain_bf16_pages_d128():
    st = make_state("bf16", first_n=0, last_n=0, lens=(1, 9, 20), page=8, d=128, heads=1, max_draft_len=0)
    check(st, tq=1, hq=4)


def test_plain_fp8_pages():
    """Plain FP8 pool (scale 0.02), read as f32(e4m3) * scale in the bf16 compute dtype."""
    st = make_state("fp8", first_n=0, last_n=0, lens=(3, 16, 21), page=16, d=32, heads=1, max_draft_len=1)
    check(st, tq=2, hq=2, num_splits=2)


def test_tq_longer_than_sequence_small_blocks_poisoned_splits():
    """GPU failure repro: Tq = 3 > n = 1 (query rows with no key: the raw reference gives NaN there). 16-token
    blocks and 3 splits: each split holds head / tail edge blocks (twin overlay, NaN-poisoned rows past n,
    poisoned twin rows outside the retained set) and interior blocks run the unmasked fast loop; with a
    sliding window the interior shrinks to one block. float32 output against the float32 reference."""
    st = make_state(lens=(1, 17, 70, 150), first_n=5, last_n=20, max_draft_len=2)
    q = queries(st, 3, 4)
    seq = jnp.arange(st.max_seqs, dtype=jnp.int32)
    cfg, pools = st.config, st.pools[0]
    for kw in (dict(), dict(sliding_window=40, soft_cap=8.0)):
        ref_o, ref_lse = reference(st, 1, q, seq, **kw)
        assert np.isfinite(np.asarray(ref_o)).all()
        out, lse = paged_decode_attention(
            q, st.page_table, st.kv_lens, 1, kernel_arrays(pools.low), kernel_arrays(pools.high), None, st.high_table,
            geom=cfg.twin, num_splits=3, block_k=16, interpret=True, out_dtype=jnp.float32, **kw)
        assert np.isfinite(np.asarray(out)).all()
        assert rel_l2(out, ref_o) < 1e-4, kw
        np.testing.assert_allclose(lse, ref_lse, atol=1e-4, rtol=1e-5)
        assert (np.asarray(out[0, :2]) == 0).all() and np.isneginf(np.asarray(lse[0, :2])).all()


def _all_twin_blocks(lens, first_n, last_n, k_tok):
    """How many ``k_tok``-token blocks of the sequences hold only retained rows and rows at or past ``n``, and how
    many of those hold rows past ``n``."""
    rows = lambda n, b: range(b * k_tok, (b + 1) * k_tok)  # noqa: E731
    twin = [(n, b) for n in lens for b in range(-(-n // k_tok))
            if all(p >= n or p < first_n or p >= n - last_n for p in rows(n, b))]
    return len(twin), sum(any(p >= n for p in rows(n, b)) for n, b in twin)


@pytest.mark.parametrize("dtype,tq,hq,block_k,splits,kw", [
    ("mixed_nvfp4_bf16", 1, 8, 16, 1, {}), ("mixed_nvfp4_bf16", 3, 4, 32, 3, {}),
    ("mixed_nvfp4_fp8", 2, 2, 16, 2, {}), ("mixed_nvfp4_bf16", 2, 4, 16, 2, dict(sliding_window=50, soft_cap=8.0))])
def test_edge_blocks_of_twin_rows_only(dtype, tq, hq, block_k, splits, kw):
    """Edge blocks made only of retained twin rows (inside first_n, or the last_n window) and rows past n, beside
    blocks that mix twin and NVFP4 rows, in one call: causal verify rows, uneven splits, NaN-poisoned rows past n
    and outside the retained set, bf16 / FP8 twins, window + soft cap; float32 output against the float32
    reference. (A twin-only branch for such blocks was tried: 10-15% faster at small pools, 33-36% slower with
    model-sized ones, bench/RESULTS.md, 'Edge blocks that hold only twin rows'; not kept. This test stays for the
    case.)"""
    lens = (1, 31, 32, 33, 64, 65, 100, 150)
    st = make_state(dtype, first_n=32, last_n=32, lens=lens, max_draft_len=3)
    n_twin, n_past = _all_twin_blocks(lens, 32, 32, block_k)
    assert n_twin >= 10 and n_past >= 4                      # the case is there, also with rows past n
    q = queries(st, tq, hq)
    seq = jnp.arange(st.max_seqs, dtype=jnp.int32)
    cfg, pools = st.config, st.pools[0]
    ref_o, ref_lse = reference(st, 1, q, seq, **kw)
    out, lse = paged_decode_attention(
        q, st.page_table, st.kv_lens, 1, kernel_arrays(pools.low), kernel_arrays(pools.high), None, st.high_table,
        geom=cfg.twin, num_splits=splits, block_k=block_k, interpret=True, out_dtype=jnp.float32, **kw)
    ok = np.isfinite(np.asarray(ref_lse))
    assert np.isfinite(np.asarray(out)).all()
    assert rel_l2(out, ref_o) < 1e-4
    np.testing.assert_allclose(np.asarray(lse)[ok], np.asarray(ref_lse)[ok], atol=1e-4, rtol=1e-5)


def test_float32_output_three_splits():
    """Kernel arithmetic itself (float32 output, 3 uneven splits) is ~1e-5 from the float32 reference."""
    st = make_state()
    q = queries(st, 1, 8)
    seq = jnp.arange(st.max_seqs, dtype=jnp.int32)
    ref_o, ref_lse = reference(st, 0, q, seq)
    cfg, pools = st.config, st.pools[0]
    out, lse = paged_decode_attention(
        q, st.page_table, st.kv_lens, 0, kernel_arrays(pools.low), kernel_arrays(pools.high), None, st.high_table,
        geom=cfg.twin, num_splits=3, interpret=True, out_dtype=jnp.float32)
    assert rel_l2(out, ref_o) < 1e-4
    np.testing.assert_allclose(lse, ref_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype,tq,hq", [("mixed_nvfp4_bf16", 3, 8), ("nvfp4", 1, 4), ("bf16", 2, 4)])
def test_natural_and_keys_major_layouts_match_reference(dtype, tq, hq):
    """The two q / o tile layouts of the kernel: natural (q read as ``[M, D]`` with a strided load per column part,
    the output stored interleaved) and keys-major (q split in parts by XLA, the output tile transposed and
    re-interleaved by the wrapper) give the same split partials (``partials_only``: ``[S, B, H, R, D]`` natural
    columns) and both match the float32 reference, over poisoned pages, first-N / last-N edges, causal verify rows
    and uneven splits, for NVFP4 (two column parts) and plain bf16 pages (one part)."""
    mixed, plain = dtype.startswith("mixed"), dtype == "bf16"
    st = make_state(dtype, first_n=5 if mixed else 0, last_n=9 if mixed else 0, lens=(1, 15, 16, 17, 70, 150), d=64)
    q = queries(st, tq, hq)
    seq = jnp.arange(st.max_seqs, dtype=jnp.int32)
    pools = st.pools[0]
    low = None if plain else kernel_arrays(pools.low)
    run = lambda km, parts=False: paged_decode_attention(  # noqa: E731
        q, st.page_table, st.kv_lens, 1, low, kernel_arrays(pools.high) if mixed else None,
        kernel_arrays(pools.plain) if plain else None, st.high_table if mixed else None,
        geom=st.config.twin if mixed else None, num_splits=3, block_k=32, keys_major=km, interpret=True,
        out_dtype=jnp.float32, partials_only=parts)
    ref_o, ref_lse = reference(st, 1, q, seq)
    for km in (False, True):
        out, lse = run(km)
        assert rel_l2(out, ref_o) < 1e-4, km
        np.testing.assert_allclose(lse, ref_lse, atol=1e-4, rtol=1e-5)
    (on, mn, ln), (ok, mk, lk) = run(False, True), run(True, True)
    assert on.shape == ok.shape and on.shape[-1] == 64 and on.shape[:3] == (3, st.max_seqs, 2)
    for a, b in ((on, ok), (mn, mk), (ln, lk)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,tq,hq,d,groups", [("mixed_nvfp4_bf16", 1, 8, 128, 4), ("mixed_nvfp4_fp8", 2, 4, 64, 2),
                                                   ("nvfp4", 1, 4, 64, 2)])
def test_column_groups_equal_ungrouped_kernel_and_reference(dtype, tq, hq, d, groups):
    """``col_groups`` (the MMA's padding query rows accumulate V's column groups): the ungrouped kernel in
    interpret mode (to float32 summation order), and the float32 reference, over poisoned pages, edge blocks (first_n / last_n, causal verify,
    rows past n) and uneven splits; a count that does not fit is refused with the values."""
    mixed = dtype.startswith("mixed")
    st = make_state(dtype, first_n=5 if mixed else 0, last_n=9 if mixed else 0, lens=(1, 15, 16, 17, 70, 150), d=d)
    q = queries(st, tq, hq)
    seq = jnp.arange(st.max_seqs, dtype=jnp.int32)
    pools = st.pools[0]
    run = lambda cg: paged_decode_attention(  # noqa: E731
        q, st.page_table, st.kv_lens, 1, kernel_arrays(pools.low), kernel_arrays(pools.high) if mixed else None,
        None, st.high_table if mixed else None, geom=st.config.twin if mixed else None, num_splits=3, block_k=32,
        num_warps=1, col_groups=cg, interpret=True, out_dtype=jnp.float32)
    (o1, l1), (og, lg) = run(1), run(groups)
    # interpret mode runs the grouped MMA as a differently shaped XLA CPU dot, whose float32 summation order is
    # not pinned (seen: up to 7e-7 apart): equal to a few ulps here, not bitwise
    np.testing.assert_allclose(np.asarray(og), np.asarray(o1), rtol=0, atol=2e-6)
    np.testing.assert_allclose(np.asarray(lg), np.asarray(l1), rtol=0, atol=2e-6)
    ref_o, ref_lse = reference(st, 1, q, seq)
    assert rel_l2(og, ref_o) < 1e-4
    np.testing.assert_allclose(lg, ref_lse, atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match=f"col_groups={2 * groups} must be a power of two <= {groups}"):
        run(2 * groups)
    with pytest.raises(ValueError, match="col_groups=3"):
        run(3)


@pytest.mark.parametrize("dtype,tq,hq,d,groups", [("mixed_nvfp4_bf16", 3, 8, 128, 1), ("mixed_nvfp4_fp8", 2, 4, 64, 1),
                                                   ("mixed_nvfp4_bf16", 1, 8, 128, 4)])
def test_edge_kernel_split_row_loads_equal_strided_loads(dtype, tq, hq, d, groups, monkeypatch):
    """The edge-only kernel (``skip_interior``, the Mosaic path's partner) reads twin tiles with one contiguous load
    split in registers when its steps hold >= 32 tokens (`split_row_loads`); its split partials are bitwise those of
    the two loads at stride 2 (the form everywhere else), over poisoned pages, first-N / last-N edges, causal verify
    rows, uneven splits, bf16 / FP8 twins and V's column groups."""
    assert tk.split_row_loads(True, 32) and tk.split_row_loads(True, 128)
    assert not tk.split_row_loads(True, 16) and not tk.split_row_loads(False, 64)
    st = make_state(dtype, first_n=5, last_n=9, lens=(1, 15, 16, 17, 70, 150), d=d)
    q = queries(st, tq, hq)
    pools = st.pools[0]

    def run(split):
        monkeypatch.setattr(tk, "split_row_loads", lambda skip, k_tok: split)
        tk.paged_decode_partials.clear_cache()
        return paged_decode_attention(
            q, st.page_table, st.kv_lens, 1, kernel_arrays(pools.low), kernel_arrays(pools.high), None,
            st.high_table, geom=st.config.twin, num_splits=3, block_k=32, num_warps=1, col_groups=groups,
            skip_interior=True, interpret=True, out_dtype=jnp.float32, partials_only=True)
    split, strided = run(True), run(False)
    tk.paged_decode_partials.clear_cache()
    o = np.asarray(split[0])
    assert np.isfinite(o).all() and np.abs(o).max() > 0
    for a, b in zip(split, strided):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_padding_rows_and_reference_backend():
    """seq_slots -1 rows give zeros / -inf; the reference backend agrees with the kernel elsewhere."""
    st = make_state()
    q = queries(st, 1, 8)
    seq = jnp.array([2, -1, 4, 0, 1], jnp.int32)
    out, lse = decode_attention(st, 1, q, seq, backend="pallas", num_splits=2)  # same compile as the first test
    r_out, r_lse = decode_attention(st, 1, q, seq, backend="reference")
    assert (np.asarray(out[1], np.float32) == 0).all() and np.isneginf(np.asarray(lse[1])).all()
    assert (np.asarray(r_out[1], np.float32) == 0).all() and np.isneginf(np.asarray(r_lse[1])).all()
    assert rel_l2(np.asarray(out, np.float32), np.asarray(r_out, np.float32)) < 1e-3


def test_merge_attention_equals_whole():
    """Attention over keys [0, a) merged with keys [a, n) equals attention over [0, n)."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 1, 4, 32)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(2, 2, 24, 32)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(2, 2, 24, 32)), jnp.float32)
    lens = jnp.array([24, 24], jnp.int32)
    whole_o, whole_l = jm.attention_reference(q, k, v, lens)
    o1, l1 = jm.attention_reference(q, k[:, :, :10], v[:, :, :10], jnp.array([10, 10]) * 0 + 24 - 14)
    # second half: keys 10..23, all visible to the query at position 23
    o2, l2 = jm.attention_reference(q, k[:, :, 10:], v[:, :, 10:], jnp.array([14, 14]))
    o, l = merge_attention(o1, l1, o2, l2)
    np.testing.assert_allclose(o, whole_o, atol=1e-5)
    np.testing.assert_allclose(l, whole_l, atol=1e-5)
    # an empty side (lse -inf) is the identity
    o, l = merge_attention(whole_o, whole_l, jnp.zeros_like(whole_o), jnp.full_like(whole_l, -jnp.inf))
    np.testing.assert_allclose(o, whole_o, atol=1e-6)
    np.testing.assert_allclose(l, whole_l)
    o, l = merge_partials(jnp.zeros((2, 3, 4)), jnp.full((2, 3), -1e30), jnp.zeros((2, 3)))
    assert (np.asarray(o) == 0).all() and np.isneginf(np.asarray(l)).all()


def test_validation_errors():
    st = make_state()
    q = queries(st, 1, 8)
    seq = jnp.arange(st.max_seqs, dtype=jnp.int32)
    with pytest.raises(ValueError, match="Hq=7"):
        decode_attention(st, 0, q[:, :, :7], seq)
    with pytest.raises(ValueError, match="Tq=4"):
        decode_attention(st, 0, queries(st, 4, 8), seq)
    with pytest.raises(ValueError, match="head_dim 32"):
        decode_attention(st, 0, q[..., :32], seq)
    with pytest.raises(ValueError, match="dtype float32"):
        decode_attention(st, 0, q.astype(jnp.float32), seq)
    with pytest.raises(ValueError, match="seq_slots"):
        decode_attention(st, 0, q, seq[:2])
    with pytest.raises(ValueError, match="layer=5"):
        decode_attention(st, 5, q, seq)
    with pytest.raises(ValueError, match="sliding_window"):
        decode_attention(st, 0, q, seq, sliding_window=0)
    with pytest.raises(ValueError, match="soft_cap"):
        decode_attention(st, 0, q, seq, soft_cap=-1.0)
    with pytest.raises(ValueError, match="num_splits"):
        decode_attention(st, 0, q, seq, num_splits=0)
    with pytest.raises(ValueError, match="backend"):
        decode_attention(st, 0, q, seq, backend="cuda")
    with pytest.raises(ValueError, match="exactly one"):
        paged_decode_attention(q, st.page_table, st.kv_lens)
    with pytest.raises(ValueError, match="block_k=0"):
        paged_decode_attention(q, st.page_table, st.kv_lens, 0, kernel_arrays(st.pools[0].low), block_k=0)
    assert default_num_splits(16, 8, 4096) == 8 and default_num_splits(64, 8, 4096) == 2
    assert default_num_splits(1, 8, 3) == 3


# ------------------------------------------------------------------------------------------ CUDA cross-lowering
# every kernel variant the bench sweeps (block_k, num_warps, num_stages, precise, keys_major, dequant) lowers for CUDA
TUNINGS = [dict(block_k=64), dict(block_k=128, num_stages=3), dict(block_k=256, num_warps=8, num_stages=3),
           dict(block_k=128, num_warps=8, num_stages=4, precise=True), dict(block_k=64, num_warps=2, keys_major=True),
           dict(block_k=64, num_warps=1, dequant="jnp")]


@pytest.mark.parametrize("tuning", TUNINGS, ids=lambda t: "-".join(f"{k}{v}" for k, v in t.items()))
@pytest.mark.parametrize("variant", ["mixed_bf16", "mixed_fp8_verify", "nvfp4", "plain"])
def test_cross_lowers_for_cuda(variant, tuning):
    L, P, kv, H, page, D, B = 2, 16, 2, 2, 16, 128, 2
    low = (jnp.zeros((L, P, kv, H, page, D // 2), jnp.uint8),
           jnp.zeros((L, P, kv, H, page, D // 16), jnp.float8_e4m3fn), jnp.ones((L, kv)))
    hd = jnp.float8_e4m3fn if variant == "mixed_fp8_verify" else jnp.bfloat16
    high = (jnp.zeros((L, 8, kv, H, page, D), hd), jnp.ones((L, kv)))
    tq = 3 if variant == "mixed_fp8_verify" else 1
    q = jnp.zeros((B, tq, 8, D), jnp.bfloat16)
    pt, lens, ht = jnp.zeros((B, 8), jnp.int32), jnp.ones((B,), jnp.int32), jnp.zeros((B, 4), jnp.int32)
    kw = dict(geom=TwinGeometry(page, 5, 7, 1, 3), num_splits=2, **tuning)
    if variant.startswith("mixed"):
        extra = dict(sliding_window=64, soft_cap=30.0) if tq > 1 else {}
        fn = lambda q, pt, lens, ht, low, high: paged_decode_attention(  # noqa: E731
            q, pt, lens, 1, low, high, None, ht, **kw, **extra)
        text = cross_lower_cuda(fn, q, pt, lens, ht, low, high)
    elif variant == "nvfp4":
        fn = lambda q, pt, lens, low: paged_decode_attention(q, pt, lens, 0, low, num_splits=2, **tuning)  # noqa
        text = cross_lower_cuda(fn, q, pt, lens, low)
    else:
        fn = lambda q, pt, lens, plain: paged_decode_attention(q, pt, lens, 0, None, None, plain, **tuning)  # noqa
        text = cross_lower_cuda(fn, q, pt, lens, high)
    assert "triton" in text.lower()


def _cross_lower_mixed(high_dtype=jnp.bfloat16, **kw):
    """Cross-lower `paged_decode_attention` for CUDA over zero NVFP4 + ``high_dtype`` twin pools (2 layers, 2 KV
    heads, page 16, D 128, batch 2, Tq 1 x 8 q heads, num_splits 2) with ``kw``; -> the lowered text."""
    L, P, kv, H, page, D, B = 2, 16, 2, 2, 16, 128, 2
    low = (jnp.zeros((L, P, kv, H, page, D // 2), jnp.uint8),
           jnp.zeros((L, P, kv, H, page, D // 16), jnp.float8_e4m3fn), jnp.ones((L, kv)))
    high = (jnp.zeros((L, 8, kv, H, page, D), high_dtype), jnp.ones((L, kv)))
    q = jnp.zeros((B, 1, 8, D), jnp.bfloat16)
    pt, lens, ht = jnp.zeros((B, 8), jnp.int32), jnp.ones((B,), jnp.int32), jnp.zeros((B, 4), jnp.int32)
    fn = lambda q, pt, lens, ht, low, high: paged_decode_attention(  # noqa: E731
        q, pt, lens, 1, low, high, None, ht, geom=TwinGeometry(page, 5, 7, 1, 3), num_splits=2, **kw)
    return cross_lower_cuda(fn, q, pt, lens, ht, low, high)


def test_column_groups_cross_lower_for_cuda():
    """The grouped kernel (column-sliced byte / scale / strided twin loads, masked P tiles) lowers for CUDA with
    the inline-PTX dequantization."""
    text = _cross_lower_mixed(block_k=32, num_warps=1, col_groups=4)
    assert "triton" in text.lower() and "_g4" in text


@pytest.mark.parametrize("block_k,col_groups,high_dtype", [(32, 1, jnp.bfloat16), (32, 4, jnp.bfloat16),
                                                          (64, 1, jnp.bfloat16), (32, 1, jnp.float8_e4m3fn)])
def test_edge_kernel_cross_lowers_for_cuda(block_k, col_groups, high_dtype):
    """The edge-only kernel (``skip_interior``), whose twin tiles are split in registers at >= 32-token steps
    (`split_row_loads`: Triton's ``split``), lowers for CUDA, with and without V's column groups, bf16 / FP8 twins."""
    text = _cross_lower_mixed(high_dtype, block_k=block_k, num_warps=1, col_groups=col_groups, skip_interior=True,
                              partials_only=True)
    assert "triton" in text.lower()


# ------------------------------------------------------------------------------------------ GPU (H200)
gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("dtype,tq,hq,d,page", [
    ("mixed_nvfp4_bf16", 1, 32, 128, 16),
    ("mixed_nvfp4_bf16", 3, 64, 128, 32),
    ("mixed_nvfp4_fp8", 1, 16, 256, 64),
    ("mixed_nvfp4_fp16", 2, 8, 64, 128),
    ("nvfp4", 1, 32, 128, 16),
    ("bf16", 1, 32, 128, 16),
])
def test_gpu_matches_reference(dtype, tq, hq, d, page):
    assert on_gpu(), "gpu tests need a GPU"
    mixed = dtype.startswith("mixed")
    lens = (1, page - 1, page, page + 1, 200, 1000, 3000, 4096)
    st = make_state(dtype, first_n=64 if mixed else 0, last_n=64 if mixed else 0, page=page, lens=lens,
                    heads=8, d=d, layers=2, max_draft_len=3, gs=0.01)
    check(st, tq=tq, hq=hq)
    check(st, tq=tq, hq=hq, num_splits=8)
    if tq > 1:
        check(st, tq=tq, hq=hq, sliding_window=500, soft_cap=30.0)


@gpu
@pytest.mark.parametrize("tq,hq", [(1, 32), (4, 32), (4, 64)])
def test_gpu_wide_grid_defaults(tq, hq):
    """Batch 9 x 8 KV heads (>= NUM_SMS / 2 programs per split) at page 16: the wide-grid default tunings compiled
    for the GPU (`WIDE_GRID_TUNING` at Tq 1 x GQA 4, the format's default at Tq 4 x GQA 4, `VERIFY_GRID_TUNING` at
    Tq 4 x GQA 8), against the float32 reference; lengths page +- 1 to 4096, split-K by default and by 8."""
    assert on_gpu(), "gpu tests need a GPU"
    lens = (1, 15, 16, 17, 200, 1000, 3000, 4096, 2049)
    st = make_state("mixed_nvfp4_bf16", first_n=64, last_n=64, page=16, lens=lens, heads=8, d=128, layers=2,
                    max_draft_len=3, gs=0.01)
    check(st, tq=tq, hq=hq)
    check(st, tq=tq, hq=hq, num_splits=8)
