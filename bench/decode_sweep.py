"""Decode-kernel sweep on the H200: correctness vs the float32 reference, then the Triton kernel's variants timed
over a handful of shapes, the Mosaic GPU kernel beside it (issue 18).

Variants (`VARIANTS`): tokens per inner step (``block_k`` = pages per iteration x page), ``num_warps``,
``num_stages``, split-K count (a multiplier of `default_num_splits`, so programs vs the 132 SMs scale with it) and
the keys-major form. GQA packing (every query head of a KV group in one program's M rows) and twin rows only in
edge blocks are what the kernel always does. Shapes (`SHAPES`): 16 x 32k GQA 4 / 8 at page 16 / 64, Tq 1 / 4,
1 x 128k, 64 x 4k, 64 x 32k; 8 KV heads, head_dim 128, mixed_nvfp4_bf16 first_n = last_n = 64.

Correctness first, on small random caches (lengths 1 .. 4096 incl. page +- 1, permuted page ids): every variant
and the Mosaic kernel vs float32 attention over `stage_reference`'s float32 staging (rel. L2, LSE abs); then at
each big shape every variant's output vs the first variant's. Per row of the table: median ms, achieved NVFP4
bandwidth (K + V + scales + twin bytes / time), ratio to the bytes floor (bytes / copy bandwidth measured in-run),
programs (grid size) per SM.

Usage: ``PYTHONPATH=. python3 bench/decode_sweep.py --out DIR [--budget-s 200]``; writes ``DIR/decode_sweep.json``
(rewritten after every shape). ``--profile NAME`` runs one variant at 16 x 32k three times and exits (for ncu).
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jmixedkv as jm  # noqa: E402
from jmixedkv import nvfp4  # noqa: E402
from jmixedkv.pools import kernel_arrays  # noqa: E402
from jmixedkv.compat import on_gpu  # noqa: E402
from pallas_kernels import decode_attention as da  # noqa: E402
from pallas_kernels import decode_mgpu  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_bench import copy_bandwidth_tbs, time_jax  # noqa: E402  (one timing rule for the decode benches)

H, D, FIRST_N, LAST_N = 8, 128, 64, 64
NUM_SMS = 132
CHECK_MGPU = True    # --no-mgpu-check: the Mosaic kernel is not re-checked
INTERPRET = False    # --smoke on CPU: tiny shapes in interpret mode (checks the script, times nothing real)
# name -> kernel kwargs; "x" = split multiplier vs default_num_splits
VARIANTS = {
    "default": {},                                                       # the kernel's own choice (after sweep)
    "k64w2s3x1": dict(block_k=64, num_warps=2, num_stages=3),           # the default before this sweep
    "k64w2s3x2": dict(block_k=64, num_warps=2, num_stages=3, x=2),
    "k64w2s3x4": dict(block_k=64, num_warps=2, num_stages=3, x=4),
    "k64w2s4x1": dict(block_k=64, num_warps=2, num_stages=4),
    "k64w2s4x2": dict(block_k=64, num_warps=2, num_stages=4, x=2),
    "k64w1s3x2": dict(block_k=64, num_warps=1, num_stages=3, x=2),
    "k64w1s3x4": dict(block_k=64, num_warps=1, num_stages=3, x=4),
    "k32w1s3x4": dict(block_k=32, num_warps=1, num_stages=3, x=4),
    "k32w1s4x8": dict(block_k=32, num_warps=1, num_stages=4, x=8),
    "k32w2s3x2": dict(block_k=32, num_warps=2, num_stages=3, x=2),
    "k128w4s3x2": dict(block_k=128, num_warps=4, num_stages=3, x=2),
    "k128w2s2x2": dict(block_k=128, num_warps=2, num_stages=2, x=2),
    "k64w4s3x2": dict(block_k=64, num_warps=4, num_stages=3, x=2),
    "k64w2s3x1-km": dict(block_k=64, num_warps=2, num_stages=3, keys_major=True),
    "k32w2s4x4": dict(block_k=32, num_warps=2, num_stages=4, x=4),
    "k64w2s3x8": dict(block_k=64, num_warps=2, num_stages=3, x=8),
    "k16w1s4x8": dict(block_k=16, num_warps=1, num_stages=4, x=8),
    "k64w2s3x1-vl": dict(block_k=64, num_warps=2, num_stages=3, v_late=True),
    "k64w2s3x4-vl": dict(block_k=64, num_warps=2, num_stages=3, x=4, v_late=True),
    "k128w4s3x2-vl": dict(block_k=128, num_warps=4, num_stages=3, x=2, v_late=True),
    "k32w2s3x2-vl": dict(block_k=32, num_warps=2, num_stages=3, x=2, v_late=True),
    "k32w1s3x4-vl": dict(block_k=32, num_warps=1, num_stages=3, x=4, v_late=True),
    "k32w2s2x4-vl": dict(block_k=32, num_warps=2, num_stages=2, x=4, v_late=True),
    "k64w2s2x2-vl": dict(block_k=64, num_warps=2, num_stages=2, x=2, v_late=True),
    "k64w4s3x2-vl": dict(block_k=64, num_warps=4, num_stages=3, x=2, v_late=True),
    # fewer, longer splits for the short / narrow shapes (16 x 4k, 1 x 32k GQA 8: 2-8x their floor on the grid)
    "k32w1s3x0.5-vl": dict(block_k=32, num_warps=1, num_stages=3, x=0.5, v_late=True),
    "k32w1s3x1-vl": dict(block_k=32, num_warps=1, num_stages=3, x=1, v_late=True),
    "k32w1s3x2-vl": dict(block_k=32, num_warps=1, num_stages=3, x=2, v_late=True),
    "k64w2s3x0.5-vl": dict(block_k=64, num_warps=2, num_stages=3, x=0.5, v_late=True),
    "k64w2s3x0.25-vl": dict(block_k=64, num_warps=2, num_stages=3, x=0.25, v_late=True),
}
# column groups (issue 18): the kernel's default puts the MMA's padding query rows to work on V's column groups;
# "-cg1" = the kernel before it (one output accumulator of all D columns)
for _n, _kw in [("k32w1s3x4-vl", dict(block_k=32, num_warps=1, num_stages=3, x=4)),
                ("k64w2s3x1-vl", dict(block_k=64, num_warps=2, num_stages=3)),
                ("k64w1s3x2-vl", dict(block_k=64, num_warps=1, num_stages=3, x=2))]:
    VARIANTS[_n + "-cg1"] = dict(_kw, v_late=True, col_groups=1)
VARIANTS.update({
    "k32w1s2x4-vl": dict(block_k=32, num_warps=1, num_stages=2, x=4, v_late=True),
    "k32w1s1x4-vl": dict(block_k=32, num_warps=1, num_stages=1, x=4, v_late=True),
    "k64w1s3x2-vl": dict(block_k=64, num_warps=1, num_stages=3, x=2, v_late=True),
    "k64w1s2x2-vl": dict(block_k=64, num_warps=1, num_stages=2, x=2, v_late=True),
    "k64w1s3x4-vl": dict(block_k=64, num_warps=1, num_stages=3, x=4, v_late=True),
    "k128w2s2x2-vl": dict(block_k=128, num_warps=2, num_stages=2, x=2, v_late=True),
    "k16w1s3x8-vl": dict(block_k=16, num_warps=1, num_stages=3, x=8, v_late=True),
    "k64w2s3x2-vl": dict(block_k=64, num_warps=2, num_stages=3, x=2, v_late=True),
    # column groups forced off / on (the default rule decides from the tokens per split)
    "k32w1s3x2-vl-g1": dict(block_k=32, num_warps=1, num_stages=3, x=2, v_late=True, col_groups=1),
    "k32w1s3x4-vl-g4": dict(block_k=32, num_warps=1, num_stages=3, x=4, v_late=True, col_groups=4),
    # Tq 4 (verify steps: 16 / 32 real query rows per program)
    "k32w2s3x1-vl": dict(block_k=32, num_warps=2, num_stages=3, x=1, v_late=True),
    "k64w4s3x1-vl": dict(block_k=64, num_warps=4, num_stages=3, x=1, v_late=True),
    "k32w4s3x1-vl": dict(block_k=32, num_warps=4, num_stages=3, x=1, v_late=True),
})
# later shapes: this subset (the default first) unless --all
SUBSET = ["k64w2s3x1", "k64w2s3x4-vl", "k64w2s3x2", "k64w2s3x4", "k64w2s4x2", "k64w1s3x4", "k32w1s3x4",
          "k32w1s4x8", "k128w2s2x2"]
# (name, batch, context, q heads, page, Tq)
SHAPES = [("16x32k g4 p16 t1", 16, 32768, 32, 16, 1),
          ("64x32k g4 p16 t1", 64, 32768, 32, 16, 1),
          ("1x128k g4 p16 t1", 1, 131072, 32, 16, 1),
          ("16x32k g8 p16 t1", 16, 32768, 64, 16, 1),
          ("16x32k g4 p64 t1", 16, 32768, 32, 64, 1),
          ("16x32k g4 p16 t4", 16, 32768, 32, 16, 4),
          ("64x4k g4 p16 t1", 64, 4096, 32, 16, 1),
          ("16x4k g4 p16 t1", 16, 4096, 32, 16, 1),
          ("1x32k g8 p16 t1", 1, 32768, 64, 16, 1),
          ("1x32k g4 p16 t1", 1, 32768, 32, 16, 1),
          ("64x8k g4 p16 t1", 64, 8192, 32, 16, 1),          # the shape of bench/step_bench.py
          ("16x32k g8 p16 t4", 16, 32768, 64, 16, 4)]


# --------------------------------------------------------------------------------------------- helpers
def copy_bw_tbs():
    """``(copy bandwidth TB/s, torch version)``: decode_bench's measurement (torch ``copy_`` of 2 GiB)."""
    if INTERPRET:
        return 4.26, "n/a (smoke)"
    try:
        import torch
        torch = torch if torch.cuda.is_available() else None
    except ImportError:
        torch = None
    bw, how = copy_bandwidth_tbs(torch)
    return bw, torch.__version__ if torch is not None else f"n/a ({how})"


def geometry(page):
    cfg = jm.KVCacheConfig("mixed_nvfp4_bf16", first_n=FIRST_N, last_n=LAST_N, page_size=page)
    return cfg, cfg.num_fixed_pages, cfg.num_ring_pages


def geom_kw(fn, page, nf, nr):
    """The twin geometry as ``fn`` takes it: ``geom=TwinGeometry`` (issue 16) or the four ints (before it)."""
    import inspect
    if "geom" in inspect.signature(fn).parameters:
        from jmixedkv.layout import TwinGeometry
        return dict(geom=TwinGeometry(page, FIRST_N, LAST_N, nf, nr))
    return dict(first_n=FIRST_N, last_n=LAST_N, num_fixed=nf, num_ring=nr)


@functools.partial(jax.jit, static_argnames=("shape",))
def _rand_u8(key, shape):
    return jax.random.bits(key, shape, jnp.uint8)


@functools.partial(jax.jit, static_argnames=("shape",))
def _rand_scales(key, shape):
    b = (jax.random.bits(key, shape, jnp.uint8) & jnp.uint8(0x1F)) + jnp.uint8(0x28)   # 2^-4 .. 2^0, finite
    return jax.lax.bitcast_convert_type(b, jnp.float8_e4m3fn)


@functools.partial(jax.jit, static_argnames=("shape",))
def _rand_bf16(key, shape):
    return jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)


def random_state(page, lens, seed=0, extra_pages=0):
    """A CacheState of ``len(lens)`` sequences of random NVFP4 pages + bf16 twin rows (valid E4M3 scales, gs from
    amax 8), page ids a random permutation; ``extra_pages`` free low pages per sequence for appends."""
    cfg, nf, nr = geometry(page)
    spec = jm.GroupSpec(num_layers=1, num_kv_heads=H, head_dim=D)
    b = len(lens)
    ppseq = max(1, -(-max(lens) // page)) + extra_pages
    used = b * ppseq
    st = jm.init_state(cfg, spec, used, b, ppseq, gs=float(nvfp4.global_scale_from_amax(8.0)))
    pool = st.pools[0]
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    low = dataclasses.replace(pool.low, data=_rand_u8(k1, pool.low.data.shape),
                              scales=_rand_scales(k2, pool.low.scales.shape))
    high = dataclasses.replace(pool.high, rows=_rand_bf16(k3, pool.high.rows.shape))
    perm = np.random.default_rng(seed).permutation(used).astype(np.int32).reshape(b, ppseq)
    nh = st.high_table.shape[1]
    ht = np.arange(b * nh, dtype=np.int32).reshape(b, nh)
    return dataclasses.replace(st, pools=(dataclasses.replace(pool, low=low, high=high),),
                               page_table=jnp.asarray(perm), high_table=jnp.asarray(ht),
                               kv_lens=jnp.asarray(np.asarray(lens, np.int32)), active=jnp.ones((b,), bool)), nf, nr


def bench_queries(batch, tq, q_heads):
    """The bench shapes' queries: bf16 ``[batch, tq, q_heads, D]``, standard normal (key ``batch``)."""
    return jax.random.normal(jax.random.PRNGKey(batch), (batch, tq, q_heads, D), jnp.float32).astype(jnp.bfloat16)


def state_args(st, q):
    """``(q, page_table, kv_lens, high_table, low arrays, high arrays)`` of layer 0's pool in ``st``: the argument
    order of this sweep's kernel functions (`kernel_fn`, `mgpu_fn`)."""
    pool = st.pools[0]
    return q, st.page_table, st.kv_lens, st.high_table, kernel_arrays(pool.low), kernel_arrays(pool.high)


def mgpu_case(page, batch, context, q_heads, tq):
    """Inputs of `pallas_kernels.decode_mgpu.paged_decode_attention_mgpu` at one bench shape: ``batch`` sequences of
    ``context`` tokens in a `random_state` cache of ``page``-token pages, ``q`` bf16 ``[batch, tq, q_heads, D]``
    (key ``batch``). -> ``(args, nf, nr)``, ``args = (q, page_table, kv_lens, 0, low arrays, high arrays,
    high_table)`` positionally; ``nf`` / ``nr`` for `geom_kw`. ValueError for a field < 1 or ``q_heads`` not a
    multiple of the `H` KV heads."""
    fields = dict(page=page, batch=batch, context=context, q_heads=q_heads, tq=tq)
    bad = {k: v for k, v in fields.items() if v < 1}
    if bad:
        raise ValueError(f"every shape field must be >= 1, got {bad}")
    if q_heads % H:
        raise ValueError(f"q_heads must be a multiple of the {H} KV heads, got {q_heads}")
    st, nf, nr = random_state(page, [context] * batch)
    q, page_table, kv_lens, high_table, low, high = state_args(st, bench_queries(batch, tq, q_heads))
    return (q, page_table, kv_lens, 0, low, high, high_table), nf, nr


def splits_for(v, b, npg, page, m_rows=16, rows=None):
    """Split count of variant ``v``; the kernel's own default tuning (`default_tuning`) for ``{}`` (``rows``: the
    real query rows ``Tq * G``, default ``m_rows``)."""
    if "block_k" not in v:
        bk, _, per_sm = da.default_tuning("nvfp4", b, H, page, m_rows, rows)
        nb = da.pages_per_block(bk, page)
        return da.default_num_splits(b, H, max(1, -(-npg // nb)), per_sm)
    nb = da.pages_per_block(v["block_k"], page)
    blocks = max(1, -(-npg // nb))
    return max(1, min(blocks, int(round(da.default_num_splits(b, H, blocks) * v.get("x", 1)))))


def kernel_fn(v, b, npg, page, nf, nr, out_dtype=None, m_rows=16, rows=None):
    kw = {k: v[k] for k in ("block_k", "num_warps", "num_stages", "keys_major", "v_late", "col_groups") if k in v}
    splits = splits_for(v, b, npg, page, m_rows, rows)
    kw.update(geom_kw(da.paged_decode_attention, page, nf, nr))
    if v:
        kw["num_splits"] = splits
    fn = jax.jit(lambda q, pt, lens, ht, low, high: da.paged_decode_attention(
        q, pt, lens, 0, low, high, None, ht, out_dtype=out_dtype, interpret=INTERPRET, **kw))
    return fn, splits


def mgpu_fn(page, nf, nr, out_dtype=None):
    kw = geom_kw(decode_mgpu.paged_decode_attention_mgpu, page, nf, nr)
    return jax.jit(lambda q, pt, lens, ht, low, high: decode_mgpu.paged_decode_attention_mgpu(
        q, pt, lens, 0, low, high, ht, out_dtype=out_dtype, interpret=INTERPRET, **kw))


# --------------------------------------------------------------------------------------------- load-only probe
# The memory side alone: the same grid, page-table gather and block sizes as the kernel, every NVFP4 byte and
# scale of K and V loaded and summed (integer adds), no dequantization, no dots, no softmax. Kernel time minus
# probe time is what the compute side costs; the probe's bandwidth is what this access pattern can reach.
PROBES = {"probe-k64w2s3x1": dict(block_k=64, num_warps=2, num_stages=3),
          "probe-k64w2s3x4": dict(block_k=64, num_warps=2, num_stages=3, x=4),
          "probe-k64w4s3x2": dict(block_k=64, num_warps=4, num_stages=3, x=2),
          "probe-k128w4s3x4": dict(block_k=128, num_warps=4, num_stages=3, x=4)}


def probe_fn(v, b, npg, page):
    from jmixedkv.compat import triton_params
    pl = da.pl
    nb = da.pages_per_block(v["block_k"], page)
    k_tok = nb * page
    splits = splits_for(v, b, npg, page)

    def kernel(pt_ref, len_ref, data_ref, scales_ref, o_ref):
        s_ = pl.program_id(2)
        n = len_ref[0]
        n_blocks = (n + k_tok - 1) // k_tok
        per = (n_blocks + splits - 1) // splits
        start = s_ * per
        end = jnp.minimum(start + per, n_blocks)

        def body(blk, acc):
            a, c = acc
            ids = jnp.maximum(pt_ref[pl.ds(blk * nb, nb)], 0)
            for kvi in range(2):
                a = a ^ data_ref[0, ids, kvi].reshape(k_tok, D // 2)
                c = c ^ jax.lax.bitcast_convert_type(scales_ref[0, ids, kvi], jnp.uint8).reshape(k_tok, D // 16)
            return a, c
        init = (jnp.zeros((k_tok, D // 2), jnp.uint8), jnp.zeros((k_tok, D // 16), jnp.uint8))
        a, c = jax.lax.fori_loop(start, jnp.maximum(end, start), body, init)
        o_ref[...] = c.astype(jnp.int32).sum(axis=0) + a.astype(jnp.int32).sum()

    def full(x):
        nd = x.ndim
        shape = tuple(None if i == 3 else x.shape[i] for i in range(nd))
        return pl.BlockSpec(shape, lambda bi, hi, si: tuple(hi if i == 3 else 0 for i in range(nd)))

    def run(pt, lens, data, scales):
        ptp = jnp.pad(pt, ((0, 0), (0, -pt.shape[1] % nb)))
        return pl.pallas_call(
            kernel, grid=(b, H, splits),
            in_specs=[pl.BlockSpec((None, ptp.shape[1]), lambda bi, hi, si: (bi, 0)),
                      pl.BlockSpec((1,), lambda bi, hi, si: (bi,)), full(data), full(scales)],
            out_specs=pl.BlockSpec((None, None, None, D // 16), lambda bi, hi, si: (si, bi, hi, 0)),
            out_shape=jax.ShapeDtypeStruct((splits, b, H, D // 16), jnp.int32),
            compiler_params=triton_params(num_warps=v["num_warps"], num_stages=v["num_stages"]),
            interpret=INTERPRET, name="decode_probe")(ptp, lens, data, scales)
    return jax.jit(run), splits


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# --------------------------------------------------------------------------------------------- correctness
def correctness(names, log):
    """Every variant (and the Mosaic kernel at page 16) vs float32 attention over the float32 staging."""
    res, ok = {}, True
    for page, tq, hq in ((16, 1, 32), (64, 4, 32), (16, 1, 64)):
        # 9 sequences at page 16: batch x kv heads = 72 >= 66 takes the kernel's wide-grid default tuning
        lens = (1, 15, 16, 17, 100, 1000, 2047, 3001, 4096) if page == 16 else (4, 63, 64, 65, 300, 2049, 4096)
        if INTERPRET:
            lens = (1, 17, 100) if page == 16 else (4, 65, 130)
        st, nf, nr = random_state(page, lens, seed=page + tq)
        q = jax.random.normal(jax.random.PRNGKey(7), (len(lens), tq, hq, D), jnp.float32).astype(jnp.bfloat16)
        slots = jnp.arange(len(lens), dtype=jnp.int32)
        staged = jm.stage_reference(st, 0, slots, dtype=jnp.float32)
        ref, ref_lse = jm.attention_reference(q, staged[:, 0], staged[:, 1], st.kv_lens)
        ref_b = np.asarray(ref.astype(jnp.bfloat16).astype(jnp.float32))
        pool = st.pools[0]
        npg = st.page_table.shape[1]
        args = state_args(st, q)
        todo = [(n, VARIANTS[n]) for n in (names if page == 16 and tq == 1 and hq == 32 else names[:4])]
        todo += [("mgpu", None)] if CHECK_MGPU else []
        for n, v in todo:
            key = f"p{page} t{tq} hq{hq} {n}"
            try:
                if v is None:
                    if not decode_mgpu.supported(head_dim=D, page=page, tq=tq, group=hq // H,
                                                 high_dtype=pool.high.rows.dtype):
                        continue
                    fn = mgpu_fn(page, nf, nr)
                else:
                    fn = kernel_fn(v, len(lens), npg, page, nf, nr,
                                   m_rows=max(16, 1 << (tq * hq // H - 1).bit_length()), rows=tq * hq // H)[0]
                o, lse = fn(*args)
                e = rel(o.astype(jnp.float32), ref_b)
                fin = np.isfinite(np.asarray(lse))
                le = float(np.max(np.abs(np.asarray(lse)[fin] - np.asarray(ref_lse)[fin]))) if fin.any() else 0.0
                good = e < 2e-3 and le < 1e-3 and bool(np.isfinite(np.asarray(o, np.float32)).all())
                res[key] = dict(rel_l2=e, lse_abs=le, ok=good)
                ok &= good
                log(f"  check {key}: rel {e:.2e} lse {le:.1e} {'ok' if good else 'FAIL'}")
            except Exception as ex:
                res[key] = dict(error=f"{type(ex).__name__}: {str(ex).splitlines()[0][:160]}")
                log(f"  check {key}: error {res[key]['error']}")
                if v is not None and n == names[0]:
                    ok = False
    return ok, res


# --------------------------------------------------------------------------------------------- shapes
def shape_bytes(b, ctx, page):
    """NVFP4 K+V data + E4M3 scales + retained twin rows (bf16) + page table, bytes."""
    toks = b * ctx
    return toks * H * D * 2 * (0.5 + 1 / 16) + b * (FIRST_N + LAST_N) * H * D * 2 * 2 + b * (ctx // page) * 4


def run_shape(shape, names, bw, log, with_mgpu=True, with_probe=False):
    label, b, ctx, hq, page, tq = shape
    st, nf, nr = random_state(page, [ctx] * b, seed=b + ctx // 1024 + page)
    pool = st.pools[0]
    npg = st.page_table.shape[1]
    q = bench_queries(b, tq, hq)
    args = state_args(st, q)
    nbytes = shape_bytes(b, ctx, page)
    floor = nbytes / (bw * 1e12) * 1e3
    row = dict(shape=label, batch=b, context=ctx, q_heads=hq, page=page, tq=tq, bytes=nbytes, floor_ms=floor,
               variants={})
    first = None
    for n in names:
        v = VARIANTS[n]
        t0 = time.time()
        try:
            fn, splits = kernel_fn(v, b, npg, page, nf, nr, m_rows=max(16, 1 << (tq * hq // H - 1).bit_length()),
                                   rows=tq * hq // H)
            out = np.asarray(fn(*args)[0], np.float32)
            if not np.isfinite(out).all():
                raise FloatingPointError("non-finite output")
            first = out if first is None else first
            d = rel(out, first)
            if d > 2e-3:
                raise ValueError(f"differs from {names[0]} by {d:.2e}")
            ms = time_jax(lambda *a: fn(*a)[0], *args)
            progs = b * H * splits
            row["variants"][n] = dict(ms=ms, x_floor=ms / floor, tbs=nbytes / (ms * 1e-3) / 1e12, splits=splits,
                                      programs=progs, programs_per_sm=progs / NUM_SMS, vs_first=d)
            log(f"  {label} {n:>14}: {ms:7.3f} ms  {ms / floor:5.2f}x floor  {nbytes / ms / 1e9:5.2f} TB/s  "
                f"splits {splits:3d}  progs/SM {progs / NUM_SMS:6.1f}  ({time.time() - t0:.0f}s)")
        except Exception as ex:
            row["variants"][n] = dict(error=f"{type(ex).__name__}: {str(ex).splitlines()[0][:160]}")
            log(f"  {label} {n:>14}: error {row['variants'][n]['error']}")
    for n, v in (PROBES.items() if with_probe else ()):
        try:
            fn, splits = probe_fn(v, b, npg, page)
            pargs = (st.page_table, st.kv_lens, pool.low.data, pool.low.scales)
            jax.block_until_ready(fn(*pargs))
            ms = time_jax(fn, *pargs)
            pbytes = b * ctx * H * D * 2 * (0.5 + 1 / 16)
            row.setdefault("probes", {})[n] = dict(ms=ms, tbs=pbytes / (ms * 1e-3) / 1e12, splits=splits,
                                                   programs_per_sm=b * H * splits / NUM_SMS)
            log(f"  {label} {n:>16}: {ms:7.3f} ms  {pbytes / ms / 1e9:5.2f} TB/s (loads only)")
        except Exception as ex:
            row.setdefault("probes", {})[n] = dict(error=f"{type(ex).__name__}: {str(ex).splitlines()[0][:160]}")
            log(f"  {label} {n}: error {row['probes'][n]['error']}")
    if with_mgpu and decode_mgpu.supported(head_dim=D, page=page, tq=tq, group=hq // H,
                                           high_dtype=pool.high.rows.dtype):
        try:
            fn = mgpu_fn(page, nf, nr)
            out = np.asarray(fn(*args)[0], np.float32)
            d = rel(out, first) if first is not None else float("nan")
            ms = time_jax(lambda *a: fn(*a)[0], *args)
            row["mgpu"] = dict(ms=ms, x_floor=ms / floor, tbs=nbytes / (ms * 1e-3) / 1e12, vs_first=d)
            log(f"  {label} {'mgpu':>14}: {ms:7.3f} ms  {ms / floor:5.2f}x floor  (vs triton {d:.1e})")
        except Exception as ex:
            row["mgpu"] = dict(error=f"{type(ex).__name__}: {str(ex).splitlines()[0][:160]}")
            log(f"  {label} mgpu: error {row['mgpu']['error']}")
    ok = {k: v for k, v in row["variants"].items() if "ms" in v}
    if ok:
        best = min(ok, key=lambda k: ok[k]["ms"])
        row["best"] = best
        row["best_ms"] = ok[best]["ms"]
    return row


def table(rows):
    lines = [f"{'shape':>18} {'floor':>7} {'default':>8} {'best':>8} {'best cfg':>14} {'x floor':>7} "
             f"{'TB/s':>5} {'gain':>5} {'mgpu':>7}"]
    for r in rows:
        dflt = r["variants"].get(SUBSET[0], {}).get("ms")
        best = r.get("best_ms")
        mg = r.get("mgpu", {}).get("ms")
        f = lambda x, w=8: f"{x:{w}.3f}" if x else f"{'-':>{w}}"  # noqa: E731
        lines.append(f"{r['shape']:>18} {f(r['floor_ms'], 7)} {f(dflt)} {f(best)} {r.get('best', '-'):>14} "
                     f"{(best / r['floor_ms']) if best else float('nan'):7.2f} "
                     f"{(r['bytes'] / best / 1e9) if best else float('nan'):5.2f} "
                     f"{(dflt / best) if (best and dflt) else float('nan'):5.2f} {f(mg, 7)}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--budget-s", type=float, default=200.0)
    ap.add_argument("--all", action="store_true", help="every variant at every shape")
    ap.add_argument("--variants", default=None, help="comma list of variant names (first = reference)")
    ap.add_argument("--shapes", default=None, help="comma list of SHAPES indices")
    ap.add_argument("--later", default=None, help="comma list of variants for shapes after the first")
    ap.add_argument("--probes", default=None, help="comma list of PROBES names (default: all) on the first two shapes")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-mgpu-check", action="store_true")
    ap.add_argument("--profile", default=None, help="comma list of variants: one launch each at 16 x 32k (ncu)")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, two variants, interpret mode")
    args = ap.parse_args(argv)
    global INTERPRET, SHAPES, SUBSET, CHECK_MGPU
    if args.smoke and not on_gpu():
        INTERPRET = True
        SHAPES = [("2x256 g4 p16 t1", 2, 256, 32, 16, 1), ("1x256 g4 p64 t4", 1, 256, 32, 64, 4)]
        SUBSET = SUBSET[:2]
        args.variants = args.variants or ",".join(SUBSET)
    elif not on_gpu():
        print("decode_sweep: no GPU; nothing to do")
        return 0
    if args.profile:      # one launch of each named variant at 16 x 32k (ncu -c <count>)
        label, b, ctx, hq, page, tq = SHAPES[0]
        st, nf, nr = random_state(page, [ctx] * b)
        q = bench_queries(b, tq, hq)
        npg = st.page_table.shape[1]
        fns = [mgpu_fn(page, nf, nr) if n == "mgpu" else kernel_fn(VARIANTS[n], b, npg, page, nf, nr,
                                                                      rows=tq * hq // H)[0]
               for n in args.profile.split(",")]
        args_ = state_args(st, q)
        compiled = [f.lower(*args_).compile() for f in fns]
        for c in compiled:
            jax.block_until_ready(c(*args_))
        return 0
    CHECK_MGPU = not args.no_mgpu_check
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    logf = open(os.path.join(args.out, "decode_sweep.log"), "a")

    def log(s):
        print(s, flush=True)
        logf.write(s + "\n")
        logf.flush()
    bw, torch_v = copy_bw_tbs()
    try:
        import triton
        triton_v = triton.__version__
    except ImportError:
        triton_v = "n/a"
    info = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=jax.devices()[0].device_kind, jax=jax.__version__, triton=triton_v,
                torch=torch_v, copy_bandwidth_tbs=bw, heads=H, head_dim=D, first_n=FIRST_N, last_n=LAST_N)
    log(f"decode_sweep {info}")
    names = args.variants.split(",") if args.variants else list(VARIANTS)
    sub = names if (args.all or args.variants) else SUBSET
    if args.later:
        sub = args.later.split(",")
    if args.probes is not None:
        for k in [k for k in PROBES if k not in args.probes.split(",")]:
            del PROBES[k]
    result = dict(info, rows=[], defaults=dict(block_k=da.DEFAULT_BLOCK_K, num_warps=da.DEFAULT_NUM_WARPS))
    path = os.path.join(args.out, "decode_sweep.json")
    if not args.no_check:
        ok, res = correctness(sub, log)
        result["correctness_ok"], result["correctness"] = ok, res
        log(f"correctness: {'OK' if ok else 'FAILED'} ({time.time() - t0:.0f}s)")
    idx = [int(i) for i in args.shapes.split(",")] if args.shapes else range(len(SHAPES))
    for j, i in enumerate(idx):
        if time.time() - t0 > args.budget_s:
            log(f"-- budget {args.budget_s:.0f}s spent: skip {SHAPES[i][0]}")
            result.setdefault("skipped", []).append(SHAPES[i][0])
            continue
        log(f"-- {SHAPES[i][0]} ({time.time() - t0:.0f}s)")
        try:
            row = run_shape(SHAPES[i], names if j == 0 else sub, bw, log, with_mgpu=j == 0, with_probe=j < 2)
        except Exception as ex:
            row = dict(shape=SHAPES[i][0], error=f"{type(ex).__name__}: {ex}"[:300], variants={}, floor_ms=0)
            log(traceback.format_exc()[-1500:])
        result["rows"].append(row)
        with open(path, "w") as f:
            json.dump(result, f, indent=1, default=str)
    ok_rows = [r for r in result["rows"] if "best" in r]
    log(table(ok_rows))
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    log(f"wrote {path} ({time.time() - t0:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
