"""The wire of rlcomm's authenticated store (:mod:`rlcomm.comm.store.client`): frames, the
handshake's MACs, request codes and limits, shared by the server and its clients."""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
import time

import msgspec

MAGIC = b"RLCS1"
NONCE = 16
MAC = 32
LEN = struct.Struct("<I")
#: The server's greeting: the magic and its nonce.
HELLO = len(MAGIC) + NONCE
#: The client's proof: the magic, its nonce and its MAC.
PROOF = len(MAGIC) + NONCE + MAC
#: Seconds a client waits for the server's greeting and proof, and a started frame has
#: to arrive whole (the server gives a connection that has not proven itself far less:
#: the ``store_auth_timeout`` setting).
HANDSHAKE_SECONDS = 10.0
#: Largest request or reply frame (keys and values are small: addresses, notes, acks).
MAX_FRAME = 16 << 20

(OP_SET, OP_GET, OP_ADD, OP_WAIT, OP_CHECK, OP_CSET, OP_DELETE, OP_NUM_KEYS, OP_APPEND,
 OP_TAKE, OP_STATUS) = range(11)
encode = msgspec.msgpack.Encoder().encode
decode = msgspec.msgpack.Decoder().decode


def mac(secret: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, label + b"".join(parts), hashlib.sha256).digest()


def recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    """``n`` bytes from ``sock``; by ``deadline`` (monotonic) when given."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{n - len(buf)} bytes still missing at the deadline")
            sock.settimeout(left)
        else:
            sock.settimeout(None)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the other end closed the connection")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket, first_deadline: float | None) -> bytes:
    """One length-prefixed frame: its length by ``first_deadline``, the rest within
    :data:`HANDSHAKE_SECONDS` of the length."""
    (n,) = LEN.unpack(recv_exact(sock, LEN.size, first_deadline))
    if n > MAX_FRAME:
        raise ValueError(f"a {n}-byte frame is over the {MAX_FRAME}-byte limit")
    return recv_exact(sock, n, time.monotonic() + HANDSHAKE_SECONDS)


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(LEN.pack(len(payload)) + payload)
