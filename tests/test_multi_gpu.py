"""Tensor-parallel decode on two GPUs (the `nvidia-h200-x2` machine kind): the default kernel (Mosaic GPU on
Hopper) under `jax.shard_map`, bitwise equal to one GPU. Marked ``gpu`` and ``gpu2``: deselected on CPU by the
README test command and from ``make test-gpu``; ``make test-gpu2`` runs them on a machine with >= 2 GPUs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jmixedkv as jm
from jmixedkv import sharding
from helpers import assert_trees_bit_equal

pytestmark = [pytest.mark.gpu, pytest.mark.gpu2]


def _mixed_state(batch, ctx, kv_heads, head_dim, page, seed):
    """``batch`` sequences of ``ctx`` random tokens of a mixed cache (first_n 4, last_n 64), one layer."""
    cfg = jm.KVCacheConfig("mixed_nvfp4_bf16", first_n=4, last_n=64, page_size=page)
    pages = -(-ctx // page)
    state = jm.init_state(cfg, jm.GroupSpec(1, kv_heads, head_dim), batch * pages, batch, pages)
    for s in range(batch):
        state = jm.admit(state, s)
    rng = np.random.default_rng(seed)
    seq = np.repeat(np.arange(batch, dtype=np.int32), ctx)
    pos = np.tile(np.arange(ctx, dtype=np.int32), batch)
    k, v = (jnp.asarray(rng.normal(size=(1, batch * ctx, kv_heads, head_dim)), jnp.bfloat16) for _ in range(2))
    state = jm.append(state, None, k, v, jnp.asarray(seq), jnp.asarray(pos))
    assert int(state.error) == 0
    return state


@pytest.mark.parametrize("batch,ctx,q_heads,tq", [(16, 8192, 32, 1), (32, 4096, 32, 4), (64, 2048, 56, 1)])
def test_sharded_decode_is_bitwise_one_gpu(batch, ctx, q_heads, tq):
    """8 KV heads over 2 GPUs (GQA 4 and 7, Tq 1 and 4): `sharded_decode_attention` with the default kernel gives
    the outputs and LSE of `decode_attention` on one GPU, bit for bit."""
    assert len(jax.devices("gpu")) >= 2, f"needs 2 GPUs, found {jax.devices()}"
    state = _mixed_state(batch, ctx, 8, 128, 16, seed=batch)
    q = jax.random.normal(jax.random.PRNGKey(batch), (batch, tq, q_heads, 128), jnp.float32).astype(jnp.bfloat16)
    slots = jnp.arange(batch, dtype=jnp.int32)
    one = jax.device_get(jax.jit(lambda st, q_: jm.decode_attention(st, 0, q_, slots))(state, q))
    mesh = sharding.make_mesh(2)
    shard = sharding.shard_state(state, mesh)
    qs = jax.device_put(q, NamedSharding(mesh, P(None, None, sharding.AXIS)))
    tp = jax.device_get(jax.jit(lambda st, q_: sharding.sharded_decode_attention(mesh, st, 0, q_, slots))(shard, qs))
    assert_trees_bit_equal(tp, one, f"{batch} x {ctx}, {q_heads} q heads, Tq {tq}")
