"""The fused write kernel (`pallas_kernels.write`) against the reference row store, bit for bit.

Every scenario drives `jmixedkv.append(..., backend="pallas")` (jitted once, reused) and the reference path
(`backend="reference"`, with its RoPE step run eagerly so that each jnp op rounds separately: see the FMA note
below) on identical poisoned states with permuted page ids, and compares every pool leaf bit-for-bit (NaN poison
included).

FMA note: ``lax.optimization_barrier`` does not stop FMA contraction (XLA CPU expands barriers before fusion:
`test_barrier_does_not_stop_fma` runs it), so `jmixedkv.rope` and the kernel's interpret path route every product
through the integer fence of `jmixedkv.numerics` (`launder`) instead. The eager reference is the separately-rounded
oracle.
"""
from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from helpers import assert_bits_equal, assert_trees_bit_equal, check_kernel, jit_static, poisoned_state
import jmixedkv as jk
from jmixedkv import numerics
from jmixedkv.compat import cross_lower_cuda, on_gpu
from jmixedkv.pools import kernel_arrays
from jmixedkv.rope import rope_cos_sin
from jmixedkv.state import GroupSpec
from pallas_kernels import write as W

PAGE = 8
T = 24  # tokens per append call (padded with seq -1): one compiled shape per scenario


# ------------------------------------------------------------------------------------------------ helpers
def assert_pools_equal(a, b, what=""):
    """Every pool leaf bit for bit; computed NaNs may differ in payload (x86 and NVIDIA GPUs generate different
    default NaNs for an invalid operation, e.g. RoPE of an Inf row ``inf * c - inf * s``). NVFP4 bytes and E4M3
    scales encode NaN explicitly (codes 0, scale 0x7F) and stay compared byte for byte."""
    assert_trees_bit_equal(a, b, what, any_nan=True)


def _chunk(lengths, starts, rng):
    """(seq, pos) i32[T] for sequences s getting positions starts[s] .. starts[s]+lengths[s]-1, shuffled,
    padded with seq -1 to T tokens."""
    seq = np.concatenate([np.full(n, s, np.int32) for s, n in enumerate(lengths)] + [np.zeros(0, np.int32)])
    pos = np.concatenate([np.arange(st, st + n, dtype=np.int32) for st, n in zip(starts, lengths)]
                         + [np.zeros(0, np.int32)])
    assert len(seq) <= T
    order = rng.permutation(len(seq))
    pad = T - len(seq)
    return (np.concatenate([seq[order], np.full(pad, -1, np.int32)]),
            np.concatenate([pos[order], rng.integers(0, 50, pad).astype(np.int32)]))


def _schedule():
    """Ragged chunks over 3 sequences: page edges (page-1, page, page+1), lengths 0 and 1, decode steps
    crossing first_n / last_n / ring boundaries."""
    return [(7, 0, 9), (1, 8, 8), (9, 1, 0), (1, 1, 1), (2, 1, 6), (1, 1, 1), (1, 1, 1)]


def _state(dtype, spec, first_n=5, last_n=9, gs=1.0, high_scale=1.0, seed=0):
    """Three empty admitted slots of a `poisoned_state` (24 pages, each slot may hold all of them)."""
    cfg = jk.KVCacheConfig(dtype, first_n=first_n, last_n=last_n, page_size=PAGE)
    return poisoned_state(cfg, spec, [0, 0, 0], seed=seed, num_pages=24, width=24, gs=gs, high_scale=high_scale)


def _rows(rng, shape, dtype, scale=3.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


def _append(st, k, v, q, p, layer, *, rope, backend):
    """`jmixedkv.append` with the arguments of `run_scenario` (``layer`` traced; None = all layers)."""
    return jk.append(st, layer, k, v, q, p, rope=rope, backend=backend)


def reference_append(st, k, v, seq, pos, layer, rope, device=None):
    """The reference path of `jmixedkv.write.write_rows`, with its RoPE step run eagerly (every op rounded
    separately) and the rest jitted: ``append(k=apply_rope(k).astype(k.dtype), rope=None)`` is exactly what
    ``write_rows`` does.

    RoPE runs on the default device: ``cos``/``sin`` are not correctly rounded and XLA CPU and CUDA's libdevice
    differ in the last bit, so the in-kernel RoPE matches the one of the backend it runs on. The row store and
    NVFP4 quantization run on ``device`` (default: the default device) and the result is put back on the default
    device. On the GPU this needs IEEE float32 division in XLA (`conftest` sets it:
    `jmixedkv.compat.xla_flags_with_ieee_division`); without it the reference run by XLA on the GPU differs from the
    convention in rare E2M1 ties (``1 / 0.0011160715`` gives 896.0 with XLA's default ``div.full.f32``: 1-6 bytes
    per step on the H200, bench/RESULTS.md)."""
    if rope is not None:
        k = jk.apply_rope(k, jnp.asarray(pos), rope).astype(k.dtype)
    device = device or jax.devices()[0]
    st, k, v, seq, pos, layer = jax.device_put((st, k, v, seq, pos, layer), device)
    with jax.default_device(device):
        out = jit_static(_append, rope=None, backend="reference")(st, k, v, seq, pos, layer)
    return jax.device_put(out, jax.devices()[0])


def reference_devices():
    """Where the reference is evaluated: the default device and, on a GPU, also the host CPU (IEEE by nature)."""
    cpu = jax.devices("cpu")[0]
    return [jax.devices()[0]] + ([cpu] if jax.devices()[0] != cpu else [])


def run_scenario(st, rope, *, all_layers=True, k_dtype=jnp.bfloat16, v_dtype=jnp.bfloat16, seed=1,
                 data_fn=None, steps=None):
    """Append the schedule with both backends (the kernel jitted and run twice: `helpers.check_kernel`), comparing
    the whole state after every step; each sequence continues from its current length. Returns the final state."""
    spec = st.groups[0]
    rng = np.random.default_rng(seed)
    starts = [int(n) for n in np.asarray(st.kv_lens)[:3]]
    for step, lengths in enumerate(steps or _schedule()):
        seq, pos = _chunk(lengths, starts, rng)
        starts = [s + n for s, n in zip(starts, lengths)]
        lead = (spec.num_layers,) if all_layers else ()
        shape = lead + (T, spec.num_kv_heads, spec.head_dim)
        k = data_fn(rng, shape, seq, pos) if data_fn else _rows(rng, shape, k_dtype)
        v = _rows(rng, shape, v_dtype, 1.0) if spec.kv_factor == 2 else None
        layer = None if all_layers else jnp.int32(step % spec.num_layers)
        devices = reference_devices()
        wants = [reference_append(st, k, v, seq, pos, layer, rope, device) for device in devices]
        assert all(int(w.error) == 0 for w in wants)
        got, _ = check_kernel(_append, wants[0], (st, k, v, seq, pos, layer),
                              kernel_kw=dict(rope=rope, backend="pallas"), any_nan=True,
                              msg=f"step {step}, reference on {devices[0]}")
        for device, want in zip(devices[1:], wants[1:]):
            assert_pools_equal(got.pools, want.pools, f"step {step}, reference on {device}")
        st = wants[0]
    return st


# ------------------------------------------------------------------------------------------------ scenarios
def test_mixed_all_layers_neox_nonfinite():
    """mixed_nvfp4_bf16, all layers in one call, full-width neox RoPE; last step holds inf / nan rows."""
    st = _state("mixed_nvfp4_bf16", GroupSpec(num_layers=2, num_kv_heads=2, head_dim=64),
                gs=np.array([[0.004, 0.002], [1.0, 0.5]], np.float32))
    rope = jk.RopeSpec("neox")

    def nonfinite(rng, shape, seq, pos):
        k = np.asarray(rng.standard_normal(shape) * 3, np.float32)
        k[0, 0, 0, 5], k[1, 1, 1, 40], k[0, 2, 1, 63] = np.inf, np.nan, -np.inf
        return jnp.asarray(k, jnp.bfloat16)

    st = run_scenario(st, rope)
    run_scenario(st, rope, data_fn=nonfinite, steps=[(1, 1, 1)], seed=7)


def test_mixed_single_layer_interleaved_partial_rotary_f32_k():
    """Traced layer, interleaved RoPE on the first 32 of 64 dims, K in float32 (rounded to f32, stored bf16)
    with V in bf16, on data chosen so that an FMA would change stored values."""
    st = _state("mixed_nvfp4_bf16", GroupSpec(num_layers=2, num_kv_heads=2, head_dim=64), first_n=3, last_n=12)
    rope = jk.RopeSpec("interleaved", theta=500.0, rotary_dim=32)
    hits = []

    def sensitive(rng, shape, seq, pos):
        k, n = fma_sensitive_rows(rng, shape, pos, rope)
        hits.append(n)
        return jnp.asarray(k)

    run_scenario(st, rope, all_layers=False, data_fn=sensitive, v_dtype=jnp.bfloat16)
    assert sum(hits) > 50  # the data really separates FMA from separate rounding


def test_low_group_all_layers_no_rope_d128():
    """dtype 'nvfp4' (low pool only), calibrated per-layer K/V global scales, head_dim 128, no RoPE."""
    gs = jk.nvfp4.global_scale_from_amax(jnp.asarray([[9.0, 3.0], [20.0, 0.5]]))
    st = _state("nvfp4", GroupSpec(num_layers=2, num_kv_heads=2, head_dim=128), first_n=0, last_n=0, gs=gs)
    assert st.pools[0].high is None and st.pools[0].plain is None
    run_scenario(st, None, steps=_schedule()[:4])


def test_plain_group_single_layer_d256():
    """dtype 'bf16' (plain pool, every token at its low slot), head_dim 256, neox RoPE on 16 dims."""
    st = _state("bf16", GroupSpec(num_layers=2, num_kv_heads=1, head_dim=256), first_n=0, last_n=0)
    run_scenario(st, jk.RopeSpec("neox", rotary_dim=16), all_layers=False, steps=_schedule()[:4])


def test_mixed_fp8_twin_all_layers():
    """mixed_nvfp4_fp8: fp8 twin rows e4m3(clip(x / scale)) with per-layer K/V scales; interleaved RoPE."""
    st = _state("mixed_nvfp4_fp8", GroupSpec(num_layers=2, num_kv_heads=2, head_dim=64), first_n=8, last_n=8,
                gs=0.01, high_scale=np.array([[0.01, 0.02], [0.003, 1.0]], np.float32))
    run_scenario(st, jk.RopeSpec("interleaved"), steps=_schedule()[:4])


def test_mla_latent_576_fp16_twin():
    """kv_factor 1 (MLA latent), head_dim 576 (padded to 1024 inside the kernel), fp16 twin, v=None."""
    st = _state("mixed_nvfp4_fp16", GroupSpec(num_layers=1, num_kv_heads=1, head_dim=576, kv_factor=1))
    run_scenario(st, jk.RopeSpec("neox", rotary_dim=64), all_layers=False, k_dtype=jnp.float16,
                 steps=_schedule()[:4])


# ------------------------------------------------------------------------------------------------ FMA
def fma_sensitive_rows(rng, shape, pos, rope, host_cos_sin=None):
    """f32 K ``[..., T, H, D]`` where, for many rotated elements, ``bf16(x*c - y*s)`` rounded separately differs
    from the FMA result ``bf16(fma(x, c, -y*s))``. Returns (k, number of such elements)."""
    d = shape[-1]
    rd = rope.rotary_dim or d
    cos, sin = host_cos_sin or map(np.asarray, rope_cos_sin(jnp.asarray(pos), rd, rope.theta))
    k = (rng.standard_normal(shape) * 3).astype(np.float32)
    half = rd // 2
    if rope.style == "neox":
        xi, yi = np.arange(half), np.arange(half) + half
    else:
        xi, yi = np.arange(0, rd, 2), np.arange(1, rd, 2)
    c = np.broadcast_to(cos[:, None, :], k.shape[:-1] + (half,)).astype(np.float32)
    s = np.broadcast_to(sin[:, None, :], k.shape[:-1] + (half,)).astype(np.float32)
    y = k[..., yi]
    ys = (y * s).astype(np.float32)
    # aim x*c - ys at a bf16 rounding midpoint m, then walk x by a few ulps
    b = (rng.standard_normal(ys.shape) * 4).astype(ml_dtypes.bfloat16).astype(np.float32)
    m = ((b.view(np.uint32) & 0xFFFF0000) | 0x8000).view(np.float32)
    ok = np.abs(c) > 0.25
    x0 = np.where(ok, ((m + ys) / np.where(ok, c, 1)).astype(np.float32), k[..., xi])
    best, found = x0.copy(), np.zeros(x0.shape, bool)
    for step in (0, 1, -1, 2, -2, 3, -3, 4, -4):
        cand = (x0.view(np.int32) + step).view(np.float32)
        sep, fma = _sep_and_fma(cand, c, ys)
        hit = ok & ~found & (sep.astype(ml_dtypes.bfloat16) != fma.astype(ml_dtypes.bfloat16))
        best = np.where(hit, cand, best)
        found |= hit
    k[..., xi] = np.where(found, best, k[..., xi])
    return k, int(found.sum())


def _sep_and_fma(x, c, ys):
    sep = ((x * c).astype(np.float32) - ys).astype(np.float32)
    fma = (x.astype(np.float64) * c.astype(np.float64) - ys.astype(np.float64)).astype(np.float32)
    return sep, fma


def numpy_rope(x, cos, sin, rope):
    """Separately rounded float32 RoPE on the host (numpy never contracts)."""
    d = x.shape[-1]
    rd = rope.rotary_dim or d
    out = x.copy()
    if rope.style == "neox":
        xi, yi = np.arange(rd // 2), np.arange(rd // 2) + rd // 2
    else:
        xi, yi = np.arange(0, rd, 2), np.arange(1, rd, 2)
    a, b = x[..., xi], x[..., yi]
    out[..., xi] = (a * cos).astype(np.float32) - (b * sin).astype(np.float32)
    out[..., yi] = (b * cos).astype(np.float32) + (a * sin).astype(np.float32)
    return out


def _rope_rows_check(style, interpret):
    rope = jk.RopeSpec(style, theta=10000.0, rotary_dim=96 if style == "neox" else None)
    rng = np.random.default_rng(3)
    t, d = 32, 128
    rd = rope.rotary_dim or d
    xi, yi = ((np.arange(rd // 2), np.arange(rd // 2) + rd // 2) if style == "neox"
              else (np.arange(0, rd, 2), np.arange(1, rd, 2)))
    pos = rng.integers(0, 100000, t).astype(np.int32)
    x = (rng.standard_normal((t, d)) * 3).astype(np.float32)
    pos[:2] = 0                           # sin = +0: y' = -0 * 1 + x * 0 is +0 or -0 by the sign of x
    x[:2, yi] = -0.0
    x[1, xi] = -np.abs(x[1, xi])
    got = np.asarray(W.rope_rows_f32(x, pos, rope.style, rope.theta, rope.rotary_dim, interpret=interpret))
    cos, sin = map(np.asarray, rope_cos_sin(jnp.asarray(pos), rd, rope.theta))
    want = numpy_rope(x, cos, sin, rope)
    assert_bits_equal(got, want)
    # sensitivity: an FMA in the first output of each pair would change many of these values
    _, fma = _sep_and_fma(x[:, xi], cos, (x[:, yi] * sin).astype(np.float32))
    assert (fma != want[:, xi]).sum() > 100


@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_rope_rows_interpret_match_numpy(style):
    _rope_rows_check(style, interpret=True)


def test_barrier_does_not_stop_fma():
    """Why `jmixedkv.rope` and the kernels' jnp paths fence products with `jmixedkv.numerics.launder` rather than
    ``lax.optimization_barrier``: jitted on XLA CPU, ``x*c - y*s`` is contracted into ``fma(x, c, -y*s)`` with or
    without a barrier around the two products (XLA CPU expands barriers before fusion), while the products
    routed through the integer fence (`numerics.opaque_zero` + `numerics.launder`) are rounded separately. The
    unfenced form is checked too, so the test fails if XLA stops contracting (the fence would then be untested)
    as well as if the fence stops working."""
    rng = np.random.default_rng(0)
    x, y = (rng.standard_normal((2, 4096)) * 3).astype(np.float32)
    c, s = np.cos(rng.uniform(0, 50, 4096)).astype(np.float32), np.sin(rng.uniform(0, 50, 4096)).astype(np.float32)
    sep, fma = _sep_and_fma(x, c, (y * s).astype(np.float32))
    sensitive = sep != fma
    assert sensitive.sum() > 100                                     # data where an FMA changes the result

    def plain(x_, y_, c_, s_):
        return x_ * c_ - y_ * s_

    def barrier(x_, y_, c_, s_):
        a, b = jax.lax.optimization_barrier((x_ * c_, y_ * s_))
        return a - b

    def fenced(x_, y_, c_, s_):
        z = numerics.opaque_zero(c_)
        return numerics.launder(x_ * c_, z) - numerics.launder(y_ * s_, z)

    cpu = jax.devices("cpu")[0]
    args = [jax.device_put(a, cpu) for a in (x, y, c, s)]
    run = lambda f: np.asarray(jax.jit(f)(*args))  # noqa: E731
    assert_bits_equal(run(plain)[sensitive], fma[sensitive], "unfenced form on XLA CPU: contracted into an FMA")
    assert_bits_equal(run(barrier)[sensitive], fma[sensitive], "barrier form on XLA CPU: contracted into an FMA")
    assert_bits_equal(run(fenced), sep, "numerics.launder fence: every product rounded")


# ------------------------------------------------------------------------------------------------ validation
def raw_pools(pools):
    """The kernel's pool arguments (``low=``, ``high=``, ``plain=`` raw array tuples) of a `GroupPools`."""
    return dict(low=kernel_arrays(pools.low), high=kernel_arrays(pools.high), plain=kernel_arrays(pools.plain))


def test_host_validation_errors():
    st = _state("mixed_nvfp4_bf16", GroupSpec(num_layers=2, num_kv_heads=2, head_dim=64))
    pools = raw_pools(st.pools[0])
    k = jnp.zeros((4, 2, 64), jnp.bfloat16)
    slots = jnp.zeros((4,), jnp.int32)
    call = lambda **kw: W.write_rows(**{**dict(k=k, v=k, layer=0, low_slot=slots,  # noqa: E731
                                                high_slot=slots, page_size=PAGE, **pools), **kw})
    with pytest.raises(ValueError, match="H=2, D=64"):
        call(k=jnp.zeros((4, 2, 32)), v=jnp.zeros((4, 2, 32)))
    with pytest.raises(ValueError, match="v must have"):
        call(v=None)
    with pytest.raises(ValueError, match="page_size=16"):
        call(page_size=16)
    with pytest.raises(ValueError, match="layer=5"):
        call(layer=5)
    with pytest.raises(ValueError, match="low_slot must be int"):
        call(low_slot=jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="float array"):
        call(k=jnp.zeros((4, 2, 64), jnp.int32), v=jnp.zeros((4, 2, 64), jnp.int32))
    with pytest.raises(ValueError, match="rope needs positions"):
        call(rope_style="neox")
    with pytest.raises(ValueError, match="rotary_dim=128"):
        call(rope_style="neox", rotary_dim=128, positions=slots)
    with pytest.raises(ValueError, match="rotary_dim=7 must be even"):
        call(rope_style="neox", rotary_dim=7, positions=slots)
    with pytest.raises(ValueError, match="rope_style must be"):
        call(rope_style="gptj", positions=slots)
    with pytest.raises(ValueError, match="a mixed group needs high_slot"):
        call(high_slot=None)
    for absent in (dict(low=None), dict(plain=pools["high"]), dict(low=None, plain=pools["high"])):
        with pytest.raises(ValueError, match="pass low= "):
            call(**absent)
    with pytest.raises(ValueError, match="all-layer k has 3"):
        call(k=jnp.zeros((3, 4, 2, 64)), v=jnp.zeros((3, 4, 2, 64)), layer=None)
    with pytest.raises(ValueError, match="heads_per_program=3"):
        call(heads_per_program=3)
    out = call(k=k[:0], v=k[:0], low_slot=slots[:0], high_slot=slots[:0])                # T == 0: no-op
    assert len(out) == 4 and all(a is b for a, b in zip(out, (*pools["low"][:2], pools["high"][0], None)))


# ------------------------------------------------------------------------------------------------ CUDA lowering
def _lower_append(st, rope, layer=None, kv=True):
    spec = st.groups[0]
    lead = () if layer is not None else (spec.num_layers,)
    k = jnp.zeros(lead + (T, spec.num_kv_heads, spec.head_dim), jnp.bfloat16)
    seq, pos = jnp.zeros((T,), jnp.int32), jnp.arange(T, dtype=jnp.int32)
    with W.lowering_for_cuda():
        fn = lambda s, k, v, q, p: jk.append(s, layer, k, v, q, p, rope=rope, backend="pallas")  # noqa
        return cross_lower_cuda(fn, st, k, k if kv else None, seq, pos, donate_argnums=0)


def _check_in_place(text, n_pools):
    """The Triton custom call aliases every pool output to its input, and each of those inputs is a donated
    parameter of the jitted append (``tf.aliasing_output``): XLA needs no pool copy."""
    call = next(line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line)
    assert call.count("stablehlo.output_operand_alias") == n_pools
    operands = re.search(r"triton\(([^)]*)\)", call).group(1).split(", ")
    aliased = [int(i) for i in re.findall(r"operand_index = (\d+)", call)]
    donated = set(re.findall(r"(%arg\d+): [^,]*tf\.aliasing_output", text))
    assert all(operands[i] in donated for i in aliased), (operands, aliased, donated)
    assert W.KERNEL_NAME in call


def test_cross_lower_cuda_mixed_all_layers_in_place():
    st = _state("mixed_nvfp4_bf16", GroupSpec(num_layers=2, num_kv_heads=4, head_dim=128))
    _check_in_place(_lower_append(st, jk.RopeSpec("neox", rotary_dim=64)), 3)
    _check_in_place(_lower_append(st, jk.RopeSpec("neox")), 3)    # whole-head neox: the two-halves path


def test_cross_lower_cuda_fp8_and_mla():
    st = _state("mixed_nvfp4_fp8", GroupSpec(num_layers=2, num_kv_heads=2, head_dim=256))
    _check_in_place(_lower_append(st, jk.RopeSpec("interleaved"), layer=1), 3)
    st = _state("mixed_nvfp4_bf16", GroupSpec(num_layers=1, num_kv_heads=1, head_dim=576, kv_factor=1))
    _check_in_place(_lower_append(st, jk.RopeSpec("neox", rotary_dim=64), layer=0, kv=False), 3)
    st = _state("bf16", GroupSpec(num_layers=2, num_kv_heads=2, head_dim=64), first_n=0, last_n=0)
    _check_in_place(_lower_append(st, None), 1)


def test_kernel_ir_uses_rounded_ptx_ops():
    st = _state("mixed_nvfp4_bf16", GroupSpec(num_layers=1, num_kv_heads=1, head_dim=64))
    slots = jnp.arange(16, dtype=jnp.int32)
    k = jnp.zeros((16, 1, 64), jnp.bfloat16)
    text = W.dump_kernel_ir(k, k, 0, slots, slots, PAGE, slots, rope_style="neox", **raw_pools(st.pools[0]))
    assert "mul.rn.f32 $0" in text and "sub.rn.f32 $0" in text and "div.rn.f32 $0" in text
    assert not re.search(r"\barith\.divf\b.*f32", text)  # Triton would emit div.full.f32 (approximate)


def test_cross_lower_rope_rows():
    with W.lowering_for_cuda():
        cross_lower_cuda(lambda x, p: W.rope_rows_f32(x, p, "interleaved"),
                         jnp.zeros((32, 128), jnp.float32), jnp.zeros((32,), jnp.int32))


# ------------------------------------------------------------------------------------------------ GPU
gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_gpu_rope_rows_match_numpy(style):
    assert on_gpu()
    _rope_rows_check(style, interpret=False)


@gpu
def test_gpu_scenarios_bit_exact():
    assert on_gpu()
    test_mixed_all_layers_neox_nonfinite()
    test_mixed_single_layer_interleaved_partial_rotary_f32_k()
    test_low_group_all_layers_no_rope_d128()
    test_plain_group_single_layer_d256()
    test_mixed_fp8_twin_all_layers()
    test_mla_latent_576_fp16_twin()


@gpu
def test_gpu_fma_sensitive_rows_match_numpy():
    """High rows written with in-kernel RoPE equal bf16(numpy separately-rounded RoPE) on FMA-sensitive data."""
    assert on_gpu()
    spec = GroupSpec(num_layers=1, num_kv_heads=4, head_dim=128)
    cfg = jk.KVCacheConfig("mixed_nvfp4_bf16", first_n=64, last_n=64, page_size=PAGE)
    st = jk.init_state(cfg, spec, num_pages=16, max_seqs=1)
    st = jk.admit(st, 0)
    rope = jk.RopeSpec("neox", theta=10000.0)
    n = 64
    pos = np.arange(n, dtype=np.int32) * 37 % 64  # a permutation of 0..63
    cos, sin = map(np.asarray, jax.jit(lambda p: rope_cos_sin(p, 128, rope.theta))(jnp.asarray(pos)))
    k, hits = fma_sensitive_rows(np.random.default_rng(5), (n, 4, 128), pos, rope, host_cos_sin=(cos, sin))
    assert hits > 500
    k[pos == 0, :, 64:] = -0.0                 # sin = +0 at position 0: the sign of each rotated zero is tested
    seq = np.zeros(n, np.int32)
    out = jk.append(st, 0, jnp.asarray(k), jnp.asarray(k), seq, pos, rope=rope, backend="pallas")
    hslot = np.asarray(jk.state.write_slots(out, jnp.asarray(seq), jnp.asarray(pos))[1])
    rows = np.asarray(out.pools[0].high.rows[0][hslot // PAGE, 0, :, hslot % PAGE, :])  # [T, H, D]
    want = numpy_rope(k, cos[:, None, :], sin[:, None, :], rope).astype(ml_dtypes.bfloat16)
    assert_bits_equal(rows, want)


def test_keep_fences_fma_whatever_its_operand():
    """`numerics.keep` holds with a second operand whose sign bit the compiler can prove clear (``jnp.abs(c)``:
    LLVM's known bits folded the former sign-bit fence away, leaving ``fma(x, c, -y*s)``), in jnp and in a Pallas
    kernel body (interpret mode; the Triton lowering accepts it), and returns every value unchanged bit for bit
    (the former fence set the low bit of negative values)."""
    from jmixedkv.compat import pl, triton_params
    x, y, t = np.random.default_rng(1).standard_normal((3, 1024)).astype(np.float32) * np.float32([[3], [3], [20]])
    c, s = np.cos(t), np.sin(t)
    sep, fma = _sep_and_fma(x, c, y * s)
    assert (sep != fma).sum() > 20                                  # data where an FMA changes the result

    def fenced(x_, y_, c_, s_):
        return numerics.keep(x_ * c_, jnp.abs(c_)) - numerics.keep(y_ * s_, jnp.abs(c_))

    def kernel(*refs):
        refs[-1][...] = fenced(*(r[...] for r in refs[:-1]))

    call = lambda interpret: pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, jnp.float32),  # noqa: E731
                                            interpret=interpret, compiler_params=triton_params())
    args = [jax.device_put(a, jax.devices("cpu")[0]) for a in (x, y, c, s)]
    unfenced = np.asarray(jax.jit(lambda *a: a[0] * a[2] - a[1] * a[3])(*args))
    assert_bits_equal(unfenced[sep != fma], fma[sep != fma], "unfenced form on XLA CPU: contracted into an FMA")
    assert_bits_equal(np.asarray(jax.jit(fenced)(*args)), sep, "keep on |c|, jnp: every product rounded")
    assert_bits_equal(np.asarray(jax.jit(call(True))(*args)), sep, "keep on |c|, Pallas interpret")
    cross_lower_cuda(call(False), *args)                            # raises if the Triton lowering rejects it
    v = np.concatenate([x * c, np.float32([-0.0, np.inf, -np.inf, np.nan, -np.nan, -1e-45])]).astype(np.float32)
    assert_bits_equal(np.asarray(jax.jit(lambda a: numerics.keep(a, a))(v)), v, "keep is the identity")
