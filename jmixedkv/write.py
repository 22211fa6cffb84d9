"""The row store of `jmixedkv.state.append`: `write_rows` (backend dispatch), its pure-jnp reference
`write_rows_reference` and the fused Pallas write kernel (`pallas_kernels.write`).

RoPE'd K is rounded to K's dtype before both stores, so in-kernel RoPE equals RoPE applied by the model followed by a
plain append. The slots come from `jmixedkv.state.write_slots` (the allocation and the twin's write dedupe).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from . import nvfp4
from .backend import dispatch
from .pools import GroupPools, encode_rows, kernel_arrays
from .rope import apply_rope

__all__ = ["write_rows", "write_rows_reference"]


def write_rows(state, layer, k, v, pos, low_slot, high_slot, *, group: int, rope=None, backend: str = "auto",
               transformed: bool = False):
    """Store rows ``k`` / ``v`` (``[T, H, D]`` for ``layer``, ``[L, T, H, D]`` for ``layer=None``; ``v=None`` for an
    MLA latent) of group ``group`` at ``low_slot`` / ``high_slot`` i32[T] (-1 skip); returns the group's new
    `GroupPools`. A rotation lever (`jmixedkv.levers`) rotates K and V after RoPE, before the store, unless
    ``transformed`` (the caller applied the levers: `jmixedkv.levers.smooth_rows`)."""
    if state.config.rotation is not None and not transformed:
        from .levers import rotate_rows
        k, v, rope = rotate_rows(state.config.rotation, k, v, pos, rope)
    return dispatch(backend, _reference, _pallas)(state.pools[group], state.groups[group].kv_factor, k, v, pos, rope,
                                                  layer, low_slot, high_slot, state.page_size,
                                                  state.config.block_scale)


def _reference(pools, kv_factor, k, v, pos, rope, layer, low_slot, high_slot, page_size, block_scale):
    if rope is not None:
        k = apply_rope(k, pos, rope).astype(k.dtype)
    x = k[..., None, :, :] if kv_factor == 1 else jnp.stack([k, v], axis=-3)     # [..., T, kv, H, D]
    return write_rows_reference(pools, x, layer, low_slot, high_slot, page_size, block_scale)


def _pallas(pools, kv_factor, k, v, pos, rope, layer, low_slot, high_slot, page_size, block_scale, *, interpret):
    del kv_factor, interpret     # the kernel reads v=None as a latent; it picks interpret itself (`lowering_for_cuda`)
    from pallas_kernels.write import write_rows as kernel
    low, high, plain = pools.low, pools.high, pools.plain      # the kernel takes raw arrays (`kernel_arrays`)
    rope_kw = {} if rope is None else dict(rope_style=rope.style, rope_theta=rope.theta, rotary_dim=rope.rotary_dim)
    data, scales, high_rows, plain_rows = kernel(
        k, v, layer, low_slot, high_slot, page_size, pos, block_scale=block_scale, **rope_kw,
        low=kernel_arrays(low), high=kernel_arrays(high), plain=kernel_arrays(plain))
    return GroupPools(low and dataclasses.replace(low, data=data, scales=scales),
                      high and dataclasses.replace(high, rows=high_rows),
                      plain and dataclasses.replace(plain, rows=plain_rows))


def _scatter(pool_l, slots, values, page_size):
    """pool_l [P, kv, H, page, X]; slots i32[T] (-1 skip); values [T, kv, H, X]."""
    num_pages = pool_l.shape[0]
    page = jnp.where(slots >= 0, slots // page_size, num_pages)  # out of range -> dropped
    row = jnp.where(slots >= 0, slots % page_size, 0)
    return pool_l.at[page, :, :, row, :].set(values.astype(pool_l.dtype), mode="drop")


def write_rows_reference(pools: GroupPools, x, layer, low_slot, high_slot, page_size: int,
                         block_scale: str = "max6") -> GroupPools:
    """Store new rows of one layer (``layer`` int, may be traced) or all layers (``layer=None``).

    Args:
      x: ``[T, kv, H, D]`` for one layer, ``[L, T, kv, H, D]`` for all (already RoPE'd, any float dtype).
      low_slot: i32[T] slots into the low pool (mixed / low groups) or the plain pool (plain groups); -1 skip.
      high_slot: i32[T] slots into the high twin; -1 skip (ignored for groups without a twin).
      block_scale: NVFP4 block scaling of the low rows (`KVCacheConfig.block_scale`).
    """
    def one_layer(pools, l, xl):
        low, high, plain = pools.low, pools.high, pools.plain
        if low is not None:
            data, scales = nvfp4.quantize_reference(xl, low.gs[l][None, :, None], block_scale)
            low = dataclasses.replace(
                low,
                data=low.data.at[l].set(_scatter(low.data[l], low_slot, data, page_size)),
                scales=low.scales.at[l].set(_scatter(low.scales[l], low_slot, scales, page_size)))
        if high is not None:
            enc = encode_rows(xl, high.rows.dtype, high.scale[l])
            high = dataclasses.replace(high, rows=high.rows.at[l].set(
                _scatter(high.rows[l], high_slot, enc, page_size)))
        if plain is not None:
            enc = encode_rows(xl, plain.rows.dtype, plain.scale[l])
            plain = dataclasses.replace(plain, rows=plain.rows.at[l].set(
                _scatter(plain.rows[l], low_slot, enc, page_size)))
        return GroupPools(low, high, plain)

    if layer is not None:
        return one_layer(pools, layer, x)
    return jax.lax.fori_loop(0, x.shape[0], lambda l, p: one_layer(p, l, x[l]), pools)
