"""Inline Mosaic GPU / PTX helpers of the Mosaic GPU decode kernel (`pallas_kernels.decode.mosaic_sm90`).

Each is a ``plgpu.inline_mgpu`` body over one warpgroup's WGMMA register fragments, written for the kernel's tiles:
64-token blocks (`BLOCK_K`) of head_dim 128 (`HEAD_DIM`; head_dim 256 as two such column blocks), each split in its
even / odd column halves.

* `dequant_inline`: packed NVFP4 bytes + E4M3 scales in shared memory -> one column block's f16 ``[64, 64]`` halves in
  registers (`E2M1_F16_PTX` and `SCALE_PAIR_PTX`).
* `key_max_inline`: the maximum over the keys of a ``[64 keys, N]`` score tile with one warpgroup barrier.
* `l_update_inline`: the per-thread partial sums of the softmax denominator, two key rows per thread in one.
* `store_keys_minor`, `store_transposed`: a WGMMA tile stored transposed into shared memory.

Compiled path only: the Mosaic GPU interpreter has no ``inline_mgpu`` (the kernel runs jnp forms there).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jmixedkv.compat import plgpu
from pallas_kernels.nvfp4_ops import E2M1_F16_PTX

__all__ = ["BLOCK_K", "HEAD_DIM", "SCALE_PAIR_PTX", "dequant_inline", "key_max_inline", "l_update_inline",
           "store_keys_minor", "store_transposed"]

BLOCK_K = 64             # tokens per step (the wgmma K of P V, N of Q K^T)
HEAD_DIM = 128


# E4M3 scale bytes 0 and 1 of $2 -> $0, $1 = f16x2 (s, s) * 2^7 each (the low domain's scale factor, exact): both
# bytes converted by one cvt and scaled by one multiply, then each half broadcast by a prmt (5 instructions; was 9 with
# a broadcast, a convert and a multiply per byte)
SCALE_PAIR_PTX = """{
.reg .b32 a, k;
.reg .b16 p;
mov.b32 k, 0x58005800;
cvt.u16.u32 p, $2;
cvt.rn.f16x2.e4m3x2 a, p;
mul.rn.f16x2 a, a, k;
prmt.b32 $0, a, 0, 0x1010;
prmt.b32 $1, a, 0, 0x3232;
}"""


def dequant_inline(b_ref, s_ref, halves=("lo", "hi"), block=0):
    """Compiled path: packed bytes ``u8[nb, box, 64 c]`` + scales ``e4m3[nb, rows, bytes]`` (a box's ``8 c`` scales
    per token, token-major, in rows of up to 128 bytes: ``[nb, box / 16, 128]`` at head_dim 128, ``[nb, 1, 64]`` at
    8-token boxes; the block's 64 tokens as ``nb`` TMA boxes of ``box`` tokens; ``c`` = head_dim / 128 column blocks
    per row) in shared memory -> column block ``block``'s ``(even, odd)`` f16 ``[64, 64]`` in the WGMMA register
    layout, columns in `WIDE_COLUMNS` order, low domain ``e2m1 * s * 2^-7`` (exact). Per thread and row: one 16-byte
    load of packed bytes, one 2-byte load of scales, then `E2M1_F16_PTX` per 4 bytes (~2 instructions per element).
    ``halves``: the ones to return (``("lo",)``: the even columns only, half the conversions, but every load: a
    caller taking the halves in two calls loads the bytes and scales twice)."""
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, vector

    out_t = plgpu.ShapeDtypeStruct((BLOCK_K, HEAD_DIM // 2), jnp.float16, layout=plgpu.Layout.WGMMA)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()), return_type=tuple(out_t for _ in halves))
    def body(ctx, b, s):
        del ctx
        layout = fa.WGMMA_LAYOUT
        shape = (BLOCK_K, HEAD_DIM // 2)
        i8, i16, i32 = (ir.IntegerType.get_signless(w) for w in (8, 16, 32))
        idx_t = ir.IndexType.get()
        f16x2 = ir.VectorType.get((2,), ir.F16Type.get())
        reg_shape = layout.registers_shape(shape)
        outs = {h_: np.empty(reg_shape, dtype=object) for h_ in halves}
        ci = lambda v: arith.constant(i32, v)  # noqa: E731
        contig = (shape[1], 1)
        tile_strides = layout.tiling.tile_strides(contig)
        dyn_strides = [ci(st_) for st_ in tile_strides[-layout.tiled_tiling_rank:]]
        base = arith.addi(mgu.dyn_dot(layout.warp_indices(), dyn_strides),
                          mgu.dyn_dot(layout.lane_indices(), dyn_strides))
        row0 = arith.divui(base, ci(shape[1]))
        quad = arith.divui(arith.remui(base, ci(shape[1])), ci(2))           # lane % 4
        to_idx = lambda v: arith.index_castui(idx_t, v)  # noqa: E731
        s_vec = ir.VectorType.get((2,), ir.MemRefType(s.type).element_type)
        b_vec = ir.VectorType.get((16,), ir.MemRefType(b.type).element_type)
        words_t = ir.VectorType.get((4,), i32)
        struct2 = ir.Type.parse("!llvm.struct<(i32, i32)>")
        regs = {}                                                             # (row offset, j) -> {half: f16x2}
        box = ir.MemRefType(b.type).shape[1]
        s_shape = ir.MemRefType(s.type).shape
        s_row = s_shape[-1]                           # bytes per row of scales: 128, 64 under 8-token boxes
        per_token = s_shape[-2] * s_row // box        # scales per token: 8 per column block
        col0, s_col0 = HEAD_DIM // 2 * block, 8 * block   # the column block's first byte and scale in a row

        def first_byte():                             # this thread's first byte of the row: 16 quad (+ col0)
            byte0 = arith.muli(quad, ci(16))
            return arith.addi(byte0, ci(col0)) if col0 else byte0
        for r_off in (0, 8):
            row = arith.addi(row0, ci(r_off))
            bx, r_in = arith.divui(row, ci(box)), arith.remui(row, ci(box))     # the row's TMA box, its row there
            # 16 bytes: this thread's columns of the row; scales of 8-byte blocks 2 quad, 2 quad + 1 (flat row * 8)
            bv = vector.load(b_vec, b, [to_idx(bx), to_idx(r_in), to_idx(first_byte())], alignment=16)
            words = vector.bitcast(words_t, mgu.bitcast(bv, ir.VectorType.get((16,), i8)))
            sflat = arith.addi(arith.muli(r_in, ci(per_token)), arith.muli(quad, ci(2)))
            if s_col0:
                sflat = arith.addi(sflat, ci(s_col0))
            sv = vector.load(s_vec, s, [to_idx(bx), to_idx(arith.divui(sflat, ci(s_row))),
                                        to_idx(arith.remui(sflat, ci(s_row)))], alignment=2)
            sv = arith.extui(i32, mgu.bitcast(mgu.bitcast(sv, ir.VectorType.get((2,), i8)), i16))
            sc = llvm.inline_asm(struct2, [sv], SCALE_PAIR_PTX, "=r,=r,r", has_side_effects=False)
            sc = [llvm.extractvalue(i32, sc, [k]) for k in (0, 1)]
            for k in range(4):                                                # word k: columns j = 2k, 2k + 1
                w = vector.extract(words, [], [k])
                f = sc[k // 2]
                pair = {h: llvm.inline_asm(struct2, [w, f, f], E2M1_F16_PTX[h], "=r,=r,r,r,r",
                                           has_side_effects=False) for h in halves}
                for e in (0, 1):
                    regs[(r_off, 2 * k + e)] = {h: mgu.bitcast(llvm.extractvalue(i32, p_, [e]), f16x2)
                                                for h, p_ in pair.items()}
        for reg_idx in np.ndindex(reg_shape):
            lin = sum(i * st_ for i, st_ in zip(reg_idx, tile_strides))
            r_off, c_off = divmod(lin, shape[1])
            for h_ in halves:
                outs[h_][reg_idx] = regs[(r_off, c_off // 8)][h_]
        return tuple(mgpu.FragmentedArray(_registers=outs[h_], _layout=layout, _is_signed=None) for h_ in halves)

    return body(b_ref, s_ref)


def key_max_inline(s, red_ref):
    """Compiled path: ``s`` f32 ``[64 keys, N]`` in the WGMMA layout -> its maximum over the keys, ``[N]`` in the layout
    ``WGMMA.reduce(0)``, with **one** warpgroup barrier. Each warp reduces its 16 keys in registers and warp
    shuffles, writes its ``N`` maxima to ``red_ref`` (``f32[4 N]``, warp-major), and after the barrier every
    thread reads the four warps' values of its columns. Pallas' own reduction (``s.max(axis=0)``) places a second
    barrier after the reads, to protect its scratch for the next reduction; here the caller guarantees that a
    warpgroup barrier separates these reads from the next call's writes (`pallas_kernels.decode.mosaic_sm90`'s
    keys-on-M step: its commit before ``P V``)."""
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, vector

    out_layout = plgpu.Layout.WGMMA.reduce(0)

    def body(ctx, x, red):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        idx_t = ir.IndexType.get()
        ci = lambda v: arith.constant(i32, v)  # noqa: E731
        rows, cols = x.shape
        regs = x.registers                                # (1, N / 8, 1, 1, 2, 1, 1, 1, 1): column tile j, row half
        assert rows == BLOCK_K and regs.shape == (1, cols // 8, 1, 1, 2, 1, 1, 1, 1), regs.shape
        tid = arith.remui(mgu.thread_idx(), ci(128))
        warp = arith.divui(tid, ci(32))
        quad = arith.remui(tid, ci(4))                    # this thread's columns: 8 j + 2 quad + {0, 1}
        vec_t = ir.VectorType.get((2,), ir.F32Type.get())
        to_idx = lambda v: arith.index_castui(idx_t, v)  # noqa: E731
        quad2 = arith.muli(quad, ci(2))
        col = [arith.addi(ci(8 * j), quad2) for j in range(cols // 8)]   # column j's pair of this thread
        for j in range(cols // 8):
            v = arith.maximumf(regs[0, j, 0, 0, 0, 0, 0, 0, 0], regs[0, j, 0, 0, 1, 0, 0, 0, 0])
            for dist in (4, 8, 16):                       # the 8 lanes that share quad: 8 rows each of 2 halves
                v = arith.maximumf(v, mgu.shfl_bfly(v, dist))
            vector.store(v, red, [to_idx(arith.addi(arith.muli(warp, ci(cols)), col[j]))])
        mgu.warpgroup_barrier()
        out = np.empty((cols // 8, 1, 1), dtype=object)
        for j in range(cols // 8):
            parts = [vector.load(vec_t, red, [to_idx(arith.addi(ci(w * cols), col[j]))]) for w in range(4)]
            out[j, 0, 0] = arith.maximumf(arith.maximumf(parts[0], parts[1]), arith.maximumf(parts[2], parts[3]))
        return mgpu.FragmentedArray(_registers=out, _layout=fa.WGMMA_LAYOUT.reduce((0,)), _is_signed=None)

    ret = plgpu.ShapeDtypeStruct((s.shape[1],), jnp.float32, layout=out_layout)
    return plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()), return_type=ret)(body)(s, red_ref)


def l_update_inline(l, alpha, p):
    """Compiled path, keys on M: ``l * alpha + p`` for ``l``, the ``[64 keys, N]`` tile of per-thread partial sums
    (WGMMA layout; ``alpha`` ``[N]`` in ``WGMMA.reduce(0)``, ``p`` like ``l``), with each thread's two key rows
    (``16 warp + lane / 4`` and ``+ 8``) summed into the first and the second left zero: the loop then carries half of
    ``l``'s registers (the compiler folds a loop-carried zero), and the sum over the keys after the loop is the
    same sum."""
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith

    def body(ctx, l_, a_, p_):
        del ctx
        regs_l, regs_p, regs_a = l_.registers, p_.registers, a_.registers
        cols = l_.shape[1]
        assert regs_l.shape == (1, cols // 8, 1, 1, 2, 1, 1, 1, 1), regs_l.shape
        f32 = ir.F32Type.get()
        vec_t = ir.VectorType.get((2,), f32)
        zero = arith.constant(vec_t, ir.DenseElementsAttr.get_splat(vec_t, ir.FloatAttr.get(f32, 0.0)))
        out = np.empty(regs_l.shape, dtype=object)
        for j in range(cols // 8):
            i0, i1 = (0, j, 0, 0, 0, 0, 0, 0, 0), (0, j, 0, 0, 1, 0, 0, 0, 0)
            acc = arith.addf(arith.mulf(regs_l[i0], regs_a[j, 0, 0]), regs_p[i0])
            out[i0] = arith.addf(acc, regs_p[i1])
            out[i1] = zero
        return mgpu.FragmentedArray(_registers=out, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

    ret = plgpu.ShapeDtypeStruct(l.shape, jnp.float32, layout=plgpu.Layout.WGMMA)
    return plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(0), plgpu.Layout.WGMMA),
                             return_type=ret)(body)(l, alpha, p)


def store_keys_minor(p, p_ref):
    """Compiled path: ``p`` f16 ``[64 keys, N]`` in the WGMMA layout stored as its transpose into ``p_ref`` (f16 ``[N,
    64]``, tiles of ``(8, 64)`` at the 128-byte swizzle; N = 8), so that a transposed view of ``p_ref`` is ``P^T`` at
    a swizzle wgmma has (a ``[64, 8]`` tile would need 16-byte rows, which it has not; Pallas cannot store through a
    transposed swizzled view). Each thread holds keys ``16 warp + lane / 4 + 8 h`` and columns ``2 (lane % 4) + {0,
    1}``: four 2-byte stores. Element ``(n, k)`` sits at ``64 n + 8 ((k / 8) ^ (n % 8)) + k % 8`` (the swizzle XORs a
    row's 16-byte chunk index with the row index mod 8)."""
    from jax.experimental.mosaic.gpu import utils as mgu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, memref, vector

    rows_n = p.shape[1]

    def body(ctx, x, ref):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        idx_t = ir.IndexType.get()
        ci = lambda v: arith.constant(i32, v)  # noqa: E731
        regs = x.registers                                 # (1, 1, 1, 1, 2, 1, 1, 1, 1): row half h
        assert x.shape == (BLOCK_K, 8) and regs.shape == (1, 1, 1, 1, 2, 1, 1, 1, 1), (x.shape, regs.shape)
        flat = mgu.memref_reshape(ref, (rows_n * BLOCK_K,))
        tid = arith.remui(mgu.thread_idx(), ci(128))
        lane = arith.remui(tid, ci(32))
        key0 = arith.addi(arith.muli(arith.divui(tid, ci(32)), ci(16)), arith.divui(lane, ci(4)))
        col0 = arith.muli(arith.remui(lane, ci(4)), ci(2))
        for h in range(2):
            key = arith.addi(key0, ci(8 * h))
            chunk, within = arith.divui(key, ci(8)), arith.remui(key, ci(8))
            for e in range(2):
                n = arith.addi(col0, ci(e))
                pos = arith.addi(arith.addi(arith.muli(n, ci(BLOCK_K)),
                                            arith.muli(arith.xori(chunk, n), ci(8))), within)
                val = vector.extract(regs[0, 0, 0, 0, h, 0, 0, 0, 0], [], [e])
                memref.store(val, flat, [arith.index_castui(idx_t, pos)])

    tiles = (plgpu.TilingTransform((8, BLOCK_K)), plgpu.SwizzleTransform(128))     # p_ref's, as allocated
    plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(tiles)))(body)(p, p_ref)


def store_transposed(acc, o_ref):
    """Compiled path: ``acc`` f32 ``[64, N]`` in the WGMMA layout (keys on M: ``O^T``, head dims x query rows) stored
    as its transpose into ``o_ref`` (f32 ``[N, 64]``, untiled): the partial output leaves the kernel query-row major,
    as the queries-on-M form writes it, so the merge after the kernel reads it without a transpose. Each thread holds
    rows ``16 warp + lane / 4 + 8 h`` and columns ``8 j + 2 (lane % 4) + e``: ``N / 2`` 4-byte stores, once per CTA."""
    from jax.experimental.mosaic.gpu import utils as mgu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, memref, vector

    rows, cols = acc.shape

    def body(ctx, x, ref):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        idx_t = ir.IndexType.get()
        ci = lambda v: arith.constant(i32, v)  # noqa: E731
        regs = x.registers                                 # (1, N / 8, 1, 1, 2, 1, 1, 1, 1): column tile j, row half h
        assert rows == 64 and regs.shape == (1, cols // 8, 1, 1, 2, 1, 1, 1, 1), regs.shape
        flat = mgu.memref_reshape(ref, (rows * cols,))
        tid = arith.remui(mgu.thread_idx(), ci(128))
        lane = arith.remui(tid, ci(32))
        row0 = arith.addi(arith.muli(arith.divui(tid, ci(32)), ci(16)), arith.divui(lane, ci(4)))
        col0 = arith.muli(arith.remui(lane, ci(4)), ci(2))
        for j in range(cols // 8):
            for h in range(2):
                row = arith.addi(row0, ci(8 * h))
                for e in range(2):
                    col = arith.addi(col0, ci(8 * j + e))
                    pos = arith.addi(arith.muli(col, ci(rows)), row)
                    val = vector.extract(regs[0, j, 0, 0, h, 0, 0, 0, 0], [], [e])
                    memref.store(val, flat, [arith.index_castui(idx_t, pos)])

    plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))(body)(acc, o_ref)
