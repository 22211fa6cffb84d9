"""Paged decode attention over NVFP4 pages for Hopper: the Pallas **Mosaic GPU** backend (``plgpu.kernel``).

Scope (`supported` says when it applies; everything else runs the Pallas Triton kernel `pallas_kernels.decode.triton`
behind the same entry point, `pallas_kernels.decode.paged_decode_attention`): head_dim 128, NVFP4 low pages (``data
u8[L,P,2,H,page,64]``, ``scales e4m3[L,P,2,H,page,8]``, ``gs f32[L,2]``) of 16, 32, 64 or 128 tokens, optional bf16 /
f16 high twin (retained rows), ``Tq * G <= 64`` query rows per KV head, no sliding window, no soft cap; head_dim 64
as head_dim 128 over token pairs (`as_token_pairs`: ``2 Tq G <= 64``); head_dim 256 as two column blocks of 128
(`dim_blocks`: each block's K halves multiplied into one score tile, its V halves into their own accumulators; keys
on M only, ``Tq * G <= 32``). The entry
point picks it on Hopper wherever `supported` (`pallas_kernels.decode.choose_backend`): it measured faster than the
Triton kernel on every shape class with >= 128k tokens. Every figure behind the choices below is in bench/RESULTS.md;
the tuning (`MosaicConfig`) and its defaults are in `pallas_kernels.decode.config`.

Two forms, one kernel body (`_make_kernel`), chosen by query rows (`MosaicConfig.keys_on_m`):

* *keys on M* (up to 32 rows by default): ``S^T = K Q^T`` with the dequantized K tile as wgmma's register A operand
  (no shared-memory round trip for K) and the query rows padded only to N = 8 / 16 / 32 / 64
  (`MosaicConfig.min_km_rows`), the softmax down the columns (``l`` kept as per-thread partial sums,
  `inline_sm90.l_update_inline`, summed once in the epilogue), ``O^T += V^T P^T`` with V^T a transposed shared-memory
  view. V's f16 tile and P^T share the swizzle of one P^T row (``2 N`` bytes); at N = 8 that row is 16 bytes, a
  swizzle wgmma has not, so P is stored as ``[8, 64]`` at the 128-byte swizzle (`inline_sm90.store_keys_minor`) and
  read through a transposed view. A CTA's query rows share one power-of-two shift into f16, so the logits' multiplier
  is one scalar folded into the exponential's FMA; at N >= 32 and pages <= 32 K's two column halves are dequantized in
  turn (`config.mosaic_qk_in_turn`: fewer registers, one more CTA per SM).
* *queries on M* (33-64 rows by default): query rows padded to wgmma's M = 64, P from registers.

Work split

* **Kernel** (one CTA = one warpgroup per ``(split, kv head, batch row)``; `config.mosaic_num_splits`): the *interior*
  blocks of each sequence (`common.interior_blocks` with 64-token blocks: every key visible to every query, no
  retained row, no row at or past n). A TMA ring of ``stages`` slots holds 64-token blocks of packed bytes + E4M3
  scales: per `tma_box` tokens (a page, up to 64) one copy of the K and V bytes and one of their scales, issued by one
  warp that rotates with the block (`jmixedkv.compat.mgpu_per_warp`: in a warpgroup context Pallas would run the
  copies' address arithmetic in all four warps, measured in the SASS); the split's page ids are copied from the page
  table to shared memory once. The warpgroup dequantizes a block in registers (per thread and row one 16-byte load in
  the `WIDE_COLUMNS` order, `E2M1_F16_PTX`, ``cvt.rn.f16x2.e4m3x2`` for the scales; exact, see below) and runs the two
  wgmma products with an online softmax in base 2. Pallas' automatic barriers around shared-memory stores are off
  (``unsafe_no_auto_barriers``); the kernel places its own, 2 per block: keys on M, the key maximum's exchange
  (`inline_sm90.key_max_inline`) and the commit before ``P V`` (V is dequantized and the next block's copy issued
  after the maximum's barrier, when every warp is past the previous block); queries on M, one at the top of each step
  and the commit before ``Q K^T``. Output: unnormalized partials ``(o, m, l)`` per split, ``o`` query-row major in
  both forms (``[rows, 2 halves, 64]`` per CTA; keys on M stores its ``O^T`` accumulator transposed,
  `inline_sm90.store_transposed`); the f32 output tile aliases the K tile (queries on M) or the V tile (keys on M)
  (``plgpu.RefUnion``). Not built: warp specialization (a producer warp and consumer warpgroups): with 5 CTAs per SM
  at N = 8 other CTAs already fill a CTA's waits (leaving ``P V`` in flight measured level).
* **Edge blocks** (the retained first-N / last-N rows, read from the twin where held, the causal region among the
  ``Tq`` new tokens, rows at or past n): the Triton kernel's `paged_decode_partials` with ``skip_interior=True``
  (`MosaicConfig.edge`: by default `config.mosaic_edge_splits` splits of 32-token steps, its twin overlay and masks;
  the interior it skips counted in this kernel's blocks), merged with the kernel's partials by LSE
  (`_merge_with_edge`: each kernel's splits summed in the layout it wrote, then one permutation within each row, not a
  transpose of every split's tile).

Numerics are the Triton kernel's (see its docstring): a NVFP4 element dequantizes to ``(e2m1 * 2^-14) * (f16(s) * 2^7)
= e2m1 * s * 2^-7`` in f16 **exactly** (the *low domain*, ``x / (gs * 2^7)``); ``gs`` and ``sm_scale`` are applied to
the f32 logits (per query row, with the power-of-two row scaling of q into f16; keys on M: one scaling per CTA,
`f16_queries`' ``rows_share_shift``) and to the f32 output. Columns are kept as ``[even | odd]`` halves (low / high
nibbles), each half in `WIDE_COLUMNS` order; q is permuted to match and the output permuted back outside.

CPU CI: ``interpret=True`` runs the same kernel body in the Mosaic GPU interpreter
(``plgpu.kernel(interpret=InterpretGPUParams())``) with the dequantization and the key maximum in plain jnp (the
interpreter has no ``inline_mgpu``) and P staged through shared memory (its wgmma takes operands from shared memory
only); the compiled form (inline PTX, the one-barrier key maximum, register-A wgmma, barriers) is checked by
cross-lowering for CUDA. Neither checks ptxas, the swizzle / TMA descriptors, races, or timing: that needs the GPU
(tests marked ``gpu``).

Entries (raw arrays, one `MosaicConfig`): `paged_decode_attention` (kernel + edge blocks, merged), `kernel_partials`
(the kernel's raw split partials, for benchmarks), `supported` (static shape / option check)."""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmixedkv.compat import (HAVE_MGPU, mgpu_interpret_params as _interpret_params, mgpu_load as _load,
                             mgpu_per_warp as _per_warp, mgpu_transposed as _transposed, pl, plgpu)
from jmixedkv.layout import TwinGeometry
from pallas_kernels.decode import triton
from pallas_kernels.decode.common import (LOW_DOMAIN, M_INIT, f16_queries, group_queries, interior_blocks,
                                          next_pow2, normalize_merged, pages_per_block, sum_splits, ungroup_rows)
from pallas_kernels.decode.config import (KEYS_ON_M_ROWS, MosaicConfig, TritonConfig, mosaic_edge_splits,
                                          mosaic_num_splits, mosaic_qk_in_turn, tuning_heads)
from pallas_kernels.decode.inline_sm90 import (BLOCK_K, HEAD_DIM, dequant_inline, key_max_inline, l_update_inline,
                                               store_keys_minor, store_transposed)
from pallas_kernels.nvfp4_ops import e2m1_f16_halves

__all__ = ["paged_decode_attention", "kernel_partials", "supported", "available", "BLOCK_K", "HEAD_DIM",
           "HEAD_DIMS", "SUPPORTED_PAGES", "WIDE_COLUMNS", "to_wide", "from_wide", "tma_box", "scale_box",
           "as_token_pairs", "kernel_rows", "max_rows", "dim_blocks", "kernel_columns", "WIDE_HEAD_DIM"]

CHUNK = 16               # tokens under one row of scale bytes in a TMA box (16 x 8 scales)
#: head_dim the kernel reads as `HEAD_DIM` over pairs of tokens (`as_token_pairs`)
PAIR_HEAD_DIM = HEAD_DIM // 2
#: head_dim the kernel reads as two column blocks of `HEAD_DIM` (`dim_blocks`), keys on M only (`supported`)
WIDE_HEAD_DIM = 2 * HEAD_DIM
HEAD_DIMS = (PAIR_HEAD_DIM, HEAD_DIM, WIDE_HEAD_DIM)
#: largest page at `WIDE_HEAD_DIM` whose edge kernel keeps its configured pipelining: at pages of 128 the edge
#: blocks' Triton kernel (whole 128-token pages of 256 columns) asked for 258 KB of shared memory on the H200 with
#: three stages (two: the same by the CPU count), above its 227 KB; `edge_config` runs it with one stage there (~90 KB;
#: it skips the interior, so it walks only the short edge loops)
WIDE_PIPELINED_MAX_PAGE = 64
SUPPORTED_PAGES = (16, 32, 64, 128)   # run on the H200
M_ROWS = 64              # query rows per CTA (wgmma M); Tq * G <= 64
#: the keys-on-M form's row multiplier (``sm_scale log2(e) gs_k 2^-7 2^-shift``, one number per CTA: its query rows
#: share one shift, `f16_queries`) goes in as a vector of this many equal floats (a warpgroup's copy moves a multiple
#: of 128 bytes)
RM_VECTOR = 32
_LOG2E = math.log2(math.e)


def tma_box(page: int) -> int:
    """Tokens per TMA copy at pages of ``page`` tokens: a whole page up to the 64-token block (one copy of bytes and
    one of scales per box, K and V rows together)."""
    return min(page, BLOCK_K)


def scale_box(box: int, per_token: int = 8) -> tuple:
    """``(rows, bytes)`` of a TMA box's scales (``per_token`` per token, token-major): rows of 128 bytes (`CHUNK`
    tokens at head_dim 128, 8 at head_dim 256), one shorter row under a box of 8 tokens (pages of 16 tokens at
    head_dim 64, `as_token_pairs`)."""
    n = box * per_token
    return max(1, n // (CHUNK * 8)), min(n, CHUNK * 8)


def dim_blocks(head_dim: int) -> int:
    """Column blocks of `HEAD_DIM` in a row as the kernel reads it: 2 at head_dim 256, else 1 (head_dim 64 is read
    as token pairs, `as_token_pairs`). Each block is two ``[64, 64]`` f16 tiles (its even and odd columns): the
    kernel's *parts*, ``2 * dim_blocks`` per row, part ``2 c + h`` being block ``c``'s half ``h``."""
    return max(1, head_dim // HEAD_DIM)


def kernel_columns(head_dim: int):
    """Column ``d`` of an output row <- position ``kernel_columns(D)[d]`` of the kernel's row of partials (``[parts,
    64]``, each part in `WIDE_COLUMNS` order): column block ``d / 128``, half ``d % 2``, the wide position of byte
    ``(d % 128) / 2`` of the block."""
    return np.array([d // HEAD_DIM * HEAD_DIM + (d % 2) * (HEAD_DIM // 2) + _FROM_WIDE[d % HEAD_DIM // 2]
                     for d in range(head_dim)])


def as_token_pairs(q, data, scales):
    """head_dim 64 as the kernel's head_dim 128: token pairs ``(2 i, 2 i + 1)`` as one row.

    A page's rows are contiguous (``data u8[..., page, 32]``, ``scales [..., page, 4]``), so the pools view as
    ``[..., page / 2, 64]`` and ``[..., page / 2, 8]`` without a copy; a row's block scales stay over its own 16
    elements. Each query row becomes two, ``[q, 0]`` and ``[0, q]``: over a pair row the first scores the even token,
    the second the odd one, so each sees half the keys with its own softmax, and its output is the half of the 128
    columns that its token's V fills (`_merge_with_edge` takes those and merges the two as splits). Costs twice the
    query rows in the products (the kernel is bound by its loads and dequantization, not the tensor cores).
    ``q [B, Tq, Hq, 64]`` -> ``[B, Tq, 2 Hq, 128]`` (head ``2 j + a`` is head ``j``'s half ``a``: the same KV head)."""
    b, tq, hq, d = q.shape
    z = jnp.zeros_like(q)
    q2 = jnp.stack([jnp.concatenate([q, z], -1), jnp.concatenate([z, q], -1)], axis=3).reshape(b, tq, 2 * hq, 2 * d)
    pairs = lambda x: x.reshape(x.shape[:-2] + (x.shape[-2] // 2, 2 * x.shape[-1]))  # noqa: E731
    return q2, pairs(data), pairs(scales)


def available() -> bool:
    """True when ``jax.experimental.pallas.mosaic_gpu`` imports (it may still fail to compile off Hopper)."""
    return HAVE_MGPU


def kernel_rows(head_dim: int, tq: int, group: int) -> int:
    """Query rows per KV head the kernel sees: ``Tq * G``, twice that at head_dim 64 (`as_token_pairs`)."""
    return tq * group * (2 if head_dim == PAIR_HEAD_DIM else 1)


def max_rows(head_dim: int) -> int:
    """Most query rows per KV head (`kernel_rows`) the kernel takes: `M_ROWS`, `KEYS_ON_M_ROWS` at head_dim 256
    (the keys-on-M form only: queries on M would hold four ``[64, 64]`` f32 accumulators, 128 registers a
    thread)."""
    return KEYS_ON_M_ROWS if head_dim == WIDE_HEAD_DIM else M_ROWS


def supported(*, head_dim, page, tq, group, high_dtype=None, sliding_window=None, soft_cap=None) -> bool:
    """Whether the Mosaic GPU kernel covers this configuration (static facts only; NVFP4 low pages)."""
    if not HAVE_MGPU:
        return False
    if head_dim not in HEAD_DIMS or page not in SUPPORTED_PAGES:
        return False
    if kernel_rows(head_dim, tq, group) > max_rows(head_dim):
        return False
    if sliding_window is not None or soft_cap is not None:
        return False
    return high_dtype is None or jnp.dtype(high_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


# ----------------------------------------------------------------------------- dequantization
#: Column order of the dequantized tiles: column ``t`` of a ``[64, 64]`` half tile (even or odd columns) holds byte
#: ``WIDE_COLUMNS[t] = 16 (t % 8 // 2) + 2 (t // 8) + t % 2`` of the packed row. In the WGMMA register layout a thread
#: holds columns ``2 (lane % 4) + 8 j + {0, 1}`` (j = 0..7) of two rows; in this order those are the 16 contiguous
#: bytes ``16 (lane % 4) .. + 15`` of each row (one 128-bit shared-memory load, conflict-free) under two contiguous
#: scale bytes. q's columns are permuted the same way and the output's back (`paged_decode_attention`); QK^T
#: sums over the columns, so the order is free. It measured faster on the H200 than 2-byte loads in natural order
#: (one scale byte and one inline-PTX call per 4 elements; bench/RESULTS.md).
WIDE_COLUMNS = np.array([16 * (t % 8 // 2) + 2 * (t // 8) + t % 2 for t in range(HEAD_DIM // 2)])


_FROM_WIDE = np.argsort(WIDE_COLUMNS)
#: `kernel_columns` at head_dim 128 (token pairs read halves of it)
_KERNEL_COLUMNS = kernel_columns(HEAD_DIM)


def to_wide(x, gather=False):
    """Last axis (64 columns, byte order) -> `WIDE_COLUMNS` order: ``x[..., WIDE_COLUMNS]``. ``gather``: as a
    ``jnp.take`` (outside a kernel: XLA on the H200 ran the reshape form's transpose, whose contiguous runs are 2
    elements, several times slower than the gather, bench/RESULTS.md), else as a reshape
    (inside a kernel body, where a gather's index array would be a captured constant)."""
    if gather:
        return jnp.take(x, WIDE_COLUMNS, axis=-1)
    return jnp.swapaxes(x.reshape(x.shape[:-1] + (4, 8, 2)), -3, -2).reshape(x.shape)


def from_wide(x):
    """Inverse of `to_wide`."""
    return jnp.swapaxes(x.reshape(x.shape[:-1] + (8, 4, 2)), -3, -2).reshape(x.shape)



def _dequant_jnp(b_ref, s_ref, halves=("lo", "hi"), block=0):
    """Interpret path: the same exact arithmetic in jnp, the same column order (column block ``block``)."""
    sc = s_ref[...].reshape(BLOCK_K, -1)[:, 8 * block:8 * block + 8].astype(jnp.float16) * jnp.float16(LOW_DOMAIN)
    sc = jnp.repeat(sc, 8, axis=1)                                            # [64, 64]
    b = b_ref[...].reshape(BLOCK_K, -1)[:, HEAD_DIM // 2 * block:HEAD_DIM // 2 * (block + 1)]
    lo, hi = (x * sc for x in e2m1_f16_halves(b))                             # [64, 64] each
    return tuple(to_wide(dict(lo=lo, hi=hi)[h]) for h in halves)



# ----------------------------------------------------------------------------- kernel
def _make_kernel(*, page, pt_len, stages, splits, data_pages, scale_pages, num_heads, batch, interpret, keys_on_m=False,
                 n_rows=M_ROWS, qk_in_turn=False, blocks=1, v_in_turn=False):
    """Body for ``plgpu.kernel``; grid ``(splits, H, B)``. ``keys_on_m``: the keys-on-M form
    (`config.KEYS_ON_M_ROWS`) with ``n_rows`` query rows (8 / 16 / 32 / 64) on the wgmma N side, its row multiplier
    one scalar per CTA; ``qk_in_turn``: there, K's column halves dequantized in turn (`config.IN_TURN_ROWS`);
    ``blocks``: column blocks of 128 per row (`dim_blocks`), each dequantized, multiplied and accumulated in turn;
    ``v_in_turn``: keys on M, the blocks' V through one pair of V tiles (`MosaicConfig.v_in_turn`)."""
    bk, half = BLOCK_K, HEAD_DIM // 2
    parts = 2 * blocks                  # [64, 64] f16 column tiles per row: part 2 c + h, block c's half h
    p_keys_minor = keys_on_m and n_rows < 16 and not interpret     # P stored as [N, keys] (`config.MIN_KM_ROWS`)
    wgmma_layout = plgpu.Layout.WGMMA
    # per-query vectors: along the rows of the accumulators, or (keys on M) along their columns
    row_layout = plgpu.Layout.WGMMA.reduce(0 if keys_on_m else 1)
    box = tma_box(page)             # tokens per TMA copy (K and V together, one copy for bytes, one for scales)
    n_box = bk // box               # copies of each kind per block
    bpp = page // box               # boxes per page
    pt_chunks = pt_len // 256 if pt_len >= 256 else 1
    pt_chunk = min(pt_len, 256)
    dequant = _dequant_jnp if interpret else dequant_inline
    # Pallas' automatic barriers (a warpgroup barrier before and after every shared-memory store) are off; the
    # kernel places its own: `sync` (a warpgroup barrier; commit_smem's proxy fence is harmless). Without them the
    # kernel measured faster on verify shapes on the H200, level at Tq 1 (bench/RESULTS.md)
    sync = (lambda: None) if interpret else plgpu.commit_smem  # noqa: E731
    # the interpreter has no layouts: plain values there
    cast = (lambda x, layout: x) if interpret else plgpu.layout_cast  # noqa: E731

    def kernel(meta_ref, q_ref, rowmul_ref, pt_ref, data_ref, scales_ref,      # inputs (GMEM)
               o_ref, m_ref, l_ref,                                           # outputs (GMEM)
               q_smem, rm_smem, pt_smem, kvb, kvs, k16, v16, p_smem, o_smem, ml_smem, red_smem,
               bar_q, bar_pt, bar_kv):
        # compiled: o_smem (used only after the loop) aliases the K tile (queries on M) or the V tile and the row
        # multiplier (keys on M; read into a register before the loop)
        if rm_smem is None:
            v16, o_smem, rm_smem = v16
        elif o_smem is None:
            k16, o_smem = k16
        si = lax.axis_index("s")
        hi = lax.axis_index("h")
        bi = lax.axis_index("b")
        bh = bi * num_heads + hi
        layer = meta_ref[0]
        i32 = lambda v: jnp.asarray(v, jnp.int32)  # noqa: E731
        blk0 = meta_ref[1 + 2 * bi]               # this sequence's interior blocks [blk0, n_blk) (all keys clean)
        n_blk = meta_ref[2 + 2 * bi]
        per = lax.div(jnp.maximum(n_blk - blk0, 0) + (splits - 1), i32(splits))
        start = blk0 + si * per
        end = jnp.minimum(start + per, n_blk)
        nblk = jnp.maximum(end - start, 0)

        # q (permuted [even | odd] halves, f16 low domain), row multiplier(s), this split's page ids
        plgpu.copy_gmem_to_smem(q_ref.at[bh], q_smem, bar_q.at[0])
        plgpu.copy_gmem_to_smem(rowmul_ref.at[bh], rm_smem, bar_q.at[0])
        # the split's page ids from the 16-byte aligned column (a multiple of 4 ids) at or below its first page: a
        # page-table copy starting off that boundary (first page 2 mod 4 at pages of 32 tokens, say) faulted on the
        # H200 with CUDA_ERROR_ILLEGAL_INSTRUCTION
        # (at most the table's last pt_len columns: the copy never leaves the table, which the wrapper pads only
        # when it is narrower than pt_len or its width not a multiple of 4)
        first_page = lax.div(start * bk, i32(page))
        first_page = jnp.minimum(first_page - lax.rem(first_page, i32(4)), i32(pt_ref.shape[1] - pt_len))
        for c_ in range(pt_chunks):
            plgpu.copy_gmem_to_smem(pt_ref.at[bi, pl.ds(first_page + c_ * pt_chunk, pt_chunk)],
                                    pt_smem.at[pl.ds(c_ * pt_chunk, pt_chunk)], bar_pt.at[0])
        plgpu.barrier_wait(bar_pt.at[0])

        def issue(blk, slot):
            tok0 = blk * bk
            for j in range(n_box):
                tok = tok0 + j * box
                # (clamped: a length past the table's pages reads the table's last column, never past the copy)
                pid = jnp.maximum(pt_smem[jnp.minimum(lax.div(tok, i32(page)) - first_page, i32(pt_len - 1))], 0)
                sub = lax.div(lax.rem(tok, i32(page)), i32(box)) if page > box else 0
                b = bar_kv.at[slot]
                # pools viewed as [(layer, page), K/V, (head, box), box tokens, ...]: one TMA copy brings the K and
                # the V rows of a box (2 x box rows, 2 KB at 16 tokens), one their scales. The data and scale pools
                # may hold different page counts (`jmixedkv.state` pads each past the offset hole on its own)
                hb = hi * bpp + sub
                plgpu.copy_gmem_to_smem(data_ref.at[layer * data_pages + pid, :, hb], kvb.at[slot, j], b)
                plgpu.copy_gmem_to_smem(scales_ref.at[layer * scale_pages + pid, :, hb], kvs.at[slot, j], b)

        def issue_from_one_warp(blk, slot, k):
            """`issue` from warp ``k mod 4`` of the warpgroup only: the other three skip its page-id loads, address
            arithmetic and TMA instructions (issued by every warp before, under a one-thread predicate: ~240 of 723
            SASS instructions per warp and block at 16 x 32k, ncu on the H200, bench/RESULTS.md).
            ``k`` rotates with the block, so the four warps (one per SM sub-partition) share the work."""
            if interpret:
                issue(blk, slot)
                return

            def per_warp():
                @pl.when(lax.axis_index("warp") == lax.rem(k, i32(4)))
                def _():
                    issue(blk, slot)
            _per_warp(per_warp)

        for i in range(stages - 1):
            @pl.when(i < nblk)
            def _():
                issue_from_one_warp(start + i, i, i32(i))

        plgpu.barrier_wait(bar_q.at[0])
        # includes log2(e): [M] f32 (queries on M), one f32 (keys on M: the query rows share one shift; a [64, N]
        # tile of it held 16 registers per thread at N = 32)
        rowmul = rm_smem[0] if keys_on_m else rm_smem[...] if interpret else _load(rm_smem, row_layout)

        def softmax_step(s, m_i, l_i, accs, kax, m_new=None, s_mul=None):
            """Online softmax (base 2) of one block's scores ``s`` (no mask: interior blocks only), keys along axis
            ``kax``, the accumulators ``accs`` rescaled; ``m_new``: the new running maximum when the caller has it;
            ``s_mul``: a multiplier of ``s`` not yet applied (folded into the exponential's argument).
            -> ``(p, m_new, l_new, accs)``. Keys on M (``kax`` 0): ``l`` is a ``[64 keys, N]`` tile of per-thread
            partial sums, summed over the keys once in the epilogue (no cross-warp reduction per block for it; the
            max needs one); compiled, each thread keeps its two key rows' sums in one (`l_update_inline`)."""
            qax = 1 - kax
            if m_new is None:
                m_new = jnp.maximum(m_i, s.max(axis=kax))
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2((s if s_mul is None else s * s_mul) - lax.broadcast_in_dim(m_new, s.shape, [qax]))
            if kax == 0 and not interpret:
                l_new = l_update_inline(l_i, alpha, p)
            elif kax == 0:
                l_new = l_i * lax.broadcast_in_dim(alpha, s.shape, [qax]) + p
            else:
                l_new = l_i * alpha + p.sum(axis=kax)
            return p, m_new, l_new, tuple(a * lax.broadcast_in_dim(alpha, a.shape, [qax]) for a in accs)

        def accumulate(mma, accs):
            """``accs`` plus the wgmma products ``mma(acc_refs)`` adds: in place (``pl.run_state``) when compiled;
            the interpreter has no run_state, so there into fresh accumulators, then added."""
            if not interpret:
                return pl.run_state(mma)(tuple(plgpu.ACC.init(a) for a in accs))

            def fresh(*refs):
                mma(refs)
                return tuple(r[...] for r in refs)
            prods = pl.run_scoped(fresh, *[plgpu.ACC(a.shape, jnp.float32) for a in accs])
            return tuple(a + d for a, d in zip(accs, prods))

        def ring(i):
            """TMA ring bookkeeping of block ``i``: ``(slot, prefetch)``, its ring slot and a function that issues
            the copy of block ``i + stages - 1`` (when this split has it) into the slot that block will read."""
            rel = i - start
            slot = lax.rem(rel, i32(stages))
            nxt = rel + stages - 1

            def prefetch():
                @pl.when(nxt < nblk)
                def _():
                    issue_from_one_warp(start + nxt, lax.rem(nxt, i32(stages)), nxt)
            return slot, prefetch

        def km_step(i, carry):
            """Keys on M, one 64-token block: ``S^T = K Q^T`` ([64 keys, N], the dequantized K the register A
            operand), softmax down the columns, ``O^T += V^T P^T`` ([64 dims, N] per half, V^T a transposed
            shared-memory view, P^T in shared memory). Two warpgroup barriers per block: the one inside the
            maximum over the keys (`key_max_inline`), past which every warp has finished block ``i - 1`` (its
            ``P V`` wgmma and its reads of the ring slot that the next copy refills, and of the V / P tiles that
            this block overwrites), and the commit before ``P V``, which also separates the maximum's scratch reads
            from the next block's writes."""
            accs, m_i, l_i = carry
            slot, prefetch = ring(i)
            plgpu.barrier_wait(bar_kv.at[slot])
            k_b, k_s = kvb.at[slot, :, 0], kvs.at[slot, :, 0]
            in_turn = qk_in_turn and not interpret
            if not in_turn:     # the first column block's halves before the scores' accumulator
                k_first = dequant(k_b, k_s)
            if interpret:       # the interpreter's wgmma takes operands from shared memory only
                for c in range(blocks):
                    for h, tile in enumerate(k_first if c == 0 else dequant(k_b, k_s, block=c)):
                        k16.at[2 * c + h][...] = tile

            def qk(acc_ref):
                if interpret:
                    for part in range(parts):
                        plgpu.wgmma(acc_ref, k16.at[part], q_smem.at[part])
                    return acc_ref[...]
                for c in range(blocks):
                    if in_turn:  # one half's registers live at a time; bytes and scales are loaded again for the
                        # second half (keeping them live across the first wgmma would hold the registers this frees)
                        for h, name in enumerate(("lo", "hi")):
                            if c or h:
                                plgpu.wgmma_wait(0)
                            plgpu.wgmma(acc_ref, dequant(k_b, k_s, (name,), block=c)[0],
                                        _transposed(q_smem.at[2 * c + h]))
                        continue
                    if c:       # the previous block's registers free first
                        plgpu.wgmma_wait(0)
                    for h, tile in enumerate(k_first if c == 0 else dequant(k_b, k_s, block=c)):
                        plgpu.wgmma(acc_ref, tile, _transposed(q_smem.at[2 * c + h]))
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((bk, n_rows), jnp.float32))      # [keys, N]
            # the row multiplier is one positive scalar: applied to the maximum, then inside the exponential's
            # argument (s * rowmul - m: one FMA per element)
            s_max = s.max(axis=0) if interpret else key_max_inline(s, red_smem)
            m_new = jnp.maximum(m_i, s_max * rowmul)
            prefetch()
            p, m_new, l_new, accs = softmax_step(s, m_i, l_i, accs, 0, m_new=m_new, s_mul=rowmul)

            def store_v(c):
                """Column block ``c``'s V halves into its V tiles (the first pair when ``v_in_turn``; V^T stored as
                such in the interpreter: no transposed operands there)."""
                for h, tile in enumerate(dequant(kvb.at[slot, :, 1], kvs.at[slot, :, 1], block=c)):
                    v16.at[h if v_in_turn else 2 * c + h][...] = tile.T if interpret else tile
            for c in range(1 if v_in_turn else blocks):
                store_v(c)
            p_op = _transposed(p_smem) if p_keys_minor else p_smem   # P^T [keys, N] either way
            if p_keys_minor:
                store_keys_minor(p.astype(jnp.float16), p_smem)
            else:
                p_smem[...] = p.astype(jnp.float16)
            plgpu.commit_smem()
            vt = (lambda r: r) if interpret else _transposed  # noqa: E731

            def pv(refs):
                if not v_in_turn:
                    for part in range(parts):
                        plgpu.wgmma(refs[part], vt(v16.at[part]), p_op)
                    return
                for c in range(blocks):
                    if c:       # block c's V tiles replace block c - 1's once every warp's products have read them
                        if not interpret:
                            plgpu.wgmma_wait(0)
                        sync()
                        store_v(c)
                        plgpu.commit_smem()
                    for h in range(2):
                        plgpu.wgmma(refs[2 * c + h], vt(v16.at[h]), p_op)

            return accumulate(pv, accs), m_new, l_new

        def qm_step(i, carry):
            """Queries on M, one 64-token block: ``S = Q K^T`` ([64 rows, 64 keys], K^T a transposed view of the
            f16 K tile), ``O += P V`` (P from registers)."""
            accs, m_i, l_i = carry
            slot, prefetch = ring(i)
            # every warp is past the previous step: its wgmma reads of the f16 tiles and its dequantization reads
            # of the ring slot that the next copy refills
            sync()
            prefetch()
            plgpu.barrier_wait(bar_kv.at[slot])
            for c in range(blocks):
                for h, tile in enumerate(dequant(kvb.at[slot, :, 0], kvs.at[slot, :, 0], block=c)):
                    # (the interpreter's wgmma takes no transposed operand: K^T stored as such)
                    k16.at[2 * c + h][...] = tile.T if interpret else tile
            # V next (dequantizing V while the tensor cores run Q K^T measured slower on the H200)
            for c in range(blocks):
                for h, tile in enumerate(dequant(kvb.at[slot, :, 1], kvs.at[slot, :, 1], block=c)):
                    v16.at[2 * c + h][...] = tile
            plgpu.commit_smem()

            def qk(acc_ref):
                kt = (lambda r: r) if interpret else _transposed  # noqa: E731
                for part in range(parts):
                    plgpu.wgmma(acc_ref, q_smem.at[part], kt(k16.at[part]))
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((M_ROWS, bk), jnp.float32))
            s = s * lax.broadcast_in_dim(rowmul, s.shape, [0])
            p, m_new, l_new, accs = softmax_step(s, m_i, l_i, accs, 1)
            p16 = p.astype(jnp.float16)
            if interpret:
                p_smem[...] = p16
                plgpu.commit_smem()
                p_op = p_smem
            else:
                p_op = p16

            def pv(refs):
                for part in range(parts):
                    plgpu.wgmma(refs[part], p_op, v16.at[part])

            return accumulate(pv, accs), m_new, l_new

        zero_acc = cast(jnp.zeros((half, n_rows) if keys_on_m else (M_ROWS, half), jnp.float32), wgmma_layout)
        carry = ((zero_acc,) * parts,
                 cast(jnp.full((n_rows,), M_INIT, jnp.float32), row_layout),
                 cast(jnp.zeros((bk, n_rows) if keys_on_m else (n_rows,), jnp.float32),
                      wgmma_layout if keys_on_m else row_layout))
        step = km_step if keys_on_m else qm_step
        accs, m_i, l_i = lax.fori_loop(start, jnp.maximum(end, start), step, carry)

        # epilogue: partials through shared memory (o_smem may alias k16: every warp past its last wgmma first;
        # each copy out read before the next tile overwrites o_smem)
        sync()
        cta = (si * batch + bi) * num_heads + hi
        for part, acc in enumerate(accs):
            if keys_on_m and not interpret:
                store_transposed(acc, o_smem)           # O^T [64, N] -> O [N, 64]
            else:
                o_smem[...] = acc.T if keys_on_m else acc
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[cta, :, part])
            plgpu.wait_smem_to_gmem(0)
            if part < parts - 1:
                sync()
        if keys_on_m:     # l: the per-thread partial sums over the keys, reduced once here (one cross-warp sum)
            l_i = l_i.sum(axis=0)
        ml_smem[0] = m_i
        ml_smem[1] = l_i
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(ml_smem.at[0], m_ref.at[si * batch * num_heads + bh])
        plgpu.copy_smem_to_gmem(ml_smem.at[1], l_ref.at[si * batch * num_heads + bh])
        plgpu.wait_smem_to_gmem(0)

    return kernel


# ----------------------------------------------------------------------------- wrapper
def _kernel_call(q, page_table, kv_lens, layer, low, high, high_table, *, geom, sm_scale, interpret, out_dtype,
                 config: MosaicConfig):
    """The Mosaic GPU kernel over the interior blocks: ``((o, m2, l), facts)``, the raw partials (`kernel_partials`)
    and what the edge call and the merge need."""
    if low is None:
        raise ValueError("mosaic_sm90.paged_decode_attention: needs low= NVFP4 pages")
    data, scales, gs = low
    b, tq, hq, d = q.shape
    _, P, kvf, h, page, dh = data.shape
    group = hq // h
    if not supported(head_dim=d, page=page, tq=tq, group=group,
                     high_dtype=None if high is None else high[0].dtype) or kvf != 2:
        raise ValueError(f"mosaic_sm90.paged_decode_attention: unsupported configuration D={d} page={page} Tq={tq} "
                         f"G={group} kv={kvf}")
    dtype = jnp.dtype(q.dtype)
    out_dtype = dtype if out_dtype is None else jnp.dtype(out_dtype)
    sm_scale = d ** -0.5 if sm_scale is None else float(sm_scale)
    use_high = high is not None and high_table is not None and high_table.shape[1] > 0
    if use_high and (geom is None or geom.page != page):
        raise ValueError(f"mosaic_sm90.paged_decode_attention: high= needs geom= with page={page}, got {geom}")
    lens = jnp.asarray(kv_lens, jnp.int32)
    layer_i = jnp.asarray(layer, jnp.int32)
    gs_l = jnp.asarray(gs, jnp.float32)[layer_i]                              # [2]

    # ---- kernel operands: the interior blocks [a, c) of each sequence (the Triton kernel's clean blocks; the
    # kernel masks nothing, every key there is a low row visible to every query)
    # both kernels count the interior in blocks of `interior_tokens`: a multiple of this kernel's block (64 rows:
    # 128 tokens at head_dim 64) and of the edge kernel's (whole pages: 128 tokens at pages of 128)
    pairs = d == PAIR_HEAD_DIM
    block_tokens = BLOCK_K * (2 if pairs else 1)
    interior_tokens = math.lcm(block_tokens, pages_per_block(config.edge.block_k, page) * page)
    per_it = interior_tokens // block_tokens
    i0, i1 = (x * per_it for x in interior_blocks(lens, interior_tokens, tq, geom if use_high else None))
    n_blocks = -(-lens // block_tokens)
    a = jnp.clip(i0, 0, n_blocks)
    c = jnp.clip(i1, a, n_blocks)
    if pairs:               # from here on the kernel's view: rows of token pairs, twice the query rows
        q, data, scales = as_token_pairs(q, data, scales)
        b, tq, hq, d = q.shape
        page, dh, group = page // 2, 2 * dh, hq // h
    blocks = dim_blocks(d)
    v_in_turn = config.v_in_turn and blocks > 1
    meta = jnp.concatenate([layer_i.reshape(1), jnp.stack([a, c], 1).reshape(-1)]).astype(jnp.int32)
    km = tq * group <= KEYS_ON_M_ROWS if config.keys_on_m is None else config.keys_on_m
    if blocks > 1 and not km:
        raise ValueError(f"mosaic_sm90.paged_decode_attention: head_dim {d} runs with keys on M only, got "
                         f"keys_on_m={config.keys_on_m}")
    n_rows = max(config.min_km_rows, next_pow2(tq * group)) if km else M_ROWS  # wgmma N (keys on M) or M
    # q grouped and padded in its own dtype, converted inside `f16_queries`' fusions: XLA writes no float32 copy of
    # it (where the rows match, the expression is the edge kernel's grouped q too)
    qg = jnp.pad(group_queries(q, h), ((0, 0), (0, 0), (0, n_rows - tq * group), (0, 0)))
    qlow, shift = f16_queries(qg.astype(jnp.float32), rows_share_shift=km)  # shift [B, H, M]
    # [B, H, parts, M, 64]: part 2 c + h holds column block c's even (h = 0) or odd columns
    qlow = qlow.reshape(b, h, n_rows, blocks, HEAD_DIM // 2, 2).transpose(0, 1, 3, 5, 2, 4)
    qlow = qlow.reshape(b, h, 2 * blocks, n_rows, HEAD_DIM // 2)
    qlow = to_wide(qlow, gather=True)                                         # `WIDE_COLUMNS` order
    if km and interpret:                  # the interpreter's wgmma takes no transposed operand: Q^T as such
        qlow = jnp.swapaxes(qlow, -1, -2)
    rowmul = jnp.ldexp(jnp.float32(sm_scale * _LOG2E) * gs_l[0] * LOW_DOMAIN, -shift).astype(jnp.float32)

    max_pages = page_table.shape[1]
    max_tokens = max_pages * page
    max_blocks = max(1, -(-max_tokens // BLOCK_K))
    splits = (mosaic_num_splits(b, tuning_heads(config, h), max_blocks) if config.num_splits is None
              else int(config.num_splits))
    per_max = -(-max_blocks // splits)
    pages_needed = -(-(per_max * BLOCK_K) // page) + 1 + 3                   # + 3: the aligned first column
    # >= 64 ids (a floor from before the misaligned-copy fault was found; it costs nothing)
    pt_len = max(64, 32 * -(-pages_needed // 32)) if pages_needed <= 256 else 256 * -(-pages_needed // 256)
    pt = jnp.asarray(page_table, jnp.int32)
    box = tma_box(page)
    # [(layer, page), K/V, (head, box), box tokens, 64 c bytes] and [(layer, page), K/V, (head, box), rows of 128
    # scale bytes] (`scale_box`: 16 tokens a row at head_dim 128)
    data3 = data.reshape(-1, 2, h * (page // box), box, dh)
    sbox = scale_box(box, dh // 8)
    scales4 = scales.reshape((-1, 2, h * (page // box)) + sbox)
    if not interpret:
        scales4 = lax.bitcast_convert_type(scales4, jnp.uint8)

    tiling = plgpu.TilingTransform((8, 64))
    swz = plgpu.SwizzleTransform(128)
    tr = (tiling, swz)
    half = HEAD_DIM // 2
    parts = 2 * blocks
    st = config.stages
    u8 = jnp.uint8
    sdt = scales4.dtype
    k16_spec = plgpu.SMEM((parts, BLOCK_K, half), jnp.float16, transforms=tr)
    o_spec = plgpu.SMEM((M_ROWS, half), jnp.float32,
                        transforms=(plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128)))
    smem = dict(                       # the kernel's shared-memory scratch, in its argument order
        q_smem=plgpu.SMEM((parts, M_ROWS, half), jnp.float16, transforms=tr),
        rm_smem=plgpu.SMEM((M_ROWS,), jnp.float32),
        pt_smem=plgpu.SMEM((pt_len,), jnp.int32),
        kvb=plgpu.SMEM((st, BLOCK_K // box, 2, box, dh), u8),
        kvs=plgpu.SMEM((st, BLOCK_K // box, 2) + sbox, sdt),
        k16=k16_spec if interpret else plgpu.RefUnion(k16_spec, o_spec),    # (| o_smem)
        v16=plgpu.SMEM((parts, BLOCK_K, half), jnp.float16, transforms=tr),
        p_smem=plgpu.SMEM((M_ROWS, BLOCK_K), jnp.float16, transforms=tr) if interpret else None,
        o_smem=o_spec if interpret else None,
        ml_smem=plgpu.SMEM((2, M_ROWS), jnp.float32),
        red_smem=None)
    if km:
        # V's f16 tile and P^T share wgmma's swizzle (the bytes of one P^T row: 2 * n_rows); the output tile O [N,
        # 64] is untiled, written by `_store_transposed`'s scalar stores once per CTA
        # (N = 8: P stored as [N, keys] at the K tiles' 128-byte swizzle, V's tile with it)
        tr_n = tr if n_rows < 16 else (plgpu.TilingTransform((8, n_rows)), plgpu.SwizzleTransform(2 * n_rows))
        rm_spec = plgpu.SMEM((RM_VECTOR,), jnp.float32)
        o_km_spec = plgpu.SMEM((n_rows, half), jnp.float32)                 # O, stored by `_store_transposed`
        v_tiles = 2 if v_in_turn else parts       # `MosaicConfig.v_in_turn`: one column block's V tiles at a time
        v16_spec = plgpu.SMEM((v_tiles, half, BLOCK_K), jnp.float16) if interpret else \
            plgpu.SMEM((v_tiles, BLOCK_K, half), jnp.float16, transforms=tr_n)
        if interpret:
            p_spec = plgpu.SMEM((BLOCK_K, n_rows), jnp.float16)
        elif n_rows < 16:                 # P stored as [N, keys] (`_store_keys_minor`), read as P^T through a view
            p_spec = plgpu.SMEM((n_rows, BLOCK_K), jnp.float16, transforms=tr)
        else:
            p_spec = plgpu.SMEM((BLOCK_K, n_rows), jnp.float16, transforms=tr_n)
        smem.update(
            q_smem=plgpu.SMEM((parts, half, n_rows), jnp.float16) if interpret else
            plgpu.SMEM((parts, n_rows, half), jnp.float16, transforms=tr),
            rm_smem=rm_spec if interpret else None,
            k16=plgpu.SMEM((parts, BLOCK_K, half), jnp.float16) if interpret else None,
            # compiled: the row multiplier (read before the loop) and the output tile (after it) share the V
            # tile's bytes (16 KB): 47 KB per CTA at N = 16, 53 KB at N = 32 (a third ring stage would fit 4 CTAs
            # per SM at N = 16; it measured slower)
            v16=v16_spec if interpret else plgpu.RefUnion(v16_spec, o_km_spec, rm_spec),
            p_smem=p_spec,
            o_smem=o_km_spec if interpret else None,
            ml_smem=plgpu.SMEM((2, n_rows), jnp.float32),
            red_smem=plgpu.SMEM((4 * n_rows,), jnp.float32))     # `_key_max_inline`'s exchange
    scratch = list(smem.values()) + [
        plgpu.Barrier(num_arrivals=2, num_barriers=1),                        # bar_q
        plgpu.Barrier(num_arrivals=max(1, pt_len // 256), num_barriers=1),    # bar_pt
        plgpu.Barrier(num_arrivals=2 * (BLOCK_K // box), num_barriers=st),   # bar_kv
    ]
    in_turn = mosaic_qk_in_turn(n_rows, page) if config.qk_in_turn is None else config.qk_in_turn
    kernel = _make_kernel(page=page, pt_len=pt_len, stages=st, splits=splits, data_pages=P,
                          scale_pages=scales.shape[1], num_heads=h, batch=b,
                          interpret=interpret, keys_on_m=km, n_rows=n_rows, qk_in_turn=km and in_turn, blocks=blocks,
                          v_in_turn=v_in_turn)
    # TMA boxes never leave the array, and its row stride is a multiple of 16 bytes (TMA's rule: a page table of
    # any width, e.g. 513 pages for 8193 tokens, failed at trace time before)
    pt_cols = max(pt_len, max_pages + (-max_pages % 4))
    pt_padded = pt if pt_cols == max_pages else jnp.pad(pt, ((0, 0), (0, pt_cols - max_pages)))
    o_rows = n_rows if km else M_ROWS
    out_type = (jax.ShapeDtypeStruct((splits * b * h, o_rows, parts, half), jnp.float32),   # [CTA, rows, part, 64]
                jax.ShapeDtypeStruct((splits * b * h, n_rows), jnp.float32),
                jax.ShapeDtypeStruct((splits * b * h, n_rows), jnp.float32))
    kw = dict(out_type=out_type, grid=(splits, h, b), grid_names=("s", "h", "b"), scratch_types=scratch,
              compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=True,
                                                   lowering_semantics=plgpu.LoweringSemantics.Lane))
    if interpret:
        kw["interpret"] = _interpret_params()
    rm = rowmul.reshape(b * h, n_rows)
    if km:                  # one number per CTA (`RM_VECTOR`)
        rm = jnp.broadcast_to(rm[:, :1], (b * h, RM_VECTOR))
    o, m2, l = plgpu.kernel(kernel, **kw)(meta, qlow.reshape((b * h,) + qlow.shape[2:]), rm, pt_padded, data3,
                                          scales4)
    return (o, m2, l), dict(use_high=use_high, interior_tokens=interior_tokens, splits=splits, n_rows=n_rows,
                            o_rows=o_rows, gs_l=gs_l, sm_scale=sm_scale, out_dtype=out_dtype, pairs=pairs)

_STATIC = ("geom", "sm_scale", "interpret", "out_dtype", "config")


@functools.partial(jax.jit, static_argnames=_STATIC)
def paged_decode_attention(q, page_table, kv_lens, layer=0, low=None, high=None, high_table=None, *,
                           geom: Optional[TwinGeometry] = None, sm_scale: Optional[float] = None,
                           interpret: bool = False, out_dtype=None, config: Optional[MosaicConfig] = None):
    """Paged decode / verify attention (one layer) over NVFP4 pages (+ optional twin), Mosaic GPU kernel.

    Same arguments and result as `pallas_kernels.decode.triton.paged_decode_attention` for the configurations
    `supported` accepts: ``q [B, Tq, Hq, D]`` (D 64 or 128, bf16 / fp16), ``page_table i32[B, max_pages]``, ``kv_lens
    i32[B]``, ``low = (data, scales, gs)``, ``high = (rows, scale)`` bf16 / fp16 twin with ``high_table i32[B, F +
    R]`` and its static ``geom`` (`jmixedkv.layout.TwinGeometry`); ``config`` the `MosaicConfig` (None: every
    default). Returns ``(out [B, Tq, Hq, D] out_dtype, lse f32[B, Tq, Hq])``.
    """
    config = MosaicConfig() if config is None else config
    (o, m2, l), f = _kernel_call(q, page_table, kv_lens, layer, low, high, high_table, geom=geom, sm_scale=sm_scale,
                                 interpret=interpret, out_dtype=out_dtype, config=config)
    b, tq, hq, _ = q.shape
    h = low[0].shape[3]
    group = hq // h
    use_high, splits, n_rows = f["use_high"], f["splits"], f["n_rows"]

    # ---- edge blocks (retained first-N / last-N rows from the twin, the causal region among the new tokens, rows
    # at or past n): the Triton kernel with the interior skipped; merged by LSE
    edge = edge_config(config, b, h, q.shape[-1], low[0].shape[4])
    oe, me, le = triton.paged_decode_partials(
        q, page_table, kv_lens, layer, low, high if use_high else None, None, high_table if use_high else None,
        geom=geom if use_high else None, sm_scale=f["sm_scale"], interpret=interpret, out_dtype=f["out_dtype"],
        config=edge, skip_interior=True, interior_tokens=f["interior_tokens"])
    o = o.reshape(splits, b, h, f["o_rows"], -1, HEAD_DIM // 2)
    out, lse = _merge_with_edge(o, m2.reshape(splits, b, h, n_rows), l.reshape(splits, b, h, n_rows), oe, me, le,
                                rows=tq * group, vmul=f["gs_l"][1] * LOW_DOMAIN, pairs=f["pairs"])
    out, lse = ungroup_rows(out, lse, tq, group)
    return out.astype(f["out_dtype"]), lse


def edge_config(config: MosaicConfig, batch: int, heads: int, head_dim: int, page: int) -> TritonConfig:
    """The edge blocks' `TritonConfig` of a call: ``config.edge`` with its ``num_splits`` None ->
    `mosaic_edge_splits`, and one stage at head_dim 256 with pages above `WIDE_PIPELINED_MAX_PAGE` (shared memory)."""
    edge = config.edge
    if edge.num_splits is None:
        edge = dataclasses.replace(edge, num_splits=mosaic_edge_splits(batch, tuning_heads(config, heads)))
    if head_dim == WIDE_HEAD_DIM and page > WIDE_PIPELINED_MAX_PAGE:
        edge = dataclasses.replace(edge, num_stages=1)
    return edge


@functools.partial(jax.jit, static_argnames=_STATIC)
def kernel_partials(q, page_table, kv_lens, layer=0, low=None, high=None, high_table=None, *,
                    geom: Optional[TwinGeometry] = None, sm_scale: Optional[float] = None, interpret: bool = False,
                    out_dtype=None, config: Optional[MosaicConfig] = None):
    """The Mosaic GPU kernel alone (no edge blocks, no merge; for benchmarks and tests): its raw split partials
    ``(o f32[S * B * H, R, parts, 64], m2, l f32[S * B * H, N])`` (CTA ``(s * B + b) * H + h``; ``o`` per query row
    each column block's even / odd half (`dim_blocks`: 2 parts, 4 at head_dim 256), each in `WIDE_COLUMNS` order,
    low domain; ``m2`` base 2; ``R`` = ``N`` query rows with
    keys on M, 64 with queries on M)."""
    config = MosaicConfig() if config is None else config
    return _kernel_call(q, page_table, kv_lens, layer, low, high, high_table, geom=geom, sm_scale=sm_scale,
                        interpret=interpret, out_dtype=out_dtype, config=config)[0]


def _merge_with_edge(o, m2, l, oe, me, le, *, rows: int, vmul, pairs: bool = False):
    """LSE merge of the kernel's split partials with the edge kernel's, each summed over its own splits first.

    ``o`` f32 ``[S, B, H, R, parts, 64]`` (per query row each column block's even / odd half, each in `WIDE_COLUMNS`
    order, low domain), ``m2`` (base 2), ``l`` f32 ``[S, B, H, R]``; ``oe`` f32 ``[Se, B, H, R', D]`` (true scale,
    natural columns), ``me``, ``le`` f32 ``[Se, B, H, R']``; the first ``rows`` query rows are real, the rest never
    read. ``vmul``: the kernel's output scale (``gs_v * 2^-7``); ``pairs``: the kernel ran head_dim 64 as token pairs
    (`as_token_pairs`: its rows ``2 r``, ``2 r + 1`` are row ``r``'s halves). -> ``(out f32[B, H, rows, D], lse f32[B,
    H, rows])``; a row that saw no key gives 0 and -inf (`normalize_merged`, as `merge_partials`). The kernel's partials
    are weighted and summed over its splits in the layout it wrote them, in a fixed order (`sum_splits`: a shard's merge
    is one device's); the column permutation and the half interleave then act within each row of the ``[B, H, rows,
    parts, 64]`` sum. (Concatenating both kernels' partials in natural column order and merging them with
    `merge_partials` cost a transpose of every split's tile; this form measured less GPU time per call at Tq 4 on the
    H200 and level at Tq 1, bench/RESULTS.md.)"""
    b, h = o.shape[1:3]
    k_rows = 2 * rows if pairs else rows                                     # the kernel's rows (`as_token_pairs`)
    m = m2[..., :k_rows] * (1.0 / _LOG2E)
    l, me, le = l[..., :k_rows], me[..., :rows], le[..., :rows]
    m_k = m.max(axis=0)
    if pairs:                                                                 # row r's halves: rows 2 r, 2 r + 1
        m_k = m_k.reshape(b, h, rows, 2).max(axis=-1)
    m_g = jnp.maximum(m_k, me.max(axis=0))                                    # [B, H, rows]
    w, we = jnp.exp(m - (jnp.repeat(m_g, 2, axis=-1) if pairs else m_g)[None]), jnp.exp(me - m_g[None])
    l_k = sum_splits(w * l)                                                  # fixed order (`sum_splits`)
    l_g = (l_k.reshape(b, h, rows, 2).sum(axis=-1) if pairs else l_k) + sum_splits(we * le)
    o_k = sum_splits(w[..., None, None] * o[:, :, :, :k_rows])                 # [B, H, k_rows, parts, 64]
    if pairs:             # the even token's V fills natural columns 0-63 of its row's half 0, the odd's 64-127 of half
        o_k = o_k.reshape(b, h, rows, 2, HEAD_DIM)       # 1: only those columns are gathered
        o_k = (jnp.take(o_k[..., 0, :], _KERNEL_COLUMNS[:PAIR_HEAD_DIM], axis=-1)
               + jnp.take(o_k[..., 1, :], _KERNEL_COLUMNS[PAIR_HEAD_DIM:], axis=-1))
    else:
        d = o_k.shape[-2] * o_k.shape[-1]
        o_k = jnp.take(o_k.reshape(b, h, rows, d), kernel_columns(d), axis=-1)        # natural column order
    return normalize_merged(o_k * vmul + sum_splits(we[..., None] * oe[:, :, :, :rows]), m_g, l_g)
