"""The sending part of a connection: messages out, one at a time, in call order.

A blocking send runs on the calling thread when nothing is queued ahead of it;
``async_op=True`` sends (and blocking ones behind them) run on the sender's own thread,
so messages of different caller threads never interleave. A send that fails part-way
fails the connection (the stream is out of step); one that timed out before anything
left keeps it usable.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable

import torch

from rlcomm.comm import framing
from rlcomm.comm.codec import MessageHeader
from rlcomm.comm.transports.base import Transport
from rlcomm.errors import CommError, CommTimeoutError


class Sender:
    """Sends a connection's messages (see the module docstring).

    Args:
        peer: the peer's address, for messages.
        ready: waits (up to its argument, seconds) for the connected transport.
        error: the connection's error, if it failed.
        fail: fails the connection.
        cuda_transport: the transport of CUDA payloads for a device (made on first use).
    """

    def __init__(
        self,
        peer: str,
        ready: Callable[[float], Transport],
        error: Callable[[], CommError | None],
        fail: Callable[[CommError], None],
        cuda_transport: Callable[[torch.device, float], Transport],
    ):
        self.peer = peer
        self.transport: Transport | None = None  # set once the connection is attached
        self._ready = ready
        self._error = error
        self._fail = fail
        self._cuda_transport = cuda_transport
        self._thread = concurrent.futures.ThreadPoolExecutor(1, f"rlcomm-send-{peer}")
        self._lock = threading.Lock()  # held while a message is being sent
        self._state = threading.Lock()  # guards _queued
        self._queued = 0

    def submit(
        self,
        header: MessageHeader,
        tensors: list[torch.Tensor],
        timeout: float,
        before: Callable[[], None] | None = None,
    ) -> concurrent.futures.Future:
        """Queue a message on the sender thread; the future completes when it left.
        ``before`` runs on the sender thread first (a failed check fails the send)."""
        self._check_sendable()
        with self._state:
            self._queued += 1
        return self._thread.submit(self._send_queued, header, tensors, timeout, before)

    def send_inline(self, header: MessageHeader, tensors: list[torch.Tensor], timeout: float) -> None:
        """Send a message from the calling thread, after any queued sends."""
        self._check_sendable()
        with self._state:
            behind_queue = self._queued > 0
            if behind_queue:
                self._queued += 1
            else:  # nothing queued: send here, holding the send lock
                self._lock.acquire()
        if behind_queue:  # keep call order: go through the sender thread too
            self._thread.submit(self._send_queued, header, tensors, timeout, None).result()
            return
        try:
            self._send_now(header, tensors, timeout)
        finally:
            self._lock.release()

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    def _check_sendable(self) -> None:
        error = self._error()
        if error is not None and not isinstance(error, CommTimeoutError):
            raise error

    def _send_queued(
        self,
        header: MessageHeader,
        tensors: list[torch.Tensor],
        timeout: float,
        before: Callable[[], None] | None,
    ) -> None:
        try:
            if before is not None:
                before()
            with self._lock:
                self._send_now(header, tensors, timeout)
        finally:
            with self._state:
                self._queued -= 1

    def _send_now(self, header: MessageHeader, tensors: list[torch.Tensor], timeout: float) -> None:
        transport = self.transport
        if transport is None or self._error() is not None:
            transport = self._ready(timeout)
        frame, payload = framing.pack(header, tensors)
        on_cuda = bool(tensors) and tensors[0].is_cuda
        try:
            if on_cuda:
                transport.send_frame(frame, [], timeout)
                self._cuda_transport(tensors[0].device, timeout).send(payload, timeout)
            else:
                transport.send_frame(frame, payload, timeout)
        except CommTimeoutError as exc:
            if not transport.broken and not on_cuda:
                raise CommTimeoutError(
                    f"send to {self.peer}: the peer did not take the message within "
                    f"{timeout}s (it is not receiving, and holds as much unread data as it "
                    "may); nothing of it was sent and the connection stays usable"
                ) from exc
            error = CommTimeoutError(
                f"send to {self.peer} timed out part-way through a message ({exc}); the "
                "connection is closed and the next op makes a new one"
            )
            self._fail(error)
            raise error from exc
        except CommError as exc:
            self._fail(exc)
            raise
