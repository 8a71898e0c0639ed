#!/usr/bin/env python
"""GPU point-to-point bandwidth: rlcomm's CUDA paths beside their baselines, one run.

Two workers move float32 CUDA tensors of each size:

- ``--gpus 1`` (default when the node has one GPU): both workers on one GPU (two worker
  groups on hardware rank 0, as Ray actors with fractional ``num_gpus`` would be), where
  rlcomm takes CUDA IPC. NCCL cannot pair two ranks on one GPU, so the baseline is a
  device-to-device copy inside one process (the bound any transport works against).
- ``--gpus 2``: one worker per GPU, where rlcomm takes NCCL; the baselines are raw
  ``torch.distributed`` NCCL send/recv between the same two workers and the in-process
  copy.

Paths: ``send/recv`` (a fresh receive buffer per message) and ``send_tensor/recv_tensor``
(into the caller's buffer). Bandwidth is bytes / seconds per transfer (GB/s = 1e9 B/s),
the median of ``--repeats`` timed batches, timed inside the workers. ``--device cpu``
runs the same code on CPU tensors (Gloo as the raw baseline), to try the script on a
machine without a GPU.

    python scripts/bench_gpu.py --json bench_gpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from bench_p2p import human_size

from rlcomm import Cluster, PackedPlacementStrategy, Worker

SIZES = [1 << 20, 16 << 20, 256 << 20, 1 << 30]


class GpuBenchWorker(Worker):
    """One end; ``transfer`` returns the seconds of ``iters`` transfers (on the sender)."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self._device = torch.device(device, 0) if device == "cuda" else torch.device(device)
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)  # CUDA_VISIBLE_DEVICES shows its GPU(s) only
        self._bufs: dict[int, torch.Tensor] = {}

    def _buf(self, nbytes: int) -> torch.Tensor:
        if nbytes not in self._bufs:
            self._bufs = {nbytes: torch.ones(nbytes // 4, dtype=torch.float32, device=self._device)}
        return self._bufs[nbytes]

    def _sync(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def init_raw(self) -> bool:
        """The raw baseline's process group (two workers of one group only)."""
        if not dist.is_initialized():
            dist.init_process_group("nccl" if self._device.type == "cuda" else "gloo")
        return True

    def local_copy(self, nbytes: int, iters: int) -> float:
        src = self._buf(nbytes)
        dst = torch.empty_like(src)
        self._sync()
        start = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        self._sync()
        return time.perf_counter() - start

    def transfer(self, path: str, peer: tuple[str, int], send: bool, nbytes: int, iters: int) -> float:
        group, rank = peer
        t = self._buf(nbytes)
        ack = torch.zeros(1, device=self._device)
        self._sync()
        start = time.perf_counter()
        if path == "raw":
            other = 1 - self._rank
            for _ in range(iters):
                (dist.send if send else dist.recv)(t, other)
            (dist.recv if send else dist.send)(ack, other)
        elif send:
            for _ in range(iters):
                if path == "send/recv":
                    self.send(t, group, rank)
                else:
                    self.send_tensor(t, group, rank)
            self.recv(group, rank)
        else:
            for _ in range(iters):
                if path == "send/recv":
                    self.recv(group, rank)
                else:
                    self.recv_tensor(t, group, rank)
            self._sync()
            self.send(ack, group, rank)
        self._sync()
        return time.perf_counter() - start

    def cuda_transport(self, peer: tuple[str, int]) -> str:
        """Which transport rlcomm chose for CUDA payloads with ``peer``."""
        from rlcomm.comm.identity.address import WorkerAddress
        from rlcomm.comm.manager import CommManager

        conn = CommManager.current().connection(WorkerAddress(peer[0], (peer[1],)), None)
        return getattr(conn._cuda, "name", "none")


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.records: list[dict[str, Any]] = []
        self.cluster = Cluster(num_nodes=1, ray_init_kwargs={
            "include_dashboard": False, "logging_level": "ERROR"})
        if args.gpus == 2:
            group = GpuBenchWorker.create_group(args.device).launch(
                self.cluster, PackedPlacementStrategy(0, 1), name="bench_gpu")
            self.ends = [(group, 0), (group, 1)]
            self.addresses = [("bench_gpu", 0), ("bench_gpu", 1)]
            group.init_raw().wait(timeout=300)
            self.raw = True
        else:
            groups = [GpuBenchWorker.create_group(args.device).launch(
                self.cluster, PackedPlacementStrategy(0, 0), name=f"bench_gpu_{i}")
                for i in range(2)]
            self.ends = [(g, 0) for g in groups]
            self.addresses = [(f"bench_gpu_{i}", 0) for i in range(2)]
            self.raw = False

    def _timed(self, path: str, nbytes: int, iters: int) -> list[float]:
        (a, ra), (b, rb) = self.ends

        def once(n: int) -> float:
            recv = b.execute_on(rb).transfer(path, self.addresses[0], False, nbytes, n)
            took = a.execute_on(ra).transfer(path, self.addresses[1], True, nbytes, n)
            recv.wait(timeout=600)
            return took.wait(timeout=600)[0]

        once(max(1, iters // 4))  # warm-up (and the CUDA transport's set-up)
        return [once(iters) / iters for _ in range(self.args.repeats)]

    def run(self) -> None:
        a, ra = self.ends[0]
        paths = ["send/recv", "send_tensor/recv_tensor", *(["raw"] if self.raw else [])]
        for nbytes in self.args.sizes:
            iters = max(2, min(200, (2 << 30) // nbytes))
            for path in paths:
                self._add(path, nbytes, self._timed(path, nbytes, iters))
            copy = [a.execute_on(ra).local_copy(nbytes, iters).wait(timeout=600)[0] / iters
                    for _ in range(self.args.repeats)]
            self._add("local copy", nbytes, copy)
        self.transport = a.execute_on(ra).cuda_transport(self.addresses[1]).wait(timeout=60)[0]

    def _add(self, path: str, nbytes: int, seconds: list[float]) -> None:
        rates = [nbytes / s / 1e9 for s in seconds]
        self.records.append({"path": path, "bytes": nbytes, "GB/s": statistics.median(rates),
                             "min": min(rates), "max": max(rates)})
        print(f"  {path:26s} {human_size(nbytes):>8s}: {statistics.median(rates):8.2f} GB/s",
              flush=True)

    def table(self) -> str:
        sizes = self.args.sizes
        raw_name = ("raw nccl" if self.args.device == "cuda" else "raw gloo")
        names = {"raw": raw_name}
        lines = [f"CUDA payloads over: {self.transport}; GB/s (median)",
                 f"{'path':28s}" + "".join(f"{human_size(s):>12s}" for s in sizes)]
        by = {(r["path"], r["bytes"]): r["GB/s"] for r in self.records}
        for path in dict.fromkeys(r["path"] for r in self.records):
            lines.append(f"{names.get(path, path):28s}" + "".join(
                f"{by.get((path, s), float('nan')):12.3g}" for s in sizes))
        for base in ("raw", "local copy"):
            if any(p == base for p, _ in by):
                lines.append(f"{'send/recv over ' + names.get(base, base):28s}" + "".join(
                    f"{by[('send/recv', s)] / by[(base, s)]:11.2f}x" for s in sizes))
        return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, choices=(1, 2), default=None,
                        help="1: both workers on one GPU (CUDA IPC); 2: one GPU each (NCCL)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=SIZES)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the records here")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here; --device cpu tries the script on CPU tensors")
    if args.gpus is None:
        args.gpus = 2 if args.device == "cuda" and torch.cuda.device_count() >= 2 else 1
    bench = Bench(args)
    bench.run()
    print(bench.table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpus": args.gpus, "device": args.device, "transport": bench.transport,
                       "records": bench.records}, f, indent=1)


if __name__ == "__main__":
    main()
