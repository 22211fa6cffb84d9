"""Pallas Triton kernel: stage a mixed-precision paged cache into plain attention-dtype pages (one pass).

Owns the staging copy of the read side (TensorRT-LLM's staging for generic backends) and `column_chunks`, shared
by the read kernels; the retained set and the ring column are `jmixedkv.layout.TwinGeometry`'s (static ``geom``),
the NVFP4 arithmetic `pallas_kernels.nvfp4_ops.dequant_tile`, the twin's row read form
`jmixedkv.numerics.decode_rows`:

* one program per ``(batch row b, page column j, (layer, kv, head))``: it loads the NVFP4 page tile
  ``u8[page, D/2]`` + ``e4m3[page, D/16]``, dequantizes it in registers (``(e2m1 * f32(s)) * gs``, then the
  attention dtype, the pinned order of `jmixedkv.nvfp4`), and — when the page overlaps the retained set and the
  twin holds it — loads the high tile and takes it for the retained rows (``where``), then stores the page once.
  Rows at or past ``kv_len`` are written as zeros; staged pages past ``ceil(kv_len / page)`` are not written.
* head dims that are not a power of two (MLA latent 576 = 512 + 64) are processed as power-of-two column chunks.

The staged page of ``(b, j)`` goes to ``out_table[b, j]`` (compact ids chosen by the caller); ``-1`` skips.
Inputs are validated by `jmixedkv.staging.stage` before this runs; inside the kernel -1 page ids are skipped.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jmixedkv.compat import triton_params
from jmixedkv.layout import TwinGeometry, check_offsets
from jmixedkv.numerics import decode_rows

from .nvfp4_ops import dequant_tile

__all__ = ["stage_pages", "column_chunks"]


def column_chunks(d: int):
    """Split head_dim ``d`` (a multiple of 16) into power-of-two ``(start, width)`` chunks, widest first.

    ``128 -> [(0, 128)]``; ``576 -> [(0, 512), (512, 64)]``."""
    out, start, bit = [], 0, 1 << (d.bit_length() - 1)
    while start < d:
        while bit > d - start:
            bit >>= 1
        out.append((start, bit))
        start += bit
    return out


def _stage_kernel(layers_ref, seq_ref, lens_ref, pt_ref, ht_ref, ot_ref, data_ref, scales_ref, gs_ref,
                  hrows_ref, hscale_ref, out_ref, *, geom: TwinGeometry, kv: int, heads: int, d: int,
                  has_high: bool, out_dtype):
    b, j, z = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    li, kvh = z // (kv * heads), z % (kv * heads)
    kvi, hi = kvh // heads, kvh % heads
    lay = layers_ref[li]
    page = geom.page
    s = seq_ref[b]
    sc = jnp.maximum(s, 0)
    n = jnp.where(s >= 0, lens_ref[sc], 0)
    lp = pt_ref[sc, j]
    dst = ot_ref[b, j]
    active = (s >= 0) & (j * page < n) & (lp >= 0) & (dst >= 0)
    gs = gs_ref[lay, kvi]
    pos = j * page + jax.lax.broadcasted_iota(jnp.int32, (page,), 0)
    valid = (pos < n)[:, None]

    def low_chunk(c0, w):
        scales = scales_ref[lay, lp, kvi, hi, :, pl.ds(c0 // 16, w // 16)].astype(jnp.float32)
        tile = dequant_tile(data_ref[lay, lp, kvi, hi, :, pl.ds(c0 // 2, w // 2)], scales, gs, out_dtype)
        return jnp.where(valid, tile, jnp.zeros((), out_dtype))

    def store(c0, w, x):
        out_ref[li, dst, kvi, hi, :, pl.ds(c0, w)] = x

    if not has_high:
        @pl.when(active)
        def _():
            for c0, w in column_chunks(d):
                store(c0, w, low_chunk(c0, w))
        return

    hp, held = geom.twin_page(ht_ref, sc, geom.page_column(j))
    use_high = held & geom.page_overlaps_window(j, n)

    @pl.when(active & ~use_high)
    def _():
        for c0, w in column_chunks(d):
            store(c0, w, low_chunk(c0, w))

    @pl.when(active & use_high)
    def _():
        keep = geom.is_retained(pos, n)[:, None]
        hscale = hscale_ref[lay, kvi]
        for c0, w in column_chunks(d):
            high = decode_rows(hrows_ref[lay, hp, kvi, hi, :, pl.ds(c0, w)], hscale, out_dtype)
            store(c0, w, jnp.where(keep, high, low_chunk(c0, w)))


@functools.partial(jax.jit, static_argnames=("geom", "num_staged_pages", "out_dtype", "interpret", "num_warps"))
def stage_pages(layers, seq, kv_lens, page_table, high_table, out_table, *, low, high=None, geom: TwinGeometry,
                num_staged_pages: int, out_dtype, interpret: bool = False, num_warps: int = 4):
    """Stage pages of ``layers`` for batch rows ``seq`` into ``out_dtype[NL, num_staged_pages, kv, H, page, D]``.

    Args:
      layers: i32[NL] layer indices (one layer or all).
      seq: i32[B] sequence slots (-1 = padding, nothing staged).
      kv_lens: i32[S]; page_table: i32[S, W] low page ids; high_table: i32[S, F + R] twin page ids.
      out_table: i32[B, W] staged page id of each ``(b, j)`` (-1 = not staged).
      low: ``(data u8[L,P,kv,H,page,D/2], scales e4m3[L,P,kv,H,page,D/16], gs f32[L,kv])``, the low pool
        (`jmixedkv.pools.kernel_arrays` of a `LowPool`).
      high: ``(rows [L,Ph,kv,H,page,D], scale f32[L,kv])``, the twin (of a `RowPool`), or None for a group without
        a twin.
      geom: the twin's static `TwinGeometry` (``geom.page`` = the pools' page size).

    Staged pages not named by ``out_table`` are left unwritten (unspecified contents).
    """
    num_layers = layers.shape[0]
    data, scales, gs = low
    high_rows, high_scale = (None, None) if high is None else high
    _, _, kv, heads, page, half = data.shape
    d = half * 2
    has_high = high_rows is not None
    if not has_high:  # placeholders keep one kernel signature
        high_rows = jnp.zeros((1, 1, 1, 1, 1, 1), out_dtype)
        high_scale = jnp.ones((1, 1), jnp.float32)
        high_table = jnp.full((1, 1), -1, jnp.int32)
    if high_table.shape[1] == 0:
        high_table = jnp.full((page_table.shape[0], 1), -1, jnp.int32)
    batch, width = out_table.shape
    check_offsets("stage", data=data, scales=scales, high_rows=high_rows)
    kernel = functools.partial(_stage_kernel, geom=geom, kv=kv, heads=heads, d=d, has_high=has_high,
                               out_dtype=jnp.dtype(out_dtype))
    return pl.pallas_call(
        kernel,
        grid=(batch, width, num_layers * kv * heads),
        out_shape=jax.ShapeDtypeStruct((num_layers, num_staged_pages, kv, heads, page, d), out_dtype),
        interpret=interpret,
        compiler_params=triton_params(num_warps=num_warps, num_stages=1),
    )(layers, seq, kv_lens, page_table, high_table, out_table, data, scales, gs, high_rows, high_scale)
