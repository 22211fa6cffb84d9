"""`interop.triton_attention.paged_attention` (the Triton paged attention of the torch hot path) against the JAX
references: `jmixedkv.decode.decode_attention(..., backend="reference")` and its float32 form `decode_reference`
(float32 staging of the stored rows, float32 output), on poisoned states (every unwritten row NaN, page ids
permuted) converted to torch. CPU tests run Triton's interpreter; ``gpu`` tests compile for CUDA.
"""
from __future__ import annotations

import contextlib
import functools
import re

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from helpers import decode_queries, decode_reference, poisoned_state, outlier_rows
from helpers import torch_of as _torch
from jmixedkv import GroupSpec, KVCacheConfig
from jmixedkv.decode import decode_attention
from interop.triton_attention import Tuning, bench_paged_attention, choose_tuning, paged_attention

#: max |out - ref| <= OUT_TOL * max |ref| per (row, head); LSE within LSE_TOL
OUT_TOL, LSE_TOL = 2e-3, 1e-4


@functools.lru_cache(maxsize=None)
def _state(dtype, first_n=0, last_n=0, page=16, lens=(0, 1, 15, 16, 17, 70), heads=2, d=64, decode_steps=0, seed=0):
    cfg = KVCacheConfig(dtype, first_n=first_n, last_n=last_n, page_size=page, max_draft_len=3)
    return poisoned_state(cfg, GroupSpec(num_layers=2, num_kv_heads=heads, head_dim=d), lens, seed=seed,
                          decode_steps=decode_steps, high_scale=0.02, rows=outlier_rows)


def _pools(st):
    """The 7 pool tensors of group 0 in the contract's order (None where absent)."""
    p = st.pools[0]
    low, high, plain = p.low, p.high, p.plain
    return [_torch(low.data) if low else None, _torch(low.scales) if low else None, _torch(low.gs) if low else None,
            _torch(high.rows) if high else None, _torch(high.scale) if high else None,
            _torch(plain.rows) if plain else None, _torch(plain.scale) if plain else None]


def _tables(st, seq):
    s = np.clip(np.asarray(seq), 0, st.max_seqs - 1)
    lens = np.where(np.asarray(seq) >= 0, np.asarray(st.kv_lens)[s], 0).astype(np.int32)
    high = _torch(np.asarray(st.high_table)[s]) if st.pools[0].high is not None else None
    return _torch(np.asarray(st.page_table)[s]), high, torch.from_numpy(lens)


def _run(st, layer, q, seq, *, sliding_window=None, soft_cap=None, sm_scale=None, **kw):
    page_table, high_table, lens = _tables(st, seq)
    d = st.groups[0].head_dim
    return paged_attention(_torch(q), *_pools(st), layer, page_table, high_table, lens, st.config.twin,
                           d ** -0.5 if sm_scale is None else sm_scale, sliding_window, soft_cap, **kw)


def _check(got, want_out, want_lse, msg=""):
    out, lse = (x.numpy() for x in got)
    ref_out, ref_lse = np.asarray(want_out, np.float32), np.asarray(want_lse, np.float32)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape, msg
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(ref_lse), err_msg=f"{msg}: rows that see no key")
    np.testing.assert_allclose(lse, ref_lse, rtol=LSE_TOL, atol=LSE_TOL, err_msg=f"{msg}: lse")
    scale = np.maximum(np.abs(ref_out).max(axis=-1, keepdims=True), 1e-3)
    err = np.abs(out - ref_out) / scale
    assert np.isfinite(out).all() and err.max() <= OUT_TOL, f"{msg}: max relative error {err.max():.3g}"


def _compare(st, tq, hq, *, layer=1, seq=None, num_splits=None, sliding_window=None, soft_cap=None, msg=""):
    seq = jnp.arange(st.max_seqs, dtype=jnp.int32) if seq is None else jnp.asarray(seq, jnp.int32)
    q = decode_queries(st, tq, hq, seed=tq * 31 + hq)[:seq.shape[0]]
    got = _run(st, layer, q, seq, sliding_window=sliding_window, soft_cap=soft_cap, num_splits=num_splits)
    want = decode_reference(st, layer, q, seq, sliding_window=sliding_window, soft_cap=soft_cap)
    _check(got, *want, msg=msg)
    return got


# ------------------------------------------------------------------------------------------------ formats
FORMATS = [("mixed_nvfp4_bf16", 5, 7), ("mixed_nvfp4_fp16", 5, 7), ("mixed_nvfp4_fp8", 5, 7), ("nvfp4", 0, 0),
           ("bf16", 0, 0), ("fp16", 0, 0), ("fp8", 0, 0)]


@pytest.mark.parametrize("dtype,first_n,last_n", FORMATS)
def test_formats_decode_and_verify(dtype, first_n, last_n):
    """Each format, lengths 0 / 1 / page-1 / page / page+1 / 70, layer 1: Tq 1 with GQA 4, Tq 2 with GQA 3."""
    st = _state(dtype, first_n, last_n)
    _compare(st, 1, 8, msg=f"{dtype} Tq 1 G 4")
    _compare(st, 2, 6, num_splits=3, msg=f"{dtype} Tq 2 G 3, 3 splits")


def test_matches_decode_attention():
    """The op's output equals `decode_attention(..., backend="reference")` within its bf16 rounding; LSE tight."""
    st = _state("mixed_nvfp4_bf16", 5, 7)
    q = decode_queries(st, 4, 8, seed=3)
    seq = jnp.arange(st.max_seqs, dtype=jnp.int32)
    out, lse = _run(st, 0, q, seq)
    ref_out, ref_lse = decode_attention(st, 0, q, seq, backend="reference")
    ref_out = np.asarray(ref_out.astype(jnp.float32))
    np.testing.assert_allclose(lse.numpy(), np.asarray(ref_lse), rtol=LSE_TOL, atol=LSE_TOL)
    np.testing.assert_allclose(out.numpy(), ref_out, rtol=2 ** -8, atol=2 ** -8 * np.abs(ref_out).max())


@pytest.mark.parametrize("tq,group,splits", [(1, 1, 1), (1, 7, 2), (4, 4, 1), (4, 7, 4), (16, 1, 1)])
def test_query_rows_and_splits(tq, group, splits):
    """Tq * G from 1 to 28 (GQA 1 / 4 / 7, Tq up to 16), the split-K merge, a few hundred tokens."""
    st = _state("mixed_nvfp4_bf16", 5, 7, lens=(300, 0, 17, 129))
    _compare(st, tq, 2 * group, num_splits=splits, msg=f"Tq {tq} G {group} splits {splits}")


def test_tiles_of_query_rows():
    """Tq * G above one tile (16 x 8 = 128 rows: four tiles of 32 at head_dim 256)."""
    st = _state("mixed_nvfp4_fp8", 5, 7, lens=(1, 17, 90), heads=1, d=256)
    _compare(st, 16, 8, msg="128 query rows")


@pytest.mark.parametrize("first_n,last_n,page,steps", [(0, 7, 16, 3), (20, 40, 16, 5), (33, 70, 32, 4)])
def test_twin_windows_and_pages(first_n, last_n, page, steps):
    """first_n / last_n windows (none, several pages, the ring wrapped by decode steps), pages 16 / 32."""
    st = _state("mixed_nvfp4_bf16", first_n, last_n, page=page, lens=(0, page - 1, page + 1, 3 * page + 5, 250),
                decode_steps=steps)
    _compare(st, 1, 4, msg=f"first_n {first_n} last_n {last_n} page {page}")
    _compare(st, 3, 4, num_splits=2, msg=f"Tq 3, first_n {first_n} last_n {last_n} page {page}")


def test_page_128():
    st = _state("mixed_nvfp4_bf16", 4, 32, page=128, lens=(1, 127, 129, 300))
    _compare(st, 2, 4, num_splits=2, msg="page 128")


@pytest.mark.parametrize("dtype,d", [("mixed_nvfp4_bf16", 128), ("bf16", 128), ("mixed_nvfp4_fp8", 256)])
def test_head_dims(dtype, d):
    mixed = dtype.startswith("mixed")
    st = _state(dtype, 5 if mixed else 0, 7 if mixed else 0, lens=(1, 17, 90), heads=1, d=d)
    _compare(st, 2, 4, num_splits=2, msg=f"{dtype} head_dim {d}")


@pytest.mark.parametrize("dtype", ["mixed_nvfp4_bf16", "nvfp4", "bf16"])
def test_sliding_window_and_soft_cap(dtype):
    mixed = dtype.startswith("mixed")
    st = _state(dtype, 5 if mixed else 0, 7 if mixed else 0, lens=(0, 1, 17, 70, 200))
    _compare(st, 4, 6, sliding_window=9, msg=f"{dtype} window 9")
    _compare(st, 2, 4, sliding_window=100, soft_cap=2.5, num_splits=2, msg=f"{dtype} window 100, cap 2.5")


def test_padding_rows_and_no_visible_key():
    """Padding rows (slot -1: kv_lens 0) and queries at negative positions (Tq > n) give zeros and -inf, as
    `decode_attention` (whose reference handles slot -1)."""
    st = _state("mixed_nvfp4_bf16", 5, 7)
    seq = jnp.asarray([-1, 1, 5, -1], jnp.int32)                    # lengths 0, 1, 70, 0
    q = decode_queries(st, 3, 4)[:4]
    out, lse = _run(st, 0, q, seq)
    ref_out, ref_lse = decode_attention(st, 0, q, seq, backend="reference")
    ref_out = np.asarray(ref_out.astype(jnp.float32))
    np.testing.assert_allclose(lse.numpy(), np.asarray(ref_lse), rtol=LSE_TOL, atol=LSE_TOL)
    np.testing.assert_allclose(out.numpy(), ref_out, rtol=2 ** -8, atol=2 ** -8 * np.abs(ref_out).max())
    assert np.all(out.numpy()[[0, 3]] == 0) and np.all(np.isneginf(lse.numpy()[[0, 3]]))
    assert np.all(out.numpy()[1, :2] == 0) and np.all(np.isneginf(lse.numpy()[1, :2]))   # n = 1, Tq = 3
    assert np.isfinite(lse.numpy()[1, 2]).all() and np.isfinite(lse.numpy()[2]).all()


def test_unused_rows_never_read():
    """The pools' unwritten rows are NaN (poisoned state): every output is finite, and overwriting every row at or
    past each sequence's length with NaN (low pool and twin) changes no bit of the result."""
    st = _state("mixed_nvfp4_bf16", 5, 7)
    q = _torch(decode_queries(st, 2, 4))
    pools = _pools(st)
    page_table, high_table, lens = _tables(st, jnp.arange(st.max_seqs, dtype=jnp.int32))
    args = (q, *pools, 0, page_table, high_table, lens, st.config.twin, 0.125)
    base = paged_attention(*args)
    page = st.page_size
    for b, n in enumerate(lens.tolist()):
        for p in range(n, page_table.shape[1] * page):
            pid = int(page_table[b, p // page])
            if pid >= 0:
                pools[0][0, pid, :, :, p % page] = 0xFF                  # E2M1 -0 / -6 ... with a NaN scale
                pools[1][0, pid, :, :, p % page] = 0x7F
    pools[3][0][pools[3][0] == 0] = float("nan")                      # unused twin rows (zero-initialized ones)
    again = paged_attention(q, *pools, 0, page_table, high_table, lens, st.config.twin, 0.125)
    for x, y in zip(base, again):
        assert torch.equal(x, y)


def test_nan_in_a_visible_key_propagates():
    st = _state("bf16")
    q = _torch(decode_queries(st, 1, 2))
    pools = _pools(st)
    page_table, high_table, lens = _tables(st, jnp.arange(st.max_seqs, dtype=jnp.int32))
    pid = int(page_table[4, 0])
    pools[5][0, pid, 0, 0, 3] = float("nan")                          # key 3 of row 4 (17 tokens), KV head 0
    out, lse = paged_attention(q, *pools, 0, page_table, high_table, lens, (16, 0, 0, 0, 0), 0.125)
    assert torch.isnan(lse[4, 0, 0]) and torch.isnan(out[4, 0, 0]).all()
    assert torch.isfinite(lse[4, 0, 1]) and torch.isfinite(lse[5]).all() and torch.isfinite(out[5]).all()


# ------------------------------------------------------------------------------------------------ the dense tail
def _tail_rows(st, tq, seed):
    """K / V ``[S, Tq, H, D]`` (attention dtype, JAX) for one step of ``tq`` new tokens per slot."""
    import jax
    h, d = st.groups[0].num_kv_heads, st.groups[0].head_dim
    kv = jax.random.normal(jax.random.PRNGKey(seed), (2, st.max_seqs, tq, h, d)) * 2.0
    return kv.astype(st.config.attention_dtype)


@pytest.mark.parametrize("dtype,tq,hq,splits,window,cap,held", [
    ("mixed_nvfp4_bf16", 1, 8, 1, None, None, 0), ("mixed_nvfp4_bf16", 3, 6, 3, None, None, 0),
    ("mixed_nvfp4_fp16", 2, 4, 2, 9, None, 0), ("mixed_nvfp4_fp8", 4, 4, 1, None, 2.5, 0),
    ("nvfp4", 2, 6, 2, 20, None, 0), ("bf16", 3, 4, 2, 5, 3.0, 0), ("fp8", 1, 2, 1, None, None, 0),
    ("mixed_nvfp4_bf16", 40, 2, 2, 30, None, 0), ("mixed_nvfp4_bf16", 1, 8, 2, None, None, 6),
    ("bf16", 2, 4, 1, 5, 3.0, 17), ("nvfp4", 1, 6, 3, 20, None, 40)])
def test_tail_against_reference(dtype, tq, hq, splits, window, cap, held):
    """Rows after the stored ones given dense (``tail_k`` / ``tail_v``: ``held`` rows of earlier steps, then the
    queries' own; queries after them, causal): the kernel equals the float32 torch reference, every format, splits,
    window, soft-cap, 40 tokens, tails of up to 41 rows under 1 query."""
    from interop.torch_paged import paged_attention_reference
    mixed = dtype.startswith("mixed")
    st = _state(dtype, 5 if mixed else 0, 7 if mixed else 0)
    q = _torch(decode_queries(st, tq, hq, seed=tq + hq))
    tk, tv = (_torch(x) for x in _tail_rows(st, held + tq, seed=tq))
    page_table, high_table, lens = _tables(st, jnp.arange(st.max_seqs, dtype=jnp.int32))
    args = (q, *_pools(st), 1, page_table, high_table, lens, st.config.twin, 0.2, window, cap)
    got = paged_attention(*args, tail_k=tk, tail_v=tv, num_splits=splits)
    want = paged_attention_reference(*args, tail_k=tk, tail_v=tv)
    _check(got, *want, msg=f"{dtype} Tq {tq} Hq {hq}")


@pytest.mark.parametrize("dtype,splits", [("mixed_nvfp4_bf16", 1), ("mixed_nvfp4_fp16", 2), ("bf16", 3)])
def test_output_in_the_query_dtype(dtype, splits):
    """``out_dtype`` = q's dtype: the kernel (or the split merge) stores its output rounded once (RTNE), bit for bit
    what ``.to(q.dtype)`` of the float32 output gives, with the same LSE; float32 stays the default, and any other
    dtype is refused by name."""
    from interop.triton_attention import PagedAttention
    mixed = dtype.startswith("mixed")
    st = _state(dtype, 5 if mixed else 0, 7 if mixed else 0)
    q = _torch(decode_queries(st, 2, 6, seed=11))
    tk, tv = (_torch(x).transpose(1, 2).contiguous().transpose(1, 2) for x in _tail_rows(st, 2, seed=12))
    page_table, high_table, lens = _tables(st, jnp.arange(st.max_seqs, dtype=jnp.int32))
    run = PagedAttention(q, *_pools(st), page_table, high_table, lens, st.config.twin, tail=True, num_splits=splits)
    out32, lse32 = run(q, 1, 0.2, tail_k=tk, tail_v=tv)
    out16, lse16 = run(q, 1, 0.2, tail_k=tk, tail_v=tv, out_dtype=q.dtype)
    assert out32.dtype == torch.float32 and out16.dtype == q.dtype
    assert torch.equal(out16.view(torch.int16), out32.to(q.dtype).view(torch.int16))
    assert torch.equal(lse16, lse32)
    with pytest.raises(ValueError, match="out_dtype=torch.float64 must be None"):
        run(q, 1, 0.2, tail_k=tk, tail_v=tv, out_dtype=torch.float64)


def test_tail_length_is_not_specialized():
    """The tail's length only bounds a loop: the compiled kernel does not specialize on it (a held run's tail grows
    a row a step; 1 and multiples of 16 would each compile anew mid-generation)."""
    from interop.triton_attention import _kernels
    attn, _ = _kernels(False)
    assert "tail_len" in attn.arg_names and "tail_len" in attn.do_not_specialize


def test_launch_calls_the_c_launcher_directly_unless_hooked(monkeypatch):
    """`Launch`: with no Triton launch hook installed and its device current, a launch calls the compiled kernel's
    C launcher directly (grid, the device's current stream, no metadata, no hooks, the arguments then the
    constexprs); with a hook installed (a profiler) or another device current, Triton's own runner under its
    device."""
    from triton import knobs
    from triton.runtime.driver import driver
    from interop.triton_launch import Launch
    calls = []

    class Compiled:
        function, packed_metadata = "fn", "packed"

        def __init__(self):
            self._run = lambda *a: calls.append(("direct", a))

        def __getitem__(self, grid):
            return lambda *a: calls.append(("runner", grid, a))

    class Driver:
        get_current_stream = staticmethod(lambda device: 1000 + device)

    current = [3]
    monkeypatch.setattr(driver, "_active", Driver())                # no GPU here: stand-ins for CUDA
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext(calls.append(("device", d))))
    launch = Launch(Compiled(), (4, 2), ("C",), 3)
    launch(("x", 7))
    assert calls == [("direct", (4, 2, 1, 1003, "fn", "packed", None, None, None, "x", 7, "C"))]
    hook = lambda *a: None                                          # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        launch(("y", 8))
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert calls[1:] == [("device", 3), ("runner", (4, 2, 1), ("y", 8, "C"))]
    current[0] = 0                                                  # another device is current: the runner, under 3
    launch(("z", 9))
    assert calls[3:] == [("device", 3), ("runner", (4, 2, 1), ("z", 9, "C"))]


def test_prepared_calls_share_runners_only_within_a_specialization():
    """Compiled launches are shared between `PagedAttention` objects (one per step) by ``spec``: the same pools and
    table shapes give the same spec; a table width Triton specializes differently (16 columns vs 17, a multiple of
    16 or not) or another grid gives another, so no launch reuses a kernel compiled for other assumptions."""
    from interop.triton_attention import PagedAttention
    st = _state("mixed_nvfp4_bf16", 5, 7)
    q = _torch(decode_queries(st, 1, 4, seed=3))
    page_table, high_table, lens = _tables(st, jnp.arange(st.max_seqs, dtype=jnp.int32))
    make = lambda pt, query=q: PagedAttention(query, *_pools(st), pt, high_table, lens, st.config.twin)  # noqa: E731
    assert make(page_table).spec == make(page_table.clone()).spec
    wide = torch.full((page_table.shape[0], 16), -1, dtype=torch.int32)
    wide[:, :page_table.shape[1]] = page_table
    assert make(wide[:, :16].contiguous()).spec != make(torch.cat([wide, wide[:, :1]], 1)).spec
    assert make(page_table).spec != make(page_table, _torch(decode_queries(st, 2, 4, seed=3))).spec


@pytest.mark.parametrize("tq,held", [(3, 0), (2, 3), (1, 6)])
def test_tail_is_append_then_attend(tq, held):
    """Reading rows as a dense tail over the cache before them (``held`` rows of earlier steps, then the step's
    ``tq``) equals appending them all (a bf16 twin whose last_n covers the tail holds them exactly) and attending
    with the last ``tq`` positions over the cache after it; tail strides of transformers' ``[B, H, T, D]``
    layout."""
    from jmixedkv.state import append
    cfg = KVCacheConfig("mixed_nvfp4_bf16", first_n=5, last_n=7, page_size=16, max_draft_len=3)
    st = poisoned_state(cfg, GroupSpec(num_layers=2, num_kv_heads=2, head_dim=64), (0, 1, 15, 16, 17, 70), width=6,
                        num_pages=40, high_scale=0.02, rows=outlier_rows)
    hq = 4
    k, v = _tail_rows(st, held + tq, seed=5)
    tq, q_len = held + tq, tq                                # the rows appended, the queries among them
    seq = jnp.repeat(jnp.arange(st.max_seqs, dtype=jnp.int32), tq)
    pos = (st.kv_lens[:, None] + jnp.arange(tq, dtype=jnp.int32)[None, :]).reshape(-1)
    flat = lambda x: x.reshape(-1, *x.shape[2:])                            # noqa: E731
    after = st
    for layer in range(st.groups[0].num_layers):
        after = append(after, layer, flat(k), flat(v), seq, pos, backend="reference")
    assert int(after.error) == 0 and np.array_equal(np.asarray(after.kv_lens), np.asarray(st.kv_lens) + tq)
    q = decode_queries(st, q_len, hq, seed=9)
    want = decode_reference(after, 1, q, jnp.arange(st.max_seqs, dtype=jnp.int32))
    page_table, high_table, lens = _tables(st, jnp.arange(st.max_seqs, dtype=jnp.int32))
    tk = _torch(k).transpose(1, 2).contiguous().transpose(1, 2)            # [B, T, H, D] view of [B, H, T, D]
    tv = _torch(v).transpose(1, 2).contiguous().transpose(1, 2)
    got = paged_attention(_torch(q), *_pools(st), 1, page_table, high_table, lens, st.config.twin,
                          st.groups[0].head_dim ** -0.5, tail_k=tk, tail_v=tv, num_splits=2)
    _check(got, *want, msg="tail vs append + attend")


NEW_ROWS_CASES = [("mixed_nvfp4_bf16", 1, 8, 1, 0, 8), ("mixed_nvfp4_bf16", 1, 6, 2, 6, 17), ("bf16", 3, 4, 3, 17, 24),
                  ("mixed_nvfp4_fp16", 40, 2, 2, 3, 64), ("nvfp4", 2, 6, 1, 31, 33)]


def _new_rows_case(dtype, tq, hq, splits, held, cap, *, d=64, cuda=False):
    from interop.torch_paged import paged_attention_reference
    from interop.triton_attention import PagedAttention
    mixed = dtype.startswith("mixed")
    st = _state(dtype, 5 if mixed else 0, 7 if mixed else 0, d=d, **({"lens": (0, 1, 15, 16, 17, 300)} if cuda else {}))
    move = _cuda if cuda else list
    q = move([_torch(decode_queries(st, tq, hq, seed=tq + hq))])[0]
    tk, tv = move([_torch(x) for x in _tail_rows(st, held + tq, seed=tq + 1)])                # [B, T, H, D]
    b, _, h, _ = tk.shape
    buf = torch.full((2, b, h, cap, d), float("nan"), dtype=tk.dtype, device=tk.device)   # [2, B, H, cap, D]
    buf[0, :, :, :held], buf[1, :, :, :held] = tk[:, :held].transpose(1, 2), tv[:, :held].transpose(1, 2)
    poison = buf.clone()
    nk = tk[:, held:].transpose(1, 2).contiguous().transpose(1, 2)                     # [B, Tq, H, D] views
    nv = tv[:, held:].transpose(1, 2).contiguous().transpose(1, 2)
    page_table, high_table, lens = move(_tables(st, jnp.arange(st.max_seqs, dtype=jnp.int32)))
    pools = move(_pools(st))
    run = PagedAttention(q, *pools, page_table, high_table, lens, st.config.twin, tail=True, num_splits=splits)
    got = run(q, 1, 0.2, tail_k=buf[0].transpose(1, 2), tail_v=buf[1].transpose(1, 2), tail_len=held + tq,
              new_k=nk, new_v=nv)
    want = paged_attention_reference(q, *pools, 1, page_table, high_table, lens, st.config.twin, 0.2, None, None,
                                     tk, tv)
    cpu = lambda xs: [x.cpu() for x in xs]                                         # noqa: E731
    _check(cpu(got), *cpu(want), msg=f"{dtype} Tq {tq} held {held}")
    assert torch.equal(buf[0, :, :, held:held + tq].view(torch.int16), nk.transpose(1, 2).view(torch.int16))
    assert torch.equal(buf[1, :, :, held:held + tq].view(torch.int16), nv.transpose(1, 2).view(torch.int16))
    for i in (0, 1):                                   # rows before and after the step's: unchanged, bit for bit
        keep = torch.cat([buf[i, :, :, :held], buf[i, :, :, held + tq:]], 2)
        was = torch.cat([poison[i, :, :, :held], poison[i, :, :, held + tq:]], 2)
        assert torch.equal(keep.view(torch.int16), was.view(torch.int16))
    out, lse = run(q, 1, 0.2, tail_k=buf[0].transpose(1, 2), tail_v=buf[1].transpose(1, 2), tail_len=held + tq,
                   return_lse=False, validate=False)              # the kept rows read back from the tail
    assert lse is None
    _check(cpu((out, got[1])), *cpu(want), msg="kept rows read back")


@pytest.mark.parametrize("dtype,tq,hq,splits,held,cap", NEW_ROWS_CASES)
def test_new_rows_are_read_and_kept(dtype, tq, hq, splits, held, cap):
    """``new_k`` / ``new_v`` (the step's own rows, transformers' ``[B, H, Tq, D]`` transposed): the kernel reads
    them in place of the tail's last ``Tq`` rows (poisoned with NaN before: never read from the tail) and keeps
    them there, bit for bit; rows past ``tail_len`` (poisoned) are neither read nor written; the result equals the
    float32 reference over the held rows followed by the new ones. Splits, 40 query rows over several tiles, a
    buffer longer than the tail."""
    _new_rows_case(dtype, tq, hq, splits, held, cap)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_new_rows_are_read_and_kept(d):
    """`test_new_rows_are_read_and_kept` compiled, at head_dim 64 / 128 / 256."""
    for case in NEW_ROWS_CASES:
        _new_rows_case(*case, d=d, cuda=True)


def test_new_rows_bad_input_is_refused():
    from interop.triton_attention import PagedAttention
    a = _good_args()
    tk = torch.zeros((a["q"].shape[0], 4, 2, 64), dtype=a["q"].dtype)
    run = PagedAttention(a["q"], *a["pools"], a["page_table"], a["high_table"], a["kv_lens"], a["geom"], tail=True)
    with pytest.raises(ValueError, match=r"tail_len=5 must be an int in \[Tq=1, 4\]"):
        run(a["q"], 0, 0.1, tail_k=tk, tail_v=tk, tail_len=5)
    with pytest.raises(ValueError, match="tail_len=0 must be"):
        run(a["q"], 0, 0.1, tail_k=tk, tail_v=tk, tail_len=0)
    with pytest.raises(ValueError, match="pass both new_k and new_v"):
        run(a["q"], 0, 0.1, tail_k=tk, tail_v=tk, tail_len=2, new_k=tk[:, :1])
    with pytest.raises(ValueError, match=r"new_v must be .*\[6, 1, 2, 64\]"):
        run(a["q"], 0, 0.1, tail_k=tk, tail_v=tk, tail_len=2, new_k=tk[:, :1], new_v=tk[:, :2])
    with pytest.raises(ValueError, match="layer=2 must be"):
        run(a["q"], 2, 0.1, tail_k=tk, tail_v=tk, validate=False)
    for layer in (0.5, 1.0, True, np.float32(0)):                 # not an integer: the launch would truncate it
        for validate in (True, False):
            with pytest.raises(ValueError, match=re.escape(f"layer={layer!r} must be an int")):
                run(a["q"], layer, 0.1, tail_k=tk, tail_v=tk, validate=validate)
    with pytest.raises(ValueError, match="sliding_window=0 must be"):                 # options: always checked
        run(a["q"], 0, 0.1, 0, tail_k=tk, tail_v=tk, validate=False)
    flat = PagedAttention(a["q"], *a["pools"], a["page_table"], a["high_table"], a["kv_lens"], a["geom"])
    with pytest.raises(ValueError, match="need tail_k / tail_v"):
        flat(a["q"], 0, 0.1, new_k=tk[:, :1], new_v=tk[:, :1])


def test_tail_bad_input_is_refused():
    a = _good_args()
    tk = torch.zeros((a["q"].shape[0], 1, 2, 64), dtype=a["q"].dtype)
    with pytest.raises(ValueError, match="tail_v must be"):
        _call(a, tail_k=tk, tail_v=tk[..., :32])
    with pytest.raises(ValueError, match="tail_k must be"):
        _call(a, tail_k=tk.float(), tail_v=tk)
    with pytest.raises(ValueError, match=r"tail_v must be .*\[B, T >= Tq=1, H, D\] = \[6, 3, 2, 64\]"):
        _call(a, tail_k=torch.cat([tk] * 3, 1), tail_v=torch.cat([tk] * 2, 1))     # K and V of other lengths
    with pytest.raises(ValueError, match="tail_k must be"):
        _call(a, tail_k=tk[:, :0], tail_v=tk[:, :0])                               # shorter than the queries


# ------------------------------------------------------------------------------------------------ bad input
def _good_args():
    st = _state("mixed_nvfp4_bf16", 5, 7)
    q = _torch(decode_queries(st, 1, 4))
    page_table, high_table, lens = _tables(st, jnp.arange(st.max_seqs, dtype=jnp.int32))
    return dict(q=q, pools=_pools(st), layer=0, page_table=page_table, high_table=high_table, kv_lens=lens,
                geom=st.config.twin, sm_scale=0.125, sliding_window=None, soft_cap=None)


def _call(a, **kw):
    return paged_attention(a["q"], *a["pools"], a["layer"], a["page_table"], a["high_table"], a["kv_lens"],
                           a["geom"], a["sm_scale"], a["sliding_window"], a["soft_cap"], **kw)


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(q=a["q"].float()), "q dtype torch.float32"),
    (lambda a: a.update(q=a["q"][..., :3, :]), "Hq=3"),
    (lambda a: a.update(q=a["q"][0]), "q must be a"),
    (lambda a: a.update(layer=2), "layer=2"),
    (lambda a: a.update(layer=-1), "layer=-1"),
    (lambda a: a.update(geom=(32, 5, 7, 1, 2)), "geom page=32"),
    (lambda a: a.update(geom=(16, -1, 7, 1, 2)), "geom must be 5 ints"),
    (lambda a: a.update(page_table=a["page_table"].long()), "page_table has dtype torch.int64"),
    (lambda a: a.update(kv_lens=a["kv_lens"][:1]), "kv_lens has shape"),
    (lambda a: a.update(high_table=None), "high_rows given without high_table"),
    (lambda a: a.update(sliding_window=0), "sliding_window=0"),
    (lambda a: a.update(soft_cap=-1.0), "soft_cap=-1.0"),
    (lambda a: a.update(sm_scale=float("nan")), "sm_scale=nan"),
    (lambda a: a["pools"].__setitem__(3, a["pools"][3].half()), "high_rows dtype torch.float16"),
    (lambda a: a["pools"].__setitem__(5, a["pools"][3]), "exactly one of low_data"),
    (lambda a: a["pools"].__setitem__(1, a["pools"][1][..., :2].contiguous()), "low_scales has shape"),
    (lambda a: a["pools"].__setitem__(0, a["pools"][0].transpose(0, 1)), "must be contiguous"),
])
def test_bad_input_is_refused(change, match):
    a = _good_args()
    change(a)
    with pytest.raises(ValueError, match=match):
        _call(a)


def test_bad_options_are_refused():
    a = _good_args()
    with pytest.raises(ValueError, match="interpret=False needs CUDA"):
        _call(a, interpret=False)
    with pytest.raises(ValueError, match="num_splits=0"):
        _call(a, num_splits=0)
    with pytest.raises(ValueError, match="block_m=8"):
        _call(a, tuning=Tuning(8, 64, 1, 4, 2))


def test_choose_tuning():
    """Splits fill ~4 programs per SM on CUDA (a power of two, bounded by the blocks and 64); 1 in the interpreter.
    Steps: 64 keys / 4 warps for NVFP4-only caches, 32 / 4 with a row pool, 32 / 8 at head_dim 256."""
    t = choose_tuning(16, 8, 4, 128, 32768, cuda=True, sms=132, row_pool=False)
    assert t == Tuning(16, 64, 8, 4, 2)                  # 128 programs -> ceil(528 / 128) = 5 -> 8
    assert choose_tuning(16, 8, 4, 128, 32768, cuda=True, sms=132) == Tuning(16, 32, 8, 4, 2)
    assert choose_tuning(1, 1, 1, 128, 256, cuda=True, sms=132, row_pool=False).num_splits == 4   # 4 blocks
    assert choose_tuning(1, 8, 128, 256, 1 << 20, cuda=True, sms=132) == Tuning(32, 32, 32, 8, 2)  # 4 tiles
    assert choose_tuning(64, 8, 4, 128, 32768, cuda=False).num_splits == 1


def test_bench_helper_runs_on_cpu():
    r = bench_paged_attention(batch=1, context=40, num_kv_heads=1, group=2, head_dim=64, page=16, iters=1,
                              warmup=0, device="cpu")
    assert r["ms"] > 0 and r["shape"]["context"] == 40 and r["tuning"]["num_splits"] == 1


# ------------------------------------------------------------------------------------------------ GPU
def _cuda(xs):
    return [None if x is None else x.cuda() for x in xs]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,first_n,last_n", FORMATS)
def test_gpu_compiled_matches_reference(dtype, first_n, last_n):
    """The compiled kernels (interpret=False) against the float32 reference, default tuning and forced splits."""
    st = _state(dtype, first_n, last_n, lens=(0, 1, 15, 16, 17, 300), d=128)
    for tq, hq, splits in ((1, 8, None), (4, 6, 3), (16, 8, 1)):
        q = decode_queries(st, tq, hq, seed=tq)
        seq = jnp.arange(st.max_seqs, dtype=jnp.int32)
        page_table, high_table, lens = _cuda(_tables(st, seq))
        got = paged_attention(_torch(q).cuda(), *_cuda(_pools(st)), 1, page_table, high_table, lens,
                              st.config.twin, 128 ** -0.5, None, None, num_splits=splits, interpret=False)
        _check([x.cpu() for x in got], *decode_reference(st, 1, q, seq), msg=f"{dtype} Tq {tq} splits {splits}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,first_n,last_n", FORMATS)
def test_gpu_tail_matches_reference(dtype, first_n, last_n):
    """The compiled kernels with the step's rows as a dense tail against the float32 torch reference: Tq 1 / 4 /
    40, forced splits, a window and a soft-cap."""
    from interop.torch_paged import paged_attention_reference
    st = _state(dtype, first_n, last_n, lens=(0, 1, 15, 16, 17, 300), d=128)
    page_table, high_table, lens = _cuda(_tables(st, jnp.arange(st.max_seqs, dtype=jnp.int32)))
    pools = _cuda(_pools(st))
    for tq, hq, splits, window, cap, held in ((1, 8, None, None, None, 0), (4, 6, 3, 9, None, 0),
                                              (40, 2, 2, 30, 2.5, 0), (1, 8, None, None, None, 17),
                                              (2, 4, 2, 9, None, 33)):
        q = _torch(decode_queries(st, tq, hq, seed=tq)).cuda()
        tk, tv = (_torch(x).cuda() for x in _tail_rows(st, held + tq, seed=tq))
        args = (q, *pools, 1, page_table, high_table, lens, st.config.twin, 128 ** -0.5, window, cap)
        got = paged_attention(*args, tail_k=tk, tail_v=tv, num_splits=splits, interpret=False)
        want = paged_attention_reference(*args, tail_k=tk, tail_v=tv)
        _check([x.cpu() for x in got], *(x.cpu() for x in want), msg=f"{dtype} Tq {tq} splits {splits}")


@pytest.mark.gpu
def test_gpu_prepared_calls_reuse_the_compiled_kernel():
    """One `PagedAttention` for many calls (a step's layers): after a specialization's first launch, later calls
    go straight to the compiled kernel's launcher; every call (layers, windows, soft-caps, a transposed query and
    tail as transformers' layout gives them) equals the float32 reference."""
    from interop.torch_paged import paged_attention_reference
    from interop.triton_attention import RUNNERS, PagedAttention
    st = _state("mixed_nvfp4_bf16", 5, 7, lens=(0, 1, 15, 16, 17, 300), d=128)
    page_table, high_table, lens = _cuda(_tables(st, jnp.arange(st.max_seqs, dtype=jnp.int32)))
    pools = _cuda(_pools(st))
    q = _torch(decode_queries(st, 2, 8, seed=4)).cuda()
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)                     # [B, T, Hq, D] view of [B, Hq, T, D]
    tk, tv = (_torch(x).cuda().transpose(1, 2).contiguous().transpose(1, 2) for x in _tail_rows(st, 2, seed=6))
    run = PagedAttention(q, *pools, page_table, high_table, lens, st.config.twin, tail=True, interpret=False)
    for n, (query, layer, window, cap) in enumerate([(q, 1, None, None), (q, 0, None, None), (qt, 1, 9, None),
                                                     (qt, 0, 9, None), (q, 1, None, 3.0), (qt, 0, 5, 3.0),
                                                     (q, 1, None, None)]):
        got = run(query, layer, 0.1, window, cap, tail_k=tk, tail_v=tv)
        want = paged_attention_reference(query, *pools, layer, page_table, high_table, lens, st.config.twin, 0.1,
                                         window, cap, tk, tv)
        _check([x.cpu() for x in got], *(x.cpu() for x in want), msg=f"call {n}")
    assert sum(spec == run.spec for spec, _ in RUNNERS) >= 4
    again = PagedAttention(q, *pools, page_table, high_table, lens, st.config.twin, tail=True, interpret=False)
    before = len(RUNNERS)                        # a new object of the same spec (the next step) launches by runner
    _check([x.cpu() for x in again(q, 1, 0.1, tail_k=tk, tail_v=tv)], *(x.cpu() for x in want), msg="next step")
    assert again.spec == run.spec and len(RUNNERS) == before
    for query in (q, qt):                       # the output stored in q's dtype: .to(q.dtype) of the float32 one
        o32, l32 = run(query, 1, 0.1, 9, None, tail_k=tk, tail_v=tv)
        o16, l16 = run(query, 1, 0.1, 9, None, tail_k=tk, tail_v=tv, out_dtype=q.dtype)
        assert o16.dtype == q.dtype and torch.equal(o16.view(torch.int16), o32.to(q.dtype).view(torch.int16))
        assert torch.equal(l16, l32)
    # a held run's tail grows a row a step: every length launches the one compiled kernel (no new runner)
    kv = [_torch(x).cuda() for x in _tail_rows(st, 40, seed=7)]
    for i, rows in enumerate((2, 16, 17, 32, 40)):
        got = run(q, 1, 0.1, tail_k=kv[0][:, :rows], tail_v=kv[1][:, :rows])
        want = paged_attention_reference(q, *pools, 1, page_table, high_table, lens, st.config.twin, 0.1, None,
                                         None, kv[0][:, :rows], kv[1][:, :rows])
        _check([x.cpu() for x in got], *(x.cpu() for x in want), msg=f"tail of {rows} rows")
        keys = len(run._runners) if i == 0 else keys
    assert len(run._runners) == keys                  # 16 / 32 rows (multiples of 16) launched the same runner


@pytest.mark.gpu
@pytest.mark.parametrize("d,group,first_n,last_n,context", [(128, 4, 4, 32, 32768), (64, 8, 4, 32, 8192),
                                                             (256, 2, 0, 32, 8192)])
def test_gpu_model_size(d, group, first_n, last_n, context):
    """16 sequences x 32k tokens x 8 KV heads x head_dim 128 (8k tokens at head_dim 64 / 256), mixed bf16, compiled,
    against the float32 reference (poisoned pools); then `bench_paged_attention` at that shape runs."""
    lens = [context - 37 * i for i in range(16)]
    cfg = KVCacheConfig("mixed_nvfp4_bf16", first_n=first_n, last_n=last_n, page_size=16, max_draft_len=3)
    st = poisoned_state(cfg, GroupSpec(num_layers=1, num_kv_heads=8, head_dim=d), lens, high_scale=0.02)
    q = decode_queries(st, 1, 8 * group)
    seq = jnp.arange(16, dtype=jnp.int32)
    page_table, high_table, kv_lens = _cuda(_tables(st, seq))
    got = paged_attention(_torch(q).cuda(), *_cuda(_pools(st)), 0, page_table, high_table, kv_lens, st.config.twin,
                          d ** -0.5, None, None, interpret=False)
    _check([x.cpu() for x in got], *decode_reference(st, 0, q, seq), msg=f"16 x 32k head_dim {d}")
    r = bench_paged_attention(batch=16, context=context, num_kv_heads=8, group=group, head_dim=d, iters=10)
    assert r["ms"] > 0


def test_compiles_for_sm90_without_a_gpu():
    """The compiled-mode kernels (``triton.jit``: what CUDA runs) build to a cubin for sm_90 on this machine with
    Triton's bundled ptxas: the paths the interpreter cannot check (globals, constexpr branches, layouts) compile.
    One variant with every branch on: NVFP4 + FP8 twin, sliding window, soft-cap, GQA 3 x Tq 2, partial output, the
    step's rows as a dense tail read from new_k / new_v and kept in it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from interop.triton_attention import _kernels

    attn, merge = _kernels(False)
    sig = dict(q_ptr="*bf16", sq_b="i32", sq_t="i32", sq_h="i32", pt_ptr="*i32", s_pt="i32", ht_ptr="*i32",
               s_ht="i32", lens_ptr="*i32", data_ptr="*u8", scales_ptr="*u8", gs_ptr="*fp32", rows_ptr="*u8",
               rscale_ptr="*fp32", o_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32", tk_ptr="*bf16", stk_b="i32",
               stk_t="i32", stk_h="i32", tv_ptr="*bf16", stv_b="i32", stv_t="i32", stv_h="i32", tail_len="i32",
               nk_ptr="*bf16", snk_b="i32", snk_t="i32", snk_h="i32", nv_ptr="*bf16", snv_b="i32", snv_t="i32",
               snv_h="i32", layer="i32", num_pages="i32",
               num_row_pages="i32", num_cols="i32", ht_width="i32", sm_scale="fp32", window="i32", cap="fp32")
    const = dict(H=2, G=3, TQ=2, D=64, PAGE=16, LOW=True, TWIN=True, ROWS_FP8=True, FIRST_N=5, LAST_N=7,
                 NUM_FIXED=1, NUM_RING=2, HAS_WINDOW=True, HAS_CAP=True, SPLIT_LOW=False, SPLIT_ROWS=False,
                 FINAL=False, BLOCK_M=16, BLOCK_N=32, EMULATE=False, TAIL=True, SPLIT_TAIL=True, NEW=True)
    sig.update(dict.fromkeys(const, "constexpr"))
    attrs = {(i,): [["tt.divisibility", 16]] for i, v in enumerate(sig.values()) if v.startswith("*")}
    target = GPUTarget("cuda", 90, 32)
    cc = triton.compile(ASTSource(fn=attn, signature=sig, constexprs=const, attrs=attrs), target=target,
                        options=dict(num_warps=4, num_stages=2))
    assert "mma.sync" in cc.asm["ptx"] and len(cc.asm["cubin"]) > 0
    msig = dict(o_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32", out_ptr="*fp32", lse_ptr="*fp32", num_splits="i32",
                D="constexpr", BLOCK_S="constexpr", EMULATE="constexpr")
    mconst = dict(D=64, BLOCK_S=4, EMULATE=False)
    cc = triton.compile(ASTSource(fn=merge, signature=msig, constexprs=mconst), target=target)
    assert len(cc.asm["cubin"]) > 0
    # the one-split kernel and the merge storing the output in the attention dtype (`PagedAttention` out_dtype)
    const.update(FINAL=True)
    cc = triton.compile(ASTSource(fn=attn, signature={**sig, "o_ptr": "*bf16"}, constexprs=const, attrs=attrs),
                        target=target, options=dict(num_warps=4, num_stages=2))
    assert "cvt.rn.bf16" in cc.asm["ptx"] and len(cc.asm["cubin"]) > 0
    cc = triton.compile(ASTSource(fn=merge, signature={**msig, "out_ptr": "*bf16"}, constexprs=mconst), target=target)
    assert "cvt.rn.bf16" in cc.asm["ptx"] and len(cc.asm["cubin"]) > 0
