"""Read-path benchmark (H200): `stage` (staging copy) and `gather_rows` (sparse top-k gather + overlay), the
Pallas kernels vs the XLA reference path, against the copy bandwidth measured in the same run.

    PYTHONPATH=. python3 bench/read_bench.py --out DIR

Cases (one layer, synthetic pools: random NVFP4 bytes, sane block scales, random bf16 twin, permuted pages):
* stage: batch 16 x 32k tokens, 8 KV heads, D 128, page 32, first_n 64, last_n 256.
* gather: top-k 2048 (sorted, unique, including first-N and last-N rows) over 128k-token histories, batch 16,
  MLA latent (kv 1, H 1, D 576) and 8 KV heads x D 128; bf16 and FP8 scratch.

Correctness is checked on the GPU first (Pallas == XLA reference, bit for bit). Bytes moved = low bytes read
(D/2 + D/16 per row) + twin rows read (retained rows only) + output bytes written; "of copy" = achieved bytes/s
over the in-run copy bandwidth. Writes ``DIR/read_bench.json`` and appends a section to ``bench/RESULTS.md``.
On a machine without a GPU it runs a tiny smoke check (interpret mode) and exits 0.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jmixedkv import checks, gather, staging  # noqa: E402
from jmixedkv.compat import on_gpu  # noqa: E402
from common import time_each  # noqa: E402
from jmixedkv.config import KVCacheConfig  # noqa: E402
from jmixedkv.pools import GroupPools, LowPool, RowPool  # noqa: E402
from jmixedkv.state import GroupSpec, init_state  # noqa: E402


def timeit(fn, *args, warmup=3, iters=20):
    """Median seconds of blocked calls (`common.time_each`)."""
    return time_each(fn, *args, warmup=warmup, iters=iters) / 1e3


def copy_bandwidth(nbytes=2 << 30):
    x = jnp.zeros((nbytes // 4,), jnp.uint32)
    f = jax.jit(lambda a: a + jnp.uint32(1))
    t = timeit(f, x, iters=30)
    return 2 * nbytes / t


def synthetic_state(cfg, spec, batch, tokens, seed=0):
    """A state whose ``batch`` sequences each hold ``tokens`` tokens (pools filled with random bytes)."""
    page = cfg.page_size
    width = -(-tokens // page)
    num_pages = batch * width
    hp = cfg.num_high_pages_per_seq
    state = init_state(cfg, spec, num_pages=1, max_seqs=batch, max_pages_per_seq=width, num_high_pages=1)
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(seed), 4)
    chunk = min(num_pages, 1024)            # random bytes for 1024 pages, tiled (keeps RNG arrays < 2^31 elements)
    reps = -(-num_pages // chunk)
    base = (1, chunk, spec.kv_factor, spec.num_kv_heads, page)
    data = jax.random.randint(k1, base + (spec.head_dim // 2,), 0, 256, jnp.int32).astype(jnp.uint8)
    sbytes = jax.random.randint(k2, base + (spec.head_dim // 16,), 0x28, 0x58, jnp.int32).astype(jnp.uint8)
    data = jnp.tile(data, (1, reps, 1, 1, 1, 1))[:, :num_pages]
    sbytes = jnp.tile(sbytes, (1, reps, 1, 1, 1, 1))[:, :num_pages]
    scales = jax.lax.bitcast_convert_type(sbytes, jnp.float8_e4m3fn)
    low = LowPool(data, scales, jnp.full((1, spec.kv_factor), 0.01, jnp.float32))
    rows = jax.random.normal(k3, (1, batch * hp, spec.kv_factor, spec.num_kv_heads, page, spec.head_dim),
                             jnp.float32).astype(cfg.high_dtype)
    high = RowPool(rows, jnp.ones((1, spec.kv_factor), jnp.float32))
    page_table = jax.random.permutation(k4, num_pages).astype(jnp.int32).reshape(batch, width)
    high_table = jnp.arange(batch * hp, dtype=jnp.int32).reshape(batch, hp)
    return dataclasses.replace(state, pools=(GroupPools(low, high, None),), page_table=page_table,
                               high_table=high_table, kv_lens=jnp.full((batch,), tokens, jnp.int32),
                               active=jnp.ones((batch,), bool))


def topk_indices(batch, tokens, k, first_n, last_n, seed=0):
    rng = np.random.default_rng(seed)
    out = np.empty((batch, k), np.int32)
    for b in range(batch):
        nf, nl = min(16, first_n, k // 4), min(64, last_n, k // 4)
        must = np.concatenate([np.arange(nf), np.arange(tokens - nl, tokens)])
        rest = rng.choice(np.arange(nf, tokens - nl), k - must.size, replace=False)
        out[b] = np.sort(np.concatenate([must, rest]))
    return jnp.asarray(out)


def bits_equal(a, b):
    view = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[a.dtype.itemsize]
    return bool(jnp.array_equal(jax.lax.bitcast_convert_type(a, view), jax.lax.bitcast_convert_type(b, view)))


def retained_rows(cfg, idx, tokens):
    idx = np.asarray(idx)
    return int(((idx < cfg.first_n) | (idx >= tokens - cfg.last_n)).sum())


def bench_stage(cfg, spec, batch, tokens, bw, iters):
    state = synthetic_state(cfg, spec, batch, tokens)
    seqs = jnp.arange(batch, dtype=jnp.int32)
    checks.validate_read(state, 0, seqs, op="stage")
    fns = {be: jax.jit(lambda st, q, be=be: staging.stage(st, 0, q, backend=be, validate=False).pages)
           for be in ("pallas", "reference")}
    ok = bits_equal(fns["pallas"](state, seqs), fns["reference"](state, seqs))
    rows = batch * tokens * spec.kv_factor * spec.num_kv_heads
    d = spec.head_dim
    high_pages = batch * (cfg.num_fixed_pages + -(-cfg.last_n // cfg.page_size) + 1)
    high_bytes = high_pages * cfg.page_size * spec.kv_factor * spec.num_kv_heads * d * 2
    nbytes = rows * (d // 2 + d // 16) + rows * d * 2 + high_bytes
    out = []
    for be, fn in fns.items():
        t = timeit(fn, state, seqs, iters=iters)
        out.append(dict(op="stage", backend=be, batch=batch, tokens=tokens, kv=spec.kv_factor,
                        heads=spec.num_kv_heads, head_dim=d, page=cfg.page_size, ms=t * 1e3, bytes=nbytes,
                        tb_s=nbytes / t / 1e12, of_copy=nbytes / t / bw, bitexact=ok))
    return out


def bench_gather(cfg, spec, batch, tokens, k, bw, iters):
    state = synthetic_state(cfg, spec, batch, tokens, seed=1)
    seqs = jnp.arange(batch, dtype=jnp.int32)
    idx = topk_indices(batch, tokens, k, cfg.first_n, cfg.last_n)
    checks.validate_read(state, 0, seqs, idx, op="gather_rows")
    out = []
    d = spec.head_dim
    rows = batch * k * spec.kv_factor * spec.num_kv_heads
    high = retained_rows(cfg, idx, tokens) * spec.kv_factor * spec.num_kv_heads * d * 2
    for scratch in (None, "fp8"):
        fns = {be: jax.jit(lambda st, q, i, be=be, sd=scratch: gather.gather_rows(st, 0, q, i, backend=be,
                                                                                scratch_dtype=sd, validate=False))
               for be in ("pallas", "reference")}
        (gp, sp), (gr, sr) = fns["pallas"](state, seqs, idx), fns["reference"](state, seqs, idx)
        ok = bits_equal(gp, gr) and bits_equal(sp, sr)
        nbytes = rows * (d // 2 + d // 16) + rows * d * (1 if scratch else 2) + high
        for be, fn in fns.items():
            t = timeit(fn, state, seqs, idx, iters=iters)
            out.append(dict(op=f"gather_{scratch or 'bf16'}", backend=be, batch=batch, tokens=tokens, topk=k,
                            kv=spec.kv_factor, heads=spec.num_kv_heads, head_dim=d, page=cfg.page_size,
                            ms=t * 1e3, bytes=nbytes, tb_s=nbytes / t / 1e12, of_copy=nbytes / t / bw,
                            bitexact=ok))
    return out


def table(results):
    head = f"| op | backend | shape | ms | GB moved | TB/s | of copy | bit-exact |\n|---|---|---|---|---|---|---|---|\n"
    lines = []
    for r in results:
        if "error" in r:
            lines.append(f"| {r['op']} | - | {r.get('shape', '')} | error: {r['error'][:80]} | | | | |")
            continue
        shape = (f"B{r['batch']} x {r['tokens']} tok" + (f", top-k {r['topk']}" if "topk" in r else "")
                 + f", kv{r['kv']} H{r['heads']} D{r['head_dim']} page{r['page']}")
        lines.append(f"| {r['op']} | {r['backend']} | {shape} | {r['ms']:.3f} | {r['bytes'] / 1e9:.3f} | "
                     f"{r['tb_s']:.2f} | {100 * r['of_copy']:.1f}% | {r['bitexact']} |")
    return head + "\n".join(lines)


def smoke():
    print("read_bench: no GPU found; running a tiny interpret-mode smoke check only (no timings).")
    cfg = KVCacheConfig("mixed_nvfp4_bf16", first_n=8, last_n=16, page_size=8)
    spec = GroupSpec(num_layers=1, num_kv_heads=1, head_dim=32)
    state = synthetic_state(cfg, spec, 2, 40)
    seqs = jnp.arange(2, dtype=jnp.int32)
    a = staging.stage(state, 0, seqs, backend="pallas").pages
    b = staging.stage(state, 0, seqs, backend="reference").pages
    idx = topk_indices(2, 40, 16, cfg.first_n, cfg.last_n)
    g = gather.gather_rows(state, 0, seqs, idx, backend="pallas")[0]
    r = gather.gather_rows(state, 0, seqs, idx, backend="reference")[0]
    print(f"smoke: stage bit-exact {bits_equal(a, b)}, gather bit-exact {bits_equal(g, r)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/out")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    if not on_gpu():
        smoke()
        return 0
    os.makedirs(args.out, exist_ok=True)
    bw = copy_bandwidth()
    print(f"device {jax.devices()[0].device_kind}; copy bandwidth {bw / 1e12:.2f} TB/s")
    cfg = KVCacheConfig("mixed_nvfp4_bf16", first_n=64, last_n=256, page_size=32)
    cases = [
        ("stage", lambda: bench_stage(cfg, GroupSpec(1, 8, 128), 16, 32768, bw, args.iters)),
        ("gather MLA", lambda: bench_gather(cfg, GroupSpec(1, 1, 576, kv_factor=1), 16, 131072, 2048, bw,
                                            args.iters)),
        ("gather 8x128", lambda: bench_gather(cfg, GroupSpec(1, 8, 128), 16, 131072, 2048, bw, args.iters)),
    ]
    results = []
    for name, fn in cases:
        try:
            results += fn()
        except Exception as e:  # keep the other cases' numbers
            traceback.print_exc()
            results.append(dict(op=name, error=f"{type(e).__name__}: {e}"))
        jax.clear_caches()
    md = table(results)
    print(md)
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "n/a"
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=jax.devices()[0].device_kind, jax=jax.__version__, triton=triton_version,
                copy_tb_s=bw / 1e12)
    with open(os.path.join(args.out, "read_bench.json"), "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=1)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
    if not os.path.exists(path):
        with open(path, "w") as f:
            f.write("# jmixedkv benchmark results (GPU runs, newest sections appended)\n")
    with open(path, "a") as f:
        f.write(f"\n## read paths (stage, gather_rows) — {meta['date']}\n\n"
                f"{meta['device']}, jax {meta['jax']}, triton {meta['triton']}; copy bandwidth measured in-run "
                f"{meta['copy_tb_s']:.2f} TB/s. `bench/read_bench.py`; one layer; first_n 64, last_n 256; "
                f"bytes = NVFP4 read + twin rows read + scratch/pages written.\n\n{md}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
