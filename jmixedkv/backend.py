"""Backend dispatch: ``backend="auto" | "reference" | "pallas"``.

``auto`` runs the Pallas kernels on a GPU and the pure-jnp references elsewhere. ``pallas`` on a machine
without a GPU runs the kernels in interpret mode (how CI checks kernel semantics on CPU). Every library op
dispatches through `dispatch`: its public function validates, then calls ``dispatch(backend, reference, pallas)``.
"""
from __future__ import annotations

import functools

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


def dispatch(backend: str, reference, pallas):
    """The implementation of an op that ``backend`` selects: ``reference`` (pure jnp), or ``pallas`` with
    ``interpret=`` bound. ``pallas`` is a library function that imports its `pallas_kernels` module inside, so the
    reference path never loads a kernel; both take the op's own arguments."""
    if resolve(backend) == "reference":
        return reference
    return functools.partial(pallas, interpret=interpret())
