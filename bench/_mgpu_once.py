"""Run the Mosaic GPU decode kernel once at one shape, for a profiler (a tool, not a bench: it times nothing).

    ncu --kernel-name regex:mosaic --launch-count 1 --section SourceCounters --section WarpStateStats \\
        -o $OUT/k -f python3 bench/_mgpu_once.py --batch 16 --context 32768
    ncu -i $OUT/k.ncu-rep --page source --print-source sass --csv > $OUT/k_sass.csv
    python bench/sass_mix.py $OUT/k_sass.csv --units $((1024 * 4 * 64))    # CTAs x warps x blocks per CTA

The cache is `decode_sweep.random_state` (random NVFP4 pages with valid scales, bf16 twin first_n = last_n = 64,
permuted page ids: the state of the bench/RESULTS.md decode tables); ``--partials`` (default) runs the kernel alone
(`paged_decode_attention_mgpu(..., partials_only=True)`), ``--full`` the whole call (edge kernel and merge too).
The first call compiles, so a profiler should skip nothing but filter on the kernel name. ``--interpret``: the
Mosaic GPU interpreter on the CPU (tiny shapes only; a check of this script).
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

import jax  # noqa: E402

import decode_sweep as ds  # noqa: E402
from pallas_kernels import decode_mgpu as dm  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--q-heads", type=int, default=32, help="query heads (8 KV heads: GQA = q_heads / 8)")
    ap.add_argument("--tq", type=int, default=1, help="query tokens per sequence")
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--full", action="store_true", help="the whole call, not the kernel's partials alone")
    ap.add_argument("--interpret", action="store_true", help="Mosaic GPU interpreter (CPU; tiny shapes)")
    a = ap.parse_args(argv)
    try:
        args, nf, nr = ds.mgpu_case(a.page, a.batch, a.context, a.q_heads, a.tq)
    except ValueError as e:
        ap.error(str(e))
    out = dm.paged_decode_attention_mgpu(*args, partials_only=not a.full, interpret=a.interpret,
                                         **ds.geom_kw(dm.paged_decode_attention_mgpu, a.page, nf, nr))
    jax.block_until_ready(out)
    shapes = [tuple(x.shape) for x in jax.tree_util.tree_leaves(out)]
    print(f"mgpu kernel ran: batch {a.batch} x context {a.context}, {a.q_heads} q heads, Tq {a.tq}, page "
          f"{a.page}, {'whole call' if a.full else 'partials'} {shapes}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
