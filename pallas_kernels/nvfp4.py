"""NVFP4 quantize / dequantize as Pallas **Triton-backend** kernels, bit-exact against `jmixedkv.nvfp4`.

Public API (2-D inputs; `jmixedkv.nvfp4.quantize` / `dequantize` dispatch any leading shape here)::

    quantize(x f[rows, D], global_scale) -> (packed u8[rows, D/2], scales float8_e4m3fn[rows, D/16])
    dequantize(packed u8[rows, D/2], scales e4m3[rows, D/16], global_scale, dtype) -> dtype[rows, D]

``global_scale`` (the *decode* scale ``gs``) is a scalar or ``f32[rows]``. ``D`` is any multiple of 16
(64, 128, 256, 512 and the MLA latent 576 are the tested ones).

How the kernels are laid out:

* **Rows are independent** (blocks of 16 never cross a row), so the wrapper views ``x[rows, D]`` as
  ``x[rows * D / W, W]`` with ``W`` the largest power of two dividing ``D`` (capped at 512): 576 = 9 x 64
  runs as 64-wide kernel rows with no padding at all (a per-row ``gs`` is repeated 9 times). ``width=16`` makes
  every kernel row a single quantization block. Kernel rows are padded to a multiple of ``block_rows`` (an XLA
  pad, i.e. one extra copy of the input, only when they are not already; small inputs shrink the block instead).
* Grid: one program per ``block_rows`` kernel rows; inside, a loop over ``sub_rows``-row tiles (so a
  program streams many rows while keeping only ``sub_rows x W`` values in registers; ``num_stages``
  lets Triton pipeline the loads of the next tile).
* Quantize is a **per-block** kernel: it sees the input as 3-D blocks ``x[n, W/16, 16]`` so the block amax is a
  reduction over the innermost axis and every per-block value (amax, scale byte, ``r``, NaN flag) lives on an
  ``[S, W/16]`` tile whose broadcast back to the elements needs no reshape; the packed output is ``[n, W/16, 8]``.
  bf16 input is bit-cast by the wrapper to int32 pairs ``[n, W/16, 8]`` (element ``2i`` is ``u << 16``, ``2i+1`` is
  ``u & 0xFFFF0000``: no bf16 -> f32 converts and no shuffles); other dtypes split the nibble pairs with
  ``jnp.unstack``. (The other variants measured and their timings: bench/RESULTS.md.)
* The arithmetic is `pallas_kernels.nvfp4_ops` (shared with the write and read kernels): **no float8 / float4
  casts** (E4M3 rounding with integer ops, E2M1 codes as the minimum of three magic-constant multiply-adds: FMA-pipe
  work, `nvfp4_ops.e2m1_magic_bits`), **exact division** by inline PTX ``div.rn.f32`` on the GPU (Triton's float32
  ``/`` is the approximate ``div.full.f32``), block maxima as **int32 maxima over the float bits** (NaN-safe on both
  backends). Scales leave the kernel as uint8 and are bit-cast in the wrapper. On the H200 the kernel is bound by
  the integer / logic (ALU) pipe (ncu: ALU 79% busy, issue 81%, 89 registers).

Bit-exactness holds for every input ``x`` (NaN, Inf, zeros, subnormals) as long as ``gs`` is a finite
positive float in ``[2^-100, 2^100]`` (any calibrated ``amax / 2688`` is): then no product of the pinned
order under- or overflows, and flush-to-zero of subnormals on the GPU cannot change a code or a scale.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmixedkv.compat import pl, triton_params
from jmixedkv.layout import offset_safe_count
from jmixedkv.numerics import BLOCK, next_pow2

from .nvfp4_ops import as_bits, bf16_pair_halves, dequant_tile, e4m3_decode, f32_halves, quantize_halves

__all__ = ["quantize", "dequantize", "kernel_width", "QUANT_DEFAULTS", "DEQUANT_DEFAULTS", "SUPPORTED_DTYPES",
           "tile_loop", "row_tiling", "gs_operand", "check_warps", "row_width", "resolve_interpret"]

#: kernel tiling defaults (kernel rows are ``W`` wide, see `kernel_width`; W = 128 for D = 128): the fastest
#: bit-exact tiling of a sweep on the H200 (figures in bench/RESULTS.md): quantize, 1 GiB bf16
#: with the three-line E2M1 encoder: 32 / 16 rows ahead of 32 / 32, 64 / 16 (2 stages), 16 / 16
#: (2 warps), 128+ rows and 8 warps
QUANT_DEFAULTS = dict(block_rows=32, sub_rows=16, num_warps=4, num_stages=1)
DEQUANT_DEFAULTS = dict(block_rows=512, sub_rows=32, num_warps=4, num_stages=2)
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
_MAX_W = 512


# ---------------------------------------------------------------------------------------------- helpers
def kernel_width(d: int) -> int:
    """Kernel row width ``W`` for a last dimension ``d``: largest power of two dividing ``d``, <= 512."""
    return min(d & -d, _MAX_W)


def _is_pow2(n) -> bool:
    return isinstance(n, (int, np.integer)) and n >= 1 and (n & (n - 1)) == 0


def tile_loop(n_sub: int, sub_rows: int, body):
    """Inside a kernel: call ``body(rows)`` for ``n_sub`` consecutive ``sub_rows``-row slices (a ``fori_loop``)."""
    if n_sub == 1:
        body(pl.ds(0, sub_rows))
        return

    def step(i, carry):
        body(pl.ds(pl.multiple_of(i * sub_rows, sub_rows), sub_rows))
        return carry

    lax.fori_loop(0, n_sub, step, jnp.int32(0))


def row_tiling(n: int, block_rows: int, sub_rows: int, w: int):
    """``(block rows, sub rows, padded kernel rows)`` for ``n`` kernel rows of width ``w``: the padded count is a
    multiple of the block and keeps both uint8 operands (``[n, w/2]``, ``[n, w/16]``) out of the Pallas Triton
    offset hole (`jmixedkv.layout.offset_safe_count`)."""
    for name, v in (("block_rows", block_rows), ("sub_rows", sub_rows)):
        if not _is_pow2(v):
            raise ValueError(f"NVFP4 kernel: {name} must be a power of two >= 1, got {v!r}")
    br = min(block_rows, next_pow2(n))
    sr = min(sub_rows, br)
    n_pad = -(-n // br) * br
    for per_row in (w // 2, w // BLOCK):
        n_pad = -(-offset_safe_count(n_pad, per_row, 1) // br) * br
    return br, sr, n_pad


def check_warps(num_warps, num_stages):
    """Validate Triton compiler params (clear errors naming the value)."""
    if not _is_pow2(num_warps) or num_warps > 32:
        raise ValueError(f"NVFP4 kernel: num_warps must be a power of two in [1, 32], got {num_warps!r}")
    if not isinstance(num_stages, (int, np.integer)) or num_stages < 1:
        raise ValueError(f"NVFP4 kernel: num_stages must be an integer >= 1, got {num_stages!r}")


def gs_operand(global_scale, rows: int, rep: int, n_pad: int):
    """(gs array, per_row): scalar -> f32[1]; per row -> f32[n_pad] repeated ``rep`` times per input row."""
    gs = jnp.asarray(global_scale, jnp.float32)
    if gs.size == 1:
        return gs.reshape(1), False
    if gs.shape != (rows,):
        raise ValueError(f"NVFP4: global_scale must be a scalar or f32[rows]=({rows},), got shape {gs.shape}")
    if rep > 1:
        gs = jnp.repeat(gs, rep)
    if n_pad > gs.shape[0]:
        gs = jnp.pad(gs, (0, n_pad - gs.shape[0]), constant_values=1.0)
    return gs, True


def row_width(d: int, width) -> int:
    """Kernel row width: `kernel_width` of ``d``, or a validated explicit ``width``."""
    if width is None:
        return kernel_width(d)
    if not _is_pow2(width) or width < BLOCK or d % width or width > _MAX_W:
        raise ValueError(f"NVFP4 kernel: width must be a power of two in [{BLOCK}, {_MAX_W}] dividing D={d}, "
                         f"got {width!r}")
    return int(width)


def resolve_interpret(interpret):
    """Interpret mode: as given, or when no GPU is present."""
    if interpret is None:
        return jax.default_backend() != "gpu"
    return bool(interpret)


# ---------------------------------------------------------------------------------------------- quantize
def _quant_kernel(x_ref, gs_ref, packed_ref, scales_ref, *, sub_rows, n_sub, per_row, exact_asm, pairs,
                  block_scale):
    def tile(rows):
        gs = (gs_ref[rows] if per_row else gs_ref[...]).reshape(-1, 1)            # [S, 1] or [1, 1]
        if pairs:
            lo, hi, signs = bf16_pair_halves(x_ref[rows, :, :])                   # int32 [S, B, 8]: 2 x bf16
        else:
            lo, hi, signs = f32_halves(as_bits(x_ref[rows, :, :].astype(jnp.float32)))   # [S, B, 16] -> [S, B, 8]
        packed, byte = quantize_halves(lo, hi, signs, gs, exact_asm, block_scale)
        packed_ref[rows, :, :] = packed.astype(jnp.uint8)
        scales_ref[rows, :] = byte.astype(jnp.uint8)

    tile_loop(n_sub, sub_rows, tile)


def quantize(x, global_scale=1.0, *, block_rows: int = QUANT_DEFAULTS["block_rows"],
             sub_rows: int = QUANT_DEFAULTS["sub_rows"], num_warps: int = QUANT_DEFAULTS["num_warps"],
             num_stages: int = QUANT_DEFAULTS["num_stages"], width=None, interpret=None,
             block_scale: str = "max6"):
    """NVFP4-quantize ``x`` with the Pallas kernel (bit-exact against `jmixedkv.nvfp4.quantize_reference`).

    Args:
      x: ``bfloat16 | float16 | float32 [rows, D]``, ``D % 16 == 0``.
      global_scale: decode scale ``gs``: a scalar or ``f32[rows]`` (finite, in ``[2^-100, 2^100]``).
      block_rows: kernel rows per program (power of two; kernel rows are ``kernel_width(D)`` wide).
      sub_rows: kernel rows per inner-loop tile (power of two, <= block_rows).
      num_warps, num_stages: Triton compiler params.
      width: kernel row width ``W`` (power of two in [16, 512] dividing D; default `kernel_width(D)`). ``16`` makes
        every kernel row one quantization block; a per-row gs is then repeated D/16 times.
      interpret: run in Pallas interpret mode; default: when no GPU is present.
      block_scale: ``"max6"`` or ``"4over6"`` (`jmixedkv.nvfp4.quantize_reference`); same byte format either way.

    Returns:
      ``(packed uint8[rows, D/2], scales float8_e4m3fn[rows, D/16])``.
    """
    x = jnp.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"pallas_kernels.nvfp4.quantize takes x[rows, D], got shape {x.shape} "
                         f"(use jmixedkv.nvfp4.quantize for other ranks)")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"NVFP4 quantize: x dtype must be one of {[str(d) for d in SUPPORTED_DTYPES]}, "
                         f"got {x.dtype}")
    rows, d = x.shape
    if d % BLOCK or d == 0:
        raise ValueError(f"NVFP4 quantize: last dimension D must be a positive multiple of {BLOCK}, got {d}")
    check_warps(num_warps, num_stages)
    if block_scale not in ("max6", "4over6"):
        raise ValueError(f"NVFP4 quantize: block_scale must be 'max6' or '4over6', got {block_scale!r}")
    w = row_width(d, width)
    if rows == 0:
        return (jnp.zeros((0, d // 2), jnp.uint8), jnp.zeros((0, d // BLOCK), jnp.float8_e4m3fn))
    rep = d // w
    n = rows * rep
    br, sr, n_pad = row_tiling(n, block_rows, sub_rows, w)
    xk = x.reshape(n, w)
    if n_pad > n:
        xk = jnp.pad(xk, ((0, n_pad - n), (0, 0)))
    gs, per_row = gs_operand(global_scale, rows, rep, n_pad)
    interp = resolve_interpret(interpret)
    nb = w // BLOCK
    pairs = x.dtype == jnp.bfloat16
    if pairs:                 # element 2i is the low half-word of int32 i (little-endian, as on the GPU)
        xk = lax.bitcast_convert_type(xk.reshape(n_pad, nb, BLOCK // 2, 2), jnp.int32)
        x_spec = pl.BlockSpec((br, nb, BLOCK // 2), lambda i: (i, 0, 0))
    else:
        xk = xk.reshape(n_pad, nb, BLOCK)
        x_spec = pl.BlockSpec((br, nb, BLOCK), lambda i: (i, 0, 0))
    kernel = functools.partial(_quant_kernel, sub_rows=sr, n_sub=br // sr, per_row=per_row, exact_asm=not interp,
                               pairs=pairs, block_scale=block_scale)
    gs_spec = pl.BlockSpec((br,), lambda i: (i,)) if per_row else pl.BlockSpec((1,), lambda i: (0,))
    packed, scales = pl.pallas_call(
        kernel,
        grid=(n_pad // br,),
        in_specs=[x_spec, gs_spec],
        out_specs=[pl.BlockSpec((br, nb, BLOCK // 2), lambda i: (i, 0, 0)), pl.BlockSpec((br, nb), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct((n_pad, nb, BLOCK // 2), jnp.uint8),
                   jax.ShapeDtypeStruct((n_pad, nb), jnp.uint8)],
        compiler_params=triton_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interp,
        name="nvfp4_quantize",
    )(xk, gs)
    packed = packed.reshape(n_pad, w // 2)
    if n_pad > n:
        packed, scales = packed[:n], scales[:n]
    scales = lax.bitcast_convert_type(scales, jnp.float8_e4m3fn)
    return packed.reshape(rows, d // 2), scales.reshape(rows, d // BLOCK)


# ---------------------------------------------------------------------------------------------- dequantize
def _dequant_kernel(p_ref, s_ref, gs_ref, o_ref, *, sub_rows, n_sub, per_row):
    def tile(rows):
        sf = e4m3_decode(s_ref[rows, :].astype(jnp.int32))                       # [S, B]
        gs = (gs_ref[rows] if per_row else gs_ref[...]).reshape(-1, 1, 1)
        o_ref[rows, :] = dequant_tile(p_ref[rows, :], sf, gs, o_ref.dtype)      # [S, W]

    tile_loop(n_sub, sub_rows, tile)


def dequantize(packed, scales, global_scale=1.0, dtype=jnp.bfloat16, *,
               block_rows: int = DEQUANT_DEFAULTS["block_rows"], sub_rows: int = DEQUANT_DEFAULTS["sub_rows"],
               num_warps: int = DEQUANT_DEFAULTS["num_warps"], num_stages: int = DEQUANT_DEFAULTS["num_stages"],
               width=None, interpret=None):
    """Dequantize NVFP4 with the Pallas kernel (bit-exact against `jmixedkv.nvfp4.dequantize_reference`).

    Args:
      packed: ``uint8[rows, D/2]``.
      scales: ``float8_e4m3fn[rows, D/16]`` (uint8 bytes are accepted too).
      global_scale: decode scale: a scalar or ``f32[rows]``.
      dtype: output dtype, ``bfloat16 | float16 | float32``.
      block_rows, sub_rows, num_warps, num_stages, width, interpret: as in `quantize`.

    Returns:
      ``dtype[rows, D]``.
    """
    packed = jnp.asarray(packed)
    scales = jnp.asarray(scales)
    dtype = jnp.dtype(dtype)
    if packed.ndim != 2 or scales.ndim != 2:
        raise ValueError(f"pallas_kernels.nvfp4.dequantize takes packed[rows, D/2], scales[rows, D/16]; got "
                         f"shapes {packed.shape}, {scales.shape}")
    if packed.dtype != jnp.uint8:
        raise ValueError(f"NVFP4 dequantize: packed must be uint8, got {packed.dtype}")
    if scales.dtype not in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.uint8)):
        raise ValueError(f"NVFP4 dequantize: scales must be float8_e4m3fn (or uint8 bytes), got {scales.dtype}")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"NVFP4 dequantize: dtype must be one of {[str(d) for d in SUPPORTED_DTYPES]}, "
                         f"got {dtype}")
    rows, half = packed.shape
    d = half * 2
    if d % BLOCK or d == 0:
        raise ValueError(f"NVFP4 dequantize: D = 2 * packed.shape[-1] must be a positive multiple of {BLOCK}, "
                         f"got {d}")
    if scales.shape != (rows, d // BLOCK):
        raise ValueError(f"NVFP4 dequantize: scales shape {scales.shape} does not match packed {packed.shape} "
                         f"(expected {(rows, d // BLOCK)})")
    check_warps(num_warps, num_stages)
    w = row_width(d, width)
    if rows == 0:
        return jnp.zeros((0, d), dtype)
    if scales.dtype != jnp.uint8:
        scales = lax.bitcast_convert_type(scales, jnp.uint8)
    rep = d // w
    n = rows * rep
    br, sr, n_pad = row_tiling(n, block_rows, sub_rows, w)
    pk = packed.reshape(n, w // 2)
    sk = scales.reshape(n, w // BLOCK)
    if n_pad > n:
        pk = jnp.pad(pk, ((0, n_pad - n), (0, 0)))
        sk = jnp.pad(sk, ((0, n_pad - n), (0, 0)))
    gs, per_row = gs_operand(global_scale, rows, rep, n_pad)
    interp = resolve_interpret(interpret)
    kernel = functools.partial(_dequant_kernel, sub_rows=sr, n_sub=br // sr, per_row=per_row)
    gs_spec = pl.BlockSpec((br,), lambda i: (i,)) if per_row else pl.BlockSpec((1,), lambda i: (0,))
    out = pl.pallas_call(
        kernel,
        grid=(n_pad // br,),
        in_specs=[pl.BlockSpec((br, w // 2), lambda i: (i, 0)), pl.BlockSpec((br, w // BLOCK), lambda i: (i, 0)),
                  gs_spec],
        out_specs=pl.BlockSpec((br, w), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((n_pad, w), dtype),
        compiler_params=triton_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interp,
        name="nvfp4_dequantize",
    )(pk, sk, gs)
    if n_pad > n:
        out = out[:n]
    return out.reshape(rows, d)
