"""Pure-jnp references for the read side: what every reader must see.

`stage_reference` builds, for a batch of sequences and one layer, the dense K/V in the attention dtype:
the high row where the position is retained (``p < first_n`` or ``n - last_n <= p < n``), else the dequantized
NVFP4 row (or the plain row for plain groups). Rows at or beyond ``n`` are zero. It is the oracle for `stage`,
`gather_rows` and the fused decode kernel, and never imports a kernel.

`attention_reference` is float32 attention over such a dense cache (GQA, multi-token causal verify, optional
sliding window and soft-cap), returning the output and the log-sum-exp.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from . import checks
from .pools import read_low_rows, read_row_pool

__all__ = ["stage_reference", "rows_reference", "attention_reference"]


def rows_reference(state, layer, seq, pos, group: int = 0, kv_lens=None, dtype=None):
    """Rows a reader sees at tokens ``(seq[...], pos[...])`` -> ``[..., kv, H, D]`` in ``dtype`` (default: the
    attention dtype; ``float32`` gives the decoded values before any rounding to it).

    Positions outside ``[0, n)``, padding (``seq == -1``) and rows whose page is not held read as zero. A bad
    slot (outside ``[-1, max_seqs)``), a bad layer (outside ``[0, num_layers)``, traced) or a length outside
    ``[0, max_pages * page]`` reads as NaN: never another sequence's rows (`jmixedkv.checks`)."""
    cfg, kind, pools = state.config, state.kinds[group], state.pools[group]
    dtype = cfg.attention_dtype if dtype is None else jnp.dtype(dtype)
    kv_lens = state.kv_lens if kv_lens is None else jnp.asarray(kv_lens, jnp.int32)
    page = cfg.page_size
    spec = state.groups[group]
    layer = checks.check_layer_arg(layer, spec.num_layers, "rows_reference", spec.name)
    layer, layer_ok = checks.layer_in_range(layer, spec.num_layers)
    seq = jnp.asarray(seq, jnp.int32)
    s = jnp.clip(seq, 0, state.max_seqs - 1)
    n_raw = kv_lens[s]
    bad = ((seq < -1) | (seq >= state.max_seqs)
           | ((seq >= 0) & ((n_raw < 0) | (n_raw > state.max_pages_per_seq * page))) | ~layer_ok)
    n = jnp.where((seq >= 0) & ~bad, n_raw, 0)
    q = pos // page
    low_page = state.page_table[s, jnp.clip(q, 0, state.max_pages_per_seq - 1)]
    valid = (seq >= 0) & (pos >= 0) & (pos < n) & (q < state.max_pages_per_seq) & (low_page >= 0)
    lp, row = jnp.maximum(low_page, 0), pos % page
    if kind == "plain":
        out = read_row_pool(pools.plain, layer, lp, row, dtype)
    else:
        out = read_low_rows(pools.low, layer, lp, row, dtype)
    if kind == "mixed" and pools.high is not None:
        hpage, held = cfg.twin.twin_page(state.high_table, s, cfg.twin.high_column(pos))
        keep = cfg.twin.is_retained(pos, n) & held & valid
        high = read_row_pool(pools.high, layer, jnp.maximum(hpage, 0), row, dtype)
        out = jnp.where(keep[..., None, None, None], high, out)
    out = jnp.where(valid[..., None, None, None], out, jnp.zeros((), dtype))
    return jnp.where(bad[..., None, None, None], jnp.array(jnp.nan, dtype), out)


def stage_reference(state, layer, seq_slots, group: int = 0, kv_lens=None, dtype=None):
    """Dense cache a reader must see: ``[B, kv, H, max_pages * page, D]`` in the attention dtype.

    Args:
      state: `CacheState`.
      layer: layer index within the group.
      seq_slots: i32[B] sequence slots (-1 = padding row, all zeros).
      kv_lens: optional override of the lengths (default ``state.kv_lens``).
      dtype: output dtype (default the attention dtype). ``float32`` keeps the decoded NVFP4 / FP8 values exact
        (``(e2m1 * s) * gs`` in float32): the oracle of the fused decode kernel, which never rounds them.
    """
    seq = jnp.asarray(seq_slots, jnp.int32)
    s_max = state.max_pages_per_seq * state.page_size
    pos = jnp.arange(s_max, dtype=jnp.int32)
    rows = rows_reference(state, layer, seq[:, None], pos[None, :], group, kv_lens, dtype)  # [B, S, kv, H, D]
    return jnp.transpose(rows, (0, 2, 3, 1, 4))


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
