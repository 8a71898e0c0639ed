"""Waiting for incoming data on shared-memory transports: spin a moment, then sleep.

One wait may watch several transports at once (:func:`wait_for_data`), so one thread
can serve many same-node peers (:class:`~rlcomm.comm.connection.selector.Selector`) instead of one
waiting thread per peer.

A waiter first checks the rings for a moment, yielding the CPU between looks
(:class:`Spin`). It then sets the *sleeping* flag of each ring and sleeps in ``poll`` on
their signalling sockets: a sender writes a wake-up token only while that flag is set.
x86 may let a sender read the flag before its data is visible here while this side reads
the ring before its flag is visible there, so both could miss each other: the first sleep
is therefore :data:`RECHECK` short; after it the flag is surely visible to the sender,
and data that raced with it is visible here.
"""

from __future__ import annotations

import os
import select
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from rlcomm.errors import PeerLostError
from rlcomm.settings import get_settings


class ShmTransport(Protocol):
    """What a wait needs of a shared-memory transport (:mod:`.shm` has the one)."""

    def available(self) -> int: ...
    def signal_fd(self) -> int: ...
    def poller(self, wake_fd: int | None) -> select.poll: ...
    def read_signal(self) -> None: ...
    def set_sleeping(self, sleeping: bool) -> None: ...
    def mark_lost(self) -> None: ...

#: Most seconds a waiter checks the rings before it sleeps (``RLCOMM_SHM_SPIN_US``;
#: 0 turns spinning off).
SPIN_SECONDS = get_settings().shm_spin_us / 1e6
#: A waiter's first sleep is this short (seconds); see the module docstring.
RECHECK = 0.001


class Spin:
    """The spinning part of a wait, with its adaptive length.

    A reply often comes within microseconds, and spinning beats sleeping and being woken
    (tens of microseconds and two syscalls). The spin doubles after data came while
    spinning and halves (down to an eighth) after it did not, so a quiet stream wastes
    little; data that came during the sleep, but within the longest spin of the wait's
    start, sets it back to the longest (:meth:`slept`): a peer that answers in 50-200 µs
    (a 64 KiB message) would otherwise be slept on and woken every time, once a spin ran
    out.
    """

    def __init__(self) -> None:
        self.seconds = SPIN_SECONDS
        self.began = 0.0  # when the last spin began (monotonic seconds)

    def until(self, ready: Callable[[], int], deadline: float | None) -> bool:
        """Look at ``ready()`` until it is true or the spin (or ``deadline``) ends."""
        if self.seconds <= 0:
            return False
        self.began = now = time.monotonic()
        end = now + self.seconds if deadline is None else min(now + self.seconds, deadline)
        while not ready() and time.monotonic() < end:
            os.sched_yield()
        if ready():
            self.seconds = min(SPIN_SECONDS, self.seconds * 2)
            return True
        self.seconds = max(SPIN_SECONDS / 8, self.seconds / 2)
        return False

    def slept(self) -> None:
        """Data came during the sleep that followed a spin: had it come within the
        longest spin of the wait's start, spin that long again."""
        if SPIN_SECONDS > 0 and time.monotonic() - self.began <= SPIN_SECONDS:
            self.seconds = SPIN_SECONDS


def _any_ready(transports: Sequence[ShmTransport]) -> Callable[[], int]:
    if len(transports) == 1:
        return transports[0].available
    return lambda: any(t.available() for t in transports)


def wait_for_data(
    transports: Sequence[ShmTransport],
    deadline: float | None,
    wake_fds: Sequence[int],
    spin: Spin,
    mark_lost: bool = False,
) -> bool:
    """Wait until one of ``transports`` has incoming data (True), or until ``deadline`` or
    one of ``wake_fds`` becomes readable (False; the fd is not read).

    Raises:
        PeerLostError: a peer's signalling socket broke. With several transports, or
            with ``mark_lost`` (a selector's wait), the broken one is marked lost
            instead (its next receive raises at once) and True is returned, so the
            caller goes on to read it.
    """
    ready = _any_ready(transports)
    if ready() or spin.until(ready, deadline):
        return True
    by_fd = {t.signal_fd(): t for t in transports}
    if len(transports) == 1 and len(wake_fds) <= 1:  # a transport's own wait: cached
        poller = transports[0].poller(wake_fds[0] if wake_fds else None)
    else:
        poller = select.poll()  # not select.select: Ray processes have fds past 1024
        for fd in (*by_fd, *wake_fds):
            poller.register(fd, select.POLLIN)
    for t in transports:
        t.set_sleeping(True)
    try:
        recheck = True
        while not ready():
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            wait = remaining
            if recheck:
                wait = RECHECK if remaining is None else min(remaining, RECHECK)
            events = poller.poll(None if wait is None else wait * 1000)
            if not events:
                recheck = False
            woken = False
            for fd, _ in events:
                t = by_fd.get(fd)
                if t is None:
                    woken = True
                    continue
                try:
                    t.read_signal()
                except PeerLostError:
                    if len(transports) == 1 and not mark_lost:
                        raise
                    t.mark_lost()
                    return True
            if woken:
                return bool(ready())
        spin.slept()
        return True
    finally:
        for t in transports:
            t.set_sleeping(False)


class ShmWaiter:
    """One thread's wait on many shared-memory transports at once (a selector's): one
    spin over all their rings, then one ``poll`` of all their sockets. A transport whose
    peer is seen gone is marked lost, and the wait returns so that it is read (and
    raises)."""

    def __init__(self) -> None:
        self._spin = Spin()

    def wait(
        self, transports: Sequence[ShmTransport], deadline: float | None,
        wake_fds: Sequence[int],
    ) -> bool:
        return wait_for_data(transports, deadline, wake_fds, self._spin, mark_lost=True)
