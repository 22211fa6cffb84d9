"""H200 A/B for the branch ``mgpu-tma-copies`` (a tool, not a bench: it needs main's kernel beside the branch's).

Compares the Mosaic decode kernel of main (loaded from ``.ab/decode_mgpu_head.py``) with this branch's, which issues
fewer TMA copies (B: a box's K and V rows in one copy, a box per page up to 64 tokens) from one warp (AB: B + the copies
issued by one warp, rotating with the block): outputs compared (max abs. difference of out and LSE; the arithmetic is
the same, so 0 is expected), kernel GPU time (`partials_only`, profiler) and end-to-end time, two alternating rounds,
7 shapes (pages 16 / 32 / 64 / 128). Writes ``$OUT/s8b.json``.

One device call (about 8 minutes)::

    # here, before the call (.ab is ignored by git; the device gets it through ``carry``):
    mkdir -p .ab && git show main:pallas_kernels/decode_mgpu.py > .ab/decode_mgpu_head.py
    # the call (carry=[".ab"]):
    export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
    timeout 330 python3 bench/_mgpu_copies_ab.py
    timeout 250 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_decode_mgpu.py \
        -k "gpu_matches_reference or pages_32_to_128 or keys_on_m"

then the rest of ``tests/test_decode_mgpu.py -m gpu`` and an ncu source page of the new kernel
(``bench/sass_mix.py`` on main reads it) in a second call.
"""
import os, sys, json, time, importlib.util
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path[:0] = [".", "bench", "tests"]
OUT = os.environ.get("OUT", "/tmp/out"); os.makedirs(OUT, exist_ok=True)
import jax, jax.numpy as jnp, numpy as np
import decode_sweep as ds
from decode_bench import gpu_busy_ms, time_jax
from jmixedkv.pools import kernel_arrays

def load(name, path, **patch):
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
    for k, v in patch.items(): setattr(m, k, v)
    return m
mods = {"head": load("dm_head", ".ab/decode_mgpu_head.py"),
        "B": load("dm_b", "pallas_kernels/decode_mgpu.py", ONE_WARP_ISSUE=False),
        "AB": load("dm_ab", "pallas_kernels/decode_mgpu.py", ONE_WARP_ISSUE=True)}
only = os.environ.get("VARIANTS")
if only: mods = {k: v for k, v in mods.items() if k in only.split(",")}
t0 = time.time()
res = []
shapes = [(16, 16, 32768, 32, 1), (16, 64, 8192, 32, 1), (16, 64, 4096, 64, 1), (16, 16, 32768, 64, 4),
          (64, 16, 32768, 32, 1), (32, 64, 8192, 32, 1), (128, 16, 32768, 32, 1)]
for page, b, ctx, hq, tq in shapes:
    st, nf, nr = ds.random_state(page, [ctx] * b)
    pool = st.pools[0]
    q = jax.random.normal(jax.random.PRNGKey(b), (b, tq, hq, 128), jnp.float32).astype(jnp.bfloat16)
    args = (q, st.page_table, st.kv_lens, 0, kernel_arrays(pool.low), kernel_arrays(pool.high), st.high_table)
    fp, fe, outs = {}, {}, {}
    for name, m in mods.items():
        kw = ds.geom_kw(m.paged_decode_attention_mgpu, page, nf, nr)
        fp[name] = jax.jit(lambda q, pt, n, l, lo, hi, ht, m=m, kw=kw: m.paged_decode_attention_mgpu(q, pt, n, l, lo, hi, ht, partials_only=True, **kw))
        fe[name] = jax.jit(lambda q, pt, n, l, lo, hi, ht, m=m, kw=kw: m.paged_decode_attention_mgpu(q, pt, n, l, lo, hi, ht, **kw))
        outs[name] = [np.asarray(x, np.float32) for x in fe[name](*args)]
    ref = outs[list(mods)[0]]
    diffs = {n: max(float(np.max(np.abs(a - b_))) for a, b_ in zip(ref, o)) for n, o in outs.items()}
    row = dict(page=page, shape=f"{b}x{ctx} hq{hq} tq{tq}", diffs=diffs)
    for rep in range(2):
        for name in mods:
            row.setdefault(f"{name}_kernel_ms", []).append(gpu_busy_ms(fp[name], *args))
            row.setdefault(f"{name}_e2e_ms", []).append(time_jax(fe[name], *args))
    res.append(row)
    line = f"p{page} {row['shape']}: " + "  ".join(
        f"{n} k {min(row[n+'_kernel_ms']):.3f} e2e {min(row[n+'_e2e_ms']):.3f}" for n in mods)
    print(line + f"  diffs {diffs} [{time.time()-t0:.0f}s]", flush=True)
    json.dump(res, open(f"{OUT}/s8b.json", "w"), indent=1)
    del st, pool, args
