"""``Endpoint``: serve messages of (frame bytes, tensors) to and from any peer.

A small facade over the connection layer for components built on top of it that speak a
protocol of their own (channels): such a message is a *frame* (bytes the component
encoded, msgspec say) plus raw tensors, never pickled objects. The facade exists so that
the component imports only this module from comm's internals: when the connection layer
changes, only this file is adapted.

- :meth:`Endpoint.listen` hands every message from a peer to a callback, on the thread
  that read it, in order (the connection's receiver thread, a :class:`PeerSelector`
  thread, or a caller of :meth:`Peer.pump`);
- :meth:`Peer.send` sends from the calling thread; :meth:`Peer.pump` reads the peer's
  messages on the calling thread until a future is done, so a blocking request's reply
  is read by the thread that waits for it;
- :class:`PeerSelector` reads many listened peers on one thread.

A message travels as a codec ``FRAMED`` message: its tensors, and the frame bytes in the
header, never pickled (see :mod:`rlcomm.comm.codec`).
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from typing import Any

import torch

from rlcomm.comm import codec
from rlcomm.comm.codec import MessageHeader
from rlcomm.comm.connection import Connection
from rlcomm.comm.connection.selector import Selector
from rlcomm.comm.handshake import parse_address
from rlcomm.comm.identity.address import WorkerAddress
from rlcomm.comm.manager import CommManager
from rlcomm.comm.options import CollectiveGroupOptions, default_timeout
from rlcomm.comm.status import add_section
from rlcomm.comm.transports import shm_relay
from rlcomm.comm.transports.shm_memory import RING_BYTES
from rlcomm.errors import CommError

logger = logging.getLogger(__name__)

#: Receives one message: ``on_message(frame, tensors)``.
OnMessage = Callable[[bytes, list[torch.Tensor]], None]
#: Listened connections wait this long per receive and simply receive again.
_LISTEN_OPTIONS = CollectiveGroupOptions(timeout=3600.0)
_SEND_OPTIONS = CollectiveGroupOptions()

#: Bytes of a shared-memory peer's ring: what it holds unread before a write waits on it.
SHARED_MEMORY_RING_BYTES = RING_BYTES

__all__ = ["SHARED_MEMORY_RING_BYTES", "Endpoint", "OnMessage", "Peer", "PeerSelector",
           "WorkerAddress", "add_status_section", "encode_message", "parse_address"]


def add_status_section(name: str, provider: Callable[[], Any]) -> None:
    """Add a part to this process's status report (``rlcomm status``): ``provider()``
    returns plain data, on a thread of rlcomm's, and must not wait long on locks. A
    name ``channel:<name>`` lists it among the process's channels (see
    :func:`rlcomm.comm.status.add_section`)."""
    add_section(name, provider)


def encode_message(frame: bytes, tensors: list[torch.Tensor]) -> tuple[MessageHeader, list[torch.Tensor]]:
    """The codec form of a message (to size it, or send it with :meth:`Peer.send_encoded`).

    Raises:
        CodecError: the tensors mix CPU and CUDA, or one cannot be sent.
    """
    return codec.encode_framed(frame, tensors)


class Peer:
    """The connection with one peer, as a component sees it."""

    def __init__(self, conn: Connection, address: WorkerAddress):
        self._conn = conn
        self.address = address

    @property
    def usable(self) -> bool:
        """False once the connection failed (a new :meth:`Endpoint.connect` makes another)."""
        return self._conn.error is None

    @property
    def shared_memory(self) -> bool:
        """Whether a write waits only on the peer's reading, never on a network (the
        transport is ``memory_only``: shared memory)."""
        return self._conn.memory_only

    def gone(self) -> bool:
        """Whether the connection failed or the peer is seen gone now, without waiting
        (a check before a write that nobody will wait on; a transport that cannot tell
        without reading says no)."""
        return self._conn.peer_gone()

    def send(self, frame: bytes, tensors: list[torch.Tensor], timeout: float | None = None) -> None:
        """Send a message from this thread (after any queued async sends).

        Raises:
            CodecError: the tensors cannot be sent together.
            CommError: the send failed (``CommTimeoutError`` after ``timeout`` seconds,
                default rlcomm's op timeout).
        """
        header, tensors = encode_message(frame, tensors)
        self.send_encoded(header, tensors, timeout)

    def send_encoded(self, header: MessageHeader, tensors: list[torch.Tensor],
                     timeout: float | None = None) -> None:
        """:meth:`send` of a message :func:`encode_message` encoded already."""
        self._conn.send_inline(header, tensors, default_timeout() if timeout is None else timeout)

    def pump(self, fut: concurrent.futures.Future, timeout: float,
             hand_back: Callable[[], bool]) -> bool:
        """Read and dispatch this listened peer's messages on this thread until ``fut`` is
        done (True) or ``timeout`` seconds passed (False). ``hand_back()``, asked at the
        end, says whether more messages are awaited (another thread then reads them)."""
        return self._conn.pump(fut, timeout, hand_back)

    def close(self) -> None:
        """End the connection (the peer sees it lost)."""
        self._conn.close()


def forward_without_copies() -> None:
    """Declare that this process forwards the payloads it receives and never writes to
    them (a channel worker): from now on, a large payload received over shared memory
    and sent on to another process of the node travels as the original sender's memory,
    not as a copy (:mod:`~rlcomm.comm.transports.shm_relay`). Call it before the
    process's first connection."""
    shm_relay.enable()


def forwarded_without_copies() -> int:
    """How many payloads this process sent on as their original sender's memory."""
    return shm_relay.relayed


class Endpoint:
    """This process's side of the connections (one per process; see the module docstring).

    Args:
        manager: the process's connection manager.
    """

    def __init__(self, manager: CommManager):
        self._manager = manager

    @classmethod
    def for_process(cls) -> Endpoint:
        """This process's endpoint; a process that is no worker (the driver) gets one."""
        return cls(CommManager.for_process())

    @classmethod
    def current(cls) -> Endpoint:
        """The endpoint of this worker process.

        Raises:
            RlcommError: this process has no rlcomm communication set up.
        """
        return cls(CommManager.current())

    @property
    def address(self) -> WorkerAddress:
        return self._manager.address

    def listen(self, peer: WorkerAddress, on_message: OnMessage,
               on_error: Callable[[CommError], None]) -> Peer:
        """Hand every message from ``peer`` to ``on_message(frame, tensors)``, in order, on
        the thread that read it; ``on_error`` is called once when the connection fails.

        A message that is not of this form (a plain ``send`` from the peer) is logged
        and dropped.
        """
        def deliver(obj: Any) -> None:
            if (type(obj) is not tuple or len(obj) != 2 or type(obj[0]) is not list
                    or type(obj[1]) is not bytes):
                logger.error("an unexpected %s message from %s; dropped", type(obj).__name__, peer)
                return
            on_message(obj[1], obj[0])

        conn = self._manager.listen(peer, deliver, on_error, _LISTEN_OPTIONS)
        return Peer(conn, peer)

    def connect(self, peer: WorkerAddress) -> Peer:
        """The connection with ``peer`` for sending only (handshake on first use)."""
        return Peer(self._manager.connection(peer, _SEND_OPTIONS), peer)


class PeerSelector:
    """Reads many listened peers on one thread it owns (see
    :mod:`rlcomm.comm.connection.selector`); their messages are dispatched on that thread.

    Args:
        name: the thread's name.
    """

    def __init__(self, name: str):
        self._selector = Selector(name)

    def add(self, peer: Peer) -> None:
        self._selector.add(peer._conn)

    def close(self) -> None:
        self._selector.close()
