"""Decode attention: `decode_attention` over a `CacheState`, its float32 references, and merging partial attentions.

* `decode_attention(state, layer, q, seq_slots, ...)`: decode / speculative-verify attention of one layer of one
  group over the cache a reader must see (retained rows from the high twin, NVFP4 elsewhere; plain groups read
  their row pool). ``backend="pallas"`` runs the fused kernel (`pallas_kernels.decode`; interpret mode
  without a GPU), ``"reference"`` runs float32 `attention_reference` over `jmixedkv.staging.stage_reference`,
  ``"auto"`` picks the kernel on a GPU.
* `attention_reference` (dense K/V: GQA, multi-token causal verify, sliding window, soft-cap) and
  `paged_attention_reference` (over a `StagedCache`: the end-to-end check of `stage`): float32, with the LSE.
* `merge_attention(o1, lse1, o2, lse2)`: combine two attentions over disjoint key sets (e.g. cache + a chunk).

`decode_attention` and `merge_attention` return the output in the attention dtype and the natural-log LSE in float32.

Levers (`jmixedkv.levers`): `decode_attention` takes model-space queries and returns model-space outputs whatever
the cache's levers. With ``rotation="hadamard"`` the stored K/V are ``k Hd``, ``v Hd``; it rotates q (``q Hd``,
float32 math, one rounding to the attention dtype: the kernels take q in that dtype), runs the kernel on the
stored rows, and un-rotates the output (``Hd`` is its own inverse; float32 math, one more rounding), all in one
jitted program. The LSE is unchanged (``(q Hd) . (k Hd) = q . k``). Against the same attention without rotation
the output differs by the rounding of the rotated q (relative ``2^-8`` per element for bf16) and of the rotated
output, i.e. within the attention dtype's rounding. With ``k_smoothing`` the stored keys are ``k - mean`` (the
state's ``k_means``, stored frame): every logit of a query shifts by ``-sm_scale * q . mean``, so the softmax and
the output are the model's; the LSE returned is that of the raw keys (the kernel's LSE plus
``sm_scale * q . mean``, with the rotated q under a rotation lever), so it merges with attention over keys held
elsewhere. A ``soft_cap`` does not commute with the shift and is refused on such a cache.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from . import checks, levers
from .backend import dispatch
from .pools import kernel_arrays
from .staging import stage_reference

__all__ = ["decode_attention", "attention_reference", "paged_attention_reference", "merge_attention"]


def _validate(state, layer, q, seq_slots, group, sm_scale, sliding_window, soft_cap, num_splits, split_heads):
    spec, cfg = checks.check_group(state, group, "decode_attention"), state.config
    if layer is None or not checks.is_jax(layer):
        checks.host_int(layer, "layer", "decode_attention", 0, spec.num_layers)
    else:
        checks.index_array(layer, "layer", "decode_attention", ndim=0)             # an integer scalar
    if getattr(q, "ndim", None) != 4:
        raise ValueError(f"decode_attention: q must be [B, Tq, Hq, D], got shape {getattr(q, 'shape', None)}")
    tq = q.shape[1]
    if not 1 <= tq <= cfg.max_draft_len + 1:
        raise ValueError(f"decode_attention: Tq={tq} query tokens per sequence; expected 1..max_draft_len+1 "
                         f"= {cfg.max_draft_len + 1}")
    checks.attention_query("decode_attention", spec, cfg, q, seq_slots, state.max_seqs)
    checks.attention_options("decode_attention", cfg, sm_scale, sliding_window, soft_cap)
    for name, v in (("num_splits", num_splits), ("split_heads", split_heads)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"decode_attention: {name} must be an int >= 1 or None, got {v!r}")


def decode_attention(state, layer, q, seq_slots, *, group: int = 0, sm_scale: Optional[float] = None,
                     sliding_window: Optional[int] = None, soft_cap: Optional[float] = None,
                     num_splits: Optional[int] = None, split_heads: Optional[int] = None, backend: str = "auto"):
    """Decode / verify attention of ``q`` against the cached history of ``seq_slots`` (one layer).

    Args:
      state: `CacheState`.
      layer: layer index within ``group`` (int or traced i32).
      q: ``[B, Tq, Hq, D]`` in the attention dtype, model space (never rotated by the caller: a rotation lever
        is applied here, module docstring); token ``t`` of row ``b`` sits at position
        ``kv_lens[seq_slots[b]] - Tq + t`` (its K/V already appended) and sees keys ``p <=`` its position.
      seq_slots: i32[B] sequence slots (-1 = padding row: output zeros, LSE -inf).
      sm_scale: logit scale (default ``D ** -0.5``); sliding_window: keys ``pos - window < p <= pos``;
      soft_cap: logits ``c * tanh(logits / c)``; num_splits: split-K programs (kernel only; None = auto).
      split_heads: the KV head count the kernel's default tuning and splits are chosen for (kernel only; None =
        the state's): `jmixedkv.sharding.sharded_decode_attention` passes the whole count to every shard, so a
        shard's outputs are bitwise the one-device ones.
      backend: ``"auto"`` | ``"pallas"`` | ``"reference"``.

    Returns:
      ``(out [B, Tq, Hq, D] attention dtype, model space; lse f32[B, Tq, Hq])``.

    Bad input (`jmixedkv.checks`): host values (Python / NumPy slots, an int layer) out of range raise
    `ValueError`; inside jit a batch row whose slot is outside ``[-1, max_seqs)`` -- every row when the layer is
    outside the group -- gets ``out = NaN`` and ``lse = NaN`` (it never reads another sequence). A NaN (or inf)
    in a key or value the query sees propagates: that head's output and LSE are NaN, never those of an empty
    sequence (``out = 0, lse = -inf`` only when no key is visible).
    """
    _validate(state, layer, q, seq_slots, group, sm_scale, sliding_window, soft_cap, num_splits, split_heads)
    seq = checks.index_array(seq_slots, "seq_slots", "decode_attention")
    return _attend(state, layer, q, seq, group=group, sm_scale=sm_scale, sliding_window=sliding_window,
                   soft_cap=soft_cap, num_splits=num_splits, split_heads=split_heads, backend=backend)


@functools.partial(jax.jit, static_argnames=("group", "sm_scale", "sliding_window", "soft_cap", "num_splits",
                                             "split_heads", "backend"))
def _attend(state, layer, q, seq, *, group, sm_scale, sliding_window, soft_cap, num_splits, split_heads, backend):
    """The body of `decode_attention` (validated arguments): one program with the rotation lever around the kernel."""
    rotation = state.config.rotation
    q = levers.unrotate(q, rotation, q.dtype)                     # q Hd: the basis of the stored keys
    spec = state.groups[group]
    layer_c, layer_ok = checks.layer_in_range(layer, spec.num_layers)
    bad = (seq < -1) | (seq >= state.max_seqs) | checks.unadmitted_rows(state, seq) | ~layer_ok
    seq = jnp.where(bad, -1, seq)
    out, lse = dispatch(backend, _reference, _pallas)(state, layer_c, q, seq, group=group, sm_scale=sm_scale,
                                                      sliding_window=sliding_window, soft_cap=soft_cap,
                                                      num_splits=num_splits, split_heads=split_heads)
    out = levers.unrotate(out, rotation, out.dtype)               # (p @ V Hd) Hd = p @ V: model space
    if state.k_means is not None:                                 # the LSE of the raw keys, k = stored + mean
        lse = lse + levers.mean_logit(state.k_means[group], layer_c, seq, q, sm_scale)
    # a query that must see at least its own key but reports "no key" (lse = -inf) met a NaN logit: flag it
    tq = q.shape[1]
    qpos = _lens(state, seq)[:, None] - tq + jnp.arange(tq, dtype=jnp.int32)[None, :]
    hidden = (seq >= 0)[:, None, None] & (qpos >= 0)[..., None] & (lse == -jnp.inf)
    bad = bad[:, None, None] | hidden
    out = jnp.where(bad[..., None], jnp.array(jnp.nan, out.dtype), out)
    return out, jnp.where(bad, jnp.nan, lse)


def _lens(state, seq):
    return jnp.where(seq >= 0, state.kv_lens[jnp.clip(seq, 0, state.max_seqs - 1)], 0)


@functools.partial(jax.jit, static_argnames=("group", "sm_scale", "sliding_window", "soft_cap", "num_splits",
                                             "split_heads"))
def _reference(state, layer, q, seq, *, group, sm_scale, sliding_window, soft_cap, num_splits, split_heads):
    del num_splits, split_heads                                             # kernel tuning knobs
    # NVFP4 groups: the decoded values exactly (float32 staging), as the fused kernel reads them
    exact = jnp.float32 if state.kinds[group] != "plain" else None
    staged = stage_reference(state, layer, seq, group, dtype=exact, as_stored=True)    # [B, kv, H, S, D] stored
    k, v = staged[:, 0], staged[:, -1]
    lens = _lens(state, seq)
    out, lse = attention_reference(q, k, v, lens, sm_scale=sm_scale, sliding_window=sliding_window,
                                   soft_cap=soft_cap)
    empty = lse == -jnp.inf                  # no visible key: zeros (a NaN key gives NaN: propagated, not hidden)
    out = jnp.where(empty[..., None], 0.0, out)
    return out.astype(state.config.attention_dtype), lse


@functools.partial(jax.jit, static_argnames=("group", "sm_scale", "sliding_window", "soft_cap", "num_splits",
                                             "split_heads", "interpret"))
def _pallas(state, layer, q, seq, *, group, sm_scale, sliding_window, soft_cap, num_splits, split_heads, interpret):
    from pallas_kernels.decode import paged_decode_attention   # picks the backend (`choose_backend`)
    cfg, kind, pools = state.config, state.kinds[group], state.pools[group]
    s = jnp.clip(seq, 0, state.max_seqs - 1)
    page_table = state.page_table[s]
    lens = _lens(state, seq)
    mixed = kind == "mixed" and pools.high is not None
    twin, ht = (cfg.twin, state.high_table[s]) if mixed else (None, None)
    low, plain = kernel_arrays(pools.low), kernel_arrays(pools.plain)          # the kernels take raw arrays
    high = kernel_arrays(pools.high) if mixed else None
    return paged_decode_attention(
        q, page_table, lens, layer, low=low, high=high, plain=plain, high_table=ht, geom=twin,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, num_splits=num_splits,
        split_heads=split_heads, interpret=interpret, out_dtype=cfg.attention_dtype)


def attention_reference(q, k, v, kv_lens, *, sm_scale=None, sliding_window=None, soft_cap=None):
    """float32 decode / verify attention over a dense cache.

    Args:
      q: ``[B, Tq, Hq, D]`` queries; token ``t`` of sequence ``b`` sits at position ``kv_lens[b] - Tq + t``
        and sees keys ``p <= `` its position (causal among the ``Tq`` new tokens).
      k, v: ``[B, H, S, D]`` dense keys / values (``Hq % H == 0``; GQA groups of ``Hq // H``).
      kv_lens: i32[B].
      sliding_window: if set, a query at position ``i`` sees keys ``i - window < p <= i``.
      soft_cap: if set, logits ``c * tanh(logits / c)``.

    Returns:
      ``(out f32[B, Tq, Hq, D], lse f32[B, Tq, Hq])`` (natural-log LSE of the scaled logits).
    """
    b, tq, hq, d = q.shape
    h, s = k.shape[1], k.shape[2]
    g = hq // h
    sm_scale = d ** -0.5 if sm_scale is None else sm_scale
    qf = q.astype(jnp.float32).reshape(b, tq, h, g, d)
    logits = jnp.einsum("btkgd,bksd->btkgs", qf, k.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST) * sm_scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    qpos = kv_lens[:, None] - tq + jnp.arange(tq)[None, :]            # [B, Tq]
    kpos = jnp.arange(s)[None, None, :]
    mask = kpos <= qpos[..., None]
    if sliding_window is not None:
        mask &= kpos > qpos[..., None] - sliding_window
    mask = mask[:, :, None, None, :]
    logits = jnp.where(mask, logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)
    p = jnp.exp(logits - lse[..., None])
    out = jnp.einsum("btkgs,bksd->btkgd", p, v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return out.reshape(b, tq, hq, d), lse.reshape(b, tq, hq)


def paged_attention_reference(q, staged, *, layer: Optional[int] = None, sm_scale=None, sliding_window=None,
                              soft_cap=None):
    """`attention_reference` over a `jmixedkv.staging.StagedCache` of a K/V group (kv = 2; for an MLA latent, kv = 1,
    keys and values are both the latent); ``layer`` picks a layer of an all-layer staged cache."""
    dense = staged.to_dense(layer)                                   # [B, kv, H, S, D]
    return attention_reference(q, dense[:, 0], dense[:, -1], staged.kv_lens, sm_scale=sm_scale,
                               sliding_window=sliding_window, soft_cap=soft_cap)


def merge_attention(o1, lse1, o2, lse2):
    """Merge two attentions over disjoint key sets.

    Args:
      o1, o2: ``[..., D]`` normalized outputs (any float dtype); lse1, lse2: f32 ``[...]`` natural-log LSE
        (``-inf`` = no keys).

    Returns:
      ``(o [..., D] in o1's dtype, lse f32[...])``; NaN in either input's LSE gives NaN (never hidden).
    """
    if o1.shape != o2.shape or lse1.shape != lse2.shape or o1.shape[:-1] != lse1.shape:
        raise ValueError(f"merge_attention: shapes o1 {o1.shape}, lse1 {lse1.shape}, o2 {o2.shape}, "
                         f"lse2 {lse2.shape} do not match ([..., D] and [...])")
    lse1, lse2 = lse1.astype(jnp.float32), lse2.astype(jnp.float32)
    m = jnp.maximum(lse1, lse2)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w1, w2 = jnp.exp(lse1 - m_safe), jnp.exp(lse2 - m_safe)
    tot = w1 + w2
    ok = tot != 0                           # empty on both sides: zeros, -inf; a NaN side propagates (not hidden)
    den = jnp.where(ok, tot, 1.0)
    o = (w1[..., None] * o1.astype(jnp.float32) + w2[..., None] * o2.astype(jnp.float32)) / den[..., None]
    o = jnp.where(ok[..., None], o, 0.0)
    lse = jnp.where(ok, m_safe + jnp.log(den), -jnp.inf)
    return o.astype(o1.dtype), lse
