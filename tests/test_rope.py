"""RoPE reference: both styles equal a float32 numpy computation with separate roundings, eager and jitted."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_bits_equal
from jmixedkv.rope import RopeSpec, apply_rope, inv_freq


def numpy_rope(v, pos, style, theta, rd):
    v = np.asarray(v, np.float32)
    ang = pos.astype(np.float32)[:, None] * inv_freq(rd, theta)
    cos, sin = np.asarray(jnp.cos(jnp.asarray(ang))), np.asarray(jnp.sin(jnp.asarray(ang)))  # same libm as jax
    out = v.copy()
    if style == "neox":
        x, y = v[..., : rd // 2], v[..., rd // 2: rd]
    else:
        x, y = v[..., 0:rd:2], v[..., 1:rd:2]
    c, s = cos[:, None, :], sin[:, None, :]
    a = np.subtract(np.multiply(x, c), np.multiply(y, s))
    b = np.add(np.multiply(y, c), np.multiply(x, s))
    if style == "neox":
        out[..., : rd // 2], out[..., rd // 2: rd] = a, b
    else:
        out[..., 0:rd:2], out[..., 1:rd:2] = a, b
    return out


@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("rd", [None, 32])
def test_rope_matches_separately_rounded_numpy(style, rd):
    rng = np.random.default_rng(1)
    v = rng.normal(size=(257, 3, 64)).astype(np.float32) * 37.0
    pos = rng.integers(0, 1 << 17, size=257).astype(np.int32)
    spec = RopeSpec(style, 10000.0, rd)
    want = numpy_rope(v, pos, style, 10000.0, rd or 64)
    eager = np.asarray(apply_rope(jnp.asarray(v), jnp.asarray(pos), spec))
    jitted = np.asarray(jax.jit(apply_rope, static_argnums=2)(jnp.asarray(v), jnp.asarray(pos), spec))
    assert_bits_equal(eager, want, "eager")
    assert_bits_equal(jitted, want, "jitted")


def test_rope_rejects_bad_spec():
    with pytest.raises(ValueError, match="style"):
        RopeSpec("gptj")
    with pytest.raises(ValueError, match="rotary_dim"):
        RopeSpec(rotary_dim=3)
    with pytest.raises(ValueError, match="exceeds head_dim"):
        apply_rope(jnp.zeros((1, 1, 16)), jnp.zeros(1, jnp.int32), RopeSpec(rotary_dim=32))
