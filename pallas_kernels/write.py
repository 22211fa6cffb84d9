"""The fused write kernel: quantize new K/V rows into NVFP4 pages and store retained rows, with in-kernel RoPE.

One Pallas Triton ``pallas_call`` does the whole row store of `jmixedkv.state.append` for one layer or all layers
of a group, in place (every pool is aliased input -> output; jit the caller with ``donate_argnums`` or XLA
copies each pool once per call). It is bit-identical to the reference path of `jmixedkv.write.write_rows`::

    k = apply_rope(k, pos, rope).astype(k.dtype)          # if rope
    write_rows_reference(pools, stack(k, v), layer, low_slot, high_slot, page_size)

Grid ``(token blocks, layers, head groups)``; a program owns ``BT`` tokens x ``HB`` heads of one layer and
handles K and V (or the MLA latent). It loads the slot ids of its tokens, the rows (``[BT, DP]``, ``DP`` =
head_dim padded to a power of two, padded columns clamped on load and masked on store), rotates K, rounds it
to K's dtype, then

* NVFP4-quantizes the row (the arithmetic of the `pallas_kernels.nvfp4` quantize kernel, bit-identical to
  `jmixedkv.nvfp4.quantize_reference`) into ``low.data`` / ``low.scales`` at
  ``low_slot`` (mixed and low groups),
* stores the row into ``high.rows`` at ``high_slot`` (mixed groups) or ``plain.rows`` at ``low_slot`` (plain
  groups): a cast for bf16 / fp16, ``e4m3(clip(x / scale, ±448))`` for fp8 (`jmixedkv.numerics.encode_rows`).

Rows whose slot is -1 are not written (masked stores; in interpret mode the masked rows point past the last
page, where the discharged scatter drops them).

RoPE: ``cos``/``sin`` are computed outside the kernel by the same jnp code as the reference
(`jmixedkv.numerics.rope_cos_sin`, f32 ``[T, rd/2]``), so they are bit-identical by construction. In the kernel each
element ``j`` is rotated against its partner column (``j +- rd/2`` for neox, ``j ^ 1`` for interleaved), loaded
by a second gather load of the same row: ``out_j = x_j * cos - p_j * sin'`` with ``sin' = -sin`` on the second
half (neox) / odd elements (interleaved). ``y*c - x*(-s)`` equals ``y*c + x*s`` bit for bit (negation is exact
and ``a - (-b)`` is ``a + b`` in IEEE arithmetic).

**How FMA contraction (and approximate division) is prevented on the GPU.** Pallas Triton offers no
``enable_fp_fusion=False`` knob, and ``ptxas`` contracts a plain ``mul.f32`` feeding an ``add/sub.f32`` into
an ``fma`` by default. Worse, Triton lowers an f32 ``arith.divf`` to ``div.full.f32`` (an approximation, up to
2 ulp), not IEEE division. So every float32 product, the RoPE difference and every division of this kernel
go through `pltriton.elementwise_inline_asm` with PTX instructions that carry an explicit rounding modifier:
``mul.rn.f32``, ``sub.rn.f32``, ``div.rn.f32``. PTX never fuses instructions with an explicit ``.rn`` into an
FMA, and ``div.rn.f32`` is the correctly rounded IEEE division; no ``.ftz``, so subnormals are kept like XLA.
The rotation is three single-instruction asm calls (one asm block ``mul.rn; mul.rn; sub.rn`` with four operands
compiled to wrong results on the H200 with triton 3.6; the single-instruction form matches numpy). In interpret
mode (CPU) the asm cannot run: the kernel uses plain jnp ops and routes each product through an integer OR with a
zero the compiler cannot prove zero (`jmixedkv.numerics.launder`), so no FMA can absorb it
(``lax.optimization_barrier`` alone does NOT stop XLA CPU: barriers are expanded before fusion and its LLVM backend
always allows FP-op fusion).
`dump_kernel_ir` prints the Triton IR of the kernel (a CPU test checks the ``.rn`` ops are there and no plain
f32 division is). On the H200 the in-kernel RoPE equals numpy's separately rounded float32 result bit for bit on
data where an FMA changes the value (``test_gpu_fma_sensitive_rows_match_numpy``).
XLA's PTX dump (``--xla_dump_to``) did not contain the Triton kernel's PTX on jax 0.11.2 (0 entries), so an
``fma`` count of the compiled kernel is not available.

Interpret vs compiled: `write_rows` runs interpret mode when no GPU is present (`jmixedkv.compat.on_gpu`).
`lowering_for_cuda()` forces the compiled (asm) path while tracing, for CUDA cross-lowering on a CPU machine.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jmixedkv.compat import on_gpu, pl, pltriton, triton_params
from jmixedkv.layout import check_offsets
from jmixedkv.numerics import BLOCK, encode_rows, launder, next_pow2, opaque_zero, rope_cos_sin

from .nvfp4_ops import as_bits, div_rn, f32_halves, ptx_f32, quantize_halves

__all__ = ["write_rows", "lowering_for_cuda", "dump_kernel_ir", "plan_for", "KERNEL_NAME", "rope_rows_f32"]

KERNEL_NAME = "jmixedkv_write_rows"
_ANY = getattr(pl, "ANY", None) or pl.MemorySpace.ANY
_FORCE_COMPILED = [False]


@contextlib.contextmanager
def lowering_for_cuda():
    """While active, kernels trace their compiled-GPU form (inline PTX, no interpret mode) even on a CPU
    machine: use it around ``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))``. Trace a fresh
    function inside it (jit caches traces by function)."""
    _FORCE_COMPILED[0] = True
    try:
        yield
    finally:
        _FORCE_COMPILED[0] = False


# --------------------------------------------------------------------------------------------- exact f32 ops
class _PtxOps:
    """Float32 ops with explicit PTX rounding (compiled GPU path): never contracted, IEEE division."""

    @staticmethod
    def div(a, b):
        return div_rn(a, b)

    @staticmethod
    def rotate(x, p, c, s):
        """``x*c - p*s`` with both products and the difference rounded separately.

        Three single-instruction asm calls: one multi-instruction asm block with four operands compiled to wrong
        results on the H200 (triton 3.6), while these match numpy bit for bit there."""
        return ptx_f32("sub.rn.f32 $0, $1, $2;", ptx_f32("mul.rn.f32 $0, $1, $2;", x, c),
                       ptx_f32("mul.rn.f32 $0, $1, $2;", p, s))


class _JnpOps:
    """The same ops in plain jnp (interpret mode on CPU). Every product is laundered so XLA can neither contract
    it into an FMA nor reassociate a chain of multiplies (it hoists scalar factors: ``e * (a * c)`` would become
    ``a * (e * c)``)."""

    @staticmethod
    def div(a, b):
        return a / b

    @staticmethod
    def rotate(x, p, c, s):
        z = opaque_zero(c)
        return launder(x * c, z) - launder(p * s, z)


def _negate(a):
    """``-a`` by flipping the sign bit. Pallas Triton lowers ``-a`` as ``0 - a``, which maps +0.0 to +0.0; RoPE's
    signed ``sin`` must give -0.0 at angle 0 so that ``y*c - x*(-s)`` equals the reference's ``y*c + x*s`` for
    every sign of zero."""
    return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(a, jnp.int32) ^ jnp.int32(-2 ** 31),
                                        jnp.float32)


# --------------------------------------------------------------------------------------------- in-kernel codec
def _quantize_tile(x, gs, exact_asm: bool, block_scale: str = "max6"):
    """NVFP4 of ``x f32[BT, DP]`` with the arithmetic of the `pallas_kernels.nvfp4` quantize kernel
    (`pallas_kernels.nvfp4_ops.quantize_halves`, exact ``div.rn`` reciprocals when ``exact_asm``).

    Returns ``(packed u8[BT, DP/2], scales float8_e4m3fn[BT, DP/16])``, bit-identical to
    `jmixedkv.nvfp4.quantize_reference`."""
    bt, dp = x.shape
    lo, hi, signs = f32_halves(as_bits(x).reshape(bt, dp // BLOCK, BLOCK))        # [BT, B, 8] each
    packed, byte = quantize_halves(lo, hi, signs, jnp.reshape(gs, (1, 1)), exact_asm, block_scale)
    packed = packed.astype(jnp.uint8).reshape(bt, dp // 2)
    return packed, jax.lax.bitcast_convert_type(byte.astype(jnp.uint8), jnp.float8_e4m3fn)


def _encode_row(x, dtype, scale, ops):
    """Store form of rows ``x`` (already in the row's source dtype) for a row pool of ``dtype``
    (`jmixedkv.numerics.encode_rows` with the kernel's exact division)."""
    return encode_rows(x, dtype, scale, div=lambda a, b: ops.div(a, jnp.broadcast_to(b, a.shape)))


# --------------------------------------------------------------------------------------------- static plan
@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static kernel configuration (hashable)."""

    num_tokens: int
    num_layers: int          # layers in the pools
    all_layers: bool
    kv: int
    heads: int
    head_dim: int
    dp: int                  # head_dim padded to a power of two
    page: int
    low_pages: int           # pages of the low / plain pool (0 if none)
    high_pages: int          # pages of the high pool (0 if none)
    has_low: bool
    row_pool: Optional[str]  # "high", "plain" or None
    row_dtype: Optional[str]
    k_dtype: str
    v_dtype: Optional[str]
    rope_style: Optional[str]
    rotary_dim: int
    block_t: int
    heads_per_program: int
    interpret: bool
    num_warps: int = 4
    block_scale: str = "max6"   # NVFP4 block scaling ("max6" | "4over6", `jmixedkv.nvfp4.quantize_reference`)

    @property
    def grid(self):
        return (pl.cdiv(self.num_tokens, self.block_t), self.num_layers if self.all_layers else 1,
                self.heads // self.heads_per_program)


def _default_blocks(num_tokens: int, dp: int):
    """(block_t, heads_per_program): at most 16 tokens x 256 columns per program, one head per program.

    The fastest in the H200 sweep of `bench/write_bench.py` (32 layers x 8 heads x 128; figures in
    bench/RESULTS.md), for the prefill chunk and the decode step alike."""
    return max(1, min(next_pow2(num_tokens), max(1, 4096 // dp), 16)), 1


# --------------------------------------------------------------------------------------------- kernel
def _slot_rows(slot_ref, t_in, t_ok, page: int, num_pages: int):
    """(page i32[BT, 1], row i32[BT, 1], ok bool[BT, 1]) of the tokens' slots; masked rows point at page
    ``num_pages`` (out of range: dropped by the interpret-mode scatter, never touched by a masked GPU store)."""
    slot = slot_ref[t_in]
    ok = t_ok & (slot >= 0)
    pg = jnp.where(ok, slot // page, num_pages)
    row = jnp.where(ok, slot % page, 0)
    return pg[:, None], row[:, None], ok[:, None]


def _row_mask(ok, cols, n, padded):
    """Store mask ``[BT, C]``: rows with a slot, and (only when D was padded) columns below ``n``."""
    return (ok & (cols < n)) if padded else jnp.broadcast_to(ok, (ok.shape[0], cols.shape[1]))


def _rope_tables(plan: _Plan, cos_ref, sin_ref, t_in, col):
    """cos and signed sin ``f32[BT, DP]`` per column, and the partner column ``i32[1, DP]``."""
    rd, half = plan.rotary_dim, plan.rotary_dim // 2
    if plan.rope_style == "neox":
        second = (col >= half) & (col < rd)
        fcol = jnp.where(col >= half, col - half, col)
        partner = jnp.where(col < half, col + half, jnp.where(col < rd, col - half, col))
    else:
        second = ((col & 1) == 1) & (col < rd)
        fcol = col >> 1
        partner = jnp.where(col < rd, col ^ 1, col)
    fcol = jnp.minimum(fcol, half - 1)
    partner = jnp.minimum(partner, plan.head_dim - 1)
    c = cos_ref[t_in[:, None], fcol]
    s = sin_ref[t_in[:, None], fcol]
    return c, jnp.where(second, _negate(s), s), partner


def _write_kernel(plan: _Plan, *refs):
    ops = _JnpOps if plan.interpret else _PtxOps
    refs = list(refs)
    take = lambda: refs.pop(0)  # noqa: E731
    layer_ref, lslot_ref, hslot_ref, k_ref = take(), take(), take(), take()
    v_ref = take() if plan.kv == 2 else None
    cos_ref, sin_ref = (take(), take()) if plan.rope_style else (None, None)
    gs_ref = take() if plan.has_low else None
    rscale_ref = take() if plan.row_pool else None
    n_pool = (2 if plan.has_low else 0) + (1 if plan.row_pool else 0)
    refs = refs[n_pool:]  # aliased inputs: only the outputs are written
    data_ref, scales_ref = (take(), take()) if plan.has_low else (None, None)
    rows_ref = take() if plan.row_pool else None

    bt, dp, d = plan.block_t, plan.dp, plan.head_dim
    t = pl.program_id(0) * bt + jax.lax.broadcasted_iota(jnp.int32, (bt,), 0)
    t_ok = t < plan.num_tokens
    t_in = jnp.minimum(t, plan.num_tokens - 1)
    layer = pl.program_id(1) if plan.all_layers else layer_ref[0]
    col = jax.lax.broadcasted_iota(jnp.int32, (1, dp), 1)
    padded = dp != d  # clamp / mask columns only when D is not a power of two (keeps loads vectorizable)
    col_in = jnp.minimum(col, d - 1) if padded else col

    low_pg = low_row = low_ok = None
    if plan.has_low or plan.row_pool == "plain":
        low_pg, low_row, low_ok = _slot_rows(lslot_ref, t_in, t_ok, plan.page, plan.low_pages)
    if plan.row_pool == "high":
        row_pg, row_row, row_ok = _slot_rows(hslot_ref, t_in, t_ok, plan.page, plan.high_pages)
    else:
        row_pg, row_row, row_ok = low_pg, low_row, low_ok
    # neox over the whole (power-of-two) head: rotate the two halves as separate contiguous tiles (vector loads);
    # otherwise one tile with a gathered partner column
    halves = plan.rope_style == "neox" and plan.rotary_dim == d and not padded
    if halves:
        col_h = jax.lax.broadcasted_iota(jnp.int32, (1, d // 2), 1)
        cos_h, sin_h = cos_ref[t_in[:, None], col_h], sin_ref[t_in[:, None], col_h]
        neg_sin_h = _negate(sin_h)
    elif plan.rope_style:
        cos_t, sin_t, partner = _rope_tables(plan, cos_ref, sin_ref, t_in, col)

    def load(src, h, cols):
        if plan.all_layers:
            return src[layer, t_in[:, None], h, cols]
        return src[t_in[:, None], h, cols]

    def segments(src, h, rotate):
        """``[(first column, rows [BT, W] in the source dtype)]`` covering the head, RoPE applied if ``rotate``."""
        if rotate and halves:
            x1, x2 = load(src, h, col_h), load(src, h, col_h + d // 2)
            a, b = x1.astype(jnp.float32), x2.astype(jnp.float32)
            # x' = x c - y s;  y' = y c + x s = y c - x (-s): the same separately rounded ops as the reference
            return [(0, ops.rotate(a, b, cos_h, sin_h).astype(x1.dtype)),
                    (d // 2, ops.rotate(b, a, cos_h, neg_sin_h).astype(x1.dtype))]
        x = load(src, h, col_in)
        if not rotate:
            return [(0, x)]
        xf = x.astype(jnp.float32)
        rot = ops.rotate(xf, load(src, h, partner).astype(jnp.float32), cos_t, sin_t)
        return [(0, jnp.where(col < plan.rotary_dim, rot, xf).astype(x.dtype))]

    def store(h, kvi, c0, x):
        w = x.shape[1]
        cw = c0 + jax.lax.broadcasted_iota(jnp.int32, (1, w), 1)
        c2 = c0 // 2 + jax.lax.broadcasted_iota(jnp.int32, (1, w // 2), 1)
        c16 = c0 // BLOCK + jax.lax.broadcasted_iota(jnp.int32, (1, w // BLOCK), 1)
        if plan.has_low:
            packed, scales = _quantize_tile(x.astype(jnp.float32), gs_ref[layer, kvi], not plan.interpret,
                                            plan.block_scale)
            pltriton.store(data_ref.at[layer, low_pg, kvi, h, low_row, c2], packed,
                           mask=_row_mask(low_ok, c2, d // 2, padded))
            pltriton.store(scales_ref.at[layer, low_pg, kvi, h, low_row, c16], scales,
                           mask=_row_mask(low_ok, c16, d // BLOCK, padded))
        if plan.row_pool:
            enc = _encode_row(x, jnp.dtype(plan.row_dtype), rscale_ref[layer, kvi], ops)
            pltriton.store(rows_ref.at[layer, row_pg, kvi, h, row_row, cw], enc,
                           mask=_row_mask(row_ok, cw, d, padded))

    head0 = pl.program_id(2) * plan.heads_per_program  # program ids must be read outside the loop body

    def one_head(hh, carry):
        h = head0 + hh
        for kvi in range(plan.kv):
            src = k_ref if kvi == 0 else v_ref
            for c0, x in segments(src, h, kvi == 0 and plan.rope_style is not None):
                store(h, kvi, c0, x)
        return carry

    jax.lax.fori_loop(0, plan.heads_per_program, one_head, 0)


# --------------------------------------------------------------------------------------------- host wrapper
def _geometry(low, high, plain):
    """(L, kv, H, page, D) of the pool arrays, checking they agree."""
    if (low is None) == (plain is None) or (high is not None and low is None):
        raise ValueError("write_rows: pass low= (NVFP4 pages, optionally with a high= twin) or plain= (row pages)")
    arrays = [(f"{name}.rows", pool[0].shape) for name, pool in (("high", high), ("plain", plain)) if pool is not None]
    if low is not None:
        arrays += [("low.data", low[0].shape[:-1] + (low[0].shape[-1] * 2,)),
                   ("low.scales", low[1].shape[:-1] + (low[1].shape[-1] * BLOCK,))]
    geo = {(s[0],) + tuple(s[2:]) for _, s in arrays}
    if len(geo) != 1 or any(len(s) != 6 for _, s in arrays):
        raise ValueError(f"write_rows: pools disagree on [L, _, kv, H, page, D]: {dict(arrays)}")
    return next(iter(geo))


def _check_inputs(geo, k, v, layer, low_slot, high_slot, page_size, positions, rope_style, rotary_dim, mixed):
    num_layers, kv, heads, page, d = geo
    if page != page_size:
        raise ValueError(f"write_rows: page_size={page_size} but the pools hold pages of {page} rows")
    want = 3 if layer is not None else 4
    if k.ndim != want or k.shape[-2:] != (heads, d):
        lead = "[T, H, D]" if layer is not None else "[L, T, H, D]"
        raise ValueError(f"write_rows: k must be {lead} with H={heads}, D={d}; got {k.shape}")
    if layer is None and k.shape[0] != num_layers:
        raise ValueError(f"write_rows: all-layer k has {k.shape[0]} layers, the pools hold {num_layers}")
    if isinstance(layer, (int, np.integer)) and not 0 <= int(layer) < num_layers:
        raise ValueError(f"write_rows: layer={layer} outside [0, {num_layers})")
    for name, a in (("k", k), ("v", v)):
        if a is not None and not jnp.issubdtype(a.dtype, jnp.floating):
            raise ValueError(f"write_rows: {name} must be a float array, got {a.dtype}")
    if kv == 1 and v is not None:
        raise ValueError("write_rows: the pools hold an MLA latent (kv_factor=1): pass v=None")
    if kv == 2 and (v is None or v.shape != k.shape):
        raise ValueError(f"write_rows: v must have k's shape {k.shape}, got {None if v is None else v.shape}")
    num_tokens = k.shape[-3]
    for name, s in (("low_slot", low_slot), ("high_slot", high_slot), ("positions", positions)):
        if s is None:
            continue
        if s.shape != (num_tokens,) or not jnp.issubdtype(s.dtype, jnp.integer):
            raise ValueError(f"write_rows: {name} must be int[{num_tokens}], got {s.dtype}{list(s.shape)}")
    if mixed and high_slot is None:
        raise ValueError("write_rows: a mixed group needs high_slot")
    if rope_style is not None:
        if rope_style not in ("neox", "interleaved"):
            raise ValueError(f"write_rows: rope_style must be 'neox', 'interleaved' or None, got {rope_style!r}")
        if positions is None:
            raise ValueError("write_rows: rope needs positions")
        if (rotary_dim or d) > d or (rotary_dim or d) % 2:
            raise ValueError(f"write_rows: rotary_dim={rotary_dim} must be even and at most head_dim={d}")


def plan_for(k, v, layer, *, low=None, high=None, plain=None, rope_style: Optional[str] = None,
             rotary_dim: Optional[int] = None, block_t: Optional[int] = None, heads_per_program: Optional[int] = None,
             interpret: Optional[bool] = None, num_warps: int = 4, block_scale: str = "max6") -> _Plan:
    """The static plan `write_rows` would use (shapes only; for benches and tests)."""
    num_layers, kv, heads, page, d = _geometry(low, high, plain)
    num_tokens = k.shape[-3]
    dp = next_pow2(d)
    bt0, hb0 = _default_blocks(num_tokens, dp)
    block_t = bt0 if block_t is None else block_t
    hb = hb0 if heads_per_program is None else heads_per_program
    if block_t < 1 or block_t & (block_t - 1):
        raise ValueError(f"write_rows: block_t must be a power of two, got {block_t}")
    if hb < 1 or heads % hb:
        raise ValueError(f"write_rows: heads_per_program={hb} must divide num_kv_heads={heads}")
    if num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"write_rows: num_warps must be 1, 2, 4, 8 or 16, got {num_warps}")
    row = high if high is not None else plain
    if interpret is None:
        interpret = (not on_gpu()) and not _FORCE_COMPILED[0]
    return _Plan(
        num_tokens=num_tokens, num_layers=num_layers, all_layers=layer is None, kv=kv, heads=heads, head_dim=d,
        dp=dp, page=page, low_pages=min(low[0].shape[1], low[1].shape[1]) if low is not None else plain[0].shape[1],
        high_pages=high[0].shape[1] if high is not None else 0, has_low=low is not None,
        row_pool=None if row is None else ("high" if high is not None else "plain"),
        row_dtype=jnp.dtype(row[0].dtype).name if row is not None else None,
        k_dtype=jnp.dtype(k.dtype).name, v_dtype=jnp.dtype(v.dtype).name if v is not None else None,
        rope_style=rope_style, rotary_dim=(rotary_dim or d) if rope_style is not None else 0,
        block_t=block_t, heads_per_program=hb, interpret=bool(interpret), num_warps=num_warps,
        block_scale=block_scale)


def _call(plan: _Plan, inputs, pools_flat, debug: bool = False):
    n_in = len(inputs)
    check_offsets("append (write kernel)", **{f"pool operand {i}": p for i, p in enumerate(pools_flat)})
    spec = pl.BlockSpec(memory_space=_ANY)
    return pl.pallas_call(
        functools.partial(_write_kernel, plan),
        grid=plan.grid,
        in_specs=[spec] * (n_in + len(pools_flat)),
        out_specs=[spec] * len(pools_flat),
        out_shape=[jax.ShapeDtypeStruct(p.shape, p.dtype) for p in pools_flat],
        input_output_aliases={n_in + i: i for i in range(len(pools_flat))},
        interpret=plan.interpret,
        compiler_params=triton_params(num_warps=plan.num_warps, num_stages=1),
        name=KERNEL_NAME,
        debug=debug,
    )(*inputs, *pools_flat)


def write_rows(k, v, layer, low_slot, high_slot, page_size: int, positions=None, *, low=None, high=None, plain=None,
               rope_style: Optional[str] = None, rope_theta: float = 10000.0, rotary_dim: Optional[int] = None,
               block_t: Optional[int] = None, heads_per_program: Optional[int] = None, interpret: Optional[bool] = None,
               num_warps: int = 4, debug: bool = False, block_scale: str = "max6"):
    """Store new rows of one layer or all layers into a group's pool arrays, in place (one fused kernel).

    Args:
      k: ``[T, H, D]`` (``layer`` given: int or traced int32 scalar) or ``[L, T, H, D]`` (``layer=None``).
        Any float dtype; RoPE'd here when ``rope_style`` is given, then rounded to ``k.dtype``.
      v: same shape as ``k`` (any float dtype), or None for an MLA latent group (kv_factor 1).
      low_slot: i32[T] slots ``page * page_size + row`` into the low pool (mixed / low) or the plain pool; -1 skip.
      high_slot: i32[T] slots into the high twin (needed with ``high``); -1 skip.
      page_size: rows per page (must match the pools).
      positions: i32[T] token positions (needed with ``rope_style``).
      low: ``(data u8[L,P,kv,H,page,D/2], scales float8_e4m3fn[L,P,kv,H,page,D/16], gs f32[L,kv])``: NVFP4 pages.
      high: ``(rows dtype[L,Ph,kv,H,page,D], scale f32[L,kv])``: the retained twin (with ``low`` only).
      plain: ``(rows dtype[L,P,kv,H,page,D], scale f32[L,kv])``: row pages (exclusive with ``low``). Row pools of
        bf16 / fp16 store a cast, float8_e4m3fn ``e4m3(clip(x / scale, ±448))``.
      rope_style: ``"neox"`` | ``"interleaved"`` | None (no RoPE); applied to K only, ``rope_theta`` its base,
        ``rotary_dim`` the rotated leading dims (even; None = D).
      block_t / heads_per_program: tokens and heads per program (powers of two / divisor of H; default heuristic).
      num_warps: Triton warps per program (GPU only).
      interpret: force interpret mode (default: interpret when no GPU, unless inside `lowering_for_cuda`).
      debug: print the kernel jaxpr and Triton IR while lowering (pallas ``debug=True``).
      block_scale: NVFP4 block scaling of the low rows, ``"max6"`` or ``"4over6"``.

    Returns:
      ``(low_data, low_scales, high_rows, plain_rows)``: the updated arrays, None for an absent pool (the same
      buffers when the caller donates them; the inputs themselves when ``T == 0``).
    """
    k = jnp.asarray(k)
    v = None if v is None else jnp.asarray(v)
    low_slot = jnp.asarray(low_slot)
    high_slot = jnp.asarray(high_slot) if high_slot is not None else None
    positions = None if positions is None else jnp.asarray(positions)
    geo = _geometry(low, high, plain)
    _check_inputs(geo, k, v, layer, low_slot, high_slot, page_size, positions, rope_style, rotary_dim,
                  mixed=high is not None)
    plan = plan_for(k, v, layer, low=low, high=high, plain=plain, rope_style=rope_style, rotary_dim=rotary_dim,
                    block_t=block_t, heads_per_program=heads_per_program, interpret=interpret, num_warps=num_warps,
                    block_scale=block_scale)
    row = high if high is not None else plain
    pools_flat = ([low[0], low[1]] if low is not None else []) + ([row[0]] if row is not None else [])
    layer_arr = jnp.zeros((1,), jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32).reshape(1)
    lslot = low_slot.astype(jnp.int32)
    hslot = high_slot.astype(jnp.int32) if high_slot is not None else lslot
    inputs = [layer_arr, lslot, hslot, k] + ([v] if geo[1] == 2 else [])
    if rope_style is not None:
        inputs += rope_cos_sin(positions.astype(jnp.int32), plan.rotary_dim, rope_theta)
    inputs += [pool[i].astype(jnp.float32) for pool, i in ((low, 2), (row, 1)) if pool is not None]  # gs, scale
    out = iter(_call(plan, inputs, pools_flat, debug=debug) if plan.num_tokens else pools_flat)
    data, scales = (next(out), next(out)) if low is not None else (None, None)
    rows = next(out, None)
    return data, scales, rows if high is not None else None, rows if plain is not None else None


def dump_kernel_ir(k, v, layer, low_slot, high_slot, page_size: int, positions=None, *, low=None, high=None,
                   plain=None, **kw) -> str:
    """Lower the compiled (GPU) kernel for CUDA and return the Pallas debug print (jaxpr + Triton IR) as text.

    Works on a CPU machine; grep the result for ``elementwise_inline_asm`` / ``mul.rn.f32`` (the PTX itself is
    produced by XLA on the GPU)."""
    import io
    import contextlib as _cl
    buf = io.StringIO()
    with lowering_for_cuda(), _cl.redirect_stdout(buf):
        fn = lambda lo, hi, pn, *a: write_rows(*a, page_size, positions, low=lo, high=hi, plain=pn, debug=True,  # noqa
                                               **kw)
        jax.jit(fn).trace(low, high, plain, k, v, layer, low_slot, high_slot).lower(lowering_platforms=("cuda",))
    return buf.getvalue()


def rope_rows_f32(x, positions, rope_style: str, rope_theta: float = 10000.0, rotary_dim: Optional[int] = None, *,
                  interpret: Optional[bool] = None):
    """The kernel's in-kernel RoPE alone: rotate ``x f32[T, D]`` (T, D powers of two) and return float32,
    without any rounding to a storage dtype. Test hook for the no-FMA guarantee (compare with numpy)."""
    x = jnp.asarray(x, jnp.float32)
    t, d = x.shape
    rd = rotary_dim or d
    interp = ((not on_gpu()) and not _FORCE_COMPILED[0]) if interpret is None else interpret
    plan = _Plan(num_tokens=t, num_layers=1, all_layers=False, kv=1, heads=1, head_dim=d, dp=d, page=1,
                 low_pages=0, high_pages=0, has_low=False, row_pool=None, row_dtype=None, k_dtype="float32",
                 v_dtype=None, rope_style=rope_style, rotary_dim=rd, block_t=t, heads_per_program=1,
                 interpret=bool(interp))
    cos, sin = rope_cos_sin(jnp.asarray(positions, jnp.int32), rd, rope_theta)

    def kernel(x_ref, cos_ref, sin_ref, o_ref):
        ops = _JnpOps if plan.interpret else _PtxOps
        t_in = jax.lax.broadcasted_iota(jnp.int32, (t,), 0)
        col = jax.lax.broadcasted_iota(jnp.int32, (1, d), 1)
        c, s, partner = _rope_tables(plan, cos_ref, sin_ref, t_in, col)
        xf = x_ref[t_in[:, None], col]
        pf = x_ref[t_in[:, None], partner]
        o_ref[...] = jnp.where(col < rd, ops.rotate(xf, pf, c, s), xf)

    spec = pl.BlockSpec(memory_space=_ANY)
    return pl.pallas_call(kernel, grid=(1,), in_specs=[spec] * 3,
                          out_specs=pl.BlockSpec((t, d), lambda i: (0, 0)),
                          out_shape=jax.ShapeDtypeStruct((t, d), jnp.float32), interpret=plan.interpret,
                          compiler_params=triton_params(num_warps=plan.num_warps, num_stages=1),
                          name="jmixedkv_rope_rows")(x, cos, sin)
