"""Cache specs of the demo and the accuracy benches: ``bf16``, ``nvfp4``, ``mixed:16:16``, ``mixed:all+rot`` ...
-> ``(label, KVCacheConfig)``.

Grammar: ``NAME``, ``NAME:all`` (every token of the run in the twin) or ``NAME:FIRST_N:LAST_N``, where ``NAME`` is a
`jmixedkv.KVCacheConfig` dtype (``mixed`` = ``mixed_nvfp4_bf16``) or ``recommended`` (`KVCacheConfig.recommended`,
its window replaced by ``recommended:FIRST_N:LAST_N``), optionally followed by ``+rot`` (Hadamard
rotation), ``+smooth`` (K smoothing) and ``+4o6`` ("4 over 6" block scaling), the accuracy levers of
`jmixedkv.levers`. A bad spec raises `UsageError` naming it.
"""
from __future__ import annotations

from typing import Callable

from jmixedkv.config import KVCacheConfig

__all__ = ["UsageError", "LEVER_SUFFIXES", "parse_cache_spec", "cache_list"]


class UsageError(ValueError):
    """A bad value given on the command line (or to a demo run); the CLI prints it and exits with code 2."""


#: spec suffix -> (KVCacheConfig field, value)
LEVER_SUFFIXES = {"rot": ("rotation", "hadamard"), "smooth": ("k_smoothing", True),
                  "4o6": ("block_scale", "4over6")}


def parse_cache_spec(spec: str, total_len: int, page_size: int) -> tuple[str, KVCacheConfig]:
    """One spec (see the module docstring) -> ``(label, KVCacheConfig)``; ``total_len`` is the run's token count
    (``NAME:all`` keeps that many last tokens high), ``page_size`` the cache's page."""
    base, *suffixes = spec.strip().split("+")
    levers = {}
    for suf in suffixes:
        if suf not in LEVER_SUFFIXES:
            raise UsageError(f"cache spec {spec!r}: unknown lever {suf!r}; expected one of "
                             f"{['+' + k for k in LEVER_SUFFIXES]}")
        levers[LEVER_SUFFIXES[suf][0]] = LEVER_SUFFIXES[suf][1]
    tail = "".join("+" + s for s in suffixes)
    parts = base.split(":")
    name = {"mixed": "mixed_nvfp4_bf16"}.get(parts[0], parts[0])
    try:
        if parts[0] == "recommended" and len(parts) in (1, 3):      # KVCacheConfig.recommended(), levers on top
            window = {} if len(parts) == 1 else dict(first_n=int(parts[1]), last_n=int(parts[2]))
            label = "recommended" if len(parts) == 1 else f"recommended({parts[1]},{parts[2]})"
            return label + tail, KVCacheConfig.recommended(page_size=page_size, **window, **levers)
        if len(parts) == 1:
            return parts[0] + tail, KVCacheConfig(name, page_size=page_size, **levers)
        if len(parts) == 2 and parts[1] == "all":
            return f"{parts[0]} all-high{tail}", KVCacheConfig(name, first_n=0, last_n=total_len,
                                                                page_size=page_size, **levers)
        if len(parts) == 3:
            first_n, last_n = int(parts[1]), int(parts[2])
            return f"{parts[0]}({first_n},{last_n}){tail}", KVCacheConfig(
                name, first_n=first_n, last_n=last_n, page_size=page_size, **levers)
    except ValueError as e:
        raise UsageError(f"cache spec {spec!r}: {e}") from None
    raise UsageError(f"cache spec {spec!r}: expected NAME, NAME:all or NAME:FIRST_N:LAST_N "
                     f"(e.g. bf16, nvfp4, mixed:16:16, mixed:all), optionally +rot / +smooth / +4o6")


def cache_list(specs: str, total_len: int, page_size: int,
               not_baseline: Callable[[KVCacheConfig], bool]) -> list[tuple[str, KVCacheConfig]]:
    """Comma-separated specs -> ``[(label, config)]``, the bf16 baseline first (prepended when ``not_baseline`` of
    the first config is true). An empty list (``''``, ``','``) or an empty entry (``'bf16,,nvfp4'``) is refused."""
    entries = specs.split(",")
    if not specs.strip():
        raise UsageError(f"--caches {specs!r}: no cache spec given (e.g. --caches bf16,nvfp4,mixed:16:16)")
    if any(not e.strip() for e in entries):
        raise UsageError(f"--caches {specs!r}: empty entry in the comma-separated list")
    caches = [parse_cache_spec(e, total_len, page_size) for e in entries]
    if not_baseline(caches[0][1]):
        caches.insert(0, parse_cache_spec("bf16", total_len, page_size))
    return caches
