"""A received message, and reading one off a transport with the checks that come before
anything is allocated: the declared size against :func:`max_message_bytes`, inline
bytes against the declared sizes."""

from __future__ import annotations

import torch

from rlcomm.comm import framing
from rlcomm.comm.codec import Kind, MessageHeader
from rlcomm.comm.options import default_timeout, max_message_bytes
from rlcomm.comm.transports.base import Transport
from rlcomm.errors import ProtocolMismatchError


class Incoming:
    """A received message; a deferred one still has its payload in the stream.

    Args:
        header: the message's header.
        inline: the payload bytes that rode in its frame.
        offer: where a one-sided transport lets the receiver read its device payload
            (empty: none); the payload stays with the sender until a receive op, or
            :meth:`~.reader.Reader.take_in_offers`, copies it out.
    """

    __slots__ = ("deferred", "header", "inline", "nbytes", "offer", "tensors")

    def __init__(self, header: MessageHeader, inline: bytes, offer: bytes = b""):
        self.header = header
        self.inline = inline
        self.offer = offer
        self.tensors: list[torch.Tensor] | None = None
        self.deferred = False
        self.nbytes = len(inline) + len(offer)  # what it holds in memory while unread

    @property
    def on_device(self) -> bool:
        """Whether its payload is CUDA tensors."""
        metas = self.header.tensors
        return bool(metas) and not self.header.inline and metas[0].device == "cuda"


def read_message(transport: Transport, peer: str, rest: float | None = None) -> Incoming:
    """Read the next message from ``transport`` (a CPU payload into fresh tensors; a
    ``send_tensor`` CPU payload, or a CUDA payload that follows in the stream, is left
    there: the message is *deferred*; a CUDA payload offered in the frame stays offered).
    Once the frame has begun, the rest must come within ``rest`` seconds (default: the
    default op timeout).

    Raises:
        ProtocolMismatchError: the message is larger than this worker accepts, or its
            frame does not match its header (the connection must be closed).
        CommTimeoutError, PeerLostError: from the transport.
    """
    rest = default_timeout() if rest is None else max(rest, 0.001)
    msg = Incoming(*framing.unpack(transport.recv_frame(None, rest)))
    header = msg.header
    metas = header.tensors
    sizes = [m.nbytes for m in metas]
    total = sum(sizes)
    limit = max_message_bytes()
    if total > limit:
        raise ProtocolMismatchError(
            f"a message from {peer} declares {total} bytes, over this worker's "
            f"limit of {limit} (RLCOMM_MAX_MESSAGE_BYTES); the connection is closed"
        )
    if msg.offer and not msg.on_device:
        raise ProtocolMismatchError(
            f"a message from {peer} carries a device offer but no CUDA tensors; the "
            "connection is closed"
        )
    if header.inline or not metas:
        if header.inline != total or len(msg.inline) != total:
            raise ProtocolMismatchError(
                f"a message from {peer} declares {total} bytes but carries "
                f"{header.inline} inline; the connection is closed"
            )
        if header.kind != Kind.RAW:
            msg.tensors = framing.split_inline(header, msg.inline)
    elif msg.on_device:
        msg.deferred = not msg.offer  # two-sided (NCCL): the payload follows in the stream
    elif header.kind != Kind.RAW:
        payload = transport.recv_new([n for n in sizes if n], rest)
        msg.tensors = framing.tensors_from_payload(header, payload)
        msg.nbytes += total
    else:
        msg.deferred = True
    return msg
