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

* ``decode="stage"`` (default): every step appends the new K/V, stages the layer (retained rows bit-exact from the
  twin, the rest dequantized NVFP4) and returns it; the model's own attention (``sdpa`` / ``eager``) runs on it.
  With a plain ``"bf16"`` cache, or a mixed cache whose ``first_n + last_n`` covers every row, the returned K/V
  are the appended ones bit for bit, so ``generate`` gives the tokens of ``DynamicCache``.
* ``decode="fused"``: prefill as above; a decode / verify step (``1 <= T <= max_draft_len + 1`` new tokens) skips
  staging and `jmixedkv_attention` runs `TorchKVCache.decode_attention` (the fused kernel on GPU) on the cache
  itself. Needs the model's attention to be ``"jmixedkv"`` (``from_pretrained(..., attn_implementation=
  "jmixedkv")`` or ``model.set_attn_implementation("jmixedkv")``): checked by `for_model` / ``config=``, and a
  fused step whose attention did not run through it raises `RuntimeError` at the next ``update``. Its float32
  attention is close to, not bit-equal with, torch's.
* ``crop(-n)`` rewinds ``n <= max_draft_len`` tokens (`TorchKVCache.correct_kv_lens`; assisted decoding);
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
from typing import Optional

import numpy as np
import torch
import transformers
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from jmixedkv.config import KVCacheConfig

from .torch_cache import CacheCapacityError, TorchKVCache

__all__ = ["JMixedKVCache", "JMixedLayer", "jmixedkv_attention", "ATTN_IMPLEMENTATION", "CACHE_KWARG"]

ATTN_IMPLEMENTATION = "jmixedkv"
# The keyword a transformers model / ``generate`` takes the cache by: ``cache`` from transformers 5.2x on
# (``past_key_values`` still accepted, deprecated), ``past_key_values`` only before (e.g. 5.17 on the GPU image).
CACHE_KWARG = ("cache" if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters
               else "past_key_values")
DECODE_MODES = ("stage", "fused")


class JMixedLayer(CacheLayerMixin):
    """One decoder layer's view of the shared `TorchKVCache` (layer ``layer_idx``); state lives in the owner."""

    is_compileable = False
    is_sliding = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, owner: "JMixedKVCache", layer_idx: int):
        super().__init__()
        self.owner, self.layer_idx = owner, layer_idx
        self.seen = 0                      # padded length transformers sees (includes left padding)
        self.lens = None                   # i64[B] real (stored) rows per batch row

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``key_states, value_states [B, H, T, D]`` (the step's new rows); returns what attention reads:
        ``[B, H, seen, D]`` staged K/V aligned with the mask, or, on a fused decode step, empty placeholders that
        `jmixedkv_attention` recognises."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self.owner._update(self, key_states, value_states, _position_ids(args, kwargs))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.seen, self.lens, self.is_initialized = 0, None, False

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("crop the whole JMixedKVCache (cache.crop(-n)): its layers share one TorchKVCache")

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("reorder the whole JMixedKVCache (cache.reorder_cache(beam_idx))")


class JMixedKVCache(Cache):
    """A transformers ``Cache`` over one `TorchKVCache` (see the module docstring for the semantics).

    Args:
      cache: the `TorchKVCache` (group 0 holds the model's layers: ``num_layers`` = the model's decoder layers,
        its KV heads and head_dim); its device must be the model's.
      decode: ``"stage"`` | ``"fused"``.
      config: the model's ``PretrainedConfig`` (optional): checks the shape, and for ``decode="fused"`` that
        ``config._attn_implementation == "jmixedkv"``.

    ``reset()`` releases the slots. One `TorchKVCache` slot per batch row: ``max_seqs`` >= the batch (beam
    search: batch x beams; ``batch_repeat_interleave`` needs the repeated batch).
    """

    def __init__(self, cache: TorchKVCache, *, decode: str = "stage", config=None):
        if not isinstance(cache, TorchKVCache):
            raise TypeError(f"JMixedKVCache wraps an interop.TorchKVCache, got {type(cache).__name__}")
        if decode not in DECODE_MODES:
            raise ValueError(f"JMixedKVCache: decode must be one of {DECODE_MODES}, got {decode!r}")
        spec = cache.groups[0]
        if spec.kv_factor != 2:
            raise ValueError("JMixedKVCache needs a K/V group (kv_factor=2), not an MLA latent")
        if config is not None:
            _check_config(config, spec, decode)
        self.cache, self.decode, self.spec = cache, decode, spec
        self.slots: Optional[np.ndarray] = None            # i32[B] slot of each batch row
        self._pos_memo = (None, None)
        self._pending = None                               # layer of a fused step whose attention has not run
        super().__init__(layers=[JMixedLayer(self, i) for i in range(spec.num_layers)])

    @classmethod
    def for_model(cls, model, kv_config: KVCacheConfig, *, max_batch_size: int, max_cache_len: int,
                  decode: str = "stage", backend: str = "auto", spare_slots: int = 0, **kwargs) -> "JMixedKVCache":
        """A cache sized for ``model`` (a transformers causal LM): ``max_batch_size`` rows (+ ``spare_slots`` for
        ``batch_repeat_interleave``) of up to ``max_cache_len`` real tokens each; ``kwargs`` go to `TorchKVCache`."""
        cfg, head_dim = _text_config(model.config)
        pages = -(-max_cache_len // kv_config.page_size)
        seqs = max_batch_size + spare_slots
        device = next(model.parameters()).device
        tkv = TorchKVCache(kv_config, cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim,
                           num_pages=seqs * pages, max_seqs=seqs, max_pages_per_seq=pages, device=device,
                           backend=backend, **kwargs)
        return cls(tkv, decode=decode, config=cfg)

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
        self._pending = None
        if self.slots is not None:
            for s in self.slots.tolist():
                self.cache.release(s)
        self.slots = None
        for layer in self.layers:
            layer.reset()

    def crop(self, tokens_to_remove: int) -> None:
        """``crop(-n)``: drop the last ``n`` tokens of every row (`TorchKVCache.correct_kv_lens`: at most
        ``max_draft_len`` behind the furthest row written; the twin's ring holds exactly that much slack). ``crop(0)`` does nothing; a positive value raises (as ``DynamicLayer.crop``)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative number of tokens to remove")
        n = -tokens_to_remove
        seen = self.layers[0].seen
        if n == 0 or self.slots is None:
            return
        if any(layer.seen != seen for layer in self.layers):
            raise ValueError("crop: layers hold different lengths (crop between whole forward passes only)")
        try:
            self.cache.correct_kv_lens(np.full(self.slots.shape, -n, np.int32), self.slots)
        except ValueError as e:
            raise ValueError(f"crop({tokens_to_remove}): the cache rewinds at most max_draft_len="
                             f"{self.cache.config.max_draft_len} tokens behind the furthest written one (build the "
                             f"KVCacheConfig with a larger max_draft_len); {e}") from None
        for layer in self.layers:
            layer.seen -= n
            layer.lens = layer.lens - n

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: new row ``b`` continues old row ``beam_idx[b]`` (forks; old rows no one uses are freed)."""
        self._remap(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._remap(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.slots is not None:
            self._remap(np.repeat(np.arange(self.slots.shape[0]), repeats))

    # ------------------------------------------------------------------ internals
    def _remap(self, src_rows) -> None:
        if self.slots is None:
            return
        if isinstance(src_rows, torch.Tensor):
            src_rows = src_rows.detach().cpu()
        src_rows = np.asarray(src_rows).astype(np.int64).reshape(-1)
        b = self.slots.shape[0]
        if src_rows.size and (src_rows.min() < 0 or src_rows.max() >= b):
            raise ValueError(f"reorder: row indices {src_rows.tolist()} out of range [0, {b})")
        if any(layer.seen != self.layers[0].seen for layer in self.layers):
            raise ValueError("reorder: layers hold different lengths (reorder between whole forward passes only)")
        used = set(src_rows.tolist())
        for r in range(b):                                   # free rows no one continues first (slots, pages)
            if r not in used:
                self.cache.release(int(self.slots[r]))
        new_slots, taken = [], set()
        for r in src_rows.tolist():
            if r not in taken:
                taken.add(r)
                new_slots.append(int(self.slots[r]))
            else:
                new_slots.append(self.cache.fork(int(self.slots[r])))
        self.slots = np.asarray(new_slots, np.int32)
        for layer in self.layers:
            if layer.lens is not None:
                layer.lens = layer.lens[src_rows]

    def _admit(self, batch: int) -> None:
        free = self.cache.manager.free_slots()
        if len(free) < batch:
            raise CacheCapacityError(f"JMixedKVCache: batch of {batch} rows but only {len(free)} free slots "
                                     f"(TorchKVCache max_seqs={self.cache.max_seqs})")
        self.slots = np.asarray([self.cache.admit() for _ in range(batch)], np.int32)

    def _new_rows(self, layer: JMixedLayer, batch: int, t: int, position_ids) -> np.ndarray:
        """Per batch row, how many of the step's ``t`` tokens are real (the trailing ones; the rest is left
        padding), from ``position_ids [B or 1, t]`` (memoized per step: every layer passes the same tensor)."""
        lens = layer.lens
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
        for b in range(batch):
            r = int(new[b])
            ok = (0 <= r <= t and (pos[b, t - r:] == lens[b] + np.arange(r)).all()
                  and len(set(pos[b, :t - r].tolist())) <= 1)      # padding: one repeated position (0 or 1)
            if not ok:
                raise ValueError(f"JMixedKVCache: row {b} has position_ids {pos[b].tolist()} after {int(lens[b])} "
                                 f"stored tokens; expected left padding followed by positions {int(lens[b])}, "
                                 f"{int(lens[b]) + 1}, ... (right padding is not supported)")
        return new

    def _update(self, layer: JMixedLayer, k: torch.Tensor, v: torch.Tensor, position_ids):
        batch, heads, t, dim = k.shape
        if self._pending is not None:
            layer_idx, self._pending = self._pending, None
            raise RuntimeError(f"JMixedKVCache(decode='fused'): layer {layer_idx}'s attention did not run through "
                               f"attn_implementation='jmixedkv' (call model.set_attn_implementation('jmixedkv'))")
        if k.requires_grad or v.requires_grad:
            raise ValueError("JMixedKVCache is inference-only (no gradient flows through the cache): run the model "
                             "under torch.no_grad() or torch.inference_mode() (generate() does)")
        if heads != self.spec.num_kv_heads or dim != self.spec.head_dim:
            raise ValueError(f"JMixedKVCache: layer {layer.layer_idx} K/V have {heads} heads x {dim}, the cache "
                             f"holds {self.spec.num_kv_heads} x {self.spec.head_dim}")
        if self.slots is None:
            self._admit(batch)
        elif batch != self.slots.shape[0]:
            raise ValueError(f"JMixedKVCache: batch of {batch} rows, the cache holds {self.slots.shape[0]}")
        if layer.lens is None:
            layer.lens = np.zeros(batch, np.int64)
        new = self._new_rows(layer, batch, t, position_ids)
        kt, vt = k.transpose(1, 2), v.transpose(1, 2)                              # [B, T, H, D]
        if (new == t).all():
            rows, cols = np.repeat(np.arange(batch), t), np.tile(np.arange(t), batch)
            ks, vs = kt.reshape(batch * t, heads, dim), vt.reshape(batch * t, heads, dim)
        else:
            rows = np.concatenate([np.full(int(r), b) for b, r in enumerate(new)]).astype(np.int64)
            cols = np.concatenate([np.arange(t - int(r), t) for r in new]).astype(np.int64)
            ri, ci = torch.from_numpy(rows).to(k.device), torch.from_numpy(cols).to(k.device)
            ks, vs = kt[ri, ci], vt[ri, ci]
        if rows.size:
            pos = (layer.lens[rows] + cols - (t - new[rows])).astype(np.int32)
            self.cache.append(layer.layer_idx, ks.contiguous(), vs.contiguous(), self.slots[rows], pos)
        layer.lens = layer.lens + new
        layer.seen += t
        if self.decode == "fused" and 1 <= t <= self.cache.config.max_draft_len + 1:
            marker = k.new_empty((batch, heads, 0, dim))
            marker._jmixedkv = (self, layer.layer_idx)     # read by jmixedkv_attention
            self._pending = layer.layer_idx
            return marker, marker
        return self._staged(layer, k.dtype)

    def _staged(self, layer: JMixedLayer, dtype):
        kd, vd = self.cache.stage(layer.layer_idx, self.slots).dense()                  # [B, H, S, D]
        seen, lens = layer.seen, layer.lens
        if (lens == seen).all() and seen <= kd.shape[2]:
            return kd[:, :, :seen].to(dtype), vd[:, :, :seen].to(dtype)
        pads = torch.from_numpy(seen - lens).to(kd.device)                             # [B]
        j = torch.arange(seen, device=kd.device)[None, :] - pads[:, None]                # [B, seen]
        ok = (j >= 0)[:, None, :, None]
        idx = j.clamp(0, kd.shape[2] - 1)[:, None, :, None].expand(-1, kd.shape[1], -1, kd.shape[3])
        zero = torch.zeros((), dtype=kd.dtype, device=kd.device)
        return (torch.where(ok, kd.gather(2, idx), zero).to(dtype), torch.where(ok, vd.gather(2, idx), zero).to(dtype))

    def _fused(self, layer_idx: int, query: torch.Tensor, scaling: Optional[float]) -> torch.Tensor:
        """``query [B, Hq, Tq, D]`` -> ``[B, Tq, Hq, D]`` via `TorchKVCache.decode_attention` (no staging)."""
        self._pending = None
        q = query.transpose(1, 2).contiguous()
        if q.dtype != self.cache.attention_dtype:
            q = q.to(self.cache.attention_dtype)
        out, _ = self.cache.decode_attention(layer_idx, q, self.slots, sm_scale=scaling)
        return out.to(query.dtype)


def _position_ids(args, kwargs):
    """``position_ids`` from whatever transformers passed to ``Cache.update`` (``kwargs=`` / ``cache_kwargs``)."""
    for d in (kwargs, kwargs.get("kwargs"), kwargs.get("cache_kwargs"), *(a for a in args if isinstance(a, dict))):
        if isinstance(d, dict) and d.get("position_ids") is not None:
            return d["position_ids"]
    return None


def _text_config(config):
    """``(text config, head_dim)`` of a transformers ``PretrainedConfig`` (multimodal ones: the text model's)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    return cfg, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _check_config(config, spec, decode):
    cfg, head_dim = _text_config(config)
    want = (cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim)
    have = (spec.num_layers, spec.num_kv_heads, spec.head_dim)
    if want != have:
        raise ValueError(f"JMixedKVCache: the model has (layers, kv heads, head_dim) = {want}, the cache {have}")
    impl = getattr(cfg, "_attn_implementation", None)
    if decode == "fused" and impl != ATTN_IMPLEMENTATION:
        raise ValueError(f"JMixedKVCache(decode='fused') needs the model's attention to be 'jmixedkv' (got {impl!r}): "
                         f"load it with attn_implementation='jmixedkv' (import interop.hf registers it)")


def jmixedkv_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                       scaling: Optional[float] = None, **kwargs):
    """transformers attention function ``attn_implementation="jmixedkv"``: ``query [B, Hq, Tq, D]`` ->
    ``(out [B, Tq, Hq, D], None)``. On a fused decode step of a `JMixedKVCache` (``key`` is its marker) runs
    `TorchKVCache.decode_attention` on the cache; otherwise (prefill, staged decode, no cache) it is ``sdpa``."""
    marker = getattr(key, "_jmixedkv", None)
    if marker is not None:
        owner, layer_idx = marker
        return owner._fused(layer_idx, query, scaling), None
    if key.shape[-2] == 0 and query.shape[-2] > 0:
        raise RuntimeError("jmixedkv attention: empty keys without a JMixedKVCache marker")
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


AttentionInterface.register(ATTN_IMPLEMENTATION, jmixedkv_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)
