"""``StreamState``: the read side of one connection, as a pure state machine.

Who reads the stream now, which receive op is served next, what waits in the inbox,
whether a listener takes every message, and whether the stream failed: one object owns
all of it and changes it only through the transitions below. It has no threads, no file
descriptors and no clock: a transition that depends on time takes ``now`` (monotonic
seconds), and each returns what its driver does next. The drivers
(:class:`~.reader.Reader` for receive ops and pumps, :mod:`.receiver`'s thread, a
:class:`~rlcomm.comm.connection.selector.Selector`) do the I/O and hold the connection's lock only
around calls into it.

The *lease* says who may read the stream:

| lease | who reads | taken by | left for |
| --- | --- | --- | --- |
| ``IDLE`` | nobody | the driver (:meth:`driver_take`), a receive op or pump whose turn it is (:meth:`want`) | |
| ``DRIVER`` | the receiver thread or the selector | :meth:`driver_take` when nobody asked for the stream (a receive op that read, or was served with none waiting, leaves it to ops for :data:`LINGER` s) and the inbox is under its cap | :meth:`leave`: ``IDLE``, or ``STALLED`` |
| ``CALLER`` | a receive op or a pump, reading its own message | :meth:`want` on a pollable transport | :meth:`leave`: ``IDLE``, or ``STALLED`` |
| ``STALLED`` | nobody: the payload of the last message read follows it in the stream | :meth:`leave` of a deferred message | :meth:`claim_stall` by that message's receive op |
| ``CLAIMANT`` | the receive op reading that payload | :meth:`claim_stall` | :meth:`leave`: ``IDLE`` |

Receive ops are served in call order: each takes a ticket (:meth:`take_ticket`) and is
served when its ticket's turn comes and a message is at the inbox's head. An op that
gives up before its turn abandons its ticket; later ones do not wait for it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from rlcomm.comm.connection.inbox import Inbox
from rlcomm.comm.connection.incoming import P_IN_STREAM, Incoming
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


class Turn(enum.Enum):
    """What a receive op or a pump does next (:meth:`StreamState.want`)."""

    SERVE = "serve"  # its message is at the inbox's head: handle it
    FAIL = "fail"  # the stream failed: raise its error
    TIMEOUT = "timeout"  # its deadline has passed
    READ = "read"  # it holds the stream (CALLER): read one message itself
    ASK = "ask"  # poke the driver out of its poll (it leaves the stream), then wait
    WAIT = "wait"  # wait to be woken, until its deadline


class DriverTurn(enum.Enum):
    """What the driver does next (:meth:`StreamState.driver_take`)."""

    READ = "read"  # it holds the stream (DRIVER): read a message
    LATER = "later"  # look again when woken (or at ``until``)
    STOP = "stop"  # the stream failed: stop driving it
    LET_GO = "let_go"  # (a selector) the transport cannot be polled: its thread drives it

# The members as module constants: a message's path compares leases and turns a dozen
# times, and an enum member's lookup (``Lease.IDLE``) costs about 60 ns on Python 3.11.
L_IDLE, L_DRIVER, L_CALLER = Lease.IDLE, Lease.DRIVER, Lease.CALLER
L_STALLED, L_CLAIMANT = Lease.STALLED, Lease.CLAIMANT
T_SERVE, T_FAIL, T_TIMEOUT, T_READ, T_ASK, T_WAIT = (
    Turn.SERVE, Turn.FAIL, Turn.TIMEOUT, Turn.READ, Turn.ASK, Turn.WAIT)
D_READ, D_LATER, D_STOP, D_LET_GO = (
    DriverTurn.READ, DriverTurn.LATER, DriverTurn.STOP, DriverTurn.LET_GO)


@dataclass(frozen=True)
class Wakes:
    """Whom a transition's driver wakes: the waiting receive ops, the driver."""

    callers: bool = True
    driver: bool = False


NOBODY = Wakes(False, False)
#: The four answers, made once (a transition runs for every message): ``_WAKES[callers][driver]``.
EVERYONE = Wakes(True, True)
_CALLERS = Wakes(True, False)
_WAKES = ((NOBODY, Wakes(False, True)), (_CALLERS, EVERYONE))


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
        self.lease = L_IDLE
        self.error: CommError | None = None
        self.attached = False
        self.pollable = False
        self.selected = False  # a selector drives, not the receiver thread
        self.listened = False
        self.wanting = 0  # receive ops that asked the driver to leave the stream
        self.pumper: int | None = None  # the thread id of a pump reading as the caller
        self._last_read = float("-inf")  # when a receive op last read or was served
        self._next_ticket = 0
        self._serving = 0
        self._abandoned: set[int] = set()

    def __repr__(self) -> str:
        return (
            f"StreamState({self.peer!r}, {self.lease.value}"
            f"{', failed' if self.error is not None else ''}"
            f"{', selected' if self.selected else ''}{', listened' if self.listened else ''}, "
            f"inbox={len(self.inbox)}/{self.inbox.unread}B, serving={self._serving}, "
            f"tickets={self._next_ticket}, wanting={self.wanting})"
        )

    # -- life cycle -------------------------------------------------------------------------

    def attach(self, pollable: bool) -> None:
        """The transport is connected (``pollable``: a receive op may read itself)."""
        self.attached, self.pollable = True, pollable

    def fail(self, error: CommError) -> bool:
        """Record the stream's error (the first stays). Returns whether it was the first:
        every waiter and the driver must then be woken."""
        if self.error is not None:
            return False
        self.error = error
        return True

    @property
    def in_use(self) -> bool:
        """Whether receive ops or messages have used the stream (it cannot be listened)."""
        return bool(self.inbox) or self._next_ticket > 0

    def listen(self) -> None:
        """From now on a listener takes every message.

        Raises:
            RuntimeError: a listener or receive ops use the stream already.
        """
        if self.listened or self.in_use:
            raise RuntimeError(f"{self.peer}: the connection is already in use")
        self.listened = True

    # -- the driver ----------------------------------------------------------------------------

    def _driver_may_read(self, now: float) -> bool:
        if self.lease is not L_IDLE or self.inbox.full:
            return False
        return not self.pollable or (
            self.wanting == 0 and now - self._last_read >= self.linger
        )

    def driver_take(self, now: float, selector: bool = False) -> tuple[DriverTurn, float | None]:
        """The driver (the receiver thread, or with ``selector`` a selector) asks for the
        stream. Returns ``(READ, None)`` when it holds it now (``DRIVER``); ``(LATER,
        until)`` when it must wait (``until``: look again then, ``None``: when woken);
        ``(STOP, None)`` when the stream failed; ``(LET_GO, None)`` when a selector must
        hand an unpollable stream back to the receiver thread. A selector told ``STOP``
        or ``LET_GO`` no longer drives the stream."""
        if self.error is not None:
            if selector:
                self.selected = False  # the selector is done with it
            return D_STOP, None
        if selector:
            if not self.attached:
                return D_LATER, None
            if not self.pollable:
                self.selected = False
                return D_LET_GO, None
        elif self.selected and self.pollable:
            return D_LATER, None  # the selector drives it
        if not self._driver_may_read(now):
            linger = self.pollable and not self.selected
            return D_LATER, (now + self.linger) if linger or selector else None
        self.lease = L_DRIVER
        return D_READ, None

    def driver_keeps(self, read: bool) -> bool:
        """A selector holding the stream dispatched a message (``read``) or found none:
        whether it keeps the stream (nobody wants it), or must :meth:`leave` it."""
        return (
            not read and self.wanting == 0 and self.error is None and self.selected
            and self.lease is L_DRIVER
        )

    def select(self) -> bool:
        """A selector drives the stream from now on. Returns whether the receiver thread
        holds it in poll now (poke it: it leaves the stream)."""
        self.selected = True
        return self.lease is L_DRIVER

    def unselect(self, holding: bool, now: float) -> Wakes:
        """The selector lets go (``holding``: it held the stream, which it leaves)."""
        self.selected = False
        wakes = self.leave(None, now, by_caller=False) if holding else NOBODY
        return _WAKES[wakes.callers][True]

    # -- leaving the stream --------------------------------------------------------------------

    def leave(self, msg: Incoming | None, now: float, by_caller: bool) -> Wakes:
        """The holder read ``msg`` (queued; ``None``: nothing, or a listener took it) and
        leaves the stream: ``STALLED`` when its payload follows it, else ``IDLE``."""
        if msg is not None:
            self.inbox.put(msg)
        stall_ends = self.lease is L_CLAIMANT
        self.lease = L_STALLED if msg is not None and msg.deferred else L_IDLE
        if by_caller:
            self._last_read = now
            self.pumper = None
        # A receiver thread blocked on its turn reads on once a stall ends; on a
        # pollable transport it looks again within the linger time anyway.
        return _WAKES[True][stall_ends and not self.pollable]

    def claim_stall(self) -> None:
        """The receive op that took a deferred message reads its payload (``CLAIMANT``).

        Raises:
            RuntimeError: the stream is not stalled on a message.
        """
        if self.lease is not L_STALLED:
            raise RuntimeError(f"{self.peer}: the stream is not stalled on this message")
        self.lease = L_CLAIMANT

    def hand_back(self) -> Wakes:
        """A pump is done and no reply is awaited: the driver may read at once."""
        self._last_read = float("-inf")
        return _WAKES[False][True]

    # -- receive ops -----------------------------------------------------------------------------

    def take_ticket(self) -> int:
        ticket = self._next_ticket
        self._next_ticket += 1
        return ticket

    def _skip_abandoned(self) -> None:
        while self._serving in self._abandoned:
            self._abandoned.discard(self._serving)
            self._serving += 1

    def release_ticket(self, ticket: int) -> bool:
        """Give up ``ticket`` if it was not served (its op failed before its turn).
        Idempotent. Returns whether waiters must be woken."""
        if ticket < self._serving or ticket in self._abandoned:
            return False
        self._abandoned.add(ticket)
        self._skip_abandoned()
        return True

    def want(
        self, now: float, deadline: float, asked: bool, ticket: int | None = None,
        pumper: int | None = None,
    ) -> tuple[Turn, bool]:
        """What the receive op holding ``ticket`` (or, without one, a pump: thread id
        ``pumper``) does next; ``asked``: it asked the driver already. Returns the turn
        and whether it has asked now (it then calls :meth:`unask` when done)."""
        if ticket is not None:
            if self._abandoned:
                self._skip_abandoned()
            my_turn = self._serving == ticket
            if my_turn and self.inbox:
                return T_SERVE, asked
            if my_turn and self.error is not None:
                return T_FAIL, asked
            if now >= deadline:
                return T_TIMEOUT, asked
            if not my_turn:
                return T_WAIT, asked
        elif now >= deadline:
            return T_TIMEOUT, asked
        if self.error is None and self.attached and self.pollable:
            if self.lease is L_IDLE:
                self.lease = L_CALLER
                self.pumper = pumper
                return T_READ, asked
            if self.lease is L_DRIVER and not asked:
                self.wanting += 1
                return T_ASK, True
        return T_WAIT, asked

    def unask(self) -> None:
        self.wanting -= 1

    def served(self, ticket: int, consumed: bool, now: float) -> Wakes:
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
        return EVERYONE if room else _CALLERS

    def served_own(self, msg: Incoming, ticket: int, consumed: bool, now: float) -> Wakes:
        """``ticket``'s op, holding the stream (``CALLER``) on its turn with the inbox
        empty, read ``msg`` and handled it at ``now`` (``consumed``: took it; else it
        stays queued): :meth:`leave` and :meth:`served` in one, the message never
        queued. The next ticket's turn begins."""
        if not consumed:
            self.inbox.put(msg)
        self.lease = L_STALLED if msg.payload is P_IN_STREAM else L_IDLE
        self._last_read = now
        self.pumper = None
        if ticket >= self._serving:
            self._serving = ticket + 1
        return _CALLERS

    def failed_op(self, ticket: int) -> None:
        """``ticket``'s op raised: its turn ends (or, not its turn yet, it is skipped)."""
        if self._serving == ticket:
            self._serving += 1
        else:
            self._abandoned.add(ticket)
