"""What every benchmark shares: timers (`time_threaded`, `time_jax`, `time_each`, `time_in_step`, `time_torch`,
`gpu_busy` / `gpu_kernel_profile` from a profiler trace), full caches of random bytes (`random_mixed_state`), the
bytes floor (`kv_bytes` over `copy_bandwidth`), the command line (`bench_parser`, `parse_ints`, `no_gpu`), versions
and the output (`write_json`, `md_table`, `append_results` for bench/RESULTS.md, `error_text`). Importing it puts
the repository root on ``sys.path`` (second, after the script's folder), so a bench imports it before `jmixedkv`."""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:            # behind sys.path[0]: an A/B tree put first stays first
    sys.path.insert(1, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jmixedkv as jm  # noqa: E402
from jmixedkv.compat import on_gpu  # noqa: E402

#: the project's results file (sections titled by topic and date)
RESULTS_MD = os.path.join(ROOT, "bench", "RESULTS.md")
#: random fills generate at most this many elements and tile them (no full-size random temporaries)
CHUNK = 1 << 26
#: the copy bandwidth a ``--smoke`` run assumes (TB/s; nothing is measured on the CPU)
SMOKE_TBS = 4.3


def time_threaded(fn, carry, *args, reps=10, trials=15, warmup=2):
    """Median ms per call of ``carry = fn(carry, *args)`` (``fn`` may donate its carry): ``trials`` batches of
    ``reps`` async calls, blocked at the end of each. Returns ``(ms, the last carry)``."""
    for _ in range(warmup):
        carry = fn(carry, *args)
    jax.block_until_ready(carry)
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(reps):
            carry = fn(carry, *args)
        jax.block_until_ready(carry)
        times.append((time.perf_counter() - t0) / reps * 1e3)
    return float(np.median(times)), carry


def time_jax(fn, *args, reps=10, trials=15, warmup=2):
    """Median ms per call of ``fn(*args)``: ``trials`` batches of ``reps`` async calls (`time_threaded`)."""
    return time_threaded(lambda _, *a: fn(*a), None, *args, reps=reps, trials=trials, warmup=warmup)[0]


def time_each(fn, *args, warmup=3, iters=20):
    """Median ms of ``iters`` calls of ``fn(*args)``, each blocked on (host dispatch and sync included)."""
    return time_jax(fn, *args, reps=1, trials=iters, warmup=warmup)


def step_loop(fn, calls=10, lens_arg=2):
    """``fn(*args)`` (-> one output array) run ``calls`` times inside **one** jitted loop, as the layers of a model's
    decode step run it: one executable, no dispatch per call. Each call's ``kv_lens`` (argument ``lens_arg``) is the
    previous one's plus ``isnan(out[0])`` (0 for a finite output), so XLA can neither hoist a call out of the loop
    nor merge two; the whole output is carried. Returns the jitted loop, ``-> (lens, last output)``."""
    def loop(*a):
        def body(i, carry):
            a_ = list(a)
            a_[lens_arg] = carry[0]
            out = fn(*a_)
            return carry[0] + jnp.isnan(out.reshape(-1)[0]).astype(carry[0].dtype), out
        out0 = jax.eval_shape(fn, *a)
        return jax.lax.fori_loop(0, calls, body, (a[lens_arg], jnp.zeros(out0.shape, out0.dtype)))
    return jax.jit(loop)


def time_in_step(fn, *args, calls=10, lens_arg=2, **timing):
    """Median ms per call of ``fn(*args)`` in `step_loop` (``timing``: `time_jax`'s keywords), without the cost of
    launching an executable that `time_jax` of a single call pays."""
    return time_jax(step_loop(fn, calls, lens_arg), *args, **timing) / calls


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


def hf_generate(model, ids, cache, new: int, device: str):
    """transformers ``generate()`` of exactly ``new`` greedy tokens after ``ids`` [B, T] (int64), the cache passed
    as transformers names it; waits for the GPU when ``device`` is a CUDA one. Returns the ids [B, T + new]."""
    import torch

    from interop.hf import CACHE_KWARG
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=0, **{CACHE_KWARG: cache})
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return out


def interleaved_ms_per_step(run, names, rounds: int, tokens: int) -> dict:
    """``rounds`` rounds of every name of ``names`` once, back to back (a GPU host's single runs of a generate loop
    vary by +-30% between and within processes; interleaving pairs each round's runs). ``run(name, n)`` generates
    ``n`` tokens and returns once they are done. Per round and name: ``(run(name, tokens) - run(name, 1))`` over the
    ``tokens - 1`` decode steps, in ms (the prefill and first token subtracted). Returns name -> [ms per decode
    step, one per round]."""
    if tokens < 2:
        raise ValueError(f"tokens must be >= 2 (one decode step after the first token), got {tokens}")
    times = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            gc.collect()
            t0 = time.perf_counter()
            run(name, 1)
            t1 = time.perf_counter()
            run(name, tokens)
            times[name].append(1e3 * ((time.perf_counter() - t1) - (t1 - t0)) / (tokens - 1))
    return times


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
    per, calls, busy, spans = {}, {}, 0.0, []
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
        if gap >= between_us:
            between += gap
        elif gap > 0:
            inside += gap
        end = max(end, t1)
    kernels = sorted(per, key=per.get, reverse=True)[:top]
    return dict(busy_us_per_step=busy / n, idle_inside_us_per_step=inside / n,
                idle_between_us_per_step=between / max(n - 1, 1), kernel_launches_per_step=len(spans) / n,
                gpu_processes=sorted(names[p] for p in gpu) or sorted(names.values()),
                kernels=[dict(name=k[:160], us=per[k] / n, calls=calls[k] / n) for k in kernels])


def gpu_busy(fn, *args, steps=5, calls=1, match=None):
    """GPU time of ``fn(*args)`` (``calls`` kernel calls per run) from `gpu_kernel_profile`, without the host's
    dispatch: ``{gpu_ms, match_ms, launches}`` per call (``match_ms``: kernels whose name matches the regex
    ``match``); ``{}`` off the GPU or when the profiler fails (a row keeps its other timings)."""
    if jax.default_backend() != "gpu":
        return {}
    try:
        prof = gpu_kernel_profile(lambda i: fn(*args), steps, tempfile.mkdtemp(prefix="trace_bench"), top=40)
    except Exception as e:
        print(f"    gpu_busy: profiler failed ({error_text(e, 100)})")
        return {}
    if not prof["kernels"]:
        return {}
    hit = sum(k["us"] for k in prof["kernels"] if match and re.search(match, k["name"], re.I))
    return dict(gpu_ms=prof["busy_us_per_step"] / 1e3 / calls, match_ms=hit / 1e3 / calls,
                launches=prof["kernel_launches_per_step"] / calls)


# ------------------------------------------------------------------------------------------- synthetic caches
@functools.partial(jax.jit, static_argnames=("shape", "axis"))
def _tile(x, *, shape, axis):
    x = jnp.tile(x, tuple(-(-shape[axis] // x.shape[axis]) if i == axis else 1 for i in range(len(shape))))
    return jax.lax.slice_in_dim(x, 0, shape[axis], axis=axis)


def random_fill(seed, shape, kind, axis=1):
    """Random ``kind`` of ``shape`` on the default device: "u8" (any byte), "e4m3" (scales in [0.25, 3.75]) or
    "bf16" (normal); one host chunk of at most `CHUNK` elements (NumPy, ``seed``) tiled along ``axis``."""
    per = int(np.prod(shape)) // shape[axis]
    n = max(1, min(shape[axis], CHUNK // max(per, 1)))
    cs = shape[:axis] + (n,) + shape[axis + 1:]
    rng = np.random.default_rng(seed)
    if kind == "bf16":
        x = rng.standard_normal(cs, dtype=np.float32).astype(jnp.bfloat16)
    else:
        x = rng.integers(0, 256, cs, dtype=np.uint8)
        x = ((x & 0x1F) + 0x28).view(jnp.float8_e4m3fn) if kind == "e4m3" else x
    x = jnp.asarray(x)
    return x if n == shape[axis] else _tile(x, shape=tuple(shape), axis=axis)


def _taken(alloc, n):
    """`jmixedkv.allocator.Allocator` with page ids ``0 .. n-1`` in use (refcount 1), the rest on the free stack."""
    total = alloc.free.shape[0]
    free = np.concatenate([np.arange(total - 1, n - 1, -1), np.arange(n)]).astype(np.int32)
    refcount = (np.arange(total) < n).astype(alloc.refcount.dtype)
    return dataclasses.replace(alloc, free=jnp.asarray(free), num_free=jnp.asarray(total - n, alloc.num_free.dtype),
                               refcount=jnp.asarray(refcount))


def random_mixed_state(cfg, spec, batch, ctx, *, spare_pages=0, seed=0):
    """A full cache of one mixed group (``cfg``, `jmixedkv.GroupSpec` ``spec``): ``batch`` sequences of ``ctx``
    tokens of random NVFP4 bytes and twin rows on a random permutation of the used page ids, ``spare_pages`` free
    pages per sequence on the allocator (appends past ``ctx`` take new pages)."""
    page = cfg.page_size
    full = -(-ctx // page)
    ppseq = full + spare_pages
    st = jm.init_state(cfg, spec, batch * ppseq, batch, ppseq)
    pool = st.pools[0]
    low = dataclasses.replace(pool.low, data=random_fill(seed, pool.low.data.shape, "u8"),
                              scales=random_fill(seed + 1, pool.low.scales.shape, "e4m3"))
    high = dataclasses.replace(pool.high, rows=random_fill(seed + 2, pool.high.rows.shape, "bf16"))
    pt = np.full((batch, ppseq), -1, np.int32)
    pt[:, :full] = np.random.default_rng(seed).permutation(batch * full).astype(np.int32).reshape(batch, full)
    nh = st.high_table.shape[1]
    return dataclasses.replace(
        st, pools=(dataclasses.replace(pool, low=low, high=high),), page_table=jnp.asarray(pt),
        high_table=jnp.asarray(np.arange(batch * nh, dtype=np.int32).reshape(batch, nh)),
        kv_lens=jnp.asarray(np.full((batch,), ctx, np.int32)), written=jnp.asarray(np.full((batch,), ctx, np.int32)),
        active=jnp.asarray(np.ones((batch,), bool)), alloc=_taken(st.alloc, batch * full),
        high_alloc=_taken(st.high_alloc, batch * nh))


def bits_equal(a, b) -> bool:
    """Whether pytrees ``a`` and ``b`` have the same leaves, shapes and bits (NaN payloads included), compared on
    the device of ``a``'s leaf (no host copy of GiB-sized pools)."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(_leaf_bits_equal(x, y) for x, y in zip(la, lb))


def _leaf_bits_equal(x, y) -> bool:
    if not (isinstance(x, jax.Array) and isinstance(y, jax.Array)):          # host data: compared on the host
        x, y = np.asarray(x), np.asarray(y)
        return x.shape == y.shape and np.array_equal(x.view(np.uint8), y.view(np.uint8))
    if x.shape != y.shape or x.dtype.itemsize != y.dtype.itemsize:
        return False
    dev = next(iter(x.devices()))           # one device (a sharded leaf is gathered there)
    x, y = (jax.device_put(a, dev) for a in (x, y))
    as_uint = jnp.dtype(f"uint{8 * x.dtype.itemsize}")          # the bits as unsigned integers (bool as uint8)
    return bool(jnp.array_equal(*(a.astype(as_uint) if a.dtype == jnp.bool_ else
                                  jax.lax.bitcast_convert_type(a, as_uint) for a in (x, y))))


# ------------------------------------------------------------------------------------------- device and output
def torch_cuda():
    """torch when it is installed and sees a CUDA device, else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def copy_bandwidth(smoke: bool):
    """``(TB/s, how)``: the device copy bandwidth (bytes read + written) of 2 GiB, by torch ``copy_`` where torch
    sees CUDA, else by a jitted jnp ``x + 1``; `SMOKE_TBS` in a smoke run."""
    if smoke:
        return SMOKE_TBS, "nominal (smoke)"
    torch, nbytes = torch_cuda(), 1 << 31
    if torch is not None:
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        ms = time_torch(torch, lambda: dst.copy_(src), reps=5, trials=10)
        del src, dst
        torch.cuda.empty_cache()
        return 2 * nbytes / (ms * 1e-3) / 1e12, "torch copy_"
    x = jnp.zeros((nbytes // 4,), jnp.float32)
    ms = time_jax(jax.jit(lambda x: x + 1.0), x, reps=5, trials=10)
    return 2 * nbytes / (ms * 1e-3) / 1e12, "jnp x + 1"


def kv_bytes(tokens, kv_heads, head_dim, fmt="nvfp4", twin_rows=0):
    """Bytes of K + V that a read of ``tokens`` rows (``kv_heads x head_dim``) in ``fmt`` must move at least once:
    2 per element (``bf16``), 1 (``fp8``) or 0.5625 (``nvfp4``: packed E2M1 + an E4M3 scale per 16), plus
    ``twin_rows`` bf16 twin rows. Over the copy bandwidth, a bytes floor."""
    per = {"bf16": 2, "fp8": 1, "nvfp4": 0.5 + 1 / 16}[fmt]
    return 2 * kv_heads * head_dim * (tokens * per + twin_rows * 2)


def versions(torch=None):
    """``{jax, jaxlib, triton, torch, device, date}`` of this process (``"n/a"`` where absent; date in UTC)."""
    v = {"jax": jax.__version__, "device": str(jax.devices()[0].device_kind),
         "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    for name in ("jaxlib", "triton"):
        try:
            v[name] = __import__(name).__version__
        except Exception:
            v[name] = "n/a"
    v["torch"] = torch.__version__ if torch is not None else "n/a"
    return v


def bench_parser(doc: str, out: str = "bench/out", md: bool = True):
    """An argument parser (description: ``doc``'s first line) with ``--out`` (folder), ``--smoke`` (tiny shapes on
    the CPU, interpret mode: checks the script, times nothing real) and, when ``md``, ``--no-md``."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", default=out, help="where the output goes")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (a script check)")
    if md:
        ap.add_argument("--no-md", action="store_true", help="do not append a section to bench/RESULTS.md")
    return ap


def parse_ints(text, what: str, sep: str = ","):
    """``"1,16,64"`` -> ``(1, 16, 64)`` (None -> None): integers separated by ``sep``; anything else is refused
    naming the flag ``what``."""
    try:
        return None if text is None else tuple(int(x) for x in text.split(sep))
    except ValueError:
        raise ValueError(f"{what}: expected integers separated by {sep!r}, got {text!r}") from None


def no_gpu(name: str, smoke: bool) -> bool:
    """Whether there is nothing to do: no GPU and no ``--smoke`` (said so; the bench then exits 0)."""
    if on_gpu() or smoke:
        return False
    print(f"{name}: no GPU here (jax backend {jax.default_backend()!r}); it runs on the H200, or pass --smoke")
    return True


def md_table(header, rows) -> str:
    """A markdown table of ``header`` (column names) and ``rows`` (cells, formatted with ``str``)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def write_json(out_dir: str, name: str, obj) -> str:
    """Write ``obj`` as ``out_dir/name`` (folders created; non-JSON values as ``str``); returns the path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    return path


def append_results(title: str, meta: dict, text: str, path: str = RESULTS_MD):
    """Append a section to the results file ``path``: ``## title, date``, the device and versions of ``meta``
    (`versions`), then ``text``."""
    with open(path, "a") as f:
        f.write(f"\n## {title}, {meta['date']}\n\n{meta['device']}, jax {meta['jax']}, triton {meta['triton']}, "
                f"torch {meta['torch']}.\n\n{text}\n")


def error_text(e: BaseException, limit: int = 300) -> str:
    """``Type: message`` of ``e`` on one line (whitespace runs collapsed), at most ``limit`` characters: a failure
    recorded in a row, not raised."""
    return f"{type(e).__name__}: {' '.join(str(e).split())}"[:limit]
