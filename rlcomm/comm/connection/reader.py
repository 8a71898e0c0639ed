"""The reading part of a connection: the drivers of its :class:`~.stream.StreamState`.

The read side's state (who reads the stream, the receive ops' turns, the bounded inbox,
the transport, the listener, the selector, the error) is :class:`~.stream.StreamState`, a
pure state machine; :class:`Reader` keeps none of it. It holds the state machine under
the connection's lock, carries out the :class:`~.stream.Action` each transition answers
(its wake-ups, then its step), and does the I/O: by default the reader's *driver*
reads (its receiver thread, :mod:`.receiver`, or a shared
:class:`~rlcomm.comm.connection.selector.Selector`, through the driver methods below), so a peer's
send never waits for this worker to call ``recv``; messages go to the inbox (while it is
full, the driver stops reading). On a pollable transport a receive op that finds the
inbox empty reads its own message (the fast path: no thread hop), waking the driver out
of its poll through a pipe if needed; a plain ``recv`` takes a small message of a header
it checked before straight from its frame (:func:`.incoming.small_parts`).

Once a frame has been read, the rest of its message must come within a deadline (the
waiting op's, or :func:`default_timeout` for the driver): a sender stalled mid-message
fails the connection. CPU payloads are read eagerly into fresh tensors; a ``send_tensor``
CPU payload, or a CUDA payload that follows its frame, *stalls* the stream until the
receive op that takes its message reads it (taking a payload, on every path, is
:mod:`.payload`'s). A *listened* reader hands every message to
a callback instead (:mod:`.listening`); a thread waiting for a reply reads itself with
:meth:`Reader.pump`. The lock is held only around a transition, the wake-ups it asks for
(notifies and non-blocking pipe writes) and a served message's ``handle``, never over a
read of the stream, with one exception: the CUDA take-in (:meth:`Reader.take_in_offers`)
copies offered payloads under it, so that no receive op takes the same offer meanwhile.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from rlcomm.comm.connection.inbox import Inbox
from rlcomm.comm.connection.incoming import (
    P_OFFERED,
    Incoming,
    Parts,
    read_message,
    small_parts,
)
from rlcomm.comm.connection.listening import Listener
from rlcomm.comm.connection.payload import CudaTransportOf, Payloads
from rlcomm.comm.connection.stream import (
    LINGER,
    Action,
    Do,
    Lease,
    StreamState,
)
from rlcomm.comm.framing import spare_ahead
from rlcomm.comm.options import default_timeout
from rlcomm.comm.transports.base import PollableTransport, Transport, is_pollable
from rlcomm.errors import CommError, CommTimeoutError, PeerLostError

logger = logging.getLogger(__name__)

__all__ = ["LINGER", "Lease", "Reader", "drain"]

T = TypeVar("T")


def drain(fd: int) -> None:
    """Read a non-blocking wake-up pipe empty."""
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


class Wakeable(Protocol):
    """A driver that is woken to look at its streams again (a selector)."""

    def wake(self) -> None: ...


class Reader:
    """Drives one connection's :class:`~.stream.StreamState` (see the module docstring).

    Args:
        peer: the peer's address, for messages.
        fail: fails the connection (the reader's :meth:`set_error` is part of it).
        ready: waits (up to its argument, seconds) for the connected transport.
        cuda_transport: the transport of CUDA payloads for a device (made on first use;
            see :mod:`.payload`).
    """

    def __init__(
        self,
        peer: str,
        fail: Callable[[CommError], None],
        ready: Callable[[float], Transport],
        cuda_transport: CudaTransportOf,
    ):
        self.peer = peer
        self.fail = fail
        self._ready = ready
        #: Takes the payloads of this connection's messages (see :mod:`.payload`).
        self.payloads = Payloads(self, cuda_transport)
        # Held with ``with self._lock`` (a C-level enter, cheaper than the condition's
        # on every message); both conditions wait and notify on it.
        self._lock = lock = threading.RLock()
        self._cond = threading.Condition(lock)
        # Receive ops waiting on ``_cond`` (counted under the lock): a message served to
        # the op that read it wakes nobody, without notify_all's calls (about 0.5 µs).
        self._waiting = 0
        # The receiver thread waits on its own condition (same lock), so that handing
        # messages to receive ops does not wake it each time.
        self._driver_wake = threading.Condition(lock)
        self._state = StreamState(peer)
        self._wake_r, self._wake_w = os.pipe()  # wakes the reading thread out of poll
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    def __repr__(self) -> str:
        return f"Reader({self._state!r})"

    # -- what the state machine says -------------------------------------------------------

    @property
    def lease(self) -> Lease:
        """Who may read the stream now."""
        return self._state.lease

    @property
    def error(self) -> CommError | None:
        """The connection's error, once it failed (the first one)."""
        return self._state.error

    @property
    def transport(self) -> Transport | None:
        """The connected transport (``None``: not attached yet)."""
        return self._state.transport

    @property
    def listener(self) -> Listener | None:
        """The listener that takes every message, if the connection is listened."""
        return self._state.listener

    @property
    def inbox(self) -> Inbox:
        return self._state.inbox

    @property
    def pollable(self) -> bool:
        return self._state.pollable

    def stats(self) -> dict[str, Any]:
        """What a status report shows of the read side: the lease, unread messages and
        bytes, whether it failed."""
        with self._lock:
            state = self._state
            return {"lease": state.lease.value, "unread": len(state.inbox),
                    "unread_bytes": state.inbox.unread, "failed": state.error is not None,
                    "listened": state.listener is not None,
                    "selected": state.selector is not None}

    # -- life cycle ----------------------------------------------------------------------------

    def attach(self, transport: Transport) -> None:
        with self._lock:
            self._execute(self._state.attach(transport, is_pollable(transport)))

    def set_error(self, error: CommError) -> bool:
        """Record the connection's error and wake every waiter. Returns False when it had
        one already (the first error stays)."""
        with self._lock:
            action = self._state.fail(error)
            self._execute(action)
        return action.do is Do.STOP

    @property
    def wake_fd(self) -> int:
        """The read end of the wake pipe (a driver polls it beside the transport)."""
        return self._wake_r

    def _wait_turn(self, timeout: float) -> None:
        """Wait (holding the lock) until a transition wakes the receive ops."""
        self._waiting += 1
        try:
            self._cond.wait(timeout)
        finally:
            self._waiting -= 1

    def _execute(self, action: Action) -> None:
        """Carry out a transition's wake-ups (holding the lock: the conditions need it;
        the pipe writes do not block)."""
        if action.callers and self._waiting:
            self._cond.notify_all()
        if action.driver:
            self._driver_wake.notify()
            selector = self._state.selector
            if selector is not None:
                selector.wake()
        if action.poke and self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"w")
            except BlockingIOError:
                pass  # the pipe is full of wake-ups already
        if action.close_pipe:
            self._close_wake_pipe()

    def _close_wake_pipe(self) -> None:
        if self._wake_w >= 0:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1

    # -- reading a message ---------------------------------------------------------------------

    def read_next(
        self, transport: Transport, within: float | None = None, wake: bool = False,
        small: bool = False,
    ) -> Incoming | Parts | None:
        """As the stream's holder, outside the lock: wait for the next message on a
        pollable transport (up to ``within`` seconds, ``None``: until it comes; ``wake``:
        the wake pipe ends the wait too) and read it. Returns the message for the inbox,
        or ``None``: nothing came, a listener took it, or the read failed (which fails
        the connection: a half-read message breaks the stream). With ``small`` (a plain
        receive op reads), a message that came whole in its frame and that such an op
        takes as it came comes back as its :data:`.incoming.Parts` (:func:`.small_parts`)."""
        try:
            deadline = None if within is None else time.monotonic() + within
            # The next small tensor is made before the wait, not after the message came.
            spare_ahead()
            if self._state.pollable and not transport.poll(  # type: ignore[attr-defined]
                    within, self._wake_r if wake else None):
                if wake:
                    drain(self._wake_r)
                return None
            frame = transport.frame_in_place() if small else None
            if frame is not None:
                parts = small_parts(frame)
                if parts is not None:
                    return parts
            rest = None if deadline is None else deadline - time.monotonic()
            msg = read_message(transport, self.peer, rest, frame)
            if msg.payload is P_OFFERED:
                # A staged payload is copied out now, as a CPU payload is read now, so
                # that the sender's slot comes back without this worker's recv (the
                # message is not queued yet: it is this read's).
                self.payloads.take_in_at_once(msg)
            listener = self._state.listener
            if listener is not None:
                self.payloads.listened(msg, transport)
                listener.deliver(self.peer, msg)
                return None
            return msg
        except CommError as exc:
            self.fail(exc)
        except Exception as exc:  # noqa: BLE001 - a broken read ends the stream, loudly
            logger.exception("receiving from %s failed", self.peer)
            self.fail(PeerLostError(f"receiving from {self.peer} failed: {exc!r}"))
        return None

    def _claim_trailing_offer(self) -> None:
        """The pair's first CUDA message stalls the stream, its offer in the frame right
        behind it: read that offer now, when it is there, so that the message is taken
        in like the others (holding ``cond``)."""
        state = self._state
        if state.lease is not Lease.STALLED or not state.pollable or not state.inbox:
            return
        msg = list(state.inbox)[-1]
        transport = state.transport
        if not (msg.deferred and msg.device) or transport is None:
            return
        if self.payloads.offers_by_ipc() is None:
            return
        try:
            if not transport.poll(0):
                return
            self._execute(state.claim_stall())
            self._execute(state.offer_read(msg, transport.recv_frame(default_timeout())))
        except CommError as exc:
            # Not fail(): it closes the CUDA transport, whose send lock this thread may
            # hold (a waiting send runs this); the stream is marked broken instead.
            self.set_error(exc)
        finally:
            if state.lease is Lease.CLAIMANT:
                self._execute(state.leave(None, time.monotonic(), by_caller=True))

    def take_in_offers(self) -> None:
        """Copy the offered CUDA payloads of queued messages into new tensors now,
        freeing what their sender holds for them (its staging slots, its lent tensors).

        A send that waits for the peer runs this meanwhile: two workers that both send
        CUDA payloads to each other before receiving then both go on, as on the CPU path,
        up to the unread-bytes cap. A payload that cannot be copied now stays offered
        (its receive op raises the reason)."""
        with self._lock:
            self._claim_trailing_offer()
            state = self._state
            inbox = state.inbox
            pending = [m for m in inbox if m.payload is P_OFFERED]
            for msg in pending:
                if inbox.full or state.error is not None:
                    return
                ipc = self.payloads.offers_by_ipc()  # made: the peer offered over it
                if ipc is None:
                    return
                try:
                    tensors = self.payloads.take_in(msg, ipc)
                except CommError:
                    logger.debug("taking in an offer from %s failed", self.peer, exc_info=True)
                    return
                self._execute(state.took_in(
                    msg, tensors, sum(t.numel() * t.element_size() for t in tensors)))

    # -- the driver (the receiver thread, a selector) ---------------------------------------

    def wait_for_stream(self) -> Transport | None:
        """As the receiver thread: wait until the stream is the driver's, then return
        the transport to read (``None``: the stream failed, the thread ends)."""
        with self._lock:
            while True:
                now = time.monotonic()
                action = self._state.driver_take(now)
                if action.do is Do.READ:
                    return self._state.transport
                if action.do is Do.STOP:
                    return None
                until = action.until
                self._driver_wake.wait(None if until is None else max(0.0, until - now))

    def driver_leave(self, msg: Incoming | None) -> None:
        """The driver read ``msg`` (``None``: nothing) and leaves the stream."""
        with self._lock:
            self._execute(self._state.leave(msg, time.monotonic(), by_caller=False))

    def receiver_ended(self) -> None:
        """The receiver thread ends: its wake pipe goes, unless a selector polls it."""
        with self._lock:
            self._execute(self._state.receiver_ended())

    def select_by(self, selector: Wakeable) -> None:
        """Let ``selector`` drive the stream instead of the receiver thread (it keeps to
        that once the transport is known to be pollable; else it lets go)."""
        with self._lock:
            self._execute(self._state.select(selector))

    def selector_take(self, selector: Wakeable) -> Action:
        """As ``selector``: take the stream if it may read now (see
        :meth:`.StreamState.selector_take`: ``READ``, then read :attr:`transport`;
        ``WAIT``: look again within :data:`LINGER`; ``STOP`` or ``LET_GO``: the
        selector is done with this reader)."""
        with self._lock:
            action = self._state.selector_take(selector, time.monotonic())
            self._execute(action)
        return action

    def selector_serve(self, transport: PollableTransport, has_data: bool) -> bool:
        """As the selector holding the stream: read the next message if ``has_data``,
        then leave the stream if the message goes to the inbox or somebody wants it.
        Returns whether it left."""
        msg = self.read_next(transport) if has_data else None  # its poll answers at once
        with self._lock:
            action = self._state.selector_served(msg, time.monotonic())
            self._execute(action)
        return action.do is not Do.READ

    def selector_release(self, selector: Wakeable, holding: bool) -> None:
        """``selector`` (``holding`` the stream or not) ends: the receiver thread reads
        the stream again."""
        with self._lock:
            self._execute(self._state.unselect(selector, holding, time.monotonic()))

    # -- receive ops ---------------------------------------------------------------------------

    def take_ticket(self) -> int:
        with self._lock:
            return self._state.take_ticket()

    def release_ticket(self, ticket: int) -> None:
        """Give up receive ``ticket`` if it was not served (a receive op that failed
        before its turn): later receives then do not wait for it. Idempotent."""
        with self._lock:
            self._execute(self._state.release_ticket(ticket))

    def receive_own(
        self, deadline: float, plain: Callable[[Incoming], bool], small: bool = False,
    ) -> tuple[int, Parts | None]:
        """Take a receive op's ticket and, when the stream is its to read at once (its
        turn, the inbox empty, the stream idle), read its message: its header and
        tensors are returned when ``plain(msg)`` says the op takes it as it is, and the
        op is served then (with ``small``, a message that came whole in its frame and
        that ``plain`` would take is taken without asking: see :meth:`read_next`). Else
        ``None`` with the ticket, for :meth:`receive`: it must wait or ask, nothing came
        by ``deadline``, the read failed, or the message (queued) needs what only the
        general way does. One hold of the lock takes the ticket and the stream, one
        serves the op: a blocking receive in a loop takes no other."""
        state = self._state
        lock = self._lock
        with lock:
            ticket = state.take_ticket()
            if state.listener is not None:  # the general way refuses it
                return ticket, None
            now = time.monotonic()
            action = state.want(now, deadline, ticket)
            if action.do is not _READ:
                self._execute(action)  # a poke, when it asked the driver
                return ticket, None
            transport = state.transport
        msg = None
        try:
            msg = self.read_next(transport, deadline - now, small=small)
        except BaseException:  # interrupted: its turn ends
            with lock:
                self._execute(state.leave(None, time.monotonic(), by_caller=True))
                self._execute(state.failed_op(ticket))
            raise
        with lock:
            if type(msg) is tuple:  # taken whole from its frame: never an Incoming
                self._execute(state.took_own(ticket, now))
                return ticket, msg
            if msg is not None and plain(msg):
                self._execute(state.served_own(msg, ticket, True, now))
                return ticket, (msg.header, msg.tensors)
            self._execute(state.leave(msg, time.monotonic(), by_caller=True))
        return ticket, None

    def receive(
        self,
        ticket: int,
        timeout: float,
        handle: Callable[[Incoming], tuple[bool, Any]],
        what: str,
        deadline: float | None = None,
    ) -> Any:
        """Serve receive ``ticket``: wait for its turn and a message, then ``handle`` it.

        While it is this ticket's turn and the inbox is empty, it reads the message
        itself when the transport allows (the fast path: no thread hop), outside the
        lock. ``handle(msg)`` returns ``(consume, result)``; it raises to refuse the
        message (which then stays queued for the next receive). ``deadline`` (monotonic
        seconds): when the op's ``timeout`` ends, where it began earlier.
        """
        state = self._state
        if state.listener is not None:
            raise RuntimeError(f"{what} from {self.peer}: this connection is listened to")
        if deadline is None:
            deadline = time.monotonic() + timeout
        lock = self._lock
        try:
            while True:
                with lock:
                    now = time.monotonic()
                    action = state.want(now, deadline, ticket)
                    do = action.do
                    if do is _SERVE:
                        consume, result = handle(state.inbox.peek())
                        self._execute(state.served(ticket, consume, now))
                        return result
                    if do is not _READ:
                        if do is Do.FAIL:
                            raise state.error  # type: ignore[misc]
                        if do is Do.TIMEOUT:
                            raise CommTimeoutError(
                                f"{what} from {self.peer}: nothing arrived within {timeout}s")
                        self._execute(action)  # a poke, when it asked the driver
                        self._wait_turn(deadline - now)
                        continue
                    transport = state.transport
                # Its turn, the stream idle: it holds it (CALLER) and reads itself.
                msg = None
                try:
                    msg = self.read_next(transport, deadline - now)
                    if msg is not None:  # its own message, handled before it is ever queued
                        consume, result = handle(msg)
                except BaseException:  # interrupted, or refused: queued
                    with lock:
                        self._execute(state.leave(msg, time.monotonic(), by_caller=True))
                    raise
                with lock:
                    if msg is None:
                        self._execute(state.leave(None, time.monotonic(), by_caller=True))
                        continue
                    self._execute(state.served_own(msg, ticket, consume, now))
                return result
        except BaseException:
            with lock:
                self._execute(state.failed_op(ticket))
            raise

    def read_deferred(
        self, msg: Incoming, read: Callable[[Transport], T], timeout: float, what: str
    ) -> T:
        """Read what follows ``msg`` in the stalled stream (``msg`` was taken by this
        receive op) with ``read(transport)``, as the stream's claimant."""
        with self._lock:
            self._execute(self._state.claim_stall())
        try:
            return read(self._ready(timeout))
        finally:
            with self._lock:
                self._execute(self._state.leave(None, time.monotonic(), by_caller=True))

    # -- listening -------------------------------------------------------------------------------

    def listen(self, listener: Listener) -> None:
        """Hand every message from now on to ``listener`` (see :mod:`.listening`)."""
        with self._lock:
            action = self._state.listen(listener)
            error = self._state.error
        if action.do is Do.FAIL:
            listener.on_error(error)  # type: ignore[arg-type]

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
        state = self._state
        lock = self._lock
        try:
            while not fut.done():
                with lock:
                    now = time.monotonic()
                    action = state.want(now, deadline, pumper=me)
                    if action.do is Do.TIMEOUT:
                        return False
                    if action.do is not _READ:
                        self._execute(action)  # a poke, when it asked the driver
                        self._wait_turn(deadline - now)
                        continue
                    transport = state.transport
                msg = None
                try:  # as the caller: the message goes to the listener on this thread
                    msg = self.read_next(transport, deadline - now, wake=True)
                finally:
                    with lock:
                        self._execute(state.leave(msg, time.monotonic(), by_caller=True))
            return True
        finally:
            give_back = hand_back()
            with lock:
                self._execute(state.pump_done(me, give_back))

    def _wake_pumper(self, pumper: int) -> None:
        """``pumper``'s future got done on another thread: end its wait."""
        if threading.get_ident() == pumper:
            return
        with self._lock:
            self._execute(self._state.wake_pumper(pumper))


# The steps a receive op compares on every message, as private names (an enum member's
# lookup costs about 60 ns on Python 3.11; ``bench_p2p.py``'s 4 B rows).
_SERVE, _READ = Do.SERVE, Do.READ
