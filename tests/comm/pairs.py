"""Two ends of a real transport, or of a connection over one, in one process: the
rank-1 end is made on a thread while the rank-0 end is made here (both block in the
rendezvous until the other comes)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from rlcomm.comm.connection import Connection
from rlcomm.comm.transports.base import Transport
from rlcomm.comm.transports.registry import PairFacts
from rlcomm.comm.transports.shm import ShmTransport


def two_stores() -> list[dist.Store]:
    """A store server and a client of it: one store connection per end, as in two
    processes (a client serializes its ops)."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return [server, dist.TCPStore("127.0.0.1", server.port, is_master=False)]


def transport_pair(
    stores: list[dist.Store], prefix: str, kind: Callable[..., Transport] = ShmTransport
) -> tuple[Transport, Transport]:
    """The two ends of a ``kind`` transport whose rendezvous keys lie under ``prefix``."""
    ends: dict[int, Transport] = {}

    def make(rank: int) -> None:
        ends[rank] = kind(dist.PrefixStore(prefix, stores[rank]), rank, 10, f"end{1 - rank}")

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
        conn.attach(ends[rank], dist.PrefixStore(prefix, stores[rank]), rank, PairFacts(True))
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
