"""``CommManager``: this process's connections and broadcast groups, made on first use.

One manager per worker process, started with the worker. It holds the
:class:`~rlcomm.comm.handshake.Handshake`, which owns the mailbox (and its reader
thread), its small pool of threads, every :class:`Connection` and the cache of peers'
endpoints (found through the registry actor once); the manager owns every
:class:`BroadcastGroup`. A send or receive on a live connection
takes no lock of the manager's (the per-message path is a dict read).

Every op is recorded in the process's flight recorder (:mod:`~rlcomm.comm.flight`),
which the mailbox's ``status`` request reports (:mod:`~rlcomm.comm.status`). An op that
fails with ``CommTimeoutError`` (one whose timeout is 1 s or more) or ``PeerLostError``
asks its peer what it is doing, and its error says (:meth:`CommManager.explain`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
import ray
import torch
import torch.distributed as dist

from rlcomm.comm import codec, status
from rlcomm.comm.broadcast.group import BroadcastGroup, GroupsSpec, expand_groups
from rlcomm.comm.buckets import MIN_BUCKET, stream_bucket
from rlcomm.comm.connection import Connection
from rlcomm.comm.connection.connection import NOT_PLAIN
from rlcomm.comm.connection.sender import DeviceOrder
from rlcomm.comm.flight import RECORDER
from rlcomm.comm.framing import small_frame
from rlcomm.comm.handshake import Handshake
from rlcomm.comm.identity.address import RankLike, WorkerAddress
from rlcomm.comm.identity.endpoint import decode_endpoint, encode_endpoint
from rlcomm.comm.identity.registry import job_secret, registry
from rlcomm.comm.options import CollectiveGroupOptions, op_timeout
from rlcomm.comm.store.client import sub_store
from rlcomm.comm.work import AsyncWork
from rlcomm.errors import (
    CommError,
    CommTimeoutError,
    OptionsMismatchError,
    PeerLostError,
    RlcommError,
)
from rlcomm.settings import get_settings

logger = logging.getLogger(__name__)

# The flight recorder's methods, bound once: they run for every message.
_begin = RECORDER.begin
_end = RECORDER.end
_monotonic = time.monotonic

#: Payloads at most this large never stream, whatever the pool (what a send checks first).
_STREAM_FLOOR = MIN_BUCKET

_encode_fields = msgspec.msgpack.Encoder().encode
_decode_fields = msgspec.msgpack.Decoder(dict | None).decode


@functools.lru_cache(maxsize=1)
def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _device_order(tensors: list[torch.Tensor], async_op: bool) -> DeviceOrder | None:
    """Where a CUDA send stands in the caller's work, taken on the caller's thread: its
    current stream (a blocking send), or an event recorded on it now (an async one, whose
    payload is read later, on rlcomm's thread, after the work queued before the call)."""
    if not tensors or not tensors[0].is_cuda:
        return None
    stream = torch.cuda.current_stream(tensors[0].device)
    if not async_op:
        return DeviceOrder(stream, stream, False)
    mark = torch.cuda.Event()
    mark.record(stream)
    return DeviceOrder(mark, None, True)


def _on_stream(stream: Any, fn: Callable[[], Any]) -> Any:
    with torch.cuda.stream(stream):
        return fn()


def _ray_session() -> str:
    ctx = ray.get_runtime_context()
    return f"{ctx.gcs_address}/{ctx.get_job_id()}"


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
        self._lock = threading.Lock()  # guards the broadcast groups
        self._bcast: dict[tuple[WorkerAddress, ...], BroadcastGroup] = {}
        self._secret = job_secret()
        self._handshake = Handshake(address, host, node_id, self._secret, status=status.report)
        self._mailbox = self._handshake.mailbox
        self.endpoint = self._handshake.endpoint
        #: The connection with a peer, made on first use (the handshake's; bound once:
        #: every message asks for it).
        self.connection = self._handshake.connection
        status.add_section("process", self._status)
        ray.get(registry().set_endpoint.remote(str(address), encode_endpoint(self.endpoint)))

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
        bucket_bytes: int | None = None,
    ) -> AsyncWork | None:
        if not (raw or async_op or bucket_bytes) and piggyback is None:
            frame = small_frame(obj)
            if frame is not None and self._send_small(frame, dst, options):
                return None
        header, tensors = codec.encode_raw(obj) if raw else codec.encode(obj, piggyback)
        if not raw and tensors and not tensors[0].is_cuda:
            total = sum(t.nbytes for t in tensors)
            if bucket_bytes or total > _STREAM_FLOOR:
                header.stream = stream_bucket(total, bucket_bytes, strict=False)
        conn = self.connection(dst, options)
        timeout = op_timeout(options)
        order = _device_order(tensors, async_op) if tensors and tensors[0].is_cuda else None
        op = "send_tensor" if raw else "send"
        key = _begin(op, dst, header)
        if async_op:
            what = f"{op} from {self.address} to {dst}"
            check = None
            if not conn.checked_first_contact:
                check = lambda: self._check_first_contact(conn, options, timeout)  # noqa: E731
            try:
                fut = conn.submit_send(header, tensors, timeout, check, order)
            except BaseException as exc:
                _end(key, exc)
                raise
            fut.add_done_callback(lambda f: RECORDER.end_future(key, f))
            return AsyncWork(fut, what, timeout, explain=lambda exc, waited: self.explain(
                exc, op, dst, key, timeout if waited is None else waited),
                progress=conn.stream_progress if header.stream else None)
        try:
            if not conn.checked_first_contact:
                self._check_first_contact(conn, options, timeout)
            conn.send_inline(header, tensors, timeout, order)
        except BaseException as exc:
            _end(key, exc)
            if isinstance(exc, CommError):
                raise self.explain(exc, op, dst, key, timeout)  # noqa: B904 - the same error
            raise
        _end(key)
        return None

    def _send_small(
        self, frame: bytes, dst: WorkerAddress, options: CollectiveGroupOptions | None,
    ) -> bool:
        """:meth:`send` of a message that is one frame (:func:`framing.small_frame`), on
        a connection past first contact. False, having sent nothing, where it is not, or
        where sends are queued ahead: the general path sends it then (and the flight
        recorder shows it twice, where a send was queued between the look at the queue
        here and the sender's own)."""
        conn = self.connection(dst, options)
        if not conn.checked_first_contact or conn.sender.queued:
            return False
        timeout = op_timeout(options)
        key = _begin("send", dst, frame)  # its payload is counted when shown (size_of)
        try:
            sent = conn.send_small(frame, timeout)
        except BaseException as exc:
            _end(key, exc)
            if isinstance(exc, CommError):
                raise self.explain(exc, "send", dst, key, timeout)  # noqa: B904 - the same error
            raise
        _end(key)
        return sent

    def recv(
        self, src: WorkerAddress, async_op: bool, options: CollectiveGroupOptions | None,
        tensor: torch.Tensor | None = None, into: Any = None, shards: Any = None,
    ) -> Any:
        """Receive the next message from ``src``: an object, its tensors copied ``into``
        existing ones, or (``tensor``) a ``send_tensor`` message in place."""
        if tensor is not None and not tensor.is_contiguous():
            raise ValueError("recv_tensor: the destination tensor must be contiguous")
        conn = self.connection(src, options)
        timeout = op_timeout(options)
        key = deadline = None
        if not async_op and tensor is None and into is None and shards is None \
                and conn.checked_first_contact:
            # The commonest receive: it reads its own message at once, as it came.
            key = _begin("recv", src)
            deadline = _monotonic() + timeout
            try:
                ticket, result = conn.recv_plain(deadline)
            except BaseException as exc:
                _end(key, exc)
                raise
            if result is not NOT_PLAIN:
                _end(key)
                return result
        else:
            ticket = conn.take_ticket()
        device = stream = None
        if _cuda_available() and torch.cuda.is_initialized():
            device = torch.device("cuda", torch.cuda.current_device())
            stream = torch.cuda.current_stream(device)
        op = "recv_tensor" if tensor is not None else "recv"
        if key is None:
            key = _begin(op, src)
        if async_op:
            what = f"{op} at {self.address} from {src}"
            task = run = functools.partial(
                self._receive, conn, ticket, options, timeout, key, device, tensor, into, shards)
            if stream is not None:  # the received tensors are ordered on the caller's stream
                task = functools.partial(_on_stream, stream, run)
            try:
                fut = conn.run_async(task)
            except BaseException as exc:
                _end(key, exc)
                raise
            # A receive cancelled before it ran (its connection closed) ends here too.
            fut.add_done_callback(lambda f: RECORDER.end_future(key, f))
            return AsyncWork(fut, what, timeout, explain=lambda exc, waited:
                             self.explain(exc, op, src, key, timeout if waited is None else waited),
                             progress=conn.stream_progress)
        try:
            return self._receive(conn, ticket, options, timeout, key, device, tensor, into,
                                 shards, deadline)
        except CommError as exc:
            raise self.explain(exc, op, src, key, timeout)  # noqa: B904 - the same error

    def _receive(
        self, conn: Connection, ticket: int, options: CollectiveGroupOptions | None,
        timeout: float, key: int, device: torch.device | None, tensor: torch.Tensor | None,
        into: Any, shards: Any = None, deadline: float | None = None,
    ) -> Any:
        """Receive op ``key`` on ``conn`` (see :meth:`recv`), on the caller's thread or
        the connection's consumer thread (``deadline``: when its timeout ends, where it
        began earlier)."""
        try:
            if not conn.checked_first_contact:
                self._check_first_contact(conn, options, timeout)
            if tensor is not None:
                result = conn.recv_tensor_into(ticket, tensor, timeout)
            else:
                result = conn.recv_object(ticket, timeout, device, into, shards, deadline)
        except BaseException as exc:
            conn.release_ticket(ticket)  # unless served: every early exit gives it up
            _end(key, exc)
            raise
        _end(key)
        return result

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
        options: CollectiveGroupOptions | None, into: Any = None, shards: Any = None,
        bucket_bytes: int | None = None,
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
        cuda = None
        if _cuda_available() and torch.cuda.is_initialized():
            device = torch.device("cuda", torch.cuda.current_device())
            cuda = (device, torch.cuda.current_stream(device))
        source = members[src_index]
        key = _begin("broadcast", source)
        try:
            fut = group.submit(obj, src_index, timeout, into, cuda, host_wait=async_op,
                               shards=shards, bucket=bucket_bytes)
        except BaseException as exc:
            _end(key, exc)
            raise
        fut.add_done_callback(lambda f: RECORDER.end_future(key, f))

        def explain(exc: CommError, waited: float | None) -> CommError:
            peer = exc.peer if isinstance(exc.peer, WorkerAddress) else source
            return self.explain(exc, "broadcast", peer, key,
                                timeout if waited is None else waited)

        work = AsyncWork(fut, f"broadcast at {self.address} from {source}", timeout,
                         explain=explain, progress=group.progress_mark)
        return work if async_op else work.wait()

    # -- stores of pairs ------------------------------------------------------------------------

    def pair_store(self, owner: WorkerAddress, prefix: str, timeout: float) -> tuple[dist.Store, Any]:
        """A store under ``prefix`` in ``owner``'s mailbox (this worker's own, or a peer's
        reached over the network), and ``owner``'s endpoint (its node and process)."""
        if owner == self.address:
            return sub_store(self._mailbox.client(timeout), prefix), self.endpoint
        ep = self._handshake.peer_endpoint(owner)
        return sub_store(self._handshake.reach(owner, ep, timeout), prefix), ep

    def peer_endpoint(self, peer: WorkerAddress) -> Any:
        """``peer``'s endpoint (from the registry once): its node and process.

        Raises:
            PeerNotFoundError: ``peer`` is not running.
        """
        return self._handshake.peer_endpoint(peer)

    # -- what the peer was doing --------------------------------------------------------------

    def explain(
        self, exc: CommError, op: str, peer: WorkerAddress, key: int, timeout: float
    ) -> CommError:
        """``exc`` with an analysis of the hang (see :func:`status.analysis`): for a
        ``CommTimeoutError`` after a wait of 1 s or more (``timeout``: the op's timeout,
        or that of the ``AsyncWork.wait`` that ran out), or a ``PeerLostError``, when
        the ``hang_analysis_timeout`` setting is not 0. Other errors come back as they
        are."""
        ask = get_settings().hang_analysis_timeout
        if (
            ask <= 0
            or status.has_analysis(exc)
            or not isinstance(exc, (CommTimeoutError, PeerLostError))
            or (isinstance(exc, CommTimeoutError) and timeout < 1.0)
            or peer == self.address
        ):
            return exc
        entry = RECORDER.find(key)
        ep = self._handshake.cached_endpoint(peer)
        if ep is None:
            try:
                data = ray.get(registry().get_endpoint.remote(str(peer)), timeout=ask)
                ep = decode_endpoint(data) if data is not None else None
            except Exception:  # noqa: BLE001 - the analysis then says it could not ask
                ep = None
        text = status.analysis(self.address, op, peer, entry.began if entry else None,
                               ep, self._secret, ask)
        return status.with_analysis(exc, text)

    def _status(self) -> dict[str, Any]:
        """The ``process`` section of this process's status report: who it is, its
        connections and its mailbox store (read without the manager's lock)."""
        conns = []
        for peer, conn in list(self._handshake.conns.items()):
            reader = conn.reader
            error = conn.error
            state = (
                f"failed ({type(error).__name__})" if error is not None
                else "connecting" if not conn.attached
                else "listened" if reader.listener is not None
                else "open"
            )
            conns.append({
                "peer": str(peer), "transport": conn.transport_name, "state": state,
                "life": conn.life.value, "reader": reader.lease.value,
                "unread_bytes": reader.inbox.unread, "unread_messages": len(reader.inbox),
            })
        return {
            "address": str(self.address), "host": self.endpoint.host,
            "node_id": self.endpoint.node_id, "incarnation": self.endpoint.incarnation,
            "connections": conns, "broadcast_groups": len(self._bcast),
            "broadcasts": [group.stats() for group in list(self._bcast.values())],
            "store": self._mailbox.store_stats(),
        }

    def _broadcast_group(self, members: tuple[WorkerAddress, ...], timeout: float) -> BroadcastGroup:
        with self._lock:
            group = self._bcast.get(members)
        if group is not None:
            return group
        eps = [self.endpoint if m == self.address else self._handshake.peer_endpoint(m) for m in members]

        def connect_store(indices: tuple[int, ...]) -> dist.Store:
            """The store of the members at ``indices``: in the first one's mailbox."""
            digest = hashlib.sha1(
                "|".join(f"{m}@{e.incarnation}" for m, e in zip(members, eps)).encode()
                + repr(indices).encode()
            ).hexdigest()[:16]
            leader = members[indices[0]]
            client = (
                self._mailbox.client(timeout) if leader == self.address
                else self._handshake.reach(leader, eps[indices[0]], timeout)
            )
            return sub_store(client, f"bcast/{digest}")

        group = BroadcastGroup(
            connect_store, list(members), members.index(self.address),
            nodes=[(e.node_id, e.host) for e in eps], pids=[e.pid for e in eps],
            host=self.endpoint.host, secret=self._secret,
        )
        with self._lock:
            return self._bcast.setdefault(members, group)

    def close(self) -> None:
        with self._lock:
            groups, self._bcast = list(self._bcast.values()), {}
        for conn in self._handshake.drop_connections():
            conn.close()
        for group in groups:
            group.close()
        self._handshake.close()
        status.remove_section("process")
