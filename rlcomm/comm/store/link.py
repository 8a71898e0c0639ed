"""The client's end of a connection to rlcomm's authenticated store (:mod:`rlcomm.comm.store.client`):
connecting, the handshake, and one request at a time.

It imports no torch: ``python -m rlcomm status`` asks every process for its report over
a :class:`StoreLink` alone, and :class:`~rlcomm.comm.store.client.StoreClient` puts the
``torch.distributed.Store`` interface over one.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import threading
import time

from rlcomm.comm.store.wire import (
    HANDSHAKE_SECONDS,
    HELLO,
    MAC,
    MAGIC,
    NONCE,
    OP_STATUS,
    decode,
    encode,
    mac,
    recv_exact,
    recv_frame,
    send_frame,
)
from rlcomm.errors import AuthenticationError, CommError, CommTimeoutError, PeerLostError
from rlcomm.settings import get_settings

logger = logging.getLogger(__name__)


class ForeignStoreError(AuthenticationError):
    """What answers at the address is not this job's store: not an rlcomm store, or one
    that refused this process's prompt proof, or could not prove its own. Where the
    address is a registered worker's, that worker's process no longer holds the port."""


class StoreLink:
    """One authenticated client connection to a store server; the
    :class:`~rlcomm.comm.store.client.StoreClient` views made from it share it.

    Args:
        host, port: the server.
        secret: the job's secret.
        timeout: seconds for connecting and the handshake.

    Raises:
        AuthenticationError: the server is not one of this job's, or refused this
            process's proof.
        PeerLostError: nothing listens there any more.
        CommTimeoutError: the server could not be reached, or did not answer the
            handshake, in time.

    The server drops a connection whose proof comes later than its
    ``store_auth_timeout`` after the connect. When this process was that slow (its
    threads starved, say) and the server closed the connection, the handshake is tried
    again while ``timeout`` lasts; a prompt proof that is refused is not retried.
    """

    def __init__(self, host: str, port: int, secret: bytes, timeout: float):
        self.where = f"{host}:{port}"
        self.lock = threading.Lock()
        end = time.monotonic() + timeout
        while True:
            started = time.monotonic()
            try:
                self.sock = self._handshake(host, port, secret, max(end - started, 0.05))
                return
            except _LateProof as exc:
                if time.monotonic() >= end:
                    raise exc.error from exc
                logger.debug("store %s: this process sent its proof late; trying again",
                             self.where)

    def _handshake(self, host: str, port: int, secret: bytes, timeout: float) -> socket.socket:
        deadline = time.monotonic() + min(timeout, HANDSHAKE_SECONDS)
        sock = _connect(host, port, timeout)
        connected = time.monotonic()
        sent = connected
        try:
            hello = recv_exact(sock, HELLO, deadline)
            if hello[: len(MAGIC)] != MAGIC:
                raise ForeignStoreError(f"{self.where} is not an rlcomm store")
            theirs = hello[len(MAGIC) :]
            mine = os.urandom(NONCE)
            sent = time.monotonic()
            sock.sendall(MAGIC + mine + mac(secret, b"client", theirs, mine))
            proof = recv_exact(sock, MAC, deadline)
        except TimeoutError as exc:
            sock.close()
            raise CommTimeoutError(
                f"the store at {self.where} took connections but did not answer the "
                f"handshake within {min(timeout, HANDSHAKE_SECONDS):g}s (its process is "
                "stopped, or too busy to serve it)"
            ) from exc
        except OSError as exc:
            sock.close()
            late = isinstance(exc, ConnectionError) and sent - connected >= _late_proof()
            error = (AuthenticationError if late else ForeignStoreError)(
                f"the store at {self.where} refused this process's credentials "
                f"({exc.__class__.__name__}): it is not one of this job's"
                + (" (or this process proved itself too late)" if late else "")
            )
            error.__cause__ = exc
            if late:
                raise _LateProof(error) from exc
            raise error from exc
        except BaseException:
            sock.close()
            raise
        if not hmac.compare_digest(proof, mac(secret, b"server", mine, theirs)):
            sock.close()
            raise ForeignStoreError(
                f"the store at {self.where} did not prove it belongs to this job"
            )
        return sock

    def call(self, request: list, timeout: float, strict: bool = False) -> list:
        """Send ``request`` and return the reply. The server answers a wait at its own
        deadline: the reply is waited for with a margin of :data:`HANDSHAKE_SECONDS`,
        none when ``strict`` (a late reply then raises ``CommTimeoutError``, not
        ``PeerLostError``). A failed call closes the connection."""
        with self.lock:
            try:
                send_frame(self.sock, encode(request))
                margin = 0.0 if strict else HANDSHAKE_SECONDS
                reply = recv_frame(self.sock, time.monotonic() + timeout + margin)
            except TimeoutError as exc:
                self.close()
                if strict:
                    raise CommTimeoutError(
                        f"the store at {self.where} did not answer within {timeout:g}s"
                    ) from exc
                raise PeerLostError(f"the store at {self.where} is gone: {exc!r}") from exc
            except (OSError, ValueError) as exc:
                self.close()
                raise PeerLostError(f"the store at {self.where} is gone: {exc!r}") from exc
            return decode(reply)

    def status(self, detail: str, timeout: float) -> bytes | None:
        """The server's process's report of what it is doing (see
        :mod:`rlcomm.comm.status`), as encoded there; ``None`` from a server that has
        no report to give.

        Raises:
            CommTimeoutError: the report was not made within ``timeout`` seconds; the
                connection is then closed.
            CommError: making the report failed in the server's process.
        """
        ok, value = self.call([OP_STATUS, detail], timeout, strict=True)
        if not ok:
            raise CommError(f"store {self.where}: {value}")
        return value  # type: ignore[return-value]

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class _LateProof(Exception):
    """The server closed the connection after a proof this process sent late."""

    def __init__(self, error: AuthenticationError):
        super().__init__(str(error))
        self.error = error


def _late_proof() -> float:
    """Seconds after the connect past which a proof may have missed the server's
    deadline (half the ``store_auth_timeout`` setting: the server's may differ)."""
    return get_settings().store_auth_timeout / 2


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
