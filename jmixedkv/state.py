"""The cache state: one immutable pytree (pools + page tables + lengths + allocators), and its pure transitions.

``admit``, ``release`` and ``append`` are pure ``state -> state`` functions; jit them with
``donate_argnums=0`` so the pools update in place (the Pallas write kernel aliases its outputs to its inputs).
Nothing retraces when lengths, page tables or batch membership change: they are all traced arrays.

A transition that cannot be met (no free page, a position past the page table, a sequence slot that is not
admitted) sets a bit in ``state.error`` and leaves every sequence unchanged. The host-side `CacheManager`
(`jmixedkv.manager`) checks capacity up front and raises a clear error instead.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp

from . import layout
from .allocator import Allocator, allocate_mask, new_allocator, release_pages
from .config import KVCacheConfig
from .pools import GroupPools, LowPool, RowPool, write_rows_reference
from .rope import RopeSpec, apply_rope

__all__ = ["GroupSpec", "CacheState", "init_state", "admit", "release", "append", "ERR_LOW_OOM",
           "ERR_HIGH_OOM", "ERR_TOO_LONG", "ERR_BAD_SLOT", "ERR_BAD_CORRECTION", "describe_error"]

ERR_LOW_OOM = 1     # not enough free low (history) pages
ERR_HIGH_OOM = 2    # not enough free high (twin) pages
ERR_TOO_LONG = 4    # a position past the page table's width
ERR_BAD_SLOT = 8    # admit of an active slot, or append to a slot that is not admitted
ERR_BAD_CORRECTION = 16  # a speculative length correction out of range (jmixedkv.speculative)
_ERR_NAMES = {ERR_LOW_OOM: "out of low pages", ERR_HIGH_OOM: "out of high pages",
              ERR_TOO_LONG: "position past max_pages_per_seq * page_size",
              ERR_BAD_SLOT: "sequence slot not admitted (or admitted twice)",
              ERR_BAD_CORRECTION: "bad speculative length correction (positive offset, rewind past max_draft_len or "
                                  "kv_len, or an idle slot)"}

GROUP_KINDS = ("mixed", "low", "plain")


def describe_error(code: int) -> str:
    return ", ".join(name for bit, name in _ERR_NAMES.items() if code & bit) or "ok"


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """A group of layers with the same geometry, sharing page ids.

    ``kind``: ``"mixed"`` (NVFP4 + high twin), ``"low"`` (NVFP4 only), ``"plain"`` (one row pool in the high
    dtype, e.g. draft layers); ``None`` = derived from the config. ``kv_factor`` 2 = K and V, 1 = MLA latent.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_factor: int = 2
    kind: Optional[str] = None
    name: str = "attn"
    compression_ratio: int = 1

    def __post_init__(self):
        for f in ("num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, f) < 1:
                raise ValueError(f"GroupSpec.{f} must be >= 1, got {getattr(self, f)}")
        if self.kv_factor not in (1, 2):
            raise ValueError(f"GroupSpec.kv_factor must be 1 (MLA latent) or 2 (K, V), got {self.kv_factor}")
        if self.kind is not None and self.kind not in GROUP_KINDS:
            raise ValueError(f"GroupSpec.kind must be one of {GROUP_KINDS} or None, got {self.kind!r}")
        if self.head_dim % 16:
            raise ValueError(f"GroupSpec.head_dim must be a multiple of 16 (NVFP4 blocks), got {self.head_dim}")

    def resolved_kind(self, config: KVCacheConfig) -> str:
        if self.kind is not None:
            if self.kind in ("mixed", "low") and not config.has_low:
                raise ValueError(f"GroupSpec {self.name!r}: kind={self.kind!r} needs an NVFP4 dtype, "
                                 f"config dtype is {config.dtype!r}")
            if self.kind == "plain" and config.high_dtype is None and config.dtype == "nvfp4":
                raise ValueError(f"GroupSpec {self.name!r}: kind='plain' needs a row dtype; dtype 'nvfp4' has none")
            return self.kind
        if config.is_mixed:
            return "mixed"
        return "low" if config.has_low else "plain"


@dataclasses.dataclass(frozen=True)
class CacheState:
    """The whole cache as one pytree.

    Attributes:
      config: `KVCacheConfig` (static).
      groups: tuple of `GroupSpec` (static), with their resolved kinds in ``kinds``.
      pools: tuple of `GroupPools`, one per group.
      page_table: i32[S, max_pages] low page ids (-1 = none).
      high_table: i32[S, F + R] high (twin) page ids (-1 = none).
      kv_lens: i32[S] corrected lengths.
      active: bool[S] admitted slots.
      alloc / high_alloc: `Allocator` for the low and high pools.
      error: i32[] sticky error bits (``ERR_*``).
    """

    config: KVCacheConfig
    groups: tuple
    kinds: tuple
    pools: tuple
    page_table: jax.Array
    high_table: jax.Array
    kv_lens: jax.Array
    active: jax.Array
    alloc: Allocator
    high_alloc: Allocator
    error: jax.Array

    @property
    def max_seqs(self) -> int:
        return self.page_table.shape[0]

    @property
    def max_pages_per_seq(self) -> int:
        return self.page_table.shape[1]

    @property
    def page_size(self) -> int:
        return self.config.page_size


jax.tree_util.register_dataclass(
    CacheState,
    data_fields=["pools", "page_table", "high_table", "kv_lens", "active", "alloc", "high_alloc", "error"],
    meta_fields=["config", "groups", "kinds"])


def _row_pool(num_layers, num_pages, spec: GroupSpec, page, dtype, fill, scale):
    shape = (num_layers, num_pages, spec.kv_factor, spec.num_kv_heads, page, spec.head_dim)
    rows = jnp.full(shape, fill, jnp.float32).astype(dtype) if fill is not None else jnp.zeros(shape, dtype)
    return RowPool(rows, jnp.broadcast_to(jnp.asarray(scale, jnp.float32), (num_layers, spec.kv_factor)))


def _low_pool(num_pages, spec: GroupSpec, page, poison, gs):
    base = (spec.num_layers, num_pages, spec.kv_factor, spec.num_kv_heads, page)
    data = jnp.full(base + (spec.head_dim // 2,), 0x77 if poison else 0, jnp.uint8)
    scales = jax.lax.bitcast_convert_type(
        jnp.full(base + (spec.head_dim // 16,), 0x7F if poison else 0, jnp.uint8), jnp.float8_e4m3fn)
    return LowPool(data, scales, jnp.broadcast_to(jnp.asarray(gs, jnp.float32), (spec.num_layers, spec.kv_factor)))


def init_state(config: KVCacheConfig, groups: Union[GroupSpec, Sequence[GroupSpec]], num_pages: int,
               max_seqs: int, max_pages_per_seq: Optional[int] = None, num_high_pages: Optional[int] = None,
               gs=1.0, high_scale=1.0, poison: bool = False, page_order=None, high_page_order=None,
               mesh=None) -> CacheState:
    """Allocate an empty cache.

    Args:
      config: validated options.
      groups: one `GroupSpec` or several (e.g. target layers + plain draft layers).
      num_pages: low (history) pages, shared by every group (each group has its own arrays).
      max_seqs: sequence slots ``S``.
      max_pages_per_seq: width of ``page_table`` (default ``num_pages``).
      num_high_pages: twin pages (default ``max_seqs * (F + R)``).
      gs: NVFP4 decode global scale, scalar or f32[L, kv] (one per group if a list).
      high_scale: scale of an FP8 twin / FP8 plain pool.
      poison: fill pools with NaN-decoding bytes (tests: unwritten rows must never be read).
      page_order / high_page_order: permutations for the free stacks (tests: permuted page ids).
      mesh: optional ``jax.sharding.Mesh`` with a ``"tp"`` axis: pools are sharded over KV heads, the rest
        replicated (`jmixedkv.sharding`).
    """
    groups = (groups,) if isinstance(groups, GroupSpec) else tuple(groups)
    if not groups:
        raise ValueError("init_state needs at least one GroupSpec")
    if num_pages < 1 or max_seqs < 1:
        raise ValueError(f"init_state: num_pages and max_seqs must be >= 1, got {num_pages}, {max_seqs}")
    page = config.page_size
    max_pages_per_seq = num_pages if max_pages_per_seq is None else max_pages_per_seq
    hp_per_seq = config.num_high_pages_per_seq
    num_high_pages = max_seqs * hp_per_seq if num_high_pages is None else num_high_pages
    kinds = tuple(g.resolved_kind(config) for g in groups)
    gss = gs if isinstance(gs, (list, tuple)) else [gs] * len(groups)
    fill = float("nan") if poison else None
    pools = []
    for spec, kind, g in zip(groups, kinds, gss):
        low = _low_pool(num_pages, spec, page, poison, g) if kind in ("mixed", "low") else None
        high = (_row_pool(spec.num_layers, max(num_high_pages, 1), spec, page, config.high_dtype, fill, high_scale)
                if kind == "mixed" and hp_per_seq else None)
        plain = (_row_pool(spec.num_layers, num_pages, spec, page, config.high_dtype or config.attention_dtype,
                           fill, high_scale) if kind == "plain" else None)
        pools.append(GroupPools(low, high, plain))
    state = CacheState(
        config=config, groups=groups, kinds=kinds, pools=tuple(pools),
        page_table=jnp.full((max_seqs, max_pages_per_seq), -1, jnp.int32),
        high_table=jnp.full((max_seqs, hp_per_seq), -1, jnp.int32),
        kv_lens=jnp.zeros((max_seqs,), jnp.int32), active=jnp.zeros((max_seqs,), bool),
        alloc=new_allocator(num_pages, page_order), high_alloc=new_allocator(max(num_high_pages, 1), high_page_order),
        error=jnp.int32(0))
    if mesh is not None:
        from .sharding import shard_state
        state = shard_state(state, mesh)
    return state


def _select(ok, new, old):
    return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)


def _slot(state: CacheState, seq_slot):
    """(clipped slot, in range, is the -1 "none" sentinel)."""
    slot = jnp.asarray(seq_slot, jnp.int32)
    in_range = (slot >= 0) & (slot < state.max_seqs)
    return jnp.clip(slot, 0, state.max_seqs - 1), in_range, slot == -1


def admit(state: CacheState, seq_slot) -> CacheState:
    """Admit an empty sequence into ``seq_slot`` (traced int; -1 = no-op): allocates its F + R high pages.

    An out-of-range or already-admitted slot sets ``ERR_BAD_SLOT``; too few high pages ``ERR_HIGH_OOM``;
    either way nothing changes."""
    slot, in_range, none = _slot(state, seq_slot)
    free_slot = in_range & ~state.active[slot]
    need = jnp.broadcast_to(free_slot, state.high_table.shape[1:])
    high_alloc, ids, ok = allocate_mask(state.high_alloc, need)
    ok = ok & free_slot
    err = jnp.where(none, 0, jnp.where(free_slot, jnp.where(ok, 0, ERR_HIGH_OOM), ERR_BAD_SLOT))
    new = dataclasses.replace(
        state, high_table=state.high_table.at[slot].set(ids), kv_lens=state.kv_lens.at[slot].set(0),
        page_table=state.page_table.at[slot].set(-1), active=state.active.at[slot].set(True), high_alloc=high_alloc)
    out = _select(ok, new, state)
    return dataclasses.replace(out, error=state.error | err)


def release(state: CacheState, seq_slot) -> CacheState:
    """Release ``seq_slot`` (-1 = no-op): every low and high page loses a reference (freed at zero).

    Releasing a slot that is not admitted sets ``ERR_BAD_SLOT`` and changes nothing."""
    slot, in_range, none = _slot(state, seq_slot)
    ok = in_range & state.active[slot]
    new = dataclasses.replace(
        state, alloc=release_pages(state.alloc, state.page_table[slot]),
        high_alloc=release_pages(state.high_alloc, state.high_table[slot]),
        page_table=state.page_table.at[slot].set(-1), high_table=state.high_table.at[slot].set(-1),
        kv_lens=state.kv_lens.at[slot].set(0), active=state.active.at[slot].set(False))
    out = _select(ok, new, state)
    return dataclasses.replace(out, error=state.error | jnp.where(ok | none, 0, ERR_BAD_SLOT))


def _ensure_pages(state: CacheState, seq, pos):
    """Allocate low pages for every (seq, page) the tokens touch. Returns (state', ok, err)."""
    page, (num_seqs, max_pages) = state.page_size, state.page_table.shape
    valid = (seq >= 0) & (pos >= 0)
    q = pos // page
    too_long = jnp.any(valid & (q >= max_pages))
    bad_slot = jnp.any(valid & ~state.active[jnp.clip(seq, 0, num_seqs - 1)])
    pre_ok = ~too_long & ~bad_slot
    touched = jnp.zeros((num_seqs, max_pages), bool).at[
        jnp.where(valid & pre_ok, seq, num_seqs), jnp.clip(q, 0, max_pages - 1)].set(True, mode="drop")
    need = touched & (state.page_table < 0)
    alloc, ids, ok = allocate_mask(state.alloc, need)
    ok = ok & pre_ok
    err = (jnp.where(too_long, ERR_TOO_LONG, 0) | jnp.where(bad_slot, ERR_BAD_SLOT, 0)
           | jnp.where(pre_ok & ~ok, ERR_LOW_OOM, 0))
    page_table = jnp.where(need & ok, ids, state.page_table)
    return dataclasses.replace(state, alloc=alloc, page_table=page_table), ok, err


def write_slots(state: CacheState, seq, pos):
    """(low_slot, high_slot) i32[T] for tokens (seq, pos), after their pages are allocated.

    Ring rows that a later token of the same call overwrites are dropped from the high store, so one call never
    writes a high row twice."""
    cfg = state.config
    page, nf, nr = cfg.page_size, cfg.num_fixed_pages, cfg.num_ring_pages
    low_slot = layout.low_slots(state.page_table, seq, pos, page)
    last = layout.segment_max_position(seq, pos, state.max_seqs)
    q, qmax = pos // page, last[jnp.clip(seq, 0, state.max_seqs - 1)] // page
    keep = (q < nf) | (q > qmax - nr)
    high_slot = layout.high_slots(state.high_table, seq, pos, page, nf, nr, write_mask=keep & (low_slot >= 0))
    return low_slot, high_slot


def _check_v(k, v, spec: GroupSpec):
    if spec.kv_factor == 1 and v is not None:
        raise ValueError(f"group {spec.name!r} stores an MLA latent (kv_factor=1): pass v=None")
    if spec.kv_factor == 2 and (v is None or v.shape != k.shape):
        raise ValueError(f"group {spec.name!r} needs v with k's shape {k.shape}, got "
                         f"{None if v is None else v.shape}")


def _stack_kv(k, v, spec: GroupSpec):
    """``[..., T, H, D]`` k (and v) -> ``[..., T, kv, H, D]`` rows."""
    return k[..., None, :, :] if spec.kv_factor == 1 else jnp.stack([k, v], axis=-3)


def _check_rows(k, spec: GroupSpec, layer, num_tokens):
    want_rank = 3 if layer is not None else 4
    if k.ndim != want_rank or k.shape[-2:] != (spec.num_kv_heads, spec.head_dim) or k.shape[-3] != num_tokens:
        lead = "[T, H, D]" if layer is not None else "[L, T, H, D]"
        raise ValueError(f"append: k must be {lead} with H={spec.num_kv_heads}, D={spec.head_dim}, "
                         f"T={num_tokens}; got {k.shape}")
    if layer is None and k.shape[0] != spec.num_layers:
        raise ValueError(f"append: all-layer k has {k.shape[0]} layers, group {spec.name!r} has {spec.num_layers}")
    if not jnp.issubdtype(k.dtype, jnp.floating):
        raise ValueError(f"append: k must be a float array, got {k.dtype}")


def append(state: CacheState, k, v, seq_slots, positions, layer=None, group: int = 0,
           rope: Optional[RopeSpec] = None, backend: str = "auto") -> CacheState:
    """Append new K/V rows (a ragged prefill chunk, or a decode / verify step) for one layer or all layers.

    Args:
      k, v: ``[T, H, D]`` (``layer`` given) or ``[L, T, H, D]`` (``layer=None``: all layers of the group);
        ``v=None`` for an MLA latent group. Any float dtype; RoPE (if ``rope``) is applied to ``k`` here.
      seq_slots: i32[T] sequence slot of each token (-1 = padding, skipped).
      positions: i32[T] position of each token in its sequence.
      layer: int (may be traced) or None for all layers.
      group: index of the layer group (static).
      rope: optional `RopeSpec` applied to K before both stores.
      backend: ``"auto"`` (Pallas on GPU), ``"reference"`` or ``"pallas"``.

    New low pages are allocated as sequences cross page boundaries; ``kv_lens`` becomes
    ``max(kv_lens, last position + 1)``. All-or-nothing: on any error nothing is written.
    """
    spec = state.groups[group]
    seq = jnp.asarray(seq_slots, jnp.int32)
    pos = jnp.asarray(positions, jnp.int32)
    if seq.shape != pos.shape or seq.ndim != 1:
        raise ValueError(f"append: seq_slots and positions must be equal-length vectors, got {seq.shape}, {pos.shape}")
    _check_rows(k, spec, layer, seq.shape[0])
    _check_v(k, v, spec)
    state, ok, err = _ensure_pages(state, seq, pos)
    seq = jnp.where(ok, seq, -1)
    low_slot, high_slot = write_slots(state, seq, pos)
    pools = _write(state, group, k, v, pos, rope, layer, low_slot, high_slot, backend)
    last = layout.segment_max_position(seq, pos, state.max_seqs)
    kv_lens = jnp.maximum(state.kv_lens, last + 1)
    new_pools = state.pools[:group] + (pools,) + state.pools[group + 1:]
    return dataclasses.replace(state, pools=new_pools, kv_lens=kv_lens, error=state.error | err)


def _write(state: CacheState, group, k, v, pos, rope, layer, low_slot, high_slot, backend):
    """Dispatch the row store. RoPE'd K is rounded to K's dtype before both stores, so in-kernel RoPE equals
    RoPE applied by the model followed by a plain append."""
    from .backend import resolve
    spec = state.groups[group]
    if resolve(backend) == "pallas":
        from pallas_kernels import write as write_kernel  # GPU kernel (interpret mode on CPU)
        return write_kernel.write_rows(state.pools[group], k, v, layer, low_slot, high_slot, state.page_size,
                                       positions=pos, rope=rope)
    if rope is not None:
        k = apply_rope(k, pos, rope).astype(k.dtype)
    return write_rows_reference(state.pools[group], _stack_kv(k, v, spec), layer, low_slot, high_slot,
                                state.page_size)
