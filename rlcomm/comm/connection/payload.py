"""Taking a message's payload out of the stream: :class:`Payloads`.

A message the reader hands to a receive op carries its tensors in one of five states
(``Incoming.payload``):

- ``P_INLINE``, ``P_READ``: read with the frame (CPU bytes in the frame, or a CPU or
  shared-memory payload read eagerly): the tensors are there.
- ``P_IN_STREAM``: the payload follows the frame in the stalled stream (a ``send_tensor``
  CPU payload, an NCCL payload, or the offer of the pair's first CUDA message), read by
  the receive op that takes the message.
- ``P_OFFERED``: a CUDA offer in the frame, copied out of the sender's GPU memory by the
  receive op (or earlier: :meth:`Payloads.take_in`).
- ``P_TAKEN``: copied out already; the receive op orders its stream after that copy.

The connection's CUDA transport is the seam: it carries a payload either *offered*
(one-sided, CUDA IPC: its ``as_one_sided()`` is a :class:`~.base.OneSidedTransport`) or
*in the stream* (two-sided, NCCL: its ``as_two_sided()`` is a :class:`~.base.Transport`).
Which one is asked of the transport, typed; nothing here tests its class.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol, TypeVar

import torch

from rlcomm.comm import codec, framing
from rlcomm.comm.connection.incoming import P_IN_STREAM, P_TAKEN, Incoming
from rlcomm.comm.options import default_timeout
from rlcomm.comm.transports.base import OneSidedTransport, Transport
from rlcomm.errors import CommError, ProtocolMismatchError

__all__ = ["CudaTransportOf", "Payloads", "StreamReader"]

T = TypeVar("T")

#: The connection's CUDA transport for a device (made at the first CUDA payload; ``None``
#: as the device: the one made already, if any, never waiting).
CudaTransportOf = Callable[[torch.device | None, float], Transport | OneSidedTransport | None]


class StreamReader(Protocol):
    """What taking a payload needs of the connection's reader."""

    peer: str

    def fail(self, error: CommError) -> None:
        """Fail the connection (a half-read message breaks the stream)."""

    def read_deferred(
        self, msg: Incoming, read: Callable[[Transport], T], timeout: float, what: str
    ) -> T:
        """``read`` what follows ``msg`` in the stalled stream, as its claimant."""


def _fill(targets: list[torch.Tensor] | None, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` copied into ``targets`` (returned then), or ``tensors`` when none."""
    if targets is None or tensors is targets:
        return tensors
    for target, tensor in zip(targets, tensors, strict=True):
        target.copy_(tensor)
    return targets


def _offered(cuda: Transport | OneSidedTransport | None) -> OneSidedTransport | None:
    """``cuda`` when it carries payloads as offers, else ``None``."""
    return None if cuda is None else cuda.as_one_sided()


class Payloads:
    """The payloads of one connection's messages, taken for its receive ops.

    Args:
        reader: the connection's reader (the stalled stream is read as its claimant;
            a failed read fails the connection through it).
        cuda_transport: the connection's CUDA transport (see :data:`CudaTransportOf`).
    """

    def __init__(self, reader: StreamReader, cuda_transport: CudaTransportOf):
        self._reader = reader
        self._cuda_transport = cuda_transport
        self.peer = reader.peer

    # -- a receive op's payload ---------------------------------------------------------------

    def take(
        self, msg: Incoming, targets: list[torch.Tensor] | None, device: torch.device | None,
        timeout: float, what: str,
    ) -> list[torch.Tensor]:
        """The tensors of ``msg``, taken by a receive op: into ``targets`` when given
        (returned then), else as they came or new ones (CUDA: on ``device``, ``None``:
        this thread's current one)."""
        if msg.device:
            return self.device(msg, targets, device, timeout, what)
        if msg.payload is P_IN_STREAM:  # a send_tensor CPU payload: into its place
            direct = targets is not None and all(
                t.is_contiguous() and not t.is_cuda for t in targets)
            buffers = targets if direct else [
                codec.empty_like_meta(m, torch.device("cpu")) for m in msg.header.tensors]
            self._reader.read_deferred(
                msg, lambda t: self.read_into(t, buffers, timeout), timeout, what)
            return _fill(targets, buffers)  # type: ignore[arg-type]
        return _fill(targets, msg.tensors)  # type: ignore[arg-type]

    def read_into(self, transport: Transport, buffers: list[torch.Tensor], timeout: float) -> None:
        """Read a payload that follows its frame into ``buffers`` (as the stream's
        holder); a failure fails the connection."""
        try:
            if buffers and buffers[0].is_cuda:
                cuda = self._cuda_transport(buffers[0].device, timeout)
                streamed = None if cuda is None else cuda.as_two_sided()
                if streamed is None:
                    raise ProtocolMismatchError(
                        f"receiving from {self.peer}: a CUDA payload came in the stream on a "
                        "connection whose CUDA payloads are offered; the ends disagree")
                streamed.recv_into(buffers, timeout)
            else:
                # The payload follows its frame: it must come within the op's timeout.
                transport.recv_into([codec.as_bytes(b) for b in buffers if b.numel()], timeout)
        except CommError as exc:
            self._reader.fail(exc)
            raise

    def device(
        self, msg: Incoming, targets: list[torch.Tensor] | None, device: torch.device | None,
        timeout: float, what: str, transport: Transport | None = None,
    ) -> list[torch.Tensor]:
        """The CUDA tensors of ``msg``, taken by this receive op: copied out of the
        sender's offer (in the frame, or, for the first CUDA message of the pair, in the
        frame that follows it), or read over NCCL. Into ``targets`` when given (returned
        then), else new tensors on ``device`` (``None``: this thread's current device).
        ``transport``: this thread holds the stream already (a listener's dispatch).

        Raises:
            ProtocolMismatchError: the payload does not fit, or came over the wrong path.
            CommTimeoutError, PeerLostError: from the transports.
        """
        header = msg.header
        if msg.payload is P_TAKEN:  # copied out already: order this stream after it
            ipc = _offered(self._cuda_transport(None, timeout))
            if ipc is not None:
                at = targets[0].device if targets and targets[0].is_cuda else (
                    msg.tensors[0].device if msg.tensors else device)
                ipc.order_after(ipc.current_order(at))
            return _fill(targets, msg.tensors)  # type: ignore[arg-type]
        if targets and targets[0].is_cuda:
            device = targets[0].device
        direct = targets is not None and all(t.is_cuda and t.is_contiguous() for t in targets)
        cuda = self._cuda_transport(None, timeout) or self._cuda_transport(
            device or torch.device("cuda", torch.cuda.current_device()), timeout)
        ipc = _offered(cuda)
        offer = msg.offer
        if msg.payload is P_IN_STREAM:  # the payload (NCCL) or its offer follows
            if ipc is None:
                device = device or torch.device("cuda", torch.cuda.current_device())
                buffers: list[torch.Tensor] = targets if direct else [  # type: ignore[assignment]
                    codec.empty_like_meta(m, device) for m in header.tensors]

                def read_stream(t: Transport) -> None:
                    self.read_into(t, buffers, timeout)

                self._in_stream(msg, read_stream, timeout, what, transport)
                return _fill(targets, buffers)
            offer = self._in_stream(msg, lambda t: self._read_offer(t, timeout), timeout, what,
                                    transport)
        if ipc is None:
            raise ProtocolMismatchError(
                f"{what} from {self.peer}: a CUDA offer came on a connection whose CUDA "
                f"payloads go over {cuda.name if cuda is not None else 'nothing'}; the ends "
                "disagree"
            )
        sizes = [m.nbytes for m in header.tensors]
        buffers = ipc.accept(offer, sizes, targets if direct else None, device,
                             ipc.current_order(device), time.monotonic() + timeout)
        if direct:
            return targets  # type: ignore[return-value]
        device = buffers[0].device if buffers else device
        return _fill(targets, framing.tensors_from_payload(header, buffers, device))

    def _in_stream(
        self, msg: Incoming, read: Callable[[Transport], T], timeout: float, what: str,
        transport: Transport | None,
    ) -> T:
        """``read`` what follows ``msg``: on ``transport`` when this thread holds the
        stream, else as the stalled stream's claimant."""
        if transport is not None:
            return read(transport)
        return self._reader.read_deferred(msg, read, timeout, what)

    def _read_offer(self, transport: Transport, timeout: float) -> bytes:
        """Read the offer that follows a deferred device message (the holder)."""
        try:
            return transport.recv_frame(timeout)
        except CommError as exc:
            self._reader.fail(exc)
            raise

    def listened(self, msg: Incoming, transport: Transport) -> None:
        """Read a listened message's payload now (this thread holds the stream): on the
        CPU, or this thread's CUDA device."""
        if msg.device:
            msg.tensors = self.device(
                msg, None, None, default_timeout(), "listen", transport=transport)
        elif msg.payload is P_IN_STREAM:
            msg.tensors = [codec.empty_like_meta(m) for m in msg.header.tensors]
            self.read_into(transport, msg.tensors, default_timeout())

    # -- offers copied out before any receive op asks -----------------------------------------

    def offers_by_ipc(self) -> OneSidedTransport | None:
        """The connection's CUDA transport if it carries offers (made already), else
        ``None``."""
        return _offered(self._cuda_transport(None, 0.0))

    def take_in_at_once(self, msg: Incoming) -> None:
        """Copy ``msg``'s offered payload out now if its sender needs the memory back
        soon (a staged payload), before any receive op asks: the message is then taken;
        else it stays offered."""
        ipc = self.offers_by_ipc()
        if ipc is not None and ipc.copies_at_once(msg.offer):
            tensors = self.take_in(msg, ipc)
            msg.taken(tensors)
            msg.nbytes += sum(t.numel() * t.element_size() for t in tensors)

    def take_in(self, msg: Incoming, ipc: OneSidedTransport) -> list[torch.Tensor]:
        """Copy ``msg``'s offered payload into new tensors (on the GPU it lies on), which
        are returned; its receive op orders its stream after the copy."""
        header = msg.header
        buffers = ipc.accept(msg.offer, [m.nbytes for m in header.tensors], None, None, None)
        device = buffers[0].device if buffers else None
        return framing.tensors_from_payload(header, buffers, device)
