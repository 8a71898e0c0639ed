"""The reading part of a connection: who reads the stream, in explicit states.

One thread at a time reads the next message; :class:`ReaderState` says who. By default
the reader's *driver* reads: its receiver thread (:mod:`.receiver`) or a shared
:class:`~rlcomm.comm.selector.Selector`, so a peer's send never waits for this worker to
call ``recv``; messages go to the bounded :class:`~.inbox.Inbox` (while it is full, the
driver stops reading). On a pollable transport a receive op that finds the inbox empty
reads its own message (the fast path: no thread hop), waking the driver out of its poll
through a pipe if needed; the driver reads again once no op read for :data:`LINGER` s.

Once a frame has been read, the rest of its message must come within a deadline (the
waiting op's, or :func:`default_timeout` for the driver): a sender stalled mid-message
fails the connection. CPU payloads are read eagerly into fresh tensors; a ``send_tensor``
or CUDA payload *stalls* the stream until the receive op that takes its message reads
it. Receives are served in call order (a ticket per call). A *listened* reader hands
every message to a callback instead (:mod:`.listening`); a thread waiting for a reply
reads itself with :meth:`Reader.pump`. All state here is guarded by ``cond``.
"""

from __future__ import annotations

import concurrent.futures
import enum
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from rlcomm.comm import codec, framing
from rlcomm.comm.connection.inbox import Inbox
from rlcomm.comm.connection.incoming import Incoming, read_message
from rlcomm.comm.connection.listening import Listener
from rlcomm.comm.options import default_timeout
from rlcomm.comm.transports.base import OneSidedTransport, Transport, is_pollable
from rlcomm.errors import CommError, CommTimeoutError, PeerLostError, ProtocolMismatchError

logger = logging.getLogger(__name__)

#: Seconds the driver leaves the stream to receive ops after one of them read.
LINGER = 0.005

T = TypeVar("T")


def _fill(targets: list[torch.Tensor] | None, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` copied into ``targets`` (returned then), or ``tensors`` when none."""
    if targets is None:
        return tensors
    for target, tensor in zip(targets, tensors, strict=True):
        target.copy_(tensor)
    return targets


class ReaderState(enum.Enum):
    """Who may read the stream now."""

    IDLE = "idle"  # nobody: the next reader may take it
    DRIVER = "driver"  # the receiver thread or the selector
    CALLER = "caller"  # a receive op or a pump, reading its own message
    STALLED = "stalled"  # a deferred payload is next; it waits for its receive op
    CLAIMANT = "claimant"  # the receive op that took that message reads its payload


def drain(fd: int) -> None:
    """Read a non-blocking wake-up pipe empty."""
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


class Reader:
    """Reads one connection's stream (see the module docstring).

    Args:
        peer: the peer's address, for messages.
        fail: fails the connection (the reader's :meth:`set_error` is part of it).
        ready: waits (up to its argument, seconds) for the connected transport.
        cuda_transport: the transport of CUDA payloads for a device (made on first use).
    """

    def __init__(
        self,
        peer: str,
        fail: Callable[[CommError], None],
        ready: Callable[[float], Transport],
        cuda_transport: Callable[[torch.device, float], Transport],
    ):
        self.peer = peer
        self.fail = fail
        self._ready = ready
        self._cuda_transport = cuda_transport
        lock = threading.RLock()
        self.cond = threading.Condition(lock)
        # The receiver thread waits on its own condition (same lock), so that handing
        # messages to receive ops does not wake it each time.
        self.driver_wake = threading.Condition(lock)
        self.inbox = Inbox()
        self.transport: Transport | None = None
        self.pollable = False
        self.error: CommError | None = None
        self.state = ReaderState.IDLE
        self.wanting = 0  # receive ops waiting for the driver to leave the stream
        self._last_read = 0.0  # when a receive op last left the stream
        self.listener: Listener | None = None
        self._pumper: int | None = None  # the thread id of a pump() reading
        self.selector: Any = None  # a Selector that drives instead of the receiver thread
        self._next_ticket = 0
        self._serving = 0
        self._abandoned: set[int] = set()
        self._wake_r, self._wake_w = os.pipe()  # wakes the reading thread out of poll
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    # -- life cycle ----------------------------------------------------------------------------

    def attach(self, transport: Transport) -> None:
        with self.cond:
            self.transport = transport
            self.pollable = is_pollable(transport)

    def set_error(self, error: CommError) -> bool:
        """Record the connection's error and wake every waiter. Returns False when it had
        one already (the first error stays)."""
        with self.cond:
            if self.error is not None:
                return False
            self.error = error
            if self.transport is None:
                self.close_wake_pipe()  # no driver will
            self.cond.notify_all()
            self.wake_driver()
        return True

    @property
    def wake_fd(self) -> int:
        """The read end of the wake pipe (a driver polls it beside the transport)."""
        return self._wake_r

    def wake_driver(self) -> None:
        """The stream may be free for the driver again: wake it (holding ``cond``)."""
        self.driver_wake.notify()
        if self.selector is not None:
            self.selector.wake()

    def poke(self, byte: bytes) -> None:
        """Wake the thread reading in poll (holding ``cond``)."""
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, byte)
            except BlockingIOError:
                pass  # the pipe is full of wake-ups already

    def drain_wake_pipe(self) -> None:
        drain(self._wake_r)

    def close_wake_pipe(self) -> None:
        if self._wake_w >= 0:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1

    # -- reading a message ---------------------------------------------------------------------

    def read_one(self, transport: Transport, rest: float | None = None) -> Incoming | None:
        """Read the next message as the state's holder: the message for the inbox, or
        None when the listener took it. A failure fails the connection."""
        try:
            msg = read_message(transport, self.peer, rest)
            if msg.offer:
                cuda = self._cuda_transport(None, 0.0)
                if isinstance(cuda, OneSidedTransport) and cuda.copies_at_once(msg.offer):
                    # A staged payload: copied out now, as a CPU payload is read now, so
                    # that the sender's slot comes back without this worker's recv.
                    self._take_in(msg, cuda)
                    msg.nbytes += sum(t.numel() * t.element_size() for t in msg.tensors or ())
            if self.listener is not None:
                self.listener.dispatch(self, transport, msg)
                return None
            return msg
        except CommError as exc:
            self.fail(exc)
        except Exception as exc:  # noqa: BLE001 - a half-read message breaks the stream
            logger.exception("receiving from %s failed", self.peer)
            self.fail(PeerLostError(f"receiving from {self.peer} failed: {exc!r}"))
        return None

    def leave(self, msg: Incoming | None, by_caller: bool) -> None:
        """Queue what the holder read and free the stream (holding ``cond``)."""
        if msg is not None:
            self.inbox.put(msg)
        stall_ends = self.state is ReaderState.CLAIMANT
        self.state = ReaderState.STALLED if msg is not None and msg.deferred else ReaderState.IDLE
        if by_caller:
            self._last_read = time.monotonic()
        self.cond.notify_all()
        if stall_ends and not self.pollable:
            # A receiver thread blocked on its turn reads on now; on a pollable
            # transport it looks again within LINGER anyway, so no wake-up is owed.
            self.driver_wake.notify()

    def driver_may_read(self) -> bool:
        """Whether the driver may take the stream now (holding ``cond``)."""
        if self.state is not ReaderState.IDLE or self.inbox.full:
            return False
        return not self.pollable or (
            self.wanting == 0 and time.monotonic() - self._last_read >= LINGER
        )

    def read_payload(self, transport: Transport, buffers: list[torch.Tensor], timeout: float) -> None:
        """Read a deferred payload (the holder); a failure fails the connection."""
        try:
            if buffers and buffers[0].is_cuda:
                self._cuda_transport(buffers[0].device, timeout).recv_into(buffers, timeout)
            else:
                # The payload follows its frame: it must come within the op's timeout.
                transport.recv_into([codec.as_bytes(b) for b in buffers if b.numel()], timeout)
        except CommError as exc:
            self.fail(exc)
            raise

    def _read_offer(self, transport: Transport, timeout: float) -> bytes:
        """Read the offer that follows a deferred device message (the holder)."""
        try:
            return transport.recv_frame(timeout)
        except CommError as exc:
            self.fail(exc)
            raise

    def device_payload(
        self, msg: Incoming, targets: list[torch.Tensor] | None, device: torch.device | None,
        timeout: float, what: str, transport: Transport | None = None,
    ) -> list[torch.Tensor]:
        """The CUDA tensors of ``msg``, taken by this receive op: copied out of the
        sender's offer (in the frame, or, for the first CUDA message of the pair, in the
        frame that follows it), or read over NCCL. Into ``targets`` when given (returned
        then), else new tensors on ``device`` (``None``: this thread's current device).
        ``transport``: this thread holds the stream already (a listener's dispatch).

        Raises:
            ProtocolMismatchError: the payload does not fit, or came over the wrong path.
            CommTimeoutError, PeerLostError: from the transports.
        """
        header = msg.header
        if msg.tensors is not None:  # taken in already: order this stream after the copy
            cuda = self._cuda_transport(None, timeout)
            if isinstance(cuda, OneSidedTransport):
                at = targets[0].device if targets and targets[0].is_cuda else (
                    msg.tensors[0].device if msg.tensors else device)
                cuda.order_after(cuda.current_order(at))
            return _fill(targets, msg.tensors)
        if targets and targets[0].is_cuda:
            device = targets[0].device
        direct = targets is not None and all(t.is_cuda and t.is_contiguous() for t in targets)
        cuda = self._cuda_transport(None, timeout) or self._cuda_transport(
            device or torch.device("cuda", torch.cuda.current_device()), timeout)
        offer = msg.offer
        if not offer:  # deferred: the payload (NCCL) or its offer follows in the stream
            if not isinstance(cuda, OneSidedTransport):
                device = device or torch.device("cuda", torch.cuda.current_device())
                buffers = targets if direct else [codec.empty_like_meta(m, device) for m in header.tensors]

                def read_stream(transport: Transport) -> list[torch.Tensor]:
                    self.read_payload(transport, buffers, timeout)  # type: ignore[arg-type]
                    return buffers  # type: ignore[return-value]

                got = read_stream(transport) if transport is not None else (
                    self.read_deferred(msg, read_stream, timeout, what))
                return got if direct else _fill(targets, got)
            offer = self._read_offer(transport, timeout) if transport is not None else (
                self.read_deferred(msg, lambda t: self._read_offer(t, timeout), timeout, what))
        if not isinstance(cuda, OneSidedTransport):
            raise ProtocolMismatchError(
                f"{what} from {self.peer}: a CUDA offer came on a connection whose CUDA "
                f"payloads go over {cuda.name}; the ends disagree"
            )
        sizes = [m.nbytes for m in header.tensors]
        buffers = cuda.accept(offer, sizes, targets if direct else None, device,
                              cuda.current_order(device))
        if direct:
            return targets  # type: ignore[return-value]
        device = buffers[0].device if buffers else device
        return _fill(targets, framing.tensors_from_payload(header, buffers, device))

    def _claim_trailing_offer(self) -> None:
        """The pair's first CUDA message stalls the stream, its offer in the frame right
        behind it: read that offer now, when it is there, so that the message is taken
        in like the others (holding ``cond``)."""
        if self.state is not ReaderState.STALLED or not self.pollable or not self.inbox:
            return
        msg = list(self.inbox)[-1]
        transport = self.transport
        if not (msg.deferred and msg.on_device and msg.tensors is None) or transport is None:
            return
        if not isinstance(self._cuda_transport(None, 0.0), OneSidedTransport):
            return
        try:
            if not transport.poll(0):
                return
            self.state = ReaderState.CLAIMANT
            msg.offer = transport.recv_frame(default_timeout())
            msg.deferred = False
        except CommError as exc:
            # Not fail(): it closes the CUDA transport, whose send lock this thread may
            # hold (a waiting send runs this); the stream is marked broken instead.
            self.set_error(exc)
        finally:
            if self.state is ReaderState.CLAIMANT:
                self.leave(None, by_caller=True)

    def take_in_offers(self) -> None:
        """Copy the offered CUDA payloads of queued messages into new tensors now,
        freeing what their sender holds for them (its staging slots, its lent tensors).

        A send that waits for the peer runs this meanwhile: two workers that both send
        CUDA payloads to each other before receiving then both go on, as on the CPU path,
        up to the unread-bytes cap. A payload that cannot be copied now stays offered
        (its receive op raises the reason)."""
        with self.cond:
            self._claim_trailing_offer()
            pending = [m for m in self.inbox if m.offer and m.tensors is None]
            for msg in pending:
                if self.inbox.full or self.error is not None:
                    return
                cuda = self._cuda_transport(None, 0.0)  # made: the peer offered over it
                if not isinstance(cuda, OneSidedTransport):
                    return
                try:
                    self._take_in(msg, cuda)
                except CommError:
                    logger.debug("taking in an offer from %s failed", self.peer, exc_info=True)
                    return
                self.inbox.grew(msg, sum(t.numel() * t.element_size() for t in msg.tensors or ()))

    def _take_in(self, msg: Incoming, cuda: OneSidedTransport) -> None:
        """Copy ``msg``'s offered payload into new tensors (on the GPU it lies on); its
        receive op orders its stream after the copy."""
        header = msg.header
        buffers = cuda.accept(msg.offer, [m.nbytes for m in header.tensors], None, None, None)
        device = buffers[0].device if buffers else None
        msg.tensors = framing.tensors_from_payload(header, buffers, device)
        msg.offer = b""

    # -- the caller's fast path ------------------------------------------------------------------

    def _read_as_caller(self, remaining: float, wakeable: bool = False) -> None:
        """Take the idle stream, read one message if one comes within ``remaining``
        seconds; ``wakeable``: the wake pipe ends the wait too (holding ``cond``; it is
        released meanwhile)."""
        transport = self.transport
        self.state = ReaderState.CALLER
        msg = None
        deadline = time.monotonic() + remaining
        self.cond.release()
        try:
            if transport.poll(remaining, self._wake_r if wakeable else None):
                msg = self.read_one(transport, deadline - time.monotonic())
            elif wakeable:
                self.drain_wake_pipe()
        except CommError as exc:
            self.fail(exc)
        except Exception as exc:  # noqa: BLE001 - a broken poll ends the stream, loudly
            logger.exception("waiting for a message from %s failed", self.peer)
            self.fail(PeerLostError(f"receiving from {self.peer} failed: {exc!r}"))
        finally:
            self.cond.acquire()
            self.leave(msg, by_caller=True)

    def _wait_for_message(self, remaining: float, asked: bool, pumper: int | None = None) -> bool:
        """One wait of a thread that wants the next message (holding ``cond``): read it
        itself if the stream is idle, else ask the driver to leave it (once) and wait to
        be notified. ``pumper``: the thread id of a waiting :meth:`pump`, whose wait in
        poll the wake pipe may end. Returns whether it has asked."""
        if self.error is None and self.transport is not None and self.pollable:
            if self.state is ReaderState.IDLE:
                self._pumper = pumper
                try:
                    self._read_as_caller(remaining, wakeable=pumper is not None)
                finally:
                    self._pumper = None
                return asked
            if self.state is ReaderState.DRIVER and not asked:
                self.wanting += 1
                self.poke(b"w")  # out of its poll: it leaves the stream
                asked = True
        self.cond.wait(remaining)
        return asked

    # -- receive ops ---------------------------------------------------------------------------

    def take_ticket(self) -> int:
        with self.cond:
            ticket = self._next_ticket
            self._next_ticket += 1
            return ticket

    @property
    def in_use(self) -> bool:
        """Whether receive ops or messages have used this reader (it cannot be listened)."""
        return bool(self.inbox) or self._next_ticket > 0

    def release_ticket(self, ticket: int) -> None:
        """Give up receive ``ticket`` if it was not served (a receive op that failed
        before its turn): later receives then do not wait for it. Idempotent."""
        with self.cond:
            if ticket < self._serving or ticket in self._abandoned:
                return
            self._abandoned.add(ticket)
            while self._serving in self._abandoned:
                self._abandoned.discard(self._serving)
                self._serving += 1
            self.cond.notify_all()

    def receive(
        self,
        ticket: int,
        timeout: float,
        handle: Callable[[Incoming], tuple[bool, Any]],
        what: str,
    ) -> Any:
        """Serve receive ``ticket``: wait for its turn and a message, then ``handle`` it.

        While it is this ticket's turn and the inbox is empty, it reads the message
        itself when the transport allows. ``handle(msg)`` returns ``(consume, result)``;
        it raises to refuse the message (which then stays queued for the next receive).
        """
        if self.listener is not None:
            raise RuntimeError(f"{what} from {self.peer}: this connection is listened to")
        deadline = time.monotonic() + timeout
        asked = False
        with self.cond:
            try:
                while True:
                    while self._serving in self._abandoned:
                        self._abandoned.discard(self._serving)
                        self._serving += 1
                    my_turn = self._serving == ticket
                    if my_turn and self.inbox:
                        break
                    if my_turn and self.error is not None:
                        raise self.error
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise CommTimeoutError(
                            f"{what} from {self.peer}: nothing arrived within {timeout}s"
                        )
                    if my_turn:
                        asked = self._wait_for_message(remaining, asked)
                    else:
                        self.cond.wait(remaining)
                msg = self.inbox.peek()
                consume, result = handle(msg)
                if consume and self.inbox.take():
                    self.wake_driver()  # it stopped at the cap: read on
            except BaseException:
                if self._serving == ticket:
                    self._serving += 1
                else:
                    self._abandoned.add(ticket)
                self.cond.notify_all()
                raise
            finally:
                if asked:
                    self.wanting -= 1
            self._serving += 1
            self.cond.notify_all()
        return result

    def read_deferred(
        self, msg: Incoming, read: Callable[[Transport], T], timeout: float, what: str
    ) -> T:
        """Read what follows ``msg`` in the stalled stream (``msg`` was taken by this
        receive op) with ``read(transport)``, as the stream's claimant."""
        with self.cond:
            if self.state is not ReaderState.STALLED:
                raise AssertionError(f"{what}: the stream is not stalled on this message")
            self.state = ReaderState.CLAIMANT
        try:
            return read(self._ready(timeout))
        finally:
            with self.cond:
                self.leave(None, by_caller=True)

    # -- listening -------------------------------------------------------------------------------

    def listen(self, listener: Listener) -> None:
        """Hand every message from now on to ``listener`` (see :mod:`.listening`)."""
        with self.cond:
            if self.listener is not None or self.in_use:
                raise RuntimeError(f"{self.peer}: the connection is already in use")
            self.listener = listener
            error = self.error
        if error is not None:
            listener.on_error(error)

    def pump(
        self, fut: concurrent.futures.Future, timeout: float, hand_back: Callable[[], bool]
    ) -> bool:
        """On a listened reader, read and dispatch messages on this thread until ``fut``
        is done (True) or ``timeout`` seconds passed (False).

        Waiting this way, a blocking request's reply is read by the thread waiting for
        it. ``hand_back()``, asked when done, says whether other replies are awaited:
        the driver then takes the stream back at once.
        """
        deadline = time.monotonic() + timeout
        me = threading.get_ident()
        fut.add_done_callback(lambda _: self._wake_pumper(me))
        asked = False
        with self.cond:
            try:
                while not fut.done():
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return False
                    asked = self._wait_for_message(remaining, asked, pumper=me)
                return True
            finally:
                if asked:
                    self.wanting -= 1
                if hand_back():
                    self._last_read = 0.0
                    self.wake_driver()

    def _wake_pumper(self, pumper: int) -> None:
        """``pumper``'s future got done on another thread: end its wait in poll."""
        if threading.get_ident() == pumper:
            return
        with self.cond:
            if self._pumper == pumper:
                self.poke(b"p")
