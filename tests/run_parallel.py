"""Run the ``gpu``-marked tests in several pytest processes sharing one GPU (``make test-gpu-parallel``).

The GPU tests spend most of their time compiling on the host, so on the GPU machine (16 cores) four processes on
the one device finish the suite in about 7 minutes instead of about 12 serially (H200, bench/RESULTS.md 2026-12-03
nineteenth). Each process gets every N-th test id of the collected list (round robin, so one file's slow tests
spread), runs with ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (JAX takes device memory as it needs it instead of 75% per
process) and writes its log to ``--logs``; the exit status is 0 only if every process passed. (``make test``'s
``pytest -n`` comes from pytest-xdist, a test extra installed here; the GPU image, where nothing is installed, does
not list it, so this runner needs nothing beyond pytest.)

    PYTHONPATH=. python3 tests/run_parallel.py [--procs 4] [--marker gpu] [--timeout S] [--logs DIR] [PATH ...]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

IGNORE = ["--ignore=tests/test_gguf.py"]      # the GPU image has no gguf; that file has no GPU test


def collect(marker: str, paths: list[str]) -> list[str]:
    """The test ids pytest selects with ``-m marker`` under ``paths``, in collection order."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", marker,
           *IGNORE, *paths]
    res = subprocess.run(cmd, capture_output=True, text=True)
    ids = [line.strip() for line in res.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if res.returncode not in (0, 5):           # 5: nothing collected
        raise SystemExit(f"run_parallel: collection failed (pytest exit {res.returncode}):\n{res.stdout[-2000:]}"
                         f"{res.stderr[-2000:]}")
    return ids


def deal(ids: list[str], procs: int) -> list[list[str]]:
    """Round robin: process ``k`` gets ids ``k, k + procs, ...``; empty shares are dropped."""
    return [share for share in (ids[k::procs] for k in range(procs)) if share]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=4, help="pytest processes (default 4)")
    ap.add_argument("--marker", default="gpu", help="pytest -m expression (default gpu)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds after which unfinished processes are killed")
    ap.add_argument("--logs", default=os.environ.get("OUT", "."), help="folder for the logs (default $OUT or .)")
    ap.add_argument("paths", nargs="*", default=["tests"])
    args = ap.parse_args(argv)
    if args.procs < 1:
        ap.error(f"--procs must be >= 1, got {args.procs}")
    ids = collect(args.marker, args.paths)
    if not ids:
        print(f"run_parallel: no test selected by -m {args.marker!r} under {args.paths}")
        return 5
    os.makedirs(args.logs, exist_ok=True)
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    t0 = time.time()
    runs = []
    for k, share in enumerate(deal(ids, args.procs)):
        log = os.path.join(args.logs, f"tests-{k}.txt")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=5", *share]
        with open(log, "w") as f:              # the child keeps its own copy of the descriptor
            runs.append((k, len(share), log, subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)))
    print(f"run_parallel: {len(ids)} tests in {len(runs)} processes, logs in {args.logs}", flush=True)
    failed = 0
    for k, n, log, proc in runs:
        left = None if args.timeout is None else max(1.0, args.timeout - (time.time() - t0))
        try:
            rc = proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "killed (timeout)"
        summary = [line for line in open(log).read().splitlines() if line.strip()][-1:] or ["(no output)"]
        print(f"  process {k}: {n} tests, exit {rc}: {summary[0]}", flush=True)
        failed += rc != 0
    print(f"run_parallel: {time.time() - t0:.0f} s, {failed} of {len(runs)} processes failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
