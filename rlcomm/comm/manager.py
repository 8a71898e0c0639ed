"""``CommManager``: this process's connections and broadcast groups, made on first use.

One manager per worker process, started with the worker. It owns the mailbox (and its
reader thread), a small pool of handshake threads, and every :class:`Connection` and
:class:`BroadcastGroup`. Peers are found through the registry actor once, then cached.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import itertools
import logging
import threading
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
import ray
import torch
import torch.distributed as dist

from rlcomm.comm import codec
from rlcomm.comm.broadcast import BroadcastGroup, GroupsSpec, expand_groups
from rlcomm.comm.connection import Connection
from rlcomm.comm.identity.address import RankLike, WorkerAddress
from rlcomm.comm.identity.registry import job_secret, registry
from rlcomm.comm.options import CollectiveGroupOptions, default_timeout, op_timeout
from rlcomm.comm.rendezvous import (
    Endpoint,
    Mailbox,
    Note,
    connect_store,
    decode_endpoint,
    encode,
    post,
)
from rlcomm.comm.store import sub_store
from rlcomm.comm.transports.base import Transport
from rlcomm.comm.transports.gloo import GlooTransport
from rlcomm.comm.transports.shm import SHM_SUPPORTED, ShmTransport
from rlcomm.comm.work import AsyncWork
from rlcomm.errors import (
    CommError,
    CommTimeoutError,
    OptionsMismatchError,
    PeerLostError,
    PeerNotFoundError,
    RlcommError,
)

logger = logging.getLogger(__name__)

_encode_fields = msgspec.msgpack.Encoder().encode
_decode_fields = msgspec.msgpack.Decoder(dict | None).decode


@functools.lru_cache(maxsize=1)
def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _ray_session() -> str:
    ctx = ray.get_runtime_context()
    return f"{ctx.gcs_address}/{ctx.get_job_id()}"


def parse_address(text: str) -> WorkerAddress:
    group, _, path = text.rpartition(":")
    return WorkerAddress(group, tuple(int(p) for p in path.split(".")))


class CommManager:
    """Connections of one worker process (see module docstring).

    Args:
        address: this worker's address; its mailbox endpoint is registered under it.
    """

    _current: CommManager | None = None
    _current_lock = threading.Lock()
    #: For a driver's manager: the Ray session it was made in (``None`` for workers).
    _driver_session: str | None = None

    def __init__(self, address: WorkerAddress):
        self.address = address
        host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
        self._lock = threading.Lock()
        self._conns: dict[WorkerAddress, Connection] = {}
        self._bcast: dict[tuple[WorkerAddress, ...], BroadcastGroup] = {}
        self._endpoints: dict[WorkerAddress, Endpoint] = {}
        self._attempts = itertools.count()
        self._handshakes = concurrent.futures.ThreadPoolExecutor(16, "rlcomm-handshake")
        self._secret = job_secret()
        self._mailbox = Mailbox(host, node_id, self._secret, self._on_note)
        self.endpoint = self._mailbox.endpoint
        ray.get(registry().set_endpoint.remote(str(address), encode(self.endpoint)))

    # -- the process's manager --------------------------------------------------------------

    @classmethod
    def start(cls, address: WorkerAddress) -> CommManager:
        with cls._current_lock:
            if cls._current is None or cls._current.address != address:
                cls._current = cls(address)
            return cls._current

    @classmethod
    def current(cls) -> CommManager:
        if cls._current is None:
            raise RlcommError(
                "this process has no rlcomm communication set up: send/recv work inside "
                "workers launched with WorkerGroup.launch (or sub-workers given a parent_address)"
            )
        return cls._current

    @classmethod
    def for_process(cls) -> CommManager:
        """This process's manager; a process that is no worker (the driver) gets one on
        first use, addressed ``driver-<id>:0``, and a new one after a Ray restart (the
        old one's registry and peers are gone). Needs Ray to be initialized."""
        with cls._current_lock:
            current = cls._current
            if (
                current is not None
                and current._driver_session is not None
                and ray.is_initialized()
                and current._driver_session != _ray_session()
            ):
                cls._current = None
                try:
                    current.close()
                except Exception:  # noqa: BLE001 - its Ray is gone; nothing to save
                    logger.debug("closing the driver's stale comm manager failed", exc_info=True)
            if cls._current is None:
                if not ray.is_initialized():
                    raise RlcommError("rlcomm communication from a driver needs ray.init() first")
                cls._current = cls(WorkerAddress(f"driver-{uuid.uuid4().hex[:8]}", (0,)))
                cls._current._driver_session = _ray_session()
            return cls._current

    # -- peers ----------------------------------------------------------------------------------

    def _endpoint(self, peer: WorkerAddress) -> Endpoint:
        ep = self._endpoints.get(peer)
        if ep is not None:
            return ep
        data = ray.get(registry().get_endpoint.remote(str(peer)), timeout=60)
        if data is None:
            info = ray.get(registry().get_group.remote(peer.group_name), timeout=60)
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
        if peer == self.address:
            raise ValueError(f"{peer}: a worker cannot send to or receive from itself")
        with self._lock:
            conn = self._conns.get(peer)
            if conn is not None:
                if conn.error is None:
                    return conn
                self._endpoints.pop(peer, None)  # the peer may be a new process now
        ep = self._endpoint(peer)
        with self._lock:
            conn = self._conns.get(peer)
            # A failed connection is forgotten right after its error is raised; one that
            # is still here is as good as gone (a reconnecting caller gets a new one).
            if conn is not None and conn.error is None:
                return conn
            conn = self._new_connection(peer, options)
        self._handshakes.submit(self._initiate, conn, peer, ep, options)
        return conn

    def _new_connection(
        self, peer: WorkerAddress, options: CollectiveGroupOptions | None
    ) -> Connection:
        conn = Connection(str(peer), on_lost=lambda c: self._forget(peer, c))
        conn.requested_options = options
        self._conns[peer] = conn
        return conn

    def _forget(self, peer: WorkerAddress, conn: Connection) -> None:
        with self._lock:
            if self._conns.get(peer) is conn:
                del self._conns[peer]
                self._endpoints.pop(peer, None)

    def _initiate(
        self, conn: Connection, peer: WorkerAddress, ep: Endpoint,
        options: CollectiveGroupOptions | None,
    ) -> None:
        try:
            if self.address > peer:
                self._request(conn, peer, ep, options)
            else:
                client = self._reach(peer, ep, op_timeout(options))
                post(client, Note("invite", str(self.address), self.endpoint.incarnation))
        except CommError as exc:
            conn.fail(exc)
        except Exception as exc:  # noqa: BLE001 - surfaces in the waiting op
            conn.fail(PeerLostError(f"connecting to {peer} failed: {exc!r}"))

    def _reach(self, peer: WorkerAddress, ep: Endpoint, timeout: float) -> dist.Store:
        try:
            return connect_store(ep.host, ep.port, self._secret, timeout)
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
            f"pair/{peer}/{self.address}/{ep.incarnation}/{self.endpoint.incarnation}/"
            f"{next(self._attempts)}"
        )
        client = self._reach(peer, ep, timeout)
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
        store = sub_store(client, prefix)
        conn.attach(self._transport(store, 1, timeout, peer, ep, conn.agreed_fields), store, 1)

    def _transport(
        self, store: dist.Store, rank: int, timeout: float, peer: WorkerAddress, ep: Endpoint,
        fields: dict | None,
    ) -> Transport:
        """Shared memory between workers of one node (unless the options ask for Gloo),
        else Gloo. Both ends decide alike: same node ids, same agreed options."""
        choice = (fields or {}).get("transport", "auto")
        same_node = ep.node_id == self.endpoint.node_id and ep.host == self.endpoint.host
        if choice == "shm" and not (same_node and SHM_SUPPORTED):
            raise OptionsMismatchError(
                f"transport='shm' needs both workers on one x86-64 node; {peer} is not"
            )
        if choice in ("auto", "shm") and same_node and SHM_SUPPORTED:
            return ShmTransport(store, rank, timeout, str(peer), peer_pid=ep.pid)
        return GlooTransport(
            store, rank, timeout, str(peer), secret=self._secret, host=self.endpoint.host
        )

    def _on_note(self, note: Note) -> None:
        if note.kind == "request":
            self._handshakes.submit(self._guarded, self._accept, note)
        elif note.kind == "invite":
            self._handshakes.submit(self._guarded, self._on_invite, note)
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
            ep = self._endpoint(peer)
            if ep.incarnation != note.incarnation:  # the cached one may be an old process
                self._endpoints.pop(peer, None)
                ep = self._endpoint(peer)
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
            if peer in self._conns:
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
            old = self._conns.get(peer)
            if old is not None and (old.attached or old.error is not None):
                del self._conns[peer]  # forgotten here; failed below, outside the lock
            else:
                old = None
            conn = self._conns.get(peer)
            if conn is None:
                conn = self._new_connection(peer, None)
        if old is not None:
            # Never under the lock: failing calls on_lost, which takes it again.
            old.fail(PeerLostError(f"{peer} reconnected; the old connection is closed"))
        mine = conn.requested_options
        mine_fields = mine.group_fields() if mine is not None else None
        client = self._mailbox.client(timeout)
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
        store = sub_store(client, note.prefix)
        try:
            conn.attach(self._transport(store, 0, timeout, peer, ep, agreed), store, 0)
        except CommError as exc:
            conn.fail(exc)

    def _check_first_contact(
        self, conn: Connection, options: CollectiveGroupOptions | None, timeout: float
    ) -> None:
        """This side's first op on a connection, when it passes options, must agree with
        the options the connection was made with; later ops' options only set timeouts."""
        if conn.checked_first_contact:
            return
        conn.checked_first_contact = True
        if options is None:
            return
        conn.wait_ready(timeout)
        agreed = conn.agreed_fields or CollectiveGroupOptions().group_fields()
        if agreed != options.group_fields():
            raise OptionsMismatchError(
                f"CollectiveGroupOptions differ between {self.address} "
                f"({options.group_fields()}) and {conn.peer} ({agreed}); pass the same options "
                "on both ends"
            )

    # -- ops --------------------------------------------------------------------------------------

    def send(
        self, obj: Any, dst: WorkerAddress, async_op: bool,
        options: CollectiveGroupOptions | None, piggyback: Any = None, raw: bool = False,
    ) -> AsyncWork | None:
        header, tensors = codec.encode_raw(obj) if raw else codec.encode(obj, piggyback)
        conn = self.connection(dst, options)
        timeout = op_timeout(options)
        if async_op:
            what = f"{'send_tensor' if raw else 'send'} from {self.address} to {dst}"
            check = None
            if not conn.checked_first_contact:
                check = lambda: self._check_first_contact(conn, options, timeout)  # noqa: E731
            return AsyncWork(conn.submit_send(header, tensors, timeout, check), what, timeout)
        self._check_first_contact(conn, options, timeout)
        conn.send_inline(header, tensors, timeout)
        return None

    def recv(
        self, src: WorkerAddress, async_op: bool, options: CollectiveGroupOptions | None,
        into: torch.Tensor | None = None,
    ) -> Any:
        if into is not None and not into.is_contiguous():
            raise ValueError("recv_tensor: the destination tensor must be contiguous")
        conn = self.connection(src, options)
        ticket = conn.take_ticket()
        timeout = op_timeout(options)
        device = None
        if _cuda_available() and torch.cuda.is_initialized():
            device = torch.device("cuda", torch.cuda.current_device())

        def run() -> Any:
            try:
                self._check_first_contact(conn, options, timeout)
                if into is not None:
                    return conn.recv_tensor_into(ticket, into, timeout)
                return conn.recv_object(ticket, timeout, device)
            finally:
                conn.release_ticket(ticket)  # a no-op once served

        if async_op:
            what = f"{'recv_tensor' if into is not None else 'recv'} at {self.address} from {src}"
            return AsyncWork(conn.run_async(run), what, timeout)
        return run()

    def listen(
        self, peer: WorkerAddress, on_message: Callable[[Any], None],
        on_error: Callable[[CommError], None], options: CollectiveGroupOptions | None,
    ) -> Connection:
        """Hand every message from ``peer`` to ``on_message`` (see ``Connection.listen``);
        the connection is then not for ``recv``. Wait for replies with its ``pump``."""
        conn = self.connection(peer, options)
        conn.listen(on_message, on_error)
        return conn

    def broadcast(
        self, obj: Any, groups: GroupsSpec, src: tuple[str, RankLike] | None, async_op: bool,
        options: CollectiveGroupOptions | None,
    ) -> Any:
        members = expand_groups(groups)
        if self.address not in members:
            raise ValueError(
                f"broadcast: this worker {self.address} is not among the participants "
                f"{[str(m) for m in members]}"
            )
        src_index = 0
        if src is not None:
            src_addr = WorkerAddress.of(src[0], src[1])
            if src_addr not in members:
                raise ValueError(f"broadcast: src {src_addr} is not among the participants")
            src_index = members.index(src_addr)
        timeout = op_timeout(options)
        group = self._broadcast_group(tuple(members), timeout)
        fut = group.submit(obj, src_index, timeout)
        work = AsyncWork(fut, f"broadcast at {self.address} from {members[src_index]}", timeout)
        return work if async_op else work.wait()

    def _broadcast_group(self, members: tuple[WorkerAddress, ...], timeout: float) -> BroadcastGroup:
        with self._lock:
            group = self._bcast.get(members)
        if group is not None:
            return group
        eps = [self.endpoint if m == self.address else self._endpoint(m) for m in members]

        def connect_store(indices: tuple[int, ...]) -> dist.Store:
            """The store of the members at ``indices``: in the first one's mailbox."""
            digest = hashlib.sha1(
                "|".join(f"{m}@{e.incarnation}" for m, e in zip(members, eps)).encode()
                + repr(indices).encode()
            ).hexdigest()[:16]
            leader = members[indices[0]]
            client = (
                self._mailbox.client(timeout) if leader == self.address
                else self._reach(leader, eps[indices[0]], timeout)
            )
            return sub_store(client, f"bcast/{digest}")

        group = BroadcastGroup(
            connect_store, list(members), members.index(self.address),
            nodes=[(e.node_id, e.host) for e in eps], pids=[e.pid for e in eps],
            host=self.endpoint.host,
        )
        with self._lock:
            return self._bcast.setdefault(members, group)

    def close(self) -> None:
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
            groups, self._bcast = list(self._bcast.values()), {}
        for conn in conns:
            conn.close()
        for group in groups:
            group.close()
        self._mailbox.close()
