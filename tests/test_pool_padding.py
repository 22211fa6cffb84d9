"""The Pallas Triton offset hole (docs/DESIGN.md): arrays of 1-byte elements in (2**31, 2**32] bytes are misaddressed
by the kernels, so `init_state` pads pools and the codec pads its operands past 2**32 bytes, and every kernel
refuses a hand-built operand in the hole. These CPU tests pin the decision without allocating anything
(`jax.eval_shape`); the real-size runs are the `gpu` tests in `tests/test_gpu_real_size.py`."""
import jax
import jax.numpy as jnp
import pytest

import jmixedkv as jm
from jmixedkv import layout

HOLE_LO, HOLE_HI = 2 ** 31, 2 ** 32


@pytest.mark.parametrize("elements,itemsize,hole", [
    (HOLE_LO, 1, False),          # largest offset 2**31 - 1: fine
    (HOLE_LO + 1, 1, True),
    (HOLE_HI, 1, True),           # exactly 2**32 bytes still uses 32-bit offsets
    (HOLE_HI + 1, 1, False),      # 64-bit offsets
    (HOLE_LO + 1, 2, False),      # 2-byte elements: > 2**32 bytes, 64-bit offsets
    (HOLE_LO // 2 + 1, 2, False),
    (HOLE_LO - 1, 4, False),
])
def test_in_offset_hole(elements, itemsize, hole):
    assert layout.in_offset_hole(elements, itemsize) is hole


def _shapes(cfg, spec, num_pages, **kw):
    st = jax.eval_shape(lambda: jm.init_state(cfg, spec, num_pages=num_pages, max_seqs=4,
                                              max_pages_per_seq=64, **kw))
    low = st.pools[0].low
    return st, low.data.shape[1], low.scales.shape[1]


MIXED = jm.KVCacheConfig("mixed_nvfp4_bf16", first_n=16, last_n=32, page_size=16)
PAGE_BYTES = 2 * 8 * 16 * 64        # one layer, K and V, 8 heads, page 16, D/2 = 64 packed bytes


@pytest.mark.parametrize("layers,num_pages,padded_data", [
    (1, 131071, False),             # just below 2**31 bytes
    (1, 131072, False),             # exactly 2**31 bytes (32 x 64k tokens): correct on the H200
    (1, 163840, True),              # 40 x 64k tokens, 2.68 GB: was garbage on the H200
    (8, 32768, True),               # 16 x 32k tokens x 8 layers = 2**32 bytes: was a segfault / illegal address
    (9, 32768, False),              # 4.8 GB: 64-bit offsets
    (1, 262145, False),             # just above 2**32 bytes
])
def test_init_state_pads_low_data(layers, num_pages, padded_data):
    spec = jm.GroupSpec(num_layers=layers, num_kv_heads=8, head_dim=128)
    st, data_pages, scale_pages = _shapes(MIXED, spec, num_pages)
    data_elems = layers * data_pages * PAGE_BYTES
    assert not layout.in_offset_hole(data_elems, 1)
    assert not layout.in_offset_hole(layers * scale_pages * PAGE_BYTES // 8, 1)
    assert (data_pages > num_pages) is padded_data
    if padded_data:   # the smallest padding: one page less would be back in the hole
        assert data_elems > HOLE_HI and layout.in_offset_hole(layers * (data_pages - 1) * PAGE_BYTES, 1)
    assert st.alloc.num_pages == num_pages        # padding pages are never allocated
    assert st.page_table.shape == (4, 64)
    # 2-byte twin rows never need padding
    assert st.pools[0].high.rows.shape[1] == 4 * MIXED.num_high_pages_per_seq


def test_model_shaped_cache_pads_scales_only():
    """Llama-3-8B shape (32 layers, 8 KV heads, D 128), ~21 GiB of NVFP4: the data array is far past 2**32 bytes
    but the E4M3 scales (1/8 of it, 2.4 GiB) fall in the hole: only the scales get padding pages."""
    spec = jm.GroupSpec(num_layers=32, num_kv_heads=8, head_dim=128)
    num_pages = 36864
    st, data_pages, scale_pages = _shapes(MIXED, spec, num_pages)
    assert data_pages == num_pages
    scale_bytes = 32 * scale_pages * PAGE_BYTES // 8
    assert scale_pages > num_pages and HOLE_HI < scale_bytes <= HOLE_HI + 32 * PAGE_BYTES // 8
    assert st.alloc.num_pages == num_pages


def test_fp8_twin_and_plain_pools_are_padded():
    cfg = jm.KVCacheConfig("mixed_nvfp4_fp8", first_n=16, last_n=32, page_size=16)
    spec = jm.GroupSpec(num_layers=1, num_kv_heads=8, head_dim=128)
    per_page = 2 * 8 * 16 * 128      # fp8 rows: 1 byte per element
    num_high = 90000                  # 2.9 GB of fp8 twin rows
    st = jax.eval_shape(lambda: jm.init_state(cfg, spec, num_pages=64, max_seqs=4, num_high_pages=num_high))
    rows = st.pools[0].high.rows
    assert rows.dtype == jnp.float8_e4m3fn and rows.shape[1] > num_high
    assert not layout.in_offset_hole(rows.shape[1] * per_page, 1)
    assert st.high_alloc.num_pages == num_high


def test_head_sharded_pools_are_padded_per_shard():
    """Under tensor parallelism each shard's kernel sees its local array: a global array past 2**32 bytes whose
    halves fall in the hole is padded until each half is past 2**32 bytes."""
    per_page = 8 * PAGE_BYTES                           # 8 layers
    assert layout.offset_safe_count(70000, per_page, 1, shards=1) == 70000       # 9.2 GB: fine on one device
    n = layout.offset_safe_count(70000, per_page, 1, shards=2)                    # halves of 4.6 GB... fine too
    assert n == 70000
    n = layout.offset_safe_count(40000, per_page, 1, shards=2)                    # 5.2 GB, halves 2.6 GB: hole
    assert n > 40000 and not layout.in_offset_hole(n * per_page // 2, 1)
    assert layout.in_offset_hole((n - 1) * per_page // 2, 1)


def test_codec_operands_are_padded_out_of_the_hole():
    from pallas_kernels import nvfp4 as k
    # 2**31 + 16 packed bytes at width 128 (64 per row), block of 1024 rows
    rows = (HOLE_LO + 64 * 1024) // 64
    br, _, n_pad = k.row_tiling(rows, 1024, 64, 128)
    assert br == 1024 and n_pad % 1024 == 0 and n_pad * 64 > HOLE_HI
    assert not layout.in_offset_hole(n_pad * 8, 1)
    assert k.row_tiling(4096, 1024, 64, 128)[2] == 4096          # small operands unchanged
    assert k.row_tiling(4000, 1024, 64, 128)[2] == 4096          # (only the block padding)


def test_kernels_refuse_hand_built_operands_in_the_hole():
    """A pool built by hand (not by init_state) that lies in the hole is refused at trace time, naming it."""
    from jmixedkv.layout import TwinGeometry
    from pallas_kernels import stage as stage_kernel
    geom = TwinGeometry(page=16)
    s = jax.ShapeDtypeStruct
    i32 = jnp.int32
    data = s((1, 163840, 2, 8, 16, 64), jnp.uint8)                  # 2.68 GB
    scales = s((1, 163840, 2, 8, 16, 8), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"operand 'data' \(1, 163840, 2, 8, 16, 64\) uint8 is 2684354560 bytes"):
        jax.eval_shape(lambda *a: stage_kernel.stage_pages(*a[:6], low=a[6:], geom=geom, num_staged_pages=1,
                                                           out_dtype=jnp.bfloat16),
                       s((1,), i32), s((1,), i32), s((4,), i32), s((4, 8), i32), s((4, 1), i32), s((1, 8), i32),
                       data, scales, s((1, 2), jnp.float32))


def test_check_offsets_message_names_operand():
    with pytest.raises(ValueError, match="op: operand 'x'"):
        layout.check_offsets("op", x=jax.ShapeDtypeStruct((HOLE_HI,), jnp.uint8), y=None)
    layout.check_offsets("op", x=jax.ShapeDtypeStruct((HOLE_HI,), jnp.bfloat16))


def test_compressed_pools_are_padded():
    """DeepSeek-V4-style compressed groups (MLA latent, D 576) get the same padding; the table checks use the real
    page count (`compressed.num_low_pages`)."""
    from jmixedkv import compressed as cz
    cfg = jm.KVCacheConfig("mixed_nvfp4_bf16", first_n=64, last_n=64, page_size=64, sparse_algorithm="deepseek_v4")
    num_pages = 120000                                        # 288 B x 64 rows x 120000 = 2.2 GB of packed data
    cache = jax.eval_shape(lambda: cz.init_compressed(cfg, (4,), num_layers=1, num_kv_heads=1, head_dim=576,
                                                      num_pages=num_pages, max_seqs=2, max_pages_per_seq=8))
    lv = cache.levels[4]
    assert lv.low.data.shape[1] > num_pages and lv.low.scales.shape[1] == num_pages
    assert not layout.in_offset_hole(lv.low.data.size, 1)
    assert cz.num_low_pages(lv) == num_pages
