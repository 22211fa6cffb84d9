"""Shared test helpers (import as ``from helpers import ...``; test modules never import each other):

* bit equality for arrays and pytrees (`bits`, `assert_bits_equal`, `assert_trees_bit_equal`) and a tolerance
  comparison (`rel_l2`, `assert_trees_close`);
* one poisoned / permuted-page state builder (`poisoned_state`): unused rows decode to NaN, page ids are handed
  out in a random order;
* one kernel-vs-reference runner (`check_kernel`): both sides jitted, the kernel run twice (determinism);
* shared fixtures of the decode-attention tests (`decode_state`, `decode_queries`, `decode_reference`) and of the
  prefix-cache tests (`new_cache`, `shadow_append`, ...).

Bit equality compares the bytes of every element, whatever the dtype (float32 included: ``-0.0 != 0.0`` and
``NaN == NaN`` when the payloads agree). ``any_nan=True`` relaxes one thing only: two floats that are both NaN
compare equal whatever their payloads (x86 and NVIDIA GPUs generate different default NaNs for an invalid
operation, so payloads are not part of the convention where a NaN is *computed*; NVFP4 bytes and E4M3 scales encode
NaN explicitly and stay compared byte for byte).
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jmixedkv import GroupSpec, KVCacheConfig, admit, append, attention_reference, init_state, rows_reference
from jmixedkv import stage_reference

__all__ = ["bits", "assert_bits_equal", "assert_trees_bit_equal", "rel_l2", "assert_trees_close", "division_probe",
           "normal_rows", "poisoned_state", "prefix_state", "jit_static", "check_kernel",
           "outlier_rows", "decode_state", "decode_queries", "decode_reference",
           "PAGE", "MAX_PAGES", "SLOTS", "MAX_TOKENS", "CFG", "GROUPS", "BASES", "kv_rows", "padded", "shadow_append",
           "cache_append", "read_all", "page_bytes", "pages_bytes", "host_bytes", "new_cache", "new_shadow"]


def bits(x) -> np.ndarray:
    """Unsigned-integer view of an array's bytes (``uint8/16/32/64`` by item size; bool as uint8)."""
    x = np.asarray(x)
    if x.dtype == bool:
        return x.view(np.uint8)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def _both_nan(x, y):
    """Where two float arrays (16 bits or wider) both hold a NaN; never for bytes, integers or bools."""
    if x.dtype.itemsize == 1 or x.dtype.kind in "biu":
        return np.zeros(x.shape, bool)
    return np.isnan(x.astype(np.float32)) & np.isnan(y.astype(np.float32))


def assert_bits_equal(got, want, msg: str = "", *, any_nan: bool = False) -> None:
    """Assert ``got`` and ``want`` have the same shape, dtype and bytes (see the module docstring for ``any_nan``).

    The failure names how many elements differ and the first few indices with both values."""
    a, b = np.asarray(got), np.asarray(want)
    assert a.shape == b.shape and a.dtype == b.dtype, \
        f"{msg}: shape/dtype {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    bad = bits(a) != bits(b)
    if any_nan:
        bad &= ~_both_nan(a, b)
    if bad.any():
        idx = np.argwhere(bad)[:4]
        first = ", ".join(f"{tuple(i.tolist())}: {a[tuple(i)]!r} vs {b[tuple(i)]!r}" for i in idx)
        raise AssertionError(f"{msg}: {int(bad.sum())} of {bad.size} elements differ; first {first}")


def assert_trees_bit_equal(a, b, msg: str = "", *, any_nan: bool = False) -> None:
    """Same tree structure and every leaf bit-identical (shape, dtype, bytes); failures name the leaf path."""
    la, ta = jax.tree_util.tree_flatten_with_path(a)
    lb, tb = jax.tree_util.tree_flatten_with_path(b)
    assert ta == tb, f"{msg}: tree structures differ:\n{ta}\n{tb}"
    for (path, x), (_, y) in zip(la, lb):
        assert_bits_equal(x, y, f"{msg} {jax.tree_util.keystr(path)}", any_nan=any_nan)


def rel_l2(a, b) -> float:
    """Relative L2 error ``|a - b| / |b|`` in float64 (``|b|`` floored at 1e-30)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def assert_trees_close(a, b, tol, msg: str = "") -> None:
    """Same tree structure and shapes; per leaf, non-finite entries agree exactly (NaN where NaN, the same
    infinities) and the finite ones have `rel_l2` below ``tol`` (a float, or a tuple with one per leaf)."""
    la, ta = jax.tree_util.tree_flatten_with_path(a)
    lb, tb = jax.tree_util.tree_flatten_with_path(b)
    assert ta == tb, f"{msg}: tree structures differ:\n{ta}\n{tb}"
    tols = tuple(tol) if isinstance(tol, (tuple, list)) else (tol,) * len(la)
    for (path, x), (_, y), t in zip(la, lb, tols):
        where = f"{msg} {jax.tree_util.keystr(path)}"
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert x.shape == y.shape, f"{where}: shape {x.shape} vs {y.shape}"
        fin = np.isfinite(x) & np.isfinite(y)
        assert np.array_equal(np.isfinite(x), np.isfinite(y)) and np.array_equal(x[~fin], y[~fin], equal_nan=True), \
            f"{where}: non-finite entries differ at {np.argwhere(~fin)[:4].tolist()}"
        err = rel_l2(x[fin], y[fin])
        assert err < t, f"{where}: relative L2 error {err:.3g} >= {t}"


# ------------------------------------------------------------------- IEEE division in XLA (jmixedkv.compat)
_DIVISION_PROBE = """
import os, sys
import numpy as np
import jax, jax.numpy as jnp
d = np.concatenate([np.float32([0.0011160715, 3.0, 7.0]),
                    np.random.default_rng(0).uniform(1e-4, 1e4, 1 << 16).astype(np.float32)])
got = np.asarray(jax.jit(lambda a: jnp.float32(1.0) / a)(jnp.asarray(d)))
want = np.float32(1.0) / d
print(jax.default_backend(), int((got.view(np.uint32) != want.view(np.uint32)).sum()), got[0])
"""


def division_probe(env_flags):
    """Run `_DIVISION_PROBE` in a fresh process with ``XLA_FLAGS=env_flags``: (backend, mismatches, 1/0.0011160715)."""
    env = dict(os.environ, XLA_FLAGS=env_flags)
    r = subprocess.run([sys.executable, "-c", _DIVISION_PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    backend, bad, inv = r.stdout.split()[-3:]
    return backend, int(bad), np.float32(inv)


# ------------------------------------------------------------------- poisoned states
_admit = jax.jit(admit)


def normal_rows(rng, shape, dtype):
    """``(k, v)`` of ``shape`` ``[L, T, H, D]`` and ``dtype``: standard normal, K scaled by one factor drawn from
    [0.5, 8) (so block scales vary between calls)."""
    k = jnp.asarray(rng.normal(size=shape) * rng.uniform(0.5, 8), dtype)
    return k, jnp.asarray(rng.normal(size=shape), dtype)


def poisoned_state(cfg: KVCacheConfig, groups, lengths, *, seed=0, decode_steps=0, num_seqs=None, width=None,
                   num_pages=None, num_high_pages=None, gs=None, high_scale=0.05, rows=normal_rows, idle=()):
    """A cache built to catch readers that read what they must not.

    `init_state(poison=True)` (every unwritten row decodes to NaN), low and twin page ids handed out in a seeded
    random order, every slot admitted but those in ``idle``; sequence ``s`` then holds ``lengths[s]`` tokens (slots
    past ``len(lengths)`` stay empty): one ragged prefill of ``lengths[s] - decode_steps`` tokens padded to a fixed
    ``num_seqs * width * page`` (one compile per geometry), then ``decode_steps`` one-token steps (the ring wraps
    for long sequences), appended with the reference backend to group 0.

    Args:
      groups: one `GroupSpec` or several (`init_state`);
      num_seqs: slots (default ``len(lengths)``); width: page-table width (default: the longest sequence's pages);
      num_pages: low pages (default: the pages the lengths need, plus 2); num_high_pages: twin pages (default
      ``num_seqs`` times the twin pages of one sequence);
      gs: NVFP4 global scale (default: f32[L, kv] per group drawn from [0.005, 0.05)); high_scale: FP8 scale;
      rows: ``rows(rng, shape, dtype) -> (k, v)``, the K/V rows of one append (``[L, T, H, D]``, attention dtype).
    """
    page = cfg.page_size
    num_seqs = num_seqs or len(lengths)
    lengths = [int(n) for n in lengths] + [0] * (num_seqs - len(lengths))
    width = width or max(-(-max(lengths) // page), 1)
    num_pages = num_pages or sum(-(-n // page) for n in lengths) + 2
    groups = (groups,) if isinstance(groups, GroupSpec) else tuple(groups)
    spec = groups[0]
    num_high_pages = num_seqs * cfg.num_high_pages_per_seq if num_high_pages is None else num_high_pages
    rng = np.random.default_rng(seed)
    if gs is None:
        gs = [rng.uniform(0.005, 0.05, (g.num_layers, g.kv_factor)).astype(np.float32) for g in groups]
    state = init_state(cfg, groups, num_pages=num_pages, max_seqs=num_seqs, max_pages_per_seq=width,
                       num_high_pages=num_high_pages, poison=True, page_order=rng.permutation(num_pages),
                       high_page_order=rng.permutation(max(num_high_pages, 1)), gs=gs, high_scale=high_scale)
    for s in sorted(set(range(num_seqs)) - set(idle)):
        state = _admit(state, s)

    def put(state, seq, pos):
        k, v = rows(rng, (spec.num_layers, len(seq), spec.num_kv_heads, spec.head_dim), cfg.attention_dtype)
        return append(state, None, k, None if spec.kv_factor == 1 else v, seq, pos, backend="reference")

    pre = [max(n - decode_steps, 0) for n in lengths]
    seq, pos = np.full(num_seqs * width * page, -1, np.int32), np.zeros(num_seqs * width * page, np.int32)
    at = 0
    for s, n in enumerate(pre):
        seq[at:at + n], pos[at:at + n] = s, np.arange(n)
        at += n
    if any(pre):
        state = put(state, seq, pos)
    for i in range(decode_steps):
        state = put(state, np.array([s if pre[s] + i < n else -1 for s, n in enumerate(lengths)], np.int32),
                    np.array([p + i for p in pre], np.int32))
    assert int(state.error) == 0, int(state.error)
    np.testing.assert_array_equal(np.asarray(state.kv_lens), lengths)
    return state


# ------------------------------------------------------------------- kernel vs reference
@functools.lru_cache(maxsize=None)
def _jitted(fn, static):
    return jax.jit(functools.partial(fn, **dict(static)) if static else fn)


def jit_static(fn, **static):
    """``jax.jit(functools.partial(fn, **static))``, memoized on ``(fn, static)``: repeated calls reuse one compile
    (``static`` values must be hashable)."""
    return _jitted(fn, tuple(sorted(static.items())))


def check_kernel(kernel, reference, args, *, kernel_kw=None, reference_kw=None, tol=None, any_nan=False, msg=""):
    """Run ``kernel(*args, **kernel_kw)`` twice and ``reference(*args, **reference_kw)`` once, each jitted
    (`jit_static`: the keyword arguments are static). The two kernel runs must be bit-identical (a race or an
    uninitialized read shows up as a difference), and the kernel's output must equal the reference's bit for bit
    (``tol=None``; ``any_nan`` as in `assert_bits_equal`) or within `assert_trees_close` ``tol``.

    ``reference`` may also be an already computed output (an oracle that must not run jitted). Returns
    ``(kernel output, reference output)``."""
    run = jit_static(kernel, **(kernel_kw or {}))
    got = jax.block_until_ready(run(*args))
    assert_trees_bit_equal(run(*args), got, f"{msg}: the kernel run twice")
    want = jit_static(reference, **(reference_kw or {}))(*args) if callable(reference) else reference
    if tol is None:
        assert_trees_bit_equal(got, want, msg, any_nan=any_nan)
    else:
        assert_trees_close(got, want, tol, msg)
    return got, want


# ------------------------------------------------------------------- decode attention (Triton and Mosaic GPU)
def outlier_rows(rng, shape, dtype):
    """``(k, v)``: K normal * 2 plus outliers of +20 at 1% of the entries (they spread the logits and the block
    scales), V standard normal."""
    k = rng.normal(size=shape) * 2.0 + 20.0 * (rng.uniform(size=shape) < 0.01)
    return jnp.asarray(k, dtype), jnp.asarray(rng.normal(size=shape), dtype)


@functools.lru_cache(maxsize=None)
def decode_state(dtype="mixed_nvfp4_bf16", first_n=5, last_n=7, page=16, lens=(1, 15, 16, 17, 70), heads=2, d=64,
                 layers=2, max_draft_len=2, gs=0.05, seed=0):
    """A `poisoned_state` of ``len(lens)`` sequences with outlier-laden K (`outlier_rows`), FP8 scale 0.02;
    memoized (read-only use: never donate it)."""
    cfg = KVCacheConfig(dtype, first_n=first_n, last_n=last_n, page_size=page, max_draft_len=max_draft_len)
    return poisoned_state(cfg, GroupSpec(num_layers=layers, num_kv_heads=heads, head_dim=d), lens, seed=seed,
                          gs=gs, high_scale=0.02, rows=outlier_rows)


def decode_queries(st, tq, hq, seed=1):
    """``q [S, Tq, Hq, D]`` in the attention dtype, one batch row per slot of ``st``."""
    d = st.groups[0].head_dim
    return (jax.random.normal(jax.random.PRNGKey(seed), (st.max_seqs, tq, hq, d)) * 1.5).astype(
        st.config.attention_dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap"))
def decode_reference(st, layer, q, seq, sm_scale=None, sliding_window=None, soft_cap=None):
    """float32 attention over the staged cache (float32 staging for NVFP4 groups: the exact decoded values).
    Query rows that see no key (position < 0 when Tq > n) give zeros and LSE -inf, as the kernels (the raw
    reference gives NaN there: softmax over nothing)."""
    exact = st.kinds[0] != "plain"      # NVFP4 / twin values are read exactly by the kernel (never rounded)
    staged = stage_reference(st, layer, seq, dtype=jnp.float32 if exact else None)
    out, lse = attention_reference(q, staged[:, 0], staged[:, 1], st.kv_lens[seq], sm_scale=sm_scale,
                                   sliding_window=sliding_window, soft_cap=soft_cap)
    ok = lse > -jnp.inf
    return jnp.where(ok[..., None], out, 0.0), jnp.where(ok, lse, -jnp.inf)


# ------------------------------------------------------------------- prefix-cache fixtures (test_prefix, test_offload)
PAGE, MAX_PAGES, SLOTS = 4, 6, 3
MAX_TOKENS = PAGE * MAX_PAGES
CFG = KVCacheConfig("mixed_nvfp4_bf16", first_n=5, last_n=3, page_size=PAGE)      # F = 2 fixed, R = 2 ring
GROUPS = (GroupSpec(2, 1, 16, name="attn"), GroupSpec(1, 1, 16, kind="plain", name="draft"))
BASES = ([1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9, 2, 2, 2, 2],
         [1, 2, 3, 4, 5, 6, 7, 8, 8, 7, 6, 5, 4, 3, 2, 1, 0, 0, 0, 0, 1, 1, 1, 1],
         [5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5])


def kv_rows(tokens, positions, num_layers, heads=1, dim=16):
    """Deterministic K/V = f(token id, position, layer): identical prefixes give identical rows."""
    t = np.asarray(tokens, np.float32)[None, :, None, None]
    p = np.asarray(positions, np.float32)[None, :, None, None]
    l = np.arange(num_layers, dtype=np.float32)[:, None, None, None]
    h = np.arange(heads, dtype=np.float32)[None, None, :, None]
    d = np.arange(dim, dtype=np.float32)[None, None, None, :]
    k = np.sin(t * 0.731 + p * 0.197 + l * 1.37 + h * 0.53 + d * 0.11) * (1 + t % 3)
    v = np.cos(t * 0.291 + p * 0.613 + l * 0.77 + h * 0.31 + d * 0.05) * (1 + t % 2)
    return jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)


def padded(slot, tokens, start):
    """Fixed-size (MAX_TOKENS) append batch: one compile for every append."""
    n = len(tokens)
    seq = np.full(MAX_TOKENS, -1, np.int32)
    seq[:n] = slot
    pos = np.zeros(MAX_TOKENS, np.int32)
    pos[:n] = np.arange(start, start + n)
    tok = np.zeros(MAX_TOKENS, np.int32)
    tok[:n] = tokens
    return seq, pos, tok


def shadow_append(state, slot, tokens, start):
    seq, pos, tok = padded(slot, tokens, start)
    for g, spec in enumerate(GROUPS):
        k, v = kv_rows(tok, pos, spec.num_layers)
        state = append(state, None, k, v, jnp.asarray(seq), jnp.asarray(pos), group=g, backend="reference")
    assert int(state.error) == 0
    return state


def cache_append(pc, slot, tokens, start):
    seq, pos, tok = padded(slot, tokens, start)
    for g, spec in enumerate(GROUPS):
        k, v = kv_rows(tok, pos, spec.num_layers)
        pc.append(None, k, v, seq, pos, group=g)


@jax.jit
def read_all(state):
    """Rows every slot reads, per group and layer: tuple of [L, S, MAX_TOKENS, kv, H, D]."""
    seq = jnp.arange(state.max_seqs, dtype=jnp.int32)[:, None]
    pos = jnp.arange(MAX_TOKENS, dtype=jnp.int32)[None, :]
    return tuple(jnp.stack([rows_reference(state, l, seq, pos, group=g) for l in range(spec.num_layers)])
                 for g, spec in enumerate(state.groups))


def _gather_pages(state, low, high):
    from jmixedkv import offload
    return jit_static(offload.gather_pages)(state, low, high)


def page_bytes(state, low, high):
    """{field: raw bytes} of one low page (and high page if >= 0), every group."""
    payload = jax.device_get(_gather_pages(state, jnp.asarray([low], jnp.int32), jnp.asarray([high], jnp.int32)))
    return {(g, name): np.ascontiguousarray(a[:, 0]).view(np.uint8).tobytes()
            for g, grp in enumerate(payload) for name, a in grp.items() if high >= 0 or not name.startswith("high")}


def pages_bytes(state, entries, bucket=16):
    """`page_bytes` of many index entries in one gather."""
    low = np.full(bucket, -1, np.int32)
    high = np.full(bucket, -1, np.int32)
    low[:len(entries)] = [e.low for e in entries]
    high[:len(entries)] = [e.high for e in entries]
    payload = jax.device_get(_gather_pages(state, jnp.asarray(low), jnp.asarray(high)))
    return [{(g, name): np.ascontiguousarray(a[:, i]).view(np.uint8).tobytes()
             for g, grp in enumerate(payload) for name, a in grp.items()
             if e.high >= 0 or not name.startswith("high")} for i, e in enumerate(entries)]


def host_bytes(page):
    return {(g, name): np.ascontiguousarray(a).view(np.uint8).tobytes()
            for g, grp in enumerate(page.groups) for name, a in grp.items()}


def prefix_state(num_pages=8, num_high_pages=8, num_seqs=2, idle=(), seed=0):
    """An empty `poisoned_state` of the prefix-cache geometry (CFG, GROUPS, MAX_PAGES; scales 1, as `new_shadow`)
    with the slots not in ``idle`` admitted."""
    return poisoned_state(CFG, GROUPS, [], num_seqs=num_seqs, width=MAX_PAGES, num_pages=num_pages,
                          num_high_pages=num_high_pages, gs=1.0, high_scale=1.0, seed=seed, idle=idle)


def new_cache(num_pages=11, num_high_pages=13, host_capacity=None, seed=0):
    from jmixedkv.prefix import PrefixCache
    state = prefix_state(num_pages, num_high_pages, SLOTS, range(SLOTS), seed)
    return PrefixCache(state, host_capacity_pages=host_capacity)


def new_shadow():
    return init_state(CFG, GROUPS, SLOTS * MAX_PAGES, SLOTS, MAX_PAGES)


def tiny_llama(vocab_size: int = 256):
    """A random 2-layer bf16 Llama (4 / 2 heads, head_dim 16, sdpa), seeded: the transformers tests' model."""
    import torch
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def torch_of(x):
    """JAX / NumPy array -> CPU torch tensor (bf16 through its bits, FP8 as its E4M3 bytes); None stays None."""
    import torch
    if x is None:
        return None
    a = np.asarray(x)
    if a.dtype == jnp.bfloat16:
        return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16)
    if a.dtype == jnp.float8_e4m3fn:
        return torch.from_numpy(a.view(np.uint8).copy())
    return torch.from_numpy(a.copy())


def zero_decode_operands(d, page, *, tq, hq, batch=2, heads=2, twin="bf16"):
    """Zero operands of a cross-lowered decode call: ``(q, page_table, kv_lens, high_table, low, high)`` -- 2 layers,
    16 low / 8 twin pages, ``heads`` KV heads, ``batch`` rows of 12 pages, head_dim ``d``, pages of ``page``, ``tq`` x
    ``hq`` query rows; ``twin`` "bf16" / "fp16" (q in fp16 too) or None (``high`` None). `TwinGeometry(page, 5, 7,
    1, 3)` fits the tables."""
    L, P, kv = 2, 16, 2
    low = (jnp.zeros((L, P, kv, heads, page, d // 2), jnp.uint8),
           jnp.zeros((L, P, kv, heads, page, d // 16), jnp.float8_e4m3fn), jnp.ones((L, kv)))
    tdt = {"bf16": jnp.bfloat16, "fp16": jnp.float16}.get(twin)
    high = (jnp.zeros((L, 8, kv, heads, page, d), tdt), jnp.ones((L, kv))) if twin else None
    q = jnp.zeros((batch, tq, hq, d), jnp.float16 if twin == "fp16" else jnp.bfloat16)
    pt, lens, ht = jnp.zeros((batch, 12), jnp.int32), jnp.ones((batch,), jnp.int32), jnp.zeros((batch, 4), jnp.int32)
    return q, pt, lens, ht, low, high
