"""`jmixedkv.prefill.chunk_attention`: prefill / chunked-prefill attention over the cache in linear memory.

* against float32 dense attention (`jmixedkv.decode.attention_reference` over `stage_reference`, the cache a reader
  must see) for an all-high (bf16) cache, a mixed (4, 8) cache and an NVFP4 cache; lengths 1, page - 1, page,
  page + 1 and longer in one batch (ragged ``kv_lens``), permuted page ids and NaN-poisoned unwritten rows
  (`helpers.poisoned_state`), GQA 1 and 3, the Hadamard rotation lever, blocks smaller than the chunk;
* explicit ragged positions (padding queries) against `chunk_attention_reference`, itself checked against
  `attention_reference`;
* a chunked prefill (two chunks, each appended then attended) equals one prefill of the whole prompt;
* sliding window and soft cap; bad input (host `ValueError`s, in-jit NaN rows with every other row bitwise unchanged);
* memory: the compiled program's temporary memory grows about linearly with the context (S = 1024 -> 4096), while
  the dense reference's grows quadratically (the measure can tell them apart).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmixedkv import levers
from jmixedkv import GroupSpec, KVCacheConfig, admit, append, attention_reference, init_state, stage_reference
from jmixedkv.prefill import chunk_attention, chunk_attention_reference
from helpers import assert_trees_bit_equal, poisoned_state

PAGE, H, D, LAYERS = 8, 2, 32, 2
LENS = (1, PAGE - 1, PAGE, PAGE + 1, 30)          # one batch: every row its own kv_len
CACHES = {"bf16": dict(dtype="bf16"), "mixed": dict(dtype="mixed_nvfp4_bf16", first_n=4, last_n=8),
          "nvfp4": dict(dtype="nvfp4"),
          "mixed_rot": dict(dtype="mixed_nvfp4_bf16", first_n=4, last_n=8, rotation="hadamard")}
SMALL = dict(q_block=4, k_block=PAGE)             # several query and key blocks per call


@functools.lru_cache(maxsize=None)
def state(name):
    cfg = KVCacheConfig(page_size=PAGE, **CACHES[name])
    return poisoned_state(cfg, GroupSpec(LAYERS, H, D), LENS, seed=3)


def queries(t, hq, seed=1, b=len(LENS)):
    return (jax.random.normal(jax.random.PRNGKey(seed), (b, t, hq, D)) * 1.5).astype(jnp.bfloat16)


def dense(st, layer, q, seq):
    """float32 attention over the staged cache, queries at ``kv_len - T + t``; zeros / -inf where nothing is seen.
    The rows as stored: under the rotation lever q is rotated (one bf16 rounding) and the output un-rotated."""
    rot = st.config.rotation
    staged = stage_reference(st, layer, seq, as_stored=True)
    out, lse = attention_reference(levers.rotate(q, rot).astype(q.dtype), staged[:, 0], staged[:, 1],
                                   jnp.where(seq >= 0, st.kv_lens[jnp.maximum(seq, 0)], 0))
    ok = lse > -jnp.inf
    return levers.rotate(jnp.where(ok[..., None], out, 0.0), rot), lse


def assert_close(got, want, msg=""):
    """Output within the attention dtype's rounding (bf16 output, bf16 probabilities in ``p @ V``); LSE in f32."""
    (o, l), (ro, rl) = got, want
    o, ro, l, rl = (np.asarray(x, np.float32) for x in (o, ro, l, rl))
    np.testing.assert_array_equal(np.isneginf(l), np.isneginf(rl), err_msg=f"{msg}: rows that see no key")
    assert np.all(np.isfinite(o)), msg
    np.testing.assert_allclose(o, ro, atol=2e-2, rtol=2e-2, err_msg=msg)
    fin = np.isfinite(rl)
    np.testing.assert_allclose(l[fin], rl[fin], atol=1e-4, rtol=1e-5, err_msg=msg)


@pytest.mark.parametrize("name", sorted(CACHES))
@pytest.mark.parametrize("group", [1, 3])
def test_matches_dense_attention(name, group):
    """Each row's last T = 9 positions (a row shorter than 9 gets queries that see nothing: zeros, -inf)."""
    st, seq = state(name), jnp.arange(len(LENS), dtype=jnp.int32)
    q = queries(9, H * group)
    for layer in range(LAYERS):
        want = dense(st, layer, q, seq)
        got = chunk_attention(st, layer, q, seq, **SMALL)
        assert got[0].dtype == jnp.bfloat16 and got[1].dtype == jnp.float32
        assert_close(got, want, f"{name} G={group} layer {layer}")
    if group == 3:
        assert_close(chunk_attention(st, 1, q, seq), want, f"{name}: default blocks")


def _ragged_positions(lens, t):
    """Row b's queries at 0..kv_len-1 (a whole prompt), -1 past it."""
    return np.array([[i if i < n else -1 for i in range(t)] for n in lens], np.int32)


@pytest.mark.parametrize("name", ["mixed", "nvfp4", "mixed_rot"])
def test_ragged_prompt_positions(name):
    st, seq = state(name), jnp.arange(len(LENS), dtype=jnp.int32)
    t = max(LENS)
    pos = _ragged_positions(LENS, t)
    q = queries(t, 3 * H)
    got = chunk_attention(st, 0, q, seq, pos, **SMALL)
    want = chunk_attention_reference(st, 0, q, seq, pos)
    assert_close(got, want, name)
    pad = pos < 0
    assert np.all(np.asarray(got[0], np.float32)[pad] == 0) and np.all(np.isneginf(np.asarray(got[1])[pad]))


def test_reference_matches_attention_reference():
    """The explicit-position oracle, at the decode convention's positions, equals `attention_reference`."""
    st, seq = state("mixed"), jnp.arange(len(LENS), dtype=jnp.int32)
    q = queries(5, 2 * H)
    pos = np.asarray(st.kv_lens)[:, None] - 5 + np.arange(5)[None, :]
    got = chunk_attention_reference(st, 1, q, seq, np.maximum(pos, -1))
    want = dense(st, 1, q, seq)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), atol=1e-5)


def test_permuted_slots_and_padding_rows():
    """Batch rows in another order than the slots, and a padding row: each row reads its own sequence."""
    st = state("mixed")
    seq = jnp.array([4, -1, 2, 0, 3], jnp.int32)
    q = queries(6, H)
    got = chunk_attention(st, 1, q, seq, **SMALL)
    assert_close(got, dense(st, 1, q, seq))
    assert np.all(np.asarray(got[0][1], np.float32) == 0) and np.all(np.isneginf(np.asarray(got[1][1])))


@pytest.mark.parametrize("dtype", ["bf16", "nvfp4"])
def test_chunked_prefill_equals_one_prefill(dtype):
    """Prompt of lengths (13, 21, 5) in two chunks (the second ragged) == one prefill; every row's rows are read
    the same way at both moments (no twin window moving between the chunks)."""
    lens, split = (13, 21, 5), (8, 8, 5)
    b, t = len(lens), max(lens)
    rng = np.random.default_rng(0)
    cfg = KVCacheConfig(dtype, page_size=PAGE)
    k = jnp.asarray(rng.normal(size=(b, t, H, D)) * 2, jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(b, t, H, D)), jnp.bfloat16)
    q = queries(t, 2 * H, b=b)
    seq = jnp.arange(b, dtype=jnp.int32)

    def fresh():
        st = init_state(cfg, GroupSpec(1, H, D), num_pages=16, max_seqs=b, max_pages_per_seq=4, poison=True,
                        page_order=np.random.default_rng(1).permutation(16))
        for s in range(b):
            st = admit(st, s)
        return st

    def put(st, lo, hi):
        """Append positions [lo[b], hi[b]) of every row."""
        pos = _positions(lo, hi, t)
        slots = np.where(pos >= 0, np.arange(b)[:, None], -1).reshape(-1)      # one token count: one compile
        st = append(st, 0, k.reshape(b * t, H, D), v.reshape(b * t, H, D), slots, np.maximum(pos, 0).reshape(-1),
                    backend="reference")
        assert int(st.error) == 0
        return st, pos

    st, pos = put(fresh(), (0,) * b, lens)
    one = chunk_attention(st, 0, q, seq, pos, **SMALL)
    assert_close(one, chunk_attention_reference(st, 0, q, seq, pos), "one prefill")
    st, pos1 = put(fresh(), (0,) * b, split)
    first = chunk_attention(st, 0, q, seq, pos1, **SMALL)
    st, pos2 = put(st, split, lens)
    second = chunk_attention(st, 0, q, seq, pos2, **SMALL)
    got_o = jnp.where((pos1 >= 0)[..., None, None], first[0], second[0])
    got_l = jnp.where((pos1 >= 0)[..., None], first[1], second[1])
    live = pos >= 0
    np.testing.assert_allclose(np.asarray(got_o, np.float32)[live], np.asarray(one[0], np.float32)[live],
                               atol=1e-2, rtol=1e-2)
    np.testing.assert_allclose(np.asarray(got_l)[live], np.asarray(one[1])[live], atol=1e-5, rtol=1e-6)


def _positions(lo, hi, t):
    return np.array([[i if l_ <= i < h_ else -1 for i in range(t)] for l_, h_ in zip(lo, hi)], np.int32)


def test_sliding_window_and_soft_cap():
    st, seq = state("mixed"), jnp.arange(len(LENS), dtype=jnp.int32)
    t = max(LENS)
    pos = _ragged_positions(LENS, t)
    q = queries(t, H)
    for kw in (dict(sliding_window=5), dict(sliding_window=9, soft_cap=2.0, sm_scale=0.3)):
        got = chunk_attention(st, 0, q, seq, pos, **SMALL, **kw)
        assert_close(got, chunk_attention_reference(st, 0, q, seq, pos, **kw), str(kw))


def test_bad_input_is_refused_by_name():
    st, seq = state("mixed"), jnp.arange(len(LENS), dtype=jnp.int32)
    q = queries(4, H)
    over = np.zeros((5, 4), np.int32)
    over[3, 0] = 9
    with pytest.raises(ValueError, match="positions\\[3, 0\\]=9 >= kv_len 9"):
        chunk_attention(st, 0, q, seq, over)
    with pytest.raises(ValueError, match="positions\\[0\\]=-2 out of range \\[-1, "):
        chunk_attention(st, 0, q, seq, np.full((5, 4), -2, np.int32))
    with pytest.raises(ValueError, match="seq_slots\\[1\\]=5 out of range"):
        chunk_attention(st, 0, q, np.array([0, 5, 1, 2, 3], np.int32))
    with pytest.raises(ValueError, match="layer=2 out of range"):
        chunk_attention(st, 2, q, seq)
    with pytest.raises(ValueError, match="q dtype float32"):
        chunk_attention(st, 0, q.astype(jnp.float32), seq)
    with pytest.raises(ValueError, match="Hq=3 not a multiple"):
        chunk_attention(st, 0, queries(4, 3), seq)
    with pytest.raises(ValueError, match="k_block must be an int >= 1, got 0"):
        chunk_attention(st, 0, q, seq, k_block=0)
    with pytest.raises(ValueError, match="implementation must be one of \\('auto', 'flash'\\), got 'cudnn'"):
        chunk_attention(st, 0, q, seq, implementation="cudnn")
    with pytest.raises(ValueError, match="positions must be i32\\[B=5, T=4\\]"):
        chunk_attention(st, 0, q, seq, np.zeros((5, 3), np.int32))


def test_in_jit_bad_rows_are_nan_and_others_unchanged():
    """Traced slots / positions: an unadmitted slot's row and a query past its kv_len read NaN; every other row is
    bitwise what it is with those rows / queries as padding."""
    cfg = KVCacheConfig("mixed_nvfp4_bf16", first_n=4, last_n=8, page_size=PAGE)
    st = poisoned_state(cfg, GroupSpec(LAYERS, H, D), LENS, seed=3, num_seqs=6, idle=(5,))
    t = max(LENS)
    pos = _ragged_positions(LENS + (0,), t)
    q = queries(t, H, b=6)
    run = jax.jit(lambda st, seq, pos: chunk_attention(st, 0, q, seq, pos, **SMALL))
    bad_pos = pos.copy()
    bad_pos[2, 3] = LENS[2]                     # past kv_len: its key is not cached
    seq = jnp.arange(6, dtype=jnp.int32)        # slot 5 is idle
    out, lse = run(st, seq, jnp.asarray(bad_pos))
    ok_pos = pos.copy()
    ok_pos[2, 3] = -1
    ref_out, ref_lse = run(st, seq.at[5].set(-1), jnp.asarray(ok_pos))
    bad = np.zeros((6, t), bool)
    bad[5] = True
    bad[2, 3] = True
    assert np.all(np.isnan(np.asarray(out, np.float32)[bad])) and np.all(np.isnan(np.asarray(lse)[bad]))
    assert_trees_bit_equal((out[~bad], lse[~bad]), (ref_out[~bad], ref_lse[~bad]), "other rows")
    out, _ = jax.jit(lambda st, layer: chunk_attention(st, layer, q, seq.at[5].set(-1), ok_pos))(st, jnp.int32(7))
    assert np.all(np.isnan(np.asarray(out, np.float32)))            # a layer out of range: every row


def _temp_bytes(fn, s, b=2, page=16):
    cfg = KVCacheConfig("bf16", page_size=page)
    st = init_state(cfg, GroupSpec(1, 1, 16), num_pages=b * s // page, max_seqs=b, max_pages_per_seq=s // page)
    q = jax.ShapeDtypeStruct((b, s, 3, 16), jnp.bfloat16)
    seq = jnp.arange(b, dtype=jnp.int32)
    return jax.jit(lambda st, q: fn(st, q, seq)).lower(st, q).compile().memory_analysis().temp_size_in_bytes


def test_memory_is_linear_in_the_context():
    """A whole-prompt prefill (T = S) at S = 1024 and 4096: the compiled program's temporaries grow < 2.5x (a
    [T, S] product would grow 16x); the dense reference's do grow > 10x under the same measure."""
    flash = lambda st, q, seq: chunk_attention(st, 0, q, seq, backend="reference", implementation="flash")  # noqa: E731
    dense_ref = lambda st, q, seq: chunk_attention_reference(st, 0, q, seq)  # noqa: E731
    small, big = _temp_bytes(flash, 1024), _temp_bytes(flash, 4096)
    assert big < 2.5 * small, (small, big)
    assert _temp_bytes(dense_ref, 4096) > 10 * _temp_bytes(dense_ref, 1024)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["mixed", "mixed_rot", "nvfp4"])
def test_cudnn_branch_on_gpu(name):
    """On a GPU ``implementation="auto"`` runs cuDNN for a contiguous chunk (whole ragged prompts, GQA 3, with and
    without a sliding window; a chunk after cached history) and the blocked flash for a chunk with padding in front;
    all match the oracle."""
    st, seq = state(name), jnp.arange(len(LENS), dtype=jnp.int32)
    t = max(LENS)
    pos = _ragged_positions(LENS, t)
    q = queries(t, 3 * H)
    for kw in ({}, dict(sliding_window=5)):
        got = chunk_attention(st, 0, q, seq, pos, **kw)
        flash = chunk_attention(st, 0, q, seq, pos, implementation="flash", **kw)
        want = chunk_attention_reference(st, 0, q, seq, pos, **kw)
        np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0]), atol=2e-2, rtol=2e-2)
        live = pos >= 0
        np.testing.assert_allclose(np.asarray(got[1])[live], np.asarray(want[1])[live], atol=1e-3, rtol=1e-4)
        assert not np.array_equal(np.asarray(got[1]), np.asarray(flash[1]))      # the cuDNN branch did run
        assert np.all(np.isneginf(np.asarray(got[1])[~live]))
    tail = np.array([[max(n - 5, 0) + i if i < min(n, 5) else -1 for i in range(5)] for n in LENS], np.int32)
    q5 = queries(5, 3 * H)                  # a chunk after history, left-aligned: cuDNN own rows + history, merged
    got = chunk_attention(st, 1, q5, seq, tail)
    flash = chunk_attention(st, 1, q5, seq, tail, implementation="flash")
    assert_close(got, chunk_attention_reference(st, 1, q5, seq, tail), f"{name}: cuDNN with history")
    assert not np.array_equal(np.asarray(got[1]), np.asarray(flash[1]))
    q9 = queries(9, 3 * H)                  # the last 9 positions, padding in front: the flash branch
    got = chunk_attention(st, 1, q9, seq)
    assert_trees_bit_equal(got, chunk_attention(st, 1, q9, seq, implementation="flash"))
    assert_close(got, dense(st, 1, q9, seq))
