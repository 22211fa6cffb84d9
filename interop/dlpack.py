"""Zero-copy DLPack bridges between JAX arrays and torch tensors, with checks that the copy really is zero.

Owns `to_torch`, `from_torch`, `same_buffer` and `nvfp4_to_torch` (the conventions every interop module uses).

Dtypes that cross without a copy, both ways (same data pointer, checked after every crossing)::

    bfloat16  float16  float32  uint8  int32  bool  float8_e4m3fn  float8_e5m2

NVFP4 crosses as its two byte arrays: packed E2M1 data ``u8[..., D/2]`` and E4M3 block scales
``float8_e4m3fn[..., D/16]`` (or their bytes as uint8, ``scales_as_uint8=True``); decode global scales as float32.
Neither JAX nor torch can exchange ``float4_e2m1fn`` over DLPack.

Accuracy levers change *which* vectors are stored, never the bytes' format (`jmixedkv.levers`). An export that
knows the cache's `KVCacheConfig` (``config=``) says so in its ``kv_transform`` field (`kv_transform`); a consumer
reading the pages with its own attention kernel must then:

* ``rotated`` (``rotation="hadamard"``): K and V are stored as ``k @ Hd``, ``v @ Hd`` (after RoPE;
  ``Hd = jmixedkv.levers.hadamard(D)``, orthonormal and symmetric). Rotate q the same way before attention
  (``(q Hd) . (k Hd) = q . k``) and multiply the attention output by ``Hd`` after it (``Hd @ Hd = I``).
  Without that, scores and outputs are wrong.
* ``k_smoothing``: every stored key of a sequence is ``k - mean`` (a per-(layer, head, channel) mean frozen from
  that sequence's prefill, held by the cache: ``CacheState.k_means[group][layer, slot]`` f32[H, D] in the stored
  frame, after the rotation; `interop.StaticPagedCache.k_mean`). Softmax attention is unchanged (each query's
  scores shift by one constant) and needs nothing; the LSE and raw scores are not (add ``sm_scale * q . mean``,
  e.g. for a sparse indexer's thresholds or a merge with other keys).
* ``block_scale``: ``"max6"`` or ``"4over6"``: informational, the decoder is the same.

What cannot be zero-copy, and what happens (``copy=False`` raises `ZeroCopyError`, a ``ValueError``, naming the
reason; ``copy=None`` makes one documented copy; ``copy=True`` always copies):

* ``int64`` / ``float64`` torch tensors while ``jax_enable_x64`` is off: JAX would silently canonicalize them to
  32 bits with a copy. Pass ``t.to(torch.int32)`` (page tables, lengths and slots are int32 here) or allow the
  copy; the copy checks that the values fit in int32.
* misaligned views: JAX on CPU needs the data pointer 64-byte aligned (an offset slice of a torch allocation is
  not); export whole allocations. Alignment on GPU is left to JAX (the pointer check still runs).
* non-compact strides (``t[:, ::2]``, broadcasts): JAX imports dense tensors and permutations of them
  (a transposed view crosses zero-copy), nothing else.
* ``requires_grad``: always refused (``detach()`` first), even with a copy, so gradients are never lost silently.

CUDA streams (documented choice: conservative by default). ``sync=True`` (default) makes the producer's work
complete before the consumer can read: `to_torch` blocks until the JAX array is ready, `from_torch`
synchronizes the tensor's CUDA device (every torch stream, so work queued on a side stream is covered).
``sync="stream"`` relies on the DLPack stream protocol alone: torch passes its *current* stream to JAX's
``__dlpack__`` (JAX orders its writes before it) and JAX passes its ready-events stream to torch's
``__dlpack__`` (torch orders its *current* stream before it); work on any other torch stream is not covered.
``sync=False`` does nothing (the caller has synchronized). On CPU every mode is the same.

Aliasing: the memory is genuinely shared. A torch in-place write is visible through the "immutable" JAX array;
treat exported pools as read-only and drop torch views before the next donated JAX update (JAX silently skips
donation, i.e. copies the pool, while torch holds a view).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jmixedkv import compat

__all__ = ["to_torch", "from_torch", "same_buffer", "nvfp4_to_torch", "NVFP4Tensors", "kv_transform", "torch_dtype",
           "ZeroCopyError", "ZERO_COPY_DTYPES", "torch_device_of", "HotBridge"]

CPU_ALIGNMENT = 64

#: jnp dtype -> torch dtype for every dtype that crosses zero-copy
ZERO_COPY_DTYPES = {jnp.dtype(name): getattr(torch, name) for name in
                    ("bfloat16", "float16", "float32", "uint8", "int32", "bool", "float8_e4m3fn", "float8_e5m2")}
_TORCH_TO_JAX = {t: j for j, t in ZERO_COPY_DTYPES.items()}
_WIDE = {torch.int64: torch.int32, torch.float64: torch.float32}

Sync = Union[bool, str]


class ZeroCopyError(ValueError):
    """A crossing was asked to be zero-copy (``copy=False``) but cannot be."""


def torch_dtype(dtype) -> torch.dtype:
    """torch dtype for a jnp dtype (raises for dtypes that do not cross)."""
    d = jnp.dtype(dtype)
    if d not in ZERO_COPY_DTYPES:
        raise ValueError(f"dtype {d} does not cross DLPack here; supported: {sorted(str(k) for k in ZERO_COPY_DTYPES)}")
    return ZERO_COPY_DTYPES[d]


def torch_device_of(device: jax.Device) -> torch.device:
    """torch device holding the same memory as JAX device ``device``."""
    if device.platform == "cpu":
        return torch.device("cpu")
    if device.platform in ("gpu", "cuda", "rocm"):
        return torch.device("cuda", device.local_hardware_id)
    raise ValueError(f"no torch device for JAX platform {device.platform!r}")


def same_buffer(x: jax.Array, t: torch.Tensor) -> bool:
    """True when JAX array ``x`` and torch tensor ``t`` start at the same address (zero-copy)."""
    if x.size == 0 or t.numel() == 0:
        return True
    return x.unsafe_buffer_pointer() == t.data_ptr()


def to_torch(x: jax.Array, *, sync: Sync = True, check: bool = True) -> torch.Tensor:
    """JAX array -> torch tensor sharing its memory (zero-copy).

    Args:
      x: a single-device ``jax.Array`` of a dtype in `ZERO_COPY_DTYPES`.
      sync: see the module docstring (``True``: block until ``x`` is ready before export).
      check: verify the pointers match (raises `ZeroCopyError` otherwise).
    Returns:
      a torch tensor of the same shape and dtype on the matching device (do not write into it).
    """
    if not isinstance(x, jax.Array):
        raise TypeError(f"to_torch expects a jax.Array, got {type(x).__name__}")
    if len(x.sharding.device_set) > 1:
        raise ValueError(f"to_torch: array of shape {x.shape} is sharded over {len(x.sharding.device_set)} devices; "
                         f"export one shard at a time (x.addressable_shards[i].data)")
    torch_dtype(x.dtype)
    if sync is True:
        x.block_until_ready()
    t = torch.from_dlpack(x)
    if check and not same_buffer(x, t):
        raise ZeroCopyError(f"to_torch: export of {x.dtype}{list(x.shape)} was not zero-copy "
                            f"(jax {x.unsafe_buffer_pointer():#x} vs torch {t.data_ptr():#x})")
    return t


class HotBridge:
    """The ``sync="stream"`` crossings of a per-layer hot loop for one device, without the per-call Python of
    `from_torch` / `to_torch` (~50-100 us each on a GPU host: device lookup, dtype canonicalization, a new
    ``torch.cuda.ExternalStream`` and ``Event`` per call). Same stream protocol: `to_jax` makes JAX's ready-events
    stream wait for torch's current stream, `to_torch` makes torch's current stream wait until the array is ready.

    `to_jax` takes the fast path only for a tensor that crosses zero-copy as it is (a dtype of `ZERO_COPY_DTYPES`,
    contiguous, on this device, not requiring grad); anything else goes through ``from_torch(t, copy=None,
    sync="stream")`` and its checks. `to_torch` takes single-device arrays of this device (the outputs of the
    caller's own programs). Where jaxlib lacks the capsule entry points (`jmixedkv.compat.have_dlpack_capsules`),
    both directions are `from_torch` / `to_torch` with ``sync="stream"``."""

    def __init__(self, device: jax.Device):
        self.device = device
        self.torch_device = torch_device_of(device)
        self.cuda = self.torch_device.type == "cuda"
        self.fast = compat.have_dlpack_capsules()
        if self.cuda and self.fast:
            self.stream = device.get_stream_for_external_ready_events()
            self._jax_stream = torch.cuda.ExternalStream(self.stream, device=self.torch_device)
            self._event = torch.cuda.Event()
            self._dl_type = 2                                  # kDLCUDA
        else:
            self.stream, self._dl_type = None, 1               # kDLCPU

    def to_jax(self, t: torch.Tensor) -> jax.Array:
        """torch -> JAX, zero-copy (module docstring: never write ``t`` while JAX uses it)."""
        if (not self.fast or t.dtype not in _TORCH_TO_JAX or t.requires_grad or not t.is_contiguous()
                or t.device != self.torch_device or (not self.cuda and t.data_ptr() % CPU_ALIGNMENT)):
            return from_torch(t, copy=None, sync="stream")
        if self.cuda:                                          # JAX's stream waits for torch's current one
            self._event.record(torch.cuda.current_stream(self.torch_device))
            self._jax_stream.wait_event(self._event)
        return compat.dlpack_import(torch._C._to_dlpack(t), self.device, self.stream, self._dl_type)

    def to_torch(self, x: jax.Array) -> torch.Tensor:
        """JAX -> torch, zero-copy; torch's current stream waits until ``x`` is ready (do not write into it)."""
        if not self.fast:
            return to_torch(x, sync="stream", check=False)
        # DLPack names CUDA's legacy default stream 1, never 0 (as torch.from_dlpack passes it)
        stream = (torch.cuda.current_stream(self.torch_device).cuda_stream or 1) if self.cuda else None
        return torch.utils.dlpack.from_dlpack(compat.dlpack_export(x, stream))


def _is_compact(t: torch.Tensor) -> bool:
    """Strides are a permutation of a dense layout (what JAX imports)."""
    dims = [(st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1]
    dims.sort(key=lambda d: d[0])
    expect = 1
    for st, sz in dims:
        if st != expect:
            return False
        expect *= sz
    return True


def _zero_copy_problem(t: torch.Tensor) -> Optional[str]:
    """Why ``t`` cannot cross zero-copy (None if it can)."""
    if t.dtype in _WIDE and not jax.config.jax_enable_x64:
        return (f"dtype {t.dtype} would be narrowed to {_WIDE[t.dtype]} by JAX (x64 disabled), which copies; "
                f"pass t.to({_WIDE[t.dtype]}) (page tables, slots and lengths are int32) or allow an explicit copy "
                f"with copy=None / copy=True")
    if t.dtype not in _TORCH_TO_JAX and t.dtype not in _WIDE:
        return f"dtype {t.dtype} does not cross DLPack (NVFP4 crosses as uint8 data + float8_e4m3fn scales)"
    if t.numel() and not _is_compact(t):
        return (f"strides {tuple(t.stride())} of shape {tuple(t.shape)} are not a dense (or transposed) layout; "
                f"JAX cannot import them; call .contiguous() or allow a copy")
    if t.device.type == "cpu" and t.numel() and t.data_ptr() % CPU_ALIGNMENT:
        return (f"data pointer {t.data_ptr():#x} is not {CPU_ALIGNMENT}-byte aligned (storage_offset "
                f"{t.storage_offset()}); JAX on CPU needs aligned buffers: export whole allocations, "
                f"or allow a copy")
    return None


def _synchronize(t: torch.Tensor, sync: Sync) -> None:
    if sync not in (True, False, "stream"):
        raise ValueError(f"sync must be True, False or 'stream', got {sync!r}")
    if sync is True and t.device.type == "cuda":
        torch.cuda.synchronize(t.device)


def from_torch(t: torch.Tensor, copy: Optional[bool] = False, *, sync: Sync = True) -> jax.Array:
    """torch tensor -> JAX array on the matching device.

    Args:
      t: a torch tensor (not requiring grad).
      copy: ``False`` (default) zero-copy or raise `ZeroCopyError` saying why; ``None`` zero-copy when possible,
        else one copy (int64 -> int32 with a range check, float64 -> float32, misaligned or strided -> dense);
        ``True`` always copy.
      sync: see the module docstring (``True``: synchronize ``t``'s CUDA device first).
    Returns:
      a ``jax.Array`` (sharing ``t``'s memory unless a copy was made; never write ``t`` while JAX uses it).
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"from_torch expects a torch.Tensor, got {type(t).__name__}")
    if copy not in (True, False, None):
        raise ValueError(f"copy must be True, False or None, got {copy!r}")
    if t.requires_grad:
        raise ValueError(f"from_torch: tensor {t.dtype}{list(t.shape)} requires grad; pass t.detach() "
                         f"(the bridge never drops gradients silently)")
    _synchronize(t, sync)
    problem = _zero_copy_problem(t)
    if problem is not None and copy is False:
        raise ZeroCopyError(f"from_torch(copy=False): {problem}")
    if problem is not None or copy is True:
        t = _explicit_copy(t)
        if t.device.type == "cuda":            # our own copy kernel must be complete before JAX reads
            torch.cuda.current_stream(t.device).synchronize()
        return jax.dlpack.from_dlpack(t, copy=False)
    try:
        x = jax.dlpack.from_dlpack(t, copy=False)
    except Exception as e:                     # e.g. an alignment rule of another platform (not seen on CPU)
        if copy is None:
            return from_torch(t, copy=True, sync=False)
        raise ZeroCopyError(f"from_torch(copy=False): JAX refused a zero-copy import of {t.dtype}{list(t.shape)} "
                            f"on {t.device}: {e}") from e
    if not same_buffer(x, t):
        raise ZeroCopyError(f"from_torch: import of {t.dtype}{list(t.shape)} was not zero-copy "
                            f"(torch {t.data_ptr():#x} vs jax {x.unsafe_buffer_pointer():#x})")
    return x


def _explicit_copy(t: torch.Tensor) -> torch.Tensor:
    """A fresh dense, aligned tensor JAX can import zero-copy (narrowing int64/float64 with a range check)."""
    if t.dtype in _WIDE and not jax.config.jax_enable_x64:
        if t.dtype == torch.int64 and t.numel():
            lo, hi = int(t.min()), int(t.max())
            info = np.iinfo(np.int32)
            if lo < info.min or hi > info.max:
                raise ValueError(f"from_torch: int64 values in [{lo}, {hi}] do not fit in int32")
        t = t.to(_WIDE[t.dtype])
    elif t.dtype not in _TORCH_TO_JAX:
        raise ValueError(f"from_torch: dtype {t.dtype} does not cross DLPack (NVFP4 crosses as uint8 data + "
                         f"float8_e4m3fn scales)")
    out = torch.empty(tuple(t.shape), dtype=t.dtype, device=t.device)  # fresh allocations are aligned
    out.copy_(t)
    return out


def kv_transform(config) -> Optional[dict]:
    """What stored K/V rows are, for a consumer (module docstring): ``{"rotated": bool, "rotation": None |
    "hadamard", "k_smoothing": bool, "block_scale": str}`` from a `KVCacheConfig`; None when ``config`` is None
    (not stated)."""
    if config is None:
        return None
    rotation = getattr(config, "rotation", None)
    return {"rotated": rotation is not None, "rotation": rotation,
            "k_smoothing": bool(getattr(config, "k_smoothing", False)),
            "block_scale": getattr(config, "block_scale", "max6")}


class NVFP4Tensors(NamedTuple):
    """`nvfp4_to_torch`'s export."""
    data: torch.Tensor                     # u8[..., D/2], element 2i in the low nibble
    scales: torch.Tensor                   # float8_e4m3fn (or u8) [..., D/16]
    global_scale: Optional[torch.Tensor]   # f32 decode global scale, or None
    kv_transform: Optional[dict]           # `kv_transform(config)`: rotated / K-shifted rows (None: not stated)


def nvfp4_to_torch(data: jax.Array, scales: jax.Array, global_scale=None, *, scales_as_uint8: bool = False,
                   sync: Sync = True, config=None) -> NVFP4Tensors:
    """Export NVFP4 bytes zero-copy: `NVFP4Tensors` ``(data u8[..., D/2], scales e4m3[..., D/16] (or u8),
    gs f32 | None, kv_transform)``.

    Element ``2i`` is in the low nibble of ``data[..., i]``; ``x = e2m1 * f32(scale) * gs``. ``config``: the
    cache's `KVCacheConfig`, so that ``kv_transform`` says whether the rows are rotated / K-shifted and what the
    consumer must do (module docstring); a rotated cache's rows are ``x @ Hd``, not ``x``.
    """
    if data.dtype != jnp.uint8:
        raise ValueError(f"nvfp4_to_torch: data must be uint8 (packed E2M1), got {data.dtype}")
    if scales.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"nvfp4_to_torch: scales must be float8_e4m3fn, got {scales.dtype}")
    if data.shape[:-1] != scales.shape[:-1] or data.shape[-1] * 2 != scales.shape[-1] * 16:
        raise ValueError(f"nvfp4_to_torch: data {data.shape} and scales {scales.shape} disagree "
                         f"(want [..., D/2] and [..., D/16])")
    td = to_torch(data, sync=sync)
    ts = to_torch(scales, sync=sync)
    if scales_as_uint8:
        ts = ts.view(torch.uint8)
    gs = None if global_scale is None else to_torch(jnp.asarray(global_scale, jnp.float32), sync=sync)
    return NVFP4Tensors(td, ts, gs, kv_transform(config))
