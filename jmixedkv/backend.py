"""Backend dispatch: ``backend="auto" | "reference" | "pallas"``.

``auto`` runs the Pallas kernels on a GPU and the pure-jnp references elsewhere. ``pallas`` on a machine
without a GPU runs the kernels in interpret mode (how CI checks kernel semantics on CPU).
"""
from __future__ import annotations

from .compat import on_gpu

BACKENDS = ("auto", "reference", "pallas")


def resolve(backend: str = "auto") -> str:
    """Return ``"pallas"`` or ``"reference"``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "pallas" if on_gpu() else "reference"
    return backend


def interpret() -> bool:
    """Pallas kernels run in interpret mode when no GPU is present."""
    return not on_gpu()
