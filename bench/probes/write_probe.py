"""GPU probe for the write kernel's in-kernel RoPE (diagnostics; not a benchmark)."""
import sys, traceback
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, ".")
import pallas_kernels.write as W
import jmixedkv as jk
from jmixedkv.rope import rope_cos_sin
sys.path.insert(0, "tests")
import test_write_kernel as T

def show(name, got, want):
    got, want = np.asarray(got), np.asarray(want)
    bad = got.view(np.uint32) != want.view(np.uint32)
    print(f"{name}: {bad.mean()*100:.1f}% differ", flush=True)
    if bad.any():
        i = np.argwhere(bad)[:3]
        for r, c in i:
            print("   ", r, c, got[r, c], want[r, c])

rng = np.random.default_rng(3)
t, d = 32, 128
pos = rng.integers(0, 100000, t).astype(np.int32)
x = (rng.standard_normal((t, d)) * 3).astype(np.float32)
for style, rd in (("neox", None), ("interleaved", None)):
    rope = jk.RopeSpec(style, 10000.0, rd)
    cos, sin = map(np.asarray, rope_cos_sin(jnp.asarray(pos), rd or d, rope.theta))
    want = T.numpy_rope(x, cos, sin, rope)
    show(f"{style} asm", W.rope_rows_f32(x, pos, rope, interpret=False), want)
    orig = W._PtxOps.rotate
    W._PtxOps.rotate = staticmethod(lambda x_, p, c, s: W._JnpOps.rotate(x_, p, c, s))
    show(f"{style} jnp-ops compiled", W.rope_rows_f32(x, pos, rope, interpret=False), want)
    W._PtxOps.rotate = staticmethod(lambda x_, p, c, s: W._asm("mul.rn.f32 $0, $1, $2;", x_, c) - W._asm("mul.rn.f32 $0, $1, $2;", p, s))
    show(f"{style} 2x mul asm + sub", W.rope_rows_f32(x, pos, rope, interpret=False), want)
    W._PtxOps.rotate = staticmethod(lambda x_, p, c, s: W._asm("sub.rn.f32 $0, $1, $2;", W._asm("mul.rn.f32 $0, $1, $2;", x_, c), W._asm("mul.rn.f32 $0, $1, $2;", p, s)))
    show(f"{style} 3 single asms", W.rope_rows_f32(x, pos, rope, interpret=False), want)
    W._PtxOps.rotate = orig
    # no-rotation partner check: x*1 - partner*0
    c1 = np.ones_like(cos); s0 = np.zeros_like(sin)
for name in ["test_low_group_all_layers_no_rope_d128", "test_plain_group_single_layer_d256", "test_mixed_fp8_twin_all_layers",
             "test_mla_latent_576_fp16_twin", "test_mixed_all_layers_neox_nonfinite", "test_mixed_single_layer_interleaved_partial_rotary_f32_k"]:
    try:
        getattr(T, name)(); print(name, "OK", flush=True)
    except Exception as e:
        print(name, "FAIL", str(e)[:300], flush=True)
