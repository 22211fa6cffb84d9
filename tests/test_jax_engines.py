"""`interop.jax_engines`: the staged cache handed to JAX's own Pallas paged attention kernels (the TPU kernel in TPU
interpret mode, the Triton GPU kernel in interpret mode; ``-m gpu``: compiled on the GPU) and a MaxText-style page
state, each checked against `jmixedkv.decode.decode_attention`."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.gpu import paged_attention as gpu_paged
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_paged_attention

from helpers import poisoned_state

from interop import jax_engines
from jmixedkv import GroupSpec, decode, staging
from jmixedkv.compat import on_gpu
from jmixedkv.config import KVCacheConfig

CFG = KVCacheConfig("mixed_nvfp4_bf16", first_n=3, last_n=5, page_size=8)
SPEC = GroupSpec(num_layers=2, num_kv_heads=2, head_dim=32)
LENGTHS = [5, 17, 40, 1]
HQ = 4


@functools.lru_cache(maxsize=None)
def _case():
    """(state, seq_slots, q [B, 1, Hq, D], decode_attention's (out, lse) for layer 1) over rows 2, 0, 3, 1, -1."""
    state = poisoned_state(CFG, SPEC, LENGTHS, decode_steps=2, width=6)
    seqs = jnp.array([2, 0, 3, 1, -1], jnp.int32)
    q = jax.random.normal(jax.random.key(1), (5, 1, HQ, SPEC.head_dim)).astype(jnp.bfloat16)
    out, lse = decode.decode_attention(state, 1, q, seqs, backend="reference")
    return state, seqs, q, out


def _tpu(q, k_pages, v_pages, lengths, page_indices, pages_per_compute_block):
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        return tpu_paged_attention(q, k_pages, v_pages, lengths, page_indices,
                                   pages_per_compute_block=pages_per_compute_block)


def _close(got, want, rows):
    """The kernels' dots run at bf16 input precision (TPU interpret mode emulates the MXU's default precision), so a
    bf16-level tolerance; a wrong page, row or K/V swap is off by O(1)."""
    got, want = np.asarray(got, np.float32)[rows], np.asarray(want, np.float32)[rows, 0]
    np.testing.assert_allclose(got, want, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("pages_per_compute_block, reserve", [(1, False), (4, True)])
def test_tpu_paged_attention_on_the_staged_cache(pages_per_compute_block, reserve):
    state, seqs, q, want = _case()
    staged = staging.stage(state, None, seqs)
    x = jax.jit(jax_engines.paged_attention_inputs, static_argnames=("layer", "pages_per_compute_block",
                                                                     "reserve_page_zero"))(
        staged, layer=1, pages_per_compute_block=pages_per_compute_block, reserve_page_zero=reserve)
    assert x.k_pages.shape == (2, staged.pages.shape[1] + reserve, 8, 32) and x.k_pages.dtype == jnp.bfloat16
    assert x.page_indices.shape == (5, 8 if pages_per_compute_block == 4 else 6)
    np.testing.assert_array_equal(x.lengths, [40, 5, 1, 17, 0])
    rows = [0, 1, 2, 3]                                      # the TPU kernel leaves empty rows unwritten
    got = _tpu(jax_engines.decode_query(q[:4]), x.k_pages, x.v_pages, x.lengths[:4], x.page_indices[:4],
               pages_per_compute_block)
    _close(got, want, rows)


def test_maxtext_page_state_drives_the_kernel_and_points_at_the_last_token():
    state, seqs, q, want = _case()
    staged = staging.stage(state, 1, seqs)
    for reserve in (False, True):
        x = jax_engines.paged_attention_inputs(staged, reserve_page_zero=reserve)
        ps = jax.jit(jax_engines.page_state, static_argnames="reserve_page_zero")(staged, reserve_page_zero=reserve)
        np.testing.assert_array_equal(ps.sequence_lengths, [40, 5, 1, 17, 0])
        np.testing.assert_array_equal(ps.num_pages_used, [5, 1, 1, 3, 0])
        np.testing.assert_array_equal(ps.has_active_page, [True, True, True, True, False])
        np.testing.assert_array_equal(ps.active_page_position, [7, 4, 0, 0, 0])
        # page_status marks exactly the pages the rows hold (and MaxText's reserved page 0)
        held = {int(p) for b in range(5) for p in np.asarray(ps.page_map)[b, :int(ps.num_pages_used[b])]}
        np.testing.assert_array_equal(np.flatnonzero(np.asarray(ps.page_status)), sorted(held | ({0} if reserve
                                                                                                   else set())))
        assert not reserve or 0 not in held
        # the active page / position hold token n - 1, as the staged dense rows say
        dense = np.asarray(staged.to_dense(), np.float32)                 # [B, kv, H, S, D]
        for b, n in enumerate([40, 5, 1, 17]):
            np.testing.assert_array_equal(
                np.asarray(x.k_pages[:, ps.active_page[b], ps.active_page_position[b]], np.float32),
                dense[b, 0, :, n - 1])
            np.testing.assert_array_equal(
                np.asarray(x.v_pages[:, ps.active_page[b], ps.active_page_position[b]], np.float32),
                dense[b, 1, :, n - 1])
        # MaxText's decode call: paged_attention(q, key_pages, value_pages, sequence_lengths, page_map)
        got = _tpu(jax_engines.decode_query(q[:4]), x.k_pages, x.v_pages, ps.sequence_lengths[:4],
                   ps.page_map[:4], 2)
        _close(got, want, [0, 1, 2, 3])


def test_gpu_paged_attention_kernel_in_interpret_mode():
    state, seqs, q, want = _case()
    x = jax_engines.paged_attention_inputs(staging.stage(state, 1, seqs), pages_per_compute_block=4)
    got = gpu_paged.paged_attention(jax_engines.decode_query(q), x.k_pages, x.v_pages, x.page_indices, x.lengths,
                                    block_h=16, pages_per_compute_block=2, k_splits=2, interpret=True)
    _close(got, want, [0, 1, 2, 3, 4])                        # the padding row: zeros on both sides


@pytest.mark.gpu
@pytest.mark.skipif(not on_gpu(), reason="needs a GPU (run with -m gpu on the GPU image)")
def test_gpu_paged_attention_kernel_compiled():
    state, seqs, q, want = _case()
    x = jax_engines.paged_attention_inputs(staging.stage(state, 1, seqs), pages_per_compute_block=4)
    got = gpu_paged.paged_attention(jax_engines.decode_query(q), x.k_pages, x.v_pages, x.page_indices, x.lengths,
                                    block_h=16, pages_per_compute_block=2, k_splits=2)
    _close(got, want, [0, 1, 2, 3, 4])


def test_bad_arguments_refused():
    state, seqs, q, _ = _case()
    staged = staging.stage(state, None, seqs)
    with pytest.raises(ValueError, match=r"got shape \(2, 30, 2, 2, 8, 32\); pass layer="):
        jax_engines.paged_attention_inputs(staged)
    with pytest.raises(ValueError, match="pages_per_compute_block must be an int >= 1, got 0"):
        jax_engines.paged_attention_inputs(staged, 0, pages_per_compute_block=0)
    with pytest.raises(ValueError, match=r"one token per sequence\), got shape \(5, 2, 4, 32\)"):
        jax_engines.decode_query(jnp.concatenate([q, q], axis=1))
