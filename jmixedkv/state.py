"""The cache state: one immutable pytree (pools + page tables + lengths + allocators), and its pure transitions.

``admit``, ``release`` and ``append`` are pure ``state -> state`` functions. ``append`` jits itself
(``donate=True`` updates the pools in place: the Pallas write kernel aliases its outputs to its inputs).
Nothing retraces when lengths, page tables or batch membership change: they are all traced arrays.

A transition that cannot be met (no free page, a position past the page table, a sequence slot that is not
admitted or out of range, a bad layer, an illegal position, a write into a shared page) sets a bit in
``state.error`` and leaves every leaf but ``error`` bitwise unchanged; host (Python / NumPy) arguments are
range-checked first and raise `ValueError`. The rule and the bits live in `jmixedkv.checks`. The host-side
`CacheManager` (`jmixedkv.manager`) checks capacity and positions up front and raises a clear error instead.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from . import checks, layout, levers
from .allocator import Allocator, allocate_mask, new_allocator, release_pages, retain_pages
from .config import KVCacheConfig
from .offload import gather_pages, scatter_pages
from .pools import GroupPools, LowPool, RowPool, pytree
from .checks import (ERR_BAD_CORRECTION, ERR_BAD_LAYER, ERR_BAD_PAGE, ERR_BAD_POSITION, ERR_BAD_SLOT,
                     ERR_HIGH_OOM, ERR_LOW_OOM, ERR_SHARED_PAGE, ERR_TOO_LONG)
from .rope import RopeSpec
from .write import write_rows

__all__ = ["GroupSpec", "CacheState", "init_state", "admit", "release", "append", "fork", "fork_shares",
           "fork_pages_needed", "step_complete", "AppendPlan", "plan_append_traced", "write_layer_traced",
           "ERR_LOW_OOM", "ERR_HIGH_OOM", "ERR_TOO_LONG", "ERR_BAD_SLOT", "ERR_BAD_CORRECTION", "ERR_BAD_LAYER",
           "ERR_BAD_POSITION", "ERR_SHARED_PAGE", "ERR_BAD_PAGE", "describe_error"]

GROUP_KINDS = ("mixed", "low", "plain")
describe_error = checks.describe_error      # error bits and the validation rule: jmixedkv.checks


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

    def __post_init__(self):
        for f in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"GroupSpec.{f} must be an integer >= 1, got {value!r}")
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


@pytree("config", "groups", "kinds")
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
      written: i32[S] one past the highest position written since admit (``kv_lens <= written <=
        kv_lens + max_draft_len``; rows in ``[kv_lens, written)`` are rejected drafts).
      floor: i32[S] the lowest length a speculative rewind may reach: ``max(written - max_draft_len, 0)``, and
        never below a reused prefix's length (`jmixedkv.prefix.admit_with_prefix`). Pages wholly below it are
        never written again, so only they may be shared (`fork_shares`; `jmixedkv.checks`).
      step_lo: i32[S] first position of the open append step (the last call that wrote new rows; a verify block
        or a prefill chunk), -1 when none is open (after admit, `accept` or a rewind). Its rows are
        ``[step_lo, kv_lens)``.
      step_layers: bool[S, sum of num_layers] the layers (groups in order) that wrote the whole open step.
        `jmixedkv.speculative.accept` / `correct_kv_lens` refuse a rewind while a group wrote the step only in
        part (an accept between two layers' appends of one verify step).
      alloc / high_alloc: `Allocator` for the low and high pools.
      error: i32[] sticky error bits (``ERR_*``).
      k_means: with ``config.k_smoothing``, one f32[L, S, H, D] per group: each slot's frozen per-(layer, KV
        head, channel) K mean in the stored frame (after RoPE and the rotation lever), subtracted from every key
        the slot stores (`append`; `jmixedkv.levers`); zero for a slot that stored nothing. None otherwise.
    """

    config: KVCacheConfig
    groups: tuple
    kinds: tuple
    pools: tuple
    page_table: jax.Array
    high_table: jax.Array
    kv_lens: jax.Array
    active: jax.Array
    written: jax.Array
    floor: jax.Array
    step_lo: jax.Array
    step_layers: jax.Array
    alloc: Allocator
    high_alloc: Allocator
    error: jax.Array
    k_means: Optional[tuple] = None

    @property
    def max_seqs(self) -> int:
        return self.page_table.shape[0]

    @property
    def max_pages_per_seq(self) -> int:
        return self.page_table.shape[1]

    @property
    def page_size(self) -> int:
        return self.config.page_size

    @property
    def layer_offsets(self) -> tuple:
        """Static first column of each group in ``step_layers`` (and the total, last)."""
        return layer_offsets(self.groups)


def tables_only(transition):
    """``transition`` (``state, *args -> state`` or ``(state, *extras)``) jitted for a transition that changes
    tables only (admit, release, page references): the tables are donated; the pools enter the program as plain
    inputs and the caller gets its own pool arrays back, never a program output. A donated pool returned unchanged
    is not reliably aliased: XLA on the GPU may copy it into a fresh buffer (a 40 GiB pool on an 80 GiB card then
    fails to allocate), and an undonated one is always copied. Raises ``TypeError`` at trace time if
    ``transition`` changed a pool. Each call of `tables_only` makes a new jitted program: wrap once, call many times
    (the input state's tables are donated: use the returned state)."""
    @functools.partial(jax.jit, donate_argnums=0)
    def run(rest, pools, *args):                   # -> (state without pools, *extras)
        out = transition(dataclasses.replace(rest, pools=pools), *args)
        new, *extras = out if isinstance(out, tuple) else (out,)
        if not all(a is b for a, b in zip(jax.tree.leaves(new.pools), jax.tree.leaves(pools), strict=True)):
            raise TypeError(f"tables_only: {getattr(transition, '__name__', transition)} changed a pool")
        return (dataclasses.replace(new, pools=None), *extras)

    @functools.wraps(transition)
    def call(state, *args):
        new, *extras = run(dataclasses.replace(state, pools=None), state.pools, *args)
        new = dataclasses.replace(new, pools=state.pools)
        return (new, *extras) if extras else new
    call.program = run                             # the jitted program (its compilations, lowering)
    return call


def layer_offsets(groups) -> tuple:
    """``(0, L_0, L_0 + L_1, ...)``: the column of each group's first layer in ``step_layers``, then the total."""
    out = [0]
    for g in groups:
        out.append(out[-1] + g.num_layers)
    return tuple(out)


def step_complete(state: CacheState):
    """bool[S]: no group wrote the open step only in part (every group's layers all or none in ``step_layers``)."""
    offs = state.layer_offsets
    ok = jnp.ones((state.max_seqs,), bool)
    for a, b in zip(offs[:-1], offs[1:]):
        cols = state.step_layers[:, a:b]
        ok = ok & (jnp.all(cols, axis=1) | ~jnp.any(cols, axis=1))
    return ok | (state.step_lo < 0)


def fork_shares(floor, page: int, num_cols: int, xp=jnp):
    """bool[..., num_cols]: page column ``j`` may be shared (by `fork`, or a reused prefix) iff it lies wholly
    below the rewind floor, ``(j + 1) * page <= floor``: every position a legal rewind can rewrite is
    ``>= floor``, so every other page a sequence holds gets its own copy. ``floor`` int[...] (NumPy on the host
    with ``xp=np``, jnp inside jit)."""
    cols = xp.arange(num_cols)
    return (cols + 1) * page <= xp.asarray(floor)[..., None]


def _pool_pages(num_pages, spec: GroupSpec, page, width, dtype, shards):
    """Pages of a pool array ``[L, P, kv, H, page, width]``: ``num_pages``, padded past the Pallas Triton offset
    hole (`layout.offset_safe_count`) for 1-byte dtypes. Padding pages are never allocated or read."""
    per_page = spec.num_layers * spec.kv_factor * spec.num_kv_heads * page * width
    return layout.offset_safe_count(num_pages, per_page, jnp.dtype(dtype).itemsize, shards)


def _row_pool(num_layers, num_pages, spec: GroupSpec, page, dtype, fill, scale, shards=1):
    num_pages = _pool_pages(num_pages, spec, page, spec.head_dim, dtype, shards)
    shape = (num_layers, num_pages, spec.kv_factor, spec.num_kv_heads, page, spec.head_dim)
    rows = jnp.full(shape, fill, jnp.float32).astype(dtype) if fill is not None else jnp.zeros(shape, dtype)
    return RowPool(rows, jnp.broadcast_to(jnp.asarray(scale, jnp.float32), (num_layers, spec.kv_factor)))


def _low_pool(num_pages, spec: GroupSpec, page, poison, gs, shards=1):
    def base(width):
        p = _pool_pages(num_pages, spec, page, width, jnp.uint8, shards)
        return (spec.num_layers, p, spec.kv_factor, spec.num_kv_heads, page, width)
    data = jnp.full(base(spec.head_dim // 2), 0x77 if poison else 0, jnp.uint8)
    scales = jax.lax.bitcast_convert_type(
        jnp.full(base(spec.head_dim // 16), 0x7F if poison else 0, jnp.uint8), jnp.float8_e4m3fn)
    return LowPool(data, scales, jnp.broadcast_to(jnp.asarray(gs, jnp.float32), (spec.num_layers, spec.kv_factor)))


def init_state(config: KVCacheConfig, groups: Union[GroupSpec, Sequence[GroupSpec]], num_pages: int,
               max_seqs: int, max_pages_per_seq: Optional[int] = None, num_high_pages: Optional[int] = None,
               gs=1.0, high_scale=1.0, poison: bool = False, page_order=None, high_page_order=None,
               mesh=None) -> CacheState:
    """Allocate an empty cache.

    Args:
      config: validated options.
      groups: one `GroupSpec` or several (e.g. target layers + plain draft layers).
      num_pages: low (history) pages, shared by every group (each group has its own arrays). A pool array of
        1-byte elements (NVFP4 data / scales, FP8 rows) that would fall in (2**31, 2**32] bytes, where Pallas
        Triton's 32-bit offsets wrap, gets padding pages past 2**32 bytes (per shard under ``mesh``): they are
        never allocated or read (`jmixedkv.layout.offset_safe_count`); ``state.alloc`` holds ``num_pages``.
      max_seqs: sequence slots ``S``.
      max_pages_per_seq: width of ``page_table`` (default ``num_pages``).
      num_high_pages: twin pages (default ``max_seqs * (F + R)``).
      gs: NVFP4 decode global scale, scalar or f32[L, kv] (one per group if a list).
      high_scale: scale of an FP8 twin / FP8 plain pool.
      poison: fill pools with NaN-decoding bytes (tests: unwritten rows must never be read).
      page_order / high_page_order: permutations for the free stacks (tests: permuted page ids).
      mesh: optional ``jax.sharding.Mesh`` with a ``"tp"`` axis: pools are sharded over KV heads, the rest
        replicated (`jmixedkv.placement`).
    """
    groups = (groups,) if isinstance(groups, GroupSpec) else tuple(groups)
    if not groups or not all(isinstance(g, GroupSpec) for g in groups):
        raise ValueError(f"init_state needs one GroupSpec or a non-empty sequence of them, got {groups!r}")
    num_pages = checks.host_int(num_pages, "num_pages", "init_state", 1)
    max_seqs = checks.host_int(max_seqs, "max_seqs", "init_state", 1)
    page = config.page_size
    max_pages_per_seq = num_pages if max_pages_per_seq is None else max_pages_per_seq
    max_pages_per_seq = checks.host_int(max_pages_per_seq, "max_pages_per_seq", "init_state", 1,
                                        checks.INT32_MAX // page + 1)
    hp_per_seq = config.num_high_pages_per_seq
    num_high_pages = max_seqs * hp_per_seq if num_high_pages is None else num_high_pages
    num_high_pages = checks.host_int(num_high_pages, "num_high_pages", "init_state", 0)
    _check_groups(config, groups, num_high_pages)
    _check_init_scales(gs, high_scale, groups)
    _check_order(page_order, num_pages, "page_order")
    _check_order(high_page_order, max(num_high_pages, 1), "high_page_order")
    kinds = tuple(g.resolved_kind(config) for g in groups)
    gss = gs if isinstance(gs, (list, tuple)) else [gs] * len(groups)
    fill = float("nan") if poison else None
    shards = 1 if mesh is None else mesh.shape["tp"]
    pools = []
    for spec, kind, g in zip(groups, kinds, gss):
        low = _low_pool(num_pages, spec, page, poison, g, shards) if kind in ("mixed", "low") else None
        high = (_row_pool(spec.num_layers, max(num_high_pages, 1), spec, page, config.high_dtype, fill, high_scale,
                          shards) if kind == "mixed" and hp_per_seq else None)
        plain = (_row_pool(spec.num_layers, num_pages, spec, page, config.high_dtype or config.attention_dtype,
                           fill, high_scale, shards) if kind == "plain" else None)
        pools.append(GroupPools(low, high, plain))
    state = CacheState(
        config=config, groups=groups, kinds=kinds, pools=tuple(pools),
        page_table=jnp.full((max_seqs, max_pages_per_seq), -1, jnp.int32),
        high_table=jnp.full((max_seqs, hp_per_seq), -1, jnp.int32),
        kv_lens=jnp.zeros((max_seqs,), jnp.int32), active=jnp.zeros((max_seqs,), bool),
        written=jnp.zeros((max_seqs,), jnp.int32), floor=jnp.zeros((max_seqs,), jnp.int32),
        step_lo=jnp.full((max_seqs,), -1, jnp.int32),
        step_layers=jnp.zeros((max_seqs, layer_offsets(groups)[-1]), bool),
        alloc=new_allocator(num_pages, page_order), high_alloc=new_allocator(max(num_high_pages, 1), high_page_order),
        error=_order_error(page_order, num_pages) | _order_error(high_page_order, max(num_high_pages, 1)),
        k_means=(tuple(jnp.zeros((g.num_layers, max_seqs, g.num_kv_heads, g.head_dim), jnp.float32) for g in groups)
                 if config.k_smoothing else None))
    if mesh is not None:
        from .placement import shard_state
        state = shard_state(state, mesh)
    return state


def _check_groups(config: KVCacheConfig, groups, num_high_pages: int) -> None:
    """Refuse at construction what the first append would: a Hadamard rotation of a head_dim that is not a power
    of two, a K-smoothed MLA latent group, and a mixed group with no twin page to admit a sequence into."""
    for g in groups:
        if config.k_smoothing and g.kv_factor == 1:
            raise ValueError(f"init_state: k_smoothing=True on group {g.name!r}, an MLA latent (kv_factor=1): the "
                             f"latent is both key and value, so a shifted key would shift the output")
        if config.rotation == "hadamard" and g.head_dim & (g.head_dim - 1):
            raise ValueError(f"init_state: rotation='hadamard' needs a power-of-two head_dim; group {g.name!r} has "
                             f"head_dim={g.head_dim}")
        if (g.resolved_kind(config) == "mixed" and config.num_high_pages_per_seq
                and num_high_pages < config.num_high_pages_per_seq):
            raise ValueError(f"init_state: num_high_pages={num_high_pages} cannot hold one sequence's twin "
                             f"({config.num_high_pages_per_seq} pages: first_n / last_n window) for mixed group "
                             f"{g.name!r}")


def _check_init_scales(gs, high_scale, groups):
    """gs / high_scale: finite and > 0 (a scale of 0 reads every row back as 0; NaN poisons every row)."""
    gss = list(gs) if isinstance(gs, (list, tuple)) else [gs]
    if isinstance(gs, (list, tuple)) and len(gss) != len(groups):
        raise ValueError(f"init_state: gs is a list of {len(gss)} entries for {len(groups)} groups")
    for name, vals in (("gs", gss), ("high_scale", [high_scale])):
        for v in vals:
            if checks.is_traced(v):
                continue                                    # traced scales: the caller's responsibility
            a = np.asarray(v, np.float64)
            if a.size == 0 or not np.all(np.isfinite(a)) or not np.all(a > 0):
                raise ValueError(f"init_state: {name} must be finite and > 0, got {np.ravel(a)[:8].tolist()}")


def _check_order(order, count, name):
    """A free-stack order must be a permutation of range(count): duplicates would hand one page to two users."""
    if order is None:
        return
    if checks.is_traced(order):
        return                                  # checked inside jit: init_state flags ERR_BAD_PAGE (_order_error)
    a = np.asarray(order)
    if a.shape != (count,) or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"init_state: {name} must be an integer permutation of range({count}), got "
                         f"{a.dtype}{list(a.shape)}")
    if not np.array_equal(np.sort(a), np.arange(count)):
        vals, counts = np.unique(a, return_counts=True)
        dup = vals[counts > 1]
        out = a[(a < 0) | (a >= count)]
        what = (f"duplicate ids {dup[:8].tolist()}" if dup.size else f"ids out of range {out[:8].tolist()}")
        raise ValueError(f"init_state: {name} must be a permutation of range({count}): {what}")


def _order_error(order, count):
    """ERR_BAD_PAGE unless a (traced) free-stack order is a permutation of range(count)."""
    if order is None or not checks.is_traced(order):
        return jnp.int32(0)
    o = jnp.asarray(order, jnp.int32).reshape(-1)
    ok = (o.shape[0] == count) and jnp.all(jnp.sort(o) == jnp.arange(count, dtype=jnp.int32))
    return jnp.where(ok, 0, ERR_BAD_PAGE).astype(jnp.int32)


def _slot(state: CacheState, seq_slot, op: str = "transition"):
    """(clipped slot, in range, is the -1 "none" sentinel). Host values outside [-1, max_seqs) raise."""
    slot = checks.check_slot_arg(seq_slot, state.max_seqs, "seq_slot", op)
    return checks.slot_in_range(slot, state.max_seqs)


def _fresh_steps(state: CacheState, slot, length=0) -> dict:
    """The rewind bookkeeping of a slot that holds ``length`` rows no rewind may drop: ``written = floor =
    length``, no open step."""
    return dict(written=state.written.at[slot].set(length), floor=state.floor.at[slot].set(length),
                step_lo=state.step_lo.at[slot].set(-1), step_layers=state.step_layers.at[slot].set(False),
                k_means=_slot_means(state, slot, None))


def _slot_means(state: CacheState, slot, src):
    """``state.k_means`` with slot ``slot``'s means zeroed (``src`` None) or copied from slot ``src``."""
    if state.k_means is None:
        return None
    return tuple(m.at[:, slot].set(0.0 if src is None else m[:, src]) for m in state.k_means)


def admit(state: CacheState, seq_slot) -> CacheState:
    """Admit an empty sequence into ``seq_slot`` (traced int; -1 = no-op): allocates its F + R high pages.

    An out-of-range or already-admitted slot sets ``ERR_BAD_SLOT`` (host ints outside [-1, max_seqs) raise
    `ValueError`); too few high pages ``ERR_HIGH_OOM``; either way nothing changes."""
    slot, in_range, none = _slot(state, seq_slot, "admit")
    free_slot = in_range & ~state.active[slot]
    need = jnp.broadcast_to(free_slot, state.high_table.shape[1:])
    high_alloc, ids, ok = allocate_mask(state.high_alloc, need)
    ok = ok & free_slot
    err = jnp.where(none, 0, jnp.where(free_slot, jnp.where(ok, 0, ERR_HIGH_OOM), ERR_BAD_SLOT))
    new = dataclasses.replace(
        state, high_table=state.high_table.at[slot].set(ids), kv_lens=state.kv_lens.at[slot].set(0),
        page_table=state.page_table.at[slot].set(-1), active=state.active.at[slot].set(True),
        high_alloc=high_alloc, **_fresh_steps(state, slot))
    out = checks.select_if(ok, new, state)
    return dataclasses.replace(out, error=state.error | err)


def release(state: CacheState, seq_slot) -> CacheState:
    """Release ``seq_slot`` (-1 = no-op): every low and high page loses a reference (freed at zero).

    Releasing a slot that is not admitted or out of range sets ``ERR_BAD_SLOT`` and changes nothing."""
    slot, in_range, none = _slot(state, seq_slot, "release")
    ok = in_range & state.active[slot]
    new = dataclasses.replace(
        state, alloc=release_pages(state.alloc, state.page_table[slot]),
        high_alloc=release_pages(state.high_alloc, state.high_table[slot]),
        page_table=state.page_table.at[slot].set(-1), high_table=state.high_table.at[slot].set(-1),
        kv_lens=state.kv_lens.at[slot].set(0), active=state.active.at[slot].set(False),
        **_fresh_steps(state, slot))
    out = checks.select_if(ok, new, state)
    return dataclasses.replace(out, error=state.error | jnp.where(ok | none, 0, ERR_BAD_SLOT))


def _write_errors(state: CacheState, seq, pos, layer_ok):
    """Every refusal of an append, before anything is allocated: ``(err i32[], first i32[S], last i32[S])``.

    ``seq`` / ``pos`` i32[T] as given (``seq == -1`` = padding). Checks slots (range, admitted), the layer,
    the position rule of `jmixedkv.checks`, the page-table width, and writes into shared low / twin pages."""
    cfg = state.config
    page, (num_seqs, max_pages) = state.page_size, state.page_table.shape
    pad = seq == -1
    s, in_range, _ = checks.slot_in_range(seq, num_seqs)
    bad_slot = jnp.any(~pad & ~(in_range & state.active[s]))
    live = in_range & ~bad_slot                              # per token; all False when any slot is bad
    seq_l = jnp.where(live, seq, -1)
    bad_pos, first, last = checks.append_position_errors(seq_l, pos, state.kv_lens, num_seqs)
    q = jnp.maximum(pos, 0) // page
    too_long = jnp.any(live & (pos >= 0) & (q >= max_pages))
    # shared pages: a held low page or twin page whose refcount > 1 (fork / prefix / index reference)
    qc = jnp.clip(q, 0, max_pages - 1)
    low_pg = state.page_table[s, qc]
    low_shared = live & (q < max_pages) & (low_pg >= 0) & (state.alloc.refcount[jnp.maximum(low_pg, 0)] > 1)
    if state.high_table.shape[1]:
        hp, held = cfg.twin.twin_page(state.high_table, s, cfg.twin.high_column(jnp.maximum(pos, 0)))
        high_shared = live & held & (state.high_alloc.refcount[jnp.maximum(hp, 0)] > 1)
    else:
        high_shared = jnp.zeros_like(live)
    shared = jnp.any(low_shared | high_shared)
    err = (jnp.where(bad_slot, ERR_BAD_SLOT, 0) | jnp.where(~layer_ok, ERR_BAD_LAYER, 0)
           | jnp.where(bad_pos & ~bad_slot, ERR_BAD_POSITION, 0) | jnp.where(too_long, ERR_TOO_LONG, 0)
           | jnp.where(shared, ERR_SHARED_PAGE, 0))
    return err.astype(jnp.int32), first, last


def _ensure_pages(state: CacheState, seq, pos, pre_ok):
    """Allocate low pages for every (seq, page) the tokens touch (only when ``pre_ok``). Returns (state', ok, err)."""
    page, (num_seqs, max_pages) = state.page_size, state.page_table.shape
    valid = (seq >= 0) & (pos >= 0) & pre_ok
    q = pos // page
    touched = jnp.zeros((num_seqs, max_pages), bool).at[
        jnp.where(valid, seq, num_seqs), jnp.clip(q, 0, max_pages - 1)].set(True, mode="drop")
    need = touched & (state.page_table < 0)
    alloc, ids, ok = allocate_mask(state.alloc, need)
    err = jnp.where(pre_ok & ~ok, ERR_LOW_OOM, 0)
    ok = ok & pre_ok
    page_table = jnp.where(need & ok, ids, state.page_table)
    return dataclasses.replace(state, alloc=alloc, page_table=page_table), ok, err


def write_slots(state: CacheState, seq, pos):
    """(low_slot, high_slot) i32[T] for tokens (seq, pos), after their pages are allocated.

    Ring rows that a later token of the same call overwrites are dropped from the high store, so one call never
    writes a high row twice."""
    twin = state.config.twin
    low_slot = layout.low_slots(state.page_table, seq, pos, twin.page)
    keep = twin.write_mask(seq, pos, state.max_seqs) & (low_slot >= 0)
    return low_slot, twin.high_slots(state.high_table, seq, pos, write_mask=keep)


def _check_v(k, v, spec: GroupSpec):
    if spec.kv_factor == 1 and v is not None:
        raise ValueError(f"group {spec.name!r} stores an MLA latent (kv_factor=1): pass v=None")
    if spec.kv_factor == 2 and (v is None or v.shape != k.shape):
        raise ValueError(f"group {spec.name!r} needs v with k's shape {k.shape}, got "
                         f"{None if v is None else v.shape}")
    if v is not None and not jnp.issubdtype(v.dtype, jnp.floating):
        raise ValueError(f"append: v must be a float array, got {v.dtype}")


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


def append(state: CacheState, layer, k, v, seq_slots, positions, group: int = 0, rope: Optional[RopeSpec] = None,
           backend: str = "auto", donate: bool = False) -> CacheState:
    """Append new K/V rows (a ragged prefill chunk, or a decode / verify step) for one layer or all layers.

    Jitted (``group``, ``rope``, ``backend`` static; ``layer`` traced, so layers share one compilation); inside
    another jit it is inlined.

    Args:
      layer: int or i32[] (traced), or None for all layers of the group.
      k, v: ``[T, H, D]`` (``layer`` given) or ``[L, T, H, D]`` (``layer=None``); ``v=None`` for an MLA latent
        group. Any float dtype; RoPE (if ``rope``) is applied to ``k`` here.
      seq_slots: i32[T] sequence slot of each token (-1 = padding, skipped).
      positions: i32[T] position of each token in its sequence.
      group: index of the layer group (static).
      rope: optional `RopeSpec` applied to K before both stores.
      backend: ``"auto"`` (Pallas on GPU), ``"reference"`` or ``"pallas"``.
      donate: donate ``state`` (its pools update in place; the caller must not use the old state again).

    Positions follow the rule of `jmixedkv.checks`: per slot contiguous ``[p0, p1]`` with
    ``p0 <= kv_len <= p1 + 1`` (an extension from ``kv_len``, or a rewrite of a suffix reaching it, e.g. the
    next layer of the same tokens). New low pages are allocated as sequences cross page boundaries;
    ``kv_lens`` becomes ``p1 + 1``. All-or-nothing: on any error (``ERR_BAD_SLOT``, ``ERR_BAD_LAYER``,
    ``ERR_BAD_POSITION``, ``ERR_TOO_LONG``, ``ERR_SHARED_PAGE``, ``ERR_LOW_OOM``) nothing is written and every
    leaf but ``error`` is unchanged. Host (non-JAX) slots / positions / layer are range-checked first
    (`ValueError`).

    With ``k_smoothing`` (`jmixedkv.levers.smooth_rows`): RoPE and the rotation are applied here, a slot whose
    tokens in this call start at position 0 (its prefill or first chunk, for the layers written) takes their mean
    as its frozen ``k_means`` entry, and every key is stored as ``k - mean``.
    """
    spec = checks.check_group(state, group, "append")
    seq = checks.index_array(seq_slots, "seq_slots", "append", -1, state.max_seqs, host=not checks.is_jax(seq_slots))
    pos = checks.index_array(positions, "positions", "append", host=not checks.is_jax(positions))
    if seq.shape != pos.shape or seq.ndim != 1:
        raise ValueError(f"append: seq_slots and positions must be equal-length vectors, got {seq.shape}, {pos.shape}")
    if not checks.is_jax(seq_slots) and not checks.is_jax(positions):
        s_, p_ = np.asarray(seq), np.asarray(pos)
        neg = np.flatnonzero((s_ >= 0) & (p_ < 0))
        if neg.size:
            raise ValueError(f"append: positions[{neg[0]}]={p_[neg[0]]} is negative (slot {s_[neg[0]]})")
    layer = checks.check_layer_arg(layer, spec.num_layers, "append", spec.name)
    _check_rows(k, spec, layer, seq.shape[0])
    _check_v(k, v, spec)
    return (_append_donated if donate else _append_jit)(state, layer, k, v, seq, pos, group=group, rope=rope,
                                                         backend=backend)


def _append(state: CacheState, layer, k, v, seq, pos, group, rope, backend) -> CacheState:
    layer_c, layer_ok = checks.layer_in_range(layer, state.groups[group].num_layers)
    err, first, last = _write_errors(state, seq, pos, layer_ok)
    state, ok, oom = _ensure_pages(state, seq, pos, err == 0)
    err = err | oom
    seq = jnp.where(ok, seq, -1)
    low_slot, high_slot = write_slots(state, seq, pos)
    k_means = state.k_means
    if k_means is not None:             # the lever: RoPE, rotation, mean (a slot's call from position 0), shift
        k, v, means = levers.smooth_rows(state.config.rotation, k_means[group], layer_c, k, v, seq, pos,
                                         first == 0, rope)
        k_means = k_means[:group] + (jnp.where(ok, means, k_means[group]),) + k_means[group + 1:]
        rope = None
    pools = write_rows(state, layer_c, k, v, pos, low_slot, high_slot, group=group, rope=rope, backend=backend,
                       transformed=k_means is not None)
    has = ok & (last >= 0)
    step_lo, step_layers = _track_step(state, group, layer_c, has, first, last)
    new_pools = state.pools[:group] + (pools,) + state.pools[group + 1:]
    return dataclasses.replace(state, pools=new_pools, **_lengths(state, has, last), step_lo=step_lo,
                               step_layers=step_layers, error=state.error | err, k_means=k_means)


def _lengths(state: CacheState, has, last) -> dict:
    """``kv_lens`` / ``written`` / ``floor`` after an append of rows up to ``last`` i32[S] to the slots ``has``."""
    return dict(kv_lens=jnp.where(has, last + 1, state.kv_lens),
                written=jnp.where(has, jnp.maximum(state.written, last + 1), state.written),
                floor=jnp.where(has, jnp.maximum(state.floor, last + 1 - state.config.max_draft_len), state.floor))


def _step_change(state: CacheState, has, first, last):
    """``(opens, covers)`` bool[S] of an append of rows ``[first, last]`` (``has``): it opens a new step (rows past
    ``kv_len``), or rewrites the whole open step (`_track_step`)."""
    opens = has & (last + 1 > state.kv_lens)
    return opens, has & ~opens & (state.step_lo >= 0) & (first <= state.step_lo)


def _track_step(state: CacheState, group: int, layer, has, first, last):
    """(step_lo i32[S], step_layers bool[S, L]) after an append of rows ``[first, last]`` per slot (``has``).

    A call that writes rows past ``kv_len`` opens a new step ``[first, last + 1)`` held by this call's layers; a
    rewrite covering the open step (``first <= step_lo``, ``last + 1 == kv_len``) adds its layers; any other
    rewrite changes nothing."""
    offs = state.layer_offsets
    cols = jnp.arange(offs[-1])
    lo, hi = offs[group], offs[group + 1]
    mine = (cols >= lo) & (cols < hi) if layer is None else cols == lo + jnp.asarray(layer, jnp.int32)
    opens, covers = _step_change(state, has, first, last)
    step_lo = jnp.where(opens, first, state.step_lo)
    step_layers = jnp.where(opens[:, None], mine[None, :],
                            state.step_layers | (covers[:, None] & mine[None, :]))
    return step_lo, step_layers


_append_jit = jax.jit(_append, static_argnames=("group", "rope", "backend"))
_append_donated = jax.jit(_append, static_argnames=("group", "rope", "backend"), donate_argnums=0)


def append_traced(state: CacheState, layer, k, v, seq, pos, *, group: int = 0, rope: Optional[RopeSpec] = None,
                  backend: str = "auto") -> CacheState:
    """`append`'s transition without its host checks, for a caller's own jitted program (`jmixedkv.step`):
    ``layer`` / ``seq`` / ``pos`` may be traced; bad values set ``state.error`` with every sequence unchanged."""
    return _append(state, layer, k, v, seq, pos, group, rope, backend)


@pytree()
class AppendPlan:
    """One append step's targets, made once for every layer of a group (`plan_append_traced`) and read by each
    layer's `write_layer_traced`. ``seq`` / ``pos`` / ``low_slot`` / ``high_slot`` i32[T] (slot -1: padding, or
    every token of a refused step); ``fresh`` bool[S] slots whose rows start at position 0 (K smoothing takes
    their mean); ``marks`` bool[S] slots whose step the layers record in ``step_layers``; ``ok`` bool[] the step
    was accepted."""

    seq: jax.Array
    pos: jax.Array
    low_slot: jax.Array
    high_slot: jax.Array
    fresh: jax.Array
    marks: jax.Array
    ok: jax.Array


def plan_append_traced(state: CacheState, seq, pos, *, group: int = 0):
    """The per-step half of `append` for an engine whose every layer appends the same tokens (`jmixedkv.step`):
    ``(state, AppendPlan)``. Every refusal, the page allocation and the length bookkeeping (``kv_lens``,
    ``written``, ``floor``, ``step_lo``) happen here once; each layer then only stores its rows
    (`write_layer_traced`). Applying the plan and then `write_layer_traced` for layers ``l_1, l_2, ...`` leaves the
    state `append_traced` for those layers would, bit for bit. A refused step sets ``state.error`` with every
    sequence unchanged, and its plan writes nothing. Pools are not touched (`tables_only`)."""
    err, first, last = _write_errors(state, seq, pos, jnp.bool_(True))
    state, ok, oom = _ensure_pages(state, seq, pos, err == 0)
    err = err | oom
    seq = jnp.where(ok, seq, -1)
    low_slot, high_slot = write_slots(state, seq, pos)
    has = ok & (last >= 0)
    opens, covers = _step_change(state, has, first, last)   # an opened step is recorded by no layer yet
    new = dataclasses.replace(state, **_lengths(state, has, last), step_lo=jnp.where(opens, first, state.step_lo),
                              step_layers=jnp.where(opens[:, None], False, state.step_layers),
                              error=state.error | err)
    return new, AppendPlan(seq, pos, low_slot, high_slot, first == 0, opens | covers, ok)


def write_layer_traced(state: CacheState, layer, k, v, plan: AppendPlan, *, group: int = 0,
                       rope: Optional[RopeSpec] = None, backend: str = "auto") -> CacheState:
    """The per-layer half of `append` (after `plan_append_traced`): store ``k, v [T, H, D]`` of ``layer`` (may be
    traced) at the plan's targets and record the layer in ``step_layers``. Changes only the group's pools, its K
    means (K smoothing), ``step_layers`` and ``error``. A ``layer`` outside the group sets ``ERR_BAD_LAYER`` and
    stores nothing (the plan's lengths stand: range-check layers on the host, as `interop.TorchKVCache` does).
    ``layer=None``: every layer of the group at once, ``k, v [L, T, H, D]`` (one store for the whole step; what the
    layers one by one leave, bit for bit; not with K smoothing, whose means are per layer)."""
    if layer is None:
        return _write_all_layers(state, k, v, plan, group, rope, backend)
    layer_c, layer_ok = checks.layer_in_range(layer, state.groups[group].num_layers)
    seq = jnp.where(layer_ok, plan.seq, -1)
    low_slot, high_slot = jnp.where(layer_ok, plan.low_slot, -1), jnp.where(layer_ok, plan.high_slot, -1)
    k_means = state.k_means
    if k_means is not None:
        k, v, means = levers.smooth_rows(state.config.rotation, k_means[group], layer_c, k, v, seq, plan.pos,
                                         plan.fresh, rope)
        k_means = k_means[:group] + (jnp.where(plan.ok & layer_ok, means, k_means[group]),) + k_means[group + 1:]
        rope = None
    pools = write_rows(state, layer_c, k, v, plan.pos, low_slot, high_slot, group=group, rope=rope,
                       backend=backend, transformed=k_means is not None)
    col = state.layer_offsets[group] + layer_c
    step_layers = state.step_layers.at[:, col].set(state.step_layers[:, col] | (plan.marks & layer_ok))
    return dataclasses.replace(state, pools=state.pools[:group] + (pools,) + state.pools[group + 1:],
                               step_layers=step_layers, k_means=k_means,
                               error=state.error | jnp.where(layer_ok, 0, ERR_BAD_LAYER).astype(jnp.int32))


def _write_all_layers(state: CacheState, k, v, plan: AppendPlan, group: int, rope, backend) -> CacheState:
    if state.k_means is not None:
        raise ValueError("write_layer_traced: layer=None (every layer at once) does not take K smoothing, whose "
                         "means are per layer; write the layers one by one")
    pools = write_rows(state, None, k, v, plan.pos, plan.low_slot, plan.high_slot, group=group, rope=rope,
                       backend=backend)
    lo, hi = state.layer_offsets[group], state.layer_offsets[group + 1]
    step_layers = state.step_layers.at[:, lo:hi].set(state.step_layers[:, lo:hi] | plan.marks[:, None])
    return dataclasses.replace(state, pools=state.pools[:group] + (pools,) + state.pools[group + 1:],
                               step_layers=step_layers)


def _tables(state, ok, **new):
    """Apply table / allocator updates only where ``ok`` (pools are never selected: no copies)."""
    return dataclasses.replace(state, **{k: checks.select_if(ok, v, getattr(state, k)) for k, v in new.items()})


def fork(state: CacheState, src, dst) -> CacheState:
    """Fork sequence ``src`` into the empty slot ``dst`` (beam search / parallel sampling).

    Copy-on-write is tied to the rewind bound: the low pages and fixed high pages wholly below ``src``'s rewind
    floor (`fork_shares`: no legal rewind of either sequence writes them again) are shared by reference; every
    other low page holding rows ``< kv_len`` (the partial last page, and the pages a rewind of up to
    ``max_draft_len`` can rewrite), every other held fixed high page and every ring page are copied into fresh
    pages. ``dst`` gets ``src``'s length, rewind bookkeeping and reads exactly what ``src`` reads. -1 for either
    slot is a no-op. Errors: ``ERR_BAD_SLOT`` (a slot out of range, src not active, dst active or equal),
    ``ERR_LOW_OOM`` / ``ERR_HIGH_OOM``; on error nothing changes but ``state.error``. Host slots outside
    [-1, max_seqs) raise `ValueError`."""
    cfg, page = state.config, state.page_size
    nf, width = cfg.num_fixed_pages, state.high_table.shape[1]
    src, src_in, src_none = checks.slot_in_range(checks.check_slot_arg(src, state.max_seqs, "src", "fork"),
                                                 state.max_seqs)
    dst, dst_in, dst_none = checks.slot_in_range(checks.check_slot_arg(dst, state.max_seqs, "dst", "fork"),
                                                 state.max_seqs)
    none = src_none | dst_none
    ok_slots = src_in & dst_in & state.active[src] & ~state.active[dst] & (src != dst) & ~none
    n = state.kv_lens[src]
    row = state.page_table[src]
    cols = jnp.arange(state.max_pages_per_seq, dtype=jnp.int32)
    share_low = fork_shares(state.floor[src], page, state.max_pages_per_seq) & (row >= 0)
    copy_low = ~share_low & (row >= 0) & (cols * page < n)
    alloc, new_low, ok_low = allocate_mask(state.alloc, copy_low & ok_slots)
    hrow = state.high_table[src]
    hcols = jnp.arange(width, dtype=jnp.int32)
    share_high = fork_shares(state.floor[src], page, width) & (hcols < nf) & (hrow >= 0)
    copy_high = ~share_high & (hrow >= 0)
    high_alloc, new_high, ok_high = allocate_mask(state.high_alloc, copy_high & ok_slots)
    ok = ok_slots & ok_low & ok_high
    alloc = retain_pages(alloc, jnp.where(share_low & ok, row, -1))
    high_alloc = retain_pages(high_alloc, jnp.where(share_high & ok, hrow, -1))
    dst_row = jnp.where(share_low, row, jnp.where(copy_low, new_low, -1))
    dst_hrow = jnp.where(share_high, hrow, jnp.where(copy_high, new_high, -1))
    err = jnp.where(none, 0, jnp.where(ok_slots, jnp.where(ok_low, 0, ERR_LOW_OOM)
                                       | jnp.where(ok_high, 0, ERR_HIGH_OOM), ERR_BAD_SLOT))
    copy = {f: getattr(state, f).at[dst].set(getattr(state, f)[src])
            for f in ("kv_lens", "written", "floor", "step_lo", "step_layers")}
    out = _tables(state, ok, alloc=alloc, high_alloc=high_alloc,
                  page_table=state.page_table.at[dst].set(dst_row),
                  high_table=state.high_table.at[dst].set(dst_hrow),
                  active=state.active.at[dst].set(True), k_means=_slot_means(state, dst, src), **copy)
    # the fresh destination pages are held once (allocated above): copy_pages' checks pass whenever ok
    src_l, dst_l = jnp.where(copy_low & ok, row, -1), jnp.where(copy_low & ok, new_low, -1)
    src_h, dst_h = jnp.where(copy_high & ok, hrow, -1), jnp.where(copy_high & ok, new_high, -1)
    payload = gather_pages(out, src_l, src_h)
    out = scatter_pages(out, dst_l, dst_h, payload)
    return dataclasses.replace(out, error=state.error | err)


def fork_pages_needed(state: CacheState, src: int) -> tuple:
    """Host mirror of `fork`'s allocation: ``(low, high)`` fresh pages a fork of ``src`` takes (host int slot)."""
    page, nf = state.page_size, state.config.num_fixed_pages
    row, hrow = np.asarray(state.page_table[src]), np.asarray(state.high_table[src])
    floor, n = int(np.asarray(state.floor[src])), int(np.asarray(state.kv_lens[src]))
    cols = np.arange(row.shape[0])
    share = fork_shares(floor, page, row.shape[0], np)
    low = int(np.sum(~share & (row >= 0) & (cols * page < n)))
    hshare = fork_shares(floor, page, hrow.shape[0], np) & (np.arange(hrow.shape[0]) < nf)
    return low, int(np.sum(~hshare & (hrow >= 0)))
