"""Input validation, one implementation for every transition and reader (docs/DESIGN.md, "bad input").

The rule: every slot, layer, page id and position that reaches a transition or a reader is range-checked where
it is used.

* **On the host** (the value is a Python / NumPy value, or a static argument): `ValueError` naming the argument,
  the offending entry and the allowed range, before anything runs. Non-integer index arrays (float, bool) and
  integers outside int32 (they would wrap: ``2**32 + 2`` -> ``2``) are refused here too.
* **Inside jit** (the value is a JAX array, traced or not): a *transition* sets an ``ERR_*`` bit in
  ``state.error`` and leaves every other leaf of the state bitwise unchanged (all-or-nothing); a *reader* returns
  NaN rows / NaN outputs for the batch rows whose slot, layer, length or index is bad (never another sequence's
  data; padding ``-1`` stays zero as before).

Error bits (sticky, OR-ed into ``state.error``; `describe_error` names them)::

    ERR_LOW_OOM        1   not enough free low (history) pages
    ERR_HIGH_OOM       2   not enough free high (twin) pages
    ERR_TOO_LONG       4   a position past max_pages_per_seq * page_size
    ERR_BAD_SLOT       8   slot outside [-1, max_seqs), not admitted, or admitted twice
    ERR_BAD_CORRECTION 16  speculative length correction out of range
    ERR_BAD_LAYER      32  layer index outside [0, num_layers) of the group
    ERR_BAD_POSITION   64  positions not a legal write (see `append_position_errors`)
    ERR_SHARED_PAGE    128 a write into a page another sequence (or the prefix index) also holds
    ERR_BAD_PAGE       256 a page id outside [-1, num_pages), not allocated, or listed twice

Legal positions of one `append` call, per sequence slot ``s`` with corrected length ``n = kv_lens[s]`` and
``w = written[s]`` (one past the highest row ever written since admit):

* the positions of ``s``'s tokens are distinct and contiguous, ``[p0, p1]`` (any order inside the call);
* ``p0 <= n <= p1 + 1``: the call either extends the sequence from ``n`` (``p0 == n``) or rewrites a suffix that
  reaches the end (``p0 < n``: the other layers of tokens a per-layer append already wrote, or a re-verified
  suffix). Afterwards ``kv_lens[s] = p1 + 1`` and ``written[s] = max(w, p1 + 1)``.

Anything else (a gap past ``n``, a rewrite that stops short of ``n - 1``, a duplicate, a negative position) is
refused: such a write would land in twin ring rows that now hold other positions of the last-N window. A rewrite
changes the low row and, where the position is retained (first-N page or in the ring window), the twin row: both
stores are written by the same call, so readers never see a mix. Speculative rewinds (`correct_kv_lens`,
`accept`) may lower ``kv_lens`` to no less than ``state.floor = max(written - max_draft_len, 0)`` (rewinds do not
accumulate past the ring's slack, so every retained row of the window is still in the ring), never below a reused
prefix (`admit_with_prefix` sets the floor to its length), and not while a group wrote the open append step only
in part (between two layers' appends of one verify step). `accept` with ``num_drafts = k`` rewinds only right
after a verify block of exactly ``k + 1`` rows. Copy-on-write follows the same bound: `fork` shares only the pages
wholly below the floor (`jmixedkv.state.fork_shares`), so a legal rewind and re-append never meets a shared page.
"""
from __future__ import annotations

import numbers
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["ERR_LOW_OOM", "ERR_HIGH_OOM", "ERR_TOO_LONG", "ERR_BAD_SLOT", "ERR_BAD_CORRECTION", "ERR_BAD_LAYER",
           "ERR_BAD_POSITION", "ERR_SHARED_PAGE", "ERR_BAD_PAGE", "ERROR_NAMES", "describe_error", "is_traced",
           "is_jax", "host_int", "index_array", "check_slot_arg", "check_layer_arg", "slot_in_range",
           "layer_in_range", "position_rule", "append_position_errors", "page_ids_ok", "write_dst_errors", "INT32_MAX", "CacheError",
           "CacheCapacityError", "validate_read", "maybe_validate_read", "bad_read_rows", "unadmitted_rows",
           "nan_like"]

ERR_LOW_OOM = 1
ERR_HIGH_OOM = 2
ERR_TOO_LONG = 4
ERR_BAD_SLOT = 8
ERR_BAD_CORRECTION = 16
ERR_BAD_LAYER = 32
ERR_BAD_POSITION = 64
ERR_SHARED_PAGE = 128
ERR_BAD_PAGE = 256

ERROR_NAMES = {
    ERR_LOW_OOM: "out of low pages",
    ERR_HIGH_OOM: "out of high pages",
    ERR_TOO_LONG: "position past max_pages_per_seq * page_size",
    ERR_BAD_SLOT: "sequence slot out of range, not admitted (or admitted twice)",
    ERR_BAD_CORRECTION: "bad speculative length correction (positive offset, rewind below the floor: written - "
                        "max_draft_len, 0 or a reused prefix; an idle slot; an accept no verify block justifies; a "
                        "rewind between two layers' appends of one step)",
    ERR_BAD_LAYER: "layer index out of range",
    ERR_BAD_POSITION: "illegal positions (gap, duplicate, negative, or a rewrite that does not reach kv_len)",
    ERR_SHARED_PAGE: "write into a shared page (fork / prefix): refused, copy-on-write happens at fork / admit",
    ERR_BAD_PAGE: "page id out of range, not allocated, or repeated",
}

INT32_MAX = 2 ** 31 - 1


class CacheError(ValueError):
    """What the host cache API (`CacheManager`, `PrefixCache`, `TorchKVCache`) raises when a request cannot run
    or a device transition refused it (``state.error`` bits, named by `describe_error`)."""


class CacheCapacityError(CacheError):
    """A request needs more pages (or slots, or positions) than the cache has, even after eviction."""


def describe_error(code: int) -> str:
    """Names of the bits set in ``code`` (``"ok"`` for 0)."""
    code = int(code)
    return ", ".join(name for bit, name in ERROR_NAMES.items() if code & bit) or "ok"


# ----------------------------------------------------------------------------------------------- host side
def is_traced(*xs) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(xs))


def is_jax(x) -> bool:
    """A JAX array (concrete or traced): validated by error bits, not on the host."""
    return isinstance(x, (jax.Array, jax.core.Tracer))


def host_int(x, name: str, op: str, lo: Optional[int] = None, hi: Optional[int] = None) -> int:
    """A Python / NumPy integer scalar in ``[lo, hi)`` -> int; `ValueError` naming it otherwise."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (numbers.Integral, np.integer)):
        a = np.asarray(x)
        if a.ndim != 0 or not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"{op}: {name} must be an integer, got {x!r} ({type(x).__name__})")
        x = a.item()
    v = int(x)
    if (lo is not None and v < lo) or (hi is not None and v >= hi):
        raise ValueError(f"{op}: {name}={v} out of range [{lo}, {hi})")
    return v


def index_array(x, name: str, op: str, lo: Optional[int] = None, hi: Optional[int] = None, ndim=None, *,
                host: bool = False):
    """Index argument -> int32 JAX array.

    JAX arrays must have an integer dtype (else `ValueError`); their values are checked inside jit by the caller.
    Host values (lists, NumPy, Python ints) must be integers that fit int32 and, when ``lo`` / ``hi`` are given,
    lie in ``[lo, hi)``; the error names the first offending entry. ``host=True``: return a NumPy int32 array
    (a JAX input is copied to the host) -- for host-side mirrors, so no eager device op runs per call."""
    if host and type(x) is np.ndarray and x.dtype == np.int32 and _within(x, lo, hi):
        out = x.copy()                                  # the hot path of host mirrors: int32 already, in range
    elif is_jax(x):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{op}: {name} must be an integer array, got dtype {x.dtype}")
        out = np.asarray(x).astype(np.int32) if host else x.astype(jnp.int32)
    else:
        a = np.asarray(x)
        if a.size == 0 and a.dtype == np.float64:
            a = a.astype(np.int32)
        if not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"{op}: {name} must be integers, got dtype {a.dtype} ({np.ravel(a)[:4].tolist()}...)")
        flat = a.reshape(-1).astype(np.int64) if a.dtype != np.uint64 else a.reshape(-1)
        lo_, hi_ = (-INT32_MAX - 1 if lo is None else lo), (INT32_MAX + 1 if hi is None else hi)
        bad = np.flatnonzero((flat < lo_) | (flat >= hi_))
        if bad.size:
            i = int(bad[0])
            where = f"{name}[{i}]" if a.ndim else name
            rng = f"[{lo_}, {hi_})" if (lo is not None or hi is not None) else "int32"
            raise ValueError(f"{op}: {where}={int(flat[i])} out of range {rng}")
        out = a.astype(np.int32) if host else jnp.asarray(a.astype(np.int32))
    if ndim is not None and out.ndim != ndim:
        raise ValueError(f"{op}: {name} must have {ndim} dimension(s), got shape {tuple(out.shape)}")
    return out


def _within(x: np.ndarray, lo: Optional[int], hi: Optional[int]) -> bool:
    """Every entry of host ``x`` in ``[lo, hi)`` (None: unbounded); an empty ``x`` is."""
    if not x.size:
        return True
    return (lo is None or int(x.min()) >= lo) and (hi is None or int(x.max()) < hi)


def check_slot_arg(x, num_seqs: int, name: str, op: str, allow_none: bool = True):
    """Scalar slot argument: host value checked in ``[-1, num_seqs)`` (``[0, ...)`` without ``allow_none``);
    returns an int32 scalar (NumPy for a host value: no eager device op)."""
    if is_jax(x):
        return index_array(x, name, op, ndim=0)
    return np.int32(host_int(x, name, op, -1 if allow_none else 0, num_seqs))


def check_group(state, group, op: str):
    """The `GroupSpec` of a host ``group`` index; `ValueError` naming it when it is not an int in range."""
    if not isinstance(group, int) or not 0 <= group < len(state.groups):
        raise ValueError(f"{op}: group={group!r} out of range [0, {len(state.groups)})")
    return state.groups[group]


def check_layer_arg(layer, num_layers: int, op: str, group_name: str = ""):
    """Layer argument: None, a host int in ``[0, num_layers)`` (kept a Python int), or a JAX integer scalar."""
    if layer is None:
        return None
    if is_jax(layer):
        return index_array(layer, "layer", op, ndim=0)
    g = f" of group {group_name!r}" if group_name else ""
    try:
        return host_int(layer, "layer", op, 0, num_layers)
    except ValueError as e:
        raise ValueError(f"{e}{g}") from None


# ----------------------------------------------------------------------------------------------- inside jit
def attention_query(op: str, spec, cfg, q, seq_slots, num_seqs: int):
    """Host checks shared by the attention readers: ``q [B, T, Hq, D]`` matches the group (head_dim, Hq a multiple
    of the KV heads) and the attention dtype; ``seq_slots`` is an int vector of length B in ``[-1, num_seqs)``.
    Returns ``seq_slots`` as checked by `index_array`."""
    b, _, hq, d = q.shape
    if d != spec.head_dim:
        raise ValueError(f"{op}: q head_dim {d} != group head_dim {spec.head_dim}")
    if hq % spec.num_kv_heads:
        raise ValueError(f"{op}: query heads Hq={hq} not a multiple of KV heads H={spec.num_kv_heads}")
    if jnp.dtype(q.dtype) != jnp.dtype(cfg.attention_dtype):
        raise ValueError(f"{op}: q dtype {jnp.dtype(q.dtype)} != attention dtype {jnp.dtype(cfg.attention_dtype)}")
    seq = index_array(seq_slots, "seq_slots", op, -1, num_seqs)
    if seq.shape != (b,):
        raise ValueError(f"{op}: seq_slots must be an int vector of length B={b}, got {seq.dtype}{tuple(seq.shape)}")
    return seq


def attention_options(op: str, cfg, sm_scale, sliding_window, soft_cap):
    """Host checks of the attention options every reader takes: ``sm_scale > 0``, ``sliding_window`` an int >= 1,
    ``soft_cap > 0`` (each or None), and no ``soft_cap`` on a K-smoothed cache (the cap does not commute with the
    per-query logit shift)."""
    if sm_scale is not None and not sm_scale > 0:
        raise ValueError(f"{op}: sm_scale must be > 0, got {sm_scale}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"{op}: sliding_window must be an int >= 1 or None, got {sliding_window!r}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"{op}: soft_cap must be > 0 or None, got {soft_cap!r}")
    if soft_cap is not None and cfg.k_smoothing:
        raise ValueError(f"{op}: soft_cap={soft_cap!r} on a cache with k_smoothing=True: the cap does not commute "
                         f"with the per-query logit shift q . mean, so the output would not be the model's")


def slot_in_range(seq, num_seqs: int):
    """(clipped slot, bool in [0, num_seqs), bool == -1) for an int32 slot array."""
    seq = jnp.asarray(seq, jnp.int32)
    ok = (seq >= 0) & (seq < num_seqs)
    return jnp.clip(seq, 0, num_seqs - 1), ok, seq == -1


def layer_in_range(layer, num_layers: int):
    """(clipped layer or None, bool ok) for a layer argument (None = all layers: ok)."""
    if layer is None:
        return None, jnp.bool_(True)
    if isinstance(layer, int):
        return layer, jnp.bool_(0 <= layer < num_layers)
    layer = jnp.asarray(layer, jnp.int32)
    return jnp.clip(layer, 0, num_layers - 1), (layer >= 0) & (layer < num_layers)


def _segment(xp, op: str, num: int, idx, vals, init):
    """``out[i] = op(init, vals[idx == i])`` for ``i < num`` (entries with ``idx >= num`` dropped): NumPy's
    ``ufunc.at`` on the host, ``.at[].min / max`` inside jit."""
    if xp is np:
        out = np.full((num,), init, vals.dtype)
        keep = idx < num
        (np.minimum if op == "min" else np.maximum).at(out, idx[keep], vals[keep])
        return out
    out = jnp.full((num,), init, vals.dtype).at[idx]
    return (out.min if op == "min" else out.max)(vals, mode="drop")


def _sort_pairs(xp, key, pos):
    """``(key, pos)`` sorted by key, then position: NumPy's ``lexsort`` on the host; inside jit one two-key
    ``lax.sort`` (no index array and no gathers: this runs in every prefill append)."""
    if xp is np:
        order = np.lexsort((pos, key))
        return key[order], pos[order]
    return jax.lax.sort((key, pos), num_keys=2)


def position_rule(seq, pos, kv_lens, num_seqs: int, xp=jnp, per_slot: bool = True):
    """The legal-position rule of one append call (module docstring), written once for the host (``xp=np``,
    `CacheManager.check_append`) and inside jit (``xp=jnp``, `append_position_errors`).

    Args: ``seq`` int[T] slots (in range, or -1 = padding), ``pos`` int[T], ``kv_lens`` int[S].
    Returns per slot ``(broken bool[S], off bool[S], first int[S], last int[S])``: positions not distinct and
    contiguous; a range ``[first, last]`` that does not satisfy ``first <= kv_len <= last + 1``; the smallest /
    largest position (``INT32_MAX`` / -1 for a slot without tokens). Negative positions are the caller's check.
    ``per_slot=False``: ``broken`` is one bool (any slot broken), without the per-slot scatter."""
    seq, pos = xp.asarray(seq), xp.asarray(pos)
    key = xp.where(seq >= 0, seq, num_seqs)
    if xp is np:
        one = _one_token_per_slot(key, pos, kv_lens, num_seqs, per_slot)
        if one is not None:
            return one
    skey, spos = _sort_pairs(xp, key, pos)
    gap = ((skey[1:] == skey[:-1]) & (skey[1:] < num_seqs) & (spos[1:] != spos[:-1] + 1)).astype(xp.int32)
    broken = _segment(xp, "max", num_seqs, skey[1:], gap, 0) > 0 if per_slot else xp.any(gap > 0)
    first = _segment(xp, "min", num_seqs, key, pos.astype(xp.int32), INT32_MAX)
    last = _segment(xp, "max", num_seqs, key, pos.astype(xp.int32), -1)
    off = (last >= 0) & ((first > kv_lens) | (last + 1 < kv_lens))
    return broken, off, first, last


def _one_token_per_slot(key, pos, kv_lens, num_seqs: int, per_slot: bool):
    """`position_rule` on the host for a call with at most one token per slot (a decode step), without the sort and
    the ``ufunc.at`` scatters: nothing is broken, first = last = the token's position; None for any other call."""
    live = key < num_seqs
    slots = key[live]
    if slots.size and np.bincount(slots, minlength=num_seqs).max() > 1:
        return None
    p = pos[live].astype(np.int32)
    first = np.full((num_seqs,), INT32_MAX, np.int32)
    last = np.full((num_seqs,), -1, np.int32)
    first[slots], last[slots] = p, p
    off = (last >= 0) & ((first > kv_lens) | (last + 1 < kv_lens))
    return (np.zeros((num_seqs,), bool) if per_slot else np.bool_(False)), off, first, last


def append_position_errors(seq, pos, kv_lens, num_seqs: int):
    """`position_rule` inside jit, reduced: ``(bad bool[], first i32[S], last i32[S])`` -- whether any slot's
    positions are illegal (negative positions included), and each slot's smallest / largest position."""
    broken, off, first, last = position_rule(seq, pos, kv_lens, num_seqs, per_slot=False)
    neg = jnp.any((seq >= 0) & (pos < 0))
    return broken | neg | jnp.any(off), first, last


def select_if(ok, new, old):
    """``new`` where ``ok`` (a traced bool) else ``old``, leaf by leaf, for all-or-nothing transitions. A leaf the
    transition passed through (``new`` is ``old``: a pool that admit / release never touches) is returned as it is,
    never selected: a select of a pool against itself would cost a pool-sized buffer on devices where XLA does not
    fold it away (the donated input and the output alive together)."""
    return jax.tree.map(lambda a, b: a if a is b else jnp.where(ok, a, b), new, old)


def page_ids_ok(ids, num_pages: int):
    """bool: every id in ``[-1, num_pages)``."""
    return jnp.all((ids >= -1) & (ids < num_pages))


def write_dst_errors(alloc, dst):
    """Error bits for whole-page write destinations ``dst`` i32[K] (-1 = none) of an `Allocator`'s pool:
    ``ERR_BAD_PAGE`` for an id out of range or repeated; ``ERR_SHARED_PAGE`` for a page held more than once
    (copy-on-write: shared pages are never written). A free page (refcount 0) may be written: nobody reads it."""
    n = alloc.num_pages
    live = dst >= 0
    refc = alloc.refcount[jnp.clip(dst, 0, n - 1)]
    count = jnp.zeros((n,), jnp.int32).at[jnp.where(live, dst, n)].add(1, mode="drop")
    bad = ~page_ids_ok(dst, n) | jnp.any(count > 1)
    shared = jnp.any(live & (refc > 1))
    return (jnp.where(bad, ERR_BAD_PAGE, 0) | jnp.where(shared & ~bad, ERR_SHARED_PAGE, 0)).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------- readers
def bad_read_rows(state, layer, seq, lens, group):
    """Inside jit, for a reader: (bool flagged batch rows, clipped layer): slot outside [-1, S) or not admitted
    (`unadmitted_rows`), length outside [0, W * page], or a bad layer (every row)."""
    layer, layer_ok = layer_in_range(layer, state.groups[group].num_layers)
    n = lens[jnp.clip(seq, 0, state.max_seqs - 1)]
    bad = ((seq < -1) | (seq >= state.max_seqs) | unadmitted_rows(state, seq)
           | ((seq >= 0) & ((n < 0) | (n > state.max_pages_per_seq * state.page_size))) | ~layer_ok)
    return bad, layer


def unadmitted_rows(state, seq):
    """bool[B]: batch rows naming a slot in ``[0, S)`` that is not admitted (a reader flags them, as it flags an
    out-of-range slot: an idle slot is no empty sequence)."""
    return (seq >= 0) & (seq < state.max_seqs) & ~state.active[jnp.clip(seq, 0, state.max_seqs - 1)]


def nan_like(x):
    return jnp.array(jnp.nan, jnp.float32).astype(x.dtype)


def validate_read(state, layer, seq_slots, indices=None, *, group: int = 0, kv_lens=None, op: str = "read"):
    """Host-side checks of a read (pulls the arrays); raises `ValueError` naming the offending entry."""
    spec = check_group(state, group, op)
    if layer is not None:
        host_int(np.asarray(layer).item() if np.ndim(layer) == 0 and not isinstance(layer, int) else layer,
                 "layer", op, 0, spec.num_layers)
    seq = np.asarray(seq_slots)
    if seq.ndim != 1 or not np.issubdtype(seq.dtype, np.integer):
        raise ValueError(f"{op}: seq_slots must be an integer vector [B], got shape {seq.shape} dtype {seq.dtype}")
    num_seqs, width = state.page_table.shape
    page = state.page_size
    bad = np.nonzero((seq < -1) | (seq >= num_seqs))[0]
    if bad.size:
        raise ValueError(f"{op}: seq_slots[{bad[0]}]={seq[bad[0]]} out of range [-1, {num_seqs})")
    active = np.asarray(state.active)
    idle = np.nonzero((seq >= 0) & ~active[np.clip(seq, 0, num_seqs - 1)])[0]
    if idle.size:
        raise ValueError(f"{op}: seq_slots[{idle[0]}]={seq[idle[0]]} is not admitted (an idle slot holds no "
                         f"sequence)")
    lens = np.asarray(state.kv_lens if kv_lens is None else kv_lens)
    pt, ht = np.asarray(state.page_table), np.asarray(state.high_table)
    pools = state.pools[group]
    num_pages = state.alloc.num_pages          # pool arrays may carry padding pages past it (layout.offset_safe_count)
    num_high = state.high_alloc.num_pages if pools.high is not None else 0
    for b, s in enumerate(seq):
        if s < 0:
            continue
        n = int(lens[s])
        if not 0 <= n <= width * page:
            raise ValueError(f"{op}: batch row {b} (sequence slot {s}): kv_len={n} out of range [0, {width * page}]")
        npg = -(-n // page)
        for j, pid in enumerate(pt[s]):
            if pid < -1 or pid >= num_pages or (j < npg and pid < 0):
                what = "not allocated (-1)" if pid == -1 else f"out of range [0, {num_pages})"
                raise ValueError(f"{op}: batch row {b} (sequence slot {s}, kv_len {n}): page_table[{s}, {j}]={pid} "
                                 f"{what}")
        if num_high:
            hb = np.nonzero((ht[s] < -1) | (ht[s] >= num_high))[0]
            if hb.size:
                raise ValueError(f"{op}: batch row {b} (sequence slot {s}): high_table[{s}, {hb[0]}]={ht[s][hb[0]]} "
                                 f"out of range [-1, {num_high})")
    if indices is not None:
        idx = np.asarray(indices)
        if idx.ndim != 2 or idx.shape[0] != seq.shape[0] or not np.issubdtype(idx.dtype, np.integer):
            raise ValueError(f"{op}: indices must be integer [B={seq.shape[0]}, K], got shape {idx.shape} "
                             f"dtype {idx.dtype}")
        for b, s in enumerate(seq):
            if s < 0:
                continue
            n = int(lens[s])
            bad = np.nonzero((idx[b] < -1) | (idx[b] >= n))[0]
            if bad.size:
                raise ValueError(f"{op}: indices[{b}, {bad[0]}]={idx[b, bad[0]]} out of range [-1, {n}) for "
                                 f"sequence slot {s} (kv_len {n})")


def maybe_validate_read(validate, state, layer, seq, indices, group, kv_lens, op):
    """A reader's checks: the group and a host layer always; `validate_read` when ``validate`` is True, or None
    with concrete inputs (True with traced inputs raises)."""
    spec = check_group(state, group, op)
    check_layer_arg(layer, spec.num_layers, op, spec.name)
    traced = is_traced(state, layer, seq, indices, kv_lens)
    if validate and traced:
        raise ValueError(f"{op}: validate=True needs concrete arrays (call it outside jit, or pass validate=False)")
    if validate or (validate is None and not traced):
        validate_read(state, layer, seq, indices, group=group, kv_lens=kv_lens, op=op)
