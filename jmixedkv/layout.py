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
``max_draft_len`` rejected tokens never loses a retained row. `TwinGeometry` is the one definition of this rule
(docs/DESIGN.md §4), used by the state, the references and the kernels alike.

Slot mappings (what write kernels take): ``slot = page_id * page + row``, ``-1`` = skip.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

__all__ = ["TwinGeometry", "low_slots", "segment_max_position",
           "OFFSET_HOLE", "in_offset_hole", "offset_safe_count", "check_offsets"]

# --- Pallas Triton addressing -------------------------------------------------------------------------------
#: Pallas Triton computes element offsets in int32 for an array of at most 2**32 bytes and Triton adds them to the
#: base pointer as *signed* int32, so an array with more than 2**31 elements but at most 2**32 bytes (only possible
#: with 1-byte elements: NVFP4 data, E4M3 scales, an FP8 twin) is misaddressed past element 2**31 - 1: wrong
#: results or an illegal address, with no error. Arrays above 2**32 bytes get 64-bit offsets. This is "the hole"
#: of docs/DESIGN.md; `init_state` pads pools and the codec pads its operands so that no kernel ever sees one.
OFFSET_HOLE = (2 ** 31, 2 ** 32)


def in_offset_hole(num_elements: int, itemsize: int) -> bool:
    """True when an array of ``num_elements`` elements of ``itemsize`` bytes is misaddressed by Pallas Triton."""
    return num_elements > OFFSET_HOLE[0] and num_elements * itemsize <= OFFSET_HOLE[1]


def offset_safe_count(count: int, elements_per_unit: int, itemsize: int, shards: int = 1) -> int:
    """Smallest ``n >= count`` such that an array of ``n * elements_per_unit`` elements, and each of its ``shards``
    equal shards, lies outside the offset hole (``n`` counts pages of a pool, rows of a codec operand, ...).

    Padding costs at most the distance to 2**32 bytes per shard (under 2 GiB); arrays outside the hole are
    returned unchanged."""
    n = count
    for parts in (1, shards):
        if in_offset_hole(n * elements_per_unit // parts, itemsize):
            n = max(n, (OFFSET_HOLE[1] * parts) // (elements_per_unit * itemsize) + 1)
    return n


def check_offsets(op: str, **arrays) -> None:
    """Raise ``ValueError`` naming the operand if a kernel operand (shape and dtype) lies in the offset hole.

    Pools from `init_state` and the codec's padded operands never do; this guards arrays built by hand."""
    for name, a in arrays.items():
        if a is None:
            continue
        n = 1
        for d in a.shape:
            n *= int(d)
        itemsize = a.dtype.itemsize
        if in_offset_hole(n, itemsize):
            raise ValueError(
                f"{op}: operand {name!r} {tuple(a.shape)} {a.dtype} is {n * itemsize} bytes, inside "
                f"({OFFSET_HOLE[0]}, {OFFSET_HOLE[1]}] where Pallas Triton's 32-bit offsets wrap; build pools with "
                f"init_state (it pads them past {OFFSET_HOLE[1]} bytes) or pad the array yourself")


@dataclasses.dataclass(frozen=True)
class TwinGeometry:
    """Static geometry of a twin (hashable: a jit static argument, folded at trace time), in the rows of its pool
    (raw tokens, or compressed rows of a compressed group): ``page`` rows per page, the retained window
    ``first_n`` / ``last_n``, and the twin table's columns: ``num_fixed`` (F) fixed pages, then a ring of
    ``num_ring`` (R) pages (0 = no ring). Every method is plain jnp on arrays or Pallas values, so the references
    and the kernels share it."""

    page: int
    first_n: int = 0
    last_n: int = 0
    num_fixed: int = 0
    num_ring: int = 0

    @classmethod
    def for_window(cls, page: int, first_n: int, last_n: int, max_draft_len: int = 0) -> "TwinGeometry":
        """``F = ceil(first_n / page)``, ``R = ceil((last_n + max_draft_len) / page) + 1`` (0 when ``last_n == 0``)."""
        ring = 0 if last_n == 0 else -(-(last_n + max_draft_len) // page) + 1
        return cls(page, first_n, last_n, -(-first_n // page), ring)

    @property
    def width(self) -> int:
        """Columns of the twin table, ``F + R``."""
        return self.num_fixed + self.num_ring

    def is_retained(self, pos, n):
        """bool: position ``pos`` of a sequence of length ``n`` is retained (``p < first_n`` or
        ``n - last_n <= p``, and ``p < n``)."""
        return ((pos < self.first_n) | (pos >= n - self.last_n)) & (pos < n)

    def page_overlaps_window(self, q, n):
        """bool: page ``q`` of a sequence of length ``n`` holds a row of the retained window."""
        return (q * self.page < self.first_n) | ((q + 1) * self.page > n - self.last_n)

    def page_column(self, q):
        """Twin-table column of page ``q``: ``q`` when ``q < F``, else ``F + q mod R`` (-1 without a ring)."""
        xp = np if isinstance(q, (np.ndarray, np.generic, int)) else jnp     # host checks: no device dispatch
        if self.num_ring == 0:
            return xp.where(q < self.num_fixed, q, -1)
        return xp.where(q < self.num_fixed, q, self.num_fixed + q % self.num_ring)

    def high_column(self, pos):
        """Twin-table column that holds position ``pos`` (`page_column` of its page)."""
        return self.page_column(pos // self.page)

    @staticmethod
    def twin_page(table, seq, col):
        """``(page id, held)`` at ``table[seq, col]`` (an i32[S, W] array or a Pallas ref): held when the column
        exists (``0 <= col < W``) and the entry is not -1 (released / not allocated)."""
        width = table.shape[1]
        page = table[seq, jnp.clip(col, 0, width - 1)]
        return page, (col >= 0) & (col < width) & (page >= 0)

    def write_mask(self, seq, pos, num_seqs: int):
        """bool[T], the write-dedupe mask: False for a ring row that a later token of the same sequence in the
        same write (tokens ``(seq[t], pos[t])``) overwrites, so one write never stores a twin row twice."""
        last = segment_max_position(seq, pos, num_seqs)
        q, qmax = pos // self.page, last[jnp.clip(seq, 0, num_seqs - 1)] // self.page
        return (q < self.num_fixed) | (q > qmax - self.num_ring)

    def high_slots(self, high_table, seq, pos, write_mask=None):
        """Flattened twin slot ``page_id * page + row`` for tokens ``(seq[t], pos[t])``; -1 when the twin does not
        hold the row (padding, ``pos < 0``, no column, a -1 entry) or ``write_mask`` (bool per token) drops it."""
        if not high_table.shape[1]:
            return jnp.full(seq.shape, -1, jnp.int32)
        page, held = self.twin_page(high_table, jnp.clip(seq, 0, high_table.shape[0] - 1), self.high_column(pos))
        ok = (seq >= 0) & (pos >= 0) & held
        if write_mask is not None:
            ok = ok & write_mask
        return jnp.where(ok, page * self.page + pos % self.page, -1)


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


def segment_max_position(seq, pos, num_seqs: int):
    """i32[num_seqs]: largest position written per sequence in a batch of tokens (-1 if none)."""
    valid = (seq >= 0) & (pos >= 0)
    return jnp.full((num_seqs,), -1, jnp.int32).at[jnp.where(valid, seq, num_seqs)].max(
        jnp.where(valid, pos, -1), mode="drop")
