"""Run by ``test_weight_sync``'s /dev/shm test inside a mount namespace whose /dev/shm is
64 MB: a fan-out source streams four 64 MiB buckets to a receiver in a forked process,
through two slots, as a broadcast does; the receiver checks every byte. Prints
``dev_shm=<bytes> streamed=<bytes> ok`` and exits 0 when it all went through."""

from __future__ import annotations

import os
import sys
import time

import torch

from rlcomm.comm.transports.shm_fanout import FanoutSource
from rlcomm.comm.transports.shm_fanout_sink import FanoutSink
from rlcomm.comm.transports.shm_memory import check_memory, dev_shm_bytes

BUCKET = 64 << 20
BUCKETS = 4
torch.set_num_threads(1)  # no thread pool to inherit across the fork


_BASE = torch.arange(251, dtype=torch.uint8).repeat(BUCKET // 251 + 1)[:BUCKET]


def bucket(k: int) -> torch.Tensor:
    """Bucket ``k``'s bytes: a pattern of prime period, shifted by ``k``."""
    return _BASE + k


def main() -> int:
    check_memory()  # a small /dev/shm is no reason to refuse
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # the receiver: it learns the source's socket name through the pipe
        try:
            os.close(write_end)
            name = os.read(read_end, 4096).decode()
            sink = FanoutSink(name, 1, os.getppid(), time.monotonic() + 30, "sink")
            for k in range(BUCKETS):
                msg = sink.recv(time.monotonic() + 60, stream=True)
                (view,) = msg.payload([BUCKET])
                if not torch.equal(view, bucket(k)):
                    os._exit(2)
                del view, msg
            os._exit(0)
        except BaseException:  # noqa: BLE001 - the parent sees the exit status
            os._exit(3)
    os.close(read_end)
    source = FanoutSource({1: child}, "dev/shm test")
    os.write(write_end, source.name.encode())
    source.accept(time.monotonic() + 30)
    for k in range(BUCKETS):
        failures = source.publish(k, b"", [bucket(k)], time.monotonic() + 60, bucket=BUCKET)
        if failures:
            print("failures", failures)
            return 1
    _, status = os.waitpid(child, 0)
    if status:
        print("receiver exit status", status)
        return 1
    print(f"dev_shm={dev_shm_bytes()} streamed={BUCKETS * BUCKET} ok slots={len(source.slots)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
