"""Named benchmark shapes, as data: the decode grid and the cache geometry the decode benches use.

`DECODE_GEOMETRY`: KV heads, head_dim, retained first_n / last_n of the mixed cache every decode bench builds.
`DECODE_GRID`: the grid `decode_bench.py --grid` runs (batch x context x (GQA group, page, Tq)); its
``--batches`` / ``--contexts`` / ``--geos`` defaults are these, as strings (`grid_args`).
"""
from __future__ import annotations

__all__ = ["DECODE_GEOMETRY", "DECODE_GRID", "grid_args"]

DECODE_GEOMETRY = dict(kv_heads=8, head_dim=128, first_n=64, last_n=64)
DECODE_GRID = dict(batches=(1, 16, 64), contexts=(4096, 32768, 131072),
                   geos=((4, 16, 1), (4, 16, 4), (4, 64, 1), (4, 64, 4), (8, 16, 1), (8, 16, 4), (8, 64, 1),
                         (8, 64, 4)))


def grid_args(grid=DECODE_GRID):
    """``(batches, contexts, geos)`` of ``grid`` as the command-line strings ``"1,16,64"``, ``"4096,..."``,
    ``"4/16/1,..."`` (GQA/page/Tq)."""
    return (",".join(map(str, grid["batches"])), ",".join(map(str, grid["contexts"])),
            ",".join("/".join(map(str, g)) for g in grid["geos"]))
