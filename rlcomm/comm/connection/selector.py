"""``Selector``: one thread that reads many connections.

By default every connection has a receiver thread of its own. A process that serves many
peers (a channel worker with one connection per client process) would then have as many
threads waiting, and on shared memory each waiting thread spins a moment before it
sleeps: with few cores, spinners crowd out the threads doing the work. A selector reads
a set of connections on one thread instead: it takes each connection's receiving role
(as the receiver thread would, see :mod:`~rlcomm.comm.connection.reader`), waits for data
on all their transports at once (a :class:`~rlcomm.comm.transports.base.PollableTransport`'s
waiter: for shared memory one spin over all rings, one ``poll``), and reads whichever
has a message, handing it to the connection's listener (or inbox). It waits on
transports of one kind: the first pollable one it takes sets the kind; a connection of
another kind goes back to its receiver thread.

A receive op or pump that wants a selected connection's role asks for it as it would
ask the receiver thread (the connection's wake pipe, which the selector polls too), and
the selector takes it back once that op is done. A connection whose transport cannot be
polled (Gloo, across nodes) stays with its receiver thread.

The selector owns its thread. Handlers run on it: a handler that blocks holds up every
connection of the selector.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from typing import TYPE_CHECKING

from rlcomm.comm.connection.reader import LINGER, Reader, drain
from rlcomm.comm.connection.stream import Action, Do
from rlcomm.comm.transports.base import PollableTransport, Waiter

if TYPE_CHECKING:
    from rlcomm.comm.connection import Connection

logger = logging.getLogger(__name__)


class Selector:
    """Reads the connections given to :meth:`add` on one thread (see the module docstring).

    Args:
        name: the thread's name.
    """

    def __init__(self, name: str = "rlcomm-selector"):
        self._lock = threading.Lock()
        self._conns: list[Reader] = []
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._kind: type | None = None  # the class of the transports it waits on
        self._waiter: Waiter | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def add(self, conn: Connection | Reader) -> None:
        """Read ``conn`` (a connection, or its reader) from now on, once its transport is
        known to be pollable."""
        reader = conn if isinstance(conn, Reader) else conn.reader
        with self._lock:
            if self._closed:
                raise RuntimeError("the selector is closed")
            self._conns.append(reader)
        select_by(reader, self)

    def wake(self) -> None:
        """Make the thread look at its connections again (any thread may call it)."""
        with self._lock:
            if self._wake_w < 0:
                return  # the thread has ended
            try:
                os.write(self._wake_w, b"w")
            except BlockingIOError:
                pass  # full of wake-ups already

    def close(self, timeout: float = 5.0) -> None:
        """Hand every connection back to its receiver thread and end the thread."""
        with self._lock:
            self._closed = True
        self.wake()
        self._thread.join(timeout)

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._conns)

    # -- the thread --------------------------------------------------------------------------

    def _run(self) -> None:
        held: dict[Reader, PollableTransport] = {}
        try:
            while True:
                with self._lock:
                    if self._closed:
                        return
                    conns = list(self._conns)
                again = self._claim(conns, held)
                self._wait(held, again)
                for conn, transport in list(held.items()):
                    if serve(conn, transport, transport.has_data()):
                        del held[conn]
        except Exception:  # noqa: BLE001 - say so loudly, then hand everything back
            logger.exception("selector thread failed; its connections go back to their "
                             "receiver threads")
        finally:
            with self._lock:
                self._closed = True
                conns, self._conns = self._conns, []
            for conn in conns:
                release(conn, self, conn in held)
            with self._lock:
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._wake_r = self._wake_w = -1

    def _claim(self, conns: list[Reader], held: dict[Reader, PollableTransport]) -> bool:
        """Take the roles that are free; drop connections it is done with. Returns whether
        a role could not be taken yet (look again within the linger time)."""
        again = False
        done = []
        for conn in conns:
            if conn in held:
                continue
            action = claim(conn, self)
            if action.do is Do.WAIT:
                again = True
            elif action.do is not Do.READ:  # STOP, LET_GO: done with it
                done.append(conn)
            elif self._takes(conn.transport):  # type: ignore[arg-type]
                held[conn] = conn.transport  # type: ignore[assignment]
            else:  # a pollable transport of another kind: not one this selector waits on
                release(conn, self, holding=True)
                done.append(conn)
        if done:
            with self._lock:
                self._conns = [c for c in self._conns if c not in done]
        return again

    def _takes(self, transport: PollableTransport) -> bool:
        """Whether it waits on ``transport`` (the first one sets the kind)."""
        if self._kind is None:
            self._kind, self._waiter = type(transport), transport.waiter()
        return type(transport) is self._kind

    def _wait(self, held: dict[Reader, PollableTransport], again: bool) -> None:
        """Wait for data on a held connection, a wake-up, or (``again``) the linger time."""
        deadline = time.monotonic() + LINGER if again else None
        if held:
            wake_fds = [self._wake_r, *(conn.wake_fd for conn in held)]
            if self._waiter.wait(list(held.values()), deadline, wake_fds):  # type: ignore[union-attr]
                return
        else:
            poller = select.poll()
            poller.register(self._wake_r, select.POLLIN)
            poller.poll(LINGER * 1000 if again else None)
        # Woken (or the time is up): empty every wake pipe, so that a stale byte cannot
        # end the next wait at once. A connection's wants are in its state, not its pipe.
        for fd in (self._wake_r, *(conn.wake_fd for conn in held)):
            drain(fd)


# -- the selector's side of a reader (what the receiver thread does in .receiver) ---------


def select_by(reader: Reader, selector: Selector) -> None:
    """Let ``selector`` drive ``reader`` instead of its receiver thread."""
    reader.select_by(selector)


def claim(reader: Reader, selector: Selector) -> Action:
    """Take the stream for ``selector`` (see :meth:`.Reader.selector_take`)."""
    return reader.selector_take(selector)


def serve(reader: Reader, transport: PollableTransport, has_data: bool) -> bool:
    """Read and hand over one message (see :meth:`.Reader.selector_serve`)."""
    return reader.selector_serve(transport, has_data)


def release(reader: Reader, selector: Selector, holding: bool) -> None:
    """``selector`` ends: the receiver thread reads ``reader`` again."""
    reader.selector_release(selector, holding)
