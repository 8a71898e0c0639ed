"""``Connection``: the message stream between this worker and one peer, in three parts.

A message is a *frame* (the msgspec header, and the payload too when it is small)
followed, for large payloads, by one transport message per tensor. The connection joins
a :class:`~.sender.Sender` (messages out), a :class:`~.reader.Reader` (who reads the
stream, in explicit states) and the reader's :class:`~.inbox.Inbox` (bounded), and
drives the reader with a receiver thread of its own (:mod:`.receiver`) unless a
selector drives it. A *consumer* thread runs the ``async_op=True`` receives.

CUDA payloads: the frame goes over the CPU transport, the payload over the connection's
CUDA transport, chosen by the transport registry from the pair's facts and made at its
first CUDA payload (either direction), when both ends have swapped their GPU's UUID.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from rlcomm.comm import codec, framing
from rlcomm.comm.bucket_iter import Buckets
from rlcomm.comm.buckets import Shards, plan
from rlcomm.comm.codec import Kind, MessageHeader
from rlcomm.comm.connection.incoming import P_IN_STREAM, P_INLINE, P_READ, Incoming
from rlcomm.comm.connection.listening import Listener
from rlcomm.comm.connection.reader import Reader
from rlcomm.comm.connection.receiver import start_receiver_thread
from rlcomm.comm.connection.sender import DeviceOrder, Sender
from rlcomm.comm.store.client import sub_store
from rlcomm.comm.taking import Receipt, Taking
from rlcomm.comm.transports import gpus, registry
from rlcomm.comm.transports.base import OneSidedTransport, Transport
from rlcomm.comm.transports.registry import PairFacts, TransportSetup
from rlcomm.errors import (
    CodecError,
    CommError,
    CommTimeoutError,
    PeerLostError,
    ProtocolMismatchError,
)

logger = logging.getLogger(__name__)


#: What :meth:`Connection.recv_plain` returns for a message it leaves to the general way.
NOT_PLAIN = object()


def _plain(msg: Incoming) -> bool:
    """Whether a plain ``recv`` takes ``msg`` as it came: a CPU message of
    ``send`` whose tensors are made (anything else goes the general way, which refuses
    or takes it)."""
    payload = msg.payload
    return (payload is P_INLINE or payload is P_READ) and msg.header.kind is not Kind.RAW


class Life(enum.Enum):
    """Where a connection is in its life (``Connection.life``)."""

    PENDING = "pending"  # made; the rendezvous with the peer has not given a transport yet
    ATTACHED = "attached"  # its transport is connected: messages flow
    FAILED = "failed"  # it broke (its error is every later op's)
    CLOSED = "closed"  # closed by this side


class Connection:
    """The two-way message stream with one peer, over a connected transport.

    Created ``PENDING`` by the manager; :meth:`attach` hands it the connected transport
    (after the rendezvous) and starts its receiver thread (``ATTACHED``); :meth:`fail`
    ends it with an error every waiting and later op raises (``FAILED``), :meth:`close`
    closes it (``CLOSED``). :attr:`life` says which.

    Args:
        peer: the peer's address, for messages.
        on_lost: called once when the connection breaks.
    """

    def __init__(self, peer: str, on_lost: Callable[[Connection], None] | None = None):
        self.peer = peer
        self._on_lost = on_lost
        self.life = Life.PENDING
        self._ready = threading.Event()  # set once it leaves PENDING
        self._transport: Transport | None = None
        self._store: dist.Store | None = None
        self._rank = 0
        #: What both ends know alike about the pair (set at the handshake; the GPU fact
        #: at the first CUDA payload).
        self.facts = PairFacts(same_node=False)
        self._cuda: Transport | OneSidedTransport | None = None  # made on first use
        self._peer_pid: int | None = None
        self._cuda_lock = threading.Lock()
        self.reader = Reader(peer, self.fail, self.wait_ready, self._cuda_transport)
        #: A receive op's place in line (see :meth:`.Reader.take_ticket`).
        self.take_ticket = self.reader.take_ticket
        self.sender = Sender(
            peer, self.wait_ready, self.reader, self.fail, self._cuda_transport,
            self.reader.take_in_offers,
        )
        #: Send a message from the calling thread, after any queued async sends (see
        #: :meth:`.Sender.send_inline`).
        self.send_inline = self.sender.send_inline
        #: Send a one-frame message from the calling thread (see :meth:`.Sender.send_small`).
        self.send_small = self.sender.send_small
        self._consumer: concurrent.futures.ThreadPoolExecutor | None = None
        self._consumer_lock = threading.Lock()
        #: Buckets of streamed messages received (the sender counts those it sent).
        self.buckets_received = 0
        self.transport_name = "pending"
        #: Whether the transport's sends wait only on the peer's reading (its ``memory_only``).
        self.memory_only = False
        # Set by the manager: options this side gave on first contact, the group fields
        # both ends agreed on, and whether this side's first op checked them.
        self.requested_options: Any = None
        self.agreed_fields: dict | None = None
        self.checked_first_contact = False

    # -- life cycle -------------------------------------------------------------------------

    def attach(
        self, transport: Transport, store: dist.Store, rank: int, facts: PairFacts | None = None,
        peer_pid: int | None = None,
    ) -> None:
        """Hand the connected ``transport`` over (its rendezvous ``store``, this end's
        ``rank``, the pair's ``facts``, the peer's process id) and start reading."""
        self._transport, self._store, self._rank = transport, store, rank
        self._peer_pid = peer_pid
        if facts is not None:
            self.facts = facts
        self.transport_name = transport.name
        self.memory_only = transport.memory_only
        self.reader.attach(transport)
        self.sender.transport = transport
        start_receiver_thread(self.reader)
        if self.life is Life.PENDING:
            self.life = Life.ATTACHED
        self._ready.set()

    def fail(self, error: CommError) -> None:
        if not self.reader.set_error(error):
            return
        if self.life is not Life.CLOSED:
            self.life = Life.FAILED
        self._ready.set()
        listener = self.reader.listener
        if listener is not None:
            listener.on_error(error)
        if self._on_lost is not None:
            self._on_lost(self)
        ipc = None if self._cuda is None else self._cuda.as_one_sided()
        if ipc is not None:
            # What the peer held of this end's GPU memory is released at once when it is
            # gone (its process cannot release it any more).
            ipc.close(lost=isinstance(error, PeerLostError))

    def peer_gone(self) -> bool:
        """Whether the connection failed, or its transport sees the peer gone now (the
        connection then fails here, as a read would have made it)."""
        if self.reader.error is not None:
            return True
        transport = self._transport
        if transport is None or not transport.peer_gone():
            return False
        self.fail(PeerLostError(f"the peer {self.peer} is gone (its process ended)"))
        return True

    @property
    def attached(self) -> bool:
        return self._transport is not None

    @property
    def error(self) -> CommError | None:
        return self.reader.error

    def wait_ready(self, timeout: float) -> Transport:
        if not self._ready.wait(timeout):
            raise CommTimeoutError(
                f"no connection with {self.peer} after {timeout}s: the peer did not take part "
                "in the rendezvous (is it alive and does it exist?)"
            )
        if self.reader.error is not None:
            raise self.reader.error
        return self._transport  # type: ignore[return-value]

    def close(self) -> None:
        self.life = Life.CLOSED
        self.fail(PeerLostError(f"the connection with {self.peer} was closed"))
        self.sender.close()
        if self._consumer is not None:
            self._consumer.shutdown(wait=False, cancel_futures=True)
        if self._transport is not None:
            self._transport.close()
        cuda = self._cuda
        if cuda is not None and cuda.close_on_teardown:
            cuda.close()

    # -- sending ----------------------------------------------------------------------------

    def submit_send(
        self,
        header: MessageHeader,
        tensors: list[torch.Tensor],
        timeout: float,
        before: Callable[[], None] | None = None,
        order: DeviceOrder | None = None,
    ) -> concurrent.futures.Future:
        """Queue a message on the sender thread (see :meth:`.Sender.submit`)."""
        return self.sender.submit(header, tensors, timeout, before, order)

    def send_message(self, obj: Any, timeout: float) -> None:
        """Encode ``obj`` and send it from the calling thread: the short path of a caller
        that holds the connection already (a listened one), past the manager's lookups."""
        header, tensors = codec.encode(obj)
        self.sender.send_inline(header, tensors, timeout)

    def _cuda_transport(
        self, device: torch.device | None, timeout: float
    ) -> Transport | OneSidedTransport | None:
        """The transport of this connection's CUDA payloads, chosen and made at the first
        one sent or received: both ends swap the UUID of their GPU (``device``'s), which
        completes the pair's facts, and the registry picks from them (CUDA IPC on one
        GPU, else NCCL, which refuses two ranks on one GPU). ``device=None``: the one
        made already, if any (never waits).

        Raises:
            CommTimeoutError: the peer did not reach its first CUDA op within ``timeout``.
        """
        if device is None or self._cuda is not None:
            return self._cuda
        with self._cuda_lock:
            if self._cuda is None:
                store = self._store
                mine = gpus.gpu_uuid(device)
                theirs = gpus.exchange_gpu_uuids(store, self._rank, mine, timeout, self.peer)
                self.facts = dataclasses.replace(self.facts, same_gpu=mine == theirs)
                spec = registry.select(self.facts, registry.CUDA)
                logger.debug(
                    "CUDA payloads with %s go over %s (GPU %s here, %s there)",
                    self.peer, spec.name, mine, theirs,
                )
                self._cuda = spec.factory(TransportSetup(
                    sub_store(store, spec.name), self._rank, timeout, self.peer,
                    peer_pid=self._peer_pid, device=device,
                ))
            return self._cuda

    # -- receive ops ----------------------------------------------------------------------------

    def release_ticket(self, ticket: int) -> None:
        self.reader.release_ticket(ticket)

    def run_async(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        with self._consumer_lock:
            if self._consumer is None:
                self._consumer = concurrent.futures.ThreadPoolExecutor(
                    1, f"rlcomm-consume-{self.peer}"
                )
        return self._consumer.submit(fn)

    def recv_plain(self, deadline: float) -> tuple[int, Any]:
        """A blocking ``recv`` of the next object, as it came, when it may read its own
        message at once (the commonest receive: one transition takes its ticket and the
        stream, and one serves it). Returns the ticket and the object, or ``NOT_PLAIN``
        with the ticket for :meth:`recv_object` (see :meth:`.Reader.receive_own`)."""
        ticket, parts = self.reader.receive_own(deadline, _plain, small=True)
        if parts is None:
            return ticket, NOT_PLAIN
        return ticket, codec.decode(*parts)

    def recv_object(
        self, ticket: int, timeout: float, device: torch.device | None, into: Any = None,
        shards: Shards | None = None, deadline: float | None = None,
    ) -> Any:
        """Serve receive ``ticket``: the next object (see ``Worker.recv``), or, with
        ``into``, its tensors copied into ``into``'s (see :func:`codec.destinations`),
        which is returned (with the piggyback, if any); ``into=Buckets()``: an iterator;
        ``shards``: what is taken of each tensor (:class:`~rlcomm.comm.taking.Taking`).
        ``deadline``: when ``timeout`` ends, where the op began earlier."""
        targets: list[torch.Tensor] | None = None
        # What it takes, when it is not the message as it came (made only then: this is
        # every receive's path).
        taking = None if shards is None and not isinstance(into, Buckets) else self._taking(
            into, shards, timeout)
        receipt: Receipt | None = None
        refused: ProtocolMismatchError | None = None

        def handle(msg: Incoming) -> tuple[bool, Any]:
            nonlocal targets, receipt, refused
            if msg.header.kind == Kind.RAW:
                raise ProtocolMismatchError(
                    f"recv from {self.peer}: the peer sent this message with send_tensor(); "
                    "receive it with recv_tensor() (do not mix send/recv with "
                    "send_tensor/recv_tensor)"
                )
            if msg.header.stream:
                try:
                    receipt = (taking or self._taking(into, shards, timeout)).stream(msg.header)
                except ProtocolMismatchError as exc:
                    refused = exc
                    raise
            elif into is not None and taking is None:
                try:
                    targets = codec.destinations(msg.header, into)
                except CodecError as exc:
                    raise ProtocolMismatchError(
                        f"recv from {self.peer} into the given tensors: {exc} (the message "
                        "stays queued)"
                    ) from exc
            return True, msg

        try:
            msg = self.reader.receive(ticket, timeout, handle, "recv", deadline)
        except ProtocolMismatchError as exc:
            if refused is exc:  # its sender streams the rest, which nothing here takes:
                self.fail(exc)  # closed, the sender sees it at once
                self.close()
            raise
        if receipt is not None:
            return self._receive_stream(msg, receipt, timeout)
        payload = msg.payload
        if taking is not None:
            return taking.whole(
                msg.header, self.reader.payloads.take(msg, None, device, timeout, "recv"))
        if targets is None and (payload is P_INLINE or payload is P_READ):
            tensors = msg.tensors  # the common case, made already: no lookups
        else:
            tensors = self.reader.payloads.take(msg, targets, device, timeout, "recv")
        if into is None:
            return codec.decode(msg.header, tensors)
        if msg.header.piggyback is not None:
            return into, codec.decode(msg.header, tensors)[1]
        return into

    def stream_progress(self) -> int:
        """Buckets of streamed messages this connection sent and received so far (a wait
        for one times out only when this has not changed for its timeout)."""
        return self.sender.buckets_sent + self.buckets_received

    def _taking(self, into: Any, shards: Shards | None, timeout: float) -> Taking:
        return Taking(into, shards, f"recv from {self.peer}", self.peer, timeout, "recv")

    def _receive_stream(self, msg: Incoming, receipt: Receipt, timeout: float) -> Any:
        """Read the buckets of a streamed message (taken by this receive op) as the
        stalled stream's claimant: on this thread, or, for an iterator, on a thread of
        its own (whose iterator is returned at once). A failure of this receive's own
        (a piece that does not fit, an iterator's caller who took nothing in time)
        reads the rest without keeping it, so the stream stays in step."""

        def read(transport: Transport) -> Any:
            failure: BaseException | None = None
            for bucket in plan(msg.header.tensors, msg.header.stream):
                direct = None if failure is not None else receipt.direct(bucket)
                try:
                    views = transport.recv_bucket(bucket.sizes, timeout, direct)
                except CommError as exc:
                    self.fail(exc)
                    raise
                self.buckets_received += 1
                if failure is None:
                    try:
                        if views is None:
                            receipt.landed(bucket)
                        else:
                            receipt.land(bucket, views)
                    except (CodecError, CommError) as exc:
                        failure = exc
                del views
            if failure is not None:
                raise failure
            return receipt.result()

        def produce() -> Any:
            try:
                return self.reader.read_deferred(msg, read, timeout, "recv")
            except BaseException as exc:
                receipt.fail(exc)
                raise

        if receipt.iterator is None:
            return produce()
        threading.Thread(target=_quietly, args=(produce,), daemon=True,
                         name=f"rlcomm-stream-{self.peer}").start()
        return receipt.iterator

    def recv_tensor_into(self, ticket: int, tensor: torch.Tensor, timeout: float) -> None:
        def handle(msg: Incoming) -> tuple[bool, Any]:
            header = msg.header
            if header.kind != Kind.RAW:
                raise ProtocolMismatchError(
                    f"recv_tensor from {self.peer}: the peer sent this message with send(); "
                    "receive it with recv() (do not mix send/recv with send_tensor/recv_tensor)"
                )
            meta = header.tensors[0]
            want = codec.meta_of(tensor)
            if (meta.dtype, tuple(meta.shape)) != (want.dtype, want.shape):
                raise ProtocolMismatchError(
                    f"recv_tensor from {self.peer}: the peer sent a {meta.dtype} tensor of shape "
                    f"{tuple(meta.shape)} but the buffer is {want.dtype} of shape {want.shape}"
                )
            if meta.device != want.device:
                raise ProtocolMismatchError(
                    f"recv_tensor from {self.peer}: the peer sent a {meta.device} tensor into a "
                    f"{want.device} buffer; use buffers on the same kind of device"
                )
            return True, msg

        msg = self.reader.receive(ticket, timeout, handle, "recv_tensor")
        if msg.device or msg.payload is P_IN_STREAM:
            self.reader.payloads.take(msg, [tensor], None, timeout, "recv_tensor")
        else:
            framing.copy_inline_into(tensor, msg.inline)

    # -- listening ----------------------------------------------------------------------------

    def listen(
        self, on_message: Callable[[Any], None], on_error: Callable[[CommError], None]
    ) -> None:
        """Hand every message from now on, decoded, to ``on_message`` on the thread that
        read it (the reader's driver, or a :meth:`pump` caller), in order; receive ops
        are then refused. ``on_error`` is called once when the connection fails."""
        self.reader.listen(Listener(on_message, on_error))

    def pump(
        self, fut: concurrent.futures.Future, timeout: float, hand_back: Callable[[], bool]
    ) -> bool:
        """Read and dispatch messages on this thread until ``fut`` is done (True) or
        ``timeout`` seconds passed (False); see :meth:`.Reader.pump`."""
        return self.reader.pump(fut, timeout, hand_back)


def _quietly(fn: Callable[[], Any]) -> None:
    """Run ``fn`` on a thread whose failure reaches its caller another way."""
    try:
        fn()
    except BaseException:  # noqa: BLE001 - handed to the iterator's caller
        logger.debug("a streamed receive ended with an error", exc_info=True)
