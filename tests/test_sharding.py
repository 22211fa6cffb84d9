"""Tensor parallelism over KV heads: sharded transitions and readers bit-equal to the unsharded ones.

Runs on 4 host CPU devices (see conftest.py)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jmixedkv as jm
from jmixedkv import sharding
from helpers import assert_trees_bit_equal, bits

L, H, D = 2, 4, 32
CFG = jm.KVCacheConfig("mixed_nvfp4_bf16", first_n=3, last_n=5, page_size=4, max_draft_len=1)

pytestmark = pytest.mark.skipif(len(jax.devices()) < 2, reason="needs >= 2 devices (conftest forces 4 CPU devices)")


def _drive(append_fn, state, rng):
    """Admit 3 sequences, a ragged prefill, then 6 decode steps; returns the final state."""
    admit, release = jax.jit(jm.admit), jax.jit(jm.release)
    for s in range(3):
        state = admit(state, s)
    lens = np.array([9, 1, 14])
    seq = np.concatenate([[s] * n for s, n in enumerate(lens)]).astype(np.int32)
    pos = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
    k = jnp.asarray(rng.normal(size=(L, len(seq), H, D)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(L, len(seq), H, D)), jnp.bfloat16)
    state = append_fn(state, None, k, v, jnp.asarray(seq), jnp.asarray(pos))
    for step in range(6):
        seq = np.arange(3, dtype=np.int32)
        for layer in range(L):
            k = jnp.asarray(rng.normal(size=(3, H, D)), jnp.bfloat16)
            state = append_fn(state, jnp.int32(layer), k, k * 2, jnp.asarray(seq), jnp.asarray(lens, jnp.int32))
        lens = lens + 1
        if step == 3:
            state = admit(release(state, 1), 1)
            lens[1] = 0
    return state


@pytest.fixture(scope="module")
def mesh():
    return sharding.make_mesh(4)


def test_sharded_transitions_and_stage_match_unsharded(mesh):
    base = jm.init_state(CFG, jm.GroupSpec(L, H, D), 32, 3, 8, poison=True)
    sharded_state = jm.init_state(CFG, jm.GroupSpec(L, H, D), 32, 3, 8, poison=True, mesh=mesh)
    assert sharded_state.pools[0].low.data.sharding.spec == P(None, None, None, "tp")

    plain_append = functools.partial(jm.append, backend="reference")
    shard_append = jax.jit(functools.partial(sharding.sharded_append, mesh, backend="reference"))
    plain = _drive(plain_append, base, np.random.default_rng(0))
    shard = _drive(shard_append, sharded_state, np.random.default_rng(0))
    assert int(plain.error) == 0
    assert_trees_bit_equal(jax.device_get(shard), jax.device_get(plain))
    # the allocator and tables are replicated and in lockstep on every shard
    for leaf in (shard.page_table, shard.high_table, shard.alloc.free, shard.alloc.num_free, shard.kv_lens):
        copies = [np.asarray(s.data) for s in leaf.addressable_shards]
        for c in copies[1:]:
            np.testing.assert_array_equal(c, copies[0])
    seq = jnp.array([0, 1, 2], jnp.int32)
    shard_stage = jax.jit(functools.partial(sharding.sharded_stage_reference, mesh))
    for layer in range(L):
        a = shard_stage(shard, layer, seq)
        b = jax.jit(jm.stage_reference)(plain, layer, seq)
        np.testing.assert_array_equal(bits(a), bits(b))


def test_head_count_must_divide(mesh):
    with pytest.raises(ValueError, match="num_kv_heads=2 is not divisible by the tensor-parallel size 4"):
        jm.init_state(CFG, jm.GroupSpec(1, 2, 32), 8, 2, mesh=mesh)


def _filled(mesh):
    """A mixed state with 3 ragged sequences, built unsharded, and its sharded copy."""
    state = jm.init_state(CFG, jm.GroupSpec(L, H, D), 32, 3, 8, poison=True)
    state = _drive(functools.partial(jm.append, backend="reference"), state, np.random.default_rng(1))
    return state, sharding.shard_state(state, mesh)


def test_sharded_readers_match_unsharded(mesh):
    plain, shard = _filled(mesh)
    seq = jnp.array([2, 0, -1, 1], jnp.int32)
    # stage: the Pallas kernel (interpret mode on CPU) per shard
    a = jax.jit(lambda st: sharding.sharded_stage(mesh, st, 1, seq, backend="pallas"))(shard)
    b = jax.jit(lambda st: jm.stage(st, 1, seq, backend="pallas", validate=False))(plain)
    assert_trees_bit_equal(jax.device_get(a), jax.device_get(b))
    assert a.pages.sharding.spec[2] == "tp"
    # gather_rows (attention-dtype scratch)
    idx = jnp.array([[0, 3, 8, 13, -1], [1, 0, 4, 5, 6], [0, 0, 0, 0, 0], [2, 1, 0, -1, -1]], jnp.int32)
    a = jax.jit(lambda st: sharding.sharded_gather_rows(mesh, st, 0, seq, idx, backend="pallas", validate=False))(shard)
    b = jax.jit(lambda st: jm.gather_rows(st, 0, seq, idx, backend="pallas", validate=False))(plain)
    assert_trees_bit_equal(jax.device_get(a), jax.device_get(b))
    with pytest.raises(ValueError, match="not supported under tensor parallelism"):
        sharding.sharded_gather_rows(mesh, shard, 0, seq, idx, scratch_dtype="fp8")
    # decode attention: the fused kernel per shard, query heads sharded, split count fixed
    q = jnp.asarray(np.random.default_rng(2).normal(size=(4, 2, 2 * H, D)), jnp.bfloat16)
    for backend, kw in (("reference", {}), ("pallas", {"num_splits": 2})):
        a = jax.jit(lambda st, q_: sharding.sharded_decode_attention(mesh, st, 1, q_, seq, backend=backend, **kw))(
            shard, q)
        b = jax.jit(lambda st, q_: jm.decode_attention(st, 1, q_, seq, backend=backend, **kw))(plain, q)
        assert_trees_bit_equal(jax.device_get(a), jax.device_get(b))


def _long_state(b, page, max_pages, lens, rng):
    """A mixed state of ``b`` sequences of ``lens`` tokens (one layer, ``H`` KV heads), appended unsharded."""
    cfg = jm.KVCacheConfig("mixed_nvfp4_bf16", first_n=3, last_n=5, page_size=page)
    state = jm.init_state(cfg, jm.GroupSpec(1, H, D), b * max_pages, b, max_pages)
    for s in range(b):
        state = jm.admit(state, s)
    seq = np.concatenate([[s] * n for s, n in enumerate(lens)]).astype(np.int32)
    pos = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
    k, v = (jnp.asarray(rng.normal(size=(1, len(seq), H, D)), jnp.bfloat16) for _ in range(2))
    state = jm.append(state, None, k, v, jnp.asarray(seq), jnp.asarray(pos), backend="reference")
    assert int(state.error) == 0
    return state


def test_sharded_decode_splits_as_one_device(mesh):
    """With its default tuning the fused kernel picks split counts from the KV heads it sees: a shard (here 1 of 4
    heads) would split each (row, KV head) differently from one device. With ``split_heads`` = the whole count a
    shard's kernel partials are bitwise one device's (for each head); without it they are not (so this test can
    fail). `sharded_decode_attention` passes it: its outputs equal one device's (the merged LSE to 1e-6: XLA's CPU
    code for the merge differs in the last bit between shapes; a `gpu2` test checks bits on GPUs)."""
    from jmixedkv.pools import kernel_arrays
    from pallas_kernels.decode import TritonConfig, triton
    b, hq, page, max_pages = 17, 2 * H, 16, 48
    rng = np.random.default_rng(3)
    lens = rng.integers(600, 700, b)
    state = _long_state(b, page, max_pages, lens, rng)
    q = jnp.asarray(rng.normal(size=(b, 1, hq, D)), jnp.bfloat16)
    low, high = kernel_arrays(state.pools[0].low), kernel_arrays(state.pools[0].high)

    def partials(h0, h1, config):
        head = lambda x: x[:, :, :, h0:h1] if x.ndim == 6 else x  # noqa: E731
        return jax.device_get(triton.paged_decode_partials(
            q[:, :, 2 * h0:2 * h1], state.page_table, jnp.asarray(lens, jnp.int32), 0, tuple(map(head, low)),
            tuple(map(head, high)), None, state.high_table, geom=state.config.twin, interpret=True, config=config))
    whole = partials(0, H, TritonConfig())
    for i in range(H):
        one_head = tuple(x[:, :, i:i + 1] for x in whole)
        assert_trees_bit_equal(partials(i, i + 1, TritonConfig(split_heads=H)), one_head, f"head {i}")
    assert partials(0, 1, TritonConfig())[0].shape[0] != whole[0].shape[0]      # its own count: other splits

    shard = sharding.shard_state(state, mesh)
    slots = jnp.arange(b, dtype=jnp.int32)
    one = jax.device_get(jax.jit(lambda st, q_: jm.decode_attention(st, 0, q_, slots, backend="pallas"))(state, q))
    tp = jax.device_get(jax.jit(lambda st, q_: sharding.sharded_decode_attention(mesh, st, 0, q_, slots,
                                                                                 backend="pallas"))(shard, q))
    np.testing.assert_allclose(np.asarray(tp[0], np.float32), np.asarray(one[0], np.float32), rtol=2 ** -7)
    np.testing.assert_allclose(tp[1], one[1], rtol=1e-6)
    with pytest.raises(ValueError, match="split_heads must be an int >= 1"):
        jm.decode_attention(state, 0, q, slots, split_heads=0)
