"""In-kernel NVFP4 arithmetic, one definition each, shared by every Pallas kernel (docs/DESIGN.md §2, §6).

A leaf module of the kernel package: it imports only `jmixedkv.compat` and `jmixedkv.numerics`. Everything here
works on values inside a Pallas Triton kernel (and in interpret mode, and as plain jnp), with no float8 / float4
casts (the E4M3 scale is rounded with integer ops, E2M1 codes come from magic-constant adds):

* exact float32 ops: `ptx_f32` (one PTX instruction with an explicit rounding modifier: never contracted into an
  FMA), `div_rn` and `recip` (IEEE division: Triton lowers ``/`` to the approximate ``div.full.f32``);
* E4M3: `e4m3_encode` (float32 -> byte, RNE, no cast) and `e4m3_decode` (byte -> float32);
* E2M1: `e2m1_code_magnitude` / `e2m1_magic_bits` (float32 -> |code| 0..7, RNE, saturating: the *encoder*) and
  `e2m1_value` (4-bit code -> float32 value, sign of zero kept: the *decoder*);
* blocks: `block_quant` (per-block scale byte, reciprocal and NaN flag in the pinned order), the element views
  `f32_halves` / `bf16_pair_halves` and `quantize_halves` (packed codes of a block tile), `dequant_tile`;
* the decode kernels' f16 form of E2M1: `NIBBLE_TO_F16` and `e2m1_f16_halves` (packed bytes -> f16 ``e2m1 * 2^-14``,
  exact) and `E2M1_F16_PTX`, the packed inline PTX both compiled decode kernels use, which builds the same bits.

Float ``min``/``max`` lower to NaN-ignoring ``minnum``/``maxnum`` on the GPU and NaN-propagating ones on the CPU,
so block maxima are **int32 maxima over the float bits** (NaN bits sort above Inf) and every NaN-dependent result
is selected explicitly (a NaN block gets scale byte 0x7F and all codes 0).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jmixedkv.compat import pltriton
from jmixedkv.numerics import BLOCK, E4M3_MAX, SIXTH as _SIXTH_F32, keep

__all__ = ["as_bits", "from_bits", "ptx_f32", "div_rn", "recip", "e4m3_encode", "e4m3_decode",
           "e2m1_code_magnitude", "e2m1_magic_bits", "e2m1_value", "block_quant", "f32_halves", "bf16_pair_halves",
           "quantize_halves", "dequant_tile", "SIXTH", "NIBBLE_TO_F16", "E2M1_F16_PTX", "e2m1_f16_halves"]

#: float32 1/6 of the pinned order as a Python float (exactly the float32 value; a weak-typed kernel constant)
SIXTH = float(_SIXTH_F32)
_MAGIC = 8388608.0          # 2^23: ulp 1, so x + 2^23 rounds x to an integer (RNE)
_MAGIC_BITS = 0x4B000000
_PACK_BIAS = (-17 * _MAGIC_BITS) % (1 << 32)     # -17 * 0x4B000000 mod 2^32 = 0x05000000 (see quantize_halves)


def as_bits(x):
    """int32 bit pattern of float32 ``x``."""
    return lax.bitcast_convert_type(x, jnp.int32)


def from_bits(i):
    """float32 with int32 bit pattern ``i``."""
    return lax.bitcast_convert_type(i, jnp.float32)


# ------------------------------------------------------------------------------------------- exact f32 ops
def ptx_f32(code: str, *args):
    """One float32 PTX instruction (``$0`` = result) on broadcast float32 operands (compiled GPU path only).

    An instruction with an explicit rounding modifier (``mul.rn.f32``, ``sub.rn.f32``, ``div.rn.f32``) is never
    fused into an FMA by ``ptxas``; ``div.rn.f32`` is the correctly rounded IEEE division."""
    args = [jnp.asarray(a, jnp.float32) for a in args]
    shape = jnp.broadcast_shapes(*(a.shape for a in args))
    args = [jnp.broadcast_to(a, shape) for a in args]
    constraints = ",".join(["=f"] + ["f"] * len(args))
    [out] = pltriton.elementwise_inline_asm(code, args=args, constraints=constraints, pack=1,
                                            result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.float32)])
    return out


def div_rn(a, b):
    """IEEE float32 ``a / b`` on the GPU (``div.rn.f32``)."""
    return ptx_f32("div.rn.f32 $0, $1, $2;", a, b)


def recip(d, exact_asm: bool):
    """``1 / d`` correctly rounded in float32: ``div.rn.f32`` when ``exact_asm`` (compiled), else jnp division
    (interpret mode: IEEE on the CPU)."""
    one = jnp.ones_like(d)
    return div_rn(one, d) if exact_asm else one / d


# ------------------------------------------------------------------------------------------- E4M3
def e4m3_encode(s):
    """RNE float32 -> E4M3 for ``s`` in ``[0, E4M3_MAX]`` or NaN, without an fp8 cast.

    Returns ``(byte int32, value float32, nan bool)``; a NaN ``s`` gives byte 0x7F."""
    sb = as_bits(s)
    rb = (sb + (0x7FFFF + ((sb >> 20) & 1))) & jnp.int32(-(1 << 20))   # keep 3 mantissa bits, RNE
    byte_n = (rb >> 20) - 960                                           # (exp - 120) << 3 | mantissa
    t = s * 512.0 + _MAGIC                                              # subnormals: multiples of 2^-9
    byte_s = as_bits(t) - _MAGIC_BITS
    val_s = byte_s.astype(jnp.float32) * (1.0 / 512.0)                  # (no (t - 2^23): XLA folds it)
    normal = s >= 2.0 ** -6
    byte = jnp.where(normal, byte_n, byte_s)
    val = jnp.where(normal, from_bits(rb), val_s)
    nan = s != s
    return jnp.where(nan, 0x7F, byte), val, nan


def e4m3_decode(b):
    """E4M3 byte (int32 0..255) -> float32 value (exact; 0x7F / 0xFF -> NaN)."""
    b7 = b & 0x7F
    val = jnp.where(b7 >= 8, from_bits((b7 + 960) << 20), b7.astype(jnp.float32) * (1.0 / 512.0))
    val = jnp.where(b7 == 0x7F, jnp.float32(jnp.nan), val)
    return jnp.where((b & 0x80) != 0, -val, val)


# ------------------------------------------------------------------------------------------- E2M1
def e2m1_magic_bits(a):
    """Encoder core: int32 bits of the float ``2^23 + |E2M1 code|`` (code 0..7, RNE, saturating at 6) of float32
    ``a >= 0`` (NaN: unspecified, masked by the caller); ``bits - 0x4B000000`` is the code.

    The code is ``RNE(g(a))`` with ``g(a) = min(2 a, a + 2, a / 2 + 4)`` (``2a`` on [0, 2), ``a + 2`` on [2, 4),
    ``a / 2 + 4`` on [4, 6]: the three lines of the E2M1 grid, concave, so ``g`` is their minimum), and RNE is
    monotone, so ``RNE(g(a)) = min`` of the three lines each rounded alone: ``a * m + (2^23 + b)`` rounds once to
    an integer (``a * m`` is exact, so an FMA gives the same bits). ``a`` is clamped to 6 first (saturation; the
    minimum also keeps ``ptxas`` from contracting the caller's ``x * r`` into the adds, which would skip the
    rounding of ``x * r`` that the pinned order has). One float minimum, three adds / FMAs and two minima per
    element: the adds run on the FMA pipe, which leaves the integer / logic pipe (the bound of the quantize
    kernel, 16 lanes per SM sub-partition on Hopper) half the work of the compare-and-select form."""
    a = jnp.minimum(a, 6.0)
    y = jnp.minimum(jnp.minimum(a * 2.0 + _MAGIC, a + (_MAGIC + 2.0)), a * 0.5 + (_MAGIC + 4.0))
    return as_bits(y)


def e2m1_code_magnitude(y, nonneg: bool = False):
    """Encoder: |E2M1 code| (int32 0..7) of float32 ``y``, RNE, saturating at 6 (NaN: unspecified, masked by the
    caller). ``nonneg``: the caller guarantees ``y >= 0`` (skips the abs). See `e2m1_magic_bits`."""
    return e2m1_magic_bits(y if nonneg else jnp.abs(y)) - _MAGIC_BITS


def e2m1_value(code):
    """Decoder: float32 value of 4-bit E2M1 codes (int32 0..15; bit 3 = sign): ±{0, .5, 1, 1.5, 2, 3, 4, 6}.

    Built from bits: magnitude ``m >= 2`` is ``(m + 252) << 22``, ``m == 1`` is 0.5; the sign is OR-ed in (not
    ``-x``: Triton lowers negation as ``0 - x``, which would turn -0.0 into +0.0), so code 8 is -0.0."""
    mag = code & 7
    vbits = jnp.where(mag >= 2, (mag + 252) << 22, jnp.where(mag == 1, 0x3F000000, 0))
    return from_bits(vbits | ((code & 8) << 28))


# ------------------------------------------------------------------------------------------- blocks
def block_quant(amax_bits, gs, exact_asm: bool, inv_max: float = SIXTH):
    """Per block, the pinned order (`jmixedkv.nvfp4`): ``s = e4m3(clip(1/gs * (amax * f32(1/6)), 0, 448))``,
    ``r = 0 if s == 0 else 1 / (f32(s) * gs)``.

    Args:
      amax_bits: int32 ``[S, B]`` bits of the block amax (NaN bits if the block holds a NaN).
      gs: float32 decode global scale, broadcastable to ``[S, B]``.
      exact_asm: exact reciprocals by inline ``div.rn.f32`` (compiled GPU path).
      inv_max: the factor in place of ``f32(1/6)`` (``0.25``: the "max to 4" candidate of ``"4over6"``).

    Returns:
      ``(scale byte int32 [S, B], r float32 [S, B], NaN flag bool [S, B])``."""
    amax = from_bits(amax_bits)
    enc = recip(gs, exact_asm)
    t = amax * inv_max
    s = enc * keep(t, t)                                                          # the pinned order, no reassoc.
    s = jnp.where(s > E4M3_MAX, E4M3_MAX, s)
    s = jnp.where(s < 0.0, 0.0, s)                                                # NaN passes both
    byte, sf, nan = e4m3_encode(s)
    prod = sf * gs
    r = jnp.where(sf == 0.0, 0.0, recip(keep(prod, prod), exact_asm))
    return byte, r, nan


def f32_halves(xb):
    """Element views of float32 bits ``xb int32[S, B, 16]`` (B blocks of 16): ``(lo, hi, signs)``, each
    ``int32[S, B, 8]``: ``lo`` / ``hi`` are the |x| bits of elements ``2i`` / ``2i + 1``, ``signs`` their sign bits
    at nibble positions 3 and 7."""
    xl, xh = jnp.unstack(xb.reshape(*xb.shape[:-1], BLOCK // 2, 2), axis=-1)
    return xl & 0x7FFFFFFF, xh & 0x7FFFFFFF, ((xl >> 28) & 0x08) | ((xh >> 24) & 0x80)


def bf16_pair_halves(u):
    """`f32_halves` of bf16 input viewed as int32 pairs ``u int32[S, B, 8]`` (element ``2i`` in the low half-word):
    the float32 bits are ``u << 16`` and ``u & 0xFFFF0000``, with no bf16 -> f32 converts and no shuffles."""
    ua = u & 0x7FFF7FFF
    return ua << 16, ua & 0x7FFF0000, ((u >> 12) & 0x08) | ((u >> 24) & 0x80)


def _sq_error(lo, hi, ml, mh, byte, gs, exact_asm: bool):
    """`jmixedkv.nvfp4.block_sq_error` of one candidate, op for op: ``d = |x| - (e2m1(m) * f32(s)) * gs``, ``d * d``,
    then the adjacent-pair tree (elements ``2i + 2i+1`` first: ``lo + hi``). Products are ``mul.rn.f32`` on the GPU
    (never contracted, subnormals kept) and fenced by `keep` elsewhere. -> ``f32[S, B]``."""
    def mul(a, b):
        if exact_asm:
            return ptx_f32("mul.rn.f32 $0, $1, $2;", a, b)
        p = a * b
        return keep(p, p)
    sf = e4m3_decode(byte)[:, :, None]
    gs3 = jnp.asarray(gs)[:, :, None]                                             # [S, 1, 1] or [1, 1, 1]
    sq = lambda b, m: mul(*(2 * [from_bits(b) - mul(mul(e2m1_value(m), sf), gs3)]))  # noqa: E731
    e = sq(lo, ml) + sq(hi, mh)                                                   # [S, B, 8]
    while e.shape[-1] > 1:
        a, b = jnp.unstack(e.reshape(*e.shape[:-1], e.shape[-1] // 2, 2), axis=-1)
        e = a + b
    return e[..., 0]


def quantize_halves(lo, hi, signs, gs, exact_asm: bool, block_scale: str = "max6"):
    """NVFP4 of a block tile given by its element views (`f32_halves` / `bf16_pair_halves`); ``block_scale``
    ``"max6"`` (the pinned order) or ``"4over6"`` (`jmixedkv.nvfp4.quantize_reference`: per block the lower-error of the
    max-to-6 and max-to-4 candidates, ties to max6).

    Returns ``(packed int32[S, B, 8]`` (byte ``i`` of a block: element ``2i`` low nibble, ``2i + 1`` high nibble; 0
    in NaN blocks), ``scale byte int32[S, B])``."""
    amax_bits = jnp.max(jnp.maximum(lo, hi), axis=-1)                             # [S, B]; NaN bits sort last

    def candidate(inv_max):
        byte, r, nan = block_quant(amax_bits, gs, exact_asm, inv_max)
        r3 = r[:, :, None]
        bits = lambda b: e2m1_magic_bits(from_bits(b) * r3)  # noqa: E731  |x * r| exactly -> 2^23 + |code|
        return byte, nan, bits(lo), bits(hi)

    byte, nan, bl, bh = candidate(SIXTH)
    if block_scale == "4over6":
        byte4, _, bl4, bh4 = candidate(0.25)
        mag = lambda b: b - _MAGIC_BITS  # noqa: E731
        use4 = (_sq_error(lo, hi, mag(bl4), mag(bh4), byte4, gs, exact_asm)
                < _sq_error(lo, hi, mag(bl), mag(bh), byte, gs, exact_asm))
        byte = jnp.where(use4, byte4, byte)
        u3 = use4[:, :, None]
        bl, bh = jnp.where(u3, bl4, bl), jnp.where(u3, bh4, bh)
    elif block_scale != "max6":
        raise ValueError(f"NVFP4 kernel: block_scale must be 'max6' or '4over6', got {block_scale!r}")
    # (2^23 + mh) * 16 + (2^23 + ml) + signs - 17 * 2^23 (bits, int32 wrapping) = ml | mh << 4 | signs: one shift /
    # multiply-add and one 3-input add instead of masks, shift and ors
    packed = (bh << 4) + bl + signs + _PACK_BIAS
    return jnp.where(nan[:, :, None], 0, packed), byte


def dequant_tile(packed, scale_values, gs, out_dtype):
    """NVFP4 tile -> ``out_dtype[T, w]``, bit-exactly `jmixedkv.nvfp4.dequantize_reference`: ``(e2m1 * f32(s)) * gs``.

    Args:
      packed: ``u8[T, w/2]`` packed codes (element 2i in the low nibble).
      scale_values: float32 ``[T, w/16]`` block scale values (`e4m3_decode` of the bytes, or an E4M3 cast).
      gs: float32 decode global scale, broadcastable to ``[T, w/16, 16]``.
    """
    t, half = packed.shape
    w = half * 2
    p = packed.astype(jnp.int32)
    vals = e2m1_value(jnp.stack([p & 15, p >> 4], axis=-1).reshape(t, w))
    out = (vals.reshape(t, w // BLOCK, BLOCK) * scale_values[:, :, None]) * gs
    return out.reshape(t, w).astype(out_dtype)


# ------------------------------------------------------------------------------------ f16 form (decode kernels)
#: E2M1 nibble of a byte held in a 16-bit word -> the f16 bits ``sign << 15 | magnitude << 9`` (= the E2M1 value
#: times 2^-14, exact; f16 keeps the subnormal 0.5 * 2^-14), for the low nibble (element 2i) and the high nibble
#: (element 2i + 1): ``(magnitude mask, its left shift, sign mask, its left shift)``
NIBBLE_TO_F16 = ((0x7, 9, 0x8, 12), (0x70, 5, 0x80, 8))


def e2m1_f16_halves(packed):
    """Packed NVFP4 bytes (``u8``, any shape) -> ``(even, odd)`` f16 of ``e2m1 * 2^-14`` (low / high nibble), exact,
    integer ops only. The decode kernels multiply by ``f16(s) * 2^7`` (their *low domain*)."""
    w = packed.astype(jnp.uint16)
    u = jnp.uint16
    return tuple(lax.bitcast_convert_type(((w & u(mm)) << u(ms)) | ((w & u(sm)) << u(ss)), jnp.float16)
                 for mm, ms, sm, ss in NIBBLE_TO_F16)


#: e2m1 -> f16 for 4 packed bytes, times the per-element f16 block factor: inline PTX with pack=4, one call for the
#: low nibbles (even columns) and one for the high nibbles (odd columns); $0,$1 = the f16 pairs of bytes 0-1 / 2-3,
#: $2 = the 4 bytes, $3,$4 = the f16 factors of bytes 0-1 / 2-3. The high byte of each f16 is
#: ``sign << 7 | magnitude << 1`` (f16 bits ``sign << 15 | magnitude << 9`` = e2m1 value * 2^-14, exact), built for
#: 4 bytes at once (shift + and + lop3), moved into place by prmt (low byte 0), then one packed ``mul.rn.f16x2`` per
#: 2 elements: ~2 integer ops and half an f16x2 multiply per element, and no conversion instruction (those run at
#: 16 per clock per SM on Hopper: they bound an f16 -> f32 -> multiply -> bf16 dequantization).
E2M1_F16_PTX = {
    "lo": """{
.reg .b32 l, t, m;
shl.b32 l, $2, 1;
shl.b32 t, $2, 4;
and.b32 t, t, 0x80808080;
lop3.b32 l, l, 0x0E0E0E0E, t, 0xEA;
prmt.b32 m, l, 0, 0x1404;
mul.rn.f16x2 $0, m, $3;
prmt.b32 m, l, 0, 0x3424;
mul.rn.f16x2 $1, m, $4;
}""",
    "hi": """{
.reg .b32 h, t, m;
shr.b32 h, $2, 3;
and.b32 t, $2, 0x80808080;
lop3.b32 h, h, 0x0E0E0E0E, t, 0xEA;
prmt.b32 m, h, 0, 0x1404;
mul.rn.f16x2 $0, m, $3;
prmt.b32 m, h, 0, 0x3424;
mul.rn.f16x2 $1, m, $4;
}"""}
