"""Micro-benchmark of the message codec: the CPU cost of one ``send``/``recv`` of metadata.

The message is a dict of N small CPU tensors (default 16 float32 tensors of 4 elements),
the common "batch of named tensors" case. Per message, in microseconds (median of the
repeats), it times each step and the whole codec round trip

    encode -> header_to_bytes -> header_from_bytes -> decode

with the header serialised by the module's msgspec encoder/decoder, and the same round trip
with the header pickled instead (``pickle.dumps(header)`` of the Struct, and of the header
as plain Python lists/tuples). Moving the tensors' bytes and allocating the receive buffers
are transport work, timed separately for reference. No tensor data is timed.

Usage:
    python scripts/bench_codec.py [--tensors 16] [--numel 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlcomm.comm.codec import (  # noqa: E402
    PICKLE_PROTOCOL,
    decode,
    empty_like_meta,
    encode,
    header_from_bytes,
    header_to_bytes,
)


def _time_us(fn: Callable[[], object], number: int, repeat: int) -> float:
    """Median over ``repeat`` runs of the mean time of one call, in microseconds."""
    fn()
    runs = []
    for _ in range(repeat):
        start = time.perf_counter_ns()
        for _ in range(number):
            fn()
        runs.append((time.perf_counter_ns() - start) / number / 1e3)
    return statistics.median(runs)


def run(num_tensors: int, numel: int, number: int, repeat: int) -> dict:
    message = {f"layer{i}.weight": torch.randn(numel) for i in range(num_tensors)}
    header, tensors = encode(message)
    received = [empty_like_meta(m) for m in header.tensors]
    for buf, t in zip(received, tensors, strict=True):
        buf.copy_(t)
    header_msgspec = header_to_bytes(header)
    header_pickle = pickle.dumps(header, protocol=PICKLE_PROTOCOL)
    plain = msgspec.to_builtins(header)
    header_plain = pickle.dumps(plain, protocol=PICKLE_PROTOCOL)
    assert header_from_bytes(header_msgspec) == pickle.loads(header_pickle) == header

    def round_trip_msgspec() -> object:
        h, _ = encode(message)
        return decode(header_from_bytes(header_to_bytes(h)), received)

    def round_trip_pickle() -> object:
        h, _ = encode(message)
        return decode(pickle.loads(pickle.dumps(h, protocol=PICKLE_PROTOCOL)), received)

    def round_trip_plain_pickle() -> object:
        h, _ = encode(message)
        pickle.loads(pickle.dumps(msgspec.to_builtins(h), protocol=PICKLE_PROTOCOL))
        return decode(h, received)  # rebuilding a Struct from the lists is not counted

    steps: list[tuple[str, Callable[[], object], int | None]] = [
        ("encode", lambda: encode(message), None),
        ("decode", lambda: decode(header, received), None),
        ("msgspec header_to_bytes", lambda: header_to_bytes(header), len(header_msgspec)),
        ("msgspec header_from_bytes", lambda: header_from_bytes(header_msgspec), None),
        ("pickle dumps(header)", lambda: pickle.dumps(header, protocol=PICKLE_PROTOCOL),
         len(header_pickle)),
        ("pickle loads(header)", lambda: pickle.loads(header_pickle), None),
        ("pickle dumps(plain header)", lambda: pickle.dumps(plain, protocol=PICKLE_PROTOCOL),
         len(header_plain)),
        ("pickle loads(plain header)", lambda: pickle.loads(header_plain), None),
        ("ROUND TRIP msgspec header", round_trip_msgspec, len(header_msgspec)),
        ("ROUND TRIP pickled header", round_trip_pickle, len(header_pickle)),
        ("ROUND TRIP pickled plain header", round_trip_plain_pickle, len(header_plain)),
        ("(transport) allocate receive buffers",
         lambda: [empty_like_meta(m) for m in header.tensors], None),
        ("(reference) pickle.dumps+loads of the dict",
         lambda: pickle.loads(pickle.dumps(message, protocol=PICKLE_PROTOCOL)), None),
    ]  # fmt: skip
    rows = [
        {"step": name, "us": round(_time_us(fn, number, repeat), 2), "bytes": size}
        for name, fn, size in steps
    ]
    return {
        "message": f"dict of {num_tensors} float32 tensors of {numel} elements (CPU)",
        "number": number,
        "repeat": repeat,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "msgspec": msgspec.__version__,
        "machine": platform.machine(),
        "loadavg": os.getloadavg(),
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=16, help="tensors in the dict")
    parser.add_argument("--numel", type=int, default=4, help="elements per tensor")
    parser.add_argument("--number", type=int, default=2000, help="calls per timed run")
    parser.add_argument("--repeat", type=int, default=7, help="timed runs (median kept)")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = run(args.tensors, args.numel, args.number, args.repeat)
    print(f"codec micro-benchmark: {result['message']}, median of {args.repeat} x {args.number}")
    print(f"{'step':<44} {'us/msg':>9} {'bytes':>7}")
    for row in result["rows"]:
        size = "" if row["bytes"] is None else row["bytes"]
        print(f"{row['step']:<44} {row['us']:>9.2f} {size:>7}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
