"""`interop.vllm` (vLLM's contiguous ``[2, num_blocks, block_size, H, D]`` cache of the staged pages and its block
table), the one block-table padding default, and the write side's slot mapping and its inverse."""
from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from helpers import poisoned_state

from interop import layouts, vllm
from interop.dlpack import to_torch
from interop.torch_cache import TorchKVCache, TorchStaged
from jmixedkv import GroupSpec, decode, staging
from jmixedkv.config import KVCacheConfig

CFG = KVCacheConfig("mixed_nvfp4_bf16", first_n=3, last_n=5, page_size=8)
SPEC = GroupSpec(num_layers=1, num_kv_heads=2, head_dim=32)
LENGTHS = [5, 17, 40, 0]


def _ref_paged_attn(q, kv_cache, block_tables, seq_lens, scale):
    """A vLLM-test-style torch reader: for each sequence, gather its blocks of ``kv_cache [2, N, page, H, D]`` by
    ``block_tables`` and attend (float32; GQA by repeating K/V heads)."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    page = kv_cache.shape[2]
    for b, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        blocks = block_tables[b, :-(-n // page)].long()
        k = kv_cache[0][blocks].reshape(-1, *kv_cache.shape[3:])[:n].float()       # [n, H, D]
        v = kv_cache[1][blocks].reshape(-1, *kv_cache.shape[3:])[:n].float()
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[b].float(), k) * scale, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", p, v)
    return out


def test_contiguous_vllm_cache_read_like_decode_attention():
    state = poisoned_state(CFG, SPEC, LENGTHS, decode_steps=2, width=6)
    seqs = jnp.array([2, 0, 3, 1], jnp.int32)
    staged = staging.stage(state, 0, seqs)
    kv = jax.jit(vllm.kv_cache)(staged)
    assert kv.shape == (2, staged.pages.shape[0], 8, 2, 32) and kv.dtype == jnp.bfloat16
    kv_t = to_torch(kv)
    assert kv_t.is_contiguous() and kv_t.shape == (2, staged.pages.shape[0], 8, 2, 32)
    table, lens = vllm.block_table(staged)
    np.testing.assert_array_equal(lens, [40, 5, 0, 17])
    assert (np.asarray(table)[2] == layouts.BLOCK_TABLE_PAD).all()
    # every held row is the row a reader must see (stage_reference: twin where retained, NVFP4 elsewhere)
    dense = np.asarray(staging.stage_reference(state, 0, seqs), np.float32)           # [B, kv, H, S, D]
    t, lens_np = np.asarray(table), np.asarray(lens)
    for b, n in enumerate(lens_np):
        for p in range(n):
            got = np.asarray(kv[:, t[b, p // 8], p % 8], np.float32)                 # [2, H, D]
            np.testing.assert_array_equal(got, dense[b, :, :, p], err_msg=f"row {b} position {p}")
    q = jax.random.normal(jax.random.key(0), (4, 1, 4, 32)).astype(jnp.bfloat16)
    want, _ = decode.decode_attention(state, 0, q, seqs, backend="reference")
    got = _ref_paged_attn(torch.from_numpy(np.array(q[:, 0], np.float32)), kv_t, torch.from_numpy(t.copy()),
                          torch.from_numpy(lens_np.copy()), 32 ** -0.5)
    np.testing.assert_allclose(got.numpy(), np.asarray(want[:, 0], np.float32), atol=1e-2, rtol=1e-2)


def test_one_block_table_padding_default():
    defaults = {f.__qualname__: inspect.signature(f).parameters["pad"].default
                for f in (layouts.block_table, vllm.block_table, TorchKVCache.block_table, TorchStaged.block_table)}
    assert set(defaults.values()) == {layouts.BLOCK_TABLE_PAD} == {0}, defaults
    table = np.array([[7, 2, -1], [4, -1, -1]], np.int32)
    got, lens = layouts.block_table(table, np.array([20, 3]), [0, 1, -1], 16)
    np.testing.assert_array_equal(got, [[7, 2, 0], [4, 0, 0], [0, 0, 0]])
    np.testing.assert_array_equal(lens, [20, 3, 0])


def test_kv_cache_bad_input_refused():
    pages = jnp.zeros((2, 3, 1, 2, 8, 32), jnp.bfloat16)
    staged = staging.StagedCache(pages, jnp.zeros((1, 2), jnp.int32), jnp.zeros((1,), jnp.int32))
    with pytest.raises(ValueError, match=r"got shape \(2, 3, 1, 2, 8, 32\); pass layer="):
        vllm.kv_cache(staged)
    with pytest.raises(ValueError, match="kv = 1 .*MLA"):
        vllm.kv_cache(staged, 0)
    with pytest.raises(ValueError, match="pad must be an integer >= -1, got -2"):
        vllm.block_table(staged, pad=-2)


def test_slot_mapping_round_trip_drives_append():
    page_table = np.array([[7, 2, 9, -1], [3, -1, -1, -1], [5, 11, -1, -1]], np.int32)
    seq = np.array([0, 0, 1, -1, 2, 2, 0], np.int32)
    pos = np.array([0, 44, 3, 0, 8, 15, 17], np.int32)
    slots = layouts.slot_mapping(page_table, seq, pos, 16)
    np.testing.assert_array_equal(slots, [7 * 16, 9 * 16 + 12, 3 * 16 + 3, -1, 5 * 16 + 8, 5 * 16 + 15, 2 * 16 + 1])
    got_seq, got_pos = layouts.positions_from_slots(slots, page_table, 16)
    np.testing.assert_array_equal(got_seq, seq)
    np.testing.assert_array_equal(got_pos, np.where(seq >= 0, pos, 0))
    assert got_seq.dtype == got_pos.dtype == np.int32


def test_positions_from_slots_refuses_shared_and_unheld_pages():
    shared = np.array([[7, 2], [7, 4]], np.int32)             # page 7 shared by a fork / prefix: read-only
    with pytest.raises(ValueError, match=r"slot 113 \(token 1\) is in page 7, held by 2 sequences \[0, 1\]"):
        layouts.positions_from_slots([2 * 16, 7 * 16 + 1], shared, 16)
    with pytest.raises(ValueError, match=r"slot 160 \(token 0\) is in page 10, held by 0 sequences"):
        layouts.positions_from_slots([160], shared, 16)
    with pytest.raises(ValueError, match="page_size must be a positive integer"):
        layouts.positions_from_slots([0], shared, 0)


def test_torch_cache_slot_mapping_and_vllm_kv_cache():
    cache = TorchKVCache(CFG, 1, 2, 32, num_pages=12, max_seqs=3, reserve_null_page=True)
    a, b = cache.admit(), cache.admit()
    k, v = (torch.randn(30, 2, 32, generator=torch.Generator().manual_seed(i)) for i in (0, 1))
    seq = torch.tensor([a] * 21 + [b] * 9, dtype=torch.int32)
    pos = torch.cat([torch.arange(21), torch.arange(9)]).to(torch.int32)
    cache.append(0, k, v, seq, pos)
    slots = cache.slot_mapping([a, b, -1, a], [20, 8, 0, 40])
    assert slots.dtype == torch.int64 and slots.device == cache.device
    table = np.asarray(cache.state.page_table)
    np.testing.assert_array_equal(slots.numpy(), [table[a, 2] * 8 + 4, table[b, 1] * 8 + 0, -1, -1])
    assert (slots.numpy()[:2] >= 8).all()                          # page 0 is the reserved null block
    got_seq, got_pos = cache.positions_from_slots(slots[:2])
    np.testing.assert_array_equal(got_seq, [a, b])
    np.testing.assert_array_equal(got_pos, [20, 8])
    with pytest.raises(ValueError, match="seq_slots .* and positions .* must have the same length"):
        cache.slot_mapping([a, b], [0])
    staged = cache.stage(0, [a, b])
    kv = staged.vllm_kv_cache()
    assert kv.is_contiguous() and kv.shape == (2, staged.pages.shape[0], 8, 2, 32)
    want = to_torch(vllm.kv_cache(staging.stage(cache.state, 0, jnp.array([a, b], jnp.int32))))
    torch.testing.assert_close(kv, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="all-layer staging"):
        cache.stage(None, [a]).vllm_kv_cache()
