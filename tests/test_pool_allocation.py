"""A cache whose pools cannot be allocated is refused where it is made: `CacheManager` raises `CacheCapacityError`
naming the pool bytes (JAX would report an asynchronous allocation failure later, from the first program that reads
the state), and `jmixedkv.placement.pack_on_device` packs other arrays so a model-sized pool finds one block.

CPU: the process's address space is capped (``RLIMIT_AS``) below the pool, in a subprocess. GPU: arrays left with
holes between them (the way building a model's weights leaves them) deny a pool that fits the free memory in total;
packed, the same pool is allocated."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmixedkv import CacheManager, GroupSpec, KVCacheConfig
from jmixedkv.checks import CacheCapacityError
from jmixedkv.compat import on_gpu
from jmixedkv.placement import pack_on_device

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC = GroupSpec(num_layers=32, num_kv_heads=8, head_dim=128)

CAPPED = """
import resource
import jax
from jmixedkv import CacheManager, GroupSpec, KVCacheConfig
from jmixedkv.checks import CacheCapacityError
resource.setrlimit(resource.RLIMIT_AS, (12 << 30, 12 << 30))
spec = GroupSpec(num_layers=32, num_kv_heads=8, head_dim=128)
small = CacheManager(KVCacheConfig("bf16", page_size=16), spec, num_pages=64, max_seqs=2)
try:
    CacheManager(KVCacheConfig("bf16", page_size=16), spec, num_pages=1 << 16, max_seqs=4)
    print("ALLOCATED")
except CacheCapacityError as e:
    print("REFUSED", e)
small.release(small.admit())
print("SMALL OK", small.free_pages)
"""


def test_unallocatable_pool_is_refused_at_construction():
    """128 GiB of bf16 pools under a 12 GiB address-space cap: `CacheCapacityError` from the constructor naming
    the pages and bytes; a cache made before it is untouched and usable."""
    proc = subprocess.run([sys.executable, "-c", CAPPED], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "REFUSED allocating the cache failed: 65536 pages make pools of 128.00 GiB" in out, out
    assert "one contiguous free block" in out and "pack_on_device" in out, out
    assert "SMALL OK 64" in out, out


def test_pack_on_device_keeps_values():
    """The packed copy holds the same values, dtypes, shardings and tree; other leaves pass through; an array met
    twice is moved once; the inputs are deleted."""
    a = jnp.arange(12, dtype=jnp.float32).reshape(3, 4)
    tree = {"a": a, "b": [jnp.ones((5,), jnp.bfloat16), 1.5, np.arange(3)], "again": a}
    want = jax.device_get(tree)
    got = pack_on_device(tree)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert got["again"] is got["a"] and got["b"][1] == 1.5 and isinstance(got["b"][2], np.ndarray)
    for g, w, x in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(tree)):
        np.testing.assert_array_equal(np.asarray(g), w)
        if isinstance(x, jax.Array):
            assert g.dtype == w.dtype and x.is_deleted() and g.sharding == x.sharding


def _fill(limit_bytes: int) -> list:
    """1 GiB arrays until ``limit_bytes`` or the first allocation that fails."""
    chunks = []
    while (len(chunks) + 1) << 30 <= limit_bytes:
        try:
            chunks.append(jnp.zeros((1 << 29,), jnp.float16).block_until_ready())
        except jax.errors.JaxRuntimeError:
            break
    return chunks


@pytest.mark.gpu
@pytest.mark.xdist_group("gpu_memory")
def test_gpu_holes_deny_a_pool_that_packing_admits():
    """Fill the allocator with 1 GiB arrays, free every other one: half the memory is free but in 1 GiB holes. A
    cache of 2 GiB pools is refused (`CacheCapacityError`); after `pack_on_device` of the kept arrays it is made."""
    assert on_gpu(), "gpu tests need a GPU"
    stats = jax.devices()[0].memory_stats()
    chunks = _fill(stats["bytes_limit"] - stats["bytes_in_use"])
    assert len(chunks) >= 6, f"only {len(chunks)} GiB could be allocated"
    kept = chunks[::2]
    del chunks
    cfg = KVCacheConfig("bf16", page_size=16)
    pages = (2 << 30) // (32 * 2 * 8 * 16 * 128 * 2)                                # 2 GiB of bf16 rows
    with pytest.raises(CacheCapacityError, match="one contiguous free block"):
        CacheManager(cfg, SPEC, num_pages=pages, max_seqs=2)
    kept = pack_on_device(kept)
    m = CacheManager(cfg, SPEC, num_pages=pages, max_seqs=2)
    assert m.free_pages == pages
    del kept
