"""interop.hf across model families (tiny random models, CPU): every attention option a model passes reaches the
cache's attention -- Mistral's sliding window, Gemma-2's soft-capping and sliding layers, gpt-oss's attention
sinks and sliding layers, Qwen2 and Llama -- so an all-high cache gives DynamicCache's tokens in both decode modes;
sliding layers are marked sliding; the fused path compiles one program per shape, not per step or layer. The
compileable `JMixedStaticCache` ("static") passes the same family checks, with K smoothing too ("static_smoothed":
the cache holds the means; refused for Gemma-2's soft-capping)."""
import numpy as np
import pytest
import torch

import transformers
from transformers import DynamicCache

from interop.hf import ATTN_IMPLEMENTATION, CACHE_KWARG, JMixedKVCache
from interop.hf_static import JMixedStaticCache
from jmixedkv import KVCacheConfig, step

PAGE, MAX_LEN, BATCH, PROMPT, NEW, WINDOW = 16, 32, 2, 7, 6, 4
ALL_HIGH = KVCacheConfig("mixed_nvfp4_bf16", first_n=16, last_n=16, page_size=PAGE, max_draft_len=4)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))


def _qwen2():
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY))


def _mistral():
    return transformers.MistralForCausalLM(transformers.MistralConfig(**TINY, sliding_window=WINDOW))


def _gemma2():
    cfg = transformers.Gemma2Config(**TINY, sliding_window=WINDOW, attn_logit_softcapping=2.0,
                                    final_logit_softcapping=30.0, query_pre_attn_scalar=16)
    return transformers.Gemma2ForCausalLM(cfg)


def _gpt_oss():
    cfg = transformers.GptOssConfig(**{**TINY, "intermediate_size": 64}, sliding_window=WINDOW,
                                    num_local_experts=4, num_experts_per_tok=2)
    model = transformers.GptOssForCausalLM(cfg)
    with torch.no_grad():                                       # sinks that matter (their init is zero)
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    return model


# name -> (factory, the model's own attention for the staged / reference runs)
FAMILIES = {"llama": (_llama, "sdpa"), "qwen2": (_qwen2, "sdpa"), "mistral": (_mistral, "sdpa"),
            "gemma2": (_gemma2, "eager"), "gpt_oss": (_gpt_oss, "eager")}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    make, impl = FAMILIES[request.param]
    torch.manual_seed(0)
    model = make().to(torch.bfloat16).eval()
    model.set_attn_implementation(impl)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (BATCH, PROMPT), generator=g)
    return request.param, model, impl, ids


def _generate(model, ids, cache):
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                         do_sample=False, **{CACHE_KWARG: cache}, return_dict_in_generate=True, output_scores=True,
                         pad_token_id=0)
    return out.sequences, torch.stack(out.scores, 1).float()


def _cache(model, decode):
    """``decode``: a `JMixedKVCache` mode or ``static`` (`JMixedStaticCache`), ``_smoothed``: with K smoothing."""
    mode, _, smoothed = decode.partition("_")
    kv = ALL_HIGH.replace(k_smoothing=smoothed == "smoothed")
    if mode == "static":                    # the compileable cache: torch-owned pools, torch ops
        return JMixedStaticCache.for_model(model, kv, max_batch_size=BATCH, max_cache_len=MAX_LEN)
    return JMixedKVCache.for_model(model, kv, max_batch_size=BATCH, max_cache_len=MAX_LEN, decode=mode,
                                   backend="reference")


@pytest.mark.parametrize("decode", ["stage", "fused", "static", "stage_smoothed", "fused_smoothed",
                                    "static_smoothed"])
def test_all_high_cache_gives_dynamic_cache_tokens(family, decode):
    name, model, impl, ids = family
    want, want_scores = _generate(model, ids, DynamicCache(config=model.config))
    model.set_attn_implementation(ATTN_IMPLEMENTATION if not decode.startswith("stage") else impl)
    try:
        if decode in ("fused_smoothed", "static_smoothed") and name == "gemma2":   # a soft-cap is not shift-invariant
            with pytest.raises(ValueError, match="k_smoothing with attention soft-capping"):
                _cache(model, decode)
            return
        cache = _cache(model, decode)
        got, scores = _generate(model, ids, cache)
    finally:
        model.set_attn_implementation(impl)
    assert torch.equal(got, want), (name, decode, got.tolist(), want.tolist())
    finite = torch.isfinite(want_scores)         # logits processors put -inf on suppressed tokens
    assert torch.equal(finite, torch.isfinite(scores))
    scale = float(want_scores[finite].abs().max())
    tol = 1e-2 if decode == "stage" else 5e-2   # stage: the model's own attention on bit-exact rows; else float32
    #                                             (or rows rounded once more: bf16(k - mean) + mean)
    np.testing.assert_allclose(scores[finite].numpy(), want_scores[finite].numpy(), atol=tol * scale)
    # the run went past the window, so a dropped option would have shown
    assert PROMPT + NEW > WINDOW + 2


def test_sliding_layers_are_marked_from_the_config(family):
    name, model, _, _ = family
    cache = _cache(model, "stage")
    cfg = model.config
    types = getattr(cfg, "layer_types", None)
    want = [(getattr(cfg, "sliding_window", None) is not None and (types is None or t == "sliding_attention"))
            for t in (types or [None] * cfg.num_hidden_layers)]
    assert [layer.is_sliding for layer in cache.layers] == want
    assert [layer.sliding_window for layer in cache.layers] == [WINDOW if w else None for w in want]
    if name in ("mistral", "gemma2", "gpt_oss"):
        assert any(want)


def test_sinks_are_one_lse_term():
    """`step.apply_sinks` equals softmax over the keys plus one extra (sink) logit that carries no value."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 1, 4, 9)).astype(np.float32)
    vals = rng.normal(size=(2, 1, 4, 9, 16)).astype(np.float32)
    sink = rng.normal(size=(4,)).astype(np.float32)
    full = np.concatenate([logits, np.broadcast_to(sink[None, None, :, None], (2, 1, 4, 1))], -1)
    p = np.exp(full - full.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = np.einsum("btks,btksd->btkd", p[..., :-1], vals)
    lse = np.log(np.exp(logits).sum(-1))
    out = np.einsum("btks,btksd->btkd", np.exp(logits - lse[..., None]), vals)
    got, got_lse = step.apply_sinks(out, lse, sink)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got_lse), np.log(np.exp(full).sum(-1)), rtol=1e-6)
    empty, _ = step.apply_sinks(np.zeros((1, 1, 4, 16), np.float32), np.full((1, 1, 4), -np.inf, np.float32), sink)
    assert (np.asarray(empty) == 0).all()


@pytest.mark.parametrize("deferred", [True, False], ids=["held_aside", "per_layer"])
def test_fused_path_compiles_once_per_shape(deferred):
    """A fused generate() compiles each program once per shape, never per step or layer, and a second run of the
    same shapes compiles nothing. A step held aside (`interop.hf.tail_limit`) is one JAX program storing every
    layer's rows (`step.plan_write_layers`: one compilation for the prompt's tokens, one for a decode step's);
    otherwise (forced here) one plan per step (`step.plan_append_packed`) and one program per layer
    (`step.layer_attend`; prefill `step.layer_append`)."""
    torch.manual_seed(0)
    model = _llama().to(torch.bfloat16).eval()
    ids = torch.randint(0, 256, (BATCH, PROMPT), generator=torch.Generator().manual_seed(3))
    model.set_attn_implementation(ATTN_IMPLEMENTATION)

    def sizes():
        plan = step._PLAN_PROGRAMS.get((0, BATCH))
        return (step.layer_attend._cache_size(), step.layer_append._cache_size(),
                0 if plan is None else plan.program._cache_size(), step._plan_write._cache_size())
    try:
        # geometries no other test uses, so the counts start from zero
        kv = KVCacheConfig("mixed_nvfp4_bf16", first_n=2, last_n=8 if deferred else 0, page_size=PAGE,
                           max_draft_len=3)
        runs = []
        for _ in range(2):
            before = sizes()
            cache = JMixedKVCache.for_model(model, kv, max_batch_size=BATCH, max_cache_len=MAX_LEN, decode="fused",
                                            backend="reference")
            if not deferred:
                cache._tail_limit = 0          # every step through the per-layer programs
            _generate(model, ids, cache)
            cache.flush()
            runs.append(tuple(a - b for a, b in zip(sizes(), before)))
    finally:
        model.set_attn_implementation("sdpa")
    assert runs == ([(0, 0, 0, 2), (0, 0, 0, 0)] if deferred else [(1, 1, 2, 0), (0, 0, 0, 0)]), runs
