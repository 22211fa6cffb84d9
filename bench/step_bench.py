"""A whole decode step on the H200: 32 layers of attention + the all-layer append, mixed NVFP4 vs bf16 + cuDNN.

The step a user's model runs per generated token, batch 64 x context 8k, 8 KV heads, 32 query heads,
head_dim 128, one query token, everything in one jit with the cache donated (updated in place):

  mixed   ``jm.append`` of the 32 layers' new K/V rows (write kernel: NVFP4 + retained twin rows), then 32 x
          ``jm.decode_attention`` (the default fused kernel) over mixed_nvfp4_bf16 pools, page 16 (`--page`),
          first_n = last_n = 64 (random NVFP4 bytes, valid E4M3 scales, random twin rows; page ids permuted)
  bf16    the same step over contiguous bf16 caches ``[B, S, H, D]`` (one per layer and K / V): a scatter of the
          new rows, then 32 x ``jax.nn.dot_product_attention(implementation="cudnn")`` with
          ``key_value_seq_lengths`` (no padding mask, every cache row, if cuDNN refuses the mask)

Timing: each step blocked on (the host waits for every token), then the same number of steps enqueued back to
back (sampling on the device: the host dispatches the next step while one runs); ``--profile`` adds a jax profiler
trace of 3 steps per path: GPU time per kernel, idle time inside a step and between steps.
Floors: K + V bytes read per step (all layers) / copy bandwidth measured in-run. Prints a table, writes
``DIR/step_bench.json``. Usage: ``PYTHONPATH=. python3 bench/step_bench.py --out DIR`` (GPU; on CPU it prints a
message and exits 0; ``--smoke`` runs tiny shapes in interpret mode, XLA attention instead of cuDNN).
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
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jmixedkv as jm  # noqa: E402
from jmixedkv import nvfp4  # noqa: E402
from jmixedkv.compat import on_gpu  # noqa: E402
from common import copy_bandwidth_tbs, gpu_kernel_profile  # noqa: E402

L, B, CTX, H, HQ, D, PAGE, FIRST_N, LAST_N = 32, 64, 8192, 8, 32, 128, 16, 64, 64
STEPS = 12            # timed steps (each appends one token per sequence)
CHUNK = 1 << 26       # random fills: at most this many elements generated, tiled along the page / token axis


@functools.partial(jax.jit, static_argnames=("shape", "axis", "kind"))
def tiled(key, *, shape, axis, kind):
    """Random ``kind`` ("u8", "e4m3" scales in 2^-4..2^0, "bf16" normal) of ``shape``: one chunk of at most
    `CHUNK` elements tiled along ``axis`` (no full-size random temporaries)."""
    per = int(np.prod(shape)) // shape[axis]
    n = max(1, min(shape[axis], CHUNK // max(per, 1)))
    cs = shape[:axis] + (n,) + shape[axis + 1:]
    if kind == "u8":
        x = jax.random.bits(key, cs, jnp.uint8)
    elif kind == "e4m3":
        x = jax.lax.bitcast_convert_type((jax.random.bits(key, cs, jnp.uint8) & jnp.uint8(0x1F)) + jnp.uint8(0x28),
                                         jnp.float8_e4m3fn)
    else:
        x = jax.random.normal(key, cs, jnp.float32).astype(jnp.bfloat16)
    x = jnp.tile(x, tuple(-(-shape[axis] // n) if i == axis else 1 for i in range(len(shape))))
    return jax.lax.slice_in_dim(x, 0, shape[axis], axis=axis)


def mixed_state(layers, batch, ctx, page, spare_pages):
    """Full mixed cache: ``batch`` sequences of ``ctx`` random tokens, ``spare_pages`` free low pages each."""
    cfg = jm.KVCacheConfig("mixed_nvfp4_bf16", first_n=FIRST_N, last_n=LAST_N, page_size=page)
    spec = jm.GroupSpec(num_layers=layers, num_kv_heads=H, head_dim=D)
    full = -(-ctx // page)
    ppseq = full + spare_pages
    st = jm.init_state(cfg, spec, batch * ppseq, batch, ppseq, gs=float(nvfp4.global_scale_from_amax(8.0)))
    pool = st.pools[0]
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    low = dataclasses.replace(pool.low, data=tiled(k1, shape=pool.low.data.shape, axis=1, kind="u8"),
                              scales=tiled(k2, shape=pool.low.scales.shape, axis=1, kind="e4m3"))
    high = dataclasses.replace(pool.high, rows=tiled(k3, shape=pool.high.rows.shape, axis=1, kind="bf16"))
    # the first `full` pages of every sequence are in use (a permutation of 0 .. batch*full-1); the spare pages
    # (batch*full ..) stay on the allocator's free stack, so appends past ctx take new pages
    perm = np.random.default_rng(0).permutation(batch * full).astype(np.int32).reshape(batch, full)
    pt = np.full((batch, ppseq), -1, np.int32)
    pt[:, :full] = perm
    alloc = _take_pages(st.alloc, batch * full)
    nh = st.high_table.shape[1]
    # twin pages: fixed + ring of every sequence, ids 0 .. batch*nh-1 (all taken)
    ht = np.arange(batch * nh, dtype=np.int32).reshape(batch, nh)
    halloc = _take_pages(st.high_alloc, batch * nh)
    return dataclasses.replace(st, pools=(dataclasses.replace(pool, low=low, high=high),), page_table=jnp.asarray(pt),
                               high_table=jnp.asarray(ht), kv_lens=jnp.full((batch,), ctx, jnp.int32),
                               written=jnp.full((batch,), ctx, jnp.int32), active=jnp.ones((batch,), bool),
                               alloc=alloc, high_alloc=halloc)


def _take_pages(alloc, n):
    """`jmixedkv.allocator.Allocator` with page ids ``0 .. n-1`` in use (refcount 1), the rest on the free stack."""
    total = alloc.free.shape[0]
    free = jnp.concatenate([jnp.arange(total - 1, n - 1, -1, dtype=jnp.int32), jnp.arange(n, dtype=jnp.int32)])
    refcount = jnp.where(jnp.arange(total) < n, 1, 0).astype(alloc.refcount.dtype)
    return dataclasses.replace(alloc, free=free, num_free=jnp.asarray(total - n, alloc.num_free.dtype),
                               refcount=refcount)


def time_steps(step, carry, args_fn, steps):
    """Run ``steps`` donated steps blocking after each (a loop that waits for every token on the host), then
    ``steps`` more enqueued back to back and blocked once (a loop that samples on the device: the host dispatches
    step i + 1 while step i runs). Returns ``(median ms per blocking step, ms per pipelined step, carry, out)``."""
    ts = []
    for i in range(steps):
        t0 = time.perf_counter()
        carry, out = step(carry, *args_fn(i))
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) * 1e3)
    t0 = time.perf_counter()
    for i in range(steps):
        carry, out = step(carry, *args_fn(i))
    jax.block_until_ready(out)
    return float(np.median(ts)), (time.perf_counter() - t0) * 1e3 / steps, carry, out


def _print_profile(label, prof):
    print(f"{label}: GPU busy {prof['busy_us_per_step'] / 1e3:.3f} ms per step, idle inside a step "
          f"{prof['idle_inside_us_per_step'] / 1e3:.3f} ms, between steps {prof['idle_between_us_per_step'] / 1e3:.3f} "
          f"ms, {prof['kernel_launches_per_step']:.0f} kernels per step ({prof['gpu_processes']})")
    for k in prof["kernels"]:
        print(f"   {k['us']:10.1f} us  x{k['calls']:5.1f}  {k['name'][:110]}")


def copy_bw():
    """Device copy bandwidth (read + write), TB/s (`common.copy_bandwidth_tbs`, with torch where it has CUDA)."""
    try:
        import torch
        torch = torch if torch.cuda.is_available() else None
    except ImportError:
        torch = None
    return copy_bandwidth_tbs(torch)[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--skip-bf16", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="also trace 3 steps of each path with the jax profiler and print GPU time per kernel")
    ap.add_argument("--page", type=int, default=PAGE,
                    help=f"tokens per page of the mixed cache (default {PAGE}; KVCacheConfig's default is 32)")
    ap.add_argument("--attn-only-after-s", type=float, default=60.0,
                    help="time the 32 attention calls alone only if the mixed step was ready within this many s")
    args = ap.parse_args(argv)
    layers, batch, ctx, steps, page = L, B, CTX, STEPS, args.page
    impl = "cudnn"
    if args.smoke and not on_gpu():
        layers, batch, ctx, steps, impl = 2, 2, 64, 2, "xla"
    elif not on_gpu():
        print("step_bench: no GPU; nothing to do")
        return 0
    os.makedirs(args.out, exist_ok=True)
    bw = copy_bw() if on_gpu() else 4.26
    t0 = time.time()
    res = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               device=jax.devices()[0].device_kind, jax=jax.__version__, layers=layers, batch=batch, context=ctx,
               kv_heads=H, q_heads=HQ, head_dim=D, page=page, first_n=FIRST_N, last_n=LAST_N,
               copy_bandwidth_tbs=bw, rows={})
    try:
        import triton
        res["triton"] = triton.__version__
    except ImportError:
        res["triton"] = "n/a"
    tok = batch * ctx
    bytes_mixed = layers * (tok * H * D * 2 * (0.5 + 1 / 16) + batch * (FIRST_N + LAST_N) * H * D * 2 * 2)
    bytes_bf16 = layers * tok * H * D * 2 * 2
    res["floor_mixed_ms"] = bytes_mixed / (bw * 1e12) * 1e3
    res["floor_bf16_ms"] = bytes_bf16 / (bw * 1e12) * 1e3
    slots = jnp.arange(batch, dtype=jnp.int32)
    interp = not on_gpu()

    def qkv(i):
        k = jax.random.fold_in(jax.random.PRNGKey(1), i)
        q = jax.random.normal(k, (layers, batch, 1, HQ, D), jnp.float32).astype(jnp.bfloat16)
        kn = jax.random.normal(jax.random.fold_in(k, 1), (layers, batch, H, D), jnp.float32).astype(jnp.bfloat16)
        vn = jax.random.normal(jax.random.fold_in(k, 2), (layers, batch, H, D), jnp.float32).astype(jnp.bfloat16)
        return q, kn, vn
    inputs = [qkv(i) for i in range(min(steps, 4))]

    # ---- mixed NVFP4
    st = mixed_state(layers, batch, ctx, page, spare_pages=4)
    backend = "reference" if interp else "auto"

    def mixed_step(state, q, kn, vn):
        pos = state.kv_lens
        state = jm.append(state, layer=None, k=kn, v=vn, seq_slots=slots, positions=pos, backend=backend)
        outs = [jm.decode_attention(state, layer=layer, q=q[layer], seq_slots=slots, backend="pallas" if not interp else "reference")[0]
                for layer in range(layers)]
        return state, jnp.stack(outs)

    def attn_only(state, q):
        return jnp.stack([jm.decode_attention(state, layer=layer, q=q[layer], seq_slots=slots, backend="pallas" if not interp else "reference")[0] for layer in range(layers)])
    step = jax.jit(mixed_step, donate_argnums=0)
    st, out = step(st, *inputs[0])
    jax.block_until_ready(out)
    res["mixed_compile_s"] = time.time() - t0
    ms, ms_pipe, st, out = time_steps(step, st, lambda i: inputs[i % len(inputs)], steps)
    res["rows"]["mixed_step_pipelined"] = dict(ms=ms_pipe, floor_ms=res["floor_mixed_ms"],
                                               x_floor=ms_pipe / res["floor_mixed_ms"])
    res["rows"]["mixed_step"] = dict(ms=ms, floor_ms=res["floor_mixed_ms"], x_floor=ms / res["floor_mixed_ms"],
                                     finite=bool(jnp.isfinite(out.astype(jnp.float32)).all()),
                                     error=int(st.error) if getattr(st.error, "ndim", 1) == 0 else None)
    print(f"mixed: step {ms:.3f} ms blocking, {ms_pipe:.3f} ms pipelined ({time.time() - t0:.0f}s)", flush=True)
    if args.profile:
        box = [st]

        def run_mixed(i):
            box[0], o = step(box[0], *inputs[i % len(inputs)])
            return o
        res["profile_mixed"] = gpu_kernel_profile(run_mixed, 3, tempfile.mkdtemp(prefix="trace_mixed"))
        _print_profile("mixed step", res["profile_mixed"])
        st = box[0]
    if time.time() - t0 < args.attn_only_after_s:     # attention alone (second compile of the 32 layers)
        fa = jax.jit(attn_only)
        jax.block_until_ready(fa(st, inputs[0][0]))
        ts = []
        for i in range(steps):
            t1 = time.perf_counter()
            jax.block_until_ready(fa(st, inputs[i % len(inputs)][0]))
            ts.append((time.perf_counter() - t1) * 1e3)
        res["rows"]["mixed_attention_only"] = dict(ms=float(np.median(ts)), floor_ms=res["floor_mixed_ms"])
        res["rows"]["mixed_append_only_derived"] = dict(ms=ms - float(np.median(ts)))
        print(f"mixed attention only {np.median(ts):.3f} ms ({time.time() - t0:.0f}s)", flush=True)
        # the all-layer append alone, donated (its device time is ~50 us; a larger step-minus-attention figure
        # means the two interact, e.g. a pool copy XLA inserts in the fused step)
        fapp = jax.jit(lambda s_, kn, vn: jm.append(s_, layer=None, k=kn, v=vn, seq_slots=slots,
                                                    positions=s_.kv_lens, backend=backend), donate_argnums=0)
        st = fapp(st, *inputs[0][1:])
        jax.block_until_ready(st)
        ts = []
        for i in range(steps):
            t1 = time.perf_counter()
            st = fapp(st, *inputs[i % len(inputs)][1:])
            jax.block_until_ready(st)
            ts.append((time.perf_counter() - t1) * 1e3)
        res["rows"]["mixed_append_only"] = dict(ms=float(np.median(ts)))
        print(f"mixed append only {np.median(ts):.3f} ms ({time.time() - t0:.0f}s)", flush=True)
    del st, step

    # ---- bf16 contiguous cache + cuDNN
    if not args.skip_bf16:
        s_max = ctx + 2 * steps + 16
        # one [B, S_max, H, D] array per layer and K / V (a stacked [L, ...] cache makes XLA copy each layer's
        # slice for the cuDNN call: 32 x 1 GiB of temporaries, out of memory at 64 x 8k)
        shape = (batch, s_max, H, D)

        def fresh():
            return ([tiled(jax.random.fold_in(jax.random.PRNGKey(5), i), shape=shape, axis=1, kind="bf16")
                     for i in range(layers)],
                    [tiled(jax.random.fold_in(jax.random.PRNGKey(6), i), shape=shape, axis=1, kind="bf16")
                     for i in range(layers)], jnp.full((batch,), ctx, jnp.int32))

        def bf16_step(carry, q, kn, vn, padded=True):
            kc, vc, lens = carry
            bi = jnp.arange(batch)
            kc = [c.at[bi, lens].set(kn[i]) for i, c in enumerate(kc)]
            vc = [c.at[bi, lens].set(vn[i]) for i, c in enumerate(vc)]
            lens = lens + 1
            outs = [jax.nn.dot_product_attention(q[i], kc[i], vc[i], key_value_seq_lengths=lens if padded else None,
                                                 implementation=impl if impl == "cudnn" else None)
                    for i in range(layers)]
            return (kc, vc, lens), jnp.stack(outs)
        for padded, name in ((True, "bf16_cudnn_step"), (False, "bf16_cudnn_step_nomask")):
            t1 = time.time()
            try:
                step = jax.jit(functools.partial(bf16_step, padded=padded), donate_argnums=0)
                carry, out = step(fresh(), *inputs[0])
                jax.block_until_ready(out)
                ms, ms_pipe, carry, out = time_steps(step, carry, lambda i: inputs[i % len(inputs)], steps)
                res["rows"][name + "_pipelined"] = dict(ms=ms_pipe, floor_ms=res["floor_bf16_ms"],
                                                        x_floor=ms_pipe / res["floor_bf16_ms"])
                if args.profile:
                    box = [carry]

                    def run_bf16(i, step=step, box=box):
                        box[0], o = step(box[0], *inputs[i % len(inputs)])
                        return o
                    res["profile_bf16"] = gpu_kernel_profile(run_bf16, 3, tempfile.mkdtemp(prefix="trace_bf16"))
                    _print_profile("bf16 step", res["profile_bf16"])
                    carry = box[0]
                res["rows"][name] = dict(ms=ms, floor_ms=res["floor_bf16_ms"], x_floor=ms / res["floor_bf16_ms"],
                                         compile_s=time.time() - t1, impl=impl, padding_mask=padded)
                print(f"{name} ({impl}): step {ms:.3f} ms blocking, {ms_pipe:.3f} ms pipelined", flush=True)
                del carry
                break
            except Exception as e:  # no padding mask: every cache row (S_max = ctx + STEPS + 16) is read
                res["rows"][name] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
                print(f"{name} failed:", res["rows"][name]["error"], flush=True)
    r = res["rows"]
    for k in ("bf16_cudnn_step", "bf16_cudnn_step_nomask"):
        if "ms" in r.get(k, {}):
            res["speedup_mixed_vs_bf16"] = r[k]["ms"] / r["mixed_step"]["ms"]
            res["speedup_mixed_vs_bf16_pipelined"] = r[k + "_pipelined"]["ms"] / r["mixed_step_pipelined"]["ms"]
    lines = [f"decode step, {layers} layers, batch {batch} x {ctx}, {H} KV / {HQ} q heads, D {D}, page {page} "
             f"({res['device']}, jax {res['jax']}, triton {res['triton']}, copy {bw:.2f} TB/s)",
             f"{'path':>28} {'ms':>8} {'floor ms':>9} {'x floor':>8}"]
    for k, v in r.items():
        if "ms" in v:
            fl = v.get("floor_ms")
            lines.append(f"{k:>28} {v['ms']:8.3f} {fl if fl else float('nan'):9.3f} "
                         f"{v['ms'] / fl if fl else float('nan'):8.2f}")
    if "speedup_mixed_vs_bf16" in res:
        lines.append(f"bf16 + cuDNN step / mixed step = {res['speedup_mixed_vs_bf16']:.2f} blocking, "
                     f"{res['speedup_mixed_vs_bf16_pipelined']:.2f} pipelined")
    text = "\n".join(lines)
    print(text)
    res["table"] = text
    with open(os.path.join(args.out, "step_bench.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
