"""Caches of real size on the GPU: every kernel correct on both sides of the Pallas Triton offset hole.

Pallas Triton addresses arrays of at most 2**32 bytes with 32-bit offsets that Triton adds as signed int32, so a
1-byte-element array in (2**31, 2**32] bytes was misaddressed (garbage decode, a segfault in the write kernel, an
illegal address in decode). `init_state` now pads such pools past 2**32 bytes and the codec pads its operands
(docs/DESIGN.md, `jmixedkv.layout.offset_safe_count`). Each case builds a cache through the public API with the
sequences on the *last* pages of the pool (``page_order``), appends all layers with the Pallas write kernel (RoPE in
the kernel), and checks stage, gather_rows and decode_attention on sampled layers against the same appends and
reads run by the jnp reference on a small cache.
"""
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmixedkv as jm
from jmixedkv import layout, nvfp4
from jmixedkv.compat import on_gpu

from helpers import bits

# one xdist group: `make test-gpu-parallel` runs these GiB-sized caches one at a time in one worker (beside the other
# workers' tests, two of them at once ran out of the H200's memory)
pytestmark = [pytest.mark.gpu, pytest.mark.xdist_group("gpu_memory")]

PAGE = 16
CFG = jm.KVCacheConfig("mixed_nvfp4_bf16", first_n=16, last_n=32, page_size=PAGE, max_draft_len=3)
ROPE = jm.RopeSpec("neox", 10000.0)
LENS = (300, 37)                 # two sequences; the first also takes three decode steps


def _fill(state, key, layers, heads, d, backend):
    a, b = 0, 1
    state = jm.admit(jm.admit(state, a), b)
    for slot, n in ((a, LENS[0]), (b, LENS[1])):
        key, k1, k2 = jax.random.split(key, 3)
        k = jax.random.normal(k1, (layers, n, heads, d), jnp.bfloat16) * 3
        v = jax.random.normal(k2, (layers, n, heads, d), jnp.bfloat16)
        state = jm.append(state, None, k, v, jnp.full((n,), slot, jnp.int32), jnp.arange(n, dtype=jnp.int32),
                        rope=ROPE, backend=backend, donate=True)
    for step in range(3):       # decode steps of sequence a (the ring turns over)
        key, k1, k2 = jax.random.split(key, 3)
        k = jax.random.normal(k1, (layers, 1, heads, d), jnp.bfloat16)
        v = jax.random.normal(k2, (layers, 1, heads, d), jnp.bfloat16)
        state = jm.append(state, None, k, v, jnp.array([a], jnp.int32), jnp.array([LENS[0] + step], jnp.int32),
                        rope=ROPE, backend=backend, donate=True)
    return state


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _check_case(layers, num_pages, heads=8, d=128):
    assert on_gpu(), "gpu tests need a GPU"
    spec = jm.GroupSpec(num_layers=layers, num_kv_heads=heads, head_dim=d)
    t0 = time.perf_counter()
    big = jm.init_state(CFG, spec, num_pages=num_pages, max_seqs=4, max_pages_per_seq=64, poison=True,
                        page_order=np.arange(num_pages, dtype=np.int32))      # highest page ids first
    small = jm.init_state(CFG, spec, num_pages=64, max_seqs=4, max_pages_per_seq=64, poison=True)
    data, scales = big.pools[0].low.data, big.pools[0].low.scales
    key = jax.random.PRNGKey(layers * 7919 + num_pages)
    big = _fill(big, key, layers, heads, d, "pallas")
    small = _fill(small, key, layers, heads, d, "reference")
    assert int(big.error) == 0 and int(small.error) == 0
    assert int(np.asarray(big.page_table).max()) == num_pages - 1              # the last page of the pool is used
    seq = jnp.array([0, 1], jnp.int32)
    q = jax.random.normal(jax.random.PRNGKey(1), (2, 1, 4 * heads, d), jnp.bfloat16)
    n0, n1 = LENS[0] + 3, LENS[1]
    idx = jnp.array([[0, 5, 15, 16, n0 // 2, n0 - 33, n0 - 1, -1], [0, 1, 17, n1 - 1, -1, -1, -1, -1]], jnp.int32)
    worst = 0.0
    for layer in sorted({0, layers // 2, layers - 1}):
        ref_staged = jm.stage(small, layer, seq, backend="reference").to_dense()
        np.testing.assert_array_equal(bits(jm.stage(big, layer, seq, backend="reference").to_dense()),
                                      bits(ref_staged), err_msg=f"reference stage, layer {layer}")
        np.testing.assert_array_equal(bits(jm.stage(big, layer, seq, backend="pallas").to_dense()),
                                      bits(ref_staged), err_msg=f"stage kernel, layer {layer}")
        got, _ = jm.gather_rows(big, layer, seq, idx, backend="pallas")
        want, _ = jm.gather_rows(small, layer, seq, idx, backend="reference")
        np.testing.assert_array_equal(bits(got), bits(want), err_msg=f"gather kernel, layer {layer}")
        out, lse = jm.decode_attention(big, layer, q, seq, backend="pallas")
        ref_out, ref_lse = jm.decode_attention(small, layer, q, seq, backend="reference")
        err = _rel(out, ref_out)
        worst = max(worst, err)
        assert err < 2e-2, (layer, err)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-3, atol=1e-3)
    print(f"\n[real-size] layers={layers} num_pages={num_pages}: data {data.shape} {data.nbytes:,} B, "
          f"scales {scales.shape} {scales.nbytes:,} B, pool {big.pools[0].low.data.nbytes + scales.nbytes:,} B, "
          f"decode rel err {worst:.2e}, {time.perf_counter() - t0:.1f} s")
    for a in (data, scales):
        assert not layout.in_offset_hole(a.size, a.dtype.itemsize)


@pytest.mark.parametrize("layers,num_pages", [
    (1, 131071),      # data just below 2**31 bytes
    (1, 163840),      # 2.68 GB: inside the hole (was garbage decode), padded past 2**32
    (8, 32768),       # exactly 2**32 bytes (was a segfault in the write kernel), padded
    (1, 262145),      # just above 2**32 bytes: 64-bit offsets
], ids=["below-2^31", "hole-2.68GB", "exactly-2^32", "above-2^32"])
def test_gpu_pool_sizes_around_the_hole(layers, num_pages):
    _check_case(layers, num_pages)


def test_gpu_model_shaped_cache():
    """Llama-3-8B shape: 32 layers x 8 KV heads x D 128, 40960 pages of 16 tokens (655k tokens): 20 GiB of NVFP4
    data + 2.5 GiB of scales (in the hole: padded) + the bf16 twin."""
    _check_case(32, 40960)


def test_gpu_codec_operands_in_the_hole():
    """The codec's packed output of 2**31 + 64 Ki bytes (8.6 GB of bf16 input): the last rows bit-exact against
    the reference on the same rows."""
    assert on_gpu(), "gpu tests need a GPU"
    rows, d = (2 ** 31 + 64 * 1024) // 64, 128
    x = jax.random.normal(jax.random.PRNGKey(3), (rows, d), jnp.bfloat16)
    packed, scales = nvfp4.quantize(x, 0.5, backend="pallas")
    tail = slice(rows - 4096, rows)
    want_p, want_s = nvfp4.quantize(x[tail], 0.5, backend="reference")
    np.testing.assert_array_equal(np.asarray(packed[tail]), np.asarray(want_p))
    np.testing.assert_array_equal(bits(scales[tail]), bits(want_s))
    del x
    back = nvfp4.dequantize(packed, scales, 0.5, jnp.bfloat16, backend="pallas")
    np.testing.assert_array_equal(bits(back[tail]),
                                  bits(nvfp4.dequantize(want_p, want_s, 0.5, jnp.bfloat16, backend="reference")))
