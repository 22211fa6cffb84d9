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
    assert tiny.ratio_vs_bf16 is None            # 0 / 0 is undefined (it used to read 1.00)
    # nvfp4 fits where bf16 does not: x / 0 is undefined too, and the table prints '-'
    budget = 8192 * 36864 + 1
    assert capacity(KVCacheConfig("nvfp4", page_size=32), budget, shape, 8192).ratio_vs_bf16 is None
    _, rows = capacity_table([KVCacheConfig("bf16", page_size=32), KVCacheConfig("nvfp4", page_size=32)], budget,
                             shape, 8192)
    assert [r[-3:] for r in rows] == [["0", "0", "-"], ["1", "8,192", "-"]]


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


# ---------------------------------------------------------------------------------------------- budgets
import json  # noqa: E402

from jmixedkv_demo import cli  # noqa: E402
from jmixedkv.capacity import MODEL_SHAPES, dense_params, kv_budget, shape_from_hf_config  # noqa: E402

LLAMA3_8B_CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
                    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                    "num_key_value_heads": 8, "tie_word_embeddings": False}


def test_named_shapes_know_their_parameters():
    # published parameter counts (model cards): 8.03B, 70.6B, 6.74B, 7.24B, 7.62B, 72.7B
    want = {"llama3-8b": 8.03e9, "llama3-70b": 70.55e9, "llama2-7b": 6.74e9, "mistral-7b": 7.24e9,
            "qwen2.5-7b": 7.62e9, "qwen2.5-72b": 72.7e9}
    for name, n in want.items():
        assert MODEL_SHAPES[name].num_params == pytest.approx(n, rel=2e-3), name
    # by hand, a 1-layer toy: embed 10*4 + lm_head 10*4, q/k/v/o 4*(4+2+2) + 4*4, mlp 3*4*6, norms 2*4 + 4
    assert dense_params(10, 4, 6, 1, 2, 1, 2) == 80 + (32 + 16) + 72 + 8 + 4


def test_shape_from_hf_config(tmp_path):
    path = tmp_path / "llama3" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(LLAMA3_8B_CONFIG))
    for arg in (str(path), str(path.parent)):
        shape = parse_model_shape(arg)
        assert (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.kv_factor) == (32, 8, 128, 2)
        assert shape.num_params == MODEL_SHAPES["llama3-8b"].num_params and shape.name == "llama3"
    tied = shape_from_hf_config(dict(LLAMA3_8B_CONFIG, tie_word_embeddings=True, head_dim=64), name="t")
    assert tied.head_dim == 64 and tied.num_params < MODEL_SHAPES["llama3-8b"].num_params
    moe = shape_from_hf_config(dict(LLAMA3_8B_CONFIG, num_local_experts=8), name="moe")
    assert moe.num_params is None and moe.num_kv_heads == 8
    mla = shape_from_hf_config({"num_hidden_layers": 61, "num_attention_heads": 128, "hidden_size": 7168,
                                "kv_lora_rank": 512, "qk_rope_head_dim": 64}, name="dsv3")
    assert (mla.num_layers, mla.num_kv_heads, mla.head_dim, mla.kv_factor) == (61, 1, 576, 1)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        shape_from_hf_config({"hidden_size": 8}, name="bad")
    # zero / negative / non-integer counts are refused naming the key (num_key_value_heads 0 used to mean 32)
    for key, value in (("num_key_value_heads", 0), ("num_hidden_layers", 0), ("head_dim", -64),
                       ("num_attention_heads", 32.5), ("num_key_value_heads", "8"), ("hidden_size", True)):
        with pytest.raises(ValueError, match=f"config.json {key}={value!r}, expected an integer >= 1"):
            shape_from_hf_config(dict(LLAMA3_8B_CONFIG, **{key: value}), name="bad")
    assert shape_from_hf_config(dict(LLAMA3_8B_CONFIG, num_key_value_heads=None), name="n").num_kv_heads == 32
    with pytest.raises(ValueError, match="cannot read"):
        parse_model_shape(str(tmp_path / "missing.json"))


def test_kv_budget_subtracts_weights_or_takes_it_as_given():
    l70 = MODEL_SHAPES["llama3-70b"]
    given = kv_budget(l70, gpu_mem=10 ** 9, kv_budget_bytes=5 * 10 ** 9)
    assert given.bytes == 5 * 10 ** 9 and given.source == "kv-budget" and "--kv-budget" in given.describe(l70)
    b = kv_budget(l70, gpu_mem=4 * 141 * 10 ** 9)
    assert b.weight_bytes == 2 * l70.num_params and b.bytes == 4 * 141 * 10 ** 9 - 2 * l70.num_params
    assert "bf16 weights" in b.describe(l70) and b.source == "gpu-mem - weights"
    fp8 = kv_budget(l70, gpu_mem=141 * 10 ** 9, weights_dtype="fp8")
    assert fp8.bytes == 141 * 10 ** 9 - l70.num_params
    # the example: 70B bf16 weights (~141 GB) do not fit in one 141 GB GPU
    with pytest.raises(ValueError, match="do not fit"):
        kv_budget(l70, gpu_mem=141 * 10 ** 9)
    custom = ModelShape(*L8B)
    u = kv_budget(custom, gpu_mem=80 * 2 ** 30)
    assert u.bytes == 80 * 2 ** 30 and "NOT subtracted" in u.describe(custom)
    with pytest.raises(ValueError, match="weights dtype"):
        kv_budget(l70, gpu_mem=10 ** 12, weights_dtype="int3")


def test_capacity_cli_budget_line_and_json(tmp_path, capsys):
    out_json = tmp_path / "cap.json"
    assert cli.main(["capacity", "--model-shape", "llama3-8b", "--gpu-mem", "80GiB", "--seq-len", "8192",
                     "--first-n", "16", "--last-n", "16", "--page-size", "32", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    weights = 2 * MODEL_SHAPES["llama3-8b"].num_params
    budget = 80 * 2 ** 30 - weights
    assert "- llama3-8b bf16 weights" in out and f"{budget // 2 ** 30}" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[3:8]}
    assert rows["bf16"][-3] == f"{budget // 2 ** 30:,}"                  # bf16: 1 GiB per 8192-token sequence
    data = json.loads(out_json.read_text())
    assert data["kv_budget_bytes"] == budget and data["weight_bytes"] == weights
    assert data["budget_source"] == "gpu-mem - weights"
    bf16 = next(r for r in data["rows"] if r["dtype"] == "bf16")
    assert bf16["sequences"] == budget // 2 ** 30 and bf16["bytes_per_token"] == 131072
    # --kv-budget: used as is; '--json -' prints JSON only
    assert cli.main(["capacity", "--kv-budget", "80GiB", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kv_budget_bytes"] == 80 * 2 ** 30 and data["budget_source"] == "kv-budget"
    assert next(r for r in data["rows"] if r["dtype"] == "bf16")["sequences"] == 80 * 8192 // 8192
    # weights that do not fit: exit 2 with the reason
    assert cli.main(["capacity", "--model-shape", "llama3-70b", "--gpu-mem", "141GB"]) == 2
    assert "do not fit" in capsys.readouterr().err


def test_capacity_cli_reads_hf_config(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA3_8B_CONFIG))
    assert cli.main(["capacity", "--model-shape", str(path), "--kv-budget", "8GiB", "--seq-len", "1024"]) == 0
    out = capsys.readouterr().out
    assert "L=32, H_kv=8, D=128" in out and "--kv-budget" in out and "sliding window" not in out
    # a sliding-window model: the table charges every token (the cache evicts nothing) and says so
    path.write_text(json.dumps(dict(LLAMA3_8B_CONFIG, sliding_window=4096)))
    assert cli.main(["capacity", "--model-shape", str(path), "--kv-budget", "8GiB", "--seq-len", "8192"]) == 0
    out = capsys.readouterr().out
    assert "sliding window 4096: every layer is charged the whole sequence" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[3:8]}
    assert rows["bf16"][-3] == "8"                                # 8 GiB / (8192 tokens * 128 KiB per token)


def test_capacity_cli_refuses_degenerate_budgets_and_outputs(tmp_path, capsys):
    """Nothing fits -> exit 2 saying so (it used to print a table of zeros with 'x bf16 1.00'); --json into a
    missing folder -> exit 2 before any work; a config.json with num_key_value_heads 0 -> exit 2 naming the key."""
    assert cli.main(["capacity", "--kv-budget", "1MiB", "--seq-len", "8192"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jmixedkv: error: nothing fits: one sequence of 8192 tokens of llama3-8b needs at least")
    assert "(nvfp4), more than the KV budget of 1.00 MiB" in err
    # bf16 does not fit one sequence, nvfp4 does: the table says so, and x bf16 is '-'
    assert cli.main(["capacity", "--kv-budget", f"{8192 * 36864 + 1}", "--seq-len", "8192", "--page-size", "32"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[3:8]}
    assert rows["bf16"][-3:] == ["0", "0", "-"] and rows["nvfp4"][-3:] == ["1", "8,192", "-"]
    assert "bf16: no sequence of 8192 tokens fits" in out
    assert cli.main(["capacity", "--json", str(tmp_path / "missing" / "cap.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(LLAMA3_8B_CONFIG, num_key_value_heads=0)))
    with pytest.raises(SystemExit) as e:
        cli.main(["capacity", "--model-shape", str(path)])
    assert e.value.code == 2 and "num_key_value_heads=0, expected an integer >= 1" in capsys.readouterr().err


def test_capacity_cli_counts_moe_weights_with_transformers(tmp_path, capsys):
    """A mixture-of-experts config.json (here a tiny Mixtral) gets its exact parameter count from transformers'
    meta-device model (the dense formula knows no experts: it used to leave the weights unsubtracted)."""
    import transformers  # noqa: F401  (the test extra installs it; a missing one fails here, never skips)
    v, h, ffn, layers, heads, kv, experts = 1000, 64, 96, 2, 4, 2, 4
    config = {"model_type": "mixtral", "vocab_size": v, "hidden_size": h, "intermediate_size": ffn,
              "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
              "num_local_experts": experts, "num_experts_per_tok": 2, "tie_word_embeddings": False}
    head_dim = h // heads
    per_layer = (h * heads * head_dim + 2 * h * kv * head_dim + heads * head_dim * h    # q, k, v, o
                 + h * experts + experts * 3 * h * ffn + 2 * h)                          # router, experts, 2 norms
    want = 2 * v * h + layers * per_layer + h                                            # embed, lm_head, final norm
    path = tmp_path / "mixtral" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    assert shape_from_hf_config(str(path)).num_params is None                   # the library's formula: unknown
    assert cli.main(["capacity", "--model-shape", str(path), "--gpu-mem", "1GiB", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["weight_bytes"] == 2 * want and data["kv_budget_bytes"] == 2 ** 30 - 2 * want
    assert data["params_source"].startswith("transformers ") and "MixtralForCausalLM" in data["params_source"]
