"""Named benchmark shapes, as data (each bench's GPU shape and the tiny ``*_SMOKE`` one its ``--smoke`` runs on CPU).

`DECODE_GEOMETRY`: KV heads, head_dim, retained first_n / last_n of the mixed cache every decode bench builds.
`DECODE_GRID`: the grid `decode_bench.py --grid` runs (batch x context x (GQA group, page, Tq)); its
``--batches`` / ``--contexts`` / ``--geos`` defaults are these, as strings (`grid_args`).
`STEP`: the whole decode step of `step_bench.py` (Llama-3-8B attention, batch 64 x 8k).
`TP`: `tp_bench.py`'s tensor-parallel decode (batch 64 x 32k, page 64) and its batch sweep.
`WRITE_CASES`: `write_bench.py`'s write-kernel cases. `READ`: `read_bench.py`'s stage / gather cases.
`NVFP4_ROWS`: rows of the ``bf16[rows, 128]`` input of `nvfp4_bench.py` (2^22: 1 GiB).
`PREFIX`: `prefix_bench.py`'s shared-prompt workload. `HF_MODELS`: `hf_bench.py`'s Llama model shapes.
"""
from __future__ import annotations

__all__ = ["DECODE_GEOMETRY", "DECODE_GRID", "grid_args", "STEP", "STEP_SMOKE", "TP", "TP_SMOKE", "WRITE_CASES",
           "WRITE_SMOKE", "READ", "READ_SMOKE", "NVFP4_ROWS", "PREFIX", "PREFIX_SMOKE", "HF_MODELS"]

DECODE_GEOMETRY = dict(kv_heads=8, head_dim=128, first_n=64, last_n=64)
DECODE_GRID = dict(batches=(1, 16, 64), contexts=(4096, 32768, 131072),
                   geos=((4, 16, 1), (4, 16, 4), (4, 64, 1), (4, 64, 4), (8, 16, 1), (8, 16, 4), (8, 64, 1),
                         (8, 64, 4)))

STEP = dict(layers=32, batch=64, context=8192, kv_heads=8, q_heads=32, head_dim=128, page=16, first_n=64, last_n=64,
            steps=12)
STEP_SMOKE = dict(STEP, layers=2, batch=2, context=64, steps=2)

TP = dict(batch=64, context=32768, kv_heads=8, q_heads=32, head_dim=128, page=64, first_n=64, last_n=64,
          sweep_batches=(32, 64, 128))
TP_SMOKE = dict(TP, batch=4, context=64, page=16, sweep_batches=(2, 4))

#: (name, layers, kv heads, head_dim, sequences, tokens per sequence, first position, pool pages or None, page);
#: mixed_nvfp4_bf16 first_n = last_n = 64, neox RoPE in the kernel. The 20 GiB pool puts the sequences on its last
#: pages (offsets past 2^32 bytes).
WRITE_CASES = [("decode L32 H8 D128 B64", 32, 8, 128, 64, 1, 1000, None, 32),
               ("prefill 8x1024 tokens", 32, 8, 128, 8, 1024, 0, None, 32),
               ("decode B64, 20 GiB pool", 32, 8, 128, 64, 1, 1000, 20480, 32)]
WRITE_SMOKE = [("decode", 2, 2, 128, 4, 1, 100, None, 32)]

#: stage: batch x tokens over (kv, heads, D); gather: top-k rows over batch x tokens, MLA latent and 8 x 128
READ = dict(first_n=64, last_n=256, page=32, stage=(16, 32768, (2, 8, 128)), gather_batch=16, gather_tokens=131072,
            topk=2048, gather_specs=((1, 1, 576), (2, 8, 128)), scratch=(None, "fp8"))
READ_SMOKE = dict(READ, first_n=8, last_n=16, page=8, stage=(2, 40, (2, 1, 32)), gather_batch=2, gather_tokens=40,
                  topk=16, gather_specs=((2, 1, 32),), scratch=(None,))

NVFP4_ROWS = 1 << 22

PREFIX = dict(requests=256, prompt=4096, suffix=64, batch=16, page=32, first_n=64, last_n=256, layers=8, heads=8,
              head_dim=128, repeats=3)
PREFIX_SMOKE = dict(PREFIX, requests=3, prompt=64, suffix=8, batch=2, page=8, first_n=8, last_n=16, layers=1,
                    heads=1, head_dim=64, repeats=1)

HF_MODELS = {
    "smollm2-shape": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=1e5,
                          max_position_embeddings=8192, tie_word_embeddings=True, rms_norm_eps=1e-5),
    "llama3-8b-shape": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=5e5,
                            max_position_embeddings=131072, tie_word_embeddings=False, rms_norm_eps=1e-5)}


def grid_args(grid=DECODE_GRID):
    """``(batches, contexts, geos)`` of ``grid`` as the command-line strings ``"1,16,64"``, ``"4096,..."``,
    ``"4/16/1,..."`` (GQA/page/Tq)."""
    return (",".join(map(str, grid["batches"])), ",".join(map(str, grid["contexts"])),
            ",".join("/".join(map(str, g)) for g in grid["geos"]))
