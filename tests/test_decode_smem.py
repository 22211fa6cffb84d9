"""Shared memory of the decode kernels' Triton programs as compiled for Hopper, checked on the CPU: the Pallas Triton
kernel is cross-lowered (`jmixedkv.compat.cross_lower_cuda`), its Triton IR taken from the lowered call
(`jmixedkv.compat.triton_programs`) and compiled by the installed Triton for sm_90 (`shared_bytes`). A program above
`HOPPER_MAX_SHARED_BYTES` fails on the GPU with ``RESOURCE_EXHAUSTED`` at its first call; the head_dim-256 edge
kernel at pages of 128 did so on the H200 (258,144 bytes asked), which is why it runs unpipelined there
(`mosaic_sm90.edge_config`, `WIDE_PIPELINED_MAX_PAGE`)."""
import dataclasses
import os
import tempfile

import pytest

from helpers import zero_decode_operands
from jmixedkv.compat import HOPPER_MAX_SHARED_BYTES, cross_lower_cuda, triton_programs
from jmixedkv.layout import TwinGeometry
from pallas_kernels.decode import mosaic_sm90
from pallas_kernels.decode import triton as triton_decode
from pallas_kernels.decode.config import MosaicConfig


def shared_bytes(lowered_text: str, capability: int = 90) -> list:
    """Each Triton program of a lowered call compiled by the installed Triton for sm_``capability`` (no GPU needed) ->
    its shared memory in bytes. XLA compiles the same IR with its own Triton at run time (on the H200 the refused
    edge kernel asked 16 bytes more than this count)."""
    import triton
    from triton.backends.compiler import GPUTarget
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (_, warps, stages, ttir) in enumerate(triton_programs(lowered_text)):
            path = os.path.join(tmp, f"k{i}.ttir")
            with open(path, "w") as f:
                f.write(ttir)
            kernel = triton.compile(path, target=GPUTarget("cuda", capability, 32),
                                    options=dict(num_warps=warps, num_stages=stages))
            out.append(int(kernel.metadata.shared))
    return out


def _shared_bytes(d, page, *, edge, tq=1, group=4, batch=2, heads=2, stages=None):
    """Largest shared memory of the Triton programs of one decode call over a mixed cache (bf16 twin) at head_dim
    ``d`` and pages of ``page``: the Mosaic backend's edge kernel (``edge``: the config `mosaic_sm90.edge_config`
    gives, or that with ``stages`` stages; the interior skipped) or the Triton backend's default."""
    operands = zero_decode_operands(d, page, tq=tq, hq=group * heads, batch=batch, heads=heads)
    geom = TwinGeometry(page, 5, 7, 1, 3)
    config = mosaic_sm90.edge_config(MosaicConfig(), batch, heads, d, page)
    if stages is not None:
        config = dataclasses.replace(config, num_stages=stages)

    def fn(q, pt, lens, ht, low, high):
        if edge:
            return triton_decode.paged_decode_partials(q, pt, lens, 1, low, high, None, ht, geom=geom, config=config,
                                                       skip_interior=True, interior_tokens=max(128, page))
        return triton_decode.paged_decode_attention(q, pt, lens, 1, low, high, None, ht, geom=geom)
    sizes = shared_bytes(cross_lower_cuda(fn, *operands))
    assert sizes, "no Triton program in the lowered call"
    return max(sizes)


@pytest.mark.parametrize("d,page", [(256, 128), (256, 64), (128, 128), (64, 128)])
def test_edge_kernel_fits_where_the_mosaic_backend_runs(d, page):
    """The edge blocks' kernel at the largest pages the Mosaic GPU backend takes at each head_dim, as `edge_config`
    sets it up, fits Hopper's shared memory (at head_dim 256: ~137 KB at pages of 64, ~90 KB unpipelined at 128)."""
    assert mosaic_sm90.supported(head_dim=d, page=page, tq=1, group=4)
    assert _shared_bytes(d, page, edge=True) <= HOPPER_MAX_SHARED_BYTES


def test_edge_kernel_at_head_dim_256_and_page_128_runs_unpipelined():
    """Why `edge_config` takes the edge kernel to one stage at head_dim 256 above pages of 64: pipelined (three
    stages, the default; two the same) its whole 128-token pages of 256 columns need more shared memory than sm_90
    has (the H200 refused 258,144 bytes); the Triton backend's own default program fits."""
    assert mosaic_sm90.edge_config(MosaicConfig(), 2, 2, 256, 128).num_stages == 1
    assert mosaic_sm90.edge_config(MosaicConfig(), 2, 2, 256, 64).num_stages == MosaicConfig().edge.num_stages
    assert mosaic_sm90.edge_config(MosaicConfig(), 2, 2, 128, 128).num_stages == MosaicConfig().edge.num_stages
    for stages in (3, 2):
        assert _shared_bytes(256, 128, edge=True, stages=stages) > HOPPER_MAX_SHARED_BYTES
    assert _shared_bytes(256, 128, edge=False) <= HOPPER_MAX_SHARED_BYTES