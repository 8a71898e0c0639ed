"""The host side of ``bench_gpu.py``'s hand-off floor: counters in shared memory that two
processes spin on, apart from the GPU work so that the CPU tests can check them.

Three 8-byte counters: the run, the messages sent and the messages taken in that run.
Each run has an id the driver picks anew. The sender resets the counts, then publishes
the run's id; the receiver starts only once it reads that id, so it never goes by counts
left over from the run before (which a receiver started first would otherwise see). At
the end the receiver sets *taken* past the last message, once its copies are done, and
the sender waits for that before its run ends. Every spin has a deadline.

x86-64 orders these aligned 8-byte stores as written, which is what the counters need
(the same assumption as rlcomm's shared-memory ring).
"""

from __future__ import annotations

import time

import numpy as np

#: Bytes the counters take in their shared memory.
NBYTES = 24
_RUN, _SENT, _TAKEN = 0, 1, 2


class HandOffStalled(RuntimeError):
    """The other side did not move within the deadline."""


class HandOff:
    """One side's view of the counters in ``buf`` (at least :data:`NBYTES` bytes).

    Args:
        buf: the shared memory (``SharedMemory.buf``, or any writable buffer).
        timeout: seconds any one wait may take.
    """

    def __init__(self, buf, timeout: float = 60.0):
        self._v = np.ndarray((3,), dtype=np.int64, buffer=buf)
        self._timeout = timeout

    def _spin(self, ready, what: str) -> None:
        if ready():
            return
        deadline = time.monotonic() + self._timeout
        while not ready():
            if time.monotonic() > deadline:
                raise HandOffStalled(f"hand-off: {what} did not happen within {self._timeout:g}s "
                                     f"(run {self._v[_RUN]}, sent {self._v[_SENT]}, "
                                     f"taken {self._v[_TAKEN]})")

    # -- the sender -------------------------------------------------------------------------

    def start_sending(self, run: int) -> None:
        """Begin run ``run`` (a new id each run): counts first, then the id."""
        self._v[_SENT] = 0
        self._v[_TAKEN] = 0
        self._v[_RUN] = run

    def wait_room(self, i: int, depth: int) -> None:
        """Before message ``i``: at most ``depth`` messages may wait to be taken."""
        self._spin(lambda: i - self._v[_TAKEN] < depth, f"room for message {i}")

    def sent(self, i: int) -> None:
        """Message ``i`` is out (its ready event recorded)."""
        self._v[_SENT] = i + 1

    def wait_finished(self, iters: int) -> None:
        """The receiver has taken all ``iters`` messages, its copies done."""
        self._spin(lambda: self._v[_TAKEN] > iters, "the receiver's end of the run")

    # -- the receiver -------------------------------------------------------------------------

    def start_receiving(self, run: int) -> None:
        """Wait until the sender has begun run ``run``."""
        self._spin(lambda: self._v[_RUN] == run, f"the start of run {run}")

    def wait_sent(self, i: int) -> None:
        self._spin(lambda: self._v[_SENT] > i, f"message {i}")

    def taken(self, i: int) -> None:
        self._v[_TAKEN] = i + 1

    def finish(self, iters: int) -> None:
        """All ``iters`` messages taken and copied: the sender's run may end."""
        self._v[_TAKEN] = iters + 1
