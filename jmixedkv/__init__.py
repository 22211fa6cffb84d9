"""jmixedkv: a mixed-precision paged KV cache for JAX (NVFP4 history + First-N/Last-N high-precision twin).

Public API: re-exports only (each module's docstring says what it owns), resolved lazily (PEP 562) so that a kernel
module, which imports only the leaf modules `jmixedkv.compat` / `layout` / `numerics`, does not load the whole
library (docs/DESIGN.md §7). ``import jmixedkv as jm; jm.init_state(...)`` works as an eager import would.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

#: public name -> the module that defines it (a module name maps to itself)
_EXPORTS = {
    "KVCacheConfig": "config",
    "RopeSpec": "rope", "apply_rope": "rope",
    "CacheState": "state", "GroupSpec": "state", "admit": "state", "append": "state", "describe_error": "state",
    "init_state": "state", "release": "state",
    "attention_reference": "reference", "rows_reference": "reference", "stage_reference": "reference",
    "CacheError": "checks", "CacheCapacityError": "checks", "CacheManager": "manager",
    "StagedCache": "read", "gather_rows": "read", "overlay_retained_rows": "read", "stage": "read",
    "decode_attention": "attention", "merge_attention": "attention",
    "accept": "speculative", "correct_kv_lens": "speculative", "draft_view": "speculative", "restore": "speculative",
    "trim": "speculative",
    "PrefixCache": "prefix", "admit_with_prefix": "prefix", "fork": "state", "page_keys": "prefix",
}
_MODULES = ("nvfp4", "codec", "capacity", "compressed", "hybrid", "sharding", "speculative", "layout", "numerics",
            "checks", "compat")

__all__ = sorted(_EXPORTS) + [m for m in _MODULES if m not in ("layout", "numerics", "checks", "compat")]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    elif name in _MODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module 'jmixedkv' has no attribute {name!r}")
    globals()[name] = value          # resolve once
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS) | set(_MODULES))
