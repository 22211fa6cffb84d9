"""Read paths of the cache: `stage` (plain paged cache for generic backends), `gather_rows` (sparse top-k rows)
and `overlay_retained_rows`; their host validation, their pure-jnp fallbacks, and a plain paged attention
reference over a staged cache.

Staged layout (HND pages, our pool layout)::

    StagedCache.pages       dtype[num_staged_pages, kv, H, page, D]      (one layer)
                            dtype[L, num_staged_pages, kv, H, page, D]   (layer=None: every layer of the group)
    StagedCache.page_table  i32[B, W]   compact staged ids: batch row b's page j is
                                        ``sum(ceil(kv_lens[:b] / page)) + j`` for ``j < ceil(kv_lens[b] / page)``,
                                        else -1 (W = the state's max_pages_per_seq)
    StagedCache.kv_lens     i32[B]      corrected lengths (0 for padding rows, seq_slot = -1)

Rows at or past ``kv_len`` inside a staged page are zero; staged pages past the used ones
(``>= sum(ceil(kv_lens / page))``) are unspecified. Export to FlashInfer (`StagedCache.flashinfer_csr`):
``kv_indptr = [0, cumsum(ceil(kv_lens / page))]``, ``kv_indices = arange(kv_indptr[-1])``,
``kv_last_page_len = kv_lens - (ceil(kv_lens / page) - 1) * page`` (0 for empty rows); HND pages of a K/V group
are FlashInfer's ``[num_pages, 2, H, page, D]`` HND cache as is, and ``pages.swapaxes(-3, -2)`` gives NHD.

FP8 scratch of `gather_rows` (``scratch_dtype="fp8"``): per batch row b the scale is the smallest power of two
``2^e >= ceiling_b / 448``, where ``ceiling_b = max(6 * f32(block scale) * gs)`` over the NVFP4 blocks of the
selected valid rows (the largest magnitude those rows can dequantize to; NaN blocks ignored; 1.0 when no block is
nonzero). The scratch is ``e4m3(clip(f32(x) / scale, ±448))`` of the attention-dtype row ``x`` (retained high rows
included: a high row above the NVFP4 ceiling saturates at ±448 * scale).

Validation (`jmixedkv.checks`): with concrete inputs (``validate=None`` or True) the arrays are pulled to the host
and out-of-range slots, layers, page ids and indices raise `ValueError` naming the batch row, slot, column and value
before any kernel runs. Under jit (traced inputs) every reader still range-checks what it uses: a batch row whose
slot is outside ``[-1, max_seqs)``, whose length is outside ``[0, max_pages * page]``, or any row when the layer is
outside ``[0, num_layers)``, is *flagged* -- `stage` gives it one staged page of NaN (``kv_lens = page_size``),
`gather_rows` / `overlay_retained_rows` give NaN rows -- and an index outside ``[-1, kv_len)`` gives a NaN row.
Nothing ever reads another sequence's data; -1 entries (padding) stay zero.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import checks
from .backend import dispatch
from .numerics import E4M3_MAX, e4m3_saturate
from .pools import pytree, read_row_pool
from .reference import attention_reference, rows_reference, stage_reference

__all__ = ["StagedCache", "stage", "gather_rows", "overlay_retained_rows", "fp8_scratch_scale", "encode_fp8_scratch",
           "staged_page_table", "paged_attention_reference", "validate_read"]

@pytree()
class StagedCache:
    """A plain paged cache in the attention dtype (see the module docstring for the layout)."""

    pages: jax.Array
    page_table: jax.Array
    kv_lens: jax.Array

    @property
    def page_size(self) -> int:
        return self.pages.shape[-2]

    def to_dense(self, layer: Optional[int] = None):
        """Dense ``[B, kv, H, W * page, D]``: staged rows, zero at rows ``>= kv_len`` (tests, small sizes)."""
        pages = self.pages if layer is None else self.pages[layer]
        if pages.ndim == 6:
            raise ValueError("StagedCache.to_dense: all-layer cache, pass layer=")
        b, w = self.page_table.shape
        page = self.page_size
        got = pages[jnp.maximum(self.page_table, 0)]                     # [B, W, kv, H, page, D]
        got = jnp.transpose(got, (0, 2, 3, 1, 4, 5)).reshape(b, pages.shape[1], pages.shape[2], w * page, -1)
        pos = jnp.arange(w * page)
        ok = (self.page_table[:, pos // page] >= 0) & (pos[None, :] < self.kv_lens[:, None])
        return jnp.where(ok[:, None, None, :, None], got, jnp.zeros((), got.dtype))

    def flashinfer_csr(self, *, as_numpy: bool = False):
        """``(kv_indptr i32[B+1], kv_indices i32[total], kv_last_page_len i32[B])`` over the staged pages for
        FlashInfer: int32 JAX arrays on the pages' device (``as_numpy=True``: host NumPy arrays). Not jittable (the
        index count depends on ``kv_lens``)."""
        lens = np.asarray(self.kv_lens)
        npages = -(-lens // self.page_size)
        indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
        last = np.where(npages > 0, lens - (npages - 1) * self.page_size, 0).astype(np.int32)
        csr = (indptr, np.arange(indptr[-1], dtype=np.int32), last)
        if as_numpy:
            return csr
        device = next(iter(self.pages.devices()))
        return tuple(jax.device_put(x, device) for x in csr)


# ----------------------------------------------------------------------------------------------- helpers
def _lens_for(state, seq, kv_lens):
    lens = state.kv_lens if kv_lens is None else jnp.asarray(kv_lens, jnp.int32)
    return lens, jnp.where(seq >= 0, lens[jnp.maximum(seq, 0)], 0)


def staged_page_table(batch_lens, width: int, page: int):
    """Compact staged ids ``i32[B, width]`` for batch lengths ``batch_lens i32[B]`` (-1 past each row's pages)."""
    npages = (batch_lens + page - 1) // page
    start = jnp.cumsum(npages) - npages
    j = jnp.arange(width, dtype=jnp.int32)[None, :]
    return jnp.where(j < npages[:, None], start[:, None] + j, -1).astype(jnp.int32)


def _is_traced(*xs) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(xs))


def _bad_rows(state, layer, seq, lens, group):
    """(bool[B] flagged batch rows, clipped layer): slot outside [-1, S), length outside [0, W * page], bad layer."""
    spec = state.groups[group]
    layer, layer_ok = checks.layer_in_range(layer, spec.num_layers)
    s = jnp.clip(seq, 0, state.max_seqs - 1)
    n = lens[s]
    bad = ((seq < -1) | (seq >= state.max_seqs)
           | ((seq >= 0) & ((n < 0) | (n > state.max_pages_per_seq * state.page_size))) | ~layer_ok)
    return bad, layer


def _nan_like(x):
    return jnp.array(jnp.nan, jnp.float32).astype(x.dtype)


# ----------------------------------------------------------------------------------------------- validation
def validate_read(state, layer, seq_slots, indices=None, *, group: int = 0, kv_lens=None, op: str = "read"):
    """Host-side checks (pulls the arrays); raises `ValueError` naming the offending entry."""
    if not isinstance(group, int) or not 0 <= group < len(state.groups):
        raise ValueError(f"{op}: group={group!r} out of range [0, {len(state.groups)})")
    spec = state.groups[group]
    if layer is not None:
        checks.host_int(np.asarray(layer).item() if np.ndim(layer) == 0 and not isinstance(layer, int) else layer,
                        "layer", op, 0, spec.num_layers)
    seq = np.asarray(seq_slots)
    if seq.ndim != 1 or not np.issubdtype(seq.dtype, np.integer):
        raise ValueError(f"{op}: seq_slots must be an integer vector [B], got shape {seq.shape} dtype {seq.dtype}")
    num_seqs, width = state.page_table.shape
    page = state.page_size
    bad = np.nonzero((seq < -1) | (seq >= num_seqs))[0]
    if bad.size:
        raise ValueError(f"{op}: seq_slots[{bad[0]}]={seq[bad[0]]} out of range [-1, {num_seqs})")
    lens = np.asarray(state.kv_lens if kv_lens is None else kv_lens)
    pt, ht = np.asarray(state.page_table), np.asarray(state.high_table)
    pools = state.pools[group]
    num_pages = state.alloc.num_pages          # pool arrays may carry padding pages past it (layout.offset_safe_count)
    num_high = state.high_alloc.num_pages if pools.high is not None else 0
    for b, s in enumerate(seq):
        if s < 0:
            continue
        n = int(lens[s])
        if not 0 <= n <= width * page:
            raise ValueError(f"{op}: batch row {b} (sequence slot {s}): kv_len={n} out of range [0, {width * page}]")
        npg = -(-n // page)
        row = pt[s]
        for j, pid in enumerate(row):
            if pid < -1 or pid >= num_pages or (j < npg and pid < 0):
                what = "not allocated (-1)" if pid == -1 else f"out of range [0, {num_pages})"
                raise ValueError(f"{op}: batch row {b} (sequence slot {s}, kv_len {n}): page_table[{s}, {j}]={pid} "
                                 f"{what}")
        if num_high:
            hb = np.nonzero((ht[s] < -1) | (ht[s] >= num_high))[0]
            if hb.size:
                raise ValueError(f"{op}: batch row {b} (sequence slot {s}): high_table[{s}, {hb[0]}]={ht[s][hb[0]]} "
                                 f"out of range [-1, {num_high})")
    if indices is not None:
        idx = np.asarray(indices)
        if idx.ndim != 2 or idx.shape[0] != seq.shape[0] or not np.issubdtype(idx.dtype, np.integer):
            raise ValueError(f"{op}: indices must be integer [B={seq.shape[0]}, K], got shape {idx.shape} "
                             f"dtype {idx.dtype}")
        for b, s in enumerate(seq):
            if s < 0:
                continue
            n = int(lens[s])
            bad = np.nonzero((idx[b] < -1) | (idx[b] >= n))[0]
            if bad.size:
                raise ValueError(f"{op}: indices[{b}, {bad[0]}]={idx[b, bad[0]]} out of range [-1, {n}) for "
                                 f"sequence slot {s} (kv_len {n})")


def _maybe_validate(validate, state, layer, seq, indices, group, kv_lens, op):
    spec = state.groups[group] if isinstance(group, int) and 0 <= group < len(state.groups) else None
    if spec is None:
        raise ValueError(f"{op}: group={group!r} out of range [0, {len(state.groups)})")
    checks.check_layer_arg(layer, spec.num_layers, op, spec.name)     # host ints: always
    traced = _is_traced(state, layer, seq, indices, kv_lens)
    if validate and traced:
        raise ValueError(f"{op}: validate=True needs concrete arrays (call it outside jit, or pass validate=False)")
    if validate or (validate is None and not traced):
        validate_read(state, layer, seq, indices, group=group, kv_lens=kv_lens, op=op)


# ----------------------------------------------------------------------------------------------- stage
def _stage_reference_pages(state, layer, seq, group, lens, table, num_staged):
    if layer is None:
        return jnp.stack([_stage_reference_pages(state, i, seq, group, lens, table, num_staged)
                          for i in range(state.groups[group].num_layers)])
    dense = stage_reference(state, layer, seq, group, lens)                  # [B, kv, H, W*page, D]
    b, kv, h, s_max, d = dense.shape
    page, w = state.page_size, table.shape[1]
    per_page = jnp.transpose(dense.reshape(b, kv, h, w, page, d), (0, 3, 1, 2, 4, 5)).reshape(b * w, kv, h, page, d)
    dst = jnp.where(table >= 0, table, num_staged).reshape(-1)
    out = jnp.zeros((num_staged, kv, h, page, d), dense.dtype)
    return out.at[dst].set(per_page, mode="drop")


def stage(state, layer, seq_slots, *, group: int = 0, backend: str = "auto", kv_lens=None,
          num_staged_pages: Optional[int] = None, validate: Optional[bool] = None) -> StagedCache:
    """Materialize a plain paged cache in the attention dtype for batch rows ``seq_slots`` (i32[B], -1 = padding).

    Args:
      layer: layer index within the group (int, may be traced) or None for every layer.
      kv_lens: optional corrected lengths i32[S] (default ``state.kv_lens``).
      num_staged_pages: static number of staged pages (default ``B * max_pages_per_seq``, always enough).
      validate: host checks (None = when the inputs are concrete).

    Returns:
      `StagedCache` (pages ``[N, kv, H, page, D]`` or ``[L, N, kv, H, page, D]``).
    """
    seq = checks.index_array(seq_slots, "seq_slots", "stage", ndim=1)
    _maybe_validate(validate, state, layer, seq, None, group, kv_lens, "stage")
    lens, batch_lens = _lens_for(state, seq, kv_lens)
    bad, layer_c = _bad_rows(state, layer, seq, lens, group)
    if layer is not None:
        layer = layer_c
    seq = jnp.where(bad, -1, seq)                    # flagged rows read nothing ...
    batch_lens = jnp.where(bad, state.page_size, batch_lens)   # ... and stage one page of NaN (below)
    width = state.max_pages_per_seq
    num_staged = seq.shape[0] * width if num_staged_pages is None else num_staged_pages
    table = staged_page_table(batch_lens, width, state.page_size)
    table = jnp.where(table < num_staged, table, -1)
    out = dispatch("reference" if state.kinds[group] == "plain" else backend,   # plain rows: already a row dtype
                   _stage_reference_pages, _stage_pallas)(state, layer, seq, group, lens, table, num_staged)
    poison = jnp.where(bad, table[:, 0], num_staged)
    poison = jnp.where(poison >= 0, poison, num_staged)
    if layer is None:
        out = out.at[:, poison].set(_nan_like(out), mode="drop")
    else:
        out = out.at[poison].set(_nan_like(out), mode="drop")
    return StagedCache(out, table, batch_lens)


def _stage_pallas(state, layer, seq, group, lens, table, num_staged, *, interpret):
    from pallas_kernels.stage import stage_pages
    kind, pools, spec = state.kinds[group], state.pools[group], state.groups[group]
    layers = (jnp.arange(spec.num_layers, dtype=jnp.int32) if layer is None
              else jnp.asarray(layer, jnp.int32).reshape(1))
    high = pools.high if kind == "mixed" else None
    pages = stage_pages(layers, seq, lens, state.page_table, state.high_table, table, pools.low.data,
                        pools.low.scales, pools.low.gs, None if high is None else high.rows,
                        None if high is None else high.scale, geom=state.config.twin,
                        num_staged_pages=num_staged, out_dtype=state.config.attention_dtype, interpret=interpret)
    return pages if layer is None else pages[0]


# ----------------------------------------------------------------------------------------------- gather / overlay
def _pow2_ceil(r):
    """Smallest power of two >= r (f32, r > 0), by exponent bits."""
    bits = jax.lax.bitcast_convert_type(r.astype(jnp.float32), jnp.int32)
    exp = (bits >> 23) + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)
    return jax.lax.bitcast_convert_type(exp << 23, jnp.float32)


def _selected(state, seq, indices, lens):
    n = jnp.where(seq >= 0, lens[jnp.maximum(seq, 0)], 0)[:, None]
    q = jnp.maximum(indices, 0) // state.page_size
    width = state.max_pages_per_seq
    lp = state.page_table[jnp.maximum(seq, 0)[:, None], jnp.minimum(q, width - 1)]
    valid = (seq[:, None] >= 0) & (indices >= 0) & (indices < n) & (q < width) & (lp >= 0)
    return jnp.maximum(lp, 0), jnp.maximum(indices, 0) % state.page_size, valid


def fp8_scratch_scale(state, layer, seq_slots, indices, *, group: int = 0, kv_lens=None):
    """f32[B] power-of-two FP8 scratch scale per batch row (see the module docstring)."""
    seq = jnp.asarray(seq_slots, jnp.int32)
    indices = jnp.asarray(indices, jnp.int32)
    lens = state.kv_lens if kv_lens is None else jnp.asarray(kv_lens, jnp.int32)
    lp, row, valid = _selected(state, seq, indices, lens)
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


def _check_scratch_dtype(scratch_dtype):
    if scratch_dtype not in (None, "fp8", "float8_e4m3fn"):
        raise ValueError(f"gather_rows: scratch_dtype must be None (attention dtype) or 'fp8', got {scratch_dtype!r}")
    return scratch_dtype is not None


def gather_rows(state, layer, seq_slots, indices, *, group: int = 0, scratch_dtype=None, backend: str = "auto",
                kv_lens=None, overlay: bool = True, validate: Optional[bool] = None):
    """Dequantize the rows a top-k indexer selected, then overlay the retained rows from the twin.

    Args:
      layer: layer index within the group (int, may be traced).
      seq_slots: i32[B] sequence slots (-1 = padding row: all zeros).
      indices: i32[B, K] positions (ragged, -1 padded).
      scratch_dtype: None (attention dtype) or ``"fp8"`` (E4M3 with a per-row power-of-two scale).
      overlay: False skips the twin (rows as the NVFP4 pool holds them; `overlay_retained_rows` adds them later).

    Returns:
      ``(scratch [B, K, kv, H, D], scale f32[B])`` (scale is 1.0 for an attention-dtype scratch).
    """
    fp8 = _check_scratch_dtype(scratch_dtype)
    seq = checks.index_array(seq_slots, "seq_slots", "gather_rows", ndim=1)
    indices = checks.index_array(indices, "indices", "gather_rows", ndim=2)
    _maybe_validate(validate, state, layer, seq, indices, group, kv_lens, "gather_rows")
    lens = state.kv_lens if kv_lens is None else jnp.asarray(kv_lens, jnp.int32)
    flag, layer, seq = _flag_selection(state, layer, seq, indices, lens, group)
    out, scale = _gather_dispatch(state, layer, seq, indices, lens, group, fp8, backend, overlay)
    return jnp.where(flag[..., None, None, None], _nan_like(out), out), scale


def _flag_selection(state, layer, seq, indices, lens, group):
    """(bool[B, K] NaN entries, clipped layer, seq with flagged rows set to -1) for a sparse read."""
    bad, layer = _bad_rows(state, layer, seq, lens, group)
    n = jnp.where(seq >= 0, lens[jnp.clip(seq, 0, state.max_seqs - 1)], 0)[:, None]
    live = (seq >= 0)[:, None]
    flag = bad[:, None] | (live & ((indices < -1) | (indices >= jnp.maximum(n, 0)) & (indices != -1)))
    return flag, layer, jnp.where(bad, -1, seq)


def _gather_dispatch(state, layer, seq, indices, lens, group, fp8, backend, overlay):
    scale = (fp8_scratch_scale(state, layer, seq, indices, group=group, kv_lens=lens) if fp8
             else jnp.ones(seq.shape, jnp.float32))
    out = dispatch("reference" if state.kinds[group] == "plain" else backend, _gather_reference, _gather_pallas)(
        state, layer, seq, indices, lens, group, scale, fp8, overlay)
    return out, scale


def _gather_reference(state, layer, seq, indices, lens, group, scale, fp8, overlay):
    if not overlay:                                          # NVFP4 / plain rows only: the state without its twin
        pools = state.pools[group]
        state = dataclasses.replace(state, pools=state.pools[:group] + (dataclasses.replace(pools, high=None),)
                                    + state.pools[group + 1:])
    rows = rows_reference(state, layer, seq[:, None], indices, group, lens)
    return encode_fp8_scratch(rows, scale) if fp8 else rows


def _gather_pallas(state, layer, seq, indices, lens, group, scale, fp8, overlay, *, interpret):
    from pallas_kernels.gather import gather_rows as kernel
    pools = state.pools[group]
    high = pools.high if (state.kinds[group] == "mixed" and overlay) else None
    return kernel(jnp.asarray(layer, jnp.int32).reshape(1), seq, lens, state.page_table, state.high_table, indices,
                  scale, pools.low.data, pools.low.scales, pools.low.gs, None if high is None else high.rows,
                  None if high is None else high.scale, geom=state.config.twin,
                  att_dtype=state.config.attention_dtype, fp8=fp8, interpret=interpret)


def overlay_retained_rows(state, layer, scratch, seq_slots, indices, *, scale=None, group: int = 0,
                          backend: str = "auto", kv_lens=None, validate: Optional[bool] = None):
    """Copy the twin's rows over ``scratch[B, K, kv, H, D]`` where the selected position is retained.

    ``scratch`` in the attention dtype, or float8_e4m3fn with ``scale f32[B]`` (high rows are encoded with it).
    Other rows are returned unchanged. The Pallas kernel aliases the scratch: inside a jit that donates it the update
    is in place."""
    seq = checks.index_array(seq_slots, "seq_slots", "overlay_retained_rows", ndim=1)
    indices = checks.index_array(indices, "indices", "overlay_retained_rows", ndim=2)
    fp8 = scratch.dtype == jnp.dtype(jnp.float8_e4m3fn)
    if fp8 and scale is None:
        raise ValueError("overlay_retained_rows: an fp8 scratch needs scale= (f32[B], from gather_rows)")
    if scratch.shape[:2] != indices.shape:
        raise ValueError(f"overlay_retained_rows: scratch {scratch.shape} does not match indices {indices.shape}")
    _maybe_validate(validate, state, layer, seq, indices, group, kv_lens, "overlay_retained_rows")
    lens = state.kv_lens if kv_lens is None else jnp.asarray(kv_lens, jnp.int32)
    flag, layer, seq = _flag_selection(state, layer, seq, indices, lens, group)
    out = _overlay_dispatch(scratch, state, layer, seq, indices, scale, group, backend, lens, fp8)
    return jnp.where(flag[..., None, None, None], _nan_like(out), out)


def _overlay_dispatch(scratch, state, layer, seq, indices, scale, group, backend, lens, fp8):
    kind, pools = state.kinds[group], state.pools[group]
    if kind != "mixed" or pools.high is None:
        return scratch
    scale = jnp.ones(seq.shape, jnp.float32) if scale is None else jnp.asarray(scale, jnp.float32)
    return dispatch(backend, _overlay_reference, _overlay_pallas)(scratch, state, layer, seq, indices, scale, group,
                                                                  lens, fp8)


def _overlay_reference(scratch, state, layer, seq, indices, scale, group, lens, fp8):
    twin = state.config.twin
    _, row, valid = _selected(state, seq, indices, lens)
    n = jnp.where(seq >= 0, lens[jnp.maximum(seq, 0)], 0)[:, None]
    hp, held = twin.twin_page(state.high_table, jnp.maximum(seq, 0)[:, None], twin.high_column(jnp.maximum(indices, 0)))
    keep = valid & twin.is_retained(indices, n) & held
    high = read_row_pool(state.pools[group].high, layer, jnp.maximum(hp, 0), row, state.config.attention_dtype)
    high = encode_fp8_scratch(high, scale) if fp8 else high.astype(scratch.dtype)
    return jnp.where(keep[..., None, None, None], high, scratch)


def _overlay_pallas(scratch, state, layer, seq, indices, scale, group, lens, fp8, *, interpret):
    from pallas_kernels.gather import overlay_rows
    high = state.pools[group].high
    return overlay_rows(scratch, jnp.asarray(layer, jnp.int32).reshape(1), seq, lens, state.page_table,
                        state.high_table, indices, scale, high.rows, high.scale, geom=state.config.twin,
                        att_dtype=state.config.attention_dtype, interpret=interpret)


# ----------------------------------------------------------------------------------------------- attention
def paged_attention_reference(q, staged: StagedCache, *, layer: Optional[int] = None, sm_scale=None,
                              sliding_window=None, soft_cap=None):
    """float32 paged decode / verify attention over a staged cache (plain jnp; the end-to-end check of `stage`).

    Args:
      q: ``[B, Tq, Hq, D]`` queries (token t of row b sits at position ``kv_len - Tq + t``, causal).
      staged: `StagedCache` of a K/V group (kv = 2); for an MLA latent (kv = 1) keys and values are both the
        latent. ``layer`` picks a layer of an all-layer staged cache.

    Returns:
      ``(out f32[B, Tq, Hq, D], lse f32[B, Tq, Hq])``.
    """
    dense = staged.to_dense(layer)                                   # [B, kv, H, S, D]
    k = dense[:, 0]
    v = dense[:, 1] if dense.shape[1] == 2 else dense[:, 0]
    return attention_reference(q, k, v, staged.kv_lens, sm_scale=sm_scale, sliding_window=sliding_window,
                               soft_cap=soft_cap)
