"""Rotary position embedding applied on write (the oracle for the write kernel's in-kernel RoPE).

Both styles rotate pairs ``(x, y)`` by the angle ``pos * inv_freq[i]``:

* ``"neox"``: ``x = v[..., :d/2]``, ``y = v[..., d/2:]`` (GPT-NeoX / Llama in HF),
* ``"interleaved"``: ``x = v[..., 0::2]``, ``y = v[..., 1::2]`` (GPT-J / Meta Llama).

``x' = x*cos - y*sin`` and ``y' = y*cos + x*sin`` are computed in float32 with **every product and the
difference rounded separately** (no fused multiply-add; the seed's GLM-5.2 lesson: one ulp from an FMA can
flip a quantized value): each product goes through the fence of `jmixedkv.numerics` (`launder` with
`opaque_zero` of ``cos``), so no backend can contract it into an FMA (docs/DESIGN.md §2).
``cos``/``sin`` come from float32 ``pos * inv_freq`` with ``inv_freq = theta ** (-2i/rotary_dim)``
(`jmixedkv.numerics.rope_cos_sin`, shared with the write kernel).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from .numerics import inv_freq, launder, opaque_zero, rope_cos_sin

__all__ = ["RopeSpec", "rope_cos_sin", "inv_freq", "apply_rope"]

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


def _rotate(x, y, cos, sin):
    z = opaque_zero(cos)
    xc, ys, yc, xs = (launder(t, z) for t in (x * cos, y * sin, y * cos, x * sin))
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
