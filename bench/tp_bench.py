"""Tensor-parallel decode attention: 1 GPU vs N GPUs (KV heads sharded with jax.shard_map), same batch and context.

    PYTHONPATH=. python3 bench/tp_bench.py --out DIR          # 2 GPUs (+ the whole decode step unless --no-step)
    python bench/tp_bench.py --smoke --no-md --out /tmp/tp    # CPU: tiny sizes, reference backend, 2 host devices

Per batch (`shapes.TP`, then its batch sweep unless ``--no-sweep``), the default kernel: the sharded output checked
bit-equal to one device's, then both timed pipelined (``ms``, q head-sharded) and blocked per call, and the
per-shard problem alone on one device (the ideal); the sharded program's collectives counted (expected: none).
Writes ``DIR/tp_bench.json``; on a GPU without ``--no-md`` a section of bench/RESULTS.md.
"""
from __future__ import annotations

import dataclasses
import os
import re
import sys

from common import (append_results, bench_parser, bits_equal, error_text, md_table, no_gpu, random_fill,
                    random_mixed_state, time_each, time_jax, time_threaded, versions, write_json)
from shapes import STEP, STEP_SMOKE, TP, TP_SMOKE

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import jmixedkv as jm
from jmixedkv import sharding
from jmixedkv.decode import decode_attention

#: HLO ops that move data between devices
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all",
               "collective-broadcast", "ragged-all-to-all", "copy-start", "send", "recv")


def head_slice(state, lo, hi, tp):
    """KV heads ``lo:hi`` of every pool (axis 3 of the 6-D pool arrays) as a state of ``num_kv_heads // tp``."""
    pools = jax.tree.map(lambda x: x[:, :, :, lo:hi] if getattr(x, "ndim", 0) == 6 else x, state.pools)
    return sharding.local_view(dataclasses.replace(state, pools=pools), tp)


def collectives(fn, *args):
    """Collective / cross-device ops in the compiled HLO of ``fn(*args)``: ``{op: count}``."""
    ops = re.findall(r"(?<=\s)([a-z][a-z0-9\-]*)\(", fn.lower(*args).compile().as_text())
    return {op: ops.count(op) for op in sorted(set(ops)) if any(op.startswith(c) for c in COLLECTIVES)}


def measure(shape, batch, tp, backend, timing):
    """One batch: bit-equality of the N-device output to the 1-device one, then both timed (and the shard alone)."""
    cfg = jm.KVCacheConfig("mixed_nvfp4_bf16", first_n=shape["first_n"], last_n=shape["last_n"],
                           page_size=shape["page"])
    hkv, hq, d = shape["kv_heads"], shape["q_heads"], shape["head_dim"]
    state = random_mixed_state(cfg, jm.GroupSpec(1, hkv, d), batch, shape["context"], seed=batch)
    q = jax.random.normal(jax.random.PRNGKey(batch), (batch, 1, hq, d), jnp.float32).astype(jnp.bfloat16)
    seq = jnp.arange(batch, dtype=jnp.int32)
    dev0 = jax.devices()[0]
    one = jax.jit(lambda st, q_, s_: decode_attention(st, 0, q_, s_, backend=backend))
    mesh = sharding.make_mesh(tp)
    sharded = jax.jit(lambda st, q_, s_: sharding.sharded_decode_attention(mesh, st, 0, q_, s_, backend=backend))
    a1 = jax.device_put((state, q, seq), dev0)
    an = (sharding.shard_state(state, mesh), jax.device_put(q, NamedSharding(mesh, P(None, None, sharding.AXIS))),
          jax.device_put(seq, NamedSharding(mesh, P())))
    alone = jax.device_put((head_slice(state, 0, hkv // tp, tp), q[:, :, :hq // tp], seq), dev0)
    del state
    row = dict(batch=batch, bit_equal=bits_equal(one(*a1), sharded(*an)),
               collectives=collectives(sharded, *an))
    for name, fn, args in (("single", one, a1), ("sharded", sharded, an)):
        row[f"{name}_ms"] = time_jax(fn, *args, reps=timing["reps"], trials=timing["trials"])
        row[f"{name}_blocking_ms"] = time_each(fn, *args, iters=timing["iters"])
    shard_alone = jax.jit(lambda st, q_, s_: decode_attention(st, 0, q_, s_, backend=backend, split_heads=hkv))
    row["alone_ms"] = time_each(shard_alone, *alone, iters=timing["iters"])    # as a shard splits
    row.update(speedup=row["single_ms"] / row["sharded_ms"],
               speedup_blocking=row["single_blocking_ms"] / row["sharded_blocking_ms"],
               ideal_speedup=row["single_blocking_ms"] / row["alone_ms"])
    return row


def measure_step(shape, tp, backend, timing):
    """The whole decode step (`shapes.STEP`: every layer's append, then every layer's decode, the state donated), 1
    device vs ``tp`` devices: outputs and the written pools compared bitwise, both timed pipelined."""
    layers, batch, hkv, hq, d = (shape[k] for k in ("layers", "batch", "kv_heads", "q_heads", "head_dim"))
    cfg = jm.KVCacheConfig("mixed_nvfp4_bf16", first_n=shape["first_n"], last_n=shape["last_n"],
                           page_size=shape["page"])
    spec = jm.GroupSpec(layers, hkv, d)
    q = random_fill(7, (layers, batch, 1, hq, d), "bf16")
    k, v = (random_fill(i, (layers, batch, hkv, d), "bf16") for i in (8, 9))
    slots = jnp.arange(batch, dtype=jnp.int32)
    mesh = sharding.make_mesh(tp)

    def step(append, attend):
        def run(st, q_, k_, v_):
            st = append(st, None, k_, v_, slots, st.kv_lens)
            return st, jnp.stack([attend(st, layer, q_[layer], slots)[0] for layer in range(layers)])
        return jax.jit(run, donate_argnums=0)
    one = step(lambda *a: jm.append(*a, backend=backend),
               lambda *a: decode_attention(*a, backend=backend))
    sharded = step(lambda st, *a: sharding.sharded_append(mesh, st, *a, backend=backend),
                   lambda st, *a: sharding.sharded_decode_attention(mesh, st, *a, backend=backend))
    qs = jax.device_put(q, NamedSharding(mesh, P(None, None, None, sharding.AXIS)))
    ks, vs = (jax.device_put(x, NamedSharding(mesh, P(None, None, sharding.AXIS))) for x in (k, v))
    steps = shape["steps"]                                   # timed steps: each appends one token per sequence
    spare = -(-(steps + 1) // shape["page"]) + 1
    row = dict(layers=layers, batch=batch, context=shape["context"], steps=steps)
    results = {}
    for name, fn, make, args in (("single", one, lambda: random_mixed_state(cfg, spec, batch, shape["context"],
                                                                            spare_pages=spare), (q, k, v)),
                                 ("sharded", sharded, lambda: sharding.shard_state(random_mixed_state(
                                     cfg, spec, batch, shape["context"], spare_pages=spare), mesh), (qs, ks, vs))):
        st, out = fn(make(), *args)
        results[name] = jax.tree.map(jnp.copy, (out, st.pools))     # a device copy (the timing donates `st`)
        run = lambda c, *a: fn(c[0], *a)  # noqa: E731
        row[f"{name}_ms"], (st, out) = time_threaded(run, (st, out), *args, reps=steps, trials=1, warmup=0)
        row[f"{name}_error"] = int(st.error)                 # 0: every timed append had its pages
        del st, out
    row.update(bit_equal=bits_equal(results["single"], results["sharded"]),
               speedup=row["single_ms"] / row["sharded_ms"])
    print(f"whole step: {row}", flush=True)
    return row


def table(rows, tp):
    return md_table(("batch", "1 device ms", f"{tp} devices ms", "speed-up", "1 device blocking ms",
                     f"{tp} devices blocking ms", "blocking speed-up", "heads / N alone ms", "ideal speed-up",
                     "bit-equal", "collectives"),
                    [(r["batch"], f"{r['single_ms']:.3f}", f"{r['sharded_ms']:.3f}",
                      f"{r['speedup']:.2f}x", f"{r['single_blocking_ms']:.3f}", f"{r['sharded_blocking_ms']:.3f}",
                      f"{r['speedup_blocking']:.2f}x", f"{r['alone_ms']:.3f}", f"{r['ideal_speedup']:.2f}x",
                      r["bit_equal"], sum(r["collectives"].values())) for r in rows])


def main(argv=None):
    ap = bench_parser(__doc__, out="bench/out/tp")
    ap.add_argument("--devices", type=int, default=2, help="devices of the sharded run (a power of two)")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false", help="only the main batch")
    ap.add_argument("--no-step", dest="step", action="store_false", help="no whole decode step (`shapes.STEP`)")
    args = ap.parse_args(argv)
    if no_gpu("tp_bench", args.smoke):
        return 0
    if len(jax.devices()) < args.devices:
        print(f"tp_bench: needs {args.devices} devices, found {len(jax.devices())}")
        return 1
    on_gpu = jax.default_backend() == "gpu"
    shape = TP_SMOKE if args.smoke else TP
    timing = dict(reps=2, trials=2, iters=2) if args.smoke else dict(reps=20, trials=15, iters=50)
    backend = "pallas" if on_gpu else "reference"
    batches = [shape["batch"]] + ([b for b in shape["sweep_batches"] if b != shape["batch"]] if args.sweep else [])
    res = dict(versions(), shape=shape, devices=args.devices, backend=backend, rows=[], errors=[])
    for b in batches:
        try:
            res["rows"].append(measure(shape, b, args.devices, backend, timing))
        except Exception as e:  # one failed batch (e.g. out of memory) must not lose the others
            res["errors"].append(dict(batch=b, error=error_text(e, 2000)))
            print(f"batch {b} FAILED: {res['errors'][-1]['error'][:300]}", flush=True)
        write_json(args.out, "tp_bench.json", res)
    if args.step:
        try:
            res["step"] = measure_step(STEP_SMOKE if args.smoke else STEP, args.devices, backend, timing)
        except Exception as e:  # noqa: BLE001 -- recorded, the per-call rows are kept
            res["errors"].append(dict(step=True, error=error_text(e, 2000)))
        write_json(args.out, "tp_bench.json", res)
    text = (f"{args.devices} devices; mixed_nvfp4_bf16 first/last {shape['first_n']}, page {shape['page']}, context "
            f"{shape['context']}, {shape['kv_heads']} KV / {shape['q_heads']} q heads, D {shape['head_dim']}, "
            f"backend {backend}; KV heads sharded with jax.shard_map.\n\n{table(res['rows'], args.devices)}")
    if "step" in res:
        r = res["step"]
        text += (f"\n\nwhole decode step, {r['layers']} layers, {r['batch']} x {r['context']}: 1 device "
                 f"{r['single_ms']:.3f} ms, {args.devices} devices {r['sharded_ms']:.3f} ms ({r['speedup']:.2f}x), "
                 f"bit-equal {r['bit_equal']}")
    print(text)
    if on_gpu and not args.no_md:
        append_results("tensor-parallel decode attention (`bench/tp_bench.py`)", res, text)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    if "--smoke" in sys.argv and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    sys.exit(main())
