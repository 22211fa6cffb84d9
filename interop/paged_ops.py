"""The torch hot path's two custom ops, so ``torch.compile`` and CUDA graphs see them as single nodes.

* ``torch.ops.jmixedkv.write_rows_``: store one layer's rows (NVFP4 + the twin, or plain rows) at given slots, in
  place (`write_rows`).
* ``torch.ops.jmixedkv.paged_attention``: one layer's attention of ``q [B, Tq, Hq, D]`` over its pages (twin rows
  where retained, NVFP4 elsewhere), float32 output and natural-log LSE (`paged_attention`).

Pools and semantics: `interop.torch_paged` (the contract, and the pure-torch implementation run on CPU). On CUDA the
ops launch the Triton kernels of `interop.triton_write` / `interop.triton_attention`. `cpu_backend("triton")`
routes CPU tensors through those kernels in Triton's interpreter (tests of the kernels' plumbing).
"""
from __future__ import annotations

import contextlib
from typing import List, Optional

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import torch_paged
from .torch_paged import TorchPools

__all__ = ["write_rows", "round_trip", "stage", "paged_attention", "step_attention", "apply_sinks", "cpu_backend",
           "CPU_BACKENDS"]

CPU_BACKENDS = ("torch", "triton")
#: `step_attention` launches from eager Python, where a launch costs more host time than a short split saves on the
#: GPU: at most one split per this many keys (`interop.triton_attention.choose_tuning`), so short caches need no
#: merge kernel
EAGER_KEYS_PER_SPLIT = 1024
_FP8 = (torch.uint8, torch.float8_e4m3fn)
_cpu = {"backend": "torch"}


@contextlib.contextmanager
def cpu_backend(name: str):
    """Within the block, CPU tensors go through ``name``: ``"torch"`` (default) or ``"triton"`` (the CUDA kernels
    in Triton's interpreter)."""
    if name not in CPU_BACKENDS:
        raise ValueError(f"cpu_backend: {name!r} is not one of {CPU_BACKENDS}")
    old, _cpu["backend"] = _cpu["backend"], name
    try:
        yield
    finally:
        _cpu["backend"] = old


def _triton(x: Tensor) -> Optional[bool]:
    """None: run the torch implementation; False: Triton compiled (CUDA); True: Triton interpreted (CPU)."""
    if x.is_cuda:
        return False
    return True if _cpu["backend"] == "triton" else None


def _eager(x: Tensor) -> bool:
    """True when an op's body may run without the dispatcher (~85 us less host time per call on the H200's host):
    eager, a plain tensor, no tracing or fake-tensor mode active. Compiled and traced code sees the op."""
    return not torch.compiler.is_compiling() and type(x) is Tensor and _get_current_dispatch_mode() is None


# ------------------------------------------------------------------------------------------------ write
def _write_rows_impl(low_data: Optional[Tensor], low_scales: Optional[Tensor], low_gs: Optional[Tensor],
                   high_rows: Optional[Tensor], high_scale: Optional[Tensor], plain_rows: Optional[Tensor],
                   plain_scale: Optional[Tensor], layer: int, k: Tensor, v: Tensor, low_slot: Tensor,
                   high_slot: Tensor, page_size: int, block_scale: str) -> None:
    pools = TorchPools(low_data, low_scales, low_gs, high_rows, high_scale, plain_rows, plain_scale)
    rows = high_rows if high_rows is not None else plain_rows
    fp8 = rows is not None and rows.dtype in _FP8
    interpret = _triton(k)
    if interpret is None:
        torch_paged.write_rows_reference_(*pools, layer, k, v, low_slot, high_slot, page_size, block_scale,
                                          high_fp8=fp8)
    else:                                    # no value checks: they read slots back to the host (a sync)
        from .triton_write import write_rows_
        write_rows_(*pools, layer, k, v, low_slot, high_slot, page_size, block_scale, high_fp8=fp8,
                    interpret=interpret, check_values=False)


_write_rows_op = torch.library.custom_op("jmixedkv::write_rows_", _write_rows_impl,
                                         mutates_args=("low_data", "low_scales", "high_rows", "plain_rows"))


@_write_rows_op.register_fake
def _(low_data, low_scales, low_gs, high_rows, high_scale, plain_rows, plain_scale, layer, k, v, low_slot,
      high_slot, page_size, block_scale):
    return None


def write_rows(pools: TorchPools, layer: int, k: Tensor, v: Tensor, low_slot: Tensor, high_slot: Tensor,
               page_size: int, block_scale: str) -> None:
    """Store ``k, v [T, H, D]`` (the attention dtype, as stored: rotated if the lever is on) of ``layer`` at
    ``low_slot`` / ``high_slot`` i64[T] (``page_id * page + row``; -1 skips), in place (op 1 of the contract)."""
    op = _write_rows_impl if _eager(k) else _write_rows_op
    op(*pools, layer, k, v, low_slot, high_slot, page_size, block_scale)


def round_trip(pools: TorchPools, layer: int, k: Tensor, v: Tensor, *, low: bool, block_scale: str,
               validate: bool = True):
    """``k, v [B, T, H, D]`` (the attention dtype, as stored: rotated if the lever is on) -> ``(k, v)`` as ``layer``
    reads them back once stored, without storing them: NVFP4 (``low``; ``pools.low_gs``) or the fp8 store form of
    the row pool (the twin's or the plain pool's scale). One Triton launch on CUDA
    (`interop.triton_write.round_trip_rows`; ``validate=False`` skips its argument checks), eager torch on CPU
    (`interop.torch_paged.round_trip_reference`)."""
    if low:
        scale = pools.low_gs
    else:
        scale = pools.high_scale if pools.high_rows is not None else pools.plain_scale
    if scale is None:
        raise ValueError(f"round_trip: the pools hold no {'NVFP4' if low else 'fp8 row'} pool to read back as")
    interpret = _triton(k)
    if interpret is None:
        out = torch_paged.round_trip_reference(k, v, scale, layer, low=low, block_scale=block_scale)
    else:
        from .triton_write import round_trip_rows
        out = round_trip_rows(k, v, scale, layer, low=low, block_scale=block_scale, interpret=interpret,
                              validate=validate)
    return out[0], out[1]


def stage(pools: TorchPools, layer: int, page_table: Tensor, high_table: Optional[Tensor], kv_lens: Tensor,
          page_size: int, geom, seen: int, tail_k: Tensor, tail_v: Tensor, *, validate: bool = True,
          check_values: bool = True):
    """``layer``'s rows as a reader gets them (the twin's where retained, NVFP4 / fp8 decoded elsewhere, in the
    attention dtype), the step's own rows ``tail_k`` / ``tail_v [B, T, H, D]`` (as they read once stored:
    `round_trip`) appended, left-aligned in ``seen`` columns: ``(k, v)`` each ``[B, H, seen, D]`` (zeros before
    row ``b``'s ``kv_lens[b] + T`` rows). One Triton launch on CUDA (`interop.triton_write.stage_rows`), eager
    torch on CPU (`interop.torch_paged.stage_reference`). ``validate`` / ``check_values``: `stage_rows`'s argument
    checks and its host check of the lengths (a device sync on CUDA)."""
    g = _geom_list(page_size, geom)
    interpret = _triton(tail_k)
    kv_lens = kv_lens.to(torch.int32)
    if interpret is None:
        out = torch_paged.stage_reference(*pools, layer, page_table, high_table, kv_lens, g, seen, tail_k, tail_v)
    else:
        from .triton_write import stage_rows
        out = stage_rows(*pools, layer, page_table, high_table, kv_lens, g, seen, tail_k, tail_v,
                         interpret=interpret, validate=validate, check_values=check_values)
    return out[0], out[1]


def _geom_list(page_size: int, geom) -> List[int]:
    """The kernels' ``(page, first_n, last_n, num_fixed, num_ring)`` of a `TwinGeometry` (None: no twin)."""
    g = [page_size, 0, 0, 0, 0] if geom is None else [geom.page, geom.first_n, geom.last_n, geom.num_fixed,
                                                       geom.num_ring]
    if g[0] != page_size:
        raise ValueError(f"the twin's page {g[0]} differs from page_size {page_size}")
    return g


# ------------------------------------------------------------------------------------------------ attention
def _paged_attention_impl(q: Tensor, low_data: Optional[Tensor], low_scales: Optional[Tensor], low_gs: Optional[Tensor],
                        high_rows: Optional[Tensor], high_scale: Optional[Tensor], plain_rows: Optional[Tensor],
                        plain_scale: Optional[Tensor], layer: int, page_table: Tensor, high_table: Tensor,
                        kv_lens: Tensor, geom: List[int], sm_scale: float, sliding_window: Optional[int],
                        soft_cap: Optional[float], tail_k: Optional[Tensor] = None,
                        tail_v: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    pools = TorchPools(low_data, low_scales, low_gs, high_rows, high_scale, plain_rows, plain_scale)
    g = tuple(geom)
    interpret = _triton(q)
    if interpret is None:
        return torch_paged.paged_attention_reference(q, *pools, layer, page_table, high_table, kv_lens, g,
                                                     sm_scale, sliding_window, soft_cap, tail_k, tail_v)
    from .triton_attention import paged_attention as kernel
    return kernel(q, *pools, layer, page_table, high_table, kv_lens, g, sm_scale, sliding_window, soft_cap,
                  tail_k=tail_k, tail_v=tail_v, interpret=interpret)


_paged_attention_op = torch.library.custom_op("jmixedkv::paged_attention", _paged_attention_impl, mutates_args=())


@_paged_attention_op.register_fake
def _(q, low_data, low_scales, low_gs, high_rows, high_scale, plain_rows, plain_scale, layer, page_table,
      high_table, kv_lens, geom, sm_scale, sliding_window, soft_cap, tail_k=None, tail_v=None):
    b, tq, hq, d = q.shape
    return q.new_empty((b, tq, hq, d), dtype=torch.float32), q.new_empty((b, tq, hq), dtype=torch.float32)


def paged_attention(pools: TorchPools, layer: int, q: Tensor, page_table: Tensor, high_table: Tensor,
                    kv_lens: Tensor, page_size: int, geom, sm_scale: float, sliding_window: Optional[int],
                    soft_cap: Optional[float], tail_k: Optional[Tensor] = None, tail_v: Optional[Tensor] = None):
    """``q [B, Tq, Hq, D]`` (the attention dtype, stored basis) over ``layer``'s pages of rows with ``page_table
    i32[B, MP]`` / ``high_table i32[B, W]`` and lengths ``kv_lens i32[B]`` -> ``(out f32[B, Tq, Hq, D], lse
    f32[B, Tq, Hq])`` (op 2 of the contract). ``geom``: the twin's `jmixedkv.layout.TwinGeometry`, or None without
    a twin (the kernels then see ``(page_size, 0, 0, 0, 0)``). ``tail_k`` / ``tail_v [B, T, H, D]``, ``T >= Tq``:
    rows after the stored ones, not in the pools, the queries' own last (query ``t`` at ``kv_lens[b] + T - Tq + t``;
    `interop.triton_attention.paged_attention`)."""
    g = _geom_list(page_size, geom)
    window = None if sliding_window is None else int(sliding_window)
    cap = None if soft_cap is None else float(soft_cap)
    op = _paged_attention_impl if _eager(q) else _paged_attention_op
    return op(q, *pools, layer, page_table, high_table, kv_lens.to(torch.int32), g, float(sm_scale), window, cap,
              tail_k, tail_v)


def step_attention(pools: TorchPools, q: Tensor, page_table: Tensor, high_table: Optional[Tensor], kv_lens: Tensor,
                   page_size: int, geom, *, tail: bool):
    """`paged_attention` over pools and tables that stay fixed for a step's layers, checked once: returns ``run(q,
    layer, sm_scale, sliding_window=None, soft_cap=None, *, tail_k=None, tail_v=None, tail_len=None, new_k=None,
    new_v=None, out_dtype=None, return_lse=True, validate=True) -> (out f32[B, Tq, Hq, D] (or ``out_dtype``, q's
    dtype: rounded once), lse f32[B, Tq, Hq] or None)`` for queries shaped like ``q`` (the keywords as
    `interop.triton_attention.PagedAttention`'s: ``new_k`` / ``new_v`` are kept in the tail). On CUDA it is an
    `interop.triton_attention.PagedAttention` (after the first call's checks, one launch per call, two with split-K;
    `EAGER_KEYS_PER_SPLIT`); on CPU the torch reference (the interpreter under ``cpu_backend("triton")``). ``tail``:
    every call passes rows after the stored ones (``tail_k`` / ``tail_v [B, T, H, D]``, ``T >= Tq``: rows held from
    earlier steps, then the call's own)."""
    g = _geom_list(page_size, geom)
    kv_lens = kv_lens.to(torch.int32)
    interpret = _triton(q)
    if interpret is not None:
        from .triton_attention import PagedAttention
        return PagedAttention(q, *pools, page_table, high_table, kv_lens, g, tail=tail, interpret=interpret,
                              min_keys_per_split=EAGER_KEYS_PER_SPLIT)

    def run(q, layer, sm_scale, sliding_window=None, soft_cap=None, *, tail_k=None, tail_v=None, tail_len=None,
            new_k=None, new_v=None, out_dtype=None, return_lse=True, validate=True):
        if tail_len is not None:
            if new_k is not None:                  # the step's own rows kept in the tail, as the kernel does
                tail_k[:, tail_len - new_k.shape[1]:tail_len].copy_(new_k)
                tail_v[:, tail_len - new_v.shape[1]:tail_len].copy_(new_v)
            tail_k, tail_v = tail_k[:, :tail_len], tail_v[:, :tail_len]
        out, lse = torch_paged.paged_attention_reference(q, *pools, layer, page_table, high_table, kv_lens, g,
                                                         sm_scale, sliding_window, soft_cap, tail_k, tail_v)
        return (out if out_dtype is None else out.to(out_dtype)), (lse if return_lse else None)
    return run


def apply_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """Attention sinks as an LSE term (as `jmixedkv.step.apply_sinks`): ``out f32[B, Tq, Hq, D]`` scaled by
    ``sigmoid(lse - sink)`` for natural-log ``lse f32[B, Tq, Hq]`` and ``sinks [Hq]`` (one logit per query head, on
    the scaled-logit scale); a row that saw no key (``lse = -inf``) gets weight 0."""
    s = sinks.to(device=out.device, dtype=torch.float32)[None, None, :]
    return out * torch.sigmoid(lse - s)[..., None]
