"""Copies into shared memory, three ways, in one run: ``torch``'s ``copy_``, the C
library's ``memmove``, and rlcomm's copy that writes around the caches (non-temporal
stores, ``rlcomm.comm.transports._stream_copy``), on one thread and split over the
threads ``bulk_copy`` uses.

Cases (GB/s, median of the rounds; the copy alone: nobody reads what it wrote):
- *warm*: the destination is one of a few buffers reused in turn (they stay in the
  caches), as a sender's segments are when its receiver gives them back at once;
- *cold*: the destination is one of enough buffers that it has left the caches when it
  comes round again (a channel producer's segments, a rollout's 16 segments);
- a 1 GiB copy between two buffers.

The copy alone flatters the non-temporal stores at 1 MiB: a receiver that reads the data
at once then reads it from memory, not the cache, so rlcomm uses them only from 8 MiB
(see ``bulk_copy``'s docstring).

    python scripts/bench_copy.py [--json docs/bench_copy.json] [--rounds 5]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import platform
import statistics
import time
from collections.abc import Callable

import torch

from rlcomm.comm.transports import bulk_copy

MIB = 1 << 20

#: (label, bytes per copy, destination buffers in turn, copies per round)
CASES = [
    ("1 MiB, warm (4 buffers)", MIB, 4, 2000),
    ("1 MiB, cold (64 buffers)", MIB, 64, 2000),
    ("16 MiB, cold (16 buffers)", 16 * MIB, 16, 64),
    ("64 MiB, cold (16 buffers)", 64 * MIB, 16, 16),
    ("1 GiB", 1024 * MIB, 1, 2),
]


def _shared(n: int) -> torch.Tensor:
    return torch.frombuffer(mmap.mmap(-1, n), dtype=torch.uint8)


def _ways() -> dict[str, Callable[[torch.Tensor, torch.Tensor], None]]:
    def memmove(dst: torch.Tensor, src: torch.Tensor) -> None:
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel())

    def split_memmove(dst: torch.Tensor, src: torch.Tensor) -> None:  # without the extension
        stream, bulk_copy._stream = bulk_copy._stream, ctypes.memmove
        try:
            bulk_copy.copy(dst, src)
        finally:
            bulk_copy._stream = stream

    def split_torch(dst: torch.Tensor, src: torch.Tensor) -> None:  # rlcomm 0.x before this
        n = src.numel()
        step = -(-n // bulk_copy.THREADS) if n >= bulk_copy.PARALLEL_BYTES else n
        step += -step % 4096
        pool = bulk_copy._helpers()
        futures = [pool.submit(lambda a, b: dst[a:b].copy_(src[a:b]), a, min(n, a + step))
                   for a in range(step, n, step)]
        dst[:step].copy_(src[:step])
        for f in futures:
            f.result()

    ways = {"torch copy_": lambda d, s: d.copy_(s), "memmove": memmove,
            f"torch copy_, {bulk_copy.THREADS} threads (before)": split_torch}
    if bulk_copy.STREAMS:
        ways["stream"] = lambda d, s: bulk_copy._stream(d.data_ptr(), s.data_ptr(), s.numel())
    ways["rlcomm without the extension"] = split_memmove
    # What the shared-memory transport does (below 8 MiB: torch's copy_).
    ways[f"rlcomm bulk_copy, {bulk_copy.THREADS} threads"] = bulk_copy.copy
    return ways


def run(rounds: int) -> list[dict]:
    records = []
    for label, n, buffers, copies in CASES:
        src = torch.ones(n, dtype=torch.uint8)
        dsts = [_shared(n) for _ in range(buffers)]
        for d in dsts:
            d.copy_(src)  # fault the pages in: every case measures warm pages
        row: dict = {"case": label, "bytes": n, "buffers": buffers}
        for way, fn in _ways().items():
            times = []
            for _ in range(rounds):
                t = time.perf_counter()
                for i in range(copies):
                    fn(dsts[i % buffers], src)
                times.append((time.perf_counter() - t) / copies)
            row[way] = statistics.median(times)
        records.append(row)
        print(f"  {label}: done", flush=True)
        del src, dsts
    return records


def table(records: list[dict]) -> str:
    """GB/s per case and way, and rlcomm's copy over the one it replaced."""
    ways = [w for w in records[0] if w not in ("case", "bytes", "buffers")]
    before = next(w for w in ways if w.endswith("(before)"))
    now = next(w for w in ways if w.startswith("rlcomm bulk_copy"))
    lines = ["GB/s per copy (median of the rounds); last column: rlcomm now / before",
             f"{'case':28s}" + "".join(f"{w[:22]:>24s}" for w in ways) + f"{'now/before':>12s}"]
    for row in records:
        cells = "".join(f"{row['bytes'] / row[w] / 1e9:24.1f}" for w in ways)
        lines.append(f"{row['case']:28s}{cells}{row[before] / row[now]:12.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    # As in a Ray actor that asked for one CPU (Ray sets OMP_NUM_THREADS=1): torch's
    # copy_ runs on one thread.
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args(argv)
    print(f"copies into shared memory; extension streams: {bulk_copy.STREAMS}, "
          f"threads: {bulk_copy.THREADS}; median of {args.rounds} rounds", flush=True)
    records = run(args.rounds)
    print(table(records))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": platform.machine(), "streams": bulk_copy.STREAMS,
                       "threads": bulk_copy.THREADS, "rounds": args.rounds,
                       "seconds_per_copy": records}, f, indent=1)


if __name__ == "__main__":
    main()
