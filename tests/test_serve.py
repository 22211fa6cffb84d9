"""The continuous-batching serving loop (`jmixedkv_demo.serve`) on a tiny model, on CPU.

* tokens: the loop's greedy tokens for requests of mixed prompt / output lengths, served concurrently with
  queueing, equal a one-request-at-a-time `jmixedkv_demo.model.generate` (bf16 cache) and, for an all-high mixed
  cache (the twin serves every row), the loop's bf16-cache tokens;
* admission: a uniform workload's peak concurrency is exactly what the pages allow (pool // pages per request)
  even with more slots; every page is back in the pool at the end; the allocated pools fit the budget;
* refusals before anything runs: a request that can never fit (named by its lengths), bad tokens; a device error
  bit is raised as `CacheError`, never ignored;
* K smoothing (the cache holds the means): tokens equal `generate`'s; with prefix reuse the owner's means are
  carried (tokens equal the run without reuse);
* EOS: sequences end at their first EOS (kept), the rest of the tokens unchanged, pages returned;
* one compiled program per bucket: every program traced once across loops of the same config and pools;
* bfloat16 weights: tokens equal `generate` with the same weights, all-high equals bf16, one decode program whose
  projections are bf16 x bf16 -> float32 products with no weight converted; the CLI's ``--weights-dtype``;
* the pure helpers (chunking, pool plan vs capacity arithmetic, the shipped length distribution) and the CLI.
"""
from __future__ import annotations

import dataclasses
import functools
import json

import jax
import numpy as np
import pytest

from jmixedkv import capacity as cap
from jmixedkv.checks import CacheCapacityError, CacheError
from jmixedkv.config import KVCacheConfig
from jmixedkv_demo import serve as sv
from jmixedkv_demo.cli import main
from jmixedkv_demo.model import ModelConfig, generate, init_params

CFG = ModelConfig.tiny()
PAGE, CHUNK = 8, 16
BF16 = KVCacheConfig("bf16", page_size=PAGE)
ALL_HIGH = KVCacheConfig("mixed_nvfp4_bf16", first_n=0, last_n=48, page_size=PAGE)   # every row of <= 48 tokens
#: (prompt, max_new): mixed lengths; prompts are multiples of CHUNK (one prefill program)
LENGTHS = [(16, 6), (32, 10), (16, 3), (32, 7), (16, 10), (32, 1)]
MAX_LEN = 48
BUDGET = 12 * PAGE * 512 + 1024     # 12 bf16 pages (512 B per token) and room for the per-layer scales


@functools.lru_cache(maxsize=None)
def params():
    return init_params(CFG)


@functools.lru_cache(maxsize=None)
def weights():
    return sv.prepare_weights(params(), CFG)


def requests(lengths=LENGTHS, seed=0):
    rng = np.random.default_rng(seed)
    return [sv.Request(rng.integers(0, CFG.vocab_size, p).astype(np.int32), n) for p, n in lengths]


@functools.lru_cache(maxsize=None)
def plan(cache_cfg=BF16, budget=BUDGET):
    """bf16: 512 B per token, so 12 pages; slot_len 8 gives 12 slots: pages, not slots, bound admission."""
    return sv.plan_pools(cache_cfg, CFG, budget, slot_len=8, max_len=MAX_LEN)


def loop(cache_cfg=BF16, budget=BUDGET, **kw):
    return sv.ServingLoop(weights(), CFG, cache_cfg, plan(cache_cfg, budget), max_chunk=CHUNK, **kw)


@functools.lru_cache(maxsize=None)
def served(cache_cfg=BF16, budget=BUDGET, eos_id=None):
    return loop(cache_cfg, budget, eos_id=eos_id).run(requests())


def test_tokens_equal_generate_and_all_high_equals_bf16():
    res = served()
    reqs = requests()
    assert [len(o) for o in res.outputs] == [n for _, n in LENGTHS]
    for p in sorted({len(r.prompt) for r in reqs}):          # one generate program per prompt length
        idx = [i for i, r in enumerate(reqs) if len(r.prompt) == p]
        for i in idx:                                         # one request at a time, as a lone sequence
            want = generate(params(), reqs[i].prompt[None], CFG, BF16, max(n for _, n in LENGTHS)).tokens
            np.testing.assert_array_equal(res.outputs[i], np.asarray(want[0, :reqs[i].max_new]))
    s = res.stats
    assert 1 < s["peak_concurrent"] < len(reqs)               # batched and queued
    assert s["free_pages_end"] == s["num_pages"] == 12
    assert s["output_tokens"] == sum(n for _, n in LENGTHS) and s["prefill_tokens"] == sum(p for p, _ in LENGTHS)
    high = served(ALL_HIGH, 256 * 1024)
    for a, b in zip(high.outputs, res.outputs):
        np.testing.assert_array_equal(a, b)
    assert high.stats["free_pages_end"] == high.stats["num_pages"]


def test_admission_is_bound_by_pages_and_releases_them():
    """16 + 6 - 1 = 21 cached tokens = 3 pages each; a pool of 12 pages admits 4 at once, with 12 slots."""
    lp = loop()
    res = lp.run(requests([(16, 6)] * 7, seed=1))
    s = res.stats
    assert (s["max_seqs"], s["num_pages"]) == (12, 12)
    assert s["peak_concurrent"] == 12 // 3
    assert s["free_pages_end"] == 12 and lp.manager.free_slots() == list(range(12))
    assert s["pool_bytes"] == lp.plan.pool_bytes <= s["budget_bytes"]      # the live pools, as planned
    assert lp.traces == {"decode": 1, f"prefill {CHUNK}": 1}  # the loops of this file share the programs


def test_eos_releases_at_the_first_eos():
    base = served().outputs
    eos = int(base[1][3])                                     # a token inside request 1's output
    res = served(eos_id=eos)
    for got, full in zip(res.outputs, base):
        hits = np.flatnonzero(full == eos)
        want = full[:hits[0] + 1] if hits.size else full
        np.testing.assert_array_equal(got, want)
    assert len(res.outputs[1]) <= 4
    assert res.stats["free_pages_end"] == res.stats["num_pages"]


def test_requests_that_can_never_fit_are_refused_before_anything_runs():
    lp = loop()
    before = dict(lp.traces)
    with pytest.raises(CacheCapacityError, match=r"request 1: a prompt of 40 tokens \+ 10 new tokens \(49 tokens"):
        lp.run(requests([(16, 6), (40, 10)]))
    bad = requests([(16, 6)])
    bad[0].prompt[3] = CFG.vocab_size
    with pytest.raises(ValueError, match=r"request 0: prompt token ids must lie in \[0, 256\)"):
        lp.run(bad)
    with pytest.raises(ValueError, match="request 0: max_new must be an integer >= 1, got 0"):
        lp.run([sv.Request(np.zeros(4, np.int32), 0)])
    assert lp.manager.free_pages == 12 and lp.manager.free_slots() == list(range(12)) and lp.traces == before
    with pytest.raises(CacheCapacityError, match="holds no sequence of 8 tokens"):
        sv.plan_pools(BF16, CFG, 100, slot_len=8, max_len=MAX_LEN)


def test_a_device_error_is_raised_not_ignored():
    lp = loop()
    lp.manager.install(dataclasses.replace(lp.manager.state, error=lp.manager.state.error | 1))   # committed
    with pytest.raises(CacheError, match="prefill of slot 0: cache state error 1"):
        lp.run(requests([(16, 2)]))


def test_k_smoothing_serves_the_tokens_of_generate():
    """The cache holds each sequence's K mean (frozen from its first prefill chunk: one-chunk prompts here, as
    `generate`'s one-call prefill)."""
    smooth = BF16.replace(k_smoothing=True)
    lengths = [(16, 5), (16, 3), (16, 6)]
    reqs = requests(lengths, seed=3)
    res = loop(smooth).run(reqs)
    for i, r in enumerate(reqs):
        want = generate(params(), r.prompt[None], CFG, smooth, r.max_new).tokens
        np.testing.assert_array_equal(res.outputs[i], np.asarray(want[0]))


def test_bad_chunk_is_refused():
    with pytest.raises(ValueError, match="max_chunk a power of two"):
        sv.ServingLoop(weights(), CFG, BF16, plan(), max_chunk=24)


def test_prefill_chunks():
    assert sv.prefill_chunks(5000, 2048) == [2048, 2048, 512, 256, 128, 8]
    assert sv.prefill_chunks(4096, 2048) == [2048, 2048]
    assert sv.prefill_chunks(1, 64) == [1] and sv.prefill_chunks(63, 64) == [32, 16, 8, 4, 2, 1]
    for n in range(1, 200):
        assert sum(sv.prefill_chunks(n, 32)) == n
    with pytest.raises(ValueError, match="max_chunk a power of two"):
        sv.prefill_chunks(10, 48)


@pytest.mark.parametrize("cfg", [BF16, KVCacheConfig("fp8", page_size=PAGE),
                                 KVCacheConfig("mixed_nvfp4_bf16", first_n=4, last_n=16, page_size=PAGE)])
def test_plan_fits_the_budget_and_follows_capacity(cfg):
    budget, slot_len = 300_000, 100
    p = sv.plan_pools(cfg, CFG, budget, slot_len=slot_len, max_len=MAX_LEN)
    # independent arithmetic: rows of L * 2 (K, V) * H heads of D elements
    rows = CFG.num_layers * 2 * CFG.num_kv_heads
    low = {"bf16": 2 * 32, "fp8": 32, "mixed_nvfp4_bf16": 16 + 2}[cfg.dtype] * rows          # bytes per token
    twin = cfg.num_high_pages_per_seq * PAGE * rows * 2 * 32 if cfg.is_mixed else 0
    per_seq = -(-slot_len // PAGE) * PAGE * low + twin
    assert p.max_seqs == budget // per_seq
    assert p.num_pages * PAGE * low + p.max_seqs * twin <= budget
    assert p.pool_bytes <= budget and p.pool_bytes >= p.num_pages * PAGE * low + p.max_seqs * twin
    assert p.max_pages_per_seq == MAX_LEN // PAGE


def test_shipped_lengths_and_sampling():
    prompts, outputs = sv.load_lengths()
    assert prompts.shape == outputs.shape == (512,)
    assert prompts.min() == 4096 and prompts.max() == 32768 and 8000 < np.median(prompts) < 16000
    assert outputs.min() == 64 and outputs.max() == 512
    a = sv.sample_requests(20, 100, seed=3, prompt_range=(8192, 16384), prompt_multiple=1024)
    b = sv.sample_requests(20, 100, seed=3, prompt_range=(8192, 16384), prompt_multiple=1024)
    assert all(np.array_equal(x.prompt, y.prompt) and x.max_new == y.max_new for x, y in zip(a, b))
    lens = np.array([len(r.prompt) for r in a])
    assert lens.min() >= 8192 and lens.max() <= 16384 and not (lens % 1024).any() and len(set(lens)) > 1
    assert all(0 <= r.prompt.min() and r.prompt.max() < 100 and 64 <= r.max_new <= 512 for r in a)


def test_cli_serve(tmp_path, capsys):
    out = tmp_path / "serve.json"
    rc = main(["serve", "--model", "tiny", "--cache", "bf16", "--requests", "3", "--prompt-range", "16:16",
               "--output-scale", "0.03", "--max-chunk", "16", "--kv-budget", "48KiB", "--json", str(out),
               "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "peak seqs" in text and "json:" in text
    doc = json.loads(out.read_text())
    r = doc["results"][0]
    assert r["label"] == "bf16" and r["requests"] == 3 and r["free_pages_end"] == r["num_pages"]
    assert r["pool_bytes"] <= doc["kv_budget_bytes"] == 48 * 1024
    assert doc["prompt_tokens"] == [16, 16, 16]


def test_cli_serve_shared_prefix(tmp_path, capsys):
    out = tmp_path / "serve.json"
    argv = ["serve", "--model", "tiny", "--cache", "bf16", "--requests", "3", "--prompt-range", "32:32",
            "--output-scale", "0.03", "--max-chunk", "16", "--kv-budget", "48KiB", "--shared-prefix", "16",
            "--json", str(out), "--no-progress"]
    assert main(argv) == 0
    assert "prefix reuse on" in capsys.readouterr().out
    r = json.loads(out.read_text())["results"][0]
    assert (r["reused_tokens"], r["prefill_tokens"]) == (2 * 16, 3 * 32 - 2 * 16)
    assert r["free_pages_end"] == r["num_pages"]
    assert main(argv + ["--no-prefix-reuse"]) == 0
    r = json.loads(out.read_text())["results"][0]
    assert (r["reused_tokens"], r["prefill_tokens"]) == (0, 3 * 32)
    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", "tiny", "--shared-prefix", "-1"])
    assert e.value.code == 2 and "--shared-prefix: expected an integer >= 0, got -1" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--cache", ""], "--cache ''"),
    (["--max-chunk", "24"], "--max-chunk 24: expected a power of two"),
    (["--prompt-range", "9:3"], "--prompt-range '9:3'"),
    (["--kv-budget", "1KiB"], "holds no sequence"),
])
def test_cli_serve_refusals(argv, message, capsys):
    assert main(["serve", "--model", "tiny", "--no-progress"] + argv) == 2
    assert message in capsys.readouterr().err


def test_capacity_helpers_agree_with_plan():
    """The plan's slots are `jmixedkv.capacity.capacity`'s sequences at slot_len."""
    shape = cap.ModelShape(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim)
    c = cap.capacity(ALL_HIGH, 256 * 1024, shape, 8)
    assert plan(ALL_HIGH, 256 * 1024).max_seqs == c.sequences


def test_serve_bench_settings():
    """bench/serve_bench.py imports; its H200 workload is 8k-32k prompts in whole prefill chunks at 40 GiB."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import serve_bench
    s = serve_bench.SERVE
    assert s["model"] == "llama3-8b-shape" and cap.parse_bytes(s["kv_budget"]) == 40 * 2 ** 30
    assert s["prompt_range"] == (8192, 32768) and all(x % s["prompt_multiple"] == 0 for x in s["prompt_range"])
    assert s["prompt_multiple"] % s["max_chunk"] == 0                      # one prefill program per cache
    assert s["weights_dtype"] == "bfloat16"                                # as a serving engine runs the model
    m = sv.MODELS[s["model"]]
    assert (m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim) == (32, 32, 8, 128)


# ---------------------------------------------------------------------------------------------- prefix reuse
SHARED = CHUNK          # a shared prefix of one whole chunk: the chunk boundaries of a reusing request stay aligned
MIXED = KVCacheConfig("mixed_nvfp4_bf16", first_n=8, last_n=16, page_size=PAGE)


def shared_requests(lengths, seed=2):
    """Requests whose prompts all start with the same ``SHARED`` tokens (`sv.sample_requests`' construction)."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, CFG.vocab_size, SHARED)
    return [sv.Request(np.concatenate([shared, rng.integers(0, CFG.vocab_size, p - SHARED)]).astype(np.int32), n)
            for p, n in lengths]


@pytest.mark.parametrize("cache_cfg, budget", [(BF16, BUDGET), (MIXED, 256 * 1024)])
def test_prefix_reuse_skips_the_shared_prefill_and_keeps_the_tokens(cache_cfg, budget):
    """With reuse every request after the first admits the shared pages by reference: the prefill drops by the
    shared tokens per request, the tokens equal the run without reuse, and every page is back at the end."""
    reqs = shared_requests([(32, 6), (32, 10), (48, 1), (32, 7), (40, 9), (32, 1)])
    base = loop(cache_cfg, budget).run(reqs)
    lp = loop(cache_cfg, budget, prefix_reuse=True)
    high = lp.manager.free_high_pages
    res = lp.run(reqs)
    for a, b in zip(res.outputs, base.outputs):
        np.testing.assert_array_equal(a, b)
    s = res.stats
    assert s["reused_tokens"] == (len(reqs) - 1) * SHARED
    assert s["prefill_tokens"] == base.stats["prefill_tokens"] - (len(reqs) - 1) * SHARED
    assert s["free_pages_end"] == s["num_pages"] and lp.manager.free_high_pages == high
    assert not lp.prefix.index and lp.manager.free_slots() == list(range(lp.plan.max_seqs))
    assert set(lp.traces.values()) == {1}


@pytest.mark.parametrize("cache_cfg, budget", [(BF16, BUDGET), (MIXED, 256 * 1024)])
def test_prefix_reuse_carries_the_k_means(cache_cfg, budget):
    """K smoothing with reuse: a request reusing the shared chunk takes its owner's means, which are those its own
    first chunk (the same shared tokens) would have frozen, so the tokens equal the run without reuse."""
    smooth = cache_cfg.replace(k_smoothing=True)
    reqs = shared_requests([(32, 6), (32, 10), (48, 1), (32, 7)], seed=5)
    base = loop(smooth, budget).run(reqs)
    lp = loop(smooth, budget, prefix_reuse=True)
    res = lp.run(reqs)
    assert res.stats["reused_tokens"] == (len(reqs) - 1) * SHARED
    for a, b in zip(res.outputs, base.outputs):
        np.testing.assert_array_equal(a, b)
    assert not lp.prefix.index and not lp.prefix.means


def test_prefix_reuse_counts_shared_pages_once():
    """32-token prompts sharing 16 tokens, 40 cached tokens = 5 pages each, 12 pages: without reuse 2 run at once;
    with reuse the first holds 5 pages and each other 3 of its own (2 shared, counted once): 5 + 3 + 3 <= 12."""
    reqs = shared_requests([(32, 9)] * 6)
    assert loop().run(reqs).stats["peak_concurrent"] == 2
    s = loop(prefix_reuse=True).run(reqs).stats
    assert s["peak_concurrent"] == 3
    assert s["evicted_pages"] > 0 and s["free_pages_end"] == s["num_pages"] == 12


def test_prefix_reuse_recomputes_the_last_n_window():
    """last_n = 12: a 28-token prompt after a committed 16-token shared prefix may match 2 pages (16 tokens, 12
    left), but the rest would prefill as chunks [8, 4], whose first does not cover the Last-N window; reuse shrinks
    by a page to 8 tokens (rest 20 = [16, 4]). Tokens equal the run without reuse."""
    cfg = KVCacheConfig("mixed_nvfp4_bf16", first_n=8, last_n=12, page_size=PAGE)
    lp = loop(cfg, 256 * 1024, prefix_reuse=True)
    reqs = shared_requests([(40, 2), (28, 2)])
    assert lp.prefix is not None and sv.prefill_chunks(28 - 16, CHUNK) == [8, 4]
    res = lp.run(reqs)
    assert res.stats["reused_tokens"] == 8 and res.stats["prefill_tokens"] == 40 + 20
    base = loop(cfg, 256 * 1024).run(reqs)
    for a, b in zip(res.outputs, base.outputs):
        np.testing.assert_array_equal(a, b)


def test_sample_requests_shared_prefix():
    a = sv.sample_requests(8, 100, seed=4, prompt_scale=1 / 512, shared_prefix=20)
    assert all(len(r.prompt) >= 21 for r in a)
    assert all(np.array_equal(r.prompt[:20], a[0].prompt[:20]) for r in a)
    assert len({r.prompt[20:].tobytes() for r in a}) == len(a)
    plain = sv.sample_requests(8, 100, seed=4, prompt_scale=1 / 512)      # shared_prefix=0: the workload as before
    again = sv.sample_requests(8, 100, seed=4, prompt_scale=1 / 512, shared_prefix=0)
    assert all(np.array_equal(x.prompt, y.prompt) for x, y in zip(plain, again))
    with pytest.raises(ValueError, match="shared_prefix must be >= 0, got -1"):
        sv.sample_requests(2, 100, shared_prefix=-1)


def test_prefix_cache_compile_changes_nothing():
    """`PrefixCache.compile` (the loop's warm-up of the index's page programs) leaves the state bitwise equal."""
    import jax
    from jmixedkv.prefix import PrefixCache
    lp = loop(MIXED, 256 * 1024)
    slot = lp.manager.admit()
    before = [np.asarray(x).copy() for x in jax.tree.leaves(lp.manager.state)]
    pc = PrefixCache(lp.manager.state)
    pc.compile(lp.plan.num_pages)
    after = jax.tree.leaves(pc.state)
    assert len(after) == len(before) and all(np.array_equal(a, np.asarray(b)) for a, b in zip(before, after))
    assert pc.manager.kv_len(slot) == 0 and pc.manager.free_slots() == list(range(1, lp.plan.max_seqs))


# ---------------------------------------------------------------------------------------------- bfloat16 weights
@functools.lru_cache(maxsize=None)
def bf16_weights():
    return sv.random_weights(CFG, "bfloat16")


@functools.lru_cache(maxsize=None)
def served_bf16_weights(cache_cfg=BF16, budget=BUDGET):
    lp = sv.ServingLoop(bf16_weights(), CFG, cache_cfg, plan(cache_cfg, budget), max_chunk=CHUNK)
    return lp.run(requests()), lp


def test_bf16_weights_serve_the_tokens_of_generate_and_all_high_equals_bf16():
    """bf16 weights through the loop: each request's tokens equal a lone `generate` with the same bf16 weights,
    and an all-high mixed cache's tokens equal the bf16 cache's; the stats carry the weights' dtype and bytes
    (float32 norm scales: 4 bytes each, every weight matrix 2 bytes per element)."""
    import jax
    res, lp = served_bf16_weights()
    p16 = init_params(CFG, "bfloat16")
    reqs = requests()
    for i in (0, 1):                                                # prompts of 16 and of 32 tokens
        want = generate(p16, reqs[i].prompt[None], CFG, BF16, reqs[i].max_new).tokens
        np.testing.assert_array_equal(res.outputs[i], np.asarray(want[0]))
    high, _ = served_bf16_weights(ALL_HIGH, 256 * 1024)
    for a, b in zip(high.outputs, res.outputs):
        np.testing.assert_array_equal(a, b)
    s = res.stats
    c = CFG
    matrices = (c.num_layers * (c.d_model * c.head_dim * 2 * (c.num_heads + c.num_kv_heads) + 3 * c.d_model * c.ffn_dim)
                + 2 * c.vocab_size * c.d_model)
    norms = (2 * c.num_layers + 1) * c.d_model
    assert s["weights_dtype"] == "bfloat16" and s["weight_bytes"] == 2 * matrices + 4 * norms
    assert sv.weight_bytes(weights()) == 4 * (matrices + norms) == sum(x.nbytes for x in jax.tree.leaves(params()))
    assert s["free_pages_end"] == s["num_pages"]


def test_bf16_weight_decode_step_compiles_once_with_bf16_products():
    """Two loops with bf16 weights share one decode and one prefill program (counted apart from the float32
    weights' programs); the decode step's StableHLO multiplies bf16 x bf16 into float32 for every projection
    (q, k, v, o, gate, up, down in the layer scan, and the output head) and converts no weight to float32."""
    import re
    import jax
    import jax.numpy as jnp
    served_bf16_weights()
    lp = sv.ServingLoop(bf16_weights(), CFG, BF16, plan(), max_chunk=CHUNK)
    lp.run(requests([(16, 3), (32, 4)], seed=5))
    assert lp.traces == {"decode": 1, f"prefill {CHUNK}": 1}
    s = lp.plan.max_seqs
    i32 = jax.ShapeDtypeStruct((s,), jnp.int32)
    text = sv.decode_step.lower(bf16_weights(), lp.manager.state, i32, i32, jax.ShapeDtypeStruct((s,), jnp.bool_),
                                model_cfg=CFG, attention="auto").as_text()
    assert lp.traces == {"decode": 1, f"prefill {CHUNK}": 1}          # lowering again hit the jit cache
    dots = re.findall(r"stablehlo.dot_general .*: \(tensor<([0-9x]+)x(\w+)>, tensor<([0-9x]+)x(\w+)>\) -> "
                      r"tensor<[0-9x]+x(\w+)>", text)
    proj = [d for d in dots if d[1] == "bf16"]
    assert len(proj) == 8 and all(d[3] == "bf16" and d[4] == "f32" for d in proj), dots
    shapes = {"x".join(map(str, x.shape[k:])) for x in jax.tree.leaves(bf16_weights()) for k in range(x.ndim - 1)}
    converts = re.findall(r"stablehlo.convert %\S+ : \(tensor<([0-9x]+)xbf16>\)", text)
    assert converts and not [c for c in converts if re.sub(r"^(1x)+", "", c) in shapes], converts


@pytest.mark.gpu
def test_bf16_weights_stay_bf16_in_the_compiled_gpu_decode_step():
    """On a GPU the compiled decode step holds no float32 copy of a weight matrix (no convert to a weight's
    shape): its projections run as bf16 GEMMs."""
    import re
    import jax
    import jax.numpy as jnp
    lp = sv.ServingLoop(bf16_weights(), CFG, BF16, plan(), max_chunk=CHUNK)
    s = lp.plan.max_seqs
    i32 = jax.ShapeDtypeStruct((s,), jnp.int32)
    hlo = sv.decode_step.lower(bf16_weights(), lp.manager.state, i32, i32, jax.ShapeDtypeStruct((s,), jnp.bool_),
                               model_cfg=CFG, attention="auto").compile().as_text()
    shapes = {",".join(map(str, x.shape[k:])) for x in jax.tree.leaves(bf16_weights()) if x.ndim >= 2
              for k in range(x.ndim - 1)}
    up = [m for m in re.findall(r"= f32\[([0-9,]+)\]\S* convert\(", hlo) if m in shapes]
    assert not up, up


def test_cli_serve_weights_dtype(tmp_path, capsys):
    """--weights-dtype: random weights default to bfloat16; the JSON and the header carry the dtype and bytes."""
    out = tmp_path / "serve.json"
    argv = ["serve", "--model", "tiny", "--cache", "bf16", "--requests", "2", "--prompt-range", "16:16",
            "--output-scale", "0.02", "--max-chunk", "16", "--kv-budget", "48KiB", "--json", str(out),
            "--no-progress"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["weights_dtype"] == "bfloat16" and doc["results"][0]["weights_dtype"] == "bfloat16"
    assert "bfloat16, 706.50 KiB" in text and doc["weight_bytes"] == sv.weight_bytes(bf16_weights())
    r = doc["results"][0]
    assert r["weight_bytes"] == doc["weight_bytes"]
    assert main(argv + ["--weights-dtype", "float32"]) == 0
    doc = json.loads(out.read_text())
    assert doc["weights_dtype"] == "float32" and doc["weight_bytes"] == sv.weight_bytes(weights())
    with pytest.raises(SystemExit) as e:
        main(argv + ["--weights-dtype", "float16"])
    assert e.value.code == 2 and "invalid choice: 'float16'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="weights_dtype must be one of .* got 'fp16'"):
        sv.load_serve_model("tiny", "fp16")


@pytest.mark.parametrize("cache_cfg", [BF16, MIXED], ids=["bf16", "mixed"])
def test_programs_update_the_pools_in_place(cache_cfg):
    """The loop's compiled decode step and prefill chunk alias every pool byte to their outputs (donated and
    written in place), and admit / release hand the pool arrays back untouched: no program copies a pool."""
    lp = loop(cache_cfg)
    pools = jax.tree.leaves(lp.manager.state.pools)
    pool_bytes = sum(x.nbytes for x in pools)
    for kind, n in (("decode", 1), ("prefill", CHUNK)):
        m = lp._program(kind, n).memory_analysis()
        assert m.alias_size_in_bytes >= pool_bytes, (kind, m.alias_size_in_bytes, pool_bytes)
    slot = lp.manager.admit()
    lp.manager.release(slot)
    assert all(a is b for a, b in zip(jax.tree.leaves(lp.manager.state.pools), pools, strict=True))
