"""Fork + legal rewind + re-append: copy-on-write at fork covers every page a legal rewind can write.

A sequence forked at ``kv_len`` 8 with rows written up to 9 (a rejected draft) may rewind either copy to
``written - max_draft_len``; the re-appended positions then land in pages that must be each sequence's own. Checked
on the pure transitions (error bits, every other sequence bitwise unchanged, rows against an unforked reference),
through `CacheManager` (host mirror) and `PrefixCache`, and through transformers (beam search ``reorder_cache``
then ``crop(-1)`` and one more forward step, against ``DynamicCache`` doing the same)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmixedkv import CacheManager, GroupSpec, KVCacheConfig, append, init_state
from jmixedkv import speculative as spec
from jmixedkv import state as st
from jmixedkv.prefix import PrefixCache
from jmixedkv.staging import rows_reference

from helpers import tiny_llama

PAGE = 4
CFG = KVCacheConfig("mixed_nvfp4_bf16", first_n=4, last_n=4, page_size=PAGE, max_draft_len=2)
SPEC = GroupSpec(num_layers=2, num_kv_heads=1, head_dim=16)


def _rows(seed, n):
    return jax.random.normal(jax.random.key(seed), (2, n, 1, 16), jnp.float32).astype(jnp.bfloat16)


def _put(state, slot, positions, seed):
    pos = np.asarray(positions, np.int32)
    k = _rows(seed, pos.size)
    return append(state, None, k, k * 2, np.full(pos.shape, slot, np.int32), pos, backend="reference")


def _read(state, slot):
    n = int(state.kv_lens[slot])
    return np.asarray(rows_reference(state, 0, jnp.full((n,), slot, jnp.int32), jnp.arange(n, dtype=jnp.int32)),
                      np.float32)


def _at_8_written_9(state, slot=0):
    """kv_len 8, written 9: 7 prompt rows, then a verify block [7, 8] (one draft) accepting none."""
    state = st.admit(state, slot)
    state = _put(state, slot, range(7), seed=1)
    state = _put(state, slot, [7, 8], seed=2)
    return spec.accept(state, [slot], 0, 1)


@pytest.mark.parametrize("rewound", ["src", "dst"])
def test_fork_then_legal_rewind_reappends(rewound):
    state = init_state(CFG, SPEC, num_pages=32, max_seqs=3, poison=True)
    state = _at_8_written_9(state)
    assert (int(state.kv_lens[0]), int(state.written[0])) == (8, 9)
    state = st.fork(state, 0, 1)
    assert int(state.error) == 0
    slot = 0 if rewound == "src" else 1
    other = 1 - slot
    keep_other = _read(state, other)
    state = spec.correct_kv_lens(state, np.where(np.arange(3) == slot, -1, 0).astype(np.int32))
    state = _put(state, slot, [7, 8], seed=3)
    assert st.describe_error(int(state.error)) == "ok"
    # the rewound sequence reads as one built without the fork; the other one is bitwise unchanged
    ref = _at_8_written_9(init_state(CFG, SPEC, num_pages=32, max_seqs=3, poison=True))
    ref = spec.correct_kv_lens(ref, np.array([-1, 0, 0], np.int32))
    ref = _put(ref, 0, [7, 8], seed=3)
    np.testing.assert_array_equal(_read(state, slot), _read(ref, 0))
    np.testing.assert_array_equal(_read(state, other), keep_other)


def test_fork_shares_only_pages_below_the_rewind_floor():
    state = init_state(CFG, SPEC, num_pages=32, max_seqs=3)
    state = _at_8_written_9(state)                     # floor = 9 - 2 = 7: page 0 shared, page 1 copied
    state = st.fork(state, 0, 1)
    pt = np.asarray(state.page_table)
    # page 2 holds only the rejected row 8 (>= kv_len): dst does not take it, an append allocates its own
    assert pt[1, 0] == pt[0, 0] and pt[1, 1] != pt[0, 1] and pt[1, 1] >= 0 and pt[0, 2] >= 0 and pt[1, 2] == -1
    # the twin's fixed page 0 ([0, 4) <= floor) is shared, the ring copied
    ht = np.asarray(state.high_table)
    assert ht[1, 0] == ht[0, 0] and not np.intersect1d(ht[1, 1:], ht[0, 1:]).size
    assert st.fork_pages_needed(st.fork(init_state(CFG, SPEC, 32, 3), -1, -1), 0) == (0, 0)


def test_manager_fork_rewind_and_capacity_mirror():
    mgr = CacheManager(CFG, SPEC, num_pages=32, max_seqs=3, backend="reference")
    mgr.replace_state(_at_8_written_9(mgr.state))
    need = st.fork_pages_needed(mgr.state, 0)
    free = mgr.free_pages, mgr.free_high_pages
    dst = mgr.fork(0)
    assert (free[0] - mgr.free_pages, free[1] - mgr.free_high_pages) == need == (1, CFG.num_high_pages_per_seq - 1)
    for slot in (0, dst):
        mgr.correct_kv_lens(np.where(np.arange(3) == slot, -1, 0).astype(np.int32))
        k = _rows(slot, 2)
        mgr.append(None, k, k, [slot, slot], [7, 8])       # was: ValueError "write into a page shared"
        assert mgr.kv_len(slot) == 9
    mgr.check()


def test_prefix_fork_rewind_reappends():
    pc = PrefixCache(init_state(CFG, SPEC, num_pages=32, max_seqs=3), backend="reference")
    pc.state = _at_8_written_9(pc.state)
    pc.fork(0, 1)
    pc.manager.correct_kv_lens(np.array([0, -1, 0], np.int32))
    k = _rows(5, 2)
    pc.append(None, k, k, [1, 1], [7, 8])
    assert int(np.asarray(pc.state.kv_lens)[1]) == 9 and int(pc.state.error) == 0


def test_rewind_into_a_reused_prefix_is_refused():
    """admit_with_prefix's rows were never appended by this sequence: no rewind may drop them."""
    pc = PrefixCache(init_state(CFG, SPEC, num_pages=32, max_seqs=3), backend="reference")
    tokens = list(range(12))
    pc.admit(0, tokens)
    pc.append(None, _rows(0, 12), _rows(1, 12), [0] * 12, list(range(12)))
    pc.commit(0, tokens)
    m = pc.admit(1, tokens)
    assert m == 8
    before = jax.tree.leaves(pc.state)
    with pytest.raises(ValueError, match="slot 1: offset -1"):
        pc.manager.correct_kv_lens(np.array([0, -1, 0], np.int32))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(pc.state), before))
    # traced: the error bit, nothing else changes
    out = jax.jit(spec.correct_kv_lens)(pc.state, jnp.array([0, -1, 0], jnp.int32))
    assert int(out.error) & st.ERR_BAD_CORRECTION
    np.testing.assert_array_equal(out.kv_lens, pc.state.kv_lens)


# ------------------------------------------------------------------------------------------- transformers
def test_hf_beam_reorder_crop_step_matches_dynamic_cache():
    import torch                                   # the test extra installs torch and transformers
    from transformers import DynamicCache
    from interop.hf import JMixedKVCache
    model = tiny_llama(128)
    kv = KVCacheConfig("bf16", page_size=4, max_draft_len=2)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))

    def run(cache):
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)             # 8 stored tokens
            cache.reorder_cache(torch.tensor([0, 0]))                     # beam search: row 0 forked
            cache.crop(-1)
            nxt = torch.tensor([[5, 5], [9, 9]])                          # re-feed position 7, then 8
            pos = torch.tensor([[7, 8], [7, 8]])
            return model(nxt, past_key_values=cache, use_cache=True, position_ids=pos,
                         cache_position=torch.tensor([7, 8])).logits.float()

    want = run(DynamicCache(config=model.config))
    got = run(JMixedKVCache.for_model(model, kv, max_batch_size=4, max_cache_len=16, backend="reference"))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_prefix_commit_refuses_token_ids_other_than_admitted():
    pc = PrefixCache(init_state(CFG, SPEC, num_pages=32, max_seqs=3), backend="reference")
    tokens = list(range(12))
    pc.admit(0, tokens)
    pc.append(None, _rows(0, 12), _rows(1, 12), [0] * 12, list(range(12)))
    with pytest.raises(ValueError, match=r"tokens\[5\]=99 differs from the token 5"):
        pc.commit(0, tokens[:5] + [99] + tokens[6:])
    assert pc.commit(0, tokens) == 3 and pc.match_prefix(tokens + [1] * 4)[0] == 12
    with pytest.raises(ValueError, match="capacity_pages must be an integer >= 0 or None, got 1.5"):
        PrefixCache(init_state(CFG, SPEC, num_pages=8, max_seqs=1), host_capacity_pages=1.5)
