"""Instruction mix of one kernel from an Nsight Compute source page (SASS), for the decode-kernel work.

On the GPU machine (ncu is in /usr/local/cuda/bin there)::

    ncu --kernel-name regex:mosaic --launch-count 1 --section SourceCounters --section WarpStateStats \\
        -o $OUT/k -f python3 bench/decode_bench.py --grid --batches 16 --contexts 32768 --geos 4/16/1 --out $OUT
    ncu -i $OUT/k.ncu-rep --page source --print-source sass --csv > $OUT/k_sass.csv

then anywhere (no GPU needed)::

    python bench/tools/sass_mix.py k_sass.csv --units 262144 --unit-name "warp x 64-token block"

prints the executed warp-level instructions by opcode (with modifiers when ``--modifiers``), per ``--units`` (e.g.
warps x blocks of the kernel's loop), the warp-stall reasons over all sampled instructions, and the most stalled
instructions. ``--json`` writes the same numbers. Instructions predicated off in every thread still count: they
take an issue slot (a finding recorded in bench/RESULTS.md).
"""
from __future__ import annotations

import argparse
import collections
import csv
import gzip
import json
import sys

__all__ = ["read_source_csv", "opcode", "mix", "stall_reasons", "main"]


def read_source_csv(path: str):
    """``(header, rows)`` of an ncu ``--page source --csv`` export (plain or .gz); the first line (kernel name) is
    skipped, rows shorter than the header are dropped."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        lines = list(csv.reader(f))
    start = next(i for i, r in enumerate(lines) if "Source" in r and "Instructions Executed" in r)
    header = lines[start]
    return header, [r for r in lines[start + 1:] if len(r) >= len(header)]


def opcode(source: str, modifiers: bool = False) -> str:
    """Opcode of one SASS line (``@P0 IMAD.SHL.U32 R1, ...`` -> ``IMAD`` or, with ``modifiers``, ``IMAD.SHL.U32``)."""
    parts = source.strip().split()
    if not parts:
        return ""
    op = parts[1] if parts[0].startswith("@") and len(parts) > 1 else parts[0]
    return op if modifiers else op.split(".")[0]


def _int(x) -> int:
    try:
        return int(str(x).replace(",", ""))
    except ValueError:
        return 0


def mix(header, rows, modifiers: bool = False):
    """``(total executed, Counter opcode -> executed, Counter opcode -> stall samples)``."""
    ix, isrc = header.index("Instructions Executed"), header.index("Source")
    iss = header.index("Warp Stall Sampling (All Samples)") if "Warp Stall Sampling (All Samples)" in header else None
    executed, stalls = collections.Counter(), collections.Counter()
    for r in rows:
        op = opcode(r[isrc], modifiers)
        if not op:
            continue
        executed[op] += _int(r[ix])
        if iss is not None:
            stalls[op] += _int(r[iss])
    return sum(executed.values()), executed, stalls


def stall_reasons(header, rows):
    """Counter ``stall_* -> samples`` summed over all instructions (issued and not issued)."""
    cols = [i for i, h in enumerate(header) if h.startswith("stall_") and "Not Issued" not in h]
    out = collections.Counter()
    for r in rows:
        for i in cols:
            out[header[i]] += _int(r[i])
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu --page source --print-source sass --csv export (.csv or .csv.gz)")
    ap.add_argument("--units", type=float, default=1.0, help="divide counts by this (e.g. warps x loop blocks)")
    ap.add_argument("--unit-name", default="kernel")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--modifiers", action="store_true", help="split opcodes by their modifiers")
    ap.add_argument("--json", help="write the numbers here")
    a = ap.parse_args(argv)
    if a.units <= 0:
        ap.error(f"--units must be > 0, got {a.units}")
    header, rows = read_source_csv(a.csv)
    total, executed, stalls = mix(header, rows, a.modifiers)
    samples = max(1, sum(stalls.values()))
    print(f"{len(rows)} SASS instructions, {total:,} executed (warp level); per {a.unit_name}: {total / a.units:.1f}")
    print(f"{'opcode':24s} {'executed':>14s} {'per unit':>9s} {'share':>6s} {'stall samples':>13s}")
    for op, e in executed.most_common(a.top):
        print(f"{op:24s} {e:14,d} {e / a.units:9.1f} {100 * e / max(total, 1):5.1f}% "
              f"{100 * stalls[op] / samples:12.1f}%")
    reasons = stall_reasons(header, rows)
    rs = max(1, sum(reasons.values()))
    print("stall reasons (share of samples): " + ", ".join(
        f"{k[6:]} {100 * v / rs:.1f}%" for k, v in reasons.most_common() if v))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(csv=a.csv, units=a.units, unit_name=a.unit_name, total=total, executed=dict(executed),
                           stall_samples=dict(stalls), stall_reasons=dict(reasons)), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
