"""The ``jmixedkv`` command line: demo (quick size), capacity, bench on CPU, help, bad arguments -> exit 2."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from jmixedkv import cli
from jmixedkv.capacity import MODEL_SHAPES, parse_bytes

REPO = Path(__file__).resolve().parent.parent


def test_demo_quick_prints_table_json_and_plot(tmp_path, capsys):
    js, png = tmp_path / "demo.json", tmp_path / "demo.png"
    rc = cli.main(["demo", "--quick", "--caches", "mixed:all,mixed:4:4", "--no-progress", "--json", str(js),
                   "--plot", str(png)])
    out = capsys.readouterr().out
    assert rc == 0
    for col in ("kv cache", "B/token", "tokens in budget", "agree %", "logit err", "tok/s"):
        assert col in out
    for row in ("bf16", "mixed all-high", "mixed(4,4)"):       # bf16 baseline added in front
        assert any(line.startswith(row) for line in out.splitlines()), row
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads(js.read_text())
    base, high, mixed = report["results"]
    n = report["cached_len"]
    assert n == 24 + 8 - 1
    assert high["token_agreement"] == 1.0 and high["logit_rel_err_max"] == 0.0 and high["attn_rel_err_mean"] == 0
    assert base["logit_rel_err_max"] == 0.0
    err = mixed["kv0_rel_err_per_position"]
    assert all(e == 0 for e in err[:4] + err[n - 4:n])           # the retained windows are exact
    assert all(0.01 < e < 0.5 for e in err[4:n - 4])             # NVFP4 elsewhere
    assert 0 < mixed["logit_rel_err_mean"] < 0.5
    # the memory columns: llama3-8b, 80 GiB, 8192 tokens; nvfp4 rows cost D/2 + D/16 = 72 B per head row
    line = next(line for line in out.splitlines() if line.startswith("mixed(4,4)"))
    assert f"{32 * 2 * 8 * 72:,}" in line.split()


def test_capacity_command(capsys):
    assert cli.main(["capacity", "--model-shape", "llama3-8b", "--gpu-mem", "80GiB", "--seq-len", "8192",
                     "--first-n", "16", "--last-n", "16", "--page-size", "32"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[3:]}
    # bf16: 32 layers * 2 (K,V) * 8 heads * 256 B = 131072 B/token; 8192 tokens = 1 GiB; 80 sequences
    assert rows["bf16"][1] == "131,072" and rows["bf16"][-3] == "80" and rows["bf16"][-2] == f"{80 * 8192:,}"
    assert rows["nvfp4"][1] == "36,864" and rows["fp8"][1] == "65,536"
    # mixed (16,16), page 32: 1 fixed + (ceil(16/32)+1 = 2) ring pages = 96 bf16 rows per layer / K,V / head
    twin = 96 * 32 * 2 * 8 * 256
    per_seq = 8192 * 36864 + twin
    assert rows["mixed_nvfp4_bf16(16,16)"][-3] == f"{parse_bytes('80GiB') // per_seq:,}"
    assert str(MODEL_SHAPES["llama3-8b"]) in out


@pytest.mark.parametrize("argv,needle", [
    (["capacity", "--gpu-mem", "80XB"], "memory size '80XB'"),
    (["capacity", "--model-shape", "32,8,100"], "multiple of 16"),
    (["capacity", "--model-shape", "gpt-9"], "expected one of"),
    (["capacity", "--seq-len", "0"], "integer >= 1"),
    (["demo", "--batch", "two"], "expected an integer"),
    (["demo", "--attention", "flash"], "invalid choice"),
    (["frobnicate"], "invalid choice"),
    ([], "required"),
])
def test_usage_errors_exit_2_with_message(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("argv,needle", [
    (["demo", "--caches", "bf16,mixed:x:y"], "cache spec 'mixed:x:y'"),
    (["demo", "--caches", "int4"], "unknown value 'int4'"),
    (["demo", "--caches", "nvfp4:4:4"], "need a mixed dtype"),
    (["demo", "--caches", "mixed:4"], "NAME:FIRST_N:LAST_N"),
    (["capacity", "--page-size", "24"], "power of two"),
    (["bench", "no_such_bench"], "unknown bench 'no_such_bench'"),
])
def test_bad_values_exit_2_with_message(argv, needle, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("jmixedkv: error:") and needle in err


def test_bench_without_gpu_says_so(capsys):
    gpu_benches = [n for n in cli._benches() if n not in cli.CPU_BENCHES]
    argv = ["bench"] + gpu_benches[:1]
    assert cli.main(argv) == cli.EXIT_NO_GPU
    assert "no GPU" in capsys.readouterr().err
    assert cli.main(["bench", "--list"]) == 0


def test_python_dash_m_entry_point():
    r = subprocess.run([sys.executable, "-m", "jmixedkv", "--help"], capture_output=True, text=True, cwd=REPO,
                       timeout=120)
    assert r.returncode == 0 and "demo" in r.stdout and "capacity" in r.stdout and "bench" in r.stdout
    r = subprocess.run([sys.executable, "-m", "jmixedkv", "capacity", "--gpu-mem", "lots"], capture_output=True,
                       text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2 and "memory size 'lots'" in r.stderr
