"""Hybrid recurrent + attention caches (`jmixedkv.hybrid`): layer-id mapping, recurrent mask, buffers, page tables,
and speculative rollback of the recurrent state against a run that never speculated."""
import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from helpers import assert_bits_equal, assert_trees_bit_equal, bits, jit_static
from jmixedkv import KVCacheConfig, rows_reference, stage_reference
from jmixedkv import hybrid as hy
from jmixedkv import speculative as spec
from jmixedkv.pools import RowPool
from jmixedkv.state import append

TYPES = ["mamba", "attention", "mamba", "mamba", "attention"]
MODEL = hy.HybridModelConfig(TYPES, num_kv_heads=1, head_dim=16, conv_dim=8, conv_kernel=4, ssm_heads=2,
                             ssm_head_dim=4, ssm_state_dim=4, num_draft_layers=1)
KV = KVCacheConfig("mixed_nvfp4_bf16", first_n=2, last_n=4, page_size=4, max_draft_len=3, speculative_mode="mtp")


def _make(model=MODEL, kv=KV, num_pages=40, max_seqs=2, width=16):
    """A poisoned hybrid state (one compile per geometry); the first model's by default, `_make2` the second's."""
    return jit_static(hy.init_hybrid_state, model=model, kv=kv, num_pages=num_pages, max_seqs=max_seqs,
                      max_pages_per_seq=width, poison=True)()


_admit = jax.jit(hy.hybrid_admit)


def test_layer_mapping_and_recurrent_mask():
    lay = hy.hybrid_layout(MODEL, KV)
    assert lay.ids("recurrent") == (0, 2, 3) and lay.ids("attention") == (1, 4)
    assert lay.ids("draft") == (5,) and lay.ids("retained") == (6, 7)           # twin ids after everything else
    assert lay.twin_of == (-1,) * 6 + (1, 4)
    assert lay.local == (0, 0, 1, 2, 1, 0, 0, 1)
    assert lay.recurrent_layer_mask == (True, False, True, True, False, False, False, False)
    assert lay.num_layer_ids == 8
    plain = hy.hybrid_layout(MODEL, KVCacheConfig("bf16", page_size=4, max_draft_len=3))
    assert plain.ids("retained") == () and plain.recurrent_layer_mask == lay.recurrent_layer_mask[:6]
    no_last = hy.hybrid_layout(MODEL, KV.replace(first_n=0, last_n=0))          # mixed, but no twin pages
    assert no_last.ids("retained") == ()


def test_validation():
    sparse = hy.HybridModelConfig(TYPES, sparse_attention_config={"algorithm": "dsa"})
    with pytest.raises(ValueError, match="sparse_attention_config algorithm='dsa'.*mixed_nvfp4_bf16"):
        hy.hybrid_layout(sparse, KV)
    assert hy.hybrid_layout(sparse, KVCacheConfig("bf16")).ids("attention") == (1, 4)
    with pytest.raises(ValueError, match="unknown kinds \\['moe'\\]"):
        hy.HybridModelConfig(["mamba", "moe"])
    with pytest.raises(ValueError, match="at least one attention layer"):
        hy.hybrid_layout(hy.HybridModelConfig(["mamba"]), KV)
    with pytest.raises(ValueError, match="separate draft state"):
        hy.init_hybrid_state(MODEL, KVCacheConfig("nvfp4", page_size=4, max_draft_len=3), 8, 2)
    with pytest.raises(ValueError, match="dynamic"):
        hy.init_hybrid_state(MODEL, KVCacheConfig("bf16", max_draft_len=3, speculative_mode="dynamic_tree"), 8, 2)
    state = _make()
    with pytest.raises(ValueError, match="recurrent layer"):
        hy.layer_page_table(state, 0)
    with pytest.raises(ValueError, match="out of range"):
        hy.layer_buffers(state, 8)


def test_buffers_page_tables_and_retained_rows():
    state = _make()
    assert state.conv.shape == (2, 3, 8, 3) and state.ssm.shape == (2, 3, 2, 4, 4)
    assert state.conv_snap.shape == (2, 4, 3, 8, 3) and state.ssm_snap.shape == (2, 4, 3, 2, 4, 4)
    assert state.snap_tokens.shape == (2, 3) and state.snap_tokens.dtype == jnp.int32
    attn = state.attn
    assert attn.kinds == ("mixed", "plain") and attn.pools[0].low.data.shape[0] == 2
    assert attn.pools[0].high.rows.shape[0] == 2
    draft = attn.pools[1]
    assert draft.low is None and isinstance(draft.plain, RowPool) and draft.plain.rows.dtype == jnp.bfloat16
    state = _admit(state, 1)
    assert (np.asarray(state.attn.high_table[1]) >= 0).all()
    assert np.asarray(hy.layer_page_table(state, 6)).shape == (2, KV.num_high_pages_per_seq)
    assert hy.layer_page_table(state, 7) is state.attn.high_table
    assert hy.layer_page_table(state, 4) is state.attn.page_table
    assert hy.layer_page_table(state, 5) is state.attn.page_table
    # write model layer 4 (attention-group layer 1) and find its retained rows through layer id 7's buffer
    n = 7
    k = jnp.asarray(np.random.default_rng(0).normal(size=(n, 1, 16)), jnp.float32)
    state = dataclasses.replace(state, attn=append(state.attn, 1, k, -k, jnp.full(n, 1, jnp.int32), jnp.arange(n)))
    pos = jnp.arange(n)
    seen = rows_reference(state.attn, 1, jnp.ones(n, jnp.int32), pos)           # what a reader sees
    retained = np.flatnonzero((np.arange(n) < KV.first_n) | (np.arange(n) >= n - KV.last_n))
    buf = hy.layer_buffers(state, 7)["rows"]
    ht = hy.layer_page_table(state, 7)
    col = KV.twin.high_column(pos)
    twin = buf[ht[1, col], :, :, pos % KV.page_size]                           # [n, kv, H, D]
    assert_bits_equal(seen[retained], twin[retained])
    assert_bits_equal(twin[retained][:, 0], k[retained].astype(jnp.bfloat16))
    # layer id 6 (twin of model layer 1) was not written; model layer 1's NVFP4 buffer neither
    assert np.isnan(np.asarray(hy.layer_buffers(state, 6)["rows"][ht[1, 0]], np.float32)).all()
    assert hy.layer_buffers(state, 4)["data"].shape == state.attn.pools[0].low.data.shape[1:]
    np.testing.assert_array_equal(np.asarray(hy.layer_buffers(state, 4)["data"]),
                                  np.asarray(state.attn.pools[0].low.data[1]))
    assert hy.layer_buffers(state, 3)["ssm"].shape == (2, 2, 4, 4)
    assert hy.layer_buffers(state, 5)["rows"].shape == draft.plain.rows.shape[1:]


T = KV.max_draft_len + 1
LAY = hy.hybrid_layout(MODEL, KV)


@jax.jit
def _forward(state, params, seq, x, katt, valid):
    """One block through the whole model: recurrent layers chain their outputs; attention layers append."""
    s_flat, p_flat = spec.verify_tokens(state.attn, seq, T)
    s_flat = jnp.where(valid.reshape(-1), s_flat, -1)
    outs = []
    for lid, kind in enumerate(LAY.kinds[:len(TYPES)]):
        i = LAY.local[lid]
        if kind == "recurrent":
            state, x = hy.recurrent_forward(state, i, x, valid, seq, params)
            outs.append(x)
        else:
            state = dataclasses.replace(state, attn=append(state.attn, i, katt[i], katt[i] * 0.5, s_flat, p_flat))
    return state, jnp.stack(outs)


_accept = jax.jit(hy.accept_hybrid)
_stage = jax.jit(stage_reference)


def test_speculative_rollback_matches_no_speculation():
    params = hy.init_recurrent_params(MODEL, jax.random.key(1))
    mk = lambda: _admit(_admit(_make(), 0), 1)  # noqa: E731
    sp, ref = mk(), mk()
    rng = np.random.default_rng(3)
    seq = jnp.array([0, 1], jnp.int32)
    j = np.arange(T)[None, :]
    plan = [((3, 3), (3, 3))] + [tuple(tuple(int(v) for v in (k, rng.integers(0, k + 1))) for k in
                                       rng.integers(0, T, 2)) for _ in range(10)]
    sensitive = False
    for step, ((k0, a0), (k1, a1)) in enumerate(plan):
        x = jnp.asarray(rng.normal(size=(2, T, 8)), jnp.float32)
        katt = jnp.asarray(rng.normal(size=(2, 2 * T, 1, 16)), jnp.float32)
        ks, acc = np.array([k0, k1]), np.array([a0, a1])
        if step == 0:   # a 4-token prefill chunk for both (no drafts)
            ks = acc = np.array([3, 3])
        sp, ysp = _forward(sp, params, seq, x, katt, jnp.asarray(j <= ks[:, None]))
        before = sp
        sp = _accept(sp, seq, jnp.asarray(acc, jnp.int32), jnp.asarray(ks, jnp.int32))
        ref, yref = _forward(ref, params, seq, x, katt, jnp.asarray(j <= acc[:, None]))
        for a, b in ((sp.conv, ref.conv), (sp.ssm, ref.ssm)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        keep = j <= acc[:, None]                                                  # outputs of accepted tokens
        np.testing.assert_array_equal(np.asarray(ysp)[:, keep], np.asarray(yref)[:, keep])
        np.testing.assert_array_equal(np.asarray(sp.attn.kv_lens), np.asarray(ref.attn.kv_lens))
        for layer in range(2):
            assert_bits_equal(_stage(sp.attn, layer, seq), _stage(ref.attn, layer, seq))
        assert int(sp.attn.error) == 0 and int(ref.attn.error) == 0
        if (acc < ks).any():   # the rollback mattered: without it the recurrent state would differ
            sensitive |= not np.array_equal(np.asarray(before.ssm), np.asarray(ref.ssm))
    assert sensitive
    assert int(sp.attn.kv_lens[0]) == 4 + sum(a + 1 for (_, a), _ in plan[1:])


@pytest.mark.gpu
def test_hybrid_rollback_gpu():
    """On the H200: the same rollback check with the attention appends on the Pallas write kernel (auto)."""
    assert jax.default_backend() == "gpu"
    test_speculative_rollback_matches_no_speculation()


# ------------------------------------------------------------------------ prefill chunks in accept, padding, re-admit
# A small second model: 2 recurrent layers around 1 attention layer, D = 2, so blocks can be longer than D + 1.
TYPES2 = ["mamba", "attention", "mamba"]
MODEL2 = hy.HybridModelConfig(TYPES2, num_kv_heads=1, head_dim=16, conv_dim=8, conv_kernel=3, ssm_heads=2,
                              ssm_head_dim=4, ssm_state_dim=4)
KV2 = KVCacheConfig("mixed_nvfp4_bf16", first_n=2, last_n=3, page_size=4, max_draft_len=2, speculative_mode="mtp")
LAY2 = hy.hybrid_layout(MODEL2, KV2)
S2, TB, C2 = 3, 5, 8                     # slots, block width (> D + 1: long prefill chunks), conv_dim
PARAMS2 = hy.init_recurrent_params(MODEL2, jax.random.key(7))


_make2 = functools.partial(_make, MODEL2, KV2, 72, S2, 24)


@jax.jit
def _forward2(state, seq, x, katt, valid):
    """One block (any mix of prefill chunks and verify blocks, ``valid`` says which tokens are real) through the
    whole small model: recurrent layers chain their outputs, the attention layer appends at kv_len.."""
    s_flat, p_flat = spec.verify_tokens(state.attn, seq, TB)
    s_flat = jnp.where(valid.reshape(-1), s_flat, -1)
    for lid, kind in enumerate(LAY2.kinds[:len(TYPES2)]):
        if kind == "recurrent":
            state, x = hy.recurrent_forward(state, LAY2.local[lid], x, valid, seq, PARAMS2)
        else:
            state = dataclasses.replace(state, attn=append(state.attn, 0, katt, katt * 0.5, s_flat, p_flat))
    return state, x


_admit2, _release2, _accept2 = jax.jit(hy.hybrid_admit), jax.jit(hy.hybrid_release), jax.jit(hy.accept_hybrid)
_rf2 = jax.jit(lambda st, layer, seq, x, valid: hy.recurrent_forward(st, layer, x, valid, seq, PARAMS2))
_read2 = jax.jit(hy.recurrent_state)
ALL2 = jnp.arange(S2, dtype=jnp.int32)
_stage2 = jax.jit(lambda attn: stage_reference(attn, 0, ALL2))


def _no_error(state):
    return dataclasses.replace(state, attn=dataclasses.replace(state.attn, error=jnp.int32(0)))


def assert_state_unchanged(a, b):
    """Every leaf but the error word bitwise equal."""
    assert_trees_bit_equal(_no_error(a), _no_error(b))


def slot_view(state, staged, s):
    """Everything that belongs to slot ``s``: recurrent state + snapshots, lengths, tables, staged attention rows."""
    return [bits(a[s]) for a in (state.conv, state.ssm, state.conv_snap, state.ssm_snap, state.snap_tokens,
                                 state.attn.kv_lens, state.attn.active, state.attn.page_table,
                                 state.attn.high_table)] + [bits(staged[s])]


def assert_slots_unchanged(a, b, slots):
    sa, sb = _stage2(a.attn), _stage2(b.attn)
    for s in slots:
        for i, (x, y) in enumerate(zip(slot_view(a, sa, s), slot_view(b, sb, s))):
            np.testing.assert_array_equal(x, y, err_msg=f"slot {s}, part {i}")


def reference_recurrence(x_rows, params=PARAMS2):
    """Independent oracle: the tokens of one sequence stepped one at a time through every recurrent layer,
    model layer order. Returns [(conv, ssm)] per recurrent layer."""
    out = []
    xs = [jnp.asarray(t, jnp.float32) for t in x_rows]
    for li in range(LAY2.num_recurrent):
        p = jax.tree.map(lambda a: a[li], params)
        conv = jnp.zeros((C2, MODEL2.conv_kernel - 1), jnp.float32)
        ssm = jnp.zeros((MODEL2.ssm_heads, MODEL2.ssm_head_dim, MODEL2.ssm_state_dim), jnp.float32)
        ys = []
        for t in xs:
            conv, ssm, y = mamba_step(conv, ssm, t, p)
            ys.append(y)
        out.append((conv, ssm))
        xs = ys
    return out


mamba_step = jax.jit(hy.mamba_step_reference)


def _populated(seed=0, chunk=(3, 2)):
    """Slots 0 and 1 admitted, each with one prefill chunk through the model (slot 2 idle); error 0."""
    rng = np.random.default_rng(seed)
    st = _admit2(_admit2(_make2(), 0), 1)
    x = jnp.asarray(rng.normal(size=(S2, TB, C2)), jnp.float32)
    katt = jnp.asarray(rng.normal(size=(S2 * TB, 1, 16)), jnp.float32)
    valid = np.zeros((S2, TB), bool)
    valid[0, :chunk[0]] = valid[1, :chunk[1]] = True
    st, _ = _forward2(st, jnp.array([0, 1, -1], jnp.int32), x, katt, jnp.asarray(valid))
    assert int(st.attn.error) == 0
    return st, x


@pytest.mark.parametrize("n", [1, 3, TB])
def test_prefill_chunk_listed_with_zero_drafts_keeps_full_state(n):
    """A prefill chunk of a mixed batch listed with num_drafts = 0 keeps the state after its last
    token -- also for chunks longer than max_draft_len + 1 -- while a verify block in the same accept rolls back."""
    st, x = _populated(seed=n, chunk=(n, 3))  # slot 0: prefill chunk of n tokens; 1: verify block, k = 2, accept 1
    out = hy.accept_hybrid(st, np.array([0, 1]), np.array([0, 1]), np.array([0, 2]))
    assert int(out.attn.error) == 0
    assert np.asarray(out.attn.kv_lens).tolist() == [n, 2, 0]
    for s, tokens in ((0, n), (1, 2)):
        for li, (conv, ssm) in enumerate(reference_recurrence(x[s, :tokens])):
            np.testing.assert_allclose(np.asarray(out.ssm[s, li]), np.asarray(ssm), rtol=2e-6, atol=1e-6)
            np.testing.assert_allclose(np.asarray(out.conv[s, li]), np.asarray(conv), rtol=2e-6, atol=1e-6)
    # bit for bit: the prefill chunk's state is exactly the state the forward left
    assert_bits_equal(out.ssm[0], st.ssm[0])
    assert_bits_equal(out.conv[0], st.conv[0])
    # the same chunk not listed at all: identical result
    alt = hy.accept_hybrid(st, np.array([1]), np.array([1]), np.array([2]))
    assert_state_unchanged(dataclasses.replace(alt, snap_tokens=out.snap_tokens), out)


_rf = jax.jit(hy.recurrent_forward)


def test_issue_repro_three_token_chunk():
    """A 3-token chunk through `recurrent_forward`, the same tokens
    appended, ``accept_hybrid(st, [0], [0], [0])``: kv_len 3 and the state after all three tokens."""
    st = _admit(_make(), 0)
    params = hy.init_recurrent_params(MODEL, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (1, 3, 8))
    st, _ = _rf(st, 0, x, jnp.ones((1, 3), bool), jnp.array([0]), params)
    k = jnp.ones((3, 1, 16))
    st = dataclasses.replace(st, attn=append(st.attn, 0, k, k, jnp.zeros(3, jnp.int32), jnp.arange(3)))
    out = _accept(st, jnp.array([0]), jnp.array([0]), jnp.array([0]))
    assert int(out.attn.kv_lens[0]) == 3 and int(out.attn.error) == 0
    conv, ssm = jnp.zeros((8, 3)), jnp.zeros((2, 4, 4))
    p = jax.tree.map(lambda a: a[0], params)
    for t in range(3):
        conv, ssm, _ = mamba_step(conv, ssm, x[0, t], p)
    np.testing.assert_allclose(np.asarray(out.ssm[0, 0]), np.asarray(ssm), rtol=2e-6, atol=1e-6)
    assert_bits_equal(out.ssm, st.ssm)


def test_admit_minus_one_is_a_noop():
    """hybrid_admit(st, -1) changes nothing (``.at[-1]`` wraps: a naive update zeroes the last slot)."""
    st, _ = _populated()
    st = _admit2(st, 2)
    st, _ = _forward2(st, jnp.array([2, -1, -1], jnp.int32), jnp.ones((S2, TB, C2)), jnp.ones((S2 * TB, 1, 16)),
                      jnp.asarray(np.arange(TB)[None, :] < np.array([[2], [0], [0]])))
    assert np.abs(np.asarray(st.ssm[2])).sum() > 0                             # the last slot has state
    for fn in (_admit2, _release2):
        out = fn(st, -1)
        assert int(out.attn.error) == 0
        assert_state_unchanged(out, st)


def test_double_admit_keeps_recurrent_state():
    """Admitting an admitted slot is refused (ERR_BAD_SLOT) and changes nothing -- its recurrent
    state and snapshots included."""
    st, _ = _populated()
    for slot in (0, 1):
        out = _admit2(st, slot)
        assert int(out.attn.error) == hy.ERR_BAD_SLOT
        assert_state_unchanged(out, st)
    with pytest.raises(ValueError, match="hybrid_admit: seq_slot=3 out of range"):
        hy.hybrid_admit(st, 3)


def test_release_zeroes_and_readmit_starts_clean():
    st, _ = _populated()
    out = _release2(st, 1)
    assert int(out.attn.error) == 0 and not bool(out.attn.active[1])
    assert not np.asarray(out.ssm[1]).any() and not np.asarray(out.ssm_snap[1]).any()
    assert not np.asarray(out.snap_tokens[1]).any()
    assert_slots_unchanged(out, st, [0, 2])
    again = _release2(out, 1)                                                   # idle: refused, unchanged
    assert int(again.attn.error) == hy.ERR_BAD_SLOT
    assert_state_unchanged(again, out)


def test_rewind_contract():
    """snap[r] = state with the last r valid tokens undone; a rewind needs the block to be the k + 1 tokens of a
    verify block, and a block is accepted once."""
    st, x = _populated(chunk=(3, 1))
    np.testing.assert_array_equal(np.asarray(st.snap_tokens), [[3, 3], [1, 1], [0, 0]])
    # slot 0 rewinds 2 of its 3 tokens: the state after token 0
    out = _accept2(st, jnp.array([0, -1, -1]), jnp.array([0, 0, 0]), jnp.array([2, 0, 0]))
    assert int(out.attn.error) == 0 and int(out.attn.kv_lens[0]) == 1
    for li, (conv, ssm) in enumerate(reference_recurrence(x[0, :1])):
        np.testing.assert_allclose(np.asarray(out.ssm[0, li]), np.asarray(ssm), rtol=2e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(out.snap_tokens[0]), [0, 0])
    # rewinding into nothing (slot 1's block had 1 token; slot 0's block is used) is refused, all or nothing
    for seq, a, k in (([1, -1, -1], [0, 0, 0], [1, 0, 0]), ([0, -1, -1], [0, 0, 0], [1, 0, 0])):
        bad = _accept2(out, jnp.array(seq), jnp.array(a), jnp.array(k))
        assert int(bad.attn.error) == hy.ERR_BAD_CORRECTION
        assert_state_unchanged(bad, out)
    # rows without valid tokens keep the previous block (state and snapshots)
    again, y = _rf2(st, jnp.int32(0), jnp.array([1, -1, -1]), jnp.ones((S2, TB, C2)), jnp.zeros((S2, TB), bool))
    assert int(again.attn.error) == 0
    assert_state_unchanged(again, st)


# ---------------------------------------------------------------------------------------------- bad input
def test_host_validation_names_the_value():
    st, x = _populated()
    v = jnp.ones((S2, TB), bool)
    cases = [
        (lambda: hy.hybrid_admit(st, -2), r"hybrid_admit: seq_slot=-2 out of range \[-1, 3\)"),
        (lambda: hy.hybrid_release(st, 7), r"hybrid_release: seq_slot=7 out of range \[-1, 3\)"),
        (lambda: hy.hybrid_admit(st, 1.0), "must be an integer"),
        (lambda: hy.recurrent_forward(st, 2, x, v, [0, 1, -1], PARAMS2), r"layer=2 out of range \[0, 2\)"),
        (lambda: hy.recurrent_forward(st, -1, x, v, [0, 1, -1], PARAMS2), r"layer=-1 out of range"),
        (lambda: hy.recurrent_forward(st, 0, x, v, [0, 3, -1], PARAMS2), r"seq_slots\[1\]=3 out of range"),
        (lambda: hy.recurrent_forward(st, 0, x, v, [0, 0, -1], PARAMS2), "slot 0 more than once"),
        (lambda: hy.recurrent_forward(st, 0, x, v, [0, 1, 2**32 + 1], PARAMS2), r"=4294967297 out of range"),
        (lambda: hy.recurrent_forward(st, 0, x, v, [0, 1], PARAMS2), "need seq_slots i32"),
        (lambda: hy.recurrent_state(st, 0, [0, -5]), r"seq_slots\[1\]=-5 out of range"),
        (lambda: hy.recurrent_state(st, 9, [0]), r"layer=9 out of range"),
        (lambda: hy.accept_hybrid(st, [0, 3], [0, 0], [0, 0]), r"seq_slots\[1\]=3 out of range"),
        (lambda: hy.accept_hybrid(st, [1, 1], [0, 0], [0, 0]), "slot 1 more than once"),
        (lambda: hy.accept_hybrid(st, [0], [2], [1]), "slot 0 has num_accepted=2, num_drafts=1"),
        (lambda: hy.rollback(st, [0], [0], [3]), r"max_draft_len \(2\); slot 0 has num_accepted=0, num_drafts=3"),
        (lambda: hy.layer_buffers(st, 4), r"layer id 4 out of range \[0, 4\)"),
        (lambda: hy.layer_buffers(st, True), "must be an integer"),
        (lambda: hy.layer_page_table(st, -1), "layer id -1 out of range"),
    ]
    for fn, msg in cases:
        with pytest.raises(ValueError, match=msg):
            fn()


def test_refusals_inside_jit_leave_every_sequence_unchanged():
    """Traced bad slots / layers / counts: the error bit, the whole state bitwise unchanged, NaN outputs."""
    st, _ = _populated()
    x = jnp.ones((S2, TB, C2), jnp.float32)
    v = jnp.ones((S2, TB), bool)
    forwards = [((0, [0, 3, -1]), hy.ERR_BAD_SLOT), ((0, [0, -2, -1]), hy.ERR_BAD_SLOT),
                ((0, [0, 2, -1]), hy.ERR_BAD_SLOT),                    # slot 2 is not admitted
                ((1, [1, 1, -1]), hy.ERR_BAD_SLOT),                    # listed twice
                ((2, [0, 1, -1]), hy.ERR_BAD_LAYER), ((-1, [0, -1, -1]), hy.ERR_BAD_LAYER)]
    for (layer, seq), bit in forwards:
        out, y = _rf2(st, jnp.int32(layer), jnp.array(seq, jnp.int32), x, v)
        assert int(out.attn.error) == bit, (layer, seq)
        assert_state_unchanged(out, st)
        assert np.isnan(np.asarray(y)).all()
    accepts = [(([0, 3, -1], [0, 0, 0], [0, 0, 0]), hy.ERR_BAD_SLOT),
               (([0, -7, -1], [0, 0, 0], [0, 0, 0]), hy.ERR_BAD_SLOT),
               (([2, -1, -1], [0, 0, 0], [0, 0, 0]), hy.ERR_BAD_SLOT),         # idle slot
               (([0, 0, -1], [0, 0, 0], [1, 1, 0]), hy.ERR_BAD_SLOT),          # listed twice
               (([0, 1, -1], [2, 0, 0], [1, 0, 0]), hy.ERR_BAD_CORRECTION),    # a > k
               (([0, 1, -1], [0, 0, 0], [0, 3, 0]), hy.ERR_BAD_CORRECTION),    # k > max_draft_len
               (([0, 1, -1], [0, 0, 0], [0, 2, 0]), hy.ERR_BAD_CORRECTION)]    # slot 1's block had 2 tokens
    for (seq, a, k), bit in accepts:
        out = _accept2(st, jnp.array(seq, jnp.int32), jnp.array(a, jnp.int32), jnp.array(k, jnp.int32))
        assert int(out.attn.error) & bit, (seq, a, k, int(out.attn.error))
        assert_state_unchanged(out, st)
    for slot, bit in ((3, hy.ERR_BAD_SLOT), (-2, hy.ERR_BAD_SLOT), (0, hy.ERR_BAD_SLOT)):
        out = _admit2(st, jnp.int32(slot))
        assert int(out.attn.error) == bit
        assert_state_unchanged(out, st)
    for slot in (3, -2, 2):
        out = _release2(st, jnp.int32(slot))
        assert int(out.attn.error) == hy.ERR_BAD_SLOT
        assert_state_unchanged(out, st)
    # sticky: earlier bits survive a good transition
    flagged = dataclasses.replace(st, attn=dataclasses.replace(st.attn, error=jnp.int32(hy.ERR_BAD_LAYER)))
    assert int(_admit2(flagged, jnp.int32(2)).attn.error) == hy.ERR_BAD_LAYER


def test_reader_flags_bad_slot_and_layer():
    st, _ = _populated()
    conv, ssm = _read2(st, jnp.int32(1), jnp.array([1, -1, 3, 2, 0, -4], jnp.int32))
    assert_bits_equal(ssm[0], st.ssm[1, 1])
    assert_bits_equal(conv[4], st.conv[0, 1])
    assert not np.asarray(ssm[1]).any() and not np.asarray(conv[1]).any()      # padding: zero
    for row in (2, 3, 5):                                                       # out of range / idle: NaN
        assert np.isnan(np.asarray(ssm[row])).all() and np.isnan(np.asarray(conv[row])).all()
    conv, ssm = _read2(st, jnp.int32(2), jnp.array([0, 1, -1], jnp.int32))     # layer out of range
    assert np.isnan(np.asarray(ssm)).all() and np.isnan(np.asarray(conv)).all()


# ---------------------------------------------------------------------------------------------- state machine
class HybridMachine(RuleBasedStateMachine):
    """A speculating hybrid cache ``sp`` vs a cache ``ref`` that only ever sees accepted tokens, driven by mixed
    batches of prefill chunks (listed with 0 drafts or not listed) and verify blocks, plus bad input: slots out
    of range, -1, double admit, release of idle slots, bad layers, bad accept counts. After every step: the error
    bits are exactly the expected ones, a refused step leaves the whole state bitwise unchanged, a good one leaves
    every other slot bitwise unchanged, and the stepped slots equal ``ref`` bit for bit."""

    @initialize(seed=st.integers(0, 2 ** 16), first=st.sets(st.integers(0, S2 - 1), min_size=1))
    def setup(self, seed, first):
        self.rng = np.random.default_rng(seed)
        self.sp = self.ref = _make2()
        self.active = set()
        for s in sorted(first):
            self.admit(s)

    def _expect(self, new, old, bits, touched=()):
        assert int(new.attn.error) == bits, (int(new.attn.error), bits)
        if bits:
            assert_state_unchanged(new, old)
        else:
            assert_slots_unchanged(new, old, [s for s in range(S2) if s not in touched])
        return _no_error(new)

    def _slot_step(self, name, step, slot, ok):
        """``step`` (admit / release) of ``slot`` on both caches; a slot that may not take it is refused (-1: a
        no-op). Returns ``ok``."""
        bits = 0 if slot == -1 or ok else hy.ERR_BAD_SLOT
        event(f"{name}: {'ok' if ok else 'no-op' if slot == -1 else 'refused'}")
        old = self.sp
        self.sp = self._expect(step(old, jnp.int32(slot)), old, bits, {slot})
        if ok:
            self.ref = _no_error(step(self.ref, jnp.int32(slot)))
        return ok

    @rule(slot=st.integers(-2, S2 + 1))
    def admit(self, slot):
        if self._slot_step("admit", _admit2, slot, 0 <= slot < S2 and slot not in self.active):
            self.active.add(slot)
            assert not np.asarray(self.sp.ssm[slot]).any() and not np.asarray(self.sp.conv[slot]).any()

    @rule(slot=st.integers(-2, S2 + 1))
    def release(self, slot):
        if self._slot_step("release", _release2, slot, slot in self.active):
            self.active.discard(slot)

    @precondition(lambda self: self.active)
    @rule(data=st.data())
    def mixed_batch(self, data):
        """Every active slot with room: sits out, runs a prefill chunk of 1..TB tokens (listed in the accept with
        0 drafts, or not listed), or a verify block of k + 1 tokens accepting a drafts."""
        lens = np.asarray(self.sp.attn.kv_lens)
        plans = {}
        for s in sorted(self.active):
            if lens[s] + TB > 24 * KV2.page_size:
                continue
            kind = data.draw(st.sampled_from(["idle", "prefill", "prefill_listed", "verify"]))
            if kind == "verify":
                k = data.draw(st.integers(0, KV2.max_draft_len))
                plans[s] = ("verify", k + 1, data.draw(st.integers(0, k)), k)
            elif kind != "idle":
                plans[s] = (kind, data.draw(st.integers(1, TB)), 0, 0)
        order = data.draw(st.permutations(list(plans) + [-1] * (S2 - len(plans))))
        event("mixed_batch: " + "+".join(sorted(p[0] for p in plans.values())))
        seq = np.array(order, np.int32)
        n_sp = np.array([plans[s][1] if s >= 0 else 0 for s in order])
        n_ref = np.array([(plans[s][2] + 1 if plans[s][0] == "verify" else plans[s][1]) if s >= 0 else 0
                          for s in order])
        x = jnp.asarray(self.rng.normal(size=(S2, TB, C2)), jnp.float32)
        katt = jnp.asarray(self.rng.normal(size=(S2 * TB, 1, 16)), jnp.float32)
        j = np.arange(TB)[None, :]
        old = self.sp
        sp, _ = _forward2(old, jnp.asarray(seq), x, katt, jnp.asarray(j < n_sp[:, None]))
        listed = [s if s >= 0 and plans[s][0] != "prefill" else -1 for s in order]
        a = [plans[s][2] if s >= 0 else 0 for s in order]
        k = [plans[s][3] if s >= 0 else 0 for s in order]
        sp = _accept2(sp, jnp.array(listed, jnp.int32), jnp.array(a, jnp.int32), jnp.array(k, jnp.int32))
        self.sp = self._expect(sp, old, 0, set(plans))
        self.ref, _ = _forward2(self.ref, jnp.asarray(seq), x, katt, jnp.asarray(j < n_ref[:, None]))
        assert int(self.ref.attn.error) == 0
        for arr in ("conv", "ssm"):
            assert_bits_equal(getattr(self.sp, arr), getattr(self.ref, arr), arr)
        np.testing.assert_array_equal(np.asarray(self.sp.attn.kv_lens), np.asarray(self.ref.attn.kv_lens))
        live = [s for s in range(S2) if s in self.active]
        st_sp, st_ref = _stage2(self.sp.attn), _stage2(self.ref.attn)
        for s in live:
            assert_bits_equal(st_sp[s], st_ref[s], f"staged slot {s}")

    @precondition(lambda self: self.active)
    @rule(data=st.data())
    def another_mixed_batch(self, data):
        """(The same rule again: batches are the common step.)"""
        self.mixed_batch(data)

    @rule(data=st.data())
    def bad_forward(self, data):
        """A block with a slot out of range, an idle slot, a repeated slot or a bad layer: refused whole."""
        idle = [s for s in range(S2) if s not in self.active]
        kinds = ["oob", "layer"] + (["idle"] if idle else []) + (["dup"] if self.active else [])
        kind = data.draw(st.sampled_from(kinds))
        seq, layer = [-1] * S2, 0
        if kind == "oob":
            seq[0] = data.draw(st.sampled_from([S2, S2 + 5, -2, -100]))
        elif kind == "idle":
            seq[0] = data.draw(st.sampled_from(idle))
        elif kind == "dup":
            seq[0] = seq[2] = data.draw(st.sampled_from(sorted(self.active)))
        else:
            layer = data.draw(st.sampled_from([-1, LAY2.num_recurrent, 99]))
            if self.active:
                seq[1] = min(self.active)
        order = data.draw(st.permutations(seq))
        event(f"bad_forward: {kind}")
        old = self.sp
        out, y = _rf2(old, jnp.int32(layer), jnp.array(order, jnp.int32), jnp.ones((S2, TB, C2)),
                      jnp.ones((S2, TB), bool))
        assert np.isnan(np.asarray(y)).all()
        self.sp = self._expect(out, old, hy.ERR_BAD_LAYER if kind == "layer" else hy.ERR_BAD_SLOT)

    @rule(data=st.data())
    def bad_accept(self, data):
        """An accept naming a bad / idle / repeated slot, bad counts, or a rewind no block can serve."""
        idle = [s for s in range(S2) if s not in self.active]
        act = sorted(self.active)
        kinds = ["oob"] + (["idle"] if idle else []) + (["dup", "counts", "rewind"] if act else [])
        kind = data.draw(st.sampled_from(kinds))
        seq, a, k = [-1] * S2, [0] * S2, [0] * S2
        bits = hy.ERR_BAD_SLOT
        if kind == "oob":
            seq[0] = data.draw(st.sampled_from([S2, -2]))
        elif kind == "idle":
            seq[0] = data.draw(st.sampled_from(idle))
        elif kind == "dup":
            seq[0] = seq[1] = data.draw(st.sampled_from(act))
        elif kind == "counts":
            seq[0] = data.draw(st.sampled_from(act))
            a[0], k[0] = data.draw(st.sampled_from([(1, 0), (-1, 0), (0, KV2.max_draft_len + 1)]))
            bits = hy.ERR_BAD_CORRECTION
        else:       # a rewind the last block does not justify: it is no verify block of k + 1 tokens (a longer or
            s = data.draw(st.sampled_from(act))          # shorter prefill chunk, or a block accepted already)
            have = int(np.asarray(self.sp.snap_tokens[s]).min())
            ks = [kk for kk in range(1, KV2.max_draft_len + 1) if kk + 1 != have]
            if not ks:
                return
            seq[0], k[0] = s, data.draw(st.sampled_from(ks))
            event(f"bad_accept: rewind of k={k[0]} after a block of {have}")
            bits = hy.ERR_BAD_CORRECTION
        event(f"bad_accept: {kind}")
        old = self.sp
        out = _accept2(old, jnp.array(seq, jnp.int32), jnp.array(a, jnp.int32), jnp.array(k, jnp.int32))
        assert int(out.attn.error) & bits, (kind, seq, a, k, int(out.attn.error))
        self.sp = self._expect(out, old, int(out.attn.error))

    @invariant()
    def tables_consistent(self):
        if not hasattr(self, "sp"):
            return
        act = np.asarray(self.sp.attn.active)
        assert set(np.flatnonzero(act).tolist()) == self.active
        idle = ~act
        assert not np.asarray(self.sp.ssm)[idle].any() and not np.asarray(self.sp.snap_tokens)[idle].any()
        conv, ssm = _read2(self.sp, jnp.int32(1), jnp.array([0, 1, 2, -1, S2], jnp.int32))   # the reader
        for s in range(S2):
            if act[s]:
                assert_bits_equal(ssm[s], self.sp.ssm[s, 1])
            else:
                assert np.isnan(np.asarray(ssm[s])).all() and np.isnan(np.asarray(conv[s])).all()
        assert not np.asarray(ssm[3]).any() and np.isnan(np.asarray(ssm[4])).all()


TestHybridMachine = HybridMachine.TestCase
TestHybridMachine.settings = settings(max_examples=int(os.environ.get("JMIXEDKV_HYBRID_EXAMPLES", "20")),
                                      stateful_step_count=16, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def test_accept_right_after_a_longer_prefill_chunk_is_refused():
    """A 4-token prefill chunk is no verify block of num_drafts = 2 (3 tokens): accept_hybrid refuses to drop its
    prompt tokens on both halves (error bit, whole state unchanged; host values: ValueError naming the slot)."""
    st, _ = _populated(chunk=(4, 3))
    bad = _accept2(st, jnp.array([0, -1, -1]), jnp.array([0, 0, 0]), jnp.array([2, 0, 0]))
    assert int(bad.attn.error) & hy.ERR_BAD_CORRECTION
    assert_state_unchanged(bad, st)
    with pytest.raises(ValueError, match="slot 0: num_drafts=2 needs a verify block of 3 rows"):
        hy.accept_hybrid(st, np.array([0]), np.array([0]), np.array([2]))
    ok = _accept2(st, jnp.array([1, -1, -1]), jnp.array([0, 0, 0]), jnp.array([2, 0, 0]))   # slot 1: 3 tokens
    assert int(ok.attn.error) == 0 and np.asarray(ok.attn.kv_lens).tolist() == [4, 1, 0]
