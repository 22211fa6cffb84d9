"""A tiny Llama-style decoder in plain PyTorch whose attention runs on the torch-facing mixed-precision cache.

Owns `LlamaConfig`, `TinyLlama` (RoPE (NeoX style), GQA, RMSNorm, SwiGLU; deterministic random bf16 weights),
two KV caches behind one ``attend`` interface, greedy `generate`, and `compare` / `main` (the report of
``python -m interop.llama_torch [--device cuda]``):

* `DenseCache`: a plain bf16 torch KV cache ``[slots, H, S, D]`` per layer (the baseline).
* `MixedCache`: `interop.TorchKVCache` (NVFP4 history + first-N / last-N bf16 twin). Prefill and, by default,
  decode attention run on the staged cache (``stage(...).dense()``) with *the same* torch attention function as
  the baseline, so when every row is retained (``first_n + last_n >= total length``) the two models see
  bit-identical K/V and produce identical logits and tokens. ``decode="fused"`` uses
  ``TorchKVCache.decode_attention`` for decode steps instead (float32 JAX attention; close, not bit-equal).

Both caches use the same key length ``S = max_pages_per_seq * page_size`` so every reduction has the same shape.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import time
from typing import Optional

import numpy as np
import torch

from jmixedkv.config import KVCacheConfig

from .torch_cache import TorchKVCache

__all__ = ["LlamaConfig", "TinyLlama", "DenseCache", "MixedCache", "dense_attention", "generate", "compare", "main"]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 256
    dim: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    ffn: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    seed: int = 0


def _rms_norm(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _rope(x, positions, theta):
    """NeoX-style RoPE of ``x [B, T, H, D]`` at ``positions [B, T]`` in float32, cast back to ``x.dtype``."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d))
    ang = positions.float()[..., None] * inv.float()                       # [B, T, D/2]
    cos, sin = ang.cos()[:, :, None, :], ang.sin()[:, :, None, :]
    xf = x.float()
    a, b = xf[..., : d // 2], xf[..., d // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


def dense_attention(q, k, v, lens):
    """Causal GQA attention: ``q [B, Tq, Hq, D]``, ``k, v [B, H, S, D]``, ``lens [B]`` (query ``t`` sits at
    ``lens - Tq + t``) -> ``[B, Tq, Hq, D]`` in ``q.dtype`` (float32 math)."""
    b, tq, hq, d = q.shape
    h, s = k.shape[1], k.shape[2]
    qf = q.float().reshape(b, tq, h, hq // h, d)
    logits = torch.einsum("btkgd,bksd->btkgs", qf, k.float()) * (d ** -0.5)
    qpos = lens[:, None] - tq + torch.arange(tq, device=q.device)[None, :]
    mask = torch.arange(s, device=q.device)[None, None, :] <= qpos[..., None]        # [B, Tq, S]
    logits = logits.masked_fill(~mask[:, :, None, None, :], float("-inf"))
    p = torch.softmax(logits, dim=-1)
    out = torch.einsum("btkgs,bksd->btkgd", p, v.float())
    return out.reshape(b, tq, hq, d).to(q.dtype)


class TinyLlama(torch.nn.Module):
    """Llama-style decoder with deterministic random weights (``cfg.seed``), bf16 on ``device``."""

    def __init__(self, cfg: LlamaConfig, device="cpu", dtype=torch.bfloat16):
        super().__init__()
        self.cfg = cfg
        g = torch.Generator().manual_seed(cfg.seed)

        def w(*shape, scale=None):
            scale = 1.0 / math.sqrt(shape[0]) if scale is None else scale
            return torch.nn.Parameter((torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype),
                                      requires_grad=False)

        hq, h, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.embed = w(cfg.vocab, cfg.dim, scale=1.0)
        self.layers = torch.nn.ModuleList()
        for _ in range(cfg.num_layers):
            layer = torch.nn.Module()
            layer.wq, layer.wk, layer.wv = w(cfg.dim, hq * d), w(cfg.dim, h * d), w(cfg.dim, h * d)
            layer.wo = w(hq * d, cfg.dim)
            layer.w1, layer.w3, layer.w2 = w(cfg.dim, cfg.ffn), w(cfg.dim, cfg.ffn), w(cfg.ffn, cfg.dim)
            layer.attn_norm = torch.nn.Parameter(torch.ones(cfg.dim, device=device, dtype=dtype), requires_grad=False)
            layer.ffn_norm = torch.nn.Parameter(torch.ones(cfg.dim, device=device, dtype=dtype), requires_grad=False)
            self.layers.append(layer)
        self.norm = torch.nn.Parameter(torch.ones(cfg.dim, device=device, dtype=dtype), requires_grad=False)
        self.lm_head = w(cfg.dim, cfg.vocab)

    @torch.no_grad()
    def forward(self, tokens, positions, slots, cache):
        """``tokens, positions [B, T]`` (int), ``slots [B]`` cache slots -> float32 logits ``[B, T, vocab]``."""
        cfg = self.cfg
        b, t = tokens.shape
        x = self.embed[tokens]
        for i, layer in enumerate(self.layers):
            hN = _rms_norm(x, layer.attn_norm, cfg.norm_eps)
            q = _rope((hN @ layer.wq).view(b, t, cfg.num_heads, cfg.head_dim), positions, cfg.rope_theta)
            k = _rope((hN @ layer.wk).view(b, t, cfg.num_kv_heads, cfg.head_dim), positions, cfg.rope_theta)
            v = (hN @ layer.wv).view(b, t, cfg.num_kv_heads, cfg.head_dim)
            attn = cache.attend(i, slots, positions, q, k, v)
            x = x + attn.reshape(b, t, -1) @ layer.wo
            hN = _rms_norm(x, layer.ffn_norm, cfg.norm_eps)
            x = x + (torch.nn.functional.silu(hN @ layer.w1) * (hN @ layer.w3)) @ layer.w2
        return (_rms_norm(x, self.norm, cfg.norm_eps) @ self.lm_head).float()


class DenseCache:
    """Plain bf16 KV cache: per layer ``k, v [max_seqs, H, max_len, D]`` (zeros past each length)."""

    def __init__(self, cfg: LlamaConfig, max_seqs: int, max_len: int, device="cpu", dtype=torch.bfloat16):
        shape = (cfg.num_layers, max_seqs, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._next = 0

    def admit(self) -> int:
        self._next += 1
        return self._next - 1

    def attend(self, layer, slots, positions, q, k, v):
        b, t = positions.shape
        rows = slots[:, None].expand(b, t).reshape(-1).long()
        pos = positions.reshape(-1).long()
        self.k[layer, rows, :, pos] = k.reshape(b * t, *k.shape[2:])
        self.v[layer, rows, :, pos] = v.reshape(b * t, *v.shape[2:])
        lens = positions[:, -1] + 1
        return dense_attention(q, self.k[layer, slots.long()], self.v[layer, slots.long()], lens)


class MixedCache:
    """The model's attention on `TorchKVCache`: append, then attend over ``stage().dense()`` (or the fused
    ``decode_attention`` for single-token decode steps when ``decode="fused"``)."""

    def __init__(self, cache: TorchKVCache, decode: str = "stage"):
        if decode not in ("stage", "fused"):
            raise ValueError(f"MixedCache: decode must be 'stage' or 'fused', got {decode!r}")
        self.cache, self.decode = cache, decode

    def admit(self) -> int:
        return self.cache.admit()

    def attend(self, layer, slots, positions, q, k, v):
        b, t = positions.shape
        seq = slots[:, None].expand(b, t).reshape(-1).to(torch.int32)
        self.cache.append(layer, k.reshape(b * t, *k.shape[2:]).contiguous(),
                          v.reshape(b * t, *v.shape[2:]).contiguous(), seq, positions.reshape(-1).to(torch.int32))
        if self.decode == "fused" and t == 1:
            out, _ = self.cache.decode_attention(layer, q.contiguous(), slots.to(torch.int32))
            return out.to(q.device).clone()
        kd, vd = self.cache.stage(layer, slots.to(torch.int32)).dense()
        return dense_attention(q, kd.to(q.device), vd.to(q.device), positions[:, -1] + 1)


@torch.no_grad()
def generate(model: TinyLlama, cache, prompts, steps: int, force: Optional[torch.Tensor] = None):
    """Greedy decode. ``prompts``: list of token lists; each is prefilled alone (batch 1), then all decode together.

    ``force [B, steps]``: feed these tokens instead of the argmax (teacher forcing, for logit comparisons).
    Returns ``(tokens i64[B, steps], logits f32[B, steps, vocab])`` on the CPU."""
    device = model.embed.device
    slots, logits, lens = [], [], []
    for p in prompts:
        slot = cache.admit()
        toks = torch.tensor([p], device=device)
        pos = torch.arange(len(p), device=device, dtype=torch.int32)[None]
        out = model(toks, pos, torch.tensor([slot], device=device, dtype=torch.int32), cache)
        slots.append(slot)
        logits.append(out[0, -1])
        lens.append(len(p))
    slots_t = torch.tensor(slots, device=device, dtype=torch.int32)
    step_logits = [torch.stack(logits)]
    for step in range(1, steps):
        prev = step_logits[-1].argmax(-1) if force is None else force[:, step - 1].to(device)
        pos = torch.tensor(lens, device=device, dtype=torch.int32)[:, None] + (step - 1)
        step_logits.append(model(prev[:, None], pos, slots_t, cache)[:, 0])
    all_logits = torch.stack(step_logits, dim=1).cpu()
    return all_logits.argmax(-1), all_logits


def compare(cfg: LlamaConfig, first_n: int, last_n: int, prompts, steps: int, device="cpu", decode: str = "stage",
            page_size: int = 16, backend: str = "auto"):
    """Run the bf16 baseline and the mixed cache; returns a dict (tokens equal, token agreement, logit errors).

    Logit errors use teacher forcing (the mixed model is fed the baseline's tokens)."""
    total = max(len(p) for p in prompts) + steps
    max_pages = -(-total // page_size)
    model = TinyLlama(cfg, device)
    base_tokens, base_logits = generate(model, DenseCache(cfg, len(prompts), max_pages * page_size, device), prompts,
                                        steps)

    def mixed():
        kv = KVCacheConfig("mixed_nvfp4_bf16", first_n=first_n, last_n=last_n, page_size=page_size)
        return MixedCache(TorchKVCache(kv, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                       num_pages=len(prompts) * max_pages, max_seqs=len(prompts),
                                       max_pages_per_seq=max_pages, device=device, backend=backend), decode)

    t0 = time.perf_counter()
    tokens, _ = generate(model, mixed(), prompts, steps)
    seconds = time.perf_counter() - t0
    _, forced_logits = generate(model, mixed(), prompts, steps, force=base_tokens)
    err = (forced_logits - base_logits).abs()
    return {"first_n": first_n, "last_n": last_n, "decode": decode, "total_len": total,
            "all_high": first_n + last_n >= total, "tokens_equal": bool(torch.equal(tokens, base_tokens)),
            "token_agreement": float((tokens == base_tokens).float().mean()),
            "max_logit_err": float(err.max()), "mean_logit_err": float(err.mean()),
            "logit_scale": float(base_logits.abs().mean()), "seconds": seconds,
            "tokens": tokens.tolist(), "base_tokens": base_tokens.tolist()}


def default_prompts(vocab: int, lengths=(13, 21, 30), seed: int = 1):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def main(argv=None):
    ap = argparse.ArgumentParser(description="Tiny torch Llama on the jmixedkv torch cache vs a bf16 KV cache")
    ap.add_argument("--device", default="cpu", help="torch device: cpu or cuda (JAX must be on the same device)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--backend", default="auto")
    args = ap.parse_args(argv)
    cfg = LlamaConfig()
    prompts = default_prompts(cfg.vocab)
    total = max(map(len, prompts)) + args.steps
    print(f"tiny llama: {cfg.num_layers} layers, {cfg.num_heads} q heads / {cfg.num_kv_heads} kv heads, "
          f"head_dim {cfg.head_dim}; prompts {[len(p) for p in prompts]}, {args.steps} greedy steps, "
          f"total length {total}, device {args.device}")
    print(f"{'first_n':>7} {'last_n':>6} {'decode':>6} {'all-high':>8} {'tokens==bf16':>12} {'agree':>6} "
          f"{'max|dlogit|':>11} {'mean|dlogit|':>12} {'mean|logit|':>11} {'s':>6}")
    rows = []
    for first_n, last_n, decode in [(total, total, "stage"), (total, total, "fused"), (4, 16, "stage"),
                                    (4, 16, "fused"), (0, 0, "stage")]:
        r = compare(cfg, first_n, last_n, prompts, args.steps, args.device, decode, backend=args.backend)
        rows.append(r)
        print(f"{first_n:>7} {last_n:>6} {decode:>6} {str(r['all_high']):>8} {str(r['tokens_equal']):>12} "
              f"{r['token_agreement']:>6.2f} {r['max_logit_err']:>11.4g} {r['mean_logit_err']:>12.4g} "
              f"{r['logit_scale']:>11.4g} {r['seconds']:>6.2f}")
    ok = rows[0]["tokens_equal"] and rows[0]["max_logit_err"] == 0.0
    print("all-high (stage) == bf16 cache, bit-exact logits:", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
