"""`jmixedkv.step`'s plan-then-layers programs against the per-layer programs they replace on the hot path.

* `plan_append` + `layer_append` for the layers of a step leave the state `append_only` per layer leaves, bit for
  bit, after every layer (prefill with left padding, decode, a speculative verify block, a second group's rewrite
  covering it, a rewind and its rewrite;
  layers in a permuted order; mixed / NVFP4-only / bf16 caches, rotation + K smoothing, a second group).
* `layer_attend` / `layer_dense` give `append_attend_packed` / `append_dense`'s outputs bit for bit.
* `plan_write_layers` (a whole step, every layer, one program) leaves the state plan + `layer_append` per layer
  leaves, bit for bit, and hands every other group's pools back as the caller's arrays.
* A layer's program donates and returns only what it changes (its group's pools, ``step_layers``, ``error``, its
  K means): every other group's pools are the caller's very arrays afterwards.
* Refusals: a step with a bad slot, a bad position or no page left sets ``error`` with every other leaf unchanged,
  and its layers store nothing; a layer outside the group sets ``ERR_BAD_LAYER`` and stores nothing.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmixedkv as jm
from jmixedkv import step
from jmixedkv.checks import ERR_BAD_LAYER, ERR_BAD_POSITION, ERR_BAD_SLOT, ERR_LOW_OOM
from jmixedkv.speculative import correct_kv_lens

from helpers import assert_trees_bit_equal

L, H, HQ, D, PAGE, MAX_PAGES, SLOTS = 3, 2, 4, 32, 4, 6, 3

CONFIGS = {
    "mixed": jm.KVCacheConfig("mixed_nvfp4_bf16", first_n=4, last_n=8, page_size=PAGE, max_draft_len=3),
    "nvfp4": jm.KVCacheConfig("nvfp4", page_size=PAGE, max_draft_len=3),
    "bf16": jm.KVCacheConfig("bf16", page_size=PAGE, max_draft_len=3),
    "levers": jm.KVCacheConfig("mixed_nvfp4_bf16", first_n=4, last_n=8, page_size=PAGE, max_draft_len=3,
                               rotation="hadamard", k_smoothing=True),
}
GROUPS = (jm.GroupSpec(num_layers=L, num_kv_heads=H, head_dim=D),
          jm.GroupSpec(num_layers=2, num_kv_heads=1, head_dim=D, name="draft"))


def _state(cfg, poison=True):
    state = jm.init_state(cfg, GROUPS, num_pages=SLOTS * MAX_PAGES, max_seqs=SLOTS, max_pages_per_seq=MAX_PAGES,
                          poison=poison, page_order=np.random.default_rng(3).permutation(SLOTS * MAX_PAGES))
    for s in range(SLOTS):
        state = jm.admit(state, s)
    return state


def _steps():
    """(seq, pos) of each step: prefill (slot 2 padded, lengths 7 / 4 / 0), decode, a 3-token verify of slots
    0 and 1; the rewind by 2 comes between (`_rewind`), then a rewrite of the rewound rows and a decode."""
    pre = [(0, p) for p in range(7)] + [(1, p) for p in range(4)] + [(-1, 0)] * 2
    dec = [(0, 7), (1, 4), (2, 0)]
    ver = [(0, 8), (0, 9), (0, 10), (1, 5), (1, 6), (1, 7)]
    rew = [(0, 9), (0, 10), (1, 6), (1, 7), (-1, 0)]
    dec2 = [(0, 11), (1, 8), (2, 1)]
    return [_arrays(t) for t in (pre, dec, ver)], [_arrays(t) for t in (rew, dec2)]


def _arrays(toks):
    return jnp.asarray([s for s, _ in toks], jnp.int32), jnp.asarray([p for _, p in toks], jnp.int32)


def _kv(seed, t, h=H):
    rng = np.random.default_rng(seed)
    k = jnp.asarray(rng.normal(size=(t, h, D)) + 2.0 * (np.arange(D) == 3), jnp.bfloat16)
    return k, jnp.asarray(rng.normal(size=(t, h, D)), jnp.bfloat16)


def _copy(state):
    return jax.tree.map(jnp.copy, state)


def _run_both(a, b, seq, pos, order, seed, group=0):
    """One step on ``a`` (append_only per layer) and on ``b`` (plan + layer_append); equal after every layer."""
    b, plan = step.plan_append(b, seq, pos, group=group)
    rest, _ = step.split_layer_state(b, group)
    for i, layer in enumerate(order):
        k, v = _kv(seed + i, seq.shape[0], GROUPS[group].num_kv_heads)
        a = step.append_only(a, jnp.int32(layer), k, v, seq, pos, group=group)
        mine = step.split_layer_state(b, group)[1]
        b = step.join_layer_state(rest, step.layer_append(rest, mine, jnp.int32(layer), k, v, plan, group=group)[0],
                                  group)
        assert_trees_bit_equal(a, b, f"after layer {layer} (#{i})")
    return a, b


def _rewind(state):
    return correct_kv_lens(state, jnp.asarray([-2, -2, 0], jnp.int32))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_plan_then_layers_equals_per_layer_appends(name):
    a = _state(CONFIGS[name])
    b = _copy(a)
    first, then = _steps()
    for n, (seq, pos) in enumerate(first):
        a, b = _run_both(a, b, seq, pos, [2, 0, 1], 10 * n)
    seq, pos = first[2]                                        # the draft group rewrites the open verify block:
    a, b = _run_both(a, b, seq, pos, [1, 0], 50, group=1)      # it covers the step, its layers join step_layers
    assert np.asarray(b.step_layers)[:2].all()
    a, b = _rewind(a), _rewind(b)
    assert_trees_bit_equal(a, b, "after the rewind")
    for n, (seq, pos) in enumerate(then):
        a, b = _run_both(a, b, seq, pos, [1, 2, 0], 100 + 10 * n)
    seq, pos = first[1]
    a, b = _run_both(a, b, seq[:2], jnp.asarray([12, 9], jnp.int32), [1, 0], 500, group=1)   # the draft group
    assert int(a.error) == 0 and int(a.kv_lens[0]) == 13


def test_layer_attend_and_dense_equal_the_per_layer_programs():
    cfg = CONFIGS["mixed"]
    a = _state(cfg)
    b = _copy(a)
    first, _ = _steps()
    for n, (seq, pos) in enumerate(first[:2]):
        a, b = _run_both(a, b, seq, pos, [0, 1, 2], 10 * n)
    seq = jnp.asarray([0, 1, 2, -1], jnp.int32)              # one token per row (and a padding row)
    pos = jnp.asarray([8, 5, 1, 0], jnp.int32)
    rows = jnp.asarray([0, 1, 2, -1], jnp.int32)
    rng = np.random.default_rng(7)
    kvq = jnp.asarray(rng.normal(size=(4, 2 * H + HQ, 1, D)), jnp.bfloat16)
    b, plan = step.plan_append(b, seq, pos)
    rest, _ = step.split_layer_state(b)
    for layer in (1, 0, 2):
        a, out_a, lse_a = step.append_attend_packed(a, jnp.int32(layer), kvq, seq, pos, rows, num_kv_heads=H,
                                                    sm_scale=0.3, soft_cap=20.0)
        mine, out_b, lse_b = step.layer_attend(rest, step.split_layer_state(b)[1], jnp.int32(layer), kvq, None,
                                               None, plan, rows, num_kv_heads=H, sm_scale=0.3, soft_cap=20.0)
        b = step.join_layer_state(rest, mine)
        assert_trees_bit_equal((a, out_a, lse_a), (b, out_b, lse_b), f"attend, layer {layer}", any_nan=True)
        assert np.isfinite(np.asarray(out_b[:3], np.float32)).all()
    kv = jnp.asarray(rng.normal(size=(4, 2 * H, 1, D)), jnp.bfloat16)
    b, plan = step.plan_append(b, seq, pos + 1)
    rest, _ = step.split_layer_state(b)
    for layer in (2, 0, 1):
        a, kd_a, vd_a = step.append_dense(a, jnp.int32(layer), kv, None, seq, pos + 1, rows, width=4, packed=True)
        mine, kd_b, vd_b = step.layer_dense(rest, step.split_layer_state(b)[1], jnp.int32(layer), kv, None, plan,
                                            rows, width=4, packed=True)
        b = step.join_layer_state(rest, mine)
        assert_trees_bit_equal((a, kd_a, vd_a), (b, kd_b, vd_b), f"dense, layer {layer}")


def test_a_layer_program_hands_back_only_what_it_changes():
    state = _state(CONFIGS["mixed"])
    other = state.pools[1]
    seq, pos = _steps()[0][0]
    state, plan = step.plan_append(state, seq, pos)
    assert all(x is y for x, y in zip(jax.tree.leaves(state.pools[1]), jax.tree.leaves(other)))   # tables only
    rest, mine = step.split_layer_state(state)
    assert len(jax.tree.leaves(mine)) == len(jax.tree.leaves(state.pools[0])) + 2
    k, v = _kv(0, seq.shape[0])
    new, = step.layer_append(rest, mine, jnp.int32(1), k, v, plan)
    assert all(x.is_deleted() for x in jax.tree.leaves(mine))                # donated
    state = step.join_layer_state(rest, new)
    assert all(x is y for x, y in zip(jax.tree.leaves(state.pools[1]), jax.tree.leaves(other)))
    assert state.page_table is rest.page_table and state.kv_lens is rest.kv_lens


@pytest.mark.parametrize("name,backend", [("mixed", "reference"), ("mixed", "pallas"), ("nvfp4", "pallas"),
                                          ("bf16", "reference"), ("levers", "reference")])
def test_plan_write_layers_equals_plan_then_layers(name, backend):
    """Prefill (padded, ragged), decode and a verify block as transformers' ``[B, H, T', D]`` rows per layer; the
    whole-step program (every layer in one store; layer by layer with K smoothing, the "levers" config) leaves the
    per-layer programs' state, bit for bit, with either write backend (the Pallas kernel interpreted); the draft
    group's pools are the caller's arrays."""
    a = _state(CONFIGS[name])
    b = _copy(a)
    other = b.pools[1]
    rng = np.random.default_rng(11)
    steps = [(np.array([[0, 0, 0], [1, 1, 1]]), np.array([[0, 1, 2], [0, 1, 2]])),      # B=2 rows x T'=3
             (np.array([[0], [1]]), np.array([[3], [3]])),                              # decode
             (np.array([[0, 0], [-1, -1]]), np.array([[4, 5], [0, 0]]))]               # verify, a padding row
    for n, (seq, pos) in enumerate(steps):
        kv = jnp.asarray(rng.normal(size=(2 * L, seq.shape[0], H, seq.shape[1], D)), jnp.bfloat16)
        seq_t, pos_t = jnp.asarray(seq.reshape(-1), jnp.int32), jnp.asarray(pos.reshape(-1), jnp.int32)
        a, plan = step.plan_append(a, seq_t, pos_t)
        rest, _ = step.split_layer_state(a)
        for layer in range(L):
            mine = step.split_layer_state(a)[1]
            a = step.join_layer_state(rest, step.layer_append(rest, mine, jnp.int32(layer), kv[layer], kv[L + layer],
                                                              plan, backend=backend)[0])
        tokens = np.concatenate([seq.reshape(-1), pos.reshape(-1)]).astype(np.int32)
        b = step.plan_write_layers(b, tokens, kv, backend=backend)
        assert_trees_bit_equal(a, b, f"{name}: after step {n}")
        assert all(x is y for x, y in zip(jax.tree.leaves(b.pools[1]), jax.tree.leaves(other)))
    assert int(b.error) == 0 and np.asarray(b.kv_lens).tolist()[:2] == [6, 4]


def test_every_layer_at_once_refuses_k_smoothing():
    """`write_layer_traced` with ``layer=None`` (every layer in one store) names K smoothing, whose means are per
    layer, instead of storing rows under one mean."""
    from jmixedkv import state as st
    a = _state(CONFIGS["levers"])
    seq, pos = jnp.asarray([0, 1], jnp.int32), jnp.asarray([0, 0], jnp.int32)
    a, plan = step.plan_append(a, seq, pos)
    kv = jnp.zeros((L, 2, H, D), jnp.bfloat16)
    with pytest.raises(ValueError, match="layer=None .* does not take K smoothing"):
        st.write_layer_traced(a, None, kv, kv, plan)


def _refused(state, seq, pos, code):
    state = _copy(state)                                      # the plan donates the tables
    before = _copy(state)
    state, plan = step.plan_append(state, seq, pos)
    assert int(state.error) & code, f"error {int(state.error)} lacks {code}"
    assert_trees_bit_equal(dataclasses.replace(state, error=before.error), before, "the refused plan")
    assert not bool(plan.ok) and (np.asarray(plan.low_slot) == -1).all() and (np.asarray(plan.high_slot) == -1).all()
    rest, mine = step.split_layer_state(state)
    k, v = _kv(1, seq.shape[0])
    state = step.join_layer_state(rest, step.layer_append(rest, mine, jnp.int32(0), k, v, plan)[0])
    assert_trees_bit_equal(dataclasses.replace(state, error=before.error), before, "its layer")


def test_refused_steps_change_nothing_but_the_error():
    state = _state(CONFIGS["mixed"])
    seq, pos = _steps()[0][0]
    state, plan = step.plan_append(state, seq, pos)
    rest, mine = step.split_layer_state(state)
    for layer in range(L):
        k, v = _kv(layer, seq.shape[0])
        mine, = step.layer_append(rest, mine, jnp.int32(layer), k, v, plan)
    state = step.join_layer_state(rest, mine)
    _refused(state, jnp.asarray([0, 1], jnp.int32), jnp.asarray([7, 9], jnp.int32), ERR_BAD_POSITION)   # gap
    _refused(jm.release(state, 2), jnp.asarray([2], jnp.int32), jnp.asarray([0], jnp.int32), ERR_BAD_SLOT)
    _refused(state, jnp.asarray([0, 7], jnp.int32), jnp.asarray([7, 0], jnp.int32), ERR_BAD_SLOT)        # range
    full = jnp.asarray([2] * 17, jnp.int32)            # slot 2 would need 5 pages: the pool has 18 - 3 left
    tight = jm.init_state(CONFIGS["mixed"], GROUPS, num_pages=4, max_seqs=SLOTS, max_pages_per_seq=MAX_PAGES)
    tight = jm.admit(tight, 2)
    _refused(tight, full, jnp.arange(17, dtype=jnp.int32), ERR_LOW_OOM)


def test_a_layer_outside_the_group_stores_nothing():
    state = _state(CONFIGS["mixed"])
    seq, pos = _steps()[0][0]
    state, plan = step.plan_append(state, seq, pos)
    assert int(state.error) == 0
    before = _copy(state)
    rest, mine = step.split_layer_state(state)
    k, v = _kv(2, seq.shape[0])
    state = step.join_layer_state(rest, step.layer_append(rest, mine, jnp.int32(L), k, v, plan)[0])
    assert int(state.error) == ERR_BAD_LAYER
    assert_trees_bit_equal(dataclasses.replace(state, error=before.error), before, "a bad layer")
