"""scripts/bench_flows.py: its tables from known numbers, and a tiny end-to-end run."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.markers import bench_smoke
from tests.test_examples import ROOT, ray_host, run_example  # noqa: F401 - the fixture by name

sys.path.insert(0, os.path.join(ROOT, "scripts"))


def test_tables_give_rlcomm_over_each_baseline():
    import bench_flows
    from _flows_runs import rollout_record, sync_record

    mib = 1 << 20
    results = {
        "weight_sync": [sync_record("rlcomm broadcast", 4, 256 * mib, [0.010, 0.012, 0.011]),
                        sync_record("ray zero-copy", 4, 256 * mib, [0.055])],
        "rollout": [rollout_record("rlcomm send/recv", 1 << 30, [0.5, 0.5, 0.5, 0.1, 0.1]),
                    rollout_record("raw gloo send/recv", 1 << 30, [0.25, 0.25, 0.25, 0.4])],
        "stream": [bench_flows.stream_record("rlcomm channel", "1 KiB", "one", 100, 1, [2000.0]),
                   bench_flows.stream_record("pyzmq ipc", "1 KiB", "one", 100, 1, [8000.0])],
        "skipped": [{"flow": "all", "path": "rlinf", "why": "RLinf is not installed"}],
    }
    out = bench_flows.tables(results)
    assert "rlcomm broadcast vs ray zero-copy" in out and "5.00x" in out
    # cold: 1 GiB / 0.5 s against 1 GiB / 0.25 s; warm: 0.1 s against 0.4 s
    assert "rlcomm send/recv vs raw gloo send/recv" in out and "0.50x" in out and "4.00x" in out
    assert "0.25x" in out  # 2000 items/s against pyzmq's 8000
    assert "rlinf (RLinf is not installed)" in out


@pytest.mark.slow
@bench_smoke("~25 processes")
@pytest.mark.timeout(900)
def test_bench_flows_quick_end_to_end(request, tmp_path):
    # About 25 processes start (workers, actors, channel workers): 465 s on the shared
    # 2-core machine at load ~25 beside a full bench run; far less on a quiet one.
    out_json, out_png = tmp_path / "flows.json", tmp_path / "flows.png"
    out = run_example(
        request.getfixturevalue("ray_host"), "scripts/bench_flows.py", "--quick", "--sync-mib", "2", "--receivers", "1,2",
        "--rollout-mib", "4", "--repeats", "1", "--stream-scale", "0.01",
        "--stream-repeats", "1", "--no-rlinf", "--json", str(out_json), "--plot", str(out_png),
        timeout=840,
    )
    assert "Weight sync, 2 MiB state dict" in out and "Channel stream" in out
    got = json.loads(out_json.read_text())
    assert {"args", "machine", "weight_sync", "rollout", "stream", "skipped"} <= set(got)
    sync = {(r["path"], r["receivers"]) for r in got["weight_sync"]}
    for path in ("rlcomm broadcast", "rlcomm send to each", "rlcomm broadcast, rlcomm.empty",
                 "rlcomm send, rlcomm.empty", "raw gloo broadcast", "ray zero-copy",
                 "ray default"):
        assert {(path, 1), (path, 2)} <= sync, sync
    assert all(r["median_s"] > 0 for r in got["weight_sync"])
    roll = {r["path"]: r for r in got["rollout"]}
    assert set(roll) == {"rlcomm send/recv", "rlcomm send, rlcomm.empty", "rlcomm channel",
                         "raw gloo send/recv", "ray zero-copy", "ray default"}
    assert all(len(r["cold_s"]) == 3 and r["warm_GBps"] > 0 for r in roll.values())
    stream = {(r["path"], r["kind"], r["mode"]) for r in got["stream"]}
    for path in ("rlcomm channel", "ray.util.queue"):
        for kind in ("1 KiB", "1 MiB"):
            assert {(path, kind, "one"), (path, kind, "batched")} <= stream, stream
    assert any(s["path"] == "rlinf" for s in got["skipped"])
    assert out_png.stat().st_size > 1000
