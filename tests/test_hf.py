"""interop.hf: `JMixedKVCache` as a transformers Cache. ``generate()`` with a random tiny ``LlamaConfig`` on CPU
gives the tokens of ``DynamicCache`` for a plain bf16 cache and an all-high mixed cache (left padding, beam
search through ``reorder_cache`` -> fork, prompt-lookup decoding through ``crop`` -> correct_kv_lens); a mixed
cache with NVFP4 history runs end to end, staged and fused; padding is not stored; bad uses raise."""
import numpy as np
import pytest
import torch

import transformers                     # in the test extra (pip install -e .[test])
from transformers import DynamicCache

from interop.hf import ATTN_IMPLEMENTATION, CACHE_KWARG, JMixedKVCache, tail_form, tail_limit
from jmixedkv import KVCacheConfig

PAGE, MAX_LEN, BATCH = 16, 32, 6           # one cache geometry for the whole file: jitted transitions compile once
PROMPT, NEW = 7, 6
ALL_HIGH = KVCacheConfig("mixed_nvfp4_bf16", first_n=16, last_n=16, page_size=PAGE, max_draft_len=4)
BF16 = KVCacheConfig("bf16", page_size=PAGE, max_draft_len=4)
MIXED = KVCacheConfig("mixed_nvfp4_bf16", first_n=2, last_n=4, page_size=PAGE, max_draft_len=4)


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


def _cache(model, kv, decode="stage"):
    return JMixedKVCache.for_model(model, kv, max_batch_size=BATCH, max_cache_len=MAX_LEN, decode=decode,
                                   backend="reference")


def _generate(model, ids, mask, cache, **kw):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, **{CACHE_KWARG: cache},
                         return_dict_in_generate=True, output_scores=True, **kw)
    return out.sequences, torch.stack(out.scores, 1).float()


def _set_attn(model, impl):
    model.set_attn_implementation(impl)


@pytest.mark.parametrize("kv", [BF16, ALL_HIGH], ids=["bf16", "all_high"])
def test_generate_equals_dynamic_cache_with_left_padding(model, batch, kv):
    ids, mask = batch
    want, want_scores = _generate(model, ids, mask, DynamicCache(config=model.config))
    cache = _cache(model, kv)
    got, scores = _generate(model, ids, mask, cache)
    assert torch.equal(got, want), (got.tolist(), want.tolist())
    assert torch.equal(scores, want_scores)                  # bit-identical logits
    # padding is not stored: row 1 holds its 4 real prompt tokens + the decoded ones (the last token's K/V is
    # never computed), the cache reports the padded length to transformers
    tkv = cache.cache
    assert [tkv.kv_len(int(s)) for s in cache.slots] == [PROMPT + NEW - 1, PROMPT - 3 + NEW - 1]
    assert cache.get_seq_length() == PROMPT + NEW - 1
    assert cache.get_mask_sizes(1, 0) == (PROMPT + NEW, 0)
    cache.reset()
    assert tkv.manager.free_slots() == list(range(BATCH)) and cache.get_seq_length() == 0


@pytest.mark.parametrize("decode", ["stage", "fused"])
def test_beam_search_reorders_by_fork(model, batch, decode):
    ids, mask = batch
    want = model.generate(ids, attention_mask=mask, max_new_tokens=5, num_beams=3, do_sample=False)
    _set_attn(model, ATTN_IMPLEMENTATION if decode == "fused" else "sdpa")
    try:
        cache = _cache(model, BF16, decode=decode)
        forks = []
        orig = cache.cache.fork
        cache.cache.fork = lambda *a, **k: forks.append(a) or orig(*a, **k)
        got = model.generate(ids, attention_mask=mask, max_new_tokens=5, num_beams=3, do_sample=False,
                             **{CACHE_KWARG: cache})
    finally:
        _set_attn(model, "sdpa")
    assert torch.equal(got, want)
    assert forks, "beam search never reordered the cache (no fork ran)"
    assert len(set(cache.slots.tolist())) == cache.slots.size == 6      # 2 rows x 3 beams, distinct slots


@pytest.mark.parametrize("decode", ["stage", "fused"])
def test_prompt_lookup_decoding_crops(model, batch, decode):
    ids = batch[0][:1]
    want = model.generate(ids, max_new_tokens=8, do_sample=False)
    _set_attn(model, ATTN_IMPLEMENTATION if decode == "fused" else "sdpa")
    try:
        cache = _cache(model, ALL_HIGH, decode=decode)
        crops = []
        orig = cache.crop
        cache.crop = lambda n: crops.append(n) or orig(n)
        got = model.generate(ids, max_new_tokens=8, do_sample=False, **{CACHE_KWARG: cache},
                             prompt_lookup_num_tokens=3)
    finally:
        _set_attn(model, "sdpa")
    assert torch.equal(got, want)
    assert any(n < 0 for n in crops), crops
    slot = int(cache.slots[0])
    assert cache.cache.kv_len(slot) == cache.get_seq_length()


def test_crop_rewinds_lengths_and_refuses_too_much(model, batch):
    ids, mask = batch
    cache = _cache(model, BF16)
    with pytest.raises(ValueError, match="inference-only"):
        model(ids, attention_mask=mask, **{CACHE_KWARG: cache})
    cache.reset()
    with torch.no_grad():
        model(ids, attention_mask=mask, **{CACHE_KWARG: cache})
    lens = [cache.cache.kv_len(int(s)) for s in cache.slots]
    cache.crop(0)
    cache.crop(-2)
    assert [cache.cache.kv_len(int(s)) for s in cache.slots] == [n - 2 for n in lens]
    assert cache.get_seq_length() == PROMPT - 2
    with pytest.raises(ValueError, match="max_draft_len=4"):
        cache.crop(-3)                                     # rewinds add up: 2 + 3 > 4 behind the furthest row
    with pytest.raises(ValueError, match="negative number"):
        cache.crop(3)
    assert [cache.cache.kv_len(int(s)) for s in cache.slots] == [n - 2 for n in lens]   # refusals changed nothing
    assert cache.get_seq_length() == PROMPT - 2
    cache.crop(-2)
    assert [cache.cache.kv_len(int(s)) for s in cache.slots] == [n - 4 for n in lens]


def test_mixed_cache_runs_staged_and_fused(model, batch):
    ids, mask = batch
    want, want_scores = _generate(model, ids, mask, DynamicCache(config=model.config))
    staged, staged_scores = _generate(model, ids, mask, _cache(model, MIXED))
    assert staged.shape == want.shape and torch.isfinite(staged_scores).all()
    assert torch.equal(staged[:, :PROMPT], ids)
    scale = float(want_scores.abs().max())
    # NVFP4 history moves the logits, not far: compare the steps whose context is the same in both runs
    k = _same_context_steps(staged, want)
    err = (staged_scores[:, :k] - want_scores[:, :k]).abs().max()
    assert 0 < err < 0.5 * scale
    _set_attn(model, ATTN_IMPLEMENTATION)
    try:
        fused, fused_scores = _generate(model, ids, mask, _cache(model, MIXED, decode="fused"))
        hi, hi_scores = _generate(model, ids, mask, _cache(model, ALL_HIGH, decode="fused"))
    finally:
        _set_attn(model, "sdpa")
    # fused decode (float32 attention on the cache) vs torch's attention on the staged cache: close
    k = _same_context_steps(fused, staged)
    assert k >= 2
    np.testing.assert_allclose(fused_scores[:, :k].numpy(), staged_scores[:, :k].numpy(), atol=0.05 * scale)
    k = _same_context_steps(hi, want)
    np.testing.assert_allclose(hi_scores[:, :k].numpy(), want_scores[:, :k].numpy(), atol=0.05 * scale)
    assert torch.equal(hi, want)


def _same_context_steps(a, b):
    """Number of generation steps whose inputs agree in both runs (up to and including the first differing
    token's step)."""
    diff = (a[:, PROMPT:] != b[:, PROMPT:]).any(0).nonzero()
    return NEW if diff.numel() == 0 else int(diff[0]) + 1


def test_fused_needs_the_jmixedkv_attention(model, batch):
    with pytest.raises(ValueError, match="attn_implementation='jmixedkv'"):
        _cache(model, MIXED, decode="fused")
    # built without the config check, a fused step whose attention ran on sdpa is caught at the next update
    tkv = _cache(model, MIXED).cache
    cache = JMixedKVCache(tkv, decode="fused")
    ids, mask = batch
    with pytest.raises(RuntimeError, match="did not run through attn_implementation='jmixedkv'"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, **{CACHE_KWARG: cache})
    with pytest.raises(ValueError, match="decode must be"):
        _cache(model, MIXED, decode="sometimes")


def test_right_padding_and_wrong_shapes_refused(model):
    cache = _cache(model, BF16)
    ids = torch.tensor([[5, 6, 7, 0], [1, 2, 3, 4]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    pos = torch.tensor([[0, 1, 2, 0], [0, 1, 2, 3]])                  # right padding
    with torch.no_grad(), pytest.raises(ValueError, match="right padding is not supported"):
        model(ids, attention_mask=mask, position_ids=pos, **{CACHE_KWARG: cache})
    small = JMixedKVCache.for_model(model, BF16, max_batch_size=1, max_cache_len=MAX_LEN, backend="reference")
    with torch.no_grad(), pytest.raises(Exception, match="free slots"):
        model(ids, **{CACHE_KWARG: small})
    other = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="layers, kv heads, head_dim"):
        JMixedKVCache(cache.cache, config=other)


def _pool_pointers(cache):
    import jax
    return [x.unsafe_buffer_pointer() for x in jax.tree.leaves(cache._tkv.state.pools)]


@pytest.mark.parametrize("kv", [BF16, MIXED], ids=["bf16", "mixed"])
def test_fused_steps_store_every_layer_in_one_program_in_place(model, batch, kv):
    """Fused steps' rows are held aside, a run of steps at a time, and stored in one program when the run is full
    (`tail_limit`: ``last_n`` = 4 rows for the mixed cache, `MAX_HELD_TOKENS` for bf16) or the cache is read
    (`JMixedKVCache.flush`): the pools keep their buffers (no torch view of them survives into the donated write,
    which would make JAX copy them), ``cache.cache`` shows every step stored, and holding a view across a write is
    what would copy."""
    ids = batch[0]
    mask = torch.ones_like(ids)
    _set_attn(model, ATTN_IMPLEMENTATION)
    steps = 6
    try:
        cache = _cache(model, kv, decode="fused")
        with torch.no_grad():
            out = model(ids, attention_mask=mask, **{CACHE_KWARG: cache})
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            first, runs = _pool_pointers(cache), []
            for i in range(steps):
                nxt = out.logits[:, -1:].argmax(-1)
                out = model(nxt, attention_mask=mask, **{CACHE_KWARG: cache})
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
                assert cache._step.held is cache._held is not None             # this step is still held aside
                runs.append((id(cache._held), cache._held.count))
            assert _pool_pointers(cache) == first
            # bf16: the prompt (7 rows, attending over itself) starts the run; mixed: runs of last_n = 4 rows
            want = ([(0, PROMPT + i + 1) for i in range(steps)] if kv is BF16
                    else [(0, 1), (0, 2), (0, 3), (0, 4), (1, 1), (1, 2)])
            ids_seen = {}
            assert [(ids_seen.setdefault(r, len(ids_seen)), n) for r, n in runs] == want
            assert [cache.cache.kv_len(int(s)) for s in cache.slots] == [PROMPT + steps] * 2
            assert cache._held is None                                         # `cache` flushed it
            assert _pool_pointers(cache) == first
            out = model(out.logits[:, -1:].argmax(-1), attention_mask=mask, **{CACHE_KWARG: cache})
            kept = cache._held.views.pools                                     # a view held across the write
            cache.flush()
            assert _pool_pointers(cache) != first and kept is not None
    finally:
        _set_attn(model, "sdpa")


NVFP4 = KVCacheConfig("nvfp4", page_size=PAGE, max_draft_len=4)
FP8 = KVCacheConfig("fp8", page_size=PAGE, max_draft_len=4)
MIXED_FP8 = KVCacheConfig("mixed_nvfp4_fp8", first_n=2, last_n=4, page_size=PAGE, max_draft_len=4)
FIRST_ONLY = KVCacheConfig("mixed_nvfp4_bf16", first_n=2, last_n=0, page_size=PAGE, max_draft_len=4)


def test_tail_limit_and_form_by_format():
    assert tail_limit(MIXED) == 4 and tail_limit(ALL_HIGH) == 16 and tail_limit(MIXED_FP8) == 4
    for cfg in (BF16, NVFP4, FP8, FIRST_ONLY):
        assert tail_limit(cfg) >= 1 << 20, cfg
    for cfg in (MIXED.replace(k_smoothing=True), KVCacheConfig("nvfp4", page_size=PAGE, compute_dtype="float32")):
        assert tail_limit(cfg) == 0, cfg
    forms = {BF16: None, MIXED: None, ALL_HIGH: None, NVFP4: "nvfp4", FIRST_ONLY: "nvfp4", FP8: "fp8",
             MIXED_FP8: "fp8"}
    for cfg, form in forms.items():
        assert tail_form(cfg) == form, cfg


def _forced_logits(model, cache, ids, steps):
    """Logits of a prefill of ``ids`` then ``steps`` decode steps of fixed tokens (teacher forcing: every cache
    sees the same context), and whether each decode step was held aside."""
    g = torch.Generator().manual_seed(3)
    nxt = torch.randint(0, 256, (ids.shape[0], steps), generator=g)
    mask = torch.ones_like(ids)
    outs, held = [], []
    with torch.no_grad():
        out = model(ids, attention_mask=mask, **{CACHE_KWARG: cache})
        outs.append(out.logits[:, -1].float())
        for i in range(steps):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            out = model(nxt[:, i:i + 1], attention_mask=mask, **{CACHE_KWARG: cache})
            outs.append(out.logits[:, -1].float())
            held.append(cache._step.held is not None)
        cache.flush()
    return torch.stack(outs, 1), held


HELD_CASES = [(kv, decode) for decode in ("fused", "stage") for kv in (NVFP4, FP8, MIXED_FP8, FIRST_ONLY)] + \
    [(MIXED, "stage"), (BF16, "stage"), (MIXED, "fused"), (BF16, "fused")]


@pytest.mark.parametrize("kv,decode", HELD_CASES, ids=[f"{kv.dtype}-{kv.first_n}-{kv.last_n}-{d}"
                                                       for kv, d in HELD_CASES])
def test_steps_held_aside_read_the_stored_rows(model, batch, kv, decode):
    """Every format holds a decode step aside (no JAX program while the layers run), in both modes: its own rows
    are read as they read once stored (`interop.paged_ops.round_trip`). Stage mode then gives the per-layer path's
    logits (append, then stage, per layer) bit for bit; fused mode matches its per-layer path (append, then the
    fused decode) up to float32 attention order and one rounding of those rows to bf16. The same step reading its
    rows as given (not through the codec) is much further off: the comparison tells them apart."""
    ids = batch[0]
    _set_attn(model, ATTN_IMPLEMENTATION if decode == "fused" else "sdpa")
    try:
        held_cache = _cache(model, kv, decode=decode)
        held, was_held = _forced_logits(model, held_cache, ids, 5)
        per_layer_cache = _cache(model, kv, decode=decode)
        per_layer_cache._tail_limit = 0                                 # the per-layer JAX path of the same format
        want, was = _forced_logits(model, per_layer_cache, ids, 5)
        raw_cache = _cache(model, kv, decode=decode)
        raw_cache._tail_form = None                                     # rows as given: what the round trip fixes
        raw, _ = _forced_logits(model, raw_cache, ids, 5)
    finally:
        _set_attn(model, "sdpa")
    assert all(was_held) and not any(was)
    scale = float(want.abs().max())
    err = float((held - want).abs().max())
    raw_err = float((raw[:, 1:] - want[:, 1:]).abs().max())
    if decode == "stage":
        assert err == 0, err
    assert err < 0.01 * scale, (err, scale)
    if tail_form(kv) is not None:
        assert raw_err > max(4 * err, 1e-3 * scale), (raw_err, err, scale)
    for layer in range(2):                                                    # the same rows were stored
        a = held_cache.cache.stage(layer, held_cache.slots).dense()
        b = per_layer_cache.cache.stage(layer, per_layer_cache.slots).dense()
        assert all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(a, b))


def test_kernel_keeps_the_steps_rows(batch):
    """Fused steps of a cache whose rows read as given (bf16 twin / pool, no rotation): the attention kernel reads
    the layer's new K / V from the model's tensors and keeps them in the run's buffer itself (no copy launch). Run
    in Triton's interpreter inside the model's forward passes, it gives the logits and stores the rows of the
    same kernel fed by a copy into the buffer first (`_Held.put`), bit for bit, and the torch path's logits up to
    float32 attention order. A kernel that did not keep them would read the buffer's unwritten rows (NaN here):
    the check can fail."""
    from interop import paged_ops
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()     # head_dim 32: the kernel's smallest
    ids = batch[0]
    _set_attn(model, ATTN_IMPLEMENTATION)
    try:
        runs = {}
        for backend, keeps in (("torch", True), ("triton", True), ("triton", False)):
            with paged_ops.cpu_backend(backend):
                cache = _cache(model, MIXED, decode="fused")
                assert cache._kernel_keeps
                cache._kernel_keeps = keeps
                logits, held = _forced_logits(model, cache, ids, 5)
                assert all(held)
                runs[backend, keeps] = (logits, [cache.cache.stage(i, cache.slots).dense() for i in range(2)])
    finally:
        _set_attn(model, "sdpa")
    (a, _), (b, kept), (c, copied) = runs["torch", True], runs["triton", True], runs["triton", False]
    assert torch.equal(b, c)
    for x, y in zip(kept, copied):
        assert all(torch.equal(p.view(torch.int16), q.view(torch.int16)) for p, q in zip(x, y))
    assert float((a - b).abs().max()) < 1e-2 * float(a.abs().max())
    _set_attn(model, ATTN_IMPLEMENTATION)
    broken = _cache(model, MIXED, decode="fused")
    broken._buffer(ids.shape[0])[0].fill_(float("nan"))
    import interop.hf as hf_mod
    real = hf_mod.paged_ops.step_attention

    def no_keep(*args, **kw):
        run = real(*args, **kw)
        return lambda *a, new_k=None, new_v=None, **k: run(*a, **k)        # drops the new rows: never kept
    hf_mod.paged_ops.step_attention = no_keep
    try:
        bad = _forced_logits(model, broken, ids, 5)[0]
    finally:
        hf_mod.paged_ops.step_attention = real
        _set_attn(model, "sdpa")
    assert torch.isfinite(bad[:, 0]).all() and not torch.isfinite(bad[:, 1:]).all()


def _staged(tkv, slots):
    tkv = tkv.cache
    return [torch.stack(tkv.stage(layer, torch.from_numpy(slots.astype(np.int64))).dense()).float()
            for layer in range(2)]


def test_a_pass_some_layer_never_reached_is_dropped_alone(model):
    """A run of held steps whose last pass reached layer 0 only: `flush` stores the passes before it (bitwise
    what a cache that never saw the broken pass holds), drops that pass's rows and raises `RuntimeError` naming
    layer 1; the cache then goes on from the stored passes."""
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(7))
    caches = [_cache(model, MIXED) for _ in range(2)]
    with torch.no_grad():
        for cache in caches:
            for i in range(3):                  # a prompt of 17 (stored), then 2 held decode steps
                t = 17 if i == 0 else 1
                lo = 0 if i == 0 else 16 + i
                model(ids[:, lo:lo + t], **{CACHE_KWARG: cache})
            assert cache._held is not None and cache._held.count == 2
        k = torch.randn((2, 2, 1, 16), generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
        caches[0].layers[0].update(k, k, {"position_ids": torch.tensor([[19], [19]])})       # layer 1 never runs
    with pytest.raises(RuntimeError, match=r"layers \[1\] of the last forward pass were never updated"):
        caches[0].flush()
    slots = caches[0].slots
    assert [caches[0].cache.kv_len(int(s)) for s in slots] == [19, 19]
    for got, want in zip(_staged(caches[0], slots), _staged(caches[1], caches[1].slots)):
        assert torch.equal(got, want)


def test_join_reserved_orders_tokens_row_by_row():
    from interop.torch_cache import ReservedStep, join_reserved
    one = ReservedStep(np.array([3, 5, 10, 20], np.int32), 0)                    # slots [3, 5], positions 10 / 20
    two = ReservedStep(np.array([3, 3, 5, 5, 11, 12, 21, 22], np.int32), 0)      # 2 tokens a row
    got = join_reserved([one, two], 2)
    assert got.tokens.tolist() == [3, 3, 3, 5, 5, 5, 10, 11, 12, 20, 21, 22] and got.group == 0
    assert join_reserved([one], 2) is one
    with pytest.raises(ValueError, match=r"\[batch=3, t\] grid of tokens; got groups \[0, 0\] with \[2, 4\]"):
        join_reserved([one, two], 3)
    with pytest.raises(ValueError, match=r"groups \[0, 1\]"):
        join_reserved([one, one._replace(group=1)], 2)
