"""jmixedkv: a mixed-precision paged KV cache for JAX (NVFP4 history + First-N/Last-N high-precision twin).

Public API (re-exports only; each module's docstring says what it owns). Kernels live in the separate
``pallas_kernels`` package and are imported lazily by the dispatching functions."""
from . import nvfp4
from .config import KVCacheConfig
from .rope import RopeSpec, apply_rope
from .state import CacheState, GroupSpec, admit, append, describe_error, init_state, release
from .reference import attention_reference, rows_reference, stage_reference
from .manager import CacheCapacityError, CacheManager
from .read import StagedCache, gather_rows, overlay_retained_rows, stage
from .attention import decode_attention, merge_attention
from .speculative import accept, correct_kv_lens, draft_view, restore, trim
from .prefix import PrefixCache, admit_with_prefix, fork, page_keys
from . import capacity, compressed, hybrid, sharding, speculative  # noqa: F401  (modules)

__version__ = "0.1.0"
__all__ = ["KVCacheConfig", "GroupSpec", "CacheState", "RopeSpec", "init_state", "admit", "release", "append",
           "stage_reference", "rows_reference", "attention_reference", "apply_rope", "describe_error", "nvfp4",
           "CacheManager", "CacheCapacityError", "StagedCache", "stage", "gather_rows", "overlay_retained_rows",
           "decode_attention", "merge_attention", "accept", "correct_kv_lens", "draft_view", "restore", "trim",
           "PrefixCache", "admit_with_prefix", "fork", "page_keys", "capacity", "compressed", "hybrid", "sharding",
           "speculative"]
