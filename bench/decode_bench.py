"""Decode-attention benchmark on the H200: the fused NVFP4 kernels against cuDNN / flash SDPA over bf16, grid by grid.

Every row builds a mixed NVFP4 + bf16-twin pool (random NVFP4 bytes, valid E4M3 scales, permuted page ids, first_n =
last_n = 64) of one `BenchGeometry` (KV heads, head_dim, GQA group, page) and times the kernels over it; the NVFP4
bytes floor (packed K + V bytes, E4M3 scales and the retained twin rows, over the copy bandwidth measured in-run) and
the bf16 floor sit beside each row. Every timed output must be finite, and every other kernel's output must match the
default's to 1e-2 (correctness against the float32 reference: `tests/test_decode_geometry.py`,
`tests/test_decode_attention.py`, `tests/test_decode_mgpu.py`).

Modes (each writes a JSON under ``--out``, rewritten after every row, so a time-budget cut keeps what was measured;
``--budget-s`` stops starting rows before the device's 600 s command limit):

* ``--grid`` (``decode_bench-grid.json``): the decode-speed grid `shapes.DECODE_GRID` at head_dim 128, 8 KV heads:
  batch x context x (GQA, page, Tq), default kernels only. Each row times the Triton kernel (``mixed``), the Mosaic GPU
  kernel (``mgpu``, where `mosaic_sm90.supported`) and the default one three ways: end to end per call (``dflt``), per
  call inside one jitted loop of ten calls as a model step runs it (``step``, `time_in_step`), GPU busy (``dflt
  GPU``); jax's Pallas paged attention over bf16 (Tq 1) and cuDNN / flash SDPA beside; the decode-speed targets counted
  last (`targets_text`).
* ``--geometry-grid`` (``decode_bench-geometry.json``): head_dim x GQA group x page x Tq at one batch x context
  (default 16 x 32k = 512k tokens, 8 KV heads): `GEOMETRY_SUBSET` by default (every head_dim x group at page 16 Tq 1,
  the page and Tq axes at head_dim 64 and 128), the full product of ``--head-dims / --groups / --pages / --tqs`` when
  any is given. Each row: what `pallas_kernels.decode.paged_decode_attention` runs by default (``dflt``: its backend,
  its time per call in a jitted loop of ten, the GPU busy time of that loop per call and the decode kernels' share of
  it), the Triton kernel in the same loop where the default is the Mosaic one, each ``--variants`` Triton config
  (`parse_variant`) where the default is Triton, cuDNN / flash SDPA over contiguous bf16; `geometry_text` counts the
  targets (within 1.5x of the floor; Tq 1 faster than cuDNN).
* ``--merge A.json B.json ...``: join the shards (``--shard I/N``: rows ``k % N == I``) of one grid run.
* ``--smoke``: the chosen grid at tiny shapes in interpret mode on the CPU (checks the script; times nothing real).

Shards: one process per GPU on a multi-GPU host, or consecutive device calls on one GPU::

    for i in 0 1 2 3; do CUDA_VISIBLE_DEVICES=$i python3 bench/decode_bench.py --grid --shard $i/4 \\
        --out $OUT/s$i > $OUT/s$i.txt 2>&1 & done; wait
    python3 bench/decode_bench.py --grid --merge $OUT/s*/decode_bench-grid.json --out $OUT

Usage: ``PYTHONPATH=. python3 bench/decode_bench.py --geometry-grid --out DIR [--head-dims 64 --groups 1,3 ...]
[--variants k64w2,k128w4x2]``. On a machine without a GPU (and no ``--smoke``) it prints a message and exits 0.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
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
from jmixedkv import layout, nvfp4  # noqa: E402
from common import copy_bandwidth_tbs, gpu_busy_ms, gpu_kernel_profile, time_jax, time_torch, versions  # noqa: E402
from shapes import DECODE_GEOMETRY, grid_args  # noqa: E402
from jmixedkv.compat import on_gpu  # noqa: E402
from jmixedkv.pools import LowPool, RowPool, kernel_arrays  # noqa: E402
from pallas_kernels import decode as decode_entry  # noqa: E402
from pallas_kernels.decode import TritonConfig, choose_backend, mosaic_sm90, triton  # noqa: E402
from pallas_kernels.decode.common import next_pow2, pages_per_block  # noqa: E402
from pallas_kernels.decode.config import triton_num_splits, triton_tuning  # noqa: E402


@dataclasses.dataclass(frozen=True)
class BenchGeometry:
    """The cache geometry of a benchmark row: KV heads, head_dim, GQA group (query heads per KV head), tokens per
    page, retained first_n / last_n of the mixed NVFP4 + bf16 twin, pool layers (the kernels read the last)."""
    kv_heads: int = DECODE_GEOMETRY["kv_heads"]
    head_dim: int = DECODE_GEOMETRY["head_dim"]
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

    @property
    def twin_pages(self) -> int:
        """Twin pages per sequence (fixed + ring)."""
        c = self.cache
        return c.num_fixed_pages + c.num_ring_pages


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How rows run: ``interpret`` (Pallas interpret mode, `--smoke`), ``mosaic`` (time the Mosaic GPU kernel where
    supported), ``variants`` (``(name, fields)`` of Triton configs timed beside the default, `parse_variant`)."""
    interpret: bool = False
    mosaic: bool = True
    variants: tuple = ()


# --------------------------------------------------------------------------------------------- timing
def step_loop(fn, calls=10, lens_arg=2):
    """``fn(*args)`` (-> one output array) run ``calls`` times inside **one** jitted loop, as the layers of a model's
    decode step run it: one executable, no dispatch per call. Each call's ``kv_lens`` (argument ``lens_arg``) is the
    previous one's plus ``isnan(out[0])`` (0 for the finite outputs checked), so XLA can neither hoist a call out of
    the loop nor merge two; the whole output is carried (materialized every call). Returns the jitted loop, ``->
    (lens, last output)``."""
    def loop(*a):
        def body(i, carry):
            a_ = list(a)
            a_[lens_arg] = carry[0]
            out = fn(*a_)
            return carry[0] + jnp.isnan(out.reshape(-1)[0]).astype(carry[0].dtype), out
        out0 = jax.eval_shape(fn, *a)
        return jax.lax.fori_loop(0, calls, body, (a[lens_arg], jnp.zeros(out0.shape, out0.dtype)))
    return jax.jit(loop)


def time_in_step(fn, *args, calls=10, lens_arg=2):
    """Median ms per call of ``fn(*args)`` in `step_loop`. `time_jax` of a single call also pays the runtime's cost
    of launching an executable (on the H200, jax 0.11.2: 23-28 us per call at 16 x 32k and 64 x 4k that ten calls
    in one loop do not see; bench/RESULTS.md)."""
    return time_jax(step_loop(fn, calls, lens_arg), *args) / calls


def step_profile(loop, args, calls=10):
    """GPU busy time of `step_loop` ``loop`` per call (us) and the decode kernels' share (names with ``decode`` or
    ``mosaic``), from a profiler trace; ``{}`` off the GPU or when the profiler fails."""
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


# --------------------------------------------------------------------------------------------- big pools
def tables(key, g: BenchGeometry, b, ctx):
    """Random page permutation: page_table i32[b, ctx/page] over b*ctx/page pages, high_table i32[b, twin pages]."""
    npg = ctx // g.page
    perm = jax.random.permutation(key, b * npg).astype(jnp.int32)
    ht = jnp.arange(b * g.twin_pages, dtype=jnp.int32).reshape(b, g.twin_pages)
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


def mixed_pools(key, g: BenchGeometry, b, ctx):
    """Random NVFP4 low pool (valid E4M3 scales, gs from amax) + bf16 twin, ``g.layers`` layers; uint8 pools padded
    out of the Pallas Triton offset hole exactly as `init_state` does."""
    pages = b * ctx // g.page
    k1, k2, k3 = jax.random.split(key, 3)
    d, h, page, lay = g.head_dim, g.kv_heads, g.page, g.layers
    count = lambda width: layout.offset_safe_count(pages, lay * 2 * h * page * width, 1)  # noqa: E731
    data = _tiled(k1, shape=(lay, count(d // 2), 2, h, page, d // 2), axis=1, gen=_u8_bits)
    scales = _tiled(k2, shape=(lay, count(d // 16), 2, h, page, d // 16), axis=1, gen=_e4m3_scales)
    gs = jnp.broadcast_to(nvfp4.global_scale_from_amax(8.0), (lay, 2)).astype(jnp.float32)
    high = rand_bf16(k3, (lay, b * g.twin_pages, 2, h, page, d))
    return LowPool(data, scales, gs), RowPool(high, jnp.ones((lay, 2), jnp.float32))


def jax_layout_pages(key, g: BenchGeometry, b, ctx):
    """k_pages, v_pages bf16[H, pages, page, D] for jax's paged_attention."""
    k1, k2 = jax.random.split(key)
    shape = (g.kv_heads, b * ctx // g.page, g.page, g.head_dim)
    return rand_bf16(k1, shape, axis=1), rand_bf16(k2, shape, axis=1)


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
    """Jitted ``(q, pt, lens, ht, low, high) -> out`` over the mixed pools: ``backend`` ``"default"`` (the entry
    point's pick, `choose_backend`), ``"triton"`` or ``"mosaic"``, with ``config`` (None: the backend's defaults)."""
    layer, twin = g.layers - 1, g.cache.twin
    if backend == "default":
        call = functools.partial(decode_entry.paged_decode_attention, config=config)
        return jax.jit(lambda q, pt, lens, ht, low, high: call(
            q, pt, lens, layer, kernel_arrays(low), kernel_arrays(high), None, ht, geom=twin,
            interpret=opts.interpret)[0])
    if backend == "triton":
        return jax.jit(lambda q, pt, lens, ht, low, high: triton.paged_decode_attention(
            q, pt, lens, layer, kernel_arrays(low), kernel_arrays(high), None, ht, geom=twin, config=config,
            interpret=opts.interpret)[0])
    return jax.jit(lambda q, pt, lens, ht, low, high: mosaic_sm90.paged_decode_attention(
        q, pt, lens, layer, kernel_arrays(low), kernel_arrays(high), ht, geom=twin, config=config,
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
    nb = pages_per_block(fields["block_k"], g.page)
    blocks = max(1, -(-(ctx // g.page) // nb))
    m_rows = next_pow2(max(16, tq * g.gqa))
    per_sm = triton_tuning("nvfp4", b, g.kv_heads, g.page, m_rows, tq * g.gqa, g.head_dim)[2]
    splits = max(1, min(blocks, int(triton_num_splits(b, g.kv_heads, blocks, per_sm) * fields["split_mult"])))
    kw = {k: v for k, v in fields.items() if k != "split_mult"}
    return TritonConfig(num_splits=splits, **kw)


def jax_pa_fn(ppcb, ks, interpret=False):
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
    return jax.jit(lambda q, k, v, bt, lens: paged_attention(q, k, v, bt, lens, pages_per_compute_block=ppcb,
                                                             k_splits=ks, interpret=interpret))


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


def _method(row, name, thunk):
    """``row[name + "_ms"] = thunk()``; a method that fails on this shape is recorded, not fatal for the row."""
    try:
        row[f"{name}_ms"] = thunk()
    except Exception as e:
        row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:160]}"
        print(f"    {name}: {row[f'{name}_error']}")


def _row_inputs(g: BenchGeometry, b, ctx, tq, seed):
    key = jax.random.PRNGKey(seed)
    q = jax.random.normal(key, (b, tq, g.q_heads, g.head_dim), jnp.bfloat16)
    lens = jnp.full((b,), ctx, jnp.int32)
    pt, ht = tables(jax.random.fold_in(key, 1), g, b, ctx)
    low, high = mixed_pools(jax.random.fold_in(key, 2), g, b, ctx)
    return key, (q, pt, lens, ht, low, high)


def _close(got, want, what):
    got = np.asarray(got, np.float32)
    if not np.isfinite(got).all():
        raise FloatingPointError(f"{what}: non-finite output")
    if want is not None:
        rel = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
        if not rel < 1e-2:
            raise ValueError(f"{what}: output differs from the default's by {rel:.2e}")
    return got


# --------------------------------------------------------------------------------------------- --grid
GRID_JAX_PA_SPLITS = {1: 16, 16: 4, 64: 1}   # jax paged_attention k_splits per batch (best of earlier sweeps)


def grid_row(torch, bw, g: BenchGeometry, b, ctx, tq, opts: RunOptions):
    """One ``--grid`` row: the Triton kernel, the Mosaic GPU kernel (where `supported`), the default one end to end,
    in a step and GPU busy, cuDNN / flash SDPA over contiguous bf16, jax's Pallas paged attention over bf16 (Tq 1
    only: it has no multi-token query), and both bytes floors."""
    row = dict(batch=b, context=ctx, head_dim=g.head_dim, gqa=g.gqa, page=g.page, tq=tq, copy_bandwidth_tbs=bw)
    row["floor_nvfp4_ms"], row["floor_bf16_ms"] = floors(g, b, ctx, bw)
    if torch is not None:
        s = torch_sdpa(torch, g, b, ctx, tq)
        row["cudnn_ms"], row["flash_ms"] = s.get("cudnn"), s.get("flash")
    key, args = _row_inputs(g, b, ctx, tq, b * 1000 + ctx // 1024 + 7 * g.gqa + g.page + tq)
    fn = kernel_fn(g, opts, "triton")
    out = _close(fn(*args), None, "mixed")
    row["mixed_ms"] = time_jax(fn, *args)
    row["mixed_gpu_ms"] = gpu_busy_ms(fn, *args)
    fns = dict(mixed=fn)

    def mgpu():
        mg = kernel_fn(g, opts, "mosaic")
        _close(mg(*args), out, "mgpu")
        ms = time_jax(mg, *args)
        row["mgpu_gpu_ms"] = gpu_busy_ms(mg, *args)
        fns["mgpu"] = mg
        return ms
    if opts.mosaic and mosaic_sm90.supported(head_dim=g.head_dim, page=g.page, tq=tq, group=g.gqa,
                                             high_dtype=jnp.bfloat16):
        _method(row, "mgpu", mgpu)
    # what `jm.decode_attention` runs here: the Mosaic GPU kernel where `choose_backend` picks it
    use_mgpu = row.get("mgpu_ms") is not None and choose_backend(
        head_dim=g.head_dim, page=g.page, tq=tq, group=g.gqa, high_dtype=jnp.bfloat16,
        interpret=opts.interpret) == "mosaic"
    row["default"] = "mgpu" if use_mgpu else "mixed"
    try:        # a failure here (e.g. memory for the loop) must not lose the row's other timings
        row["default_step_ms"] = time_in_step(fns[row["default"]], *args)
    except Exception as e:
        row["default_step_ms"], row["step_error"] = None, f"{type(e).__name__}: {str(e)[:160]}"
        print(f"    step: {row['step_error']}")
    q = args[0]
    pt, lens = args[1], args[2]
    del args, fns

    def jax_pa():   # 128-token compute blocks: 8 pages of 16 or 2 of 64 (8 x 64 needs 276 KB of shared memory)
        kp, vp = jax_layout_pages(jax.random.fold_in(key, 4), g, b, ctx)
        npg, ppcb, ks = ctx // g.page, max(1, 128 // g.page), GRID_JAX_PA_SPLITS.get(b, 1)
        while ks > 1 and npg % (ks * ppcb):
            ks //= 2
        return time_jax(jax_pa_fn(min(ppcb, npg), ks, opts.interpret), q[:, 0], kp, vp, pt, lens)
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


def fmt(x, w=8):
    return f"{x:{w}.3f}" if isinstance(x, (int, float)) and x is not None else f"{'-':>{w}}"


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


# --------------------------------------------------------------------------------------------- --geometry-grid
#: the default rows of ``--geometry-grid`` (head_dim, GQA, page, Tq): every head_dim x group at page 16 Tq 1, then
#: the page and Tq axes at head_dim 64 and 128 (GQA 4)
GEOMETRY_SUBSET = tuple([(d, g, 16, 1) for d in (64, 128, 256) for g in (1, 2, 3, 4, 7, 8)]
                        + [(d, 4, p, 1) for d in (64, 128) for p in (32, 64, 128)]
                        + [(d, 4, 16, t) for d in (64, 128) for t in (2, 4, 8)])
#: the whole axes (``--head-dims`` / ``--groups`` / ``--pages`` / ``--tqs`` take subsets of any size)
GEOMETRY_AXES = dict(head_dims=(64, 128, 256), groups=(1, 2, 3, 4, 7, 8), pages=(16, 32, 64, 128), tqs=(1, 2, 4, 8))
#: the target of every geometry row: within this many times its NVFP4 bytes floor
TARGET_GEOMETRY = 1.5


def geometry_order(head_dims=None, groups=None, pages=None, tqs=None, batch=16, context=32768):
    """The ``--geometry-grid`` rows ``(batch, context, head_dim, gqa, page, tq)`` in run order: `GEOMETRY_SUBSET`
    when every axis is None, else the product of the given axes (None = the whole axis, `GEOMETRY_AXES`)."""
    if all(a is None for a in (head_dims, groups, pages, tqs)):
        geo = GEOMETRY_SUBSET
    else:
        ax = [tuple(v) if v is not None else GEOMETRY_AXES[k]
              for k, v in zip(("head_dims", "groups", "pages", "tqs"), (head_dims, groups, pages, tqs))]
        geo = [(d, g, p, t) for d in ax[0] for g in ax[1] for p in ax[2] for t in ax[3]]
    return [(batch, context, *x) for x in geo]


def geometry_row(torch, bw, g: BenchGeometry, b, ctx, tq, opts: RunOptions):
    """One ``--geometry-grid`` row: the default backend, the Triton kernel beside a Mosaic default, the ``variants``
    beside a Triton default, each per call in a jitted loop of ten (`time_in_step`); the default's GPU busy time in
    that loop and its decode kernels' share (`step_profile`); cuDNN / flash SDPA over bf16; both floors."""
    row = dict(batch=b, context=ctx, head_dim=g.head_dim, gqa=g.gqa, page=g.page, tq=tq, kv_heads=g.kv_heads,
               copy_bandwidth_tbs=bw)
    row["floor_nvfp4_ms"], row["floor_bf16_ms"] = floors(g, b, ctx, bw)
    if torch is not None:
        s = torch_sdpa(torch, g, b, ctx, tq)
        row["cudnn_ms"], row["flash_ms"] = s.get("cudnn"), s.get("flash")
    _, args = _row_inputs(g, b, ctx, tq, b * 1000 + ctx // 1024 + 7 * g.gqa + g.page + tq + g.head_dim)
    row["backend"] = choose_backend(head_dim=g.head_dim, page=g.page, tq=tq, group=g.gqa,
                                    high_dtype=jnp.bfloat16, interpret=opts.interpret)
    if row["backend"] == "mosaic" and not opts.mosaic:
        row["backend"] = "triton"
    loop = step_loop(kernel_fn(g, opts, row["backend"]))
    want = _close(loop(*args)[1], None, "default")
    row["step_ms"] = time_jax(loop, *args) / 10
    row.update(step_profile(loop, args))
    row["variants"] = {}
    others = [("triton", None)] if row["backend"] == "mosaic" else [
        (name, variant_config(f, g, b, ctx, tq)) for name, f in opts.variants]
    for name, config in others:
        def run(config=config, name=name):
            lp = step_loop(kernel_fn(g, opts, "triton", config))
            _close(lp(*args)[1], want, name)
            return time_jax(lp, *args) / 10
        try:
            row["variants"][name] = run()
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


def geometry_table(rows):
    """``dflt``: what the entry point runs (``M`` Mosaic GPU, ``T`` Triton), ms per call in a jitted loop of ten;
    ``GPU``: GPU busy per call in that loop, ``kern``: its decode kernels' share; ``best other``: the fastest of the
    Triton kernel (beside a Mosaic default) or the ``--variants`` (beside a Triton default)."""
    head = (f"{'hd':>3} {'gqa':>3} {'pg':>3} {'tq':>2} {'B x ctx':>11} {'dflt':>8} {'GPU':>7} {'kern':>7} "
            f"{'best other':>22} {'cuDNN':>7} {'flash':>7} {'fl.fp4':>7} {'fl.bf16':>7} {'dflt/fl4':>8} "
            f"{'cuDNN/dflt':>10}")
    lines = [head]
    for r in rows:
        if r.get("error"):
            lines.append(f"{r['head_dim']:>3} {r['gqa']:>3} {r['page']:>3} {r['tq']:>2} {r['batch']:>4} x "
                         f"{r['context'] // 1024:>4}k  {r['error']}")
            continue
        f = lambda k: fmt(r.get(k), 7)  # noqa: E731
        best = f"{r['best_variant']} {r['best_variant_ms']:.3f}" if r.get("best_variant") else "-"
        gpu = lambda k: fmt(r[k] / 1e3 if r.get(k) else None, 7)  # noqa: E731
        lines.append(f"{r['head_dim']:>3} {r['gqa']:>3} {r['page']:>3} {r['tq']:>2} {r['batch']:>4} x "
                     f"{r['context'] // 1024:>4}k {r['step_ms']:7.3f}{'M' if r['backend'] == 'mosaic' else 'T'} "
                     f"{gpu('gpu_us')} {gpu('kernel_us')} {best:>22} {f('cudnn_ms')} {f('flash_ms')} "
                     f"{f('floor_nvfp4_ms')} {f('floor_bf16_ms')} {fmt(r.get('step_vs_nvfp4_floor'), 8)} "
                     f"{fmt(r.get('cudnn_over_step'), 10)}")
    return "\n".join(lines)


def geometry_text(rows):
    """The geometry targets counted over geometry rows: within `TARGET_GEOMETRY` x the floor; Tq 1 faster than
    cuDNN; with the misses."""
    done = [r for r in rows if r.get("step_ms")]
    near = [r for r in done if r["step_vs_nvfp4_floor"] > TARGET_GEOMETRY]
    tq1 = [r for r in done if r["tq"] == 1 and r.get("cudnn_ms")]
    slow = [r for r in tq1 if r["cudnn_ms"] <= r["step_ms"]]

    def key(r):
        return f"hd{r['head_dim']}/G{r['gqa']}/p{r['page']}/t{r['tq']}"
    far = ", ".join(f"{key(r)} {r['step_vs_nvfp4_floor']:.2f}x" for r in near) or "none"
    behind = ", ".join(f"{key(r)} {r['cudnn_ms'] / r['step_ms']:.2f}x" for r in slow) or "none"
    return (f"within {TARGET_GEOMETRY}x the NVFP4 floor: {len(done) - len(near)}/{len(done)} (misses: {far})\n"
            f"Tq 1 faster than cuDNN bf16: {len(tq1) - len(slow)}/{len(tq1)} (misses, cuDNN / dflt: {behind})")


# --------------------------------------------------------------------------------------------- shards, merge
def grid_order(batches: str, contexts: str, geos: str):
    """The ``--grid`` rows ``(batch, context, gqa, page, tq)`` in run order: geometry by geometry (``geos`` =
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


def _order_key(o):
    """A grid order entry -> ``(batch, context, head_dim, gqa, page, tq)`` (``--grid`` entries are at head_dim 128)."""
    return tuple(o) if len(o) == 6 else (o[0], o[1], DECODE_GEOMETRY["head_dim"], *o[2:])


def _row_key(row):
    return (row["batch"], row["context"], row.get("head_dim", DECODE_GEOMETRY["head_dim"]), row["gqa"], row["page"],
            row["tq"])


def merge_grids(results, order=None):
    """Join grid results (the JSON dicts of shards of one grid) into one, rows in ``order`` (the grid's run order,
    `grid_order` / `geometry_order`; default: the shards' rows as listed). Refuses shards measured on different
    devices or versions (the rows would not be side by side) and a row measured twice. Each row keeps the copy
    bandwidth its shard measured (``copy_bandwidth_tbs``); the merged header gives their range. A row one shard
    skipped (time budget) and another measured (a re-run of the skipped rows) is not listed as skipped."""
    if not results:
        raise ValueError("merge: no grid results given")
    keys = ("grid", "device", "jax", "triton", "torch", "heads", "head_dim", "first_n", "last_n", "layers")
    first = results[0]
    for r in results[1:]:
        diff = {k: (first.get(k), r.get(k)) for k in keys if first.get(k) != r.get(k)}
        if diff:
            raise ValueError(f"merge: shards differ in {diff}; their rows are not side by side")
    rows, seen = [], set()
    for r in results:
        for row in r["rows"]:
            k = _row_key(row)
            if k in seen:
                raise ValueError(f"merge: row {k} appears in more than one shard")
            seen.add(k)
            rows.append(row)
    if order is not None:
        rank = {_order_key(o): i for i, o in enumerate(order)}
        rows.sort(key=lambda row: rank.get(_row_key(row), len(rank)))
    bws = [x["copy_bandwidth_tbs"] for x in results]
    out = {k: first.get(k) for k in keys}
    out.update(date=min(x["date"] for x in results), shards=len(results), copy_bandwidth_tbs=min(bws),
               copy_bandwidth_range_tbs=[min(bws), max(bws)],
               copy_bandwidth_how="; ".join(sorted({x.get("copy_bandwidth_how", "") for x in results})),
               rows=rows, skipped=[s for x in results for s in x.get("skipped", [])
                                   if _order_key(s) not in seen])
    return out


def _ints(text):
    return None if text is None else tuple(int(x) for x in text.split(","))


def _order(args):
    if args.geometry_grid:
        return geometry_order(_ints(args.head_dims), _ints(args.groups), _ints(args.pages), _ints(args.tqs),
                              args.geometry_batch, args.geometry_context)
    return grid_order(args.batches, args.contexts, args.geos)


def _texts(geometry: bool, rows):
    return (geometry_table(rows), geometry_text(rows)) if geometry else (grid_table(rows), targets_text(rows))


def merge_main(args):
    """``--merge A.json B.json ...``: one grid JSON and table from the shards of one grid run."""
    results = []
    for path in args.merge:
        with open(path) as f:
            results.append(json.load(f))
    merged = merge_grids(results, _order(args))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "decode_bench-geometry.json" if args.geometry_grid else "decode_bench-grid.json")
    with open(path, "w") as f:
        json.dump(merged, f, indent=1, default=str)
    print(f"device {merged['device']}  jax {merged['jax']}  triton {merged['triton']}  torch {merged['torch']}  "
          f"copy bandwidth {merged['copy_bandwidth_range_tbs'][0]:.2f}-{merged['copy_bandwidth_range_tbs'][1]:.2f} "
          f"TB/s ({merged['shards']} shards)")
    print("\n".join(_texts(args.geometry_grid, merged["rows"])))
    if merged["skipped"]:
        print(f"not run (time budget): {merged['skipped']}")
    print(f"wrote {path}")
    return 0


def grid_main(args, torch, bw, bw_how, info, opts: RunOptions):
    """``--grid`` / ``--geometry-grid``: the shard's rows in order, one JSON rewritten after every row."""
    geometry = args.geometry_grid
    order = shard_rows(_order(args), parse_shard(args.shard))
    result = dict(grid="geometry" if geometry else "speed",
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **info,
                  copy_bandwidth_tbs=bw, copy_bandwidth_how=bw_how, heads=args.kv_heads,
                  head_dim=None if geometry else DECODE_GEOMETRY["head_dim"], first_n=DECODE_GEOMETRY["first_n"],
                  last_n=DECODE_GEOMETRY["last_n"], layers=args.layers, shard=args.shard,
                  variants=[n for n, _ in opts.variants], rows=[], skipped=[])
    path = os.path.join(args.out, "decode_bench-geometry.json" if geometry else "decode_bench-grid.json")
    t0 = time.time()
    for o in order:
        b, c, d, g_, p, t = _order_key(o)
        if time.time() - t0 > args.budget_s:
            result["skipped"].append(list(o))
            continue
        g = BenchGeometry(kv_heads=args.kv_heads, head_dim=d, gqa=g_, page=p, layers=args.layers)
        try:
            if not fits(g, b, c, args.mem_gib):
                raise MemoryError(f"needs more than --mem-gib {args.mem_gib}")
            row = (geometry_row if geometry else grid_row)(torch, bw, g, b, c, t, opts)
        except Exception as e:  # OOM or a failure on one shape must not lose the rest
            row = dict(batch=b, context=c, head_dim=d, gqa=g_, page=p, tq=t,
                       error=f"{type(e).__name__}: {str(e)[:160]}")
        result["rows"].append(row)
        print(_texts(geometry, [row])[0].splitlines()[-1], f"({time.time() - t0:.0f}s)", flush=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1, default=str)
    print("\n".join(_texts(geometry, result["rows"])))
    if result["skipped"]:
        print(f"not run (time budget {args.budget_s:.0f}s): {result['skipped']}")
    return 0


def main(argv=None):
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
    args = ap.parse_args(argv)
    try:
        parse_shard(args.shard)
        _order(args)
        variants = tuple(parse_variant(v) for v in args.variants.split(",") if v.strip())
    except ValueError as e:
        ap.error(str(e))
    if args.merge:
        return merge_main(args)
    if not (args.grid or args.geometry_grid):
        ap.error("choose --grid, --geometry-grid or --merge")
    interpret = args.smoke and not on_gpu()
    if not interpret and not on_gpu():
        print("decode_bench: no GPU found (jax backend is %r); this benchmark runs on the H200 only. "
              "Nothing to do." % jax.default_backend())
        return 0
    if interpret:      # tiny rows: the script's paths, nothing timed for real
        args.geometry_batch, args.geometry_context, args.batches, args.contexts = 2, 256, "2", "256"
        args.kv_heads = 2
    opts = RunOptions(interpret=interpret, mosaic=not args.no_mgpu and not interpret, variants=variants)
    os.makedirs(args.out, exist_ok=True)
    try:
        import torch
        if interpret or not torch.cuda.is_available():
            torch = None
    except Exception:
        torch = None
    bw, bw_how = (4.3, "nominal (smoke)") if interpret else copy_bandwidth_tbs(torch)
    info = versions(torch)
    print(f"device {info['device']}  jax {info['jax']}  triton {info['triton']}  torch {info['torch']}  "
          f"copy bandwidth {bw:.2f} TB/s ({bw_how})")
    return grid_main(args, torch, bw, bw_how, info, opts)


if __name__ == "__main__":
    sys.exit(main())
