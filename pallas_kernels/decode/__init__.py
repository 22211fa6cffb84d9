"""Fused paged decode / verify attention over the cache's pools: one entry point, two Pallas backends.

* `pallas_kernels.decode.triton`: the Pallas Triton kernel, every page format and option (`TritonConfig`).
* `pallas_kernels.decode.mosaic_sm90`: the Pallas Mosaic GPU kernel for Hopper, NVFP4 pages at head_dim 128 (64 as
  token pairs, 256 as two column blocks), any GQA group with ``Tq * G <= 64`` (``2 Tq G`` at head_dim 64, ``Tq G <=
  32`` at 256) (`MosaicConfig`;
  `mosaic_sm90.supported` says where; a `MosaicConfig` elsewhere is refused by name), its edge blocks attended by the
  Triton kernel; inline PTX / Mosaic GPU helpers in `pallas_kernels.decode.inline_sm90`.
* `pallas_kernels.decode.common`: query grouping, the interior / edge block rule, split merging, `num_sms`.
* `pallas_kernels.decode.config`: the two frozen configs and their default heuristics.

`paged_decode_attention` picks the backend by its ``config``: a `TritonConfig` or a `MosaicConfig` runs that
backend; None runs `choose_backend`'s pick with its defaults.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional, Union

import jax.numpy as jnp

from jmixedkv.compat import on_hopper
from jmixedkv.layout import TwinGeometry
from pallas_kernels.decode import mosaic_sm90, triton
from pallas_kernels.decode.config import MosaicConfig, TritonConfig

__all__ = ["paged_decode_attention", "choose_backend", "TritonConfig", "MosaicConfig", "KERNEL_ENV"]

#: environment variable overriding `choose_backend` (read there only, when `paged_decode_attention` gets no
#: config): ``auto`` (the default), ``triton`` (always the Triton kernel) or ``mgpu`` (the Mosaic GPU kernel wherever
#: `mosaic_sm90.supported`, in interpret mode too). jit caches the choice: set it before the first call.
KERNEL_ENV = "JMIXEDKV_DECODE_KERNEL"


def choose_backend(*, head_dim, page, tq, group, high_dtype=None, sliding_window=None, soft_cap=None,
                   interpret=False) -> str:
    """``"mosaic"`` or ``"triton"``: the backend `paged_decode_attention` runs without a config. The Mosaic GPU
    kernel on a Hopper GPU (compiled) wherever `mosaic_sm90.supported` (NVFP4 pages), the Triton kernel elsewhere;
    `KERNEL_ENV` overrides. On the H200 the Mosaic GPU kernel measured faster end to end on every shape class it
    supports, Tq 1 included (bench/RESULTS.md)."""
    choice = os.environ.get(KERNEL_ENV, "auto").strip().lower()
    if choice not in ("auto", "triton", "mgpu"):
        raise ValueError(f"{KERNEL_ENV}={choice!r}: expected 'auto', 'triton' or 'mgpu'")
    if choice == "triton":
        return "triton"
    ok = mosaic_sm90.supported(head_dim=head_dim, page=page, tq=tq, group=group, high_dtype=high_dtype,
                               sliding_window=sliding_window, soft_cap=soft_cap)
    if choice == "auto":
        ok = ok and not interpret and on_hopper()
    return "mosaic" if ok else "triton"


def paged_decode_attention(q, page_table, kv_lens, layer=0, low=None, high=None, plain=None, high_table=None, *,
                           geom: Optional[TwinGeometry] = None, sm_scale: Optional[float] = None,
                           sliding_window: Optional[int] = None, soft_cap: Optional[float] = None,
                           interpret: bool = False, out_dtype=None,
                           config: Union[TritonConfig, MosaicConfig, None] = None,
                           num_splits: Optional[int] = None, split_heads: Optional[int] = None):
    """Paged decode / verify attention over raw pool arrays (one layer).

    Args:
      q: ``[B, Tq, Hq, D]`` queries in the attention dtype (bf16 / fp16); ``Hq % H == 0``; query token ``t`` of a
        sequence of length ``n`` sits at position ``n - Tq + t`` (causal among the new tokens).
      page_table: i32[B, max_pages] low (or plain) page id of each batch row's page ``j`` (-1 = none).
      kv_lens: i32[B] lengths ``n`` (0 for padding rows).
      layer: layer index into the pools' leading axis (int or traced i32).
      low: ``(data u8[L,P,kv,H,page,D/2], scales e4m3[L,P,kv,H,page,D/16], gs f32[L,kv])`` NVFP4 pages.
      high: ``(rows dtype[L,Ph,kv,H,page,D], scale f32[L,kv])``: the retained twin (optional, with ``low``).
      plain: ``(rows, scale)``: plain row pages (exclusive with ``low``; Triton backend).
      high_table: i32[B, F + R] high page ids (needed with ``high``).
      geom: the twin's static `jmixedkv.layout.TwinGeometry` (needed with ``high``).
      sm_scale, sliding_window, soft_cap: attention options (default scale ``D ** -0.5``).
      interpret: Pallas interpret mode (CPU).
      out_dtype: output dtype (default ``q.dtype``).
      config: `TritonConfig` or `MosaicConfig` (that backend); None = `choose_backend` with default tuning.
      num_splits: split-K programs per (row, KV head), replacing the config's (None: the config's / default).
      split_heads: the KV head count the default tuning and splits are chosen for, replacing the config's (None:
        the config's / the call's): a shard of the heads passes the whole count to get one device's bits.

    Returns:
      ``(out [B, Tq, Hq, D] out_dtype, lse f32[B, Tq, Hq])``: natural-log LSE of the scaled (capped) logits; rows
      with no visible key give zeros and ``-inf``.
    """
    if config is None:
        pool = low[0] if low is not None else None
        mosaic = pool is not None and choose_backend(
            head_dim=q.shape[-1], page=pool.shape[4], tq=q.shape[1], group=q.shape[2] // pool.shape[3],
            high_dtype=None if high is None or high_table is None else jnp.dtype(high[0].dtype),
            sliding_window=sliding_window, soft_cap=soft_cap, interpret=interpret) == "mosaic"
        config = MosaicConfig() if mosaic else TritonConfig()
    if not isinstance(config, (TritonConfig, MosaicConfig)):
        raise ValueError(f"paged_decode_attention: config must be a TritonConfig, a MosaicConfig or None, "
                         f"got {config!r}")
    if num_splits is not None:
        config = dataclasses.replace(config, num_splits=num_splits)
    if split_heads is not None:
        config = dataclasses.replace(config, split_heads=split_heads)
    if isinstance(config, MosaicConfig):
        if plain is not None or low is None or sliding_window is not None or soft_cap is not None:
            raise ValueError("paged_decode_attention: the Mosaic GPU backend takes NVFP4 pages (low=) without a "
                             "sliding window or soft cap; pass a TritonConfig")
        pool, use_high = low[0], high is not None and high_table is not None
        geometry = dict(head_dim=q.shape[-1], page=pool.shape[4], tq=q.shape[1], group=q.shape[2] // pool.shape[3],
                        high_dtype=jnp.dtype(high[0].dtype) if use_high else None)
        if not mosaic_sm90.supported(**geometry):
            raise ValueError(f"paged_decode_attention: the Mosaic GPU backend does not cover {geometry} (head_dim "
                             f"{mosaic_sm90.HEAD_DIMS}, pages {mosaic_sm90.SUPPORTED_PAGES}, Tq * G <= "
                             f"{mosaic_sm90.M_ROWS} (2 Tq * G at head_dim 64, Tq * G <= "
                             f"{mosaic_sm90.max_rows(mosaic_sm90.WIDE_HEAD_DIM)} at 256), a bf16 / f16 twin; "
                             f"Mosaic GPU importable: {mosaic_sm90.available()}); pass a TritonConfig or config=None")
        return mosaic_sm90.paged_decode_attention(q, page_table, kv_lens, layer, low, high, high_table, geom=geom,
                                                  sm_scale=sm_scale, interpret=interpret, out_dtype=out_dtype,
                                                  config=config)
    return triton.paged_decode_attention(q, page_table, kv_lens, layer, low, high, plain, high_table, geom=geom,
                                         sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                                         interpret=interpret, out_dtype=out_dtype, config=config)
