"""The server side of rlcomm's authenticated store (see :mod:`rlcomm.comm.store`): its
key table, the thread that accepts clients and the threads that serve them, and the
owner's own reads without a connection (:func:`local_reader`)."""

from __future__ import annotations

import hmac
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

import msgspec

from rlcomm.comm.store_wire import (
    HANDSHAKE_SECONDS,
    MAC,
    MAGIC,
    MAX_PENDING,
    NONCE,
    OP_ADD,
    OP_APPEND,
    OP_CHECK,
    OP_CSET,
    OP_DELETE,
    OP_GET,
    OP_NUM_KEYS,
    OP_SET,
    OP_TAKE,
    OP_WAIT,
    decode,
    encode,
    mac,
    recv_exact,
    recv_frame,
    send_frame,
)

logger = logging.getLogger(__name__)


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

    def take(self, key: str, timeout: float) -> bytes | None:
        """Wait up to ``timeout`` seconds for ``key``, then remove it and return its value."""
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.data, timeout):
                return None
            return self.data.pop(key)

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
        nonce = os.urandom(NONCE)
        sock.sendall(MAGIC + nonce)
        reply = recv_exact(sock, len(MAGIC) + NONCE + MAC, deadline)
        theirs = reply[len(MAGIC) : len(MAGIC) + NONCE]
        proof = reply[len(MAGIC) + NONCE :]
        if reply[: len(MAGIC)] != MAGIC or not hmac.compare_digest(
            proof, mac(self._secret, b"client", nonce, theirs)
        ):
            return False
        sock.sendall(mac(self._secret, b"server", theirs, nonce))
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
                request = decode(recv_frame(sock, None))
                send_frame(sock, encode(self._apply(request)))
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
        if op == OP_SET:
            table.set(str(args[0]), bytes(args[1]))
            return [True, None]
        if op == OP_GET:
            value = table.get(str(args[0]), float(args[1]))
            return [value is not None, value]
        if op == OP_ADD:
            return [True, table.add(str(args[0]), int(args[1]))]
        if op == OP_WAIT:
            return [table.wait([str(k) for k in args[0]], float(args[1])), None]
        if op == OP_CHECK:
            with table.cond:
                return [True, all(str(k) in table.data for k in args[0])]
        if op == OP_CSET:
            return [True, table.compare_set(str(args[0]), bytes(args[1]), bytes(args[2]))]
        if op == OP_DELETE:
            return [True, table.pop(str(args[0])) is not None]
        if op == OP_TAKE:
            value = table.take(str(args[0]), float(args[1]))
            return [value is not None, value]
        if op == OP_NUM_KEYS:
            with table.cond:
                return [True, len(table.data)]
        if op == OP_APPEND:
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
