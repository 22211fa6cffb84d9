"""interop.dlpack: zero-copy round trips per dtype (pointer equality), refused / copied crossings, NVFP4 bytes,
and (gpu) device zero-copy plus CUDA stream ordering."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from interop.dlpack import (HotBridge, ZeroCopyError, from_torch, nvfp4_to_torch, same_buffer, to_torch)
from jmixedkv import nvfp4

DTYPES = [(jnp.bfloat16, torch.bfloat16), (jnp.float16, torch.float16), (jnp.float32, torch.float32),
          (jnp.uint8, torch.uint8), (jnp.int32, torch.int32), (jnp.float8_e4m3fn, torch.float8_e4m3fn)]


def _random(dtype, shape, seed=0):
    rng = np.random.default_rng(seed)
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        return jnp.asarray(rng.integers(info.min, info.max, shape, endpoint=True).astype(np.dtype(dtype)))
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32) * 3).astype(dtype)


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy()


@pytest.mark.parametrize("jdt,tdt", DTYPES, ids=[str(t).split(".")[1] for _, t in DTYPES])
def test_round_trip_zero_copy(jdt, tdt):
    x = _random(jdt, (4, 3, 64))
    t = to_torch(x)
    assert t.dtype == tdt and tuple(t.shape) == x.shape
    assert t.data_ptr() == x.unsafe_buffer_pointer()
    np.testing.assert_array_equal(_bytes(t), np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint8)).reshape(4, 3, -1))
    y = from_torch(t)
    assert y.dtype == jnp.dtype(jdt) and y.unsafe_buffer_pointer() == t.data_ptr() == x.unsafe_buffer_pointer()
    np.testing.assert_array_equal(np.asarray(y).view(np.uint8), np.asarray(x).view(np.uint8))


@pytest.mark.parametrize("jdt,tdt", DTYPES, ids=[str(t).split(".")[1] for _, t in DTYPES])
def test_from_torch_owned_tensor_zero_copy(jdt, tdt):
    t = torch.from_dlpack(_random(jdt, (8, 32), seed=1)).clone()       # torch-owned memory
    y = from_torch(t, copy=False)
    assert same_buffer(y, t) and y.unsafe_buffer_pointer() == t.data_ptr()
    np.testing.assert_array_equal(np.asarray(y).view(np.uint8).reshape(8, -1), _bytes(t).reshape(8, -1))


def test_memory_is_shared():
    t = torch.zeros(64, dtype=torch.float32)
    y = from_torch(t)
    t[3] = 5.0                                   # documented: torch writes are visible through the JAX array
    assert float(y[3]) == 5.0


def test_transposed_view_is_zero_copy():
    base = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
    t = base.T
    y = from_torch(t, copy=False)
    assert y.shape == (32, 64) and y.unsafe_buffer_pointer() == base.data_ptr()
    np.testing.assert_array_equal(np.asarray(y), t.numpy())


@pytest.mark.parametrize("wide,narrow", [(torch.int64, jnp.int32), (torch.float64, jnp.float32)])
def test_wide_dtypes_refused_or_copied(wide, narrow):
    t = torch.arange(-5, 123, dtype=wide)
    with pytest.raises(ZeroCopyError, match=r"int32|float32") as e:
        from_torch(t, copy=False)
    assert "copy=None" in str(e.value)
    y = from_torch(t, copy=None)
    assert y.dtype == jnp.dtype(narrow)
    np.testing.assert_array_equal(np.asarray(y), t.numpy().astype(np.dtype(narrow)))
    assert y.unsafe_buffer_pointer() != t.data_ptr()


def test_int64_overflow_refused():
    with pytest.raises(ValueError, match="do not fit in int32"):
        from_torch(torch.tensor([0, 2 ** 40]), copy=None)


def test_misaligned_view():
    base = torch.arange(1000, dtype=torch.int32).view(torch.uint8)
    for offset in (1, 16, 32):
        t = base[offset:offset + 512]
        with pytest.raises(ZeroCopyError, match="64-byte aligned"):
            from_torch(t, copy=False)
        y = from_torch(t, copy=None)                      # documented copy
        np.testing.assert_array_equal(np.asarray(y), t.numpy())
        assert y.unsafe_buffer_pointer() % 64 == 0
    y = from_torch(base[64:128], copy=False)              # an aligned offset crosses zero-copy
    assert y.unsafe_buffer_pointer() == base[64:].data_ptr()


def test_non_compact_strides():
    t = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)[:, ::2]
    with pytest.raises(ZeroCopyError, match="strides"):
        from_torch(t, copy=False)
    np.testing.assert_array_equal(np.asarray(from_torch(t, copy=None)), t.numpy())
    b = torch.zeros(1, 32).expand(8, 32)
    with pytest.raises(ZeroCopyError, match="strides"):
        from_torch(b, copy=False)


def test_requires_grad_refused_even_with_copy():
    t = torch.zeros(4, 16, requires_grad=True)
    for copy in (False, None, True):
        with pytest.raises(ValueError, match="detach"):
            from_torch(t, copy=copy)


def test_explicit_copy_true():
    t = torch.arange(128, dtype=torch.int32)
    y = from_torch(t, copy=True)
    assert y.unsafe_buffer_pointer() != t.data_ptr()
    t[0] = 99
    assert int(y[0]) == 0


def test_bad_arguments():
    with pytest.raises(TypeError, match="torch.Tensor"):
        from_torch(np.zeros(3))
    with pytest.raises(TypeError, match="jax.Array"):
        to_torch(np.zeros(3))
    with pytest.raises(ValueError, match="sync"):
        from_torch(torch.zeros(4), sync="maybe")
    with pytest.raises(ValueError, match="copy"):
        from_torch(torch.zeros(4), copy="yes")
    with pytest.raises(ValueError, match="does not cross"):
        to_torch(jnp.zeros(3, jnp.int16))
    with pytest.raises(ZeroCopyError, match="does not cross"):
        from_torch(torch.zeros(4, dtype=torch.complex64))


def test_empty_tensors():
    y = from_torch(torch.zeros(0, 16, dtype=torch.bfloat16))
    assert y.shape == (0, 16)
    assert to_torch(jnp.zeros((0, 4), jnp.int32)).shape == (0, 4)


def test_nvfp4_crosses_as_bytes():
    """Packed E2M1 + E4M3 scale bytes cross zero-copy; torch decodes them (independent table decode) to the JAX
    reference dequantization, bit for bit."""
    x = jnp.asarray(np.random.default_rng(3).standard_normal((5, 2, 64)).astype(np.float32)).astype(jnp.bfloat16)
    gs = jnp.float32(0.75)
    data, scales = nvfp4.quantize_reference(x, gs)
    td, ts, tgs, meta = nvfp4_to_torch(data, scales, gs)
    assert meta is None                                          # no config given: the transform is not stated
    assert td.dtype == torch.uint8 and ts.dtype == torch.float8_e4m3fn and tgs.dtype == torch.float32
    assert td.data_ptr() == data.unsafe_buffer_pointer() and ts.data_ptr() == scales.unsafe_buffer_pointer()
    table = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float32)
    codes = torch.stack([td & 0xF, td >> 4], dim=-1).reshape(*td.shape[:-1], -1).long()
    blocks = table[codes].reshape(*codes.shape[:-1], -1, 16)
    got = ((blocks * ts.float()[..., None]) * tgs).reshape(codes.shape).to(torch.bfloat16)
    want = nvfp4.dequantize_reference(data, scales, gs, jnp.bfloat16)
    np.testing.assert_array_equal(_bytes(got), np.asarray(want).view(np.uint8))
    _, tsu, _, _ = nvfp4_to_torch(data, scales, scales_as_uint8=True)
    np.testing.assert_array_equal(tsu.numpy(), np.asarray(scales).view(np.uint8))
    with pytest.raises(ValueError, match="disagree"):
        nvfp4_to_torch(data[..., :16], scales)


@pytest.mark.parametrize("jdt,tdt", DTYPES, ids=[str(t).split(".")[1] for _, t in DTYPES])
def test_hot_bridge_round_trip_zero_copy(jdt, tdt):
    bridge = HotBridge(jax.devices("cpu")[0])
    t = torch.from_dlpack(_random(jdt, (4, 15, 1, 64), seed=2)).clone()       # torch-owned memory
    y = bridge.to_jax(t)
    assert y.dtype == jnp.dtype(jdt) and y.shape == tuple(t.shape) and y.unsafe_buffer_pointer() == t.data_ptr()
    np.testing.assert_array_equal(np.asarray(y).view(np.uint8).reshape(4, -1), _bytes(t).reshape(4, -1))
    back = bridge.to_torch(y)
    assert back.dtype == tdt and back.data_ptr() == t.data_ptr()
    torch.testing.assert_close(back, t, rtol=0, atol=0)


def test_hot_bridge_without_capsule_entry_points(monkeypatch):
    """A jaxlib without the capsule entry points: both directions go through `from_torch` / `to_torch`."""
    from jmixedkv import compat
    monkeypatch.setattr(compat, "have_dlpack_capsules", lambda: False)
    bridge = HotBridge(jax.devices("cpu")[0])
    assert not bridge.fast
    t = torch.arange(64, dtype=torch.float32)
    y = bridge.to_jax(t)
    assert y.unsafe_buffer_pointer() == t.data_ptr() and bridge.to_torch(y).data_ptr() == t.data_ptr()


def test_hot_bridge_falls_back_to_the_checked_crossing():
    """What the fast path cannot take as is goes through ``from_torch(copy=None)``: a copy where one is allowed
    (strided, int64 with a range check), the same refusals otherwise (requires_grad)."""
    bridge = HotBridge(jax.devices("cpu")[0])
    base = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
    strided = base[:, ::2]
    y = bridge.to_jax(strided)
    np.testing.assert_array_equal(np.asarray(y), strided.numpy())
    assert y.unsafe_buffer_pointer() != base.data_ptr()
    wide = torch.tensor([1, -2, 3], dtype=torch.int64)
    y = bridge.to_jax(wide)
    assert y.dtype == jnp.int32 and np.asarray(y).tolist() == [1, -2, 3]
    with pytest.raises(ValueError, match="do not fit in int32"):
        bridge.to_jax(torch.tensor([2 ** 40], dtype=torch.int64))
    with pytest.raises(ValueError, match="requires grad"):
        bridge.to_jax(torch.ones(4, requires_grad=True))
    misaligned = torch.zeros(65, dtype=torch.float32)[1:]
    y = bridge.to_jax(misaligned)
    assert y.shape == (64,) and y.unsafe_buffer_pointer() != misaligned.data_ptr()


# ------------------------------------------------------------------------------------------------- GPU
def _cuda_pair():
    if not torch.cuda.is_available():
        pytest.fail("gpu test needs torch with CUDA")
    gpus = jax.devices("gpu")
    return torch.device("cuda", gpus[0].local_hardware_id), gpus[0]


@pytest.mark.gpu
@pytest.mark.parametrize("jdt,tdt", DTYPES, ids=[str(t).split(".")[1] for _, t in DTYPES])
def test_gpu_zero_copy(jdt, tdt):
    tdev, jdev = _cuda_pair()
    x = jax.device_put(_random(jdt, (16, 128)), jdev)
    t = to_torch(x)
    assert t.device == tdev and t.data_ptr() == x.unsafe_buffer_pointer()
    y = from_torch(t)
    assert y.unsafe_buffer_pointer() == t.data_ptr() and next(iter(y.devices())) == jdev
    owned = torch.empty((16, 128), dtype=tdt, device=tdev)
    owned.copy_(t)
    z = from_torch(owned, copy=False)
    assert z.unsafe_buffer_pointer() == owned.data_ptr()
    np.testing.assert_array_equal(np.asarray(z).view(np.uint8), np.asarray(x).view(np.uint8))


@pytest.mark.gpu
def test_gpu_side_stream_producer_is_finished_before_jax_reads():
    """A tensor written by slow work queued on a non-default torch stream is imported with its final values."""
    tdev, _ = _cuda_pair()
    n = 4096
    a = torch.randn(n, n, device=tdev) / n ** 0.5
    out = torch.zeros(n, n, device=tdev)
    torch.cuda.synchronize(tdev)
    side = torch.cuda.Stream(tdev)
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)                 # ~0.1 s of spinning before the writes
        b = a
        for _ in range(8):
            b = b @ a                                  # big kernels on the side stream
        out.copy_(b)
        out.add_(1.0)
    x = from_torch(out)                                # sync=True: device-wide synchronize first
    y = x + 1.0                                        # JAX reads right away, on its own stream, into a new buffer
    torch.cuda.synchronize(tdev)
    want = (out + 1.0).cpu().numpy()
    np.testing.assert_array_equal(np.asarray(y), want)
    assert (want != 1.0).any()


@pytest.mark.gpu
@pytest.mark.parametrize("importer", ["from_torch", "hot_bridge"])
def test_gpu_stream_protocol_on_current_stream(importer):
    """sync='stream' (`from_torch` and `HotBridge.to_jax`): work on the *current* torch stream is ordered before
    JAX's read, zero-copy."""
    tdev, jdev = _cuda_pair()
    to_jax = HotBridge(jdev).to_jax if importer == "hot_bridge" else lambda t: from_torch(t, sync="stream")
    out = torch.zeros(1 << 24, device=tdev)
    torch.cuda.synchronize(tdev)
    side = torch.cuda.Stream(tdev)
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        out.fill_(7.0)
        x = to_jax(out)
        assert x.unsafe_buffer_pointer() == out.data_ptr()
        total = float(jnp.sum(x))
    assert total == 7.0 * (1 << 24)


@pytest.mark.gpu
def test_gpu_jax_producer_is_finished_before_torch_side_stream_reads():
    tdev, jdev = _cuda_pair()
    a = jax.device_put(jnp.asarray(np.random.default_rng(0).standard_normal((4096, 4096)), jnp.float32), jdev)
    f = jax.jit(lambda a: (a @ a @ a @ a) * 0 + 3.0)
    x = f(a)                                            # queued asynchronously on JAX's stream
    t = to_torch(x)                                     # sync=True: blocks until ready
    side = torch.cuda.Stream(tdev)
    with torch.cuda.stream(side):
        ok = bool((t == 3.0).all())
    assert ok


@pytest.mark.gpu
def test_gpu_hot_bridge_export_waits_for_jax():
    """`HotBridge.to_torch`: zero-copy, and torch's current (side) stream reads a slow JAX result only once it is
    ready (no host block)."""
    tdev, jdev = _cuda_pair()
    a = jax.device_put(jnp.asarray(np.random.default_rng(0).standard_normal((4096, 4096)), jnp.float32), jdev)
    f = jax.jit(lambda a: (a @ a @ a @ a) * 0 + 3.0)
    y = f(a)                                            # queued on JAX's stream, not finished
    with torch.cuda.stream(torch.cuda.Stream(tdev)):
        t = HotBridge(jdev).to_torch(y)
        assert t.data_ptr() == y.unsafe_buffer_pointer()
        ok = bool((t == 3.0).all())
    assert ok
