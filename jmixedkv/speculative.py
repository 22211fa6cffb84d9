"""Speculative decoding as pure state transitions: draft layers, verify / accept, the overlap scheduler's
device-side length correction, page trimming, and the draft swap (twin off during a draft forward, back after).

Linear drafts only (MTP, NGram, Eagle one-model). One step, for a sequence of corrected length ``n0``:

1. **verify**: `jmixedkv.append` writes ``k + 1`` rows at positions ``n0 .. n0 + k``: row ``n0`` is the verified
   input token (the bonus token the target sampled last step, whose KV is not yet cached) and rows
   ``n0 + 1 .. n0 + k`` are the ``k`` drafts. Afterwards ``kv_len = n0 + k + 1`` (as if every draft were accepted).
2. **accept** ``a`` drafts (``0 <= a <= k``): ``kv_len = n0 + 1 + a`` -- the verified input token plus the accepted
   drafts. The new bonus token is *not* cached: it is row 0 of the next step's append. Equivalently
   `correct_kv_lens` with offset ``a - k <= 0`` (the overlap scheduler's form: the host staged full-acceptance
   lengths, the device adds the non-positive offset once the accepted counts are known).

Every reader follows the corrected device length (``state.kv_lens``): `rows_reference` / `stage_reference`, the
stage / gather / fused-decode kernels, the last-N window (retained set ``[n - last_n, n)``) and the next append
(which writes from position ``n`` on and sets ``kv_len = max(kv_len, last + 1)``). Rows of rejected drafts stay
in the pools past ``n``; nobody reads them, and the next append overwrites them (low pool by page id, twin by ring
slot). The twin's ring has ``R = ceil((last_n + max_draft_len) / page) + 1`` pages indexed by ``(p // page) mod R``,
so a rewind of up to ``max_draft_len`` never loses a retained row: the oldest row a later writer can clobber is
``R * page > last_n + max_draft_len`` positions behind it. The state enforces this: ``state.floor``
(``max(written - max_draft_len, 0)``, ``written`` one past the highest row written since admit, never below a
reused prefix) bounds every correction, so rewinds never accumulate past the ring's slack; a rewind waits until
every layer of a group wrote the open step, and `accept` rewinds only right after a verify block of exactly
``k + 1`` rows (``state.step_lo`` / ``step_layers``; `jmixedkv.checks`).

Pages: `accept` / `correct_kv_lens` **keep** low pages allocated for rejected drafts past a page boundary (the
next step writes there again, and under the overlap scheduler the host has already staged page tables assuming
full acceptance, so freeing them on the device would race the next step). `trim` releases, as a separate
transition, every low page wholly past ``ceil(n / page)`` (one reference each; shared pages survive).

Draft swap: `draft_view` switches the twin off by state (mixed groups become NVFP4-only ``"low"`` groups: no
retained-row store, no overlay, an empty twin page table); `restore` puts the target's twin back. No hooks.
A separate draft state (`draft_config`) has no twin at all; apply the same `accept` / `correct_kv_lens` to it.

Dynamic-tree drafting is rejected: it relocates accepted KV rows inside the pools after verification, so
neither the twin nor a linear rewind can follow.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from .allocator import release_pages
from .config import KVCacheConfig
from .pools import GroupPools
from . import checks as _checks
from . import state as _state
from .state import CacheState, GroupSpec

__all__ = ["ERR_BAD_CORRECTION", "draft_config", "draft_dtype", "draft_group_spec", "verify_tokens",
           "correct_kv_lens", "accept", "offset_positions", "trim", "draft_view", "restore", "check_linear_drafts"]

ERR_BAD_CORRECTION = _state.ERR_BAD_CORRECTION  # positive offset, rewind past max_draft_len / below 0, idle slot

_TREE_WHY = ("dynamic-tree drafting relocates accepted KV rows inside the pools after verification; the "
             "high-precision twin and the last-N ring cannot follow relocated rows, and accept/correct_kv_lens only "
             "rewind a linear suffix. Use a linear drafter (mtp, ngram, eagle one-model)")


def check_linear_drafts(config: KVCacheConfig, draft_tree=None, what: str = "speculative") -> None:
    """Raise `ValueError` if ``config`` or the caller asks for tree drafts (``draft_tree`` not None)."""
    if config.speculative_mode == "dynamic_tree" or draft_tree is not None:
        src = "speculative_mode='dynamic_tree'" if draft_tree is None else "a draft tree (draft_tree=...)"
        raise ValueError(f"{what}: {src} is not supported: {_TREE_WHY}")


def _is_concrete(*xs) -> bool:
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


# ---------------------------------------------------------------------------------------------- draft layers
def draft_dtype(target: KVCacheConfig) -> str:
    """Draft cache dtype string (TensorRT-LLM `_util.py` rule): ``"fp8"`` for FP8 targets (``mixed_nvfp4_fp8``,
    ``fp8``), else the model (attention) dtype -- never NVFP4."""
    if target.dtype in ("mixed_nvfp4_fp8", "fp8"):
        return "fp8"
    name = jnp.dtype(target.attention_dtype).name
    if name == "bfloat16":
        return "bf16"
    if name == "float16":
        return "fp16"
    raise ValueError(f"draft_dtype: target dtype={target.dtype!r} with attention dtype {name!r} has no plain draft "
                     f"cache dtype (bf16, fp16 or fp8)")


def draft_config(target: KVCacheConfig) -> KVCacheConfig:
    """Config of a separate draft state: plain pool in `draft_dtype`, no twin, same page size / draft length."""
    check_linear_drafts(target, what="draft_config")
    return KVCacheConfig(dtype=draft_dtype(target), page_size=target.page_size, max_draft_len=target.max_draft_len,
                         speculative_mode=target.speculative_mode, compute_dtype=target.compute_dtype)


def draft_group_spec(config: KVCacheConfig, num_layers: int, num_kv_heads: int, head_dim: int, kv_factor: int = 2,
                     name: str = "draft") -> GroupSpec:
    """`GroupSpec(kind="plain")` for draft layers, either appended to a target state built with ``config`` (their
    pool is a `RowPool` in the config's high dtype: bf16 / fp16, fp8 for ``mixed_nvfp4_fp8``) or in a separate
    state built with `draft_config` (``config`` is then the target's config or the draft config)."""
    check_linear_drafts(config, what="draft_group_spec")
    if config.high_dtype is None:
        raise ValueError(f"draft_group_spec: dtype={config.dtype!r} has no row dtype for appended draft layers; "
                         f"build a separate draft state with draft_config(target) (dtype "
                         f"{draft_dtype(config)!r}) instead")
    return GroupSpec(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, kv_factor=kv_factor,
                     kind="plain", name=name)


# ---------------------------------------------------------------------------------------------- verify
def verify_tokens(state: CacheState, seq_slots, num_tokens: int, offsets=None):
    """Flattened ``(seq i32[B*T], pos i32[B*T])`` for a verify step of ``T = num_tokens = k + 1`` rows per sequence
    at positions ``kv_len .. kv_len + k`` read from the device lengths (``offsets`` i32[S], if given, are added
    first: positions staged before a pending `correct_kv_lens`). ``seq_slots`` i32[B], -1 = padding."""
    check_linear_drafts(state.config, what="verify_tokens")
    seq = _checks.index_array(seq_slots, "seq_slots", "verify_tokens", -1, state.max_seqs, ndim=1)
    lens = state.kv_lens if offsets is None else state.kv_lens + jnp.asarray(offsets, jnp.int32)
    base = lens[jnp.clip(seq, 0, state.max_seqs - 1)]
    pos = base[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
    seq2 = jnp.broadcast_to(seq[:, None], pos.shape)
    return seq2.reshape(-1), jnp.where(seq2 >= 0, pos, -1).reshape(-1)


def offset_positions(positions, seq_slots, offsets):
    """Host-staged positions (full acceptance assumed) corrected on the device: ``positions + offsets[seq]``
    (padding, ``seq < 0``, unchanged). ``offsets`` i32[S] as given to `correct_kv_lens`."""
    seq = _checks.index_array(seq_slots, "seq_slots", "offset_positions")
    off = _checks.index_array(offsets, "offsets", "offset_positions")
    # a slot outside the offsets (bad input) keeps its position: the append that follows refuses it (ERR_BAD_SLOT)
    live = (seq >= 0) & (seq < off.shape[0])
    return jnp.where(live, positions + off[jnp.clip(seq, 0, off.shape[0] - 1)], positions)


# ---------------------------------------------------------------------------------------------- lengths
def correct_kv_lens(state: CacheState, offsets) -> CacheState:
    """Add per-slot offsets ``offsets i32[S] <= 0`` to the device lengths (overlap-scheduler correction).

    Valid offsets keep ``kv_len + offset >= state.floor`` (``max(written - max_draft_len, 0)``, never below a
    reused prefix: rewinds never accumulate past the twin ring's slack nor drop rows no step wrote), are 0 on idle
    slots, and rewind (offset < 0) only a slot whose open append step every layer of a group wrote or none did
    (not between two layers' appends of one verify step). A rewind closes the slot's open step.
    Concrete (non-traced) offsets breaking these rules raise `ValueError` naming the slot; traced ones set
    ``ERR_BAD_CORRECTION`` and change nothing (all-or-nothing). Pages are kept (see `trim`)."""
    check_linear_drafts(state.config, what="correct_kv_lens")
    off = _checks.index_array(offsets, "offsets", "correct_kv_lens")
    if off.shape != state.kv_lens.shape:
        raise ValueError(f"correct_kv_lens: offsets must be i32[{state.max_seqs}] (one per slot), got {off.shape}")
    if _is_concrete(offsets, state.kv_lens, state.active, state.floor, state.step_lo, state.step_layers):
        o, lens = np.asarray(off), np.asarray(state.kv_lens)
        lo = np.asarray(_floor(state.kv_lens, state.active, state.floor)) - lens
        bad = np.flatnonzero((o > 0) | (o < lo))
        if bad.size:
            detail = ", ".join(f"slot {s}: offset {o[s]} (allowed [{lo[s]}, 0])" for s in bad[:8])
            raise ValueError(f"correct_kv_lens: offsets must be <= 0, keep kv_len >= written - max_draft_len "
                             f"({state.config.max_draft_len}), >= 0 and >= a reused prefix's length, and be 0 on "
                             f"idle slots; {detail}")
        part = np.flatnonzero((o < 0) & ~np.asarray(_state.step_complete(state)))
        if part.size:
            raise ValueError(f"correct_kv_lens: slots {part[:8].tolist()} are between two layers' appends of one "
                             f"step (some layers of a group wrote rows [step_lo, kv_len), others not): rewind "
                             f"after every layer appended the step")
    kv_lens, step_lo, error = _apply_offsets(state.kv_lens, state.active, state.floor, state.step_lo,
                                             _state.step_complete(state), state.error, off)
    return dataclasses.replace(state, kv_lens=kv_lens, step_lo=step_lo, error=error)


def _floor(kv_lens, active, floor):
    """Smallest legal corrected length per slot: ``state.floor`` (active), ``kv_len`` (idle)."""
    return jnp.where(active, floor, kv_lens)


@jax.jit
def _apply_offsets(kv_lens, active, floor, step_lo, complete, error, off):
    new = kv_lens + off
    bad = jnp.any((off > 0) | (new < _floor(kv_lens, active, floor)) | ((off < 0) & ~complete))
    step_lo = jnp.where(bad | (off == 0), step_lo, -1)
    return jnp.where(bad, kv_lens, new), step_lo, error | jnp.where(bad, ERR_BAD_CORRECTION, 0)


def accept(state: CacheState, seq_slots, num_accepted, num_drafts, draft_tree=None) -> CacheState:
    """After a verify append of ``num_drafts + 1`` rows per sequence, keep the verified token and the first
    ``num_accepted`` drafts: ``kv_len = n0 + 1 + num_accepted`` (``n0`` = length before the verify append), i.e.
    ``kv_len += num_accepted - num_drafts``.

    Args:
      seq_slots: i32[B] verified sequences (-1 = padding; prefill-chunk sequences of a mixed batch are simply not
        listed, or listed with ``num_drafts = 0``). Slots must be distinct.
      num_accepted: i32[B] or scalar, ``0 <= num_accepted <= num_drafts``.
      num_drafts: int or i32[B], ``k <= max_draft_len``.
    A rewind (``num_accepted < num_drafts``) must be justified by the state: the slot's open append step is the
    verify block, exactly ``k + 1`` rows ``[kv_len - k - 1, kv_len)``, written by every layer of each group that
    wrote it (not a prefill chunk, not between two layers' appends, not accepted already), and the rules of
    `correct_kv_lens` hold. Bad counts, slots or unjustified rewinds raise `ValueError` when concrete; traced ones
    set ``ERR_BAD_CORRECTION`` (counts, unjustified rewinds) / ``ERR_BAD_SLOT`` (slot out of range or repeated)
    and change nothing.
    """
    check_linear_drafts(state.config, draft_tree, what="accept")
    seq = _checks.index_array(seq_slots, "seq_slots", "accept")
    if seq.ndim != 1:
        raise ValueError(f"accept: seq_slots must be i32[B], got shape {seq.shape}")
    a = jnp.broadcast_to(_checks.index_array(num_accepted, "num_accepted", "accept"), seq.shape)
    k = jnp.broadcast_to(_checks.index_array(num_drafts, "num_drafts", "accept"), seq.shape)
    if _is_concrete(seq_slots, num_accepted, num_drafts):
        _check_accept_counts(seq, a, k, state.config.max_draft_len, "accept")
        s_ = np.asarray(seq)
        live = s_ >= 0
        if (len(set(s_[live].tolist())) != int(live.sum()) or (s_[live] >= state.max_seqs).any()
                or (s_ < -1).any()):
            raise ValueError(f"accept: seq_slots must be distinct slots in [0, {state.max_seqs}) or -1, "
                             f"got {s_.tolist()}")
        if _is_concrete(state.kv_lens, state.step_lo):
            _check_accept_step(state, s_, np.asarray(a), np.asarray(k))
    offsets, bad, bad_slot = _accept_offsets(state.max_seqs, state.config.max_draft_len, seq, a, k)
    bad = bad | ~_steps_justify(state, offsets, seq, k)
    offsets = jnp.where(bad | bad_slot, 0, offsets)
    out = correct_kv_lens(state, offsets)
    return dataclasses.replace(out, error=out.error | jnp.where(bad, ERR_BAD_CORRECTION, 0)
                               | jnp.where(bad_slot, _checks.ERR_BAD_SLOT, 0))


def _steps_justify(state: CacheState, offsets, seq, k):
    """bool[]: every listed slot that rewinds (offset < 0) has an open step of exactly ``k + 1`` rows ending at
    its length (its verify block)."""
    num_seqs = state.max_seqs
    live = (seq >= 0) & (seq < num_seqs)
    s = jnp.clip(seq, 0, num_seqs - 1)
    rewinds = live & (offsets[s] < 0)
    block = (state.step_lo[s] >= 0) & (state.kv_lens[s] - state.step_lo[s] == k + 1)
    return ~jnp.any(rewinds & ~block)


def _check_accept_step(state: CacheState, seq, a, k) -> None:
    """Host form of `_steps_justify`: `ValueError` naming the first slot whose rewind no verify block justifies."""
    lens, lo = np.asarray(state.kv_lens), np.asarray(state.step_lo)
    for s, a_, k_ in zip(seq.tolist(), a.tolist(), k.tolist()):
        if s < 0 or a_ >= k_:
            continue
        if lo[s] < 0 or lens[s] - lo[s] != k_ + 1:
            have = "no open append step (admitted, rewound or accepted since)" if lo[s] < 0 else \
                f"the last append step wrote {lens[s] - lo[s]} rows [{lo[s]}, {lens[s]})"
            raise ValueError(f"accept: slot {s}: num_drafts={k_} needs a verify block of {k_ + 1} rows ending at "
                             f"kv_len {lens[s]}, but {have}; rejected drafts can only be dropped right after "
                             f"their verify append")


def _check_accept_counts(seq_slots, num_accepted, num_drafts, max_draft_len: int, what: str) -> None:
    """The accept rule on host values: ``0 <= num_accepted <= num_drafts <= max_draft_len`` on every live row
    (``seq_slots >= 0``), else `ValueError` naming the first bad slot."""
    s_, a_, k_ = np.asarray(seq_slots), np.asarray(num_accepted), np.asarray(num_drafts)
    bad = np.flatnonzero((s_ >= 0) & ((a_ < 0) | (a_ > k_) | (k_ > max_draft_len)))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{what}: need 0 <= num_accepted <= num_drafts <= max_draft_len ({max_draft_len}); slot "
                         f"{s_[i]} has num_accepted={a_[i]}, num_drafts={k_[i]}")


@functools.partial(jax.jit, static_argnums=(0, 1))
def _accept_offsets(num_seqs, max_draft_len, seq, a, k):
    """i32[S] offsets ``a - k`` at the listed slots (0 elsewhere), whether any count was out of range, and whether
    any slot was out of range or listed twice."""
    live = seq >= 0
    bad = jnp.any(live & ((a < 0) | (a > k) | (k > max_draft_len)))
    idx = jnp.where(live, seq, num_seqs)
    count = jnp.zeros((num_seqs,), jnp.int32).at[idx].add(1, mode="drop")
    bad_slot = jnp.any((seq < -1) | (seq >= num_seqs)) | jnp.any(count > 1)
    a = jnp.clip(a, 0, k)
    offsets = jnp.zeros((num_seqs,), jnp.int32).at[idx].set(a - k, mode="drop")
    return offsets, bad, bad_slot


# ---------------------------------------------------------------------------------------------- pages
def trim(state: CacheState, seq_slots=None) -> CacheState:
    """Release low pages wholly past each sequence's length: page ``j`` with ``j * page >= kv_len`` loses one
    reference (freed at zero) and leaves the page table. ``seq_slots`` i32[B] (-1 = padding) or None for every
    slot. Twin pages are per-sequence and fixed (F + R), so they are never trimmed.

    Slots outside [-1, max_seqs) raise `ValueError` (host values) or set ``ERR_BAD_SLOT`` and change nothing.
    ``written`` is kept: the twin ring still holds the rejected rows, so rewinds stay bounded by it."""
    num_seqs = state.max_seqs
    if seq_slots is None:
        sel, bad = jnp.ones((num_seqs,), bool), jnp.bool_(False)
    else:
        seq = _checks.index_array(seq_slots, "seq_slots", "trim", -1, num_seqs, ndim=1)
        sel = jnp.zeros((num_seqs,), bool).at[jnp.where(seq >= 0, seq, num_seqs)].set(True, mode="drop")
        bad = jnp.any((seq < -1) | (seq >= num_seqs))
    sel = sel & ~bad
    alloc, page_table = _trim_pages(state.page_size, state.alloc, state.page_table, state.kv_lens, sel)
    return dataclasses.replace(state, alloc=alloc, page_table=page_table,
                               error=state.error | jnp.where(bad, _checks.ERR_BAD_SLOT, 0))


@functools.partial(jax.jit, static_argnums=0)
def _trim_pages(page, alloc, page_table, kv_lens, sel):
    num_seqs, max_pages = page_table.shape
    keep = -(-kv_lens // page)
    drop = sel[:, None] & (jnp.arange(max_pages)[None, :] >= keep[:, None]) & (page_table >= 0)
    ids = jnp.where(drop, page_table, -1)
    # one row per call: a page shared by two trimmed sequences (fork) then loses both references correctly
    alloc = jax.lax.fori_loop(0, num_seqs, lambda s, al: release_pages(al, ids[s]), alloc)
    return alloc, jnp.where(drop, -1, page_table)


# ---------------------------------------------------------------------------------------------- draft swap
def draft_view(state: CacheState) -> CacheState:
    """The state a draft forward runs on: every mixed group becomes an NVFP4-only ``"low"`` group (its twin pool
    is dropped from the pytree, so no retained-row store and no overlay) and the twin page table is empty
    (``i32[S, 0]``: no page-table fill). Draft (plain) groups, low page tables, lengths and allocators are
    shared. Undo with `restore`."""
    check_linear_drafts(state.config, what="draft_view")
    kinds = tuple("low" if k == "mixed" else k for k in state.kinds)
    pools = tuple(GroupPools(p.low, None, p.plain) if k == "mixed" else p for p, k in zip(state.pools, state.kinds))
    return dataclasses.replace(state, kinds=kinds, pools=pools, high_table=state.high_table[:, :0])


def restore(target_state: CacheState, draft_state: CacheState) -> CacheState:
    """Target state after a draft forward on ``draft_state = f(draft_view(target_state))``.

    Takes from ``draft_state`` what a draft forward may legitimately change -- draft (non-mixed) group pools, the
    low page table and allocator (pages drafts allocated), lengths, ``active`` and the error bits -- and from
    ``target_state`` the twin: every mixed group's pools (bit-for-bit, writes into target layers through the view
    are discarded: the twin would not follow them), the twin page table and its allocator.
    ``restore(s, draft_view(s))`` is ``s`` leaf for leaf."""
    t, d = target_state, draft_state
    if d.config != t.config or d.groups != t.groups:
        raise ValueError("restore: draft_state is not a view of target_state (config or groups differ)")
    want = tuple("low" if k == "mixed" else k for k in t.kinds)
    if d.kinds != want or d.high_table.shape != t.high_table[:, :0].shape:
        raise ValueError(f"restore: draft_state must come from draft_view(target_state); its group kinds are "
                         f"{d.kinds}, expected {want}")
    pools = tuple(tp if k == "mixed" else dp for tp, dp, k in zip(t.pools, d.pools, t.kinds))
    return dataclasses.replace(d, kinds=t.kinds, pools=pools, high_table=t.high_table, high_alloc=t.high_alloc)

