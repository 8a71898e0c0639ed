"""Real Ray nodes in network namespaces of this machine, on one bridge (``tests/netns.py``).

Each node is a ``ray start --block`` process inside its own namespace, with its own
address from 198.18.0.0/24 and no route to the others' loopback, as separate machines
would be. The module's namespaces are made once; its tests run in order on them:

- two nodes, unshaped links: the driver (``tests/netns_driver.py``, in the first
  namespace) runs send/recv, broadcast and a distributed channel between workers on the
  two nodes, with no ``GLOO_SOCKET_IFNAME`` anywhere, and a plain Gloo group with Gloo's
  own address choice as the control that fails there;
- a third node joins and every link is shaped to 100 Mbit/s each way: the chain driver
  (``tests/netns_chain_driver.py``) broadcasts along the chain of nodes, starts a fourth
  node late and puts a member of it in the middle of the chain, kills a relay with
  SIGKILL in the middle of the stream and stops another with SIGSTOP past the timeout.

Needs root, ``ip`` and ``tc`` (skips otherwise, saying why). Cleans up only what it made:
its Ray nodes and the processes inside its own namespaces, by PID; its namespaces (their
veth pairs and bridge with them), by name; its temp directory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from tests.netns import NetnsCluster, RayNode, ray_env, tail, unsupported

pytestmark = [pytest.mark.multinode, pytest.mark.timeout(240)]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIVER = os.path.join(ROOT, "tests", "netns_driver.py")
CHAIN_DRIVER = os.path.join(ROOT, "tests", "netns_chain_driver.py")
NODES = 4  # the fourth joins late, in the chain test
DRIVER_TIMEOUT = 160  # seconds; the two-node test took 55-100 s on the busy shared 2-core machine
CHAIN_RATE = "100mbit"


class Emulated:
    """The module's namespaces, and the Ray nodes started in them."""

    def __init__(self, cluster: NetnsCluster, tmp: str):
        self.cluster, self.tmp = cluster, tmp
        self.env = ray_env()
        self.nodes: dict[int, RayNode] = {}

    def start(self, i: int) -> None:
        if i not in self.nodes:
            self.nodes[i] = self.cluster.start_node(
                i, os.path.join(self.tmp, f"n{i}"), self.log(i), self.env
            )

    def log(self, i: int) -> str:
        return os.path.join(self.tmp, f"node{i}.log")

    def run_driver(self, args: list[str], marker: str) -> tuple[dict | None, str, int]:
        """Run a driver in the first node's namespace; its result line, stderr, code."""
        driver = subprocess.Popen(
            self.cluster.exec(0, sys.executable, *args),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env, cwd=ROOT,
        )
        try:
            stdout, stderr = driver.communicate(timeout=DRIVER_TIMEOUT)
        except subprocess.TimeoutExpired:
            driver.kill()
            stdout, stderr = driver.communicate(timeout=10)
            stderr += f"\n(the driver ran past {DRIVER_TIMEOUT}s and was killed)"
        lines = [ln for ln in stdout.splitlines() if ln.startswith(marker + " ")]
        result = json.loads(lines[-1].split(" ", 1)[1]) if lines else None
        if result is None:  # killed: what it said it did
            stderr = "\n".join(ln for ln in stdout.splitlines() if "_STEP " in ln) + "\n" + stderr
        return result, stderr, driver.returncode

    def context(self, result: dict | None, stderr: str, code: int, start: float) -> str:
        logs = "".join(f"node {i} log:\n{tail(self.log(i))}\n" for i in sorted(self.nodes))
        return (
            f"driver exit {code}, {time.monotonic() - start:.0f}s\n"
            f"result: {json.dumps(result, indent=1) if result else None}\n"
            f"driver stderr tail:\n{stderr[-3000:]}\n{logs}"
        )


@pytest.fixture(scope="module")
def emulated():
    reason = unsupported(need_tc=True)
    if reason:
        pytest.skip(reason)
    cluster = NetnsCluster(NODES)
    tmp = tempfile.mkdtemp(prefix="rlcn-")  # short: Ray's unix socket paths live under it
    made = None
    try:
        try:
            cluster.make()
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            pytest.skip(f"this machine does not allow network namespaces with veth: {exc}")
        made = Emulated(cluster, tmp)
        yield made
    finally:
        if made is not None:
            for node in reversed(list(made.nodes.values())):
                node.stop()
        cluster.remove()  # and whatever else runs inside its namespaces, by PID
        shutil.rmtree(tmp, ignore_errors=True)


def test_two_nodes_in_two_namespaces(emulated):
    start = time.monotonic()
    emulated.start(0)
    emulated.start(1)
    ips = emulated.cluster.ips[:2]
    result, stderr, code = emulated.run_driver(
        [DRIVER, f"{ips[0]}:6379", *ips], "NETNS_RESULT"
    )
    context = emulated.context(result, stderr, code, start)
    print(f"netns test: {time.monotonic() - start:.0f}s, driver steps "
          f"{result and result['steps']}")
    assert result is not None and result["ok"] and code == 0, context
    assert result["node_ips"] == list(ips), context
    assert [f["gloo_socket_ifname"] for f in result["facts"]] == [None, None], context
    assert result["homes"] == {"k1": 1, "k0": 0}, context
    assert result["raw_gloo_node_ip"] == ["ok", "ok"], context


def test_chain_of_nodes_with_a_killed_a_stopped_and_a_late_relay(emulated):
    start = time.monotonic()
    cluster = emulated.cluster
    for i in range(NODES - 1):
        emulated.start(i)
    cluster.shape(CHAIN_RATE)
    spec = {
        "ips": cluster.ips, "namespaces": cluster.ns, "late": NODES - 1,
        "temp_dir": os.path.join(emulated.tmp, f"n{NODES - 1}"),
        "late_log": emulated.log(NODES - 1), "work_dir": emulated.tmp,
    }
    result, stderr, code = emulated.run_driver([CHAIN_DRIVER, json.dumps(spec)], "CHAIN_RESULT")
    context = emulated.context(result, stderr, code, start) + (
        f"late node log:\n{tail(emulated.log(NODES - 1))}\n"
    )
    print(f"chain test: {time.monotonic() - start:.0f}s, driver steps "
          f"{result and result['steps']}")
    assert result is not None and result["ok"] and code == 0, context
