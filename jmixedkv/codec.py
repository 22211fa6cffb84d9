"""NVFP4 codec dispatch: one entry point for the reference (`jmixedkv.nvfp4`) and the Pallas kernels.

``backend="auto"`` runs the Pallas Triton kernels on a GPU and the pure-jnp reference elsewhere;
``"pallas"`` without a GPU runs the kernels in interpret mode; ``"reference"`` always runs the reference.
Both give the same bits (`tests/test_nvfp4_kernels.py`). Any leading shape is accepted: ``x[..., D]`` is
viewed as ``[prod(...), D]`` for the kernels (a per-row ``global_scale`` is broadcast to ``x.shape[:-1]``).
The kernels are imported lazily, so the reference package never depends on them.
"""
from __future__ import annotations

import math

import jax.numpy as jnp

from . import backend as _backend
from . import nvfp4 as _ref

__all__ = ["quantize", "dequantize"]


def _flat_gs(global_scale, lead):
    gs = jnp.asarray(global_scale, jnp.float32)
    if gs.size == 1:
        return gs.reshape(())
    try:
        gs = jnp.broadcast_to(gs, lead)
    except ValueError as e:
        raise ValueError(f"NVFP4: global_scale of shape {gs.shape} does not broadcast to x.shape[:-1]={lead}") from e
    return gs.reshape(-1)


def quantize(x, global_scale=1.0, backend: str = "auto", block_scale: str = "max6", **kernel_kwargs):
    """NVFP4-quantize ``x[..., D]`` (bf16 / f16 / f32, ``D % 16 == 0``).

    Args:
      x: ``float[..., D]``.
      global_scale: float32 decode scale ``gs``, a scalar or broadcastable to ``x.shape[:-1]``.
      backend: ``"auto" | "reference" | "pallas"``.
      block_scale: ``"max6"`` or ``"4over6"`` (`jmixedkv.nvfp4.quantize`).
      **kernel_kwargs: tiling knobs forwarded to `pallas_kernels.nvfp4.quantize` (``block_rows``, ``sub_rows``,
        ``num_warps``, ``num_stages``, ``width``); ignored by the reference.

    Returns:
      ``(packed uint8[..., D/2], scales float8_e4m3fn[..., D/16])``.
    """
    x = jnp.asarray(x)
    if x.ndim == 0:
        raise ValueError(f"NVFP4 quantize: x must have at least one dimension, got shape {x.shape}")
    return _backend.dispatch(backend, _quantize_reference, _quantize_pallas)(x, global_scale, block_scale,
                                                                             **kernel_kwargs)


def _quantize_reference(x, global_scale, block_scale, **_):
    return _ref.quantize(x, global_scale, block_scale)


def _quantize_pallas(x, global_scale, block_scale, *, interpret, **kernel_kwargs):
    from pallas_kernels import nvfp4 as _k  # lazy: the reference never imports a kernel

    lead, d = x.shape[:-1], x.shape[-1]
    packed, scales = _k.quantize(x.reshape(math.prod(lead), d), _flat_gs(global_scale, lead), interpret=interpret,
                                 block_scale=block_scale, **kernel_kwargs)
    return packed.reshape(*lead, packed.shape[-1]), scales.reshape(*lead, scales.shape[-1])


def dequantize(packed, scales, global_scale=1.0, dtype=jnp.bfloat16, backend: str = "auto", **kernel_kwargs):
    """Dequantize NVFP4 ``(packed uint8[..., D/2], scales float8_e4m3fn[..., D/16])`` to ``dtype[..., D]``.

    ``global_scale``: a scalar or broadcastable to ``packed.shape[:-1]``; ``backend`` as in `quantize`.
    """
    packed = jnp.asarray(packed)
    scales = jnp.asarray(scales)
    if packed.ndim == 0 or scales.ndim != packed.ndim or scales.shape[:-1] != packed.shape[:-1]:
        raise ValueError(f"NVFP4 dequantize: packed {packed.shape} and scales {scales.shape} must share their "
                         f"leading dimensions")
    return _backend.dispatch(backend, _dequantize_reference, _dequantize_pallas)(packed, scales, global_scale, dtype,
                                                                                 **kernel_kwargs)


def _dequantize_reference(packed, scales, global_scale, dtype, **_):
    return _ref.dequantize(packed, scales, global_scale, dtype)


def _dequantize_pallas(packed, scales, global_scale, dtype, *, interpret, **kernel_kwargs):
    from pallas_kernels import nvfp4 as _k

    lead = packed.shape[:-1]
    rows = math.prod(lead)
    out = _k.dequantize(packed.reshape(rows, packed.shape[-1]), scales.reshape(rows, scales.shape[-1]),
                        _flat_gs(global_scale, lead), dtype, interpret=interpret, **kernel_kwargs)
    return out.reshape(*lead, out.shape[-1])
