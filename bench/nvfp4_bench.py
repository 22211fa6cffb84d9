"""NVFP4 quantize / dequantize kernels on the GPU: bit-exactness first, then bandwidth vs a device copy.

Run on the H200:   PYTHONPATH=. python3 bench/nvfp4_bench.py --out bench/out
On a CPU machine it prints a message and exits 0 (``--smoke`` runs a tiny interpret-mode check instead).

What it does:
1. Bit-exactness of the Pallas kernels (the library kernel and every experimental variant below, default tiling)
   against the XLA reference on the same GPU and the pinned reference on the host CPU, for D in {64, 128, 256,
   576}, scalar and per-row gs, rows not a multiple of the block (``--quick``: the variants for two of those
   cases).
2. Timing (warmup, then the median over ``--samples`` samples of ``--inner`` back-to-back calls) on
   ``bf16[rows, 128]`` with rows = 2^22 (1 GiB) by default:
   - device copy of the same bytes: ``jax.jit(jnp.copy)`` and torch ``dst.copy_(src)`` when torch+CUDA exist;
     a JAX elementwise op (``x * 2``) for reference;
   - the XLA-compiled reference codec;
   - quantize kernels: every ``impl`` of `quantize_variant` ("v1", and the per-block "pairs" / "blocked" /
     "strided", with ``recip="table"``, ``scale_cvt`` and ``code_impl="compare"``) over tilings (block_rows,
     sub_rows, num_warps, num_stages, width); each timed variant is first checked bit-exact on the timed input
     against the XLA reference; ``--quick`` runs the 9 configs of ``QUANT_QUICK`` (the old best v1 tiling + 8
     new ones) and one dequantize tiling;
   - dequantize kernels over a sweep of tilings.
   Bytes counted = bytes read + bytes written; "frac" = GB/s over the best copy GB/s.
3. Writes ``--out/nvfp4_bench.json`` and appends a dated section to ``bench/RESULTS.md``.

The experimental quantize variants live here, not in the library: `pallas_kernels.nvfp4.quantize` is the one
kernel the library ships (the per-block "pairs" / "blocked" kernel, the fastest bit-exact variant measured);
`quantize_variant` re-creates the others from the shared in-kernel arithmetic of `pallas_kernels.nvfp4_ops`.
"""
from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax import lax  # noqa: E402

from jmixedkv import nvfp4  # noqa: E402
from jmixedkv.compat import on_gpu, pl, pltriton, triton_params  # noqa: E402
from jmixedkv.numerics import BLOCK, E4M3_MAX, SIXTH, keep  # noqa: E402
from pallas_kernels import nvfp4 as K  # noqa: E402
from pallas_kernels import nvfp4_ops as ops  # noqa: E402

# ------------------------------------------------------------------------------ experimental quantize variants
#: quantize kernel variants of `quantize_variant`: "v1" = the original 2-D kernel; the others are per-block 3-D
QUANT_IMPLS = ("v1", "blocked", "strided", "pairs")
#: "probe": the "pairs" kernel's loads, stores and tiling with almost no arithmetic (NOT a quantizer: its bytes are
#: meaningless): the bandwidth this kernel structure reaches in Pallas Triton, the ceiling for the arithmetic
PROBE = "probe"


def _magnitude_compare(y, nonneg=False):
    """|E2M1 code| by 7 threshold compares (``code_impl="compare"``; the library uses `nvfp4_ops.e2m1_magic_bits`,
    the minimum of three magic-constant lines)."""
    a = y if nonneg else jnp.abs(y)
    return ((a > 0.25).astype(jnp.int32) + (a >= 0.75).astype(jnp.int32) + (a > 1.25).astype(jnp.int32)
            + (a >= 1.75).astype(jnp.int32) + (a > 2.5).astype(jnp.int32) + (a >= 3.5).astype(jnp.int32)
            + (a > 5.0).astype(jnp.int32))


def _magnitude(code_impl):
    return _magnitude_compare if code_impl == "compare" else ops.e2m1_code_magnitude


def _e4m3_byte_cvt(s):
    """E4M3 byte (int32) of float32 ``s`` in [0, 448] or NaN by the sm_89+ instruction
    ``cvt.rn.satfinite.e4m3x2.f32`` (RNE; NaN -> 0x7F). GPU only; both halves get ``s``, the low byte is kept."""
    [b] = pltriton.elementwise_inline_asm(
        "{ .reg .b16 t; cvt.rn.satfinite.e4m3x2.f32 t, $1, $1; cvt.u32.u16 $0, t; }",
        args=[s], constraints="=r,f", pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(s.shape, jnp.int32)])
    return b & 0xFF


def _block_quant_variant(amax_bits, gs, exact_asm, rtab_ref=None, e4m3_cvt=False):
    """`pallas_kernels.nvfp4_ops.block_quant` with two experiments: ``rtab_ref`` (f32[128] table of ``r`` per scale
    byte, `_recip_table`, scalar gs only) instead of the per-block exact division, and ``e4m3_cvt`` (GPU only) the
    hardware E4M3 conversion instead of the integer rounding."""
    if rtab_ref is None and not (e4m3_cvt and exact_asm):
        return ops.block_quant(amax_bits, gs, exact_asm)
    amax = ops.from_bits(amax_bits)
    enc = ops.recip(gs, exact_asm)
    t = amax * float(SIXTH)
    s = enc * keep(t, t)
    s = jnp.where(s > E4M3_MAX, E4M3_MAX, s)
    s = jnp.where(s < 0.0, 0.0, s)
    if e4m3_cvt and exact_asm:
        byte, nan = _e4m3_byte_cvt(s), s != s
        sf = ops.e4m3_decode(byte)
    else:
        byte, sf, nan = ops.e4m3_encode(s)
    if rtab_ref is not None:
        return byte, rtab_ref[byte], nan                                          # byte in [0, 127]
    prod = sf * gs
    return byte, jnp.where(sf == 0.0, 0.0, ops.recip(keep(prod, prod), exact_asm)), nan


def _recip_table(gs):
    """f32[128]: ``r`` of the pinned order for each E4M3 scale byte and the scalar decode scale ``gs`` (f32[1]),
    computed by XLA with IEEE division (0 for byte 0 and the NaN byte 0x7F, whose codes are masked anyway)."""
    b = jnp.arange(128, dtype=jnp.int32)
    sf = ops.e4m3_decode(b)
    prod = jnp.where(b == 0x7F, 1.0, sf * gs[0])
    r = jnp.float32(1.0) / keep(prod, prod)
    return jnp.where((sf == 0.0) | (b == 0x7F), jnp.float32(0.0), r)


def _quant_kernel_v1(x_ref, gs_ref, packed_ref, scales_ref, *, sub_rows, n_sub, width, per_row, exact_asm,
                     code_impl):
    """The original 2-D kernel: ``[S, W]`` tiles reshaped to ``[S, W/16, 16]`` in the kernel."""
    nb = width // BLOCK
    mag = _magnitude(code_impl)

    def tile(rows):
        xf = x_ref[rows, :].astype(jnp.float32)                                  # [S, W]
        gs = (gs_ref[rows] if per_row else gs_ref[...]).reshape(-1, 1)
        amax_bits = jnp.max((ops.as_bits(xf) & 0x7FFFFFFF).reshape(sub_rows, nb, BLOCK), axis=-1)
        byte, r, nan = ops.block_quant(amax_bits, gs, exact_asm)
        y = (xf.reshape(sub_rows, nb, BLOCK) * r[:, :, None]).reshape(sub_rows, width)
        code = mag(y) | ((ops.as_bits(y) >> 28) & 8)
        lo, hi = jnp.unstack(code.reshape(sub_rows, width // 2, 2), axis=-1)
        nan_h = jnp.broadcast_to(nan[:, :, None], (sub_rows, nb, BLOCK // 2)).reshape(sub_rows, width // 2)
        packed_ref[rows, :] = jnp.where(nan_h, 0, lo | (hi << 4)).astype(jnp.uint8)
        scales_ref[rows, :] = byte.astype(jnp.uint8)

    K.tile_loop(n_sub, sub_rows, tile)


def _words(b):
    """Bytes (int32 0..255) ``[..., 4k]`` -> little-endian int32 words ``[..., k]`` (byte ``4j + t`` at bits 8t)."""
    b4 = b.reshape(*b.shape[:-1], b.shape[-1] // 4, 4)
    return jnp.sum(b4 << (lax.broadcasted_iota(jnp.int32, b4.shape, b4.ndim - 1) * 8), axis=-1)


def _quant_kernel_blocked(x_ref, gs_ref, *refs, sub_rows, n_sub, per_row, exact_asm, code_impl, impl, table,
                          e4m3_cvt, words=0):
    """The per-block kernels: "blocked" (jnp.unstack), "strided" (two stride-2 ref loads), "pairs" (int32 view).
    ``words``: 1 = packed codes stored as int32 words (4 bytes each), 2 = the scale bytes too."""
    rtab_ref, packed_ref, scales_ref = refs if table else (None, *refs)
    mag = _magnitude(code_impl)

    def tile(rows):
        gs = (gs_ref[rows] if per_row else gs_ref[...]).reshape(-1, 1)
        if impl == PROBE:
            u = x_ref[rows, :, :]
            packed_ref[rows, :, :] = (u & 0xFF).astype(jnp.uint8)
            scales_ref[rows, :] = (jnp.max(u, axis=-1) & 0xFF).astype(jnp.uint8)
            return
        if impl == "pairs":
            lo, hi, signs = ops.bf16_pair_halves(x_ref[rows, :, :])
        elif impl == "strided":
            xl = ops.as_bits(x_ref[rows, :, pl.ds(0, BLOCK // 2, stride=2)].astype(jnp.float32))
            xh = ops.as_bits(x_ref[rows, :, pl.ds(1, BLOCK // 2, stride=2)].astype(jnp.float32))
            lo, hi, signs = xl & 0x7FFFFFFF, xh & 0x7FFFFFFF, ((xl >> 28) & 0x08) | ((xh >> 24) & 0x80)
        else:
            lo, hi, signs = ops.f32_halves(ops.as_bits(x_ref[rows, :, :].astype(jnp.float32)))
        amax_bits = jnp.max(jnp.maximum(lo, hi), axis=-1)
        byte, r, nan = _block_quant_variant(amax_bits, gs, exact_asm, rtab_ref, e4m3_cvt)
        r3 = r[:, :, None]
        m = lambda b: mag(ops.from_bits(b) * r3, nonneg=True)  # noqa: E731
        packed = jnp.where(nan[:, :, None], 0, m(lo) | (m(hi) << 4) | signs)
        packed_ref[rows, :, :] = _words(packed) if words else packed.astype(jnp.uint8)
        scales_ref[rows, :] = _words(byte) if words == 2 else byte.astype(jnp.uint8)

    K.tile_loop(n_sub, sub_rows, tile)


def quantize_variant(x, global_scale=1.0, *, impl: str = "pairs", code_impl: str = "magic", recip: str = "div",
                     scale_cvt: bool = False, block_rows: int = 32, sub_rows: int = 32, num_warps: int = 4,
                     num_stages: int = 1, width=None, interpret=None, words: int = 0):
    """An experimental NVFP4 quantize kernel (all bit-exact against `jmixedkv.nvfp4.quantize_reference`; they differ
    only in speed). ``impl``: "v1" | "blocked" | "strided" | "pairs" ("pairs" runs "blocked" for non-bf16 input);
    ``code_impl``: "magic" | "compare"; ``recip``: "div" | "table" (per-block variants, scalar gs);
    ``scale_cvt``: hardware E4M3 rounding (per-block variants, GPU). Tiling as `pallas_kernels.nvfp4.quantize`.
    ``words`` (per-block variants): 1 = the packed codes leave the kernel as int32 words (4 bytes per store
    element instead of 1), 2 = the scale bytes too (needs ``W / 16 % 4 == 0``); bit-cast to bytes outside.
    ``impl="pairs"`` with the other options at their defaults is the library kernel."""
    x = jnp.asarray(x)
    if impl not in QUANT_IMPLS + (PROBE,) or code_impl not in ("magic", "compare") or recip not in ("div", "table"):
        raise ValueError(f"quantize_variant: impl={impl!r} code_impl={code_impl!r} recip={recip!r}")
    rows, d = x.shape
    K.check_warps(num_warps, num_stages)
    w = K.row_width(d, width)
    rep = d // w
    n = rows * rep
    br, sr, n_pad = K.row_tiling(n, block_rows, sub_rows, w)
    xk = x.reshape(n, w)
    if n_pad > n:
        xk = jnp.pad(xk, ((0, n_pad - n), (0, 0)))
    gs, per_row = K.gs_operand(global_scale, rows, rep, n_pad)
    interp = K.resolve_interpret(interpret)
    gs_spec = pl.BlockSpec((br,), lambda i: (i,)) if per_row else pl.BlockSpec((1,), lambda i: (0,))
    params = dict(grid=(n_pad // br,), compiler_params=triton_params(num_warps=num_warps, num_stages=num_stages),
                  interpret=interp, name="nvfp4_quantize")
    nb = w // BLOCK
    scale_spec = pl.BlockSpec((br, nb), lambda i: (i, 0))
    scale_shape = jax.ShapeDtypeStruct((n_pad, nb), jnp.uint8)
    if impl == "v1":
        kernel = functools.partial(_quant_kernel_v1, sub_rows=sr, n_sub=br // sr, width=w, per_row=per_row,
                                   exact_asm=not interp, code_impl=code_impl)
        packed, scales = pl.pallas_call(
            kernel, in_specs=[pl.BlockSpec((br, w), lambda i: (i, 0)), gs_spec],
            out_specs=[pl.BlockSpec((br, w // 2), lambda i: (i, 0)), scale_spec],
            out_shape=[jax.ShapeDtypeStruct((n_pad, w // 2), jnp.uint8), scale_shape], **params)(xk, gs)
    else:
        if impl == "pairs" and x.dtype != jnp.bfloat16:
            impl = "blocked"
        if impl in ("pairs", PROBE):
            xk = lax.bitcast_convert_type(xk.reshape(n_pad, nb, BLOCK // 2, 2), jnp.int32)
            x_spec = pl.BlockSpec((br, nb, BLOCK // 2), lambda i: (i, 0, 0))
        else:
            xk = xk.reshape(n_pad, nb, BLOCK)
            x_spec = pl.BlockSpec((br, nb, BLOCK), lambda i: (i, 0, 0))
        table = recip == "table" and not per_row
        words = int(words) if (words != 2 or nb % 4 == 0) else 1
        kernel = functools.partial(_quant_kernel_blocked, sub_rows=sr, n_sub=br // sr, per_row=per_row,
                                   exact_asm=not interp, code_impl=code_impl, impl=impl, table=table,
                                   e4m3_cvt=bool(scale_cvt), words=words)
        extra_in = [_recip_table(gs)] if table else []
        pw, pdt = (BLOCK // 8, jnp.int32) if words else (BLOCK // 2, jnp.uint8)
        if words == 2:
            scale_spec = pl.BlockSpec((br, nb // 4), lambda i: (i, 0))
            scale_shape = jax.ShapeDtypeStruct((n_pad, nb // 4), jnp.int32)
        packed, scales = pl.pallas_call(
            kernel, in_specs=[x_spec, gs_spec] + [pl.BlockSpec((128,), lambda i: (0,))] * len(extra_in),
            out_specs=[pl.BlockSpec((br, nb, pw), lambda i: (i, 0, 0)), scale_spec],
            out_shape=[jax.ShapeDtypeStruct((n_pad, nb, pw), pdt), scale_shape],
            **params)(xk, gs, *extra_in)
        as_bytes = lambda a: lax.bitcast_convert_type(a, jnp.uint8).reshape(n_pad, -1)  # noqa: E731  little-endian
        packed = as_bytes(packed) if words else packed.reshape(n_pad, w // 2)
        scales = as_bytes(scales) if words == 2 else scales
    if n_pad > n:
        packed, scales = packed[:n], scales[:n]
    scales = lax.bitcast_convert_type(scales, jnp.float8_e4m3fn)
    return packed.reshape(rows, d // 2), scales.reshape(rows, d // BLOCK)



RESULTS_MD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
MD_HEADER = ("# Benchmark results\n\nEach section is appended by a benchmark script "
             "(date, device, versions, shapes, numbers).\n")

# (block_rows, sub_rows, num_warps, num_stages, width): kernel rows are `width` wide (128 = one input row for
# D = 128; 16 = one quantization block per kernel row, no in-kernel reshape)
QUANT_SWEEP = [
    (32, 32, 4, 1, 128), (32, 32, 8, 1, 128), (64, 64, 4, 1, 128), (64, 64, 8, 1, 128), (128, 128, 8, 1, 128),
    (128, 128, 16, 1, 128), (256, 32, 4, 2, 128), (256, 64, 8, 2, 128), (512, 32, 4, 2, 128), (512, 32, 4, 3, 128),
    (512, 64, 8, 2, 128), (512, 16, 2, 2, 128), (1024, 32, 4, 2, 128), (1024, 64, 8, 3, 128),
    (1024, 128, 8, 2, 128), (2048, 64, 8, 2, 128),
    (256, 256, 4, 1, 16), (512, 512, 8, 1, 16), (4096, 256, 4, 2, 16), (4096, 512, 8, 2, 16),
    (1024, 128, 4, 2, 32), (256, 256, 8, 1, 64),
]
# the per-block variants (impl="blocked" | "strided" | "pairs"), as full configs; "quick" marks the ones --quick runs
def _q(impl, br, sub, nw, ns, w=128, **kw):
    return dict(impl=impl, block_rows=br, sub_rows=sub, num_warps=nw, num_stages=ns, width=w, **kw)


QUANT_QUICK = [
    _q("v1", 32, 32, 4, 1),             # the best v1 tiling of the first H200 run (0.592 ms, 55% of copy)
    _q("pairs", 32, 32, 4, 1), _q("pairs", 64, 64, 4, 1), _q("pairs", 128, 64, 8, 2),
    _q("pairs", 32, 32, 4, 1, recip="table"), _q("pairs", 128, 64, 8, 2, recip="table"),
    _q("pairs", 32, 32, 4, 1, recip="table", scale_cvt=True), _q("pairs", 128, 64, 8, 2, recip="table", scale_cvt=True),
    _q("blocked", 32, 32, 4, 1),
    # int32-word stores of the packed codes (words=1) and of the scales too (words=2)
    # (0.589 / 0.588 ms against 0.530 for byte stores; other tilings 0.58-0.98 ms: not the bound)
    _q("pairs", 32, 32, 4, 1, words=1), _q("pairs", 32, 32, 4, 1, words=2),
    # the memory-side ceiling of this kernel structure (not a quantizer, excluded from "best")
    _q(PROBE, 32, 32, 4, 1), _q(PROBE, 64, 64, 8, 1), _q(PROBE, 256, 64, 8, 2), _q(PROBE, 1024, 128, 8, 2),
]
_TILES = ((32, 32, 8, 1), (64, 64, 8, 1), (128, 128, 8, 1), (128, 128, 16, 1), (256, 32, 4, 2), (256, 64, 4, 3),
          (512, 64, 8, 2), (512, 16, 2, 2), (1024, 64, 8, 3), (1024, 128, 8, 2), (2048, 256, 16, 2), (16, 16, 2, 1),
          (16, 16, 1, 1), (4096, 256, 4, 2, 16), (1024, 128, 4, 2, 32))
QUANT_IMPL_SWEEP = [c for c in QUANT_QUICK[1:]] + [
    c for c in ([_q(impl, *t) for impl in ("pairs", "blocked", "strided") for t in _TILES]
                + [_q("pairs", *t, recip="table") for t in _TILES]
                + [_q("pairs", *t, recip="table", scale_cvt=True) for t in _TILES]
                + [_q("blocked", *t, recip="table") for t in _TILES[:6]]
                + [_q("strided", 64, 64, 4, 1)])
    if c not in QUANT_QUICK
]
DEQUANT_SWEEP = [
    (32, 32, 4, 1, 128), (64, 64, 8, 1, 128), (128, 128, 8, 1, 128), (256, 32, 4, 2, 128), (512, 32, 4, 2, 128),
    (512, 64, 8, 2, 128), (1024, 64, 8, 2, 128), (1024, 32, 4, 3, 128), (256, 256, 4, 1, 16),
    (4096, 256, 4, 2, 16),
]


def bench(fn, args, *, inner: int, samples: int, warmup: int = 2):
    """Median seconds per call of ``fn(*args)``; each sample enqueues ``inner`` calls, then blocks."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner)
        del out
    return statistics.median(times), min(times)


def torch_copy_seconds(nbytes: int, *, inner: int, samples: int):
    try:
        import torch
    except Exception:  # noqa: BLE001
        return None, "torch not importable"
    if not torch.cuda.is_available():
        return None, "torch has no CUDA"
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(samples):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            dst.copy_(src)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / inner)
    del src, dst
    torch.cuda.empty_cache()
    return statistics.median(times), f"torch {torch.__version__}"


def _make_input(rows, d, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, d)) * rng.choice([1e-6, 1e-3, 1.0, 30.0, 1e4], (rows, 1))).astype(np.float32)
    x[0, 3] = np.nan
    x[1, 16 + 7] = np.inf
    x[2, 32:48] = 0.0
    x[3, 0:16] = -0.0
    x[4, 16:32] *= 1e-30
    x[5, 0:16] = 6.0 * 448.0
    return jnp.asarray(x, jnp.bfloat16)


@jax.jit
def _count_diff(p, s, pr, sr):
    u8 = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.uint8)
    return jnp.sum(p != pr, dtype=jnp.int32) + jnp.sum(u8(s) != u8(sr), dtype=jnp.int32)


def _mismatch(got, want):
    """Number of packed + scale bytes that differ between two (packed, scales) pairs, counted on ``got``'s
    device (``want`` is moved there: it may come from the host CPU reference)."""
    dev = list(got[0].devices())[0]
    (p, s), (pr, sr) = got, jax.device_put(want, dev)
    return int(_count_diff(p, s, pr, sr))


def bit_exact_checks(quick: bool):
    """Kernels (every impl, default tiling) vs the jitted reference on this GPU AND the pinned reference on the
    host CPU, rows not a multiple of the block; dequantize vs the GPU reference. ``quick``: the per-block impls
    only for (D=128, scalar gs) and (D=576, per-row gs)."""
    results = []
    ref_q = jax.jit(nvfp4.quantize_reference)
    ref_dq = jax.jit(nvfp4.dequantize_reference)
    cpu = jax.devices("cpu")[0]
    for d in (64, 128, 256, 576):
        for per_row in (False, True):
            rows = 4099
            x = _make_input(rows, d, seed=d)
            gs = (jnp.asarray(np.random.default_rng(d).uniform(1e-3, 10.0, rows), jnp.float32) if per_row
                  else nvfp4.global_scale_from_amax(jnp.float32(1e3)))
            with jax.default_device(cpu):
                want_cpu = jax.jit(nvfp4.quantize_reference)(jax.device_put(x, cpu), jax.device_put(gs, cpu))
            want_gpu = ref_q(x, gs)
            impls = (("library",) + QUANT_IMPLS if (not quick or (d, per_row) in ((128, False), (576, True)))
                     else ("library",))
            for impl in impls:
                entry = dict(d=d, rows=rows, per_row_gs=per_row, impl=impl)
                try:
                    fn = K.quantize if impl == "library" else functools.partial(quantize_variant, impl=impl)
                    got = jax.jit(fn)(x, gs)
                    entry["kernel_vs_gpu_reference_mismatch"] = _mismatch(got, want_gpu)
                    entry["kernel_vs_cpu_reference_mismatch"] = _mismatch(got, want_cpu)
                    entry["gpu_vs_cpu_reference_mismatch"] = _mismatch(want_gpu, want_cpu)
                    bad = [k for k in entry if k.endswith("_mismatch") and entry[k]]
                    if impl == "library":
                        out = np.asarray(jax.jit(K.dequantize)(*want_gpu, gs), np.float32)
                        want = np.asarray(ref_dq(*want_gpu, gs), np.float32)
                        entry["dequant_mismatch"] = int(np.sum(~((out == want) | (np.isnan(out) & np.isnan(want)))))
                        bad += ["dequant_mismatch"] if entry["dequant_mismatch"] else []
                    entry["ok"] = not bad
                except Exception as e:  # noqa: BLE001
                    entry["ok"] = False
                    entry["error"] = f"{type(e).__name__}: {e}"[:500]
                results.append(entry)
                print(f"  bit-exact D={d:4d} per_row_gs={per_row!s:5} impl={impl:8s}: "
                      + ("OK" if entry["ok"] else f"FAILED {entry}"), flush=True)
    return results


def smoke():
    """CPU: the library kernel and every experimental variant in interpret mode on 64 x 128 (special blocks
    included), bit for bit against the reference. Returns the exit code."""
    x = _make_input(64, 128, 0)
    want = jax.jit(nvfp4.quantize_reference)(x, jnp.float32(1.0))
    tile = dict(block_rows=32, sub_rows=16, interpret=True)
    cases = [("library", functools.partial(K.quantize, **tile))]
    cases += [(impl, functools.partial(quantize_variant, impl=impl, **tile)) for impl in QUANT_IMPLS]
    cases += [("pairs code_impl=compare", functools.partial(quantize_variant, code_impl="compare", **tile)),
              ("v1 code_impl=compare", functools.partial(quantize_variant, impl="v1", code_impl="compare", **tile)),
              ("pairs recip=table", functools.partial(quantize_variant, recip="table", **tile)),
              ("pairs words=1", functools.partial(quantize_variant, words=1, **tile)),
              ("pairs words=2", functools.partial(quantize_variant, words=2, **tile)),
              ("blocked words=2", functools.partial(quantize_variant, impl="blocked", words=2, **tile)),
              ("blocked float32 input", lambda a, g: quantize_variant(a.astype(jnp.float32), g, impl="blocked",
                                                                       **tile))]
    bad = 0
    for name, fn in cases:
        got = jax.jit(fn)(x, jnp.float32(1.0))
        n = _mismatch(got, want)
        bad += n
        print(f"smoke (interpret mode, 64 x 128) {name}: {'OK' if n == 0 else f'{n} bytes differ'}")
    return 0 if bad == 0 else 1


def _xla_ops_outside_kernel(fn, *args):
    """How many XLA ops (fusions / copies / converts) the compiled ``fn`` runs besides the Triton kernel: a
    non-zero count for impl="pairs" means XLA materialized the bf16 -> int32 pair view (an extra 2 GiB of
    traffic) instead of a free bitcast. -1 if it cannot tell."""
    try:
        text = fn.lower(*args).compile().as_text()
    except Exception:  # noqa: BLE001
        return -1
    ops, entry = 0, False
    for line in text.splitlines():                       # count only the ENTRY computation's instructions
        if line.startswith("ENTRY"):
            entry = True
        elif entry and line.startswith("}"):
            break
        elif entry and any(op in line for op in (" fusion(", " copy(", " bitcast-convert(", " convert(")):
            ops += 1
    return ops


def _cfg_name(cfg):
    short = dict(block_rows="br", sub_rows="sub", num_warps="warps", num_stages="stages", code_impl="code",
                 width="W")
    return " ".join(f"{short.get(k, k)}={v}" for k, v in cfg.items())


def _jaxlib_version():
    try:
        import jaxlib
        return jaxlib.__version__
    except Exception:  # noqa: BLE001
        return "n/a"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/out")
    ap.add_argument("--rows", type=int, default=1 << 22, help="rows of bf16[rows, 128] (default 2^22 = 1 GiB)")
    ap.add_argument("--inner", type=int, default=10)
    ap.add_argument("--samples", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="the 9 most promising quantize configs (< 2 min)")
    ap.add_argument("--smoke", action="store_true", help="on CPU: tiny interpret-mode correctness check")
    ap.add_argument("--no-md", action="store_true", help="do not append to bench/RESULTS.md")
    args = ap.parse_args(argv)

    if not on_gpu():
        print(f"nvfp4_bench: no GPU (jax backend {jax.default_backend()!r}); the benchmark needs the H200. "
              f"Run: PYTHONPATH=. python3 bench/nvfp4_bench.py --out DIR")
        if args.smoke:
            return smoke()
        return 0

    dev = jax.devices()[0]
    try:
        import triton
        triton_version = triton.__version__
    except Exception:  # noqa: BLE001
        triton_version = "n/a"
    meta = dict(date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), device=dev.device_kind,
                jax=jax.__version__, jaxlib=_jaxlib_version(),
                triton=triton_version, python=platform.python_version())
    print(f"nvfp4_bench on {meta['device']} | jax {meta['jax']} | triton {triton_version}", flush=True)

    print("1) bit-exactness, kernel (default tiling) vs the XLA reference on this GPU and on the host CPU", flush=True)
    exact = bit_exact_checks(args.quick)

    rows, d = args.rows, 128
    n_el = rows * d
    x = jax.random.normal(jax.random.key(0), (rows, d), jnp.bfloat16)
    gs = nvfp4.global_scale_from_amax(jnp.max(jnp.abs(x)).astype(jnp.float32))
    gs_rows = jnp.full((rows,), gs, jnp.float32)
    in_bytes, packed_bytes, scale_bytes = n_el * 2, n_el // 2, n_el // 16
    q_bytes = in_bytes + packed_bytes + scale_bytes
    dq_bytes = packed_bytes + scale_bytes + in_bytes
    print(f"2) timing on bf16[{rows}, {d}] = {in_bytes / 2**30:.2f} GiB; quantize moves {q_bytes / 1e9:.3f} GB, "
          f"dequantize {dq_bytes / 1e9:.3f} GB", flush=True)
    kw = dict(inner=args.inner, samples=args.samples)
    rows_out = []

    def record(kind, name, seconds, nbytes, **extra):
        med, best = seconds
        rows_out.append(dict(kind=kind, name=name, ms=med * 1e3, ms_min=best * 1e3, bytes=nbytes,
                             gbps=nbytes / med / 1e9, **extra))
        print(f"   {kind:10s} {name:60s} {med * 1e3:8.3f} ms  {nbytes / med / 1e9:8.1f} GB/s", flush=True)

    def attempt(kind, name, fn, fargs, nbytes, want=None, **extra):
        try:
            if want is not None:      # bit-exact on the timed input too (vs the XLA reference on this GPU)
                extra["exact_on_timed_input"] = _mismatch(fn(*fargs), want) == 0
                if not extra["exact_on_timed_input"]:
                    print(f"   {kind:10s} {name:60s} NOT BIT-EXACT on the timed input", flush=True)
            record(kind, name, bench(fn, fargs, **kw), nbytes, **extra)
        except Exception as e:  # noqa: BLE001
            msg = f"{type(e).__name__}: {e}"
            print(f"   {kind:10s} {name:60s} FAILED: {msg[:300]}", flush=True)
            rows_out.append(dict(kind=kind, name=name, error=msg[:2000], **extra))

    # copies
    attempt("copy", "jax.jit(jnp.copy)", jax.jit(jnp.copy), (x,), 2 * in_bytes)
    attempt("copy", "jax.jit(x * 2) (elementwise)", jax.jit(lambda a: a * 2), (x,), 2 * in_bytes)
    t, why = torch_copy_seconds(in_bytes, **kw)
    if t is not None:
        record("copy", f"torch copy_ ({why})", (t, t), 2 * in_bytes)
    else:
        print(f"   torch copy_ skipped: {why}")
    copy_gbps = max(r["gbps"] for r in rows_out if r["kind"] == "copy" and "gbps" in r and "elementwise" not in r["name"])

    # references
    attempt("reference", "XLA nvfp4.quantize", jax.jit(nvfp4.quantize_reference), (x, gs), q_bytes, op="quantize")
    pr, sr = jax.jit(nvfp4.quantize_reference)(x, gs)
    attempt("reference", "XLA nvfp4.dequantize (bf16)", jax.jit(nvfp4.dequantize_reference), (pr, sr, gs), dq_bytes,
            op="dequantize")

    # kernels
    if args.quick:
        qcfgs = list(QUANT_QUICK)
    else:
        qcfgs = [dict(impl="v1", block_rows=br, sub_rows=sub, num_warps=nw, num_stages=ns, width=w)
                 for br, sub, nw, ns, w in QUANT_SWEEP] + QUANT_IMPL_SWEEP
    seen_impls = set()
    for cfg in qcfgs:
        fn = jax.jit(functools.partial(quantize_variant, **cfg))
        extra = {}
        if cfg["impl"] not in seen_impls:     # once per impl: does XLA add ops around the kernel?
            seen_impls.add(cfg["impl"])
            extra["xla_ops"] = _xla_ops_outside_kernel(fn, x, gs)
            print(f"   (impl={cfg['impl']}: {extra['xla_ops']} XLA ops besides the kernel)", flush=True)
        attempt("quantize", _cfg_name(cfg), fn, (x, gs), q_bytes, want=None if cfg["impl"] == PROBE else (pr, sr),
                op="quantize", config=cfg, **extra)
    done = [r for r in rows_out if r["kind"] == "quantize" and "gbps" in r and r["config"].get("impl") != PROBE]
    if done:
        best = max(done, key=lambda r: r["gbps"])
        cfg = dict(best["config"], code_impl="compare")
        attempt("quantize", "best, code_impl=compare", jax.jit(functools.partial(quantize_variant, **cfg)),
                (x, gs), q_bytes, want=(pr, sr), op="quantize", config=cfg)
        cfg = dict(best["config"])
        attempt("quantize", "best, per-row gs", jax.jit(functools.partial(quantize_variant, **cfg)),
                (x, gs_rows), q_bytes + rows * 4, op="quantize", config=cfg)
        if cfg.get("recip") == "table":
            cfg = dict(best["config"], recip="div")
            attempt("quantize", "best, recip=div", jax.jit(functools.partial(quantize_variant, **cfg)),
                    (x, gs), q_bytes, want=(pr, sr), op="quantize", config=cfg)
        if cfg.get("impl") in ("pairs", "blocked", "strided"):
            xf = x.astype(jnp.float16)
            cfg = dict(best["config"])
            attempt("quantize", "best, float16 input" + (" (runs blocked)" if cfg["impl"] == "pairs" else ""),
                    jax.jit(functools.partial(quantize_variant, **cfg)), (xf, gs), q_bytes, op="quantize", config=cfg)
            del xf
    attempt("quantize", "defaults " + _cfg_name(K.QUANT_DEFAULTS), jax.jit(K.quantize), (x, gs), q_bytes,
            want=(pr, sr), op="quantize", config=dict(K.QUANT_DEFAULTS))

    dsweep = DEQUANT_SWEEP[1:2] if args.quick else DEQUANT_SWEEP
    for br, sub, nw, ns, w in dsweep:
        cfg = dict(block_rows=br, sub_rows=sub, num_warps=nw, num_stages=ns, width=w)
        fn = jax.jit(functools.partial(K.dequantize, **cfg))
        attempt("dequantize", f"br={br} sub={sub} warps={nw} stages={ns} W={w}", fn, (pr, sr, gs), dq_bytes,
                op="dequantize", config=cfg)
    attempt("dequantize", "defaults " + _cfg_name(K.DEQUANT_DEFAULTS), jax.jit(K.dequantize), (pr, sr, gs), dq_bytes,
            op="dequantize", config=dict(K.DEQUANT_DEFAULTS))

    for r in rows_out:
        if "gbps" in r:
            r["frac_copy"] = r["gbps"] / copy_gbps
    # table
    print(f"\n{'kind':10s} {'variant':60s} {'ms':>8s} {'GB/s':>8s} {'frac copy':>9s}")
    for r in rows_out:
        if "gbps" in r:
            print(f"{r['kind']:10s} {r['name']:60s} {r['ms']:8.3f} {r['gbps']:8.1f} {r['frac_copy']:9.3f}")
        else:
            print(f"{r['kind']:10s} {r['name']:60s} FAILED")
    best_q = max((r for r in rows_out if r["kind"] == "quantize" and "gbps" in r
                  and r.get("config", {}).get("impl") != PROBE), key=lambda r: r["gbps"], default=None)
    best_dq = max((r for r in rows_out if r["kind"] == "dequantize" and "gbps" in r), key=lambda r: r["gbps"],
                  default=None)
    summary = dict(copy_gbps=copy_gbps, best_quantize=best_q, best_dequantize=best_dq,
                   quantize_target_met=bool(best_q and best_q["frac_copy"] >= 0.85),
                   bit_exact_all=all(e["ok"] for e in exact))
    print(f"\ncopy bandwidth {copy_gbps:.0f} GB/s; best quantize "
          + (f"{best_q['name']}: {best_q['gbps']:.0f} GB/s = {best_q['frac_copy']:.1%} of copy "
             f"(target 85%: {'met' if summary['quantize_target_met'] else 'NOT met'})" if best_q else "none")
          + (f"; best dequantize {best_dq['name']}: {best_dq['frac_copy']:.1%}" if best_dq else "")
          + f"; bit-exact: {'all OK' if summary['bit_exact_all'] else 'FAILURES (see above)'}")

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "nvfp4_bench.json")
    with open(path, "w") as f:
        json.dump(dict(meta=meta, shape=[rows, d], bit_exact=exact, results=rows_out, summary=summary), f, indent=1)
    print(f"wrote {path}")
    if not args.no_md:
        append_markdown(meta, rows, d, exact, rows_out, summary)
        print(f"appended a section to {RESULTS_MD}")
    return 0


def append_markdown(meta, rows, d, exact, rows_out, summary):
    lines = [f"\n## NVFP4 quantize / dequantize kernels — {meta['date']}\n",
             f"Device: {meta['device']}; jax {meta['jax']}, triton {meta['triton']}, Python {meta['python']}. "
             f"Input bf16[{rows}, {d}] ({rows * d * 2 / 2**30:.2f} GiB); bytes = read + written; "
             f"frac = GB/s / best copy GB/s ({summary['copy_gbps']:.0f} GB/s). Median of back-to-back calls.\n",
             "Bit-exact vs the XLA reference on the same GPU (D = 64/128/256/576, scalar and per-row gs): "
             + ("**all OK**" if summary["bit_exact_all"] else
                "**FAILURES**: " + "; ".join(f"D={e['d']} per_row={e['per_row_gs']} impl={e.get('impl')}"
                                            for e in exact if not e["ok"]))
             + "\n",
             "| kind | variant | ms | GB/s | frac copy |", "|---|---|---:|---:|---:|"]
    for r in rows_out:
        if "gbps" in r:
            lines.append(f"| {r['kind']} | {r['name']} | {r['ms']:.3f} | {r['gbps']:.0f} | {r['frac_copy']:.3f} |")
        else:
            lines.append(f"| {r['kind']} | {r['name']} | failed | | |")
    ops = {r["config"]["impl"]: r["xla_ops"] for r in rows_out if "xla_ops" in r}
    if ops:
        lines.append("\nXLA ops besides the Triton kernel, per impl (pairs more than v1 = XLA copies for the int32 view; recip=table adds one tiny table fusion): "
                     + ", ".join(f"{k}: {v}" for k, v in ops.items()))
    inexact = [r["name"] for r in rows_out if r.get("exact_on_timed_input") is False]
    if inexact:
        lines.append("\n**Not bit-exact on the timed input**: " + "; ".join(inexact))
    bq = summary["best_quantize"]
    if bq:
        lines.append(f"\nBest quantize: {bq['name']} at {bq['frac_copy']:.1%} of copy bandwidth "
                     f"(issue target 85%: {'met' if summary['quantize_target_met'] else 'not met'}).\n")
    new = not os.path.exists(RESULTS_MD)
    with open(RESULTS_MD, "a") as f:
        if new:
            f.write(MD_HEADER)
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
