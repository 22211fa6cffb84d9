"""interop.llama_torch: the torch Llama on the mixed cache gives the bf16-cache tokens (and bit-identical logits)
when every row is retained, and a finite, reported logit error when not; (gpu) the same on CUDA."""
import jax
import pytest
import torch

from interop.llama_torch import LlamaConfig, compare, default_prompts

CFG = LlamaConfig(num_layers=2, dim=64, ffn=128)
PROMPTS = default_prompts(CFG.vocab, lengths=(5, 11, 17))
STEPS = 6                                        # total length 23 -> 2 pages of 16


def test_all_high_equals_bf16_cache():
    r = compare(CFG, first_n=16, last_n=16, prompts=PROMPTS, steps=STEPS, backend="reference")
    assert r["all_high"] and r["total_len"] == 23
    assert r["tokens_equal"], (r["tokens"], r["base_tokens"])
    assert r["max_logit_err"] == 0.0


def test_mixed_reports_logit_error():
    r = compare(CFG, first_n=2, last_n=4, prompts=PROMPTS, steps=STEPS, backend="reference", decode="fused")
    assert not r["all_high"]
    assert 0.0 < r["max_logit_err"] < 5.0 and r["mean_logit_err"] < r["logit_scale"]
    assert 0.0 <= r["token_agreement"] <= 1.0 and len(r["tokens"]) == len(PROMPTS)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_gpu_all_high_equals_bf16_cache(backend):
    assert torch.cuda.is_available() and jax.default_backend() == "gpu"
    r = compare(CFG, first_n=16, last_n=16, prompts=PROMPTS, steps=STEPS, device="cuda", backend=backend)
    assert r["tokens_equal"] and r["max_logit_err"] == 0.0
    m = compare(CFG, first_n=2, last_n=4, prompts=PROMPTS, steps=STEPS, device="cuda", backend=backend,
                decode="fused")
    assert 0.0 < m["max_logit_err"] < 5.0


@pytest.mark.gpu
def test_gpu_module_main_runs():
    from interop.llama_torch import main
    assert main(["--device", "cuda", "--steps", "8"]) == 0
