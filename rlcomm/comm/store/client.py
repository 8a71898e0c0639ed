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
The client's end of a connection (:mod:`rlcomm.comm.store.link`) imports no torch; this
module puts torch's ``Store`` interface over it. The server
(:mod:`rlcomm.comm.store.server`) serves every client from one event loop: a
connection that has not proven itself costs no thread, must send its proof within the
``store_auth_timeout`` setting (2 s) and is dropped after it; the number of connections
is bounded (the ``store_max_connections`` setting), the oldest unproven ones dropped
first. Frames have a size limit, and a started frame must arrive whole within
:data:`~rlcomm.comm.store.wire.HANDSHAKE_SECONDS`.

Keys and values are bytes; ``add`` keeps a decimal integer, as TCPStore does. A client
connection serves one request at a time; a blocking ``get``, ``wait`` or ``take`` is
parked in the server until its key comes or its deadline passes, holding only that
client's connection. ``status`` asks the server's process for a report of what it is
doing (:mod:`rlcomm.comm.status`), answered from a thread of rlcomm's own.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from rlcomm.comm.store.link import StoreLink
from rlcomm.comm.store.server import StoreServer, local_reader
from rlcomm.comm.store.wire import (
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
)
from rlcomm.errors import CommTimeoutError

__all__ = ["StoreClient", "StoreServer", "local_reader", "sub_store"]


class StoreClient(dist.Store):
    """A ``torch.distributed.Store`` over an authenticated connection to a
    :class:`StoreServer`; every key is under ``prefix``.

    Args:
        host, port: the server.
        secret: the job's secret.
        timeout: seconds for connecting, and the default of blocking ops.

    Raises:
        AuthenticationError, PeerLostError, CommTimeoutError: from connecting, as
            :class:`~rlcomm.comm.store.link.StoreLink` says.
    """

    def __init__(self, host: str, port: int, secret: bytes, timeout: float,
                 prefix: str = "", _link: StoreLink | None = None):
        super().__init__()
        self._args = (host, port, secret, timeout)
        self._link = _link if _link is not None else StoreLink(host, port, secret, timeout)
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
        self._call([OP_SET, self._key(key), self._bytes(value)])

    def get(self, key: str) -> bytes:
        return self._call([OP_GET, self._key(key), self._timeout_s])  # type: ignore[return-value]

    def add(self, key: str, amount: int) -> int:
        return self._call([OP_ADD, self._key(key), int(amount)])  # type: ignore[return-value]

    def append(self, key: str, value: bytes | str) -> None:
        self._call([OP_APPEND, self._key(key), self._bytes(value)])

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        seconds = self._timeout_s if timeout is None else timeout.total_seconds()
        self._call([OP_WAIT, [self._key(k) for k in keys], seconds], seconds)

    def check(self, keys: list[str]) -> bool:
        return self._call([OP_CHECK, [self._key(k) for k in keys]])  # type: ignore[return-value]

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self._call(  # type: ignore[return-value]
            [OP_CSET, self._key(key), self._bytes(expected), self._bytes(desired)]
        )

    def delete_key(self, key: str) -> bool:
        return self._call([OP_DELETE, self._key(key)])  # type: ignore[return-value]

    def take(self, key: str, timeout: datetime.timedelta | None = None) -> bytes:
        """Wait for ``key``, then remove it and return its value: one round trip where
        ``wait``, ``get`` and ``delete_key`` take three (not in torch's ``Store``).

        Raises:
            CommTimeoutError: ``key`` was not set within ``timeout`` (the store's own
                timeout when ``None``).
        """
        seconds = self._timeout_s if timeout is None else timeout.total_seconds()
        return self._call([OP_TAKE, self._key(key), seconds], seconds)  # type: ignore[return-value]

    def num_keys(self) -> int:
        return self._call([OP_NUM_KEYS])  # type: ignore[return-value]

    def status(self, detail: str = "", timeout: float | None = None) -> bytes | None:
        """The server's process's report of what it is doing (see
        :mod:`rlcomm.comm.status`), as encoded there; ``None`` from a server that has
        no report to give. Not in torch's ``Store``.

        Raises:
            CommTimeoutError: the report was not made within ``timeout`` seconds (the
                store's own timeout when ``None``); the connection is then closed.
            CommError: making the report failed in the server's process.
        """
        return self._link.status(detail, self._timeout_s if timeout is None else timeout)

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
