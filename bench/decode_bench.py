"""Decode-attention benchmark on the H200: fused NVFP4 mixed kernel vs bf16 paged attention vs staging vs SDPA.

Side by side, one run, batch x context grid (default {1, 16, 64} x {4k, 32k, 128k}), 8 KV heads, 32 query heads,
head_dim 128, page 16, one query token:

  (a) ``mixed``   our fused kernel on mixed_nvfp4_bf16 pools (first_n = last_n = 64), best of the sweep
                  `MIXED_CONFIGS` (block_k x num_warps x num_stages x split multiplier; every config's output is
                  checked finite and equal to the first config's to 1e-2 before it is timed)
  (b) ``plain``   the same kernel family over plain bf16 pages (`PLAIN_CONFIGS`)
  (c) ``jax_pa``  ``jax.experimental.pallas.ops.gpu.paged_attention`` over bf16 pages (best of
                  pages_per_compute_block x k_splits)
  (d) ``stage``   "stage (XLA) + paged attention": jnp gather + NVFP4 dequant + retained-row overlay into a bf16
                  paged cache, then (c)'s best config over it (stage time reported separately too)
  (e) ``sdpa``    torch SDPA (flash and cuDNN, best) over contiguous bf16 K/V (skipped if torch is missing)
  (f) ``mgpu``    the Pallas Mosaic GPU kernel (`pallas_kernels.decode.mosaic_sm90`) on the same mixed pools, best of
                  `MGPU_CONFIGS` (ring stages x split multiplier), output checked against (a) to 1e-2
                  (``--no-mgpu`` skips it)
  floors          NVFP4 (+ retained rows) and bf16 K+V bytes / copy bandwidth measured in-run

Correctness is checked on the GPU first (small cache built by `append`, every path vs the float32 reference).
Big pools are filled with random bytes (valid E4M3 scales) instead of appends. Writes ``decode_bench.json`` under
``--out`` as ``decode_bench-b<batches>-c<contexts>.json`` (rewritten after every shape, so a timeout keeps what
was measured; ``--budget-s`` stops starting shapes before the device's 600 s command limit), prints a table and appends a dated section to
``bench/RESULTS.md``. On a machine without a GPU it prints a message and exits 0.

Usage: ``PYTHONPATH=. python3 bench/decode_bench.py --out DIR [--batches 1,16,64] [--contexts 4096,32768,131072]``
Compiling every config for all nine shapes takes a while: on a 600 s device limit run one batch size per command
(``--batches 1``, ``--batches 16``, ``--batches 64``) or pass ``--quick``; `bench/tools/plot_decode.py` merges the JSONs.

``--grid`` (the decode-speed grid: batch x context x GQA {4, 8} x page {16, 64} x Tq {1, 4}, default kernels only, 72
rows) is more than one 600 s command holds. ``--shard I/N`` runs every N-th row, so one command on a 4-GPU host runs
it all, one process per GPU, and ``--merge`` joins the shards (it refuses shards from different devices or
versions)::

    for i in 0 1 2 3; do CUDA_VISIBLE_DEVICES=$i python3 bench/decode_bench.py --grid --shard $i/4 \
        --out $OUT/s$i > $OUT/s$i.txt 2>&1 & done; wait
    python3 bench/decode_bench.py --merge $OUT/s*/decode_bench-grid.json --out $OUT

(on a 1-GPU machine the shards run in consecutive commands). Each grid row times the default kernel three ways:
end to end per call (``dflt``, one dispatch per call), per call inside one jitted loop of ten calls as a model step
runs it (``step``, `time_in_step`), and GPU busy (``dflt GPU``); the run ends with the decode-speed targets counted by each
(`targets_text`).
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import argparse  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jmixedkv as jm  # noqa: E402
from jmixedkv import layout, nvfp4  # noqa: E402
from common import copy_bandwidth_tbs, gpu_busy_ms, time_jax, time_torch, versions  # noqa: E402
from shapes import DECODE_GEOMETRY, grid_args  # noqa: E402
from jmixedkv.decode import decode_attention  # noqa: E402
from jmixedkv.compat import on_gpu  # noqa: E402
from jmixedkv.pools import LowPool, RowPool, kernel_arrays  # noqa: E402
from pallas_kernels.decode import MosaicConfig, TritonConfig, choose_backend, mosaic_sm90  # noqa: E402
from pallas_kernels.decode.config import mosaic_num_splits, triton_num_splits  # noqa: E402
from pallas_kernels.decode.triton import paged_decode_attention  # noqa: E402

H, D, FIRST_N, LAST_N = (DECODE_GEOMETRY[k] for k in ("kv_heads", "head_dim", "first_n", "last_n"))
HQ, PAGE = 4 * H, 16
CFG = jm.KVCacheConfig("mixed_nvfp4_bf16", first_n=FIRST_N, last_n=LAST_N, page_size=PAGE)
NF, NR = CFG.num_fixed_pages, CFG.num_ring_pages
# Kernel variants (block_k tokens per step, num_warps, num_stages, split multiplier vs triton_num_splits,
# precise P @ V, dequant form). The first shape of a run sweeps them all; later shapes of a --quick run time only
# the best TOP_K of the first shape (compiles dominate the budget). "-p": P split in two f16 halves (float32-output
# accuracy); "-jnp": the NVFP4 dequantization in plain jnp ops instead of the packed inline PTX.
MIXED_CONFIGS = [dict(), dict(block_k=128, num_warps=4, num_stages=3), dict(block_k=128, num_warps=4, num_stages=4),
                 dict(block_k=64, num_warps=4, num_stages=3), dict(block_k=128, num_warps=2, num_stages=3),
                 dict(block_k=64, num_warps=2, num_stages=3), dict(block_k=64, num_warps=1, num_stages=3),
                 dict(block_k=128, num_warps=4, num_stages=3, split_mult=2),
                 dict(block_k=128, num_warps=4, num_stages=3, precise=True),
                 dict(block_k=128, num_warps=4, num_stages=3, dequant="jnp"),
                 dict(block_k=128, num_warps=4, num_stages=3, keys_major=True)]
PLAIN_CONFIGS = [dict(block_k=64, num_warps=4, num_stages=2), dict(block_k=128, num_warps=4, num_stages=3),
                 dict(block_k=128, num_warps=8, num_stages=3), dict(block_k=256, num_warps=8, num_stages=3)]
FULL_EXTRA = [dict(block_k=128, num_warps=8, num_stages=3), dict(block_k=64, num_warps=4, num_stages=4), dict(block_k=256, num_warps=4, num_stages=2),
              dict(block_k=128, num_warps=8, num_stages=4), dict(block_k=64, num_warps=4, num_stages=3, split_mult=2)]
TOP_K = 3
# (f) Mosaic GPU kernel variants: TMA ring stages, split multiplier vs `mosaic_num_splits`
MGPU_CONFIGS = [dict(stages=2), dict(stages=3), dict(stages=2, split_mult=2), dict(stages=2, split_mult=0.5)]
USE_MGPU = True
LAYERS = 1           # --layers: pool layers (the kernels read the last one)
STAGE_MAX_TOKENS = 1 << 22   # (d) materializes f32 dequant temporaries of the whole batch: skip above this
JAX_PA_CONFIGS = [(ppcb, ks) for ppcb in (8, 16) for ks in (1, 4, 16)]
INTERPRET = False   # --smoke: tiny shapes in interpret mode on CPU (checks the script, times nothing real)
CHECK_LENS = (1, 15, 16, 17, 100, 1000, 2047, 4096)


# --------------------------------------------------------------------------------------------- timing
def time_in_step(fn, *args, calls=10, lens_arg=2):
    """Median ms per call of ``fn(*args)`` (-> one output array) run ``calls`` times inside **one** jitted loop, as
    the layers of a model's decode step run: one executable, no dispatch per call. `time_jax` of a single call
    also pays the runtime's cost of launching an executable: on the H200 (jax 0.11.2) 23-28 us per call at 16 x 32k
    and 64 x 4k that ten calls in one loop do not see (5 us per call there; bench/RESULTS.md). Each call's ``kv_lens`` (argument ``lens_arg``) is the previous one's plus ``isnan(out[0])`` (0 for
    the finite outputs the grid checks), so XLA can neither hoist a call out of the loop nor merge two; the whole
    output is carried (materialized every call). Adds one 1-element op per call."""
    def loop(*a):
        def body(i, carry):
            a_ = list(a)
            a_[lens_arg] = carry[0]
            out = fn(*a_)
            return carry[0] + jnp.isnan(out.reshape(-1)[0]).astype(carry[0].dtype), out
        out0 = jax.eval_shape(fn, *a)
        return jax.lax.fori_loop(0, calls, body, (a[lens_arg], jnp.zeros(out0.shape, out0.dtype)))
    return time_jax(jax.jit(loop), *args) / calls


# --------------------------------------------------------------------------------------------- big pools
def tables(key, b, ctx):
    """Random page permutation: page_table i32[b, ctx/PAGE] over b*ctx/PAGE pages, high_table i32[b, NF+NR]."""
    npg = ctx // PAGE
    perm = jax.random.permutation(key, b * npg).astype(jnp.int32)
    ht = jnp.arange(b * (NF + NR), dtype=jnp.int32).reshape(b, NF + NR)
    return perm.reshape(b, npg), ht


CHUNK_ELEMS = 1 << 26   # random fills generate at most this many elements and tile them along the page axis


@functools.partial(jax.jit, static_argnames=("shape", "axis", "gen"))
def _tiled(key, *, shape, axis, gen):
    """``gen(key, chunk_shape)`` tiled along ``axis`` up to ``shape``: big pools without full-size random
    temporaries (jax.random.bits of a 32 GiB u16 pool goes through u32 / converts and ran out of memory)."""
    per = int(np.prod(shape)) // shape[axis]
    chunk = max(1, min(shape[axis], CHUNK_ELEMS // max(per, 1)))
    cshape = shape[:axis] + (chunk,) + shape[axis + 1:]
    x = gen(key, cshape)
    reps = -(-shape[axis] // chunk)
    x = jnp.tile(x, tuple(reps if i == axis else 1 for i in range(len(shape))))
    return jax.lax.slice_in_dim(x, 0, shape[axis], axis=axis)


def _bf16_bits(key, shape):
    bits = (jax.random.bits(key, shape, jnp.uint16) & jnp.uint16(0x807F)) | jnp.uint16(0x3F00)
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)


def _u8_bits(key, shape):
    return jax.random.bits(key, shape, jnp.uint8)


def _e4m3_scales(key, shape):
    sbytes = jax.random.randint(key, shape, 0x28, 0x58, jnp.int32).astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(sbytes, jnp.float8_e4m3fn)


def rand_bf16(key, shape, axis=1):
    """Random finite bf16 in +-[0.5, 1) from random bits, generated in chunks along ``axis`` (the page axis)."""
    return _tiled(key, shape=tuple(shape), axis=axis, gen=_bf16_bits)


def _pool_pages(pages, width):
    """Pages of a uint8 pool array, padded out of the Pallas Triton offset hole exactly as `init_state` does."""
    return layout.offset_safe_count(pages, LAYERS * 2 * H * PAGE * width, 1)


def mixed_pools(key, b, ctx):
    """Random NVFP4 low pool (valid E4M3 scales, gs from amax) + bf16 twin, ``L = LAYERS`` (``--layers``; the
    kernels read the last layer, the highest offsets of a model-shaped pool)."""
    pages = b * ctx // PAGE
    k1, k2, k3 = jax.random.split(key, 3)
    data = _tiled(k1, shape=(LAYERS, _pool_pages(pages, D // 2), 2, H, PAGE, D // 2), axis=1, gen=_u8_bits)
    scales = _tiled(k2, shape=(LAYERS, _pool_pages(pages, D // 16), 2, H, PAGE, D // 16), axis=1, gen=_e4m3_scales)
    gs = jnp.broadcast_to(nvfp4.global_scale_from_amax(8.0), (LAYERS, 2)).astype(jnp.float32)
    high = rand_bf16(k3, (LAYERS, b * (NF + NR), 2, H, PAGE, D))
    return LowPool(data, scales, gs), RowPool(high, jnp.ones((LAYERS, 2), jnp.float32))


def plain_pool(key, b, ctx):
    rows = rand_bf16(key, (LAYERS, b * ctx // PAGE, 2, H, PAGE, D))
    return RowPool(rows, jnp.ones((LAYERS, 2), jnp.float32))


def jax_layout_pages(key, b, ctx):
    """k_pages, v_pages bf16[H, pages, PAGE, D] for jax's paged_attention."""
    k1, k2 = jax.random.split(key)
    shape = (H, b * ctx // PAGE, PAGE, D)
    return rand_bf16(k1, shape, axis=1), rand_bf16(k2, shape, axis=1)


# --------------------------------------------------------------------------------------------- (d) staging
@functools.partial(jax.jit, static_argnames=("first_n", "last_n", "nf", "nr"))
def stage_xla(low, high, page_table, high_table, kv_lens, layer=0, *, first_n, last_n, nf, nr):
    """Materialize the batch's pages as a bf16 paged cache in jax's layout: ``(k, v) bf16[H, B*np, page, D]``
    (page ``j`` of row ``b`` at ``b * np + j``): gather + dequantize the low pages, overlay the retained rows,
    rows at or past the length are zero (as `stage_reference`)."""
    b, npg = page_table.shape
    page = low.data.shape[4]
    ids = jnp.maximum(page_table, 0)
    gs = low.gs[layer]                                                         # [kv]
    x = nvfp4.dequantize_reference(low.data[layer][ids], low.scales[layer][ids], gs[:, None, None], jnp.bfloat16)
    pos = jnp.arange(npg)[None, :, None] * page + jnp.arange(page)[None, None, :]
    x = jnp.where((pos < kv_lens[:, None, None])[:, :, None, None, :, None], x, jnp.zeros((), x.dtype))  # rows >= n: 0
    # x: [B, np, kv, H, page, D]; overlay fixed pages (positions < first_n) and the ring (last_n window)
    n = kv_lens[:, None, None]
    rowpos = lambda j: j[:, :, None] * page + jnp.arange(page)[None, None, :]  # noqa: E731  [B, J, page]
    keep = lambda pos: ((pos < first_n) | (pos >= n - last_n)) & (pos < n)   # noqa: E731
    hrows = high.rows[layer]
    bi = jnp.arange(b)[:, None]
    if nf:
        j = jnp.broadcast_to(jnp.arange(nf)[None, :], (b, nf))
        hp = hrows[jnp.maximum(high_table[:, :nf], 0)]                         # [B, nf, kv, H, page, D]
        m = (keep(rowpos(j)) & (high_table[:, :nf, None] >= 0))[:, :, None, None, :, None]
        x = x.at[:, :nf].set(jnp.where(m, hp.astype(x.dtype), x[:, :nf]))
    if nr:
        j0 = jnp.maximum(kv_lens - last_n, 0) // page
        j = jnp.minimum(j0[:, None] + jnp.arange(nr)[None, :], npg - 1)         # [B, nr]
        col = jnp.where(j < nf, j, nf + j % nr)
        hid = high_table[bi, col]
        hp = hrows[jnp.maximum(hid, 0)]
        m = (keep(rowpos(j)) & (hid[..., None] >= 0) & (j[..., None] >= nf))[:, :, None, None, :, None]
        x = x.at[bi, j].set(jnp.where(m, hp.astype(x.dtype), x[bi, j]))
    x = x.reshape(b * npg, 2, x.shape[3], page, x.shape[-1])
    return jnp.transpose(x[:, 0], (1, 0, 2, 3)), jnp.transpose(x[:, 1], (1, 0, 2, 3))


# --------------------------------------------------------------------------------------------- runners
def ours_fn(mode, cfg, b, npg):
    if not cfg:     # the kernel's own defaults (block_k, num_warps, splits, v_late chosen per shape class)
        splits = None
        kw = dict(config=TritonConfig(num_stages=3), interpret=INTERPRET)
        if mode == "mixed":
            return jax.jit(lambda q, pt, lens, ht, low, high: paged_decode_attention(
                q, pt, lens, LAYERS - 1, kernel_arrays(low), kernel_arrays(high), None, ht, geom=CFG.twin, **kw)[0]), splits
        return jax.jit(lambda q, pt, lens, plain: paged_decode_attention(q, pt, lens, LAYERS - 1, None, None, kernel_arrays(plain),
                                                                          **kw)[0]), splits
    blocks = max(1, npg // max(1, cfg["block_k"] // PAGE))
    splits = max(1, min(blocks, int(triton_num_splits(b, H, blocks) * cfg.get("split_mult", 1))))
    config = TritonConfig(block_k=cfg["block_k"], num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 2),
                          precise=cfg.get("precise"), num_splits=splits, keys_major=cfg.get("keys_major", False),
                          dequant=cfg.get("dequant") if mode == "mixed" else None)
    kw = dict(config=config, interpret=INTERPRET)
    if mode == "mixed":
        return jax.jit(lambda q, pt, lens, ht, low, high: paged_decode_attention(
            q, pt, lens, LAYERS - 1, kernel_arrays(low), kernel_arrays(high), None, ht, geom=CFG.twin,
            **kw)[0]), splits
    return jax.jit(lambda q, pt, lens, plain: paged_decode_attention(q, pt, lens, LAYERS - 1, None, None, kernel_arrays(plain),
                                                                      **kw)[0]), splits


def mgpu_fn(cfg, b, npg):
    blocks = max(1, npg * PAGE // mosaic_sm90.BLOCK_K)
    splits = max(1, min(blocks, int(mosaic_num_splits(b, H, blocks) * cfg.get("split_mult", 1))))
    config = MosaicConfig(num_splits=splits, stages=cfg["stages"])
    return jax.jit(lambda q, pt, lens, ht, low, high: mosaic_sm90.paged_decode_attention(
        q, pt, lens, LAYERS - 1, kernel_arrays(low), kernel_arrays(high), ht, geom=CFG.twin,
        config=config, interpret=INTERPRET)[0])


def mgpu_name(c):
    return f"st{c['stages']}x{c.get('split_mult', 1)}"


def jax_pa_fn(ppcb, ks):
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
    return jax.jit(lambda q, k, v, bt, lens: paged_attention(q, k, v, bt, lens, pages_per_compute_block=ppcb,
                                                             k_splits=ks, interpret=INTERPRET))


def cfg_name(c):
    """``k128w4s3x1`` (+ ``-p`` precise, ``-jnp`` dequant, ``-km`` keys-major): block_k, num_warps, num_stages, split multiplier."""
    if not c:
        return "default"
    name = f"k{c['block_k']}w{c['num_warps']}s{c.get('num_stages', 2)}x{c.get('split_mult', 1)}"
    return (name + ("-p" if c.get("precise") else "") + (f"-{c['dequant']}" if "dequant" in c else "")
            + ("-km" if c.get("keys_major") else ""))


def best_of(label, candidates):
    """candidates: list of (name, thunk -> ms). Returns (best_ms, best_name, all)."""
    results = {}
    for name, thunk in candidates:
        t0 = time.time()
        try:
            results[name] = thunk()
            print(f"  {label} {name}: {results[name]:.3f} ms ({time.time() - t0:.0f}s incl. compile)", flush=True)
        except Exception as e:  # a config that does not compile is reported, not fatal
            results[name] = None
            print(f"  {label} {name}: failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
    ok = {k: v for k, v in results.items() if v is not None}
    if not ok:
        return None, None, results
    name = min(ok, key=ok.get)
    return ok[name], name, results


# --------------------------------------------------------------------------------------------- correctness
def check_correctness(torch):
    """Small cache built by append; every path vs float32 attention_reference over stage_reference."""
    cfg = jm.KVCacheConfig("mixed_nvfp4_bf16", first_n=FIRST_N, last_n=LAST_N, page_size=PAGE)
    lens = CHECK_LENS
    npg = -(-max(lens) // PAGE)
    spec = jm.GroupSpec(num_layers=1, num_kv_heads=H, head_dim=D)
    st = jm.init_state(cfg, spec, num_pages=len(lens) * npg, max_seqs=len(lens), max_pages_per_seq=npg,
                       poison=True, gs=0.005, page_order=np.random.default_rng(0).permutation(len(lens) * npg))
    seq = np.concatenate([np.full(n, s) for s, n in enumerate(lens)]).astype(np.int32)
    pos = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
    key = jax.random.PRNGKey(0)
    for s in range(len(lens)):
        st = jm.admit(st, s)
    k = jax.random.normal(key, (1, len(seq), H, D)).astype(jnp.bfloat16)
    v = jax.random.normal(jax.random.fold_in(key, 1), (1, len(seq), H, D)).astype(jnp.bfloat16)
    st = jm.append(st, None, k, v, seq, pos, backend="reference")
    q = jax.random.normal(jax.random.fold_in(key, 2), (len(lens), 1, HQ, D)).astype(jnp.bfloat16)
    slots = jnp.arange(len(lens), dtype=jnp.int32)
    staged = jm.stage_reference(st, 0, slots)
    ref, ref_lse = jm.attention_reference(q, staged[:, 0], staged[:, 1], st.kv_lens)
    rel = lambda a: float(jnp.linalg.norm(a.astype(jnp.float32) - ref.astype(jnp.bfloat16).astype(jnp.float32))  # noqa
                          / jnp.linalg.norm(ref))
    out = {}
    # the fused kernel reads NVFP4 / twin values exactly: its oracle is attention over the float32 staging
    staged32 = jm.stage_reference(st, 0, slots, dtype=jnp.float32)
    ref32, ref32_lse = jm.attention_reference(q, staged32[:, 0], staged32[:, 1], st.kv_lens)
    rel32 = lambda a: float(jnp.linalg.norm(a.astype(jnp.float32) - ref32.astype(jnp.bfloat16).astype(jnp.float32))  # noqa
                            / jnp.linalg.norm(ref32))
    o, lse = decode_attention(st, 0, q, slots, backend="pallas")
    out["mixed_kernel"] = rel32(o)
    out["mixed_kernel_lse_abs"] = float(jnp.max(jnp.abs(lse - ref32_lse)))
    out["mixed_kernel_vs_bf16_staging"] = rel(o)
    low, high = kernel_arrays(st.pools[0].low), kernel_arrays(st.pools[0].high)
    o, _ = paged_decode_attention(q, st.page_table, st.kv_lens, 0, low, high, None, st.high_table, geom=CFG.twin,
                                  config=TritonConfig(dequant="jnp"), interpret=INTERPRET)
    out["mixed_kernel_jnp_dequant"] = rel32(o)
    o, _ = paged_decode_attention(q, st.page_table, st.kv_lens, 0, low, high, None, st.high_table,
                                  geom=CFG.twin, config=TritonConfig(precise=True),
                                  out_dtype=jnp.float32, interpret=INTERPRET)
    out["mixed_kernel_f32_out_vs_f32"] = float(jnp.linalg.norm(o - ref32) / jnp.linalg.norm(ref32))
    if USE_MGPU:    # (f) against the same float32 oracle
        o, lse = mosaic_sm90.paged_decode_attention(
            q, st.page_table, st.kv_lens, 0, low, high, st.high_table, geom=CFG.twin,
            out_dtype=jnp.float32, interpret=INTERPRET)
        out["mgpu_kernel_f32_out_vs_f32"] = float(jnp.linalg.norm(o - ref32) / jnp.linalg.norm(ref32))
        out["mgpu_kernel_lse_abs"] = float(jnp.max(jnp.abs(lse - ref32_lse)))
    # plain bf16 pages holding exactly the staged rows
    pools = st.pools[0]
    plain_rows = jnp.zeros((1, len(lens) * npg, 2, H, PAGE, D), jnp.bfloat16)
    pt = st.page_table
    sr = staged.reshape(len(lens), 2, H, npg, PAGE, D).transpose(0, 3, 1, 2, 4, 5)   # [B, np, kv, H, page, D]
    plain_rows = plain_rows.at[0, pt.reshape(-1)].set(sr.reshape(-1, 2, H, PAGE, D))
    plain = RowPool(plain_rows, jnp.ones((1, 2), jnp.float32))
    o, _ = paged_decode_attention(q, pt, st.kv_lens, 0, None, None, kernel_arrays(plain), interpret=INTERPRET)
    out["plain_kernel"] = rel(o)
    ks, vs = stage_xla(pools.low, pools.high, pt, st.high_table, st.kv_lens, first_n=FIRST_N, last_n=LAST_N,
                       nf=NF, nr=NR)
    want_k = staged[:, 0].transpose(1, 0, 2, 3).reshape(H, len(lens) * npg, PAGE, D)
    valid = (jnp.arange(npg * PAGE)[None, :] < st.kv_lens[:, None]).reshape(len(lens) * npg, PAGE)
    out["stage_xla_bitexact_k"] = bool(jnp.all(jnp.where(valid[None, :, :, None], ks == want_k, True)))
    bt = jnp.arange(len(lens) * npg, dtype=jnp.int32).reshape(len(lens), npg)
    q_scaled = (q[:, 0].astype(jnp.float32) * D ** -0.5).astype(jnp.bfloat16)   # jax's kernel does not scale
    o = jax_pa_fn(8, 1)(q_scaled, ks, vs, bt, st.kv_lens)
    out["stage_plus_jax_pa"] = rel(o[:, None])
    if torch is not None:
        kk = torch.from_dlpack(staged[:, 0]).float()
        vv = torch.from_dlpack(staged[:, 1]).float()
        outs = []
        for bi, n in enumerate(lens):
            qq = torch.from_dlpack(q[bi, 0].astype(jnp.float32)).view(1, HQ, 1, D)
            outs.append(torch.nn.functional.scaled_dot_product_attention(
                qq, kk[bi:bi + 1, :, :n], vv[bi:bi + 1, :, :n], enable_gqa=True).view(1, 1, HQ, D))
        o = jnp.asarray(torch.cat(outs).cpu().numpy())
        out["torch_sdpa_f32"] = rel(o)
    ok = (out["mixed_kernel"] < 1e-3 and out["plain_kernel"] < 1e-3 and out["stage_xla_bitexact_k"]
          and out["mixed_kernel_jnp_dequant"] < 1e-3 and out["mixed_kernel_f32_out_vs_f32"] < 1e-4
          and out["stage_plus_jax_pa"] < 1e-2 and out["mixed_kernel_lse_abs"] < 1e-3
          and out.get("mgpu_kernel_f32_out_vs_f32", 0.0) < 1e-4 and out.get("mgpu_kernel_lse_abs", 0.0) < 1e-3)
    return ok, out


# --------------------------------------------------------------------------------------------- main
def run_shape(b, ctx, bw, torch_ms, quick, first_shape_best=None):
    key = jax.random.PRNGKey(b * 1000 + ctx // 1024)
    npg = ctx // PAGE
    tokens = b * ctx
    row = dict(batch=b, context=ctx)
    nvfp4_bytes = tokens * H * D * 2 * (0.5 + 1 / 16) + b * (FIRST_N + LAST_N) * H * D * 2 * 2
    bf16_bytes = tokens * H * D * 2 * 2
    row["floor_nvfp4_ms"] = nvfp4_bytes / (bw * 1e12) * 1e3
    row["floor_bf16_ms"] = bf16_bytes / (bw * 1e12) * 1e3
    q4 = jax.random.normal(key, (b, 1, HQ, D), jnp.bfloat16)
    lens = jnp.full((b,), ctx, jnp.int32)
    pt, ht = tables(jax.random.fold_in(key, 1), b, ctx)
    mixed_cfgs = MIXED_CONFIGS + ([] if quick else FULL_EXTRA)
    plain_cfgs = PLAIN_CONFIGS + ([] if quick else FULL_EXTRA)
    if quick and first_shape_best:          # later shapes of a quick run: the first shape's TOP_K only
        mixed_cfgs = [c for c in mixed_cfgs if cfg_name(c) in first_shape_best.get("mixed", ())]
        plain_cfgs = [c for c in plain_cfgs if cfg_name(c) in first_shape_best.get("plain", ())]

    # (a) mixed
    low, high = mixed_pools(jax.random.fold_in(key, 2), b, ctx)
    jax.block_until_ready((low, high))

    first_out = {}

    def ours(mode, cfg, *args):
        """Time one config; its output must agree with the mode's first config (same inputs) to 1e-2."""
        fn, splits = ours_fn(mode, cfg, b, npg)
        out = np.asarray(fn(*args), np.float32)
        if not np.isfinite(out).all():
            raise FloatingPointError(f"{mode} {cfg_name(cfg)}: non-finite output")
        ref = first_out.setdefault(mode, out)
        rel = float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))
        if rel > 1e-2:
            raise ValueError(f"{mode} {cfg_name(cfg)}: output differs from the first config by {rel:.2e}")
        return time_jax(fn, *args)
    cand = [(cfg_name(c), functools.partial(ours, "mixed", c, q4, pt, lens, ht, low, high)) for c in mixed_cfgs]
    row["mixed_ms"], row["mixed_cfg"], row["mixed_all"] = best_of("mixed", cand)

    # (f) Mosaic GPU kernel on the same pools, checked against (a)'s output
    if USE_MGPU and mosaic_sm90.supported(head_dim=D, page=PAGE, tq=1, group=HQ // H, high_dtype=high.rows.dtype):
        def mg(cfg):
            fn = mgpu_fn(cfg, b, npg)
            out = np.asarray(fn(q4, pt, lens, ht, low, high), np.float32)
            ref = first_out.get("mixed")
            if not np.isfinite(out).all():
                raise FloatingPointError(f"mgpu {mgpu_name(cfg)}: non-finite output")
            if ref is not None:
                rel = float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))
                if rel > 1e-2:
                    raise ValueError(f"mgpu {mgpu_name(cfg)}: output differs from (a) by {rel:.2e}")
            return time_jax(fn, q4, pt, lens, ht, low, high)
        cand = [(mgpu_name(c), functools.partial(mg, c)) for c in MGPU_CONFIGS]
        row["mgpu_ms"], row["mgpu_cfg"], row["mgpu_all"] = best_of("mgpu", cand)

    # (d) staging path: stage (XLA) + jax paged attention (best config found in (c), filled in below)
    stage = functools.partial(stage_xla, first_n=FIRST_N, last_n=LAST_N, nf=NF, nr=NR)
    do_stage = b * ctx <= STAGE_MAX_TOKENS
    if do_stage:
        row["stage_only_ms"] = time_jax(lambda *a: stage(*a), low, high, pt, ht, lens, reps=3, trials=7)
    else:
        row["stage_skipped"] = (f"(d) skipped: {b}x{ctx} = {b * ctx} tokens > {STAGE_MAX_TOKENS}; staging "
                                f"materializes the whole batch's dequantized K/V and does not fit")
        print("  " + row["stage_skipped"])
    staged_args = (low, high, pt, ht, lens)
    del high

    # (b) plain bf16 pages, our kernel
    plain = plain_pool(jax.random.fold_in(key, 3), b, ctx)
    cand = [(cfg_name(c), functools.partial(ours, "plain", c, q4, pt, lens, plain)) for c in plain_cfgs]
    row["plain_ms"], row["plain_cfg"], row["plain_all"] = best_of("plain", cand)
    del plain

    # (c) jax paged_attention over bf16 pages (its own layout)
    kp, vp = jax_layout_pages(jax.random.fold_in(key, 4), b, ctx)
    q3 = q4[:, 0]
    cand = [(f"ppcb{p}ks{k}", functools.partial(lambda p, k: time_jax(jax_pa_fn(p, k), q3, kp, vp, pt, lens), p, k))
            for p, k in (JAX_PA_CONFIGS[:3] if quick else JAX_PA_CONFIGS) if npg % k == 0 and (npg // k) % p == 0]
    row["jax_pa_ms"], row["jax_pa_cfg"], row["jax_pa_all"] = best_of("jax_pa", cand)
    del kp, vp

    # (d) full staging path with (c)'s best config
    if row["jax_pa_cfg"] is not None and do_stage:
        p_, k_ = [int(x) for x in row["jax_pa_cfg"].replace("ppcb", "").split("ks")]
        pa = jax_pa_fn(p_, k_)
        bt = jnp.arange(b * npg, dtype=jnp.int32).reshape(b, npg)

        @jax.jit
        def staged_attention(q3, low, high, pt, ht, lens):
            ks, vs = stage(low, high, pt, ht, lens, LAYERS - 1)
            return pa(q3, ks, vs, bt, lens)
        row["stage_ms"] = time_jax(staged_attention, q3, *staged_args, reps=3, trials=7)
    del low, staged_args

    # (e) torch SDPA (measured earlier, before JAX allocated)
    row.update(torch_ms.get((b, ctx), {}))
    if row.get("mgpu_ms"):
        row["mgpu_vs_nvfp4_floor"] = row["mgpu_ms"] / row["floor_nvfp4_ms"]
        if row.get("mixed_ms"):
            row["speedup_mgpu_vs_mixed"] = row["mixed_ms"] / row["mgpu_ms"]
    a = row.get("mixed_ms")
    if a:
        row["mixed_vs_nvfp4_floor"] = a / row["floor_nvfp4_ms"]
        for other in ("plain_ms", "jax_pa_ms", "stage_ms", "sdpa_ms"):
            if row.get(other):
                row[f"speedup_vs_{other[:-3]}"] = row[other] / a
    return row


def top_configs(results, k=None):
    """Names of the ``k`` (default TOP_K) fastest precise configs in ``{name: ms or None}``."""
    ok = sorted((v, n) for n, v in results.items() if v is not None)
    return tuple(n for _, n in ok[:k or TOP_K])


def torch_sdpa_all(torch, shapes):
    """(e) for every shape, before JAX allocates: best of flash / cuDNN SDPA over contiguous bf16 K/V."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    out = {}
    for b, ctx in shapes:
        res = {}
        q = torch.randn(b, HQ, 1, D, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(b, H, ctx, D, dtype=torch.bfloat16, device="cuda")
        v = torch.randn_like(k)
        for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            def f():
                with sdpa_kernel(be):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            try:
                res[f"sdpa_{name}_ms"] = time_torch(torch, f)
            except Exception as e:  # backend not available for this shape
                print(f"  sdpa {name} {b}x{ctx}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
        vals = [v_ for v_ in res.values() if v_]
        if vals:
            res["sdpa_ms"] = min(vals)
        out[(b, ctx)] = res
        del q, k, v
        torch.cuda.empty_cache()
    return out


def fits(b, ctx, budget_gib):
    tokens = b * ctx
    # peak: mixed pools + staged bf16 copy (K+V) during (d); or mixed + jax-layout bf16
    need = tokens * H * D * 2 * (0.5625 * LAYERS + 2 * max(LAYERS, 2)) * 1.1
    return need / 2 ** 30 < budget_gib


def fmt(x, w=8):
    return f"{x:{w}.3f}" if isinstance(x, (int, float)) and x is not None else f"{'-':>{w}}"


def table(rows):
    head = (f"{'B x ctx':>12} {'(a)mixed':>8} {'(b)plain':>8} {'(c)jaxPA':>8} {'(d)stage':>8} {'(e)sdpa':>8} "
            f"{'(f)mgpu':>8} {'fl.fp4':>8} {'fl.bf16':>8} {'a/fl4':>6} {'f/fl4':>6} {'c/a':>6} {'e/a':>6}")
    lines = [head]
    for r in rows:
        ratio = lambda k: f"{r[k]:6.2f}" if r.get(k) else f"{'-':>6}"  # noqa: E731
        ctx = f"{r['context'] // 1024}k" if r['context'] >= 1024 else str(r['context'])
        lines.append(f"{r['batch']:>4} x {ctx:>5} {fmt(r.get('mixed_ms'))} {fmt(r.get('plain_ms'))} "
                     f"{fmt(r.get('jax_pa_ms'))} {fmt(r.get('stage_ms'))} {fmt(r.get('sdpa_ms'))} "
                     f"{fmt(r.get('mgpu_ms'))} {fmt(r['floor_nvfp4_ms'])} {fmt(r['floor_bf16_ms'])} "
                     f"{ratio('mixed_vs_nvfp4_floor')} {ratio('mgpu_vs_nvfp4_floor')} "
                     f"{ratio('speedup_vs_jax_pa')} {ratio('speedup_vs_sdpa')}")
    return "\n".join(lines)


def best_lines(rows):
    """One line per shape: the best config of (a) / (b) / (c) and all of (a)'s timings."""
    out = []
    for r in rows:
        allm = " ".join(f"{k}={v:.3f}" for k, v in (r.get("mixed_all") or {}).items() if v is not None)
        allf = " ".join(f"{k}={v:.3f}" for k, v in (r.get("mgpu_all") or {}).items() if v is not None)
        out.append(f"{r['batch']} x {r['context']}: best (a) {r.get('mixed_cfg')} (b) {r.get('plain_cfg')} "
                   f"(c) {r.get('jax_pa_cfg')} (f) {r.get('mgpu_cfg')}; (a) sweep: {allm}; (f) sweep: {allf}")
    return "\n".join(out)


# --------------------------------------------------------------------------------------------- --grid
GRID_JAX_PA_SPLITS = {1: 16, 16: 4, 64: 1}   # jax paged_attention k_splits per batch (best of earlier sweeps)


def set_geometry(gqa, page):
    """Point the module-level shape constants (used by `tables` / `mixed_pools`) at one grid geometry."""
    global HQ, PAGE, CFG, NF, NR
    HQ, PAGE = H * gqa, page
    CFG = jm.KVCacheConfig("mixed_nvfp4_bf16", first_n=FIRST_N, last_n=LAST_N, page_size=PAGE)
    NF, NR = CFG.num_fixed_pages, CFG.num_ring_pages


def torch_sdpa(torch, b, ctx, tq):
    """cuDNN and flash SDPA over contiguous bf16 K/V ``[b, H, ctx, D]``, ``tq`` query tokens (no mask: the
    same bytes as the causal verify step), ms each (None where the backend refuses): the better of torch's
    ``enable_gqa`` and the group folded into the query rows (``q [b, H, tq * G, D]``, what a serving engine does;
    for Tq > 1 ``enable_gqa`` expands K / V to every query head and reads G x the bytes)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    g = HQ // H
    q = torch.randn(b, HQ, tq, D, dtype=torch.bfloat16, device="cuda")
    qf = torch.randn(b, H, tq * g, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(b, H, ctx, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    res = {}
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        times = []
        for qq, gqa in ((q, True), (qf, False)):
            def f():
                with sdpa_kernel(be):
                    return torch.nn.functional.scaled_dot_product_attention(qq, k, v, enable_gqa=gqa)
            try:
                times.append(time_torch(torch, f))
            except Exception as e:  # backend not available for this shape
                print(f"    sdpa {name} enable_gqa={gqa}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
        res[name] = min(times) if times else None
    del q, qf, k, v
    torch.cuda.empty_cache()
    return res


def grid_row(torch, bw, b, ctx, gqa, page, tq):
    """One grid shape: the default NVFP4 kernel, the Mosaic GPU kernel (where `supported`), cuDNN / flash SDPA
    over contiguous bf16, jax's Pallas paged attention over bf16 (Tq 1 only: it has no multi-token query), and
    both bytes floors. Every timed output must be finite; the Mosaic GPU output must match the Triton one."""
    set_geometry(gqa, page)
    key = jax.random.PRNGKey(b * 1000 + ctx // 1024 + 7 * gqa + page + tq)
    row = dict(batch=b, context=ctx, gqa=gqa, page=page, tq=tq, copy_bandwidth_tbs=bw)
    tokens = b * ctx
    row["floor_nvfp4_ms"] = (tokens * H * D * 2 * (0.5 + 1 / 16) + b * (FIRST_N + LAST_N) * H * D * 4) / bw * 1e-9
    row["floor_bf16_ms"] = tokens * H * D * 4 / bw * 1e-9
    if torch is not None:
        s = torch_sdpa(torch, b, ctx, tq)
        row["cudnn_ms"], row["flash_ms"] = s.get("cudnn"), s.get("flash")
    q = jax.random.normal(key, (b, tq, HQ, D), jnp.bfloat16)
    lens = jnp.full((b,), ctx, jnp.int32)
    pt, ht = tables(jax.random.fold_in(key, 1), b, ctx)
    low, high = mixed_pools(jax.random.fold_in(key, 2), b, ctx)
    fn = jax.jit(lambda q, pt, lens, ht, low, high: paged_decode_attention(
        q, pt, lens, LAYERS - 1, kernel_arrays(low), kernel_arrays(high), None, ht, geom=CFG.twin, interpret=INTERPRET)[0])
    out = np.asarray(fn(q, pt, lens, ht, low, high), np.float32)
    if not np.isfinite(out).all():
        raise FloatingPointError("mixed: non-finite output")
    row["mixed_ms"] = time_jax(fn, q, pt, lens, ht, low, high)
    row["mixed_gpu_ms"] = gpu_busy_ms(fn, q, pt, lens, ht, low, high)
    fns = dict(mixed=fn)

    def mgpu():
        mg = jax.jit(lambda q, pt, lens, ht, low, high: mosaic_sm90.paged_decode_attention(
            q, pt, lens, LAYERS - 1, kernel_arrays(low), kernel_arrays(high), ht, geom=CFG.twin, interpret=INTERPRET)[0])
        got = np.asarray(mg(q, pt, lens, ht, low, high), np.float32)
        rel = float(np.linalg.norm(got - out) / max(np.linalg.norm(out), 1e-30))
        if not rel < 1e-2:
            raise ValueError(f"mgpu output differs from the Triton kernel's by {rel:.2e}")
        ms = time_jax(mg, q, pt, lens, ht, low, high)
        row["mgpu_gpu_ms"] = gpu_busy_ms(mg, q, pt, lens, ht, low, high)
        fns["mgpu"] = mg
        return ms
    if USE_MGPU and mosaic_sm90.supported(head_dim=D, page=PAGE, tq=tq, group=gqa, high_dtype=high.rows.dtype):
        _method(row, "mgpu", mgpu)
    # what `jm.decode_attention` runs here: the Mosaic GPU kernel where `choose_backend` picks it
    use_mgpu = row.get("mgpu_ms") is not None and choose_backend(
        head_dim=D, page=PAGE, tq=tq, group=gqa, high_dtype=jnp.bfloat16, interpret=INTERPRET) == "mosaic"
    row["default"] = "mgpu" if use_mgpu else "mixed"
    try:        # a failure here (e.g. memory for the loop) must not lose the row's other timings
        row["default_step_ms"] = time_in_step(fns[row["default"]], q, pt, lens, ht, low, high)
    except Exception as e:
        row["default_step_ms"], row["step_error"] = None, f"{type(e).__name__}: {str(e)[:160]}"
        print(f"    step: {row['step_error']}")
    del low, high, fns

    def jax_pa():   # 128-token compute blocks: 8 pages of 16 or 2 of 64 (8 x 64 needs 276 KB of shared memory)
        kp, vp = jax_layout_pages(jax.random.fold_in(key, 4), b, ctx)
        npg, ppcb, ks = ctx // PAGE, max(1, 128 // PAGE), GRID_JAX_PA_SPLITS.get(b, 1)
        while ks > 1 and npg % (ks * ppcb):
            ks //= 2
        return time_jax(jax_pa_fn(min(ppcb, npg), ks), q[:, 0], kp, vp, pt, lens)
    if tq == 1:
        _method(row, "jax_pa", jax_pa)
    row["mixed_vs_nvfp4_floor"] = row["mixed_ms"] / row["floor_nvfp4_ms"]
    for other in ("cudnn", "flash", "jax_pa", "mgpu"):
        if row.get(f"{other}_ms"):
            row[f"{other}_over_mixed"] = row[f"{other}_ms"] / row["mixed_ms"]
    row["default_ms"] = row[f"{row['default']}_ms"]
    row["default_vs_nvfp4_floor"] = row["default_ms"] / row["floor_nvfp4_ms"]
    row["default_gpu_ms"] = row.get(f"{row['default']}_gpu_ms")
    if row["default_step_ms"]:
        row["default_step_vs_nvfp4_floor"] = row["default_step_ms"] / row["floor_nvfp4_ms"]
    # end to end well above the GPU's busy time: the host's dispatch, not the kernels, sets the call's time
    row["host_bound"] = bool(row["default_gpu_ms"] and row["default_ms"] > 1.25 * row["default_gpu_ms"])
    if row.get("cudnn_ms"):
        row["cudnn_over_default"] = row["cudnn_ms"] / row["default_ms"]
        if row["default_step_ms"]:
            row["cudnn_over_default_step"] = row["cudnn_ms"] / row["default_step_ms"]
    return row


def _method(row, name, thunk):
    """``row[name + "_ms"] = thunk()``; a method that fails on this shape is recorded, not fatal for the row."""
    try:
        row[f"{name}_ms"] = thunk()
    except Exception as e:
        row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:160]}"
        print(f"    {name}: {row[f'{name}_error']}")


def grid_table(rows):
    """``mixed``: the Triton kernel; ``mgpu``: the Mosaic GPU kernel; ``dflt``: the one `jm.decode_attention` runs
    (``*`` marks the Mosaic GPU kernel; ``h`` a host-bound call: end to end > 1.25x its GPU time); ``dflt GPU``:
    its GPU busy time (`gpu_busy_ms`); ``step``: its time per call inside one jitted loop of 10 (`time_in_step`);
    ``dflt/fl4`` and ``cuDNN/dflt`` are of the default's end-to-end time, ``step/fl4`` and ``cuDNN/step`` of its
    in-step time."""
    head = (f"{'pg':>3} {'gqa':>3} {'tq':>2} {'B x ctx':>11} {'mixed':>7} {'mgpu':>7} {'dflt':>9} {'dflt GPU':>8} "
            f"{'step':>7} {'cuDNN':>7} {'flash':>7} {'jaxPA':>7} {'fl.fp4':>7} {'fl.bf16':>7} {'dflt/fl4':>8} "
            f"{'step/fl4':>8} {'cuDNN/dflt':>10} {'cuDNN/step':>10}")
    lines = [head]
    for r in rows:
        f = lambda k: fmt(r.get(k), 7)  # noqa: E731
        mark = ("*" if r.get("default") == "mgpu" else " ") + ("h" if r.get("host_bound") else " ")
        lines.append(f"{r['page']:>3} {r['gqa']:>3} {r['tq']:>2} {r['batch']:>4} x {r['context'] // 1024:>4}k "
                     f"{f('mixed_ms')} {f('mgpu_ms')} {f('default_ms')}{mark} {fmt(r.get('default_gpu_ms'), 8)} "
                     f"{f('default_step_ms')} {f('cudnn_ms')} {f('flash_ms')} "
                     f"{f('jax_pa_ms')} {f('floor_nvfp4_ms')} {f('floor_bf16_ms')} "
                     f"{fmt(r.get('default_vs_nvfp4_floor'), 8)} {fmt(r.get('default_step_vs_nvfp4_floor'), 8)} "
                     f"{fmt(r.get('cudnn_over_default'), 10)} {fmt(r.get('cudnn_over_default_step'), 10)}"
                     + (f"  {r['error']}" if r.get("error") else ""))
    return "\n".join(lines)


#: the decode-speed targets, by the default's time ``key``: 16 x 32k at <= 1.5x the NVFP4 bytes floor; every row with
#: >= 512k tokens (batch x context) at <= 1.8x; every row with >= 128k tokens faster than cuDNN SDPA over bf16
TARGET_16X32K, TARGET_512K, TOKENS_512K, TOKENS_128K = 1.5, 1.8, 512 * 1024, 128 * 1024


def grid_targets(rows, key="default_ms"):
    """The three decode-speed targets counted over grid ``rows`` by the default kernel's ``key`` time (``default_ms`` end
    to end, ``default_step_ms`` in one executable, ``default_gpu_ms`` GPU busy): ``{"16x32k": (met, of),
    "512k": (met, of), "cudnn_128k": (met, of), "misses": {target: [(batch, context, gqa, page, tq, value)]}}``,
    values the ratio to the floor (16 x 32k, 512k) or cuDNN / default. Rows without the time are not counted."""
    out = {"misses": {"16x32k": [], "512k": [], "cudnn_128k": []}}
    checks = (("16x32k", lambda r: r["batch"] == 16 and r["context"] == 32768,
               lambda r: r[key] / r["floor_nvfp4_ms"], lambda v: v <= TARGET_16X32K),
              ("512k", lambda r: r["batch"] * r["context"] >= TOKENS_512K,
               lambda r: r[key] / r["floor_nvfp4_ms"], lambda v: v <= TARGET_512K),
              ("cudnn_128k", lambda r: r["batch"] * r["context"] >= TOKENS_128K and r.get("cudnn_ms"),
               lambda r: r["cudnn_ms"] / r[key], lambda v: v > 1.0))
    for name, applies, value, ok in checks:
        met = total = 0
        for r in rows:
            if not r.get(key) or not applies(r):
                continue
            v = value(r)
            total += 1
            if ok(v):
                met += 1
            else:
                out["misses"][name].append((r["batch"], r["context"], r["gqa"], r["page"], r["tq"], round(v, 3)))
        out[name] = (met, total)
    return out


def targets_text(rows):
    """Lines counting the decode-speed targets (`grid_targets`) by end-to-end, in-step and GPU busy time."""
    lines = []
    for key, label in (("default_ms", "end to end"), ("default_step_ms", "in a step"),
                       ("default_gpu_ms", "GPU busy")):
        t = grid_targets(rows, key)
        lines.append(f"targets by {label}: 16 x 32k <= {TARGET_16X32K}x floor {t['16x32k'][0]}/{t['16x32k'][1]}; "
                     f">= 512k tokens <= {TARGET_512K}x {t['512k'][0]}/{t['512k'][1]}; faster than cuDNN at "
                     f">= 128k tokens {t['cudnn_128k'][0]}/{t['cudnn_128k'][1]}")
    return "\n".join(lines)


def grid_order(batches: str, contexts: str, geos: str):
    """The grid's rows ``(batch, context, gqa, page, tq)`` in run order: geometry by geometry (``geos`` =
    ``"GQA/page/Tq,..."``), each over batch x context, so a time-budget cut loses the later geometries."""
    shapes = [(b, c) for b in map(int, batches.split(",")) for c in map(int, contexts.split(","))]
    geo = [tuple(map(int, g.split("/"))) for g in geos.split(",")]
    for g in geo:
        if len(g) != 3:
            raise ValueError(f"--geos: expected GQA/page/Tq triples, got {geos!r}")
    return [(b, c, *g) for g in geo for b, c in shapes]


def parse_shard(text):
    """``"I/N"`` -> ``(I, N)`` with ``0 <= I < N`` (``None`` -> ``(0, 1)``)."""
    if text is None:
        return 0, 1
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard: expected I/N (e.g. 0/4), got {text!r}") from None
    if not 0 <= i < n:
        raise ValueError(f"--shard: need 0 <= I < N, got {text!r}")
    return i, n


def shard_rows(order, shard):
    """Rows ``k`` of ``order`` with ``k % N == I`` (``shard = (I, N)``): N processes, one per GPU of a multi-GPU
    host (``CUDA_VISIBLE_DEVICES``) or consecutive device calls, run the whole grid between them; ``--merge``
    joins their JSONs. Interleaved, so every shard gets small and large shapes alike."""
    i, n = shard
    return [r for k, r in enumerate(order) if k % n == i]


def merge_grids(results, order=None):
    """Join grid results (the JSON dicts of shards of one grid) into one, rows in ``order`` (the grid's run
    order, `grid_order`; default: the shards' rows as listed). Refuses shards measured on different devices or
    versions (the rows would not be side by side) and a row measured twice. Each row keeps the copy bandwidth its
    shard measured (``copy_bandwidth_tbs``); the merged header gives their range. A row one shard skipped (time
    budget) and another measured (a re-run of the skipped rows) is not listed as skipped."""
    if not results:
        raise ValueError("merge: no grid results given")
    keys = ("device", "jax", "triton", "torch", "heads", "head_dim", "first_n", "last_n", "layers")
    first = results[0]
    for r in results[1:]:
        diff = {k: (first.get(k), r.get(k)) for k in keys if first.get(k) != r.get(k)}
        if diff:
            raise ValueError(f"merge: shards differ in {diff}; their rows are not side by side")
    def row_key(row):
        return row["batch"], row["context"], row["gqa"], row["page"], row["tq"]

    rows, seen = [], set()
    for r in results:
        for row in r["rows"]:
            k = row_key(row)
            if k in seen:
                raise ValueError(f"merge: row {k} appears in more than one shard")
            seen.add(k)
            rows.append(row)
    if order is not None:
        rank = {tuple(o): i for i, o in enumerate(order)}
        rows.sort(key=lambda row: rank.get(row_key(row), len(rank)))
    bws = [x["copy_bandwidth_tbs"] for x in results]
    out = {k: first.get(k) for k in keys}
    out.update(date=min(x["date"] for x in results), shards=len(results), copy_bandwidth_tbs=min(bws),
               copy_bandwidth_range_tbs=[min(bws), max(bws)],
               copy_bandwidth_how="; ".join(sorted({x.get("copy_bandwidth_how", "") for x in results})),
               rows=rows, skipped=[s for x in results for s in x.get("skipped", []) if tuple(s) not in seen])
    return out


def merge_main(args):
    """``--merge A.json B.json ...``: one grid JSON (``decode_bench-grid.json`` under ``--out``) and table from
    the shards of one ``--grid`` run."""
    results = []
    for path in args.merge:
        with open(path) as f:
            results.append(json.load(f))
    merged = merge_grids(results, grid_order(args.batches, args.contexts, args.geos))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "decode_bench-grid.json")
    with open(path, "w") as f:
        json.dump(merged, f, indent=1, default=str)
    print(f"device {merged['device']}  jax {merged['jax']}  triton {merged['triton']}  torch {merged['torch']}  "
          f"copy bandwidth {merged['copy_bandwidth_range_tbs'][0]:.2f}-{merged['copy_bandwidth_range_tbs'][1]:.2f} "
          f"TB/s ({merged['shards']} shards)")
    print(grid_table(merged["rows"]))
    print(targets_text(merged["rows"]))
    if merged["skipped"]:
        print(f"not run (time budget): {merged['skipped']}")
    print(f"wrote {path}")
    return 0


def grid_main(args, torch, bw, bw_how, info):
    """``--grid``: batch x context x GQA {4, 8} x page {16, 64} x Tq {1, 4}, default configs only (one compile per
    kernel and shape), the headline geometry (GQA 4, page 16, Tq 1) first so a time-budget cut loses variants;
    ``--shard I/N`` runs every N-th row (`shard_rows`)."""
    order = shard_rows(grid_order(args.batches, args.contexts, args.geos), parse_shard(args.shard))
    result = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **info,
                  copy_bandwidth_tbs=bw, copy_bandwidth_how=bw_how, heads=H, head_dim=D, first_n=FIRST_N,
                  last_n=LAST_N, layers=LAYERS, shard=args.shard, rows=[], skipped=[])
    path = os.path.join(args.out, "decode_bench-grid.json")
    t0 = time.time()
    for b, c, g, p, t in order:
        if time.time() - t0 > args.budget_s:
            result["skipped"].append([b, c, g, p, t])
            continue
        try:
            row = grid_row(torch, bw, b, c, g, p, t)
        except Exception as e:  # OOM or a failure on one shape must not lose the rest
            row = dict(batch=b, context=c, gqa=g, page=p, tq=t, error=f"{type(e).__name__}: {str(e)[:160]}")
        result["rows"].append(row)
        print(grid_table([row]).splitlines()[-1], f"({time.time() - t0:.0f}s)", flush=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1, default=str)
    text = grid_table(result["rows"])
    print(text)
    print(targets_text(result["rows"]))
    if result["skipped"]:
        print(f"not run (time budget {args.budget_s:.0f}s): {result['skipped']}")
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    batches, contexts, geos = grid_args()
    ap.add_argument("--batches", default=batches)
    ap.add_argument("--contexts", default=contexts)
    ap.add_argument("--quick", action="store_true",
                    help="sweep MIXED/PLAIN_CONFIGS on the first shape only, then its TOP_K; fewer jax_pa configs")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny shapes in interpret mode (script check)")
    ap.add_argument("--no-mgpu", action="store_true", help="skip (f), the Mosaic GPU kernel")
    ap.add_argument("--layers", type=int, default=1,
                    help="layers in every pool (32 = a model-shaped cache, e.g. Llama-3-8B); the last is read")
    ap.add_argument("--budget-s", type=float, default=520.0,
                    help="stop starting new shapes after this many seconds (the device runs commands for <= 600 s)")
    ap.add_argument("--mem-gib", type=float, default=120.0, help="skip shapes needing more device memory")
    ap.add_argument("--grid", action="store_true",
                    help="the decode-speed grid: x GQA {4, 8} x page {16, 64} x Tq {1, 4}, default configs only")
    ap.add_argument("--geos", default=geos,
                    help="--grid geometries GQA/page/Tq, in the order they run")
    ap.add_argument("--shard", default=None,
                    help="--grid: run rows k with k %% N == I (I/N), e.g. one process per GPU: "
                         "CUDA_VISIBLE_DEVICES=i ... --shard i/4; --merge joins the shards' JSONs")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="join the decode_bench-grid.json files of --shard runs into one grid JSON + table "
                         "under --out (no GPU needed)")
    ap.add_argument("--results-md", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md"))
    args = ap.parse_args(argv)
    try:
        parse_shard(args.shard)
        grid_order(args.batches, args.contexts, args.geos)
    except ValueError as e:
        ap.error(str(e))
    if args.merge:
        return merge_main(args)
    global INTERPRET, CHECK_LENS, USE_MGPU, MGPU_CONFIGS, LAYERS
    USE_MGPU = not args.no_mgpu
    LAYERS = args.layers
    if args.smoke:
        MGPU_CONFIGS = MGPU_CONFIGS[:1]      # the Mosaic GPU interpreter is slow
    if args.smoke and not on_gpu():
        INTERPRET, CHECK_LENS = True, (1, 17, 100)
    elif not on_gpu():
        print("decode_bench: no GPU found (jax backend is %r); this benchmark runs on the H200 only. "
              "Nothing to do." % jax.default_backend())
        return 0
    os.makedirs(args.out, exist_ok=True)
    try:
        import torch
        if INTERPRET or not torch.cuda.is_available():
            torch = None
    except Exception:
        torch = None
    shapes = [(b, c) for b in map(int, args.batches.split(",")) for c in map(int, args.contexts.split(","))]
    skipped = [s for s in shapes if not fits(*s, args.mem_gib)]
    shapes = [s for s in shapes if fits(*s, args.mem_gib)]
    t0 = time.time()
    bw, bw_how = (4.3, "nominal (smoke)") if INTERPRET else copy_bandwidth_tbs(torch)
    info = versions(torch)
    print(f"device {info['device']}  jax {info['jax']}  triton {info['triton']}  torch {info['torch']}  "
          f"copy bandwidth {bw:.2f} TB/s ({bw_how})")
    if args.grid:
        return grid_main(args, torch, bw, bw_how, info)
    torch_ms = torch_sdpa_all(torch, shapes) if torch is not None else {}
    ok, corr = check_correctness(torch)
    print("correctness:", json.dumps(corr), "OK" if ok else "FAILED")
    result = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **info,
                  copy_bandwidth_tbs=bw, copy_bandwidth_how=bw_how, heads=H, q_heads=HQ, head_dim=D, page=PAGE,
                  first_n=FIRST_N, last_n=LAST_N, layers=LAYERS, correctness=corr, correctness_ok=ok,
                  skipped=[list(s) for s in skipped], rows=[])
    tag = f"b{args.batches}-c{args.contexts}".replace(",", "_") + (f"-L{LAYERS}" if LAYERS > 1 else "")
    path = os.path.join(args.out, f"decode_bench-{tag}.json")
    first_best = None
    for b, ctx in shapes:
        if time.time() - t0 > args.budget_s:
            print(f"-- time budget {args.budget_s:.0f}s spent: skipping {b}x{ctx} and the rest")
            result["skipped"].append([b, ctx, "time budget"])
            continue
        print(f"-- batch {b} x context {ctx} ({time.time() - t0:.0f}s)", flush=True)
        try:
            row = run_shape(b, ctx, bw, torch_ms, args.quick, first_best)
            if first_best is None:
                first_best = {k: top_configs(row.get(f"{k}_all") or {}) for k in ("mixed", "plain")}
                print(f"   best configs carried to later shapes: {first_best}", flush=True)
        except Exception as e:  # OOM or a failure on one shape must not lose the rest
            row = dict(batch=b, context=ctx, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}",
                       floor_nvfp4_ms=float("nan"), floor_bf16_ms=float("nan"))
            print("   failed:", row["error"])
        result["rows"].append(row)
        with open(path, "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(table([row]).splitlines()[-1], flush=True)
    text = table(result["rows"]) + "\n" + best_lines(result["rows"])
    print(text)
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    append_results_md(args.results_md, result, text)
    print(f"wrote {path} and a section in {args.results_md} ({time.time() - t0:.0f}s)")
    return 0 if ok else 1


def append_results_md(md, result, text):
    if not os.path.exists(md):
        with open(md, "w") as f:
            f.write("# jmixedkv benchmark results (GPU runs; each section dated, with device and versions)\n")
    target = [r for r in result["rows"] if r.get("batch") == 16 and r.get("context") == 32768 and r.get("mixed_ms")]
    goal = ""
    if target:
        r = target[0]
        goal = (f"\nTarget (16 x 32k): mixed {r['mixed_ms']:.3f} ms = {r['mixed_vs_nvfp4_floor']:.2f}x the NVFP4 "
                f"bytes floor (goal <= 1.25x); {r.get('speedup_vs_jax_pa', float('nan')):.2f}x faster than JAX "
                f"Pallas bf16 paged attention and {r.get('speedup_vs_sdpa', float('nan')):.2f}x than torch SDPA "
                f"(goal >= 3x bf16 paged attention).\n")
    with open(md, "a") as f:
        f.write(f"\n## Decode attention (fused NVFP4 mixed kernel) — {result['date']}\n\n"
                f"Device {result['device']}, jax {result['jax']}, triton {result['triton']}, torch {result['torch']}; "
                f"copy bandwidth {result['copy_bandwidth_tbs']:.2f} TB/s ({result['copy_bandwidth_how']}). "
                f"{H} KV heads, {HQ} query heads, head_dim {D}, page {PAGE}, Tq 1, mixed_nvfp4_bf16 first_n="
                f"{FIRST_N} last_n={LAST_N}. Times in ms (median); (a) fused kernel on mixed pools, (b) same kernel on "
                f"bf16 pages, (c) jax.experimental.pallas.ops.gpu.paged_attention bf16 (best config), (d) stage (XLA) "
                f"+ paged attention, (e) torch SDPA best of flash/cuDNN, (f) Pallas Mosaic GPU kernel on the mixed "
                f"pools (pallas_kernels/decode/mosaic_sm90.py); floors = K+V bytes / copy bandwidth. "
                f"Correctness on GPU: {'OK' if result['correctness_ok'] else 'FAILED'} {json.dumps(result['correctness'])}."
                f"\n{goal}\n```\n{text}\n```\n")
        if result["skipped"]:
            f.write(f"Skipped (memory or time budget): {result['skipped']}\n")


if __name__ == "__main__":
    sys.exit(main())
