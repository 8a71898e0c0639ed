#!/usr/bin/env python
"""Point-to-point bandwidth and latency: rlcomm's paths beside their baselines, one run.

Two workers (same node by default, ``--nodes 2`` puts them on two nodes of a running
cluster) move float32 CPU tensors of each size. rlcomm paths: ``send/recv``,
``send_tensor/recv_tensor``, their ``async_op=True`` variants, ``send/recv`` forced onto
Gloo, and channel ``put/get`` up to 256 MiB (rank 0 puts into a channel whose worker
sits on rank 0's node, rank 1 gets; larger items would keep GiB-sized segment pools on
three more connections, which this 24 GiB machine cannot hold beside the rest). Baselines, measured in the
same run: raw ``torch.distributed`` Gloo send/recv between the same two actors, a Ray
actor->actor call with the tensor as argument (default pickling, and with
``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1``), Ray Direct Transport over Gloo, and a Ray
Compiled Graph between two actors, owned by the sender (it compiles the graph and
executes it, the receiver's method takes the payload over Ray's shared-memory channels;
up to 256 MiB, as the channel),
timed inside the sender as rlcomm's paths are. Small payloads (up to 64 KiB) also go as
``bytes`` objects, on rlcomm's ``send/recv`` and on the compiled graph, and (latency
only) as a dict of one tensor on rlcomm's ``send/recv``.

Bandwidth is bytes / seconds per transfer (GB/s = 1e9 B/s), latency is half the round
trip of a ping-pong; each figure is the median of ``--repeats`` timed batches
(``--latency-repeats`` for latency: its batches are short, and a median of few of them
swings with the machine's moods), with min and max. The latency batches of one size go
in rounds, a batch of each path in turn
(the compiled graph's two in rounds of their own, while its graph lives), so that the
machine's moods fall on every path alike. The compiled graph's cases come after all
others: its actors keep taking CPU time for a while after a graph is torn down. Times are taken inside the workers, except
for the Ray baselines, which time the actor calls the way a Ray user would make them.

    python scripts/bench_p2p.py --json bench_p2p.json --plot bench_p2p.png
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any

import ray
import torch
import torch.distributed as dist

from rlcomm import Channel, Cluster, CollectiveGroupOptions, NodePlacementStrategy, Worker
from rlcomm.comm.transports.shm import SHM_SUPPORTED, ShmTransport

SIZES = [4, 1 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20, 1 << 30]
GRAPH = "ray compiled graph"
CHANNEL_MAX = 256 << 20  # the largest channel put/get measured (see the docstring)
LATENCY_MAX = 64 << 10  # sizes up to this also get a ping-pong latency
GLOO = CollectiveGroupOptions(transport="gloo")
BYTES = " (bytes)"  # a path's suffix: the payload is a bytes object, not a tensor
DICT = " (dict)"  # a path's suffix: the payload is a dict of one tensor (latency only)
#: A compiled graph's executions in flight at most while streaming, and the bytes they
#: may hold together (the graph's actors keep what they received until it is read: eight
#: 256 MiB payloads in flight beside the rest of this run ran a 24 GiB machine out of
#: memory). The graph's rows stop at GRAPH_MAX, as the channel's do.
GRAPH_WINDOW = 8
GRAPH_WINDOW_BYTES = 256 << 20
GRAPH_MAX = 256 << 20


def human_size(n: int) -> str:
    """``n`` bytes the way the tables name sizes (4 B, 1 KiB, 16 MiB, 1 GiB)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n // scale} {unit}"
    return f"{n} B"


class BenchWorker(Worker):
    """Rank 0 sends, rank 1 receives; each timed method returns seconds (rank 0)."""

    def __init__(self) -> None:
        super().__init__()
        torch.set_num_threads(1)
        self._bufs: dict[int, torch.Tensor] = {}
        self._raw_shm: ShmTransport | None = None
        self._channel: Channel | None = None

    def _buf(self, nbytes: int) -> torch.Tensor:
        if nbytes not in self._bufs:
            self._bufs = {nbytes: torch.ones(max(1, nbytes // 4), dtype=torch.float32)}
        return self._bufs[nbytes]

    def _peer(self) -> tuple[str, int]:
        return self.worker_group_name, 1 - self._rank

    def _payload(self, path: str, nbytes: int) -> tuple[str, Any]:
        """The path without its payload suffix, and the payload (a tensor, or bytes)."""
        if path.endswith(BYTES):
            return path[: -len(BYTES)], b"x" * nbytes
        if path.endswith(DICT):
            return path[: -len(DICT)], {"x": self._buf(nbytes)}
        return path, self._buf(nbytes)

    def transfer(self, path: str, nbytes: int, iters: int) -> float:
        group, peer = self._peer()
        path, t = self._payload(path, nbytes)
        opts = GLOO if path == "send/recv (gloo)" else None
        ack = torch.zeros(1)
        start = time.perf_counter()
        if path == "raw gloo":
            if self._rank == 0:
                for _ in range(iters):
                    dist.send(t, 1)
                dist.recv(ack, 1)
            else:
                for _ in range(iters):
                    dist.recv(t, 0)
                dist.send(ack, 0)
        elif path == "raw shm":
            raw, flat, flat_ack = self._raw_shm, t.view(torch.uint8), ack.view(torch.uint8)
            if self._rank == 0:
                for _ in range(iters):
                    raw.send([flat], 600)
                raw.recv_into([flat_ack], 600)
            else:
                for _ in range(iters):
                    raw.recv_into([flat], 600)
                raw.send([flat_ack], 600)
        elif path == "channel put/get":
            if self._rank == 0:
                for _ in range(iters):
                    self._channel.put(t)
                self.recv(group, peer)
            else:
                for _ in range(iters):
                    self._channel.get()
                self.send(ack, group, peer)
        elif self._rank == 0:
            if path in ("send/recv", "send/recv (gloo)"):
                for _ in range(iters):
                    self.send(t, group, peer, options=opts)
            elif path == "send_tensor/recv_tensor":
                for _ in range(iters):
                    self.send_tensor(t, group, peer)
            elif path == "async send/recv":
                works = [self.send(t, group, peer, async_op=True) for _ in range(iters)]
                for w in works:
                    w.wait()
            self.recv(group, peer, options=opts)
        else:
            if path in ("send/recv", "send/recv (gloo)"):
                for _ in range(iters):
                    self.recv(group, peer, options=opts)
            elif path == "send_tensor/recv_tensor":
                for _ in range(iters):
                    self.recv_tensor(t, group, peer)
            elif path == "async send/recv":
                works = [self.recv(group, peer, async_op=True) for _ in range(iters)]
                for w in works:
                    w.wait()
            self.send(ack, group, peer, options=opts)
        return time.perf_counter() - start

    def ping_pong(self, path: str, nbytes: int, iters: int) -> float:
        """Seconds for ``iters`` round trips, timed from a first, untimed one: the two
        workers' calls start apart (each a Ray call of its own), and the time one waits
        for the other is not the path's."""
        group, peer = self._peer()
        path, t = self._payload(path, nbytes)
        for i in range(iters + 1):
            if i == 1:
                start = time.perf_counter()
            if path == "raw gloo":
                if self._rank == 0:
                    dist.send(t, 1)
                    dist.recv(t, 1)
                else:
                    dist.recv(t, 0)
                    dist.send(t, 0)
            elif path == "raw shm":
                flat = t.view(torch.uint8)
                if self._rank == 0:
                    self._raw_shm.send([flat], 600)
                    self._raw_shm.recv_into([flat], 600)
                else:
                    self._raw_shm.recv_into([flat], 600)
                    self._raw_shm.send([flat], 600)
            elif path == "send_tensor/recv_tensor":
                if self._rank == 0:
                    self.send_tensor(t, group, peer)
                    self.recv_tensor(t, group, peer)
                else:
                    self.recv_tensor(t, group, peer)
                    self.send_tensor(t, group, peer)
            else:
                opts = GLOO if path == "send/recv (gloo)" else None
                if self._rank == 0:
                    self.send(t, group, peer, options=opts)
                    self.recv(group, peer, options=opts)
                else:
                    got = self.recv(group, peer, options=opts)
                    self.send(got, group, peer, options=opts)
        return time.perf_counter() - start

    def init_raw_gloo(self) -> bool:
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        return True

    def init_raw_shm(self) -> bool:
        """The shared-memory transport alone, without rlcomm's messages around it (the
        raw path that rlcomm's same-node send/recv runs on)."""
        if not SHM_SUPPORTED:
            return False
        # A client of the store that init_raw_gloo's process group started.
        client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                               is_master=False)
        store = dist.PrefixStore("raw_shm", client)
        self._raw_shm = ShmTransport(store, self._rank, 60, f"rank {1 - self._rank}")
        return True

    def use_channel(self, name: str) -> bool:
        self._channel = Channel.connect(name)
        return True

    def first_contact(self) -> float:
        group, peer = self._peer()
        start = time.perf_counter()
        if self._rank == 0:
            self.send(torch.ones(1), group, peer)
            self.recv(group, peer)
        else:
            self.send(self.recv(group, peer), group, peer)
        return time.perf_counter() - start


@ray.remote(num_cpus=0)
class RayPeer:
    """A plain Ray actor for the Ray baselines."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self._t: torch.Tensor | None = None
        # The zero-copy baseline is measured on purpose, on tensors it never writes; Ray's
        # warnings about zero-copy tensors would read like a failure of the run.
        warnings.filterwarnings("ignore", category=UserWarning, module=r"ray\.")

    def sink(self, t: torch.Tensor) -> int:
        return t.numel()

    def push(self, other: Any, nbytes: int, iters: int) -> float:
        if self._t is None or self._t.numel() * 4 != nbytes:
            self._t = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
        start = time.perf_counter()
        for _ in range(iters):
            ray.get(other.sink.remote(self._t))
        return time.perf_counter() - start

    @ray.method(tensor_transport="gloo")
    def make(self, nbytes: int) -> torch.Tensor:
        if self._t is None or self._t.numel() * 4 != nbytes:
            self._t = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
        return self._t


def _kind(path: str) -> str:
    return "bytes" if path.endswith(BYTES) else "tensor"


def _payload(kind: str, nbytes: int) -> Any:
    return b"x" * nbytes if kind == "bytes" else torch.ones(max(1, nbytes // 4))


@ray.remote(num_cpus=0)
class GraphPeer:
    """A plain Ray actor of a compiled graph: the sender compiles a graph of one node,
    the receiver's :meth:`reply`, and executes it; the receiver answers with the payload
    (``echo``, for a ping-pong) or a small int."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self._graph: Any = None
        warnings.filterwarnings("ignore", category=UserWarning, module=r"ray\.")

    def reply(self, x: Any, echo: bool) -> Any:
        return x if echo else 1

    def compile(self, receiver: Any) -> bool:
        from ray.dag import InputNode

        with InputNode() as inp:
            node = receiver.reply.bind(inp[0], inp[1])
        self._graph = node.experimental_compile(_max_inflight_executions=2 * GRAPH_WINDOW)
        return True

    def transfer(self, kind: str, nbytes: int, iters: int) -> float:
        """Seconds for ``iters`` executions, at most :data:`GRAPH_WINDOW` (and
        :data:`GRAPH_WINDOW_BYTES`) in flight."""
        x = _payload(kind, nbytes)
        window = max(1, min(GRAPH_WINDOW, GRAPH_WINDOW_BYTES // max(nbytes, 1)))
        pending: collections.deque = collections.deque()
        start = time.perf_counter()
        for _ in range(iters):
            pending.append(self._graph.execute(x, False))
            if len(pending) >= window:
                ray.get(pending.popleft())
        while pending:
            ray.get(pending.popleft())
        return time.perf_counter() - start

    def ping_pong(self, kind: str, nbytes: int, iters: int) -> float:
        x = _payload(kind, nbytes)
        start = time.perf_counter()
        for _ in range(iters):
            ray.get(self._graph.execute(x, True))
        return time.perf_counter() - start

    def teardown(self) -> bool:
        if self._graph is not None:
            self._graph.teardown()
            self._graph = None
        return True


def _iters(nbytes: int, target: int) -> int:
    return max(1, min(2000, target // max(nbytes, 1)))


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.records: list[dict[str, Any]] = []
        ray_kwargs = {"include_dashboard": False, "logging_level": "ERROR"}
        self.cluster = Cluster(num_nodes=args.nodes, ray_init_kwargs=ray_kwargs)
        nodes = [0, min(1, args.nodes - 1)]
        self.pair = BenchWorker.create_group().launch(
            self.cluster, NodePlacementStrategy(nodes), name="bench_p2p"
        )
        self.pair.init_raw_gloo().wait(timeout=120)
        self.channel = Channel.create(f"bench_p2p_{os.getpid()}", cluster=self.cluster,
                                      node_rank=nodes[0])
        self.pair.use_channel(self.channel.name).wait(timeout=120)
        self.raw_shm_ok = args.nodes == 1 and all(self.pair.init_raw_shm().wait(timeout=120))
        # Options apply on first contact: the forced-Gloo path gets a pair of its own.
        self.gloo_pair = BenchWorker.create_group().launch(
            self.cluster, NodePlacementStrategy(nodes), name="bench_p2p_gloo"
        )
        node_ids = [self.cluster.nodes[n].node_id for n in nodes]
        self.ray_pairs = {}
        for label, env in (
            ("ray actor call", {}),
            ("ray zero-copy", {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}),
        ):
            self.ray_pairs[label] = [
                RayPeer.options(
                    runtime_env={"env_vars": env} if env else None,
                    scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                        nid, soft=False
                    ),
                ).remote()
                for nid in node_ids
            ]
        self.rdt_ok = self._setup_rdt()
        self.graph_pair = [] if args.no_graph else [
            GraphPeer.options(scheduling_strategy=ray.util.scheduling_strategies
                              .NodeAffinitySchedulingStrategy(nid, soft=False)).remote()
            for nid in node_ids
        ]
        # Started now, not while the first cases run (a starting worker takes a core).
        ray.get([peer.reply.remote(0, False) for peer in self.graph_pair], timeout=300)

    def _setup_graph(self) -> bool:
        """Compile the graph once to see that it works (its actors then serve it on
        threads of their own, which take CPU time while it lives, and for a while after
        it is torn down: the graph's cases come after every other case)."""
        try:
            with self._graph() as sender:
                ray.get(sender.ping_pong.remote("tensor", 4, 3), timeout=120)
            return True
        except Exception as exc:  # noqa: BLE001 - a baseline that cannot run is reported
            print(f"Ray Compiled Graph unavailable: {exc!r}", file=sys.stderr)
            return False

    def _setup_rdt(self) -> bool:
        try:
            from ray.experimental.collective import create_collective_group

            create_collective_group(self.ray_pairs["ray actor call"], backend="torch_gloo")
            a, b = self.ray_pairs["ray actor call"]
            ray.get(b.sink.remote(a.make.remote(16)), timeout=60)
            return True
        except Exception as exc:  # noqa: BLE001 - a baseline that cannot run is reported
            print(f"Ray Direct Transport unavailable: {exc!r}", file=sys.stderr)
            return False

    def record(self, path: str, nbytes: int, metric: str, samples: list[float]) -> None:
        self.records.append({
            "path": path, "bytes": nbytes, "metric": metric,
            "median": statistics.median(samples), "min": min(samples), "max": max(samples),
        })

    def time_pair(self, method: str, path: str, nbytes: int, iters: int) -> list[float]:
        self.time_batch(method, path, nbytes, max(1, iters // 4))  # warm-up
        return [self.time_batch(method, path, nbytes, iters) / iters
                for _ in range(self.args.repeats)]

    def time_rounds(self, paths: list[str], nbytes: int, iters: int) -> dict[str, list[float]]:
        """Round trips (seconds) of each pair path's ping-pong, taken in rounds: one
        batch of each path per round, in turn, so that what the machine does meanwhile
        falls on every path alike (a path timed after another would get its own share)."""
        for p in paths:  # warm-up
            self.time_batch("ping_pong", p, nbytes, max(1, iters // 4))
        out: dict[str, list[float]] = {p: [] for p in paths}
        for _ in range(self.args.latency_repeats):
            for p in paths:
                out[p].append(self.time_batch("ping_pong", p, nbytes, iters) / iters)
        return out

    def time_batch(self, method: str, path: str, nbytes: int, iters: int) -> float:
        pair = self.gloo_pair if path == "send/recv (gloo)" else self.pair
        return getattr(pair, method)(path, nbytes, iters).wait(timeout=600)[0]

    @contextlib.contextmanager
    def _graph(self) -> Iterator[Any]:
        """The graph compiled for the cases inside (a live graph takes CPU time from
        every other case of this 2-core machine); yields its sender, which executes it."""
        a, b = self.graph_pair
        ray.get(a.compile.remote(b), timeout=120)
        try:
            yield a
        finally:
            ray.get(a.teardown.remote(), timeout=120)

    def time_graph_rounds(self, nbytes: int, iters: int) -> dict[str, list[float]]:
        """The compiled graph's round trips, tensor and ``bytes`` in turn as
        :meth:`time_rounds` takes the pair's, on one graph compiled for them alone."""
        kinds = {GRAPH: "tensor", GRAPH + BYTES: "bytes"}
        with self._graph() as sender:
            for kind in kinds.values():
                ray.get(sender.ping_pong.remote(kind, nbytes, max(1, iters // 4)), timeout=600)
            out: dict[str, list[float]] = {p: [] for p in kinds}
            for _ in range(self.args.latency_repeats):
                for p, kind in kinds.items():
                    out[p].append(
                        ray.get(sender.ping_pong.remote(kind, nbytes, iters), timeout=600) / iters)
            return out

    def time_ray(self, label: str, nbytes: int, iters: int) -> list[float]:
        a, b = self.ray_pairs[label]
        ray.get(a.push.remote(b, nbytes, 1), timeout=600)
        return [ray.get(a.push.remote(b, nbytes, iters), timeout=600) / iters
                for _ in range(self.args.repeats)]

    def time_graph(self, kind: str, nbytes: int, iters: int) -> list[float]:
        """Seconds per transfer of a compiled graph's bandwidth case, on a graph compiled
        for it alone."""
        with self._graph() as sender:
            ray.get(sender.transfer.remote(kind, nbytes, max(1, iters // 4)), timeout=600)
            return [ray.get(sender.transfer.remote(kind, nbytes, iters), timeout=600) / iters
                    for _ in range(self.args.repeats)]

    def time_rdt(self, nbytes: int, iters: int) -> list[float]:
        a, b = self.ray_pairs["ray actor call"]
        ray.get(b.sink.remote(a.make.remote(nbytes)), timeout=600)
        out = []
        for _ in range(self.args.repeats):
            start = time.perf_counter()
            for _ in range(iters):
                ray.get(b.sink.remote(a.make.remote(nbytes)), timeout=600)
            out.append((time.perf_counter() - start) / iters)
        return out

    def run(self) -> None:
        from tqdm import tqdm

        paths = ["send/recv", "send_tensor/recv_tensor", "async send/recv", "send/recv (gloo)",
                 "channel put/get", "raw gloo", "ray actor call", "ray zero-copy"]
        raw_shm = ["raw shm"] if self.raw_shm_ok else []
        paths[6:6] = raw_shm
        if self.rdt_ok:
            paths.append("ray direct transport (gloo)")
        small = [s for s in self.args.sizes if s <= LATENCY_MAX]
        jobs = [(p, s) for s in self.args.sizes for p in paths
                if p != "channel put/get" or s <= CHANNEL_MAX]
        jobs += [("send/recv" + BYTES, s) for s in small]
        jobs += [(f"latency:{s}", s) for s in small]
        latency_paths = ["send/recv", "send_tensor/recv_tensor", "send/recv (gloo)", "raw gloo",
                         *raw_shm, "send/recv" + BYTES, "send/recv" + DICT]
        # The compiled graph's cases last: its threads take CPU time for a while after a
        # graph is torn down, which the case after it would pay.
        graph_jobs = [] if not self.graph_pair else [
            (GRAPH, s) for s in self.args.sizes if s <= GRAPH_MAX]
        graph_jobs += [(GRAPH + BYTES, s) for s in small if self.graph_pair]
        graph_jobs += [(f"{GRAPH} latency:{s}", s) for s in small if self.graph_pair]

        def one(path: str, nbytes: int) -> None:
            big = nbytes >= (256 << 20)
            iters = _iters(nbytes, self.args.target_bytes if not path.startswith("ray") else
                           self.args.target_bytes // 8)
            if big and path.startswith("ray"):
                iters = 1
            if "latency:" in path:
                rounds = (self.time_graph_rounds if path.startswith(GRAPH) else
                          functools.partial(self.time_rounds, latency_paths))(
                    nbytes, min(500, iters))
                for p, rtt in rounds.items():
                    self.record(p, nbytes, "latency_us", [r / 2 * 1e6 for r in rtt])
                return
            if path.startswith(GRAPH):
                secs = self.time_graph(_kind(path), nbytes, min(iters, 2000))
            elif path in ("ray actor call", "ray zero-copy"):
                secs = self.time_ray(path, nbytes, min(iters, 200))
            elif path.startswith("ray direct"):
                secs = self.time_rdt(nbytes, min(iters, 200))
            else:
                secs = self.time_pair("transfer", path, nbytes, iters)
            self.record(path, nbytes, "GB/s", [nbytes / s / 1e9 for s in secs])

        for path, nbytes in tqdm(jobs, desc="bench_p2p", unit="case", file=sys.stderr):
            one(path, nbytes)
        self.cold()
        if graph_jobs and self._setup_graph():
            for path, nbytes in tqdm(graph_jobs, desc="bench_p2p (compiled graph)",
                                     unit="case", file=sys.stderr):
                one(path, nbytes)

    def cold(self) -> None:
        """The first send/recv of fresh pairs (the connection made on first contact)."""
        colds = []
        for i in range(self.args.cold_repeats):
            fresh = BenchWorker.create_group().launch(
                self.cluster, NodePlacementStrategy([0, min(1, self.args.nodes - 1)]),
                name=f"bench_cold_{i}",
            )
            colds.append(fresh.first_contact().wait(timeout=120)[0] * 1e3)
            fresh.shutdown()
        if colds:
            self.record("first send/recv of a fresh pair", 4, "cold_ms", colds)

    def table(self) -> str:
        sizes = self.args.sizes
        lines = []

        def emit(title: str, metric: str, fmt: str, sizes_here: list[int]) -> None:
            rows = sorted({r["path"] for r in self.records if r["metric"] == metric},
                          key=lambda p: [r["path"] for r in self.records].index(p))
            if not rows:
                return
            lines.append(f"\n{title}")
            head = f"{'path':34s}" + "".join(f"{human_size(s):>14s}" for s in sizes_here)
            lines.append(head)
            lines.append("-" * len(head))
            for p in rows:
                cells = []
                for s in sizes_here:
                    r = self.get(p, s, metric)
                    cells.append(f"{format(r['median'], fmt):>14s}" if r else f"{'-':>14s}")
                lines.append(f"{p:34s}" + "".join(cells))

        emit("Bandwidth, GB/s (median)", "GB/s", ".3g", sizes)
        emit("One-way latency, us (median of half round trips)", "latency_us", ".1f",
             [s for s in sizes if s <= LATENCY_MAX])
        lines.append("\nRatios, rlcomm send/recv over each baseline (bandwidth; >1 is faster)")
        head = f"{'baseline':34s}" + "".join(f"{human_size(s):>14s}" for s in sizes)
        lines.append(head)
        lines.append("-" * len(head))
        for base in ("raw gloo", "ray actor call", "ray zero-copy", "ray direct transport (gloo)",
                     GRAPH):
            cells = []
            for s in sizes:
                ours, theirs = self.get("send/recv", s, "GB/s"), self.get(base, s, "GB/s")
                cells.append(f"{ours['median'] / theirs['median']:>13.2f}x" if ours and theirs
                             else f"{'-':>14s}")
            if any(c.strip() != "-" for c in cells):
                lines.append(f"{base:34s}" + "".join(cells))
        tensor_vs_shm = [(s, self.get("send_tensor/recv_tensor", s, "GB/s"),
                          self.get("raw shm", s, "GB/s")) for s in sizes if s >= (1 << 20)]
        if any(a and b for _, a, b in tensor_vs_shm):
            lines.append("\nsend_tensor/recv_tensor over the raw shm transport it runs on "
                         "(bandwidth, >= 1 MiB): " + ", ".join(
                             f"{human_size(s)} {a['median'] / b['median']:.2f}x"
                             for s, a, b in tensor_vs_shm if a and b))
        lat = [(s, self.get("send/recv", s, "latency_us"), self.get("raw gloo", s, "latency_us"))
               for s in sizes if s <= LATENCY_MAX]
        if lat:
            lines.append("\nLatency ratio, rlcomm send/recv over raw gloo (<1 is faster): " + ", ".join(
                f"{human_size(s)} {a['median'] / b['median']:.2f}x" for s, a, b in lat if a and b))
        for ours, theirs in (("send/recv", "raw shm"), ("send/recv" + BYTES, "raw shm"),
                             ("send/recv" + DICT, "raw shm"),
                             (GRAPH, "send/recv"), (GRAPH + BYTES, "send/recv" + BYTES)):
            pairs = [(s, self.get(ours, s, "latency_us"), self.get(theirs, s, "latency_us"))
                     for s in sizes if s <= LATENCY_MAX]
            if any(a and b for _, a, b in pairs):
                lines.append(f"Latency ratio, {ours} over {theirs}: " + ", ".join(
                    f"{human_size(s)} {a['median'] / b['median']:.2f}x"
                    for s, a, b in pairs if a and b))
        cold = self.get("first send/recv of a fresh pair", 4, "cold_ms")
        if cold:
            lines.append(f"\nFirst send/recv of a fresh pair (lazy connection): median "
                         f"{cold['median']:.1f} ms (min {cold['min']:.1f}, max {cold['max']:.1f})")
        return "\n".join(lines)

    def get(self, path: str, nbytes: int, metric: str) -> dict[str, Any] | None:
        for r in self.records:
            if r["path"] == path and r["bytes"] == nbytes and r["metric"] == metric:
                return r
        return None

    def plot(self, out: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 6))
        for path in dict.fromkeys(r["path"] for r in self.records if r["metric"] == "GB/s"):
            pts = [(r["bytes"], r["median"]) for r in self.records
                   if r["path"] == path and r["metric"] == "GB/s"]
            style = "-o" if not path.startswith(("raw", "ray")) else "--s"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=path)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("bandwidth (GB/s)")
        ax.set_title("Point-to-point bandwidth, two workers, one node (2 cores)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out, dpi=120)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=SIZES,
                        help="comma-separated message sizes in bytes (default 4 B .. 1 GiB)")
    parser.add_argument("--max-size", type=int, default=None, help="drop sizes above this")
    parser.add_argument("--repeats", type=int, default=5, help="timed batches per case")
    parser.add_argument("--latency-repeats", type=int, default=15,
                        help="timed batches per latency case (rounds of every path)")
    parser.add_argument("--target-bytes", type=int, default=256 << 20,
                        help="bytes moved per timed batch (sets the iterations per size)")
    parser.add_argument("--cold-repeats", type=int, default=2, help="fresh pairs for cold start")
    parser.add_argument("--nodes", type=int, default=1, help="2: the two workers on two nodes")
    parser.add_argument("--no-graph", action="store_true",
                        help="leave out the Ray Compiled Graph rows (each case compiles a graph)")
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--plot", help="write a bandwidth-vs-size PNG here")
    parser.add_argument("--from-json", help="print the tables (and --plot) of an earlier run")
    args = parser.parse_args(argv)
    if args.max_size:
        args.sizes = [s for s in args.sizes if s <= args.max_size]
    return args


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    args = parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        bench = Bench.__new__(Bench)
        bench.args = argparse.Namespace(**{**vars(args), "sizes": saved["args"]["sizes"]})
        bench.records = saved["records"]
        print(bench.table())
        if args.plot:
            bench.plot(args.plot)
        return
    bench = Bench(args)
    bench.run()
    print(bench.table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "records": bench.records},
                      f, indent=1)
    if args.plot:
        bench.plot(args.plot)
    bench.channel.shutdown()
    bench.pair.shutdown()
    bench.gloo_pair.shutdown()


if __name__ == "__main__":
    main()
