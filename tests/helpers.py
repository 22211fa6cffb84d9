"""Shared test helpers: one bitwise equality for arrays and pytrees (import as ``from helpers import ...``).

Bit equality compares the bytes of every element, whatever the dtype (float32 included: ``-0.0 != 0.0`` and
``NaN == NaN`` when the payloads agree). ``any_nan=True`` relaxes one thing only: two floats that are both NaN
compare equal whatever their payloads (x86 and NVIDIA GPUs generate different default NaNs for an invalid
operation, so payloads are not part of the convention where a NaN is *computed*; NVFP4 bytes and E4M3 scales encode
NaN explicitly and stay compared byte for byte).
"""
from __future__ import annotations

import os
import subprocess
import sys

import jax
import numpy as np

__all__ = ["bits", "assert_bits_equal", "assert_trees_bit_equal", "division_probe"]


def bits(x) -> np.ndarray:
    """Unsigned-integer view of an array's bytes (``uint8/16/32/64`` by item size; bool as uint8)."""
    x = np.asarray(x)
    if x.dtype == bool:
        return x.view(np.uint8)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def _both_nan(x, y):
    """Where two float arrays (16 bits or wider) both hold a NaN; never for bytes, integers or bools."""
    if x.dtype.itemsize == 1 or x.dtype.kind in "biu":
        return np.zeros(x.shape, bool)
    return np.isnan(x.astype(np.float32)) & np.isnan(y.astype(np.float32))


def assert_bits_equal(got, want, msg: str = "", *, any_nan: bool = False) -> None:
    """Assert ``got`` and ``want`` have the same shape, dtype and bytes (see the module docstring for ``any_nan``).

    The failure names how many elements differ and the first few indices with both values."""
    a, b = np.asarray(got), np.asarray(want)
    assert a.shape == b.shape and a.dtype == b.dtype, \
        f"{msg}: shape/dtype {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    bad = bits(a) != bits(b)
    if any_nan:
        bad &= ~_both_nan(a, b)
    if bad.any():
        idx = np.argwhere(bad)[:4]
        first = ", ".join(f"{tuple(i.tolist())}: {a[tuple(i)]!r} vs {b[tuple(i)]!r}" for i in idx)
        raise AssertionError(f"{msg}: {int(bad.sum())} of {bad.size} elements differ; first {first}")


def assert_trees_bit_equal(a, b, msg: str = "", *, any_nan: bool = False) -> None:
    """Same tree structure and every leaf bit-identical (shape, dtype, bytes); failures name the leaf path."""
    la, ta = jax.tree_util.tree_flatten_with_path(a)
    lb, tb = jax.tree_util.tree_flatten_with_path(b)
    assert ta == tb, f"{msg}: tree structures differ:\n{ta}\n{tb}"
    for (path, x), (_, y) in zip(la, lb):
        assert_bits_equal(x, y, f"{msg} {jax.tree_util.keystr(path)}", any_nan=any_nan)


# ------------------------------------------------------------------- IEEE division in XLA (jmixedkv.compat)
_DIVISION_PROBE = """
import os, sys
import numpy as np
import jax, jax.numpy as jnp
d = np.concatenate([np.float32([0.0011160715, 3.0, 7.0]),
                    np.random.default_rng(0).uniform(1e-4, 1e4, 1 << 16).astype(np.float32)])
got = np.asarray(jax.jit(lambda a: jnp.float32(1.0) / a)(jnp.asarray(d)))
want = np.float32(1.0) / d
print(jax.default_backend(), int((got.view(np.uint32) != want.view(np.uint32)).sum()), got[0])
"""


def division_probe(env_flags):
    """Run `_DIVISION_PROBE` in a fresh process with ``XLA_FLAGS=env_flags``: (backend, mismatches, 1/0.0011160715)."""
    env = dict(os.environ, XLA_FLAGS=env_flags)
    r = subprocess.run([sys.executable, "-c", _DIVISION_PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    backend, bad, inv = r.stdout.split()[-3:]
    return backend, int(bad), np.float32(inv)
