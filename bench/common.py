"""What every benchmark shares: timers, the device copy bandwidth, a GPU kernel profile, versions, the results file.

* `time_jax` (median ms per call of batches of async calls), `time_each` (median ms of blocked calls),
  `time_torch` (CUDA events), `gpu_kernel_profile` / `gpu_busy_ms` (GPU kernel time from a jax profiler trace).
* `copy_bandwidth_tbs`: device-to-device copy bandwidth, the denominator of every bytes floor.
* `versions`: device and library versions for a result's header.
* `append_results`: append a section to a markdown results file (bench/RESULTS.md by default).
"""
from __future__ import annotations

import glob
import gzip
import json
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["RESULTS_MD", "time_jax", "time_each", "time_torch", "gpu_kernel_profile", "gpu_busy_ms",
           "copy_bandwidth_tbs", "versions", "append_results"]

#: the project's results file (sections titled by topic and date)
RESULTS_MD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")


def time_jax(fn, *args, reps=10, trials=15, warmup=2):
    """Median ms per call: ``trials`` batches of ``reps`` async calls, blocked at the end of each batch."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / reps * 1e3)
    return float(np.median(times))


def time_each(fn, *args, warmup=3, iters=20):
    """Median ms of ``iters`` calls, each blocked on (host dispatch and sync included)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def time_torch(torch, fn, reps=10, trials=15, warmup=2):
    """Median ms per call of ``fn()`` (torch CUDA work): ``trials`` batches of ``reps`` calls between CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return float(np.median(times))


def copy_bandwidth_tbs(torch=None):
    """Device-to-device copy bandwidth (bytes read + written), TB/s, and how it was measured: torch ``copy_`` of
    2 GiB if torch with CUDA is given, else a jitted jnp ``x + 1`` (which measured well below torch's on the H200)."""
    nbytes = 1 << 31
    if torch is not None:
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        ms = time_torch(torch, lambda: dst.copy_(src), reps=5, trials=10)
        del src, dst
        torch.cuda.empty_cache()
        return 2 * nbytes / (ms * 1e-3) / 1e12, "torch copy_"
    x = jnp.zeros((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda x: x + 1.0)
    ms = time_jax(f, x, reps=5, trials=10)
    return 2 * nbytes / (ms * 1e-3) / 1e12, "jnp x + 1"


def gpu_kernel_profile(run, n, log_dir, top=25, between_us=300.0):
    """Device-side breakdown of ``run(i)`` (one blocking step) for ``i < n``: a jax profiler trace, then GPU kernel
    time summed by kernel name from its Chrome-trace export. Returns ``{busy_us_per_step, idle_inside_us_per_step,
    idle_between_us_per_step, kernel_launches_per_step, kernels: [{name, us per step, calls per step}],
    gpu_processes}`` (empty kernels if the trace holds no GPU rows). Idle gaps between kernels of at least
    ``between_us`` count as between steps (host sync + the next dispatch), shorter ones as inside a step."""
    jax.profiler.start_trace(log_dir)
    for i in range(n):
        jax.block_until_ready(run(i))
    jax.profiler.stop_trace()
    path = max(glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "*.trace.json.gz")), key=os.path.getmtime)
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {pid for pid, nm in names.items() if "GPU" in nm or "gpu" in nm}
    per, calls, busy = {}, {}, 0.0
    spans = []
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu and "dur" in e:
            per[e["name"]] = per.get(e["name"], 0.0) + e["dur"]
            calls[e["name"]] = calls.get(e["name"], 0) + 1
            busy += e["dur"]
            spans.append((float(e["ts"]), float(e["ts"]) + e["dur"]))
    spans.sort()
    inside = between = 0.0
    end = spans[0][1] if spans else 0.0
    for t0, t1 in spans[1:]:
        gap = t0 - end
        if gap > 0:
            if gap >= between_us:
                between += gap
            else:
                inside += gap
        end = max(end, t1)
    kernels = sorted(per, key=per.get, reverse=True)[:top]
    return dict(busy_us_per_step=busy / n, idle_inside_us_per_step=inside / n,
                idle_between_us_per_step=between / max(n - 1, 1), kernel_launches_per_step=len(spans) / n,
                gpu_processes=sorted(names[p] for p in gpu) or sorted(names.values()),
                kernels=[dict(name=k[:160], us=per[k] / n, calls=calls[k] / n) for k in kernels])


def gpu_busy_ms(fn, *args, steps=5):
    """GPU time per call of ``fn(*args)``, ms: the kernels' busy time in a profiler trace (`gpu_kernel_profile`),
    without the host's dispatch; None off the GPU or when the profiler fails (a failure must not lose a row's other
    timings). End-to-end time of a small shape measures the host; this does not."""
    if jax.default_backend() != "gpu":
        return None
    try:
        prof = gpu_kernel_profile(lambda i: fn(*args), steps, tempfile.mkdtemp(prefix="trace_bench"))
    except Exception as e:
        print(f"    gpu_busy_ms: profiler failed ({type(e).__name__}: {str(e)[:100]})")
        return None
    return prof["busy_us_per_step"] / 1e3 if prof["kernels"] else None


def versions(torch=None):
    """``{jax, jaxlib, triton, torch, device}`` of this process (``"n/a"`` where absent)."""
    v = {"jax": jax.__version__, "device": str(jax.devices()[0].device_kind)}
    try:
        import jaxlib
        v["jaxlib"] = jaxlib.__version__
    except Exception:
        pass
    try:
        import triton
        v["triton"] = triton.__version__
    except Exception:
        v["triton"] = "n/a"
    v["torch"] = torch.__version__ if torch is not None else "n/a"
    return v


def append_results(text: str, path: str = RESULTS_MD):
    """Append ``text`` (a markdown section, its title naming topic and date) to the results file ``path``."""
    if not os.path.exists(path):
        with open(path, "w") as f:
            f.write("# jmixedkv benchmark results\n")
    with open(path, "a") as f:
        f.write(text)
