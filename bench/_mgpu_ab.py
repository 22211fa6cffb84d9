"""Same-run A/B of the Mosaic GPU decode kernel under module-flag variants (a tool, not a bench).

Each ``--variant NAME:FLAG=VALUE[,FLAG=VALUE...]`` loads its own copy of ``pallas_kernels/decode_mgpu.py`` with those
module attributes set (e.g. ``EDGE_WARPS=2``), so the variants compile separately and run side by side in one
process. Per shape: the outputs of every variant against the first one (max abs. difference of output and LSE, and
whether they are bitwise equal), then ``--rounds`` alternating rounds of kernel time (``partials_only``, profiler GPU
time, `decode_bench.gpu_busy_ms`) and end-to-end time (`decode_bench.time_jax`). Prints one line per shape and writes
``OUT/mgpu_ab.json`` after each shape (a time limit keeps the shapes done). Cache states: `decode_sweep.random_state`
(8 KV heads, D 128, bf16 twin first_n = last_n = 64, random NVFP4 bytes, permuted page ids).

    PYTHONPATH=. python3 bench/_mgpu_ab.py --variant w4:EDGE_WARPS=4 --variant w8:EDGE_WARPS=8 --out DIR

``--shapes page/batch/context/q_heads/tq,...`` (default: seven shapes of the issue-18 work at pages 16-128);
``--interpret``: the Mosaic GPU interpreter on the CPU at one tiny shape, outputs compared, nothing timed (a check of
this script; the interpreter runs the interpret form of the kernel, whatever the flags).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
_BENCH = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_BENCH)
sys.path[:0] = [_BENCH, _ROOT]

import jax  # noqa: E402
import numpy as np  # noqa: E402

import decode_sweep as ds  # noqa: E402

KERNEL = os.path.join(_ROOT, "pallas_kernels", "decode_mgpu.py")
DEFAULT_SHAPES = "16/16/32768/32/1,16/64/8192/32/1,16/64/4096/64/1,16/16/32768/64/4,64/16/32768/32/1," \
                 "32/64/8192/32/1,128/16/32768/32/1"


def parse_variant(text: str) -> tuple[str, dict]:
    """``"name:FLAG=1,OTHER=x"`` -> ``("name", {"FLAG": 1, "OTHER": "x"})`` (integers parsed as int)."""
    name, _, flags = text.partition(":")
    if not name or not flags:
        raise ValueError(f"--variant wants NAME:FLAG=VALUE[,FLAG=VALUE], got {text!r}")
    out = {}
    for item in flags.split(","):
        key, eq, val = item.partition("=")
        if not eq or not key:
            raise ValueError(f"--variant {text!r}: {item!r} is not FLAG=VALUE")
        out[key] = int(val) if val.lstrip("-").isdigit() else val
    return name, out


def parse_shapes(text: str) -> list[tuple[int, int, int, int, int]]:
    """``"page/batch/context/q_heads/tq,..."`` -> tuples, each field >= 1 and q_heads a multiple of the KV heads."""
    shapes = []
    for item in text.split(","):
        parts = item.split("/")
        if len(parts) != 5 or not all(p.isdigit() and int(p) >= 1 for p in parts):
            raise ValueError(f"--shapes wants page/batch/context/q_heads/tq (each >= 1), got {item!r}")
        page, b, ctx, hq, tq = map(int, parts)
        if hq % ds.H:
            raise ValueError(f"--shapes {item!r}: q_heads {hq} is not a multiple of the {ds.H} KV heads")
        shapes.append((page, b, ctx, hq, tq))
    return shapes


def load_variant(name: str, flags: dict):
    """A fresh copy of the kernel module with ``flags`` set; refuses a flag the module does not have."""
    spec = importlib.util.spec_from_file_location(f"_mgpu_ab_{name}", KERNEL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for key, val in flags.items():
        if not hasattr(mod, key):
            raise ValueError(f"variant {name!r}: decode_mgpu has no module attribute {key!r}")
        kind = type(getattr(mod, key))
        if kind is bool and val not in (0, 1) or kind in (bool, int) and not isinstance(val, int):
            raise ValueError(f"variant {name!r}: {key} is {kind.__name__}, got {val!r} (booleans are 0 / 1)")
        setattr(mod, key, kind(val))
    return mod


def max_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32)))) for x, y in zip(a, b))


def bitwise_equal(a, b) -> bool:
    return all(np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8)) for x, y in zip(a, b))


def run_shape(mods, shape, rounds, interpret):
    page, b, ctx, hq, tq = shape
    args, nf, nr = ds.mgpu_case(page, b, ctx, hq, tq)
    fns, outs = {}, {}
    for name, m in mods.items():
        kw = dict(ds.geom_kw(m.paged_decode_attention_mgpu, page, nf, nr), interpret=interpret)
        part = jax.jit(lambda *a, m=m, kw=kw: m.paged_decode_attention_mgpu(*a, partials_only=True, **kw))
        full = jax.jit(lambda *a, m=m, kw=kw: m.paged_decode_attention_mgpu(*a, **kw))
        fns[name] = (part, full)
        outs[name] = jax.block_until_ready(full(*args))
    first = next(iter(mods))
    row = {"page": page, "batch": b, "context": ctx, "q_heads": hq, "tq": tq,
           "max_abs_diff": {n: max_diff(outs[first], o) for n, o in outs.items()},
           "bitwise_equal": {n: bitwise_equal(outs[first], o) for n, o in outs.items()}}
    if not interpret:
        from decode_bench import gpu_busy_ms, time_jax
        for _ in range(rounds):
            for name, (part, full) in fns.items():
                row.setdefault(f"{name}_kernel_ms", []).append(gpu_busy_ms(part, *args))
                row.setdefault(f"{name}_e2e_ms", []).append(time_jax(full, *args))
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", action="append", required=True, help="NAME:FLAG=VALUE[,FLAG=VALUE] (2 or more)")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="page/batch/context/q_heads/tq,...")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    ap.add_argument("--interpret", action="store_true", help="CPU check: interpreter, one tiny shape, no timing")
    a = ap.parse_args(argv)
    try:
        variants = [parse_variant(v) for v in a.variant]
        shapes = [(16, 2, 300, 16, 1)] if a.interpret else parse_shapes(a.shapes)
        if len(variants) < 2 or len({n for n, _ in variants}) != len(variants):
            raise ValueError(f"want two or more variants with distinct names, got {[n for n, _ in variants]}")
        if a.rounds < 1:
            raise ValueError(f"--rounds must be >= 1, got {a.rounds}")
        mods = {name: load_variant(name, flags) for name, flags in variants}
    except ValueError as e:
        ap.error(str(e))
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "mgpu_ab.json")
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "variants": dict(variants), "rows": []}
    t0 = time.time()
    for shape in shapes:
        row = run_shape(mods, shape, a.rounds, a.interpret)
        result["rows"].append(row)
        json.dump(result, open(path, "w"), indent=1)
        times = "  ".join(f"{n} k {min(row[n + '_kernel_ms']):.3f} e2e {min(row[n + '_e2e_ms']):.3f}"
                          for n in mods if f"{n}_kernel_ms" in row)
        print(f"p{shape[0]} {shape[1]}x{shape[2]} hq{shape[3]} tq{shape[4]}: {times}  diff {row['max_abs_diff']} "
              f"bitwise {row['bitwise_equal']} [{time.time() - t0:.0f}s]", flush=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
