"""The host-side cache manager: capacity checks up front, jitted + donated transitions, one error hierarchy.

The pure transitions in `jmixedkv.state` never raise inside jit; they set an error bit and leave every sequence
unchanged. `CacheManager` is the layer an engine talks to: it keeps an exact host mirror of the device (pages held
per sequence, lengths, written rows, free pages), refuses requests that the device would refuse -- bad slots,
layers, positions (`ValueError`, the rule of `jmixedkv.checks`) and capacity (`CacheCapacityError`, naming the
shortfall) -- *before* touching the device, runs the transitions jitted with the state donated (pools update in
place), and re-reads the device after any transition it did not run itself (`replace_state`, `set_lengths`).
It owns every transition an engine calls: `admit`, `append`, `release`, `fork`, and the speculative `accept`,
`correct_kv_lens`, `trim` (validated by `jmixedkv.speculative`). `interop.TorchKVCache` converts torch <-> JAX and
delegates here. Errors: `CacheError` (a `ValueError`) and its `CacheCapacityError` (`jmixedkv.checks`).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import checks, speculative
from . import state as st
from .checks import CacheCapacityError, CacheError
from .config import KVCacheConfig
from .rope import RopeSpec

__all__ = ["CacheManager", "CacheError", "CacheCapacityError"]

_admit = st.tables_only(st.admit)                  # tables donated, pools never copied (see `tables_only`)
_release = st.tables_only(st.release)
_fork = jax.jit(st.fork, donate_argnums=0)


def _allocate(config: KVCacheConfig, groups, num_pages: int, max_seqs: int, max_pages_per_seq, init_kwargs):
    """`jmixedkv.init_state` committed to the first device (or placed on ``init_kwargs["mesh"]``), waited for, with
    an allocation failure raised here as `CacheCapacityError` (JAX would report an asynchronous one later, from the
    first program that reads the state). A pool array is one allocation: on a GPU it needs one contiguous free block
    of its size, which other arrays' holes can deny although enough memory is free in total."""
    def make():
        state = st.init_state(config, groups, num_pages, max_seqs, max_pages_per_seq, **init_kwargs)
        # commit the fresh arrays to one device, so the first donated call does not compile a second time
        return state if init_kwargs.get("mesh") is not None else jax.device_put(state, jax.devices()[0])
    try:
        return jax.block_until_ready(make())
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        pools = jax.tree.leaves(jax.eval_shape(make).pools)
        sizes = [x.size * x.dtype.itemsize for x in pools]
        raise CacheCapacityError(
            f"allocating the cache failed: {num_pages} pages make pools of {sum(sizes) / 2**30:.2f} GiB, the largest "
            f"array {max(sizes) / 2**30:.2f} GiB, which needs one contiguous free block on {jax.devices()[0]}. Ask "
            f"for fewer pages, allocate the cache before other large arrays, or pack those first (through host "
            f"memory: `jmixedkv.placement.pack_on_device`). JAX said: {str(e)[:300]}") from None


class CacheManager:
    """Owns one `CacheState` and mirrors its capacity on the host (`wrap` adopts an existing state).

    Args: as `jmixedkv.init_state`. ``backend`` is used for every append (default ``"auto"``).
    """

    def __init__(self, config: KVCacheConfig, groups, num_pages: int, max_seqs: int,
                 max_pages_per_seq: Optional[int] = None, backend: str = "auto", **init_kwargs):
        state = _allocate(config, groups, num_pages, max_seqs, max_pages_per_seq, init_kwargs)
        self.config, self.backend = config, backend
        self.replace_state(state)

    @classmethod
    def wrap(cls, state: st.CacheState, backend: str = "auto") -> "CacheManager":
        """A manager over an existing state (`jmixedkv.init_state`'s); it owns the state from now on."""
        self = cls.__new__(cls)
        self.config, self.backend = state.config, backend
        self.replace_state(state)
        return self

    def _read_shared(self) -> None:
        """Mirror of which (slot, page) / (slot, twin column) entries are shared (refcount > 1): writes there are
        refused (`ERR_SHARED_PAGE`). Re-read from the device after fork / prefix / release (a sync)."""
        def shared(table, alloc):
            t, r = np.asarray(table), np.asarray(alloc.refcount)
            return (t >= 0) & (r[np.maximum(t, 0)] > 1)
        self._shared = shared(self.state.page_table, self.state.alloc)
        self._hshared = shared(self.state.high_table, self.state.high_alloc)

    # ------------------------------------------------------------------ queries
    @property
    def max_seqs(self) -> int:
        return self.state.max_seqs

    @property
    def free_pages(self) -> int:
        return self._free_low

    @property
    def free_high_pages(self) -> int:
        return self._free_high

    def kv_len(self, slot: int) -> int:
        return int(self._lens[checks.host_int(slot, "slot", "kv_len", 0, self.max_seqs)])

    def free_slots(self) -> list[int]:
        return [int(s) for s in np.flatnonzero(~self._active)]

    def can_admit(self, slot: Optional[int] = None) -> bool:
        need = self.config.num_high_pages_per_seq
        if slot is not None:
            slot = checks.host_int(slot, "slot", "can_admit")
        slot_ok = (not self._active.all()) if slot is None else (0 <= slot < self.max_seqs and not self._active[slot])
        return slot_ok and need <= self._free_high

    def host_tokens(self, seq_slots, positions, op: str = "append"):
        """``(seq, pos)`` as host int32 vectors, range-checked (slots in ``[-1, max_seqs)``); `ValueError` naming
        ``op`` and the offending entry otherwise."""
        seq = checks.index_array(seq_slots, "seq_slots", op, -1, self.max_seqs, host=True)
        pos = checks.index_array(positions, "positions", op, host=True)
        if seq.shape != pos.shape or seq.ndim != 1:
            raise ValueError(f"{op}: seq_slots and positions must be equal-length vectors, got {seq.shape}, "
                             f"{pos.shape}")
        return seq, pos

    def pages_needed(self, seq_slots, positions) -> dict[int, int]:
        """New low pages an append of tokens (seq_slots, positions) would allocate, per slot it names."""
        seq, pos = self.host_tokens(seq_slots, positions, "pages_needed")
        live = seq >= 0
        last = np.full(self.max_seqs, -1, np.int64)
        np.maximum.at(last, seq[live], pos[live].astype(np.int64))
        touched = np.zeros(self.max_seqs, bool)
        touched[seq[live]] = True
        return self._need_dict(self._new_pages(last), touched)

    def _new_pages(self, last) -> np.ndarray:
        """int64[S] new low pages per slot for appends reaching position ``last`` int[S] (-1: no token)."""
        last = np.asarray(last, np.int64)
        return np.where(last >= 0, np.maximum(0, last // self.config.page_size + 1 - self._pages_held), 0)

    @staticmethod
    def _need_dict(need: np.ndarray, touched: Optional[np.ndarray] = None) -> dict[int, int]:
        """``{slot: new pages}`` of the slots with tokens (``touched`` bool[S]; default: those needing pages)."""
        keys = np.flatnonzero(need > 0 if touched is None else touched)
        return dict(zip(keys.tolist(), need[keys].tolist()))

    def can_append(self, seq_slots, positions) -> bool:
        try:
            self.check_append(seq_slots, positions)
            return True
        except CacheCapacityError:
            return False

    def _free_slot(self, slot, name: str, op: str) -> int:
        """``slot`` range-checked, or the first free slot when None (`CacheCapacityError` if there is none)."""
        if slot is None:
            free = self.free_slots()
            if not free:
                raise CacheCapacityError(f"{op}: no free sequence slot: all {self.max_seqs} slots are admitted")
            slot = free[0]
        return checks.host_int(slot, name, op, 0, self.max_seqs)

    # ------------------------------------------------------------------ transitions
    def admit(self, slot: Optional[int] = None) -> int:
        """Admit an empty sequence; returns its slot. Raises `CacheCapacityError` if it cannot."""
        slot = self._free_slot(slot, "slot", "admit")
        if self._active[slot]:
            raise ValueError(f"admit: slot {slot} is already admitted")
        need = self.config.num_high_pages_per_seq
        if need > self._free_high:
            raise CacheCapacityError(f"admit: a sequence needs {need} high (first-N/last-N) pages, "
                                     f"only {self._free_high} are free")
        self.state = _admit(self.state, np.int32(slot))
        self._active[slot], self._lens[slot], self._written[slot], self._pages_held[slot] = True, 0, 0, 0
        self._shared[slot], self._hshared[slot] = False, False
        self._free_high -= need
        return slot

    def release(self, slot: int) -> None:
        slot = checks.host_int(slot, "slot", "release")
        if not (0 <= slot < self.max_seqs and self._active[slot]):
            raise ValueError(f"release: slot {slot} is not admitted")
        self.replace_state(_release(self.state, np.int32(slot)))

    def check_append(self, seq_slots, positions, capacity: bool = True):
        """Host mirror of `jmixedkv.append`'s refusals (`jmixedkv.checks`): `ValueError` for bad slots / positions,
        `CacheCapacityError` for capacity (the pool's free pages only when ``capacity``). Returns the new pages
        per slot (``{slot: pages}`` for every slot with tokens)."""
        seq, pos = self.host_tokens(seq_slots, positions, "append")
        need, last = self._check_host(seq, pos, capacity)
        return self._need_dict(need, last >= 0)

    def _check_host(self, seq, pos, capacity: bool):
        """`check_append` on host int32 vectors, vectorized over the tokens (no loop over slots): the first
        offending slot (lowest id) is named, with its first broken rule. Returns ``(new pages int64[S], last
        position int32[S] (-1: no token))``."""
        live = seq >= 0
        sl, pl = seq[live], pos[live]
        idle = ~self._active[sl]
        if idle.any():
            raise ValueError(f"append: sequence slots {np.unique(sl[idle]).tolist()} are not admitted")
        if (pl < 0).any():
            raise ValueError(f"append: negative positions {np.unique(pl[pl < 0]).tolist()}")
        cfg = self.config
        limit = self.state.max_pages_per_seq * cfg.page_size
        if (pl >= limit).any():
            raise CacheCapacityError(f"append: position {int(pl.max())} is past the page table's width "
                                     f"({self.state.max_pages_per_seq} pages x {cfg.page_size} = {limit} tokens)")
        broken, off, _, last = checks.position_rule(seq, pos, self._lens, self.max_seqs, np)   # the one rule
        hit = self._shared[sl, pl // cfg.page_size]                   # per token: writes a shared page / twin page
        width = self._hshared.shape[1]
        if width:
            col = cfg.twin.high_column(pl)
            hit = hit | ((col >= 0) & self._hshared[sl, np.clip(col, 0, width - 1)])
        shared = np.zeros(self.max_seqs, bool)
        shared[sl[hit]] = True
        bad = broken | shared | off
        if bad.any():
            first = int(np.flatnonzero(bad)[0])
            self._refuse(first, np.sort(pl[sl == first]), broken, shared)
        need = self._new_pages(last)
        total = int(need.sum())
        if capacity and total > self._free_low:
            detail = ", ".join(f"slot {s} needs {n}" for s, n in self._need_dict(need).items())
            raise CacheCapacityError(f"append needs {total} new low pages but only {self._free_low} are free "
                                     f"(short by {total - self._free_low}: {detail})")
        return need, last

    def _refuse(self, s: int, p: np.ndarray, broken, shared) -> None:
        """The `ValueError` of slot ``s`` (its sorted positions ``p``): broken positions, a shared page, or a
        range that does not meet its kv_len, in that order."""
        if broken[s]:
            raise ValueError(f"append: slot {s}: positions must be distinct and contiguous, got "
                             f"{p[:16].tolist()}{'...' if p.size > 16 else ''}")
        if shared[s]:
            raise ValueError(f"append: slot {s}: positions [{p[0]}, {p[-1]}] write into a page shared with "
                             f"another sequence or the prefix index (fork / prefix reuse); shared pages are "
                             f"never written (copy-on-write happens at fork / admit)")
        raise ValueError(f"append: slot {s} has kv_len {int(self._lens[s])}; positions [{p[0]}, {p[-1]}] must "
                         f"start at or before it and reach it (extend from kv_len, or rewrite a suffix ending at "
                         f"kv_len - 1 or later)")

    def append(self, layer, k, v, seq_slots, positions, group: int = 0, rope: Optional[RopeSpec] = None):
        """`jmixedkv.append` (donated) with capacity and positions checked first; see it for shapes."""
        spec = checks.check_group(self.state, group, "append")
        if layer is not None:
            layer = checks.host_int(np.asarray(layer).item() if checks.is_jax(layer) else layer, "layer", "append",
                                    0, spec.num_layers)
        seq, pos = self.host_tokens(seq_slots, positions, "append")
        need, last = self._check_host(seq, pos, True)
        layer_arg = None if layer is None else np.int32(layer)
        self.state = st.append(self.state, layer_arg, k, v, seq, pos, group=group,
                               rope=rope, backend=self.backend, donate=True)
        self._account_append(need, last)

    def reserve_append(self, seq_slots, positions):
        """Check an append of tokens ``(seq_slots, positions)`` as `append` does (`ValueError` /
        `CacheCapacityError`, nothing changed) and account for it in the host mirror, for an engine that runs the
        transition itself in its own jitted program, for every layer of a step (`jmixedkv.step`), and installs the
        result with `install`. Returns the host ``(seq, pos)`` int32 vectors."""
        seq, pos = self.host_tokens(seq_slots, positions, "append")
        need, last = self._check_host(seq, pos, True)
        self._account_append(need, last)
        return seq, pos

    def install(self, state: st.CacheState) -> None:
        """Install the result of a transition `reserve_append` accounted for (no host re-read, no sync)."""
        self.state = state

    def _account_append(self, need: np.ndarray, last: np.ndarray) -> None:
        """Host mirror of an append: ``need`` int64[S] new pages per slot, ``last`` int[S] each slot's last position
        written (-1: none; `_check_host`): lengths / written to one past it."""
        self._pages_held += need
        self._free_low -= int(need.sum())
        hit = last >= 0
        end = last[hit].astype(np.int64) + 1
        self._lens[hit] = end
        self._written[hit] = np.maximum(self._written[hit], end)

    def set_lengths(self, lens=None) -> None:
        """Host mirror update after a device-side length change (speculative accept / correction): re-reads the
        device lengths. ``lens`` (optional, host i32[S]) must equal them, else `ValueError` (the device refused or
        did something else)."""
        dev = np.asarray(self.state.kv_lens, np.int64)
        if lens is not None:
            want = checks.index_array(lens, "lens", "set_lengths", host=True).astype(np.int64)
            if want.shape != dev.shape or (want != dev).any():
                diff = np.flatnonzero(want != dev) if want.shape == dev.shape else []
                raise ValueError(f"set_lengths: host lengths differ from the device at slots {list(diff)[:8]} "
                                 f"(device error bits: {st.describe_error(int(self.state.error))})")
        self._lens = dev.copy()
        self._written = np.asarray(self.state.written, np.int64).copy()

    def check(self) -> None:
        """Raise `CacheError` if the device state recorded an error (syncs with the device)."""
        code = int(self.state.error)
        if code:
            raise CacheError(f"cache state error {code}: {st.describe_error(code)}")

    def _run(self, what: str, fn, *args) -> None:
        """Run an all-or-nothing transition; if it sets new error bits (it then changed nothing else), keep the
        old bits and raise `CacheCapacityError` (out of pages) or `CacheError` naming them."""
        before = int(self.state.error)                       # read before a donated call
        new = fn(self.state, *args)
        added = int(new.error) & ~before
        if added:
            self.replace_state(dataclasses.replace(new, error=jnp.full_like(new.error, before)))
            cls = CacheCapacityError if not added & ~(st.ERR_LOW_OOM | st.ERR_HIGH_OOM) else CacheError
            raise cls(f"{what}: refused ({st.describe_error(added)}); nothing changed "
                      f"({self.free_pages} low / {self.free_high_pages} high pages free)")
        self.replace_state(new)

    def fork(self, src: int, dst: Optional[int] = None) -> int:
        """Copy sequence ``src`` into the free slot ``dst`` (default: the first free one), `jmixedkv.state.fork`:
        pages wholly below the rewind floor shared, every page a legal rewind can write and the ring copied
        (`jmixedkv.state.fork_pages_needed` pages; `CacheCapacityError` if they are not free). Returns ``dst``."""
        src = checks.host_int(src, "src", "fork", 0, self.max_seqs)
        if not self._active[src]:
            raise ValueError(f"fork: source slot {src} is not admitted")
        dst = self._free_slot(dst, "dst", "fork")
        if dst == src or self._active[dst]:
            raise ValueError(f"fork: destination slot {dst} is admitted already (or equals src {src})")
        self._run(f"fork {src} -> {dst}", _fork, np.int32(src), np.int32(dst))
        return dst

    def correct_kv_lens(self, offsets) -> None:
        """`jmixedkv.speculative.correct_kv_lens` (``offsets i32[max_seqs] <= 0``; its rule, its `ValueError`s)."""
        self._run("correct_kv_lens", speculative.correct_kv_lens, offsets)

    def accept(self, seq_slots, num_accepted, num_drafts, trim_pages: bool = False) -> None:
        """`jmixedkv.speculative.accept` (validated there), then `trim` of those slots when ``trim_pages``."""
        self._run("accept", speculative.accept, seq_slots, num_accepted, num_drafts)
        if trim_pages:
            self.trim(seq_slots)

    def trim(self, seq_slots=None) -> None:
        """`jmixedkv.speculative.trim`: release low pages wholly past each sequence's length."""
        self._run("trim", speculative.trim, seq_slots)

    def replace_state(self, state: st.CacheState) -> None:
        """Install a state produced by a pure transition outside the manager; re-reads the host mirror."""
        self.state = state
        self._lens = np.asarray(state.kv_lens, np.int64)
        self._written = np.asarray(state.written, np.int64).copy()
        self._active = np.asarray(state.active).copy()
        self._pages_held = (np.asarray(state.page_table) >= 0).sum(axis=1).astype(np.int64)
        self._free_low = int(state.alloc.num_free)
        self._free_high = int(state.high_alloc.num_free)
        self._read_shared()
