"""What both decode backends share: query grouping, the f16 query scaling of the low domain, the interior / edge
block rule, split merging, and the device's SM count.

* `group_queries` / `ungroup_rows`: ``q [B, Tq, Hq, D]`` <-> each KV head's ``Tq * G`` query rows (row ``t * G + g``).
* `f16_queries`: query rows scaled by a power of two into f16 for the dot with low-domain NVFP4 rows.
* `interior_blocks`: the *clean* blocks of a sequence (no mask, no retained row); `pages_per_block`.
* `merge_partials` / `normalize_merged`: the LSE merge of split-K partials ``(o, m, l)``.
* `num_sms`: streaming multiprocessors of the first device (132, an H200's, off GPU: the tuning defaults of a
  cross-lowered kernel are those of the H200).

Constants: `LOW_DOMAIN` (the low domain's ``2^7``), `M_INIT` (the running maximum's finite start).
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from jmixedkv.layout import TwinGeometry
from jmixedkv.numerics import next_pow2

__all__ = ["LOW_DOMAIN", "M_INIT", "DEFAULT_NUM_SMS", "num_sms", "next_pow2", "sum_splits", "group_queries",
           "ungroup_rows", "f16_queries", "interior_blocks", "pages_per_block", "merge_partials", "normalize_merged"]

#: low rows dequantize to ``x / (gs * 2^7)`` in f16 (e2m1 * 2^-14 times e4m3 * 2^7: exact)
LOW_DOMAIN = 128.0
#: finite running-max start: fully masked rows keep ``l == 0`` and never produce NaN
M_INIT = -1e30
#: SMs assumed where the device does not say (CPU: interpret mode, cross-lowering): an H200's
DEFAULT_NUM_SMS = 132


@functools.lru_cache(maxsize=None)
def num_sms() -> int:
    """Streaming multiprocessors of the first JAX device (``core_count`` of a GPU), else `DEFAULT_NUM_SMS`. The
    split-K defaults (`pallas_kernels.decode.config`) size the grid with it."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return DEFAULT_NUM_SMS
    count = getattr(dev, "core_count", None) if dev.platform == "gpu" else None
    return int(count) if isinstance(count, int) and count > 0 else DEFAULT_NUM_SMS


def group_queries(q, num_kv_heads: int):
    """``q [B, Tq, Hq, D]`` -> ``[B, H, Tq * G, D]`` (``G = Hq / H``): each KV head's query rows, row ``t * G + g``."""
    b, tq, hq, d = q.shape
    g = hq // num_kv_heads
    return q.reshape(b, tq, num_kv_heads, g, d).transpose(0, 2, 1, 3, 4).reshape(b, num_kv_heads, tq * g, d)


def ungroup_rows(out, lse, tq: int, group: int):
    """Inverse of `group_queries` for merged rows ``out [B, H, >= Tq * G, D]``, ``lse [B, H, >= Tq * G]`` (padding
    rows dropped) -> ``(out [B, Tq, Hq, D], lse [B, Tq, Hq])``."""
    b, h, _, d = out.shape
    n = tq * group
    out = out[:, :, :n].reshape(b, h, tq, group, d).transpose(0, 2, 1, 3, 4).reshape(b, tq, h * group, d)
    lse = lse[:, :, :n].reshape(b, h, tq, group).transpose(0, 2, 1, 3).reshape(b, tq, h * group)
    return out, lse


def f16_queries(qf, rows_share_shift: bool = False):
    """float32 query rows ``[..., D]`` -> ``(rows * 2^shift in f16, shift i32[...])``: each row scaled by a power of
    two into ``[2^7, 2^8)`` (exact) for the f16 dot with low-domain NVFP4 rows; the caller applies ``2^-shift`` to
    the float32 logits. ``rows_share_shift``: one shift for all rows of ``qf[..., R, D]`` (the largest row's), so
    that the logits' multiplier is one number per ``[R, D]`` group (a row 2^k smaller than the largest then has 2^k
    less room above f16's subnormals: its elements below about 2^(k - 21) of its own largest lose bits, against
    2^-21 with a shift of its own). The shared shift is taken over the finite rows only: a row holding inf / NaN
    stays non-finite itself and does not push the other rows past f16's range."""
    amax = jnp.max(jnp.abs(qf), axis=-1)
    if rows_share_shift:
        # the barrier keeps XLA from fusing the rows' reduction into the shared one: fused, XLA's GPU emitter ran
        # both as one slow kernel at 8 rows per KV head (bench/RESULTS.md)
        amax = lax.optimization_barrier(amax)
        finite = jnp.where(jnp.isfinite(amax), amax, 0.0)
        amax = jnp.broadcast_to(jnp.max(finite, axis=-1, keepdims=True), amax.shape)
    _, ex = jnp.frexp(amax)
    shift = 8 - ex
    return jnp.ldexp(qf, shift[..., None]).astype(jnp.float16), shift


def pages_per_block(block_k: int, page: int) -> int:
    """Pages per kernel step for a requested ``block_k`` (tokens): whole pages, at least one and at least 16 tokens
    (the smallest dot); the step is ``pages_per_block(block_k, page) * page`` tokens."""
    return max(1, block_k // page, -(-16 // page))


def interior_blocks(n, k_tok: int, tq: int, geom: Optional[TwinGeometry] = None, window: Optional[int] = None):
    """The *clean* blocks ``[i0, i1)`` (``k_tok`` tokens each) of a sequence of length ``n`` (int32 scalar or array):
    every key visible to every one of the ``Tq`` queries, no retained row (first_n / last_n of ``geom``, the twin's
    geometry when one is read), no row at or past ``n``. Empty when ``i1 <= i0``. The Triton kernel runs the other
    blocks (the *edge* blocks) with masks and the twin overlay; the Mosaic GPU kernel attends ``[i0, i1)`` itself."""
    c_lo = geom.first_n if geom is not None else 0
    if window is not None:
        c_lo = jnp.maximum(c_lo, n - window)
    c_hi = jnp.minimum(n - (geom.last_n if geom is not None else 0), n - tq + 1)
    return (jnp.maximum(c_lo, 0) + k_tok - 1) // k_tok, jnp.maximum(c_hi, 0) // k_tok


def sum_splits(x):
    """``x[S, ...]`` summed over its leading (split) axis in a fixed order, ``((x0 + x1) + x2) + ...``: a reduce
    may associate differently for different trailing shapes, so a shard of the heads would not reproduce one
    device's bits (`jmixedkv.sharding.sharded_decode_attention`)."""
    out = x[0]
    for i in range(1, x.shape[0]):
        out = out + x[i]
    return out


def merge_partials(o, m, l):
    """Merge split partials ``o f32[S,...,D]`` (unnormalized), ``m, l f32[S,...]`` -> ``(out f32[...,D], lse)``.

    Rows that saw no key give ``out = 0`` and ``lse = -inf``. The sums run in a fixed order (`sum_splits`)."""
    m_g = m.max(axis=0)
    w = jnp.exp(m - m_g[None])
    return normalize_merged(sum_splits(w[..., None] * o), m_g, sum_splits(w * l))


def normalize_merged(o_g, m_g, l_g):
    """Merged sums -> ``(out, lse)``: ``out = o_g / l_g``, ``lse = m_g + log(l_g)``; rows with ``l_g == 0`` (no key
    seen) give ``out = 0`` and ``lse = -inf``. ``o_g f32[..., D]``, ``m_g, l_g f32[...]``."""
    ok = l_g > 0
    out = jnp.where(ok[..., None], o_g / jnp.where(ok, l_g, 1.0)[..., None], 0.0)
    lse = jnp.where(ok, m_g + jnp.log(jnp.where(ok, l_g, 1.0)), -jnp.inf)
    return out, lse
