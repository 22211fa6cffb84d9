"""`jmixedkv.gather.gather_rows` / `overlay_retained_rows` and their Pallas kernels vs `rows_reference`:
bf16 scratch bit-exact, FP8 scratch exact vs the jnp encoding with the same power-of-two scale (itself checked
against a numpy computation), MLA latent 576, host validation, CUDA cross-lowering, and (``-m gpu``) the GPU."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from helpers import assert_bits_equal, check_kernel, poisoned_state

from jmixedkv import gather
from jmixedkv.compat import cross_lower_cuda, on_gpu
from jmixedkv.config import KVCacheConfig
from jmixedkv.gather import rows_reference
from jmixedkv.state import GroupSpec
from pallas_kernels import gather as gk

CFG = KVCacheConfig("mixed_nvfp4_bf16", first_n=5, last_n=7, page_size=8, max_draft_len=2)
SPEC = GroupSpec(num_layers=2, num_kv_heads=2, head_dim=32)
S, W, P = 4, 6, 24
EDGE_LENGTHS = [0, 1, 7, 8, 9, 12, 16, 17, 40, 48]
build = functools.partial(poisoned_state, decode_steps=3, num_seqs=S, width=W, num_pages=P)
_rows_ref = jax.jit(lambda state, layer, seq, idx: rows_reference(state, layer, seq[:, None], idx))


def topk(rng, lengths, seqs, k, first_n, last_n):
    """Random top-k sets per batch row mixing first-N, last-N, middle positions and -1 padding (unsorted)."""
    out = np.full((len(seqs), k), -1, np.int32)
    for b, s in enumerate(seqs):
        n = lengths[s] if s >= 0 else 0
        if n == 0:
            continue
        pools = [np.arange(min(first_n, n)), np.arange(max(n - last_n, 0), n), np.arange(n)]
        picks = [rng.choice(p) for p in pools if p.size for _ in range(k // 4)]
        picks = np.unique(picks)[: k - k // 4]              # a quarter stays padding
        out[b, : picks.size] = picks
        rng.shuffle(out[b])
    return out


def scale_numpy(state, layer, seqs, idx):
    """Independent FP8 scale: smallest 2^e >= max(6 * s * gs) / 448 over the selected rows' blocks."""
    low = state.pools[0].low
    sc = np.asarray(low.scales[layer].astype(jnp.float32))
    gs = np.asarray(low.gs[layer])
    pt, lens, page = np.asarray(state.page_table), np.asarray(state.kv_lens), state.page_size
    out = []
    for b, s in enumerate(seqs):
        ceil = 0.0
        for p in idx[b]:
            if s < 0 or p < 0 or p >= lens[s]:
                continue
            blk = sc[pt[s, p // page], :, :, p % page] * 6.0 * gs[:, None, None]
            ceil = max(ceil, float(np.nanmax(np.where(np.isnan(blk), 0, blk))))
        out.append(1.0 if ceil == 0 else 2.0 ** np.ceil(np.log2(np.float32(ceil) / np.float32(448.0))))
    return np.array(out, np.float32)


def _gather(state, layer, seqs, idx, *, backend, fp8, overlay=True):
    return gather.gather_rows(state, layer, seqs, idx, backend=backend, scratch_dtype=fp8, overlay=overlay)


def _overlay(state, layer, scratch, seqs, idx, scale, *, backend):
    return gather.overlay_retained_rows(state, layer, scratch, seqs, idx, scale=scale, backend=backend)


def check_gather(state, seqs, idx, layer):
    """Both backends of `gather_rows` (one step, and gather without the twin followed by `overlay_retained_rows`),
    jitted and run twice, vs `rows_reference`: the bf16 scratch bit for bit, the FP8 scratch as the jnp encoding
    with the numpy scale. Returns the reference rows."""
    args = (state, layer, jnp.asarray(seqs), jnp.asarray(idx))
    rows = _rows_ref(*args)
    scale = scale_numpy(state, layer, seqs, idx)
    want = {None: (rows, np.ones(len(seqs), np.float32)), "fp8": (gather.encode_fp8_scratch(rows, scale), scale)}
    for fp8 in (None, "fp8"):
        (bare, sc), _ = check_kernel(_gather, _gather, args, kernel_kw=dict(backend="pallas", fp8=fp8, overlay=False),
                                     reference_kw=dict(backend="reference", fp8=fp8, overlay=False),
                                     msg=f"gather without the twin, {fp8}")
        for backend in ("pallas", "reference"):
            check_kernel(_gather, want[fp8], args, kernel_kw=dict(backend=backend, fp8=fp8),
                         msg=f"gather {backend} {fp8}")
            check_kernel(_overlay, want[fp8][0], (state, layer, bare, args[2], args[3], sc),
                         kernel_kw=dict(backend=backend), msg=f"overlay {backend} {fp8}")
    return rows


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(lengths=st.lists(st.sampled_from(EDGE_LENGTHS), min_size=S, max_size=S), seed=st.integers(0, 2**16))
def test_gather_matches_reference(lengths, seed):
    state = build(CFG, SPEC, lengths, seed=seed)
    rng = np.random.default_rng(seed)
    seqs = np.concatenate([rng.permutation(S)[:3], [-1]]).astype(np.int32)
    idx = topk(rng, lengths, seqs, 16, CFG.first_n, CFG.last_n)
    got = check_gather(state, seqs, idx, layer=int(rng.integers(0, 2)))
    assert not np.isnan(np.asarray(got, np.float32)).any()          # poisoned rows never read


def test_gather_ragged_k_and_fp8_twin():
    cfg = KVCacheConfig("mixed_nvfp4_fp8", first_n=9, last_n=4, page_size=8, max_draft_len=1)
    lengths = [17, 0, 40, 3]
    state = build(cfg, SPEC, lengths, seed=4, decode_steps=0)
    seqs = np.array([2, 0, 1, 3, -1], np.int32)
    idx = topk(np.random.default_rng(1), lengths, seqs, 20, cfg.first_n, cfg.last_n)   # K=20: padded to 32 inside
    check_gather(state, seqs, idx, layer=1)


def test_gather_mla_latent_576():
    cfg = KVCacheConfig("mixed_nvfp4_bf16", first_n=3, last_n=5, page_size=8)
    spec = GroupSpec(num_layers=1, num_kv_heads=1, head_dim=576, kv_factor=1)
    lengths = [20, 3, 0, 9]
    state = build(cfg, spec, lengths, seed=7, num_seqs=4, width=3, num_pages=12, decode_steps=0)
    seqs = np.array([0, 3, 1, 2], np.int32)
    idx = topk(np.random.default_rng(2), lengths, seqs, 16, 3, 5)
    check_gather(state, seqs, idx, layer=0)


def test_gather_validation():
    lengths = [9, 0, 17, 8]
    state = build(CFG, SPEC, lengths, seed=9, decode_steps=0)
    seqs = np.array([0, 2], np.int32)
    idx = np.array([[0, 8, -1], [16, 3, 17]], np.int32)
    with pytest.raises(ValueError, match=r"indices\[1, 2\]=17 out of range \[-1, 17\) for sequence slot 2"):
        gather.gather_rows(state, 0, seqs, idx)
    with pytest.raises(ValueError, match=r"indices\[0, 0\]=-2"):
        gather.gather_rows(state, 0, seqs, np.array([[-2, 0, 0], [0, 0, 0]], np.int32))
    with pytest.raises(ValueError, match=r"indices must be integer \[B=2, K\]"):
        gather.gather_rows(state, 0, seqs, np.zeros((3, 2), np.int32))
    bad = dataclasses.replace(state, page_table=state.page_table.at[0, 1].set(-1))
    with pytest.raises(ValueError, match=r"page_table\[0, 1\]=-1 not allocated"):
        gather.gather_rows(bad, 0, seqs, idx[:, :2])
    with pytest.raises(ValueError, match="scratch_dtype"):
        gather.gather_rows(state, 0, seqs, idx[:, :2], scratch_dtype="int8")
    with pytest.raises(ValueError, match="needs scale="):
        gather.overlay_retained_rows(state, 0, jnp.zeros((2, 2, 2, 2, 32), jnp.float8_e4m3fn), seqs, idx[:, :2])
    # inside jit: no host checks; an index outside [-1, kv_len) is flagged: a NaN row (jmixedkv.checks), both
    # backends alike, the other rows exactly the reference's
    for backend in ("pallas", "reference"):
        traced = jax.jit(lambda st_, q, i: gather.gather_rows(st_, 0, q, i, backend=backend)[0])
        got = traced(state, jnp.asarray(seqs), jnp.asarray(idx))
        want = _rows_ref(state, 0, jnp.asarray(seqs), jnp.asarray(idx))
        want = want.at[1, 2].set(jnp.nan)                                     # idx[1, 2] = 17 = kv_len of slot 2
        assert_bits_equal(got, want)


def _args(state, d_seqs=2, k=32):
    pools = state.pools[0]
    seqs = jnp.arange(d_seqs, dtype=jnp.int32)
    idx = jnp.zeros((d_seqs, k), jnp.int32)
    return seqs, idx, pools


@pytest.mark.parametrize("head_dim,kv,fp8", [(128, 2, False), (128, 2, True), (576, 1, True)])
def test_gather_kernels_cross_lower_for_cuda(head_dim, kv, fp8):
    from jmixedkv.state import init_state
    spec = GroupSpec(num_layers=1, num_kv_heads=2, head_dim=head_dim, kv_factor=kv)
    state = init_state(CFG, spec, num_pages=8, max_seqs=2, max_pages_per_seq=4)
    geom = CFG.twin
    seqs, idx, pools = _args(state)
    lay, scale = jnp.zeros((1,), jnp.int32), jnp.ones((2,), jnp.float32)
    text = cross_lower_cuda(
        lambda *a: gk.gather_rows(*a[:7], low=a[7:10], high=a[10:], geom=geom, att_dtype=jnp.bfloat16, fp8=fp8,
                                  interpret=False),
        lay, seqs, state.kv_lens, state.page_table, state.high_table, idx, scale, pools.low.data, pools.low.scales,
        pools.low.gs, pools.high.rows, pools.high.scale)
    assert "triton" in text.lower()
    scratch = jnp.zeros((2, 32, kv, 2, head_dim), jnp.float8_e4m3fn if fp8 else jnp.bfloat16)
    text = cross_lower_cuda(
        lambda *a: gk.overlay_rows(*a[:8], high=a[8:], geom=geom, att_dtype=jnp.bfloat16, interpret=False),
        scratch, lay, seqs, state.kv_lens, state.page_table, state.high_table, idx, scale, pools.high.rows,
        pools.high.scale)
    assert "triton" in text.lower()


@pytest.mark.gpu
@pytest.mark.skipif(not on_gpu(), reason="needs a GPU")
def test_gather_on_gpu_bitexact():
    cfg = KVCacheConfig("mixed_nvfp4_bf16", first_n=20, last_n=37, page_size=16, max_draft_len=3)
    lengths = [0, 1, 15, 16, 17, 100, 257, 512]
    seqs = np.array([7, 3, -1, 0, 5, 6, 1, 2], np.int32)
    for spec in (GroupSpec(num_layers=2, num_kv_heads=4, head_dim=128),
                 GroupSpec(num_layers=1, num_kv_heads=1, head_dim=576, kv_factor=1)):
        state = build(cfg, spec, lengths, seed=1, num_seqs=8, width=32, num_pages=256)
        for k in (16, 64, 100):
            idx = topk(np.random.default_rng(k), lengths, seqs, k, cfg.first_n, cfg.last_n)
            check_gather(state, seqs, idx, layer=0)
