"""A small Llama-style decoder (Flax linen) whose attention reads and writes through a jmixedkv cache, and a
jit-compiled generation loop (prefill, then greedy decode in ``lax.fori_loop``).

Model: token embedding, ``num_layers`` pre-norm blocks (RMSNorm, GQA attention with NeoX RoPE, SwiGLU MLP), a
final RMSNorm and an untied output head. Weights are deterministic from a seed. Because the weights are random,
the init is scaled so the model is not flat: attention logits have a standard deviation of about ``qk_gain**2``
(1 by default: attention is neither uniform, which would average cache errors away, nor one-hot, which would
make any error flip the output) and output logits have a standard deviation of about ``logit_gain`` (4: greedy
argmax has a real margin), which makes token agreement with the bf16 run informative.

RoPE is applied **in the model** to q and k (`jmixedkv.apply_rope`, float32, no FMA) and K is appended already
rotated (``append(..., rope=None)``), so every cache dtype sees the same rows.

Cache I/O: each layer appends its K/V with `jmixedkv.append(state, k, v, seq_slots, positions, layer=l)` and
attends over what the cache gives back: single-token decode steps use `jmixedkv.attention.decode_attention`
(the fused kernel) when that module is importable and ``attention="auto"`` or ``"fused"``; prefill, and
``attention="reference"``, stage the cache with `stage_reference` and run `attention_reference` (float32,
causal). Both paths take queries in the cache's attention dtype and round the output to it (the fused kernel's
contract), so they agree up to accumulation order. The `CacheState` is carried through the loop, so the whole
generation (prefill + decode) is one compiled program per cache config; `build_generate` caches it.

Shapes: ``B`` sequences, prompt length ``P``, ``N`` new tokens, ``V`` vocab, ``Hq`` query heads, ``H`` KV heads,
``D`` head_dim.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from .config import KVCacheConfig
from .reference import attention_reference, stage_reference
from .rope import RopeSpec, apply_rope
from .state import GroupSpec, admit, append, init_state

__all__ = ["ModelConfig", "Decoder", "init_params", "GenerationResult", "build_generate", "generate",
           "cache_shape", "has_fused_attention"]

ATTENTION_MODES = ("auto", "fused", "reference")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static model hyper-parameters (hashable). ``qk_gain`` / ``logit_gain`` sharpen the random init."""

    vocab_size: int = 512
    d_model: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    ffn_dim: int = 512
    rope_theta: float = 10000.0
    qk_gain: float = 1.0
    logit_gain: float = 4.0
    seed: int = 0

    def __post_init__(self):
        for f in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "ffn_dim"):
            if getattr(self, f) < 1:
                raise ValueError(f"ModelConfig.{f} must be >= 1, got {getattr(self, f)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig: num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads} (GQA)")
        if self.head_dim % 16:
            raise ValueError(f"ModelConfig.head_dim must be a multiple of 16 (NVFP4 blocks), got {self.head_dim}")

    @property
    def rope(self) -> RopeSpec:
        return RopeSpec("neox", self.rope_theta)

    @classmethod
    def tiny(cls, seed: int = 0) -> "ModelConfig":
        """A 2-layer model for tests and ``--quick`` runs."""
        return cls(vocab_size=256, d_model=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                   ffn_dim=256, seed=seed)


def cache_shape(cfg: ModelConfig) -> GroupSpec:
    """The model's KV geometry as a jmixedkv `GroupSpec`."""
    return GroupSpec(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)


# ---------------------------------------------------------------------------------------------- cache session
def has_fused_attention() -> bool:
    """True when `jmixedkv.attention.decode_attention` (the fused decode kernel's entry point) is importable."""
    try:
        from .attention import decode_attention  # noqa: F401
    except ImportError:
        return False
    return True


class CacheSession:
    """Trace-time helper threading a `CacheState` through one forward pass (not a pytree; lives in one trace).

    ``attend(layer, q, k, v, positions)`` appends ``k, v [B, T, H, D]`` at ``positions i32[B, T]`` and returns
    the attention output ``f32[B, T, Hq, D]`` over the whole cache of each sequence (causal)."""

    def __init__(self, state, seq_slots, attention: str = "auto", record: bool = False):
        self.state, self.seq_slots, self.attention = state, seq_slots, attention
        self.outputs = [] if record else None

    def attend(self, layer: int, q, k, v, positions):
        b, t, h, d = k.shape
        seq = jnp.repeat(self.seq_slots, t)
        self.state = append(self.state, k.reshape(b * t, h, d), v.reshape(b * t, h, d), seq,
                            positions.reshape(-1), layer=layer)
        dtype = self.state.config.attention_dtype
        q = q.astype(dtype)             # readers take queries in the attention dtype (as the fused kernel does)
        if t == 1 and self.attention != "reference" and has_fused_attention():
            from .attention import decode_attention
            backend = "pallas" if self.attention == "fused" else "auto"
            out, _ = decode_attention(self.state, layer, q, self.seq_slots, backend=backend)
        else:
            staged = stage_reference(self.state, layer, self.seq_slots)     # [B, kv, H, S, D]
            out, _ = attention_reference(q, staged[:, 0], staged[:, 1], self.state.kv_lens[self.seq_slots])
        out = out.astype(dtype).astype(jnp.float32)
        if self.outputs is not None:
            self.outputs.append(out)
        return out


class DenseSession:
    """Cache-free causal attention over the tokens of one call (used for ``init`` and as a sanity oracle)."""

    def attend(self, layer, q, k, v, positions):
        kv_lens = jnp.full((q.shape[0],), q.shape[1], jnp.int32)
        out, _ = attention_reference(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), kv_lens)
        return out


# ---------------------------------------------------------------------------------------------- the model
class RMSNorm(nn.Module):
    eps: float = 1e-6

    @nn.compact
    def __call__(self, x):
        w = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps) * w


def _dense(features, fan_in, gain=1.0, name=None):
    return nn.Dense(features, use_bias=False, name=name,
                    kernel_init=nn.initializers.normal(stddev=gain / fan_in ** 0.5))


class Attention(nn.Module):
    cfg: ModelConfig
    layer: int

    @nn.compact
    def __call__(self, x, positions, session):
        c = self.cfg
        b, t, _ = x.shape
        # q.k ~ qk_gain**2 * D before the 1/sqrt(D) scale: logits std ~ qk_gain**2
        q = _dense(c.num_heads * c.head_dim, c.d_model, c.qk_gain, "q")(x).reshape(b, t, c.num_heads, c.head_dim)
        k = _dense(c.num_kv_heads * c.head_dim, c.d_model, c.qk_gain, "k")(x).reshape(
            b, t, c.num_kv_heads, c.head_dim)
        v = _dense(c.num_kv_heads * c.head_dim, c.d_model, 1.0, "v")(x).reshape(b, t, c.num_kv_heads, c.head_dim)
        q = apply_rope(q, positions, c.rope)
        k = apply_rope(k, positions, c.rope)
        out = session.attend(self.layer, q, k, v, positions)
        return _dense(c.d_model, c.num_heads * c.head_dim, 1.0, "o")(out.reshape(b, t, -1))


class MLP(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        gate = _dense(c.ffn_dim, c.d_model, 1.0, "gate")(x)
        up = _dense(c.ffn_dim, c.d_model, 1.0, "up")(x)
        return _dense(c.d_model, c.ffn_dim, 1.0, "down")(nn.silu(gate) * up)


class Block(nn.Module):
    cfg: ModelConfig
    layer: int

    @nn.compact
    def __call__(self, x, positions, session):
        x = x + Attention(self.cfg, self.layer, name="attn")(RMSNorm(name="attn_norm")(x), positions, session)
        return x + MLP(self.cfg, name="mlp")(RMSNorm(name="mlp_norm")(x))


class Decoder(nn.Module):
    """``tokens i32[B, T]``, ``positions i32[B, T]``, a session -> logits ``f32[B, T, V]``."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens, positions, session):
        c = self.cfg
        x = nn.Embed(c.vocab_size, c.d_model, embedding_init=nn.initializers.normal(1.0), name="embed")(tokens)
        for layer in range(c.num_layers):
            x = Block(c, layer, name=f"block{layer}")(x, positions, session)
        x = RMSNorm(name="final_norm")(x)
        return _dense(c.vocab_size, c.d_model, c.logit_gain, "lm_head")(x)


def init_params(cfg: ModelConfig):
    """Deterministic float32 parameters from ``cfg.seed``."""
    tokens = jnp.zeros((1, 4), jnp.int32)
    positions = jnp.arange(4, dtype=jnp.int32)[None]
    return Decoder(cfg).init(jax.random.PRNGKey(cfg.seed), tokens, positions, DenseSession())


# ---------------------------------------------------------------------------------------------- generation
@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """Outputs of one generation.

    tokens: i32[B, N] greedy tokens (under teacher forcing: the argmax at each step, not the fed tokens).
    logits: f32[B, N, V] logits that produced each new token.
    attn: f32[B, N, L, Hq, D] every layer's attention output at each step (step 0 = last prompt token).
    state: the final `CacheState` (all ``P + N - 1`` fed tokens appended).
    """

    tokens: jax.Array
    logits: jax.Array
    attn: jax.Array
    state: object


jax.tree_util.register_dataclass(GenerationResult, data_fields=["tokens", "logits", "attn", "state"],
                                 meta_fields=[])


def _pages_needed(total: int, page: int) -> int:
    return -(-total // page)


def _generate_impl(params, prompts, teacher, forced, *, model_cfg: ModelConfig, cache_cfg: KVCacheConfig,
                   num_new: int, attention: str):
    """The traced body: prefill the prompts, then ``num_new - 1`` decode steps in a ``fori_loop``."""
    b, p = prompts.shape
    total = p + num_new
    max_pages = _pages_needed(total, cache_cfg.page_size)
    state = init_state(cache_cfg, cache_shape(model_cfg), num_pages=b * max_pages, max_seqs=b,
                       max_pages_per_seq=max_pages)
    slots = jnp.arange(b, dtype=jnp.int32)
    state = jax.lax.fori_loop(0, b, lambda i, s: admit(s, i), state)
    model = Decoder(model_cfg)

    def forward(state, tokens, positions):
        session = CacheSession(state, slots, attention, record=True)
        logits = model.apply(params, tokens, positions, session)
        attn = jnp.stack([o[:, -1] for o in session.outputs], axis=1)        # [B, L, Hq, D] last token
        return session.state, logits[:, -1].astype(jnp.float32), attn

    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    state, logits0, attn0 = forward(state, prompts, positions)
    vocab = logits0.shape[-1]
    tokens = jnp.zeros((b, num_new), jnp.int32).at[:, 0].set(jnp.argmax(logits0, -1).astype(jnp.int32))
    all_logits = jnp.zeros((b, num_new, vocab), jnp.float32).at[:, 0].set(logits0)
    all_attn = jnp.zeros((b, num_new) + attn0.shape[1:], jnp.float32).at[:, 0].set(attn0)

    def step(i, carry):
        state, tokens, all_logits, all_attn = carry
        fed = jnp.where(forced, teacher[:, i - 1], tokens[:, i - 1])
        pos = jnp.full((b, 1), p + i - 1, jnp.int32)
        state, logits, attn = forward(state, fed[:, None], pos)
        tokens = tokens.at[:, i].set(jnp.argmax(logits, -1).astype(jnp.int32))
        return state, tokens, all_logits.at[:, i].set(logits), all_attn.at[:, i].set(attn)

    state, tokens, all_logits, all_attn = jax.lax.fori_loop(1, num_new, step, (state, tokens, all_logits, all_attn))
    return GenerationResult(tokens, all_logits, all_attn, state)


def build_generate(model_cfg: ModelConfig, cache_cfg: KVCacheConfig, num_new: int, attention: str = "auto",
                   wrap: Optional[Callable] = None):
    """Jitted ``fn(params, prompts i32[B, P], teacher i32[B, N], forced bool[]) -> GenerationResult``.

    ``forced=True`` feeds ``teacher[:, i-1]`` at step ``i`` (teacher forcing) instead of the model's own
    previous token; both modes share one compiled program. ``wrap`` (tests) wraps the traced function before
    ``jax.jit``, e.g. ``chex.assert_max_traces(n=1)``."""
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
    if attention == "fused" and not has_fused_attention():
        raise ValueError("attention='fused' needs jmixedkv.attention.decode_attention, which is not importable")
    if num_new < 1:
        raise ValueError(f"num_new must be >= 1, got {num_new}")
    if wrap is None:
        return _cached_generate(model_cfg, cache_cfg, num_new, attention)

    def fn(params, prompts, teacher, forced):
        return _generate_impl(params, prompts, teacher, forced, model_cfg=model_cfg, cache_cfg=cache_cfg,
                              num_new=num_new, attention=attention)
    return jax.jit(wrap(fn))


@functools.lru_cache(maxsize=64)
def _cached_generate(model_cfg, cache_cfg, num_new, attention):
    """One jitted program per (model, cache config, num_new, attention): repeated calls reuse its compilation."""
    return jax.jit(functools.partial(_generate_impl, model_cfg=model_cfg, cache_cfg=cache_cfg, num_new=num_new,
                                     attention=attention))


def generate(params, prompts, model_cfg: ModelConfig, cache_cfg: KVCacheConfig, num_new: int,
             teacher=None, attention: str = "auto") -> GenerationResult:
    """One-shot convenience wrapper around `build_generate` (compiles on every new shape / config)."""
    prompts = jnp.asarray(prompts, jnp.int32)
    if prompts.ndim != 2 or prompts.shape[1] < 1:
        raise ValueError(f"prompts must be i32[B, P] with P >= 1, got shape {prompts.shape}")
    if int(jnp.max(prompts)) >= model_cfg.vocab_size or int(jnp.min(prompts)) < 0:
        raise ValueError(f"prompt tokens must lie in [0, {model_cfg.vocab_size}), got "
                         f"[{int(jnp.min(prompts))}, {int(jnp.max(prompts))}]")
    forced = teacher is not None
    teacher = jnp.zeros((prompts.shape[0], num_new), jnp.int32) if teacher is None else jnp.asarray(teacher, jnp.int32)
    if teacher.shape != (prompts.shape[0], num_new):
        raise ValueError(f"teacher must be i32[B={prompts.shape[0]}, N={num_new}], got {teacher.shape}")
    fn = build_generate(model_cfg, cache_cfg, num_new, attention)
    return fn(params, prompts, teacher, jnp.asarray(forced))
