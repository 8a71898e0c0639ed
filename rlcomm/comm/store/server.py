"""The server side of rlcomm's authenticated store (see :mod:`rlcomm.comm.store.client`): its
key table, the one thread that serves every client from an event loop, and the owner's
own reads without a connection (:func:`local_reader`).

One thread (``rlcomm-store``) owns the listening socket and every client socket, and
waits on all of them at once (``selectors``). Each client's protocol is a
:class:`~rlcomm.comm.store.session.Session` (sans-IO); the loop only moves bytes, runs
requests on the table, and keeps deadlines:

- a connection that has not proven it belongs to the job costs a socket and a few
  hundred bytes, no thread: it must send its proof whole within the
  ``store_auth_timeout`` setting (2 s) of its accept, or it is dropped. Nothing it sends
  is decoded;
- at most the ``store_max_connections`` setting connections are open at once; a new
  one beyond that drops the oldest connection that has not proven itself (or, when all
  have, is closed at once);
- requests that wait for a key (``get``, ``wait``, ``take``) are *parked* with their
  deadline and answered when the key is written or the deadline passes: no wait ever
  blocks the loop. The ``status`` request runs on a thread of its own
  (``rlcomm-status``), so a report that is slow to gather never holds up the loop;
- every ready client is served in turn, one request (and at most
  :data:`~rlcomm.comm.store.session.READ_CHUNK` bytes) per turn, so proven clients are
  served whatever unproven ones do.

The table is also read by the owning process itself (the mailbox takes its notes with
:func:`local_reader`), under the table's condition; the loop writes under it too.
"""

from __future__ import annotations

import collections
import concurrent.futures
import errno
import heapq
import itertools
import logging
import os
import queue
import resource
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from rlcomm.comm.store.session import Phase, Session
from rlcomm.comm.store.wire import (
    HANDSHAKE_SECONDS,
    LEN,
    NONCE,
    OP_ADD,
    OP_APPEND,
    OP_CHECK,
    OP_CSET,
    OP_DELETE,
    OP_GET,
    OP_NUM_KEYS,
    OP_SET,
    OP_STATUS,
    OP_TAKE,
    OP_WAIT,
    decode,
    encode,
)
from rlcomm.settings import get_settings

logger = logging.getLogger(__name__)

#: Connections the loop accepts per turn before it serves its clients again.
_ACCEPTS_PER_TURN = 64
#: Seconds the loop stops accepting when the process is out of file descriptors and no
#: unproven connection can be dropped to free one.
_FD_PAUSE = 0.1
#: Seconds between two log lines about dropped connections (the first is logged at once).
_LOG_EVERY = 10.0
#: Connections kept free of the store's bound for the rest of the process (its
#: transports, files), when the process's descriptor limit is the tighter bound.
_FD_RESERVE = 256

#: A status provider: ``status(detail) -> bytes`` (the report, encoded), run on the
#: server's status thread.
StatusProvider = Callable[[str], bytes]


class _Table:
    """The keys of one server. The loop thread writes them; a thread of the owning
    process may read and take keys (:func:`local_reader`) under ``cond``."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.cond = threading.Condition()


class _Parked:
    """A request waiting for keys: ``get``, ``take`` (one key) or ``wait`` (all keys)."""

    __slots__ = ("client", "op", "keys", "deadline", "done")

    def __init__(self, client: _Client, op: int, keys: list[str], deadline: float):
        self.client = client
        self.op = op
        self.keys = keys
        self.deadline = deadline
        self.done = False


class _Client:
    """A client socket and its session (the loop's bookkeeping of one connection)."""

    __slots__ = ("sock", "addr", "session", "out", "out_since", "events", "parked", "timer")

    def __init__(self, sock: socket.socket, addr: Any, session: Session):
        self.sock = sock
        self.addr = addr
        self.session = session
        self.out = bytearray()
        self.out_since = 0.0  # when unsent output began to wait for the client
        self.events = 0  # what the selector watches for
        self.parked: _Parked | None = None
        self.timer: float | None = None  # the deadline the loop has a timer for


def _default_max_connections() -> int:
    """The ``store_max_connections`` setting, within what the process's descriptor limit
    leaves beside :data:`_FD_RESERVE`."""
    wanted = get_settings().store_max_connections
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(16, min(wanted, soft - _FD_RESERVE))


class StoreServer:
    """The store server of this process (its mailbox), on ``host`` (see module docstring).

    Args:
        host: the node address to bind (never all interfaces).
        secret: the job's secret; clients must prove they hold it.
        status: answers a client's ``status`` request (on the server's status thread);
            ``None``: the request is answered with nothing.
        max_connections: the most connections open at once (default: the
            ``store_max_connections`` setting, within the process's descriptor limit).
        auth_timeout: seconds a new connection has to prove itself (default: the
            ``store_auth_timeout`` setting).
    """

    def __init__(self, host: str, secret: bytes, *, status: StatusProvider | None = None,
                 max_connections: int | None = None, auth_timeout: float | None = None):
        if not secret:
            raise ValueError("StoreServer needs the job's secret")
        self._secret = secret
        self._status = status
        self.max_connections = (
            _default_max_connections() if max_connections is None else max_connections
        )
        self.auth_timeout = (
            get_settings().store_auth_timeout if auth_timeout is None else auth_timeout
        )
        self.table = _Table()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, 0), family=family, backlog=1024)
        self._listener.setblocking(False)
        self.host = host
        self.port = self._listener.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._clients: set[_Client] = set()
        # Unproven connections in accept order, which is their deadline order.
        self._unproven: collections.OrderedDict[_Client, None] = collections.OrderedDict()
        self._status_clients: set[_Client] = set()  # their status report is being made
        self._ready: set[_Client] = set()  # clients with a whole request buffered
        self._timers: list[tuple[float, int, object]] = []  # parked requests, frame deadlines
        self._seq = itertools.count()
        self._waiting: dict[str, list[_Parked]] = {}
        self._status_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._status_done: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_lock = threading.Lock()  # the wake pipe's write end is closed under it
        self._accept_paused_until = 0.0
        self._closed = False
        #: Why connections ended before proving themselves, by reason (for stats and logs).
        self.counts = {"wrong_proof": 0, "no_proof_in_time": 0, "evicted": 0,
                       "refused_full": 0, "closed_unproven": 0}
        self._logged = dict(self.counts)
        self._last_log = 0.0
        self._thread = threading.Thread(target=self._run, name="rlcomm-store", daemon=True)
        self._thread.start()

    # -- public ---------------------------------------------------------------------------

    @property
    def rejected(self) -> int:
        """Connections that ended without proving they belong to the job."""
        c = self.counts
        return c["wrong_proof"] + c["no_proof_in_time"] + c["evicted"] + c["closed_unproven"]

    def stats(self) -> dict[str, int]:
        """Connections open now (proven and not), requests parked, and why connections
        ended unproven (read without a lock: a snapshot that may be a moment old)."""
        clients = list(self._clients)
        out = {
            "connections": len(clients),
            "unproven": len(self._unproven),
            "parked": sum(1 for c in clients if c.parked is not None),
            "max_connections": self.max_connections,
        }
        out["proven"] = out["connections"] - out["unproven"]
        out.update(self.counts)
        out["rejected"] = self.rejected
        return out

    def close(self) -> None:
        """Stop serving: the loop closes every connection and the listening socket."""
        self._closed = True
        self._wake()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)

    # -- the loop ---------------------------------------------------------------------------

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_w < 0:
                return  # the loop has ended
            try:
                os.write(self._wake_w, b"w")
            except BlockingIOError:
                pass  # full of wake-ups already

    def _run(self) -> None:
        try:
            while not self._closed:
                self._turn()
        except Exception:  # noqa: BLE001 - a bug here must be seen, not end the loop silently
            logger.exception("store %s:%s: the serving loop failed", self.host, self.port)
        finally:
            self._shutdown()

    def _turn(self) -> None:
        now = time.monotonic()
        timeout = 0.0 if self._ready else self._next_timeout(now)
        for key, mask in self._sel.select(timeout):
            now = time.monotonic()
            obj = key.fileobj
            if obj is self._listener:
                self._accept(now)
            elif obj == self._wake_r:
                _drain(self._wake_r)
            else:
                client: _Client = key.data
                try:
                    if mask & selectors.EVENT_WRITE:
                        self._flush(client, now)
                    if mask & selectors.EVENT_READ and client in self._clients:
                        self._read(client, now)
                except Exception:  # noqa: BLE001 - a bug must cost one client, not the store
                    self._failed(client)
        now = time.monotonic()
        self._finish_status(now)
        for client in list(self._ready):
            self._ready.discard(client)
            try:
                self._serve(client, now)
            except Exception:  # noqa: BLE001 - as above
                self._failed(client)
        self._expire(now)
        if self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            self._sel.register(self._listener, selectors.EVENT_READ)
        if now - self._last_log >= _LOG_EVERY:
            self._log_drops(now)

    def _failed(self, client: _Client) -> None:
        logger.exception("store %s:%s: serving client %s failed; it is dropped",
                         self.host, self.port, client.addr)
        client.session.end("failed in the server")
        self._drop(client)

    def _next_timeout(self, now: float) -> float | None:
        deadlines = []
        if self._unproven:
            first = next(iter(self._unproven))
            if first.session.deadline is not None:
                deadlines.append(first.session.deadline)
        if self._timers:
            deadlines.append(self._timers[0][0])
        if self._accept_paused_until:
            deadlines.append(self._accept_paused_until)
        if not deadlines:
            return None
        return max(0.0, min(deadlines) - now)

    # -- connections ------------------------------------------------------------------------

    def _accept(self, now: float) -> None:
        for _ in range(_ACCEPTS_PER_TURN):
            try:
                sock, addr = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    if not self._evict_oldest_unproven("the process is out of file descriptors"):
                        self._sel.unregister(self._listener)
                        self._accept_paused_until = now + _FD_PAUSE
                        logger.warning("store %s:%s: out of file descriptors with every "
                                       "connection proven; accepting again in %ss",
                                       self.host, self.port, _FD_PAUSE)
                        return
                    continue
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EINTR):
                    continue
                raise
            if len(self._clients) >= self.max_connections and not self._evict_oldest_unproven(
                f"over the limit of {self.max_connections} connections"
            ):
                self.counts["refused_full"] += 1
                sock.close()
                continue
            sock.setblocking(False)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            session = Session(self._secret, os.urandom(NONCE), now, self.auth_timeout)
            client = _Client(sock, addr, session)
            self._clients.add(client)
            self._unproven[client] = None
            self._send(client, session.greeting(), now)

    def _evict_oldest_unproven(self, why: str) -> bool:
        if not self._unproven:
            return False
        oldest, _ = self._unproven.popitem(last=False)
        oldest.session.end(f"dropped: {why}")
        self.counts["evicted"] += 1
        self._drop(oldest)
        return True

    def _read(self, client: _Client, now: float) -> None:
        session = client.session
        want = session.want()
        if want <= 0:
            return
        try:
            data = client.sock.recv(want)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            session.end(f"failed: {exc!r}")
            self._drop(client)
            return
        proven_before = session.phase is Phase.PROVEN
        proof = session.received(data, now)
        if session.phase is Phase.ENDED:
            if not proven_before:
                key = "wrong_proof" if data else "closed_unproven"
                self.counts[key] += 1
                if key == "wrong_proof" and self.counts[key] == 1:
                    logger.warning("store %s:%s: a connection from %s did not prove it "
                                   "belongs to this job; closed unanswered",
                                   self.host, self.port, client.addr)
            self._drop(client)
            return
        if proof is not None:
            self._unproven.pop(client, None)
            self._send(client, proof, now)
        if session.phase is Phase.PROVEN:
            self._serve(client, now)
            self._arm(client)
        self._watch(client)

    def _send(self, client: _Client, data: bytes, now: float) -> None:
        if not client.out:
            client.out_since = now
        client.out += data
        self._flush(client, now)

    def _flush(self, client: _Client, now: float) -> None:
        if client not in self._clients:
            return
        if client.out:
            try:
                sent = client.sock.send(client.out)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                client.session.end(f"failed: {exc!r}")
                self._drop(client)
                return
            del client.out[:sent]
            if client.out:
                self._watch(client)
                self._arm(client)
                return
        session = client.session
        if session.busy and client.parked is None and client not in self._status_clients:
            session.served(now)
            self._ready.add(client)  # another request may be buffered
            self._arm(client)
        self._watch(client)

    def _watch(self, client: _Client) -> None:
        """Make the selector watch what ``client`` needs now."""
        if client not in self._clients:
            return
        events = (selectors.EVENT_READ if client.session.want() > 0 else 0) | (
            selectors.EVENT_WRITE if client.out else 0
        )
        if events == client.events:
            return
        if client.events == 0:
            self._sel.register(client.sock, events, client)
        elif events == 0:
            self._sel.unregister(client.sock)
        else:
            self._sel.modify(client.sock, events, client)
        client.events = events

    def _arm(self, client: _Client) -> None:
        """Keep a timer for the client's next deadline: a frame being sent, or a reply
        the client does not read."""
        deadline = client.session.deadline
        if client.out:
            out_deadline = client.out_since + HANDSHAKE_SECONDS
            deadline = out_deadline if deadline is None else min(deadline, out_deadline)
        if deadline is not None and deadline != client.timer and client.session.phase is Phase.PROVEN:
            client.timer = deadline
            heapq.heappush(self._timers, (deadline, next(self._seq), client))

    def _drop(self, client: _Client) -> None:
        if client not in self._clients:
            return
        self._clients.discard(client)
        self._unproven.pop(client, None)
        self._ready.discard(client)
        self._status_clients.discard(client)
        if client.parked is not None:
            client.parked.done = True
            client.parked = None
        if client.events:
            self._sel.unregister(client.sock)
            client.events = 0
        try:
            client.sock.close()
        except OSError:
            pass

    def _expire(self, now: float) -> None:
        while self._unproven:
            client = next(iter(self._unproven))
            if not client.session.expired(now):
                break
            del self._unproven[client]
            self.counts["no_proof_in_time"] += 1
            self._drop(client)
        while self._timers and self._timers[0][0] <= now:
            deadline, _, obj = heapq.heappop(self._timers)
            if isinstance(obj, _Parked):
                if not obj.done:
                    self._answer(obj, [False, None], now)
                continue
            client: _Client = obj  # type: ignore[assignment]
            if client not in self._clients or client.timer != deadline:
                continue  # gone, or a later deadline replaced this one
            client.timer = None
            if client.session.expired(now) or (
                client.out and now - client.out_since >= HANDSHAKE_SECONDS
            ):
                if client.session.phase is not Phase.ENDED:
                    client.session.end("left its reply unread")
                logger.debug("store %s:%s: client %s dropped: %s", self.host, self.port,
                             client.addr, client.session.why)
                self._drop(client)
            else:
                self._arm(client)

    # -- requests ---------------------------------------------------------------------------

    def _serve(self, client: _Client, now: float) -> None:
        """Run the client's next buffered request, if it has one and none is under way."""
        if client not in self._clients:
            return
        payload = client.session.next_request(now)
        if payload is None:
            if client.session.phase is Phase.ENDED:
                logger.warning("store %s:%s: client %s dropped: %s", self.host, self.port,
                               client.addr, client.session.why)
                self._drop(client)
            return
        try:
            request = decode(payload)
            reply = self._apply(client, request, now)
        except (ValueError, TypeError, IndexError, KeyError, msgspec.DecodeError) as exc:
            logger.warning("store %s:%s: client %s sent a malformed request (%r); dropped",
                           self.host, self.port, client.addr, exc)
            client.session.end("sent a malformed request")
            self._drop(client)
            return
        if reply is not None:
            self._reply(client, reply, now)

    def _reply(self, client: _Client, reply: list, now: float) -> None:
        body = encode(reply)
        self._send(client, LEN.pack(len(body)) + body, now)

    def _apply(self, client: _Client, request: list, now: float) -> list | None:
        """Run one request: ``[op, ...]`` -> its reply ``[ok, value]``, or None when it
        was parked or handed to the status thread (answered later)."""
        op, args = request[0], request[1:]
        table = self.table
        data = table.data
        if op == OP_GET or op == OP_TAKE:
            key = str(args[0])
            with table.cond:
                if key in data:
                    return [True, data.pop(key) if op == OP_TAKE else data[key]]
            return self._park(client, op, [key], float(args[1]), now)
        if op == OP_WAIT:
            keys = [str(k) for k in args[0]]
            with table.cond:
                if all(k in data for k in keys):
                    return [True, None]
            return self._park(client, op, keys, float(args[1]), now)
        if op == OP_STATUS:
            self._start_status(client, str(args[0]) if args else "")
            return None
        changed: str | None = None
        with table.cond:
            if op == OP_SET:
                changed = str(args[0])
                data[changed] = bytes(args[1])
                result: list = [True, None]
            elif op == OP_ADD:
                changed = str(args[0])
                value = int(data.get(changed, b"0")) + int(args[1])
                data[changed] = str(value).encode()
                result = [True, value]
            elif op == OP_APPEND:
                changed = str(args[0])
                data[changed] = data.get(changed, b"") + bytes(args[1])
                result = [True, None]
            elif op == OP_CSET:
                key, expected, desired = str(args[0]), bytes(args[1]), bytes(args[2])
                current = data.get(key)
                if (current is None and not expected) or current == expected:
                    data[key] = desired
                    changed = key
                    result = [True, desired]
                else:
                    result = [True, expected if current is None else current]
            elif op == OP_CHECK:
                result = [True, all(str(k) in data for k in args[0])]
            elif op == OP_DELETE:
                result = [True, data.pop(str(args[0]), None) is not None]
            elif op == OP_NUM_KEYS:
                result = [True, len(data)]
            else:
                raise ValueError(f"unknown store op {op!r}")
            if changed is not None:
                table.cond.notify_all()
        if changed is not None:
            self._wake_parked(changed, now)
        return result

    def _park(self, client: _Client, op: int, keys: list[str], timeout: float,
              now: float) -> list | None:
        if timeout <= 0:
            return [False, None]
        parked = _Parked(client, op, keys, now + timeout)
        client.parked = parked
        for key in keys:
            self._waiting.setdefault(key, []).append(parked)
        heapq.heappush(self._timers, (parked.deadline, next(self._seq), parked))
        return None

    def _wake_parked(self, key: str, now: float) -> None:
        """``key`` was written: answer the requests it completes."""
        waiting = self._waiting.pop(key, None)
        if not waiting:
            return
        data = self.table.data
        for parked in waiting:
            if parked.done:
                continue
            with self.table.cond:
                if parked.op == OP_WAIT:
                    missing = [k for k in parked.keys if k not in data]
                    if missing:
                        self._waiting.setdefault(missing[0], []).append(parked)
                        continue
                    reply: list = [True, None]
                elif key not in data:  # taken by an earlier request of this batch
                    self._waiting.setdefault(key, []).append(parked)
                    continue
                elif parked.op == OP_TAKE:
                    reply = [True, data.pop(key)]
                else:
                    reply = [True, data[key]]
            self._answer(parked, reply, now)

    def _answer(self, parked: _Parked, reply: list, now: float) -> None:
        parked.done = True
        client = parked.client
        if client.parked is parked:
            client.parked = None
        if client in self._clients:
            self._reply(client, reply, now)
        # Its other keys' lists drop it lazily (done), when those keys are written.
        for key in parked.keys:
            waiting = self._waiting.get(key)
            if waiting is not None and all(p.done for p in waiting):
                del self._waiting[key]

    # -- the status thread ------------------------------------------------------------------

    def _start_status(self, client: _Client, detail: str) -> None:
        status = self._status
        if status is None:
            self._status_done.put((client, None))
            self._wake()
            return
        if self._status_pool is None:
            self._status_pool = concurrent.futures.ThreadPoolExecutor(1, "rlcomm-status")
        self._status_clients.add(client)
        fut = self._status_pool.submit(status, detail)

        def done(f: concurrent.futures.Future) -> None:
            self._status_done.put((client, f))
            self._wake()

        fut.add_done_callback(done)

    def _finish_status(self, now: float) -> None:
        while True:
            try:
                client, fut = self._status_done.get_nowait()
            except queue.Empty:
                return
            if client not in self._clients:
                continue
            self._status_clients.discard(client)
            if fut is None:
                reply: list = [True, None]
            elif fut.exception() is not None:
                reply = [False, f"status failed: {fut.exception()!r}"]
            else:
                reply = [True, fut.result()]
            self._reply(client, reply, now)

    # -- logs and shutdown ------------------------------------------------------------------

    def _log_drops(self, now: float) -> None:
        self._last_log = now
        new = {k: v - self._logged[k] for k, v in self.counts.items()}
        self._logged = dict(self.counts)
        # A client that closed its own connection before proving anything (one that gave
        # up on a stopped process, a port scan) is no sign of an attack: not logged.
        if any(v for k, v in new.items() if k != "closed_unproven"):
            logger.warning(
                "store %s:%s: in the last %.0fs, connections ended without proving they "
                "belong to this job: %d sent no proof within %ss, %d a wrong one, %d were "
                "dropped over the limit of %d connections, %d closed; %d refused while "
                "every connection was proven", self.host, self.port, _LOG_EVERY,
                new["no_proof_in_time"], self.auth_timeout, new["wrong_proof"],
                new["evicted"], self.max_connections, new["closed_unproven"],
                new["refused_full"],
            )

    def _shutdown(self) -> None:
        self._closed = True
        for client in list(self._clients):
            try:
                client.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._drop(client)
        try:
            self._sel.unregister(self._listener)
        except (KeyError, ValueError):
            pass
        self._listener.close()
        self._sel.close()
        with self._wake_lock:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_w = -1
        if self._status_pool is not None:
            self._status_pool.shutdown(wait=False, cancel_futures=True)


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except (BlockingIOError, OSError):
        pass


def local_reader(
    server: StoreServer, stop: threading.Event
) -> Callable[[str, float], bytes | None]:
    """``read(key, timeout)``: take a key out of ``server``'s own table when it appears
    (None on timeout, or at once once ``stop`` is set and the table's condition is
    notified). The mailbox reads its notes this way, without a connection."""
    table = server.table

    def read(key: str, timeout: float) -> bytes | None:
        with table.cond:
            table.cond.wait_for(lambda: key in table.data or stop.is_set(), timeout)
            return table.data.pop(key, None)

    return read
