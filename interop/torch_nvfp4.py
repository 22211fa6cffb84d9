"""The NVFP4 codec, the FP8 row codec and the Hadamard rotation in plain eager torch ops: the CPU references of the
torch-native hot path, bit-exact with `jmixedkv.nvfp4.quantize_reference` / `dequantize_reference` and
`jmixedkv.numerics.encode_rows` / `decode_rows`.

Byte formats (docs/DESIGN.md §2, `jmixedkv.layout`)::

    packed  torch.uint8 [..., D/2]    E2M1 codes, element 2i in the low nibble, 2i+1 in the high nibble
    scales  torch.uint8 [..., D/16]   E4M3 (float8_e4m3fn) block-scale bytes; torch.float8_e4m3fn is accepted too
    gs      float32, broadcastable to x.shape[:-1] (a float, one per layer and K/V, or one per row)
    fp8 rows torch.uint8 [..., D]     E4M3 bytes of ``e4m3(clip(f32(x) / scale, ±448))`` (NaN kept)

Operation order (float32, every op a separate eager torch op, hence rounded separately; IEEE division)::

    enc  = 1 / gs
    s    = e4m3_rne_satfinite(enc * (amax_block * f32(1/6)))      # clamped to [0, 448] before the cast
    r    = 0 if s == 0 else 1 / (f32(s) * gs)
    code = e2m1_rne_sat(x * r)
    x̂    = (e2m1(code) * f32(s)) * gs

``block_scale="4over6"`` also encodes with ``amax * 0.25`` and keeps that candidate per block when its squared
error (`block_sq_error`: balanced pairwise sum) is strictly lower. A block holding NaN gets scale byte 0x7F and
zero codes; ±Inf saturates (scale 448, element ±6).

Exactness: eager torch evaluates each elementwise op correctly rounded (SIMD included), never contracting a
product and a sum into an FMA and never reassociating, which is what the JAX reference fences XLA into; the tests
(`tests/test_torch_paged.py`) check the bytes against the JAX reference rather than relying on this argument. Do
not run these functions under ``torch.compile``: Inductor fuses elementwise ops and may contract them into FMAs.

The rotation (`hadamard`, `rotate`) is the lever of `jmixedkv.levers` (``x @ Hd`` in float32). It is *not*
bit-exact with JAX's einsum (the order of the float32 sums differs): it agrees to float32 rounding.
"""
from __future__ import annotations

import functools
from typing import Optional, Union

import numpy as np
import torch

from jmixedkv import levers
from jmixedkv.numerics import BLOCK, E4M3_MAX, SIXTH

__all__ = ["BLOCK_SCALES", "quantize", "dequantize", "cast", "e2m1_codes", "e2m1_values", "pack_nibbles",
           "unpack_nibbles", "block_sq_error", "e4m3_saturate", "e4m3_values", "is_fp8_pool", "encode_rows",
           "decode_rows", "hadamard", "rotate"]

#: block scaling rules of `quantize` (`jmixedkv.nvfp4.BLOCK_SCALES`)
BLOCK_SCALES = ("max6", "4over6")

#: value of each 4-bit E2M1 code (bit 3 = sign), as `jmixedkv.nvfp4.E2M1_TABLE`
_E2M1_TABLE = (0.0, .5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: the E2M1 rounding thresholds of the magnitude code (RNE: strict where the lower code is odd)
_E2M1_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def _f32(value, device) -> torch.Tensor:
    """A 0-dim float32 tensor (constants enter every op as float32, never as a Python double)."""
    return torch.tensor(np.float32(value), dtype=torch.float32, device=device)


def _check_last_dim(d: int, op: str) -> None:
    if d % BLOCK:
        raise ValueError(f"NVFP4 {op}: the last dimension must be a multiple of {BLOCK}, got {d}")


def _global_scale(gs, lead, device, op: str) -> torch.Tensor:
    """``gs`` as float32 broadcast to ``lead`` (x.shape[:-1]); host values must be finite and > 0."""
    g = gs if isinstance(gs, torch.Tensor) else torch.tensor(gs, dtype=torch.float32)
    if g.dtype != torch.float32:
        raise ValueError(f"NVFP4 {op}: global scale must be float32, got {g.dtype}")
    g = g.to(device)
    try:
        g = torch.broadcast_to(g, lead)
    except RuntimeError as e:
        raise ValueError(f"NVFP4 {op}: global scale of shape {tuple(g.shape)} does not broadcast to "
                         f"x.shape[:-1]={tuple(lead)}") from e
    if g.device.type == "cpu" and not torch.compiler.is_compiling():
        bad = ~(torch.isfinite(g) & (g > 0))
        if bool(bad.any()):
            raise ValueError(f"NVFP4 {op}: global scale must be finite and > 0, got {g[bad][:4].tolist()}")
    return g


def _scale_bytes(scales: torch.Tensor, op: str) -> torch.Tensor:
    if scales.dtype == torch.float8_e4m3fn:
        return scales.view(torch.uint8)
    if scales.dtype != torch.uint8:
        raise ValueError(f"NVFP4 {op}: scales must be uint8 (E4M3 bytes) or float8_e4m3fn, got {scales.dtype}")
    return scales


#: the quiet NaN a float32 NaN converts to in XLA (payload's top bits kept: 0x7FC00000 -> these), by dtype
_QUIET_NAN_BITS = {torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)`` with NaN going to the quiet NaN of its sign (bf16 0x7FC0 / 0xFFC0, fp16 0x7E00 / 0xFE00), as
    XLA converts the canonical float32 NaN; torch's own casts give other payloads (bf16 0xFFFF)."""
    out = x.to(dtype)
    if dtype not in _QUIET_NAN_BITS or x.dtype == dtype:
        return out
    bits = _QUIET_NAN_BITS[dtype]
    nan = torch.tensor([bits, bits - 0x10000 + 0x8000], dtype=torch.int16, device=x.device).view(dtype)
    return torch.where(torch.isnan(x), torch.where(torch.signbit(x), nan[1], nan[0]), out)


# ------------------------------------------------------------------------------------------------ E2M1
def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (uint8) of float32 ``y``: RNE, saturating at ±6, sign of zero kept, NaN -> 0."""
    a = torch.abs(y)
    mag = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for t, inclusive in _E2M1_STEPS:
        mag += ((a >= t) if inclusive else (a > t)).to(torch.uint8)
    sign = torch.signbit(y).to(torch.uint8) << 3
    return torch.where(torch.isnan(y), torch.zeros((), dtype=torch.uint8, device=y.device), sign | mag)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 value of each 4-bit code (any integer dtype, values 0..15)."""
    table = torch.tensor(_E2M1_TABLE, dtype=torch.float32, device=codes.device)
    return table[codes.to(torch.int64)]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``u8[..., D]`` codes -> ``u8[..., D/2]`` (element 2i in the low nibble)."""
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``u8[..., D/2]`` -> ``u8[..., D]`` codes (inverse of `pack_nibbles`)."""
    both = torch.stack([packed & 0xF, packed >> 4], dim=-1)
    return both.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# ------------------------------------------------------------------------------------------------ E4M3
def e4m3_saturate(y: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes (uint8) of float32 ``y``: RNE, clamped to ``±448`` first, NaN kept (0x7F / 0xFF by sign)."""
    y = torch.where(torch.isnan(y), y, torch.clamp(y, -E4M3_MAX, E4M3_MAX))
    return y.to(torch.float8_e4m3fn).view(torch.uint8)


@functools.lru_cache(maxsize=None)
def _e4m3_table_np() -> np.ndarray:
    """float32 value of every E4M3 byte, NaN bytes as the canonical quiet NaN with their sign (0x7FC00000 /
    0xFFC00000, as `jmixedkv.nvfp4.E4M3_VALUES`; torch's own cast gives the payload 0x7FF00000)."""
    table = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32).numpy()
    table = table.copy()
    table.view(np.uint32)[[0x7F, 0xFF]] = [0x7FC00000, 0xFFC00000]
    return table


def e4m3_values(s_bytes: torch.Tensor) -> torch.Tensor:
    """float32 value of E4M3 bytes (uint8 or float8_e4m3fn), by table lookup (NaN bytes: the canonical NaN)."""
    table = torch.from_numpy(_e4m3_table_np()).to(s_bytes.device)
    if s_bytes.dtype == torch.float8_e4m3fn:
        s_bytes = s_bytes.view(torch.uint8)
    return table[s_bytes.to(torch.int64)]


# ------------------------------------------------------------------------------------------------ the codec
def _block_codes(xf, amax, gs, inv_max):
    """One candidate of the pinned order with the block max mapped to ``1 / inv_max``: (scale bytes u8[..., B],
    their f32 values, codes u8[..., B, 16]). ``xf f32[..., B, 16]``, ``amax f32[..., B]``, ``gs f32[..., 1]``."""
    dev = xf.device
    enc = torch.div(_f32(1.0, dev), gs)
    s = enc * (amax * inv_max)
    s = torch.where(torch.isnan(s), s, torch.clamp(s, 0.0, E4M3_MAX)).to(torch.float8_e4m3fn).view(torch.uint8)
    sf = e4m3_values(s)
    prod = sf * gs
    r = torch.where(sf == 0, _f32(0.0, dev), torch.div(_f32(1.0, dev), prod))
    return s, sf, e2m1_codes(xf * r[..., None])


def block_sq_error(xf, codes, sf, gs) -> torch.Tensor:
    """Squared dequantization error per block (`jmixedkv.nvfp4.block_sq_error`): ``d = |x| - (|e2m1(code)| *
    f32(s)) * gs``, ``d * d``, summed as a balanced tree over adjacent elements. ``xf f32[..., B, 16]``, ``codes
    u8[..., B, 16]``, ``sf f32[..., B]``, ``gs`` broadcastable to ``[..., B]`` -> ``f32[..., B]``."""
    xh = (torch.abs(e2m1_values(codes)) * sf[..., None]) * gs[..., None]
    d = torch.abs(xf) - xh
    e = d * d
    while e.shape[-1] > 1:
        e = e.reshape(*e.shape[:-1], e.shape[-1] // 2, 2)
        e = e[..., 0] + e[..., 1]
    return e[..., 0]


def quantize(x: torch.Tensor, gs: Union[float, torch.Tensor] = 1.0, block_scale: str = "max6"):
    """NVFP4 of ``x[..., D]`` (bf16 / fp16 / f32, ``D % 16 == 0``), bit-exact with
    `jmixedkv.nvfp4.quantize_reference`.

    Args:
      x: ``float[..., D]``.
      gs: float32 decode global scale, broadcastable to ``x.shape[:-1]`` (a float, or a tensor); finite and > 0
        (checked for host values).
      block_scale: ``"max6"`` or ``"4over6"``.

    Returns:
      ``(packed u8[..., D/2], scales u8[..., D/16])`` (the scales are E4M3 bytes).
    """
    if block_scale not in BLOCK_SCALES:
        raise ValueError(f"NVFP4 quantize: block_scale must be one of {BLOCK_SCALES}, got {block_scale!r}")
    if not isinstance(x, torch.Tensor) or x.ndim == 0 or not x.is_floating_point():
        raise ValueError(f"NVFP4 quantize: x must be a float tensor with at least one dimension, got "
                         f"{getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}")
    d = x.shape[-1]
    _check_last_dim(d, "quantize")
    lead = x.shape[:-1]
    xf = x.to(torch.float32).reshape(*lead, d // BLOCK, BLOCK)
    g = _global_scale(gs, lead, x.device, "quantize")[..., None]                        # [..., 1]
    amax = torch.amax(torch.abs(xf), dim=-1)
    amax = torch.where(torch.isnan(xf).any(dim=-1), _f32(float("nan"), x.device), amax)
    s, sf, codes = _block_codes(xf, amax, g, _f32(SIXTH, x.device))
    if block_scale == "4over6":
        s4, sf4, codes4 = _block_codes(xf, amax, g, _f32(0.25, x.device))
        use4 = block_sq_error(xf, codes4, sf4, g) < block_sq_error(xf, codes, sf, g)
        s, codes = torch.where(use4, s4, s), torch.where(use4[..., None], codes4, codes)
    return pack_nibbles(codes.reshape(*lead, d)), s


def dequantize(packed: torch.Tensor, scales: torch.Tensor, gs: Union[float, torch.Tensor] = 1.0,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(e2m1 * f32(scale)) * gs`` of NVFP4 ``(packed u8[..., D/2], scales u8 | float8_e4m3fn [..., D/16])``
    in float32, then cast to ``dtype`` -> ``dtype[..., D]`` (`jmixedkv.nvfp4.dequantize_reference`).
    ``gs`` broadcastable to ``packed.shape[:-1]``."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"NVFP4 dequantize: packed must be uint8, got {packed.dtype}")
    scales = _scale_bytes(scales, "dequantize")
    d = packed.shape[-1] * 2
    _check_last_dim(d, "dequantize")
    if scales.shape[:-1] != packed.shape[:-1] or scales.shape[-1] * BLOCK != d:
        raise ValueError(f"NVFP4 dequantize: scales {tuple(scales.shape)} do not match packed "
                         f"{tuple(packed.shape)} (expected [..., {d // BLOCK}])")
    lead = packed.shape[:-1]
    vals = e2m1_values(unpack_nibbles(packed)).reshape(*lead, d // BLOCK, BLOCK)
    g = _global_scale(gs, lead, packed.device, "dequantize")[..., None, None]
    out = (vals * e4m3_values(scales)[..., None]) * g
    return cast(out.reshape(*lead, d), dtype)


# ------------------------------------------------------------------------------------------------ FP8 rows
def is_fp8_pool(dtype: torch.dtype) -> bool:
    """True for a row pool holding FP8 E4M3: ``torch.uint8`` (its bytes, the kernels' view) or
    ``torch.float8_e4m3fn``; False for bf16 / fp16 / f32."""
    return dtype in (torch.uint8, torch.float8_e4m3fn)


def encode_rows(x: torch.Tensor, pool_dtype: torch.dtype, scale: Union[float, torch.Tensor] = 1.0) -> torch.Tensor:
    """Store form of rows ``x`` for a row pool of ``pool_dtype`` (`jmixedkv.numerics.encode_rows`).

    FP8 (``pool_dtype`` uint8 or float8_e4m3fn): ``e4m3_saturate(f32(x) / scale)`` (IEEE division; ``scale``
    float32 broadcastable to ``x``), returned in ``pool_dtype``. bf16 / fp16 / f32: a cast (``scale`` unused)."""
    if is_fp8_pool(pool_dtype):
        sc = scale if isinstance(scale, torch.Tensor) else _f32(scale, x.device)
        out = e4m3_saturate(torch.div(x.to(torch.float32), sc.to(torch.float32)))
        return out if pool_dtype == torch.uint8 else out.view(torch.float8_e4m3fn)
    return cast(x, pool_dtype)


def decode_rows(rows: torch.Tensor, scale: Union[float, torch.Tensor] = 1.0,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Read form of stored rows (`jmixedkv.numerics.decode_rows`): FP8 (uint8 bytes or float8_e4m3fn) ->
    ``f32(e4m3) * scale`` (``scale`` broadcastable) then ``out_dtype``; other dtypes: a cast."""
    if is_fp8_pool(rows.dtype):
        sc = scale if isinstance(scale, torch.Tensor) else _f32(scale, rows.device)
        return cast(e4m3_values(rows) * sc.to(torch.float32), out_dtype)
    return cast(rows, out_dtype)


# ------------------------------------------------------------------------------------------------ rotation
def hadamard(d: int, device: Optional[Union[str, torch.device]] = None) -> torch.Tensor:
    """Orthonormal, symmetric Sylvester-Hadamard matrix ``f32[d, d]`` (``H @ H = I``), the entries of
    `jmixedkv.levers.hadamard` bit for bit (``±f32(1 / sqrt(d))``)."""
    return torch.from_numpy(levers.hadamard_np(d).copy()).to(device)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``f32(x[..., D]) @ Hd`` in float32 (self-inverse). Agrees with `jmixedkv.levers.rotate` to float32
    rounding, not bit for bit (the matmul sums in another order)."""
    return torch.matmul(x.to(torch.float32), hadamard(x.shape[-1], x.device))
