"""A broadcast over Gloo (and NCCL for CUDA payloads): the path to members on other
nodes, one process group per distinct ordered set of those members, made on first use."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from rlcomm.comm import codec, framing
from rlcomm.comm.codec import MessageHeader
from rlcomm.comm.connection.incoming import Payload, classify
from rlcomm.comm.store.client import sub_store
from rlcomm.comm.transports.base import (
    FOREVER,
    FRAME_BYTES,
    fixed_frames,
    frame_rest,
    map_error,
)
from rlcomm.comm.transports.gloo import new_gloo_group


class GlooBroadcast:
    """A process group of ``size`` ranks; this process is rank ``rank``. Its Gloo sockets
    bind to ``host`` (this node's IP; ``None``: Gloo's own choice, see ``new_gloo_group``).
    Not thread-safe: the owning :class:`~rlcomm.comm.broadcast.group.BroadcastGroup` runs one
    broadcast at a time.

    Args:
        connect_store: makes the authenticated rendezvous store of this group.
        label: how error messages name the group.
    """

    def __init__(
        self, connect_store: Callable[[], dist.Store], rank: int, size: int, label: str,
        host: str | None = None,
    ):
        self.rank, self.size = rank, size
        self._connect_store = connect_store
        self._host = host
        self._label = label
        self._store: dist.Store | None = None
        self._pg: Any = None
        self._nccl: Any = None

    def _connect(self, timeout: float) -> Any:
        """The Gloo group, created on first use (every rank must reach this)."""
        if self._pg is None:
            deadline = time.monotonic() + timeout
            self._store = self._connect_store()
            try:
                self._pg = new_gloo_group(
                    self._store, self.rank, self.size, datetime.timedelta(seconds=timeout),
                    self._host,
                )
            except RuntimeError as exc:
                raise map_error(exc, "broadcast rendezvous", self._label, deadline) from exc
        return self._pg

    def _run(self, pg: Any, tensors: list[torch.Tensor], src: int, timeout: float) -> None:
        # Gloo raises RuntimeError for a timeout and a lost peer alike: the deadline
        # tells them apart (see map_error).
        deadline = time.monotonic() + timeout if timeout else None
        try:
            works = [pg.broadcast(t, src) for t in tensors]
            for work in works:
                work.wait(datetime.timedelta(seconds=timeout) if timeout else FOREVER)
        except RuntimeError as exc:
            raise map_error(exc, "broadcast", self._label, deadline) from exc

    def send(self, frame: bytes, payload: list[torch.Tensor], src: int, timeout: float) -> None:
        """As rank ``src``: send a message's frame, then its payload (uint8 CPU views, or
        CUDA tensors)."""
        self.send_frame(frame, src, timeout)
        self.send_payload(payload, src, timeout)

    def send_frame(self, frame: bytes, src: int, timeout: float) -> None:
        """As rank ``src``: send a frame (any bytes; what follows is the caller's)."""
        self._run(self._connect(timeout), fixed_frames(frame), src, timeout)

    def send_payload(self, payload: list[torch.Tensor], src: int, timeout: float) -> None:
        """As rank ``src``: send a message's payload (after its frame)."""
        pg = self._connect(timeout)
        if payload and payload[0].is_cuda:
            self._broadcast_cuda(payload, src, timeout)
        else:
            self._run(pg, payload, src, timeout)

    def recv(self, src: int, timeout: float) -> tuple[MessageHeader, list[Any]]:
        """As any other rank: the header and tensors of the message ``src`` sends."""
        header, inline, _ = framing.unpack(self.recv_frame(src, timeout))
        return header, self.recv_payload(header, inline, src, timeout)

    def recv_frame(self, src: int, timeout: float) -> bytes:
        """As any other rank: the frame ``src`` sends with :meth:`send_frame`."""
        pg = self._connect(timeout)
        first = torch.empty(FRAME_BYTES, dtype=torch.uint8)
        self._run(pg, [first], src, timeout)
        frame, rest = frame_rest(first)
        if rest:
            more = torch.empty(rest, dtype=torch.uint8)
            self._run(pg, [more], src, timeout)
            frame += more.numpy().tobytes()
        return frame

    def recv_payload(
        self, header: MessageHeader, inline: bytes, src: int, timeout: float
    ) -> list[Any]:
        """As any other rank: the tensors of the message whose frame held ``header``
        and ``inline`` (checked against ``RLCOMM_MAX_MESSAGE_BYTES`` before any is made).

        Raises:
            ProtocolMismatchError: from :func:`~.connection.incoming.classify` (over this
                process's size limit, or a frame that does not match its header).
        """
        incoming = classify(header, inline, b"", f"rank {src} of {self._label}", "a broadcast",
                            then="nothing of its payload was read")
        if incoming.payload is Payload.INLINE:
            return incoming.tensors or framing.split_inline(header, inline)
        metas = header.tensors
        pg = self._connect(timeout)
        if incoming.on_device:
            device = torch.device("cuda", torch.cuda.current_device())
            tensors = [codec.empty_like_meta(m, device) for m in metas]
            self._broadcast_cuda(tensors, src, timeout)
            return tensors
        tensors = [codec.empty_like_meta(m, torch.device("cpu")) for m in metas]
        self._run(pg, [codec.as_bytes(t) for t in tensors if t.numel()], src, timeout)
        return tensors

    def _broadcast_cuda(self, tensors: list[torch.Tensor], src: int, timeout: float) -> None:
        device = tensors[0].device
        with torch.cuda.device(device):
            if self._nccl is None:
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = datetime.timedelta(seconds=timeout)
                self._nccl = dist.ProcessGroupNCCL(
                    sub_store(self._store, "nccl"), self.rank, self.size, opts
                )
            self._run(self._nccl, tensors, src, timeout)
            torch.cuda.current_stream().synchronize()
