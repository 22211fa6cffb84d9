"""A torch-facing mixed-precision KV cache for engines written in PyTorch.

`TorchKVCache` only converts torch <-> JAX and delegates: one `jmixedkv.CacheManager` owns the state, the host
capacity mirror and the jitted, donated transitions; the reads call `jmixedkv.staging.stage` /
`jmixedkv.gather.gather_rows` / `jmixedkv.decode.decode_attention`; every transition (append, fork, the
speculative `correct_kv_lens` / `accept`) is the manager's. K/V, queries and
indices come in as torch tensors; staged caches, gathered rows and attention outputs go out as torch tensors, all
through the zero-copy DLPack bridge (`interop.dlpack`). Inputs are checked on the host first (dtype, device,
shape, slot / layer / page ids); a bad one raises a ``ValueError`` naming the offending value.

Length correction (`correct_kv_lens`, `accept`) follows `jmixedkv.speculative`; pages are kept.

Hot path: every call takes ``sync=`` (the DLPack stream policy, `interop.dlpack`; ``"stream"`` has no host round
trip) and ``validate=`` (host checks of the page tables: a device-to-host copy per read), by default the cache's
own settings. ``stage(None, ...)`` stages every layer of a group in one call.

Aliasing: outputs are zero-copy views of fresh JAX arrays; ``kv_lens()`` is a view of the live state: drop it
before the next append (JAX silently skips donating a buffer torch still views).

LSE convention: every LSE returned here is the **natural-log** log-sum-exp of the scaled logits (JAX's). FlashInfer
returns and takes base-2 LSE by default (``log2(sum 2^(x * log2 e))``); convert with `lse_to_base2` /
`lse_from_base2`.

What a page table means (FlashInfer / vLLM handoff, see `interop.layouts`):

* ``flashinfer_page_table`` / ``block_table`` index the **NVFP4 pool** (``state.pools[g].low``): an engine
  reading them sees *history only* -- plain NVFP4, the high-precision twin (first-N / last-N rows) is dropped.
* ``stage(...).flashinfer_csr()`` / ``stage(...).block_table()`` index the **staged pages**: the mixed semantics
  (retained rows bit-exact from the twin, others dequantized NVFP4), in the attention dtype.

torch.library: ``torch.ops.jmixedkv.decode_attention(handle, layer, q, seq_slots)`` and
``torch.ops.jmixedkv.stage_dense(handle, layer, seq_slots)`` wrap the reads as custom ops with fake kernels
(``cache.handle`` names the cache), so torch.compile / torch.export can trace an engine around them.

Shapes: ``T`` tokens, ``B`` sequences, ``L`` layers, ``H`` KV heads, ``Hq`` query heads, ``D`` head_dim,
``S = max_pages_per_seq * page_size``. Staged / gathered K and V are in the config's attention dtype.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import weakref
from typing import NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jmixedkv import checks, gather, staging, step
from jmixedkv.checks import CacheError, describe_error
from jmixedkv.allocator import Allocator
from jmixedkv.decode import decode_attention as _jax_decode_attention
from jmixedkv.config import KVCacheConfig
from jmixedkv.manager import CacheCapacityError, CacheManager
from jmixedkv.offload import page_bucket
from jmixedkv.rope import RopeSpec
from jmixedkv.state import AppendPlan, GroupSpec

from . import layouts
from .dlpack import HotBridge, from_torch, to_torch, torch_device_of, torch_dtype
from .torch_paged import TorchPools

__all__ = ["TorchKVCache", "TorchStaged", "StepPlan", "ReservedStep", "join_reserved", "ReadViews",
           "CacheCapacityError", "cache_from_handle", "lse_to_base2", "lse_from_base2"]

FLOAT_INPUTS = (torch.bfloat16, torch.float16, torch.float32)
INDEX_INPUTS = (torch.int32, torch.int64)
LOG2_E = 1.0 / math.log(2.0)
SYNC_MODES = (True, False, "stream")

# host validation off inside jit: TorchKVCache validates before calling
_stage_jit = jax.jit(staging.stage, static_argnames=("group", "backend", "validate", "num_staged_pages"))
_gather_jit = jax.jit(gather.gather_rows, static_argnames=("group", "backend", "validate", "scratch_dtype", "overlay"))


def lse_to_base2(lse):
    """Natural-log LSE (ours) -> base-2 LSE (FlashInfer's default): ``lse * log2(e)``; -inf stays -inf.

    Works on torch tensors, JAX / NumPy arrays and floats; float32 math, the input's type back."""
    return lse * LOG2_E


def lse_from_base2(lse2):
    """Base-2 LSE (FlashInfer's default) -> natural-log LSE (ours, `jmixedkv.decode.merge_attention`):
    ``lse2 / log2(e)``; -inf stays -inf."""
    return lse2 / LOG2_E


class StepPlan(NamedTuple):
    """One engine step's tokens, checked and accounted for once (`TorchKVCache.plan_step`), on the device:
    ``seq`` / ``pos`` i32[T] (slot -1 = padding token), ``rows`` i32[B] the batch rows' slots, ``width`` the
    pages per row that cover the longest row after the step (a power of two: one program per bucket), ``group``,
    ``append`` the step's write targets (`jmixedkv.state.AppendPlan`: pages allocated, lengths counted once)."""

    seq: jax.Array
    pos: jax.Array
    rows: jax.Array
    width: int
    group: int
    append: Optional[AppendPlan] = None


class ReservedStep(NamedTuple):
    """A step `TorchKVCache.reserve_step` checked and accounted for on the host: ``tokens i32[2 T]`` (``seq |
    pos``) and its ``group``, stored by `TorchKVCache.write_step`."""
    tokens: np.ndarray
    group: int


def join_reserved(steps, batch: int) -> ReservedStep:
    """Several `ReservedStep` s of one group, reserved in turn, as one for `TorchKVCache.write_step`: each step's
    tokens a ``[batch, t_s]`` grid (token ``b * t_s + j``), joined row by row into ``[batch, sum t_s]`` (token
    ``b * T' + j``), the order `write_step`'s ``kv [2 L, B, H, T', D]`` has."""
    steps = list(steps)
    sizes = [s.tokens.shape[0] // 2 for s in steps]
    if not steps or len({s.group for s in steps}) != 1 or any(n % batch for n in sizes):
        raise ValueError(f"join_reserved: needs steps of one group, each a [batch={batch}, t] grid of tokens; got "
                         f"groups {[s.group for s in steps]} with {sizes} tokens")
    if len(steps) == 1:
        return steps[0]
    grids = [s.tokens.reshape(2, batch, -1) for s in steps]                # [seq | pos, B, t_s] of each step
    return ReservedStep(np.concatenate(grids, axis=2).reshape(-1), steps[0].group)


class ReadViews(NamedTuple):
    """`TorchKVCache.read_views`: ``pools`` (`interop.torch_paged.TorchPools` of zero-copy views), and for the batch
    rows ``page_table i32[B, MP]``, ``high_table i32[B, W]`` (None without a twin), ``kv_lens i32[B]``; ``geom``
    the twin's `jmixedkv.layout.TwinGeometry` (None without a twin)."""
    pools: "TorchPools"
    page_table: torch.Tensor
    high_table: Optional[torch.Tensor]
    kv_lens: torch.Tensor
    geom: object


class TorchStaged(NamedTuple):
    """A staged (plain paged) cache as torch tensors, zero-copy views of the JAX result: the **mixed** semantics
    (retained rows from the twin bit-exact, others dequantized NVFP4) in the attention dtype.

    ``pages [N, kv, H, page, D]`` (FlashInfer's 5-D HND cache; ``k_pages = pages[:, 0]``) or
    ``[L, N, kv, H, page, D]`` when every layer was staged (``stage(None, ...)``; pick one with ``layer(i)``),
    ``page_table i32[B, W]`` (compact staged ids, -1 past each row's pages), ``kv_lens i32[B]``."""

    pages: torch.Tensor
    page_table: torch.Tensor
    kv_lens: torch.Tensor

    def layer(self, i: int) -> "TorchStaged":
        """One layer of an all-layer staging (``pages [L, N, ...]`` -> ``[N, ...]``; shares the page table)."""
        if self.pages.dim() != 6:
            raise ValueError(f"TorchStaged.layer: pages {list(self.pages.shape)} hold one layer already")
        if not 0 <= i < self.pages.shape[0]:
            raise ValueError(f"TorchStaged.layer: layer {i} out of range [0, {self.pages.shape[0]})")
        return TorchStaged(self.pages[i], self.page_table, self.kv_lens)

    def _one_layer(self, what):
        if self.pages.dim() == 6:
            raise ValueError(f"TorchStaged.{what}: all-layer staging, pick a layer first: staged.layer(i).{what}")
        return self.pages

    @property
    def k_pages(self) -> torch.Tensor:
        return self._one_layer("k_pages")[:, 0]

    @property
    def v_pages(self) -> Optional[torch.Tensor]:
        pages = self._one_layer("v_pages")
        return pages[:, 1] if pages.shape[1] == 2 else None

    def dense(self):
        """``(k, v)`` each ``[B, H, W * page, D]`` (a copy), zero at rows ``>= kv_len`` (``v`` None for a latent)."""
        pages = self._one_layer("dense")
        b, w = self.page_table.shape
        page = pages.shape[-2]
        got = pages[self.page_table.clamp(min=0).long()]                           # [B, W, kv, H, page, D]
        got = got.permute(0, 2, 3, 1, 4, 5).reshape(b, pages.shape[1], pages.shape[2], w * page, -1)
        pos = torch.arange(w * page, device=got.device)
        ok = (self.page_table[:, pos // page] >= 0) & (pos[None, :] < self.kv_lens[:, None])
        got = torch.where(ok[:, None, None, :, None], got, torch.zeros((), dtype=got.dtype, device=got.device))
        return got[:, 0], (got[:, 1] if got.shape[1] == 2 else None)

    def vllm_kv_cache(self) -> torch.Tensor:
        """vLLM's contiguous per-layer cache ``[2, N, page, H, D]`` (K/V first, NHD inside a block: the
        FlashAttention backend's layout) of the staged pages, a copy (`interop.vllm.kv_cache` does the same on the
        JAX side); index it with `block_table`. A latent (MLA) group has no K/V pair and is refused."""
        pages = self._one_layer("vllm_kv_cache")
        if pages.shape[1] != 2:
            raise ValueError(f"TorchStaged.vllm_kv_cache: a K/V group has kv = 2, got kv = {pages.shape[1]} (MLA "
                             f"latent: use staged.k_pages.transpose(1, 2))")
        return pages.permute(1, 0, 3, 2, 4).contiguous()

    def flashinfer_csr(self, *, as_numpy: bool = False) -> layouts.FlashInferCSR:
        """FlashInfer ``(kv_indptr i32[B+1], kv_indices i32[nnz], kv_last_page_len i32[B])`` over the **staged**
        pages (mixed semantics): int32 torch tensors on the pages' device (NumPy with ``as_numpy=True``); pass
        them with ``pages`` to ``BatchDecodeWithPagedKVCacheWrapper.plan`` / ``run``."""
        csr = layouts.flashinfer_csr(self.page_table, self.kv_lens, np.arange(self.page_table.shape[0]),
                                     self.pages.shape[-2])
        return csr if as_numpy else layouts.csr_to_torch(csr, self.pages.device)

    def block_table(self, *, pad: int = 0, as_numpy: bool = False):
        """vLLM ``(block_table i32[B, W], seq_lens i32[B])`` over the staged pages (mixed semantics), int32 torch
        tensors on the pages' device (NumPy with ``as_numpy=True``). Entries past a row's pages hold ``pad``
        (vLLM pads with 0): a padded entry names a real staged page, which a reader never uses (it stops at
        ``seq_lens``) and nobody writes (staged pages are a read-only snapshot)."""
        out = layouts.block_table(self.page_table, self.kv_lens, np.arange(self.page_table.shape[0]),
                                  self.pages.shape[-2], pad=pad)
        return out if as_numpy else tuple(layouts.to_device(a, self.pages.device) for a in out)


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
        (``jmixedkv.checks.validate_read``; costs a device-to-host copy of the tables). Default for every call;
        each call takes ``validate=`` too. Without it, ``decode_attention``, ``stage`` and ``gather_rows`` take
        torch slot (and index) tensors as they are (no copy to the host, which would wait for the GPU) and check
        them inside the program: a row whose slot is outside ``[-1, max_seqs)`` reads as NaN (its output, one
        staged page, its gathered rows) instead of raising.
      sync: ``True`` | ``"stream"`` | ``False``, the DLPack stream policy (`interop.dlpack`); default for every
        call, each call takes ``sync=`` too (``"stream"`` keeps a hot loop on torch's current stream).
      reserve_null_page: keep low page 0 out of the allocator (vLLM's null block), so ``block_table(pad=0)``
        padding never names a page holding data. Costs one page of ``num_pages``.
      init_kwargs: passed to `jmixedkv.init_state` (``gs``, ``poison``, ``page_order``, ...).
    """

    def __init__(self, config: KVCacheConfig, num_layers: Optional[int] = None, num_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, *, num_pages: int, max_seqs: int,
                 max_pages_per_seq: Optional[int] = None, groups: Optional[Sequence[GroupSpec]] = None,
                 device: Union[str, torch.device, None] = None, backend: str = "auto", validate: bool = True,
                 token_buckets: bool = True, sync: Union[bool, str] = True, reserve_null_page: bool = False,
                 **init_kwargs):
        if sync not in SYNC_MODES:
            raise ValueError(f"TorchKVCache: sync must be one of {SYNC_MODES}, got {sync!r}")
        if groups is None:
            if None in (num_layers, num_kv_heads, head_dim):
                raise ValueError("TorchKVCache needs num_layers, num_kv_heads and head_dim (or groups=)")
            groups = (GroupSpec(num_layers, num_kv_heads, head_dim),)
        self.manager = CacheManager(config, groups, num_pages, max_seqs, max_pages_per_seq, backend=backend,
                                    **init_kwargs)
        self.config, self.backend, self.validate, self.sync = config, backend, validate, sync
        self.reserve_null_page, self.token_buckets = bool(reserve_null_page), token_buckets
        self.handle = next(_HANDLE_IDS)          # for the torch.library ops (see the end of this module)
        _HANDLES[self.handle] = weakref.ref(self)
        self._layer_ids: dict = {}             # (group, layer) -> device i32 scalar (`_layer_id`)
        self._split = None                     # (state, group, rest) of the last layer program (`_run_layer`)
        self._row_index: dict = {}             # rows -> device int64 index (`read_views`)
        jax_dev = next(iter(self.manager.state.kv_lens.devices()))     # CacheManager committed the state there
        self.device = torch_device_of(jax_dev)
        self._hot = HotBridge(jax_dev)         # the step methods' crossings under sync="stream"
        self._attention_dtype = torch_dtype(config.attention_dtype)
        if device is not None and not _same_device(torch.device(device), self.device):
            raise ValueError(f"TorchKVCache: device {device} does not match the JAX device {jax_dev} the cache "
                             f"lives on (torch {self.device}); set JAX's default device or pass device={self.device}")
        if self.reserve_null_page:
            if num_pages < 2:
                raise ValueError(f"TorchKVCache: reserve_null_page=True takes page 0 out of num_pages={num_pages}, "
                                 f"leaving no usable page (need num_pages >= 2)")
            self.manager.replace_state(_reserve_page_zero(self.manager.state))

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
        return self._attention_dtype

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
               group: int = 0, rope: Optional[RopeSpec] = None, sync: Union[bool, str, None] = None) -> None:
        """Store new K/V rows of one layer (``k, v [T, H, D]``) or all layers (``layer=None``: ``[L, T, H, D]``).

        ``seq_slots`` / ``positions``: int32 (or int64, converted on the host) ``[T]``; slot -1 = padding.
        ``v=None`` for an MLA-latent group. Raises `CacheCapacityError` if pages run out (nothing written)."""
        sync = self._sync(sync, "append")
        spec = checks.check_group(self.state, group, "append")
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
        kj = from_torch(k, copy=None, sync=sync)
        vj = None if v is None else from_torch(v, copy=None, sync=sync)
        self.manager.append(layer, kj, vj, seq, pos, group=group, rope=rope)

    def stage(self, layer: Optional[int], seq_slots, *, group: int = 0, sync: Union[bool, str, None] = None,
              validate: Optional[bool] = None) -> TorchStaged:
        """Plain paged cache a reader sees, in the attention dtype, for batch rows ``seq_slots [B]`` (-1 = padding):
        retained positions are the high rows bit-for-bit, others dequantized NVFP4; see `TorchStaged`.

        ``layer=None`` stages every layer of the group in one call (``pages [L, N, kv, H, page, D]``)."""
        sync, _, seq = self._read_args("stage", layer, group, seq_slots, sync, all_layers=True,
                                       slots_on_host=self._validates(validate))
        self._validate_read(layer, seq, None, group, "stage", validate)
        layer_j = None if layer is None else self._device_layer(layer, group, "stage")
        st = _stage_jit(self.state, layer_j, seq, group=group, backend=self.backend, validate=False)
        return TorchStaged(to_torch(st.pages, sync=sync), to_torch(st.page_table, sync=sync),
                           to_torch(st.kv_lens, sync=sync))

    def gather_rows(self, layer: int, seq_slots, indices, *, group: int = 0, scratch_dtype: Optional[str] = None,
                    sync: Union[bool, str, None] = None, validate: Optional[bool] = None):
        """Rows at positions ``indices [B, K]`` (-1 = padding) of sequences ``seq_slots [B]``.

        Returns ``(k, v, scale)``: ``k, v [B, K, H, D]`` (``v`` None for a latent group) in the attention dtype, or
        float8_e4m3fn with ``scratch_dtype="fp8"`` (value = f32(row) * scale[b]); ``scale f32[B]``. Positions
        outside ``[0, n)`` read as zero."""
        on_host = self._validates(validate)
        sync, spec, seq = self._read_args("gather_rows", layer, group, seq_slots, sync, slots_on_host=on_host)
        if on_host or not isinstance(indices, torch.Tensor):
            idx = self._indices(indices, "gather_rows", "indices", ndim=2)
        else:                                       # positions outside [0, n) read as zero inside the program
            idx = self._index_tensor(indices, sync, "gather_rows", "indices", 2, -checks.INT32_MAX - 1,
                                     checks.INT32_MAX)
        if idx.shape[0] != seq.shape[0]:
            raise ValueError(f"gather_rows: indices has {idx.shape[0]} rows for {seq.shape[0]} sequences")
        if scratch_dtype not in (None, "fp8", "float8_e4m3fn"):
            raise ValueError(f"gather_rows: scratch_dtype must be None or 'fp8', got {scratch_dtype!r}")
        self._validate_read(layer, seq, idx, group, "gather_rows", validate)
        rows, scale = _gather_jit(self.state, self._device_layer(layer, group, "gather_rows"), seq, idx, group=group,
                                  scratch_dtype=scratch_dtype, backend=self.backend, validate=False)
        k = to_torch(rows[:, :, 0], sync=sync)
        v = to_torch(rows[:, :, 1], sync=sync) if spec.kv_factor == 2 else None
        return k, v, to_torch(scale, sync=sync)

    def decode_attention(self, layer: int, q: torch.Tensor, seq_slots, *, group: int = 0,
                         sm_scale: Optional[float] = None, sync: Union[bool, str, None] = None,
                         validate: Optional[bool] = None):
        """Attention of queries ``q [B, Tq, Hq, D]`` (or ``[B, Hq, D]``) in the attention dtype over the cache.

        Query token ``t`` sits at position ``n - Tq + t`` (append the new K/V first); ``Tq <= max_draft_len + 1``;
        GQA: ``Hq % H == 0``. Returns ``(out [B, Tq, Hq, D] attention dtype, lse f32[B, Tq, Hq])`` (no ``Tq`` axis
        for a 3-D ``q``); ``lse`` is the **natural-log** LSE of the scaled logits (FlashInfer's is base 2: see
        `lse_to_base2`); padding rows give zeros and LSE -inf."""
        sync, spec, seq = self._read_args("decode_attention", layer, group, seq_slots, sync,
                                          slots_on_host=self._validates(validate))
        self._check_query(q, spec, seq.shape[0])
        squeeze = q.dim() == 3
        self._validate_read(layer, seq, None, group, "decode_attention", validate)
        qj = from_torch(q.unsqueeze(1) if squeeze else q, copy=None, sync=sync)
        out, lse = _jax_decode_attention(self.state, self._device_layer(layer, group, "decode_attention"), qj, seq,
                                         group=group, sm_scale=sm_scale, backend=self.backend)
        out, lse = to_torch(out, sync=sync), to_torch(lse, sync=sync)
        return (out[:, 0], lse[:, 0]) if squeeze else (out, lse)

    # ------------------------------------------------------------------ the engine step (one program per layer)
    def plan_step(self, seq_slots, positions, rows, *, group: int = 0) -> "StepPlan":
        """Check one engine step's tokens once on the host and account for them (pages, lengths), for the
        per-layer `step_append` / `step_dense` / `step_attend` calls of that step (every layer appends the same
        tokens). ``seq_slots`` / ``positions`` int ``[T]`` (slot -1 = padding token), ``rows`` int ``[B]`` the slot
        of each batch row the step reads (-1 = padding row). Refusals are those of `append` (`ValueError` naming
        the value, `CacheCapacityError`), raised before anything changes. A refusal the device met inside an
        earlier step's program (it changed nothing) is raised here as a `CacheError`. On the device the plan
        allocates the step's pages and counts its lengths once (`jmixedkv.step.plan_append_packed`); each layer's call
        then only stores its rows and reads (`jmixedkv.step.layer_append` / ``layer_dense`` / ``layer_attend``)."""
        self._raise_device_error("plan_step")
        checks.check_group(self.state, group, "plan_step")
        seq, pos = self._index_pair(seq_slots, positions, "plan_step")
        rows = self._slots(rows, "plan_step")
        seq, pos = self.manager.reserve_append(seq, pos)
        longest = max([self.manager.kv_len(int(r)) for r in rows if r >= 0] or [0])
        width = min(max(1, page_bucket(-(-longest // self.page_size))), self.state.max_pages_per_seq)
        tokens = np.concatenate([seq, pos, rows]).astype(np.int32, copy=False)     # one host-to-device copy
        state, targets, (seq_j, pos_j, rows_j) = step.plan_append_packed(self.state, tokens, num_rows=rows.shape[0],
                                                                         group=group)
        self.manager.install(state)
        return StepPlan(seq_j, pos_j, rows_j, width, group, targets)

    def step_append(self, layer: int, k: torch.Tensor, v: Optional[torch.Tensor], plan: "StepPlan", *,
                    sync: Union[bool, str, None] = None) -> None:
        """Append one layer's rows of a planned step: ``k, v [B, H, T, D]`` (transformers' layout; token ``(b, t)``
        is the plan's token ``b * T + t``) or ``[T, H, D]``; ``v=None``: ``k`` is ``[B, 2 H, T, D]``, K and V
        packed along the head axis (one crossing). One donated program, no host round trip."""
        kj, vj = self._step_kv(k, v, sync)
        self._run_layer(plan, step.layer_append, self._layer_id(layer, plan), kj, vj, plan.append, group=plan.group,
                        backend=self.backend, packed=vj is None)

    def step_dense(self, layer: int, k: torch.Tensor, v: Optional[torch.Tensor], plan: "StepPlan", *,
                   sync: Union[bool, str, None] = None):
        """`step_append`, then the dense cache of the plan's rows as ``(k, v)`` each ``[B, H, width * page, D]``
        in the attention dtype (`jmixedkv.step.layer_dense`; zero past each row's length), in one program."""
        kj, vj = self._step_kv(k, v, sync)
        kd, vd = self._run_layer(plan, step.layer_dense, self._layer_id(layer, plan), kj, vj, plan.append, plan.rows,
                                 width=plan.width, group=plan.group, backend=self.backend, packed=vj is None)
        out = self._out(self._sync(sync, "step_dense"))
        return out(kd), out(vd)                                                            # (zero-copy: tested)

    def step_attend(self, layer: int, k: torch.Tensor, v: Optional[torch.Tensor], q: Optional[torch.Tensor],
                    plan: "StepPlan", *, sm_scale: Optional[float] = None, sliding_window: Optional[int] = None,
                    soft_cap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
                    sync: Union[bool, str, None] = None, return_lse: bool = True):
        """`step_append`, then decode attention of ``q [B, Hq, Tq, D]`` (transformers' layout, the attention
        dtype) for the plan's rows, in one program (`jmixedkv.step.layer_attend`). ``v=None, q=None``: ``k`` is
        ``[B, 2 H + Hq, T, D]``, K, V and Q packed along the head axis (one crossing instead of three). Returns
        ``(out [B, Tq, Hq, D] attention dtype, lse f32[B, Tq, Hq])`` (natural-log LSE; None unless
        ``return_lse``). ``sinks`` ``[Hq]``: per-head attention-sink logits (gpt-oss)."""
        sync = self._sync(sync, "step_attend")
        opts = dict(group=plan.group, backend=self.backend, sm_scale=sm_scale, sliding_window=sliding_window,
                    soft_cap=soft_cap)
        imp = self._in(sync)
        sj = None if sinks is None else imp(sinks.detach().float().contiguous())
        layer_id = self._layer_id(layer, plan)
        if v is None and q is None:
            kj, vj, qj = imp(k), None, None
        else:
            (kj, vj), qj = self._step_kv(k, v, sync), imp(q)
        out, lse = self._run_layer(plan, step.layer_attend, layer_id, kj, vj, qj, plan.append, plan.rows, sj,
                                   num_kv_heads=self.state.groups[plan.group].num_kv_heads, **opts)
        exp = self._out(sync)
        return exp(out), exp(lse) if return_lse else None

    # ------------------------------------------------------------------ a step written after its layers ran
    def reserve_step(self, seq_slots, positions, *, group: int = 0) -> "ReservedStep":
        """The host half of `plan_step` for a step whose rows are stored later, every layer in one program
        (`write_step`): the tokens ``seq_slots`` / ``positions`` int ``[T]`` (slot -1 = padding token) are checked
        and accounted for in the host mirror now (refusals as `append`'s, raised before anything changes); the
        device state changes only in `write_step`. Until then the cache must not be read or changed but by
        `read_views` (the state before the step) and that `write_step`."""
        checks.check_group(self.state, group, "reserve_step")
        seq, pos = self._index_pair(seq_slots, positions, "reserve_step")
        seq, pos = self.manager.reserve_append(seq, pos)
        return ReservedStep(np.concatenate([seq, pos]).astype(np.int32, copy=False), group)

    def write_step(self, reserved: "ReservedStep", kv: torch.Tensor, *, sync: Union[bool, str, None] = None) -> None:
        """Store a `reserve_step` step's rows for every layer of its group in ONE donated program
        (`jmixedkv.step.plan_write_layers`): ``kv [2 L, B, H, T', D]`` (layer ``l``'s K at ``kv[l]``, its V at
        ``kv[L + l]``; transformers' ``[B, H, T', D]`` per layer, token ``b * T' + t`` of the reserved tokens), the
        attention dtype. First raises (`CacheError`) a refusal the device met in an earlier program. Every torch
        view of the pools (`read_views`) must be dropped before: JAX copies a donated buffer torch still views. A
        ``kv`` of the wrong shape or dtype raises `ValueError` naming it; the step is then dropped (nothing
        written, the host accounting re-read from the device state)."""
        self._raise_device_error("write_step")
        spec = self.state.groups[reserved.group]
        want = (2 * spec.num_layers, None, spec.num_kv_heads, None, spec.head_dim)
        if (not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.dtype != self.attention_dtype
                or any(w is not None and w != g for w, g in zip(want, kv.shape))
                or kv.shape[1] * kv.shape[3] != reserved.tokens.shape[0] // 2):
            self.manager.replace_state(self.state)          # the reservation is dropped: the host mirror re-read
            raise ValueError(f"write_step: kv must be {self.attention_dtype} [2 L={2 * spec.num_layers}, B, "
                             f"H={spec.num_kv_heads}, T', D={spec.head_dim}] with B * T' = "
                             f"{reserved.tokens.shape[0] // 2} tokens, got {getattr(kv, 'dtype', type(kv).__name__)} "
                             f"{list(getattr(kv, 'shape', []))}")
        kj = self._in(self._sync(sync, "write_step"))(kv.contiguous())
        self.manager.install(step.plan_write_layers(self.state, reserved.tokens, kj, group=reserved.group,
                                                    backend=self.backend))
        self.state.error.copy_to_host_async()        # read by the next step's check without waiting for the GPU

    def read_views(self, rows, *, group: int = 0, sync: Union[bool, str, None] = None) -> "ReadViews":
        """What a torch attention kernel needs to read ``group`` for batch rows ``rows`` (int ``[B]`` slots, host
        values): its pools as zero-copy torch views (`interop.torch_paged.TorchPools`, read-only) and the rows'
        ``page_table i32[B, MP]``, ``high_table i32[B, W]`` (None without a twin) and ``kv_lens i32[B]`` (zero-copy
        slices for consecutive slots, else torch copies), with the twin's geometry. Valid until the next
        transition: drop them before it."""
        sync = self._sync(sync, "read_views")
        checks.check_group(self.state, group, "read_views")
        rows = self._slots(rows, "read_views")
        if (rows < 0).any():
            raise ValueError(f"read_views: rows {rows.tolist()} include padding (-1); pass admitted slots")
        out = self._out(sync)
        st, pools = self.state, self.state.pools[group]
        if rows.size and (np.diff(rows) == 1).all():           # consecutive slots: a zero-copy slice, no launch
            lo, hi = int(rows[0]), int(rows[-1]) + 1
            take = lambda x: out(x)[lo:hi]                        # noqa: E731
        else:
            key = rows.tobytes()
            idx = self._row_index.get(key)
            if idx is None:                  # one host-to-device copy per batch layout, not per step
                if len(self._row_index) > 64:
                    self._row_index.clear()
                idx = self._row_index[key] = torch.from_numpy(rows.astype(np.int64)).to(self.device)
            take = lambda x: out(x).index_select(0, idx)          # noqa: E731
        low, high, plain = pools.low, pools.high, pools.plain
        tp = TorchPools(*(None if x is None else out(x) for x in (
            low and low.data, low and low.scales, low and low.gs, high and high.rows, high and high.scale,
            plain and plain.rows, plain and plain.scale)))
        return ReadViews(tp, take(st.page_table), take(st.high_table) if high is not None else None,
                         take(st.kv_lens), st.config.twin if high is not None else None)

    def _run_layer(self, plan: "StepPlan", program, *args, **kwargs):
        """Run a layer program of `jmixedkv.step` (``layer_append`` / ``layer_dense`` / ``layer_attend``) on the
        current state split in two (`jmixedkv.step.split_layer_state`: the read-only rest is split once per step
        and group, the part a layer changes is donated), install the result, and return the program's outputs."""
        if plan.append is None:
            raise ValueError("step_append / step_dense / step_attend take the StepPlan plan_step returned (its append "
                             "targets are made on the device there), not one built by hand")
        state, group = self.state, plan.group
        split = self._split
        if split is None or split[0] is not state or split[1] != group:
            rest, mine = step.split_layer_state(state, group)
        else:
            rest, mine = split[2], step.layer_part(state, group)
        mine, *outs = program(rest, mine, *args, **kwargs)
        new = step.join_layer_state(rest, mine, group)
        self.manager.install(new)
        self._split = (new, group, rest)
        return outs

    def _step_kv(self, k, v, sync):
        imp = self._in(self._sync(sync, "step"))
        return imp(k), None if v is None else imp(v)

    def _in(self, sync):
        """The step methods' torch -> JAX crossing under ``sync`` (`HotBridge` for ``"stream"``)."""
        if sync == "stream":
            return self._hot.to_jax
        return lambda t: from_torch(t, copy=None, sync=sync)

    def _out(self, sync):
        """The step methods' JAX -> torch crossing of their own outputs under ``sync``."""
        if sync == "stream":
            return self._hot.to_torch
        return lambda x: to_torch(x, sync=sync, check=False)

    def _layer_id(self, layer: int, plan: "StepPlan"):
        return self._device_layer(layer, plan.group, "step")

    def _device_layer(self, layer: int, group: int, what: str):
        """``layer`` as a device int32 scalar, made once per (group, layer): a host scalar argument would cost a
        host-to-device copy in every call (measured on the H200: ~170 us of a ~450 us call)."""
        key = (group, layer)
        got = self._layer_ids.get(key)
        if got is None:
            spec = self.state.groups[group]
            self._layer(layer, spec, what)
            got = self._layer_ids[key] = jax.device_put(np.int32(layer), next(iter(self.state.kv_lens.devices())))
        return got

    def _raise_device_error(self, what):
        """Raise (once) a refusal the device recorded inside a program this cache ran without a host check."""
        code = int(self.state.error)
        if code:
            self.manager.replace_state(dataclasses.replace(self.state, error=jnp.zeros_like(self.state.error)))
            raise CacheError(f"{what}: the device refused an earlier step ({describe_error(code)}); that step "
                             f"changed nothing")

    # ------------------------------------------------------------------ speculative decoding / beams
    def correct_kv_lens(self, offsets, seq_slots=None) -> None:
        """Add non-positive ``offsets`` to the lengths (rewind rejected drafts): ``kv_lens += offsets``.

        ``offsets``: int ``[max_seqs]``, or ``[B]`` aligned with ``seq_slots``. The rule is
        `jmixedkv.speculative.correct_kv_lens`'s (a `ValueError` names the slot): ``offset <= 0``, 0 on idle
        slots, and ``kv_len + offset >= max(written - max_draft_len, 0)`` (``written``: one past the highest
        row written since admit, so rewinds never add up past the twin ring's slack)."""
        self.manager.correct_kv_lens(self._offsets(offsets, seq_slots, "correct_kv_lens"))

    def accept(self, seq_slots, num_accepted, num_drafts) -> None:
        """After a verify append of ``num_drafts[b] + 1`` rows (the verified token + drafts) to ``seq_slots[b]``,
        keep the verified token and the first ``num_accepted[b]`` drafts: ``kv_len += num_accepted - num_drafts``."""
        seq = self._slots(seq_slots, "accept")
        self.manager.accept(seq, self._counts(num_accepted, seq, "accept", "num_accepted"),
                            self._counts(num_drafts, seq, "accept", "num_drafts"))

    def fork(self, src: int, dst: Optional[int] = None) -> int:
        """Copy sequence ``src`` into the free slot ``dst`` (default: the first free one) for beam search /
        parallel sampling (`CacheManager.fork`: full pages shared, the partial page and the twin copied).
        Returns ``dst``. Raises `CacheCapacityError` (nothing changed) when no slot or page is free."""
        return self.manager.fork(self._slot(src, "fork src"), None if dst is None else self._slot(dst, "fork dst"))

    # ------------------------------------------------------------------ layout exports (see interop.layouts)
    def flashinfer_page_table(self, seq_slots, *, as_numpy: bool = False) -> layouts.FlashInferCSR:
        """FlashInfer CSR ``(kv_indptr i32[B+1], kv_indices i32[nnz], kv_last_page_len i32[B])`` over the **NVFP4
        pool** (`layouts.nvfp4_pages`) of ``seq_slots``: int32 torch tensors on ``self.device`` (NumPy with
        ``as_numpy=True``). Semantics: *history only*, plain NVFP4 -- the twin (first-N / last-N rows) is dropped.
        For the mixed semantics use the staged pages: ``stage(layer, seq).flashinfer_csr()``."""
        seq = self._slots(seq_slots, "flashinfer_page_table")
        csr = layouts.flashinfer_csr(np.asarray(self.state.page_table), np.asarray(self.state.kv_lens), seq,
                                     self.page_size)
        return csr if as_numpy else layouts.csr_to_torch(csr, self.device)

    def block_table(self, seq_slots, *, pad: int = 0, as_numpy: bool = False):
        """vLLM ``(block_table i32[B, max_pages], seq_lens i32[B])`` over the **NVFP4 pool** (history only, the
        twin dropped), int32 torch tensors on ``self.device`` (NumPy with ``as_numpy=True``). Entries past a
        row's pages hold ``pad`` (vLLM: 0, its null block); with ``pad=0`` on a cache without
        ``reserve_null_page=True`` a padded 0 may name a page holding data (harmless for readers, which stop at
        ``seq_lens``). Padding rows (slot -1) are all ``pad`` with length 0."""
        seq = self._slots(seq_slots, "block_table")
        out = layouts.block_table(np.asarray(self.state.page_table), np.asarray(self.state.kv_lens), seq,
                                  self.page_size, pad=pad)
        return out if as_numpy else tuple(layouts.to_device(a, self.device) for a in out)

    def slot_mapping(self, seq_slots, positions, *, as_numpy: bool = False):
        """vLLM's ``slot_mapping i64[T]`` (``page_id * page_size + position % page_size``) of tokens already in
        the cache, one per ``(seq_slots[t], positions[t])``; -1 (vLLM's ``PAD_SLOT_ID``) for padding (slot -1) and
        for a position whose page is not allocated yet (pages are allocated by ``append``, so export after it).
        A torch tensor on ``self.device`` (NumPy with ``as_numpy=True``); `positions_from_slots` inverts it."""
        seq, pos = self._index_pair(seq_slots, positions, "slot_mapping")
        out = layouts.slot_mapping(np.asarray(self.state.page_table), seq, pos, self.page_size)
        return out if as_numpy else torch.from_numpy(out).to(self.device)

    def positions_from_slots(self, slots):
        """``(seq_slots i32[T], positions i32[T])`` for `append` from a vLLM ``slot_mapping`` over this cache's
        pages (`interop.layouts.positions_from_slots`: each page written must be held by exactly one sequence)."""
        if isinstance(slots, torch.Tensor):
            slots = slots.detach().cpu().numpy()
        return layouts.positions_from_slots(np.asarray(slots), np.asarray(self.state.page_table), self.page_size)

    # ------------------------------------------------------------------ validation helpers
    def _read_args(self, what, layer, group, seq_slots, sync, all_layers: bool = False, slots_on_host: bool = True):
        """``(sync, group spec, slots)`` of a read, each checked (``layer=None`` only with ``all_layers``). The slots
        are host int32, range-checked, unless ``slots_on_host=False`` and they are a torch tensor: then they cross
        as they are (`_slots_as_they_are`)."""
        sync = self._sync(sync, what)
        spec = checks.check_group(self.state, group, what)
        if layer is not None or not all_layers:
            self._layer(layer, spec, what)
        if not slots_on_host and isinstance(seq_slots, torch.Tensor):
            return sync, spec, self._slots_as_they_are(seq_slots, sync, what)
        return sync, spec, self._slots(seq_slots, what)

    def _layer(self, layer, spec, what):
        checks.host_int(layer, f"layer (group {spec.name!r})", what, 0, spec.num_layers)

    def _slot(self, slot, what):
        return checks.host_int(slot, "slot", what, 0, self.max_seqs)

    def _indices(self, x, what, name, ndim, lo=None, hi=None):
        """Host int32 numpy copy of an index tensor / list (int32 or int64; CPU or this cache's device), its values
        in ``[lo, hi)`` when given (`jmixedkv.checks.index_array`: the error names the first offending entry)."""
        if isinstance(x, torch.Tensor):
            if x.dtype not in INDEX_INPUTS:
                raise ValueError(f"{what}: expected an int32 (or int64) tensor, got {x.dtype}")
            if x.device.type != "cpu" and not _same_device(x.device, self.device):
                raise ValueError(f"{what}: tensor is on {x.device}, the cache is on {self.device}")
            x = x.detach().cpu().numpy()
        # a host copy first: `index_array` range-checks host values only (it leaves JAX arrays to jit)
        return checks.index_array(np.asarray(x), name, what, lo, hi, ndim=ndim, host=True)

    def _slots(self, seq_slots, what):
        """Host int32 sequence slots in ``[-1, max_seqs)`` (-1 = padding)."""
        return self._indices(seq_slots, what, "seq_slots", ndim=1, lo=-1, hi=self.max_seqs)

    def _index_pair(self, seq_slots, positions, what):
        seq = self._slots(seq_slots, what)
        pos = self._indices(positions, what, "positions", ndim=1)
        if seq.shape != pos.shape:
            raise ValueError(f"{what}: seq_slots {seq.shape} and positions {pos.shape} must have the same length")
        return seq, pos

    def _offsets(self, offsets, seq_slots, what):
        off = self._indices(offsets, what, "offsets", ndim=1)
        if seq_slots is None:
            if off.shape[0] != self.max_seqs:
                raise ValueError(f"{what}: offsets must have max_seqs={self.max_seqs} entries, got {off.shape[0]}")
            full = off
        else:
            seq = self._slots(seq_slots, what)
            if seq.shape != off.shape:
                raise ValueError(f"{what}: seq_slots {seq.shape} and offsets {off.shape} must have the same length")
            live = seq[seq >= 0]
            vals, counts = np.unique(live, return_counts=True)
            dup = vals[counts > 1]
            if dup.size:
                raise ValueError(f"{what}: seq_slots lists slots {dup.tolist()} more than once")
            full = np.zeros(self.max_seqs, np.int32)
            full[live] = off[seq >= 0]
        return full        # the range rule (written - max_draft_len <= kv_len + offset) is checked by speculative

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

    def _validates(self, validate) -> bool:
        return self.validate if validate is None else validate

    def _validate_read(self, layer, seq, indices, group, what, validate=None):
        """Host checks of the tables and of ``indices`` (`jmixedkv.checks.validate_read`), unless switched off."""
        if not self._validates(validate):
            return
        checks.validate_read(self.state, layer, seq, indices, group=group, op=what)

    def _slots_as_they_are(self, seq_slots: torch.Tensor, sync, what):
        """A slot tensor read without host validation: ``i32[B]`` JAX array over the same memory (DLPack; no copy
        to the host, which would wait for every kernel queued before it). Its values are checked inside the
        program (a row whose slot is outside ``[-1, max_seqs)`` reads as NaN)."""
        return self._index_tensor(seq_slots, sync, what, "seq_slots", 1, -2, self.max_seqs)

    def _index_tensor(self, x: torch.Tensor, sync, what, name, ndim, lo, hi):
        """An index tensor as an int32 JAX array without a host copy (`_slots_as_they_are`); int64 values are first
        clamped to ``[lo, hi]`` on the tensor's device (just outside the legal range), so none wraps into range."""
        if x.dtype not in INDEX_INPUTS or x.dim() != ndim:
            raise ValueError(f"{what}: {name} must be an int32 (or int64) tensor of {ndim} dims, got {x.dtype} "
                             f"{list(x.shape)}")
        if not _same_device(x.device, self.device):
            raise ValueError(f"{what}: {name} is on {x.device}, the cache is on {self.device}")
        if x.dtype != torch.int32:
            x = x.clamp(lo, hi).to(torch.int32)
        return from_torch(x.detach(), copy=None, sync=sync)

    def _sync(self, sync, what):
        sync = self.sync if sync is None else sync
        if sync not in SYNC_MODES:
            raise ValueError(f"{what}: sync must be one of {SYNC_MODES}, got {sync!r}")
        return sync

    def _counts(self, x, seq, what, name):
        """Per-row counts: a scalar or ``[B]`` aligned with ``seq``."""
        arr = np.asarray(x) if not isinstance(x, torch.Tensor) else None
        if arr is not None and arr.ndim == 0:
            n = checks.host_int(arr, name, what, -checks.INT32_MAX - 1, checks.INT32_MAX + 1)
            return np.full(seq.shape, n, np.int32)
        out = self._indices(x, what, name, ndim=1)
        if out.shape != seq.shape:
            raise ValueError(f"{what}: {name} has {out.shape[0]} entries for {seq.shape[0]} sequence slots")
        return out


def _reserve_page_zero(state):
    """Take low page 0 out of the free stack for good (refcount 1, never released): vLLM's null block."""
    alloc = state.alloc
    free = np.asarray(alloc.free)
    n = int(alloc.num_free)
    if n != alloc.num_pages:
        raise ValueError("reserve_null_page: the cache must be fresh (all low pages free)")
    order = np.concatenate([free[free != 0], [0]]).astype(np.int32)   # page 0 below the stack top: never popped
    new = Allocator(jnp.asarray(order), jnp.int32(n - 1), alloc.refcount.at[0].set(1))
    return dataclasses.replace(state, alloc=jax.device_put(new, next(iter(state.kv_lens.devices()))))


def _pad_tokens(k, v, seq, pos, token_axis):
    """Pad the token axis to a power of two >= 8 with zero rows at slot -1 (skipped by append)."""
    t = seq.shape[0]
    b = max(8, page_bucket(t))
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
# The reads as custom ops (module docstring; ``handle`` is a graph constant). Appends change the cache's own (JAX)
# state, not a tensor, and stay eager.
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
    """``torch.ops.jmixedkv.decode_attention(handle, layer, q [B, Tq, Hq, D], seq_slots i32[B]) -> (out, lse)``;
    ``lse f32[B, Tq, Hq]`` natural-log (FlashInfer's is base 2: `lse_to_base2`)."""
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
