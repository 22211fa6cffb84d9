"""Exports of our page tables and pools into the layouts other engines' kernels take (FlashInfer, vLLM).

Page tables (the functions here compute on the host and return NumPy int32; the torch-facing exporters of
`interop.torch_cache` -- ``TorchKVCache.flashinfer_page_table`` / ``block_table``, ``TorchStaged.flashinfer_csr``
/ ``block_table`` -- return int32 **torch tensors on the pages' device**, ready for FlashInfer's ``plan()`` and
vLLM's metadata, NumPy only with ``as_numpy=True``; `csr_to_torch` converts. ``seq_slots i32[B]``, -1 = padding):

* **FlashInfer CSR** (`flashinfer_csr`): ``kv_indptr i32[B+1]``, ``kv_indices i32[kv_indptr[-1]]`` (physical page
  ids in sequence order), ``kv_last_page_len i32[B]`` with ``1 <= last <= page_size`` for a non-empty sequence
  (``((n - 1) % page) + 1``). **Empty sequences** (length 0, and padding rows) own no page and get
  ``last_page_len = 0``, so FlashInfer's ``get_seq_lens`` (``clamp(pages - 1, 0) * page + last``) gives 0.
  `flashinfer_csr_padded` is the jittable fixed-shape twin (``kv_indices`` padded to ``B * max_pages`` with -1,
  CUDA-graph friendly); `seq_lens_from_csr` inverts the form.
* **vLLM block tables** (`block_table`): ``i32[B, max_pages]`` with ``pad`` past each sequence's last used page
  (`BLOCK_TABLE_PAD` = 0 by default, in every block-table export: vLLM pads with 0 and reserves block 0 as its
  null block, MaxText's ``page_map`` is zero-filled, and JAX's Pallas paged kernels load whole blocks of page ids,
  so a padded id must be a valid page; ``TorchKVCache(reserve_null_page=True)`` keeps page 0 out of the
  allocator; ``pad=-1`` on request), plus ``seq_lens i32[B]``; **slot mappings** (`slot_mapping`): ``slot =
  page_id * page + pos % page`` per token, -1 (vLLM's ``PAD_SLOT_ID``) for padding or unheld rows; int64 by default
  as in vLLM; `positions_from_slots` inverts it into the ``(seq_slots, positions)`` that ``append`` takes.

Pool page views (`page_view`): our row pools are ``rows[L, P, kv, H, page, D]`` (HND inside a page), so per
layer the pool *is* FlashInfer's 5-D HND paged cache ``[P, 2, H, page, D]`` (K/V axis at dim 1), and per layer
and K/V a zero-copy strided view gives ``HND [P, H, page, D]`` or ``NHD [P, page, H, D]`` (a permuted,
non-contiguous view; FlashInfer accepts strided pages, call ``.contiguous()`` for kernels that do not).

What a table over which pool means. A CSR / block table over the **NVFP4 pool** (``TorchKVCache.
flashinfer_page_table`` / ``block_table``, with `nvfp4_pages`) gives *history only*: plain NVFP4, the
high-precision twin (first-N / last-N rows) is dropped. The **mixed** semantics (retained rows bit-exact from the
twin, the rest dequantized NVFP4) is the staged cache: `interop.torch_cache.TorchStaged` (from
``jmixedkv.staging.stage``) is a paged HND cache ``[N, kv, H, page, D]`` with a compact page table; its
``flashinfer_csr()`` / ``block_table()`` index those staged pages.

NVFP4 pages (`nvfp4_pages`): FlashInfer's paged NVFP4 KV layout (``nvfp4_quantize_append_paged_kv_cache``,
``nvfp4_kv_dequantize_paged``): per layer, K and V separately, data ``uint8 [P, H, page, D/2]`` (HND) or
``[P, page, H, D/2]`` (NHD), element ``2i`` in the low nibble; block scales ``float8_e4m3fn`` in the same layout
with ``D/16`` (linear, one per 16 elements along head_dim; ``scales_as_uint8=True`` gives the bytes); decode
global scales ``k_scale = gs[layer, 0]``, ``v_scale = gs[layer, 1]`` (float32, ``x = e2m1 * scale * gs``).
Not applied: trtllm-gen's 4-token-interleaved V-scale layout (only the linear layout is exported). Pass the cache's
``config=`` and ``NVFP4Pages.kv_transform`` says whether K/V are rotated (``rotation="hadamard"``: rotate q before
attention, multiply the output by the Hadamard matrix after it) or K-shifted (`interop.dlpack.kv_transform`).

Levers and what each export holds. Pool exports (`nvfp4_pages`, `page_view` of a twin / plain row pool, and the
CSR / block tables over them) are the rows **as stored**: an exporter cannot un-rotate NVFP4 bytes in place, so a
consumer of a rotated cache must follow ``kv_transform`` (`jmixedkv.levers.hadamard`). **Staged** pages
(``jmixedkv.staging.stage``, `interop.torch_cache.TorchStaged` and their CSR / block tables) follow stage's
default: model space, the rotation already undone (float32, one rounding to the attention dtype), so FlashInfer /
vLLM attend over them with the model's own q; ``stage(..., as_stored=True)`` keeps the stored basis and names it
in ``StagedCache.rotation``. K smoothing: pool exports hold the shifted keys ``k - mean`` (the
means: ``CacheState.k_means``, `interop.dlpack.kv_transform`); a consumer's output is unchanged, its LSE is lower by
``sm_scale * q . mean``. Staged pages are raw keys by default (``as_stored=True``: shifted, ``StagedCache.k_mean``).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import torch

__all__ = ["FlashInferCSR", "flashinfer_csr", "flashinfer_csr_padded", "seq_lens_from_csr", "block_table",
           "slot_mapping", "positions_from_slots", "BLOCK_TABLE_PAD", "page_view", "nvfp4_pages", "NVFP4Pages", "csr_to_torch", "to_device"]

LAYOUTS = ("HND", "NHD")
#: padding of every block-table export (vLLM's null block; module docstring)
BLOCK_TABLE_PAD = 0


class FlashInferCSR(NamedTuple):
    """FlashInfer's paged-KV CSR (NumPy or torch int32, see the producer)."""
    kv_indptr: np.ndarray          # i32[B+1]
    kv_indices: np.ndarray         # i32[kv_indptr[-1]]
    kv_last_page_len: np.ndarray   # i32[B]


def to_device(a: np.ndarray, device) -> torch.Tensor:
    """Host int32 NumPy array -> int32 torch tensor on ``device`` (one host-to-device copy)."""
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))
    return t.to(device) if torch.device(device).type != "cpu" else t


def csr_to_torch(csr: FlashInferCSR, device) -> FlashInferCSR:
    """`FlashInferCSR` of NumPy arrays -> the same of int32 torch tensors on ``device`` (what ``plan()`` takes)."""
    return FlashInferCSR(*(to_device(a, device) for a in csr))


def _host(x, what: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what}: expected integers, got {arr.dtype}")
    return arr.astype(np.int64)


def _check_page_size(page_size: int) -> None:
    if not isinstance(page_size, (int, np.integer)) or page_size < 1:
        raise ValueError(f"page_size must be a positive integer, got {page_size!r}")


def _rows(page_table, kv_lens, seq_slots, page_size, what):
    """Validated ``(table i64[B, M], lens i64[B])`` for the batch (padding rows: no pages, length 0)."""
    _check_page_size(page_size)
    table, lens, seq = _host(page_table, "page_table"), _host(kv_lens, "kv_lens"), _host(seq_slots, "seq_slots")
    if table.ndim != 2 or lens.ndim != 1 or lens.shape[0] != table.shape[0]:
        raise ValueError(f"{what}: page_table must be [S, max_pages] and kv_lens [S]; got {table.shape}, {lens.shape}")
    if seq.ndim != 1:
        raise ValueError(f"{what}: seq_slots must be 1-D, got shape {seq.shape}")
    bad = sorted({int(s) for s in seq if s < -1 or s >= table.shape[0]})
    if bad:
        raise ValueError(f"{what}: sequence slots {bad} out of range [-1, {table.shape[0]})")
    rows = table[np.clip(seq, 0, None)]
    n = np.where(seq >= 0, lens[np.clip(seq, 0, None)], 0)
    if (n < 0).any():
        raise ValueError(f"{what}: negative lengths {n[n < 0].tolist()}")
    pages = -(-n // page_size)
    if (pages > table.shape[1]).any():
        raise ValueError(f"{what}: lengths {n.tolist()} need more than max_pages={table.shape[1]} pages of {page_size}")
    used = np.arange(table.shape[1])[None, :] < pages[:, None]
    missing = np.argwhere(used & (rows < 0))
    if missing.size:
        b, j = missing[0]
        raise ValueError(f"{what}: sequence slot {int(seq[b])} (length {int(n[b])}) has no page at column {int(j)}")
    return rows, n, pages, used


def flashinfer_csr(page_table, kv_lens, seq_slots, page_size: int) -> FlashInferCSR:
    """FlashInfer's CSR page table for ``seq_slots`` (see module docstring); numpy int32 arrays."""
    rows, n, pages, used = _rows(page_table, kv_lens, seq_slots, page_size, "flashinfer_csr")
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    indices = rows[used].astype(np.int32)          # row-major: sequence by sequence, page order
    last = np.where(n > 0, (n - 1) % page_size + 1, 0).astype(np.int32)
    return FlashInferCSR(indptr, indices, last)


def flashinfer_csr_padded(page_table, kv_lens, seq_slots, page_size: int):
    """Jittable fixed-shape CSR: ``(kv_indptr i32[B+1], kv_indices i32[B * max_pages] (-1 padded),
    kv_last_page_len i32[B])`` from JAX arrays (no validation: it runs inside jit)."""
    seq = jnp.asarray(seq_slots, jnp.int32)
    num_seqs, max_pages = page_table.shape
    s = jnp.clip(seq, 0, num_seqs - 1)
    n = jnp.where(seq >= 0, kv_lens[s], 0)
    pages = (n + page_size - 1) // page_size
    indptr = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(pages).astype(jnp.int32)])
    j = jnp.arange(max_pages, dtype=jnp.int32)
    used = j[None, :] < pages[:, None]
    dest = jnp.where(used, indptr[:-1, None] + j[None, :], seq.shape[0] * max_pages)
    indices = jnp.full((seq.shape[0] * max_pages,), -1, jnp.int32).at[dest.reshape(-1)].set(
        page_table[s].reshape(-1), mode="drop")
    last = jnp.where(n > 0, (n - 1) % page_size + 1, 0).astype(jnp.int32)
    return indptr, indices, last


def seq_lens_from_csr(kv_indptr, kv_last_page_len, page_size: int) -> np.ndarray:
    """FlashInfer's ``get_seq_lens``: ``clamp(pages - 1, 0) * page + last``."""
    indptr, last = _host(kv_indptr, "kv_indptr"), _host(kv_last_page_len, "kv_last_page_len")
    return (np.maximum(np.diff(indptr) - 1, 0) * page_size + last).astype(np.int32)


def block_table(page_table, kv_lens, seq_slots, page_size: int, *, pad: int = BLOCK_TABLE_PAD):
    """vLLM-style ``(block_table i32[B, max_pages], seq_lens i32[B])``: page ids of the used pages, ``pad`` after
    (`BLOCK_TABLE_PAD` = 0 by default, vLLM's reserved null block; -1 on request)."""
    if isinstance(pad, bool) or not isinstance(pad, (int, np.integer)) or pad < -1:
        raise ValueError(f"block_table: pad must be an integer >= -1, got {pad!r}")
    rows, n, _, used = _rows(page_table, kv_lens, seq_slots, page_size, "block_table")
    return np.where(used, rows, pad).astype(np.int32), n.astype(np.int32)


def slot_mapping(page_table, seq, positions, page_size: int, dtype=np.int64) -> np.ndarray:
    """Per-token slot ``page_id * page + pos % page`` (``seq[t]``, ``positions[t]``); -1 when ``seq < 0``, the
    position is negative or past the table, or its page is not allocated (vLLM ``PAD_SLOT_ID``)."""
    _check_page_size(page_size)
    table, seq, pos = _host(page_table, "page_table"), _host(seq, "seq"), _host(positions, "positions")
    if seq.shape != pos.shape or seq.ndim != 1:
        raise ValueError(f"slot_mapping: seq and positions must be equal-length vectors, got {seq.shape}, {pos.shape}")
    if (seq >= table.shape[0]).any():
        raise ValueError(f"slot_mapping: sequence slots {sorted(set(seq[seq >= table.shape[0]].tolist()))} out of "
                         f"range [-1, {table.shape[0]})")
    q = pos // page_size
    ok = (seq >= 0) & (pos >= 0) & (q < table.shape[1])
    page = table[np.clip(seq, 0, None), np.clip(q, 0, table.shape[1] - 1)]
    ok &= page >= 0
    return np.where(ok, page * page_size + pos % page_size, -1).astype(dtype)


def positions_from_slots(slots, page_table, page_size: int):
    """Inverse of `slot_mapping` (the write side of a vLLM-style engine): ``(seq_slots i32[T], positions i32[T])``
    for ``append`` from per-token ``slots`` (``page_id * page + offset``; negative = padding -> ``(-1, 0)``).

    Each page id must be held by exactly one sequence of ``page_table i32[S, max_pages]`` (a page shared by a fork
    or a prefix is read-only: writing it is refused, as is a slot whose page no sequence holds)."""
    _check_page_size(page_size)
    table, slots = _host(page_table, "page_table"), _host(slots, "slots")
    if table.ndim != 2 or slots.ndim != 1:
        raise ValueError(f"positions_from_slots: page_table must be [S, max_pages] and slots [T]; got "
                         f"{table.shape}, {slots.shape}")
    held = table >= 0
    owners = {}
    for s, j in zip(*np.nonzero(held)):
        owners.setdefault(int(table[s, j]), []).append((int(s), int(j)))
    seq, pos = np.full(slots.shape, -1, np.int32), np.zeros(slots.shape, np.int32)
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        who = owners.get(int(slot // page_size), [])
        if len(who) != 1:
            raise ValueError(f"positions_from_slots: slot {int(slot)} (token {t}) is in page {int(slot // page_size)}"
                             f", held by {len(who)} sequences {[s for s, _ in who]}; a written page must be held by "
                             f"exactly one")
        s, j = who[0]
        seq[t], pos[t] = s, j * page_size + slot % page_size
    return seq, pos


def page_view(rows, layer: int, kv: Optional[int] = None, layout: str = "HND"):
    """View of a row pool ``rows[L, P, kv, H, page, D]`` (torch tensor: zero-copy view; jax/numpy: transposed
    array) for one layer.

    ``kv=None`` -> ``[P, kv, H, page, D]`` (HND, FlashInfer's 5-D form) or ``[P, kv, page, H, D]`` (NHD);
    ``kv=0`` (K) / ``1`` (V) -> ``[P, H, page, D]`` (HND) or ``[P, page, H, D]`` (NHD)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if rows.ndim != 6:
        raise ValueError(f"page_view: expected a pool [L, P, kv, H, page, D], got shape {tuple(rows.shape)}")
    if not 0 <= layer < rows.shape[0]:
        raise ValueError(f"page_view: layer {layer} out of range [0, {rows.shape[0]})")
    if kv is not None and not 0 <= kv < rows.shape[2]:
        raise ValueError(f"page_view: kv {kv} out of range [0, {rows.shape[2]})")
    x = rows[layer] if kv is None else rows[layer][:, kv]
    if layout == "HND":
        return x
    perm = (0, 1, 3, 2, 4) if kv is None else (0, 2, 1, 3)
    return x.permute(*perm) if isinstance(x, torch.Tensor) else jnp.transpose(x, perm) if isinstance(
        x, jax.Array) else np.transpose(x, perm)


class NVFP4Pages(NamedTuple):
    k_data: object      # u8[P, H, page, D/2] (HND) / [P, page, H, D/2] (NHD)
    k_scales: object    # e4m3 (or u8) [..., D/16], same layout
    v_data: object
    v_scales: object
    k_scale: float      # decode global scale of K (gs[layer, 0])
    v_scale: float
    kv_transform: Optional[dict] = None   # `interop.dlpack.kv_transform`: rotated / K-shifted rows (None: not stated)


def nvfp4_pages(low, layer: int, layout: str = "HND", *, scales_as_uint8: bool = False,
                as_torch: bool = True, config=None) -> NVFP4Pages:
    """Per-layer NVFP4 pages of a `jmixedkv.pools.LowPool` in FlashInfer's paged NVFP4 KV layout (module doc).

    ``as_torch=True``: zero-copy torch views of the pool (read-only; drop them before the next donated append).
    ``config``: the cache's `KVCacheConfig`; its levers go into ``kv_transform`` (with ``rotated`` True, a consumer
    must rotate q by ``jmixedkv.levers.hadamard(D)`` before attention and the output after it: these are the
    stored bytes, unlike the model-space staged pages of ``jmixedkv.staging.stage``)."""
    from .dlpack import kv_transform, to_torch
    if low.data.shape[2] != 2:
        raise ValueError(f"nvfp4_pages: expected a K/V pool (kv=2), got kv={low.data.shape[2]}")
    data, scales = low.data, low.scales
    if as_torch:
        data, scales = to_torch(data), to_torch(scales)
        if scales_as_uint8:
            scales = scales.view(torch.uint8)
    elif scales_as_uint8:
        scales = jax.lax.bitcast_convert_type(scales, jnp.uint8)
    gs = np.asarray(low.gs, np.float32)
    views = [page_view(a, layer, kv, layout) for kv in (0, 1) for a in (data, scales)]
    return NVFP4Pages(*views, float(gs[layer, 0]), float(gs[layer, 1]), kv_transform(config))
