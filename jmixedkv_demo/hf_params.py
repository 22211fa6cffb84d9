"""Parameter count of a Hugging Face ``config.json`` from transformers' own model, built on the meta device (no
weights allocated): exact for every architecture transformers knows (mixture-of-experts, MLA, tied embeddings,
biases), where `jmixedkv.capacity.dense_params` only knows dense Llama-style decoders. Needs ``torch`` and
``transformers`` (the ``hf`` extra); without them, or for a ``model_type`` transformers does not know, the count is
None and the reason says why.
"""
from __future__ import annotations

from typing import Optional

__all__ = ["count_parameters"]


def count_parameters(config: dict) -> tuple[Optional[int], str]:
    """``(parameters, how)`` of ``AutoModelForCausalLM.from_config(config)`` on the meta device; ``(None, why)``
    when transformers cannot build it."""
    try:
        import torch
        import transformers
    except ImportError:
        return None, "transformers / torch not installed (pip install 'jmixedkv[hf]')"
    model_type = config.get("model_type")
    if not model_type:
        return None, "the config.json has no model_type"
    try:
        hf_config = transformers.AutoConfig.for_model(**config)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(hf_config)
    except (ValueError, KeyError, TypeError, AttributeError, ImportError) as e:
        return None, f"transformers cannot build model_type {model_type!r} ({type(e).__name__}: {e})"
    return int(model.num_parameters()), f"transformers {transformers.__version__}, meta-device {type(model).__name__}"
