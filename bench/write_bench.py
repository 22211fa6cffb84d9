"""Benchmark of the fused write kernel (`pallas_kernels.write`) on the H200, against the XLA reference path.

Cases (all: mixed_nvfp4_bf16, first_n=64, last_n=64, page 32, 32 layers, 8 KV heads, head_dim 128, bf16 K/V,
Llama-style neox RoPE applied in the kernel):

* decode step: batch 64, one token per sequence at position 1000 (every row also goes to the twin);
  all 32 layers in one call vs 32 per-layer calls (one jit), kernel alone and the full ``append`` transition;
* prefill chunk: 8 sequences x 1024 tokens (8192 tokens), all layers in one call.

Each case is first checked bit-for-bit against the reference (`write_rows_reference` after an eager
`apply_rope`), then timed (warmup, then the median over batches of 10 asynchronous calls, each batch blocked
once; pools donated). Effective bandwidth counts K/V read + NVFP4 bytes written + twin rows written, against a
device copy measured in-run.

    PYTHONPATH=. python3 bench/write_bench.py --out DIR       # GPU: table, DIR/write_bench.json, RESULTS.md
    PYTHONPATH=. python3 bench/write_bench.py --dump-ptx DIR  # GPU: XLA dump; counts fma in this kernel's PTX
    PYTHONPATH=. python3 bench/write_bench.py --smoke         # CPU: tiny sizes in interpret mode (script check)
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/out/write", help="output folder for the JSON")
    ap.add_argument("--dump-ptx", default=None, help="XLA dump folder: compile once and report fma in the PTX")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (runs on CPU in interpret mode)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--quick", action="store_true",
                    help="decode + prefill cases, default kernel vs XLA reference only (no sweep, no 20 GiB pool)")
    ap.add_argument("--no-results-md", action="store_true", help="do not append to bench/RESULTS.md")
    return ap.parse_args()


ARGS = _parse() if __name__ == "__main__" else None
from jmixedkv.compat import xla_flags_with_ieee_division  # noqa: E402  (no jax backend started yet)

# IEEE float32 division in XLA on the GPU, so the reference checked against runs on the GPU as well (jmixedkv.compat)
os.environ["XLA_FLAGS"] = xla_flags_with_ieee_division(os.environ.get("XLA_FLAGS", ""))
if ARGS is not None and ARGS.dump_ptx:
    os.makedirs(ARGS.dump_ptx, exist_ok=True)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={ARGS.dump_ptx}").strip()

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jmixedkv as jk  # noqa: E402
from jmixedkv.compat import on_gpu  # noqa: E402
from jmixedkv.write import write_rows_reference  # noqa: E402
from jmixedkv.pools import kernel_arrays  # noqa: E402
from jmixedkv.allocator import allocate_mask  # noqa: E402
from jmixedkv.state import GroupSpec, write_slots  # noqa: E402
from pallas_kernels import write as W  # noqa: E402
from common import copy_bandwidth_tbs  # noqa: E402  (bench/ is sys.path[0] when run as a script)


def _torch_cuda():
    """torch, when it can see the GPU (the copy-bandwidth ceiling is then torch's ``copy_``), else None."""
    try:
        import torch
        return torch if torch.cuda.is_available() else None
    except ImportError:
        return None


# --------------------------------------------------------------------------------------------- setup
def make_case(num_layers, heads, head_dim, seqs, tokens_per_seq, start_pos, page=32, first_n=64, last_n=64,
              pool_pages=None):
    """(state with pages allocated, k, v [L, T, H, D] bf16, seq, pos, low_slot, high_slot).

    ``pool_pages``: a real-size pool of that many pages, the sequences on its last pages (highest offsets)."""
    cfg = jk.KVCacheConfig("mixed_nvfp4_bf16", first_n=first_n, last_n=last_n, page_size=page)
    pages_per_seq = -(-(start_pos + tokens_per_seq) // page)
    spec = GroupSpec(num_layers=num_layers, num_kv_heads=heads, head_dim=head_dim)
    gs = jk.nvfp4.global_scale_from_amax(jnp.full((num_layers, 2), 12.0))
    num_pages = max(seqs * pages_per_seq + 1, pool_pages or 0)
    st = jk.init_state(cfg, spec, num_pages=num_pages, max_seqs=seqs, max_pages_per_seq=pages_per_seq, gs=gs,
                       page_order=None if pool_pages is None else np.arange(num_pages, dtype=np.int32))
    for s in range(seqs):
        st = jk.admit(st, s)
    seq = jnp.repeat(jnp.arange(seqs, dtype=jnp.int32), tokens_per_seq)
    pos = jnp.tile(jnp.arange(start_pos, start_pos + tokens_per_seq, dtype=jnp.int32), seqs)
    need = jnp.zeros(st.page_table.shape, bool).at[seq, pos // page].set(True)     # the pages the tokens touch
    alloc, ids, ok = allocate_mask(st.alloc, need)
    assert bool(ok), "page allocation failed"
    st = dataclasses.replace(st, alloc=alloc, page_table=jnp.where(need, ids, st.page_table))
    low_slot, high_slot = write_slots(st, seq, pos)
    key = jax.random.PRNGKey(0)
    shape = (num_layers, seq.shape[0], heads, head_dim)
    k = (jax.random.normal(key, shape, jnp.float32) * 3).astype(jnp.bfloat16)
    v = jax.random.normal(jax.random.fold_in(key, 1), shape, jnp.float32).astype(jnp.bfloat16)
    return st, k, v, seq, pos, low_slot, high_slot


def traffic_bytes(k, low_slot, high_slot):
    """K/V read + NVFP4 data/scales written + twin rows written (rows with a slot only)."""
    num_layers, _, heads, d = k.shape
    n_low = int(jnp.sum(low_slot >= 0))
    n_high = int(jnp.sum(high_slot >= 0))
    read = 2 * k.size * k.dtype.itemsize
    low = num_layers * n_low * 2 * heads * (d // 2 + d // 16)
    high = num_layers * n_high * 2 * heads * d * 2
    return read + low + high, dict(read=read, low=low, high=high)


# --------------------------------------------------------------------------------------------- functions
def kernel_args(pools, rope):
    """The kernel's keyword arguments for a mixed group's `GroupPools` and a `RopeSpec` (or None): raw array
    tuples and RoPE statics, as `jmixedkv.write` passes them."""
    rope_kw = {} if rope is None else dict(rope_style=rope.style, rope_theta=rope.theta, rotary_dim=rope.rotary_dim)
    return dict(low=kernel_arrays(pools.low), high=kernel_arrays(pools.high), **rope_kw)


def kernel_write(pools, k, v, layer, ls, hs, page, pos, rope, **kw):
    """`W.write_rows` on a mixed group's `GroupPools`, returning the updated `GroupPools`."""
    data, scales, rows, _ = W.write_rows(k, v, layer, ls, hs, page, pos, **kernel_args(pools, rope), **kw)
    return dataclasses.replace(pools, low=dataclasses.replace(pools.low, data=data, scales=scales),
                               high=dataclasses.replace(pools.high, rows=rows))


def fns(page, rope, block_t=None, heads_per_program=None, num_warps=4):
    kw = dict(block_t=block_t, heads_per_program=heads_per_program, num_warps=num_warps)

    def all_layers(pools, k, v, ls, hs, pos):
        return kernel_write(pools, k, v, None, ls, hs, page, pos, rope, **kw)

    def per_layer(pools, k, v, ls, hs, pos):
        for l in range(k.shape[0]):
            pools = kernel_write(pools, k[l], v[l], l, ls, hs, page, pos, rope, **kw)
        return pools

    return jax.jit(all_layers, donate_argnums=0), jax.jit(per_layer, donate_argnums=0)


def reference_fns(page, rope):
    def all_layers(pools, k, v, ls, hs, pos):
        k = jk.apply_rope(k, pos, rope).astype(k.dtype)
        return write_rows_reference(pools, jnp.stack([k, v], axis=-3), None, ls, hs, page)

    def per_layer(pools, k, v, ls, hs, pos):
        k = jk.apply_rope(k, pos, rope).astype(k.dtype)
        for l in range(k.shape[0]):
            pools = write_rows_reference(pools, jnp.stack([k[l], v[l]], axis=-3), l, ls, hs, page)
        return pools
    return jax.jit(all_layers, donate_argnums=0), jax.jit(per_layer, donate_argnums=0)


def copy_pools(pools):
    """Fresh device copies of every array of a pytree (pools or a whole `CacheState`)."""
    return jax.tree.map(lambda a: a.copy(), pools)


def check_bit_exact(pools, k, v, ls, hs, pos, page, rope, fn):
    """Kernel result vs the reference: an eager (separately rounded) RoPE on the default device (``cos``/``sin`` are
    backend-dependent in the last bit), then the row store + NVFP4 quantization on the GPU (XLA with IEEE division,
    see `jmixedkv.compat`) and on the host CPU; returns {platform: mismatching bytes} (NaN payloads aside: float
    rows where both sides are NaN count as equal)."""
    got = jax.device_get(fn(copy_pools(pools), k, v, ls, hs, pos))
    kv = jnp.stack([jk.apply_rope(k, pos, rope).astype(k.dtype), v], axis=-3)
    return {dev.platform: _bytes_differ(got, _reference_on(dev, pools, kv, ls, hs, page))
            for dev in dict.fromkeys([jax.devices()[0], jax.devices("cpu")[0]])}


def _reference_on(device, pools, kv, ls, hs, page):
    pools, kv, ls, hs = jax.device_put((pools, kv, ls, hs), device)
    with jax.default_device(device):
        return jax.device_get(jax.jit(lambda p, x: write_rows_reference(p, x, None, ls, hs, page))(pools, kv))


def _bytes_differ(got, want):
    bad = 0
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a), np.asarray(b)
        ua = a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])
        ub = b.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[b.dtype.itemsize])
        diff = ua != ub
        if a.dtype.itemsize > 1:
            diff &= ~(np.isnan(a.astype(np.float32)) & np.isnan(b.astype(np.float32)))
        bad += int(diff.sum())
    return bad


def time_fn(fn, state, args, iters, reps=10, inner=1):
    """Median seconds per call over ``iters`` batches of ``reps`` asynchronous calls, blocked once per batch (the
    timing rule of `decode_bench.time_jax`). ``state`` (pools or a whole `CacheState`) is copied, donated and
    threaded through the calls.

    ``inner > 1`` runs ``inner`` calls inside one jitted ``fori_loop`` per dispatch and divides by it: device time
    per call. The decode write (19 MB) takes less device time than the host needs to dispatch one jitted call with
    the pools pytree (~50-90 us), so without it the decode rows time the host (run-to-run spread 55-137 us on the H200,
    bench/RESULTS.md)."""
    if inner > 1:
        step = fn
        fn = jax.jit(lambda s, *a: jax.lax.fori_loop(0, inner, lambda i, s_: step(s_, *a), s), donate_argnums=0)
    state = copy_pools(state)
    for _ in range(3):
        state = fn(state, *args)
    jax.block_until_ready(state)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(reps):
            state = fn(state, *args)
        jax.block_until_ready(state)
        times.append((time.perf_counter() - t0) / (reps * inner))
    del state
    return statistics.median(times)


# --------------------------------------------------------------------------------------------- PTX dump
def ptx_report(dump_dir):
    """Find this kernel's PTX entries in an XLA dump and count fma / unrounded f32 mul-add-sub in them."""
    entries = {}
    for name in sorted(os.listdir(dump_dir)):
        if not name.endswith(".ptx"):
            continue
        text = open(os.path.join(dump_dir, name)).read()
        parts = re.split(r"(?m)^\s*\.(?:visible\s+)?\.?entry\s+", text)
        for part in parts[1:]:
            ename = re.match(r"[\w$.]+", part).group(0)
            entries[f"{name}:{ename}"] = part
    # by name, or by the inline PTX only this kernel carries (in case XLA renamed the entry)
    ours = {n: b for n, b in entries.items() if "write_rows" in n or "div.rn.f32" in b}
    report = {n: dict(fma=len(re.findall(r"\bfma\.", b)),
                      unrounded_f32=len(re.findall(r"\b(?:mul|add|sub)\.f32\b", b)),
                      rn_f32=len(re.findall(r"\b(?:mul|add|sub|div)\.rn\.f32\b", b))) for n, b in ours.items()}
    return entries, report


def run_dump(dump_dir):
    st, k, v, seq, pos, ls, hs = make_case(2, 2, 128, 4, 16, 0, page=16, first_n=16, last_n=16)
    rope = jk.RopeSpec("neox", theta=500000.0)
    all_fn, _ = fns(st.page_size, rope)
    jax.block_until_ready(all_fn(st.pools[0], k, v, ls, hs, pos))
    entries, report = ptx_report(dump_dir)
    print(f"{len(entries)} PTX entries in {dump_dir}")
    if not report:
        print("kernel entry not found; entries:", list(entries)[:50])
        return 1
    for n, r in report.items():
        print(f"{n}: {r}")
    print(f"kernel fma count: {sum(r['fma'] for r in report.values())}")
    print(f"kernel unrounded f32 mul/add/sub count: {sum(r['unrounded_f32'] for r in report.values())}")
    return 0


# --------------------------------------------------------------------------------------------- main
def bench_case(name, case, rope, iters, sweep, with_append, full=True, inner=20):
    """``full=False`` (real-size pools): the default kernel and the pallas ``append`` only; bit-exactness at
    that size is checked by tests/test_gpu_real_size.py. Kernel rows are device time per call (``inner`` calls per
    dispatch, `time_fn`); the XLA reference rows and the reference ``append`` are timed per dispatch."""
    st, k, v, seq, pos, ls, hs = case
    page = st.page_size
    pools = st.pools[0]
    nbytes, parts = traffic_bytes(k, ls, hs)
    rows = []
    all_fn, per_fn = fns(page, rope)
    bad = check_bit_exact(pools, k, v, ls, hs, pos, page, rope, all_fn) if full else {}
    plan = W.plan_for(k, v, None, low=(pools.low.data, pools.low.scales, pools.low.gs),
                      high=(pools.high.rows, pools.high.scale), rope_style=rope.style, rotary_dim=rope.rotary_dim)
    verdict = ", ".join(f"reference on {d}: " + ("OK" if n == 0 else f"{n} BYTES DIFFER") for d, n in bad.items())
    print(f"[{name}] bit-exact? {verdict} "
          f"(default block_t={plan.block_t}, heads_per_program={plan.heads_per_program}, grid={plan.grid})")
    args = (k, v, ls, hs, pos)
    rows.append(dict(case=name, path="pallas all-layers (default)",
                     s=time_fn(all_fn, pools, args, iters, inner=inner)))
    for bt, hb, nw in (sweep if full else []):
        f, _ = fns(page, rope, bt, hb, nw)
        rows.append(dict(case=name, path=f"pallas all-layers bt={bt} hb={hb} warps={nw}",
                         s=time_fn(f, pools, args, iters, inner=inner)))
    if full:
        rows.append(dict(case=name, path=f"pallas {k.shape[0]}x per-layer",
                         s=time_fn(per_fn, pools, args, iters, inner=inner)))
        rows.append(dict(case=name, path="pallas all-layers, no RoPE (timing only)",
                         s=time_fn(fns(page, None)[0], pools, args, iters, inner=inner)))
        ref_all, ref_per = reference_fns(page, rope)
        rows.append(dict(case=name, path="XLA reference all-layers", s=time_fn(ref_all, pools, args, iters)))
        rows.append(dict(case=name, path="XLA reference per-layer", s=time_fn(ref_per, pools, args, iters)))
    if with_append:
        for backend in (("pallas", "reference") if full else ("pallas",)):
            f = jax.jit(lambda s, k, v, q, p, b=backend: jk.append(s, None, k, v, q, p, rope=rope, backend=b),
                        donate_argnums=0)
            rows.append(dict(case=name, path=f"append() transition, {backend}",
                             s=time_fn(f, st, (k, v, seq, pos), iters, inner=inner if backend == "pallas" else 1)))
    for r in rows:
        r.update(bytes=nbytes, tbps=nbytes / r["s"] / 1e12, bit_exact=not any(bad.values()),
                 bytes_differ=bad)
    return rows, parts


def main():
    args = ARGS
    if args.dump_ptx:
        if not on_gpu():
            print("--dump-ptx needs a GPU (XLA only emits PTX there); nothing to do on CPU")
            return 0
        return run_dump(args.dump_ptx)
    if not on_gpu() and not args.smoke:
        print("write_bench: no GPU here. Run on the H200: PYTHONPATH=. python3 bench/write_bench.py --out DIR "
              "(or --smoke for a tiny interpret-mode run of this script on CPU)")
        return 0
    rope = jk.RopeSpec("neox", theta=500000.0)
    if args.smoke:
        cases = [("decode", make_case(2, 2, 128, 4, 1, 100, page=32), False, True),
                 ("prefill", make_case(2, 2, 128, 2, 16, 0, page=32), False, True),
                 ("decode, pool on its last pages", make_case(2, 2, 128, 4, 1, 100, page=32, pool_pages=64), True,
                  False)]
        iters, sweep = 2, [(16, 1, 4)]
    else:
        cases = [("decode L32 H8 D128 B64", make_case(32, 8, 128, 64, 1, 1000), True, True),
                 ("prefill 8x1024 tokens", make_case(32, 8, 128, 8, 1024, 0), False, True)]
        if not args.quick:   # model-shaped real-size pool: 32 layers x 655k tokens = 20 GiB NVFP4 (+ scales > 4 GiB)
            cases.append(("decode B64, 20 GiB pool", make_case(32, 8, 128, 64, 1, 1000, pool_pages=20480), True,
                          False))
        iters, sweep = args.iters, [(16, 1, 2), (16, 1, 8), (32, 1, 4), (64, 1, 4), (16, 2, 4),
                                   (32, 8, 4)]
        if args.quick:
            sweep = []
    copy_tbs, copy_how = (4.3, "nominal (smoke)") if args.smoke else copy_bandwidth_tbs(_torch_cuda())
    copy_bw = copy_tbs * 1e12
    all_rows, parts = [], {}
    for name, case, with_append, full in cases:
        rows, parts[name] = bench_case(name, case, rope, iters, sweep, with_append, full,
                                       inner=2 if args.smoke else 20)
        all_rows += rows
        del case
    dev = jax.devices()[0]
    try:
        import triton
        triton_version = triton.__version__
    except Exception:  # noqa: BLE001
        triton_version = "n/a"
    header = (f"device: {dev.device_kind}, jax {jax.__version__}, triton {triton_version}, "
              f"copy bandwidth {copy_tbs:.2f} TB/s ({copy_how}, 2 GiB)")
    print(header)
    lines = ["| case | path | time (us) | bytes (MB) | TB/s | x copy BW | bytes differing from reference on |", "|---|---|---|---|---|---|---|"]
    for r in all_rows:
        lines.append(f"| {r['case']} | {r['path']} | {r['s'] * 1e6:.1f} | {r['bytes'] / 1e6:.2f} | {r['tbps']:.3f} | "
                     f"{r['tbps'] * 1e12 / copy_bw:.2f} | "
                     + (" ".join(f"{d} {n}" for d, n in r["bytes_differ"].items())
                        or "not here (tests/test_gpu_real_size.py)") + " |")
    print("\n".join(lines))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "write_bench.json"), "w") as f:
        json.dump(dict(header=header, copy_bw=copy_bw, rows=all_rows, traffic=parts, smoke=args.smoke), f, indent=1)
    if not args.no_results_md and not args.smoke:
        path = os.path.join(ROOT, "bench", "RESULTS.md")
        if not os.path.exists(path):
            with open(path, "w") as f:
                f.write("# Benchmark results (GPU runs, newest sections appended)\n")
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        with open(path, "a") as f:
            f.write(f"\n## write kernel (`bench/write_bench.py`), {stamp}\n\n{header}. mixed_nvfp4_bf16, "
                    "first_n=64, last_n=64, page 32, 32 layers, 8 KV heads, head_dim 128, bf16, neox RoPE "
                    "in-kernel. Bytes = K/V read + NVFP4 written + twin rows written; ratio vs the in-run copy.\n\n")
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
