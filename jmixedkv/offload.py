"""Host tier for committed prefix pages: page payload gather / scatter, host storage, and victim selection.

Owns three things:

* `gather_pages` / `scatter_pages`: pure, jittable copies of whole pages (every layer, every group) between the
  device pools and a `payload` pytree. A *low* page id addresses the NVFP4 pool (packed ``data`` + E4M3
  ``scales``, moved as raw bytes) and, for plain groups, the plain row pool; a *high* page id addresses the
  twin pool (the "cold codec" of the seed: a raw copy of the high rows, no re-quantization). Payload arrays are
  ``[L, K, ...]`` per pool (``K`` pages, padded; ids ``-1`` are skipped on scatter and read page 0 on gather).
* `HostTier`: numpy copies of evicted pages keyed by content key, with an optional page capacity.
* `select_victims`: priority-aware LRU choice of evictable leaf entries (TensorRT-LLM's retention priorities,
  0-100: lower priorities go first, then least recently used).

The prefix index itself (keys, refcounts, match / commit) lives in `jmixedkv.prefix`.
"""
from __future__ import annotations

import heapq

import dataclasses
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .numerics import next_pow2

__all__ = ["gather_pages", "scatter_pages", "HostPage", "HostTier", "select_victims", "payload_to_host",
           "host_to_payload", "page_bucket", "MIN_PRIORITY", "MAX_PRIORITY", "DEFAULT_PRIORITY"]

MIN_PRIORITY, MAX_PRIORITY, DEFAULT_PRIORITY = 0, 100, 35   # TensorRT-LLM's KvCacheRetentionConfig range / default

# (group attribute, array attribute, which page ids index it)
_FIELDS = (("low", "data", "low"), ("low", "scales", "low"), ("plain", "rows", "low"), ("high", "rows", "high"))


def page_bucket(count: int) -> int:
    """Padded page count (power of two >= 1) so page copies compile once per bucket, not once per count."""
    return next_pow2(count)


def gather_pages(state, low_ids, high_ids):
    """Copy pages out of the pools.

    Args:
      state: `CacheState`.
      low_ids, high_ids: i32[K] page ids (-1 = padding; the payload there is page 0's and must be ignored).
        Ids outside ``[-1, num_pages)`` give a NaN-decoding payload (never another page's bytes); host ids
        outside it raise `ValueError`.
    Returns:
      tuple (one per group) of dicts ``{"low_data", "low_scales", "plain_rows", "high_rows"}`` (present pools
      only) of arrays ``[L, K, kv, H, page, X]`` in the pool's storage dtype.
    """
    from .checks import index_array, nan_like
    raw = {"low": index_array(low_ids, "low_ids", "gather_pages", -1, state.alloc.num_pages),
           "high": index_array(high_ids, "high_ids", "gather_pages", -1, state.high_alloc.num_pages)}
    limit = {"low": state.alloc.num_pages, "high": state.high_alloc.num_pages}
    out = []
    for pools in state.pools:
        group = {}
        for pool_name, arr_name, which in _FIELDS:
            pool = getattr(pools, pool_name)
            if pool is not None:
                arr = getattr(pool, arr_name)
                ids = raw[which]
                bad = (ids < -1) | (ids >= limit[which])
                got = arr[:, jnp.clip(ids, 0, limit[which] - 1)]
                bad = bad.reshape((1, -1) + (1,) * (got.ndim - 2))
                # NaN-decoding fill: NVFP4 data 0x77 (with E4M3 scales NaN, 0x7F) decodes to NaN
                poison = jnp.uint8(0x77) if arr.dtype == jnp.uint8 else nan_like(arr)
                group[f"{pool_name}_{arr_name}"] = jnp.where(bad, poison, got)
        out.append(group)
    return tuple(out)


def scatter_pages(state, low_ids, high_ids, payload):
    """Write whole pages back into the pools (the inverse of `gather_pages`); ids ``-1`` are skipped.

    Args:
      state: `CacheState`.
      low_ids, high_ids: i32[K] destination page ids: each in ``[-1, num_pages)``, listed once, not shared
        (refcount <= 1; `jmixedkv.checks.write_dst_errors`); otherwise nothing is written and ``ERR_BAD_PAGE`` /
        ``ERR_SHARED_PAGE`` is set (host ids out of range raise `ValueError`).
      payload: as returned by `gather_pages` (same K).
    Returns:
      the new `CacheState` (tables, lengths and allocators unchanged).
    """
    from .checks import index_array, write_dst_errors
    ids = {"low": index_array(low_ids, "low_ids", "scatter_pages", -1, state.alloc.num_pages),
           "high": index_array(high_ids, "high_ids", "scatter_pages", -1, state.high_alloc.num_pages)}
    err = write_dst_errors(state.alloc, ids["low"]) | write_dst_errors(state.high_alloc, ids["high"])
    ok = err == 0
    new_pools = []
    for pools, group in zip(state.pools, payload):
        changes = {}
        for pool_name, arr_name, which in _FIELDS:
            pool = changes.get(pool_name, getattr(pools, pool_name))
            if pool is None:
                continue
            arr = getattr(pool, arr_name)
            dst = jnp.where((ids[which] >= 0) & ok, ids[which], arr.shape[1])
            arr = arr.at[:, dst].set(group[f"{pool_name}_{arr_name}"].astype(arr.dtype), mode="drop")
            changes[pool_name] = dataclasses.replace(pool, **{arr_name: arr})
        new_pools.append(dataclasses.replace(pools, **changes))
    return dataclasses.replace(state, pools=tuple(new_pools), error=state.error | err)


@dataclasses.dataclass
class HostPage:
    """One page in host memory: per group a dict of numpy arrays ``[L, kv, H, page, X]`` (low-id arrays and,
    when the page is one of the first-N fixed pages, ``high_rows``)."""

    groups: tuple
    has_high: bool

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for g in self.groups for a in g.values())


def payload_to_host(payload, count: int, has_high: Sequence[bool]) -> List[HostPage]:
    """Split the first ``count`` pages of a device payload into `HostPage`s (one device->host transfer)."""
    host = jax.device_get(payload)
    pages = []
    for i in range(count):
        groups = tuple({k: np.array(v[:, i]) for k, v in g.items() if has_high[i] or not k.startswith("high")}
                       for g in host)
        pages.append(HostPage(groups, bool(has_high[i])))
    return pages


def host_to_payload(state, pages: Sequence[HostPage], bucket: int):
    """Stack host pages into a device payload of ``bucket`` pages (missing ones zero-filled)."""
    template = jax.eval_shape(lambda s: gather_pages(s, jnp.zeros((bucket,), jnp.int32),
                                                     jnp.zeros((bucket,), jnp.int32)), state)

    def stack(gi, name, spec):
        arr = np.zeros(spec.shape, spec.dtype)
        for i, page in enumerate(pages):
            if name in page.groups[gi]:
                arr[:, i] = page.groups[gi][name]
        return jnp.asarray(arr)
    return tuple({name: stack(gi, name, spec) for name, spec in g.items()} for gi, g in enumerate(template))


class HostTier:
    """Evicted pages in host memory, keyed by content key. ``capacity_pages`` (None = unbounded) is enforced by
    the owner (`PrefixCache` drops the least valuable host leaves and forgets their index entries)."""

    def __init__(self, capacity_pages: Optional[int] = None):
        if capacity_pages is not None and (isinstance(capacity_pages, bool) or capacity_pages < 0
                                           or not isinstance(capacity_pages, (int, np.integer))):
            raise ValueError(f"HostTier capacity_pages must be an integer >= 0 or None, got {capacity_pages!r}")
        self.capacity_pages = capacity_pages
        self._pages: Dict[bytes, HostPage] = {}

    def __contains__(self, key) -> bool:
        return key in self._pages

    def __len__(self) -> int:
        return len(self._pages)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self._pages.values())

    def get(self, key) -> HostPage:
        return self._pages[key]

    def put(self, key, page: HostPage) -> None:
        self._pages[key] = page

    def pop(self, key) -> HostPage:
        return self._pages.pop(key)

    def keys(self):
        return list(self._pages)


def select_victims(candidates: Iterable, num_pages: int, is_leaf: Callable, evictable: Callable,
                   rank: Callable, parent: Optional[Callable] = None) -> List:
    """Pick up to ``num_pages`` entries to evict, one at a time: among entries that are `evictable` (no live
    sequence holds them) and `is_leaf` (no device-resident child, given those already picked), the one with the
    smallest ``rank`` (``(priority, last_used)``; ties: the earlier candidate) goes first. Evicting a leaf may make
    its parent a leaf.

    ``is_leaf(entry, picked_ids)`` (``picked_ids``: the ``id`` of every entry picked so far; being a leaf only
    becomes true as entries are picked); ``parent(entry)``: the entry whose leaf status a pick can change, or None.
    With ``parent`` the choice costs ``O((N + k) log N)`` for ``N`` candidates and ``k`` picks (a heap of leaves;
    a pick re-examines only its parent); without it every pick re-examines the entries that are not yet leaves.
    Returns the chosen entries in eviction order."""
    pool = [c for c in candidates if evictable(c)]
    in_pool = {id(c) for c in pool}
    picked, picked_ids, heap, waiting = [], set(), [], []
    for i, c in enumerate(pool):
        (heap if is_leaf(c, picked_ids) else waiting).append((rank(c), i, c))
    heapq.heapify(heap)
    order = {id(c): i for i, c in enumerate(pool)}
    queued = {id(item[2]) for item in heap}
    while heap and len(picked) < num_pages:
        _, _, best = heapq.heappop(heap)
        picked.append(best)
        picked_ids.add(id(best))
        if parent is not None:
            p = parent(best)
            if p is not None and id(p) in in_pool and id(p) not in queued and is_leaf(p, picked_ids):
                queued.add(id(p))
                heapq.heappush(heap, (rank(p), order[id(p)], p))
        else:
            still = []
            for item in waiting:
                (heapq.heappush(heap, item) if is_leaf(item[2], picked_ids) else still.append(item))
            waiting = still
    return picked
