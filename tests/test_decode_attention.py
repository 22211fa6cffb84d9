"""Fused paged decode attention (`pallas_kernels.decode_attention`, `jmixedkv.attention`) against float32
`attention_reference` over `stage_reference` (the cache a reader must see).

States are built with `init_state(poison=True)` + `admit` + one ragged `append` (reference backend), so every row
past a sequence's length decodes to NaN: a kernel that reads one shows. Kernels run in interpret mode on CPU,
are cross-lowered for CUDA, and run for real under the ``gpu`` marker.

Error metric: relative L2 of the kernel's output against the float32 reference rounded to the output dtype
(< 1e-3), plus the float32-output kernel against the unrounded reference (< 1e-4) and LSE (abs < 1e-4).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmixedkv as jm
from jmixedkv.attention import decode_attention, merge_attention
from jmixedkv.compat import cross_lower_cuda, on_gpu
from pallas_kernels.decode_attention import default_num_splits, merge_partials, paged_decode_attention

_append = jax.jit(jm.append, static_argnames=("group", "rope", "backend"))
_admit = jax.jit(jm.admit)


def rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@functools.lru_cache(maxsize=None)
def make_state(dtype="mixed_nvfp4_bf16", first_n=5, last_n=7, page=16, lens=(1, 15, 16, 17, 70), heads=2, d=64,
               layers=2, max_draft_len=2, gs=0.05, seed=0, permute=True):
    """A poisoned cache holding ``len(lens)`` sequences of random (outlier-laden) K/V, pages in permuted order."""
    cfg = jm.KVCacheConfig(dtype, first_n=first_n, last_n=last_n, page_size=page, max_draft_len=max_draft_len)
    spec = jm.GroupSpec(num_layers=layers, num_kv_heads=heads, head_dim=d)
    num_pages = sum(-(-n // page) for n in lens) + 2
    order = np.random.default_rng(seed).permutation(num_pages).astype(np.int32) if permute else None
    high_order = None
    if permute and cfg.num_high_pages_per_seq:
        high_order = np.random.default_rng(seed + 1).permutation(len(lens) * cfg.num_high_pages_per_seq)
    st = jm.init_state(cfg, spec, num_pages=num_pages, max_seqs=len(lens), max_pages_per_seq=-(-max(lens) // page),
                       poison=True, gs=gs, high_scale=0.02, page_order=order, high_page_order=high_order)
    for s in range(len(lens)):
        st = _admit(st, s)
    seq = np.concatenate([np.full(n, s) for s, n in enumerate(lens)]).astype(np.int32)
    pos = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
    key = jax.random.PRNGKey(seed)
    kk, kv, ko = jax.random.split(key, 3)
    shape = (layers, len(seq), heads, d)
    k = jax.random.normal(kk, shape) * 2.0
    k = k + 20.0 * (jax.random.uniform(ko, shape) < 0.01)          # outliers: spread logits and block scales
    v = jax.random.normal(kv, shape)
    att = cfg.attention_dtype
    st = _append(st, k.astype(att), v.astype(att), seq, pos, backend="reference")
    assert int(st.error) == 0
    return st


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap"))
def reference(st, layer, q, seq, sm_scale=None, sliding_window=None, soft_cap=None):
    """float32 attention over the staged cache (float32 staging for NVFP4 groups: the exact decoded values); query rows that see no key (position < 0 when Tq > n) give zeros
    and LSE -inf, as the kernel (the raw reference gives NaN there: softmax over nothing)."""
    exact = st.kinds[0] != "plain"      # NVFP4 / twin values are read exactly by the kernel (never rounded)
    staged = jm.stage_reference(st, layer, seq, dtype=jnp.float32 if exact else None)
    out, lse = jm.attention_reference(q, staged[:, 0], staged[:, 1], st.kv_lens[seq], sm_scale=sm_scale,
                                      sliding_window=sliding_window, soft_cap=soft_cap)
    ok = lse > -jnp.inf
    return jnp.where(ok[..., None], out, 0.0), jnp.where(ok, lse, -jnp.inf)


def queries(st, tq, hq, seed=1):
    d = st.groups[0].head_dim
    return (jax.random.normal(jax.random.PRNGKey(seed), (st.max_seqs, tq, hq, d)) * 1.5).astype(
        st.config.attention_dtype)


def check(st, tq, hq, layer=1, num_splits=None, **kw):
    q = queries(st, tq, hq)
    seq = jnp.arange(st.max_seqs, dtype=jnp.int32)
    out, lse = decode_attention(st, layer, q, seq, num_splits=num_splits, backend="pallas", **kw)
    ref_o, ref_lse = reference(st, layer, q, seq, **kw)
    assert out.dtype == st.config.attention_dtype and out.shape == q.shape and lse.shape == q.shape[:3]
    assert np.isfinite(np.asarray(out, np.float32)).all()
    err = rel_l2(np.asarray(out, np.float32), np.asarray(ref_o.astype(out.dtype), np.float32))
    assert err < 1e-3, err
    assert rel_l2(np.asarray(out, np.float32), ref_o) < 4e-3          # bf16 rounding bound vs float32
    np.testing.assert_allclose(lse, ref_lse, atol=1e-4, rtol=1e-5)
    return q, out, lse


# ------------------------------------------------------------------------------------------ interpret mode
def test_mixed_lengths_overlapping_windows_gqa4_split():
    """Lengths 1, page-1, page, page+1, long; first-N/last-N windows overlap for short rows; split-K."""
    st = make_state()
    check(st, tq=1, hq=8, num_splits=2)


def test_causal_verify_gqa8_window_softcap():
    st = make_state(lens=(3, 17, 40), max_draft_len=2)
    check(st, tq=3, hq=16, num_splits=1, sliding_window=20, soft_cap=5.0)


def test_fp8_twin_gqa1_all_high():
    """mixed_nvfp4_fp8 twin (scale 0.02); first_n + last_n >= n for every row: all reads come from the twin."""
    st = make_state("mixed_nvfp4_fp8", first_n=24, last_n=16, lens=(1, 16, 33), d=32)
    check(st, tq=1, hq=2)


def test_all_low_nvfp4():
    st = make_state("nvfp4", first_n=0, last_n=0, lens=(5, 31, 33), page=32)
    check(st, tq=2, hq=4, num_splits=2)


def test_plain_bf16_pages_d128():
    st = make_state("bf16", first_n=0, last_n=0, lens=(1, 9, 20), page=8, d=128, heads=1, max_draft_len=0)
    check(st, tq=1, hq=4)


def test_plain_fp8_pages():
    """Plain FP8 pool (scale 0.02), read as f32(e4m3) * scale in the bf16 compute dtype."""
    st = make_state("fp8", first_n=0, last_n=0, lens=(3, 16, 21), page=16, d=32, heads=1, max_draft_len=1)
    check(st, tq=2, hq=2, num_splits=2)


def test_tq_longer_than_sequence_small_blocks_poisoned_splits():
    """GPU failure repro: Tq = 3 > n = 1 (query rows with no key: the raw reference gives NaN there). 16-token
    blocks and 3 splits: each split holds head / tail edge blocks (twin overlay, NaN-poisoned rows past n,
    poisoned twin rows outside the retained set) and interior blocks run the unmasked fast loop; with a
    sliding window the interior shrinks to one block. float32 output against the float32 reference."""
    st = make_state(lens=(1, 17, 70, 150), first_n=5, last_n=20, max_draft_len=2)
    q = queries(st, 3, 4)
    seq = jnp.arange(st.max_seqs, dtype=jnp.int32)
    cfg, pools = st.config, st.pools[0]
    for kw in (dict(), dict(sliding_window=40, soft_cap=8.0)):
        ref_o, ref_lse = reference(st, 1, q, seq, **kw)
        assert np.isfinite(np.asarray(ref_o)).all()
        out, lse = paged_decode_attention(
            q, st.page_table, st.kv_lens, 1, pools.low, pools.high, None, st.high_table, first_n=cfg.first_n,
            last_n=cfg.last_n, num_fixed=cfg.num_fixed_pages, num_ring=cfg.num_ring_pages, num_splits=3,
            block_k=16, interpret=True, out_dtype=jnp.float32, **kw)
        assert np.isfinite(np.asarray(out)).all()
        assert rel_l2(out, ref_o) < 1e-4, kw
        np.testing.assert_allclose(lse, ref_lse, atol=1e-4, rtol=1e-5)
        assert (np.asarray(out[0, :2]) == 0).all() and np.isneginf(np.asarray(lse[0, :2])).all()


def test_float32_output_three_splits():
    """Kernel arithmetic itself (float32 output, 3 uneven splits) is ~1e-5 from the float32 reference."""
    st = make_state()
    q = queries(st, 1, 8)
    seq = jnp.arange(st.max_seqs, dtype=jnp.int32)
    ref_o, ref_lse = reference(st, 0, q, seq)
    cfg, pools = st.config, st.pools[0]
    out, lse = paged_decode_attention(
        q, st.page_table, st.kv_lens, 0, pools.low, pools.high, None, st.high_table, first_n=cfg.first_n,
        last_n=cfg.last_n, num_fixed=cfg.num_fixed_pages, num_ring=cfg.num_ring_pages, num_splits=3,
        interpret=True, out_dtype=jnp.float32)
    assert rel_l2(out, ref_o) < 1e-4
    np.testing.assert_allclose(lse, ref_lse, atol=1e-4, rtol=1e-5)


def test_padding_rows_and_reference_backend():
    """seq_slots -1 rows give zeros / -inf; the reference backend agrees with the kernel elsewhere."""
    st = make_state()
    q = queries(st, 1, 8)
    seq = jnp.array([2, -1, 4, 0, 1], jnp.int32)
    out, lse = decode_attention(st, 1, q, seq, backend="pallas", num_splits=2)  # same compile as the first test
    r_out, r_lse = decode_attention(st, 1, q, seq, backend="reference")
    assert (np.asarray(out[1], np.float32) == 0).all() and np.isneginf(np.asarray(lse[1])).all()
    assert (np.asarray(r_out[1], np.float32) == 0).all() and np.isneginf(np.asarray(r_lse[1])).all()
    assert rel_l2(np.asarray(out, np.float32), np.asarray(r_out, np.float32)) < 1e-3


def test_merge_attention_equals_whole():
    """Attention over keys [0, a) merged with keys [a, n) equals attention over [0, n)."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 1, 4, 32)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(2, 2, 24, 32)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(2, 2, 24, 32)), jnp.float32)
    lens = jnp.array([24, 24], jnp.int32)
    whole_o, whole_l = jm.attention_reference(q, k, v, lens)
    o1, l1 = jm.attention_reference(q, k[:, :, :10], v[:, :, :10], jnp.array([10, 10]) * 0 + 24 - 14)
    # second half: keys 10..23, all visible to the query at position 23
    o2, l2 = jm.attention_reference(q, k[:, :, 10:], v[:, :, 10:], jnp.array([14, 14]))
    o, l = merge_attention(o1, l1, o2, l2)
    np.testing.assert_allclose(o, whole_o, atol=1e-5)
    np.testing.assert_allclose(l, whole_l, atol=1e-5)
    # an empty side (lse -inf) is the identity
    o, l = merge_attention(whole_o, whole_l, jnp.zeros_like(whole_o), jnp.full_like(whole_l, -jnp.inf))
    np.testing.assert_allclose(o, whole_o, atol=1e-6)
    np.testing.assert_allclose(l, whole_l)
    o, l = merge_partials(jnp.zeros((2, 3, 4)), jnp.full((2, 3), -1e30), jnp.zeros((2, 3)))
    assert (np.asarray(o) == 0).all() and np.isneginf(np.asarray(l)).all()


def test_validation_errors():
    st = make_state()
    q = queries(st, 1, 8)
    seq = jnp.arange(st.max_seqs, dtype=jnp.int32)
    with pytest.raises(ValueError, match="Hq=7"):
        decode_attention(st, 0, q[:, :, :7], seq)
    with pytest.raises(ValueError, match="Tq=4"):
        decode_attention(st, 0, queries(st, 4, 8), seq)
    with pytest.raises(ValueError, match="head_dim 32"):
        decode_attention(st, 0, q[..., :32], seq)
    with pytest.raises(ValueError, match="dtype float32"):
        decode_attention(st, 0, q.astype(jnp.float32), seq)
    with pytest.raises(ValueError, match="seq_slots"):
        decode_attention(st, 0, q, seq[:2])
    with pytest.raises(ValueError, match="layer=5"):
        decode_attention(st, 5, q, seq)
    with pytest.raises(ValueError, match="sliding_window"):
        decode_attention(st, 0, q, seq, sliding_window=0)
    with pytest.raises(ValueError, match="soft_cap"):
        decode_attention(st, 0, q, seq, soft_cap=-1.0)
    with pytest.raises(ValueError, match="num_splits"):
        decode_attention(st, 0, q, seq, num_splits=0)
    with pytest.raises(ValueError, match="backend"):
        decode_attention(st, 0, q, seq, backend="cuda")
    with pytest.raises(ValueError, match="exactly one"):
        paged_decode_attention(q, st.page_table, st.kv_lens)
    with pytest.raises(ValueError, match="block_k=0"):
        paged_decode_attention(q, st.page_table, st.kv_lens, 0, st.pools[0].low, block_k=0)
    assert default_num_splits(16, 8, 4096) == 8 and default_num_splits(64, 8, 4096) == 2
    assert default_num_splits(1, 8, 3) == 3


# ------------------------------------------------------------------------------------------ CUDA cross-lowering
# every kernel variant the bench sweeps (block_k, num_warps, num_stages, precise, keys_major, dequant) lowers for CUDA
TUNINGS = [dict(block_k=64), dict(block_k=128, num_stages=3), dict(block_k=256, num_warps=8, num_stages=3),
           dict(block_k=128, num_warps=8, num_stages=4, precise=True), dict(block_k=64, num_warps=2, keys_major=True),
           dict(block_k=64, num_warps=1, dequant="jnp")]


@pytest.mark.parametrize("tuning", TUNINGS, ids=lambda t: "-".join(f"{k}{v}" for k, v in t.items()))
@pytest.mark.parametrize("variant", ["mixed_bf16", "mixed_fp8_verify", "nvfp4", "plain"])
def test_cross_lowers_for_cuda(variant, tuning):
    L, P, kv, H, page, D, B = 2, 16, 2, 2, 16, 128, 2
    low = (jnp.zeros((L, P, kv, H, page, D // 2), jnp.uint8),
           jnp.zeros((L, P, kv, H, page, D // 16), jnp.float8_e4m3fn), jnp.ones((L, kv)))
    hd = jnp.float8_e4m3fn if variant == "mixed_fp8_verify" else jnp.bfloat16
    high = (jnp.zeros((L, 8, kv, H, page, D), hd), jnp.ones((L, kv)))
    tq = 3 if variant == "mixed_fp8_verify" else 1
    q = jnp.zeros((B, tq, 8, D), jnp.bfloat16)
    pt, lens, ht = jnp.zeros((B, 8), jnp.int32), jnp.ones((B,), jnp.int32), jnp.zeros((B, 4), jnp.int32)
    kw = dict(first_n=5, last_n=7, num_fixed=1, num_ring=3, num_splits=2, **tuning)
    if variant.startswith("mixed"):
        extra = dict(sliding_window=64, soft_cap=30.0) if tq > 1 else {}
        fn = lambda q, pt, lens, ht, low, high: paged_decode_attention(  # noqa: E731
            q, pt, lens, 1, low, high, None, ht, **kw, **extra)
        text = cross_lower_cuda(fn, q, pt, lens, ht, low, high)
    elif variant == "nvfp4":
        fn = lambda q, pt, lens, low: paged_decode_attention(q, pt, lens, 0, low, num_splits=2, **tuning)  # noqa
        text = cross_lower_cuda(fn, q, pt, lens, low)
    else:
        fn = lambda q, pt, lens, plain: paged_decode_attention(q, pt, lens, 0, None, None, plain, **tuning)  # noqa
        text = cross_lower_cuda(fn, q, pt, lens, high)
    assert "triton" in text.lower()


# ------------------------------------------------------------------------------------------ GPU (H200)
gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("dtype,tq,hq,d,page", [
    ("mixed_nvfp4_bf16", 1, 32, 128, 16),
    ("mixed_nvfp4_bf16", 3, 64, 128, 32),
    ("mixed_nvfp4_fp8", 1, 16, 256, 64),
    ("mixed_nvfp4_fp16", 2, 8, 64, 128),
    ("nvfp4", 1, 32, 128, 16),
    ("bf16", 1, 32, 128, 16),
])
def test_gpu_matches_reference(dtype, tq, hq, d, page):
    assert on_gpu(), "gpu tests need a GPU"
    mixed = dtype.startswith("mixed")
    lens = (1, page - 1, page, page + 1, 200, 1000, 3000, 4096)
    st = make_state(dtype, first_n=64 if mixed else 0, last_n=64 if mixed else 0, page=page, lens=lens,
                    heads=8, d=d, layers=2, max_draft_len=3, gs=0.01)
    check(st, tq=tq, hq=hq)
    check(st, tq=tq, hq=hq, num_splits=8)
    if tq > 1:
        check(st, tq=tq, hq=hq, sliding_window=500, soft_cap=30.0)
