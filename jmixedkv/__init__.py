"""jmixedkv: a mixed-precision paged KV cache for JAX (NVFP4 history + First-N/Last-N high-precision twin).

Public API (re-exports only; each module's docstring says what it owns)."""
from . import nvfp4
from .config import KVCacheConfig
from .rope import RopeSpec, apply_rope
from .state import (CacheState, GroupSpec, admit, append, describe_error, init_state, release)
from .reference import attention_reference, rows_reference, stage_reference

__version__ = "0.1.0"
__all__ = ["KVCacheConfig", "GroupSpec", "CacheState", "RopeSpec", "init_state", "admit", "release", "append",
           "stage_reference", "rows_reference", "attention_reference", "apply_rope", "describe_error", "nvfp4"]
from .manager import CacheCapacityError, CacheManager  # noqa: E402

__all__ += ["CacheManager", "CacheCapacityError"]
