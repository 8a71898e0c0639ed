"""Emulated nodes on one machine: network namespaces on one bridge, a Ray node in each.

:class:`NetnsCluster` makes ``n`` namespaces, one per node, and one more that holds the
bridge (a *switch*), so nothing is added to the machine's own network namespace. Node
``i`` has the address ``198.18.0.<i + 1>`` (RFC 2544's benchmarking range, never routed)
on one end of a veth pair whose other end is a port of the bridge, and no route to the
others' loopback, as separate machines would be. ``shape(rate)`` limits every node's
link to ``rate`` each way with ``tc`` (a token bucket on both ends of its veth pair: the
node's end shapes what it sends, the bridge's end what it receives).

:class:`RayNode` runs ``ray start --block`` in one of those namespaces (its own process
group; a head node, or one that joins the head). Everything is removed by what made it:
the processes inside the cluster's own namespaces by PID, then the namespaces by name
(their veth pairs and the bridge go with them).

Used by ``tests/test_netns.py`` and ``scripts/bench_multinode.py``. Needs root, ``ip``
and ``tc`` (:func:`unsupported` says what is missing).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RAY = os.path.join(os.path.dirname(sys.executable), "ray")
SUBNET = "198.18.0"  # RFC 2544 benchmarking range: never routed
GCS_PORT = 6379  # free: each namespace has its own ports
IP_TIMEOUT = 20  # seconds for one `ip` or `tc` command


def node_ip(i: int) -> str:
    """The address of emulated node ``i`` (0-based)."""
    return f"{SUBNET}.{i + 1}"


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=IP_TIMEOUT,
                          check=False)


def _must(*cmd: str) -> None:
    out = _run(*cmd)
    if out.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {out.stderr.strip()}")


def unsupported(need_tc: bool = False) -> str | None:
    """Why this machine cannot run emulated nodes (``None``: it can)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "needs root to make network namespaces (ip netns add)"
    if shutil.which("ip") is None:
        return "no `ip` binary (iproute2) on PATH"
    if need_tc and shutil.which("tc") is None:
        return "no `tc` binary (iproute2) on PATH to shape the links"
    if not os.path.exists(RAY):
        return f"no `ray` command beside {sys.executable}"
    return None


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


class NetnsCluster:
    """``n`` node namespaces ``rlc<sfx><i>`` and a switch namespace ``rlc<sfx>s`` with a
    bridge; node ``i``'s veth pair is ``rlv<sfx><i>n`` (in the node) and ``rlv<sfx><i>b``
    (a bridge port). Only what this object made is removed by :meth:`remove`."""

    def __init__(self, n: int):
        if not 1 <= n <= 200:
            raise ValueError(f"NetnsCluster: 1 to 200 nodes, not {n}")
        sfx = secrets.token_hex(3)
        self.n = n
        self.switch = f"rlc{sfx}s"
        self.ns = [f"rlc{sfx}{i}" for i in range(n)]
        self.veth = [(f"rlv{sfx}{i}n", f"rlv{sfx}{i}b") for i in range(n)]  # < 16 chars
        self.ips = [node_ip(i) for i in range(n)]
        self.made: list[str] = []  # namespaces, in the order made
        self.rate: str | None = None

    def make(self) -> None:
        """Raises ``RuntimeError`` with the command's message on the first step that fails."""
        _must("ip", "netns", "add", self.switch)
        self.made.append(self.switch)
        _must("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _must("ip", "-n", self.switch, "link", "set", "br0", "up")
        for ns, (inside, port), ip in zip(self.ns, self.veth, self.ips):
            _must("ip", "netns", "add", ns)
            self.made.append(ns)
            _must("ip", "-n", self.switch, "link", "add", port, "type", "veth", "peer", "name",
                  inside, "netns", ns)
            _must("ip", "-n", self.switch, "link", "set", port, "master", "br0")
            _must("ip", "-n", self.switch, "link", "set", port, "up")
            _must("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", inside)
            _must("ip", "-n", ns, "link", "set", inside, "up")
            _must("ip", "-n", ns, "link", "set", "lo", "up")

    def shape(self, rate: str | None) -> None:
        """Limit every node's link to ``rate`` (``tc`` syntax: ``1gbit``, ``200mbit``)
        each way; ``None`` lifts the limit."""
        for ns, (inside, port) in zip(self.ns, self.veth):
            for where, dev in ((ns, inside), (self.switch, port)):
                if rate is None:
                    _run("ip", "netns", "exec", where, "tc", "qdisc", "del", "dev", dev, "root")
                else:
                    _must("ip", "netns", "exec", where, "tc", "qdisc", "replace", "dev", dev,
                          "root", "tbf", "rate", rate, "burst", _burst(rate), "latency", "20ms")
        self.rate = rate

    def start_node(self, i: int, temp_dir: str, log: str, env: dict, **kwargs) -> RayNode:
        """A Ray node in node ``i``'s namespace (the head for ``i == 0``)."""
        return RayNode(self.ns[i], self.ips[i], None if i == 0 else self.ips[0], temp_dir,
                       log, env, **kwargs)

    def exec(self, i: int, *cmd: str) -> list[str]:
        """The command line that runs ``cmd`` inside node ``i``'s namespace."""
        return ["ip", "netns", "exec", self.ns[i], *cmd]

    def pids(self) -> list[int]:
        """The processes inside this cluster's namespaces."""
        pids: list[int] = []
        for ns in self.made:
            out = _run("ip", "netns", "pids", ns)
            pids += [int(p) for p in out.stdout.split() if p.isdigit()]
        return pids

    def remove(self) -> None:
        for pid in self.pids():  # only processes inside our own namespaces
            _kill(pid, signal.SIGKILL)
        for ns in reversed(self.made):  # a namespace takes its veth ends and bridge along
            _run("ip", "netns", "del", ns)
        self.made.clear()


def _burst(rate: str) -> str:
    """A token bucket for ``rate``: 1 ms of it, and at least 128 KiB (a veth passes
    segments of up to 64 KiB at once). A larger bucket would let the first megabytes of
    a transfer through faster than ``rate``."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for unit, scale in units.items():
        if rate.endswith(unit):
            bits = float(rate[: -len(unit)]) * scale
            return f"{max(128 << 10, int(bits / 8 / 1000))}b"
    return "128kb"


def ray_env(token: str | None = None) -> dict[str, str]:
    """This process's environment for emulated nodes and their drivers: no
    ``GLOO_SOCKET_IFNAME``, no ``RAY_ADDRESS``, the repository on ``PYTHONPATH``, and a
    token of its own for Ray's token authentication (nothing reads ``~/.ray``)."""
    env = {
        k: v for k, v in os.environ.items()
        if k not in ("GLOO_SOCKET_IFNAME", "RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH")
    }
    pythonpath = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    env.update(
        PYTHONPATH=pythonpath, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=token or secrets.token_hex(16),
    )
    return env


class RayNode:
    """``ray start --block`` in the network namespace ``ns`` with address ``ip``: the
    head when ``head`` is ``None``, else a node that joins the head at ``head``; its log
    goes to ``log``. :meth:`stop` ends it and its process group.

    Use :meth:`NetnsCluster.start_node`, or this class directly from a process inside the
    cluster (a driver that starts a node late).
    """

    def __init__(self, ns: str, ip: str, head: str | None, temp_dir: str, log: str,
                 env: dict, num_cpus: int = 1, object_store_bytes: int = 100_000_000):
        role = ["--head", f"--port={GCS_PORT}", "--include-dashboard=false"] if head is None \
            else [f"--address={head}:{GCS_PORT}"]
        cmd = [
            "ip", "netns", "exec", ns, RAY, "start", "--block", *role, f"--node-ip-address={ip}",
            f"--num-cpus={num_cpus}", f"--object-store-memory={object_store_bytes}",
            "--disable-usage-stats", f"--temp-dir={temp_dir}",
        ]
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def stop(self) -> None:
        """SIGTERM first (ray stops its children), then SIGKILL to the process group."""
        proc = self.proc
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

    def tail(self, n: int = 15) -> str:
        return tail(self.log, n)


def tail(path: str, n: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError as exc:
        return f"({exc})"


def wait_for_port(address: str, timeout: float) -> None:
    """Until something listens on ``host:port`` (a head that is still starting)."""
    import socket

    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {address} after {timeout}s") from None
            time.sleep(0.2)
