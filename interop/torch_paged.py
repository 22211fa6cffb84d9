"""The torch references of the cache's two hot-path ops: `write_rows_reference_` (append the rows of one
layer, in place) and `paged_attention_reference` (decode / verify / chunk attention of one layer), over torch pools
in the project's exact layout; plus the slot helpers `low_slots` / `high_slots`. Every computation is a torch op (the
module imports `jmixedkv` for `TwinGeometry` and the format constants, and runs no JAX): the CPU implementations
of the contract, and the oracles of the Triton kernels.

Pools (`TorchPools`; ``L`` layers, ``P`` low pages, ``Ph`` twin pages; absent pools are None)::

    low_data    torch.uint8        [L, P, 2, H, page, D/2]   packed E2M1, element 2i in the low nibble
    low_scales  torch.uint8        [L, P, 2, H, page, D/16]  E4M3 bytes (float8_e4m3fn accepted)
    low_gs      torch.float32      [L, 2]                    NVFP4 decode global scale per layer, K/V
    high_rows   bf16 | fp16 | uint8 (fp8 e4m3 bytes) [L, Ph, 2, H, page, D]   the twin of a mixed cache
    high_scale  torch.float32      [L, 2]                    1.0 unless the twin is fp8
    plain_rows / plain_scale       as high_* with [L, P, ...]: every row of a plain (non-NVFP4) cache

A cache is mixed (low + high), NVFP4 only (low) or plain. Slots: ``slot = page_id * page + row``, -1 = skip.
Twin geometry ``geom``: a `jmixedkv.layout.TwinGeometry` or the tuple ``(page, first_n, last_n, num_fixed,
num_ring)``; its rule (retained set, ring column, write dedupe) is re-stated here in torch ops.

Semantics (bits equal to the JAX references; tests/test_torch_paged.py checks them against JAX):

* `write_rows_reference_` = `jmixedkv.write.write_rows_reference` of one layer: NVFP4 (`interop.torch_nvfp4`) of
  each K/V row into the low pool at ``low_slot`` (plain caches: the row's store form into ``plain_rows`` at
  ``low_slot``), the row's store form into the twin at ``high_slot``.
* `paged_attention_reference` = `jmixedkv.decode` over float32 staging: retained rows whose twin page is held
  read the twin (decoded in float32), others the NVFP4 row dequantized exactly in float32 (plain caches: the row
  decoded to the attention dtype, q's: an fp8 plain row is rounded to it, as `jmixedkv.decode`'s reference stages
  plain groups in the attention dtype); float32 logits, softmax
  and LSE (natural log). A query that sees no key gives ``out = 0, lse = -inf``; a NaN key or value it sees
  propagates. Agreement with JAX is to float32 rounding (the dot products sum in another order). Rows whose low
  page is -1 are not attended (JAX's reference would attend a zero row there; that never happens for ``p < n``
  in a valid state).

Bad input (shapes, dtypes, a layer, slot, page id or length out of range, repeated slots) raises `ValueError`
naming the value. The checks read the index tensors on the host (a device sync on CUDA): these are references.
"""
from __future__ import annotations

import operator
from typing import NamedTuple, Optional, Sequence, Union

import torch

from jmixedkv.layout import TwinGeometry
from jmixedkv.numerics import BLOCK

from .torch_nvfp4 import BLOCK_SCALES, decode_rows, dequantize, encode_rows, is_fp8_pool, quantize

__all__ = ["TorchPools", "geometry", "is_retained", "page_column", "low_slots", "high_slots", "write_rows_reference_",
           "paged_attention_reference", "round_trip_reference", "stage_reference"]

ROW_DTYPES = (torch.bfloat16, torch.float16, torch.uint8, torch.float8_e4m3fn)


class TorchPools(NamedTuple):
    """The pools of one cache as torch tensors (layout in the module docstring; None for absent pools). Its
    fields are the first seven positional arguments of `write_rows_reference_` / `paged_attention_reference`
    (``write_rows_reference_(*pools, layer, ...)``)."""

    low_data: Optional[torch.Tensor] = None
    low_scales: Optional[torch.Tensor] = None
    low_gs: Optional[torch.Tensor] = None
    high_rows: Optional[torch.Tensor] = None
    high_scale: Optional[torch.Tensor] = None
    plain_rows: Optional[torch.Tensor] = None
    plain_scale: Optional[torch.Tensor] = None


# ------------------------------------------------------------------------------------------------ geometry
def geometry(geom: Union[TwinGeometry, Sequence[int]]) -> TwinGeometry:
    """``geom`` as a `TwinGeometry` (from the tuple ``(page, first_n, last_n, num_fixed, num_ring)`` or itself)."""
    if isinstance(geom, TwinGeometry):
        return geom
    try:
        page, first_n, last_n, num_fixed, num_ring = (int(g) for g in geom)
    except (TypeError, ValueError) as e:
        raise ValueError(f"geom must be a TwinGeometry or (page, first_n, last_n, num_fixed, num_ring), "
                         f"got {geom!r}") from e
    if page < 1 or min(first_n, last_n, num_fixed, num_ring) < 0:
        raise ValueError(f"geom: page must be >= 1 and the other fields >= 0, got {tuple(geom)}")
    return TwinGeometry(page, first_n, last_n, num_fixed, num_ring)


def is_retained(pos: torch.Tensor, n: torch.Tensor, geom: TwinGeometry) -> torch.Tensor:
    """bool: ``pos < first_n`` or ``n - last_n <= pos``, and ``pos < n`` (`TwinGeometry.is_retained`)."""
    return ((pos < geom.first_n) | (pos >= n - geom.last_n)) & (pos < n)


def page_column(q: torch.Tensor, geom: TwinGeometry) -> torch.Tensor:
    """Twin-table column of page ``q``: ``q`` when ``q < F``, else ``F + q mod R`` (-1 without a ring)
    (`TwinGeometry.page_column`)."""
    if geom.num_ring == 0:
        return torch.where(q < geom.num_fixed, q, torch.full_like(q, -1))
    return torch.where(q < geom.num_fixed, q, geom.num_fixed + torch.remainder(q, geom.num_ring))


def _twin_page(table_rows: torch.Tensor, col: torch.Tensor):
    """``(page id i64, held bool)`` at ``table_rows[b, col[b, ...]]`` (``col`` [B, ...]): held when the column
    exists and the entry is not -1 (`TwinGeometry.twin_page` on a batch's rows)."""
    width = table_rows.shape[1]
    flat = col.reshape(col.shape[0], -1)
    page = torch.gather(table_rows.to(torch.int64), 1, flat.clamp(0, width - 1)).reshape(col.shape)
    return page, (col >= 0) & (col < width) & (page >= 0)


# ------------------------------------------------------------------------------------------------ slots
def low_slots(page_table_rows: torch.Tensor, pos: torch.Tensor, page: int) -> torch.Tensor:
    """Low (or plain) slots ``i64[B, T]`` of tokens at positions ``pos[B, T]`` of batch rows whose page-table rows
    are ``page_table_rows i32[B, MP]``: ``page_id * page + pos % page``; -1 for padding (``pos < 0``), a position
    past the table and an unallocated page (`jmixedkv.layout.low_slots`)."""
    _check_table(page_table_rows, "page_table_rows", "low_slots")
    pos = _check_positions(pos, page_table_rows.shape[0], "low_slots")
    max_pages = page_table_rows.shape[1]
    q = torch.div(pos, page, rounding_mode="floor")
    pg = torch.gather(page_table_rows.to(torch.int64), 1, q.clamp(0, max_pages - 1))
    ok = (pos >= 0) & (q < max_pages) & (pg >= 0)
    return torch.where(ok, pg * page + torch.remainder(pos, page), torch.full_like(pos, -1))


def high_slots(high_table_rows: Optional[torch.Tensor], pos: torch.Tensor,
               geom: Union[TwinGeometry, Sequence[int]], keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Twin slots ``i64[B, T]`` of tokens at positions ``pos[B, T]`` (``pos < 0`` = padding) of batch rows whose
    twin-table rows are ``high_table_rows i32[B, W]``, for one write of those tokens.

    A slot is -1 where the twin does not hold the row (padding, no column, a -1 entry), where ``keep`` (optional
    bool[B, T], e.g. ``low_slots(...) >= 0``) is False, and where the write dedupe drops it: a ring row that a
    later token of the same row in the same write overwrites (`TwinGeometry.write_mask` with each batch row as
    one sequence: page ``q`` is kept when ``q < F`` or ``q > q_last - R``, ``q_last`` the page of the row's
    largest position). Equals `jmixedkv.state.write_slots`' twin slots."""
    g = geometry(geom)
    rows = high_table_rows.shape[0] if high_table_rows is not None else getattr(pos, "shape", (0,))[0]
    pos = _check_positions(pos, rows, "high_slots")
    if high_table_rows is None or high_table_rows.shape[1] == 0 or pos.shape[1] == 0:
        return torch.full_like(pos, -1)
    _check_table(high_table_rows, "high_table_rows", "high_slots")
    if keep is not None and (keep.dtype != torch.bool or keep.shape != pos.shape):
        raise ValueError(f"high_slots: keep must be bool{list(pos.shape)}, got {keep.dtype} {list(keep.shape)}")
    valid = pos >= 0
    last = torch.where(valid, pos, torch.full_like(pos, -1)).amax(dim=1, keepdim=True)     # [B, 1]
    q = torch.div(pos, g.page, rounding_mode="floor")
    q_last = torch.div(last, g.page, rounding_mode="floor")
    dedupe = (q < g.num_fixed) | (q > q_last - g.num_ring)
    hp, held = _twin_page(high_table_rows, page_column(q.clamp(min=0), g))
    ok = valid & held & dedupe
    if keep is not None:
        ok = ok & keep
    return torch.where(ok, hp * g.page + torch.remainder(pos, g.page), torch.full_like(pos, -1))


# ------------------------------------------------------------------------------------------------ checks
def _check_table(table: torch.Tensor, name: str, op: str) -> None:
    if not isinstance(table, torch.Tensor) or table.ndim != 2 or table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: {name} must be an int32 / int64 [B, W] tensor, got "
                         f"{getattr(table, 'dtype', type(table))} {list(getattr(table, 'shape', []))}")


def _check_positions(pos: torch.Tensor, rows: int, op: str) -> torch.Tensor:
    if not isinstance(pos, torch.Tensor) or pos.ndim != 2 or pos.shape[0] != rows or pos.is_floating_point():
        raise ValueError(f"{op}: pos must be an integer [B={rows}, T] tensor, got "
                         f"{getattr(pos, 'dtype', type(pos))} {list(getattr(pos, 'shape', []))}")
    return pos.to(torch.int64)


def _check_layer(layer, pool: torch.Tensor, op: str) -> int:
    try:
        value = None if isinstance(layer, bool) else operator.index(layer)     # int, NumPy / 0-dim torch integers
    except TypeError:
        value = None
    if value is None or not 0 <= value < pool.shape[0]:
        raise ValueError(f"{op}: layer must be an int in [0, {pool.shape[0]}), got {layer!r}")
    return value


def _check_ids(ids: torch.Tensor, name: str, op: str, hi: int, lo: int = -1) -> None:
    bad = (ids < lo) | (ids >= hi)
    if bool(bad.any()):
        i = tuple(torch.nonzero(bad)[0].tolist())
        raise ValueError(f"{op}: {name}{list(i)}={int(ids[i])} is outside [{lo}, {hi})")


def _pool_kind(pools: TorchPools, op: str) -> str:
    """"mixed" | "low" | "plain" from which pools are present (and their dtypes)."""
    low = [pools.low_data, pools.low_scales, pools.low_gs]
    if any(p is not None for p in low) and not all(p is not None for p in low):
        raise ValueError(f"{op}: low_data, low_scales and low_gs come together (got "
                         f"{[p is not None for p in low]})")
    has_low, has_high, has_plain = low[0] is not None, pools.high_rows is not None, pools.plain_rows is not None
    if has_plain and (has_low or has_high):
        raise ValueError(f"{op}: a plain cache has plain_rows only, got low={has_low}, high={has_high}")
    if not (has_low or has_plain):
        raise ValueError(f"{op}: no pools (a cache has low_* (NVFP4) or plain_rows)")
    if has_low:
        if pools.low_data.dtype != torch.uint8 or pools.low_scales.dtype not in (torch.uint8, torch.float8_e4m3fn):
            raise ValueError(f"{op}: low_data must be uint8 and low_scales uint8 / float8_e4m3fn, got "
                             f"{pools.low_data.dtype}, {pools.low_scales.dtype}")
        if pools.low_gs.dtype != torch.float32 or pools.low_gs.shape != (pools.low_data.shape[0], 2):
            raise ValueError(f"{op}: low_gs must be float32 [L, 2], got {pools.low_gs.dtype} "
                             f"{list(pools.low_gs.shape)}")
        want = (*pools.low_data.shape[:-1], pools.low_data.shape[-1] * 2 // BLOCK)
        if pools.low_data.ndim != 6 or tuple(pools.low_scales.shape) != want:
            raise ValueError(f"{op}: low_data [L, P, 2, H, page, D/2] and low_scales [L, P, 2, H, page, D/16] "
                             f"do not match: {list(pools.low_data.shape)}, {list(pools.low_scales.shape)}")
    for name in ("high", "plain"):
        rows, scale = getattr(pools, f"{name}_rows"), getattr(pools, f"{name}_scale")
        if rows is None:
            continue
        if rows.ndim != 6 or (has_low and (rows.shape[0], *rows.shape[2:]) != (
                pools.low_data.shape[0], *pools.low_data.shape[2:-1], pools.low_data.shape[-1] * 2)):
            raise ValueError(f"{op}: {name}_rows must be [L, P, 2, H, page, D] matching the low pool, got "
                             f"{list(rows.shape)}")
        if rows.dtype not in ROW_DTYPES:
            raise ValueError(f"{op}: {name}_rows must be one of {ROW_DTYPES}, got {rows.dtype}")
        if scale is None or scale.dtype != torch.float32 or scale.shape != (rows.shape[0], 2):
            raise ValueError(f"{op}: {name}_scale must be float32 [L, 2], got "
                             f"{None if scale is None else (scale.dtype, list(scale.shape))}")
    return "plain" if has_plain else ("mixed" if has_high else "low")


def _u8(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """float8_e4m3fn pools as their bytes (a view: writes go through)."""
    return t.view(torch.uint8) if t is not None and t.dtype == torch.float8_e4m3fn else t


# ------------------------------------------------------------------------------------------------ write
def _scatter_(pool_l: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, page: int) -> None:
    """``pool_l [P, 2, H, page, X]`` at ``slots i64[T]`` (-1 skip) <- ``values [T, 2, H, X]``, in place."""
    sel = slots >= 0
    s = slots[sel]
    pool_l[torch.div(s, page, rounding_mode="floor"), :, :, torch.remainder(s, page)] = values[sel].to(pool_l.dtype)


def _check_slots(slots: torch.Tensor, name: str, t: int, num_rows: int, op: str) -> torch.Tensor:
    if not isinstance(slots, torch.Tensor) or slots.shape != (t,) or slots.is_floating_point():
        raise ValueError(f"{op}: {name} must be an integer [T={t}] tensor, got "
                         f"{getattr(slots, 'dtype', type(slots))} {list(getattr(slots, 'shape', []))}")
    slots = slots.to(torch.int64)
    _check_ids(slots, name, op, num_rows)
    used = slots[slots >= 0]
    if used.numel() != torch.unique(used).numel():
        uniq, counts = torch.unique(used, return_counts=True)
        raise ValueError(f"{op}: {name} repeats slot {int(uniq[counts > 1][0])} (one write stores a row once)")
    return slots


def write_rows_reference_(low_data, low_scales, low_gs, high_rows, high_scale, plain_rows, plain_scale,
                          layer: int, k: torch.Tensor, v: torch.Tensor, low_slot: torch.Tensor,
                          high_slot: torch.Tensor, page_size: int, block_scale: str = "max6",
                          high_fp8: bool = False) -> None:
    """Append rows of one layer in place: bits equal to `jmixedkv.write.write_rows_reference` (module docstring).

    Args:
      low_data .. plain_scale: the pools (`TorchPools` order; None for absent ones), updated in place.
      layer: int in ``[0, L)``.
      k, v: ``[T, H, D]`` bf16 / fp16 (already RoPE'd, and rotated under a rotation lever).
      low_slot: int ``[T]`` slots of the low pool (plain caches: of ``plain_rows``), -1 skip.
      high_slot: int ``[T]`` slots of the twin, -1 skip (ignored without a twin).
      page_size: rows per page; block_scale: ``"max6"`` | ``"4over6"``.
      high_fp8: the row pool (twin or plain) holds FP8 E4M3 (must agree with its dtype: uint8 / float8_e4m3fn).
    """
    op = "write_rows"
    pools = TorchPools(low_data, low_scales, low_gs, high_rows, high_scale, plain_rows, plain_scale)
    kind = _pool_kind(pools, op)
    if block_scale not in BLOCK_SCALES:
        raise ValueError(f"{op}: block_scale must be one of {BLOCK_SCALES}, got {block_scale!r}")
    rows = plain_rows if kind == "plain" else high_rows
    if rows is not None and is_fp8_pool(rows.dtype) != bool(high_fp8):
        raise ValueError(f"{op}: high_fp8={high_fp8!r} but the row pool is {rows.dtype}")
    ref = plain_rows if kind == "plain" else low_data
    layer = _check_layer(layer, ref, op)
    num_kv, h, page = ref.shape[2], ref.shape[3], ref.shape[4]
    d = ref.shape[5] * (2 if kind != "plain" else 1)
    if page != page_size or num_kv != 2:
        raise ValueError(f"{op}: pools hold {num_kv} K/V planes of {page}-row pages; expected 2 and "
                         f"page_size={page_size}")
    if (k.ndim != 3 or k.shape[1:] != (h, d) or not isinstance(v, torch.Tensor) or v.shape != k.shape
            or k.dtype not in (torch.bfloat16, torch.float16) or v.dtype != k.dtype):
        raise ValueError(f"{op}: k and v must be bf16 / fp16 [T, H={h}, D={d}] of one dtype, got "
                         f"{k.dtype} {list(k.shape)}, {getattr(v, 'dtype', None)} {list(getattr(v, 'shape', []))}")
    t = k.shape[0]
    low_slot = _check_slots(low_slot, "low_slot", t, ref.shape[1] * page, op)
    if kind == "mixed":                                  # every check before the first store: all or nothing
        high_slot = _check_slots(high_slot, "high_slot", t, high_rows.shape[1] * page, op)
    x = torch.stack([k, v], dim=-3)                                                       # [T, 2, H, D]
    if kind == "plain":
        enc = encode_rows(x, _u8(plain_rows).dtype, plain_scale[layer][:, None, None])
        _scatter_(_u8(plain_rows)[layer], low_slot, enc, page)
        return
    packed, scales = quantize(x, low_gs[layer][None, :, None], block_scale)
    _scatter_(low_data[layer], low_slot, packed, page)
    _scatter_(_u8(low_scales)[layer], low_slot, scales, page)
    if kind == "mixed":
        enc = encode_rows(x, _u8(high_rows).dtype, high_scale[layer][:, None, None])
        _scatter_(_u8(high_rows)[layer], high_slot, enc, page)


def round_trip_reference(k: torch.Tensor, v: torch.Tensor, scale: torch.Tensor, layer: int, *, low: bool,
                         block_scale: str = "max6") -> torch.Tensor:
    """Rows as the cache reads them back once stored (`interop.triton_write.round_trip_rows`, whose reference this
    is): ``k, v [B, T, H, D]`` -> ``[2, B, T, H, D]`` in their dtype; NVFP4 with ``gs = scale[layer, kv]``
    (``low``), else the fp8 store form with that scale."""
    out = []
    for kv, x in enumerate((k, v)):
        g = scale[layer, kv]
        if low:
            out.append(dequantize(*quantize(x, g, block_scale), g, x.dtype))
        else:
            out.append(decode_rows(encode_rows(x, torch.uint8, g), g, x.dtype))
    return torch.stack(out)


# ------------------------------------------------------------------------------------------------ attention
def _staged_kv(pools: TorchPools, kind: str, layer: int, page_table, high_table, n, geom: TwinGeometry,
               att_dtype: torch.dtype):
    """float32 K/V ``[B, MP, 2, H, page, D]`` a reader sees at every position of the batch's pages (rows not yet
    masked by length). Plain rows are decoded to the attention dtype ``att_dtype`` first (an fp8 plain row is
    rounded to it, as `jmixedkv.decode` stages plain groups); NVFP4 and twin rows stay exact in float32."""
    pt = page_table.to(torch.int64).clamp(min=0)
    if kind == "plain":
        rows = decode_rows(pools.plain_rows[layer][pt], pools.plain_scale[layer][:, None, None, None], att_dtype)
        return rows.to(torch.float32)
    kv = dequantize(pools.low_data[layer][pt], pools.low_scales[layer][pt], pools.low_gs[layer][:, None, None],
                    torch.float32)
    if kind != "mixed" or high_table is None or high_table.shape[1] == 0:
        return kv
    mp, page = page_table.shape[1], geom.page
    cols = page_column(torch.arange(mp, device=pt.device), geom).expand(pt.shape[0], mp)
    hp, held = _twin_page(high_table, cols)                                               # [B, MP]
    twin = decode_rows(pools.high_rows[layer][hp.clamp(min=0)], pools.high_scale[layer][:, None, None, None],
                       torch.float32)
    pos = torch.arange(mp * page, device=pt.device).reshape(1, mp, page)
    use = is_retained(pos, n[:, None, None], geom) & held[:, :, None]                      # [B, MP, page]
    return torch.where(use[:, :, None, None, :, None], twin, kv)


def paged_attention_reference(q, low_data, low_scales, low_gs, high_rows, high_scale, plain_rows, plain_scale,
                              layer: int, page_table: torch.Tensor, high_table: Optional[torch.Tensor],
                              kv_lens: torch.Tensor, geom: Union[TwinGeometry, Sequence[int]],
                              sm_scale: Optional[float] = None, sliding_window: Optional[int] = None,
                              soft_cap: Optional[float] = None, tail_k: Optional[torch.Tensor] = None,
                              tail_v: Optional[torch.Tensor] = None):
    """Paged attention of one layer (decode / verify / a later prefill chunk), float32 (module docstring).

    Args:
      q: ``[B, Tq, Hq, D]`` (attention dtype, in the stored basis); query ``t`` of row ``b`` sits at position
        ``kv_lens[b] - Tq + t`` and sees keys ``p <=`` its position (and ``p > pos - sliding_window``).
      low_data .. plain_scale: the pools (`TorchPools` order).
      layer: int in ``[0, L)``.
      page_table: int ``[B, MP]`` low (plain) page of each row's page ``j`` (-1 = none).
      high_table: int ``[B, W]`` twin pages (columns per ``geom``), or None without a twin.
      kv_lens: int ``[B]`` lengths ``n`` (0 for padding rows).
      geom: `TwinGeometry` or ``(page, first_n, last_n, num_fixed, num_ring)``.
      sm_scale: logit scale (default ``D ** -0.5``); soft_cap: logits ``c * tanh(logits / c)``.
      tail_k, tail_v: rows after the stored ones ``[B, T, H, D]``, ``T >= Tq`` (q's dtype; rows held from earlier
        steps, then the step's own), not in the pools: query ``t`` then sits at ``kv_lens[b] + T - Tq + t`` and
        also sees tail row ``j <= T - Tq + t`` at position ``kv_lens[b] + j``; the twin windows then count from
        ``kv_lens[b] + T`` (as if the tail were appended).

    Returns:
      ``(out f32[B, Tq, Hq, D], lse f32[B, Tq, Hq])`` (natural-log LSE of the scaled, soft-capped logits).
    """
    op = "paged_attention"
    pools = TorchPools(low_data, low_scales, low_gs, high_rows, high_scale, plain_rows, plain_scale)
    kind = _pool_kind(pools, op)
    g = geometry(geom)
    ref = plain_rows if kind == "plain" else low_data
    layer = _check_layer(layer, ref, op)
    h, page = ref.shape[3], ref.shape[4]
    d = ref.shape[5] * (2 if kind != "plain" else 1)
    if page != g.page:
        raise ValueError(f"{op}: geom.page={g.page} but the pools hold {page}-row pages")
    if not isinstance(q, torch.Tensor) or q.ndim != 4 or q.shape[3] != d or q.shape[2] % h or not q.is_floating_point():
        raise ValueError(f"{op}: q must be float [B, Tq, Hq, D={d}] with Hq a multiple of H={h}, got "
                         f"{getattr(q, 'dtype', None)} {list(getattr(q, 'shape', []))}")
    b, tq, hq, _ = q.shape
    _check_table(page_table, "page_table", op)
    if page_table.shape[0] != b:
        raise ValueError(f"{op}: page_table has {page_table.shape[0]} rows, q has B={b}")
    _check_ids(page_table, "page_table", op, ref.shape[1])
    mixed = kind == "mixed" and high_table is not None
    if mixed:
        _check_table(high_table, "high_table", op)
        if high_table.shape[0] != b:
            raise ValueError(f"{op}: high_table has {high_table.shape[0]} rows, q has B={b}")
        _check_ids(high_table, "high_table", op, high_rows.shape[1])
    mp = page_table.shape[1]
    if (not isinstance(kv_lens, torch.Tensor) or kv_lens.shape != (b,) or kv_lens.is_floating_point()):
        raise ValueError(f"{op}: kv_lens must be an integer [B={b}] tensor, got "
                         f"{getattr(kv_lens, 'dtype', type(kv_lens))} {list(getattr(kv_lens, 'shape', []))}")
    _check_ids(kv_lens, "kv_lens", op, mp * page + 1, lo=0)
    for name, val in (("sliding_window", sliding_window), ("soft_cap", soft_cap)):
        if val is not None and not val > 0:
            raise ValueError(f"{op}: {name} must be None or > 0, got {val!r}")
    n = kv_lens.to(torch.int64)
    tt = tail_k.shape[1] if isinstance(tail_k, torch.Tensor) and tail_k.ndim == 4 else tq     # tail rows
    retained_from = n if tail_k is None else n + tt        # a tail counts as appended for the twin windows
    kv = _staged_kv(pools, kind, layer, page_table, high_table if mixed else None, retained_from, g, q.dtype)
    s = mp * page
    kv = kv.permute(0, 2, 3, 1, 4, 5).reshape(b, 2, h, s, d)
    kpos = torch.arange(s, device=q.device)
    held = (page_table.to(torch.int64) >= 0).repeat_interleave(page, dim=1)                 # [B, S]
    valid = held & (kpos[None, :] < n[:, None])
    kv = torch.where(valid[:, None, None, :, None], kv, torch.zeros((), dtype=kv.dtype, device=kv.device))
    k, v = kv[:, 0], kv[:, 1]
    kpos = kpos[None, :].expand(b, s)
    qpos = n[:, None] - tq + torch.arange(tq, device=q.device)[None, :]                      # [B, Tq]
    if (tail_k is None) != (tail_v is None):
        raise ValueError(f"{op}: pass both tail_k and tail_v, or neither")
    if tail_k is not None:
        for name, x in (("tail_k", tail_k), ("tail_v", tail_v)):
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != (b, max(tt, tq), h, d):
                raise ValueError(f"{op}: {name} must be [B, T >= Tq={tq}, H, D] = {[b, max(tt, tq), h, d]} "
                                 f"(tail_k's shape), got {list(getattr(x, 'shape', []))}")
        k = torch.cat([k, tail_k.to(torch.float32).transpose(1, 2)], dim=2)
        v = torch.cat([v, tail_v.to(torch.float32).transpose(1, 2)], dim=2)
        tpos = n[:, None] + torch.arange(tt, device=q.device)[None, :]
        kpos = torch.cat([kpos, tpos], dim=1)
        valid = torch.cat([valid, torch.ones((b, tt), dtype=torch.bool, device=q.device)], dim=1)
        qpos = tpos[:, tt - tq:]
    return _attend(q, k, v, valid, kpos, qpos, d ** -0.5 if sm_scale is None else sm_scale, sliding_window,
                   soft_cap)


def stage_reference(low_data, low_scales, low_gs, high_rows, high_scale, plain_rows, plain_scale, layer: int,
                    page_table: torch.Tensor, high_table: Optional[torch.Tensor], kv_lens: torch.Tensor,
                    geom: Union[TwinGeometry, Sequence[int]], seen: int, tail_k: torch.Tensor,
                    tail_v: torch.Tensor) -> torch.Tensor:
    """One layer's rows as a reader gets them, the step's own rows ``tail_k`` / ``tail_v [B, T, H, D]`` appended,
    left-aligned in ``seen`` columns -> ``[2, B, H, seen, D]`` in the tail's dtype (the reference of
    `interop.triton_write.stage_rows`, which states the layout)."""
    op = "stage"
    pools = TorchPools(low_data, low_scales, low_gs, high_rows, high_scale, plain_rows, plain_scale)
    kind = _pool_kind(pools, op)
    g = geometry(geom)
    layer = _check_layer(layer, plain_rows if kind == "plain" else low_data, op)
    b, t, h, d = tail_k.shape
    mixed = kind == "mixed" and high_table is not None
    n = kv_lens.to(torch.int64)
    mp, page = page_table.shape[1], g.page
    kv = _staged_kv(pools, kind, layer, page_table, high_table if mixed else None, n + t, g, tail_k.dtype)
    kv = kv.permute(0, 2, 3, 1, 4, 5).reshape(b, 2, h, mp * page, d).to(tail_k.dtype)
    held = (page_table.to(torch.int64) >= 0).repeat_interleave(page, dim=1)                 # [B, S]
    tail = torch.stack([tail_k, tail_v], 1).transpose(2, 3)                                 # [B, 2, H, T, D]
    out = torch.zeros((b, 2, h, seen, d), dtype=tail_k.dtype, device=tail_k.device)
    for r in range(b):
        nr, pad = int(n[r]), seen - int(n[r]) - t
        if pad < 0:
            raise ValueError(f"{op}: row {r} holds {nr} + {t} rows, more than seen={seen}")
        rows = torch.where(held[r, :nr][None, None, :, None], kv[r, :, :, :nr], torch.zeros((), dtype=kv.dtype))
        out[r, :, :, pad:pad + nr] = rows
        out[r, :, :, pad + nr:] = tail[r]
    return out.transpose(0, 1).contiguous()


def _attend(q, k, v, valid, kpos, qpos, sm_scale, sliding_window, soft_cap):
    """float32 attention of ``q [B, Tq, Hq, D]`` at positions ``qpos [B, Tq]`` over ``k, v f32[B, H, S, D]`` at
    positions ``kpos [B, S]`` (``valid bool[B, S]``)."""
    b, tq, hq, d = q.shape
    h, s = k.shape[1], k.shape[2]
    qf = q.to(torch.float32).reshape(b, tq, h, hq // h, d)
    logits = torch.einsum("btkgd,bksd->btkgs", qf, k) * torch.tensor(sm_scale, dtype=torch.float32)
    if soft_cap is not None:
        cap = torch.tensor(soft_cap, dtype=torch.float32)
        logits = cap * torch.tanh(logits / cap)
    kpos = kpos[:, None, :]
    mask = (kpos <= qpos[..., None]) & valid[:, None, :]
    if sliding_window is not None:
        mask = mask & (kpos > qpos[..., None] - sliding_window)
    logits = torch.where(mask[:, :, None, None, :], logits, torch.tensor(-torch.inf))
    lse = torch.logsumexp(logits, dim=-1)                                                   # [B, Tq, H, G]
    empty = lse == -torch.inf
    p = torch.where(empty[..., None], torch.zeros(()), torch.exp(logits - lse[..., None]))
    out = torch.einsum("btkgs,bksd->btkgd", p, v)
    return out.reshape(b, tq, hq, d), lse.reshape(b, tq, hq)
