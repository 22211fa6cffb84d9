"""GPU probe: where does XLA-on-GPU's run of the NVFP4 reference (`jmixedkv.nvfp4.quantize`) differ from the same
jitted code on the CPU? Prints every intermediate of the pinned order for the first mismatching blocks."""
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, ".")
from jmixedkv import nvfp4 as N  # noqa: E402

cpu = jax.devices("cpu")[0]


def stages(x, gs):
    xf = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // 16, 16)
    gs = jnp.broadcast_to(gs, x.shape[:-1])[..., None]
    amax = jnp.max(jnp.abs(xf), axis=-1)
    enc = jnp.float32(1.0) / gs
    t = amax * N._SIXTH
    s_f32 = enc * N._keep(t, t)
    s8 = N._block_scale(amax, gs)
    sf = N.e4m3_values(s8)
    prod = sf * gs
    r = jnp.where(sf == 0, jnp.float32(0.0), jnp.float32(1.0) / N._keep(prod, prod))
    y = xf * N._keep(r, r)[..., None]
    codes = N.e2m1_codes(y)
    return dict(amax=amax, enc=enc, s_f32=s_f32, s8=jax.lax.bitcast_convert_type(s8, jnp.uint8), sf=sf, prod=prod,
                r=r, y=y, codes=codes)


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint32) if a.dtype == np.float32 else a


rng = np.random.default_rng(1)
for trial in range(6):
    x = jnp.asarray(rng.standard_normal((4096, 128)) * 3.0, jnp.bfloat16)
    amax = float(rng.choice([9.0, 3.0, 20.0, 0.5]))
    gs = N.global_scale_from_amax(jnp.float32(amax))
    g = jax.jit(stages)(x, gs)
    with jax.default_device(cpu):
        c = jax.jit(stages)(jax.device_put(x, cpu), jax.device_put(gs, cpu))
    qg = jax.jit(N.quantize)(x, gs)
    with jax.default_device(cpu):
        qc = jax.jit(N.quantize)(jax.device_put(x, cpu), jax.device_put(gs, cpu))
    nd = int((np.asarray(qg[0]) != np.asarray(qc[0])).sum())
    ns = int((np.asarray(qg[1]).view(np.uint8) != np.asarray(qc[1]).view(np.uint8)).sum())
    print(f"trial {trial} amax {amax} gs {float(gs)!r}: quantize() GPU vs CPU: data {nd} bytes, scales {ns} bytes")
    print("  stages differing (GPU vs CPU):", {k: int((bits(g[k]) != bits(c[k])).sum()) for k in g})
