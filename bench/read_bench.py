"""Read paths on the GPU: `stage` (staging copy) and `gather_rows` (sparse top-k gather + overlay), the Pallas
kernels against the XLA reference path, each checked bit for bit first (`shapes.READ`, one layer of random bytes).

    PYTHONPATH=. python3 bench/read_bench.py --out DIR            # GPU
    PYTHONPATH=. python3 bench/read_bench.py --smoke --out DIR    # CPU: tiny shapes in interpret mode

Bytes = low bytes + retained twin rows read + output written; ms = median of blocked calls. Writes
``DIR/read_bench.json`` and (GPU, unless ``--no-md``) a section of bench/RESULTS.md.
"""
from __future__ import annotations

import sys

from common import (append_results, bench_parser, bits_equal, copy_bandwidth, md_table, no_gpu, random_mixed_state,
                    time_each, versions, write_json)
from shapes import READ, READ_SMOKE

import jax
import jax.numpy as jnp
import numpy as np

from jmixedkv import gather, staging
from jmixedkv.config import KVCacheConfig
from jmixedkv.state import GroupSpec


def topk_indices(batch, tokens, k, first_n, last_n, seed=0):
    """``i32[batch, k]``: per sequence sorted unique positions, the first and last rows of the history included."""
    rng = np.random.default_rng(seed)
    out = np.empty((batch, k), np.int32)
    for b in range(batch):
        nf, nl = min(16, first_n, k // 4), min(64, last_n, k // 4)
        must = np.concatenate([np.arange(nf), np.arange(tokens - nl, tokens)])
        rest = rng.choice(np.arange(nf, tokens - nl), k - must.size, replace=False)
        out[b] = np.sort(np.concatenate([must, rest]))
    return jnp.asarray(out)


def timed_rows(op, fns, args, nbytes, iters, **shape):
    """One row per backend of ``fns`` (``{backend: jitted fn}``), after checking the two give the same bits."""
    exact = bits_equal(fns["pallas"](*args), fns["reference"](*args))
    out = []
    for backend, fn in fns.items():
        ms = time_each(fn, *args, iters=iters)
        out.append(dict(op=op, backend=backend, **shape, ms=ms, bytes=nbytes, tbs=nbytes / ms / 1e9, bitexact=exact))
    return out


def bench_stage(cfg, spec, batch, tokens, iters):
    state = random_mixed_state(cfg, spec, batch, tokens)
    seqs = jnp.arange(batch, dtype=jnp.int32)
    fns = {be: jax.jit(lambda st, q, be=be: staging.stage(st, 0, q, backend=be, validate=False).pages)
           for be in ("pallas", "reference")}
    d, kvh = spec.head_dim, spec.kv_factor * spec.num_kv_heads
    rows = batch * tokens * kvh
    high_pages = batch * (cfg.num_fixed_pages + -(-cfg.last_n // cfg.page_size) + 1)
    nbytes = rows * (d // 2 + d // 16) + rows * d * 2 + high_pages * cfg.page_size * kvh * d * 2
    return timed_rows("stage", fns, (state, seqs), nbytes, iters, batch=batch, tokens=tokens, kv=spec.kv_factor,
                      heads=spec.num_kv_heads, head_dim=d)


def bench_gather(cfg, spec, batch, tokens, k, scratches, iters):
    state = random_mixed_state(cfg, spec, batch, tokens, seed=1)
    seqs = jnp.arange(batch, dtype=jnp.int32)
    idx = topk_indices(batch, tokens, k, cfg.first_n, cfg.last_n)
    d, kvh = spec.head_dim, spec.kv_factor * spec.num_kv_heads
    retained = int(((np.asarray(idx) < cfg.first_n) | (np.asarray(idx) >= tokens - cfg.last_n)).sum())
    out = []
    for scratch in scratches:
        fns = {be: jax.jit(lambda st, q, i, be=be, sd=scratch: gather.gather_rows(
            st, 0, q, i, backend=be, scratch_dtype=sd, validate=False)) for be in ("pallas", "reference")}
        nbytes = batch * k * kvh * (d // 2 + d // 16 + d * (1 if scratch else 2)) + retained * kvh * d * 2
        out += timed_rows(f"gather_{scratch or 'bf16'}", fns, (state, seqs, idx), nbytes, iters, batch=batch,
                          tokens=tokens, topk=k, kv=spec.kv_factor, heads=spec.num_kv_heads, head_dim=d)
    return out


def table(results, copy_tbs):
    return md_table(("op", "backend", "shape", "ms", "GB moved", "TB/s", "of copy", "bit-exact"), [
        (r["op"], r["backend"], f"B{r['batch']} x {r['tokens']} tok" + (f", top-k {r['topk']}" if "topk" in r else "")
         + f", kv{r['kv']} H{r['heads']} D{r['head_dim']}", f"{r['ms']:.3f}", f"{r['bytes'] / 1e9:.3f}",
         f"{r['tbs']:.2f}", f"{r['tbs'] / copy_tbs:.1%}", r["bitexact"]) for r in results])


def main(argv=None):
    ap = bench_parser(__doc__)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    if no_gpu("read_bench", args.smoke):
        return 0
    shape, iters = (READ_SMOKE, 1) if args.smoke else (READ, args.iters)
    copy_tbs, how = copy_bandwidth(args.smoke)
    cfg = KVCacheConfig("mixed_nvfp4_bf16", first_n=shape["first_n"], last_n=shape["last_n"], page_size=shape["page"])
    batch, tokens, (kv, heads, d) = shape["stage"]
    results = bench_stage(cfg, GroupSpec(1, heads, d, kv_factor=kv), batch, tokens, iters)
    jax.clear_caches()
    for kv, heads, d in shape["gather_specs"]:
        results += bench_gather(cfg, GroupSpec(1, heads, d, kv_factor=kv), shape["gather_batch"],
                                shape["gather_tokens"], shape["topk"], shape["scratch"], iters)
        jax.clear_caches()
    md = table(results, copy_tbs)
    meta = dict(versions(), copy_tbs=copy_tbs, copy_how=how)
    print(md)
    write_json(args.out, "read_bench.json", dict(meta=meta, results=results))
    if not args.smoke and not args.no_md:
        append_results("read paths (stage, gather_rows)", meta, (
            f"copy {copy_tbs:.2f} TB/s ({how}). `bench/read_bench.py`; one layer; first_n 64, last_n 256, page 32; "
            f"bytes = NVFP4 read + twin rows read + scratch/pages written.\n\n{md}"))
    return 0 if all(r["bitexact"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
