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
    """

    __slots__ = ("deferred", "header", "inline", "nbytes", "tensors")

    def __init__(self, header: MessageHeader, inline: bytes):
        self.header = header
        self.inline = inline
        self.tensors: list[torch.Tensor] | None = None
        self.deferred = False
        self.nbytes = len(inline)  # what it holds in memory while unread


def read_message(transport: Transport, peer: str, rest: float | None = None) -> Incoming:
    """Read the next message from ``transport`` (a CPU payload into fresh tensors; a
    ``send_tensor`` or CUDA payload is left in the stream: the message is *deferred*).
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
    if header.inline or not metas:
        if header.inline != total or len(msg.inline) != total:
            raise ProtocolMismatchError(
                f"a message from {peer} declares {total} bytes but carries "
                f"{header.inline} inline; the connection is closed"
            )
        if header.kind != Kind.RAW:
            msg.tensors = framing.split_inline(header, msg.inline)
    elif header.kind != Kind.RAW and not metas[0].device.startswith("cuda"):
        payload = transport.recv_new([n for n in sizes if n], rest)
        msg.tensors = framing.tensors_from_payload(header, payload)
        msg.nbytes += total
    else:
        msg.deferred = True
    return msg
