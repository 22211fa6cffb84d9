"""The fused write kernel (`pallas_kernels.write`) against the XLA reference path, on the GPU.

    PYTHONPATH=. python3 bench/write_bench.py [--quick] --out DIR   # GPU (--quick: decode + prefill only)
    PYTHONPATH=. python3 bench/write_bench.py --smoke --out DIR     # CPU: tiny cases in interpret mode

Cases: `shapes.WRITE_CASES`. Each is first checked bit for bit against the reference (`write_rows_reference` after
an eager `apply_rope`) on the GPU (XLA with IEEE division) and the host CPU. Kernel rows are device time (20 calls
in one jitted ``fori_loop`` per dispatch), reference rows per dispatch; pools donated. Bytes = K/V read + NVFP4 and
twin rows written. Writes ``DIR/write_bench.json`` and (GPU, unless ``--no-md``) a section of bench/RESULTS.md.
"""
from __future__ import annotations

import dataclasses
import os
import sys

from common import append_results, bench_parser, copy_bandwidth, md_table, no_gpu, time_threaded, versions, write_json
from shapes import WRITE_CASES, WRITE_SMOKE

import jax
import jax.numpy as jnp
import numpy as np

import jmixedkv as jk
from jmixedkv.allocator import allocate_mask
from jmixedkv.compat import xla_flags_with_ieee_division
from jmixedkv.pools import kernel_arrays
from jmixedkv.state import GroupSpec, write_slots
from jmixedkv.write import write_rows_reference
from pallas_kernels import write as W

ROPE = jk.RopeSpec("neox", theta=500000.0)


def make_case(num_layers, heads, head_dim, seqs, tokens_per_seq, start_pos, pool_pages, page):
    """``(state with pages allocated, k, v [L, T, H, D] bf16, seq, pos, low_slot, high_slot)``; ``pool_pages``: a
    real-size pool of that many pages, the sequences on its last pages (highest offsets)."""
    cfg = jk.KVCacheConfig("mixed_nvfp4_bf16", first_n=64, last_n=64, page_size=page)
    pages_per_seq = -(-(start_pos + tokens_per_seq) // page)
    gs = jk.nvfp4.global_scale_from_amax(jnp.full((num_layers, 2), 12.0))
    num_pages = max(seqs * pages_per_seq + 1, pool_pages or 0)
    st = jk.init_state(cfg, GroupSpec(num_layers, heads, head_dim), num_pages=num_pages, max_seqs=seqs,
                       max_pages_per_seq=pages_per_seq, gs=gs,
                       page_order=None if pool_pages is None else np.arange(num_pages, dtype=np.int32))
    for s in range(seqs):
        st = jk.admit(st, s)
    seq = jnp.repeat(jnp.arange(seqs, dtype=jnp.int32), tokens_per_seq)
    pos = jnp.tile(jnp.arange(start_pos, start_pos + tokens_per_seq, dtype=jnp.int32), seqs)
    need = jnp.zeros(st.page_table.shape, bool).at[seq, pos // page].set(True)     # the pages the tokens touch
    alloc, ids, ok = allocate_mask(st.alloc, need)
    if not bool(ok):
        raise RuntimeError(f"write_bench: page allocation failed for {num_pages} pages")
    st = dataclasses.replace(st, alloc=alloc, page_table=jnp.where(need, ids, st.page_table))
    low_slot, high_slot = write_slots(st, seq, pos)
    shape = (num_layers, seq.shape[0], heads, head_dim)
    k = (jax.random.normal(jax.random.PRNGKey(0), shape, jnp.float32) * 3).astype(jnp.bfloat16)
    v = jax.random.normal(jax.random.PRNGKey(1), shape, jnp.float32).astype(jnp.bfloat16)
    return st, k, v, seq, pos, low_slot, high_slot


def traffic_bytes(k, low_slot, high_slot):
    """K/V read + NVFP4 data / scales written + twin rows written (rows with a slot only)."""
    num_layers, _, heads, d = k.shape
    low = num_layers * int(jnp.sum(low_slot >= 0)) * 2 * heads * (d // 2 + d // 16)
    return 2 * k.size * k.dtype.itemsize + low + num_layers * int(jnp.sum(high_slot >= 0)) * 2 * heads * d * 2


def kernel_fns(page):
    """Jitted, pools-donating ``(all layers in one kernel call, one call per layer)`` of `W.write_rows`."""
    kw = dict(rope_style=ROPE.style, rope_theta=ROPE.theta, rotary_dim=ROPE.rotary_dim)

    def write(pools, k, v, layer, ls, hs, pos):
        data, scales, rows, _ = W.write_rows(k, v, layer, ls, hs, page, pos, low=kernel_arrays(pools.low),
                                             high=kernel_arrays(pools.high), **kw)
        return dataclasses.replace(pools, low=dataclasses.replace(pools.low, data=data, scales=scales),
                                   high=dataclasses.replace(pools.high, rows=rows))

    def per_layer(pools, k, v, ls, hs, pos):
        for layer in range(k.shape[0]):
            pools = write(pools, k[layer], v[layer], layer, ls, hs, pos)
        return pools
    return (jax.jit(lambda p, k, v, ls, hs, pos: write(p, k, v, None, ls, hs, pos), donate_argnums=0),
            jax.jit(per_layer, donate_argnums=0))


def reference_fns(page):
    """`kernel_fns` of the XLA reference path (an eager-rounded RoPE, then `write_rows_reference`)."""
    def run(pools, k, v, ls, hs, pos, layers):
        k = jk.apply_rope(k, pos, ROPE).astype(k.dtype)
        for layer in layers:
            kv = jnp.stack([k, v] if layer is None else [k[layer], v[layer]], axis=-3)
            pools = write_rows_reference(pools, kv, layer, ls, hs, page)
        return pools
    return (jax.jit(lambda p, k, v, ls, hs, pos: run(p, k, v, ls, hs, pos, [None]), donate_argnums=0),
            jax.jit(lambda p, k, v, ls, hs, pos: run(p, k, v, ls, hs, pos, range(k.shape[0])), donate_argnums=0))


def bytes_differ(pools, k, v, ls, hs, pos, page, fn):
    """``{platform: bytes of the kernel's pools differing from the reference's}`` on this device and the host CPU
    (float rows NaN on both sides count as equal)."""
    got = jax.device_get(fn(jax.tree.map(lambda a: a.copy(), pools), k, v, ls, hs, pos))
    kv = jnp.stack([jk.apply_rope(k, pos, ROPE).astype(k.dtype), v], axis=-3)
    out = {}
    for dev in dict.fromkeys([jax.devices()[0], jax.devices("cpu")[0]]):
        p_, kv_, ls_, hs_ = jax.device_put((pools, kv, ls, hs), dev)
        with jax.default_device(dev):
            want = jax.device_get(jax.jit(lambda p, x: write_rows_reference(p, x, None, ls_, hs_, page))(p_, kv_))
        bad = 0
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            a, b = np.asarray(a), np.asarray(b)
            uint = {1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
            diff = a.view(uint) != b.view(uint)
            if a.dtype.itemsize > 1:
                diff &= ~(np.isnan(a.astype(np.float32)) & np.isnan(b.astype(np.float32)))
            bad += int(diff.sum())
        out[dev.platform] = bad
    return out


def device_ms(fn, state, args, trials, inner):
    """ms per call of the donating ``fn(state, *args)``; ``inner > 1``: ``inner`` calls in one jitted ``fori_loop``
    per dispatch (device time)."""
    if inner > 1:
        step = fn
        fn = jax.jit(lambda s, *a: jax.lax.fori_loop(0, inner, lambda i, s_: step(s_, *a), s), donate_argnums=0)
    ms, _ = time_threaded(fn, jax.tree.map(lambda a: a.copy(), state), *args, reps=10, trials=trials)
    return ms / inner


def bench_case(case, trials, inner, smoke=False):
    """Rows ``{case, path, ms, bytes, bytes_differ}`` of one case: a real-size pool (pool pages given) times the
    default kernel and ``append`` only; ``smoke``: the default kernel, the XLA reference and ``append``."""
    name, layers, _, _, _, tokens, _, pool_pages, page = case
    st, k, v, seq, pos, ls, hs = make_case(*case[1:])
    pools, args, full = st.pools[0], (k, v, ls, hs, pos), pool_pages is None
    all_fn, per_fn = kernel_fns(page)
    bad = bytes_differ(pools, k, v, ls, hs, pos, page, all_fn) if full else {}
    print(f"[{name}] bytes differing from the reference: {bad or 'not checked here'}", flush=True)
    paths = [("pallas all-layers (default)", all_fn, pools, args, inner)]
    if full:
        ref_all, ref_per = reference_fns(page)
        paths += [("XLA reference all-layers", ref_all, pools, args, 1)]
        paths += [] if smoke else [(f"pallas {layers}x per-layer", per_fn, pools, args, inner),
                                   ("XLA reference per-layer", ref_per, pools, args, 1)]
    if tokens == 1:     # a decode step: the whole `append` transition too
        for backend in ("pallas", "reference") if full and not smoke else ("pallas",):
            f = jax.jit(lambda s, k, v, q, p, b=backend: jk.append(s, None, k, v, q, p, rope=ROPE, backend=b),
                        donate_argnums=0)
            paths.append((f"append() transition, {backend}", f, st, (k, v, seq, pos),
                          inner if backend == "pallas" else 1))
    nbytes = traffic_bytes(k, ls, hs)
    return [dict(case=name, path=p, ms=device_ms(f, s, a, trials, n), bytes=nbytes, bytes_differ=bad)
            for p, f, s, a, n in paths]


def main(argv=None):
    ap = bench_parser(__doc__, out="bench/out/write")
    ap.add_argument("--iters", type=int, default=50, help="timed batches of 10 calls per row")
    ap.add_argument("--quick", action="store_true", help="decode + prefill only (no 20 GiB pool)")
    args = ap.parse_args(argv)
    if no_gpu("write_bench", args.smoke):
        return 0
    cases, trials, inner = ((WRITE_SMOKE, 1, 1) if args.smoke
                            else (WRITE_CASES[:2] if args.quick else WRITE_CASES, args.iters, 20))
    copy_tbs, copy_how = copy_bandwidth(args.smoke)
    rows = [r for case in cases for r in bench_case(case, trials, inner, args.smoke)]
    meta = dict(versions(), copy_tbs=copy_tbs, copy_how=copy_how)
    table = md_table(("case", "path", "time (us)", "bytes (MB)", "TB/s", "x copy", "bytes differing from the "
                      "reference on"), [(r["case"], r["path"], f"{r['ms'] * 1e3:.1f}", f"{r['bytes'] / 1e6:.2f}",
                                         f"{r['bytes'] / r['ms'] / 1e9:.3f}",
                                         f"{r['bytes'] / r['ms'] / 1e9 / copy_tbs:.2f}",
                                         " ".join(f"{d} {n}" for d, n in r["bytes_differ"].items()) or "-")
                                        for r in rows])
    print(table)
    write_json(args.out, "write_bench.json", dict(meta, rows=rows, smoke=args.smoke))
    if not args.no_md and not args.smoke:
        append_results("write kernel (`bench/write_bench.py`)", meta, (
            f"mixed_nvfp4_bf16 first_n = last_n = 64, page 32, 32 layers, 8 KV heads, head_dim 128, bf16, neox RoPE "
            f"in-kernel; copy {copy_tbs:.2f} TB/s ({copy_how}).\n\n{table}"))
    return 1 if any(n for r in rows for n in r["bytes_differ"].values()) else 0


if __name__ == "__main__":
    # IEEE float32 division in XLA on the GPU (read when the backend starts), so the reference matches the kernel
    os.environ["XLA_FLAGS"] = xla_flags_with_ieee_division(os.environ.get("XLA_FLAGS", ""))
    sys.exit(main())
