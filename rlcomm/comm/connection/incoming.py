"""A received message, and reading one off a transport with the checks that come before
anything is allocated: the declared size against :func:`max_message_bytes`, inline
bytes against the declared sizes (:func:`classify`, which broadcasts use too)."""

from __future__ import annotations

import enum

import torch

from rlcomm.comm import framing
from rlcomm.comm.buckets import header_bucket
from rlcomm.comm.codec import Kind, MessageHeader
from rlcomm.comm.options import default_timeout, max_message_bytes
from rlcomm.comm.transports.base import Transport
from rlcomm.errors import CodecError, ProtocolMismatchError


class Payload(enum.Enum):
    """Where a received message's payload is, decided once, when its header is read."""

    INLINE = "inline"  # none, or in the frame: its tensors are made from the frame
    READ = "read"  # a CPU payload read into new tensors right after the frame
    IN_STREAM = "in_stream"  # it follows in the stream, for the receive op that takes it
    OFFERED = "offered"  # a device payload the sender offers (in the frame)
    TAKEN = "taken"  # an offered payload copied out already, into new tensors

# The members as module constants (an enum member's lookup costs about 60 ns on Python
# 3.11, and every message's path asks where its payload is).
P_INLINE, P_READ, P_IN_STREAM, P_OFFERED, P_TAKEN = (
    Payload.INLINE, Payload.READ, Payload.IN_STREAM, Payload.OFFERED, Payload.TAKEN)
# The one kind every message is asked about (the same reason).
_RAW = Kind.RAW


#: A received message as :func:`.codec.decode` takes it: its header and tensors.
Parts = tuple[MessageHeader, list[torch.Tensor | bytes]]

# Kept headers (:func:`framing.kept`: one object each while the process lives, so that an
# ``id`` names one) of messages that carry their whole CPU payload in the frame and that a
# plain ``recv`` takes as they came, with their payload's bytes: :func:`classify` checked
# them once, and :func:`small_parts` takes their later messages without its checks or an
# :class:`Incoming` (a received 4 B message's cost, ``bench_p2p.py``).
_SMALL: dict[int, int] = {}


class Incoming:
    """A received message, and where its payload is (:class:`Payload`).

    Args:
        header: the message's header.
        inline: the payload bytes that rode in its frame.
        offer: where a one-sided transport lets the receiver read its device payload
            (empty: none); the payload stays with the sender until a receive op, or
            :meth:`~.reader.Reader.take_in_offers`, copies it out.
    """

    __slots__ = ("device", "header", "inline", "nbytes", "offer", "payload", "sizes", "tensors")

    def __init__(self, header: MessageHeader, inline: bytes, offer: bytes = b"",
                 payload: Payload = P_INLINE, device: bool = False):
        self.header = header
        self.inline = inline
        self.offer = offer
        self.payload = payload
        self.device = device  # its payload is CUDA tensors
        self.tensors: list[torch.Tensor] | None = None
        self.nbytes = len(inline) + len(offer)  # what it holds in memory while unread
        self.sizes: list[int] = []  # each tensor's bytes, as :func:`classify` worked them out

    @property
    def deferred(self) -> bool:
        """Whether its payload follows it in the stream (the stream stalls on it)."""
        return self.payload is P_IN_STREAM

    @property
    def on_device(self) -> bool:
        """Whether its payload is CUDA tensors."""
        return self.device

    def offered(self, offer: bytes) -> None:
        """The offer that followed this message in the stream was read."""
        self.offer, self.payload = offer, P_OFFERED

    def taken(self, tensors: list[torch.Tensor]) -> None:
        """Its offered payload was copied into ``tensors``."""
        self.tensors, self.offer, self.payload = tensors, b"", P_TAKEN


def classify(
    header: MessageHeader, inline: bytes, offer: bytes, peer: str, what: str = "a message",
    then: str = "the connection is closed", sizes: list[int] | None = None,
) -> Incoming:
    """A received message's header checked against this worker's limits and its frame,
    before anything is allocated, and where its payload is: the one place a received
    message's kind is decided (connections and broadcasts alike). ``what`` and ``then``
    word the error: what was received, and what follows from refusing it. ``sizes``:
    each tensor's bytes, when the caller has them (:func:`framing.unpack_sized`).

    Raises:
        ProtocolMismatchError: it is larger than this worker accepts, or its frame does
            not match its header.
    """
    metas = header.tensors
    if sizes is None:
        sizes = [m.nbytes for m in metas]
    if header.stream:  # its buckets follow; the receive op checks what it takes of them
        try:
            header_bucket(header)
        except CodecError as exc:
            raise ProtocolMismatchError(f"{what} from {peer}: {exc}; {then}") from exc
        if header.inline or inline or offer or header.kind == _RAW:
            raise ProtocolMismatchError(
                f"{what} from {peer} streams in buckets but carries a payload in its frame; "
                f"{then}")
        msg = Incoming(header, inline, offer, P_IN_STREAM)
        msg.sizes = sizes
        return msg
    total = sum(sizes)
    limit = max_message_bytes()
    if total > limit:
        raise ProtocolMismatchError(
            f"{what} from {peer} declares {total} bytes, over this worker's "
            f"limit of {limit} (RLCOMM_MAX_MESSAGE_BYTES); {then}"
        )
    device = not header.inline and bool(metas) and metas[0].device == "cuda"
    if offer and not device:
        raise ProtocolMismatchError(
            f"{what} from {peer} carries a device offer but no CUDA tensors; {then}"
        )
    if header.inline or not metas:  # the commonest: a small CPU payload in the frame
        if header.inline != total or len(inline) != total:
            raise ProtocolMismatchError(
                f"{what} from {peer} declares {total} bytes but carries "
                f"{header.inline} inline; {then}"
            )
        msg = Incoming(header, inline)
        msg.sizes = sizes
        if header.kind != _RAW:
            msg.tensors = framing.split_inline(header, inline, sizes)
            if framing.kept(header):
                _SMALL[id(header)] = total
        return msg
    msg = Incoming(header, inline, offer, P_INLINE, device)
    msg.sizes = sizes
    if device:
        msg.payload = P_OFFERED if offer else P_IN_STREAM
    elif header.kind != _RAW:
        msg.payload = P_READ
    else:
        msg.payload = P_IN_STREAM
    return msg


def small_parts(frame: bytes) -> Parts | None:
    """The header and tensors (to :func:`codec.decode`) of a received ``frame`` whose
    message a plain ``recv`` takes as it came, with its whole payload in the frame, of a
    header :func:`classify` passed before (checked again: its length, and the limit,
    which may have changed). ``None`` for any other: :func:`read_message` it."""
    header, sizes, inline, offer = framing.unpack_sized(frame)
    total = _SMALL.get(id(header))
    if total is None or offer or len(inline) != total or total > max_message_bytes():
        return None
    return header, framing.split_inline(header, inline, sizes)


def read_message(
    transport: Transport, peer: str, rest: float | None = None, frame: bytes | None = None,
) -> Incoming:
    """Read the next message from ``transport`` (see :func:`classify`; a CPU payload
    that follows its frame is read into new tensors), or the one whose ``frame`` was
    read already. Once the frame has begun, the rest must come within ``rest`` seconds
    (default: the default op timeout).

    Raises:
        ProtocolMismatchError: from :func:`classify` (the connection must be closed).
        CommTimeoutError, PeerLostError: from the transport.
    """
    rest = default_timeout() if rest is None else max(rest, 0.001)
    if frame is None:
        frame = transport.recv_frame(None, rest)
    header, sizes, inline, offer = framing.unpack_sized(frame)
    msg = classify(header, inline, offer, peer, sizes=sizes)
    if msg.payload is P_READ:
        sizes = [n for n in msg.sizes if n]
        payload = transport.recv_new(sizes, rest)
        msg.tensors = framing.tensors_from_payload(msg.header, payload)
        msg.nbytes += sum(sizes)
    return msg
