"""Prefix reuse: a shared system prompt across many requests, with and without `jmixedkv.prefix.PrefixCache`.

    PYTHONPATH=. python3 bench/prefix_bench.py --out DIR            # GPU (`shapes.PREFIX`; e.g. --requests 64)
    PYTHONPATH=. python3 bench/prefix_bench.py --smoke --out DIR    # CPU: `shapes.PREFIX_SMOKE`

Every prompt = one shared system prompt + a unique tail; request 0 is prefilled and committed, the others admitted
in batches. Reports pages saved, hit rate and the prefill-append time with and without reuse, after checking that
reused sequences read bit-exactly what the others read. Writes ``DIR/prefix_bench.json`` (GPU: + a RESULTS section
unless ``--no-md``).
"""
from __future__ import annotations

import statistics
import sys
import time

from common import append_results, bench_parser, copy_bandwidth, md_table, no_gpu, versions, write_json
from shapes import PREFIX, PREFIX_SMOKE

import jax
import jax.numpy as jnp
import numpy as np

from jmixedkv import GroupSpec, KVCacheConfig, init_state, rows_reference
from jmixedkv.compat import on_gpu
from jmixedkv.prefix import PrefixCache


def make_kv(s):
    @jax.jit
    def kv(tok, pos):
        """Deterministic K/V = f(token, position, layer, head, dim): ``[L, T, H, D]`` bf16 each."""
        t, p = (a.astype(jnp.float32)[None, :, None, None] for a in (tok, pos))
        l = jnp.arange(s["layers"], dtype=jnp.float32)[:, None, None, None]  # noqa: E741
        h = jnp.arange(s["heads"], dtype=jnp.float32)[None, None, :, None]
        d = jnp.arange(s["head_dim"], dtype=jnp.float32)[None, None, None, :]
        k = jnp.sin(t * 0.731 + p * 0.197 + l * 1.37 + h * 0.53 + d * 0.11) * (1 + t % 3)
        v = jnp.cos(t * 0.291 + p * 0.613 + l * 0.77 + h * 0.31 + d * 0.05) * (1 + t % 2)
        return k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    return kv


def run_workload(s, cfg, spec, kv, reqs, reuse, backend):
    """Admit + prefill-append every request: ``(cache, append seconds, total seconds, appended tokens)``."""
    per_seq = -(-(s["prompt"] + s["suffix"]) // s["page"])
    matched = max(0, min(s["prompt"], s["prompt"] + s["suffix"] - max(s["last_n"], 1))) // s["page"]
    n = s["requests"]               # the cache's shape does not depend on len(reqs): the warm-up compiles it
    num_pages = (per_seq + (per_seq - matched) * n if reuse else per_seq * n) + 8
    pc = PrefixCache(init_state(cfg, spec, num_pages, n, per_seq, num_high_pages=n * cfg.num_high_pages_per_seq
                                + cfg.num_fixed_pages + 8), backend=backend)
    jax.block_until_ready(pc.state)
    append_s, appended, t_total = 0.0, 0, time.perf_counter()

    def batch_append(slots, starts, width):
        nonlocal append_s, appended
        seq, pos, tok = np.full(width, -1, np.int32), np.zeros(width, np.int32), np.zeros(width, np.int32)
        i = 0
        for slot, start in zip(slots, starts):
            tail = reqs[slot][start:]
            span = slice(i, i + len(tail))
            seq[span], pos[span], tok[span] = slot, range(start, start + len(tail)), tail
            i += len(tail)
        k, v = kv(jnp.asarray(tok), jnp.asarray(pos))
        jax.block_until_ready((k, v, pc.state))
        t0 = time.perf_counter()
        pc.append(None, k, v, seq, pos)
        jax.block_until_ready(pc.state)
        append_s += time.perf_counter() - t0
        appended += i

    batch_append([0], [pc.admit(0, reqs[0])], len(reqs[0]))
    if reuse:
        pc.commit(0, reqs[0])
    width = None
    for b in range(1, len(reqs), s["batch"]):
        slots = list(range(b, min(b + s["batch"], len(reqs))))
        starts = [pc.admit(i, reqs[i], count_stats=reuse) for i in slots]
        width = width or s["batch"] * max(len(reqs[i]) - m for i, m in zip(slots, starts))
        batch_append(slots, starts, width)
    jax.block_until_ready(pc.state)
    return pc, append_s, time.perf_counter() - t_total, appended


def check_exact(a, b, slots):
    """Caches ``a`` (reuse) and ``b`` (none) give bit-identical rows to ``slots`` at the first and last layer."""
    seq = jnp.asarray(slots, jnp.int32)[:, None]
    pos = jnp.arange(b.state.max_pages_per_seq * b.page, dtype=jnp.int32)[None, :]
    for layer in {0, b.state.groups[0].num_layers - 1}:
        if not np.array_equal(np.asarray(rows_reference(a.state, layer, seq, pos)).view(np.uint16),
                              np.asarray(rows_reference(b.state, layer, seq, pos)).view(np.uint16)):
            raise AssertionError(f"prefix reuse changed what sequences {slots} read at layer {layer}")


def table(s, sm):
    return (f"prefix reuse: {s['requests']} requests x ({s['prompt']} shared + {s['suffix']} unique) tokens, page "
            f"{s['page']}, first_n {s['first_n']}, last_n {s['last_n']}, L={s['layers']} H={s['heads']} "
            f"D={s['head_dim']}, batch {s['batch']}, append backend {sm['backend']}\nhit rate {sm['hit_rate']:.1%} | "
            f"matched pages {sm['pages_saved_matched']} | low pages saved {sm['low_pages_saved']} | copy "
            f"{sm['copy_tbs']:.2f} TB/s | reads bit-exact: True\n\n"
            + md_table(("mode", "appended tokens", "low pages", "high pages", "append ms", "end-to-end ms",
                        "bytes floor ms"),
                       [(r["mode"], r["appended_tokens"], r["low_pages_used"], r["high_pages_used"],
                         f"{r['append_ms']:.1f}", f"{r['total_ms']:.1f}", f"{r['floor_ms']:.2f}") for r in sm["rows"]])
            + f"\n\nappend speed-up x{sm['append_speedup']:.2f}, end to end x{sm['total_speedup']:.2f}")


def main(argv=None):
    ap = bench_parser(__doc__)
    for key in PREFIX:
        ap.add_argument("--" + key.replace("_", "-"), type=int, default=None, help=f"default {PREFIX[key]}")
    args = ap.parse_args(argv)
    if no_gpu("prefix_bench", args.smoke):
        return 0
    base = PREFIX_SMOKE if args.smoke else PREFIX
    s = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in base.items()}
    backend = "auto" if on_gpu() else "reference"
    cfg = KVCacheConfig("mixed_nvfp4_bf16", first_n=s["first_n"], last_n=s["last_n"], page_size=s["page"])
    spec, kv = GroupSpec(s["layers"], s["heads"], s["head_dim"]), make_kv(s)
    rng = np.random.default_rng(0)
    system = rng.integers(0, 32000, s["prompt"]).tolist()
    reqs = [system + rng.integers(0, 32000, s["suffix"]).tolist() for _ in range(s["requests"])]
    runs = {}
    for mode, reuse in (("no_reuse", False), ("reuse", True)):
        run_workload(s, cfg, spec, kv, reqs[:1 + s["batch"]], reuse, backend)    # warm-up: compiles every shape
        timed = [run_workload(s, cfg, spec, kv, reqs, reuse, backend) for _ in range(s["repeats"])]
        runs[mode] = (timed[-1][0], statistics.median(t[1] for t in timed), statistics.median(t[2] for t in timed),
                      timed[-1][3])
    check_exact(runs["reuse"][0], runs["no_reuse"][0], [0, 1, s["requests"] - 1])
    copy_tbs = copy_bandwidth(not on_gpu())[0]
    kvh = spec.kv_factor * spec.num_kv_heads
    retained = min(1.0, (s["first_n"] + s["last_n"]) / (s["prompt"] + s["suffix"]))
    per_token = s["layers"] * kvh * (s["head_dim"] // 2 + s["head_dim"] // 16 + retained * s["head_dim"] * 2)
    rows = []
    for mode, (pc, append_s, total_s, appended) in runs.items():
        free_low, free_high = pc.free_pages()
        rows.append(dict(mode=mode, appended_tokens=appended, low_pages_used=int(pc.state.alloc.num_pages - free_low),
                         high_pages_used=int(pc.state.high_alloc.num_pages - free_high), append_ms=1e3 * append_s,
                         total_ms=1e3 * total_s, floor_ms=appended * per_token / copy_tbs / 1e9))
    stats = runs["reuse"][0].stats()
    nr, ru = rows
    sm = dict(versions(), shape=s, backend=backend, copy_tbs=copy_tbs, hit_rate=stats["hit_rate"],
              pages_saved_matched=stats["pages_saved"], low_pages_saved=nr["low_pages_used"] - ru["low_pages_used"],
              append_speedup=nr["append_ms"] / ru["append_ms"], total_speedup=nr["total_ms"] / ru["total_ms"],
              rows=rows)
    text = table(s, sm)
    print(text)
    write_json(args.out, "prefix_bench.json", sm)
    if on_gpu() and not args.no_md:
        append_results("prefix reuse (`bench/prefix_bench.py`)", sm, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
