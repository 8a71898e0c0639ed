"""``StreamState``: the read side of one connection, as a pure state machine.

Who reads the stream now, which receive op is served next, what waits in the inbox, which
receive ops asked the driver for the stream, the transport, the listener that takes every
message, the selector that drives the stream, and whether the stream failed: one object
owns all of it and changes it only through the transitions below. It has no threads, no
file descriptors and no clock: a transition that depends on time takes ``now`` (monotonic
seconds), and every transition answers with one :class:`Action`, which its driver carries
out: the step it takes next (:class:`Do`) and whom it wakes. The drivers
(:class:`~.reader.Reader` for receive ops and pumps, :mod:`.receiver`'s thread, a
:class:`~rlcomm.comm.connection.selector.Selector`) do the I/O, and hold the connection's
lock only around a transition and the wake-ups it asks for.

The *lease* says who may read the stream:

| lease | who reads | taken by | left for |
| --- | --- | --- | --- |
| ``IDLE`` | nobody | the driver (:meth:`driver_take`, :meth:`selector_take`), a receive op or pump whose turn it is (:meth:`want`) | |
| ``DRIVER`` | the receiver thread or the selector | :meth:`driver_take` or :meth:`selector_take` when nobody asked for the stream (a receive op that read, or was served with none waiting, leaves it to ops for :data:`LINGER` s) and the inbox is under its cap | :meth:`leave` or :meth:`selector_served`: ``IDLE``, or ``STALLED`` |
| ``CALLER`` | a receive op or a pump, reading its own message | :meth:`want` on a pollable transport | :meth:`leave`, :meth:`served_own`: ``IDLE``, or ``STALLED`` |
| ``STALLED`` | nobody: the payload of the last message read follows it in the stream | :meth:`leave` of a deferred message | :meth:`claim_stall` by that message's receive op |
| ``CLAIMANT`` | the receive op reading that payload | :meth:`claim_stall` | :meth:`leave`: ``IDLE`` |

Receive ops are served in call order: each takes a ticket (:meth:`take_ticket`) and is
served when its ticket's turn comes and a message is at the inbox's head. An op that
gives up before its turn abandons its ticket; later ones do not wait for it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from rlcomm.comm.connection.inbox import Inbox
from rlcomm.comm.connection.incoming import Incoming, Payload
from rlcomm.errors import CommError

#: Seconds the driver leaves the stream to receive ops after one of them read.
LINGER = 0.005


class Lease(enum.Enum):
    """Who may read the stream now (see the module docstring's table)."""

    IDLE = "idle"
    DRIVER = "driver"
    CALLER = "caller"
    STALLED = "stalled"
    CLAIMANT = "claimant"


class Do(enum.Enum):
    """The step a transition's caller takes next (:attr:`Action.do`)."""

    GO_ON = "go_on"  # nothing but the wake-ups: carry on
    SERVE = "serve"  # (a receive op) its message is at the inbox's head: handle it
    FAIL = "fail"  # (a receive op, a listener) the stream failed: take its error
    TIMEOUT = "timeout"  # (a receive op, a pump) its deadline has passed
    READ = "read"  # it holds the stream now: read one message
    WAIT = "wait"  # wait to be woken, or until ``until`` (``None``: its own deadline, or
    # for a driver: until woken)
    STOP = "stop"  # (a driver) the stream failed, or is not this driver's: stop driving it
    LET_GO = "let_go"  # (a selector) the transport cannot be polled: its thread drives it


@dataclass(frozen=True, slots=True)
class Action:
    """What a transition's caller does: the step (:class:`Do`) and the wake-ups.

    Attributes:
        do: the next step.
        callers: wake the receive ops and pumps waiting for a turn.
        driver: wake the driver (the receiver thread's wait, and the selector, if any).
        poke: write the wake pipe: the thread waiting in ``poll`` on the transport (the
            driver, or a pump) stops waiting.
        close_pipe: nobody polls the wake pipe any more: close it.
        until: for ``WAIT``, when to look again (``None``: see :class:`Do`).
    """

    do: Do = Do.GO_ON
    callers: bool = False
    driver: bool = False
    poke: bool = False
    close_pipe: bool = False
    until: float | None = None


# The answers that do not depend on ``now``, made once: a message's path takes several
# transitions, and a frozen dataclass costs about a microsecond to make.
NOTHING = Action()
_CALLERS = Action(callers=True)
_DRIVER = Action(driver=True)
_EVERYONE = Action(callers=True, driver=True)
_SERVE = Action(Do.SERVE)
_FAIL = Action(Do.FAIL)
_TIMEOUT = Action(Do.TIMEOUT)
_READ = Action(Do.READ)
_WAIT = Action(Do.WAIT)
_ASK = Action(Do.WAIT, poke=True)  # poke the driver out of its poll (it leaves), then wait
_STOP = Action(Do.STOP)
_KEEP = Action(Do.READ)  # a selector keeps the stream it holds

# Private spellings of the leases, for the transitions every message takes (an enum
# member's lookup costs about 60 ns on Python 3.11; ``bench_p2p.py``'s 4 B rows).
_IDLE, _DRIVER_LEASE, _CALLER = Lease.IDLE, Lease.DRIVER, Lease.CALLER
_STALLED, _CLAIMANT = Lease.STALLED, Lease.CLAIMANT
_IN_STREAM = Payload.IN_STREAM


class StreamState:
    """The read side of one connection (see the module docstring).

    Args:
        peer: the peer's address, for ``repr``.
        max_unread: the inbox's cap in bytes (default: the ``max_unread_bytes`` setting).
        linger: seconds the driver leaves the stream to receive ops after one read.
    """

    def __init__(self, peer: str, max_unread: int | None = None, linger: float = LINGER):
        self.peer = peer
        self.inbox = Inbox(max_unread)
        self.linger = linger
        self.lease = _IDLE
        self.error: CommError | None = None
        #: The connected transport (``None``: not attached yet); opaque here.
        self.transport: Any = None
        self.pollable = False
        #: The selector that drives the stream instead of the receiver thread, if any.
        self.selector: Any = None
        #: The listener that takes every message, if any.
        self.listener: Any = None
        self.pumper: int | None = None  # the thread id of a pump reading as the caller
        # The receive ops (tickets) and pumps (("pump", thread id)) that asked the driver
        # to leave the stream: it does not take the stream again while any of them waits.
        self._asked: set[Any] = set()
        self._last_read = float("-inf")  # when a receive op last read or was served
        self._next_ticket = 0
        self._serving = 0
        self._abandoned: set[int] = set()

    def __repr__(self) -> str:
        return (
            f"StreamState({self.peer!r}, {self.lease.value}"
            f"{', failed' if self.error is not None else ''}"
            f"{', selected' if self.selector is not None else ''}"
            f"{', listened' if self.listener is not None else ''}, "
            f"inbox={len(self.inbox)}/{self.inbox.unread}B, serving={self._serving}, "
            f"tickets={self._next_ticket}, asked={len(self._asked)})"
        )

    @property
    def wanting(self) -> int:
        """How many receive ops and pumps asked the driver for the stream."""
        return len(self._asked)

    # -- life cycle -------------------------------------------------------------------------

    def attach(self, transport: Any, pollable: bool) -> Action:
        """The transport is connected (``pollable``: a receive op may read itself)."""
        self.transport, self.pollable = transport, pollable
        return _DRIVER if self.selector is not None else NOTHING

    def fail(self, error: CommError) -> Action:
        """Record the stream's error (the first stays). ``STOP`` when it was the first
        (every waiter and the driver are woken; the connection ends), else nothing."""
        if self.error is not None:
            return NOTHING
        self.error = error
        return Action(Do.STOP, callers=True, driver=True, close_pipe=self.transport is None)

    @property
    def in_use(self) -> bool:
        """Whether receive ops or messages have used the stream (it cannot be listened)."""
        return bool(self.inbox) or self._next_ticket > 0

    def listen(self, listener: Any) -> Action:
        """From now on ``listener`` takes every message. ``FAIL`` when the stream failed
        already (the listener is told its error).

        Raises:
            RuntimeError: a listener or receive ops use the stream already.
        """
        if self.listener is not None or self.in_use:
            raise RuntimeError(f"{self.peer}: the connection is already in use")
        self.listener = listener
        return _FAIL if self.error is not None else NOTHING

    # -- the driver ----------------------------------------------------------------------------

    def _driver_may_read(self, now: float) -> bool:
        if self.lease is not _IDLE or self.inbox.full:
            return False
        return not self.pollable or (not self._asked and now - self._last_read >= self.linger)

    def driver_take(self, now: float) -> Action:
        """The receiver thread asks for the stream: ``READ`` when it holds it now
        (``DRIVER``); ``WAIT`` (``until``: look again then, ``None``: when woken);
        ``STOP`` when the stream failed."""
        if self.error is not None:
            return _STOP
        if self.selector is not None and self.pollable:
            return _WAIT  # the selector drives it
        if not self._driver_may_read(now):
            return Action(Do.WAIT, until=now + self.linger) if self.pollable else _WAIT
        self.lease = _DRIVER_LEASE
        return _READ

    def receiver_ended(self) -> Action:
        """The receiver thread ends: its wake pipe goes, unless a selector polls it."""
        return NOTHING if self.selector is not None else Action(close_pipe=True)

    def select(self, selector: Any) -> Action:
        """``selector`` drives the stream from now on: it is woken, and the receiver thread
        is poked out of its poll when it holds the stream (it leaves it then)."""
        self.selector = selector
        return Action(driver=True, poke=self.lease is _DRIVER_LEASE)

    def selector_take(self, selector: Any, now: float) -> Action:
        """``selector`` asks for the stream: ``READ`` when it holds it now; ``WAIT`` when
        it must look again within the linger time; ``STOP`` when it is done with the
        stream (it failed, or another selector drives it); ``LET_GO`` when the transport
        cannot be polled (the receiver thread, woken, drives it)."""
        if self.selector is not selector:
            return _STOP
        if self.error is not None:
            self.selector = None  # its receiver thread left the wake pipe to it
            return Action(Do.STOP, close_pipe=True)
        if self.transport is None:
            return _WAIT
        if not self.pollable:
            self.selector = None
            return Action(Do.LET_GO, driver=True)
        if not self._driver_may_read(now):
            return Action(Do.WAIT, until=now + self.linger)
        self.lease = _DRIVER_LEASE
        return _READ

    def selector_served(self, msg: Incoming | None, now: float) -> Action:
        """The selector holding the stream read ``msg`` (``None``: nothing, or a listener
        took it). ``READ`` when it keeps the stream (it dispatched nothing to the inbox
        and nobody wants the stream), else what :meth:`leave` says."""
        if (msg is None and not self._asked and self.error is None
                and self.selector is not None and self.lease is _DRIVER_LEASE):
            return _KEEP
        return self.leave(msg, now, by_caller=False)

    def unselect(self, selector: Any, holding: bool, now: float) -> Action:
        """``selector`` (``holding`` the stream or not) lets go: the receiver thread reads
        the stream again."""
        if self.selector is not selector:
            return NOTHING
        self.selector = None
        left = self.leave(None, now, by_caller=False) if holding else NOTHING
        return Action(callers=left.callers, driver=True, close_pipe=self.error is not None)

    # -- leaving the stream --------------------------------------------------------------------

    def leave(self, msg: Incoming | None, now: float, by_caller: bool) -> Action:
        """The holder read ``msg`` (queued; ``None``: nothing, or a listener took it) and
        leaves the stream: ``STALLED`` when its payload follows it, else ``IDLE``."""
        if msg is not None:
            self.inbox.put(msg)
        stall_ends = self.lease is _CLAIMANT
        self.lease = _STALLED if msg is not None and msg.payload is _IN_STREAM else _IDLE
        if by_caller:
            self._last_read = now
            self.pumper = None
        # A receiver thread blocked on its turn reads on once a stall ends; on a
        # pollable transport it looks again within the linger time anyway.
        return _EVERYONE if stall_ends and not self.pollable else _CALLERS

    def claim_stall(self) -> Action:
        """The receive op that took a deferred message reads its payload (``CLAIMANT``).

        Raises:
            RuntimeError: the stream is not stalled on a message.
        """
        if self.lease is not _STALLED:
            raise RuntimeError(f"{self.peer}: the stream is not stalled on this message")
        self.lease = _CLAIMANT
        return NOTHING

    def offer_read(self, msg: Incoming, offer: bytes) -> Action:
        """The claimant read the offer that followed ``msg`` (queued, deferred) in the
        stream: the message's payload is offered now."""
        msg.offered(offer)
        return NOTHING

    def took_in(self, msg: Incoming, tensors: list, nbytes: int) -> Action:
        """``msg``, queued, had its offered payload copied into ``tensors`` (``nbytes``
        more held while it is unread)."""
        msg.taken(tensors)
        self.inbox.grew(msg, nbytes)
        return NOTHING

    # -- receive ops and pumps -------------------------------------------------------------------

    def take_ticket(self) -> int:
        """A receive op's place in line (the number :meth:`want` and the rest take)."""
        ticket = self._next_ticket
        self._next_ticket += 1
        return ticket

    def _skip_abandoned(self) -> None:
        while self._serving in self._abandoned:
            self._abandoned.discard(self._serving)
            self._serving += 1

    def release_ticket(self, ticket: int) -> Action:
        """Give up ``ticket`` if it was not served (its op failed before its turn).
        Idempotent. Wakes the waiters when that moved the line on."""
        if ticket < self._serving or ticket in self._abandoned:
            return NOTHING
        self._abandoned.add(ticket)
        self._skip_abandoned()
        return _CALLERS

    def want(
        self, now: float, deadline: float, ticket: int | None = None, pumper: int | None = None,
    ) -> Action:
        """What the receive op holding ``ticket`` (or, without one, a pump: thread id
        ``pumper``) does next: ``SERVE``, ``FAIL``, ``TIMEOUT``, ``READ`` (it holds the
        stream: ``CALLER``), or ``WAIT`` until its deadline, with a poke when it asks the
        driver to leave the stream (once: the ask stands until the op ends)."""
        if ticket is not None:
            if self._abandoned:
                self._skip_abandoned()
            my_turn = self._serving == ticket
            if my_turn and self.inbox:
                return _SERVE
            if my_turn and self.error is not None:
                return _FAIL
            if now >= deadline:
                return _TIMEOUT
            if not my_turn:
                return _WAIT
            key: Any = ticket
        else:
            if now >= deadline:
                return _TIMEOUT
            key = ("pump", pumper)
        if self.error is None and self.pollable and self.transport is not None:
            if self.lease is _IDLE:
                self.lease = _CALLER
                self.pumper = pumper
                return _READ
            if self.lease is _DRIVER_LEASE and key not in self._asked:
                self._asked.add(key)
                return _ASK
        return _WAIT

    def served(self, ticket: int, consumed: bool, now: float) -> Action:
        """``ticket``'s op handled the message at the inbox's head (``consumed``: took it
        out) at ``now``. The next ticket's turn begins.

        When no other receive op waits, one served keeps the driver off the stream for
        the linger time, as one that read does: a caller receiving in a loop then reads
        on itself once the inbox is empty, instead of sharing every message with the
        driver's thread (and the process's GIL). Receive ops queued behind it (async
        ones) are fed by the driver reading ahead."""
        room = consumed and self.inbox.take()  # below the cap again: the driver reads on
        if ticket >= self._serving:
            self._serving = ticket + 1
        if self._next_ticket <= self._serving:
            self._last_read = now
        if self._asked:
            self._asked.discard(ticket)
        return _EVERYONE if room else _CALLERS

    def served_own(self, msg: Incoming, ticket: int, consumed: bool, now: float) -> Action:
        """``ticket``'s op, holding the stream (``CALLER``) on its turn with the inbox
        empty, read ``msg`` and handled it at ``now`` (``consumed``: took it; else it
        stays queued): :meth:`leave` and :meth:`served` in one, the message never
        queued. The next ticket's turn begins."""
        if not consumed:
            self.inbox.put(msg)
        action = self.took_own(ticket, now)
        if msg.payload is _IN_STREAM:
            self.lease = _STALLED
        return action

    def took_own(self, ticket: int, now: float) -> Action:
        """``ticket``'s op, holding the stream (``CALLER``) on its turn with the inbox
        empty, read a message at ``now`` and took it: :meth:`served_own` of one that
        nothing follows in the stream. The next ticket's turn begins."""
        self.lease = _IDLE
        self._last_read = now
        self.pumper = None
        if ticket >= self._serving:
            self._serving = ticket + 1
        if self._asked:
            self._asked.discard(ticket)
        return _CALLERS

    def failed_op(self, ticket: int) -> Action:
        """``ticket``'s op raised: its turn ends (or, not its turn yet, it is skipped)."""
        if self._serving == ticket:
            self._serving += 1
        else:
            self._abandoned.add(ticket)
        self._asked.discard(ticket)
        return _CALLERS

    def wake_pumper(self, pumper: int) -> Action:
        """The future ``pumper`` waits for got done on another thread: poked out of its
        poll when it reads as the caller now, woken when it waits for a turn."""
        return Action(callers=True, poke=self.pumper == pumper)

    def pump_done(self, pumper: int, hand_back: bool) -> Action:
        """``pumper`` stops pumping; ``hand_back``: no other reply is awaited, so the
        driver may read at once."""
        self._asked.discard(("pump", pumper))
        if not hand_back:
            return NOTHING
        self._last_read = float("-inf")
        return _DRIVER
