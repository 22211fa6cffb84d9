"""Smoke runs of the benchmarks and their tools on the CPU (they time nothing here): every bench module imports,
`bench/tools/sass_mix.py` counts a synthetic Nsight Compute export, `decode_bench --grid`'s shards partition the grid
and merge back in order, and `tp_bench.py --smoke` runs end to end on 2 host devices."""
import csv
import importlib
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
sys.path[:0] = [BENCH, os.path.join(BENCH, "tools")]

#: bench modules this smoke imports (hf_bench needs transformers' models and is run by its owner)
MODULES = ["common", "shapes", "decode_bench", "step_bench", "read_bench", "write_bench", "prefix_bench", "tp_bench",
           "nvfp4_bench", "sass_mix", "plot_decode"]


@pytest.mark.parametrize("name", MODULES)
def test_bench_module_imports(name):
    importlib.import_module(name)


def test_sass_mix_counts_a_synthetic_export(tmp_path, capsys):
    import sass_mix
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
              "Instructions Executed", "stall_wait", "stall_barrier", "stall_wait (Not Issued)"]
    rows = [["0x0", "      IMAD.SHL.U32 R1, R2, 0x10, RZ", "3", "1", "400", "2", "1", "9"],
            ["0x10", "@P0   R2UR UR4, R5", "1", "0", "400", "1", "0", "9"],
            ["0x20", "      IMAD.U32 R1, RZ, RZ, UR4", "0", "0", "200", "0", "0", "0"],
            ["0x30", "@!P1  BRA 0x40", "6", "2", "100", "0", "6", "0"]]
    path = tmp_path / "k.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["Kernel Name", "k"])
        w.writerow(header)
        w.writerows(rows)
    out_json = tmp_path / "m.json"
    assert sass_mix.main([str(path), "--units", "100", "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "1,100 executed" in text and "wait 30.0%" in text and "barrier 70.0%" in text
    assert json.loads(out_json.read_text())["executed"] == {"IMAD": 600, "R2UR": 400, "BRA": 100}


def test_decode_grid_shards_partition_and_merge_in_order(tmp_path):
    import decode_bench as db
    order = db.grid_order("1,16", "4096", "4/16/1,8/64/4")
    paths = []
    for i in range(3):
        rows = db.shard_rows(order, (i, 3))
        shard = dict(date=f"d{i}", device="NVIDIA H200", jax="0.11.2", triton="3.6.0", torch="2.11", heads=8,
                     head_dim=128, first_n=64, last_n=64, layers=1, copy_bandwidth_tbs=4.2 + i / 100,
                     copy_bandwidth_how="torch copy", skipped=[],
                     rows=[dict(batch=b, context=c, gqa=g, page=p, tq=t, default_ms=0.1, copy_bandwidth_tbs=4.2)
                           for b, c, g, p, t in rows])
        paths.append(tmp_path / f"s{i}.json")
        paths[-1].write_text(json.dumps(shard))
    assert db.main(["--merge", *map(str, paths), "--out", str(tmp_path / "m"), "--batches", "1,16",
                    "--contexts", "4096", "--geos", "4/16/1,8/64/4"]) == 0
    merged = json.loads((tmp_path / "m" / "decode_bench-grid.json").read_text())
    assert [(r["batch"], r["context"], r["gqa"], r["page"], r["tq"]) for r in merged["rows"]] == order
    assert merged["shards"] == 3


def test_tp_bench_smoke_cpu(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "tp_bench.py"), "--smoke", "--no-md", "--no-sweep",
                           "--no-trace", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.load(open(tmp_path / "tp_bench.json"))
    assert res["errors"] == [], res["errors"]
    assert [r["devices"] for r in res["rows"]] == [1, 2] and res["rows"][1]["bit_equal_to_single"] is True
    assert res["hlo"]["sharded_fixed_preplaced"]["collectives_total"] == 0
