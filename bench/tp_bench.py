"""Tensor-parallel decode attention: 1 GPU vs N GPUs (KV heads sharded with jax.shard_map), same total batch/context.

    PYTHONPATH=. python3 bench/tp_bench.py --out DIR          # on the 2-GPU H200 machine (nvidia-h200-x2)
    python bench/tp_bench.py --smoke                          # CPU: tiny sizes, reference backend, 2 host devices

Checks first that the sharded output equals the single-device output (bit-exact: each shard runs the same kernel on
its heads), then times both with the fused NVFP4 decode kernel and reports the speed-up (target >= 1.8x for 2 GPUs).
The state is filled with random NVFP4 bytes directly (no append), so set-up is quick at 32k contexts.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys

if "--smoke" in sys.argv and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jmixedkv as jm  # noqa: E402
from jmixedkv import sharding  # noqa: E402
from jmixedkv.attention import decode_attention  # noqa: E402
from read_bench import timeit as _median_s  # noqa: E402  (warm-up + median wall time, seconds)


def timeit(fn, *args, iters=30):
    return _median_s(fn, *args, iters=iters) * 1e3


def random_state(cfg, spec, batch, ctx, seed=0):
    """A full cache: every sequence has ``ctx`` tokens of random NVFP4 bytes and random twin rows."""
    page = cfg.page_size
    ppseq = -(-ctx // page)
    num_pages = batch * ppseq
    state = jm.init_state(cfg, spec, num_pages, batch, ppseq)
    rng = np.random.default_rng(seed)
    pool = state.pools[0]
    key = jax.random.PRNGKey(seed)
    k1, k2, k3 = jax.random.split(key, 3)
    data = jax.random.randint(k1, pool.low.data.shape, 0, 256, jnp.int32).astype(jnp.uint8)
    # valid E4M3 scale bytes in [0x20, 0x40): 2^-5 .. 2^-1 — finite, non-zero
    scales = jax.lax.bitcast_convert_type(
        jax.random.randint(k2, pool.low.scales.shape, 0x20, 0x40, jnp.int32).astype(jnp.uint8), jnp.float8_e4m3fn)
    low = dataclasses.replace(pool.low, data=data, scales=scales)
    high = pool.high
    if high is not None:
        high = dataclasses.replace(high, rows=jax.random.normal(k3, high.rows.shape, jnp.float32).astype(high.rows.dtype))
    perm = rng.permutation(num_pages).astype(np.int32)
    page_table = jnp.asarray(perm.reshape(batch, ppseq))
    nh = state.high_table.shape[1]
    high_table = jnp.asarray(np.arange(batch * nh, dtype=np.int32).reshape(batch, nh))
    return dataclasses.replace(
        state, pools=(dataclasses.replace(pool, low=low, high=high),), page_table=page_table, high_table=high_table,
        kv_lens=jnp.full((batch,), ctx, jnp.int32), active=jnp.ones((batch,), bool))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/out/tp")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (reference backend)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--no-md", action="store_true")
    args = ap.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not args.smoke:
        print("tp_bench: no GPU found; run on the 2-GPU H200 machine, or pass --smoke for a tiny CPU check")
        return 0
    devices = jax.devices()
    if len(devices) < 2:
        print(f"tp_bench: needs >= 2 devices, found {len(devices)}")
        return 0
    batch, ctx = (4, 256) if args.smoke else (args.batch, args.context)
    backend = "pallas" if on_gpu else "reference"
    cfg = jm.KVCacheConfig("mixed_nvfp4_bf16", first_n=64, last_n=64, page_size=16 if args.smoke else 64)
    spec = jm.GroupSpec(1, 8, 128)
    hq = 32
    state = random_state(cfg, spec, batch, ctx)
    q = jax.random.normal(jax.random.PRNGKey(1), (batch, 1, hq, 128), jnp.float32).astype(jnp.bfloat16)
    seq = jnp.arange(batch, dtype=jnp.int32)
    one = jax.device_put(state, devices[0])
    # the split-K count is fixed from the global shape, so each shard runs exactly the single-GPU programs of its
    # heads (bit-equal outputs); the default would pick more splits for fewer local heads
    from pallas_kernels.decode_attention import default_num_splits
    splits = default_num_splits(batch, spec.num_kv_heads, -(-ctx // 64)) if on_gpu else None
    kw = dict(backend=backend, num_splits=splits)
    single = jax.jit(lambda st, q_, s_: decode_attention(st, 0, q_, s_, **kw))
    rows = []
    base_out = single(one, jax.device_put(q, devices[0]), seq)
    t1 = timeit(single, one, jax.device_put(q, devices[0]), seq)
    rows.append(dict(devices=1, ms=t1, speedup=1.0))
    for n in range(2, len(devices) + 1):
        if n & (n - 1) or 8 % n:
            continue
        mesh = sharding.make_mesh(n)
        st_n = sharding.shard_state(state, mesh)
        fn = jax.jit(lambda st, q_, s_: sharding.sharded_decode_attention(mesh, st, 0, q_, s_, **kw))
        out = fn(st_n, q, seq)
        same = all(np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
                   for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(base_out)))
        tn = timeit(fn, st_n, q, seq)
        rows.append(dict(devices=n, ms=tn, speedup=t1 / tn, bit_equal_to_single=same))
    kv_bytes = batch * ctx * spec.num_kv_heads * 2 * (128 // 2 + 128 // 16)
    print(f"\nTP decode attention, mixed_nvfp4_bf16 (first/last 64), batch {batch} x context {ctx}, "
          f"8 KV heads / 32 q heads, D 128, backend {backend}, device {devices[0].device_kind}")
    print(f"{'devices':>8} {'ms':>9} {'speed-up':>9} {'GB/s per dev':>13}  bit-equal")
    for r in rows:
        gbs = kv_bytes / r["devices"] / (r["ms"] * 1e-3) / 1e9
        r["gb_per_s_per_device"] = gbs
        print(f"{r['devices']:>8} {r['ms']:>9.3f} {r['speedup']:>9.2f} {gbs:>13.0f}  {r.get('bit_equal_to_single', '-')}")
    os.makedirs(args.out, exist_ok=True)
    meta = dict(date=datetime.date.today().isoformat(), device=devices[0].device_kind, jax=jax.__version__,
                batch=batch, context=ctx, backend=backend, rows=rows)
    with open(os.path.join(args.out, "tp_bench.json"), "w") as f:
        json.dump(meta, f, indent=1)
    if on_gpu and not args.no_md:
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md"), "a") as f:
            f.write(f"\n## {meta['date']} — tensor-parallel decode attention (bench/tp_bench.py)\n\n"
                    f"{len(devices)} x {devices[0].device_kind}, jax {jax.__version__}; mixed_nvfp4_bf16 first/last 64, "
                    f"page 64, batch {batch} x context {ctx}, 8 KV heads, 32 query heads, D 128, fused Pallas kernel; "
                    f"KV heads sharded with jax.shard_map.\n\n| devices | ms | speed-up vs 1 | GB/s per device | "
                    f"bit-equal to 1 GPU |\n|---|---|---|---|---|\n")
            for r in rows:
                f.write(f"| {r['devices']} | {r['ms']:.3f} | {r['speedup']:.2f}x | {r['gb_per_s_per_device']:.0f} | "
                        f"{r.get('bit_equal_to_single', '-')} |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
