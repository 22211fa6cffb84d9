"""CI: the installed wheel works on its own. Run by ``.ci/run`` with a clean venv's python, from outside the source
tree: ``import jmixedkv`` resolves to the venv's site-packages (not the checkout), the demo package and its data ship
in the wheel, and a tiny mixed-precision cache appends 20 tokens and answers ``decode_attention`` like the float32
reference over its staged rows."""
import importlib.resources
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jmixedkv as jm

checkout = os.path.abspath(sys.argv[1])
assert not os.path.abspath(jm.__file__).startswith(checkout + os.sep), f"imported from the checkout: {jm.__file__}"
assert importlib.resources.files("jmixedkv_demo").joinpath("data", "prose.txt").is_file(), "no demo texts in the wheel"

cfg = jm.KVCacheConfig("mixed_nvfp4_bf16", first_n=4, last_n=4, page_size=8)
spec = jm.GroupSpec(num_layers=1, num_kv_heads=2, head_dim=64)
state = jm.admit(jm.init_state(cfg, spec, num_pages=4, max_seqs=1), 0)
k, v = (jax.random.normal(jax.random.PRNGKey(i), (20, 2, 64), jnp.float32) for i in (0, 1))
state = jm.append(state, 0, k, v, jnp.zeros((20,), jnp.int32), jnp.arange(20, dtype=jnp.int32))
assert int(state.error) == 0 and int(state.kv_lens[0]) == 20
q = jax.random.normal(jax.random.PRNGKey(2), (1, 1, 4, 64), jnp.float32).astype(cfg.attention_dtype)
slots = jnp.zeros((1,), jnp.int32)
out, lse = jm.decode_attention(state, 0, q, slots)
staged = jm.stage_reference(state, 0, slots, dtype=jnp.float32)                 # [B, kv, H, S, D]
ref, _ = jm.attention_reference(q, staged[:, 0], staged[:, 1], state.kv_lens[slots])
out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
assert out.shape == (1, 1, 4, 64) and np.isfinite(out).all()
np.testing.assert_allclose(out, ref, atol=2e-2, rtol=2e-2)
print(f"wheel smoke ok: jmixedkv from {os.path.dirname(jm.__file__)}, jax {jax.__version__}, "
      f"max |decode - reference| = {np.abs(out - ref).max():.2e}")
