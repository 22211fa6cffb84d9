"""NVFP4 quantize / dequantize kernels (`pallas_kernels.nvfp4`) at their default tilings: bit-exactness first
(quantize at D 64 / 128 / 256 / 576, scalar and per-row gs, both block scales, against the XLA reference on the GPU
and the pinned one on the host CPU; dequantize against the GPU reference), then time on ``bf16[rows, 128]``
(`shapes.NVFP4_ROWS`, 1 GiB) beside the device copy and the XLA references (bytes = read + written).

    PYTHONPATH=. python3 bench/nvfp4_bench.py --out DIR   # GPU; appends a RESULTS section unless --no-md
    PYTHONPATH=. python3 bench/nvfp4_bench.py --smoke     # CPU: 64 x 128 in interpret mode, bit for bit
"""
from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from common import (append_results, bench_parser, copy_bandwidth, md_table, no_gpu, time_jax, versions,
                    write_json)
from shapes import NVFP4_ROWS

from jmixedkv import nvfp4
from pallas_kernels import nvfp4 as K


def make_input(rows, d, seed):
    """bf16 ``[rows, d]`` over many magnitudes with special blocks: NaN, inf, zeros, -0, subnormal-small, E4M3 max."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, d)) * rng.choice([1e-6, 1e-3, 1.0, 30.0, 1e4], (rows, 1))).astype(np.float32)
    x[0, 3], x[1, 16 + 7], x[2, 32:48], x[3, 0:16] = np.nan, np.inf, 0.0, -0.0
    x[4, 16:32] *= 1e-30
    x[5, 0:16] = 6.0 * 448.0
    return jnp.asarray(x, jnp.bfloat16)


def mismatch(got, want) -> int:
    """Bytes that differ between two ``(packed, scales)`` pairs, compared on ``got``'s device."""
    dev = list(got[0].devices())[0]
    (p, s), (pr, sr) = got, jax.device_put(want, dev)
    u8 = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.uint8)
    return int(jnp.sum(p != pr) + jnp.sum(u8(s) != u8(sr)))


def bit_exact_checks():
    """``[{d, per_row_gs, block_scale, vs_gpu_reference, vs_cpu_reference, dequantize}]`` (mismatching bytes / values;
    on the CPU both references are the same)."""
    cpu = jax.devices("cpu")[0]
    out = []
    for d in (64, 128, 256, 576):
        for per_row in (False, True):
            for block_scale in ("max6", "4over6"):
                x = make_input(4099, d, seed=d)
                gs = (jnp.asarray(np.random.default_rng(d).uniform(1e-3, 10.0, 4099), jnp.float32) if per_row
                      else nvfp4.global_scale_from_amax(jnp.float32(1e3)))
                ref = functools.partial(nvfp4.quantize_reference, block_scale=block_scale)
                want = jax.jit(ref)(x, gs)
                with jax.default_device(cpu):
                    want_cpu = jax.jit(ref)(*jax.device_put((x, gs), cpu))
                got = jax.jit(functools.partial(K.quantize, block_scale=block_scale))(x, gs)
                dq = np.asarray(jax.jit(K.dequantize)(*want, gs), np.float32)
                dq_want = np.asarray(jax.jit(nvfp4.dequantize_reference)(*want, gs), np.float32)
                out.append(dict(d=d, per_row_gs=per_row, block_scale=block_scale,
                                vs_gpu_reference=mismatch(got, want), vs_cpu_reference=mismatch(got, want_cpu),
                                dequantize=int(np.sum(~((dq == dq_want) | (np.isnan(dq) & np.isnan(dq_want)))))))
    return out


def timings(rows):
    """Rows ``{kind, name, ms, bytes, tbs[, exact]}`` of the copy, the XLA references and the kernels."""
    x = jax.random.normal(jax.random.key(0), (rows, 128), jnp.bfloat16)
    gs = nvfp4.global_scale_from_amax(jnp.max(jnp.abs(x)).astype(jnp.float32))
    n = rows * 128
    q_bytes = dq_bytes = 2 * n + n // 2 + n // 16
    packed, scales = want = jax.jit(nvfp4.quantize_reference)(x, gs)
    copy_tbs, how = copy_bandwidth(False)
    out = [dict(kind="copy", name=how, tbs=copy_tbs)]

    def timed(kind, name, fn, args, nbytes, **extra):
        ms = time_jax(fn, *args)
        out.append(dict(kind=kind, name=name, ms=ms, bytes=nbytes, tbs=nbytes / ms / 1e9, **extra))
        print(f"{kind:10s} {name:44s} {ms:8.3f} ms {out[-1]['tbs'] / copy_tbs:7.1%} of copy", flush=True)

    timed("reference", "XLA quantize_reference", jax.jit(nvfp4.quantize_reference), (x, gs), q_bytes)
    timed("reference", "XLA dequantize_reference", jax.jit(nvfp4.dequantize_reference), want + (gs,), dq_bytes)
    for name, block_scale in (("defaults", "max6"), ("defaults, 4over6", "4over6")):
        fn = jax.jit(functools.partial(K.quantize, block_scale=block_scale, **K.QUANT_DEFAULTS))
        exact = {} if block_scale != "max6" else dict(exact=mismatch(fn(x, gs), want) == 0)
        timed("quantize", name, fn, (x, gs), q_bytes, **exact)
    timed("dequantize", "defaults", jax.jit(functools.partial(K.dequantize, **K.DEQUANT_DEFAULTS)),
          (packed, scales, gs), dq_bytes)
    return out


def markdown(res):
    bad = [c for c in res["bit_exact"] if c["vs_gpu_reference"] or c["vs_cpu_reference"] or c["dequantize"]]
    copy = res["timings"][0]
    return (
        f"bf16[{res['rows']}, 128]; bytes = read + written; of copy = against the {copy['name']} copy, "
        f"{copy['tbs']:.2f} TB/s. Bit-exact (D 64 / 128 / 256 / 576, scalar and per-row gs, max6 and 4over6, vs the "
        "GPU and CPU references): " + ("**all OK**" if not bad else f"**{len(bad)} cases differ** (see the JSON)")
        + "\n\n" + md_table(("kind", "tiling", "ms", "TB/s", "of copy", "bit-exact on the timed input"),
                             [(r["kind"], r["name"], f"{r['ms']:.3f}", f"{r['tbs']:.2f}",
                               f"{r['tbs'] / copy['tbs']:.1%}", r.get("exact", "-")) for r in res["timings"][1:]]))


def main(argv=None):
    ap = bench_parser(__doc__)
    ap.add_argument("--rows", type=int, default=NVFP4_ROWS, help="rows of the timed bf16[rows, 128]")
    args = ap.parse_args(argv)
    if args.smoke:
        x, gs = make_input(64, 128, 0), jnp.float32(1.0)
        tile = dict(block_rows=32, sub_rows=16, interpret=True)
        bad = {bs: mismatch(K.quantize(x, gs, block_scale=bs, **tile), nvfp4.quantize_reference(x, gs, bs))
               for bs in ("max6", "4over6")}
        print(f"nvfp4_bench smoke (interpret mode, 64 x 128): bytes differing from the reference {bad}")
        return 0 if not any(bad.values()) else 1
    if no_gpu("nvfp4_bench", False):
        return 0
    res = dict(versions(), rows=args.rows, bit_exact=bit_exact_checks())
    res["timings"] = timings(args.rows)
    print(markdown(res))
    print("wrote", write_json(args.out, "nvfp4_bench.json", res))
    if not args.no_md:
        append_results("NVFP4 quantize / dequantize kernels (`bench/nvfp4_bench.py`)", res, markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
