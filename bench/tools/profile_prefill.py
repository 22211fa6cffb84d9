"""Where the first step (prefill + one token) of ``generate()`` spends its time, StaticCache beside
`JMixedStaticCache`: wall time with a fresh cache per call and with one cache reset between calls, then a
torch.profiler table (self CPU and self CUDA time) of one fresh-cache call.

    PYTHONPATH=. python3 bench/tools/profile_prefill.py --model smollm2-shape --batch 4 --prompt 512 --out /tmp/p
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import hf_bench  # noqa: E402


def wall(model, ids, make, device, reps, reuse):
    cache = make() if reuse else None
    out = []
    for _ in range(reps):
        if reuse:
            cache.reset()
        t0 = time.perf_counter()
        hf_bench.generate(model, ids, cache if reuse else make(), 1, device)
        out.append(1e3 * (time.perf_counter() - t0))
    return out


def micro(model, args, device, reps=50):
    """Per-call wall time (us) of the pieces of one layer's prefill append, at the model's shape."""
    from interop import paged_ops, triton_write
    from interop.static_cache import StaticPagedCache
    from jmixedkv import KVCacheConfig
    cfg = model.config
    hd = cfg.hidden_size // cfg.num_attention_heads
    kv = KVCacheConfig(dtype="mixed_nvfp4_bf16", first_n=4, last_n=64, page_size=16, max_draft_len=4)
    paged = StaticPagedCache(kv, cfg.num_hidden_layers, cfg.num_key_value_heads, hd, max_batch_size=args.batch,
                             max_cache_len=args.prompt + args.new, device=device)
    b, t, h = args.batch, args.prompt, cfg.num_key_value_heads
    k = torch.randn(b, h, t, hd, dtype=torch.bfloat16, device=device)
    pos = torch.arange(t, device=device)[None].expand(b, t)
    grp, index = paged.group_of(0)
    rows = k.transpose(1, 2).reshape(b * t, h, hd).contiguous()
    write = torch.ones(b, t, dtype=torch.bool, device=device)
    low, high = paged._slots(grp.page_table[:b], pos, write)
    low, high = low.reshape(-1), high.reshape(-1)

    def append():
        paged.reset()
        paged.append(0, k, k, pos)

    pieces = {"reset": paged.reset, "append (incl. reset)": append,
              "_slots": lambda: paged._slots(grp.page_table[:b], pos, write),
              "paged_ops.write_rows": lambda: paged_ops.write_rows(grp.pools, index, rows, rows, low, high, 16,
                                                                   "max6"),
              "triton_write.write_rows_": lambda: triton_write.write_rows_(
                  *grp.pools, index, rows, rows, low, high, 16, "max6", check_values=False)}
    out = {}
    for name, fn in pieces.items():
        fn()
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        _sync(device)
        out[name] = 1e6 * (time.perf_counter() - t0) / reps
        print(f"micro {name:28s} {out[name]:9.1f} us/call", flush=True)
    return out


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-shape")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--caches", default="StaticCache;jmixedkv mixed(4,64) (static)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--out", default="/tmp/profile_prefill")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    os.makedirs(args.out, exist_ok=True)
    model, desc = hf_bench.load_model(args.model, device, args.layers)
    ids = torch.randint(1, model.config.vocab_size, (args.batch, args.prompt),
                        generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        micro(model, args, device)
    which = set(args.caches.split(";"))
    makers = hf_bench.caches(model, args.batch, args.prompt + args.new, "auto", which)
    with torch.no_grad():
        for name, (make, _) in makers.items():
            for _ in range(2):
                hf_bench.generate(model, ids, make(), 2, device)                # compile / warm
            fresh = wall(model, ids, make, device, args.reps, reuse=False)
            reused = wall(model, ids, make, device, args.reps, reuse=True)
            print(f"{name:34s} prefill+1 ms fresh cache {[round(x, 1) for x in fresh]} reused "
                  f"{[round(x, 1) for x in reused]}", flush=True)
            acts = [torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
            with torch.profiler.profile(activities=acts) as prof:
                hf_bench.generate(model, ids, make(), 1, device)
            tag = name.replace(" ", "_").replace("(", "").replace(")", "").replace(",", "-")
            for key in ("self_cpu_time_total",) + (("self_cuda_time_total",) if device == "cuda" else ()):
                table = prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=70)
                with open(os.path.join(args.out, f"{tag}-{key}.txt"), "w") as f:
                    f.write(f"{desc}, batch {args.batch} x prompt {args.prompt}, {name}\n{table}\n")
                print(f"--- {name} by {key}\n" + "\n".join(table.splitlines()[:22]), flush=True)


if __name__ == "__main__":
    main()
