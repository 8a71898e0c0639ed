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

Two more cases, on one GPU (``--case sync``, ``--case message``; ``--case all`` runs
every case the machine allows):

- *weight sync* (``--sync-bytes``, 1 GiB of 64 bf16 tensors by default): a trainer and
  N = 1 and 4 receivers, each worker its own process on GPU 0, until every receiver
  holds the values in its own parameters (its ``torch.cuda.synchronize()`` returned):
  rlcomm ``broadcast`` into the parameters, ``send`` to each + ``recv`` into them,
  ``send`` + ``recv`` into fresh tensors (not loaded), ``send_tensor`` per tensor, the
  pushed sync (``Worker.weight_pusher``: the trainer writes each receiver's registered
  parameters itself; each receiver's ``update()``, set up before the first round); the
  baseline verl and SGLang use, ``reduce_tensor`` CUDA IPC handles passed to each
  receiver in a Ray call, rebuilt there and loaded; and the bound, N device copies of
  the state dict inside one process. Milliseconds, median of ``--repeats`` rounds after
  two warm-up rounds, one set of workers per N (``--receivers``; ``--sync-paths`` picks
  rlcomm's paths). Each path's record holds the peak GPU memory of tensors that the
  trainer and (the most of) a receiver held beyond their parameters while it ran.
  ``--soak K``: then K broadcasts more to the last N, and the GPU memory they leave
  behind in any worker (allocated, reserved, the device's used). ``--device cpu`` runs
  this case on CPU tensors, without the handles path and the memory figures, to try
  its code without a GPU.
- *per message* (``--message-sizes``, 4 B and 1 MiB by default): rlcomm ``send/recv``
  streamed (messages back to back, the receiver synchronizing at the end) and as a
  ping-pong (each side's copy done before it answers: the latency of one hand-off),
  beside the hand-off floor measured the same two ways (two processes, buffer and
  events opened once, a flag in shared host memory, no store); without NVIDIA MPS and, when ``nvidia-cuda-mps-control`` is
  on the machine, under MPS (the script starts the daemon and stops it after).

    python scripts/bench_gpu.py --json bench_gpu.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import statistics
import subprocess
import time
from typing import Any

import _gpu_workers
import ray
import torch
import torch.distributed as dist
from _gpu_workers import MessageWorker, SyncWorker
from bench_p2p import human_size

from rlcomm import Cluster, PackedPlacementStrategy, Worker

# The worker processes cannot import scripts/ by name: ship the module by value.
ray.cloudpickle.register_pickle_by_value(_gpu_workers)

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


# -- the weight-sync and per-message cases ---------------------------------------------------

SYNC_PATHS = ["broadcast", "send", "send_fresh", "send_tensor", "push"]
#: Paths that only CUDA tensors take.
CUDA_ONLY = {"push"}


def _one_gpu_groups(cls: type, names: list[str], *args: Any) -> list[Any]:
    groups = []
    try:
        for name in names:
            groups.append(cls.create_group(*args).launch(
                Cluster(num_nodes=1), PackedPlacementStrategy(0, 0), name=name))
    except BaseException:
        for g in groups:
            g.shutdown()
        raise
    return groups


def sync_case(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The weight-sync table's records: ms per sync, by path and receivers, with the
    peak extra GPU memory of the trainer and of the receivers; then, with ``--soak``,
    the GPU memory that ``--soak`` more broadcasts to the last N leave behind."""
    records = []
    rounds = 2 + args.repeats
    for n in args.receivers:
        names = ["sync_trainer", *[f"sync_rollout{i}" for i in range(n)]]
        groups = _one_gpu_groups(SyncWorker, names, args.sync_bytes, args.sync_tensors,
                                 args.device)
        trainer, receivers = groups[0], groups[1:]
        addresses = [(name, 0) for name in names[1:]]
        members = [(name, 0) for name in names]
        try:
            for path in args.sync_paths:
                if path in CUDA_ONLY and args.device != "cuda":
                    continue
                ends = [g.receiver_rounds(path, ("sync_trainer", 0), rounds, members)
                        for g in receivers]
                starts, trainer_peak = trainer.trainer_rounds(
                    path, addresses, rounds, members).wait(timeout=1800)[0]
                got = [e.wait(timeout=1800)[0] for e in ends]
                if not all(ok for _, ok, _ in got):
                    raise RuntimeError(f"weight sync by {path}: a receiver holds wrong values")
                took = [max(e[k] for e, _, _ in got) - starts[k] for k in range(rounds)]
                peaks = [peak for _, _, peak in got]
                records.append(_sync_record(
                    path, n, args.sync_bytes, took[2:], trainer_peak,
                    None if None in peaks else max(peaks)))
            if args.device == "cuda":  # CUDA IPC handles: there is no CPU form of them
                actors = [g.workers[0] for g in receivers]
                took = trainer.handle_rounds(actors, rounds).wait(timeout=1800)[0]
                records.append(_sync_record("handles through Ray", n, args.sync_bytes,
                                            took[2:]))
            took = trainer.bound_rounds(n, rounds).wait(timeout=1800)[0]
            records.append(_sync_record("bound", n, args.sync_bytes, took[2:]))
            if args.soak and n == args.receivers[-1]:
                records.append(_soak(args.soak, groups, addresses, members))
        finally:
            for g in groups:
                g.shutdown()
    return records


def _soak(rounds: int, groups: list[Any], addresses: list, members: list) -> dict[str, Any]:
    """``rounds`` broadcasts more, after the timed ones: the GPU memory each worker holds
    after them beyond what it held before, the most of any worker."""
    trainer, receivers = groups[0], groups[1:]
    before = [g.memory().wait(timeout=60)[0] for g in groups]
    ends = [g.receiver_rounds("broadcast", ("sync_trainer", 0), rounds, members)
            for g in receivers]
    trainer.trainer_rounds("broadcast", addresses, rounds, members).wait(timeout=1800)
    if not all(ok for _, ok, _ in (e.wait(timeout=1800)[0] for e in ends)):
        raise RuntimeError("weight sync soak: a receiver holds wrong values")
    after = [g.memory().wait(timeout=60)[0] for g in groups]

    def growth(key: str) -> float | None:
        if before[0][key] is None:
            return None
        return max(a[key] - b[key] for a, b in zip(after, before)) / (1 << 20)

    record = {"case": "soak", "path": "broadcast", "receivers": len(receivers),
              "rounds": rounds, "allocated_growth_mib": growth("allocated"),
              "reserved_growth_mib": growth("reserved"),
              "device_used_growth_mib": growth("device_used")}
    print(f"  soak: {rounds} broadcasts to {len(receivers)}: growth "
          f"allocated {record['allocated_growth_mib']} MiB, reserved "
          f"{record['reserved_growth_mib']} MiB, device {record['device_used_growth_mib']} MiB",
          flush=True)
    return record


def _mib(nbytes: int | None) -> float | None:
    return None if nbytes is None else nbytes / (1 << 20)


def _sync_record(path: str, n: int, nbytes: int, seconds: list[float],
                 trainer_peak: int | None = None,
                 receiver_peak: int | None = None) -> dict[str, Any]:
    ms = [s * 1e3 for s in seconds]
    record = {"case": "sync", "path": path, "receivers": n, "bytes": nbytes,
              "ms": statistics.median(ms), "min": min(ms), "max": max(ms),
              "trainer_peak_extra_mib": _mib(trainer_peak),
              "receiver_peak_extra_mib": _mib(receiver_peak)}
    memory = "" if receiver_peak is None else (
        f"; peak extra MiB: trainer {_mib(trainer_peak):.1f}, "
        f"a receiver {_mib(receiver_peak):.1f}")
    print(f"  sync {path:22s} {human_size(nbytes)} N={n}: {record['ms']:9.2f} ms "
          f"({record['min']:.2f}-{record['max']:.2f}){memory}", flush=True)
    return record


def _mps(start: bool) -> bool:
    """Start (or stop) the NVIDIA MPS control daemon; False when it is not on the machine."""
    binary = shutil.which("nvidia-cuda-mps-control")
    if binary is None:
        return False
    if start:
        subprocess.run([binary, "-d"], check=True, timeout=30)
    else:
        subprocess.run([binary], input=b"quit\n", check=False, timeout=30)
    return True


def message_case(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The per-message table's records, without MPS and (when there) under it."""
    records = []
    modes = [False] + ([True] if shutil.which("nvidia-cuda-mps-control") else [])
    for mps in modes:
        if mps:
            _mps(True)
        try:
            a, b = _one_gpu_groups(MessageWorker, ["msg_0", "msg_1"])
            try:
                info = [g.gpu_info().wait(timeout=60)[0] for g in (a, b)]
                for nbytes in args.message_sizes:
                    iters = 2000 if nbytes <= 4096 else 500
                    records += _message_records(a, b, nbytes, iters, mps, info, args.repeats)
            finally:
                a.shutdown()
                b.shutdown()
        finally:
            if mps:
                _mps(False)
    return records


def _message_records(a: Any, b: Any, nbytes: int, iters: int, mps: bool, info: list,
                     repeats: int) -> list[dict[str, Any]]:
    out = []

    def timed(name: str, run: Any) -> None:
        run(max(10, iters // 10))  # warm-up
        per = [run(iters) for _ in range(repeats)]
        us = statistics.median(per) * 1e6
        out.append({"case": "message", "path": name, "bytes": nbytes, "mps": mps,
                    "us": us, "min": min(per) * 1e6, "max": max(per) * 1e6,
                    "GB/s": nbytes / (us * 1e-6) / 1e9, "workers": info})
        print(f"  message {name:22s} {human_size(nbytes):>8s} mps={mps!s:5s}: {us:9.1f} µs",
              flush=True)

    def rlcomm(method: str) -> Any:
        def run(n: int) -> float:
            other = getattr(b, method)(("msg_0", 0), False, nbytes, n)
            took = getattr(a, method)(("msg_1", 0), True, nbytes, n).wait(timeout=600)[0]
            other.wait(timeout=600)
            return took
        return run

    timed("rlcomm streamed", rlcomm("stream"))
    timed("rlcomm ping-pong", rlcomm("latency"))
    opened = a.floor_open(nbytes).wait(timeout=60)[0]
    events = b.floor_attach(opened, nbytes).wait(timeout=60)[0]
    a.floor_peer_events(events).wait(timeout=60)
    try:
        runs = itertools.count(1)
        for name, serial in (("floor streamed", False), ("floor ping-pong", True)):
            def floor(n: int, serial: bool = serial) -> float:
                run = next(runs)  # both sides start on this id, the counts reset
                other = b.floor_run(False, nbytes, n, serial, run)
                took = a.floor_run(True, nbytes, n, serial, run).wait(timeout=600)[0]
                other.wait(timeout=600)
                return took
            timed(name, floor)
    finally:
        b.floor_close().wait(timeout=60)
        a.floor_close().wait(timeout=60)
    return out


def case_tables(records: list[dict[str, Any]]) -> str:
    lines = []
    sync = [r for r in records if r["case"] == "sync"]
    if sync:
        ns = sorted({r["receivers"] for r in sync})
        by = {(r["path"], r["receivers"]): r for r in sync}
        lines.append("weight sync, ms (median; min-max)" + "".join(f"{'N=' + str(n):>22s}" for n in ns))

        def cell(r: dict[str, Any] | None) -> str:
            return "-" if r is None else f"{r['ms']:9.2f} ({r['min']:.1f}-{r['max']:.1f})"

        def ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> str:
            return "-" if a is None or b is None else f"{a['ms'] / b['ms']:.2f}x"

        for path in dict.fromkeys(r["path"] for r in sync):
            lines.append(f"{path:34s}" + "".join(cell(by.get((path, n))).rjust(22) for n in ns))
        for path in ("broadcast", "send", "push"):
            lines.append(f"{path + ' over the bound':34s}" + "".join(
                ratio(by.get((path, n)), by.get(("bound", n))).rjust(22) for n in ns))
            lines.append(f"{'handles over ' + path:34s}" + "".join(
                ratio(by.get(("handles through Ray", n)), by.get((path, n))).rjust(22)
                for n in ns))
    msgs = [r for r in records if r["case"] == "message"]
    if msgs:
        lines.append("per message, µs (median)")
        for mps in sorted({r["mps"] for r in msgs}):
            for nbytes in sorted({r["bytes"] for r in msgs}):
                row = {r["path"]: r["us"] for r in msgs if r["mps"] == mps and r["bytes"] == nbytes}
                lines.append(f"  mps={mps!s:5s} {human_size(nbytes):>8s}: " + ", ".join(
                    f"{k} {v:.1f}" for k, v in row.items()))
                for how in ("streamed", "ping-pong"):
                    lines.append(f"      rlcomm {how} over the floor: "
                                 f"{row[f'rlcomm {how}'] / row[f'floor {how}']:.2f}x")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, choices=(1, 2), default=None,
                        help="1: both workers on one GPU (CUDA IPC); 2: one GPU each (NCCL)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=SIZES)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--case", choices=("p2p", "sync", "message", "all"), default="all",
                        help="bandwidth between two workers, the weight sync on one GPU, "
                             "the per-message case, or every one the machine allows")
    parser.add_argument("--sync-bytes", type=int, default=1 << 30)
    parser.add_argument("--sync-tensors", type=int, default=64)
    parser.add_argument("--receivers", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 4])
    parser.add_argument("--sync-paths", type=lambda s: s.split(","), default=SYNC_PATHS,
                        help=f"the weight sync's rlcomm paths (of {','.join(SYNC_PATHS)})")
    parser.add_argument("--message-sizes", type=lambda s: [int(x) for x in s.split(",")],
                        default=[4, 1 << 20], help="the per-message case's sizes, bytes")
    parser.add_argument("--soak", type=int, default=0,
                        help="after the sync case, this many broadcasts more to the last "
                             "N, and the GPU memory they leave behind")
    parser.add_argument("--json", help="write the records here")
    args = parser.parse_args()
    unknown = set(args.sync_paths) - set(SYNC_PATHS)
    if unknown:
        parser.error(f"--sync-paths: no such path {sorted(unknown)} (of {SYNC_PATHS})")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here; --device cpu tries the script on CPU tensors")
    if args.gpus is None:
        args.gpus = 2 if args.device == "cuda" and torch.cuda.device_count() >= 2 else 1
    one_gpu = args.device == "cuda"
    result: dict[str, Any] = {"gpus": args.gpus, "device": args.device, "records": []}
    if args.case in ("p2p", "all"):
        bench = Bench(args)
        bench.run()
        print(bench.table())
        result.update(transport=bench.transport, records=bench.records)
    # The sync case runs on CPU tensors too (to try its code); the message case's floor
    # is CUDA's alone.
    sync = args.case == "sync" or (args.case == "all" and one_gpu)
    message = args.case in ("message", "all") and one_gpu
    if args.case == "message" and not one_gpu:
        parser.error("--case message needs a CUDA device")
    if sync or message:
        if not ray.is_initialized():
            Cluster(num_nodes=1, ray_init_kwargs={"include_dashboard": False,
                                                  "logging_level": "ERROR"})
        extra = []
        if sync:
            extra += sync_case(args)
        if message:
            extra += message_case(args)
        print(case_tables(extra))
        result["records"] = result["records"] + extra
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
