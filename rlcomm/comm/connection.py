"""``Connection``: the message stream between this worker and one peer.

A message is a *frame* (the msgspec header, and the payload too when it is small)
followed, for large payloads, by one transport message per tensor.

Sending: a blocking send runs on the calling thread when nothing is queued ahead of it;
``async_op=True`` sends (and blocking ones behind them) run on the connection's *sender*
thread, so messages of different caller threads never interleave.

Receiving: who reads the stream (a waiting receive op, the receiver thread) is the
business of :mod:`rlcomm.comm.reading`. A *consumer* thread runs the ``async_op=True``
receives. Receives are served in call order (a ticket per call), so an async receive
posted first gets the first message even if a blocking receive is called right after it.

CUDA payloads: the frame goes over the CPU transport, the payload over the connection's
CUDA transport, chosen and made at its first CUDA payload (either direction): CUDA IPC
when both ends use one physical GPU of one node, else NCCL (see
:mod:`rlcomm.comm.transports.cuda_ipc`)."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from rlcomm.comm import codec, framing
from rlcomm.comm.codec import Kind, MessageHeader
from rlcomm.comm.reading import (
    ROLE_CLAIMANT,
    ROLE_STALLED,
    Incoming,
    StreamReader,
)
from rlcomm.comm.store import sub_store
from rlcomm.comm.transports import cuda_ipc
from rlcomm.comm.transports.base import Transport
from rlcomm.comm.transports.cuda_ipc import CudaIpcTransport
from rlcomm.comm.transports.nccl import NcclTransport
from rlcomm.errors import (
    CommError,
    CommTimeoutError,
    PeerLostError,
    ProtocolMismatchError,
)

logger = logging.getLogger(__name__)


class Connection(StreamReader):
    """The two-way message stream with one peer, over a connected transport.

    Created pending by the manager; :meth:`attach` hands it the connected transport
    (after the rendezvous) and starts its threads; :meth:`fail` ends it with an error
    every waiting and later op raises.

    Args:
        peer: the peer's address, for messages.
        on_lost: called once when the connection breaks.
    """

    def __init__(self, peer: str, on_lost: Callable[[Connection], None] | None = None):
        self.peer = peer
        self._on_lost = on_lost
        self._ready = threading.Event()
        self._error: CommError | None = None
        self._transport: Transport | None = None
        self._store: dist.Store | None = None
        self._rank = 0
        self._cuda: Transport | None = None  # CUDA IPC or NCCL, made by _cuda_transport
        self._cuda_lock = threading.Lock()
        super().__init__()
        self._next_ticket = 0
        self._serving = 0
        self._abandoned: set[int] = set()
        self._sender = concurrent.futures.ThreadPoolExecutor(1, f"rlcomm-send-{peer}")
        self._send_lock = threading.Lock()  # held while a message is being sent
        self._send_state = threading.Lock()  # guards _queued_sends
        self._queued_sends = 0
        self._consumer: concurrent.futures.ThreadPoolExecutor | None = None
        self.transport_name = "pending"
        # Set by the manager: options this side gave on first contact, the group fields
        # both ends agreed on, and whether this side's first op checked them.
        self.requested_options: Any = None
        self.agreed_fields: dict | None = None
        self.checked_first_contact = False

    # -- life cycle -------------------------------------------------------------------------

    def attach(self, transport: Transport, store: dist.Store, rank: int) -> None:
        self._transport, self._store, self._rank = transport, store, rank
        self.transport_name = transport.name
        threading.Thread(target=self._receive_loop, name=f"rlcomm-recv-{self.peer}",
                         daemon=True).start()
        self._ready.set()
        with self._cond:
            if self._selector is not None:
                self._selector.wake()

    def fail(self, error: CommError) -> None:
        with self._cond:
            if self._error is not None:
                return
            self._error = error
            if self._transport is None:
                self._close_wake_pipe()  # no receiver thread will
            self._cond.notify_all()
            self._wake_reader()
        self._ready.set()
        if self._listener is not None:
            self._listener[1](error)
        if self._on_lost is not None:
            self._on_lost(self)

    @property
    def attached(self) -> bool:
        return self._transport is not None

    @property
    def error(self) -> CommError | None:
        return self._error

    def wait_ready(self, timeout: float) -> Transport:
        if not self._ready.wait(timeout):
            raise CommTimeoutError(
                f"no connection with {self.peer} after {timeout}s: the peer did not take part "
                "in the rendezvous (is it alive and does it exist?)"
            )
        if self._error is not None:
            raise self._error
        return self._transport  # type: ignore[return-value]

    def close(self) -> None:
        self.fail(PeerLostError(f"the connection with {self.peer} was closed"))
        self._sender.shutdown(wait=False, cancel_futures=True)
        if self._consumer is not None:
            self._consumer.shutdown(wait=False, cancel_futures=True)
        if self._transport is not None:
            self._transport.close()
        if isinstance(self._cuda, CudaIpcTransport):
            # NCCL's communicator is left to its own teardown, as before: its shutdown
            # may wait on a dead peer.
            self._cuda.close()

    # -- sending ----------------------------------------------------------------------------

    def submit_send(
        self,
        header: MessageHeader,
        tensors: list[torch.Tensor],
        timeout: float,
        before: Callable[[], None] | None = None,
    ) -> concurrent.futures.Future:
        """Queue a message on the sender thread; the future completes when it left.

        ``before`` runs on the sender thread first (a failed check fails the send).
        """
        self._check_sendable()
        with self._send_state:
            self._queued_sends += 1
        return self._sender.submit(self._send_queued, header, tensors, timeout, before)

    def send_inline(self, header: MessageHeader, tensors: list[torch.Tensor], timeout: float) -> None:
        """Send a message from the calling thread, after any queued async sends."""
        self._check_sendable()
        with self._send_state:
            behind_queue = self._queued_sends > 0
            if behind_queue:
                self._queued_sends += 1
            else:  # nothing queued: send here, holding the send lock
                self._send_lock.acquire()
        if behind_queue:  # keep call order: go through the sender thread too
            self._sender.submit(self._send_queued, header, tensors, timeout, None).result()
            return
        try:
            self._send_now(header, tensors, timeout)
        finally:
            self._send_lock.release()

    def send_message(self, obj: Any, timeout: float) -> None:
        """Encode ``obj`` and send it from the calling thread: the short path of a caller
        that holds the connection already (a listened one), past the manager's lookups."""
        header, tensors = codec.encode(obj)
        self.send_inline(header, tensors, timeout)

    def _check_sendable(self) -> None:
        if self._error is not None and not isinstance(self._error, CommTimeoutError):
            raise self._error

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
            with self._send_lock:
                self._send_now(header, tensors, timeout)
        finally:
            with self._send_state:
                self._queued_sends -= 1

    def _send_now(self, header: MessageHeader, tensors: list[torch.Tensor], timeout: float) -> None:
        transport = self._transport
        if transport is None or self._error is not None:
            transport = self.wait_ready(timeout)
        frame, payload = framing.pack(header, tensors)
        try:
            if tensors and tensors[0].is_cuda:
                transport.send_frame(frame, [], timeout)
                self._cuda_transport(tensors[0].device, timeout).send(payload, timeout)
            else:
                transport.send_frame(frame, payload, timeout)
        except CommTimeoutError as exc:
            if not transport.broken and not (tensors and tensors[0].is_cuda):
                raise CommTimeoutError(
                    f"send to {self.peer}: the peer did not take the message within "
                    f"{timeout}s (it is not receiving, and holds as much unread data as it "
                    "may); nothing of it was sent and the connection stays usable"
                ) from exc
            error = CommTimeoutError(
                f"send to {self.peer} timed out part-way through a message ({exc}); the "
                "connection is closed and the next op makes a new one"
            )
            self.fail(error)
            raise error from exc
        except CommError as exc:
            self.fail(exc)
            raise

    def _cuda_transport(self, device: torch.device, timeout: float) -> Transport:
        """The transport of this connection's CUDA payloads, chosen and made at the first
        one sent or received: both ends swap the UUID of their GPU (``device``'s) and
        take CUDA IPC when it is one GPU and the frames go over shared memory, else NCCL
        (which refuses two ranks on one GPU).

        Raises:
            CommTimeoutError: the peer did not reach its first CUDA op within ``timeout``.
        """
        with self._cuda_lock:
            if self._cuda is None:
                store = self._store
                mine = cuda_ipc.gpu_uuid(device)
                theirs = cuda_ipc.exchange_gpu_uuids(store, self._rank, mine, timeout, self.peer)
                kind = cuda_ipc.choose_cuda_transport(self.transport_name, mine, theirs)
                logger.debug(
                    "CUDA payloads with %s go over %s (GPU %s here, %s there)",
                    self.peer, kind, mine, theirs,
                )
                if kind == CudaIpcTransport.name:
                    self._cuda = CudaIpcTransport(
                        sub_store(store, "cuda_ipc"), self._rank, self.peer
                    )
                else:
                    self._cuda = NcclTransport(
                        sub_store(store, "nccl"), self._rank, timeout, self.peer, device
                    )
            return self._cuda

    # -- receiving: receive ops ---------------------------------------------------------------

    def take_ticket(self) -> int:
        with self._cond:
            ticket = self._next_ticket
            self._next_ticket += 1
            return ticket

    def release_ticket(self, ticket: int) -> None:
        """Give up receive ``ticket`` if it was not served (a receive op that failed
        before its turn): later receives then do not wait for it. Idempotent."""
        with self._cond:
            if ticket < self._serving or ticket in self._abandoned:
                return
            self._abandoned.add(ticket)
            while self._serving in self._abandoned:
                self._abandoned.discard(self._serving)
                self._serving += 1
            self._cond.notify_all()

    def run_async(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        with self._cond:
            if self._consumer is None:
                self._consumer = concurrent.futures.ThreadPoolExecutor(
                    1, f"rlcomm-consume-{self.peer}"
                )
        return self._consumer.submit(fn)

    def receive(
        self,
        ticket: int,
        timeout: float,
        handle: Callable[[Incoming], tuple[bool, Any]],
        what: str,
    ) -> Any:
        """Serve receive ``ticket``: wait for its turn and a message, then ``handle`` it.

        While it is this ticket's turn and the inbox is empty, it reads the message
        itself when the transport allows (see the module docstring).
        ``handle(msg)`` returns ``(consume, result)``; it raises to refuse the message
        (which then stays queued for the next receive).
        """
        if self._listener is not None:
            raise RuntimeError(f"{what} from {self.peer}: this connection is listened to")
        deadline = time.monotonic() + timeout
        asked = False
        with self._cond:
            try:
                while True:
                    while self._serving in self._abandoned:
                        self._abandoned.discard(self._serving)
                        self._serving += 1
                    my_turn = self._serving == ticket
                    if my_turn and self._inbox:
                        break
                    if my_turn and self._error is not None:
                        raise self._error
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise CommTimeoutError(
                            f"{what} from {self.peer}: nothing arrived within {timeout}s"
                        )
                    if my_turn:
                        asked = self._wait_for_message(remaining, asked)
                    else:
                        self._cond.wait(remaining)
                msg = self._inbox[0]
                consume, result = handle(msg)
                if consume:
                    self._inbox.popleft()
                    was_full = self._unread >= self._max_unread
                    self._unread -= msg.nbytes
                    if was_full and self._unread < self._max_unread:
                        self._wake_reader()  # it stopped at the cap: read on
            except BaseException:
                if self._serving == ticket:
                    self._serving += 1
                else:
                    self._abandoned.add(ticket)
                self._cond.notify_all()
                raise
            finally:
                if asked:
                    self._wanting -= 1
            self._serving += 1
            self._cond.notify_all()
        return result

    def read_deferred(
        self, msg: Incoming, buffers: list[torch.Tensor], timeout: float, what: str
    ) -> list[torch.Tensor]:
        """Read the stalled payload of ``msg`` (taken by this receive op) into ``buffers``."""
        with self._cond:
            if self._role != ROLE_STALLED:
                raise AssertionError(f"{what}: the stream is not stalled on this message")
            self._role = ROLE_CLAIMANT
        try:
            self._read_payload(self.wait_ready(timeout), buffers, timeout)
        finally:
            with self._cond:
                self._leave_role(None, by_caller=True)
        msg.tensors = buffers
        return buffers

    # -- receive ops ---------------------------------------------------------------------------

    def recv_object(self, ticket: int, timeout: float, device: torch.device | None) -> Any:
        def handle(msg: Incoming) -> tuple[bool, Any]:
            if msg.header.kind == Kind.RAW:
                raise ProtocolMismatchError(
                    f"recv from {self.peer}: the peer sent this message with send_tensor(); "
                    "receive it with recv_tensor() (do not mix send/recv with "
                    "send_tensor/recv_tensor)"
                )
            return True, msg

        msg = self.receive(ticket, timeout, handle, "recv")
        if msg.deferred:
            dev = device or torch.device("cuda", torch.cuda.current_device())
            buffers = [codec.empty_like_meta(m, dev) for m in msg.header.tensors]
            tensors = self.read_deferred(msg, buffers, timeout, "recv")
        else:
            tensors = msg.tensors
        return codec.decode(msg.header, tensors)

    def recv_tensor_into(self, ticket: int, tensor: torch.Tensor, timeout: float) -> None:
        def handle(msg: Incoming) -> tuple[bool, Any]:
            header = msg.header
            if header.kind != Kind.RAW:
                raise ProtocolMismatchError(
                    f"recv_tensor from {self.peer}: the peer sent this message with send(); "
                    "receive it with recv() (do not mix send/recv with send_tensor/recv_tensor)"
                )
            meta = header.tensors[0]
            want = codec.meta_of(tensor)
            if (meta.dtype, tuple(meta.shape)) != (want.dtype, want.shape):
                raise ProtocolMismatchError(
                    f"recv_tensor from {self.peer}: the peer sent a {meta.dtype} tensor of shape "
                    f"{tuple(meta.shape)} but the buffer is {want.dtype} of shape {want.shape}"
                )
            if meta.device != want.device:
                raise ProtocolMismatchError(
                    f"recv_tensor from {self.peer}: the peer sent a {meta.device} tensor into a "
                    f"{want.device} buffer; use buffers on the same kind of device"
                )
            return True, msg

        msg = self.receive(ticket, timeout, handle, "recv_tensor")
        if msg.deferred:
            self.read_deferred(msg, [tensor], timeout, "recv_tensor")
        else:
            framing.copy_inline_into(tensor, msg.inline)
