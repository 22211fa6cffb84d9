"""Smoke test of `bench/tp_bench.py` on CPU: 2 host devices, reference backend, tiny sizes, no sweep / trace.

Checks that one unattended run produces every diagnostic (variants, per-device times, HLO counts) with no failed
step, that the sharded and per-shard outputs are bit-equal to the 1-device output, and that the bench's pool
pools (built by init_state) avoid the (2^31, 2^32]-byte range where the kernel's 32-bit offsets would wrap."""
import json
import os
import subprocess
import sys

import jax

import jmixedkv as jm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))


def test_pool_pages_avoids_signed_32bit_wrap():
    from tp_bench import pool_pages
    cfg = jm.KVCacheConfig("mixed_nvfp4_bf16", first_n=64, last_n=64, page_size=64)
    spec = jm.GroupSpec(1, 8, 128)
    page_bytes = 2 * 8 * 64 * 64
    for batch, padded in ((32, False), (64, False), (128, True), (256, False)):
        pages, pad = pool_pages(cfg, spec, batch, 32768)
        assert pad == padded and pages == batch * 512, batch
        # the bench no longer pads: init_state does (the data array of the state it builds is out of the hole)
        st = jax.eval_shape(lambda: jm.init_state(cfg, spec, pages, batch, 512))
        data_pages = st.pools[0].low.data.shape[1]
        assert (data_pages > pages) == pad and not 2 ** 31 < data_pages * page_bytes <= 2 ** 32, (batch, pages)


def test_tp_bench_smoke_cpu(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "tp_bench.py"), "--smoke", "--no-md",
                           "--no-sweep", "--no-trace", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.load(open(tmp_path / "tp_bench.json"))
    assert res["errors"] == [], res["errors"]
    assert [r["devices"] for r in res["rows"]] == [1, 2] and res["rows"][1]["bit_equal_to_single"] is True
    v = res["variants"]
    for name in ("single8_dev0", "sharded_fixed_current", "alone4_fixed_dev0", "manual_tp_fixed",
                 "alone4_fixed_dev1", "sharded_fixed_preplaced", "sharded_default_preplaced",
                 "alone4_default_dev0", "single8_dev1"):
        assert v[name]["ms"] > 0 and v[name]["pipelined_ms"] > 0, name
        if name != "single8_dev0":
            assert v[name]["bit_equal"] is True, name   # the reference backend ignores num_splits
    for name in ("manual_tp_fixed", "sharded_fixed_preplaced"):
        assert set(res["per_device"][name]) == {"ready_0_ms", "ready_1_ms", "dispatch_ms"}
    h = res["hlo"]["sharded_fixed_preplaced"]
    assert h["collectives_total"] == 0 and h["out_sharded_as_expected"] is True
    assert "'tp'" in h["input_sharding_q"]
    assert (tmp_path / "tp_bench_hlo.txt").stat().st_size > 0
    assert "speed-up" in proc.stdout
