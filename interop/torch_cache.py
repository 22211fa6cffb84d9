"""A torch-facing mixed-precision KV cache for engines written in PyTorch.

`TorchKVCache` owns one `jmixedkv.CacheManager` (host capacity checks, jitted transitions with the state
donated) and speaks torch: K/V, queries and indices come in as torch tensors, staged caches, gathered rows and
attention outputs go out as torch tensors, all through the zero-copy DLPack bridge (`interop.dlpack`). Every
input is validated on the host first (dtype, device, shape, slot / layer / page ids) and a bad one raises a
``ValueError`` naming the offending value.

Read and speculative calls are resolved lazily at call time (``importlib`` on first use), so this module works
with or without those modules and picks up the real implementations when they are importable; `implementations()`
reports which one each call uses:

===================  ===========================================================  =====================================
call                 real implementation (when importable)                        fallback
===================  ===========================================================  =====================================
``stage``            ``jmixedkv.read.stage(state, layer, seq_slots, group=,         ``reference.stage_reference``, paged
                     backend=) -> StagedCache``                                   like ``read.stage`` (compact ids)
``gather_rows``      ``jmixedkv.read.gather_rows(state, layer, seq_slots,          ``reference.rows_reference``
                     indices, group=, scratch_dtype=, backend=)``                 (attention dtype only, scale 1)
``decode_attention`` ``jmixedkv.attention.decode_attention(state, layer, q,        ``stage_reference`` +
                     seq_slots, group=, sm_scale=, backend=) -> (out, lse)``      ``attention_reference``
``correct_kv_lens``  ``jmixedkv.speculative.correct_kv_lens(state, offsets)``     ``kv_lens + offsets``
                                                                                  (``dataclasses.replace``)
``accept``           ``jmixedkv.speculative.accept(state, seq_slots,               ``correct_kv_lens`` with
                     num_accepted, num_drafts)``                                  ``num_accepted - num_drafts``
===================  ===========================================================  =====================================

Length correction follows `jmixedkv.speculative`: ``offsets i32[S] <= 0`` are *added* (``kv_lens += offsets``,
``-min(max_draft_len, kv_len) <= offset <= 0``, 0 on idle slots); ``accept`` keeps the verified token plus
``num_accepted`` of ``num_drafts`` drafts (``kv_len += num_accepted - num_drafts``). Pages are kept.

Streams and aliasing: inputs cross with `from_torch` (default ``sync=True``: the tensor's CUDA device is
synchronized first, so K/V written on any torch stream are complete) and outputs with `to_torch` (JAX work is
finished before torch sees the tensor). Outputs are zero-copy views of fresh JAX arrays; ``kv_lens()`` is a view of
the live state: drop it before the next append (JAX silently skips donating a buffer torch still views).

torch.library: ``torch.ops.jmixedkv.decode_attention(handle, layer, q, seq_slots)`` and
``torch.ops.jmixedkv.stage_dense(handle, layer, seq_slots)`` wrap the reads as custom ops with fake kernels
(``cache.handle`` names the cache), so torch.compile / torch.export can trace an engine around them.

Shapes: ``T`` tokens, ``B`` sequences, ``H`` KV heads, ``Hq`` query heads, ``D`` head_dim, ``S`` =
``max_pages_per_seq * page_size``. Staged / gathered K and V are in the config's attention dtype.
"""
from __future__ import annotations

import dataclasses
import importlib
import itertools
import weakref
from typing import NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jmixedkv import reference
from jmixedkv.config import KVCacheConfig
from jmixedkv.manager import CacheCapacityError, CacheManager
from jmixedkv.rope import RopeSpec
from jmixedkv.state import GroupSpec

from . import layouts
from .dlpack import from_torch, to_torch, torch_device_of

__all__ = ["TorchKVCache", "TorchStaged", "CacheCapacityError", "implementations", "cache_from_handle"]

FLOAT_INPUTS = (torch.bfloat16, torch.float16, torch.float32)
INDEX_INPUTS = (torch.int32, torch.int64)

# (module, attribute) of each real implementation; resolved at call time
_REAL = {
    "stage": ("jmixedkv.read", "stage"),
    "gather_rows": ("jmixedkv.read", "gather_rows"),
    "decode_attention": ("jmixedkv.attention", "decode_attention"),
    "correct_kv_lens": ("jmixedkv.speculative", "correct_kv_lens"),
    "accept": ("jmixedkv.speculative", "accept"),
}


def _real(name: str):
    """The real implementation of ``name``, or None if its module (or the function) does not exist yet."""
    module, attr = _REAL[name]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:      # the module exists but one of its own imports is broken: surface that
            raise
        return None
    return getattr(mod, attr, None)


_JITTED: dict = {}


def _real_jit(name: str, static=("group", "backend", "validate", "scratch_dtype")):
    """`_real(name)` wrapped in ``jax.jit`` (host validation off: `TorchKVCache` validates before calling)."""
    fn = _real(name)
    if fn is None:
        return None
    if _JITTED.get(name, (None,))[0] is not fn:
        import inspect
        params = inspect.signature(fn).parameters
        _JITTED[name] = (fn, jax.jit(fn, static_argnames=[a for a in static if a in params]))
    return _JITTED[name][1]


def implementations() -> dict[str, str]:
    """Which implementation each lazily resolved call uses right now (``"module.fn"`` or ``"fallback"``)."""
    return {k: (".".join(_REAL[k]) if _real(k) is not None else "fallback") for k in _REAL}


# ---------------------------------------------------------------------------------------------- jitted fallbacks
def _batch_lens(kv_lens, seq):
    return jnp.where(seq >= 0, kv_lens[jnp.clip(seq, 0, kv_lens.shape[0] - 1)], 0)


def _stage_fallback(state, layer, seq, group):
    """(pages [B*W, kv, H, page, D], page_table i32[B, W], kv_lens i32[B]): `read.stage`'s compact layout."""
    dense = reference.stage_reference(state, layer, seq, group)                  # [B, kv, H, W*page, D]
    b, kv, h, _, d = dense.shape
    page, w = state.page_size, state.max_pages_per_seq
    lens = _batch_lens(state.kv_lens, seq)
    npages = (lens + page - 1) // page
    j = jnp.arange(w, dtype=jnp.int32)[None, :]
    table = jnp.where(j < npages[:, None], (jnp.cumsum(npages) - npages)[:, None] + j, -1).astype(jnp.int32)
    per_page = jnp.transpose(dense.reshape(b, kv, h, w, page, d), (0, 3, 1, 2, 4, 5)).reshape(b * w, kv, h, page, d)
    dst = jnp.where(table >= 0, table, b * w).reshape(-1)
    pages = jnp.zeros((b * w, kv, h, page, d), dense.dtype).at[dst].set(per_page, mode="drop")
    return pages, table, lens


def _rows_fallback(state, layer, seq, idx, group):
    return reference.rows_reference(state, layer, seq[:, None], idx, group), jnp.ones(seq.shape, jnp.float32)


def _attention_fallback(state, layer, q, seq, group, sm_scale):
    staged = reference.stage_reference(state, layer, seq, group)
    k, v = staged[:, 0], staged[:, -1]
    out, lse = reference.attention_reference(q, k, v, _batch_lens(state.kv_lens, seq), sm_scale=sm_scale)
    ok = jnp.isfinite(lse)
    out = jnp.where(ok[..., None], out, 0.0).astype(state.config.attention_dtype)
    return out, jnp.where(ok, lse, -jnp.inf)


def _correct_fallback(state, offsets):
    return dataclasses.replace(state, kv_lens=state.kv_lens + offsets)


_stage_fallback_jit = jax.jit(_stage_fallback, static_argnames=("group",))
_rows_fallback_jit = jax.jit(_rows_fallback, static_argnames=("group",))
_attention_fallback_jit = jax.jit(_attention_fallback, static_argnames=("group", "sm_scale"))
_correct_fallback_jit = jax.jit(_correct_fallback)


class TorchStaged(NamedTuple):
    """A staged (plain paged) cache as torch tensors, zero-copy views of the JAX result.

    ``pages [N, kv, H, page, D]`` (FlashInfer's 5-D HND cache; ``k_pages = pages[:, 0]``), ``page_table i32[B, W]``
    (compact staged ids, -1 past each row's pages), ``kv_lens i32[B]``."""

    pages: torch.Tensor
    page_table: torch.Tensor
    kv_lens: torch.Tensor

    @property
    def k_pages(self) -> torch.Tensor:
        return self.pages[:, 0]

    @property
    def v_pages(self) -> Optional[torch.Tensor]:
        return self.pages[:, 1] if self.pages.shape[1] == 2 else None

    def dense(self):
        """``(k, v)`` each ``[B, H, W * page, D]`` (a copy), zero at rows ``>= kv_len`` (``v`` None for a latent)."""
        b, w = self.page_table.shape
        page = self.pages.shape[-2]
        got = self.pages[self.page_table.clamp(min=0).long()]                      # [B, W, kv, H, page, D]
        got = got.permute(0, 2, 3, 1, 4, 5).reshape(b, self.pages.shape[1], self.pages.shape[2], w * page, -1)
        pos = torch.arange(w * page, device=got.device)
        ok = (self.page_table[:, pos // page] >= 0) & (pos[None, :] < self.kv_lens[:, None])
        got = torch.where(ok[:, None, None, :, None], got, torch.zeros((), dtype=got.dtype, device=got.device))
        return got[:, 0], (got[:, 1] if got.shape[1] == 2 else None)

    def flashinfer_csr(self):
        """FlashInfer ``(kv_indptr, kv_indices, kv_last_page_len)`` (numpy int32) over ``pages``."""
        return layouts.flashinfer_csr(self.page_table.cpu().numpy(), self.kv_lens.cpu().numpy(),
                                      np.arange(self.page_table.shape[0]), self.pages.shape[-2])


# ---------------------------------------------------------------------------------------------- the cache
class TorchKVCache:
    """Mixed-precision paged KV cache with a torch API.

    Args:
      config: `KVCacheConfig` (dtype, first_n, last_n, page_size, max_draft_len, ...).
      num_layers, num_kv_heads, head_dim: model shape (one K/V layer group), or pass ``groups`` instead.
      num_pages: low (history) pages; max_seqs: sequence slots; max_pages_per_seq: page-table width.
      device: torch device the engine uses; must match the JAX device the state lives on (default: derived
        from JAX's default device).
      backend: ``"auto"`` | ``"reference"`` | ``"pallas"`` for appends and reads.
      token_buckets: pad the token axis of every append to the next power of two (>= 8) with padding tokens
        (slot -1, skipped), so the jitted append compiles once per bucket instead of once per token count
        (a power-of-two count crosses without a copy).
      validate: before every read, check the page tables, lengths and indices on the host
        (``jmixedkv.read.validate_read`` when importable; costs a device-to-host copy of the tables).
      init_kwargs: passed to `jmixedkv.init_state` (``gs``, ``poison``, ``page_order``, ...).
    """

    def __init__(self, config: KVCacheConfig, num_layers: Optional[int] = None, num_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, *, num_pages: int, max_seqs: int,
                 max_pages_per_seq: Optional[int] = None, groups: Optional[Sequence[GroupSpec]] = None,
                 device: Union[str, torch.device, None] = None, backend: str = "auto", validate: bool = True,
                 token_buckets: bool = True,
                 **init_kwargs):
        if groups is None:
            if None in (num_layers, num_kv_heads, head_dim):
                raise ValueError("TorchKVCache needs num_layers, num_kv_heads and head_dim (or groups=)")
            groups = (GroupSpec(num_layers, num_kv_heads, head_dim),)
        self.manager = CacheManager(config, groups, num_pages, max_seqs, max_pages_per_seq, backend=backend,
                                    **init_kwargs)
        self.config = config
        self.backend = backend
        self.validate = validate
        self.handle = next(_HANDLE_IDS)          # for the torch.library ops (see the end of this module)
        _HANDLES[self.handle] = weakref.ref(self)
        self.token_buckets = token_buckets
        jax_dev = next(iter(self.manager.state.kv_lens.devices()))
        # commit the fresh state to its device: jit outputs are committed, so the second append would otherwise
        # compile again for the changed committed-ness of its inputs
        self.manager.state = jax.device_put(self.manager.state, jax_dev)
        self.device = torch_device_of(jax_dev)
        if device is not None and not _same_device(torch.device(device), self.device):
            raise ValueError(f"TorchKVCache: device {device} does not match the JAX device {jax_dev} the cache "
                             f"lives on (torch {self.device}); set JAX's default device or pass device={self.device}")

    # ------------------------------------------------------------------ properties / queries
    @property
    def state(self):
        return self.manager.state

    @property
    def groups(self):
        return self.state.groups

    @property
    def max_seqs(self) -> int:
        return self.manager.max_seqs

    @property
    def page_size(self) -> int:
        return self.config.page_size

    @property
    def free_pages(self) -> int:
        return self.manager.free_pages

    @property
    def free_high_pages(self) -> int:
        return self.manager.free_high_pages

    @property
    def attention_dtype(self) -> torch.dtype:
        from .dlpack import torch_dtype
        return torch_dtype(self.config.attention_dtype)

    def kv_lens(self) -> torch.Tensor:
        """i32[max_seqs] corrected lengths (a zero-copy view of the device state; read-only)."""
        return to_torch(self.state.kv_lens)

    def kv_len(self, slot: int) -> int:
        return int(self.state.kv_lens[self._slot(slot, "kv_len")])

    def can_admit(self, slot: Optional[int] = None) -> bool:
        return self.manager.can_admit(slot)

    def can_append(self, seq_slots, positions) -> bool:
        seq, pos = self._index_pair(seq_slots, positions, "can_append")
        return self.manager.can_append(seq, pos)

    # ------------------------------------------------------------------ transitions
    def admit(self, slot: Optional[int] = None) -> int:
        return self.manager.admit(slot)

    def release(self, slot: int) -> None:
        self.manager.release(self._slot(slot, "release"))

    def append(self, layer: Optional[int], k: torch.Tensor, v: Optional[torch.Tensor], seq_slots, positions, *,
               group: int = 0, rope: Optional[RopeSpec] = None) -> None:
        """Store new K/V rows of one layer (``k, v [T, H, D]``) or all layers (``layer=None``: ``[L, T, H, D]``).

        ``seq_slots`` / ``positions``: int32 (or int64, converted on the host) ``[T]``; slot -1 = padding.
        ``v=None`` for an MLA-latent group. Raises `CacheCapacityError` if pages run out (nothing written)."""
        spec = self._group(group, "append")
        seq, pos = self._index_pair(seq_slots, positions, "append")
        if layer is not None:
            self._layer(layer, spec, "append")
        want = ((spec.num_layers,) if layer is None else ()) + (seq.shape[0], spec.num_kv_heads, spec.head_dim)
        self._check_float(k, "k", want, "append")
        if spec.kv_factor == 1:
            if v is not None:
                raise ValueError(f"append: group {spec.name!r} stores an MLA latent (kv_factor=1); pass v=None")
        else:
            self._check_float(v, "v", want, "append")
            if v.dtype != k.dtype:
                raise ValueError(f"append: k is {k.dtype} but v is {v.dtype}")
        if self.token_buckets:
            k, v, seq, pos = _pad_tokens(k, v, seq, pos, token_axis=0 if layer is not None else 1)
        kj = from_torch(k, copy=None)
        vj = None if v is None else from_torch(v, copy=None)
        self.manager.append(kj, vj, seq, pos, layer=layer, group=group, rope=rope)

    def stage(self, layer: int, seq_slots, *, group: int = 0) -> TorchStaged:
        """Plain paged cache a reader sees, in the attention dtype, for batch rows ``seq_slots [B]`` (-1 = padding):
        retained positions are the high rows bit-for-bit, others dequantized NVFP4; see `TorchStaged`."""
        spec = self._group(group, "stage")
        self._layer(layer, spec, "stage")
        seq = self._slots(seq_slots, "stage")
        self._validate_read(layer, seq, None, group, "stage")
        fn = _real_jit("stage")
        if fn is not None:
            st = fn(self.state, jnp.int32(layer), jnp.asarray(seq), group=group, backend=self.backend, validate=False)
            pages, table, lens = st.pages, st.page_table, st.kv_lens
        else:
            pages, table, lens = _stage_fallback_jit(self.state, jnp.int32(layer), jnp.asarray(seq), group=group)
        return TorchStaged(to_torch(pages), to_torch(table), to_torch(lens))

    def gather_rows(self, layer: int, seq_slots, indices, *, group: int = 0, scratch_dtype: Optional[str] = None):
        """Rows at positions ``indices [B, K]`` (-1 = padding) of sequences ``seq_slots [B]``.

        Returns ``(k, v, scale)``: ``k, v [B, K, H, D]`` (``v`` None for a latent group) in the attention dtype, or
        float8_e4m3fn with ``scratch_dtype="fp8"`` (value = f32(row) * scale[b]); ``scale f32[B]``. Positions
        outside ``[0, n)`` read as zero."""
        spec = self._group(group, "gather_rows")
        self._layer(layer, spec, "gather_rows")
        seq = self._slots(seq_slots, "gather_rows")
        idx = self._indices(indices, "gather_rows indices", ndim=2)
        if idx.shape[0] != seq.shape[0]:
            raise ValueError(f"gather_rows: indices has {idx.shape[0]} rows for {seq.shape[0]} sequences")
        if scratch_dtype not in (None, "fp8", "float8_e4m3fn"):
            raise ValueError(f"gather_rows: scratch_dtype must be None or 'fp8', got {scratch_dtype!r}")
        self._validate_read(layer, seq, idx, group, "gather_rows")
        fn = _real_jit("gather_rows")
        if fn is not None:
            rows, scale = fn(self.state, jnp.int32(layer), jnp.asarray(seq), jnp.asarray(idx), group=group,
                             scratch_dtype=scratch_dtype, backend=self.backend, validate=False)
        elif scratch_dtype is not None:
            raise NotImplementedError("gather_rows: the fp8 scratch needs jmixedkv.read (not importable)")
        else:
            rows, scale = _rows_fallback_jit(self.state, jnp.int32(layer), jnp.asarray(seq), jnp.asarray(idx),
                                             group=group)
        k = to_torch(rows[:, :, 0])
        v = to_torch(rows[:, :, 1]) if spec.kv_factor == 2 else None
        return k, v, to_torch(scale)

    def decode_attention(self, layer: int, q: torch.Tensor, seq_slots, *, group: int = 0,
                         sm_scale: Optional[float] = None):
        """Attention of queries ``q [B, Tq, Hq, D]`` (or ``[B, Hq, D]``) in the attention dtype over the cache.

        Query token ``t`` sits at position ``n - Tq + t`` (append the new K/V first); ``Tq <= max_draft_len + 1``;
        GQA: ``Hq % H == 0``. Returns ``(out [B, Tq, Hq, D] attention dtype, lse f32[B, Tq, Hq])`` (no ``Tq`` axis
        for a 3-D ``q``); padding rows give zeros and LSE -inf."""
        spec = self._group(group, "decode_attention")
        self._layer(layer, spec, "decode_attention")
        seq = self._slots(seq_slots, "decode_attention")
        self._check_query(q, spec, seq.shape[0])
        squeeze = q.dim() == 3
        self._validate_read(layer, seq, None, group, "decode_attention")
        qj = from_torch(q.unsqueeze(1) if squeeze else q, copy=None)
        fn = _real("decode_attention")
        if fn is not None:
            out, lse = fn(self.state, jnp.int32(layer), qj, jnp.asarray(seq), group=group, sm_scale=sm_scale,
                          backend=self.backend)
        else:
            out, lse = _attention_fallback_jit(self.state, jnp.int32(layer), qj, jnp.asarray(seq), group=group,
                                               sm_scale=sm_scale)
        out, lse = to_torch(out), to_torch(lse)
        return (out[:, 0], lse[:, 0]) if squeeze else (out, lse)

    # ------------------------------------------------------------------ speculative decoding
    def correct_kv_lens(self, offsets, seq_slots=None) -> None:
        """Add non-positive ``offsets`` to the lengths (rewind rejected drafts): ``kv_lens += offsets``.

        ``offsets``: int ``[max_seqs]``, or ``[B]`` aligned with ``seq_slots``; each in
        ``[-min(max_draft_len, kv_len), 0]`` and 0 on idle slots (else `ValueError`)."""
        full = self._offsets(offsets, seq_slots, "correct_kv_lens")
        fn = _real("correct_kv_lens")
        off = jnp.asarray(full, jnp.int32)
        state = fn(self.state, off) if fn is not None else _correct_fallback_jit(self.state, off)
        self.manager.replace_state(state)

    def accept(self, seq_slots, num_accepted, num_drafts) -> None:
        """After a verify append of ``num_drafts[b] + 1`` rows (the verified token + drafts) to ``seq_slots[b]``,
        keep the verified token and the first ``num_accepted[b]`` drafts: ``kv_len += num_accepted - num_drafts``."""
        seq = self._slots(seq_slots, "accept")
        acc = self._counts(num_accepted, seq, "accept num_accepted")
        dra = self._counts(num_drafts, seq, "accept num_drafts")
        live = seq >= 0
        bad = live & ((acc < 0) | (acc > dra) | (dra > self.config.max_draft_len))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"accept: need 0 <= num_accepted <= num_drafts <= max_draft_len "
                             f"({self.config.max_draft_len}); slot {seq[i]} has num_accepted={acc[i]}, "
                             f"num_drafts={dra[i]}")
        if len(set(seq[live].tolist())) != int(live.sum()):
            raise ValueError(f"accept: seq_slots must be distinct, got {seq.tolist()}")
        fn = _real("accept")
        if fn is not None:
            state = fn(self.state, jnp.asarray(seq), jnp.asarray(acc), jnp.asarray(dra))
            self.manager.replace_state(state)
        else:
            self.correct_kv_lens(np.where(live, acc - dra, 0), seq)

    # ------------------------------------------------------------------ layout exports (see interop.layouts)
    def flashinfer_page_table(self, seq_slots):
        """FlashInfer CSR ``(kv_indptr, kv_indices, kv_last_page_len)`` int32 torch tensors on ``self.device``
        for the low (NVFP4) pages of ``seq_slots``."""
        seq = self._slots(seq_slots, "flashinfer_page_table")
        csr = layouts.flashinfer_csr(np.asarray(self.state.page_table), np.asarray(self.state.kv_lens), seq,
                                     self.page_size)
        return tuple(torch.from_numpy(a).to(self.device) for a in csr)

    def block_table(self, seq_slots):
        """vLLM-style ``(block_table i32[B, max_pages] (-1 padded), seq_lens i32[B])`` torch tensors."""
        seq = self._slots(seq_slots, "block_table")
        table, lens = layouts.block_table(np.asarray(self.state.page_table), np.asarray(self.state.kv_lens), seq,
                                          self.page_size)
        return torch.from_numpy(table).to(self.device), torch.from_numpy(lens).to(self.device)

    # ------------------------------------------------------------------ validation helpers
    def _group(self, group, what):
        if not (isinstance(group, int) and 0 <= group < len(self.groups)):
            raise ValueError(f"{what}: group {group!r} out of range [0, {len(self.groups)})")
        return self.groups[group]

    def _layer(self, layer, spec, what):
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < spec.num_layers:
            raise ValueError(f"{what}: layer {layer!r} out of range [0, {spec.num_layers}) of group {spec.name!r}")

    def _slot(self, slot, what):
        if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)) or not 0 <= slot < self.max_seqs:
            raise ValueError(f"{what}: slot {slot!r} out of range [0, {self.max_seqs})")
        return int(slot)

    def _indices(self, x, what, ndim):
        """Host int32 numpy copy of an index tensor / list (int32 or int64; CPU or this cache's device)."""
        if isinstance(x, torch.Tensor):
            if x.dtype not in INDEX_INPUTS:
                raise ValueError(f"{what}: expected an int32 (or int64) tensor, got {x.dtype}")
            if x.device.type != "cpu" and not _same_device(x.device, self.device):
                raise ValueError(f"{what}: tensor is on {x.device}, the cache is on {self.device}")
            arr = x.detach().cpu().numpy()
        else:
            arr = np.asarray(x)
            if arr.size and not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(f"{what}: expected integers, got {arr.dtype}")
        if arr.ndim != ndim:
            raise ValueError(f"{what}: expected a {ndim}-D index array, got shape {arr.shape}")
        info = np.iinfo(np.int32)
        if arr.size and (arr.min() < info.min or arr.max() > info.max):
            raise ValueError(f"{what}: values outside int32")
        return arr.astype(np.int32)

    def _slots(self, seq_slots, what):
        seq = self._indices(seq_slots, f"{what} seq_slots", ndim=1)
        bad = sorted({int(s) for s in seq if s < -1 or s >= self.max_seqs})
        if bad:
            raise ValueError(f"{what}: sequence slots {bad} out of range [-1, {self.max_seqs}) (-1 = padding)")
        return seq

    def _index_pair(self, seq_slots, positions, what):
        seq = self._slots(seq_slots, what)
        pos = self._indices(positions, f"{what} positions", ndim=1)
        if seq.shape != pos.shape:
            raise ValueError(f"{what}: seq_slots {seq.shape} and positions {pos.shape} must have the same length")
        return seq, pos

    def _offsets(self, offsets, seq_slots, what):
        off = self._indices(offsets, f"{what} offsets", ndim=1)
        if seq_slots is None:
            if off.shape[0] != self.max_seqs:
                raise ValueError(f"{what}: offsets must have max_seqs={self.max_seqs} entries, got {off.shape[0]}")
            full = off
        else:
            seq = self._slots(seq_slots, what)
            if seq.shape != off.shape:
                raise ValueError(f"{what}: seq_slots {seq.shape} and offsets {off.shape} must have the same length")
            full = np.zeros(self.max_seqs, np.int32)
            np.add.at(full, seq[seq >= 0], off[seq >= 0])
        lens, active = np.asarray(self.state.kv_lens), np.asarray(self.state.active)
        lim = np.where(active, np.minimum(self.config.max_draft_len, lens), 0)
        bad = [(s, int(lens[s]), int(full[s])) for s in range(self.max_seqs) if full[s] > 0 or full[s] < -lim[s]]
        if bad:
            raise ValueError(f"{what}: offsets must lie in [-min(max_draft_len={self.config.max_draft_len}, kv_len), "
                             f"0] and be 0 on idle slots; (slot, kv_len, offset) = {bad}")
        return full

    def _check_float(self, x, name, shape, what):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{what}: {name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in FLOAT_INPUTS:
            raise ValueError(f"{what}: {name} must be one of {[str(d) for d in FLOAT_INPUTS]}, got {x.dtype}")
        if not _same_device(x.device, self.device):
            raise ValueError(f"{what}: {name} is on {x.device}, the cache is on {self.device}")
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"{what}: {name} must have shape {list(shape)}, got {list(x.shape)}")

    def _check_query(self, q, spec, batch):
        if not isinstance(q, torch.Tensor):
            raise ValueError(f"decode_attention: q must be a torch.Tensor, got {type(q).__name__}")
        if q.dim() not in (3, 4):
            raise ValueError(f"decode_attention: q must be [B, Tq, Hq, D] or [B, Hq, D], got {list(q.shape)}")
        hq, d = q.shape[-2], q.shape[-1]
        if q.shape[0] != batch or d != spec.head_dim or hq % spec.num_kv_heads:
            raise ValueError(f"decode_attention: q {list(q.shape)} needs B={batch}, D={spec.head_dim} and Hq a "
                             f"multiple of H={spec.num_kv_heads}")
        self._check_float(q, "q", tuple(q.shape), "decode_attention")
        if q.dtype != self.attention_dtype:
            raise ValueError(f"decode_attention: q is {q.dtype}, the cache's attention dtype is {self.attention_dtype}")
        tq = q.shape[1] if q.dim() == 4 else 1
        if not 1 <= tq <= self.config.max_draft_len + 1:
            raise ValueError(f"decode_attention: Tq={tq} query tokens per sequence; expected 1..max_draft_len+1 = "
                             f"{self.config.max_draft_len + 1} (use stage() for prefill attention)")

    def _validate_read(self, layer, seq, indices, group, what):
        """Host checks of the tables (real ``validate_read`` when importable) and of ``indices`` (-1 <= i < n)."""
        if not self.validate:
            return
        try:
            from jmixedkv.read import validate_read
        except ImportError:
            validate_read = None
        if validate_read is not None:
            validate_read(self.state, layer, seq, indices, group=group, op=what)
            return
        if indices is not None:
            lens = np.asarray(self.state.kv_lens)
            for b, s in enumerate(seq):
                n = int(lens[s]) if s >= 0 else 0
                bad = np.flatnonzero((indices[b] < -1) | ((indices[b] >= n) & (s >= 0)))
                if bad.size:
                    raise ValueError(f"{what}: indices[{b}, {bad[0]}]={indices[b, bad[0]]} out of range [-1, {n}) "
                                     f"for sequence slot {s}")

    def _counts(self, x, seq, what):
        """Per-row counts: a scalar or ``[B]`` aligned with ``seq``."""
        arr = np.asarray(x) if not isinstance(x, torch.Tensor) else None
        if arr is not None and arr.ndim == 0:
            if not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(f"{what}: expected an integer, got {arr.dtype}")
            return np.full(seq.shape, int(arr), np.int32)
        out = self._indices(x, what, ndim=1)
        if out.shape != seq.shape:
            raise ValueError(f"{what}: {out.shape[0]} entries for {seq.shape[0]} sequence slots")
        return out


def _bucket(n: int, minimum: int = 8) -> int:
    return max(minimum, 1 << max(n - 1, 0).bit_length())


def _pad_tokens(k, v, seq, pos, token_axis):
    """Pad the token axis to `_bucket` size with zero rows at slot -1 (skipped by append)."""
    t = seq.shape[0]
    b = _bucket(t)
    if b == t:
        return k, v, seq, pos
    pad = [0, 0] * (k.dim() - 1 - token_axis) + [0, b - t]
    k = torch.nn.functional.pad(k, pad)
    v = None if v is None else torch.nn.functional.pad(v, pad)
    seq = np.concatenate([seq, np.full(b - t, -1, np.int32)])
    pos = np.concatenate([pos, np.zeros(b - t, np.int32)])
    return k, v, seq, pos


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type == "cpu":
        return True
    ia = torch.cuda.current_device() if a.index is None else a.index
    ib = torch.cuda.current_device() if b.index is None else b.index
    return ia == ib


# ---------------------------------------------------------------------------------------------- torch.library ops
# The read calls as custom ops, so torch.compile / torch.export can trace an engine that uses the cache: the cache
# is named by its integer ``handle`` (a graph constant); fake kernels give the output shapes. Reads only: appends
# change the cache's own (JAX) state, not a tensor, and stay eager.
_HANDLE_IDS = itertools.count()
_HANDLES: dict = {}


def cache_from_handle(handle: int) -> TorchKVCache:
    ref = _HANDLES.get(handle)
    cache = None if ref is None else ref()
    if cache is None:
        raise ValueError(f"no live TorchKVCache with handle {handle}")
    return cache


@torch.library.custom_op("jmixedkv::decode_attention", mutates_args=())
def decode_attention_op(handle: int, layer: int, q: torch.Tensor,
                        seq_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.jmixedkv.decode_attention(handle, layer, q [B, Tq, Hq, D], seq_slots i32[B]) -> (out, lse)``."""
    return cache_from_handle(handle).decode_attention(layer, q, seq_slots)


@decode_attention_op.register_fake
def _(handle, layer, q, seq_slots):
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("jmixedkv::stage_dense", mutates_args=())
def stage_dense_op(handle: int, layer: int, seq_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.jmixedkv.stage_dense(handle, layer, seq_slots i32[B]) -> (k, v)`` each ``[B, H, S, D]``."""
    k, v = cache_from_handle(handle).stage(layer, seq_slots).dense()
    return k.contiguous(), (k if v is None else v).contiguous()


@stage_dense_op.register_fake
def _(handle, layer, seq_slots):
    cache = cache_from_handle(handle)
    spec = cache.groups[0]
    shape = (seq_slots.shape[0], spec.num_kv_heads, cache.state.max_pages_per_seq * cache.page_size, spec.head_dim)
    return (seq_slots.new_empty(shape, dtype=cache.attention_dtype),
            seq_slots.new_empty(shape, dtype=cache.attention_dtype))
