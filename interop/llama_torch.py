"""A transformers ``LlamaForCausalLM`` (tiny, random weights) generating on the mixed cache vs ``DynamicCache``.

``python -m interop.llama_torch [--device cuda] [--steps 16]`` prints, for several mixed configurations, whether
greedy ``generate()`` on `interop.hf.JMixedKVCache` gives the ``DynamicCache`` tokens, the token agreement and the
teacher-forced logit error (both caches fed the ``DynamicCache`` tokens, so the contexts are the same).

* all-high (``first_n + last_n >= total length``) with ``decode="stage"``: every row the model reads is the bf16
  row it wrote, so tokens and logits equal ``DynamicCache`` bit for bit.
* ``decode="fused"``: decode steps run `TorchKVCache.decode_attention` (float32 attention) through
  ``attn_implementation="jmixedkv"``: close, not bit-equal.
* a short twin (e.g. first 4 / last 16): NVFP4 history, a reported logit error.

Prompts of different lengths are one left-padded batch (the padding is not stored in the cache).
"""
from __future__ import annotations

import argparse
import time
from typing import Optional

import numpy as np
import torch
import transformers
from transformers import DynamicCache

from jmixedkv.config import KVCacheConfig

from .hf import ATTN_IMPLEMENTATION, CACHE_KWARG, JMixedKVCache

__all__ = ["tiny_config", "build_model", "left_pad", "generate", "forced_logits", "compare", "default_prompts",
           "main"]


def tiny_config(vocab: int = 256, hidden: int = 128, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                head_dim: int = 32, ffn: int = 256) -> transformers.LlamaConfig:
    """A small random-weight Llama shape (RoPE, GQA, RMSNorm, SwiGLU: transformers' own modelling code)."""
    return transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                                    num_hidden_layers=layers, num_attention_heads=heads,
                                    num_key_value_heads=kv_heads, head_dim=head_dim, attn_implementation="sdpa")


def build_model(cfg: transformers.LlamaConfig, device="cpu", seed: int = 0) -> transformers.LlamaForCausalLM:
    """``LlamaForCausalLM(cfg)`` with deterministic random weights (``seed``), bf16, eval mode, on ``device``."""
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).to(device=device, dtype=torch.bfloat16).eval()


def left_pad(prompts, device="cpu", pad_id: int = 0):
    """``(input_ids i64[B, T], attention_mask i64[B, T])`` with the prompts left-padded to the longest."""
    t = max(map(len, prompts))
    ids = torch.full((len(prompts), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), t), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, t - len(p):] = torch.tensor(p)
        mask[b, t - len(p):] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def generate(model, cache, prompts, steps: int):
    """Greedy ``model.generate`` of ``steps`` tokens on ``cache``: ``i64[B, steps]`` on the CPU."""
    ids, mask = left_pad(prompts, next(model.parameters()).device)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                         pad_token_id=0, **{CACHE_KWARG: cache})
    return out[:, ids.shape[1]:].cpu()


@torch.no_grad()
def forced_logits(model, cache, prompts, forced: torch.Tensor):
    """Teacher forcing: prefill, then feed ``forced [B, steps]`` one step at a time; float32 logits
    ``[B, steps, vocab]`` on the CPU (step ``s`` predicts token ``s`` from the prompt + ``forced[:, :s]``)."""
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(ids, attention_mask=mask, position_ids=pos, **{CACHE_KWARG: cache})
    logits = [out.logits[:, -1].float()]
    for s in range(forced.shape[1] - 1):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        pos = (mask.sum(-1, keepdim=True) - 1)
        out = model(forced[:, s:s + 1].to(device), attention_mask=mask, position_ids=pos, **{CACHE_KWARG: cache})
        logits.append(out.logits[:, -1].float())
    return torch.stack(logits, 1).cpu()


def compare(cfg: transformers.LlamaConfig, first_n: int, last_n: int, prompts, steps: int, device="cpu",
            decode: str = "stage", page_size: int = 16, backend: str = "auto", model=None):
    """Run ``DynamicCache`` and the mixed cache on the same model; returns a dict (tokens equal, token agreement,
    teacher-forced logit errors, seconds of the mixed ``generate``)."""
    model = build_model(cfg, device) if model is None else model
    total = max(len(p) for p in prompts) + steps
    kv = KVCacheConfig("mixed_nvfp4_bf16", first_n=first_n, last_n=last_n, page_size=page_size)

    def mixed():
        return JMixedKVCache.for_model(model, kv, max_batch_size=len(prompts), max_cache_len=total, decode=decode,
                                       backend=backend)

    model.set_attn_implementation("sdpa")
    base_tokens = generate(model, DynamicCache(config=model.config), prompts, steps)
    base_logits = forced_logits(model, DynamicCache(config=model.config), prompts, base_tokens)
    model.set_attn_implementation(ATTN_IMPLEMENTATION if decode == "fused" else "sdpa")
    try:
        t0 = time.perf_counter()
        tokens = generate(model, mixed(), prompts, steps)
        seconds = time.perf_counter() - t0
        logits = forced_logits(model, mixed(), prompts, base_tokens)
    finally:
        model.set_attn_implementation("sdpa")
    err = (logits - base_logits).abs()
    return {"first_n": first_n, "last_n": last_n, "decode": decode, "total_len": total,
            "all_high": first_n + last_n >= total, "tokens_equal": bool(torch.equal(tokens, base_tokens)),
            "token_agreement": float((tokens == base_tokens).float().mean()),
            "max_logit_err": float(err.max()), "mean_logit_err": float(err.mean()),
            "logit_scale": float(base_logits.abs().mean()), "seconds": seconds,
            "tokens": tokens.tolist(), "base_tokens": base_tokens.tolist()}


def default_prompts(vocab: int, lengths=(13, 21, 30), seed: int = 1):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, n).tolist() for n in lengths]


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description="transformers Llama (tiny, random) on the jmixedkv cache vs "
                                             "DynamicCache")
    ap.add_argument("--device", default="cpu", help="torch device: cpu or cuda (JAX must be on the same device)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--backend", default="auto")
    args = ap.parse_args(argv)
    cfg = tiny_config()
    model = build_model(cfg, args.device)
    prompts = default_prompts(cfg.vocab_size)
    total = max(map(len, prompts)) + args.steps
    print(f"LlamaForCausalLM (random): {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} q heads / "
          f"{cfg.num_key_value_heads} kv heads, head_dim {cfg.head_dim}; prompts {[len(p) for p in prompts]} "
          f"(left-padded), {args.steps} greedy steps, total length {total}, device {args.device}")
    print(f"{'first_n':>7} {'last_n':>6} {'decode':>6} {'all-high':>8} {'tokens==dyn':>11} {'agree':>6} "
          f"{'max|dlogit|':>11} {'mean|dlogit|':>12} {'mean|logit|':>11} {'s':>6}")
    rows = []
    for first_n, last_n, decode in [(total, total, "stage"), (total, total, "fused"), (4, 16, "stage"),
                                    (4, 16, "fused"), (0, 0, "stage")]:
        r = compare(cfg, first_n, last_n, prompts, args.steps, args.device, decode, backend=args.backend,
                    model=model)
        rows.append(r)
        print(f"{first_n:>7} {last_n:>6} {decode:>6} {str(r['all_high']):>8} {str(r['tokens_equal']):>11} "
              f"{r['token_agreement']:>6.2f} {r['max_logit_err']:>11.4g} {r['mean_logit_err']:>12.4g} "
              f"{r['logit_scale']:>11.4g} {r['seconds']:>6.2f}")
    ok = rows[0]["tokens_equal"] and rows[0]["max_logit_err"] == 0.0
    print("all-high (stage) == DynamicCache, bit-exact logits:", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
