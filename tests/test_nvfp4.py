"""Reference NVFP4 codec (`jmixedkv.nvfp4`): the pinned convention of docs/DESIGN.md §2, checked three ways.

1. Hand-written cases: E2M1 code table and RNE ties, E4M3 saturation, zero / NaN / Inf blocks, packing order.
2. An independent NumPy + ml_dtypes re-implementation of the pinned op order (bit-exact, hypothesis shapes).
3. torchao 0.18.0 `nvfp4_quantize` (a different op order): >= 99% equal bytes, every differing byte explained
   (an exact E2M1 midpoint between the two orders' scaled values, an E4M3 tie in the block scale, or a block
   scale below 2^-6 where torchao clamps), dequantized MSE within 1%.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import division_probe
from jmixedkv import nvfp4

E4M3 = ml_dtypes.float8_e4m3fn
F4 = ml_dtypes.float4_e2m1fn
SIXTH = np.float32(1.0) / np.float32(6.0)
MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)


_quantize = jax.jit(nvfp4.quantize_reference)                 # one compile per shape (eager op-by-op is slow on CI)
_dequantize = jax.jit(nvfp4.dequantize_reference, static_argnames="dtype")
_codes = jax.jit(nvfp4.e2m1_codes)


def q(x, gs=1.0):
    p, s = _quantize(jnp.asarray(x), jnp.asarray(gs, jnp.float32))
    return np.asarray(p), np.asarray(s).view(np.uint8)


def dq(p, s, gs=1.0, dtype=jnp.float32):
    s = np.asarray(s)
    s = s.view(E4M3) if s.dtype == np.uint8 else s
    return np.asarray(_dequantize(jnp.asarray(p), jnp.asarray(s), jnp.asarray(gs, jnp.float32), dtype=dtype))


def codes_of(packed):
    packed = np.asarray(packed)
    return np.stack([packed & 0xF, packed >> 4], -1).reshape(*packed.shape[:-1], -1)


# ------------------------------------------------------------------------------------------ independent re-impl
def np_quantize(x, gs=1.0):
    """NumPy/ml_dtypes re-implementation of the pinned order (float32 per op, ml_dtypes RNE casts)."""
    x = np.asarray(x, np.float32)
    lead, d = x.shape[:-1], x.shape[-1]
    xb = x.reshape(*lead, d // 16, 16)
    g = np.broadcast_to(np.asarray(gs, np.float32), lead)[..., None].astype(np.float32)
    with np.errstate(all="ignore"):
        amax = np.max(np.abs(xb), axis=-1)                       # NaN propagates
        s = (np.float32(1.0) / g) * (amax * SIXTH)
        s = np.where(np.isnan(s), s, np.clip(s, np.float32(0), np.float32(448))).astype(np.float32)
        s8 = s.astype(E4M3)
        sf = s8.astype(np.float32)
        r = np.where(sf == 0, np.float32(0), np.float32(1.0) / (sf * g)).astype(np.float32)
        y = xb * r[..., None]
    c = y.astype(F4).view(np.uint8) & 0xF
    c = np.where(np.isnan(y), 0, c).reshape(*lead, d // 2, 2)
    return (c[..., 0] | (c[..., 1] << 4)).astype(np.uint8), s8.view(np.uint8)


# ------------------------------------------------------------------------------------------ E2M1 element format
def test_e2m1_code_table_matches_ml_dtypes():
    codes = np.arange(16, dtype=np.uint8)
    want = codes.view(F4).astype(np.float32)
    got = np.asarray(nvfp4.e2m1_values(jnp.asarray(codes)))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
    # every code round-trips through e2m1_codes
    np.testing.assert_array_equal(np.asarray(nvfp4.e2m1_codes(jnp.asarray(want))), codes)


def test_e2m1_codes_exhaustive_bf16_vs_ml_dtypes():
    """All 65536 bf16 bit patterns (as float32), plus float32 neighbours of every midpoint."""
    v = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
    mids = np.concatenate([MIDPOINTS, -MIDPOINTS, [6.0, -6.0, 0.0, -0.0]]).astype(np.float32)
    near = np.concatenate([mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf))])
    v = np.concatenate([v, near.astype(np.float32)])
    got = np.asarray(_codes(jnp.asarray(v)))
    with np.errstate(invalid="ignore"):
        want = v.astype(F4).view(np.uint8) & 0xF
    want = np.where(np.isnan(v), 0, want)                      # pinned: NaN -> 0 (ml_dtypes gives -0)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_rne_ties_and_saturation(sign):
    # gs = 1 and block amax 6 -> scale exactly 1.0, so the elements are quantized as given
    vals = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 5.99, 0.5, 0.1, 0.0, 2.9, 3.1, 4.9, 5.1],
                    np.float32) * np.float32(sign)
    p, s = q(vals[None])
    assert s.tolist() == [[0x38]]                               # E4M3 1.0
    mags = [0, 2, 2, 4, 4, 6, 6, 7, 7, 1, 0, 0, 5, 5, 6, 7]    # values 0,1,1,2,2,4,4,6,6,.5,0,0,3,3,4,6
    want = [m | 8 for m in mags] if sign < 0 else mags
    want[11] = 8 if sign < 0 else 0                             # -0.0 keeps its sign: code 8
    assert codes_of(p)[0].tolist() == want


def test_sign_of_zero_kept():
    x = np.zeros((1, 16), np.float32)
    x[0, :4] = [-0.0, -1e-30, -0.1, 0.0]
    x[0, 15] = 6.0
    c = codes_of(q(x)[0])[0]
    assert c[:4].tolist() == [8, 8, 8, 0]
    # an all-negative-zero block: scale 0, codes 8
    p, s = q(-np.zeros((1, 16), np.float32))
    assert s.tolist() == [[0]] and codes_of(p)[0].tolist() == [8] * 16


def test_packing_order():
    x = np.zeros((1, 16), np.float32)
    x[0, :2] = [0.5, 6.0]
    p, _ = q(x)
    assert p[0, 0] == 0x71 and p[0, 1:].tolist() == [0] * 7
    np.testing.assert_array_equal(np.asarray(nvfp4.pack_nibbles(nvfp4.unpack_nibbles(jnp.asarray(p)))), p)


# ------------------------------------------------------------------------------------------ block scales
def test_e4m3_scale_saturation_and_zero_blocks():
    x = np.zeros((1, 64), np.float32)
    x[0, :16] = np.linspace(-3000, 3000, 16)                     # amax/6 = 500 > 448: saturates
    x[0, 16:32] = 0.0                                           # zero block
    x[0, 32:48] = 6.0 * 448.0                                   # exactly the largest scale
    x[0, 48:64] = 1e-4                                          # scale rounds to 0
    p, s = q(x)
    assert s[0].tolist() == [0x7E, 0, 0x7E, 0]
    c = codes_of(p)[0]
    assert c[0] == 15 and c[15] == 7                            # ±3000 / 448 -> saturated ±6
    assert c[16:32].tolist() == [0] * 16
    assert c[32:48].tolist() == [7] * 16
    assert c[48:64].tolist() == [0] * 16
    # decode of a scale-0 block is exactly zero
    out = dq(p, s)
    assert (out[0, 16:32] == 0).all() and (out[0, 48:] == 0).all()
    assert out[0, 0] == -448.0 * 6 and out[0, 15] == 448.0 * 6


def test_no_overflow_to_nan_before_cast():
    """XLA turns > 464 into E4M3 NaN: the reference clamps first (tiny gs -> huge enc)."""
    x = np.full((2, 16), 5.0, np.float32)
    p, s = q(x, jnp.asarray([1e-6, 1.0], jnp.float32))
    assert s[:, 0].tolist() == [0x7E, np.float32(5.0 * SIXTH).astype(E4M3).view(np.uint8)]


def test_nan_and_inf_confined_to_their_block():
    rng = np.random.default_rng(1)
    base = rng.standard_normal((3, 64)).astype(np.float32)
    x = base.copy()
    x[0, 5] = np.nan                                            # block 0 of row 0
    x[1, 20] = np.inf                                           # block 1 of row 1
    x[2, 40] = -np.inf                                          # block 2 of row 2
    x[2, 41] = np.nan                                           # ... and a NaN in the same block
    clean = base.copy()
    clean[0, 0:16] = 0
    clean[1, 16:32] = 0
    clean[2, 32:48] = 0
    p, s = q(x)
    pc, sc = q(clean)
    blocks = [(0, 0), (1, 1), (2, 2)]
    mask = np.ones_like(s, bool)
    for r, b in blocks:
        mask[r, b] = False
    np.testing.assert_array_equal(s[mask], sc[mask])
    pmask = np.repeat(mask, 8, axis=1)
    np.testing.assert_array_equal(p[pmask], pc[pmask])
    assert s[0, 0] == 0x7F and (p[0, :8] == 0).all()            # NaN block: NaN scale, zero codes
    assert s[2, 2] == 0x7F and (p[2, 16:24] == 0).all()         # NaN beats Inf
    assert s[1, 1] == 0x7E and codes_of(p)[1, 20] == 7          # Inf: scale 448, element +6
    out = dq(p, s)
    assert np.isnan(out[0, :16]).all() and np.isfinite(np.delete(out[0], np.s_[:16])).all()
    assert np.isfinite(out[1]).all() and out[1, 20] == 6 * 448


# ------------------------------------------------------------------------------------------ round trip
def test_round_trip_error_bound():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((256, 128)) * rng.lognormal(0, 2, (256, 1))).astype(np.float32)
    gs = nvfp4.global_scale_from_amax(np.abs(x).max())
    p, s = q(x, gs)
    sf = s.view(E4M3).astype(np.float32)
    out = dq(p, s, gs)
    unit = np.repeat(sf, 16, axis=1) * np.float32(gs)           # value of one E2M1 unit per element
    y = np.abs(x) / np.where(unit == 0, 1, unit)
    half_step = np.where(y < 2, 0.25, np.where(y < 4, 0.5, 1.0))
    normal = np.repeat(sf >= 2.0 ** -6, 16, axis=1)             # subnormal scales lose relative precision
    err = np.abs(x - out)
    assert (err[normal] <= (half_step * unit * (1 + 2.0 ** -16) + 1e-30)[normal]).all()
    assert normal.mean() > 0.9
    # scale-0 blocks are tiny: every |x| < 2^-10 * 6 * gs (the largest amax that rounds to 0)
    zero = np.repeat(sf == 0, 16, axis=1)
    assert (np.abs(x[zero]) <= 6 * 2.0 ** -10 * float(gs)).all()
    rel = np.linalg.norm(x - out) / np.linalg.norm(x)
    assert rel < 0.12


# ------------------------------------------------------------------------------------------ independent re-impl
def _special_blocks(x, rng):
    flat = x.reshape(-1, 16)
    n = flat.shape[0]
    for kind in rng.choice(6, size=min(n, 6), replace=False):
        b = rng.integers(n)
        if kind == 0:
            flat[b, rng.integers(16)] = np.nan
        elif kind == 1:
            flat[b, rng.integers(16)] = np.inf * rng.choice([-1, 1])
        elif kind == 2:
            flat[b] = 0.0
        elif kind == 3:
            flat[b] *= 1e-6
        elif kind == 4:
            flat[b] *= 1e4
        else:
            flat[b, :4] = [-0.0, -1e-30, 0.0, -0.0]
    return flat.reshape(x.shape)


@settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lead=st.sampled_from([(), (3,), (2, 5)]), nblk=st.sampled_from([1, 8, 36]),
       seed=st.integers(0, 2 ** 31 - 1), dtype=st.sampled_from(["bfloat16", "float32", "float16"]),
       per_row=st.booleans())
def test_matches_numpy_reimplementation(lead, nblk, seed, dtype, per_row):
    rng = np.random.default_rng(seed)
    lead = list(lead)
    shape = (*lead, nblk * 16)
    x = (rng.standard_normal(shape) * rng.lognormal(0, 3, (*lead, 1))).astype(np.float32)
    with np.errstate(over="ignore"):
        x = _special_blocks(x, rng).astype(dtype).astype(np.float32)
    with np.errstate(all="ignore"):
        amax = np.nanmax(np.where(np.isinf(x), 0, np.abs(x))) if x.size else 1.0
    gs = (rng.uniform(0.1, 10.0, lead).astype(np.float32) if per_row and lead
          else np.float32(nvfp4.global_scale_from_amax(amax)))
    p, s = _quantize(jnp.asarray(x, dtype), jnp.asarray(gs, jnp.float32))
    pn, sn = np_quantize(x, gs)
    np.testing.assert_array_equal(np.asarray(s).view(np.uint8), sn)
    np.testing.assert_array_equal(np.asarray(p), pn)
    # dequantize: (e2m1 * s) * gs, then cast
    vals = codes_of(pn).view(np.uint8)
    vals = (vals & 0xF).view(F4).astype(np.float32).reshape(*lead, nblk, 16)
    g = np.broadcast_to(np.asarray(gs, np.float32), tuple(lead))[..., None, None]
    with np.errstate(all="ignore"):
        want = ((vals * sn.view(E4M3).astype(np.float32)[..., None]) * g).reshape(shape)
    got = dq(p, s, gs)
    np.testing.assert_array_equal(got, want)                     # NaN == NaN for assert_array_equal


def test_codec_reference_backend_is_the_reference():
    x = jnp.asarray(np.random.default_rng(5).standard_normal((2, 3, 64)), jnp.bfloat16)
    p, s = nvfp4.quantize(x, 0.5, backend="reference")
    pr, sr = nvfp4.quantize_reference(x, 0.5)
    np.testing.assert_array_equal(np.asarray(p), np.asarray(pr))
    assert p.shape == (2, 3, 32) and s.shape == (2, 3, 4) and s.dtype == jnp.float8_e4m3fn
    with pytest.raises(ValueError, match="backend"):
        nvfp4.quantize(x, 1.0, backend="triton")


def test_global_scale_from_amax():
    np.testing.assert_array_equal(np.asarray(nvfp4.global_scale_from_amax(jnp.asarray([2688.0, 0.0, np.inf, np.nan]))),
                                  np.array([1.0, 1.0, 1.0, 1.0], np.float32))
    assert float(nvfp4.global_scale_from_amax(5376.0)) == 2.0


def test_bad_last_dim_raises():
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4.quantize_reference(jnp.zeros((2, 24)))
    with pytest.raises(ValueError, match="scales last dim"):
        nvfp4.dequantize_reference(jnp.zeros((2, 8), jnp.uint8), jnp.zeros((2, 2), jnp.float8_e4m3fn))


# ------------------------------------------------------------------------------------------ torchao 0.18.0
def _torchao():
    """torch + torchao 0.18.0 (the `test` extra installs both: a missing one is a failure, not a skip)."""
    import importlib

    import torch
    import torchao
    assert torchao.__version__.startswith("0.18.0"), f"tests pin torchao 0.18.0, found {torchao.__version__}"
    mod = importlib.import_module("torchao.prototype.mx_formats.nvfp4_tensor")
    return torch, mod.nvfp4_quantize, mod.per_tensor_amax_to_scale


def _is_e4m3_tie_or_neighbour(a, b):
    """True where float32 ``a`` / ``b`` (two orders' unrounded block scales) round to E4M3 bytes that
    differ by one step because a tie (or a value 1-2 ulp from it) lies between them."""
    lo, hi = np.minimum(a, b), np.maximum(a, b)
    ra, rb = lo.astype(E4M3).astype(np.float32), hi.astype(E4M3).astype(np.float32)
    mid = (ra + rb) / 2                                          # exact in float32
    return (lo <= mid) & (mid <= hi)


def test_agrees_with_torchao_0_18():
    torch, nvfp4_quantize, per_tensor_amax_to_scale = _torchao()
    rng = np.random.default_rng(3)
    R = 512
    x = (rng.standard_normal((R, 128)) * rng.lognormal(0, 1, (R, 1))).astype(np.float32)
    xb = x.astype(ml_dtypes.bfloat16)
    xt = torch.from_numpy(xb.view(np.uint16).astype(np.int16)).view(torch.bfloat16)
    amax = torch.amax(torch.abs(xt.float()))
    pts = per_tensor_amax_to_scale(amax)
    gs = np.float32(pts.item())
    assert gs == np.float32(nvfp4.global_scale_from_amax(amax.item()))
    st_, pt_ = nvfp4_quantize(xt, 16, pts)
    s_t = st_.view(torch.uint8).numpy().reshape(R, 8)
    p_t = pt_.numpy().reshape(R, 64)
    p, s = q(xb.astype(np.float32), gs)

    same_bytes = (p == p_t).sum() + (s == s_t).sum()
    assert same_bytes / (p.size + s.size) >= 0.99

    # explain every differing scale byte
    xf = xb.astype(np.float32).reshape(R, 8, 16)
    blk_amax = np.abs(xf).max(-1)
    ours_s = (np.float32(1) / gs) * (blk_amax * SIXTH)
    torch_s = (blk_amax / np.float32(6.0)) / gs
    ds = s != s_t
    tiny = s_t.view(E4M3).astype(np.float32) <= 2.0 ** -6       # torchao clamps scales at 2^-6
    explained = _is_e4m3_tie_or_neighbour(ours_s, torch_s) | tiny
    assert explained[ds].all(), f"unexplained scale bytes at {np.argwhere(ds & ~explained)[:5]}"
    assert (np.abs(s.astype(int) - s_t.astype(int))[ds & ~tiny] <= 1).all()

    # explain every differing code in blocks whose scales agree: a midpoint between the two scaled values
    c, c_t = codes_of(p).reshape(R, 8, 16), codes_of(p_t).reshape(R, 8, 16)
    sf = s.view(E4M3).astype(np.float32)[..., None]
    y_ours = xf * np.where(sf == 0, 0, np.float32(1) / (sf * gs))
    y_torch = xf * ((np.float32(1) / gs) / sf)
    lo, hi = np.minimum(np.abs(y_ours), np.abs(y_torch)), np.maximum(np.abs(y_ours), np.abs(y_torch))
    at_mid = ((lo[..., None] <= MIDPOINTS) & (MIDPOINTS <= hi[..., None])).any(-1)
    dc = (c != c_t) & ~ds[..., None]
    assert at_mid[dc].all(), f"unexplained codes at {np.argwhere(dc & ~at_mid)[:5]}"
    assert (np.abs((c & 7).astype(int) - (c_t & 7).astype(int))[dc] <= 1).all()
    # ... and differing codes only happen in about 1% of elements
    assert dc.mean() < 0.01

    # dequantized MSE within 1% of torchao's (both decoded with the same formula)
    def mse(pp, ss):
        out = dq(pp, ss, gs)
        return float(np.mean((out - xb.astype(np.float32)) ** 2))

    m_ours, m_torch = mse(p, s), mse(p_t, s_t)
    assert abs(m_ours - m_torch) <= 0.01 * m_torch, (m_ours, m_torch)


# --------------------------------------------------------------------------- IEEE division in XLA (compat)
def test_xla_flags_with_ieee_division_merges_and_is_accepted():
    """The flag string merges with other flags and XLA accepts it (an unknown LLVM option aborts the process);
    on this backend the division it compiles is IEEE (on an H200 see the GPU test in test_nvfp4_kernels)."""
    from jmixedkv.compat import IEEE_DIVISION_OPTION, xla_flags_with_ieee_division as f
    assert f("") == "--xla_backend_extra_options=" + IEEE_DIVISION_OPTION
    assert f("--a=1 --xla_backend_extra_options=-x=1") == ("--a=1 --xla_backend_extra_options=-x=1,"
                                                           + IEEE_DIVISION_OPTION)
    assert f(f("--a=1")) == f("--a=1")
    _, bad, inv = division_probe(f("--xla_force_host_platform_device_count=2"))
    assert bad == 0 and inv == np.float32(1.0) / np.float32(0.0011160715)


# --------------------------------------------------------------------------- jmixedkv.numerics (the leaf)
def test_numerics_fence_keeps_every_bit_pattern():
    """`keep` / `launder` return their input bit for bit (signed zeros, subnormals, Inf, NaN payloads), eager and
    jitted, with the zeros they need (`keep`: a non-negative value; `launder`: `opaque_zero` of a |c| <= 1)."""
    from helpers import assert_bits_equal
    from jmixedkv import numerics
    rng = np.random.default_rng(0)
    pats = np.concatenate([rng.integers(0, 2 ** 32, 1 << 14, dtype=np.uint64).astype(np.uint32),
                           np.array([0, 0x80000000, 1, 0x807FFFFF, 0x7F800000, 0xFF800000, 0x7FC00001, 0xFFC00000],
                                    np.uint32)])
    a = pats.view(np.float32)
    nonneg = np.abs(rng.standard_normal(a.shape)).astype(np.float32)
    c = np.cos(rng.uniform(0, 50, a.shape)).astype(np.float32)
    for f in (numerics.keep, jax.jit(numerics.keep)):
        assert_bits_equal(np.asarray(f(jnp.asarray(a), jnp.asarray(nonneg))), a, "keep")
    launder = lambda x, c_: numerics.launder(x, numerics.opaque_zero(c_))  # noqa: E731
    for f in (launder, jax.jit(launder)):
        assert_bits_equal(np.asarray(f(jnp.asarray(a), jnp.asarray(c))), a, "launder")


def test_numerics_fp8_row_codec():
    """FP8 rows: ``e4m3(clip(f32(x) / scale, ±448))`` (saturating, NaN kept) and back ``f32(e4m3) * scale``;
    16-bit pools are a cast. ml_dtypes is the independent reference for the E4M3 rounding."""
    from helpers import assert_bits_equal
    from jmixedkv import numerics
    assert numerics.E4M3_MAX == float(ml_dtypes.finfo(E4M3).max) == nvfp4.E4M3_MAX
    x = np.array([0.0, -0.0, 1.0, -3.3, 500.0, -1e9, np.inf, -np.inf, np.nan, 2.0 ** -12, 447.9, 464.1],
                 np.float32)
    scale = np.float32(0.5)
    got = np.asarray(numerics.encode_rows(jnp.asarray(x), jnp.float8_e4m3fn, jnp.float32(scale)))
    y = x / scale
    want = np.where(np.isnan(y), y, np.clip(y, -448, 448)).astype(E4M3)
    assert_bits_equal(got, want, "encode_rows fp8")
    assert_bits_equal(np.asarray(numerics.e4m3_saturate(jnp.asarray(y))), want, "e4m3_saturate")
    back = np.asarray(numerics.decode_rows(jnp.asarray(got), jnp.float32(scale), jnp.float32))
    assert_bits_equal(back, want.astype(np.float32) * scale, "decode_rows fp8")
    # a scale whose reciprocal is inexact: x / scale is an E4M3 tie (7.5 * 2^-9) that a multiply by 1 / scale
    # misses by one ulp; jitted, with the scale broadcast per row, as the write path divides
    tie, s37 = np.full((2, 16), -0.05419921875, np.float32), np.float32(3.7)
    assert tie[0, 0] / s37 == np.float32(-7.5 * 2.0 ** -9)
    enc = jax.jit(lambda a, s: numerics.encode_rows(a, jnp.float8_e4m3fn, s[:, None]))
    got = np.asarray(enc(jnp.asarray(tie), jnp.full((2,), s37)))
    assert_bits_equal(got, (tie / s37).astype(E4M3), "encode_rows fp8 at a tie")
    b16 = numerics.encode_rows(jnp.asarray(x), jnp.bfloat16, jnp.float32(scale))       # a cast, scale unused
    assert_bits_equal(np.asarray(b16), x.astype(ml_dtypes.bfloat16), "encode_rows bf16")
    assert numerics.is_fp8(jnp.float8_e4m3fn) and not numerics.is_fp8(jnp.bfloat16)
