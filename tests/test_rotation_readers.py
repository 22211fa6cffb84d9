"""Every reader applies the cache's own levers: with ``rotation="hadamard"`` (stored K/V are ``x Hd``) a reader still
means what it means without it.

* All-high bf16 caches (first_n + last_n cover every row), rotated or not: `decode_attention` (both backends, Tq 1
  and 2), `stage`, `gather_rows` (+ `overlay_retained_rows`), `TorchKVCache.decode_attention` / ``.stage`` and
  `interop.hf.JMixedKVCache` (``decode="stage"`` and ``"fused"``) equal the unquantized float32 attention / the
  written rows within the bounds derived below; without rotation the rows are bit-exact.
* ``as_stored=True`` gives the rows as stored (``bf16(x Hd)``) and names the rotation; un-rotating them gives the
  default (model-space) rows.
* A mixed cache (NVFP4 history): rotated and unrotated outputs both stay close to the unquantized attention.
* K smoothing (the cache stores ``k - mean`` and holds the mean): output and LSE are the unsmoothed ones;
  ``soft_cap`` on such a cache is refused.

Bounds (bf16 unit roundoff ``u = 2^-8``). A row ``x`` stored as ``bf16(x Hd)`` and read back in model space is
``x + e Hd`` rounded once more, ``|e_i| <= u |(x Hd)_i|``, so ``|err_i| <= u (1.01 ||x||_2 + |x_i|)`` (`_row_bound`).
Attention: each logit moves by at most ``Delta = 2.01 u sm_scale ||q|| max ||k||`` (rounded rotated q and rotated
keys), so the softmax weights move by a factor within ``exp(+-2 Delta)``; the values move by ``<= 1.01 u ||v||`` and
the output is rounded twice (rotated, then model space): ``|err| <= (exp(2 Delta) - 1 + 3.1 u) max ||v||``
(`_attn_bound`); the LSE moves by at most ``Delta``. These worst cases are loose (rounding errors do not all align);
what is measured is tighter and asserted too (`_typical`): output within ``4 u max|out|`` per head, LSE within
``2 u max(|lse|, 1)`` -- a few bf16 roundings at the output's own scale (the unrotated all-high cache: ``u``).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmixedkv import GroupSpec, KVCacheConfig, admit, append, init_state, levers, stage, gather_rows
from jmixedkv.decode import attention_reference, decode_attention, paged_attention_reference
from jmixedkv.gather import overlay_retained_rows

from helpers import tiny_llama

U = 2.0 ** -8                                       # bf16 unit roundoff
PAGE, D, H, HQ, MAX_PAGES = 4, 32, 2, 4, 4
LENS = (11, 6)
SEQ = jnp.arange(len(LENS), dtype=jnp.int32)
IDX = jnp.array([[0, 3, 10, -1, 7], [5, 1, -1, 2, 0]], jnp.int32)
CASES = [(None, "reference"), ("hadamard", "reference"), ("hadamard", "pallas")]
case_ids = [f"{r}-{b}" for r, b in CASES]


def _config(rotation, first_n=16, last_n=16, **kw):
    return KVCacheConfig("mixed_nvfp4_bf16", first_n=first_n, last_n=last_n, page_size=PAGE, max_draft_len=1,
                         rotation=rotation, **kw)


def _rows(seed, n):
    """bf16 ``k, v [n, H, D]``: K with an outlier channel (what the rotation is for)."""
    key = jax.random.PRNGKey(seed)
    k = jax.random.normal(jax.random.fold_in(key, 0), (n, H, D)) * (1.0 + 7.0 * (jnp.arange(D) == 3))
    v = jax.random.normal(jax.random.fold_in(key, 1), (n, H, D))
    return k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)


def _written():
    return [_rows(10 + b, n) for b, n in enumerate(LENS)]


@functools.lru_cache(maxsize=None)
def _state(cfg):
    """A cache holding `_written` (the cache itself shifts K by the per-sequence mean when ``cfg.k_smoothing``)."""
    s = init_state(cfg, GroupSpec(num_layers=1, num_kv_heads=H, head_dim=D), num_pages=8, max_seqs=len(LENS),
                   max_pages_per_seq=MAX_PAGES)
    for b, (k, v) in enumerate(_written()):
        s = admit(s, b)
        n = k.shape[0]
        s = append(s, 0, k, v, jnp.full((n,), b, jnp.int32), jnp.arange(n, dtype=jnp.int32), backend="reference")
    assert int(s.error) == 0
    return s


def _dense(i):
    """Written K (i=0) or V (i=1) as a dense float32 ``[B, H, S, D]`` cache (zeros past each length)."""
    out = np.zeros((len(LENS), H, MAX_PAGES * PAGE, D), np.float32)
    for b, rows in enumerate(_written()):
        out[b, :, :LENS[b]] = np.swapaxes(np.asarray(rows[i], np.float32), 0, 1)
    return jnp.asarray(out)


def _queries(tq, seed=5):
    return jax.random.normal(jax.random.PRNGKey(seed), (len(LENS), tq, HQ, D)).astype(jnp.bfloat16)


def _unquantized(q):
    """float32 attention over the written bf16 K/V: what every all-high reader must give."""
    return attention_reference(q, _dense(0), _dense(1), jnp.array(LENS))


def _row_bound(x):
    x = np.asarray(x, np.float64)
    return U * (1.01 * np.linalg.norm(x, axis=-1, keepdims=True) + np.abs(x)) + 1e-6


def _attn_bound(q, key_err_factor=2.01):
    """(out bound [B, Tq, Hq, 1], lse bound [B, Tq, Hq]) of the module docstring."""
    qn = np.linalg.norm(np.asarray(q, np.float64), axis=-1)                        # [B, Tq, Hq]
    kmax = np.linalg.norm(np.asarray(_dense(0), np.float64), axis=-1).max(-1)       # [B, H]
    vmax = np.linalg.norm(np.asarray(_dense(1), np.float64), axis=-1).max(-1)
    g = HQ // H
    kmax, vmax = np.repeat(kmax, g, 1)[:, None], np.repeat(vmax, g, 1)[:, None]     # [B, 1, Hq]
    delta = key_err_factor * U * D ** -0.5 * qn * kmax
    return ((np.expm1(2 * delta) + 3.1 * U) * vmax)[..., None] + 1e-6, delta + 1e-5


def _typical(out, lse, want, want_lse, what):
    """The measured regime (module docstring): a few bf16 roundings at the output's own scale."""
    want = np.asarray(want, np.float64)
    _close(out, want, 4 * U * np.abs(want).max(-1, keepdims=True) + 1e-6, f"{what} (typical)")
    _close(lse, want_lse, 2 * U * np.maximum(np.abs(np.asarray(want_lse, np.float64)), 1.0), f"{what} lse (typical)")


def _close(got, want, bound, what):
    err = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    assert np.all(err <= bound), f"{what}: max error {err.max():.3g} over bound by up to {(err / bound).max():.3g}x"


# ------------------------------------------------------------------------------------------------- decode_attention
@pytest.mark.parametrize("rotation,backend", CASES, ids=case_ids)
def test_decode_attention_all_high_equals_unquantized(rotation, backend):
    s = _state(_config(rotation))
    for tq in ((1, 2) if backend == "reference" else (1,)):
        q = _queries(tq)
        out, lse = decode_attention(s, 0, q, SEQ, backend=backend)
        want, want_lse = _unquantized(q)
        assert out.dtype == jnp.bfloat16 and out.shape == q.shape
        out_bound, lse_bound = _attn_bound(q)
        _close(out, want, out_bound, f"decode_attention out ({rotation}, {backend}, Tq={tq})")
        _close(lse, want_lse, lse_bound, f"decode_attention lse ({rotation}, {backend}, Tq={tq})")
        _typical(out, lse, want, want_lse, f"decode_attention ({rotation}, {backend}, Tq={tq})")
        if rotation is None:        # exact rows: only the output's rounding to bf16
            _close(out, want, U * np.abs(np.asarray(want)) + 1e-6, "unrotated decode_attention")
            np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-6, atol=1e-6)


def test_decode_attention_rotation_in_one_program():
    """The rotation lives inside the traced program: under an outer jit the result is the eager one, and a padding
    row (-1) still gives zeros and LSE -inf."""
    s = _state(_config("hadamard"))
    q = _queries(1)
    seq = jnp.array([1, -1], jnp.int32)
    eager = decode_attention(s, 0, q, seq, backend="reference")
    jitted = jax.jit(lambda st, q_, s_: decode_attention(st, 0, q_, s_, backend="reference"))(s, q, seq)
    for a, b in zip(eager, jitted):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert not np.asarray(eager[0][1], np.float32).any() and np.all(np.asarray(eager[1][1]) == -np.inf)


# ------------------------------------------------------------------------------------------------- stage / gather
def _staged_rows(st):
    """Staged K/V as float64 ``[B, 2, H, S, D]``."""
    return np.asarray(st.to_dense(), np.float64)


@pytest.mark.parametrize("rotation,backend", CASES, ids=case_ids)
def test_stage_returns_model_space_rows(rotation, backend):
    s = _state(_config(rotation))
    st = stage(s, 0, SEQ, backend=backend)
    assert st.rotation is None and st.pages.dtype == jnp.bfloat16
    got = _staged_rows(st)[..., :MAX_PAGES * PAGE, :]
    for i in (0, 1):
        want = np.asarray(_dense(i))
        if rotation is None:
            np.testing.assert_array_equal(got[:, i], want)
        else:
            _close(got[:, i], want, _row_bound(want), f"stage ({backend}) kv={i}")
    # a generic attention over the staged pages, with the model's own q, is the model's attention
    q = _queries(1)
    out, lse = paged_attention_reference(q, st)
    want, want_lse = _unquantized(q)
    out_bound, lse_bound = _attn_bound(q)
    _close(out, want, out_bound, "attention over staged pages")
    _close(lse, want_lse, lse_bound, "lse over staged pages")
    _typical(out, lse, want, want_lse, "attention over staged pages")


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_stage_as_stored_names_the_rotation(backend):
    s = _state(_config("hadamard"))
    st = stage(s, 0, SEQ, backend=backend, as_stored=True)
    assert st.rotation == "hadamard"
    got = np.asarray(st.to_dense())
    for i in (0, 1):                  # exactly the stored rows: bf16(x Hd)
        want = np.asarray(levers.rotate(_dense(i), "hadamard").astype(jnp.bfloat16), np.float32)
        np.testing.assert_array_equal(got[:, i], want)
    model = stage(s, 0, SEQ, backend=backend)
    np.testing.assert_array_equal(np.asarray(levers.unrotate(st.pages, st.rotation), np.float32),
                                  np.asarray(model.pages, np.float32))
    # as_stored on an unrotated cache changes nothing
    plain = _state(_config(None))
    a, b = stage(plain, 0, SEQ, backend=backend, as_stored=True), stage(plain, 0, SEQ, backend=backend)
    assert a.rotation is None
    np.testing.assert_array_equal(np.asarray(a.pages, np.float32), np.asarray(b.pages, np.float32))


def _selected(i):
    """Written rows at `IDX` (zeros at -1): float64 ``[B, K, H, D]``."""
    dense = np.asarray(_dense(i), np.float64)                     # [B, H, S, D]
    out = np.stack([dense[b][:, np.maximum(IDX[b], 0)].swapaxes(0, 1) for b in range(len(LENS))])
    return np.where(np.asarray(IDX)[..., None, None] >= 0, out, 0.0)


@pytest.mark.parametrize("rotation,backend", CASES, ids=case_ids)
def test_gather_rows_returns_model_space_rows(rotation, backend):
    s = _state(_config(rotation))
    rows, scale = gather_rows(s, 0, SEQ, IDX, backend=backend)
    assert rows.dtype == jnp.bfloat16 and np.all(np.asarray(scale) == 1.0)
    got = np.asarray(rows, np.float64)
    for i in (0, 1):
        want = _selected(i)
        if rotation is None:
            np.testing.assert_array_equal(got[:, :, i], want)
        else:
            _close(got[:, :, i], want, _row_bound(want), f"gather_rows ({backend}) kv={i}")
    # the twin overlaid later (model space on both sides) gives the same rows
    low, _ = gather_rows(s, 0, SEQ, IDX, backend=backend, overlay=False)
    over = overlay_retained_rows(s, 0, low, SEQ, IDX, backend=backend)
    np.testing.assert_allclose(np.asarray(over, np.float32), np.asarray(rows, np.float32), rtol=U, atol=1e-6)
    if rotation is None:              # unrotated FP8 scratch: the NVFP4-ceiling rule (tests/test_gather.py)
        return
    # rotated FP8 scratch: a power-of-two scale covering the model-space rows, rows within E4M3 rounding (2^-4)
    fp8, fscale = gather_rows(s, 0, SEQ, IDX, backend=backend, scratch_dtype="fp8")
    assert fp8.dtype == jnp.float8_e4m3fn
    dec = np.asarray(fp8, np.float64) * np.asarray(fscale, np.float64)[:, None, None, None, None]
    mag = np.abs(got).max(axis=(1, 2, 3, 4))
    assert np.all(np.asarray(fscale) * 448 >= mag) and np.all(np.log2(np.asarray(fscale)) % 1 == 0)
    np.testing.assert_array_less(np.abs(dec - got), 2.0 ** -4 * np.abs(got) + 2.0 ** -9 * np.asarray(fscale)[
        :, None, None, None, None] + 1e-9)


def test_gather_rows_as_stored():
    s = _state(_config("hadamard"))
    rows, _ = gather_rows(s, 0, SEQ, IDX, backend="reference", as_stored=True)
    for i in (0, 1):
        want = np.asarray(levers.rotate(jnp.asarray(_selected(i), jnp.float32), "hadamard").astype(jnp.bfloat16),
                          np.float32)
        np.testing.assert_array_equal(np.asarray(rows[:, :, i], np.float32), want)
    low, _ = gather_rows(s, 0, SEQ, IDX, backend="reference", overlay=False, as_stored=True)
    over = overlay_retained_rows(s, 0, low, SEQ, IDX, backend="reference", as_stored=True)
    np.testing.assert_array_equal(np.asarray(over, np.float32), np.asarray(rows, np.float32))


# ------------------------------------------------------------------------------------------------- mixed cache
@pytest.mark.parametrize("rotation", [None, "hadamard"])
def test_mixed_cache_stays_close_to_unquantized(rotation):
    """NVFP4 history (first 2 / last 3 rows high): both bases give attention near the unquantized one (the
    rotation must not move it into another space: without un-rotation the error would be O(1))."""
    s = _state(_config(rotation, first_n=2, last_n=3))
    q = _queries(1)
    want, want_lse = _unquantized(q)
    for backend in ("reference",):
        out, lse = decode_attention(s, 0, q, SEQ, backend=backend)
        rel = float(jnp.linalg.norm(out.astype(jnp.float32) - want) / jnp.linalg.norm(want))
        assert rel < 0.15, (rotation, rel)
        assert float(jnp.max(jnp.abs(lse - want_lse))) < 0.5
    st = _staged_rows(stage(s, 0, SEQ, backend="reference"))
    for i in (0, 1):
        want_rows = np.asarray(_dense(i))
        rel = np.linalg.norm(st[:, i, :, :MAX_PAGES * PAGE] - want_rows) / np.linalg.norm(want_rows)
        assert rel < 0.15, (rotation, i, rel)


# ------------------------------------------------------------------------------------------------- K smoothing
@pytest.mark.parametrize("rotation", [None, "hadamard"])
def test_k_smoothing_output_and_lse_unchanged(rotation):
    cfg = _config(rotation, k_smoothing=True)
    s = _state(cfg)
    q = _queries(2)
    out, lse = decode_attention(s, 0, q, SEQ, backend="reference")
    want, want_lse = _unquantized(q)
    out_bound, lse_bound = _attn_bound(q, key_err_factor=3.1)      # + the bf16 rounding of k - mean
    _close(out, want, out_bound, "k-smoothed output")
    _close(lse, want_lse, lse_bound, "k-smoothed lse")
    _typical(out, lse, want, want_lse, "k-smoothed")
    with pytest.raises(ValueError, match="soft_cap=30.0 on a cache with k_smoothing=True"):
        decode_attention(s, 0, q, SEQ, soft_cap=30.0, backend="reference")


# ------------------------------------------------------------------------------------------------- interop
@pytest.mark.parametrize("rotation", [None, "hadamard"])
def test_torch_cache_readers(rotation):
    import torch
    from interop.torch_cache import TorchKVCache
    tkv = TorchKVCache(_config(rotation), 1, H, D, num_pages=8, max_seqs=len(LENS), max_pages_per_seq=MAX_PAGES,
                       backend="reference")
    for b, (k, v) in enumerate(_written()):
        assert tkv.admit(b) == b
        n = k.shape[0]
        tkv.append(0, torch.tensor(np.asarray(k, np.float32)).bfloat16(), torch.tensor(np.asarray(v, np.float32))
                   .bfloat16(), torch.full((n,), b, dtype=torch.int32), torch.arange(n, dtype=torch.int32))
    seq = torch.arange(len(LENS), dtype=torch.int32)
    q = _queries(1)
    out, lse = tkv.decode_attention(0, torch.tensor(np.asarray(q, np.float32)).bfloat16(), seq)
    want, want_lse = _unquantized(q)
    out_bound, lse_bound = _attn_bound(q)
    out, lse = out.float().numpy(), lse.float().numpy()
    _close(out, want, out_bound, "TorchKVCache.decode_attention")
    _close(lse, want_lse, lse_bound, "TorchKVCache.decode_attention lse")
    _typical(out, lse, want, want_lse, "TorchKVCache.decode_attention")
    kd, vd = tkv.stage(0, seq).dense()                                              # [B, H, S, D]
    for got, i in ((kd, 0), (vd, 1)):
        want_rows = np.asarray(_dense(i))
        got = got.float().numpy()[:, :, :MAX_PAGES * PAGE]
        if rotation is None:
            np.testing.assert_array_equal(got, want_rows)
        else:
            _close(got, want_rows, _row_bound(want_rows), f"TorchKVCache.stage kv={i}")


HF_PROMPT, HF_NEW, HF_PAGE, HF_LEN = 7, 6, 16, 32


@functools.lru_cache(maxsize=None)
def _hf_model():
    import torch                                   # the test extra installs torch and transformers
    model = tiny_llama(256)
    ids = torch.randint(0, 256, (2, HF_PROMPT), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0                                       # row 1: 3 tokens of left padding
    return model, ids, mask


def _hf_generate(model, ids, mask, cache):
    import torch
    out = model.generate(ids, attention_mask=mask, max_new_tokens=HF_NEW, do_sample=False, cache=cache,
                         return_dict_in_generate=True, output_scores=True)
    return out.sequences, torch.stack(out.scores, 1).float()


@pytest.mark.parametrize("decode", ["stage", "fused"])
def test_hf_all_high_rotated_cache_gives_dynamic_cache_logits(decode):
    """`interop.hf.JMixedKVCache` over an all-high bf16 cache with ``rotation="hadamard"``: the tokens of
    ``DynamicCache`` and logits within bf16 rounding of its (the unrotated all-high cache is bit-identical,
    tests/test_hf.py): max |diff| <= 4 u max|logit| (measured: 2^-8 at max |logit| 0.64; without the readers'
    un-rotation 0.76 and other tokens)."""
    from transformers import DynamicCache
    from interop.hf import ATTN_IMPLEMENTATION, JMixedKVCache
    model, ids, mask = _hf_model()
    want, want_scores = _hf_generate(model, ids, mask, DynamicCache(config=model.config))
    kv = KVCacheConfig("mixed_nvfp4_bf16", first_n=HF_LEN, last_n=HF_LEN, page_size=HF_PAGE, max_draft_len=4,
                       rotation="hadamard")
    if decode == "fused":
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        cache = JMixedKVCache.for_model(model, kv, max_batch_size=2, max_cache_len=HF_LEN, decode=decode,
                                        backend="reference")
        got, scores = _hf_generate(model, ids, mask, cache)
    finally:
        model.set_attn_implementation("sdpa")
    assert got.tolist() == want.tolist()
    err = float((scores - want_scores).abs().max())
    scale = float(want_scores.abs().max())
    assert err <= 4 * U * scale, (err, scale)
