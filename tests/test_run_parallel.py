"""`tests/run_parallel.py` (``make test-gpu-parallel``): the round-robin deal and a real run of pytest processes
(on CPU, with a marker expression that selects CPU tests)."""
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import run_parallel  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def test_deal_round_robin_drops_empty_shares():
    ids = [f"t{i}" for i in range(7)]
    assert run_parallel.deal(ids, 3) == [["t0", "t3", "t6"], ["t1", "t4"], ["t2", "t5"]]
    assert run_parallel.deal(ids[:2], 4) == [["t0"], ["t1"]]
    assert run_parallel.deal(ids, 1) == [ids]


def _run(tmp_path, *args):
    return subprocess.run([sys.executable, os.path.join(HERE, "run_parallel.py"), "--logs", str(tmp_path), *args],
                          capture_output=True, text=True, cwd=os.path.dirname(HERE))


def test_runs_every_selected_test_once_and_reports_failure(tmp_path):
    path = os.path.join("tests", "test_config.py")
    want = run_parallel.collect("not gpu", [path])
    assert len(want) >= 4
    res = _run(tmp_path / "ok", "--procs", "3", "--marker", "not gpu", path)
    assert res.returncode == 0, res.stdout + res.stderr
    logs = sorted(os.listdir(tmp_path / "ok"))
    assert logs == ["tests-0.txt", "tests-1.txt", "tests-2.txt"]
    passed = sum(int(open(tmp_path / "ok" / f).read().split(" passed")[0].split()[-1]) for f in logs)
    assert passed == len(want)
    # a failing selection makes the runner fail (here: the GPU tests of a file, on a machine without a GPU)
    if not run_parallel.collect("gpu", [os.path.join("tests", "test_dlpack.py")]):
        pytest.fail("test_dlpack.py has no gpu test any more: pick another file for the failing run")
    from jmixedkv.compat import on_gpu
    if not on_gpu():
        bad = _run(tmp_path / "bad", "--procs", "2", "--marker", "gpu", os.path.join("tests", "test_dlpack.py"))
        assert bad.returncode == 1 and "failed" in bad.stdout, bad.stdout + bad.stderr


def test_refuses_bad_arguments_and_empty_selection(tmp_path):
    res = _run(tmp_path, "--procs", "0")
    assert res.returncode == 2 and "--procs must be >= 1, got 0" in res.stderr
    res = _run(tmp_path, "--marker", "gpu", os.path.join("tests", "test_config.py"))
    assert res.returncode == 5 and "no test selected" in res.stdout
