#!/usr/bin/env python
"""Channel throughput: rlcomm channels beside ``ray.util.queue.Queue``, in one run.

One producer worker streams items to one consumer worker through a queue (each worker
its own process, all on one node), for four item kinds: 1 KiB ``bytes``, 1 MiB float32
CPU tensors, and large items: 64 MiB float32 CPU tensors and 64 MiB ``bytes`` (pickled by
the codec). ``--kinds`` picks some; ``--no-ray`` leaves Ray's queue out. Each kind runs

- *one at a time*: the producer calls a blocking ``put(item)`` per item, the consumer a
  blocking ``get()`` per item (rlcomm ``Channel.put/get``; Ray ``Queue.put/get``);
- *batched*: batches of ``B`` items. rlcomm: the producer posts ``B``
  ``put(item, async_op=True)`` and waits for the previous batch's works (two batches in
  flight; puts posted in a row travel in one message); the consumer calls
  ``get_batch(B)`` (items of weight 1). Ray: ``put_nowait_batch`` of a list of ``B`` and
  ``get_nowait_batch(B)``, retried after 1 ms while fewer than ``B`` are queued;
- (rlcomm only) *pipelined puts*: ``put(item, async_op=True)`` per item with at most
  ``B`` in flight, consumer ``get()`` per item: one item per call on both ends.

Beside them, a Ray Compiled Graph between two actors that the producer's actor owns (it
compiles a graph of one node, the consumer's method, and executes it; the items go over
Ray's shared-memory channels): *one at a time* is an execution whose result the
producer waits for; *pipelined*, at most ``B`` executions in flight. Its cases run
after all others, on a graph compiled for them (a live graph's actors take CPU time from
whatever runs beside them). ``--no-graph`` leaves it out.

Items/s is the number of items over the time from the producer's first put to the
consumer's last get (wall clock, same machine; for the compiled graph, the producer's
first execution to its last result), median of ``--repeats`` runs after a warm-up. A second table breaks one item's cost down: the rlcomm point-to-point round
trip (``send`` then ``recv`` of the same item between the same two workers), a channel
``put`` alone (no consumer), a ``get`` alone (pre-filled), and Ray's ``put``/``get``.

    python scripts/bench_channel.py [--json bench_channel.json] [--address local]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import time
from typing import Any

import ray
import torch
from ray.util.queue import Empty, Queue

from rlcomm import Channel, Cluster, NodePlacementStrategy, Worker

KIB = 1 << 10
MIB = 1 << 20
POLL = 0.001
GRAPH = "ray compiled graph"


KINDS = ("1 KiB", "1 MiB", "64 MiB", "64 MiB bytes")


def make_item(kind: str) -> Any:
    if kind == "1 KiB":
        return bytes(KIB)
    if kind == "64 MiB":
        return torch.ones(64 * MIB // 4, dtype=torch.float32)
    if kind == "64 MiB bytes":
        return bytes(64 * MIB)
    return torch.ones(MIB // 4, dtype=torch.float32)


def put_windowed(put_async: Any, n: int, batch: int) -> None:
    """``n`` calls of ``put_async()`` (each returns a handle with ``wait()``), at most two
    windows of ``batch`` in flight: a window is waited for once the next one is full."""
    window: list[Any] = []
    previous: list[Any] = []
    for _ in range(n):
        window.append(put_async())
        if len(window) == batch:
            for work in previous:
                work.wait()
            previous, window = window, []
    for work in previous + window:
        work.wait()


class Producer(Worker):
    """Puts ``n`` items; returns the wall-clock time of its first put."""

    def __init__(self) -> None:
        super().__init__()
        torch.set_num_threads(1)

    def produce(self, queue: Any, backend: str, mode: str, kind: str, n: int, batch: int) -> float:
        item = make_item(kind)
        start = time.time()
        if backend == "ray":
            if mode == "batched":
                for i in range(0, n, batch):
                    queue.put_nowait_batch([item] * min(batch, n - i))
            else:
                for _ in range(n):
                    queue.put(item)
        elif mode == "one":
            for _ in range(n):
                queue.put(item)
        else:  # "batched" and "pipelined": async puts, at most two batches / B in flight
            put_windowed(lambda: queue.put(item, weight=1, async_op=True), n, batch)
        return start

    def where(self) -> str:
        """Where this worker imported rlcomm from."""
        import rlcomm

        return rlcomm.__file__

    def put_latency(self, queue: Any, backend: str, kind: str, n: int) -> float:
        """Seconds per blocking put, nobody consuming (the queue is unbounded)."""
        item = make_item(kind)
        start = time.perf_counter()
        for _ in range(n):
            queue.put(item)
        return (time.perf_counter() - start) / n

    def fill(self, channel: Channel, kind: str, n: int) -> None:
        item = make_item(kind)
        for work in [channel.put(item, async_op=True) for _ in range(n)]:
            work.wait()

    def ping(self, peer: str, kind: str, n: int) -> float:
        """Seconds per rlcomm send + recv round trip with the consumer."""
        item = make_item(kind)
        self.send(item, peer, 0)
        self.recv(peer, 0)
        start = time.perf_counter()
        for _ in range(n):
            self.send(item, peer, 0)
            self.recv(peer, 0)
        return (time.perf_counter() - start) / n


class Consumer(Worker):
    """Gets ``n`` items; returns the wall-clock time of its last get."""

    def __init__(self) -> None:
        super().__init__()
        torch.set_num_threads(1)

    def consume(self, queue: Any, backend: str, mode: str, n: int, batch: int) -> float:
        got = 0
        if backend == "ray" and mode == "batched":
            while got < n:
                try:
                    got += len(queue.get_nowait_batch(min(batch, n - got)))
                except Empty:
                    time.sleep(POLL)
        elif backend == "rlcomm" and mode == "batched":
            while got < n:
                got += len(queue.get_batch(min(batch, n - got), timeout=120))
        elif backend == "ray":
            for _ in range(n):
                queue.get(timeout=120)
            got = n
        else:
            for _ in range(n):
                queue.get(timeout=120)
            got = n
        return time.time()

    def get_latency(self, queue: Any, backend: str, n: int) -> float:
        """Seconds per blocking get from a pre-filled queue."""
        start = time.perf_counter()
        for _ in range(n):
            queue.get(timeout=120)
        return (time.perf_counter() - start) / n

    def pong(self, peer: str, n: int) -> None:
        for _ in range(n + 1):
            self.send(self.recv(peer, 0), peer, 0)


@ray.remote(num_cpus=0)
class GraphEnd:
    """One end of a Ray Compiled Graph: the producer's compiles and executes a graph of
    one node, the consumer's :meth:`take`."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self._graph: Any = None

    def take(self, item: Any) -> int:
        return 1

    def compile(self, consumer: Any) -> bool:
        from ray.dag import InputNode

        with InputNode() as inp:
            node = consumer.take.bind(inp)
        self._graph = node.experimental_compile(_max_inflight_executions=256)
        return True

    def stream(self, kind: str, n: int, window: int) -> float:
        """Items/s of ``n`` executions, at most ``window`` in flight (1: one at a time)."""
        item = make_item(kind)
        pending: collections.deque = collections.deque()
        start = time.perf_counter()
        for _ in range(n):
            pending.append(self._graph.execute(item))
            if len(pending) >= window:
                ray.get(pending.popleft())
        while pending:
            ray.get(pending.popleft())
        return n / (time.perf_counter() - start)

    def teardown(self) -> bool:
        if self._graph is not None:
            self._graph.teardown()
            self._graph = None
        return True


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.cluster = Cluster(num_nodes=1)
        self.producer = Producer.create_group().launch(
            self.cluster, NodePlacementStrategy([0]), name="bench_channel_producer"
        )
        self.consumer = Consumer.create_group().launch(
            self.cluster, NodePlacementStrategy([0]), name="bench_channel_consumer"
        )
        self.records: list[dict[str, Any]] = []
        self.latency: list[dict[str, Any]] = []
        self._channels = 0
        self.graph: list[Any] = []
        if not args.no_graph:  # started now, compiled for its own cases only (see run)
            self.graph = [GraphEnd.remote(), GraphEnd.remote()]
            ray.get([end.take.remote(None) for end in self.graph], timeout=300)

    def graph_throughput(self, mode: str, kind: str, n: int, window: int) -> None:
        """Items/s of the compiled graph, as :meth:`throughput` for a channel."""
        producer = self.graph[0]
        ray.get(producer.stream.remote(kind, max(window, n // 10), window), timeout=600)
        rates = [ray.get(producer.stream.remote(kind, n, window), timeout=600)
                 for _ in range(self.args.repeats)]
        record = {"backend": GRAPH, "mode": mode, "kind": kind, "items": n, "batch": window,
                  "items_per_s": statistics.median(rates), "min": min(rates),
                  "max": max(rates)}
        self.records.append(record)
        print(f"  graph   {mode:9s} {kind:6s} n={n:6d} B={window:4d}: "
              f"{record['items_per_s']:10.0f} items/s", flush=True)

    def _queue(self, backend: str) -> Any:
        if backend == "ray":
            return Queue(actor_options={"num_cpus": 0})
        self._channels += 1
        return Channel.create(f"bench_channel_{os.getpid()}_{self._channels}", cluster=self.cluster)

    def _close(self, backend: str, queue: Any) -> None:
        if backend == "ray":
            queue.shutdown()
        else:
            queue.shutdown()

    def _once(self, queue: Any, backend: str, mode: str, kind: str, n: int, batch: int) -> float:
        consumed = self.consumer.consume(queue, backend, mode, n, batch)
        produced = self.producer.produce(queue, backend, mode, kind, n, batch)
        start = produced.wait(timeout=600)[0]
        end = consumed.wait(timeout=600)[0]
        return n / (end - start)

    def throughput(self, backend: str, mode: str, kind: str, n: int, batch: int,
                   warmup: int | None = None) -> None:
        """Items/s of one case: a warm-up round of ``warmup`` items (a tenth of ``n`` by
        default), then ``--repeats`` timed rounds of ``n``."""
        queue = self._queue(backend)
        try:
            self._once(queue, backend, mode, kind, warmup or max(batch, n // 10), batch)
            rates = [self._once(queue, backend, mode, kind, n, batch)
                     for _ in range(self.args.repeats)]
        finally:
            self._close(backend, queue)
        record = {
            "backend": backend, "mode": mode, "kind": kind, "items": n, "batch": batch,
            "items_per_s": statistics.median(rates), "min": min(rates), "max": max(rates),
        }
        self.records.append(record)
        print(f"  {backend:7s} {mode:9s} {kind:6s} n={n:6d} B={batch:4d}: "
              f"{record['items_per_s']:10.0f} items/s", flush=True)

    def breakdown(self, kind: str, n: int) -> None:
        row: dict[str, Any] = {"kind": kind, "ops": n}
        pong = self.consumer.pong("bench_channel_producer", n)
        row["p2p_round_trip_us"] = self.producer.ping("bench_channel_consumer", kind, n).wait(
            timeout=600)[0] * 1e6
        pong.wait(timeout=600)
        for backend in self.backends:
            queue = self._queue(backend)
            try:
                self.producer.put_latency(queue, backend, kind, 20).wait(timeout=600)
                self.consumer.get_latency(queue, backend, 20).wait(timeout=600)
                put = self.producer.put_latency(queue, backend, kind, n).wait(timeout=600)[0]
                get = self.consumer.get_latency(queue, backend, n).wait(timeout=600)[0]
            finally:
                self._close(backend, queue)
            row[f"{backend}_put_us"] = put * 1e6
            row[f"{backend}_get_us"] = get * 1e6
        self.latency.append(row)

    @property
    def backends(self) -> tuple[str, ...]:
        return ("rlcomm",) if self.args.no_ray else ("rlcomm", "ray")

    def cases(self) -> list[tuple[str, int, int, int]]:
        a = self.args
        every = (
            ("1 KiB", a.small_items, a.small_batched_items, a.small_batch),
            ("1 MiB", a.tensor_items, a.tensor_batched_items, a.tensor_batch),
            ("64 MiB", a.large_items, a.large_batched_items, a.large_batch),
            ("64 MiB bytes", a.large_items, a.large_batched_items, a.large_batch),
        )
        wanted = a.kinds.split(",") if a.kinds else KINDS
        return [case for case in every if case[0] in wanted]

    def run(self) -> None:
        for kind, n_one, n_batched, batch in self.cases():
            for backend in self.backends:
                self.throughput(backend, "one", kind, n_one, 1)
                self.throughput(backend, "batched", kind, n_batched, batch)
            self.throughput("rlcomm", "pipelined", kind, n_one, batch)
            if not kind.startswith("64"):
                self.breakdown(kind, max(50, n_one // 4))
        if not self.graph:
            return
        # The compiled graph's cases last, on a graph compiled for them: a live graph's
        # actors take CPU time from every other case (and for a while after teardown).
        ray.get(self.graph[0].compile.remote(self.graph[1]), timeout=120)
        try:
            for kind, n_one, _, batch in self.cases():
                self.graph_throughput("one", kind, n_one, 1)
                self.graph_throughput("pipelined", kind, n_one, batch)
        finally:
            ray.get(self.graph[0].teardown.remote(), timeout=120)

    def _rate(self, backend: str, mode: str, kind: str) -> float:
        for r in self.records:
            if (r["backend"], r["mode"], r["kind"]) == (backend, mode, kind):
                return r["items_per_s"]
        return float("nan")

    def table(self) -> str:
        lines = [
            f"{'case':44s} {'rlcomm/s':>10s} {'ray/s':>10s} {'ratio':>7s} {'target':>7s}",
        ]
        for kind, _, _, batch in self.cases():
            what = {"1 KiB": "1 KiB bytes", "1 MiB": "1 MiB tensor", "64 MiB": "64 MiB tensor"
                    }.get(kind, kind)
            cases = (
                ("one", "one", f"{what}, one at a time", ">=10x"),
                ("batched", "batched", f"{what}, batched (B={batch})", ">=2x"),
                ("pipelined", "one", f"{what}, async puts + get() vs ray one", ""),
            )
            for mode, ray_mode, label, target in cases:
                ours, theirs = self._rate("rlcomm", mode, kind), self._rate("ray", ray_mode, kind)
                lines.append(f"{label:44s} {ours:10.0f} {theirs:10.0f} {ours / theirs:6.1f}x "
                             f"{target:>7s}")
        if self.graph:
            lines.append("")
            lines.append(f"{'case':44s} {'rlcomm/s':>10s} {'graph/s':>10s} {'ratio':>7s}")
            for kind, _, _, batch in self.cases():
                for mode, label in (("one", "one at a time"),
                                    ("pipelined", f"pipelined (B={batch})")):
                    ours, theirs = self._rate("rlcomm", mode, kind), self._rate(GRAPH, mode, kind)
                    lines.append(f"{kind + ', ' + label:44s} {ours:10.0f} {theirs:10.0f} "
                                 f"{ours / theirs:6.1f}x")
        lines.append("")
        lines.append(f"{'per item, microseconds':24s} {'p2p send+recv':>14s} {'channel put':>12s} "
                     f"{'channel get':>12s} {'ray put':>9s} {'ray get':>9s}")
        for row in self.latency:
            nan = float("nan")
            lines.append(
                f"{row['kind']:24s} {row['p2p_round_trip_us']:14.0f} {row['rlcomm_put_us']:12.0f} "
                f"{row['rlcomm_get_us']:12.0f} {row.get('ray_put_us', nan):9.0f} "
                f"{row.get('ray_get_us', nan):9.0f}"
            )
        return "\n".join(lines)

    def rlcomm_path(self) -> str:
        """Where the workers import rlcomm from (a before/after comparison checks it)."""
        return self.producer.where().wait(timeout=60)[0]

    def shutdown(self) -> None:
        self.producer.shutdown()
        self.consumer.shutdown()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small-items", type=int, default=2000, help="1 KiB items, one at a time")
    parser.add_argument("--small-batched-items", type=int, default=20000)
    parser.add_argument("--small-batch", type=int, default=100)
    parser.add_argument("--tensor-items", type=int, default=200, help="1 MiB tensors, one at a time")
    parser.add_argument("--tensor-batched-items", type=int, default=1000)
    parser.add_argument("--tensor-batch", type=int, default=10)
    parser.add_argument("--large-items", type=int, default=16, help="64 MiB items, one at a time")
    parser.add_argument("--large-batched-items", type=int, default=32)
    parser.add_argument("--large-batch", type=int, default=4)
    parser.add_argument("--kinds", default="", help=f"comma-separated, of {', '.join(KINDS)}")
    parser.add_argument("--no-ray", action="store_true", help="leave ray.util.queue out")
    parser.add_argument("--no-graph", action="store_true",
                        help="leave the Ray Compiled Graph out")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per case (median)")
    parser.add_argument("--address", default="local",
                        help="Ray address: 'local' starts a fresh Ray, 'auto' joins a running one")
    parser.add_argument("--num-cpus", type=int, default=None, help="CPUs of a fresh local Ray")
    parser.add_argument("--json", help="write the records here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    args = parse_args(argv)
    init: dict[str, Any] = {"address": args.address, "include_dashboard": False,
                            "logging_level": "WARNING"}
    if args.address == "local" and args.num_cpus is not None:
        init["num_cpus"] = args.num_cpus
    ray.init(**init)
    bench = Bench(args)
    where = bench.rlcomm_path()
    print(f"rlcomm from {where}", flush=True)
    try:
        bench.run()
    finally:
        bench.shutdown()
    print(bench.table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({
                "args": vars(args),
                "rlcomm": where,
                "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                            "ray": ray.__version__, "torch": torch.__version__},
                "throughput": bench.records,
                "latency": bench.latency,
            }, f, indent=1)


if __name__ == "__main__":
    main()
