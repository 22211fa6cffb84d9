"""Prefix-reuse benchmark: a shared system prompt across many requests, with and without reuse.

Workload: ``--requests`` prompts = one shared ``--prompt``-token system prompt + a unique ``--suffix``-token tail.
Request 0 is prefilled and committed; the others are admitted in batches of ``--batch`` concurrent sequences
(all requests stay live, as in a serving batch). Without reuse every request appends its whole prompt; with reuse
it appends only what `PrefixCache.admit` did not match (its suffix plus the recomputed Last-N window, see
`jmixedkv.prefix`). Reports pages saved, hit rate, and the prefill-append time of both (append only, and
end-to-end including admit / match / commit), after checking that reused sequences read bit-exactly what
non-reused ones read.

GPU (default sizes): 8 layers, 8 KV heads, head_dim 128. CPU: scaled down to 1 layer, 1 KV head, head_dim 64
(said in the output) so it finishes in a couple of minutes. Prints a table, writes ``prefix_bench.json`` under
``--out``, and (GPU only) appends a dated section to ``bench/RESULTS.md``. The append backend is the Pallas write
kernel when ``pallas_kernels.write`` imports, else the XLA reference store (printed in the table).

    PYTHONPATH=. python3 bench/prefix_bench.py --out DIR
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jmixedkv import GroupSpec, KVCacheConfig, init_state, rows_reference  # noqa: E402
from jmixedkv.compat import on_gpu  # noqa: E402
from jmixedkv.prefix import PrefixCache  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")


def parse_args():
    gpu = on_gpu()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench_out")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt", type=int, default=4096)
    p.add_argument("--suffix", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--page", type=int, default=32)
    p.add_argument("--first-n", type=int, default=64)
    p.add_argument("--last-n", type=int, default=256)
    p.add_argument("--layers", type=int, default=8 if gpu else 1)
    p.add_argument("--heads", type=int, default=8 if gpu else 1)
    p.add_argument("--head-dim", type=int, default=128 if gpu else 64)
    p.add_argument("--repeats", type=int, default=3 if gpu else 1)
    p.add_argument("--no-results", action="store_true", help="do not append to bench/RESULTS.md")
    return p.parse_args()


def backend_name() -> str:
    if not on_gpu():
        return "reference"
    try:
        import pallas_kernels.write  # noqa: F401
        return "auto"
    except Exception:  # noqa: BLE001 - kernel not available yet: time the XLA reference store
        return "reference"


def make_kv(layers, heads, dim):
    @jax.jit
    def kv(tok, pos):
        """Deterministic K/V = f(token, position, layer): [L, T, H, D] bf16 each."""
        t = tok.astype(jnp.float32)[None, :, None, None]
        p = pos.astype(jnp.float32)[None, :, None, None]
        l = jnp.arange(layers, dtype=jnp.float32)[:, None, None, None]
        h = jnp.arange(heads, dtype=jnp.float32)[None, None, :, None]
        d = jnp.arange(dim, dtype=jnp.float32)[None, None, None, :]
        k = jnp.sin(t * 0.731 + p * 0.197 + l * 1.37 + h * 0.53 + d * 0.11) * (1 + t % 3)
        v = jnp.cos(t * 0.291 + p * 0.613 + l * 0.77 + h * 0.31 + d * 0.05) * (1 + t % 2)
        return k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    return kv


def prompts(args):
    rng = np.random.default_rng(0)
    system = rng.integers(0, 32000, args.prompt).tolist()
    return [system + rng.integers(0, 32000, args.suffix).tolist() for _ in range(args.requests)]


def build_cache(args, cfg, spec, reuse):
    per_seq = -(-(args.prompt + args.suffix) // args.page)
    matched = max(0, min(args.prompt, args.prompt + args.suffix - max(args.last_n, 1))) // args.page
    num_pages = per_seq + (per_seq - matched) * args.requests + 8 if reuse else per_seq * args.requests + 8
    state = init_state(cfg, spec, num_pages, args.requests, per_seq,
                       num_high_pages=args.requests * cfg.num_high_pages_per_seq + cfg.num_fixed_pages + 8)
    return PrefixCache(state, backend=backend_name())


def run_workload(args, cfg, spec, kv, reqs, reuse):
    """Admit + prefill-append every request. Returns (cache, append seconds, total seconds, appended tokens)."""
    pc = build_cache(args, cfg, spec, reuse)
    jax.block_until_ready(pc.state)
    append_s, appended = 0.0, 0
    t_total = time.perf_counter()

    def batch_append(slots, starts, tails, width):
        nonlocal append_s, appended
        seq = np.full(width, -1, np.int32)
        pos = np.zeros(width, np.int32)
        tok = np.zeros(width, np.int32)
        i = 0
        for s, start, tail in zip(slots, starts, tails):
            span = slice(i, i + len(tail))
            seq[span], pos[span], tok[span] = s, np.arange(start, start + len(tail)), tail
            i += len(tail)
        k, v = kv(jnp.asarray(tok), jnp.asarray(pos))
        jax.block_until_ready((k, v, pc.state))
        t0 = time.perf_counter()
        pc.append(None, k, v, seq, pos)
        jax.block_until_ready(pc.state)
        append_s += time.perf_counter() - t0
        appended += i

    first = reqs[0]
    m = pc.admit(0, first)
    batch_append([0], [m], [first[m:]], len(first))
    if reuse:
        pc.commit(0, first)
    rest = list(range(1, len(reqs)))
    width = None
    for b in range(0, len(rest), args.batch):
        slots = rest[b:b + args.batch]
        starts = [pc.admit(s, reqs[s]) if reuse else pc.admit(s, reqs[s], count_stats=False) for s in slots]
        tails = [reqs[s][m:] for s, m in zip(slots, starts)]
        width = width or args.batch * max(len(t) for t in tails)
        batch_append(slots, starts, tails, width)
    jax.block_until_ready(pc.state)
    total_s = time.perf_counter() - t_total
    return pc, append_s, total_s, appended


def check_exact(pc_reuse, pc_plain, slots):
    """Reused and non-reused sequences read bit-identical rows (layer 0 and last layer)."""
    seq = jnp.asarray(slots, jnp.int32)[:, None]
    pos = jnp.arange(pc_plain.state.max_pages_per_seq * pc_plain.page, dtype=jnp.int32)[None, :]
    for layer in {0, pc_plain.state.groups[0].num_layers - 1}:
        a = np.asarray(rows_reference(pc_reuse.state, layer, seq, pos)).view(np.uint16)
        b = np.asarray(rows_reference(pc_plain.state, layer, seq, pos)).view(np.uint16)
        if not np.array_equal(a, b):
            raise AssertionError(f"prefix reuse changed what sequences {slots} read at layer {layer}")


def copy_bandwidth():
    """Measured device copy bandwidth (bytes/s): read + write of a large array."""
    n = (1 << 28) if on_gpu() else (1 << 24)
    x = jnp.ones((n,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0 + 0.0)
    jax.block_until_ready(f(x))
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        times.append(time.perf_counter() - t0)
    return 2 * 4 * n / statistics.median(times)


def bytes_per_token(cfg, spec, retained_fraction):
    kvh = spec.kv_factor * spec.num_kv_heads
    low = kvh * (spec.head_dim // 2 + spec.head_dim // 16)
    high = kvh * spec.head_dim * cfg.high_dtype.itemsize
    return spec.num_layers * (low + retained_fraction * high)


def main():
    args = parse_args()
    if not on_gpu():
        print(f"[prefix_bench] no GPU: CPU run scaled down to {args.layers} layer(s), {args.heads} KV head(s), "
              f"head_dim {args.head_dim} (GPU default: 8 layers, 8 heads, head_dim 128)")
    cfg = KVCacheConfig("mixed_nvfp4_bf16", first_n=args.first_n, last_n=args.last_n, page_size=args.page)
    spec = GroupSpec(args.layers, args.heads, args.head_dim)
    kv = make_kv(args.layers, args.heads, args.head_dim)
    reqs = prompts(args)

    results = {}
    for mode, reuse in (("no_reuse", False), ("reuse", True)):
        run_workload(args, cfg, spec, kv, reqs[:1 + args.batch], reuse)     # warmup: compiles every shape
        runs = []
        for _ in range(args.repeats):
            runs = [r[1:] for r in runs]                     # keep only the last cache alive (GPU memory)
            runs.append(run_workload(args, cfg, spec, kv, reqs, reuse))
        pc = runs[-1][0]
        runs = [r[-3:] for r in runs]
        results[mode] = dict(cache=pc, append_s=statistics.median(r[0] for r in runs),
                             total_s=statistics.median(r[1] for r in runs), appended=runs[-1][2],
                             low_pages_used=pc.state.alloc.num_pages - pc.free_pages()[0],
                             high_pages_used=pc.state.high_alloc.num_pages - pc.free_pages()[1])
    check_exact(results["reuse"]["cache"], results["no_reuse"]["cache"], [0, 1, args.requests - 1])
    stats = results["reuse"]["cache"].stats()
    bw = copy_bandwidth()
    rows = []
    for mode in ("no_reuse", "reuse"):
        r = results[mode]
        nbytes = r["appended"] * bytes_per_token(cfg, spec, min(1.0, (args.first_n + args.last_n) /
                                                                     (args.prompt + args.suffix)))
        rows.append(dict(mode=mode, appended_tokens=r["appended"], low_pages_used=int(r["low_pages_used"]),
                         high_pages_used=int(r["high_pages_used"]), append_ms=1e3 * r["append_s"],
                         total_ms=1e3 * r["total_s"], bytes_written=nbytes,
                         floor_ms=1e3 * nbytes / bw, ratio_to_floor=(nbytes / bw) / r["append_s"]))
    nr, ru = rows
    summary = dict(
        device=jax.devices()[0].device_kind, platform=jax.default_backend(), jax=jax.__version__,
        triton=_triton_version(), backend=backend_name(), requests=args.requests, prompt=args.prompt,
        suffix=args.suffix, batch=args.batch, page=args.page, first_n=args.first_n, last_n=args.last_n,
        layers=args.layers, kv_heads=args.heads, head_dim=args.head_dim, repeats=args.repeats,
        copy_bw_tbs=bw / 1e12, hit_rate=stats["hit_rate"], pages_saved_matched=stats["pages_saved"],
        low_pages_saved=nr["low_pages_used"] - ru["low_pages_used"],
        append_speedup=nr["append_ms"] / ru["append_ms"], total_speedup=nr["total_ms"] / ru["total_ms"],
        append_ms_saved=nr["append_ms"] - ru["append_ms"], rows=rows, exact=True)
    table = _table(summary)
    print(table)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "prefix_bench.json"), "w") as f:
        json.dump(summary, f, indent=2)
    if args.no_results:
        return
    if not on_gpu():
        print("[prefix_bench] CPU run: not appended to bench/RESULTS.md (GPU numbers only)")
        return
    _append_results(summary, table)


def _triton_version():
    try:
        import triton
        return triton.__version__
    except Exception:  # noqa: BLE001
        return None


def _table(s):
    lines = [f"prefix reuse: {s['requests']} requests x ({s['prompt']} shared + {s['suffix']} unique) tokens, "
             f"page {s['page']}, first_n {s['first_n']}, last_n {s['last_n']}, L={s['layers']} H={s['kv_heads']} "
             f"D={s['head_dim']}, batch {s['batch']}, append backend {s['backend']}, {s['device']}",
             f"hit rate {100 * s['hit_rate']:.1f}% | matched pages {s['pages_saved_matched']} | low pages saved "
             f"{s['low_pages_saved']} | copy bw {1e3 * s['copy_bw_tbs']:.1f} GB/s (in-run) | "
             f"reads bit-exact: {s['exact']}",
             "| mode | appended tokens | low pages | high pages | append ms | end-to-end ms | bytes floor ms | "
             "floor / append |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in s["rows"]:
        lines.append(f"| {r['mode']} | {r['appended_tokens']} | {r['low_pages_used']} | {r['high_pages_used']} | "
                     f"{r['append_ms']:.1f} | {r['total_ms']:.1f} | {r['floor_ms']:.2f} | "
                     f"{r['ratio_to_floor']:.3f} |")
    lines.append(f"append speedup x{s['append_speedup']:.2f} ({s['append_ms_saved']:.1f} ms saved), end-to-end "
                 f"x{s['total_speedup']:.2f}")
    return "\n".join(lines)


def _append_results(s, table):
    if not os.path.exists(RESULTS):
        with open(RESULTS, "w") as f:
            f.write("# jmixedkv benchmark results\n")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    with open(RESULTS, "a") as f:
        f.write(f"\n## prefix_bench ({stamp}, {s['device']}, jax {s['jax']}, triton {s['triton']})\n\n")
        f.write(table + "\n")


if __name__ == "__main__":
    main()
