"""Reliability under pressure, with real Ray workers, sockets and signals: a mailbox held
by hundreds of idle connections still lets a new peer in at once; ``python -m rlcomm
status`` shows a job of 16 workers and 2 channels while one worker is stopped and one
is blocked in ``recv``; and a receive that times out says what its peer was doing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import ray

import rlcomm
from rlcomm import Channel, CollectiveGroupOptions, NodePlacementStrategy, Worker
from rlcomm.comm.identity.endpoint import decode_endpoint
from rlcomm.comm.identity.registry import registry
from rlcomm.errors import CommError
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(300)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GROUP = "hang"  # 16 workers
CHANNELS = ("hang_c1", "hang_c2")


class HangWorker(Worker):
    def pid(self) -> int:
        return os.getpid()

    def store_threads(self) -> list[str]:
        return sorted(t.name for t in threading.enumerate() if t.name.startswith("rlcomm-store"))

    def store_stats(self) -> dict:
        from rlcomm.comm.status import process_status

        return process_status()["process"]["store"]

    def send_one(self, obj, group, rank, timeout=30):
        self.send(obj, group, rank, options=CollectiveGroupOptions(timeout=timeout))

    def recv_one(self, group, rank, timeout=30):
        return self.recv(group, rank, options=CollectiveGroupOptions(timeout=timeout))

    def echo(self, group, rank, timeout=60):
        """Receive one message from ``(group, rank)`` and send it back."""
        msg = self.recv(group, rank, options=CollectiveGroupOptions(timeout=timeout))
        self.send(msg, group, rank, options=CollectiveGroupOptions(timeout=timeout))

    def ping(self, group, rank, timeout=30) -> float:
        """Seconds from this worker's first send to ``(group, rank)`` to its echo."""
        opts = CollectiveGroupOptions(timeout=timeout)
        start = time.monotonic()
        self.send("ping", group, rank, options=opts)
        assert self.recv(group, rank, options=opts) == "ping"
        return time.monotonic() - start

    def exchange(self, group, rank, count) -> int:
        for i in range(count):
            self.send(i, group, rank)
        return count

    def recv_numbered(self, group, rank, count) -> list:
        return [self.recv(group, rank) for _ in range(count)]

    def put_items(self, channel, key, count) -> None:
        ch = Channel.connect(channel)
        for i in range(count):
            ch.put(i, key=key)

    def async_recv_waits(self, group, rank) -> tuple[str, str]:
        """The errors of a short and of a long wait on an async recv that gets nothing."""
        work = self.recv(group, rank, async_op=True, options=CollectiveGroupOptions(timeout=60))
        texts = []
        for seconds in (0.2, 1.5):
            try:
                work.wait(timeout=seconds)
            except CommError as exc:
                texts.append(str(exc))
        return tuple(texts)

    def expect_error(self, method, *args, **kwargs):
        start = time.monotonic()
        try:
            getattr(self, method)(*args, **kwargs)
        except CommError as exc:
            return type(exc).__name__, str(exc), time.monotonic() - start
        return None, "no error", time.monotonic() - start


@pytest.fixture(scope="module")
def job(cluster):
    group = HangWorker.create_group().launch(cluster, NodePlacementStrategy([0] * 16), name=GROUP)
    channels = [Channel.create(name, maxsize=8) for name in CHANNELS]
    yield group
    for ch in channels:
        ch.shutdown()
    group.shutdown()


def _endpoint(address: str):
    return decode_endpoint(ray.get(registry().get_endpoint.remote(address), timeout=30))


def test_idle_connections_do_not_hold_a_mailbox_shut(cluster, job):
    """500 idle connections held to a worker's mailbox (reopened as the store drops
    them): a new peer connects and exchanges a message within 2 s, a live pair goes
    on, and the store still has one thread."""
    def target():
        return job.execute_on(0)

    job.execute_on(1).send_one("before", GROUP, 0).wait(timeout=60)
    assert target().recv_one(GROUP, 1).wait(timeout=60) == ["before"]
    threads_before = target().store_threads().wait(timeout=30)[0]
    ep = _endpoint(f"{GROUP}:0")
    holder = subprocess.Popen(
        [sys.executable, "-m", "tests.comm.idle_holder", ep.host, str(ep.port), "500", "60"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )
    newcomer = HangWorker.create_group().launch(cluster, NodePlacementStrategy([0]),
                                                name="hang_new")
    try:
        assert holder.stdout.readline().strip() == "holding 500"
        wait_for(lambda: target().store_stats().wait(timeout=30)[0]["unproven"] >= 450,
                  "the idle connections are not held")
        echo = target().echo("hang_new", 0)
        took = newcomer.ping(GROUP, 0).wait(timeout=60)[0]
        echo.wait(timeout=60)
        print(f"\nthe new peer's first exchange took {took:.3f}s beside 500 idle connections")
        assert took < 2.0, f"the new peer's first exchange took {took:.2f}s"
        # The pair connected before goes on, in order, while the connections are held.
        done = job.execute_on(1).exchange(GROUP, 0, 50)
        assert target().recv_numbered(GROUP, 1, 50).wait(timeout=60)[0] == list(range(50))
        done.wait(timeout=60)
        stats = target().store_stats().wait(timeout=30)[0]
        assert stats["unproven"] >= 100, stats  # still under attack
        assert target().store_threads().wait(timeout=30)[0] == threads_before == ["rlcomm-store"]
        # The store dropped idle connections at their deadline, and they came back.
        wait_for(lambda: target().store_stats().wait(timeout=30)[0]["no_proof_in_time"] >= 500,
                  "idle connections were not dropped")
    finally:
        holder.kill()
        holder.wait(timeout=30)
        newcomer.shutdown()


def _addresses(status: dict, group: str) -> dict[str, dict]:
    return {w["address"]: w for w in status["workers"] if w["group"] == group}


def test_status_shows_a_stopped_worker_and_a_blocked_recv(cluster, job):
    """``python -m rlcomm status`` on 16 workers and 2 channels: a stopped worker is
    listed as not answering, a blocked recv with its age, the channels' keys with their
    depth and clients; all within 3 s."""
    job.execute_on(2).put_items(CHANNELS[0], "rollouts", 3).wait(timeout=60)
    job.execute_on(2).put_items(CHANNELS[1], 7, 2).wait(timeout=60)
    job.execute_on(3).send_one("hello", GROUP, 4).wait(timeout=60)
    job.execute_on(4).recv_one(GROUP, 3).wait(timeout=60)
    blocked = job.execute_on(3).recv_one(GROUP, 4, 120)  # nothing comes
    stopped_pid = job.execute_on(5).pid().wait(timeout=30)[0]
    os.kill(stopped_pid, signal.SIGSTOP)
    try:
        env = dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address)
        start = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "rlcomm", "status", "--json"], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=120)
        cli_seconds = time.monotonic() - start
        assert out.returncode == 1, out.stderr  # 1: a process did not answer
        status = json.loads(out.stdout)
        assert status["took_s"] < 3.0, status["took_s"]
        assert cli_seconds < 3.0, f"the command took {cli_seconds:.2f}s in all"
        workers = _addresses(status, GROUP)
        assert sorted(workers) == sorted(f"{GROUP}:{r}" for r in range(16))
        assert workers[f"{GROUP}:5"]["state"] == "not answering"
        assert "did not answer" in workers[f"{GROUP}:5"]["problem"]
        assert all(w["state"] == "ok" for a, w in workers.items() if a != f"{GROUP}:5")
        three = workers[f"{GROUP}:3"]
        assert three["pid"] and three["host"] and three["node_id"]
        [pending] = three["pending"]
        assert (pending["op"], pending["peer"]) == ("recv", f"{GROUP}:4")
        peers = {c["peer"]: c for c in three["process"]["connections"]}
        assert peers[f"{GROUP}:4"]["transport"] == "shm"
        assert peers[f"{GROUP}:4"]["state"] == "open"
        assert [r["op"] for r in three["recent"]][-1] == "send"  # the flight recorder
        chans = {c["name"]: c for w in status["workers"] for c in w.get("channels") or []}
        assert {k["key"]: k["depth"] for k in chans[CHANNELS[0]]["keys"]} == {"rollouts": 3}
        assert {k["key"]: k["depth"] for k in chans[CHANNELS[1]]["keys"]} == {"7": 2}
        assert f"{GROUP}:2" in chans[CHANNELS[0]]["clients"]
        # The table, from the function, in this process.
        start = time.monotonic()
        table = rlcomm.job_status().table()
        assert time.monotonic() - start < 3.0
        assert "NOT ANSWERING" in table and "recv from hang:4" in table
        assert "CHANNELS" in table and "rollouts" in table
        print(f"\n`python -m rlcomm status --json` took {cli_seconds:.2f}s in all "
              f"(the gathering {status['took_s']:.2f}s)\n{table}")
    finally:
        os.kill(stopped_pid, signal.SIGCONT)
        job.execute_on(4).send_one("release", GROUP, 3).wait(timeout=60)
        assert blocked.wait(timeout=60) == ["release"]


def test_a_timed_out_recv_says_what_its_peer_is_doing(job):
    """trainer-like 6 waits for 7, which is blocked in a recv from 8: the error says so.
    A stopped peer cannot be asked, and the error says that instead."""
    blocked = job.execute_on(7).recv_one(GROUP, 8, 120)
    try:
        wait_for(lambda: any(
            w["address"] == f"{GROUP}:7" and w.get("pending")
            for w in rlcomm.job_status().workers
        ), "hang:7 is not in its recv")
        name, text, took = job.execute_on(6).expect_error("recv_one", GROUP, 7, 1.5).wait(
            timeout=60)[0]
        assert name == "CommTimeoutError", text
        assert (f"analysis: {GROUP}:6 is in recv from {GROUP}:7 since" in text
                and f"{GROUP}:7 is in recv from {GROUP}:8 since" in text), text
        assert took < 1.5 + 5
    finally:
        job.execute_on(8).send_one("release", GROUP, 7).wait(timeout=60)
        assert blocked.wait(timeout=60) == ["release"]
    # A short wait on an async op (polling) does not ask; a wait of a second or more does.
    short, long = job.execute_on(6).async_recv_waits(GROUP, 10).wait(timeout=60)[0]
    assert "analysis" not in short and "did not complete within 0.2s" in short, short
    assert f"analysis: {GROUP}:6 is in recv from {GROUP}:10 since" in long, long
    assert f"{GROUP}:10 is in no rlcomm op" in long, long
    job.execute_on(10).send_one("end", GROUP, 6).wait(timeout=60)  # the async recv takes it
    pid = job.execute_on(9).pid().wait(timeout=30)[0]
    os.kill(pid, signal.SIGSTOP)
    try:
        name, text, _ = job.execute_on(6).expect_error("recv_one", GROUP, 9, 1.5).wait(
            timeout=60)[0]
        assert name == "CommTimeoutError", text
        assert f"{GROUP}:9 could not be asked: it did not answer within 1 s" in text, text
    finally:
        os.kill(pid, signal.SIGCONT)
    # After it ran again, it answers: it made no op yet.
    name, text, _ = job.execute_on(6).expect_error("recv_one", GROUP, 9, 1).wait(timeout=60)[0]
    assert f"{GROUP}:9 is in no rlcomm op" in text, text


def test_the_command_sends_this_users_ray_token_to_an_address_it_was_given(monkeypatch, tmp_path):
    """Ray sends its token to an address given to ``ray.init`` only in token mode: the
    command turns it on when this user has a token, and leaves a mode that is set."""
    from rlcomm.__main__ import _token_auth_if_token_found

    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
        monkeypatch.setenv(name, "")  # recorded, so the test's changes are undone
        monkeypatch.delenv(name)
    token = tmp_path / "auth_token"
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    _token_auth_if_token_found()
    assert "RAY_AUTH_MODE" not in os.environ  # no token: Ray's own default
    token.write_text("0" * 32)
    _token_auth_if_token_found()
    assert os.environ["RAY_AUTH_MODE"] == "token"
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    _token_auth_if_token_found()
    assert os.environ["RAY_AUTH_MODE"] == "disabled"
