#!/usr/bin/env python
"""Weight sync across nodes, on emulated nodes of this machine, four ways, one run.

The script makes ``--nodes`` Ray nodes of this machine, each in its own network
namespace on one bridge (addresses from 198.18.0.0/24), with every node's link shaped to
``--rate`` each way with ``tc`` (default 1 Gbit/s: the link, not the machine's cores, is
then the bottleneck), one worker per node. A state dict (``--mib`` MiB in ``--tensors``
float32 tensors; 256 MiB in 16 by default) goes from the trainer's worker on the first
node to one worker on each of the next ``N - 1`` nodes, for N = 2 .. ``--nodes``:

- ``rlcomm pipelined``: ``Worker.broadcast`` along the chain of the nodes (each node
  forwards each record of ``RLCOMM_BCAST_CHUNK_BYTES`` while the next arrives);
- ``rlcomm star (Gloo)``: ``Worker.broadcast`` with the chain turned off at the source
  (``RLCOMM_BCAST_CHAIN_MIN_BYTES`` above the payload): Gloo's broadcast in the group of
  the source and the relays;
- ``Ray object store``: plain Ray actors, one per node; the trainer's ``ray.put``\\ s the
  dict once and each other actor ``ray.get``\\ s it (zero-copy torch tensors);
- ``bound``: one node-to-node transfer of the same dict at the link rate, measured in the
  same run as one rlcomm ``send`` from the first node to the second.

``--sync-mib`` adds a weight sync at the size of a real model: a state dict of that many
MiB (one tensor of a quarter of it, the rest in ``--sync-tensors`` tensors) from the
first node to one worker on each other node, each taking it into its own preallocated
dict (``into=``), with ``RLCOMM_SHM_POOL_BYTES`` at ``--sync-pool-mib`` so that it
streams in buckets; besides the time, each receiver's peak resident memory beyond its
dict and the bytes its node's link carried (the relay's count), and one ``send`` of it
to the second node (``into=`` too) as the bound. The same sync again with each receiver
taking one tensor-parallel shard of four (``shards=``, node ``r`` part ``r - 1``) shows
the links carrying only those shards.
``--sync-only`` runs only that.

A figure is the time from the source's start until the last receiver holds the whole
dict (receivers note the wall clock when their call returns: all processes share this
machine's clock), the median of ``--repeats`` rounds after a first round that is not
counted (connections, groups and fresh memory). The ways take turns round by round, so
a change in the machine's load falls on all of them alike. Two more sweeps, at the most
nodes: the chain against the star for payloads of 64 KiB to 64 MiB (where the chain
starts to pay: ``RLCOMM_BCAST_CHAIN_MIN_BYTES``), and the chain's record size
(``RLCOMM_BCAST_CHUNK_BYTES``).

Needs root, ``ip`` and ``tc``; removes only what it made (its Ray nodes and the
processes inside its own namespaces, by PID; its namespaces, by name; its temp
directory). Writes the tables to stdout, and on request the records (``--json``) and a
figure of time against N (``--png``); ``scripts/make_tables.py`` then writes the figures
section of ``docs/multinode.md`` from the JSON.

    sudo .venv/bin/python scripts/bench_multinode.py --json docs/bench_multinode.json \\
        --png docs/bench_multinode.png
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import ray  # noqa: E402
import torch  # noqa: E402
from make_tables import (  # noqa: E402  (this script's folder is on sys.path)
    BOUND,
    MULTINODE_WAYS,
    PIPELINED,
    RAY,
    STAR,
    multinode_acceptance,
    multinode_median,
    multinode_tables,
)
from make_tables import size as size_label  # noqa: E402

from rlcomm import Shard, Worker, update_settings  # noqa: E402

GROUP = "bench_mn"
SYNC_GROUP = "bench_mn_sync"
STREAMED, STREAMED_BOUND = "rlcomm streamed (into=)", "bound: one send (into=)"
SHARDED = "rlcomm streamed, a TP-4 shard each (into=)"
#: The sharded sync's tensor-parallel degree: node r takes part r - 1.
TP = 4
MIB = 1 << 20
#: The chain stays on for every size with this; the star is taken with ``NEVER``.
ALWAYS, NEVER = 1, 1 << 62


# -- inside the cluster: the driver ------------------------------------------------------------


def state_dict(mib: float, tensors: int) -> dict[str, torch.Tensor]:
    numel = max(1, int(mib * MIB) // 4 // tensors)
    return {f"layers.{i}.weight": torch.full((numel,), float(i)) for i in range(tensors)}


class BenchWorker(Worker):
    """Rank r runs on node r; rank 0 is the trainer."""

    def __init__(self) -> None:
        super().__init__()
        torch.set_num_threads(1)
        self._sd: Any = None
        self._held: Any = None

    def make(self, mib: float, tensors: int) -> int:
        self._sd = state_dict(mib, tensors)
        return sum(t.numel() * 4 for t in self._sd.values())

    def configure(self, settings: dict) -> bool:
        update_settings(**settings)
        return True

    group = GROUP

    def _sync(self, n: int) -> None:
        """Every receiver is inside its call before the source starts."""
        if self._rank == 0:
            for r in range(1, n):
                self.recv(self.group, r)
        else:
            self.send(0, self.group, 0)

    def bcast(self, n: int) -> float:
        members = [(GROUP, list(range(n)))]
        self._sync(n)
        if self._rank == 0:
            start = time.time()
            self.broadcast(self._sd, groups=members)
            return start
        self._held = None  # the last round's weights go as the new ones come
        self._held = self.broadcast(None, groups=members)
        return time.time()

    def p2p(self) -> float:
        self._sync(2)
        if self._rank == 0:
            start = time.time()
            self.send(self._sd, GROUP, 1)
            return start
        self._held = None
        self._held = self.recv(GROUP, 0)
        return time.time()


def sync_layout(mib: int, tensors: int) -> list[tuple[str, int]]:
    """A weight sync's tensors (name, float32 elements): one of a quarter of the dict,
    the rest alike."""
    big = mib * MIB // 16 // TP * TP
    rest = (mib * MIB // 4 - big) // max(1, tensors - 1) // TP * TP
    return [("embed.weight", big)] + [(f"layers.{i}.weight", rest) for i in range(tensors - 1)]


def _link_in(members: list) -> int:
    """Bytes this member took in by broadcasts of ``members`` so far (a relay: what its
    node's link carried)."""
    from rlcomm.comm.status import process_status

    names = [f"{g}:{r}" for g, ranks in members for r in ranks]
    for group in process_status()["process"]["broadcasts"]:
        if group["members"] == names:
            return group["bytes_in"]
    return 0


def _vm(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


class SyncWorker(BenchWorker):
    """Rank r runs on node r; rank 0 is the trainer, the others take the weights into
    their own dicts."""

    group = SYNC_GROUP

    def make(self, mib: int, tensors: int) -> int:
        layout = sync_layout(mib, tensors)
        if self._rank == 0:
            self._sd = {n: torch.full((k,), float(i)) for i, (n, k) in enumerate(layout)}
        else:
            self._sd = {n: torch.zeros(k) for n, k in layout}
            self._shards = {n: torch.zeros(k // TP) for n, k in layout}
        return sum(t.numel() * 4 for t in self._sd.values())

    def bcast(self, n: int, sharded: bool = False) -> tuple[float, int, int]:
        """One sync to ranks 1..n-1 (``sharded``: each takes part ``rank - 1`` of
        :data:`TP` of every tensor): the wall clock at the start (source) or end, the
        peak resident memory this round added (receivers; the dict was there before),
        and the bytes that came over this node's link."""
        members = [(SYNC_GROUP, list(range(n)))]
        self._sync(n)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak (VmHWM) starts again from now
        base = _vm("VmRSS")
        if self._rank == 0:
            start = time.time()
            self.broadcast(self._sd, groups=members)
            return start, _vm("VmHWM") - base, 0
        came = _link_in(members)
        if sharded:
            part = Shard(0, self._rank - 1, TP)
            self.broadcast(None, groups=members, into=self._shards,
                           shards=lambda name, shape: part)
        else:
            self.broadcast(None, groups=members, into=self._sd)
        return time.time(), _vm("VmHWM") - base, _link_in(members) - came

    def p2p(self) -> tuple[float, int, int]:
        self._sync(2)
        if self._rank == 0:
            start = time.time()
            self.send(self._sd, SYNC_GROUP, 1)
            return start, 0, 0
        self.recv(SYNC_GROUP, 0, into=self._sd)
        return time.time(), 0, 0

    def check(self) -> bool:
        return all(bool((t == float(i)).all()) for i, t in enumerate(self._sd.values())) and (
            all(bool((t == float(i)).all()) for i, t in enumerate(self._shards.values())))


@ray.remote(num_cpus=0, runtime_env={"env_vars": {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}})
class RayPeer:
    """A plain Ray actor on one node: the first one puts, the others get."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self._sd: Any = None
        self._held: Any = None

    def make(self, mib: float, tensors: int) -> bool:
        self._sd = state_dict(mib, tensors)
        return True

    def take(self, refs: list) -> float:
        self._held = None
        self._held = ray.get(refs[0])
        return time.time()

    def round(self, receivers: list) -> float:
        ray.get([r.take.remote([ray.put(0)]) for r in receivers])  # all idle first
        start = time.time()
        ref = ray.put(self._sd)
        ends = ray.get([r.take.remote([ref]) for r in receivers])
        return max(ends) - start


def _inner(spec: dict) -> dict:
    """Runs in the first node's namespace: every measurement; returns the records."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rlcomm import Cluster, NodePlacementStrategy
    from tests.netns import GCS_PORT, wait_for_port

    ips = spec["ips"]
    wait_for_port(f"{ips[0]}:{GCS_PORT}", 120)
    ray.init(address=f"{ips[0]}:{GCS_PORT}", logging_level="ERROR")
    cluster = Cluster(num_nodes=len(ips), timeout=180)
    by_ip = {n.ip: n for n in cluster.nodes}
    update_settings(comm_timeout=600.0)  # workers start with it: large sends on slow links
    workers = BenchWorker.create_group().launch(
        cluster, NodePlacementStrategy([by_ip[ip].node_rank for ip in ips]), name=GROUP
    )
    peers = [RayPeer.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        by_ip[ip].node_id, soft=False)).remote() for ip in ips]
    wait = 900.0
    records: list[dict] = []

    def log(msg: str) -> None:
        print(f"BENCH {msg}", flush=True)

    def configure(settings: dict) -> None:
        workers.execute_on(0).configure(settings).wait(timeout=wait)

    def once(way: str, n: int) -> float:
        if way in (PIPELINED, STAR):
            configure({"bcast_chain_min_bytes": ALWAYS if way == PIPELINED else NEVER})
            times = workers.execute_on(*range(n)).bcast(n).wait(timeout=wait)
            return max(times[1:]) - times[0]
        if way == BOUND:
            times = workers.execute_on(0, 1).p2p().wait(timeout=wait)
            return times[1] - times[0]
        return ray.get(peers[0].round.remote(peers[1:n]), timeout=wait)

    def measure(ways: list[str], n: int, case: dict, repeats: int) -> None:
        """First rounds of each way, then ``repeats`` rounds with the ways in turn."""
        firsts = {way: once(way, n) for way in ways}
        samples: dict[str, list[float]] = {way: [] for way in ways}
        for _ in range(repeats):
            for way in ways:
                samples[way].append(once(way, n))
        for way in ways:
            got = samples[way]
            records.append({**case, "way": way, "nodes": n, "first": firsts[way],
                            "median": statistics.median(got), "min": min(got),
                            "max": max(got), "samples": got})
            log(f"{case['sweep']} {way:30s} N={n} {case.get('bytes', 0) / MIB:8.2f} MiB "
                f"chunk {case.get('chunk', 0) / MIB:g} MiB: {statistics.median(got):7.3f} s "
                f"(min {min(got):.3f}, max {max(got):.3f}; first {firsts[way]:.3f})")

    chunk = spec["chunk"]
    nodes = len(ips)
    if spec["sync_mib"]:
        _sync_sweep(spec, cluster, by_ip, records, log, wait)
    if spec["sync_only"]:
        workers.shutdown()
        return {"records": records}
    size = workers.execute_on(0).make(spec["mib"], spec["tensors"]).wait(timeout=wait)[0]
    ray.get(peers[0].make.remote(spec["mib"], spec["tensors"]), timeout=wait)
    configure({"bcast_chunk_bytes": chunk})
    for n in spec["counts"]:
        if n > nodes:
            continue
        measure(MULTINODE_WAYS, n, {"sweep": "nodes", "bytes": size, "chunk": chunk}, spec["repeats"])
    for mib in spec["switch_mib"]:
        got = workers.execute_on(0).make(mib, spec["tensors"]).wait(timeout=wait)[0]
        for n in spec["switch_nodes"]:
            if n <= nodes:
                measure([PIPELINED, STAR], n, {"sweep": "switch", "bytes": got, "chunk": chunk},
                        spec["switch_repeats"])
    workers.execute_on(0).make(spec["mib"], spec["tensors"]).wait(timeout=wait)
    for c in spec["chunks"]:
        configure({"bcast_chunk_bytes": c})
        measure([PIPELINED], nodes, {"sweep": "chunk", "bytes": size, "chunk": c},
                spec["repeats"])
    configure({"bcast_chunk_bytes": chunk})
    workers.shutdown()
    return {"records": records}


def _sync_sweep(spec: dict, cluster: Any, by_ip: dict, records: list[dict], log: Any,
                wait: float) -> None:
    """The weight sync at a real model's size (see the module docstring)."""
    from rlcomm import NodePlacementStrategy

    ips = spec["ips"]
    n = len(ips)
    group = SyncWorker.create_group().launch(
        cluster, NodePlacementStrategy([by_ip[ip].node_rank for ip in ips]), name=SYNC_GROUP,
        env_vars={"RLCOMM_SHM_POOL_BYTES": str(spec["sync_pool_mib"] * MIB),
                  "RLCOMM_COMM_TIMEOUT": "600"},
    )
    try:
        size = group.make(spec["sync_mib"], spec["sync_tensors"]).wait(timeout=wait)[0]
        case = {"sweep": "sync", "bytes": size, "pool": spec["sync_pool_mib"] * MIB}

        ways = [STREAMED, STREAMED_BOUND] + ([SHARDED] if n - 1 <= TP else [])

        def once(way: str) -> tuple[float, list[int], list[int]]:
            if way == STREAMED_BOUND:
                got = group.execute_on(0, 1).p2p().wait(timeout=wait)
            else:
                got = group.execute_on(*range(n)).bcast(n, way == SHARDED).wait(timeout=wait)
            return (max(t for t, _, _ in got[1:]) - got[0][0], [r for _, r, _ in got[1:]],
                    [b for _, _, b in got[1:]])

        firsts = {way: once(way)[0] for way in ways}
        samples: dict[str, list[float]] = {way: [] for way in ways}
        rss: dict[str, list[int]] = {}
        links: dict[str, list[int]] = {}
        for _ in range(spec["repeats"]):
            for way in ways:
                seconds, grew, came = once(way)
                samples[way].append(seconds)
                rss[way] = [max(a, b) for a, b in zip(rss[way], grew)] if way in rss else grew
                links[way] = came
        ok = all(group.execute_on(*range(1, n)).check().wait(timeout=wait))
        for way, got in samples.items():
            bound = way == STREAMED_BOUND
            records.append({**case, "way": way, "nodes": 2 if bound else n,
                            "first": firsts[way], "median": statistics.median(got),
                            "min": min(got), "max": max(got), "samples": got,
                            "receiver_rss_growth": None if bound else rss[way],
                            "link_bytes": None if bound else links[way], "checked": ok})
            log(f"sync {way:30s} {size / MIB:8.0f} MiB: {statistics.median(got):7.3f} s "
                f"(first {firsts[way]:.3f}); receivers' peak RSS beyond their dict "
                f"{[r // MIB for r in rss[way]]} MiB; links carried "
                f"{[b / MIB for b in links[way]]} MiB; values {'checked' if ok else 'WRONG'}")
    finally:
        group.shutdown()


# -- outside: the cluster, the tables, the files ------------------------------------------------


def plot(result: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records, args = result["records"], result["args"]
    counts = sorted({r["nodes"] for r in records if r["sweep"] == "nodes"})
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    styles = {PIPELINED: "o-", STAR: "s--", RAY: "^:", BOUND: "k-"}
    for way in MULTINODE_WAYS:
        ys = [multinode_median(records, "nodes", way, nodes=n) for n in counts]
        if way == BOUND:
            ax.axhline(statistics.median([y for y in ys if y]), color="0.45", lw=1.2,
                       ls="--", label="one node-to-node transfer", zorder=0)
        else:
            ax.plot(counts, ys, styles[way], label=way)
    nbytes = next((r["bytes"] for r in records if r["sweep"] == "nodes"), 0)
    ax.set_xlabel("nodes (the trainer's and N - 1 receiving nodes)")
    ax.set_ylabel("seconds until the last node holds it")
    ax.set_xticks(counts)
    ax.set_ylim(bottom=0)
    ax.set_title(f"{size_label(nbytes)} state dict, links of {args['rate']} each way", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def _parse_list(kind: type) -> Any:
    return lambda s: [kind(x) for x in s.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=5, help="emulated nodes (at least 2)")
    parser.add_argument("--rate", default="1gbit", help="each node's link, each way (tc syntax)")
    parser.add_argument("--mib", type=float, default=256, help="state dict size in MiB")
    parser.add_argument("--tensors", type=int, default=16, help="tensors in the state dict")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per case")
    parser.add_argument("--chunk", type=int, default=None,
                        help="the chain's record size in bytes (default: the setting's)")
    parser.add_argument("--switch-mib", type=_parse_list(float),
                        default=[1 / 64, 1 / 16, 0.25, 1, 4, 16],
                        help="payload sizes (MiB) of the chain-against-star sweep ('' for none)")
    parser.add_argument("--chunks", type=_parse_list(int),
                        default=[256 << 10, 1 << 20, 4 << 20, 16 << 20],
                        help="record sizes (bytes) of the record-size sweep ('' for none)")
    parser.add_argument("--object-store-mib", type=int, default=640,
                        help="each Ray node's object store")
    parser.add_argument("--sync-mib", type=int, default=0,
                        help="also a weight sync of a state dict this large, streamed (0: none)")
    parser.add_argument("--sync-tensors", type=int, default=128,
                        help="tensors of that state dict")
    parser.add_argument("--sync-pool-mib", type=int, default=256,
                        help="the workers' RLCOMM_SHM_POOL_BYTES in that sync, in MiB")
    parser.add_argument("--sync-only", action="store_true", help="run only that sync")
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--png", help="write the figure (time against N) here")
    parser.add_argument("--from-json", help="print (and write) the tables of an earlier run")
    parser.add_argument("--inner", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def run_cluster(args: argparse.Namespace) -> dict:
    """Make the emulated cluster, run the measurements inside it, remove it."""
    from rlcomm import get_settings
    from tests.netns import NetnsCluster, ray_env, tail, unsupported

    reason = unsupported(need_tc=True)
    if reason:
        raise SystemExit(f"bench_multinode: {reason}")
    if args.nodes < 2:
        raise SystemExit("bench_multinode: --nodes must be at least 2")
    cluster = NetnsCluster(args.nodes)
    tmp = tempfile.mkdtemp(prefix="rlcb-")  # short: Ray's unix socket paths live under it
    nodes = []
    load_before = _load()
    try:
        cluster.make()
        cluster.shape(args.rate)
        env = ray_env()
        for i in range(args.nodes):
            nodes.append(cluster.start_node(
                i, os.path.join(tmp, f"n{i}"), os.path.join(tmp, f"node{i}.log"), env,
                object_store_bytes=args.object_store_mib * MIB,
            ))
        spec = {
            "ips": cluster.ips, "mib": args.mib, "tensors": args.tensors,
            "repeats": args.repeats, "chunk": args.chunk or get_settings().bcast_chunk_bytes,
            "counts": list(range(2, args.nodes + 1)), "switch_mib": args.switch_mib,
            "switch_nodes": sorted({2, args.nodes}), "switch_repeats": max(5, args.repeats),
            "chunks": args.chunks, "sync_mib": args.sync_mib,
            "sync_tensors": args.sync_tensors, "sync_pool_mib": args.sync_pool_mib,
            "sync_only": args.sync_only,
        }
        proc = subprocess.Popen(
            cluster.exec(0, sys.executable, os.path.abspath(__file__), "--inner",
                         json.dumps(spec)),
            stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT,
        )
        result = None
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("BENCH_RESULT "):
                result = json.loads(line.split(" ", 1)[1])
            else:
                print(line, end="", flush=True)
        proc.wait()
        if result is None or "error" in result:
            tails = "".join(
                f"--- node {i}\n" + tail(os.path.join(tmp, f"node{i}.log"), 10)
                for i in range(len(nodes))
            )
            raise SystemExit(f"bench_multinode: the run failed: "
                             f"{(result or {}).get('error', f'exit {proc.returncode}')}\n{tails}")
    finally:
        for node in reversed(nodes):
            node.stop()
        cluster.remove()
        shutil.rmtree(tmp, ignore_errors=True)
    result["args"] = {k: v for k, v in vars(args).items() if k not in ("inner", "from_json")}
    result["args"]["chunk"] = spec["chunk"]
    result["host"] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                      "load_before": load_before, "load_after": _load()}
    result["date"] = time.strftime("%Y-%m-%d")
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.inner:
        try:
            out = _inner(json.loads(args.inner))
        except Exception as exc:  # noqa: BLE001 - reported to the outer part
            import traceback

            out = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
        print("BENCH_RESULT " + json.dumps(out), flush=True)
        sys.stdout.flush()
        os._exit(0)  # threads waiting on the cluster's processes would hold the exit
    if args.from_json:
        with open(args.from_json) as f:
            result = json.load(f)
    else:
        result = run_cluster(args)
    print(multinode_tables(result))
    print(json.dumps(multinode_acceptance(result)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.png:
        plot(result, args.png)


if __name__ == "__main__":
    main()
