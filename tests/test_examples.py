"""The examples, run as a user would on a cluster (``RAY_ADDRESS`` set), in their quick
modes. They attach to one Ray that a helper process holds (:mod:`tests.ray_host`), so Ray
starts once for all of them, not once per example (about 6 s each); each example is a job
of its own there, as on a cluster. ``scripts/check_wheel`` runs ``quickstart.py`` on a
Ray that it starts, as a user's first run does.
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import time

import pytest

from tests.waiting import wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


#: Lines that read like a failure: Python logging at WARNING and above, Python warnings,
#: tracebacks, and Ray's own C++ log lines at warning (W) or error (E).
_ALARMING = re.compile(
    r"\b(WARNING|ERROR|CRITICAL)\b|\w+Warning: |^Traceback \(most recent call last\)"
    r"|^\[[\d\- :,]+ [WEF] \d+ \d+\]"
)


def alarming_lines(text: str) -> list[str]:
    """The lines of ``text`` (tqdm's carriage returns split too) that look like failures."""
    lines = text.replace("\r", "\n").splitlines()
    return [line for line in lines if _ALARMING.search(re.sub(r"\x1b\[[0-9;]*m", "", line))]


class RayHost:
    """The helper process of :mod:`tests.ray_host` and its Ray."""

    def __init__(self, timeout: float = 120.0):
        env = dict(os.environ, PYTHONPATH=ROOT, RAY_ADDRESS="local")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.ray_host"], cwd=ROOT, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        first = json.loads(self._line(timeout))
        self.address: str = first["address"]
        #: What a process attaching to it needs in its environment.
        self.env: dict[str, str] = {**first["env"], "RAY_ADDRESS": self.address}

    def _line(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while not select.select([self.proc.stdout], [], [], 0.5)[0]:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise AssertionError(f"tests.ray_host gave no answer within {timeout:.0f}s")
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise AssertionError(f"tests.ray_host exited ({self.proc.wait(timeout=60)})")
        return line.strip()

    def named(self) -> set[tuple[str, str]]:
        """The named actors alive on the host's Ray."""
        self.proc.stdin.write("named\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return {(ns, name) for ns, name in json.loads(self._line(60.0))}

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()  # its Ray shuts down
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def ray_host():
    host = RayHost()
    try:
        yield host
    finally:
        host.close()


def run_example(host: RayHost, *args: str, timeout: float = 240) -> str:
    """Run an example as a user would, attached to ``host``'s Ray; its stdout. Fails if
    it exits non-zero or if a normal run prints anything that looks like a failure
    (WARNING, ERROR, a traceback). Returns once the example's named actors are gone, so
    the next one starts on a Ray as free as this one found it."""
    before = host.named()
    env = dict(os.environ, PYTHONPATH=ROOT, **host.env)
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    alarming = alarming_lines(proc.stdout + "\n" + proc.stderr)
    assert not alarming, f"{args} printed lines that read like failures:\n" + "\n".join(alarming)
    wait_for(lambda: not host.named() - before, f"the actors of {args[0]} gone after it",
             timeout=60, interval=0.2)
    return proc.stdout


def test_alarming_lines_are_recognised():
    sample = (
        "ok\n\x1b[36m(Actor pid=1)\x1b[0m WARNING rlcomm.x: slow\nfoo.py:3: UserWarning: hm\n"
        "[2026-11-23 21:30:36,676 E 25249 25249] logging.cc:474: boom\nbar\r"
        "ERROR rlcomm: x\nTraceback (most recent call last):\nwarnings are fine in prose\n"
    )
    assert len(alarming_lines(sample)) == 5


@pytest.mark.timeout(300)
def test_hello_workers(ray_host):
    out = run_example(ray_host, "examples/hello_workers.py")
    assert "all_reduce of ones on every rank -> [4.0, 4.0, 4.0, 4.0]" in out
    assert "execute_on(0, 3).hello() -> ['hello from greeters:0', 'hello from greeters:3']" in out
    assert "replied [0.0, 2.0, 4.0, 6.0]" in out


@pytest.mark.timeout(300)
def test_quickstart(ray_host):
    out = run_example(ray_host, "examples/quickstart.py")
    assert "[8] [torch.Size([8]), torch.Size([8])]" in out


@pytest.mark.timeout(300)
def test_rollout_to_trainer_quick(ray_host, tmp_path):
    plot = tmp_path / "curve.png"
    out = run_example(ray_host, "examples/rollout_to_trainer.py", "--quick", "--plot",
                      str(plot))
    updates = int(re.search(r"updates\s+(\d+)", out).group(1))
    assert updates == 5, out
    assert int(re.search(r"episodes trained on\s+(\d+)", out).group(1)) >= 5 * 16
    assert float(re.search(r"episodes through the channel\s+([\d.]+) [KMG]?B", out).group(1)) > 0
    assert re.search(r"weights broadcast \(to all workers\)\s+[1-9][\d.]* [KMG]?B", out), out
    assert "never solves CartPole" in out
    assert "not solved (expected: --quick" in out
    assert int(re.search(r"policy version reached\s+(\d+)", out).group(1)) == updates
    assert plot.exists() and plot.stat().st_size > 1000


@pytest.mark.timeout(300)
def test_asyncio_pipeline(ray_host):
    out = run_example(ray_host, "examples/asyncio_pipeline.py", "--items", "200")
    assert "all items arrived exactly once" in out
    assert "event loop: uvloop" in out
    m = re.search(r"deepest queue seen: prompts (\d+), scored (\d+) \(bound (\d+)\)", out)
    assert m and int(m.group(1)) <= int(m.group(3)) and int(m.group(2)) <= int(m.group(3))


@pytest.mark.timeout(300)
def test_p2p_bandwidth_example(ray_host):
    # The compiled-graph rows compile a graph per case: bench_p2p's own runs show them.
    # One fresh pair for the cold row: each pair is two more worker processes. One size:
    # the example's run, not the sizes (bench_p2p's own runs show those).
    out = run_example(ray_host, "examples/p2p_bandwidth.py", "--sizes", "4",
                      "--repeats", "1", "--latency-repeats", "2", "--cold-repeats", "1",
                      "--no-graph")
    assert "Bandwidth, GB/s" in out and "raw gloo" in out and "send/recv" in out
    assert "First send/recv of a fresh pair" in out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_weight_sync_tp_example(ray_host):
    out = run_example(ray_host, "examples/weight_sync_tp.py", "--quick")
    syncs = [line for line in out.splitlines() if line.startswith("sync ")]
    assert len(syncs) == 2 and all("values checked: True" in line for line in syncs), out
    # Each TP-2 rank read about half of the 11 MiB: only its shards.
    assert "read [5, 5, 5, 5] MiB" in syncs[-1], out


@pytest.mark.timeout(600)
def test_rollout_to_trainer_solves_cartpole(ray_host, tmp_path):
    out = run_example(ray_host, "examples/rollout_to_trainer.py", "--plot",
                      str(tmp_path / "c.png"), timeout=540)
    assert "SOLVED" in out, out[-2000:]
