"""The row store of the torch hot path as one raw Triton kernel: `write_rows_` appends the new K/V rows of one layer
into the cache's pools (torch tensors in the exact layout of `jmixedkv.layout`), in place. Two read-back kernels
share its codec: `round_trip_rows` (rows as they would read once stored, without storing them) and `stage_rows`
(a layer's stored rows as a reader gets them, dense and left-aligned, a step's rows appended); the held-aside steps
of `interop.hf.JMixedKVCache` use them.

Bits equal to `jmixedkv.write.write_rows_reference(pools, stack([k, v], -3), layer, low_slot, high_slot, page,
block_scale)` (op 1 of the torch hot-path contract):

* NVFP4 of every row (16-element blocks, E4M3 block scales, ``gs = low_gs[layer, kv]``) into ``low_data`` /
  ``low_scales`` at ``low_slot``, in the pinned order of `jmixedkv.nvfp4` (``"max6"`` or ``"4over6"``);
* the row's store form (`jmixedkv.numerics.encode_rows`: the 16-bit row itself, or
  ``e4m3_saturate(f32(x) / scale)`` for an fp8 pool; a NaN keeps the sign bit of ``x``'s 16-bit word, as on the
  CPU: a GPU's fp16 -> f32 conversion drops a NaN's sign) into
  ``high_rows`` at ``high_slot`` (the twin of a mixed cache) or into ``plain_rows`` at ``low_slot`` (a plain cache);
* a slot of -1 skips the row (so does a slot past the pool: masked, and refused by the host check).

Pools (``L`` layers, ``P`` low / plain pages, ``Ph`` twin pages, ``H`` KV heads, ``D`` head_dim)::

    low_data    u8[L, P, 2, H, page, D/2]       packed E2M1, element 2i in the low nibble
    low_scales  u8 | float8_e4m3fn[L, P, 2, H, page, D/16]
    low_gs      f32[L, 2]
    high_rows   bf16 | fp16 | u8 | float8_e4m3fn[L, Ph, 2, H, page, D]     (u8 = the e4m3 bytes)
    high_scale  f32[L, 2]
    plain_rows / plain_scale: as high_*, with [L, P, ...]

One launch: grid ``(cdiv(T * H, BLOCK_R), 2)``; a program owns ``BLOCK_R`` rows (token, head) of K (axis 1 = 0) or
V (= 1), loads them as 16-bit words, and writes every pool of the cache. ``layer`` is a runtime scalar (not
specialized: one compiled kernel serves every layer). Offsets are int64.

Exactness on the GPU (compiled mode; its bits are checked on the device by the tests marked ``gpu``):

* launched with ``enable_fp_fusion=False`` (no FMA contraction: LLVM ``fp-contract=off`` and ``ptxas --fmad=false``);
* every division is ``tl.math.div_rn`` (``div.rn.f32``; a plain ``/`` may lower to an approximate division);
* E4M3 (block scales, fp8 rows) is encoded by integer arithmetic on the float bits (RNE, saturation by an explicit
  clamp first, NaN -> 0x7F, subnormals via a ``2^23`` add), never by an fp8 cast; E2M1 by comparisons (RNE,
  saturating at 6, sign of zero kept, NaN -> code 0);
* block maxima are int32 maxima over the ``|x|`` bits (NaN bits sort above inf; float ``max`` may drop NaN);
* ``"4over6"``: the per-block squared error in the order of `jmixedkv.nvfp4.block_sq_error` (balanced adjacent-pair
  sum), the max-to-4 candidate kept only when strictly better.

`lower_for_cuda` compiles the kernel exactly as `write_rows_` would launch it on an sm_90 device, on any machine (no
GPU needed), so a CPU test can check the launch binds and compiles and that the PTX arithmetic is ``div.rn`` / ``.rn``
and free of ``fma`` / ``.ftz``.

Modes: ``interpret=True`` runs the kernel in Triton's interpreter on CPU tensors (no environment variable), built
with ``triton.runtime.interpreter.InterpretedFunction``; ``interpret=False`` compiles it with ``triton.jit`` (CUDA).
The kernel and its helpers are plain functions of this module; `_build` clones them into a private globals dict per
mode (so the helper names resolve to interpreted or jitted functions) and caches the result. ``triton`` is imported
only there: importing this module does not need triton.

Validation (host): shapes, dtypes, devices, layer, page size, block scale; with ``check_values=True`` (default) also
the slot values (range, no repeats) and the layer's scales (finite, > 0), which reads them back to the host (a
device sync: pass ``check_values=False`` in a captured / compiled hot path). Errors are `ValueError` naming the
value.
"""
from __future__ import annotations

import types
from typing import Optional

import numpy as np
import torch

from jmixedkv.numerics import BLOCK, SIXTH, next_pow2

from .torch_paged import geometry
from .triton_launch import Launch

__all__ = ["write_rows_", "round_trip_rows", "stage_rows", "lower_for_cuda", "lower_round_trip_for_cuda",
           "lower_stage_for_cuda", "BLOCK_SCALES"]

#: block scaling rules of the low pool (`jmixedkv.nvfp4.BLOCK_SCALES`)
BLOCK_SCALES = ("max6", "4over6")

_ROW_DTYPES = (torch.bfloat16, torch.float16, torch.uint8, torch.float8_e4m3fn)
_FP8_DTYPES = (torch.uint8, torch.float8_e4m3fn)
_ATTN_DTYPES = (torch.bfloat16, torch.float16)
#: the kernel's literal for the float32 1/6 of the pinned order (``jmixedkv.numerics.SIXTH``, exact in float32)
SIXTH_LITERAL = 0.16666667163372040
assert SIXTH_LITERAL == float(SIXTH)
_ROW_NONE, _ROW_HIGH, _ROW_PLAIN = 0, 1, 2


# --------------------------------------------------------------------------------------------- kernel helpers
# Plain functions written in triton.language; `_build` clones them into the kernel's globals as interpreted or jitted
# functions. ``tl`` is bound there too (this module never imports triton at import time).

def _f32_of_bits16(u, IS_BF16: tl.constexpr):  # noqa: F821
    """float32 value of 16-bit words ``u`` (int16): bf16 by a shift of the bits, fp16 by an exact conversion."""
    if IS_BF16:
        return (u.to(tl.int32) << 16).to(tl.float32, bitcast=True)  # noqa: F821
    return u.to(tl.float16, bitcast=True).to(tl.float32)  # noqa: F821


def _bits16_of_f32(y, IS_BF16: tl.constexpr):  # noqa: F821
    """16-bit words (int16) of float32 ``y`` rounded to bf16 (RNE on the bits; NaN -> 0x7FC0, as torch) or fp16
    (an RNE conversion)."""
    if IS_BF16:
        b = y.to(tl.int32, bitcast=True)  # noqa: F821
        r = (b + (0x7FFF + ((b >> 16) & 1))) >> 16
        return tl.where(y != y, 0x7FC0, r).to(tl.int16)  # noqa: F821
    return y.to(tl.float16).to(tl.int16, bitcast=True)  # noqa: F821


def _e4m3_encode(a):
    """RNE float32 -> E4M3 magnitude for ``a`` in ``[0, 448]`` or NaN, without an fp8 cast: ``(byte int32, value
    float32)``; NaN gives byte 0x7F and value NaN. Normal values keep 3 mantissa bits by an integer RNE on the float
    bits; values below 2^-6 are multiples of 2^-9, rounded by the add of 2^23 (``a * 512`` is exact)."""
    ab = a.to(tl.int32, bitcast=True)  # noqa: F821
    rb = (ab + (0x7FFFF + ((ab >> 20) & 1))) & -1048576            # -(1 << 20): clear the 20 dropped bits
    t = a * 512.0 + 8388608.0
    byte_s = t.to(tl.int32, bitcast=True) - 0x4B000000  # noqa: F821
    normal = a >= 0.015625                                         # 2^-6, the smallest normal E4M3
    byte = tl.where(normal, (rb >> 20) - 960, byte_s)  # noqa: F821
    val = tl.where(normal, rb.to(tl.float32, bitcast=True), byte_s.to(tl.float32) * 0.001953125)  # noqa: F821
    nan = a != a
    return tl.where(nan, 0x7F, byte), tl.where(nan, a, val)  # noqa: F821


def _e2m1_code(y):
    """4-bit E2M1 code (int32, bit 3 = sign) of float32 ``y``: RNE by comparisons, saturating at 6, sign of zero
    kept, NaN -> 0 (`jmixedkv.nvfp4.e2m1_codes`)."""
    a = tl.abs(y)  # noqa: F821
    mag = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)  # noqa: F821
           + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)  # noqa: F821
           + (a > 5.0).to(tl.int32))  # noqa: F821
    sign = (y.to(tl.int32, bitcast=True) >> 28) & 8  # noqa: F821
    return tl.where(y != y, 0, sign | mag)  # noqa: F821


def _e2m1_magnitude(code):
    """|value| (float32) of 4-bit E2M1 codes: 0, .5, 1, 1.5, 2, 3, 4, 6 (magnitude m >= 2 is ``(m + 252) << 22``)."""
    m = code & 7
    bits = tl.where(m >= 2, (m + 252) << 22, tl.where(m == 1, 0x3F000000, 0))  # noqa: F821
    return bits.to(tl.float32, bitcast=True)  # noqa: F821


def _nvfp4_candidate(x3, amax, enc, gs, inv_max):
    """One candidate of the pinned order with the block max mapped to ``1 / inv_max`` (`jmixedkv.nvfp4`):
    ``s = e4m3(clip(enc * (amax * inv_max), 0, 448))``, ``r = 0 if s == 0 else 1 / (f32(s) * gs)``,
    ``code = e2m1(x * r)``. ``x3 f32[R, NB, 16]``, ``amax f32[R, NB]`` -> ``(byte i32[R, NB], scale f32[R, NB],
    codes i32[R, NB, 16])``."""
    t = amax * inv_max
    s = enc * t
    s = tl.where(s > 448.0, 448.0, s)  # noqa: F821   (NaN passes both clamps)
    s = tl.where(s < 0.0, 0.0, s)  # noqa: F821
    byte, sf = _e4m3_encode(s)
    prod = sf * gs
    r = tl.where(sf == 0.0, 0.0, tl.math.div_rn(tl.full(prod.shape, 1.0, tl.float32), prod))  # noqa: F821
    return byte, sf, _e2m1_code(x3 * r[:, :, None])


def _block_sq_error(ax3, codes, sf, gs, R: tl.constexpr, NB: tl.constexpr):  # noqa: F821
    """Squared dequantization error per block in the order of `jmixedkv.nvfp4.block_sq_error`:
    ``d = |x| - (|e2m1(code)| * f32(s)) * gs``, ``d * d``, summed as a balanced tree over adjacent elements.
    ``ax3 f32[R, NB, 16]`` (|x|), ``codes i32[R, NB, 16]``, ``sf f32[R, NB]`` -> ``f32[R, NB]``."""
    p = _e2m1_magnitude(codes) * sf[:, :, None]
    d = ax3 - p * gs
    e = d * d
    e = tl.reshape(e, (R, NB, 8, 2))  # noqa: F821
    a, b = tl.split(e)  # noqa: F821
    e = tl.reshape(a + b, (R, NB, 4, 2))  # noqa: F821
    a, b = tl.split(e)  # noqa: F821
    e = tl.reshape(a + b, (R, NB, 2, 2))  # noqa: F821
    a, b = tl.split(e)  # noqa: F821
    a, b = tl.split(a + b)  # noqa: F821
    return a + b


def _block_max(ab3, R: tl.constexpr, NB: tl.constexpr):  # noqa: F821
    """int32 maximum over the last axis of ``ab3 i32[R, NB, 16]`` (the ``|x|`` bits: NaN bits sort above inf) by a
    tree of `tl.maximum` (``tl.max`` is a jitted library function, which the interpreter cannot call)."""
    a, b = tl.split(tl.reshape(ab3, (R, NB, 8, 2)))  # noqa: F821
    a, b = tl.split(tl.reshape(tl.maximum(a, b), (R, NB, 4, 2)))  # noqa: F821
    a, b = tl.split(tl.reshape(tl.maximum(a, b), (R, NB, 2, 2)))  # noqa: F821
    a, b = tl.split(tl.maximum(a, b))  # noqa: F821
    return tl.maximum(a, b)  # noqa: F821


def _fp8_row(x, sign, scale):
    """fp8 store form of float32 rows ``x`` (`jmixedkv.numerics.encode_rows`): the E4M3 byte (int32) of
    ``clip(x / scale, +-448)``, RNE, NaN kept (0x7F with the sign of ``x``). ``sign``: 0x80 where the 16-bit input
    word is negative, else 0 (taken from its bits: a GPU's fp16 -> f32 conversion drops a NaN's sign)."""
    y = tl.math.div_rn(x, tl.full(x.shape, 1.0, tl.float32) * scale)  # noqa: F821
    a = tl.abs(y)  # noqa: F821
    a = tl.where(a > 448.0, 448.0, a)  # noqa: F821   (NaN passes)
    byte, _ = _e4m3_encode(a)
    return byte | sign


def _page_row(slot_ptr, tok, r_ok, lyr, kv, head, num_pages, HEADS: tl.constexpr, PAGE: tl.constexpr):  # noqa: F821
    """``(row i64[R], ok bool[R])``: the pool row (in units of one ``[X]`` row of a ``[L, P, 2, H, page, X]`` pool) of
    each token's slot, ``((layer * P + page_id) * 2 + kv) * H + head) * page + row``; ``ok`` is False for -1 and for
    slots past the pool (their row is 0, never stored)."""
    slot = tl.load(slot_ptr + tok, mask=r_ok, other=-1).to(tl.int64)  # noqa: F821
    ok = r_ok & (slot >= 0) & (slot < num_pages.to(tl.int64) * PAGE)  # noqa: F821
    s32 = tl.where(ok, slot, 0).to(tl.int32)  # noqa: F821   (the host keeps P * page < 2^31)
    pg = (s32 // PAGE).to(tl.int64)  # noqa: F821
    return (((lyr * num_pages + pg) * 2 + kv) * HEADS + head) * PAGE + s32 % PAGE, ok


def _write_rows_kernel(k_ptr, v_ptr, k_st, k_sh, v_st, v_sh, low_slot_ptr, high_slot_ptr,
                       data_ptr, scales_ptr, gs_ptr, rows_ptr, rscale_ptr,
                       layer, num_rows, low_pages, row_pages,
                       HEADS: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,  # noqa: F821
                       BLOCK_R: tl.constexpr, HAS_LOW: tl.constexpr, ROW_POOL: tl.constexpr,  # noqa: F821
                       ROW_FP8: tl.constexpr, IS_BF16: tl.constexpr, FOUR_OVER_SIX: tl.constexpr):  # noqa: F821
    """One program: ``BLOCK_R`` rows (token, head) of K or V (``program_id(1)``) -> every pool of the cache."""
    NB: tl.constexpr = DP // 16  # noqa: F821
    kv = tl.program_id(1)  # noqa: F821
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # noqa: F821
    r_ok = r < num_rows
    r = tl.where(r_ok, r, 0)  # noqa: F821
    tok = r // HEADS
    head = r % HEADS
    col = tl.arange(0, DP)  # noqa: F821
    col_ok = col < D
    is_k = kv == 0
    src = tl.where(is_k, k_ptr, v_ptr)  # noqa: F821
    st = tl.where(is_k, k_st, v_st).to(tl.int64)  # noqa: F821
    sh = tl.where(is_k, k_sh, v_sh).to(tl.int64)  # noqa: F821
    ld_mask = r_ok[:, None] & col_ok[None, :]
    u = tl.load(src + (tok.to(tl.int64) * st + head * sh)[:, None] + col[None, :], mask=ld_mask,  # noqa: F821
                other=0)
    x = _f32_of_bits16(u, IS_BF16)                                                   # f32[R, DP]
    lyr = layer.to(tl.int64)  # noqa: F821
    l_row, l_ok = _page_row(low_slot_ptr, tok, r_ok, lyr, kv, head, low_pages, HEADS, PAGE)

    if HAS_LOW:
        gs = tl.load(gs_ptr + lyr * 2 + kv)  # noqa: F821
        byte, _, codes = _nvfp4_encode(x, gs, BLOCK_R, DP, FOUR_OVER_SIX)
        lo, hi = tl.split(tl.reshape(codes, (BLOCK_R, DP // 2, 2)))  # noqa: F821
        packed = (lo | (hi << 4)).to(tl.uint8)  # noqa: F821
        c2 = tl.arange(0, DP // 2)  # noqa: F821
        tl.store(data_ptr + (l_row * (D // 2))[:, None] + c2[None, :], packed,  # noqa: F821
                 mask=l_ok[:, None] & (c2 < D // 2)[None, :])
        c16 = tl.arange(0, NB)  # noqa: F821
        tl.store(scales_ptr + (l_row * (D // 16))[:, None] + c16[None, :], byte.to(tl.uint8),  # noqa: F821
                 mask=l_ok[:, None] & (c16 < D // 16)[None, :])

    if ROW_POOL != 0:
        if ROW_POOL == 1:
            w_row, w_ok = _page_row(high_slot_ptr, tok, r_ok, lyr, kv, head, row_pages, HEADS, PAGE)
        else:
            w_ok = l_ok
            w_row = l_row
        w_off = (w_row * D)[:, None] + col[None, :]
        w_mask = w_ok[:, None] & col_ok[None, :]
        if ROW_FP8:
            rscale = tl.load(rscale_ptr + lyr * 2 + kv)  # noqa: F821
            sign = (u.to(tl.int32) >> 8) & 0x80  # noqa: F821   (bit 15 of the input word)
            tl.store(rows_ptr + w_off, _fp8_row(x, sign, rscale).to(tl.uint8), mask=w_mask)  # noqa: F821
        else:
            tl.store(rows_ptr + w_off, u, mask=w_mask)  # noqa: F821


def _nvfp4_encode(x, gs, R: tl.constexpr, DP: tl.constexpr, FOUR_OVER_SIX: tl.constexpr):  # noqa: F821
    """NVFP4 of ``f32[R, DP]`` rows in the pinned order (`jmixedkv.nvfp4`; ``"4over6"`` keeps the max-to-4
    candidate of a block only when its squared error is strictly lower): ``(scale byte i32[R, NB], scale f32[R,
    NB], codes i32[R, NB, 16])``. The block maxima are int32 maxima over the ``|x|`` bits (NaN bits sort last)."""
    NB: tl.constexpr = DP // 16  # noqa: F821
    enc = tl.math.div_rn(1.0, gs)  # noqa: F821
    x3 = tl.reshape(x, (R, NB, 16))  # noqa: F821
    ab3 = tl.reshape(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, (R, NB, 16))  # noqa: F821
    amax = _block_max(ab3, R, NB).to(tl.float32, bitcast=True)  # noqa: F821
    byte, sf, codes = _nvfp4_candidate(x3, amax, enc, gs, 0.16666667163372040)
    if FOUR_OVER_SIX:
        byte4, sf4, codes4 = _nvfp4_candidate(x3, amax, enc, gs, 0.25)
        ax3 = ab3.to(tl.float32, bitcast=True)  # noqa: F821
        use4 = _block_sq_error(ax3, codes4, sf4, gs, R, NB) < _block_sq_error(ax3, codes, sf, gs, R, NB)
        byte = tl.where(use4, byte4, byte)  # noqa: F821
        sf = tl.where(use4, sf4, sf)  # noqa: F821
        codes = tl.where(use4[:, :, None], codes4, codes)  # noqa: F821
    return byte, sf, codes


def _nvfp4_value(codes, sf, gs):
    """float32 value ``(e2m1 * sf) * gs`` of E2M1 codes (bit 3 = sign, kept on zeros) with block scales ``sf``
    (float32, broadcast like ``codes``)."""
    val = (_e2m1_magnitude(codes) * sf) * gs
    return (val.to(tl.int32, bitcast=True) ^ ((codes & 8) << 28)).to(tl.float32, bitcast=True)  # noqa: F821


def _nvfp4_round_trip(x, gs, R: tl.constexpr, DP: tl.constexpr, FOUR_OVER_SIX: tl.constexpr):  # noqa: F821
    """``f32[R, DP]`` rows -> their NVFP4 value ``(e2m1 * f32(s)) * gs`` (float32), the block scales and codes
    chosen exactly as the store chooses them (`_nvfp4_encode`, as `_write_rows_kernel`)."""
    _, sf, codes = _nvfp4_encode(x, gs, R, DP, FOUR_OVER_SIX)
    return tl.reshape(_nvfp4_value(codes, sf[:, :, None], gs), (R, DP))  # noqa: F821


def _e4m3_value(byte):
    """float32 value of E4M3 bytes (int32, bit 7 = sign; 0x7F / 0xFF read NaN), exactly: the f16 bits
    ``sign << 15 | magnitude << 7`` are ``e4m3 * 2^-8``."""
    bits = ((byte & 0x7F) << 7) | ((byte & 0x80) << 8)
    e = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0  # noqa: F821
    return tl.where((byte & 0x7F) == 0x7F, float("nan"), e)  # noqa: F821


def _fp8_round_trip(x, u, scale):
    """``f32`` rows (``u``: their 16-bit words) -> ``f32(e4m3) * scale`` of their fp8 store form (`_fp8_row`); a
    NaN byte reads NaN."""
    return _e4m3_value(_fp8_row(x, (u.to(tl.int32) >> 8) & 0x80, scale)) * scale  # noqa: F821


def _round_trip_kernel(k_ptr, v_ptr, k_sb, k_st, k_sh, v_sb, v_st, v_sh, out_ptr, scale_ptr, layer, num_rows, T,
                       HEADS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK_R: tl.constexpr,  # noqa: F821
                       LOW: tl.constexpr, IS_BF16: tl.constexpr, FOUR_OVER_SIX: tl.constexpr):  # noqa: F821
    """One program: ``BLOCK_R`` rows (b, t, head) of K or V (``program_id(1)``) -> ``out[kv, b, t, head]``, the row
    as the cache reads it back once stored (NVFP4, or the fp8 store form), in the rows' dtype."""
    kv = tl.program_id(1)  # noqa: F821
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # noqa: F821
    r_ok = r < num_rows
    r = tl.where(r_ok, r, 0).to(tl.int64)  # noqa: F821
    head = r % HEADS
    bt = r // HEADS
    tok = bt % T
    b = bt // T
    col = tl.arange(0, DP)  # noqa: F821
    col_ok = col < D
    is_k = kv == 0
    src = tl.where(is_k, k_ptr, v_ptr)  # noqa: F821
    sb = tl.where(is_k, k_sb, v_sb).to(tl.int64)  # noqa: F821
    st = tl.where(is_k, k_st, v_st).to(tl.int64)  # noqa: F821
    sh = tl.where(is_k, k_sh, v_sh).to(tl.int64)  # noqa: F821
    mask = r_ok[:, None] & col_ok[None, :]
    u = tl.load(src + (b * sb + tok * st + head * sh)[:, None] + col[None, :], mask=mask, other=0)  # noqa: F821
    x = _f32_of_bits16(u, IS_BF16)
    scale = tl.load(scale_ptr + layer.to(tl.int64) * 2 + kv)  # noqa: F821
    if LOW:
        y = _nvfp4_round_trip(x, scale, BLOCK_R, DP, FOUR_OVER_SIX)
    else:
        y = _fp8_round_trip(x, u, scale)
    out = _bits16_of_f32(y, IS_BF16)
    off = (kv.to(tl.int64) * num_rows + r) * D  # noqa: F821
    tl.store(out_ptr + off[:, None] + col[None, :], out, mask=mask)  # noqa: F821


def _stored_row(rows_ptr, row, ok, scale, col, col_ok, D: tl.constexpr, FP8: tl.constexpr,  # noqa: F821
                IS_BF16: tl.constexpr):  # noqa: F821
    """16-bit words (int16 ``[N, DP]``) of row-pool rows ``row i64[N]`` as a reader gets them: a 16-bit row as
    stored, an fp8 row as ``f32(e4m3) * scale`` rounded once; zero where ``ok`` is False."""
    m = ok[:, None] & col_ok[None, :]
    x = tl.load(rows_ptr + (row * D)[:, None] + col[None, :], mask=m, other=0)  # noqa: F821
    if FP8:
        out = _bits16_of_f32(_e4m3_value(x.to(tl.int32) & 0xFF) * scale, IS_BF16)  # noqa: F821
    else:
        out = x
    return out


def _stage_kernel(data_ptr, scales_ptr, gs_ptr, rows_ptr, rscale_ptr, pt_ptr, s_pt, ht_ptr, s_ht, lens_ptr,
                  tk_ptr, tk_sb, tk_st, tk_sh, tv_ptr, tv_sb, tv_st, tv_sh, out_ptr,
                  layer, num_pages, num_row_pages, num_cols, ht_width, seen, T, B,
                  HEADS: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,  # noqa: F821
                  BLOCK_N: tl.constexpr, LOW: tl.constexpr, ROW_POOL: tl.constexpr,  # noqa: F821
                  ROW_FP8: tl.constexpr, FIRST_N: tl.constexpr, LAST_N: tl.constexpr,  # noqa: F821
                  NUM_FIXED: tl.constexpr, NUM_RING: tl.constexpr, IS_BF16: tl.constexpr):  # noqa: F821
    """One program: ``BLOCK_N`` output columns of one (batch row, head) (``program_id(0)``) of K or V
    (``program_id(2)``): column ``c`` holds position ``p = c - (seen - n - T)`` of the row (``n = kv_lens[b]``):
    the stored row as a reader gets it for ``0 <= p < n`` (the twin's where retained, counted from ``n + T``), the
    step's own row ``p - n`` for ``n <= p < n + T``, zero elsewhere (left padding)."""
    bh = tl.program_id(0)  # noqa: F821
    kv = tl.program_id(2)  # noqa: F821
    b = bh // HEADS
    h = bh % HEADS
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # noqa: F821
    col = tl.arange(0, DP)  # noqa: F821
    col_ok = col < D
    n = tl.load(lens_ptr + b)  # noqa: F821
    p = c - (seen - n - T)
    c_ok = c < seen
    hist = c_ok & (p >= 0) & (p < n)
    pp = tl.maximum(p, 0)  # noqa: F821
    page_col = tl.minimum(pp // PAGE, num_cols - 1)  # noqa: F821
    pid = tl.load(pt_ptr + b.to(tl.int64) * s_pt + page_col, mask=hist, other=-1)  # noqa: F821
    valid = hist & (pid >= 0)
    lyr = layer.to(tl.int64)  # noqa: F821
    kv64 = kv.to(tl.int64)  # noqa: F821
    pg = tl.maximum(pid, 0).to(tl.int64)  # noqa: F821
    row = (((lyr * num_pages + pg) * 2 + kv64) * HEADS + h) * PAGE + pp % PAGE
    if LOW:
        m = valid[:, None] & col_ok[None, :]
        byte = tl.load(data_ptr + (row * (D // 2))[:, None] + (col // 2)[None, :], mask=m, other=0)  # noqa: F821
        code = (byte.to(tl.int32) >> ((col % 2) * 4)[None, :]) & 0xF  # noqa: F821
        sb = tl.load(scales_ptr + (row * (D // 16))[:, None] + (col // 16)[None, :], mask=m, other=0)  # noqa: F821
        gs = tl.load(gs_ptr + lyr * 2 + kv64)  # noqa: F821
        out = _bits16_of_f32(_nvfp4_value(code, _e4m3_value(sb.to(tl.int32)), gs), IS_BF16)
        if ROW_POOL == 1:                               # the twin where retained (`TwinGeometry` rule)
            qp = pp // PAGE
            if NUM_RING > 0:
                tcol = tl.where(qp < NUM_FIXED, qp, NUM_FIXED + qp % NUM_RING)  # noqa: F821
            else:
                tcol = tl.where(qp < NUM_FIXED, qp, -1)  # noqa: F821
            has_col = (tcol >= 0) & (tcol < ht_width)
            hid = tl.load(ht_ptr + b.to(tl.int64) * s_ht + tl.minimum(tl.maximum(tcol, 0), ht_width - 1),  # noqa: F821
                          mask=valid & has_col, other=-1)
            keep = valid & (hid >= 0) & ((pp < FIRST_N) | (pp >= n + T - LAST_N))
            trow = (((lyr * num_row_pages + tl.maximum(hid, 0).to(tl.int64)) * 2 + kv64) * HEADS + h) * PAGE \
                + pp % PAGE  # noqa: F821
            rscale = tl.load(rscale_ptr + lyr * 2 + kv64)  # noqa: F821
            twin = _stored_row(rows_ptr, trow, keep, rscale, col, col_ok, D, ROW_FP8, IS_BF16)
            out = tl.where(keep[:, None], twin, out)  # noqa: F821
    else:
        rscale = tl.load(rscale_ptr + lyr * 2 + kv64)  # noqa: F821
        out = _stored_row(rows_ptr, row, valid, rscale, col, col_ok, D, ROW_FP8, IS_BF16)
    out = tl.where(valid[:, None], out, 0).to(tl.int16)  # noqa: F821
    tail = c_ok & (p >= n) & (p < n + T)
    j = tl.maximum(tl.minimum(p - n, T - 1), 0).to(tl.int64)  # noqa: F821
    is_k = kv == 0
    src = tl.where(is_k, tk_ptr, tv_ptr)  # noqa: F821
    st_b = tl.where(is_k, tk_sb, tv_sb).to(tl.int64)  # noqa: F821
    st_t = tl.where(is_k, tk_st, tv_st).to(tl.int64)  # noqa: F821
    st_h = tl.where(is_k, tk_sh, tv_sh).to(tl.int64)  # noqa: F821
    tx = tl.load(src + (b.to(tl.int64) * st_b + j * st_t + h * st_h)[:, None] + col[None, :],  # noqa: F821
                 mask=tail[:, None] & col_ok[None, :], other=0)
    out = tl.where(tail[:, None], tx, out)  # noqa: F821
    o_row = ((kv64 * B + b) * HEADS + h) * seen + c
    tl.store(out_ptr + (o_row * D)[:, None] + col[None, :], out, mask=c_ok[:, None] & col_ok[None, :])  # noqa: F821


_HELPERS = (_f32_of_bits16, _e4m3_encode, _e2m1_code, _e2m1_magnitude, _nvfp4_candidate, _block_sq_error,
            _block_max, _fp8_row, _page_row, _bits16_of_f32, _nvfp4_encode, _nvfp4_value, _nvfp4_round_trip,
            _e4m3_value, _fp8_round_trip, _stored_row)
_BUILT = {}


def _build(interpret: bool) -> dict:
    """The kernels for one mode by name (cached): the module's kernels and helpers cloned into a private globals
    dict, wrapped by ``InterpretedFunction`` (interpret) or ``triton.jit`` (compiled, ``layer`` / ``num_rows`` not
    specialized)."""
    if interpret in _BUILT:
        return _BUILT[interpret]
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    g = {"tl": tl, "triton": triton, "__name__": __name__, "__builtins__": __builtins__}

    def clone(fn):
        """``fn`` over the globals ``g``; annotations (the ``tl.constexpr`` marks triton.jit reads) and names kept."""
        out = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
        out.__annotations__, out.__qualname__, out.__doc__ = dict(fn.__annotations__), fn.__qualname__, fn.__doc__
        return out

    for fn in _HELPERS:
        g[fn.__name__] = InterpretedFunction(clone(fn)) if interpret else triton.jit(clone(fn))
    built = {}
    for fn, runtime in ((_write_rows_kernel, ["layer", "num_rows", "low_pages", "row_pages"]),
                        (_round_trip_kernel, ["layer", "num_rows", "T"]),
                        (_stage_kernel, ["layer", "num_pages", "num_row_pages", "num_cols", "ht_width", "seen", "T",
                                         "B"])):
        kernel = clone(fn)
        kernel.__module__ = __name__
        built[fn.__name__] = InterpretedFunction(kernel) if interpret else triton.jit(kernel,
                                                                                     do_not_specialize=runtime)
    _BUILT[interpret] = built
    return built


# --------------------------------------------------------------------------------------------- host side

def _check_pool(name, t, shape, dtypes, device):
    """`ValueError` naming ``name`` unless ``t`` is a contiguous tensor of ``shape`` (None = any size) and a dtype in
    ``dtypes`` on ``device``."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"write_rows_: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != len(shape) or any(s is not None and t.shape[i] != s for i, s in enumerate(shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"write_rows_: {name} has shape {tuple(t.shape)}, expected {want}")
    if t.dtype not in dtypes:
        raise ValueError(f"write_rows_: {name} has dtype {t.dtype}, expected one of {[str(d) for d in dtypes]}")
    if t.device != device:
        raise ValueError(f"write_rows_: {name} is on {t.device}, k is on {device}")
    if not t.is_contiguous():
        raise ValueError(f"write_rows_: {name} {tuple(t.shape)} must be contiguous (it is written in place)")


def _check_rows(k, v, op: str = "write_rows_", layout: str = "[T, H, D]"):
    """K and V rows of ``op``: ``layout`` (its last axis D), same shape, bf16 / fp16, ``D % 16 == 0``."""
    for name, x in (("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != layout.count(",") + 1:
            raise ValueError(f"{op}: {name} must be a {layout} tensor, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if x.dtype not in _ATTN_DTYPES:
            raise ValueError(f"{op}: {name} has dtype {x.dtype}, expected bfloat16 or float16")
    if k.shape != v.shape or k.dtype != v.dtype or k.device != v.device:
        raise ValueError(f"{op}: k {tuple(k.shape)} {k.dtype} {k.device} and v {tuple(v.shape)} {v.dtype} "
                         f"{v.device} must share shape, dtype and device")
    if k.shape[-1] % BLOCK or k.shape[-1] == 0:
        raise ValueError(f"{op}: head_dim {k.shape[-1]} must be a positive multiple of {BLOCK}")


def _check_slots(name, s, t, device):
    if not isinstance(s, torch.Tensor) or s.dim() != 1 or s.shape[0] != t:
        raise ValueError(f"write_rows_: {name} must be a 1-D tensor of {t} slots (one per token), got "
                         f"{tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__}")
    if s.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"write_rows_: {name} has dtype {s.dtype}, expected int64 (or int32)")
    if s.device != device:
        raise ValueError(f"write_rows_: {name} is on {s.device}, k is on {device}")


def _check_slot_values(name, s, num_pages, page):
    """Host read of the slots: each in ``[-1, num_pages * page)``, no slot twice."""
    a = s.detach().cpu().numpy().astype(np.int64)
    bad = (a < -1) | (a >= num_pages * page)
    if bad.any():
        raise ValueError(f"write_rows_: {name} {a[bad][:4].tolist()} out of range [-1, {num_pages * page}) "
                         f"({num_pages} pages x {page} rows)")
    held = a[a >= 0]
    uniq, counts = np.unique(held, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"write_rows_: {name} repeats slot(s) {uniq[counts > 1][:4].tolist()} (slots must be "
                         f"unique within one write)")


def _check_scale_values(name, scale, layer):
    a = scale[layer].detach().float().cpu().numpy()
    if not (np.isfinite(a) & (a > 0)).all():
        raise ValueError(f"write_rows_: {name}[{layer}] = {a.tolist()} must be finite and > 0")


def _plan(low_data, low_scales, low_gs, high_rows, high_scale, plain_rows, plain_scale, layer, k, v, low_slot,
          high_slot, page_size, block_scale, high_fp8):
    """Validate every argument (shapes, dtypes, devices, kinds of cache) -> ``(row_pool, row_fp8, rows, scale,
    low_pages, row_pages)``: ``row_pool`` one of ``_ROW_NONE / _ROW_HIGH / _ROW_PLAIN``, ``rows`` / ``scale`` that
    pool's tensors (None without one)."""
    _check_rows(k, v)
    t, h, d = k.shape
    dev = k.device
    if block_scale not in BLOCK_SCALES:
        raise ValueError(f"write_rows_: block_scale must be one of {BLOCK_SCALES}, got {block_scale!r}")
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
        raise ValueError(f"write_rows_: layer must be an int, got {layer!r}")
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size < 1:
        raise ValueError(f"write_rows_: page_size must be a positive int, got {page_size!r}")
    has_low = low_data is not None
    if has_low != (low_scales is not None) or has_low != (low_gs is not None):
        raise ValueError("write_rows_: low_data, low_scales and low_gs come together (all None or all tensors)")
    if (high_rows is None) != (high_scale is None) or (plain_rows is None) != (plain_scale is None):
        raise ValueError("write_rows_: a row pool comes with its scale (rows and scale both None or both tensors)")
    if plain_rows is not None and (has_low or high_rows is not None):
        raise ValueError("write_rows_: a plain cache has only plain_rows / plain_scale (low and high pools None)")
    if high_rows is not None and not has_low:
        raise ValueError("write_rows_: a twin (high_rows) needs the low NVFP4 pool")
    if not has_low and plain_rows is None:
        raise ValueError("write_rows_: no pool to write (give the low pool, the low + high pools or the plain pool)")
    pool0 = low_data if has_low else plain_rows
    if not isinstance(pool0, torch.Tensor) or pool0.dim() != 6:
        raise ValueError(f"write_rows_: {'low_data' if has_low else 'plain_rows'} must be a 6-D pool "
                         f"[L, P, 2, H, page, X], got {getattr(pool0, 'shape', type(pool0).__name__)}")
    num_layers, low_pages = pool0.shape[0], pool0.shape[1]
    if not 0 <= layer < num_layers:
        raise ValueError(f"write_rows_: layer {layer} out of range [0, {num_layers})")
    if pool0.shape[4] != page_size:
        raise ValueError(f"write_rows_: page_size {page_size} does not match the pool's page dimension "
                         f"{pool0.shape[4]} (pool shape {tuple(pool0.shape)})")
    lead = (num_layers, low_pages, 2, h, page_size)
    if has_low:
        _check_pool("low_data", low_data, lead + (d // 2,), (torch.uint8,), dev)
        _check_pool("low_scales", low_scales, lead + (d // BLOCK,), (torch.uint8, torch.float8_e4m3fn), dev)
        _check_pool("low_gs", low_gs, (num_layers, 2), (torch.float32,), dev)
    row_pool, rows, scale, row_pages = _ROW_NONE, None, None, 0
    if high_rows is not None:
        row_pool, rows, scale, name = _ROW_HIGH, high_rows, high_scale, "high_rows"
        row_pages = high_rows.shape[1] if isinstance(high_rows, torch.Tensor) and high_rows.dim() == 6 else -1
        _check_pool(name, high_rows, (num_layers, None, 2, h, page_size, d), _ROW_DTYPES, dev)
        _check_pool("high_scale", high_scale, (num_layers, 2), (torch.float32,), dev)
    elif plain_rows is not None:
        row_pool, rows, scale, row_pages = _ROW_PLAIN, plain_rows, plain_scale, low_pages
        _check_pool("plain_rows", plain_rows, lead + (d,), _ROW_DTYPES, dev)
        _check_pool("plain_scale", plain_scale, (num_layers, 2), (torch.float32,), dev)
    row_fp8 = rows is not None and rows.dtype in _FP8_DTYPES
    if rows is not None and bool(high_fp8) != row_fp8:
        raise ValueError(f"write_rows_: high_fp8={high_fp8!r} does not match the row pool's dtype {rows.dtype} "
                         f"(fp8 row pools are uint8 / float8_e4m3fn)")
    if rows is not None and not row_fp8 and rows.dtype != k.dtype:
        raise ValueError(f"write_rows_: the {'twin' if row_pool == _ROW_HIGH else 'plain'} pool has dtype "
                         f"{rows.dtype} but k / v are {k.dtype} (a 16-bit row pool stores rows in their own dtype)")
    for name, pages in (("the low / plain pool", low_pages), ("the twin", row_pages)):
        if pages * page_size >= 2 ** 31:
            raise ValueError(f"write_rows_: {name} holds {pages} pages x {page_size} rows = {pages * page_size} "
                             f"slots, at most 2**31 - 1 are addressable")
    _check_slots("low_slot", low_slot, t, dev)
    if row_pool == _ROW_HIGH:
        _check_slots("high_slot", high_slot, t, dev)
    return row_pool, row_fp8, rows, scale, low_pages, row_pages


def write_rows_(low_data: Optional[torch.Tensor], low_scales: Optional[torch.Tensor], low_gs: Optional[torch.Tensor],
                high_rows: Optional[torch.Tensor], high_scale: Optional[torch.Tensor],
                plain_rows: Optional[torch.Tensor], plain_scale: Optional[torch.Tensor],
                layer: int, k: torch.Tensor, v: torch.Tensor, low_slot: torch.Tensor,
                high_slot: Optional[torch.Tensor], page_size: int, block_scale: str = "max6",
                high_fp8: bool = False, *, interpret: Optional[bool] = None, check_values: bool = True,
                block_rows: Optional[int] = None, num_warps: int = 4) -> None:
    """Append rows ``k`` / ``v`` (``[T, H, D]`` bf16 / fp16, already RoPE'd and rotated) of ``layer`` into the pools,
    in place, with one Triton launch (the contract's op 1; bits of `jmixedkv.write.write_rows_reference`).

    Args:
      low_data, low_scales, low_gs: the NVFP4 pool (``u8[L, P, 2, H, page, D/2]``, ``u8 | float8_e4m3fn[L, P, 2, H,
        page, D/16]``, ``f32[L, 2]``), or all None (plain caches).
      high_rows, high_scale: the twin (``bf16 | fp16 | u8 | float8_e4m3fn[L, Ph, 2, H, page, D]``, ``f32[L, 2]``) of
        a mixed cache, or None.
      plain_rows, plain_scale: every row of a plain cache (``[L, P, 2, H, page, D]``, ``f32[L, 2]``), or None.
      layer: the layer written (a runtime scalar of the kernel).
      low_slot: ``i64[T]`` (or i32) slots ``page_id * page + row`` into the low / plain pool; -1 skips the row.
      high_slot: ``i64[T]`` slots into the twin; -1 skips; unused (may be None) without a twin.
      page_size: rows per page (must match the pools).
      block_scale: ``"max6"`` or ``"4over6"`` (`jmixedkv.nvfp4.quantize_reference`).
      high_fp8: the row pool (twin or plain) is fp8; must match its dtype (uint8 / float8_e4m3fn).
      interpret: run in Triton's interpreter (CPU tensors); default ``not k.is_cuda``.
      check_values: also check slot values and the layer's scales on the host (a device sync).
      block_rows: rows (token, head) per program (power of two; default by mode and head_dim).
      num_warps: warps per program (compiled mode).

    Slots never repeat within one call (the caller's dedupe; `check_values` refuses repeats).
    """
    launch = _launch(low_data, low_scales, low_gs, high_rows, high_scale, plain_rows, plain_scale, layer, k, v,
                     low_slot, high_slot, page_size, block_scale, high_fp8, interpret, check_values, block_rows)
    if launch is None:
        return
    interpret, kernel, grid, args, meta = launch
    if interpret:
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):   # masked-off lanes (1 / 0, inf * 0)
            kernel[grid](*args, **meta)
    else:
        with torch.cuda.device(k.device):
            kernel[grid](*args, **meta, num_warps=num_warps, enable_fp_fusion=False)


def _launch(low_data, low_scales, low_gs, high_rows, high_scale, plain_rows, plain_scale, layer, k, v, low_slot,
            high_slot, page_size, block_scale, high_fp8, interpret, check_values, block_rows):
    """Validate (`_plan`, and the values when ``check_values``) -> ``(interpret, kernel, grid, args, constexprs)``, or
    None when there is no token to write."""
    row_pool, row_fp8, rows, scale, low_pages, row_pages = _plan(
        low_data, low_scales, low_gs, high_rows, high_scale, plain_rows, plain_scale, layer, k, v, low_slot,
        high_slot, page_size, block_scale, high_fp8)
    layer, page_size = int(layer), int(page_size)
    has_low = low_data is not None
    if check_values:
        if k.is_cuda and torch.cuda.is_current_stream_capturing():
            raise ValueError("write_rows_: check_values=True reads the slots back to the host, which a CUDA graph "
                             "capture cannot do; pass check_values=False in a captured hot path")
        _check_slot_values("low_slot", low_slot, low_pages, page_size)
        if row_pool == _ROW_HIGH:
            _check_slot_values("high_slot", high_slot, row_pages, page_size)
        if has_low:
            _check_scale_values("low_gs", low_gs, layer)
        if row_fp8:
            _check_scale_values("high_scale" if row_pool == _ROW_HIGH else "plain_scale", scale, layer)
    t, h, d = k.shape
    if t == 0:
        return None
    interpret = (not k.is_cuda) if interpret is None else bool(interpret)
    if k.stride(2) != 1:
        k = k.contiguous()
    if v.stride(2) != 1:
        v = v.contiguous()
    if block_rows is None:
        # compiled: 1024 elements per program (8 rows at D = 128), 8 per thread at 4 warps: no register spills on
        # sm_90 for either block scale (ptxas -v: 133 / 163 registers; 16 rows spill); interpreter: large tiles
        block_rows = min(256 if interpret else max(1, 1024 // next_pow2(d)), next_pow2(t * h))
    elif isinstance(block_rows, bool) or not isinstance(block_rows, int) or block_rows < 1 or \
            block_rows & (block_rows - 1):
        raise ValueError(f"write_rows_: block_rows must be a power of two, got {block_rows!r}")
    dummy = low_slot
    grid = (-(-(t * h) // block_rows), 2)
    args = (k.view(torch.int16), v.view(torch.int16), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            low_slot, high_slot if row_pool == _ROW_HIGH else low_slot,
            low_data if has_low else dummy, low_scales.view(torch.uint8) if has_low else dummy,
            low_gs if has_low else dummy,
            dummy if rows is None else rows.view(torch.uint8 if row_fp8 else torch.int16),
            dummy if scale is None else scale,
            layer, t * h, low_pages, max(row_pages, 1))
    meta = _constexprs(h, page_size, d, block_rows, has_low, row_pool, row_fp8, k.dtype, block_scale)
    return interpret, _build(interpret)["_write_rows_kernel"], grid, args, meta


def _constexprs(heads, page, d, block_rows, has_low, row_pool, row_fp8, attn_dtype, block_scale):
    """The kernel's compile-time arguments (one compiled kernel per distinct set)."""
    return dict(HEADS=heads, PAGE=page, D=d, DP=next_pow2(d), BLOCK_R=block_rows, HAS_LOW=has_low, ROW_POOL=row_pool,
                ROW_FP8=row_fp8, IS_BF16=attn_dtype == torch.bfloat16, FOUR_OVER_SIX=block_scale == "4over6")


def lower_for_cuda(low_data, low_scales, low_gs, high_rows, high_scale, plain_rows, plain_scale, layer, k, v,
                   low_slot, high_slot, page_size, block_scale="max6", high_fp8=False, *,
                   block_rows: Optional[int] = None, num_warps: int = 4, capability: int = 90) -> dict:
    """Compile the kernel exactly as `write_rows_` would launch it on a CUDA device of compute ``capability`` (same
    validation, arguments, specialization binder and options, ``enable_fp_fusion=False``), without a GPU: the
    arguments may be CPU tensors (Triton ships ``ptxas``). Returns the compiled kernel's ``asm`` dict (``"ttir"``,
    ``"ttgir"``, ``"llir"``, ``"ptx"``, ``"cubin"``). Nothing is launched or written."""
    launch = _launch(low_data, low_scales, low_gs, high_rows, high_scale, plain_rows, plain_scale, layer, k, v,
                     low_slot, high_slot, page_size, block_scale, high_fp8, False, False, block_rows)
    if launch is None:
        raise ValueError("lower_for_cuda: no token to write (T = 0), nothing to compile")
    _, kernel, _, args, meta = launch
    return _compile_for_cuda(kernel, args, meta, num_warps, capability)


def _compile_for_cuda(kernel, args, meta, num_warps: int, capability: int) -> dict:
    """``kernel`` compiled for ``args`` / ``meta`` as its launch would compile it on an sm_``capability`` device."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(meta, num_warps=num_warps, enable_fp_fusion=False, debug=False)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                          options=options.__dict__).asm


# --------------------------------------------------------------------------------------------- round trip
def round_trip_rows(k: torch.Tensor, v: torch.Tensor, scale: torch.Tensor, layer: int, *, low: bool,
                    block_scale: str = "max6", interpret: Optional[bool] = None, validate: bool = True,
                    block_rows: Optional[int] = None, num_warps: int = 4) -> torch.Tensor:
    """Rows as the cache reads them back once stored, without storing them: one Triton launch.

    Args:
      k, v: ``[B, T, H, D]`` bf16 / fp16 (any strides but a contiguous last dim; ``D % 16 == 0``), as `write_rows_`
        would take them (RoPE'd, rotated).
      scale: ``f32[L, 2]``: ``low_gs`` for ``low=True``, the fp8 row pool's scale (``high_scale`` / ``plain_scale``)
        for ``low=False``; entry ``[layer, kv]`` is used.
      layer: the layer whose scale applies.
      low: NVFP4 (``(e2m1 * f32(s)) * gs``, the block scales chosen by ``block_scale`` exactly as `write_rows_`
        chooses them) if True; the fp8 store form (``f32(e4m3(clip(x / scale, +-448))) * scale``) if False.
      interpret: run in Triton's interpreter (CPU tensors); default ``not k.is_cuda``.
      validate: check the arguments (False: a caller that checked the same shapes, dtypes and ``layer`` already,
        e.g. once per step for every layer).

    Returns:
      ``[2, B, T, H, D]`` in k's dtype, contiguous: ``[0]`` the K rows, ``[1]`` the V rows, each the float32 read
      value rounded once to that dtype (`interop.torch_nvfp4.dequantize` / ``decode_rows`` of the stored bytes,
      bit for bit). A NaN block reads NaN.
    """
    interpret, kernel, grid, args, meta, out = _round_trip_launch(k, v, scale, layer, low, block_scale, interpret,
                                                                  block_rows, validate)
    if grid[0]:
        _run_kernel(kernel, grid, args, meta, 10, k.device, interpret, num_warps, fp_fusion=False)
    return out


def _run_kernel(kernel, grid, args, meta, num_specialized: int, device, interpret: bool, num_warps: int,
                fp_fusion: bool) -> None:
    """``kernel[grid](*args, **meta)``. Compiled, once a specialization has launched (the key: device, grid, warps,
    constexprs, and how Triton specializes the first ``num_specialized`` arguments -- 16-byte alignment of tensors,
    unit / 16-multiple ints; the rest are ``do_not_specialize``), later launches go straight to the compiled
    kernel's launcher (`interop.triton_launch.Launch`), skipping the argument binding of ``JITFunction.run``
    (tens of microseconds of host time per call, paid per layer by the held-aside steps)."""
    if interpret:
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):   # masked-off lanes (1 / 0, inf * 0)
            kernel[grid](*args, **meta)
        return
    key = (kernel, device.index, grid, num_warps, tuple(meta.values()),
           *(x.data_ptr() % 16 == 0 if isinstance(x, torch.Tensor) else _int_spec(x)
             for x in args[:num_specialized]))
    launch = _RUNNERS.get(key)
    if launch is not None:
        launch(args)
        return
    with torch.cuda.device(device):
        compiled = kernel[grid](*args, **meta, num_warps=num_warps, enable_fp_fusion=fp_fusion)
    if hasattr(compiled, "run"):
        if len(_RUNNERS) > 256:
            _RUNNERS.clear()
        _RUNNERS[key] = Launch(compiled, grid, tuple(meta[name] for name in kernel.arg_names[len(args):]),
                               device.index)


#: compiled launches by specialization (`_run_kernel`)
_RUNNERS: dict = {}


def _int_spec(v: int) -> int:
    """How Triton specializes an int argument: 1, a multiple of 16, or neither (and 64-bit beyond int32)."""
    return 1 if v == 1 else 16 if v % 16 == 0 else (2 if -2 ** 31 <= v < 2 ** 31 else 3)


def lower_round_trip_for_cuda(k, v, scale, layer, *, low: bool, block_scale: str = "max6",
                              block_rows: Optional[int] = None, num_warps: int = 4, capability: int = 90) -> dict:
    """`round_trip_rows`'s kernel compiled as it would launch on an sm_``capability`` device (CPU tensors allowed;
    nothing launched): the ``asm`` dict, as `lower_for_cuda`."""
    _, kernel, _, args, meta, _ = _round_trip_launch(k, v, scale, layer, low, block_scale, False, block_rows, True)
    return _compile_for_cuda(kernel, args, meta, num_warps, capability)


def _round_trip_launch(k, v, scale, layer, low, block_scale, interpret, block_rows, validate):
    """Validate (``validate``) -> ``(interpret, kernel, grid, args, constexprs, out)``."""
    if validate:
        _check_round_trip(k, v, scale, layer, block_scale, block_rows)
    b, t, h, d = k.shape
    interpret = (not k.is_cuda) if interpret is None else bool(interpret)
    if k.stride(3) != 1:
        k = k.contiguous()
    if v.stride(3) != 1:
        v = v.contiguous()
    rows = b * t * h
    if block_rows is None:
        block_rows = min(256 if interpret else max(1, 1024 // next_pow2(d)), next_pow2(max(rows, 1)))
    out = torch.empty((2, b, t, h, d), dtype=k.dtype, device=k.device)
    grid = (-(-rows // block_rows), 2)
    args = (k.view(torch.int16), v.view(torch.int16), k.stride(0), k.stride(1), k.stride(2), v.stride(0),
            v.stride(1), v.stride(2), out.view(torch.int16), scale, int(layer), rows, max(t, 1))
    meta = dict(HEADS=h, D=d, DP=next_pow2(d), BLOCK_R=block_rows, LOW=bool(low),
                IS_BF16=k.dtype == torch.bfloat16, FOUR_OVER_SIX=block_scale == "4over6")
    return interpret, _build(interpret)["_round_trip_kernel"], grid, args, meta, out


def _check_round_trip(k, v, scale, layer, block_scale, block_rows) -> None:
    """`ValueError` naming the bad argument of `round_trip_rows`."""
    _check_rows(k, v, "round_trip_rows", "[B, T, H, D]")
    if block_scale not in BLOCK_SCALES:
        raise ValueError(f"round_trip_rows: block_scale must be one of {BLOCK_SCALES}, got {block_scale!r}")
    if not isinstance(scale, torch.Tensor) or scale.dim() != 2 or scale.shape[1] != 2 or \
            scale.dtype != torch.float32 or scale.device != k.device:
        raise ValueError(f"round_trip_rows: scale must be a float32 [L, 2] tensor on {k.device}, got "
                         f"{getattr(scale, 'dtype', type(scale).__name__)} {tuple(getattr(scale, 'shape', ()))} "
                         f"on {getattr(scale, 'device', None)}")
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < scale.shape[0]:
        raise ValueError(f"round_trip_rows: layer {layer!r} out of range [0, {scale.shape[0]})")
    if not scale.is_contiguous():
        raise ValueError(f"round_trip_rows: scale must be contiguous, got strides {scale.stride()}")
    if block_rows is not None and (isinstance(block_rows, bool) or not isinstance(block_rows, int) or
                                   block_rows < 1 or block_rows & (block_rows - 1)):
        raise ValueError(f"round_trip_rows: block_rows must be a power of two, got {block_rows!r}")


# --------------------------------------------------------------------------------------------- staging
def stage_rows(low_data: Optional[torch.Tensor], low_scales: Optional[torch.Tensor], low_gs: Optional[torch.Tensor],
               high_rows: Optional[torch.Tensor], high_scale: Optional[torch.Tensor],
               plain_rows: Optional[torch.Tensor], plain_scale: Optional[torch.Tensor], layer: int,
               page_table: torch.Tensor, high_table: Optional[torch.Tensor], kv_lens: torch.Tensor, geom,
               seen: int, tail_k: torch.Tensor, tail_v: torch.Tensor, *, interpret: Optional[bool] = None,
               validate: bool = True, check_values: bool = True, block_n: Optional[int] = None,
               num_warps: int = 4) -> torch.Tensor:
    """One layer's K / V as a reader gets them, dense and left-aligned as transformers' mask wants them, the step's
    own rows appended, without storing them: one Triton launch (`interop.torch_paged.stage_reference` is the
    torch reference).

    Args:
      low_data ... plain_scale: the pools (`interop.torch_paged.TorchPools`), as `write_rows_` takes them.
      layer: the layer read.
      page_table: ``i32[B, MP]`` page ids (-1 = none) of the batch rows; ``high_table``: ``i32[B, W]`` twin pages
        (a mixed cache; else None).
      kv_lens: ``i32[B]`` rows stored per batch row (``n``).
      geom: the twin's `jmixedkv.layout.TwinGeometry` or ``(page, first_n, last_n, num_fixed, num_ring)`` (zeros
        but the page without a twin).
      seen: the output's length (>= ``n + T`` for every row).
      tail_k, tail_v: the step's own rows ``[B, T, H, D]`` (the attention dtype, as they read once stored:
        `round_trip_rows`).
      validate: check the arguments' shapes, dtypes and devices (False: a caller that checked the same pools,
        tables and tail shapes already, e.g. once per step for every layer).
      check_values: also check on the host that every row's ``n + T`` fits ``seen`` and its pages (reads
        ``kv_lens`` back: a device sync; pass False where the caller knows the lengths).

    Returns:
      ``[2, B, H, seen, D]`` in the tail's dtype: row ``b``'s stored position ``p < n`` at column ``seen - n - T +
      p`` (the twin's row bit for bit where retained, the windows counted from ``n + T``, as after appending the
      tail; NVFP4 ``(e2m1 * s) * gs`` elsewhere; an fp8 row ``f32(e4m3) * scale``; each rounded once), its tail
      row ``j`` at ``seen - T + j``, zeros before (left padding) -- `jmixedkv.step.dense_rows` after the append,
      aligned.
    """
    interpret, kernel, grid, args, meta, out = _stage_launch(
        low_data, low_scales, low_gs, high_rows, high_scale, plain_rows, plain_scale, layer, page_table, high_table,
        kv_lens, geom, seen, tail_k, tail_v, interpret, block_n, validate)
    if check_values:
        n = kv_lens.detach().cpu().numpy().astype(np.int64)
        t, cap = tail_k.shape[1], page_table.shape[1] * meta["PAGE"]
        bad = (n < 0) | (n > cap) | (n + t > seen)
        if bad.any():
            r = int(np.flatnonzero(bad)[0])
            raise ValueError(f"stage_rows: row {r} holds kv_lens={int(n[r])} rows + {t} new; expected 0 <= kv_lens "
                             f"<= {cap} (its pages) and kv_lens + {t} <= seen={seen}")
    if grid[0] and grid[1]:
        _run_kernel(kernel, grid, args, meta, 19, tail_k.device, interpret, num_warps, fp_fusion=True)
    return out


def lower_stage_for_cuda(*args, block_n: Optional[int] = None, num_warps: int = 4, capability: int = 90,
                         **kwargs) -> dict:
    """`stage_rows`'s kernel compiled as it would launch on an sm_``capability`` device (same arguments; CPU
    tensors allowed; nothing launched): the ``asm`` dict, as `lower_for_cuda`."""
    names = ("low_data", "low_scales", "low_gs", "high_rows", "high_scale", "plain_rows", "plain_scale", "layer",
             "page_table", "high_table", "kv_lens", "geom", "seen", "tail_k", "tail_v")
    bound = dict(zip(names, args), **kwargs)
    _, kernel, _, launch_args, meta, _ = _stage_launch(*(bound[n] for n in names), False, block_n, True)
    return _compile_for_cuda(kernel, launch_args, meta, num_warps, capability)


def _stage_launch(low_data, low_scales, low_gs, high_rows, high_scale, plain_rows, plain_scale, layer, page_table,
                  high_table, kv_lens, geom, seen, tail_k, tail_v, interpret, block_n, validate):
    """Validate (``validate``) -> ``(interpret, kernel, grid, args, constexprs, out)``."""
    geom = geometry(geom)
    if validate:
        roles = _check_stage(low_data, low_scales, low_gs, high_rows, high_scale, plain_rows, plain_scale, layer,
                             page_table, high_table, kv_lens, geom, seen, tail_k, tail_v)
    else:
        roles = _row_pool_roles(low_data, high_rows, high_scale, plain_rows, plain_scale)
    row_pool, row_fp8, rows, scale, low_pages, row_pages = roles
    b, t, h, d = tail_k.shape
    dev, page = tail_k.device, geom.page
    interpret = (not dev.type == "cuda") if interpret is None else bool(interpret)
    if block_n is None:
        block_n = min(64 if interpret else 32, next_pow2(max(int(seen), 1)))
    out = torch.empty((2, b, h, int(seen), d), dtype=tail_k.dtype, device=dev)
    grid = (b * h, -(-int(seen) // block_n), 2)
    dummy = kv_lens
    twin = row_pool == _ROW_HIGH
    tables = (page_table, page_table.stride(0), high_table if twin else page_table,
              high_table.stride(0) if twin else 0)
    tails = [(x.view(torch.int16), x.stride(0), x.stride(1), x.stride(2)) for x in (tail_k, tail_v)]
    has_low = low_data is not None
    args = (low_data if has_low else dummy, low_scales.view(torch.uint8) if has_low else dummy,
            low_gs if has_low else dummy,
            dummy if rows is None else rows.view(torch.uint8 if row_fp8 else torch.int16),
            dummy if scale is None else scale, *tables, kv_lens, *tails[0], *tails[1], out.view(torch.int16),
            int(layer), low_pages, max(row_pages, 1), page_table.shape[1], high_table.shape[1] if twin else 1,
            int(seen), t, b)
    meta = dict(HEADS=h, PAGE=page, D=d, DP=next_pow2(d), BLOCK_N=block_n, LOW=has_low, ROW_POOL=row_pool,
                ROW_FP8=row_fp8, FIRST_N=geom.first_n, LAST_N=geom.last_n, NUM_FIXED=geom.num_fixed,
                NUM_RING=geom.num_ring, IS_BF16=tail_k.dtype == torch.bfloat16)
    return interpret, _build(interpret)["_stage_kernel"], grid, args, meta, out


def _row_pool_roles(low_data, high_rows, high_scale, plain_rows, plain_scale):
    """`_plan`'s ``(row_pool, row_fp8, rows, scale, low_pages, row_pages)`` of pools already checked."""
    if high_rows is not None:
        row_pool, rows, scale, row_pages = _ROW_HIGH, high_rows, high_scale, high_rows.shape[1]
    elif plain_rows is not None:
        row_pool, rows, scale, row_pages = _ROW_PLAIN, plain_rows, plain_scale, plain_rows.shape[1]
    else:
        row_pool, rows, scale, row_pages = _ROW_NONE, None, None, 0
    low_pages = (low_data if low_data is not None else plain_rows).shape[1]
    return row_pool, rows is not None and rows.dtype in _FP8_DTYPES, rows, scale, low_pages, row_pages


def _check_stage(low_data, low_scales, low_gs, high_rows, high_scale, plain_rows, plain_scale, layer, page_table,
                 high_table, kv_lens, geom, seen, tail_k, tail_v):
    """`ValueError` naming the bad argument of `stage_rows`; else `_plan`'s roles of the pools."""
    if not isinstance(tail_k, torch.Tensor) or tail_k.dim() != 4 or not isinstance(tail_v, torch.Tensor) or \
            tail_v.shape != tail_k.shape or tail_k.dtype not in _ATTN_DTYPES or tail_v.dtype != tail_k.dtype:
        raise ValueError(f"stage_rows: tail_k / tail_v must be bf16 / fp16 [B, T, H, D] tensors of one shape, got "
                         f"{getattr(tail_k, 'shape', tail_k)} / {getattr(tail_v, 'shape', tail_v)}")
    b, t, h, d = tail_k.shape
    dev = tail_k.device
    roles = _plan(
        low_data, low_scales, low_gs, high_rows, high_scale, plain_rows, plain_scale, layer,
        tail_k[:, 0] if t else tail_k.new_empty((b, h, d)), tail_v[:, 0] if t else tail_v.new_empty((b, h, d)),
        torch.zeros(b, dtype=torch.int64, device=dev), torch.zeros(b, dtype=torch.int64, device=dev), geom.page,
        "max6", None if high_rows is None and plain_rows is None else _row_is_fp8(high_rows, plain_rows))
    for name, table in (("page_table", page_table), ("high_table", high_table)):
        if table is None and name == "high_table" and roles[0] != _ROW_HIGH:
            continue
        if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.shape[0] != b or \
                table.dtype != torch.int32 or table.device != dev or table.stride(1) != 1:
            raise ValueError(f"stage_rows: {name} must be an int32 [B={b}, *] tensor on {dev} with unit column "
                             f"stride, got {getattr(table, 'dtype', table)} {tuple(getattr(table, 'shape', ()))}")
    if not isinstance(kv_lens, torch.Tensor) or kv_lens.shape != (b,) or kv_lens.dtype != torch.int32 or \
            kv_lens.device != dev:
        raise ValueError(f"stage_rows: kv_lens must be an int32 [{b}] tensor on {dev}")
    if isinstance(seen, bool) or not isinstance(seen, (int, np.integer)) or seen < t:
        raise ValueError(f"stage_rows: seen must be an int >= the step's {t} tokens, got {seen!r}")
    return roles


def _row_is_fp8(high_rows, plain_rows) -> bool:
    rows = high_rows if high_rows is not None else plain_rows
    return isinstance(rows, torch.Tensor) and rows.dtype in _FP8_DTYPES
