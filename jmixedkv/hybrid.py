"""Hybrid recurrent + attention models (Qwen3.5 / Kimi-K3 style Mamba stacks): recurrent state slots beside the
attention cache, the layer-id mapping, and speculative rollback of the recurrent state.

`HybridState` is one pytree: the attention `CacheState` (one mixed group for the model's attention layers, plus an
optional plain group of draft layers) and per-sequence recurrent state for every recurrent layer::

    conv      dtype[S, L_rec, conv_dim, kernel - 1]            causal-conv shift register
    ssm       f32[S, L_rec, heads, head_dim, state_dim]         SSM state
    conv_snap dtype[S, max_draft_len + 1, L_rec, conv_dim, kernel - 1]
    ssm_snap  f32[S, max_draft_len + 1, L_rec, heads, head_dim, state_dim]

Layer ids (`HybridLayout`, TensorRT-LLM's hybrid-manager convention): ``[0, M)`` are the model's layers in order
(recurrent or attention), ``[M, M + Dr)`` the appended draft layers (plain cache, never NVFP4), and the retained
(twin) group's ids ``[M + Dr, M + Dr + A)`` come last, one per attention layer. The recurrent layer mask is True
exactly on the model's recurrent layers: draft and retained ids stay out of it.

Speculative rollback: a verify block runs ``k + 1 <= max_draft_len + 1`` tokens through each recurrent layer and
keeps the state after every token (``snap[j]`` = state after tokens ``0..j``). Accepting ``a`` drafts restores
``snap[a]``. Why snapshots: the SSM update ``h' = exp(dt A) h + dt x B`` is not invertible in finite precision
(decays underflow, every step rounds), so rejected tokens cannot be subtracted; recomputing the accepted prefix
would cost a second forward. A snapshot restore is a gather and bit-exact. The conv state is a shift register and
could be rebuilt from the block's inputs, but one mechanism for both keeps rollback a single select; its
snapshots are small (``conv_dim * (kernel - 1)`` per layer). Cost: ``(max_draft_len + 1)`` copies of the recurrent
state per sequence, TensorRT-LLM's "intermediate states" trade-off.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp

from . import speculative as spec
from .config import KVCacheConfig
from .state import CacheState, GroupSpec, admit, init_state, release

__all__ = ["HybridModelConfig", "HybridLayout", "HybridState", "hybrid_layout", "init_hybrid_state", "hybrid_admit",
           "hybrid_release", "layer_buffers", "layer_page_table", "init_recurrent_params", "mamba_step_reference",
           "recurrent_forward", "rollback", "accept_hybrid", "RECURRENT_KINDS", "ATTENTION_KINDS"]

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
    kinds, local, twin_of = [], [], []
    counts = {"recurrent": 0, "attention": 0}
    for t in model.layer_types:
        k = "recurrent" if t in RECURRENT_KINDS else "attention"
        kinds.append(k)
        local.append(counts[k])
        twin_of.append(-1)
        counts[k] += 1
    for d in range(model.num_draft_layers):
        kinds.append("draft")
        local.append(d)
        twin_of.append(-1)
    if kv.is_mixed and kv.num_high_pages_per_seq:
        for lid, t in enumerate(model.layer_types):
            if t in ATTENTION_KINDS:
                kinds.append("retained")
                local.append(local[lid])
                twin_of.append(lid)
    if not counts["attention"] and kv.is_mixed:
        raise ValueError("hybrid_layout: a mixed dtype needs at least one attention layer, layer_types has none")
    return HybridLayout(tuple(kinds), tuple(local), tuple(twin_of))


@dataclasses.dataclass(frozen=True)
class HybridState:
    """Attention cache + recurrent state slots (see module docstring for shapes)."""

    layout: HybridLayout
    attn: CacheState
    conv: jax.Array
    ssm: jax.Array
    conv_snap: jax.Array
    ssm_snap: jax.Array


jax.tree_util.register_dataclass(HybridState, data_fields=["attn", "conv", "ssm", "conv_snap", "ssm_snap"],
                                 meta_fields=["layout"])


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
                       jnp.zeros((max_seqs, snaps) + ssm.shape[1:], jnp.float32))


def hybrid_admit(state: HybridState, seq_slot) -> HybridState:
    """`admit` the attention slot and zero its recurrent state."""
    slot = jnp.asarray(seq_slot, jnp.int32)
    return dataclasses.replace(state, attn=admit(state.attn, slot), conv=state.conv.at[slot].set(0),
                               ssm=state.ssm.at[slot].set(0))


def hybrid_release(state: HybridState, seq_slot) -> HybridState:
    return dataclasses.replace(state, attn=release(state.attn, jnp.asarray(seq_slot, jnp.int32)))


# ---------------------------------------------------------------------------------------------- buffers
def _check_id(state: HybridState, layer_id: int) -> str:
    if not 0 <= layer_id < state.layout.num_layer_ids:
        raise ValueError(f"layer id {layer_id} out of range [0, {state.layout.num_layer_ids})")
    return state.layout.kinds[layer_id]


def layer_buffers(state: HybridState, layer_id: int) -> dict:
    """The arrays behind one layer id: recurrent -> ``conv`` / ``ssm`` ``[S, ...]``; attention -> NVFP4 ``data`` /
    ``scales`` / ``gs`` (or ``rows`` for a plain / no-twin dtype); draft -> plain ``rows`` / ``scale``;
    retained -> the twin's ``rows`` / ``scale`` of the attention layer it shadows."""
    kind, i = _check_id(state, layer_id), state.layout.local[layer_id]
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


def recurrent_forward(state: HybridState, rec_layer, seq_slots, x, valid, params):
    """Run a block of tokens through recurrent layer ``rec_layer`` (index among recurrent layers; may be traced).

    Args:
      seq_slots: i32[B] (-1 = padding row).
      x: ``[B, T, conv_dim]`` inputs; ``valid`` bool[B, T] (a row's valid tokens first; invalid ones leave the
        state unchanged). A verify block has ``T <= max_draft_len + 1``; longer prefill chunks update the state
        but only the first ``max_draft_len + 1`` snapshots are kept (rollback is for verify blocks).
      params: `init_recurrent_params` output (all layers).
    Returns ``(state', y f32[B, T, conv_dim])``; ``snap[:, j]`` holds the state after tokens ``0..j``.
    """
    seq = jnp.asarray(seq_slots, jnp.int32)
    s_max = state.conv.shape[0]
    safe = jnp.clip(seq, 0, s_max - 1)
    p = jax.tree.map(lambda a: a[rec_layer], params)
    step = jax.vmap(mamba_step_reference, in_axes=(0, 0, 0, None))

    def body(carry, inp):
        conv, ssm = carry
        xt, vt = inp
        nc, ns, y = step(conv, ssm, xt, p)
        conv = jnp.where(vt[:, None, None], nc, conv)
        ssm = jnp.where(vt[:, None, None, None], ns, ssm)
        return (conv, ssm), (conv, ssm, y)

    init = (state.conv[safe, rec_layer], state.ssm[safe, rec_layer])
    (conv, ssm), (cs, ss, y) = jax.lax.scan(body, init, (jnp.swapaxes(x, 0, 1), jnp.swapaxes(valid, 0, 1)))
    dst = jnp.where(seq >= 0, seq, s_max)
    nsnap = min(state.conv_snap.shape[1], x.shape[1])
    conv_snap, ssm_snap = state.conv_snap, state.ssm_snap
    for j in range(nsnap):
        conv_snap = conv_snap.at[dst, j, rec_layer].set(cs[j], mode="drop")
        ssm_snap = ssm_snap.at[dst, j, rec_layer].set(ss[j], mode="drop")
    return dataclasses.replace(
        state, conv=state.conv.at[dst, rec_layer].set(conv, mode="drop"),
        ssm=state.ssm.at[dst, rec_layer].set(ssm, mode="drop"), conv_snap=conv_snap,
        ssm_snap=ssm_snap), jnp.swapaxes(y, 0, 1)


def rollback(state: HybridState, seq_slots, num_accepted) -> HybridState:
    """Recurrent state of the listed sequences after accepting ``num_accepted`` drafts of the last verify block:
    ``snap[num_accepted]`` (state after the verified token and the accepted drafts), every recurrent layer.
    ``num_accepted`` i32[B] or scalar in ``[0, max_draft_len]`` (clipped)."""
    seq = jnp.asarray(seq_slots, jnp.int32)
    a = jnp.clip(jnp.broadcast_to(jnp.asarray(num_accepted, jnp.int32), seq.shape), 0, state.conv_snap.shape[1] - 1)
    s_max = state.conv.shape[0]
    safe, dst = jnp.clip(seq, 0, s_max - 1), jnp.where(seq >= 0, seq, s_max)
    return dataclasses.replace(state, conv=state.conv.at[dst].set(state.conv_snap[safe, a], mode="drop"),
                               ssm=state.ssm.at[dst].set(state.ssm_snap[safe, a], mode="drop"))


def accept_hybrid(state: HybridState, seq_slots, num_accepted, num_drafts, draft_tree=None) -> HybridState:
    """`jmixedkv.speculative.accept` on the attention cache and `rollback` of the recurrent state, together."""
    attn = spec.accept(state.attn, seq_slots, num_accepted, num_drafts, draft_tree=draft_tree)
    return rollback(dataclasses.replace(state, attn=attn), seq_slots, num_accepted)

