"""CUDA IPC's protocol pieces: the :class:`Offer` a sender publishes for one message, where
a payload lies in a staging buffer, and the :class:`OfferBoard` of store keys one
direction uses (see :mod:`~rlcomm.comm.transports.cuda_ipc` for the protocol)."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import torch
import torch.distributed as dist

from rlcomm.comm.transports.base import as_timedelta, deadline_of, map_error
from rlcomm.errors import CommError, CommTimeoutError, ProtocolMismatchError

#: Each tensor of a payload starts at a multiple of this many bytes of the staging buffer.
ALIGN = 256


class Offer(msgspec.Struct, frozen=True):
    """What a sender publishes for one message: where its payload lies.

    ``memory`` is the first seven fields ``UntypedStorage._share_cuda_()`` gives for the
    staging buffer, without the device index (the receiver uses its own index of the GPU
    named ``gpu``): handle, size, offset, ref-counter handle and offset, the sharing
    event's handle and whether it must be waited on.
    """

    gpu: str
    mem_handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_counter: bytes
    ref_counter_offset: int
    share_event: bytes
    share_event_sync: bool
    event: bytes
    offsets: list[int]
    sizes: list[int]


_encode_offer = msgspec.msgpack.Encoder().encode
_decode_offer = msgspec.msgpack.Decoder(Offer).decode


# -- pure helpers ----------------------------------------------------------------------------


def payload_layout(sizes: Sequence[int], align: int = ALIGN) -> tuple[list[int], int]:
    """Where each of ``sizes`` bytes lies in a staging buffer: the offsets (each a
    multiple of ``align``) and the total bytes the buffer needs."""
    offsets, end = [], 0
    for n in sizes:
        if n < 0:
            raise ValueError(f"payload sizes must be >= 0, got {list(sizes)}")
        start = -(-end // align) * align
        offsets.append(start)
        end = start + n
    return offsets, end


def byte_views(tensors: Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
    """Flat uint8 views of contiguous CUDA tensors (writing to a view writes the tensor).

    Raises:
        ValueError: a tensor is not contiguous, or not on a CUDA device.
    """
    views = []
    for i, t in enumerate(tensors):
        if not t.is_contiguous():
            raise ValueError(
                f"{what}: tensor {i} (shape {tuple(t.shape)}, strides {t.stride()}) is not "
                "contiguous; call .contiguous() first"
            )
        if not t.is_cuda:
            raise ValueError(
                f"{what}: tensor {i} is on {t.device}; the cuda_ipc transport moves CUDA "
                "tensors only"
            )
        views.append(t.reshape(-1).view(torch.uint8))
    return views


# -- the store keys of one direction -----------------------------------------------------------


class OfferBoard:
    """The store keys of one direction: the sender's offers, the receiver's acks.

    Each end keeps one board per direction over a store client of its own: a TCPStore
    client serves one call at a time, so a wait for an ack would stall the other
    direction's wait for an offer. Keys are deleted once read: in the same round trip
    as the wait for them on rlcomm's own store (its ``take``), in three elsewhere.

    Args:
        store: a store client used by this board only (keys under its prefix).
        sender: the rank that sends in this direction (names the keys).
        peer: how error messages name the other end.
    """

    def __init__(self, store: dist.Store, sender: int, peer: str):
        self._store = store
        self._sender = sender
        self._peer = peer
        self._take = getattr(store, "take", None)  # rlcomm's store: one round trip

    def _key(self, kind: str, seq: int) -> str:
        return f"{self._sender}/{kind}/{seq}"

    def _wait_and_take(self, key: str, timeout: float | None, what: str) -> bytes:
        deadline = deadline_of(timeout)
        try:
            if self._take is not None:
                return self._take(key, as_timedelta(timeout))
            self._store.wait([key], as_timedelta(timeout))
            data = self._store.get(key)
            self._store.delete_key(key)
        except CommTimeoutError as exc:  # the store's own: say which op timed out
            raise map_error(TimeoutError(str(exc)), what, self._peer) from exc
        except (RuntimeError, CommError) as exc:
            raise map_error(exc, what, self._peer, deadline) from exc
        return data

    def post(self, seq: int, offer: Offer) -> None:
        """Publish the offer of message ``seq`` (the sender)."""
        try:
            self._store.set(self._key("offer", seq), _encode_offer(offer))
        except (RuntimeError, CommError) as exc:
            raise map_error(exc, f"cuda_ipc send of message {seq}", self._peer) from exc

    def take(self, seq: int, timeout: float | None) -> Offer:
        """Wait for the offer of message ``seq`` and take it (the receiver).

        Raises:
            CommTimeoutError: no offer within ``timeout`` seconds (``None``: a week).
            PeerLostError: the store is gone.
        """
        what = f"cuda_ipc recv of message {seq}"
        return _decode_offer(self._wait_and_take(self._key("offer", seq), timeout, what))

    def ack(self, seq: int, refusal: str = "") -> None:
        """Tell the sender message ``seq`` was copied out, or why it was refused."""
        try:
            self._store.set(self._key("ack", seq), refusal.encode())
        except (RuntimeError, CommError) as exc:
            raise map_error(exc, f"cuda_ipc ack of message {seq}", self._peer) from exc

    def wait_ack(self, seq: int, timeout: float) -> None:
        """Wait until the receiver acknowledged message ``seq`` (the sender).

        Raises:
            CommTimeoutError: no ack within ``timeout`` seconds.
            ProtocolMismatchError: the receiver refused the payload.
            PeerLostError: the store is gone.
        """
        what = f"cuda_ipc send of message {seq}"
        refusal = self._wait_and_take(self._key("ack", seq), timeout, what)
        if refusal:
            raise ProtocolMismatchError(
                f"{what} to {self._peer}: the receiver refused the payload: {refusal.decode()}"
            )
