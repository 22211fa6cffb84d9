"""GPU probe: the fused NVFP4 decode kernel's variants at one shape (default 16 x 32k), correctness first.

    PYTHONPATH=. python3 bench/probes/decode_probe.py [--batch 16 --context 32768] [--out DIR]

Prints correctness (bench.decode_bench.check_correctness) and the time of each variant next to the NVFP4 bytes
floor; writes decode_probe.json under --out. Used to tune the kernel between full bench runs.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import decode_bench as db  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

VARIANTS = [dict(block_k=128, num_warps=4, num_stages=3), dict(block_k=128, num_warps=4, num_stages=4),
            dict(block_k=128, num_warps=4, num_stages=3, keys_major=True),
            dict(block_k=64, num_warps=4, num_stages=3, keys_major=True),
            dict(block_k=128, num_warps=4, num_stages=4, keys_major=True),
            dict(block_k=128, num_warps=8, num_stages=3, keys_major=True),
            dict(block_k=256, num_warps=8, num_stages=3, keys_major=True),
            dict(block_k=128, num_warps=4, num_stages=3, keys_major=True, dequant="jnp"),
            dict(block_k=128, num_warps=4, num_stages=3, keys_major=True, precise=True)]
PLAIN_VARIANTS = [dict(block_k=128, num_warps=4, num_stages=3), dict(block_k=128, num_warps=4, num_stages=3,
                                                                      keys_major=True)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--out", default="/tmp/decode_probe")
    ap.add_argument("--plain", action="store_true", help="also time the plain bf16 kernel (b)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    try:
        import torch
    except Exception:
        torch = None
    bw, _ = db.copy_bandwidth_tbs(torch)
    ok, corr = db.check_correctness(torch)
    print("correctness", "OK" if ok else "FAILED", json.dumps(corr), flush=True)
    b, ctx = args.batch, args.context
    npg = ctx // db.PAGE
    key = jax.random.PRNGKey(0)
    q4 = db.rand_bf16(jax.random.fold_in(key, 5), (b, 1, db.HQ, db.D))
    lens = jnp.full((b,), ctx, jnp.int32)
    pt, ht = db.tables(jax.random.fold_in(key, 1), b, ctx)
    low, high = db.mixed_pools(jax.random.fold_in(key, 2), b, ctx)
    nbytes = b * ctx * db.H * db.D * 2 * (0.5 + 1 / 16) + b * (db.FIRST_N + db.LAST_N) * db.H * db.D * 2 * 2
    floor_ms = nbytes / (bw * 1e12) * 1e3          # as decode_bench: bytes over the copy bandwidth
    res = dict(batch=b, context=ctx, copy_tbs=bw, floor_nvfp4_ms=floor_ms, correctness=corr, ok=ok, variants={})
    base = None
    for c in VARIANTS:
        name = db.cfg_name(c)
        t0 = time.time()
        try:
            fn, splits = db.ours_fn("mixed", c, b, npg)
            out = fn(q4, pt, lens, ht, low, high)
            base = out if base is None else base
            rel = float(jnp.linalg.norm((out - base).astype(jnp.float32)) / jnp.linalg.norm(base.astype(jnp.float32)))
            ms = db.time_jax(fn, q4, pt, lens, ht, low, high)
            res["variants"][name] = dict(ms=ms, x_floor=ms / floor_ms, splits=splits, rel_vs_first=rel)
            print(f"{name:>22}: {ms:.3f} ms  {ms / floor_ms:.2f}x floor  splits {splits}  rel {rel:.1e}  "
                  f"({time.time() - t0:.0f}s)", flush=True)
        except Exception as e:
            res["variants"][name] = dict(error=f"{type(e).__name__}: {str(e)[:400]}")
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
    if args.plain:
        plain = db.plain_pool(jax.random.fold_in(key, 3), b, ctx)
        for c in PLAIN_VARIANTS:
            fn, _ = db.ours_fn("plain", c, b, npg)
            res["plain_" + db.cfg_name(c)] = db.time_jax(fn, q4, pt, lens, plain)
            print("plain", db.cfg_name(c), res["plain_" + db.cfg_name(c)], flush=True)
    print(f"floor {floor_ms:.3f} ms at {bw:.2f} TB/s")
    with open(os.path.join(args.out, "decode_probe.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
