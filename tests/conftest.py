"""Test session setup (shared helpers live in `helpers.py`).

Tests run with 4 host CPU devices (``--xla_force_host_platform_device_count=4``) so the tensor-parallel tests
can build a ``("tp",)`` mesh; single-device code is unaffected (it runs on device 0).

Where a jax CUDA plugin is installed, XLA's float32 division on the GPU is made IEEE
(`jmixedkv.compat.xla_flags_with_ieee_division`), so the jnp references run on the GPU follow the NVFP4 convention
and the GPU tests can compare kernels with the reference run on the same GPU.
"""
import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import shutil  # noqa: E402
import tempfile  # noqa: E402

from jmixedkv.compat import cuda_plugin_installed, xla_flags_with_ieee_division  # noqa: E402  (no backend yet)

if cuda_plugin_installed():
    os.environ["XLA_FLAGS"] = xla_flags_with_ieee_division(os.environ.get("XLA_FLAGS", ""))

# One compilation cache for the whole run (both xdist workers and the benches / CLI the tests start as subprocesses
# inherit it): the suite compiles many programs more than once (fresh closures, a module's programs compiled again
# after `_clear_jax_caches_per_module`, the demo model in several subprocesses), and XLA's key is the program
# itself, so a repeat is read back instead of compiled. Made by the first process that loads this file (the xdist
# controller; the workers inherit the variable) and removed by that process at the end; a cache dir the caller set is
# used as is and kept.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jmixedkv-tests-xla-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_unconfigure(config):
    if _OWN_CACHE:                                                   # only the process that made the cache dir
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _clear_jax_caches_per_module():
    """Drop compiled executables after each test module: the suite compiles thousands of programs, and one long
    process holding all of them grows past what a 2-core / 24 GiB CI machine handles comfortably."""
    yield
    jax.clear_caches()
