"""KV cache configuration: the public options of TensorRT-LLM's mixed-precision cache, validated.

`KVCacheConfig` owns the user-facing knobs and nothing else: which storage format (`dtype`), how many
first / last tokens are also kept in high precision (`first_n`, `last_n`), the page size, speculative
decoding and sparse-attention settings. Every invalid combination raises `ValueError` naming the field
and the offending value, before any array is allocated.

Dtype strings (TensorRT-LLM's `kv_cache_config.dtype`):

=====================  =================  ========================  =================================
dtype                  low (history)      high (first-N / last-N)   what a reader sees
=====================  =================  ========================  =================================
``mixed_nvfp4_bf16``   NVFP4              bfloat16 twin             high rows where retained, else NVFP4
``mixed_nvfp4_fp16``   NVFP4              float16 twin              idem
``mixed_nvfp4_fp8``    NVFP4              FP8 E4M3 twin (+ scale)   idem
``bf16`` / ``fp16``    -                  plain pool, every token   plain cache
``fp8``                -                  plain FP8 pool (+ scale)  plain cache
``nvfp4``              NVFP4              -                         plain NVFP4 cache
=====================  =================  ========================  =================================
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax.numpy as jnp

from .layout import TwinGeometry
from .levers import ROTATIONS

__all__ = ["KVCacheConfig", "RECOMMENDED", "DTYPES", "SPECULATIVE_MODES", "SUPPORTED_MIXED_SPARSE"]

#: dtype string -> (low format or None, high / plain storage dtype name or None)
DTYPES: dict[str, tuple[Optional[str], Optional[str]]] = {
    "mixed_nvfp4_bf16": ("nvfp4", "bfloat16"),
    "mixed_nvfp4_fp16": ("nvfp4", "float16"),
    "mixed_nvfp4_fp8": ("nvfp4", "float8_e4m3fn"),
    "bf16": (None, "bfloat16"),
    "fp16": (None, "float16"),
    "fp8": (None, "float8_e4m3fn"),
    "nvfp4": ("nvfp4", None),
}
SPECULATIVE_MODES = (None, "mtp", "ngram", "eagle", "dynamic_tree")
#: sparse algorithms that work with a mixed dtype (their pools are NVFP4 + a twin)
SUPPORTED_MIXED_SPARSE = (None, "dsa", "deepseek_v4")
#: sparse algorithms whose pool format is natively NVFP4 (DeepSeek-V4.1 CSA2): no twin possible
NATIVE_NVFP4_SPARSE = ("csa2", "deepseek_v4.1", "deepseek_v41")
COMPUTE_DTYPES = ("bfloat16", "float16", "float32")
#: fields of `KVCacheConfig.recommended` (the accuracy sweep's winner at <= 0.6 bytes per element)
RECOMMENDED = {"dtype": "mixed_nvfp4_bf16", "first_n": 4, "last_n": 32, "page_size": 16, "rotation": "hadamard",
               "block_scale": "4over6"}

_ALIASES = {
    "mixed_precision_first_n": "first_n",
    "mixed_precision_last_n": "last_n",
    "tokens_per_block": "page_size",
}


@dataclasses.dataclass(frozen=True, init=False)
class KVCacheConfig:
    """Validated, hashable KV cache options (usable as static jit metadata).

    Args:
      dtype: one of `DTYPES` (default ``"mixed_nvfp4_bf16"``).
      first_n: tokens ``p < first_n`` of every sequence are also kept in the high pool
        (alias ``mixed_precision_first_n``). Need not be a page multiple.
      last_n: tokens ``n - last_n <= p < n`` (``n`` = corrected length) are also kept in the high pool
        (alias ``mixed_precision_last_n``).
      page_size: tokens per page, a power of two (alias ``tokens_per_block``).
      max_draft_len: draft tokens a speculative step may append and later reject (ring slack).
      speculative_mode: ``None``, ``"mtp"``, ``"ngram"``, ``"eagle"`` or ``"dynamic_tree"``
        (the last is rejected with a mixed dtype: the twin cannot follow relocated rows).
      sparse_algorithm: ``None``, ``"dsa"``, ``"deepseek_v4"`` or another name (only the first three
        work with a mixed dtype; ``"csa2"`` never does, its pool is natively NVFP4).
      compute_dtype: dtype readers get when the storage itself is not an attention dtype
        (``nvfp4``, ``fp8``, ``mixed_nvfp4_fp8``); default ``"bfloat16"``.
      rotation: accuracy lever (`jmixedkv.levers`): ``None`` or ``"hadamard"`` - stored K/V rows are rotated
        along head_dim after RoPE (``append`` does it); readers rotate q and un-rotate the output.
      k_smoothing: accuracy lever: stored keys are ``k - mean``, a per-(layer, KV head, channel) K mean frozen from
        each sequence's prefill (its first call from position 0). The cache holds the means and subtracts them
        itself: the JAX `CacheState.k_means` (``append``), the torch `interop.StaticPagedCache` /
        `JMixedStaticCache`; the caller passes raw keys and readers return model-space rows and the raw keys' LSE
        (`jmixedkv.levers`). Refused by prefix reuse / offload, MLA latent groups, ``soft_cap`` and
        `interop.hf.JMixedKVCache`.
      block_scale: NVFP4 block scaling on write (`jmixedkv.nvfp4.BLOCK_SCALES`): ``"max6"`` (default, the pinned
        order) or ``"4over6"`` (per block, the block max mapped to 6 or to 4, whichever dequantizes with the lower
        squared error). Same bytes and decoder: readers and exporters are unchanged.
    """

    dtype: str
    first_n: int
    last_n: int
    page_size: int
    max_draft_len: int
    speculative_mode: Optional[str]
    sparse_algorithm: Optional[str]
    compute_dtype: str
    rotation: Optional[str]
    k_smoothing: bool
    block_scale: str

    def __init__(self, dtype: str = "mixed_nvfp4_bf16", first_n: Optional[int] = None,
                 last_n: Optional[int] = None, page_size: Optional[int] = None, max_draft_len: int = 0,
                 speculative_mode: Optional[str] = None, sparse_algorithm: Optional[str] = None,
                 compute_dtype: Optional[str] = None, rotation: Optional[str] = None,
                 k_smoothing: bool = False, block_scale: str = "max6", **aliases: Any):
        values = {"first_n": first_n, "last_n": last_n, "page_size": page_size}
        for alias, value in aliases.items():
            if alias not in _ALIASES:
                raise TypeError(f"KVCacheConfig() got an unexpected keyword argument {alias!r}")
            field = _ALIASES[alias]
            if values[field] is not None and values[field] != value:
                raise ValueError(f"KVCacheConfig: {alias}={value!r} conflicts with {field}={values[field]!r}")
            values[field] = value
        defaults = {"first_n": 0, "last_n": 0, "page_size": 32}
        values = {k: defaults[k] if v is None else v for k, v in values.items()}
        if compute_dtype is None:
            compute_dtype = {"float16": "float16"}.get(DTYPES.get(dtype, (None, None))[1], "bfloat16")
        for name, value in dict(dtype=dtype, **values, max_draft_len=max_draft_len, speculative_mode=speculative_mode,
                                sparse_algorithm=sparse_algorithm, compute_dtype=compute_dtype, rotation=rotation,
                                k_smoothing=k_smoothing, block_scale=block_scale).items():
            object.__setattr__(self, name, value)
        self._validate()

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        for name, allowed in (("dtype", sorted(DTYPES)), ("speculative_mode", list(SPECULATIVE_MODES)),
                              ("compute_dtype", list(COMPUTE_DTYPES)), ("rotation", list(ROTATIONS)),
                              ("block_scale", ["max6", "4over6"])):
            if getattr(self, name) not in allowed:
                raise ValueError(f"KVCacheConfig.{name}: unknown value {getattr(self, name)!r}; expected one of "
                                 f"{allowed}")
        for name in ("first_n", "last_n", "max_draft_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"KVCacheConfig.{name} must be an integer >= 0, got {value!r}")
        page = self.page_size
        if isinstance(page, bool) or not isinstance(page, int) or page < 1 or page & (page - 1):
            raise ValueError(f"KVCacheConfig.page_size (tokens_per_block) must be a power of two >= 1, "
                             f"got {self.page_size!r}")
        if not self.is_mixed and (self.first_n or self.last_n):
            raise ValueError(f"KVCacheConfig: first_n={self.first_n}, last_n={self.last_n} need a mixed dtype "
                             f"(mixed_nvfp4_*), but dtype={self.dtype!r} keeps no high-precision twin")
        if self.block_scale != "max6" and not self.has_low:
            raise ValueError(f"KVCacheConfig: block_scale={self.block_scale!r} scales NVFP4 blocks, but "
                             f"dtype={self.dtype!r} has no NVFP4 pool")
        if not isinstance(self.k_smoothing, bool):
            raise ValueError(f"KVCacheConfig.k_smoothing must be a bool, got {self.k_smoothing!r}")
        if self.sparse_algorithm is not None and not isinstance(self.sparse_algorithm, str):
            raise ValueError(f"KVCacheConfig.sparse_algorithm must be a string or None, got {self.sparse_algorithm!r}")
        if not self.is_mixed:
            return
        if self.speculative_mode == "dynamic_tree":
            raise ValueError(f"KVCacheConfig.speculative_mode={self.speculative_mode!r} is not supported with "
                             f"dtype={self.dtype!r}: dynamic-tree drafting relocates accepted KV rows inside the "
                             f"pools after verification, and the high-precision twin would not follow")
        sparse = (self.sparse_algorithm or "").lower() or None
        if sparse in NATIVE_NVFP4_SPARSE:
            raise ValueError(f"KVCacheConfig.sparse_algorithm={self.sparse_algorithm!r} (DeepSeek-V4.1 / CSA2) is "
                             f"not supported with dtype={self.dtype!r}: its pool format is natively NVFP4")
        if sparse not in SUPPORTED_MIXED_SPARSE:
            raise ValueError(f"KVCacheConfig.sparse_algorithm={self.sparse_algorithm!r} is not supported with "
                             f"dtype={self.dtype!r}; mixed precision works with {list(SUPPORTED_MIXED_SPARSE)}")

    # ------------------------------------------------------------------ derived
    @property
    def mixed_precision_first_n(self) -> int:
        return self.first_n

    @property
    def mixed_precision_last_n(self) -> int:
        return self.last_n

    @property
    def tokens_per_block(self) -> int:
        return self.page_size

    @property
    def is_mixed(self) -> bool:
        return self.dtype.startswith("mixed_")

    @property
    def has_low(self) -> bool:
        """History is stored in NVFP4 (mixed dtypes and ``nvfp4``)."""
        return DTYPES[self.dtype][0] == "nvfp4"

    @property
    def high_dtype(self):
        """jnp dtype of the high (twin) pool, or of the plain pool; None for ``nvfp4``."""
        name = DTYPES[self.dtype][1]
        return None if name is None else jnp.dtype(name)

    @property
    def attention_dtype(self):
        """jnp dtype readers get (staged K/V, gathered rows, decode outputs)."""
        high = DTYPES[self.dtype][1]
        if high in ("bfloat16", "float16"):
            return jnp.dtype(high)
        return jnp.dtype(self.compute_dtype)

    @property
    def twin(self) -> TwinGeometry:
        """The twin's static `jmixedkv.layout.TwinGeometry` (docs/DESIGN.md §4; no pages without a mixed dtype)."""
        return TwinGeometry.for_window(self.page_size, self.first_n, self.last_n, self.max_draft_len)

    @property
    def num_fixed_pages(self) -> int:
        return self.twin.num_fixed

    @property
    def num_ring_pages(self) -> int:
        return self.twin.num_ring

    @property
    def num_high_pages_per_seq(self) -> int:
        return self.twin.width

    def replace(self, **changes: Any) -> "KVCacheConfig":
        return KVCacheConfig(**{**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, **changes})

    @classmethod
    def recommended(cls, **overrides: Any) -> "KVCacheConfig":
        """The recommended mixed configuration, chosen by the accuracy sweep of ``bench/accuracy.py --sweep`` (six
        texts the project does not ship; bench/RESULTS.md): `RECOMMENDED`, i.e. ``mixed_nvfp4_bf16`` (NVFP4 history,
        bf16 twin), ``first_n=4``, ``last_n=32``, Hadamard ``rotation``, ``"4over6"`` block scaling, page 16. Of the
        swept configurations at <= 0.6 bytes per element that need nothing from the caller, it has the lowest worst
        text (SmolLM2-135M, 4096 tokens: KL 0.65x fp8's on average over the six texts, 0.98x on the worst) and a
        mean level with the best; ``k_smoothing=True`` lowers that to 0.48x / 0.69x, but a logit soft-cap refuses
        it (`jmixedkv.levers`) and its GPU cost is not measured, so it is left out (``recommended(k_smoothing=True)``
        turns it on).

        Memory (twin pages and scales included, any model shape): 0.594 bytes per K/V element at 4096 tokens per
        sequence, 0.578 at 8192 (``nvfp4`` alone: 0.5625; ``fp8``: 1.0). ``overrides`` replace fields (aliases such
        as ``mixed_precision_last_n`` accepted); an unknown field or a bad value is refused like the constructor's.
        ``KVCacheConfig("mixed_nvfp4_bf16")`` itself keeps TensorRT-LLM's meaning (``first_n = last_n = 0``)."""
        given = {_ALIASES.get(k, k) for k in overrides}           # an alias replaces its field's default
        return cls(**{k: v for k, v in RECOMMENDED.items() if k not in given}, **overrides)

    # ------------------------------------------------------------------ engine names
    @classmethod
    def from_vllm(cls, cache_dtype: str = "auto", block_size: int = 16, *, model_dtype=None,
                  **rest: Any) -> "KVCacheConfig":
        """From vLLM's ``cache_dtype`` / ``block_size`` (``"auto"`` needs ``model_dtype=``); other vLLM
        ``CacheConfig`` fields are accepted at vLLM's default or refused by name; ``first_n`` etc. pass through
        (`jmixedkv.engine_configs`)."""
        from .engine_configs import vllm_kwargs
        return cls(**vllm_kwargs(cache_dtype, block_size, model_dtype=model_dtype, **rest))

    @classmethod
    def from_trtllm(cls, kv_cache_config=None, *, model_dtype=None, **fields: Any) -> "KVCacheConfig":
        """From a TensorRT-LLM ``KvCacheConfig`` (object, mapping or keyword fields): ``dtype``,
        ``tokens_per_block`` (power of two > 1), ``mixed_precision_first_n`` / ``_last_n`` mapped; runtime fields
        accepted at TensorRT-LLM's default or refused by name (`jmixedkv.engine_configs`)."""
        from .engine_configs import trtllm_kwargs
        return cls(**trtllm_kwargs(kv_cache_config, model_dtype=model_dtype, **fields))
