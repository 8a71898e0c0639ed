"""Who reads a connection's stream: the *receiving role*, the receiver thread, pumps.

One thread at a time holds the receiving role and reads the next message from the
transport. By default the connection's *receiver* thread holds it, so a peer's send
never waits for this worker's code to call ``recv``: messages go to the inbox. On a
pollable transport (shared memory) a receive op that finds the inbox empty takes the
role itself (waking the receiver thread out of its poll through a pipe if needed) and
reads its own message, which saves a thread hop per message; the receiver thread takes
the role back once no op has read for :data:`LINGER` seconds.

Once a message's frame has been read, the rest of it (the frame's tail, the payload)
must arrive within a deadline: the waiting op's, or :func:`default_timeout` for the
receiver thread. A sender stalled mid-message fails the connection with
:class:`CommTimeoutError` instead of holding the reader forever. Frames declaring more
than :func:`max_message_bytes` fail the connection before anything is allocated.

Memory is bounded: the receiver thread (or selector) stops reading while the inbox holds
:func:`max_unread_bytes` or more, so a sender to a worker that never receives fills the
transport and then waits (its send times out with a clear error); a receive op that
takes a message lets reading go on.

CPU payloads are read eagerly into fresh tensors. A ``send_tensor`` payload (read in
place into the caller's buffer) or a CUDA payload (read on the caller's device) *stalls*
the stream until the receive op that takes the message reads the payload itself.

A *listened* connection (:meth:`StreamReader.listen`) hands every message, decoded, to a
callback on the thread that read it instead; a thread waiting for a reply reads the
stream itself with :meth:`StreamReader.pump`.
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

from rlcomm.comm import codec, framing
from rlcomm.comm.codec import Kind, MessageHeader
from rlcomm.comm.options import default_timeout, max_message_bytes, max_unread_bytes
from rlcomm.comm.transports.base import Transport
from rlcomm.errors import CodecError, CommError, PeerLostError, ProtocolMismatchError

logger = logging.getLogger(__name__)

#: Seconds the receiver thread leaves the receiving role to receive ops after one read.
LINGER = 0.005
#: Holders of the receiving role (``None``: nobody; ``ROLE_STALLED``: a deferred payload is
#: next in the stream and waits for the receive op that takes its message).
ROLE_RECEIVER_THREAD = "receiver thread"
ROLE_CALLER = "caller"  # a receive op or a pump
ROLE_STALLED = "stalled"
ROLE_CLAIMANT = "claimant"  # the receive op reading a stalled payload


def drain(fd: int) -> None:
    """Read a non-blocking wake-up pipe empty."""
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


class Incoming:
    """A received message; a deferred one still has its payload in the stream."""

    def __init__(self, header: MessageHeader, inline: bytes):
        self.header = header
        self.inline = inline
        self.tensors: list[torch.Tensor] | None = None
        self.deferred = False
        self.nbytes = len(inline)  # what it holds in memory while unread


class StreamReader:
    """The receiving half of a :class:`~rlcomm.comm.connection.Connection` (see the
    module docstring). The connection supplies ``peer``, ``_transport``, ``_error``,
    ``_next_ticket`` (receive ops taken so far), :meth:`fail` and
    :meth:`_cuda_transport`; all state here is guarded by ``_cond``.
    """

    peer: str
    _transport: Transport | None
    _error: CommError | None
    _next_ticket: int

    def __init__(self) -> None:
        lock = threading.RLock()
        self._cond = threading.Condition(lock)  # guards the inbox, tickets and the role
        # The receiver thread waits on its own condition (same lock), so that handing
        # messages to receive ops does not wake it each time.
        self._receiver_wake = threading.Condition(lock)
        self._inbox: deque[Incoming] = deque()
        self._unread = 0  # bytes held by the inbox's messages
        self._max_unread = max_unread_bytes()
        self._role: str | None = None  # who may read from the transport
        self._wanting = 0  # receive ops waiting for the receiver thread to leave the role
        self._last_read = 0.0  # when a receive op last left the role
        self._listener: tuple[Callable[[Any], None], Callable[[CommError], None]] | None = None
        self._pumper: int | None = None  # the thread id of a pump() holding the role
        self._selector: Any = None  # a Selector that reads instead of the receiver thread
        self._wake_r, self._wake_w = os.pipe()  # wakes the role holder out of poll
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    def fail(self, error: CommError) -> None:
        raise NotImplementedError

    def _cuda_transport(self, device: torch.device, timeout: float) -> Transport:
        raise NotImplementedError

    # -- the role and the receiver thread ------------------------------------------------------

    def _read_message(self, transport: Transport, rest: float | None = None) -> Incoming:
        """Read the next message; with a deferred payload, only its frame. Once the frame
        has begun, the rest must come within ``rest`` seconds (default: the default op
        timeout)."""
        rest = default_timeout() if rest is None else max(rest, 0.001)
        msg = Incoming(*framing.unpack(transport.recv_frame(None, rest)))
        header = msg.header
        metas = header.tensors
        sizes = [m.nbytes for m in metas]
        total = sum(sizes)
        if total > max_message_bytes():
            raise ProtocolMismatchError(
                f"a message from {self.peer} declares {total} bytes, over this worker's "
                f"limit of {max_message_bytes()} (RLCOMM_MAX_MESSAGE_BYTES); the connection "
                "is closed"
            )
        if header.inline or not metas:
            if header.inline != total or len(msg.inline) != total:
                raise ProtocolMismatchError(
                    f"a message from {self.peer} declares {total} bytes but carries "
                    f"{header.inline} inline; the connection is closed"
                )
            if header.kind != Kind.RAW:
                msg.tensors = framing.split_inline(header, msg.inline)
        elif header.kind != Kind.RAW and not metas[0].device.startswith("cuda"):
            payload = transport.recv_new([n for n in sizes if n], rest)
            msg.tensors = framing.tensors_from_payload(header, payload)
            msg.nbytes += total
        else:
            msg.deferred = True
        return msg

    def _leave_role(self, msg: Incoming | None, by_caller: bool) -> None:
        """Queue what the role holder read and free the role (call holding ``_cond``)."""
        if msg is not None:
            self._inbox.append(msg)
            self._unread += msg.nbytes
        stall_ends = self._role == ROLE_CLAIMANT
        self._role = ROLE_STALLED if msg is not None and msg.deferred else None
        if by_caller:
            self._last_read = time.monotonic()
        self._cond.notify_all()
        if stall_ends and not self._transport.pollable:
            # A receiver thread blocked on its turn reads on now; on a pollable
            # transport it looks again within LINGER anyway, so no wake-up is owed.
            self._receiver_wake.notify()

    def _receiver_may_read(self, pollable: bool) -> bool:
        """Whether the reader (receiver thread or selector) may take the role now."""
        if self._role is not None or self._unread >= self._max_unread:
            return False
        return not pollable or (
            self._wanting == 0 and time.monotonic() - self._last_read >= LINGER
        )

    def _receive_loop(self) -> None:
        """The receiver thread: holds the role whenever no receive op wants it."""
        transport = self._transport
        pollable = transport.pollable
        try:
            while True:
                with self._cond:
                    # While a selector reads this connection, this thread only waits to be
                    # handed the role back (or for the end).
                    while self._error is None and (
                        (self._selector is not None and pollable)
                        or not self._receiver_may_read(pollable)
                    ):
                        selected = self._selector is not None
                        self._receiver_wake.wait(LINGER if pollable and not selected else None)
                    if self._error is not None:
                        return
                    self._role = ROLE_RECEIVER_THREAD
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
                if self._selector is None:  # else the selector polls it; it closes it
                    self._close_wake_pipe()

    def _wake_reader(self) -> None:
        """The role may be free for the reader again: wake it (holding ``_cond``)."""
        self._receiver_wake.notify()
        if self._selector is not None:
            self._selector.wake()

    def _drain_wake_pipe(self) -> None:
        drain(self._wake_r)

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
        self._role = ROLE_CALLER
        msg = None
        deadline = time.monotonic() + remaining
        self._cond.release()
        try:
            if transport.poll(remaining, self._wake_r if wakeable else None):
                msg = self._read_message(transport, deadline - time.monotonic())
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

    def _wait_for_message(self, remaining: float, asked: bool, pumper: int | None = None) -> bool:
        """One wait of a thread that wants the next message (holding ``_cond``): read it
        itself if the role is free, else ask the receiver thread to leave the role (once)
        and wait to be notified. ``pumper``: the thread id of a waiting :meth:`pump`,
        whose wait in poll the wake pipe may end. Returns whether it has asked."""
        transport = self._transport
        if self._error is None and transport is not None and transport.pollable:
            if self._role is None:
                self._pumper = pumper
                try:
                    self._read_as_caller(remaining, wakeable=pumper is not None)
                finally:
                    self._pumper = None
                return asked
            if self._role == ROLE_RECEIVER_THREAD and not asked:
                self._ask_for_role()
                asked = True
        self._cond.wait(remaining)
        return asked

    def _ask_for_role(self) -> None:
        """Wake the receiver thread out of its poll so it leaves the role (holding ``_cond``)."""
        self._wanting += 1
        try:
            os.write(self._wake_w, b"w")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already

    def _read_payload(self, transport: Transport, buffers: list[torch.Tensor], timeout: float) -> None:
        """Read a deferred payload (the role holder); a failure breaks the stream, so it
        fails the connection."""
        try:
            if buffers and buffers[0].is_cuda:
                self._cuda_transport(buffers[0].device, timeout).recv_into(buffers, timeout)
            else:
                # The payload follows its frame: it must come within the op's timeout.
                transport.recv_into([codec.as_bytes(b) for b in buffers if b.numel()], timeout)
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

    def _dispatch(self, transport: Transport, msg: Incoming) -> None:
        """Complete ``msg`` and hand it to the listener (the role holder, no lock held)."""
        if msg.deferred:  # read it now: on CPU, or this thread's CUDA device
            msg.tensors = [codec.empty_like_meta(m) for m in msg.header.tensors]
            self._read_payload(transport, msg.tensors, default_timeout())
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
                    asked = self._wait_for_message(remaining, asked, pumper=me)
                return True
            finally:
                if asked:
                    self._wanting -= 1
                if hand_back():
                    self._last_read = 0.0
                    self._wake_reader()

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

    # -- serving by a selector -------------------------------------------------------------------

    def select_by(self, selector: Any) -> None:
        """Let ``selector`` read this connection instead of its receiver thread (it keeps
        to that once the transport is known to be pollable; else it lets go)."""
        with self._cond:
            self._selector = selector
            if self._role == ROLE_RECEIVER_THREAD and self._wake_w >= 0:
                try:
                    os.write(self._wake_w, b"s")  # out of its poll: it leaves the role
                except BlockingIOError:
                    pass  # full of wake-ups already
        selector.wake()

    def claim_for_selector(self, selector: Any) -> Transport | bool:
        """Take the role for ``selector`` if it may read now: the transport when taken;
        False when not now (try again within :data:`LINGER`); True when the selector is
        done with this connection (it failed, or its transport cannot be polled)."""
        with self._cond:
            transport = self._transport
            if self._selector is not selector:
                return True
            if self._error is not None:
                self._selector = None
                self._close_wake_pipe()  # its receiver thread left it to the selector
                return True
            if transport is None:
                return False
            if not transport.pollable:  # its receiver thread reads it
                self._selector = None
                self._receiver_wake.notify()
                return True
            if not self._receiver_may_read(True):
                return False
            self._role = ROLE_RECEIVER_THREAD
            return transport

    def serve_for_selector(self, transport: Transport, has_data: bool) -> bool:
        """The selector, holding the role: read the next message if ``has_data``, then
        leave the role if the message goes to the inbox or somebody else wants the role.
        Returns whether it left."""
        msg = None
        try:
            if has_data:
                msg = self._read_message(transport)
                if self._listener is not None:
                    self._dispatch(transport, msg)
                    msg = None
        except CommError as exc:
            self.fail(exc)
        except Exception as exc:  # noqa: BLE001 - a half-read message breaks the stream
            logger.exception("receiving from %s failed", self.peer)
            self.fail(PeerLostError(f"receiving from {self.peer} failed: {exc!r}"))
        with self._cond:
            # A dispatched message leaves nothing to hand over: keep the role unless it
            # is wanted (the selector empties the wake pipes when woken).
            if msg is None and not self._wanting and self._error is None and (
                self._selector is not None
            ):
                return False
            self._leave_role(msg, by_caller=False)
            return True

    def release_selector(self, selector: Any, holding: bool) -> None:
        """``selector`` (``holding`` the role or not) ends: the receiver thread reads this
        connection again."""
        with self._cond:
            if self._selector is selector:
                self._selector = None
                if holding:
                    self._leave_role(None, by_caller=False)
                if self._error is not None:
                    self._close_wake_pipe()
                self._receiver_wake.notify()

    @property
    def wake_fd(self) -> int:
        """The read end of the wake pipe (a reader polls it beside the transport)."""
        return self._wake_r
