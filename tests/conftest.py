"""Shared test helpers: NaN-safe bitwise comparisons of arrays and pytrees.

Tests run with 4 host CPU devices (``--xla_force_host_platform_device_count=4``) so the tensor-parallel tests
can build a ``("tp",)`` mesh; single-device code is unaffected (it runs on device 0).

Where a jax CUDA plugin is installed, XLA's float32 division on the GPU is made IEEE
(`jmixedkv.compat.xla_flags_with_ieee_division`), so the jnp references run on the GPU follow the NVFP4 convention
and the GPU tests can compare kernels with the reference run on the same GPU.
"""
import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

from jmixedkv.compat import cuda_plugin_installed, xla_flags_with_ieee_division  # noqa: E402  (no backend yet)

if cuda_plugin_installed():
    os.environ["XLA_FLAGS"] = xla_flags_with_ieee_division(os.environ.get("XLA_FLAGS", ""))

import jax  # noqa: E402
import numpy as np


def bits(x):
    """Bit-pattern view of an array (so NaN == NaN when the bytes agree)."""
    x = np.asarray(x)
    if x.dtype == bool:
        return x.view(np.uint8)
    return x.view(np.uint8) if x.dtype.itemsize == 1 else x.view(f"u{x.dtype.itemsize}")


def assert_trees_bit_equal(a, b):
    """Same tree structure and every leaf bit-identical (shape, dtype, bytes)."""
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb, f"tree structures differ:\n{ta}\n{tb}"
    for i, (x, y) in enumerate(zip(la, lb)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape and x.dtype == y.dtype, (i, x.shape, y.shape, x.dtype, y.dtype)
        np.testing.assert_array_equal(bits(x), bits(y), err_msg=f"leaf {i}")


import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _clear_jax_caches_per_module():
    """Drop compiled executables after each test module: the suite compiles thousands of programs, and one long
    process holding all of them grows past what a 2-core / 24 GiB CI machine handles comfortably."""
    yield
    jax.clear_caches()
