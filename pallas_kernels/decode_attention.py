"""Fused paged decode attention over NVFP4 pages with in-kernel retained rows (Pallas Triton).

One kernel family, three page formats chosen statically by which pools are given:

* **mixed** (``low`` + ``high``): packed NVFP4 K/V (``data u8[L,P,kv,H,page,D/2]``, E4M3 block scales
  ``scales[L,P,kv,H,page,D/16]``, decode global scale ``gs f32[L,kv]``) dequantized in registers; the retained rows
  (``p < first_n`` or ``n - last_n <= p < n``) are read from the high twin ``rows[L,Ph,kv,H,page,D]`` (bf16 / fp16,
  or fp8 with ``scale f32[L,kv]``) instead.
* **low only** (``low``, no ``high``): plain NVFP4 cache.
* **plain** (``plain``): row pages in an attention dtype (or fp8 + scale), page ids from the low page table.

Grid: one program per ``(batch row, kv head, split)``. A program owns the query rows of its KV head
(``Tq * G`` rows, ``G = Hq // H``, padded to a power of two >= 16 for ``pl.dot``), so each K/V block is loaded and
dequantized once for the whole GQA group. It walks its share of the sequence's blocks of ``block_k`` tokens (page
ids gathered as a vector) with an online softmax. Splits (flash-decoding) divide the *actual* length of each
sequence evenly; their partial ``(o, m, l)`` are merged outside the kernel in jnp. Query token ``t`` of a sequence
of length ``n`` sits at position ``n - Tq + t`` (causal among the new tokens); optional sliding window, soft-cap.

Each program's block range is cut into three loops: head and tail *edge* blocks (those touching ``p < first_n``,
the last-N window, causal / sliding-window masks, or rows at or past ``n``) run the full step: twin overlay,
masks, rows ``>= n`` zeroed in V, so NaN-poisoned rows are never multiplied, whatever split the block falls in;
*interior* blocks run a step with no branch, no mask and no twin load, so the loop body is straight-line code that
Triton can software-pipeline (``num_stages``).

NVFP4 pages never interleave nibbles: the low nibbles of a row are its even columns, the high nibbles its odd
columns, and q / o are permuted to ``[even | odd]`` outside the kernel (``QK^T = q_e K_e^T + q_o K_o^T``;
``PV`` gives the even and odd output columns separately). Dequantization: the widened byte gives the f16 bit
pattern ``sign << 15 | magnitude << 9`` (= e2m1 value * 2^-14, exact) with 4 integer ops per element, one
f16 -> f32 convert, one multiply by the per-block factor ``f32(s) * (2^14 * gs)`` (a ``[tokens, D/16]`` tile
broadcast over 8 bytes), one cast to the attention dtype. This equals `jmixedkv.nvfp4.dequantize`'s
``(e2m1 * f32(s)) * gs`` except for a rare double rounding of ``s * gs`` (<= 1 f32 ulp before the cast).
``precise=True`` splits the probabilities into two attention-dtype halves for the P @ V product, so the output
error is dominated by the final rounding (``precise=False`` is ~1e-3 relative L2 from the rounded reference).

Entry: `paged_decode_attention` (raw arrays; used by `jmixedkv.attention.decode_attention` and the bench).
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from jmixedkv.compat import pl, pltriton, triton_params

__all__ = ["paged_decode_attention", "merge_partials", "default_num_splits", "NUM_SMS", "DEFAULT_BLOCK_K"]

NUM_SMS = 132          # H200
_M_INIT = -1e30        # finite running-max start: fully masked rows keep l == 0 and never produce NaN
_F16_BIAS = 16384.0    # f16 bits (m << 9) read as 2^-14 * e2m1 value
_dot = getattr(pltriton, "dot", None) or pl.dot
# tokens per inner step when block_k is None; with num_stages=3 the fastest on the H200 (2026-11-29,
# bench/decode_bench.py, 16 x 32k: NVFP4 k128/4 warps/3 stages 0.801-0.810 ms, plain bf16 k128/4/3 1.036 ms)
DEFAULT_BLOCK_K = {"nvfp4": 128, "plain": 128}


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def default_num_splits(batch: int, num_kv_heads: int, max_blocks: int) -> int:
    """Splits so that the grid has ~4 programs per SM, never more than the page blocks of the longest sequence."""
    programs = max(1, batch * num_kv_heads)
    want = max(1, -(-4 * NUM_SMS // programs))
    return int(max(1, min(_next_pow2(want), max_blocks, 64)))


# --------------------------------------------------------------------------------------------- in-kernel helpers
def _dequant_low(data_ref, scales_ref, gs, layer, ids, kvi, k_tok, d, dtype):
    """NVFP4 rows of pages ``ids`` -> ``(even, odd)`` columns, each ``[k_tok, d/2]`` in ``dtype``.

    No nibble interleave: byte ``c`` of a row holds elements ``2c`` (low nibble) and ``2c + 1`` (high nibble), so
    the low nibbles are the even columns and the high nibbles the odd ones; the caller permutes q / o to match.
    Per element: 4 integer ops on the widened byte (f16 bits ``sign << 15 | magnitude << 9`` = value * 2^-14),
    one f16 -> f32 convert, one multiply by the per-block factor ``f32(s) * 2^14 * gs`` (a ``[k_tok, d/16]`` tile
    broadcast over 8 columns), one cast to ``dtype``."""
    half, nblk = d // 2, d // 16
    # [tokens, scale blocks, 8 bytes]: the only reshapes act on the u8 input and the final dtype tile (if Triton
    # cannot make a reshape free it moves 1-2 bytes per element, never f32)
    b = data_ref[layer, ids, kvi].reshape(k_tok, nblk, 8).astype(jnp.uint16)
    sc = scales_ref[layer, ids, kvi].reshape(k_tok, nblk).astype(jnp.float32) * (gs * _F16_BIAS)
    sc = sc[:, :, None]
    u = lambda v: jnp.uint16(v)  # noqa: E731
    lo = ((b << u(12)) & u(0x8000)) | ((b << u(9)) & u(0x0E00))
    hi = ((b << u(8)) & u(0x8000)) | ((b << u(5)) & u(0x0E00))

    def scale(bits):
        e = lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)        # value * 2^-14, exact
        return (e * sc).astype(dtype).reshape(k_tok, half)
    return scale(lo), scale(hi)


def _load_rows(rows_ref, scale, layer, ids, kvi, k_tok, d, dtype, fp8: bool, parts: int):
    """Row-pool rows of pages ``ids`` -> ``parts`` column groups (1: ``[k_tok, d]``; 2: even / odd columns
    ``[k_tok, d/2]``, strided loads) in ``dtype`` (fp8: ``f32(e4m3) * scale``)."""
    out = []
    for p in range(parts):
        cols = slice(None) if parts == 1 else pl.ds(p, d // parts, stride=parts)
        x = rows_ref[layer, ids, kvi, :, cols].reshape(k_tok, d // parts)
        out.append((x.astype(jnp.float32) * scale).astype(dtype) if fp8 else x.astype(dtype))
    return tuple(out)


def _kernel(layer_ref, q_ref, pt_ref, len_ref, ht_ref, gs_ref, hs_ref, data_ref, scales_ref, high_ref, plain_ref,
            o_ref, m_ref, l_ref, *, page, nb, tq, group, kv_factor, first_n, last_n, nf, nr, ht_width, sm_scale,
            window, cap, num_splits, dtype, precise, high_fp8, plain_fp8, parts):
    s = pl.program_id(2)
    layer = layer_ref[0]
    n = len_ref[0]
    k_tok = nb * page
    qs = [q_ref[p] for p in range(parts)]                                   # parts x [M, D/parts]
    m_rows, dp = qs[0].shape
    d = dp * parts
    has_low, has_high = data_ref is not None, high_ref is not None

    rows = lax.broadcasted_iota(jnp.int32, (m_rows,), 0)
    qpos = n - tq + jnp.minimum(rows // group, tq - 1)                       # [M]
    n_blocks = (n + k_tok - 1) // k_tok
    lo_blk = 0 if window is None else jnp.maximum(n - tq - window + 1, 0) // k_tok
    per = (n_blocks - lo_blk + num_splits - 1) // num_splits
    start = lo_blk + s * per
    end = jnp.minimum(start + per, n_blocks)
    # "clean" blocks [i0, i1): every key visible to every query, no retained row, no row at or past n
    c_lo = first_n if has_high else 0
    if window is not None:
        c_lo = jnp.maximum(c_lo, n - window)
    c_hi = jnp.minimum(n - (last_n if has_high else 0), n - tq + 1)
    i0 = (jnp.maximum(c_lo, 0) + k_tok - 1) // k_tok
    i1 = jnp.maximum(c_hi, 0) // k_tok
    a = jnp.clip(i0, start, jnp.maximum(end, start))
    c = jnp.clip(i1, a, jnp.maximum(end, a))
    e = jnp.maximum(end, c)

    gs = [gs_ref[i] for i in range(kv_factor)] if has_low else None
    hs = [hs_ref[i] for i in range(kv_factor)] if (high_fp8 or plain_fp8) else [None] * kv_factor

    def load(kvi, ids):
        if has_low:
            return _dequant_low(data_ref, scales_ref, gs[kvi], layer, ids, kvi, k_tok, d, dtype)
        return _load_rows(plain_ref, hs[kvi], layer, ids, kvi, k_tok, d, dtype, plain_fp8, parts)

    def overlay(blk, kpos, kv):
        qpg = blk * nb + lax.broadcasted_iota(jnp.int32, (nb,), 0)
        col = jnp.where(qpg < nf, qpg, (nf + qpg % nr) if nr else -1)
        hid = ht_ref[jnp.clip(col, 0, ht_width - 1)]
        held = (col >= 0) & (hid >= 0)
        hid = jnp.maximum(hid, 0)
        held_row = jnp.broadcast_to(held[:, None], (nb, page)).reshape(k_tok)
        keep = (held_row & ((kpos < first_n) | ((kpos >= n - last_n) & (kpos < n))))[:, None]
        out = []
        for kvi, xs in enumerate(kv):
            hx = _load_rows(high_ref, hs[kvi], layer, hid, kvi, k_tok, d, dtype, high_fp8, parts)
            out.append(tuple(jnp.where(keep, h_, x_) for h_, x_ in zip(hx, xs)))
        return tuple(out)

    def step(blk, carry, edge):
        o, m, l = carry
        ids = jnp.maximum(pt_ref[pl.ds(blk * nb, nb)], 0)
        kpos = blk * k_tok + lax.broadcasted_iota(jnp.int32, (k_tok,), 0)
        kv = tuple(load(kvi, ids) for kvi in range(kv_factor))
        if edge and has_high:
            kv = overlay(blk, kpos, kv)
        ks, vs = kv[0], kv[-1]
        logits = _dot(qs[0], ks[0], trans_b=True)
        for p in range(1, parts):
            logits += _dot(qs[p], ks[p], trans_b=True)
        logits = logits * sm_scale                                          # [M, K] f32
        if cap is not None:
            logits = cap * jnp.tanh(logits / cap)
        if edge:
            mask = kpos[None, :] <= qpos[:, None]
            if window is not None:
                mask &= kpos[None, :] > qpos[:, None] - window
            logits = jnp.where(mask, logits, -jnp.inf)
            # rows at or past n may hold anything (NaN poison): zero them so that p == 0 never meets NaN
            vs = tuple(jnp.where((kpos < n)[:, None], v_, jnp.zeros((), dtype)) for v_ in vs)
        m_new = jnp.maximum(m, logits.max(axis=-1))
        alpha = jnp.exp(m - m_new)
        pr = jnp.exp(logits - m_new[:, None])
        l_new = alpha * l + pr.sum(axis=-1)
        p_hi = pr.astype(dtype)
        p_lo = (pr - p_hi.astype(jnp.float32)).astype(dtype) if precise else None
        o_new = []
        for p in range(parts):
            pv = _dot(p_hi, vs[p])
            if precise:
                pv += _dot(p_lo, vs[p])
            o_new.append(alpha[:, None] * o[p] + pv)
        return tuple(o_new), m_new, l_new

    edge_body = lambda i, carry: step(i, carry, True)    # noqa: E731
    clean_body = lambda i, carry: step(i, carry, False)  # noqa: E731
    init = (tuple(jnp.zeros((m_rows, dp), jnp.float32) for _ in range(parts)),
            jnp.full((m_rows,), _M_INIT, jnp.float32), jnp.zeros((m_rows,), jnp.float32))
    carry = lax.fori_loop(start, a, edge_body, init)          # head: first_n / window edge
    carry = lax.fori_loop(a, c, clean_body, carry)            # interior: no masks, no twin, pipelined loads
    o, m, l = lax.fori_loop(c, e, edge_body, carry)           # tail: last_n window, causal, rows past n
    for p in range(parts):
        o_ref[p] = o[p]
    m_ref[...] = m
    l_ref[...] = l


# --------------------------------------------------------------------------------------------------- wrapper
def merge_partials(o, m, l):
    """Merge split partials ``o f32[S,...,D]`` (unnormalized), ``m, l f32[S,...]`` -> ``(out f32[...,D], lse)``.

    Rows that saw no key give ``out = 0`` and ``lse = -inf``."""
    m_g = m.max(axis=0)
    w = jnp.exp(m - m_g[None])
    l_g = (w * l).sum(axis=0)
    o_g = (w[..., None] * o).sum(axis=0)
    ok = l_g > 0
    out = jnp.where(ok[..., None], o_g / jnp.where(ok, l_g, 1.0)[..., None], 0.0)
    lse = jnp.where(ok, m_g + jnp.log(jnp.where(ok, l_g, 1.0)), -jnp.inf)
    return out, lse


def _pad_cols(x, multiple, fill):
    pad = -x.shape[1] % multiple
    return jnp.pad(x, ((0, 0), (0, pad)), constant_values=fill) if pad else x


@functools.partial(jax.jit, static_argnames=(
    "first_n", "last_n", "num_fixed", "num_ring", "sm_scale", "sliding_window", "soft_cap", "num_splits",
    "block_k", "num_warps", "num_stages", "precise", "interpret", "out_dtype"))
def paged_decode_attention(q, page_table, kv_lens, layer=0, low=None, high=None, plain=None, high_table=None, *,
                           first_n: int = 0, last_n: int = 0, num_fixed: int = 0, num_ring: int = 0,
                           sm_scale: Optional[float] = None, sliding_window: Optional[int] = None,
                           soft_cap: Optional[float] = None, num_splits: Optional[int] = None,
                           block_k: Optional[int] = None,
                           num_warps: int = 4, num_stages: int = 3, precise: bool = True, interpret: bool = False,
                           out_dtype=None):
    """Paged decode / verify attention over raw pool arrays (one layer).

    Args:
      q: ``[B, Tq, Hq, D]`` queries in the attention dtype (bf16 / fp16); ``Hq % H == 0``.
      page_table: i32[B, max_pages] low (or plain) page id of each batch row's page ``j`` (-1 = none).
      kv_lens: i32[B] lengths ``n`` (0 for padding rows).
      layer: layer index into the pools' leading axis (int or traced i32).
      low: ``(data u8[L,P,kv,H,page,D/2], scales e4m3[L,P,kv,H,page,D/16], gs f32[L,kv])`` or an object with
        ``.data/.scales/.gs`` (`jmixedkv.pools.LowPool`); None for plain pages.
      high: ``(rows dtype[L,Ph,kv,H,page,D], scale f32[L,kv])`` or a `RowPool`: the retained twin (optional).
      plain: ``(rows, scale)`` or a `RowPool`: plain pages (exclusive with ``low``).
      high_table: i32[B, F + R] high page ids (needed with ``high``).
      first_n, last_n, num_fixed, num_ring: retained-set geometry (`KVCacheConfig`).
      num_splits: split-K programs per (row, head); None = `default_num_splits`.
      block_k: tokens per inner step (``max(1, block_k // page)`` pages, at least 16 tokens); None =
        `DEFAULT_BLOCK_K` of the format (128 for NVFP4 pages, 64 for plain row pages).
      num_warps, num_stages: Triton launch / software-pipelining depth of the interior loop.
      precise: P @ V with P split into two attention-dtype halves (output error ~ its final rounding).
      out_dtype: output dtype (default ``q.dtype``).

    Returns:
      ``(out [B, Tq, Hq, D] out_dtype, lse f32[B, Tq, Hq])``: natural-log LSE of the scaled (capped) logits;
      rows with no visible key give zeros and ``-inf``.
    """
    low = _as_tuple(low, ("data", "scales", "gs"))
    high = _as_tuple(high, ("rows", "scale"))
    plain = _as_tuple(plain, ("rows", "scale"))
    if (low is None) == (plain is None):
        raise ValueError("paged_decode_attention: pass exactly one of low= (NVFP4 pages) or plain= (row pages)")
    b, tq, hq, d = q.shape
    pool = low[0] if low is not None else plain[0]
    kv_factor, h, page = pool.shape[2], pool.shape[3], pool.shape[4]
    group = hq // h
    dtype = jnp.dtype(q.dtype)
    out_dtype = dtype if out_dtype is None else jnp.dtype(out_dtype)
    if block_k is None:
        block_k = DEFAULT_BLOCK_K["nvfp4" if low is not None else "plain"]
    if block_k < 1 or num_warps < 1 or num_stages < 1:
        raise ValueError(f"paged_decode_attention: block_k={block_k}, num_warps={num_warps}, "
                         f"num_stages={num_stages} must be >= 1")
    nb = max(1, block_k // page, -(-16 // page))
    k_tok = nb * page
    max_blocks = max(1, -(-page_table.shape[1] // nb))
    splits = default_num_splits(b, h, max_blocks) if num_splits is None else int(num_splits)
    m_rows = _next_pow2(max(16, tq * group))
    sm_scale = d ** -0.5 if sm_scale is None else float(sm_scale)
    parts = 2 if low is not None else 1          # NVFP4: even / odd columns (low / high nibbles) kept apart
    dp = d // parts

    qg = q.reshape(b, tq, h, group, d).transpose(0, 2, 1, 3, 4).reshape(b, h, tq * group, d)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, m_rows - tq * group), (0, 0)))
    qg = qg.reshape(b, h, m_rows, dp, parts).transpose(0, 1, 4, 2, 3)       # [B, H, parts, M, D/parts]
    pt = _pad_cols(jnp.asarray(page_table, jnp.int32), nb, 0)
    lens = jnp.asarray(kv_lens, jnp.int32)
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)
    use_high = high is not None and high_table is not None and high_table.shape[1] > 0
    ht = jnp.asarray(high_table, jnp.int32) if use_high else None
    ht_width = ht.shape[1] if use_high else 1
    high_fp8 = use_high and jnp.dtype(high[0].dtype) == jnp.dtype(jnp.float8_e4m3fn)
    plain_fp8 = plain is not None and jnp.dtype(plain[0].dtype) == jnp.dtype(jnp.float8_e4m3fn)
    gs_l = jnp.asarray(low[2], jnp.float32)[layer_arr[0]] if low is not None else None
    if high_fp8:
        hs_l = jnp.asarray(high[1], jnp.float32)[layer_arr[0]]
    elif plain_fp8:
        hs_l = jnp.asarray(plain[1], jnp.float32)[layer_arr[0]]
    else:
        hs_l = None

    def full(x, squeeze_head):
        nd = x.ndim
        shape = tuple(None if (squeeze_head and i == 3) else x.shape[i] for i in range(nd))
        return pl.BlockSpec(shape, lambda bi, hi, si: tuple(hi if (squeeze_head and i == 3) else 0
                                                             for i in range(nd)))

    vec = lambda x: pl.BlockSpec(x.shape, lambda bi, hi, si: (0,))  # noqa: E731
    in_specs = [
        vec(layer_arr),
        pl.BlockSpec((None, None, parts, m_rows, dp), lambda bi, hi, si: (bi, hi, 0, 0, 0)),
        pl.BlockSpec((None, pt.shape[1]), lambda bi, hi, si: (bi, 0)),
        pl.BlockSpec((1,), lambda bi, hi, si: (bi,)),
        pl.BlockSpec((None, ht_width), lambda bi, hi, si: (bi, 0)) if use_high else None,
        vec(gs_l) if gs_l is not None else None,
        vec(hs_l) if hs_l is not None else None,
        full(low[0], True) if low is not None else None,
        full(low[1], True) if low is not None else None,
        full(high[0], True) if use_high else None,
        full(plain[0], True) if plain is not None else None,
    ]
    args = [layer_arr, qg, pt, lens, ht, gs_l, hs_l,
            low[0] if low is not None else None, low[1] if low is not None else None,
            high[0] if use_high else None, plain[0] if plain is not None else None]
    kernel = functools.partial(
        _kernel, page=page, nb=nb, tq=tq, group=group, kv_factor=kv_factor, first_n=first_n, last_n=last_n,
        nf=num_fixed, nr=num_ring, ht_width=ht_width, sm_scale=sm_scale, window=sliding_window, cap=soft_cap,
        num_splits=splits, dtype=dtype, precise=precise, high_fp8=high_fp8, plain_fp8=plain_fp8, parts=parts)
    fmt = "mixed" if use_high else ("nvfp4" if low is not None else "plain")
    o, m, l = pl.pallas_call(
        kernel,
        grid=(b, h, splits),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, None, parts, m_rows, dp), lambda bi, hi, si: (si, bi, hi, 0, 0, 0)),
                   pl.BlockSpec((None, None, None, m_rows), lambda bi, hi, si: (si, bi, hi, 0)),
                   pl.BlockSpec((None, None, None, m_rows), lambda bi, hi, si: (si, bi, hi, 0))],
        out_shape=[jax.ShapeDtypeStruct((splits, b, h, parts, m_rows, dp), jnp.float32),
                   jax.ShapeDtypeStruct((splits, b, h, m_rows), jnp.float32),
                   jax.ShapeDtypeStruct((splits, b, h, m_rows), jnp.float32)],
        interpret=interpret,
        compiler_params=triton_params(num_warps=num_warps, num_stages=num_stages),
        name=f"decode_attention_{fmt}_k{k_tok}_m{m_rows}",
    )(*args)
    o = jnp.moveaxis(o, 3, -1).reshape(splits, b, h, m_rows, d)               # re-interleave the columns
    out, lse = merge_partials(o, m, l)                                        # [B, H, M, D], [B, H, M]
    out = out[:, :, :tq * group].reshape(b, h, tq, group, d).transpose(0, 2, 1, 3, 4).reshape(b, tq, hq, d)
    lse = lse[:, :, :tq * group].reshape(b, h, tq, group).transpose(0, 2, 1, 3).reshape(b, tq, hq)
    return out.astype(out_dtype), lse


def _as_tuple(pool, fields):
    if pool is None or isinstance(pool, (tuple, list)):
        return None if pool is None else tuple(pool)
    return tuple(getattr(pool, f) for f in fields)
