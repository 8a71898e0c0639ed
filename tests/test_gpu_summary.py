"""The summary of a GPU run (``scripts/gpu_summary.py``), on the files that
``scripts/gpu_check`` writes, made here as a run would leave them: every acceptance figure
worked out from its records, none met by default where the run did not produce it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from gpu_summary import GIB, summarize, table  # noqa: E402

from tests.markers import bench_smoke  # noqa: E402
from tests.test_examples import ray_host, run_example  # noqa: E402, F401 - the fixture by name

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.comm.test_cuda_ipc" name="test_a" time="0.1"/>
<testcase classname="tests.comm.test_cuda_ipc" name="test_b" time="0.1">
  <failure message="assert 1.0 == 2.0">trace</failure></testcase>
<testcase classname="tests.comm.test_gpu" name="test_c" time="0.0">
  <skipped message="needs two GPUs"/></testcase>
<testcase classname="tests.comm.test_gpu" name="test_d" time="0.0">
  <error message="fixture broke">trace</error></testcase>
</testsuite></testsuites>
"""


def _sync(path, n, ms, nbytes=GIB, receiver_peak=None):
    return {"case": "sync", "path": path, "receivers": n, "bytes": nbytes, "ms": ms,
            "min": ms, "max": ms, "trainer_peak_extra_mib": None,
            "receiver_peak_extra_mib": receiver_peak}


def _message(path, us, mps=False, nbytes=4):
    return {"case": "message", "path": path, "bytes": nbytes, "mps": mps, "us": us}


@pytest.fixture
def run(tmp_path):
    """A run's folder: the tests, the 1 GiB sync with its soak, the per-message case
    without MPS; no 16 GiB step, no MPS."""
    (tmp_path / "cuda_tests.xml").write_text(JUNIT)
    sync = [_sync("bound", 4, 2.8), _sync("broadcast", 4, 3.5), _sync("send", 4, 5.0),
            _sync("handles through Ray", 4, 43.6), _sync("send_tensor", 4, 7.0),
            _sync("bound", 1, 0.8), _sync("send_fresh", 1, 1.5), _sync("broadcast", 1, 1.0),
            {"case": "soak", "path": "broadcast", "receivers": 4, "rounds": 1000,
             "allocated_growth_mib": 0.0, "reserved_growth_mib": 2.0,
             "device_used_growth_mib": 2.0}]
    message = [_message("rlcomm streamed", 300.0), _message("floor streamed", 250.0),
               _message("rlcomm ping-pong", 600.0), _message("floor ping-pong", 300.0),
               _message("rlcomm streamed", 900.0, nbytes=1 << 20)]
    for name, records in (("bench_gpu_sync.json", sync), ("bench_gpu_message.json", message)):
        (tmp_path / name).write_text(json.dumps({"records": records}))
    (tmp_path / "steps.tsv").write_text("cuda_tests\t1\t120\nbench_sync\t0\t80\n")
    return tmp_path


def _by_name(summary):
    return {c["check"]: c for c in summary["checks"]}


def test_each_figure_is_worked_out_and_held_to_its_bar(run):
    checks = _by_name(summarize(run))
    expect = {
        "CUDA tests failed": (2, False),  # a failure and an error
        "1 GiB to 4, broadcast over the bound": (3.5 / 2.8, True),
        "1 GiB to 4, send over the bound": (5.0 / 2.8, False),
        "1 GiB to 4, handles through Ray over broadcast": (43.6 / 3.5, True),
        "1 GiB to 4, handles through Ray over send": (43.6 / 5.0, False),
        "1 GiB to 4, send_tensor per tensor over the bound": (7.0 / 2.8, True),
        "1 GiB to 1, send into fresh tensors over the bound": (1.5 / 0.8, True),
        "4 B message streamed over the floor": (1.2, True),
        "4 B message ping-pong over the floor": (2.0, False),
        "GPU memory left by 1000 syncs more (allocated, the most of any worker)": (0.0, True),
    }
    for name, (value, ok) in expect.items():
        assert checks[name]["value"] == pytest.approx(value), name
        assert checks[name]["ok"] is ok, name


def test_what_the_run_did_not_produce_is_not_measured_never_met(run):
    summary = summarize(run)
    missing = [c for c in summary["checks"] if c["ok"] is None]
    assert {c["check"] for c in missing} == {
        "16 GiB to 4, broadcast over the bound", "16 GiB to 4, send over the bound",
        "16 GiB to 4, broadcast: a receiver's peak extra GPU memory",
        "16 GiB to 4, send: a receiver's peak extra GPU memory",
        "1 GiB to 4, push over the bound", "16 GiB to 4, push over the bound",
        "16 GiB to 4, push: a receiver's peak extra GPU memory",
        "4 B message streamed under MPS over the floor",
        "4 B message ping-pong under MPS over the floor",
    }
    assert all(c["value"] is None for c in missing)
    assert summary["all_met"] is False


def test_the_16_gib_step_and_peak_memory_count_when_present(run):
    records = [_sync("bound", 4, 45.0, 16 * GIB),
               _sync("broadcast", 4, 60.0, 16 * GIB, receiver_peak=12.5),
               _sync("send", 4, 90.0, 16 * GIB, receiver_peak=80.0)]
    (run / "bench_gpu_sync16.json").write_text(json.dumps({"records": records}))
    checks = _by_name(summarize(run))
    assert checks["16 GiB to 4, broadcast over the bound"]["ok"] is True
    assert checks["16 GiB to 4, send over the bound"]["ok"] is False
    assert checks["16 GiB to 4, broadcast: a receiver's peak extra GPU memory"]["ok"] is True
    assert checks["16 GiB to 4, send: a receiver's peak extra GPU memory"]["ok"] is False


def test_a_sync_of_another_size_is_not_taken_for_the_one_the_bar_names(run):
    records = [_sync(p, 4, ms, 2 * GIB) for p, ms in (("bound", 2.8), ("broadcast", 3.0))]
    (run / "bench_gpu_sync.json").write_text(json.dumps({"records": records}))
    (run / "bench_gpu_sync16.json").write_text(json.dumps({"records": records}))
    checks = _by_name(summarize(run))
    for name in ("1 GiB to 4, broadcast over the bound", "16 GiB to 4, broadcast over the bound"):
        assert checks[name]["ok"] is None and checks[name]["value"] is None


def test_every_check_met_says_so(run):
    good = [_sync("bound", 4, 2.8), _sync("broadcast", 4, 3.0), _sync("send", 4, 3.2),
            _sync("push", 4, 3.1), _sync("handles through Ray", 4, 43.6), _sync("send_tensor", 4, 7.0),
            _sync("bound", 1, 0.8), _sync("send_fresh", 1, 1.5),
            {"case": "soak", "path": "broadcast", "receivers": 4, "rounds": 1000,
             "allocated_growth_mib": 0.0, "reserved_growth_mib": 0.0,
             "device_used_growth_mib": 0.0}]
    big = [_sync("bound", 4, 45.0, 16 * GIB), _sync("broadcast", 4, 50.0, 16 * GIB, 8.0),
           _sync("send", 4, 60.0, 16 * GIB, 8.0), _sync("push", 4, 48.0, 16 * GIB, 0.0)]
    message = [_message(f"{who} {how}", us, mps)
               for mps in (False, True) for how in ("streamed", "ping-pong")
               for who, us in (("rlcomm", 300.0), ("floor", 250.0))]
    for name, records in (("bench_gpu_sync.json", good), ("bench_gpu_sync16.json", big),
                          ("bench_gpu_message.json", message)):
        (run / name).write_text(json.dumps({"records": records}))
    (run / "cuda_tests.xml").write_text(JUNIT.replace(
        '<failure message="assert 1.0 == 2.0">trace</failure>', "").replace(
        '<error message="fixture broke">trace</error>', ""))
    summary = summarize(run)
    assert summary["tests"]["cuda"]["tests.comm.test_cuda_ipc::test_b"] == "passed"
    assert [c["check"] for c in summary["checks"] if c["ok"] is not True] == []
    assert summary["all_met"] is True
    assert table(summary).splitlines()[-1] == "every check met"


def test_the_command_writes_summary_json_and_prints_one_table(run):
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_summary.py"),
                           str(run)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    written = json.loads((run / "summary.json").read_text())
    assert written == json.loads(json.dumps(summarize(run)))
    out = done.stdout
    assert "1 GiB to 4, send over the bound" in out and "NOT MET" in out
    assert "not measured" in out
    assert "failed: tests.comm.test_cuda_ipc::test_b" in out
    assert "error: tests.comm.test_gpu::test_d" in out
    assert "cuda tests: 1 passed, 1 failed, 1 error, 1 skipped" in out
    assert "step cuda_tests: exit 1 in 120 s" in out
    assert out.splitlines()[-1] == "not every check met"


@pytest.mark.slow
@bench_smoke("7 workers")
@pytest.mark.timeout(900)
def test_the_sync_case_runs_on_cpu_tensors_into_a_summary(request, tmp_path):
    """bench_gpu.py's sync case, soak included, on CPU tensors: the code a GPU run takes
    for the 1 GiB step, at 4 MiB, and the summary of what it wrote."""
    out = run_example(
        request.getfixturevalue("ray_host"), "scripts/bench_gpu.py", "--case", "sync", "--device", "cpu", "--sync-bytes",
        str(4 << 20), "--sync-tensors", "8", "--receivers", "1,4", "--repeats", "1",
        "--soak", "20", "--json", str(tmp_path / "bench_gpu_sync.json"), timeout=840,
    )
    assert "broadcast over the bound" in out
    records = json.loads((tmp_path / "bench_gpu_sync.json").read_text())["records"]
    paths = {(r["path"], r["receivers"]) for r in records if r["case"] == "sync"}
    assert paths == {(p, n) for p in ("broadcast", "send", "send_fresh", "send_tensor", "bound")
                     for n in (1, 4)}
    soak = [r for r in records if r["case"] == "soak"]
    assert len(soak) == 1 and soak[0]["receivers"] == 4 and soak[0]["rounds"] == 20
    checks = {c["check"]: c for c in summarize(tmp_path)["checks"]}
    # 4 MiB is not the 1 GiB the bars name: measured, but not taken for them.
    assert checks["1 GiB to 4, broadcast over the bound"]["ok"] is None
