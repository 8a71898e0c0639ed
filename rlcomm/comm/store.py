"""An authenticated key-value store: every worker's mailbox, and its peers' rendezvous keys.

``torch.distributed.TCPStore`` lets anyone who reaches its port read and write every key,
and rlcomm's stores carry connection requests and Gloo/NCCL rendezvous addresses. This
store serves the same operations (the ``torch.distributed.Store`` interface, so Gloo and
NCCL rendezvous on it) over TCP bound to the node's address, to clients that have proven
they hold the job's secret:

1. the server sends a random nonce;
2. the client answers with its own nonce and ``HMAC-SHA256(secret, "client" + both)``;
3. the server checks it (constant time) and answers ``HMAC(secret, "server" + both)``,
   which the client checks in turn.

A connection that fails the check is logged and closed: it never reads or writes a key.
Every read of a frame, the handshake included, has a deadline, and frames have a size
limit, so a client that connects and stalls (or claims a huge frame) holds one thread
for at most :data:`HANDSHAKE_SECONDS`. At most :data:`MAX_PENDING` connections may be
in their handshake at once; more are closed at once.

Keys and values are bytes; ``add`` keeps a decimal integer, as TCPStore does. The server
thread of each client serves one request at a time, so a blocking ``wait`` holds only
that client's connection.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable

import msgspec
import torch.distributed as dist

from rlcomm.errors import AuthenticationError, CommTimeoutError, PeerLostError

logger = logging.getLogger(__name__)

_MAGIC = b"RLCS1"
_NONCE = 16
_MAC = 32
_LEN = struct.Struct("<I")
#: Seconds a connecting client has to prove itself, and a started frame to arrive whole.
HANDSHAKE_SECONDS = 10.0
#: Connections allowed in their handshake at once (more are closed unanswered).
MAX_PENDING = 64
#: Largest request or reply frame (keys and values are small: addresses, notes, acks).
MAX_FRAME = 16 << 20

_SET, _GET, _ADD, _WAIT, _CHECK, _CSET, _DELETE, _NUM_KEYS, _APPEND = range(9)
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode


def _mac(secret: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, label + b"".join(parts), hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    """``n`` bytes from ``sock``; by ``deadline`` (monotonic) when given."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{n - len(buf)} bytes still missing at the deadline")
            sock.settimeout(left)
        else:
            sock.settimeout(None)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the other end closed the connection")
        buf += chunk
    return bytes(buf)


def _recv_frame(sock: socket.socket, first_deadline: float | None) -> bytes:
    """One length-prefixed frame: its length by ``first_deadline``, the rest within
    :data:`HANDSHAKE_SECONDS` of the length."""
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size, first_deadline))
    if n > MAX_FRAME:
        raise ValueError(f"a {n}-byte frame is over the {MAX_FRAME}-byte limit")
    return _recv_exact(sock, n, time.monotonic() + HANDSHAKE_SECONDS)


def _send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_LEN.pack(len(payload)) + payload)


class _Table:
    """The keys of one server, with waits on them (shared by its client threads)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.cond = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self.cond:
            self.data[key] = value
            self.cond.notify_all()

    def wait(self, keys: list[str], timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: all(k in self.data for k in keys), timeout)

    def get(self, key: str, timeout: float) -> bytes | None:
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.data, timeout):
                return None
            return self.data[key]

    def pop(self, key: str) -> bytes | None:
        with self.cond:
            return self.data.pop(key, None)

    def add(self, key: str, amount: int) -> int:
        with self.cond:
            value = int(self.data.get(key, b"0")) + amount
            self.data[key] = str(value).encode()
            self.cond.notify_all()
            return value

    def append(self, key: str, value: bytes) -> None:
        with self.cond:
            self.data[key] = self.data.get(key, b"") + value
            self.cond.notify_all()

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self.cond:
            current = self.data.get(key)
            if (current is None and not expected) or current == expected:
                self.data[key] = desired
                self.cond.notify_all()
                return desired
            return expected if current is None else current


class StoreServer:
    """The store server of this process (its mailbox), on ``host`` (see module docstring).

    Args:
        host: the node address to bind (never all interfaces).
        secret: the job's secret; clients must prove they hold it.
    """

    def __init__(self, host: str, secret: bytes):
        if not secret:
            raise ValueError("StoreServer needs the job's secret")
        self._secret = secret
        self.table = _Table()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, 0), family=family, backlog=128)
        self.host = host
        self.port = self._listener.getsockname()[1]
        self._pending = threading.BoundedSemaphore(MAX_PENDING)
        self._clients: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.rejected = 0  # connections that failed the handshake (for tests and logs)
        threading.Thread(target=self._accept_loop, name="rlcomm-store", daemon=True).start()

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except OSError:
                return  # closed
            if not self._pending.acquire(blocking=False):
                logger.warning("store %s:%s: too many handshakes at once; %s closed",
                               self.host, self.port, addr)
                sock.close()
                continue
            threading.Thread(
                target=self._serve, args=(sock, addr), name="rlcomm-store-client", daemon=True
            ).start()

    def _handshake(self, sock: socket.socket) -> bool:
        deadline = time.monotonic() + HANDSHAKE_SECONDS
        nonce = os.urandom(_NONCE)
        sock.sendall(_MAGIC + nonce)
        reply = _recv_exact(sock, len(_MAGIC) + _NONCE + _MAC, deadline)
        theirs = reply[len(_MAGIC) : len(_MAGIC) + _NONCE]
        proof = reply[len(_MAGIC) + _NONCE :]
        if reply[: len(_MAGIC)] != _MAGIC or not hmac.compare_digest(
            proof, _mac(self._secret, b"client", nonce, theirs)
        ):
            return False
        sock.sendall(_mac(self._secret, b"server", theirs, nonce))
        return True

    def _serve(self, sock: socket.socket, addr: object) -> None:
        try:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                ok = self._handshake(sock)
            except (OSError, ValueError) as exc:
                ok = False
                logger.warning("store %s:%s: handshake with %s failed: %s",
                               self.host, self.port, addr, exc)
            finally:
                self._pending.release()
            if not ok:
                with self._lock:
                    self.rejected += 1
                logger.warning(
                    "store %s:%s: a connection from %s did not prove it belongs to this "
                    "job; closed unanswered", self.host, self.port, addr,
                )
                return
            with self._lock:
                if self._closed:
                    return
                self._clients.add(sock)
            while True:
                request = _decode(_recv_frame(sock, None))
                _send_frame(sock, _encode(self._apply(request)))
        except (OSError, ValueError, TypeError, msgspec.DecodeError) as exc:
            if not self._closed and not isinstance(exc, ConnectionError):
                logger.debug("store %s:%s: client %s dropped: %r", self.host, self.port, addr, exc)
        finally:
            with self._lock:
                self._clients.discard(sock)
            sock.close()

    def _apply(self, request: list) -> list:
        """Run one request of an authenticated client: ``[op, ...]`` -> ``[ok, value]``."""
        op, args = request[0], request[1:]
        table = self.table
        if op == _SET:
            table.set(str(args[0]), bytes(args[1]))
            return [True, None]
        if op == _GET:
            value = table.get(str(args[0]), float(args[1]))
            return [value is not None, value]
        if op == _ADD:
            return [True, table.add(str(args[0]), int(args[1]))]
        if op == _WAIT:
            return [table.wait([str(k) for k in args[0]], float(args[1])), None]
        if op == _CHECK:
            with table.cond:
                return [True, all(str(k) in table.data for k in args[0])]
        if op == _CSET:
            return [True, table.compare_set(str(args[0]), bytes(args[1]), bytes(args[2]))]
        if op == _DELETE:
            return [True, table.pop(str(args[0])) is not None]
        if op == _NUM_KEYS:
            with table.cond:
                return [True, len(table.data)]
        if op == _APPEND:
            table.append(str(args[0]), bytes(args[1]))
            return [True, None]
        raise ValueError(f"unknown store op {op!r}")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            clients, self._clients = list(self._clients), set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        except OSError:
            pass
        self._listener.close()
        for sock in clients:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _Link:
    """One authenticated client connection, shared by the store views made from it."""

    def __init__(self, host: str, port: int, secret: bytes, timeout: float):
        self.where = f"{host}:{port}"
        self.lock = threading.Lock()
        deadline = time.monotonic() + min(timeout, HANDSHAKE_SECONDS)
        self.sock = _connect(host, port, timeout)
        try:
            hello = _recv_exact(self.sock, len(_MAGIC) + _NONCE, deadline)
            if hello[: len(_MAGIC)] != _MAGIC:
                raise AuthenticationError(f"{self.where} is not an rlcomm store")
            theirs = hello[len(_MAGIC) :]
            mine = os.urandom(_NONCE)
            self.sock.sendall(_MAGIC + mine + _mac(secret, b"client", theirs, mine))
            proof = _recv_exact(self.sock, _MAC, deadline)
        except (OSError, TimeoutError) as exc:
            self.sock.close()
            raise AuthenticationError(
                f"the store at {self.where} refused this process's credentials or did "
                f"not answer ({exc.__class__.__name__}): is it a worker of another job?"
            ) from exc
        if not hmac.compare_digest(proof, _mac(secret, b"server", mine, theirs)):
            self.sock.close()
            raise AuthenticationError(
                f"the store at {self.where} did not prove it belongs to this job"
            )

    def call(self, request: list, timeout: float) -> list:
        with self.lock:
            try:
                _send_frame(self.sock, _encode(request))
                # The server answers a wait at its own deadline; allow it a margin.
                reply = _recv_frame(self.sock, time.monotonic() + timeout + HANDSHAKE_SECONDS)
            except (OSError, TimeoutError, ValueError) as exc:
                self.close()
                raise PeerLostError(f"the store at {self.where} is gone: {exc!r}") from exc
            return _decode(reply)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _connect(host: str, port: int, timeout: float) -> socket.socket:
    """A TCP connection to ``host:port``. A refused connection means nobody listens
    there (the process is gone): it is retried only briefly."""
    deadline = time.monotonic() + timeout
    refused_until = time.monotonic() + min(1.0, timeout)
    while True:
        try:
            sock = socket.create_connection(
                (host, port), timeout=max(0.05, min(deadline - time.monotonic(), 5.0))
            )
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except ConnectionRefusedError as exc:
            if time.monotonic() >= min(deadline, refused_until):
                raise PeerLostError(
                    f"nothing listens at {host}:{port} any more: the process is gone"
                ) from exc
            time.sleep(0.05)
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise CommTimeoutError(
                    f"cannot reach {host}:{port} within {timeout}s ({exc.__class__.__name__})"
                ) from exc
            time.sleep(0.1)


class StoreClient(dist.Store):
    """A ``torch.distributed.Store`` over an authenticated connection to a
    :class:`StoreServer`; every key is under ``prefix``.

    Args:
        host, port: the server.
        secret: the job's secret.
        timeout: seconds for connecting, and the default of blocking ops.

    Raises:
        AuthenticationError: the server is not one of this job's.
        PeerLostError: nothing listens there any more.
        CommTimeoutError: the server could not be reached in time.
    """

    def __init__(self, host: str, port: int, secret: bytes, timeout: float,
                 prefix: str = "", _link: _Link | None = None):
        super().__init__()
        self._args = (host, port, secret, timeout)
        self._link = _link if _link is not None else _Link(host, port, secret, timeout)
        self._prefix = prefix
        self._timeout_s = timeout
        self.set_timeout(datetime.timedelta(seconds=timeout))

    def prefixed(self, prefix: str) -> StoreClient:
        """A view of the same connection with keys under ``prefix/``."""
        return StoreClient(*self._args, prefix=f"{self._prefix}{prefix}/", _link=self._link)

    def clone(self) -> StoreClient:
        """A new connection with the same prefix (for a user that blocks on its own)."""
        return StoreClient(*self._args, prefix=self._prefix)

    def _key(self, key: str) -> str:
        return self._prefix + key

    def _call(self, request: list, timeout: float | None = None) -> object:
        ok, value = self._link.call(request, self._timeout_s if timeout is None else timeout)
        if not ok:
            raise CommTimeoutError(
                f"store {self._link.where}: timed out waiting for {request[1]!r}"
            )
        return value

    @staticmethod
    def _bytes(value: bytes | str) -> bytes:
        return value.encode() if isinstance(value, str) else bytes(value)

    def set(self, key: str, value: bytes | str) -> None:
        self._call([_SET, self._key(key), self._bytes(value)])

    def get(self, key: str) -> bytes:
        return self._call([_GET, self._key(key), self._timeout_s])  # type: ignore[return-value]

    def add(self, key: str, amount: int) -> int:
        return self._call([_ADD, self._key(key), int(amount)])  # type: ignore[return-value]

    def append(self, key: str, value: bytes | str) -> None:
        self._call([_APPEND, self._key(key), self._bytes(value)])

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        seconds = self._timeout_s if timeout is None else timeout.total_seconds()
        self._call([_WAIT, [self._key(k) for k in keys], seconds], seconds)

    def check(self, keys: list[str]) -> bool:
        return self._call([_CHECK, [self._key(k) for k in keys]])  # type: ignore[return-value]

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self._call(  # type: ignore[return-value]
            [_CSET, self._key(key), self._bytes(expected), self._bytes(desired)]
        )

    def delete_key(self, key: str) -> bool:
        return self._call([_DELETE, self._key(key)])  # type: ignore[return-value]

    def num_keys(self) -> int:
        return self._call([_NUM_KEYS])  # type: ignore[return-value]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: list[str], values: list[bytes]) -> None:
        for key, value in zip(keys, values):
            self.set(key, value)

    def has_extended_api(self) -> bool:
        return False

    def close(self) -> None:
        """Close the connection (every view of it)."""
        self._link.close()


def sub_store(store: dist.Store, prefix: str) -> dist.Store:
    """``store`` with keys under ``prefix``: a view of a :class:`StoreClient`, else a
    ``PrefixStore`` (torch's cannot wrap a store implemented in Python)."""
    if isinstance(store, StoreClient):
        return store.prefixed(prefix)
    return dist.PrefixStore(prefix, store)


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
