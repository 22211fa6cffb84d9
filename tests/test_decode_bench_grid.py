"""`bench/decode_bench.py --grid` bookkeeping on the CPU: the row order, `--shard I/N` (the shards partition the
grid), `--merge` (rows back in grid order; shards from different devices / versions or a row measured twice are
refused with the offending values)."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import decode_bench as db  # noqa: E402

GEOS = "4/16/1,4/16/4,4/64/1,4/64/4,8/16/1,8/16/4,8/64/1,8/64/4"


def test_grid_order_is_geometry_major_and_covers_the_issue_grid():
    order = db.grid_order("1,16,64", "4096,32768,131072", GEOS)
    assert len(order) == 72 and len(set(order)) == 72
    assert order[:3] == [(1, 4096, 4, 16, 1), (1, 32768, 4, 16, 1), (1, 131072, 4, 16, 1)]
    assert order[9] == (1, 4096, 4, 16, 4)
    with pytest.raises(ValueError, match="GQA/page/Tq"):
        db.grid_order("1", "4096", "4/16")


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_shards_partition_the_grid(n):
    order = db.grid_order("1,16,64", "4096,32768,131072", GEOS)
    shards = [db.shard_rows(order, (i, n)) for i in range(n)]
    assert sorted(r for s in shards for r in s) == sorted(order)
    assert sum(len(s) for s in shards) == len(order)
    assert max(len(s) for s in shards) - min(len(s) for s in shards) <= 1


@pytest.mark.parametrize("bad", ["4", "4/4", "-1/2", "a/b", "1/0"])
def test_parse_shard_refuses(bad):
    with pytest.raises(ValueError, match="--shard"):
        db.parse_shard(bad)
    assert db.parse_shard(None) == (0, 1) and db.parse_shard("2/4") == (2, 4)


def _shard(rows, bw, device="NVIDIA H200", date="2026-12-02T10:00:00+00:00"):
    return dict(date=date, device=device, jax="0.11.2", triton="3.6.0", torch="2.11", heads=8, head_dim=128,
                first_n=64, last_n=64, layers=1, copy_bandwidth_tbs=bw, copy_bandwidth_how="torch copy",
                rows=[dict(batch=b, context=c, gqa=g, page=p, tq=t, default_ms=0.1 * (k + 1),
                           copy_bandwidth_tbs=bw) for k, (b, c, g, p, t) in enumerate(rows)], skipped=[])


def test_merge_puts_rows_in_grid_order_and_keeps_each_bandwidth():
    order = db.grid_order("1,16", "4096", "4/16/1,8/64/4")
    a, b = db.shard_rows(order, (0, 2)), db.shard_rows(order, (1, 2))
    m = db.merge_grids([_shard(b, 4.20), _shard(a, 4.26, date="2026-12-02T09:00:00+00:00")], order)
    assert [(r["batch"], r["context"], r["gqa"], r["page"], r["tq"]) for r in m["rows"]] == order
    assert m["copy_bandwidth_range_tbs"] == [4.20, 4.26] and m["shards"] == 2
    assert m["date"] == "2026-12-02T09:00:00+00:00"
    assert {r["copy_bandwidth_tbs"] for r in m["rows"]} == {4.20, 4.26}


def test_merge_lists_as_skipped_only_rows_no_shard_measured():
    order = db.grid_order("16,64", "4096", "4/16/1,8/64/4")
    first = _shard(order[:2], 4.25)
    first["skipped"] = [list(r) for r in order[2:]]          # the time budget cut the last two rows
    rerun = _shard(order[2:3], 4.24)                          # a later call measured one of them
    m = db.merge_grids([first, rerun], order)
    assert m["skipped"] == [list(order[3])]
    assert len(m["rows"]) == 3


def test_merge_refuses_other_devices_and_duplicate_rows():
    order = db.grid_order("1", "4096", "4/16/1,4/16/4")
    with pytest.raises(ValueError, match="A100"):
        db.merge_grids([_shard(order[:1], 4.2), _shard(order[1:], 4.2, device="A100")], order)
    with pytest.raises(ValueError, match="more than one shard"):
        db.merge_grids([_shard(order, 4.2), _shard(order[:1], 4.2)], order)
    with pytest.raises(ValueError, match="no grid results"):
        db.merge_grids([], order)


def test_main_merge_writes_one_grid(tmp_path, capsys):
    order = db.grid_order("1,16", "4096", "4/16/1")
    paths = []
    for i in range(2):
        p = tmp_path / f"s{i}.json"
        p.write_text(json.dumps(_shard(db.shard_rows(order, (i, 2)), 4.25)))
        paths.append(str(p))
    assert db.main(["--merge", *paths, "--out", str(tmp_path / "m"), "--batches", "1,16", "--contexts", "4096",
                    "--geos", "4/16/1"]) == 0
    merged = json.loads((tmp_path / "m" / "decode_bench-grid.json").read_text())
    assert [r["batch"] for r in merged["rows"]] == [1, 16]
    out = capsys.readouterr().out
    assert "2 shards" in out and "   1 x    4k" in out and "  16 x    4k" in out
    with pytest.raises(SystemExit):
        db.main(["--merge", *paths, "--out", str(tmp_path), "--shard", "5/2"])


def _row(b, c, ms, floor, cudnn=None, **kw):
    return dict(batch=b, context=c, gqa=4, page=16, tq=1, default_ms=ms, floor_nvfp4_ms=floor, cudnn_ms=cudnn, **kw)


def test_grid_targets_counts_each_target_by_the_chosen_time():
    rows = [_row(16, 32768, 0.20, 0.144, 0.49, default_step_ms=0.21),     # 1.39x floor, faster than cuDNN
            _row(16, 32768, 0.30, 0.144, 0.49, default_step_ms=0.22),     # 2.08x end to end, 1.53x in a step
            _row(64, 131072, 4.20, 2.30, 8.30),                           # 1.83x: a 512k miss; no step time
            _row(64, 4096, 0.33, 0.079, 0.265, default_step_ms=0.30),     # 256k tokens: slower than cuDNN (0.80x)
            _row(1, 4096, 0.10, 0.001, 0.05)]                             # 4k tokens: in no target
    t = db.grid_targets(rows)
    assert t["16x32k"] == (1, 2) and t["512k"] == (1, 3) and t["cudnn_128k"] == (3, 4)
    assert t["misses"]["16x32k"] == [(16, 32768, 4, 16, 1, 2.083)]
    assert t["misses"]["512k"] == [(16, 32768, 4, 16, 1, 2.083), (64, 131072, 4, 16, 1, 1.826)]
    assert t["misses"]["cudnn_128k"] == [(64, 4096, 4, 16, 1, 0.803)]
    s = db.grid_targets(rows, "default_step_ms")              # rows without the time are not counted
    assert s["16x32k"] == (1, 2) and s["512k"] == (2, 2) and s["cudnn_128k"] == (2, 3)
    assert s["misses"]["16x32k"] == [(16, 32768, 4, 16, 1, 1.528)]
    assert "in a step: 16 x 32k <= 1.5x floor 1/2" in db.targets_text(rows)


def test_time_in_step_runs_every_call_inside_one_executable():
    """`time_in_step`: ten calls per execution of its jitted loop (none hoisted or merged: a host callback in ``fn``
    fires once per call), each reading the ``kv_lens`` argument; returns ms per call."""
    import jax
    import jax.numpy as jnp
    calls = []

    def fn(q, pt, lens):
        jax.debug.callback(lambda n: calls.append(int(n)), lens[0])
        return q * lens[0].astype(q.dtype)

    ms = db.time_in_step(fn, jnp.ones((2, 4), jnp.float32), jnp.zeros((2, 3), jnp.int32), jnp.full((2,), 7, jnp.int32))
    assert ms > 0
    executions = 2 + 15 * 10                     # `time_jax`: 2 warm-up calls, then 15 trials of 10
    assert len(calls) == 10 * executions and set(calls) == {7}
