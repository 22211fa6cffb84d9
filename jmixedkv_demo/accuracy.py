"""``jmixedkv bench accuracy``: every KV cache format scored on your own texts, with a per-position KL curve.

For each text and each cache (`jmixedkv_demo.specs`; the bf16 cache is the reference and comes first), SmolLM2-135M
(`jmixedkv_demo.gguf`) is teacher-forced through `jmixedkv_demo.model.evaluate_caches`: the first ``tokens - window``
tokens are prefilled exactly, then ``window`` decode steps are scored, each reading what the cache serves at its own
step. Per cache and text: mean KL(bf16 || cache) of the next-token distribution (nats), its multiple of fp8's KL,
perplexity, top-1 agreement, attention-output error, KV bytes per element at the run's length (twin and pages
included), and the KL curve over the scored positions in ``buckets`` equal buckets (``kl_buckets``): whether the
twin still helps when the position is far from the start and only ``last_n`` rows behind it are high.

Across texts (`summary`): per cache the KL multiple of fp8 on every text, its mean and its worst text.

Shapes: ``T`` scored positions (``window``), ``N = tokens + 1`` token ids per text.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from jmixedkv import capacity as cap

from .specs import UsageError, cache_list

__all__ = ["SWEEP_CACHES", "BENCH_CACHES", "run_accuracy", "kl_buckets", "summary", "summary_table",
           "bucket_table", "plot_accuracy"]

#: the levers and windows of the recommended-configuration sweep (page 16: <= 0.6 B/elem at 4096 tokens except
#: mixed(4,64) 0.609 and mixed(16,128) 0.641, the no-lever defaults they are compared with)
SWEEP_CACHES = ("bf16,fp8,nvfp4,mixed:4:64,mixed:16:128,mixed:4:64+rot,mixed:4:64+4o6,mixed:4:64+smooth,"
                "mixed_nvfp4_fp8:16:96,mixed_nvfp4_fp8:16:96+rot,mixed:4:32+rot+4o6,mixed:4:32+rot+smooth+4o6,"
                "mixed_nvfp4_fp8:16:96+rot+4o6,mixed_nvfp4_fp8:16:96+rot+smooth+4o6,"
                "mixed_nvfp4_fp8:4:112+rot+4o6,mixed_nvfp4_fp8:64:64+rot+4o6,nvfp4+rot+smooth+4o6")
#: ``jmixedkv bench accuracy``'s default caches
BENCH_CACHES = "bf16,fp8,nvfp4,mixed:4:64,mixed_nvfp4_fp8:16:96,recommended"


def kl_buckets(kl_per_position, buckets: int) -> list[dict]:
    """``kl_per_position f32[T]`` -> ``buckets`` contiguous buckets (fewer when ``T < buckets``) as dicts
    ``{"start", "stop", "kl"}``: scored positions ``[start, stop)`` (0 = the first scored step) and their mean KL."""
    t = len(kl_per_position)
    if buckets < 1:
        raise ValueError(f"buckets must be >= 1, got {buckets}")
    n = min(buckets, t)
    edges = [round(i * t / n) for i in range(n + 1)]
    return [{"start": a, "stop": b, "kl": sum(kl_per_position[a:b]) / (b - a)} for a, b in zip(edges, edges[1:])]


def run_accuracy(params, model, texts: dict, caches: str, tokens: int, window: int, page_size: int = 16,
                 buckets: int = 16, progress: Optional[Callable[[str], None]] = None) -> dict:
    """Score the caches of spec list ``caches`` on each text of ``texts`` (``{name: text}``).

    ``model`` is a `jmixedkv_demo.gguf.LoadedModel`, ``params`` its parameters as jax arrays. A text with fewer
    than ``tokens + 1`` tokens is refused (`UsageError` naming it) before any scoring. Returns the report: ``model``,
    ``device``, ``tokens``, ``window``, ``page_size``, ``buckets`` and ``texts``: per text ``prefix_len``,
    ``window``, ``seq_len``, ``seconds`` and ``results`` (per cache the metrics of `evaluate_caches` plus
    ``bytes_per_element``, ``high_fraction``, ``kl_over_fp8`` (None without an fp8 row), ``kl_buckets`` and the
    config's fields), then ``summary`` (`summary`)."""
    import jax

    from .demo import SMOLLM_SHAPE, device_name
    from .model import evaluate_caches, high_fraction
    if not 2 <= window < tokens - 1:
        raise UsageError(f"--window {window} must be in [2, --tokens - 1) = [2, {tokens - 1})")
    specs = cache_list(caches, tokens, page_size, lambda c: c.dtype != "bf16" or c.rotation or c.k_smoothing)
    ids = {}
    for name, text in texts.items():
        ids[name] = model.encode(text)
        if len(ids[name]) < tokens + 1:
            raise UsageError(f"text {name!r} has {len(ids[name])} tokens, fewer than --tokens {tokens} + 1 (pass a "
                             f"smaller --tokens or a longer text)")
    report = {"model": model.name, "device": device_name(), "jax": jax.__version__, "tokens": tokens,
              "window": window, "page_size": page_size, "buckets": buckets, "texts": {}}
    elems_per_token = SMOLLM_SHAPE.num_layers * 2 * SMOLLM_SHAPE.num_kv_heads * SMOLLM_SHAPE.head_dim
    for name, toks in ids.items():
        t0 = time.perf_counter()
        acc = evaluate_caches(params, model.cfg, toks[:tokens + 1], specs, tokens - window,
                              progress=None if progress is None else lambda label: progress(f"{name}: {label}"))
        acc.pop("prefix")
        seq_len = acc["seq_len"]
        fp8 = next((r["kl"] for r in acc["results"] if r["label"] == "fp8"), None)
        for r in acc["results"]:
            cfg = r.pop("config")
            r["bytes_per_element"] = (cap.capacity(cfg, 1 << 40, SMOLLM_SHAPE, seq_len).bytes_per_sequence
                                      / (seq_len * elems_per_token))
            r["high_fraction"] = high_fraction(cfg, seq_len)
            r["kl_over_fp8"] = r["kl"] / fp8 if fp8 else None
            r["kl_buckets"] = kl_buckets(r["kl_per_position"], buckets)
            r.update(dtype=cfg.dtype, first_n=cfg.first_n, last_n=cfg.last_n, rotation=cfg.rotation,
                     k_smoothing=cfg.k_smoothing, block_scale=cfg.block_scale)
        acc["seconds"] = time.perf_counter() - t0
        report["texts"][name] = acc
    report["summary"] = summary(report)
    return report


def summary(report: dict) -> list[dict]:
    """Per cache (in run order): ``label``, ``bytes_per_element`` (of the first text), ``kl_over_fp8`` per text,
    their ``mean``, the ``worst`` and ``worst_text`` (None entries when no fp8 row was run)."""
    texts = report["texts"]
    out = []
    for i, r0 in enumerate(next(iter(texts.values()))["results"]):
        per = {name: t["results"][i]["kl_over_fp8"] for name, t in texts.items()}
        vals = [v for v in per.values() if v is not None]
        worst = max(per, key=lambda k: per[k]) if len(vals) == len(per) else None
        out.append({"label": r0["label"], "bytes_per_element": r0["bytes_per_element"], "kl_over_fp8": per,
                    "mean": sum(vals) / len(vals) if vals and len(vals) == len(per) else None,
                    "worst": per[worst] if worst else None, "worst_text": worst})
    return out


def summary_table(report: dict) -> str:
    """Markdown: one row per cache, KL as a multiple of fp8's on each text, mean and worst (or plain KL in nats
    when no fp8 row was run)."""
    names = list(report["texts"])
    has_fp8 = report["summary"][0]["worst_text"] is not None
    unit = "KL / fp8" if has_fp8 else "KL (nats)"
    lines = [f"{unit} per text ({report['tokens']} tokens: {report['tokens'] - report['window']} prefilled exactly, "
             f"{report['window']} decode steps scored; page {report['page_size']}; B/elem at {report['tokens']} "
             f"tokens)", "",
             "| kv cache | B/elem | " + " | ".join(names) + (" | mean | worst |" if has_fp8 else " |"),
             "|---|---:|" + "---:|" * (len(names) + (2 if has_fp8 else 0))]
    for i, s in enumerate(report["summary"]):
        if has_fp8:
            cells = [f"{s['kl_over_fp8'][n]:.2f}" for n in names] + [f"{s['mean']:.2f}",
                                                                      f"{s['worst']:.2f} ({s['worst_text']})"]
        else:
            cells = [f"{report['texts'][n]['results'][i]['kl']:.4f}" for n in names]
        lines.append(f"| {s['label']} | {s['bytes_per_element']:.3f} | " + " | ".join(cells) + " |")
    if any(s["label"].startswith("recommended") for s in report["summary"]):
        from jmixedkv.config import RECOMMENDED
        lines += ["", "recommended = KVCacheConfig.recommended(): " + ", ".join(f"{k}={v!r}"
                                                                              for k, v in RECOMMENDED.items())]
    return "\n".join(lines) + "\n"


def bucket_table(report: dict, text: str) -> str:
    """Markdown: KL (nats) per scored-position bucket of one text, one row per cache (columns: the buckets'
    first absolute token positions)."""
    acc = report["texts"][text]
    first = acc["results"][0]["kl_buckets"]
    p = acc["prefix_len"]
    lines = [f"KL per position bucket, {text} (column: first position of the bucket; {len(first)} buckets of "
             f"{first[0]['stop'] - first[0]['start']} positions)", "",
             "| kv cache | " + " | ".join(str(p + b["start"]) for b in first) + " |",
             "|---|" + "---:|" * len(first)]
    for r in acc["results"][1:]:
        lines.append(f"| {r['label']} | " + " | ".join(f"{b['kl']:.4f}" for b in r["kl_buckets"]) + " |")
    return "\n".join(lines) + "\n"


def plot_accuracy(report: dict, path: str) -> None:
    """One panel per text: the KL-per-bucket curve of every cache (log scale), matplotlib (Agg), saved to ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(report["texts"])
    cols = min(3, len(names))
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.2 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        acc = report["texts"][name]
        for r in acc["results"][1:]:
            b = r["kl_buckets"]
            ax.plot([acc["prefix_len"] + (x["start"] + x["stop"]) / 2 for x in b], [max(x["kl"], 1e-7) for x in b],
                    marker=".", lw=1.1, label=r["label"])
        ax.set(yscale="log", xlabel="token position (scored decode steps)", ylabel="KL(bf16 || cache), nats",
               title=f"{report['model']}: {name}")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
