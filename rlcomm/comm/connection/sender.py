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
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from rlcomm.comm import codec, framing
from rlcomm.comm.buckets import plan
from rlcomm.comm.codec import MessageHeader
from rlcomm.comm.connection.payload import CudaTransportOf
from rlcomm.comm.transports.base import OneSidedTransport, Transport
from rlcomm.errors import CommError, CommTimeoutError, ProtocolMismatchError


class Failing(Protocol):
    """What a sender reads of its connection's read side: the error, once it failed."""

    error: CommError | None


@dataclass(frozen=True)
class DeviceOrder:
    """Where a CUDA send stands in its caller's work.

    Args:
        after: the caller's CUDA stream, or an event recorded on it at the call: the
            payload is read after the work queued before.
        stream: the stream to order after the receiver's copy of a lent payload (the
            caller's, for a blocking send).
        host: the host waits for that copy instead (an ``async_op=True`` send, whose
            caller may write the tensors from any stream once its work is done).
    """

    after: Any
    stream: Any
    host: bool


class Sender:
    """Sends a connection's messages (see the module docstring).

    Args:
        peer: the peer's address, for messages.
        ready: waits (up to its argument, seconds) for the connected transport.
        reader: has the connection's ``error``, once it failed.
        fail: fails the connection.
        cuda_transport: the transport of CUDA payloads for a device (made on first use).
        on_wait: run now and then while a send waits for the peer to take a CUDA payload
            (the connection takes in the peer's own offers meanwhile).
    """

    def __init__(
        self,
        peer: str,
        ready: Callable[[float], Transport],
        reader: Failing,
        fail: Callable[[CommError], None],
        cuda_transport: CudaTransportOf,
        on_wait: Callable[[], None] | None = None,
    ):
        self.peer = peer
        self.transport: Transport | None = None  # set once the connection is attached
        self._ready = ready
        self._reader = reader
        self._fail = fail
        self._cuda_transport = cuda_transport
        self._on_wait = on_wait
        self._thread = concurrent.futures.ThreadPoolExecutor(1, f"rlcomm-send-{peer}")
        self._lock = threading.Lock()  # held while a message is being sent
        self._state = threading.Lock()  # guards _queued
        self._queued = 0
        #: Buckets of streamed messages sent (read by any thread: a wait's progress).
        self.buckets_sent = 0

    def submit(
        self,
        header: MessageHeader,
        tensors: list[torch.Tensor],
        timeout: float,
        before: Callable[[], None] | None = None,
        order: DeviceOrder | None = None,
    ) -> concurrent.futures.Future:
        """Queue a message on the sender thread; the future completes when it left.
        ``before`` runs on the sender thread first (a failed check fails the send);
        ``order``: where a CUDA payload stands in the caller's work (see
        :class:`DeviceOrder`)."""
        self._check_sendable()
        with self._state:
            self._queued += 1
        return self._thread.submit(self._send_queued, header, tensors, timeout, before, order)

    def send_inline(
        self, header: MessageHeader, tensors: list[torch.Tensor], timeout: float,
        order: DeviceOrder | None = None,
    ) -> None:
        """Send a message from the calling thread, after any queued sends."""
        self._check_sendable()
        with self._state:
            behind_queue = self._queued > 0
            if behind_queue:
                self._queued += 1
            else:  # nothing queued: send here, holding the send lock
                self._lock.acquire()
        if behind_queue:  # keep call order: go through the sender thread too
            self._thread.submit(self._send_queued, header, tensors, timeout, None, order).result()
            return
        try:
            self._send_now(header, tensors, timeout, order)
        finally:
            self._lock.release()

    @property
    def queued(self) -> int:
        """Sends queued on the sender thread (a look without the lock)."""
        return self._queued

    def send_small(self, frame: bytes, timeout: float) -> bool:
        """Send a whole message that is one frame (:func:`framing.small_frame`) from the
        calling thread. Returns False, having sent nothing, when sends are queued ahead
        of it: the caller then sends it the general way, which keeps call order."""
        if self._queued:
            return False
        lock = self._lock
        lock.acquire()
        try:
            # Only now is the look final: a queued send counts until it has left, and
            # one of another thread may have been queued and sent meanwhile.
            if self._queued:
                return False
            transport = self.transport
            if transport is None or self._reader.error is not None:
                self._check_sendable()
                transport = self._ready(timeout)
            self._send_frame(transport, frame, (), timeout, small=True)
        finally:
            lock.release()
        return True

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    def _check_sendable(self) -> None:
        error = self._reader.error
        if error is not None and not isinstance(error, CommTimeoutError):
            raise error

    def _send_queued(
        self,
        header: MessageHeader,
        tensors: list[torch.Tensor],
        timeout: float,
        before: Callable[[], None] | None,
        order: DeviceOrder | None = None,
    ) -> None:
        try:
            if before is not None:
                before()
            with self._lock:
                self._send_now(header, tensors, timeout, order)
        finally:
            with self._state:
                self._queued -= 1

    def _send_now(
        self, header: MessageHeader, tensors: list[torch.Tensor], timeout: float,
        order: DeviceOrder | None = None,
    ) -> None:
        transport = self.transport
        if transport is None or self._reader.error is not None:
            transport = self._ready(timeout)
        frame, payload = framing.pack(header, tensors)
        on_cuda = bool(tensors) and tensors[0].is_cuda
        if on_cuda:
            self._send_device(transport, frame, payload, timeout, order)
            return
        self._send_frame(transport, frame, [] if header.stream else payload, timeout)
        if header.stream:
            self._send_buckets(transport, header, tensors, timeout)

    def _send_frame(
        self, transport: Transport, frame: bytes, payload: Sequence[torch.Tensor],
        timeout: float, small: bool = False,
    ) -> None:
        """Send ``frame`` and ``payload`` (``small``: there is none, the frame is a whole
        message: :meth:`.Transport.send_small`)."""
        try:
            if small:
                transport.send_small(frame, timeout)
            else:
                transport.send_frame(frame, payload, timeout)
        except CommTimeoutError as exc:
            if not transport.broken:
                raise self._not_taken(timeout) from exc
            self._part_way(exc)
        except CommError as exc:
            self._fail(exc)
            raise

    def _send_buckets(
        self, transport: Transport, header: MessageHeader, tensors: list[torch.Tensor],
        timeout: float,
    ) -> None:
        """The buckets of a message that streams, after its frame (each within
        ``timeout``: the receiver reads one while the next is written)."""
        views = [codec.as_bytes(t) for t in tensors]
        try:
            for bucket in plan(header.tensors, header.stream):
                transport.send_bucket(
                    [views[p.tensor][p.start : p.end] for p in bucket.pieces], timeout)
                self.buckets_sent += 1
        except CommError as exc:
            transport.broken = True
            self._part_way(exc)

    def _not_taken(self, timeout: float, why: str = "") -> CommTimeoutError:
        return CommTimeoutError(
            f"send to {self.peer}: the peer did not take the message within {timeout}s "
            f"({why or 'it is not receiving, and holds as much unread data as it may'}); "
            "nothing of it was sent and the connection stays usable"
        )

    def _part_way(self, exc: CommError) -> None:
        if isinstance(exc, CommTimeoutError):
            error: CommError = CommTimeoutError(
                f"send to {self.peer} timed out part-way through a message ({exc}); the "
                "connection is closed and the next op makes a new one"
            )
        else:
            error = exc
        self._fail(error)
        raise error from exc

    def _send_device(
        self, transport: Transport, frame: bytes, payload: list[torch.Tensor], timeout: float,
        order: DeviceOrder | None,
    ) -> None:
        """A CUDA payload: offered in the frame over a one-sided transport (CUDA IPC),
        else sent after the frame (NCCL). The pair's first CUDA message goes before its
        CUDA transport exists: its frame first (the peer's receive op, reaching it, makes
        its end), then the offer in a frame of its own, or the payload."""
        device = payload[0].device
        if order is None:
            stream = torch.cuda.current_stream(device)
            order = DeviceOrder(stream, stream, False)
        made = self._cuda_transport(None, timeout)
        ipc = None if made is None else made.as_one_sided()
        if ipc is not None:
            self._send_offered(transport, ipc, frame, payload, timeout, order, False)
            return
        try:
            transport.send_frame(frame, [], timeout)
            cuda = self._cuda_transport(device, timeout)  # made now, for this device
            assert cuda is not None
            streamed = cuda.as_two_sided()
            if streamed is not None:
                streamed.send(payload, timeout)
                return
        except CommError as exc:
            self._part_way(exc)
        ipc = cuda.as_one_sided()
        assert ipc is not None  # a transport is one of the two
        self._send_offered(transport, ipc, b"", payload, timeout, order, True)

    def _send_offered(
        self, transport: Transport, cuda: OneSidedTransport, frame: bytes,
        payload: list[torch.Tensor], timeout: float, order: DeviceOrder, behind: bool,
    ) -> None:
        """Offer ``payload`` and send the offer in ``frame`` (``behind``: in a frame of
        its own, behind the message's frame that left already)."""
        deadline = time.monotonic() + timeout
        try:
            out = cuda.offer(payload, order.after, deadline, self._on_wait)
        except CommTimeoutError as exc:
            if behind:
                self._part_way(exc)
            raise self._not_taken(timeout, str(exc)) from exc
        except CommError as exc:
            self._fail(exc)
            raise
        try:
            transport.send_frame(frame + out.offer, [], max(0.001, deadline - time.monotonic()))
        except CommError as exc:
            cuda.withdraw(out)
            if isinstance(exc, CommTimeoutError) and not transport.broken and not behind:
                raise self._not_taken(timeout) from exc
            self._part_way(exc)
        try:
            cuda.complete(out, order.stream, deadline, self._on_wait, order.host)
        except ProtocolMismatchError:
            raise  # refused by the receiver, which said so: the stream is in step
        except CommError as exc:
            self._part_way(exc)
