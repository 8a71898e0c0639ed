"""The channel wire protocol: request and reply entries, many to one rlcomm message.

A client process and a channel worker exchange messages over the point-to-point layer
(``CommManager.send`` / ``recv``). A message holds a list of small scalar *heads* and a
parallel list of *items*. When an item may hold a tensor, the message is an
:class:`Envelope` dataclass, so the codec walks the items (lists, tuples, dicts,
dataclasses) and sends every tensor inside them as raw memory over the transport; the
heads and the non-tensor parts are pickled. A message whose items are all plain scalars,
``str`` or ``bytes`` or lists of them (acks, get requests, byte items) is the tuple
``(heads, items)``, pickled in one go. Nothing rides Ray's actor-call pickling on the
data path.

Request head: ``(op, rid, key, arg, timeout)``; its item is the item to put (``PUT``),
the items to put back (``REQUEUE``) or ``None``. ``arg`` is the weight of a put, the
target weight of a ``GET_BATCH``, the request id to withdraw for ``CANCEL``, the
weights of a ``REQUEUE`` and the proposed home rank of a ``ROUTE``. ``timeout`` is
the seconds a blocking request may wait at the channel worker.

Reply head: ``(rid, status, weights)``; its item is the result (the item of a get,
the list of a get_batch, a count, a rank). ``weights`` is the weight (or list of
weights) of the items a get returns, so a client can put them back if it no longer
wants them. Every request with ``rid >= 0`` gets exactly one reply; ``rid == -1``
requests (``CANCEL``, ``REQUEUE``) get none.

Every message also carries ``read``: in a client's message, how many reply messages
that client has read from the channel worker so far, which tells the worker how much of
what it sent is still unread (:mod:`~rlcomm.channel.replies`); ``-1`` in replies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Ops (plain ints: they are pickled in every head).
PUT = 0
PUT_NOWAIT = 1
GET = 2
GET_NOWAIT = 3
GET_BATCH = 4
QSIZE = 5
CLOSE = 6
CANCEL = 7
REQUEUE = 8
ROUTE = 9

OP_NAMES = {
    PUT: "put",
    PUT_NOWAIT: "put_nowait",
    GET: "get",
    GET_NOWAIT: "get_nowait",
    GET_BATCH: "get_batch",
    QSIZE: "qsize",
    CLOSE: "close",
    CANCEL: "cancel",
    REQUEUE: "requeue",
    ROUTE: "route",
}
PUT_OPS = (PUT, PUT_NOWAIT)
GET_OPS = (GET, GET_NOWAIT, GET_BATCH)

# Reply statuses.
OK = 0
FULL = 1
EMPTY = 2
CLOSED = 3
TIMEOUT = 4
CANCELLED = 5
ERROR = 6

#: The request id of requests that get no reply.
NO_REPLY = -1

#: A channel key. ``str`` (or ``int``) keys name independent queues of one channel.
Key = str | int


@dataclass
class Envelope:
    """One rlcomm message of the channel protocol: parallel heads and items, and ``read``."""

    heads: list[tuple]
    items: list[Any]
    read: int = -1


# Item types that cannot hold a tensor: a message of only these is sent as a plain tuple,
# which the codec pickles in one go (several times cheaper than walking a dataclass).
_PLAIN = frozenset((type(None), bytes, str, int, float, bool, bytearray))


def pack(heads: list[tuple], items: list[Any], read: int = -1) -> Any:
    """The object to send for a message: an :class:`Envelope` when an item may hold a
    tensor (so the codec extracts it), else the plain ``(heads, items, read)`` tuple."""
    for item in items:
        tp = type(item)
        if tp in _PLAIN:
            continue
        if tp is list and all(type(x) in _PLAIN for x in item):  # a get_batch of plain items
            continue
        return Envelope(heads, items, read)
    return (heads, items, read)


def unpack(message: Any) -> tuple[list[tuple], list[Any], int] | None:
    """``(heads, items, read)`` of a received message, ``None`` if it is not a channel
    message."""
    if type(message) is Envelope:
        return message.heads, message.items, message.read
    if type(message) is tuple and len(message) == 3 and type(message[0]) is list:
        return message
    return None


def op_name(op: int) -> str:
    return OP_NAMES.get(op, f"op {op}")
