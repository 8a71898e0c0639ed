"""The transport contract.

A transport moves plain, contiguous tensors between two ranks (``rank`` 0 and 1) of a
connection, in order. It knows nothing about workers, codecs or channels.

Both operations are two-sided: a ``send`` is matched by the peer's ``recv_into`` of
buffers of the same sizes, in the same order. Messages of one direction are delivered in
the order they were sent. One thread may send while another receives; two threads must
not send (or receive) on one transport at once — the connection above serializes them.
"""

from __future__ import annotations

import datetime
import struct
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import torch
import torch.distributed as dist

from rlcomm.comm.transports import pool
from rlcomm.errors import CommError, CommTimeoutError, PeerLostError

#: Size of the fixed frames of transports that need equal-sized messages (Gloo).
FRAME_BYTES = 4096
_TOTAL = struct.Struct("<I")

#: How long a receive may wait for a live peer that sends nothing (a week: "forever").
FOREVER = datetime.timedelta(days=7)
#: A failed op whose deadline is this close (seconds) counts as timed out: torch starts
#: its own timer a moment after the caller's deadline was taken.
_DEADLINE_SLACK = 0.005


# -- deadlines -----------------------------------------------------------------------------


def deadline_of(timeout: float | None) -> float | None:
    """The monotonic time ``timeout`` seconds from now (``None``: no deadline)."""
    return None if timeout is None else time.monotonic() + timeout


def remaining(deadline: float | None, floor: float = 0.0) -> float | None:
    """Seconds left until ``deadline`` (at least ``floor``; ``None``: no deadline)."""
    return None if deadline is None else max(floor, deadline - time.monotonic())


def as_timedelta(timeout: float | None) -> datetime.timedelta:
    """``timeout`` seconds for torch's waits; ``None`` is :data:`FOREVER`."""
    return FOREVER if timeout is None else datetime.timedelta(seconds=timeout)


# -- errors --------------------------------------------------------------------------------

#: Low-level exception types and the error each one means, checked in order.
_LOST_TYPES: tuple[type[BaseException], ...] = (
    ConnectionError, EOFError, dist.DistNetworkError,
)
_TIMEOUT_TYPES: tuple[type[BaseException], ...] = (TimeoutError,)


def with_peer(error: CommError, peer: str) -> CommError:
    """``error`` with the peer it concerns attached as ``error.peer``."""
    if getattr(error, "peer", None) is None:
        error.peer = peer  # type: ignore[attr-defined]
    return error


def map_error(
    exc: BaseException, what: str, peer: str, deadline: float | None = None
) -> CommError:
    """The rlcomm error a low-level failure of ``what`` with ``peer`` means, by type.

    A :class:`CommError` stays as it is; ``TimeoutError`` means a timeout; a broken
    connection (``ConnectionError``, ``EOFError``, ``DistNetworkError``) a lost peer.
    Gloo and the c10d store raise plain ``RuntimeError`` / ``DistStoreError`` for both;
    those are told apart by the op's ``deadline`` (monotonic seconds): failed at its
    deadline, the op timed out; failed before it, the peer is gone or its link broke.
    The error carries ``peer`` as its ``peer`` field.
    """
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if isinstance(exc, CommError):
        return with_peer(exc, peer)
    if isinstance(exc, _LOST_TYPES):
        timed_out = False
    elif isinstance(exc, _TIMEOUT_TYPES):
        timed_out = True
    elif deadline is not None:
        timed_out = time.monotonic() >= deadline - _DEADLINE_SLACK
    else:  # no deadline known: the caller waited "forever", so the peer failed
        timed_out = False
    if timed_out:
        return with_peer(CommTimeoutError(f"{what} with {peer} timed out: {first}"), peer)
    return with_peer(
        PeerLostError(
            f"{what} with {peer} failed, the peer process is gone or its connection broke: "
            f"{first}"
        ),
        peer,
    )


def fixed_frames(frame: bytes) -> list[torch.Tensor]:
    """``frame`` as one :data:`FRAME_BYTES` tensor (its length first), plus one tensor
    with the rest when it does not fit."""
    head = _TOTAL.pack(len(frame)) + frame
    first = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
    cut = min(len(head), FRAME_BYTES)
    first.numpy()[:cut] = np.frombuffer(head, dtype=np.uint8, count=cut)
    if len(head) <= FRAME_BYTES:
        return [first]
    return [first, torch.frombuffer(bytearray(head[FRAME_BYTES:]), dtype=torch.uint8)]


def frame_rest(first: torch.Tensor) -> tuple[bytes, int]:
    """The frame bytes inside a received first fixed frame, and how many bytes follow in
    a second message (0 for most frames)."""
    raw = first.numpy()
    (total,) = _TOTAL.unpack_from(raw)
    here = min(total, FRAME_BYTES - _TOTAL.size)
    return raw[_TOTAL.size : _TOTAL.size + here].tobytes(), total - here


class Transport(ABC):
    """A two-party, ordered, two-sided tensor transport."""

    #: Short name used in logs and benchmarks ("gloo", "nccl", "shm").
    name: str = "?"
    #: Set when a send failed after part of a message had left: the stream is out of
    #: step, and the transport must not carry another message. A send that fails with
    #: this still False sent nothing (the caller may go on using the transport).
    broken: bool = False
    #: Whether :meth:`poll` works: a receiver can then wait for the next frame without
    #: committing to receive it, and any thread may read (one at a time).
    pollable: bool = False
    #: Whether a send waits only on the peer reading this node's memory, never on a
    #: network (shared memory): a component may then send from a thread that must not
    #: wait long, while the peer keeps reading.
    memory_only: bool = False
    #: Whether the connection closes it on teardown (NCCL's communicator is left to its
    #: own teardown: its shutdown may wait on a dead peer).
    close_on_teardown: bool = True

    def as_one_sided(self) -> OneSidedTransport | None:
        """This transport as one that carries payloads as offers: ``None``, it is two-sided
        (the payload follows its frame in the stream)."""
        return None

    def as_two_sided(self) -> Transport | None:
        """This transport as one whose payloads follow their frame: itself."""
        return self

    @abstractmethod
    def send(self, tensors: Sequence[torch.Tensor], timeout: float) -> None:
        """Send ``tensors`` to the peer, in order.

        Blocks until the data left this side's buffers (the tensors may then be reused).

        Raises:
            CommTimeoutError: not done within ``timeout`` seconds.
            PeerLostError: the connection to the peer broke.
        """

    @abstractmethod
    def recv_into(self, tensors: Sequence[torch.Tensor], timeout: float | None) -> None:
        """Fill ``tensors`` in place, in order, from the peer's sends.

        Args:
            timeout: seconds, or ``None`` to wait as long as the peer is alive.

        Raises:
            CommTimeoutError, PeerLostError: as for :meth:`send`.
        """

    def send_frame(self, frame: bytes, payload: Sequence[torch.Tensor], timeout: float) -> None:
        """Send a message frame (a short byte string), then ``payload``.

        The default sends fixed-size frames; byte-stream transports send just the bytes.
        """
        self.send([*fixed_frames(frame), *payload], timeout)

    def send_small(self, frame: bytes, timeout: float) -> None:
        """:meth:`send_frame` of a frame without a payload (a transport may have a
        shorter way for it)."""
        self.send_frame(frame, (), timeout)

    def recv_frame(self, timeout: float | None, rest: float | None = None) -> bytes:
        """Receive the next frame sent with :meth:`send_frame` (its payload follows).

        Args:
            timeout: seconds to wait for the frame to begin (``None``: while the peer
                is alive).
            rest: seconds the rest of the frame may take once it began (default:
                ``timeout``).
        """
        first = torch.empty(FRAME_BYTES, dtype=torch.uint8)
        self.recv_into([first], timeout)
        data, more_bytes = frame_rest(first)
        if more_bytes:
            more = torch.empty(more_bytes, dtype=torch.uint8)
            self.recv_into([more], timeout if rest is None else rest)
            data += more.numpy().tobytes()
        return data

    def frame_in_place(self) -> bytes | None:
        """The next frame, when it has come whole and is taken without waiting or a copy
        into a buffer first (a transport may have such a way); else ``None``, having
        taken nothing: :meth:`recv_frame` reads it."""
        return None

    def recv_new(self, sizes: Sequence[int], timeout: float | None) -> list[torch.Tensor]:
        """Receive payloads of ``sizes`` bytes into new uint8 tensors.

        Transports that can hand out received memory without a copy (shared memory)
        override this; the default receives into pooled buffers (:mod:`.pool`) with
        :meth:`recv_into`.
        """
        tensors = [pool.take(n) for n in sizes]
        self.recv_into(tensors, timeout)
        return tensors

    def send_bucket(self, pieces: Sequence[torch.Tensor], timeout: float) -> None:
        """Send one bucket of a message that streams in buckets (after its frame): the
        uint8 ``pieces``, in order. The peer takes it with :meth:`recv_bucket`.

        The default sends the pieces as they are; a transport with staging of its own
        (shared memory) copies the bucket into one buffer of it, which the peer reads
        and gives back before the bucket after next can use it.
        """
        self.send(pieces, timeout)

    def recv_bucket(
        self, sizes: Sequence[int], timeout: float | None,
        into: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor] | None:
        """Receive one bucket sent with :meth:`send_bucket`, its pieces of ``sizes``
        bytes: straight into ``into`` (one contiguous uint8 tensor per piece) when the
        caller gives them and the transport can (it returns None then), else as uint8
        tensors the caller copies out and drops (the staging goes back when they are
        freed)."""
        if into is not None:
            self.recv_into(into, timeout)
            return None
        return self.recv_new(sizes, timeout)

    def poll(self, timeout: float | None, wake_fd: int | None = None) -> bool:
        """Wait until a frame can be received at once, consuming nothing of it.

        Only for ``pollable`` transports. Once it returns True, :meth:`recv_frame` and
        the frame's payload receives do not wait on the peer's pace.

        Args:
            timeout: seconds, or ``None`` to wait as long as the peer is alive.
            wake_fd: a file descriptor that ends the wait when it becomes readable (it
                is not read here).

        Returns:
            True when a frame is there; False on timeout or when ``wake_fd`` woke it.

        Raises:
            PeerLostError: the connection to the peer broke.
        """
        raise NotImplementedError(f"the {self.name} transport cannot be polled")

    def peer_gone(self) -> bool:
        """Whether the peer is seen gone now, found without waiting and without reading
        anything (a cheap check before a write that nobody will wait on). ``False``
        when this transport cannot tell without a read."""
        return False

    @abstractmethod
    def close(self) -> None:
        """Release the connection's resources; later calls fail."""


class Outgoing(Protocol):
    """What :meth:`OneSidedTransport.offer` gives for one message: ``offer``, the bytes
    that ride in the message's frame."""

    offer: bytes


class OneSidedTransport(ABC):
    """A transport whose payload never enters the pair's stream (CUDA IPC).

    The sender *offers* a payload: :meth:`offer` makes it readable by the peer and
    returns a short description (``Outgoing.offer``) that the connection carries in the
    message's frame over the pair's CPU transport. The receiver, holding that frame,
    copies the payload out with :meth:`accept` and acknowledges it to the sender over
    the transport's own link. Whether a send waits for that acknowledgement is the
    transport's choice (:meth:`complete`): a payload copied into the transport's own
    buffer need not wait, one read straight from the sender's tensors must.

    ``order`` arguments are the caller's CUDA stream: a send's payload is read after the
    work queued on it before the call, and a receive's tensors may be used on it as soon
    as :meth:`accept` returns.
    """

    name: str = "?"
    close_on_teardown = True

    def as_one_sided(self) -> OneSidedTransport | None:
        """Itself: its payloads are offers (see :meth:`Transport.as_one_sided`)."""
        return self

    def as_two_sided(self) -> Transport | None:
        """``None``: no payload of it follows its frame in the stream."""
        return None

    @abstractmethod
    def offer(
        self, tensors: Sequence[torch.Tensor], order: object, deadline: float | None,
        on_wait: Callable[[], None] | None = None, lend: bool = False,
    ) -> Outgoing:
        """Make ``tensors`` readable by the peer; returns the message's offer.

        Waits (until ``deadline``, monotonic seconds) only when the transport's buffers
        are all in use, running ``on_wait`` now and then meanwhile. ``lend``: let the
        peer read the tensors themselves whatever their size (no copy here).

        Raises:
            CommTimeoutError: no buffer came free in time (nothing was offered).
            PeerLostError: the peer is gone.
        """

    @abstractmethod
    def withdraw(self, outgoing: Outgoing) -> None:
        """Take back the last offer, whose frame could not be sent."""

    @abstractmethod
    def complete(
        self, outgoing: Outgoing, order: object, deadline: float | None,
        on_wait: Callable[[], None] | None = None, host: bool = False,
    ) -> None:
        """Return once the sender may write the offered tensors again, in order on
        ``order``: at once for a payload the transport copied (``order`` after that
        copy), after the receiver's copy for one it reads from the tensors themselves
        (``order`` after the receiver's copy). ``host``: the host waits for the copy
        instead.

        Raises:
            CommTimeoutError: the receiver did not take it by ``deadline``.
            ProtocolMismatchError: the receiver refused it.
            PeerLostError: the peer is gone.
        """

    @abstractmethod
    def accept(
        self, offer: bytes, sizes: Sequence[int], into: Sequence[torch.Tensor] | None,
        device: torch.device | None, order: object, deadline: float | None = None,
    ) -> list[torch.Tensor]:
        """Copy the payload of the received ``offer`` (tensors of ``sizes`` bytes) into
        ``into`` (contiguous tensors of those sizes), or into new uint8 tensors on
        ``device`` (``None``: the GPU the payload lies on); returns the uint8 buffers,
        ordered on ``order`` (``None``: not yet; see :meth:`order_after`). A transport
        may have the sender write ``into`` instead, waiting for it until ``deadline``
        (``None``: the ``comm_timeout`` setting from now).

        Raises:
            ProtocolMismatchError: the offer does not match ``sizes``, or is out of order.
            CommError: the sender's memory could not be read (the sender is told).
        """

    @abstractmethod
    def current_order(self, device: torch.device | None) -> object:
        """The calling thread's current stream on ``device`` (``None``: this end's)."""

    @abstractmethod
    def order_after(self, order: object) -> None:
        """Order ``order`` (a stream) after every copy :meth:`accept` made so far (for
        buffers accepted with ``order=None``)."""

    def copies_at_once(self, offer: bytes) -> bool:
        """Whether the receiver should copy ``offer``'s payload out as soon as it reads
        it, before any receive op asks (its sender needs the memory back soon)."""
        return False

    @abstractmethod
    def refuse(self, offer: bytes, reason: str) -> None:
        """Turn a received ``offer`` down, telling the sender ``reason``."""

    def peer_gone(self) -> bool:
        return False

    @property
    def usable(self) -> bool:
        """Whether it may carry another message (not closed, not out of step)."""
        return True

    @abstractmethod
    def close(self, lost: bool = False) -> None:
        """Release everything; ``lost``: the peer is gone, so also what it held."""


@runtime_checkable
class PollableTransport(Protocol):
    """A transport whose incoming stream can be watched without reading it: a receiver
    waits for the next frame with :meth:`poll`, and a selector watches many transports
    of one kind on one thread with a :meth:`waiter`. Any thread may then read (one at a
    time). A transport is pollable when it has these methods and ``pollable`` is True.
    """

    name: str
    pollable: bool

    def poll(self, timeout: float | None, wake_fd: int | None = None) -> bool: ...

    def has_data(self) -> bool:
        """Whether a read would not wait: a frame is there, or the peer is known gone
        (the read then raises)."""
        ...

    def waiter(self) -> Waiter:
        """A new wait on many transports of this one's kind (one per waiting thread)."""
        ...


class Waiter(Protocol):
    """One thread's wait on several pollable transports of one kind at once."""

    def wait(
        self, transports: Sequence[PollableTransport], deadline: float | None,
        wake_fds: Sequence[int],
    ) -> bool:
        """Until one of ``transports`` :meth:`~PollableTransport.has_data` (True), or
        until ``deadline`` or a readable ``wake_fds`` (False; the fds are not read). A
        transport whose peer is seen gone is marked so (True: its read raises)."""
        ...


def is_pollable(transport: Transport) -> bool:
    """Whether ``transport`` can be watched without reading it (see
    :class:`PollableTransport`)."""
    return transport.pollable and isinstance(transport, PollableTransport)
