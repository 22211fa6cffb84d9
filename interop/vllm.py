"""vLLM's paged KV layout for a staged cache (`jmixedkv.staging.stage`, the mixed semantics): pure jnp, jittable.

* `kv_cache`: vLLM's per-layer cache tensor ``[2, num_blocks, block_size, H, D]`` (K/V first, NHD inside a block,
  the FlashAttention backend's layout), **contiguous**: one XLA transpose of the staged pages (a copy of the
  staged bytes; `interop.dlpack.to_torch` then hands it to torch without another copy). It is a read snapshot
  with vLLM's shape and strides; vLLM's own writes (``reshape_and_cache``) go to jmixedkv's ``append`` instead.
* `block_table`: ``(block_table i32[B, W], seq_lens i32[B])`` over those blocks, padded with
  `interop.layouts.BLOCK_TABLE_PAD` (0, vLLM's null block) like every block-table export.
* Write side: `interop.layouts.slot_mapping` gives vLLM's ``slot = block_id * block_size + offset`` per token, and
  `interop.layouts.positions_from_slots` turns a vLLM ``slot_mapping`` back into ``append``'s
  ``(seq_slots, positions)``.

Why no zero-copy vLLM view of the pools themselves: the row pools are ``[L, P, kv, H, page, D]`` (per layer
FlashInfer's HND ``[P, 2, H, page, D]``, `interop.layouts.page_view`), while vLLM's layout puts K/V before the block
axis and tokens before heads: no strides of the pool's bytes give ``[2, P, page, H, D]``, so a contiguous vLLM
tensor is always a copy; the NVFP4 pool has no attention-dtype bytes to view at all (hence staging).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from .layouts import BLOCK_TABLE_PAD

__all__ = ["kv_cache", "block_table"]


def kv_cache(staged, layer: Optional[int] = None) -> jax.Array:
    """vLLM's ``[2, N, page, H, D]`` contiguous cache of one layer of a `jmixedkv.staging.StagedCache` (pages
    ``[N, 2, H, page, D]``, or ``[L, N, ...]`` with ``layer``), in the attention dtype."""
    pages = staged.pages if layer is None else staged.pages[layer]
    if pages.ndim != 5:
        raise ValueError(f"vllm.kv_cache: expected one layer's staged pages [N, kv, H, page, D], got shape "
                         f"{tuple(pages.shape)}; pass layer= for an all-layer staged cache")
    if pages.shape[1] != 2:
        raise ValueError(f"vllm.kv_cache: a K/V group has kv = 2, got kv = {pages.shape[1]} (an MLA latent: vLLM's "
                         f"MLA cache is [num_blocks, block_size, D], use staged.pages[:, 0].swapaxes(1, 2))")
    return jnp.transpose(pages, (1, 0, 3, 2, 4))


def block_table(staged, *, pad: int = BLOCK_TABLE_PAD):
    """``(block_table i32[B, W], seq_lens i32[B])`` over `kv_cache`'s blocks: each row's staged block ids, ``pad``
    after them (`BLOCK_TABLE_PAD` = 0 by default; -1 on request)."""
    if isinstance(pad, bool) or not isinstance(pad, int) or pad < -1:
        raise ValueError(f"vllm.block_table: pad must be an integer >= -1, got {pad!r}")
    table = staged.page_table
    return jnp.where(table >= 0, table, pad).astype(jnp.int32), staged.kv_lens.astype(jnp.int32)
