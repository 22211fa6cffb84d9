"""Hybrid recurrent + attention models (Qwen3.5 / Kimi-K3 style Mamba stacks): recurrent state slots beside the
attention cache, the layer-id mapping, and speculative rollback of the recurrent state.

`HybridState` is one pytree: the attention `CacheState` (one mixed group for the model's attention layers, plus an
optional plain group of draft layers) and per-sequence recurrent state for every recurrent layer (``D`` =
``max_draft_len``)::

    conv        dtype[S, L_rec, conv_dim, kernel - 1]            causal-conv shift register
    ssm         f32[S, L_rec, heads, head_dim, state_dim]         SSM state
    conv_snap   dtype[S, D + 1, L_rec, conv_dim, kernel - 1]      rewind snapshots of the last block
    ssm_snap    f32[S, D + 1, L_rec, heads, head_dim, state_dim]
    snap_tokens i32[S, L_rec]                                     valid tokens of the last block (0 = none / used)

Layer ids (`HybridLayout`, TensorRT-LLM's hybrid-manager convention): ``[0, M)`` are the model's layers in order
(recurrent or attention), ``[M, M + Dr)`` the appended draft layers (plain cache, never NVFP4), and the retained
(twin) group's ids ``[M + Dr, M + Dr + A)`` come last, one per attention layer. The recurrent layer mask is True
exactly on the model's recurrent layers: draft and retained ids stay out of it.

Speculative rollback -- the contract between `recurrent_forward` and `accept_hybrid` / `rollback`:

* `recurrent_forward` runs one *block* (a verify block of ``k + 1`` tokens or a prefill chunk of any length) and,
  for every row with ``n >= 1`` valid tokens, records rewind snapshots counted **from the end of the block**:
  ``snap[r]`` = the state with the last ``r`` valid tokens undone (``r = 0 .. D``; ``snap[0]`` is the state after
  the whole block, ``r >= n`` gives the state before it), and ``snap_tokens = n``. Rows without a valid token
  change nothing (state, snapshots and ``snap_tokens`` keep the previous block).
* `accept_hybrid(slots, num_accepted=a, num_drafts=k)` rewinds each listed sequence by ``r = k - a`` tokens,
  exactly like the attention side's ``kv_len += a - k``: ``r = 0`` keeps the current state bit for bit (a prefill
  chunk listed with ``num_drafts = 0`` keeps its full state, however long the chunk), ``r > 0`` restores
  ``snap[r]`` and needs ``snap_tokens == k + 1`` (the last block is the verify block of ``k`` drafts: a prefill
  chunk's tokens are never undone, nor a block's verified token; a rewind with no block is refused). Each block
  is accepted at most once: listed slots get ``snap_tokens = 0``.
  Sequences that are not listed keep everything.

Why snapshots: the SSM update ``h' = exp(dt A) h + dt x B`` is not invertible in finite precision (decays
underflow, every step rounds), so rejected tokens cannot be subtracted; recomputing the accepted prefix would cost
a second forward. A snapshot restore is a gather and bit-exact. The conv state is a shift register and could be
rebuilt from the block's inputs, but one mechanism for both keeps rollback a single select; its snapshots are small
(``conv_dim * (kernel - 1)`` per layer). Cost: ``D + 1`` copies of the recurrent state per sequence,
TensorRT-LLM's "intermediate states" trade-off.

Bad input (docs/DESIGN.md, "bad input never touches another sequence"): every slot and recurrent-layer index is
range-checked where it is used (the rule and helpers of `jmixedkv.checks`). Host (Python / NumPy) values out of
range raise `ValueError` naming the value. For JAX values (traced or not) a transition sets a bit in
``state.attn.error`` (``ERR_BAD_SLOT`` for a slot out of ``[-1, S)``, not admitted,
admitted twice or listed twice; `ERR_BAD_LAYER` for a recurrent layer out of range; ``ERR_BAD_CORRECTION`` for a
bad accept count or a rewind the snapshots cannot serve) and leaves **every** sequence -- attention and recurrent
state -- bitwise unchanged (all-or-nothing, like the attention transitions). The recurrent state follows the
attention state's rules: a refused admit changes nothing, ``-1`` is a no-op everywhere, release of an idle slot is
refused. Readers (`recurrent_state`, `recurrent_forward`'s outputs) return NaN rows for a bad slot or layer, never
another sequence's data.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import speculative as spec
from . import checks
from .config import KVCacheConfig
from .checks import ERR_BAD_CORRECTION, ERR_BAD_LAYER, ERR_BAD_SLOT
from .pools import pytree
from .state import CacheState, GroupSpec, admit, init_state, release

__all__ = ["HybridModelConfig", "HybridLayout", "HybridState", "hybrid_layout", "init_hybrid_state", "hybrid_admit",
           "hybrid_release", "layer_buffers", "layer_page_table", "init_recurrent_params", "mamba_step_reference",
           "recurrent_forward", "rollback", "accept_hybrid", "recurrent_state", "RECURRENT_KINDS", "ATTENTION_KINDS",
           "ERR_BAD_LAYER"]

RECURRENT_KINDS = ("mamba", "mamba2", "linear_attention")
ATTENTION_KINDS = ("attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class HybridModelConfig:
    """Stand-in for a hybrid model's config (what the cache reads from it).

    Attributes:
      layer_types: per model layer, one of `RECURRENT_KINDS` or `ATTENTION_KINDS`.
      num_kv_heads, head_dim: attention layers' KV geometry.
      conv_dim, conv_kernel: causal conv channels and width (state keeps ``kernel - 1`` inputs).
      ssm_heads, ssm_head_dim, ssm_state_dim: SSM state ``[heads, head_dim, state_dim]``
        (``conv_dim == ssm_heads * ssm_head_dim`` for the reference step).
      num_draft_layers: MTP / Eagle one-model draft layers appended to the cache (plain group).
      sparse_attention_config: None, or an object / dict naming ``algorithm`` (the loader reads it).
    """

    layer_types: tuple
    num_kv_heads: int = 1
    head_dim: int = 16
    conv_dim: int = 8
    conv_kernel: int = 4
    ssm_heads: int = 2
    ssm_head_dim: int = 4
    ssm_state_dim: int = 4
    num_draft_layers: int = 0
    sparse_attention_config: Any = None

    def __post_init__(self):
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        bad = [t for t in self.layer_types if t not in RECURRENT_KINDS + ATTENTION_KINDS]
        if bad:
            raise ValueError(f"HybridModelConfig.layer_types: unknown kinds {bad}; expected "
                             f"{RECURRENT_KINDS + ATTENTION_KINDS}")
        if self.conv_kernel < 2:
            raise ValueError(f"HybridModelConfig.conv_kernel must be >= 2, got {self.conv_kernel}")
        if self.conv_dim != self.ssm_heads * self.ssm_head_dim:
            raise ValueError(f"HybridModelConfig: conv_dim={self.conv_dim} must equal ssm_heads * ssm_head_dim "
                             f"= {self.ssm_heads * self.ssm_head_dim}")


def _sparse_name(cfg) -> Optional[str]:
    sac = cfg.sparse_attention_config
    if sac is None:
        return None
    name = sac.get("algorithm") if isinstance(sac, dict) else getattr(sac, "algorithm", None)
    return str(name) if name is not None else "unknown"


@dataclasses.dataclass(frozen=True)
class HybridLayout:
    """Static layer-id mapping. ``kinds[i]`` in ``("recurrent", "attention", "draft", "retained")``;
    ``local[i]`` = index in that kind's arrays (recurrent slot, attention-group layer, draft-group layer, or the
    attention layer whose twin it is); ``twin_of[i]`` = model layer id of a retained id, else -1."""

    kinds: tuple
    local: tuple
    twin_of: tuple

    def ids(self, kind: str) -> tuple:
        return tuple(i for i, k in enumerate(self.kinds) if k == kind)

    @property
    def num_layer_ids(self) -> int:
        return len(self.kinds)

    @property
    def recurrent_layer_mask(self) -> tuple:
        """bool per layer id: True exactly on the model's recurrent layers (never draft or retained ids)."""
        return tuple(k == "recurrent" for k in self.kinds)

    @property
    def num_recurrent(self) -> int:
        return len(self.ids("recurrent"))

    @property
    def num_attention(self) -> int:
        return len(self.ids("attention"))

    @property
    def num_draft(self) -> int:
        return len(self.ids("draft"))


def hybrid_layout(model: HybridModelConfig, kv: KVCacheConfig) -> HybridLayout:
    """Layer ids: model layers, then draft layers, then (mixed dtypes only) one retained id per attention layer."""
    sparse = _sparse_name(model)
    if kv.is_mixed and sparse is not None:
        raise ValueError(f"hybrid model with sparse_attention_config algorithm={sparse!r} cannot use "
                         f"dtype={kv.dtype!r}: the hybrid manager's retained twin serves the staging path of full "
                         f"attention layers only (a sparse backend on a hybrid stack has no retained-row hooks)")
    ids, counts = [], {"recurrent": 0, "attention": 0}           # ids: (kind, local, twin_of) per layer id
    for t in model.layer_types:
        k = "recurrent" if t in RECURRENT_KINDS else "attention"
        ids.append((k, counts[k], -1))
        counts[k] += 1
    ids += [("draft", d, -1) for d in range(model.num_draft_layers)]
    if kv.is_mixed and kv.num_high_pages_per_seq:
        ids += [("retained", ids[lid][1], lid) for lid, t in enumerate(model.layer_types) if t in ATTENTION_KINDS]
    if not counts["attention"] and kv.is_mixed:
        raise ValueError("hybrid_layout: a mixed dtype needs at least one attention layer, layer_types has none")
    return HybridLayout(*map(tuple, zip(*ids))) if ids else HybridLayout((), (), ())


@pytree("layout")
class HybridState:
    """Attention cache + recurrent state slots (see module docstring for shapes)."""

    layout: HybridLayout
    attn: CacheState
    conv: jax.Array
    ssm: jax.Array
    conv_snap: jax.Array
    ssm_snap: jax.Array
    snap_tokens: jax.Array

    @property
    def max_seqs(self) -> int:
        return self.conv.shape[0]

    @property
    def error(self) -> jax.Array:
        """i32[] sticky error bits (``state.attn.error``)."""
        return self.attn.error


def init_hybrid_state(model: HybridModelConfig, kv: KVCacheConfig, num_pages: int, max_seqs: int,
                      max_pages_per_seq: Optional[int] = None, recurrent_dtype=jnp.float32, **init_kwargs
                      ) -> HybridState:
    """Empty hybrid cache: attention group(s) via `init_state` (kwargs pass through) and zeroed recurrent slots."""
    spec.check_linear_drafts(kv, what="init_hybrid_state")
    layout = hybrid_layout(model, kv)
    if not layout.num_attention:
        raise ValueError("init_hybrid_state: layer_types has no attention layer (nothing to cache)")
    groups = [GroupSpec(layout.num_attention, model.num_kv_heads, model.head_dim, name="attn")]
    if layout.num_draft:
        groups.append(spec.draft_group_spec(kv, layout.num_draft, model.num_kv_heads, model.head_dim))
    attn = init_state(kv, groups, num_pages, max_seqs, max_pages_per_seq, **init_kwargs)
    lr, snaps = layout.num_recurrent, kv.max_draft_len + 1
    conv = jnp.zeros((max_seqs, lr, model.conv_dim, model.conv_kernel - 1), recurrent_dtype)
    ssm = jnp.zeros((max_seqs, lr, model.ssm_heads, model.ssm_head_dim, model.ssm_state_dim), jnp.float32)
    return HybridState(layout, attn, conv, ssm, jnp.zeros((max_seqs, snaps) + conv.shape[1:], recurrent_dtype),
                       jnp.zeros((max_seqs, snaps) + ssm.shape[1:], jnp.float32),
                       jnp.zeros((max_seqs, lr), jnp.int32))


# ---------------------------------------------------------------------------------------------- index checks
# The shared rule and helpers of `jmixedkv.checks`: host values (Python / NumPy) are checked here and raise
# `ValueError` naming the value; JAX arrays (traced or not) are checked inside jit (error bits / NaN rows).
def _slots_arg(what: str, seq_slots, num_seqs: int, distinct: bool = False):
    """``seq_slots`` -> i32[B] JAX array; host values must lie in ``[-1, num_seqs)`` (and be distinct)."""
    seq = checks.index_array(seq_slots, "seq_slots", what, -1, num_seqs, ndim=1)
    if distinct and not checks.is_jax(seq_slots):
        live = np.asarray(seq_slots).reshape(-1)
        vals, counts = np.unique(live[live >= 0], return_counts=True)
        if (counts > 1).any():
            raise ValueError(f"{what}: seq_slots lists slot {int(vals[counts > 1][0])} more than once")
    return seq


def _layer_arg(what: str, layer, num_layers: int):
    """Recurrent layer -> i32 scalar; a host value must be an integer in ``[0, num_layers)``."""
    return jnp.asarray(checks.check_layer_arg(layer, num_layers, what, "recurrent"), jnp.int32)


def _slot_checks(state: HybridState, seq):
    """Checks of i32[B] slots inside jit: (clipped slot, live (>= 0 and in range), per-row ok (-1, or in range
    and admitted), any live slot listed twice)."""
    s_max = state.max_seqs
    safe, live, pad = checks.slot_in_range(seq, s_max)
    row_ok = pad | (live & state.attn.active[safe])
    counts = jnp.zeros((s_max,), jnp.int32).at[jnp.where(live, seq, s_max)].add(1, mode="drop")
    return safe, live, row_ok, jnp.any(counts > 1)


def _commit(old: HybridState, new: HybridState, added) -> HybridState:
    """All or nothing: ``new`` if its transition added no error bit, else ``old``; ``added`` OR-ed into the bits."""
    out = checks.select_if(added == 0, new, old)
    return dataclasses.replace(out, attn=dataclasses.replace(out.attn, error=old.attn.error | added))


def _with_error(state: HybridState, err) -> HybridState:
    return dataclasses.replace(state, attn=dataclasses.replace(state.attn, error=state.attn.error | err))


def _clear_error(state: HybridState) -> HybridState:
    return dataclasses.replace(state, attn=dataclasses.replace(state.attn, error=jnp.zeros_like(state.attn.error)))


def _zero_slot(state: HybridState, slot, ok) -> HybridState:
    """Zero slot ``slot``'s recurrent state, snapshots and ``snap_tokens`` where ``ok`` (else unchanged)."""
    dst = jnp.where(ok, slot, state.max_seqs)
    z = lambda a: a.at[dst].set(0, mode="drop")  # noqa: E731
    return dataclasses.replace(state, conv=z(state.conv), ssm=z(state.ssm), conv_snap=z(state.conv_snap),
                               ssm_snap=z(state.ssm_snap), snap_tokens=z(state.snap_tokens))


# ---------------------------------------------------------------------------------------------- admit / release
def _admit_or_release(state: HybridState, seq_slot, fn, what: str) -> HybridState:
    slot = checks.check_slot_arg(seq_slot, state.max_seqs, "seq_slot", what)
    tried = fn(_clear_error(state).attn, slot)
    new = _zero_slot(dataclasses.replace(state, attn=tried), jnp.clip(slot, 0, state.max_seqs - 1),
                     (slot >= 0) & (slot < state.max_seqs))
    return _commit(state, new, tried.error)


def hybrid_admit(state: HybridState, seq_slot) -> HybridState:
    """`admit` the attention slot and zero its recurrent state (and snapshots), all or nothing.

    ``seq_slot``: int or i32 scalar array; -1 = no-op. A host slot outside ``[-1, S)`` raises `ValueError`. A JAX
    slot out of range, or an already admitted slot, sets ``ERR_BAD_SLOT`` (too few twin pages ``ERR_HIGH_OOM``)
    and leaves the whole state -- attention and recurrent -- unchanged."""
    return _admit_or_release(state, seq_slot, admit, "hybrid_admit")


def hybrid_release(state: HybridState, seq_slot) -> HybridState:
    """`release` the attention slot and zero its recurrent state (so no later reader sees it), all or nothing.

    ``seq_slot`` as in `hybrid_admit`; releasing a slot that is not admitted (or a JAX slot out of range) sets
    ``ERR_BAD_SLOT`` and changes nothing."""
    return _admit_or_release(state, seq_slot, release, "hybrid_release")


# ---------------------------------------------------------------------------------------------- buffers
def _check_id(state: HybridState, layer_id) -> str:
    if isinstance(layer_id, jax.core.Tracer):
        raise ValueError("layer id must be a Python int (it selects arrays of different shapes), got a traced value")
    a = np.asarray(layer_id)
    if a.ndim != 0 or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"layer id must be an integer, got {layer_id!r}")
    if not 0 <= int(a) < state.layout.num_layer_ids:
        raise ValueError(f"layer id {int(a)} out of range [0, {state.layout.num_layer_ids})")
    return state.layout.kinds[int(a)]


def layer_buffers(state: HybridState, layer_id: int) -> dict:
    """The arrays behind one layer id: recurrent -> ``conv`` / ``ssm`` ``[S, ...]``; attention -> NVFP4 ``data`` /
    ``scales`` / ``gs`` (or ``rows`` for a plain / no-twin dtype); draft -> plain ``rows`` / ``scale``;
    retained -> the twin's ``rows`` / ``scale`` of the attention layer it shadows. ``layer_id`` out of range
    raises `ValueError`."""
    kind = _check_id(state, layer_id)
    i = state.layout.local[int(layer_id)]
    pools = state.attn.pools
    if kind == "recurrent":
        return {"conv": state.conv[:, i], "ssm": state.ssm[:, i]}
    if kind == "attention":
        low, plain = pools[0].low, pools[0].plain
        if low is not None:
            return {"data": low.data[i], "scales": low.scales[i], "gs": low.gs[i]}
        return {"rows": plain.rows[i], "scale": plain.scale[i]}
    if kind == "draft":
        return {"rows": pools[1].plain.rows[i], "scale": pools[1].plain.scale[i]}
    return {"rows": pools[0].high.rows[i], "scale": pools[0].high.scale[i]}


def layer_page_table(state: HybridState, layer_id: int):
    """i32 page table a layer id is addressed with: ``page_table`` for attention and draft ids, ``high_table``
    (F fixed + R ring columns) for retained ids. Recurrent layers have none (`ValueError`)."""
    kind = _check_id(state, layer_id)
    if kind == "recurrent":
        raise ValueError(f"layer id {layer_id} is a recurrent layer: it has state slots, not a page table")
    return state.attn.high_table if kind == "retained" else state.attn.page_table


def recurrent_state(state: HybridState, rec_layer, seq_slots):
    """Reader: the recurrent state of sequences ``seq_slots i32[B]`` in recurrent layer ``rec_layer``.

    Returns ``(conv [B, conv_dim, kernel - 1], ssm f32[B, heads, head_dim, state_dim])``. Padding rows (-1) are
    zero; a slot out of range or not admitted, or a layer out of range (JAX values), gives NaN rows -- never
    another sequence's state. Host (Python / NumPy) slots / layer out of range raise `ValueError`."""
    seq = _slots_arg("recurrent_state", seq_slots, state.max_seqs)
    layer = _layer_arg("recurrent_state", rec_layer, state.layout.num_recurrent)
    safe, live, row_ok, _ = _slot_checks(state, seq)
    lc, layer_ok = checks.layer_in_range(layer, state.layout.num_recurrent)
    row_ok = row_ok & layer_ok

    def pick(a):
        x = a[safe, lc]
        bshape = (-1,) + (1,) * (x.ndim - 1)
        return jnp.where(row_ok.reshape(bshape), jnp.where(live.reshape(bshape), x, 0), jnp.nan).astype(a.dtype)
    return pick(state.conv), pick(state.ssm)


# ---------------------------------------------------------------------------------------------- recurrence
def init_recurrent_params(model: HybridModelConfig, key, num_layers: Optional[int] = None) -> dict:
    """Random parameters of the reference Mamba-2 style step for ``num_layers`` recurrent layers (f32)."""
    lr = hybrid_layout(model, KVCacheConfig("bf16")).num_recurrent if num_layers is None else num_layers
    ks = jax.random.split(key, 5)
    h, n, c = model.ssm_heads, model.ssm_state_dim, model.conv_dim
    return {"conv_w": jax.random.normal(ks[0], (lr, c, model.conv_kernel)) * 0.5,
            "conv_b": jax.random.normal(ks[1], (lr, c)) * 0.1,
            "a_log": jnp.zeros((lr, h)) + jnp.log(jnp.arange(1, h + 1, dtype=jnp.float32)) - 1.0,
            "dt_bias": jnp.full((lr, h), -0.5),
            "b": jax.random.normal(ks[2], (lr, h, n)),
            "c": jax.random.normal(ks[3], (lr, h, n)),
            "d": jax.random.normal(ks[4], (lr, h)) * 0.1}


def mamba_step_reference(conv, ssm, x, p):
    """One token through one recurrent layer (a minimal Mamba-2 step, float32).

    Args: ``conv [C, K-1]``, ``ssm f32[H, P, N]``, ``x [C]``, ``p`` one layer's params. Returns
    ``(conv', ssm', y f32[C])``."""
    window = jnp.concatenate([conv.astype(jnp.float32), x.astype(jnp.float32)[:, None]], axis=1)   # [C, K]
    out = jnp.sum(window * p["conv_w"], axis=1) + p["conv_b"]
    u = out * jax.nn.sigmoid(out)
    h, n = p["b"].shape
    xs = u.reshape(h, -1)                                                                          # [H, P]
    dt = jax.nn.softplus(p["dt_bias"] + jnp.mean(xs, axis=1))                                      # [H]
    decay = jnp.exp(-jnp.exp(p["a_log"]) * dt)
    ssm = decay[:, None, None] * ssm + (dt[:, None] * xs)[:, :, None] * p["b"][:, None, :]
    y = jnp.sum(ssm * p["c"][:, None, :], axis=2) + p["d"][:, None] * xs
    return window[:, 1:].astype(conv.dtype), ssm, y.reshape(-1)


def recurrent_forward(state: HybridState, rec_layer, x, valid, seq_slots, params):
    """Run one block of tokens through recurrent layer ``rec_layer`` (index among recurrent layers; may be traced)
    and record its rewind snapshots (see the module docstring for the contract with `accept_hybrid`).

    Args (the library's order: state, layer, data, slots):
      x: ``[B, T, conv_dim]`` float inputs; ``valid`` bool[B, T]: which tokens of a row are real (any pattern;
        invalid tokens leave the state unchanged). ``T`` is free: a verify block has ``k + 1 <= D + 1`` valid
        tokens, a prefill chunk any number; in both, ``snap[r]`` = state with the row's last ``r`` valid tokens
        undone, ``r = 0 .. D``, and ``snap_tokens`` = the row's valid-token count. Rows with no valid token change
        nothing.
      seq_slots: i32[B] distinct admitted slots (-1 = padding row).
      params: `init_recurrent_params` output (all layers).
    Returns ``(state', y f32[B, T, conv_dim])``; ``y`` of a padding row is computed from a zero state.

    Host (Python / NumPy) slots out of ``[-1, S)`` or repeated, or a host layer out of range, raise `ValueError`.
    JAX values (traced or not): any bad, repeated or not-admitted slot sets ``ERR_BAD_SLOT``, a bad layer
    ``ERR_BAD_LAYER``; then nothing changes and ``y`` is all NaN."""
    seq = _slots_arg("recurrent_forward", seq_slots, state.max_seqs, distinct=True)
    layer = _layer_arg("recurrent_forward", rec_layer, state.layout.num_recurrent)
    x = jnp.asarray(x)
    valid = jnp.asarray(valid)
    b, conv_dim = seq.shape[0], state.conv.shape[2]
    if x.ndim != 3 or x.shape[0] != b or x.shape[2] != conv_dim or valid.shape != x.shape[:2]:
        raise ValueError(f"recurrent_forward: need seq_slots i32[B], x [B, T, {conv_dim}], valid bool[B, T]; got "
                         f"{seq.shape}, {x.shape}, {valid.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating) or valid.dtype != jnp.bool_:
        raise ValueError(f"recurrent_forward: x must be float and valid bool, got {x.dtype}, {valid.dtype}")
    s_max, n_rec, n_snap = state.max_seqs, state.layout.num_recurrent, state.conv_snap.shape[1]
    safe, live, row_ok, dup = _slot_checks(state, seq)
    lc, layer_ok = checks.layer_in_range(layer, n_rec)
    slots_ok = jnp.all(row_ok) & ~dup
    ok = layer_ok & slots_ok
    err = jnp.where(slots_ok, 0, ERR_BAD_SLOT) | jnp.where(layer_ok, 0, ERR_BAD_LAYER)
    p = jax.tree.map(lambda a: a[lc], params)
    step = jax.vmap(mamba_step_reference, in_axes=(0, 0, 0, None))

    def body(carry, inp):
        conv, ssm = carry
        xt, vt = inp
        nc, ns, y = step(conv, ssm, xt, p)
        conv = jnp.where(vt[:, None, None], nc, conv)
        ssm = jnp.where(vt[:, None, None, None], ns, ssm)
        return (conv, ssm), (conv, ssm, y)

    conv0 = jnp.where(live[:, None, None], state.conv[safe, lc], 0).astype(state.conv.dtype)
    ssm0 = jnp.where(live[:, None, None, None], state.ssm[safe, lc], 0)
    (conv, ssm), (cs, ss, y) = jax.lax.scan(body, (conv0, ssm0), (jnp.swapaxes(x, 0, 1), jnp.swapaxes(valid, 0, 1)))
    # snapshots from the end: after m = n - r valid tokens (index 0 = before the block, t + 1 = after token t)
    n = jnp.sum(valid, axis=1, dtype=jnp.int32)                                            # [B]
    count = jnp.cumsum(valid, axis=1, dtype=jnp.int32)                                     # [B, T]
    m = n[:, None] - jnp.arange(n_snap, dtype=jnp.int32)[None, :]                          # [B, D + 1]
    first = jnp.sum(count[:, None, :] < jnp.maximum(m, 1)[:, :, None], axis=2)              # token reaching m
    idx = jnp.where(m <= 0, 0, first + 1)
    rows = jnp.arange(b)[:, None]
    conv_all = jnp.concatenate([conv0[None], cs], axis=0)                                  # [T + 1, B, ...]
    ssm_all = jnp.concatenate([ssm0[None], ss], axis=0)
    conv_snaps, ssm_snaps = conv_all[idx, rows], ssm_all[idx, rows]                        # [B, D + 1, ...]
    dst = jnp.where(ok & live & (n > 0), seq, s_max)
    out = dataclasses.replace(
        state, conv=state.conv.at[dst, lc].set(conv, mode="drop"),
        ssm=state.ssm.at[dst, lc].set(ssm, mode="drop"),
        conv_snap=state.conv_snap.at[dst, :, lc].set(conv_snaps, mode="drop"),
        ssm_snap=state.ssm_snap.at[dst, :, lc].set(ssm_snaps, mode="drop"),
        snap_tokens=state.snap_tokens.at[dst, lc].set(n, mode="drop"))
    y = jnp.where(ok, jnp.swapaxes(y, 0, 1), jnp.nan)
    return _with_error(out, err), y


def _accept_args(state: HybridState, seq_slots, num_accepted, num_drafts, what: str):
    """``(seq, a, k)`` i32[B]: the distinct slots (`_slots_arg`) and the counts broadcast to them; host values are
    checked here (``0 <= a <= k <= D`` on live rows)."""
    seq = _slots_arg(what, seq_slots, state.max_seqs, distinct=True)
    a = jnp.broadcast_to(jnp.asarray(num_accepted, jnp.int32), seq.shape)
    k = jnp.broadcast_to(jnp.asarray(num_drafts, jnp.int32), seq.shape)
    if not any(checks.is_jax(x) for x in (num_accepted, num_drafts, seq_slots)):
        spec._check_accept_counts(seq_slots, a, k, state.attn.config.max_draft_len, what)
    return seq, a, k


def rollback(state: HybridState, seq_slots, num_accepted, num_drafts) -> HybridState:
    """Recurrent half of `accept_hybrid`: rewind each listed sequence by ``r = num_drafts - num_accepted`` tokens
    of its last `recurrent_forward` block, every recurrent layer (``r = 0``: state kept bit for bit; ``r > 0``:
    ``snap[r]``), and mark the block used (``snap_tokens = 0``). Does not touch the attention cache's lengths.

    Args: ``seq_slots`` i32[B] distinct (-1 = padding); ``num_accepted`` / ``num_drafts`` i32[B] or scalars with
    ``0 <= num_accepted <= num_drafts <= max_draft_len``.
    Refused (all or nothing, error bit): a bad / repeated / idle slot (``ERR_BAD_SLOT``), bad counts or
    ``snap_tokens != k + 1`` for a rewind (``r > 0``) in some layer (``ERR_BAD_CORRECTION``). Host (Python / NumPy) bad slots or counts raise
    `ValueError`."""
    seq, a, k = _accept_args(state, seq_slots, num_accepted, num_drafts, "rollback")
    s_max, n_snap = state.max_seqs, state.conv_snap.shape[1]
    safe, live, row_ok, dup = _slot_checks(state, seq)
    r = k - a
    counts_ok = ~live | ((a >= 0) & (a <= k) & (k < n_snap))
    need = live & (r > 0)
    # a rewind undoes drafts of a verify block: the last block must be exactly the k + 1 verify tokens (a prefill
    # chunk, or a block already accepted, justifies no rewind)
    rewind_ok = ~need | jnp.all(state.snap_tokens[safe] == (k + 1)[:, None], axis=1)
    slots_ok = jnp.all(row_ok) & ~dup
    good = jnp.all(counts_ok & rewind_ok)
    ok = slots_ok & good
    err = jnp.where(slots_ok, 0, ERR_BAD_SLOT) | jnp.where(good, 0, ERR_BAD_CORRECTION)
    rc = jnp.clip(r, 0, n_snap - 1)
    dst = jnp.where(ok & need, seq, s_max)
    used = jnp.where(ok & live, seq, s_max)
    out = dataclasses.replace(
        state, conv=state.conv.at[dst].set(state.conv_snap[safe, rc], mode="drop"),
        ssm=state.ssm.at[dst].set(state.ssm_snap[safe, rc], mode="drop"),
        snap_tokens=state.snap_tokens.at[used].set(0, mode="drop"))
    return _with_error(out, err)


def accept_hybrid(state: HybridState, seq_slots, num_accepted, num_drafts, draft_tree=None) -> HybridState:
    """`jmixedkv.speculative.accept` on the attention cache and `rollback` of the recurrent state, together and all
    or nothing: both sides rewind by ``num_drafts - num_accepted`` tokens (``kv_len += a - k``). A prefill chunk of
    a mixed batch may be left out or listed with ``num_drafts = num_accepted = 0``: it keeps its full state.

    Arguments as in `rollback`. If either side refuses (error bit set), the whole state is unchanged and the bits of
    both are OR-ed into ``state.attn.error``. A listed slot that is not admitted is refused even with
    ``num_drafts = 0`` (``ERR_BAD_SLOT``)."""
    spec.check_linear_drafts(state.attn.config, draft_tree, what="accept_hybrid")
    seq, a, k = _accept_args(state, seq_slots, num_accepted, num_drafts, "accept_hybrid")
    clean = _clear_error(state)
    # spec.accept treats every negative slot as padding: give it only the in-range rows (rollback flags the rest)
    attn = spec.accept(clean.attn, jnp.where(seq < state.max_seqs, seq, -1), a, k)
    rec = rollback(clean, seq, a, k)
    return _commit(state, dataclasses.replace(rec, attn=attn), attn.error | rec.attn.error)
