"""``Connection``: the message stream between this worker and one peer.

A message is a *frame* (the msgspec header, and the payload too when it is small)
followed, for large payloads, by one transport message per tensor.

Sending: a blocking send runs on the calling thread when nothing is queued ahead of it;
``async_op=True`` sends (and blocking ones behind them) run on the connection's *sender*
thread, so messages of different caller threads never interleave.

Receiving: one thread at a time holds the *receiving role* and reads the next message
from the transport into the inbox. By default the connection's *receiver* thread holds
it, so a peer's send never waits for this worker's code to call ``recv``. On a pollable
transport (shared memory) a receive op that finds the inbox empty takes the role itself
(waking the receiver thread if it was waiting) and reads its own message, which saves a
thread hop per message; the receiver thread takes the role back once no op has read for
:data:`_LINGER` seconds. CPU payloads are read eagerly into fresh tensors. A
``send_tensor`` payload (read in place into the caller's buffer) or a CUDA payload (read
on the caller's device) *stalls* the stream until the receive op that takes the message
reads the payload itself. A *consumer* thread runs the ``async_op=True`` receives.

Receives are served in call order (a ticket per call), so an async receive posted first
gets the first message even if a blocking receive is called right after it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from rlcomm.comm import codec, framing
from rlcomm.comm.codec import Kind, MessageHeader
from rlcomm.comm.transports.base import Transport
from rlcomm.comm.transports.nccl import NcclTransport
from rlcomm.errors import (
    CodecError,
    CommError,
    CommTimeoutError,
    PeerLostError,
    ProtocolMismatchError,
)

logger = logging.getLogger(__name__)



#: Seconds the receiver thread leaves the receiving role to receive ops after one read.
_LINGER = 0.005
#: Holders of the receiving role (``None``: nobody; ``_STALLED``: a deferred payload is
#: next in the stream and waits for the receive op that takes its message).
_BACKGROUND, _CALLER, _STALLED, _CLAIMANT = "receiver thread", "caller", "stalled", "claimant"


class _Incoming:
    """A received message; a deferred one still has its payload in the stream."""

    def __init__(self, header: MessageHeader, inline: bytes):
        self.header = header
        self.inline = inline
        self.tensors: list[torch.Tensor] | None = None
        self.deferred = False


class Connection:
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
        self._nccl: NcclTransport | None = None
        self._nccl_lock = threading.Lock()
        lock = threading.RLock()
        self._cond = threading.Condition(lock)  # guards the inbox, tickets and the role
        # The receiver thread waits on its own condition (same lock), so that handing
        # messages to receive ops does not wake it each time.
        self._receiver_wake = threading.Condition(lock)
        self._inbox: deque[_Incoming] = deque()
        self._next_ticket = 0
        self._serving = 0
        self._abandoned: set[int] = set()
        self._role: str | None = None  # who may read from the transport (see module doc)
        self._wanting = 0  # receive ops waiting for the receiver thread to leave the role
        self._last_read = 0.0  # when a receive op last left the role
        self._listener: tuple[Callable[[Any], None], Callable[[CommError], None]] | None = None
        self._pumper: int | None = None  # the thread id of a pump() holding the role
        self._wake_r, self._wake_w = os.pipe()  # wakes the receiver thread out of poll
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
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

    def fail(self, error: CommError) -> None:
        with self._cond:
            if self._error is not None:
                return
            self._error = error
            if self._transport is None:
                self._close_wake_pipe()  # no receiver thread will
            self._cond.notify_all()
            self._receiver_wake.notify()
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
        transport = self.wait_ready(timeout)
        frame, payload = framing.pack(header, tensors)
        if tensors and tensors[0].is_cuda:
            transport.send_frame(frame, [], timeout)
            self._nccl_transport(tensors[0].device, timeout).send(payload, timeout)
        else:
            transport.send_frame(frame, payload, timeout)

    def _nccl_transport(self, device: torch.device, timeout: float) -> NcclTransport:
        with self._nccl_lock:
            if self._nccl is None:
                self._nccl = NcclTransport(
                    dist.PrefixStore("nccl", self._store), self._rank, timeout, self.peer, device
                )
            return self._nccl

    # -- receiving: the role and the receiver thread ----------------------------------------

    def _read_message(self, transport: Transport) -> _Incoming:
        """Read the next message; with a deferred payload, only its frame."""
        msg = _Incoming(*framing.unpack(transport.recv_frame(None)))
        header = msg.header
        metas = header.tensors
        if header.inline or not metas:
            if header.kind != Kind.RAW:
                msg.tensors = framing.split_inline(header, msg.inline)
        elif header.kind != Kind.RAW and not metas[0].device.startswith("cuda"):
            payload = transport.recv_new([m.nbytes for m in metas if m.nbytes], None)
            msg.tensors = framing.tensors_from_payload(header, payload)
        else:
            msg.deferred = True
        return msg

    def _leave_role(self, msg: _Incoming | None, by_caller: bool) -> None:
        """Queue what the role holder read and free the role (call holding ``_cond``)."""
        if msg is not None:
            self._inbox.append(msg)
        stall_ends = self._role == _CLAIMANT
        self._role = _STALLED if msg is not None and msg.deferred else None
        if by_caller:
            self._last_read = time.monotonic()
        self._cond.notify_all()
        if stall_ends:
            self._receiver_wake.notify()

    def _receiver_may_read(self, pollable: bool) -> bool:
        if self._role is not None:
            return False
        return not pollable or (
            self._wanting == 0 and time.monotonic() - self._last_read >= _LINGER
        )

    def _receive_loop(self) -> None:
        """The receiver thread: holds the role whenever no receive op wants it."""
        transport = self._transport
        pollable = transport.pollable
        try:
            while True:
                with self._cond:
                    while self._error is None and not self._receiver_may_read(pollable):
                        self._receiver_wake.wait(_LINGER if pollable else None)
                    if self._error is not None:
                        return
                    self._role = _BACKGROUND
                msg = None
                try:
                    if not pollable or transport.poll(None, self._wake_r):
                        msg = self._read_message(transport)
                        if self._listener is not None:
                            self._dispatch(transport, msg)
                            msg = None
                    else:
                        self._drain_wake_pipe()
                finally:
                    with self._cond:
                        self._leave_role(msg, by_caller=False)
        except CommError as exc:
            self.fail(exc)
        except Exception as exc:  # noqa: BLE001 - any failure ends the stream, loudly
            logger.exception("receiver thread for %s failed", self.peer)
            self.fail(PeerLostError(f"receiving from {self.peer} failed: {exc!r}"))
        finally:
            with self._cond:
                self._close_wake_pipe()

    def _drain_wake_pipe(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _close_wake_pipe(self) -> None:
        if self._wake_w >= 0:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1

    def _read_as_caller(self, remaining: float, wakeable: bool = False) -> None:
        """Take the free role, read one message into the inbox (or hand it to the
        listener) if one comes within ``remaining`` seconds; ``wakeable``: the wake pipe
        ends the wait too (call holding ``_cond``; it is released meanwhile)."""
        transport = self._transport
        self._role = _CALLER
        msg = None
        self._cond.release()
        try:
            if transport.poll(remaining, self._wake_r if wakeable else None):
                msg = self._read_message(transport)
                if self._listener is not None:
                    self._dispatch(transport, msg)
                    msg = None
            elif wakeable:
                self._drain_wake_pipe()
        except CommError as exc:
            self.fail(exc)
        except Exception as exc:  # noqa: BLE001 - a half-read message breaks the stream
            logger.exception("receiving from %s failed", self.peer)
            self.fail(PeerLostError(f"receiving from {self.peer} failed: {exc!r}"))
        finally:
            self._cond.acquire()
            self._leave_role(msg, by_caller=True)

    def _ask_for_role(self) -> None:
        """Wake the receiver thread out of its poll so it leaves the role (holding ``_cond``)."""
        self._wanting += 1
        try:
            os.write(self._wake_w, b"w")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already

    # -- receiving: receive ops ---------------------------------------------------------------

    def take_ticket(self) -> int:
        with self._cond:
            ticket = self._next_ticket
            self._next_ticket += 1
            return ticket

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
        handle: Callable[[_Incoming], tuple[bool, Any]],
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
                    if my_turn and self._transport is not None and self._transport.pollable:
                        if self._role is None:
                            self._read_as_caller(remaining)
                            continue
                        if self._role == _BACKGROUND and not asked:
                            self._ask_for_role()
                            asked = True
                    self._cond.wait(remaining)
                msg = self._inbox[0]
                consume, result = handle(msg)
                if consume:
                    self._inbox.popleft()
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
        self, msg: _Incoming, buffers: list[torch.Tensor], timeout: float, what: str
    ) -> list[torch.Tensor]:
        """Read the stalled payload of ``msg`` (taken by this receive op) into ``buffers``."""
        with self._cond:
            if self._role != _STALLED:
                raise AssertionError(f"{what}: the stream is not stalled on this message")
            self._role = _CLAIMANT
        try:
            self._read_payload(self.wait_ready(timeout), buffers, timeout)
        finally:
            with self._cond:
                self._leave_role(None, by_caller=True)
        msg.tensors = buffers
        return buffers

    def _read_payload(self, transport: Transport, buffers: list[torch.Tensor], timeout: float) -> None:
        """Read a deferred payload (the role holder); a failure breaks the stream, so it
        fails the connection."""
        try:
            if buffers and buffers[0].is_cuda:
                self._nccl_transport(buffers[0].device, timeout).recv_into(buffers, timeout)
            else:
                # The payload follows its frame; only a dead peer stops it (seen at once).
                transport.recv_into([codec.as_bytes(b) for b in buffers if b.numel()], None)
        except CommError as exc:
            self.fail(exc)
            raise

    # -- listening: messages handed to a callback instead of receive ops -------------------

    def listen(
        self, on_message: Callable[[Any], None], on_error: Callable[[CommError], None]
    ) -> None:
        """Hand every message from now on, decoded, to ``on_message`` on the thread that
        read it (the receiver thread, or a :meth:`pump` caller), in order; receive ops
        are then refused. ``on_error`` is called once when the connection fails."""
        with self._cond:
            if self._listener is not None or self._inbox or self._next_ticket:
                raise RuntimeError(f"{self.peer}: the connection is already in use")
            self._listener = (on_message, on_error)
            error = self._error
        if error is not None:
            on_error(error)

    def _dispatch(self, transport: Transport, msg: _Incoming) -> None:
        """Complete ``msg`` and hand it to the listener (the role holder, no lock held)."""
        if msg.deferred:  # read it now: on CPU, or this thread's CUDA device
            msg.tensors = [codec.empty_like_meta(m) for m in msg.header.tensors]
            self._read_payload(transport, msg.tensors, 600.0)
        try:
            obj = codec.decode(msg.header, msg.tensors)
        except CodecError:
            logger.exception("a message from %s cannot be decoded; dropped", self.peer)
            return
        try:
            self._listener[0](obj)  # type: ignore[index]
        except Exception:  # noqa: BLE001 - the listener's failure must not end the stream
            logger.exception("the listener of %s failed on a message", self.peer)

    def pump(
        self, fut: concurrent.futures.Future, timeout: float, hand_back: Callable[[], bool]
    ) -> bool:
        """On a listened connection, read and dispatch messages on this thread until
        ``fut`` is done (True) or ``timeout`` seconds passed (False).

        Waiting this way, a blocking request's reply is read by the thread waiting for
        it. ``hand_back()``, asked when done, says whether other replies are awaited:
        the receiver thread then takes the role back at once.
        """
        deadline = time.monotonic() + timeout
        me = threading.get_ident()
        fut.add_done_callback(lambda _: self._wake_pumper(me))
        asked = False
        with self._cond:
            try:
                while not fut.done():
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return False
                    transport = self._transport
                    if self._error is None and transport is not None and transport.pollable:
                        if self._role is None:
                            self._pumper = me
                            try:
                                self._read_as_caller(remaining, wakeable=True)
                            finally:
                                self._pumper = None
                            continue
                        if self._role == _BACKGROUND and not asked:
                            self._ask_for_role()
                            asked = True
                    self._cond.wait(remaining)
                return True
            finally:
                if asked:
                    self._wanting -= 1
                if hand_back():
                    self._last_read = 0.0
                    self._receiver_wake.notify()

    def _wake_pumper(self, pumper: int) -> None:
        """``pumper``'s future got done on another thread: end its wait in poll."""
        if threading.get_ident() == pumper:
            return
        with self._cond:
            if self._pumper == pumper and self._wake_w >= 0:
                try:
                    os.write(self._wake_w, b"p")
                except BlockingIOError:
                    pass

    # -- receive ops ---------------------------------------------------------------------------

    def recv_object(self, ticket: int, timeout: float, device: torch.device | None) -> Any:
        def handle(msg: _Incoming) -> tuple[bool, Any]:
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
        def handle(msg: _Incoming) -> tuple[bool, Any]:
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

        if not tensor.is_contiguous():
            raise ValueError("recv_tensor: the destination tensor must be contiguous")
        msg = self.receive(ticket, timeout, handle, "recv_tensor")
        if msg.deferred:
            self.read_deferred(msg, [tensor], timeout, "recv_tensor")
        else:
            framing.copy_inline_into(tensor, msg.inline)
