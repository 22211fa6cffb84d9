"""Rotary position embedding applied on write (the oracle for the write kernel's in-kernel RoPE).

Both styles rotate pairs ``(x, y)`` by the angle ``pos * inv_freq[i]``:

* ``"neox"``: ``x = v[..., :d/2]``, ``y = v[..., d/2:]`` (GPT-NeoX / Llama in HF),
* ``"interleaved"``: ``x = v[..., 0::2]``, ``y = v[..., 1::2]`` (GPT-J / Meta Llama).

``x' = x*cos - y*sin`` and ``y' = y*cos + x*sin`` are computed in float32 with **every product and the
difference rounded separately** (no fused multiply-add; the seed's GLM-5.2 lesson: one ulp from an FMA can
flip a quantized value). Each product is routed through an integer OR with a zero the compiler cannot prove
is zero (bit 30 of ``|cos| <= 1``), so no backend can contract it into an FMA. (``lax.optimization_barrier``
is not enough: XLA CPU expands barriers before fusion and its LLVM backend allows FP contraction.)
``cos``/``sin`` come from float32 ``pos * inv_freq`` with ``inv_freq = theta ** (-2i/rotary_dim)``.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["RopeSpec", "rope_cos_sin", "apply_rope"]

STYLES = ("neox", "interleaved")


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """Static RoPE settings. ``rotary_dim`` defaults to the whole head_dim (must be even)."""

    style: str = "neox"
    theta: float = 10000.0
    rotary_dim: int | None = None

    def __post_init__(self):
        if self.style not in STYLES:
            raise ValueError(f"RopeSpec.style must be one of {STYLES}, got {self.style!r}")
        if self.rotary_dim is not None and (self.rotary_dim <= 0 or self.rotary_dim % 2):
            raise ValueError(f"RopeSpec.rotary_dim must be a positive even number, got {self.rotary_dim}")


def inv_freq(rotary_dim: int, theta: float) -> np.ndarray:
    """f32[rotary_dim/2], computed on the host (identical on every backend)."""
    i = np.arange(0, rotary_dim, 2, dtype=np.float64)
    return (1.0 / (theta ** (i / rotary_dim))).astype(np.float32)


def rope_cos_sin(positions, rotary_dim: int, theta: float):
    """``(cos, sin)`` f32[..., rotary_dim/2] for integer ``positions``."""
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq(rotary_dim, theta))
    return jnp.cos(ang), jnp.sin(ang)


def _opaque_zero(c):
    """int32 zeros the compiler cannot prove zero: bit 30 (exponent MSB) of ``|c| <= 1`` is clear."""
    return (jax.lax.bitcast_convert_type(c, jnp.int32) >> 30) & 1


def _launder(a, z):
    """``a`` unchanged, routed through an integer OR so no FMA can absorb the product that made it."""
    return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(a, jnp.int32) | z, jnp.float32)


def _rotate(x, y, cos, sin):
    z = _opaque_zero(cos)
    xc, ys, yc, xs = (_launder(t, z) for t in (x * cos, y * sin, y * cos, x * sin))
    return xc - ys, yc + xs


def apply_rope(v, positions, spec: RopeSpec):
    """Rotate ``v[..., T, H, D]`` (any float dtype) by ``positions i32[T]``; returns float32.

    ``positions`` broadcast over heads. Dimensions past ``rotary_dim`` pass through unchanged."""
    d = v.shape[-1]
    rd = spec.rotary_dim or d
    if rd > d:
        raise ValueError(f"RopeSpec.rotary_dim={rd} exceeds head_dim={d}")
    vf = v.astype(jnp.float32)
    rot, rest = vf[..., :rd], vf[..., rd:]
    cos, sin = rope_cos_sin(positions, rd, spec.theta)
    cos, sin = cos[..., None, :], sin[..., None, :]  # [T, 1, rd/2] broadcast over heads
    if spec.style == "neox":
        x, y = rot[..., : rd // 2], rot[..., rd // 2:]
        a, b = _rotate(x, y, cos, sin)
        out = jnp.concatenate([a, b], axis=-1)
    else:
        pairs = rot.reshape(*rot.shape[:-1], rd // 2, 2)
        a, b = _rotate(pairs[..., 0], pairs[..., 1], cos, sin)
        out = jnp.stack([a, b], axis=-1).reshape(rot.shape)
    return jnp.concatenate([out, rest], axis=-1) if rest.shape[-1] else out
