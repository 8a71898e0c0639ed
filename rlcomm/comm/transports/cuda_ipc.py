"""CUDA IPC transport: CUDA payloads between two processes that share one GPU.

NCCL refuses two ranks on one GPU, which is what Ray actors with fractional ``num_gpus``
are. Between two processes of one node on one physical GPU, a connection moves its CUDA
payloads through CUDA IPC, one-sided (:class:`~.base.OneSidedTransport`): the payload's
bytes never enter the pair's stream, and no store is on a message's path.

Set up once per pair, at its first CUDA payload: each end makes two streams of its own
(one its sends' copies run on, one its receives' copies run on), two interprocess events
(*ready*, recorded after a send's copies; *done*, after a receive's copies), and one
``SOCK_SEQPACKET`` *link* to the peer (an abstract socket named in the rendezvous store,
both ends' processes checked with ``SO_PEERCRED``), over which the ends swap their
events' handles (and a second link, for the other direction's payloads). After that,
one message:

1. The sender orders its send stream after the caller's stream and *offers* the
   payload, in one of two ways:

   - *staged*: a payload of at most :func:`slot_bytes` is copied, in one batched copy,
     into a free *slot* of the sender's staging area (:class:`Staging`: fixed slots in
     one allocation, shared once). The send returns at once; the slot is reused after
     the receiver's ack, its next copy ordered after the receiver's *done* event.
   - *lent*: a larger payload is not copied: the receiver reads the sender's own
     tensors (each allocation shared once per pair and cached). The send returns once the
     receiver has acked, with the caller's stream ordered after the receiver's copy.

   It records *ready* and returns an :class:`Offer` (the memory's handles, each tensor's
   place) that the connection carries in the message's frame.
2. The receiver, holding the frame, opens the memory (once per allocation; an opened
   allocation stays open until the sender says it freed it: a lent offer names the
   allocations freed since the last one), makes its receive stream
   wait on *ready*, copies into the caller's tensors or new ones (a staged payload in
   one copy, as soon as its frame is read; a lent one when a receive op takes it),
   records *done*, orders the caller's stream after it and sends the ack: the message's
   sequence number, and why it refused it if it did.

3. *Written by the sender*: a receiver that takes a lent payload into tensors it has
   received into before (the same storages: its parameters, sync after sync) has them
   *registered* with the sender once (their storages shared, as the sender's are), and
   asks the sender to write them instead of copying: it records *done* after the
   caller's work queued so far (its reads of the tensors), sends a write request, and
   waits for the word that the write is queued; the sender, waiting for its ack, copies
   on its send stream after *done*, records *ready* and says so (which stands for the
   ack); the receiver orders the caller's stream after *ready*. Every copy of a sync is
   then queued from the sender's process. Tensors received into once cost the sender
   nothing; a registration whose storages the receiver freed ends, and the sender closes
   what it opened of it.

One event per end and role is enough because each is always recorded on the same
stream: waiting on a later record of it also waits for every earlier one. A stream
waits on another through an event of this end's own, one per direction, made at set-up:
no message makes an event. Each direction of payloads has a link of its own, read by
one side at each end: acks, write requests and registrations from the receiver, and the
sender's word on each write.

Lifetimes: the staging area is released after :func:`idle_release` seconds without a
message, and the receiver closes what it opened after as long. When the peer is lost,
everything this end shared with it is released on its behalf (see
:mod:`.cuda_device`), so nothing stays pinned for a dead process.

GPUs are named by UUID, never by index: ``CUDA_VISIBLE_DEVICES`` differs between Ray
actors. Which CUDA transport a connection uses is decided once, at its first CUDA
payload: both ends swap their GPU's UUID (:func:`~.gpus.exchange_gpu_uuids`) and the
registry picks CUDA IPC when they are equal, else NCCL.
"""

from __future__ import annotations

import errno
import logging
import select
import socket
import struct
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from rlcomm.comm.transports import registry
from rlcomm.comm.transports.base import OneSidedTransport, map_error
from rlcomm.comm.transports.cuda_device import CUDA, DeviceOps, Share
from rlcomm.comm.transports.shm_signals import connect_published, credentials_ok, seqpacket
from rlcomm.errors import (
    CommError,
    CommTimeoutError,
    PeerLostError,
    ProtocolMismatchError,
)
from rlcomm.settings import get_settings

logger = logging.getLogger(__name__)

#: Each tensor of a payload starts at a multiple of this many bytes.
ALIGN = 256
#: A link message: a number (a message's, or a registration's) and its kind; what
#: follows depends on the kind. From a receiver: an ack (``_OK``, ``_REFUSED`` and the
#: reason), a request to write a lent payload into registered tensors (``_WRITE``, then
#: the registration's number), a registration in parts (``_REGISTER``, the last
#: ``_REGISTERED``), a registration's end (``_RETIRE``). From a sender: a write done
#: (``_WRITTEN``) or not (``_NOT_WRITTEN``, then the reason).
_ACK = struct.Struct("<QB")
_OK, _REFUSED, _WRITE, _REGISTER, _REGISTERED, _RETIRE, _WRITTEN, _NOT_WRITTEN = range(8)
_NUMBER = struct.Struct("<Q")
#: Bytes of a registration's part (a link message stays well under a socket's buffer).
_PART = 32 << 10
#: A receiver registers tensors it receives into the second time it does (a target used
#: once costs its sender nothing), up to this many registrations per peer (past them, it
#: copies out itself: registering one to end another would open and close a mapping per
#: message).
_MAX_REGISTRATIONS = 1024
#: The largest registration a sender takes in (about 100 bytes per storage).
_MAX_REGISTRATION_BYTES = 16 << 20
#: How often a send waiting for an ack runs its ``on_wait`` (seconds).
_WAIT_SLICE = 0.002


def slot_bytes() -> int:
    """Payloads up to this many bytes are staged, larger ones lent (``cuda_slot_bytes``)."""
    return get_settings().cuda_slot_bytes


def idle_release() -> float:
    """Seconds without a message after which staging and opened memory are released."""
    return get_settings().cuda_idle_release


class Offer(msgspec.Struct, array_like=True, frozen=True):
    """What a sender publishes for one message: where its payload lies.

    Attributes:
        seq: the message's number in this direction (from 0, no gaps).
        gpu: the UUID of the GPU the memory lies on.
        shares: the allocations the payload lies in.
        pieces: per non-empty tensor, ``(share index, byte offset in that storage,
            bytes)``.
        staged: the pieces lie in one staging slot, in order (one copy takes them all).
        retired: the shares (their counters) of the sender's allocations freed since its
            last lent offer: the receiver closes them, and torch then lets the sender's
            allocator have that memory again.
    """

    seq: int
    gpu: str
    shares: list[Share]
    pieces: list[tuple[int, int, int]]
    staged: bool = False
    retired: list[tuple[bytes, int]] = []


class Hello(msgspec.Struct, array_like=True, frozen=True):
    """What the ends swap over the link when it is made: their events' handles."""

    gpu: str
    ready: bytes
    done: bytes


class Targets(msgspec.Struct, array_like=True, frozen=True):
    """A receiver's registration of tensors it receives lent payloads into, so that
    their sender writes them itself: the allocations, and per non-empty tensor ``(share
    index, byte offset in that storage, bytes)``."""

    shares: list[Share]
    pieces: list[tuple[int, int, int]]


_encode = msgspec.msgpack.Encoder().encode
_decode_offer = msgspec.msgpack.Decoder(Offer).decode
_decode_hello = msgspec.msgpack.Decoder(Hello).decode
_decode_targets = msgspec.msgpack.Decoder(Targets).decode


def sub_store_of(store: dist.Store, prefix: str) -> dist.Store:
    """``store`` with keys under ``prefix`` (a prefixed view where the store has one)."""
    prefixed = getattr(store, "prefixed", None)
    if prefixed is not None:
        return prefixed(prefix)
    return dist.PrefixStore(prefix, store)


def decode_offer(data: bytes, peer: str) -> Offer:
    """Parse the offer bytes of a received frame.

    Raises:
        ProtocolMismatchError: they are not an offer.
    """
    try:
        return _decode_offer(data)
    except (msgspec.DecodeError, ValueError) as exc:
        raise ProtocolMismatchError(
            f"a CUDA message from {peer} carries a malformed offer ({exc}); the connection "
            "is closed"
        ) from exc


# -- pure helpers ----------------------------------------------------------------------------


def payload_layout(sizes: Sequence[int], align: int = ALIGN) -> tuple[list[int], int]:
    """Where each of ``sizes`` bytes lies in one buffer: the offsets (each a multiple of
    ``align``) and the total bytes the buffer needs."""
    offsets, end = [], 0
    for n in sizes:
        if n < 0:
            raise ValueError(f"payload sizes must be >= 0, got {list(sizes)}")
        start = -(-end // align) * align
        offsets.append(start)
        end = start + n
    return offsets, end


def byte_views(tensors: Sequence[torch.Tensor], what: str, ops: DeviceOps = CUDA) -> list[torch.Tensor]:
    """Flat uint8 views of contiguous device tensors (writing to a view writes the tensor).

    Raises:
        ValueError: a tensor is not contiguous, or not in device memory.
    """
    views = []
    for i, t in enumerate(tensors):
        if not t.is_contiguous():
            raise ValueError(
                f"{what}: tensor {i} (shape {tuple(t.shape)}, strides {t.stride()}) is not "
                "contiguous; call .contiguous() first"
            )
        if not ops.is_device(t):
            raise ValueError(
                f"{what}: tensor {i} is on {t.device}; the cuda_ipc transport moves CUDA "
                "tensors only"
            )
        views.append(t.detach().reshape(-1).view(torch.uint8))
    return views


def pieces_outside(shares: Sequence[Share], pieces: Iterable[tuple[int, int, int]]) -> str:
    """Why one of ``pieces`` (share index, byte offset, bytes) does not lie inside the
    allocation of ``shares`` it names ("" when all do)."""
    for index, offset, n in pieces:
        if not 0 <= index < len(shares):
            return f"a piece names allocation {index} of {len(shares)}"
        if n < 0 or offset < 0 or offset + n > shares[index].nbytes:
            return (f"a piece of {n} bytes at {offset} lies outside its allocation of "
                    f"{shares[index].nbytes} bytes")
    return ""


def check_pieces(offer: Offer, sizes: Sequence[int]) -> str:
    """Why ``offer`` cannot fill tensors of ``sizes`` bytes ("" when it can)."""
    want = [n for n in sizes if n]
    got = [n for _, _, n in offer.pieces]
    if got != want:
        return f"it holds tensors of {got} bytes but the receiver's buffers are {want} bytes"
    return pieces_outside(offer.shares, offer.pieces)


# -- the link ----------------------------------------------------------------------------------


def recv_within(sock: socket.socket, poller: select.poll, deadline: float | None) -> bytes | None:
    """The next message on the link ``sock`` (``b""`` once its peer closed it), or
    ``None`` when none came by ``deadline``. A reset (the peer closed with messages of
    this end unread) is reported by the kernel once, before what the peer sent: it is
    passed over.

    Raises:
        OSError: the link broke.
    """
    reset = False
    while True:
        try:
            return sock.recv(_PART + 64, socket.MSG_DONTWAIT)
        except BlockingIOError:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return None
            poller.poll(None if remaining is None else max(1, int(remaining * 1000)))
        except ConnectionResetError:
            if reset:
                raise
            reset = True


def connect_link(
    store: dist.Store, rank: int, hello: bytes, deadline: float, peer: str,
    peer_pid: int | None,
) -> tuple[socket.socket, bytes]:
    """The pair's link (rank 0 listens on an abstract socket it names in ``store``),
    and the peer's hello. Connections from any process but ``peer_pid`` of this user
    are refused.

    Raises:
        CommTimeoutError: the peer did not come by ``deadline``.
        AuthenticationError: the socket is not the peer's.
    """
    try:
        if rank == 0:
            server = seqpacket()
            name = f"\0rlcomm-ipc-{uuid.uuid4().hex}"
            server.bind(name)
            server.listen(2)
            store.set("ipc/addr", name.encode())
            try:
                while True:
                    server.settimeout(max(0.01, deadline - time.monotonic()))
                    sock, _ = server.accept()
                    if credentials_ok(sock, peer_pid):
                        break
                    logger.warning("cuda_ipc set-up for %s: a connection from another "
                                   "process was refused", peer)
                    sock.close()
            finally:
                server.close()
        else:
            sock, _ = connect_published(store, "ipc/addr", "\0rlcomm-ipc-", deadline, peer,
                                        peer_pid, "cuda_ipc")
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        sock.send(hello)
        theirs = sock.recv(4096)
        sock.settimeout(None)
    except (TimeoutError, OSError, RuntimeError) as exc:
        raise CommTimeoutError(f"cuda_ipc set-up with {peer} failed: {exc}") from exc
    if not theirs:
        sock.close()
        raise PeerLostError(f"cuda_ipc set-up with {peer}: the peer closed the link")
    return sock, theirs


# -- the sender's side -------------------------------------------------------------------------


class Staging:
    """The sender's staging area: ``count`` fixed slots of ``size`` bytes in one
    allocation on ``device``, shared once; made on first use, released when idle."""

    def __init__(self, ops: DeviceOps, device: torch.device, size: int, count: int):
        self.size, self.count = size, count
        self.memory = ops.empty(size * count, device)
        self.share = ops.share(self.memory)
        self.free = list(range(count))

    @property
    def idle(self) -> bool:
        return len(self.free) == self.count

    def slot(self, index: int) -> torch.Tensor:
        return self.memory[index * self.size : (index + 1) * self.size]


@dataclass
class Sent:
    """One offered message (:class:`~.base.Outgoing`)."""

    seq: int
    offer: bytes
    lent: bool
    slot: int | None = None
    nbytes: int = 0
    retired: tuple[tuple[bytes, int], ...] = ()
    views: list[torch.Tensor] | None = None  # a lent payload's bytes (a write reads them)
    pushed: bool = False  # the sender wrote it into the receiver's registered tensors


class _Registration:
    """Tensors a receiver registered with its sender: their number, the storages they
    lie in (weak references: a freed one ends the registration), what was shared."""

    __slots__ = ("number", "refs", "shares")

    def __init__(self, number: int, refs: list[Any], shares: list[Share]):
        self.number, self.refs, self.shares = number, refs, shares


class _LentShare:
    """One of the sender's allocations shared with the peer, while it lives."""

    __slots__ = ("ref", "share")

    def __init__(self, ref: Any, share: Share):
        self.ref, self.share = ref, share


# -- the transport -----------------------------------------------------------------------------


class CudaIpcTransport(OneSidedTransport):
    """CUDA payloads to a process of this node on the same physical GPU (see the module
    docstring for the protocol).

    Args:
        store: the rendezvous store (a prefix private to this connection's transport).
        rank: 0 or 1.
        peer: how error messages name the other end.
        device: this end's CUDA device (the GPU both ends share).
        timeout: seconds the set-up may take.
        peer_pid: the peer's process id (the link accepts no other process).
        ops: the device layer (a fake in the protocol's CPU tests).
    """

    name = "cuda_ipc"

    def __init__(
        self, store: dist.Store, rank: int, peer: str, device: torch.device,
        timeout: float = 60.0, peer_pid: int | None = None, ops: DeviceOps = CUDA,
    ):
        if rank not in (0, 1):
            raise ValueError(f"cuda_ipc: rank must be 0 or 1, got {rank}")
        self._peer = peer
        self._ops = ops
        self._device = device
        self._gpu = ops.gpu_uuid(device)
        self._send_stream = ops.new_stream(device)
        self._recv_stream = ops.new_stream(device)
        self._ready, ready_handle = ops.new_ipc_event(device)
        self._done, done_handle = ops.new_ipc_event(device)
        # What a stream waits on another through (see DeviceOps.wait_stream): one per
        # lock, so that a message makes no event of its own.
        self._send_mark = ops.new_event()
        self._recv_mark = ops.new_event()
        deadline = time.monotonic() + timeout
        hello = _encode(Hello(self._gpu, ready_handle, done_handle))
        first, theirs = connect_link(store, rank, hello, deadline, peer, peer_pid)
        try:
            second, _ = connect_link(sub_store_of(store, "back"), rank, b"back", deadline,
                                     peer, peer_pid)
        except CommError:
            first.close()
            raise
        # Two links, one per direction of payloads, each read by one side of each end:
        # _sock is about this end's sends (acks and write requests come in, writes done
        # go out), _back about its receives (the other way).
        self._sock, self._back = (first, second) if rank == 0 else (second, first)
        try:
            peer_hello = _decode_hello(theirs)
            self._peer_ready = ops.open_ipc_event(peer_hello.ready, device)
            self._peer_done = ops.open_ipc_event(peer_hello.done, device)
        except (msgspec.DecodeError, ValueError, RuntimeError) as exc:
            self._sock.close()
            self._back.close()
            raise ProtocolMismatchError(f"cuda_ipc set-up with {peer}: a bad hello ({exc})") from exc
        self._poller = select.poll()
        self._poller.register(self._sock, select.POLLIN)
        self._back_poller = select.poll()
        self._back_poller.register(self._back, select.POLLIN)
        self._failed: CommError | None = None
        self._closed = False
        # The sending side (under _send_lock).
        self._send_lock = threading.Lock()
        self._next_seq = 0
        self._acked = 0  # acks come in order: every seq below this one is acked
        self._in_flight: dict[int, Sent] = {}
        self._refused: dict[int, str] = {}
        self._staging: Staging | None = None
        self._slot_bytes = slot_bytes()
        self._slot_count = get_settings().cuda_staging_slots
        self._lent: dict[tuple[int, int], _LentShare] = {}
        self._retiring: list[tuple[bytes, int]] = []  # freed, for the next lent offer
        self._shared: list[Share] = []  # everything this end shared with the peer
        self._targets: dict[int, list[torch.Tensor] | str] = {}  # the peer's registrations
        self._parts: dict[int, bytearray] = {}  # registrations still coming
        self._last_send = time.monotonic()
        # The receiving side (under _recv_lock).
        self._recv_lock = threading.Lock()
        self._expected = 0
        self._opened: dict[tuple, torch.Tensor] = {}  # share's key -> the memory opened
        self._registered: dict[tuple, _Registration] = {}  # targets the peer writes
        self._seen: dict[tuple, list[Any]] = {}  # targets received into once: their storages
        self._next_registration = 0
        self._collect_due = False  # registrations of freed tensors were retired
        self._last_offer: tuple[bytes, Offer] | None = None  # see _decoded
        self._last_recv = time.monotonic()
        _IDLE.add(self)

    def __repr__(self) -> str:
        return (f"CudaIpcTransport(peer={self._peer!r}, sent={self._next_seq}, "
                f"acked={self._acked}, received={self._expected}, "
                f"staging={'none' if self._staging is None else self._staging.size * self._staging.count})")

    # -- state ------------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Counters and held memory, for tests and status: messages sent and acked,
        received, bytes of staging this end holds, allocations it has open and lent
        (acks that came are taken in first)."""
        if not self._closed and self._failed is None and self._send_lock.acquire(blocking=False):
            try:
                self._reap()
            except CommError:
                pass  # recorded in _failed; the next op raises it
            finally:
                self._send_lock.release()
        staging = self._staging
        return {
            "sent": self._next_seq, "acked": self._acked, "in_flight": len(self._in_flight),
            "received": self._expected,
            "staging_bytes": 0 if staging is None else staging.size * staging.count,
            "opened": len(self._opened), "lent": len(self._lent), "shared": len(self._shared),
            "registered": len(self._registered), "targets": len(self._targets),
        }

    def _check_usable(self, what: str) -> None:
        if self._closed:
            raise PeerLostError(f"{what} with {self._peer}: the connection was closed")
        if self._failed is not None:
            raise PeerLostError(
                f"{what} with {self._peer}: the connection's CUDA IPC path failed earlier "
                f"({self._failed})"
            )

    @property
    def usable(self) -> bool:
        return not self._closed and self._failed is None

    def peer_gone(self) -> bool:
        try:
            return self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    # -- acks ---------------------------------------------------------------------------------

    def _reap(self) -> None:
        """Take in every ack that has come (the send lock held)."""
        while True:
            try:
                data = self._sock.recv(_PART + 64, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                    return
                self._lose(f"the link broke ({exc})")
            if not data:
                self._lose("its process is gone")
            try:
                seq, status = _ACK.unpack_from(data)
            except struct.error:
                self._fail(ProtocolMismatchError(
                    f"cuda_ipc with {self._peer}: a malformed ack; the CUDA path is closed"))
            if status == _WRITE:
                self._write(seq, data)
                continue
            if status in (_REGISTER, _REGISTERED):
                self._take_registration(seq, data[_ACK.size:], status == _REGISTERED)
                continue
            if status == _RETIRE:
                self._targets.pop(seq, None)  # closes what this end opened of them
                continue
            if status not in (_OK, _REFUSED):
                self._fail(ProtocolMismatchError(
                    f"cuda_ipc with {self._peer}: a message of kind {status} on the link of "
                    "this end's sends; the CUDA path is closed"))
            self._take_ack(seq, status, data)

    def _take_ack(self, seq: int, status: int, data: bytes) -> None:
        """Message ``seq`` is taken (acks come in order): its slot comes back, what its
        offer retired is closed on the receiver's side, a refusal is kept for its send."""
        if seq != self._acked or seq not in self._in_flight:
            self._fail(ProtocolMismatchError(
                f"cuda_ipc with {self._peer}: an ack of message {seq} where {self._acked} "
                "was due; the CUDA path is closed"))
        self._acked += 1
        sent = self._in_flight.pop(seq)
        if sent.retired:  # the receiver closed them: nothing to release for it
            gone = set(sent.retired)
            self._shared = [s for s in self._shared
                            if (s.ref_counter, s.ref_counter_offset) not in gone]
        if sent.slot is not None and self._staging is not None:
            self._staging.free.append(sent.slot)
        if status == _REFUSED:
            reason = data[_ACK.size:].decode(errors="replace")
            if sent.lent:
                self._refused[seq] = reason
            else:
                logger.warning("cuda_ipc: %s refused message %d: %s", self._peer, seq, reason)

    # -- writing into the peer's registered tensors (the send lock held) ------------------

    def _write(self, seq: int, data: bytes) -> None:
        """The receiver asks this end to write lent message ``seq`` into its registered
        tensors: copy on the send stream, record *ready*, say it is done (or why not;
        the receiver then copies it out itself)."""
        why = ""
        try:
            (number,) = _NUMBER.unpack_from(data, _ACK.size)
        except struct.error:
            number, why = -1, "a malformed write request"
        sent = self._in_flight.get(seq)
        target = self._targets.get(number)
        if why:
            pass
        elif self.peer_gone():  # it gave up waiting (or died) since it asked: no write
            self._lose(f"it closed the link after asking for message {seq} to be written")
        elif sent is None or sent.views is None or seq != self._acked:
            why = f"message {seq} is not the lent payload due to its receiver"
        elif not isinstance(target, list):
            why = target or f"no registration {number}"
        elif [t.numel() for t in target] != [v.numel() for v in sent.views]:
            why = (f"registration {number} holds tensors of {[t.numel() for t in target]} "
                   f"bytes, the message {[v.numel() for v in sent.views]}")
        if not why:
            ops = self._ops
            # The receiver's reads of its tensors are done (it recorded done after them).
            ops.wait_event(self._send_stream, self._peer_done)
            ops.copy(target, sent.views, self._send_stream)  # type: ignore[arg-type]
            ops.record(self._ready, self._send_stream)  # the receiver's stream waits for it
            sent.pushed = True  # type: ignore[union-attr]
            self._take_ack(seq, _OK, data)  # written: the receiver acks no more
        self._post(_ACK.pack(seq, _NOT_WRITTEN if why else _WRITTEN) + why.encode()[:2048])

    def _take_registration(self, number: int, part: bytes, last: bool) -> None:
        """A part of the receiver's registration ``number``; once whole, open what it
        names (a registration this end cannot open is kept as the reason)."""
        if number not in self._parts and (
                len(self._targets) + len(self._parts) >= 2 * _MAX_REGISTRATIONS):
            self._fail(ProtocolMismatchError(
                f"cuda_ipc with {self._peer}: more than {2 * _MAX_REGISTRATIONS} "
                "registrations; the CUDA path is closed"))
        buffer = self._parts.setdefault(number, bytearray())
        buffer += part
        if len(buffer) > _MAX_REGISTRATION_BYTES:
            self._fail(ProtocolMismatchError(
                f"cuda_ipc with {self._peer}: a registration of over {len(buffer)} bytes; "
                "the CUDA path is closed"))
        if not last:
            return
        del self._parts[number]
        try:
            targets = _decode_targets(bytes(buffer))
            outside = pieces_outside(targets.shares, targets.pieces)
            if outside:
                raise ValueError(outside)
            memory = [self._ops.open(share, self._device) for share in targets.shares]
            self._targets[number] = [memory[i][o : o + n] for i, o, n in targets.pieces]
        except (msgspec.DecodeError, ValueError, RuntimeError) as exc:
            self._targets[number] = f"registration {number} could not be opened ({exc})"

    def _post(self, data: bytes) -> None:
        """A message on the link of this end's sends (to the receiver)."""
        try:
            self._sock.send(data, socket.MSG_DONTWAIT)
        except BlockingIOError:
            self._lose("its link is full: it takes nothing in")
        except OSError as exc:
            self._lose(f"the link broke ({exc})")

    def _lose(self, why: str) -> None:
        error = PeerLostError(f"cuda_ipc with {self._peer}: {why}")
        self._failed = error
        raise error

    def _fail(self, error: CommError) -> None:
        self._failed = error
        raise error

    def _wait_for_acks(
        self, until: Callable[[], bool], deadline: float | None,
        on_wait: Callable[[], None] | None, what: str,
    ) -> None:
        """Take in acks until ``until()`` (the send lock held), running ``on_wait`` every
        :data:`_WAIT_SLICE` s meanwhile."""
        self._reap()
        while not until():
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise CommTimeoutError(f"{what} with {self._peer} timed out")
            wait = _WAIT_SLICE if on_wait is not None else remaining
            if wait is not None and remaining is not None:
                wait = min(wait, remaining)
            self._poller.poll(None if wait is None else wait * 1000)
            if self._closed:
                raise PeerLostError(f"{what} with {self._peer}: the connection was closed")
            self._reap()
            if on_wait is not None and not until():
                on_wait()

    # -- sending --------------------------------------------------------------------------------

    def _share_of(self, view: torch.Tensor) -> Share:
        """The share of the allocation ``view`` lies in (made once per live storage)."""
        ops = self._ops
        key = ops.storage_key(view)
        lent = self._lent.get(key)
        if lent is not None and not ops.expired(lent.ref):
            return lent.share
        if lent is not None:  # freed, and a new storage at its address
            ops.free_weak_ref(lent.ref)
            self._retiring.append((lent.share.ref_counter, lent.share.ref_counter_offset))
        share = ops.share(view)
        self._lent[key] = _LentShare(ops.weak_ref(view), share)
        self._shared.append(share)
        return share

    def _retire_freed(self) -> tuple[tuple[bytes, int], ...]:
        """The shares of allocations freed since the last lent offer (forgotten here;
        the receiver closes them when the offer comes)."""
        ops = self._ops
        for key, lent in list(self._lent.items()):
            if ops.expired(lent.ref):
                ops.free_weak_ref(lent.ref)
                del self._lent[key]
                self._retiring.append((lent.share.ref_counter, lent.share.ref_counter_offset))
        retired, self._retiring = tuple(self._retiring), []
        return retired

    def offer(
        self, tensors: Sequence[torch.Tensor], order: object, deadline: float | None,
        on_wait: Callable[[], None] | None = None, lend: bool = False,
    ) -> Sent:
        ops = self._ops
        views = byte_views(tensors, f"cuda_ipc send to {self._peer}", ops)
        for v in views:
            if v.device != self._device:
                raise ValueError(
                    f"cuda_ipc send to {self._peer}: tensor on {v.device}, but this "
                    f"connection's CUDA payloads go from {self._device}; send from one "
                    "device per peer"
                )
        pieces = [v for v in views if v.numel()]
        sizes = [v.numel() for v in pieces]
        offsets, total = payload_layout(sizes)
        with self._send_lock:
            self._check_usable("cuda_ipc send")
            if not pieces:  # nothing to read: no message number, no ack
                return Sent(-1, _encode(Offer(-1, self._gpu, [], [])), False)
            ops.wait_stream(self._send_stream, order, self._send_mark)
            slot, retired = None, ()
            if not lend and total <= self._slot_bytes and self._slot_count:
                slot = self._take_slot(deadline, on_wait)
                area = self._staging.slot(slot)  # type: ignore[union-attr]
                # The receiver's copy out of this slot's last message is done first.
                ops.wait_event(self._send_stream, self._peer_done)
                ops.copy([area[o : o + n] for o, n in zip(offsets, sizes)], pieces,
                         self._send_stream)
                # The caller may free its tensors once this returns: their memory is not
                # handed out again before the copy out of them is done.
                ops.keep_until_done(pieces, self._send_stream)
                base = slot * self._slot_bytes
                shares = [self._staging.share]  # type: ignore[union-attr]
                spots = [(0, base + o, n) for o, n in zip(offsets, sizes)]
            else:
                shares, spots, index = [], [], {}
                retired = self._retire_freed()
                for v in pieces:
                    share = self._share_of(v)
                    at = index.setdefault((share.ref_counter, share.ref_counter_offset), len(shares))
                    if at == len(shares):
                        shares.append(share)
                    spots.append((at, ops.storage_offset(v), v.numel()))
            ops.record(self._ready, self._send_stream)
            seq = self._next_seq
            self._next_seq += 1
            sent = Sent(seq, _encode(Offer(seq, self._gpu, shares, spots, slot is not None,
                                           list(retired))),
                        slot is None, slot, total, retired,
                        views=pieces if slot is None else None)
            self._in_flight[seq] = sent
            self._last_send = time.monotonic()
            return sent

    def _take_slot(self, deadline: float | None, on_wait: Callable[[], None] | None) -> int:
        if self._staging is None:
            self._staging = Staging(self._ops, self._device, self._slot_bytes, self._slot_count)
            self._shared.append(self._staging.share)
        staging = self._staging
        if not staging.free:
            self._wait_for_acks(
                lambda: bool(staging.free), deadline, on_wait,
                f"cuda_ipc send (all {staging.count} staging slots are waiting for the "
                "peer to receive their messages)",
            )
        return staging.free.pop()

    def withdraw(self, outgoing: Sent) -> None:  # type: ignore[override]
        if outgoing.seq < 0:
            return
        with self._send_lock:
            if outgoing.seq == self._next_seq - 1 and self._in_flight.pop(outgoing.seq, None):
                self._next_seq -= 1
                if outgoing.slot is not None and self._staging is not None:
                    self._staging.free.append(outgoing.slot)

    def complete(
        self, outgoing: Sent, order: object, deadline: float | None,  # type: ignore[override]
        on_wait: Callable[[], None] | None = None, host: bool = False,
    ) -> None:
        if outgoing.seq < 0:
            return
        if not outgoing.lent:
            # The staging copy reads the caller's tensors: writes after this return are
            # ordered after it (the host waits for it instead, for an async send).
            if host:
                self._ops.synchronize(self._ready)
            else:
                self._ops.wait_event(order, self._ready)
            return
        seq = outgoing.seq
        what = f"cuda_ipc send of message {seq} ({outgoing.nbytes} bytes, lent)"
        with self._send_lock:
            try:
                self._wait_for_acks(lambda: self._acked > seq, deadline, on_wait, what)
            except CommTimeoutError as exc:
                # The receiver may still read the tensors later: this path is out of step.
                self._failed = exc
                raise CommTimeoutError(
                    f"{what}: {self._peer} did not take it in time. A send of more than "
                    f"{self._slot_bytes} bytes to a worker on the same GPU returns once the "
                    "receiver has copied it; a receiver that is itself blocked sending "
                    "cannot; use async_op=True on one side"
                ) from exc
            refusal = self._refused.pop(seq, None)
        if refusal is not None:
            raise ProtocolMismatchError(f"{what} to {self._peer}: the receiver refused it: {refusal}")
        # Written by this end into the receiver's tensors (its copy, then ready), or read
        # by the receiver (its copy, then done).
        read = self._ready if outgoing.pushed else self._peer_done
        if host:
            self._ops.synchronize(read)
        else:
            self._ops.wait_event(order, read)

    # -- receiving ------------------------------------------------------------------------------

    def _open(self, share: Share, device: torch.device) -> torch.Tensor:
        # The counter is part of the key: a storage shared anew (the old one was freed)
        # is opened anew, so that each sharing's counter is taken down by its own close.
        key = (share.handle, share.offset, share.nbytes, share.ref_counter, share.ref_counter_offset)
        memory = self._opened.get(key)
        if memory is None:
            memory = self._opened[key] = self._ops.open(share, device)
        return memory

    def _take_out_retired(self, offer: Offer) -> list:
        """Take out what this end opened of the allocations the sender freed (its
        memory is then its own again); returns them, for the caller to drop without the
        lock (closing one waits for this process's stream)."""
        if not offer.retired:
            return []
        gone = set(offer.retired)  # (counter, offset) pairs, as msgspec decodes them
        keys = [k for k in self._opened if (k[3], k[4]) in gone]
        return [self._opened.pop(key) for key in keys]

    def accept(
        self, offer: bytes, sizes: Sequence[int], into: Sequence[torch.Tensor] | None,
        device: torch.device | None, order: object, deadline: float | None = None,
    ) -> list[torch.Tensor]:
        ops = self._ops
        got = self._decoded(offer)
        closing: list = []  # what the sender freed: closed at the end, without the lock
        with self._recv_lock:
            self._check_usable("cuda_ipc recv")
            if not got.pieces:  # an offer of empty tensors only: no number, no ack
                if any(sizes):
                    raise ProtocolMismatchError(
                        f"cuda_ipc recv from {self._peer}: an empty offer for tensors of "
                        f"{list(sizes)} bytes; the connection is closed")
                return []
            what = f"cuda_ipc recv of message {got.seq} from {self._peer}"
            if got.seq != self._expected:
                self._failed = ProtocolMismatchError(
                    f"{what}: message {self._expected} was due; the CUDA path is closed")
                raise self._failed
            self._expected += 1
            self._last_recv = time.monotonic()
            closing = self._take_out_retired(got)
            refusal = check_pieces(got, sizes)
            local = ops.local_gpus().get(got.gpu)
            if not refusal and local is None:
                refusal = (f"it lies on GPU {got.gpu}, which the receiving process does not "
                           f"see (its GPUs: {sorted(ops.local_gpus())}; check "
                           "CUDA_VISIBLE_DEVICES)")
            if refusal:
                self._ack(got.seq, refusal)
                raise ProtocolMismatchError(f"{what}: the payload was refused: {refusal}")
            try:
                buffers = None
                if into is not None and not got.staged and order is not None:
                    buffers = self._written_by_sender(got, ops.device(local), into, order,
                                                      deadline)
                written = buffers is not None
                if not written:
                    buffers = self._copy_out(got, ops.device(local), into, device, order)
            except RuntimeError as exc:  # opening the memory or the event, or a copy
                self._ack(got.seq, f"the receiver could not read the sender's GPU memory: {exc}")
                raise CommError(f"{what}: reading the sender's GPU memory failed: {exc}") from exc
            if not written:  # a write the sender made stands for the ack
                self._ack(got.seq, "")
        closing.clear()
        return buffers

    def _decoded(self, offer: bytes) -> Offer:
        """``offer`` decoded, once: the reader asks whether to copy a message out at once
        and then copies it, both from the same bytes."""
        last = self._last_offer
        if last is not None and last[0] is offer:
            return last[1]
        got = decode_offer(offer, self._peer)
        self._last_offer = (offer, got)
        return got

    def current_order(self, device: torch.device | None) -> object:
        return self._ops.current_stream(device or self._device)

    def order_after(self, order: object) -> None:
        # Done is recorded on the receive stream after each of its copies (and a later
        # record comes after every earlier copy): waiting on it needs no event of its own.
        self._ops.wait_event(order, self._done)

    def copies_at_once(self, offer: bytes) -> bool:
        # A staged payload holds one of the sender's slots until it is copied out.
        return self._decoded(offer).staged

    def refuse(self, offer: bytes, reason: str) -> None:
        """Turn the received ``offer`` down (the receiver cannot take it: ``reason``),
        telling the sender, whose send then raises that reason."""
        got = self._decoded(offer)
        closing: list = []
        with self._recv_lock:
            self._check_usable("cuda_ipc recv")
            if got.pieces and got.seq == self._expected:
                self._expected += 1
                closing = self._take_out_retired(got)
                self._ack(got.seq, reason)
        closing.clear()  # closed without the lock

    def _copy_out(
        self, offer: Offer, src_device: torch.device, into: Sequence[torch.Tensor] | None,
        device: torch.device | None, order: object,
    ) -> list[torch.Tensor]:
        ops = self._ops
        memory = [self._open(s, src_device) for s in offer.shares]
        srcs = [memory[i][o : o + n] for i, o, n in offer.pieces]
        stream = self._recv_stream
        # The buffers are free to write once the caller's work queued so far is done. A
        # copy taken in before any receive op (order None) writes new memory, which the
        # allocator hands out from the pool of this thread's current stream: a block
        # that kernels queued there may still read, freed by their tensor's owner.
        ops.wait_stream(stream, order if order is not None else ops.current_stream(
            into[0].device if into else device or src_device), self._recv_mark)
        ops.wait_event(stream, self._peer_ready)  # the sender's bytes are there
        if into is not None:
            dsts = [v for v in byte_views(into, f"cuda_ipc recv from {self._peer}", ops) if v.numel()]
            ops.copy(dsts, srcs, stream)
        elif offer.staged:
            first = offer.pieces[0][1]
            span = offer.pieces[-1][1] + offer.pieces[-1][2] - first
            block = ops.empty(span, device or src_device)
            ops.copy([block], [memory[0][first : first + span]], stream)
            dsts = [block[o - first : o - first + n] for _, o, n in offer.pieces]
        else:
            offsets, total = payload_layout([n for _, _, n in offer.pieces])
            block = ops.empty(total, device or src_device)
            dsts = [block[o : o + n] for o, (_, _, n) in zip(offsets, offer.pieces)]
            ops.copy(dsts, srcs, stream)
        ops.record(self._done, stream)
        if into is None:  # new memory, used on this stream: not handed out again before
            ops.keep_until_done([block], stream)
        if order is not None:  # else the caller orders its stream later (order_after)
            ops.wait_event(order, self._done)
        return dsts

    # -- tensors the sender writes (the receive lock held) -----------------------------------

    def _written_by_sender(
        self, offer: Offer, src_device: torch.device, into: Sequence[torch.Tensor],
        order: object, deadline: float | None,
    ) -> list[torch.Tensor] | None:
        """Have the sender write lent ``offer`` into ``into`` itself, when those tensors
        are registered with it (they are the second time they are received into); the
        buffers, ordered on ``order``, or ``None`` when the caller copies it out."""
        ops = self._ops
        devices = {t.device for t in into}
        if len(devices) != 1 or ops.gpu_uuid(next(iter(devices))) != offer.gpu:
            return None  # the sender writes memory of its own GPU only
        dsts = [v for v in byte_views(into, f"cuda_ipc recv from {self._peer}", ops) if v.numel()]
        number = self._registration(dsts)
        if number is None:
            return None
        # What the offer names is opened all the same (once per allocation), so that its
        # sharing ends as every lent one does: closed here when the sender frees it.
        for share in offer.shares:
            self._open(share, src_device)
        stream = self._recv_stream
        # The sender writes once the caller's work queued on the tensors so far is done:
        # it waits for done, recorded after that work.
        ops.wait_stream(stream, order, self._recv_mark)
        ops.record(self._done, stream)  # what the sender's write waits for
        self._send_back(_ACK.pack(offer.seq, _WRITE) + _NUMBER.pack(number))
        why = self._wait_written(offer.seq, deadline)
        if why:  # the sender could not: copy it out here, and register them no more
            logger.info("cuda_ipc: %s did not write message %d into registered tensors (%s)",
                        self._peer, offer.seq, why)
            self._retire([k for k, r in self._registered.items() if r.number == number])
            return None
        ops.wait_event(order, self._peer_ready)  # the sender's copy is done first
        return dsts

    def _registration(self, dsts: list[torch.Tensor]) -> int | None:
        """The number of the registration of ``dsts`` with the sender, made the second
        time they are received into (``None`` before, and for tensors in no storage)."""
        ops = self._ops
        if not dsts:
            return None
        key = tuple((*ops.storage_key(v), ops.storage_offset(v), v.numel()) for v in dsts)
        known = self._registered.get(key)
        if known is not None:
            if known.number < 0:
                return None  # they could not be shared
            if not any(ops.expired(ref) for ref in known.refs):
                return known.number
            self._retire([key])  # a storage was freed: its address means nothing now
        # The same storages a second time (not new ones at the same addresses, as a
        # caching allocator hands out: those would be registered and retired each time).
        seen = self._seen.pop(key, None)
        alive = seen is not None and not any(ops.expired(ref) for ref in seen)
        for ref in seen or ():
            ops.free_weak_ref(ref)
        if not alive:
            if len(self._seen) >= 4 * _MAX_REGISTRATIONS:
                self._forget_seen()
            firsts = {ops.storage_key(v): v for v in dsts}
            self._seen[key] = [ops.weak_ref(v) for v in firsts.values()]
            return None
        if len(self._registered) >= _MAX_REGISTRATIONS:
            return None
        shares: list[Share] = []
        refs: list[Any] = []
        index: dict[tuple[int, int], int] = {}
        pieces = []
        try:
            for v in dsts:
                storage = ops.storage_key(v)
                at = index.get(storage)
                if at is None:
                    at = index[storage] = len(shares)
                    shares.append(ops.share(v))
                    refs.append(ops.weak_ref(v))
                pieces.append((at, ops.storage_offset(v), v.numel()))
        except RuntimeError as exc:  # memory that cannot be shared (another allocator's)
            logger.info("cuda_ipc: tensors received into from %s cannot be shared (%s); "
                        "they are copied into here", self._peer, exc)
            for share in shares:
                ops.release(share)
            for ref in refs:
                ops.free_weak_ref(ref)
            self._registered[key] = _Registration(-1, [], [])  # never asked again
            return None
        number = self._next_registration
        self._next_registration += 1
        self._registered[key] = _Registration(number, refs, shares)
        data = _encode(Targets(shares, pieces))
        for start in range(0, len(data), _PART):
            last = start + _PART >= len(data)
            self._send_back(_ACK.pack(number, _REGISTERED if last else _REGISTER)
                            + data[start : start + _PART])
        return number

    def _forget_seen(self) -> None:
        seen, self._seen = self._seen, {}
        for refs in seen.values():
            for ref in refs:
                self._ops.free_weak_ref(ref)

    def _retire(self, keys: list[tuple]) -> None:
        """End the registrations at ``keys``: the sender closes what it opened of them."""
        for key in keys:
            known = self._registered.pop(key, None)
            if known is None:
                continue
            for ref in known.refs:
                self._ops.free_weak_ref(ref)
            if self.usable and known.number >= 0:
                self._send_back(_ACK.pack(known.number, _RETIRE))

    def _wait_written(self, seq: int, deadline: float | None) -> str:
        """Wait for the sender's word on writing message ``seq``: "" once written, else
        why not.

        Raises:
            CommTimeoutError: no word by ``deadline`` (the CUDA path is then closed).
            PeerLostError: the sender is gone.
        """
        if deadline is None:
            deadline = time.monotonic() + get_settings().comm_timeout
        what = f"cuda_ipc recv of message {seq} from {self._peer} (written by the sender)"
        try:
            data = recv_within(self._back, self._back_poller, deadline)
        except OSError as exc:
            self._failed = PeerLostError(f"{what}: the link broke ({exc})")
            raise self._failed from exc
        if data is None:
            self._failed = CommTimeoutError(f"{what}: the sender did not write it in time")
            try:  # no later write: the sender sees this link end
                self._back.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            raise self._failed
        if not data:
            self._failed = PeerLostError(
                f"{what}: {'the connection was closed' if self._closed else 'its process is gone'}")
            raise self._failed
        try:
            got, status = _ACK.unpack_from(data)
        except struct.error:
            got, status = -1, -1
        if got != seq or status not in (_WRITTEN, _NOT_WRITTEN):
            self._failed = ProtocolMismatchError(
                f"{what}: a message of kind {status} for message {got} came instead; the CUDA "
                "path is closed")
            raise self._failed
        return "" if status == _WRITTEN else data[_ACK.size:].decode(errors="replace")

    def _send_back(self, data: bytes) -> None:
        """A message on the link of this end's receives (to the sender)."""
        try:
            self._back.send(data, socket.MSG_DONTWAIT)
        except BlockingIOError:  # the sender has not taken its link's messages in for a while
            try:
                self._back.settimeout(10.0)
                self._back.send(data)
            except OSError as exc:
                raise map_error(exc, "cuda_ipc ack", self._peer) from exc
            finally:
                self._back.settimeout(None)
        except OSError as exc:
            raise PeerLostError(f"cuda_ipc ack to {self._peer}: the peer is gone ({exc})") from exc

    def _ack(self, seq: int, refusal: str) -> None:
        self._send_back(_ACK.pack(seq, _REFUSED if refusal else _OK) + refusal.encode()[:2048])

    # -- lifetimes ------------------------------------------------------------------------------

    def release_idle(self, now: float, after: float) -> None:
        """Release the staging area and close what this end opened, when unused for
        ``after`` seconds (never waits on a busy side)."""
        if self._send_lock.acquire(blocking=False):
            try:
                staging = self._staging
                if staging is not None and staging.idle and now - self._last_send >= after:
                    self._staging = None
                    self._shared = [s for s in self._shared if s != staging.share]
                    self._ops.collect()
            finally:
                self._send_lock.release()
        opened: dict = {}
        if self._recv_lock.acquire(blocking=False):
            try:
                if self._opened and now - self._last_recv >= after:
                    opened, self._opened = self._opened, {}
                if self._collect_due:  # the sender has had a pass to close them
                    self._collect_due = False
                    self._ops.collect()
                # Registered tensors freed since: the sender lets go of them, and their
                # memory is this end's again (collected on the next pass).
                freed = [key for key, known in self._registered.items()
                         if any(self._ops.expired(ref) for ref in known.refs)]
                self._retire(freed)
                self._collect_due = bool(freed)
            except CommError:
                pass  # the peer is gone: its next op says so
            finally:
                self._recv_lock.release()
        opened.clear()  # closed without the lock

    def close(self, lost: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        _IDLE.discard(self)
        for sock in (self._sock, self._back):
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a wait for an ack or a write
            except OSError:
                pass
        with self._send_lock:
            shared, self._shared = self._shared, []
            if lost:
                for share in shared:
                    self._ops.release(share)
            for lent in self._lent.values():
                self._ops.free_weak_ref(lent.ref)
            self._lent.clear()
            self._staging = None
            self._in_flight.clear()
            targets, self._targets = self._targets, {}
            self._parts.clear()
        with self._recv_lock:
            opened, self._opened = self._opened, {}
            registered, self._registered = self._registered, {}
            self._forget_seen()
        for known in registered.values():
            for ref in known.refs:
                self._ops.free_weak_ref(ref)
            if lost:  # what the dead sender held open of these tensors
                for share in known.shares:
                    self._ops.release(share)
        opened.clear()
        targets.clear()
        self._sock.close()
        self._back.close()
        try:
            self._ops.collect()
        except RuntimeError:
            logger.debug("collecting CUDA IPC memory failed", exc_info=True)


class _IdleReleaser:
    """One thread per process that releases idle transports' memory (see
    :meth:`CudaIpcTransport.release_idle`); it runs while any transport exists."""

    def __init__(self) -> None:
        self._transports: weakref.WeakSet[CudaIpcTransport] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, transport: CudaIpcTransport) -> None:
        with self._lock:
            self._transports.add(transport)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="rlcomm-cuda-idle",
                                                daemon=True)
                self._thread.start()

    def discard(self, transport: CudaIpcTransport) -> None:
        with self._lock:
            self._transports.discard(transport)

    def _run(self) -> None:
        while True:
            after = idle_release()
            time.sleep(min(1.0, max(0.05, after / 4)))
            with self._lock:
                transports = list(self._transports)
                if not transports:
                    self._thread = None
                    return
            now = time.monotonic()
            for transport in transports:
                try:
                    transport.release_idle(now, after)
                except Exception:  # noqa: BLE001 - one transport's failure must not stop the others
                    logger.exception("releasing idle CUDA IPC memory failed")


_IDLE = _IdleReleaser()


def _cuda_ipc(setup: registry.TransportSetup) -> CudaIpcTransport:
    if setup.device is None:
        raise ValueError("the cuda_ipc transport needs the CUDA device of its end")
    return CudaIpcTransport(setup.store, setup.rank, setup.peer, setup.device, setup.timeout,
                            setup.peer_pid)


#: CUDA IPC connects CUDA payloads of two ends on one physical GPU (so one node).
SPEC = registry.register(registry.TransportSpec(
    name=CudaIpcTransport.name, devices=frozenset({registry.CUDA}), pollable=False,
    accepts=lambda facts: bool(facts.same_gpu and facts.same_node), factory=_cuda_ipc,
    preference=1,
))

