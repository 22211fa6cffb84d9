"""Rows as the cache reads them back once stored, without storing them (`interop.triton_write.round_trip_rows`, the
torch reference `interop.torch_paged.round_trip_reference`, the dispatcher `interop.paged_ops.round_trip`): bit
for bit against the JAX codec (`jmixedkv.nvfp4.quantize_reference` -> ``dequantize_reference``, and
`jmixedkv.numerics.encode_rows` -> ``decode_rows`` for fp8 rows) and against "store with the write kernel, then
decode the stored bytes". The held-aside fused step of `interop.hf.JMixedKVCache` reads its own rows this way for
NVFP4 / FP8 formats.

CPU: Triton's interpreter, and the CUDA form compiled for sm_90 without a GPU (exact float ops). ``gpu``: the
compiled kernel on the device, same bits.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import triton  # noqa: F401  (a test dependency: the kernel needs it, no silent skip)

from jmixedkv import nvfp4
from jmixedkv.numerics import decode_rows, encode_rows
from interop import paged_ops, torch_paged
from interop import triton_write as tw
from interop.torch_paged import TorchPools

gpu = pytest.mark.gpu
_JDT = {torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16}


def _rows(seed, b, t, h, d, dtype, strided=True):
    """``(k, v) [B, T, H, D]``: normal rows scaled by 10^U(-3, 3) per row, transposed views of ``[B, H, T, D]``
    (``strided``), K's first row holding the edge cases (NaN, +-inf, +-0, E2M1 midpoints)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(2, b, h, t, d)) * 10.0 ** rng.uniform(-3, 3, size=(2, b, h, t, 1))
    x = x.astype(np.float32)
    edge = np.array([np.nan, 1.0, -2.0, 0.25, 0.75, -0.0, 0.0, 5.0, 3.5, -1.25, 2.5, 1.75, 6.0, -6.0, 0.5, 1.0],
                    np.float32)
    x[0, 0, 0, 0, :16] = edge
    if d >= 48:
        x[0, 0, 0, 0, 16:32] = np.linspace(-1, 2, 16)
        x[0, 0, 0, 0, 23] = np.inf
        x[1, 0, 0, 0, 32:48] = -0.0                                   # a zero block: scale 0, codes 8
    out = []
    for a in x:
        y = torch.from_numpy(a).to(dtype)
        out.append(y.transpose(1, 2) if strided else y.transpose(1, 2).contiguous())
    return out


def _jax_round_trip(k, v, scale, layer, low, block_scale):
    """The independent reference: JAX's codec on the CPU -> ``[2, B, T, H, D]`` torch in k's dtype."""
    out = []
    with jax.default_device(jax.devices("cpu")[0]):
        for kv, x in enumerate((k, v)):
            xj = jnp.asarray(x.float().numpy()).astype(_JDT[x.dtype])
            g = jnp.float32(scale[layer, kv].item())
            if low:
                y = nvfp4.dequantize_reference(*nvfp4.quantize_reference(xj, g, block_scale), g, jnp.float32)
            else:
                y = decode_rows(encode_rows(xj, jnp.float8_e4m3fn, g), g, jnp.float32)
            out.append(torch.from_numpy(np.array(y)).to(x.dtype))
    return torch.stack(out)


def _assert_same(got, want):
    """Bit-equal 16-bit words, NaN anywhere equal to NaN (torch's cast canonicalizes NaN payloads)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    g, w = got.view(torch.int16)[~nan], want.view(torch.int16)[~nan]
    bad = (g != w).nonzero()
    assert bad.numel() == 0, (bad[:4].tolist(), got[~nan][bad[:4, 0]].tolist(), want[~nan][bad[:4, 0]].tolist())


SCALES = torch.tensor([[0.5, 2.0], [1e-3, 3.7], [2.0 ** -20, 1e4]], dtype=torch.float32)


@pytest.mark.parametrize("block_scale", tw.BLOCK_SCALES)
@pytest.mark.parametrize("low", [True, False], ids=["nvfp4", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_bits_equal_jax_codec(dtype, low, block_scale):
    """Interpreted kernel == torch reference == JAX's codec, bit for bit (head_dim 48: a padded block of columns)."""
    for layer, (b, t, h, d) in ((1, (2, 3, 4, 48)), (2, (1, 5, 2, 128))):
        k, v = _rows(layer, b, t, h, d, dtype)
        got = tw.round_trip_rows(k, v, SCALES, layer, low=low, block_scale=block_scale)
        want = _jax_round_trip(k, v, SCALES, layer, low, block_scale)
        _assert_same(got, want)
        _assert_same(torch_paged.round_trip_reference(k, v, SCALES, layer, low=low, block_scale=block_scale), want)
        assert got.is_contiguous() and got.shape == (2, b, t, h, d)


@pytest.mark.parametrize("low", [True, False], ids=["nvfp4", "fp8"])
def test_equals_store_then_read(low):
    """The round trip is what a reader gets from the bytes the write kernel stores: `write_rows_` into a pool, then
    decode those bytes (pages of 4 rows, slots permuted)."""
    b, t, h, d, layer, page = 2, 3, 2, 32, 1, 4
    k, v = _rows(7, b, t, h, d, torch.bfloat16)
    n = b * t
    slots = torch.randperm(4 * page)[:n]
    shape = (2, 4, 2, h, page)
    if low:
        pools = dict(low_data=torch.zeros(shape + (d // 2,), dtype=torch.uint8),
                     low_scales=torch.zeros(shape + (d // 16,), dtype=torch.uint8), low_gs=SCALES[:2].clone(),
                     high_rows=None, high_scale=None, plain_rows=None, plain_scale=None)
    else:
        pools = dict(low_data=None, low_scales=None, low_gs=None, high_rows=None, high_scale=None,
                     plain_rows=torch.zeros(shape + (d,), dtype=torch.uint8), plain_scale=SCALES[:2].clone())
    flat = lambda x: x.reshape(n, h, d)                                      # noqa: E731  tokens b * t + j
    tw.write_rows_(**pools, layer=layer, k=flat(k), v=flat(v), low_slot=slots, high_slot=None, page_size=page,
                   high_fp8=not low)
    pg, row = slots // page, slots % page
    read = []
    for kv in range(2):
        g = SCALES[layer, kv]
        if low:
            data, sc = pools["low_data"][layer, pg, kv, :, row], pools["low_scales"][layer, pg, kv, :, row]
            x = torch_paged.dequantize(data, sc, g, torch.bfloat16)
        else:
            x = torch_paged.decode_rows(pools["plain_rows"][layer, pg, kv, :, row], g, torch.bfloat16)
        read.append(x.reshape(b, t, h, d))
    _assert_same(tw.round_trip_rows(k, v, SCALES[:2], layer, low=low), torch.stack(read))


def test_dispatcher_picks_the_pool_scale():
    """`paged_ops.round_trip`: NVFP4 reads ``low_gs``; fp8 rows the twin's scale, else the plain pool's; the torch
    reference on CPU and the interpreted kernel under ``cpu_backend("triton")`` agree."""
    k, v = _rows(3, 2, 2, 2, 32, torch.bfloat16)
    a, b_ = SCALES[:2].clone(), SCALES[1:].clone()
    cases = [(TorchPools(low_gs=a, high_rows=torch.zeros(1, dtype=torch.uint8), high_scale=b_), True, a),
             (TorchPools(low_gs=a, high_rows=torch.zeros(1, dtype=torch.uint8), high_scale=b_), False, b_),
             (TorchPools(plain_rows=torch.zeros(1, dtype=torch.uint8), plain_scale=a), False, a)]
    for pools, low, scale in cases:
        want = _jax_round_trip(k, v, scale, 1, low, "max6")
        for backend in paged_ops.CPU_BACKENDS:
            with paged_ops.cpu_backend(backend):
                got = paged_ops.round_trip(pools, 1, k, v, low=low, block_scale="max6")
            _assert_same(torch.stack(got), want)
    with pytest.raises(ValueError, match="no NVFP4 pool"):
        paged_ops.round_trip(TorchPools(plain_rows=torch.zeros(1), plain_scale=a), 0, k, v, low=True,
                             block_scale="max6")


def test_no_rows():
    k = torch.zeros(2, 0, 2, 16, dtype=torch.bfloat16)
    out = tw.round_trip_rows(k, k, SCALES, 0, low=True)
    assert out.shape == (2, 2, 0, 2, 16)


def _bad_inputs():
    k = torch.zeros(1, 2, 2, 32, dtype=torch.bfloat16)
    return [
        ("k 3-D", dict(k=k[0]), "must be a [B, T, H, D] tensor"),
        ("k float32", dict(k=k.float(), v=k.float()), "expected bfloat16 or float16"),
        ("v shape", dict(v=k[:, :1]), "must share shape"),
        ("head_dim", dict(k=k[..., :24], v=k[..., :24]), "head_dim 24"),
        ("layer high", dict(layer=3), "layer 3 out of range [0, 3)"),
        ("layer negative", dict(layer=-1), "layer -1 out of range"),
        ("layer bool", dict(layer=True), "layer True out of range"),
        ("scale shape", dict(scale=SCALES[:, :1]), "scale must be a float32 [L, 2] tensor"),
        ("scale dtype", dict(scale=SCALES.double()), "scale must be a float32 [L, 2] tensor"),
        ("block_scale", dict(block_scale="max8"), "block_scale must be one of"),
        ("block_rows", dict(block_rows=3), "block_rows must be a power of two, got 3"),
    ], k


@pytest.mark.parametrize("case", range(11))
def test_bad_input_refused(case):
    cases, k = _bad_inputs()
    _, bad, text = cases[case]
    args = dict(k=k, v=k, scale=SCALES, layer=0, low=True)
    args.update(bad)
    with pytest.raises(ValueError) as err:
        tw.round_trip_rows(**args)
    assert text in str(err.value), str(err.value)


def _ptx_ops(ptx):
    return set(re.findall(r"^\s*(?:@!?%p\d+\s+)?([a-z][a-z0-9_.]*)", ptx, re.M))


@pytest.mark.parametrize("low,block_scale", [(True, "4over6"), (False, "max6")], ids=["nvfp4", "fp8"])
def test_cuda_launch_compiles_with_exact_float_ops(low, block_scale):
    """The CUDA kernel as `round_trip_rows` launches it (sm_90, compiled here without a GPU): ``div.rn`` divisions,
    ``.rn`` multiplies / adds (no FMA contraction), no flush-to-zero, no fp8 / fp4 conversion instruction; one
    kernel for every layer and token count."""
    k, v = _rows(0, 2, 3, 8, 128, torch.bfloat16)
    asm = {layer: tw.lower_round_trip_for_cuda(k, v, SCALES, layer, low=low, block_scale=block_scale)
           for layer in (1, 2)}
    assert asm[1]["ptx"] == asm[2]["ptx"]
    ops = _ptx_ops(asm[1]["ptx"])
    assert not [o for o in ops if o.startswith("fma") or ".ftz" in o or ".approx" in o], ops
    assert not [o for o in ops if o.startswith("cvt") and ("e4m3" in o or "e2m1" in o)], ops
    assert not [o for o in ops if re.match(r"(mul|add|sub|div)\.f32", o)], ops
    assert {"div.rn.f32", "mul.rn.f32"} <= ops, ops


@gpu
@pytest.mark.parametrize("block_scale", tw.BLOCK_SCALES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_bits_equal_jax_codec(dtype, block_scale):
    """The compiled kernel on the device: the same bits as JAX's codec, NVFP4 and fp8, at a decode step of a
    Llama-3-8B-shaped layer (16 rows x 8 heads x 128) and a 64-token verify step."""
    assert torch.cuda.is_available()
    for low in (True, False):
        for b, t in ((16, 1), (4, 64)):
            k, v = _rows(b + t, b, t, 8, 128, dtype)
            got = tw.round_trip_rows(k.cuda(), v.cuda(), SCALES.cuda(), 2, low=low, block_scale=block_scale)
            _assert_same(got.cpu(), _jax_round_trip(k, v, SCALES, 2, low, block_scale))
