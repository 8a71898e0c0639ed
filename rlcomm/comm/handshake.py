"""The handshake: how two workers' managers make a connection.

The end with the higher address *requests* (a note in the peer's mailbox naming a fresh
rendezvous prefix and its options); the other *invites* it to (a note that makes the
peer request). A note's claims are checked against the registry (the sender's
incarnation) before anything is answered, and a note never picks the transport: both
ends compute the pair's facts and let the transport registry choose. Handshakes run on
a small pool of threads that this object owns, never on the mailbox's reader.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import torch.distributed as dist

from rlcomm.comm.connection import Connection
from rlcomm.comm.identity.address import WorkerAddress
from rlcomm.comm.identity.endpoint import Endpoint
from rlcomm.comm.options import CollectiveGroupOptions, default_timeout, op_timeout
from rlcomm.comm.rendezvous import Note, connect_store, post
from rlcomm.comm.store import sub_store
from rlcomm.comm.transports import registry
from rlcomm.comm.transports.registry import PairFacts, TransportSetup
from rlcomm.errors import CommError, CommTimeoutError, OptionsMismatchError, PeerLostError

if TYPE_CHECKING:
    from rlcomm.comm.manager import CommManager

logger = logging.getLogger(__name__)

_encode_fields = msgspec.msgpack.Encoder().encode
_decode_fields = msgspec.msgpack.Decoder(dict | None).decode


def parse_address(text: str) -> WorkerAddress:
    group, _, path = text.rpartition(":")
    return WorkerAddress(group, tuple(int(p) for p in path.split(".")))


class Handshake:
    """The handshakes of one manager (see the module docstring). It reads and changes
    the manager's connection table under the manager's lock, and never fails a
    connection while holding it.

    Args:
        manager: the manager whose connections it makes.
    """

    def __init__(self, manager: CommManager):
        self._m = manager
        self._attempts = itertools.count()
        self.pool = concurrent.futures.ThreadPoolExecutor(16, "rlcomm-handshake")

    def initiate(
        self, conn: Connection, peer: WorkerAddress, ep: Endpoint,
        options: CollectiveGroupOptions | None,
    ) -> None:
        try:
            if self._m.address > peer:
                self._request(conn, peer, ep, options)
            else:
                client = self.reach(peer, ep, op_timeout(options))
                post(client, Note("invite", str(self._m.address), self._m.endpoint.incarnation))
        except CommError as exc:
            conn.fail(exc)
        except Exception as exc:  # noqa: BLE001 - surfaces in the waiting op
            conn.fail(PeerLostError(f"connecting to {peer} failed: {exc!r}"))

    def reach(self, peer: WorkerAddress, ep: Endpoint, timeout: float) -> dist.Store:
        try:
            return connect_store(ep.host, ep.port, self._m._secret, timeout)
        except PeerLostError as exc:
            raise PeerLostError(
                f"cannot reach {peer} at {ep.host}:{ep.port}: its process is gone"
            ) from exc
        except CommError as exc:
            raise type(exc)(f"cannot reach {peer} at {ep.host}:{ep.port}: {exc}") from exc

    def _request(
        self, conn: Connection, peer: WorkerAddress, ep: Endpoint,
        options: CollectiveGroupOptions | None,
    ) -> None:
        timeout = op_timeout(options)
        prefix = (
            f"pair/{peer}/{self._m.address}/{ep.incarnation}/{self._m.endpoint.incarnation}/"
            f"{next(self._attempts)}"
        )
        client = self.reach(peer, ep, timeout)
        fields = options.group_fields() if options is not None else None
        post(client, Note("request", str(self._m.address), self._m.endpoint.incarnation, prefix, fields))
        try:
            client.wait([f"{prefix}/reply"])
        except Exception as exc:  # noqa: BLE001
            raise CommTimeoutError(
                f"{peer} did not answer the connection request within {timeout}s"
            ) from exc
        reply = client.get(f"{prefix}/reply")
        if reply.startswith(b"reject:"):
            raise OptionsMismatchError(reply[len(b"reject:"):].decode())
        conn.agreed_fields = _decode_fields(reply[len(b"ok:"):])
        self._attach(conn, sub_store(client, prefix), 1, timeout, peer, ep, conn.agreed_fields)

    def _attach(
        self, conn: Connection, store: dist.Store, rank: int, timeout: float,
        peer: WorkerAddress, ep: Endpoint, fields: dict | None,
    ) -> None:
        """Make this end's transport and attach it to ``conn``. The pair's facts are
        computed here, once; the registry picks the transport from them and the agreed
        options, so both ends pick alike without telling each other."""
        mine = self._m.endpoint
        facts = PairFacts(same_node=ep.node_id == mine.node_id and ep.host == mine.host)
        try:
            spec = registry.select(facts, registry.CPU, (fields or {}).get("transport", "auto"))
        except OptionsMismatchError as exc:
            raise OptionsMismatchError(f"connecting {self._m.address} with {peer}: {exc}") from exc
        transport = spec.factory(TransportSetup(
            store, rank, timeout, str(peer), peer_pid=ep.pid, secret=self._m._secret,
            host=mine.host,
        ))
        conn.attach(transport, store, rank, facts, peer_pid=ep.pid)

    def on_note(self, note: Note) -> None:
        if note.kind == "request":
            self.pool.submit(self._guarded, self._accept, note)
        elif note.kind == "invite":
            self.pool.submit(self._guarded, self._on_invite, note)
        else:
            logger.warning("mailbox of %s: a note of unknown kind %r dropped",
                           self._m.address, note.kind)

    def _guarded(self, handler: Callable[[Note], None], note: Note) -> None:
        """Run a note's handler on a handshake thread; a failure is logged, never lost."""
        try:
            handler(note)
        except Exception:  # noqa: BLE001 - a bad note must not go unnoticed
            logger.exception("%s: handling a %s note from %r failed",
                             self._m.address, note.kind, note.sender)

    def _sender_of(self, note: Note) -> tuple[WorkerAddress, Endpoint] | None:
        """The note's sender and its registered endpoint, when the note's claims match
        the registry (the sender's incarnation); else None (the note is dropped)."""
        try:
            peer = parse_address(note.sender)
        except ValueError:
            logger.warning("%s: a note names no valid sender (%r); dropped",
                           self._m.address, note.sender)
            return None
        if peer == self._m.address:
            logger.warning("%s: a note claims to come from this worker; dropped", self._m.address)
            return None
        try:
            ep = self._m._endpoint(peer)
            if ep.incarnation != note.incarnation:  # the cached one may be an old process
                self._m._endpoints.pop(peer, None)
                ep = self._m._endpoint(peer)
        except CommError as exc:
            logger.warning("%s: a %s note from %s, who is not registered (%s); dropped",
                           self._m.address, note.kind, peer, exc)
            return None
        if ep.incarnation != note.incarnation:
            logger.warning(
                "%s: a %s note claims to come from %s incarnation %r, but the registry "
                "knows incarnation %r; dropped", self._m.address, note.kind, peer,
                note.incarnation, ep.incarnation,
            )
            return None
        return peer, ep

    def _on_invite(self, note: Note) -> None:
        sender = self._sender_of(note)
        if sender is None:
            return
        peer = sender[0]
        with self._m._lock:
            if peer in self._m._conns:
                return  # connected or connecting already
        try:
            self._m.connection(peer, None)
        except CommError as exc:
            logger.warning("invite from %s could not be answered: %s", peer, exc)

    def _accept(self, note: Note) -> None:
        sender = self._sender_of(note)
        if sender is None:
            return
        peer, ep = sender
        expected = f"pair/{self._m.address}/{peer}/{self._m.endpoint.incarnation}/{ep.incarnation}/"
        tail = note.prefix[len(expected):]
        if not note.prefix.startswith(expected) or not tail.isdigit():
            logger.warning("%s: a request from %s names a foreign prefix %r; dropped",
                           self._m.address, peer, note.prefix)
            return
        try:
            theirs = (
                None if note.options is None
                else CollectiveGroupOptions.from_group_fields(note.options).group_fields()
            )
        except (TypeError, ValueError) as exc:
            logger.warning("%s: a request from %s has invalid options (%s); dropped",
                           self._m.address, peer, exc)
            return
        timeout = default_timeout()
        with self._m._lock:
            old = self._m._conns.get(peer)
            if old is not None and (old.attached or old.error is not None):
                del self._m._conns[peer]  # forgotten here; failed below, outside the lock
            else:
                old = None
            conn = self._m._conns.get(peer)
            if conn is None:
                conn = self._m._new_connection(peer, None)
        if old is not None:
            # Never under the lock: failing calls on_lost, which takes it again.
            old.fail(PeerLostError(f"{peer} reconnected; the old connection is closed"))
        mine = conn.requested_options
        mine_fields = mine.group_fields() if mine is not None else None
        client = self._m._mailbox.client(timeout)
        reply_key = f"{note.prefix}/reply"
        if mine_fields is not None and theirs is not None and mine_fields != theirs:
            text = (
                f"CollectiveGroupOptions differ between {self._m.address} ({mine_fields}) and "
                f"{peer} ({theirs}); pass the same options on both ends"
            )
            client.set(reply_key, b"reject:" + text.encode())
            conn.fail(OptionsMismatchError(text))
            return
        agreed = theirs if theirs is not None else mine_fields
        conn.agreed_fields = agreed
        client.set(reply_key, b"ok:" + _encode_fields(agreed))
        try:
            self._attach(conn, sub_store(client, note.prefix), 0, timeout, peer, ep, agreed)
        except CommError as exc:
            conn.fail(exc)
