"""Fused paged decode attention over NVFP4 pages with in-kernel retained rows: the Pallas Triton backend.

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

Column groups (`TritonConfig.col_groups`; NVFP4 K / V pages with ``Tq * G <= 8`` real rows of the 16): the padding
rows of the MMA hold replicas of the real query rows, and replica ``j`` accumulates only V's column group ``j`` (its P
rows masked to zero for the other groups), so the f32 output accumulator shrinks by ``col_groups`` at the same MMA
work; the wrapper reassembles the columns and takes ``m`` / ``l`` from replica 0 (all replicas compute identical
logits).

NVFP4 pages never interleave nibbles: the low nibbles of a row are its even columns, the high nibbles its odd
columns (``QK^T = q_e K_e^T + q_o K_o^T``; ``PV`` gives the even and odd output columns separately). A program
reads q's even / odd parts with strided loads and stores the two output parts interleaved, strided (keys-major
programs take q split in parts by the wrapper; it re-interleaves their output tiles and those of column groups).
Dequantization: the widened byte gives the f16 bit pattern ``sign << 15 | magnitude << 9`` (= e2m1 value * 2^-14,
exact) with 4 integer ops per element, one f16 -> f32 convert, one multiply by the per-block factor
``f32(s) * (2^14 * gs)`` (a ``[tokens, D/16]`` tile broadcast over 8 bytes), one cast to the attention dtype. This
equals `jmixedkv.nvfp4.dequantize_reference`'s ``(e2m1 * f32(s)) * gs`` except for a rare double rounding of
``s * gs`` (<= 1 f32 ulp before the cast).
`TritonConfig.precise` splits the probabilities into two attention-dtype halves for the P @ V product, so the output
error is dominated by the final rounding (``precise=False`` is ~1e-3 relative L2 from the rounded reference).

Entries (raw arrays, one `TritonConfig`): `paged_decode_attention` (merged output and LSE) and
`paged_decode_partials` (the split partials; with ``skip_interior`` the edge blocks only, for the Mosaic GPU
backend, `pallas_kernels.decode.mosaic_sm90`). The public entry point is `pallas_kernels.decode.paged_decode_attention`.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from jmixedkv.compat import pl, pltriton, triton_params
from jmixedkv.layout import TwinGeometry, check_offsets
from pallas_kernels.decode.common import (LOW_DOMAIN, M_INIT, f16_queries, group_queries, interior_blocks,
                                          merge_partials, next_pow2, pages_per_block, ungroup_rows)
from pallas_kernels.decode.config import TritonConfig, triton_num_splits, triton_tuning, tuning_heads
from pallas_kernels.nvfp4_ops import E2M1_F16_PTX, e2m1_f16_halves

__all__ = ["paged_decode_attention", "paged_decode_partials", "split_row_loads"]

_dot = getattr(pltriton, "dot", None) or pl.dot


# --------------------------------------------------------------------------------------------- in-kernel helpers
def _dequant_low(data_ref, scales_ref, layer, ids, kvi, k_tok, d, use_asm: bool, group: int = 0, groups: int = 1):
    """NVFP4 rows of pages ``ids`` -> ``(even, odd)`` columns, each f16 ``[k_tok, d/2/groups]``, in the *low domain*
    ``x / (gs * 2^7)`` (``gs`` is applied by the caller: folded into the logit scale for K and the output scale
    for V). With ``groups > 1`` only the bytes ``[group * w, (group + 1) * w)`` of each row (``w = d/2/groups``,
    whole scale blocks) are read: column group ``group`` of the even and the odd half.

    No nibble interleave: byte ``c`` of a row holds elements ``2c`` (low nibble) and ``2c + 1`` (high nibble), so
    the low nibbles are the even columns and the high nibbles the odd ones; the caller permutes q / o to match.
    Value of an element: ``(e2m1 * 2^-14) * (f16(s) * 2^7)`` in f16 = ``e2m1 * s * 2^-7`` **exactly** (<= 6
    significant bits, magnitude in [2^-17, 21]; f16 keeps subnormals), so this path adds no rounding at all
    before the f16 x f16 -> f32 dot. ``use_asm``: the packed inline-PTX form (GPU); otherwise the same arithmetic in
    jnp (interpret mode)."""
    w = d // 2 // groups
    nblk = w // 8
    cols = slice(None) if groups == 1 else pl.ds(group * w, w)
    scols = slice(None) if groups == 1 else pl.ds(group * nblk, nblk)
    b = data_ref[layer, ids, kvi, :, cols].reshape(k_tok, nblk, 8)                    # u8
    sc = scales_ref[layer, ids, kvi, :, scols].reshape(k_tok, nblk).astype(jnp.float16) * jnp.float16(LOW_DOMAIN)
    sc = jnp.broadcast_to(sc[:, :, None], (k_tok, nblk, 8))
    if use_asm:
        out = [jax.ShapeDtypeStruct(b.shape, jnp.float16)]
        lo, hi = (pltriton.elementwise_inline_asm(E2M1_F16_PTX[half_], args=[b, sc], constraints="=r,=r,r,r,r",
                                                  pack=4, result_shape_dtypes=out)[0] for half_ in ("lo", "hi"))
    else:
        lo, hi = (x * sc for x in e2m1_f16_halves(b))
    return lo.reshape(k_tok, w), hi.reshape(k_tok, w)


def _load_rows(rows_ref, scale, layer, ids, kvi, k_tok, d, dtype, fp8: bool, parts: int, groups: int = 1,
               split: bool = False):
    """Row-pool rows of pages ``ids`` -> ``parts`` x ``groups`` column tiles (parts 1: columns in order; parts 2:
    even / odd columns; ``groups`` consecutive column groups of each) ``[k_tok, d/parts/groups]`` in ``dtype``
    (fp8: ``f32(e4m3) * scale``). Parts 2: two loads at stride 2, or with ``split`` one contiguous load per group
    split into even / odd in registers (``unstack`` of the trailing pair: Triton's ``split``); same values."""
    w = d // parts // groups
    out = [[] for _ in range(parts)]
    for j in range(groups):
        if parts == 2 and split:
            x = rows_ref[layer, ids, kvi, :, slice(None) if groups == 1 else pl.ds(2 * j * w, 2 * w)]
            halves = jnp.unstack(x.reshape(k_tok, w, 2), axis=-1)
        else:
            halves = [rows_ref[layer, ids, kvi, :, slice(None) if parts == groups == 1 else
                               pl.ds(j * w, w) if parts == 1 else pl.ds(2 * j * w + p, w, stride=2)].reshape(k_tok, w)
                      for p in range(parts)]
        for p in range(parts):
            x = halves[p]
            out[p].append((x.astype(jnp.float32) * scale).astype(dtype) if fp8 else x.astype(dtype))
    return tuple(tuple(t) for t in out)


def split_row_loads(skip_interior: bool, k_tok: int) -> bool:
    """Whether the kernel reads row-pool (twin) tiles with one contiguous load split in registers (`_load_rows`'
    ``split``) rather than two loads at stride 2: only in the edge-only kernel (``skip_interior``) with steps of at
    least 32 tokens, where the H200 measured it faster; slower with 16-token steps and in the whole Triton kernel
    (bench/RESULTS.md)."""
    return skip_interior and k_tok >= 32


def _kernel(layer_ref, q_ref, qlow_ref, rowmul_ref, pt_ref, len_ref, ht_ref, lowmul_ref, hs_ref, data_ref,
            scales_ref, high_ref, plain_ref, o_ref, m_ref, l_ref, *, page, nb, tq, group, kv_factor, geom,
            ht_width, sm_scale, window, cap, num_splits, dtype, precise, high_fp8, plain_fp8, parts,
            use_asm, keys_major, v_late=False, groups=1, rep=1, skip_interior=False, interior_tokens=None,
            split_loads=False):
    s = pl.program_id(2)
    layer = layer_ref[0]
    n = len_ref[0]
    k_tok = nb * page
    has_low, has_high = data_ref is not None, high_ref is not None
    q_any = q_ref if q_ref is not None else qlow_ref
    natural_q = q_any.ndim == 2          # q tiles [M, D] in natural column order: part p read by a strided load

    def q_parts(ref):
        if natural_q:
            return [ref[:, pl.ds(p, ref.shape[1] // parts, stride=parts)] for p in range(parts)]
        return [ref[p] for p in range(parts)]
    qs = q_parts(q_ref) if q_ref is not None else None                                # attention dtype
    m_rows, dp = (q_any.shape[0], q_any.shape[1] // parts) if natural_q else q_any.shape[-2:]
    if keys_major:      # q / o tiles are [D/parts, M]; scores are [keys, M]
        dp, m_rows = m_rows, dp
    qv = (lambda x: x[None, :]) if keys_major else (lambda x: x[:, None])    # noqa: E731  per-query vector
    kvec = (lambda x: x[:, None]) if keys_major else (lambda x: x[None, :])  # noqa: E731  per-key vector
    kax = 0 if keys_major else 1                                             # the keys axis of the scores
    d = dp * parts

    rows = lax.broadcasted_iota(jnp.int32, (m_rows,), 0)
    qpos = n - tq + jnp.minimum((rows % rep) // group, tq - 1)               # [M]
    replica = rows // rep                     # column groups: replica j of the query rows owns V's column group j
    n_blocks = (n + k_tok - 1) // k_tok
    lo_blk = 0 if window is None else jnp.maximum(n - tq - window + 1, 0) // k_tok
    per = (n_blocks - lo_blk + num_splits - 1) // num_splits
    start = lo_blk + s * per
    end = jnp.minimum(start + per, n_blocks)
    it = k_tok if interior_tokens is None else interior_tokens     # the interior's block (a multiple of k_tok)
    i0, i1 = (x * (it // k_tok) for x in interior_blocks(n, it, tq, geom if has_high else None, window))
    a = jnp.clip(i0, start, jnp.maximum(end, start))
    c = jnp.clip(i1, a, jnp.maximum(end, a))
    e = jnp.maximum(end, c)

    hs = [hs_ref[i] for i in range(kv_factor)] if (high_fp8 or plain_fp8) else [None] * kv_factor
    twin_dtype = jnp.float16 if high_fp8 else dtype
    if has_low:
        qlow = q_parts(qlow_ref)                                              # f16, rows scaled by powers of 2
        rowmul = rowmul_ref[...]                                              # [M]: sm_scale * gs_k * 2^7 / 2^e
        vmul = lowmul_ref[kv_factor - 1]                                      # gs_v * 2^7 (output scale)
        inv_v = 1.0 / vmul

    def load(kvi, ids, g=1):
        """K / V tiles of pages ``ids``: ``parts`` x ``g`` column tiles (``g`` column groups, V only)."""
        if has_low:
            tiles = [_dequant_low(data_ref, scales_ref, layer, ids, kvi, k_tok, d, use_asm, j, g) for j in range(g)]
            return tuple(tuple(t[p] for t in tiles) for p in range(parts))
        return _load_rows(plain_ref, hs[kvi], layer, ids, kvi, k_tok, d, dtype, plain_fp8, parts)   # parts 1

    def retained(blk, kpos, kvis=None):
        """(keep bool[k_tok], twin rows per K/V: parts x groups x [k_tok, D/parts/groups] in ``twin_dtype`` (V in
        its column groups, K whole), zero where not kept or at / past ``n``)."""
        qpg = blk * nb + lax.broadcasted_iota(jnp.int32, (nb,), 0)
        col = geom.page_column(qpg)
        hid = ht_ref[jnp.clip(col, 0, ht_width - 1)]
        held = (col >= 0) & (hid >= 0)
        hid = jnp.maximum(hid, 0)
        held_row = jnp.broadcast_to(held[:, None], (nb, page)).reshape(k_tok)
        keep = held_row & geom.is_retained(kpos, n)
        zero = jnp.zeros((), twin_dtype)
        # FP8 twin rows enter the dot as their exact e4m3 values in f16 (the scale goes to the f32 side)
        rows_ = tuple(tuple(tuple(jnp.where(keep[:, None], h_, zero) for h_ in tiles) for tiles in
                            _load_rows(high_ref, None, layer, hid, kvi, k_tok, d, twin_dtype, False, parts,
                                       groups if kvi == 1 else 1, split_loads))
                      for kvi in (range(kv_factor) if kvis is None else kvis))
        return keep, rows_

    def qk(qparts, kparts):
        """Scores: ``[M, K] = sum_p q_p k_p^T`` or, keys-major, ``[K, M] = sum_p k_p q_p`` (q tiles ``[D/p, M]``)."""
        out = None
        for q_, k_ in zip(qparts, kparts):
            t = _dot(k_, q_) if keys_major else _dot(q_, k_, trans_b=True)
            out = t if out is None else out + t
        return out

    def pv1(pr, v_):
        return _dot(v_.T, pr) if keys_major else _dot(pr, v_)

    def pv(pr, vs, mma_dtype, split):
        """``P @ V`` per part; with column groups, group ``j``'s tile meets only the rows of replica ``j``."""
        p_hi = pr.astype(mma_dtype)
        ps = (p_hi, (pr - p_hi.astype(jnp.float32)).astype(mma_dtype)) if split else (p_hi,)
        n_groups = len(vs[0])
        zero = jnp.zeros((), mma_dtype)
        # P of each column group (its replica's rows only), built once and shared by the parts
        pg = [ps] if n_groups == 1 else [[jnp.where(qv(replica == j), p_, zero) for p_ in ps] for j in range(n_groups)]
        out = []
        for tiles in vs:
            acc = None
            for v_, pj in zip(tiles, pg):
                for p_ in pj:
                    t = pv1(p_, v_)
                    acc = t if acc is None else acc + t
            out.append(acc)
        return out

    def step(blk, carry, edge):
        o, m, l = carry
        ids = jnp.maximum(pt_ref[pl.ds(blk * nb, nb)], 0)
        kpos = blk * k_tok + lax.broadcasted_iota(jnp.int32, (k_tok,), 0)
        ks = [t[0] for t in load(0, ids)]
        # v_late: V is read and dequantized after the softmax (K's dequantized tile is dead by then: fewer live
        # registers per program); otherwise both at the top of the step
        vs = load(kv_factor - 1, ids, groups) if (kv_factor == 1 or not v_late) else None
        if has_low:
            logits = qk(qlow, ks) * qv(rowmul)                               # [M, K] (or [K, M]) f32
        else:
            logits = qk(qs, ks) * sm_scale
        keep = None
        if edge and has_high:
            # retained rows: a second dot in the attention dtype on the exact twin rows (no domain change)
            keep, twin = retained(blk, kpos, (0,) if (v_late and kv_factor == 2) else None)
            twin_k = [t[0] for t in twin[0]]
            if high_fp8:
                twin_logits = qk(qlow, twin_k) * qv(rowmul * (hs[0] / lowmul_ref[0]))
            else:
                twin_logits = qk(qs, twin_k) * sm_scale
            logits = jnp.where(kvec(keep), twin_logits, logits)
        if cap is not None:
            logits = cap * jnp.tanh(logits / cap)
        if edge:
            mask = kvec(kpos) <= qv(qpos)
            if window is not None:
                mask &= kvec(kpos) > qv(qpos) - window
            logits = jnp.where(mask, logits, -jnp.inf)
        m_new = jnp.maximum(m, logits.max(axis=kax))
        alpha = jnp.exp(m - m_new)
        pr = jnp.exp(logits - qv(m_new))
        l_new = alpha * l + pr.sum(axis=kax)
        if vs is None:
            vs = load(kv_factor - 1, ids, groups)
        if edge:
            # rows at or past n may hold anything (NaN poison): zero them so that p == 0 never meets NaN
            zero = jnp.zeros((), vs[0][0].dtype)
            vs = tuple(tuple(jnp.where((kpos < n)[:, None], v_, zero) for v_ in tiles) for tiles in vs)
        if has_low:
            p_low = pr if keep is None else jnp.where(kvec(keep), 0.0, pr)
            acc = pv(p_low, vs, jnp.float16, precise)                         # low domain (x / (gs_v 2^7))
            if keep is not None:
                twin_vr = retained(blk, kpos, (1,))[1][0] if (v_late and kv_factor == 2) else twin[-1]
                twin_v = pv(jnp.where(kvec(keep), pr, 0.0), twin_vr, twin_dtype, True)
                t_mul = hs[-1] * inv_v if high_fp8 else inv_v
                acc = [a_ + t_ * t_mul for a_, t_ in zip(acc, twin_v)]
        else:
            acc = pv(pr, vs, dtype, precise)
        o_new = tuple(qv(alpha) * o_ + a_ for o_, a_ in zip(o, acc))
        return o_new, m_new, l_new

    edge_body = lambda i, carry: step(i, carry, True)    # noqa: E731
    clean_body = lambda i, carry: step(i, carry, False)  # noqa: E731
    init = (tuple(jnp.zeros((dp, m_rows) if keys_major else (m_rows, dp // groups), jnp.float32) for _ in range(parts)),
            jnp.full((m_rows,), M_INIT, jnp.float32), jnp.zeros((m_rows,), jnp.float32))
    carry = lax.fori_loop(start, a, edge_body, init)          # head: first_n / window edge
    if not skip_interior:     # (skipped: another kernel attends the interior, `mosaic_sm90`)
        carry = lax.fori_loop(a, c, clean_body, carry)        # interior: no masks, no twin, pipelined loads
    o, m, l = lax.fori_loop(c, e, edge_body, carry)           # tail: last_n window, causal, rows past n
    for p in range(parts):
        o_p = o[p] * vmul if has_low else o[p]
        if o_ref.ndim == 2:     # interleaved output [M, D]: part p is the columns p, p + parts, ... (no XLA transpose)
            o_ref[:, pl.ds(p, dp, stride=parts)] = o_p
        else:
            o_ref[p] = o_p
    m_ref[...] = m
    l_ref[...] = l

# --------------------------------------------------------------------------------------------------- wrapper
def _pad_cols(x, multiple, fill):
    pad = -x.shape[1] % multiple
    return jnp.pad(x, ((0, 0), (0, pad)), constant_values=fill) if pad else x


def _partials(q, page_table, kv_lens, layer, low, high, plain, high_table, *, geom, sm_scale, sliding_window,
              soft_cap, interpret, out_dtype, config: TritonConfig, skip_interior: bool, interior_tokens):
    """The kernel call: ``(o f32[S, B, H, R, D], m, l f32[S, B, H, R])`` (see `paged_decode_partials`)."""
    config = TritonConfig() if config is None else config
    low, high, plain = (None if x is None else tuple(x) for x in (low, high, plain))
    if (low is None) == (plain is None):
        raise ValueError("paged_decode_attention: pass exactly one of low= (NVFP4 pages) or plain= (row pages)")
    b, tq, hq, d = q.shape
    pool = low[0] if low is not None else plain[0]
    kv_factor, h, page = pool.shape[2], pool.shape[3], pool.shape[4]
    group = hq // h
    dtype = jnp.dtype(q.dtype)
    out_dtype = dtype if out_dtype is None else jnp.dtype(out_dtype)
    fmt_key = "nvfp4" if low is not None else "plain"
    m_rows = next_pow2(max(16, tq * group))
    hs = tuning_heads(config, h)
    tuned_k, tuned_w, per_sm = triton_tuning(fmt_key, b, hs, page, m_rows, tq * group, d)
    block_k = tuned_k if config.block_k is None else config.block_k
    num_warps = tuned_w if config.num_warps is None else config.num_warps
    num_stages, keys_major = config.num_stages, config.keys_major
    v_late = low is not None if config.v_late is None else config.v_late
    nb = pages_per_block(block_k, page)
    k_tok = nb * page
    if interior_tokens is not None and (not skip_interior or interior_tokens % k_tok):
        raise ValueError(f"paged_decode_attention: interior_tokens={interior_tokens} needs skip_interior=True and a "
                         f"multiple of the block ({k_tok} tokens)")
    max_blocks = max(1, -(-page_table.shape[1] // nb))
    splits = triton_num_splits(b, hs, max_blocks, per_sm) if config.num_splits is None else int(config.num_splits)
    sm_scale = d ** -0.5 if sm_scale is None else float(sm_scale)
    parts = 2 if low is not None else 1          # NVFP4: even / odd columns (low / high nibbles) kept apart
    dp = d // parts
    rep = next_pow2(tq * group)                  # query rows of one replica (column groups)
    fit = 1 if (low is None or keys_major or kv_factor != 2) else max(1, min(m_rows // rep, dp // 16))
    col_groups = config.col_groups
    if col_groups is None:       # measured faster only with one-warp programs of 32-token steps and >= 1024 tokens
        long_splits = max_blocks * k_tok >= 1024 * splits                  # per split (bench/RESULTS.md)
        col_groups = fit if (k_tok == 32 and num_warps == 1 and long_splits) else 1
    col_groups = int(col_groups)
    if col_groups > fit:
        raise ValueError(f"paged_decode_attention: col_groups={col_groups} must be a power of two <= {fit} here "
                         f"(Tq * G = {tq * group} of {m_rows} rows, head_dim {d}, keys_major={keys_major})")
    rep = rep if col_groups > 1 else m_rows

    precise = config.precise
    if precise is None:       # f16 P (NVFP4 pages) is fine for 16-bit outputs; bf16 P (plain bf16 pages) is not
        precise = out_dtype == jnp.dtype(jnp.float32) or (low is None and dtype == jnp.dtype(jnp.bfloat16))
    dequant = ("jnp" if interpret else "asm") if config.dequant is None else config.dequant
    if dequant == "asm" and interpret:
        raise ValueError("paged_decode_attention: dequant='asm' (inline PTX) needs the compiled kernel; "
                         "interpret mode runs 'jnp'")

    qg = jnp.pad(group_queries(q, h), ((0, 0), (0, 0), (0, rep - tq * group), (0, 0)))   # [B, H, rep, D]
    qg = jnp.tile(qg, (1, 1, col_groups, 1))                                 # column-group replicas
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, m_rows - qg.shape[2]), (0, 0)))   # [B, H, M, D]
    # keys-major programs take q split in parts, ``[B, H, parts, D/p, M]``; the others take ``[B, H, M, D]`` as is
    # and read each part with a strided load (no XLA split of q: less XLA time per call)
    split = ((lambda x: x.reshape(b, h, m_rows, dp, parts).transpose(0, 1, 4, 3, 2)) if keys_major  # noqa: E731
             else (lambda x: x))
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)
    qlow = rowmul = lowmul = None
    if low is not None:
        # the low-page dot runs in f16: each query row is scaled by a power of two 2^-e into [2^7, 2^8) (exact),
        # and 2^e, sm_scale and the low domain's gs_k * 2^7 are applied to its f32 logits
        gs_l = jnp.asarray(low[2], jnp.float32)[layer_arr[0]]                 # [kv]
        lowmul = gs_l * LOW_DOMAIN
        q16, shift = f16_queries(qg.astype(jnp.float32))                       # shift [B, H, M]
        qlow = split(q16)
        rowmul = jnp.ldexp(jnp.float32(sm_scale) * lowmul[0], -shift)         # [B, H, M]
    use_high = high is not None and high_table is not None and high_table.shape[1] > 0
    if use_high and (geom is None or geom.page != page):
        raise ValueError(f"paged_decode_attention: high= needs geom= with page={page} (the twin's TwinGeometry), "
                         f"got {geom}")
    high_fp8 = use_high and jnp.dtype(high[0].dtype) == jnp.dtype(jnp.float8_e4m3fn)
    qg = split(qg) if (low is None or (use_high and not high_fp8)) else None    # attention-dtype dots
    pt = _pad_cols(jnp.asarray(page_table, jnp.int32), nb, 0)
    lens = jnp.asarray(kv_lens, jnp.int32)
    ht = jnp.asarray(high_table, jnp.int32) if use_high else None
    ht_width = ht.shape[1] if use_high else 1
    plain_fp8 = plain is not None and jnp.dtype(plain[0].dtype) == jnp.dtype(jnp.float8_e4m3fn)
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
    qtile = (dp, m_rows) if keys_major else (m_rows, dp)
    otile = (m_rows, dp // col_groups) if col_groups > 1 else qtile
    # one program's output written in natural column order, ``[M, D]`` (the parts interleaved by strided stores),
    # where no replica / transposed tile needs the XLA re-interleave below (one XLA transpose per call fewer)
    interleaved = col_groups == 1 and not keys_major
    o_block = (None, None, None) + ((m_rows, d) if interleaved else (parts,) + otile)
    o_index = (lambda bi, hi, si: (si, bi, hi, 0, 0)) if interleaved else (lambda bi, hi, si: (si, bi, hi, 0, 0, 0))
    qspec = (pl.BlockSpec((None, None, parts) + qtile, lambda bi, hi, si: (bi, hi, 0, 0, 0)) if keys_major else
             pl.BlockSpec((None, None, m_rows, d), lambda bi, hi, si: (bi, hi, 0, 0)))
    in_specs = [
        vec(layer_arr),
        qspec if qg is not None else None,
        qspec if qlow is not None else None,
        pl.BlockSpec((None, None, m_rows), lambda bi, hi, si: (bi, hi, 0)) if rowmul is not None else None,
        pl.BlockSpec((None, pt.shape[1]), lambda bi, hi, si: (bi, 0)),
        pl.BlockSpec((1,), lambda bi, hi, si: (bi,)),
        pl.BlockSpec((None, ht_width), lambda bi, hi, si: (bi, 0)) if use_high else None,
        vec(lowmul) if lowmul is not None else None,
        vec(hs_l) if hs_l is not None else None,
        full(low[0], True) if low is not None else None,
        full(low[1], True) if low is not None else None,
        full(high[0], True) if use_high else None,
        full(plain[0], True) if plain is not None else None,
    ]
    args = [layer_arr, qg, qlow, rowmul, pt, lens, ht, lowmul, hs_l,
            low[0] if low is not None else None, low[1] if low is not None else None,
            high[0] if use_high else None, plain[0] if plain is not None else None]
    kernel = functools.partial(
        _kernel, page=page, nb=nb, tq=tq, group=group, kv_factor=kv_factor, geom=geom,
        ht_width=ht_width, sm_scale=sm_scale, window=sliding_window, cap=soft_cap,
        num_splits=splits, dtype=dtype, precise=precise, high_fp8=high_fp8, plain_fp8=plain_fp8, parts=parts,
        use_asm=dequant == "asm", keys_major=keys_major, v_late=v_late, groups=col_groups, rep=rep,
        skip_interior=skip_interior, interior_tokens=interior_tokens,
        split_loads=split_row_loads(skip_interior, k_tok))
    fmt = "mixed" if use_high else ("nvfp4" if low is not None else "plain")
    check_offsets("decode_attention", **{f"pool operand {i}": a for i, a in enumerate(args[9:])})
    o, m, l = pl.pallas_call(
        kernel,
        grid=(b, h, splits),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec(o_block, o_index),
                   pl.BlockSpec((None, None, None, m_rows), lambda bi, hi, si: (si, bi, hi, 0)),
                   pl.BlockSpec((None, None, None, m_rows), lambda bi, hi, si: (si, bi, hi, 0))],
        out_shape=[jax.ShapeDtypeStruct((splits, b, h) + o_block[3:], jnp.float32),
                   jax.ShapeDtypeStruct((splits, b, h, m_rows), jnp.float32),
                   jax.ShapeDtypeStruct((splits, b, h, m_rows), jnp.float32)],
        interpret=interpret,
        compiler_params=triton_params(num_warps=num_warps, num_stages=num_stages),
        name=f"decode_attention_{fmt}_k{k_tok}_m{m_rows}_g{col_groups}",
    )(*args)
    if interleaved:
        o = o[:, :, :, :rep]                                                  # [S, B, H, rep, D]
    else:
        if keys_major:
            o = jnp.swapaxes(o, -1, -2)                                       # [S, B, H, parts, M, D/parts]
        # rows (replica j, query row i) of column group j -> [S, B, H, rep, groups, D/parts/groups, parts]
        o = o[:, :, :, :, :col_groups * rep].reshape(splits, b, h, parts, col_groups, rep, dp // col_groups)
        o = o.transpose(0, 1, 2, 5, 4, 6, 3).reshape(splits, b, h, rep, d)    # re-interleave the columns
    return o, m[..., :rep], l[..., :rep]


_STATIC = ("geom", "sm_scale", "sliding_window", "soft_cap", "interpret", "out_dtype", "config")


@functools.partial(jax.jit, static_argnames=_STATIC)
def paged_decode_attention(q, page_table, kv_lens, layer=0, low=None, high=None, plain=None, high_table=None, *,
                           geom: Optional[TwinGeometry] = None, sm_scale: Optional[float] = None,
                           sliding_window: Optional[int] = None, soft_cap: Optional[float] = None,
                           interpret: bool = False, out_dtype=None, config: Optional[TritonConfig] = None):
    """Paged decode / verify attention over raw pool arrays (one layer), Pallas Triton kernel.

    Args:
      q: ``[B, Tq, Hq, D]`` queries in the attention dtype (bf16 / fp16); ``Hq % H == 0``.
      page_table: i32[B, max_pages] low (or plain) page id of each batch row's page ``j`` (-1 = none).
      kv_lens: i32[B] lengths ``n`` (0 for padding rows).
      layer: layer index into the pools' leading axis (int or traced i32).
      low: ``(data u8[L,P,kv,H,page,D/2], scales e4m3[L,P,kv,H,page,D/16], gs f32[L,kv])``; None for plain
        pages (`jmixedkv.pools.kernel_arrays` of a `LowPool`).
      high: ``(rows dtype[L,Ph,kv,H,page,D], scale f32[L,kv])``: the retained twin (optional).
      plain: ``(rows, scale)``: plain pages (exclusive with ``low``).
      high_table: i32[B, F + R] high page ids (needed with ``high``).
      geom: the twin's static `jmixedkv.layout.TwinGeometry` (`KVCacheConfig.twin`; needed with ``high``).
      sliding_window, soft_cap: optional attention options (a query at ``i`` sees ``i - window < p <= i``;
        logits ``c * tanh(logits / c)``).
      out_dtype: output dtype (default ``q.dtype``).
      config: the `TritonConfig` (None: every default).

    Returns:
      ``(out [B, Tq, Hq, D] out_dtype, lse f32[B, Tq, Hq])``: natural-log LSE of the scaled (capped) logits;
      rows with no visible key give zeros and ``-inf``.
    """
    o, m, l = _partials(q, page_table, kv_lens, layer, low, high, plain, high_table, geom=geom, sm_scale=sm_scale,
                        sliding_window=sliding_window, soft_cap=soft_cap, interpret=interpret,
                        out_dtype=out_dtype, config=config, skip_interior=False, interior_tokens=None)
    pool = low[0] if low is not None else plain[0]
    tq, group = q.shape[1], q.shape[2] // pool.shape[3]
    out, lse = ungroup_rows(*merge_partials(o, m, l), tq, group)
    return out.astype(q.dtype if out_dtype is None else jnp.dtype(out_dtype)), lse


@functools.partial(jax.jit, static_argnames=_STATIC + ("skip_interior", "interior_tokens"))
def paged_decode_partials(q, page_table, kv_lens, layer=0, low=None, high=None, plain=None, high_table=None, *,
                          geom: Optional[TwinGeometry] = None, sm_scale: Optional[float] = None,
                          sliding_window: Optional[int] = None, soft_cap: Optional[float] = None,
                          interpret: bool = False, out_dtype=None, config: Optional[TritonConfig] = None,
                          skip_interior: bool = False, interior_tokens: Optional[int] = None):
    """`paged_decode_attention`'s split partials before the merge: ``(o f32[S, B, H, R, D], m, l f32[S, B, H,
    R])``, unnormalized, natural-log ``m``, rows ``t * G + g`` of each KV head (``R >= Tq * G``).

    ``skip_interior``: attend only the *edge* blocks of each sequence (those before and after `interior_blocks`'
    range; each split skips its part of that range, so over all splits exactly that range is skipped), for a caller
    that attends the interior with another kernel and merges (`pallas_kernels.decode.mosaic_sm90`).
    ``interior_tokens``: with ``skip_interior``, the block size (tokens) in which the other kernel counts the
    interior (a multiple of this kernel's block); None = this kernel's block."""
    return _partials(q, page_table, kv_lens, layer, low, high, plain, high_table, geom=geom, sm_scale=sm_scale,
                     sliding_window=sliding_window, soft_cap=soft_cap, interpret=interpret, out_dtype=out_dtype,
                     config=config, skip_interior=skip_interior, interior_tokens=interior_tokens)
