"""Every difference between the jax versions we run on (0.10.2 on CPU/CI, 0.11.2 on the H200) lives here.

* Pallas Triton backend: always pass `triton_params(...)` explicitly (0.10.2 would otherwise pick Mosaic GPU).
* The Triton backend warns that it is deprecated on 0.11+; `silence_triton_deprecation()` filters that warning.
* `shard_map`: top-level `jax.shard_map` in both.
* `cross_lower_cuda(fn, *args)`: lower a jitted function for CUDA on a machine without a GPU (CI check that a
  kernel can compile), `jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))`; `triton_programs(text)`: the
  Pallas Triton programs in such a text as Triton IR (jax's serialized IR printed through jaxlib's Triton dialect).
* `xla_flags_with_ieee_division(flags)`: XLA on NVIDIA GPUs lowers float32 division to ``div.full.f32`` (it passes
  ``-nvptx-prec-divf32=1`` to LLVM; up to 2 ulp off: ``1 / 0.0011160715`` gives 896.0, IEEE 895.99994). The
  returned ``XLA_FLAGS`` add ``--xla_backend_extra_options=-nvptx-prec-divf32=2`` (``div.rn.f32``), so jnp code
  run by XLA on the GPU divides like the CPU. It must be in the environment before jax starts its backends.
* Pallas Mosaic GPU (`plgpu`, used by `pallas_kernels.decode.mosaic_sm90`): `mgpu_transposed` (``ref.transpose`` on 0.11,
  ``plgpu.transpose_ref`` on 0.10), `mgpu_load` (0.10's ``plgpu.load`` takes an index), `mgpu_interpret_params`.
* `cudnn_attention_lse`: cuDNN fused attention with its float32 LSE (a private entry point; the public
  ``jax.nn.dot_product_attention`` rounds the LSE to bf16).
* `dlpack_import` / `dlpack_export`: jaxlib's DLPack capsule <-> array entry points (private; what
  ``jax.dlpack.from_dlpack`` / ``Array.__dlpack__`` call after ~50-100 us of Python checks per call), for the
  per-layer hot path of `interop.dlpack.HotBridge`; the import's signature changed with jaxlib's extension
  version 467 (the DLPack device type argument).
"""
from __future__ import annotations

import inspect
import warnings

import jax
from jax.experimental import pallas as pl  # noqa: F401  (re-exported for kernels)
from jax.experimental.pallas import triton as pltriton

__all__ = ["pl", "pltriton", "plgpu", "HAVE_MGPU", "mgpu_transposed", "mgpu_load", "mgpu_interpret_params",
           "triton_params", "on_gpu", "on_hopper", "shard_map", "cross_lower_cuda", "silence_triton_deprecation", "IEEE_DIVISION_OPTION", "xla_flags_with_ieee_division",
           "cuda_plugin_installed", "cudnn_attention_lse", "have_dlpack_capsules", "dlpack_import", "dlpack_export",
           "triton_programs", "HOPPER_MAX_SHARED_BYTES"]

#: LLVM option (NVPTX backend) for IEEE float32 division, passed through ``--xla_backend_extra_options``
IEEE_DIVISION_OPTION = "-nvptx-prec-divf32=2"
_EXTRA = "--xla_backend_extra_options="

shard_map = jax.shard_map


def triton_params(num_warps: int = 4, num_stages: int = 2):
    """Explicit Triton compiler params (selects the Triton backend on every jax version)."""
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def on_hopper() -> bool:
    """True when the default device is an NVIDIA GPU of compute capability 9.x (H100 / H200: wgmma, TMA)."""
    if not on_gpu():
        return False
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9")


def cuda_plugin_installed() -> bool:
    """True when a jax CUDA plugin package (``jax-cuda12-plugin``, ``jax-cuda13-plugin``, ...) is installed."""
    from importlib import metadata
    return any((d.metadata["Name"] or "").lower().replace("_", "-").startswith("jax-cuda")
               for d in metadata.distributions())


def xla_flags_with_ieee_division(flags: str) -> str:
    """``flags`` (an ``XLA_FLAGS`` string) with `IEEE_DIVISION_OPTION` added: merged into an existing
    ``--xla_backend_extra_options=...`` (comma-separated) or appended as a new flag; unchanged if already there."""
    if IEEE_DIVISION_OPTION in flags:
        return flags
    parts = flags.split()
    for i, part in enumerate(parts):
        if part.startswith(_EXTRA):
            value = part[len(_EXTRA):]
            parts[i] = _EXTRA + (value + "," if value else "") + IEEE_DIVISION_OPTION
            return " ".join(parts)
    return " ".join(parts + [_EXTRA + IEEE_DIVISION_OPTION])


def silence_triton_deprecation() -> None:
    warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
    warnings.filterwarnings("ignore", message=".*pallas.*deprecated.*", category=DeprecationWarning)


def cross_lower_cuda(fn, *args, **kwargs):
    """Lower ``jax.jit(fn)`` for CUDA without a GPU; returns the lowered text (raises if it cannot lower)."""
    lowered = jax.jit(fn, **kwargs).trace(*args).lower(lowering_platforms=("cuda",))
    return lowered.as_text()


#: shared memory a Hopper CTA may have (sm_90's opt-in maximum, 227 KB): what the H200 reported as available when a
#: decode kernel asked for more (bench/RESULTS.md)
HOPPER_MAX_SHARED_BYTES = 232448

#: the custom call through which XLA runs a Pallas Triton program (its ``mhlo.backend_config`` holds the program)
TRITON_CALL_TARGET = "__gpu$xla.gpu.triton"


def _operations(op):
    """Every operation nested in ``op`` (an MLIR operation), depth first."""
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                yield inner.operation
                yield from _operations(inner.operation)


def triton_programs(lowered_text: str) -> list:
    """The Pallas Triton programs of a `cross_lower_cuda` text -> ``[(name, num_warps, num_stages, TTIR text)]``
    (the module parsed in jax's MLIR context with jaxlib's Triton dialect; each `TRITON_CALL_TARGET` custom call's
    serialized IR printed): what XLA hands its own Triton at run time. A test compiles them with the installed Triton
    to read their shared memory (`HOPPER_MAX_SHARED_BYTES`)."""
    from jax._src.interpreters import mlir as jax_mlir
    from jax._src.lib.mlir import ir
    from jaxlib.triton import dialect

    ctx = jax_mlir.make_ir_context()
    dialect.register_dialect(ctx)
    out = []
    with ctx:
        for op in _operations(ir.Module.parse(lowered_text).operation):
            attrs = op.attributes
            if op.name != "stablehlo.custom_call" or \
                    ir.StringAttr(attrs["call_target_name"]).value != TRITON_CALL_TARGET:
                continue
            config = ir.DictAttr(attrs["mhlo.backend_config"])
            ttir = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes).operation.get_asm(enable_debug_info=False)
            out.append((ir.StringAttr(config["name"]).value, ir.IntegerAttr(config["num_warps"]).value,
                        ir.IntegerAttr(config["num_stages"]).value, ttir))
    return out


silence_triton_deprecation()


# --- Pallas Mosaic GPU (pallas_kernels/decode/mosaic_sm90.py): names that differ between 0.10.2 and 0.11.2 -----------------
try:
    from jax.experimental.pallas import mosaic_gpu as plgpu
    HAVE_MGPU = True
except Exception:  # pragma: no cover - depends on the jax build
    plgpu = None
    HAVE_MGPU = False

_MGPU_LOAD_TAKES_IDX = HAVE_MGPU and "idx" in inspect.signature(plgpu.load).parameters and \
    inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty


def mgpu_transposed(ref):
    """``ref`` viewed as its 2-D transpose: ``ref.transpose`` on 0.11, ``plgpu.transpose_ref`` on 0.10."""
    if hasattr(ref, "transpose"):
        try:
            return ref.transpose((1, 0))
        except TypeError:
            pass
    return plgpu.transpose_ref(ref, (1, 0))


def mgpu_load(ref, layout):
    """``plgpu.load`` of a whole ref with a register layout (0.10 takes an index argument, 0.11 does not)."""
    return plgpu.load(ref, (), layout=layout) if _MGPU_LOAD_TAKES_IDX else plgpu.load(ref, layout=layout)


def mgpu_per_warp(body, axis_name: str = "warp"):
    """Run ``body()`` once per warp of the current warpgroup, inside a Mosaic GPU kernel (``lax.axis_index(axis_name)``
    is the warp, 0..3). ``pl.kernel(body, out_type=(), mesh=plgpu.WarpMesh(...))()``: the same module as the
    ``pl.core_map(plgpu.WarpMesh(...))`` decorator, which jax 0.11 deprecates for it (both lower alike on 0.10.2)."""
    pl.kernel(body, out_type=(), mesh=plgpu.WarpMesh(axis_name=axis_name))()


def mgpu_interpret_params():
    """Mosaic GPU interpret-mode params (``plgpu.InterpretGPUParams``, or its private home on 0.10)."""
    p = getattr(plgpu, "InterpretGPUParams", None)
    if p is None:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as p  # noqa: N813
    return p()


def cudnn_attention_lse(q, k, v, q_lens, kv_lens, *, scale: float, causal: bool, window=None):
    """cuDNN fused attention with per-row lengths and its float32 LSE (``jax.nn.dot_product_attention`` rounds the
    LSE to the output dtype; 0.10 and 0.11 share the private entry point used here).

    ``q [B, T, N, D]``, ``k, v [B, S, K, D]`` (bf16 / fp16, GQA ``N % K == 0``), ``q_lens`` / ``kv_lens`` i32[B]
    (right padding); ``causal``: top-left aligned (query ``t`` sees keys ``<= t``); ``window``: keys
    ``t - window < s`` (causal only). Returns ``(out [B, T, N, D] in q's dtype, lse f32[B, T, N])`` (natural log).
    """
    from jax._src.cudnn import fused_attention_stablehlo as fa
    mask = fa.MaskType.PADDING_CAUSAL if causal else fa.MaskType.PADDING
    out, lse = fa.dot_product_attention(q, k, v, q_seqlen=q_lens, kv_seqlen=kv_lens, scale=scale, mask_type=mask,
                                        sliding_window_length=window, return_residual=True)
    return out, jax.numpy.transpose(lse, (0, 2, 1)).astype(jax.numpy.float32)


try:                                               # jaxlib's private extension module (DLPack capsule entry points)
    from jax._src.lib import _jax as _jaxlib_ext, jaxlib_extension_version as _EXTENSION_VERSION
except ImportError:                                # a jaxlib without it
    _jaxlib_ext, _EXTENSION_VERSION = None, 0


def have_dlpack_capsules() -> bool:
    """True when jaxlib has the capsule entry points `dlpack_import` / `dlpack_export` use (else callers cross
    through ``jax.dlpack``)."""
    return _jaxlib_ext is not None and all(
        hasattr(_jaxlib_ext, f) for f in ("dlpack_managed_tensor_to_buffer", "buffer_to_dlpack_managed_tensor"))


def dlpack_import(capsule, device, stream, dl_device_type: int):
    """A DLPack capsule (a producer's ``__dlpack__`` / ``torch._C._to_dlpack``) -> ``jax.Array`` on ``device``,
    zero-copy. ``stream``: the JAX device's ready-events stream the producer has made wait for its writes (None on
    CPU). No dtype canonicalization: the caller passes only dtypes JAX holds as is."""
    if _EXTENSION_VERSION >= 467:
        return _jaxlib_ext.dlpack_managed_tensor_to_buffer(capsule, device, stream, False, dl_device_type)
    return _jaxlib_ext.dlpack_managed_tensor_to_buffer(capsule, device, stream, False)


def dlpack_export(x, stream):
    """A single-device ``jax.Array`` -> DLPack capsule, zero-copy; ``stream`` (the consumer's CUDA stream, None on
    CPU) is made to wait until ``x`` is ready."""
    return _jaxlib_ext.buffer_to_dlpack_managed_tensor(x, stream=stream)
