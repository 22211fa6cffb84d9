"""Sparse reads: `gather_rows` (the rows a top-k indexer selected) and `overlay_retained_rows` (the twin's rows over
a scratch), with their pure-jnp reference `rows_reference` (what every reader must see) and their Pallas kernels
(`pallas_kernels.gather`).

FP8 scratch of `gather_rows` (``scratch_dtype="fp8"``): per batch row b the scale is the smallest power of two
``2^e >= ceiling_b / 448``, where ``ceiling_b = max(6 * f32(block scale) * gs)`` over the NVFP4 blocks of the
selected valid rows (the largest magnitude those rows can dequantize to; NaN blocks ignored; 1.0 when no block is
nonzero). The scratch is ``e4m3(clip(f32(x) / scale, ±448))`` of the attention-dtype row ``x`` (retained high rows
included: a high row above the NVFP4 ceiling saturates at ±448 * scale).

Rotation lever (``KVCacheConfig.rotation``, `jmixedkv.levers`): every reader here returns **model-space** rows by
default -- the stored rows multiplied back by the Hadamard matrix (float32, one rounding to the attention dtype),
so a consumer never needs to know the lever; ``as_stored=True`` returns the rows as stored (rotated) and the
consumer applies ``jmixedkv.levers.unrotate(rows, state.config.rotation)`` itself (or rotates its queries). With a
rotation, a model-space FP8 scratch takes its scale from the un-rotated rows (``2^e >= max|x| / 448``, the NVFP4
block ceiling bounds the stored basis only), and `overlay_retained_rows` runs its jnp path (no in-place kernel:
the twin's rows are un-rotated first). K smoothing (``k_smoothing``, the state's ``k_means``): model-space keys
are the stored ``k - mean`` plus the slot's mean (float32, before the un-rotation and the one rounding; the same jnp
paths as the rotation); ``as_stored=True`` gives the shifted keys, and ``state.k_means[group][layer, slot]`` is the
mean to add. Without either lever ``as_stored`` changes nothing.

Validation (`jmixedkv.checks`): concrete inputs are checked on the host (`checks.validate_read`); inside jit a batch
row whose slot, length or layer is bad, or an index outside ``[-1, kv_len)``, gives NaN rows. Nothing ever reads
another sequence's data; -1 entries (padding) stay zero.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from . import checks, levers
from .backend import dispatch
from .numerics import E4M3_MAX, e4m3_saturate
from .pools import read_low_rows, read_row_pool

__all__ = ["gather_rows", "overlay_retained_rows", "rows_reference", "fp8_scratch_scale", "encode_fp8_scratch"]


def rows_reference(state, layer, seq, pos, group: int = 0, kv_lens=None, dtype=None, as_stored: bool = False):
    """Rows a reader sees at tokens ``(seq[...], pos[...])`` -> ``[..., kv, H, D]`` in ``dtype`` (default: the
    attention dtype; ``float32`` gives the decoded values before any rounding to it): the high row where the
    position is retained (``p < first_n`` or ``n - last_n <= p < n``), else the dequantized NVFP4 row (or the plain
    row for plain groups). Never imports a kernel. Model space (the rotation lever undone, module docstring)
    unless ``as_stored``.

    Positions outside ``[0, n)``, padding (``seq == -1``) and rows whose page is not held read as zero. A bad
    slot (outside ``[-1, max_seqs)``), a bad layer (outside ``[0, num_layers)``, traced) or a length outside
    ``[0, max_pages * page]`` reads as NaN: never another sequence's rows (`jmixedkv.checks`)."""
    cfg, kind, pools, spec = state.config, state.kinds[group], state.pools[group], state.groups[group]
    dtype = cfg.attention_dtype if dtype is None else jnp.dtype(dtype)
    rotation = None if as_stored else cfg.rotation
    smoothed = not as_stored and state.k_means is not None
    out_dtype, dtype = dtype, (dtype if rotation is None and not smoothed else jnp.dtype(jnp.float32))
    kv_lens = state.kv_lens if kv_lens is None else jnp.asarray(kv_lens, jnp.int32)
    page = cfg.page_size
    layer = checks.check_layer_arg(layer, spec.num_layers, "rows_reference", spec.name)
    seq = jnp.asarray(seq, jnp.int32)
    bad, layer = checks.bad_read_rows(state, layer, seq, kv_lens, group)
    s = jnp.clip(seq, 0, state.max_seqs - 1)
    n = jnp.where((seq >= 0) & ~bad, kv_lens[s], 0)
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
    mean = state.k_means[group][layer][s] if smoothed else None                       # [..., H, D]
    out = levers.to_model_space(out, rotation, mean, out_dtype)         # float32 math, one rounding
    out = jnp.where(valid[..., None, None, None], out, jnp.zeros((), out_dtype))
    return jnp.where(bad[..., None, None, None], jnp.array(jnp.nan, out_dtype), out)


def _pow2_ceil(r):
    """Smallest power of two >= r (f32, r > 0), by exponent bits."""
    bits = jax.lax.bitcast_convert_type(r.astype(jnp.float32), jnp.int32)
    exp = (bits >> 23) + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)
    return jax.lax.bitcast_convert_type(exp << 23, jnp.float32)


def _selected(state, seq, indices, lens):
    """(low page, row, valid, kv_len [B, 1]) of each selected position ``indices[b, k]``."""
    n = jnp.where(seq >= 0, lens[jnp.maximum(seq, 0)], 0)[:, None]
    q = jnp.maximum(indices, 0) // state.page_size
    width = state.max_pages_per_seq
    lp = state.page_table[jnp.maximum(seq, 0)[:, None], jnp.minimum(q, width - 1)]
    valid = (seq[:, None] >= 0) & (indices >= 0) & (indices < n) & (q < width) & (lp >= 0)
    return jnp.maximum(lp, 0), jnp.maximum(indices, 0) % state.page_size, valid, n


def fp8_scratch_scale(state, layer, seq_slots, indices, *, group: int = 0, kv_lens=None):
    """f32[B] power-of-two FP8 scratch scale per batch row (see the module docstring)."""
    seq = jnp.asarray(seq_slots, jnp.int32)
    indices = jnp.asarray(indices, jnp.int32)
    lens = state.kv_lens if kv_lens is None else jnp.asarray(kv_lens, jnp.int32)
    lp, row, valid, _ = _selected(state, seq, indices, lens)
    pools = state.pools[group]
    if state.kinds[group] == "plain":
        mag = jnp.max(jnp.abs(read_row_pool(pools.plain, layer, lp, row, jnp.float32)), axis=(-1, -2, -3))
    else:
        s = pools.low.scales[layer][lp, :, :, row, :].astype(jnp.float32)            # [B, K, kv, H, D/16]
        ceil = (s * jnp.float32(6.0)) * pools.low.gs[layer][:, None, None]
        mag = jnp.max(jnp.where(jnp.isnan(ceil), 0.0, ceil), axis=(-1, -2, -3))
    ceiling = jnp.max(jnp.where(valid, jnp.where(jnp.isnan(mag), 0.0, mag), 0.0), axis=1)
    return jnp.where(ceiling > 0, _pow2_ceil(ceiling / jnp.float32(E4M3_MAX)), jnp.float32(1.0))


def encode_fp8_scratch(rows, scale):
    """``e4m3(clip(f32(rows) / scale[b], ±448))`` for rows ``[B, K, ...]`` (NaN kept)."""
    return e4m3_saturate(rows.astype(jnp.float32) / scale.reshape((-1,) + (1,) * (rows.ndim - 1)))


def gather_rows(state, layer, seq_slots, indices, *, group: int = 0, scratch_dtype=None, backend: str = "auto",
                kv_lens=None, overlay: bool = True, validate: Optional[bool] = None, as_stored: bool = False):
    """Dequantize the rows a top-k indexer selected, then overlay the retained rows from the twin.

    Args:
      layer: layer index within the group (int, may be traced).
      seq_slots: i32[B] sequence slots (-1 = padding row: all zeros).
      indices: i32[B, K] positions (ragged, -1 padded).
      scratch_dtype: None (attention dtype) or ``"fp8"`` (E4M3 with a per-row power-of-two scale).
      overlay: False skips the twin (rows as the NVFP4 pool holds them; `overlay_retained_rows` adds them later).
      validate: host checks (None = when the inputs are concrete).
      as_stored: rows as stored (rotated under ``rotation="hadamard"``); default model space (module docstring).

    Returns:
      ``(scratch [B, K, kv, H, D], scale f32[B])`` (scale is 1.0 for an attention-dtype scratch).
    """
    if scratch_dtype not in (None, "fp8", "float8_e4m3fn"):
        raise ValueError(f"gather_rows: scratch_dtype must be None (attention dtype) or 'fp8', got {scratch_dtype!r}")
    fp8 = scratch_dtype is not None
    seq = checks.index_array(seq_slots, "seq_slots", "gather_rows", ndim=1)
    indices = checks.index_array(indices, "indices", "gather_rows", ndim=2)
    checks.maybe_validate_read(validate, state, layer, seq, indices, group, kv_lens, "gather_rows")
    lens = state.kv_lens if kv_lens is None else jnp.asarray(kv_lens, jnp.int32)
    flag, layer, seq = _flag_selection(state, layer, seq, indices, lens, group)
    impl = dispatch("reference" if state.kinds[group] == "plain" else backend, _gather_reference, _gather_pallas)
    rotation = None if as_stored else state.config.rotation
    mean = _row_means(state, layer, seq, group, as_stored)
    if rotation is not None or mean is not None:   # model space: float32 rows, mean added, un-rotated, one rounding
        ones = jnp.ones(seq.shape, jnp.float32)
        rows = impl(state, layer, seq, indices, lens, group, ones, False, overlay, jnp.float32)
        rows = levers.to_model_space(rows, rotation, None if mean is None else mean[:, None], jnp.float32)
        rows = jnp.where(_selected(state, seq, indices, lens)[2][..., None, None, None], rows, 0.0)   # padding: 0
        scale = _rows_scale(rows) if fp8 else ones
        out = rows.astype(state.config.attention_dtype)
        out = encode_fp8_scratch(out, scale) if fp8 else out
    else:
        scale = (fp8_scratch_scale(state, layer, seq, indices, group=group, kv_lens=lens) if fp8
                 else jnp.ones(seq.shape, jnp.float32))
        out = impl(state, layer, seq, indices, lens, group, scale, fp8, overlay)
    return jnp.where(flag[..., None, None, None], checks.nan_like(out), out), scale


def _row_means(state, layer, seq, group, as_stored):
    """f32[B, H, D] K-smoothing means of batch rows ``seq`` (zeros for -1), None unless a model-space read of a
    K-smoothed state."""
    if as_stored or state.k_means is None:
        return None
    m = state.k_means[group][layer][jnp.clip(seq, 0, state.max_seqs - 1)]
    return jnp.where((seq >= 0)[:, None, None], m, 0.0)


def _rows_scale(rows):
    """f32[B] power-of-two FP8 scale of model-space rows ``f32[B, K, kv, H, D]``: ``2^e >= max|x| / 448`` over
    the row's non-NaN entries (1.0 when all are zero)."""
    mag = jnp.max(jnp.where(jnp.isnan(rows), 0.0, jnp.abs(rows)), axis=(1, 2, 3, 4))
    return jnp.where(mag > 0, _pow2_ceil(mag / jnp.float32(E4M3_MAX)), jnp.float32(1.0))


def _flag_selection(state, layer, seq, indices, lens, group):
    """(bool[B, K] NaN entries, clipped layer, seq with flagged rows set to -1) for a sparse read."""
    bad, layer = checks.bad_read_rows(state, layer, seq, lens, group)
    n = jnp.where(seq >= 0, lens[jnp.clip(seq, 0, state.max_seqs - 1)], 0)[:, None]
    live = (seq >= 0)[:, None]
    flag = bad[:, None] | (live & ((indices < -1) | (indices >= jnp.maximum(n, 0)) & (indices != -1)))
    return flag, layer, jnp.where(bad, -1, seq)


def _gather_reference(state, layer, seq, indices, lens, group, scale, fp8, overlay, dtype=None):
    """Rows as stored (the rotation, if any, is undone by `gather_rows`), in ``dtype`` (default attention)."""
    if not overlay:                                          # NVFP4 / plain rows only: the state without its twin
        pools = state.pools[group]
        state = dataclasses.replace(state, pools=state.pools[:group] + (dataclasses.replace(pools, high=None),)
                                    + state.pools[group + 1:])
    rows = rows_reference(state, layer, seq[:, None], indices, group, lens, dtype, as_stored=True)
    return encode_fp8_scratch(rows, scale) if fp8 else rows


def _gather_pallas(state, layer, seq, indices, lens, group, scale, fp8, overlay, dtype=None, *, interpret):
    from pallas_kernels.gather import gather_rows as kernel
    pools = state.pools[group]
    high = pools.high if (state.kinds[group] == "mixed" and overlay) else None
    return kernel(jnp.asarray(layer, jnp.int32).reshape(1), seq, lens, state.page_table, state.high_table, indices,
                  scale, low=(pools.low.data, pools.low.scales, pools.low.gs),
                  high=None if high is None else (high.rows, high.scale), geom=state.config.twin,
                  att_dtype=state.config.attention_dtype if dtype is None else dtype, fp8=fp8, interpret=interpret)


def overlay_retained_rows(state, layer, scratch, seq_slots, indices, *, scale=None, group: int = 0,
                          backend: str = "auto", kv_lens=None, validate: Optional[bool] = None,
                          as_stored: bool = False):
    """Copy the twin's rows over ``scratch[B, K, kv, H, D]`` where the selected position is retained.

    ``scratch`` in the attention dtype, or float8_e4m3fn with ``scale f32[B]`` (high rows are encoded with it).
    Other rows are returned unchanged. The Pallas kernel aliases the scratch: inside a jit that donates it the update
    is in place. The twin's rows go in model space (the scratch of ``gather_rows(..., overlay=False)``) unless
    ``as_stored`` (a scratch gathered with ``as_stored=True``); a rotated cache's model-space overlay runs the jnp
    path for either backend (module docstring)."""
    seq = checks.index_array(seq_slots, "seq_slots", "overlay_retained_rows", ndim=1)
    indices = checks.index_array(indices, "indices", "overlay_retained_rows", ndim=2)
    fp8 = scratch.dtype == jnp.dtype(jnp.float8_e4m3fn)
    if fp8 and scale is None:
        raise ValueError("overlay_retained_rows: an fp8 scratch needs scale= (f32[B], from gather_rows)")
    if scratch.shape[:2] != indices.shape:
        raise ValueError(f"overlay_retained_rows: scratch {scratch.shape} does not match indices {indices.shape}")
    checks.maybe_validate_read(validate, state, layer, seq, indices, group, kv_lens, "overlay_retained_rows")
    lens = state.kv_lens if kv_lens is None else jnp.asarray(kv_lens, jnp.int32)
    flag, layer, seq = _flag_selection(state, layer, seq, indices, lens, group)
    out = scratch
    if state.kinds[group] == "mixed" and state.pools[group].high is not None:
        scale = jnp.ones(seq.shape, jnp.float32) if scale is None else jnp.asarray(scale, jnp.float32)
        rotation = None if as_stored else state.config.rotation
        mean = _row_means(state, layer, seq, group, as_stored)
        impl = (_overlay_reference if rotation is not None or mean is not None
                else dispatch(backend, _overlay_reference, _overlay_pallas))
        out = impl(scratch, state, layer, seq, indices, scale, group, lens, fp8, rotation, mean)
    return jnp.where(flag[..., None, None, None], checks.nan_like(out), out)


def _overlay_reference(scratch, state, layer, seq, indices, scale, group, lens, fp8, rotation=None, mean=None):
    twin = state.config.twin
    _, row, valid, n = _selected(state, seq, indices, lens)
    hp, held = twin.twin_page(state.high_table, jnp.maximum(seq, 0)[:, None], twin.high_column(jnp.maximum(indices, 0)))
    keep = valid & twin.is_retained(indices, n) & held
    att = state.config.attention_dtype
    high = read_row_pool(state.pools[group].high, layer, jnp.maximum(hp, 0), row,
                         att if rotation is None and mean is None else jnp.float32)
    high = levers.to_model_space(high, rotation, None if mean is None else mean[:, None], att)
    high = encode_fp8_scratch(high, scale) if fp8 else high.astype(scratch.dtype)
    return jnp.where(keep[..., None, None, None], high, scratch)


def _overlay_pallas(scratch, state, layer, seq, indices, scale, group, lens, fp8, rotation=None, mean=None, *,
                    interpret):
    del rotation, mean                                    # None here: a model-space rotated overlay runs the jnp path
    from pallas_kernels.gather import overlay_rows
    high = state.pools[group].high
    return overlay_rows(scratch, jnp.asarray(layer, jnp.int32).reshape(1), seq, lens, state.page_table,
                        state.high_table, indices, scale, high=(high.rows, high.scale), geom=state.config.twin,
                        att_dtype=state.config.attention_dtype, interpret=interpret)
