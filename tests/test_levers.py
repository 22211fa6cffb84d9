"""Accuracy levers (Hadamard rotation, K smoothing) and the teacher-forced decode simulation used by the accuracy
evaluation.

* the rotation is orthonormal and self-inverse; `append` with ``rotation="hadamard"`` stores ``RoPE(k) @ H`` and
  ``v @ H`` (RoPE in the write path composes: same rows as RoPE outside + plain append), bytes format unchanged
  (read with ``as_stored=True``; the default model-space reads are tests/test_rotation_readers.py);
* K smoothing leaves attention unchanged in exact arithmetic (softmax shift invariance);
* `score_decode` (one pass, every decode step's retained set simulated) equals the real jit generation loop over
  the real cache, teacher-forced, for every cache kind and lever (1-layer model, so the exact prefill and the
  cached prefill give the same layer-0 K/V).
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmixedkv import GroupSpec, KVCacheConfig, RopeSpec, admit, append, apply_rope, init_state, stage_reference
from jmixedkv import levers
from jmixedkv_demo.model import (ModelConfig, build_generate, calibrate, exact_prefill, init_params, score_decode,
                                 sim_knobs, token_metrics)
from jmixedkv.decode import attention_reference


def test_hadamard_orthonormal_and_self_inverse():
    for d in (16, 32, 64, 128):
        h = np.asarray(levers.hadamard(d), np.float64)
        np.testing.assert_allclose(h @ h.T, np.eye(d), atol=1e-6)
        np.testing.assert_array_equal(h, h.T)
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 5, 64))
    np.testing.assert_allclose(np.asarray(levers.rotate(levers.rotate(x, "hadamard"), "hadamard")), np.asarray(x),
                               atol=1e-5)
    assert levers.rotate(x, None) is x
    with pytest.raises(ValueError, match="power of two"):
        levers.hadamard(48)
    with pytest.raises(ValueError, match="rotation"):
        KVCacheConfig("nvfp4", rotation="givens")
    with pytest.raises(ValueError, match="k_smoothing"):
        KVCacheConfig("nvfp4", k_smoothing=1)


def test_rotation_error_is_measured_in_either_basis():
    """Orthonormal: the NVFP4 error of a rotated row is the same after un-rotating (norms preserved); whether it
    is lower than without rotation depends on the data (see bench/accuracy.py), so nothing is assumed here."""
    from jmixedkv import nvfp4
    x = jax.random.normal(jax.random.PRNGKey(1), (256, 64)).at[:, 5].mul(40.0)
    xr = levers.rotate(x, "hadamard")
    qr = nvfp4.dequantize_reference(*nvfp4.quantize_reference(xr), dtype=jnp.float32)
    back = levers.rotate(qr, "hadamard")
    np.testing.assert_allclose(float(jnp.linalg.norm(back - x)), float(jnp.linalg.norm(qr - xr)), rtol=1e-4)
    np.testing.assert_allclose(float(jnp.linalg.norm(xr)), float(jnp.linalg.norm(x)), rtol=1e-5)


@pytest.mark.parametrize("dtype", ["mixed_nvfp4_bf16", "nvfp4", "bf16"])
def test_append_rotates_after_rope(dtype):
    spec = GroupSpec(num_layers=2, num_kv_heads=2, head_dim=32)
    rope = RopeSpec("neox", 1e4)
    t = 11
    k = jax.random.normal(jax.random.PRNGKey(2), (t, 2, 32))
    v = jax.random.normal(jax.random.PRNGKey(3), (t, 2, 32))
    pos = jnp.arange(t, dtype=jnp.int32)
    seq = jnp.zeros((t,), jnp.int32)
    extra = dict(first_n=2, last_n=4) if dtype.startswith("mixed") else {}

    def staged(cfg, k, v, rope):
        s = admit(init_state(cfg, spec, num_pages=4, max_seqs=1), 0)
        s = append(s, 1, k, v, seq, pos, rope=rope, backend="reference")
        assert int(s.error) == 0
        return np.asarray(stage_reference(s, 1, jnp.zeros((1,), jnp.int32), dtype=jnp.float32, as_stored=True))[0]

    rot_cfg = KVCacheConfig(dtype, page_size=4, rotation="hadamard", **extra)
    got = staged(rot_cfg, k, v, rope)
    # RoPE in the write path == RoPE outside, then a plain append; and == rotating by hand into a plain cache
    np.testing.assert_array_equal(got, staged(rot_cfg, apply_rope(k, pos, rope), v, None))
    kr = levers.rotate(apply_rope(k, pos, rope), "hadamard")
    np.testing.assert_array_equal(got, staged(KVCacheConfig(dtype, page_size=4, **extra), kr,
                                              levers.rotate(v, "hadamard"), None))
    if dtype == "bf16":      # rows are the rotated ones (bf16-rounded): un-rotating gives K / V back
        back = np.asarray(levers.rotate(jnp.asarray(got[:, :, :t]), "hadamard"))
        np.testing.assert_allclose(back[0], np.swapaxes(np.asarray(apply_rope(k, pos, rope)), 0, 1), atol=0.05)


def test_k_smoothing_leaves_exact_attention_unchanged():
    key = jax.random.split(jax.random.PRNGKey(4), 3)
    q = jax.random.normal(key[0], (1, 3, 4, 32))
    k = jax.random.normal(key[1], (1, 9, 2, 32)) + 3.0
    v = jax.random.normal(key[2], (1, 9, 2, 32))
    mean = levers.k_mean(k)
    lens = jnp.array([9])
    a, _ = attention_reference(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), lens)
    b, _ = attention_reference(q, jnp.swapaxes(levers.smooth_k(k, mean), 1, 2), jnp.swapaxes(v, 1, 2), lens)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)
    valid = jnp.arange(9)[None] < 5
    np.testing.assert_allclose(np.asarray(levers.k_mean(k, valid)), np.asarray(k[:, :5].mean(1)), atol=1e-6)


# --------------------------------------------------------------------------------------------- simulation vs cache
CFG1 = dataclasses.replace(ModelConfig.tiny(seed=5), num_layers=1)
B, P, N, PAGE = 2, 21, 12, 8


@functools.lru_cache(maxsize=None)
def _setup():
    params = init_params(CFG1)
    toks = jax.random.randint(jax.random.PRNGKey(9), (B, P + N), 0, CFG1.vocab_size, jnp.int32)
    return params, toks[:, :P], toks[:, P:]


SIM_CASES = [
    KVCacheConfig("bf16", page_size=PAGE),
    KVCacheConfig("fp8", page_size=PAGE),
    KVCacheConfig("nvfp4", page_size=PAGE),
    KVCacheConfig("mixed_nvfp4_bf16", first_n=5, last_n=6, page_size=PAGE),
    KVCacheConfig("mixed_nvfp4_fp8", first_n=3, last_n=9, page_size=PAGE),
    KVCacheConfig("mixed_nvfp4_bf16", first_n=4, last_n=8, page_size=PAGE, rotation="hadamard"),
    KVCacheConfig("nvfp4", page_size=PAGE, rotation="hadamard", k_smoothing=True),
    KVCacheConfig("mixed_nvfp4_bf16", first_n=2, last_n=4, page_size=PAGE, k_smoothing=True),
    KVCacheConfig("mixed_nvfp4_fp8", first_n=2, last_n=5, page_size=PAGE, rotation="hadamard", block_scale="4over6"),
]


@pytest.mark.parametrize("cfg", SIM_CASES, ids=lambda c: f"{c.dtype}-{c.first_n}-{c.last_n}-{c.rotation}-"
                                                      f"{c.k_smoothing}-{c.block_scale}")
def test_simulated_decode_equals_the_real_cache(cfg):
    params, prompt, teacher = _setup()
    prefix, _ = exact_prefill(params, CFG1, prompt)
    sim_logits, sim_attn, scales = score_decode(params, CFG1, cfg, prefix, teacher[:, :N - 1])
    np.testing.assert_array_equal(np.asarray(scales["gs"]),
                                  np.asarray(calibrate(prefix, sim_knobs(cfg, CFG1))["gs"]))
    gen = build_generate(CFG1, cfg, N, attention="reference")(params, prompt, teacher, jnp.asarray(True), scales)
    assert int(gen.state.error) == 0
    real = np.asarray(gen.logits[:, 1:])                       # decode steps at positions P .. P + N - 2
    sim = np.asarray(sim_logits)
    np.testing.assert_allclose(sim, real, rtol=0, atol=2e-3 * float(np.abs(real).max()))
    np.testing.assert_allclose(np.asarray(sim_attn[0]), np.asarray(gen.attn[:, 1:, 0]), rtol=0, atol=1e-2)
    m = token_metrics(sim, real, teacher[:, 1:N])
    assert m["kl"] < 1e-4 and m["top1"] == 1.0


def test_simulation_sees_quantization_where_the_cache_does():
    """Against bf16: nvfp4 differs, an all-high mixed cache equals bf16 exactly."""
    params, prompt, teacher = _setup()
    prefix, _ = exact_prefill(params, CFG1, prompt)
    run = lambda c: np.asarray(score_decode(params, CFG1, c, prefix, teacher)[0])  # noqa: E731
    bf = run(KVCacheConfig("bf16", page_size=PAGE))
    np.testing.assert_array_equal(run(KVCacheConfig("mixed_nvfp4_bf16", first_n=0, last_n=P + N, page_size=PAGE)), bf)
    nv = run(KVCacheConfig("nvfp4", page_size=PAGE))
    assert 0 < token_metrics(nv, bf, teacher)["kl"] < 0.5


def _all_high_session():
    from jmixedkv_demo.model import SimulatedDecodeSession

    class AllHigh(SimulatedDecodeSession):
        def retained(self, layer, ret):
            return jnp.ones_like(ret)

    class Weights(SimulatedDecodeSession):
        def emitted(self):
            return self.weights
    return AllHigh, Weights


def test_simulation_session_hooks():
    """``score_decode(session=...)``: a subclass's `retained` decides which rows the twin serves (all of them: an
    NVFP4-history mixed cache then equals bf16 exactly, where the plain session does not) and its `emitted` is what
    the layer scan returns (the attention weights: causal rows summing to 1)."""
    all_high, weights = _all_high_session()
    params, prompt, teacher = _setup()
    prefix, _ = exact_prefill(params, CFG1, prompt)
    mixed = KVCacheConfig("mixed_nvfp4_bf16", first_n=1, last_n=2, page_size=PAGE)
    bf = np.asarray(score_decode(params, CFG1, KVCacheConfig("bf16", page_size=PAGE), prefix, teacher)[0])
    assert not np.array_equal(np.asarray(score_decode(params, CFG1, mixed, prefix, teacher)[0]), bf)
    np.testing.assert_array_equal(np.asarray(score_decode(params, CFG1, mixed, prefix, teacher, session=all_high)[0]),
                                  bf)
    w = np.asarray(score_decode(params, CFG1, mixed, prefix, teacher, session=weights)[1])    # [L, B, T, H, G, S]
    t, s = w.shape[2], w.shape[-1]
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-5)
    future = np.arange(s)[None, :] > (s - t + np.arange(t))[:, None]                     # [T, S]
    assert (w[:, :, future.nonzero()[0], ..., future.nonzero()[1]] == 0).all() and future.any()
