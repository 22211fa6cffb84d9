"""``jmixedkv demo`` measures capacity and speed with the serving loop (`jmixedkv_demo.demo.measure_serving`) on a
GPU, or on a CPU with ``--measure`` (a tiny workload): the measured table replaces the projected capacity columns,
the JSON keeps it, and the default CPU budget is the independent arithmetic of 3 bf16 sequences."""
import argparse
import json
import types

import numpy as np

from jmixedkv_demo import cli, demo


def test_cpu_demo_measure_prints_the_measured_table(tmp_path, capsys):
    js = tmp_path / "demo.json"
    rc = cli.main(["demo", "--model", "random", "--quick", "--caches", "bf16,mixed:8:8", "--measure",
                   "--no-progress", "--json", str(js)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "MEASURED serving (cpu)" in out and "peak seqs" in out and "decode tok/s" in out
    assert "tokens in budget" not in out and "x bf16" not in out          # the projected columns are replaced
    m = json.loads(js.read_text())["measured"]
    rows = {r["label"]: r for r in m["rows"]}
    assert list(rows) == ["bf16", "mixed(8,8)"]
    # tiny model: 2 layers x (K, V) x 2 heads x 32 dims x 2 bytes = 512 B per bf16 token; pages of 8 tokens
    mean = int(round(float(np.mean(np.array(m["prompt_tokens"]) + np.array(m["output_tokens"]) - 1))))
    assert m["budget_bytes"] == 3 * (-(-mean // 8) * 8) * 512 + 4096
    for r in rows.values():
        assert r["requests"] == 6 and r["free_pages_end"] == r["num_pages"] and r["pool_bytes"] <= m["budget_bytes"]
        assert 1 <= r["peak_concurrent"] <= r["max_seqs"] and r["output_tokens"] == sum(m["output_tokens"])
    assert rows["bf16"]["max_seqs"] == 3
    assert all(p % 16 == 0 for p in m["prompt_tokens"])                 # whole prefill chunks: one program


def test_cpu_demo_default_keeps_the_projection(monkeypatch):
    monkeypatch.setattr(cli, "measure_serving", lambda *a, **k: (_ for _ in ()).throw(AssertionError("measured")))
    args = argparse.Namespace(measure=False, no_progress=True, kv_budget=None, quick=True, seed=0)
    assert cli._measure(args, "random", "bf16", 8) is None


def test_gpu_demo_measures_by_default(monkeypatch):
    import jax
    calls = []
    monkeypatch.setattr(jax, "devices", lambda *a: [types.SimpleNamespace(platform="gpu")])
    monkeypatch.setattr(cli, "measure_serving", lambda *a, **k: calls.append((a, k)) or {"rows": []})
    args = argparse.Namespace(measure=False, no_progress=True, kv_budget=None, quick=False, seed=3)
    assert cli._measure(args, "smollm2", "bf16,fp8", 16) == {"rows": []}
    assert calls == [(("smollm2", "bf16,fp8", 16, None), dict(quick=False, seed=3, progress=None))]
    assert demo.MEASURE_WORKLOAD["gpu"]["kv_budget"] == "4GiB"
