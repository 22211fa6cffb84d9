"""The NVFP4 codec: `quantize` / `dequantize` (backend dispatch: the Pallas kernels of `pallas_kernels.nvfp4` on a GPU,
any leading shape) and their pure-jnp references `quantize_reference` / `dequantize_reference` (run anywhere): the
one convention every kernel must match bit-exactly.

Format (docs/DESIGN.md §2):

* E2M1 elements ±{0, .5, 1, 1.5, 2, 3, 4, 6}: round-to-nearest-even, saturating at ±6. The sign of zero
  is kept (``-0.1`` encodes as code 8, ``-0``), as the hardware ``cvt.rn.satfinite.e2m1x2`` does.
* Blocks of 16 along the last axis; one FP8 E4M3 block scale per block, linear layout ``[..., D/16]``.
* Packing: element ``2i`` in the low nibble, ``2i+1`` in the high nibble, ``[..., D/2]`` uint8
  (``[0.5, 6.0]`` packs to ``0x71``).
* One float32 *decode* global scale ``gs`` per layer and per K/V (FlashInfer's ``k_scale``/``v_scale``);
  ``gs = amax / 2688`` when calibrated (`global_scale_from_amax`), 1.0 by default.

Exact operation order, all float32, every op rounded separately (no FMA, no reassociation), IEEE division::

    enc  = 1 / gs
    s    = e4m3_rne_satfinite(enc * (amax_block * f32(1/6)))      # clamp to [0, 448] before the cast
    r    = 0 if s == 0 else 1 / (f32(s) * gs)
    code = e2m1_rne_sat(x * r)
    x̂    = (e2m1(code) * f32(s)) * gs, then cast to the output dtype

This is TensorRT-LLM's kernel order with exact reciprocals (FlashInfer with fast math off). The convention is this
code evaluated with IEEE float32 arithmetic. XLA on NVIDIA GPUs lowers a float32 division to ``div.full.f32`` by
default, which is not always correctly rounded (``1 / 0.0011160715`` gives 896.0 there, IEEE 895.99994; H200,
jax 0.11.2), so a GPU run of this module then differs from the convention in rare E2M1 ties;
`jmixedkv.compat.xla_flags_with_ieee_division` gives the ``XLA_FLAGS`` that make it ``div.rn.f32`` (the test suite
sets them on CUDA machines). The Pallas kernels use ``div.rn.f32`` themselves and need no flag. Under ``jax.jit`` XLA
would reassociate ``enc * (amax * 1/6)`` into ``amax * (enc * 1/6)`` (scalar hoisting); intermediate products are
therefore routed through `jmixedkv.numerics.keep` (an integer OR with a zero XLA cannot prove), so eager, jitted
CPU, jitted GPU and the Pallas kernels all compute the same bits. ``gs`` must be positive and finite.

Non-finite input: a block holding NaN gets scale byte 0x7F (E4M3 NaN) and all-zero codes, so it decodes to
NaN in that block only; ±Inf gives scale 448 and element ±6. Nothing outside the block is touched.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .backend import dispatch
from .numerics import BLOCK, E2M1_MAX, E4M3_MAX, SIXTH, keep

__all__ = ["quantize", "dequantize", "check_global_scale", "quantize_reference", "dequantize_reference", "global_scale_from_amax",
           "pack_nibbles", "unpack_nibbles", "e2m1_codes", "e2m1_values", "e4m3_values", "block_sq_error", "BLOCK",
           "BLOCK_SCALES", "E4M3_MAX",
           "E2M1_MAX", "E2M1_TABLE"]

#: block scaling rules (`quantize`'s ``block_scale``): ``"max6"`` maps the block max to 6 (the pinned order);
#: ``"4over6"`` also tries mapping it to 4 and keeps, per block, the candidate with the lower squared error
BLOCK_SCALES = ("max6", "4over6")

#: value of each 4-bit code (bit 3 = sign)
E2M1_TABLE = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
#: float32 value of every E4M3 byte (0x7F / 0xFF are NaN)
E4M3_VALUES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def global_scale_from_amax(amax):
    """Decode global scale ``amax / 2688`` (= amax / (6 * 448)); 1.0 where ``amax`` is 0 or not finite."""
    amax = jnp.asarray(amax, jnp.float32)
    ok = jnp.isfinite(amax) & (amax > 0)
    return jnp.where(ok, amax / jnp.float32(E2M1_MAX * E4M3_MAX), jnp.float32(1.0))


def e2m1_codes(y):
    """4-bit E2M1 codes (uint8, one per element) of float32 ``y``: RNE, saturating, sign of zero kept, NaN -> 0."""
    a = jnp.abs(y)
    mag = ((a > 0.25).astype(jnp.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75)
           + (a > 2.5) + (a >= 3.5) + (a > 5.0)).astype(jnp.uint8)
    sign = jnp.signbit(y).astype(jnp.uint8) << 3
    return jnp.where(jnp.isnan(y), jnp.uint8(0), sign | mag)


def e2m1_values(codes):
    """float32 value of each 4-bit code (``codes`` any integer dtype, values 0..15)."""
    return jnp.asarray(E2M1_TABLE)[codes.astype(jnp.int32)]


def e4m3_values(s):
    """float32 value of E4M3 bytes, by table lookup.

    (Not ``s.astype(float32)``: XLA GPU folds an f32 -> e4m3 -> f32 round trip inside one fusion into the
    un-rounded value, which would change ``r`` and thus the codes.)"""
    return jnp.asarray(E4M3_VALUES)[jax.lax.bitcast_convert_type(s, jnp.uint8).astype(jnp.int32)]


def pack_nibbles(codes):
    """``u8[..., D]`` codes -> ``u8[..., D/2]``: element 2i in the low nibble, 2i+1 in the high nibble."""
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).astype(jnp.uint8)


def unpack_nibbles(packed):
    """``u8[..., D/2]`` -> ``u8[..., D]`` codes (inverse of `pack_nibbles`)."""
    both = jnp.stack([packed & 0xF, packed >> 4], axis=-1)
    return both.reshape(*packed.shape[:-1], packed.shape[-1] * 2).astype(jnp.uint8)


def _check_last_dim(d: int) -> None:
    if d % BLOCK:
        raise ValueError(f"NVFP4 needs the last dimension to be a multiple of {BLOCK}, got {d}")


def _block_codes(xf, amax, gs, inv_max):
    """One candidate of the pinned order with the block max mapped to ``1 / inv_max``: (scale e4m3, its f32
    value, codes u8[..., B, 16])."""
    enc = jnp.float32(1.0) / gs
    t = amax * inv_max
    s = enc * keep(t, t)
    s = jnp.where(jnp.isnan(s), s, jnp.clip(s, 0.0, E4M3_MAX)).astype(jnp.float8_e4m3fn)
    sf = e4m3_values(s)
    prod = sf * gs
    r = jnp.where(sf == 0, jnp.float32(0.0), jnp.float32(1.0) / keep(prod, prod))
    return s, sf, e2m1_codes(xf * keep(r, r)[..., None])  # opaque r: XLA may not rewrite x * (1/d) as x / d


def block_sq_error(xf, codes, sf, gs):
    """Squared dequantization error of each block, in the pinned order of ``"4over6"`` (docs/DESIGN.md §2):
    ``d = |x| - (|e2m1(code)| * f32(s)) * gs`` and ``d * d`` per element (each op rounded separately), summed as a
    balanced tree over adjacent elements (``(e0 + e1) + (e2 + e3)``, ...). ``xf f32[..., B, 16]``, ``codes
    u8[..., B, 16]``, ``sf f32[..., B]``, ``gs`` broadcastable to ``[..., B]`` -> ``f32[..., B]``."""
    p = jnp.abs(e2m1_values(codes)) * sf[..., None]
    xh = keep(p, p) * gs[..., None]
    d = jnp.abs(xf) - keep(xh, xh)
    e = d * d
    e = keep(e, e)
    while e.shape[-1] > 1:
        e = e.reshape(*e.shape[:-1], e.shape[-1] // 2, 2)
        e = e[..., 0] + e[..., 1]
    return e[..., 0]


def quantize_reference(x, global_scale=1.0, block_scale: str = "max6"):
    """Quantize ``x[..., D]`` (any float dtype, D % 16 == 0) to NVFP4.

    Args:
      x: ``float[..., D]``.
      global_scale: float32 decode scale, broadcastable to ``x.shape[:-1]`` (a scalar, or one per row).
      block_scale: ``"max6"`` (the pinned order) or ``"4over6"``: per block, also encode with the block max
        mapped to 4 (``amax * 0.25`` in place of ``amax * f32(1/6)``) and keep that candidate when its
        `block_sq_error` is strictly lower (ties, NaN blocks: max6). Same byte format and decoder.

    Returns:
      ``(packed u8[..., D/2], scales float8_e4m3fn[..., D/16])``.
    """
    if block_scale not in BLOCK_SCALES:
        raise ValueError(f"NVFP4 quantize: block_scale must be one of {BLOCK_SCALES}, got {block_scale!r}")
    x = jnp.asarray(x)
    _check_last_dim(x.shape[-1])
    xf = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    gs = jnp.broadcast_to(jnp.asarray(global_scale, jnp.float32), x.shape[:-1])[..., None]
    amax = jnp.max(jnp.abs(xf), axis=-1)
    amax = jnp.where(jnp.any(jnp.isnan(xf), axis=-1), jnp.float32(jnp.nan), amax)
    s, sf, codes = _block_codes(xf, amax, gs, SIXTH)
    if block_scale == "4over6":
        s4, sf4, codes4 = _block_codes(xf, amax, gs, jnp.float32(0.25))
        use4 = block_sq_error(xf, codes4, sf4, gs) < block_sq_error(xf, codes, sf, gs)
        s, codes = jnp.where(use4, s4, s), jnp.where(use4[..., None], codes4, codes)
    return pack_nibbles(codes.reshape(x.shape)), s


def dequantize_reference(packed, scales, global_scale=1.0, dtype=jnp.bfloat16):
    """Dequantize NVFP4 ``(packed u8[..., D/2], scales e4m3[..., D/16])`` to ``dtype[..., D]``."""
    packed = jnp.asarray(packed)
    d = packed.shape[-1] * 2
    _check_last_dim(d)
    if scales.shape[-1] * BLOCK != d:
        raise ValueError(f"NVFP4 scales last dim {scales.shape[-1]} does not match data last dim "
                         f"{packed.shape[-1]} (expected {d // BLOCK})")
    vals = e2m1_values(unpack_nibbles(packed)).reshape(*packed.shape[:-1], d // BLOCK, BLOCK)
    gs = jnp.broadcast_to(jnp.asarray(global_scale, jnp.float32), packed.shape[:-1])[..., None, None]
    sf = scales.astype(jnp.float32)[..., None]
    out = keep(vals * sf, sf) * gs
    return out.reshape(*packed.shape[:-1], d).astype(dtype)


# ----------------------------------------------------------------------------------------------- dispatch
def _flat_gs(global_scale, lead):
    gs = jnp.asarray(global_scale, jnp.float32)
    if gs.size == 1:
        return gs.reshape(())
    try:
        gs = jnp.broadcast_to(gs, lead)
    except ValueError as e:
        raise ValueError(f"NVFP4: global_scale of shape {gs.shape} does not broadcast to x.shape[:-1]={lead}") from e
    return gs.reshape(-1)


def check_global_scale(global_scale, op: str) -> None:
    """`ValueError` naming the value unless a concrete ``global_scale`` is finite and > 0 everywhere (0 decodes
    every row to 0 and makes ``1 / gs`` infinite; NaN / inf / negative give NaN or sign-flipped rows). A traced
    scale (inside jit) cannot be checked: it is the caller's contract."""
    if isinstance(global_scale, jax.core.Tracer):
        return
    a = np.asarray(global_scale, np.float64)
    bad = ~(np.isfinite(a) & (a > 0))
    if bad.any():
        raise ValueError(f"NVFP4 {op}: global_scale must be finite and > 0, got "
                         f"{np.ravel(a[bad])[:4].tolist()} (of {a.size} value(s))")


def quantize(x, global_scale=1.0, *, backend: str = "auto", block_scale: str = "max6", **kernel_kwargs):
    """`quantize_reference` (``backend="reference"``, or ``"auto"`` without a GPU) or the Pallas kernel, same bits.
    ``x[..., D]`` is viewed as ``[prod(...), D]`` for the kernel; ``**kernel_kwargs``: tiling knobs of
    `pallas_kernels.nvfp4.quantize` (``block_rows``, ``sub_rows``, ``num_warps``, ``num_stages``, ``width``).
    ``global_scale`` must be finite and > 0 (`check_global_scale`: concrete values raise `ValueError`)."""
    x = jnp.asarray(x)
    if x.ndim == 0:
        raise ValueError(f"NVFP4 quantize: x must have at least one dimension, got shape {x.shape}")
    check_global_scale(global_scale, "quantize")
    return dispatch(backend, quantize_reference, functools.partial(_quantize_pallas, **kernel_kwargs))(
        x, global_scale, block_scale)


def _quantize_pallas(x, global_scale, block_scale, *, interpret, **kernel_kwargs):
    from pallas_kernels import nvfp4 as kernels   # lazy: the reference never imports a kernel
    lead, d = x.shape[:-1], x.shape[-1]
    packed, scales = kernels.quantize(x.reshape(math.prod(lead), d), _flat_gs(global_scale, lead), interpret=interpret,
                                      block_scale=block_scale, **kernel_kwargs)
    return packed.reshape(*lead, packed.shape[-1]), scales.reshape(*lead, scales.shape[-1])


def dequantize(packed, scales, global_scale=1.0, dtype=jnp.bfloat16, *, backend: str = "auto", **kernel_kwargs):
    """`dequantize_reference` or the Pallas kernel (``backend``, ``**kernel_kwargs`` and the ``global_scale``
    rule as in `quantize`)."""
    check_global_scale(global_scale, "dequantize")
    packed, scales = jnp.asarray(packed), jnp.asarray(scales)
    if packed.ndim == 0 or scales.ndim != packed.ndim or scales.shape[:-1] != packed.shape[:-1]:
        raise ValueError(f"NVFP4 dequantize: packed {packed.shape} and scales {scales.shape} must share their "
                         f"leading dimensions")
    return dispatch(backend, dequantize_reference, functools.partial(_dequantize_pallas, **kernel_kwargs))(
        packed, scales, global_scale, dtype)


def _dequantize_pallas(packed, scales, global_scale, dtype, *, interpret, **kernel_kwargs):
    from pallas_kernels import nvfp4 as kernels
    lead = packed.shape[:-1]
    rows = math.prod(lead)
    out = kernels.dequantize(packed.reshape(rows, packed.shape[-1]), scales.reshape(rows, scales.shape[-1]),
                             _flat_gs(global_scale, lead), dtype, interpret=interpret, **kernel_kwargs)
    return out.reshape(*lead, out.shape[-1])
