"""Smoke runs of the benchmarks and their tools on the CPU (tiny shapes, interpret mode; they time nothing real):
each bench's ``--smoke`` command runs end to end and reports its checks passed, and bench/'s imports form no
circle (a bench imports only `common` and `shapes` of bench/, and those two import no bench module)."""
import ast
import glob
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
sys.path.insert(0, BENCH)

#: bench module (``:label`` for a second run) -> the arguments of its smoke run (``{out}``: a fresh folder), run in
#: this process
SMOKE = {"write_bench": ["--smoke", "--out", "{out}"],
         "read_bench": ["--smoke", "--out", "{out}"],
         "step_bench": ["--smoke", "--levers", "--out", "{out}"],
         "prefix_bench": ["--smoke", "--out", "{out}"],
         "nvfp4_bench": ["--smoke"],
         "decode_bench": ["--grid", "--smoke", "--geos", "4/16/1", "--out", "{out}"],
         "decode_bench:geometry": ["--geometry-grid", "--smoke", "--head-dims", "64", "--groups", "2", "--pages", "16",
                                   "--tqs", "1", "--variants", "k64w2", "--out", "{out}"],
         "hf_bench": ["--smoke", "--profile-host", "5", "--rounds", "2", "--out", "{out}"],   # a folder
         "hf_bench:profile": ["--profile-prefill", "{out}", "--layers", "2", "--batch", "1", "--prompt", "16",
                              "--new", "3", "--reps", "1"],
         "flashinfer_bench": ["--smoke", "--out", "{out}"],
         "serve_bench": ["--smoke", "--caches", "bf16,mixed:4:64", "--out", "{out}"],
         "accuracy": ["--texts", "prose", "--caches", "bf16,nvfp4", "--tokens", "64", "--window", "8", "--buckets",
                      "2", "--out", "{out}/accuracy.json"],
         "accuracy:transformers": ["--transformers", "--texts", "prose", "--caches", "fp8,recommended+smooth",
                                   "--tokens", "48", "--window", "4", "--out", "{out}/accuracy_transformers.json"]}


def _bench_imports(path, names):
    """Bench modules (of ``names``) that the file at ``path`` imports, function bodies included."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out & names


def test_bench_imports_form_no_circle():
    files = {os.path.basename(p)[:-3]: p for p in glob.glob(os.path.join(BENCH, "*.py"))
             + glob.glob(os.path.join(BENCH, "tools", "*.py"))}
    names = set(files)
    assert {"common", "shapes", "decode_bench", "write_bench"} <= names
    for name, path in files.items():
        allowed = set() if name in ("common", "shapes") else {"common", "shapes"}
        assert _bench_imports(path, names) <= allowed, (name, _bench_imports(path, names))


@pytest.mark.parametrize("name", sorted(SMOKE))
def test_bench_smoke(name, tmp_path):
    import importlib
    mod = importlib.import_module(name.split(":")[0])
    argv = [a.format(out=tmp_path) for a in SMOKE[name]]
    assert mod.main(argv) in (0, None)          # an exit code (serve_bench's main returns None on success)
    assert name == "nvfp4_bench" or any(tmp_path.iterdir()), f"{name} wrote nothing under {tmp_path}"
    if name == "hf_bench":                      # the interleaved rounds: every cache that ran, each round timed
        rounds = json.loads((tmp_path / "hf_bench.json").read_text())["rounds"]
        assert len(rounds) == 2 and all(len(r["rounds"]) == 2 and math.isfinite(r["ms_per_decode_step_min"])
                                        for r in rounds)        # (2 steps on a loaded CPU: a difference of noise)
    if name == "step_bench":                    # the levers' steps and appends ran beside the plain ones, no error bit
        res = json.loads((tmp_path / "step_bench.json").read_text())
        for cfg in ("mixed", "mixed_levers", "mixed_levers_smooth"):
            assert res["rows"][cfg + "_step"]["error"] == 0 == res["rows"][cfg + "_append_only"]["error"], cfg
        assert res["mixed_levers_smooth_over_plain_append_only"] > 0 and res["mixed_levers_over_plain_step"] > 0
    if name == "accuracy:transformers":         # KL of each cache against DynamicCache: finite, fp8's above zero
        kl = json.loads((tmp_path / "accuracy_transformers.json").read_text())["kl"]["prose"]
        assert set(kl) == {"fp8", "recommended+smooth"} and kl["fp8"] > 0 and all(
            0 <= v < 10 for v in kl.values()), kl
    if name.startswith("decode_bench"):         # a row's failure is recorded in its JSON, not raised
        (path,) = tmp_path.glob("decode_bench-*.json")
        rows = json.loads(path.read_text())["rows"]
        assert len(rows) == 1 and not [r for r in rows if any("error" in k for k in r)], rows
        assert name == "decode_bench" or (rows[0]["variants"]["k64w2"] or 0) > 0, rows


@pytest.mark.parametrize("spec,variant", [("64/2/16/1", "mv0"), ("256/2/16/1", "")])
def test_decode_bench_kernel_alone(spec, variant, capsys):
    """``decode_bench --kernel-alone`` (the Mosaic GPU kernel alone, for ncu) runs its calls in interpret mode and
    checks its partials (finite, some key seen); a geometry or variant the kernel does not take is refused."""
    import decode_bench
    assert decode_bench.main(["--kernel-alone", spec, "--variants", variant, "--calls", "1", "--smoke"]) == 0
    assert f"kernel alone {variant or 'default'}: head_dim {spec.split('/')[0]}" in capsys.readouterr().out
    for bad in (["--kernel-alone", "256/8/16/8"], ["--kernel-alone", "64/2/16/1", "--variants", "k64w2"]):
        with pytest.raises(SystemExit, match="does not take|not a Mosaic GPU variant"):
            decode_bench.main(bad + ["--smoke"])
    with pytest.raises(SystemExit):                              # argparse's error: two configs
        decode_bench.main(["--kernel-alone", spec, "--variants", "m,mv1", "--smoke"])


def test_decode_bench_launches(tmp_path, capsys):
    """``decode_bench --launches`` (what one default call launches) runs the call in its loop of ten on the CPU and
    writes its JSON (no kernels traced off the GPU) and the loop's optimized HLO; a malformed row is refused."""
    import decode_bench
    assert decode_bench.main(["--launches", "64/2/16/1", "--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "decode_bench-launches.json").read_text())
    assert (result["head_dim"], result["gqa"], result["page"], result["tq"]) == (64, 2, 16, 1)
    assert result["backend"] == "triton" and result["kernels"] == [] and result["launches_per_call"] is None
    assert "HloModule" in (tmp_path / "decode_bench-launches-hlo.txt").read_text()
    assert "no GPU kernels traced" in capsys.readouterr().out
    for bad in ("64/2/16", "64/2/x/1"):
        with pytest.raises(SystemExit, match="expected HD/GQA/PAGE/TQ"):
            decode_bench.main(["--launches", bad, "--smoke", "--out", str(tmp_path)])


def test_interleaved_rounds_run_every_name_per_round():
    """`common.interleaved_ms_per_step`: each round runs every name back to back (one token, then ``tokens``), one
    time per round and name; fewer than two tokens (no decode step to time) is refused."""
    import common
    calls = []
    times = common.interleaved_ms_per_step(lambda name, n: calls.append((name, n)), ["a", "b"], 3, 4)
    assert calls == [("a", 1), ("a", 4), ("b", 1), ("b", 4)] * 3
    assert sorted(times) == ["a", "b"] and all(len(v) == 3 and all(math.isfinite(x) for x in v)
                                               for v in times.values())
    with pytest.raises(ValueError, match="tokens must be >= 2.*got 1"):
        common.interleaved_ms_per_step(lambda name, n: None, ["a"], 1, 1)


def test_tp_bench_smoke_on_two_host_devices(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "tp_bench.py"), "--smoke", "--no-md", "--no-sweep",
                           "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.load(open(tmp_path / "tp_bench.json"))
    assert res["errors"] == [] and [r["batch"] for r in res["rows"]] == [4], res
    assert res["rows"][0]["bit_equal"] is True and res["rows"][0]["collectives"] == {}
    step = res["step"]                            # the whole decode step: outputs and written pools bit-equal
    assert step["bit_equal"] is True and step["single_error"] == 0 == step["sharded_error"], step


def test_ab_kernels_smoke(tmp_path):
    """The A/B tool times this tree's decode and append through the public API (tiny shapes, CPU)."""
    out = tmp_path / "ab.json"
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "tools", "ab_kernels.py"), "--tree", ROOT, "--label",
                           "now", "--smoke", "--out", str(out)], cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [len(res["decode"]), len(res["append"])] == [1, 1] and all(
        r["ms"] > 0 for r in res["decode"] + res["append"]), res


def test_bridge_parts_smoke(tmp_path):
    """The bridge attribution tool runs a decode step through `TorchKVCache` and times every part (CPU, tiny)."""
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "tools", "bridge_parts.py"), "--smoke", "--out",
                           str(tmp_path)], cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "bridge_parts.json").read_text())
    timed = [v for k, v in res.items() if k.split("_")[0] in ("loop", "plan", "cross", "program", "floor")]
    assert len(timed) == 23 and all(isinstance(v, list) and 0 < v[0] <= v[1] for v in timed), res
    assert res["entry_fusions"] > 0 and res["entry_parameters"] > 0, res


def test_generate_parts_smoke(tmp_path):
    """The generate() attribution tool times DynamicCache's and the fused `JMixedKVCache`'s pieces per decode step:
    per layer (2 layers) and once per step where the step's work happens (CPU, tiny)."""
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "tools", "generate_parts.py"), "--smoke", "--reps", "1",
                           "--out", str(tmp_path)], cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "generate_parts.json").read_text())["caches"]
    calls = {name: {k: v["calls"] for k, v in r["pieces_per_decode_step"].items()} for name, r in res.items()}
    assert calls["DynamicCache"] == {"DynamicCache update": 2.0, "sdpa attention": 2.0}, calls
    mixed = calls["JMixedKVCache mixed (4, 64) fused"]
    assert mixed["JMixedKVCache update"] == mixed["jmixedkv attention"] == mixed["placeholder K/V"] == 2.0, mixed
    # every step is checked as it comes; the 16-token prompt and the 3 decode steps form one run of held steps:
    # its views are made once (1 / 3 per decode step) and nothing is stored while it lasts
    assert mixed["reserve_step (step)"] == 1.0 and abs(mixed["read_views (step)"] - 1 / 3) < 1e-9, mixed
    assert mixed.get("flush (step)", 0.0) == 0.0 and "write_step" not in mixed, mixed
    # a difference of two wall times: on a loaded CPU with 3 tokens it can come out negative (it times nothing real)
    assert all(math.isfinite(r["us_per_decode_step"]) for r in res.values()), res


def test_accuracy_research_smoke(tmp_path):
    """The accuracy study's variants (per-channel K, an oracle twin) score against the bf16 cache on a real text
    with the GGUF model cut to 2 layers: every variant's KL is finite and positive, and each variant changes what
    the cache serves (its KL differs from `recommended()`'s)."""
    text = os.path.join(BENCH, "texts", "chat.txt")
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "tools", "accuracy_research.py"), "--layers", "2",
                           "--tokens", "160", "--window", "16", "--texts", text, "--out", str(tmp_path)], cwd=ROOT,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    kl = json.loads((tmp_path / "accuracy_research.json").read_text())["kl"]["chat"]
    assert len(kl) == 11 and all(math.isfinite(v) and v > 0 for v in kl.values()), kl
    assert all(v != kl["recommended"] for k, v in kl.items() if k not in ("recommended", "fp8")), kl


def test_hf_ab_smoke(tmp_path):
    """The generate() A/B (kernel-kept rows, direct launches, their "before" forms, DynamicCache) runs end to end on
    CPU through the torch reference path: every variant's tokens equal its "before" variant's and DynamicCache's
    (random weights, every row served as given), and every time is finite (3 steps on a loaded CPU: their sign
    is noise)."""
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "tools", "hf_ab.py"), "--smoke", "--out",
                           str(tmp_path)], cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "hf_ab.json").read_text())["variants"]
    assert len(rows) == 8 and all(r["tokens_equal_before"] and r["tokens_equal_dynamic"]
                                  and math.isfinite(r["ms_per_step_min"]) for r in rows), rows


def test_decode_bench_variants_name_both_backends():
    """``--variants``: ``k..w..`` forms are Triton configs, ``m[s][t][v][x]`` forms Mosaic GPU ones (stages, K's
    halves in turn, the head_dim-256 V tiles in turn, a split multiplier of the default count); a bad form is
    refused naming both."""
    import decode_bench
    from pallas_kernels.decode import MosaicConfig, TritonConfig
    from pallas_kernels.decode.config import mosaic_num_splits
    _, f = decode_bench.parse_variant("ms3t1v1x2")
    assert f == dict(backend="mosaic", stages=3, split_mult=2.0, v_in_turn=True, qk_in_turn=True)
    g = decode_bench.BenchGeometry(head_dim=256, gqa=2)
    cfg = decode_bench.variant_config(f, g, 16, 32768, 1)
    assert isinstance(cfg, MosaicConfig) and cfg.stages == 3 and cfg.qk_in_turn and cfg.v_in_turn
    assert cfg.num_splits == 2 * mosaic_num_splits(16, g.kv_heads, 512)
    assert decode_bench.parse_variant("m")[1] == dict(backend="mosaic", stages=2, split_mult=1.0)
    assert decode_bench.parse_variant("mv0")[1]["v_in_turn"] is False
    assert isinstance(decode_bench.variant_config(decode_bench.parse_variant("k64w4")[1], g, 16, 32768, 1),
                      TritonConfig)
    with pytest.raises(ValueError, match="m\\[s<stages>\\]"):
        decode_bench.parse_variant("q7")
