"""A whole decode step on the GPU: every layer's attention + the all-layer append, mixed NVFP4 vs bf16 + cuDNN.

    PYTHONPATH=. python3 bench/step_bench.py --profile --out DIR   # GPU (``--page 32``: KVCacheConfig's default)
    PYTHONPATH=. python3 bench/step_bench.py --levers --out DIR    # GPU: + the recommended levers' cost
    PYTHONPATH=. python3 bench/step_bench.py --smoke --out DIR     # CPU: tiny shapes, reference backend, XLA SDPA

The step (`shapes.STEP`: Llama-3-8B attention, batch 64 x 8k) in one jit, the cache donated: ``mixed`` is
``jm.append`` of every layer's rows, then ``jm.decode_attention`` per layer over random mixed pools; ``bf16`` a
scatter into contiguous bf16 caches, then cuDNN ``jax.nn.dot_product_attention`` per layer (``key_value_seq_lengths``;
without, if cuDNN refuses). Timed blocked and pipelined, and the mixed attention alone; ``--profile`` adds GPU time
per kernel and idle time. Floors: K + V bytes / the in-run copy bandwidth. Writes ``DIR/step_bench.json``.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import sys  # noqa: E402
import tempfile  # noqa: E402

from common import (bench_parser, copy_bandwidth, error_text, gpu_kernel_profile, kv_bytes, no_gpu,  # noqa: E402
                    random_fill, random_mixed_state, time_each, time_threaded, versions, write_json)
from shapes import STEP, STEP_SMOKE  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jmixedkv as jm  # noqa: E402
from jmixedkv.compat import on_gpu  # noqa: E402

#: the accuracy levers of `jmixedkv.KVCacheConfig.recommended` (its window aside), then with K smoothing: what
#: ``--levers`` costs
LEVERS = dict(rotation="hadamard", block_scale="4over6")
LEVER_SETS = (("mixed_levers", LEVERS), ("mixed_levers_smooth", dict(LEVERS, k_smoothing=True)))


def step_inputs(s):
    """``(q [L, B, 1, Hq, D], k, v [L, B, H, D])`` bf16: one step's queries and new K/V rows of every layer."""
    key = jax.random.PRNGKey(1)
    def rand(i, shape):
        return jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32).astype(jnp.bfloat16)
    lb = (s["layers"], s["batch"])
    return (rand(0, lb + (1, s["q_heads"], s["head_dim"])), rand(1, lb + (s["kv_heads"], s["head_dim"])),
            rand(2, lb + (s["kv_heads"], s["head_dim"])))


def mixed_step_fns(s, backend):
    """Jitted ``(step(state, q, k, v) -> (state, out), attention_only(state, q) -> out, append_only(state, k, v)
    -> state)`` of the mixed cache (``step`` and ``append_only`` donate the state)."""
    slots = jnp.arange(s["batch"], dtype=jnp.int32)
    attend_backend = "reference" if backend == "reference" else "pallas"

    def attention(state, q):
        return jnp.stack([jm.decode_attention(state, layer, q[layer], slots, backend=attend_backend)[0]
                          for layer in range(s["layers"])])

    def append(state, k, v):
        return jm.append(state, None, k, v, slots, state.kv_lens, backend=backend)

    def step(state, q, k, v):
        state = append(state, k, v)
        return state, attention(state, q)
    return jax.jit(step, donate_argnums=0), jax.jit(attention), jax.jit(append, donate_argnums=0)


def bf16_step_fn(s, padded, impl):
    """Jitted ``step((k caches, v caches, lens), q, k, v) -> (carry, out)`` over contiguous bf16 caches."""
    def step(carry, q, kn, vn):
        kc, vc, lens = carry
        bi = jnp.arange(s["batch"])
        kc = [c.at[bi, lens].set(kn[i]) for i, c in enumerate(kc)]
        vc = [c.at[bi, lens].set(vn[i]) for i, c in enumerate(vc)]
        lens = lens + 1
        outs = [jax.nn.dot_product_attention(q[i], kc[i], vc[i], key_value_seq_lengths=lens if padded else None,
                                             implementation=impl) for i in range(s["layers"])]
        return (kc, vc, lens), jnp.stack(outs)
    return jax.jit(step, donate_argnums=0)


def bf16_caches(s):
    """One ``[B, S_max, H, D]`` bf16 array per layer and K / V (a stacked ``[L, ...]`` cache makes XLA copy each
    layer's slice for the cuDNN call: out of memory at 64 x 8k), and the lengths."""
    shape = (s["batch"], s["context"] + 4 * s["steps"] + 16, s["kv_heads"], s["head_dim"])
    k, v = random_fill(5, shape, "bf16"), random_fill(6, shape, "bf16")     # every layer a copy of the same rows
    return ([k.copy() for _ in range(s["layers"])], [v.copy() for _ in range(s["layers"])],
            jnp.full((s["batch"],), s["context"], jnp.int32))


def time_step(name, step, carry, inputs, s, floor_ms, profile):
    """Rows ``name`` (blocking) and ``name_pipelined`` of a donating ``step``; its profile when asked."""
    run = lambda c, *a: step(c[0], *a)  # noqa: E731    (carry = (state, last output))
    carry = step(carry, *inputs)
    ms, carry = time_threaded(run, carry, *inputs, reps=1, trials=s["steps"], warmup=0)
    ms_pipe, carry = time_threaded(run, carry, *inputs, reps=s["steps"], trials=1, warmup=0)
    rows = {name: dict(ms=ms, floor_ms=floor_ms), name + "_pipelined": dict(ms=ms_pipe, floor_ms=floor_ms)}
    print(f"{name}: {ms:.3f} ms blocking, {ms_pipe:.3f} ms pipelined", flush=True)
    prof = None
    if profile:
        box = [carry]

        def one(i):
            box[0] = run(box[0], *inputs)
            return box[0][1]
        prof = gpu_kernel_profile(one, 3, tempfile.mkdtemp(prefix="trace_step"))
        print(f"  GPU busy {prof['busy_us_per_step'] / 1e3:.3f} ms per step, idle inside "
              f"{prof['idle_inside_us_per_step'] / 1e3:.3f} ms, between steps "
              f"{prof['idle_between_us_per_step'] / 1e3:.3f} ms, {prof['kernel_launches_per_step']:.0f} kernels")
        for k in prof["kernels"]:
            print(f"   {k['us']:10.1f} us  x{k['calls']:5.1f}  {k['name'][:110]}")
        carry = box[0]
    return rows, prof, carry


def main(argv=None):
    ap = bench_parser(__doc__, out=".", md=False)
    ap.add_argument("--skip-bf16", action="store_true")
    ap.add_argument("--profile", action="store_true", help="jax profiler trace of 3 steps per path")
    ap.add_argument("--levers", action="store_true", help="also the mixed step with recommended()'s levers (Hadamard "
                    "rotation, 4over6), then with K smoothing too: their cost in the append and in the decode")
    ap.add_argument("--page", type=int, default=STEP["page"], help="tokens per page of the mixed cache")
    args = ap.parse_args(argv)
    if no_gpu("step_bench", args.smoke):
        return 0
    s = dict(STEP_SMOKE if args.smoke else STEP, page=args.page)
    backend, impl = ("reference", "xla") if not on_gpu() else ("auto", "cudnn")
    bw = copy_bandwidth(not on_gpu())[0]
    rows, twin = s["layers"] * s["batch"] * s["context"], s["layers"] * s["batch"] * (s["first_n"] + s["last_n"])
    floor = dict(mixed=kv_bytes(rows, s["kv_heads"], s["head_dim"], "nvfp4", twin) / bw / 1e9,
                 bf16=kv_bytes(rows, s["kv_heads"], s["head_dim"], "bf16") / bw / 1e9)
    res = dict(versions(), shape=s, copy_bandwidth_tbs=bw, floor_ms=floor, rows={})
    inputs = step_inputs(s)

    step, attention, append = mixed_step_fns(s, backend)
    for name, levers in (("mixed", {}),) + (LEVER_SETS if args.levers else ()):
        cfg = jm.KVCacheConfig("mixed_nvfp4_bf16", first_n=s["first_n"], last_n=s["last_n"], page_size=s["page"],
                               **levers)
        state = random_mixed_state(cfg, jm.GroupSpec(s["layers"], s["kv_heads"], s["head_dim"]), s["batch"],
                                   s["context"], spare_pages=5)
        rows, res["profile_" + name], (state, _) = time_step(name + "_step", step, state, inputs, s, floor["mixed"],
                                                             args.profile)
        res["rows"].update(rows)
        res["rows"][name + "_step"]["error"] = int(state.error)
        res["rows"][name + "_attention_only"] = dict(ms=time_each(attention, state, inputs[0], iters=s["steps"]),
                                                     floor_ms=floor["mixed"])
        ms, state = time_threaded(append, state, *inputs[1:], reps=4, trials=3, warmup=1)
        res["rows"][name + "_append_only"] = dict(ms=ms, floor_ms=floor["mixed"], error=int(state.error))
        del state
    for padded in ((True, False) if not args.skip_bf16 else ()):
        name = "bf16_cudnn_step" + ("" if padded else "_nomask")
        try:
            rows, res["profile_bf16"], _ = time_step(name, bf16_step_fn(s, padded, impl), bf16_caches(s), inputs, s,
                                                     floor["bf16"], args.profile)
            res["rows"].update(rows)
            break
        except Exception as e:  # without the padding mask every cache row (S_max) is read
            res["rows"][name] = dict(error=error_text(e))
            print(f"{name} failed: {res['rows'][name]['error']}", flush=True)
    lines = [f"decode step, {s['layers']} layers, batch {s['batch']} x {s['context']}, {s['kv_heads']} KV / "
             f"{s['q_heads']} q heads, D {s['head_dim']}, page {s['page']} ({res['device']}, jax {res['jax']}, "
             f"triton {res['triton']}, copy {bw:.2f} TB/s)", f"{'path':>36} {'ms':>8} {'floor ms':>9} {'x floor':>8}"]
    lines += [f"{k:>36} {v['ms']:8.3f} {v['floor_ms']:9.3f} {v['ms'] / v['floor_ms']:8.2f}"
              for k, v in res["rows"].items() if "ms" in v]
    r = res["rows"]
    for mode in ("", "_pipelined"):
        for bf in ("bf16_cudnn_step", "bf16_cudnn_step_nomask"):
            if "ms" in r.get(bf + mode, {}):
                res["speedup_mixed_vs_bf16" + mode] = r[bf + mode]["ms"] / r["mixed_step" + mode]["ms"]
                ratio = res["speedup_mixed_vs_bf16" + mode]
                lines.append(f"bf16 step / mixed step{mode.replace('_', ' ')}: {ratio:.2f}")
    for name, _ in LEVER_SETS if args.levers else ():
        for what in ("step", "step_pipelined", "attention_only", "append_only"):
            res[f"{name}_over_plain_{what}"] = ratio = r[f"{name}_{what}"]["ms"] / r[f"mixed_{what}"]["ms"]
            lines.append(f"{name} / plain, {what.replace('_', ' ')}: {ratio:.3f}")
    print("\n".join(lines))
    write_json(args.out, "step_bench.json", dict(res, table="\n".join(lines)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
