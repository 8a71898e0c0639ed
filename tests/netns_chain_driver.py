"""The driver of ``tests/test_netns.py``'s chain test: broadcasts along the chain of
emulated nodes (network namespaces on one bridge, links shaped with ``tc``), with a
relay killed with SIGKILL in the middle of the stream, a relay stopped with SIGSTOP past
the timeout, a member on a node that joins late, and payloads that are no multiple of
the chain's record size.

Usage: ``python tests/netns_chain_driver.py '<json>'`` inside the first node's namespace;
the JSON gives the head's address, the nodes' addresses and namespaces, the late node's
index, and a temp directory and log path for the late node. Prints one line
``CHAIN_RESULT <json>`` and exits 0 when every check passed, 1 otherwise (the JSON says
which check failed and why).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from typing import Any

import ray
import torch

from rlcomm import (
    Cluster,
    CollectiveGroupOptions,
    NodePlacementStrategy,
    Worker,
    update_settings,
)
from tests.netns import GCS_PORT, RayNode, ray_env, wait_for_port
from tests.waiting import wait_for

WAIT = 90.0  # seconds any one step may take
START_WAIT = 120.0  # for nodes and worker processes (slow on a busy machine)
CHUNK = 256 << 10  # the chain's record size in this test
TIMEOUT = 60.0  # the broadcasts' timeout, but the frozen relay's
FROZEN_TIMEOUT = 4.0  # the timeout of the broadcast whose relay is stopped past it
ODD = [(3 << 20) + 7, 1_000_003, 1]  # bytes of uint8, elements of float32, a scalar
BIG = [(24 << 20) + 5, 3, 1]  # ~2 s per link at 100 Mbit/s: time to find a relay midway


def payload(seed: int, sizes: list[int]) -> dict[str, torch.Tensor]:
    """A state dict whose bytes depend on ``seed`` and their place: a pattern of period
    251 (prime: a record out of place shows), cheap to make and compare."""
    n_bytes, n_floats, _ = sizes
    period = (torch.arange(251, dtype=torch.uint8) + seed % 251).repeat(n_bytes // 251 + 1)
    return {
        "w.bytes": period[:n_bytes].clone(),
        "w.floats": torch.arange(n_floats, dtype=torch.float32) * 0.5 + seed,
        "step": torch.tensor(seed),
    }


class Member(Worker):
    """One member of the test's broadcasts (a threaded actor: ``progress`` answers while
    a broadcast runs)."""

    def pid(self) -> int:
        return os.getpid()

    def ip(self) -> str:
        return ray.util.get_node_ip_address()

    def cast(self, groups: list, src: tuple, seed: int, sizes: list[int], source: bool,
             timeout: float, into: bool = False) -> dict[str, Any]:
        """One broadcast; returns whether this member holds the payload, or its error."""
        options = CollectiveGroupOptions(timeout=timeout)
        start = time.monotonic()
        try:
            if source:
                self.broadcast(payload(seed, sizes), groups=groups, src=src, options=options)
                return {"ok": True, "took": time.monotonic() - start}
            target = {k: torch.zeros_like(v) for k, v in payload(0, sizes).items()} if into else None
            got = self.broadcast(None, groups=groups, src=src, options=options, into=target)
            want = payload(seed, sizes)
            ok = (got is target or not into) and set(got) == set(want) and all(
                torch.equal(got[k], want[k]) for k in want)
            return {"ok": ok, "took": time.monotonic() - start}
        except Exception as exc:  # noqa: BLE001 - reported to the test
            return {"ok": False, "took": time.monotonic() - start,
                    "error": type(exc).__name__, "text": str(exc),
                    "peer": str(getattr(exc, "peer", None))}

    def progress(self, groups: list) -> dict | None:
        """Where this member's broadcast on ``groups`` is (its group's ``progress()``)."""
        from rlcomm.comm.broadcast.group import expand_groups

        group = self._comm._bcast.get(tuple(expand_groups(groups)))
        return None if group is None else group.progress()

    def watch_midway(self, groups: list, path: str, timeout: float) -> dict | None:
        """Until this member holds some of a chain's records but not all, and passed one
        on (its link to the next member is made), then write its progress to ``path`` (a file on this machine: the driver reads it without a
        round trip over the shaped, saturated links). Runs beside ``cast``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            p = self.progress(groups)
            if (p and p["phase"] == "chain" and 0 < p.get("received", 0) < p.get("total", 0)
                    and p.get("forwarded", 0) > 0):
                with open(path + ".tmp", "w") as f:
                    json.dump(p, f)
                os.rename(path + ".tmp", path)
                return p
            time.sleep(0.002)
        return None


def _cast_all(ranks: list[tuple[Any, int]], groups: list, src: tuple, seed: int,
              sizes: list[int], timeout: float, into: frozenset = frozenset()) -> list:
    """Start the broadcast on each ``(group, rank)``; returns their handles in order."""
    handles = []
    for group, rank in ranks:
        name = group.worker_group_name
        handles.append(group.execute_on(rank).cast(
            groups, src, seed, sizes, (name, rank) == tuple(src), timeout, (name, rank) in into))
    return handles


def _until(what: str, check, timeout: float = WAIT, every: float = 0.02,
           handles: list | None = None) -> Any:
    """Poll ``check(seen)`` (an observable state of the cluster) until it is truthy; on
    timeout, say what it saw last and how the broadcast's ``handles`` ended."""
    seen: list = []
    try:
        return wait_for(lambda: check(seen), what, timeout, interval=every)
    except AssertionError as exc:
        ended = []
        for h in handles or []:
            try:
                ended.append(h.wait(timeout=1))
            except Exception as err:  # noqa: BLE001 - for the message only
                ended.append(type(err).__name__)
        raise TimeoutError(f"{exc}; seen {seen[-3:]}; the broadcast's calls: {ended}") from exc


def _read_mark(path: str, seen: list) -> dict | None:
    """What a ``watch_midway`` wrote to ``path``, once it did."""
    try:
        with open(path) as f:
            seen.append(got := json.load(f))
            return got
    except FileNotFoundError:
        return None


class Run:
    """The cluster, the test's workers and what the driver found, step by step."""

    def __init__(self, spec: dict, result: dict):
        self.spec, self.result = spec, result
        self.t0 = time.monotonic()
        self.ips, self.late = spec["ips"], spec["late"]
        self.cm: Any = None
        self.late_group: Any = None

    def step(self, name: str) -> None:
        self.result["steps"].append([name, round(time.monotonic() - self.t0, 1)])
        print(f"CHAIN_STEP {self.result['steps'][-1]}", flush=True)  # seen even if killed

    def note(self, what: str, got: Any) -> None:
        print(f"CHAIN_STEP {what}: {got}", flush=True)

    def start(self) -> None:
        ips = self.ips
        wait_for_port(f"{ips[0]}:{GCS_PORT}", START_WAIT)
        ray.init(address=f"{ips[0]}:{GCS_PORT}", logging_level="WARNING")
        # Workers launched from here on start with these (the source's values travel in
        # each broadcast's frame anyway).
        update_settings(bcast_chunk_bytes=CHUNK, bcast_chain_min_bytes=1 << 20)
        cluster = Cluster(num_nodes=self.late, timeout=START_WAIT)
        rank_of = {n.ip: n.node_rank for n in cluster.nodes}
        assert sorted(rank_of) == sorted(ips[: self.late]), f"nodes {rank_of}"
        self.step("cluster")
        # cm:0, cm:1 on node 0; cm:2, cm:3 on node 1; cm:4, cm:5 on node 2.
        where = [0, 0, 1, 1, 2, 2]
        self.cm = Member.create_group().launch(
            cluster, NodePlacementStrategy([rank_of[ips[i]] for i in where]), name="cm",
            max_concurrency=2,
        )
        assert self.cm.ip().wait(timeout=START_WAIT) == [ips[i] for i in where]
        self.note("pids", self.cm.pid().wait(timeout=WAIT))
        self.step("launch")

    def odd_payload(self) -> None:
        """A payload no multiple of the record size, to two relays (one with a node-mate)
        and the source's node-mate; cm:3 and cm:4 receive into their tensors."""
        cm, groups = self.cm, [("cm", [0, 1, 2, 3, 4])]
        handles = _cast_all([(cm, r) for r in range(5)], groups, ("cm", 0), 11, ODD, TIMEOUT,
                            into=frozenset({("cm", 3), ("cm", 4)}))
        got = self.result["odd"] = [h.wait(timeout=WAIT)[0] for h in handles]
        assert all(g["ok"] for g in got), f"odd payload: {got}"
        prog = self.result["odd_progress"] = cm.execute_on(4).progress(groups).wait(
            timeout=WAIT)[0]
        total = sum(t.numel() * t.element_size() for t in payload(0, ODD).values())
        assert prog["total"] == -(-total // CHUNK) and prog["received"] == prog["total"], prog
        self.step("odd payload")

    def late_member(self) -> None:
        """A node that joins late, and its member in the middle of the chain:
        cm:0 -> late:0 -> cm:2 -> cm:4 (late:1 is late:0's node-mate)."""
        spec, ips, late, cm = self.spec, self.ips, self.late, self.cm
        node = RayNode(spec["namespaces"][late], ips[late], ips[0], spec["temp_dir"],
                       spec["late_log"], ray_env(os.environ["RAY_AUTH_TOKEN"]))
        self.result["late_node_pid"] = node.proc.pid
        cluster = Cluster(num_nodes=late + 1, timeout=START_WAIT)
        rank_of = {n.ip: n.node_rank for n in cluster.nodes}
        self.late_group = Member.create_group().launch(
            cluster, NodePlacementStrategy([rank_of[ips[late]]] * 2), name="late",
            max_concurrency=2,
        )
        assert self.late_group.ip().wait(timeout=START_WAIT) == [ips[late]] * 2
        self.step("late node")
        groups = [("cm", 0), ("late", [0, 1]), ("cm", [2, 4])]
        early = _cast_all([(cm, 0), (cm, 2), (cm, 4)], groups, ("cm", 0), 12, ODD, TIMEOUT)
        _until("the source in its broadcast", lambda seen: (
            cm.execute_on(0).progress(groups).wait(timeout=WAIT)[0] or {}
        ).get("phase", "idle") != "idle", handles=early)
        latecomers = _cast_all([(self.late_group, r) for r in (0, 1)], groups, ("cm", 0), 12,
                               ODD, TIMEOUT)
        got = self.result["late"] = [h.wait(timeout=WAIT)[0] for h in early + latecomers]
        assert all(g["ok"] for g in got), f"late member: {got}"
        self.step("late member")

    def _midway(self, rank: int, seed: int, timeout: float, what: str) -> tuple[list, int]:
        """Start a broadcast of :data:`BIG` along cm:0 -> cm:2 -> cm:<rank> -> late:0
        (+ late:1), and return once cm:<rank> is midway: the handles, and its pid."""
        cm, lg = self.cm, self.late_group
        groups = [("cm", [0, 2, rank]), ("late", [0, 1])]
        pid = cm.execute_on(rank).pid().wait(timeout=WAIT)[0]  # (execute_on: one call)
        mark = os.path.join(self.spec["work_dir"], f"midway-{what}-{os.getpid()}.json")
        watch = cm.execute_on(rank).watch_midway(groups, mark, WAIT)
        handles = _cast_all([(cm, 0), (cm, 2), (cm, rank), (lg, 0), (lg, 1)], groups,
                            ("cm", 0), seed, BIG, timeout)
        self.result[f"{what}_at"] = _until(
            "the relay midway", lambda seen: _read_mark(mark, seen),
            handles=handles + [watch], every=0.002,
        )
        return handles, pid

    def killed_relay(self) -> None:
        """A relay killed midway: cm:0 -> cm:2 -> cm:4 (SIGKILL) -> late:0 (+ late:1)."""
        handles, pid = self._midway(4, 13, TIMEOUT, "kill")
        os.kill(pid, signal.SIGKILL)
        self.step("kill")
        got: list = []
        self.result["killed"] = got
        for i in (0, 1, 3, 4):
            got.append(handles[i].wait(timeout=WAIT)[0])
            self.note("killed", got[-1])
        for g in got:
            assert g.get("error") == "PeerLostError" and "cm:4" in g["text"], f"killed: {got}"
            assert g["peer"] == "cm:4", f"killed: {got}"
            assert g["took"] < TIMEOUT / 2, f"not at once: {got}"
        self.step("killed relay")

    def stopped_relay(self) -> None:
        """A relay stopped past the timeout: cm:0 -> cm:2 -> cm:5 (SIGSTOP) -> late:0; then,
        once it runs again, the same members broadcast as before."""
        handles, pid = self._midway(5, 14, FROZEN_TIMEOUT, "stop")
        os.kill(pid, signal.SIGSTOP)
        self.step("stop")
        got: list = []
        self.result["frozen"] = got
        try:
            for i in (0, 1, 3, 4):
                got.append(handles[i].wait(timeout=WAIT)[0])
                self.note("frozen", got[-1])
        finally:
            os.kill(pid, signal.SIGCONT)
        for g in got:
            assert g.get("error") == "CommTimeoutError" and "cm:5" in g["text"], f"frozen: {got}"
            assert g["peer"] == "cm:5", f"frozen: {got}"
            assert g["took"] < FROZEN_TIMEOUT + 10, f"frozen: {got}"
        self.result["frozen_self"] = handles[2].wait(timeout=WAIT)[0]
        self.step("frozen relay")
        cm, lg = self.cm, self.late_group
        handles = _cast_all([(cm, 0), (cm, 2), (cm, 5), (lg, 0), (lg, 1)],
                            [("cm", [0, 2, 5]), ("late", [0, 1])], ("cm", 0), 15, ODD, TIMEOUT)
        got = self.result["after_frozen"] = [h.wait(timeout=WAIT)[0] for h in handles]
        assert all(g["ok"] for g in got), f"after the frozen relay ran again: {got}"
        self.step("after frozen")

    def stop(self) -> None:
        if self.late_group is not None:
            self.late_group.shutdown()
        if self.cm is not None:
            self.cm.shutdown()


#: The scenarios, in the order they run (``spec["scenarios"]`` may pick some; the late
#: member's starts the node that the last two use).
SCENARIOS = ["odd_payload", "late_member", "killed_relay", "stopped_relay"]


def _run(spec: dict, result: dict) -> None:
    run = Run(spec, result)
    try:
        run.start()
        for name in spec.get("scenarios", SCENARIOS):
            getattr(run, name)()
    finally:
        run.stop()


def main() -> int:
    spec = json.loads(sys.argv[1])
    result: dict = {"ok": False, "steps": []}
    try:
        _run(spec, result)
        result["ok"] = True
    except Exception as exc:  # reported to the test as JSON, with the traceback
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
    print("CHAIN_RESULT " + json.dumps(result, default=str), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    # No interpreter shutdown: threads stuck with a stopped or dead peer would hold it.
    os._exit(code)
