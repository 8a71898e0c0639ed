"""Two ends of a real transport, or of a connection over one, in one process: the
rank-1 end is made on a thread while the rank-0 end is made here (both block in the
rendezvous until the other comes)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from rlcomm.comm.connection import Connection
from rlcomm.comm.store.client import StoreClient, sub_store
from rlcomm.comm.store.server import StoreServer
from rlcomm.comm.transports.base import Transport
from rlcomm.comm.transports.registry import PairFacts
from rlcomm.comm.transports.shm import ShmTransport

_SECRET = b"pairs-secret-of-this-test-process"
_server: StoreServer | None = None
_server_lock = threading.Lock()
_calls = itertools.count()


def two_stores() -> list[dist.Store]:
    """Two connections to a store, one per end, as in two processes (a client serializes
    its ops), with keys of their own: rlcomm's store, as a connection's transports get
    in a worker. One server serves every call of this process; each call's keys lie
    under a prefix of its own. (torch's TCPStore looks up its peer's host name on every
    connection it makes: a slow name server costs such a pair seconds.)"""
    global _server
    with _server_lock:
        if _server is None:
            _server = StoreServer("127.0.0.1", _SECRET)
        port, prefix = _server.port, f"pair{next(_calls)}"
    return [StoreClient("127.0.0.1", port, _SECRET, 30).prefixed(prefix) for _ in range(2)]


def transport_pair(
    stores: list[dist.Store], prefix: str, kind: Callable[..., Transport] = ShmTransport
) -> tuple[Transport, Transport]:
    """The two ends of a ``kind`` transport whose rendezvous keys lie under ``prefix``."""
    ends: dict[int, Transport] = {}

    def make(rank: int) -> None:
        ends[rank] = kind(sub_store(stores[rank], prefix), rank, 10, f"end{1 - rank}")

    t = threading.Thread(target=make, args=(1,))
    t.start()
    make(0)
    t.join(timeout=10)
    return ends[0], ends[1]


def connection_pair(
    stores: list[dist.Store], prefix: str, kind: Callable[..., Transport] = ShmTransport
) -> tuple[Connection, Connection]:
    """Two attached connections over a ``kind`` transport: ``(rank 0 end, rank 1 end)``."""
    ends = transport_pair(stores, prefix, kind)
    a, b = Connection("b"), Connection("a")
    for rank, conn in enumerate((a, b)):  # both ends in this process: one node
        conn.attach(ends[rank], sub_store(stores[rank], prefix), rank, PairFacts(True))
    return a, b


def send(conn: Connection, obj: Any) -> None:
    conn.send_message(obj, 10)


def receive(conn: Connection, timeout: float = 10) -> Any:
    return conn.recv_object(conn.take_ticket(), timeout, None)


def send_past_the_ring(src: Connection, dst: Connection, big: torch.Tensor, count: int) -> None:
    """Send ``count`` copies of ``big``, then "last", with nobody receiving at ``dst``
    (more than its ring holds: whoever reads for ``dst`` must buffer), then receive and
    check them all."""
    for _ in range(count):
        send(src, big)
    send(src, "last")
    got = [receive(dst) for _ in range(count + 1)]
    assert all(torch.equal(t, big) for t in got[:-1]) and got[-1] == "last"
