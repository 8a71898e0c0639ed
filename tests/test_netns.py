"""Two real Ray nodes in two network namespaces of this machine, joined by a veth pair.

Each node is a ``ray start --block`` process inside its own namespace, with its own
address from 198.18.0.0/24 and no route to the other's loopback, as two machines would
be. The driver (``tests/netns_driver.py``) runs in the first namespace: send/recv,
broadcast and a distributed channel between workers on the two nodes, with no
``GLOO_SOCKET_IFNAME`` anywhere, and a plain Gloo group with Gloo's own address choice
as the control that fails there.

Needs root and ``ip netns`` (skips otherwise, saying why). Cleans up only what it made:
its two namespaces and veth pair (unique names), its own processes by PID (their
process groups and whatever is left inside its namespaces), its temp directory.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

pytestmark = [pytest.mark.multinode, pytest.mark.timeout(240)]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIVER = os.path.join(ROOT, "tests", "netns_driver.py")
RAY = os.path.join(os.path.dirname(sys.executable), "ray")
IPS = ("198.18.0.1", "198.18.0.2")  # RFC 2544 benchmarking range, never routed
GCS_PORT = 6379  # free: each namespace has its own ports
IP_TIMEOUT = 20  # seconds for one `ip` command
DRIVER_TIMEOUT = 160  # seconds; the whole test took 68-98 s on the busy shared 2-core machine


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT, check=False
    )


def _unsupported() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "needs root to make network namespaces (ip netns add)"
    if shutil.which("ip") is None:
        return "no `ip` binary (iproute2) on PATH"
    if not os.path.exists(RAY):
        return f"no `ray` command beside {sys.executable}"
    return None


class NetnsPair:
    """Two namespaces ``rlc<sfx>a``/``rlc<sfx>b`` and a veth pair between them; only
    what this object made is removed by :meth:`remove`."""

    def __init__(self) -> None:
        sfx = secrets.token_hex(3)
        self.ns = (f"rlc{sfx}a", f"rlc{sfx}b")
        self.veth = (f"rlcv{sfx}a", f"rlcv{sfx}b")  # under 16 characters (IFNAMSIZ)
        self.made_ns: list[str] = []
        self.made_veth = False

    def make(self) -> None:
        """Raises ``RuntimeError`` with ``ip``'s message on the first step that fails."""

        def run(*args: str) -> None:
            out = _ip(*args)
            if out.returncode != 0:
                raise RuntimeError(f"`ip {' '.join(args)}` failed: {out.stderr.strip()}")

        for ns in self.ns:
            run("netns", "add", ns)
            self.made_ns.append(ns)
        run("link", "add", self.veth[0], "type", "veth", "peer", "name", self.veth[1])
        self.made_veth = True
        for ns, veth, ip in zip(self.ns, self.veth, IPS):
            run("link", "set", veth, "netns", ns)
            run("-n", ns, "addr", "add", f"{ip}/24", "dev", veth)
            run("-n", ns, "link", "set", veth, "up")
            run("-n", ns, "link", "set", "lo", "up")

    def pids(self) -> list[int]:
        pids: list[int] = []
        for ns in self.made_ns:
            out = _ip("netns", "pids", ns)
            pids += [int(p) for p in out.stdout.split() if p.isdigit()]
        return pids

    def remove(self) -> None:
        for pid in self.pids():  # only processes inside our own namespaces
            _kill(pid, signal.SIGKILL)
        if self.made_veth:  # deleting one end deletes both, wherever they are
            for ns, veth in zip(self.ns, self.veth):
                if _ip("-n", ns, "link", "del", veth).returncode == 0:
                    break
            else:
                _ip("link", "del", self.veth[0])
        for ns in self.made_ns:
            _ip("netns", "del", ns)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _stop(proc: subprocess.Popen) -> None:
    """End one ``ray start --block`` and everything in its process group (it leads one:
    started with ``start_new_session``): SIGTERM first (ray stops its children), then
    SIGKILL to the group."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _env() -> dict[str, str]:
    """This process's environment for the nodes and the driver: no GLOO_SOCKET_IFNAME,
    no RAY_ADDRESS, and a token of our own for Ray's token authentication (so nothing
    reads or writes ~/.ray/auth_token)."""
    env = {
        k: v for k, v in os.environ.items()
        if k not in ("GLOO_SOCKET_IFNAME", "RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH")
    }
    pythonpath = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    env.update(
        PYTHONPATH=pythonpath, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=secrets.token_hex(16),
    )
    return env


def _ray_start(ns: str, ip: str, temp_dir: str, log: str, env: dict, head: bool):
    role = ["--head", f"--port={GCS_PORT}", "--include-dashboard=false"] if head else [
        f"--address={IPS[0]}:{GCS_PORT}"
    ]
    cmd = [
        "ip", "netns", "exec", ns, RAY, "start", "--block", *role, f"--node-ip-address={ip}",
        "--num-cpus=1", "--object-store-memory=100000000", "--disable-usage-stats",
        f"--temp-dir={temp_dir}",
    ]
    with open(log, "wb") as out:
        return subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def _tail(path: str, n: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError as exc:
        return f"({exc})"


@pytest.fixture(scope="module")
def namespaces():
    reason = _unsupported()
    if reason:
        pytest.skip(reason)
    pair = NetnsPair()
    try:
        try:
            pair.make()
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            pytest.skip(f"this machine does not allow network namespaces with veth: {exc}")
        yield pair
    finally:
        pair.remove()


def test_two_nodes_in_two_namespaces(namespaces):
    tmp = tempfile.mkdtemp(prefix="rlcn-")  # short: Ray's unix socket paths live under it
    env = _env()
    procs: list[subprocess.Popen] = []
    logs = [os.path.join(tmp, f"node{i}.log") for i in (0, 1)]
    start = time.monotonic()
    try:
        for i, head in ((0, True), (1, False)):
            procs.append(_ray_start(
                namespaces.ns[i], IPS[i], os.path.join(tmp, f"n{i}"), logs[i], env, head
            ))
        driver = subprocess.Popen(
            ["ip", "netns", "exec", namespaces.ns[0], sys.executable, DRIVER,
             f"{IPS[0]}:{GCS_PORT}", *IPS],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
        )
        try:
            stdout, stderr = driver.communicate(timeout=DRIVER_TIMEOUT)
        except subprocess.TimeoutExpired:
            driver.kill()
            stdout, stderr = driver.communicate(timeout=10)
            stderr += f"\n(the driver ran past {DRIVER_TIMEOUT}s and was killed)"
        lines = [ln for ln in stdout.splitlines() if ln.startswith("NETNS_RESULT ")]
        result = json.loads(lines[-1].split(" ", 1)[1]) if lines else None
        context = (
            f"driver exit {driver.returncode}, {time.monotonic() - start:.0f}s\n"
            f"result: {json.dumps(result, indent=1) if result else None}\n"
            f"driver stderr tail:\n{stderr[-3000:]}\n"
            f"node 0 log:\n{_tail(logs[0])}\nnode 1 log:\n{_tail(logs[1])}"
        )
        print(f"netns test: {time.monotonic() - start:.0f}s, driver steps "
              f"{result and result['steps']}")
        assert result is not None and result["ok"] and driver.returncode == 0, context
        assert result["node_ips"] == list(IPS), context
        assert [f["gloo_socket_ifname"] for f in result["facts"]] == [None, None], context
        assert result["homes"] == {"k1": 1, "k0": 0}, context
        assert result["raw_gloo_node_ip"] == ["ok", "ok"], context
    finally:
        for proc in reversed(procs):
            _stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)
