"""interop.torch_cache.TorchKVCache against the JAX API on the same inputs (bit-exact), the all-high invariant,
speculative accept / correction, fork, all-layer staging, per-call sync / validate, the torch exporters (int32
tensors on the cache's device, 0-padded vLLM tables, the reserved null page), capacity queries and bad inputs."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from interop import torch_cache as tc
from interop.dlpack import to_torch
from interop.torch_cache import CacheCapacityError, TorchKVCache
from jmixedkv import CacheManager, GroupSpec, KVCacheConfig, append, init_state, rows_reference, stage_reference
from jmixedkv import checks as checks_mod, gather, speculative, staging
from jmixedkv.decode import decode_attention
from jmixedkv.state import admit

from helpers import assert_trees_bit_equal

L, H, HQ, D, PAGE = 2, 2, 4, 32, 16
LENS = (0, 1, 15, 16, 17, 33)            # 0, 1, page-1, page, page+1, 2 pages + 1
NUM_PAGES, MAX_PAGES = 14, 4
CFG = KVCacheConfig("mixed_nvfp4_bf16", first_n=5, last_n=12, page_size=PAGE, max_draft_len=3)
ORDER = np.random.default_rng(7).permutation(NUM_PAGES)
GS = np.array([[0.5, 2.0], [1.5, 0.25]], np.float32)

# every cache in this file has the same geometry (the jitted transitions compile once)
GEOM = dict(num_pages=NUM_PAGES, max_seqs=len(LENS), max_pages_per_seq=MAX_PAGES, backend="reference")
_stage_ref = jax.jit(stage_reference)
_rows_ref = jax.jit(lambda s, seq, idx: rows_reference(s, 1, seq[:, None], idx))


def _new_cache(**kw):
    return TorchKVCache(CFG, L, H, D, **GEOM, **kw)


_read_stage = jax.jit(staging.stage, static_argnames=("group", "backend", "validate"))
_read_gather = jax.jit(gather.gather_rows, static_argnames=("group", "backend", "validate", "scratch_dtype"))


def jax_stage(state, layer, seq):
    """The JAX API `jmixedkv.staging.stage` on the mirrored state."""
    return _read_stage(state, None if layer is None else jnp.int32(layer), jnp.asarray(seq), group=0,
                       backend="reference", validate=False)


def jax_gather(state, layer, seq, idx, scratch):
    return _read_gather(state, jnp.int32(layer), jnp.asarray(seq), jnp.asarray(idx), group=0,
                        scratch_dtype=scratch, backend="reference", validate=False)


def _bytes(t):
    if isinstance(t, torch.Tensor):
        return t.detach().cpu().contiguous().view(torch.uint8).numpy()
    return np.asarray(t).view(np.uint8)


def _tokens(lens, rng, start=None):
    start = [0] * len(lens) if start is None else start
    seq = np.concatenate([np.full(n, s) for s, n in enumerate(lens)]).astype(np.int32)
    pos = np.concatenate([np.arange(a, a + n) for a, n in zip(start, lens)]).astype(np.int32)
    perm = rng.permutation(seq.size)                      # ragged, shuffled token order
    return seq[perm], pos[perm]


def _kv(rng, shape):
    k = torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(torch.bfloat16)
    v = torch.from_numpy((rng.standard_normal(shape) * 2).astype(np.float32)).to(torch.bfloat16)
    return k, v


def _jax(t):
    return jnp.asarray(t.float().numpy()).astype(jnp.bfloat16)


@functools.lru_cache(maxsize=None)
def _pair():
    """(TorchKVCache, mirrored JAX CacheState via the host `CacheManager`, dense K/V written, f32
    ``[L, kv, S, H, max_len, D]``) after a ragged all-layer prefill and a per-layer decode step."""
    rng = np.random.default_rng(0)
    cache = _new_cache(poison=True, page_order=ORDER, gs=jnp.asarray(GS))
    mirror = CacheManager(CFG, GroupSpec(L, H, D), NUM_PAGES, len(LENS), MAX_PAGES, backend="reference",
                          poison=True, page_order=ORDER, gs=jnp.asarray(GS))
    mirror.state = jax.device_put(mirror.state, jax.devices()[0])
    written = np.zeros((L, 2, len(LENS), H, MAX_PAGES * PAGE, D), np.float32)
    for s in range(len(LENS)):
        assert cache.admit() == s
        mirror.admit(s)
    pre = [max(n - 1, 0) for n in LENS]                    # prefill n-1 tokens, then one decode token
    seq, pos = _tokens(pre, rng)
    k, v = _kv(rng, (L, seq.size, H, D))
    cache.append(None, k, v, torch.from_numpy(seq), torch.from_numpy(pos))
    kp, vp, sp, pp = tc._pad_tokens(k, v, seq, pos, token_axis=1)     # same bucketed shapes: one compile
    mirror.append(None, _jax(kp), _jax(vp), sp, pp)
    for t in range(seq.size):
        written[:, 0, seq[t], :, pos[t]] = k[:, t].float().numpy()
        written[:, 1, seq[t], :, pos[t]] = v[:, t].float().numpy()
    dec = np.array([s for s, n in enumerate(LENS) if n > 0], np.int32)
    dpos = np.array([LENS[s] - 1 for s in dec], np.int32)
    for layer in range(L):
        k, v = _kv(rng, (dec.size, H, D))
        cache.append(layer, k, v, torch.from_numpy(dec).long(), dpos)        # int64 slots accepted
        kp, vp, sp, pp = tc._pad_tokens(k, v, dec, dpos, token_axis=0)
        mirror.append(layer, _jax(kp), _jax(vp), sp, pp)
        for t in range(dec.size):
            written[layer, 0, dec[t], :, dpos[t]] = k[t].float().numpy()
            written[layer, 1, dec[t], :, dpos[t]] = v[t].float().numpy()
    return cache, mirror.state, written


SEQ = np.array([5, -1, 0, 1, 2, 3, 4], np.int32)


def test_lengths_and_pages_mirror_jax():
    cache, state, _ = _pair()
    np.testing.assert_array_equal(cache.kv_lens().numpy(), LENS)
    np.testing.assert_array_equal(np.asarray(cache.state.page_table), np.asarray(state.page_table))
    assert cache.free_pages == int(state.alloc.num_free) == NUM_PAGES - sum(-(-n // PAGE) for n in LENS)


@pytest.mark.parametrize("layer", [0, 1])
def test_stage_bit_exact_vs_jax(layer):
    cache, state, _ = _pair()
    st = cache.stage(layer, torch.from_numpy(SEQ))
    want = jax_stage(state, layer, SEQ)
    np.testing.assert_array_equal(st.page_table.numpy(), np.asarray(want.page_table))
    np.testing.assert_array_equal(st.kv_lens.numpy(), np.asarray(want.kv_lens))
    used = int(np.ceil(np.asarray(want.kv_lens) / PAGE).sum())
    np.testing.assert_array_equal(_bytes(st.pages[:used]), _bytes(want.pages[:used]))
    k, v = st.dense()                                       # independent: dense reference oracle
    dense = _stage_ref(state, layer, SEQ)
    np.testing.assert_array_equal(_bytes(k), _bytes(dense[:, 0]))
    np.testing.assert_array_equal(_bytes(v), _bytes(dense[:, 1]))
    assert st.k_pages.shape == (SEQ.size * MAX_PAGES, H, PAGE, D)
    indptr, indices, last = st.flashinfer_csr(as_numpy=True)
    np.testing.assert_array_equal(indices, np.arange(used))
    np.testing.assert_array_equal(last, [(n - 1) % PAGE + 1 if n else 0 for n in np.asarray(want.kv_lens)])


@pytest.mark.parametrize("scratch", [None, "fp8"])
def test_gather_rows_bit_exact_vs_jax(scratch):
    cache, state, _ = _pair()
    rng = np.random.default_rng(3)
    seq = np.array([5, 3, -1, 1], np.int32)
    idx = np.stack([rng.integers(-1, max(LENS[s], 1) if s >= 0 else 1, 6) for s in seq]).astype(np.int32)
    idx[1] = [0, 4, 5, 14, 15, -1]
    idx[3] = [0, -1, -1, 0, 0, -1]
    k, v, scale = cache.gather_rows(1, torch.from_numpy(seq), torch.from_numpy(idx), scratch_dtype=scratch)
    rows, wscale = jax_gather(state, 1, seq, idx, scratch)
    np.testing.assert_array_equal(_bytes(k), _bytes(rows[:, :, 0]))
    np.testing.assert_array_equal(_bytes(v), _bytes(rows[:, :, 1]))
    np.testing.assert_array_equal(scale.numpy(), np.asarray(wscale))
    if scratch is None:                                    # independent: the rows oracle
        ref = _rows_ref(state, seq, idx)
        np.testing.assert_array_equal(_bytes(k), _bytes(ref[:, :, 0]))


@pytest.mark.parametrize("tq", [1, 2])
def test_decode_attention_bit_exact_vs_jax(tq):
    cache, state, _ = _pair()
    rng = np.random.default_rng(4)
    q = torch.from_numpy(rng.standard_normal((SEQ.size, tq, HQ, D)).astype(np.float32)).to(torch.bfloat16)
    out, lse = cache.decode_attention(1, q, torch.from_numpy(SEQ))
    want_out, want_lse = decode_attention(state, 1, _jax(q), SEQ, backend="reference")
    np.testing.assert_array_equal(_bytes(out), _bytes(want_out))
    np.testing.assert_array_equal(lse.numpy(), np.asarray(want_lse))
    assert (out[1] == 0).all() and torch.isneginf(lse[1]).all()          # padding row
    if tq == 1:
        out3, lse3 = cache.decode_attention(1, q[:, 0], torch.from_numpy(SEQ))
        assert torch.equal(out3, out[:, 0]) and torch.equal(lse3, lse[:, 0])


def test_decode_attention_takes_slot_tensors_as_they_are_without_validation(monkeypatch):
    """``validate=False`` with a torch slot tensor: no host copy of the slots (it would wait for the GPU); equal to
    the host-checked read, bitwise; a slot out of range -- int64 values that would wrap into range as int32
    included -- reads as NaN on its own row, every other row bitwise unchanged, the state untouched; with
    validation the same slots raise, naming the value."""
    cache, state, _ = _pair()
    rng = np.random.default_rng(5)
    q = torch.from_numpy(rng.standard_normal((SEQ.size, 2, HQ, D)).astype(np.float32)).to(torch.bfloat16)
    want_out, want_lse = cache.decode_attention(1, q, SEQ)
    before = [np.asarray(x).copy() for x in jax.tree_util.tree_leaves(cache.state)]
    n = cache.max_seqs
    with monkeypatch.context() as m:
        m.setattr(cache, "_indices", lambda *a, **k: pytest.fail("slots were copied to the host"))
        for dtype in (torch.int32, torch.int64):
            out, lse = cache.decode_attention(1, q, torch.from_numpy(SEQ).to(dtype), validate=False)
            np.testing.assert_array_equal(_bytes(out), _bytes(want_out))
            np.testing.assert_array_equal(lse.numpy(), want_lse.numpy())
        bad_slots = ((torch.int32, n), (torch.int32, -7), (torch.int64, 2 ** 32 + 2), (torch.int64, -2 ** 40))
        for dtype, bad_value in bad_slots:
            slots = torch.from_numpy(SEQ).to(dtype).clone()              # SEQ itself stays as it is
            slots[3] = bad_value                                       # 2**32 + 2 would wrap to slot 2
            out, lse = cache.decode_attention(1, q, slots, validate=False)
            assert torch.isnan(out[3].float()).all() and torch.isnan(lse[3]).all(), (dtype, bad_value)
            keep = np.arange(SEQ.size) != 3
            np.testing.assert_array_equal(_bytes(out[keep]), _bytes(want_out[keep]))
            np.testing.assert_array_equal(lse[keep].numpy(), want_lse[keep].numpy())
    for a, b in zip(before, jax.tree_util.tree_leaves(cache.state)):
        np.testing.assert_array_equal(a, np.asarray(b))
    slots = torch.from_numpy(SEQ).clone()
    slots[3] = n
    with pytest.raises(ValueError, match=f"seq_slots.*{n}"):
        cache.decode_attention(1, q, slots)
    with pytest.raises(ValueError, match="int32 .or int64. tensor"):
        cache.decode_attention(1, q, torch.from_numpy(SEQ).float(), validate=False)


def test_stage_takes_slot_tensors_as_they_are_without_validation(monkeypatch):
    """``stage(validate=False)`` with a torch slot tensor: no host copy; the same staged cache as the host-checked
    call, bitwise; an out-of-range slot stages one page of NaN for its row, the other rows' K/V bitwise unchanged."""
    cache, _, _ = _pair()
    want = cache.stage(1, SEQ)
    want_k, want_v = want.dense()
    with monkeypatch.context() as m:
        m.setattr(cache, "_indices", lambda *a, **k: pytest.fail("slots were copied to the host"))
        got = cache.stage(1, torch.from_numpy(SEQ).clone(), validate=False)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(_bytes(a), _bytes(b))
        slots = torch.from_numpy(SEQ).to(torch.int64)
        slots[2] = 2 ** 32                                     # slot 0 once wrapped to int32
        bad = cache.stage(1, slots, validate=False)
    k, v = bad.dense()
    assert torch.isnan(k[2, :, :PAGE].float()).all() and torch.isnan(v[2, :, :PAGE].float()).all()
    keep = np.arange(SEQ.size) != 2
    np.testing.assert_array_equal(_bytes(k[keep]), _bytes(want_k[keep]))
    np.testing.assert_array_equal(_bytes(v[keep]), _bytes(want_v[keep]))


def test_gather_rows_takes_index_tensors_as_they_are_without_validation(monkeypatch):
    """``gather_rows(validate=False)`` with torch slot and index tensors: no host copy, the host-checked call's rows
    bitwise; an int64 index that would wrap into range as int32 reads as an out-of-range one does (the host path's
    ``INT32_MAX``), an out-of-range slot gives NaN rows for its row only."""
    cache, _, _ = _pair()
    seq = np.array([5, 3, -1, 1], np.int32)
    idx = np.array([[0, 1, 2, -1], [0, 4, 5, 14], [-1, -1, -1, -1], [0, -1, -1, 0]], np.int32)
    far = idx.copy()
    far[1, 2] = checks_mod.INT32_MAX
    want = cache.gather_rows(1, seq, far, validate=False)          # host arrays: copied, checked to fit int32 only
    with monkeypatch.context() as m:
        m.setattr(cache, "_indices", lambda *a, **k: pytest.fail("indices were copied to the host"))
        same = cache.gather_rows(1, torch.from_numpy(seq.copy()), torch.from_numpy(far.copy()), validate=False)
        wrapping = torch.from_numpy(idx.astype(np.int64))
        wrapping[1, 2] = 2 ** 32 + 5                              # position 5 once wrapped to int32
        got = cache.gather_rows(1, torch.from_numpy(seq.astype(np.int64)), wrapping, validate=False)
        bad_seq = torch.from_numpy(seq.copy())
        bad_seq[3] = cache.max_seqs
        bad = cache.gather_rows(1, bad_seq, torch.from_numpy(idx.copy()), validate=False)
    for a, b, c in zip(same, got, want):
        np.testing.assert_array_equal(_bytes(a), _bytes(c))
        np.testing.assert_array_equal(_bytes(b), _bytes(c))
    plain = cache.gather_rows(1, seq, idx)
    assert torch.isnan(bad[0][3].float()).all() and torch.isnan(bad[1][3].float()).all()
    for a, b in zip(bad[:2], plain[:2]):
        np.testing.assert_array_equal(_bytes(a[:3]), _bytes(b[:3]))


def test_stage_all_layers_in_one_call():
    cache, state, _ = _pair()
    st = cache.stage(None, torch.from_numpy(SEQ), sync="stream", validate=False)
    assert st.pages.shape[0] == L and st.pages.dim() == 6
    want = jax_stage(state, None, SEQ)
    used = int(np.ceil(np.asarray(want.kv_lens) / PAGE).sum())
    np.testing.assert_array_equal(_bytes(st.pages[:, :used]), _bytes(want.pages[:, :used]))
    for layer in range(L):                               # each layer equals the one-layer staging
        one = cache.stage(layer, torch.from_numpy(SEQ))
        for a, b in zip(st.layer(layer).dense(), one.dense()):
            np.testing.assert_array_equal(_bytes(a), _bytes(b))
    with pytest.raises(ValueError, match="pick a layer"):
        st.dense()
    with pytest.raises(ValueError, match="out of range"):
        st.layer(L)


def test_per_call_sync_and_validate():
    cache, state, _ = _pair()
    rng = np.random.default_rng(6)
    q = torch.from_numpy(rng.standard_normal((SEQ.size, 1, HQ, D)).astype(np.float32)).to(torch.bfloat16)
    base = cache.decode_attention(1, q, SEQ)
    for sync in (True, False, "stream"):
        out, lse = cache.decode_attention(1, q, SEQ, sync=sync, validate=False)
        assert torch.equal(out, base[0]) and torch.equal(lse, base[1])
    with pytest.raises(ValueError, match="sync must be one of"):
        cache.stage(0, SEQ, sync="later")
    with pytest.raises(ValueError, match="sync must be one of"):
        TorchKVCache(CFG, L, H, D, **GEOM, sync="maybe")
    # validate=True (the default) catches a slot that is in range but not admitted; validate=False skips the
    # host pull of the tables (what a hot loop wants) and the read still runs
    fresh = _new_cache()
    fresh.admit(0)
    with pytest.raises(ValueError):
        fresh.gather_rows(0, [0], [[3]])
    fresh.gather_rows(0, [0], [[3]], validate=False)


def test_lse_base_conversion():
    cache, state, _ = _pair()
    rng = np.random.default_rng(8)
    q = torch.from_numpy(rng.standard_normal((SEQ.size, HQ, D)).astype(np.float32)).to(torch.bfloat16)
    out, lse = cache.decode_attention(0, q, SEQ)
    # independent: natural-log LSE of the staged K over the live rows, by hand in float64
    k, _ = cache.stage(0, SEQ).dense()
    for b, s in enumerate(SEQ):
        n = LENS[s] if s >= 0 else 0
        if n == 0:
            assert torch.isneginf(lse[b]).all() and torch.isneginf(tc.lse_to_base2(lse[b])).all()
            continue
        kk = k[b, :, :n].double().repeat_interleave(HQ // H, dim=0)                 # [Hq, n, D]
        logits = torch.einsum("hd,hnd->hn", q[b].double(), kk) * D ** -0.5
        want = torch.logsumexp(logits, -1)
        np.testing.assert_allclose(lse[b].numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
        want2 = torch.log2(torch.exp2(logits * tc.LOG2_E).sum(-1))                  # FlashInfer's base 2
        np.testing.assert_allclose(tc.lse_to_base2(lse[b]).numpy(), want2.numpy(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tc.lse_from_base2(tc.lse_to_base2(lse[b])), lse[b])
    assert tc.lse_to_base2(1.0) == pytest.approx(1.4426950408889634)


def test_fork_copies_a_sequence_and_leaves_others_alone():
    cache = _new_cache()
    rng = np.random.default_rng(9)
    for s in range(3):
        cache.admit(s)
    seq = np.repeat([0, 1, 2], [20, 7, 3]).astype(np.int32)
    pos = np.concatenate([np.arange(20), np.arange(7), np.arange(3)]).astype(np.int32)
    k, v = _kv(rng, (L, seq.size, H, D))
    cache.append(None, k, v, seq, pos)
    before = [[_bytes(t) for t in cache.stage(l, [0, 1, 2]).dense()] for l in range(L)]
    dst = cache.fork(0)
    assert dst == 3 and cache.kv_len(3) == 20
    for l in range(L):
        got = cache.stage(l, [0, 1, 2, 3]).dense()
        for i, t in enumerate(got):
            np.testing.assert_array_equal(_bytes(t[:3]), before[l][i])             # the others unchanged
            np.testing.assert_array_equal(_bytes(t[3]), before[l][i][0])           # the fork reads as src
    # appending to the fork does not touch the source (the partial page was copied)
    k1, v1 = _kv(rng, (1, H, D))
    for l in range(L):
        cache.append(l, k1, v1, [3], [20])
    for l in range(L):
        kd, vd = cache.stage(l, [0]).dense()
        np.testing.assert_array_equal(_bytes(kd), before[l][0][:1])
    with pytest.raises(ValueError, match="not admitted"):
        cache.fork(5)
    with pytest.raises(ValueError, match="admitted already"):
        cache.fork(0, 1)
    cache.fork(1, 4), cache.fork(2, 5)
    with pytest.raises(CacheCapacityError, match="no free sequence slot"):
        cache.fork(0)


def test_exporters_give_int32_tensors_on_the_cache_device():
    cache, state, _ = _pair()
    csr = cache.flashinfer_page_table([5, 0, -1, 2])
    assert all(isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.device == cache.device for t in csr)
    np_csr = cache.flashinfer_page_table([5, 0, -1, 2], as_numpy=True)
    for t, a in zip(csr, np_csr):
        assert isinstance(a, np.ndarray) and a.dtype == np.int32 and (t.numpy() == a).all()
    st = cache.stage(0, SEQ)
    scsr = st.flashinfer_csr()
    assert all(t.dtype == torch.int32 and t.device == st.pages.device for t in scsr)
    table, lens = st.block_table()
    assert table.dtype == torch.int32 and lens.dtype == torch.int32
    # the staged CSR over the staged pages reproduces the mixed (dense) reading; the NVFP4-pool CSR is history
    # only: it equals staging a twin-less view (tested in test_layouts)
    kd, _ = st.dense()
    for b in range(SEQ.size):
        n = int(st.kv_lens[b])
        pages = scsr.kv_indices[scsr.kv_indptr[b]:scsr.kv_indptr[b + 1]].long()
        rows = st.k_pages[pages].permute(1, 0, 2, 3).reshape(H, -1, D)[:, :n]
        assert torch.equal(rows, kd[b, :, :n])
        assert (table[b, len(pages):] == 0).all() and torch.equal(table[b, :len(pages)], pages.int())


def test_block_table_zero_padding_and_reserved_null_page():
    cache, _, _ = _pair()
    table, lens = cache.block_table([4, 2, -1])
    assert lens.tolist() == [17, 15, 0] and (table[0, 2:] == 0).all() and (table[1, 1:] == 0).all()
    assert (table[2] == 0).all()
    t1, _ = cache.block_table([4, 2], pad=-1)
    assert (t1[0, 2:] == -1).all()
    with pytest.raises(ValueError, match="pad must be"):
        cache.block_table([4], pad=-2)
    # reserved null page: page 0 never holds data, so 0-padding is vLLM's null block exactly
    null = TorchKVCache(CFG, L, H, D, **GEOM, reserve_null_page=True)
    assert null.free_pages == NUM_PAGES - 1
    rng = np.random.default_rng(10)
    for s in range(len(LENS)):
        null.admit(s)
    seq = np.repeat(np.arange(len(LENS)), [min(n, 16) for n in LENS]).astype(np.int32)   # one page per slot
    pos = np.concatenate([np.arange(min(n, 16)) for n in LENS]).astype(np.int32)
    k, v = _kv(rng, (L, seq.size, H, D))
    null.append(None, k, v, seq, pos)
    table, lens = null.block_table(list(range(len(LENS))))
    used = table[torch.arange(table.shape[1])[None, :] < ((lens[:, None] + PAGE - 1) // PAGE)]
    assert (used > 0).all() and null.free_pages == NUM_PAGES - 1 - int((lens > 0).sum())
    assert (np.asarray(null.state.page_table) != 0).all()


def test_all_high_stage_equals_inputs():
    """Invariant 2: first_n + last_n = 17 >= n -> staged rows are the appended bf16 rows bit for bit (slots of
    lengths 0, 1, 15, 16, 17); the 33-token slot is checked on its retained rows only."""
    cache, _, written = _pair()
    for layer in range(L):
        kd, vd = cache.stage(layer, list(range(len(LENS)))).dense()
        for s, n in enumerate(LENS):
            for kv, got in enumerate((kd, vd)):
                g = got[s].float().numpy()
                if n <= CFG.first_n + CFG.last_n:
                    np.testing.assert_array_equal(g[:, :n], written[layer, kv, s, :, :n])
                else:
                    keep = [p for p in range(n) if p < CFG.first_n or p >= n - CFG.last_n]
                    np.testing.assert_array_equal(g[:, keep], written[layer, kv, s][:, keep])
                    assert not np.array_equal(g[:, :n], written[layer, kv, s, :, :n])   # NVFP4 in between
                assert (g[:, n:] == 0).all()


def _spec_cache():
    cache = _new_cache(poison=True)
    cache.admit(), cache.admit()
    return cache


def test_accept_equals_appending_only_accepted_tokens():
    """Invariant 3 through the torch API, and the JAX speculative.accept on the mirrored state."""
    rng = np.random.default_rng(8)
    k, v = _kv(rng, (24, H, D))
    seq0 = torch.zeros(24, dtype=torch.int32)
    a, b = _spec_cache(), _spec_cache()
    a.append(0, k[:20], v[:20], seq0[:20], torch.arange(20, dtype=torch.int32))
    for layer in range(L):          # verify: 1 + 3 drafts, every layer (an accept between layers is refused)
        a.append(layer, k[20:], v[20:], seq0[20:], torch.arange(20, 24, dtype=torch.int32))
    before = a.state
    a.accept([0, -1], [1, 0], [3, 0])
    assert a.kv_len(0) == 22
    b.append(0, k[:22], v[:22], seq0[:22], torch.arange(22, dtype=torch.int32))
    for x, y in zip(a.stage(0, [0]).dense(), b.stage(0, [0]).dense()):
        assert torch.equal(x, y)
    want = speculative.accept(before, np.array([0], np.int32), 1, 3)
    np.testing.assert_array_equal(np.asarray(a.state.kv_lens), np.asarray(want.kv_lens))
    with pytest.raises(ValueError, match="written - max_draft_len"):
        a.correct_kv_lens([-2], seq_slots=[0])            # 24 written: rewinds stop at 24 - 3 = 21
    a.correct_kv_lens([-1], seq_slots=[0])
    assert a.kv_len(0) == 21
    a.append(0, k[21:22], v[21:22], seq0[:1], torch.arange(21, 22, dtype=torch.int32))    # re-append
    for x, y in zip(a.stage(0, [0]).dense(), b.stage(0, [0]).dense()):
        assert torch.equal(x, y)


def test_speculative_bad_inputs():
    cache = _spec_cache()
    cache.append(0, *_kv(np.random.default_rng(9), (10, H, D)), torch.zeros(10, dtype=torch.int32),
                 torch.arange(10, dtype=torch.int32))
    with pytest.raises(ValueError, match="slot 0: offset 1"):
        cache.correct_kv_lens([1], seq_slots=[0])          # positive
    with pytest.raises(ValueError, match="slot 0: offset -4"):
        cache.correct_kv_lens([-4], seq_slots=[0])         # past max_draft_len
    with pytest.raises(ValueError, match="slot 1: offset -1"):
        cache.correct_kv_lens([0, -1, 0, 0, 0, 0])         # an idle slot
    with pytest.raises(ValueError, match="max_seqs=6"):
        cache.correct_kv_lens([0, 0, 0])
    with pytest.raises(ValueError, match="same length"):
        cache.correct_kv_lens([0, 0], seq_slots=[0])
    with pytest.raises(ValueError, match="num_accepted <= num_drafts"):
        cache.accept([0], [2], [1])
    with pytest.raises(ValueError, match="distinct"):
        cache.accept([0, 0], [0, 0], [1, 1])
    assert cache.kv_len(0) == 10


def test_capacity_queries_and_errors():
    cache = _new_cache()
    assert cache.can_admit() and cache.free_pages == NUM_PAGES
    for s in range(len(LENS)):
        cache.admit()
    assert not cache.can_admit()
    with pytest.raises(CacheCapacityError, match="no free sequence slot"):
        cache.admit()
    k, v = _kv(np.random.default_rng(10), (MAX_PAGES * PAGE + 1, H, D))
    pos = torch.arange(MAX_PAGES * PAGE + 1, dtype=torch.int32)
    zeros = torch.zeros(MAX_PAGES * PAGE + 1, dtype=torch.int32)
    with pytest.raises(CacheCapacityError, match="past the page table"):
        cache.append(0, k, v, zeros, pos)
    n = MAX_PAGES * PAGE
    for s in range(3):                                     # 3 x 4 pages of 14
        assert cache.can_append(zeros[:n] + s, pos[:n])
        for h in (0, n // 2):                               # two 32-token chunks (a shared compiled size)
            cache.append(0, k[h:h + n // 2], v[h:h + n // 2], zeros[:n // 2] + s, pos[h:h + n // 2])
    assert cache.free_pages == NUM_PAGES - 12
    assert not cache.can_append(zeros[:33] + 3, pos[:33])      # 3 pages needed, 2 free
    with pytest.raises(CacheCapacityError, match="short by 2"):
        cache.append(0, k[:n], v[:n], zeros[:n] + 3, pos[:n])
    assert cache.free_pages == 2 and cache.kv_len(3) == 0
    assert cache.can_append(zeros[:32] + 3, pos[:32])
    cache.release(1)
    assert cache.free_pages == 6 and cache.can_admit(1) and not cache.can_admit(0)


def test_bad_inputs_raise_clear_errors():
    cache, _, _ = _pair()
    rng = np.random.default_rng(11)
    k, v = _kv(rng, (3, H, D))
    seq, pos = torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="float64"):
        cache.append(0, k.double(), v.double(), seq, pos)
    with pytest.raises(ValueError, match="torch.int32"):
        cache.append(0, k.to(torch.int32), v, seq, pos)
    with pytest.raises(ValueError, match=r"k must have shape \[3, 2, 32\]"):
        cache.append(0, k[:, :1], v, seq, pos)
    with pytest.raises(ValueError, match="v is torch.float16"):
        cache.append(0, k, v.half(), seq, pos)
    with pytest.raises(ValueError, match=r"layer \(group '.*'\)=2 out of range"):
        cache.append(2, k, v, seq, pos)
    with pytest.raises(ValueError, match=r"seq_slots\[1\]=9 out of range \[-1, "):
        cache.append(0, k, v, torch.tensor([0, 9, 1], dtype=torch.int32), pos)
    with pytest.raises(ValueError, match=r"seq_slots\[1\]=9 out of range \[-1, "):      # a JAX array: checked too
        cache.append(0, k, v, jnp.array([0, 9, 1], jnp.int32), pos)
    with pytest.raises(ValueError, match="int32"):
        cache.append(0, k, v, seq.float(), pos)
    with pytest.raises(ValueError, match="same length"):
        cache.append(0, k, v, seq, pos[:2])
    with pytest.raises(ValueError, match="is on meta"):
        cache.append(0, k.to("meta"), v, seq, pos)
    with pytest.raises(ValueError, match="layer .*=-1 out of range"):
        cache.stage(-1, [0])
    for group in (1, -1, "0", None):                       # one rule: jmixedkv.checks.check_group
        want = re.escape(f"group={group!r} out of range [0, 1)")
        with pytest.raises(ValueError, match="append: " + want):
            cache.append(0, k, v, seq, pos, group=group)
        with pytest.raises(ValueError, match="stage: " + want):
            cache.stage(0, [0], group=group)
    with pytest.raises(ValueError, match="indices"):
        cache.gather_rows(0, [1], [[0, 1]])               # slot 1 has length 1
    q = torch.zeros(2, 1, HQ, D)
    with pytest.raises(ValueError, match="attention dtype"):
        cache.decode_attention(0, q, [0, 1])
    with pytest.raises(ValueError, match="Tq=5"):
        cache.decode_attention(0, torch.zeros(2, 5, HQ, D, dtype=torch.bfloat16), [0, 1])
    with pytest.raises(ValueError, match="multiple"):
        cache.decode_attention(0, torch.zeros(2, 1, 3, D, dtype=torch.bfloat16), [0, 1])
    with pytest.raises(ValueError, match="does not match"):
        _new_cache(device="cuda")
    with pytest.raises(ValueError, match="num_layers"):
        TorchKVCache(CFG, num_pages=2, max_seqs=1)
    unadmitted = _new_cache()
    with pytest.raises(ValueError, match="not admitted"):
        unadmitted.append(0, k[:1], v[:1], [0], [0])


def test_outputs_are_zero_copy_views():
    cache, _, _ = _pair()
    lens = cache.kv_lens()
    assert lens.data_ptr() == cache.state.kv_lens.unsafe_buffer_pointer()
    st = cache.stage(0, [0])
    assert st.pages.dtype == torch.bfloat16 and st.page_table.dtype == torch.int32
    assert to_torch(cache.state.page_table).dtype == torch.int32
    indptr, indices, last = cache.flashinfer_page_table([5, 0, -1])
    assert indptr.tolist() == [0, 3, 3, 3] and last.tolist() == [1, 0, 0]


def test_custom_ops_opcheck():
    cache, state, _ = _pair()
    q = torch.from_numpy(np.random.default_rng(13).standard_normal((3, 1, HQ, D)).astype(np.float32)).to(torch.bfloat16)
    seq = torch.tensor([5, -1, 2], dtype=torch.int32)
    out, lse = torch.ops.jmixedkv.decode_attention(cache.handle, 1, q, seq)
    want, want_lse = cache.decode_attention(1, q, seq)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    torch.library.opcheck(tc.decode_attention_op, (cache.handle, 1, q, seq))
    k, v = torch.ops.jmixedkv.stage_dense(cache.handle, 0, seq)
    wk, wv = cache.stage(0, seq).dense()
    assert torch.equal(k, wk) and torch.equal(v, wv)
    torch.library.opcheck(tc.stage_dense_op, (cache.handle, 0, seq))
    with pytest.raises(ValueError, match="no live TorchKVCache"):
        tc.cache_from_handle(10 ** 6)


# ------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_gpu_torch_cache_matches_jax(backend):
    gpu = jax.devices("gpu")[0]
    with jax.default_device(gpu):
        cache = TorchKVCache(CFG, 1, H, D, num_pages=8, max_seqs=2, max_pages_per_seq=4, device="cuda",
                             backend=backend)
        state = jax.device_put(init_state(CFG, GroupSpec(1, H, D), 8, 2, 4), gpu)
        for s in range(2):
            cache.admit(s)
            state = admit(state, s)
        rng = np.random.default_rng(12)
        k, v = _kv(rng, (40, H, D))
        seq = np.repeat(np.arange(2), 20).astype(np.int32)
        pos = np.tile(np.arange(20), 2).astype(np.int32)
        cache.append(0, k.cuda(), v.cuda(), torch.from_numpy(seq).cuda(), torch.from_numpy(pos).cuda())
        state = append(state, jnp.int32(0), _jax(k), _jax(v), seq, pos, backend="reference")
        st = cache.stage(0, torch.tensor([1, 0], dtype=torch.int32, device="cuda"))
        assert st.pages.device.type == "cuda"
        kd, vd = st.dense()
        dense = _stage_ref(state, 0, np.array([1, 0], np.int32))
        np.testing.assert_array_equal(_bytes(kd), _bytes(dense[:, 0]))
        np.testing.assert_array_equal(_bytes(vd), _bytes(dense[:, 1]))
        q = torch.from_numpy(rng.standard_normal((2, 1, HQ, D)).astype(np.float32)).to(torch.bfloat16).cuda()
        out, lse = cache.decode_attention(0, q, [1, 0])
        want, _ = decode_attention(state, 0, _jax(q.cpu()), np.array([1, 0], np.int32), backend="reference")
        np.testing.assert_allclose(out.float().cpu().numpy(), np.asarray(want.astype(jnp.float32)), atol=3e-2,
                                   rtol=2e-2)
        assert torch.isfinite(lse).all()


def test_k_smoothing_means_are_the_caches_own():
    """`k_smoothing=True` through the torch cache: the state holds each slot's prefill K mean; `decode_attention`
    gives float64 attention over the RAW keys (output and natural-log LSE) and `stage` the raw keys, on an all-high
    cache (no RoPE, no rotation: the stored frame is the model's). A cache that forgot the mean in its LSE or its
    staged rows would miss by ``q . mean`` / ``mean``, far outside the tolerances (checked below)."""
    cfg = KVCacheConfig("mixed_nvfp4_bf16", first_n=32, last_n=32, page_size=PAGE, max_draft_len=1, k_smoothing=True)
    cache = TorchKVCache(cfg, 1, H, D, num_pages=8, max_seqs=2, max_pages_per_seq=4, backend="reference")
    a, b = cache.admit(), cache.admit()
    rng = np.random.default_rng(3)
    lens = (20, 9)
    seq = np.repeat(np.array([a, b], np.int32), lens)
    pos = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
    k, v = _kv(rng, (seq.size, H, D))
    k = k + torch.linspace(-4, 4, D, dtype=torch.bfloat16)          # a channel offset worth removing
    cache.append(0, k, v, torch.from_numpy(seq), torch.from_numpy(pos))
    means = np.asarray(cache.state.k_means[0])[0]                   # [S, H, D]
    for s, n in zip((a, b), lens):
        np.testing.assert_allclose(means[s], k[seq == s].double().mean(0).numpy(), rtol=1e-5, atol=1e-5)
    q = torch.from_numpy(rng.standard_normal((2, HQ, D)).astype(np.float32)).to(torch.bfloat16)
    out, lse = cache.decode_attention(0, q, torch.tensor([a, b], dtype=torch.int32))
    kd, vd = cache.stage(0, [a, b]).dense()
    for i, (s, n) in enumerate(zip((a, b), lens)):
        keys, vals = k[seq == s].double().numpy(), v[seq == s].double().numpy()       # [n, H, D]
        qh = q[i].double().numpy().reshape(H, HQ // H, D)
        logits = np.einsum("hgd,nhd->hgn", qh, keys) * D ** -0.5
        want_lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        p = np.exp(logits - want_lse[..., None])
        want = np.einsum("hgn,nhd->hgd", p, vals).reshape(HQ, D)
        np.testing.assert_allclose(out[i].float().numpy(), want, atol=2e-2 * np.abs(want).max())
        np.testing.assert_allclose(lse[i].reshape(-1).numpy(), want_lse.reshape(-1), atol=2e-2)
        shift = np.einsum("hgd,hd->hg", qh, means[s]) * D ** -0.5     # what a forgotten LSE term would miss
        assert np.abs(shift).max() > 0.2
        staged = kd[i, :, :n].float().numpy().transpose(1, 0, 2)       # [n, H, D]
        np.testing.assert_allclose(staged, keys, atol=0.07)            # bf16(k - mean) + mean, rounded again
        assert np.abs(means[s]).max() > 1.0                            # a stage without the mean would miss


def test_step_calls_refuse_a_hand_built_plan():
    """The step calls take `plan_step`'s plan (its write targets are made on the device there); a `StepPlan`
    built by hand is refused by name, and the state is left as it was (the very arrays)."""
    c = _new_cache(sync="stream", validate=False)
    s = c.admit()
    plan = c.plan_step(np.array([s], np.int32), np.array([0], np.int32), np.array([s], np.int32))
    k = torch.randn(1, H, 1, D, dtype=torch.bfloat16)
    c.step_append(0, k, k, plan)
    before = jax.tree.leaves(c.state)
    by_hand = tc.StepPlan(plan.seq, plan.pos, plan.rows, plan.width, plan.group)
    q = torch.randn(1, HQ, 1, D, dtype=torch.bfloat16)
    for call in (lambda: c.step_append(1, k, k, by_hand), lambda: c.step_dense(1, k, k, by_hand),
                 lambda: c.step_attend(1, k, k, q, by_hand)):
        with pytest.raises(ValueError, match="StepPlan plan_step returned"):
            call()
    assert all(x is y for x, y in zip(jax.tree.leaves(c.state), before, strict=True))
    c.step_append(1, k, k, plan)                                      # the real plan still works
    assert c.kv_len(s) == 1


def test_reserve_then_write_step_equals_the_per_layer_calls():
    """`reserve_step` + `write_step` (every layer's rows in one program) leave the state `plan_step` + one
    `step_append` per layer leave, bit for bit; `read_views` shows the stored rows (its pools are the state's very
    buffers, its tables the batch rows'); a ``kv`` of the wrong shape is refused by name with the reservation
    dropped (the host mirror equal to the device state again, every sequence unchanged)."""
    a, b = _new_cache(sync="stream", validate=False), _new_cache(sync="stream", validate=False)
    rows = np.array([a.admit(), a.admit()], np.int32)
    assert [b.admit(), b.admit()] == rows.tolist()
    rng = np.random.default_rng(5)
    for start, t in ((0, 3), (3, 1), (4, 2)):
        seq = np.repeat(rows, t).astype(np.int32)
        pos = np.tile(np.arange(start, start + t), 2).astype(np.int32)
        kv = torch.from_numpy(rng.normal(size=(2 * L, 2, H, t, D)).astype(np.float32)).to(torch.bfloat16)
        plan = a.plan_step(seq, pos, rows)
        for layer in range(L):
            a.step_append(layer, kv[layer], kv[L + layer], plan)
        b.write_step(b.reserve_step(seq, pos), kv)
        assert_trees_bit_equal(a.state, b.state, f"step at {start}")
    views = b.read_views(rows[::-1])
    assert views.pools.low_data.data_ptr() == b.state.pools[0].low.data.unsafe_buffer_pointer()
    np.testing.assert_array_equal(views.kv_lens.numpy(), [6, 6])
    np.testing.assert_array_equal(views.page_table.numpy(), np.asarray(b.state.page_table)[rows[::-1]])
    assert (rows == np.arange(rows[0], rows[0] + 2)).all()         # consecutive slots: slices of the state's tables
    views = b.read_views(rows)
    assert views.kv_lens.data_ptr() == b.state.kv_lens.unsafe_buffer_pointer() + 4 * int(rows[0])
    np.testing.assert_array_equal(views.page_table.numpy(), np.asarray(b.state.page_table)[rows])
    np.testing.assert_array_equal(views.high_table.numpy(), np.asarray(b.state.high_table)[rows])
    del views
    free = b.free_pages
    bad = b.reserve_step(np.repeat(rows, 1), np.array([6, 6], np.int32))
    with pytest.raises(ValueError, match=r"write_step: kv must be .* 2 tokens, got torch.bfloat16 \[4, 2, 2, 1, 33\]"):
        b.write_step(bad, torch.zeros(2 * L, 2, H, 1, D + 1, dtype=torch.bfloat16))
    assert b.free_pages == free and [b.kv_len(int(s)) for s in rows] == [6, 6]
    assert_trees_bit_equal(a.state, b.state, "after the refusal")
