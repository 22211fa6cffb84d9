"""NVFP4 Pallas kernels (`pallas_kernels.nvfp4`) against the reference codec, bit-exact.

CPU: interpret mode (small grids: ~0.3 ms per grid step) and CUDA cross-lowering for every D.
GPU (``-m gpu``, on the device machine): the compiled Triton kernels against the reference run on the same
GPU and on the host CPU backend.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from helpers import assert_bits_equal, division_probe
from jmixedkv import nvfp4
from jmixedkv.compat import cross_lower_cuda, on_gpu
from pallas_kernels import nvfp4 as K
from pallas_kernels import nvfp4_ops as ops

E4M3 = ml_dtypes.float8_e4m3fn
DS = (64, 128, 256, 576)
TILE = dict(block_rows=16, sub_rows=8)          # interpret tests: 2 loop steps per program, a few programs


def make_input(rows, d, seed=0, dtype=jnp.bfloat16):
    """Random rows of very different magnitudes plus every special block kind."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, d)) * rng.choice([1e-6, 1e-3, 0.1, 1.0, 30.0, 1e3, 1e5], (rows, 1))
    x = x.astype(np.float32)
    specials = [
        (0, 0, lambda b: np.where(np.arange(16) == 3, np.nan, b)),              # NaN block
        (1, 1, lambda b: np.where(np.arange(16) == 7, np.inf, b)),              # +Inf
        (2, 2, lambda b: np.where(np.arange(16) == 0, -np.inf, b)),             # -Inf
        (3, 0, lambda b: np.zeros(16)),                                         # zero block
        (3, 1, lambda b: -np.zeros(16)),                                        # negative zeros
        (4, 0, lambda b: b * 1e-30),                                            # tiny (scale 0)
        (4, 1, lambda b: np.concatenate([[-0.0, -1e-30, 0.0, 1e-38], b[4:]])),  # signed zeros in a block
        (5, 2, lambda b: np.sign(b) * 1e35),                                    # saturating scale
        (6, 0, lambda b: np.full(16, 6.0 * 448.0)),                             # exactly the largest scale
        (6, 1, lambda b: np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 6] * 2) * np.repeat([1, -1], 8)),
    ]
    for r, blk, f in specials:
        if r < rows and (blk + 1) * 16 <= d:
            x[r, blk * 16:(blk + 1) * 16] = f(x[r, blk * 16:(blk + 1) * 16])
    return jnp.asarray(x, dtype)


def assert_same_quant(got, want, msg=""):
    """(packed, scales) pairs byte for byte."""
    assert_bits_equal(got[1], want[1], f"{msg}: scale bytes")
    assert_bits_equal(got[0], want[0], f"{msg}: packed bytes")


def assert_same_bits(got, want, msg=""):
    """Dequantized values bit for bit; NaN positions must agree, NaN payloads may differ (computed NaNs)."""
    assert_bits_equal(got, want, msg, any_nan=True)


_ref_q = jax.jit(nvfp4.quantize_reference)
_ref_dq = jax.jit(nvfp4.dequantize_reference, static_argnames="dtype")


@functools.lru_cache(maxsize=None)
def _kq(**kw):
    return jax.jit(functools.partial(K.quantize, interpret=True, **kw))


@functools.lru_cache(maxsize=None)
def _kdq(dtype, **kw):
    return jax.jit(functools.partial(K.dequantize, dtype=dtype, interpret=True, **kw))


# ----------------------------------------------------------------------------------------- element helpers
def test_e2m1_code_magnitude_matches_reference():
    """The in-kernel E2M1 encoder on all bf16 patterns, float32 neighbours of every midpoint, random float32."""
    rng = np.random.default_rng(0)
    v = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 2.0, 4.0, 1.0, 0.5, 3.0], np.float32)
    near = [mids]
    for _ in range(3):
        near += [np.nextafter(near[-1], np.float32(np.inf))]
    lo = [mids]
    for _ in range(3):
        lo += [np.nextafter(lo[-1], np.float32(-np.inf))]
    r = rng.uniform(0, 7, 1 << 16).astype(np.float32)
    v = np.concatenate([v, *near, *lo, r])
    v = np.concatenate([v, -v])
    v = v[~np.isnan(v)]
    want = np.asarray(jax.jit(nvfp4.e2m1_codes)(v)).astype(np.int32) & 7
    np.testing.assert_array_equal(np.asarray(jax.jit(ops.e2m1_code_magnitude)(jnp.asarray(v))), want)
    nonneg = np.abs(v)
    got = np.asarray(jax.jit(lambda y: ops.e2m1_code_magnitude(y, nonneg=True))(jnp.asarray(nonneg)))
    np.testing.assert_array_equal(got, want)


def test_e2m1_value_decodes_every_code():
    """The in-kernel E2M1 decoder equals the reference table for all 16 codes, sign of zero included."""
    got = np.asarray(jax.jit(ops.e2m1_value)(jnp.arange(16, dtype=jnp.int32)))
    assert_bits_equal(got, nvfp4.E2M1_TABLE, "e2m1_value")
    assert np.signbit(got[8]) and not np.signbit(got[0])


def test_e2m1_f16_halves_decodes_every_byte():
    """The decode kernels' f16 E2M1 form (`nvfp4_ops.e2m1_f16_halves`: ``e2m1 * 2^-14``, exact) for all 256 bytes,
    both nibbles, against ml_dtypes ``float4_e2m1fn``, sign of zero included (bits compared in float32)."""
    b = np.arange(256, dtype=np.uint8)
    lo, hi = jax.jit(ops.e2m1_f16_halves)(jnp.asarray(b))
    for got, nib in ((lo, b & 15), (hi, b >> 4)):
        assert got.dtype == jnp.float16
        want = nib.view(ml_dtypes.float4_e2m1fn).astype(np.float32) * np.float32(2.0 ** -14)
        assert_bits_equal(np.asarray(got).astype(np.float32), want, "e2m1_f16_halves")
    assert np.signbit(np.asarray(lo)[8]) and not np.signbit(np.asarray(hi)[8])


def test_e4m3_encode_decode_helpers():
    rng = np.random.default_rng(1)
    vals = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)
    fin = np.unique(np.abs(vals[np.isfinite(vals)]))
    ties = (fin[1:] + fin[:-1]) / 2
    s = np.concatenate([fin, ties, np.nextafter(ties, np.float32(0)), np.nextafter(ties, np.float32(500)),
                        rng.uniform(0, 448, 1 << 15), np.exp2(rng.uniform(-40, 8.8, 1 << 15)),
                        [0.0, 2.0 ** -6, 2.0 ** -10, 1e-40, 448.0]]).astype(np.float32)
    s = np.minimum(s, np.float32(448))
    byte, val, nan = jax.jit(ops.e4m3_encode)(jnp.asarray(s))
    want = s.astype(E4M3)
    np.testing.assert_array_equal(np.asarray(byte), want.view(np.uint8).astype(np.int32))
    np.testing.assert_array_equal(np.asarray(val), want.astype(np.float32))
    byte, val, nan = jax.jit(ops.e4m3_encode)(jnp.asarray([np.nan], jnp.float32))
    assert int(byte[0]) == 0x7F and bool(nan[0])
    dec = np.asarray(jax.jit(ops.e4m3_decode)(jnp.arange(256, dtype=jnp.int32)))
    assert_same_bits(dec, vals)
    np.testing.assert_array_equal(np.signbit(dec), np.signbit(vals))


# ----------------------------------------------------------------------------------------- interpret mode
# (D, per-row gs) pairs: every D, both gs kinds, few compiles
CASES = [(64, False), (128, False), (128, True), (256, True), (576, False), (576, True)]


@pytest.mark.parametrize("d,per_row", CASES)
def test_interpret_quantize_dequantize_bit_exact(d, per_row):
    rows = 37                                                   # not a multiple of the block
    x = make_input(rows, d, seed=d + per_row)
    gs = (jnp.asarray(np.random.default_rng(d).uniform(0.01, 4.0, rows), jnp.float32) if per_row
          else jnp.float32(0.37))
    want = _ref_q(x, gs)
    got = _kq(**TILE)(x, gs)
    assert got[1].dtype == jnp.float8_e4m3fn and got[0].dtype == jnp.uint8
    assert_same_quant(got, want, f"quantize D={d} per_row={per_row}")
    out = _kdq(jnp.bfloat16, **TILE)(want[0], want[1], gs)
    assert_same_bits(out, _ref_dq(want[0], want[1], gs, dtype=jnp.bfloat16), f"dequantize D={d}")


def test_interpret_float32_and_float16_inputs_and_outputs():
    for dtype in (jnp.float32, jnp.float16):
        with np.errstate(over="ignore"):
            x = make_input(16, 128, seed=7, dtype=dtype)
        want = _ref_q(x, jnp.float32(1.0))
        assert_same_quant(_kq(**TILE)(x, jnp.float32(1.0)), want, str(dtype))
        out = _kdq(dtype, **TILE)(want[0], want[1], jnp.float32(1.0))
        assert_same_bits(out, _ref_dq(want[0], want[1], jnp.float32(1.0), dtype=dtype), str(dtype))


@pytest.mark.parametrize("d,width", [(128, 16), (576, 32)])
def test_interpret_other_kernel_widths(d, width):
    """``width=16``: one quantization block per kernel row; 576 as 18 rows of 32."""
    x = make_input(8, d, seed=11)
    gs = jnp.asarray(np.random.default_rng(11).uniform(0.1, 3.0, 8), jnp.float32)
    want = _ref_q(x, gs)
    assert_same_quant(_kq(block_rows=64, sub_rows=32, width=width)(x, gs), want, f"width={width}")
    out = _kdq(jnp.bfloat16, block_rows=64, sub_rows=32, width=width)(want[0], want[1], gs)
    assert_same_bits(out, _ref_dq(want[0], want[1], gs, dtype=jnp.bfloat16), f"dequantize width={width}")


def test_interpret_default_tiling_small_rows():
    """Default block sizes clamp to the (padded) row count: 5 rows run as one 8-row program."""
    x = make_input(5, 128, seed=3)
    assert_same_quant(_kq()(x, jnp.float32(2.0)), _ref_q(x, jnp.float32(2.0)), "default tiling")


def test_codec_dispatch_pallas_backend_any_leading_shape():
    x = make_input(24, 64, seed=4).reshape(2, 3, 4, 64)
    gs = jnp.asarray(np.random.default_rng(4).uniform(0.5, 2.0, (2, 3, 4)), jnp.float32)
    got = jax.jit(functools.partial(nvfp4.quantize, backend="pallas", **TILE))(x, gs)
    want = nvfp4.quantize(x, gs, backend="reference")
    assert got[0].shape == (2, 3, 4, 32) and got[1].shape == (2, 3, 4, 4)
    assert_same_quant(got, want, "codec pallas")
    out = jax.jit(functools.partial(nvfp4.dequantize, dtype=jnp.bfloat16, backend="pallas", **TILE))(*got, gs)
    assert out.shape == x.shape
    assert_same_bits(out, nvfp4.dequantize(*want, gs, jnp.bfloat16, backend="reference"), "codec dequantize")
    if not on_gpu():   # auto = reference on CPU
        assert_same_quant(nvfp4.quantize(x, gs), want, "codec auto")


def test_bad_inputs_raise_clear_errors():
    x = jnp.zeros((4, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of 16, got 24"):
        K.quantize(jnp.zeros((4, 24), jnp.bfloat16))
    with pytest.raises(ValueError, match="int32"):
        K.quantize(jnp.zeros((4, 128), jnp.int32))
    with pytest.raises(ValueError, match="x\\[rows, D\\]"):
        K.quantize(jnp.zeros((2, 4, 128), jnp.bfloat16))
    with pytest.raises(ValueError, match="block_rows must be a power of two"):
        K.quantize(x, block_rows=48)
    with pytest.raises(ValueError, match="num_warps"):
        K.quantize(x, num_warps=3)
    with pytest.raises(ValueError, match="global_scale"):
        K.quantize(x, jnp.ones((3,), jnp.float32))
    with pytest.raises(ValueError, match="width must be"):
        K.quantize(x, width=48)
    with pytest.raises(TypeError, match="impl"):           # the experimental variants live in the bench
        K.quantize(x, impl="v1")
    with pytest.raises(ValueError, match="scales shape"):
        K.dequantize(jnp.zeros((4, 64), jnp.uint8), jnp.zeros((4, 4), jnp.float8_e4m3fn))
    with pytest.raises(ValueError, match="packed must be uint8"):
        K.dequantize(jnp.zeros((4, 64), jnp.int8), jnp.zeros((4, 8), jnp.float8_e4m3fn))
    with pytest.raises(ValueError, match="dtype must be one of"):
        K.dequantize(jnp.zeros((4, 64), jnp.uint8), jnp.zeros((4, 8), jnp.float8_e4m3fn), dtype=jnp.int8)
    with pytest.raises(ValueError, match="backend"):
        nvfp4.quantize(x, backend="cuda")
    assert K.quantize(jnp.zeros((0, 64), jnp.bfloat16))[0].shape == (0, 32)


def test_kernel_width():
    assert [K.kernel_width(d) for d in (16, 64, 128, 192, 256, 576, 1024)] == [16, 64, 128, 64, 256, 64, 512]


# ----------------------------------------------------------------------------------------- CUDA lowering
@pytest.mark.parametrize("d", DS)
def test_cross_lowers_for_cuda(d):
    rows = 1000
    for gs in (jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((rows,), jnp.float32)):
        x = jax.ShapeDtypeStruct((rows, d), jnp.bfloat16)
        text = cross_lower_cuda(functools.partial(K.quantize, interpret=False), x, gs)
        assert "triton" in text and "nvfp4_quantize" in text
        p = jax.ShapeDtypeStruct((rows, d // 2), jnp.uint8)
        s = jax.ShapeDtypeStruct((rows, d // 16), jnp.float8_e4m3fn)
        text = cross_lower_cuda(functools.partial(K.dequantize, interpret=False), p, s, gs)
        assert "triton" in text and "nvfp4_dequantize" in text
    # the bench's tilings and the non-bf16 inputs (no int32 pair view) lower too
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    for dtype in (jnp.bfloat16, jnp.float32, jnp.float16):
        x = jax.ShapeDtypeStruct((4096, d), dtype)
        for kw in (dict(block_rows=1024, sub_rows=64, num_warps=8), dict(block_rows=4096, sub_rows=256, width=16),
                   dict(block_rows=16, sub_rows=16, num_warps=1))[:3 if dtype == jnp.bfloat16 else 1]:
            cross_lower_cuda(functools.partial(K.quantize, interpret=False, **kw), x, scalar)


# ----------------------------------------------------------------------------------------- GPU
gpu = pytest.mark.skipif(not on_gpu(), reason="needs a CUDA GPU")


def _on_cpu(fn, *args, **kw):
    """Run the pinned reference ``fn`` on the host CPU backend (the convention every kernel must match)."""
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        return jax.jit(fn, static_argnames=tuple(kw))(*(jax.device_put(a, cpu) for a in args), **kw)


def _cpu_reference_quant(x, gs):
    return _on_cpu(nvfp4.quantize_reference, x, gs)


def _diff(check, got, want, msg):
    """None if ``check`` passes, else its one-line message (so a GPU run reports every failing pair at once)."""
    try:
        check(got, want, msg)
    except AssertionError as e:
        return str(e)
    return None


def _quant_diff(got, want, msg):
    return _diff(assert_same_quant, got, want, msg)


def _bits_diff(got, want, msg):
    return _diff(assert_same_bits, got, want, msg)


def _run(fn, *args):
    """(result, None) or (None, error line): a variant that fails to compile is reported with the others."""
    try:
        return jax.block_until_ready(fn(*args)), None
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {str(e)[:300]}"


def _check_all(diffs):
    bad = [d for d in diffs if d]
    assert not bad, f"{len(bad)} of {len(diffs)} comparisons differ:\n" + "\n".join(bad)


@pytest.mark.gpu
@gpu
def test_gpu_xla_division_ieee_only_with_the_flag():
    """XLA's default float32 division on the GPU is ``div.full.f32`` (not IEEE: ``1 / 0.0011160715`` = 896.0);
    with `xla_flags_with_ieee_division` it matches numpy bit for bit (what lets GPU tests run the jnp reference on
    the GPU itself)."""
    from jmixedkv.compat import xla_flags_with_ieee_division
    backend, bad_default, inv_default = division_probe("")
    _, bad_ieee, inv_ieee = division_probe(xla_flags_with_ieee_division(""))
    assert backend == "gpu"
    assert bad_ieee == 0 and inv_ieee == np.float32(1.0) / np.float32(0.0011160715), (bad_ieee, inv_ieee)
    assert bad_default > 0 and inv_default == np.float32(896.0), (bad_default, inv_default)


GPU_TILINGS = [dict(), dict(block_rows=32, sub_rows=32, num_warps=8), dict(block_rows=1024, sub_rows=64, num_warps=8),
               dict(block_rows=256, sub_rows=16, num_warps=4, num_stages=1),
               dict(block_rows=4096, sub_rows=256, num_warps=4, width=16),
               dict(block_rows=256, sub_rows=64, num_warps=8, num_stages=2)]
#: tilings run for every D / gs kind (the full list runs for D = 128, scalar gs)
GPU_TILINGS_SHORT = [dict(), dict(block_rows=4096, sub_rows=256, num_warps=4, width=16)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("d", DS)
@pytest.mark.parametrize("per_row", [False, True])
def test_gpu_kernels_bit_exact(d, per_row):
    """The kernel over several tilings against BOTH the pinned reference on the host CPU and the jitted reference on the
    GPU (all comparisons run; the failure lists every pair that differs)."""
    rows = 4099
    x = make_input(rows, d, seed=d)
    gs = (jnp.asarray(np.random.default_rng(d).uniform(1e-3, 10.0, rows), jnp.float32) if per_row
          else nvfp4.global_scale_from_amax(1e3))
    want_gpu = jax.jit(nvfp4.quantize_reference)(x, gs)
    want_cpu = _cpu_reference_quant(x, gs)
    full = d == 128 and not per_row                                  # every tiling once, the short list elsewhere
    diffs = [_quant_diff(want_gpu, want_cpu, "XLA GPU reference vs CPU reference")]
    for kw in (GPU_TILINGS if full else GPU_TILINGS_SHORT):
        got, err = _run(jax.jit(functools.partial(K.quantize, interpret=False, **kw)), x, gs)
        if err:
            diffs.append(f"kernel D={d} per_row={per_row} {kw} failed: {err}")
            continue
        diffs.append(_quant_diff(got, want_cpu, f"kernel vs CPU reference D={d} per_row={per_row} {kw}"))
        diffs.append(_quant_diff(got, want_gpu, f"kernel vs GPU reference D={d} per_row={per_row} {kw}"))
    q = jax.device_put(want_cpu, jax.devices()[0])                   # the pinned codes, on the GPU
    for dtype in ((jnp.bfloat16, jnp.float32, jnp.float16) if full else (jnp.bfloat16,)):
        ref_gpu = jax.jit(nvfp4.dequantize_reference, static_argnames="dtype")(*q, gs, dtype=dtype)
        ref_cpu = _on_cpu(nvfp4.dequantize_reference, *want_cpu, gs, dtype=dtype)
        diffs.append(_bits_diff(ref_gpu, ref_cpu, f"dequantize XLA GPU vs CPU reference D={d} {dtype}"))
        for kw in (dict(), dict(block_rows=1024, sub_rows=64, num_warps=8)):
            out = jax.jit(functools.partial(K.dequantize, dtype=dtype, interpret=False, **kw))(*q, gs)
            diffs.append(_bits_diff(out, ref_cpu, f"dequantize vs CPU reference D={d} {dtype} {kw}"))
            diffs.append(_bits_diff(out, ref_gpu, f"dequantize vs GPU reference D={d} {dtype} {kw}"))
    _check_all(diffs)


def _impl_diffs(impls, x, gs, want_cpu, want_gpu, label):
    """The quantize kernel with each tiling of ``impls`` on ``x`` against both references: difference reports."""
    diffs = []
    for kw in impls:
        got, err = _run(jax.jit(functools.partial(K.quantize, **kw)), x, gs)
        if err:
            diffs.append(f"{label} {kw} failed: {err}")
            continue
        diffs += [_quant_diff(got, want_cpu, f"{label} {kw}: kernel vs CPU reference"),
                  _quant_diff(got, want_gpu, f"{label} {kw}: kernel vs GPU reference")]
    return diffs


@pytest.mark.gpu
@gpu
def test_gpu_large_and_random_bit_patterns():
    """1M rows x 128 of N(0, 1) bf16 plus 64K rows of raw random bf16 bit patterns (all exponents, NaN, Inf),
    bf16 (int32 pair view) and float32 input, against the CPU and the GPU reference."""
    impls = [dict(), dict(block_rows=256, sub_rows=64, num_warps=8)]
    x = jax.random.normal(jax.random.key(0), (1 << 20, 128), jnp.bfloat16)
    gs = nvfp4.global_scale_from_amax(jnp.max(jnp.abs(x)).astype(jnp.float32))
    want_gpu, want_cpu = jax.jit(nvfp4.quantize_reference)(x, gs), _cpu_reference_quant(x, gs)
    diffs = [_quant_diff(want_gpu, want_cpu, "1M x 128: XLA GPU reference vs CPU reference")]
    diffs += _impl_diffs(impls, x, gs, want_cpu, want_gpu, "1M x 128")
    xf = x[: 1 << 16].astype(jnp.float32)
    diffs += _impl_diffs(impls[:1], xf, gs, _cpu_reference_quant(xf, gs), _ref_q(xf, gs), "f32")
    bits = jax.random.bits(jax.random.key(1), (1 << 16, 128), jnp.uint16)
    xr = jax.lax.bitcast_convert_type(bits, jnp.bfloat16)
    for gs in (jnp.float32(1.0), jnp.float32(2.0 ** -90), jnp.float32(2.0 ** 90)):
        want_gpu, want_cpu = jax.jit(nvfp4.quantize_reference)(xr, gs), _cpu_reference_quant(xr, gs)
        diffs += _impl_diffs(impls, xr, gs, want_cpu, want_gpu, f"random bits gs={float(gs)}")
        q = jax.device_put(want_cpu, jax.devices()[0])
        out = K.dequantize(*q, gs)
        diffs += [_bits_diff(out, _on_cpu(nvfp4.dequantize_reference, *want_cpu, gs),
                             "dequantize random bits vs CPU ref"),
                  _bits_diff(out, _ref_dq(*q, gs), "dequantize random bits vs GPU ref")]
    _check_all(diffs)


@pytest.mark.gpu
@gpu
def test_gpu_codec_auto_uses_kernels():
    x = make_input(300, 576, seed=9).reshape(3, 100, 576)
    got = nvfp4.quantize(x, 0.25)
    _check_all([_quant_diff(got, _cpu_reference_quant(x, jnp.float32(0.25)), "codec auto vs CPU reference"),
                _quant_diff(got, _ref_q(x, jnp.float32(0.25)), "codec auto vs GPU reference")])

