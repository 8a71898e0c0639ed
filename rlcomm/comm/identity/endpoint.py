"""A worker's endpoint: where its mailbox listens, and which incarnation of the worker it is.

Every communicating process publishes its endpoint in the registry under its address
(encoded with :func:`encode_endpoint`); a peer, or ``python -m rlcomm status``, reads it
back with :func:`decode_endpoint`. The mailbox itself is :mod:`rlcomm.comm.store.rendezvous`.
"""

from __future__ import annotations

import msgspec


class Endpoint(msgspec.Struct, frozen=True):
    """Where a worker's mailbox listens, and which incarnation of the worker it is."""

    host: str
    port: int
    node_id: str
    incarnation: str
    pid: int


_encode_endpoint = msgspec.msgpack.Encoder().encode
_decode_endpoint = msgspec.msgpack.Decoder(Endpoint).decode


def encode_endpoint(endpoint: Endpoint) -> bytes:
    return _encode_endpoint(endpoint)


def decode_endpoint(data: bytes) -> Endpoint:
    """Raises ``msgspec.DecodeError`` or ``msgspec.ValidationError`` for data that is no
    endpoint."""
    return _decode_endpoint(data)
