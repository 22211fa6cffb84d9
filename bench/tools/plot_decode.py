"""Plot decode-attention time vs context for (a)-(f) and the bytes floors, one panel per batch size.

Reads every ``decode_bench*.json`` under ``--json-dir`` (written by `bench/decode_bench.py`; rows of several runs
are merged, the latest run wins for a repeated shape) and writes ``decode_attention.png`` under ``--out``.

Usage: ``python3 bench/tools/plot_decode.py --json-dir DIR [--out DIR]``
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

SERIES = [("mixed_ms", "(a) fused NVFP4 mixed (ours)", "o-"),
          ("mgpu_ms", "(f) Mosaic GPU NVFP4 mixed (ours)", "x-"),
          ("plain_ms", "(b) same kernel, bf16 pages", "s-"),
          ("jax_pa_ms", "(c) JAX Pallas paged_attention bf16", "^-"),
          ("stage_ms", "(d) stage (XLA) + paged attention", "v-"), ("sdpa_ms", "(e) torch SDPA bf16", "d-"),
          ("floor_nvfp4_ms", "NVFP4 bytes floor", "k--"), ("floor_bf16_ms", "bf16 bytes floor", "k:")]


def load_rows(json_dir):
    rows = {}
    for path in sorted(glob.glob(os.path.join(json_dir, "decode_bench*.json")), key=os.path.getmtime):
        with open(path) as f:
            data = json.load(f)
        for r in data.get("rows", []):
            if "error" not in r:
                rows[(r["batch"], r["context"])] = r
    return list(rows.values())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json-dir", required=True)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = load_rows(args.json_dir)
    if not rows:
        print(f"plot_decode: no decode_bench*.json rows under {args.json_dir}")
        return 1
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4.2), squeeze=False)
    for ax, b in zip(axes[0], batches):
        rs = sorted((r for r in rows if r["batch"] == b), key=lambda r: r["context"])
        for key, label, style in SERIES:
            pts = [(r["context"], r[key]) for r in rs if r.get(key)]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label, ms=4)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("ms per decode step (one layer)")
        ax.set_title(f"batch {b}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Decode attention on H200: 8 KV / 32 Q heads, head_dim 128, page 16")
    fig.tight_layout()
    out_dir = args.out or args.json_dir
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "decode_attention.png")
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
