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
    "init_state": "state", "release": "state", "tables_only": "state",
    "CacheError": "checks", "CacheCapacityError": "checks", "CacheManager": "manager",
    "StagedCache": "staging", "stage": "staging", "stage_reference": "staging",
    "gather_rows": "gather", "overlay_retained_rows": "gather", "rows_reference": "gather",
    "chunk_attention": "prefill",
    "decode_attention": "decode", "attention_reference": "decode", "merge_attention": "decode",
    "accept": "speculative", "correct_kv_lens": "speculative", "draft_view": "speculative", "restore": "speculative",
    "trim": "speculative",
    "PrefixCache": "prefix", "admit_with_prefix": "prefix", "fork": "state", "page_keys": "prefix",
}
_MODULES = ("nvfp4", "capacity", "compressed", "hybrid", "sharding", "speculative", "layout", "numerics",
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
