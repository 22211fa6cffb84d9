"""Exports of a staged cache (`jmixedkv.staging.stage`: the mixed semantics, retained rows bit-exact from the twin,
NVFP4 dequantized elsewhere) to JAX engines' paged attention, as pure jnp functions (jittable, no host sync).

* `paged_attention_inputs`: JAX's Pallas paged attention layout, taken by both of JAX's kernels,
  ``jax.experimental.pallas.ops.tpu.paged_attention.paged_attention(q, k_pages, v_pages, lengths, page_indices,
  pages_per_compute_block=...)`` (TPU; MaxText's decode path) and
  ``jax.experimental.pallas.ops.gpu.paged_attention.paged_attention(q, k_pages, v_pages, block_tables, lengths)``
  (Triton, GPU): ``k_pages`` / ``v_pages`` ``[H, N, page, D]`` in the attention dtype, ``lengths i32[B]``,
  ``page_indices i32[B, W]`` (0 past each row's pages: both kernels load whole blocks of page ids, so every id must
  be in ``[0, N)``; a padded id is loaded and masked by ``lengths``, never attended).
* `page_state`: a MaxText-style `PageState` (``maxtext.inference.page_manager.PageState``: ``page_status``,
  ``page_map``, ``num_pages_used``, ``sequence_lengths``, ``active_page``, ``has_active_page``,
  ``active_page_position``; older MaxText named the last two ``current_page`` / ``current_page_position``) of the
  same staged pages: MaxText's decode attention reads ``page_state.page_map`` and ``page_state.sequence_lengths``
  with the ``[H, N, page, D]`` pages of `paged_attention_inputs`.

Neither kernel scales the logits: pass ``q * sm_scale`` (`decode_query`; `jmixedkv.decode_attention` uses
``D ** -0.5`` by default). Both take one query token per sequence (``Tq = 1``). Rows of an empty sequence
(``lengths = 0``): the GPU kernel returns zeros; the TPU kernel skips them and leaves its output block unwritten
(undefined, NaN in interpret mode): mask them. Levers: a cache with ``rotation="hadamard"`` stores rotated rows
(rotate ``q`` by ``jmixedkv.levers.hadamard(D)`` and the output back); ``k_smoothing`` needs nothing for the output (a
per-channel K shift changes every logit of a query by the same amount; the means are ``CacheState.k_means``).

``reserve_page_zero=True`` shifts every staged page id by one and puts a zero page at 0 (MaxText's allocator never
hands out page 0; vLLM's null block), in both exports alike.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

__all__ = ["PagedAttentionInputs", "paged_attention_inputs", "PageState", "page_state", "decode_query"]


class PagedAttentionInputs(NamedTuple):
    """JAX's Pallas paged attention inputs (module docstring)."""
    k_pages: jax.Array        # [H, N (+1), page, D] attention dtype
    v_pages: jax.Array        # [H, N (+1), page, D]
    lengths: jax.Array        # i32[B]
    page_indices: jax.Array   # i32[B, W'] (W' = W rounded up to pages_per_compute_block), 0 past each row's pages


class PageState(NamedTuple):
    """MaxText's ``PageState`` fields, one page group per batch row, over the staged pages. The state is the one
    MaxText's decode step has after ``update_decode_pages`` (the step's token, position ``n - 1``, already stored)."""
    page_status: jax.Array            # i32[N (+1)]  1 = page holds rows of some batch row (page 0 too if reserved)
    page_map: jax.Array               # i32[B, W]    staged page ids, 0 past each row's pages
    num_pages_used: jax.Array         # i32[B]       ceil(n / page)
    sequence_lengths: jax.Array       # i32[B]       n
    active_page: jax.Array            # i32[B]       page holding token n - 1 (0 when n = 0)
    has_active_page: jax.Array        # bool[B]      n > 0
    active_page_position: jax.Array   # i32[B]       (n - 1) % page (0 when n = 0)


def _layer_pages(staged, layer: Optional[int]):
    pages = staged.pages if layer is None else staged.pages[layer]
    if pages.ndim != 5:
        raise ValueError(f"jax_engines: expected one layer's staged pages [N, kv, H, page, D], got shape "
                         f"{tuple(pages.shape)}; pass layer= for an all-layer staged cache")
    return pages


def _page_ids(staged, reserve_page_zero: bool):
    """``i32[B, W]`` staged ids (+1 when page 0 is reserved), 0 past each row's pages."""
    table = staged.page_table
    return jnp.where(table >= 0, table + int(reserve_page_zero), 0).astype(jnp.int32)


def paged_attention_inputs(staged, layer: Optional[int] = None, *, pages_per_compute_block: int = 1,
                           reserve_page_zero: bool = False) -> PagedAttentionInputs:
    """`PagedAttentionInputs` of one layer of a `jmixedkv.staging.StagedCache`.

    Args:
      staged: pages ``[N, kv, H, page, D]`` (or ``[L, N, ...]`` with ``layer``); kv = 1 (an MLA latent) gives the
        latent as both keys and values.
      pages_per_compute_block: the page-table width is padded (with 0) to a multiple of it (the TPU kernel requires
        ``W % pages_per_compute_block == 0``; the GPU kernel ``W % k_splits == 0``).
      reserve_page_zero: prepend a zero page and shift ids by one (module docstring).
    """
    if isinstance(pages_per_compute_block, bool) or not isinstance(pages_per_compute_block, int) \
            or pages_per_compute_block < 1:
        raise ValueError(f"paged_attention_inputs: pages_per_compute_block must be an int >= 1, got "
                         f"{pages_per_compute_block!r}")
    pages = _layer_pages(staged, layer)
    k, v = (jnp.swapaxes(pages[:, i], 0, 1) for i in (0, -1))            # [H, N, page, D]
    if reserve_page_zero:
        k, v = (jnp.pad(x, ((0, 0), (1, 0), (0, 0), (0, 0))) for x in (k, v))
    ids = _page_ids(staged, reserve_page_zero)
    ids = jnp.pad(ids, ((0, 0), (0, -ids.shape[1] % pages_per_compute_block)))
    return PagedAttentionInputs(k, v, staged.kv_lens.astype(jnp.int32), ids)


def page_state(staged, *, reserve_page_zero: bool = False) -> PageState:
    """MaxText-style `PageState` of a `jmixedkv.staging.StagedCache` (page groups = batch rows; the pages are
    `paged_attention_inputs`'s, with the same ``reserve_page_zero``)."""
    page = staged.page_size
    n = staged.kv_lens.astype(jnp.int32)
    ids = _page_ids(staged, reserve_page_zero)
    used = (n + page - 1) // page
    last = jnp.maximum(used - 1, 0)
    active = jnp.where(n > 0, jnp.take_along_axis(ids, last[:, None], axis=1)[:, 0], 0)
    num_pages = staged.pages.shape[-5] + int(reserve_page_zero)
    j = jnp.arange(ids.shape[1], dtype=jnp.int32)[None, :]
    held = jnp.where(j < used[:, None], ids, num_pages)
    status = jnp.zeros((num_pages,), jnp.int32).at[held.reshape(-1)].set(1, mode="drop")
    if reserve_page_zero:
        status = status.at[0].set(1)
    return PageState(status, ids, used, n, active.astype(jnp.int32), n > 0,
                     jnp.where(n > 0, (n - 1) % page, 0).astype(jnp.int32))


def decode_query(q, sm_scale: Optional[float] = None):
    """``q [B, 1, Hq, D]`` (`jmixedkv.decode_attention`'s form, one token) -> ``[B, Hq, D]`` scaled by ``sm_scale``
    (default ``D ** -0.5``), in q's dtype: the query JAX's paged attention kernels take."""
    if q.ndim != 4 or q.shape[1] != 1:
        raise ValueError(f"decode_query: expected q [B, 1, Hq, D] (one token per sequence), got shape "
                         f"{tuple(q.shape)}")
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    return (q[:, 0].astype(jnp.float32) * scale).astype(q.dtype)
