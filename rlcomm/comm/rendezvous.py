"""Rendezvous: each worker's mailbox store, and the notes workers leave in each other's.

Every communicating process runs a ``TCPStore`` server on a free port of its node (its
*mailbox*) and publishes the address in the registry. A worker that wants a connection
leaves a note in the peer's mailbox; a thread of the peer reads notes in order and
answers, so a connection forms even while the peer's own code is busy elsewhere. The
stores also carry the connections' Gloo/NCCL rendezvous keys, under prefixes private to
each connection. No fixed ports, no call-order dependence.
"""

from __future__ import annotations

import datetime
import logging
import threading
import uuid
from collections.abc import Callable

import msgspec
import torch.distributed as dist

logger = logging.getLogger(__name__)

_WEEK = datetime.timedelta(days=7)


class Endpoint(msgspec.Struct, frozen=True):
    """Where a worker's mailbox listens, and which incarnation of the worker it is."""

    host: str
    port: int
    node_id: str
    incarnation: str
    pid: int


class Note(msgspec.Struct, frozen=True):
    """A note left in a mailbox.

    kind: ``"request"`` (connect to me under ``prefix`` of your store; reply there),
    ``"invite"`` (please send me a request) or ``"stop"`` (the mailbox closes).
    """

    kind: str
    sender: str = ""
    incarnation: str = ""
    prefix: str = ""
    options: dict | None = None


_encode = msgspec.msgpack.Encoder().encode
_decode_note = msgspec.msgpack.Decoder(Note).decode
_decode_endpoint = msgspec.msgpack.Decoder(Endpoint).decode


def encode(obj: msgspec.Struct) -> bytes:
    return _encode(obj)


def decode_endpoint(data: bytes) -> Endpoint:
    return _decode_endpoint(data)


def connect_store(host: str, port: int, timeout: float) -> dist.TCPStore:
    """A client connection to a mailbox store."""
    return dist.TCPStore(
        host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout)
    )


def post(store: dist.Store, note: Note) -> None:
    """Leave ``note`` in the mailbox behind ``store`` (numbered, read in order)."""
    n = store.add("inbox/count", 1)
    store.set(f"inbox/{n}", encode(note))


class Mailbox:
    """This process's store server and the thread that reads its notes.

    Args:
        host: the node address peers connect to.
        node_id: the Ray node id (peers use it to pick same-node transports).
        on_note: called on the reader thread for every note but ``stop``.
    """

    def __init__(self, host: str, node_id: str, on_note: Callable[[Note], None]):
        self._server = dist.TCPStore(
            host, 0, is_master=True, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=60),
        )
        self.endpoint = Endpoint(
            host=host, port=self._server.port, node_id=node_id,
            incarnation=uuid.uuid4().hex[:12], pid=_pid(),
        )
        self._on_note = on_note
        self._reader = connect_store(host, self._server.port, _WEEK.total_seconds())
        self._thread = threading.Thread(target=self._read_notes, name="rlcomm-mailbox", daemon=True)
        self._thread.start()

    def client(self, timeout: float) -> dist.TCPStore:
        """A new client connection to this mailbox (one per connection that uses it)."""
        return connect_store(self.endpoint.host, self.endpoint.port, timeout)

    def _read_notes(self) -> None:
        n = 1
        while True:
            key = f"inbox/{n}"
            try:
                self._reader.wait([key])
                note = _decode_note(self._reader.get(key))
            except Exception:  # noqa: BLE001 - a dead mailbox ends the reader, logged
                logger.exception("mailbox reader stopped")
                return
            n += 1
            if note.kind == "stop":
                return
            try:
                self._on_note(note)
            except Exception:  # noqa: BLE001 - one bad note must not stop the mailbox
                logger.exception("handling %s note from %s failed", note.kind, note.sender)

    def close(self) -> None:
        post(self.client(10.0), Note("stop"))
        self._thread.join(timeout=10)


def _pid() -> int:
    import os

    return os.getpid()
