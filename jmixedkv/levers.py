"""Accuracy levers that keep the NVFP4 byte format: a Hadamard rotation of K/V and per-channel K smoothing.

Both are `KVCacheConfig` options (``rotation="hadamard"``, ``k_smoothing=True``) and change only *which* vectors
are stored, never how they are stored: pools, page tables, kernels and exporters are untouched; exporters given
the config say so (`interop.dlpack.kv_transform`, docs/DESIGN.md §11). The third lever, "4 over 6" block scaling
(``block_scale="4over6"``), changes how a block is scaled, not what is stored: it lives in the codec
(`jmixedkv.nvfp4.quantize_reference`).

* **Hadamard rotation** (``rotation="hadamard"``): every stored K and V row (after RoPE) is multiplied by the
  orthonormal Sylvester-Hadamard matrix ``Hd = H_D / sqrt(D)`` (symmetric, ``Hd @ Hd = I``). Scores are unchanged
  when queries are rotated the same way (``(q Hd) . (k Hd) = q . k``) and the attention output comes out rotated
  (``p @ (V Hd) = (p @ V) Hd``), so attention over rotated rows rotates q before and the output after it
  (`rotate` twice = identity). The rotation spreads a channel outlier over the whole row, so each 16-element
  NVFP4 block sees a flatter distribution. `jmixedkv.state.append` applies it on write (after RoPE, so RoPE in the
  write path composes: RoPE first, then the rotation, then the store with ``rope=None``). **Readers undo it**:
  `jmixedkv.decode.decode_attention` rotates q and un-rotates its output inside one program, and `stage`,
  `stage_reference`, `gather_rows`, `overlay_retained_rows` and `rows_reference` return model-space rows
  (`unrotate`, float32 math, one rounding to the attention dtype) unless asked for ``as_stored=True`` -- so a
  caller never needs to know the lever. Exports of the pools themselves (`interop.layouts.nvfp4_pages`, row-pool
  views) are the stored rows and say so (``kv_transform``). Compressed groups (`jmixedkv.compressed`) are never
  rotated: the lever applies to the raw-token groups' write path only.
* **K smoothing** (``k_smoothing=True``): a per-(layer, KV head, channel) mean of K, taken over the prefill of each
  sequence (post-RoPE, post-rotation) and frozen for later tokens, is subtracted from every stored key, twin
  included. Every score of one query shifts by the same ``q . mean``, so softmax and the output are unchanged
  and nothing is undone on read. Two things do change: the LSE a reader returns is that of the smoothed keys
  (``lse - sm_scale * q . mean``), so merging it with attention over other keys (`merge_attention`) needs those
  keys smoothed by the same mean; and a logit soft-cap does not commute with the shift, so `decode_attention`
  refuses ``soft_cap`` on a K-smoothed cache. In the JAX cache the mean lives with the caller (the model's
  generation loop carries it per sequence): the cache stores only ``k - mean``. Speculative rollback is unaffected
  (the mean is frozen before any draft token), but prefix reuse is not: a forked / prefix-shared sequence must
  reuse the owner's mean, since the shared pages hold keys shifted by it; that per-sequence state, which `fork`,
  prefix reuse and offload would have to carry, is why the JAX cache state does not hold it. The torch
  `interop.StaticPagedCache` (no forks, no prefix sharing) holds the means itself. With the rotation and "4 over
  6" it lowered KL on every text measured; without them its effect changes sign with the text (bench/RESULTS.md).

Shapes: ``[..., D]`` with ``D`` a power of two (head_dim).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["ROTATIONS", "hadamard", "hadamard_np", "rotate", "unrotate", "rotate_rows", "k_mean", "smooth_k"]

ROTATIONS = (None, "hadamard")


@functools.lru_cache(maxsize=None)
def hadamard_np(d: int) -> np.ndarray:
    """The orthonormal Sylvester-Hadamard matrix as NumPy ``f32[d, d]`` (read-only: cached), the one definition
    behind `hadamard` and the torch readers' rotation."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"the Hadamard rotation needs head_dim to be a power of two, got {d}")
    h = np.ones((1, 1), np.float64)
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(d)).astype(np.float32)


def hadamard(d: int) -> jax.Array:
    """Orthonormal, symmetric Sylvester-Hadamard matrix ``f32[d, d]`` (``H @ H = I``)."""
    return jnp.asarray(hadamard_np(d))


def rotate(x, rotation=None):
    """``x[..., D] @ Hd`` in float32 (HIGHEST precision); identity when ``rotation`` is None. Self-inverse."""
    if rotation is None:
        return x
    if rotation != "hadamard":
        raise ValueError(f"rotation must be one of {ROTATIONS}, got {rotation!r}")
    return jnp.einsum("...d,de->...e", x.astype(jnp.float32), hadamard(x.shape[-1]),
                      precision=jax.lax.Precision.HIGHEST)


def unrotate(x, rotation=None, dtype=None):
    """Stored rows / rotated-space outputs ``x[..., D]`` back to model space, in ``dtype`` (default ``x``'s):
    `rotate` in float32 (self-inverse), one rounding to ``dtype``; ``x`` cast to ``dtype`` when ``rotation`` is
    None. Exact up to that rounding plus float32 error (~1e-7 relative). Not bit-exact for a row rotated on
    write: a row ``x`` stored as ``bf16(x Hd)`` comes back as ``x + e Hd`` rounded once more, with ``e`` the
    write's rounding (``|e_i| <= 2^-8 |(x Hd)_i|``, bf16's unit roundoff), so the error before the final rounding
    is at most ``2^-8 ||x||_2`` per element and about ``2^-8 rms(x) / sqrt(3)`` typically (the rotation keeps
    the error's norm and spreads it over the row)."""
    dtype = x.dtype if dtype is None else jnp.dtype(dtype)
    return rotate(x, rotation).astype(dtype)


def k_mean(k, valid=None):
    """Per-channel mean of keys ``k[B, T, H, D]`` over tokens (``valid bool[B, T]`` masks padding) -> f32[B, H, D]."""
    kf = k.astype(jnp.float32)
    if valid is None:
        return jnp.mean(kf, axis=1)
    w = valid.astype(jnp.float32)[:, :, None, None]
    return jnp.sum(kf * w, axis=1) / jnp.maximum(jnp.sum(w, axis=1), 1.0)


def smooth_k(k, mean):
    """``k[B, T, H, D] - mean[B, H, D]`` in float32."""
    return k.astype(jnp.float32) - mean[:, None].astype(jnp.float32)


def rotate_rows(rotation, k, v, positions, rope=None):
    """The write-path hook of `jmixedkv.state.append`: ``(k', v', None)`` with RoPE (if ``rope``) applied to ``k``
    first, both rounded to ``k``'s dtype like the plain path, then both rotated and rounded to their dtype
    again. ``k, v [..., T, H, D]`` (``v`` may be None: MLA latent)."""
    from .rope import apply_rope
    if rope is not None:
        k = apply_rope(k, positions, rope).astype(k.dtype)
    k = rotate(k, rotation).astype(k.dtype)
    v = None if v is None else rotate(v, rotation).astype(v.dtype)
    return k, v, None
