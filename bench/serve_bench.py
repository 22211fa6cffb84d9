"""Serving at a fixed KV budget: measured concurrency and throughput of bf16, fp8 and the mixed cache.

    PYTHONPATH=. python3 bench/serve_bench.py --out DIR            # GPU: Llama-3-8B shape, 40 GiB KV, 8k-32k prompts
    PYTHONPATH=. python3 bench/serve_bench.py --smoke --out DIR    # CPU: the tiny model, a few requests

The same requests (lengths from `jmixedkv_demo/data/lengths.json`, random prompt tokens, greedy, no EOS) go through
`jmixedkv_demo.serve.ServingLoop` once per cache at the same KV budget (pools and twin included), random weights in
``--weights-dtype``. Per cache (`jmixedkv_demo.serve.serve_table`): slots, pages, bytes, peak concurrency, tokens/s,
time per output token and to the first token, ratios to bf16. ``--shared-prefix N``: every prompt starts with the
same N tokens, reused through `jmixedkv.PrefixCache` (``--no-prefix-reuse``: prefilled). ``--max-minutes`` skips a
cache the time spent predicts would not finish. Writes ``DIR/serve_bench.json`` (nothing to bench/RESULTS.md).
"""
from __future__ import annotations

import os
import time

# 40 GiB of pools, the weights and prefill activations need more than XLA's default 75% (kept if set)
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")

from common import bench_parser, md_table, parse_ints, versions, write_json  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jmixedkv import capacity as cap  # noqa: E402
from jmixedkv_demo import serve  # noqa: E402
from jmixedkv_demo.specs import parse_cache_spec  # noqa: E402

#: the H200 target: Llama-3-8B geometry, 40 GiB of KV cache, prompts of 8k-32k tokens
SERVE = dict(model="llama3-8b-shape", kv_budget="40GiB", requests=80, prompt_range=(8192, 32768),
             prompt_multiple=4096, output_scale=1.0, page=32, max_chunk=4096, caches=serve.SERVE_CACHES, seed=0,
             max_minutes=7.5, shared_prefix=0, prefix_reuse=True, weights_dtype="bfloat16")
#: the CPU smoke: the tiny model
SERVE_SMOKE = dict(SERVE, model="tiny", kv_budget="192KiB", requests=6, prompt_range=(16, 48), prompt_multiple=16,
                   output_scale=1 / 32, page=8, max_chunk=16, max_minutes=30.0)


def run(s: dict, out_dir: str) -> dict:
    t_start = time.perf_counter()
    info = dict(versions(), settings=dict(s))
    print(f"serve_bench {info['date']}: device {info['device']}, jax {info['jax']}, jaxlib {info.get('jaxlib')}, "
          f"triton {info.get('triton')}", flush=True)
    model_cfg = serve.MODELS[s["model"]]
    weights = serve.random_weights(model_cfg, s["weights_dtype"])
    jax.block_until_ready(weights)
    wbytes = serve.weight_bytes(weights)
    print(f"model {s['model']}: {model_cfg} (random {s['weights_dtype']} weights, {cap.format_bytes(wbytes)}, "
          f"{time.perf_counter() - t_start:.0f} s)", flush=True)
    budget = cap.parse_bytes(s["kv_budget"])
    reqs = serve.sample_requests(s["requests"], model_cfg.vocab_size, seed=s["seed"],
                                 prompt_range=tuple(s["prompt_range"]), prompt_multiple=s["prompt_multiple"],
                                 output_scale=s["output_scale"], shared_prefix=s["shared_prefix"])
    reuse = bool(s["shared_prefix"]) and s["prefix_reuse"]
    plen = np.array([len(r.prompt) for r in reqs])
    olen = np.array([r.max_new for r in reqs])
    max_len = max(r.cache_len for r in reqs)
    caches = [parse_cache_spec(c, max_len, s["page"]) for c in s["caches"].split(",")]
    print(f"{len(reqs)} requests: prompts {plen.min()}-{plen.max()} (mean {plen.mean():.0f}, {plen.sum():,} tokens), "
          f"outputs {olen.min()}-{olen.max()} (mean {olen.mean():.0f}); KV budget {cap.format_bytes(budget)}, page "
          f"{s['page']}, prefill chunk {s['max_chunk']}; shared prefix {s['shared_prefix']}, prefix reuse "
          f"{'on' if reuse else 'off'}", flush=True)
    shape = cap.ModelShape(model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim, name=s["model"])
    mean_len = int(round(float(np.mean([r.cache_len for r in reqs]))))
    for label, cfg in caches:
        c = cap.capacity(cfg, budget, shape, mean_len)
        print(f"  projection {label}: {c.sequences} sequences of {mean_len} tokens", flush=True)
    result = dict(info, prompt_tokens=plen.tolist(), output_tokens=olen.tolist(), kv_budget_bytes=budget,
                  weights_dtype=s["weights_dtype"], weight_bytes=wbytes, rows=[], skipped=[])
    rows, last_cost = [], 0.0
    for label, cfg in caches:
        elapsed = time.perf_counter() - t_start
        if last_cost and elapsed + last_cost > 60 * s["max_minutes"]:
            result["skipped"].append(label)
            print(f"STOPPED before {label}: {elapsed:.0f} s spent and the last cache took {last_cost:.0f} s, past "
                  f"--max-minutes {s['max_minutes']} (raise it, or lower --requests)", flush=True)
            continue
        t0 = time.perf_counter()
        rows += serve.serve_caches(weights, model_cfg, [(label, cfg)], reqs, budget, max_chunk=s["max_chunk"],
                                   prefix_reuse=reuse, progress=lambda m: print(f"  {m}", flush=True))
        last_cost = time.perf_counter() - t0
        result["rows"] = [{k: (str(v) if k == "config" else v) for k, v in r.items() if k != "outputs"} for r in rows]
        write_json(out_dir, "serve_bench.json", result)         # after every cache: a stopped run keeps its rows
    base = next((r for r in rows if r["config"].dtype == "bf16"), rows[0])
    for r in rows:                                              # same tokens as the first cache run
        r["same_tokens"] = float(np.mean([np.array_equal(a, b) for a, b in zip(r["outputs"], rows[0]["outputs"])]))
    headers, table = serve.serve_table([base] + [r for r in rows if r is not base])
    print(f"{s['model']}, {s['weights_dtype']} weights ({cap.format_bytes(wbytes)}), KV budget "
          f"{cap.format_bytes(budget)}, {len(reqs)} requests, prompts {plen.min()}-{plen.max()}:")
    print(cap.format_table(headers, table))
    print(md_table(headers, table))
    print(f"x first = ratio to {base['label']}; total {time.perf_counter() - t_start:.0f} s")
    result["rows"] = [{k: (str(v) if k == "config" else v) for k, v in r.items() if k != "outputs"} for r in rows]
    path = write_json(out_dir, "serve_bench.json", result)
    print(f"json: {path}")
    return result


#: the command line's overrides of `SERVE`: flag (``--`` + key) -> argparse keywords
FLAGS = dict(model=dict(choices=sorted(serve.MODELS)), kv_budget={}, requests=dict(type=int),
             prompt_range=dict(metavar="LO:HI"), prompt_multiple=dict(type=int), output_scale=dict(type=float),
             page=dict(type=int), max_chunk=dict(type=int), caches={}, seed=dict(type=int),
             max_minutes=dict(type=float), weights_dtype=dict(choices=("float32", "bfloat16")),
             shared_prefix=dict(type=int, help="prompt tokens every request shares (default 0)"))


def main(argv=None):
    ap = bench_parser(__doc__, md=False)
    for key, kw in FLAGS.items():
        ap.add_argument("--" + key.replace("_", "-"), default=None, **{"help": f"default {SERVE[key]!r}", **kw})
    ap.add_argument("--no-prefix-reuse", action="store_true", help="prefill shared prefixes anyway (baseline)")
    a = ap.parse_args(argv)
    s = dict(SERVE_SMOKE if a.smoke else SERVE)
    s.update({k: getattr(a, k) for k in FLAGS if getattr(a, k) is not None})
    if a.no_prefix_reuse:
        s["prefix_reuse"] = False
    if a.prompt_range:
        s["prompt_range"] = parse_ints(a.prompt_range, "--prompt-range", ":")
    run(s, a.out)


if __name__ == "__main__":
    main()
