"""Array layouts and the retained-set mapping: the contract shared by the state, the references and the kernels.

Pools (one set per layer group; ``L`` layers, ``P`` low pages, ``Ph`` high pages, ``kv`` = 2 for K/V or 1 for an
MLA latent, ``H`` KV heads, ``page`` tokens per page, ``D`` head_dim; HND inside a page)::

    low.data    u8[L, P, kv, H, page, D/2]          packed E2M1, element 2i in the low nibble
    low.scales  float8_e4m3fn[L, P, kv, H, page, D/16]
    low.gs      f32[L, kv]                          decode global scale per layer and K/V
    high.rows   dtype[L, Ph, kv, H, page, D]        the twin (bf16 / fp16, or fp8 e4m3 with high.scale)
    high.scale  f32[L, kv]                          1.0 unless the twin is fp8
    plain.rows  dtype[L, P, kv, H, page, D]         plain (non-mixed) groups: every token, low page ids

Tables (shared by every raw-token layer group)::

    page_table  i32[S, max_pages]    low page of each sequence's page j (-1 = none)
    high_table  i32[S, F + R]        high pages: F = ceil(first_n/page) fixed, then a ring of R pages
    kv_lens     i32[S]               corrected length n of each sequence

Retained set of a sequence with length ``n``: ``p < first_n`` or ``n - last_n <= p < n``.
A position ``p`` (page ``q = p // page``, row ``p % page``) lives in the high pool at column
``q`` of `high_table` when ``q < F``, else at column ``F + q mod R`` (the ring), so a rewind of up to
``max_draft_len`` rejected tokens never loses a retained row.

Slot mappings (what write kernels take): ``slot = page_id * page + row``, ``-1`` = skip.
"""
from __future__ import annotations

import jax.numpy as jnp

__all__ = ["is_retained", "high_column", "low_slots", "high_slots", "segment_max_position"]


def is_retained(pos, n, first_n: int, last_n: int):
    """bool: position ``pos`` of a sequence of length ``n`` is in the retained set."""
    return (pos < first_n) | ((pos >= n - last_n) & (pos < n))


def high_column(pos, page_size: int, num_fixed: int, num_ring: int):
    """Column of `high_table` that holds position ``pos`` (-1 if no high page can hold it)."""
    q = pos // page_size
    if num_ring == 0:
        return jnp.where(q < num_fixed, q, -1)
    return jnp.where(q < num_fixed, q, num_fixed + q % num_ring)


def low_slots(page_table, seq, pos, page_size: int):
    """Flattened low slot ``page_id * page + row`` for tokens ``(seq[t], pos[t])``; -1 when not held.

    ``seq`` < 0 (padding), positions past the table's width and unallocated pages all give -1
    (never the last column)."""
    max_pages = page_table.shape[1]
    q = pos // page_size
    ok = (seq >= 0) & (pos >= 0) & (q < max_pages)
    page = page_table[jnp.clip(seq, 0, page_table.shape[0] - 1), jnp.clip(q, 0, max_pages - 1)]
    ok = ok & (page >= 0)
    return jnp.where(ok, page * page_size + pos % page_size, -1)


def high_slots(high_table, seq, pos, page_size: int, num_fixed: int, num_ring: int, write_mask=None):
    """Flattened high slot for tokens ``(seq[t], pos[t])``; -1 when the twin does not hold the row.

    ``write_mask`` (bool per token) additionally drops rows (e.g. ring rows overwritten later in the same
    call)."""
    width = high_table.shape[1]
    col = high_column(pos, page_size, num_fixed, num_ring)
    ok = (seq >= 0) & (pos >= 0) & (col >= 0) & (col < width)
    page = high_table[jnp.clip(seq, 0, high_table.shape[0] - 1), jnp.clip(col, 0, max(width - 1, 0))] \
        if width else jnp.full(seq.shape, -1, jnp.int32)
    ok = ok & (page >= 0)
    if write_mask is not None:
        ok = ok & write_mask
    return jnp.where(ok, page * page_size + pos % page_size, -1)


def segment_max_position(seq, pos, num_seqs: int):
    """i32[num_seqs]: largest position written per sequence in a batch of tokens (-1 if none)."""
    valid = (seq >= 0) & (pos >= 0)
    return jnp.full((num_seqs,), -1, jnp.int32).at[jnp.where(valid, seq, num_seqs)].max(
        jnp.where(valid, pos, -1), mode="drop")
