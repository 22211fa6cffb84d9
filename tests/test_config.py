"""KVCacheConfig: options, aliases, derived page counts and every rejection (ValueError naming field and value)."""
import jax.numpy as jnp
import pytest

from jmixedkv import KVCacheConfig


def test_defaults_and_aliases():
    c = KVCacheConfig(mixed_precision_first_n=5, mixed_precision_last_n=9, tokens_per_block=16)
    assert (c.dtype, c.first_n, c.last_n, c.page_size) == ("mixed_nvfp4_bf16", 5, 9, 16)
    assert c.mixed_precision_first_n == 5 and c.mixed_precision_last_n == 9 and c.tokens_per_block == 16
    assert c == KVCacheConfig(first_n=5, last_n=9, page_size=16)
    assert hash(c) == hash(KVCacheConfig(first_n=5, last_n=9, page_size=16))


@pytest.mark.parametrize("dtype,low,high,att", [
    ("mixed_nvfp4_bf16", True, jnp.bfloat16, jnp.bfloat16),
    ("mixed_nvfp4_fp16", True, jnp.float16, jnp.float16),
    ("mixed_nvfp4_fp8", True, jnp.float8_e4m3fn, jnp.bfloat16),
    ("bf16", False, jnp.bfloat16, jnp.bfloat16),
    ("fp16", False, jnp.float16, jnp.float16),
    ("fp8", False, jnp.float8_e4m3fn, jnp.bfloat16),
    ("nvfp4", True, None, jnp.bfloat16),
])
def test_dtypes(dtype, low, high, att):
    c = KVCacheConfig(dtype)
    assert c.has_low == low
    assert c.high_dtype == (None if high is None else jnp.dtype(high))
    assert c.attention_dtype == jnp.dtype(att)
    assert c.is_mixed == dtype.startswith("mixed")


@pytest.mark.parametrize("first_n,last_n,page,draft,fixed,ring", [
    (0, 0, 16, 0, 0, 0), (1, 0, 16, 0, 1, 0), (16, 0, 16, 0, 1, 0), (17, 0, 16, 0, 2, 0),
    (0, 1, 16, 0, 0, 2), (0, 16, 16, 0, 0, 2), (0, 17, 16, 0, 0, 3), (0, 16, 16, 3, 0, 3),
    (64, 64, 32, 4, 2, 4),
])
def test_page_counts(first_n, last_n, page, draft, fixed, ring):
    c = KVCacheConfig(first_n=first_n, last_n=last_n, page_size=page, max_draft_len=draft)
    assert (c.num_fixed_pages, c.num_ring_pages) == (fixed, ring)
    assert c.num_high_pages_per_seq == fixed + ring


@pytest.mark.parametrize("kwargs,words", [
    (dict(dtype="int4"), ["dtype", "'int4'"]),
    (dict(first_n=-1), ["first_n", "-1"]),
    (dict(last_n=-3), ["last_n", "-3"]),
    (dict(max_draft_len=-1), ["max_draft_len", "-1"]),
    (dict(page_size=24), ["page_size", "24"]),
    (dict(tokens_per_block=0), ["page_size", "0"]),
    (dict(dtype="bf16", first_n=4), ["first_n=4", "'bf16'"]),
    (dict(dtype="nvfp4", last_n=4), ["last_n=4", "'nvfp4'"]),
    (dict(dtype="fp8", first_n=1, last_n=1), ["'fp8'"]),
    (dict(speculative_mode="dynamic_tree"), ["dynamic_tree", "relocates"]),
    (dict(speculative_mode="medusa"), ["speculative_mode", "'medusa'"]),
    (dict(sparse_algorithm="rocket"), ["sparse_algorithm", "'rocket'"]),
    (dict(sparse_algorithm="csa2"), ["csa2", "natively NVFP4"]),
    (dict(dtype="mixed_nvfp4_fp8", sparse_algorithm="deepseek_v4.1"), ["deepseek_v4.1", "natively NVFP4"]),
    (dict(compute_dtype="int8"), ["compute_dtype", "'int8'"]),
    (dict(first_n=2, mixed_precision_first_n=3), ["mixed_precision_first_n=3", "first_n=2"]),
])
def test_rejections_name_field_and_value(kwargs, words):
    with pytest.raises(ValueError) as e:
        KVCacheConfig(**kwargs)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_accepted_combinations():
    for mode in ("mtp", "ngram", "eagle", None):
        KVCacheConfig(speculative_mode=mode, max_draft_len=3, first_n=4, last_n=4)
    for sparse in ("dsa", "deepseek_v4", None):
        KVCacheConfig(sparse_algorithm=sparse, first_n=4)
    # non-mixed dtypes may use any sparse algorithm and dynamic trees: no twin to follow
    KVCacheConfig("bf16", speculative_mode="dynamic_tree", sparse_algorithm="rocket")
    KVCacheConfig("nvfp4", sparse_algorithm="csa2")


def test_unknown_keyword():
    with pytest.raises(TypeError, match="unexpected keyword"):
        KVCacheConfig(first_m=3)


def test_replace_revalidates():
    c = KVCacheConfig(first_n=4)
    assert c.replace(last_n=8).last_n == 8
    with pytest.raises(ValueError, match="page_size"):
        c.replace(page_size=3)
