"""Capacity arithmetic against hand-computed byte counts."""
import pytest

from jmixedkv import KVCacheConfig
from jmixedkv.capacity import (ModelShape, bytes_per_token, capacity, capacity_table, format_bytes, format_table,
                               parse_bytes, parse_model_shape, row_bytes, twin_bytes_per_sequence)

L8B = (32, 8, 128)   # llama3-8b: layers, KV heads, head_dim


def test_row_bytes():
    assert row_bytes("nvfp4", 128) == 64 + 8 == 72
    assert row_bytes("nvfp4", 16) == 8 + 1
    assert row_bytes("float8_e4m3fn", 128) == 128
    assert row_bytes("bfloat16", 64) == row_bytes("float16", 64) == 128
    with pytest.raises(ValueError, match="int4"):
        row_bytes("int4", 128)


@pytest.mark.parametrize("dtype,expected", [
    ("bf16", 32 * 2 * 8 * 256), ("fp16", 131072), ("fp8", 32 * 2 * 8 * 128), ("nvfp4", 32 * 2 * 8 * 72),
    ("mixed_nvfp4_bf16", 36864), ("mixed_nvfp4_fp8", 36864)])
def test_bytes_per_token(dtype, expected):
    assert bytes_per_token(KVCacheConfig(dtype), *L8B) == expected


def test_bytes_per_token_mla_latent():
    # one latent row (kv_factor 1) of 576 -> 288 + 36 NVFP4 bytes, 61 layers, 1 head
    assert bytes_per_token(KVCacheConfig("nvfp4"), 61, 1, 576, kv_factor=1) == 61 * 324


def test_twin_bytes_per_sequence():
    # page 32, first 16 -> 1 fixed page; last 64 -> ring ceil(64/32) + 1 = 3 pages; 4 pages = 128 rows
    cfg = KVCacheConfig("mixed_nvfp4_bf16", first_n=16, last_n=64, page_size=32)
    assert twin_bytes_per_sequence(cfg, *L8B) == 128 * 32 * 2 * 8 * 256
    fp8 = cfg.replace(dtype="mixed_nvfp4_fp8")
    assert twin_bytes_per_sequence(fp8, *L8B) == 128 * 32 * 2 * 8 * 128
    # draft slack widens the ring: ceil((64 + 3)/32) + 1 = 4 ring pages
    assert twin_bytes_per_sequence(cfg.replace(max_draft_len=3), *L8B) == 160 * 32 * 2 * 8 * 256
    assert twin_bytes_per_sequence(KVCacheConfig("nvfp4"), *L8B) == 0
    assert twin_bytes_per_sequence(KVCacheConfig("mixed_nvfp4_bf16", page_size=32), *L8B) == 0


def test_capacity_page_rounding_and_twin():
    shape = ModelShape(*L8B)
    budget = 80 * 2 ** 30
    bf = capacity(KVCacheConfig("bf16", page_size=32), budget, shape, 8192)
    assert (bf.bytes_per_sequence, bf.sequences, bf.tokens, bf.ratio_vs_bf16) == (2 ** 30, 80, 80 * 8192, 1.0)
    # 8193 tokens -> 257 pages of 32
    bf2 = capacity(KVCacheConfig("bf16", page_size=32), budget, shape, 8193)
    assert bf2.bytes_per_sequence == 257 * 32 * 131072 and bf2.sequences == budget // (257 * 32 * 131072)
    mixed = capacity(KVCacheConfig("mixed_nvfp4_bf16", first_n=16, last_n=64, page_size=32), budget, shape, 8192)
    per_seq = 8192 * 36864 + 128 * 32 * 2 * 8 * 256
    assert mixed.bytes_per_sequence == per_seq and mixed.sequences == budget // per_seq == 269
    assert mixed.tokens == 269 * 8192 and mixed.ratio_vs_bf16 == pytest.approx(269 / 80)
    assert mixed.effective_bytes_per_token == pytest.approx(per_seq / 8192)
    tiny = capacity(KVCacheConfig("bf16", page_size=32), 1000, shape, 1)
    assert tiny.sequences == 0 and tiny.tokens == 0


def test_table_and_parsers():
    headers, rows = capacity_table([KVCacheConfig("bf16"), KVCacheConfig("nvfp4")], parse_bytes("80GiB"),
                                   parse_model_shape("llama3-8b"), 8192)
    text = format_table(headers, rows)
    assert text.splitlines()[0].startswith("kv cache") and len(text.splitlines()) == 4
    assert rows[1][0] == "nvfp4" and rows[1][1] == "36,864"
    assert parse_bytes("80GiB") == 80 * 2 ** 30 and parse_bytes("141GB") == 141 * 10 ** 9
    assert parse_bytes("1.5 KiB") == 1536 and parse_bytes("4096") == 4096
    assert parse_model_shape("80,8,128") == ModelShape(80, 8, 128, name="80,8,128")
    assert format_bytes(3 * 2 ** 20) == "3.00 MiB" and format_bytes(12) == "12 B"
    for bad in ("80XB", "", "-1GiB", "0"):
        with pytest.raises(ValueError):
            parse_bytes(bad)
    for bad in ("llama9", "32,8", "32,8,100", "0,8,128"):
        with pytest.raises(ValueError):
            parse_model_shape(bad)
    with pytest.raises(ValueError, match="seq_len"):
        capacity(KVCacheConfig("bf16"), 10 ** 9, ModelShape(*L8B), 0)
