"""The ``jmixedkv`` command line (`jmixedkv_demo.cli`): demo (quick size), capacity, help, bad arguments -> exit 2."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from jmixedkv.capacity import MODEL_SHAPES, parse_bytes
from jmixedkv_demo import cli, demo, specs

REPO = Path(__file__).resolve().parent.parent


def test_demo_quick_prints_table_json_and_plot(tmp_path, capsys):
    js, png = tmp_path / "demo.json", tmp_path / "demo.png"
    rc = cli.main(["demo", "--model", "random", "--quick", "--caches", "mixed:all,mixed:4:4", "--no-progress",
                   "--json", str(js),
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


def test_demo_output_paths_fail_fast(tmp_path, capsys, monkeypatch):
    """--plot / --json into a missing folder, or --plot without matplotlib: exit 2 before any model work."""
    import jmixedkv_demo.model as model_mod
    monkeypatch.setattr(model_mod, "evaluate_caches", lambda *a, **k: pytest.fail("ran the model"))
    monkeypatch.setattr(cli, "run_demo", lambda *a, **k: pytest.fail("ran the model"))
    monkeypatch.setattr(cli, "run_smollm_demo", lambda *a, **k: pytest.fail("ran the model"))
    for argv in (["--plot", str(tmp_path / "missing" / "x.png")], ["--json", str(tmp_path / "nope" / "x.json")],
                 ["--model", "random", "--plot", str(tmp_path / "missing" / "x.png")]):
        assert cli.main(["demo", "--no-progress"] + argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("jmixedkv: error: --") and "does not exist" in err
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert cli.main(["demo", "--no-progress", "--plot", str(tmp_path / "x.png")]) == 2
    assert "needs matplotlib" in capsys.readouterr().err


def test_cache_spec_levers():
    label, cfg = specs.parse_cache_spec("mixed:4:64+rot+smooth", 100, 16)
    assert label == "mixed(4,64)+rot+smooth" and cfg.rotation == "hadamard" and cfg.k_smoothing
    assert specs.parse_cache_spec("nvfp4+rot", 100, 16)[1].rotation == "hadamard"
    with pytest.raises(specs.UsageError, match="unknown lever"):
        specs.parse_cache_spec("nvfp4+magic", 100, 16)


@pytest.mark.parametrize("text,needle", [("", "no cache spec given"), ("  ", "no cache spec given"),
                                         (",", "empty entry"), ("bf16,,nvfp4", "empty entry")])
def test_empty_cache_lists_refused(text, needle, monkeypatch, capsys):
    """``--caches ''`` (or an empty entry) is refused for both models, before any model work (it used to run the
    default set)."""
    with pytest.raises(specs.UsageError, match=needle):
        specs.cache_list(text, 100, 16, lambda c: True)
    import jmixedkv_demo.gguf as gguf_mod
    monkeypatch.setattr(gguf_mod, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    monkeypatch.setattr(demo, "run_demo", lambda *a, **k: pytest.fail("ran the model"))
    for model in ("smollm2", "random"):
        assert cli.main(["demo", "--model", model, "--no-progress", "--caches", text]) == 2
        err = capsys.readouterr().err
        assert err.startswith("jmixedkv: error: --caches") and needle in err


@pytest.mark.slow
def test_demo_smollm2_quick(tmp_path, capsys):
    """The default model: SmolLM2 generates through each cache and is scored teacher-forced (quick sizes)."""
    from jmixedkv_demo.gguf import smollm2_path
    smollm2_path()          # raises ModelUnavailable (with the install command) when the 'model' extra is missing
    js = tmp_path / "d.json"
    rc = cli.main(["demo", "--quick", "--no-progress", "--caches", "bf16,nvfp4,mixed:4:64", "--eval-tokens", "512",
                   "--window", "32", "--new-tokens", "8", "--json", str(js)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "[bf16] 'The capital of France is Paris" in out
    for col in ("B/elem", "high %", "KL", "ppl", "top1 %", "proj. x bf16", "PROJECTION"):
        assert col in out
    report = json.loads(js.read_text())
    base, nv, mixed = report["results"]
    assert base["kl"] == 0 and base["top1"] == 1.0
    assert 0 < mixed["kl"] < nv["kl"] < 1.0                     # the twin helps; nvfp4 is a perturbation
    assert nv["bytes_per_element"] == pytest.approx(36 / 64)  # D/2 + D/16 bytes per 64-element row
    assert report["seq_len"] == 512 and mixed["high_fraction"] == pytest.approx(68 / 512)


def test_capacity_command(capsys):
    assert cli.main(["capacity", "--model-shape", "llama3-8b", "--kv-budget", "80GiB", "--seq-len", "8192",
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


@pytest.mark.parametrize("argv,needle,usage", [
    (["capacity", "--gpu-mem", "80XB"], "memory size '80XB'", True),
    (["capacity", "--model-shape", "32,8,100"], "multiple of 16", True),
    (["capacity", "--model-shape", "gpt-9"], "expected one of", True),
    (["capacity", "--seq-len", "0"], "integer >= 1", True),
    (["demo", "--batch", "two"], "expected an integer", True),
    (["demo", "--attention", "flash"], "invalid choice", True),
    (["frobnicate"], "invalid choice", True),
    ([], "required", True),
    (["demo", "--caches", "bf16,mixed:x:y"], "cache spec 'mixed:x:y'", False),
    (["demo", "--caches", "int4"], "unknown value 'int4'", False),
    (["demo", "--caches", "nvfp4:4:4"], "need a mixed dtype", False),
    (["demo", "--caches", "mixed:4"], "NAME:FIRST_N:LAST_N", False),
    (["capacity", "--page-size", "24"], "power of two", False),
    (["bench"], "required: BENCH", True),                          # bench accuracy; the speed benches: bench/
    (["bench", "speed"], "invalid choice: 'speed'", True),
    (["demo", "--budget", "80GiB"], "unrecognized arguments: --budget", True),     # one meaning: --gpu-mem
    (["demo", "--model", "random", "--gpu-mem", "1GiB"], "do not fit in --gpu-mem", False),
])
def test_bad_input_exits_2_with_message(argv, needle, usage, capsys):
    """Usage errors: argparse's ``SystemExit(2)``; bad values: ``main`` returns 2 after a "jmixedkv: error:" line."""
    if usage:
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2
    else:
        assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and (usage or err.startswith("jmixedkv: error:"))


def test_python_dash_m_entry_point():
    r = subprocess.run([sys.executable, "-m", "jmixedkv_demo", "--help"], capture_output=True, text=True, cwd=REPO,
                       timeout=120)
    assert r.returncode == 0 and all(c in r.stdout for c in ("demo", "capacity", "bench"))
    r = subprocess.run([sys.executable, "-m", "jmixedkv_demo", "capacity", "--gpu-mem", "lots"], capture_output=True,
                       text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2 and "memory size 'lots'" in r.stderr


def test_unknown_arguments_refused(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["capacity", "--frobnicate"])
    assert e.value.code == 2 and "unrecognized arguments: --frobnicate" in capsys.readouterr().err


def test_demo_memory_columns_use_the_gpu_mem_and_kv_budget_meanings(capsys, monkeypatch):
    """``demo``'s memory columns take --gpu-mem as GPU memory (weights subtracted) and --kv-budget as the KV cache's
    own memory, as ``capacity`` does (``--gpu-mem`` used to mean the KV budget in ``demo``)."""
    seen = []
    model = dict(num_layers=1, d_model=16, num_heads=1, num_kv_heads=1, head_dim=16, vocab_size=2)
    monkeypatch.setattr(cli, "run_demo", lambda s, progress: {"model": model, "device": "cpu", "results": []})
    monkeypatch.setattr(cli, "demo_table", lambda report, shape, budget, seq_len: seen.append(budget) or ([], []))
    monkeypatch.setattr(cli, "_write_outputs", lambda *a: None)
    weights = 2 * MODEL_SHAPES["llama3-8b"].num_params
    assert cli.main(["demo", "--model", "random", "--gpu-mem", "80GiB"]) == 0
    assert cli.main(["demo", "--model", "random", "--kv-budget", "10GiB"]) == 0
    assert seen == [80 * 2 ** 30 - weights, 10 * 2 ** 30]
    out = capsys.readouterr().out
    assert "= --gpu-mem 80.00 GiB - llama3-8b bf16 weights" in out and "(--kv-budget; model weights not" in out


@pytest.mark.parametrize("content,needle", [(None, "cannot read"), (b"  \n\t", "holds no text"),
                                            (b"\xff\xfe\xfa", "not UTF-8")])
def test_text_file_refused_by_name_before_any_model_work(tmp_path, content, needle, monkeypatch, capsys):
    """``demo --text-file PATH`` (your own data for the accuracy run): a missing, blank or non-UTF-8 file is refused
    naming the path, before the model loads."""
    path = tmp_path / "mine.txt"
    if content is not None:
        path.write_bytes(content)
    monkeypatch.setattr(demo, "run_demo", lambda *a, **k: pytest.fail("ran the model"))
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--no-progress", "--text-file", str(path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and str(path) in err


def test_text_file_is_the_text_scored(tmp_path, monkeypatch):
    """The file's text reaches the accuracy run (what the demo encodes), not a shipped text."""
    path = tmp_path / "mine.txt"
    path.write_text("Ein Satz, den das Projekt nie gesehen hat.\n", encoding="utf-8")
    seen = {}

    class Stop(Exception):
        pass

    class FakeModel:
        params = {}

        def encode(self, text):
            seen["text"] = text
            raise Stop

    import jmixedkv_demo.gguf as gguf_mod
    monkeypatch.setattr(gguf_mod, "load_model", lambda *a, **k: FakeModel())
    args = cli.build_parser().parse_args(["demo", "--no-progress", "--text-file", str(path)])
    with pytest.raises(Stop):
        demo.run_smollm_demo(args, progress=False)
    assert seen["text"] == path.read_text(encoding="utf-8")
