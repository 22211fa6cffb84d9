"""Tuning of the two decode backends: one frozen config per backend, its fields validated when it is built, and the
default heuristics that fill the fields left as None (figures behind each choice: bench/RESULTS.md).

* `TritonConfig`: the Pallas Triton kernel (`pallas_kernels.decode.triton`); defaults `triton_tuning`,
  `triton_num_splits`.
* `MosaicConfig`: the Pallas Mosaic GPU kernel for Hopper (`pallas_kernels.decode.mosaic_sm90`), with the
  `TritonConfig` of the Triton kernel that attends its edge blocks; defaults `mosaic_num_splits`,
  `mosaic_edge_splits`, `mosaic_qk_in_turn`.

A config is hashable (a static argument of the jitted kernel calls); a bench passes one per variant.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Optional

from pallas_kernels.decode import common
from pallas_kernels.decode.common import next_pow2

__all__ = ["TritonConfig", "MosaicConfig", "TRITON_BLOCK_K", "TRITON_NUM_WARPS", "WIDE_GRID_TUNING",
           "VERIFY_GRID_TUNING", "SMALL_HEAD_TUNING", "SMALL_HEAD_DIM", "SMALL_HEAD_MAX_PAGE", "LARGE_HEAD_TUNING",
           "LARGE_HEAD_DIM", "LARGE_HEAD_MAX_PAGE", "triton_tuning",
           "triton_num_splits", "tuning_heads", "KEYS_ON_M_ROWS", "MIN_KM_ROWS",
           "MAX_SPLIT_BLOCKS", "EDGE_BLOCK_K", "EDGE_WARPS", "IN_TURN_ROWS", "IN_TURN_MAX_PAGE", "mosaic_num_splits",
           "mosaic_edge_splits", "mosaic_qk_in_turn"]


def _check(cls: str, ok: bool, field: str, value, want: str):
    if not ok:
        raise ValueError(f"{cls}: {field}={value!r} must be {want}")


def _positive(cls: str, optional: bool, **fields):
    for name, v in fields.items():
        ok = (v is None and optional) or (isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 1)
        _check(cls, ok, name, v, "an int >= 1" + (" or None" if optional else ""))


# --------------------------------------------------------------------------------------------------- Triton
#: tokens per inner step and warps per program when the config leaves them out: the fastest in the H200 sweeps
#: (NVFP4 pages 64 tokens / 2 warps / 3 stages; plain bf16 pages 128 / 4 / 3)
TRITON_BLOCK_K = {"nvfp4": 64, "plain": 128}
TRITON_NUM_WARPS = {"nvfp4": 2, "plain": 4}
#: NVFP4 pages with many (row, head) programs (batch x kv heads >= SMs / 2), pages <= 32 and at most 8 real query
#: rows in the MMA's 16 (Tq * G <= 8, so column groups put the padding rows to work): 32-token steps, one warp per
#: program, V read late, ~4 programs per SM rounded up to a power of two of splits (about one resident wave), so
#: splits are long and column groups apply from 1024 tokens per split. Faster than 16 programs per SM at 16 x 4k,
#: 16 x 32k (GQA 4 and 8), 64 x 4k and 64 x 8k, level at 64 x 32k; with 16 real rows (Tq 4 x GQA 4) slower than
#: 64 / 2 at 16 x 32k.
WIDE_GRID_TUNING = dict(block_k=32, num_warps=1, per_sm=4)
#: the same grid with 32 query rows per program (Tq * G in 17..32, e.g. Tq 4 x GQA 8 verify steps): 32-token
#: steps, two warps (faster than 64 / 2 at 16 x 32k)
VERIFY_GRID_TUNING = dict(block_k=32, num_warps=2, per_sm=4)
#: NVFP4 pages at head_dim <= `SMALL_HEAD_DIM` on the wide grid (batch x kv heads >= SMs / 2) with at most 8 real
#: query rows of the 16 and pages of at most `SMALL_HEAD_MAX_PAGE` tokens: 64-token steps, one warp. On the H200 at
#: 16 x 32k, 8 KV heads, Tq 1 (per call in a jitted loop of ten): 0.262 ms against 0.273-0.280 for
#: `WIDE_GRID_TUNING` (GQA 1 / 3 / 8, page 16) and 0.229 against 0.289 for the format's default (GQA 4, page 64); 2 or
#: 4 warps, 128-token steps and twice the splits measured slower (bench/data/decode_geometry-hd64-*.json).
SMALL_HEAD_TUNING = dict(block_k=64, num_warps=1, per_sm=4)
SMALL_HEAD_DIM, SMALL_HEAD_MAX_PAGE = 64, 64
#: NVFP4 pages at head_dim >= `LARGE_HEAD_DIM` on the wide grid with at most 8 real query rows of 16 and pages of at
#: most `LARGE_HEAD_MAX_PAGE` tokens: 64-token steps, four warps (`WIDE_GRID_TUNING`'s one warp holds a 256-wide
#: accumulator). On the H100 at 16 x 32k, 8 KV heads, page 16, Tq 1 (per call in a jitted loop of ten): 1.050-1.052 ms
#: against 1.279-1.399 for `WIDE_GRID_TUNING` (GQA 1 / 4 / 8); 32 / 2 1.114, 32 / 4 1.286, 64 / 2 1.335-1.339,
#: 128 / 4 1.398-1.401, 64 / 8 1.557, 16 / 4 2.260, 32 / 8 2.593 (bench/RESULTS.md, "head_dim 256 decode tuning").
#: Larger pages were not measured and keep the older rules.
LARGE_HEAD_TUNING = dict(block_k=64, num_warps=4, per_sm=4)
LARGE_HEAD_DIM, LARGE_HEAD_MAX_PAGE = 256, 16


def triton_tuning(fmt_key: str, batch: int, num_kv_heads: int, page: int, m_rows: int, rows: Optional[int] = None,
                  head_dim: int = 128):
    """``(block_k, num_warps, programs per SM)`` the Triton kernel uses when the config leaves them out: `fmt_key`
    ``"nvfp4"`` | ``"plain"``, ``m_rows`` = query rows per program (``Tq * G`` padded to a power of two >= 16),
    ``rows`` = the real ones, ``Tq * G`` (default ``m_rows``), ``head_dim`` the K / V rows' (`SMALL_HEAD_TUNING`
    at <= 64, `LARGE_HEAD_TUNING` at >= 256)."""
    rows = m_rows if rows is None else rows
    many = fmt_key == "nvfp4" and batch * num_kv_heads >= common.num_sms() // 2
    wide = many and page <= 32
    few_rows = m_rows == 16 and rows <= 8
    small = many and head_dim <= SMALL_HEAD_DIM and page <= SMALL_HEAD_MAX_PAGE and few_rows
    large = many and head_dim >= LARGE_HEAD_DIM and page <= LARGE_HEAD_MAX_PAGE and few_rows
    t = (SMALL_HEAD_TUNING if small else
         LARGE_HEAD_TUNING if large else
         WIDE_GRID_TUNING if (wide and m_rows == 16 and rows <= 8) else
         VERIFY_GRID_TUNING if (wide and m_rows == 32) else None)
    if t is not None:
        return t["block_k"], t["num_warps"], t["per_sm"]
    return TRITON_BLOCK_K[fmt_key], TRITON_NUM_WARPS[fmt_key], 4


def tuning_heads(config, num_kv_heads: int) -> int:
    """The KV head count ``config``'s default tuning and splits are chosen for: its ``split_heads`` (a shard of
    the heads passes the whole count), else the call's ``num_kv_heads``."""
    return num_kv_heads if config.split_heads is None else config.split_heads


def triton_num_splits(batch: int, num_kv_heads: int, max_blocks: int, per_sm: int = 4) -> int:
    """Splits so that the Triton kernel's grid has ~``per_sm`` programs per SM, never more than the page blocks of
    the longest sequence (and at most 64)."""
    programs = max(1, batch * num_kv_heads)
    want = max(1, -(-per_sm * common.num_sms() // programs))
    return int(max(1, min(next_pow2(want), max_blocks, 64)))


@dataclasses.dataclass(frozen=True)
class TritonConfig:
    """Tuning of the Pallas Triton decode kernel; None fields take the defaults named.

    Attributes:
      block_k: tokens per inner step (whole pages, at least 16 tokens: `common.pages_per_block`); None =
        `triton_tuning` (64 for NVFP4 pages, 128 for plain row pages, 32 on the wide grids, 64 with one warp on the
        wide grid at head_dim <= 64, 64 with four warps there at head_dim >= 256 and pages of 16).
      num_warps: Triton warps per program; None = `triton_tuning`.
      num_stages: software-pipelining depth of the interior loop.
      num_splits: split-K programs per (row, KV head); None = `triton_num_splits` (~4 programs per SM).
      precise: P @ V with P split into two halves of the MMA dtype (float32-accumulation error); None = True for a
        float32 output or bf16 plain pages (f16 P leaves ~1e-4 relative error, below a 16-bit output's rounding).
      dequant: NVFP4 dequantization form, ``"asm"`` (packed inline PTX) or ``"jnp"`` (the same arithmetic in plain
        ops); None = ``"asm"`` compiled, ``"jnp"`` in interpret mode (its only form).
      keys_major: scores transposed, ``[keys, M] = K q^T`` and ``o^T = V^T P^T`` (the key tiles the MMA's A operand).
      v_late: read and dequantize V after the softmax of each step (fewer live registers); None = True for NVFP4
        pages, False for plain pages.
      col_groups: the MMA's padding query rows hold replicas of the real rows, replica ``j`` accumulating V's column
        group ``j`` (a power of two; the kernel checks that the shape fits it); None = the largest that fits with
        32-token steps, one warp and >= 1024 tokens per split, else 1.
      split_heads: the KV head count the defaults above (tuning, splits) are chosen for; None = the call's. A
        caller holding a shard of the heads passes the whole count, so every shard splits and tiles each
        (row, KV head) as one device would and its outputs are bitwise the one-device ones
        (`jmixedkv.sharding.sharded_decode_attention`).
    """
    block_k: Optional[int] = None
    num_warps: Optional[int] = None
    num_stages: int = 3
    num_splits: Optional[int] = None
    precise: Optional[bool] = None
    dequant: Optional[str] = None
    keys_major: bool = False
    v_late: Optional[bool] = None
    col_groups: Optional[int] = None
    split_heads: Optional[int] = None

    def __post_init__(self):
        name = "TritonConfig"
        _positive(name, True, block_k=self.block_k, num_warps=self.num_warps, num_splits=self.num_splits,
                  split_heads=self.split_heads)
        _positive(name, False, num_stages=self.num_stages)
        _check(name, self.dequant in (None, "asm", "jnp"), "dequant", self.dequant, "'asm', 'jnp' or None")
        cg = self.col_groups
        _check(name, cg is None or (isinstance(cg, int) and cg >= 1 and not cg & (cg - 1)), "col_groups", cg,
               "a power of two >= 1 or None")
        for f in ("precise", "v_late"):
            _check(name, getattr(self, f) in (None, True, False), f, getattr(self, f), "a bool or None")
        _check(name, self.keys_major in (True, False), "keys_major", self.keys_major, "a bool")


# ------------------------------------------------------------------------------------------------ Mosaic GPU
#: the keys-on-M form (``S^T = K Q^T``, the query rows on wgmma's N side) for ``Tq * G <=`` this many query rows,
#: queries on M (rows padded to 64) above: the faster form on each side of the line on the H200
KEYS_ON_M_ROWS = 32
#: fewest query rows on wgmma's N side in the keys-on-M form: 8 (P stored as ``[N, keys]``, read through a
#: transposed view) measured faster than 16 at 4-8 rows, outputs bitwise equal
MIN_KM_ROWS = 8
#: most 64-token blocks one CTA attends: ~256 blocks per CTA measured slower than ~100-137 at long contexts
MAX_SPLIT_BLOCKS = 128
#: tokens per step and warps of the Triton kernel that attends the Mosaic kernel's edge blocks (32 x 4 beat 64 x 2,
#: L1-bound at 64-token steps; with the twin's split loads 32-token steps beat 16 at every shape measured)
EDGE_BLOCK_K = 32
EDGE_WARPS = 4
#: K's two column halves dequantized in turn (fewer registers live) at this many query rows or more and pages of at
#: most `IN_TURN_MAX_PAGE` tokens: a fourth CTA per SM at N = 32 and pages 16 / 32; slower elsewhere
IN_TURN_ROWS = 32
IN_TURN_MAX_PAGE = 32


def mosaic_num_splits(batch: int, num_kv_heads: int, max_blocks: int) -> int:
    """Split-K count of the Mosaic GPU kernel: ~4 CTAs per SM (3-5 are resident at a time), and no split runs more
    than `MAX_SPLIT_BLOCKS` 64-token blocks (finer CTAs leave a shorter tail at long contexts). 0.5x and 2x these
    splits, split counts off a power of two, and one full wave of 5 CTAs per SM at N = 8 measured slower or level."""
    programs = max(1, batch * num_kv_heads)
    want = max(1, -(-4 * common.num_sms() // programs))
    splits = max(next_pow2(want), -(-max_blocks // MAX_SPLIT_BLOCKS))
    return int(max(1, min(splits, max_blocks, 64)))


def mosaic_qk_in_turn(n_rows: int, page: int) -> bool:
    """Whether the keys-on-M form with ``n_rows`` query rows on wgmma's N side dequantizes K's column halves in turn
    at pages of ``page`` tokens (`IN_TURN_ROWS`, `IN_TURN_MAX_PAGE`)."""
    return n_rows >= IN_TURN_ROWS and page <= IN_TURN_MAX_PAGE


def mosaic_edge_splits(batch: int, num_kv_heads: int) -> int:
    """Split-K programs of the Triton kernel that attends the edge blocks: its splits cut a sequence's blocks in
    equal ranges and skip the interior in each, so with 2 the leading edge (first_n) and the trailing one (last_n,
    the new tokens) run in different programs. 2 while one program per (row, KV head) leaves SMs idle, else 1."""
    return 2 if batch * num_kv_heads <= common.num_sms() else 1


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """Tuning of the Pallas Mosaic GPU decode kernel (Hopper); None fields take the defaults named.

    Attributes:
      num_splits: split-K CTAs per (row, KV head); None = `mosaic_num_splits`.
      stages: TMA ring depth (64-token blocks in flight; 3 measured slower than 2 with keys on M).
      keys_on_m: the keys-on-M form; None = for ``Tq * G <=`` `KEYS_ON_M_ROWS` query rows.
      min_km_rows: fewest query rows on wgmma's N side there, 8 or 16.
      qk_in_turn: there, K's column halves dequantized in turn (the same products in the same order either way);
        None = `mosaic_qk_in_turn`.
      v_in_turn: at head_dim 256, the two column blocks' V through one pair of f16 V tiles, block 1's stored once
        block 0's ``P V`` products have read theirs (16 KB less shared memory per CTA: ~65 against 81 KB, a third
        CTA per SM where shared memory allowed two; the same products in the same order). On by default: ~10%
        less time per call at 16 x 32k on the H100 (bench/RESULTS.md).
      edge: the `TritonConfig` of the edge blocks' kernel (its ``num_splits`` None = `mosaic_edge_splits`; its
        ``block_k`` a whole number of pages, the interior counted in a common multiple of both kernels' blocks).
      split_heads: the KV head count both kernels' default splits are chosen for (None = the call's; as
        `TritonConfig.split_heads`).
    """
    num_splits: Optional[int] = None
    stages: int = 2
    keys_on_m: Optional[bool] = None
    min_km_rows: int = MIN_KM_ROWS
    qk_in_turn: Optional[bool] = None
    v_in_turn: bool = True
    edge: TritonConfig = TritonConfig(block_k=EDGE_BLOCK_K, num_warps=EDGE_WARPS)
    split_heads: Optional[int] = None

    def __post_init__(self):
        name = "MosaicConfig"
        _positive(name, True, num_splits=self.num_splits, split_heads=self.split_heads)
        _positive(name, False, stages=self.stages)
        _check(name, self.min_km_rows in (8, 16), "min_km_rows", self.min_km_rows, "8 or 16")
        _check(name, isinstance(self.v_in_turn, bool), "v_in_turn", self.v_in_turn, "a bool")
        for f in ("keys_on_m", "qk_in_turn"):
            _check(name, getattr(self, f) in (None, True, False), f, getattr(self, f), "a bool or None")
        _check(name, isinstance(self.edge, TritonConfig), "edge", self.edge, "a TritonConfig")
        _check(name, self.edge.block_k is not None, "edge.block_k", self.edge.block_k,
               "set (both kernels count the interior in a common multiple of their blocks)")
