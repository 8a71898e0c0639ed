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

``--sweep`` measures instead a weight sync at the sizes of real models: state dicts of
``--sizes`` MiB (one tensor of a quarter of the dict, the rest in ``--sweep-tensors``
tensors) from one worker to two others, each taking it into its own preallocated dict
(``into=``), by ``broadcast`` and by ``send`` to each, with the shared-memory pool at each
of ``--pools`` (MiB, ``default``, or ``2x``: twice the largest dict): the GB/s delivered
(the dict's bytes over the time until the last receiver holds it), the peak of the
node's shared memory beyond what it held before the workers started (each pool and way
has workers of its own, so this is that way's, all its connections' and slots'
together), and each receiver's peak resident memory beyond its dict. Every received value is checked after the run. Then the sharded
case: a dict of 2-D weights to ``--tp`` receivers, each taking its tensor-parallel shard
of every weight (``shards=``), against the same broadcast taken whole; with the bytes
each receiver read out of shared memory.

    python scripts/bench_broadcast.py --sweep --json docs/bench_weight_sync.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import threading
import time
from typing import Any

import ray
import torch
from make_tables import weight_sync_tables  # noqa: E402 - the docs' tables, one renderer

from rlcomm import Cluster, NodePlacementStrategy, Worker, get_settings

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


# -- the sweep: weight syncs at the sizes of real models ----------------------------------------

SWEEP_GROUP = "bench_sync"
SWEEP_WAYS = ["broadcast (into=)", "send to each (into=)"]
SHARD_WAYS = ["broadcast, whole (into=)", "broadcast, TP shards (into=)"]


def sync_layout(mib: int, tensors: int) -> list[tuple[str, int]]:
    """(name, float32 elements) of a sync's tensors: one of a quarter of the dict, the
    rest alike."""
    big = (mib << 20) // 16
    rest = ((mib << 20) // 4 - big) // max(1, tensors - 1)
    return [("embed.weight", big)] + [(f"layers.{i}.weight", rest) for i in range(tensors - 1)]


def _pattern(n: int, i: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32).remainder_(4093).add_(i)


def tp_layout(mib: int) -> list[tuple[str, tuple[int, int]]]:
    """2-D weights of ``mib`` MiB (float32), half column-parallel, half row-parallel."""
    rows, cols = 4096, 1024
    count = max(2, (mib << 20) // (rows * cols * 4))
    return [(f"layers.{i}.{'qkv' if i % 2 == 0 else 'o'}.weight", (rows, cols))
            for i in range(count)]


def tp_shard(rank: int, tp: int) -> Any:
    from rlcomm import Shard

    return lambda name, shape: Shard(0 if ".qkv." in name else 1, rank, tp)


def _vm(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


def _shut_down(group: Any, timeout: float = 60.0) -> None:
    """Shut ``group`` down and wait until its processes have ended (their shared memory
    is given back then)."""
    pids = ray.get([w.__ray_call__.remote(lambda self: os.getpid()) for w in group.workers],
                   timeout=timeout)
    group.shutdown()
    end = time.monotonic() + timeout
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < end:
        time.sleep(0.05)


def _shmem() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    return 0


class SyncWorker(Worker):
    """Rank 0 is the trainer; the others take its weights into their own dicts."""

    def __init__(self) -> None:
        super().__init__()
        torch.set_num_threads(1)
        self._sd: dict[str, torch.Tensor] = {}
        self._layout: Any = None

    def make(self, mib: int, tensors: int) -> int:
        self._sd = {}
        self._layout = sync_layout(mib, tensors)
        if self._rank == 0:
            self._sd = {n: _pattern(k, i) for i, (n, k) in enumerate(self._layout)}
        else:
            self._sd = {n: torch.zeros(k) for n, k in self._layout}
        return sum(t.numel() * 4 for t in self._sd.values())

    def make_tp(self, mib: int, tp: int, sharded: bool) -> int:
        self._sd = {}
        self._layout = tp_layout(mib)
        if self._rank == 0:
            self._sd = {n: _pattern(r * c, i).view(r, c)
                        for i, (n, (r, c)) in enumerate(self._layout)}
        elif sharded:
            shard = tp_shard(self._rank - 1, tp)
            self._sd = {n: torch.zeros(shard(n, s).shape_of(s, n)) for n, s in self._layout}
        else:
            self._sd = {n: torch.zeros(s) for n, s in self._layout}
        return sum(t.numel() * 4 for t in self._sd.values())

    def _barrier(self, n: int) -> None:
        if self._rank == 0:
            for r in range(1, n):
                self.recv(SWEEP_GROUP, r)
        else:
            self.send(0, SWEEP_GROUP, 0)

    def round(self, way: str, n: int, tp: int = 0) -> tuple[float, int, int]:
        """One sync to ranks 1..n-1: the wall clock at its start (source) or end, the
        peak resident memory this round added, and the bytes read out of shared memory."""
        members = [(SWEEP_GROUP, list(range(n)))]
        self._barrier(n)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak (VmHWM) starts again from now
        base = _vm("VmRSS")
        read = self._read_so_far(members)
        if self._rank == 0:
            start = time.time()
            if way.startswith("send"):
                works = [self.send(self._sd, SWEEP_GROUP, r, async_op=True) for r in range(1, n)]
                for w in works:
                    w.wait()
            else:
                self.broadcast(self._sd, groups=members)
            return start, _vm("VmHWM") - base, 0
        if way.startswith("send"):
            self.recv(SWEEP_GROUP, 0, into=self._sd)
        else:
            shards = tp_shard(self._rank - 1, tp) if "shards" in way else None
            self.broadcast(None, groups=members, into=self._sd, shards=shards)
        return time.time(), _vm("VmHWM") - base, self._read_so_far(members) - read

    @staticmethod
    def _read_so_far(members: list) -> int:
        from rlcomm.comm.status import process_status

        names = [f"{g}:{r}" for g, ranks in members for r in ranks]
        for group in process_status()["process"]["broadcasts"]:
            if group["members"] == names:
                return group["bytes_in"]
        return 0

    def check(self, tp: int = 0) -> bool:
        """Whether every received value is what the trainer sent (``tp``: each tensor is
        this rank's shard of it)."""
        for i, (name, shape) in enumerate(self._layout):
            want = _pattern(math.prod(shape) if isinstance(shape, tuple) else shape, i)
            if isinstance(shape, tuple):
                want = want.view(shape)
                if tp:
                    s = tp_shard(self._rank - 1, tp)(name, shape)
                    want = want.chunk(s.parts, s.dim)[s.index]
            if not torch.equal(self._sd[name], want):
                return False
        return True


class SizeSweep:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.records: list[dict[str, Any]] = []
        self.cluster = Cluster(num_nodes=1, ray_init_kwargs={
            "include_dashboard": False, "logging_level": "ERROR"})

    def _pools(self) -> list[tuple[str, int | None]]:
        out = []
        for p in self.args.pools:
            if p == "default":
                out.append(("default", None))
            elif p == "2x":
                out.append(("2x", 2 * max(self.args.sizes) << 20))
            else:
                out.append((f"{int(p)} MiB", int(p) << 20))
        return out

    def _launch(self, label: str, pool: int | None, n: int) -> Any:
        """A group of ``n`` workers with the pool; the node's shared memory before it (its
        rings and pools count from then on)."""
        self.shm_base = _shmem()
        # Every group's workers start with an environment of their own (a runtime_env),
        # the default pool's too: Ray then starts each group's processes alike, and does
        # not start spare workers (two more processes importing torch) behind a group
        # that used its pre-started ones, in the next case's rounds.
        env = {"RLCOMM_LOG_LEVEL": get_settings().log_level}
        if pool is not None:
            env["RLCOMM_SHM_POOL_BYTES"] = str(pool)
        return SyncWorker.create_group().launch(
            self.cluster, NodePlacementStrategy([0] * n), name=SWEEP_GROUP, env_vars=env)

    def _measure(self, group: Any, way: str, n: int, case: dict, tp: int = 0) -> None:
        peak = [0]
        stop = threading.Event()

        def sample() -> None:  # the node's shared memory beyond what it held at the start
            while not stop.is_set():
                peak[0] = max(peak[0], _shmem() - self.shm_base)
                stop.wait(0.005)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()

        def once() -> tuple[float, list[int], list[int]]:
            got = group.execute_on(*range(n)).round(way, n, tp).wait(timeout=1200)
            return (max(t for t, _, _ in got[1:]) - got[0][0], [g for _, g, _ in got[1:]],
                    [b for _, _, b in got[1:]])

        try:
            first, _, _ = once()
            samples, growth, read = [], [0] * (n - 1), [0] * (n - 1)
            for _ in range(self.args.repeats):
                seconds, grew, bytes_read = once()
                samples.append(seconds)
                growth = [max(a, b) for a, b in zip(growth, grew)]
                read = bytes_read
        finally:
            stop.set()
            sampler.join()
        checked = all(group.execute_on(*range(1, n)).check(tp if "shards" in way else 0).wait(
            timeout=600))
        med = statistics.median(samples)
        record = {**case, "way": way, "receivers": n - 1, "first": first, "median": med,
                  "min": min(samples), "max": max(samples), "gbps": case["bytes"] / med / 1e9,
                  "peak_shm": peak[0], "receiver_rss_growth": growth,
                  "receiver_bytes_read": read, "checked": checked}
        self.records.append(record)
        print(f"{case.get('pool', '')!s:>10} {case['bytes'] >> 20:6d} MiB {way:30s}: "
              f"{med:7.3f} s, {record['gbps']:.2f} GB/s (first {first:.3f} s); peak shm "
              f"{peak[0] >> 20} MiB; receivers' RSS +{[g >> 20 for g in growth]} MiB; "
              f"{'checked' if checked else 'WRONG VALUES'}", flush=True)

    def run(self) -> None:
        # Workers of their own for each case: the shared memory a case shows is then its
        # own (connections keep their segments, a source its slots, while they live).
        for label, pool in self._pools():
            for way in SWEEP_WAYS:
                for mib in self.args.sizes:
                    group = self._launch(label, pool, 3)
                    try:
                        size = group.make(mib, self.args.sweep_tensors).wait(timeout=1200)[0]
                        self._measure(group, way, 3, {"sweep": "size", "pool": label,
                                                      "bytes": size})
                    finally:
                        _shut_down(group)
        tp = self.args.tp
        group = self._launch("default", None, tp + 1)
        try:
            for way in SHARD_WAYS:
                size = group.make_tp(self.args.tp_mib, tp, "shards" in way).wait(
                    timeout=1200)[0]
                self._measure(group, way, tp + 1, {"sweep": "tp", "pool": "default",
                                                   "bytes": size, "tp": tp}, tp)
        finally:
            _shut_down(group)

    def table(self) -> str:
        return weight_sync_tables({"records": self.records})


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
    parser.add_argument("--sweep", action="store_true",
                        help="the weight sync at real models' sizes instead (see above)")
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")],
                        default=[256, 1024, 4096], help="--sweep: state dict sizes, MiB")
    parser.add_argument("--sweep-tensors", type=int, default=200,
                        help="--sweep: tensors of each state dict")
    parser.add_argument("--pools", type=lambda s: s.split(","), default=["256", "default", "2x"],
                        help="--sweep: RLCOMM_SHM_POOL_BYTES in MiB, 'default' or '2x'")
    parser.add_argument("--tp", type=int, default=4, help="--sweep: tensor-parallel receivers")
    parser.add_argument("--tp-mib", type=int, default=1024,
                        help="--sweep: MiB of 2-D weights in the sharded case")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    args = parse_args(argv)
    kind = SizeSweep if args.sweep else Bench
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        if saved.get("args", {}).get("sweep"):
            kind = SizeSweep
        bench = kind.__new__(kind)
        bench.args, bench.records = args, saved["records"]
        print(bench.table())
        return
    if args.sweep:
        import platform

        machine = {"cpus": os.cpu_count(), "python": platform.python_version(),
                   "torch": torch.__version__, "ray": ray.__version__,
                   "loadavg_start": list(os.getloadavg())}
        sweep = SizeSweep(args)
        sweep.run()
        machine["loadavg_end"] = list(os.getloadavg())
        print(sweep.table())
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "machine": machine, "records": sweep.records},
                          f, indent=1)
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
