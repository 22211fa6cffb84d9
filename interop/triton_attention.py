"""Paged attention of one layer over the cache's torch pools as raw Triton kernels: the attention op of the torch hot
path (decode, speculative verify, a later prefill chunk), capturable by torch.compile / CUDA graphs.

`paged_attention(q, low_data, low_scales, low_gs, high_rows, high_scale, plain_rows, plain_scale, layer, page_table,
high_table, kv_lens, geom, sm_scale, sliding_window, soft_cap)` -> ``(out f32[B, Tq, Hq, D], lse f32[B, Tq, Hq])``,
the semantics of `jmixedkv.decode._reference` over float32 staging of the stored rows (``as_stored=True``; the
caller rotates q): a key row ``p < n = kv_lens[b]`` is the twin row (decoded in float32) where the cache is mixed,
`TwinGeometry.is_retained(p, n)` and the twin page is held, else the NVFP4 row dequantized exactly,
``(e2m1 * f32(scale)) * gs``; plain caches read their row pool. Query ``t`` sits at position ``n - Tq + t`` (causal
inside the step; optional sliding window ``pos - w < p <= pos``, soft-cap ``c * tanh(x / c)``); GQA: query head
``hq`` reads KV head ``hq // (Hq // H)``. A query that sees no key gives ``out = 0, lse = -inf``; a NaN key or value
it sees propagates (NaN output and LSE).

Pools (`jmixedkv.layout`, torch tensors, ``L`` layers, ``P`` low pages, ``Ph`` twin pages)::

    low_data    u8[L, P, 2, H, page, D/2]        packed E2M1, element 2i in the low nibble
    low_scales  u8 | float8_e4m3fn[L, P, 2, H, page, D/16]   E4M3 block scales
    low_gs      f32[L, 2]                        decode global scale per layer, K / V
    high_rows   bf16 | fp16 | u8 | float8_e4m3fn[L, Ph, 2, H, page, D]   the twin (u8: the E4M3 bytes)
    high_scale  f32[L, 2]                        FP8 scale (read only for an FP8 twin)
    plain_rows, plain_scale                      the same as high_* with low page ids, for plain caches

A cache is mixed (low + high), NVFP4 only (low) or plain (plain); absent pools are None. Pools must be contiguous.

Algorithm (the port of `pallas_kernels.decode.triton`): split-K flash decoding. Grid ``(B * H, splits, tiles)``:
a program owns query rows ``r = t * G + g`` (``G = Hq / H``) of one KV head -- ``BLOCK_M`` of them (a power of two
>= 16, the smallest ``tl.dot``; ``Tq * G`` rows in ``tiles`` tiles) -- so each K / V block is loaded and dequantized
once for the whole GQA group, and walks its split's share of the keys the tile can see in blocks of ``BLOCK_N`` keys
(page ids looked up per key, so any page size works) with a float32 online softmax. Splits divide the *actual*
length ``kv_lens[b]`` (read on the device: no host sync, so a CUDA graph replays any lengths). Blocks are cut in
three loops: head and tail *edge* blocks (the first_n / last_n windows, the causal and sliding-window masks, keys at
or past ``n``) run with masked loads (unused rows, NaN-poisoned or not, are never read), the twin overlay and the
masks; *interior* blocks run straight-line code with no mask and no twin load (software-pipelined by Triton). With
one split the kernel normalizes and writes ``(out, lse)`` itself; otherwise its partials ``(o, m, l)`` go through a
second small kernel, the LSE merge.

Numerics. Columns are handled as even / odd halves (the low / high nibbles of a packed byte; twin and plain rows are
split in registers), so NVFP4 never needs a nibble interleave. NVFP4 rows enter the dot in the *low domain*,
``x / (gs * 2^7)`` in f16: ``(e2m1 * 2^-14) * (s * 2^7)``, both factors built with integer ops and their product
exact in f16; the query rows are scaled into f16 by a power of two each (``[2^7, 2^8)`` for the row's largest
element, exact), and ``sm_scale * gs_k * 2^7 * 2^-shift`` multiplies the f32 logits. P @ V runs with P in f16 in
the low domain (``gs_v * 2^7`` applied to the output); FP8 rows enter as their exact e4m3 values times ``2^-8`` in
f16 (the scale goes to the f32 side); 16-bit twin / plain rows meet q in their own dtype, and a bf16 P is split in
two bf16 halves (``hi + lo``) so the P @ V error stays at f32 accumulation level. Against the float32 reference the
output differs by the f16 rounding of P on NVFP4 / FP8 rows (~2^-12 relative per probability) and by accumulation
order; the LSE by f32 accumulation order.

Interpret mode (``interpret=True``, the default off CUDA) runs the same kernels in Triton's CPU interpreter
(`triton.runtime.interpreter.InterpretedFunction`; its bf16 dot is emulated by widening the exact bf16 operands to
f32). `triton` is imported only when a kernel is built. `bench_paged_attention` times the op at a given shape.
"""
from __future__ import annotations

import functools
import math
import numbers
import time
import types
from typing import NamedTuple, Optional

import torch

from jmixedkv.numerics import next_pow2

from .triton_launch import Launch
from .triton_write import _int_spec

#: head dims the kernel takes (tl.dot tiles of the packed NVFP4 halves need D / 2 >= 16, a power of two)
HEAD_DIMS = (32, 64, 128, 256)

__all__ = ["HEAD_DIMS", "paged_attention", "PagedAttention", "Tuning", "choose_tuning", "num_sms",
           "bench_paged_attention",
           "M_INIT", "DEFAULT_NUM_SMS"]

#: finite running-max start: rows that see no key keep ``l == 0`` and never produce NaN
M_INIT = -1e30
#: SMs assumed where torch does not say (CPU): an H200's
DEFAULT_NUM_SMS = 132
#: the split-K grid aims at about this many programs per SM (the Pallas Triton kernel's default)
PROGRAMS_PER_SM = 4
#: most splits per (row, KV head, tile)
MAX_SPLITS = 64


# ================================================================================================ kernel source
# Plain functions, wrapped per mode by `_kernels` (``triton.jit`` compiled, ``InterpretedFunction`` interpreted) in a
# namespace of their own, so the helpers are the same mode as the kernel that calls them. ``tl`` is that
# namespace's `triton.language`. Only builtins of `triton.language` are used (``tl.full``, ``tl.reduce`` with the
# standard combine functions), never its ``@jit`` library functions (``tl.max``, ``tl.sum``, ``tl.zeros``): those are
# compiled-mode objects that the interpreter cannot call unless TRITON_INTERPRET was set before triton's import.

def _dot(a, b, EMULATE: tl.constexpr):
    """``a @ b`` with float32 accumulation; ``EMULATE`` (interpreter: its bf16 dot is not numeric) widens the
    operands to f32 first (exact: they are 16-bit values)."""
    if EMULATE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


def _qk(q_e, q_o, k_e, k_o, EMULATE: tl.constexpr):
    """Scores ``[M, N] = q_e k_e^T + q_o k_o^T`` (even / odd column halves), f32."""
    return _dot(q_e, tl.trans(k_e), EMULATE) + _dot(q_o, tl.trans(k_o), EMULATE)


def _bf16_rne(x):
    """f32 ``x`` rounded to bf16 (nearest even) with integer ops, kept in f32 (the interpreter's f32 -> bf16 casts
    and stores truncate)."""
    u = x.to(tl.uint32, bitcast=True)
    return ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)


def _cast(x, like, EMULATE: tl.constexpr):
    """f32 ``x`` -> ``like``'s dtype, round to nearest even. ``EMULATE`` (interpreter) keeps the (exact) bf16
    values in f32 (`_bf16_rne`)."""
    if EMULATE:
        if like.dtype == tl.bfloat16:
            return _bf16_rne(x)
    return x.to(like.dtype)


def _stored(x, ptr, EMULATE: tl.constexpr):
    """f32 ``x`` as a store to ``ptr`` keeps it: the store rounds to the pointer's element type (RTNE on the GPU).
    ``EMULATE`` (the interpreter) rounds to bf16 first (`_bf16_rne`, NaN kept)."""
    if EMULATE:
        if ptr.dtype.element_ty == tl.bfloat16:
            return tl.where(x != x, x, _bf16_rne(x))
    return x


def _pv(p, v_e, v_o, SPLIT: tl.constexpr, EMULATE: tl.constexpr):
    """``(p @ v_e, p @ v_o)`` f32 with ``p`` f32 ``[M, N]`` rounded to V's dtype; ``SPLIT``: ``p`` as two halves
    ``hi + lo`` of that dtype (the product then carries f32-level error)."""
    hi = _cast(p, v_e, EMULATE)
    a_e = _dot(hi, v_e, EMULATE)
    a_o = _dot(hi, v_o, EMULATE)
    if SPLIT:
        lo = _cast(p - hi.to(tl.float32), v_e, EMULATE)
        a_e += _dot(lo, v_e, EMULATE)
        a_o += _dot(lo, v_o, EMULATE)
    return a_e, a_o


def _nvfp4_tile(data_ptr, scales_ptr, row, mask, D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """NVFP4 rows ``row i64[N]`` (``N = BLOCK_N``) -> ``(even, odd)`` columns f16 ``[N, D/2]`` in the low domain
    ``x / (gs * 2^7)`` = ``(e2m1 * 2^-14) * (s * 2^7)`` (exact). ``MASKED``: rows where ``mask`` is False read as
    zero (not loaded). A NaN scale byte (0x7F / 0xFF) gives NaN elements."""
    off = row[:, None] * (D // 2) + tl.arange(0, D // 2)[None, :]
    soff = row[:, None] * (D // 16) + tl.arange(0, D // 16)[None, :]
    if MASKED:
        b = tl.load(data_ptr + off, mask=mask[:, None], other=0)
        sb = tl.load(scales_ptr + soff, mask=mask[:, None], other=0)
    else:
        b = tl.load(data_ptr + off)
        sb = tl.load(scales_ptr + soff)
    b = b.to(tl.uint16)
    sb = sb.to(tl.uint16)
    # E4M3 byte -> f16 bits (byte & 0x7F) << 7 = s * 2^-8 (normal and subnormal alike); times 2^15 = s * 2^7
    sc = ((sb & 0x7F) << 7).to(tl.float16, bitcast=True) * 32768.0
    sc = tl.where((sb & 0x7F) == 0x7F, float("nan"), sc).to(tl.float16)
    # each block scale over its 8 bytes (16 elements): [N, D/16] -> [N, D/16, 8] -> [N, D/2]
    sc = tl.reshape(tl.broadcast_to(sc[:, :, None], [BLOCK_N, D // 16, 8]), [BLOCK_N, D // 2])
    # E2M1 nibble -> f16 bits sign << 15 | magnitude << 9 = e2m1 * 2^-14
    even = (((b & 0x7) << 9) | ((b & 0x8) << 12)).to(tl.float16, bitcast=True)
    odd = (((b & 0x70) << 5) | ((b & 0x80) << 8)).to(tl.float16, bitcast=True)
    return (even * sc).to(tl.float16), (odd * sc).to(tl.float16)


def _row_tile(rows_ptr, row, mask, D: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr,
              MASKED: tl.constexpr):
    """Row-pool rows ``row i64[N]`` -> ``(even, odd)`` columns ``[N, D/2]``: the stored dtype (bf16 / fp16), or for
    ``FP8`` (E4M3 bytes) f16 ``e4m3 * 2^-8`` (exact; NaN bytes give NaN). One contiguous load split in registers."""
    off = row[:, None] * D + tl.arange(0, D)[None, :]
    if MASKED:
        x = tl.load(rows_ptr + off, mask=mask[:, None], other=0)
    else:
        x = tl.load(rows_ptr + off)
    if FP8:
        u = x.to(tl.uint16)
        f = (((u & 0x7F) << 7) | ((u & 0x80) << 8)).to(tl.float16, bitcast=True)
        x = tl.where((u & 0x7F) == 0x7F, float("nan"), f).to(tl.float16)
    return tl.split(tl.reshape(x, [BLOCK_N, D // 2, 2]))


def _step(blk, acc_e, acc_o, m_i, l_i, n, n_ret, qpos, q_e, q_o, q16_e, q16_o, mul_k, rmul_k, twin_v_mul, rk_mul,
          rv_mul, pt_row, ht_row, num_cols, ht_width, data_ptr, scales_ptr, rows_ptr, layer64, num_pages,
          num_row_pages, h, sm_scale, window, cap,
          H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, LOW: tl.constexpr, TWIN: tl.constexpr,
          ROWS_FP8: tl.constexpr, FIRST_N: tl.constexpr, LAST_N: tl.constexpr, NUM_FIXED: tl.constexpr,
          NUM_RING: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr, SPLIT_LOW: tl.constexpr,
          SPLIT_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, EMULATE: tl.constexpr, EDGE: tl.constexpr):
    """One block of ``BLOCK_N`` keys: scores, (edge: twin overlay and masks), online softmax, P @ V."""
    p = blk * BLOCK_N + tl.arange(0, BLOCK_N)                       # key positions
    col = tl.minimum(p // PAGE, num_cols - 1)
    valid = p < n
    if EDGE:
        pid = tl.load(pt_row + col, mask=valid, other=-1)
        valid = valid & (pid >= 0)
    else:
        pid = tl.load(pt_row + col)
    row_k = (((layer64 * num_pages + tl.maximum(pid, 0).to(tl.int64)) * 2) * H + h) * PAGE + p % PAGE
    row_v = row_k + H * PAGE
    main_mask = valid
    if LOW:
        k_e, k_o = _nvfp4_tile(data_ptr, scales_ptr, row_k, valid, D, BLOCK_N, EDGE)
        logits = _qk(q16_e, q16_o, k_e, k_o, EMULATE) * mul_k[:, None]
    elif ROWS_FP8:       # plain FP8 rows read as the reference reads them: f32(e4m3) * scale, then q's dtype
        k_e, k_o = _row_tile(rows_ptr, row_k, valid, D, BLOCK_N, True, EDGE)
        k_e = _cast(k_e.to(tl.float32) * rk_mul, q_e, EMULATE)
        k_o = _cast(k_o.to(tl.float32) * rk_mul, q_e, EMULATE)
        logits = _qk(q_e, q_o, k_e, k_o, EMULATE) * sm_scale
    else:
        k_e, k_o = _row_tile(rows_ptr, row_k, valid, D, BLOCK_N, False, EDGE)
        logits = _qk(q_e, q_o, k_e, k_o, EMULATE) * sm_scale
    if TWIN and EDGE:
        # retained rows (first_n / last_n, twin page held) read the twin instead (`TwinGeometry` rule)
        qp = p // PAGE
        if NUM_RING > 0:
            tcol = tl.where(qp < NUM_FIXED, qp, NUM_FIXED + qp % NUM_RING)
        else:
            tcol = tl.where(qp < NUM_FIXED, qp, -1)
        has_col = (tcol >= 0) & (tcol < ht_width)
        hid = tl.load(ht_row + tl.minimum(tl.maximum(tcol, 0), ht_width - 1), mask=valid & has_col, other=-1)
        keep = valid & (hid >= 0) & ((p < FIRST_N) | (p >= n_ret - LAST_N))
        main_mask = valid & (keep == 0)
        trow_k = (((layer64 * num_row_pages + tl.maximum(hid, 0).to(tl.int64)) * 2) * H + h) * PAGE + p % PAGE
        trow_v = trow_k + H * PAGE
        tk_e, tk_o = _row_tile(rows_ptr, trow_k, keep, D, BLOCK_N, ROWS_FP8, True)
        if ROWS_FP8:
            twin_logits = _qk(q16_e, q16_o, tk_e, tk_o, EMULATE) * rmul_k[:, None]
        else:
            twin_logits = _qk(q_e, q_o, tk_e, tk_o, EMULATE) * sm_scale
        logits = tl.where(keep[None, :], twin_logits, logits)
    if HAS_CAP:
        x = logits / cap
        z = tl.exp(-2.0 * tl.abs(x))                                   # tanh without libdevice
        th = (1.0 - z) / (1.0 + z)
        logits = cap * tl.where(x < 0, -th, th)
    if EDGE:
        vis = valid[None, :] & (p[None, :] <= qpos[:, None])
        if HAS_WINDOW:
            vis = vis & (p[None, :] > qpos[:, None] - window)
        logits = tl.where(vis, logits, float("-inf"))
    m_new = tl.maximum(m_i, tl.reduce(logits, 1, tl.standard._elementwise_max))
    alpha = tl.exp(m_i - m_new)
    pr = tl.exp(logits - m_new[:, None])
    l_i = l_i * alpha + tl.reduce(pr, 1, tl.standard._sum_combine)
    if LOW:
        v_e, v_o = _nvfp4_tile(data_ptr, scales_ptr, row_v, main_mask, D, BLOCK_N, EDGE)
        if TWIN and EDGE:
            a_e, a_o = _pv(tl.where(keep[None, :], 0.0, pr), v_e, v_o, SPLIT_LOW, EMULATE)
            tv_e, tv_o = _row_tile(rows_ptr, trow_v, keep, D, BLOCK_N, ROWS_FP8, True)
            b_e, b_o = _pv(tl.where(keep[None, :], pr, 0.0), tv_e, tv_o, SPLIT_ROWS, EMULATE)
            a_e += b_e * twin_v_mul
            a_o += b_o * twin_v_mul
        else:
            a_e, a_o = _pv(pr, v_e, v_o, SPLIT_LOW, EMULATE)
    else:
        v_e, v_o = _row_tile(rows_ptr, row_v, valid, D, BLOCK_N, ROWS_FP8, EDGE)
        if ROWS_FP8:
            v_e = _cast(v_e.to(tl.float32) * rv_mul, q_e, EMULATE)
            v_o = _cast(v_o.to(tl.float32) * rv_mul, q_e, EMULATE)
        a_e, a_o = _pv(pr, v_e, v_o, SPLIT_ROWS, EMULATE)
    acc_e = acc_e * alpha[:, None] + a_e
    acc_o = acc_o * alpha[:, None] + a_o
    return acc_e, acc_o, m_new, l_i


def _tail_step(tb, acc_e, acc_o, m_i, l_i, n, t, qpos, q_e, q_o, tail_v_mul, tk_row, tv_row, stk_t, stv_t,
               nk_row, nv_row, snk_t, snv_t, tail_len, sm_scale, window, cap, TQ: tl.constexpr, D: tl.constexpr,
               HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr, SPLIT_TAIL: tl.constexpr, BLOCK_N: tl.constexpr,
               EMULATE: tl.constexpr, NEW: tl.constexpr):
    """One block of the dense tail's ``tail_len`` rows (held rows, then the step's own): key ``j`` at position ``n +
    j``, seen by query ``t`` (the tail's row ``tail_len - TQ + t``) when ``j <= tail_len - TQ + t`` (and inside the
    window); 16-bit rows in q's dtype, online softmax as `_step`. ``NEW``: the step's own rows (the last ``TQ``)
    come from ``nk_row`` / ``nv_row`` instead of the tail."""
    j = tb * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = j < tail_len
    cols = tl.arange(0, D)[None, :]
    held = ok
    if NEW:
        held = j < tail_len - TQ
    kx = tl.load(tk_row + j[:, None].to(tl.int64) * stk_t + cols, mask=held[:, None], other=0.0)
    vx = tl.load(tv_row + j[:, None].to(tl.int64) * stv_t + cols, mask=held[:, None], other=0.0)
    if NEW:
        own = ok & (j >= tail_len - TQ)
        jn = (j - (tail_len - TQ))[:, None].to(tl.int64)
        kx = tl.where(own[:, None], tl.load(nk_row + jn * snk_t + cols, mask=own[:, None], other=0.0), kx)
        vx = tl.where(own[:, None], tl.load(nv_row + jn * snv_t + cols, mask=own[:, None], other=0.0), vx)
    k_e, k_o = tl.split(tl.reshape(kx, [BLOCK_N, D // 2, 2]))
    v_e, v_o = tl.split(tl.reshape(vx, [BLOCK_N, D // 2, 2]))
    logits = _qk(q_e, q_o, k_e, k_o, EMULATE) * sm_scale
    if HAS_CAP:
        x = logits / cap
        z = tl.exp(-2.0 * tl.abs(x))
        th = (1.0 - z) / (1.0 + z)
        logits = cap * tl.where(x < 0, -th, th)
    vis = ok[None, :] & (j[None, :] <= (tail_len - TQ + t)[:, None])
    if HAS_WINDOW:
        vis = vis & ((n + j)[None, :] > qpos[:, None] - window)
    logits = tl.where(vis, logits, float("-inf"))
    m_new = tl.maximum(m_i, tl.reduce(logits, 1, tl.standard._elementwise_max))
    alpha = tl.exp(m_i - m_new)
    pr = tl.exp(logits - m_new[:, None])
    l_i = l_i * alpha + tl.reduce(pr, 1, tl.standard._sum_combine)
    a_e, a_o = _pv(pr, v_e, v_o, SPLIT_TAIL, EMULATE)
    acc_e = acc_e * alpha[:, None] + a_e * tail_v_mul
    acc_o = acc_o * alpha[:, None] + a_o * tail_v_mul
    return acc_e, acc_o, m_new, l_i


def _keep_rows(tk_row, tv_row, stk_t, stv_t, nk_row, nv_row, snk_t, snv_t, tail_len, TQ: tl.constexpr,
               D: tl.constexpr):
    """Copy a ``(b, h)``'s ``TQ`` new K / V rows into the tail at ``[tail_len - TQ, tail_len)``."""
    cols = tl.arange(0, D)
    for r in range(0, TQ):
        dst = (tail_len - TQ + r).to(tl.int64)
        tl.store(tk_row + dst * stk_t + cols, tl.load(nk_row + r * snk_t + cols))
        tl.store(tv_row + dst * stv_t + cols, tl.load(nv_row + r * snv_t + cols))


def _pow2(e):
    """float32 ``2^e`` for int32 ``e`` in ``[-126, 127]`` (exponent bits)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


def _attn_kernel(q_ptr, sq_b, sq_t, sq_h, pt_ptr, s_pt, ht_ptr, s_ht, lens_ptr,
                 data_ptr, scales_ptr, gs_ptr, rows_ptr, rscale_ptr, o_ptr, m_ptr, l_ptr,
                 tk_ptr, stk_b, stk_t, stk_h, tv_ptr, stv_b, stv_t, stv_h, tail_len,
                 nk_ptr, snk_b, snk_t, snk_h, nv_ptr, snv_b, snv_t, snv_h,
                 layer, num_pages, num_row_pages, num_cols, ht_width, sm_scale, window, cap,
                 H: tl.constexpr, G: tl.constexpr, TQ: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                 LOW: tl.constexpr, TWIN: tl.constexpr, ROWS_FP8: tl.constexpr,
                 FIRST_N: tl.constexpr, LAST_N: tl.constexpr, NUM_FIXED: tl.constexpr, NUM_RING: tl.constexpr,
                 HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr, SPLIT_LOW: tl.constexpr,
                 SPLIT_ROWS: tl.constexpr, FINAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 EMULATE: tl.constexpr, TAIL: tl.constexpr, SPLIT_TAIL: tl.constexpr, NEW: tl.constexpr):
    """Program ``(b * H + h, split, tile)``: query rows ``tile * BLOCK_M + [0, BLOCK_M)`` of KV head ``h`` of batch
    row ``b`` over the split's blocks. ``FINAL`` (one split): writes ``out f32[B, Tq, Hq, D]`` to ``o_ptr`` and
    ``lse f32[B, Tq, Hq]`` to ``m_ptr``; else the partials ``o f32[B, Tq, Hq, S, D]`` (unnormalized), ``m, l
    f32[B, Tq, Hq, S]``. ``TAIL``: ``tail_len >= Tq`` rows after the ``n`` stored ones come dense (``tk_ptr`` /
    ``tv_ptr``, ``[B, tail_len, H, D]`` by strides; the queries' own rows are its last ``Tq``): query ``t`` sits at
    ``n + tail_len - Tq + t``, the twin windows count from ``n + tail_len`` (the length once the tail is appended),
    and the last split also reads the tail. ``NEW`` (with ``TAIL``): the tail's last ``Tq`` rows are read from
    ``nk_ptr`` / ``nv_ptr`` (``[B, Tq, H, D]`` by strides) and stored into the tail at ``[tail_len - Tq,
    tail_len)`` by the last split's first tile of each ``(b, h)`` (no program reads them from the tail)."""
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    tile = tl.program_id(2)
    b = pid_bh // H
    h = pid_bh % H
    n = tl.load(lens_ptr + b)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    real = rows < TQ * G
    t = tl.minimum(rows // G, TQ - 1)
    hq = h * G + rows % G
    q0 = n - TQ                                                    # position of query 0 (TAIL: after the cache)
    n_ret = n                                                      # the length the twin windows count from
    if TAIL:
        q0 = n + tail_len - TQ
        n_ret = n + tail_len
    qpos = q0 + t                                                  # each query row's position
    layer64 = layer.to(tl.int64)

    q_row = b.to(tl.int64) * sq_b + t * sq_t + hq * sq_h
    qx = tl.load(q_ptr + q_row[:, None] + tl.arange(0, D)[None, :], mask=real[:, None], other=0.0)
    q_e, q_o = tl.split(tl.reshape(qx, [BLOCK_M, D // 2, 2]))
    q16_e = q_e
    q16_o = q_o
    mul_k = tl.full([BLOCK_M], 0.0, tl.float32)
    rmul_k = mul_k
    out_mul = 1.0
    twin_v_mul = 1.0
    rk_mul = 1.0
    rv_mul = 1.0
    if LOW:
        # f16 query rows, each scaled by 2^shift (two exact factors) so its largest element is in [2^7, 2^8)
        qf_e = q_e.to(tl.float32)
        qf_o = q_o.to(tl.float32)
        amax = tl.maximum(tl.reduce(tl.abs(qf_e), 1, tl.standard._elementwise_max),
                          tl.reduce(tl.abs(qf_o), 1, tl.standard._elementwise_max))
        shift = 134 - ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF)    # 8 - frexp exponent
        s1 = shift >> 1
        s2 = shift - s1
        q16_e = (qf_e * _pow2(s1)[:, None] * _pow2(s2)[:, None]).to(tl.float16)
        q16_o = (qf_o * _pow2(s1)[:, None] * _pow2(s2)[:, None]).to(tl.float16)
        gs_k = tl.load(gs_ptr + layer64 * 2)
        gs_v = tl.load(gs_ptr + layer64 * 2 + 1)
        mul_k = sm_scale * (gs_k * 128.0) * _pow2(-s1) * _pow2(-s2)       # low-domain logits -> scaled logits
        out_mul = gs_v * 128.0                                             # low-domain output -> output
        if ROWS_FP8:       # FP8 twin: e4m3 * 2^-8 in f16 against the f16 query rows
            hs_k = tl.load(rscale_ptr + layer64 * 2)
            hs_v = tl.load(rscale_ptr + layer64 * 2 + 1)
            rmul_k = sm_scale * (hs_k * 256.0) * _pow2(-s1) * _pow2(-s2)
            twin_v_mul = (hs_v * 256.0) / out_mul
        else:
            twin_v_mul = 1.0 / out_mul
    elif ROWS_FP8:         # plain FP8 rows: decoded to q's dtype in the kernel
        rk_mul = tl.load(rscale_ptr + layer64 * 2) * 256.0
        rv_mul = tl.load(rscale_ptr + layer64 * 2 + 1) * 256.0

    # the keys this tile can see: [lo, hi)
    t_lo = (tile * BLOCK_M) // G
    t_hi = tl.minimum(((tile + 1) * BLOCK_M - 1) // G, TQ - 1)
    pos_lo = q0 + t_lo
    pos_hi = q0 + t_hi
    hi = tl.maximum(tl.minimum(n, pos_hi + 1), 0)
    lo = hi * 0
    if HAS_WINDOW:
        lo = tl.minimum(tl.maximum(pos_lo - window + 1, 0), hi)
    blk_lo = lo // BLOCK_N
    blk_hi = (hi + BLOCK_N - 1) // BLOCK_N
    per = (blk_hi - blk_lo + num_splits - 1) // num_splits
    start = blk_lo + split * per
    end = tl.minimum(start + per, blk_hi)
    # interior blocks: every key visible to every row, below n, not retained
    c_lo = lo * 0
    c_hi = tl.minimum(n, pos_lo + 1)
    if TWIN:
        c_lo = c_lo + FIRST_N
        c_hi = tl.minimum(c_hi, n_ret - LAST_N)
    if HAS_WINDOW:
        c_lo = tl.maximum(c_lo, pos_hi - window + 1)
    i0 = (tl.maximum(c_lo, 0) + BLOCK_N - 1) // BLOCK_N
    i1 = tl.maximum(c_hi, 0) // BLOCK_N
    a = tl.minimum(tl.maximum(i0, start), tl.maximum(end, start))
    c = tl.minimum(tl.maximum(i1, a), tl.maximum(end, a))
    e = tl.maximum(end, c)

    pt_row = pt_ptr + b.to(tl.int64) * s_pt
    ht_row = ht_ptr + b.to(tl.int64) * s_ht
    acc_e = tl.full([BLOCK_M, D // 2], 0.0, tl.float32)
    acc_o = tl.full([BLOCK_M, D // 2], 0.0, tl.float32)
    m_i = tl.full([BLOCK_M], M_INIT, tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    for blk in range(start, a):                                    # head edge: first_n, window
        acc_e, acc_o, m_i, l_i = _step(
            blk, acc_e, acc_o, m_i, l_i, n, n_ret, qpos, q_e, q_o, q16_e, q16_o, mul_k, rmul_k, twin_v_mul, rk_mul,
            rv_mul, pt_row, ht_row, num_cols, ht_width, data_ptr, scales_ptr, rows_ptr, layer64, num_pages,
            num_row_pages, h, sm_scale, window, cap, H, D, PAGE, LOW, TWIN, ROWS_FP8, FIRST_N, LAST_N, NUM_FIXED,
            NUM_RING, HAS_WINDOW, HAS_CAP, SPLIT_LOW, SPLIT_ROWS, BLOCK_N, EMULATE, True)
    for blk in range(a, c):                                        # interior: no mask, no twin
        acc_e, acc_o, m_i, l_i = _step(
            blk, acc_e, acc_o, m_i, l_i, n, n_ret, qpos, q_e, q_o, q16_e, q16_o, mul_k, rmul_k, twin_v_mul, rk_mul,
            rv_mul, pt_row, ht_row, num_cols, ht_width, data_ptr, scales_ptr, rows_ptr, layer64, num_pages,
            num_row_pages, h, sm_scale, window, cap, H, D, PAGE, LOW, TWIN, ROWS_FP8, FIRST_N, LAST_N, NUM_FIXED,
            NUM_RING, HAS_WINDOW, HAS_CAP, SPLIT_LOW, SPLIT_ROWS, BLOCK_N, EMULATE, False)
    for blk in range(c, e):                                        # tail edge: last_n, causal, rows past n
        acc_e, acc_o, m_i, l_i = _step(
            blk, acc_e, acc_o, m_i, l_i, n, n_ret, qpos, q_e, q_o, q16_e, q16_o, mul_k, rmul_k, twin_v_mul, rk_mul,
            rv_mul, pt_row, ht_row, num_cols, ht_width, data_ptr, scales_ptr, rows_ptr, layer64, num_pages,
            num_row_pages, h, sm_scale, window, cap, H, D, PAGE, LOW, TWIN, ROWS_FP8, FIRST_N, LAST_N, NUM_FIXED,
            NUM_RING, HAS_WINDOW, HAS_CAP, SPLIT_LOW, SPLIT_ROWS, BLOCK_N, EMULATE, True)
    if TAIL:
        if split == num_splits - 1:                                # the step's own rows: once, in the last split
            tail_v_mul = 1.0 / out_mul
            tk_row = tk_ptr + b.to(tl.int64) * stk_b + h.to(tl.int64) * stk_h
            tv_row = tv_ptr + b.to(tl.int64) * stv_b + h.to(tl.int64) * stv_h
            nk_row = nk_ptr + b.to(tl.int64) * snk_b + h.to(tl.int64) * snk_h
            nv_row = nv_ptr + b.to(tl.int64) * snv_b + h.to(tl.int64) * snv_h
            for tb in range(0, (tail_len - TQ + t_hi) // BLOCK_N + 1):
                acc_e, acc_o, m_i, l_i = _tail_step(
                    tb, acc_e, acc_o, m_i, l_i, n, t, qpos, q_e, q_o, tail_v_mul, tk_row, tv_row, stk_t, stv_t,
                    nk_row, nv_row, snk_t, snv_t, tail_len, sm_scale, window, cap, TQ, D, HAS_WINDOW, HAS_CAP,
                    SPLIT_TAIL, BLOCK_N, EMULATE, NEW)
            if NEW:
                if tile == 0:                                      # the step's own rows kept in the tail
                    _keep_rows(tk_row, tv_row, stk_t, stv_t, nk_row, nv_row, snk_t, snv_t, tail_len, TQ, D)
    acc_e = acc_e * out_mul
    acc_o = acc_o * out_mul

    out_row = (b.to(tl.int64) * TQ + t) * (H * G) + hq                # [M] row of [B, Tq, Hq]
    if FINAL:
        empty = l_i == 0.0
        inv = 1.0 / tl.where(empty, 1.0, l_i)
        o = tl.reshape(tl.join(acc_e * inv[:, None], acc_o * inv[:, None]), [BLOCK_M, D])
        o = _stored(tl.where(empty[:, None], 0.0, o), o_ptr, EMULATE)
        tl.store(o_ptr + out_row[:, None] * D + tl.arange(0, D)[None, :], o, mask=real[:, None])
        lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
        tl.store(m_ptr + out_row, lse, mask=real)
    else:
        part = out_row * num_splits + split
        o = tl.reshape(tl.join(acc_e, acc_o), [BLOCK_M, D])
        tl.store(o_ptr + part[:, None] * D + tl.arange(0, D)[None, :], o, mask=real[:, None])
        tl.store(m_ptr + part, m_i, mask=real)
        tl.store(l_ptr + part, l_i, mask=real)


def _merge_kernel(o_ptr, m_ptr, l_ptr, out_ptr, lse_ptr, num_splits, D: tl.constexpr, BLOCK_S: tl.constexpr,
                  EMULATE: tl.constexpr):
    """LSE merge of one output row's split partials (``o f32[S, D]``, ``m, l f32[S]``) -> ``out [D]`` (float32 or
    the attention dtype, rounded once), ``lse``; ``l == 0`` everywhere (no key seen) gives zeros and ``-inf``; NaN
    partials give NaN."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    ok = s < num_splits
    m = tl.load(m_ptr + row * num_splits + s, mask=ok, other=M_INIT)
    l = tl.load(l_ptr + row * num_splits + s, mask=ok, other=0.0)
    m_g = tl.reduce(m, 0, tl.standard._elementwise_max)
    w = tl.exp(m - m_g)
    l_g = tl.reduce(w * l, 0, tl.standard._sum_combine)
    cols = tl.arange(0, D)
    o = tl.load(o_ptr + (row * num_splits + s)[:, None] * D + cols[None, :], mask=ok[:, None], other=0.0)
    acc = tl.reduce(w[:, None] * o, 0, tl.standard._sum_combine)
    empty = l_g == 0.0
    out = _stored(tl.where(empty, 0.0, acc / tl.where(empty, 1.0, l_g)), out_ptr, EMULATE)
    tl.store(out_ptr + row * D + cols, out)
    tl.store(lse_ptr + row, tl.where(empty, float("-inf"), m_g + tl.log(tl.where(empty, 1.0, l_g))))


def _interpreter_range(*bounds):
    """``range`` over interpreter scalars: they are 1-element arrays, which NumPy >= 2.4 no longer converts with
    ``int()`` (the interpreter's ``__index__``). Compiled kernels use Triton's own ``range``."""
    import numpy as np
    return range(*(int(np.asarray(b.handle.data).reshape(-1)[0]) if hasattr(b, "handle") else int(b)
                   for b in bounds))


_HELPERS = ("_dot", "_bf16_rne", "_cast", "_stored", "_qk", "_pv", "_nvfp4_tile", "_row_tile", "_step", "_tail_step",
            "_keep_rows", "_pow2")


@functools.lru_cache(maxsize=None)
def _kernels(interpret: bool):
    """``(attention kernel, merge kernel)`` built for one mode, helpers included (cached)."""
    import triton
    import triton.language as tl
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        def wrap(fn, **_):
            return InterpretedFunction(fn)
    else:
        wrap = triton.jit
    ns = {"tl": tl, "triton": triton, "M_INIT": tl.constexpr(M_INIT), "float": float}
    if interpret:
        ns["range"] = _interpreter_range

    def bind(fn, **kw):
        f = types.FunctionType(fn.__code__, ns, fn.__name__, fn.__defaults__, fn.__closure__)
        f.__qualname__, f.__module__, f.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
        f.__annotations__ = dict(fn.__annotations__)
        return wrap(f, **kw)

    for name in _HELPERS:
        ns[name] = bind(globals()[name])
    # runtime values that only bound loops or index: one compilation for all of them (a held run's tail grows by a
    # row a step, so specializing ``tail_len`` would compile mid-generation at 16 rows)
    attn = bind(_attn_kernel, do_not_specialize=["layer", "window", "num_pages", "num_row_pages", "tail_len"])
    merge = bind(_merge_kernel, do_not_specialize=["num_splits"])
    return attn, merge


# ================================================================================================ host side
class Tuning(NamedTuple):
    """Launch shape of `paged_attention`: query rows and keys per program step, split-K count, warps, stages."""
    block_m: int
    block_n: int
    num_splits: int
    num_warps: int
    num_stages: int



@functools.lru_cache(maxsize=None)
def _device_sms(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def num_sms(device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (`DEFAULT_NUM_SMS` for any other device)."""
    device = torch.device(device)
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return _device_sms(device.index if device.index is not None else torch.cuda.current_device())


def choose_tuning(batch: int, num_kv_heads: int, rows: int, head_dim: int, max_keys: int, *, cuda: bool,
                  sms: int = DEFAULT_NUM_SMS, row_pool: bool = True, min_keys_per_split: int = 0) -> Tuning:
    """Default `Tuning` for ``batch`` rows, ``rows = Tq * G`` query rows per KV head, ``max_keys`` = the page
    table's capacity in tokens, ``row_pool`` = the cache reads a twin or plain rows (False: NVFP4 only).

    ``BLOCK_M``: ``rows`` padded to a power of two >= 16, at most 64 (32 at head_dim > 128; more rows run in
    tiles). ``BLOCK_N`` / warps: the largest step that compiles for sm_90 without register spills (ptxas, 2
    stages): 64 keys / 4 warps for NVFP4-only caches and plain rows at head_dim <= 128, 32 / 4 with a twin, 32 / 8
    at head_dim 256 or 64 query rows (chosen by register use, not by timing). Splits: about `PROGRAMS_PER_SM`
    programs per SM (a power of two, at most `MAX_SPLITS` and the blocks of the longest possible sequence, and with
    ``min_keys_per_split`` at most one split per that many keys: a caller that launches from eager Python trades a
    little GPU time at short lengths for the merge kernel's launch) on CUDA, 1 elsewhere (the interpreter runs
    programs one by one)."""
    big = head_dim > 128
    block_m = min(next_pow2(max(16, rows)), 32 if big else 64)
    if big or block_m == 64:
        block_n, warps = 32, 8
    else:
        block_n, warps = (32 if row_pool else 64), 4
    tiles = -(-rows // block_m)
    splits = 1
    if cuda:
        programs = max(1, batch * num_kv_heads * tiles)
        want = max(1, -(-PROGRAMS_PER_SM * sms // programs))
        splits = int(max(1, min(next_pow2(want), -(-max_keys // max(block_n, min_keys_per_split)), MAX_SPLITS)))
    return Tuning(block_m, block_n, splits, warps, 2)


def _geometry(geom):
    """``(page, first_n, last_n, num_fixed, num_ring)`` from a 5-tuple or a `jmixedkv.layout.TwinGeometry`."""
    if hasattr(geom, "first_n"):
        geom = (geom.page, geom.first_n, geom.last_n, geom.num_fixed, geom.num_ring)
    try:
        vals = tuple(geom)
    except TypeError:
        raise ValueError(f"paged_attention: geom must be (page, first_n, last_n, num_fixed, num_ring) or a "
                         f"TwinGeometry, got {geom!r}") from None
    if len(vals) != 5 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in vals):
        raise ValueError(f"paged_attention: geom must be 5 ints >= 0 (page, first_n, last_n, num_fixed, num_ring), "
                         f"got {geom!r}")
    if vals[0] < 1:
        raise ValueError(f"paged_attention: geom page={vals[0]} must be >= 1")
    return vals


_FP8 = getattr(torch, "float8_e4m3fn", None)


def _byte_view(x, name):
    """uint8 view of an E4M3 (or already uint8) tensor."""
    if x.dtype == torch.uint8:
        return x
    if _FP8 is not None and x.dtype == _FP8:
        return x.view(torch.uint8)
    raise ValueError(f"paged_attention: {name} must be uint8 or float8_e4m3fn, got {x.dtype}")


def _check_tensor(x, name, shape, dtypes, device):
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"paged_attention: {name} must be a torch.Tensor, got {type(x).__name__}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"paged_attention: {name} has shape {tuple(x.shape)}, expected {tuple(shape)}")
    if dtypes is not None and x.dtype not in dtypes:
        raise ValueError(f"paged_attention: {name} has dtype {x.dtype}, expected one of {list(dtypes)}")
    if x.device != device:
        raise ValueError(f"paged_attention: {name} is on {x.device}, q on {device}")


def _check_pool(x, name, ndim_tail, device):
    """Shape prefix ``[L, pages, 2, H, page]`` of a contiguous pool."""
    if not isinstance(x, torch.Tensor) or x.dim() != 6 or x.shape[2] != 2:
        raise ValueError(f"paged_attention: {name} must be [L, pages, 2, H, page, {ndim_tail}], got "
                         f"{getattr(x, 'shape', type(x).__name__)}")
    if not x.is_contiguous():
        raise ValueError(f"paged_attention: {name} must be contiguous (strides {tuple(x.stride())})")
    if x.device != device:
        raise ValueError(f"paged_attention: {name} is on {x.device}, q on {device}")


class _Plan(NamedTuple):
    low: bool
    twin: bool
    rows_fp8: bool
    rows: Optional[torch.Tensor]
    rscale: Optional[torch.Tensor]
    num_layers: int
    num_pages: int
    num_row_pages: int
    heads: int
    page: int


def _check_table(table, name: str, bsz: int, width: str, min_width: int, dev) -> None:
    """A page table ``i32[B, width]`` on ``dev`` with unit column stride (`ValueError` naming it otherwise)."""
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.shape[0] != bsz \
            or table.shape[1] < min_width:
        raise ValueError(f"paged_attention: {name} must be i32[B={bsz}, {width}], got "
                         f"{getattr(table, 'shape', type(table).__name__)}")
    _check_tensor(table, name, table.shape, (torch.int32,), dev)
    if table.stride(1) != 1:
        raise ValueError(f"paged_attention: {name} must have unit stride on its columns, got "
                         f"{tuple(table.stride())}")


def _check_layer(layer, num_layers: int) -> None:
    """``layer``: a Python or NumPy integer (not a bool, not a float: the launch would truncate one) in
    [0, ``num_layers``). A Python int skips the ABC check (~0.4 us: every layer of a held step comes here)."""
    if type(layer) is not int and (isinstance(layer, bool) or not isinstance(layer, numbers.Integral)) \
            or not 0 <= layer < num_layers:
        raise ValueError(f"paged_attention: layer={layer!r} must be an int in [0, {num_layers})")


def _check_options(sm_scale, sliding_window, soft_cap) -> None:
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)) or not math.isfinite(sm_scale):
        raise ValueError(f"paged_attention: sm_scale={sm_scale!r} must be a finite float")
    if sliding_window is not None and (not isinstance(sliding_window, int) or isinstance(sliding_window, bool)
                                       or sliding_window < 1):
        raise ValueError(f"paged_attention: sliding_window={sliding_window!r} must be None or an int >= 1")
    if soft_cap is not None and (isinstance(soft_cap, bool) or not isinstance(soft_cap, (int, float))
                                 or not math.isfinite(soft_cap) or soft_cap <= 0):
        raise ValueError(f"paged_attention: soft_cap={soft_cap!r} must be None or a finite float > 0")


def _validate(q, low_data, low_scales, low_gs, high_rows, high_scale, plain_rows, plain_scale, layer, page_table,
              high_table, kv_lens, geom, sm_scale, sliding_window, soft_cap):
    """Host checks; ``(plan, low_scales as uint8)``."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"paged_attention: q must be a [B, Tq, Hq, D] tensor, got "
                         f"{getattr(q, 'shape', type(q).__name__)}")
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"paged_attention: q dtype {q.dtype} must be bfloat16 or float16 (the attention dtype)")
    if q.stride(-1) != 1:
        raise ValueError(f"paged_attention: q must have unit stride on head_dim, got strides {tuple(q.stride())}")
    bsz, tq, hq, d = q.shape
    dev = q.device
    if tq < 1 or bsz < 1:
        raise ValueError(f"paged_attention: q shape {tuple(q.shape)} needs B >= 1 and Tq >= 1")
    if d not in HEAD_DIMS:
        raise ValueError(f"paged_attention: head_dim {d} must be one of {HEAD_DIMS}")
    if (low_data is None) == (plain_rows is None):
        raise ValueError("paged_attention: pass exactly one of low_data (NVFP4 pools) or plain_rows (plain pools)")
    low = low_data is not None
    main = low_data if low else plain_rows
    _check_pool(main, "low_data" if low else "plain_rows", "D/2" if low else "D", dev)
    num_layers, num_pages, _, heads, page = main.shape[:5]
    if main.shape[5] != (d // 2 if low else d):
        raise ValueError(f"paged_attention: {'low_data' if low else 'plain_rows'} last axis {main.shape[5]} does "
                         f"not match head_dim {d} of q")
    if hq % heads:
        raise ValueError(f"paged_attention: Hq={hq} query heads is not a multiple of H={heads} KV heads")
    rows = rscale = None
    twin = rows_fp8 = False
    num_row_pages = 1
    if low:
        if low_data.dtype != torch.uint8:
            raise ValueError(f"paged_attention: low_data dtype {low_data.dtype} must be uint8")
        _check_pool(low_scales, "low_scales", "D/16", dev)
        if tuple(low_scales.shape) != (num_layers, num_pages, 2, heads, page, d // 16):
            raise ValueError(f"paged_attention: low_scales has shape {tuple(low_scales.shape)}, expected "
                             f"{(num_layers, num_pages, 2, heads, page, d // 16)}")
        low_scales = _byte_view(low_scales, "low_scales")
        _check_tensor(low_gs, "low_gs", (num_layers, 2), (torch.float32,), dev)
        if high_rows is not None:
            if high_table is None:
                raise ValueError("paged_attention: high_rows given without high_table")
            twin = not isinstance(high_table, torch.Tensor) or high_table.dim() != 2 or high_table.shape[1] > 0
            if twin:                   # a twin table of no columns: every row is read from the NVFP4 pool
                rows, rscale, rname = high_rows, high_scale, "high_rows"
    else:
        for name, x in (("low_scales", low_scales), ("low_gs", low_gs), ("high_rows", high_rows)):
            if x is not None:
                raise ValueError(f"paged_attention: {name} must be None for a plain cache (plain_rows given)")
        rows, rscale, rname = plain_rows, plain_scale, "plain_rows"
    if rows is not None:
        _check_pool(rows, rname, "D", dev)
        if tuple(rows.shape[:1]) + tuple(rows.shape[2:]) != (num_layers, 2, heads, page, d):
            raise ValueError(f"paged_attention: {rname} has shape {tuple(rows.shape)}, expected "
                             f"[{num_layers}, pages, 2, {heads}, {page}, {d}]")
        num_row_pages = rows.shape[1]
        if rows.dtype in (torch.uint8,) or (_FP8 is not None and rows.dtype == _FP8):
            rows_fp8 = True
            rows = _byte_view(rows, rname)
            _check_tensor(rscale, rname.replace("rows", "scale"), (num_layers, 2), (torch.float32,), dev)
        elif rows.dtype != q.dtype:
            raise ValueError(f"paged_attention: {rname} dtype {rows.dtype} must be q's dtype {q.dtype} (the "
                             f"attention dtype) or FP8 (uint8 / float8_e4m3fn)")
    if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < num_layers:
        raise ValueError(f"paged_attention: layer={layer!r} must be an int in [0, {num_layers})")
    _check_table(page_table, "page_table", bsz, "max_pages >= 1", 1, dev)
    _check_tensor(kv_lens, "kv_lens", (bsz,), (torch.int32,), dev)
    if not kv_lens.is_contiguous():
        raise ValueError("paged_attention: kv_lens must be contiguous")
    g = _geometry(geom)
    if g[0] != page:
        raise ValueError(f"paged_attention: geom page={g[0]} does not match the pools' page size {page}")
    if twin:
        _check_table(high_table, "high_table", bsz, "W", 0, dev)
    _check_options(sm_scale, sliding_window, soft_cap)
    return _Plan(low, twin, rows_fp8, rows, rscale, num_layers, num_pages, num_row_pages, heads, page), low_scales


def paged_attention(q, low_data, low_scales, low_gs, high_rows, high_scale, plain_rows, plain_scale, layer: int,
                    page_table, high_table, kv_lens, geom, sm_scale: float, sliding_window: Optional[int] = None,
                    soft_cap: Optional[float] = None, *, tail_k=None, tail_v=None, interpret: Optional[bool] = None,
                    tuning: Optional[Tuning] = None, num_splits: Optional[int] = None):
    """Paged attention of one layer (decode, verify, a later prefill chunk) over the torch pools.

    Args:
      q: ``[B, Tq, Hq, D]`` bf16 / fp16 (the attention dtype, in the stored basis: the caller rotates), unit stride
        on ``D``; ``D`` in 32 / 64 / 128 / 256; ``Hq % H == 0``.
      low_data, low_scales, low_gs, high_rows, high_scale, plain_rows, plain_scale: the pools (module docstring;
        None where absent). ``high_scale`` / ``plain_scale`` are read only for FP8 rows.
      layer: the layer (a host int in ``[0, L)``; a runtime kernel argument: one compilation for every layer).
      page_table: i32[B, MP] low (or plain) page ids of each row's pages (-1 = not held).
      high_table: i32[B, W] twin page ids (``TwinGeometry`` columns; needed with ``high_rows``).
      kv_lens: i32[B] lengths ``n`` (0 for padding rows), read on the device.
      geom: ``(page, first_n, last_n, num_fixed, num_ring)`` or a `jmixedkv.layout.TwinGeometry`.
      sm_scale: logit scale; sliding_window: keys ``pos - w < p <= pos``; soft_cap: ``c * tanh(x / c)``.
      tail_k, tail_v: rows after the stored ones, not in the pools: ``[B, T, H, D]`` with ``T >= Tq`` (rows held
        from earlier steps, then the step's own ``Tq``) in q's dtype (any strides with unit stride on ``D``; e.g. a
        transpose of transformers' ``[B, H, T, D]``), both or neither. With them query ``t`` sits at position ``n +
        T - Tq + t`` (after the ``n`` stored rows and the tail's earlier rows) and also sees tail rows ``j <= T - Tq
        + t`` (key position ``n + j``; the window applies); without them it sits at ``n - Tq + t``. With a tail
        the twin's first_n / last_n windows count from ``n + T``: the result is that of appending the tail, then
        attending.
      interpret: run Triton's CPU interpreter (default: ``not q.is_cuda``).
      tuning: a `Tuning` (default `choose_tuning`); num_splits: overrides its split count.

    Returns:
      ``(out f32[B, Tq, Hq, D], lse f32[B, Tq, Hq])``, natural-log LSE of the scaled (soft-capped) logits; rows that
      see no key: zeros and ``-inf``.

    Host checks raise ``ValueError`` naming the bad value (shapes, dtypes, devices, layer, geom, options). Table
    entries and lengths are not read on the host: a valid state is assumed (every page of ``p < n`` held, ``n <=
    MP * page``); page ids are clamped into the pool, never read out of bounds. `PagedAttention` checks the pools
    and tables once for many calls (every layer of a step).
    """
    run = PagedAttention(q, low_data, low_scales, low_gs, high_rows, high_scale, plain_rows, plain_scale, page_table,
                         high_table, kv_lens, geom, tail=tail_k is not None or tail_v is not None,
                         interpret=interpret, tuning=tuning, num_splits=num_splits)
    return run(q, layer, sm_scale, sliding_window, soft_cap, tail_k=tail_k, tail_v=tail_v)


class PagedAttention:
    """`paged_attention` with the pools, tables, lengths, geometry and query shape checked once (the host work a
    step's layers share); each call then checks only its query, layer, options and tail, and launches.

    ``PagedAttention(q, <7 pools>, page_table, high_table, kv_lens, geom, tail=False)`` takes the arguments of
    `paged_attention` (``q`` gives the shape, dtype and device every call must match; ``tail``: calls pass
    ``tail_k`` / ``tail_v``); ``run(q, layer, sm_scale, sliding_window=None, soft_cap=None, tail_k=None,
    tail_v=None, out_dtype=None)`` -> ``(out f32[B, Tq, Hq, D] (or ``out_dtype``: q's dtype), lse f32[B, Tq, Hq])``.
    The tensors it was made with must stay alive and unchanged while it is used (it keeps references, not
    copies)."""

    def __init__(self, q, low_data, low_scales, low_gs, high_rows, high_scale, plain_rows, plain_scale, page_table,
                 high_table, kv_lens, geom, *, tail: bool = False, interpret: Optional[bool] = None,
                 tuning: Optional[Tuning] = None, num_splits: Optional[int] = None, min_keys_per_split: int = 0):
        plan, low_scales = _validate(q, low_data, low_scales, low_gs, high_rows, high_scale, plain_rows,
                                     plain_scale, 0, page_table, high_table, kv_lens, geom, 1.0, None, None)
        interpret = (not q.is_cuda) if interpret is None else bool(interpret)
        if not interpret and not q.is_cuda:
            raise ValueError(f"paged_attention: interpret=False needs CUDA tensors, q is on {q.device}")
        bsz, tq, hq, d = q.shape
        heads, group = plan.heads, hq // plan.heads
        rows = tq * group
        max_keys = page_table.shape[1] * plan.page + (tq if tail else 0)
        if tuning is None:
            tuning = choose_tuning(bsz, heads, rows, d, max_keys, cuda=not interpret,
                                   sms=num_sms(q.device) if q.is_cuda else DEFAULT_NUM_SMS,
                                   row_pool=plan.rows is not None, min_keys_per_split=min_keys_per_split)
        if num_splits is not None:
            if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
                raise ValueError(f"paged_attention: num_splits={num_splits!r} must be an int >= 1")
            tuning = tuning._replace(num_splits=num_splits)
        _check_tuning(tuning)
        _, first_n, last_n, num_fixed, num_ring = _geometry(geom)
        self.attn, self.merge = _kernels(interpret)
        dev = q.device
        # stand-ins for absent operands: never read (their constexpr branches are compiled out), so never filled
        dummy_u8 = torch.empty(1, dtype=torch.uint8, device=dev)
        dummy_f32 = torch.empty(1, dtype=torch.float32, device=dev)
        ht = high_table if plan.twin else torch.empty((1, 1), dtype=torch.int32, device=dev)
        self.shape, self.dtype, self.device, self.tail, self.tuning = tuple(q.shape), q.dtype, dev, bool(tail), tuning
        self.num_layers, self.heads = plan.num_layers, heads
        self.grid = (bsz * heads, tuning.num_splits, -(-rows // tuning.block_m))
        self.tables = (page_table, page_table.stride(0), ht, ht.stride(0), kv_lens,
                       low_data if plan.low else dummy_u8, low_scales if plan.low else dummy_u8,
                       low_gs if plan.low else dummy_f32, plan.rows if plan.rows is not None else dummy_u8,
                       plan.rscale if plan.rows_fp8 else dummy_f32)
        self.sizes = (plan.num_pages, plan.num_row_pages, page_table.shape[1], ht.shape[1])
        # bf16 probabilities are split in two halves where rows meet them in bf16 (a bf16 twin, plain bf16 / FP8
        # rows under bf16 q, the bf16 tail)
        bf16 = q.dtype == torch.bfloat16
        self.constants = dict(
            H=heads, G=group, TQ=tq, D=d, PAGE=plan.page, LOW=plan.low, TWIN=plan.twin, ROWS_FP8=plan.rows_fp8,
            FIRST_N=first_n, LAST_N=last_n, NUM_FIXED=num_fixed, NUM_RING=num_ring, SPLIT_LOW=False,
            SPLIT_ROWS=bf16 and plan.rows is not None and (not plan.low or not plan.rows_fp8),
            FINAL=tuning.num_splits == 1, BLOCK_M=tuning.block_m, BLOCK_N=tuning.block_n, EMULATE=interpret,
            TAIL=self.tail, SPLIT_TAIL=bf16, num_warps=tuning.num_warps, num_stages=tuning.num_stages)
        self.dummy, self.interpret, self._runners = dummy_u8, interpret, {}     # this object's launches by key
        self._lse_scratch = None                       # the LSE of calls that do not return it (one split)
        # what fixes the compiled kernel besides a call's own arguments (`_launch`): device, grid, constexprs and
        # Triton's specialization of the fixed arguments (alignment of the tables and pools, unit / 16-multiple ints)
        self.spec = (dev.index, self.grid, tuple(self.constants.items()),
                     *(_align16(x) if isinstance(x, torch.Tensor) else _int_spec(x) for x in self.tables + self.sizes))

    def _check_call(self, q, layer, sm_scale, sliding_window, soft_cap, tail_k, tail_v, tail_len, new_k,
                    new_v) -> None:
        if not isinstance(q, torch.Tensor) or tuple(q.shape) != self.shape or q.dtype != self.dtype \
                or q.device != self.device or q.stride(-1) != 1:
            raise ValueError(f"paged_attention: q must be {self.dtype} {list(self.shape)} on {self.device} with unit "
                             f"stride on head_dim (the shape this PagedAttention was made for), got "
                             f"{getattr(q, 'dtype', type(q).__name__)} {list(getattr(q, 'shape', []))}")
        _check_layer(layer, self.num_layers)
        _check_options(sm_scale, sliding_window, soft_cap)
        if (tail_k is not None or tail_v is not None) != self.tail:
            raise ValueError(f"paged_attention: this call was prepared {'with' if self.tail else 'without'} tail_k / "
                             f"tail_v (the step's own rows); pass {'both' if self.tail else 'neither'}")
        if not self.tail:
            if tail_len is not None or new_k is not None or new_v is not None:
                raise ValueError("paged_attention: tail_len / new_k / new_v need tail_k / tail_v")
            return
        rows = tail_k.shape[1] if isinstance(tail_k, torch.Tensor) and tail_k.dim() == 4 else -1
        want = (self.shape[0], max(rows, self.shape[1]), self.heads, self.shape[3])
        for name, x in (("tail_k", tail_k), ("tail_v", tail_v)):
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != want or x.dtype != self.dtype \
                    or x.device != self.device or x.stride(-1) != 1:
                raise ValueError(f"paged_attention: {name} must be {self.dtype} [B, T >= Tq={self.shape[1]}, H, D]"
                                 f" = {list(want)} (tail_k's shape) on {self.device} with unit stride on D, got "
                                 f"{getattr(x, 'dtype', type(x).__name__)} {list(getattr(x, 'shape', []))} "
                                 f"strides {tuple(getattr(x, 'stride', tuple)())}")
        if tail_len is not None and (isinstance(tail_len, bool) or not isinstance(tail_len, int)
                                     or not self.shape[1] <= tail_len <= rows):
            raise ValueError(f"paged_attention: tail_len={tail_len!r} must be an int in [Tq={self.shape[1]}, "
                             f"{rows}] (tail_k's rows)")
        if (new_k is None) != (new_v is None):
            raise ValueError("paged_attention: pass both new_k and new_v, or neither")
        if new_k is not None:
            want = (self.shape[0], self.shape[1], self.heads, self.shape[3])
            for name, x in (("new_k", new_k), ("new_v", new_v)):
                if not isinstance(x, torch.Tensor) or tuple(x.shape) != want or x.dtype != self.dtype \
                        or x.device != self.device or x.stride(-1) != 1:
                    raise ValueError(f"paged_attention: {name} must be {self.dtype} [B, Tq, H, D] = {list(want)} on "
                                     f"{self.device} with unit stride on D, got "
                                     f"{getattr(x, 'dtype', type(x).__name__)} {list(getattr(x, 'shape', []))}")

    def __call__(self, q, layer: int, sm_scale: float, sliding_window: Optional[int] = None,
                 soft_cap: Optional[float] = None, *, tail_k=None, tail_v=None, tail_len: Optional[int] = None,
                 new_k=None, new_v=None, out_dtype=None, return_lse: bool = True, validate: bool = True):
        """``out_dtype``: None / ``torch.float32`` (the default) or q's dtype (the output stored rounded to it by
        the kernel, RTNE: what ``.to(q.dtype)`` of the float32 output gives, without a cast launch).

        ``tail_len``: the tail is ``tail_k[:, :tail_len]`` (default: all its rows; a buffer's first rows, without a
        view per call). ``new_k`` / ``new_v [B, Tq, H, D]``: the step's own rows, read from them and written by the
        kernel into the tail at ``[tail_len - Tq, tail_len)`` (one launch instead of a copy, then the attention).
        ``return_lse=False``: returns ``(out, None)`` (with one split, the LSE goes to a scratch buffer this object
        reuses). ``validate=False`` skips the checks of the tensors' shapes, dtypes and devices, for a caller that
        made the same call shapes once already (a step's later layers); the layer and options are still checked."""
        if validate:
            self._check_call(q, layer, sm_scale, sliding_window, soft_cap, tail_k, tail_v, tail_len, new_k, new_v)
        else:
            _check_layer(layer, self.num_layers)
            _check_options(sm_scale, sliding_window, soft_cap)
        odt = torch.float32 if out_dtype is None else out_dtype
        if odt is not torch.float32 and odt != self.dtype:
            raise ValueError(f"paged_attention: out_dtype={out_dtype!r} must be None, torch.float32 or q's dtype "
                             f"{self.dtype}")
        bsz, tq, hq, d = self.shape
        splits, dev = self.tuning.num_splits, self.device
        if splits == 1:
            o = torch.empty((bsz, tq, hq, d), dtype=odt, device=dev)
            if return_lse:
                m = torch.empty((bsz, tq, hq), dtype=torch.float32, device=dev)
            else:
                m = self._lse_scratch
                if m is None:
                    m = self._lse_scratch = torch.empty((bsz, tq, hq), dtype=torch.float32, device=dev)
            l_part = m
        else:
            o = torch.empty((bsz, tq, hq, splits, d), dtype=torch.float32, device=dev)
            m = torch.empty((bsz, tq, hq, splits), dtype=torch.float32, device=dev)
            l_part = torch.empty_like(m)
        new = new_k is not None
        if self.tail:
            sk, sv = tail_k.stride(), tail_v.stride()
            tail = (tail_k, sk[0], sk[1], sk[2], tail_v, sv[0], sv[1], sv[2],
                    tail_k.shape[1] if tail_len is None else tail_len)
            tail_key = (_align16(tail_k), _int_spec(sk[0]), _int_spec(sk[1]), _int_spec(sk[2]),
                        _align16(tail_v), _int_spec(sv[0]), _int_spec(sv[1]), _int_spec(sv[2]))
        else:
            tail, tail_key = (self.dummy, 0, 0, 0, self.dummy, 0, 0, 0, tq), ()
        if new:
            nk, nv = new_k.stride(), new_v.stride()
            fresh = (new_k, nk[0], nk[1], nk[2], new_v, nv[0], nv[1], nv[2])
            tail_key += (_align16(new_k), _int_spec(nk[0]), _int_spec(nk[1]), _int_spec(nk[2]),
                         _align16(new_v), _int_spec(nv[0]), _int_spec(nv[1]), _int_spec(nv[2]))
        else:
            fresh = (self.dummy, 0, 0, 0, self.dummy, 0, 0, 0)
        sq = q.stride()
        args = (q, sq[0], sq[1], sq[2], *self.tables, o, m, l_part, *tail, *fresh, int(layer), *self.sizes,
                float(sm_scale), int(sliding_window or 0), float(soft_cap or 1.0))
        has_window, has_cap = sliding_window is not None, soft_cap is not None
        key = ("attn", has_window, has_cap, new, odt if splits == 1 else None, _align16(q), _int_spec(sq[0]),
               _int_spec(sq[1]), _int_spec(sq[2]), *tail_key)
        self._launch(key, self.attn, self.grid, args, lambda: dict(HAS_WINDOW=has_window, HAS_CAP=has_cap, NEW=new,
                                                                    **self.constants))
        if splits == 1:
            return o, (m if return_lse else None)
        out = torch.empty((bsz, tq, hq, d), dtype=odt, device=dev)
        lse = torch.empty((bsz, tq, hq), dtype=torch.float32, device=dev)
        self._launch(("merge", odt), self.merge, (bsz * tq * hq,), (o, m, l_part, out, lse, splits),
                     lambda: dict(D=d, BLOCK_S=next_pow2(splits), EMULATE=self.interpret, num_warps=4))
        return out, (lse if return_lse else None)

    def _launch(self, key, fn, grid, args, kwargs) -> None:
        """``fn[grid](*args, **kwargs())``. On CUDA, once a specialization ``key`` (what Triton specializes on among
        the arguments that change between calls: flags, the output's dtype, alignment and unit / 16-multiple
        strides of the query and tail; every other argument is fixed for this object, or a fresh allocation) has
        launched, later launches go straight to the compiled kernel's launcher (`Launch`), skipping
        ``JITFunction.run``'s argument binding and specialization on the host. The launches are shared by every
        `PagedAttention` of the same `spec` through `RUNNERS` (a step's first layer launches as fast as the rest);
        a call looks up its object's own by ``key`` alone (the spec is hashed once per key and object, not per
        launch)."""
        entry = self._runners.get(key)
        if entry is None:
            full = (self.spec, key)
            entry = RUNNERS.get(full)
            if entry is None:
                kw = kwargs()
                compiled = fn[grid](*args, **kw)
                if not self.interpret and hasattr(compiled, "run"):
                    if len(RUNNERS) > 256:
                        RUNNERS.clear()
                    constants = tuple(kw[name] for name in fn.arg_names[len(args):])
                    self._runners[key] = RUNNERS[full] = Launch(compiled, grid, constants, self.device.index)
                return
            self._runners[key] = entry
        entry(args)


#: `PagedAttention`'s compiled launches by (`PagedAttention.spec`, the call's specialization key)
RUNNERS: dict = {}


def _align16(x: torch.Tensor) -> bool:
    return x.data_ptr() % 16 == 0


def _check_tuning(tuning: Tuning) -> None:
    if not isinstance(tuning, Tuning):
        raise ValueError(f"paged_attention: tuning must be a Tuning, got {tuning!r}")
    pow2 = lambda v: isinstance(v, int) and v >= 1 and not v & (v - 1)  # noqa: E731
    if not (pow2(tuning.block_m) and tuning.block_m >= 16):
        raise ValueError(f"paged_attention: tuning.block_m={tuning.block_m!r} must be a power of two >= 16")
    if not (pow2(tuning.block_n) and tuning.block_n >= 16):
        raise ValueError(f"paged_attention: tuning.block_n={tuning.block_n!r} must be a power of two >= 16")
    for name in ("num_splits", "num_warps", "num_stages"):
        v = getattr(tuning, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"paged_attention: tuning.{name}={v!r} must be an int >= 1")


# ================================================================================================ bench helper
def bench_paged_attention(batch: int = 16, context: int = 32768, num_kv_heads: int = 8, group: int = 4,
                          head_dim: int = 128, page: int = 16, fmt: str = "mixed_bf16", tq: int = 1,
                          first_n: int = 4, last_n: int = 32, iters: int = 20, warmup: int = 3,
                          device: Optional[str] = None, tuning: Optional[Tuning] = None, seed: int = 0) -> dict:
    """Time `paged_attention` on random pools: ``batch`` rows of ``context`` tokens (pages shuffled), one layer.

    ``fmt``: ``"mixed_bf16"`` | ``"mixed_fp16"`` | ``"mixed_fp8"`` | ``"nvfp4"`` | ``"bf16"`` | ``"fp16"`` |
    ``"fp8"``. On CUDA the time is CUDA events around ``iters`` calls after ``warmup``; elsewhere wall time in the
    interpreter (small shapes only). Returns ``{"ms": per call, "tuning": the Tuning, "shape": {...}, "device"}``."""
    formats = ("mixed_bf16", "mixed_fp16", "mixed_fp8", "nvfp4", "bf16", "fp16", "fp8")
    if fmt not in formats:
        raise ValueError(f"bench_paged_attention: fmt={fmt!r} must be one of {formats}")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dtype = torch.float16 if fmt.endswith("fp16") else torch.bfloat16
    pages_per_seq = -(-context // page)
    num_pages = batch * pages_per_seq
    low = fmt.startswith("mixed") or fmt == "nvfp4"
    twin_dtype = {"mixed_bf16": torch.bfloat16, "mixed_fp16": torch.float16, "mixed_fp8": torch.uint8}.get(fmt)
    plain_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8}.get(fmt)

    def rand_bytes(shape, hi):
        return torch.randint(0, hi, shape, dtype=torch.uint8, generator=gen).to(dev)

    def rand_rows(shape, dt):
        if dt == torch.uint8:     # E4M3 bytes of magnitude < 8 (no NaN)
            return (torch.randint(0, 0x50, shape, dtype=torch.uint8, generator=gen)
                    | (torch.randint(0, 2, shape, dtype=torch.uint8, generator=gen) << 7)).to(dev)
        return torch.randn(shape, generator=gen).to(dt).to(dev)

    shape5 = (1, num_pages, 2, num_kv_heads, page)
    geom = (page, 0, 0, 0, 0)
    pools = dict(low_data=None, low_scales=None, low_gs=None, high_rows=None, high_scale=None, plain_rows=None,
                 plain_scale=None)
    high_table = None
    if low:
        pools.update(low_data=rand_bytes(shape5 + (head_dim // 2,), 256),
                     low_scales=rand_bytes(shape5 + (head_dim // 16,), 0x40) + 0x20,
                     low_gs=torch.full((1, 2), 0.01, dtype=torch.float32, device=dev))
    if twin_dtype is not None:
        ring = -(-(last_n + tq) // page) + 1 if last_n else 0
        fixed = -(-first_n // page)
        geom = (page, first_n, last_n, fixed, ring)
        width = fixed + ring
        pools.update(high_rows=rand_rows((1, batch * width, 2, num_kv_heads, page, head_dim), twin_dtype),
                     high_scale=torch.full((1, 2), 0.05, dtype=torch.float32, device=dev))
        high_table = torch.arange(batch * width, dtype=torch.int32).reshape(batch, width).to(dev)
    if plain_dtype is not None:
        pools.update(plain_rows=rand_rows(shape5 + (head_dim,), plain_dtype),
                     plain_scale=torch.full((1, 2), 0.05, dtype=torch.float32, device=dev))
    page_table = torch.randperm(num_pages, generator=gen).to(torch.int32).reshape(batch, pages_per_seq).to(dev)
    kv_lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    q = torch.randn((batch, tq, num_kv_heads * group, head_dim), generator=gen).to(dtype).to(dev)

    def call():
        return paged_attention(q, pools["low_data"], pools["low_scales"], pools["low_gs"], pools["high_rows"],
                               pools["high_scale"], pools["plain_rows"], pools["plain_scale"], 0, page_table,
                               high_table, kv_lens, geom, head_dim ** -0.5, tuning=tuning)

    for _ in range(max(warmup, 0)):
        call()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            call()
        stop.record()
        torch.cuda.synchronize(dev)
        ms = start.elapsed_time(stop) / iters
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            call()
        ms = (time.perf_counter() - t0) * 1e3 / iters
    used = tuning or choose_tuning(batch, num_kv_heads, tq * group, head_dim, pages_per_seq * page,
                                   cuda=dev.type == "cuda", sms=num_sms(dev), row_pool=fmt != "nvfp4")
    return {"ms": ms, "tuning": used._asdict(), "device": str(dev),
            "shape": dict(batch=batch, context=context, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
                          page=page, fmt=fmt, tq=tq)}
