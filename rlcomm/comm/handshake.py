"""The handshake: how two workers' managers make a connection.

The end with the higher address *requests* (a note in the peer's mailbox naming a fresh
rendezvous prefix and its options); the other *invites* it to (a note that makes the
peer request). A note's claims are checked against the registry (the sender's
incarnation) before anything is answered, and a note never picks the transport: both
ends compute the pair's facts and let the transport registry choose. Handshakes run on
a small pool of threads that this object owns, never on the mailbox's reader.

The handshake owns what it builds: this process's mailbox, the table of connections by
peer (one writer: this object, under its lock) and the cache of peers' endpoints. The
:class:`~rlcomm.comm.manager.CommManager` asks it for a connection and sends on it.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
from collections.abc import Callable

import msgspec
import ray
import torch.distributed as dist

from rlcomm.comm.connection import Connection
from rlcomm.comm.identity.address import WorkerAddress
from rlcomm.comm.identity.endpoint import Endpoint, decode_endpoint
from rlcomm.comm.identity.registry import registry as registry_actor
from rlcomm.comm.options import CollectiveGroupOptions, default_timeout, op_timeout
from rlcomm.comm.store.client import sub_store
from rlcomm.comm.store.link import ForeignStoreError
from rlcomm.comm.store.rendezvous import Mailbox, Note, connect_store, post
from rlcomm.comm.transports import registry
from rlcomm.comm.transports.registry import PairFacts, TransportSetup
from rlcomm.errors import (
    CommError,
    CommTimeoutError,
    OptionsMismatchError,
    PeerLostError,
    PeerNotFoundError,
)

logger = logging.getLogger(__name__)

_encode_fields = msgspec.msgpack.Encoder().encode
_decode_fields = msgspec.msgpack.Decoder(dict | None).decode


def parse_address(text: str) -> WorkerAddress:
    group, _, path = text.rpartition(":")
    return WorkerAddress(group, tuple(int(p) for p in path.split(".")))


class Handshake:
    """The connections of one worker process and how they are made (see the module
    docstring). It changes its connection table under its lock, and never fails a
    connection while holding it.

    Args:
        address: this worker's address.
        host: the node address peers connect to (the mailbox binds to it alone).
        node_id: the Ray node id.
        secret: the job's secret.
        status: answers the mailbox store's ``status`` requests.
    """

    def __init__(
        self, address: WorkerAddress, host: str, node_id: str, secret: bytes,
        status: Callable[[str], bytes] | None = None,
    ):
        self.address = address
        self._secret = secret
        self._lock = threading.Lock()
        #: The connection with each peer; read without the lock on the per-message path.
        self.conns: dict[WorkerAddress, Connection] = {}
        self._endpoints: dict[WorkerAddress, Endpoint] = {}
        self._attempts = itertools.count()
        self.pool = concurrent.futures.ThreadPoolExecutor(16, "rlcomm-handshake")
        self.mailbox = Mailbox(host, node_id, secret, self.on_note, status=status)
        self.endpoint = self.mailbox.endpoint

    # -- the connection table -----------------------------------------------------------------

    def cached_endpoint(self, peer: WorkerAddress) -> Endpoint | None:
        """``peer``'s endpoint if it was looked up already."""
        return self._endpoints.get(peer)

    def peer_endpoint(self, peer: WorkerAddress) -> Endpoint:
        """``peer``'s mailbox endpoint, from the registry once, then cached.

        Raises:
            PeerNotFoundError: ``peer`` is not running.
        """
        ep = self._endpoints.get(peer)
        if ep is not None:
            return ep
        data = ray.get(registry_actor().get_endpoint.remote(str(peer)), timeout=60)
        if data is None:
            info = ray.get(registry_actor().get_group.remote(peer.group_name), timeout=60)
            if not info:
                raise PeerNotFoundError(
                    f"no worker group named {peer.group_name!r} is running (peer {peer})"
                )
            size = info.get("world_size", 0)
            if not 0 <= peer.root_rank < size:
                raise PeerNotFoundError(
                    f"rank {peer.root_rank} is not in group {peer.group_name!r} of size {size}"
                )
            raise PeerNotFoundError(f"worker {peer} is not running or has not registered")
        ep = decode_endpoint(data)
        self._endpoints[peer] = ep
        return ep

    def connection(self, peer: WorkerAddress, options: CollectiveGroupOptions | None) -> Connection:
        """The connection with ``peer``, starting the handshake if there is none."""
        # The per-message path: a dict read is atomic, so a live connection is found
        # without the lock (one is never made for this worker's own address).
        conn = self.conns.get(peer)
        if conn is not None and conn.error is None:
            return conn
        if peer == self.address:
            raise ValueError(f"{peer}: a worker cannot send to or receive from itself")
        with self._lock:
            conn = self.conns.get(peer)
            if conn is not None:
                if conn.error is None:
                    return conn
                self._endpoints.pop(peer, None)  # the peer may be a new process now
        ep = self.peer_endpoint(peer)
        with self._lock:
            conn = self.conns.get(peer)
            # A failed connection is forgotten right after its error is raised; one that
            # is still here is as good as gone (a reconnecting caller gets a new one).
            if conn is not None and conn.error is None:
                return conn
            conn = self._new_connection(peer, options)
        self.pool.submit(self.initiate, conn, peer, ep, options)
        return conn

    def _new_connection(
        self, peer: WorkerAddress, options: CollectiveGroupOptions | None
    ) -> Connection:
        conn = Connection(str(peer), on_lost=lambda c: self._forget(peer, c))
        conn.requested_options = options
        self.conns[peer] = conn
        return conn

    def _forget(self, peer: WorkerAddress, conn: Connection) -> None:
        with self._lock:
            if self.conns.get(peer) is conn:
                del self.conns[peer]
                self._endpoints.pop(peer, None)

    def drop_connections(self) -> list[Connection]:
        """Forget every connection; they are returned for the caller to close."""
        with self._lock:
            conns, self.conns = list(self.conns.values()), {}
        return conns

    def close(self) -> None:
        """Close the mailbox: no more notes are read."""
        self.mailbox.close()

    # -- the handshake --------------------------------------------------------------------------

    def initiate(
        self, conn: Connection, peer: WorkerAddress, ep: Endpoint,
        options: CollectiveGroupOptions | None,
    ) -> None:
        try:
            if self.address > peer:
                self._request(conn, peer, ep, options)
            else:
                client = self.reach(peer, ep, op_timeout(options))
                post(client, Note("invite", str(self.address), self.endpoint.incarnation))
        except CommError as exc:
            conn.fail(exc)
        except Exception as exc:  # noqa: BLE001 - surfaces in the waiting op
            conn.fail(PeerLostError(f"connecting to {peer} failed: {exc!r}"))

    def reach(self, peer: WorkerAddress, ep: Endpoint, timeout: float) -> dist.Store:
        try:
            return connect_store(ep.host, ep.port, self._secret, timeout)
        except PeerLostError as exc:
            raise PeerLostError(
                f"cannot reach {peer} at {ep.host}:{ep.port}: its process is gone"
            ) from exc
        except ForeignStoreError as exc:
            # A live worker holds its port: something else there means it is gone.
            raise PeerLostError(
                f"cannot reach {peer} at {ep.host}:{ep.port}: its process is gone (another "
                f"process now answers at its port: {exc})", peer=peer, op="connect",
            ) from exc
        except CommError as exc:
            raise type(exc)(f"cannot reach {peer} at {ep.host}:{ep.port}: {exc}") from exc

    def _request(
        self, conn: Connection, peer: WorkerAddress, ep: Endpoint,
        options: CollectiveGroupOptions | None,
    ) -> None:
        timeout = op_timeout(options)
        prefix = (
            f"pair/{peer}/{self.address}/{ep.incarnation}/{self.endpoint.incarnation}/"
            f"{next(self._attempts)}"
        )
        client = self.reach(peer, ep, timeout)
        fields = options.group_fields() if options is not None else None
        post(client, Note("request", str(self.address), self.endpoint.incarnation, prefix, fields))
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
        mine = self.endpoint
        facts = PairFacts(same_node=ep.node_id == mine.node_id and ep.host == mine.host)
        try:
            spec = registry.select(facts, registry.CPU, (fields or {}).get("transport", "auto"))
        except OptionsMismatchError as exc:
            raise OptionsMismatchError(f"connecting {self.address} with {peer}: {exc}") from exc
        transport = spec.factory(TransportSetup(
            store, rank, timeout, str(peer), peer_pid=ep.pid, secret=self._secret,
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
                           self.address, note.kind)

    def _guarded(self, handler: Callable[[Note], None], note: Note) -> None:
        """Run a note's handler on a handshake thread; a failure is logged, never lost."""
        try:
            handler(note)
        except Exception:  # noqa: BLE001 - a bad note must not go unnoticed
            logger.exception("%s: handling a %s note from %r failed",
                             self.address, note.kind, note.sender)

    def _sender_of(self, note: Note) -> tuple[WorkerAddress, Endpoint] | None:
        """The note's sender and its registered endpoint, when the note's claims match
        the registry (the sender's incarnation); else None (the note is dropped)."""
        try:
            peer = parse_address(note.sender)
        except ValueError:
            logger.warning("%s: a note names no valid sender (%r); dropped",
                           self.address, note.sender)
            return None
        if peer == self.address:
            logger.warning("%s: a note claims to come from this worker; dropped", self.address)
            return None
        try:
            ep = self.peer_endpoint(peer)
            if ep.incarnation != note.incarnation:  # the cached one may be an old process
                self._endpoints.pop(peer, None)
                ep = self.peer_endpoint(peer)
        except CommError as exc:
            logger.warning("%s: a %s note from %s, who is not registered (%s); dropped",
                           self.address, note.kind, peer, exc)
            return None
        if ep.incarnation != note.incarnation:
            logger.warning(
                "%s: a %s note claims to come from %s incarnation %r, but the registry "
                "knows incarnation %r; dropped", self.address, note.kind, peer,
                note.incarnation, ep.incarnation,
            )
            return None
        return peer, ep

    def _on_invite(self, note: Note) -> None:
        sender = self._sender_of(note)
        if sender is None:
            return
        peer = sender[0]
        with self._lock:
            if peer in self.conns:
                return  # connected or connecting already
        try:
            self.connection(peer, None)
        except CommError as exc:
            logger.warning("invite from %s could not be answered: %s", peer, exc)

    def _accept(self, note: Note) -> None:
        sender = self._sender_of(note)
        if sender is None:
            return
        peer, ep = sender
        expected = f"pair/{self.address}/{peer}/{self.endpoint.incarnation}/{ep.incarnation}/"
        tail = note.prefix[len(expected):]
        if not note.prefix.startswith(expected) or not tail.isdigit():
            logger.warning("%s: a request from %s names a foreign prefix %r; dropped",
                           self.address, peer, note.prefix)
            return
        try:
            theirs = (
                None if note.options is None
                else CollectiveGroupOptions.from_group_fields(note.options).group_fields()
            )
        except (TypeError, ValueError) as exc:
            logger.warning("%s: a request from %s has invalid options (%s); dropped",
                           self.address, peer, exc)
            return
        timeout = default_timeout()
        with self._lock:
            old = self.conns.get(peer)
            if old is not None and (old.attached or old.error is not None):
                del self.conns[peer]  # forgotten here; failed below, outside the lock
            else:
                old = None
            conn = self.conns.get(peer)
            if conn is None:
                conn = self._new_connection(peer, None)
        if old is not None:
            # Never under the lock: failing calls on_lost, which takes it again.
            old.fail(PeerLostError(f"{peer} reconnected; the old connection is closed"))
        mine = conn.requested_options
        mine_fields = mine.group_fields() if mine is not None else None
        client = self.mailbox.client(timeout)
        reply_key = f"{note.prefix}/reply"
        if mine_fields is not None and theirs is not None and mine_fields != theirs:
            text = (
                f"CollectiveGroupOptions differ between {self.address} ({mine_fields}) and "
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
