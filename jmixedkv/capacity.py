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
"""
from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Sequence

from .config import DTYPES, KVCacheConfig

__all__ = ["config_label", "MODEL_SHAPES", "ModelShape", "parse_model_shape", "parse_bytes", "format_bytes",
           "row_bytes", "bytes_per_token", "twin_bytes_per_sequence", "Capacity", "capacity", "capacity_table",
           "format_table"]


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """KV geometry of a model: layers with a KV cache, KV heads, head_dim, K+V (2) or MLA latent (1)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_factor: int = 2
    name: str = "custom"

    def __post_init__(self):
        for f in ("num_layers", "num_kv_heads", "head_dim"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"ModelShape.{f} must be an integer >= 1, got {v!r}")
        if self.head_dim % 16:
            raise ValueError(f"ModelShape.head_dim must be a multiple of 16 (NVFP4 blocks), got {self.head_dim}")
        if self.kv_factor not in (1, 2):
            raise ValueError(f"ModelShape.kv_factor must be 1 or 2, got {self.kv_factor}")

    def __str__(self) -> str:
        return f"{self.name} (L={self.num_layers}, H_kv={self.num_kv_heads}, D={self.head_dim})"


#: Named KV shapes of public models (layers, KV heads, head_dim).
MODEL_SHAPES = {
    "llama3-8b": ModelShape(32, 8, 128, name="llama3-8b"),
    "llama3-70b": ModelShape(80, 8, 128, name="llama3-70b"),
    "llama2-7b": ModelShape(32, 32, 128, name="llama2-7b"),
    "mistral-7b": ModelShape(32, 8, 128, name="mistral-7b"),
    "qwen2.5-7b": ModelShape(28, 4, 128, name="qwen2.5-7b"),
    "qwen2.5-72b": ModelShape(80, 8, 128, name="qwen2.5-72b"),
}

_UNITS = {"": 1, "b": 1, "k": 10 ** 3, "kb": 10 ** 3, "m": 10 ** 6, "mb": 10 ** 6, "g": 10 ** 9, "gb": 10 ** 9,
          "t": 10 ** 12, "tb": 10 ** 12, "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def parse_model_shape(text: str) -> ModelShape:
    """``"llama3-8b"`` (see `MODEL_SHAPES`) or ``"L,H,D"`` -> `ModelShape`; ValueError otherwise."""
    key = text.strip().lower()
    if key in MODEL_SHAPES:
        return MODEL_SHAPES[key]
    parts = key.split(",")
    if len(parts) == 3 and all(p.strip().isdigit() for p in parts):
        return ModelShape(*(int(p) for p in parts), name=f"{parts[0]},{parts[1]},{parts[2]}")
    raise ValueError(f"model shape {text!r}: expected one of {sorted(MODEL_SHAPES)} or 'L,H,D' "
                     f"(layers, KV heads, head_dim), e.g. '32,8,128'")


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


def _main_format(config: KVCacheConfig) -> str:
    low, high = DTYPES[config.dtype]
    return low if low is not None else high


def bytes_per_token(config: KVCacheConfig, num_layers: int, num_kv_heads: int, head_dim: int,
                    kv_factor: int = 2) -> int:
    """Bytes every token costs in the main pool (NVFP4 for mixed / nvfp4 dtypes, else the plain dtype),
    over all layers, K and V (``kv_factor``) and KV heads. The twin is counted by `twin_bytes_per_sequence`."""
    return num_layers * kv_factor * num_kv_heads * row_bytes(_main_format(config), head_dim)


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
    ``ratio_vs_bf16`` = tokens / tokens of a bf16 cache at the same page size."""

    label: str
    seq_len: int
    bytes_per_token: int
    twin_bytes_per_sequence: int
    bytes_per_sequence: int
    sequences: int
    tokens: int
    ratio_vs_bf16: float

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
    ratio = (seqs / bf16_seqs) if bf16_seqs else float("inf") if seqs else 1.0
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
                     f"{c.ratio_vs_bf16:.2f}"])
    return headers, rows


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Plain-text table: first column left-aligned, the others right-aligned."""
    cols = list(zip(headers, *rows)) if rows else [(h,) for h in headers]
    widths = [max(len(str(x)) for x in col) for col in cols]

    def line(cells):
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))
    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), sep] + [line(r) for r in rows])
