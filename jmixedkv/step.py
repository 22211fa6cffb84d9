"""One layer of an engine's step as ONE jitted, donated program: append the step's K/V, then read the cache.

An engine written around a per-layer ``attention(q, k, v)`` (transformers, a PyTorch engine over
`interop.TorchKVCache`) calls the cache twice per layer and step: store the new rows, read for attention. Two
programs per layer cost two dispatches and an intermediate state; these fuse them:

* `append_attend`: `jmixedkv.state.append` then `jmixedkv.decode.decode_attention` (decode / speculative verify,
  ``1 <= Tq <= max_draft_len + 1``), with the attention options models pass: ``sliding_window``, ``soft_cap`` and
  per-head attention ``sinks`` (an extra logit per query head that takes softmax mass and gives no value: the
  output scales by ``sigmoid(lse - sink)``; the returned LSE includes it).
* `append_dense`: append then the dense K/V a reader sees, ``[B, H, width * page, D]`` for ``width`` pages per row
  (static; the caller buckets it to the longest row), so the cost follows the tokens held, not the page table's
  width.

Both are jitted with the state donated (the pools update in place) and ``layer`` traced (every layer of a group
shares one compilation; a new program per distinct static option or shape only).

For an engine whose every layer appends the same tokens, the hot path splits a step instead: `plan_append` once
per step (refusals, page allocation, lengths), then per layer `layer_append` / `layer_attend` / `layer_dense`,
which donate and return only what a layer changes (`split_layer_state`) and leave the state the programs above
would, bit for bit (`interop.TorchKVCache.plan_step` and its ``step_*`` calls). None of these programs does
host checks: the caller (`interop.TorchKVCache.plan_step`) validates a step's slots and positions once on the
host, and a bad value met inside the program sets ``state.error`` with every sequence unchanged
(`jmixedkv.state.append`) and NaN outputs for the rows it refuses (`decode_attention`), as the unfused ops do.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from . import state as st
from .decode import decode_attention
from .rope import RopeSpec
from .staging import stage

__all__ = ["append_only", "append_attend", "append_attend_packed", "append_dense", "dense_rows", "apply_sinks",
           "plan_append", "plan_append_packed", "split_layer_state", "layer_part", "join_layer_state", "layer_append",
           "layer_attend", "layer_dense", "plan_write_layers"]


def _tokens(x):
    """Rows of a step as tokens: ``[T, H, D]`` as is, or ``[B, H, T, D]`` (transformers' layout) as ``[B * T, H,
    D]`` (token ``b * T + t``); the transpose is part of the caller's program (no copy outside it)."""
    if x is None or x.ndim == 3:
        return x
    b, h, t, d = x.shape
    return jnp.swapaxes(x, 1, 2).reshape(b * t, h, d)


def _unpack(k, v, packed: bool):
    """``packed``: ``k`` is ``[B, 2 H, T, D]``, K and V packed along the head axis (one engine buffer; ``v`` None)."""
    if packed:
        h = k.shape[1] // 2
        return k[:, :h], k[:, h:]
    return k, v


@functools.partial(jax.jit, donate_argnums=0, static_argnames=("group", "rope", "backend", "packed"))
def append_only(state, layer, k, v, seq, pos, *, group: int = 0, rope: Optional[RopeSpec] = None,
                backend: str = "auto", packed: bool = False):
    """`jmixedkv.state.append` of ``k, v`` (``[T, H, D]`` or ``[B, H, T, D]``, see `_tokens`) at ``seq`` / ``pos``
    i32[T] without host checks (the caller checked them once per step); ``state`` donated. ``packed``: K and V
    come as one ``[B, 2 H, T, D]`` buffer in ``k`` (``v`` None)."""
    k, v = _unpack(k, v, packed)
    return st.append_traced(state, layer, _tokens(k), _tokens(v), seq, pos, group=group, rope=rope, backend=backend)


def apply_sinks(out, lse, sinks):
    """Attention sinks as an LSE term: ``out [B, Tq, Hq, D]``, natural-log ``lse f32[B, Tq, Hq]``, ``sinks
    [Hq]`` (one logit per query head, already on the scaled-logit scale) -> ``(out * sigmoid(lse - sink), lse')``
    with ``lse' = logaddexp(lse, sink)``. A row with no visible key (``lse = -inf``) gives zeros."""
    s = sinks.astype(jnp.float32)[None, None, :]
    w = jax.nn.sigmoid(lse - s)
    return (out.astype(jnp.float32) * w[..., None]).astype(out.dtype), jnp.logaddexp(lse, s)


_ATTEND_STATIC = ("group", "rope", "backend", "sm_scale", "sliding_window", "soft_cap")


def _append_attend(state, layer, k, v, seq, pos, q, rows, sinks=None, *, group: int = 0,
                   rope: Optional[RopeSpec] = None, backend: str = "auto", sm_scale: Optional[float] = None,
                   sliding_window: Optional[int] = None, soft_cap: Optional[float] = None):
    if k.ndim == 4:
        q = jnp.swapaxes(q, 1, 2)
    state = st.append_traced(state, layer, _tokens(k), _tokens(v), seq, pos, group=group, rope=rope, backend=backend)
    out, lse = decode_attention(state, layer, q, rows, group=group, sm_scale=sm_scale,
                                sliding_window=sliding_window, soft_cap=soft_cap, backend=backend)
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks)
    return state, out, lse


append_attend = jax.jit(_append_attend, donate_argnums=0, static_argnames=_ATTEND_STATIC)
append_attend.__doc__ = """Append ``k, v`` (``[T, H, D]`` or ``[B, H, T, D]``) at ``seq`` / ``pos`` i32[T] (slot -1 =
padding token) to ``layer``, then decode attention of ``q`` (attention dtype; ``[B, Tq, Hq, D]``, or with ``k`` in
transformers' ``[B, H, T, D]`` layout, ``q [B, Hq, Tq, D]`` too) for batch rows ``rows`` i32[B] (-1 = padding).

Returns ``(state, out [B, Tq, Hq, D] attention dtype, lse f32[B, Tq, Hq])`` (natural-log LSE; with ``sinks
f32[Hq]`` the sink is part of both). ``state`` is donated."""


@functools.partial(jax.jit, donate_argnums=0, static_argnames=("num_kv_heads",) + _ATTEND_STATIC)
def append_attend_packed(state, layer, kvq, seq, pos, rows, sinks=None, *, num_kv_heads: int, **options):
    """`append_attend` with K, V and Q packed along the head axis, ``kvq [B, 2 H + Hq, T, D]`` (transformers'
    layout; one buffer crosses from the engine instead of three): ``k = kvq[:, :H]``, ``v = kvq[:, H:2H]``,
    ``q = kvq[:, 2H:]``."""
    h = num_kv_heads
    return _append_attend(state, layer, kvq[:, :h], kvq[:, h:2 * h], seq, pos, kvq[:, 2 * h:], rows, sinks,
                          **options)


@functools.partial(jax.jit, donate_argnums=0, static_argnames=("width", "group", "rope", "backend", "packed"))
def append_dense(state, layer, k, v, seq, pos, rows, *, width: int, group: int = 0,
                 rope: Optional[RopeSpec] = None, backend: str = "auto", packed: bool = False):
    """Append ``k, v`` (``[T, H, D]`` or ``[B, H, T, D]``) at ``seq`` / ``pos`` i32[T] to ``layer``, then the dense
    cache batch rows ``rows`` i32[B] read: ``(state, k [B, H, width * page, D], v [B, H, width * page, D])`` in the
    attention dtype (the staged rows: retained rows from the twin, others dequantized NVFP4), zero at rows
    ``>= kv_len``. ``width`` (static) must cover every row's pages (``ceil(kv_len / page) <= width``)."""
    k, v = _unpack(k, v, packed)
    state = st.append_traced(state, layer, _tokens(k), _tokens(v), seq, pos, group=group, rope=rope, backend=backend)
    return (state,) + dense_rows(state, layer, rows, width=width, group=group, backend=backend)


def dense_rows(state, layer, rows, *, width: int, group: int = 0, backend: str = "auto"):
    """The staged cache of ``rows`` i32[B] as dense ``(k, v)`` each ``[B, H, width * page, D]`` (``v`` is ``k``
    for an MLA latent), staging only ``B * width`` pages."""
    b, page = rows.shape[0], state.page_size
    staged = stage(state, layer, rows, group=group, backend=backend, num_staged_pages=b * width, width=width,
                   validate=False)
    table = staged.page_table[:, :width]
    got = staged.pages[jnp.maximum(table, 0)]                                   # [B, W, kv, H, page, D]
    got = jnp.transpose(got, (2, 0, 3, 1, 4, 5))
    kv, h, d = got.shape[0], got.shape[2], got.shape[-1]
    got = got.reshape(kv, b, h, width * page, d)
    p = jnp.arange(width * page, dtype=jnp.int32)
    ok = (table[:, p // page] >= 0) & (p[None, :] < staged.kv_lens[:, None])     # [B, S]
    got = jnp.where(ok[None, :, None, :, None], got, jnp.zeros((), got.dtype))
    return got[0], got[-1]


# ---------------------------------------------------------------------------------------- one plan, then layers
# The per-layer programs above repeat, in every layer, what is the same for all of them (the refusal checks, the
# page allocation, the length bookkeeping) and donate and return the whole state: ~20 arrays in and out per call,
# a few microseconds of host time each, and a kernel launch per piece of bookkeeping. `plan_append` does the shared
# part once per step; `layer_append` / `layer_attend` / `layer_dense` then take the state split in two
# (`split_layer_state`): what a layer changes (its group's pools, ``step_layers``, ``error``, its group's K means;
# donated) and the rest (read only, neither donated nor returned). Plan + layers leave the state the per-layer
# programs would, bit for bit (tests/test_step.py).

def plan_append(state, seq, pos, *, group: int = 0):
    """`jmixedkv.state.plan_append_traced` as a tables-only program (`jmixedkv.state.tables_only`: the tables are
    donated, the pools never copied): ``(state, AppendPlan)`` for one step's tokens ``seq`` / ``pos`` i32[T]. The
    program is `plan_append_packed`'s (no batch rows)."""
    state, plan, _ = plan_append_packed(state, jnp.concatenate([seq, pos]), num_rows=0, group=group)
    return state, plan


_PLAN_PROGRAMS: dict = {}


def plan_append_packed(state, tokens, *, num_rows: int, group: int = 0):
    """`plan_append` fed by ONE host array, for an engine's hot loop (one host-to-device copy per step instead of
    three ``jax.device_put`` calls): ``tokens`` i32[2 T + B] = ``seq | pos | rows`` (NumPy), ``num_rows`` = B
    (static). Returns ``(state, AppendPlan, (seq, pos, rows))``: the host array's three parts on the device."""
    key = (group, num_rows)
    run = _PLAN_PROGRAMS.get(key)
    if run is None:
        def transition(state, tokens):
            t = (tokens.shape[0] - num_rows) // 2
            seq, pos, rows = tokens[:t], tokens[t:2 * t], tokens[2 * t:]
            new, plan = st.plan_append_traced(state, seq, pos, group=group)
            return new, plan, (seq, pos, rows)
        run = _PLAN_PROGRAMS[key] = st.tables_only(transition)
    return run(state, tokens)


def split_layer_state(state, group: int = 0):
    """``(rest, mine)``: ``mine = (pools[group], step_layers, error, k_means[group] or None)``, what a layer's
    write changes; ``rest`` the state with those set to None (every other group's pools stay in it, untouched)."""
    km = state.k_means
    rest = dataclasses.replace(state, pools=state.pools[:group] + (None,) + state.pools[group + 1:],
                               step_layers=None, error=None,
                               k_means=None if km is None else km[:group] + (None,) + km[group + 1:])
    return rest, layer_part(state, group)


def layer_part(state, group: int = 0):
    """``mine`` of `split_layer_state` alone (what a layer program takes and returns)."""
    km = state.k_means
    return state.pools[group], state.step_layers, state.error, None if km is None else km[group]


def join_layer_state(rest, mine, group: int = 0):
    """The inverse of `split_layer_state`."""
    pools, step_layers, error, km = mine
    k_means = rest.k_means if km is None else rest.k_means[:group] + (km,) + rest.k_means[group + 1:]
    return dataclasses.replace(rest, pools=rest.pools[:group] + (pools,) + rest.pools[group + 1:],
                               step_layers=step_layers, error=error, k_means=k_means)


def _write(rest, mine, layer, k, v, plan, group, rope, backend, packed):
    k, v = _unpack(k, v, packed)
    state = join_layer_state(rest, mine, group)
    return st.write_layer_traced(state, layer, _tokens(k), _tokens(v), plan, group=group, rope=rope, backend=backend)


@functools.partial(jax.jit, donate_argnums=1, static_argnames=("group", "rope", "backend", "packed"))
def layer_append(rest, mine, layer, k, v, plan, *, group: int = 0, rope: Optional[RopeSpec] = None,
                 backend: str = "auto", packed: bool = False):
    """Store one layer's rows of a planned step (`plan_append`): ``k, v`` as in `append_only`; returns ``(mine,)``,
    the new `split_layer_state` part (``mine`` donated), as the other layer programs return ``(mine, *outputs)``."""
    return (layer_part(_write(rest, mine, layer, k, v, plan, group, rope, backend, packed), group),)


@functools.partial(jax.jit, donate_argnums=1, static_argnames=("num_kv_heads",) + _ATTEND_STATIC)
def layer_attend(rest, mine, layer, k, v, q, plan, rows, sinks=None, *, num_kv_heads: Optional[int] = None,
                 group: int = 0, rope: Optional[RopeSpec] = None, backend: str = "auto",
                 sm_scale: Optional[float] = None, sliding_window: Optional[int] = None,
                 soft_cap: Optional[float] = None):
    """`append_attend` for a planned step -> ``(mine, out [B, Tq, Hq, D], lse f32[B, Tq, Hq])``; ``mine`` donated.
    ``k, v, q`` as in `append_attend`, or (``v`` and ``q`` None) ``k = kvq [B, 2 H + Hq, T, D]``, K, V and Q
    packed along the head axis (`append_attend_packed`; ``num_kv_heads`` = H)."""
    if v is None and q is None:
        h = num_kv_heads
        k, v, q = k[:, :h], k[:, h:2 * h], k[:, 2 * h:]
    if k.ndim == 4:
        q = jnp.swapaxes(q, 1, 2)
    state = _write(rest, mine, layer, k, v, plan, group, rope, backend, False)
    out, lse = decode_attention(state, layer, q, rows, group=group, sm_scale=sm_scale, sliding_window=sliding_window,
                                soft_cap=soft_cap, backend=backend)
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks)
    return layer_part(state, group), out, lse


@functools.partial(jax.jit, donate_argnums=1, static_argnames=("width", "group", "rope", "backend", "packed"))
def layer_dense(rest, mine, layer, k, v, plan, rows, *, width: int, group: int = 0,
                rope: Optional[RopeSpec] = None, backend: str = "auto", packed: bool = False):
    """`append_dense` for a planned step: ``(mine, k [B, H, width * page, D], v [...])``; ``mine`` donated."""
    state = _write(rest, mine, layer, k, v, plan, group, rope, backend, packed)
    return (layer_part(state, group),) + dense_rows(state, layer, rows, width=width, group=group, backend=backend)



# ---------------------------------------------------------------------------------------- a whole step at once
def plan_write_layers(state, tokens, kv, *, group: int = 0, rope: Optional[RopeSpec] = None, backend: str = "auto"):
    """A step whose rows were kept aside while its layers ran (`interop.hf.JMixedKVCache`'s fused path reads
    them dense), stored for every layer of ``group`` in ONE program: `plan_append`'s plan of ``tokens`` i32[2 T] =
    ``seq | pos`` (NumPy or device), then each layer's `jmixedkv.state.write_layer_traced` from ``kv [2 L, B, H,
    T', D]`` (layer ``l``'s K at ``kv[l]``, its V at ``kv[L + l]``; transformers' layout, token ``b * T' + t``;
    ``B * T' = T``). Leaves the state plan + per-layer programs leave, bit for bit. Every layer is stored by one
    write (`jmixedkv.state.write_layer_traced` with ``layer=None``: one kernel launch on the GPU), or with K
    smoothing (per-layer means) layer by layer in a loop. The state is donated but for other groups' pools, which
    enter read-only and come back as the caller's own arrays (never copied)."""
    others = tuple(None if i == group else p for i, p in enumerate(state.pools))
    new = _plan_write(_own_pools(state, group), others, tokens, kv, group=group, rope=rope, backend=backend)
    return _with_pools(new, others, group)


def _with_pools(state, others, group: int):
    return dataclasses.replace(state, pools=tuple(p if i == group else others[i] for i, p in enumerate(state.pools)))


def _own_pools(state, group: int):
    return dataclasses.replace(state, pools=tuple(p if i == group else None for i, p in enumerate(state.pools)))


@functools.partial(jax.jit, donate_argnums=0, static_argnames=("group", "rope", "backend"))
def _plan_write(own, others, tokens, kv, *, group: int, rope, backend: str):
    t = tokens.shape[0] // 2
    state, plan = st.plan_append_traced(_with_pools(own, others, group), tokens[:t], tokens[t:], group=group)
    num_layers = state.groups[group].num_layers
    if state.k_means is None:                      # every layer in one store: one write kernel for the step
        layers = jax.vmap(_tokens)
        full = st.write_layer_traced(state, None, layers(kv[:num_layers]), layers(kv[num_layers:]), plan,
                                     group=group, rope=rope, backend=backend)
        return _own_pools(full, group)

    def store(layer, carry):                       # the loop carries the group's pools only (updated in place)
        k = lax.dynamic_index_in_dim(kv, layer, keepdims=False)
        v = lax.dynamic_index_in_dim(kv, layer + num_layers, keepdims=False)
        full = st.write_layer_traced(_with_pools(carry, others, group), layer, _tokens(k), _tokens(v), plan,
                                     group=group, rope=rope, backend=backend)
        return _own_pools(full, group)

    return lax.fori_loop(0, num_layers, store, _own_pools(state, group))
