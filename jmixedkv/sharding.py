"""Tensor parallelism over KV heads with `jax.shard_map` (JAX's own SPMD engine; no home-made transport).

Pools are sharded on their KV-head axis (axis 3 of every ``[L, P, kv, H, page, X]`` pool array) over the mesh
axis ``"tp"``; page tables, lengths, global scales and the allocators are replicated, and every shard runs the
same pure transition on identical replicated inputs, so allocation stays in lockstep with no communication.
Inside `shard_map` each shard sees a state whose `GroupSpec`s carry the *local* head count and runs the same
code (reference or Pallas kernels) as one device would.

Readers return head-sharded outputs (``stage`` / ``gather_rows`` on the KV-head axis, ``decode_attention`` on the
query-head axis): the hot path moves no data between devices; the output projection that follows does its own
reduction.

Multi-host: call ``jax.distributed.initialize()`` in every process first, then build the mesh over
``jax.devices()`` (all hosts' devices), e.g. ``Mesh(np.array(jax.devices()).reshape(-1), ("tp",))``; arrays must
then be created with `jax.make_array_from_process_local_data` or by `shard_state` from identical host data on
every process. Nothing else changes: `shard_map` is the same program on every process.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from .compat import shard_map
from .placement import AXIS, check_divisible, shard_state, state_specs  # noqa: F401  (re-exported)
from .state import CacheState, append

__all__ = ["make_mesh", "state_specs", "shard_state", "local_view", "sharded", "sharded_append",
           "sharded_stage_reference", "sharded_decode_attention", "sharded_stage", "sharded_gather_rows"]

def make_mesh(num_devices: Optional[int] = None, devices=None) -> Mesh:
    """A 1-D ``("tp",)`` mesh over the first ``num_devices`` devices (default: all)."""
    devices = list(jax.devices() if devices is None else devices)
    devices = devices[: num_devices or len(devices)]
    return Mesh(np.array(devices), (AXIS,))


def local_view(state: CacheState, tp: int) -> CacheState:
    """The state one shard sees: group specs with ``num_kv_heads // tp`` heads (arrays untouched)."""
    groups = tuple(dataclasses.replace(g, num_kv_heads=g.num_kv_heads // tp) for g in state.groups)
    return dataclasses.replace(state, groups=groups)


def sharded(fn: Callable, mesh: Mesh, state: CacheState, args=(), arg_specs=(), out_specs=P(), returns_state=False):
    """Run ``fn(local_state, *args)`` on every shard.

    ``arg_specs``: a PartitionSpec per arg; ``out_specs``: specs of fn's outputs (the state's spec is used for a
    returned state when ``returns_state``: then fn returns ``(state, *outputs)`` or just a state)."""
    tp = mesh.shape[AXIS]
    check_divisible(state, tp)
    groups = state.groups
    sspec = state_specs(state)

    def body(st, *a):
        out = fn(local_view(st, tp), *a)
        if not returns_state:
            return out
        if isinstance(out, CacheState):
            return dataclasses.replace(out, groups=groups)
        return (dataclasses.replace(out[0], groups=groups),) + tuple(out[1:])

    if returns_state:
        outs = sspec if out_specs is None else (sspec,) + tuple(out_specs)
    else:
        outs = out_specs
    return shard_map(body, mesh=mesh, in_specs=(sspec,) + tuple(arg_specs), out_specs=outs,
                     check_vma=False)(state, *args)


def _host_checks(state, group, op, layer, seq_slots, positions=None):
    """Validate host values before they become traced shard_map arguments (`jmixedkv.checks`)."""
    from . import checks
    spec = checks.check_group(state, group, op)
    layer = checks.check_layer_arg(layer, spec.num_layers, op, spec.name)
    seq = checks.index_array(seq_slots, "seq_slots", op, -1, state.max_seqs, ndim=1)
    pos = None if positions is None else checks.index_array(positions, "positions", op)
    return seq, pos, layer


_KV_ROWS = P(None, None, AXIS, None)  # [L, T, H, D]
_KV_ROWS_1 = P(None, AXIS, None)      # [T, H, D]


def sharded_append(mesh: Mesh, state: CacheState, layer, k, v, seq_slots, positions, group: int = 0, rope=None,
                   backend: str = "auto") -> CacheState:
    """`jmixedkv.append` with K/V sharded over heads; tables and allocators advance identically on every shard.

    Host (Python / NumPy) slots, positions and layer are range-checked first (`ValueError`); JAX values are
    checked inside, on every shard alike, so the error bits and the all-or-nothing refusal stay replicated."""
    seq_slots, positions, layer = _host_checks(state, group, "sharded_append", layer, seq_slots, positions)
    rows = _KV_ROWS_1 if layer is not None else _KV_ROWS
    args, specs = [k, seq_slots, positions], [rows, P(), P()]
    if v is not None:
        args.append(v)
        specs.append(rows)
    if layer is not None:
        args.append(jnp.asarray(layer, jnp.int32))
        specs.append(P())

    def fn(st, k_, s_, p_, *rest):
        v_ = rest[0] if v is not None else None
        l_ = rest[-1] if layer is not None else None
        return append(st, l_, k_, v_, s_, p_, group=group, rope=rope, backend=backend)
    return sharded(fn, mesh, state, args, specs, out_specs=None, returns_state=True)


def sharded_stage_reference(mesh: Mesh, state: CacheState, layer, seq_slots, group: int = 0):
    """`stage_reference` per shard: ``[B, kv, H, S, D]`` sharded over H."""
    from .staging import stage_reference
    seq_slots, _, layer = _host_checks(state, group, "sharded_stage_reference", layer, seq_slots)
    return sharded(lambda st, l_, s_: stage_reference(st, l_, s_, group), mesh, state,
                   (jnp.asarray(layer, jnp.int32), seq_slots), (P(), P()), out_specs=P(None, None, AXIS))


def sharded_stage(mesh: Mesh, state: CacheState, layer, seq_slots, group: int = 0, backend: str = "auto"):
    """`jmixedkv.staging.stage` per shard: staged pages sharded over KV heads (page table / lengths replicated)."""
    from .staging import stage
    seq_slots, _, layer = _host_checks(state, group, "sharded_stage", layer, seq_slots)
    probe = jax.eval_shape(lambda st: stage(local_view(st, 1), layer, seq_slots, group=group, backend="reference"),
                           state)
    specs = jax.tree.map(lambda x: P(*([None] * (x.ndim - 3)), AXIS) if x.ndim >= 5 else P(), probe)
    return sharded(lambda st, l_, s_: stage(st, l_, s_, group=group, backend=backend), mesh, state,
                   (jnp.asarray(layer, jnp.int32), seq_slots), (P(), P()), out_specs=specs)


def sharded_gather_rows(mesh: Mesh, state: CacheState, layer, seq_slots, indices, group: int = 0, **kwargs):
    """`jmixedkv.gather.gather_rows` per shard: the scratch ``[B, K, kv, H, D]`` sharded over H.

    Only attention-dtype scratches: the FP8 scratch's per-row scale is a maximum over *all* heads, which a shard
    cannot compute alone (it would need a cross-device max before the encode)."""
    from .gather import gather_rows
    seq_slots, _, layer = _host_checks(state, group, "sharded_gather_rows", layer, seq_slots)
    if kwargs.get("scratch_dtype") is not None:
        raise ValueError(f"sharded_gather_rows: scratch_dtype={kwargs['scratch_dtype']!r} is not supported under "
                         f"tensor parallelism (the FP8 scale spans all heads); use the attention-dtype scratch")
    probe = jax.eval_shape(lambda st: gather_rows(local_view(st, 1), layer, seq_slots, indices, group=group,
                                                  **{**kwargs, "backend": "reference"}), state)
    specs = jax.tree.map(lambda x: P(None, None, None, AXIS) if x.ndim == 5 else P(), probe)
    return sharded(lambda st, l_, s_, i_: gather_rows(st, l_, s_, i_, group=group, **kwargs), mesh, state,
                   (jnp.asarray(layer, jnp.int32), seq_slots, indices), (P(), P(), P()), out_specs=specs)


def sharded_decode_attention(mesh: Mesh, state: CacheState, layer, q, seq_slots, group: int = 0, **kwargs):
    """`jmixedkv.decode.decode_attention` per shard: ``q [B, Tq, Hq, D]`` and the outputs sharded over
    query heads (each shard holds the KV heads its query heads attend to).

    Each shard's kernel chooses its tuning and split-K count for the whole KV head count (``split_heads``, unless
    given), as one device would: every (row, KV head) is split and its partials summed in the same order
    (`sum_splits`), so a shard's split partials are bitwise one device's (tests/test_sharding.py, CPU). The merged
    outputs and LSE match to the last bits XLA's merge may round differently at another array shape (CPU: LSE
    within 1e-6 relative); bitwise equality on two GPUs is what the `gpu2` tests check."""
    from .decode import decode_attention
    seq_slots, _, layer = _host_checks(state, group, "sharded_decode_attention", layer, seq_slots)
    kwargs.setdefault("split_heads", state.groups[group].num_kv_heads)     # the whole count (checked above)
    qspec = P(None, None, AXIS, None)
    return sharded(lambda st, l_, q_, s_: decode_attention(st, l_, q_, s_, group=group, **kwargs), mesh, state,
                   (jnp.asarray(layer, jnp.int32), q, seq_slots), (P(), qspec, P()),
                   out_specs=(qspec, P(None, None, AXIS)))
