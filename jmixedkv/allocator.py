"""Device-side page allocator: a free stack plus refcounts, as an immutable pytree with pure transitions.

``free[:num_free]`` are the free page ids; allocation pops from the top (``free[num_free-1]`` first), so every
device (and every shard under `jax.shard_map`) allocates the same pages for the same requests. Refcounts allow
sharing (prefix reuse, fork); a page returns to the stack when its count reaches zero.

Every transition is all-or-nothing: a request that cannot be met returns ``ok=False`` and the allocator unchanged.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .pools import pytree

__all__ = ["Allocator", "new_allocator", "allocate_mask", "release_pages", "retain_pages"]


@pytree()
class Allocator:
    """``free i32[P]`` stack, ``num_free i32[]``, ``refcount i32[P]``."""

    free: jax.Array
    num_free: jax.Array
    refcount: jax.Array

    @property
    def num_pages(self) -> int:
        return self.free.shape[0]


def new_allocator(num_pages: int, order=None) -> Allocator:
    """All pages free. ``order`` (optional permutation of page ids) sets the stack, last entry popped first."""
    free = jnp.arange(num_pages, dtype=jnp.int32)[::-1] if order is None else jnp.asarray(order, jnp.int32)
    if free.shape != (num_pages,):
        raise ValueError(f"allocator order must have shape ({num_pages},), got {free.shape}")
    return Allocator(free, jnp.int32(num_pages), jnp.zeros((num_pages,), jnp.int32))


def allocate_mask(alloc: Allocator, need):
    """Allocate one page for every True entry of ``need`` (bool, any shape), in row-major order.

    Returns ``(alloc', ids, ok)``: ``ids`` has need's shape (-1 where not needed, and everywhere when not ok)."""
    flat = need.reshape(-1)
    count = jnp.sum(flat, dtype=jnp.int32)
    ok = count <= alloc.num_free
    rank = jnp.cumsum(flat, dtype=jnp.int32) - 1
    src = alloc.num_free - 1 - rank
    ids = jnp.where(flat & ok, alloc.free[jnp.clip(src, 0, alloc.num_pages - 1)], -1)
    new = Allocator(alloc.free, alloc.num_free - jnp.where(ok, count, 0), retain_pages(alloc, ids).refcount)
    return new, ids.reshape(need.shape), ok


def retain_pages(alloc: Allocator, ids) -> Allocator:
    """Add one reference to every page id ``>= 0`` in ``ids`` (sharing)."""
    flat = ids.reshape(-1)
    return dataclasses.replace(alloc, refcount=alloc.refcount.at[
        jnp.where(flat >= 0, flat, alloc.num_pages)].add(1, mode="drop"))


def release_pages(alloc: Allocator, ids) -> Allocator:
    """Drop one reference from every page id ``>= 0`` in ``ids``; pages reaching zero go back on the stack
    (in the order they appear in ``ids``). A page id must not appear twice in one call."""
    flat = ids.reshape(-1)
    valid = flat >= 0
    safe = jnp.where(valid, flat, alloc.num_pages)
    refcount = alloc.refcount.at[safe].add(-1, mode="drop")
    freed = valid & (refcount[jnp.clip(flat, 0, alloc.num_pages - 1)] == 0)
    rank = jnp.cumsum(freed, dtype=jnp.int32) - 1
    dst = jnp.where(freed, alloc.num_free + rank, alloc.num_pages)
    free = alloc.free.at[dst].set(flat, mode="drop")
    return Allocator(free, alloc.num_free + jnp.sum(freed, dtype=jnp.int32), refcount)
