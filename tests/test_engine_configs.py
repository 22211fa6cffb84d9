"""`KVCacheConfig.from_vllm` / `from_trtllm` (`jmixedkv.engine_configs`): every engine name mapped or refused by
name, and a cache of 1-token pages (vLLM's ``block_size=1``) read by the kernels like the reference."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from helpers import poisoned_state

from jmixedkv import GroupSpec, decode, engine_configs, staging
from jmixedkv.config import KVCacheConfig

#: TensorRT-LLM ``tensorrt_llm.llmapi.KvCacheConfig`` fields (llm_args.py) and the First-N/Last-N fields of PR #20452
TRTLLM_FIELDS = ("enable_block_reuse", "max_tokens", "max_attention_window", "sink_token_length",
                 "free_gpu_memory_fraction", "host_cache_size", "onboard_blocks", "cross_kv_cache_fraction",
                 "secondary_offload_min_priority", "event_buffer_max_size", "attention_dp_events_gather_period_ms",
                 "enable_partial_reuse", "copy_on_partial_reuse", "use_uvm", "max_gpu_total_bytes", "dtype",
                 "mamba_ssm_cache_dtype", "tokens_per_block", "use_kv_cache_manager_v2", "max_util_for_resume",
                 "mixed_precision_first_n", "mixed_precision_last_n")
#: vLLM ``vllm.config.CacheConfig`` fields
VLLM_FIELDS = ("block_size", "gpu_memory_utilization", "swap_space", "cache_dtype", "is_attention_free",
               "num_gpu_blocks_override", "sliding_window", "enable_prefix_caching", "prefix_caching_hash_algo",
               "cpu_offload_gb", "calculate_kv_scales", "cpu_kvcache_space_bytes", "mamba_page_size_padded",
               "mamba_block_size", "mamba_cache_dtype", "mamba_ssm_cache_dtype", "mamba_cache_mode",
               "num_gpu_blocks", "num_cpu_blocks", "kv_sharing_fast_prefill", "kv_cache_memory_bytes",
               "kv_offloading_size", "kv_offloading_backend")
NOT_A_DEFAULT = 12345


@pytest.mark.parametrize("cache_dtype, model_dtype, want", [
    ("auto", "bfloat16", dict(dtype="bf16")),
    ("auto", torch.float16, dict(dtype="fp16")),
    ("auto", jnp.bfloat16, dict(dtype="bf16")),
    ("bfloat16", None, dict(dtype="bf16")),
    ("float16", "half", dict(dtype="fp16")),
    ("fp8", None, dict(dtype="fp8")),
    ("fp8_e4m3", "float16", dict(dtype="fp8", compute_dtype="float16")),
    ("nvfp4", "bf16", dict(dtype="nvfp4", compute_dtype="bfloat16")),
    ("mixed_nvfp4_fp8", torch.float16, dict(dtype="mixed_nvfp4_fp8", compute_dtype="float16")),
])
def test_vllm_cache_dtypes_map(cache_dtype, model_dtype, want):
    got = KVCacheConfig.from_vllm(cache_dtype, 16, model_dtype=model_dtype)
    assert got == KVCacheConfig(page_size=16, **want)
    assert got.attention_dtype == jnp.dtype(want.get("compute_dtype") or {"bf16": "bfloat16", "fp16": "float16"}.get(
        want["dtype"], "bfloat16"))


@pytest.mark.parametrize("cache_dtype, reason", [
    ("fp8_e5m2", "E4M3"), ("fp8_inc", "Gaudi"), ("fp8_ds_mla", "DeepSeek MLA"), ("int8", "int8"),
    ("int4_per_token_head", "int4"), ("turboquant_k8v4", "TurboQuant"), ("float32", "unknown"), ("fp4", "unknown"),
])
def test_vllm_refuses_unsupported_dtypes_by_name(cache_dtype, reason):
    with pytest.raises(ValueError, match=rf"cache_dtype='{cache_dtype}'.*{reason}.*accepted: \[.*'fp8_e4m3'"):
        KVCacheConfig.from_vllm(cache_dtype, 16, model_dtype="bfloat16")


def test_auto_needs_an_attention_model_dtype_and_formats_follow_the_model():
    for call in (lambda **kw: KVCacheConfig.from_vllm("auto", **kw), lambda **kw: KVCacheConfig.from_trtllm(**kw)):
        with pytest.raises(ValueError, match="'auto' means the model's dtype; pass model_dtype="):
            call()
        with pytest.raises(ValueError, match="'auto' with model_dtype='float32'"):
            call(model_dtype="float32")
        with pytest.raises(ValueError, match="model_dtype='int8' is not a model dtype"):
            call(model_dtype="int8")
    with pytest.raises(ValueError, match="attention dtype bfloat16, but model_dtype='float16'"):
        KVCacheConfig.from_vllm("bfloat16", model_dtype="float16")
    with pytest.raises(ValueError, match="attention dtype float16, but model_dtype='bfloat16'"):
        KVCacheConfig.from_trtllm(dtype="mixed_nvfp4_fp16", model_dtype=torch.bfloat16)
    # an explicit compute_dtype wins over model_dtype for formats without an attention dtype
    assert KVCacheConfig.from_vllm("fp8", model_dtype="bfloat16", compute_dtype="float32").compute_dtype == "float32"


@pytest.mark.parametrize("block_size", [1, 2, 8, 16, 256])
def test_vllm_block_size_is_the_page_size(block_size):
    assert KVCacheConfig.from_vllm("bfloat16", block_size).page_size == block_size


@pytest.mark.parametrize("block_size", [0, 3, 24, 16.0, True, "16"])
def test_vllm_bad_block_size_refused(block_size):
    with pytest.raises(ValueError, match=f"{block_size!r}"):
        KVCacheConfig.from_vllm("bfloat16", block_size)


def test_vllm_native_options_pass_through():
    got = KVCacheConfig.from_vllm("mixed_nvfp4_bf16", 32, first_n=4, last_n=64, max_draft_len=3,
                                  speculative_mode="eagle", rotation="hadamard")
    assert got == KVCacheConfig("mixed_nvfp4_bf16", first_n=4, last_n=64, page_size=32, max_draft_len=3,
                                speculative_mode="eagle", rotation="hadamard")


@pytest.mark.parametrize("name", sorted(engine_configs.VLLM_RUNTIME_FIELDS))
def test_vllm_runtime_fields_default_accepted_other_values_refused(name):
    defaults, where = engine_configs.VLLM_RUNTIME_FIELDS[name]
    base = KVCacheConfig.from_vllm("bfloat16", 16)
    for d in defaults:
        assert KVCacheConfig.from_vllm("bfloat16", 16, **{name: d}) == base
    with pytest.raises(ValueError, match=rf"{name}={NOT_A_DEFAULT} is not a property of the cache format: ") as err:
        KVCacheConfig.from_vllm("bfloat16", 16, **{name: NOT_A_DEFAULT})
    assert where in str(err.value)


def test_every_engine_field_is_mapped_or_refused():
    vllm_known = {"cache_dtype", "block_size"} | set(engine_configs.VLLM_RUNTIME_FIELDS)
    assert set(VLLM_FIELDS) <= vllm_known, sorted(set(VLLM_FIELDS) - vllm_known)
    trt_known = {"dtype", "tokens_per_block", "mixed_precision_first_n", "mixed_precision_last_n"} | set(
        engine_configs.TRTLLM_RUNTIME_FIELDS)
    assert set(TRTLLM_FIELDS) <= trt_known, sorted(set(TRTLLM_FIELDS) - trt_known)
    for call in (lambda: KVCacheConfig.from_vllm("bfloat16", kv_cache_layout="HND"),
                 lambda: KVCacheConfig.from_trtllm(dtype="fp8", kv_cache_layout="HND")):
        with pytest.raises(TypeError, match="unknown field 'kv_cache_layout'; accepted: .*'first_n'"):
            call()


@pytest.mark.parametrize("dtype, want", [
    ("fp8", "fp8"), ("nvfp4", "nvfp4"), ("bfloat16", "bf16"), ("fp16", "fp16"),
    ("mixed_nvfp4_bf16", "mixed_nvfp4_bf16"), ("mixed_nvfp4_bfloat16", "mixed_nvfp4_bf16"),
    ("mixed_nvfp4_float16", "mixed_nvfp4_fp16"), ("mixed_nvfp4_fp8", "mixed_nvfp4_fp8"),
])
def test_trtllm_dtypes_map(dtype, want):
    got = KVCacheConfig.from_trtllm(dtype=dtype, tokens_per_block=16)
    assert (got.dtype, got.page_size) == (want, 16)


def test_trtllm_mixed_fields_and_tokens_per_block():
    got = KVCacheConfig.from_trtllm(dtype="mixed_nvfp4_bf16", tokens_per_block=64, mixed_precision_first_n=4,
                                    mixed_precision_last_n=128, model_dtype="bfloat16", max_draft_len=2,
                                    speculative_mode="mtp")
    assert got == KVCacheConfig("mixed_nvfp4_bf16", first_n=4, last_n=128, page_size=64, max_draft_len=2,
                                speculative_mode="mtp")
    assert KVCacheConfig.from_trtllm(dtype="fp8").page_size == 32          # TensorRT-LLM's default tokens_per_block
    assert KVCacheConfig.from_trtllm(dtype="fp8", mixed_precision_first_n=None).first_n == 0


@pytest.mark.parametrize("tokens_per_block", [1, 0, 3, 48, 2.0, True])
def test_trtllm_tokens_per_block_must_be_a_power_of_two_above_one(tokens_per_block):
    with pytest.raises(ValueError, match=rf"tokens_per_block={tokens_per_block!r}; TensorRT-LLM requires a power "
                                         "of two greater than 1"):
        KVCacheConfig.from_trtllm(dtype="fp8", tokens_per_block=tokens_per_block)


@pytest.mark.parametrize("dtype", ["int8", "fp8_e5m2", "mixed_nvfp4_fp32", "fp4"])
def test_trtllm_refuses_unsupported_dtypes_by_name(dtype):
    with pytest.raises(ValueError, match=rf"dtype='{dtype}' is not supported.*accepted: \[.*'mixed_nvfp4_bf16'"):
        KVCacheConfig.from_trtllm(dtype=dtype)


@pytest.mark.parametrize("name", sorted(engine_configs.TRTLLM_RUNTIME_FIELDS))
def test_trtllm_runtime_fields_default_accepted_other_values_refused(name):
    defaults, _ = engine_configs.TRTLLM_RUNTIME_FIELDS[name]
    base = KVCacheConfig.from_trtllm(dtype="fp8")
    for d in defaults:
        assert KVCacheConfig.from_trtllm(dtype="fp8", **{name: d}) == base
    with pytest.raises(ValueError, match=rf"{name}={NOT_A_DEFAULT} is not a property of the cache format"):
        KVCacheConfig.from_trtllm(dtype="fp8", **{name: NOT_A_DEFAULT})


def test_trtllm_budget_refusal_says_where_it_belongs():
    with pytest.raises(ValueError, match=r"free_gpu_memory_fraction=0.5 .*init_state\(num_pages=...\).*capacity"):
        KVCacheConfig.from_trtllm(dtype="fp8", free_gpu_memory_fraction=0.5)
    with pytest.raises(ValueError, match=r"max_attention_window=\[4096\] .*decode_attention\(sliding_window=...\)"):
        KVCacheConfig.from_trtllm(dtype="fp8", max_attention_window=[4096])
    with pytest.raises(ValueError, match=r"host_cache_size=1073741824 .*jmixedkv.offload.HostTier"):
        KVCacheConfig.from_trtllm(dtype="fp8", host_cache_size=1 << 30)


class _PydanticLike:
    """Stand-in for a pydantic ``KvCacheConfig``: ``model_dump(exclude_unset=True)`` gives the fields set."""

    def __init__(self, **fields):
        self._fields = fields

    def model_dump(self, exclude_unset=False):
        assert exclude_unset
        return dict(self._fields)


def test_trtllm_config_object_or_mapping():
    obj = _PydanticLike(dtype="mixed_nvfp4_fp8", tokens_per_block=16, mixed_precision_last_n=32,
                        use_kv_cache_manager_v2=True, free_gpu_memory_fraction=0.9)
    want = KVCacheConfig("mixed_nvfp4_fp8", last_n=32, page_size=16, compute_dtype="float16")
    assert KVCacheConfig.from_trtllm(obj, model_dtype="float16") == want
    assert KVCacheConfig.from_trtllm(dict(obj.model_dump(True)), model_dtype="float16") == want
    assert KVCacheConfig.from_trtllm(obj, model_dtype="float16", tokens_per_block=16) == want
    with pytest.raises(ValueError, match="tokens_per_block=32 conflicts with the config object's tokens_per_block=16"):
        KVCacheConfig.from_trtllm(obj, tokens_per_block=32)


def test_one_token_pages_are_read_like_the_reference():
    """vLLM's ``block_size=1``: the staging kernel is bit-equal to its reference and the decode kernel matches the
    float32 reference (the decode step gathers >= 16 one-token pages)."""
    cfg = KVCacheConfig.from_vllm("mixed_nvfp4_bf16", 1, first_n=2, last_n=3)
    state = poisoned_state(cfg, GroupSpec(num_layers=1, num_kv_heads=2, head_dim=32), [5, 9, 0], decode_steps=2)
    seqs = jnp.array([0, 1, 2, -1], jnp.int32)
    got = staging.stage(state, 0, seqs, backend="pallas")
    want = staging.stage(state, 0, seqs, backend="reference")
    np.testing.assert_array_equal(np.asarray(got.to_dense(), np.float32), np.asarray(want.to_dense(), np.float32))
    q = jax.random.normal(jax.random.key(0), (4, 1, 4, 32)).astype(jnp.bfloat16)
    out, lse = decode.decode_attention(state, 0, q, seqs, backend="pallas")
    ref, ref_lse = decode.decode_attention(state, 0, q, seqs, backend="reference")
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=1e-2, rtol=1e-2)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=1e-4, rtol=1e-4)
    assert np.isinf(np.asarray(lse)[2:]).all() and not np.asarray(out, np.float32)[2:].any()   # empty / padding
