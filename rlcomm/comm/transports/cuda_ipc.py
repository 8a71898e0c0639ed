"""CUDA IPC transport: CUDA payloads between two processes that share one GPU.

NCCL refuses two ranks on one GPU, which is what Ray actors with fractional ``num_gpus``
are. Between two processes of one node on one physical GPU, the connection moves its
CUDA payloads through CUDA IPC instead, and its frames over shared memory as usual.

One direction of the protocol, over the connection's rendezvous store (its keys named
after the sending rank and a per-message sequence number):

1. the sender copies the payload into its *staging buffer* (one per transport, kept and
   reused, grown when too small), records an interprocess CUDA event after the copies
   and sets ``<rank>/offer/<seq>`` to an :class:`Offer`: the staging memory's IPC handle,
   the event's handle, the GPU's UUID, and each tensor's offset and size;
2. the receiver waits for that key, opens the staging memory (once per staging buffer:
   opening is slow), makes its stream wait on the event, copies into its tensors,
   synchronizes and sets ``<rank>/ack/<seq>`` (empty, or why it refused the payload);
3. the sender's ``send`` returns once the ack is there: the staging buffer is free again.

GPUs are named by UUID, never by index: ``CUDA_VISIBLE_DEVICES`` differs between Ray
actors, so one GPU may be ``cuda:0`` here and ``cuda:1`` there. Which CUDA transport a
connection uses is decided once, at its first CUDA payload: both ends swap their GPU's
UUID (:func:`~rlcomm.comm.transports.gpus.exchange_gpu_uuids`) and the transport registry
picks CUDA IPC when they are equal (one GPU, so one node), else NCCL. Memory is shared with
torch's own machinery (``UntypedStorage._share_cuda_`` / ``_new_shared_cuda``, as
``torch.multiprocessing`` does), so the sender's staging memory outlives a staging
buffer it drops until the receiver has closed it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from rlcomm.comm.transports import registry
from rlcomm.comm.transports.base import Transport, map_error
from rlcomm.comm.transports.cuda_ipc_board import Offer, OfferBoard, byte_views, payload_layout
from rlcomm.comm.transports.gpus import gpu_uuid, local_gpus
from rlcomm.errors import CommError, CommTimeoutError, PeerLostError, ProtocolMismatchError

#: Staging buffers are sized in multiples of this many bytes.
_STAGING_GRANULE = 2 << 20
#: Opened event handles a receiver keeps (one per sending device, in practice).
_MAX_EVENTS = 8


# -- the transport ---------------------------------------------------------------------------


class CudaIpcTransport(Transport):
    """CUDA payloads to a process of this node on the same physical GPU, through CUDA IPC
    (see the module docstring for the protocol).

    Args:
        store: the rendezvous store (a prefix private to this connection); the
            transport makes two clients of its own with ``store.clone()``.
        rank: 0 or 1.
        peer: how error messages name the other end.
    """

    name = "cuda_ipc"

    def __init__(self, store: dist.Store, rank: int, peer: str):
        if rank not in (0, 1):
            raise ValueError(f"cuda_ipc: rank must be 0 or 1, got {rank}")
        self._peer = peer
        try:
            self._outgoing = OfferBoard(store.clone(), rank, peer)
            self._incoming = OfferBoard(store.clone(), 1 - rank, peer)
        except RuntimeError as exc:
            raise map_error(exc, "cuda_ipc set-up", peer) from exc
        self._failed: CommError | None = None  # a send or receive that broke the protocol
        self._closed = False
        # Sending side (the sending thread only).
        self._sent = 0
        self._staging: torch.Tensor | None = None
        self._share: tuple | None = None  # _share_cuda_() of the staging buffer
        self._events: dict[torch.device, tuple[torch.cuda.Event, bytes]] = {}
        # Receiving side (the receiving thread only).
        self._received = 0
        self._opened: tuple[tuple, torch.Tensor] | None = None  # (key, the peer's staging)
        self._peer_events: dict[bytes, torch.cuda.Event] = {}

    def _check_usable(self, what: str) -> None:
        if self._closed:
            raise PeerLostError(f"{what} with {self._peer}: the connection was closed")
        if self._failed is not None:
            raise PeerLostError(
                f"{what} with {self._peer}: an earlier CUDA IPC transfer failed "
                f"({self._failed}); the connection's CUDA path is out of step"
            )

    # -- sending ------------------------------------------------------------------------------

    def _staging_for(self, device: torch.device, total: int) -> tuple[torch.Tensor, tuple]:
        staging = self._staging
        if staging is None or staging.device != device or staging.numel() < total:
            grown = 2 * staging.numel() if staging is not None and staging.device == device else 0
            size = -(-max(total, grown) // _STAGING_GRANULE) * _STAGING_GRANULE
            self._staging = self._share = None  # the old buffer lives on until the peer closes it
            staging = torch.empty(size, dtype=torch.uint8, device=device)
            self._share = staging.untyped_storage()._share_cuda_()
            self._staging = staging
        return staging, self._share  # type: ignore[return-value]

    def _event_for(self, device: torch.device) -> tuple[torch.cuda.Event, bytes]:
        if device not in self._events:
            with torch.cuda.device(device):
                event = torch.cuda.Event(interprocess=True)
                self._events[device] = (event, event.ipc_handle())
        return self._events[device]

    def send(self, tensors: Sequence[torch.Tensor], timeout: float) -> None:
        self._check_usable("cuda_ipc send")
        views = byte_views(tensors, f"cuda_ipc send to {self._peer}")
        sizes = [v.numel() for v in views]
        if not any(sizes):
            return  # the receiver skips an empty payload alike
        offsets, total = payload_layout(sizes)
        device = views[0].device
        staging, share = self._staging_for(device, total)
        event, event_handle = self._event_for(device)
        with torch.cuda.device(device):
            for view, start, n in zip(views, offsets, sizes, strict=True):
                if n:
                    staging[start : start + n].copy_(view, non_blocking=True)
            event.record(torch.cuda.current_stream())
        _, handle, nbytes, offset, counter, counter_offset, share_event, sync = share
        offer = Offer(
            gpu=gpu_uuid(device), mem_handle=handle, storage_bytes=nbytes, storage_offset=offset,
            ref_counter=counter, ref_counter_offset=counter_offset, share_event=share_event,
            share_event_sync=sync, event=event_handle, offsets=offsets, sizes=sizes,
        )
        seq = self._sent
        self._sent += 1
        try:
            self._outgoing.post(seq, offer)
            self._outgoing.wait_ack(seq, timeout)
        except (CommTimeoutError, PeerLostError) as exc:
            # The receiver may still read the staging buffer: later sends must not touch it.
            self._failed = exc
            raise

    # -- receiving ----------------------------------------------------------------------------

    def _open_memory(self, offer: Offer, index: int) -> torch.Tensor:
        key = (offer.gpu, offer.mem_handle, offer.storage_offset, offer.storage_bytes,
               offer.ref_counter, offer.ref_counter_offset)
        if self._opened is None or self._opened[0] != key:
            # The sender has one staging buffer: an older one is dead there, close it here.
            self._opened = None
            storage = torch.UntypedStorage._new_shared_cuda(
                index, offer.mem_handle, offer.storage_bytes, offer.storage_offset,
                offer.ref_counter, offer.ref_counter_offset, offer.share_event,
                offer.share_event_sync,
            )
            memory = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index))
            self._opened = (key, memory.set_(storage))
        return self._opened[1]

    def _open_event(self, handle: bytes, index: int) -> torch.cuda.Event:
        event = self._peer_events.get(handle)
        if event is None:
            if len(self._peer_events) >= _MAX_EVENTS:
                self._peer_events.clear()
            event = torch.cuda.Event.from_ipc_handle(index, handle)
            self._peer_events[handle] = event
        return event

    def _copy_out(self, offer: Offer, views: list[torch.Tensor], index: int) -> None:
        source = self._open_memory(offer, index)
        event = self._open_event(offer.event, index)
        with torch.cuda.device(index):
            # Copies run on the source GPU's current stream (torch's rule for copies
            # between devices), which first waits for the sender's copies.
            event.wait(torch.cuda.current_stream())
            for view, start, n in zip(views, offer.offsets, offer.sizes, strict=True):
                if n:
                    view.copy_(source[start : start + n], non_blocking=True)
        for device in {index, *(v.device.index for v in views)}:
            torch.cuda.current_stream(device).synchronize()

    def _refusal(self, offer: Offer, sizes: list[int]) -> str:
        if offer.sizes != sizes:
            return (
                f"it holds tensors of {offer.sizes} bytes but the receiver's buffers are "
                f"{sizes} bytes"
            )
        if offer.gpu not in local_gpus():
            return (
                f"it lies on GPU {offer.gpu}, which the receiving process does not see "
                f"(its GPUs: {sorted(local_gpus())}; check CUDA_VISIBLE_DEVICES)"
            )
        return ""

    def recv_into(self, tensors: Sequence[torch.Tensor], timeout: float | None) -> None:
        self._check_usable("cuda_ipc recv")
        views = byte_views(tensors, f"cuda_ipc recv from {self._peer}")
        sizes = [v.numel() for v in views]
        if not any(sizes):
            return  # the sender skipped it alike
        seq = self._received
        try:
            offer = self._incoming.take(seq, timeout)
            self._received += 1
            refusal = self._refusal(offer, sizes)
            failure = None
            if not refusal:
                try:
                    self._copy_out(offer, views, local_gpus()[offer.gpu])
                except RuntimeError as exc:  # opening the memory or the event, or a copy
                    failure = exc
                    refusal = f"the receiver could not read the sender's GPU memory: {exc}"
            self._incoming.ack(seq, refusal)
        except CommError as exc:
            self._failed = exc
            raise
        what = f"cuda_ipc recv of message {seq} from {self._peer}"
        if failure is not None:
            raise CommError(
                f"{what}: reading the sender's GPU memory failed: {failure}"
            ) from failure
        if refusal:
            raise ProtocolMismatchError(f"{what}: the payload was refused: {refusal}")

    def close(self) -> None:
        self._closed = True
        self._staging = self._share = None
        self._events.clear()
        self._opened = None
        self._peer_events.clear()


def _cuda_ipc(setup: registry.TransportSetup) -> CudaIpcTransport:
    return CudaIpcTransport(setup.store, setup.rank, setup.peer)


#: CUDA IPC connects CUDA payloads of two ends on one physical GPU (so one node).
SPEC = registry.register(registry.TransportSpec(
    name=CudaIpcTransport.name, devices=frozenset({registry.CUDA}), pollable=False,
    accepts=lambda facts: bool(facts.same_gpu and facts.same_node), factory=_cuda_ipc,
    preference=1,
))
