"""Hybrid recurrent + attention caches (`jmixedkv.hybrid`): layer-id mapping, recurrent mask, buffers, page tables,
and speculative rollback of the recurrent state against a run that never speculated."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmixedkv import KVCacheConfig, rows_reference, stage_reference
from jmixedkv import hybrid as hy
from jmixedkv import speculative as spec
from jmixedkv.layout import high_column
from jmixedkv.pools import RowPool
from jmixedkv.state import append

TYPES = ["mamba", "attention", "mamba", "mamba", "attention"]
MODEL = hy.HybridModelConfig(TYPES, num_kv_heads=1, head_dim=16, conv_dim=8, conv_kernel=4, ssm_heads=2,
                             ssm_head_dim=4, ssm_state_dim=4, num_draft_layers=1)
KV = KVCacheConfig("mixed_nvfp4_bf16", first_n=2, last_n=4, page_size=4, max_draft_len=3, speculative_mode="mtp")


@jax.jit
def _make():
    """The one hybrid state shape every test uses (one compile)."""
    return hy.init_hybrid_state(MODEL, KV, 40, 2, 16, poison=True)


_append = jax.jit(append, static_argnames=("group", "rope", "backend"))
_admit = jax.jit(hy.hybrid_admit)


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint16) if x.dtype.itemsize == 2 else x


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
    state = hy.HybridState(state.layout, _append(state.attn, k, -k, jnp.full(n, 1, jnp.int32), jnp.arange(n), 1),
                           state.conv, state.ssm, state.conv_snap, state.ssm_snap)
    pos = jnp.arange(n)
    seen = rows_reference(state.attn, 1, jnp.ones(n, jnp.int32), pos)           # what a reader sees
    retained = np.flatnonzero((np.arange(n) < KV.first_n) | (np.arange(n) >= n - KV.last_n))
    buf = hy.layer_buffers(state, 7)["rows"]
    ht = hy.layer_page_table(state, 7)
    col = high_column(pos, KV.page_size, KV.num_fixed_pages, KV.num_ring_pages)
    twin = buf[ht[1, col], :, :, pos % KV.page_size]                           # [n, kv, H, D]
    np.testing.assert_array_equal(_bits(seen[retained]), _bits(twin[retained]))
    np.testing.assert_array_equal(_bits(twin[retained][:, 0]), _bits(k[retained].astype(jnp.bfloat16)))
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
            state, x = hy.recurrent_forward(state, i, seq, x, valid, params)
            outs.append(x)
        else:
            attn = append(state.attn, katt[i], katt[i] * 0.5, s_flat, p_flat, layer=i)
            state = hy.HybridState(state.layout, attn, state.conv, state.ssm, state.conv_snap, state.ssm_snap)
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
            np.testing.assert_array_equal(_bits(_stage(sp.attn, layer, seq)), _bits(_stage(ref.attn, layer, seq)))
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
