"""Decode-attention benchmark on the H200: the fused NVFP4 kernels against cuDNN / flash SDPA over bf16, grid by grid.

Every row fills a mixed NVFP4 + bf16-twin cache of one `BenchGeometry` with random bytes (`common.random_mixed_state`)
and times the kernels over it, beside the NVFP4 bytes floor (packed K + V, E4M3 scales and the retained twin rows over
the copy bandwidth measured in-run) and the bf16 floor. Every timed output must be finite and every other kernel's
within 1e-2 of the default's (correctness against a reference: `tests/test_decode_geometry.py` and the kernel tests).

Modes (each writes a JSON under ``--out``, rewritten after every row, so a time-budget cut keeps what was measured;
``--budget-s`` stops starting rows before the device's 600 s command limit):

* ``--grid`` (``decode_bench-grid.json``): the decode-speed grid `shapes.DECODE_GRID` at head_dim 128, batch x context
  x (GQA, page, Tq), default kernels only. Each row times the Triton kernel (``mixed``), the Mosaic GPU kernel
  (``mgpu``, where `mosaic_sm90.supported`) and the default one three ways: end to end per call (``dflt``), per call
  inside one jitted loop of ten calls as a model step runs it (``step``, `time_in_step`), GPU busy (``dflt GPU``);
  jax's Pallas paged attention over bf16 (Tq 1) and cuDNN / flash SDPA beside; the targets counted last.
* ``--geometry-grid`` (``decode_bench-geometry.json``): head_dim x GQA group x page x Tq at one batch x context
  (default 16 x 32k): `GEOMETRY_SUBSET`, or the product of ``--head-dims / --groups / --pages / --tqs`` when any is
  given. Each row: the entry point's default backend per call in a jitted loop of ten, that loop's GPU busy time and
  the decode kernels' share, the Triton kernel beside a Mosaic default, each ``--variants`` Triton config
  (`parse_variant`) beside a Triton default, cuDNN / flash SDPA over contiguous bf16.
* ``--merge A.json B.json ...``: join the shards (``--shard I/N``: rows ``k % N == I``) of one grid run.
* ``--smoke``: the chosen rows at batch 2 x 256 tokens, 2 KV heads, in interpret mode on the CPU (checks the script;
  times nothing real).

Shards: one process per GPU on a multi-GPU host, or consecutive device calls on one GPU::

    for i in 0 1 2 3; do CUDA_VISIBLE_DEVICES=$i python3 bench/decode_bench.py --grid --shard $i/4 \\
        --out $OUT/s$i > $OUT/s$i.txt 2>&1 & done; wait
    python3 bench/decode_bench.py --grid --merge $OUT/s*/decode_bench-grid.json --out $OUT

On a machine without a GPU (and no ``--smoke``) it prints a message and exits 0.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Optional  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jmixedkv as jm  # noqa: E402
from jmixedkv import nvfp4  # noqa: E402
from jmixedkv.compat import on_gpu  # noqa: E402
from jmixedkv.pools import kernel_arrays  # noqa: E402
from pallas_kernels.decode import TritonConfig, choose_backend, mosaic_sm90, triton  # noqa: E402
from pallas_kernels.decode.common import next_pow2, pages_per_block  # noqa: E402
from pallas_kernels.decode.config import triton_num_splits, triton_tuning  # noqa: E402
from common import (copy_bandwidth_tbs, gpu_busy_ms, gpu_kernel_profile, random_fill, random_mixed_state,  # noqa: E402
                    step_loop, time_in_step, time_jax, time_torch, torch_cuda, utc_now, versions, write_json)
from shapes import DECODE_GEOMETRY, grid_args  # noqa: E402

HEAD_DIM = DECODE_GEOMETRY["head_dim"]      # every --grid row's
#: the decode-speed targets of ``--grid``: 16 x 32k at <= 1.5x the NVFP4 bytes floor; every row with >= 512k tokens
#: (batch x context) at <= 1.8x; every row with >= 128k tokens faster than cuDNN SDPA over bf16
TARGET_16X32K, TARGET_512K, TOKENS_512K, TOKENS_128K = 1.5, 1.8, 512 * 1024, 128 * 1024
#: the target of every ``--geometry-grid`` row: within this many times its NVFP4 bytes floor
TARGET_GEOMETRY = 1.5
#: the default rows of ``--geometry-grid`` (head_dim, GQA, page, Tq): every head_dim x group at page 16 Tq 1, then
#: the page and Tq axes at head_dim 64 and 128 (GQA 4)
GEOMETRY_SUBSET = tuple([(d, g, 16, 1) for d in (64, 128, 256) for g in (1, 2, 3, 4, 7, 8)]
                        + [(d, 4, p, 1) for d in (64, 128) for p in (32, 64, 128)]
                        + [(d, 4, 16, t) for d in (64, 128) for t in (2, 4, 8)])
#: the whole geometry axes: head_dims, groups, pages, tqs (``--head-dims`` etc. take subsets of any size)
GEOMETRY_AXES = ((64, 128, 256), (1, 2, 3, 4, 7, 8), (16, 32, 64, 128), (1, 2, 4, 8))
#: ``--smoke``: every geometry asked for at this batch x context (`smoke_order`) and KV heads, one call timed
SMOKE_BATCH, SMOKE_CONTEXT, SMOKE_KV_HEADS, SMOKE_TIMING = 2, 256, 2, (("reps", 1), ("trials", 1), ("warmup", 1))


@dataclasses.dataclass(frozen=True)
class BenchGeometry:
    """The cache geometry of a benchmark row: KV heads, head_dim, GQA group (query heads per KV head), tokens per
    page, retained first_n / last_n of the mixed NVFP4 + bf16 twin, pool layers (the kernels read the last)."""
    kv_heads: int = DECODE_GEOMETRY["kv_heads"]
    head_dim: int = HEAD_DIM
    gqa: int = 4
    page: int = 16
    first_n: int = DECODE_GEOMETRY["first_n"]
    last_n: int = DECODE_GEOMETRY["last_n"]
    layers: int = 1

    @property
    def q_heads(self) -> int:
        return self.kv_heads * self.gqa

    @property
    def cache(self) -> jm.KVCacheConfig:
        return jm.KVCacheConfig("mixed_nvfp4_bf16", first_n=self.first_n, last_n=self.last_n, page_size=self.page)


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How a grid run goes: ``geometry`` (``--geometry-grid`` rows, else ``--grid``), ``kv_heads`` / ``layers`` of
    every pool, ``interpret`` (Pallas interpret mode, ``--smoke``), ``mosaic`` (time the Mosaic GPU kernel where
    supported), ``variants`` (``(name, fields)`` Triton configs, `parse_variant`), ``budget_s`` (no row starts after
    it), ``mem_gib`` (rows needing more device memory are skipped), ``shard`` (``I/N`` text, recorded), ``timing``
    (`time_jax`'s ``reps`` / ``trials`` / ``warmup``; one call each in ``--smoke``)."""
    geometry: bool = False
    kv_heads: int = DECODE_GEOMETRY["kv_heads"]
    layers: int = 1
    interpret: bool = False
    mosaic: bool = True
    variants: tuple = ()
    budget_s: float = 520.0
    mem_gib: float = 120.0
    shard: Optional[str] = None
    timing: tuple = (("reps", 10), ("trials", 15), ("warmup", 2))

    def time(self, fn, *args, in_step=False):
        """Median ms per call of ``fn(*args)``: `time_jax`, or `time_in_step` (inside one jitted loop of ten)."""
        return (time_in_step if in_step else time_jax)(fn, *args, **dict(self.timing))


# --------------------------------------------------------------------------------------------- profile, inputs
def step_profile(loop, args, calls=10):
    """GPU busy time of `step_loop` ``loop`` per call (us) and the decode kernels' share (names with ``decode`` or
    ``mosaic``), from `gpu_kernel_profile`; ``{}`` off the GPU or when the profiler fails."""
    if jax.default_backend() != "gpu":
        return {}
    try:
        prof = gpu_kernel_profile(lambda i: loop(*args), 3, tempfile.mkdtemp(prefix="trace_geometry"), top=40)
    except Exception as e:
        print(f"    profile failed ({type(e).__name__}: {str(e)[:100]})")
        return {}
    kern = sum(k["us"] for k in prof["kernels"] if re.search("decode|mosaic", k["name"], re.I))
    return dict(gpu_us=prof["busy_us_per_step"] / calls, kernel_us=kern / calls,
                launches=prof["kernel_launches_per_step"] / calls)


def row_inputs(g: BenchGeometry, b, ctx, tq, seed):
    """``(q bf16[b, tq, Hq, D], page_table i32[b, ctx/page], kv_lens i32[b], high_table i32[b, twin pages], LowPool,
    RowPool)``: a full cache of ``b`` x ``ctx`` random tokens (`random_mixed_state`; decode global scale of amax 8,
    so scores stay moderate) and random queries."""
    st = random_mixed_state(g.cache, jm.GroupSpec(g.layers, g.kv_heads, g.head_dim), b, ctx, seed=seed)
    pool = st.pools[0]
    low = dataclasses.replace(pool.low, gs=jnp.full_like(pool.low.gs, nvfp4.global_scale_from_amax(8.0)))
    q = random_fill(seed + 3, (b, tq, g.q_heads, g.head_dim), "bf16")
    return q, st.page_table, st.kv_lens, st.high_table, low, pool.high


def floors(g: BenchGeometry, b, ctx, bw):
    """``(NVFP4 floor ms, bf16 floor ms)``: packed K + V bytes, E4M3 scales and the retained twin rows (bf16) read
    once, and bf16 K + V, over ``bw`` TB/s."""
    tokens, row = b * ctx, g.kv_heads * g.head_dim * 2
    nvfp4_bytes = tokens * row * (0.5 + 1 / 16) + b * (g.first_n + g.last_n) * row * 2
    return nvfp4_bytes / bw * 1e-9, tokens * row * 2 / bw * 1e-9


def fits(g: BenchGeometry, b, ctx, budget_gib):
    """Whether a row's pools (+ the bf16 K / V of the baselines) fit in ``budget_gib``."""
    need = b * ctx * g.kv_heads * g.head_dim * 2 * (0.5625 * g.layers + 2 * max(g.layers, 2)) * 1.1
    return need / 2 ** 30 < budget_gib


# --------------------------------------------------------------------------------------------- kernels
def kernel_fn(g: BenchGeometry, opts: RunOptions, backend: str, config=None):
    """Jitted ``(q, pt, lens, ht, low, high) -> out`` over the last pool layer: ``backend`` ``"triton"`` or
    ``"mosaic"`` with ``config`` (None: the backend's defaults)."""
    layer, twin = g.layers - 1, g.cache.twin
    if backend == "mosaic":
        return jax.jit(lambda q, pt, lens, ht, low, high: mosaic_sm90.paged_decode_attention(
            q, pt, lens, layer, kernel_arrays(low), kernel_arrays(high), ht, geom=twin, config=config,
            interpret=opts.interpret)[0])
    return jax.jit(lambda q, pt, lens, ht, low, high: triton.paged_decode_attention(
        q, pt, lens, layer, kernel_arrays(low), kernel_arrays(high), None, ht, geom=twin, config=config,
        interpret=opts.interpret)[0])


_VARIANT = re.compile(r"^k(\d+)w(\d+)(?:s(\d+))?(?:x([\d.]+))?(?:c(\d+))?$")


def parse_variant(text: str) -> tuple:
    """``"k{block_k}w{num_warps}[s{num_stages}][x{split multiplier}][c{col_groups}]"`` -> ``(text, fields)``: a
    Triton config timed beside the default; the multiplier scales `triton_num_splits` of its block (default 1)."""
    m = _VARIANT.match(text.strip())
    if not m:
        raise ValueError(f"--variants: {text!r} is not k<block_k>w<warps>[s<stages>][x<split mult>][c<col groups>]")
    k, w, s, x, c = m.groups()
    fields = dict(block_k=int(k), num_warps=int(w), num_stages=int(s or 3), split_mult=float(x or 1))
    if c:
        fields["col_groups"] = int(c)
    return text.strip(), fields


def variant_config(fields: dict, g: BenchGeometry, b: int, ctx: int, tq: int) -> TritonConfig:
    """The `TritonConfig` of a variant at this row: its splits `triton_num_splits` of its block times the multiplier
    (at least 1, at most the blocks)."""
    blocks = max(1, -(-(ctx // g.page) // pages_per_block(fields["block_k"], g.page)))
    m_rows = next_pow2(max(16, tq * g.gqa))
    per_sm = triton_tuning("nvfp4", b, g.kv_heads, g.page, m_rows, tq * g.gqa, g.head_dim)[2]
    splits = max(1, min(blocks, int(triton_num_splits(b, g.kv_heads, blocks, per_sm) * fields["split_mult"])))
    return TritonConfig(num_splits=splits, **{k: v for k, v in fields.items() if k != "split_mult"})


def torch_sdpa(torch, g: BenchGeometry, b, ctx, tq):
    """cuDNN and flash SDPA over contiguous bf16 K/V ``[b, H, ctx, D]``, ``tq`` query tokens (no mask: the same bytes
    as the causal verify step), ms each (None where the backend refuses): the better of torch's ``enable_gqa`` and
    the group folded into the query rows (``q [b, H, tq * G, D]``, what a serving engine does; for Tq > 1
    ``enable_gqa`` expands K / V to every query head and reads G x the bytes)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    h, d = g.kv_heads, g.head_dim
    q = torch.randn(b, g.q_heads, tq, d, dtype=torch.bfloat16, device="cuda")
    qf = torch.randn(b, h, tq * g.gqa, d, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(b, h, ctx, d, dtype=torch.bfloat16, device="cuda")
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


def jax_paged_ms(g: BenchGeometry, b, ctx, q, pt, lens, seed, opts: RunOptions):
    """jax's Pallas paged attention over bf16 pages ``[H, pages, page, D]`` (Tq 1), ms: 128-token compute blocks
    (8 pages of 16, 2 of 64; 8 x 64 needs 276 KB of shared memory), k_splits 16 / 4 / 1 at batch 1 / 16 / else
    (the best of earlier sweeps) halved until they divide the pages."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
    shape = (g.kv_heads, b * ctx // g.page, g.page, g.head_dim)
    kp, vp = random_fill(seed, shape, "bf16"), random_fill(seed + 1, shape, "bf16")
    npg, ppcb, ks = ctx // g.page, max(1, 128 // g.page), {1: 16, 16: 4}.get(b, 1)
    while ks > 1 and npg % (ks * ppcb):
        ks //= 2
    fn = jax.jit(lambda q, k, v, bt, lens: paged_attention(q, k, v, bt, lens, pages_per_compute_block=min(ppcb, npg),
                                                           k_splits=ks, interpret=opts.interpret))
    return opts.time(fn, q[:, 0], kp, vp, pt, lens)


# --------------------------------------------------------------------------------------------- rows
def _method(row, name, thunk):
    """``row[name + "_ms"] = thunk()``; a method that fails on this shape is recorded, not fatal for the row."""
    try:
        row[f"{name}_ms"] = thunk()
    except Exception as e:
        row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:160]}"
        print(f"    {name}: {row[f'{name}_error']}")


def _close(got, want, what):
    """``got`` as float32 NumPy; refuses a non-finite one or one off ``want`` (when given) by 1e-2 relative L2."""
    got = np.asarray(got, np.float32)
    if not np.isfinite(got).all():
        raise FloatingPointError(f"{what}: non-finite output")
    if want is not None:
        rel = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
        if not rel < 1e-2:
            raise ValueError(f"{what}: output differs from the default's by {rel:.2e}")
    return got


def _row_start(torch, bw, g: BenchGeometry, b, ctx, tq):
    """A row's keys, both floors and (with torch) cuDNN / flash SDPA over bf16."""
    row = dict(batch=b, context=ctx, head_dim=g.head_dim, gqa=g.gqa, page=g.page, tq=tq, kv_heads=g.kv_heads,
               copy_bandwidth_tbs=bw)
    row["floor_nvfp4_ms"], row["floor_bf16_ms"] = floors(g, b, ctx, bw)
    if torch is not None:
        s = torch_sdpa(torch, g, b, ctx, tq)
        row["cudnn_ms"], row["flash_ms"] = s.get("cudnn"), s.get("flash")
    return row


def _seed(g: BenchGeometry, b, ctx, tq):
    """A row's random seed, distinct per shape."""
    return b * 1000 + ctx // 1024 + 7 * g.gqa + g.page + tq + g.head_dim


def grid_row(torch, bw, g: BenchGeometry, b, ctx, tq, opts: RunOptions):
    """One ``--grid`` row: the Triton kernel, the Mosaic GPU kernel (where `supported`), the default one end to end,
    in a step and GPU busy, cuDNN / flash SDPA over contiguous bf16, jax's Pallas paged attention over bf16 (Tq 1
    only: it has no multi-token query), and both bytes floors."""
    row = _row_start(torch, bw, g, b, ctx, tq)
    args = row_inputs(g, b, ctx, tq, _seed(g, b, ctx, tq))
    fns = dict(mixed=kernel_fn(g, opts, "triton"))
    out = _close(fns["mixed"](*args), None, "mixed")
    row["mixed_ms"] = opts.time(fns["mixed"], *args)
    row["mixed_gpu_ms"] = gpu_busy_ms(fns["mixed"], *args)

    def mgpu():
        fns["mgpu"] = kernel_fn(g, opts, "mosaic")
        _close(fns["mgpu"](*args), out, "mgpu")
        row["mgpu_gpu_ms"] = gpu_busy_ms(fns["mgpu"], *args)
        return opts.time(fns["mgpu"], *args)
    if opts.mosaic and mosaic_sm90.supported(head_dim=g.head_dim, page=g.page, tq=tq, group=g.gqa,
                                             high_dtype=jnp.bfloat16):
        _method(row, "mgpu", mgpu)
    # what `jm.decode_attention` runs here: the Mosaic GPU kernel where `choose_backend` picks it
    use_mgpu = row.get("mgpu_ms") is not None and choose_backend(
        head_dim=g.head_dim, page=g.page, tq=tq, group=g.gqa, high_dtype=jnp.bfloat16,
        interpret=opts.interpret) == "mosaic"
    row["default"] = "mgpu" if use_mgpu else "mixed"
    try:        # a failure here (e.g. memory for the loop) must not lose the row's other timings
        row["default_step_ms"] = opts.time(fns[row["default"]], *args, in_step=True)
    except Exception as e:
        row["default_step_ms"], row["step_error"] = None, f"{type(e).__name__}: {str(e)[:160]}"
        print(f"    step: {row['step_error']}")
    q, pt, lens = args[:3]
    del args, fns
    if tq == 1:
        _method(row, "jax_pa", lambda: jax_paged_ms(g, b, ctx, q, pt, lens, _seed(g, b, ctx, tq) + 4, opts))
    row["default_ms"], row["default_gpu_ms"] = row[f"{row['default']}_ms"], row.get(f"{row['default']}_gpu_ms")
    for other in ("cudnn", "flash", "jax_pa", "mgpu"):
        if row.get(f"{other}_ms"):
            row[f"{other}_over_mixed"] = row[f"{other}_ms"] / row["mixed_ms"]
    for t in ("mixed", "default", "default_step"):
        if row.get(f"{t}_ms"):
            row[f"{t}_vs_nvfp4_floor"] = row[f"{t}_ms"] / row["floor_nvfp4_ms"]
            if t != "mixed" and row.get("cudnn_ms"):
                row[f"cudnn_over_{t}"] = row["cudnn_ms"] / row[f"{t}_ms"]
    # end to end well above the GPU's busy time: the host's dispatch, not the kernels, sets the call's time
    row["host_bound"] = bool(row["default_gpu_ms"] and row["default_ms"] > 1.25 * row["default_gpu_ms"])
    return row


def geometry_row(torch, bw, g: BenchGeometry, b, ctx, tq, opts: RunOptions):
    """One ``--geometry-grid`` row: the default backend, the Triton kernel beside a Mosaic default, the ``variants``
    beside a Triton default, each per call in a jitted loop of ten (`step_loop`); the default's GPU busy time in
    that loop and its decode kernels' share (`step_profile`); cuDNN / flash SDPA over bf16; both floors."""
    row = _row_start(torch, bw, g, b, ctx, tq)
    args = row_inputs(g, b, ctx, tq, _seed(g, b, ctx, tq))
    row["backend"] = choose_backend(head_dim=g.head_dim, page=g.page, tq=tq, group=g.gqa,
                                    high_dtype=jnp.bfloat16, interpret=opts.interpret)
    if row["backend"] == "mosaic" and not opts.mosaic:
        row["backend"] = "triton"
    loop = step_loop(kernel_fn(g, opts, row["backend"]))
    want = _close(loop(*args)[1], None, "default")
    row["step_ms"] = opts.time(loop, *args) / 10
    row.update(step_profile(loop, args))
    row["variants"] = {}
    others = [("triton", None)] if row["backend"] == "mosaic" else [
        (name, variant_config(f, g, b, ctx, tq)) for name, f in opts.variants]
    for name, config in others:
        try:
            lp = step_loop(kernel_fn(g, opts, "triton", config))
            _close(lp(*args)[1], want, name)
            row["variants"][name] = opts.time(lp, *args) / 10
        except Exception as e:   # a config that does not compile is recorded, not fatal
            row["variants"][name] = None
            print(f"    {name}: {type(e).__name__}: {str(e).splitlines()[0][:140]}")
    ok = {k: v for k, v in row["variants"].items() if v}
    if ok:
        row["best_variant"] = min(ok, key=ok.get)
        row["best_variant_ms"] = ok[row["best_variant"]]
    row["step_vs_nvfp4_floor"] = row["step_ms"] / row["floor_nvfp4_ms"]
    if row.get("cudnn_ms"):
        row["cudnn_over_step"] = row["cudnn_ms"] / row["step_ms"]
    return row


# --------------------------------------------------------------------------------------------- tables, targets
def fmt(x, w=8):
    return f"{x:{w}.3f}" if isinstance(x, (int, float)) else f"{'-':>{w}}"


def grid_table(rows):
    """``mixed``: the Triton kernel; ``mgpu``: the Mosaic GPU kernel; ``dflt``: the one `jm.decode_attention` runs
    (``*`` marks the Mosaic GPU kernel; ``h`` a host-bound call: end to end > 1.25x its GPU time); ``dflt GPU``:
    its GPU busy time (`gpu_busy_ms`); ``step``: its time per call inside one jitted loop of 10 (`time_in_step`);
    ``dflt/fl4`` and ``cuDNN/dflt`` are of the default's end-to-end time, ``step/fl4`` and ``cuDNN/step`` of its
    in-step time."""
    lines = [f"{'pg':>3} {'gqa':>3} {'tq':>2} {'B x ctx':>11} {'mixed':>7} {'mgpu':>7} {'dflt':>9} {'dflt GPU':>8} "
             f"{'step':>7} {'cuDNN':>7} {'flash':>7} {'jaxPA':>7} {'fl.fp4':>7} {'fl.bf16':>7} {'dflt/fl4':>8} "
             f"{'step/fl4':>8} {'cuDNN/dflt':>10} {'cuDNN/step':>10}"]
    for r in rows:
        f = lambda k, w=7: fmt(r.get(k), w)  # noqa: E731
        mark = ("*" if r.get("default") == "mgpu" else " ") + ("h" if r.get("host_bound") else " ")
        lines.append(f"{r['page']:>3} {r['gqa']:>3} {r['tq']:>2} {r['batch']:>4} x {r['context'] // 1024:>4}k "
                     f"{f('mixed_ms')} {f('mgpu_ms')} {f('default_ms')}{mark} {f('default_gpu_ms', 8)} "
                     f"{f('default_step_ms')} {f('cudnn_ms')} {f('flash_ms')} {f('jax_pa_ms')} "
                     f"{f('floor_nvfp4_ms')} {f('floor_bf16_ms')} {f('default_vs_nvfp4_floor', 8)} "
                     f"{f('default_step_vs_nvfp4_floor', 8)} {f('cudnn_over_default', 10)} "
                     f"{f('cudnn_over_default_step', 10)}" + (f"  {r['error']}" if r.get("error") else ""))
    return "\n".join(lines)


def grid_targets(rows, key="default_ms"):
    """The three decode-speed targets counted over grid ``rows`` by the default kernel's ``key`` time (``default_ms``
    end to end, ``default_step_ms`` in one executable, ``default_gpu_ms`` GPU busy): ``{"16x32k": (met, of),
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
        counted = [(r, value(r)) for r in rows if r.get(key) and applies(r)]
        out["misses"][name] = [(r["batch"], r["context"], r["gqa"], r["page"], r["tq"], round(v, 3))
                               for r, v in counted if not ok(v)]
        out[name] = (len(counted) - len(out["misses"][name]), len(counted))
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


def geometry_table(rows):
    """``dflt``: what the entry point runs (``M`` Mosaic GPU, ``T`` Triton), ms per call in a jitted loop of ten;
    ``GPU``: GPU busy per call in that loop, ``kern``: its decode kernels' share; ``best other``: the fastest of the
    Triton kernel (beside a Mosaic default) or the ``--variants`` (beside a Triton default)."""
    lines = [f"{'hd':>3} {'gqa':>3} {'pg':>3} {'tq':>2} {'B x ctx':>11} {'dflt':>8} {'GPU':>7} {'kern':>7} "
             f"{'best other':>22} {'cuDNN':>7} {'flash':>7} {'fl.fp4':>7} {'fl.bf16':>7} {'dflt/fl4':>8} "
             f"{'cuDNN/dflt':>10}"]
    for r in rows:
        head = (f"{r['head_dim']:>3} {r['gqa']:>3} {r['page']:>3} {r['tq']:>2} {r['batch']:>4} x "
                f"{r['context'] // 1024:>4}k")
        if r.get("error"):
            lines.append(f"{head}  {r['error']}")
            continue
        f = lambda k, w=7: fmt(r.get(k), w)  # noqa: E731
        us = lambda k: fmt(r[k] / 1e3 if r.get(k) else None, 7)  # noqa: E731
        best = f"{r['best_variant']} {r['best_variant_ms']:.3f}" if r.get("best_variant") else "-"
        lines.append(f"{head} {r['step_ms']:7.3f}{'M' if r['backend'] == 'mosaic' else 'T'} {us('gpu_us')} "
                     f"{us('kernel_us')} {best:>22} {f('cudnn_ms')} {f('flash_ms')} {f('floor_nvfp4_ms')} "
                     f"{f('floor_bf16_ms')} {f('step_vs_nvfp4_floor', 8)} {f('cudnn_over_step', 10)}")
    return "\n".join(lines)


def geometry_text(rows):
    """The geometry targets counted over geometry rows (within `TARGET_GEOMETRY` x the floor; Tq 1 faster than
    cuDNN), with the misses."""
    done = [r for r in rows if r.get("step_ms")]
    far = [r for r in done if r["step_vs_nvfp4_floor"] > TARGET_GEOMETRY]
    tq1 = [r for r in done if r["tq"] == 1 and r.get("cudnn_ms")]
    slow = [r for r in tq1 if r["cudnn_ms"] <= r["step_ms"]]
    key = lambda r: f"hd{r['head_dim']}/G{r['gqa']}/p{r['page']}/t{r['tq']}"  # noqa: E731
    misses = ", ".join(f"{key(r)} {r['step_vs_nvfp4_floor']:.2f}x" for r in far) or "none"
    behind = ", ".join(f"{key(r)} {r['cudnn_ms'] / r['step_ms']:.2f}x" for r in slow) or "none"
    return (f"within {TARGET_GEOMETRY}x the NVFP4 floor: {len(done) - len(far)}/{len(done)} (misses: {misses})\n"
            f"Tq 1 faster than cuDNN bf16: {len(tq1) - len(slow)}/{len(tq1)} (misses, cuDNN / dflt: {behind})")


def _texts(geometry: bool, rows):
    return (geometry_table(rows), geometry_text(rows)) if geometry else (grid_table(rows), targets_text(rows))


# --------------------------------------------------------------------------------------------- row order, shards
def grid_order(batches: str, contexts: str, geos: str):
    """The ``--grid`` rows ``(batch, context, gqa, page, tq)`` in run order: geometry by geometry (``geos`` =
    ``"GQA/page/Tq,..."``), each over batch x context, so a time-budget cut loses the later geometries."""
    shapes = [(b, c) for b in map(int, batches.split(",")) for c in map(int, contexts.split(","))]
    geo = [tuple(map(int, g.split("/"))) for g in geos.split(",")]
    if any(len(g) != 3 for g in geo):
        raise ValueError(f"--geos: expected GQA/page/Tq triples, got {geos!r}")
    return [(b, c, *g) for g in geo for b, c in shapes]


def geometry_order(head_dims=None, groups=None, pages=None, tqs=None, batch=16, context=32768):
    """The ``--geometry-grid`` rows ``(batch, context, head_dim, gqa, page, tq)`` in run order: `GEOMETRY_SUBSET`
    when every axis is None, else the product of the given axes (None = the whole axis, `GEOMETRY_AXES`)."""
    given = (head_dims, groups, pages, tqs)
    if all(a is None for a in given):
        geo = GEOMETRY_SUBSET
    else:
        ax = [tuple(v) if v is not None else whole for v, whole in zip(given, GEOMETRY_AXES)]
        geo = [(d, g, p, t) for d in ax[0] for g in ax[1] for p in ax[2] for t in ax[3]]
    return [(batch, context, *x) for x in geo]


def order_key(o):
    """A row order entry -> ``(batch, context, head_dim, gqa, page, tq)`` (``--grid`` entries are at head_dim 128)."""
    return tuple(o) if len(o) == 6 else (o[0], o[1], HEAD_DIM, *o[2:])


def smoke_order(order):
    """``--smoke``: the geometries of ``order`` (first occurrence, in order) at `SMOKE_BATCH` x `SMOKE_CONTEXT`."""
    return list(dict.fromkeys((SMOKE_BATCH, SMOKE_CONTEXT, *order_key(o)[2:]) for o in order))


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


def _row_key(row):
    return (row["batch"], row["context"], row.get("head_dim", HEAD_DIM), row["gqa"], row["page"], row["tq"])


def merge_grids(results, order=None):
    """Join grid results (the JSON dicts of shards of one grid) into one, rows in ``order`` (the grid's run order,
    `grid_order` / `geometry_order`; default: the shards' rows as listed). Refuses shards measured on different
    devices or versions (the rows would not be side by side) and a row measured twice. Each row keeps the copy
    bandwidth its shard measured; the merged header gives their range. A row one shard skipped (time budget) and
    another measured (a re-run of the skipped rows) is not listed as skipped."""
    if not results:
        raise ValueError("merge: no grid results given")
    keys = ("grid", "device", "jax", "triton", "torch", "heads", "head_dim", "first_n", "last_n", "layers")
    first = results[0]
    for r in results[1:]:
        diff = {k: (first.get(k), r.get(k)) for k in keys if first.get(k) != r.get(k)}
        if diff:
            raise ValueError(f"merge: shards differ in {diff}; their rows are not side by side")
    rows, seen = [], set()
    for row in (row for r in results for row in r["rows"]):
        k = _row_key(row)
        if k in seen:
            raise ValueError(f"merge: row {k} appears in more than one shard")
        seen.add(k)
        rows.append(row)
    if order is not None:
        rank = {order_key(o): i for i, o in enumerate(order)}
        rows.sort(key=lambda row: rank.get(_row_key(row), len(rank)))
    bws = [x["copy_bandwidth_tbs"] for x in results]
    out = {k: first.get(k) for k in keys}
    out.update(date=min(x["date"] for x in results), shards=len(results), copy_bandwidth_tbs=min(bws),
               copy_bandwidth_range_tbs=[min(bws), max(bws)],
               copy_bandwidth_how="; ".join(sorted({x.get("copy_bandwidth_how", "") for x in results})),
               rows=rows, skipped=[s for x in results for s in x.get("skipped", []) if order_key(s) not in seen])
    return out


# --------------------------------------------------------------------------------------------- runs
def _json_name(geometry: bool) -> str:
    return "decode_bench-geometry.json" if geometry else "decode_bench-grid.json"


def merge_main(paths, out_dir, geometry: bool, order):
    """``--merge A.json B.json ...``: one grid JSON and table from the shards of one grid run."""
    results = []
    for path in paths:
        with open(path) as f:
            results.append(json.load(f))
    merged = merge_grids(results, order)
    path = write_json(out_dir, _json_name(geometry), merged)
    lo, hi = merged["copy_bandwidth_range_tbs"]
    print(f"device {merged['device']}  jax {merged['jax']}  triton {merged['triton']}  torch {merged['torch']}  "
          f"copy bandwidth {lo:.2f}-{hi:.2f} TB/s ({merged['shards']} shards)")
    print("\n".join(_texts(geometry, merged["rows"])))
    if merged["skipped"]:
        print(f"not run (time budget): {merged['skipped']}")
    print(f"wrote {path}")
    return 0


def run_grid(order, out_dir, opts: RunOptions):
    """``--grid`` / ``--geometry-grid``: the rows of ``order`` in turn, one JSON under ``out_dir`` rewritten after
    every row; a row that fails (memory, a compile error) is recorded with its error, not fatal."""
    torch = None if opts.interpret else torch_cuda()
    bw, bw_how = (4.3, "nominal (smoke)") if opts.interpret else copy_bandwidth_tbs(torch)
    info = versions(torch)
    print(f"device {info['device']}  jax {info['jax']}  triton {info['triton']}  torch {info['torch']}  "
          f"copy bandwidth {bw:.2f} TB/s ({bw_how})")
    result = dict(grid="geometry" if opts.geometry else "speed", date=utc_now(), **info, copy_bandwidth_tbs=bw,
                  copy_bandwidth_how=bw_how, heads=opts.kv_heads, head_dim=None if opts.geometry else HEAD_DIM,
                  first_n=DECODE_GEOMETRY["first_n"], last_n=DECODE_GEOMETRY["last_n"], layers=opts.layers,
                  shard=opts.shard, variants=[n for n, _ in opts.variants], rows=[], skipped=[])
    measure = geometry_row if opts.geometry else grid_row
    t0 = time.time()
    for o in order:
        b, c, d, gqa, page, tq = order_key(o)
        if time.time() - t0 > opts.budget_s:
            result["skipped"].append(list(o))
            continue
        g = BenchGeometry(kv_heads=opts.kv_heads, head_dim=d, gqa=gqa, page=page, layers=opts.layers)
        try:
            if not fits(g, b, c, opts.mem_gib):
                raise MemoryError(f"needs more than --mem-gib {opts.mem_gib}")
            row = measure(torch, bw, g, b, c, tq, opts)
        except Exception as e:  # OOM or a failure on one shape must not lose the rest
            row = dict(batch=b, context=c, head_dim=d, gqa=gqa, page=page, tq=tq,
                       error=f"{type(e).__name__}: {str(e)[:160]}")
        result["rows"].append(row)
        print(_texts(opts.geometry, [row])[0].splitlines()[-1], f"({time.time() - t0:.0f}s)", flush=True)
        write_json(out_dir, _json_name(opts.geometry), result)
    print("\n".join(_texts(opts.geometry, result["rows"])))
    if result["skipped"]:
        print(f"not run (time budget {opts.budget_s:.0f}s): {result['skipped']}")
    return 0


def _ints(text):
    return None if text is None else tuple(int(x) for x in text.split(","))


def parser():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--grid", action="store_true",
                      help="the decode-speed grid: batch x context x GQA/page/Tq (--geos), head_dim 128")
    mode.add_argument("--geometry-grid", action="store_true",
                      help="head_dim x GQA x page x Tq at one batch x context (GEOMETRY_SUBSET unless an axis "
                           "is given)")
    batches, contexts, geos = grid_args()
    ap.add_argument("--batches", default=batches, help="--grid batches")
    ap.add_argument("--contexts", default=contexts, help="--grid contexts")
    ap.add_argument("--geos", default=geos, help="--grid geometries GQA/page/Tq, in the order they run")
    ap.add_argument("--head-dims", default=None, help="--geometry-grid head_dims, e.g. 64,256")
    ap.add_argument("--groups", default=None, help="--geometry-grid GQA groups, e.g. 1,3,7")
    ap.add_argument("--pages", default=None, help="--geometry-grid pages, e.g. 16,64")
    ap.add_argument("--tqs", default=None, help="--geometry-grid query tokens, e.g. 1,4")
    ap.add_argument("--geometry-batch", type=int, default=16)
    ap.add_argument("--geometry-context", type=int, default=32768)
    ap.add_argument("--kv-heads", type=int, default=DECODE_GEOMETRY["kv_heads"])
    ap.add_argument("--variants", default="",
                    help="--geometry-grid: Triton configs timed beside a Triton default, k<block_k>w<warps>"
                         "[s<stages>][x<split mult>][c<col groups>], comma-separated")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny shapes in interpret mode (script check)")
    ap.add_argument("--no-mgpu", action="store_true", help="never time the Mosaic GPU kernel")
    ap.add_argument("--layers", type=int, default=1,
                    help="layers in every pool (32 = a model-shaped cache, e.g. Llama-3-8B); the last is read")
    ap.add_argument("--budget-s", type=float, default=520.0,
                    help="stop starting new rows after this many seconds (the device runs commands for <= 600 s)")
    ap.add_argument("--mem-gib", type=float, default=120.0, help="skip rows needing more device memory")
    ap.add_argument("--shard", default=None,
                    help="run rows k with k %% N == I (I/N), e.g. one process per GPU: "
                         "CUDA_VISIBLE_DEVICES=i ... --shard i/4; --merge joins the shards' JSONs")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="join the JSON files of --shard runs into one JSON + table under --out (no GPU needed)")
    return ap


def main(argv=None):
    ap = parser()
    args = ap.parse_args(argv)
    try:
        shard = parse_shard(args.shard)
        order = (geometry_order(_ints(args.head_dims), _ints(args.groups), _ints(args.pages), _ints(args.tqs),
                                args.geometry_batch, args.geometry_context) if args.geometry_grid
                 else grid_order(args.batches, args.contexts, args.geos))
        variants = tuple(parse_variant(v) for v in args.variants.split(",") if v.strip())
    except ValueError as e:
        ap.error(str(e))
    if args.merge:
        return merge_main(args.merge, args.out, args.geometry_grid, order)
    if not (args.grid or args.geometry_grid):
        ap.error("choose --grid, --geometry-grid or --merge")
    interpret = args.smoke and not on_gpu()
    if not interpret and not on_gpu():
        print(f"decode_bench: no GPU found (jax backend is {jax.default_backend()!r}); this benchmark runs on the "
              "H200 only. Nothing to do.")
        return 0
    opts = RunOptions(geometry=args.geometry_grid, kv_heads=args.kv_heads, layers=args.layers,
                      mosaic=not args.no_mgpu, variants=variants, budget_s=args.budget_s, mem_gib=args.mem_gib,
                      shard=args.shard)
    if interpret:
        opts = dataclasses.replace(opts, interpret=True, mosaic=False, kv_heads=SMOKE_KV_HEADS, timing=SMOKE_TIMING)
        order = smoke_order(order)
    return run_grid(shard_rows(order, shard), args.out, opts)


if __name__ == "__main__":
    sys.exit(main())
