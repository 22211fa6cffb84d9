"""PyTorch side of jmixedkv: zero-copy DLPack bridges, a torch-facing cache, and layout exports.

* `interop.dlpack`: `to_torch`, `from_torch` (zero-copy, pointer-checked, stream-safe), `nvfp4_to_torch`.
* `interop.torch_cache`: `TorchKVCache` (append / stage / gather_rows / decode_attention / accept from torch),
  and the read calls as ``torch.ops.jmixedkv.decode_attention`` / ``stage_dense`` custom ops.
* `interop.layouts`: FlashInfer CSR page tables, vLLM block tables and slot mappings, NHD/HND page views, NVFP4
  pages in FlashInfer's paged NVFP4 layout.
* `interop.llama_torch`: a tiny Llama-style torch decoder using the cache (``python -m interop.llama_torch``).
"""
from .dlpack import ZeroCopyError, from_torch, nvfp4_to_torch, same_buffer, to_torch
from .torch_cache import TorchKVCache, TorchStaged
from . import layouts

__all__ = ["to_torch", "from_torch", "same_buffer", "nvfp4_to_torch", "ZeroCopyError", "TorchKVCache", "TorchStaged", "layouts"]
