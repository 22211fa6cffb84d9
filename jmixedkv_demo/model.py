"""A small Llama-style decoder (Flax linen) whose attention reads and writes through a jmixedkv cache, and a
jit-compiled generation loop (prefill, then greedy decode in ``lax.fori_loop``).

Model: token embedding, ``num_layers`` pre-norm blocks (RMSNorm, GQA attention with NeoX RoPE, SwiGLU MLP), a
final RMSNorm and an untied output head. Weights are deterministic from a seed. Because the weights are random,
the init is scaled so the model is not flat: attention logits have a standard deviation of about ``qk_gain**2``
(1 by default: attention is neither uniform, which would average cache errors away, nor one-hot, which would
make any error flip the output) and output logits have a standard deviation of about ``logit_gain`` (4: greedy
argmax has a real margin), which makes token agreement with the bf16 run informative.

Weights: float32 by default; with ``init_params(cfg, "bfloat16")`` (or `cast_weights`) every weight matrix
(projections, embedding, output head) is stored in bfloat16 and each projection multiplies bfloat16 operands with
float32 accumulation (`project`: the activation is rounded, the weight never converted); activations, the residual
stream, norms, RoPE and softmax stay float32, as in a bf16 serving engine.

RoPE is applied **in the model** to q and k (`jmixedkv.apply_rope`, float32, no FMA) and K is appended already
rotated (``append(..., rope=None)``), so every cache dtype sees the same rows.

Cache I/O: each layer appends its K/V with `jmixedkv.append(state, k, v, seq_slots, positions, layer=l)` and
attends over what the cache gives back: with ``attention="auto"`` or ``"fused"``, single-token decode steps use
`jmixedkv.decode.decode_attention` (the fused kernel) and prefill uses `jmixedkv.prefill.chunk_attention` (cuDNN
on a GPU, else a blocked flash, over the staged cache: memory linear in the prompt); ``attention="reference"``
stages the cache with `stage_reference` and runs `attention_reference` (float32, causal, dense ``[T, S]``
logits). Every path takes queries in the cache's attention dtype and rounds the output to it (the fused kernel's
contract), so they agree up to accumulation order and the rounding of the probabilities. The `CacheState` is
carried through the loop, so the whole generation (prefill + decode) is one compiled program per cache config;
`build_generate` caches it.

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

from jmixedkv import levers, numerics
from jmixedkv.config import KVCacheConfig
from jmixedkv.decode import attention_reference
from jmixedkv.staging import stage_reference
from jmixedkv.pools import pytree
from jmixedkv.rope import RopeSpec, apply_rope
from jmixedkv.state import GroupSpec, admit, append, init_state

__all__ = ["ModelConfig", "Decoder", "init_params", "WEIGHTS_DTYPES", "cast_weights", "project", "Linear",
           "GenerationResult", "build_generate", "generate",
           "cache_shape", "exact_prefill", "score_decode", "sim_knobs", "calibrate",
           "token_metrics", "SimulatedDecodeSession"]

ATTENTION_MODES = ("auto", "fused", "reference")
#: dtypes of the weight matrices (projections, embedding, output head); norm scales stay float32
WEIGHTS_DTYPES = ("float32", "bfloat16")


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
    rms_eps: float = 1e-6
    tie_embeddings: bool = False
    max_len: Optional[int] = None

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
class CacheSession:
    """Trace-time helper threading a `CacheState` through one forward pass (not a pytree; lives in one trace).

    ``attend(layer, q, k, v, positions)`` appends ``k, v [B, T, H, D]`` at ``positions i32[B, T]`` and returns
    the attention output ``f32[B, T, Hq, D]`` over the whole cache of each sequence (causal; also in ``outputs``).
    ``attention``: ``"auto"`` / ``"fused"`` read through the kernels -- `decode_attention` for one token,
    `jmixedkv.prefill.chunk_attention` (cuDNN or a blocked flash, memory linear in the chunk) for a prefill -- and
    ``"reference"`` through dense float32 `attention_reference` over `stage_reference` (``[B, H, T, S]`` logits:
    small sizes only). The levers are the cache's: ``append`` rotates and K-smooths (the cache holds each
    sequence's K mean, `jmixedkv.levers`), the readers undo them."""

    def __init__(self, state, seq_slots, attention: str = "auto"):
        self.state, self.seq_slots, self.attention = state, seq_slots, attention
        self.outputs = []

    def attend(self, layer: int, q, k, v, positions):
        b, t, h, d = k.shape
        cfg = self.state.config
        seq = jnp.repeat(self.seq_slots, t)
        self.state = append(self.state, layer, k.reshape(b * t, h, d), v.reshape(b * t, h, d), seq,
                            positions.reshape(-1))     # the levers (rotation, K smoothing) are applied by append
        dtype = cfg.attention_dtype
        # readers take queries in the attention dtype (as the fused kernel does)
        if t == 1 and self.attention != "reference":
            from jmixedkv.decode import decode_attention
            backend = "pallas" if self.attention == "fused" else "auto"
            # model-space q and output: a rotation lever is applied and undone inside `decode_attention`
            out, _ = decode_attention(self.state, layer, q.astype(dtype), self.seq_slots, backend=backend)
            out = out.astype(dtype).astype(jnp.float32)
        elif self.attention != "reference":
            from jmixedkv.prefill import chunk_attention
            backend = "pallas" if self.attention == "fused" else "auto"
            # prefill / chunk: cuDNN or a blocked flash over the staged cache, memory linear in the chunk (model space)
            out, _ = chunk_attention(self.state, layer, q.astype(dtype), self.seq_slots, positions, backend=backend)
            out = out.astype(jnp.float32)
        else:
            # the rows as stored (rotated by a rotation lever): q rotated like the stored K, the output un-rotated
            # (the Hadamard is its own inverse), as `SimulatedDecodeSession` computes
            q = levers.rotate(q, cfg.rotation).astype(dtype)
            staged = stage_reference(self.state, layer, self.seq_slots, as_stored=True)     # [B, kv, H, S, D]
            out, _ = attention_reference(q, staged[:, 0], staged[:, 1], self.state.kv_lens[self.seq_slots])
            out = levers.rotate(out.astype(dtype).astype(jnp.float32), cfg.rotation)
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


def project(x, w):
    """``x f32[..., K] @ w [K, N] -> f32[..., N]``, a projection in the weights' dtype.

    float32 ``w``: a float32 product (`flax.linen.Dense`'s ``dot_general``). bfloat16 ``w``: ``x`` rounded to
    bfloat16, bf16 x bf16 operands, float32 accumulation and result (``preferred_element_type``); the weight
    matrix itself is never converted."""
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    if w.dtype == jnp.float32:
        return jax.lax.dot_general(x, w, dims)
    return jax.lax.dot_general(x.astype(w.dtype), w, dims, preferred_element_type=jnp.float32)


class Linear(nn.Module):
    """A bias-free projection ``f32[..., K] -> f32[..., features]`` through `project`; param ``kernel
    f32[K, features]`` ~ N(0, ``stddev``) at init (`cast_weights` gives it another dtype)."""

    features: int
    stddev: float

    @nn.compact
    def __call__(self, x):
        w = self.param("kernel", nn.initializers.normal(stddev=self.stddev), (x.shape[-1], self.features),
                       jnp.float32)
        return project(x, w)


def _dense(features, fan_in, gain=1.0, name=None):
    return Linear(features, gain / fan_in ** 0.5, name=name)


class Attention(nn.Module):
    cfg: ModelConfig
    layer: int

    @nn.compact
    def __call__(self, x, positions, session):
        c = self.cfg
        b, t, _ = x.shape
        proj = lambda heads, gain, name: _dense(heads * c.head_dim, c.d_model, gain, name)(x).reshape(  # noqa: E731
            b, t, heads, c.head_dim)
        # q.k ~ qk_gain**2 * D before the 1/sqrt(D) scale: logits std ~ qk_gain**2
        q = apply_rope(proj(c.num_heads, c.qk_gain, "q"), positions, c.rope)
        k = apply_rope(proj(c.num_kv_heads, c.qk_gain, "k"), positions, c.rope)
        v = proj(c.num_kv_heads, 1.0, "v")
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
        eps = self.cfg.rms_eps
        x = x + Attention(self.cfg, self.layer, name="attn")(RMSNorm(eps, name="attn_norm")(x), positions, session)
        return x + MLP(self.cfg, name="mlp")(RMSNorm(eps, name="mlp_norm")(x))


class Decoder(nn.Module):
    """``tokens i32[B, T]``, ``positions i32[B, T]``, a session -> logits ``f32[B, T, V]`` (``last_only``:
    ``f32[B, 1, V]``, the last token's only: a long prefill need not build ``T x V`` logits)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens, positions, session, last_only: bool = False):
        c = self.cfg
        embed = nn.Embed(c.vocab_size, c.d_model, embedding_init=nn.initializers.normal(1.0), name="embed")
        x = embed(tokens).astype(jnp.float32)         # the gathered rows only (bfloat16 weights)
        for layer in range(c.num_layers):
            x = Block(c, layer, name=f"block{layer}")(x, positions, session)
        if last_only:
            x = x[:, -1:]
        x = RMSNorm(c.rms_eps, name="final_norm")(x)
        if c.tie_embeddings:              # output head = token embedding (SmolLM2 / GGUF without output.weight)
            return project(x, embed.embedding.T)
        return _dense(c.vocab_size, c.d_model, c.logit_gain, "lm_head")(x)


def _check_weights_dtype(weights_dtype: str) -> None:
    if weights_dtype not in WEIGHTS_DTYPES:
        raise ValueError(f"weights_dtype must be one of {WEIGHTS_DTYPES}, got {weights_dtype!r}")


def _cast_leaf(name, x, dtype):
    """A parameter named ``name`` in ``dtype`` when it is a weight matrix (``kernel``, ``embedding``), else as is."""
    return x.astype(dtype) if name in ("kernel", "embedding") else x


def cast_weights(params, weights_dtype: str):
    """``params`` (an `init_params` tree, blocks not stacked) with every weight matrix (``kernel``,
    ``embedding``) in ``weights_dtype`` (round to nearest even); norm scales stay float32."""
    _check_weights_dtype(weights_dtype)
    dtype = jnp.dtype(weights_dtype)
    return jax.tree_util.tree_map_with_path(lambda path, x: _cast_leaf(getattr(path[-1], "key", None), x, dtype),
                                            params)


def init_params(cfg: ModelConfig, weights_dtype: str = "float32"):
    """Deterministic parameters from ``cfg.seed``: float32, or with ``weights_dtype="bfloat16"`` the float32
    parameters with every weight matrix rounded to bfloat16 (`cast_weights`), one matrix at a time (at the peak
    the float32 set plus one bfloat16 matrix)."""
    _check_weights_dtype(weights_dtype)
    tokens = jnp.zeros((1, 4), jnp.int32)
    positions = jnp.arange(4, dtype=jnp.int32)[None]
    params = Decoder(cfg).init(jax.random.PRNGKey(cfg.seed), tokens, positions, DenseSession())
    if weights_dtype == "float32":
        return params
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    del params
    names = [getattr(path[-1], "key", None) for path, _ in flat]
    leaves = [x for _, x in flat]
    del flat
    for i, name in enumerate(names):          # each float32 matrix is freed as its bfloat16 copy replaces it
        leaves[i] = _cast_leaf(name, leaves[i], jnp.dtype(weights_dtype))
    return jax.tree_util.tree_unflatten(treedef, leaves)


# ---------------------------------------------------------------------------------------------- generation
@pytree()
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


def with_scales(state, scales):
    """``state`` with traced per-layer K/V scales in its pools (``init_state`` takes only concrete ones):
    ``scales["gs"] f32[L, 2]`` -> NVFP4 decode global scale, ``scales["high"] f32[L, 2]`` -> FP8 twin / plain
    scale (ignored by bf16 / fp16 pools). Call it before anything is appended."""
    from jmixedkv.pools import GroupPools
    rep_ = lambda pool, f, x: None if pool is None else dataclasses.replace(  # noqa: E731
        pool, **{f: jnp.broadcast_to(jnp.asarray(x, jnp.float32), getattr(pool, f).shape)})
    return dataclasses.replace(state, pools=tuple(
        GroupPools(rep_(gp.low, "gs", scales["gs"]), rep_(gp.high, "scale", scales["high"]),
                   rep_(gp.plain, "scale", scales["high"])) for gp in state.pools))


def _generate_impl(params, prompts, teacher, forced, scales=None, *, model_cfg: ModelConfig,
                   cache_cfg: KVCacheConfig, num_new: int, attention: str):
    """The traced body: prefill the prompts, then ``num_new - 1`` decode steps in a ``fori_loop``.

    ``scales`` (optional, see `calibrate`): ``{"gs": f32[L, 2], "high": f32[L, 2]}`` NVFP4 global / FP8 scales."""
    b, p = prompts.shape
    total = p + num_new
    max_pages = -(-total // cache_cfg.page_size)
    state = init_state(cache_cfg, cache_shape(model_cfg), num_pages=b * max_pages, max_seqs=b,
                       max_pages_per_seq=max_pages)
    if scales is not None:
        state = with_scales(state, scales)
    slots = jnp.arange(b, dtype=jnp.int32)
    state = jax.lax.fori_loop(0, b, lambda i, s: admit(s, i), state)
    stacked = _stack_blocks(params, model_cfg)

    def forward(state, tokens, positions):
        """``(state', last-token logits f32[B, V], attention outputs f32[B, L, Hq, D] of the last token)``."""
        def emit(s):
            return s.state, s.outputs[0][:, -1]
        logits, state, attn = _scan_layers(
            params, model_cfg, tokens, positions, emit=emit, carry=state, last_only=True, stacked=stacked,
            make_session=lambda layer, st: CacheSession(st, slots, attention))
        return state, logits[:, -1].astype(jnp.float32), jnp.swapaxes(attn, 0, 1)

    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    state, logits0, attn0 = forward(state, prompts, positions)      # the cache freezes K means (k_smoothing)
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


class _AtLayer:
    """Session proxy for one scanned block: the block's static layer index is replaced by the traced one."""

    def __init__(self, session, layer):
        self.session, self.layer = session, layer

    def attend(self, _static_layer, q, k, v, positions):
        return self.session.attend(self.layer, q, k, v, positions)


def _stack_blocks(params, cfg: ModelConfig):
    """Per-block parameter trees stacked along a leading layer axis (for ``lax.scan`` over layers)."""
    p = params["params"]
    return jax.tree.map(lambda *xs: jnp.stack(xs), *[p[f"block{l}"] for l in range(cfg.num_layers)])


def build_generate(model_cfg: ModelConfig, cache_cfg: KVCacheConfig, num_new: int, attention: str = "auto",
                   wrap: Optional[Callable] = None):
    """Jitted ``fn(params, prompts i32[B, P], teacher i32[B, N], forced bool[], scales=None) -> GenerationResult``.

    ``forced=True`` feeds ``teacher[:, i-1]`` at step ``i`` (teacher forcing) instead of the model's own
    previous token; both modes share one compiled program. ``wrap`` (tests) wraps the traced function before
    ``jax.jit``, e.g. ``chex.assert_max_traces(n=1)``."""
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
    if num_new < 1:
        raise ValueError(f"num_new must be >= 1, got {num_new}")
    if wrap is None:
        return _cached_generate(model_cfg, cache_cfg, num_new, attention)

    def fn(params, prompts, teacher, forced, scales=None):
        return _generate_impl(params, prompts, teacher, forced, scales, model_cfg=model_cfg, cache_cfg=cache_cfg,
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


# ---------------------------------------------------------------------------------------------- teacher-forced eval
# Teacher-forced accuracy over a long text without running thousands of decode steps one by one: the text's first
# ``P`` tokens are prefilled exactly (float32 attention over unquantized K/V, as a serving engine's context phase
# attends over the fresh K/V of the chunk), their K/V recorded; then the next ``T`` tokens are scored in ONE
# forward in which the query at position ``t`` sees, for every key ``j <= t``, exactly what the cache serves at the
# decode step of length ``n = t + 1``: the high (twin) row where ``j`` is retained (``j < first_n`` or
# ``n - last_n <= j < n``), the dequantized NVFP4 row elsewhere (or the plain pool's row). The rows go through the
# cache's own codec functions (`nvfp4.quantize_reference` / `dequantize_reference`, `jmixedkv.pools.encode_rows` /
# `decode_rows`) with per-layer K/V scales calibrated on the prefix (NVFP4 ``gs = amax / 2688``, FP8
# ``amax / 448``), queries and outputs are rounded to the attention dtype and the levers are applied as
# `CacheSession` applies them, so this equals ``T`` teacher-forced decode steps of `build_generate` after an exact
# prefill (tests/test_levers.py checks it against the real cache). One program per (high dtype, attention dtype):
# first_n / last_n / levers are data.

@functools.lru_cache(maxsize=8)
def _prefill_fn(model_cfg: ModelConfig):
    class Recorder:
        """Exact causal attention in query chunks of ``CHUNK`` (keys up to the chunk's end only: half the work of
        a masked dense pass, and no ``T x T`` logits in memory); records K/V (one block: one call)."""

        CHUNK = 512

        def attend(self, layer, q, k, v, positions):
            self.kv = (k.astype(jnp.float32), v.astype(jnp.float32))
            t, outs = q.shape[1], []
            for lo in range(0, t, self.CHUNK):
                hi_ = min(lo + self.CHUNK, t)
                out, _ = attention_reference(q[:, lo:hi_], jnp.swapaxes(k[:, :hi_], 1, 2),
                                             jnp.swapaxes(v[:, :hi_], 1, 2),
                                             jnp.full((q.shape[0],), hi_, jnp.int32))
                outs.append(out)
            return jnp.concatenate(outs, axis=1)

    def fn(params, tokens):
        pos = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        logits, _, (k, v) = _scan_layers(params, model_cfg, tokens, pos, lambda layer, _: Recorder(),
                                         lambda r: (None, r.kv), last_only=True)
        return {"k": k, "v": v}, logits[:, -1].astype(jnp.float32)
    return jax.jit(fn)


def _scan_layers(params, cfg: ModelConfig, tokens, positions, make_session, emit, carry=None, last_only=False,
                 stacked=None):
    """`Decoder` with a ``lax.scan`` over layers (one traced block instead of ``L``: compile time independent of
    depth; the same operations as the unrolled `Decoder`). ``make_session(layer, carry)`` (traced layer) gives
    the attention session of a block, ``emit(session) -> (carry', out)`` what goes on to the next block and what
    to stack over layers; ``stacked``: `_stack_blocks` of ``params`` when already built. Returns ``(logits, carry,
    stacked outs)``."""
    p = params["params"]
    x = jnp.take(p["embed"]["embedding"], tokens, axis=0).astype(jnp.float32)

    def body(xc, xs):
        x, c = xc
        block_params, layer = xs
        session = make_session(layer, c)
        x = Block(cfg, 0).apply({"params": block_params}, x, positions, _AtLayer(session, layer))
        c, out = emit(session)
        return (x, c), out

    blocks = _stack_blocks(params, cfg) if stacked is None else stacked
    (x, carry), out = jax.lax.scan(body, (x, carry), (blocks, jnp.arange(cfg.num_layers)))
    if last_only:
        x = x[:, -1:]
    x = RMSNorm(cfg.rms_eps).apply({"params": p["final_norm"]}, x)
    logits = project(x, p["embed"]["embedding"].T if cfg.tie_embeddings else p["lm_head"]["kernel"])
    return logits, carry, out


def exact_prefill(params, model_cfg: ModelConfig, tokens):
    """Exact (float32, cache-free) causal forward of ``tokens i32[B, P]``.

    Returns ``(prefix, last_logits)``: ``prefix = {"k": f32[L, B, P, H, D] (post-RoPE), "v": f32[L, B, P, H, D]}``
    and ``f32[B, V]`` logits of the last token."""
    return _prefill_fn(model_cfg)(params, jnp.asarray(tokens, jnp.int32))


def _sim_kind(cache_cfg: KVCacheConfig):
    """(high storage dtype name, attention dtype name): the static part of a simulated cache."""
    high = cache_cfg.high_dtype
    high = "bfloat16" if high is None else jnp.dtype(high).name        # nvfp4: the twin is never selected
    return high, jnp.dtype(cache_cfg.attention_dtype).name, cache_cfg.block_scale


def sim_knobs(cache_cfg: KVCacheConfig, model_cfg: ModelConfig) -> dict:
    """The data part of a simulated cache: ``first_n`` / ``last_n`` of the high view (everything for plain row
    caches, nothing for ``nvfp4``), the rotation matrix (identity when off) and the K-smoothing switch."""
    # mixed: its window; nvfp4: nothing high; plain row caches: every row "first"
    fn, ln = ((cache_cfg.first_n, cache_cfg.last_n) if cache_cfg.is_mixed else (0, 0) if cache_cfg.has_low
              else (1 << 30, 0))
    d = model_cfg.head_dim
    rot = levers.hadamard(d) if cache_cfg.rotation else jnp.eye(d, dtype=jnp.float32)
    return {"first_n": jnp.int32(fn), "last_n": jnp.int32(ln), "rot": rot,
            "smooth": jnp.float32(1.0 if cache_cfg.k_smoothing else 0.0)}


def _views(rows, high_dtype, attn_dtype, gs, hs, block_scale="max6"):
    """(low view, high view) of rows ``f32[..., 2, H, D]`` as the cache serves them (attention dtype)."""
    from jmixedkv import nvfp4
    from jmixedkv.pools import decode_rows, encode_rows
    data, sc = nvfp4.quantize_reference(rows, gs[:, None], block_scale)
    low = nvfp4.dequantize_reference(data, sc, gs[:, None], attn_dtype)
    high = decode_rows(encode_rows(rows, high_dtype, hs), hs, attn_dtype)
    return low, high


def calibrate(prefix, knobs):
    """Per-layer K/V scales from the prefix rows after the levers: ``{"gs": f32[L, 2], "high": f32[L, 2]}``
    (NVFP4 decode global scale ``amax / 2688``, FP8 scale ``amax / 448``; 1.0 where amax is 0)."""
    from jmixedkv import nvfp4
    k = prefix["k"] - knobs["smooth"] * jnp.mean(prefix["k"], axis=2, keepdims=True)
    rot = knobs["rot"]
    hi = jax.lax.Precision.HIGHEST
    amax = jnp.stack([jnp.max(jnp.abs(jnp.einsum("...d,de->...e", x, rot, precision=hi)), axis=(1, 2, 3, 4))
                      for x in (k, prefix["v"])], axis=1)                      # [L, 2]
    ok = amax > 0
    return {"gs": nvfp4.global_scale_from_amax(amax), "high": jnp.where(ok, amax / numerics.E4M3_MAX, 1.0)}


class SimulatedDecodeSession:
    """Scores ``T`` new tokens at positions ``P..P+T-1`` in one pass, each query seeing the cache of its own decode
    step (see the section comment). ``prefix`` from `exact_prefill`, ``knobs`` from `sim_knobs`, ``scales`` from
    `calibrate`. Records every layer's attention output ``f32[B, T, Hq, D]`` in ``outputs`` (what `emitted`
    returns). `views` and `retained` are the two places a study varies the cache (a subclass overrides them)."""

    def __init__(self, prefix, knobs, scales, high_dtype, attn_dtype, block_scale="max6"):
        self.prefix, self.knobs, self.scales, self.block_scale = prefix, knobs, scales, block_scale
        self.high_dtype, self.attn_dtype = jnp.dtype(high_dtype), jnp.dtype(attn_dtype)
        self.outputs, self.weights = [], None

    def views(self, layer, rows):
        """(low view, high view) of one layer's rows ``f32[B, S, 2, H, D]`` (after the levers) as the cache serves
        them: NVFP4 per token / the twin's dtype (`_views`)."""
        return _views(rows, self.high_dtype, self.attn_dtype, self.scales["gs"][layer], self.scales["high"][layer],
                      self.block_scale)

    def retained(self, layer, ret):
        """Which rows a query reads from the twin: ``ret bool[B, T, 1, 1, S]`` (``first_n`` / ``last_n`` of its
        step), broadcast against ``[B, T, H, G, S]``."""
        return ret

    def emitted(self):
        """What the layer scan stacks over layers for this session: its attention output."""
        return self.outputs[0]

    def attend(self, layer, q, k, v, positions):
        kn, hi = self.knobs, jax.lax.Precision.HIGHEST
        pk, pv = self.prefix["k"][layer], self.prefix["v"][layer]              # [B, P, H, D]
        b, t, h, d = k.shape
        p = pk.shape[1]
        mean = kn["smooth"] * jnp.mean(pk, axis=1, keepdims=True)              # frozen from the prefill
        keys = jnp.concatenate([pk, k.astype(jnp.float32)], axis=1) - mean
        vals = jnp.concatenate([pv, v.astype(jnp.float32)], axis=1)
        rows = jnp.einsum("bshd,de->bshe", jnp.stack([keys, vals], axis=2).reshape(b, p + t, 2 * h, d), kn["rot"],
                          precision=hi).reshape(b, p + t, 2, h, d)
        low, high = self.views(layer, rows)
        qr = jnp.einsum("bthd,de->bthe", q.astype(jnp.float32), kn["rot"], precision=hi)
        qr = qr.astype(self.attn_dtype).astype(jnp.float32).reshape(b, t, h, -1, d)
        scale = d ** -0.5
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        lg_lo = jnp.einsum("btkgd,bskd->btkgs", qr, f32(low[:, :, 0]), precision=hi) * scale
        lg_hi = jnp.einsum("btkgd,bskd->btkgs", qr, f32(high[:, :, 0]), precision=hi) * scale
        qpos = positions[:, :, None]                                           # [B, T, 1]
        j = jnp.arange(p + t)[None, None, :]
        n = qpos + 1
        retained = (j < kn["first_n"]) | ((j >= n - kn["last_n"]) & (j < n))
        causal = j <= qpos
        ret = self.retained(layer, retained[:, :, None, None, :])
        logits = jnp.where(causal[:, :, None, None, :], jnp.where(ret, lg_hi, lg_lo), -jnp.inf)
        w = self.weights = jax.nn.softmax(logits, axis=-1)                     # f32[B, T, H, G, S]
        out = (jnp.einsum("btkgs,bskd->btkgd", jnp.where(ret, w, 0.0), f32(high[:, :, 1]), precision=hi)
               + jnp.einsum("btkgs,bskd->btkgd", jnp.where(ret, 0.0, w), f32(low[:, :, 1]), precision=hi))
        out = out.reshape(b, t, -1, d).astype(self.attn_dtype).astype(jnp.float32)
        out = jnp.einsum("bthd,de->bthe", out, kn["rot"], precision=hi)        # un-rotate (self-inverse)
        self.outputs.append(out)
        return out


@functools.lru_cache(maxsize=16)
def _score_fn(model_cfg: ModelConfig, high_dtype: str, attn_dtype: str, block_scale: str, session=None):
    session = SimulatedDecodeSession if session is None else session

    def fn(params, prefix, tokens, knobs):
        scales = calibrate(prefix, knobs)
        p = prefix["k"].shape[2]
        pos = jnp.broadcast_to(p + jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        make = lambda layer, _: session(prefix, knobs, scales, high_dtype, attn_dtype, block_scale)  # noqa: E731
        logits, _, attn = _scan_layers(params, model_cfg, tokens, pos, make, lambda s: (None, s.emitted()))
        return logits.astype(jnp.float32), attn, scales
    return jax.jit(fn)


def score_decode(params, model_cfg: ModelConfig, cache_cfg: KVCacheConfig, prefix, tokens, session=None):
    """Teacher-forced decode of ``tokens i32[B, T]`` after the exact prefix, through a simulated ``cache_cfg``.

    ``session``: a `SimulatedDecodeSession` subclass (a study's variant of the cache; the class must be hashable
    and fixed: its compiled pass is cached by it). Returns ``(logits f32[B, T, V], attn, scales)``: ``attn`` what
    the session's `emitted` stacks over layers (by default f32[L, B, T, Hq, D]), ``scales`` from `calibrate`."""
    fn = _score_fn(model_cfg, *_sim_kind(cache_cfg), session)
    return fn(params, prefix, jnp.asarray(tokens, jnp.int32), sim_knobs(cache_cfg, model_cfg))


def token_metrics(logits, ref_logits, targets) -> dict:
    """Next-token metrics of ``logits f32[B, T, V]`` vs a reference run's, for ``targets i32[B, T]``.

    ``kl``: mean KL(reference || this) in nats; ``kl_per_position`` f32[T] (mean over B); ``nll`` / ``ppl`` of the
    targets; ``top1``: share of positions whose argmax equals the reference's."""
    import numpy as np
    lp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), -1)
    lr = jax.nn.log_softmax(jnp.asarray(ref_logits, jnp.float32), -1)
    kl = jnp.sum(jnp.exp(lr) * (lr - lp), -1)                                   # [B, T]
    nll = -jnp.take_along_axis(lp, jnp.asarray(targets)[..., None], -1)[..., 0]
    top1 = jnp.argmax(lp, -1) == jnp.argmax(lr, -1)
    return {"kl": float(jnp.mean(kl)), "kl_per_position": np.asarray(jnp.mean(kl, 0)).tolist(),
            "nll": float(jnp.mean(nll)), "ppl": float(jnp.exp(jnp.mean(nll))), "top1": float(jnp.mean(top1))}


def builtin_text(name: str) -> str:
    """A text shipped with the package (``jmixedkv_demo/data/NAME.txt``): ``"prose"`` (English prose paragraphs of the
    Python Language Reference, from CPython's ``pydoc_data``) or ``"code"`` (a snapshot of the jmixedkv library's Python
    source). Nothing is downloaded."""
    from importlib import resources
    path = resources.files("jmixedkv_demo").joinpath("data", f"{name}.txt")
    if not path.is_file():
        avail = sorted(p.name[:-4] for p in resources.files("jmixedkv_demo").joinpath("data").iterdir()
                       if p.name.endswith(".txt"))
        raise ValueError(f"unknown built-in text {name!r}; available: {avail}")
    return path.read_text(encoding="utf-8")


def evaluate_caches(params, model_cfg: ModelConfig, tokens, caches, prefix_len: int, progress=None) -> dict:
    """Teacher-forced accuracy of each cache against the first one (the bf16 baseline) on one token sequence.

    Args:
      tokens: ``i32[N]`` token ids; the first ``prefix_len`` are prefilled exactly, the next ``N - prefix_len - 1``
        are decode steps scored against their next token.
      caches: list of ``(label, KVCacheConfig)``; the first is the reference.
      progress: optional callable ``(label) -> None`` called before each cache.

    Returns a dict: ``prefix_len``, ``window``, ``seq_len`` (tokens in the cache at the last step), ``prefix`` (the
    exact prefill's K/V, see `exact_prefill`) and ``results``: per cache ``label``, ``config``, ``kl``,
    ``kl_per_position``, ``nll``, ``ppl``, ``top1``, ``attn_rel_err_per_layer`` (relative L2 error of each layer's
    attention output vs the reference, teacher-forced), ``seconds``.
    """
    import time
    import numpy as np
    toks = jnp.asarray(tokens, jnp.int32)[None]
    n = toks.shape[1]
    if not 1 <= prefix_len <= n - 2:
        raise ValueError(f"prefix_len must be in [1, {n - 2}] for {n} tokens, got {prefix_len}")
    if progress:
        progress("exact prefill")
    prefix, _ = exact_prefill(params, model_cfg, toks[:, :prefix_len])
    window, targets = toks[:, prefix_len:n - 1], toks[:, prefix_len + 1:]
    results, ref = [], None
    for label, cfg in caches:
        if progress:
            progress(label)
        t0 = time.perf_counter()
        logits, attn, _ = score_decode(params, model_cfg, cfg, prefix, window)
        logits = jax.block_until_ready(logits)
        if ref is None:
            ref = (logits, attn)
        m = token_metrics(logits, ref[0], targets)
        a, r = np.asarray(attn), np.asarray(ref[1])
        err = (np.linalg.norm((a - r).reshape(a.shape[0], -1), axis=-1)
               / np.maximum(np.linalg.norm(r.reshape(r.shape[0], -1), axis=-1), 1e-30))
        m.update(label=label, config=cfg, attn_rel_err_per_layer=err.tolist(),
                 seconds=time.perf_counter() - t0)
        results.append(m)
    return {"prefix_len": prefix_len, "window": n - 1 - prefix_len, "seq_len": n - 1, "results": results,
            "prefix": prefix}


def high_fraction(cfg: KVCacheConfig, seq_len: int) -> float:
    """Share of a ``seq_len``-token sequence's rows served by the twin (1 for bf16 / fp16 / fp8, 0 for nvfp4)."""
    if not cfg.is_mixed:
        return 0.0 if cfg.has_low else 1.0
    first = min(cfg.first_n, seq_len)
    return (first + min(cfg.last_n, seq_len - first)) / seq_len
