"""Same-run A/B of the decode and write kernels of two trees, through the public API only (`jm.decode_attention`,
`jm.append`), so a restructure or kernel change can be checked for speed against the code before it.

On the GPU machine, with an older tree unpacked beside the checkout (untracked, so it travels with the tree)::

    git archive <commit> jmixedkv pallas_kernels interop | (mkdir -p ab_before && tar -x -C ab_before)
    for i in 1 2; do for t in ab_before .; do
      python3 bench/tools/ab_kernels.py --tree $t --label $t-$i --out $OUT/ab-$(basename $t)-$i.json; done; done

Each run imports ``jmixedkv`` from ``--tree`` (checked) and bench/common.py from this checkout, and prints / writes
ms per call (median of batches of 10 calls in one jitted loop; the appends donate the cache) for decode shapes
(Tq 1 and 4, head_dim 128 and 64) and two writes (a 32-layer decode step's append at 64 x 8k, one layer's
4096-token prefill of 8 sequences). ``--smoke``: tiny shapes on the CPU.
"""
import argparse
import dataclasses
import json
import os
import sys

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--tree", required=True, help="the tree whose jmixedkv / pallas_kernels are timed")
ap.add_argument("--label", required=True)
ap.add_argument("--out", required=True, help="JSON path")
ap.add_argument("--smoke", action="store_true")
args = ap.parse_args()
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path[:0] = [os.path.abspath(args.tree), os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")]
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jmixedkv as jm  # noqa: E402
from common import random_fill, random_mixed_state, time_jax, time_threaded  # noqa: E402

if not os.path.abspath(jm.__file__).startswith(os.path.abspath(args.tree) + os.sep):
    sys.exit(f"ab_kernels: jmixedkv came from {jm.__file__}, not from --tree {args.tree}")


def mixed(page, last_n=64, tq=1):
    return jm.KVCacheConfig("mixed_nvfp4_bf16", first_n=4, last_n=last_n, page_size=page, max_draft_len=tq - 1)


def decode_ms(batch, ctx, kv_heads, q_heads, head_dim, page, tq=1):
    st = random_mixed_state(mixed(page, tq=tq), jm.GroupSpec(1, kv_heads, head_dim), batch, ctx)
    q = random_fill(3, (batch, tq, q_heads, head_dim), "bf16")
    slots = jnp.arange(batch, dtype=jnp.int32)

    @jax.jit
    def ten(st, q):                      # 10 calls in one program; each depends on the last (nothing hoisted)
        def body(_, acc):
            out, _ = jm.decode_attention(st, 0, q + (acc * 0).astype(q.dtype), slots)
            return acc + out[0, 0, 0, 0].astype(jnp.float32)
        return jax.lax.fori_loop(0, 10, body, jnp.float32(0))
    return time_jax(ten, st, q, reps=1, trials=7) / 10


def append_ms(layers, batch, kv_heads, head_dim, page, ctx, tokens):
    st = random_mixed_state(mixed(page), jm.GroupSpec(layers, kv_heads, head_dim), batch, ctx,
                            spare_pages=-(-tokens * 11 // page) + 2)
    k, v = (random_fill(i, (layers, batch * tokens, kv_heads, head_dim), "bf16") for i in (4, 5))
    slots = jnp.repeat(jnp.arange(batch, dtype=jnp.int32), tokens)
    offsets = jnp.tile(jnp.arange(tokens, dtype=jnp.int32), batch)

    def ten(st):                          # 10 appends, the state donated (every pool write is live)
        st = jax.lax.fori_loop(0, 10, lambda _, s: jm.append(s, None, k, v, slots, jnp.repeat(s.kv_lens, tokens)
                                                             + offsets), st)
        lens = jnp.full_like(st.kv_lens, ctx)                     # the next batch rewrites the same rows
        reset = dict(kv_lens=lens, written=lens, floor=jnp.zeros_like(lens), step_lo=jnp.full_like(lens, -1))
        return dataclasses.replace(st, **{f: x for f, x in reset.items() if hasattr(st, f)})
    ms, st = time_threaded(jax.jit(ten, donate_argnums=0), st, reps=1, trials=5, warmup=1)
    if int(st.error):
        sys.exit(f"ab_kernels: append set error bits {int(st.error)}")
    return ms / 10


DECODE = [dict(batch=2, ctx=64, kv_heads=2, q_heads=4, head_dim=128, page=16)] if args.smoke else [
    dict(batch=16, ctx=32768, kv_heads=8, q_heads=32, head_dim=128, page=16),
    dict(batch=64, ctx=8192, kv_heads=8, q_heads=32, head_dim=128, page=16),
    dict(batch=16, ctx=32768, kv_heads=8, q_heads=32, head_dim=128, page=16, tq=4),
    dict(batch=16, ctx=32768, kv_heads=8, q_heads=32, head_dim=64, page=16),
    dict(batch=64, ctx=8192, kv_heads=3, q_heads=9, head_dim=64, page=16)]
APPEND = [dict(layers=2, batch=2, kv_heads=2, head_dim=128, page=16, ctx=32, tokens=1)] if args.smoke else [
    dict(layers=32, batch=64, kv_heads=8, head_dim=128, page=16, ctx=8192, tokens=1),
    dict(layers=1, batch=8, kv_heads=8, head_dim=128, page=16, ctx=0, tokens=4096)]
res = dict(label=args.label, tree=os.path.abspath(args.tree), jax=jax.__version__, device=str(jax.devices()[0]),
           decode=[], append=[])
for kind, cases, fn in (("decode", DECODE, decode_ms), ("append", APPEND, append_ms)):
    for c in cases:
        res[kind].append(dict(c, ms=fn(**c)))
        print(args.label, kind, res[kind][-1], flush=True)
with open(args.out, "w") as f:
    json.dump(res, f, indent=1)
