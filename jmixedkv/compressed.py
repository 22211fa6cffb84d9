"""Compressed-history layer groups (DeepSeek-V4 style): NVFP4 rows of compressed positions + one high twin per
compression ratio, their page tables, the twin's row mask, and the reference write / read.

A compressed group with ratio ``r`` stores one row per ``r`` raw tokens: compressed row ``c`` covers raw tokens
``[c * r, (c + 1) * r)`` and exists once all of them are in (compressed length ``n_c = kv_len // r``).

Retained set in compressed positions (our choice, documented): a compressed row is retained when it covers any
raw token of the raw retained set, rounded outward:

    first_c = ceil(first_n / r)          rows c < first_c          (cover raw tokens < first_n)
    last_c  = ceil(last_n / r)           rows n_c - last_c <= c < n_c

Twin table per ratio: ``F_c = ceil(first_c / page)`` fixed pages, then a ring of
``R_c = ceil((last_c + ceil(max_draft_len / r)) / page) + 1`` pages (0 when ``last_n == 0``): a
`jmixedkv.layout.TwinGeometry` in compressed rows, so the retained / column rules are the raw groups' own.

The twin's write takes a row mask (`twin_row_mask`): a row is written only if the twin holds its page — a released
page (``-1`` entry, e.g. a ring page given back) or a column past the table's width means "not held", never the
table's last column. Readers take a twin row only where it is retained *and* held, else the dequantized NVFP4 row.

Levers: the rotation lever (``KVCacheConfig.rotation``) does not apply to compressed groups -- their write
(`write_compressed_reference`) stores the compressor's rows as given and their readers return them as stored, so
a reader sees the rows the caller wrote whatever the config (no ``as_stored`` choice to make). Nor does
``block_scale`` (NVFP4 rows are written with the default ``"max6"``), nor K smoothing (``k_smoothing``: only the
raw-token groups' `CacheState` holds K means; compressed rows are stored as given).

State is a pytree (`CompressedCache`); every function is pure (cache in, cache out). Tables are set by the caller
(`with_tables`, `release_twin_page`): page allocation for these groups belongs to the cache manager.

Bad input (the rule of `jmixedkv.checks`, docs/DESIGN.md "bad input"): every slot, layer, page id and position is
range-checked where it is used. Host values (Python / NumPy) out of range raise `ValueError` naming the value.
JAX values (traced or not) are checked on the device: a transition (`with_tables`, `release_twin_page`,
`set_lengths`, `write_compressed_reference`) then sets a bit in ``cache.error`` (``checks.ERR_*``) and changes
nothing else (all or nothing); a reader (`read_compressed_reference`, `gather_compressed`) returns NaN rows for a
bad slot, layer or page id -- never another sequence's rows (padding ``-1`` and positions outside ``[0, n_c)``
read as zero, as before). Legal write positions follow the raw groups' rule (`jmixedkv.checks`, in compressed
rows against ``n_c``): per sequence and call, distinct contiguous rows ``[p0, p1]`` with ``p0 <= n_c <= p1 + 1``
(an extension from ``n_c`` or a rewrite that reaches the end), so a write never lands in a twin ring row that
holds another row of the current window. Lengths are the caller's mirror of the raw state (`set_lengths`): set
them to cover written rows before reading.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import checks, layout
from .backend import dispatch
from .checks import ERR_BAD_LAYER, ERR_BAD_PAGE, ERR_BAD_POSITION, ERR_BAD_SLOT, ERR_SHARED_PAGE, ERR_TOO_LONG
from .config import KVCacheConfig
from .pools import GroupPools, LowPool, RowPool, pytree, read_low_rows, read_row_pool
from .write import write_rows_reference

__all__ = ["CompressedLevel", "CompressedCache", "compressed_geometry", "init_compressed",
           "with_tables", "release_twin_page", "set_lengths", "compressed_lengths", "twin_row_mask",
           "twin_write_mask", "write_compressed_reference", "read_compressed_reference",
           "gather_compressed", "validate_compressed"]


def compressed_geometry(config: KVCacheConfig, ratio: int) -> layout.TwinGeometry:
    """Twin geometry of the ratio-``ratio`` group under ``config``, in compressed rows (the module docstring)."""
    if not isinstance(ratio, int) or ratio < 1:
        raise ValueError(f"compression ratio must be an integer >= 1, got {ratio!r}")
    return layout.TwinGeometry.for_window(config.page_size, -(-config.first_n // ratio),
                                          -(-config.last_n // ratio), -(-config.max_draft_len // ratio))


@pytree()
class CompressedLevel:
    """One ratio: ``low`` NVFP4 pool of compressed rows + ``page_table i32[S, W]``; ``twin`` row pool +
    ``twin_table i32[S, F_c + R_c]`` (None when the config keeps no twin)."""

    low: LowPool
    page_table: jax.Array
    twin: Optional[RowPool]
    twin_table: jax.Array


@pytree("config")
class CompressedCache:
    """Compressed-history groups keyed by ratio. ``levels: dict ratio -> CompressedLevel``; ``kv_lens i32[S]`` raw
    lengths (shared with the raw-token groups); ``error i32[]`` sticky ``checks.ERR_*`` bits of refused
    transitions."""

    config: KVCacheConfig
    levels: Dict[int, CompressedLevel]
    kv_lens: jax.Array
    error: jax.Array

    @property
    def max_seqs(self) -> int:
        return self.kv_lens.shape[0]

    def geometry(self, ratio: int) -> layout.TwinGeometry:
        if ratio not in self.levels:
            raise ValueError(f"no compressed group with ratio {ratio}; have {sorted(self.levels)}")
        return compressed_geometry(self.config, ratio)

    @property
    def twins(self) -> Dict[int, Optional[RowPool]]:
        """``dict ratio -> twin`` (the high pool of each compressed group)."""
        return {r: lv.twin for r, lv in self.levels.items()}


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
        def shape(pages, width, itemsize):   # pages padded out of the Pallas Triton offset hole (layout.py)
            per_page = num_layers * kv_factor * num_kv_heads * page * width
            return (num_layers, layout.offset_safe_count(pages, per_page, itemsize), kv_factor, num_kv_heads, page,
                    width)
        data = jnp.full(shape(num_pages, head_dim // 2, 1), 0x77 if poison else 0, jnp.uint8)
        scales = jax.lax.bitcast_convert_type(
            jnp.full(shape(num_pages, head_dim // 16, 1), 0x7F if poison else 0, jnp.uint8), jnp.float8_e4m3fn)
        low = LowPool(data, scales, jnp.broadcast_to(jnp.asarray(gs, jnp.float32), (num_layers, kv_factor)))
        twin = None
        if geom.width:
            n_twin = max_seqs * geom.width if num_twin_pages is None else num_twin_pages
            twin_shape = shape(n_twin, head_dim, jnp.dtype(config.high_dtype).itemsize)
            rows = (jnp.full(twin_shape, jnp.nan, jnp.float32).astype(config.high_dtype) if poison
                    else jnp.zeros(twin_shape, config.high_dtype))
            twin = RowPool(rows, jnp.broadcast_to(jnp.asarray(twin_scale, jnp.float32), (num_layers, kv_factor)))
        levels[r] = CompressedLevel(low, jnp.full((max_seqs, max_pages_per_seq), -1, jnp.int32), twin,
                                    jnp.full((max_seqs, geom.width), -1, jnp.int32))
    return CompressedCache(config, levels, jnp.zeros((max_seqs,), jnp.int32), jnp.int32(0))


def num_low_pages(level: CompressedLevel) -> int:
    """Pages of a level's NVFP4 pool. Only one of ``data`` / ``scales`` can carry offset-hole padding pages
    (`jmixedkv.layout.offset_safe_count`), so the smaller page axis is the real count."""
    return min(level.low.data.shape[1], level.low.scales.shape[1])


def _level(cache: CompressedCache, ratio: int):
    """``(geometry, level)`` of the ratio-``ratio`` group (`ValueError` when there is none)."""
    return cache.geometry(ratio), cache.levels[ratio]


def _replace_level(cache: CompressedCache, ratio: int, **changes) -> CompressedCache:
    cache.geometry(ratio)
    levels = dict(cache.levels)
    levels[ratio] = dataclasses.replace(levels[ratio], **changes)
    return dataclasses.replace(cache, levels=levels)


def _flag(cache: CompressedCache, err) -> CompressedCache:
    return dataclasses.replace(cache, error=cache.error | err)


def _ids_ok(ids, num_pages: int, per_row: bool):
    """bool: every entry in ``[-1, num_pages)`` and no id >= 0 listed twice -- within a row (``per_row``: low pages
    may be shared between sequences, e.g. a common prefix) or anywhere (twin pages belong to one sequence)."""
    rows = ids if per_row else ids.reshape(1, -1)
    n = rows.shape[1]
    if n < 2:
        return checks.page_ids_ok(ids, num_pages)
    srt = jnp.sort(jnp.where(rows >= 0, rows, -1 - jnp.arange(n, dtype=rows.dtype)[None, :]), axis=1)
    dup = jnp.any((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0))
    return checks.page_ids_ok(ids, num_pages) & ~dup


def _table_arg(table, name: str, num_seqs: int, num_pages: int, per_row: bool):
    """A page table argument -> i32[S, W]; host values: ids in ``[-1, num_pages)``, each id >= 0 at most once (per
    row when ``per_row``)."""
    t = checks.index_array(table, name, "with_tables", -1, num_pages, ndim=2)
    if t.shape[0] != num_seqs:
        raise ValueError(f"with_tables: {name} must have {num_seqs} rows (one per sequence slot), got {t.shape}")
    if not checks.is_jax(table):
        h = np.asarray(table)
        for r, row in enumerate(h if per_row else h.reshape(1, -1)):
            vals, counts = np.unique(row[row >= 0], return_counts=True)
            if (counts > 1).any():
                where = f" row {r}" if per_row else ""
                raise ValueError(f"with_tables: {name}{where} lists page {int(vals[counts > 1][0])} more than once")
    return t


def with_tables(cache: CompressedCache, ratio: int, page_table=None, twin_table=None) -> CompressedCache:
    """Replace the low page table ``i32[S, W]`` and/or the twin table ``i32[S, ·]`` of one ratio (any width; rows
    past it are not held). Entries are page ids in ``[-1, P)`` (``-1`` = not held); a low page at most once per
    sequence (sequences may share one: `write_compressed_reference` refuses to write into it), a twin page at most
    once in the table. Host tables with a bad entry raise `ValueError`. JAX tables with one set ``ERR_BAD_PAGE`` and change
    nothing (a table of a new width, which cannot keep the old contents, is replaced by an empty one: nothing
    held)."""
    _, lv = _level(cache, ratio)
    new, ok = {}, jnp.bool_(True)
    n_twin = lv.twin.rows.shape[1] if lv.twin is not None else 0
    for name, table, n, per_row in (("page_table", page_table, num_low_pages(lv), True),
                                    ("twin_table", twin_table, n_twin, False)):
        if table is not None:
            new[name] = _table_arg(table, name, cache.max_seqs, n, per_row)
            ok = ok & _ids_ok(new[name], n, per_row)
    old = {k: getattr(lv, k) for k in new}
    kept = {k: jnp.where(ok, v, old[k] if old[k].shape == v.shape else -1) for k, v in new.items()}
    return _flag(_replace_level(cache, ratio, **kept), jnp.where(ok, 0, ERR_BAD_PAGE))


def release_twin_page(cache: CompressedCache, ratio: int, seq_slot, column) -> CompressedCache:
    """Mark twin column ``column`` of ``seq_slot`` released (-1): its rows are no longer held. ``seq_slot = -1`` is
    a no-op. Host values out of range raise `ValueError`; JAX values set ``ERR_BAD_SLOT`` (slot outside
    ``[-1, S)``) or ``ERR_BAD_PAGE`` (column outside the table) and change nothing."""
    _, lv = _level(cache, ratio)
    width = lv.twin_table.shape[1]
    slot = checks.check_slot_arg(seq_slot, cache.max_seqs, "seq_slot", "release_twin_page")
    if checks.is_jax(column):
        col = checks.index_array(column, "column", "release_twin_page", ndim=0)
    else:
        col = jnp.int32(checks.host_int(column, "column", "release_twin_page", 0, width))
    slot_ok = (slot >= -1) & (slot < cache.max_seqs)
    col_ok = (col >= 0) & (col < width)
    ok = slot_ok & col_ok & (slot >= 0)
    row = jnp.where(ok, slot, cache.max_seqs)
    table = lv.twin_table.at[row, jnp.clip(col, 0, max(width - 1, 0))].set(-1, mode="drop")
    err = jnp.where(slot_ok, 0, ERR_BAD_SLOT) | jnp.where(col_ok | (slot == -1), 0, ERR_BAD_PAGE)
    return _flag(_replace_level(cache, ratio, twin_table=table), err)


def set_lengths(cache: CompressedCache, kv_lens) -> CompressedCache:
    """New raw lengths ``i32[S]`` (e.g. the raw-token state's corrected ``kv_lens``), each ``>= 0``. Host values
    that are not raise `ValueError`; JAX values set ``ERR_BAD_POSITION`` and keep the old lengths. (Compressed rows
    past a ratio's page table are simply not held: they read as zero.)"""
    lens = checks.index_array(kv_lens, "kv_lens", "set_lengths", 0, None, ndim=1)
    if lens.shape != cache.kv_lens.shape:
        raise ValueError(f"set_lengths: kv_lens must be i32[{cache.max_seqs}], got shape {lens.shape}")
    ok = jnp.all(lens >= 0)
    return dataclasses.replace(cache, kv_lens=jnp.where(ok, lens, cache.kv_lens),
                               error=cache.error | jnp.where(ok, 0, ERR_BAD_POSITION))


def compressed_lengths(cache: CompressedCache, ratio: int, kv_lens=None):
    """i32[S]: complete compressed rows per sequence, ``kv_len // ratio``."""
    lens = cache.kv_lens if kv_lens is None else jnp.asarray(kv_lens, jnp.int32)
    return lens // ratio


def _live(cache: CompressedCache, seq):
    """Slots outside ``[0, S)`` -> -1 (never clipped onto another sequence's row of a table)."""
    return jnp.where((seq >= 0) & (seq < cache.max_seqs), seq, -1)


def twin_row_mask(cache: CompressedCache, ratio: int, seq, cpos):
    """bool: the twin holds compressed row ``(seq, cpos)`` — its column exists in the table's width and the page
    entry is not -1 (released). Padding (``seq < 0``), slots ``>= S`` and ``cpos < 0`` are not held."""
    geom = cache.geometry(ratio)
    seq = _live(cache, jnp.asarray(seq, jnp.int32))
    return geom.high_slots(cache.levels[ratio].twin_table, seq, cpos) >= 0


def twin_write_mask(cache: CompressedCache, ratio: int, seq, cpos):
    """bool[T]: rows of a write call that go to the twin: held (`twin_row_mask`), stored in the low pool too, and
    not overwritten later in the same call by a ring row of the same sequence."""
    geom, lv = _level(cache, ratio)
    seq = _live(cache, jnp.asarray(seq, jnp.int32))
    low_ok = layout.low_slots(lv.page_table, seq, cpos, geom.page) >= 0
    fresh = geom.write_mask(seq, cpos, lv.page_table.shape[0])
    return twin_row_mask(cache, ratio, seq, cpos) & low_ok & fresh


def _page_at(table, seq, col):
    """``table[seq, col]`` for in-range (seq, col), else -1 (seq already -1 for padding / bad slots)."""
    ok = (seq >= 0) & (col >= 0) & (col < table.shape[1])
    if not table.shape[1]:
        return jnp.full(jnp.broadcast_shapes(seq.shape, col.shape), -1, jnp.int32)
    v = table[jnp.clip(seq, 0, table.shape[0] - 1), jnp.clip(col, 0, table.shape[1] - 1)]
    return jnp.where(ok, v, -1)


def write_compressed_reference(cache: CompressedCache, ratio: int, x, layer, seq, cpos) -> CompressedCache:
    """Store compressed rows ``x[T, kv, H, D]`` (one layer) or ``[L, T, kv, H, D]`` (``layer=None``) at
    ``(seq[t], cpos[t])``: every row to the NVFP4 pool, masked rows (`twin_write_mask`) to the twin.

    ``seq`` i32[T] (-1 = padding), ``cpos`` i32[T], ``layer`` int / traced i32 / None. All or nothing: a slot
    outside ``[-1, S)`` (``ERR_BAD_SLOT``), a layer out of range (``ERR_BAD_LAYER``), a row past the page table
    (``ERR_TOO_LONG``), positions that break the write rule of the module docstring (``ERR_BAD_POSITION``) or a
    row whose low page is not held / whose page id is out of range (``ERR_BAD_PAGE``) or is also held by another
    sequence (``ERR_SHARED_PAGE``: no copy-on-write here, the manager gives a writer its own page) write nothing
    and set the bit in ``cache.error``. Host ``seq`` / ``layer`` out of range raise `ValueError`."""
    geom, lv = _level(cache, ratio)
    op = "write_compressed_reference"
    num_layers, num_seqs = lv.low.data.shape[0], cache.max_seqs
    layer = checks.check_layer_arg(layer, num_layers, op)
    seq = checks.index_array(seq, "seq", op, -1, num_seqs, ndim=1)
    cpos = checks.index_array(cpos, "cpos", op, ndim=1)
    if cpos.shape != seq.shape:
        raise ValueError(f"{op}: seq and cpos must have the same length, got {seq.shape}, {cpos.shape}")
    want = (seq.shape[0],) + lv.low.data.shape[2:4] + (lv.low.data.shape[5] * 2,)
    if layer is None:
        want = (num_layers,) + want
    if tuple(x.shape) != want:
        raise ValueError(f"{op}: x must be {want} ([L,] T, kv, H, D), got {tuple(x.shape)}")
    layer_c, layer_ok = checks.layer_in_range(layer, num_layers)
    slot_ok = jnp.all((seq >= -1) & (seq < num_seqs))
    seq = _live(cache, seq)
    live = seq >= 0
    q = cpos // geom.page
    too_long = jnp.any(live & (q >= lv.page_table.shape[1]))
    n_c = compressed_lengths(cache, ratio)
    bad_pos, _, _ = checks.append_position_errors(seq, cpos, n_c, num_seqs)
    low_page = _page_at(lv.page_table, seq, q)
    num_pages = num_low_pages(lv)
    bad_page = jnp.any(live & ~too_long & ((low_page < 0) | (low_page >= num_pages)))
    holders = jnp.zeros((num_pages,), jnp.int32).at[
        jnp.where(lv.page_table >= 0, lv.page_table, num_pages)].add(1, mode="drop")
    shared = jnp.any(live & (low_page >= 0) & (holders[jnp.clip(low_page, 0, num_pages - 1)] > 1))
    if lv.twin is not None:
        hcol = geom.high_column(cpos)
        hpage = _page_at(lv.twin_table, seq, hcol)
        bad_page = bad_page | jnp.any(live & (hpage >= lv.twin.rows.shape[1]))
    ok = layer_ok & slot_ok & ~too_long & ~bad_pos & ~bad_page & ~shared
    err = (jnp.where(layer_ok, 0, ERR_BAD_LAYER) | jnp.where(slot_ok, 0, ERR_BAD_SLOT)
           | jnp.where(too_long, ERR_TOO_LONG, 0) | jnp.where(bad_pos, ERR_BAD_POSITION, 0)
           | jnp.where(bad_page, ERR_BAD_PAGE, 0) | jnp.where(shared, ERR_SHARED_PAGE, 0))
    seq = jnp.where(ok, seq, -1)
    low_slot = layout.low_slots(lv.page_table, seq, cpos, geom.page)
    mask = twin_write_mask(cache, ratio, seq, cpos)
    high_slot = geom.high_slots(lv.twin_table, seq, cpos, write_mask=mask)
    pools = write_rows_reference(GroupPools(lv.low, lv.twin, None), x, layer_c, low_slot, high_slot, geom.page)
    return _flag(_replace_level(cache, ratio, low=pools.low, twin=pools.high), err)


def read_compressed_reference(cache: CompressedCache, ratio: int, layer, seq, cpos, kv_lens=None):
    """Rows a reader sees at compressed positions ``(seq, cpos)`` -> ``[..., kv, H, D]`` (attention dtype).

    Twin row where retained and held, else the dequantized NVFP4 row; zero outside ``[0, n_c)``, for padding
    (``seq == -1``) and where the low page is -1. NaN rows for a slot outside ``[-1, S)``, a layer out of range
    or a page id outside the pool (never another sequence's rows); host slots / layer out of range raise
    `ValueError`."""
    geom, lv = _level(cache, ratio)
    op = "read_compressed_reference"
    dtype = cache.config.attention_dtype
    num_layers, num_pages = lv.low.data.shape[0], num_low_pages(lv)
    layer = checks.check_layer_arg(layer, num_layers, op)
    if layer is None:
        raise ValueError(f"{op}: layer must be an index in [0, {num_layers}), got None")
    seq = checks.index_array(seq, "seq", op, -1, cache.max_seqs)
    cpos = jnp.asarray(cpos, jnp.int32)
    layer_c, layer_ok = checks.layer_in_range(layer, num_layers)
    bad = ~layer_ok | (seq < -1) | (seq >= cache.max_seqs)
    seq = _live(cache, seq)
    n_c = jnp.where(seq >= 0, compressed_lengths(cache, ratio, kv_lens)[jnp.maximum(seq, 0)], 0)
    page = _page_at(lv.page_table, seq, cpos // geom.page)
    in_len = (cpos >= 0) & (cpos < n_c)
    bad = bad | (in_len & ((page < -1) | (page >= num_pages)))
    valid = in_len & (page >= 0) & (page < num_pages)
    lp, row = jnp.clip(page, 0, num_pages - 1), jnp.maximum(cpos, 0) % geom.page
    out = read_low_rows(lv.low, layer_c, lp, row, dtype)
    if lv.twin is not None:
        n_twin = lv.twin.rows.shape[1]
        hcol = geom.high_column(cpos)
        hpage = _page_at(lv.twin_table, seq, hcol)
        keep = valid & geom.is_retained(cpos, n_c)
        bad = bad | (keep & ((hpage < -1) | (hpage >= n_twin)))
        keep = keep & (hpage >= 0) & (hpage < n_twin)
        high = read_row_pool(lv.twin, layer_c, jnp.clip(hpage, 0, n_twin - 1), row, dtype)
        out = jnp.where(keep[..., None, None, None], high, out)
    out = jnp.where(valid[..., None, None, None], out, jnp.zeros((), dtype))
    return jnp.where(bad[..., None, None, None], jnp.asarray(jnp.nan, dtype), out)


def validate_compressed(cache: CompressedCache, ratio: int, seq_slots, indices, kv_lens=None, layer=None) -> None:
    """Host checks for `gather_compressed` (pulls the arrays): layer, slots, indices in ``[-1, n_c)``, and the low
    pages of selected rows in ``[0, P)``; raises `ValueError` naming the offending entry."""
    geom, lv = _level(cache, ratio)
    if layer is not None:
        checks.host_int(np.asarray(layer).item() if checks.is_jax(layer) else layer, "layer", "gather_compressed",
                        0, lv.low.data.shape[0])
    seq, idx = np.asarray(seq_slots), np.asarray(indices)
    n_c = np.asarray(compressed_lengths(cache, ratio, kv_lens))
    pt, num_pages = np.asarray(lv.page_table), num_low_pages(lv)
    if seq.ndim != 1 or idx.ndim != 2 or idx.shape[0] != seq.shape[0]:
        raise ValueError(f"gather_compressed: seq_slots must be [B] and indices [B, K], got {seq.shape}, "
                         f"{idx.shape}")
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
    (``validate`` None or True) the host checks of `validate_compressed` run first. Traced: rows of a slot outside
    ``[-1, S)``, a layer out of range or a bad page id come back NaN (both backends); indices outside
    ``[0, n_c)`` read as zero."""
    traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves((cache, layer, seq_slots,
                                                                                    indices)))
    if validate or (validate is None and not traced):
        validate_compressed(cache, ratio, seq_slots, indices, kv_lens, layer=layer)
    return dispatch(backend, _gather_compressed_reference, _gather_compressed_pallas)(
        cache, ratio, layer, jnp.asarray(seq_slots, jnp.int32), jnp.asarray(indices, jnp.int32), kv_lens)


def _gather_compressed_reference(cache, ratio, layer, seq, indices, kv_lens):
    return read_compressed_reference(cache, ratio, layer, seq[:, None], indices, kv_lens)


def _gather_compressed_pallas(cache, ratio, layer, seq, indices, kv_lens, *, interpret):
    from pallas_kernels.gather import gather_rows
    geom, lv = _level(cache, ratio)
    num_layers, num_pages = lv.low.data.shape[0], num_low_pages(lv)
    n_c = compressed_lengths(cache, ratio, kv_lens)
    # the kernel gets only in-range ids (bad slots -> padding, bad page ids -> not held); their rows are NaN after
    layer_c, layer_ok = checks.layer_in_range(jnp.asarray(layer, jnp.int32), num_layers)
    bad = ~layer_ok | (seq < -1) | (seq >= cache.max_seqs)
    seq_k = _live(cache, seq)
    n_row = jnp.where(seq_k >= 0, n_c[jnp.maximum(seq_k, 0)], 0)
    idx_k = jnp.where((indices >= 0) & (indices < n_row[:, None]), indices, -1)
    page = _page_at(lv.page_table, seq_k[:, None], idx_k // geom.page)
    bad_rows = bad[:, None] | ((idx_k >= 0) & ((page < -1) | (page >= num_pages)))
    page_table = jnp.where((lv.page_table >= 0) & (lv.page_table < num_pages), lv.page_table, -1)
    twin, twin_table = lv.twin, lv.twin_table
    if twin is not None:
        n_twin = twin.rows.shape[1]
        hcol = geom.high_column(idx_k)
        hpage = _page_at(twin_table, seq_k[:, None], hcol)
        bad_rows = bad_rows | ((idx_k >= 0) & ((hpage < -1) | (hpage >= n_twin)))
        twin_table = jnp.where((twin_table >= 0) & (twin_table < n_twin), twin_table, -1)
    out = gather_rows(layer_c.reshape(1), seq_k, n_c, page_table, twin_table, idx_k,
                      jnp.ones(seq.shape, jnp.float32), low=(lv.low.data, lv.low.scales, lv.low.gs),
                      high=None if twin is None else (twin.rows, twin.scale), geom=geom,
                      att_dtype=cache.config.attention_dtype, fp8=False, interpret=interpret)
    return jnp.where(bad_rows[..., None, None, None], jnp.asarray(jnp.nan, out.dtype), out)
