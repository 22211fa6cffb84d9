"""Accuracy levers that keep the NVFP4 byte format: a Hadamard rotation of K/V and per-channel K smoothing.

Both are `KVCacheConfig` options (``rotation="hadamard"``, ``k_smoothing=True``) and change only *which* vectors
are stored, never how they are stored: pools, page tables, kernels and exporters are untouched; exporters given
the config say so (`interop.dlpack.kv_transform`, docs/DESIGN.md §11). The third lever, "4 over 6" block scaling
(``block_scale="4over6"``), changes how a block is scaled, not what is stored: it lives in the codec
(`jmixedkv.nvfp4.quantize_reference`).

* **Hadamard rotation** (``rotation="hadamard"``): every stored K and V row (after RoPE) is multiplied by the
  orthonormal Sylvester-Hadamard matrix ``Hd = H_D / sqrt(D)`` (symmetric, ``Hd @ Hd = I``). Scores are unchanged
  when queries are rotated the same way (``(q Hd) . (k Hd) = q . k``) and the attention output comes out rotated
  (``p @ (V Hd) = (p @ V) Hd``), so a reader rotates q before attention and the output after it
  (`rotate` twice = identity). The rotation spreads a channel outlier over the whole row, so each 16-element
  NVFP4 block sees a flatter distribution. `jmixedkv.state.append` applies it on write (after RoPE, so RoPE in the
  write path composes: RoPE first, then the rotation, then the store with ``rope=None``); `jmixedkv.model` rotates
  q and un-rotates the output around the attention call (also around the fused decode kernel).
* **K smoothing** (``k_smoothing=True``): a per-(layer, KV head, channel) mean of K, taken over the prefill of each
  sequence (post-RoPE, post-rotation) and frozen for later tokens, is subtracted from every stored key, twin
  included. Every score of one query shifts by the same ``q . mean``, so softmax and the output are unchanged
  and nothing is undone on read. The mean lives with the caller (the model's generation loop carries it per
  sequence): the cache stores only ``k - mean``. Speculative rollback is unaffected (the mean is frozen before any
  draft token), but prefix reuse is not: a forked / prefix-shared sequence must reuse the owner's mean, since the
  shared pages hold keys shifted by it. Deliberately *not* moved into the cache state / write path (yet): on SmolLM2
  it lowers KL in 9 of 12 mixed-cache cases but its effect changes sign with the text and the other levers (with
  the rotation alone it raises code KL by up to 1.44x; bench/RESULTS.md, 2026-11-30), and a cache-side mean needs
  a rule for chunked prefill (which tokens define it) and per-sequence state that `fork` / prefix reuse must copy;
  so it stays an experimental model-side option, off by default.

Shapes: ``[..., D]`` with ``D`` a power of two (head_dim).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["ROTATIONS", "hadamard", "rotate", "rotate_rows", "k_mean", "smooth_k"]

ROTATIONS = (None, "hadamard")


@functools.lru_cache(maxsize=None)
def _hadamard_np(d: int) -> np.ndarray:
    if d < 1 or d & (d - 1):
        raise ValueError(f"the Hadamard rotation needs head_dim to be a power of two, got {d}")
    h = np.ones((1, 1), np.float64)
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(d)).astype(np.float32)


def hadamard(d: int) -> jax.Array:
    """Orthonormal, symmetric Sylvester-Hadamard matrix ``f32[d, d]`` (``H @ H = I``)."""
    return jnp.asarray(_hadamard_np(d))


def rotate(x, rotation=None):
    """``x[..., D] @ Hd`` in float32 (HIGHEST precision); identity when ``rotation`` is None. Self-inverse."""
    if rotation is None:
        return x
    if rotation != "hadamard":
        raise ValueError(f"rotation must be one of {ROTATIONS}, got {rotation!r}")
    return jnp.einsum("...d,de->...e", x.astype(jnp.float32), hadamard(x.shape[-1]),
                      precision=jax.lax.Precision.HIGHEST)


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
