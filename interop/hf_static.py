"""`JMixedStaticCache`: the mixed-precision cache as a *compileable* transformers ``Cache``.

transformers compiles a model's decode forward when the cache is compileable (``generate`` does it by itself on a
GPU, as for ``StaticCache``) and replays it as a CUDA graph. This cache is built for that: its state is device
tensors at fixed addresses (`interop.static_cache.StaticPagedCache`), and each layer's work is two torch custom ops
(append, then paged attention over twin + NVFP4 pages: `interop.paged_ops`), with no host round trip and no JAX
call on the hot path.

Use it with ``attn_implementation="jmixedkv"`` (the attention function of `interop.hf`)::

    cache = JMixedStaticCache.for_model(model, KVCacheConfig.recommended(), max_batch_size=4, max_cache_len=1024)
    out = model.generate(input_ids, max_new_tokens=32, do_sample=False, past_key_values=cache)

Semantics:

* The layer's ``update`` only hands its new K / V to the attention function; that function appends them at the
  positions the model passes (``position_ids``: real token ``i`` of a row at position ``i``; left padding, the
  tokens before a row's real ones in its first step, is not stored) and attends.
* The first step of an empty cache (prefill) attends over its own K / V with the model's mask (``sdpa``, or the
  model's eager attention when it passes a soft-cap or sinks), as engines do; every later step (decode, verify,
  a later chunk) runs ``jmixedkv::paged_attention`` over the cache with the model's ``scaling``,
  ``sliding_window``, ``softcap`` and ``s_aux`` sinks.
* Lengths are per-layer device counters: ``get_seq_length()`` is a 0-d tensor (as ``StaticCache``'s),
  ``get_mask_sizes`` is ``(max_cache_len, 0)``.
* A step whose positions do not continue a row, or run past ``max_cache_len``, leaves that row unchanged, gives it
  NaN outputs and sets an error bit: `raise_errors` (called by ``reset`` and ``crop``) raises `ValueError` naming it.
* ``crop(-n)`` rewinds ``n <= max_draft_len`` tokens (assisted decoding); ``reorder_cache`` /
  ``batch_select_indices`` / ``batch_repeat_interleave`` copy whole rows (beam search), within
  ``max_batch_size`` rows.
* Sliding layers (``layer_types`` / ``sliding_window`` in the config) are marked ``is_sliding``, attend over their
  window and hold only it (a ring of pages per row), as transformers' own static sliding layers do.
* ``KVCacheConfig(..., k_smoothing=True)``: the cache smooths K itself (each row's K mean frozen from its prefill,
  `StaticPagedCache`); the model needs nothing. Refused for models with attention soft-capping (Gemma-2).
"""
from __future__ import annotations

from typing import Optional

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from jmixedkv.config import KVCacheConfig

from . import hf
from .static_cache import StaticPagedCache

__all__ = ["JMixedStaticCache", "JMixedStaticLayer"]


class JMixedStaticLayer(CacheLayerMixin):
    """One decoder layer's view of the shared `StaticPagedCache`; ``cumulative_length`` (a 0-d device tensor) is
    the padded length transformers counts."""

    is_compileable = True
    is_croppable = True
    supports_early_init = False

    def __init__(self, owner: "JMixedStaticCache", layer_idx: int, sliding_window: Optional[int], device):
        super().__init__()
        self.owner, self.layer_idx = owner, layer_idx
        self.is_sliding, self.sliding_window = sliding_window is not None, sliding_window
        self.cumulative_length = torch.zeros((), dtype=torch.int64, device=device)
        self.prefilled = False                  # host flag: the first step of an empty cache attends densely
        self.pending = None                     # (k, v) of the step in flight, read by the attention function
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the pools are allocated with the cache."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Hand ``key_states, value_states [B, H, T, D]`` (the step's new rows) to ``attn_implementation=
        "jmixedkv"``, which appends and attends; returns them unchanged."""
        self.owner._check_rows(self.layer_idx, key_states, value_states)
        self.pending = (key_states, value_states)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.max_cache_len, 0

    def get_seq_length(self):
        return self.cumulative_length

    def get_max_length(self) -> int:
        return self.owner.max_cache_len

    def reset(self) -> None:
        self.cumulative_length.zero_()
        self.prefilled, self.pending = False, None

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("crop the whole JMixedStaticCache (cache.crop(-n)): its layers share one pool")


class JMixedStaticCache(Cache):
    """A compileable transformers ``Cache`` over one `StaticPagedCache` (module docstring: semantics).

    Args:
      paged: the pools (its ``num_layers`` / KV heads / head_dim must be the model's).
      config: the model's ``PretrainedConfig`` (optional): checks the shape and marks sliding layers.
    """

    def __init__(self, paged: StaticPagedCache, *, config=None):
        if not isinstance(paged, StaticPagedCache):
            raise TypeError(f"JMixedStaticCache wraps an interop.static_cache.StaticPagedCache, got "
                            f"{type(paged).__name__}")
        windows = [None] * paged.num_layers
        if config is not None:
            _check_model(config, paged)
            windows = hf.sliding_windows(config, paged.num_layers)
        self.paged, self._batch = paged, None
        self._plans = {}                        # group -> (position_ids, StepPlan, layers that used it): `_plan`
        super().__init__(layers=[JMixedStaticLayer(self, i, windows[i], paged.device)
                                 for i in range(paged.num_layers)])
        if not torch.compiler.is_compiling():
            for t in paged.tensors() + [layer.cumulative_length for layer in self.layers]:
                torch._dynamo.mark_static_address(t)

    @classmethod
    def for_model(cls, model, kv_config: KVCacheConfig, *, max_batch_size: int, max_cache_len: int,
                  **kwargs) -> "JMixedStaticCache":
        """A cache sized for ``model`` (a transformers causal LM whose attention is ``"jmixedkv"``), attached to its
        attention modules; ``kwargs`` go to `StaticPagedCache` (``global_scale``, ``high_scale``; ``sliding_windows``
        defaults to the config's)."""
        cfg, head_dim = hf.text_config(model.config)
        impl = getattr(cfg, "_attn_implementation", None)
        if impl != hf.ATTN_IMPLEMENTATION:
            raise ValueError(f"JMixedStaticCache needs the model's attention to be 'jmixedkv' (got {impl!r}): load it "
                             f"with attn_implementation='jmixedkv' or call model.set_attn_implementation('jmixedkv')")
        device = next(model.parameters()).device
        kwargs.setdefault("sliding_windows", hf.sliding_windows(cfg, cfg.num_hidden_layers))
        paged = StaticPagedCache(kv_config, cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim,
                                 max_batch_size=max_batch_size, max_cache_len=max_cache_len, device=device, **kwargs)
        cache = cls(paged, config=cfg)
        cache.attach(model)
        return cache

    def attach(self, model) -> None:
        """Point ``model``'s attention modules (those with a ``layer_idx``) at this cache: the attention function
        finds it there (a compiled forward reads it as a constant)."""
        found = 0
        for module in model.modules():
            idx = getattr(module, "layer_idx", None)
            if isinstance(idx, int) and hasattr(module, "config"):
                module._jmixedkv_static = self
                found += 1
        if not found:
            raise ValueError(f"JMixedStaticCache.attach: {type(model).__name__} has no attention module with a "
                             f"layer_idx")

    # ------------------------------------------------------------------ transformers Cache API
    @property
    def max_batch_size(self) -> int:
        return self.paged.max_batch_size

    @property
    def max_cache_len(self) -> int:
        return self.paged.max_cache_len

    def get_seq_length(self, layer_idx: int = 0):
        return self.layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return self.max_cache_len

    def raise_errors(self) -> None:
        """Raise `ValueError` if an earlier step was refused (`StaticPagedCache.raise_errors`; one host sync)."""
        self.paged.raise_errors()

    def reset(self) -> None:
        """Every row empty; raises first if a step since the last check was refused."""
        self._plans.clear()
        try:
            self.raise_errors()
        finally:
            self.paged.reset()
            for layer in self.layers:
                layer.reset()

    def crop(self, tokens_to_remove: int) -> None:
        """``crop(-n)``: drop the last ``n <= max_draft_len`` tokens of every row; ``crop(0)`` does nothing. ``n`` may
        be a 0-d tensor (transformers computes it from `get_seq_length`, a device counter)."""
        tokens_to_remove = int(tokens_to_remove)
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative number of tokens to remove")
        n = -tokens_to_remove
        if n == 0:
            return
        self._plans.clear()
        self.raise_errors()
        self.paged.rewind(n)
        for layer in self.layers:
            layer.cumulative_length.sub_(n)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._plans.clear()
        self.paged.select_rows(beam_idx.detach().cpu())

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._plans.clear()
        self.paged.select_rows(torch.as_tensor(indices).detach().cpu())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._plans.clear()
        if self._batch is None:
            raise ValueError("batch_repeat_interleave before the first step: the cache does not know the batch yet")
        self.paged.select_rows(torch.arange(self._batch).repeat_interleave(repeats))

    # ------------------------------------------------------------------ the attention function's side
    def _plan(self, layer_idx: int, positions: torch.Tensor, batch: int):
        """The step's `StepPlan` for ``layer_idx``'s group: made by the group's first layer of a forward, reused by
        the others (the model passes every layer the same ``position_ids`` tensor), so a step does the bookkeeping
        once per group, not once per layer. The group's last layer drops it: nothing outlives the forward (a
        compiled step starts from the same empty memo every time)."""
        group = self.paged.group_index(layer_idx)
        memo = self._plans.get(group)
        if memo is None or memo[0] is not positions or layer_idx in memo[2] or memo[1].batch != batch:
            rows = positions.reshape(-1, positions.shape[-1])
            memo = self._plans[group] = (positions, self.paged.plan_step(layer_idx, rows, batch), set())
        memo[2].add(layer_idx)
        if len(memo[2]) == len(self.paged.groups[group].layers):
            del self._plans[group]
        return memo[1]

    def _check_rows(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        p = self.paged
        if k.requires_grad or v.requires_grad:
            raise ValueError("JMixedStaticCache is inference-only: run the model under torch.no_grad() or "
                             "torch.inference_mode() (generate() does)")
        b, h, _, d = k.shape
        if b > p.max_batch_size or (h, d) != (p.num_kv_heads, p.head_dim) or v.shape != k.shape:
            raise ValueError(f"JMixedStaticCache: layer {layer_idx} K/V have shapes {list(k.shape)} / "
                             f"{list(v.shape)}; the cache holds up to {p.max_batch_size} rows of {p.num_kv_heads} "
                             f"heads x {p.head_dim}")
        self._batch = b

    def attention(self, module, query, attention_mask, scaling, sliding_window, softcap, sinks, kwargs):
        """The step of ``module``'s layer (its ``update`` ran): append the pending K / V and attend; ``None`` when
        the layer has no step in flight (the model ran with another cache)."""
        layer = self.layers[module.layer_idx]
        if layer.pending is None:
            return None
        k, v = layer.pending
        layer.pending = None
        positions = kwargs.get("position_ids")
        if positions is None:
            raise ValueError("JMixedStaticCache: the model passed no position_ids to its attention; the cache stores "
                             "each token at its position")
        lens, bad = self.paged.append(layer.layer_idx, k, v, plan=self._plan(layer.layer_idx, positions, k.shape[0]))
        layer.cumulative_length.add_(k.shape[2])
        if not layer.prefilled:                 # the first step: attend over its own rows (exact), as engines do
            layer.prefilled = True
            if attention_mask is not None and attention_mask.shape[-1] > k.shape[2]:    # sized max_cache_len
                attention_mask = attention_mask[..., :k.shape[2]]
            return hf.dense_attention(module, query, k, v, attention_mask, scaling=scaling,
                                      sliding_window=sliding_window, softcap=softcap, s_aux=sinks, **kwargs)[0]
        out = self.paged.attend(layer.layer_idx, query, lens, bad, sm_scale=scaling,
                                sliding_window=None if sliding_window is None else int(sliding_window),
                                soft_cap=None if softcap is None else float(softcap), sinks=sinks)
        return out.to(query.dtype)


def _check_model(config, paged: StaticPagedCache) -> None:
    """``paged`` fits the model of ``config``: its geometry, and no K smoothing under attention soft-capping."""
    hf.check_model_fits(config, "JMixedStaticCache", (paged.num_layers, paged.num_kv_heads, paged.head_dim),
                        paged.k_mean is not None, "build the KVCacheConfig without k_smoothing")
