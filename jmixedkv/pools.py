"""Page pools as immutable pytrees, and the reference row read over them (the row store: `jmixedkv.write`).

* `LowPool`: NVFP4 history (packed data, E4M3 block scales, per-layer K/V decode global scale).
* `RowPool`: rows in an attention dtype (bf16 / fp16) or FP8 E4M3 with a per-layer K/V scale. Used for the
  high twin of a mixed group and for the whole history of a plain group.
* `GroupPools`: the pools of one layer group (``low`` / ``high`` / ``plain``; absent ones are None).

Layouts: see `jmixedkv.layout`. FP8 rows are stored as ``e4m3(clip(x / scale, ±E4M3_MAX))`` (IEEE division)
and read back as ``f32(e4m3) * scale`` (the codec of `jmixedkv.numerics`).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax

from . import numerics, nvfp4

__all__ = ["pytree", "LowPool", "RowPool", "GroupPools", "kernel_arrays", "encode_rows", "decode_rows",
           "read_low_rows", "read_row_pool"]


def pytree(*meta: str):
    """Class decorator: a frozen dataclass registered as a JAX pytree; the fields named in ``meta`` are static
    (hashable metadata), every other field is a child."""
    def register(cls):
        cls = dataclasses.dataclass(frozen=True)(cls)
        data = [f.name for f in dataclasses.fields(cls) if f.name not in meta]
        return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=list(meta))
    return register


@pytree()
class LowPool:
    """NVFP4 pool. ``data u8[L,P,kv,H,page,D/2]``, ``scales e4m3[L,P,kv,H,page,D/16]``, ``gs f32[L,kv]``."""

    data: jax.Array
    scales: jax.Array
    gs: jax.Array


@pytree()
class RowPool:
    """Row pool. ``rows dtype[L,P,kv,H,page,D]``, ``scale f32[L,kv]`` (1.0 unless fp8)."""

    rows: jax.Array
    scale: jax.Array


@pytree()
class GroupPools:
    low: Optional[LowPool] = None
    high: Optional[RowPool] = None
    plain: Optional[RowPool] = None


def kernel_arrays(pool):
    """A pool as the kernels take it: ``(data, scales, gs)`` for a `LowPool`, ``(rows, scale)`` for a `RowPool`,
    None for None (the kernels in ``pallas_kernels`` take raw arrays, never these pytrees)."""
    return None if pool is None else tuple(getattr(pool, f.name) for f in dataclasses.fields(pool))


def encode_rows(x, dtype, scale):
    """Store form of rows ``x[..., kv, H, D]`` for a row pool of ``dtype`` (``scale`` f32[kv]; see
    `jmixedkv.numerics.encode_rows`)."""
    return numerics.encode_rows(x, dtype, scale[:, None, None])


def decode_rows(rows, scale, out_dtype):
    """Read form of stored rows ``rows[..., kv, H, D]`` (``scale`` f32[kv]; `numerics.decode_rows`)."""
    return numerics.decode_rows(rows, scale[:, None, None], out_dtype)


def read_low_rows(low: LowPool, layer, pages, rows, out_dtype):
    """Dequantized low rows at ``(pages[...], rows[...])`` of ``layer`` -> ``[..., kv, H, D]``."""
    data = low.data[layer][pages, :, :, rows, :]
    scales = low.scales[layer][pages, :, :, rows, :]
    return nvfp4.dequantize_reference(data, scales, low.gs[layer][:, None], out_dtype)


def read_row_pool(pool: RowPool, layer, pages, rows, out_dtype):
    """Rows of a row pool at ``(pages[...], rows[...])`` of ``layer`` -> ``[..., kv, H, D]``."""
    return decode_rows(pool.rows[layer][pages, :, :, rows, :], pool.scale[layer], out_dtype)
