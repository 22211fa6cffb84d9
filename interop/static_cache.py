"""`StaticPagedCache`: the cache's pools owned by torch, written and read by torch ops, for compiled engines.

The JAX-backed `interop.TorchKVCache` runs one JAX program per layer: correct, but each call is a JAX dispatch on
the host, which torch's CUDA graphs cannot capture. This cache keeps the same pools, in the layout of
`jmixedkv.layout` (NVFP4 data / E4M3 scale bytes / global scales, the twin's rows and its table), as torch tensors,
and does a layer's work with two torch custom ops (`interop.paged_ops`: ``jmixedkv::write_rows_`` and
``jmixedkv::paged_attention``; Triton kernels on CUDA, torch code on CPU). Nothing on the hot path syncs with the
host or touches JAX, so ``torch.compile`` (transformers' ``generate`` compiles a compileable cache's forward and
replays it as a CUDA graph) captures a whole decode step.

Static, as transformers' ``StaticCache``: batch row ``b`` owns low pages ``[b * MP, (b + 1) * MP)`` (``MP =
ceil(max_cache_len / page)``) and twin pages ``[b * W, (b + 1) * W)`` (``W`` = `TwinGeometry.width`); the tables
never change, so no allocator runs. Memory is ``max_batch_size x max_cache_len`` rows, each in NVFP4 (0.5625 bytes
per element) plus the twin's ``W`` pages per row.

State on the device, updated in place by the ops (static addresses: CUDA-graph safe):

* ``kv_lens i32[L, B]``: stored (real) tokens per layer and row; a step's tokens sit at the positions the model
  gives (``position_ids``: real token ``i`` of a row at position ``i``; left padding is not stored).
* ``written i32[L, B]``: the furthest length each row has reached (its rewind floor is ``max_draft_len`` below).
* ``error i32[]``: sticky bits (`jmixedkv.checks`'s ``ERR_BAD_POSITION`` / ``ERR_TOO_LONG`` /
  ``ERR_BAD_CORRECTION``) set when a step's positions do not continue a row or run past ``max_cache_len``, or a
  rewind would cross a row's floor; such a row is left unchanged (nothing written, its length kept) and a step's
  attention output for it is NaN. `raise_errors` reads it (one host sync: call it between steps).

Levers: ``rotation="hadamard"`` rotates K / V before the write and q / the output around the attention (float32,
`interop.torch_nvfp4.rotate`), so readers see model space; ``block_scale="4over6"`` is the write's. K smoothing is a
model-side lever and is refused. Attention options: ``sm_scale``, ``sliding_window``, ``soft_cap`` and per-head
``sinks`` (an LSE term). Sliding layers hold only their window (a ring of pages per row: `StaticPagedCache`).

`as_cache_state` hands one layer's pools to JAX readers (`jmixedkv.decode_attention`, `stage`, exporters) as a
one-layer `jmixedkv.CacheState` over DLPack.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from jmixedkv.checks import ERR_BAD_CORRECTION, ERR_BAD_POSITION, ERR_TOO_LONG
from jmixedkv.config import KVCacheConfig

from . import paged_ops, torch_nvfp4
from .torch_paged import TorchPools

__all__ = ["StaticPagedCache", "LayerGroup", "StepPlan"]

_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float8_e4m3fn": torch.uint8,
                 "float32": torch.float32}


def _torch_dtype(jnp_dtype) -> torch.dtype:
    import numpy as np
    return _TORCH_DTYPES[np.dtype(jnp_dtype).name]


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"StaticPagedCache: {name} must be an integer >= 1, got {value!r}")
    return value


class LayerGroup(NamedTuple):
    """Layers with one page geometry: ``layers`` (model layer ids, in order), their ``pools`` (`TorchPools`, layer
    axis in that order), ``page_table i32[B, MP]`` (logical page -> pool page), ``pages_per_row`` physical low
    pages a row owns, ``window`` (None: full attention; else the sliding window, whose rows live in a ring)."""

    layers: tuple
    pools: TorchPools
    page_table: torch.Tensor
    pages_per_row: int
    window: Optional[int]


class StepPlan(NamedTuple):
    """A step's bookkeeping for one layer group (`StaticPagedCache.plan_step`), shared by its layers: ``group``
    (index into ``groups``), ``batch`` x ``tokens``, ``before i64[B]`` / ``lens i32[B]`` (lengths before and after),
    ``bad bool[B]`` (refused rows), ``low_slot`` / ``high_slot i64[B * T]`` (-1: not written), ``bits i32[]``
    (the error bits it sets); ``owner`` the cache that made it."""

    owner: "StaticPagedCache"
    group: int
    batch: int
    tokens: int
    before: torch.Tensor
    lens: torch.Tensor
    bad: torch.Tensor
    low_slot: torch.Tensor
    high_slot: torch.Tensor
    bits: torch.Tensor


class StaticPagedCache:
    """Pools, static tables and per-layer lengths of ``max_batch_size`` rows of up to ``max_cache_len`` tokens.

    A step of ``B <= max_batch_size`` rows uses rows ``[0, B)``.

    Sliding layers (``sliding_windows[l]`` set, smaller than ``max_cache_len``) hold only their window: their low
    pages form a ring of ``ceil((window + max_draft_len + 1) / page) + 1`` pages per row (their page table maps
    logical page ``q`` to ring page ``q mod R``), so a query never sees a row the ring has overwritten (a rewind of
    up to ``max_draft_len`` included). Full layers hold ``ceil(max_cache_len / page)`` pages per row.

    Args:
      config: `KVCacheConfig` (raw-token dtypes: ``bf16`` / ``fp16`` / ``fp8`` plain pages, ``nvfp4``,
        ``mixed_nvfp4_*``; no sparse or compressed algorithm). With ``k_smoothing=True`` the cache smooths K
        itself (below).
      num_layers, num_kv_heads, head_dim: the model's attention geometry (head_dim a multiple of 16).
      max_batch_size, max_cache_len: rows and tokens per row.
      device: torch device of the pools.
      sliding_windows: per layer, its sliding window or None (default: every layer full).
      global_scale: NVFP4 decode global scale, a float or ``f32[L, 2]`` (K, V); high_scale: an FP8 twin's / FP8
        plain pool's scale, same shapes.

    K smoothing (``config.k_smoothing``, `jmixedkv.levers`): a row's first stored tokens in a layer (its prefill, or
    its first chunk) set that row's per-(KV head, channel) K mean ``k_mean f32[L, B, H, D]`` (model space,
    post-RoPE, over the real tokens only); every key the row stores afterwards, twin rows included, is ``k -
    mean`` (float32, one rounding to the attention dtype after the rotation). Softmax attention is unchanged
    (each query's scores shift by ``sm_scale * q . mean``), so `attend` undoes nothing; its sinks use the
    unshifted LSE, and a soft-cap, which does not commute with the shift, is refused. A row emptied by `rewind`
    or `reset` takes a new mean at its next append; `select_rows` copies the means with the rows.
    """

    def __init__(self, config: KVCacheConfig, num_layers: int, num_kv_heads: int, head_dim: int, *,
                 max_batch_size: int, max_cache_len: int, device=None, sliding_windows=None, global_scale=1.0,
                 high_scale=1.0):
        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"StaticPagedCache needs a jmixedkv.KVCacheConfig, got {type(config).__name__}")
        _check_config(config)
        self.config = config
        self.num_layers = _positive_int(num_layers, "num_layers")
        self.num_kv_heads = _positive_int(num_kv_heads, "num_kv_heads")
        self.head_dim = _positive_int(head_dim, "head_dim")
        if head_dim % 16 or (config.rotation is not None and head_dim & (head_dim - 1)):
            raise ValueError(f"StaticPagedCache: head_dim={head_dim} must be a multiple of 16 (NVFP4 blocks)"
                             + (" and a power of two (the Hadamard rotation)" if config.rotation else ""))
        self.device = torch.device("cpu" if device is None else device)
        if self.device.type == "cuda":
            from .triton_attention import HEAD_DIMS
            if head_dim not in HEAD_DIMS:
                raise ValueError(f"StaticPagedCache: head_dim={head_dim} on CUDA; the Triton paged attention takes "
                                 f"head_dim in {HEAD_DIMS}")
        self.max_batch_size = _positive_int(max_batch_size, "max_batch_size")
        self.max_cache_len = _positive_int(max_cache_len, "max_cache_len")
        self.page_size = config.page_size
        self.geom = config.twin if config.is_mixed else None
        self.max_pages_per_seq = -(-max_cache_len // self.page_size)
        self.attention_dtype = _torch_dtype(config.attention_dtype)
        scales = (_layer_scale(global_scale, num_layers, "global_scale", self.device),
                  _layer_scale(high_scale, num_layers, "high_scale", self.device))
        self.groups = self._groups(_windows(sliding_windows, num_layers, max_cache_len), scales)
        self._where = {l: (g, i) for g, grp in enumerate(self.groups) for i, l in enumerate(grp.layers)}
        b = self.max_batch_size
        width = self.geom.width if self.geom is not None else 0
        self.high_table = torch.arange(b * width, dtype=torch.int32, device=self.device).reshape(b, width)
        self.kv_lens = torch.zeros(num_layers, b, dtype=torch.int32, device=self.device)
        self.written = torch.zeros(num_layers, b, dtype=torch.int32, device=self.device)
        self.error = torch.zeros((), dtype=torch.int32, device=self.device)
        self.k_mean = (torch.zeros(num_layers, b, num_kv_heads, head_dim, dtype=torch.float32, device=self.device)
                       if config.k_smoothing else None)
        self._hadamard = (torch_nvfp4.hadamard(head_dim, self.device) if config.rotation is not None else None)

    # ------------------------------------------------------------------ allocation
    def _groups(self, windows, scales) -> tuple:
        """One `LayerGroup` for the full layers, one per distinct sliding window."""
        groups = []
        for window in sorted(set(windows), key=lambda w: -1 if w is None else w):
            layers = tuple(l for l, w in enumerate(windows) if w == window)
            per_row = (self.max_pages_per_seq if window is None
                       else -(-(window + self.config.max_draft_len + 1) // self.page_size) + 1)
            mp, b = self.max_pages_per_seq, self.max_batch_size
            ring = torch.arange(mp, device=self.device) % per_row
            table = (torch.arange(b, device=self.device)[:, None] * per_row + ring[None, :]).to(torch.int32)
            pools = self._allocate(len(layers), b * per_row, [scales[0][list(layers)], scales[1][list(layers)]])
            groups.append(LayerGroup(layers, pools, table, per_row, window))
        return tuple(groups)

    def _allocate(self, num_layers: int, pages: int, scales) -> TorchPools:
        cfg, dev = self.config, self.device
        lyr, h, d, page = num_layers, self.num_kv_heads, self.head_dim, self.page_size
        low_data = low_scales = low_gs = high_rows = high_scale_t = plain_rows = plain_scale = None
        if cfg.has_low:
            low_data = torch.zeros(lyr, pages, 2, h, page, d // 2, dtype=torch.uint8, device=dev)
            low_scales = torch.zeros(lyr, pages, 2, h, page, d // 16, dtype=torch.uint8, device=dev)
            low_gs = scales[0].contiguous()
        if cfg.is_mixed:
            twin_pages = self.max_batch_size * cfg.twin.width
            high_rows = torch.zeros(lyr, twin_pages, 2, h, page, d, dtype=_torch_dtype(cfg.high_dtype), device=dev)
            high_scale_t = scales[1].contiguous()
        elif not cfg.has_low:
            plain_rows = torch.zeros(lyr, pages, 2, h, page, d, dtype=_torch_dtype(cfg.high_dtype), device=dev)
            plain_scale = scales[1].contiguous()
        return TorchPools(low_data, low_scales, low_gs, high_rows, high_scale_t, plain_rows, plain_scale)

    def group_of(self, layer: int):
        """``(LayerGroup, index of layer in it)``."""
        self._check_layer(layer)
        g, i = self._where[layer]
        return self.groups[g], i

    def group_index(self, layer: int) -> int:
        """Index into ``groups`` of ``layer``'s group."""
        self._check_layer(layer)
        return self._where[layer][0]

    def tensors(self):
        """Every device tensor the ops read or write in place (mark them static for CUDA graphs)."""
        out = [self.high_table, self.kv_lens, self.written, self.error]
        if self.k_mean is not None:
            out.append(self.k_mean)
        for grp in self.groups:
            out += [t for t in grp.pools if t is not None] + [grp.page_table]
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of the pools (what the cache costs in device memory)."""
        return sum(t.numel() * t.element_size() for grp in self.groups for t in grp.pools if t is not None)

    # ------------------------------------------------------------------ the hot path
    def plan_step(self, layer: int, positions: torch.Tensor, batch: int) -> "StepPlan":
        """The bookkeeping of a step of ``batch`` rows at ``positions i64[B or 1, T]`` (``position_ids``: a row's
        real tokens are its last ``new`` ones, at positions ``kv_lens, kv_lens + 1, ...``; tokens before them are
        left padding, not stored) for ``layer``'s group, from ``layer``'s lengths: which rows are refused (positions
        that do not continue a row, or run past ``max_cache_len``), the lengths after, and the slots written. Every
        layer of the group can `append` with it (a model's layers step together). No host sync."""
        grp, _ = self.group_of(layer)
        b = batch
        if positions.dim() != 2 or positions.shape[-1] < 1 or positions.shape[0] not in (1, b):
            raise ValueError(f"StaticPagedCache: positions {list(positions.shape)}; expected [{b} or 1, T >= 1]")
        t = positions.shape[-1]
        pos = positions.to(device=self.device, dtype=torch.int64).expand(b, t)
        before = self.kv_lens[layer, :b].to(torch.int64)                # a copy: the lengths before the step
        new = pos[:, -1] + 1 - before                                  # real tokens of this step per row
        j = torch.arange(t, device=self.device)[None, :]
        first = (t - new)[:, None]
        real = j >= first
        want = before[:, None] + j - first
        too_long = pos[:, -1] >= self.max_cache_len
        bad = (new < 0) | (new > t) | (real & (pos != want)).any(dim=1) | too_long
        write = real & ~bad[:, None]
        low_slot, high_slot = self._slots(grp.page_table[:b], pos, write)
        lens = torch.where(bad, before, before + new).to(torch.int32)
        bits = (torch.where(too_long.any(), ERR_TOO_LONG, 0)
                | torch.where((bad & ~too_long).any(), ERR_BAD_POSITION, 0)).to(torch.int32)
        return StepPlan(self, self._where[layer][0], b, t, before, lens, bad, low_slot.reshape(-1),
                        high_slot.reshape(-1), bits)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: Optional[torch.Tensor] = None, *,
               plan: Optional["StepPlan"] = None):
        """Store a step's rows of ``layer``: ``k, v [B, H, T, D]`` (post-RoPE, model space, any float dtype) at
        ``positions i64[B or 1, T]`` (`plan_step` says how they are read), or with the ``plan`` another layer of
        the group made for this step (`plan_step`; ``positions`` unused): a row whose length in this layer is not
        the plan's is refused, as positions that do not continue it.

        Returns ``(kv_lens i32[B] after the step, bad bool[B])``; a bad row is left unchanged and sets an ``error``
        bit. No host sync."""
        grp, index = self.group_of(layer)
        b, h, t, d = k.shape
        if not 1 <= b <= self.max_batch_size or (h, d) != (self.num_kv_heads, self.head_dim) or v.shape != k.shape:
            raise ValueError(f"StaticPagedCache.append: k {list(k.shape)} / v {list(v.shape)}; expected "
                             f"[B <= {self.max_batch_size}, {self.num_kv_heads}, T, {self.head_dim}]")
        if plan is None:
            if positions is None or positions.dim() != 2 or positions.shape[-1] != t:
                raise ValueError(f"StaticPagedCache.append: positions "
                                 f"{None if positions is None else list(positions.shape)}; expected [{b} or 1, {t}]")
            plan = self.plan_step(layer, positions, b)
            low_slot, high_slot, lens, bad, bits = plan.low_slot, plan.high_slot, plan.lens, plan.bad, plan.bits
            before = plan.before
        else:
            if plan.owner is not self:
                raise ValueError("StaticPagedCache.append: the plan was made by another StaticPagedCache")
            if plan.group != self._where[layer][0] or (plan.batch, plan.tokens) != (b, t):
                raise ValueError(f"StaticPagedCache.append: layer {layer} (group {self._where[layer][0]}) with k "
                                 f"{list(k.shape)} was given a plan of group {plan.group} for {plan.batch} rows x "
                                 f"{plan.tokens} tokens")
            before = self.kv_lens[layer, :b]
            stale = plan.before != before                               # this layer is out of step with the plan
            skip = stale[:, None].expand(b, t).reshape(-1)
            low_slot = torch.where(skip, -1, plan.low_slot)
            high_slot = torch.where(skip, -1, plan.high_slot)
            lens = torch.where(stale, before, plan.lens)
            bad = plan.bad | stale
            bits = plan.bits | torch.where(stale.any(), ERR_BAD_POSITION, 0).to(torch.int32)
        if self.k_mean is not None:
            k = self._smoothed(layer, k, low_slot.view(b, t) >= 0, before)
        rows_k = self._stored(k.transpose(1, 2).reshape(b * t, h, d))
        rows_v = self._stored(v.transpose(1, 2).reshape(b * t, h, d))
        paged_ops.write_rows(grp.pools, index, rows_k, rows_v, low_slot, high_slot, self.page_size,
                             self.config.block_scale)
        self.kv_lens[layer, :b].copy_(lens)
        self.written[layer, :b].copy_(torch.maximum(self.written[layer, :b], lens))
        self.error.bitwise_or_(bits)
        return lens, bad

    def attend(self, layer: int, q: torch.Tensor, lens: torch.Tensor, bad: Optional[torch.Tensor] = None, *,
               sm_scale: Optional[float] = None, sliding_window: Optional[int] = None,
               soft_cap: Optional[float] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Attention of ``q [B, Hq, Tq, D]`` (model space; token ``t`` at position ``lens - Tq + t``, its K/V
        appended) over ``layer``'s cache -> ``[B, Tq, Hq, D]`` in the attention dtype. ``sinks f32[Hq]``: one
        logit per head on the scaled-logit scale (gpt-oss). A ``bad`` row (from `append`) gets NaN."""
        grp, index = self.group_of(layer)
        b, hq, tq, d = q.shape
        if self.k_mean is not None and soft_cap is not None:
            raise ValueError(f"StaticPagedCache.attend: soft_cap={soft_cap} on a K-smoothed cache; a soft-cap does "
                             f"not commute with the smoothing shift (build the KVCacheConfig without k_smoothing)")
        if not 1 <= b <= self.max_batch_size or d != self.head_dim or hq % self.num_kv_heads or lens.shape != (b,):
            raise ValueError(f"StaticPagedCache.attend: q {list(q.shape)}, lens {list(lens.shape)}; expected q "
                             f"[B <= {self.max_batch_size}, a multiple of {self.num_kv_heads}, Tq, {self.head_dim}] "
                             f"and lens [B]")
        qs = self._stored(q.transpose(1, 2))
        scale = d ** -0.5 if sm_scale is None else float(sm_scale)
        if grp.window is not None and (sliding_window is None or sliding_window > grp.window):
            raise ValueError(f"StaticPagedCache.attend: layer {layer} holds a window of {grp.window} tokens; "
                             f"sliding_window={sliding_window} would read rows its ring has dropped")
        out, lse = paged_ops.paged_attention(grp.pools, index, qs, grp.page_table[:b], self.high_table[:b], lens,
                                             self.page_size, self.geom, scale, sliding_window, soft_cap)
        if sinks is not None:
            if self.k_mean is not None:                               # the LSE of the unshifted keys
                lse = lse + scale * self._mean_logit(layer, q)
            out = paged_ops.apply_sinks(out, lse, sinks)
        if self._hadamard is not None:
            out = out @ self._hadamard
        if bad is not None:
            out = torch.where(bad[:, None, None, None], torch.full_like(out, float("nan")), out)
        return out.to(self.attention_dtype)

    # ------------------------------------------------------------------ host-side
    def raise_errors(self) -> None:
        """Raise `ValueError` naming the sticky error bits set by earlier steps (one host sync), then clear them."""
        bits = int(self.error.item())
        if bits:
            from jmixedkv.checks import describe_error
            self.error.zero_()
            raise ValueError(f"StaticPagedCache: a step was refused and its rows left unchanged: "
                             f"{describe_error(bits)} (max_cache_len={self.max_cache_len})")

    def reset(self) -> None:
        """Every row empty (pools are not cleared: rows past ``kv_lens`` are never read)."""
        self.kv_lens.zero_()
        self.written.zero_()
        self.error.zero_()
        if self.k_mean is not None:
            self.k_mean.zero_()

    def rewind(self, n: int) -> None:
        """Drop the last ``n`` tokens of every row of every layer, within each row's rewind floor: at most
        ``max_draft_len`` behind the furthest position it has written (the twin's ring and a sliding layer's ring
        keep exactly that much slack, docs/DESIGN.md §4). ``n`` past ``max_draft_len`` raises; a row whose floor
        it would cross (earlier rewinds) is left unchanged and sets ``ERR_BAD_CORRECTION`` (`raise_errors`). No
        host sync."""
        limit = self.config.max_draft_len
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= limit:
            raise ValueError(f"StaticPagedCache.rewind: n={n!r}; expected 0 <= n <= max_draft_len={limit} (build the "
                             f"KVCacheConfig with a larger max_draft_len)")
        new = self.kv_lens - n
        unused = self.written == 0                                       # rows no step has written since reset
        ok = (new >= torch.clamp(self.written - limit, min=0)) | unused
        self.kv_lens.copy_(torch.where(ok & ~unused, new, self.kv_lens))
        self.error.bitwise_or_(torch.where(ok.all(), 0, ERR_BAD_CORRECTION).to(torch.int32))

    def select_rows(self, src_rows) -> None:
        """Row ``b`` continues old row ``src_rows[b]`` (beam search / batch selection): whole pages are copied;
        rows past ``len(src_rows)`` become empty."""
        src = torch.as_tensor(src_rows, dtype=torch.int64).reshape(-1).to(self.device)
        n = src.numel()
        if n > self.max_batch_size or (n and (int(src.min()) < 0 or int(src.max()) >= self.max_batch_size)):
            raise ValueError(f"StaticPagedCache.select_rows: rows {src.tolist()} must be < max_batch_size="
                             f"{self.max_batch_size} and at most that many")
        b, width = self.max_batch_size, self.geom.width if self.geom is not None else 0
        for grp in self.groups:
            p = grp.pools
            for t, per_row in ((p.low_data, grp.pages_per_row), (p.low_scales, grp.pages_per_row),
                               (p.plain_rows, grp.pages_per_row), (p.high_rows, width)):
                if t is None or per_row == 0:
                    continue
                view = t.view(t.shape[0], b, per_row, *t.shape[2:])
                view[:, :n] = view[:, src].clone()
        for t in (self.kv_lens, self.written) + (() if self.k_mean is None else (self.k_mean,)):
            old = t.clone()
            t.zero_()
            t[:, :n] = old[:, src]

    def as_cache_state(self, layer: int):
        """One layer of the cache as a one-layer JAX `jmixedkv.CacheState` (its pools, page table and twin table,
        its ``kv_lens``, every row admitted), for JAX readers: ``jm.decode_attention(state, 0, ...)``. A sliding
        layer's table maps onto its ring: read it with its ``sliding_window``. Pools cross by DLPack
        (`interop.dlpack.from_torch`, copying only where it must). Read-only: the returned state's allocator does
        not know the static pages."""
        import dataclasses

        import jax
        import jax.numpy as jnp

        from jmixedkv.state import GroupSpec, init_state
        from .dlpack import from_torch

        grp, i = self.group_of(layer)
        b, mp, cfg = self.max_batch_size, self.max_pages_per_seq, self.config
        width = self.geom.width if self.geom is not None else 0
        state = init_state(cfg, GroupSpec(1, self.num_kv_heads, self.head_dim), num_pages=b * grp.pages_per_row,
                           max_seqs=b, max_pages_per_seq=mp, num_high_pages=max(b * width, 1))

        def jax_of(t, like):
            x = from_torch(t.contiguous(), copy=None)
            if x.dtype == jnp.uint8 and like.dtype != jnp.uint8:       # E4M3 bytes
                x = jax.lax.bitcast_convert_type(x, like.dtype)
            if x.shape != like.shape:
                raise ValueError(f"as_cache_state: pool {tuple(x.shape)} does not fit the JAX layout {like.shape}")
            return x

        p, pools = grp.pools, state.pools[0]
        if pools.low is not None:
            pools = dataclasses.replace(pools, low=dataclasses.replace(
                pools.low, data=jax_of(p.low_data[i:i + 1], pools.low.data),
                scales=jax_of(p.low_scales[i:i + 1], pools.low.scales), gs=jax_of(p.low_gs[i:i + 1], pools.low.gs)))
        if pools.high is not None and p.high_rows is not None and width:
            pools = dataclasses.replace(pools, high=dataclasses.replace(
                pools.high, rows=jax_of(p.high_rows[i:i + 1], pools.high.rows),
                scale=jax_of(p.high_scale[i:i + 1], pools.high.scale)))
        if pools.plain is not None:
            pools = dataclasses.replace(pools, plain=dataclasses.replace(
                pools.plain, rows=jax_of(p.plain_rows[i:i + 1], pools.plain.rows),
                scale=jax_of(p.plain_scale[i:i + 1], pools.plain.scale)))
        lens = jax_of(self.kv_lens[layer].contiguous(), state.kv_lens)
        high_table = jax_of(self.high_table, state.high_table) if width else state.high_table
        return dataclasses.replace(state, pools=(pools,), page_table=jax_of(grp.page_table, state.page_table),
                                   high_table=high_table, kv_lens=lens, written=lens, active=jnp.ones((b,), bool))

    # ------------------------------------------------------------------ internals
    def _check_layer(self, layer) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"StaticPagedCache: layer {layer!r} out of range [0, {self.num_layers})")

    def _stored(self, x: torch.Tensor) -> torch.Tensor:
        """Rows as stored: rotated (float32, one rounding to the attention dtype) when the lever is on."""
        if self._hadamard is None:
            return x.to(self.attention_dtype)
        return (x.float() @ self._hadamard).to(self.attention_dtype)

    def _smoothed(self, layer: int, k: torch.Tensor, written: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
        """``k [B, H, T, D]`` minus each row's K mean, float32 (``k_smoothing``). A row with nothing stored before
        the step (``before i64[B]`` = 0) and tokens written in it (``written bool[B, T]``) first takes the mean of
        those tokens as its frozen mean."""
        b = k.shape[0]
        kf = k.float()
        w = written[:, None, :, None].to(torch.float32)
        count = w.sum(dim=2)                                             # [B, 1, 1]
        mean = (kf * w).sum(dim=2) / count.clamp(min=1.0)                # [B, H, D]
        take = ((before == 0) & (count[:, 0, 0] > 0))[:, None, None]
        mean = torch.where(take, mean, self.k_mean[layer, :b])
        self.k_mean[layer, :b].copy_(mean)
        return kf - mean[:, :, None, :]

    def _mean_logit(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """``q . mean`` per query ``f32[B, Tq, Hq]`` for ``q [B, Hq, Tq, D]`` (model space): what K smoothing took
        off every score of that query."""
        b, hq = q.shape[:2]
        mean = self.k_mean[layer, :b].repeat_interleave(hq // self.num_kv_heads, dim=1)      # [B, Hq, D]
        return torch.einsum("bhtd,bhd->bth", q.float(), mean)

    def _slots(self, page_table: torch.Tensor, pos: torch.Tensor, write: torch.Tensor):
        """``(low_slot, high_slot) i64[B, T]`` of tokens at ``pos`` (``write`` False -> -1), with the twin's write
        dedupe (a ring row that a later token of the same step overwrites is not written: `TwinGeometry.write_mask`)."""
        page = self.page_size
        p = torch.clamp(pos, min=0)
        q, row = p // page, p % page
        mp = self.max_pages_per_seq
        qc = torch.clamp(q, max=mp - 1)
        low = torch.gather(page_table.to(torch.int64), 1, qc) * page + row
        low_slot = torch.where(write, low, torch.full_like(low, -1))
        g = self.geom
        if g is None or g.width == 0:
            return low_slot, torch.full_like(low_slot, -1)
        qmax = p[:, -1:] // page
        if g.num_ring:
            col = torch.where(q < g.num_fixed, q, g.num_fixed + q % g.num_ring)
            keep = (q < g.num_fixed) | (q > qmax - g.num_ring)
        else:
            col = torch.where(q < g.num_fixed, q, torch.full_like(q, -1))
            keep = q < g.num_fixed
        ok = write & keep & (col >= 0)
        high_table = self.high_table[:pos.shape[0]].to(torch.int64)
        high = torch.gather(high_table, 1, torch.clamp(col, 0, g.width - 1)) * page + row
        return low_slot, torch.where(ok, high, torch.full_like(high, -1))


def _check_config(config: KVCacheConfig) -> None:
    if config.sparse_algorithm is not None:
        raise ValueError(f"StaticPagedCache holds raw-token pages for dense attention only; "
                         f"sparse_algorithm={config.sparse_algorithm!r}")
    if config.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"StaticPagedCache: dtype {config.dtype!r} is not one of {_SUPPORTED_DTYPES}")


_SUPPORTED_DTYPES = ("bf16", "fp16", "fp8", "nvfp4", "mixed_nvfp4_bf16", "mixed_nvfp4_fp16", "mixed_nvfp4_fp8")


def _windows(sliding_windows, num_layers: int, max_cache_len: int) -> list:
    """Per layer, its window (None: full; a window that covers ``max_cache_len`` is full)."""
    if sliding_windows is None:
        return [None] * num_layers
    windows = list(sliding_windows)
    if len(windows) != num_layers:
        raise ValueError(f"StaticPagedCache: sliding_windows has {len(windows)} entries for {num_layers} layers")
    for w in windows:
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"StaticPagedCache: a sliding window must be an integer >= 1 or None, got {w!r}")
    return [None if w is None or w >= max_cache_len else w for w in windows]


def _layer_scale(value, num_layers: int, name: str, device) -> torch.Tensor:
    """A per-(layer, K/V) float32 scale ``[L, 2]`` from a float or an array of that shape (finite and > 0)."""
    t = torch.as_tensor(value, dtype=torch.float32)
    try:
        t = torch.broadcast_to(t, (num_layers, 2)).contiguous()
    except RuntimeError:
        raise ValueError(f"StaticPagedCache: {name} of shape {tuple(t.shape)} does not broadcast to "
                         f"[{num_layers}, 2]") from None
    if not (torch.isfinite(t) & (t > 0)).all():
        raise ValueError(f"StaticPagedCache: {name} must be finite and > 0, got {t.flatten()[:4].tolist()}")
    return t.to(device)
