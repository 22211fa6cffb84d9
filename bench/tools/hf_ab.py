"""generate() through `JMixedKVCache`, A/B inside ONE process in interleaved rounds: the attention kernel keeping
a held step's rows itself against a copy launch first (`_Held.put`), and Triton's C launcher called directly
against Triton's runner (`interop.triton_launch.Launch`), beside eager ``DynamicCache``.

A GPU host's single runs of ``generate()`` vary by +-30% from one process to the next (and within one): each round
runs every variant once, back to back, and the table gives each variant's median and best time per decode step and
its median ratio to ``DynamicCache`` within a round (paired). Every variant's tokens are compared with its "before"
variant's and with ``DynamicCache``'s. CUDA only (``--smoke``: 2 layers on CPU, the torch reference path)::

    python bench/tools/hf_ab.py --rounds 12 --out bench/out
"""
from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from common import bench_parser, hf_generate, interleaved_ms_per_step, md_table, versions, write_json  # noqa: E402
from shapes import HF_MODELS  # noqa: E402
import interop.triton_launch as triton_launch  # noqa: E402
from interop.hf import ATTN_IMPLEMENTATION, JMixedKVCache  # noqa: E402
from jmixedkv import KVCacheConfig  # noqa: E402

MIXED = KVCacheConfig("mixed_nvfp4_bf16", first_n=4, last_n=64, page_size=16)
BF16 = KVCacheConfig("bf16", page_size=16)
DIRECT = triton_launch.Launch.__call__


def _by_runner(self, args) -> None:
    self.runner(*args, *self.constants)


def _model(device: str, layers):
    cfg = dict(HF_MODELS["smollm2-shape"], **({"num_hidden_layers": layers} if layers else {}))
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg, attn_implementation="sdpa"))
    return model.to(torch.bfloat16).eval()


def _variants(model, batch: int, max_len: int) -> dict:
    """name -> (cache factory, the variant whose tokens it must give)."""
    def jm(kv, keep, direct, decode="fused"):
        def make():
            triton_launch.Launch.__call__ = DIRECT if direct else _by_runner
            model.set_attn_implementation(ATTN_IMPLEMENTATION if decode == "fused" else "sdpa")
            cache = JMixedKVCache.for_model(model, kv, max_batch_size=batch, max_cache_len=max_len, decode=decode,
                                            validate=False)
            cache._kernel_keeps = cache._kernel_keeps and keep
            return cache
        return make

    def dynamic():
        triton_launch.Launch.__call__ = DIRECT
        model.set_attn_implementation("sdpa")
        return DynamicCache(config=model.config)
    before = "mixed fused, copy + runner (before)"
    return {"DynamicCache": (dynamic, "DynamicCache"),
            "mixed fused, kept + direct": (jm(MIXED, True, True), before),
            "mixed fused, copy + direct": (jm(MIXED, False, True), before),
            before: (jm(MIXED, False, False), before),
            "bf16 fused, kept + direct": (jm(BF16, True, True), "bf16 fused, copy + runner (before)"),
            "bf16 fused, copy + runner (before)": (jm(BF16, False, False), "bf16 fused, copy + runner (before)"),
            "mixed stage, direct": (jm(MIXED, False, True, "stage"), "mixed stage, runner (before)"),
            "mixed stage, runner (before)": (jm(MIXED, False, False, "stage"), "mixed stage, runner (before)")}


def main(argv=None):
    p = bench_parser(__doc__, out="bench/out", md=False)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=32, help="decode steps timed (one more token is generated)")
    args = p.parse_args(argv)
    device, layers = ("cuda", None) if torch.cuda.is_available() else ("cpu", 2)
    if args.smoke or device == "cpu":
        args.rounds, args.batch, args.prompt, args.new = 1, 1, 16, 3
    model = _model(device, layers)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, model.config.vocab_size, (args.batch, args.prompt), generator=g).to(device)
    variants = _variants(model, args.batch, args.prompt + args.new + 8)
    tokens = {}
    for name, (make, _) in variants.items():                                 # warm-up: compiles
        hf_generate(model, ids, make(), 1, device)
        tokens[name] = hf_generate(model, ids, make(), args.new + 1, device)[:, args.prompt:].cpu()
    times = interleaved_ms_per_step(lambda name, n: hf_generate(model, ids, variants[name][0](), n, device),
                                    list(variants), args.rounds, args.new + 1)
    model.set_attn_implementation("sdpa")
    triton_launch.Launch.__call__ = DIRECT
    dyn, rows = times["DynamicCache"], []
    for name, (_, base) in variants.items():
        x = times[name]
        rows.append(dict(variant=name, ms_per_step_median=statistics.median(x), ms_per_step_min=min(x),
                         paired_ratio_to_dynamic=statistics.median(a / b for a, b in zip(x, dyn)),
                         tokens_equal_before=bool(torch.equal(tokens[name], tokens[base])),
                         tokens_equal_dynamic=bool(torch.equal(tokens[name], tokens["DynamicCache"])), rounds=x))
    print(md_table(["variant", "ms / step median", "best", "x DynamicCache (paired median)", "tokens = before",
                    "tokens = DynamicCache"],
                   [[r["variant"], f"{r['ms_per_step_median']:.2f}", f"{r['ms_per_step_min']:.2f}",
                     f"{r['paired_ratio_to_dynamic']:.3f}", r["tokens_equal_before"], r["tokens_equal_dynamic"]]
                    for r in rows]))
    env = dict(versions(torch), transformers=transformers.__version__, batch=args.batch, prompt=args.prompt,
               new=args.new, rounds=args.rounds, model="smollm2-shape" + (f" ({layers} layers)" if layers else ""))
    print("wrote", write_json(args.out, "hf_ab.json", dict(env=env, variants=rows)))
    return 0 if all(r["tokens_equal_before"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
