"""`jmixedkv.staging.stage` and the Pallas staging kernel vs `jmixedkv.staging.stage_reference` (bit-exact),
the staged layout / FlashInfer export, host validation, the paged attention reference, CUDA cross-lowering,
and (``-m gpu``) the kernel on the GPU."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from helpers import assert_bits_equal, check_kernel, poisoned_state

from jmixedkv import decode, staging
from jmixedkv.compat import cross_lower_cuda, on_gpu
from jmixedkv.config import KVCacheConfig
from jmixedkv.staging import stage_reference
from jmixedkv.state import GroupSpec, init_state
from pallas_kernels.stage import column_chunks, stage_pages

CFG = KVCacheConfig("mixed_nvfp4_bf16", first_n=5, last_n=7, page_size=8, max_draft_len=2)
SPEC = GroupSpec(num_layers=2, num_kv_heads=2, head_dim=32)
S, W, P = 4, 6, 24
EDGE_LENGTHS = [0, 1, 7, 8, 9, 12, 16, 17, 40, 48]

build = functools.partial(poisoned_state, decode_steps=3, num_seqs=S, width=W, num_pages=P)


def _stage_dense(state, seqs, *, layer, backend):
    """``(rows [L', B, kv, H, S, D], page_table)`` staged by `staging.stage` (``L' = 1`` for one layer)."""
    staged = staging.stage(state, layer, seqs, backend=backend)
    if layer is not None:
        return staged.to_dense()[None], staged.page_table
    return jnp.stack([staged.to_dense(i) for i in range(state.groups[0].num_layers)]), staged.page_table


def _stage_expected(state, seqs, *, layer):
    """What `_stage_dense` must give: `stage_reference` per layer, and compact staged page ids in batch order
    (row b holds ``ceil(n_b / page)`` consecutive ids after those of rows < b; -1 past them)."""
    layers = range(state.groups[0].num_layers) if layer is None else [layer]
    npages = -(-jnp.where(seqs >= 0, state.kv_lens[seqs], 0) // state.page_size)
    j = jnp.arange(state.max_pages_per_seq)[None, :]
    table = jnp.where(j < npages[:, None], (jnp.cumsum(npages) - npages)[:, None] + j, -1)
    return jnp.stack([stage_reference(state, l, seqs) for l in layers]), table.astype(jnp.int32)


def check_stage(state, seqs, layer, backend="pallas"):
    """`staging.stage` (jitted, run twice) vs `stage_reference`, bit for bit. Returns (rows, page_table)."""
    got, _ = check_kernel(_stage_dense, _stage_expected, (state, jnp.asarray(seqs, jnp.int32)),
                          kernel_kw=dict(layer=layer, backend=backend), reference_kw=dict(layer=layer),
                          msg=f"stage layer={layer} backend={backend}")
    return got


@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
@given(lengths=st.lists(st.sampled_from(EDGE_LENGTHS), min_size=S, max_size=S), seed=st.integers(0, 2**16),
       perm_seed=st.integers(0, 2**16))
def test_stage_matches_reference(lengths, seed, perm_seed):
    state = build(CFG, SPEC, lengths, seed=seed)
    rng = np.random.default_rng(perm_seed)
    seqs = np.concatenate([rng.permutation(S)[:3], [-1]]).astype(np.int32)
    check_stage(state, seqs, layer=int(rng.integers(0, SPEC.num_layers)))


@pytest.mark.parametrize("dtype", ["mixed_nvfp4_fp8", "nvfp4"])
def test_stage_other_dtypes(dtype):
    kw = {} if dtype == "nvfp4" else dict(first_n=9, last_n=4, max_draft_len=1)
    cfg = KVCacheConfig(dtype, page_size=8, **kw)
    state = build(cfg, SPEC, [17, 0, 9, 33], seed=3, decode_steps=0)
    check_stage(state, np.array([0, 2, 3], np.int32), layer=1)


def test_stage_all_layers_and_reference_backend():
    state = build(CFG, SPEC, [9, 40, 1, 16], seed=5)
    seqs = np.array([3, 1, 0, 2], np.int32)
    check_stage(state, seqs, layer=None)
    check_stage(state, seqs, layer=None, backend="reference")
    staged, ref = (staging.stage(state, None, seqs, backend=b) for b in ("pallas", "reference"))
    assert staged.pages.shape == (2, 4 * W, 2, 2, 8, 32)
    table = np.asarray(ref.page_table)
    for l in range(2):
        assert_bits_equal(np.asarray(staged.pages[l])[table[table >= 0]], np.asarray(ref.pages[l])[table[table >= 0]])


def test_stage_mla_latent_576():
    cfg = KVCacheConfig("mixed_nvfp4_bf16", first_n=3, last_n=5, page_size=8)
    spec = GroupSpec(num_layers=1, num_kv_heads=1, head_dim=576, kv_factor=1)
    assert column_chunks(576) == [(0, 512), (512, 64)]
    state = build(cfg, spec, [20, 3, 0, 9], seed=7, num_seqs=4, width=3, num_pages=12, decode_steps=0)
    check_stage(state, np.array([0, 1, 3, -1], np.int32), layer=0)


def test_flashinfer_export_and_nhd():
    state = build(CFG, SPEC, [9, 0, 17, 8], seed=11)
    staged = staging.stage(state, 0, np.array([0, 1, 2, 3], np.int32), backend="reference")
    csr = staged.flashinfer_csr()
    dev = next(iter(staged.pages.devices()))
    assert all(isinstance(x, jax.Array) and x.dtype == jnp.int32 and x.devices() == {dev} for x in csr)
    for x, y in zip(csr, staged.flashinfer_csr(as_numpy=True)):
        assert isinstance(y, np.ndarray) and y.dtype == np.int32
        np.testing.assert_array_equal(np.asarray(x), y)
    indptr, indices, last = map(np.asarray, csr)
    np.testing.assert_array_equal(indptr, [0, 2, 2, 5, 6])
    np.testing.assert_array_equal(indices, np.arange(6))
    np.testing.assert_array_equal(last, [1, 0, 1, 8])
    dense = np.asarray(staged.to_dense())
    nhd = np.asarray(staged.pages).swapaxes(-3, -2)                    # [N, kv, page, H, D]
    # row 3 of sequence 2's second page, head 1, V
    np.testing.assert_array_equal(nhd[indices[indptr[2] + 1], 1, 3, 1], dense[2, 1, 1, 8 + 3])


def test_paged_attention_reference_vs_jax():
    state = build(CFG, SPEC, [9, 40, 1, 23], seed=13)
    seqs = np.array([1, 3, 0, 2], np.int32)
    staged = staging.stage(state, 1, seqs, backend="reference")
    rng = np.random.default_rng(0)
    hq = 4
    q = jnp.asarray(rng.normal(size=(4, 1, hq, 32)), jnp.float32)
    out, _ = decode.paged_attention_reference(q, staged)
    dense = staged.to_dense().astype(jnp.float32)                    # [B, kv, H, S, D]
    k = jnp.transpose(dense[:, 0], (0, 2, 1, 3))
    v = jnp.transpose(dense[:, 1], (0, 2, 1, 3))
    want = jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=staged.kv_lens, implementation="xla")
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_validation_errors():
    state = build(CFG, SPEC, [9, 0, 17, 8], seed=17)
    with pytest.raises(ValueError, match=r"seq_slots\[1\]=4 out of range"):
        staging.stage(state, 0, np.array([0, 4], np.int32))
    with pytest.raises(ValueError, match="layer=2 out of range"):
        staging.stage(state, 2, np.array([0], np.int32))
    bad = state.page_table.at[2, 1].set(-1)
    import dataclasses
    with pytest.raises(ValueError, match=r"sequence slot 2.*page_table\[2, 1\]=-1 not allocated"):
        staging.stage(dataclasses.replace(state, page_table=bad), 0, np.array([0, 2], np.int32))
    bad = state.page_table.at[0, 0].set(P + 3)
    with pytest.raises(ValueError, match=rf"page_table\[0, 0\]={P + 3} out of range"):
        staging.stage(dataclasses.replace(state, page_table=bad), 0, np.array([0], np.int32))
    bad = state.high_table.at[3, 2].set(999)
    with pytest.raises(ValueError, match=r"high_table\[3, 2\]=999 out of range"):
        staging.stage(dataclasses.replace(state, high_table=bad), 0, np.array([3], np.int32))
    with pytest.raises(ValueError, match="kv_len=49 out of range"):
        staging.stage(state, 0, np.array([0], np.int32), kv_lens=jnp.array([49, 0, 0, 0], jnp.int32))

    @jax.jit
    def traced(state, seqs):     # inside jit nothing is checked; -1 page entries are skipped
        return staging.stage(state, 0, seqs, backend="pallas").page_table
    traced(dataclasses.replace(state, page_table=state.page_table.at[2, 1].set(-1)), jnp.array([2, 0], jnp.int32))
    with pytest.raises(ValueError, match="validate=True needs concrete"):
        jax.jit(lambda s, q: staging.stage(s, 0, q, validate=True).pages)(state, jnp.array([0], jnp.int32))


def _kernel_args(state, seqs, layers):
    pools = state.pools[0]
    lens = state.kv_lens
    table = staging.staged_page_table(lens[jnp.asarray(seqs)], state.max_pages_per_seq, state.page_size)
    return (jnp.asarray(layers, jnp.int32), jnp.asarray(seqs, jnp.int32), lens, state.page_table, state.high_table,
            table, pools.low.data, pools.low.scales, pools.low.gs, pools.high.rows, pools.high.scale)


@pytest.mark.parametrize("head_dim,kv", [(32, 2), (576, 1)])
def test_stage_kernel_cross_lowers_for_cuda(head_dim, kv):
    spec = GroupSpec(num_layers=2, num_kv_heads=2, head_dim=head_dim, kv_factor=kv)
    state = init_state(CFG, spec, num_pages=8, max_seqs=2, max_pages_per_seq=4)
    geom = CFG.twin
    for layers in ([1], [0, 1]):
        text = cross_lower_cuda(lambda *a: stage_pages(*a[:6], low=a[6:9], high=a[9:], geom=geom,
                                                       num_staged_pages=8, out_dtype=jnp.bfloat16, interpret=False),
                                *_kernel_args(state, [0, 1], layers))
        assert "triton" in text.lower() or "__gpu$xla.gpu.triton" in text


@pytest.mark.gpu
@pytest.mark.skipif(not on_gpu(), reason="needs a GPU")
def test_stage_on_gpu_bitexact():
    cfg = KVCacheConfig("mixed_nvfp4_bf16", first_n=20, last_n=37, page_size=16, max_draft_len=3)
    spec = GroupSpec(num_layers=2, num_kv_heads=4, head_dim=128)
    lengths = [0, 1, 15, 16, 17, 100, 257, 512]
    state = build(cfg, spec, lengths, seed=1, num_seqs=8, width=32, num_pages=8 * 32)
    seqs = np.array([7, 3, -1, 0, 5, 6, 1, 2], np.int32)
    check_stage(state, seqs, layer=1)
    check_stage(state, seqs, layer=None)
    for dtype in ("mixed_nvfp4_fp8", "nvfp4"):
        kw = {} if dtype == "nvfp4" else dict(first_n=20, last_n=37, max_draft_len=3)
        c2 = KVCacheConfig(dtype, page_size=16, **kw)
        check_stage(build(c2, spec, lengths, seed=2, num_seqs=8, width=32, num_pages=256), seqs, layer=0)
    mla = GroupSpec(num_layers=1, num_kv_heads=1, head_dim=576, kv_factor=1)
    check_stage(build(cfg, mla, lengths, seed=3, num_seqs=8, width=32, num_pages=256), seqs, layer=0)


def test_stage_does_not_retrace_when_lengths_or_tables_change():
    traces = []

    @jax.jit
    def staged(state, seqs):
        traces.append(1)
        return staging.stage(state, 0, seqs, backend="pallas").pages

    a = build(CFG, SPEC, [9, 0, 17, 8], seed=21, decode_steps=0)
    b = build(CFG, SPEC, [40, 3, 1, 16], seed=22, decode_steps=0)
    staged(a, jnp.array([0, 2], jnp.int32))
    staged(b, jnp.array([3, -1], jnp.int32))
    assert len(traces) == 1
