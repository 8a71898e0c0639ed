#!/usr/bin/env python
"""Weight sync on one node: a state dict from one worker to N others, three ways, one run.

A 256 MiB state dict (16 float32 tensors of 16 MiB, ``--mib`` and ``--tensors`` change
it) goes from one source worker to 1, 4 and 8 receivers of the same node by:

- ``rlcomm broadcast``: ``Worker.broadcast`` (one copy into shared memory, zero-copy
  copy-on-write views at each receiver);
- ``rlcomm send to each``: the source sends it to every receiver (``send`` with
  ``async_op=True``, all at once), each receiver ``recv``\\ s it;
- ``ray put + zero-copy gets``: plain Ray actors with
  ``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1``; the source ``ray.put``\\ s the dict once and
  hands the reference to every receiver, which ``ray.get``\\ s it.

A figure is the time from the source's start until the last receiver holds the whole
dict (each receiver notes the wall clock when its call returns; all sit on one node),
the median of ``--repeats`` rounds after a first round, which is reported on its own
(it pays for connections, pools and fresh memory). Receivers keep each dict
until the next round arrives, as rollout workers keep their weights. ``--touch``: each
receiver also reads every byte (a sum) before it counts as done.

    python scripts/bench_broadcast.py --json bench_broadcast.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import ray
import torch

from rlcomm import Cluster, NodePlacementStrategy, Worker

GROUP = "bench_bcast"
PATHS = ["rlcomm broadcast", "rlcomm send to each", "ray put + zero-copy gets"]


def state_dict(mib: int, tensors: int) -> dict[str, torch.Tensor]:
    numel = (mib << 20) // 4 // tensors
    return {f"layers.{i}.weight": torch.full((numel,), float(i)) for i in range(tensors)}


def _hold(sd: dict[str, torch.Tensor], touch: bool) -> float:
    if touch:
        for t in sd.values():
            t.sum()
    return time.time()


class BcastWorker(Worker):
    """Rank 0 is the source; ranks 1..N receive."""

    def __init__(self) -> None:
        super().__init__()
        torch.set_num_threads(1)
        self._sd: dict[str, torch.Tensor] | None = None
        self._held: Any = None

    def make(self, mib: int, tensors: int) -> bool:
        self._sd = state_dict(mib, tensors)
        return True

    def _sync(self, receivers: int) -> None:
        """A barrier: every receiver is inside the call before the source starts."""
        if self._rank == 0:
            for r in range(1, receivers + 1):
                self.recv(GROUP, r)
        else:
            self.send(0, GROUP, 0)

    def broadcast_round(self, receivers: int, touch: bool) -> float:
        members = [(GROUP, list(range(receivers + 1)))]
        self._sync(receivers)
        if self._rank == 0:
            start = time.time()
            self.broadcast(self._sd, groups=members)
            return start
        self._held = None  # the previous round's weights go as the new ones come
        self._held = self.broadcast(None, groups=members)
        return _hold(self._held, touch)

    def send_round(self, receivers: int, touch: bool) -> float:
        self._sync(receivers)
        if self._rank == 0:
            start = time.time()
            works = [self.send(self._sd, GROUP, r, async_op=True) for r in range(1, receivers + 1)]
            for work in works:
                work.wait()
            return start
        self._held = None
        self._held = self.recv(GROUP, 0)
        return _hold(self._held, touch)


@ray.remote(num_cpus=0, runtime_env={"env_vars": {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}})
class RayPeer:
    """A plain Ray actor: the source puts, the receivers get."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self._sd: dict[str, torch.Tensor] | None = None
        self._held: Any = None

    def make(self, mib: int, tensors: int) -> bool:
        self._sd = state_dict(mib, tensors)
        return True

    def take(self, refs: list, touch: bool) -> float:
        self._held = None
        self._held = ray.get(refs[0])
        return _hold(self._held, touch)

    def round(self, receivers: list, touch: bool) -> float:
        ray.get([r.take.remote([ray.put(0)], False) for r in receivers])  # all idle first
        start = time.time()
        ref = ray.put(self._sd)
        ends = ray.get([r.take.remote([ref], touch) for r in receivers])
        return max(ends) - start


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.records: list[dict[str, Any]] = []
        self.cluster = Cluster(num_nodes=1, ray_init_kwargs={
            "include_dashboard": False, "logging_level": "ERROR"})
        most = max(args.receivers)
        self.workers = BcastWorker.create_group().launch(
            self.cluster, NodePlacementStrategy([0] * (most + 1)), name=GROUP
        )
        self.workers.execute_on(0).make(args.mib, args.tensors).wait(timeout=300)
        self.ray_peers = [RayPeer.remote() for _ in range(most + 1)]
        ray.get(self.ray_peers[0].make.remote(args.mib, args.tensors), timeout=300)

    def _rlcomm(self, method: str, receivers: int) -> float:
        ranks = list(range(receivers + 1))
        times = getattr(self.workers.execute_on(*ranks), method)(
            receivers, self.args.touch
        ).wait(timeout=600)
        return max(times[1:]) - times[0]

    def _ray(self, receivers: int) -> float:
        src, rest = self.ray_peers[0], self.ray_peers[1 : receivers + 1]
        return ray.get(src.round.remote(rest, self.args.touch), timeout=600)

    def measure(self, path: str, receivers: int) -> None:
        def once() -> float:
            if path == "rlcomm broadcast":
                return self._rlcomm("broadcast_round", receivers)
            if path == "rlcomm send to each":
                return self._rlcomm("send_round", receivers)
            return self._ray(receivers)

        first = once()  # the first round: connections, pools, fresh memory faulting in
        samples = [once() for _ in range(self.args.repeats)]
        self.records.append({
            "path": path, "receivers": receivers, "bytes": self.args.mib << 20,
            "tensors": self.args.tensors, "touch": self.args.touch, "first": first,
            "median": statistics.median(samples), "min": min(samples), "max": max(samples),
        })
        print(f"{path:28s} 1 -> {receivers}: {statistics.median(samples) * 1e3:8.1f} ms "
              f"(min {min(samples) * 1e3:.1f}, max {max(samples) * 1e3:.1f}; first round "
              f"{first * 1e3:.1f})", flush=True)

    def run(self) -> None:
        for receivers in self.args.receivers:
            for path in PATHS:
                self.measure(path, receivers)

    def get(self, path: str, receivers: int, metric: str = "median") -> float | None:
        for r in self.records:
            if r["path"] == path and r["receivers"] == receivers:
                return r.get(metric)
        return None

    def table(self) -> str:
        recv = sorted({r["receivers"] for r in self.records})
        size = self.records[0]["bytes"] >> 20 if self.records else self.args.mib
        head = f"| ms, median (first round), {size} MiB | " + " | ".join(
            f"1 → {n}" for n in recv) + " |"
        lines = [head, "| --- |" + " --- |" * len(recv)]
        for path in PATHS:
            cells = [self.get(path, n) for n in recv]
            firsts = [self.get(path, n, "first") for n in recv]
            lines.append(f"| {path} | " + " | ".join(
                "-" if c is None else f"{c * 1e3:.1f}" + ("" if f is None else f" ({f * 1e3:.0f})")
                for c, f in zip(cells, firsts)) + " |")
        lines += ["", "| rlcomm broadcast is faster than | " + " | ".join(
            f"1 → {n}" for n in recv) + " |", "| --- |" + " --- |" * len(recv)]
        for base in PATHS[1:]:
            cells = []
            for n in recv:
                ours, theirs = self.get(PATHS[0], n), self.get(base, n)
                cells.append("-" if not ours or theirs is None else f"{theirs / ours:.1f}x")
            lines.append(f"| {base} | " + " | ".join(cells) + " |")
        return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="state dict size in MiB")
    parser.add_argument("--tensors", type=int, default=16, help="tensors in the state dict")
    parser.add_argument("--receivers", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 4, 8], help="comma-separated receiver counts")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per case")
    parser.add_argument("--touch", action="store_true", help="receivers read every byte")
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--from-json", help="print the tables of an earlier run")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    args = parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        bench = Bench.__new__(Bench)
        bench.args, bench.records = args, saved["records"]
        print(bench.table())
        return
    bench = Bench(args)
    bench.run()
    print(bench.table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "records": bench.records}, f, indent=1)
    bench.workers.shutdown()


if __name__ == "__main__":
    main()
