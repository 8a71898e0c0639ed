"""The driver of ``tests/test_netns.py``: runs inside the first network namespace, on a
Ray cluster of two nodes (one per namespace, joined by a veth pair), and checks that
workers on the two nodes talk with no ``GLOO_SOCKET_IFNAME`` anywhere.

Usage: ``python tests/netns_driver.py RAY_ADDRESS NODE0_IP NODE1_IP``. Prints one line
``NETNS_RESULT <json>`` and exits 0 when every check passed, 1 otherwise (the JSON says
which check failed and why).
"""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import os
import sys
import time
import traceback

import ray
import torch
import torch.distributed as dist

from rlcomm import Channel, Cluster, NodePlacementStrategy, Worker
from rlcomm.comm.transports.gloo import new_gloo_group
from tests.netns import wait_for_port

GROUP = "netns_peers"
WAIT = 60.0  # seconds any one step may take
START_WAIT = 100.0  # for the nodes and the first worker processes (slow on a busy machine)


class Peer(Worker):
    """Rank r runs on node r."""

    def facts(self) -> dict:
        return {
            "ip": ray.util.get_node_ip_address(),
            "gloo_socket_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
            "master_addr": os.environ["MASTER_ADDR"],
        }

    def ping(self, n: int) -> list:
        """Rank 0 sends an object and a tensor; rank 1 answers with the tensor doubled."""
        other = 1 - self.rank
        if self.rank == 0:
            self.send({"hello": "from node 0", "n": n}, GROUP, other)
            self.send(torch.arange(n, dtype=torch.float32), GROUP, other)
            back = self.recv(GROUP, other)
            return [back.tolist(), self.transport_to(other)]
        note = self.recv(GROUP, other)
        tensor = self.recv(GROUP, other)
        self.send(tensor * 2, GROUP, other)
        return [note, self.transport_to(other)]

    def transport_to(self, rank: int) -> str:
        addr = self._comm.address.__class__.of(GROUP, rank)
        return self._comm.connection(addr, None).transport_name

    def bcast(self, payload: dict | None) -> dict:
        """Rank 1 (on node 1) broadcasts to both ranks."""
        return self.broadcast(payload, groups=[(GROUP, [0, 1])], src=(GROUP, 1))

    def put_items(self, channel: Channel, key: str, n: int) -> int:
        for i in range(n):
            channel.put((key, i), key=key, timeout=WAIT)
        return n

    def get_items(self, channel: Channel, key: str, n: int) -> list:
        return [channel.get(key=key, timeout=WAIT) for _ in range(n)]

    def raw_gloo(self, bind_node_ip: bool, timeout: float) -> str:
        """A plain two-rank Gloo group over MASTER_ADDR:MASTER_PORT (the store rlcomm
        hands users): bound to the node IP (as rlcomm does) or with Gloo's own choice of
        address (as ``init_process_group('gloo')`` does without GLOO_SOCKET_IFNAME).
        Returns "ok" or the error's first line."""
        wait = datetime.timedelta(seconds=timeout)
        if getattr(self, "_store", None) is None:
            self._store = dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), 2,
                is_master=self.rank == 0, timeout=datetime.timedelta(seconds=WAIT),
            )
        store = dist.PrefixStore("node_ip" if bind_node_ip else "default", self._store)
        host = ray.util.get_node_ip_address() if bind_node_ip else None
        try:
            pg = new_gloo_group(store, self.rank, 2, wait, host)
            t = torch.full((4,), float(self.rank + 1))
            pg.allreduce([t]).wait(wait)
            return "ok" if t.tolist() == [3.0] * 4 else f"wrong sum {t.tolist()}"
        except RuntimeError as exc:
            return f"failed: {str(exc).splitlines()[0][:200]}"


def _run(ray_address: str, ips: list[str], result: dict) -> None:
    t0 = time.monotonic()

    def step(name: str) -> None:
        result["steps"].append([name, round(time.monotonic() - t0, 1)])

    wait_for_port(ray_address, START_WAIT)
    ray.init(address=ray_address, logging_level="WARNING")
    cluster = Cluster(num_nodes=2, timeout=START_WAIT)
    result["node_ips"] = [n.ip for n in cluster.nodes]
    assert result["node_ips"] == ips, f"nodes {result['node_ips']} != {ips}"
    assert ray.util.get_node_ip_address() == ips[0], "the driver is not on node 0"
    step("cluster")

    # The channel workers start while the group does (both wait for their processes; the
    # nodes tear everything down if one fails).
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        making = pool.submit(
            Channel.create, "netns_ch", maxsize=32, distributed=True, cluster=cluster
        )
        peers = Peer.create_group().launch(cluster, NodePlacementStrategy([0, 1]), name=GROUP)
        channel = making.result(timeout=START_WAIT)
    try:
        facts = peers.facts().wait(timeout=START_WAIT)
        result["facts"] = facts
        assert [f["ip"] for f in facts] == ips, f"ranks on {facts}"
        assert all(f["gloo_socket_ifname"] is None for f in facts), "GLOO_SOCKET_IFNAME set"
        assert all(f["master_addr"] == ips[0] for f in facts), f"MASTER_ADDR {facts}"
        step("launch")

        got = peers.ping(5).wait(timeout=WAIT)
        assert got[0] == [[0.0, 2.0, 4.0, 6.0, 8.0], "gloo"], f"rank 0 got {got[0]}"
        assert got[1] == [{"hello": "from node 0", "n": 5}, "gloo"], f"rank 1 got {got[1]}"
        step("send/recv")

        payload = {"weights": torch.arange(6.0).reshape(2, 3), "version": 7}
        handles = [peers.execute_on(0).bcast(None), peers.execute_on(1).bcast(payload)]
        got = [h.wait(timeout=WAIT)[0] for h in handles]
        for g in got:
            assert g["version"] == 7 and torch.equal(g["weights"], payload["weights"]), g
        step("broadcast")

        # Key "k1" is first used on node 1 (homed there) and read from node 0, and the
        # other way round for "k0": both directions cross the link.
        n = 20
        for src, dst, key in ((1, 0, "k1"), (0, 1, "k0")):
            assert peers.execute_on(src).put_items(channel, key, n).wait(timeout=WAIT) == [n]
            got = peers.execute_on(dst).get_items(channel, key, n).wait(timeout=WAIT)[0]
            assert got == [(key, i) for i in range(n)], f"{key} on node {dst}: {got}"
        stats = channel.stats()
        assert [s["node_id"] for s in stats] == [node.node_id for node in cluster.nodes]
        result["homes"] = stats[0]["homes"]
        assert stats[0]["homes"] == {"k1": 1, "k0": 0}, f"homes {stats[0]['homes']}"
        step("channel")

        # The same plain Gloo pair with Gloo's own address choice (the hostname's
        # address, or loopback) cannot connect across the namespaces: this is what
        # rlcomm's binding to the node IP fixes.
        bound = peers.raw_gloo(True, 20).wait(timeout=WAIT)
        result["raw_gloo_node_ip"] = bound
        assert bound == ["ok", "ok"], f"raw gloo bound to the node IP: {bound}"
        # (1 s: the rank that waits for its peer gives up after 5x that.)
        default = peers.raw_gloo(False, 1).wait(timeout=WAIT)
        result["raw_gloo_default"] = default
        assert all(d.startswith("failed") for d in default), f"default gloo: {default}"
        assert any("127." in d for d in default), f"not a loopback address: {default}"
        step("raw gloo")
    finally:
        channel.shutdown()
        peers.shutdown()


def main() -> int:
    ray_address, *ips = sys.argv[1:]
    result: dict = {"ok": False, "steps": []}
    try:
        _run(ray_address, ips, result)
        result["ok"] = True
    except Exception as exc:  # reported to the test as JSON, with the traceback
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
    print("NETNS_RESULT " + json.dumps(result, default=str), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    # No interpreter shutdown: after a failed check, threads stuck in a rendezvous with
    # an unreachable peer would hold the exit; the test tears the nodes down anyway.
    os._exit(code)
