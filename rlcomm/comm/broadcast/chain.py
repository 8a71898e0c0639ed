"""The pipelined broadcast across nodes: a payload passed along a chain of the nodes'
relays, in records of ``RLCOMM_BCAST_CHUNK_BYTES``.

The chain of a broadcast is its source, then each other node's relay in member order
(:meth:`~rlcomm.comm.broadcast.group.BroadcastGroup.relays`). Each member of the chain receives
the payload from the one before it and passes it to the one after it: it forwards record
``k`` as soon as it holds all of it, while record ``k + 1`` arrives. A broadcast to ``n``
nodes then takes about one transfer plus ``n - 2`` record times, and each node's link
carries the payload at most once in each direction, however many nodes there are.

**Links.** A member that receives along chains listens on one TCP socket bound to its
node's address (:class:`ChainListener`), published once in the group's authenticated
store. For each broadcast, each member of the chain connects to the next one. Before
either end reads a byte of the stream, both prove that they hold the group's key and
agree on what the link is for: the downstream end sends a random nonce; the upstream
end answers with the link's :data:`HELLO` (the broadcast's random id, the source, its
own place, the place it connects to), a nonce of its own and an HMAC of all that and the
first nonce; the downstream end checks it, then answers with an HMAC of both nonces and
the hello. A link lives for one broadcast, so one that failed leaves nothing behind.

**The stream.** Downstream, a link carries records (:data:`RECORD`): ``DATA`` (record
``k`` of the payload; both ends know each record's length from the message's frame, and
anything else is refused), ``WAIT`` (the sender is alive and waiting on member ``m``)
and ``ABORT`` (member ``m`` is gone, or timed out: nothing more comes). Upstream, it
carries ``WAIT`` and, once the downstream member, its node-mates and everything after it
are done, ``DONE`` with the failures seen there, and, in a run that asks for them, a
*report* of fixed size from each member there (what each node takes of a streamed
payload, :mod:`~rlcomm.comm.broadcast.routes`). So:

- a relay that dies makes its successor see the link break; the successor sends
  ``ABORT`` on, and every member after it, and their node-mates, raise
  :class:`~rlcomm.errors.PeerLostError` naming it, at once;
- a relay that stops (a frozen process) makes the members after it time out: each names
  the member the chain was waiting on, which the ``WAIT`` records of the live members in
  between tell (a relay gives up on its upstream a moment before the op's deadline, so
  that its ``ABORT`` reaches its node-mates before theirs);
- every member before the failure learns it from ``DONE`` (or from the ``WAIT`` records
  when it times out): the source raises naming the member that did not get it;
- a member whose upstream neighbour has not linked to it yet tries, at each heartbeat,
  to connect to that neighbour's listener: a refusal means its process is gone (a live
  node refuses at once a port that nobody listens on), and the member raises
  :class:`~rlcomm.errors.PeerLostError` naming it rather than wait for the deadline.

Nothing here knows codecs or workers: a payload is a list of byte views, a member is an
index. :class:`ChainRun` drives one broadcast at one member on non-blocking sockets, one
thread, one ``poll`` loop; the record plan and the checks of what arrives are pure
functions beside it.
"""

from __future__ import annotations

import concurrent.futures
import errno
import hashlib
import hmac
import os
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rlcomm.errors import ProtocolMismatchError

#: A record's header: kind, reason, count (of a ``DONE``'s reports), index (a record
#: number, a member, or a ``DONE``'s failures), length.
RECORD = struct.Struct("<BBHIQ")
DATA, WAIT, ABORT, DONE = 1, 2, 3, 4
#: Why a member did not get a payload (``ABORT`` and ``DONE`` records carry it).
LOST, TIMEOUT, REFUSED = 1, 2, 3
REASONS = {LOST: "is gone", TIMEOUT: "timed out", REFUSED: "refused it (over its size limit)"}
#: One failure in a ``DONE`` record: member, reason.
FAILURE = struct.Struct("<IB3x")
#: The member a report in a ``DONE`` record is from (the report follows).
REPORTER = struct.Struct("<I")
#: What a link is for: the broadcast's id, the source, the connecting (upstream) member
#: and the accepting (downstream) one.
HELLO = struct.Struct("<QIII")
NONCE = 32
MAC = 32  # HMAC-SHA256
#: Seconds an accepted connection may take to prove itself.
HANDSHAKE_TIMEOUT = 10.0
#: Accepted connections that have not proven themselves yet, at most: past it the oldest
#: is dropped (the member the chain waits for proves itself within a round trip), so
#: silent connections cost at most this many descriptors and never shut the listener.
MAX_PENDING = 64
#: Most buffers one ``sendmsg`` takes (under the kernel's IOV_MAX of 1024).
_IOV = 256
#: Most bytes one ``recv_into`` asks for.
_RECV_MAX = 1 << 22


# -- the record plan (pure) -------------------------------------------------------------------


def plan_records(sizes: Sequence[int], chunk: int) -> list[list[tuple[int, int, int]]]:
    """The records of a payload of tensors of ``sizes`` bytes, cut every ``chunk`` bytes
    of the tensors laid end to end: each record is its ``(tensor, start, end)`` pieces.

    The last record holds what is left (a payload need not be a multiple of ``chunk``);
    empty tensors have no pieces. Raises ``ValueError`` for a ``chunk`` below 1.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1 byte, got {chunk}")
    records: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    room = chunk
    for i, size in enumerate(sizes):
        start = 0
        while start < size:
            take = min(room, size - start)
            current.append((i, start, start + take))
            start += take
            room -= take
            if room == 0:
                records.append(current)
                current, room = [], chunk
    if current:
        records.append(current)
    return records


#: Records are cut no finer than this (a record costs a header and a turn of the loop).
MIN_RECORD = 64 << 10


def record_size(payload: int, hops: int, largest: int) -> int:
    """The record size of a ``payload``-byte broadcast along a chain of ``hops`` links:
    ``largest`` (``RLCOMM_BCAST_CHUNK_BYTES``), but cut finer, down to
    :data:`MIN_RECORD`, so that the payload has at least two records per link. A payload
    of one or two records would cross each link whole before the next could start, as
    a store-and-forward line; cut in ``2 * hops`` it reaches the last node after about
    1.5 transfer times, however many links there are."""
    want = -(-payload // max(1, 2 * hops))
    return max(min(largest, MIN_RECORD), min(largest, want))


def record_bytes(record: Sequence[tuple[int, int, int]]) -> int:
    return sum(end - start for _, start, end in record)


def check_record(
    kind: int, reason: int, index: int, length: int, *, downstream: bool, members: int,
    next_record: int, lengths: Sequence[int], count: int = 0, report_bytes: int = 0,
) -> None:
    """Refuse a record header that the stream's other end cannot have meant to send.

    Args:
        downstream: whether it came from upstream (``DATA``, ``WAIT``, ``ABORT``), or
            from downstream (``WAIT``, ``DONE``).
        members: the group's size (members are indices below it).
        next_record: the ``DATA`` record expected next.
        lengths: every record's length.
        count: the header's count (of a ``DONE``'s reports; 0 in any other record).
        report_bytes: each report's size (0: the run asks for none).

    Raises:
        ProtocolMismatchError: saying what is wrong.
    """
    allowed = (DATA, WAIT, ABORT) if downstream else (WAIT, DONE)
    if kind not in allowed:
        raise ProtocolMismatchError(f"a chain record of kind {kind} on this side of a link")
    if count and (kind != DONE or not report_bytes or count > members):
        raise ProtocolMismatchError(f"a chain record of kind {kind} with {count} reports")
    if kind == DATA:
        if index != next_record or next_record >= len(lengths) or length != lengths[index]:
            raise ProtocolMismatchError(
                f"chain record {index} of {length} bytes, where record {next_record} of "
                f"{lengths[next_record] if next_record < len(lengths) else 0} bytes is due"
            )
        return
    if kind == DONE:
        if index > members or length != index * FAILURE.size + count * (
                REPORTER.size + report_bytes):
            raise ProtocolMismatchError(
                f"a chain DONE of {index} failures and {count} reports in {length} bytes")
        return
    if index >= members or length:
        raise ProtocolMismatchError(f"a chain record naming member {index} of {members}")
    if kind == ABORT and reason not in REASONS:
        raise ProtocolMismatchError(f"a chain ABORT with reason {reason}")


def pack_failures(failures: dict[int, int]) -> bytes:
    return b"".join(FAILURE.pack(m, r) for m, r in sorted(failures.items()))


def pack_reports(reports: dict[int, bytes]) -> bytes:
    return b"".join(REPORTER.pack(m) + r for m, r in sorted(reports.items()))


def unpack_reports(data: bytes, count: int, size: int, members: int) -> dict[int, bytes]:
    """The reports of a ``DONE`` record's body past its failures (checked: ``count``
    reports of ``size`` bytes, from distinct members)."""
    out = {}
    step = REPORTER.size + size
    for offset in range(0, count * step, step):
        (member,) = REPORTER.unpack_from(data, offset)
        if member >= members or member in out:
            raise ProtocolMismatchError(f"a chain DONE with a report from member {member}")
        out[member] = bytes(data[offset + REPORTER.size : offset + step])
    return out


def unpack_failures(data: bytes, members: int) -> dict[int, int]:
    """The failures of a ``DONE`` record's body (checked: members and reasons known)."""
    out = {}
    for offset in range(0, len(data), FAILURE.size):
        member, reason = FAILURE.unpack_from(data, offset)
        if member >= members or reason not in REASONS:
            raise ProtocolMismatchError(f"a chain DONE naming member {member}, reason {reason}")
        out[member] = reason
    return out


# -- the handshake (pure) ---------------------------------------------------------------------


def group_key(secret: bytes, group: str) -> bytes:
    """The key of one broadcast group's links, from the job's secret."""
    return hmac.new(secret, b"rlcomm-bcast-chain|" + group.encode(), hashlib.sha256).digest()


def upstream_proof(key: bytes, nonce_down: bytes, hello: bytes, nonce_up: bytes) -> bytes:
    return hmac.new(key, b"up" + nonce_down + hello + nonce_up, hashlib.sha256).digest()


def downstream_proof(key: bytes, nonce_up: bytes, nonce_down: bytes, hello: bytes) -> bytes:
    return hmac.new(key, b"down" + nonce_up + nonce_down + hello, hashlib.sha256).digest()


# -- sockets ------------------------------------------------------------------------------------


class ChainListener:
    """The socket a member's upstream neighbours connect to, bound to ``host`` (this
    node's address; ``port`` 0: any free one). One per member of a broadcast group;
    :class:`ChainRun` accepts from it during a broadcast, nobody in between."""

    def __init__(self, host: str, port: int = 0):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind((host, port))
            self.sock.listen(128)
            self.sock.setblocking(False)
        except BaseException:
            self.sock.close()
            raise
        self.address = f"{host}:{self.sock.getsockname()[1]}"

    def close(self) -> None:
        self.sock.close()

    def __repr__(self) -> str:
        return f"ChainListener({self.address})"


def parse_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ProtocolMismatchError(f"not a chain listener's address: {text!r}")
    return host, int(port)


class _Gone(Exception):
    """The other end of a link closed it or reset it (the peer's process is gone)."""


class _Refused(Exception):
    """The other end of a link failed its proof or broke the protocol."""


class _Link:
    """One end of a link of one broadcast: a non-blocking socket, the bytes queued to go
    out, and the bytes being read in.

    ``stage`` is ``connecting`` (the connecting end, until the socket connects),
    ``nonce`` (it waits for the accepting end's nonce), ``proof`` (the connecting end
    waits for the accepting end's proof; the accepting end for the hello and its proof),
    then ``ready``.
    """

    def __init__(self, sock: socket.socket, peer: int | None, stage: str):
        self.sock = sock
        self.peer = peer
        self.stage = stage
        self.out: deque[memoryview] = deque()
        self.queued_total = 0  # bytes ever queued
        self.sent_total = 0  # bytes the socket ever took
        self.buf = bytearray()  # a handshake's or a record header's bytes so far
        self.want = 0  # how many bytes ``buf`` is to hold
        self.opened = time.monotonic()
        self.nonce = b""  # this end's
        self.hello = b""

    @property
    def ready(self) -> bool:
        return self.stage == "ready"

    @property
    def unsent(self) -> int:
        return self.queued_total - self.sent_total

    def queue(self, *buffers: bytes | memoryview) -> None:
        for b in buffers:
            view = memoryview(b).cast("B")
            if len(view):
                self.out.append(view)
                self.queued_total += len(view)

    def take_back(self, nbytes: int) -> None:
        """Unqueue the last ``nbytes`` (whole buffers none of which began to go)."""
        while nbytes > 0:
            tail = self.out.pop()
            nbytes -= len(tail)
            self.queued_total -= len(tail)

    def flush(self) -> None:
        """Write what the socket takes now. Raises :class:`_Gone` when it is closed."""
        while self.out:
            batch = [self.out[i] for i in range(min(len(self.out), _IOV))]
            try:
                sent = self.sock.sendmsg(batch)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                raise _Gone(exc.strerror or str(exc)) from exc
            self.sent_total += sent
            while sent:
                head = self.out[0]
                if sent >= len(head):
                    sent -= len(head)
                    self.out.popleft()
                else:
                    self.out[0] = head[sent:]
                    sent = 0

    def fill(self) -> bool:
        """Read into ``buf`` until it holds ``want`` bytes (True) or the socket has no
        more now (False). Raises :class:`_Gone` at the end of the stream."""
        while len(self.buf) < self.want:
            try:
                data = self.sock.recv(self.want - len(self.buf))
            except (BlockingIOError, InterruptedError):
                return False
            except OSError as exc:
                raise _Gone(exc.strerror or str(exc)) from exc
            if not data:
                raise _Gone("the connection was closed")
            self.buf += data
        return True

    def expect(self, nbytes: int) -> None:
        self.buf, self.want = bytearray(), nbytes

    def recv_into(self, view: memoryview) -> int:
        """Read into ``view`` what the socket has now (0: nothing yet)."""
        try:
            n = self.sock.recv_into(view, min(len(view), _RECV_MAX))
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as exc:
            raise _Gone(exc.strerror or str(exc)) from exc
        if n == 0:
            raise _Gone("the connection was closed")
        return n

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


# -- one broadcast at one member ----------------------------------------------------------------


@dataclass
class ChainOutcome:
    """How a broadcast went at one member of its chain.

    Args:
        upstream_error: ``(member, reason)`` when the payload did not come whole: the
            member the chain failed at, and why (this member's own index when it
            refused the payload).
        failures: members that did not get it, by reason, as far as this member knows:
            the members after it along the chain and their node-mates (from ``DONE``),
            and its own node-mates (from ``local``).
        local: the hand-off to this member's node-mates, when one started (its result:
            failures by member).
        reports: in a run that asks for them, the report of each member after this one
            (from ``DONE``), and this member's own.
    """

    upstream_error: tuple[int, int] | None = None
    failures: dict[int, int] = field(default_factory=dict)
    local: concurrent.futures.Future | None = None
    reports: dict[int, bytes] = field(default_factory=dict)


class ChainRun:
    """One broadcast along a chain, at one of its members (see the module docstring).
    One thread runs it (:meth:`run`); its counters may be read by any (progress).

    Args:
        index: this member.
        src: the source member.
        upstream: the member this one receives from (``None`` at the source).
        downstream: the member this one passes the payload to (``None`` at the end).
        members: the group's size.
        run_id: the broadcast's id (the source picks it at random; it is in the frame).
        key: the group's key (:func:`group_key`).
        records: the record plan (:func:`plan_records`).
        views: one byte ``memoryview`` per tensor of the payload (writable where this
            member receives).
        listener: this member's listener (``None`` at the source).
        downstream_address: gives ``host:port`` of the downstream member's listener.
        upstream_address: gives ``host:port`` of the upstream member's listener, to probe
            while its link is not there (``None``: it has none, or do not probe).
        host: this node's address (the outgoing link binds to it; ``None``: any).
        deadline: the op's deadline (monotonic seconds).
        slack: a relay gives up on its neighbours this many seconds before
            ``deadline``, so that what it says about them arrives in time.
        heartbeat: seconds between ``WAIT`` records while waiting.
        on_received: called once the payload is all here (at once at the source):
            starts the hand-off to this member's node-mates and returns its future (its
            result: failures by member), or ``None`` when there are none.
        refuse: this member does not take the payload (over its size limit): it tells
            both neighbours and ends.
        report_bytes: the size of each member's report (0: the run asks for none).
        report: this member's report (a relay's, in a run that asks for them), sent up
            with the reports of the members after it in ``DONE``.
    """

    def __init__(
        self, *, index: int, src: int, upstream: int | None, downstream: int | None,
        members: int, run_id: int, key: bytes, records: list[list[tuple[int, int, int]]],
        views: Sequence[memoryview], listener: ChainListener | None,
        downstream_address: Callable[[], str] | None, host: str | None, deadline: float,
        slack: float = 0.0, heartbeat: float = 1.0,
        upstream_address: Callable[[], str] | None = None,
        on_received: Callable[[], concurrent.futures.Future | None] | None = None,
        refuse: bool = False, report_bytes: int = 0, report: bytes | None = None,
    ):
        if (report is not None and len(report) != report_bytes) or (
                report is None and report_bytes and upstream is not None):
            raise ValueError(f"a chain report of {len(report or b'')} bytes, where "
                             f"{report_bytes} are due")
        self.index, self.src = index, src
        self.upstream, self.downstream = upstream, downstream
        self.members = members
        self.run_id = run_id
        self._key = key
        self._records = records
        self._lengths = [record_bytes(r) for r in records]
        self._views = list(views)
        self._listener = listener
        self._downstream_address = downstream_address
        self._upstream_address = upstream_address
        self._host = host
        self._deadline = deadline
        self._give_up = deadline if upstream is None else deadline - slack
        self._gave_up = False
        self._heartbeat = heartbeat
        self._on_received = on_received
        self.refuse = refuse
        # -- progress: written by the running thread only -----------------------------------
        self.received = len(records) if upstream is None else 0  # whole records held
        self.queued = 0  # records queued on the downstream link
        self.forwarded = 0  # records the downstream link took whole
        self.waiting_up: int | None = None  # whom the upstream member said it waits on
        self.waiting_down: int | None = None  # whom the downstream member said it waits on
        self.outcome = ChainOutcome()
        self._report_bytes = report_bytes
        if report is not None:
            self.outcome.reports[index] = report
        if refuse:
            self.outcome.upstream_error = (index, REFUSED)
        # -- links ----------------------------------------------------------------------------
        self.up: _Link | None = None
        self.down: _Link | None = None
        self.down_done = downstream is None  # DONE came, or the downstream member failed
        self._pending: list[_Link] = []  # accepted, not yet proven
        self._ends: deque[int] = deque()  # down.queued_total at the end of each queued record
        self._piece = 0  # of the record being read: its piece, and the offset in it
        self._offset = 0
        self._in_record = False
        # (kind, index, count) of a DONE/WAIT body being read
        self._down_record: tuple[int, int, int] | None = None
        self._done_sent = upstream is None
        self._abort_sent = False
        self._next_beat = time.monotonic() + heartbeat
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._wake_lock = threading.Lock()  # the pipe is closed under it
        self._closed = False

    @property
    def total(self) -> int:
        return len(self._records)

    def __repr__(self) -> str:
        return (
            f"ChainRun(member {self.index}: {self.upstream} -> {self.index} -> "
            f"{self.downstream}, received {self.received}/{self.total}, forwarded "
            f"{self.forwarded}, waiting up {self.waiting_up}, down {self.waiting_down}, "
            f"{self.outcome})"
        )

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> ChainOutcome:
        """Run the broadcast here until it is done, failed, or past its deadline."""
        try:
            if self.downstream is not None:
                self._connect()
            if self.upstream is None:
                self._start_local()
            while not self._finished():
                now = time.monotonic()
                if now >= self._give_up and not self._gave_up:
                    self._gave_up = True
                    self._time_out()
                    continue
                if now >= self._deadline:
                    break
                self._beat(now)
                until = self._deadline if self._gave_up else self._give_up
                self._step(min(self._next_beat, until) - now)
        finally:
            self._close()
        return self.outcome

    def _finished(self) -> bool:
        out = self.outcome
        down = self.down
        if out.upstream_error is not None:
            # Ends once ABORT went downstream (or cannot go), and a refusal's DONE went up.
            if self.refuse and not self._done_sent:
                return False
            if self.up is not None and self.up.out:
                return False
            return self.down_done or down is None or (self._abort_sent and not down.out)
        if self.received < self.total:
            return False
        if out.local is not None:
            if not out.local.done():
                return False
            self._merge_local()
        if not self.down_done:
            return False
        if not self._done_sent:
            self._send_done()
        return self.up is None or not self.up.out

    def _step(self, timeout: float) -> None:
        poller = select.poll()
        links: dict[int, _Link] = {}
        watched = [(link, select.POLLIN) for link in self._pending]
        up, down = self.up, self.down
        if up is None and self._listener is not None:
            poller.register(self._listener.sock, select.POLLIN)
        elif up is not None:  # read while records are due (an EOF stays readable)
            due = self.received < self.total and self.outcome.upstream_error is None
            watched.append((up, (select.POLLIN if due else 0) | (select.POLLOUT if up.out else 0)))
        if down is not None:
            events = 0 if self.down_done else select.POLLIN
            if down.out or down.stage == "connecting":
                events |= select.POLLOUT
            watched.append((down, events))
        for link, events in watched:
            if events:
                poller.register(link.sock, events)
                links[link.sock.fileno()] = link
        poller.register(self._wake_r, select.POLLIN)
        for fd, events in poller.poll(max(0.0, timeout) * 1000):
            if fd == self._wake_r:
                try:
                    os.read(self._wake_r, 64)
                except BlockingIOError:
                    pass
            elif link := links.get(fd):
                self._service(link, events)
            elif self._listener is not None and fd == self._listener.sock.fileno():
                self._accept()
        now = time.monotonic()
        for link in [p for p in self._pending if now - p.opened > HANDSHAKE_TIMEOUT]:
            self._pending.remove(link)
            link.close()

    def _service(self, link: _Link, events: int) -> None:
        if link is self.down:
            try:
                if link.stage == "connecting":
                    self._connected(link)
                # Read first: what the other end said before it closed (an early DONE)
                # is still there to read once its reset arrived.
                if events & (select.POLLIN | select.POLLHUP | select.POLLERR):
                    self._read_down(link)
                if link.ready and self.outcome.upstream_error is not None:
                    self._send_abort()
                if link.out and not self.down_done:
                    link.flush()
                    self._note_forwarded()
            except _Gone as exc:
                self._down_broke(exc)
            except _Refused as exc:
                self._lost_down(REFUSED, str(exc))
        elif link is self.up:
            try:
                if link.out:
                    link.flush()
                if events & (select.POLLIN | select.POLLHUP | select.POLLERR):
                    self._read_up(link)
            except _Gone:
                self._lost_up(LOST)
            except _Refused:
                self._lost_up(REFUSED)
        else:
            try:
                self._prove_accepted(link)
            except (_Gone, _Refused):
                if link in self._pending:
                    self._pending.remove(link)
                link.close()

    # -- making links ------------------------------------------------------------------------

    def _connect(self) -> None:
        assert self.downstream is not None and self._downstream_address is not None
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.down = _Link(sock, self.downstream, "connecting")
        try:
            host, port = parse_address(self._downstream_address())
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._host:
                try:
                    sock.bind((self._host, 0))
                except OSError:
                    pass  # not an address of this machine: the kernel picks
            sock.setblocking(False)
            code = sock.connect_ex((host, port))
        except TimeoutError as exc:
            self._lost_down(TIMEOUT, f"cannot connect: {exc}")
            return
        except (OSError, ProtocolMismatchError) as exc:
            self._lost_down(LOST, f"cannot connect: {exc}")
            return
        if code not in (0, errno.EINPROGRESS, errno.EAGAIN):
            self._lost_down(LOST, f"cannot connect: {os.strerror(code)}")

    def _connected(self, link: _Link) -> None:
        code = link.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if code == errno.EINPROGRESS:
            return
        if code:
            raise _Gone(f"cannot connect: {os.strerror(code)}")
        link.stage = "nonce"
        link.expect(NONCE)

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, _ = self._listener.sock.accept()
            except OSError:  # nothing more now (or an aborted connection)
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            link = _Link(sock, None, "proof")
            link.nonce = os.urandom(NONCE)
            link.expect(HELLO.size + NONCE + MAC)
            try:
                sock.send(link.nonce)  # a fresh socket takes 32 bytes at once
            except OSError:
                sock.close()
                continue
            self._pending.append(link)
            if len(self._pending) > MAX_PENDING:
                self._pending.pop(0).close()

    def _prove_accepted(self, link: _Link) -> None:
        """An accepted connection's hello, checked before anything of it is believed."""
        if not link.fill():
            return
        hello = bytes(link.buf[: HELLO.size])
        nonce_up = bytes(link.buf[HELLO.size : HELLO.size + NONCE])
        mac = bytes(link.buf[HELLO.size + NONCE :])
        if not hmac.compare_digest(mac, upstream_proof(self._key, link.nonce, hello, nonce_up)):
            raise _Refused("a connection to the chain listener failed its proof")
        self._pending.remove(link)
        want = HELLO.pack(self.run_id, self.src, self.upstream or 0, self.index)
        if hello != want or self.up is not None:
            link.close()  # a link of another broadcast (one that timed out here)
            return
        link.queue(downstream_proof(self._key, nonce_up, link.nonce, hello))
        link.peer, link.stage = self.upstream, "ready"
        link.expect(RECORD.size)
        self.up = link
        link.flush()
        if self.refuse:
            self._send_done()

    def _read_down(self, link: _Link) -> None:
        """What the downstream member sends: its nonce and proof, then WAIT and DONE."""
        if link.stage == "nonce":
            if not link.fill():
                return
            nonce_down = bytes(link.buf)
            link.nonce = os.urandom(NONCE)
            link.hello = HELLO.pack(self.run_id, self.src, self.index, self.downstream)
            link.queue(link.hello, link.nonce,
                       upstream_proof(self._key, nonce_down, link.hello, link.nonce))
            link.flush()
            link.stage = "proof"
            link.buf, link.want = bytearray(nonce_down), NONCE + MAC
        if link.stage == "proof":
            if not link.fill():
                return
            nonce_down, mac = bytes(link.buf[:NONCE]), bytes(link.buf[NONCE:])
            if not hmac.compare_digest(
                mac, downstream_proof(self._key, link.nonce, nonce_down, link.hello)
            ):
                raise _Refused("the downstream member failed its proof")
            link.stage = "ready"
            link.expect(RECORD.size)
            if self.outcome.upstream_error is None:
                self._queue_records()  # written once what came with the proof is read
        while not self.down_done:
            if self._down_record is None:
                if not link.fill():
                    return
                kind, reason, count, index, length = RECORD.unpack(bytes(link.buf))
                try:
                    check_record(kind, reason, index, length, downstream=False,
                                 members=self.members, next_record=0, lengths=(),
                                 count=count, report_bytes=self._report_bytes)
                except ProtocolMismatchError as exc:
                    raise _Refused(str(exc)) from exc
                self._down_record = (kind, index, count)
                link.expect(length)
            if not link.fill():
                return
            (kind, index, count), body = self._down_record, bytes(link.buf)
            self._down_record = None
            link.expect(RECORD.size)
            if kind == WAIT:
                self.waiting_down = index
                continue
            split = index * FAILURE.size
            try:
                failures = unpack_failures(body[:split], self.members)
                reports = unpack_reports(body[split:], count, self._report_bytes,
                                         self.members)
            except ProtocolMismatchError as exc:
                raise _Refused(str(exc)) from exc
            for member, reason in failures.items():
                self.outcome.failures.setdefault(member, reason)
            for member, report in reports.items():
                self.outcome.reports.setdefault(member, report)
            self.down_done = True
            if self.forwarded < self.total:  # an early DONE: it refused; send no more
                link.out.clear()

    def _read_up(self, link: _Link) -> None:
        """The upstream stream: DATA into the payload's views, WAIT, ABORT."""
        while self.received < self.total and self.outcome.upstream_error is None:
            if not self._in_record:
                if not link.fill():
                    return
                kind, reason, count, index, length = RECORD.unpack(bytes(link.buf))
                link.expect(RECORD.size)
                try:
                    check_record(kind, reason, index, length, downstream=True,
                                 members=self.members, next_record=self.received,
                                 lengths=self._lengths, count=count)
                except ProtocolMismatchError as exc:
                    raise _Refused(str(exc)) from exc
                if kind == WAIT:
                    self.waiting_up = index
                    continue
                if kind == ABORT:
                    self._fail_up(index, reason)
                    return
                self._in_record, self._piece, self._offset = True, 0, 0
                self.waiting_up = None
            record = self._records[self.received]
            while self._piece < len(record):
                tensor, start, end = record[self._piece]
                n = link.recv_into(self._views[tensor][start + self._offset : end])
                if n == 0:
                    return
                self._offset += n
                if start + self._offset == end:
                    self._piece, self._offset = self._piece + 1, 0
            self._in_record = False
            self.received += 1
            self._forward()
            if self.received == self.total:
                self._start_local()

    # -- sending ------------------------------------------------------------------------------

    def _forward(self) -> None:
        """Queue the records held but not queued yet on the downstream link, and write."""
        link = self.down
        if link is None or not link.ready or self.down_done:
            return
        self._queue_records()
        try:
            link.flush()
        except _Gone as exc:
            self._down_broke(exc)
            return
        self._note_forwarded()

    def _queue_records(self) -> None:
        link = self.down
        assert link is not None
        while self.queued < self.received:
            k = self.queued
            link.queue(RECORD.pack(DATA, 0, 0, k, self._lengths[k]),
                       *(self._views[t][s:e] for t, s, e in self._records[k]))
            self._ends.append(link.queued_total)
            self.queued += 1

    def _note_forwarded(self) -> None:
        link = self.down
        while link is not None and self._ends and link.sent_total >= self._ends[0]:
            self._ends.popleft()
            self.forwarded += 1

    def _send_done(self) -> None:
        if self._done_sent or self.up is None or not self.up.ready:
            return
        failures = dict(self.outcome.failures)
        if self.refuse:
            failures[self.index] = REFUSED
        reports = self.outcome.reports
        body = pack_failures(failures) + pack_reports(reports)
        self.up.queue(RECORD.pack(DONE, 0, len(reports), len(failures), len(body)), body)
        self._done_sent = True
        try:
            self.up.flush()
        except _Gone:
            self.up.out.clear()

    def _send_abort(self) -> None:
        error, link = self.outcome.upstream_error, self.down
        if error is None or link is None or not link.ready or self._abort_sent or self.down_done:
            return
        self._abort_sent = True
        # Whole records only: those none of whose bytes went are taken back.
        while self._ends and self.queued > self.forwarded:
            size = RECORD.size + self._lengths[self.queued - 1]
            if self._ends[-1] - size < link.sent_total:
                break  # it began to go: it goes whole
            link.take_back(size)
            self._ends.pop()
            self.queued -= 1
        culprit, reason = error
        link.queue(RECORD.pack(ABORT, reason, 0, culprit, 0))
        try:
            link.flush()
        except _Gone:
            link.out.clear()

    def _beat(self, now: float) -> None:
        """Now and then, say whom this member waits on, to each side that waits on it."""
        if now < self._next_beat:
            return
        self._next_beat = now + self._heartbeat
        down, up = self.down, self.up
        if up is None and self.outcome.upstream_error is None and not self.refuse:
            self._probe_upstream()
        if (down is not None and down.ready and not down.out and not self.down_done
                and self.upstream is not None and self.outcome.upstream_error is None
                and self.received < self.total):
            culprit = self.waiting_up if self.waiting_up is not None else self.upstream
            down.queue(RECORD.pack(WAIT, 0, 0, culprit, 0))
            try:
                down.flush()
            except _Gone as exc:
                self._lost_down(LOST, str(exc))
        if up is not None and up.ready and not self._done_sent and self.received == self.total:
            if not self.down_done:
                culprit = self.waiting_down if self.waiting_down is not None else self.downstream
            else:
                culprit = self.index  # the hand-off to this member's node-mates
            up.queue(RECORD.pack(WAIT, 0, 0, culprit, 0))  # type: ignore[arg-type]
            try:
                up.flush()
            except _Gone:
                self._lost_up(LOST)

    def _probe_upstream(self) -> None:
        """Whether the upstream member's process is gone: its listener refuses."""
        if self._upstream_address is None:
            return
        try:
            host, port = parse_address(self._upstream_address())
        except (OSError, ProtocolMismatchError):
            return
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.settimeout(min(0.25, self._heartbeat))
            if self._host:
                try:
                    sock.bind((self._host, 0))
                except OSError:
                    pass
            code = sock.connect_ex((host, port))
        except OSError:
            return
        finally:
            sock.close()
        if code == errno.ECONNREFUSED:
            self._fail_up(self.upstream, LOST)  # type: ignore[arg-type]

    # -- failures -----------------------------------------------------------------------------

    def _down_broke(self, exc: _Gone) -> None:
        """A write to the downstream link failed: what its end said before it closed
        the link (an early DONE) is still there to read; without it, the end is gone."""
        if self.down is not None and self.down.ready:
            try:
                self._read_down(self.down)
            except (_Gone, _Refused):
                pass
        self._lost_down(LOST, str(exc))

    def _lost_down(self, reason: int, why: str) -> None:
        """The downstream link broke (or its end broke the protocol): nothing more goes."""
        if self.down is not None:
            self.down.out.clear()
        if not self.down_done:
            # A member told to stop (ABORT) closes its link: that is no failure of its own,
            # and the upstream error already says why it has nothing.
            if not self._abort_sent:
                self.outcome.failures.setdefault(self.downstream, reason)  # type: ignore[arg-type]
            self.down_done = True

    def _lost_up(self, reason: int) -> None:
        """The upstream link broke: a failure unless the payload is all here already
        (then only this member's DONE cannot go: the upstream member is gone)."""
        if self.up is not None:
            self.up.out.clear()
        if self.received < self.total:
            self._fail_up(self.upstream, reason)  # type: ignore[arg-type]
        else:
            self._done_sent = True

    def _fail_up(self, culprit: int, reason: int) -> None:
        if self.outcome.upstream_error is None:
            self.outcome.upstream_error = (culprit, reason)
            self._send_abort()

    def _time_out(self) -> None:
        """This member gives up: note whom it waited on (told on, until the deadline)."""
        if self.received < self.total:
            culprit = self.waiting_up if self.waiting_up is not None else self.upstream
            self._fail_up(culprit, TIMEOUT)  # type: ignore[arg-type]
            return
        if not self.down_done:
            culprit = self.waiting_down if self.waiting_down is not None else self.downstream
            self.outcome.failures.setdefault(culprit, TIMEOUT)  # type: ignore[arg-type]
            self.down_done = True
            if self.down is not None:
                self.down.out.clear()

    # -- the hand-off to node-mates -------------------------------------------------------------

    def _start_local(self) -> None:
        if self._on_received is None or self.outcome.local is not None:
            return
        future = self._on_received()
        if future is None:
            return
        self.outcome.local = future
        future.add_done_callback(self._wake)

    def _wake(self, _: concurrent.futures.Future) -> None:
        with self._wake_lock:
            if not self._closed:
                try:
                    os.write(self._wake_w, b"x")
                except BlockingIOError:  # already awake
                    pass

    def _merge_local(self) -> None:
        """The node-mates that the finished hand-off did not reach, into the failures."""
        local = self.outcome.local
        if local is None or not local.done() or local.exception() is not None:
            return
        for member, reason in (local.result() or {}).items():
            self.outcome.failures.setdefault(member, reason)

    def _close(self) -> None:
        self._merge_local()
        for link in (self.up, self.down, *self._pending):
            if link is not None:
                link.close()
        self._pending.clear()
        with self._wake_lock:
            self._closed = True
            os.close(self._wake_r)
            os.close(self._wake_w)
