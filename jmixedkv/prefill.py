"""Prefill attention: `chunk_attention` of a chunk of new queries over each sequence's whole cache, in memory linear
in the chunk and the context (never a ``[T, S]`` or ``[S, S]`` score matrix), and its dense float32 reference
`chunk_attention_reference`.

A prefill (or one chunk of a chunked prefill) appends its K/V first (`jmixedkv.state.append`), then its ``T``
queries attend causally over everything the sequence holds: the history cached by earlier chunks and the chunk's own
rows. `chunk_attention` reads the cache as every other reader does -- the twin's row where the position is retained,
the dequantized NVFP4 row elsewhere, the row pool of a plain group -- by staging the rows once per call
(`jmixedkv.staging.stage`, the Pallas kernel on a GPU, ``as_stored=True``: one page per ``page`` rows, in the
attention dtype), then runs a blocked flash attention over the staged pages:

* queries in blocks of ``q_block`` tokens (a ``lax.scan``), each block's GQA group flattened into ``q_block * G``
  rows per KV head;
* per query block, keys in blocks of ``k_block`` tokens (a whole number of pages, gathered from the staged pages
  by the staged page table), only the blocks a query of the block can see (a ``fori_loop`` from the first block
  the sliding window reaches to the block of the block's last position: causal blocks past it are never read);
* an online softmax per query row (running max ``m``, running sum ``l``, float32 accumulator): logits
  ``q . k`` in float32 (bf16 / fp16 products, float32 accumulation), the probabilities rounded to the attention
  dtype for the ``p @ V`` product (as FlashAttention does; float32 with ``HIGHEST`` precision for a float32
  attention dtype), the output ``acc / l`` rounded once to the attention dtype.

cuDNN (``implementation="auto"`` on a GPU, 16-bit attention dtype, no ``soft_cap``): a contiguous chunk -- every
row's queries are its positions ``start, start + 1, ...`` (padding ``-1`` only after them: a whole prompt, a
prefill chunk after cached history or a reused prefix) -- runs cuDNN's fused attention instead, over the staged rows
made dense (``[B, W * page, H, D]``, a linear copy): the chunk's own rows with the causal mask, the history (keys
``< start``, skipped when no row has any) unmasked, the two merged by their float32 LSEs
(`jmixedkv.compat.cudnn_attention_lse`, `jmixedkv.decode.merge_attention`). With a sliding window only a chunk
without history goes to cuDNN. Any other chunk runs the blocked flash (the choice is a ``lax.cond`` on the
positions: one program). cuDNN rounds the probabilities to the attention dtype too and accumulates in float32.

Memory: the staged pages (``B * W * page`` rows of K and V in the attention dtype, linear in the context) plus, per
step, ``[B, H, q_block * G, k_block]`` float32 logits and the ``[B, H, q_block * G, D]`` accumulator: linear in
the chunk ``T`` and in the context ``S`` (tests/test_prefill.py asserts it on the compiled program).

Levers (`jmixedkv.levers`): model-space ``q`` in, model-space output out, as `jmixedkv.decode.decode_attention`:
with ``rotation="hadamard"`` the staged rows are the stored (rotated) rows, ``q`` is rotated (float32, one
rounding to the attention dtype) and the float32 output un-rotated before its one rounding; the LSE is unchanged.
With ``k_smoothing`` every stored key (the chunk's own and the history) is shifted by the slot's one frozen mean,
so the output is the model's and the LSE is returned for the raw keys (``+ sm_scale * q . mean``); ``soft_cap`` is
refused (module docstring of `jmixedkv.decode`).

Bad input (`jmixedkv.checks`): host values out of range raise `ValueError` naming the value; inside jit a batch
row whose slot is outside ``[-1, max_seqs)`` or not admitted, every row when the layer is out of range, and a query
whose explicit position lies outside ``[-1, kv_len)`` (its own key is not cached) get ``out = NaN``, ``lse = NaN``;
every other row is computed as if the bad one were padding. Padding rows (slot -1) and padding queries (position
-1) get ``out = 0``, ``lse = -inf``.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import checks, levers
from .compat import cudnn_attention_lse, on_gpu
from .decode import merge_attention
from .staging import stage, stage_reference

__all__ = ["chunk_attention", "chunk_attention_reference", "Q_BLOCK", "K_BLOCK", "IMPLEMENTATIONS"]

#: default query block (tokens) and key block (tokens, rounded up to whole pages) of `chunk_attention`
Q_BLOCK, K_BLOCK = 256, 512
IMPLEMENTATIONS = ("auto", "flash")


def _validate(state, layer, q, seq_slots, positions, group, sm_scale, sliding_window, soft_cap, q_block, k_block):
    op = "chunk_attention"
    spec, cfg = checks.check_group(state, group, op), state.config
    if layer is None or not checks.is_jax(layer):
        checks.host_int(layer, "layer", op, 0, spec.num_layers)
    else:
        checks.index_array(layer, "layer", op, ndim=0)
    if getattr(q, "ndim", None) != 4:
        raise ValueError(f"{op}: q must be [B, T, Hq, D], got shape {getattr(q, 'shape', None)}")
    b, t = q.shape[:2]
    if t < 1:
        raise ValueError(f"{op}: q has T={t} query tokens; expected at least 1")
    if spec.kv_factor != 2:
        raise ValueError(f"{op}: group {spec.name!r} stores an MLA latent (kv_factor=1); chunk_attention reads K/V")
    seq = checks.attention_query(op, spec, cfg, q, seq_slots, state.max_seqs)
    if positions is not None:
        pos = checks.index_array(positions, "positions", op, -1, checks.INT32_MAX)
        if pos.shape != (b, t):
            raise ValueError(f"{op}: positions must be i32[B={b}, T={t}], got shape {tuple(pos.shape)}")
    checks.attention_options(op, cfg, sm_scale, sliding_window, soft_cap)
    for name, value in (("q_block", q_block), ("k_block", k_block)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{op}: {name} must be an int >= 1, got {value!r}")
    if positions is not None and not checks.is_traced(state, seq_slots, positions):
        _check_positions(state, np.asarray(seq), np.asarray(positions))


def _check_positions(state, seq, pos):
    """Host check of explicit positions: every live query's key is cached (``position < kv_len`` of its slot)."""
    lens = np.asarray(state.kv_lens)
    active = np.asarray(state.active)
    for b, s in enumerate(seq):
        if s < 0:
            continue
        if not active[s]:
            raise ValueError(f"chunk_attention: seq_slots[{b}]={s} is not admitted (an idle slot holds no sequence)")
        over = np.flatnonzero(pos[b] >= lens[s])
        if over.size:
            t = int(over[0])
            raise ValueError(f"chunk_attention: positions[{b}, {t}]={int(pos[b, t])} >= kv_len {int(lens[s])} of "
                             f"sequence slot {s}: append the chunk's K/V before attending")


def chunk_attention(state, layer, q, seq_slots, positions=None, *, group: int = 0, sm_scale: Optional[float] = None,
                    sliding_window: Optional[int] = None, soft_cap: Optional[float] = None, q_block: int = Q_BLOCK,
                    k_block: int = K_BLOCK, backend: str = "auto", implementation: str = "auto"):
    """Causal attention of a prefill chunk's queries over each sequence's whole cache (one layer; module docstring).

    Args:
      state: `CacheState` holding the chunk's K/V already (append first).
      layer: layer index within ``group`` (int or traced i32[]).
      q: ``[B, T, Hq, D]`` in the attention dtype, model space (a rotation lever is applied here); GQA groups of
        ``Hq // H`` consecutive query heads per KV head.
      seq_slots: i32[B] sequence slots (-1 = padding row: output zeros, LSE -inf).
      positions: i32[B, T] position of each query (-1 = padding query); the query at position ``p`` sees the keys
        ``j <= p`` (``j > p - sliding_window`` with a window). None: the last ``T`` positions of each sequence,
        ``kv_len - T + t`` (a row shorter than ``T`` gets padding queries in front), as `decode_attention`.
      sm_scale: logit scale (default ``D ** -0.5``); sliding_window: int >= 1 or None; soft_cap: logits
        ``c * tanh(logits / c)``.
      q_block / k_block: static block sizes in tokens (``k_block`` rounded up to whole pages): the working set of
        one step is ``[B, H, q_block * Hq / H, k_block]`` float32 logits.
      backend: staging backend, ``"auto"`` (the Pallas stage kernel on a GPU) | ``"pallas"`` | ``"reference"``.
      implementation: ``"flash"`` (the blocked flash, everywhere) or ``"auto"``: on a GPU with a 16-bit attention
        dtype and no ``soft_cap``, a contiguous chunk (module docstring, "cuDNN") runs cuDNN's fused attention,
        any other chunk the blocked flash (one ``lax.cond``); elsewhere the blocked flash.

    Returns:
      ``(out [B, T, Hq, D] attention dtype, model space; lse f32[B, T, Hq])`` (natural-log LSE of the scaled
      logits; ``-inf`` for a query that sees no key).
    """
    _validate(state, layer, q, seq_slots, positions, group, sm_scale, sliding_window, soft_cap, q_block, k_block)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"chunk_attention: implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    seq = checks.index_array(seq_slots, "seq_slots", "chunk_attention")
    pos = None if positions is None else checks.index_array(positions, "positions", "chunk_attention")
    use_cudnn = (implementation == "auto" and on_gpu() and soft_cap is None
                 and jnp.dtype(state.config.attention_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)))
    return _attend(state, layer, q, seq, pos, group=group, sm_scale=sm_scale, sliding_window=sliding_window,
                   soft_cap=soft_cap, q_block=q_block, k_block=k_block, backend=backend, cudnn=use_cudnn)


def _lens(state, seq):
    return jnp.where(seq >= 0, state.kv_lens[jnp.clip(seq, 0, state.max_seqs - 1)], 0)


def _query_positions(state, seq, positions, t):
    """``(qpos i32[B, T] with -1 for padding / bad queries, bad bool[B, T], lens i32[B])`` for checked slots."""
    lens = _lens(state, seq)
    if positions is None:
        qpos = lens[:, None] - t + jnp.arange(t, dtype=jnp.int32)[None, :]
        bad = jnp.zeros(qpos.shape, bool)
    else:
        qpos = positions
        bad = (seq >= 0)[:, None] & ((qpos < -1) | (qpos >= lens[:, None]))
    qpos = jnp.where((seq >= 0)[:, None] & ~bad & (qpos >= 0), qpos, -1)
    return qpos, bad, lens


@functools.partial(jax.jit, static_argnames=("group", "sm_scale", "sliding_window", "soft_cap", "q_block",
                                             "k_block", "backend", "cudnn"))
def _attend(state, layer, q, seq, positions, *, group, sm_scale, sliding_window, soft_cap, q_block, k_block,
            backend, cudnn=False):
    """The body of `chunk_attention` (validated arguments): checks, staging, the blocked flash, the levers."""
    cfg, spec = state.config, state.groups[group]
    dtype, rotation = jnp.dtype(cfg.attention_dtype), cfg.rotation
    q = levers.unrotate(q, rotation, dtype)                        # q Hd: the basis of the stored keys
    layer_c, layer_ok = checks.layer_in_range(layer, spec.num_layers)
    bad_row = (seq < -1) | (seq >= state.max_seqs) | checks.unadmitted_rows(state, seq) | ~layer_ok
    seq = jnp.where(bad_row, -1, seq)
    qpos, bad_q, lens = _query_positions(state, seq, positions, q.shape[1])
    staged = stage(state, layer_c, seq, group=group, backend=backend, validate=False, as_stored=True)
    flash = functools.partial(_flash, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                              q_block=q_block, k_block=k_block)
    args = (q, staged.pages, staged.page_table, lens, qpos)
    if cudnn:
        fused = functools.partial(_cudnn, sm_scale=sm_scale, sliding_window=sliding_window)
        contiguous, start, _ = _chunk_start(qpos)
        if sliding_window is not None:
            contiguous &= jnp.all(start == 0)
        out, lse = jax.lax.cond(contiguous, fused, flash, *args)
    else:
        out, lse = flash(*args)
    out = levers.unrotate(out, rotation, dtype)                    # (p @ V Hd) Hd = p @ V, one rounding
    if state.k_means is not None:                                  # the LSE of the raw keys (k = stored + mean)
        lse = lse + levers.mean_logit(state.k_means[group], layer_c, seq, q, sm_scale)
    bad = bad_row[:, None] | bad_q
    out = jnp.where(bad[..., None, None], jnp.array(jnp.nan, dtype), out)
    return out, jnp.where(bad[..., None], jnp.nan, lse)


def _flash(q, pages, table, lens, qpos, *, sm_scale, sliding_window, soft_cap, q_block, k_block):
    """Blocked causal attention over staged pages.

    Args:
      q: ``[B, T, Hq, D]`` (attention dtype, the pages' basis); pages: ``[N, 2, H, page, D]``; table: i32[B, W]
        staged page ids (-1 past a row's pages); lens: i32[B] keys per row; qpos: i32[B, T] (-1 = no query).

    Returns:
      ``(out f32[B, T, Hq, D], lse f32[B, T, Hq])``; a query with no visible key gets zeros and -inf.
    """
    b, t, hq, d = q.shape
    h, page = pages.shape[2], pages.shape[3]
    g = hq // h
    scale = d ** -0.5 if sm_scale is None else sm_scale
    tq = min(q_block, t)
    nqb = -(-t // tq)
    per = max(1, -(-k_block // page))                            # pages per key block
    kb = per * page
    width = -(-table.shape[1] // per) * per
    table = jnp.pad(table, ((0, 0), (0, width - table.shape[1])), constant_values=-1)
    tp = nqb * tq
    qp = jnp.pad(q, ((0, 0), (0, tp - t), (0, 0), (0, 0)))
    qp = qp.reshape(b, nqb, tq, h, g, d).transpose(1, 0, 3, 2, 4, 5).reshape(nqb, b, h, tq * g, d)
    pos = jnp.pad(qpos, ((0, 0), (0, tp - t)), constant_values=-1).reshape(b, nqb, tq).transpose(1, 0, 2)
    pv_precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

    def key_block(j, carry, qb, rowpos):
        acc, m, l = carry
        ids = jax.lax.dynamic_slice_in_dim(table, j * per, per, axis=1)                 # [B, per]
        kv = pages[jnp.maximum(ids, 0)]                                                  # [B, per, 2, H, page, D]
        kv = jnp.moveaxis(kv, 1, 3).reshape(b, 2, h, kb, d)
        kpos = j * kb + jnp.arange(kb, dtype=jnp.int32)
        held = (kpos[None, :] < lens[:, None]) & (jnp.repeat(ids, page, axis=1) >= 0)     # [B, kb]
        kv = jnp.where(held[:, None, None, :, None], kv, jnp.zeros((), kv.dtype))
        s = jnp.einsum("bhmd,bhkd->bhmk", qb, kv[:, 0], preferred_element_type=jnp.float32) * scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        see = held[:, None, None, :] & (kpos[None, None, None, :] <= rowpos[:, None, :, None])
        if sliding_window is not None:
            see &= kpos[None, None, None, :] > rowpos[:, None, :, None] - sliding_window
        s = jnp.where(see, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)             # NaN stays NaN: propagated, never hidden
        p = jnp.exp(s - m_use[..., None])
        alpha = jnp.exp(m - m_use)
        pv = jnp.einsum("bhmk,bhkd->bhmd", p.astype(kv.dtype), kv[:, 1], preferred_element_type=jnp.float32,
                        precision=pv_precision)
        return alpha[..., None] * acc + pv, m_new, alpha * l + jnp.sum(p, axis=-1)

    def query_block(_, xs):
        qb, bpos = xs                                                   # [B, H, tq*G, D], [B, tq]
        rowpos = jnp.repeat(bpos, g, axis=1)                            # [B, tq*G]: row t*G + g
        live = bpos >= 0
        last = jnp.max(jnp.where(live, bpos, -1))
        hi = (last + kb) // kb                                          # blocks up to the last query's position
        lo = jnp.int32(0)
        if sliding_window is not None:
            first = jnp.min(jnp.where(live, bpos - sliding_window + 1, jnp.iinfo(jnp.int32).max))
            lo = jnp.clip(first, 0, None) // kb
            lo = jnp.minimum(lo, hi)
        init = (jnp.zeros((b, h, tq * g, d), jnp.float32), jnp.full((b, h, tq * g), -jnp.inf, jnp.float32),
                jnp.zeros((b, h, tq * g), jnp.float32))
        acc, m, l = jax.lax.fori_loop(lo, hi, functools.partial(key_block, qb=qb, rowpos=rowpos), init)
        ok = l != 0                                                     # NaN stays NaN
        out = jnp.where(ok[..., None], acc / jnp.where(ok, l, 1.0)[..., None], 0.0)
        lse = jnp.where(ok, m + jnp.log(jnp.where(ok, l, 1.0)), -jnp.inf)
        return None, (out, lse)

    _, (out, lse) = jax.lax.scan(query_block, None, (qp, pos))          # [nqb, B, H, tq*G, D], [nqb, B, H, tq*G]
    out = out.reshape(nqb, b, h, tq, g, d).transpose(1, 0, 3, 2, 4, 5).reshape(b, tp, hq, d)[:, :t]
    lse = lse.reshape(nqb, b, h, tq, g).transpose(1, 0, 3, 2, 4).reshape(b, tp, hq)[:, :t]
    return out, lse


def _chunk_start(qpos):
    """``(contiguous bool[], start i32[B], count i32[B])``: whether every row's live queries are ``start, start + 1,
    ...`` from its first entry on (padding ``-1`` only after them), and each row's first position and count."""
    t = jnp.arange(qpos.shape[1], dtype=jnp.int32)[None, :]
    count = jnp.sum(qpos >= 0, axis=1).astype(jnp.int32)
    start = jnp.where(count > 0, qpos[:, 0], 0)
    want = jnp.where(t < count[:, None], start[:, None] + t, -1)
    return jnp.all(qpos == want), start, count


def _cudnn(q, pages, table, lens, qpos, *, sm_scale, sliding_window):
    """cuDNN fused attention of a contiguous chunk (`_chunk_start`) over its staged rows made dense
    (``[B, W * page, H, D]``): the chunk's own rows causally, the history (keys ``< start``) without a mask, merged
    by their float32 LSEs (`jmixedkv.compat.cudnn_attention_lse`). ``(out f32[B, T, Hq, D], lse f32[B, T, Hq])``.
    With a sliding window only a chunk without history comes here (cuDNN's window needs the causal mask)."""
    b, t, hq, d = q.shape
    w, h, page = table.shape[1], pages.shape[2], pages.shape[3]
    scale = d ** -0.5 if sm_scale is None else sm_scale
    kv = pages[jnp.maximum(table, 0)]                                   # [B, W, 2, H, page, D]
    k, v = jnp.transpose(kv, (2, 0, 1, 4, 3, 5)).reshape(2, b, w * page, h, d)
    _, start, count = _chunk_start(qpos)
    own = jnp.clip(start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :], 0, w * page - 1)[..., None, None]
    o_own, l_own = cudnn_attention_lse(q, jnp.take_along_axis(k, own, axis=1), jnp.take_along_axis(v, own, axis=1),
                                       count, count, scale=scale, causal=True, window=sliding_window)
    o_own = o_own.astype(jnp.float32)

    def with_history(_):
        o_hist, l_hist = cudnn_attention_lse(q, k, v, count, start, scale=scale, causal=False)
        seen = (start > 0)[:, None, None]
        return merge_attention(o_own, l_own, jnp.where(seen[..., None], o_hist.astype(jnp.float32), 0.0),
                               jnp.where(seen, l_hist, -jnp.inf))

    if sliding_window is None:
        out, lse = jax.lax.cond(jnp.any(start > 0), with_history, lambda _: (o_own, l_own), None)
    else:
        out, lse = o_own, l_own
    live = qpos >= 0
    return jnp.where(live[..., None, None], out, 0.0), jnp.where(live[..., None], lse, -jnp.inf)


def chunk_attention_reference(state, layer, q, seq_slots, positions=None, *, group: int = 0, sm_scale=None,
                              sliding_window=None, soft_cap=None):
    """Dense float32 oracle of `chunk_attention`: ``[B, T, Hq, S]`` logits (tests and small sizes only).

    The rows of `jmixedkv.staging.stage_reference` as stored (attention dtype) and float32 attention with each
    query's own causal mask (explicit ``positions``, or None: ``kv_len - T + t``); under a rotation lever ``q`` is
    rotated first (one rounding to the attention dtype) and the float32 output un-rotated, as `chunk_attention`
    does. Returns ``(out f32[B, T, Hq, D], lse f32[B, T, Hq])``: zeros and -inf for padding rows / queries and for
    queries that see no key. No bad-input flags (valid input only)."""
    seq = jnp.asarray(seq_slots, jnp.int32)
    b, t, hq, d = q.shape
    rotation = state.config.rotation
    q = levers.unrotate(q, rotation, q.dtype)
    pos = None if positions is None else jnp.asarray(positions, jnp.int32)
    qpos, _, _ = _query_positions(state, seq, pos, t)
    staged = stage_reference(state, layer, seq, group, as_stored=True).astype(jnp.float32)   # [B, 2, H, S, D]
    h, s_len = staged.shape[2], staged.shape[3]
    hi = jax.lax.Precision.HIGHEST
    qf = q.astype(jnp.float32).reshape(b, t, h, hq // h, d)
    logits = jnp.einsum("btkgd,bksd->btkgs", qf, staged[:, 0], precision=hi) * (d ** -0.5 if sm_scale is None
                                                                                 else sm_scale)
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    kpos = jnp.arange(s_len)[None, None, :]
    see = (kpos <= qpos[..., None]) & (qpos[..., None] >= 0)
    if sliding_window is not None:
        see &= kpos > qpos[..., None] - sliding_window
    logits = jnp.where(see[:, :, None, None, :], logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)
    ok = lse > -jnp.inf
    p = jnp.exp(logits - jnp.where(ok, lse, 0.0)[..., None])
    out = jnp.einsum("btkgs,bksd->btkgd", p, staged[:, 1], precision=hi)
    out = levers.rotate(jnp.where(ok[..., None], out, 0.0).reshape(b, t, hq, d), rotation)
    lse = lse.reshape(b, t, hq)
    if state.k_means is not None:                                  # raw keys' LSE, as `chunk_attention`
        lse = lse + levers.mean_logit(state.k_means[group], layer, seq, q, sm_scale)
    return out, lse
