"""Pallas Triton kernels: sparse row gather (DSA-style top-k) with the retained-row overlay, and the overlay alone.

* `gather_rows`: one program per ``(batch row b, block of TK indices, (kv, head))``; it gathers the selected
  NVFP4 rows by vector page/row indices, dequantizes them in registers, and — only when the block holds a retained
  row the twin holds — loads those high rows and takes them (``where``). Output is the scratch
  ``[B, K, kv, H, D]`` in the attention dtype, or FP8 E4M3 ``e4m3(clip(f32(x) / scale[b], ±448))`` of the
  attention-dtype value ``x`` with a per-batch-row power-of-two ``scale`` computed by the caller.
* `overlay_rows`: the same overlay over an existing scratch (aliased in place): rows not retained are left as
  they are.

Padding indices (-1), indices at or past ``kv_len``, and rows whose low page is -1 read as zero (gather) or are
left untouched (overlay). Head dims that are not a power of two (MLA 576) run as power-of-two column chunks.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jmixedkv.compat import triton_params
from jmixedkv.layout import TwinGeometry, check_offsets
from jmixedkv.numerics import decode_rows, e4m3_saturate

from .nvfp4_ops import dequant_tile
from .stage import column_chunks

__all__ = ["gather_rows", "overlay_rows", "block_rows"]


def block_rows(k: int) -> int:
    """Rows per program: a power of two, 16..32 (Triton needs power-of-two tiles)."""
    return 16 if k <= 16 else 32


def _encode_fp8(x, inv_scale):
    """``e4m3(clip(f32(x) / scale))``; ``inv_scale = 1 / scale`` is exact for a power-of-two scale, so the product
    equals the IEEE quotient (Triton's f32 ``/`` is not IEEE-rounded by default)."""
    return e4m3_saturate(x.astype(jnp.float32) * inv_scale)


def _row_setup(b, kb, seq_ref, lens_ref, pt_ref, ht_ref, idx_ref, geom: TwinGeometry, tk: int):
    """Per-block index math shared by both kernels."""
    s = seq_ref[b]
    sc = jnp.maximum(s, 0)
    n = jnp.where(s >= 0, lens_ref[sc], 0)
    idx = idx_ref[b, pl.ds(kb * tk, tk)]
    width = pt_ref.shape[1]
    q = jnp.maximum(idx, 0) // geom.page
    lp = pt_ref[sc, jnp.minimum(q, width - 1)]
    valid = (idx >= 0) & (idx < n) & (q < width) & (lp >= 0)
    row = jnp.maximum(idx, 0) % geom.page
    hp, held = geom.twin_page(ht_ref, sc, geom.page_column(q))
    keep = valid & geom.is_retained(idx, n) & held
    return jnp.maximum(lp, 0), row, valid, jnp.maximum(hp, 0), keep


def _gather_kernel(layer_ref, seq_ref, lens_ref, pt_ref, ht_ref, idx_ref, fscale_ref, data_ref, scales_ref, gs_ref,
                   hrows_ref, hscale_ref, out_ref, *, geom, tk, kv, heads, d, has_high, att_dtype, fp8):
    b, kb, kvh = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kvi, hi = kvh // heads, kvh % heads
    lay = layer_ref[0]
    lp, row, valid, hp, keep = _row_setup(b, kb, seq_ref, lens_ref, pt_ref, ht_ref, idx_ref, geom, tk)
    gs = gs_ref[lay, kvi]
    fscale = fscale_ref[b]

    def low_chunk(c0, w):
        scales = scales_ref[lay, lp, kvi, hi, row, pl.ds(c0 // 16, w // 16)].astype(jnp.float32)
        tile = dequant_tile(data_ref[lay, lp, kvi, hi, row, pl.ds(c0 // 2, w // 2)], scales, gs, att_dtype)
        return jnp.where(valid[:, None], tile, jnp.zeros((), att_dtype))

    def store(c0, w, x):
        out_ref[b, pl.ds(kb * tk, tk), kvi, hi, pl.ds(c0, w)] = _encode_fp8(x, fscale) if fp8 else x

    if not has_high:
        for c0, w in column_chunks(d):
            store(c0, w, low_chunk(c0, w))
        return
    any_keep = jnp.max(keep.astype(jnp.int32)) > 0

    @pl.when(jnp.logical_not(any_keep))
    def _():
        for c0, w in column_chunks(d):
            store(c0, w, low_chunk(c0, w))

    if has_high:
        @pl.when(any_keep)
        def _():
            hscale = hscale_ref[lay, kvi]
            for c0, w in column_chunks(d):
                high = decode_rows(hrows_ref[lay, hp, kvi, hi, row, pl.ds(c0, w)], hscale, att_dtype)
                store(c0, w, jnp.where(keep[:, None], high, low_chunk(c0, w)))


def _overlay_kernel(layer_ref, seq_ref, lens_ref, pt_ref, ht_ref, idx_ref, fscale_ref, hrows_ref, hscale_ref,
                    scratch_ref, out_ref, *, geom, tk, kv, heads, d, att_dtype, fp8):
    del scratch_ref  # aliased to out_ref
    b, kb, kvh = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kvi, hi = kvh // heads, kvh % heads
    lay = layer_ref[0]
    _, row, _, hp, keep = _row_setup(b, kb, seq_ref, lens_ref, pt_ref, ht_ref, idx_ref, geom, tk)
    any_keep = jnp.max(keep.astype(jnp.int32)) > 0

    @pl.when(any_keep)
    def _():
        hscale = hscale_ref[lay, kvi]
        fscale = fscale_ref[b]
        for c0, w in column_chunks(d):
            high = decode_rows(hrows_ref[lay, hp, kvi, hi, row, pl.ds(c0, w)], hscale, att_dtype)
            if fp8:
                high = _encode_fp8(high, fscale)
            blk = out_ref[b, pl.ds(kb * tk, tk), kvi, hi, pl.ds(c0, w)]
            out_ref[b, pl.ds(kb * tk, tk), kvi, hi, pl.ds(c0, w)] = jnp.where(keep[:, None], high, blk)


def _placeholder_high(high_rows, high_scale, high_table, num_seqs, dtype):
    if high_rows is None:
        high_rows = jnp.zeros((1, 1, 1, 1, 1, 1), dtype)
        high_scale = jnp.ones((1, 1), jnp.float32)
        high_table = None
    if high_table is None or high_table.shape[1] == 0:
        high_table = jnp.full((num_seqs, 1), -1, jnp.int32)
    return high_rows, high_scale, high_table


def _pad_indices(indices, tk):
    k = indices.shape[1]
    kp = -(-k // tk) * tk
    return indices if kp == k else jnp.pad(indices, ((0, 0), (0, kp - k)), constant_values=-1)


@functools.partial(jax.jit, static_argnames=("geom", "att_dtype", "fp8", "interpret", "num_warps"))
def gather_rows(layer, seq, kv_lens, page_table, high_table, indices, fp8_scale, *, low, high=None,
                geom: TwinGeometry, att_dtype, fp8: bool = False, interpret: bool = False, num_warps: int = 4):
    """Gather + dequantize + overlay the selected rows.

    Args:
      layer: i32[1] layer index.  seq: i32[B] slots (-1 = padding).  kv_lens: i32[S].
      page_table: i32[S, W]; high_table: i32[S, F + R] (or None); indices: i32[B, K] positions (-1 = padding).
      fp8_scale: f32[B] power-of-two scratch scale (used when ``fp8``; the kernel multiplies by its exact inverse).
      low: ``(data, scales, gs)``, the low pool (`jmixedkv.pools.kernel_arrays` of a `LowPool`).
      high: ``(rows, scale)``, the twin (of a `RowPool`), or None: no overlay.

    Returns:
      ``[B, K, kv, H, D]`` in ``att_dtype``, or float8_e4m3fn when ``fp8``.
    """
    data, scales, gs = low
    high_rows, high_scale = (None, None) if high is None else high
    _, _, kv, heads, _, half = data.shape
    d = half * 2
    has_high = high_rows is not None
    high_rows, high_scale, high_table = _placeholder_high(high_rows, high_scale, high_table, page_table.shape[0],
                                                          att_dtype)
    batch, k = indices.shape
    tk = block_rows(k)
    idx = _pad_indices(indices, tk)
    out_dtype = jnp.float8_e4m3fn if fp8 else att_dtype
    check_offsets("gather_rows", data=data, scales=scales, high_rows=high_rows,
                  scratch=jax.ShapeDtypeStruct((batch, idx.shape[1], kv, heads, d), out_dtype))
    kernel = functools.partial(_gather_kernel, geom=geom, tk=tk, kv=kv, heads=heads, d=d, has_high=has_high,
                               att_dtype=jnp.dtype(att_dtype), fp8=fp8)
    out = pl.pallas_call(
        kernel,
        grid=(batch, idx.shape[1] // tk, kv * heads),
        out_shape=jax.ShapeDtypeStruct((batch, idx.shape[1], kv, heads, d), out_dtype),
        interpret=interpret,
        compiler_params=triton_params(num_warps=num_warps, num_stages=1),
    )(layer, seq, kv_lens, page_table, high_table, idx, 1.0 / fp8_scale, data, scales, gs, high_rows, high_scale)
    return out if idx.shape[1] == k else out[:, :k]


@functools.partial(jax.jit, static_argnames=("geom", "att_dtype", "interpret", "num_warps"))
def overlay_rows(scratch, layer, seq, kv_lens, page_table, high_table, indices, fp8_scale, *, high,
                 geom: TwinGeometry, att_dtype, interpret: bool = False, num_warps: int = 4):
    """Copy the twin's rows over ``scratch[B, K, kv, H, D]`` where the selected position is retained.

    The kernel aliases ``scratch`` to its output: it updates in place when the caller's jit donates the scratch
    (otherwise XLA copies it first). fp8 scratches (float8_e4m3fn) encode the high rows with ``fp8_scale[b]``.
    ``high``: ``(rows [L,Ph,kv,H,page,D], scale f32[L,kv])``, the twin (`jmixedkv.pools.kernel_arrays` of a
    `RowPool`)."""
    high_rows, high_scale = high
    _, _, kv, heads, _, d = high_rows.shape
    batch, k = indices.shape
    tk = block_rows(k)
    idx = _pad_indices(indices, tk)
    padded = idx.shape[1] != k
    buf = jnp.pad(scratch, ((0, 0), (0, idx.shape[1] - k), (0, 0), (0, 0), (0, 0))) if padded else scratch
    if high_table.shape[1] == 0:
        high_table = jnp.full((page_table.shape[0], 1), -1, jnp.int32)
    fp8 = scratch.dtype == jnp.dtype(jnp.float8_e4m3fn)
    check_offsets("overlay_retained_rows", high_rows=high_rows, scratch=buf)
    kernel = functools.partial(_overlay_kernel, geom=geom, tk=tk, kv=kv, heads=heads, d=d,
                               att_dtype=jnp.dtype(att_dtype), fp8=fp8)
    out = pl.pallas_call(
        kernel,
        grid=(batch, idx.shape[1] // tk, kv * heads),
        out_shape=jax.ShapeDtypeStruct(buf.shape, buf.dtype),
        input_output_aliases={9: 0},
        interpret=interpret,
        compiler_params=triton_params(num_warps=num_warps, num_stages=1),
    )(layer, seq, kv_lens, page_table, high_table, idx, 1.0 / fp8_scale, high_rows, high_scale, buf)
    return out[:, :k] if padded else out
