"""Compressed-history layer groups (DeepSeek-V4 style): NVFP4 rows of compressed positions + one high twin per
compression ratio, their page tables, the twin's row mask, and the reference write / read.

A compressed group with ratio ``r`` stores one row per ``r`` raw tokens: compressed row ``c`` covers raw tokens
``[c * r, (c + 1) * r)`` and exists once all of them are in (compressed length ``n_c = kv_len // r``).

Retained set in compressed positions (our choice, documented): a compressed row is retained when it covers any
raw token of the raw retained set, rounded outward:

    first_c = ceil(first_n / r)          rows c < first_c          (cover raw tokens < first_n)
    last_c  = ceil(last_n / r)           rows n_c - last_c <= c < n_c

Twin table per ratio: ``F_c = ceil(first_c / page)`` fixed pages, then a ring of
``R_c = ceil((last_c + ceil(max_draft_len / r)) / page) + 1`` pages (0 when ``last_n == 0``), the same
column rule as raw groups (`jmixedkv.layout.high_column`).

The twin's write takes a row mask (`twin_row_mask`): a row is written only if the twin holds its page — a released
page (``-1`` entry, e.g. a ring page given back) or a column past the table's width means "not held", never the
table's last column. Readers take a twin row only where it is retained *and* held, else the dequantized NVFP4 row.

State is a pytree (`CompressedCache`); every function is pure (cache in, cache out). Tables are set by the caller
(`with_tables`, `release_twin_page`): page allocation for these groups belongs to the cache manager.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import jax
import jax.numpy as jnp

from . import layout
from .config import KVCacheConfig
from .pools import GroupPools, LowPool, RowPool, read_low_rows, read_row_pool, write_rows_reference

__all__ = ["CompressedGeometry", "CompressedLevel", "CompressedCache", "compressed_geometry", "init_compressed",
           "with_tables", "release_twin_page", "set_lengths", "compressed_lengths", "twin_row_mask",
           "twin_write_mask", "retained_compressed", "write_compressed_reference", "read_compressed_reference",
           "gather_compressed", "validate_compressed"]


@dataclasses.dataclass(frozen=True)
class CompressedGeometry:
    """Static layout of one ratio: retained window in compressed rows and the twin table's columns."""

    ratio: int
    page: int
    first_c: int
    last_c: int
    num_fixed: int
    num_ring: int

    @property
    def twin_width(self) -> int:
        return self.num_fixed + self.num_ring


def compressed_geometry(config: KVCacheConfig, ratio: int) -> CompressedGeometry:
    """Geometry of the ratio-``ratio`` group under ``config`` (see the module docstring)."""
    if not isinstance(ratio, int) or ratio < 1:
        raise ValueError(f"compression ratio must be an integer >= 1, got {ratio!r}")
    page = config.page_size
    first_c = -(-config.first_n // ratio)
    last_c = -(-config.last_n // ratio)
    num_fixed = -(-first_c // page)
    num_ring = 0 if last_c == 0 else -(-(last_c + -(-config.max_draft_len // ratio)) // page) + 1
    return CompressedGeometry(ratio, page, first_c, last_c, num_fixed, num_ring)


@dataclasses.dataclass(frozen=True)
class CompressedLevel:
    """One ratio: ``low`` NVFP4 pool of compressed rows + ``page_table i32[S, W]``; ``twin`` row pool +
    ``twin_table i32[S, F_c + R_c]`` (None when the config keeps no twin)."""

    low: LowPool
    page_table: jax.Array
    twin: Optional[RowPool]
    twin_table: jax.Array


@dataclasses.dataclass(frozen=True)
class CompressedCache:
    """Compressed-history groups keyed by ratio. ``levels: dict ratio -> CompressedLevel``; ``kv_lens i32[S]`` raw
    lengths (shared with the raw-token groups)."""

    config: KVCacheConfig
    levels: Dict[int, CompressedLevel]
    kv_lens: jax.Array

    def geometry(self, ratio: int) -> CompressedGeometry:
        if ratio not in self.levels:
            raise ValueError(f"no compressed group with ratio {ratio}; have {sorted(self.levels)}")
        return compressed_geometry(self.config, ratio)

    @property
    def twins(self) -> Dict[int, Optional[RowPool]]:
        """``dict ratio -> twin`` (the high pool of each compressed group)."""
        return {r: lv.twin for r, lv in self.levels.items()}


jax.tree_util.register_dataclass(CompressedLevel, data_fields=["low", "page_table", "twin", "twin_table"],
                                 meta_fields=[])
jax.tree_util.register_dataclass(CompressedCache, data_fields=["levels", "kv_lens"], meta_fields=["config"])


def init_compressed(config: KVCacheConfig, ratios, *, num_layers: int, num_kv_heads: int, head_dim: int,
                    kv_factor: int = 1, num_pages: int, max_seqs: int, max_pages_per_seq: int,
                    num_twin_pages: Optional[int] = None, gs=1.0, twin_scale=1.0, poison: bool = False
                    ) -> CompressedCache:
    """Empty compressed groups for ``ratios`` (all tables -1). Pools: NVFP4 ``[L, num_pages, kv, H, page, ·]``
    and a twin ``[L, num_twin_pages, kv, H, page, D]`` in ``config.high_dtype`` (default ``max_seqs`` times the
    twin width). ``poison`` fills them with NaN-decoding bytes."""
    if not config.is_mixed:
        raise ValueError(f"compressed groups need a mixed dtype, got {config.dtype!r}")
    if head_dim % 16:
        raise ValueError(f"head_dim must be a multiple of 16, got {head_dim}")
    page = config.page_size
    levels = {}
    for r in ratios:
        geom = compressed_geometry(config, r)
        base = (num_layers, num_pages, kv_factor, num_kv_heads, page)
        data = jnp.full(base + (head_dim // 2,), 0x77 if poison else 0, jnp.uint8)
        scales = jax.lax.bitcast_convert_type(jnp.full(base + (head_dim // 16,), 0x7F if poison else 0, jnp.uint8),
                                              jnp.float8_e4m3fn)
        low = LowPool(data, scales, jnp.broadcast_to(jnp.asarray(gs, jnp.float32), (num_layers, kv_factor)))
        twin = None
        if geom.twin_width:
            n_twin = max_seqs * geom.twin_width if num_twin_pages is None else num_twin_pages
            shape = (num_layers, n_twin, kv_factor, num_kv_heads, page, head_dim)
            rows = (jnp.full(shape, jnp.nan, jnp.float32).astype(config.high_dtype) if poison
                    else jnp.zeros(shape, config.high_dtype))
            twin = RowPool(rows, jnp.broadcast_to(jnp.asarray(twin_scale, jnp.float32), (num_layers, kv_factor)))
        levels[r] = CompressedLevel(low, jnp.full((max_seqs, max_pages_per_seq), -1, jnp.int32), twin,
                                    jnp.full((max_seqs, geom.twin_width), -1, jnp.int32))
    return CompressedCache(config, levels, jnp.zeros((max_seqs,), jnp.int32))


def _replace_level(cache: CompressedCache, ratio: int, **changes) -> CompressedCache:
    cache.geometry(ratio)
    levels = dict(cache.levels)
    levels[ratio] = dataclasses.replace(levels[ratio], **changes)
    return dataclasses.replace(cache, levels=levels)


def with_tables(cache: CompressedCache, ratio: int, page_table=None, twin_table=None) -> CompressedCache:
    """Replace the low page table and/or the twin table of one ratio (any width; rows past it are not held)."""
    changes = {}
    if page_table is not None:
        changes["page_table"] = jnp.asarray(page_table, jnp.int32)
    if twin_table is not None:
        changes["twin_table"] = jnp.asarray(twin_table, jnp.int32)
    return _replace_level(cache, ratio, **changes)


def release_twin_page(cache: CompressedCache, ratio: int, seq_slot, column) -> CompressedCache:
    """Mark twin column ``column`` of ``seq_slot`` released (-1): its rows are no longer held."""
    lv = cache.levels[ratio]
    return _replace_level(cache, ratio, twin_table=lv.twin_table.at[seq_slot, column].set(-1))


def set_lengths(cache: CompressedCache, kv_lens) -> CompressedCache:
    """New raw lengths ``i32[S]`` (e.g. the raw-token state's corrected ``kv_lens``)."""
    return dataclasses.replace(cache, kv_lens=jnp.asarray(kv_lens, jnp.int32))


def compressed_lengths(cache: CompressedCache, ratio: int, kv_lens=None):
    """i32[S]: complete compressed rows per sequence, ``kv_len // ratio``."""
    lens = cache.kv_lens if kv_lens is None else jnp.asarray(kv_lens, jnp.int32)
    return lens // ratio


def twin_row_mask(cache: CompressedCache, ratio: int, seq, cpos):
    """bool: the twin holds compressed row ``(seq, cpos)`` — its column exists in the table's width and the page
    entry is not -1 (released). Padding (``seq < 0``) and ``cpos < 0`` are not held."""
    geom = cache.geometry(ratio)
    slots = layout.high_slots(cache.levels[ratio].twin_table, seq, cpos, geom.page, geom.num_fixed, geom.num_ring)
    return slots >= 0


def twin_write_mask(cache: CompressedCache, ratio: int, seq, cpos):
    """bool[T]: rows of a write call that go to the twin: held (`twin_row_mask`), stored in the low pool too, and
    not overwritten later in the same call by a ring row of the same sequence."""
    geom = cache.geometry(ratio)
    lv = cache.levels[ratio]
    low_ok = layout.low_slots(lv.page_table, seq, cpos, geom.page) >= 0
    num_seqs = lv.page_table.shape[0]
    last = layout.segment_max_position(seq, cpos, num_seqs)
    q, qmax = cpos // geom.page, last[jnp.clip(seq, 0, num_seqs - 1)] // geom.page
    fresh = (q < geom.num_fixed) | (q > qmax - geom.num_ring)
    return twin_row_mask(cache, ratio, seq, cpos) & low_ok & fresh


def retained_compressed(cache: CompressedCache, ratio: int, cpos, n_c):
    """bool: compressed row ``cpos`` of a sequence with ``n_c`` compressed rows is retained."""
    geom = cache.geometry(ratio)
    return layout.is_retained(cpos, n_c, geom.first_c, geom.last_c)


def write_compressed_reference(cache: CompressedCache, ratio: int, x, layer, seq, cpos) -> CompressedCache:
    """Store compressed rows ``x[T, kv, H, D]`` (one layer) or ``[L, T, kv, H, D]`` (``layer=None``) at
    ``(seq[t], cpos[t])``: every row to the NVFP4 pool, masked rows (`twin_write_mask`) to the twin."""
    geom = cache.geometry(ratio)
    lv = cache.levels[ratio]
    seq = jnp.asarray(seq, jnp.int32)
    cpos = jnp.asarray(cpos, jnp.int32)
    low_slot = layout.low_slots(lv.page_table, seq, cpos, geom.page)
    mask = twin_write_mask(cache, ratio, seq, cpos)
    high_slot = layout.high_slots(lv.twin_table, seq, cpos, geom.page, geom.num_fixed, geom.num_ring,
                                  write_mask=mask)
    pools = write_rows_reference(GroupPools(lv.low, lv.twin, None), x, layer, low_slot, high_slot, geom.page)
    return _replace_level(cache, ratio, low=pools.low, twin=pools.high)


def read_compressed_reference(cache: CompressedCache, ratio: int, layer, seq, cpos, kv_lens=None):
    """Rows a reader sees at compressed positions ``(seq, cpos)`` -> ``[..., kv, H, D]`` (attention dtype).

    Twin row where retained and held, else the dequantized NVFP4 row; zero outside ``[0, n_c)``, for padding and
    where the low page is -1."""
    geom = cache.geometry(ratio)
    lv = cache.levels[ratio]
    dtype = cache.config.attention_dtype
    seq = jnp.asarray(seq, jnp.int32)
    cpos = jnp.asarray(cpos, jnp.int32)
    n_c = compressed_lengths(cache, ratio, kv_lens)[jnp.maximum(seq, 0)]
    slot = layout.low_slots(lv.page_table, seq, cpos, geom.page)
    valid = (slot >= 0) & (cpos < n_c)
    lp, row = jnp.maximum(slot, 0) // geom.page, jnp.maximum(cpos, 0) % geom.page
    out = read_low_rows(lv.low, layer, lp, row, dtype)
    if lv.twin is not None:
        hslot = layout.high_slots(lv.twin_table, seq, cpos, geom.page, geom.num_fixed, geom.num_ring)
        keep = valid & (hslot >= 0) & retained_compressed(cache, ratio, cpos, n_c)
        high = read_row_pool(lv.twin, layer, jnp.maximum(hslot, 0) // geom.page, row, dtype)
        out = jnp.where(keep[..., None, None, None], high, out)
    return jnp.where(valid[..., None, None, None], out, jnp.zeros((), dtype))


def validate_compressed(cache: CompressedCache, ratio: int, seq_slots, indices, kv_lens=None) -> None:
    """Host checks for `gather_compressed` (pulls the arrays): slots, indices in ``[-1, n_c)``, and the low pages
    of selected rows in ``[0, P)``; raises `ValueError` naming the offending entry."""
    import numpy as np
    lv = cache.levels[ratio]
    geom = cache.geometry(ratio)
    seq, idx = np.asarray(seq_slots), np.asarray(indices)
    n_c = np.asarray(compressed_lengths(cache, ratio, kv_lens))
    pt, num_pages = np.asarray(lv.page_table), lv.low.data.shape[1]
    if idx.ndim != 2 or idx.shape[0] != seq.shape[0]:
        raise ValueError(f"gather_compressed: indices must be [B={seq.shape[0]}, K], got {idx.shape}")
    for b, s in enumerate(seq):
        if not -1 <= s < pt.shape[0]:
            raise ValueError(f"gather_compressed: seq_slots[{b}]={s} out of range [-1, {pt.shape[0]})")
        if s < 0:
            continue
        for k, c in enumerate(idx[b]):
            if not -1 <= c < n_c[s]:
                raise ValueError(f"gather_compressed: indices[{b}, {k}]={c} out of range [-1, {n_c[s]}) for "
                                 f"sequence slot {s} (ratio {ratio})")
            q = c // geom.page
            if c >= 0 and (q >= pt.shape[1] or not 0 <= pt[s, q] < num_pages):
                val = pt[s, q] if q < pt.shape[1] else "past the table width"
                raise ValueError(f"gather_compressed: indices[{b}, {k}]={c}: page_table[{s}, {q}]={val} is not a "
                                 f"valid page (ratio {ratio}, {num_pages} pages)")


def gather_compressed(cache: CompressedCache, ratio: int, layer, seq_slots, indices, *, backend: str = "auto",
                      kv_lens=None, validate: Optional[bool] = None):
    """Sparse gather over compressed rows (attention-dtype scratch ``[B, K, kv, H, D]``): the Pallas gather kernel
    with this ratio's geometry and compressed lengths, or `read_compressed_reference`. With concrete inputs
    (``validate`` None or True) the host checks of `validate_compressed` run first."""
    from .backend import interpret, resolve
    traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves((cache, seq_slots, indices)))
    if validate or (validate is None and not traced):
        validate_compressed(cache, ratio, seq_slots, indices, kv_lens)
    seq = jnp.asarray(seq_slots, jnp.int32)
    indices = jnp.asarray(indices, jnp.int32)
    if resolve(backend) == "reference":
        return read_compressed_reference(cache, ratio, layer, seq[:, None], indices, kv_lens)
    from pallas_kernels.gather import gather_rows
    from pallas_kernels.stage import ReadGeometry
    geom = cache.geometry(ratio)
    lv = cache.levels[ratio]
    rgeom = ReadGeometry(geom.page, geom.first_c, geom.last_c, geom.num_fixed, geom.num_ring)
    n_c = compressed_lengths(cache, ratio, kv_lens)
    twin = lv.twin
    return gather_rows(jnp.asarray(layer, jnp.int32).reshape(1), seq, n_c, lv.page_table, lv.twin_table, indices,
                       jnp.ones(seq.shape, jnp.float32), lv.low.data, lv.low.scales, lv.low.gs,
                       None if twin is None else twin.rows, None if twin is None else twin.scale, geom=rgeom,
                       att_dtype=cache.config.attention_dtype, fp8=False, interpret=interpret())
