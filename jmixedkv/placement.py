"""Placement of arrays on devices: a `CacheState` on a ``("tp",)`` mesh -- pool arrays ``[L, P, kv, H, page, X]``
sharded on their KV-head axis (the K-smoothing means ``f32[L, S, H, D]`` on theirs), the rest replicated -- and
`pack_on_device` (arrays packed side by side before a model-sized pool is allocated). Imports no `jmixedkv` module,
so `state` (``init_state(mesh=...)``) and `sharding` (which imports `state`) both use it without a cycle
(docs/DESIGN.md §7)."""
from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

__all__ = ["AXIS", "state_specs", "check_divisible", "shard_state", "pack_on_device"]

AXIS = "tp"


def _pool_leaf_spec(leaf):
    """Axis 3 (KV heads) of a 6-d pool array over ``AXIS``; any other leaf replicated."""
    return P(None, None, None, AXIS) if getattr(leaf, "ndim", 0) == 6 else P()


def state_specs(state):
    """PartitionSpec pytree for a `CacheState`: pool arrays and K-smoothing means on the head axis, everything else
    replicated."""
    pools = jax.tree.map(_pool_leaf_spec, state.pools)
    rest = {f: jax.tree.map(lambda _: P(), getattr(state, f))
            for f in ("page_table", "high_table", "kv_lens", "active", "written", "floor", "step_lo",
                      "step_layers", "alloc", "high_alloc", "error")}
    k_means = jax.tree.map(lambda _: P(None, None, AXIS), state.k_means)     # f32[L, S, H, D]: the head axis
    return dataclasses.replace(state, pools=pools, k_means=k_means, **rest)


def check_divisible(state, tp: int):
    """`ValueError` naming the group unless every group's ``num_kv_heads`` divides by ``tp``."""
    for g in state.groups:
        if g.num_kv_heads % tp:
            raise ValueError(f"group {g.name!r}: num_kv_heads={g.num_kv_heads} is not divisible by the "
                             f"tensor-parallel size {tp}")


def shard_state(state, mesh: Mesh):
    """Place a `CacheState` on ``mesh``: pools sharded over KV heads, the rest replicated."""
    check_divisible(state, mesh.shape[AXIS])
    specs = state_specs(state)
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), state, specs)


def pack_on_device(tree):
    """``tree`` with its JAX arrays moved through host memory and back to where they were (each keeps its
    sharding), so that they sit side by side at the low end of the GPU allocator; other leaves as they are (an array
    met twice is moved once). The arrays of ``tree`` are deleted: use the returned tree.

    A cache pool is ONE array and needs one contiguous free block (docs/DESIGN.md §3). Arrays built before it can
    leave holes between them that deny it although enough memory is free in total -- model weights built in place,
    for one (float32 parameters freed as their bfloat16 copies and stacked layers replace them), where
    `jmixedkv.CacheManager` then refuses the cache with `CacheCapacityError`. Call this on such arrays first."""
    leaves, treedef = jax.tree.flatten(tree)
    arrays = {id(x): x for x in leaves if isinstance(x, jax.Array)}
    host = {i: (jax.device_get(x), x.sharding) for i, x in arrays.items()}
    for x in arrays.values():
        x.delete()
    placed = {i: jax.device_put(h, sharding) for i, (h, sharding) in host.items()}
    return jax.tree.unflatten(treedef, [placed.get(id(x), x) if isinstance(x, jax.Array) else x for x in leaves])
