"""interop.hf_static: `JMixedStaticCache`, the compileable transformers Cache over torch-owned pools. On CPU with a
tiny random Llama: ``generate`` gives DynamicCache's tokens for a plain bf16 cache and an all-high mixed cache (left
padding, beam search, prompt-lookup decoding through ``crop``), a rotated all-high cache too (the lever is
transparent); a decode step traces as one graph with no break and compiles once for every later step; a mixed
cache with NVFP4 history matches the JAX reference read of the same pools; bad steps are refused loudly."""
import numpy as np
import pytest
import torch

import transformers
from transformers import DynamicCache
from transformers.generation.configuration_utils import CompileConfig

import jmixedkv as jm
from interop.hf import ATTN_IMPLEMENTATION, CACHE_KWARG
from interop.hf_static import JMixedStaticCache
from interop.static_cache import StaticPagedCache
from jmixedkv import KVCacheConfig

PAGE, MAX_LEN, BATCH, PROMPT, NEW = 8, 40, 6, 7, 6
ALL_HIGH = KVCacheConfig("mixed_nvfp4_bf16", first_n=24, last_n=24, page_size=PAGE, max_draft_len=4)
ALL_HIGH_ROT = ALL_HIGH.replace(rotation="hadamard")
BF16 = KVCacheConfig("bf16", page_size=PAGE, max_draft_len=4)
MIXED = KVCacheConfig("mixed_nvfp4_bf16", first_n=2, last_n=4, page_size=PAGE, max_draft_len=4,
                      rotation="hadamard", block_scale="4over6")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (2, PROMPT), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0                                       # row 1: 3 tokens of left padding
    return ids, mask


def _generate(model, ids, mask, cache, **kw):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                         **{CACHE_KWARG: cache}, return_dict_in_generate=True, output_scores=True, pad_token_id=0, **kw)
    return out.sequences, torch.stack(out.scores, 1).float()


def _static(model, kv, batch_size=BATCH):
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return JMixedStaticCache.for_model(model, kv, max_batch_size=batch_size, max_cache_len=MAX_LEN)


def _reference(model, ids, mask, **kw):
    model.set_attn_implementation("sdpa")
    return _generate(model, ids, mask, DynamicCache(config=model.config), **kw)


@pytest.mark.parametrize("kv", [BF16, ALL_HIGH, ALL_HIGH_ROT], ids=["bf16", "all_high", "all_high_rotated"])
def test_generate_gives_dynamic_cache_tokens_with_left_padding(model, batch, kv):
    ids, mask = batch
    want, want_scores = _reference(model, ids, mask)
    cache = _static(model, kv)
    got, scores = _generate(model, ids, mask, cache)
    assert torch.equal(got, want), (got.tolist(), want.tolist())
    assert torch.equal(scores[:, 0], want_scores[:, 0])          # the prefill attends densely: bit-identical
    finite = torch.isfinite(want_scores)                          # min_new_tokens masks EOS with -inf
    assert torch.equal(torch.isfinite(scores), finite)
    assert (scores - want_scores)[finite].abs().max() < 0.05      # decode: float32 over bf16 rows vs sdpa in bf16
    # padding is not stored: row 1 holds its 4 real prompt tokens + the decoded ones; transformers sees the padded
    # length through a device counter
    lens = cache.paged.kv_lens[:, :2].tolist()
    assert lens == [[PROMPT + NEW - 1, PROMPT - 3 + NEW - 1]] * 2
    assert int(cache.get_seq_length()) == PROMPT + NEW - 1
    assert cache.get_mask_sizes(1, 0) == (MAX_LEN, 0) and cache.is_compileable
    cache.reset()
    assert int(cache.get_seq_length()) == 0 and not cache.paged.kv_lens.any()


def test_mixed_cache_reads_what_the_jax_reference_reads(model, batch):
    """A mixed cache (NVFP4 history, rotation, 4over6): the logits of a decode step equal those of the same model
    whose attention reads the same pools through `jm.decode_attention(backend="reference")` (the JAX contract)."""
    ids, mask = batch
    cache = _static(model, MIXED)
    with torch.no_grad():
        model(ids, attention_mask=mask, **{CACHE_KWARG: cache}, position_ids=_positions(mask))
    paged = cache.paged
    q = torch.randn(2, 4, 1, 16, generator=torch.Generator().manual_seed(3)).bfloat16()
    k = torch.randn(2, 2, 1, 16, generator=torch.Generator().manual_seed(4)).bfloat16()
    pos = paged.kv_lens[0, :2].long()[:, None]
    lens, bad = paged.append(0, k, k, pos)
    got = paged.attend(0, q, lens, bad).float()
    import jax.numpy as jnp
    state = paged.as_cache_state(0)
    want, _ = jm.decode_attention(state, 0, jnp.asarray(q.transpose(1, 2).float().numpy(), jnp.bfloat16),
                                  jnp.arange(2), backend="reference")
    want = torch.from_numpy(np.array(want.astype(jnp.float32))[:2])
    assert lens.tolist() == [PROMPT + 1, PROMPT - 3 + 1]
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)       # two bf16 roundings of rotated q / out


def _positions(mask):
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


@pytest.mark.parametrize("kv", [ALL_HIGH, ALL_HIGH.replace(k_smoothing=True)], ids=["all_high", "k_smoothing"])
def test_decode_step_is_one_graph_compiled_once(model, batch, kv):
    """A decode step traces with fullgraph=True (no graph break: nothing syncs with the host) and later steps reuse
    the compiled graph: the cache's lengths and counters are device tensors, its hot path torch ops (the K means of
    ``k_smoothing`` too)."""
    ids, mask = batch
    want, _ = _reference(model, ids, mask)
    cache = _static(model, kv)
    torch._dynamo.reset()
    frames = []
    def backend(gm, example_inputs):                      # counts compilations, runs the graph eagerly
        frames.append(gm)
        return gm.forward
    config = CompileConfig(fullgraph=True, backend=backend, mode=None)
    config._compile_all_devices = True                     # transformers compiles on CPU only when asked
    got, _ = _generate(model, ids, mask, cache, compile_config=config)
    assert torch.equal(got, want), (got.tolist(), want.tolist())
    assert len(frames) == 1, f"{len(frames)} compilations for {NEW - 1} decode steps"
    ops = {str(n.target) for n in frames[0].graph.nodes if n.op == "call_function"}
    assert any("jmixedkv.paged_attention" in o for o in ops) and any("jmixedkv.write_rows_" in o for o in ops), ops
    assert not cache._plans                                # the step's plan does not outlive the forward
    torch._dynamo.reset()


def test_beam_search_and_prompt_lookup(model, batch):
    ids, mask = batch
    model.set_attn_implementation("sdpa")
    want = model.generate(ids, attention_mask=mask, max_new_tokens=5, num_beams=3, do_sample=False)
    cache = _static(model, BF16)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=5, num_beams=3, do_sample=False,
                         **{CACHE_KWARG: cache})
    assert torch.equal(got, want)
    one = ids[:1]
    model.set_attn_implementation("sdpa")
    want = model.generate(one, max_new_tokens=8, do_sample=False)
    cache = _static(model, ALL_HIGH, batch_size=1)
    crops = []
    orig = cache.crop
    cache.crop = lambda n: crops.append(n) or orig(n)
    got = model.generate(one, max_new_tokens=8, do_sample=False, **{CACHE_KWARG: cache}, prompt_lookup_num_tokens=3)
    assert torch.equal(got, want)
    assert any(n < 0 for n in crops), crops
    assert int(cache.paged.kv_lens[0, 0]) == int(cache.get_seq_length())


def test_bad_steps_refused_and_other_rows_unchanged(model, batch):
    ids, mask = batch
    cache = _static(model, MIXED)
    paged = cache.paged
    with torch.no_grad():
        model(ids, attention_mask=mask, **{CACHE_KWARG: cache}, position_ids=_positions(mask))
    before = [t.clone() for t in paged.groups[0].pools if t is not None]
    lens0 = paged.kv_lens.clone()
    k = torch.randn(2, 2, 1, 16).bfloat16()
    # row 0 continues; row 1 skips a position
    pos = torch.tensor([[PROMPT], [PROMPT - 3 + 1]])
    lens, bad = paged.append(1, k, k, pos)
    assert bad.tolist() == [False, True] and lens.tolist() == [PROMPT + 1, PROMPT - 3]
    out = paged.attend(1, torch.randn(2, 4, 1, 16).bfloat16(), lens, bad)
    assert torch.isnan(out[1]).all() and torch.isfinite(out[0]).all()
    assert paged.kv_lens[0].tolist() == lens0[0].tolist()                    # layer 0 untouched
    for old, new in zip(before, [t for t in paged.groups[0].pools if t is not None]):  # row 1's pages: unchanged
        rows = old.shape[1] // BATCH
        assert torch.equal(old[:, rows:2 * rows], new[:, rows:2 * rows])
    with pytest.raises(ValueError, match="ERR_BAD_POSITION|position"):
        cache.raise_errors()
    # past max_cache_len
    lens, bad = paged.append(1, k, k, torch.tensor([[MAX_LEN], [PROMPT - 3]]))
    assert bad.tolist() == [True, False]
    with pytest.raises(ValueError, match=f"max_cache_len={MAX_LEN}"):
        cache.raise_errors()
    with pytest.raises(ValueError, match="max_draft_len=4"):
        cache.crop(-5)
    # rewinds add up against the floor (max_draft_len behind the furthest written): 3 + 3 > 4 is refused
    lens0 = paged.kv_lens.clone()
    paged.rewind(3)
    assert torch.equal(paged.kv_lens[:, :2], lens0[:, :2] - 3) and not paged.kv_lens[:, 2:].any()
    paged.raise_errors()                                           # unused rows are not refusals
    paged.rewind(3)
    assert torch.equal(paged.kv_lens[:, :2], lens0[:, :2] - 3)     # refused: every row unchanged
    with pytest.raises(ValueError, match="ERR_BAD_CORRECTION|correction"):
        paged.raise_errors()
    with pytest.raises(ValueError, match="inference-only"):
        cache.reset()
        model(ids, attention_mask=mask, **{CACHE_KWARG: cache})


def test_construction_refusals(model):
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="attention to be 'jmixedkv'"):
        JMixedStaticCache.for_model(model, ALL_HIGH, max_batch_size=2, max_cache_len=16)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    with pytest.raises(ValueError, match="max_cache_len must be an integer >= 1, got 0"):
        JMixedStaticCache.for_model(model, ALL_HIGH, max_batch_size=2, max_cache_len=0)
    with pytest.raises(ValueError, match="global_scale must be finite"):
        JMixedStaticCache.for_model(model, ALL_HIGH, max_batch_size=2, max_cache_len=16, global_scale=0.0)


def test_triton_kernels_through_generate(model, batch):
    """The CUDA path's Triton kernels (write + paged attention), run in Triton's interpreter on CPU, inside a whole
    ``generate``: a mixed cache gives the torch implementation's tokens (and a prefill's pools bit for bit), an
    all-high one DynamicCache's tokens."""
    from interop import paged_ops
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()     # head_dim 32: the kernel's smallest
    ids, mask = batch
    want, _ = _reference(model, ids, mask)
    runs = {}
    for backend in ("torch", "triton"):
        with paged_ops.cpu_backend(backend):
            for name, kv in (("mixed", MIXED), ("all_high", ALL_HIGH)):
                cache = _static(model, kv)
                with torch.no_grad():                          # the prefill's writes: the same bits
                    model(ids, attention_mask=mask, **{CACHE_KWARG: cache}, position_ids=_positions(mask))
                pools = [None if t is None else t.clone() for t in cache.paged.groups[0].pools]
                runs[backend, name] = (_generate(model, ids, mask, _static(model, kv))[0], pools)
    assert torch.equal(runs["triton", "all_high"][0], want)
    assert torch.equal(runs["triton", "mixed"][0], runs["torch", "mixed"][0])
    for a, b in zip(runs["torch", "mixed"][1], runs["triton", "mixed"][1]):
        assert (a is None and b is None) or torch.equal(a, b)
    with pytest.raises(ValueError, match="cpu_backend"):
        with paged_ops.cpu_backend("cuda"):
            pass


def test_sliding_layers_hold_only_their_window():
    """Mistral with a 5-token window, page 4: every layer keeps a ring of ceil((5 + 2 + 1) / 4) + 1 = 3 pages per
    row, which wraps several times over 7 + 14 tokens; generate still gives DynamicCache's tokens (bf16 rows: the
    same bits), and the ring's rows read through JAX's reference with the window agree with the cache's attention."""
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=5)
    model = transformers.MistralForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, 256, (2, PROMPT), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    model.set_attn_implementation("sdpa")
    want = model.generate(ids, attention_mask=mask, max_new_tokens=14, min_new_tokens=14, do_sample=False,
                          **{CACHE_KWARG: DynamicCache(config=model.config)}, pad_token_id=0)
    for kv in (KVCacheConfig("bf16", page_size=4, max_draft_len=2),
               KVCacheConfig("mixed_nvfp4_bf16", first_n=2, last_n=4, page_size=4, max_draft_len=2)):
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        cache = JMixedStaticCache.for_model(model, kv, max_batch_size=2, max_cache_len=64)
        paged = cache.paged
        assert [g.window for g in paged.groups] == [5] and paged.groups[0].pages_per_row == 3
        assert paged.groups[0].page_table[1, :7].tolist() == [3, 4, 5, 3, 4, 5, 3]
        got = model.generate(ids, attention_mask=mask, max_new_tokens=14, min_new_tokens=14, do_sample=False,
                             **{CACHE_KWARG: cache}, pad_token_id=0)
        if kv.dtype == "bf16":
            assert torch.equal(got, want), (got.tolist(), want.tolist())
        full = StaticPagedCache(kv, 2, 2, 32, max_batch_size=2, max_cache_len=64)
        rows = paged.groups[0].pools.low_data if kv.has_low else paged.groups[0].pools.plain_rows
        assert rows.shape[1] == 2 * 3                              # 3 history pages per row instead of 16
        assert paged.nbytes < full.nbytes
        import jax.numpy as jnp
        q = torch.randn(2, 4, 1, 32, generator=torch.Generator().manual_seed(5)).bfloat16()
        lens = paged.kv_lens[1]
        out = paged.attend(1, q, lens, sliding_window=5).float()
        ref, _ = jm.decode_attention(paged.as_cache_state(1), 0, jnp.asarray(q.transpose(1, 2).float().numpy(),
                                     jnp.bfloat16), jnp.arange(2), sliding_window=5, backend="reference")
        torch.testing.assert_close(out, torch.from_numpy(np.array(ref.astype(jnp.float32))), rtol=2e-2, atol=2e-2)
        with pytest.raises(ValueError, match="holds a window of 5 tokens"):
            paged.attend(1, q, lens)


@pytest.mark.gpu
def test_generate_compiled_into_cuda_graphs():
    """On a GPU ``generate`` compiles the static cache's decode step (mode "reduce-overhead": CUDA graphs) with the
    Triton kernels inside: an all-high cache gives DynamicCache's tokens on a tiny model, and a SmolLM2-shaped
    model (30 layers, 9 / 3 heads, head_dim 64) runs with the recommended cache at batch 4 x 512."""
    dev = "cuda"
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    with torch.device(dev):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, 256, (2, PROMPT), generator=torch.Generator().manual_seed(1)).to(dev)
    mask = torch.ones_like(ids)
    want, _ = _reference(model, ids, mask)
    cache = _static(model, ALL_HIGH, batch_size=2)
    got, _ = _generate(model, ids, mask, cache)
    assert torch.equal(got, want), (got.tolist(), want.tolist())
    cache.raise_errors()
    big = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    with torch.device(dev):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**big)).to(torch.bfloat16).eval()
    ids = torch.randint(0, 49152, (4, 512), generator=torch.Generator().manual_seed(2)).to(dev)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    cache = JMixedStaticCache.for_model(model, KVCacheConfig.recommended(max_draft_len=4), max_batch_size=4,
                                       max_cache_len=512 + 32)
    out = model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0,
                         **{CACHE_KWARG: cache})
    cache.raise_errors()
    assert out.shape == (4, 544) and int(cache.get_seq_length()) == 543


def test_chunked_prefill_reads_the_cache(model, batch):
    """``prefill_chunk_size=3``: the first chunk attends densely, later chunks (Tq = 3 > 1) append and run the paged
    attention over the cache (causal inside the chunk); an all-high cache gives DynamicCache's tokens."""
    ids = batch[0]
    mask = torch.ones_like(ids)
    want, _ = _reference(model, ids, mask)
    cache = _static(model, ALL_HIGH)
    got, _ = _generate(model, ids, mask, cache, prefill_chunk_size=3)
    assert torch.equal(got, want), (got.tolist(), want.tolist())
    assert cache.paged.kv_lens[:, :2].tolist() == [[PROMPT + NEW - 1] * 2] * 2


def _pools(paged):
    return [t.clone() for grp in paged.groups for t in grp.pools if t is not None]


@pytest.mark.parametrize("kv", [MIXED, BF16], ids=["mixed", "bf16"])
def test_one_plan_per_step_writes_what_per_layer_plans_write(model, batch, kv):
    """An eager step (the prefill) plans its bookkeeping once per layer group and every layer appends with it: the
    pools, lengths and outputs are bitwise those of planning per layer; a second forward with the same
    position_ids tensor plans again."""
    ids, mask = batch
    pos = _positions(mask)
    runs = []
    for shared in (True, False):
        cache = _static(model, kv)
        calls = []
        orig = cache.paged.plan_step
        cache.paged.plan_step = lambda *a, **k: calls.append(a[0]) or orig(*a, **k)
        if not shared:
            cache._plan = lambda layer, p, b, paged=cache.paged: paged.plan_step(layer, p.reshape(-1, p.shape[-1]), b)
        with torch.no_grad():
            logits = model(ids, attention_mask=mask, **{CACHE_KWARG: cache}, position_ids=pos).logits
            step = model(ids[:, :1], **{CACHE_KWARG: cache}, position_ids=pos[:, -1:] + 1).logits
        runs.append((logits, step, _pools(cache.paged), cache.paged.kv_lens.clone(), calls))
    (l1, s1, p1, n1, c1), (l2, s2, p2, n2, c2) = runs
    assert c1 == [0, 0] and c2 == [0, 1, 0, 1]                    # one group, two layers, two forwards
    assert torch.equal(l1, l2) and torch.equal(s1, s2) and torch.equal(n1, n2)
    assert n1[:, :2].tolist() == [[PROMPT + 1, PROMPT - 3 + 1]] * 2
    assert all(torch.equal(a, b) for a, b in zip(p1, p2))


def test_plan_refuses_a_layer_out_of_step(model, batch):
    """A layer whose length is not the plan's is refused for that row (nothing written, its length kept, error
    bit); every other row and layer is bitwise unchanged; a plan of another shape or group raises."""
    ids, mask = batch
    cache = _static(model, MIXED)
    paged = cache.paged
    with torch.no_grad():
        model(ids, attention_mask=mask, **{CACHE_KWARG: cache}, position_ids=_positions(mask))
    paged.kv_lens[1, 1] -= 1                                       # layer 1, row 1 one token behind layer 0
    k = torch.randn(2, 2, 1, 16, generator=torch.Generator().manual_seed(5)).bfloat16()
    pos = paged.kv_lens[0, :2].long()[:, None]
    plan = paged.plan_step(0, pos, 2)
    paged.append(0, k, k, plan=plan)
    pools, lens_before = _pools(paged), paged.kv_lens.clone()
    lens, bad = paged.append(1, k, k, plan=plan)
    assert bad.tolist() == [False, True] and lens.tolist() == [PROMPT + 1, PROMPT - 3 - 1]
    assert paged.kv_lens[1, :2].tolist() == [PROMPT + 1, PROMPT - 3 - 1]
    assert torch.equal(paged.kv_lens[0], lens_before[0])
    rows = paged.groups[0].pools.low_data.shape[1] // BATCH
    for old, new in zip(pools, _pools(paged)):
        assert torch.equal(old[0], new[0])                         # layer 0: unchanged
        per = old.shape[1] // BATCH
        assert torch.equal(old[1, per:], new[1, per:])             # layer 1, rows 1..: unchanged
    assert not torch.equal(pools[0][1, :rows], _pools(paged)[0][1, :rows])   # layer 1, row 0: written
    with pytest.raises(ValueError, match="ERR_BAD_POSITION|position"):
        paged.raise_errors()
    with pytest.raises(ValueError, match="plan of group 0 for 2 rows x 1 tokens"):
        paged.append(1, k[:1], k[:1], plan=plan)
    other = StaticPagedCache(MIXED, 2, 2, 16, max_batch_size=BATCH, max_cache_len=MAX_LEN)
    with pytest.raises(ValueError, match="made by another StaticPagedCache"):
        other.append(1, k, k, plan=plan)
    assert not other.kv_lens.any()
    with pytest.raises(ValueError, match=r"positions \[2, 3\]; expected \[2 or 1, 1\]"):
        paged.append(1, k, k, torch.zeros(2, 3, dtype=torch.long))


def test_eager_calls_skip_the_dispatcher_with_the_ops_bits():
    """Eager calls of `paged_ops.write_rows` / `paged_attention` run the ops' bodies directly; the registered ops
    (what compiled code sees) give the same bits; traced code (a fake-tensor mode) goes through the ops."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from interop import paged_ops
    paged = StaticPagedCache(MIXED, 2, 2, 16, max_batch_size=2, max_cache_len=MAX_LEN)
    grp, index = paged.group_of(1)
    g = torch.Generator().manual_seed(7)
    k, v = (torch.randn(10, 2, 16, generator=g).bfloat16() for _ in range(2))
    low = torch.randperm(MAX_LEN // PAGE * PAGE, generator=g)[:10]
    high = torch.where(torch.arange(10) % 3 == 0, -1, torch.randperm(paged.high_table.numel() * PAGE, generator=g)[:10])
    pools = [None if t is None else t.clone() for t in grp.pools]
    paged_ops.write_rows(grp.pools, index, k, v, low, high, PAGE, MIXED.block_scale)
    direct = [None if t is None else t.clone() for t in grp.pools]
    grp.pools.low_data.copy_(pools[0]), grp.pools.low_scales.copy_(pools[1]), grp.pools.high_rows.copy_(pools[3])
    torch.ops.jmixedkv.write_rows_(*grp.pools, index, k, v, low, high, PAGE, MIXED.block_scale)
    assert not torch.equal(direct[0], pools[0]) and not torch.equal(direct[3], pools[3])
    assert all(a is None or torch.equal(a, b) for a, b in zip(direct, grp.pools))
    q = torch.randn(2, 1, 4, 16, generator=g).bfloat16()
    lens = torch.tensor([9, 33], dtype=torch.int32)
    geom = MIXED.twin
    args = (q, *grp.pools, index, grp.page_table[:2], paged.high_table[:2], lens,
            [geom.page, geom.first_n, geom.last_n, geom.num_fixed, geom.num_ring], 0.25, None, None)
    out, lse = paged_ops.paged_attention(grp.pools, index, q, grp.page_table[:2], paged.high_table[:2], lens, PAGE,
                                         geom, 0.25, None, None)
    out_op, lse_op = torch.ops.jmixedkv.paged_attention(*args)
    assert torch.equal(out, out_op) and torch.equal(lse, lse_op) and torch.isfinite(out).all()
    assert paged_ops._eager(q)
    with FakeTensorMode():
        assert not paged_ops._eager(torch.zeros(1))
