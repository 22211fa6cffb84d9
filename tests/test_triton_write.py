"""The Triton write kernel of the torch hot path (`interop.triton_write.write_rows_`) against the JAX reference
`jmixedkv.write.write_rows_reference`, bit for bit, on every pool.

CPU tests run the kernel in Triton's interpreter, and compile its CUDA form for sm_90 without a GPU
(`interop.triton_write.lower_for_cuda`: the launch binds, one kernel serves every layer, the PTX float ops are exact).
The ``gpu`` tests launch it compiled (``interpret=False``) and check the same bits on the device, at a small size
against the full reference and at a model-like size (32 layers x 8 heads x 128, a few GiB of pools) against per-row
references plus "no other byte changed".

Pools are poisoned: random bytes in the byte pools, random *finite* 16-bit words in 16-bit pools (the JAX reference
quiets / canonicalizes NaN payloads of rows it copies; in 16-bit pools two NaNs compare equal, and
`test_nan_poison_is_untouched` checks NaN-poisoned rows against the original bytes instead). Slots are permuted,
some -1.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import triton  # noqa: F401  (a test dependency: the kernel needs it, no silent skip)

from helpers import assert_bits_equal
from jmixedkv import nvfp4
from jmixedkv.numerics import SIXTH
from jmixedkv.pools import GroupPools, LowPool, RowPool, encode_rows
from jmixedkv.write import write_rows_reference
from interop import triton_write as tw

gpu = pytest.mark.gpu
#: the references, jitted (one compile per shape instead of one per eager op; they pin the same bits either way)
_write_rows_reference = jax.jit(write_rows_reference, static_argnums=(5, 6))
_quantize_reference = jax.jit(nvfp4.quantize_reference, static_argnums=2)

#: cache kinds: (low pool?, row pool "high" / "plain" / None, row dtype, k / v dtype)
KINDS = {
    "mixed_bf16": (True, "high", torch.bfloat16, torch.bfloat16),
    "mixed_fp16": (True, "high", torch.float16, torch.float16),
    "mixed_fp8": (True, "high", torch.uint8, torch.bfloat16),
    "nvfp4_bf16": (True, None, None, torch.bfloat16),
    "nvfp4_fp16": (True, None, None, torch.float16),
    "plain_bf16": (False, "plain", torch.bfloat16, torch.bfloat16),
    "plain_fp8": (False, "plain", torch.float8_e4m3fn, torch.float16),
}


# ------------------------------------------------------------------------------------------ data
def _bits16(rng, shape, dtype, finite=True):
    """Random 16-bit words of ``dtype`` (finite ones only when ``finite``: exponent all-ones avoided)."""
    w = rng.integers(0, 1 << 16, shape, dtype=np.uint32).astype(np.uint16)
    if finite:
        exp_mask = 0x7F80 if dtype == torch.bfloat16 else 0x7C00
        w = np.where((w & exp_mask) == exp_mask, w & ~np.uint16(0x4000), w).astype(np.uint16)
    return torch.from_numpy(w.view(np.int16)).view(dtype)


def _edge_blocks():
    """f32[n, 16] blocks that pin the corner cases (each exactly representable in bf16 and fp16)."""
    ties = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 0.125]
    b = np.zeros((13, 16), np.float32)
    b[0] = ties                                     # gs = 1: scale 1.0, every element an E2M1 midpoint
    b[1] = -0.0                                     # scale 0, codes 8
    b[2, ::2] = -0.0                                # +-0 mixed
    b[3] = np.linspace(-3, 3, 16)
    b[3, 5] = np.nan                                # a NaN block
    b[4] = np.linspace(-1, 2, 16)
    b[4, 7] = np.inf                                # inf: scale 448, element 6
    b[5] = np.linspace(-2, 1, 16)
    b[5, 9] = -np.inf
    b[6] = np.linspace(-6.375, 6.375, 16)           # amax / 6 = 1.0625: an E4M3 tie (-> 1.0)
    b[7] = np.linspace(-7.125, 1.0, 16)             # amax / 6 = 1.1875: an E4M3 tie (-> 1.25)
    b[8] = np.linspace(-1, 1, 16) * 2.0 ** -12      # tiny: subnormal / zero scales
    b[9] = np.linspace(-1, 1, 16) * 2.0 ** 12       # large (fp16-finite)
    b[10] = [448.0, -448.0, 464.0, -464.0, 480.0, 1.0625, 1.1875, -0.0, 0.0, 2.0 ** -10, 2.0 ** -9, 3 * 2.0 ** -10,
             -3 * 2.0 ** -10, 2.0 ** -7, 0.5, -0.5]                       # E4M3 ties / saturation of fp8 rows
    b[11] = np.linspace(-1, 1, 16)
    b[11, 3] = -np.nan                              # a negative NaN (fp8 rows keep its sign)
    b[12, :5] = [6.0, 3.0, -3.0, 1.5, -1.5]         # gs = 1: exact under max6 and max4: equal errors, "4over6" -> max6
    return b


def _rows(rng, t, h, d, dtype, edges: bool):
    """``(k, v)`` ``[T, H, D]``: normal rows, each scaled by 10^U(-3, 3); the first rows of K hold `_edge_blocks`."""
    x = rng.normal(size=(2, t, h, d)) * 10.0 ** rng.uniform(-3, 3, size=(2, t, h, 1))
    x = x.astype(np.float32)
    if edges:
        e = _edge_blocks().reshape(-1)[:t * h * d]                  # as many edge blocks as fit in K
        flat = x.reshape(-1)
        flat[:e.size] = e
        v_flat = x[1].reshape(-1)
        v_flat[:e.size] = e[::-1]
        x[1] = v_flat.reshape(t, h, d)
        x = flat.reshape(x.shape)
    out = []
    for a in x:                                      # NaNs as quiet NaNs with the source's sign (torch's cast drops it)
        y = torch.from_numpy(a.copy()).to(dtype)
        nan = torch.from_numpy(np.isnan(a))
        sign = torch.from_numpy(np.signbit(a) & np.isnan(a)).to(torch.int16) * -2 ** 15
        quiet = 0x7FC0 if dtype == torch.bfloat16 else 0x7E00
        y.view(torch.int16)[nan] = (sign | quiet)[nan]
        out.append(y)
    return tuple(out)


def _pools(rng, kind, layers, pages, twin_pages, h, page, d, gs, row_scale):
    """Poisoned torch pools of ``kind`` (`KINDS`) as a dict of the contract's seven arguments."""
    has_low, row_pool, row_dtype, _ = KINDS[kind]
    lead = (layers, pages, 2, h, page)
    out = dict.fromkeys(("low_data", "low_scales", "low_gs", "high_rows", "high_scale", "plain_rows", "plain_scale"))
    if has_low:
        out["low_data"] = torch.from_numpy(rng.integers(0, 256, lead + (d // 2,), dtype=np.uint8))
        out["low_scales"] = torch.from_numpy(rng.integers(0, 256, lead + (d // 16,), dtype=np.uint8))
        out["low_gs"] = torch.tensor(gs, dtype=torch.float32)
    if row_pool is not None:
        shape = ((layers, twin_pages) if row_pool == "high" else (layers, pages)) + (2, h, page, d)
        if row_dtype in (torch.uint8, torch.float8_e4m3fn):
            rows = torch.from_numpy(rng.integers(0, 256, shape, dtype=np.uint8)).view(row_dtype)
        else:
            rows = _bits16(rng, shape, row_dtype)
        out[f"{row_pool}_rows"] = rows
        out[f"{row_pool}_scale"] = torch.tensor(row_scale, dtype=torch.float32)
    return out


def _slots(rng, t, num_slots, skips):
    """i64[T]: distinct slots in a random order, ``skips`` of them -1."""
    s = rng.permutation(num_slots)[:t].astype(np.int64)
    s[rng.permutation(t)[:skips]] = -1
    return torch.from_numpy(s)


# ------------------------------------------------------------------------------------------ torch <-> jax
def _np(t):
    """numpy array of a CPU / CUDA tensor, with JAX's dtypes (bf16 -> ml_dtypes.bfloat16, fp8 -> float8_e4m3fn)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return t.numpy()


def _reference(p, layer, k, v, low_slot, high_slot, page, block_scale):
    """`write_rows_reference` on the JAX copies of the pools -> the expected pools as numpy bytes, by name."""
    with jax.default_device(jax.devices("cpu")[0]):
        return _reference_cpu(p, layer, k, v, low_slot, high_slot, page, block_scale)


def _reference_cpu(p, layer, k, v, low_slot, high_slot, page, block_scale):
    f8 = lambda a: a.view(ml_dtypes.float8_e4m3fn) if a.dtype == np.uint8 else a  # noqa: E731
    low = high = plain = None
    if p["low_data"] is not None:
        low = LowPool(jnp.asarray(_np(p["low_data"])), jnp.asarray(f8(_np(p["low_scales"]))),
                      jnp.asarray(_np(p["low_gs"])))
    if p["high_rows"] is not None:
        high = RowPool(jnp.asarray(f8(_np(p["high_rows"]))), jnp.asarray(_np(p["high_scale"])))
    if p["plain_rows"] is not None:
        plain = RowPool(jnp.asarray(f8(_np(p["plain_rows"]))), jnp.asarray(_np(p["plain_scale"])))
    x = jnp.stack([jnp.asarray(_np(k)), jnp.asarray(_np(v))], axis=-3)
    hs = jnp.asarray(_np(high_slot if high_slot is not None else low_slot).astype(np.int32))
    out = _write_rows_reference(GroupPools(low, high, plain), x, layer,
                                jnp.asarray(_np(low_slot).astype(np.int32)), hs, page, block_scale)
    want = {}
    if out.low is not None:
        want.update(low_data=np.asarray(out.low.data), low_scales=np.asarray(out.low.scales))
    if out.high is not None:
        want["high_rows"] = np.asarray(out.high.rows)
    if out.plain is not None:
        want["plain_rows"] = np.asarray(out.plain.rows)
    return want


def _assert_pools_equal(p, want, msg):
    """Every pool byte for byte; in 16-bit row pools two NaNs are equal whatever their payloads (the reference's
    XLA copies quiet or canonicalize NaN payloads; the kernel copies the row's bits)."""
    for name, w in want.items():
        got = _np(p[name])
        if got.dtype == np.uint8 and w.dtype != np.uint8:
            got = got.view(w.dtype)
        assert_bits_equal(got, w, f"{msg} {name}", any_nan=w.dtype.itemsize == 2)


# ------------------------------------------------------------------------------------------ the cases
def _case(kind, block_scale, *, seed=0, layers=3, layer=2, pages=6, twin_pages=4, h=3, page=8, d=64, t=13, skips=3,
          gs=None, row_scale=None, device="cpu", interpret=None, strided=False, slot_dtype=torch.int64):
    """Write ``t`` tokens with the kernel and compare every pool with the reference; returns the kernel's pools."""
    rng = np.random.default_rng(seed)
    gs = gs if gs is not None else rng.uniform(0.005, 2.0, (layers, 2)).tolist()
    row_scale = row_scale if row_scale is not None else rng.uniform(0.02, 1.5, (layers, 2)).tolist()
    attn = KINDS[kind][3]
    p = _pools(rng, kind, layers, pages, twin_pages, h, page, d, gs, row_scale)
    k, v = _rows(rng, t, h, d, attn, edges=True)
    if strided:                                      # non-contiguous token / head strides
        k = torch.cat([k, k], dim=1)[:, ::2] if h > 1 else k.expand(t, 1, d)
        v = torch.stack([v, v], dim=0)[1]
        k = k.transpose(0, 1).contiguous().transpose(0, 1)
    low_slot = _slots(rng, t, pages * page, skips).to(slot_dtype)
    high_slot = _slots(rng, t, twin_pages * page, skips).to(slot_dtype) if KINDS[kind][1] == "high" else None
    want = _reference(p, layer, k, v, low_slot, high_slot, page, block_scale)
    dev = {name: (x.to(device, copy=True) if x is not None else None) for name, x in p.items()}
    tw.write_rows_(**dev, layer=layer, k=k.to(device), v=v.to(device), low_slot=low_slot.to(device),
                   high_slot=None if high_slot is None else high_slot.to(device), page_size=page,
                   block_scale=block_scale, high_fp8=KINDS[kind][2] in (torch.uint8, torch.float8_e4m3fn),
                   interpret=interpret)
    _assert_pools_equal(dev, want, f"{kind} {block_scale}")
    return p, dev, low_slot, high_slot


@pytest.mark.parametrize("block_scale", tw.BLOCK_SCALES)
@pytest.mark.parametrize("kind", list(KINDS))
def test_bits_equal_reference(kind, block_scale):
    p, dev, low_slot, _ = _case(kind, block_scale, seed=list(KINDS).index(kind) * 2 + (block_scale == "4over6"))
    name = "low_data" if p["low_data"] is not None else "plain_rows"
    # the write happened: the written rows of the layer differ from the poison somewhere
    assert not torch.equal(p[name].view(torch.uint8), dev[name].view(torch.uint8))


@pytest.mark.parametrize("gs", [[[2.0 ** -20, 1e-3], [7.5, 1e4]], [[1e-30, 3e-38], [1e30, 1.0]]])
def test_large_and_tiny_global_scales(gs):
    """Per-layer K / V scales far from 1 (subnormal products, saturated scales, infinite reciprocals), layer 0 and
    layer 1, both block scales."""
    for layer in (0, 1):
        for bs in tw.BLOCK_SCALES:
            _case("mixed_fp8", bs, layers=2, layer=layer, gs=gs, row_scale=[[1e-3, 1.0], [300.0, 2.0 ** -8]],
                  seed=layer)


def test_padded_head_dim_and_strided_rows():
    """head_dim 80 (padded to 128 in the kernel), K / V with non-contiguous token / head strides, int32 slots."""
    _case("mixed_bf16", "4over6", d=80, h=2, t=9, strided=True, slot_dtype=torch.int32)
    _case("plain_fp8", "max6", d=48, h=1, t=5, strided=True)


@pytest.mark.parametrize("block_scale", tw.BLOCK_SCALES)
def test_unit_gs_pins_ties(block_scale):
    """gs = 1: the tie block of `_edge_blocks` (max6 scale 1.0, byte 0x38) gets the RNE codes of its midpoints, and
    the block that both candidates encode exactly keeps max6 under "4over6" (strict ``<``)."""
    p, dev, low_slot, _ = _case("nvfp4_bf16", block_scale, layers=1, layer=0, gs=[[1.0, 1.0]], t=4, skips=0, h=1)
    s0, s3 = int(low_slot[0]), int(low_slot[3])
    row = dev["low_data"][0, s0 // 8, 0, 0, s0 % 8]
    codes = torch.stack([row & 15, row >> 4], -1).reshape(-1)[:16].tolist()
    # values 6, .25, .75, 1.25, 1.75, 2.5, 3.5, 5 and negatives -> 6, 0, 1, 1, 2, 2, 4, 4 (ties to even), .125 -> 0
    if block_scale == "max6":
        assert int(dev["low_scales"][0, s0 // 8, 0, 0, s0 % 8, 0]) == 0x38
        assert codes == [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 0]
    assert int(dev["low_scales"][0, s3 // 8, 0, 0, s3 % 8, 0]) == 0x38                 # block 12: scale 1.0


def test_nan_poison_is_untouched():
    """Rows the kernel does not write keep their bytes exactly, NaN payloads included (16-bit twin)."""
    rng = np.random.default_rng(7)
    p = _pools(rng, "mixed_bf16", 2, 4, 3, 2, 8, 32, [[0.5, 1.0], [1.0, 2.0]], [[1.0, 1.0]] * 2)
    p["high_rows"] = _bits16(rng, p["high_rows"].shape, torch.bfloat16, finite=False)
    p["high_rows"].view(torch.int16)[..., :4] = 0x7F81                    # signalling-NaN payloads
    before = {n: x.clone() for n, x in p.items() if x is not None}
    k, v = _rows(rng, 5, 2, 32, torch.bfloat16, edges=False)
    low_slot, high_slot = torch.tensor([3, -1, 30, 12, 7]), torch.tensor([-1, 9, 0, 20, -1])
    tw.write_rows_(**p, layer=1, k=k, v=v, low_slot=low_slot, high_slot=high_slot, page_size=8)
    for name, old in before.items():
        now = p[name]
        changed = (now.view(torch.uint8) != old.view(torch.uint8)) if now.element_size() == 1 else \
            (now.view(torch.int16) != old.view(torch.int16))
        assert not changed[0].any(), f"{name}: layer 0 changed"
    written = torch.zeros_like(p["high_rows"], dtype=torch.bool)
    for t, s in enumerate(high_slot.tolist()):
        if s >= 0:
            written[1, s // 8, :, :, s % 8] = True
            assert torch.equal(p["high_rows"][1, s // 8, 0, :, s % 8].view(torch.int16), k[t].view(torch.int16))
            assert torch.equal(p["high_rows"][1, s // 8, 1, :, s % 8].view(torch.int16), v[t].view(torch.int16))
    assert torch.equal(p["high_rows"].view(torch.int16)[~written], before["high_rows"].view(torch.int16)[~written])


def test_plain_fp8_flag_must_match_the_pool():
    rng = np.random.default_rng(5)
    p = _pools(rng, "plain_fp8", 1, 2, 0, 1, 4, 16, None, [[1.0, 1.0]])
    k, v = _rows(rng, 2, 1, 16, torch.float16, edges=False)
    with pytest.raises(ValueError, match="high_fp8=False does not match the row pool's dtype torch.float8_e4m3fn"):
        tw.write_rows_(**p, layer=0, k=k, v=v, low_slot=torch.tensor([0, 1]), high_slot=None, page_size=4)


def test_no_tokens_is_a_no_op():
    rng = np.random.default_rng(3)
    p = _pools(rng, "mixed_bf16", 1, 2, 2, 1, 4, 16, [[1.0, 1.0]], [[1.0, 1.0]])
    before = {n: x.clone() for n, x in p.items() if x is not None}
    k = torch.zeros(0, 1, 16, dtype=torch.bfloat16)
    tw.write_rows_(**p, layer=0, k=k, v=k, low_slot=torch.zeros(0, dtype=torch.int64),
                   high_slot=torch.zeros(0, dtype=torch.int64), page_size=4)
    assert all(torch.equal(before[n].view(torch.uint8), p[n].view(torch.uint8)) for n in before)


# ------------------------------------------------------------------------------------------ refusals
def _bad_inputs():
    """(label, overrides of the good arguments, text the ValueError must contain)."""
    return [
        ("layer", dict(layer=2), "layer 2"),
        ("layer type", dict(layer=1.0), "layer must be an int"),
        ("page size", dict(page_size=16), "page_size 16"),
        ("block scale", dict(block_scale="max4"), "'max4'"),
        ("k dtype", dict(k=torch.zeros(3, 2, 32)), "float32"),
        ("k / v shape", dict(v=torch.zeros(3, 2, 48, dtype=torch.bfloat16)), "must share"),
        ("head dim", dict(k=torch.zeros(3, 2, 24, dtype=torch.bfloat16),
                          v=torch.zeros(3, 2, 24, dtype=torch.bfloat16)), "head_dim 24"),
        ("slot range", dict(low_slot=torch.tensor([0, 64, -1])), "[64]"),
        ("slot below -1", dict(high_slot=torch.tensor([-2, 1, 2])), "[-2]"),
        ("slot repeat", dict(low_slot=torch.tensor([5, 5, -1])), "repeats slot(s) [5]"),
        ("slot count", dict(low_slot=torch.tensor([0, 1])), "3 slots"),
        ("slot dtype", dict(low_slot=torch.tensor([0.0, 1.0, 2.0])), "torch.float32"),
        ("twin fp8 flag", dict(high_fp8=True), "high_fp8=True does not match the row pool's dtype torch.bfloat16"),
        ("twin dtype", dict(high_rows=torch.zeros(2, 3, 2, 2, 8, 32, dtype=torch.float16)), "torch.float16"),
        ("twin shape", dict(high_rows=torch.zeros(2, 3, 2, 2, 8, 16, dtype=torch.bfloat16)), "high_rows"),
        ("gs shape", dict(low_gs=torch.ones(2, 1)), "low_gs"),
        ("gs value", dict(low_gs=torch.tensor([[1.0, 1.0], [0.0, 1.0]])), "low_gs[1]"),
        ("twin without low", dict(low_data=None, low_scales=None, low_gs=None), "needs the low"),
        ("plain with low", dict(plain_rows=torch.zeros(2, 4, 2, 2, 8, 32, dtype=torch.bfloat16),
                                plain_scale=torch.ones(2, 2)), "plain cache"),
        ("non-contiguous pool", dict(low_data=torch.zeros(2, 4, 2, 2, 16, 8, dtype=torch.uint8).transpose(-1, -2)),
         "contiguous"),
    ]


@pytest.mark.parametrize("label,bad,text", _bad_inputs(), ids=[b[0] for b in _bad_inputs()])
def test_bad_input_refused(label, bad, text):
    rng = np.random.default_rng(11)
    p = _pools(rng, "mixed_bf16", 2, 4, 3, 2, 8, 32, [[0.5, 1.0], [1.0, 2.0]], [[1.0, 1.0]] * 2)
    before = {n: x.clone() for n, x in p.items() if x is not None}
    k, v = _rows(rng, 3, 2, 32, torch.bfloat16, edges=False)
    args = dict(p, layer=1, k=k, v=v, low_slot=torch.tensor([0, 9, -1]), high_slot=torch.tensor([4, -1, 2]),
                page_size=8, block_scale="max6", high_fp8=False)
    args.update(bad)
    with pytest.raises(ValueError) as err:
        tw.write_rows_(**args)
    assert text in str(err.value), str(err.value)
    for name, old in before.items():                        # nothing was written
        assert torch.equal(p[name].view(torch.uint8), old.view(torch.uint8)), name


# ------------------------------------------------------------------------------------------ compiled form
def _lower(kind, block_scale, layer=1, d=128, h=8, t=16):
    """`tw.lower_for_cuda` on small CPU pools of ``kind`` (the launch `write_rows_` would make on an sm_90 device)."""
    rng = np.random.default_rng(0)
    p = _pools(rng, kind, 3, 4, 2, h, 16, d, [[1.0, 1.0]] * 3, [[1.0, 1.0]] * 3)
    k, v = _rows(rng, t, h, d, KINDS[kind][3], edges=False)
    high_slot = _slots(rng, t, 32, 2) if KINDS[kind][1] == "high" else None
    return tw.lower_for_cuda(**p, layer=layer, k=k, v=v, low_slot=_slots(rng, t, 64, 2), high_slot=high_slot,
                             page_size=16, block_scale=block_scale,
                             high_fp8=KINDS[kind][2] in (torch.uint8, torch.float8_e4m3fn))


def _ptx_ops(ptx):
    return set(re.findall(r"^\s*(?:@!?%p\d+\s+)?([a-z][a-z0-9_.]*)", ptx, re.M))


@pytest.mark.parametrize("kind,block_scale", [("mixed_fp8", "4over6"), ("plain_bf16", "max6")])
def test_cuda_launch_compiles_with_exact_float_ops(kind, block_scale):
    """The CUDA kernel as `write_rows_` launches it (sm_90, compiled here without a GPU): IEEE ``div.rn.f32``
    divisions, every float multiply / add / subtract with an explicit ``.rn`` (no FMA contraction), no flush-to-zero,
    no approximate division, no fp8 / fp4 conversion instruction."""
    ops = _ptx_ops(_lower(kind, block_scale)["ptx"])
    assert not [o for o in ops if o.startswith("fma") or ".ftz" in o or ".approx" in o or ".full" in o], ops
    assert not [o for o in ops if o.startswith("cvt") and ("e4m3" in o or "e2m1" in o)], ops
    assert not [o for o in ops if re.match(r"(mul|add|sub|div)\.f32", o)], ops
    if kind == "mixed_fp8":
        assert {"div.rn.f32", "mul.rn.f32", "add.rn.f32", "sub.rn.f32"} <= ops, ops


def test_one_compiled_kernel_for_every_layer():
    """``layer`` is a runtime scalar of the CUDA kernel: layers 1 (Triton specializes an int equal to 1 unless told
    not to) and 2 compile to the same PTX; the kernels are built once per mode."""
    ptx = {layer: _lower("nvfp4_bf16", "max6", layer=layer, d=64, h=2, t=4)["ptx"] for layer in (1, 2)}
    assert ptx[1] == ptx[2]
    assert tw._build(False) is tw._build(False) and tw._build(True) is tw._build(True)
    jitted = tw._build(False)["_write_rows_kernel"]
    assert {p.name for p in jitted.params if p.do_not_specialize} >= {"layer", "num_rows", "low_pages", "row_pages"}
    assert {p.name for p in jitted.params if p.is_constexpr} == {"HEADS", "PAGE", "D", "DP", "BLOCK_R", "HAS_LOW",
                                                                 "ROW_POOL", "ROW_FP8", "IS_BF16", "FOUR_OVER_SIX"}
    assert tw.SIXTH_LITERAL == float(SIXTH)


# ------------------------------------------------------------------------------------------ GPU
@gpu
@pytest.mark.parametrize("block_scale", tw.BLOCK_SCALES)
@pytest.mark.parametrize("kind", list(KINDS))
def test_gpu_bits_equal_reference(kind, block_scale):
    assert torch.cuda.is_available()
    _case(kind, block_scale, device="cuda", interpret=False, seed=5)
    _case(kind, block_scale, device="cuda", interpret=False, seed=6, gs=[[1e-30, 3e-38], [1e30, 1.0], [1.0, 1.0]],
          d=80, strided=True)


def _expected_rows(k, v, gs, row_scale, row_dtype, block_scale):
    """Per-row references (JAX on the CPU): NVFP4 ``(data u8[T, 2, H, D/2], scales u8[T, 2, H, D/16])`` and the
    row pool's store form ``[T, 2, H, D]`` as torch tensors."""
    with jax.default_device(jax.devices("cpu")[0]):
        x = jnp.stack([jnp.asarray(_np(k)), jnp.asarray(_np(v))], axis=-3)
        data, scales = _quantize_reference(x, jnp.asarray(gs)[None, :, None], block_scale)
        jdt = {torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16, torch.uint8: jnp.float8_e4m3fn}[row_dtype]
        rows = encode_rows(x, jdt, jnp.asarray(row_scale))
    def as_t(a):
        return torch.from_numpy(np.asarray(a).view(np.uint8 if a.dtype.itemsize == 1 else np.int16).copy())
    return as_t(data), as_t(scales), as_t(rows)


def _check_every_byte(layers, pages, twin_pages, h, page, d, dev, row_dtype, block_scale, writes, interpret):
    """Write ``(tokens, layer)`` chunks into poisoned pools on ``dev``; after each, the pools equal their previous
    bytes with the written rows replaced by the per-row references (`_expected_rows`): nothing else changes."""
    rng = np.random.default_rng(0)
    gen = torch.Generator(device=dev).manual_seed(0)
    data = torch.randint(0, 256, (layers, pages, 2, h, page, d // 2), dtype=torch.uint8, device=dev, generator=gen)
    scales = torch.randint(0, 256, (layers, pages, 2, h, page, d // 16), dtype=torch.uint8, device=dev, generator=gen)
    rows = torch.randint(0, 256, (layers, twin_pages, 2, h, page, d * row_dtype.itemsize), dtype=torch.uint8,
                         device=dev, generator=gen).view(row_dtype)             # bf16: any bits, NaNs included
    gs = torch.tensor(rng.uniform(0.002, 0.2, (layers, 2)), dtype=torch.float32, device=dev)
    rscale = torch.tensor(rng.uniform(0.01, 0.1, (layers, 2)) if row_dtype == torch.uint8 else np.ones((layers, 2)),
                          dtype=torch.float32, device=dev)
    for t, layer in writes:
        k, v = _rows(rng, t, h, d, torch.bfloat16, edges=True)
        low_slot = _slots(rng, t, pages * page, t // 8)
        high_slot = _slots(rng, t, twin_pages * page, t // 4)
        want = {"data": data.clone(), "scales": scales.clone(), "rows": rows.clone()}
        tw.write_rows_(data, scales, gs, rows, rscale, None, None, layer, k.to(dev), v.to(dev), low_slot.to(dev),
                       high_slot.to(dev), page, block_scale, row_dtype == torch.uint8, interpret=interpret)
        e_data, e_scales, e_rows = _expected_rows(k, v, gs[layer].cpu().numpy(), rscale[layer].cpu().numpy(),
                                                  row_dtype, block_scale)
        ti = torch.nonzero(low_slot >= 0)[:, 0]
        pg, row = (low_slot[ti] // page).to(dev), (low_slot[ti] % page).to(dev)
        want["data"][layer, pg, :, :, row] = e_data[ti].to(dev)                  # -> [n, 2, H, X] at (page, row)
        want["scales"][layer, pg, :, :, row] = e_scales[ti].to(dev)
        ti = torch.nonzero(high_slot >= 0)[:, 0]
        pg, row = (high_slot[ti] // page).to(dev), (high_slot[ti] % page).to(dev)
        w_rows = want["rows"].view(torch.uint8 if row_dtype == torch.uint8 else torch.int16)
        w_rows[layer, pg, :, :, row] = e_rows[ti].to(dev)
        for name, got in (("data", data), ("scales", scales), ("rows", rows)):
            same = got.view(torch.uint8) == want[name].view(torch.uint8)
            assert bool(same.all()), f"{name} t={t} layer={layer}: {int((~same).sum())} bytes differ"


@pytest.mark.parametrize("row_dtype,block_scale", [(torch.bfloat16, "4over6"), (torch.uint8, "max6")])
def test_every_other_byte_unchanged(row_dtype, block_scale):
    """Small pools (interpreter): after each write only the written rows changed, to their per-row references."""
    _check_every_byte(3, 8, 4, 2, 8, 32, "cpu", row_dtype, block_scale, [(12, 0), (3, 2), (20, 2)], interpret=True)


@gpu
@pytest.mark.parametrize("row_dtype,block_scale", [(torch.bfloat16, "max6"), (torch.uint8, "4over6")])
def test_gpu_model_size(row_dtype, block_scale):
    """32 layers x 8 heads x 128, page 64: 1024 low pages (2.4 GiB NVFP4) and 256 twin pages (2 GiB bf16 / 1 GiB
    fp8). A 512-token prefill chunk and a 16-token decode step, into layers 0 and 31, compiled kernel."""
    assert torch.cuda.is_available()
    _check_every_byte(32, 1024, 256, 8, 64, 128, "cuda", row_dtype, block_scale, [(512, 0), (16, 31), (512, 31)],
                      interpret=False)
