"""K smoothing held by the JAX cache (``KVCacheConfig(k_smoothing=True)``): ``CacheState.k_means``.

* The mean: each slot's first call from position 0 (its prefill, or first prefill chunk; every layer) freezes the
  float32 per-(layer, KV head, channel) mean of its keys after RoPE and the rotation; checked against float64
  NumPy. Later calls (decode, later chunks) leave it unchanged; admit / release zero it; a rewind to 0 and a new
  append take a new one; `fork` copies it.
* The stored rows are bitwise those of a cache without the levers given ``bf16(rope(k) - mean)`` (with the
  rotation, ``bf16(rotate(rope(k)) - mean)``, up to 1-ulp differences of the float32 rotation product).
* Readers mean what they mean without the lever: `decode_attention` (reference and Pallas) and `chunk_attention`
  give the output and the LSE of the raw keys (float64 reference, all-high and mixed caches, with and without the
  rotation); `stage` / `gather_rows` give the raw keys unless ``as_stored=True`` (then the shifted keys and, for
  `stage`, ``StagedCache.k_mean``); `append_attend` equals append + `decode_attention`.
* A refused append changes no mean and no other leaf; a sharded state (2 of the 4 CPU devices; no rotation) equals
  the unsharded one bitwise.
* Prefix reuse (`PrefixCache`) carries the owner's means: a reusing request (pages on the device, or offloaded to
  the host and restored) holds them bitwise and reads attention over the raw keys (float64 reference; all-high,
  and mixed with the rotation); a match never mixes pages of two means (the cut); unused means go; a refused
  `admit_with_prefix` changes no leaf but ``error``.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmixedkv as jm
from jmixedkv import levers
from jmixedkv.prefill import chunk_attention, chunk_attention_reference
from jmixedkv.rope import RopeSpec, apply_rope
from jmixedkv.speculative import correct_kv_lens
from jmixedkv.checks import ERR_BAD_PAGE
from jmixedkv.state import ERR_BAD_POSITION, append_traced
from jmixedkv.step import append_attend, apply_sinks

from helpers import assert_trees_bit_equal

L, H, HQ, D, PAGE, MAX_PAGES, SLOTS = 2, 2, 4, 32, 4, 4, 3
LENS = (9, 5)                                   # prefill lengths of slots 0 and 1 (slot 2 stays free)
ROPE = RopeSpec(theta=100.0)
U = 2.0 ** -8                                   # bf16 unit roundoff
OFFSET = 2.0 + 4.0 * (np.arange(D) == 3)        # a per-channel K offset: what the lever is for


def _config(smoothing=True, rotation=None, all_high=True, draft=1):
    span = MAX_PAGES * PAGE if all_high else PAGE
    return jm.KVCacheConfig("mixed_nvfp4_bf16", first_n=span, last_n=span, page_size=PAGE, max_draft_len=draft,
                            rotation=rotation, k_smoothing=smoothing)


def _init(cfg):
    return jm.init_state(cfg, jm.GroupSpec(num_layers=L, num_kv_heads=H, head_dim=D), num_pages=16,
                         max_seqs=SLOTS, max_pages_per_seq=MAX_PAGES)


def _kv(seed, n):
    """bf16 ``k, v [L, n, H, D]``: K with a per-channel offset."""
    rng = np.random.default_rng(seed)
    k = rng.normal(size=(L, n, H, D)) + OFFSET
    return jnp.asarray(k, jnp.bfloat16), jnp.asarray(rng.normal(size=(L, n, H, D)), jnp.bfloat16)


def _tokens(lens, start=None):
    start = [0] * len(lens) if start is None else start
    seq = np.concatenate([[s] * n for s, n in enumerate(lens)]).astype(np.int32)
    pos = np.concatenate([np.arange(p, p + n) for p, n in zip(start, lens)]).astype(np.int32)
    return jnp.asarray(seq), jnp.asarray(pos)


def _fill(cfg, backend="reference", rope=ROPE):
    """Slots 0 and 1: an all-layer ragged prefill of `LENS`, then one decode token each, layer by layer.
    Returns ``(state, k, v)`` with ``k, v [L, sum(LENS) + 2, H, D]`` in call order (prefill, then decode)."""
    s = _init(cfg)
    for slot in range(len(LENS)):
        s = jm.admit(s, slot)
    k, v = _kv(0, sum(LENS) + 2)
    seq, pos = _tokens(LENS)
    s = jm.append(s, None, k[:, :sum(LENS)], v[:, :sum(LENS)], seq, pos, rope=rope, backend=backend)
    dseq, dpos = jnp.arange(2, dtype=jnp.int32), jnp.asarray(LENS, jnp.int32)
    for layer in range(L):
        s = jm.append(s, layer, k[layer, sum(LENS):], v[layer, sum(LENS):], dseq, dpos, rope=rope, backend=backend)
    assert int(s.error) == 0
    return s, k, v


def _model_keys(k, rope=ROPE):
    """Post-RoPE keys (rounded to bf16 like the write path) ``[L, T, H, D]`` in call order, float64."""
    seq, pos = _tokens(LENS)
    pos = jnp.concatenate([pos, jnp.asarray(LENS, jnp.int32)])
    out = k if rope is None else apply_rope(k, pos, rope).astype(k.dtype)
    return np.asarray(out, np.float64)


def _per_slot(x):
    """``[L, T, H, D]`` in call order -> list per slot of ``[L, n + 1, H, D]`` in position order."""
    a, b = LENS
    return [np.concatenate([x[:, :a], x[:, a + b:a + b + 1]], 1), np.concatenate([x[:, a:a + b], x[:, a + b + 1:]], 1)]


def _rot64(x, rotation):
    return x if rotation is None else x @ levers.hadamard_np(D).astype(np.float64)


def _attention64(q, keys, vals, sm_scale=D ** -0.5):
    """float64 causal attention of ``q [Tq, HQ, D]`` (the last Tq positions) over ``keys, vals [n, H, D]``."""
    q = np.asarray(q, np.float64)
    tq, n, g = q.shape[0], keys.shape[0], HQ // H
    logits = np.einsum("thd,shd->ths", q, np.repeat(keys, g, axis=1)) * sm_scale
    qpos = n - tq + np.arange(tq)
    logits = np.where(np.arange(n)[None, None, :] <= qpos[:, None, None], logits, -np.inf)
    m = logits.max(-1, keepdims=True)
    p = np.exp(logits - m)
    lse = np.log(p.sum(-1)) + m[..., 0]
    return np.einsum("ths,shd->thd", p / p.sum(-1, keepdims=True), np.repeat(vals, g, axis=1)), lse


# ----------------------------------------------------------------------------------------------------- the mean
@pytest.mark.parametrize("per_layer", [True, False])
def test_means_are_summed_without_a_scatter_add(per_layer):
    """The per-slot sums behind a mean are a one-hot contraction, never a scatter-add (on a GPU, XLA adds the
    colliding rows of a scatter-add with atomics in no fixed order: the means, and every key stored as
    ``k - mean``, would change in their last bits from run to run). The sums equal float64 NumPy's."""
    rng = np.random.default_rng(7)
    t, s, h, d, layers = 9, 3, 2, 8, 2
    seq = jnp.asarray([0, 0, 2, -1, 2, 0, 5, 2, 2], jnp.int32)          # padding (-1) and a slot past S (5) dropped
    k = jnp.asarray(rng.normal(size=(t, h, d) if per_layer else (layers, t, h, d)), jnp.bfloat16)
    means = jnp.zeros((layers, s, h, d), jnp.float32)
    fresh = jnp.ones((s,), bool)
    args = (None, means, jnp.int32(1) if per_layer else None, k, None, seq, jnp.arange(t, dtype=jnp.int32), fresh)
    prims = {e.primitive.name for e in jax.make_jaxpr(levers.smooth_rows)(*args).jaxpr.eqns}
    assert not {p for p in prims if p.startswith("scatter")} - {"scatter"}, prims      # no scatter-add / -max
    _, _, got = levers.smooth_rows(*args)
    kf = np.asarray(k, np.float64)
    for slot in range(s):
        rows = np.asarray(seq) == slot
        want = (kf[rows] if per_layer else kf[:, rows]).mean(axis=0 if per_layer else 1) if rows.any() else 0.0
        have = np.asarray(got[1, slot] if per_layer else got[:, slot])
        np.testing.assert_allclose(have, want, rtol=1e-6, atol=1e-6, err_msg=f"slot {slot}")

@pytest.mark.parametrize("rotation", [None, "hadamard"])
def test_means_are_the_prefill_means_and_freeze(rotation):
    s, k, _ = _fill(_config(rotation=rotation))
    keys = [_rot64(x, rotation) for x in _per_slot(_model_keys(k))]
    got = np.asarray(s.k_means[0])                                                       # [L, S, H, D]
    assert got.dtype == np.float32 and got.shape == (L, SLOTS, H, D)
    for slot, n in enumerate(LENS):
        want = keys[slot][:, :n].mean(axis=1)                                            # prefill only
        np.testing.assert_allclose(got[:, slot], want, rtol=0, atol=1e-5 * np.abs(want).max())
        wrong = keys[slot].mean(axis=1)                                                  # decode token included
        assert np.abs(got[:, slot] - wrong).max() > 1e-3
    assert not got[:, 2].any()                                                           # a free slot: zero


def test_other_configs_have_no_means():
    assert _init(_config(smoothing=False)).k_means is None


# ----------------------------------------------------------------------------------------------------- stored rows
@pytest.mark.parametrize("rotation,backend", [(None, "reference"), ("hadamard", "reference"), ("hadamard", "pallas")])
def test_stored_rows_are_the_plain_cache_rows_of_k_minus_mean(rotation, backend):
    s, k, v = _fill(_config(rotation=rotation), backend)
    means = s.k_means[0]
    plain = _init(_config(smoothing=False))
    for slot in range(len(LENS)):
        plain = jm.admit(plain, slot)
    seq, pos = _tokens(LENS)
    seq = jnp.concatenate([seq, jnp.arange(2, dtype=jnp.int32)])
    pos = jnp.concatenate([pos, jnp.asarray(LENS, jnp.int32)])
    n = sum(LENS)
    kr = apply_rope(k, pos, ROPE).astype(jnp.bfloat16)

    def rot(x):                         # per call, as append rotates (the product's rounding may depend on shape)
        decode = jnp.stack([levers.rotate(x[l, n:], rotation) for l in range(L)])
        return jnp.concatenate([levers.rotate(x[:, :n], rotation), decode], axis=1)
    shifted = (rot(kr).astype(jnp.float32) - means[:, seq]).astype(jnp.bfloat16)
    vr = rot(v).astype(jnp.bfloat16)
    plain = jm.append(plain, None, shifted[:, :n], vr[:, :n], seq[:n], pos[:n], backend="reference")
    for layer in range(L):
        plain = jm.append(plain, layer, shifted[layer, n:], vr[layer, n:], seq[n:], pos[n:], backend="reference")
    assert int(plain.error) == 0
    if rotation is None:
        assert_trees_bit_equal(s.pools, plain.pools, "pools")
    else:       # the rotation's float32 product inside append's program may round 1 ulp apart from this one's
        got, want = np.asarray(s.pools[0].high.rows, np.float32), np.asarray(plain.pools[0].high.rows, np.float32)
        np.testing.assert_allclose(got, want, rtol=2 * U, atol=0)
        assert np.mean(got != want) < 1e-3
        for f in ("data", "scales"):
            a = np.asarray(getattr(s.pools[0].low, f)).view(np.uint8)
            b = np.asarray(getattr(plain.pools[0].low, f)).view(np.uint8)
            assert np.mean(a != b) < 1e-3, f
    assert_trees_bit_equal((s.page_table, s.high_table, s.kv_lens), (plain.page_table, plain.high_table,
                                                                      plain.kv_lens), "tables")


# ----------------------------------------------------------------------------------------------------- decode
DECODE_CASES = [(None, True, "reference"), ("hadamard", True, "reference"), (None, True, "pallas"),
                ("hadamard", True, "pallas"), (None, False, "reference"), ("hadamard", False, "reference")]


@pytest.mark.parametrize("rotation,all_high,backend", DECODE_CASES)
def test_decode_attention_is_attention_over_the_raw_keys(rotation, all_high, backend):
    s, k, v = _fill(_config(rotation=rotation, all_high=all_high))
    keys, vals = _per_slot(_model_keys(k)), _per_slot(np.asarray(v, np.float64))
    q = jnp.asarray(np.random.default_rng(7).normal(size=(2, 1, HQ, D)), jnp.bfloat16)
    rows = jnp.arange(2, dtype=jnp.int32)
    for layer in range(L):
        out, lse = jm.decode_attention(s, layer, q, rows, backend=backend)
        for b in range(2):
            want, want_lse = _attention64(q[b], keys[b][layer], vals[b][layer])
            scale = np.abs(want).max()
            # all-high: bf16 rounding of k - mean, of the rotated q / output (tests/test_rotation_readers.py);
            # mixed: NVFP4 history rows on top
            out_tol, lse_tol = (0.03 * scale, 0.03) if all_high else (0.25 * scale, 0.3)
            np.testing.assert_allclose(np.asarray(out[b], np.float64), want, rtol=0, atol=out_tol)
            np.testing.assert_allclose(np.asarray(lse[b], np.float64), want_lse, rtol=0, atol=lse_tol)
            # the test can fail: the stored keys' LSE (without the mean term) is far off
            qs = levers.rotate(q[b], rotation).astype(jnp.bfloat16)
            term = np.einsum("thd,hd->th", np.asarray(qs, np.float64),
                             np.repeat(np.asarray(s.k_means[0][layer, b], np.float64), HQ // H, 0)) * D ** -0.5
            assert np.abs(np.asarray(lse[b]) - term - want_lse).max() > 5 * lse_tol


def test_soft_cap_refused():
    s, _, _ = _fill(_config())
    q = jnp.zeros((1, 1, HQ, D), jnp.bfloat16)
    with pytest.raises(ValueError, match="soft_cap=30.0 on a cache with k_smoothing=True"):
        jm.decode_attention(s, 0, q, jnp.array([0], jnp.int32), soft_cap=30.0, backend="reference")


def test_append_attend_equals_append_then_decode():
    s, _, _ = _fill(_config(rotation="hadamard"))
    k, v = _kv(3, 2)
    q = jnp.asarray(np.random.default_rng(8).normal(size=(2, 1, HQ, D)), jnp.bfloat16)
    seq, pos = jnp.arange(2, dtype=jnp.int32), jnp.asarray(LENS, jnp.int32) + 1
    sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)
    want_state = jm.append(s, 1, k[1], v[1], seq, pos, rope=ROPE, backend="reference")
    want_out, want_lse = jm.decode_attention(want_state, 1, q, seq, backend="reference")
    want_out, want_lse = apply_sinks(want_out, want_lse, sinks)
    got_state, out, lse = append_attend(jax.tree.map(jnp.copy, s), 1, k[1], v[1], seq, pos, q, seq, sinks,
                                        rope=ROPE, backend="reference")
    assert_trees_bit_equal(got_state, want_state, "state")
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want_out, np.float32), rtol=0, atol=1e-2)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------------------------------- prefill
@pytest.mark.parametrize("rotation", [None, "hadamard"])
def test_chunked_prefill_first_chunk_freezes_the_mean(rotation):
    s = jm.admit(_init(_config(rotation=rotation)), 0)
    k, v = _kv(4, 10)
    pos = jnp.arange(10, dtype=jnp.int32)
    chunks = ((0, 6), (6, 10))
    q = jnp.asarray(np.random.default_rng(9).normal(size=(1, 4, HQ, D)), jnp.bfloat16)
    for lo, hi in chunks:                                          # layer by layer, as a model runs
        seq = jnp.zeros((hi - lo,), jnp.int32)
        for layer in range(L):
            s = jm.append(s, layer, k[layer, lo:hi], v[layer, lo:hi], seq, pos[lo:hi], rope=ROPE,
                          backend="reference")
    assert int(s.error) == 0
    keys = _rot64(np.asarray(apply_rope(k, pos, ROPE).astype(jnp.bfloat16), np.float64), rotation)
    want_mean = keys[:, :6].mean(axis=1)                           # the first chunk only
    np.testing.assert_allclose(np.asarray(s.k_means[0][:, 0]), want_mean, rtol=0, atol=1e-5 * np.abs(want_mean).max())
    raw = _rot64(keys, rotation)                                   # model space again (Hd @ Hd = I)
    for layer in range(L):
        out, lse = chunk_attention(s, layer, q, jnp.array([0], jnp.int32), backend="reference")
        ref_out, ref_lse = chunk_attention_reference(s, layer, q, jnp.array([0], jnp.int32))
        want, want_lse = _attention64(q[0], raw[layer], np.asarray(v[layer], np.float64))
        scale = np.abs(want).max()
        np.testing.assert_allclose(np.asarray(out[0], np.float64), want, rtol=0, atol=0.03 * scale)
        np.testing.assert_allclose(np.asarray(lse[0], np.float64), want_lse, rtol=0, atol=0.03)
        np.testing.assert_allclose(np.asarray(ref_out[0], np.float64), want, rtol=0, atol=0.03 * scale)
        np.testing.assert_allclose(np.asarray(ref_lse[0], np.float64), want_lse, rtol=0, atol=0.03)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=0, atol=1e-3)
        qs = np.asarray(levers.rotate(q[0], rotation).astype(jnp.bfloat16), np.float64)
        term = np.einsum("thd,hd->th", qs, np.repeat(np.asarray(s.k_means[0][layer, 0], np.float64), 2, 0))
        assert np.abs(np.asarray(lse[0]) - term * D ** -0.5 - want_lse).max() > 0.15   # the mean term matters


# ----------------------------------------------------------------------------------------------------- transitions
def test_fork_copies_the_means():
    s, _, _ = _fill(_config(rotation="hadamard"))
    f = jm.fork(s, 0, 2)
    assert int(f.error) == 0
    np.testing.assert_array_equal(np.asarray(f.k_means[0][:, 2]), np.asarray(s.k_means[0][:, 0]))
    q = jnp.asarray(np.random.default_rng(10).normal(size=(1, 1, HQ, D)), jnp.bfloat16)
    out, lse = jm.decode_attention(f, 1, jnp.concatenate([q, q]), jnp.array([0, 2], jnp.int32), backend="reference")
    np.testing.assert_array_equal(np.asarray(out[0], np.float32), np.asarray(out[1], np.float32))
    np.testing.assert_array_equal(np.asarray(lse[0]), np.asarray(lse[1]))
    k, v = _kv(11, 1)                                              # one more token on both: same stored rows
    k, v = jnp.concatenate([k, k], 1), jnp.concatenate([v, v], 1)
    n = LENS[0] + 1
    f = jm.append(f, None, k, v, jnp.array([0, 2], jnp.int32), jnp.array([n, n], jnp.int32), backend="reference")
    rows = jm.rows_reference(f, 0, jnp.array([[0], [2]], jnp.int32), jnp.array([[n]], jnp.int32), as_stored=True)
    np.testing.assert_array_equal(np.asarray(rows[0], np.float32), np.asarray(rows[1], np.float32))


def test_refused_append_changes_nothing():
    s, _, _ = _fill(_config())
    s = jm.admit(s, 2)
    k, v = _kv(12, 4)
    seq = jnp.array([2, 2, 2, 0], jnp.int32)
    good = jm.append(s, 0, k[0, :3], v[0, :3], seq[:3], jnp.arange(3, dtype=jnp.int32), backend="reference")
    assert int(good.error) == 0 and np.asarray(good.k_means[0][0, 2]).any()    # the fresh slot would take a mean
    bad_pos = jnp.array([0, 1, 2, LENS[0] + 3], jnp.int32)                   # slot 0 skips ahead
    bad = jax.jit(append_traced, static_argnames=("group", "rope", "backend"))(
        s, jnp.int32(0), k[0], v[0], seq, bad_pos, backend="reference")
    assert int(bad.error) & ERR_BAD_POSITION
    assert_trees_bit_equal(dataclasses.replace(bad, error=s.error), s, "refused append")


def test_admit_release_rewind_zero_or_retake_the_mean():
    s, _, _ = _fill(_config(draft=3))
    before = np.asarray(s.k_means[0])
    r = jm.release(s, 0)
    np.testing.assert_array_equal(np.asarray(r.k_means[0][:, 0]), 0)
    np.testing.assert_array_equal(np.asarray(r.k_means[0][:, 1]), before[:, 1])
    r = jm.admit(r, 0)
    np.testing.assert_array_equal(np.asarray(r.k_means[0][:, 0]), 0)
    # a rewind to 0 then a new append takes a new mean
    k, v = _kv(13, 5)
    r = jm.append(r, None, k[:, :2], v[:, :2], jnp.zeros((2,), jnp.int32), jnp.arange(2, dtype=jnp.int32),
                  backend="reference")
    first = np.asarray(r.k_means[0][:, 0])
    np.testing.assert_allclose(first, np.asarray(k[:, :2], np.float64).mean(1), rtol=0, atol=1e-5)
    offsets = np.zeros(SLOTS, np.int32)
    offsets[0] = -2
    r = correct_kv_lens(r, offsets)
    assert int(r.kv_lens[0]) == 0
    r = jm.append(r, None, k[:, 2:], v[:, 2:], jnp.zeros((3,), jnp.int32), jnp.arange(3, dtype=jnp.int32),
                  backend="reference")
    assert int(r.error) == 0
    np.testing.assert_allclose(np.asarray(r.k_means[0][:, 0]), np.asarray(k[:, 2:], np.float64).mean(1),
                               rtol=0, atol=1e-5)


def test_mla_latent_group_refused():
    with pytest.raises(ValueError, match="k_smoothing=True on group 'attn', an MLA latent"):
        jm.init_state(_config(), jm.GroupSpec(1, 1, 32, kv_factor=1), num_pages=4, max_seqs=1)


# ----------------------------------------------------------------------------------------------------- prefix reuse
def _reuse_config(rotation=None, all_high=True):
    """All-high: every row in the fixed high pages (first_n spans the sequence; a short window so prefixes match)."""
    return jm.KVCacheConfig("mixed_nvfp4_bf16", first_n=MAX_PAGES * PAGE if all_high else PAGE, last_n=PAGE,
                            page_size=PAGE, rotation=rotation, k_smoothing=True)


def _prefix_cache(cfg, host_capacity=None):
    from jmixedkv.prefix import PrefixCache
    return PrefixCache(_init(cfg), host_capacity_pages=host_capacity, backend="reference")


def _feed(pc, slot, tokens, start, seed):
    """`PrefixCache.admit` ``slot`` for ``tokens`` (expecting ``start`` reused tokens) and append the rest (all
    layers, one call); returns the raw keys / values appended ``[L, n - start, H, D]``."""
    assert pc.admit(slot, tokens) == start
    k, v = _kv(seed, len(tokens) - start)
    pos = jnp.arange(start, len(tokens), dtype=jnp.int32)
    pc.append(None, k, v, jnp.full(pos.shape, slot, jnp.int32), pos, rope=ROPE)
    assert int(pc.state.error) == 0
    return k, v, pos


def _raw64(k, pos):
    return np.asarray(apply_rope(k, pos, ROPE).astype(k.dtype), np.float64)


def _check_decode(state, slot, keys, vals, all_high, seed):
    """`decode_attention` of ``slot`` (one query) against float64 attention over raw ``keys, vals [L, n, H, D]``."""
    q = jnp.asarray(np.random.default_rng(seed).normal(size=(1, 1, HQ, D)), jnp.bfloat16)
    for layer in range(L):
        out, lse = jm.decode_attention(state, layer, q, jnp.array([slot], jnp.int32), backend="reference")
        want, want_lse = _attention64(q[0], keys[layer], vals[layer])
        out_tol, lse_tol = (0.03 * np.abs(want).max(), 0.03) if all_high else (0.25 * np.abs(want).max(), 0.3)
        np.testing.assert_allclose(np.asarray(out[0], np.float64), want, rtol=0, atol=out_tol)
        np.testing.assert_allclose(np.asarray(lse[0], np.float64), want_lse, rtol=0, atol=lse_tol)


REUSE_CASES = [(None, True), ("hadamard", False)]


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("rotation,all_high", REUSE_CASES)
def test_prefix_reuse_adopts_the_owners_means(rotation, all_high, offload):
    """A request reusing a committed prefix (on the device, or after its owner left and the pages went to the
    host and came back) takes the owner's means and reads attention over the raw keys of prompt + its own rest."""
    pc = _prefix_cache(_reuse_config(rotation, all_high))
    owner = list(range(12))
    ko, vo, po = _feed(pc, 0, owner, 0, seed=20)
    assert pc.commit(0, owner) == 3 and len(pc.means) == 1
    owner_means = np.asarray(pc.state.k_means[0][:, 0])
    assert np.abs(owner_means).max() > 1.0                                  # the offset: a mean worth carrying
    if offload:
        pc.release(0)
        assert pc.evict(3) == 3 and pc.stats()["host_entries"] == 3 and len(pc.means) == 1
    prompt = owner[:8] + [100, 101, 102, 103]                              # matches 2 pages, recomputes 4 tokens
    kr, vr, pr = _feed(pc, 1, prompt, 8, seed=21)
    assert pc.stats()["restored_pages"] == (2 if offload else 0)
    np.testing.assert_array_equal(np.asarray(pc.state.k_means[0][:, 1]), owner_means)
    keys = np.concatenate([_raw64(ko, po)[:, :8], _raw64(kr, pr)], axis=1)
    vals = np.concatenate([np.asarray(vo, np.float64)[:, :8], np.asarray(vr, np.float64)], axis=1)
    _check_decode(pc.state, 1, keys, vals, all_high, seed=22)
    pc.fork(1, 2)                                                          # the fork's commit files the same id
    assert pc._slot_mean[2] == pc._slot_mean[1]
    pc.release(1)
    assert pc.commit(2, prompt) == 1 and {e.mean_id for e in pc.index.values()} == set(pc.means)
    assert len(pc.means) == 1


def test_prefix_match_never_mixes_two_means():
    """Owners A and B share their first page but not their means (B reused nothing): B's later pages sit under
    A's first page in the index. A request matching A's page and B's next two takes only A's page (the cut), with
    A's means, and reads attention over the raw keys; once no entry or slot uses them the means go."""
    cfg = _reuse_config()
    pc = _prefix_cache(cfg, host_capacity=0)
    a = list(range(12))
    b = a[:4] + list(range(20, 28))
    ka, va, pa = _feed(pc, 0, a, 0, seed=30)
    assert pc.commit(0, a) == 3
    kb, _, _ = _feed(pc, 1, b[:4], 0, seed=31)                            # 4 tokens: too short to match
    k2, v2 = _kv(32, 8)
    pos = jnp.arange(4, 12, dtype=jnp.int32)
    pc.append(None, k2, v2, jnp.ones((8,), jnp.int32), pos, rope=ROPE)
    assert pc.commit(1, b) == 2                                            # page 0: A's entry keeps its page
    mean_a, mean_b = (np.asarray(pc.state.k_means[0][:, s]) for s in (0, 1))
    assert np.abs(mean_a - mean_b).max() > 0.1 and len(pc.means) == 2
    prompt = b + [5, 5, 5, 5]                                              # 16 tokens: up to 3 pages may match
    keys_b = pc._keys(prompt)[:3]
    assert [k in pc.index for k in keys_b] == [True, True, True]
    assert pc.index[keys_b[0]].mean_id != pc.index[keys_b[1]].mean_id == pc.index[keys_b[2]].mean_id
    assert pc.match_prefix(prompt)[0] == PAGE                              # the cut: A's page only
    kc, vc, pc_pos = _feed(pc, 2, prompt, PAGE, seed=33)
    np.testing.assert_array_equal(np.asarray(pc.state.k_means[0][:, 2]), mean_a)
    keys = np.concatenate([_raw64(ka, pa)[:, :PAGE], _raw64(kc, pc_pos)], axis=1)
    vals = np.concatenate([np.asarray(va, np.float64)[:, :PAGE], np.asarray(vc, np.float64)], axis=1)
    _check_decode(pc.state, 2, keys, vals, True, seed=34)
    pc.release(2)                                  # a slot whose pages the index already has keeps no mean id
    _feed(pc, 2, a[:4], 0, seed=35)
    pc.append(None, k2, v2, jnp.full((8,), 2, jnp.int32), pos, rope=ROPE)
    assert pc.commit(2, a) == 0 and 2 not in pc._slot_mean and len(pc.means) == 2
    for slot in range(3):
        pc.release(slot)
    pc.evict(len(pc.index))                                                # host capacity 0: forgotten
    assert not pc.index and not pc.means and not pc._mean_refs


def test_refused_admit_with_prefix_changes_nothing():
    from jmixedkv.prefix import admit_with_prefix
    s, _, _ = _fill(_config())
    nf = s.config.num_fixed_pages
    low = np.full(MAX_PAGES, -1, np.int32)
    low[:2] = np.asarray(s.page_table[0, :2])
    means = (jnp.asarray(np.random.default_rng(40).normal(size=(L, H, D)), jnp.float32),)
    admit = jax.jit(admit_with_prefix)
    good = admit(s, jnp.int32(2), jnp.asarray(low), jnp.full((nf,), -1, jnp.int32), jnp.int32(2 * PAGE), means)
    assert int(good.error) == 0
    np.testing.assert_array_equal(np.asarray(good.k_means[0][:, 2]), np.asarray(means[0]))
    np.testing.assert_array_equal(np.asarray(good.k_means[0][:, :2]), np.asarray(s.k_means[0][:, :2]))
    zero = admit(s, jnp.int32(2), jnp.asarray(low), jnp.full((nf,), -1, jnp.int32), jnp.int32(2 * PAGE), None)
    assert int(zero.error) == 0 and not np.asarray(zero.k_means[0][:, 2]).any()
    bad = admit(s, jnp.int32(2), jnp.asarray(low), jnp.full((nf,), -1, jnp.int32), jnp.int32(3 * PAGE), means)
    assert int(bad.error) & ERR_BAD_PAGE
    assert_trees_bit_equal(dataclasses.replace(bad, error=s.error), s, "refused admit_with_prefix")
    with pytest.raises(ValueError, match=r"k_means\[0\] must have shape \(2, 2, 32\)"):
        admit_with_prefix(s, 2, low, np.full(nf, -1, np.int32), 2 * PAGE, (jnp.zeros((L, D), jnp.float32),))
    plain = jm.admit(_init(_config(smoothing=False)), 0)
    with pytest.raises(ValueError, match="k_means given, but the cache has no K smoothing"):
        admit_with_prefix(plain, 1, np.full(MAX_PAGES, -1, np.int32), np.full(nf, -1, np.int32), 0, means)


# ----------------------------------------------------------------------------------------------------- row readers
@pytest.mark.parametrize("rotation,backend", [(None, "reference"), ("hadamard", "reference"), ("hadamard", "pallas"),
                                              (None, "pallas")])
def test_stage_adds_the_mean_back(rotation, backend):
    s, k, _ = _fill(_config(rotation=rotation))
    keys = _per_slot(_model_keys(k))
    rows = jnp.array([1, -1, 0], jnp.int32)
    model = jm.stage(s, 0, rows, backend=backend)
    stored = jm.stage(s, 0, rows, backend=backend, as_stored=True)
    assert model.k_mean is None and stored.k_mean.shape == (3, H, D)
    np.testing.assert_array_equal(np.asarray(stored.k_mean[0]), np.asarray(s.k_means[0][0, 1]))
    np.testing.assert_array_equal(np.asarray(stored.k_mean[1]), 0)
    dense, dense_stored = model.to_dense(), stored.to_dense()
    for b, slot in ((0, 1), (2, 0)):
        n = LENS[slot] + 1
        want = keys[slot][0]                                                          # [n, H, D]
        got = np.swapaxes(np.asarray(dense[b, 0, :, :n], np.float64), 0, 1)
        np.testing.assert_allclose(got, want, rtol=0, atol=3 * U * np.abs(want).max())
        assert not np.asarray(dense[b, :, :, n:], np.float32).any()                    # past kv_len: zero
        back = levers.to_model_space(jnp.moveaxis(dense_stored[b], 2, 0), stored.rotation, stored.k_mean[b],
                                     jnp.float32)                                     # [S, kv, H, D]
        np.testing.assert_allclose(np.asarray(back[:n, 0], np.float64), want, rtol=0, atol=3 * U * np.abs(want).max())
        stored_k = _rot64(np.swapaxes(np.asarray(dense_stored[b, 0, :, :n], np.float64), 0, 1), rotation)
        assert np.abs(stored_k - want).max() > 1.0                                    # as stored: shifted
    assert not np.asarray(dense[1], np.float32).any()                                 # padding row


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_gather_rows_adds_the_mean_back(backend):
    s, k, _ = _fill(_config(rotation="hadamard", all_high=False))
    idx = jnp.array([[0, 3, -1, 9], [5, 1, 2, -1]], jnp.int32)
    rows = jnp.array([0, 1], jnp.int32)
    model, _ = jm.gather_rows(s, 1, rows, idx, backend=backend)
    stored, _ = jm.gather_rows(s, 1, rows, idx, backend=backend, as_stored=True)
    want = jm.rows_reference(s, 1, rows[:, None], idx)                               # model space (reference)
    np.testing.assert_array_equal(np.asarray(model, np.float32), np.asarray(want, np.float32))
    mean = np.asarray(s.k_means[0][1, :2], np.float64)                               # [B, H, D]
    back = np.asarray(stored, np.float64)
    back[:, :, 0] += mean[:, None]
    back = _rot64(back, "hadamard")
    live = np.asarray(idx) >= 0
    np.testing.assert_allclose(back[live], np.asarray(model, np.float64)[live], rtol=0,
                               atol=2 * U * np.abs(back).max())
    assert not np.asarray(model, np.float32)[~live].any()                             # padding stays zero
    keys = _per_slot(_model_keys(k))
    for b in range(2):                                                               # twin rows: the raw keys
        for j, p in enumerate(np.asarray(idx[b])):
            if p >= 0 and (p < PAGE or p >= LENS[b] + 1 - PAGE):
                want_k = keys[b][1, p]
                np.testing.assert_allclose(np.asarray(model[b, j, 0], np.float64), want_k, rtol=0,
                                           atol=3 * U * np.abs(want_k).max())


# ----------------------------------------------------------------------------------------------------- sharding
def test_sharded_state_matches_unsharded():
    assert len(jax.devices()) >= 2, "conftest forces 4 host CPU devices"
    from jax.sharding import PartitionSpec as P
    from jmixedkv import sharding
    mesh = sharding.make_mesh(2)
    base = _init(_config(rotation=None))
    shard = jm.init_state(base.config, base.groups, 16, SLOTS, MAX_PAGES, mesh=mesh)
    assert shard.k_means[0].sharding.spec == P(None, None, "tp")
    k, v = _kv(14, sum(LENS))
    seq, pos = _tokens(LENS)
    for slot in range(2):
        base, shard = jm.admit(base, slot), jax.jit(jm.admit)(shard, slot)
    base = jm.append(base, None, k, v, seq, pos, backend="reference")
    shard = sharding.sharded_append(mesh, shard, None, k, v, seq, pos, backend="reference")
    assert_trees_bit_equal(jax.device_get(shard), jax.device_get(base), "sharded state")
    q = jnp.asarray(np.random.default_rng(15).normal(size=(2, 1, HQ, D)), jnp.bfloat16)
    want = jm.decode_attention(base, 0, q, seq[jnp.array([0, LENS[0]])], backend="reference")
    got = sharding.sharded_decode_attention(mesh, shard, 0, q, seq[jnp.array([0, LENS[0]])], backend="reference")
    assert_trees_bit_equal(jax.device_get(got), jax.device_get(want), "sharded decode")
