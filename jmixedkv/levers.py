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
  sequence (post-RoPE, post-rotation: the stored frame) and frozen for later tokens, is subtracted from every
  stored key, twin included. The cache holds the means: `jmixedkv.state.CacheState.k_means` (f32[L, S, H, D] per
  group). `append` (`smooth_rows`) applies RoPE and the rotation outside the write kernel; a slot's call that
  writes its position 0 (its prefill or first prefill chunk, every layer) takes the float32 mean of that call's
  keys of the slot (padding excluded); every key is stored as ``k - mean`` (float32, one rounding to ``k``'s
  dtype). A refused call changes no mean; admit / release zero a slot's means; `fork` copies them (the shared
  pages hold keys shifted by the source's mean); a rewind to 0 and a new append take a new mean; speculative
  rollback above 0 keeps it (frozen before any draft token). Every score of one query shifts by the same
  ``sm_scale * q . mean``, so softmax and the output are unchanged; readers undo the rest: `decode_attention` and
  `chunk_attention` add ``sm_scale * q . mean`` to the LSE (`mean_logit`, q in the stored frame), so the LSE is the
  raw keys' and merges with attention over keys held elsewhere (sinks in `jmixedkv.step` apply to it); `stage`,
  `gather_rows`, `overlay_retained_rows` and `rows_reference` add the mean back to K (`to_model_space`) unless
  ``as_stored=True`` (`StagedCache.k_mean` then holds the means to add). A logit soft-cap does not commute with the
  shift, so ``soft_cap`` is refused. Prefix reuse and offload carry the owner's mean: a `jmixedkv.prefix.PrefixCache`
  entry keeps the id of the means its keys are shifted by, a match never mixes two, and `admit_with_prefix` writes
  them as the reusing slot's. An MLA latent group
  (kv_factor=1) refuses it (the latent is also the value). Compressed groups (`jmixedkv.compressed`) are not
  smoothed. The torch `interop.StaticPagedCache` holds its means likewise. With the rotation and "4 over 6" it
  lowered KL on every text measured; without them its effect changes sign with the text (bench/RESULTS.md).

Shapes: ``[..., D]`` with ``D`` a power of two (head_dim).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["ROTATIONS", "hadamard", "hadamard_np", "rotate", "unrotate", "rotate_rows", "k_mean", "smooth_k",
           "smooth_rows", "mean_logit", "to_model_space"]

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


def smooth_rows(rotation, means, layer, k, v, seq, pos, fresh, rope=None):
    """The write-path hook of `jmixedkv.state.append` under ``k_smoothing``: ``(k', v', means')``.

    ``k`` is RoPE'd (if ``rope``; rounded to ``k``'s dtype like the plain path) and rotated (float32); every slot
    with ``fresh bool[S]`` and at least one token here (``seq i32[T]``, -1 = padding) takes the float32 mean of its
    tokens' keys as its frozen mean; every key becomes ``k - means'[layer, seq]`` in float32, rounded once to
    ``k``'s dtype. ``v`` is rotated like `rotate_rows`. ``means f32[L, S, H, D]`` (stored frame: after the
    rotation); ``layer`` i32[] with ``k [T, H, D]``, or None with ``k [L, T, H, D]`` (every layer)."""
    from .rope import apply_rope
    if rope is not None:
        k = apply_rope(k, pos, rope).astype(k.dtype)
    kf = rotate(k, rotation).astype(jnp.float32)
    v = None if v is None else rotate(v, rotation).astype(v.dtype)
    num_seqs = means.shape[1]
    tokens = kf if layer is not None else jnp.moveaxis(kf, 0, 1)               # [T, (L,) H, D]
    sums, count = _slot_sums(tokens, seq, num_seqs)
    take = fresh & (count > 0)
    fresh_mean = sums / jnp.maximum(count, 1.0).reshape((-1,) + (1,) * (sums.ndim - 1))
    s = jnp.clip(seq, 0, num_seqs - 1)
    if layer is not None:
        cur = jnp.where(take[:, None, None], fresh_mean, means[layer])         # [S, H, D]
        means = means.at[layer].set(cur)
        k = (kf - cur[s]).astype(k.dtype)
    else:
        means = jnp.where(take[None, :, None, None], jnp.moveaxis(fresh_mean, 1, 0), means)   # [L, S, H, D]
        k = (kf - means[:, s]).astype(k.dtype)
    return k, v, means


def _slot_sums(tokens, seq, num_seqs: int):
    """``(sums f32[S, ...], count f32[S])``: the sum of ``tokens f32[T, ...]`` per slot ``seq i32[T]`` (-1 and
    out-of-range slots dropped) and the token count. A contraction with the one-hot ``[S, T]`` matrix, not a
    scatter-add: a GPU scatter-add adds colliding rows with atomics in no fixed order, so the mean (and every key
    stored as ``k - mean``) would differ in its last bits from run to run and between programs."""
    onehot = (seq[None, :] == jnp.arange(num_seqs, dtype=seq.dtype)[:, None]).astype(jnp.float32)    # [S, T]
    flat = tokens.reshape(tokens.shape[0], -1)
    sums = jnp.dot(onehot, flat, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return sums.reshape((num_seqs,) + tokens.shape[1:]), onehot.sum(axis=1)


def mean_logit(means, layer, seq, q, sm_scale=None):
    """``sm_scale * q . mean`` per query ``f32[B, Tq, Hq]``: what K smoothing took off every logit of a query.

    ``means f32[L, S, H, D]``; ``layer`` i32[]; ``seq i32[B]`` (-1 rows give 0); ``q [B, Tq, Hq, D]`` in the
    stored frame (rotated under a rotation lever), GQA groups of ``Hq // H`` consecutive query heads."""
    b, tq, hq, d = q.shape
    h = means.shape[2]
    scale = d ** -0.5 if sm_scale is None else sm_scale
    m = means[layer][jnp.clip(seq, 0, means.shape[1] - 1)]                      # [B, H, D]
    m = jnp.where((seq >= 0)[:, None, None], m, 0.0)
    qf = q.astype(jnp.float32).reshape(b, tq, h, hq // h, d)
    dot = jnp.einsum("btkgd,bkd->btkg", qf, m, precision=jax.lax.Precision.HIGHEST)
    return (dot * scale).reshape(b, tq, hq)


def to_model_space(rows, rotation=None, k_mean=None, dtype=None):
    """Stored rows ``rows [..., kv, H, D]`` back to model space in ``dtype`` (default ``rows``'s): the K mean
    ``k_mean f32[..., H, D]`` (None: no smoothing) added to the keys (``kv`` index 0), then `unrotate`; float32
    math, one rounding."""
    dtype = rows.dtype if dtype is None else jnp.dtype(dtype)
    if k_mean is not None:
        rows = rows.astype(jnp.float32)
        rows = jnp.concatenate([rows[..., :1, :, :] + k_mean[..., None, :, :], rows[..., 1:, :, :]], axis=-3)
    return unrotate(rows, rotation, dtype)
