"""The ``jmixedkv`` command line: ``demo`` (the memory / accuracy / speed trade), ``capacity`` and ``bench``.

``jmixedkv demo`` generates greedily with a small Llama-style model (`jmixedkv.model`) over bf16, fp8, nvfp4 and
mixed NVFP4 + bf16-twin caches and prints one table: KV bytes per token / per sequence and what fits in a memory
budget for a real model shape, agreement of the generated tokens with the bf16 run, teacher-forced logit and
attention-output error against bf16, and tokens per second. ``--plot`` draws the error per cache position (the
retained first-N / last-N windows are exact) and per generated token.

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
CPU_BENCHES = ("real_activations",)


class CliError(Exception):
    """A bad value found after parsing; printed as ``jmixedkv: error: ...`` with exit code 2."""


# ---------------------------------------------------------------------------------------------- arguments
def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _bytes(text: str) -> int:
    try:
        return cap.parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _shape(text: str) -> cap.ModelShape:
    try:
        return cap.parse_model_shape(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_cache_spec(spec: str, total_len: int, page_size: int):
    """``bf16 | fp16 | fp8 | nvfp4 | mixed:F:L | mixed:all | mixed_nvfp4_fp8:F:L`` -> (label, KVCacheConfig).

    ``mixed`` is ``mixed_nvfp4_bf16``; ``all`` keeps every one of ``total_len`` tokens in the twin."""
    from .config import KVCacheConfig
    parts = spec.strip().split(":")
    name = {"mixed": "mixed_nvfp4_bf16"}.get(parts[0], parts[0])
    try:
        if len(parts) == 1:
            return parts[0], KVCacheConfig(name, page_size=page_size)
        if len(parts) == 2 and parts[1] == "all":
            return f"{parts[0]} all-high", KVCacheConfig(name, first_n=0, last_n=total_len, page_size=page_size)
        if len(parts) == 3:
            first_n, last_n = int(parts[1]), int(parts[2])
            return f"{parts[0]}({first_n},{last_n})", KVCacheConfig(name, first_n=first_n, last_n=last_n,
                                                                     page_size=page_size)
    except ValueError as e:
        raise CliError(f"cache spec {spec!r}: {e}") from None
    raise CliError(f"cache spec {spec!r}: expected NAME, NAME:all or NAME:FIRST_N:LAST_N "
                   f"(e.g. bf16, nvfp4, mixed:16:16, mixed:all)")


DEMO_CACHES = "bf16,fp8,nvfp4,mixed:16:16,mixed:32:64,mixed:all"
QUICK_CACHES = "bf16,nvfp4,mixed:8:8,mixed:all"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jmixedkv",
        description="Mixed-precision paged KV cache for JAX: NVFP4 history + a high-precision twin of the "
                    "first-N / last-N tokens of every sequence.",
        epilog="Examples:\n  jmixedkv demo\n  jmixedkv demo --quick --plot demo.png\n"
               "  jmixedkv capacity --model-shape llama3-8b --gpu-mem 80GiB --seq-len 32768\n"
               "  jmixedkv bench decode_attention --out bench/out\n\nExit codes: 0 ok, 2 bad arguments or "
               "(bench) no GPU.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    d = sub.add_parser("demo", help="generate with bf16 / fp8 / nvfp4 / mixed caches; print memory, accuracy, "
                                    "speed", description="Greedy generation with a small random-weight "
                       "Llama-style model (RoPE, GQA, SwiGLU) through each KV cache format, compared with a bf16 "
                       "cache. Accuracy is measured teacher-forced (every cache is fed the bf16 run's tokens).")
    d.add_argument("--caches", default=None, help=f"comma-separated cache specs (default {DEMO_CACHES!r}; "
                   f"--quick: {QUICK_CACHES!r}); NAME, NAME:all or NAME:FIRST_N:LAST_N")
    d.add_argument("--batch", type=_positive_int, default=None, help="sequences (default 4; --quick 2)")
    d.add_argument("--prompt-len", type=_positive_int, default=None, help="prompt tokens (default 96; --quick 24)")
    d.add_argument("--new-tokens", type=_positive_int, default=None,
                   help="generated tokens (default 32; --quick 8)")
    d.add_argument("--page-size", type=_positive_int, default=None, help="tokens per page (default 16; --quick 8)")
    d.add_argument("--quick", action="store_true", help="tiny model and sizes (a smoke run, seconds on CPU)")
    d.add_argument("--seed", type=_nonneg_int, default=0, help="weights and prompts seed (default 0)")
    d.add_argument("--attention", choices=("auto", "reference", "fused"), default="auto",
                   help="decode attention: fused kernel entry point when present (auto), or staged reference")
    _capacity_args(d, seq_len_default=8192)
    d.add_argument("--plot", metavar="PNG", help="write error vs cache position / generated token")
    d.add_argument("--json", metavar="PATH", help="write every metric as JSON")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")

    c = sub.add_parser("capacity", help="tokens / sequences of a model shape that fit in GPU memory",
                       description="KV cache capacity per dtype for a model shape (page rounding and the "
                                   "per-sequence twin counted).")
    _capacity_args(c, seq_len_default=8192)
    c.add_argument("--first-n", type=_nonneg_int, default=16, help="twin: first tokens kept high (default 16)")
    c.add_argument("--last-n", type=_nonneg_int, default=64, help="twin: last tokens kept high (default 64)")
    c.add_argument("--page-size", type=_positive_int, default=32, help="tokens per page (default 32)")

    b = sub.add_parser("bench", help="run the GPU benchmarks (bench/*.py)",
                       description="Run bench/NAME.py (or all) with --out DIR. The benches time GPU kernels: "
                                   "without a GPU this prints a message and exits with code 2, except the "
                                   f"CPU-capable ones: {', '.join(CPU_BENCHES)}.")
    b.add_argument("name", nargs="?", help="bench name (file stem); default: all")
    b.add_argument("--out", default="bench/out", help="output folder for JSON / plots (default bench/out)")
    b.add_argument("--list", action="store_true", help="list the benches and exit")
    return p


def _capacity_args(p, seq_len_default):
    p.add_argument("--model-shape", type=_shape, default=cap.MODEL_SHAPES["llama3-8b"],
                   help=f"named shape ({', '.join(cap.MODEL_SHAPES)}) or L,H,D (default llama3-8b)")
    p.add_argument("--gpu-mem", "--budget", dest="budget", type=_bytes, default=cap.parse_bytes("80GiB"),
                   help="memory for the KV cache, e.g. 80GiB, 141GB (default 80GiB)")
    p.add_argument("--seq-len", type=_positive_int, default=seq_len_default,
                   help=f"tokens per sequence for the capacity columns (default {seq_len_default})")


# ---------------------------------------------------------------------------------------------- capacity
def cmd_capacity(args) -> int:
    from .config import KVCacheConfig
    try:
        configs = [KVCacheConfig(d, page_size=args.page_size) for d in ("bf16", "fp8", "nvfp4")] + [
            KVCacheConfig(d, first_n=args.first_n, last_n=args.last_n, page_size=args.page_size)
            for d in ("mixed_nvfp4_bf16", "mixed_nvfp4_fp8")]
    except ValueError as e:
        raise CliError(str(e)) from None
    headers, rows = cap.capacity_table(configs, args.budget, args.model_shape, args.seq_len)
    print(f"KV cache capacity: {args.model_shape}, {cap.format_bytes(args.budget)} for KV, sequences of "
          f"{args.seq_len} tokens, page {args.page_size}")
    print(cap.format_table(headers, rows))
    return 0


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
    from .reference import stage_reference

    total = s.prompt_len + s.new_tokens
    caches = [parse_cache_spec(c, total, s.page_size) for c in s.caches.split(",") if c.strip()]
    if not caches:
        raise CliError("--caches: no cache spec given")
    if caches[0][1].dtype != "bf16":
        caches.insert(0, parse_cache_spec("bf16", total, s.page_size))     # the baseline runs first
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


def plot_demo(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    n = report["cached_len"]
    for m in report["results"][1:]:
        a.plot(range(n), m["kv0_rel_err_per_position"][:n], label=m["label"], lw=1.2)
        b.plot(range(1, len(m["logit_rel_err_per_step"]) + 1), m["logit_rel_err_per_step"], marker=".",
               label=m["label"])
    p = report["settings"]["prompt_len"]
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    a.axvline(p - 0.5, color="k", ls=":", lw=0.8)
    a.set(title="layer-0 K/V rows: relative error vs bf16 (retained windows are exact)",
          xlabel="cache position (prompt | generated)", ylabel="relative L2 error")
    b.set(title="teacher-forced logits: relative error vs bf16", xlabel="generated token", ylabel="relative L2 error")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cmd_demo(args) -> int:
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
    if args.plot:
        plot_demo(report, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        out = {k: v for k, v in report.items() if k != "results"}
        out["results"] = [{k: v for k, v in r.items() if k != "config"} for r in report["results"]]
        Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"json: {args.json}")
    return 0


# ---------------------------------------------------------------------------------------------- bench
def _benches():
    return sorted(p.stem for p in BENCH_DIR.glob("*.py") if not p.stem.startswith("_")) if BENCH_DIR.is_dir() \
        else []


def cmd_bench(args) -> int:
    names = _benches()
    if args.list:
        print("\n".join(names) if names else f"no benches found in {BENCH_DIR}")
        return 0
    if not names:
        raise CliError(f"no bench scripts found in {BENCH_DIR} (the benches ship with the source tree)")
    if args.name is not None and args.name not in names:
        raise CliError(f"unknown bench {args.name!r}; available: {', '.join(names)}")
    from .compat import on_gpu
    todo = [args.name] if args.name else names
    if not on_gpu() and not (args.name in CPU_BENCHES):
        print(f"jmixedkv bench: no GPU found (jax backend is {_device()}). The benches time Pallas kernels on a "
              f"CUDA GPU; on the GPU machine run: PYTHONPATH=. python3 bench/<name>.py --out DIR. "
              f"On CPU only these run (by name): {', '.join(CPU_BENCHES)}", file=sys.stderr)
        return EXIT_NO_GPU
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(BENCH_DIR.parent),
                                                                    os.environ.get("PYTHONPATH")])))
    worst = 0
    for name in todo:
        print(f"== bench {name}", flush=True)
        rc = subprocess.call([sys.executable, str(BENCH_DIR / f"{name}.py"), "--out", args.out], env=env)
        worst = worst or rc
    return worst


# ---------------------------------------------------------------------------------------------- main
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)            # usage errors: message + SystemExit(2)
    try:
        return {"demo": cmd_demo, "capacity": cmd_capacity, "bench": cmd_bench}[args.command](args)
    except CliError as e:
        print(f"jmixedkv: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
