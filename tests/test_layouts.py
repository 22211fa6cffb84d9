"""interop.layouts: FlashInfer CSR / vLLM block tables / slot mappings against hand-computed examples, page
views of the pools (zero-copy torch views), and NVFP4 pages decoded in torch against the staged reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from helpers import poisoned_state
from interop import layouts
from interop.dlpack import to_torch
from jmixedkv import GroupSpec, KVCacheConfig, append, init_state, stage, stage_reference
from jmixedkv.state import admit

PAGE = 16
# slots 0..4; lengths 45 (3 pages, last 13), 0 (empty), 1, 16 (exactly one page), 17; permuted page ids
TABLE = np.array([[7, 2, 9, -1],
                  [-1, -1, -1, -1],
                  [4, -1, -1, -1],
                  [0, -1, -1, -1],
                  [11, 5, -1, -1]], np.int32)
LENS = np.array([45, 0, 1, 16, 17], np.int32)


def test_flashinfer_csr_hand_example():
    csr = layouts.flashinfer_csr(TABLE, LENS, [0, 1, 2, 3, 4], PAGE)
    np.testing.assert_array_equal(csr.kv_indptr, [0, 3, 3, 4, 5, 7])
    np.testing.assert_array_equal(csr.kv_indices, [7, 2, 9, 4, 0, 11, 5])
    np.testing.assert_array_equal(csr.kv_last_page_len, [13, 0, 1, 16, 1])
    assert all(a.dtype == np.int32 for a in csr)
    np.testing.assert_array_equal(layouts.seq_lens_from_csr(csr.kv_indptr, csr.kv_last_page_len, PAGE), LENS)


def test_flashinfer_csr_single_45_tokens():
    csr = layouts.flashinfer_csr(TABLE[:1], LENS[:1], [0], PAGE)
    assert csr.kv_indptr.tolist() == [0, 3] and csr.kv_last_page_len.tolist() == [13]


def test_flashinfer_csr_subset_reordered_with_padding():
    csr = layouts.flashinfer_csr(TABLE, LENS, [4, -1, 0], PAGE)
    np.testing.assert_array_equal(csr.kv_indptr, [0, 2, 2, 5])
    np.testing.assert_array_equal(csr.kv_indices, [11, 5, 7, 2, 9])
    np.testing.assert_array_equal(csr.kv_last_page_len, [1, 0, 13])


def test_flashinfer_csr_padded_matches():
    seq = np.array([4, -1, 0, 1, 2, 3], np.int32)
    want = layouts.flashinfer_csr(TABLE, LENS, seq, PAGE)
    indptr, indices, last = jax.jit(layouts.flashinfer_csr_padded, static_argnums=3)(
        jnp.asarray(TABLE), jnp.asarray(LENS), jnp.asarray(seq), PAGE)
    np.testing.assert_array_equal(indptr, want.kv_indptr)
    np.testing.assert_array_equal(last, want.kv_last_page_len)
    total = int(want.kv_indptr[-1])
    np.testing.assert_array_equal(np.asarray(indices)[:total], want.kv_indices)
    assert indices.shape == (seq.size * TABLE.shape[1],) and (np.asarray(indices)[total:] == -1).all()


def test_block_table_and_slot_mapping_hand_example():
    table, lens = layouts.block_table(TABLE, LENS, [0, 1, 2, 4, -1], PAGE, pad=-1)
    np.testing.assert_array_equal(table, [[7, 2, 9, -1], [-1] * 4, [4, -1, -1, -1], [11, 5, -1, -1], [-1] * 4])
    np.testing.assert_array_equal(lens, [45, 0, 1, 17, 0])
    seq = np.array([0, 0, 4, 4, -1, 2, 1, 0], np.int32)
    pos = np.array([44, 16, 16, 0, 3, 0, 0, 70], np.int32)
    slots = layouts.slot_mapping(TABLE, seq, pos, PAGE)
    np.testing.assert_array_equal(slots, [9 * 16 + 12, 2 * 16 + 0, 5 * 16 + 0, 11 * 16, -1, 4 * 16, -1, -1])
    assert slots.dtype == np.int64
    assert layouts.slot_mapping(TABLE, seq, pos, PAGE, dtype=np.int32).dtype == np.int32


def test_torch_inputs_accepted():
    csr = layouts.flashinfer_csr(torch.from_numpy(TABLE), torch.from_numpy(LENS).long(), torch.tensor([0]), PAGE)
    assert csr.kv_indices.tolist() == [7, 2, 9]


def test_bad_inputs():
    with pytest.raises(ValueError, match="slot 2 .*no page at column 1"):
        layouts.flashinfer_csr(TABLE, np.array([45, 0, 20, 16, 17]), [2], PAGE)
    with pytest.raises(ValueError, match=r"slots \[5\]"):
        layouts.flashinfer_csr(TABLE, LENS, [5], PAGE)
    with pytest.raises(ValueError, match="max_pages"):
        layouts.block_table(TABLE, np.array([80, 0, 0, 0, 0]), [0], PAGE)
    with pytest.raises(ValueError, match="page_size"):
        layouts.flashinfer_csr(TABLE, LENS, [0], 0)
    with pytest.raises(ValueError, match="integers"):
        layouts.flashinfer_csr(TABLE.astype(np.float32), LENS, [0], PAGE)
    with pytest.raises(ValueError, match="equal-length"):
        layouts.slot_mapping(TABLE, [0, 1], [0], PAGE)
    with pytest.raises(ValueError, match="layout"):
        layouts.page_view(torch.zeros(1, 2, 2, 1, 4, 16), 0, 0, "NDH")
    with pytest.raises(ValueError, match="layer"):
        layouts.page_view(torch.zeros(1, 2, 2, 1, 4, 16), 1, 0)


def test_page_views_are_zero_copy_and_index_correctly():
    rows = jnp.arange(2 * 3 * 2 * 2 * 4 * 16, dtype=jnp.float32).reshape(2, 3, 2, 2, 4, 16).astype(jnp.bfloat16)
    pool = to_torch(rows)
    hnd = layouts.page_view(pool, 1, 1, "HND")
    nhd = layouts.page_view(pool, 1, 1, "NHD")
    five = layouts.page_view(pool, 1, None, "HND")
    assert hnd.shape == (3, 2, 4, 16) and nhd.shape == (3, 4, 2, 16) and five.shape == (3, 2, 2, 4, 16)
    for v in (hnd, nhd, five):
        assert v.untyped_storage().data_ptr() == rows.unsafe_buffer_pointer()
    r = np.asarray(rows.astype(jnp.float32))
    p, h, t = 2, 1, 3
    assert float(hnd[p, h, t, 5]) == r[1, p, 1, h, t, 5]
    assert float(nhd[p, t, h, 5]) == r[1, p, 1, h, t, 5]
    np.testing.assert_array_equal(np.asarray(layouts.page_view(rows, 1, 1, "NHD").astype(jnp.float32)),
                                  nhd.float().numpy())


def _kv_rows(rng, shape, dtype):
    """K standard normal, V standard normal * 3."""
    return jnp.asarray(rng.standard_normal(shape), dtype), jnp.asarray(rng.standard_normal(shape) * 3, dtype)


def _state(cfg, seed, rows=_kv_rows):
    """Slots 0 and 1 holding 45 and 17 tokens in 8 permuted, poisoned pages (`poisoned_state`), 2 layers of 2 heads
    of 32, global scales K/V 0.5/2.0 (layer 0) and 1.25/0.75 (layer 1)."""
    return poisoned_state(cfg, GroupSpec(num_layers=2, num_kv_heads=2, head_dim=32), (45, 17), seed=seed,
                          num_pages=8, gs=np.float32([[0.5, 2.0], [1.25, 0.75]]), rows=rows)


def _nvfp4_state():
    return _state(KVCacheConfig("nvfp4", page_size=PAGE), seed=1)


_STATE = []


def _nvfp4_state_cached():
    if not _STATE:
        _STATE.append(_nvfp4_state())
    return _STATE[0]


_stage = jax.jit(stage_reference)


def _torch_decode_page_rows(data, scales, gs):
    """Independent torch NVFP4 decode of ``data u8[..., D/2]``, ``scales e4m3[..., D/16]`` -> bf16."""
    table = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float32)
    codes = torch.stack([data & 0xF, data >> 4], dim=-1).reshape(*data.shape[:-1], -1).long()
    blocks = table[codes].reshape(*codes.shape[:-1], -1, 16)
    return ((blocks * scales.float()[..., None]) * gs).reshape(codes.shape).to(torch.bfloat16)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_nvfp4_pages_decode_to_staged_reference(layout):
    """Walk the FlashInfer CSR over the exported NVFP4 pages, decode in torch, compare to stage_reference."""
    state = _nvfp4_state_cached()
    seq = np.array([0, 1], np.int32)
    csr = layouts.flashinfer_csr(np.asarray(state.page_table), np.asarray(state.kv_lens), seq, PAGE)
    for layer in (0, 1):
        pages = layouts.nvfp4_pages(state.pools[0].low, layer, layout)
        assert pages.k_scale == [0.5, 1.25][layer] and pages.v_scale == [2.0, 0.75][layer]
        assert pages.k_data.dtype == torch.uint8 and pages.k_scales.dtype == torch.float8_e4m3fn
        want = np.asarray(_stage(state, layer, seq).astype(jnp.float32))          # [B, kv, H, S, D]
        for b in range(2):
            ids = csr.kv_indices[csr.kv_indptr[b]:csr.kv_indptr[b + 1]]
            n = int(state.kv_lens[b])
            for kv, (data, scales, gs) in enumerate([(pages.k_data, pages.k_scales, pages.k_scale),
                                                     (pages.v_data, pages.v_scales, pages.v_scale)]):
                got = _torch_decode_page_rows(data[ids], scales[ids], gs)       # HND [p, H, page, D]
                if layout == "NHD":                                           # NHD [p, page, H, D]
                    got = got.permute(0, 2, 1, 3)
                got = got.permute(1, 0, 2, 3).reshape(2, -1, 32)[:, :n].float().numpy()
                np.testing.assert_array_equal(got, want[b, kv, :, :n])


def test_nvfp4_pages_scale_bytes():
    state = _nvfp4_state_cached()
    pages = layouts.nvfp4_pages(state.pools[0].low, 0, scales_as_uint8=True)
    assert pages.k_scales.dtype == torch.uint8
    np.testing.assert_array_equal(pages.v_scales.numpy(),
                                  np.asarray(state.pools[0].low.scales[0][:, 1]).view(np.uint8))
    jx = layouts.nvfp4_pages(state.pools[0].low, 0, "NHD", as_torch=False)
    assert jx.k_data.shape == (8, PAGE, 2, 16) and jx.k_scales.shape == (8, PAGE, 2, 2)


def _kv_states():
    """The same K/V written to a mixed cache (first 2 / last 4 rows in a bf16 twin) and to a plain NVFP4 cache."""
    same = lambda _, shape, dtype: _kv_rows(np.random.default_rng(2), shape, dtype)  # noqa: E731
    return [_state(cfg, seed=0, rows=same) for cfg in (
        KVCacheConfig("mixed_nvfp4_bf16", first_n=2, last_n=4, page_size=PAGE), KVCacheConfig("nvfp4", page_size=PAGE))]


def test_nvfp4_pool_csr_means_history_only_staged_csr_means_mixed():
    """The documented statement: a CSR over the NVFP4 pool reads plain NVFP4 (the twin dropped) -- exactly what a
    twin-less NVFP4 cache holds; the staged cache's CSR reads the mixed semantics (retained rows bf16)."""
    from interop.torch_cache import TorchStaged
    mixed, plain = _kv_states()
    seq = np.array([0, 1], np.int32)
    csr = layouts.csr_to_torch(layouts.flashinfer_csr(np.asarray(mixed.page_table), np.asarray(mixed.kv_lens),
                                                      seq, PAGE), "cpu")
    assert all(t.dtype == torch.int32 for t in csr)
    staged = jax.jit(lambda s: stage(s, 0, seq, backend="reference", validate=False))(mixed)
    st = TorchStaged(to_torch(staged.pages), to_torch(staged.page_table), to_torch(staged.kv_lens))
    scsr = st.flashinfer_csr()
    pages = layouts.nvfp4_pages(mixed.pools[0].low, 0)
    history = np.asarray(_stage(plain, 0, seq).astype(jnp.float32))            # twin-less NVFP4 reading
    mixed_view = np.asarray(_stage(mixed, 0, seq).astype(jnp.float32))         # the mixed reading
    for b, n in enumerate((45, 17)):
        ids = csr.kv_indices[csr.kv_indptr[b]:csr.kv_indptr[b + 1]].long()
        got = _torch_decode_page_rows(pages.k_data[ids], pages.k_scales[ids], pages.k_scale)
        got = got.permute(1, 0, 2, 3).reshape(2, -1, 32)[:, :n].float().numpy()
        np.testing.assert_array_equal(got, history[b, 0, :, :n])
        assert not np.array_equal(got, mixed_view[b, 0, :, :n])               # the retained rows differ
        sids = scsr.kv_indices[scsr.kv_indptr[b]:scsr.kv_indptr[b + 1]].long()
        srows = st.k_pages[sids].permute(1, 0, 2, 3).reshape(2, -1, 32)[:, :n].float().numpy()
        np.testing.assert_array_equal(srows, mixed_view[b, 0, :, :n])


def test_block_table_padding_value():
    table, lens = layouts.block_table(TABLE, LENS, [0, 1, 2, -1], PAGE, pad=0)
    np.testing.assert_array_equal(table, [[7, 2, 9, 0], [0, 0, 0, 0], [4, 0, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(lens, [45, 0, 1, 0])
    for bad in (-2, 1.5, True, "0"):
        with pytest.raises(ValueError, match="pad must be"):
            layouts.block_table(TABLE, LENS, [0], PAGE, pad=bad)


def test_csr_to_torch_and_to_device():
    csr = layouts.flashinfer_csr(TABLE, LENS, [0, 1, 4], PAGE)
    t = layouts.csr_to_torch(csr, "cpu")
    assert isinstance(t, layouts.FlashInferCSR)
    for a, b in zip(csr, t):
        assert b.dtype == torch.int32 and b.device.type == "cpu" and b.tolist() == a.tolist()
    assert layouts.to_device(np.array([1, 2], np.int64), "cpu").dtype == torch.int32


def test_exports_say_rotated_and_following_them_gives_the_plain_attention():
    """A rotated cache's NVFP4 pages carry ``kv_transform`` (rotated, Hadamard); a consumer that follows it (rotate
    q, un-rotate the output) gets the plain attention back up to NVFP4 error; one that ignores it does not."""
    from interop.dlpack import nvfp4_to_torch
    from jmixedkv import levers
    spec = GroupSpec(num_layers=1, num_kv_heads=1, head_dim=32)
    rng = np.random.default_rng(7)
    t = 24
    k = jnp.asarray(rng.standard_normal((t, 1, 32)) * 0.5, jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((t, 1, 32)), jnp.bfloat16)
    seq, pos = jnp.zeros((t,), jnp.int32), jnp.arange(t, dtype=jnp.int32)
    cfg = KVCacheConfig("nvfp4", page_size=PAGE, rotation="hadamard")
    state = append(admit(init_state(cfg, spec, num_pages=4, max_seqs=1), 0), 0, k, v, seq, pos, backend="reference")
    assert int(state.error) == 0
    pages = layouts.nvfp4_pages(state.pools[0].low, 0, config=cfg)
    assert pages.kv_transform == {"rotated": True, "rotation": "hadamard", "k_smoothing": False,
                                  "block_scale": "max6"}
    ids = torch.as_tensor(np.array(state.page_table)[0, :2]).long()
    rows = lambda d, s, g: _torch_decode_page_rows(d[ids], s[ids], g)[:, 0].reshape(-1, 32)[:t].double()  # noqa
    kr, vr = rows(pages.k_data, pages.k_scales, pages.k_scale), rows(pages.v_data, pages.v_scales, pages.v_scale)
    h = torch.as_tensor(np.array(levers.hadamard(32)), dtype=torch.float64)
    q = torch.as_tensor(rng.standard_normal((5, 32)))
    attend = lambda q, k, v: torch.softmax(q @ k.T / 32 ** 0.5, -1) @ v  # noqa: E731
    exact = attend(q, *(torch.as_tensor(np.asarray(x, np.float64)[:, 0]) for x in (k, v)))
    rel = lambda a: float(torch.linalg.norm(a - exact) / torch.linalg.norm(exact))  # noqa: E731
    assert rel(attend(q @ h, kr, vr) @ h) < 0.15 < 0.5 < rel(attend(q, kr, vr))
    # every other exporter / config states it too; nothing stated without a config
    assert layouts.nvfp4_pages(state.pools[0].low, 0).kv_transform is None
    plain = layouts.nvfp4_pages(state.pools[0].low, 0, config=KVCacheConfig("nvfp4", k_smoothing=True,
                                                                            block_scale="4over6"))
    assert plain.kv_transform == {"rotated": False, "rotation": None, "k_smoothing": True, "block_scale": "4over6"}
    low = state.pools[0].low
    out = nvfp4_to_torch(low.data, low.scales, low.gs, config=cfg)
    assert out.kv_transform["rotated"] and out.data.data_ptr() == low.data.unsafe_buffer_pointer()
