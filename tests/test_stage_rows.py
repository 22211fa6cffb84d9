"""A layer's rows as a reader gets them, dense, left-aligned, the step's own rows appended, without storing them
(`interop.triton_write.stage_rows`, its torch reference `interop.torch_paged.stage_reference`, the dispatcher
`interop.paged_ops.stage`): the held-aside ``decode="stage"`` step of `interop.hf.JMixedKVCache` hands these to the
model's own attention.

The independent reference is JAX: append the step's rows to the state (`jmixedkv.state.append`), then stage them
(`jmixedkv.step.dense_rows`), aligned as transformers' mask wants them. Bit for bit, every format, poisoned states
(unwritten rows NaN, page ids permuted, lengths 0, 1, page - 1, page, page + 1, 70), the step's rows given in the
form they read once stored (`interop.paged_ops.round_trip`). CPU: Triton's interpreter and the CUDA form compiled
for sm_90; ``gpu``: compiled on the device.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import triton  # noqa: F401  (a test dependency: the kernel needs it, no silent skip)

from helpers import outlier_rows, poisoned_state
from helpers import torch_of as _torch
from jmixedkv import GroupSpec, KVCacheConfig
from jmixedkv.state import append
from jmixedkv.step import dense_rows
from interop import paged_ops, torch_paged
from interop import triton_write as tw
from interop.hf import tail_form
from interop.torch_paged import TorchPools

gpu = pytest.mark.gpu
LENS = (0, 1, 15, 16, 17, 70)


def _case(dtype, first_n, last_n, tq, d=64, heads=2, seed=0, lens=LENS):
    """``(state, pools, tables, tail_k, tail_v, raw k, raw v)``: a poisoned state and a step of ``tq`` rows per slot
    (raw: as the model gives them; tail: as they read once stored)."""
    cfg = KVCacheConfig(dtype, first_n=first_n, last_n=last_n, page_size=16, max_draft_len=3)
    st = poisoned_state(cfg, GroupSpec(num_layers=2, num_kv_heads=heads, head_dim=d), lens, width=6, num_pages=48,
                        seed=seed, high_scale=0.02, rows=outlier_rows)
    p = st.pools[0]
    low, high, plain = p.low, p.high, p.plain
    pools = TorchPools(*(_torch(x) for x in (low and low.data, low and low.scales, low and low.gs,
                                             high and high.rows, high and high.scale, plain and plain.rows,
                                             plain and plain.scale)))
    kv = jax.random.normal(jax.random.PRNGKey(seed + tq), (2, st.max_seqs, tq, heads, d)) * 2.0
    kv = kv.astype(cfg.attention_dtype)
    k, v = _torch(kv[0]), _torch(kv[1])
    form = tail_form(cfg)
    tk, tv = (k, v) if form is None else paged_ops.round_trip(pools, 1, k, v, low=form == "nvfp4",
                                                              block_scale="max6")
    tables = (_torch(st.page_table), _torch(st.high_table) if high is not None else None,
              _torch(st.kv_lens).to(torch.int32))
    return st, pools, tables, tk, tv, kv


def _jax_staged(st, kv, layer, seen):
    """Append the raw rows in JAX, stage the layer (`dense_rows`), align: ``[2, B, H, seen, D]`` torch."""
    tq = kv.shape[2]
    seq = jnp.repeat(jnp.arange(st.max_seqs, dtype=jnp.int32), tq)
    pos = (st.kv_lens[:, None] + jnp.arange(tq, dtype=jnp.int32)[None, :]).reshape(-1)
    flat = lambda x: x.reshape(-1, *x.shape[2:])                            # noqa: E731
    after = append(st, layer, flat(kv[0]), flat(kv[1]), seq, pos, backend="reference")
    assert int(after.error) == 0
    width = int(after.page_table.shape[1])
    k, v = dense_rows(after, layer, jnp.arange(st.max_seqs, dtype=jnp.int32), width=width, backend="reference")
    dense = torch.stack([_torch(k), _torch(v)])                             # [2, B, H, S, D], real rows first
    n = np.asarray(after.kv_lens)
    out = torch.zeros(dense.shape[:3] + (seen, dense.shape[-1]), dtype=dense.dtype)
    for b in range(len(n)):
        out[:, b, :, seen - n[b]:] = dense[:, b, :, :n[b]]
    return out


def _assert_same(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    bad = (got.view(torch.int16) != want.view(torch.int16)) & ~nan
    assert not bad.any(), (bad.nonzero()[:4].tolist(), got[bad][:4].tolist(), want[bad][:4].tolist())


#: (dtype, first_n, last_n, stored lengths): a twin without last_n reads a step past first_n as NVFP4 (the only
#: steps `interop.hf.JMixedKVCache` holds aside for it)
FORMATS = [("mixed_nvfp4_bf16", 5, 7, LENS), ("mixed_nvfp4_fp16", 5, 7, LENS), ("mixed_nvfp4_fp8", 5, 7, LENS),
           ("nvfp4", 0, 0, LENS), ("mixed_nvfp4_bf16", 3, 0, (3, 15, 16, 17, 70, 4)), ("bf16", 0, 0, LENS),
           ("fp8", 0, 0, LENS)]


#: every format at a 2-token step, the bf16 twin also at 1 and 3 (its windows move with the step)
CASES = [f + (2,) for f in FORMATS] + [FORMATS[0] + (1,), FORMATS[0] + (3,)]


@pytest.mark.parametrize("dtype,first_n,last_n,lens,tq", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}-T{c[4]}" for c in CASES])
def test_equals_append_then_stage(dtype, first_n, last_n, lens, tq):
    """Kernel (interpreted) == torch reference == JAX append + `dense_rows`, bit for bit, two padding columns
    before the longest row; the twin's windows after the step (a row that leaves ``last_n`` reads NVFP4)."""
    st, pools, (pt, ht, lens), tk, tv, kv = _case(dtype, first_n, last_n, tq, lens=lens)
    seen = int(lens.max()) + tq + 2
    geom = st.config.twin if pools.high_rows is not None else None
    want = _jax_staged(st, kv, 1, seen)
    for backend in paged_ops.CPU_BACKENDS:
        with paged_ops.cpu_backend(backend):
            got = paged_ops.stage(pools, 1, pt, ht, lens, 16, geom, seen, tk, tv)
        _assert_same(torch.stack(got), want)


def test_no_step_rows_and_wide_padding():
    """``T = 0`` (the cache alone) and many padding columns: the stored rows at the right end, zeros before."""
    st, pools, (pt, ht, lens), tk, tv, kv = _case("mixed_nvfp4_bf16", 5, 7, 1)
    seen = int(lens.max()) + 40
    got = torch.stack(paged_ops.stage(pools, 0, pt, ht, lens, 16, st.config.twin, seen, tk[:, :0], tv[:, :0]))
    want = torch_paged.stage_reference(*pools, 0, pt, ht, lens, st.config.twin, seen, tk[:, :0], tv[:, :0])
    with paged_ops.cpu_backend("triton"):
        got_kernel = torch.stack(paged_ops.stage(pools, 0, pt, ht, lens, 16, st.config.twin, seen, tk[:, :0],
                                                 tv[:, :0]))
    _assert_same(got, want)
    _assert_same(got_kernel, want)
    for b, n in enumerate(lens.tolist()):
        assert not got[:, b, :, :seen - n].any()


def _bad_inputs():
    return [
        (dict(seen=70), "row 5 holds kv_lens=70 rows + 1 new; expected 0 <= kv_lens <= 96 (its pages) and "
                          "kv_lens + 1 <= seen=70"),
        (dict(seen=-1), "seen must be an int >= the step's 1 tokens, got -1"),
        (dict(tail_k="x"), "tail_k / tail_v must be"),
        (dict(page_table="pt64"), "page_table must be an int32"),
        (dict(kv_lens="lens64"), "kv_lens must be an int32"),
        (dict(layer=2), "layer 2 out of range [0, 2)"),
        (dict(high_table=None), "high_table must be an int32"),
    ]


@pytest.mark.parametrize("bad,text", _bad_inputs(), ids=[b[1][:20] for b in _bad_inputs()])
def test_bad_input_refused(bad, text):
    st, pools, (pt, ht, lens), tk, tv, kv = _case("mixed_nvfp4_bf16", 5, 7, 1)
    args = dict(layer=1, page_table=pt, high_table=ht, kv_lens=lens, geom=(16, 5, 7, 1, 2), seen=80, tail_k=tk,
                tail_v=tv)
    args.update(bad)
    args["page_table"] = pt.long() if args["page_table"] == "pt64" else args["page_table"]
    args["kv_lens"] = lens.long() if isinstance(args["kv_lens"], str) else args["kv_lens"]
    with pytest.raises(ValueError) as err:
        tw.stage_rows(*pools, **args)
    assert text in str(err.value), str(err.value)


def _ptx_ops(ptx):
    return set(re.findall(r"^\s*(?:@!?%p\d+\s+)?([a-z][a-z0-9_.]*)", ptx, re.M))


@pytest.mark.parametrize("dtype,first_n,last_n", [("mixed_nvfp4_fp8", 5, 7), ("nvfp4", 0, 0), ("bf16", 0, 0)])
def test_compiles_for_sm90_without_a_gpu(dtype, first_n, last_n):
    """The CUDA kernel as `stage_rows` launches it (sm_90, compiled here without a GPU): no flush-to-zero, no
    approximate or fused float op, no fp8 / fp4 conversion instruction; one kernel for every layer and length."""
    st, pools, (pt, ht, lens), tk, tv, kv = _case(dtype, first_n, last_n, 1, d=128)
    geom = st.config.twin if pools.high_rows is not None else (16, 0, 0, 0, 0)
    asm = [tw.lower_stage_for_cuda(*pools, layer, pt, ht, lens, geom, seen, tk, tv)["ptx"]
           for layer, seen in ((0, 80), (1, 96))]
    assert asm[0] == asm[1]
    ops = _ptx_ops(asm[0])
    assert not [o for o in ops if o.startswith("fma") or ".ftz" in o or ".approx" in o], ops
    assert not [o for o in ops if o.startswith("cvt") and ("e4m3" in o or "e2m1" in o)], ops


@gpu
@pytest.mark.parametrize("dtype,first_n,last_n,lens", FORMATS, ids=[f"{f[0]}-{f[1]}-{f[2]}" for f in FORMATS])
def test_gpu_equals_reference(dtype, first_n, last_n, lens):
    """The compiled kernel on the device: the bits of the torch reference (which the CPU tests tie to JAX), head_dim
    128, 8 KV heads, a 3-token step."""
    assert torch.cuda.is_available()
    st, pools, (pt, ht, lens), tk, tv, kv = _case(dtype, first_n, last_n, 3, d=128, heads=8, lens=lens)
    geom = st.config.twin if pools.high_rows is not None else None
    seen = int(lens.max()) + 5
    want = torch.stack(paged_ops.stage(pools, 1, pt, ht, lens, 16, geom, seen, tk, tv))
    cuda = lambda x: None if x is None else x.cuda()                         # noqa: E731
    got = paged_ops.stage(TorchPools(*map(cuda, pools)), 1, pt.cuda(), cuda(ht), lens.cuda(), 16, geom, seen,
                          tk.cuda(), tv.cuda())
    _assert_same(torch.stack(got).cpu(), want)
