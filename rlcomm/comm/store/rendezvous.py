"""Rendezvous: each worker's mailbox store, and the notes workers leave in each other's.

Every communicating process runs an authenticated store (:mod:`rlcomm.comm.store.client`) on
its node's address (its *mailbox*) and publishes where it listens in the registry (its
:class:`~rlcomm.comm.identity.endpoint.Endpoint`). Only processes that hold the job's
secret can connect to it, read a key or leave a note. A worker that wants a connection
leaves a note in the peer's mailbox; a thread of the peer reads notes in order and
answers, so a connection forms even while the peer's own code is busy elsewhere. A note that cannot be decoded is logged and skipped. The stores also
carry the connections' Gloo/NCCL rendezvous keys, under prefixes private to each
connection. No fixed ports, no call-order dependence.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable

import msgspec
import torch.distributed as dist

from rlcomm.comm.identity.endpoint import Endpoint
from rlcomm.comm.store.client import StoreClient, StoreServer, local_reader

logger = logging.getLogger(__name__)

#: Seconds between the mailbox reader's looks at whether it was closed.
_READ_SLICE = 1.0
#: Seconds a numbered note may be missing while later ones wait before it is skipped.
_GAP_SECONDS = 10.0


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


def encode(obj: msgspec.Struct) -> bytes:
    return _encode(obj)


def connect_store(host: str, port: int, secret: bytes, timeout: float) -> StoreClient:
    """An authenticated client connection to a mailbox store."""
    return StoreClient(host, port, secret, timeout)


def post(store: dist.Store, note: Note) -> None:
    """Leave ``note`` in the mailbox behind ``store`` (numbered, read in order)."""
    n = store.add("inbox/count", 1)
    store.set(f"inbox/{n}", encode(note))


class Mailbox:
    """This process's store server and the thread that reads its notes.

    Args:
        host: the node address peers connect to (the server binds to it alone).
        node_id: the Ray node id (peers use it to pick same-node transports).
        secret: the job's secret, which every client of the store must prove.
        on_note: called on the reader thread for every note but ``stop``.
        status: answers the store's ``status`` requests (see :class:`StoreServer`).
    """

    def __init__(
        self, host: str, node_id: str, secret: bytes, on_note: Callable[[Note], None],
        status: Callable[[str], bytes] | None = None,
    ):
        self._secret = secret
        self._server = StoreServer(host, secret, status=status)
        self.endpoint = Endpoint(
            host=host, port=self._server.port, node_id=node_id,
            incarnation=uuid.uuid4().hex[:12], pid=os.getpid(),
        )
        self._on_note = on_note
        self._closed = threading.Event()
        self._read = local_reader(self._server, self._closed)
        self._thread = threading.Thread(target=self._read_notes, name="rlcomm-mailbox", daemon=True)
        self._thread.start()

    def _posted(self) -> int:
        with self._server.table.cond:
            return int(self._server.table.data.get("inbox/count", b"0"))

    @property
    def rejected(self) -> int:
        """Connections to this mailbox that failed authentication so far."""
        return self._server.rejected

    def store_stats(self) -> dict[str, int]:
        """The store's connections and why unproven ones ended (``StoreServer.stats``)."""
        return self._server.stats()

    def client(self, timeout: float) -> StoreClient:
        """A new client connection to this mailbox (one per connection that uses it)."""
        return connect_store(self.endpoint.host, self.endpoint.port, self._secret, timeout)

    def _read_notes(self) -> None:
        n = 1
        missing_since: float | None = None
        while not self._closed.is_set():
            data = self._read(f"inbox/{n}", _READ_SLICE)
            if data is None:
                # A poster that died between numbering its note and writing it leaves a
                # gap: skip it once later notes wait behind it for a while.
                if self._posted() > n:
                    now = time.monotonic()
                    missing_since = missing_since or now
                    if now - missing_since > _GAP_SECONDS:
                        logger.warning("mailbox note %d never came; skipped", n)
                        n, missing_since = n + 1, None
                continue
            n, missing_since = n + 1, None
            try:
                note = _decode_note(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.warning("mailbox note %d cannot be decoded (%s); skipped", n - 1, exc)
                continue
            if note.kind == "stop":
                return
            try:
                self._on_note(note)
            except Exception:  # noqa: BLE001 - one bad note must not stop the mailbox
                logger.exception("handling %s note from %s failed", note.kind, note.sender)

    def close(self) -> None:
        self._closed.set()
        with self._server.table.cond:
            self._server.table.cond.notify_all()
        self._thread.join(timeout=10)
        self._server.close()
