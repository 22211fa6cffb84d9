"""KV cache capacity arithmetic: bytes per token, twin bytes per sequence, and what fits in a memory budget.

Bytes per stored head row of ``D`` elements (one K or one V row of one KV head):

==========================  ===================================  ==========
format                      bytes per row                        D = 128
==========================  ===================================  ==========
NVFP4 (low pool)            ``D/2`` packed E2M1 + ``D/16`` E4M3   72
FP8 E4M3                    ``D`` (+ one f32 scale per layer)      128
bf16 / fp16                 ``2 D``                               256
==========================  ===================================  ==========

A mixed dtype stores every token in NVFP4 *and* keeps a per-sequence twin of ``F + R`` high pages
(``F = ceil(first_n / page)`` fixed pages, a ring of ``R = ceil((last_n + max_draft_len) / page) + 1`` pages):
its cost is fixed per sequence, whatever the sequence length. Per-layer scales (f32 per layer and K/V) are
negligible and not counted. Pages are whole: a sequence of ``n`` tokens holds ``ceil(n / page)`` low pages.

Budgets: the KV budget is either given (``--kv-budget``) or GPU memory minus the model's weights
(`kv_budget`): ``num_params * bytes per weight`` (bf16: 2), with ``num_params`` known for the named shapes and
counted from a Hugging Face ``config.json`` of a dense Llama-style model (`shape_from_hf_config`); activations,
workspace and the CUDA context are not counted.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Iterable, Optional, Sequence

from .config import DTYPES, KVCacheConfig

__all__ = ["config_label", "MODEL_SHAPES", "ModelShape", "parse_model_shape", "parse_bytes", "format_bytes",
           "row_bytes", "bytes_per_token", "twin_bytes_per_sequence", "Capacity", "capacity", "capacity_table",
           "format_table", "format_ratio", "shape_from_hf_config", "dense_params", "WEIGHT_BYTES", "KVBudget",
           "kv_budget"]


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """KV geometry of a model: layers with a KV cache, KV heads, head_dim, K+V (2) or MLA latent (1); and the
    parameter count when known (None: unknown, weights cannot be subtracted from a GPU memory size)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_factor: int = 2
    name: str = "custom"
    num_params: Optional[int] = None

    def __post_init__(self):
        for f in ("num_layers", "num_kv_heads", "head_dim"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"ModelShape.{f} must be an integer >= 1, got {v!r}")
        if self.head_dim % 16:
            raise ValueError(f"ModelShape.head_dim must be a multiple of 16 (NVFP4 blocks), got {self.head_dim}")
        if self.kv_factor not in (1, 2):
            raise ValueError(f"ModelShape.kv_factor must be 1 or 2, got {self.kv_factor}")
        if self.num_params is not None and (not isinstance(self.num_params, int) or self.num_params < 1):
            raise ValueError(f"ModelShape.num_params must be a positive integer or None, got {self.num_params!r}")

    def __str__(self) -> str:
        return f"{self.name} (L={self.num_layers}, H_kv={self.num_kv_heads}, D={self.head_dim})"


def dense_params(vocab_size: int, hidden_size: int, intermediate_size: int, num_layers: int, num_heads: int,
                 num_kv_heads: int, head_dim: int, tie_word_embeddings: bool = False,
                 attention_bias: bool = False) -> int:
    """Parameters of a dense Llama-style decoder (embeddings, q/k/v/o, SwiGLU MLP, RMSNorms, lm_head)."""
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    attn = hidden_size * (q + 2 * kv) + q * hidden_size + (q + 2 * kv if attention_bias else 0)
    layer = attn + 3 * hidden_size * intermediate_size + 2 * hidden_size
    embed = vocab_size * hidden_size * (1 if tie_word_embeddings else 2)
    return num_layers * layer + embed + hidden_size


def _named(name, vocab, hidden, inter, layers, heads, kv_heads, head_dim=128, bias=False):
    return ModelShape(layers, kv_heads, head_dim, name=name,
                      num_params=dense_params(vocab, hidden, inter, layers, heads, kv_heads, head_dim,
                                              attention_bias=bias))


#: Named KV shapes of public models (layers, KV heads, head_dim; parameters from their published configs).
MODEL_SHAPES = {
    "llama3-8b": _named("llama3-8b", 128256, 4096, 14336, 32, 32, 8),
    "llama3-70b": _named("llama3-70b", 128256, 8192, 28672, 80, 64, 8),
    "llama2-7b": _named("llama2-7b", 32000, 4096, 11008, 32, 32, 32),
    "mistral-7b": _named("mistral-7b", 32000, 4096, 14336, 32, 32, 8),
    "qwen2.5-7b": _named("qwen2.5-7b", 152064, 3584, 18944, 28, 28, 4, bias=True),
    "qwen2.5-72b": _named("qwen2.5-72b", 152064, 8192, 29568, 80, 64, 8, bias=True),
}

#: bytes per weight for the weight subtraction
WEIGHT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1, "int8": 1, "nvfp4": 0.5625, "int4": 0.5}


def shape_from_hf_config(config, name: Optional[str] = None) -> ModelShape:
    """`ModelShape` from a Hugging Face config (a ``config.json`` path, a folder holding one, or the dict).

    KV geometry: ``num_hidden_layers``, ``num_key_value_heads`` (default ``num_attention_heads``), ``head_dim``
    (default ``hidden_size / num_attention_heads``); an MLA model (``kv_lora_rank``) stores one latent row of
    ``kv_lora_rank + qk_rope_head_dim``. Parameters: counted for dense Llama-style models (`dense_params`), None
    for mixture-of-experts and MLA configs (not modelled)."""
    if not isinstance(config, dict):
        path = os.path.join(config, "config.json") if os.path.isdir(config) else config
        try:
            with open(path) as f:
                config = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"model shape {path!r}: cannot read a Hugging Face config.json ({e})") from None
        name = name or os.path.basename(os.path.dirname(os.path.abspath(path))) or path
    cfg = config.get("text_config", config)
    missing = [k for k in ("num_hidden_layers", "num_attention_heads", "hidden_size") if cfg.get(k) is None]
    if missing:
        raise ValueError(f"model shape {name!r}: config lacks {missing} (need num_hidden_layers, "
                         f"num_attention_heads, hidden_size)")
    count = lambda key, default=None, low=1: _config_count(cfg, key, name, default, low)  # noqa: E731
    layers, heads, hidden = count("num_hidden_layers"), count("num_attention_heads"), count("hidden_size")
    kv_heads = count("num_key_value_heads", heads)
    head_dim = count("head_dim", hidden // heads)
    moe = any(cfg.get(k) for k in ("num_local_experts", "num_experts", "n_routed_experts"))
    if cfg.get("kv_lora_rank") is not None:                           # MLA: one latent row per token and layer
        dim = count("kv_lora_rank") + count("qk_rope_head_dim", 0, low=0)
        return ModelShape(layers, 1, dim, kv_factor=1, name=name or "hf-config")
    params = None
    if not moe and cfg.get("vocab_size") and cfg.get("intermediate_size"):
        params = dense_params(int(cfg["vocab_size"]), hidden, int(cfg["intermediate_size"]), layers, heads,
                              kv_heads, head_dim, bool(cfg.get("tie_word_embeddings", False)),
                              bool(cfg.get("attention_bias", False)))
    return ModelShape(layers, kv_heads, head_dim, name=name or "hf-config", num_params=params)


def _config_count(cfg: dict, key: str, name, default=None, low: int = 1) -> int:
    """``cfg[key]`` as an integer >= ``low`` (``default`` when absent or null); ValueError naming the key."""
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"model shape {name!r}: config.json {key}={value!r}, expected an integer >= {low}")
    return value


@dataclasses.dataclass(frozen=True)
class KVBudget:
    """The KV budget and where it came from: ``source`` is ``"kv-budget"`` (given) or ``"gpu-mem - weights"``
    or ``"gpu-mem (weights unknown, not subtracted)"``."""

    bytes: int
    source: str
    gpu_mem: Optional[int] = None
    weight_bytes: Optional[int] = None
    weights_dtype: Optional[str] = None

    def describe(self, shape: ModelShape) -> str:
        if self.source == "kv-budget":
            return f"KV budget {format_bytes(self.bytes)} (--kv-budget; model weights not considered)"
        if self.weight_bytes is None:
            return (f"KV budget {format_bytes(self.bytes)} = all of --gpu-mem: the parameter count of "
                    f"{shape.name} is unknown, so its weights are NOT subtracted (pass --kv-budget, or a config.json "
                    f"with transformers installed)")
        return (f"KV budget {format_bytes(self.bytes)} = --gpu-mem {format_bytes(self.gpu_mem)} - {shape.name} "
                f"{self.weights_dtype} weights {format_bytes(self.weight_bytes)} ({shape.num_params / 1e9:.2f}B "
                f"params; activations and workspace not counted)")


def kv_budget(shape: ModelShape, *, gpu_mem: Optional[int] = None, kv_budget_bytes: Optional[int] = None,
              weights_dtype: str = "bf16") -> KVBudget:
    """The KV budget: ``kv_budget_bytes`` as given, else ``gpu_mem`` minus the weights (``num_params *
    WEIGHT_BYTES[weights_dtype]``; all of ``gpu_mem`` when the parameter count is unknown). ValueError when the
    weights do not fit."""
    if kv_budget_bytes is not None:
        return KVBudget(int(kv_budget_bytes), "kv-budget")
    if gpu_mem is None:
        raise ValueError("kv_budget: give gpu_mem or kv_budget_bytes")
    if weights_dtype not in WEIGHT_BYTES:
        raise ValueError(f"weights dtype {weights_dtype!r}: expected one of {sorted(WEIGHT_BYTES)}")
    if shape.num_params is None:
        return KVBudget(int(gpu_mem), "gpu-mem (weights unknown, not subtracted)", gpu_mem)
    weights = int(shape.num_params * WEIGHT_BYTES[weights_dtype])
    if weights >= gpu_mem:
        raise ValueError(f"the {weights_dtype} weights of {shape.name} ({format_bytes(weights)}, "
                         f"{shape.num_params / 1e9:.2f}B params) do not fit in --gpu-mem {format_bytes(gpu_mem)}; "
                         f"use more GPUs' memory, a smaller --weights-dtype, or set --kv-budget")
    return KVBudget(int(gpu_mem - weights), "gpu-mem - weights", gpu_mem, weights, weights_dtype)


_UNITS = {"": 1, "b": 1, "k": 10 ** 3, "kb": 10 ** 3, "m": 10 ** 6, "mb": 10 ** 6, "g": 10 ** 9, "gb": 10 ** 9,
          "t": 10 ** 12, "tb": 10 ** 12, "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def parse_model_shape(text: str) -> ModelShape:
    """``"llama3-8b"`` (see `MODEL_SHAPES`), ``"L,H,D"``, or a path to a Hugging Face ``config.json`` (or its
    folder) -> `ModelShape`; ValueError otherwise."""
    key = text.strip().lower()
    if key in MODEL_SHAPES:
        return MODEL_SHAPES[key]
    if text.strip().endswith(".json") or os.path.isdir(text.strip()) or os.path.isfile(text.strip()):
        return shape_from_hf_config(text.strip())
    parts = key.split(",")
    if len(parts) == 3 and all(p.strip().isdigit() for p in parts):
        return ModelShape(*(int(p) for p in parts), name=f"{parts[0]},{parts[1]},{parts[2]}")
    raise ValueError(f"model shape {text!r}: expected one of {sorted(MODEL_SHAPES)}, 'L,H,D' "
                     f"(layers, KV heads, head_dim), e.g. '32,8,128', or a path to a Hugging Face config.json")


def parse_bytes(text) -> int:
    """``"80GiB"``, ``"80GB"``, ``"1.5TiB"``, ``"123456"`` -> bytes (int); ValueError otherwise."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"memory size {text!r}: expected a number with an optional unit "
                             f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '80GiB'")
        value, unit = float(m.group(1)), m.group(2).lower()
    out = int(value * _UNITS[unit])
    if out <= 0:
        raise ValueError(f"memory size {text!r} must be > 0")
    return out


def format_bytes(n: float) -> str:
    """Human-readable binary size (``"1.50 GiB"``)."""
    for unit, scale in (("TiB", 2 ** 40), ("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def row_bytes(fmt: str, head_dim: int) -> int:
    """Bytes of one head row of ``head_dim`` elements in ``fmt`` (``nvfp4``, ``float8_e4m3fn``, ``bfloat16``,
    ``float16``)."""
    if fmt == "nvfp4":
        return head_dim // 2 + head_dim // 16
    if fmt == "float8_e4m3fn":
        return head_dim
    if fmt in ("bfloat16", "float16"):
        return 2 * head_dim
    raise ValueError(f"row_bytes: unknown format {fmt!r}")


def bytes_per_token(config: KVCacheConfig, num_layers: int, num_kv_heads: int, head_dim: int,
                    kv_factor: int = 2) -> int:
    """Bytes every token costs in the main pool (NVFP4 for mixed / nvfp4 dtypes, else the plain dtype),
    over all layers, K and V (``kv_factor``) and KV heads. The twin is counted by `twin_bytes_per_sequence`."""
    low, high = DTYPES[config.dtype]
    return num_layers * kv_factor * num_kv_heads * row_bytes(low or high, head_dim)


def twin_bytes_per_sequence(config: KVCacheConfig, num_layers: int, num_kv_heads: int, head_dim: int,
                            kv_factor: int = 2) -> int:
    """Bytes of one sequence's high twin: ``(F + R) * page`` rows per layer / K,V / head (0 unless mixed)."""
    if not config.is_mixed:
        return 0
    rows = config.num_high_pages_per_seq * config.page_size
    return rows * num_layers * kv_factor * num_kv_heads * row_bytes(DTYPES[config.dtype][1], head_dim)


@dataclasses.dataclass(frozen=True)
class Capacity:
    """What fits in a budget for sequences of ``seq_len`` tokens.

    ``bytes_per_sequence`` = ``ceil(seq_len / page) * page * bytes_per_token + twin_bytes_per_sequence``;
    ``sequences`` = ``budget // bytes_per_sequence``; ``tokens`` = ``sequences * seq_len``;
    ``ratio_vs_bf16`` = tokens / tokens of a bf16 cache at the same page size; None where the budget holds no
    bf16 sequence (the ratio is undefined: 0 / 0, or x / 0)."""

    label: str
    seq_len: int
    bytes_per_token: int
    twin_bytes_per_sequence: int
    bytes_per_sequence: int
    sequences: int
    tokens: int
    ratio_vs_bf16: Optional[float]

    @property
    def effective_bytes_per_token(self) -> float:
        """Bytes per token of a ``seq_len`` sequence, page rounding and twin included."""
        return self.bytes_per_sequence / self.seq_len


def config_label(config: KVCacheConfig) -> str:
    if config.is_mixed:
        return f"{config.dtype}({config.first_n},{config.last_n})"
    return config.dtype


def capacity(config: KVCacheConfig, budget_bytes: int, shape: ModelShape, seq_len: int) -> Capacity:
    """Sequences of ``seq_len`` tokens (and their tokens) that fit in ``budget_bytes`` of KV cache."""
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"capacity: seq_len must be an integer >= 1, got {seq_len!r}")
    if budget_bytes <= 0:
        raise ValueError(f"capacity: budget_bytes must be > 0, got {budget_bytes!r}")
    geo = (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.kv_factor)
    per_tok = bytes_per_token(config, *geo)
    twin = twin_bytes_per_sequence(config, *geo)
    pages = -(-seq_len // config.page_size)
    per_seq = pages * config.page_size * per_tok + twin
    seqs = int(budget_bytes // per_seq)
    bf16 = KVCacheConfig("bf16", page_size=config.page_size)
    bf16_seqs = int(budget_bytes // (pages * config.page_size * bytes_per_token(bf16, *geo)))
    ratio = seqs / bf16_seqs if bf16_seqs else None
    return Capacity(config_label(config), seq_len, per_tok, twin, per_seq, seqs, seqs * seq_len, ratio)


def capacity_table(configs: Iterable[KVCacheConfig], budget_bytes: int, shape: ModelShape,
                   seq_len: int) -> tuple[list[str], list[list[str]]]:
    """``(headers, rows)`` of strings, one row per config, for `format_table`."""
    headers = ["kv cache", "B/token", "eff. B/token", "twin/seq", "bytes/seq", "sequences", "tokens", "x bf16"]
    rows = []
    for cfg in configs:
        c = capacity(cfg, budget_bytes, shape, seq_len)
        rows.append([c.label, f"{c.bytes_per_token:,}", f"{c.effective_bytes_per_token:,.0f}",
                     format_bytes(c.twin_bytes_per_sequence), format_bytes(c.bytes_per_sequence),
                     f"{c.sequences:,}", f"{c.tokens:,}",
                     format_ratio(c.ratio_vs_bf16)])
    return headers, rows


def format_ratio(ratio: Optional[float]) -> str:
    """``"1.78"``, or ``"-"`` where the ratio is undefined (no bf16 sequence fits)."""
    return "-" if ratio is None else f"{ratio:.2f}"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Plain-text table: first column left-aligned, the others right-aligned."""
    cols = list(zip(headers, *rows)) if rows else [(h,) for h in headers]
    widths = [max(len(str(x)) for x in col) for col in cols]

    def line(cells):
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))
    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), sep] + [line(r) for r in rows])
