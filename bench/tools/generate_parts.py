"""Where the host time of a transformers ``generate()`` decode step goes: DynamicCache against `JMixedKVCache`
(mixed (4, 64), ``decode="fused"``), piece by piece, without a profiler.

SmolLM2's shape (``HF_MODELS["smollm2-shape"]`` of `bench/shapes.py`, built as `bench/hf_bench.py` builds it: 30
layers, 3 KV / 9 query heads, head_dim 64, random bf16 weights), batch 4 x 512 prompt tokens. Each piece is a method
wrapped in a ``perf_counter`` timer (~1 us per call; the wrappers reach into the bridge's internals, which is what
this tool is for). Per decode step = (a ``generate()`` of ``1 + new`` tokens - one of 1 token) / ``new``; best of
``--reps`` by whole step; Python's garbage collector off while timing. Prints and writes (``--out``, a folder:
``generate_parts.json``) microseconds and calls per decode step for every piece; nested pieces are indented under
the piece that calls them.

Pieces: DynamicCache's ``update`` and the ``sdpa`` attention function; `JMixedKVCache`'s layer ``update`` (with, once
per step, `JMixedKVCache.flush` -> `TorchKVCache.write_step` -> `jmixedkv.step.plan_write_layers` (the step's JAX
program: its dispatch), its error-bit read and ``to_jax``; the step's position check and `TorchKVCache.reserve_step`;
the placeholder K/V) and its ``jmixedkv`` attention function (with, once per step, `TorchKVCache.read_views` and the
`interop.paged_ops.step_attention` set-up; per layer `interop.triton_attention.PagedAttention`'s call and launch).

``--smoke``: 2 layers, 16 prompt tokens, 3 new, on the CPU (a script check: the CPU runs the reference attention).
"""
import collections
import functools
import gc
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers.cache_utils import DynamicLayer  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

from common import bench_parser, versions, write_json  # noqa: E402
from shapes import HF_MODELS  # noqa: E402
import interop.dlpack as dlpack  # noqa: E402
import interop.hf as hf  # noqa: E402
import interop.paged_ops as paged_ops  # noqa: E402
import interop.torch_cache as torch_cache  # noqa: E402
import interop.triton_attention as triton_attention  # noqa: E402
import jmixedkv.step as jstep  # noqa: E402
from jmixedkv import KVCacheConfig  # noqa: E402

MIXED = KVCacheConfig("mixed_nvfp4_bf16", first_n=4, last_n=64, page_size=16, max_draft_len=4)
#: (owner, attribute, label, depth): the pieces timed
PIECES = [
    (DynamicLayer, "update", "DynamicCache update", 0),
    (ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", "sdpa attention", 0),
    (hf.JMixedLayer, "update", "JMixedKVCache update", 0),
    (hf.JMixedKVCache, "flush", "flush (step)", 1),
    (torch_cache.TorchKVCache, "write_step", "write_step", 2),
    (jstep, "plan_write_layers", "plan_write_layers (JAX program dispatch)", 3),
    (torch_cache.TorchKVCache, "_raise_device_error", "error bits read", 3),
    (dlpack.HotBridge, "to_jax", "torch -> JAX crossing", 3),
    (hf.JMixedKVCache, "_new_rows", "position_ids check (step)", 1),
    (torch_cache.TorchKVCache, "reserve_step", "reserve_step (step)", 1),
    (hf.JMixedKVCache, "_marker", "placeholder K/V", 1),
    (ALL_ATTENTION_FUNCTIONS._global_mapping, hf.ATTN_IMPLEMENTATION, "jmixedkv attention", 0),
    (torch_cache.TorchKVCache, "read_views", "read_views (step)", 1),
    (dlpack.HotBridge, "to_torch", "JAX -> torch crossing", 2),
    (paged_ops, "step_attention", "step_attention set-up (step)", 1),
    (triton_attention.PagedAttention, "__call__", "PagedAttention call", 1),
    (triton_attention.PagedAttention, "_launch", "launch", 2),
]


def _wrap(owner, name: str, label: str, seconds, calls) -> None:
    mapping = isinstance(owner, dict)
    fn = owner[name] if mapping else getattr(owner, name)

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[label] += time.perf_counter() - t0
            calls[label] += 1

    if mapping:
        owner[name] = timed
    else:
        setattr(owner, name, timed)


def _model(device: str, layers):
    """The random-weight bf16 SmolLM2-shaped Llama of `bench/hf_bench.py`, built on ``device``."""
    cfg = dict(HF_MODELS["smollm2-shape"], **({"num_hidden_layers": layers} if layers else {}))
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg, attn_implementation="sdpa",
                                                                      torch_dtype=torch.bfloat16))
    return model.to(torch.bfloat16).eval(), f"smollm2-shape Llama, random weights ({cfg['num_hidden_layers']} layers)"


def _caches(model, batch: int, max_len: int) -> dict:
    def dynamic():
        model.set_attn_implementation("sdpa")
        return transformers.DynamicCache(config=model.config)

    def mixed_fused():
        model.set_attn_implementation(hf.ATTN_IMPLEMENTATION)
        return hf.JMixedKVCache.for_model(model, MIXED, max_batch_size=batch, max_cache_len=max_len, decode="fused",
                                          validate=False)
    return {"DynamicCache": dynamic, "JMixedKVCache mixed (4, 64) fused": mixed_fused}


def _generate(model, ids, cache, new: int) -> None:
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                   do_sample=False, pad_token_id=0, **{hf.CACHE_KWARG: cache})
    if ids.is_cuda:
        torch.cuda.synchronize()


def main(argv=None):
    ap = bench_parser(__doc__, md=False)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    layers, batch, prompt, new = (2, 2, 16, 3) if args.smoke else (None, 4, 512, 32)
    seconds, calls = collections.defaultdict(float), collections.defaultdict(int)
    for owner, name, label, _ in PIECES:
        _wrap(owner, name, label, seconds, calls)
    dev = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    model, desc = _model(dev, layers)
    ids = torch.randint(1, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(1))
    ids = ids.to(dev)
    out = dict(versions(torch), model=desc, batch=batch, prompt=prompt, new=new, reps=args.reps, caches={})
    for name, make in _caches(model, batch, prompt + new + 1).items():
        _generate(model, ids, make(), 1)                                   # warm-up: compiles
        _generate(model, ids, make(), new + 1)
        best = None
        for _ in range(args.reps):
            gc.collect()
            gc.disable()
            try:
                seconds.clear(), calls.clear()
                t0 = time.perf_counter()
                _generate(model, ids, make(), 1)
                one, one_calls, one_s = dict(seconds), dict(calls), time.perf_counter() - t0
                seconds.clear(), calls.clear()
                t0 = time.perf_counter()
                _generate(model, ids, make(), new + 1)
                step_us = (time.perf_counter() - t0 - one_s) / new * 1e6
            finally:
                gc.enable()
            pieces = {label: {"us": (seconds[label] - one.get(label, 0.0)) / new * 1e6,
                              "calls": (calls[label] - one_calls.get(label, 0)) / new} for label in seconds}
            if best is None or step_us < best["us_per_decode_step"]:
                best = {"us_per_decode_step": step_us, "pieces_per_decode_step": pieces}
        out["caches"][name] = best
        print(f"{name}: {best['us_per_decode_step']:.0f} us per decode step")
        for _, _, label, depth in PIECES:
            p = best["pieces_per_decode_step"].get(label)
            if p is not None:
                print(f"  {('  ' * depth + label):<50} {p['us']:9.1f} us {p['calls']:6.1f} calls")
    print("wrote", write_json(args.out, "generate_parts.json", out))


if __name__ == "__main__":
    main()
