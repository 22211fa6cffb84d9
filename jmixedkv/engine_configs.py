"""Engine configuration names -> `KVCacheConfig` arguments: vLLM's ``cache_dtype`` / ``block_size`` and
TensorRT-LLM's ``KvCacheConfig`` fields (`KVCacheConfig.from_vllm`, `KVCacheConfig.from_trtllm` call these).

Every engine field is either **mapped** to a cache-format option or **refused by name** with a `ValueError` saying
where it belongs. Runtime fields (memory budgets, reuse, offload, events) are not properties of the cache format:
passed at the engine's own default they are accepted and mean nothing here (so a whole engine config can be
passed); any other value is refused with the jmixedkv place that owns it. Unknown names raise `TypeError` listing
the accepted ones. This module imports nothing from the library (`jmixedkv.config` imports it lazily).

Cache dtypes. ``"auto"`` means "the model's dtype" in both engines: it needs ``model_dtype=`` (``"bfloat16"`` or
``"float16"``; a float32 model has no cache dtype of its own: pass one). ``model_dtype`` also sets the attention
dtype of the formats that store no attention dtype (``fp8``, ``nvfp4``, ``mixed_nvfp4_fp8``: ``compute_dtype``), and
a bf16 / fp16 format whose dtype differs from ``model_dtype`` is refused (queries must be in the attention dtype).

=====================  =====================================  ==================================================
engine value           jmixedkv dtype                         note
=====================  =====================================  ==================================================
``auto``               ``bf16`` / ``fp16`` (``model_dtype``)  needs ``model_dtype``
``bfloat16``           ``bf16``                               vLLM, TensorRT-LLM (also ``bf16``)
``float16``            ``fp16``                               (also ``fp16``)
``fp8``, ``fp8_e4m3``  ``fp8``                                E4M3 rows + one scale per pool (``high_scale``)
``nvfp4``              ``nvfp4``                              NVFP4 history, no twin
``mixed_nvfp4_<d>``    ``mixed_nvfp4_{bf16,fp16,fp8}``        TensorRT-LLM's mixed dtypes (``<d>`` also spelled
                                                              ``bfloat16`` / ``float16``); vLLM has none: jmixedkv
                                                              names are accepted by `vllm_kwargs` as an extension
=====================  =====================================  ==================================================

Refused dtypes: ``fp8_e5m2`` (the cache stores FP8 as E4M3), ``fp8_inc`` (Intel Gaudi's FP8 path), ``fp8_ds_mla``
(DeepSeek MLA's packed FP8 row format), ``int8``, ``int4_per_token_head``, ``turboquant_*``.

Page size. vLLM's ``block_size`` (its ``BlockSize`` values 1, 8, ..., 256; default 16 on CUDA) maps to
``page_size`` as is: the cache's kernels take any power of two, 1 included (the NVFP4 block of 16 runs along
head_dim, not along tokens; the decode kernel steps over at least 16 tokens, gathering pages). TensorRT-LLM's
``tokens_per_block`` must be "a power of two greater than 1" in TensorRT-LLM itself, so `trtllm_kwargs` refuses 1
as TensorRT-LLM would.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import numpy as np

__all__ = ["vllm_kwargs", "trtllm_kwargs", "model_dtype_name", "VLLM_CACHE_DTYPES", "TRTLLM_DTYPES",
           "NATIVE_OPTIONS", "VLLM_RUNTIME_FIELDS", "TRTLLM_RUNTIME_FIELDS"]

#: jmixedkv dtype names (`jmixedkv.config.DTYPES`), repeated here to keep this module free of library imports
_OUR_DTYPES = ("mixed_nvfp4_bf16", "mixed_nvfp4_fp16", "mixed_nvfp4_fp8", "bf16", "fp16", "fp8", "nvfp4")
#: `KVCacheConfig` options that no engine field names: passed through unchanged by both translators
NATIVE_OPTIONS = ("first_n", "last_n", "max_draft_len", "speculative_mode", "sparse_algorithm", "compute_dtype",
                  "rotation", "k_smoothing", "block_scale")

_ATTENTION_DTYPES = {"bfloat16": "bf16", "float16": "fp16"}
_MODEL_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
                 "half": "float16", "float32": "float32", "fp32": "float32", "float": "float32"}

#: vLLM ``CacheConfig.cache_dtype`` -> jmixedkv dtype (``"auto"``: the model dtype)
VLLM_CACHE_DTYPES = {"auto": None, "bfloat16": "bf16", "float16": "fp16", "fp8": "fp8", "fp8_e4m3": "fp8",
                     "nvfp4": "nvfp4"}
#: TensorRT-LLM ``KvCacheConfig.dtype`` -> jmixedkv dtype (``"auto"``: the model dtype)
TRTLLM_DTYPES = {"auto": None, "bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "fp8": "fp8",
                 "nvfp4": "nvfp4", **{f"mixed_nvfp4_{k}": f"mixed_nvfp4_{v}" for k, v in
                                      (("bf16", "bf16"), ("bfloat16", "bf16"), ("fp16", "fp16"),
                                       ("float16", "fp16"), ("fp8", "fp8"))}}
_REFUSED_DTYPES = {
    "fp8_e5m2": "the cache stores FP8 as E4M3 (fp8 / fp8_e4m3), not E5M2",
    "fp8_inc": "fp8_inc is Intel Gaudi's FP8 path; use fp8 (E4M3)",
    "fp8_ds_mla": "fp8_ds_mla is DeepSeek MLA's packed FP8 row format, which this cache does not store",
    "int8": "the cache has no int8 format",
    "int4_per_token_head": "the cache has no int4 format; nvfp4 is its 4-bit format",
}

_POOL_SIZE = "the pool size is init_state(num_pages=...), planned by jmixedkv.capacity (kv_budget / capacity)"
_HOST_TIER = "host offload is jmixedkv.offload.HostTier (and CacheManager's host tier)"
_PREFIX = "prefix reuse is jmixedkv.prefix.PrefixCache"
_NOT_PROVIDED = "not provided by jmixedkv"

#: vLLM ``CacheConfig`` fields that are not cache-format properties: {name: (accepted default values, where)}
VLLM_RUNTIME_FIELDS: dict[str, tuple[tuple, str]] = {
    "gpu_memory_utilization": ((0.9,), _POOL_SIZE),
    "kv_cache_memory_bytes": ((None,), _POOL_SIZE),
    "num_gpu_blocks_override": ((None,), _POOL_SIZE),
    "num_gpu_blocks": ((None,), _POOL_SIZE),
    "swap_space": ((4, 0), _HOST_TIER),
    "num_cpu_blocks": ((None,), _HOST_TIER),
    "cpu_kvcache_space_bytes": ((None,), _HOST_TIER),
    "kv_offloading_size": ((None,), _HOST_TIER),
    "kv_offloading_backend": (("native",), _HOST_TIER),
    "cpu_offload_gb": ((0,), "cpu_offload_gb offloads model weights, not the KV cache"),
    "enable_prefix_caching": ((True, False), _PREFIX),
    "prefix_caching_hash_algo": (("sha256",), _PREFIX + " (content keys: jmixedkv.prefix.page_keys)"),
    "sliding_window": ((None,), "a sliding window is a read-time argument: decode_attention(sliding_window=...)"),
    "calculate_kv_scales": ((False,), "FP8 / NVFP4 scales are init_state(high_scale=..., gs=...)"),
    "is_attention_free": ((False,), "an attention-free model has no KV cache"),
    "mamba_page_size_padded": ((None,), "recurrent state is jmixedkv.hybrid"),
    "mamba_block_size": ((None,), "recurrent state is jmixedkv.hybrid"),
    "mamba_cache_dtype": (("auto",), "recurrent state is jmixedkv.hybrid"),
    "mamba_ssm_cache_dtype": (("auto",), "recurrent state is jmixedkv.hybrid"),
    "mamba_cache_mode": (("none",), "recurrent state is jmixedkv.hybrid"),
    "kv_sharing_fast_prefill": ((False,), "cross-layer KV sharing is " + _NOT_PROVIDED),
}

#: TensorRT-LLM ``KvCacheConfig`` fields that are not cache-format properties (defaults from its ``llm_args.py``)
TRTLLM_RUNTIME_FIELDS: dict[str, tuple[tuple, str]] = {
    "max_tokens": ((None,), _POOL_SIZE),
    "free_gpu_memory_fraction": ((0.9, None), _POOL_SIZE),
    "max_gpu_total_bytes": ((0,), _POOL_SIZE),
    "cross_kv_cache_fraction": ((None,), "encoder-decoder cross-attention caches are " + _NOT_PROVIDED),
    "host_cache_size": ((None,), _HOST_TIER),
    "onboard_blocks": ((True,), _HOST_TIER),
    "secondary_offload_min_priority": ((None,), _HOST_TIER + " (priorities: jmixedkv.offload.MIN_PRIORITY..)"),
    "enable_block_reuse": ((True, False), _PREFIX),
    "enable_partial_reuse": ((True, False), _PREFIX + " (whole pages only)"),
    "copy_on_partial_reuse": ((True, False), _PREFIX + " (whole pages only)"),
    "max_attention_window": ((None,), "a sliding window is a read-time argument: "
                                      "decode_attention(sliding_window=...); the cache keeps every token"),
    "sink_token_length": ((None, 0), "StreamingLLM sink tokens of an evicting window are " + _NOT_PROVIDED
                                     + " (first_n keeps the first tokens in high precision, it evicts nothing)"),
    "event_buffer_max_size": ((0,), "KV cache events are " + _NOT_PROVIDED),
    "attention_dp_events_gather_period_ms": ((5,), "KV cache events are " + _NOT_PROVIDED),
    "use_uvm": ((False,), "unified-memory pools are " + _NOT_PROVIDED),
    "mamba_ssm_cache_dtype": (("auto",), "recurrent state is jmixedkv.hybrid"),
    "use_kv_cache_manager_v2": ((False, True), "selects TensorRT-LLM's manager; jmixedkv is its own manager"),
    "max_util_for_resume": ((0.95,), "a TensorRT-LLM manager V2 scheduling knob: " + _POOL_SIZE),
}
_TRTLLM_MAPPED = {"dtype": "dtype", "tokens_per_block": "page_size", "mixed_precision_first_n": "first_n",
                  "mixed_precision_last_n": "last_n"}


def model_dtype_name(model_dtype) -> Optional[str]:
    """``"bfloat16"`` / ``"float16"`` / ``"float32"`` from a name (``"bf16"``, ``"half"``, ...), a jnp / NumPy dtype
    or a torch dtype (``torch.bfloat16``); None stays None."""
    if model_dtype is None:
        return None
    if isinstance(model_dtype, str) or type(model_dtype).__module__.startswith("torch"):
        name = str(model_dtype).lower().removeprefix("torch.")
    else:
        try:
            name = np.dtype(model_dtype).name                      # jnp / NumPy dtypes and scalar types
        except TypeError:
            name = repr(model_dtype)
    if name not in _MODEL_DTYPES:
        raise ValueError(f"model_dtype={model_dtype!r} is not a model dtype; expected one of "
                         f"{sorted(set(_MODEL_DTYPES.values()))}")
    return _MODEL_DTYPES[name]


def _dtype_options(engine: str, field: str, value, ours: Optional[str], model: Optional[str],
                   compute_dtype) -> dict:
    """``{"dtype": ..., ["compute_dtype": ...]}`` for a mapped engine dtype (``ours`` None: ``"auto"``)."""
    if ours is None:
        if model is None:
            raise ValueError(f"{engine}: {field}='auto' means the model's dtype; pass model_dtype= "
                             f"('bfloat16' or 'float16')")
        if model not in _ATTENTION_DTYPES:
            raise ValueError(f"{engine}: {field}='auto' with model_dtype={model!r}: the cache has no {model} format; "
                             f"pass {field}= one of 'bfloat16', 'float16', 'fp8', 'nvfp4'")
        return {"dtype": _ATTENTION_DTYPES[model]}
    stored = {"bf16": "bfloat16", "fp16": "float16"}.get(ours.removeprefix("mixed_nvfp4_"))
    if stored is not None:
        if model is not None and model != stored:
            raise ValueError(f"{engine}: {field}={value!r} gives attention dtype {stored}, but model_dtype={model!r}"
                             f"; queries must be in the attention dtype: pick the {model} variant")
        return {"dtype": ours}
    if model is not None and compute_dtype is None:
        if model not in _ATTENTION_DTYPES:
            raise ValueError(f"{engine}: {field}={value!r} with model_dtype={model!r}: the attention dtype must be "
                             f"bfloat16 or float16 (compute_dtype=); pass compute_dtype= explicitly")
        return {"dtype": ours, "compute_dtype": model}
    return {"dtype": ours}


def _runtime(engine: str, table: Mapping[str, tuple[tuple, str]], name: str, value) -> None:
    """Accept a runtime field at the engine's default, refuse any other value with where it belongs."""
    defaults, where = table[name]
    if any(value is d or (d is not None and not isinstance(value, bool) and value == d) for d in defaults):
        return
    raise ValueError(f"{engine}: {name}={value!r} is not a property of the cache format: {where}. Leave it at "
                     f"the engine default ({' or '.join(repr(d) for d in defaults)}) when translating a config")


def _native(engine: str, options: Mapping[str, Any], accepted) -> dict:
    """The `NATIVE_OPTIONS` among ``options``; any other name raises `TypeError` listing ``accepted``."""
    out = {}
    for name, value in options.items():
        if name not in NATIVE_OPTIONS:
            raise TypeError(f"{engine}: unknown field {name!r}; accepted: {sorted(accepted)}")
        out[name] = value
    return out


def _refuse_dtype(engine: str, field: str, value, accepted) -> None:
    why = _REFUSED_DTYPES.get(value) or ("TurboQuant formats are not stored by this cache"
                                         if str(value).startswith("turboquant") else "unknown value")
    raise ValueError(f"{engine}: {field}={value!r} is not supported ({why}); accepted: {sorted(accepted)}")


def vllm_kwargs(cache_dtype: str = "auto", block_size: int = 16, *, model_dtype=None, **rest) -> dict:
    """`KVCacheConfig` keyword arguments for vLLM's ``cache_dtype`` / ``block_size`` (module docstring).

    Args:
      cache_dtype: a vLLM ``CacheDType`` (or a jmixedkv dtype name such as ``"mixed_nvfp4_bf16"``).
      block_size: tokens per block (vLLM's ``BlockSize``), the page size.
      model_dtype: the model's dtype; needed by ``"auto"``, sets ``compute_dtype`` of fp8 / nvfp4 formats.
      rest: other vLLM ``CacheConfig`` fields (`VLLM_RUNTIME_FIELDS`: accepted at vLLM's default, refused
        otherwise) and `NATIVE_OPTIONS` (``first_n``, ``last_n``, ...).
    """
    engine = "KVCacheConfig.from_vllm"
    accepted_dtypes = list(VLLM_CACHE_DTYPES) + list(_OUR_DTYPES)
    if cache_dtype in VLLM_CACHE_DTYPES:
        ours = VLLM_CACHE_DTYPES[cache_dtype]
    elif cache_dtype in _OUR_DTYPES:
        ours = cache_dtype
    else:
        _refuse_dtype(engine, "cache_dtype", cache_dtype, dict.fromkeys(accepted_dtypes))
    runtime = {k: rest.pop(k) for k in list(rest) if k in VLLM_RUNTIME_FIELDS}
    for name, value in runtime.items():
        _runtime(engine, VLLM_RUNTIME_FIELDS, name, value)
    native = _native(engine, rest, ["cache_dtype", "block_size", "model_dtype", *VLLM_RUNTIME_FIELDS,
                                    *NATIVE_OPTIONS])
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise ValueError(f"{engine}: block_size must be an integer power of two, got {block_size!r}")
    options = _dtype_options(engine, "cache_dtype", cache_dtype, ours, model_dtype_name(model_dtype),
                             native.get("compute_dtype"))
    return {**options, "page_size": block_size, **native}


def _fields(kv_cache_config) -> dict:
    """Field dict of a TensorRT-LLM ``KvCacheConfig`` object (set fields only, pydantic) or a mapping."""
    if kv_cache_config is None:
        return {}
    if isinstance(kv_cache_config, Mapping):
        return dict(kv_cache_config)
    dump = getattr(kv_cache_config, "model_dump", None)
    if dump is not None:
        return dict(dump(exclude_unset=True))
    return {k: v for k, v in vars(kv_cache_config).items() if not k.startswith("_")}


def trtllm_kwargs(kv_cache_config=None, *, model_dtype=None, **fields) -> dict:
    """`KVCacheConfig` keyword arguments for a TensorRT-LLM ``KvCacheConfig`` (an object, a mapping of its fields,
    or its fields as keywords; module docstring).

    Mapped: ``dtype``, ``tokens_per_block`` (power of two > 1, TensorRT-LLM's rule), ``mixed_precision_first_n``,
    ``mixed_precision_last_n``. Runtime fields (`TRTLLM_RUNTIME_FIELDS`) are accepted at TensorRT-LLM's default and
    refused otherwise; `NATIVE_OPTIONS` pass through; anything else raises `TypeError`.
    """
    engine = "KVCacheConfig.from_trtllm"
    given = _fields(kv_cache_config)
    for name, value in fields.items():
        if name in given and given[name] != value:
            raise ValueError(f"{engine}: {name}={value!r} conflicts with the config object's {name}={given[name]!r}")
        given[name] = value
    runtime = {k: given.pop(k) for k in list(given) if k in TRTLLM_RUNTIME_FIELDS}
    for name, value in runtime.items():
        _runtime(engine, TRTLLM_RUNTIME_FIELDS, name, value)
    mapped = {k: given.pop(k) for k in list(given) if k in _TRTLLM_MAPPED}
    native = _native(engine, given, ["model_dtype", *_TRTLLM_MAPPED, *TRTLLM_RUNTIME_FIELDS, *NATIVE_OPTIONS])
    dtype = mapped.get("dtype", "auto")
    if dtype not in TRTLLM_DTYPES:
        _refuse_dtype(engine, "dtype", dtype, TRTLLM_DTYPES)
    out = _dtype_options(engine, "dtype", dtype, TRTLLM_DTYPES[dtype], model_dtype_name(model_dtype),
                         native.get("compute_dtype"))
    page = mapped.get("tokens_per_block", 32)
    if isinstance(page, bool) or not isinstance(page, int) or page < 2 or page & (page - 1):
        raise ValueError(f"{engine}: tokens_per_block={page!r}; TensorRT-LLM requires a power of two greater "
                         f"than 1")
    out["page_size"] = page
    for name in ("mixed_precision_first_n", "mixed_precision_last_n"):
        if name in mapped and mapped[name] is not None:
            out[_TRTLLM_MAPPED[name]] = mapped[name]
    return {**out, **native}
