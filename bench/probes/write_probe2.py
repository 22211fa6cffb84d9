"""GPU probe: write kernel vs the XLA reference on GPU and on CPU (who is right when they disagree?)."""
import sys
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, "."); sys.path.insert(0, "tests")
import jmixedkv as jk
import test_write_kernel as T
from jmixedkv import GroupSpec

cpu = jax.devices("cpu")[0]
def bitsdiff(a, b):
    n = 0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        n += int((T._bits(x) != T._bits(y)).sum())
    return n

for name, (dtype, spec, kw) in {
    "low d128": ("nvfp4", GroupSpec(num_layers=2, num_kv_heads=2, head_dim=128), dict(first_n=0, last_n=0,
                 gs=jk.nvfp4.global_scale_from_amax(jnp.asarray([[9.0, 3.0], [20.0, 0.5]])))),
    "mixed d64 gs": ("mixed_nvfp4_bf16", GroupSpec(num_layers=2, num_kv_heads=2, head_dim=64),
                     dict(gs=np.array([[0.004, 0.002], [1.0, 0.5]], np.float32))),
}.items():
    st = T._state(dtype, spec, **kw)
    rng = np.random.default_rng(1)
    starts = [0, 0, 0]
    for step, lengths in enumerate(T._schedule()[:3]):
        seq, pos = T._chunk(lengths, starts, rng)
        starts = [a + n for a, n in zip(starts, lengths)]
        shape = (spec.num_layers, T.T, spec.num_kv_heads, spec.head_dim)
        k, v = T._rows(rng, shape, jnp.bfloat16), T._rows(rng, shape, jnp.bfloat16, 1.0)
        got = T._jit_append(None, "pallas")(st, k, v, seq, pos, None)
        ref_gpu = T._jit_append(None, "reference")(st, k, v, seq, pos, None)
        st_cpu = jax.device_put(st, cpu)
        with jax.default_device(cpu):
            ref_cpu = jax.jit(lambda s_, k_, v_, q_, p_: jk.append(s_, k_, v_, q_, p_, None, backend="reference"))(
                st_cpu, jax.device_put(k, cpu), jax.device_put(v, cpu), jax.device_put(seq, cpu), jax.device_put(pos, cpu))
        print(f"{name} step {step}: kernel vs GPU-ref {bitsdiff(got.pools, ref_gpu.pools)}, kernel vs CPU-ref "
              f"{bitsdiff(got.pools, jax.device_get(ref_cpu.pools))}, GPU-ref vs CPU-ref "
              f"{bitsdiff(ref_gpu.pools, jax.device_get(ref_cpu.pools))}", flush=True)
        st = ref_gpu
