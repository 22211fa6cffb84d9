"""Numeric primitives shared by the references and the kernels: one definition each (docs/DESIGN.md §2, §6).

A leaf module: it imports nothing from `jmixedkv` or `pallas_kernels`, so kernels may import it.

* Format constants: `BLOCK` (NVFP4 block length), `E2M1_MAX`, `E4M3_MAX` (the largest finite E4M3 value, 448),
  `SIXTH` (float32 1/6 of the pinned scale order).
* The FMA / reassociation fence. XLA's algebraic simplifier hoists scalar factors out of products
  (``e * (a * c)`` -> ``a * (e * c)``) and its CPU LLVM backend contracts ``a * b - c`` into an FMA;
  ``lax.optimization_barrier`` stops neither (XLA CPU expands barriers before fusion). A value routed through an
  integer OR with a zero the compiler cannot prove zero is opaque to both; the value is unchanged bit for bit.
  `keep` takes its zero from ``u * (u + 1)`` (even for every int32 ``u``), which holds for any data: a zero that
  rests on a fact the compiler can also prove is folded away (the old sign bit of a known non-negative value: LLVM's
  known bits see through ``abs``). `opaque_zero` + `launder` is the cheap form for ``|c| <= 1`` (bit 30 of RoPE's
  cos, which no compiler can prove clear): the in-kernel RoPE of the write kernel uses it per element.
* The FP8 row codec of row pools (an FP8 twin, plain FP8 pages, the FP8 gather scratch): `e4m3_saturate`
  (``e4m3(clip(y, ±448))``, NaN kept), `encode_rows` (``e4m3_saturate(f32(x) / scale)``, or a cast for 16-bit
  pools) and `decode_rows` (``f32(e4m3) * scale``, or a cast).
* RoPE angles: `inv_freq`, `rope_cos_sin` (the write kernel computes them outside the kernel with this code, so
  its ``cos``/``sin`` are those of the reference bit for bit).
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["BLOCK", "E2M1_MAX", "E4M3_MAX", "SIXTH", "keep", "opaque_zero", "launder", "is_fp8", "e4m3_saturate",
           "ieee_div", "encode_rows", "decode_rows", "inv_freq", "rope_cos_sin", "next_pow2"]

#: NVFP4 block length (elements per E4M3 block scale) along the last axis
BLOCK = 16
#: largest E2M1 magnitude
E2M1_MAX = 6.0
#: largest finite FP8 E4M3 (e4m3fn) magnitude; clamp before every E4M3 cast (XLA turns > 464 into NaN)
E4M3_MAX = 448.0
#: float32 1/6, the factor of the pinned block-scale order ``(1/gs) * (amax * SIXTH)``
SIXTH = np.float32(1.0) / np.float32(6.0)


# ------------------------------------------------------------------------------------------------ the fence
def opaque_zero(c):
    """int32 zeros the compiler cannot prove zero, from float32 ``c`` with ``|c| <= 1`` (bit 30, the exponent MSB,
    is clear; RoPE's cos / sin): two integer ops per element, the cheap zero of the in-kernel RoPE. Pair with
    `launder`. For values of any magnitude use `keep`."""
    return (jax.lax.bitcast_convert_type(c, jnp.int32) >> 30) & 1


def launder(a, z):
    """``a`` (float32) unchanged, routed through an integer OR with ``z`` (`opaque_zero`, broadcastable to ``a``),
    so no reassociation or FMA crosses it. Works in jnp and inside Pallas kernels."""
    return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(a, jnp.int32) | z, jnp.float32)


def keep(a, like):
    """``a`` (float32) unchanged but fenced, for ``like`` of any value: a float32 array broadcastable to ``a``
    (``a`` itself, or a smaller array to save integer ops) whose bits ``u`` give the zero ``(u * (u + 1)) & 1``
    (even for every int32 ``u``, wrapping included). Four integer ops per element of ``like``."""
    u = jax.lax.bitcast_convert_type(like, jnp.int32)
    return launder(a, (u * (u + 1)) & 1)


# ------------------------------------------------------------------------------------------------ FP8 rows
def is_fp8(dtype) -> bool:
    """True for FP8 E4M3 (``float8_e4m3fn``), the only FP8 row format."""
    return jnp.dtype(dtype) == jnp.dtype(jnp.float8_e4m3fn)


def e4m3_saturate(y):
    """``float8_e4m3fn`` of float32 ``y``, saturating at ``±E4M3_MAX`` (RNE; NaN stays NaN)."""
    return jnp.where(jnp.isnan(y), y, jnp.clip(y, -E4M3_MAX, E4M3_MAX)).astype(jnp.float8_e4m3fn)


def ieee_div(a, b):
    """``a / b`` (float32), correctly rounded, ``b`` broadcastable to ``a``. XLA rewrites a division by a broadcast
    into a multiply by the reciprocal (one ulp off: on the CPU an E4M3 tie of ``x / scale`` then rounds the other
    way); the broadcast behind an optimization barrier keeps the division."""
    b = jax.lax.optimization_barrier(jnp.broadcast_to(jnp.asarray(b, jnp.float32), jnp.shape(a)))
    return a / b


def encode_rows(x, dtype, scale, div=ieee_div):
    """Store form of rows ``x`` (any float dtype) for a row pool of ``dtype``.

    FP8: ``e4m3_saturate(div(f32(x), scale))`` with ``scale`` broadcastable to ``x`` (``div`` defaults to IEEE
    division, `ieee_div`; kernels pass their exact in-kernel division). Other dtypes: a cast (``scale``
    unused)."""
    if is_fp8(dtype):
        return e4m3_saturate(div(x.astype(jnp.float32), scale))
    return x.astype(dtype)


def decode_rows(rows, scale, out_dtype):
    """Read form of stored rows: FP8 -> ``f32(rows) * scale`` (``scale`` broadcastable), then ``out_dtype``;
    other dtypes: a cast."""
    if is_fp8(rows.dtype):
        return (rows.astype(jnp.float32) * scale).astype(out_dtype)
    return rows.astype(out_dtype)


# ------------------------------------------------------------------------------------------------ RoPE angles
def inv_freq(rotary_dim: int, theta: float) -> np.ndarray:
    """f32[rotary_dim/2] ``theta ** (-2i / rotary_dim)``, computed on the host (identical on every backend)."""
    i = np.arange(0, rotary_dim, 2, dtype=np.float64)
    return (1.0 / (theta ** (i / rotary_dim))).astype(np.float32)


def rope_cos_sin(positions, rotary_dim: int, theta: float):
    """``(cos, sin)`` f32[..., rotary_dim/2] of the angles ``f32(positions) * inv_freq`` for integer ``positions``."""
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq(rotary_dim, theta))
    return jnp.cos(ang), jnp.sin(ang)


def next_pow2(n: int) -> int:
    """Smallest power of two ``>= n`` (1 for ``n <= 1``): the padded sizes of kernels and page buckets."""
    return 1 << max(0, int(n) - 1).bit_length()
