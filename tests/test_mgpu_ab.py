"""bench/_mgpu_ab.py (same-run A/B of the Mosaic kernel's module flags): argument parsing and refusals (CPU)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import _mgpu_ab as ab  # noqa: E402


def test_parse_variant_types_and_names():
    assert ab.parse_variant("new:EDGE_WARPS=8,EDGE_BLOCK_K=64,X=ab") == ("new", {"EDGE_WARPS": 8, "EDGE_BLOCK_K": 64,
                                                                               "X": "ab"})
    assert ab.parse_variant("neg:A=-3") == ("neg", {"A": -3})
    for bad in ("old", "old:", ":A=1", "old:A", "old:=1"):
        with pytest.raises(ValueError, match="variant"):
            ab.parse_variant(bad)


def test_parse_shapes_checks_every_field():
    assert ab.parse_shapes("16/16/32768/32/1,64/1/4096/8/4") == [(16, 16, 32768, 32, 1), (64, 1, 4096, 8, 4)]
    assert len(ab.parse_shapes(ab.DEFAULT_SHAPES)) == 7
    for bad in ("16/16/32768/32", "16/0/4096/32/1", "16/1/4096/12/1", "a/1/1/8/1"):
        with pytest.raises(ValueError, match="shapes"):
            ab.parse_shapes(bad)


def test_load_variant_sets_flags_and_refuses_unknown_ones():
    mod = ab.load_variant("t0", {"EDGE_WARPS": 2, "EDGE_BLOCK_K": 64})
    assert mod.EDGE_WARPS == 2 and mod.EDGE_BLOCK_K == 64
    from pallas_kernels import decode_mgpu
    assert decode_mgpu.EDGE_WARPS == 4 and decode_mgpu.EDGE_BLOCK_K == 32   # the shared module is untouched
    with pytest.raises(ValueError, match="NOPE"):
        ab.load_variant("t1", {"NOPE": 1})
    with pytest.raises(ValueError, match="EDGE_WARPS is int"):
        ab.load_variant("t2", {"EDGE_WARPS": "four"})


def test_main_refuses_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        ab.main(["--variant", "a:EDGE_WARPS=4"])           # one variant
    assert "two or more" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.main(["--variant", "a:EDGE_WARPS=4", "--variant", "a:EDGE_WARPS=2"])
    assert "distinct" in capsys.readouterr().err


def test_mgpu_case_builds_the_kernel_inputs_and_refuses_bad_shapes():
    import decode_sweep as ds
    args, nf, nr = ds.mgpu_case(16, 2, 100, 16, 3)
    q, pt, lens, layer = args[:4]
    assert q.shape == (2, 3, 16, ds.D) and str(q.dtype) == "bfloat16" and layer == 0
    assert lens.tolist() == [100, 100] and pt.shape[0] == 2 and nf >= 1 and nr >= 1
    with pytest.raises(ValueError, match="batch"):
        ds.mgpu_case(16, 0, 100, 16, 1)
    with pytest.raises(ValueError, match="multiple of the 8"):
        ds.mgpu_case(16, 1, 100, 12, 1)
