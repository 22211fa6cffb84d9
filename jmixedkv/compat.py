"""Every difference between the jax versions we run on (0.10.2 on CPU/CI, 0.11.2 on the H200) lives here.

* Pallas Triton backend: always pass `triton_params(...)` explicitly (0.10.2 would otherwise pick Mosaic GPU).
* The Triton backend warns that it is deprecated on 0.11+; `silence_triton_deprecation()` filters that warning.
* `shard_map`: top-level `jax.shard_map` in both.
* `cross_lower_cuda(fn, *args)`: lower a jitted function for CUDA on a machine without a GPU (CI check that a
  kernel can compile), `jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))`.
"""
from __future__ import annotations

import warnings

import jax
from jax.experimental import pallas as pl  # noqa: F401  (re-exported for kernels)
from jax.experimental.pallas import triton as pltriton

__all__ = ["pl", "pltriton", "triton_params", "on_gpu", "shard_map", "cross_lower_cuda",
           "silence_triton_deprecation", "JAX_VERSION"]

JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())
shard_map = jax.shard_map


def triton_params(num_warps: int = 4, num_stages: int = 2):
    """Explicit Triton compiler params (selects the Triton backend on every jax version)."""
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def silence_triton_deprecation() -> None:
    warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
    warnings.filterwarnings("ignore", message=".*pallas.*deprecated.*", category=DeprecationWarning)


def cross_lower_cuda(fn, *args, **kwargs):
    """Lower ``jax.jit(fn)`` for CUDA without a GPU; returns the lowered text (raises if it cannot lower)."""
    lowered = jax.jit(fn, **kwargs).trace(*args).lower(lowering_platforms=("cuda",))
    return lowered.as_text()


silence_triton_deprecation()
