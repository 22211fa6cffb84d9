"""Where a layer's host time goes in the torch bridge's hot path (`TorchKVCache.plan_step` + `step_attend` under
``sync="stream"``), split into its parts, beside the floors of trivial jitted programs with the same arguments.

SmolLM2's cache geometry (30 layers, 3 KV / 9 query heads, head_dim 64), batch 4 x 512 tokens, mixed (4, 64),
page 16. Prints and writes (``--out``, a folder: ``bridge_parts.json``) microseconds per call as ``[host, wall]``:
the host time of a loop of calls without a wait, and the time until the device is done. Rows:

* ``loop_per_layer``: one decode step (plan + 30 ``step_attend`` calls) divided by the layers; ``_*`` variants: the
  layer program compiled with XLA's command buffers off, the plan without its read of the device error bits, every
  layer's output handed to torch at the end of the step;
* ``plan_step``: the step's plan alone; ``plan_program``: its jitted program alone (no host checks, no error read);
* ``cross_*``: the crossings (`interop.dlpack.HotBridge`, its parts, and `from_torch` / ``jax.dlpack`` beside it);
* ``program_*``: one layer's `jmixedkv.step.layer_attend` (default compile; its layer argument cycling over every
  layer as in a step; with XLA's command buffers (CUDA graphs) off, or on for every kernel type);
* ``floor_*``: trivial programs: the layer's own arguments with ``mine`` donated and returned, ``mine`` alone, one
  array, 29 small int arrays;
* the compiled layer program's entry fusions / custom calls / parameters.

``--kernels``: also the device kernels and the host's CUDA API calls (launches, copies, synchronizations) of one
decode step and of one plan (``torch.profiler``, which records those of the whole process, JAX's included), under
``device_kernels`` / ``plan_kernels``.

``--smoke``: 2 layers, 16 tokens, on the CPU (a script check; the CPU runs the reference kernels, so its
``program_*`` rows are compute, not dispatch).
"""
import json
import os
import re
import sys
import time
from unittest import mock

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from common import bench_parser, versions, write_json  # noqa: E402
from interop.dlpack import from_torch, to_torch  # noqa: E402
from interop.torch_cache import TorchKVCache  # noqa: E402
from jmixedkv import KVCacheConfig, compat, step  # noqa: E402

HEADS, Q_HEADS, HEAD_DIM, BATCH, PAGE = 3, 9, 64, 4, 16
COMMAND_BUFFERS = {"command_buffers_off": {"xla_gpu_enable_command_buffer": ""},
                   "command_buffers_every_kind": {"xla_gpu_enable_command_buffer":
                                                  "FUSION,CUSTOM_CALL,CUBLAS,CUBLASLT,DYNAMIC_SLICE_FUSION",
                                                  "xla_gpu_graph_min_graph_size": 1}}


def main(argv=None):
    ap = bench_parser(__doc__, md=False)
    ap.add_argument("--kernels", action="store_true", help="also profile one decode step's device kernels")
    args = ap.parse_args(argv)
    layers, ctx, reps = (2, 16, 5) if args.smoke else (30, 512, 300)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = KVCacheConfig("mixed_nvfp4_bf16", first_n=4, last_n=64, page_size=PAGE, max_draft_len=4)
    pages = (ctx + 448) // PAGE + 1                 # room for every timed step's token
    cache = TorchKVCache(cfg, layers, HEADS, HEAD_DIM, num_pages=BATCH * pages, max_seqs=BATCH,
                         max_pages_per_seq=pages, device=dev, sync="stream", validate=False)
    slots = np.array([cache.admit() for _ in range(BATCH)], np.int32)
    plan = cache.plan_step(np.repeat(slots, ctx), np.tile(np.arange(ctx, dtype=np.int32), BATCH), slots)
    kv = torch.randn(BATCH, 2 * HEADS, ctx, HEAD_DIM, dtype=torch.bfloat16, device=dev)
    for layer in range(layers):
        cache.step_append(layer, kv, None, plan)
    kvq = torch.randn(BATCH, 2 * HEADS + Q_HEADS, 1, HEAD_DIM, dtype=torch.bfloat16, device=dev)

    def wait():
        if dev.type == "cuda":
            torch.cuda.synchronize()
        jax.block_until_ready(cache.state.kv_lens)

    def timed(fn, n=reps):
        fn()
        wait()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        host = time.perf_counter() - t
        wait()
        return [round(host / n * 1e6, 1), round((time.perf_counter() - t) / n * 1e6, 1)]

    def plan_next():
        return cache.plan_step(slots, np.full(BATCH, cache.manager.kv_len(int(slots[0])), np.int32), slots)

    def decode_step():
        p = plan_next()
        for layer in range(layers):
            cache.step_attend(layer, kvq, None, None, p, return_lse=False)

    res = dict(versions(torch), device=str(jax.devices()[0]), layers=layers, context=ctx, batch=BATCH)
    step_us = timed(decode_step, max(3, reps // 30))
    res["loop_per_layer"] = [round(x / layers, 1) for x in step_us]
    res.update(_loop_variants(cache, decode_step, timed, layers, max(3, reps // 30), plan_next, kvq))
    res["plan_step"] = timed(plan_next, max(5, reps // 6))
    res.update(_plan_program(cache, slots, timed, max(5, reps // 6)))
    if args.kernels:
        res["device_kernels"] = _kernels(decode_step, wait, dev)
        res["plan_kernels"] = _kernels(plan_next, wait, dev)
    res.update(_crossings(cache, kvq, dev, timed))
    res.update(_programs(cache, kvq, plan_next(), timed))
    print(json.dumps(res, indent=1))
    print("wrote", write_json(args.out, "bridge_parts.json", res))
    return 0


def _loop_variants(cache, decode_step, timed, layers, n, plan_next, kvq):
    """The decode step with its layer program compiled with XLA's command buffers off; with `plan_step`'s read of
    the device error bits (a wait for the device, once per step) skipped; and with every layer's output handed to
    torch at the end of the step instead of after its layer (`HotBridge.to_torch` makes torch's stream wait for the
    array, and the host may wait until JAX has launched the program that makes it)."""
    def exports_at_end():
        p, outs = plan_next(), []
        for layer in range(layers):
            outs.append(cache.step_attend(layer, kvq, None, None, p, return_lse=False)[0])
        for o in outs:
            cache._hot.to_torch(o)

    static = ("num_kv_heads", "group", "rope", "backend", "sm_scale", "sliding_window", "soft_cap")
    off = jax.jit(step.layer_attend.__wrapped__, donate_argnums=1, static_argnames=static,
                  compiler_options=COMMAND_BUFFERS["command_buffers_off"])
    variants = {"exports_at_end": (cache, "_out", lambda sync: (lambda x: x), exports_at_end),
                "command_buffers_off": (step, "layer_attend", off, decode_step),
                "no_error_read": (cache, "_raise_device_error", lambda what: None, decode_step)}
    res = {}
    for name, (owner, attr, value, fn) in variants.items():
        with mock.patch.object(owner, attr, value):
            res["loop_per_layer_" + name] = [round(x / layers, 1) for x in timed(fn, n)]
    return res


def _plan_program(cache, slots, timed, n):
    """`jmixedkv.step.plan_append_packed` alone on one decode step's tokens (each call donates the tables the
    last one returned): ``plan_program`` with the tokens as the NumPy array `TorchKVCache.plan_step` passes,
    ``plan_program_device_tokens`` with them put on the device first (``jax.device_put``, timed with the call)."""
    def call(put):
        seq, pos = cache.manager.reserve_append(slots, np.full(BATCH, cache.manager.kv_len(int(slots[0])), np.int32))
        tokens = put(np.concatenate([seq, pos, slots]).astype(np.int32))
        state, _, _ = step.plan_append_packed(cache.state, tokens, num_rows=BATCH)
        cache.manager.install(state)
    return {"plan_program": timed(lambda: call(lambda x: x), n),
            "plan_program_device_tokens": timed(lambda: call(jax.device_put), n)}


def _kernels(fn, wait, dev, top: int = 12):
    """One call of ``fn`` under ``torch.profiler`` (CUPTI records every kernel and CUDA API call of the process,
    JAX's included): the device kernels (count, busy and span microseconds, the top ones) and the host's CUDA API
    calls (``cu*``: launches, copies, synchronizations; count and microseconds)."""
    if dev.type != "cuda":
        return "no CUDA device"
    from torch.profiler import ProfilerActivity, profile
    fn()
    wait()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        wait()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    api = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("cu")]
    span = (max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)) if kernels else 0
    ktimes, atimes = _by_name(kernels, lambda e: e.device_time_total), \
        _by_name(api, lambda e: e.cpu_time_total)
    return {"count": sum(t[0] for t in ktimes.values()), "busy_us": round(sum(t[1] for t in ktimes.values()), 1),
            "span_us": round(span, 1), "top": _top(ktimes, top), "api_calls": _top(atimes, top)}


def _by_name(events, micros):
    times = {}
    for e in events:
        t = times.setdefault(e.name[:90], [0, 0.0])
        t[0] += 1
        t[1] += micros(e)
    return times


def _top(times, n):
    return sorted(([k, v[0], round(v[1], 1)] for k, v in times.items()), key=lambda r: -r[2])[:n]


def _crossings(cache, kvq, dev, timed):
    hot, jdev = cache._hot, next(iter(cache.state.kv_lens.devices()))
    kind = 2 if dev.type == "cuda" else 1                                      # kDLCUDA / kDLCPU
    out = jnp.zeros((BATCH, 1, Q_HEADS, HEAD_DIM), jnp.bfloat16)
    stream = (torch.cuda.current_stream(dev).cuda_stream or 1) if dev.type == "cuda" else None

    def event():
        if dev.type == "cuda":
            hot._event.record(torch.cuda.current_stream(dev))
            hot._jax_stream.wait_event(hot._event)
    return {"cross_hot_to_jax": timed(lambda: hot.to_jax(kvq)),
            "cross_hot_to_jax_event_only": timed(event),
            "cross_import_with_stream": timed(lambda: compat.dlpack_import(torch._C._to_dlpack(kvq), jdev,
                                                                           hot.stream, kind)),
            "cross_import_without_stream": timed(lambda: compat.dlpack_import(torch._C._to_dlpack(kvq), jdev, None,
                                                                              kind)),
            "cross_from_torch": timed(lambda: from_torch(kvq, copy=None, sync="stream")),
            "cross_jax_dlpack_from_dlpack": timed(lambda: jax.dlpack.from_dlpack(kvq)),
            "cross_hot_to_torch": timed(lambda: hot.to_torch(out)),
            "cross_to_torch": timed(lambda: to_torch(out, sync="stream", check=False))}


def _programs(cache, kvq, plan, timed):
    kj, layer = cache._hot.to_jax(kvq), cache._layer_id(0, plan)
    rest, _ = step.split_layer_state(cache.state, 0)
    opts = dict(num_kv_heads=HEADS, group=0, backend="auto", sm_scale=None, sliding_window=None, soft_cap=None)
    args = (layer, kj, None, None, plan.append, plan.rows, None)

    def run(program):
        def call():
            mine, *_ = program(rest, step.layer_part(cache.state, 0), *args)
            cache.manager.install(step.join_layer_state(rest, mine, 0))
        return call
    res = {"program_layer_attend": timed(run(lambda *a: step.layer_attend(*a, **opts)))}
    # the same program, the layer argument cycling over every layer's device scalar as in a decode step (XLA
    # re-records a program's command buffer when an argument's address differs from the last call's)
    ids, turn = [cache._layer_id(i, plan) for i in range(cache.state.groups[0].num_layers)], [0]

    def cycling(rest_, mine, _layer, *a):
        turn[0] += 1
        return step.layer_attend(rest_, mine, ids[turn[0] % len(ids)], *a, **opts)
    res["program_layer_attend_cycling_layers"] = timed(run(cycling))
    lowered = step.layer_attend.lower(rest, step.layer_part(cache.state, 0), *args, **opts)
    for name, options in COMMAND_BUFFERS.items():
        try:
            res["program_layer_attend_" + name] = timed(run(lowered.compile(compiler_options=options)))
        except Exception as e:                                                # an XLA without these options
            res["program_layer_attend_" + name] = f"{type(e).__name__}: {str(e)[:200]}"
    same = jax.jit(lambda r, m, *a: (m, a[1][:, :1] * 2), donate_argnums=1)    # the layer's own arguments
    mine_only = jax.jit(lambda m, k: (m, k[:, :1] * 2), donate_argnums=0)
    res["floor_same_arguments"] = timed(run(same))
    res["floor_mine_only"] = timed(run(lambda r, m, *a: mine_only(m, kj)))
    one = jax.jit(lambda x: x[:, :1] * 2)
    res["floor_one_array"] = timed(lambda: one(kj))
    small, first = [jnp.zeros((BATCH,), jnp.int32) + i for i in range(29)], jax.jit(lambda xs: xs[0] + 1)
    res["floor_29_int_arrays"] = timed(lambda: first(small))
    entry = lowered.compile().as_text()
    entry = entry[entry.find("ENTRY"):]
    res["entry_fusions"] = len(re.findall(r"= .*? fusion\(", entry))
    res["entry_custom_calls"] = len(re.findall(r"custom-call\(", entry))
    res["entry_parameters"] = len(re.findall(r"parameter\(", entry))
    return res


if __name__ == "__main__":
    sys.exit(main())
