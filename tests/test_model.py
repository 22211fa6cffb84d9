"""The Llama-style decoder and its jit generation loop over a jmixedkv cache.

* all-high mixed cache (first_n + last_n >= every length, fixed pages + ring): generated tokens,
  logits and attention outputs equal the plain bf16 cache's bit for bit (invariant 2, end to end);
* the cache-threaded model equals a cache-free dense forward of the same token sequence (teacher forcing);
* the loop compiles once (chex.assert_max_traces) for new prompts and both free / forced modes;
* the cache actually matters (nvfp4 differs from bf16), lengths after generation, and bad input.
"""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmixedkv import KVCacheConfig, stage_reference
from jmixedkv_demo.model import DenseSession, Decoder, ModelConfig, build_generate, generate, init_params
from helpers import assert_trees_bit_equal

CFG = ModelConfig.tiny(seed=3)
B, P, N, PAGE = 2, 21, 8, 8        # 28 tokens: 4 pages, the last one partly filled
TOTAL = P + N


@functools.lru_cache(maxsize=None)
def params():
    return init_params(CFG)


@functools.lru_cache(maxsize=None)
def prompts():
    return jax.random.randint(jax.random.PRNGKey(7), (B, P), 0, CFG.vocab_size, jnp.int32)


TRACES = {}
CHEXED = ("mixed_nvfp4_bf16", 8, 8, "auto")     # chex counts traces by source, so one chex-wrapped program only


def _counted(key):
    def wrap(fn):
        def counted(*args):
            TRACES[key] = TRACES.get(key, 0) + 1
            assert TRACES[key] == 1, f"generation program {key} traced {TRACES[key]} times"
            return fn(*args)
        return counted
    return wrap


@functools.lru_cache(maxsize=None)
def program(dtype, first_n, last_n, attention):
    """One jitted generation program per cache config; each may trace exactly once in this whole file."""
    cfg = KVCacheConfig(dtype, first_n=first_n, last_n=last_n, page_size=PAGE)
    key = (dtype, first_n, last_n, attention)
    if key == CHEXED:
        chex.clear_trace_counter()
        wrap = chex.assert_max_traces(n=1)
    else:
        wrap = _counted(key)
    return build_generate(CFG, cfg, N, attention=attention, wrap=wrap)


@functools.lru_cache(maxsize=None)
def run(dtype, first_n=0, last_n=0, attention="auto", forced_from=None):
    teacher = jnp.zeros((B, N), jnp.int32) if forced_from is None else run(*forced_from).tokens
    fn = program(dtype, first_n, last_n, attention)
    return fn(params(), prompts(), teacher, jnp.asarray(forced_from is not None))


def _outputs(r):
    return r.tokens, r.logits, r.attn


def test_all_high_mixed_equals_bf16():
    """first_n + last_n >= every length (5 fixed rows + the ring): the twin serves every row."""
    mixed = run("mixed_nvfp4_bf16", 5, TOTAL - 5)
    assert_trees_bit_equal(_outputs(mixed), _outputs(run("bf16")))
    assert float(jnp.std(run("bf16").logits)) > 1.0          # the model is not flat: agreement is informative


def test_default_path_matches_reference_path():
    """``attention="auto"`` (`chunk_attention` prefill, fused decode) vs staged dense reference attention."""
    auto, ref = run("bf16"), run("bf16", attention="reference")
    np.testing.assert_allclose(np.asarray(auto.logits[:, 0]), np.asarray(ref.logits[:, 0]), atol=0.05)  # prefill
    np.testing.assert_array_equal(np.asarray(auto.tokens[:, 0]), np.asarray(ref.tokens[:, 0]))
    np.testing.assert_allclose(np.asarray(auto.attn), np.asarray(ref.attn), atol=2e-2, rtol=2e-2)


def test_cache_path_matches_dense_forward():
    """Teacher-forced logits of the cached bf16 run == a cache-free forward of prompt + generated tokens."""
    ref = run("bf16")
    seq = jnp.concatenate([prompts(), ref.tokens[:, :-1]], axis=1)              # [B, P + N - 1]
    pos = jnp.broadcast_to(jnp.arange(seq.shape[1], dtype=jnp.int32), seq.shape)
    dense = Decoder(CFG).apply(params(), seq, pos, DenseSession())[:, P - 1:]   # logits of each new token
    np.testing.assert_allclose(np.asarray(ref.logits), np.asarray(dense), rtol=0, atol=0.05 * float(dense.std()))
    assert float(jnp.mean(jnp.argmax(dense, -1) == ref.tokens)) >= 0.9


def test_teacher_forcing_feeds_the_teacher():
    forced = run("bf16", forced_from=("bf16",))
    assert_trees_bit_equal(_outputs(forced), _outputs(run("bf16")))     # forcing a model with its own tokens
    forced_nv, free_nv = run("nvfp4", forced_from=("bf16",)), run("nvfp4")
    np.testing.assert_array_equal(np.asarray(forced_nv.logits[:, 0]), np.asarray(free_nv.logits[:, 0]))  # prefill
    fed_differs = np.any(np.asarray(free_nv.tokens[:, :-1]) != np.asarray(run("bf16").tokens[:, :-1]))
    assert fed_differs == (not np.array_equal(np.asarray(forced_nv.logits), np.asarray(free_nv.logits)))


def test_quantized_cache_changes_outputs_and_lengths():
    nv, bf = run("nvfp4"), run("bf16")
    assert not np.array_equal(np.asarray(nv.logits), np.asarray(bf.logits))
    rel = float(jnp.linalg.norm(nv.logits[:, 0] - bf.logits[:, 0]) / jnp.linalg.norm(bf.logits[:, 0]))
    assert 0 < rel < 0.5, rel                          # a perturbation, not garbage (prefill: same inputs)
    np.testing.assert_array_equal(np.asarray(bf.state.kv_lens), [TOTAL - 1] * B)
    assert int(bf.state.error) == 0 and int(nv.state.error) == 0


def test_windows_are_exact_in_the_final_cache():
    """Staged K of a (8, 8) mixed run equals the bf16 cache inside the windows when fed the same tokens."""
    mixed = run("mixed_nvfp4_bf16", 8, 8, forced_from=("bf16",))
    bf = run("bf16")
    slots = jnp.arange(B, dtype=jnp.int32)
    for layer in (0, CFG.num_layers - 1):
        km = np.asarray(stage_reference(mixed.state, layer, slots), np.float32)[:, 0]
        kb = np.asarray(stage_reference(bf.state, layer, slots), np.float32)[:, 0]
        n = TOTAL - 1
        if layer == 0:   # layer 0's K depends only on the fed tokens: identical inputs on both runs
            np.testing.assert_array_equal(km[:, :, :8], kb[:, :, :8])
            np.testing.assert_array_equal(km[:, :, n - 8:n], kb[:, :, n - 8:n])
            assert not np.array_equal(km[:, :, 8:n - 8], kb[:, :, 8:n - 8])
        assert np.all(km[:, :, n:] == 0)


def test_loop_compiles_once():
    """New prompts, free and forced mode, repeated calls: the traced body (prefill + fori_loop) runs once."""
    fn = program(*CHEXED)
    a = run(*CHEXED[:3])
    b = fn(params(), (prompts() + 1) % CFG.vocab_size, a.tokens, jnp.asarray(True))
    c = fn(params(), prompts(), jnp.zeros((B, N), jnp.int32), jnp.asarray(False))
    assert_trees_bit_equal(_outputs(a), _outputs(c))
    assert not np.array_equal(np.asarray(a.logits), np.asarray(b.logits))


def test_fused_attention_mode():
    assert build_generate(CFG, KVCacheConfig("bf16", page_size=PAGE), N, attention="fused") is not None


def test_bad_input():
    cfg = KVCacheConfig("bf16", page_size=PAGE)
    with pytest.raises(ValueError, match="attention"):
        build_generate(CFG, cfg, N, attention="flash")
    with pytest.raises(ValueError, match="num_new"):
        build_generate(CFG, cfg, 0)
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        generate(params(), jnp.full((1, 4), 300), CFG, cfg, 2)
    with pytest.raises(ValueError, match="teacher"):
        generate(params(), jnp.zeros((1, 4)), CFG, cfg, 2, teacher=jnp.zeros((1, 3)))
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelConfig(num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="multiple of 16"):
        ModelConfig(head_dim=40)


def test_tied_embeddings_and_rms_eps():
    import dataclasses
    cfg = dataclasses.replace(ModelConfig.tiny(seed=1), tie_embeddings=True, rms_eps=1e-5)
    p = init_params(cfg)
    assert "lm_head" not in p["params"]
    toks = jnp.array([[1, 2, 3]])
    pos = jnp.arange(3)[None]
    logits = Decoder(cfg).apply(p, toks, pos, DenseSession())
    last = Decoder(cfg).apply(p, toks, pos, DenseSession(), last_only=True)
    np.testing.assert_allclose(np.asarray(last[:, 0]), np.asarray(logits[:, -1]), rtol=1e-5, atol=1e-5)
    assert logits.shape == (1, 3, cfg.vocab_size)


def test_builtin_texts_and_high_fraction():
    from jmixedkv_demo.model import builtin_text, high_fraction
    for name in ("prose", "code"):
        assert len(builtin_text(name)) > 20000
    with pytest.raises(ValueError, match="available"):
        builtin_text("poetry")
    assert high_fraction(KVCacheConfig("bf16"), 100) == 1.0 and high_fraction(KVCacheConfig("nvfp4"), 100) == 0.0
    assert high_fraction(KVCacheConfig("mixed_nvfp4_bf16", first_n=4, last_n=64), 4096) == 68 / 4096
    assert high_fraction(KVCacheConfig("mixed_nvfp4_bf16", first_n=64, last_n=64), 100) == 1.0


def test_evaluate_caches_on_the_tiny_model():
    from jmixedkv_demo.model import evaluate_caches
    toks = jax.random.randint(jax.random.PRNGKey(3), (40,), 0, CFG.vocab_size)
    caches = [("bf16", KVCacheConfig("bf16", page_size=PAGE)), ("nvfp4", KVCacheConfig("nvfp4", page_size=PAGE)),
              ("all", KVCacheConfig("mixed_nvfp4_bf16", first_n=0, last_n=40, page_size=PAGE))]
    r = evaluate_caches(params(), CFG, toks, caches, prefix_len=30)
    assert r["window"] == 9 and r["seq_len"] == 39
    base, nv, allhigh = r["results"]
    assert base["kl"] == 0 and allhigh["kl"] == 0 and allhigh["attn_rel_err_per_layer"] == [0.0, 0.0]
    assert nv["kl"] > 0 and len(nv["kl_per_position"]) == 9 and all(e > 0 for e in nv["attn_rel_err_per_layer"])
    with pytest.raises(ValueError, match="prefix_len"):
        evaluate_caches(params(), CFG, toks, caches, prefix_len=39)


# ---------------------------------------------------------------------------------------------- bfloat16 weights
def _reference_forward(params, cfg: ModelConfig, tokens) -> np.ndarray:
    """An independent float64 NumPy forward of the decoder (causal, cache-free): logits ``f64[B, T, V]``."""
    p = jax.tree.map(lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64), params["params"])
    norm = lambda a, s: a / np.sqrt(np.mean(a * a, -1, keepdims=True) + cfg.rms_eps) * s  # noqa: E731
    b, t = tokens.shape
    d, hq, h = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    ang = np.arange(t)[:, None] * cfg.rope_theta ** (-np.arange(0, d, 2) / d)[None]
    cos, sin = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]

    def rope(v):                                                    # NeoX halves
        x, y = v[..., :d // 2], v[..., d // 2:]
        return np.concatenate([x * cos - y * sin, x * sin + y * cos], -1)
    x = p["embed"]["embedding"][np.asarray(tokens)]
    causal = np.tril(np.ones((t, t), bool))
    for layer in range(cfg.num_layers):
        bp = p[f"block{layer}"]
        a = norm(x, bp["attn_norm"]["scale"])
        q = rope((a @ bp["attn"]["q"]["kernel"]).reshape(b, t, hq, d))
        k = np.repeat(rope((a @ bp["attn"]["k"]["kernel"]).reshape(b, t, h, d)), hq // h, axis=2)
        v = np.repeat((a @ bp["attn"]["v"]["kernel"]).reshape(b, t, h, d), hq // h, axis=2)
        lg = np.where(causal, np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(d), -np.inf)
        w = np.exp(lg - lg.max(-1, keepdims=True))
        x = x + (np.einsum("bhts,bshd->bthd", w / w.sum(-1, keepdims=True), v).reshape(b, t, -1)
                 @ bp["attn"]["o"]["kernel"])
        m = norm(x, bp["mlp_norm"]["scale"])
        g = m @ bp["mlp"]["gate"]["kernel"]
        x = x + (g / (1 + np.exp(-g)) * (m @ bp["mlp"]["up"]["kernel"])) @ bp["mlp"]["down"]["kernel"]
    x = norm(x, p["final_norm"]["scale"])
    return x @ (p["embed"]["embedding"].T if cfg.tie_embeddings else p["lm_head"]["kernel"])


@pytest.mark.parametrize("tied", [False, True])
def test_bf16_weight_forward_matches_the_float32_reference(tied):
    """bfloat16 weights are the float32 init rounded (norm scales stay float32). The bf16-weight forward (each
    projection: activation rounded to bf16, bf16 x bf16 products, float32 accumulation) equals the float32 forward
    with the rounded weights upcast, and an independent float64 NumPy forward of them, within a relative L2 error
    of 1e-2 on the logits (measured ~3e-3: the activations' bf16 rounding, 2**-9 relative, at every projection);
    the float32 forward with the upcast weights equals the NumPy forward to 1e-5 (so the reference is the model)."""
    import dataclasses
    from jmixedkv_demo.model import cast_weights, exact_prefill
    cfg = dataclasses.replace(CFG, tie_embeddings=tied)
    p32, p16 = init_params(cfg), init_params(cfg, "bfloat16")
    assert_trees_bit_equal(p16, cast_weights(p32, "bfloat16"))
    kinds = {jax.tree_util.keystr(path): x.dtype for path, x in jax.tree_util.tree_leaves_with_path(p16)}
    assert all((d == jnp.bfloat16) == ("kernel" in k or "embedding" in k) for k, d in kinds.items()), kinds
    up = jax.tree.map(lambda a: a.astype(jnp.float32), p16)
    toks = jax.random.randint(jax.random.PRNGKey(5), (2, 24), 0, cfg.vocab_size, jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(24, dtype=jnp.int32), (2, 24))
    fwd = lambda p: np.asarray(Decoder(cfg).apply(p, toks, pos, DenseSession()), np.float64)  # noqa: E731
    rel = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b)  # noqa: E731
    got, want, ref = fwd(p16), fwd(up), _reference_forward(p16, cfg, toks)
    assert rel(want, ref) < 1e-5
    assert rel(got, want) < 1e-2 and rel(got, ref) < 1e-2
    # the scanned forward of the serving loop and the generation loop: the same tolerance
    last16, last32 = exact_prefill(p16, cfg, toks)[1], exact_prefill(up, cfg, toks)[1]
    assert rel(np.asarray(last16, np.float64), ref[:, -1]) < 1e-2 and rel(np.asarray(last32, np.float64),
                                                                          ref[:, -1]) < 1e-5
    with pytest.raises(ValueError, match="weights_dtype must be one of .* got 'float16'"):
        init_params(cfg, "float16")
