"""interop.llama_torch: transformers' LlamaForCausalLM on the mixed cache gives the DynamicCache tokens (and
bit-identical teacher-forced logits) when every row is retained, and a finite, reported logit error when not;
(gpu) the same on CUDA."""
import jax
import pytest
import torch

from interop.llama_torch import build_model, compare, default_prompts, tiny_config

CFG = tiny_config(hidden=64, ffn=128)
PROMPTS = default_prompts(CFG.vocab_size, lengths=(5, 11, 17))
STEPS = 6                                        # total length 23 -> 2 pages of 16


@pytest.fixture(scope="module")
def model():
    return build_model(CFG)


def test_all_high_equals_dynamic_cache(model):
    r = compare(CFG, first_n=16, last_n=16, prompts=PROMPTS, steps=STEPS, backend="reference", model=model)
    assert r["all_high"] and r["total_len"] == 23
    assert r["tokens_equal"], (r["tokens"], r["base_tokens"])
    assert r["max_logit_err"] == 0.0


def test_mixed_reports_logit_error(model):
    r = compare(CFG, first_n=2, last_n=4, prompts=PROMPTS, steps=STEPS, backend="reference", decode="fused",
                model=model)
    assert not r["all_high"]
    assert 0.0 < r["max_logit_err"] < 5.0 and r["mean_logit_err"] < r["logit_scale"]
    assert 0.0 <= r["token_agreement"] <= 1.0 and len(r["tokens"]) == len(PROMPTS)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_gpu_all_high_equals_dynamic_cache(backend):
    assert torch.cuda.is_available() and jax.default_backend() == "gpu"
    model = build_model(CFG, "cuda")
    r = compare(CFG, first_n=16, last_n=16, prompts=PROMPTS, steps=STEPS, device="cuda", backend=backend,
                model=model)
    assert r["tokens_equal"] and r["max_logit_err"] == 0.0
    m = compare(CFG, first_n=2, last_n=4, prompts=PROMPTS, steps=STEPS, device="cuda", backend=backend,
                decode="fused", model=model)
    assert 0.0 < m["max_logit_err"] < 5.0


@pytest.mark.gpu
def test_gpu_module_main_runs():
    from interop.llama_torch import main
    assert main(["--device", "cuda", "--steps", "8"]) == 0
