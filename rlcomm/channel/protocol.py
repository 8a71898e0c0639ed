"""The channel wire protocol: tagged msgspec structs, many requests or replies a message.

A client process and a channel worker exchange messages over the point-to-point layer
(:mod:`rlcomm.comm.endpoint`). A message is a msgspec-encoded *frame*
(:class:`ClientFrame` from a client, :class:`WorkerFrame` from a worker) plus the raw
tensors of the items it carries. Nothing rides Ray's actor-call pickling on the data path,
and nothing in a frame is pickled.

Items travel as opaque :class:`Payload` s: the producer encodes an item once
(:mod:`~rlcomm.channel.payload`), the channel worker stores and forwards the payload (its
bytes and tensors) without decoding it, and the consumer decodes it once. A payload's
tensors are not in the frame: they follow it in the message, in the order of the payloads
that own them (``Payload.tensors`` says how many each owns).

Requests (:data:`Request`) carry a request id ``rid``; every request with ``rid >= 0`` gets
exactly one reply (:data:`Reply`) with that id. :class:`Cancel` and :class:`Requeue` get
none. A :class:`Put` with ``rid`` :data:`NO_REPLY` is a *write-behind* put: its producer
did not wait for it, and it is answered only if it was not enqueued
(:class:`Unaccepted`); a :class:`Sync` tells the producer that everything it sent before
was applied. ``timeout`` is the seconds a blocking request may wait at the channel worker
(``None``: it never parks, or waits without limit).

``ClientFrame.read`` is how many reply messages the client has read from the worker so
far, which tells the worker how much of what it sent is still unread
(:mod:`~rlcomm.channel.replies`).

One encoder and one decoder per frame type are made once per process (module level).
"""

from __future__ import annotations

from enum import IntEnum
from typing import Union

import msgspec

#: A channel key. ``str`` (or ``int``) keys name independent queues of one channel.
Key = Union[str, int]  # noqa: UP007 - msgspec decodes the Union form


class Status(IntEnum):
    """Why a request was not answered with its result."""

    OK = 0
    FULL = 1
    EMPTY = 2
    CLOSED = 3
    TIMEOUT = 4
    CANCELLED = 5
    ERROR = 6


OK, FULL, EMPTY, CLOSED, TIMEOUT, CANCELLED, ERROR = (
    Status.OK, Status.FULL, Status.EMPTY, Status.CLOSED, Status.TIMEOUT, Status.CANCELLED,
    Status.ERROR,
)

#: The request id of requests that get no reply.
NO_REPLY = -1


class Payload(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One item, encoded by its producer (see :mod:`~rlcomm.channel.payload`).

    Attributes:
        header: the msgpack bytes of the item's codec header; empty for an item in the
            codec's ``OBJECT`` form (a plain value) whose pickle is ``data``.
        data: the item's payload bytes when they ride in the frame (a small CPU item).
        tensors: how many of the message's tensors are this item's (0 when ``data``
            holds them).
    """

    header: bytes
    data: bytes = b""
    tensors: int = 0


# -- requests --------------------------------------------------------------------------------


class Put(msgspec.Struct, tag="put", array_like=True, gc=False):
    """Enqueue ``item`` on ``key`` (``nowait``: answer ``FULL`` rather than park)."""

    rid: int
    key: Key
    weight: float
    timeout: float | None
    item: Payload
    nowait: bool = False


class Get(msgspec.Struct, tag="get", array_like=True, gc=False):
    """Take the next item of ``key`` (``nowait``: answer ``EMPTY`` rather than park).

    ``prefetch``: up to this many more items of the key may come in the same
    :class:`Got`, for the client's next gets (see :mod:`~rlcomm.channel.state`)."""

    rid: int
    key: Key
    timeout: float | None
    nowait: bool = False
    prefetch: int = 0


class GetBatch(msgspec.Struct, tag="get_batch", array_like=True, gc=False):
    """Take items from the head of ``key`` until their weights reach ``target``."""

    rid: int
    key: Key
    target: float
    timeout: float | None


class QSize(msgspec.Struct, tag="qsize", array_like=True, gc=False):
    """How many items ``key`` holds (answered :class:`Count`)."""

    rid: int
    key: Key


class Close(msgspec.Struct, tag="close", array_like=True, gc=False):
    """Close the channel (every key)."""

    rid: int


class Route(msgspec.Struct, tag="route", array_like=True, gc=False):
    """Ask the coordinator for the home rank of ``key``, proposing ``proposed`` (-1: only
    look it up). Answered :class:`Count` with the rank (-1: the key has no home)."""

    rid: int
    key: Key
    proposed: int


class Sync(msgspec.Struct, tag="sync", array_like=True, gc=False):
    """Answered :class:`Done` once every request this client sent before it was applied
    (and any :class:`Unaccepted` they caused was sent ahead of that reply)."""

    rid: int


class Cancel(msgspec.Struct, tag="cancel", array_like=True, gc=False):
    """Withdraw parked request ``target`` of this client (no reply; the withdrawn request
    is answered ``CANCELLED`` if it was still parked)."""

    key: Key
    target: int


class Requeue(msgspec.Struct, tag="requeue", array_like=True, gc=False):
    """Put items that reached a request no one waits for back at the head of ``key``
    (no reply)."""

    key: Key
    items: list[Payload]
    weights: list[float]


Request = Union[Put, Get, GetBatch, QSize, Close, Route, Sync, Cancel, Requeue]  # noqa: UP007


def rid_of(request: Request) -> int:
    """The request id of ``request`` (:data:`NO_REPLY` for one that gets no reply)."""
    return getattr(request, "rid", NO_REPLY)


def op_name(request: Request) -> str:
    """``put``, ``put_nowait``, ``get``, ... for messages."""
    tag = type(request).__struct_config__.tag
    return f"{tag}_nowait" if getattr(request, "nowait", False) else tag


# -- replies -----------------------------------------------------------------------------------


class Done(msgspec.Struct, tag="done", array_like=True, gc=False):
    """The request succeeded and has no result (put, close)."""

    rid: int


class Got(msgspec.Struct, tag="got", array_like=True, gc=False):
    """The items a get (one) or a get_batch (many) took, with their weights."""

    rid: int
    items: list[Payload]
    weights: list[float]


class Count(msgspec.Struct, tag="count", array_like=True, gc=False):
    """A number: the size of a key (qsize), a home rank (route)."""

    rid: int
    value: int


class Refused(msgspec.Struct, tag="refused", array_like=True, gc=False):
    """The request failed: ``status`` says why, ``text`` details an ``ERROR``."""

    rid: int
    status: Status
    text: str = ""


class Unaccepted(msgspec.Struct, tag="unaccepted", array_like=True, gc=False):
    """A write-behind put (one with ``rid`` :data:`NO_REPLY`) on ``key`` was not
    enqueued: ``status`` says why (``CLOSED``, or ``ERROR``: see the worker's log)."""

    key: Key
    status: Status


Reply = Union[Done, Got, Count, Refused, Unaccepted]  # noqa: UP007


# -- frames ------------------------------------------------------------------------------------


class ClientFrame(msgspec.Struct, array_like=True, gc=False):
    """What a client sends: requests, and how many reply messages it has read."""

    requests: list[Request]
    read: int = -1


class WorkerFrame(msgspec.Struct, array_like=True, gc=False):
    """What a channel worker sends: replies."""

    replies: list[Reply]


_ENCODER = msgspec.msgpack.Encoder()
_CLIENT_DECODER = msgspec.msgpack.Decoder(ClientFrame)
_WORKER_DECODER = msgspec.msgpack.Decoder(WorkerFrame)


def encode(frame: ClientFrame | WorkerFrame) -> bytes:
    """The msgpack bytes of a frame."""
    return _ENCODER.encode(frame)


def decode_client_frame(data: bytes) -> ClientFrame:
    """Parse a client's frame. Raises ``msgspec.DecodeError`` (a ``ValueError``) if bad."""
    return _CLIENT_DECODER.decode(data)


def decode_worker_frame(data: bytes) -> WorkerFrame:
    """Parse a channel worker's frame. Raises ``msgspec.DecodeError`` if bad."""
    return _WORKER_DECODER.decode(data)


def frame_payloads(frame: ClientFrame | WorkerFrame) -> list[Payload]:
    """The payloads of a frame, in the order they own the message's tensors."""
    out: list[Payload] = []
    for entry in frame.requests if type(frame) is ClientFrame else frame.replies:
        tp = type(entry)
        if tp is Put:
            out.append(entry.item)
        elif tp is Requeue or tp is Got:
            out.extend(entry.items)
    return out
