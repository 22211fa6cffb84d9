"""transformers ``generate()`` through the cache, every format and decode mode (`JMixedKVCache` ``"stage"`` /
``"fused"``, `JMixedStaticCache` ``"static"``), beside DynamicCache (eager) and StaticCache (compiled); per cache:
ms per token, ms per decode step (a 1-token run subtracted), tokens/s, token agreement with DynamicCache and the
bridge's cost per layer (``--profile-host N``: and where its host time goes, `host_profile`; ``--rounds R``: then
R interleaved rounds, medians and paired ratios to DynamicCache, `interleaved_rounds`). Models:
`shapes.HF_MODELS`, random bf16 weights. ``--profile-prefill DIR`` instead: where
the first step (prefill + one token) of each cache spends its time (`profile_prefill`).

    python bench/hf_bench.py --model smollm2-shape --batch 4 --prompt 512 --new 32
    python bench/hf_bench.py --new 33 --rounds 12 --caches "DynamicCache;jmixedkv mixed(4,64) (fused)"
    python bench/hf_bench.py --model llama3-8b-shape --batch 16 --prompt 8192 --new 16 \
        --caches "DynamicCache;StaticCache;jmixedkv mixed(4,64) (fused)"
    python bench/hf_bench.py --profile-prefill DIR --batch 4 --prompt 512   # StaticCache beside static mixed
    python bench/hf_bench.py --smoke --out /tmp/hf.json    # CPU: a 2-layer model, 3 tokens
"""
from __future__ import annotations

import cProfile
import gc
import json
import os
import pstats
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")      # torch and JAX share the GPU

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import DynamicCache, StaticCache  # noqa: E402

from common import bench_parser, error_text, hf_generate, interleaved_ms_per_step, versions, write_json  # noqa: E402
from shapes import HF_MODELS  # noqa: E402

import jax  # noqa: E402

from interop.hf import ATTN_IMPLEMENTATION, JMixedKVCache  # noqa: E402
from interop.hf_static import JMixedStaticCache  # noqa: E402
from jmixedkv import KVCacheConfig  # noqa: E402

#: every jmixedkv cache the bench can run: name -> `KVCacheConfig`, in every decode mode (K smoothing: the static
#: cache only, the one that holds the K means itself)
PAGE = 16
JM = {"bf16": KVCacheConfig("bf16", page_size=PAGE, max_draft_len=4),
      "fp8": KVCacheConfig("fp8", page_size=PAGE, max_draft_len=4),
      "nvfp4": KVCacheConfig("nvfp4", page_size=PAGE, max_draft_len=4),
      "mixed(4,64)": KVCacheConfig("mixed_nvfp4_bf16", first_n=4, last_n=64, page_size=PAGE, max_draft_len=4),
      "recommended": KVCacheConfig.recommended(max_draft_len=4),
      "recommended+k_smoothing": KVCacheConfig.recommended(max_draft_len=4, k_smoothing=True)}
MODES = ("stage", "fused", "static")
#: ``--caches`` / ``--reps`` / ``--new`` when not given: for the generate table, for ``--profile-prefill``
DEFAULTS = dict(caches="all", reps=1, new=64)
PROFILE_DEFAULTS = dict(caches="StaticCache;jmixedkv mixed(4,64) (static)", reps=3, new=32)


def load_model(name: str, device: str, layers: int | None):
    """A random-weight bf16 ``LlamaForCausalLM`` of `shapes.HF_MODELS` ``name`` built on ``device``."""
    cfg = dict(HF_MODELS[name], **({"num_hidden_layers": layers} if layers else {}))
    torch.manual_seed(0)
    with torch.device(device):                  # random bf16 weights built where they run (8B: no host copy)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg, attn_implementation="sdpa",
                                                                      torch_dtype=torch.bfloat16))
    return model.to(torch.bfloat16).eval(), f"{name} Llama, random weights ({cfg['num_hidden_layers']} layers)"


def time_generate(model, ids, make_cache, new, device, reps):
    """Best of ``reps`` timed runs after a warm-up (compiles); returns (total s, prefill-only s, tokens)."""
    hf_generate(model, ids, make_cache(), 1, device)                   # warm-up: prefill + one step compiled
    hf_generate(model, ids, make_cache(), new, device)
    best, best1, out = float("inf"), float("inf"), None
    for _ in range(reps):
        t0 = time.perf_counter()
        hf_generate(model, ids, make_cache(), 1, device)               # prefill + 1 token: subtracted below
        best1 = min(best1, time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = hf_generate(model, ids, make_cache(), new, device)
        best = min(best, time.perf_counter() - t0)
    return best, best1, out


def caches(model, batch, max_len, backend, which):
    """name -> (factory, must equal DynamicCache's tokens) for the names in ``which``."""
    cfg = model.config

    def jm(kv, decode):
        def make():
            model.set_attn_implementation(ATTN_IMPLEMENTATION if decode != "stage" else "sdpa")
            if decode == "static":
                return JMixedStaticCache.for_model(model, kv, max_batch_size=batch, max_cache_len=max_len)
            return JMixedKVCache.for_model(model, kv, max_batch_size=batch, max_cache_len=max_len, decode=decode,
                                           backend=backend, validate=False)
        return make

    def plain(make):
        def f():
            model.set_attn_implementation("sdpa")
            return make()
        return f

    out = {"DynamicCache": (plain(lambda: DynamicCache(config=cfg)), None),
           "StaticCache": (plain(lambda: StaticCache(config=cfg, max_cache_len=max_len)), True)}
    for fmt, kv in JM.items():
        for decode in MODES if not kv.k_smoothing else ("static",):
            out[f"jmixedkv {fmt} ({decode})"] = (jm(kv, decode), fmt == "bf16" and decode == "stage")
    unknown = set() if which == "all" else which - set(out)
    if unknown:
        raise SystemExit(f"hf_bench: unknown --caches {sorted(unknown)}; expected names from {sorted(out)}")
    return {k: v for k, v in out.items() if which == "all" or k in which}


def bench_generate(model, args, device):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, model.config.vocab_size, (args.batch, args.prompt), generator=g).to(device)
    max_len = args.prompt + args.new
    layers = model.config.num_hidden_layers
    rows, want, ref = [], None, {}
    which = "all" if args.caches == "all" else set(args.caches.split(";"))
    for name, (make, must_equal) in caches(model, args.batch, max_len, args.backend, which).items():
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()                             # the last cache's memory back (JAX allocates too)
        try:
            t, t1, out = time_generate(model, ids, make, args.new, device, args.reps)
        except Exception as e:                                   # noqa: BLE001 -- reported in the table
            rows.append(dict(cache=name, error=error_text(e)))
            print(f"{name:30s} FAILED {rows[-1]['error']}", flush=True)
            continue
        step_ms = 1e3 * (t - t1) / (args.new - 1)               # decode steps only (prefill subtracted)
        new_tokens = out[:, args.prompt:].cpu()
        if want is None:
            want = new_tokens
        if name in ("DynamicCache", "StaticCache"):
            ref[name] = step_ms
        agree = float((new_tokens == want).float().mean())
        row = dict(cache=name, seconds=t, prefill_plus_one_s=t1, ms_per_token=1e3 * t / args.new,
                   ms_per_decode_step=step_ms, tokens_per_s=args.batch * args.new / t,
                   decode_tokens_per_s=1e3 * args.batch / step_ms, token_agreement_vs_dynamic=agree,
                   must_equal_dynamic=must_equal)
        for base in ("DynamicCache", "StaticCache"):             # the bridge's cost per layer, against each
            if base in ref and name != base:
                row[f"us_per_layer_vs_{base}"] = 1e3 * (step_ms - ref[base]) / layers
        if args.profile_host:
            row["host_profile"] = host_profile(model, ids, make, args.new, device, args.profile_host)
        rows.append(row)
        extra = " ".join(f"{k[-12:]}={v:+.0f}us" for k, v in row.items() if k.startswith("us_per_layer"))
        print(f"{name:30s} {row['ms_per_token']:8.2f} ms/token {step_ms:8.2f} ms/step "
              f"{row['tokens_per_s']:9.1f} tok/s agree {agree:.3f} {extra}", flush=True)
    model.set_attn_implementation("sdpa")
    return rows


def interleaved_rounds(model, args, device, names) -> list:
    """``--rounds R``: every cache of ``names`` once per round, back to back, R rounds (a GPU host's single runs vary
    by +-30% between and within processes; the sequential best-of-reps table cannot tell a 10% change). Per cache:
    the median and best ms per decode step and, with ``DynamicCache`` among them, the median of its ratio to
    ``DynamicCache`` within a round (paired)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, model.config.vocab_size, (args.batch, args.prompt), generator=g).to(device)
    made = caches(model, args.batch, args.prompt + args.new, args.backend, set(names))
    times = interleaved_ms_per_step(lambda name, n: hf_generate(model, ids, made[name][0](), n, device), names,
                                    args.rounds, args.new)
    model.set_attn_implementation("sdpa")
    dyn, rows = times.get("DynamicCache"), []
    for name in names:
        x = times[name]
        rows.append(dict(cache=name, ms_per_decode_step_median=statistics.median(x), ms_per_decode_step_min=min(x),
                         paired_ratio_vs_DynamicCache=None if dyn is None else
                         statistics.median(a / b for a, b in zip(x, dyn)), rounds=x))
        ratio = rows[-1]["paired_ratio_vs_DynamicCache"]
        print(f"{name:30s} rounds: {rows[-1]['ms_per_decode_step_median']:8.2f} ms/step median "
              f"{min(x):8.2f} best" + ("" if ratio is None else f"  x DynamicCache {ratio:.3f} (paired)"), flush=True)
    return rows


def host_profile(model, ids, make, new, device, top):
    """``--profile-host N``: cProfile one ``generate()`` of ``new`` tokens (after the timed runs) and return / print the
    ``N`` functions with the most own time and the bridge's (``interop`` / ``jmixedkv`` / DLPack) by cumulative time,
    each ``{function, calls, own_s, cum_s}``. A host-bound bridge shows as own time spread over the host; a call that
    waits on the GPU shows as one function's own time."""
    cache = make()
    prof = cProfile.Profile()
    prof.enable()
    hf_generate(model, ids, cache, new, device)
    prof.disable()
    st = pstats.Stats(prof)
    bridge_files = (os.sep + "interop" + os.sep, os.sep + "jmixedkv" + os.sep, "dlpack")
    rows = [dict(function=f"{os.path.basename(f)}:{line}({fn})", calls=nc, own_s=tt, cum_s=ct,
                 bridge=any(k in f for k in bridge_files)) for (f, line, fn), (_, nc, tt, ct, _) in st.stats.items()]
    own = sorted(rows, key=lambda r: -r["own_s"])[:top]
    bridge = sorted((r for r in rows if r["bridge"]), key=lambda r: -r["cum_s"])[:top]
    print(f"  host profile, {st.total_tt:.3f} s in one generate() of {new} tokens; own / cumulative s, calls:")
    for label, part in (("most own time", own), ("the bridge by cumulative time", bridge)):
        print(f"    {label}:")
        for r in part:
            print(f"      {r['own_s']:8.4f} {r['cum_s']:8.4f} {r['calls']:7d}  {r['function']}")
    return dict(total_s=st.total_tt, own=own, bridge=bridge)


def first_step_ms(model, ids, make, device, reps, reuse):
    """ms of ``reps`` calls of prefill + one token: a fresh cache each (its construction timed), or one cache reset
    (untimed) between calls."""
    cache, out = (make() if reuse else None), []
    for _ in range(reps):
        if reuse:
            cache.reset()
        t0 = time.perf_counter()
        hf_generate(model, ids, cache if reuse else make(), 1, device)
        out.append(1e3 * (time.perf_counter() - t0))
    return out


def profile_prefill(model, desc, args, device):
    """``--profile-prefill DIR``: per cache, the first step's wall time with a fresh cache per call and with one
    cache reset between calls (`first_step_ms`), and torch.profiler tables (self CPU and, on CUDA, self CUDA time)
    of one fresh-cache call, printed and written as ``DIR/<cache>-<key>.txt``."""
    os.makedirs(args.profile_prefill, exist_ok=True)
    ids = torch.randint(1, model.config.vocab_size, (args.batch, args.prompt),
                        generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        for name, (make, _) in caches(model, args.batch, args.prompt + args.new, args.backend,
                                      set(args.caches.split(";"))).items():
            for _ in range(2):
                hf_generate(model, ids, make(), 2, device)             # compile / warm
            fresh, reused = (first_step_ms(model, ids, make, device, args.reps, r) for r in (False, True))
            print(f"{name:34s} prefill+1 ms fresh cache {[round(x, 1) for x in fresh]} reused "
                  f"{[round(x, 1) for x in reused]}", flush=True)
            cuda = device.startswith("cuda")
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
            with torch.profiler.profile(activities=acts) as prof:
                hf_generate(model, ids, make(), 1, device)
            tag = name.replace(" ", "_").replace("(", "").replace(")", "").replace(",", "-")
            for key in ("self_cpu_time_total",) + (("self_cuda_time_total",) if cuda else ()):
                table = prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=70)
                with open(os.path.join(args.profile_prefill, f"{tag}-{key}.txt"), "w") as f:
                    f.write(f"{desc}, batch {args.batch} x prompt {args.prompt}, {name}\n{table}\n")
                print(f"--- {name} by {key}\n" + "\n".join(table.splitlines()[:22]), flush=True)
    return 0


def main(argv=None):
    p = bench_parser(__doc__, out="bench/out", md=False)          # a folder, or a path ending in .json
    p.add_argument("--model", default="smollm2-shape", choices=sorted(HF_MODELS))
    p.add_argument("--caches", default=None, help="'all' or names separated by ';' (see the table; default all)")
    p.add_argument("--layers", type=int, default=None, help="fewer layers (a quick CPU run)")
    for flag, default in (("--batch", 4), ("--prompt", 512), ("--new", None), ("--reps", None)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--backend", default="auto")
    p.add_argument("--rounds", type=int, default=0, help="then R interleaved rounds of the caches that ran "
                   "(`interleaved_rounds`: medians, ratios to DynamicCache within a round)")
    p.add_argument("--profile-host", metavar="N", type=int, default=0,
                   help="after each cache's timing, cProfile one generate() and list the N heaviest host functions")
    p.add_argument("--profile-prefill", metavar="DIR", default=None, help="profile the first step instead (defaults "
                   f"{PROFILE_DEFAULTS}); its tables go to DIR")
    args = p.parse_args(argv)
    for k, v in (PROFILE_DEFAULTS if args.profile_prefill else DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.smoke:      # 2 layers, batch 1, 16-token prompt, 3 new tokens, the mixed cache fused, recommended static
        args.layers, args.batch, args.prompt, args.new = 2, 1, 16, 3
        args.caches = "jmixedkv mixed(4,64) (fused);jmixedkv recommended (static)"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, desc = load_model(args.model, device, args.layers)
    if args.profile_prefill:
        return profile_prefill(model, desc, args, device)
    env = dict(versions(torch), jax_devices=str(jax.devices()), transformers=transformers.__version__, model=desc,
               batch=args.batch, prompt=args.prompt, new=args.new, backend=args.backend)
    print(json.dumps(env), flush=True)
    result = dict(env=env, generate=bench_generate(model, args, device))
    if args.rounds > 0:
        ran = [r["cache"] for r in result["generate"] if "error" not in r]
        result["rounds"] = interleaved_rounds(model, args, device, ran)
    if args.out.endswith(".json"):
        out_dir, name = os.path.dirname(args.out) or ".", os.path.basename(args.out)
    else:                                  # a folder, as every other bench's --out
        out_dir, name = args.out, "hf_bench.json"
    print("wrote", write_json(out_dir, name, result))
    return 0 if all("error" not in r for r in result["generate"]) else 1


if __name__ == "__main__":
    sys.exit(main())
