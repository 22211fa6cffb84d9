"""PyTorch side of jmixedkv: zero-copy DLPack bridges, a torch-facing cache, a transformers Cache, layout exports.

* `interop.dlpack`: `to_torch`, `from_torch` (zero-copy, pointer-checked, stream-safe), `nvfp4_to_torch`.
* `interop.torch_cache`: `TorchKVCache` (append / stage / gather_rows / decode_attention / accept / fork from
  torch; per-call ``sync=`` / ``validate=``), `lse_to_base2` / `lse_from_base2` (our LSE is natural-log,
  FlashInfer's base 2), and the reads as ``torch.ops.jmixedkv.decode_attention`` / ``stage_dense`` custom ops.
* `interop.hf` (needs ``transformers``; import it explicitly): `JMixedKVCache`, a ``transformers.Cache`` for
  ``model.generate(..., past_key_values=...)``, and the ``attn_implementation="jmixedkv"`` attention function.
* `interop.static_cache`: `StaticPagedCache`, the torch-native hot path (torch-owned pools, the custom ops of
  `interop.paged_ops`: Triton kernels on CUDA, capturable in CUDA graphs); `interop.hf_static.JMixedStaticCache`
  is its compileable transformers ``Cache``.
* `interop.layouts`: FlashInfer CSR page tables, vLLM block tables and slot mappings, NHD/HND page views, NVFP4
  pages in FlashInfer's paged NVFP4 layout.
* `interop.llama_torch`: transformers' ``LlamaForCausalLM`` (tiny, random) on the cache vs ``DynamicCache``
  (``python -m interop.llama_torch``).
"""
from .dlpack import ZeroCopyError, from_torch, nvfp4_to_torch, same_buffer, to_torch
from .torch_cache import TorchKVCache, TorchStaged, lse_from_base2, lse_to_base2
from .static_cache import StaticPagedCache
from . import layouts

__all__ = ["to_torch", "from_torch", "same_buffer", "nvfp4_to_torch", "ZeroCopyError", "TorchKVCache", "TorchStaged",
           "StaticPagedCache", "lse_to_base2", "lse_from_base2", "layouts"]
