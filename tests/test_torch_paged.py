"""The torch references of the hot path (`interop.torch_nvfp4`, `interop.torch_paged`) against the JAX references:

* the NVFP4 codec bit-exact with `jmixedkv.nvfp4.quantize_reference` / `dequantize_reference` (random data of
  several scales, per-row and scalar global scales, tiny / huge ones, both block scales, bf16 / fp16 / f32 input,
  and hand-built edge blocks: zeros, -0, NaN, ±inf, E2M1 and E4M3 ties, E4M3 subnormal and saturated scales);
* the FP8 row codec bit-exact with `jmixedkv.numerics`; the Hadamard matrix bit-exact, the rotation to f32 rounding;
* the slot helpers equal to `jmixedkv.layout.low_slots` and `jmixedkv.state.write_slots`' twin slots;
* `write_rows_reference_` bit-exact with `jmixedkv.write.write_rows_reference` on poisoned pools of every cache
  kind (slots permuted, -1 skips; untouched rows keep their bytes), and refusals that leave the pools unchanged;
* `paged_attention_reference` against `jmixedkv.decode` (float32 staging + `attention_reference`, and
  `decode_attention(backend="reference")`) on states built by `jmixedkv.state.append`.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from helpers import assert_bits_equal, bits, decode_reference, jit_static, outlier_rows, poisoned_state
from interop import torch_nvfp4 as tn
from interop import torch_paged as tp
from jmixedkv import GroupSpec, KVCacheConfig, decode_attention, layout, levers, numerics, nvfp4
from jmixedkv.pools import GroupPools
from jmixedkv.write import write_rows_reference


# ------------------------------------------------------------------------------------------------ conversions
def to_torch(a) -> torch.Tensor:
    """A JAX / NumPy array as a torch tensor (a copy): bf16 and fp8 e4m3 by their bytes (fp8 stays uint8)."""
    a = np.array(a)
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    if a.dtype == ml_dtypes.float8_e4m3fn:
        return torch.from_numpy(a.view(np.uint8))
    return torch.from_numpy(a)


def to_numpy(t: torch.Tensor, like=None) -> np.ndarray:
    """A torch tensor as NumPy; ``like`` (a NumPy dtype) reinterprets 1- / 2-byte data (bf16, fp8 bytes)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    a = t.numpy()
    return a.view(like) if like is not None else a


def torch_pools(gp: GroupPools) -> tp.TorchPools:
    low, high, plain = gp.low, gp.high, gp.plain
    conv = lambda x: None if x is None else to_torch(x)          # noqa: E731
    return tp.TorchPools(conv(low and low.data), conv(low and low.scales), conv(low and low.gs),
                         conv(high and high.rows), conv(high and high.scale),
                         conv(plain and plain.rows), conv(plain and plain.scale))


def stored_index(kind: str) -> int:
    """`TorchPools` field index of the pool every write of ``kind`` stores into."""
    return tp.TorchPools._fields.index("plain_rows" if kind == "plain" else "low_data")


def assert_pools_equal(got: tp.TorchPools, want: GroupPools, msg: str) -> None:
    """Every pool leaf of ``got`` (torch) bit-identical to ``want`` (JAX)."""
    want_t = torch_pools(want)
    for name, g, w in zip(tp.TorchPools._fields, got, want_t):
        assert (g is None) == (w is None), f"{msg}: {name} presence"
        if g is not None:
            assert_bits_equal(to_numpy(g), to_numpy(w), f"{msg}: {name}")


# ------------------------------------------------------------------------------------------------ the codec
def _codec_pair(x, gs, block_scale):
    """(torch bytes, JAX bytes) of quantize + dequantize of ``x`` (f32 / bf16 / fp16 NumPy) with ``gs``."""
    tx = to_torch(x)
    tg = gs if isinstance(gs, float) else to_torch(gs)
    packed, scales = tn.quantize(tx, tg, block_scale)
    jp, js = jit_static(nvfp4.quantize_reference, block_scale=block_scale)(jnp.asarray(x), jnp.asarray(gs, jnp.float32))
    assert_bits_equal(packed.numpy(), np.asarray(jp), f"packed {block_scale}")
    assert_bits_equal(scales.numpy(), np.asarray(js).view(np.uint8), f"scales {block_scale}")
    for dtype, jdtype in ((torch.float32, jnp.float32), (torch.bfloat16, jnp.bfloat16)):
        got = tn.dequantize(packed, scales, tg, dtype)
        want = jit_static(nvfp4.dequantize_reference, dtype=jdtype)(jp, js, jnp.asarray(gs, jnp.float32))
        assert_bits_equal(to_numpy(got), np.asarray(want), f"dequantize {block_scale} {dtype}")
    return packed, scales


@pytest.mark.parametrize("block_scale", ["max6", "4over6"])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
def test_codec_random_bit_exact(block_scale, dtype):
    rng = np.random.default_rng(0)
    for scale in (1e-4, 0.3, 7.0, 2e3):
        x = (rng.normal(size=(16, 4, 64)) * scale * rng.uniform(0.2, 5, (16, 4, 1))).astype(dtype)
        _codec_pair(x, rng.uniform(0.001, 0.2, (16, 4)).astype(np.float32), block_scale)      # per-row gs
        _codec_pair(x, float(np.float32(scale / 2688)), block_scale)                          # calibrated scalar


def test_codec_scale_order_sensitive_blocks():
    """Blocks whose scale byte depends on the op order: ``(1/gs) * (amax * f32(1/6))`` and the reassociated
    ``amax * ((1/gs) * f32(1/6))`` (what XLA's scalar hoisting would compute) round to different E4M3 bytes."""
    rng = np.random.default_rng(8)
    e4m3 = np.arange(8, 0x7E, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    mids = ((e4m3[1:] + e4m3[:-1]) / 2)[rng.integers(0, e4m3.size - 1, 4096)]       # E4M3 ties
    gs = rng.uniform(0.001, 0.1, 4096).astype(np.float32)
    enc = np.float32(1) / gs
    near = (mids / (enc.astype(np.float64) * float(numerics.SIXTH))).astype(np.float32)    # amax whose scale ~ tie
    amax = (near[None] + np.arange(-6, 7, dtype=np.float32)[:, None] * np.spacing(near)[None]).reshape(-1)
    gs, enc = np.tile(gs, 13), np.tile(enc, 13)
    e4m3 = lambda v: np.clip(v, 0, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)    # noqa: E731
    pinned, hoisted = e4m3(enc * (amax * numerics.SIXTH)), e4m3(amax * (enc * numerics.SIXTH))
    pick = np.flatnonzero(pinned != hoisted)[:32]
    assert pick.size >= 8, pick.size
    x = np.linspace(-1, 1, 16, dtype=np.float32)[None, :] * amax[pick, None]
    x[:, 3] = amax[pick]                                                         # the block max itself
    packed, scales = _codec_pair(x, gs[pick], "max6")
    assert_bits_equal(scales.numpy()[:, 0], pinned[pick], "the pinned order's scale bytes")


@pytest.mark.parametrize("block_scale", ["max6", "4over6"])
def test_codec_tiny_and_huge_global_scales(block_scale):
    rng = np.random.default_rng(1)
    x = (rng.normal(size=(8, 128)) * np.exp2(rng.integers(-30, 30, (8, 1)))).astype(np.float32)
    for gs in (1e-30, 3e-8, 1.0, 5e7, 1e30):
        _codec_pair(x, float(np.float32(gs)), block_scale)


def _amax_for_scales(targets):
    """Block maxima ``a`` (f32) with ``a * f32(1/6) == t`` exactly for each target ``t`` that has one (with gs = 1
    the pre-cast scale is then exactly ``t``: an E4M3 tie when ``t`` is a midpoint)."""
    out = []
    for t in targets:
        a = np.float32(t * 6)
        for step in range(-4, 5):
            c = np.float32(a + step * np.spacing(a))
            if np.float32(c * numerics.SIXTH) == t:
                out.append(c)
                break
    assert len(out) >= len(targets) // 2, "E4M3 ties: too few exact block maxima"
    return out


@pytest.mark.parametrize("block_scale", ["max6", "4over6"])
def test_codec_edge_blocks_bit_exact(block_scale):
    e2m1_ties = np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])       # amax 6, gs 1: s = 1, r = 1
    e4m3 = np.arange(0, 0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    mids = ((e4m3[1:].astype(np.float64) + e4m3[:-1]) / 2).astype(np.float32)   # E4M3 ties of amax / 6
    blocks = [
        np.zeros(16, np.float32),
        -np.zeros(16, np.float32),
        np.concatenate([e2m1_ties, -e2m1_ties]),
        np.concatenate([e2m1_ties * 0.5, -e2m1_ties * 2]),
        np.float32([np.nan] + [1.0] * 15),
        np.float32([2.0] * 15 + [np.inf]),
        np.float32([-np.inf, 3.0] + [-0.1] * 14),
        np.float32([np.inf, -np.inf] + [0.0] * 14),
        np.float32([-0.1, 0.1, -1e-30, 1e-30] * 4),                                  # tiny: subnormal E4M3 scales
        np.float32([1e38, -3e38] + [1.0] * 14),                                      # saturated scale 448
        np.full(16, 1e-42, np.float32),                                              # f32 subnormal block
    ]
    blocks += [np.linspace(-a, a, 16, dtype=np.float32) for a in _amax_for_scales(mids[::5])]
    x = np.stack(blocks)                                                          # [N, 16]: one block per row
    packed, scales = _codec_pair(x, 1.0, block_scale)
    assert int(scales[4]) == 0x7F and not packed[4].any(), "a NaN block: scale 0x7F, zero codes"
    assert packed[1].tolist() == [0x88] * 8, "-0 keeps its sign"
    # the NaN block stays in its block: the same rows with a second block are unchanged there
    two = np.concatenate([x[4:5], x[0:1] + 1.0], axis=-1)
    p2, s2 = tn.quantize(torch.from_numpy(two), 1.0, block_scale)
    assert int(s2[0, 0]) == 0x7F and int(s2[0, 1]) != 0x7F
    _codec_pair(x, float(np.float32(0.013)), block_scale)


def test_codec_refusals():
    x = torch.ones(2, 32)
    with pytest.raises(ValueError, match="multiple of 16"):
        tn.quantize(torch.ones(2, 24))
    with pytest.raises(ValueError, match="block_scale"):
        tn.quantize(x, 1.0, "max4")
    with pytest.raises(ValueError, match=r"finite and > 0, got \[0.0\]"):
        tn.quantize(x, torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="does not broadcast"):
        tn.quantize(x, torch.ones(3))
    with pytest.raises(ValueError, match="scales"):
        tn.dequantize(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8))


# ------------------------------------------------------------------------------------------------ rows, rotation
def test_row_codec_bit_exact():
    rng = np.random.default_rng(2)
    x = (rng.normal(size=(64, 4, 32)) * np.exp2(rng.integers(-12, 12, (64, 1, 1)))).astype(np.float32)
    x[0, 0, :4] = [np.nan, -np.nan, np.inf, -np.inf]
    x[1, 0, :3] = [1e6, -1e6, -0.0]
    scale = np.float32([0.02, 3.0])[None, :, None] * np.ones((1, 2, 1), np.float32)
    for src in (np.float32, ml_dtypes.bfloat16):
        xs = x.reshape(64, 2, 2, 32).astype(src)
        xt = to_torch(xs)
        got = tn.encode_rows(xt, torch.uint8, to_torch(scale))
        want = numerics.encode_rows(jnp.asarray(xs), jnp.float8_e4m3fn, jnp.asarray(scale))
        assert_bits_equal(got.numpy(), np.asarray(want).view(np.uint8), f"fp8 encode from {src}")
        assert tn.encode_rows(xt, torch.float8_e4m3fn, to_torch(scale)).dtype == torch.float8_e4m3fn
        back = tn.decode_rows(got, to_torch(scale), torch.float32)
        want_back = numerics.decode_rows(want, jnp.asarray(scale), jnp.float32)
        assert_bits_equal(back.numpy(), np.asarray(want_back), "fp8 decode")
        for pool, jpool in ((torch.float16, jnp.float16), (torch.bfloat16, jnp.bfloat16)):
            got16 = tn.encode_rows(xt, pool, to_torch(scale))
            assert_bits_equal(to_numpy(got16), np.asarray(numerics.encode_rows(jnp.asarray(xs), jpool, 1.0)),
                              f"{pool} cast from {src}")


def test_hadamard_and_rotate():
    for d in (16, 64, 128):
        assert_bits_equal(tn.hadamard(d).numpy(), np.asarray(levers.hadamard(d)), f"hadamard({d})")
    x = np.random.default_rng(3).normal(size=(5, 3, 128)).astype(ml_dtypes.bfloat16)
    got = tn.rotate(to_torch(x))
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), np.asarray(levers.rotate(jnp.asarray(x), "hadamard")), rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(tn.rotate(got).numpy(), x.astype(np.float32), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="power of two, got 48"):
        tn.hadamard(48)


# ------------------------------------------------------------------------------------------------ slots
def test_slot_helpers_match_layout():
    rng = np.random.default_rng(4)
    for geom in (layout.TwinGeometry.for_window(4, 5, 6, 2), layout.TwinGeometry.for_window(4, 9, 0),
                 layout.TwinGeometry.for_window(8, 0, 3, 1)):
        b, mp, t = 6, 9, 30                         # long runs (prefill) cross more than R pages: dedupe
        pt = rng.integers(-1, 40, (b, mp)).astype(np.int32)
        ht = rng.integers(-1, 30, (b, geom.width)).astype(np.int32)
        start = rng.integers(0, mp * geom.page - 4, b)
        start[:2] = 0
        count = rng.integers(0, t + 1, b)
        pos = np.where(np.arange(t)[None] < count[:, None], start[:, None] + np.arange(t)[None], -1).astype(np.int32)
        seq = np.where(pos >= 0, np.arange(b)[:, None], -1).astype(np.int32).reshape(-1)
        flat = pos.reshape(-1)
        want_low = np.asarray(layout.low_slots(jnp.asarray(pt), seq, flat, geom.page))
        keep = jnp.asarray(geom.write_mask(jnp.asarray(seq), jnp.asarray(flat), b)) & (want_low >= 0)
        want_high = np.asarray(geom.high_slots(jnp.asarray(ht), jnp.asarray(seq), jnp.asarray(flat), write_mask=keep))
        low = tp.low_slots(torch.from_numpy(pt), torch.from_numpy(pos), geom.page)
        high = tp.high_slots(torch.from_numpy(ht), torch.from_numpy(pos), tuple(geom.__dict__.values()), low >= 0)
        np.testing.assert_array_equal(low.numpy().reshape(-1), want_low, err_msg=f"low slots {geom}")
        np.testing.assert_array_equal(high.numpy().reshape(-1), want_high, err_msg=f"high slots {geom}")
        assert (high >= 0).any() and (low >= 0).any() and (low < 0).any()


# ------------------------------------------------------------------------------------------------ write
WRITE_CASES = {             # dtype -> (cache kind, twin / plain fp8)
    "mixed_nvfp4_bf16": ("mixed", False), "mixed_nvfp4_fp8": ("mixed", True), "mixed_nvfp4_fp16": ("mixed", False),
    "nvfp4": ("low", False), "bf16": ("plain", False), "fp8": ("plain", True)}


@functools.lru_cache(maxsize=None)
def _empty_state(dtype):
    mixed = dtype.startswith("mixed")
    cfg = KVCacheConfig(dtype, first_n=5 if mixed else 0, last_n=6 if mixed else 0, page_size=8)
    return poisoned_state(cfg, GroupSpec(num_layers=2, num_kv_heads=2, head_dim=32), [0, 0, 0], num_pages=10,
                          width=10, gs=[np.float32([[0.02, 0.5], [0.004, 0.09]])])


@pytest.mark.parametrize("dtype", list(WRITE_CASES))
@pytest.mark.parametrize("block_scale", ["max6", "4over6"])
def test_write_rows_bit_exact(dtype, block_scale):
    kind, fp8 = WRITE_CASES[dtype]
    st = _empty_state(dtype)
    gp, page = st.pools[0], st.page_size
    rng = np.random.default_rng(5)
    t = 23
    low_slot = rng.permutation(10 * page)[:t].astype(np.int64)
    low_slot[rng.uniform(size=t) < 0.25] = -1
    num_high = gp.high.rows.shape[1] if gp.high is not None else 10        # ignored without a twin
    high_slot = rng.permutation(num_high * page)[:t].astype(np.int64)
    high_slot[rng.uniform(size=t) < 0.3] = -1
    k, v = outlier_rows(rng, (t, 2, 32), st.config.attention_dtype)
    k = k.at[3, 1, :4].set(jnp.nan).at[4, 0, 5].set(jnp.inf)           # non-finite rows stay in their block
    for layer in (1, 0):
        pools = torch_pools(gp)
        tp.write_rows_reference_(*pools, layer, to_torch(k), to_torch(v), torch.from_numpy(low_slot),
                                 torch.from_numpy(high_slot), page, block_scale, fp8)
        want = write_rows_reference(gp, jnp.stack([k, v], axis=-3), layer, jnp.asarray(low_slot, jnp.int32),
                                    jnp.asarray(high_slot, jnp.int32), page, block_scale)
        assert_pools_equal(pools, want, f"{dtype} {block_scale} layer {layer}")
        stored = pools[stored_index(kind)]
        assert not np.array_equal(bits(to_numpy(stored)), bits(to_numpy(torch_pools(gp)[stored_index(kind)]))), \
            "the write stored nothing"


def test_write_rows_refusals_leave_pools_unchanged():
    st = _empty_state("mixed_nvfp4_bf16")
    page = st.page_size
    pools = torch_pools(st.pools[0])
    snapshot = [None if p is None else p.clone() for p in pools]
    k = torch.ones(3, 2, 32, dtype=torch.bfloat16)
    ok_low, ok_high = torch.tensor([0, 5, -1]), torch.tensor([1, -1, 2])
    cases = [
        (dict(low_slot=torch.tensor([0, 80, 1])), r"low_slot\[1\]=80 is outside \[-1, 80\)"),
        (dict(high_slot=torch.tensor([0, -2, 1])), r"high_slot\[1\]=-2"),
        (dict(low_slot=torch.tensor([4, 4, 1])), "repeats slot 4"),
        (dict(layer=2), r"layer must be an int in \[0, 2\), got 2"),
        (dict(high_fp8=True), "high_fp8=True"),
        (dict(page_size=16), "page_size=16"),
        (dict(block_scale="max5"), "block_scale"),
        (dict(v=torch.ones(3, 2, 32, dtype=torch.float16)), "one dtype"),
        (dict(k=torch.ones(3, 2, 48, dtype=torch.bfloat16)), "D=32"),
    ]
    for change, match in cases:
        args = dict(layer=0, k=k, v=k, low_slot=ok_low, high_slot=ok_high, page_size=page, block_scale="max6",
                    high_fp8=False)
        args.update(change)
        with pytest.raises(ValueError, match=match):
            tp.write_rows_reference_(*pools, **args)
        for name, a, b in zip(tp.TorchPools._fields, pools, snapshot):
            assert a is None or np.array_equal(bits(to_numpy(a)), bits(to_numpy(b))), \
                f"{name} changed by a refused write ({match})"
    with pytest.raises(ValueError, match="plain cache has plain_rows only"):
        tp.write_rows_reference_(*pools[:5], pools[3], pools[4], 0, k, k, ok_low, ok_high, page)


# ------------------------------------------------------------------------------------------------ attention
LENS = (0, 1, 15, 16, 17, 70)


@functools.lru_cache(maxsize=None)
def _attn_state(dtype, first_n=5, last_n=7, page=16):
    mixed = dtype.startswith("mixed")
    cfg = KVCacheConfig(dtype, first_n=first_n if mixed else 0, last_n=last_n if mixed else 0, page_size=page,
                        max_draft_len=2)
    return poisoned_state(cfg, GroupSpec(num_layers=2, num_kv_heads=2, head_dim=64), LENS, decode_steps=3,
                          high_scale=0.02, rows=outlier_rows, seed=7)


def _torch_attention(st, q, layer, **kw):
    seq = np.arange(st.max_seqs)
    kind = st.kinds[0]
    geom = st.config.twin
    ht = to_torch(st.high_table)[seq] if kind == "mixed" else None
    return tp.paged_attention_reference(
        to_torch(q), *torch_pools(st.pools[0]), layer, to_torch(st.page_table)[seq], ht,
        to_torch(st.kv_lens)[seq], (geom.page, geom.first_n, geom.last_n, geom.num_fixed, geom.num_ring), **kw)


def _queries(st, tq, hq, seed):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.normal(size=(st.max_seqs, tq, hq, 64)) * 1.5, st.config.attention_dtype)


def _check_attention(st, tq, hq, layer=1, seed=0, **kw):
    q = _queries(st, tq, hq, seed)
    out, lse = _torch_attention(st, q, layer, **kw)
    want_out, want_lse = decode_reference(st, layer, q, jnp.arange(st.max_seqs), **kw)
    want_out, want_lse = np.asarray(want_out), np.asarray(want_lse)
    assert out.dtype == lse.dtype == torch.float32 and out.shape == want_out.shape and lse.shape == want_lse.shape
    np.testing.assert_array_equal(np.isneginf(lse.numpy()), np.isneginf(want_lse), err_msg="rows seeing no key")
    assert np.isfinite(want_lse).any() and np.isfinite(out.numpy()).all(), "a finite answer (no poison read)"
    np.testing.assert_allclose(out.numpy(), want_out, rtol=1e-5, atol=2e-6, err_msg=f"out {kw}")
    np.testing.assert_allclose(lse.numpy(), want_lse, rtol=1e-5, atol=1e-6, err_msg=f"lse {kw}")
    assert (out.numpy()[np.isneginf(want_lse)] == 0).all(), "no key: zeros"
    return q, out, lse


@pytest.mark.parametrize("tq", [1, 3])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_attention_mixed_gqa_verify(tq, group):
    _check_attention(_attn_state("mixed_nvfp4_bf16"), tq, 2 * group)


@pytest.mark.parametrize("dtype", ["mixed_nvfp4_fp8", "nvfp4", "bf16", "fp8"])
def test_attention_every_cache_kind(dtype):
    st = _attn_state(dtype)
    for tq, hq, layer in ((1, 4, 0), (3, 6, 1)):
        _check_attention(st, tq, hq, layer)


@pytest.mark.parametrize("first_n,last_n", [(20, 0), (0, 33)])
def test_attention_twin_windows(first_n, last_n):
    _check_attention(_attn_state("mixed_nvfp4_bf16", first_n, last_n), 3, 4)


def test_attention_twin_rows_are_read():
    """The twin matters: with the high pool's rows replaced by zeros the answer changes (so a reader that ignored
    the twin would fail the comparisons above)."""
    st = _attn_state("mixed_nvfp4_bf16")
    q = _queries(st, 1, 2, 0)
    out, _ = _torch_attention(st, q, 1)
    pools = torch_pools(st.pools[0])
    geom = st.config.twin
    zeroed = pools._replace(high_rows=torch.zeros_like(pools.high_rows))
    out0, _ = tp.paged_attention_reference(to_torch(q), *zeroed, 1, to_torch(st.page_table), to_torch(st.high_table),
                                           to_torch(st.kv_lens), geom)
    changed = (out - out0).abs().amax(dim=(1, 2, 3))
    assert (changed[1:] > 0).all() and changed[0] == 0      # every non-empty row reads retained twin rows


@pytest.mark.parametrize("kw", [dict(sliding_window=20), dict(soft_cap=5.0), dict(sm_scale=0.3, soft_cap=30.0,
                                                                                   sliding_window=3)])
def test_attention_window_and_soft_cap(kw):
    _check_attention(_attn_state("mixed_nvfp4_bf16"), 3, 6, **kw)


def test_attention_matches_decode_attention():
    """End to end against `decode_attention(backend="reference")` (its output rounded to bf16)."""
    st = _attn_state("mixed_nvfp4_bf16")
    q = _queries(st, 3, 4, 1)
    out, lse = _torch_attention(st, q, 1, soft_cap=20.0)
    want_out, want_lse = decode_attention(st, 1, q, jnp.arange(st.max_seqs), soft_cap=20.0, backend="reference")
    np.testing.assert_allclose(lse.numpy(), np.asarray(want_lse), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out.numpy(), np.asarray(want_out, np.float32), rtol=2 ** -8, atol=1e-6)


def test_attention_refusals():
    st = _attn_state("mixed_nvfp4_bf16")
    pools = torch_pools(st.pools[0])
    q = to_torch(_queries(st, 1, 4, 0))
    pt, ht, lens = to_torch(st.page_table), to_torch(st.high_table), to_torch(st.kv_lens)
    geom = st.config.twin
    base = dict(layer=0, page_table=pt, high_table=ht, kv_lens=lens, geom=geom)
    bad_pt = pt.clone()
    bad_pt[2, 1] = 99
    cases = [
        (dict(layer=5), r"layer must be an int in \[0, 2\), got 5"),
        (dict(page_table=bad_pt), r"page_table\[2, 1\]=99"),
        (dict(kv_lens=torch.tensor([0, 1, 15, 16, 17, 300], dtype=torch.int32)), r"kv_lens\[5\]=300"),
        (dict(geom=(8, 5, 7, 1, 2)), "geom.page=8"),
        (dict(soft_cap=0.0), "soft_cap"),
    ]
    for change, match in cases:
        with pytest.raises(ValueError, match=match):
            tp.paged_attention_reference(q, *pools, **{**base, **change})
    with pytest.raises(ValueError, match="multiple of H=2"):
        tp.paged_attention_reference(q[:, :, :3], *pools, **base)
