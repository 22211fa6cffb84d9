"""Staging: `stage` materializes a plain paged cache in the attention dtype (for generic attention backends), with
its pure-jnp reference `stage_reference` and its Pallas kernel (`pallas_kernels.stage`).

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

Rotation lever (``KVCacheConfig.rotation``, `jmixedkv.levers`): staged pages are **model space** by default --
the stored rows multiplied back by the Hadamard matrix in float32 and rounded once to the attention dtype -- so a
generic backend (FlashInfer / vLLM over the staged pages, `interop.hf`'s staged decode) attends with the model's
own q and needs nothing else (``StagedCache.rotation`` is None). ``stage(..., as_stored=True)`` stages the rows as
stored; ``StagedCache.rotation`` then names the rotation still applied to them (rotate q by
``jmixedkv.levers.hadamard(D)`` before attention and the output after it, or un-rotate the pages). Accuracy: a
bf16 twin row comes back within one bf16 rounding of the row written plus the write's rounding of the rotated row
(`jmixedkv.levers.unrotate`), so an all-high rotated cache is not bit-exact but within bf16 rounding. The Pallas
path stages rotated pages in float32 first (twice the staging buffer, transiently).

K smoothing (``k_smoothing``): model-space pages hold the raw keys (the stored ``k - mean`` plus the slot's frozen
mean, float32, before the un-rotation and the one rounding); ``as_stored=True`` pages hold the shifted keys and
``StagedCache.k_mean`` the per-batch-row means to add (a backend attending over them gets the model's output; its
LSE is lower by ``sm_scale * q . mean``).

Validation (`jmixedkv.checks`): concrete inputs are checked on the host (`checks.validate_read`); inside jit a batch
row whose slot, length or layer is bad gets one staged page of NaN (``kv_lens = page_size``) and reads nothing.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import checks, levers
from .backend import dispatch
from .gather import rows_reference
from .pools import pytree

__all__ = ["StagedCache", "stage", "stage_reference", "staged_page_table"]


@pytree("rotation")
class StagedCache:
    """A plain paged cache in the attention dtype (see the module docstring for the layout). ``rotation``: None
    for model-space pages (the default of `stage`), else the rotation the pages are still stored in. ``k_mean``:
    None for model-space pages, else (``as_stored=True`` on a K-smoothed cache) the K mean each batch row's keys
    are still shifted by, ``f32[B, H, D]`` (``[L, B, H, D]`` for every layer), in the stored frame."""

    pages: jax.Array
    page_table: jax.Array
    kv_lens: jax.Array
    rotation: Optional[str] = None
    k_mean: Optional[jax.Array] = None

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


def staged_page_table(batch_lens, width: int, page: int):
    """Compact staged ids ``i32[B, width]`` for batch lengths ``batch_lens i32[B]`` (-1 past each row's pages)."""
    npages = (batch_lens + page - 1) // page
    start = jnp.cumsum(npages) - npages
    j = jnp.arange(width, dtype=jnp.int32)[None, :]
    return jnp.where(j < npages[:, None], start[:, None] + j, -1).astype(jnp.int32)


def stage_reference(state, layer, seq_slots, group: int = 0, kv_lens=None, dtype=None, width: Optional[int] = None,
                    as_stored: bool = False):
    """Dense cache a reader must see (`jmixedkv.gather.rows_reference` at every position): ``[B, kv, H,
    max_pages * page, D]``; ``seq_slots`` i32[B] (-1 = padding row, all zeros); ``kv_lens`` overrides the lengths.
    ``dtype``: default the attention dtype; ``float32`` keeps the decoded NVFP4 / FP8 values exact (``(e2m1 * s) *
    gs`` in float32): the oracle of the fused decode kernel, which never rounds them. Model space unless
    ``as_stored`` (module docstring)."""
    seq = jnp.asarray(seq_slots, jnp.int32)
    width = state.max_pages_per_seq if width is None else width             # pages per row read
    pos = jnp.arange(width * state.page_size, dtype=jnp.int32)
    rows = rows_reference(state, layer, seq[:, None], pos[None, :], group, kv_lens, dtype,
                          as_stored=as_stored)                                             # [B, S, kv, H, D]
    return jnp.transpose(rows, (0, 2, 3, 1, 4))


def stage(state, layer, seq_slots, *, group: int = 0, backend: str = "auto", kv_lens=None,
          num_staged_pages: Optional[int] = None, validate: Optional[bool] = None,
          width: Optional[int] = None, as_stored: bool = False) -> StagedCache:
    """Materialize a plain paged cache in the attention dtype for batch rows ``seq_slots`` (i32[B], -1 = padding).

    Args:
      layer: layer index within the group (int, may be traced) or None for every layer.
      kv_lens: optional corrected lengths i32[S] (default ``state.kv_lens``).
      num_staged_pages: static number of staged pages (default ``B * width``, always enough).
      width: static page-table width of the result (default the state's ``max_pages_per_seq``); a smaller one
        stages only each row's first ``width`` pages (for callers that know ``ceil(kv_len / page) <= width``).
      validate: host checks (None = when the inputs are concrete).
      as_stored: stage the rows as stored (rotated under ``rotation="hadamard"``, named by
        ``StagedCache.rotation``); default model space (module docstring).

    Returns:
      `StagedCache` (pages ``[N, kv, H, page, D]`` or ``[L, N, kv, H, page, D]``).
    """
    seq = checks.index_array(seq_slots, "seq_slots", "stage", ndim=1)
    checks.maybe_validate_read(validate, state, layer, seq, None, group, kv_lens, "stage")
    lens = state.kv_lens if kv_lens is None else jnp.asarray(kv_lens, jnp.int32)
    bad, layer = checks.bad_read_rows(state, layer, seq, lens, group)         # layer None stays None
    batch_lens = jnp.where(seq >= 0, lens[jnp.maximum(seq, 0)], 0)
    seq = jnp.where(bad, -1, seq)                    # flagged rows read nothing ...
    batch_lens = jnp.where(bad, state.page_size, batch_lens)   # ... and stage one page of NaN (below)
    width = state.max_pages_per_seq if width is None else width
    num_staged = seq.shape[0] * width if num_staged_pages is None else num_staged_pages
    table = staged_page_table(batch_lens, width, state.page_size)
    table = jnp.where(table < num_staged, table, -1)
    out = dispatch("reference" if state.kinds[group] == "plain" else backend,   # plain rows: already a row dtype
                   _stage_reference_pages, _stage_pallas)(state, layer, seq, group, lens, table, num_staged,
                                                          as_stored)
    poison = jnp.where(bad, table[:, 0], num_staged)
    poison = jnp.where(poison >= 0, poison, num_staged)
    out = (out.at[:, poison] if layer is None else out.at[poison]).set(checks.nan_like(out), mode="drop")
    k_mean = None
    if as_stored and state.k_means is not None:
        m = state.k_means[group] if layer is None else state.k_means[group][layer]
        m = jnp.take(m, jnp.clip(seq, 0, state.max_seqs - 1), axis=-3)
        k_mean = jnp.where((seq >= 0)[:, None, None], m, 0.0)
    return StagedCache(out, table, batch_lens, state.config.rotation if as_stored else None, k_mean)


def _stage_reference_pages(state, layer, seq, group, lens, table, num_staged, as_stored):
    """Staged pages in the attention dtype, in model space unless ``as_stored``."""
    if layer is None:
        return jnp.stack([_stage_reference_pages(state, i, seq, group, lens, table, num_staged, as_stored)
                          for i in range(state.groups[group].num_layers)])
    dense = stage_reference(state, layer, seq, group, lens, width=table.shape[1],
                            as_stored=as_stored)                             # [B, kv, H, W*page, D]
    b, kv, h, s_max, d = dense.shape
    page, w = state.page_size, table.shape[1]
    per_page = jnp.transpose(dense.reshape(b, kv, h, w, page, d), (0, 3, 1, 2, 4, 5)).reshape(b * w, kv, h, page, d)
    dst = jnp.where(table >= 0, table, num_staged).reshape(-1)
    out = jnp.zeros((num_staged, kv, h, page, d), dense.dtype)
    return out.at[dst].set(per_page, mode="drop")


def _page_means(state, layer, seq, group, lens, table, num_staged):
    """The K mean to add to every staged row, ``f32[N, page, H, D]`` (``[L, N, page, H, D]`` for ``layer=None``):
    its batch row's slot mean at rows ``< kv_len``, zero elsewhere (unused pages, padding, rows past the length)."""
    b, w = table.shape
    page = state.page_size
    dst = jnp.where(table >= 0, table, num_staged).reshape(-1)
    owner = jnp.full((num_staged,), -1, jnp.int32).at[dst].set(jnp.repeat(jnp.arange(b, dtype=jnp.int32), w),
                                                                mode="drop")
    col = jnp.zeros((num_staged,), jnp.int32).at[dst].set(jnp.tile(jnp.arange(w, dtype=jnp.int32), b), mode="drop")
    row_seq = jnp.where(owner >= 0, seq[jnp.maximum(owner, 0)], -1)                        # [N]
    row_len = jnp.where(owner >= 0, lens[jnp.clip(row_seq, 0, state.max_seqs - 1)], 0)
    held = (row_seq >= 0)[:, None] & (col[:, None] * page + jnp.arange(page)[None, :] < row_len[:, None])
    means = state.k_means[group] if layer is None else state.k_means[group][layer]
    m = jnp.take(means, jnp.clip(row_seq, 0, state.max_seqs - 1), axis=-3)               # [(L,) N, H, D]
    return jnp.where(held[..., None, None], m[..., None, :, :], 0.0)


def _stage_pallas(state, layer, seq, group, lens, table, num_staged, as_stored, *, interpret):
    """Staged pages from the kernel; in model space under a lever it stages float32 pages, adds the K means and
    un-rotates them, one rounding."""
    from pallas_kernels.stage import stage_pages
    rotation = None if as_stored else state.config.rotation
    smoothed = not as_stored and state.k_means is not None
    kind, pools, spec = state.kinds[group], state.pools[group], state.groups[group]
    layers = (jnp.arange(spec.num_layers, dtype=jnp.int32) if layer is None
              else jnp.asarray(layer, jnp.int32).reshape(1))
    high = pools.high if kind == "mixed" else None
    pages = stage_pages(layers, seq, lens, state.page_table, state.high_table, table,
                        low=(pools.low.data, pools.low.scales, pools.low.gs),
                        high=None if high is None else (high.rows, high.scale), geom=state.config.twin,
                        num_staged_pages=num_staged, interpret=interpret,
                        out_dtype=state.config.attention_dtype if rotation is None and not smoothed else jnp.float32)
    if smoothed:                                     # pages [L, N, kv, H, page, D]; the mean per [L, N, page, H, D]
        mean = _page_means(state, None if layer is None else layers[0], seq, group, lens, table, num_staged)
        mean = jnp.swapaxes(mean if layer is None else mean[None], -3, -2)               # [L, N, H, page, D]
        pages = pages.astype(jnp.float32)
        pages = jnp.concatenate([pages[:, :, :1] + mean[:, :, None], pages[:, :, 1:]], axis=2)
    pages = levers.unrotate(pages, rotation, state.config.attention_dtype)
    return pages if layer is None else pages[0]
