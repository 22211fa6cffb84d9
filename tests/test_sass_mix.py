"""`bench/sass_mix.py` on a small synthetic Nsight Compute source export (the real one of 2026-12-01 is in
bench/data): opcodes with and without modifiers, predicated lines, per-unit counts, stall reasons, gzip input."""
import csv
import gzip
import io
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import sass_mix  # noqa: E402

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
          "Instructions Executed", "stall_wait", "stall_barrier", "stall_wait (Not Issued)"]
ROWS = [["0x0", "      IMAD.SHL.U32 R1, R2, 0x10, RZ", "3", "1", "400", "2", "1", "9"],
        ["0x10", "@P0   R2UR UR4, R5", "1", "0", "400", "1", "0", "9"],
        ["0x20", "      IMAD.U32 R1, RZ, RZ, UR4", "0", "0", "200", "0", "0", "0"],
        ["0x30", "@!P1  BRA 0x40", "6", "2", "100", "0", "6", "0"]]


def _write(path, gz=False):
    buf = io.StringIO()
    w = csv.writer(buf, quoting=csv.QUOTE_ALL)
    w.writerow(["Kernel Name", "k"])
    w.writerow(HEADER)
    w.writerows(ROWS)
    data = buf.getvalue()
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(data)
    else:
        with open(path, "w") as f:
            f.write(data)


@pytest.mark.parametrize("gz", [False, True])
def test_mix_counts_opcodes_and_stalls(tmp_path, gz):
    path = str(tmp_path / ("k.csv.gz" if gz else "k.csv"))
    _write(path, gz)
    header, rows = sass_mix.read_source_csv(path)
    total, ex, st = sass_mix.mix(header, rows)
    assert total == 1100 and ex == {"IMAD": 600, "R2UR": 400, "BRA": 100}
    assert st == {"IMAD": 3, "R2UR": 1, "BRA": 6}
    _, ex_m, _ = sass_mix.mix(header, rows, modifiers=True)
    assert ex_m == {"IMAD.SHL.U32": 400, "IMAD.U32": 200, "R2UR": 400, "BRA": 100}
    assert sass_mix.stall_reasons(header, rows) == {"stall_wait": 3, "stall_barrier": 7}   # "Not Issued" not summed


def test_main_prints_per_unit_and_writes_json(tmp_path, capsys):
    path = str(tmp_path / "k.csv")
    _write(path)
    out_json = str(tmp_path / "m.json")
    assert sass_mix.main([path, "--units", "100", "--json", out_json]) == 0
    text = capsys.readouterr().out
    assert "1,100 executed" in text and "per kernel: 11.0" in text
    assert "IMAD" in text and "wait 30.0%" in text and "barrier 70.0%" in text
    assert json.load(open(out_json))["executed"]["R2UR"] == 400
    with pytest.raises(SystemExit):
        sass_mix.main([path, "--units", "0"])
