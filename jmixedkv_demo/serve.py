"""A continuous-batching serving loop over a fixed KV memory budget (greedy decoding, one program per shape bucket).

What a JAX serving engine does around a paged KV cache, small enough to copy:

* **Memory**: a KV budget in bytes becomes ``num_pages`` and ``max_seqs`` (`plan_pools`, from
  `jmixedkv.capacity`): the slots are what the budget holds at ``slot_len`` tokens per sequence, twin included
  (a mixed cache's per-sequence high pool is part of the budget), and the low pool gets the rest. The pools of the
  state actually allocated are measured (bytes of its arrays) and kept within the budget.
* **Admission** (`ServingLoop.run`): requests wait in a FIFO queue; the head is admitted while a slot is free
  and the pages of its whole life (prompt + max_new - 1 tokens) fit next to the pages every running sequence
  has reserved for its own whole life. No running sequence can then run out of pages, so there is no
  preemption. A request that can never fit (more pages than the pool or a sequence's page table) is refused
  before anything runs, by `CacheCapacityError` naming its lengths.
* **Prefill**: an admitted request is prefilled alone, in chunks of exact lengths: as many ``max_chunk`` chunks
  as fit, then the binary decomposition of the rest (powers of two, largest first), so no token is padded and
  the prefill programs are one per power of two up to ``max_chunk`` (`prefill_chunks`). Each chunk appends its
  K/V through the model's forward (`jmixedkv_demo.model.CacheSession`: the cache's own append and attention
  paths), attending to the earlier chunks through the cache.
* **Decode**: one jitted step over all ``max_seqs`` slots (inactive slots are padding rows: slot -1, nothing
  appended, attention output zero), greedy ``argmax`` on the device; the host reads the new tokens, releases a
  sequence at EOS or at ``max_new`` tokens (its pages return to the pool) and admits more.
* **Weights**: float32 or bfloat16 (`random_weights` / `load_serve_model` ``weights_dtype``; bfloat16: every
  projection multiplies bf16 operands with float32 accumulation, `jmixedkv_demo.model.project`); their bytes are
  reported next to the pools' (``weight_bytes``).
* Every program is compiled ahead of the timed run (`ServingLoop.compile`): one decode step and one prefill
  program per chunk length, per (model, cache config, attention, pool shapes, weight dtypes), shared by every loop
  of that config (`TRACES` / ``ServingLoop.traces`` count the traces). With prefix reuse a remainder's chunk length
  not met ahead is compiled when first met, its time excluded from the run's times.
* Host work per decode step: `CacheManager.reserve_append` checks and accounts the step's tokens (vectorized over
  the running slots, reported as ``host_ms``), then one device sync for the tokens.
* **Prefix reuse** (``prefix_reuse=True``, `jmixedkv.PrefixCache`), on the host at admission, between the jitted
  programs: the request's longest committed prefix (full pages, content-hashed) is admitted by reference
  (`PrefixCache.admit`, `jmixedkv.prefix.admit_with_prefix`) and only the rest of the prompt is prefilled; after
  its prefill the prompt's full pages are committed to the index. Reuse is capped so the first prefill chunk
  recomputes the Last-N window (`jmixedkv.prefix`'s rule). Pages: the index keeps committed pages after their
  request ends; they are evicted (dropped: no host tier) when a sequence needs pages. Admission counts the pages
  live sequences hold (a shared page once, and index pages that are prefixes of held ones) plus every running
  sequence's remaining growth plus the new request's pages not already held; index-only pages count as free
  (evictable). At the end of a run the index is emptied, so every page is back in the pool.

Shapes: ``S`` = ``max_seqs`` slots, ``P`` prompt tokens, ``T`` chunk tokens, ``V`` vocabulary.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import json
import time
from importlib import resources
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jmixedkv import capacity as cap
from jmixedkv.checks import CacheCapacityError, CacheError
from jmixedkv.config import KVCacheConfig
from jmixedkv.manager import CacheManager
from jmixedkv.placement import pack_on_device
from jmixedkv.prefix import PrefixCache
from jmixedkv.state import describe_error, init_state

from .model import (ATTENTION_MODES, WEIGHTS_DTYPES, CacheSession, ModelConfig, _scan_layers, _stack_blocks,
                    cache_shape, cast_weights, init_params)

__all__ = ["MODELS", "Request", "load_lengths", "sample_requests", "PoolPlan", "plan_pools", "prefill_chunks",
           "prepare_weights", "random_weights", "decode_step", "prefill_chunk", "TRACES", "ServingLoop", "ServeResult",
           "serve_caches", "serve_table", "SERVE_DEFAULTS", "SERVE_CACHES", "load_serve_model", "weight_bytes",
           "weights_dtype_of"]

#: model geometries of ``jmixedkv serve`` (random weights; ``smollm2`` is SmolLM2-135M's architecture)
MODELS = {
    "tiny": ModelConfig.tiny(),
    "smollm2": ModelConfig(vocab_size=49152, d_model=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                           ffn_dim=1536, rope_theta=100000.0, tie_embeddings=True),
    "llama3-8b-shape": ModelConfig(vocab_size=128256, d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                                   head_dim=128, ffn_dim=14336, rope_theta=500000.0),
}


# ---------------------------------------------------------------------------------------------- workload
@dataclasses.dataclass(frozen=True, eq=False)
class Request:
    """One request: ``prompt`` i32[P] token ids (P >= 1) and ``max_new`` >= 1 tokens to generate at most."""

    prompt: np.ndarray
    max_new: int

    @property
    def cache_len(self) -> int:
        """Tokens the cache holds when the request ends at ``max_new`` (the last token is never fed back)."""
        return len(self.prompt) + self.max_new - 1


def load_lengths() -> tuple[np.ndarray, np.ndarray]:
    """The shipped length distribution ``jmixedkv_demo/data/lengths.json``: ``(prompt_tokens i64[512],
    output_tokens i64[512])``; prompts lognormal (median 12000, sigma 0.5) clipped to [4096, 32768], outputs
    lognormal (median 192, sigma 0.5) clipped to [64, 512] (the file holds its recipe)."""
    doc = json.loads(resources.files("jmixedkv_demo").joinpath("data", "lengths.json").read_text())
    return np.asarray(doc["prompt_tokens"], np.int64), np.asarray(doc["output_tokens"], np.int64)


def sample_requests(n: int, vocab_size: int, *, seed: int = 0, prompt_scale: float = 1.0,
                    output_scale: float = 1.0, prompt_range: Optional[tuple[int, int]] = None,
                    prompt_multiple: int = 1, shared_prefix: int = 0) -> list[Request]:
    """``n`` requests with (prompt, output) lengths drawn from `load_lengths` (seeded) and random prompt tokens.

    Prompt lengths are scaled by ``prompt_scale``, clipped to ``prompt_range`` (inclusive) when given, then rounded
    up to a multiple of ``prompt_multiple`` (fewer prefill chunk lengths); output lengths are scaled by
    ``output_scale``; both at least 1. ``shared_prefix`` > 0: every prompt starts with the same ``shared_prefix``
    random tokens (a shared system prompt) followed by its own, and is at least ``shared_prefix + 1`` tokens."""
    if n < 1:
        raise ValueError(f"sample_requests: n must be >= 1, got {n}")
    if shared_prefix < 0:
        raise ValueError(f"sample_requests: shared_prefix must be >= 0, got {shared_prefix}")
    if prompt_multiple < 1:
        raise ValueError(f"sample_requests: prompt_multiple must be >= 1, got {prompt_multiple}")
    if prompt_range is not None and not 1 <= prompt_range[0] <= prompt_range[1]:
        raise ValueError(f"sample_requests: prompt_range must be (lo, hi) with 1 <= lo <= hi, got {prompt_range}")
    rng = np.random.default_rng(seed)
    prompts, outputs = load_lengths()
    pick = rng.integers(0, len(prompts), n)
    plen = np.maximum(1, np.round(prompts[pick] * prompt_scale)).astype(np.int64)
    if prompt_range is not None:
        plen = np.clip(plen, *prompt_range)
    plen = np.maximum(plen, shared_prefix + 1)
    plen = -(-plen // prompt_multiple) * prompt_multiple
    olen = np.maximum(1, np.round(outputs[pick] * output_scale)).astype(np.int64)
    shared = rng.integers(0, vocab_size, shared_prefix) if shared_prefix else np.zeros(0, np.int64)
    return [Request(np.concatenate([shared, rng.integers(0, vocab_size, int(p) - shared_prefix)]).astype(np.int32),
                    int(o)) for p, o in zip(plen, olen)]


# ---------------------------------------------------------------------------------------------- memory
@dataclasses.dataclass(frozen=True)
class PoolPlan:
    """Pool sizes for a KV budget: ``num_pages`` low pages, ``max_seqs`` slots (with their twin pages),
    ``max_pages_per_seq`` (page-table width), the ``budget_bytes`` and the ``pool_bytes`` the allocated pools take
    (every pool array of the state, scales included), sized for ``slot_len`` tokens per sequence."""

    num_pages: int
    max_seqs: int
    max_pages_per_seq: int
    budget_bytes: int
    pool_bytes: int
    slot_len: int


def _pool_bytes(cache_cfg: KVCacheConfig, model_cfg: ModelConfig, num_pages, max_seqs, max_pages_per_seq) -> int:
    """Bytes of the pool arrays `init_state` would allocate (evaluated abstractly: nothing is allocated)."""
    state = jax.eval_shape(functools.partial(init_state, cache_cfg, cache_shape(model_cfg), num_pages, max_seqs,
                                             max_pages_per_seq))
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.pools)))


def plan_pools(cache_cfg: KVCacheConfig, model_cfg: ModelConfig, budget_bytes: int, slot_len: int,
               max_len: int) -> PoolPlan:
    """Slots and pages for ``budget_bytes`` of KV cache: ``max_seqs`` = sequences of ``slot_len`` tokens the
    budget holds (`jmixedkv.capacity.capacity`: page rounding and a mixed cache's twin counted), ``num_pages`` =
    what is left after the slots' twins, in low pages; then lowered until the allocated pool arrays fit the
    budget. ``max_len`` (tokens of the longest sequence) sets the page-table width. `CacheCapacityError` when the
    budget holds no sequence of ``slot_len`` tokens."""
    shape = cap.ModelShape(model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim, name="model")
    c = cap.capacity(cache_cfg, budget_bytes, shape, slot_len)
    if c.sequences < 1:
        raise CacheCapacityError(f"KV budget {cap.format_bytes(budget_bytes)} holds no sequence of {slot_len} tokens "
                                 f"with a {c.label} cache ({cap.format_bytes(c.bytes_per_sequence)} each)")
    page_bytes = cache_cfg.page_size * c.bytes_per_token
    num_pages = (budget_bytes - c.sequences * c.twin_bytes_per_sequence) // page_bytes
    width = lambda n: max(1, min(n, -(-max_len // cache_cfg.page_size)))  # noqa: E731
    for _ in range(8):                    # scales and any offset-hole padding of `init_state` are real bytes too
        used = _pool_bytes(cache_cfg, model_cfg, num_pages, c.sequences, width(num_pages))
        if used <= budget_bytes:
            return PoolPlan(int(num_pages), c.sequences, width(num_pages), int(budget_bytes), used, slot_len)
        num_pages -= max(1, -(-(used - budget_bytes) // page_bytes))
        if num_pages < 1:
            break
    raise CacheCapacityError(f"KV budget {cap.format_bytes(budget_bytes)}: the {c.label} pools of {c.sequences} "
                             f"slots do not fit it")


def prefill_chunks(num_tokens: int, max_chunk: int) -> list[int]:
    """Chunk lengths of a ``num_tokens`` prefill: ``max_chunk`` while it fits, then powers of two, largest first
    (``prefill_chunks(5000, 2048) == [2048, 2048, 512, 256, 128, 8]``)."""
    if num_tokens < 1 or max_chunk < 1 or max_chunk & (max_chunk - 1):
        raise ValueError(f"prefill_chunks: need num_tokens >= 1 and max_chunk a power of two, got {num_tokens}, "
                         f"{max_chunk}")
    out = [max_chunk] * (num_tokens // max_chunk)
    rest = num_tokens % max_chunk
    while rest:
        out.append(1 << (rest.bit_length() - 1))
        rest -= out[-1]
    return out


# ---------------------------------------------------------------------------------------------- the loop
def prepare_weights(params, model_cfg: ModelConfig) -> dict:
    """Parameters as the loop's programs take them: ``{"top": {"params": embed / final_norm / lm_head},
    "stacked": the blocks stacked along a leading layer axis}`` (stacked once, not in every step)."""
    p = params["params"]
    top = {"params": {k: v for k, v in p.items() if not k.startswith("block")}}
    return {"top": top, "stacked": jax.jit(_stack_blocks, static_argnums=1)(params, model_cfg)}


def weight_bytes(weights) -> int:
    """Bytes of every array of ``weights`` (`prepare_weights`' dict or a parameter tree)."""
    return int(sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(weights)))


def weights_dtype_of(weights: dict) -> str:
    """The weight matrices' dtype name of `prepare_weights`' dict (``"float32"`` or ``"bfloat16"``)."""
    return jnp.dtype(weights["top"]["params"]["embed"]["embedding"].dtype).name


#: traces of the loop's programs: (model_cfg, cache_cfg, attention, state shapes + weight dtypes, "decode" |
#: "prefill", tokens) -> count
TRACES: collections.Counter = collections.Counter()


def _shapes(state, weights) -> tuple:
    """The shapes of every array of ``state`` (a pool plan's signature) and the weights' dtypes."""
    return (tuple(tuple(x.shape) for x in jax.tree.leaves(state))
            + (tuple(sorted({jnp.dtype(x.dtype).name for x in jax.tree.leaves(weights)})),))


def _forward(weights, state, tokens, positions, slots, model_cfg: ModelConfig, attention: str):
    """``tokens, positions i32[B, T]`` of ``slots i32[B]`` through the model and the cache -> ``(state', last-token
    logits f32[B, V])``."""
    logits, state, _ = _scan_layers(
        weights["top"], model_cfg, tokens, positions,
        make_session=lambda layer, st: CacheSession(st, slots, attention),
        emit=lambda s: (s.state, jnp.zeros((), jnp.float32)), carry=state, last_only=True,
        stacked=weights["stacked"])
    return state, logits[:, -1].astype(jnp.float32)


@functools.partial(jax.jit, donate_argnums=1, static_argnames=("model_cfg", "attention"))
def decode_step(weights, state, tokens, positions, active, *, model_cfg: ModelConfig, attention: str = "auto"):
    """One decode step over all slots (``state`` donated): ``tokens, positions i32[S]`` (the fed token and its
    position per slot), ``active bool[S]`` (inactive slots are padding rows) -> ``(state', greedy next tokens
    i32[S], error bits i32[])``."""
    TRACES[(model_cfg, state.config, attention, _shapes(state, weights), "decode", 1)] += 1
    slots = jnp.where(active, jnp.arange(active.shape[0], dtype=jnp.int32), -1)
    state, logits = _forward(weights, state, tokens[:, None], positions[:, None], slots, model_cfg, attention)
    return state, jnp.argmax(logits, -1).astype(jnp.int32), state.error


@functools.partial(jax.jit, donate_argnums=1, static_argnames=("model_cfg", "attention"))
def prefill_chunk(weights, state, tokens, start, slot, *, model_cfg: ModelConfig, attention: str = "auto"):
    """One prefill chunk of one sequence (``state`` donated): ``tokens i32[1, T]`` at positions ``start + [0, T)``
    of ``slot i32[]`` -> ``(state', greedy token after the chunk i32[], error bits i32[])``."""
    TRACES[(model_cfg, state.config, attention, _shapes(state, weights), "prefill", tokens.shape[1])] += 1
    positions = start + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    state, logits = _forward(weights, state, tokens, positions, slot[None], model_cfg, attention)
    return state, jnp.argmax(logits[0]).astype(jnp.int32), state.error


@dataclasses.dataclass
class ServeResult:
    """One `ServingLoop.run`: ``outputs`` (generated tokens per request, in request order, i32[n_i]) and
    ``stats`` (see `ServingLoop.run`)."""

    outputs: list
    stats: dict


class ServingLoop:
    """Continuous batching for one cache config (see the module docstring).

    Args:
      weights: `prepare_weights` of the model's parameters.
      model_cfg: the `ModelConfig` (its KV geometry sizes the cache).
      cache_cfg: the `KVCacheConfig` (with ``k_smoothing`` the cache freezes each sequence's K mean from its first
        prefill chunk; with ``prefix_reuse`` a request reusing a prefix takes its owner's: `jmixedkv.PrefixCache`).
      plan: `plan_pools` for the budget.
      eos_id: token that ends a sequence (kept in its output), or None.
      max_chunk: longest prefill chunk (a power of two): prefill memory is linear in it.
      attention: `jmixedkv_demo.model` attention mode (``"auto"``, ``"fused"``, ``"reference"``).
      prefix_reuse: reuse committed prompt prefixes (`jmixedkv.PrefixCache`, see the module docstring).
    """

    def __init__(self, weights: dict, model_cfg: ModelConfig, cache_cfg: KVCacheConfig, plan: PoolPlan, *,
                 eos_id: Optional[int] = None, max_chunk: int = 2048, attention: str = "auto",
                 prefix_reuse: bool = False):
        if attention not in ATTENTION_MODES:
            raise ValueError(f"ServingLoop: attention must be one of {ATTENTION_MODES}, got {attention!r}")
        prefill_chunks(1, max_chunk)                                     # max_chunk: a power of two
        if eos_id is not None and not 0 <= eos_id < model_cfg.vocab_size:
            raise ValueError(f"ServingLoop: eos_id={eos_id} is outside the vocabulary [0, {model_cfg.vocab_size})")
        self.weights, self.model_cfg, self.cache_cfg, self.plan = weights, model_cfg, cache_cfg, plan
        self.eos_id, self.max_chunk, self.attention = eos_id, max_chunk, attention
        self.manager = CacheManager(cache_cfg, cache_shape(model_cfg), plan.num_pages, plan.max_seqs,
                                    plan.max_pages_per_seq)
        self.prefix = None
        if prefix_reuse:                      # the index wraps the state; its manager is the loop's from now on
            self.prefix = PrefixCache(self.manager.state, host_capacity_pages=0)
            self.manager = self.prefix.manager
        self._compiled = {}
        self._compile_s = 0.0                 # seconds spent compiling programs (excluded from the run's times)
        self._pinned = None                   # `_pinned_pages` since the last admission / release (reuse only)

    def _program(self, kind: str, length: int = 1):
        """The compiled program ``kind`` (``"decode"``, or ``"prefill"`` of ``length`` tokens): compiled once per
        (model, cache config, attention, shapes), shared by every loop of that config."""
        if (kind, length) not in self._compiled:
            t0 = time.perf_counter()
            i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
            s = self.plan.max_seqs
            fn, args = ((decode_step, (i32(s), i32(s), jax.ShapeDtypeStruct((s,), jnp.bool_))) if kind == "decode"
                        else (prefill_chunk, (i32(1, length), i32(), i32())))
            self._compiled[kind, length] = fn.lower(self.weights, self.manager.state, *args, model_cfg=self.model_cfg,
                                                    attention=self.attention).compile()
            self._compile_s += time.perf_counter() - t0
        return self._compiled[kind, length]

    @property
    def traces(self) -> dict:
        """Traces of this loop's programs so far (this config, pool shapes and weight dtypes): ``{"decode": n,
        "prefill T": n, ...}`` (each 1 when every program is traced once)."""
        key = (self.model_cfg, self.cache_cfg, self.attention, _shapes(self.manager.state, self.weights))
        return {(k[4] if k[4] == "decode" else f"prefill {k[5]}"): v for k, v in TRACES.items() if k[:4] == key}

    def compile(self, requests: Sequence[Request]) -> float:
        """Compile the decode step, every prefill chunk length ``requests`` need and the manager's admit / release
        (one admit + release of an empty sequence: the cache is left as it was); with prefix reuse also the
        index's page programs (`PrefixCache.compile`); returns the seconds taken."""
        t0 = time.perf_counter()
        if self.prefix is not None:
            slot = self.manager.free_slots()[0]
            self.prefix.admit(slot, np.zeros(1, np.int32), count_stats=False)
            self.prefix.release(slot)
            self.prefix.compile(self.plan.num_pages)
        else:
            self.manager.release(self.manager.admit())
        self._program("decode")
        for length in sorted({t for r in requests for t in prefill_chunks(len(r.prompt), self.max_chunk)}):
            self._program("prefill", length)
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ host side
    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.cache_cfg.page_size)

    def check_requests(self, requests: Sequence[Request]) -> None:
        """`ValueError` for a malformed request, `CacheCapacityError` for one that can never fit (its lengths
        named), before anything runs."""
        vocab, page = self.model_cfg.vocab_size, self.cache_cfg.page_size
        for i, r in enumerate(requests):
            prompt = np.asarray(r.prompt)
            if prompt.ndim != 1 or prompt.size < 1 or not np.issubdtype(prompt.dtype, np.integer):
                raise ValueError(f"request {i}: prompt must be a non-empty vector of token ids, got shape "
                                 f"{prompt.shape} dtype {prompt.dtype}")
            if prompt.min() < 0 or prompt.max() >= vocab:
                raise ValueError(f"request {i}: prompt token ids must lie in [0, {vocab}), got "
                                 f"[{prompt.min()}, {prompt.max()}]")
            if not isinstance(r.max_new, (int, np.integer)) or r.max_new < 1:
                raise ValueError(f"request {i}: max_new must be an integer >= 1, got {r.max_new!r}")
            need = self._pages(r.cache_len)
            if need > min(self.plan.num_pages, self.plan.max_pages_per_seq):
                raise CacheCapacityError(
                    f"request {i}: a prompt of {prompt.size} tokens + {r.max_new} new tokens ({r.cache_len} tokens "
                    f"cached) needs {need} pages of {page} tokens, but the pool holds {self.plan.num_pages} pages "
                    f"({cap.format_bytes(self.plan.budget_bytes)} KV budget) and a sequence at most "
                    f"{self.plan.max_pages_per_seq}: it can never be admitted")

    def _check(self, error, what: str) -> None:
        if int(error):
            raise CacheError(f"{what}: cache state error {int(error)}: {describe_error(int(error))}")

    def _prefill(self, slot: int, prompt: np.ndarray, start: int = 0) -> int:
        """Prefill ``prompt[start:]`` into the admitted ``slot`` (holding ``start`` tokens) chunk by chunk;
        returns the first generated token."""
        tok, err = None, None
        for length in prefill_chunks(len(prompt) - start, self.max_chunk):
            seq, pos = np.full(length, slot, np.int32), np.arange(start, start + length, dtype=np.int32)
            self._make_room(seq, pos)
            self.manager.reserve_append(seq, pos)
            state, tok, err = self._program("prefill", length)(
                self.weights, self.manager.state, jnp.asarray(prompt[None, start:start + length], jnp.int32),
                np.int32(start), np.int32(slot))
            self.manager.install(state)
            start += length
        tok, err = jax.device_get((tok, err))
        self._check(err, f"prefill of slot {slot}")
        return int(tok)

    def run(self, requests: Sequence[Request], progress: Optional[Callable[[str], None]] = None) -> ServeResult:
        """Serve ``requests`` (all queued at time 0, FIFO) to completion.

        ``stats``: ``requests``, ``output_tokens``, ``prefill_tokens`` (prompt tokens prefilled),
        ``reused_tokens`` (prompt tokens admitted from the prefix index instead), ``peak_concurrent`` (most sequences
        admitted at once), ``wall_s`` (first admission to last release, compilation excluded),
        ``tokens_per_s`` (output tokens / wall), ``decode_tokens_per_s`` (tokens of decode steps / their time),
        ``tpot_ms`` (mean over requests of (last token time - first token time) / (tokens - 1): what a user sees
        between tokens, prefill stalls of other requests included), ``step_ms`` (mean decode step, its host work
        included: releases at EOS / max_new, the host check of the step), ``host_ms`` (of which the host check
        `CacheManager.reserve_append`), ``ttft_s``
        (mean time to first token from time 0, queueing included), ``prefill_s``, ``decode_steps``,
        ``compile_s`` (ahead of the run, and of any prefill length first met during it: excluded from the times),
        ``evicted_pages`` (index pages evicted to make room), ``pool_bytes`` (bytes of the allocated pool arrays,
        twin and scales included), ``state_bytes`` (every array of the cache state: pools, page tables,
        allocators), ``weight_bytes`` / ``weights_dtype`` (the model's weights), ``budget_bytes``, ``num_pages``,
        ``max_seqs``, ``free_pages_end`` (== ``num_pages``: every page returned), ``traces``."""
        self.check_requests(requests)
        compile_s = self.compile(requests)
        n, s_max = len(requests), self.plan.max_seqs
        pending = collections.deque(range(n))
        active: dict[int, int] = {}                    # slot -> request index
        lens = np.zeros(s_max, np.int64)               # tokens in the cache per slot
        last = np.zeros(s_max, np.int32)               # last generated token per slot (fed next)
        reserved = np.zeros(s_max, np.int64)           # pages each running sequence may still hold at its end
        outputs = [[] for _ in range(n)]
        t_first, t_done = np.zeros(n), np.zeros(n)
        peak, steps, step_s, host_s, prefill_s, decode_tokens, prefilled, reused = 0, 0, 0.0, 0.0, 0.0, 0, 0, 0
        self._compile_s, self._pinned = 0.0, None
        t0 = time.perf_counter()

        def emit(slot: int, tok: int) -> None:
            i = active[slot]
            outputs[i].append(tok)
            last[slot] = tok
            if len(outputs[i]) == requests[i].max_new or tok == self.eos_id:
                t_done[i] = time.perf_counter() - t0
                (self.manager if self.prefix is None else self.prefix).release(slot)
                self._pinned = None
                reserved[slot] = 0
                del active[slot]
                if progress and (n - len(pending) - len(active)) % max(1, n // 8) == 0:
                    progress(f"{n - len(pending) - len(active)}/{n} requests done, {len(active)} running, "
                             f"{time.perf_counter() - t0:.1f} s")

        while pending or active:
            while pending and (reuse := self._fits(requests[pending[0]], reserved)) is not None:
                i = pending.popleft()
                prompt = np.asarray(requests[i].prompt)
                tp = time.perf_counter()
                slot, start = self._admit(prompt, reuse)
                active[slot] = i
                reserved[slot] = self._pages(requests[i].cache_len)
                peak = max(peak, len(active))
                c0 = self._compile_s
                tok = self._prefill(slot, prompt, start)
                if self.prefix is not None:
                    self.prefix.commit(slot, prompt)
                prefill_s += time.perf_counter() - tp - (self._compile_s - c0)
                prefilled += len(prompt) - start
                reused += start
                self._pinned = None
                if progress and (n - len(pending)) % max(1, n // 8) == 0:
                    progress(f"admitted {n - len(pending)}/{n}, {len(active)} running; prefill {prefilled:,} tokens "
                             f"in {prefill_s:.1f} s ({prefilled / prefill_s:,.0f} tokens/s)")
                lens[slot] = len(requests[i].prompt)
                t_first[i] = time.perf_counter() - t0
                emit(slot, tok)
            if not active:                     # an empty cache (index emptied) fits any checked request: never spin
                if pending:
                    raise CacheCapacityError(f"request {pending[0]} does not fit an empty cache "
                                             f"({self.manager.free_pages} pages, {self.manager.free_high_pages} "
                                             f"high pages free)")
                break
            ts = time.perf_counter()
            seq = np.asarray(sorted(active), np.int32)
            self._make_room(seq, lens[seq].astype(np.int32))
            self.manager.reserve_append(seq, lens[seq].astype(np.int32))   # checked and accounted on the host
            on = np.zeros(s_max, bool)
            on[seq] = True
            th = time.perf_counter()
            state, nxt, err = self._program("decode")(self.weights, self.manager.state, np.where(on, last, 0),
                                                      np.where(on, lens, 0).astype(np.int32), on)
            self.manager.install(state)
            nxt, err = jax.device_get((nxt, err))
            host_s += th - ts
            self._check(err, f"decode step {steps}")
            steps += 1
            decode_tokens += len(seq)
            lens[seq] += 1
            for slot in seq.tolist():
                emit(slot, int(nxt[slot]))
            step_s += time.perf_counter() - ts
        wall = time.perf_counter() - t0 - self._compile_s
        evicted = 0
        if self.prefix is not None:                    # nothing runs: every index page goes, the pool is whole
            evicted = self.prefix.stats()["evicted_pages"]
            self.prefix.evict(len(self.prefix.index))
        counts = np.array([len(o) for o in outputs])
        multi = counts > 1
        tpot = (t_done - t_first)[multi] / (counts[multi] - 1)
        stats = dict(
            requests=n, output_tokens=int(counts.sum()), prefill_tokens=prefilled, reused_tokens=reused,
            peak_concurrent=peak, wall_s=wall, tokens_per_s=counts.sum() / wall,
            decode_tokens_per_s=decode_tokens / step_s if step_s else 0.0,
            tpot_ms=1e3 * float(tpot.mean()) if tpot.size else 0.0, step_ms=1e3 * step_s / max(steps, 1),
            host_ms=1e3 * host_s / max(steps, 1),
            ttft_s=float(t_first.mean()), prefill_s=prefill_s, decode_steps=steps,
            compile_s=compile_s + self._compile_s, evicted_pages=evicted,
            pool_bytes=sum(x.nbytes for x in jax.tree.leaves(self.manager.state.pools)),
            state_bytes=sum(x.nbytes for x in jax.tree.leaves(self.manager.state)),
            weight_bytes=weight_bytes(self.weights), weights_dtype=weights_dtype_of(self.weights),
            budget_bytes=self.plan.budget_bytes, num_pages=self.plan.num_pages,
            max_seqs=s_max, free_pages_end=self.manager.free_pages,
            traces=self.traces)
        return ServeResult([np.asarray(o, np.int32) for o in outputs], stats)

    def _fits(self, request: Request, reserved: np.ndarray) -> Optional[int]:
        """None when ``request`` cannot be admitted now, else the prompt tokens it reuses from the prefix index.

        Without reuse: a free slot (and its twin pages) and the request's lifetime pages next to every running
        one's. With reuse: a free slot (twin pages are evicted from the index if need be) and the pages live
        sequences pin now (`_pinned_pages`) + their remaining growth + the request's pages not pinned already fit
        the pool (index-only pages are evictable, so they count as free)."""
        if self.prefix is None:
            ok = (self.manager.can_admit()
                  and int(reserved.sum()) + self._pages(request.cache_len) <= self.plan.num_pages)
            return 0 if ok else None
        if not self.manager.free_slots():
            return None
        start, ids = self._reuse(np.asarray(request.prompt))
        if self._pinned is None:               # recomputed after an admission or a release only: a running
            self._pinned = self._pinned_pages(reserved)   # sequence's new page moves one page from growth to pinned
        pinned, growth = self._pinned
        need = self._pages(request.cache_len) - len(pinned.intersection(ids))
        return start if len(pinned) + growth + need <= self.plan.num_pages else None

    def _reuse(self, prompt: np.ndarray) -> tuple[int, list[int]]:
        """``(tokens, low page ids)`` of ``prompt``'s committed prefix the loop reuses: the index's match
        (`PrefixCache.match_prefix`), shortened by whole pages until the first prefill chunk of the rest covers
        the Last-N window (``min(last_n, rest)`` tokens, `jmixedkv.prefix`'s rule)."""
        start, ids = self.prefix.match_prefix(prompt)
        window, page = self.cache_cfg.last_n, self.cache_cfg.page_size
        while start and prefill_chunks(len(prompt) - start, self.max_chunk)[0] < min(window, len(prompt) - start):
            start -= page
        return start, ids[:start // page]

    def _pinned_pages(self, reserved: np.ndarray) -> tuple[set, int]:
        """``(low page ids pinned, pages the running sequences may still allocate)`` given ``reserved`` int[S]
        (lifetime pages per running slot): pinned = held by a running sequence (a shared page once), and index
        pages on the prefix chain of a pinned one (not evictable while a descendant is held). Reads the page
        table from the device (admission only)."""
        active = np.flatnonzero(np.asarray(self.manager.state.active))
        rows = np.asarray(self.manager.state.page_table)[active]
        pinned = set(rows[rows >= 0].tolist())
        growth = int(reserved[active].sum() - (rows >= 0).sum())
        index = self.prefix.index
        by_low = {e.low: e for e in index.values() if not e.on_host}
        todo, seen = [by_low[p] for p in pinned if p in by_low], set()
        while todo:
            e = todo.pop()
            if e.key in seen:
                continue
            seen.add(e.key)
            pinned.add(e.low)
            if e.parent is not None and e.parent in index and not index[e.parent].on_host:
                todo.append(index[e.parent])
        return pinned, growth

    def _admit(self, prompt: np.ndarray, start: int) -> tuple[int, int]:
        """Admit ``prompt`` into the first free slot reusing ``start`` tokens (`_reuse`); ``(slot, start)``."""
        if self.prefix is None:
            return self.manager.admit(), 0
        slot = self.manager.free_slots()[0]
        # the index matches at most floor((len - max(last_n, 1)) / page) pages: pass just enough tokens for start
        got = self.prefix.admit(slot, prompt[:start + max(self.cache_cfg.last_n, 1)])
        if got != start:
            raise CacheError(f"prefix reuse: slot {slot} matched {got} tokens, planned {start}")
        return slot, start

    def _make_room(self, seq: np.ndarray, pos: np.ndarray) -> None:
        """With reuse: evict index pages until the append of tokens ``(seq, pos)`` has its new pages."""
        if self.prefix is not None and self.manager.free_pages < len(seq):
            self.prefix.ensure_free(sum(self.manager.pages_needed(seq, pos).values()))

    def close(self) -> None:
        """Drop the cache state and the compiled programs (frees the pools before another config runs)."""
        self.manager = None
        self._compiled.clear()


# ---------------------------------------------------------------------------------------------- caches side by side
def serve_caches(weights: dict, model_cfg: ModelConfig, caches: Sequence[tuple[str, KVCacheConfig]],
                 requests: Sequence[Request], budget_bytes: int, *, slot_len: Optional[int] = None,
                 eos_id: Optional[int] = None, max_chunk: int = 2048, attention: str = "auto",
                 prefix_reuse: bool = False, progress: Optional[Callable[[str], None]] = None) -> list[dict]:
    """Run the same ``requests`` through a `ServingLoop` per ``(label, config)`` of ``caches`` at one KV budget.

    ``slot_len`` (default: the requests' mean cache length) sizes the slots (`plan_pools`); ``prefix_reuse``:
    `ServingLoop`'s. Returns one dict per
    cache: ``label``, ``config`` (the `KVCacheConfig`), every `ServingLoop.run` stat, ``slot_len`` and
    ``same_tokens`` (share of requests whose tokens equal the first cache's)."""
    lens = [r.cache_len for r in requests]
    slot_len = int(round(float(np.mean(lens)))) if slot_len is None else slot_len
    rows, first = [], None
    for label, cfg in caches:
        plan = plan_pools(cfg, model_cfg, budget_bytes, slot_len, max(lens))
        if progress:
            progress(f"[{label}] {plan.max_seqs} slots, {plan.num_pages} pages of {cfg.page_size}, pools "
                     f"{cap.format_bytes(plan.pool_bytes)} of {cap.format_bytes(budget_bytes)}")
        loop = ServingLoop(weights, model_cfg, cfg, plan, eos_id=eos_id, max_chunk=max_chunk, attention=attention,
                           prefix_reuse=prefix_reuse)
        try:
            res = loop.run(requests, progress=(lambda m, lb=label: progress(f"[{lb}] {m}")) if progress else None)
        finally:
            loop.close()
        first = res.outputs if first is None else first
        same = float(np.mean([np.array_equal(a, b) for a, b in zip(res.outputs, first)]))
        rows.append(dict(res.stats, label=label, config=cfg, slot_len=slot_len, same_tokens=same,
                         outputs=res.outputs))
        if progress:
            progress(f"[{label}] peak {res.stats['peak_concurrent']} sequences, {res.stats['tokens_per_s']:.1f} "
                     f"output tokens/s, wall {res.stats['wall_s']:.1f} s (compile {res.stats['compile_s']:.1f} s)")
    return rows


def serve_table(rows: Sequence[dict]) -> tuple[list[str], list[list[str]]]:
    """``(headers, rows)`` of strings for `jmixedkv.capacity.format_table`, one row per cache (``memory`` =
    the model's weights + the allocated pools)."""
    headers = ["kv cache", "slots", "pages", "pools", "memory", "peak seqs", "x first", "out tok/s", "x first",
               "decode tok/s", "TPOT ms", "step ms", "host ms", "TTFT s", "wall s", "reused", "same tokens"]
    base = rows[0] if rows else None
    out = []
    for r in rows:
        ratio = lambda k: f"{r[k] / base[k]:.2f}" if base[k] else "-"  # noqa: E731
        out.append([r["label"], f"{r['max_seqs']:,}", f"{r['num_pages']:,}", cap.format_bytes(r["pool_bytes"]),
                    cap.format_bytes(r.get("weight_bytes", 0) + r["pool_bytes"]), f"{r['peak_concurrent']:,}",
                    ratio("peak_concurrent"), f"{r['tokens_per_s']:,.1f}", ratio("tokens_per_s"),
                    f"{r['decode_tokens_per_s']:,.1f}", f"{r['tpot_ms']:.2f}",
                    f"{r['step_ms']:.2f}", f"{r['host_ms']:.2f}", f"{r['ttft_s']:.2f}", f"{r['wall_s']:.1f}",
                    f"{100 * r['reused_tokens'] / max(1, r['reused_tokens'] + r['prefill_tokens']):.0f}%",
                    f"{100 * r['same_tokens']:.0f}%"])
    return headers, out


def random_weights(model_cfg: ModelConfig, weights_dtype: str = "float32") -> dict:
    """`prepare_weights` of the deterministic random parameters of ``model_cfg`` (`init_params`), weight matrices
    in ``weights_dtype`` (``"float32"`` or ``"bfloat16"``), packed side by side on the device
    (`jmixedkv.placement.pack_on_device`: building them leaves holes, and a cache pool allocated after them needs
    one contiguous block)."""
    return pack_on_device(prepare_weights(init_params(model_cfg, weights_dtype), model_cfg))


#: ``jmixedkv serve`` defaults per model: KV budget, workload scaling of the shipped lengths, page, prefill chunk
SERVE_DEFAULTS = {
    "tiny": dict(kv_budget="256KiB", requests=16, prompt_scale=1 / 128, output_scale=1 / 8, page_size=8,
                 max_chunk=64),
    "smollm2": dict(kv_budget="40GiB", requests=64, prompt_scale=1.0, output_scale=1.0, page_size=32,
                    max_chunk=2048),
    "llama3-8b-shape": dict(kv_budget="40GiB", requests=64, prompt_scale=1.0, output_scale=1.0, page_size=32,
                            max_chunk=2048),
}

#: the default cache list: bf16, fp8 and the default mixed cache of the demo
SERVE_CACHES = "bf16,fp8,mixed:4:64"


def load_serve_model(name: str, weights_dtype: Optional[str] = "float32") -> tuple[ModelConfig, dict, str]:
    """``(model_cfg, prepare_weights(params), how)`` of a `MODELS` name: random weights, except ``smollm2`` when
    its GGUF is installed (`jmixedkv_demo.gguf`), whose real weights are loaded (dequantized to float32).

    ``weights_dtype``: ``"float32"`` / ``"bfloat16"`` for the weight matrices (`cast_weights`), or None: bfloat16
    for random weights, float32 for the GGUF's. ``how`` names the source and the dtype."""
    if name not in MODELS:
        raise ValueError(f"unknown serve model {name!r}; expected one of {sorted(MODELS)}")
    if weights_dtype is not None and weights_dtype not in WEIGHTS_DTYPES:
        raise ValueError(f"weights_dtype must be one of {WEIGHTS_DTYPES} or None, got {weights_dtype!r}")
    if name == "smollm2":
        from .gguf import ModelUnavailable, load_model
        try:
            m = load_model()
            dtype = weights_dtype or "float32"
            return (m.cfg, prepare_weights(cast_weights(m.params, dtype), m.cfg),
                    f"{m.name} weights from {m.path.name}, {dtype}")
        except ModelUnavailable as e:
            how = f"random weights (GGUF not installed: {e})"
    else:
        how = "random weights"
    cfg, dtype = MODELS[name], weights_dtype or "bfloat16"
    return cfg, random_weights(cfg, dtype), f"{how}, {dtype}"
