"""`KVCacheConfig.recommended()`: the accuracy sweep's winner, its overrides, its memory, and that the plain dtype keeps
TensorRT-LLM's meaning."""
import pytest

from jmixedkv import capacity as cap
from jmixedkv.config import RECOMMENDED, KVCacheConfig
from jmixedkv_demo.specs import UsageError, parse_cache_spec


def bytes_per_element(cfg: KVCacheConfig, shape, seq_len: int) -> float:
    elems = seq_len * shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim
    return cap.capacity(cfg, 1 << 40, shape, seq_len).bytes_per_sequence / elems


def test_recommended_fields():
    cfg = KVCacheConfig.recommended()
    assert (cfg.dtype, cfg.first_n, cfg.last_n, cfg.page_size, cfg.rotation, cfg.block_scale, cfg.k_smoothing) == (
        "mixed_nvfp4_bf16", 4, 32, 16, "hadamard", "4over6", False)
    assert cfg == KVCacheConfig(**RECOMMENDED)
    assert cfg.is_mixed and cfg.has_low


def test_plain_mixed_dtype_keeps_trtllm_meaning():
    """``KVCacheConfig("mixed_nvfp4_bf16")``: no twin window and no lever unless given (TensorRT-LLM's defaults)."""
    cfg = KVCacheConfig("mixed_nvfp4_bf16")
    assert (cfg.first_n, cfg.last_n, cfg.rotation, cfg.block_scale, cfg.k_smoothing) == (0, 0, None, "max6", False)
    assert KVCacheConfig() == cfg


def test_recommended_overrides():
    base = KVCacheConfig.recommended()
    cfg = KVCacheConfig.recommended(last_n=64, page_size=32)
    assert (cfg.last_n, cfg.page_size) == (64, 32)
    assert cfg == base.replace(last_n=64, page_size=32)
    # TensorRT-LLM's names replace the field too
    assert KVCacheConfig.recommended(mixed_precision_last_n=64, tokens_per_block=32) == cfg
    assert KVCacheConfig.recommended(dtype="mixed_nvfp4_fp8").dtype == "mixed_nvfp4_fp8"
    assert KVCacheConfig.recommended(rotation=None).rotation is None
    with pytest.raises(ValueError, match="conflicts"):          # the same field twice, two values
        KVCacheConfig.recommended(last_n=64, mixed_precision_last_n=32)


@pytest.mark.parametrize("overrides,error,needle", [
    ({"bogus_field": 1}, TypeError, "bogus_field"),
    ({"last_n": -1}, ValueError, "last_n"),
    ({"rotation": "fourier"}, ValueError, "fourier"),
    ({"page_size": 24}, ValueError, "page_size"),
    ({"dtype": "fp8"}, ValueError, "first_n"),                  # a plain dtype keeps no twin window
])
def test_recommended_bad_override_refused(overrides, error, needle):
    with pytest.raises(error, match=needle):
        KVCacheConfig.recommended(**overrides)


@pytest.mark.parametrize("shape", [cap.ModelShape(30, 3, 64, name="SmolLM2-135M"), cap.MODEL_SHAPES["llama3-8b"]])
def test_recommended_memory_at_the_reference_length(shape):
    """<= 0.6 B/elem at the reference length (4096 tokens) and at 8192, as the docstring says; NVFP4 rows cost
    D/2 + D/16 bytes, so the twin's share is the rest."""
    cfg = KVCacheConfig.recommended()
    b4k, b8k = bytes_per_element(cfg, shape, 4096), bytes_per_element(cfg, shape, 8192)
    assert b4k <= 0.6 and b8k <= 0.6
    assert round(b4k, 3) == 0.594 and round(b8k, 3) == 0.578
    nvfp4 = (shape.head_dim / 2 + shape.head_dim / 16) / shape.head_dim
    assert bytes_per_element(KVCacheConfig("nvfp4", page_size=16), shape, 4096) == pytest.approx(nvfp4)
    assert b8k - nvfp4 == pytest.approx((b4k - nvfp4) / 2, rel=0.05)   # a fixed twin: its share halves


def test_recommended_cache_spec():
    label, cfg = parse_cache_spec("recommended", 4096, 32)
    assert label == "recommended" and cfg == KVCacheConfig.recommended(page_size=32)
    label, cfg = parse_cache_spec("recommended:4:32+smooth", 4096, 16)
    assert label == "recommended(4,32)+smooth"
    assert cfg == KVCacheConfig.recommended(first_n=4, last_n=32, k_smoothing=True)
    with pytest.raises(UsageError, match="recommended:x:1"):
        parse_cache_spec("recommended:x:1", 4096, 16)
