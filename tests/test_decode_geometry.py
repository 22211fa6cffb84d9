"""Fused decode attention at every model geometry: head_dim 64 / 128 / 256 x GQA group 1, 2, 3, 4, 7, 8 (the
non-power-of-two groups of SmolLM2 and Qwen2.5 included), against float32 `attention_reference` over the staged
cache (`helpers.decode_reference`), on NaN-poisoned caches (`helpers.decode_state`: every row past a sequence's length
decodes to NaN).

CPU (interpret mode, tiny caches): the Triton kernel through the public `decode_attention` at every group at head_dim
64 and groups 1 / 3 / 7 / 8 at 128 and 256, the Mosaic GPU kernel (interpreter) at head_dim 128 with groups 3 and 7,
which backend the entry point picks for each geometry, the refusal of a `MosaicConfig` where its kernel does not
apply, and the per-head_dim Triton defaults.
GPU (``gpu`` marker, H200): model-shaped caches (8 KV heads, 9 sequences up to 4096 tokens, batch x heads on the wide
grid) through the default backend and the Triton kernel at every head_dim x group.

Error metric: relative L2 of the output against the float32 reference rounded to the attention dtype (< 1e-3),
against float32 (< 4e-3), the LSE within 1e-4.
"""
import jax.numpy as jnp
import numpy as np
import pytest

from jmixedkv.compat import on_gpu
from jmixedkv.decode import decode_attention
from jmixedkv.pools import kernel_arrays
from pallas_kernels import decode as entry
from pallas_kernels.decode import MosaicConfig, TritonConfig, mosaic_sm90, triton as tk
from pallas_kernels.decode.common import num_sms
from pallas_kernels.decode.config import LARGE_HEAD_TUNING, SMALL_HEAD_TUNING, WIDE_GRID_TUNING, triton_tuning
from helpers import decode_queries as queries, decode_reference as reference, decode_state as make_state, rel_l2

HEAD_DIMS = (64, 128, 256)
GROUPS = (1, 2, 3, 4, 7, 8)


def _raw(st):
    """``(low, high, high_table, geom)`` raw kernel arguments of a mixed cache's group 0."""
    pools = st.pools[0]
    return kernel_arrays(pools.low), kernel_arrays(pools.high), st.high_table, st.config.twin


def _check(out, lse, st, layer, q, seq, tol=1e-3):
    """``out`` / ``lse`` of a kernel against the float32 reference: relative L2 < ``tol`` against the reference
    rounded to the attention dtype, < 4e-3 against float32; LSE within 1e-4 (-inf where no key is visible)."""
    ref_o, ref_lse = reference(st, layer, q, seq)
    out32 = np.asarray(out, np.float32)
    assert out.shape == q.shape and lse.shape == q.shape[:3] and np.isfinite(out32).all()
    rounded = np.asarray(jnp.asarray(ref_o).astype(st.config.attention_dtype), np.float32)
    assert rel_l2(out32, rounded) < tol, rel_l2(out32, rounded)
    assert rel_l2(out32, ref_o) < 4e-3
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=1e-4, rtol=1e-5)


# ------------------------------------------------------------------------------------------ interpret mode
#: interpret mode is slow: every group at head_dim 64, the odd groups and the ends at 128 / 256 (the GPU tests run
#: the whole product)
CPU_GEOMETRIES = [(64, g) for g in GROUPS] + [(d, g) for d in (128, 256) for g in (1, 3, 7, 8)]


@pytest.mark.parametrize("d,group", CPU_GEOMETRIES)
def test_triton_every_head_dim_and_group(d, group):
    """`decode_attention` (the Triton kernel: interpret mode) at head_dim ``d`` x GQA ``group``: lengths 1, page + 1
    and 40 (NaN-poisoned rows past each), retained first-N / last-N windows from the twin, 2 splits; Tq 2 for the odd
    groups (causal verify rows of a non-power-of-two group: ``Tq * G`` rows padded to 16)."""
    st = make_state(lens=(1, 17, 40), d=d, heads=1, first_n=5, last_n=7)
    tq = 2 if group in (3, 7) else 1
    q = queries(st, tq, group)
    seq = jnp.arange(st.max_seqs, dtype=jnp.int32)
    out, lse = decode_attention(st, 1, q, seq, backend="pallas", num_splits=2)
    _check(out, lse, st, 1, q, seq)


@pytest.mark.parametrize("group", (3, 7))
def test_mosaic_interpret_odd_groups(group):
    """The Mosaic GPU kernel (interpreter) at head_dim 128 with GQA 3 and 7 (keys on M, ``G`` query rows padded to
    wgmma's N = 8), 2 splits, against the float32 reference (float32 output: < 1e-4)."""
    st = make_state(lens=(1, 17, 150), first_n=5, last_n=20, d=128, heads=2, max_draft_len=2)
    q = queries(st, 1, 2 * group)
    seq = jnp.arange(st.max_seqs, dtype=jnp.int32)
    low, high, ht, geom = _raw(st)
    out, lse = entry.paged_decode_attention(q, st.page_table, st.kv_lens, 1, low, high, None, ht, geom=geom,
                                            interpret=True, out_dtype=jnp.float32,
                                            config=MosaicConfig(num_splits=2))
    ref_o, ref_lse = reference(st, 1, q, seq)
    assert rel_l2(out, ref_o) < 1e-4
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_backend_choice_every_group(d, monkeypatch):
    """Where the Mosaic GPU kernel may run (``JMIXEDKV_DECODE_KERNEL=mgpu``: wherever it is supported), it covers
    head_dim 128 at every group and Tq with ``Tq * G <= 64``, head_dim 64 (token pairs) with ``2 Tq * G <= 64``,
    head_dim 256 (two column blocks, keys on M only) with ``Tq * G <= 32``."""
    if not mosaic_sm90.available():
        pytest.fail("jax.experimental.pallas.mosaic_gpu does not import: the backend choice cannot be checked")
    monkeypatch.setenv(entry.KERNEL_ENV, "mgpu")
    for group in GROUPS:
        for tq in (1, 2, 4, 8):
            rows = {128: tq * group, 64: 2 * tq * group, 256: tq * group}[d]
            want = "mosaic" if rows <= (32 if d == 256 else 64) else "triton"
            got = entry.choose_backend(head_dim=d, page=16, tq=tq, group=group, high_dtype=jnp.bfloat16)
            assert got == want, (d, group, tq, got)
    monkeypatch.setenv(entry.KERNEL_ENV, "auto")
    assert entry.choose_backend(head_dim=d, page=16, tq=1, group=3, interpret=True) == "triton"


@pytest.mark.parametrize("d,tq", [(32, 1), (256, 5)])
def test_mosaic_config_refused_by_name_outside_its_head_dim(d, tq):
    """A `MosaicConfig` at head_dim 32, or at head_dim 256 with more than 32 query rows per KV head (Tq 5 x GQA 8), is
    refused with the geometry named (the entry point without a config picks the Triton kernel there instead)."""
    st = make_state(lens=(1, 17), d=d, heads=2, max_draft_len=tq)
    q = queries(st, tq, 16 if d == 256 else 6)
    low, high, ht, geom = _raw(st)
    with pytest.raises(ValueError, match=f"'head_dim': {d}"):
        entry.paged_decode_attention(q, st.page_table, st.kv_lens, 0, low, high, None, ht, geom=geom,
                                     interpret=True, config=MosaicConfig())


def test_triton_defaults_per_head_dim():
    """`triton_tuning`: NVFP4 pages at head_dim 64 on the wide grid with <= 8 real query rows of 16 take
    `SMALL_HEAD_TUNING` at pages up to 64, at head_dim 256 `LARGE_HEAD_TUNING` at pages of 16; head_dim 128 keeps
    the rules measured at 128."""
    wide_b = -(-(num_sms() // 2) // 8)
    small, wide, large = (tuple(t[k] for k in ("block_k", "num_warps", "per_sm"))
                          for t in (SMALL_HEAD_TUNING, WIDE_GRID_TUNING, LARGE_HEAD_TUNING))
    for page in (16, 32, 64):
        for rows in (1, 3, 7, 8):
            assert triton_tuning("nvfp4", wide_b, 8, page, 16, rows, head_dim=64) == small
    assert triton_tuning("nvfp4", wide_b, 8, 128, 16, 4, head_dim=64) != small           # pages of 128
    assert triton_tuning("nvfp4", wide_b - 1, 8, 16, 16, 4, head_dim=64) != small        # narrow grid
    assert triton_tuning("nvfp4", wide_b, 8, 16, 16, 16, head_dim=64) != small           # 16 real rows
    assert triton_tuning("nvfp4", wide_b, 8, 16, 32, 32, head_dim=64) != small           # 32 query rows
    assert triton_tuning("plain", wide_b, 8, 16, 16, 4, head_dim=64) != small
    assert triton_tuning("nvfp4", wide_b, 8, 16, 16, 4, head_dim=128) == wide
    assert triton_tuning("nvfp4", wide_b, 8, 64, 16, 4, head_dim=128) != small
    assert triton_tuning("nvfp4", wide_b, 8, 16, 16, 4) == wide                          # head_dim 128 by default
    for rows in (1, 4, 8):                             # head_dim 256: 64-token steps, four warps at pages of 16
        assert triton_tuning("nvfp4", wide_b, 8, 16, 16, rows, head_dim=256) == large
    assert triton_tuning("nvfp4", wide_b, 8, 32, 16, 4, head_dim=256) == wide            # pages of 32: not measured
    assert triton_tuning("nvfp4", wide_b, 8, 16, 16, 16, head_dim=256) != large          # 16 real rows
    assert triton_tuning("nvfp4", wide_b - 1, 8, 16, 16, 4, head_dim=256) != large       # narrow grid


# ------------------------------------------------------------------------------------------ GPU (H200)
gpu = pytest.mark.gpu
GPU_LENS = (1, 15, 16, 17, 200, 1000, 3000, 4096, 2049)      # 9 x 8 KV heads >= SMs / 2: the wide grid


@gpu
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_gpu_every_group_default_and_triton(d):
    """Model-shaped cache (8 KV heads, 9 sequences up to 4096 tokens, page 16, first_n = last_n = 64, 2 layers) at
    head_dim ``d``: for every GQA group, the default backend (`decode_attention`: the Mosaic GPU kernel at head_dim
    64 and 128, the Triton kernel at 256) and the Triton kernel with its defaults, Tq 1 and (Tq 2 at the odd groups)
    causal verify rows, against the float32 reference."""
    assert on_gpu(), "gpu tests need a GPU"
    st = make_state(first_n=64, last_n=64, page=16, lens=GPU_LENS, heads=8, d=d, layers=2, max_draft_len=3,
                    gs=0.01)
    seq = jnp.arange(st.max_seqs, dtype=jnp.int32)
    low, high, ht, geom = _raw(st)
    for group in GROUPS:
        for tq in ((1, 2) if group in (3, 7) else (1,)):
            q = queries(st, tq, 8 * group)
            out, lse = decode_attention(st, 1, q, seq, backend="pallas")
            _check(out, lse, st, 1, q, seq)
            out, lse = tk.paged_decode_attention(q, st.page_table, st.kv_lens, 1, low, high, None, ht, geom=geom,
                                                 config=TritonConfig())
            _check(out, lse, st, 1, q, seq)


@gpu
@pytest.mark.parametrize("d,page,tq,group", [(64, 64, 1, 4), (64, 128, 1, 3), (64, 16, 4, 4), (64, 32, 8, 2),
                                             (256, 16, 4, 2), (256, 64, 1, 8)])
def test_gpu_pages_and_verify_rows(d, page, tq, group):
    """The page and Tq axes at head_dim 64 / 256 (`SMALL_HEAD_TUNING` up to pages of 64), the default backend against
    the float32 reference, split-K by default and by 8."""
    assert on_gpu(), "gpu tests need a GPU"
    st = make_state(first_n=64, last_n=64, page=page, lens=GPU_LENS, heads=8, d=d, layers=2, max_draft_len=7,
                    gs=0.01)
    seq = jnp.arange(st.max_seqs, dtype=jnp.int32)
    q = queries(st, tq, 8 * group)
    for splits in (None, 8):
        out, lse = decode_attention(st, 1, q, seq, backend="pallas", num_splits=splits)
        _check(out, lse, st, 1, q, seq)
