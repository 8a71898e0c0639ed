#!/usr/bin/env python
"""The acceptance figures of a GPU run, from what ``scripts/gpu_check`` wrote to its
output folder: ``summary.json`` there, and one table printed.

Each check is a figure, its bar and whether the figure meets it: the CUDA tests' failures;
the weight sync of 1 GiB to 4 receivers on one GPU (``broadcast`` and ``send`` against
the bound and against CUDA IPC handles through Ray; the pushed sync against the bound;
``send_tensor`` one tensor at a time;
1 GiB to 1 into fresh tensors), of 16 GiB to 4 (against the bound, with the receivers'
peak extra GPU memory); a 4 B CUDA message streamed and as a ping-pong against the
hand-off floor measured in the same run, without NVIDIA MPS and under it; the GPU memory
that 1,000 syncs more leave behind. A figure that the run did not produce is reported as
not measured, never as met. The summary also holds each test's result and each step's
exit status and seconds.

    python scripts/gpu_summary.py gpu-out
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

GIB = 1 << 30
#: The test runs of gpu_check whose results the summary lists, by junit file.
TEST_FILES = {"cuda": "cuda_tests.xml"}


def _json(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return json.loads(path.read_text()).get("records", [])


def junit_results(path: Path) -> dict[str, str] | None:
    """Each test's outcome (passed, failed, error, skipped) by its id, from a junit XML
    file; None where there is no such file (the step did not run)."""
    if not path.is_file():
        return None
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = "failed" if child.tag == "failure" else child.tag
        out[name] = outcome
    return out


def _steps(path: Path) -> dict[str, dict[str, int]]:
    """gpu_check's steps: exit status and seconds, by name (``steps.tsv``)."""
    out = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            name, rc, seconds = line.split("\t")
            out[name] = {"exit": int(rc), "seconds": int(seconds)}
    return out


def _check(name: str, value: float | None, bar: float, at_most: bool = True,
           unit: str = "x") -> dict[str, Any]:
    ok = None if value is None else (value <= bar if at_most else value >= bar)
    return {"check": name, "value": value, "bar": f"{'<=' if at_most else '>='} {bar:g}{unit}",
            "ok": ok}


def _ms(records: list[dict[str, Any]], path: str, n: int, nbytes: int) -> dict | None:
    for r in records:
        if (r["case"] == "sync" and r["path"] == path and r["receivers"] == n
                and r.get("bytes", GIB) == nbytes):
            return r
    return None


def _over(a: dict | None, b: dict | None) -> float | None:
    return None if a is None or b is None else a["ms"] / b["ms"]


def _us(records: list[dict[str, Any]], path: str, mps: bool) -> float | None:
    for r in records:
        if r["case"] == "message" and r["path"] == path and r["bytes"] == 4 and r["mps"] == mps:
            return r["us"]
    return None


def checks(sync: list[dict[str, Any]], sync16: list[dict[str, Any]],
           message: list[dict[str, Any]], cuda: dict[str, str] | None) -> list[dict[str, Any]]:
    """The acceptance checks of a run (see the module docstring)."""
    out = []
    failed = None if cuda is None else sum(v in ("failed", "error") for v in cuda.values())
    out.append(_check("CUDA tests failed", failed, 0, unit=""))
    bound = _ms(sync, "bound", 4, GIB)
    handles = _ms(sync, "handles through Ray", 4, GIB)
    for path in ("broadcast", "send"):
        r = _ms(sync, path, 4, GIB)
        out.append(_check(f"1 GiB to 4, {path} over the bound", _over(r, bound), 1.5))
        out.append(_check(f"1 GiB to 4, handles through Ray over {path}", _over(handles, r),
                          10, at_most=False))
    out.append(_check("1 GiB to 4, push over the bound", _over(_ms(sync, "push", 4, GIB), bound),
                      1.5))
    bound16 = _ms(sync16, "bound", 4, 16 * GIB)
    for path in ("broadcast", "send", "push"):
        r = _ms(sync16, path, 4, 16 * GIB)
        out.append(_check(f"16 GiB to 4, {path} over the bound", _over(r, bound16), 1.5))
        out.append(_check(f"16 GiB to 4, {path}: a receiver's peak extra GPU memory",
                          None if r is None else r.get("receiver_peak_extra_mib"), 64,
                          unit=" MiB"))
    out.append(_check("1 GiB to 4, send_tensor per tensor over the bound",
                      _over(_ms(sync, "send_tensor", 4, GIB), bound), 3))
    out.append(_check("1 GiB to 1, send into fresh tensors over the bound",
                      _over(_ms(sync, "send_fresh", 1, GIB), _ms(sync, "bound", 1, GIB)), 2))
    for mps, bar in ((False, 1.5), (True, 2.0)):
        for how in ("streamed", "ping-pong"):
            ours, floor = _us(message, f"rlcomm {how}", mps), _us(message, f"floor {how}", mps)
            out.append(_check(
                f"4 B message {how}{' under MPS' if mps else ''} over the floor",
                None if ours is None or floor is None else ours / floor, bar))
    soak = next((r for r in sync if r["case"] == "soak"), None)
    out.append(_check(
        f"GPU memory left by {soak['rounds'] if soak else 1000} syncs more "
        "(allocated, the most of any worker)",
        None if soak is None else soak["allocated_growth_mib"], 0, unit=" MiB"))
    return out


def summarize(out: Path) -> dict[str, Any]:
    """The summary of the run whose outputs are in ``out``."""
    tests = {k: junit_results(out / f) for k, f in TEST_FILES.items()}
    sync = _json(out / "bench_gpu_sync.json")
    found = checks(sync, _json(out / "bench_gpu_sync16.json"),
                   _json(out / "bench_gpu_message.json"), tests["cuda"])
    return {
        "all_met": all(c["ok"] is True for c in found),
        "checks": found,
        "soak": next((r for r in sync if r["case"] == "soak"), None),
        "tests": tests,
        "steps": _steps(out / "steps.tsv"),
    }


def table(summary: dict[str, Any]) -> str:
    """The summary as one table, then the tests that did not pass."""
    rows = [("check", "value", "bar", "result")]
    for c in summary["checks"]:
        v = c["value"]
        value = "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))
        result = {True: "met", False: "NOT MET", None: "not measured"}[c["ok"]]
        rows.append((c["check"], value, c["bar"], result))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    for kind, results in summary["tests"].items():
        if results is None:
            lines.append(f"{kind} tests: not run")
            continue
        counts = {o: sum(v == o for v in results.values())
                  for o in ("passed", "failed", "error", "skipped")}
        lines.append(f"{kind} tests: " + ", ".join(f"{n} {o}" for o, n in counts.items() if n))
        lines += [f"  {o}: {name}" for name, o in results.items() if o in ("failed", "error")]
    for name, step in summary["steps"].items():
        lines.append(f"step {name}: exit {step['exit']} in {step['seconds']} s")
    lines.append("every check met" if summary["all_met"] else "not every check met")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: gpu_summary.py OUT_DIR")
    out = Path(sys.argv[1])
    summary = summarize(out)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(table(summary))


if __name__ == "__main__":
    main()
