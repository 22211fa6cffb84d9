"""NVFP4 quantize / dequantize as Pallas **Triton-backend** kernels, bit-exact against `jmixedkv.nvfp4`.

Public API (2-D inputs; `jmixedkv.codec` dispatches any leading shape here)::

    quantize(x f[rows, D], global_scale) -> (packed u8[rows, D/2], scales float8_e4m3fn[rows, D/16])
    dequantize(packed u8[rows, D/2], scales e4m3[rows, D/16], global_scale, dtype) -> dtype[rows, D]

``global_scale`` (the *decode* scale ``gs``) is a scalar or ``f32[rows]``. ``D`` is any multiple of 16
(64, 128, 256, 512 and the MLA latent 576 are the tested ones).

How the kernels are laid out:

* **Rows are independent** (blocks of 16 never cross a row), so the wrapper views ``x[rows, D]`` as
  ``x[rows * D / W, W]`` with ``W`` the largest power of two dividing ``D`` (capped at 512): 576 = 9 x 64
  runs as 64-wide kernel rows with no padding at all (a per-row ``gs`` is repeated 9 times). ``width=16`` makes
  every kernel row a single quantization block (a tiling variant for the bench). Kernel rows are padded to a
  multiple of ``block_rows`` (an XLA pad, i.e. one extra copy of the input, only when they are not already; small
  inputs shrink the block instead).
* Grid: one program per ``block_rows`` kernel rows; inside, a loop over ``sub_rows``-row tiles (so a
  program streams 256-1024 rows while keeping only ``sub_rows x W`` values in registers; ``num_stages``
  lets Triton pipeline the loads of the next tile).
* Quantize variants (``impl=``; all bit-exact, they differ only in speed): ``"v1"`` (default; 2-D ``[S, W]``
  tiles reshaped to ``[S, W/16, 16]`` in the kernel for the block max and the broadcast of ``r``, nibbles paired
  by ``jnp.unstack`` on ``[S, W/2, 2]``) and three **per-block** kernels that see the input as 3-D blocks, so the
  block amax is a reduction over the innermost axis and every per-block value (amax, scale byte, ``r``, NaN
  flag) lives on an ``[S, W/16]`` tile whose broadcast back to the elements needs no reshape:
  ``"blocked"`` (``x[n, W/16, 16]``, nibble pairs by ``jnp.unstack``), ``"strided"`` (two stride-2 ref loads)
  and ``"pairs"`` (bf16 only: the wrapper bit-casts ``x`` to int32 pairs ``[n, W/16, 8]``, so element ``2i``
  is ``u << 16`` and ``2i+1`` is ``u & 0xFFFF0000``: no bf16->f32 converts and no shuffles; abs and sign
  bits of both halves in 4 int ops). ``recip="table"`` (scalar gs) replaces the per-block exact division by a
  gather from a 128-entry table ``1 / (s * gs)`` per scale byte, computed by XLA outside the kernel.
* **No float8 / float4 casts** inside the kernels: the E4M3 scale is rounded RNE with integer ops on the
  float32 bits (normal range) and a 2^23 magic add (subnormal range); E2M1 codes come from one
  multiply-add with a 2^23(+2k) magic constant (the add does the round-to-nearest-even), which is ~8 ops per
  element instead of 7 compares + 7 adds. Scales leave the kernel as uint8 and are bit-cast in the wrapper.
* **Exact division**: Triton lowers float32 ``/`` to the approximate ``div.full.f32``; on the GPU the two
  reciprocals of the pinned order (``1/gs`` per row, ``1/(s*gs)`` per block) use inline PTX ``div.rn.f32``.
  Interpret mode (CPU) uses the ordinary IEEE division.
* Float ``min``/``max`` lower to NaN-ignoring ``minnum``/``maxnum`` on the GPU, NaN-propagating ones on the
  CPU; the block amax is therefore an **int32 max over the float bits** (NaN bits sort above Inf), and every
  NaN-dependent result is selected explicitly (NaN block -> scale byte 0x7F and all codes 0).

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

from jmixedkv.compat import pl, pltriton, triton_params
from jmixedkv.nvfp4 import _keep  # opaque to XLA's simplifier; in the kernel two integer ops per block

__all__ = ["quantize", "dequantize", "kernel_width", "QUANT_DEFAULTS", "QUANT_IMPLS", "DEQUANT_DEFAULTS", "SUPPORTED_DTYPES"]

BLOCK = 16
#: kernel tiling defaults (kernel rows are ``W`` wide, see `kernel_width`; W = 128 for D = 128)
#: fastest bit-exact variant on the H200 (2026-11-29, bench/nvfp4_bench.py --quick: 0.535 ms for 1 GiB bf16,
#: 60% of copy bandwidth; v1 at 512/32/4/2 was 0.621 ms). "pairs" falls back to "blocked" for non-bf16 input.
QUANT_DEFAULTS = dict(block_rows=32, sub_rows=32, num_warps=4, num_stages=1, code_impl="magic", impl="pairs")
#: quantize kernel variants (see `quantize`): "v1" = the original 2-D kernel; the others are per-block 3-D kernels
QUANT_IMPLS = ("v1", "blocked", "strided", "pairs")
DEQUANT_DEFAULTS = dict(block_rows=512, sub_rows=32, num_warps=4, num_stages=2)
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
_MAX_W = 512
_SIXTH = float(np.float32(1.0) / np.float32(6.0))
_MAGIC = 8388608.0          # 2^23: ulp 1, so x + 2^23 rounds x to an integer (RNE)
_MAGIC_BITS = 0x4B000000


# ---------------------------------------------------------------------------------------------- helpers
def kernel_width(d: int) -> int:
    """Kernel row width ``W`` for a last dimension ``d``: largest power of two dividing ``d``, <= 512."""
    return min(d & -d, _MAX_W)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _is_pow2(n) -> bool:
    return isinstance(n, (int, np.integer)) and n >= 1 and (n & (n - 1)) == 0


def _bits(x):
    return lax.bitcast_convert_type(x, jnp.int32)


def _f32(i):
    return lax.bitcast_convert_type(i, jnp.float32)


def _recip(d, exact_asm: bool):
    """``1 / d`` correctly rounded (IEEE) in float32."""
    one = jnp.ones_like(d)
    if not exact_asm:
        return one / d
    [r] = pltriton.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;", args=[one, d], constraints="=f,f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(d.shape, jnp.float32)])
    return r


def _e4m3_encode(s):
    """RNE float32 -> E4M3 for ``s`` in [0, 448] or NaN: (byte int32, value float32). No fp8 cast."""
    sb = _bits(s)
    rb = (sb + (0x7FFFF + ((sb >> 20) & 1))) & jnp.int32(-(1 << 20))   # keep 3 mantissa bits, RNE
    byte_n = (rb >> 20) - 960                                           # (exp - 120) << 3 | mantissa
    t = s * 512.0 + _MAGIC                                              # subnormals: multiples of 2^-9
    byte_s = _bits(t) - _MAGIC_BITS
    val_s = byte_s.astype(jnp.float32) * (1.0 / 512.0)                  # (no (t - 2^23): XLA folds it)
    normal = s >= 2.0 ** -6
    byte = jnp.where(normal, byte_n, byte_s)
    val = jnp.where(normal, _f32(rb), val_s)
    nan = s != s
    return jnp.where(nan, 0x7F, byte), val, nan


def _e4m3_decode(b):
    """E4M3 byte (int32 0..255) -> float32 value (exact; 0x7F/0xFF -> NaN)."""
    b7 = b & 0x7F
    val = jnp.where(b7 >= 8, _f32((b7 + 960) << 20), b7.astype(jnp.float32) * (1.0 / 512.0))
    val = jnp.where(b7 == 0x7F, jnp.float32(jnp.nan), val)
    return jnp.where((b & 0x80) != 0, -val, val)


def _e2m1_magnitude(y, code_impl: str, nonneg: bool = False):
    """|E2M1 code| (int32 0..7) of float32 ``y``: RNE, saturating (NaN: unspecified, masked by caller).

    ``nonneg``: the caller guarantees ``y >= 0`` (skips the abs)."""
    a = y if nonneg else jnp.abs(y)
    if code_impl == "compare":
        c = ((a > 0.25).astype(jnp.int32) + (a >= 0.75).astype(jnp.int32) + (a > 1.25).astype(jnp.int32)
             + (a >= 1.75).astype(jnp.int32) + (a > 2.5).astype(jnp.int32) + (a >= 3.5).astype(jnp.int32)
             + (a > 5.0).astype(jnp.int32))
        return c
    # code = RNE(a * m) + b with (m, b) = (2, 0) on [0, 2), (1, 2) on [2, 4), (1/2, 4) on [4, 6]; a * m is exact,
    # so a fused multiply-add gives the same bits; the 2^23 + b magic makes the add round to an integer.
    a = jnp.minimum(a, 6.0)
    lt2 = a < 2.0
    lt4 = a < 4.0
    m = jnp.where(lt2, 2.0, jnp.where(lt4, 1.0, 0.5))
    magic = jnp.where(lt2, _MAGIC, jnp.where(lt4, _MAGIC + 2.0, _MAGIC + 4.0))
    return _bits(a * m + magic) & 7


def _tiles(n_sub: int, sub_rows: int, body):
    if n_sub == 1:
        body(pl.ds(0, sub_rows))
        return

    def step(i, carry):
        body(pl.ds(pl.multiple_of(i * sub_rows, sub_rows), sub_rows))
        return carry

    lax.fori_loop(0, n_sub, step, jnp.int32(0))


# ---------------------------------------------------------------------------------------------- quantize
def _e4m3_byte_cvt(s):
    """E4M3 byte (int32) of float32 ``s`` in [0, 448] or NaN by the sm_89+ instruction
    ``cvt.rn.satfinite.e4m3x2.f32`` (RNE; NaN -> 0x7F). GPU only; both halves get ``s``, the low byte is kept."""
    [b] = pltriton.elementwise_inline_asm(
        "{ .reg .b16 t; cvt.rn.satfinite.e4m3x2.f32 t, $1, $1; cvt.u32.u16 $0, t; }",
        args=[s], constraints="=r,f", pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(s.shape, jnp.int32)])
    return b & 0xFF


def _block_quant(amax_bits, gs, exact_asm, rtab_ref=None, e4m3_cvt=False):
    """Per block: (scale byte int32 [S, B], reciprocal r f32 [S, B], NaN flag bool [S, B]).

    ``rtab_ref``: optional f32[128] table of ``r`` per scale byte (`_recip_table`, scalar gs only) replacing the
    per-block exact division by a gather. ``e4m3_cvt`` (GPU only, ``exact_asm``): round the scale with the
    hardware E4M3 conversion instead of the integer arithmetic of `_e4m3_encode`."""
    amax = _f32(amax_bits)                                                        # NaN if the block has one
    enc = _recip(gs, exact_asm)
    t = amax * _SIXTH
    s = enc * _keep(t, t)                                                         # the pinned order, no reassoc.
    s = jnp.where(s > 448.0, 448.0, s)
    s = jnp.where(s < 0.0, 0.0, s)                                                # NaN passes both
    if e4m3_cvt and exact_asm:
        byte, nan = _e4m3_byte_cvt(s), s != s
        sf = _e4m3_decode(byte)                                                   # (dead code with a table)
    else:
        byte, sf, nan = _e4m3_encode(s)
    if rtab_ref is not None:
        return byte, rtab_ref[byte], nan                                          # byte in [0, 127]
    prod = sf * gs
    r = jnp.where(sf == 0.0, 0.0, _recip(_keep(prod, prod), exact_asm))
    return byte, r, nan


def _recip_table(gs):
    """f32[128]: ``r`` of the pinned order for each E4M3 scale byte 0..127 and the scalar decode scale ``gs``
    (f32[1]), computed by XLA with IEEE division exactly as `jmixedkv.nvfp4.quantize` does (0 for byte 0 and for
    the NaN byte 0x7F, whose codes are masked anyway)."""
    b = jnp.arange(128, dtype=jnp.int32)
    sf = _e4m3_decode(b)
    prod = sf * gs[0]
    prod = jnp.where(b == 0x7F, 1.0, prod)
    r = jnp.float32(1.0) / _keep(prod, prod)
    return jnp.where((sf == 0.0) | (b == 0x7F), jnp.float32(0.0), r)


def _quant_kernel(x_ref, gs_ref, packed_ref, scales_ref, *, sub_rows, n_sub, width, per_row, exact_asm,
                  code_impl):
    nb = width // BLOCK

    def tile(rows):
        xf = x_ref[rows, :].astype(jnp.float32)                                  # [S, W]
        gs = (gs_ref[rows] if per_row else gs_ref[...]).reshape(-1, 1)           # [S, 1] or [1, 1]
        amax_bits = jnp.max((_bits(xf) & 0x7FFFFFFF).reshape(sub_rows, nb, BLOCK), axis=-1)  # [S, B]
        byte, r, nan = _block_quant(amax_bits, gs, exact_asm)                    # [S, B]
        y = (xf.reshape(sub_rows, nb, BLOCK) * r[:, :, None]).reshape(sub_rows, width)
        code = _e2m1_magnitude(y, code_impl) | ((_bits(y) >> 28) & 8)
        lo, hi = jnp.unstack(code.reshape(sub_rows, width // 2, 2), axis=-1)
        packed = lo | (hi << 4)                                                  # [S, W/2]
        nan_h = jnp.broadcast_to(nan[:, :, None], (sub_rows, nb, BLOCK // 2)).reshape(sub_rows, width // 2)
        packed_ref[rows, :] = jnp.where(nan_h, 0, packed).astype(jnp.uint8)
        scales_ref[rows, :] = byte.astype(jnp.uint8)

    _tiles(n_sub, sub_rows, tile)


# ------------------------------------------------------------------------------- quantize, per-block variants
# impl="blocked" | "strided" | "pairs": the kernel sees x as 3-D blocks x[n, W/16, 16] (or, for "pairs", the bf16
# pairs as int32 x[n, W/16, 8]), so the block amax is a reduction over the innermost (in-thread) axis, every
# per-block quantity (amax, scale byte, reciprocal, NaN flag) lives on a [S, W/16] tile whose broadcast back to
# the elements is free (no reshapes, no layout conversions), and the packed output is written as [n, W/16, 8].
# The low / high nibble elements come from: "blocked": jnp.unstack of [S, B, 8, 2] (tt.split);
# "strided": two stride-2 ref loads; "pairs": the int32 view of two bf16 (element 2i = low half-word), so the
# float32 bits are ``u << 16`` and ``u & 0xFFFF0000`` with no shuffle at all (bf16 only; other dtypes use
# "blocked"). Per element: abs-bits (and), int max, one multiply, min, 2 compares + 4 selects + 1 FMA (magic
# code), and the sign; per block: the E4M3 rounding and one exact division.
def _magnitude(abs_bits, r3, code_impl):
    """|E2M1 code| (int32 0..7) of the element with float32 bits ``abs_bits`` (sign cleared) times ``r3 >= 0``."""
    return _e2m1_magnitude(_f32(abs_bits) * r3, code_impl, nonneg=True)              # = |x * r| exactly


def _quant_kernel_blocked(x_ref, gs_ref, *refs, sub_rows, n_sub, per_row, exact_asm, code_impl, impl, table,
                          e4m3_cvt):
    rtab_ref, packed_ref, scales_ref = refs if table else (None, *refs)

    def tile(rows):
        gs = (gs_ref[rows] if per_row else gs_ref[...]).reshape(-1, 1)            # [S, 1] or [1, 1]
        if impl == "pairs":
            u = x_ref[rows, :, :]                                                 # int32 [S, B, 8]: 2 x bf16
            ua = u & 0x7FFF7FFF
            lo, hi = ua << 16, ua & 0x7FFF0000                                    # |x_2i|, |x_2i+1| f32 bits
            signs = ((u >> 12) & 0x08) | ((u >> 24) & 0x80)                       # bf16 sign bits 15, 31
        else:
            if impl == "strided":
                xl = _bits(x_ref[rows, :, pl.ds(0, BLOCK // 2, stride=2)].astype(jnp.float32))
                xh = _bits(x_ref[rows, :, pl.ds(1, BLOCK // 2, stride=2)].astype(jnp.float32))
            else:
                xb = _bits(x_ref[rows, :, :].astype(jnp.float32))                 # [S, B, 16]
                xl, xh = jnp.unstack(xb.reshape(*xb.shape[:2], BLOCK // 2, 2), axis=-1)
            lo, hi = xl & 0x7FFFFFFF, xh & 0x7FFFFFFF
            signs = ((xl >> 28) & 0x08) | ((xh >> 24) & 0x80)
        amax_bits = jnp.max(jnp.maximum(lo, hi), axis=-1)                         # [S, B]; NaN bits sort last
        byte, r, nan = _block_quant(amax_bits, gs, exact_asm, rtab_ref, e4m3_cvt)
        r3 = r[:, :, None]
        packed = _magnitude(lo, r3, code_impl) | (_magnitude(hi, r3, code_impl) << 4) | signs   # [S, B, 8]
        packed_ref[rows, :, :] = jnp.where(nan[:, :, None], 0, packed).astype(jnp.uint8)
        scales_ref[rows, :] = byte.astype(jnp.uint8)

    _tiles(n_sub, sub_rows, tile)


def _tiling(n: int, block_rows: int, sub_rows: int):
    for name, v in (("block_rows", block_rows), ("sub_rows", sub_rows)):
        if not _is_pow2(v):
            raise ValueError(f"NVFP4 kernel: {name} must be a power of two >= 1, got {v!r}")
    br = min(block_rows, _next_pow2(n))
    sr = min(sub_rows, br)
    return br, sr, -(-n // br) * br


def _check_warps(num_warps, num_stages):
    if not _is_pow2(num_warps) or num_warps > 32:
        raise ValueError(f"NVFP4 kernel: num_warps must be a power of two in [1, 32], got {num_warps!r}")
    if not isinstance(num_stages, (int, np.integer)) or num_stages < 1:
        raise ValueError(f"NVFP4 kernel: num_stages must be an integer >= 1, got {num_stages!r}")


def _gs_operand(global_scale, rows: int, rep: int, n_pad: int):
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


def _width(d: int, width) -> int:
    if width is None:
        return kernel_width(d)
    if not _is_pow2(width) or width < BLOCK or d % width or width > _MAX_W:
        raise ValueError(f"NVFP4 kernel: width must be a power of two in [{BLOCK}, {_MAX_W}] dividing D={d}, "
                         f"got {width!r}")
    return int(width)


def _resolve_interpret(interpret):
    if interpret is None:
        return jax.default_backend() != "gpu"
    return bool(interpret)


def quantize(x, global_scale=1.0, *, block_rows: int = QUANT_DEFAULTS["block_rows"],
             sub_rows: int = QUANT_DEFAULTS["sub_rows"], num_warps: int = QUANT_DEFAULTS["num_warps"],
             num_stages: int = QUANT_DEFAULTS["num_stages"], code_impl: str = QUANT_DEFAULTS["code_impl"],
             impl: str = QUANT_DEFAULTS["impl"], recip: str = "div", scale_cvt: bool = False, width=None,
             interpret=None):
    """NVFP4-quantize ``x`` with the Pallas kernel (bit-exact against `jmixedkv.nvfp4.quantize`).

    Args:
      x: ``bfloat16 | float16 | float32 [rows, D]``, ``D % 16 == 0``.
      global_scale: decode scale ``gs``: a scalar or ``f32[rows]`` (finite, in ``[2^-100, 2^100]``).
      block_rows: kernel rows per program (power of two; kernel rows are ``kernel_width(D)`` wide).
      sub_rows: kernel rows per inner-loop tile (power of two, <= block_rows).
      num_warps, num_stages: Triton compiler params.
      code_impl: ``"magic"`` (multiply-add rounding, default) or ``"compare"`` (7 threshold compares).
      impl: kernel variant: ``"v1"`` (2-D ``[S, W]`` tiles, in-kernel reshapes; the original default),
        ``"blocked"`` (3-D ``[S, W/16, 16]`` tiles: per-block math on ``[S, W/16]``, nibble pairs by
        ``jnp.unstack``), ``"strided"`` (3-D, nibble pairs by two stride-2 loads), ``"pairs"`` (bf16 only, other
        dtypes run ``"blocked"``: the input is viewed as int32 bf16 pairs ``[n, W/16, 8]``, no shuffles at all).
        All are bit-exact; they differ only in speed.
      recip: per-block reciprocal of the per-block variants: ``"div"`` (exact division, inline ``div.rn.f32``)
        or ``"table"`` (a 128-entry table of ``1 / (s * gs)`` per scale byte built by XLA outside the kernel, then
        a gather; scalar ``global_scale`` only: per-row gs and ``impl="v1"`` use ``"div"``).
      scale_cvt: per-block variants on the GPU: round the E4M3 scale with the hardware
        ``cvt.rn.satfinite.e4m3x2.f32`` (sm_89+) instead of integer arithmetic (interpret mode ignores it).
      width: kernel row width ``W`` (power of two in [16, 512] dividing D; default `kernel_width(D)`). ``16`` makes
        every kernel row one quantization block (no in-kernel reshapes); a per-row gs is then repeated D/16 times.
      interpret: run in Pallas interpret mode; default: when no GPU is present.

    Returns:
      ``(packed uint8[rows, D/2], scales float8_e4m3fn[rows, D/16])``.
    """
    x = jnp.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"pallas_kernels.nvfp4.quantize takes x[rows, D], got shape {x.shape} "
                         f"(use jmixedkv.codec.quantize for other ranks)")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"NVFP4 quantize: x dtype must be one of {[str(d) for d in SUPPORTED_DTYPES]}, "
                         f"got {x.dtype}")
    rows, d = x.shape
    if d % BLOCK or d == 0:
        raise ValueError(f"NVFP4 quantize: last dimension D must be a positive multiple of {BLOCK}, got {d}")
    if code_impl not in ("magic", "compare"):
        raise ValueError(f"NVFP4 quantize: code_impl must be 'magic' or 'compare', got {code_impl!r}")
    if impl not in QUANT_IMPLS:
        raise ValueError(f"NVFP4 quantize: impl must be one of {QUANT_IMPLS}, got {impl!r}")
    if recip not in ("div", "table"):
        raise ValueError(f"NVFP4 quantize: recip must be 'div' or 'table', got {recip!r}")
    _check_warps(num_warps, num_stages)
    w = _width(d, width)
    if rows == 0:
        return (jnp.zeros((0, d // 2), jnp.uint8), jnp.zeros((0, d // BLOCK), jnp.float8_e4m3fn))
    rep = d // w
    n = rows * rep
    br, sr, n_pad = _tiling(n, block_rows, sub_rows)
    xk = x.reshape(n, w)
    if n_pad > n:
        xk = jnp.pad(xk, ((0, n_pad - n), (0, 0)))
    gs, per_row = _gs_operand(global_scale, rows, rep, n_pad)
    interp = _resolve_interpret(interpret)
    gs_spec = pl.BlockSpec((br,), lambda i: (i,)) if per_row else pl.BlockSpec((1,), lambda i: (0,))
    params = dict(grid=(n_pad // br,), compiler_params=triton_params(num_warps=num_warps, num_stages=num_stages),
                  interpret=interp, name="nvfp4_quantize")
    nb = w // BLOCK
    scale_spec = pl.BlockSpec((br, nb), lambda i: (i, 0))
    scale_shape = jax.ShapeDtypeStruct((n_pad, nb), jnp.uint8)
    if impl == "v1":
        kernel = functools.partial(_quant_kernel, sub_rows=sr, n_sub=br // sr, width=w, per_row=per_row,
                                   exact_asm=not interp, code_impl=code_impl)
        packed, scales = pl.pallas_call(
            kernel,
            in_specs=[pl.BlockSpec((br, w), lambda i: (i, 0)), gs_spec],
            out_specs=[pl.BlockSpec((br, w // 2), lambda i: (i, 0)), scale_spec],
            out_shape=[jax.ShapeDtypeStruct((n_pad, w // 2), jnp.uint8), scale_shape],
            **params,
        )(xk, gs)
    else:
        if impl == "pairs" and x.dtype != jnp.bfloat16:
            impl = "blocked"
        if impl == "pairs":       # element 2i is the low half-word of int32 i (little-endian, as on the GPU)
            xk = lax.bitcast_convert_type(xk.reshape(n_pad, nb, BLOCK // 2, 2), jnp.int32)
            x_spec = pl.BlockSpec((br, nb, BLOCK // 2), lambda i: (i, 0, 0))
        else:
            xk = xk.reshape(n_pad, nb, BLOCK)
            x_spec = pl.BlockSpec((br, nb, BLOCK), lambda i: (i, 0, 0))
        table = recip == "table" and not per_row
        kernel = functools.partial(_quant_kernel_blocked, sub_rows=sr, n_sub=br // sr, per_row=per_row,
                                   exact_asm=not interp, code_impl=code_impl, impl=impl, table=table,
                                   e4m3_cvt=bool(scale_cvt))
        extra_in = [_recip_table(gs)] if table else []
        packed, scales = pl.pallas_call(
            kernel,
            in_specs=[x_spec, gs_spec] + [pl.BlockSpec((128,), lambda i: (0,))] * len(extra_in),
            out_specs=[pl.BlockSpec((br, nb, BLOCK // 2), lambda i: (i, 0, 0)), scale_spec],
            out_shape=[jax.ShapeDtypeStruct((n_pad, nb, BLOCK // 2), jnp.uint8), scale_shape],
            **params,
        )(xk, gs, *extra_in)
        packed = packed.reshape(n_pad, w // 2)
    if n_pad > n:
        packed, scales = packed[:n], scales[:n]
    scales = lax.bitcast_convert_type(scales, jnp.float8_e4m3fn)
    return packed.reshape(rows, d // 2), scales.reshape(rows, d // BLOCK)


# ---------------------------------------------------------------------------------------------- dequantize
def _dequant_kernel(p_ref, s_ref, gs_ref, o_ref, *, sub_rows, n_sub, width, per_row):
    nb = width // BLOCK

    def tile(rows):
        p = p_ref[rows, :].astype(jnp.int32)                                     # [S, W/2]
        code = jnp.stack([p & 15, p >> 4], axis=-1).reshape(sub_rows, width)     # element 2i = low nibble
        mag = code & 7
        vbits = jnp.where(mag >= 2, (mag + 252) << 22, jnp.where(mag == 1, 0x3F000000, 0))
        v = _f32(vbits | ((code & 8) << 28))                                     # E2M1 value, sign of zero kept
        sf = _e4m3_decode(s_ref[rows, :].astype(jnp.int32))                      # [S, B]
        gs = (gs_ref[rows] if per_row else gs_ref[...]).reshape(-1, 1, 1)
        out = (v.reshape(sub_rows, nb, BLOCK) * sf[:, :, None]) * gs
        o_ref[rows, :] = out.reshape(sub_rows, width).astype(o_ref.dtype)

    _tiles(n_sub, sub_rows, tile)


def dequantize(packed, scales, global_scale=1.0, dtype=jnp.bfloat16, *,
               block_rows: int = DEQUANT_DEFAULTS["block_rows"], sub_rows: int = DEQUANT_DEFAULTS["sub_rows"],
               num_warps: int = DEQUANT_DEFAULTS["num_warps"], num_stages: int = DEQUANT_DEFAULTS["num_stages"],
               width=None, interpret=None):
    """Dequantize NVFP4 with the Pallas kernel (bit-exact against `jmixedkv.nvfp4.dequantize`).

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
    _check_warps(num_warps, num_stages)
    w = _width(d, width)
    if rows == 0:
        return jnp.zeros((0, d), dtype)
    if scales.dtype != jnp.uint8:
        scales = lax.bitcast_convert_type(scales, jnp.uint8)
    rep = d // w
    n = rows * rep
    br, sr, n_pad = _tiling(n, block_rows, sub_rows)
    pk = packed.reshape(n, w // 2)
    sk = scales.reshape(n, w // BLOCK)
    if n_pad > n:
        pk = jnp.pad(pk, ((0, n_pad - n), (0, 0)))
        sk = jnp.pad(sk, ((0, n_pad - n), (0, 0)))
    gs, per_row = _gs_operand(global_scale, rows, rep, n_pad)
    interp = _resolve_interpret(interpret)
    kernel = functools.partial(_dequant_kernel, sub_rows=sr, n_sub=br // sr, width=w, per_row=per_row)
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
