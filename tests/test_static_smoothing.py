"""K smoothing inside `interop.static_cache.StaticPagedCache` (``KVCacheConfig(k_smoothing=True)``): each row's
K mean is frozen from its first stored tokens (real tokens only: left padding and refused rows do not count),
every later key of the row is stored as ``k - mean`` (twin and plain rows included), attention is what it is
without smoothing (sinks included: they use the unshifted LSE), a soft-cap is refused, and beam search / rewind /
reset carry or drop the means. References: float64 NumPy means and attention over the unsmoothed keys."""
import numpy as np
import pytest
import torch

import transformers
from transformers import DynamicCache

from interop.hf import ATTN_IMPLEMENTATION, CACHE_KWARG
from interop.hf_static import JMixedStaticCache
from interop.static_cache import StaticPagedCache
from jmixedkv import KVCacheConfig
from helpers import tiny_llama

PAGE, MAX_LEN, H, D = 8, 32, 2, 16
BF16 = KVCacheConfig("bf16", page_size=PAGE, max_draft_len=2, k_smoothing=True)
ALL_HIGH = KVCacheConfig("mixed_nvfp4_bf16", first_n=16, last_n=16, page_size=PAGE, max_draft_len=2)


def _cache(kv, batch=3, layers=2):
    return StaticPagedCache(kv, layers, H, D, max_batch_size=batch, max_cache_len=MAX_LEN)


def _keys(b, t, seed, offset=3.0):
    """bf16 keys ``[B, H, T, D]`` with a large per-channel offset (what smoothing takes off)."""
    g = torch.Generator().manual_seed(seed)
    shift = offset * torch.randn(1, H, 1, D, generator=g)
    return (torch.randn(b, H, t, D, generator=g) + shift).bfloat16()


def _plain_row(paged, layer, row, pos):
    """The stored K of ``row`` at ``pos`` (plain bf16 pages), float64 ``[H, D]``."""
    grp, i = paged.group_of(layer)
    page = int(grp.page_table[row, pos // PAGE])
    return grp.pools.plain_rows[i, page, 0, :, pos % PAGE].double().numpy()


def _mean(k, row, tokens):
    return k[row][:, tokens].double().numpy().mean(axis=1)            # [H, D]


def test_means_from_real_tokens_and_stored_rows():
    paged = _cache(BF16)
    k = _keys(2, 6, 0)
    k[1, :, :2] = 1e4                                               # row 1's left padding: must not count
    pos = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 0, 0, 1, 2, 3]])
    for layer in (0, 1):
        lens, bad = paged.append(layer, k, k, pos)
    assert lens.tolist() == [6, 4] and not bad.any()
    want = [_mean(k, 0, range(6)), _mean(k, 1, range(2, 6))]
    for row in (0, 1):
        np.testing.assert_allclose(paged.k_mean[0, row].double().numpy(), want[row], rtol=1e-6, atol=1e-6)
        for j, p in enumerate(range(6) if row == 0 else range(4)):
            tok = j if row == 0 else j + 2
            stored = _plain_row(paged, 0, row, p)
            np.testing.assert_allclose(stored, k[row, :, tok].double().numpy() - want[row], atol=2e-2, rtol=2 ** -7)
    assert not paged.k_mean[:, 2].any()                              # row 2: nothing stored, no mean
    means = paged.k_mean.clone()
    # a decode step (rows 0, 1 continue; row 2 takes its first tokens): rows 0 / 1 keep their means bitwise
    k2 = _keys(3, 1, 1)
    lens, bad = paged.append(0, k2, k2, torch.tensor([[6], [4], [0]]))
    assert lens.tolist() == [7, 5, 1] and not bad.any()
    assert torch.equal(paged.k_mean[0, :2], means[0, :2])
    np.testing.assert_allclose(paged.k_mean[0, 2].double().numpy(), _mean(k2, 2, [0]), rtol=1e-6)
    np.testing.assert_allclose(_plain_row(paged, 0, 0, 6), k2[0, :, 0].double().numpy() - want[0],
                               atol=2e-2, rtol=2 ** -7)
    # a refused step (row 1 skips a position) changes no mean and leaves row 1's length
    means = paged.k_mean.clone()
    lens, bad = paged.append(1, k2, k2, torch.tensor([[6], [9], [0]]))
    assert bad.tolist() == [False, True, False]
    assert torch.equal(paged.k_mean[1, :2], means[1, :2]) and paged.kv_lens[1, 1] == 4
    np.testing.assert_allclose(paged.k_mean[1, 2].double().numpy(), _mean(k2, 2, [0]), rtol=1e-6)
    with pytest.raises(ValueError, match="position"):
        paged.raise_errors()
    # row copies (beam search's reorder) carry the means: rows 0 and 1 swapped, then row 0 stores a key with row 1's
    means = paged.k_mean.clone()
    paged.select_rows([1, 0])
    assert torch.equal(paged.k_mean[:, 0], means[:, 1]) and torch.equal(paged.k_mean[:, 1], means[:, 0])
    assert not paged.k_mean[:, 2].any()                              # rows past the selection: emptied
    k3 = _keys(1, 1, 5)
    paged.append(0, k3, k3, torch.tensor([[int(paged.kv_lens[0, 0])]]))
    np.testing.assert_allclose(_plain_row(paged, 0, 0, 5), k3[0, :, 0].double().numpy() - want[1],
                               atol=2e-2, rtol=2 ** -7)
    # reset drops every mean; the next first append takes a new one
    paged.reset()
    assert not paged.k_mean.any()
    paged.append(0, k2[:1], k2[:1], torch.tensor([[0]]))
    np.testing.assert_allclose(paged.k_mean[0, 0].double().numpy(), _mean(k2, 0, [0]), rtol=1e-6)


def _attention_f64(q, k, v, scale, sinks=None):
    """Reference attention of ``q [B, Hq, 1, D]`` over ``k, v [B, H, T, D]`` (all keys), float64, ``[B, 1, Hq, D]``;
    ``sinks [Hq]``: one extra logit per head with no value."""
    q, k, v = (x.double().numpy() for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = np.einsum("bhqd,bhkd->bhqk", q, k) * scale
    m = s.max(-1, keepdims=True)
    if sinks is not None:
        m = np.maximum(m, sinks.double().numpy()[None, :, None, None])
    e = np.exp(s - m)
    den = e.sum(-1, keepdims=True)
    if sinks is not None:
        den = den + np.exp(sinks.double().numpy()[None, :, None, None] - m)
    return np.einsum("bhqk,bhkd->bqhd", e / den, v)


@pytest.mark.parametrize("kv", [ALL_HIGH, ALL_HIGH.replace(rotation="hadamard"), BF16.replace(k_smoothing=False)],
                         ids=["all_high", "all_high_rotated", "bf16"])
@pytest.mark.parametrize("sinks", [False, True])
def test_attention_is_unchanged(kv, sinks):
    """Attention over a smoothed cache equals attention over the raw keys (float64), with and without sinks (which
    need the LSE of the unshifted keys); the unsmoothed cache is the control (looser when rotated: the rotation
    rounds q and the large raw keys to bf16 once more, which the sharp softmax of these offset keys amplifies)."""
    smoothed, plain = _cache(kv.replace(k_smoothing=True)), _cache(kv.replace(k_smoothing=False))
    k, v = _keys(3, 9, 2, offset=6.0), _keys(3, 9, 3, offset=0.0)
    pos = torch.arange(9)[None].expand(3, 9)
    g = torch.Generator().manual_seed(4)
    q = (torch.randn(3, 4, 1, D, generator=g) * 2).bfloat16()
    s = torch.randn(4, generator=g) * 3 if sinks else None
    want = _attention_f64(q, k, v, D ** -0.5, s)
    for cache, tol in ((smoothed, 1e-2), (plain, 1e-2 if kv.rotation is None else 6e-2)):
        lens, bad = cache.append(0, k[:, :, :8], v[:, :, :8], pos[:, :8])
        lens, bad = cache.append(0, k[:, :, 8:], v[:, :, 8:], pos[:, 8:])
        got = cache.attend(0, q, lens, bad, sinks=s).double().numpy()
        np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
    assert smoothed.k_mean[0].abs().max() > 3                       # the shift was large: a missed term would show
    with pytest.raises(ValueError, match="soft_cap=30.0 on a K-smoothed cache"):
        smoothed.attend(0, q, lens, bad, soft_cap=30.0)


def test_generate_and_beam_search_give_dynamic_cache_tokens():
    """All-high + k_smoothing through ``generate`` (left padding, then beam search): DynamicCache's tokens."""
    model = tiny_llama()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (2, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    kv = ALL_HIGH.replace(k_smoothing=True, max_draft_len=4)
    for extra in (dict(), dict(num_beams=3)):
        model.set_attn_implementation("sdpa")
        want = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, **extra,
                              **{CACHE_KWARG: DynamicCache(config=model.config)})
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        cache = JMixedStaticCache.for_model(model, kv, max_batch_size=6, max_cache_len=MAX_LEN)
        got = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, **extra,
                             **{CACHE_KWARG: cache})
        assert torch.equal(got, want), (extra, got.tolist(), want.tolist())
        assert cache.paged.k_mean.abs().sum() > 0


def test_soft_capping_models_are_refused():
    cfg = transformers.Gemma2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    attn_logit_softcapping=50.0)
    model = transformers.Gemma2ForCausalLM(cfg).eval()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    with pytest.raises(ValueError, match="attn_logit_softcapping=50.0"):
        JMixedStaticCache.for_model(model, ALL_HIGH.replace(k_smoothing=True), max_batch_size=1, max_cache_len=16)
    JMixedStaticCache.for_model(model, ALL_HIGH, max_batch_size=1, max_cache_len=16)      # without: accepted
