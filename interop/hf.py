"""The mixed-precision cache as a transformers ``Cache``: ``model.generate(..., past_key_values=JMixedKVCache(...))``
(``cache=`` on transformers >= 5.2x; `CACHE_KWARG` names the one the installed version takes).

Owns `JMixedKVCache` (a ``transformers.Cache`` of per-layer `JMixedLayer` ``CacheLayerMixin`` layers over one
`interop.TorchKVCache`) and `jmixedkv_attention`, registered with transformers' ``AttentionInterface`` (and the
mask interface) as ``attn_implementation="jmixedkv"``.

Batch rows and slots. On the first ``update`` of a fresh cache each batch row ``b`` is admitted into a slot
(``cache.slots[b]``). Rows are stored **compact**: a left-padding token (its ``position_ids`` entry repeats one
before it; transformers gives pads position 0 or 1) is not stored, so row ``b``'s real token ``i`` sits at cache
position ``i`` -- first-N retains the first *real* tokens and no page holds padding. What a layer returns to the
model is aligned with transformers' attention mask: ``[B, H, seen, D]`` (``seen`` = padded length, what
``get_seq_length`` reports), row ``b``'s real rows at ``[seen - n_b, seen)``, zeros at its padding columns (the
mask hides them). Right padding is refused (`ValueError`).

Semantics, exactly:

* Hot path: the first layer of a forward pass checks the step's positions and slots once (`_Step`); then either
  every layer runs ONE jitted, donated program (`TorchKVCache.plan_step`, `jmixedkv.step`), its K / V (and Q)
  crossing DLPack as one packed buffer on torch's current stream (``sync="stream"`` by default), or (a fused step,
  below) no JAX program runs until the step ends.
* ``decode="stage"`` (default): a first prefill (nothing stored yet) appends and returns the step's own K/V, as
  engines attend over a fresh chunk; later steps append and stage the layer (retained rows bit-exact from the twin,
  the rest dequantized NVFP4; ``width`` bucketed to the longest row, so the cost follows the tokens held) in one
  program, and the model's own attention (``sdpa`` / ``eager``) runs on it. A step short enough to be held aside
  (below; not with the rotation lever, whose staged rows are model-space) gives the same K/V bit for bit from one
  Triton launch over views of the cache before the run of held steps plus the run's rows
  (`interop.paged_ops.stage`), and is stored when the run ends (below). With a plain ``"bf16"`` cache, or a
  mixed cache whose ``first_n + last_n`` covers every row, the returned K/V are the appended ones bit for bit, so
  ``generate`` gives the tokens of ``DynamicCache``.
* ``decode="fused"``: attention over the cache without staging, with the model's ``scaling``,
  ``sliding_window``, ``softcap`` and ``s_aux`` sinks, in `jmixedkv_attention`. Needs the model's attention to be
  ``"jmixedkv"`` (``from_pretrained(..., attn_implementation="jmixedkv")`` or
  ``model.set_attn_implementation("jmixedkv")``): checked by `for_model` / ``config=``, and a fused step whose
  attention did not run through it raises `RuntimeError` at the next ``update``. Its float32 attention is close
  to, not bit-equal with, torch's. Two ways, by format:

  - Held aside (every format but K smoothing and a float32 attention dtype; no padding inside the step; past ``first_n``
    for a mixed cache without ``last_n``): consecutive steps form a *run* of up to `tail_limit` rows per row (``last_n``
    for a mixed cache with a ``last_n`` window, else `MAX_HELD_TOKENS`; decode steps: up to 64 passes). Each layer's K /
    V go into the run's buffer (``[L, 2, B, H, limit, D]`` in the attention dtype): the attention kernel keeps them
    there itself where they read as given (no codec form, no rotation: no launch but the kernel's), else one copy launch
    per layer. Attention is a torch Triton kernel (`interop.paged_ops.step_attention`; torch code on CPU) over zero-copy
    views of the pools as they were before the run plus the run's rows so far read dense in the form they read once
    stored (`tail_form`: as given from a 16-bit pool or twin; through the NVFP4 or fp8 codec otherwise, one more Triton
    launch, `interop.paged_ops.round_trip`) -- the result of appending them first, up to one rounding of those rows to
    the attention dtype. The rotation lever is applied to q / the rows and undone on the output around it. When a step
    would not fit the run (or at `flush`, or any method that reads or changes the cache: ``cache``, ``crop``,
    ``reorder_cache``, ``reset``), every layer's rows of the run are stored in ONE donated JAX program
    (`TorchKVCache.write_step`); the views are dropped first, so the pools are updated in place. A first step that fits
    attends over its own rows (the model's attention) and starts a run.
  - Otherwise, a decode / verify step (``1 <= T <= max_draft_len + 1``) appends and runs the fused decode (the
    Mosaic GPU / Triton kernel on a GPU) in one JAX program per layer; a longer step is staged as above.
* Sliding layers (``layer_types`` / ``sliding_window`` in the config) are marked ``is_sliding``; they attend over
  their window but keep every page (one page table per sequence for all layers).
* ``crop(-n)`` rewinds ``n`` tokens within the cache's rewind floor (`TorchKVCache.correct_kv_lens`: at most
  ``max_draft_len`` behind the furthest row written, never below a reused prefix; assisted decoding);
  ``reorder_cache`` / ``batch_select_indices`` / ``batch_repeat_interleave`` remap rows to slots with
  `TorchKVCache.fork` (a slot used once is kept as is; rows that drop out are released first).
* ``get_mask_sizes(q) = (seen + q, 0)``; ``get_max_length() = -1`` (capacity is pages: `CacheCapacityError`).

Example (copy-paste; runs on CPU)::

    import torch, transformers
    from interop.hf import JMixedKVCache
    from jmixedkv import KVCacheConfig
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    cache = JMixedKVCache.for_model(model, KVCacheConfig("mixed_nvfp4_bf16", first_n=4, last_n=32, page_size=16),
                                    max_batch_size=2, max_cache_len=64)
    out = model.generate(torch.tensor([[1, 2, 3, 4]] * 2), max_new_tokens=8, do_sample=False, past_key_values=cache)
"""
from __future__ import annotations

import inspect
import sys
from typing import Optional

import numpy as np
import torch
import transformers
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from jmixedkv.config import KVCacheConfig

from . import paged_ops
from .torch_cache import CacheCapacityError, TorchKVCache, join_reserved

__all__ = ["JMixedKVCache", "JMixedLayer", "jmixedkv_attention", "dense_attention", "text_config", "sliding_windows",
           "check_model_fits", "tail_limit", "tail_form", "ATTN_IMPLEMENTATION", "CACHE_KWARG"]

ATTN_IMPLEMENTATION = "jmixedkv"
# The keyword a transformers model / ``generate`` takes the cache by: ``cache`` from transformers 5.2x on
# (``past_key_values`` still accepted, deprecated), ``past_key_values`` only before (e.g. 5.17 on the GPU image).
CACHE_KWARG = ("cache" if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters
               else "past_key_values")
DECODE_MODES = ("stage", "fused")
#: most tokens per row a fused step holds aside (a decode / verify step, a short chunk); longer steps (a long prompt)
#: store their rows layer by layer as they come
MAX_HELD_TOKENS = 64


class JMixedLayer(CacheLayerMixin):
    """One decoder layer's view of the shared `TorchKVCache` (layer ``layer_idx``); state lives in the owner.

    ``is_sliding`` / ``sliding_window`` come from the model's config (``layer_types`` / ``sliding_window``): the
    attention of a sliding layer sees its window (the mask on staged steps, the kernel's ``sliding_window`` on
    fused ones). Its pages are not reclaimed behind the window: every layer of a sequence shares one page table."""

    is_compileable = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, owner: "JMixedKVCache", layer_idx: int, sliding_window: Optional[int] = None):
        super().__init__()
        self.owner, self.layer_idx = owner, layer_idx
        self.is_sliding, self.sliding_window = sliding_window is not None, sliding_window
        self.seen = 0                      # padded length transformers sees (includes left padding)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``key_states, value_states [B, H, T, D]`` (the step's new rows); returns what attention reads:
        ``[B, H, seen, D]`` K/V aligned with the mask, or, on a fused decode step, empty placeholders that
        `jmixedkv_attention` recognises (it appends and attends in one program)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self.owner._update(self, key_states, value_states, (args, kwargs))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.seen, self.is_initialized = 0, False

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("crop the whole JMixedKVCache (cache.crop(-n)): its layers share one TorchKVCache")

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("reorder the whole JMixedKVCache (cache.reorder_cache(beam_idx))")


class _Step:
    """The forward pass in flight: its tokens checked and accounted for once, shared by every layer. ``start``:
    the padded length before it; ``t``: its tokens per row; ``before`` / ``new``: i64[B] stored rows before it and
    its real (non-padding) tokens per row; ``first``: nothing was stored before it. ``plan``: its
    `TorchKVCache.plan_step` (per-layer JAX programs), or None for a step held aside (``held``: the `_Held` run it
    joined, its rows at ``[off, off + t)`` there; ``reached``: which layers stored theirs)."""

    __slots__ = ("start", "t", "plan", "before", "new", "first", "held", "off", "reached", "checked")

    def __init__(self, start, t, plan, before, new, held=None, num_layers=0):
        self.start, self.t, self.plan, self.before, self.new = start, t, plan, before, new
        self.first = not before.any()          # nothing stored before it: attention reads the step's own rows
        self.held, self.off = held, (0 if held is None else held.count)
        self.reached = [False] * num_layers
        self.checked = set()                   # torch kernels whose arguments this step has checked (`_checks`)


class _Held:
    """Steps held aside since the cache was last stored (a run of passes whose rows are not in the pools yet).

    ``buf [L, 2, B, H, cap, D]`` (attention dtype): each layer's K / V rows of the run, ``count`` per batch row
    (every held step takes all its ``t`` tokens in every row); ``tails``: per layer, its K and V rows as the
    kernel's tail ``[B, cap, H, D]`` (views made once per buffer); ``reserved``: each step's
    `TorchKVCache.reserve_step`; ``views``: the cache before the run as torch views (`TorchKVCache.read_views`, made
    once per run); ``attend``: the attention over them per query length (`interop.paged_ops.step_attention`)."""

    __slots__ = ("buf", "tails", "count", "reserved", "views", "attend")

    def __init__(self, buf: torch.Tensor, tails: list):
        self.buf, self.tails, self.count, self.reserved, self.views, self.attend = buf, tails, 0, [], None, {}

    def put(self, layer: int, off: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep a layer's step rows ``k`` / ``v [B, H, t, D]`` at ``[off, off + t)`` (one copy launch)."""
        dst = self.buf[layer, :, :, :, off:off + k.shape[2]]
        torch._foreach_copy_((dst[0], dst[1]), (k, v))

    def rows(self, layer: int, count: int) -> torch.Tensor:
        """The run's first ``count`` rows of ``layer``: ``[2, B, H, count, D]`` (a view)."""
        return self.buf[layer, :, :, :, :count]

    def stacked(self) -> torch.Tensor:
        """Every layer's rows as `TorchKVCache.write_step` takes them: ``[2 L, B, H, count, D]`` (a fresh copy)."""
        src = self.buf[:, :, :, :, :self.count].transpose(0, 1)
        out = torch.empty((src.shape[0] * src.shape[1], *src.shape[2:]), dtype=src.dtype, device=src.device)
        out.view(src.shape).copy_(src)
        return out


class JMixedKVCache(Cache):
    """A transformers ``Cache`` over one `TorchKVCache` (see the module docstring for the semantics).

    Args:
      cache: the `TorchKVCache` (group 0 holds the model's layers: ``num_layers`` = the model's decoder layers,
        its KV heads and head_dim); its device must be the model's.
      decode: ``"stage"`` | ``"fused"``.
      config: the model's ``PretrainedConfig`` (optional): checks the shape, marks sliding layers, and for
        ``decode="fused"`` checks that ``config._attn_implementation == "jmixedkv"``.

    ``reset()`` releases the slots. One `TorchKVCache` slot per batch row: ``max_seqs`` >= the batch (beam
    search: batch x beams; ``batch_repeat_interleave`` needs the repeated batch). Steps held aside are stored when
    their run ends: read the `TorchKVCache` through ``cache`` (which stores them first, `flush`), not through a
    reference kept from before the run.
    """

    def __init__(self, cache: TorchKVCache, *, decode: str = "stage", config=None):
        if not isinstance(cache, TorchKVCache):
            raise TypeError(f"JMixedKVCache wraps an interop.TorchKVCache, got {type(cache).__name__}")
        if decode not in DECODE_MODES:
            raise ValueError(f"JMixedKVCache: decode must be one of {DECODE_MODES}, got {decode!r}")
        spec = cache.groups[0]
        if spec.kv_factor != 2:
            raise ValueError("JMixedKVCache needs a K/V group (kv_factor=2), not an MLA latent")
        windows = [None] * spec.num_layers
        if config is not None:
            _check_config(config, spec, decode, cache.config.k_smoothing)
            windows = sliding_windows(config, spec.num_layers)
        self._tkv, self.decode, self.spec = cache, decode, spec
        self.slots: Optional[np.ndarray] = None            # i32[B] slot of each batch row
        self.lens: Optional[np.ndarray] = None             # i64[B] real (stored) rows per batch row
        self._step: Optional[_Step] = None
        self._held: Optional[_Held] = None                 # steps held aside, not stored yet (`flush`)
        self._bufs: dict = {}                              # batch -> the held rows' buffer (`_Held.buf`)
        self._pos_memo = (None, None)
        self._pending = None                               # layer of a fused step whose attention has not run
        self._markers: dict = {}                 # (layer, batch) -> its empty K / V placeholder (`_marker`)
        # a stage step is held aside only without the rotation lever (it stages model-space rows)
        held = decode == "fused" or cache.config.rotation is None
        self._tail_limit = min(tail_limit(cache.config), MAX_HELD_TOKENS) if held else 0
        self._tail_form = tail_form(cache.config)
        self._tail_from = cache.config.first_n if cache.config.is_mixed and not cache.config.last_n else 0
        self._hadamard = None
        # fused steps held aside read their rows as given (no rotation, no codec): the attention kernel reads the
        # layer's new rows from the model's tensors and keeps them in the run's buffer itself (no copy launch)
        self._kernel_keeps = decode == "fused" and self._tail_form is None and cache.config.rotation is None
        if cache.config.rotation == "hadamard":
            from .torch_nvfp4 import hadamard
            self._hadamard = hadamard(spec.head_dim, cache.device)
        super().__init__(layers=[JMixedLayer(self, i, windows[i]) for i in range(spec.num_layers)])

    @classmethod
    def for_model(cls, model, kv_config: KVCacheConfig, *, max_batch_size: int, max_cache_len: int,
                  decode: str = "stage", backend: str = "auto", spare_slots: int = 0, **kwargs) -> "JMixedKVCache":
        """A cache sized for ``model`` (a transformers causal LM): ``max_batch_size`` rows (+ ``spare_slots`` for
        ``batch_repeat_interleave``) of up to ``max_cache_len`` real tokens each; ``kwargs`` go to `TorchKVCache`
        (default ``sync="stream"``: the hot loop stays on torch's current stream, `interop.dlpack`)."""
        cfg, head_dim = text_config(model.config)
        pages = -(-max_cache_len // kv_config.page_size)
        seqs = max_batch_size + spare_slots
        device = next(model.parameters()).device
        kwargs.setdefault("sync", "stream")
        tkv = TorchKVCache(kv_config, cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim,
                           num_pages=seqs * pages, max_seqs=seqs, max_pages_per_seq=pages, device=device,
                           backend=backend, **kwargs)
        return cls(tkv, decode=decode, config=cfg)

    @property
    def cache(self) -> TorchKVCache:
        """The `TorchKVCache` underneath, with every step stored (`flush`)."""
        self.flush()
        return self._tkv

    def flush(self) -> None:
        """Store the steps held aside (`_Held`: the rows of every pass since the cache was last stored, every layer
        in ONE program, `TorchKVCache.write_step`). Runs when a step would not fit the run (`tail_limit`) and from
        every method that reads or changes the cache outside a forward pass; so does `cache`. A pass some layer never
        reached raises `RuntimeError`: its rows are dropped (the passes before it are stored, and the cache's host
        accounting re-read from the device state)."""
        held, step = self._held, self._step
        if held is None:
            return
        self._held = None
        held.views, held.attend = None, {}             # drop the pools' views first: the write donates them
        missing = [i for i, r in enumerate(step.reached) if not r] if step is not None and step.held is held else []
        if missing:
            held.count = step.off
            held.reserved.pop()
        if held.count:
            self._tkv.write_step(join_reserved(held.reserved, held.buf.shape[2]), held.stacked())
        if missing:
            self._step = None
            self._tkv.manager.replace_state(self._tkv.state)
            raise RuntimeError(f"JMixedKVCache: layers {missing} of the last forward pass were never updated; its "
                               f"rows were dropped (the cache holds every pass before it)")

    # ------------------------------------------------------------------ transformers Cache API
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].seen if layer_idx < len(self.layers) else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.layers[layer_idx].get_mask_sizes(query_length)

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return -1

    @property
    def batch_size(self) -> int:
        return -1 if self.slots is None else int(self.slots.shape[0])

    def reset(self) -> None:
        """Release every slot; the cache is empty and can take a new batch."""
        self.flush()
        self._pending, self._step = None, None
        if self.slots is not None:
            for s in self.slots.tolist():
                self._tkv.release(s)
        self.slots, self.lens = None, None
        for layer in self.layers:
            layer.reset()

    def crop(self, tokens_to_remove: int) -> None:
        """``crop(-n)``: drop the last ``n`` tokens of every row (`TorchKVCache.correct_kv_lens`: at most
        ``max_draft_len`` behind the furthest row written; the twin's ring holds exactly that much slack).
        ``crop(0)`` does nothing; a positive value raises (as ``DynamicLayer.crop``)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative number of tokens to remove")
        n = -tokens_to_remove
        if n == 0 or self.slots is None:
            return
        self._between_passes("crop")
        self.flush()
        try:
            self._tkv.correct_kv_lens(np.full(self.slots.shape, -n, np.int32), self.slots)
        except ValueError as e:
            raise ValueError(f"crop({tokens_to_remove}): the cache rewinds at most max_draft_len="
                             f"{self._tkv.config.max_draft_len} tokens behind the furthest written one (build the "
                             f"KVCacheConfig with a larger max_draft_len); {e}") from None
        for layer in self.layers:
            layer.seen -= n
        self.lens = self.lens - n
        self._step = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: new row ``b`` continues old row ``beam_idx[b]`` (forks; old rows no one uses are freed)."""
        self._remap(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._remap(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.slots is not None:
            self._remap(np.repeat(np.arange(self.slots.shape[0]), repeats))

    # ------------------------------------------------------------------ internals
    def _between_passes(self, what: str) -> None:
        if any(layer.seen != self.layers[0].seen for layer in self.layers):
            raise ValueError(f"{what}: layers hold different lengths ({what} between whole forward passes only)")

    def _remap(self, src_rows) -> None:
        if self.slots is None:
            return
        if isinstance(src_rows, torch.Tensor):
            src_rows = src_rows.detach().cpu()
        src_rows = np.asarray(src_rows).astype(np.int64).reshape(-1)
        b = self.slots.shape[0]
        if src_rows.size and (src_rows.min() < 0 or src_rows.max() >= b):
            raise ValueError(f"reorder: row indices {src_rows.tolist()} out of range [0, {b})")
        self._between_passes("reorder")
        self.flush()
        used = set(src_rows.tolist())
        for r in range(b):                                   # free rows no one continues first (slots, pages)
            if r not in used:
                self._tkv.release(int(self.slots[r]))
        new_slots, taken = [], set()
        for r in src_rows.tolist():
            if r not in taken:
                taken.add(r)
                new_slots.append(int(self.slots[r]))
            else:
                new_slots.append(self._tkv.fork(int(self.slots[r])))
        self.slots = np.asarray(new_slots, np.int32)
        if self.lens is not None:
            self.lens = self.lens[src_rows]
        self._step = None

    def _admit(self, batch: int) -> None:
        free = self._tkv.manager.free_slots()
        if len(free) < batch:
            raise CacheCapacityError(f"JMixedKVCache: batch of {batch} rows but only {len(free)} free slots "
                                     f"(TorchKVCache max_seqs={self._tkv.max_seqs})")
        self.slots = np.asarray([self._tkv.admit() for _ in range(batch)], np.int32)
        self.lens = np.zeros(batch, np.int64)

    def _new_rows(self, batch: int, t: int, position_ids) -> np.ndarray:
        """Per batch row, how many of the step's ``t`` tokens are real (the trailing ones; the rest is left
        padding), from ``position_ids [B or 1, t]`` (checked once per step, vectorized)."""
        lens = self.lens
        if position_ids is None:
            return np.full(batch, t, np.int64)
        memo_key, pos = self._pos_memo
        if memo_key is not position_ids:
            pos = position_ids.detach().to("cpu", torch.int64).numpy()
            pos = np.broadcast_to(pos.reshape(-1, pos.shape[-1]), (batch, pos.shape[-1]))
            self._pos_memo = (position_ids, pos)
        if pos.shape[1] != t:
            raise ValueError(f"JMixedKVCache: position_ids has {pos.shape[1]} tokens, the step has {t}")
        new = pos[:, -1] + 1 - lens                           # real tokens of this step per row
        j = np.arange(t)[None, :]
        real = j >= t - new[:, None]                          # [B, t]
        want = lens[:, None] + j - (t - new[:, None])
        pad_one = np.where(real, pos[:, :1], pos) == pos[:, :1]    # padding: one repeated position (0 or 1)
        ok = (new >= 0) & (new <= t) & np.where(real, pos == want, pad_one).all(axis=1)
        if not ok.all():
            b = int(np.flatnonzero(~ok)[0])
            raise ValueError(f"JMixedKVCache: row {b} has position_ids {pos[b].tolist()} after {int(lens[b])} "
                             f"stored tokens; expected left padding followed by positions {int(lens[b])}, "
                             f"{int(lens[b]) + 1}, ... (right padding is not supported)")
        return new

    def _step_for(self, layer: JMixedLayer, batch: int, t: int, update_args) -> _Step:
        """The step ``layer`` takes part in: the open one, or (the first layer of a forward pass) a new one whose
        tokens are checked and accounted for once (``position_ids`` read from ``update_args``, the ``(args,
        kwargs)`` transformers gave ``update``). A new pass joins the run of held steps if it fits (`_defers`), else
        first stores that run (`flush`)."""
        step = self._step
        if step is not None and layer.seen == step.start and t == step.t:
            return step
        if any(other.seen != layer.seen for other in self.layers):          # a new pass: every layer level
            raise ValueError(f"JMixedKVCache: layer {layer.layer_idx} holds {layer.seen} tokens but the pass in "
                             f"flight started at {None if step is None else step.start} (layers must be updated "
                             f"once per forward pass, in any order)")
        held = self._held
        if held is not None and step is not None and step.held is held and not all(step.reached):
            self.flush()                               # a pass some layer never reached: raises
        new = self._new_rows(batch, t, _position_ids(*update_args))
        before = self.lens
        if held is not None and not self._defers(t, new, before, held.count):
            self.flush()
            held = None
        j = np.arange(t)[None, :]
        real = j >= t - new[:, None]
        seq = np.where(real, self.slots[:, None], -1).astype(np.int32).reshape(-1)     # token b * t + j
        pos = np.where(real, before[:, None] + j - (t - new[:, None]), 0).astype(np.int32).reshape(-1)
        if held is None and self._defers(t, new, before, 0):
            held = _Held(*self._buffer(batch))
        if held is not None:
            reserved = self._tkv.reserve_step(seq, pos)
            self._held = held
            step = _Step(layer.seen, t, None, before, new, held, len(self.layers))
            held.reserved.append(reserved)
            held.count += t
        else:
            step = _Step(layer.seen, t, self._tkv.plan_step(seq, pos, self.slots), before, new)
        self.lens = before + new
        self._step = step
        return step

    def _defers(self, t: int, new: np.ndarray, before: np.ndarray, count: int) -> bool:
        """Whether a step's rows are held aside (joining a run of ``count`` rows held already), stored when the run
        ends (one JAX program for the run; the layers read the cache through torch kernels, the run's rows dense in
        the form they read once stored): ``count + t`` within its format's limit (`tail_limit`, at most
        `MAX_HELD_TOKENS`: the rows held cost a copy of them for every layer; 0 for stage mode with the rotation
        lever), every row taking all ``t`` tokens (no padding inside), and (a mixed cache without ``last_n``) every
        new row past ``first_n``."""
        return (count + t <= self._tail_limit and bool((new == t).all())
                and (not self._tail_from or int(before.min()) >= self._tail_from))

    def _buffer(self, batch: int):
        """The held rows' buffer for ``batch`` rows and its per-layer tail views (`_Held`), made once and reused by
        every run."""
        got = self._bufs.get(batch)
        if got is None:
            sp = self.spec
            buf = torch.empty((sp.num_layers, 2, batch, sp.num_kv_heads, self._tail_limit, sp.head_dim),
                              dtype=self._tkv.attention_dtype, device=self._tkv.device)
            got = self._bufs[batch] = (buf, [(buf[i, 0].transpose(1, 2), buf[i, 1].transpose(1, 2))
                                             for i in range(sp.num_layers)])
        return got

    def _update(self, layer: JMixedLayer, k: torch.Tensor, v: torch.Tensor, update_args):
        batch, heads, t, dim = k.shape
        if self._pending is not None:
            layer_idx, self._pending = self._pending, None
            raise RuntimeError(f"JMixedKVCache(decode='fused'): layer {layer_idx}'s attention did not run through "
                               f"attn_implementation='jmixedkv' (call model.set_attn_implementation('jmixedkv'))")
        if k.requires_grad or v.requires_grad:
            raise ValueError("JMixedKVCache is inference-only (no gradient flows through the cache): run the model "
                             "under torch.no_grad() or torch.inference_mode() (generate() does)")
        if heads != self.spec.num_kv_heads or dim != self.spec.head_dim or v.shape != k.shape:
            raise ValueError(f"JMixedKVCache: layer {layer.layer_idx} K/V have shapes {list(k.shape)} / "
                             f"{list(v.shape)}, the cache holds {self.spec.num_kv_heads} heads x {self.spec.head_dim}")
        if self.slots is None:
            self._admit(batch)
        elif batch != self.slots.shape[0]:
            raise ValueError(f"JMixedKVCache: batch of {batch} rows, the cache holds {self.slots.shape[0]}")
        step = self._step_for(layer, batch, t, update_args)
        k0, v0 = k, v
        k, v = _attention_dtype(k, self._tkv), _attention_dtype(v, self._tkv)
        layer.seen += t
        if step.plan is None:                          # held aside: stored when the run ends (`flush`)
            if self._kernel_keeps and not step.first:  # the attention kernel keeps the rows (`_attend_tail`)
                return self._marker(layer, step, k, v)
            step.held.put(layer.layer_idx, step.off, k, v)
            step.reached[layer.layer_idx] = True
            if step.first:                             # nothing stored before: attention reads the step's own rows
                return k0, v0
            if self.decode == "stage":
                return self._stage_tail(step, layer)
            return self._marker(layer, step, k, v)
        if self.decode == "fused" and 1 <= t <= self._tkv.config.max_draft_len + 1:
            return self._marker(layer, step, k, v)
        kv = torch.cat([k, v], dim=1)                  # one crossing for K and V
        if step.first:                                 # nothing stored before: attention reads the step's own rows
            self._tkv.step_append(layer.layer_idx, kv, None, step.plan)
            return k0, v0
        kd, vd = self._tkv.step_dense(layer.layer_idx, kv, None, step.plan)
        return _align(kd, k.dtype, layer.seen, self.lens), _align(vd, k.dtype, layer.seen, self.lens)

    def _marker(self, layer: JMixedLayer, step: _Step, k: torch.Tensor, v: torch.Tensor):
        """Empty K/V placeholders that `jmixedkv_attention` recognises: the layer's attention runs there."""
        key = (layer.layer_idx, k.shape[0])       # heads, head_dim and dtype are the cache's (checked in `_update`)
        marker = self._markers.get(key)
        if marker is None:
            marker = self._markers[key] = k.new_empty((k.shape[0], k.shape[1], 0, k.shape[3]))
        marker._jmixedkv = (self, layer.layer_idx, k, v, step)              # read by jmixedkv_attention
        self._pending = layer.layer_idx
        return marker, marker

    def _fused(self, marker, query: torch.Tensor, scaling: Optional[float], sliding_window, softcap, sinks):
        """``query [B, Hq, Tq, D]`` -> ``[B, Tq, Hq, D]``: attention over the cache and the layer's new rows."""
        _, layer_idx, k, v, step = marker
        self._pending = None
        if query.shape[2] != k.shape[2]:
            raise ValueError(f"jmixedkv attention: {query.shape[2]} query tokens for a step of {k.shape[2]}")
        window = _int_or_none(sliding_window)
        cap = None if softcap is None else float(softcap)
        if step.plan is None:
            return self._attend_tail(step, layer_idx, query, k, v, scaling, window, cap, sinks)
        kvq = torch.cat([k, v, _attention_dtype(query, self._tkv)], dim=1)    # one crossing for K, V and Q
        out, _ = self._tkv.step_attend(layer_idx, kvq, None, None, step.plan, sm_scale=scaling,
                                       sliding_window=window, soft_cap=cap, sinks=sinks, return_lse=False)
        return out.to(query.dtype)

    def _attend_tail(self, step: _Step, layer_idx: int, query, k, v, scaling, window, cap, sinks):
        """A held-aside step's attention: a torch kernel over the cache as it was before the run (zero-copy views
        of its pools, `TorchKVCache.read_views`) plus the run's rows so far read dense (`interop.paged_ops.
        step_attention`; the result of appending them first: `tail_limit`), with the cache's rotation applied to
        q / the rows and undone on the output, and ``sinks`` as an LSE term."""
        q = _attention_dtype(query, self._tkv)
        held = step.held
        if self._hadamard is not None:                 # q and the rows rotated in float32, rounded once
            q = (q.float() @ self._hadamard).to(q.dtype)
        q = q.transpose(1, 2)                                                           # [B, T, heads, D] view
        attend = held.attend.get(step.t)
        if attend is None:
            views = self._views(held)
            attend = held.attend[step.t] = paged_ops.step_attention(
                views.pools, q, views.page_table, views.high_table, views.kv_lens, self._tkv.page_size, views.geom,
                tail=True)
        scale = self.spec.head_dim ** -0.5 if scaling is None else float(scaling)
        # the kernel rounds its output to the model's dtype itself (no cast launch) unless float32 work follows
        direct = sinks is None and self._hadamard is None and query.dtype == q.dtype
        odt = q.dtype if direct else None
        if self._kernel_keeps:                         # the step's rows from k / v, kept in the run by the kernel
            tk, tv = held.tails[layer_idx]
            out, lse = attend(q, layer_idx, scale, window, cap, tail_k=tk, tail_v=tv, tail_len=step.off + step.t,
                              new_k=k.transpose(1, 2), new_v=v.transpose(1, 2), out_dtype=odt,
                              return_lse=sinks is not None, validate=_checks(step, "attend"))
            step.reached[layer_idx] = True
        else:
            tk, tv = self._tail_rows(step, layer_idx)
            out, lse = attend(q, layer_idx, scale, window, cap, tail_k=tk, tail_v=tv, out_dtype=odt)
        if sinks is not None:
            out = paged_ops.apply_sinks(out, lse, sinks)
        if self._hadamard is not None:
            out = out @ self._hadamard
        return out if out.dtype == query.dtype else out.to(query.dtype)

    def _views(self, held: _Held):
        """The cache before a run of held steps as torch views (`TorchKVCache.read_views`), made once per run."""
        if held.views is None:
            held.views = self._tkv.read_views(self.slots, group=0)
        return held.views

    def _tail_rows(self, step: _Step, layer_idx: int):
        """The run's rows of one layer up to and including ``step``'s as ``[B, T, H, D]`` views, rotated (the
        rotation lever), or (NVFP4 / fp8 formats, `tail_form`) their values once stored
        (`interop.paged_ops.round_trip`)."""
        held = step.held
        kv = held.rows(layer_idx, step.off + step.t)                                   # [2, B, H, T, D]
        if self._hadamard is not None:
            kv = (kv.float() @ self._hadamard).to(kv.dtype)
        tk, tv = kv[0].transpose(1, 2), kv[1].transpose(1, 2)
        if self._tail_form is None:
            return tk, tv
        return paged_ops.round_trip(self._views(held).pools, layer_idx, tk, tv, low=self._tail_form == "nvfp4",
                                    block_scale=self._tkv.config.block_scale, validate=_checks(step, "round_trip"))

    def _stage_tail(self, step: _Step, layer: JMixedLayer):
        """A held-aside ``decode="stage"`` step: the layer's K / V as the model's attention reads them -- the cache
        before the run read from the views (twin rows where retained, counted as if the run were appended; NVFP4
        / fp8 decoded elsewhere), the run's rows (`_tail_rows`) appended, left-aligned with the mask: ``[B, H,
        seen, D]`` each, what staging after the append gives, bit for bit (`interop.paged_ops.stage`)."""
        views = self._views(step.held)
        tk, tv = self._tail_rows(step, layer.layer_idx)
        return paged_ops.stage(views.pools, layer.layer_idx, views.page_table, views.high_table, views.kv_lens,
                               self._tkv.page_size, views.geom, layer.seen, tk, tv, validate=_checks(step, "stage"),
                               check_values=False)


def _checks(step: _Step, kernel: str) -> bool:
    """Whether ``kernel``'s call checks its arguments: the first call of a step does; the step's other layers pass
    the same pools, tables and shapes."""
    if kernel in step.checked:
        return False
    step.checked.add(kernel)
    return True


def tail_limit(config: KVCacheConfig) -> int:
    """Most new tokens per row a `JMixedKVCache` step reads dense (held aside, stored after its layers ran) with
    the result of storing them first (each row read back in the form `tail_form` names). A plain cache reads
    every row in one form (no limit); a mixed cache reads its last ``last_n`` rows from the twin (limit ``last_n``),
    or with ``last_n = 0`` every row past ``first_n`` as NVFP4 (no limit; steps inside ``first_n`` are not held).
    0 (the step's rows are stored, then read, layer by layer) for K smoothing (its stored keys are shifted by a
    mean the step's rows would need first) and a float32 attention dtype (the torch kernels read 16-bit rows)."""
    if config.k_smoothing or config.attention_dtype.itemsize != 2:
        return 0
    return config.last_n if config.is_mixed and config.last_n else 1 << 30


def tail_form(config: KVCacheConfig) -> Optional[str]:
    """How a held-aside step's own rows read once stored (`tail_limit`): None (as given: a 16-bit plain pool or
    twin), ``"fp8"`` (the fp8 store form of an FP8 plain pool or twin) or ``"nvfp4"`` (NVFP4 alone, or a mixed
    cache without ``last_n``): `interop.paged_ops.round_trip`."""
    if config.has_low and not (config.is_mixed and config.last_n):
        return "nvfp4"
    return None if config.high_dtype.itemsize == 2 else "fp8"


def _attention_dtype(x: torch.Tensor, cache: TorchKVCache) -> torch.Tensor:
    return x if x.dtype == cache.attention_dtype else x.to(cache.attention_dtype)


def _int_or_none(x):
    return None if x is None else int(x)


def _align(dense: torch.Tensor, dtype, seen: int, lens: np.ndarray) -> torch.Tensor:
    """Staged ``dense [B, H, S, D]`` (row ``b``'s real rows at ``[0, lens[b])``) as ``[B, H, seen, D]`` aligned
    with transformers' left-padded mask: row ``b``'s real rows at ``[seen - lens[b], seen)``, zeros before."""
    if (lens == seen).all() and seen <= dense.shape[2]:
        return dense[:, :, :seen].to(dtype)
    pads = torch.from_numpy(seen - lens).to(dense.device)                             # [B]
    j = torch.arange(seen, device=dense.device)[None, :] - pads[:, None]               # [B, seen]
    ok = (j >= 0)[:, None, :, None]
    idx = j.clamp(0, dense.shape[2] - 1)[:, None, :, None].expand(-1, dense.shape[1], -1, dense.shape[3])
    return torch.where(ok, dense.gather(2, idx), torch.zeros((), dtype=dense.dtype, device=dense.device)).to(dtype)


def _position_ids(args, kwargs):
    """``position_ids`` from whatever transformers passed to ``Cache.update`` (``kwargs=`` / ``cache_kwargs``)."""
    for d in (kwargs, kwargs.get("kwargs"), kwargs.get("cache_kwargs"), *(a for a in args if isinstance(a, dict))):
        if isinstance(d, dict) and d.get("position_ids") is not None:
            return d["position_ids"]
    return None


def text_config(config):
    """``(text config, head_dim)`` of a transformers ``PretrainedConfig`` (multimodal ones: the text model's)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    return cfg, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def check_model_fits(config, what: str, have: tuple, smoothed: bool, instead: str):
    """The model of ``config`` fits a cache: its (layers, KV heads, head_dim) equal ``have``, and no K smoothing
    (``smoothed``: the cache attends over smoothed keys) under attention soft-capping, which does not commute with
    the shift (``instead``: what to do). Returns the text config; `ValueError` names the mismatch."""
    cfg, head_dim = text_config(config)
    cap = getattr(cfg, "attn_logit_softcapping", None)
    if smoothed and cap:
        raise ValueError(f"{what}: k_smoothing with attention soft-capping (attn_logit_softcapping={cap}): a "
                         f"soft-cap does not commute with the smoothing shift; {instead}")
    want = (cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim)
    if want != tuple(have):
        raise ValueError(f"{what}: the model has (layers, kv heads, head_dim) = {want}, the cache {tuple(have)}")
    return cfg


def _check_config(config, spec, decode, k_smoothing=False):
    what = "JMixedKVCache(decode='fused')" if decode == "fused" else "JMixedKVCache"
    cfg = check_model_fits(config, what, (spec.num_layers, spec.num_kv_heads, spec.head_dim),
                           decode == "fused" and k_smoothing,
                           "use decode='stage' (staged keys have the mean added back) or drop k_smoothing")
    impl = getattr(cfg, "_attn_implementation", None)
    if decode == "fused" and impl != ATTN_IMPLEMENTATION:
        raise ValueError(f"JMixedKVCache(decode='fused') needs the model's attention to be 'jmixedkv' (got {impl!r}): "
                         f"load it with attn_implementation='jmixedkv' (import interop.hf registers it)")


def sliding_windows(config, num_layers: int) -> list:
    """Per layer, its sliding window (None = full attention), from ``layer_types`` (Gemma-2/3, Qwen2, gpt-oss:
    ``"sliding_attention"``) or, without them, a config-wide ``sliding_window`` (Mistral: every layer)."""
    cfg, _ = text_config(config)
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if not window:
        return [None] * num_layers
    if types is None:
        return [int(window)] * num_layers
    return [int(window) if types[i] == "sliding_attention" else None for i in range(num_layers)]


def jmixedkv_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                       scaling: Optional[float] = None, sliding_window: Optional[int] = None,
                       softcap: Optional[float] = None, s_aux: Optional[torch.Tensor] = None, **kwargs):
    """transformers attention function ``attn_implementation="jmixedkv"``: ``query [B, Hq, Tq, D]`` ->
    ``(out [B, Tq, Hq, D], None)``.

    On a fused decode step of a `JMixedKVCache` (``key`` is its marker) it appends the layer's rows and attends
    over the cache in one program (`TorchKVCache.step_attend`) with the options the model passes: ``scaling``,
    ``sliding_window``, ``softcap`` (Gemma-2) and ``s_aux`` attention sinks (gpt-oss). On a step of a
    `interop.hf_static.JMixedStaticCache` attached to ``module`` it runs that cache's append + paged attention.
    Otherwise (prefill, staged decode, no cache) it is `dense_attention`."""
    static = getattr(module, "__dict__", {}).get("_jmixedkv_static")        # (no Module.__getattr__ miss)
    if static is not None:
        out = static.attention(module, query, attention_mask, scaling, sliding_window, softcap, s_aux, kwargs)
        if out is not None:
            return out, None
    marker = getattr(key, "_jmixedkv", None)
    if marker is not None:
        return marker[0]._fused(marker, query, scaling, sliding_window, softcap, s_aux), None
    if key.shape[-2] == 0 and query.shape[-2] > 0:
        raise RuntimeError("jmixedkv attention: empty keys without a JMixedKVCache marker")
    return dense_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                           sliding_window=sliding_window, softcap=softcap, s_aux=s_aux, **kwargs)


def dense_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: Optional[float] = None,
                    sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                    s_aux: Optional[torch.Tensor] = None, **kwargs):
    """Attention over dense ``key`` / ``value [B, H, S, D]`` with the model's mask: ``sdpa``, or the model's own
    eager attention when it passes soft-capping or sinks (which ``sdpa`` does not implement)."""
    if softcap is not None or s_aux is not None:
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if eager is None:
            raise NotImplementedError(f"jmixedkv attention: {type(module).__name__} passes "
                                      f"{'softcap' if softcap is not None else 's_aux (sinks)'}, which sdpa does not "
                                      f"implement, and its module has no eager_attention_forward")
        extra = {"softcap": softcap} if softcap is not None else {"s_aux": s_aux}
        if attention_mask is not None and attention_mask.dtype == torch.bool:    # our mask is sdpa's (boolean)
            attention_mask = torch.where(attention_mask, 0.0, torch.finfo(query.dtype).min).to(query.dtype)
        return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                     sliding_window=sliding_window, **extra, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  sliding_window=sliding_window, **kwargs)


AttentionInterface.register(ATTN_IMPLEMENTATION, jmixedkv_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)
