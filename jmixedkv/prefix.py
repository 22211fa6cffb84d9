"""Prefix reuse: content keys, the host-side prefix index, admit-with-prefix and the `PrefixCache` API.

Content keys (as vLLM / TensorRT-LLM): full pages only, a hash chain
``key_j = sha256(key_{j-1} || int64 tokens of page j || salt)`` with ``key_{-1} = sha256(salt)``, so a key
names a whole prefix, not just one page. Committed pages go into an index; the index holds ONE reference on each
committed low page and, for pages ``j < F`` (the first-N fixed high pages), on the high page too, so a committed
page outlives its sequence until it is evicted (`jmixedkv.offload`).

What is shared and what is not:

* low pages of fully matched pages and the fixed high pages ``j < F`` of fully matched pages: by reference
  (refcounts, `retain_pages` / `release_pages`);
* Last-N ring pages: never shared. **Rule (recompute the window):** a prompt of ``n`` tokens matches at most
  ``floor((n - max(last_n, 1)) / page)`` full pages, so the caller re-appends (recomputes) at least the last
  ``max(last_n, 1)`` tokens; the ring is then rebuilt by that append exactly as a cache without reuse would
  build it. The sequence is readable once that re-append is done; its FIRST append call after `admit` must
  carry at least ``min(last_n, n - matched)`` tokens (the whole tail in one call is always fine), because the
  window of any shorter length would reach into the shared prefix, whose high rows a new ring does not hold
  (`PrefixCache.append` enforces this);
* the pages of a `fork` source that a legal rewind can rewrite (every page not wholly below its rewind floor
  ``max(written - max_draft_len, reused prefix)``, the partial last page included), its partially filled fixed
  high pages and its whole ring: copied into fresh pages on the device (copy-on-write at fork time: the two
  sequences then append and rewind independently; `jmixedkv.state.fork_shares`).

Pages a sequence may still write (its partial last page, its ring) are therefore always exclusively owned.
Committed pages must be final (accepted tokens only): commit after speculative verification.

K smoothing (``k_smoothing``): shared pages hold keys shifted by their owner's K means, so a sequence reusing
them must hold the same means (``admit_with_prefix(..., k_means=)``; `PrefixCache` keeps them per entry, on
the host, and never matches pages of two means into one sequence).

Transitions (`admit_with_prefix`, `copy_pages`; `fork` is `jmixedkv.state`'s) are pure ``state -> state``
functions. `PrefixCache` composes a `jmixedkv.CacheManager` (which runs append / fork / release and keeps the
host mirror) and keeps only the index, the host tier, eviction and statistics.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from . import checks, offload
from .allocator import allocate_mask, release_pages, retain_pages
from .checks import CacheCapacityError, CacheError
from .manager import CacheManager
from .state import (ERR_BAD_SLOT, ERR_HIGH_OOM, ERR_LOW_OOM, CacheState, _fresh_steps, _tables, describe_error,
                    fork_pages_needed, tables_only)

__all__ = ["page_keys", "admit_with_prefix", "copy_pages", "Entry", "PrefixCache"]


# ----------------------------------------------------------------------------------------------- content keys
def page_keys(tokens: Sequence[int], page_size: int, salt=None) -> List[bytes]:
    """Content keys of the full pages of ``tokens`` (a hash chain; ``len(tokens) // page_size`` keys)."""
    if page_size < 1:
        raise ValueError(f"page_keys: page_size must be >= 1, got {page_size}")
    toks = np.asarray(tokens, np.int64).reshape(-1)
    salt_b = b"" if salt is None else salt if isinstance(salt, bytes) else str(salt).encode()
    prev = hashlib.sha256(salt_b).digest()
    keys = []
    for j in range(toks.shape[0] // page_size):
        prev = hashlib.sha256(prev + toks[j * page_size:(j + 1) * page_size].tobytes() + salt_b).digest()
        keys.append(prev)
    return keys


# ----------------------------------------------------------------------------------------------- transitions
def copy_pages(state: CacheState, src_low, dst_low, src_high, dst_high) -> CacheState:
    """Device-side copy of whole pages (every layer of every group). i32[K] id vectors; -1 = skip that pair.

    Every id must lie in ``[-1, num_pages)`` of its pool, a destination may appear once, and a shared destination
    (refcount > 1) is never written (copy-on-write). Host ids out of range raise `ValueError`; JAX ids set
    ``ERR_BAD_PAGE`` (range / repeated destination) or ``ERR_SHARED_PAGE`` and nothing changes. Destinations must
    be pages the caller owns (fresh ones): a page id does not say which sequence holds it."""
    op = "copy_pages"
    src_low, dst_low, src_high, dst_high = (
        checks.index_array(x, name, op, -1, n, ndim=1) for x, name, n in
        ((src_low, "src_low", state.alloc.num_pages), (dst_low, "dst_low", state.alloc.num_pages),
         (src_high, "src_high", state.high_alloc.num_pages), (dst_high, "dst_high", state.high_alloc.num_pages)))
    dst_low = jnp.where(src_low >= 0, dst_low, -1)
    dst_high = jnp.where(src_high >= 0, dst_high, -1)
    err = checks.write_dst_errors(state.alloc, dst_low) | checks.write_dst_errors(state.high_alloc, dst_high)
    err = err | jnp.where(checks.page_ids_ok(src_low, state.alloc.num_pages)
                          & checks.page_ids_ok(src_high, state.high_alloc.num_pages), 0, checks.ERR_BAD_PAGE)
    ok = err == 0
    payload = offload.gather_pages(state, src_low, src_high)
    out = offload.scatter_pages(state, jnp.where(ok, dst_low, -1), jnp.where(ok, dst_high, -1), payload)
    return dataclasses.replace(out, error=state.error | err)


def _prefix_means(state: CacheState, k_means, op: str):
    """``admit_with_prefix``'s ``k_means`` as one f32[L, H, D] per group (None = zeros), or None without
    ``k_smoothing``; host shapes and structure are checked (`ValueError`)."""
    if state.k_means is None:
        if k_means is not None:
            raise ValueError(f"{op}: k_means given, but the cache has no K smoothing (k_smoothing=False)")
        return None
    want = [(g.num_layers, g.num_kv_heads, g.head_dim) for g in state.groups]
    if k_means is None:
        return tuple(jnp.zeros(w, jnp.float32) for w in want)
    k_means = tuple(k_means)
    if len(k_means) != len(want):
        raise ValueError(f"{op}: k_means must hold one f32[L, H, D] per group ({len(want)}), got {len(k_means)}")
    for g, (m, w) in enumerate(zip(k_means, want)):
        if tuple(m.shape) != w:
            raise ValueError(f"{op}: k_means[{g}] must have shape {w} (L, H, D), got {tuple(m.shape)}")
    return tuple(jnp.asarray(m, jnp.float32) for m in k_means)


def admit_with_prefix(state: CacheState, seq_slot, low_pages, high_fixed_pages, length, k_means=None) -> CacheState:
    """Admit ``seq_slot`` holding a shared prefix of ``length`` tokens.

    Args:
      seq_slot: i32 scalar, must not be active (-1 = no-op).
      low_pages: i32[max_pages] low page ids shared by reference (-1 = none); gets one extra reference each.
        Pages ``j < ceil(length / page)`` must be given, later ones -1; every given page must be allocated
        (refcount >= 1) and listed once.
      high_fixed_pages: i32[F] first-N fixed high pages to share (-1 = allocate a fresh page); a shared one must be
        allocated and cover a full page of the prefix (``(j + 1) * page <= length``).
      length: i32 scalar in ``[0, max_pages * page]``, the new ``kv_lens`` (and ``written`` and the rewind
        ``floor``: the shared prefix is never rewound into, `correct_kv_lens` / `accept` refuse it).
      k_means: with ``k_smoothing``, the slot's K means: a tuple (one per group) of f32[L, H, D], the means the
        shared pages' keys are shifted by (their owner's, `PrefixCache` keeps them), or None = zeros (nothing
        shared: the slot's first append from position 0 takes its own). Given without ``k_smoothing``:
        `ValueError`.
    The R ring pages (and unshared fixed pages) are allocated fresh. Errors: ``ERR_BAD_SLOT`` (slot active or out
    of range), ``ERR_BAD_PAGE`` (ids / length inconsistent), ``ERR_HIGH_OOM``; on error nothing changes but
    ``state.error``. Host values breaking these rules raise `ValueError`.
    """
    cfg, page = state.config, state.page_size
    nf, nr = cfg.num_fixed_pages, state.high_table.shape[1] - cfg.num_fixed_pages
    op = "admit_with_prefix"
    means = _prefix_means(state, k_means, op)
    slot, in_range, none = checks.slot_in_range(checks.check_slot_arg(seq_slot, state.max_seqs, "seq_slot", op),
                                                state.max_seqs)
    low_pages = checks.index_array(low_pages, "low_pages", op, -1, state.alloc.num_pages)
    low_pages = low_pages.reshape(state.max_pages_per_seq)
    fixed = checks.index_array(high_fixed_pages, "high_fixed_pages", op, -1, state.high_alloc.num_pages).reshape(nf)
    length = checks.index_array(length, "length", op, 0, state.max_pages_per_seq * page + 1, ndim=0)
    cols = jnp.arange(state.max_pages_per_seq, dtype=jnp.int32)
    npg = -(-length // page)
    n_low = state.alloc.num_pages
    count = jnp.zeros((n_low,), jnp.int32).at[jnp.where(low_pages >= 0, low_pages, n_low)].add(1, mode="drop")
    low_ok = (checks.page_ids_ok(low_pages, n_low) & jnp.all((cols < npg) == (low_pages >= 0))
              & jnp.all((low_pages < 0) | (state.alloc.refcount[jnp.clip(low_pages, 0, n_low - 1)] >= 1))
              & ~jnp.any(count > 1))
    fcols = jnp.arange(nf, dtype=jnp.int32)
    n_high = state.high_alloc.num_pages
    fixed_ok = (checks.page_ids_ok(fixed, n_high)
                & jnp.all((fixed < 0) | (((fcols + 1) * page <= length)
                                         & (state.high_alloc.refcount[jnp.clip(fixed, 0, n_high - 1)] >= 1))))
    pages_ok = low_ok & fixed_ok & (length >= 0) & (length <= state.max_pages_per_seq * page)
    free_slot = in_range & ~state.active[slot]
    pre_ok = free_slot & pages_ok
    shared_high = jnp.concatenate([fixed, jnp.full((nr,), -1, jnp.int32)])
    need = (shared_high < 0) & pre_ok
    high_alloc, ids, ok = allocate_mask(state.high_alloc, need)
    ok = ok & pre_ok
    alloc = retain_pages(state.alloc, jnp.where(ok, low_pages, -1))
    high_alloc = retain_pages(high_alloc, jnp.where(ok, shared_high, -1))
    err = jnp.where(none, 0, jnp.where(free_slot, jnp.where(pages_ok, jnp.where(ok, 0, ERR_HIGH_OOM),
                                                            checks.ERR_BAD_PAGE), ERR_BAD_SLOT))
    steps = _fresh_steps(state, slot, length)
    if means is not None:
        steps["k_means"] = tuple(m.at[:, slot].set(x) for m, x in zip(state.k_means, means))
    out = _tables(state, ok, alloc=alloc, high_alloc=high_alloc,
                  page_table=state.page_table.at[slot].set(low_pages),
                  high_table=state.high_table.at[slot].set(jnp.where(need, ids, shared_high)),
                  kv_lens=state.kv_lens.at[slot].set(length), active=state.active.at[slot].set(True), **steps)
    return dataclasses.replace(out, error=state.error | err)


def _alloc_pages(state: CacheState, need_low, need_high):
    """Allocate pages for True entries of bool[K] masks (refcount 1: the index's reference)."""
    alloc, low_ids, ok_low = allocate_mask(state.alloc, need_low)
    high_alloc, high_ids, ok_high = allocate_mask(state.high_alloc, need_high)
    ok = ok_low & ok_high
    out = _tables(state, ok, alloc=alloc, high_alloc=high_alloc)
    err = jnp.where(ok_low, 0, ERR_LOW_OOM) | jnp.where(ok_high, 0, ERR_HIGH_OOM)
    return (dataclasses.replace(out, error=state.error | err),
            jnp.where(ok, low_ids, -1), jnp.where(ok, high_ids, -1))


def _refs(update):
    """``(state, low_ids, high_ids) -> state`` applying ``update`` (`retain_pages` / `release_pages`) to both
    allocators."""
    return lambda state, low_ids, high_ids: dataclasses.replace(
        state, alloc=update(state.alloc, low_ids), high_alloc=update(state.high_alloc, high_ids))


# the index's own transitions, donated as `CacheManager`'s (append / fork / release run there)
_admit = tables_only(admit_with_prefix)             # tables only: the pools are never copied (`tables_only`)
_alloc = tables_only(_alloc_pages)
_retain = tables_only(_refs(retain_pages))
_release_ids_jit = tables_only(_refs(release_pages))
_restore_jit = jax.jit(offload.scatter_pages, donate_argnums=0)
_gather = jax.jit(offload.gather_pages)


# ----------------------------------------------------------------------------------------------- host index
@dataclasses.dataclass(eq=False)
class Entry:
    """One committed page of the index: content ``key``, its ``parent`` key, page index ``j`` in the prefix,
    device ``low`` / ``high`` page ids (-1 when on host; ``high`` is -1 for ``j >= F``), retention
    ``priority`` (0-100), ``last_used`` tick, whether it lives in the host tier, and with ``k_smoothing`` the id
    of the K means its keys are shifted by (`PrefixCache`'s host table; None without the lever)."""

    key: bytes
    parent: Optional[bytes]
    j: int
    low: int
    high: int
    priority: int
    last_used: int
    on_host: bool = False
    mean_id: Optional[int] = None


class PrefixCache:
    """Prefix matching, commits, offload and eviction over a `CacheManager` (``.manager``), which runs append /
    fork / release and raises `CacheError` / `CacheCapacityError`.

    Args:
      state: an initialised `CacheState` (`init_state`); `PrefixCache` owns it from now on (``.state``).
      salt: optional cache salt mixed into every key (per-tenant isolation / LoRA id, as vLLM's ``cache_salt``).
      host_capacity_pages: host tier size in pages (None = unbounded, 0 = evicted pages are dropped).
      backend: append backend (``"auto"``, ``"reference"``, ``"pallas"``).
    Pools running short are refilled by evicting least-valuable leaf pages of the index (lowest priority, then
    least recently used; only pages no live sequence holds) to the host tier; a later match brings them back.

    K smoothing (``k_smoothing``): a page's keys are stored shifted by its owner's K means (`CacheState.k_means`),
    so every entry carries the id of those means and a host table maps ids to them (NumPy f32[L, H, D] per
    group). `commit` files a slot's pages under the id it adopted at `admit`, or, for a slot that reused nothing,
    under a new id whose means are read from the device once (a slot's committed pages are final, so its means
    are frozen). A match stops at the first entry whose id differs from the first entry's (pages shifted by two
    means are never mixed in one sequence); `admit` writes the matched id's means as the slot's
    (`admit_with_prefix`), so its later keys are shifted like the shared ones. Host-tier pages keep their id;
    an id goes when no entry and no live slot uses it.
    """

    def __init__(self, state: CacheState, salt=None, host_capacity_pages: Optional[int] = None,
                 backend: str = "auto"):
        self.manager = CacheManager.wrap(state, backend)
        self.salt = salt
        self.host = offload.HostTier(host_capacity_pages)
        self.index: Dict[bytes, Entry] = {}
        self.children: Dict[bytes, set] = {}
        self._tick = 0
        self._pending: Dict[int, int] = {}    # slot -> length its first append after a reuse admit must reach
        self._tokens: Dict[int, np.ndarray] = {}   # slot -> the prompt token ids it was admitted with
        self.means: Dict[int, tuple] = {}           # k_smoothing: mean id -> NumPy f32[L, H, D] per group
        self._mean_refs: Dict[int, int] = {}        # mean id -> entries and live slots using it
        self._slot_mean: Dict[int, int] = {}        # slot -> the mean id its keys are shifted by (once known)
        self._next_mean = 0
        self._stats = dict(query_tokens=0, hit_tokens=0, pages_saved=0, evicted_pages=0, restored_pages=0,
                           dropped_pages=0, committed_pages=0)

    # ------------------------------------------------------------------ small helpers
    @property
    def state(self) -> CacheState:
        return self.manager.state

    @state.setter
    def state(self, new: CacheState) -> None:       # the index's own transitions: the manager re-reads its mirror
        self.manager.replace_state(new)

    @property
    def config(self):
        return self.state.config

    @property
    def page(self) -> int:
        return self.state.page_size

    def _touch(self) -> int:
        self._tick += 1
        return self._tick

    def _check(self, what: str) -> None:
        err = int(self.state.error)
        if err:
            self.state = dataclasses.replace(self.state, error=jnp.int32(0))
            raise CacheError(f"PrefixCache.{what}: device transition failed: {describe_error(err)}")

    def _slot(self, slot: int, active: Optional[bool], what: str) -> int:
        if not 0 <= int(slot) < self.state.max_seqs:
            raise ValueError(f"PrefixCache.{what}: slot {slot} out of range [0, {self.state.max_seqs})")
        if active is not None and bool(np.asarray(self.state.active)[int(slot)]) != active:
            raise ValueError(f"PrefixCache.{what}: slot {slot} is {'not ' if active else ''}active")
        return int(slot)

    # ------------------------------------------------------------------ K means (k_smoothing)
    def _hold_mean(self, mid: Optional[int]) -> None:
        if mid is not None:
            self._mean_refs[mid] += 1

    def _drop_mean(self, mid: Optional[int]) -> None:
        if mid is not None:
            self._mean_refs[mid] -= 1
            if not self._mean_refs[mid]:
                del self._mean_refs[mid], self.means[mid]

    def _set_mean(self, e: Entry, mid: Optional[int]) -> None:
        self._hold_mean(mid)
        self._drop_mean(e.mean_id)
        e.mean_id = mid

    def _slot_mean_id(self, slot: int) -> Optional[int]:
        """The mean id of ``slot``'s keys: the one it adopted (or got at an earlier commit), else a new id whose
        means are read from the device now. None without ``k_smoothing``."""
        if self.state.k_means is None:
            return None
        mid = self._slot_mean.get(slot)
        if mid is None:
            mid, self._next_mean = self._next_mean, self._next_mean + 1
            self.means[mid] = tuple(np.asarray(m[:, slot], np.float32) for m in self.state.k_means)
            self._mean_refs[mid] = 1
            self._slot_mean[slot] = mid
        return mid

    def _keys(self, tokens) -> List[bytes]:
        return page_keys(tokens, self.page, self.salt)

    def free_pages(self) -> Tuple[int, int]:
        """(free low pages, free high pages)."""
        return int(self.state.alloc.num_free), int(self.state.high_alloc.num_free)

    def _ids(self, values: Sequence[int], k: int):
        out = np.full((k,), -1, np.int32)
        out[:len(values)] = values
        return jnp.asarray(out)

    # ------------------------------------------------------------------ matching
    def max_match_pages(self, num_tokens: int) -> int:
        """Pages a prompt of ``num_tokens`` may reuse: leaves at least ``max(last_n, 1)`` tokens to recompute."""
        usable = max(0, num_tokens - max(self.config.last_n, 1))
        return min(usable // self.page, self.state.max_pages_per_seq)

    def _match_entries(self, tokens) -> List[Entry]:
        out = []
        for key in self._keys(tokens)[:self.max_match_pages(len(tokens))]:
            entry = self.index.get(key)
            if entry is None or (out and entry.mean_id != out[0].mean_id):   # never two K means in one sequence
                break
            out.append(entry)
        return out

    def match_prefix(self, tokens) -> Tuple[int, List[int]]:
        """``(num_matched_tokens, low page ids)`` of the longest reusable committed prefix (no side effects).

        Page ids are -1 for pages currently in the host tier (`admit` / `prefetch` brings them back)."""
        entries = self._match_entries(tokens)
        return len(entries) * self.page, [(-1 if e.on_host else e.low) for e in entries]

    # ------------------------------------------------------------------ eviction / restore
    def _evictable(self, protect):
        ref_low = np.asarray(self.state.alloc.refcount)
        ref_high = np.asarray(self.state.high_alloc.refcount)

        def ok(e: Entry) -> bool:
            return (not e.on_host and e.key not in protect and ref_low[e.low] == 1
                    and (e.high < 0 or ref_high[e.high] == 1))
        return ok

    def _is_leaf(self, e: Entry, picked) -> bool:
        return all(self.index[c].on_host or id(self.index[c]) in picked for c in self.children.get(e.key, ()))

    def evict(self, num_pages: int, protect=()) -> int:
        """Move up to ``num_pages`` evictable leaf pages of the index to the host tier; returns how many moved.

        Never touches a page a live sequence references (refcount held only by the index)."""
        if num_pages < 0:
            raise ValueError(f"PrefixCache.evict: num_pages must be >= 0, got {num_pages}")
        victims = offload.select_victims(self.index.values(), num_pages, self._is_leaf,
                                         self._evictable(set(protect)), lambda e: (e.priority, e.last_used),
                                         parent=lambda e: None if e.parent is None else self.index.get(e.parent))
        if not victims:
            return 0
        k = offload.page_bucket(len(victims))
        low_ids = self._ids([e.low for e in victims], k)
        high_ids = self._ids([e.high for e in victims], k)
        pages = offload.payload_to_host(_gather(self.state, low_ids, high_ids), len(victims),
                                        [e.high >= 0 for e in victims])
        self.state = _release_ids_jit(self.state, low_ids, high_ids)
        for e, page in zip(victims, pages):
            self.host.put(e.key, page)
            e.low, e.high, e.on_host = -1, -1, True
        self._stats["evicted_pages"] += len(victims)
        self._trim_host(protect)
        return len(victims)

    def _trim_host(self, protect=()) -> None:
        """Drop the least valuable host leaves (and their index entries) until the host tier fits its capacity;
        ``protect``ed keys (a prefix being restored) stay, over capacity until they leave the host."""
        cap = self.host.capacity_pages
        while cap is not None and len(self.host) > cap:
            leaves = [self.index[k] for k in self.host.keys() if not self.children.get(k) and k not in protect]
            if not leaves:
                return
            victim = min(leaves, key=lambda e: (e.priority, e.last_used))
            self._forget(victim)
            self._stats["dropped_pages"] += 1

    def _forget(self, e: Entry) -> None:
        self._set_mean(e, None)
        self.host.pop(e.key)
        del self.index[e.key]
        self.children.pop(e.key, None)
        if e.parent is not None and e.parent in self.children:
            self.children[e.parent].discard(e.key)

    def ensure_free(self, num_low: int, num_high: int = 0, protect=()) -> None:
        """Evict until ``num_low`` low and ``num_high`` high pages are free, or raise `CacheCapacityError`."""
        while True:
            free_low, free_high = self.free_pages()
            deficit = max(num_low - free_low, num_high - free_high)
            if deficit <= 0:
                return
            if self.evict(deficit, protect) == 0:
                raise CacheCapacityError(f"need {num_low} low / {num_high} high free pages, have {free_low} / "
                                    f"{free_high} and nothing left to evict")

    def _restore_entries(self, matched: List[Entry], extra_high: int = 0) -> int:
        """Bring the host-tier entries of a matched prefix back onto the device (fresh pages; the index holds their
        reference), first evicting other pages until they and ``extra_high`` more high pages fit. Returns how many
        came back."""
        entries = [e for e in matched if e.on_host]
        nf = self.config.num_fixed_pages
        try:
            self.ensure_free(len(entries), sum(e.j < nf for e in entries) + extra_high,
                             protect={e.key for e in matched})
        except CacheCapacityError:
            self._trim_host()          # the matched host pages stay there: the host back within its capacity
            raise
        if not entries:
            return 0
        k = offload.page_bucket(len(entries))
        need_low = np.arange(k) < len(entries)
        need_high = np.zeros((k,), bool)
        need_high[:len(entries)] = [e.j < nf for e in entries]
        self.state, low_ids, high_ids = _alloc(self.state, jnp.asarray(need_low), jnp.asarray(need_high))
        self._check("restore")
        pages = [self.host.get(e.key) for e in entries]
        self.state = _restore_jit(self.state, low_ids, high_ids, offload.host_to_payload(self.state, pages, k))
        low_ids, high_ids = np.asarray(low_ids), np.asarray(high_ids)
        for i, e in enumerate(entries):
            self.host.pop(e.key)
            e.low, e.high, e.on_host = int(low_ids[i]), int(high_ids[i]), False
        self._stats["restored_pages"] += len(entries)
        self._trim_host()              # (over capacity only while protected pages were on the host)
        return len(entries)

    def prefetch(self, tokens) -> int:
        """Restore the host-tier pages of ``tokens``' matched prefix ahead of `admit`; returns pages restored."""
        return self._restore_entries(self._match_entries(tokens))

    # ------------------------------------------------------------------ sequence lifecycle
    def admit(self, slot: int, tokens, count_stats: bool = True) -> int:
        """Admit ``slot`` for prompt ``tokens`` reusing the longest committed prefix; returns ``m`` matched tokens.

        The caller must then `append` K/V for ``tokens[m:]`` (first call >= ``min(last_n, len - m)`` tokens,
        see the module docstring) before reading the sequence."""
        slot = self._slot(slot, False, "admit")
        nf = self.config.num_fixed_pages
        if len(tokens) > self.state.max_pages_per_seq * self.page:
            raise ValueError(f"PrefixCache.admit: {len(tokens)} tokens exceed max_pages_per_seq * page_size = "
                             f"{self.state.max_pages_per_seq * self.page}")
        entries = self._match_entries(tokens)
        self._restore_entries(entries, extra_high=self.state.high_table.shape[1] - sum(e.j < nf for e in entries))
        low = np.full((self.state.max_pages_per_seq,), -1, np.int32)
        fixed = np.full((nf,), -1, np.int32)
        for e in entries:
            low[e.j] = e.low
            if e.j < nf:
                fixed[e.j] = e.high
            e.last_used = self._touch()
        m = len(entries) * self.page
        self._tokens[slot] = np.asarray(tokens, np.int64).reshape(-1).copy()
        mid = entries[0].mean_id if entries else None
        means = _prefix_means(self.state, self.means.get(mid), "PrefixCache.admit")   # zeros, not None: one program
        self.state = _admit(self.state, jnp.int32(slot), jnp.asarray(low), jnp.asarray(fixed), jnp.int32(m), means)
        self._check("admit")
        if mid is not None:
            self._hold_mean(mid)
            self._slot_mean[slot] = mid
        if m:
            self._pending[slot] = min(len(tokens), m + self.config.last_n)
        if count_stats:
            self._stats["query_tokens"] += len(tokens)
            self._stats["hit_tokens"] += m
            self._stats["pages_saved"] += len(entries)
        return m

    def append(self, layer, k, v, seq_slots, positions, group: int = 0, rope=None) -> None:
        """`CacheManager.append` (which refuses writes into shared pages), after the reuse rule below and, when
        the low pool runs short, eviction of index pages."""
        seq, pos = self.manager.host_tokens(seq_slots, positions, "PrefixCache.append")
        for slot, need in self._pending.items():
            mine = (seq == slot) & (pos >= 0)
            if mine.any() and int(pos[mine].max()) + 1 < need:
                raise ValueError(f"PrefixCache.append: slot {slot} reused a prefix; its first append must reach "
                                 f"length {need} (the Last-N window is recomputed, not shared), got "
                                 f"{int(pos[mine].max()) + 1}")
        self.manager.check_append(seq, pos, capacity=False)   # refusals (shared page, position) before eviction
        self.ensure_free(sum(self.manager.pages_needed(seq, pos).values()))
        self.manager.append(layer, k, v, seq, pos, group=group, rope=rope)
        for slot in [s_ for s_ in self._pending if (seq == s_).any()]:
            del self._pending[slot]

    def commit(self, slot: int, tokens, priority: int = offload.DEFAULT_PRIORITY) -> int:
        """Commit the full pages of ``slot`` (``tokens`` = its token ids, at least its committed part) to the
        index; returns the number of newly indexed pages. A key already on the device keeps its first page; a
        key in the host tier is replaced by this sequence's device page."""
        slot = self._slot(slot, True, "commit")
        if not offload.MIN_PRIORITY <= priority <= offload.MAX_PRIORITY:
            raise ValueError(f"PrefixCache.commit: priority must be in [0, 100], got {priority}")
        self._check_tokens(slot, tokens)
        n = min(int(np.asarray(self.state.kv_lens)[slot]), len(tokens))
        row = np.asarray(self.state.page_table)[slot]
        hrow = np.asarray(self.state.high_table)[slot]
        nf = self.config.num_fixed_pages
        new_low, new_high, parent = [], [], None
        keys = self._keys(list(tokens)[:n])
        mid = self._slot_mean_id(slot) if keys else None
        for j, key in enumerate(keys):
            e = self.index.get(key)
            high = int(hrow[j]) if j < nf else -1
            if e is None:
                e = self.index[key] = Entry(key, parent, j, -1, -1, priority, 0)
                if parent is not None:
                    self.children.setdefault(parent, set()).add(key)
            elif e.on_host:
                self.host.pop(key)
            if e.low < 0:                  # new, or back from the host tier: this sequence's device pages
                e.low, e.high, e.on_host = int(row[j]), high, False
                self._set_mean(e, mid)     # and its keys' K means
                new_low.append(e.low)
                new_high.append(high)
            e.priority = max(e.priority, priority)
            e.last_used = self._touch()
            parent = key
        if mid is not None and self._mean_refs[mid] == 1:    # no entry took it: read again at the next commit
            self._drop_mean(self._slot_mean.pop(slot))     # (the slot's pages are all its own: it may rewind to 0)
        if new_low:
            k = offload.page_bucket(len(new_low))
            self.state = _retain(self.state, self._ids(new_low, k), self._ids(new_high, k))
        self._stats["committed_pages"] += len(new_low)
        return len(new_low)

    def _check_tokens(self, slot: int, tokens) -> None:
        """`ValueError` naming the first position where ``tokens`` differ from the prompt ``slot`` was admitted
        with (a commit under the wrong ids would index pages under another prompt's keys)."""
        have = self._tokens.get(slot)
        if have is None:
            return
        toks = np.asarray(tokens, np.int64).reshape(-1)
        n = min(have.size, toks.size)
        diff = np.flatnonzero(toks[:n] != have[:n])
        if diff.size:
            i = int(diff[0])
            raise ValueError(f"PrefixCache.commit: slot {slot}: tokens[{i}]={int(toks[i])} differs from the token "
                             f"{int(have[i])} the slot was admitted with (its cached rows are of those tokens)")

    def fork(self, src: int, dst: int) -> None:
        """Fork live ``src`` into empty ``dst`` (shares full pages, copies the partial last page and the ring)."""
        src = self._slot(src, True, "fork")
        dst = self._slot(dst, False, "fork")
        # new pages: every page a legal rewind can rewrite, and every twin page but the shared fixed ones
        self.ensure_free(*fork_pages_needed(self.state, src))
        self.manager.fork(src, dst)
        if src in self._tokens:
            self._tokens[dst] = self._tokens[src]
        if src in self._slot_mean:         # `fork` copied the means
            self._slot_mean[dst] = self._slot_mean[src]
            self._hold_mean(self._slot_mean[dst])

    def release(self, slot: int) -> None:
        """Release ``slot``: its references go; committed pages stay held by the index."""
        slot = self._slot(slot, True, "release")
        self._pending.pop(slot, None)
        self._tokens.pop(slot, None)
        self.manager.release(slot)
        self._drop_mean(self._slot_mean.pop(slot, None))

    def compile(self, max_pages: int) -> None:
        """Compile the commit / evict page programs for every page-count bucket up to ``max_pages`` (run on
        all -1 ids: nothing changes), so that no commit or eviction compiles inside an engine's timed loop."""
        k = 1
        while True:
            ids = jnp.full((k,), -1, jnp.int32)
            jax.block_until_ready(_gather(self.state, ids, ids))
            self.state = _retain(_release_ids_jit(self.state, ids, ids), ids, ids)
            if k >= max_pages:
                return
            k *= 2

    # ------------------------------------------------------------------ statistics
    def stats(self) -> dict:
        """Capacity and hit-rate statistics."""
        free_low, free_high = self.free_pages()
        s = dict(self._stats)
        s.update(hit_rate=s["hit_tokens"] / s["query_tokens"] if s["query_tokens"] else 0.0,
                 device_entries=sum(not e.on_host for e in self.index.values()), host_entries=len(self.host),
                 host_bytes=self.host.nbytes, free_low_pages=free_low, free_high_pages=free_high,
                 num_low_pages=self.state.alloc.num_pages, num_high_pages=self.state.high_alloc.num_pages)
        return s
