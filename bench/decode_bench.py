"""Decode attention on the GPU: the fused NVFP4 kernels over a mixed cache of random bytes beside cuDNN / flash
SDPA over bf16 and the NVFP4 / bf16 bytes floors (copy bandwidth measured in-run); timed outputs must be finite and
within 1e-2 of the default's. A JSON under ``--out`` is rewritten after every row; no row starts after `BUDGET_S`.

* ``--grid``: batch x context x ``--geos`` GQA/page/Tq at head_dim 128 (`shapes.DECODE_GRID`): the Triton and Mosaic
  GPU kernels, the default end to end, in a jitted loop of ten and GPU busy; the speed targets counted last.
* ``--geometry-grid``: head_dim x GQA x page x Tq at 16 x 32k (`GEOMETRY_SUBSET`, or the product of ``--head-dims
  / --groups / --pages / --tqs``): the default in a loop of ten, its GPU busy time, each ``--variants`` config.
* ``--kernel-alone HD/GQA/PAGE/TQ``: the Mosaic GPU kernel alone (`mosaic_sm90.kernel_partials`: no edge blocks, no
  merge) ``--calls`` times on a 16 x 32k row's inputs (``--variants``: one Mosaic config), for a profiler.
* ``--launches HD/GQA/PAGE/TQ``: what one default call launches on the GPU, in a jitted loop of ten on a 16 x 32k
  row's inputs: each kernel's name, time and count per call from a profiler trace (the decode kernel, the edge
  kernel, XLA's fusions), and the loop's optimized HLO (what each fusion computes).
* ``--shard I/N`` runs rows ``k % N == I``; ``--merge A.json B.json ...`` joins the shards. ``--smoke``: CPU.

    python3 bench/decode_bench.py --grid --shard 0/3 --out $OUT      # then --grid --merge $OUT/*/decode_bench-grid.json
    python3 bench/decode_bench.py --geometry-grid --head-dims 64 --variants k64w2,k32w4 --out $OUT
    ncu -k regex:mosaic --launch-skip 2 --launch-count 1 --set full \
        python3 bench/decode_bench.py --kernel-alone 64/4/16/1
    python3 bench/decode_bench.py --launches 64/4/16/1 --out $OUT
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import dataclasses  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Optional  # noqa: E402

from common import (bench_parser, copy_bandwidth, error_text, gpu_busy, gpu_kernel_profile, kv_bytes,  # noqa: E402
                    md_table, no_gpu, parse_ints, random_fill, random_mixed_state, step_loop, time_in_step, time_jax,
                    time_torch, torch_cuda, versions, write_json)
from shapes import DECODE_GEOMETRY, grid_args  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jmixedkv as jm  # noqa: E402
from jmixedkv import nvfp4  # noqa: E402
from jmixedkv.compat import on_gpu  # noqa: E402
from jmixedkv.numerics import next_pow2  # noqa: E402
from jmixedkv.pools import kernel_arrays  # noqa: E402
from pallas_kernels.decode import MosaicConfig, TritonConfig, choose_backend, mosaic_sm90, triton  # noqa: E402
from pallas_kernels.decode.common import pages_per_block  # noqa: E402
from pallas_kernels.decode.config import mosaic_num_splits, triton_num_splits, triton_tuning  # noqa: E402
from pallas_kernels.decode.mosaic_sm90 import BLOCK_K  # noqa: E402

HEAD_DIM = DECODE_GEOMETRY["head_dim"]      # every --grid row's
#: ``--grid`` targets: (name, rows it applies to, the default's time over the NVFP4 floor at most / cuDNN's over
#: the default's above); ``--geometry-grid``: every row within `TARGET_GEOMETRY` x the floor
TARGETS = (("16 x 32k <= 1.5x floor", lambda r: r["batch"] == 16 and r["context"] == 32768, 1.5, None),
           (">= 512k tokens <= 1.8x floor", lambda r: r["batch"] * r["context"] >= 512 * 1024, 1.8, None),
           ("faster than cuDNN at >= 128k tokens", lambda r: r["batch"] * r["context"] >= 128 * 1024, None, 1.0))
TARGET_GEOMETRY = 1.5
#: the default ``--geometry-grid`` rows (head_dim, GQA, page, Tq) and the whole axes (what an axis flag selects from)
GEOMETRY_SUBSET = tuple([(d, g, 16, 1) for d in (64, 128, 256) for g in (1, 2, 3, 4, 7, 8)]
                        + [(d, 4, p, 1) for d in (64, 128) for p in (32, 64, 128)]
                        + [(d, 4, 16, t) for d in (64, 128) for t in (2, 4, 8)])
GEOMETRY_AXES = ((64, 128, 256), (1, 2, 3, 4, 7, 8), (16, 32, 64, 128), (1, 2, 4, 8))
GEOMETRY_BATCH, GEOMETRY_CONTEXT = 16, 32768
#: no row starts after this many seconds (the device runs a command for at most 600 s); rows needing more device
#: memory than `MEM_GIB` are recorded as skipped
BUDGET_S, MEM_GIB = 520.0, 120.0
#: ``--smoke``: every geometry asked for at this batch x context and KV heads, one call timed
SMOKE_BATCH, SMOKE_CONTEXT, SMOKE_KV_HEADS, SMOKE_TIMING = 2, 256, 2, (("reps", 1), ("trials", 1), ("warmup", 1))


@dataclasses.dataclass(frozen=True)
class BenchGeometry:
    """A row's cache: KV heads, head_dim, GQA group (query heads per KV head), tokens per page, retained first_n /
    last_n of the mixed NVFP4 + bf16 twin (one pool layer)."""
    kv_heads: int = DECODE_GEOMETRY["kv_heads"]
    head_dim: int = HEAD_DIM
    gqa: int = 4
    page: int = 16
    first_n: int = DECODE_GEOMETRY["first_n"]
    last_n: int = DECODE_GEOMETRY["last_n"]

    @property
    def q_heads(self) -> int:
        return self.kv_heads * self.gqa

    @property
    def cache(self) -> jm.KVCacheConfig:
        return jm.KVCacheConfig("mixed_nvfp4_bf16", first_n=self.first_n, last_n=self.last_n, page_size=self.page)


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """A grid run: ``geometry`` (``--geometry-grid``), ``interpret`` (``--smoke``: no Mosaic GPU kernel),
    ``variants`` (`parse_variant`), ``shard`` (recorded), ``timing`` (`time_jax`'s keywords)."""
    geometry: bool = False
    kv_heads: int = DECODE_GEOMETRY["kv_heads"]
    interpret: bool = False
    variants: tuple = ()
    shard: Optional[str] = None
    timing: tuple = (("reps", 10), ("trials", 15), ("warmup", 2))

    def time(self, fn, *args, in_step=False):
        """Median ms per call of ``fn(*args)``: `time_jax`, or `time_in_step` (inside one jitted loop of ten)."""
        return (time_in_step if in_step else time_jax)(fn, *args, **dict(self.timing))


# --------------------------------------------------------------------------------------------- inputs, kernels
def row_inputs(g: BenchGeometry, b, ctx, tq):
    """``(q bf16[b, tq, Hq, D], page_table, kv_lens, high_table, LowPool, RowPool)``: a full cache of ``b`` x ``ctx``
    random tokens (global scale of amax 8: moderate scores) and random queries."""
    seed = b * 1000 + ctx // 1024 + 7 * g.gqa + g.page + tq + g.head_dim
    st = random_mixed_state(g.cache, jm.GroupSpec(1, g.kv_heads, g.head_dim), b, ctx, seed=seed)
    pool = st.pools[0]
    low = dataclasses.replace(pool.low, gs=jnp.full_like(pool.low.gs, nvfp4.global_scale_from_amax(8.0)))
    q = random_fill(seed + 3, (b, tq, g.q_heads, g.head_dim), "bf16")
    return q, st.page_table, st.kv_lens, st.high_table, low, pool.high


def kernel_fn(g: BenchGeometry, opts: RunOptions, backend: str, config=None):
    """Jitted ``(q, pt, lens, ht, low, high) -> out``: ``backend`` ``"triton"`` or ``"mosaic"`` with ``config``
    (None: the backend's defaults)."""
    kernel = mosaic_sm90 if backend == "mosaic" else triton
    return jax.jit(lambda q, pt, lens, ht, low, high: kernel.paged_decode_attention(
        q, pt, lens, 0, kernel_arrays(low), kernel_arrays(high), high_table=ht, geom=g.cache.twin, config=config,
        interpret=opts.interpret)[0])


_VARIANT = re.compile(r"^k(\d+)w(\d+)(?:s(\d+))?(?:x([\d.]+))?(?:c(\d+))?$")
_MOSAIC_VARIANT = re.compile(r"^m(?:s(\d+))?(?:t([01]))?(?:v([01]))?(?:x([\d.]+))?$")
_VARIANT_FORMS = ("k<block_k>w<warps>[s<stages>][x<split mult>][c<col groups>] or "
                  "m[s<stages>][t<0|1>][v<0|1>][x<split mult>]")


def parse_variant(text: str) -> tuple:
    """A config timed beside the default -> ``(text, fields)``: ``"k{block_k}w{num_warps}[s{num_stages}][x{split
    multiplier}][c{col_groups}]"`` a Triton config (the multiplier scales `triton_num_splits` of its block, default
    1); ``"m[s{stages}][t{qk_in_turn 0 / 1}][v{v_in_turn 0 / 1}][x{split multiplier}]"`` a Mosaic GPU one (timed
    where the default is the Mosaic GPU kernel; the multiplier scales `mosaic_num_splits`; a field left out keeps
    `MosaicConfig`'s default)."""
    m = _VARIANT.match(text.strip())
    mm = _MOSAIC_VARIANT.match(text.strip())
    if mm:
        s, t, v, x = mm.groups()
        fields = dict(backend="mosaic", stages=int(s or 2), split_mult=float(x or 1))
        if v:
            fields["v_in_turn"] = v == "1"
        return text.strip(), dict(fields, qk_in_turn=t == "1") if t else fields
    if not m:
        raise ValueError(f"--variants: {text!r} is not {_VARIANT_FORMS}")
    k, w, s, x, c = m.groups()
    fields = dict(block_k=int(k), num_warps=int(w), num_stages=int(s or 3), split_mult=float(x or 1))
    return text.strip(), dict(fields, col_groups=int(c)) if c else fields


def variant_config(fields: dict, g: BenchGeometry, b: int, ctx: int, tq: int):
    """A variant's `TritonConfig` (or `MosaicConfig`, `parse_variant`) at this row: the default split count of its
    block times its multiplier (>= 1)."""
    if fields.get("backend") == "mosaic":
        blocks = max(1, -(-ctx // BLOCK_K))
        splits = max(1, min(blocks, int(mosaic_num_splits(b, g.kv_heads, blocks) * fields["split_mult"])))
        return MosaicConfig(num_splits=splits, **{k: v for k, v in fields.items()
                                                  if k not in ("backend", "split_mult")})
    blocks = max(1, -(-(ctx // g.page) // pages_per_block(fields["block_k"], g.page)))
    per_sm = triton_tuning("nvfp4", b, g.kv_heads, g.page, next_pow2(max(16, tq * g.gqa)), tq * g.gqa,
                           g.head_dim)[2]
    splits = max(1, min(blocks, int(triton_num_splits(b, g.kv_heads, blocks, per_sm) * fields["split_mult"])))
    return TritonConfig(num_splits=splits, **{k: v for k, v in fields.items() if k != "split_mult"})


def torch_sdpa(torch, g: BenchGeometry, b, ctx, tq):
    """``{"cudnn", "flash": ms or None}``: torch SDPA over contiguous bf16 K/V ``[b, H, ctx, D]`` (no mask: the bytes
    of a causal verify step), the better of ``enable_gqa`` and the group folded into the query rows (what a serving
    engine does; ``enable_gqa`` at Tq > 1 reads G x the bytes)."""
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
                print(f"    sdpa {name} enable_gqa={gqa}: {error_text(e, 120)}")
        res[name] = min(times) if times else None
    q = qf = k = v = None           # free before torch returns its cache
    torch.cuda.empty_cache()
    return res


# --------------------------------------------------------------------------------------------- rows
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
    """A row's keys, its NVFP4 (twin included) and bf16 bytes floors over ``bw`` TB/s, cuDNN / flash SDPA (torch)."""
    rows, twin = b * ctx, b * min(ctx, g.first_n + g.last_n)
    row = dict(batch=b, context=ctx, head_dim=g.head_dim, gqa=g.gqa, page=g.page, tq=tq, kv_heads=g.kv_heads,
               copy_bandwidth_tbs=bw, floor_nvfp4_ms=kv_bytes(rows, g.kv_heads, g.head_dim, "nvfp4", twin) / bw * 1e-9,
               floor_bf16_ms=kv_bytes(rows, g.kv_heads, g.head_dim, "bf16") / bw * 1e-9)
    if torch is not None:
        s = torch_sdpa(torch, g, b, ctx, tq)
        row["cudnn_ms"], row["flash_ms"] = s.get("cudnn"), s.get("flash")
    return row


def grid_row(torch, bw, g: BenchGeometry, b, ctx, tq, opts: RunOptions):
    """One ``--grid`` row: the Triton kernel, the Mosaic GPU kernel (where `supported`), the default one end to end,
    in a step and GPU busy, cuDNN / flash SDPA over contiguous bf16, and both bytes floors."""
    row = _row_start(torch, bw, g, b, ctx, tq)
    args = row_inputs(g, b, ctx, tq)
    fns = dict(mixed=kernel_fn(g, opts, "triton"))
    out = _close(fns["mixed"](*args), None, "mixed")
    row["mixed_ms"] = opts.time(fns["mixed"], *args)
    row["mixed_gpu_ms"] = gpu_busy(fns["mixed"], *args).get("gpu_ms")
    if not opts.interpret and mosaic_sm90.supported(head_dim=g.head_dim, page=g.page, tq=tq, group=g.gqa,
                                                    high_dtype=jnp.bfloat16):
        try:    # a method that fails on this shape is recorded, not fatal for the row
            fns["mgpu"] = kernel_fn(g, opts, "mosaic")
            _close(fns["mgpu"](*args), out, "mgpu")
            row["mgpu_gpu_ms"] = gpu_busy(fns["mgpu"], *args).get("gpu_ms")
            row["mgpu_ms"] = opts.time(fns["mgpu"], *args)
        except Exception as e:
            row["mgpu_error"] = error_text(e, 160)
            print(f"    mgpu: {row['mgpu_error']}")
    # what `jm.decode_attention` runs here: the Mosaic GPU kernel where `choose_backend` picks it
    use_mgpu = row.get("mgpu_ms") is not None and choose_backend(
        head_dim=g.head_dim, page=g.page, tq=tq, group=g.gqa, high_dtype=jnp.bfloat16,
        interpret=opts.interpret) == "mosaic"
    row["default"] = "mgpu" if use_mgpu else "mixed"
    try:        # a failure here (e.g. memory for the loop) must not lose the row's other timings
        row["default_step_ms"] = opts.time(fns[row["default"]], *args, in_step=True)
    except Exception as e:
        row["default_step_ms"], row["step_error"] = None, error_text(e, 160)
        print(f"    step: {row['step_error']}")
    row["default_ms"], row["default_gpu_ms"] = row[f"{row['default']}_ms"], row.get(f"{row['default']}_gpu_ms")
    for other in ("cudnn", "flash", "mgpu"):
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
    that loop and its decode kernels' share; cuDNN / flash SDPA over bf16; both floors."""
    row = _row_start(torch, bw, g, b, ctx, tq)
    args = row_inputs(g, b, ctx, tq)
    row["backend"] = choose_backend(head_dim=g.head_dim, page=g.page, tq=tq, group=g.gqa,
                                    high_dtype=jnp.bfloat16, interpret=opts.interpret)
    loop = step_loop(kernel_fn(g, opts, row["backend"]))
    want = _close(loop(*args)[1], None, "default")
    row["step_ms"] = opts.time(loop, *args) / 10
    prof = gpu_busy(loop, *args, steps=3, calls=10, match="decode|mosaic")
    if prof:
        row.update(gpu_us=prof["gpu_ms"] * 1e3, kernel_us=prof["match_ms"] * 1e3, launches=prof["launches"])
    row["variants"] = {}
    mosaic = row["backend"] == "mosaic"
    others = [("triton", None)] if mosaic else []
    others += [(name, variant_config(f, g, b, ctx, tq)) for name, f in opts.variants
               if (f.get("backend") == "mosaic") == mosaic]
    for name, config in others:
        try:
            lp = step_loop(kernel_fn(g, opts, "mosaic" if isinstance(config, MosaicConfig) else "triton", config))
            _close(lp(*args)[1], want, name)
            row["variants"][name] = opts.time(lp, *args) / 10
        except Exception as e:   # a config that does not compile is recorded, not fatal
            row["variants"][name] = None
            print(f"    {name}: {error_text(e, 160)}")
    ok = {k: v for k, v in row["variants"].items() if v}
    if ok:
        row["best_variant"] = min(ok, key=ok.get)
        row["best_variant_ms"] = ok[row["best_variant"]]
    row["step_vs_nvfp4_floor"] = row["step_ms"] / row["floor_nvfp4_ms"]
    if row.get("cudnn_ms"):
        row["cudnn_over_step"] = row["cudnn_ms"] / row["step_ms"]
    return row


# --------------------------------------------------------------------------------------------- tables, targets
def fmt(x):
    return f"{x:.3f}" if isinstance(x, (int, float)) else "-"


def _shape(r):
    return f"{r['page']} / {r['gqa']} / {r['tq']}", f"{r['batch']} x {r['context'] // 1024}k"


def grid_table(rows):
    """``dflt``: the kernel `jm.decode_attention` runs (``*``: Mosaic GPU; ``h``: host-bound, end to end > 1.25x
    its GPU time); ``step``: per call in a jitted loop of ten; ratios to the NVFP4 floor (``fl4``) and cuDNN's."""
    keys = ("mixed_ms", "mgpu_ms", "default_ms", "default_gpu_ms", "default_step_ms", "cudnn_ms", "flash_ms",
            "floor_nvfp4_ms", "floor_bf16_ms", "default_vs_nvfp4_floor", "default_step_vs_nvfp4_floor",
            "cudnn_over_default", "cudnn_over_default_step")
    return md_table(("page / GQA / Tq", "B x ctx", "mixed", "mgpu", "dflt", "dflt GPU", "step", "cuDNN", "flash",
                     "fl.fp4", "fl.bf16", "dflt/fl4", "step/fl4", "cuDNN/dflt", "cuDNN/step", "error"),
                    [(*_shape(r), *(fmt(r.get(k)) + ("*" if k == "default_ms" and r.get("default") == "mgpu" else "")
                                    + ("h" if k == "default_ms" and r.get("host_bound") else "") for k in keys),
                      r.get("error", "")) for r in rows])


def targets_text(rows):
    """The ``--grid`` `TARGETS` met (of the rows with that time) by the default's end-to-end, in-step and GPU busy
    time."""
    lines = []
    for key, label in (("default_ms", "end to end"), ("default_step_ms", "in a step"), ("default_gpu_ms", "GPU busy")):
        counts = []
        for name, applies, floor_x, cudnn_x in TARGETS:
            rs = [r for r in rows if r.get(key) and applies(r) and (floor_x or r.get("cudnn_ms"))]
            met = [r for r in rs if (r[key] / r["floor_nvfp4_ms"] <= floor_x if floor_x
                                     else r["cudnn_ms"] / r[key] > cudnn_x)]
            counts.append(f"{name} {len(met)}/{len(rs)}")
        lines.append(f"targets by {label}: " + "; ".join(counts))
    return "\n".join(lines)


def geometry_table(rows):
    """``dflt``: ms per call in a jitted loop of ten (``M`` Mosaic GPU, ``T`` Triton); ``GPU`` / ``kern``: GPU busy
    per call and its decode kernels' share, us; ``best other``: the fastest other Triton config."""
    return md_table(("hd", "page / GQA / Tq", "B x ctx", "dflt", "GPU", "kern", "best other", "cuDNN", "flash",
                     "fl.fp4", "dflt/fl4", "cuDNN/dflt", "error"),
                    [(r["head_dim"], *_shape(r), fmt(r.get("step_ms")) + {"mosaic": "M", "triton": "T"}.get(
                        r.get("backend"), ""), fmt(r.get("gpu_us")), fmt(r.get("kernel_us")),
                      f"{r['best_variant']} {r['best_variant_ms']:.3f}" if r.get("best_variant") else "-",
                      *(fmt(r.get(k)) for k in ("cudnn_ms", "flash_ms", "floor_nvfp4_ms", "step_vs_nvfp4_floor",
                                                "cudnn_over_step")), r.get("error", "")) for r in rows])


def geometry_text(rows):
    """The ``--geometry-grid`` targets met (within `TARGET_GEOMETRY` x the floor; Tq 1 faster than cuDNN)."""
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
    """The ``--grid`` rows ``(batch, context, head_dim, gqa, page, tq)`` in run order: geometry by geometry
    (``geos`` = ``"GQA/page/Tq,..."``), each over batch x context, so a time-budget cut loses the later ones."""
    geo = [parse_ints(g, "--geos", "/") for g in geos.split(",")]
    if any(len(g) != 3 for g in geo):
        raise ValueError(f"--geos: expected GQA/page/Tq triples, got {geos!r}")
    shapes = [(b, c) for b in parse_ints(batches, "--batches") for c in parse_ints(contexts, "--contexts")]
    return [(b, c, HEAD_DIM, *g) for g in geo for b, c in shapes]


def geometry_order(head_dims=None, groups=None, pages=None, tqs=None):
    """The ``--geometry-grid`` rows in run order: `GEOMETRY_SUBSET` when every axis is None, else the product of
    the given axes (None: the whole axis, `GEOMETRY_AXES`)."""
    given = (head_dims, groups, pages, tqs)
    ax = [v if v is not None else whole for v, whole in zip(given, GEOMETRY_AXES)]
    geo = GEOMETRY_SUBSET if all(a is None for a in given) else [
        (d, g, p, t) for d in ax[0] for g in ax[1] for p in ax[2] for t in ax[3]]
    return [(GEOMETRY_BATCH, GEOMETRY_CONTEXT, *x) for x in geo]


def parse_shard(text):
    """``"I/N"`` -> ``(I, N)`` with ``0 <= I < N`` (``None`` -> ``(0, 1)``)."""
    shard = (0, 1) if text is None else parse_ints(text, "--shard", "/")
    if len(shard) != 2 or not 0 <= shard[0] < shard[1]:
        raise ValueError(f"--shard: expected I/N with 0 <= I < N (e.g. 0/4), got {text!r}")
    return shard


def _row_key(row):
    return tuple(row[k] for k in ("batch", "context", "head_dim", "gqa", "page", "tq"))


def _json_name(geometry: bool) -> str:
    return "decode_bench-geometry.json" if geometry else "decode_bench-grid.json"


def merge_main(paths, out_dir, geometry: bool, order):
    """``--merge A.json B.json ...``: one JSON and table from the shards of one grid run, rows in ``order``. Refuses
    shards of different devices or versions and a row measured twice; gives the shards' copy bandwidth range."""
    results = [json.load(open(p)) for p in paths]
    keys = ("grid", "device", "jax", "triton", "torch", "heads", "head_dim", "first_n", "last_n")
    diff = {k: [r.get(k) for r in results] for k in keys if len({str(r.get(k)) for r in results}) > 1}
    rows = [row for r in results for row in r["rows"]]
    seen = {_row_key(row) for row in rows}
    if diff or len(seen) < len(rows):
        raise ValueError(f"merge: shards differ in {diff} or a row appears twice: not one grid run")
    rank = {tuple(o): i for i, o in enumerate(order)}
    bws = [x["copy_bandwidth_tbs"] for x in results]
    merged = dict({k: results[0].get(k) for k in keys}, date=min(x["date"] for x in results), shards=len(results),
                  copy_bandwidth_tbs=min(bws), copy_bandwidth_range_tbs=[min(bws), max(bws)],
                  rows=sorted(rows, key=lambda row: rank.get(_row_key(row), len(rank))),
                  skipped=[s for x in results for s in x.get("skipped", []) if tuple(s) not in seen])
    path = write_json(out_dir, _json_name(geometry), merged)
    print(f"{merged['device']}, jax {merged['jax']}, triton {merged['triton']}, copy bandwidth "
          f"{merged['copy_bandwidth_range_tbs']} TB/s ({merged['shards']} shards)")
    print("\n".join(_texts(geometry, merged["rows"])) + f"\nnot run (time budget): {merged['skipped']}\nwrote {path}")
    return 0


def run_grid(order, out_dir, opts: RunOptions):
    """The rows of ``order`` in turn, one JSON under ``out_dir`` rewritten after every row; a row that fails
    (memory, a compile error) is recorded with its error, not fatal."""
    torch = None if opts.interpret else torch_cuda()
    bw, bw_how = copy_bandwidth(opts.interpret)
    info = versions(torch)
    print(f"{info['device']}, jax {info['jax']}, triton {info['triton']}, torch {info['torch']}, copy bandwidth "
          f"{bw:.2f} TB/s ({bw_how})")
    result = dict(grid="geometry" if opts.geometry else "speed", **info, copy_bandwidth_tbs=bw,
                  copy_bandwidth_how=bw_how, heads=opts.kv_heads, head_dim=None if opts.geometry else HEAD_DIM,
                  first_n=DECODE_GEOMETRY["first_n"], last_n=DECODE_GEOMETRY["last_n"], shard=opts.shard,
                  variants=[n for n, _ in opts.variants], rows=[], skipped=[])
    measure = geometry_row if opts.geometry else grid_row
    t0 = time.time()
    for b, c, d, gqa, page, tq in order:
        if time.time() - t0 > BUDGET_S:
            result["skipped"].append([b, c, d, gqa, page, tq])
            continue
        g = BenchGeometry(kv_heads=opts.kv_heads, head_dim=d, gqa=gqa, page=page)
        try:    # pools + the baselines' bf16 K / V must fit; OOM or a failure on one shape must not lose the rest
            if b * c * g.kv_heads * d * 2 * 4.5625 * 1.1 / 2 ** 30 > MEM_GIB:
                raise MemoryError(f"needs more than {MEM_GIB} GiB")
            row = measure(torch, bw, g, b, c, tq, opts)
        except Exception as e:
            row = dict(batch=b, context=c, head_dim=d, gqa=gqa, page=page, tq=tq, error=error_text(e, 160))
        result["rows"].append(row)
        print(_texts(opts.geometry, [row])[0].splitlines()[-1], f"({time.time() - t0:.0f}s)", flush=True)
        write_json(out_dir, _json_name(opts.geometry), result)
    print("\n".join(_texts(opts.geometry, result["rows"])) + f"\nnot run (time budget): {result['skipped']}")
    return 0


def _row_spec(spec: str, flag: str) -> tuple:
    """``"HD/GQA/PAGE/TQ"`` -> four ints; anything else exits naming ``flag`` and the text."""
    try:
        d, gqa, page, tq = parse_ints(spec, f"{flag} HD/GQA/PAGE/TQ", "/")
    except ValueError:
        raise SystemExit(f"decode_bench {flag}: expected HD/GQA/PAGE/TQ (four integers), got {spec!r}") from None
    return d, gqa, page, tq


def kernel_alone(spec: str, variant: Optional[tuple], calls: int) -> int:
    """``--kernel-alone``: `mosaic_sm90.kernel_partials` ``calls`` times (jitted, each waited for) on the inputs of
    the 16 x 32k row ``spec`` (``"HD/GQA/PAGE/TQ"``; on the CPU the smoke shape in interpret mode) with the default
    `MosaicConfig` or the one Mosaic ``variant`` (`parse_variant`'s ``(text, fields)``); prints the row and the last
    call's wall time. Exit 1 if the partials are not finite or no key was seen."""
    d, gqa, page, tq = _row_spec(spec, "--kernel-alone")
    interpret = not on_gpu()
    # on the CPU: a context with interior blocks past the twin's windows (64 + 64; pair blocks of 128 tokens)
    b, ctx = (SMOKE_BATCH, 4 * SMOKE_CONTEXT) if interpret else (GEOMETRY_BATCH, GEOMETRY_CONTEXT)
    g = BenchGeometry(head_dim=d, gqa=gqa, page=page, **(dict(kv_heads=SMOKE_KV_HEADS) if interpret else {}))
    if not mosaic_sm90.supported(head_dim=d, page=page, tq=tq, group=gqa, high_dtype=jnp.bfloat16):
        raise SystemExit(f"decode_bench --kernel-alone: the Mosaic GPU kernel does not take {spec} "
                         f"(head_dim / GQA / page / Tq)")
    name, fields = variant or ("default", None)
    if fields is not None and fields.get("backend") != "mosaic":
        raise SystemExit(f"decode_bench --kernel-alone: {name!r} is not a Mosaic GPU variant (m...)")
    config = MosaicConfig() if fields is None else variant_config(fields, g, b, ctx, tq)
    q, pt, lens, ht, low, high = row_inputs(g, b, ctx, tq)
    call = jax.jit(lambda q, pt, lens, ht, low, high: mosaic_sm90.kernel_partials(
        q, pt, lens, 0, kernel_arrays(low), kernel_arrays(high), high_table=ht, geom=g.cache.twin, config=config,
        interpret=interpret))
    for _ in range(calls):
        t0 = time.perf_counter()
        o, m2, l_sum = jax.block_until_ready(call(q, pt, lens, ht, low, high))
    ok = bool(jnp.isfinite(o).all()) and float(l_sum.max()) > 0
    print(f"kernel alone {name}: head_dim {d}, GQA {gqa}, page {page}, Tq {tq}, {b} x {ctx}, {calls} calls; last "
          f"{1e3 * (time.perf_counter() - t0):.3f} ms wall; partials {'finite' if ok else 'NOT finite or empty'}")
    return 0 if ok else 1


def launches(spec: str, out_dir: str) -> int:
    """``--launches``: the default call of row ``spec`` (``"HD/GQA/PAGE/TQ"``; 16 x 32k, on the CPU the smoke shape
    in interpret mode) in a jitted loop of ten (`step_loop`): prints each GPU kernel's time and count per call
    (`gpu_kernel_profile` over three loops; none off the GPU) and writes them (``decode_bench-launches.json``) and
    the loop's optimized HLO (``decode_bench-launches-hlo.txt``) under ``out_dir``."""
    d, gqa, page, tq = _row_spec(spec, "--launches")
    interpret = not on_gpu()
    b, ctx = (SMOKE_BATCH, SMOKE_CONTEXT) if interpret else (GEOMETRY_BATCH, GEOMETRY_CONTEXT)
    g = BenchGeometry(head_dim=d, gqa=gqa, page=page, **(dict(kv_heads=SMOKE_KV_HEADS) if interpret else {}))
    backend = choose_backend(head_dim=d, page=page, tq=tq, group=gqa, high_dtype=jnp.bfloat16, interpret=interpret)
    args = row_inputs(g, b, ctx, tq)
    loop = step_loop(kernel_fn(g, RunOptions(geometry=True, interpret=interpret), backend))
    jax.block_until_ready(loop(*args))
    hlo = loop.lower(*args).compile().as_text()
    prof = {} if interpret else gpu_kernel_profile(lambda i: loop(*args), 3, tempfile.mkdtemp(prefix="launches"),
                                                       top=60)
    per_call = lambda x: None if x is None else x / 10        # noqa: E731  (`step_loop`'s calls per loop)
    kernels = [dict(name=k["name"], us_per_call=per_call(k["us"]), launches_per_call=per_call(k["calls"]))
               for k in prof.get("kernels", [])]
    result = dict(grid="launches", **versions(torch_cuda()), head_dim=d, gqa=gqa, page=page, tq=tq, batch=b,
                  context=ctx, kv_heads=g.kv_heads, backend=backend, kernels=kernels,
                  busy_us_per_call=per_call(prof.get("busy_us_per_step")),
                  launches_per_call=per_call(prof.get("kernel_launches_per_step")))
    path = write_json(out_dir, "decode_bench-launches.json", result)
    with open(os.path.join(out_dir, "decode_bench-launches-hlo.txt"), "w") as f:
        f.write(hlo)
    print(f"launches of one {backend} call: head_dim {d}, GQA {gqa}, page {page}, Tq {tq}, {b} x {ctx}; GPU busy "
          f"{fmt(result['busy_us_per_call'])} us, {fmt(result['launches_per_call'])} launches per call")
    print(md_table(("us / call", "launches / call", "kernel"),
                   [(f"{k['us_per_call']:.2f}", f"{k['launches_per_call']:.1f}", k["name"][:100]) for k in kernels])
          if kernels else "  no GPU kernels traced (no GPU: the HLO only)")
    print(f"wrote {path} and the optimized HLO beside it")
    return 0


def main(argv=None):
    ap = bench_parser(__doc__, md=False)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--grid", action="store_true", help="batch x context x --geos, head_dim 128")
    mode.add_argument("--geometry-grid", action="store_true", help="head_dim x GQA x page x Tq at 16 x 32k")
    mode.add_argument("--kernel-alone", default=None, metavar="HD/GQA/PAGE/TQ",
                      help="the Mosaic GPU kernel alone, --calls times, for a profiler")
    mode.add_argument("--launches", default=None, metavar="HD/GQA/PAGE/TQ",
                      help="the default call's GPU kernels (names, times) and optimized HLO")
    ap.add_argument("--calls", type=int, default=3, help="--kernel-alone: calls (default 3)")
    for flag, default in zip(("--batches", "--contexts", "--geos"), grid_args()):
        ap.add_argument(flag, default=default, help=f"--grid (default {default})")
    for flag in ("--head-dims", "--groups", "--pages", "--tqs"):
        ap.add_argument(flag, default=None, help="--geometry-grid axis, comma-separated")
    ap.add_argument("--variants", default="", help=f"--geometry-grid: configs {_VARIANT_FORMS}, comma-separated")
    ap.add_argument("--shard", default=None, help="I/N: run rows k with k %% N == I")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON", help="join --shard JSONs (no GPU needed)")
    args = ap.parse_args(argv)
    try:
        i, n = parse_shard(args.shard)
        order = (geometry_order(*(parse_ints(getattr(args, a), a) for a in ("head_dims", "groups", "pages", "tqs")))
                 if args.geometry_grid else grid_order(args.batches, args.contexts, args.geos))
        variants = tuple(parse_variant(v) for v in args.variants.split(",") if v.strip())
    except ValueError as e:
        ap.error(str(e))
    if args.kernel_alone:
        if args.calls < 1 or len(variants) > 1:
            ap.error(f"--kernel-alone takes --calls >= 1 and at most one --variants config, got {args.calls} / "
                     f"{args.variants!r}")
        return 0 if no_gpu("decode_bench", args.smoke) else kernel_alone(args.kernel_alone, (variants or [None])[0],
                                                                           args.calls)
    if args.launches:
        return 0 if no_gpu("decode_bench", args.smoke) else launches(args.launches, args.out)
    if args.merge:
        return merge_main(args.merge, args.out, args.geometry_grid, order)
    if not (args.grid or args.geometry_grid):
        ap.error("choose --grid, --geometry-grid or --merge")
    if no_gpu("decode_bench", args.smoke):
        return 0
    opts = RunOptions(geometry=args.geometry_grid, variants=variants, shard=args.shard)
    if not on_gpu():
        opts = dataclasses.replace(opts, interpret=True, kv_heads=SMOKE_KV_HEADS, timing=SMOKE_TIMING)
        order = list(dict.fromkeys((SMOKE_BATCH, SMOKE_CONTEXT, *o[2:]) for o in order))
    return run_grid([o for k, o in enumerate(order) if k % n == i], args.out, opts)


if __name__ == "__main__":
    sys.exit(main())
