"""One member of a broadcast chain in a process of its own, for
``tests/comm/test_broadcast_chain.py``: a relay that a test kills or stops.

Usage: ``python -m tests.comm.chain_member '<json>'``. The JSON gives the member's place
(``index``, ``src``, ``upstream``, ``downstream``, ``members``), the run (``run_id``,
``key`` in hex, ``sizes``, ``chunk``), the listening socket's inherited file descriptor
(``fd``), the downstream listener's address, and ``stop_after``: once it holds that
many records and passed one on (``linked``, the default; else before it linked to
its downstream neighbour), the process stops itself (SIGSTOP), so a test finds it
stopped in the middle of the stream (``os.waitpid(pid, os.WUNTRACED)``), and may kill it there. Once
its imports are done it prints ``READY`` and reads the run's deadline (``time.monotonic``
seconds, one clock for all processes of the machine) from stdin. It prints
``OUTCOME <repr>`` when its run ends.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time

import torch

from rlcomm.comm.broadcast.chain import ChainListener, ChainRun, plan_records
from tests.waiting import wait_for


def main() -> None:
    spec = json.loads(sys.argv[1])
    # The stopping thread must get the GIL soon after the record it waits for: at the
    # default switch interval (5 ms) the relay's thread can pass the whole stream on
    # before it runs, and the member is never stopped midway.
    sys.setswitchinterval(1e-4)
    listener = ChainListener.__new__(ChainListener)
    listener.sock = socket.socket(fileno=spec["fd"])
    listener.sock.setblocking(False)
    listener.address = "inherited"
    buffers = [torch.empty(n, dtype=torch.uint8) for n in spec["sizes"]]
    print("READY", flush=True)
    deadline = float(sys.stdin.readline())
    probe = spec.get("up_address")
    run = ChainRun(
        index=spec["index"], src=spec["src"], upstream=spec["upstream"],
        downstream=spec["downstream"], members=spec["members"], run_id=spec["run_id"],
        key=bytes.fromhex(spec["key"]), records=plan_records(spec["sizes"], spec["chunk"]),
        views=[memoryview(b.numpy()) for b in buffers], listener=listener,
        downstream_address=lambda: spec["down_address"], host="127.0.0.1",
        upstream_address=(lambda: probe) if probe else None,
        deadline=deadline, slack=0.3, heartbeat=0.1,
    )

    def stop_midway() -> None:
        forwarded = 1 if spec.get("linked", True) else 0
        # By the run's deadline at the latest (past it the test has failed: this raises).
        wait_for(lambda: run.received >= spec["stop_after"] and run.forwarded >= forwarded,
                 "the member midway", max(0.0, deadline - time.monotonic()), interval=0.0005)
        os.kill(os.getpid(), signal.SIGSTOP)

    threading.Thread(target=stop_midway, daemon=True).start()
    outcome = run.run()
    print(f"OUTCOME {outcome!r}", flush=True)


if __name__ == "__main__":
    main()
