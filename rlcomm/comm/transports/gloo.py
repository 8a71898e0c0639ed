"""Gloo transport: a two-rank ``ProcessGroupGloo`` over TCP, built on a given store.

Before it carries anything, each end proves to the other that it holds the job's secret
over the new Gloo pair itself (an HMAC of the other end's random nonce): a process that
got into the rendezvous without the secret is refused before a byte of it is decoded.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from rlcomm.comm.transports.base import Transport
from rlcomm.errors import AuthenticationError, CommError, CommTimeoutError, PeerLostError

_NONCE = 32

#: How long a receive may wait for a live peer that sends nothing (a week: "forever").
FOREVER = datetime.timedelta(days=7)


def classify_error(exc: BaseException, what: str, peer: str) -> CommError:
    """Turn a torch.distributed error into rlcomm's timeout / lost-peer errors."""
    text = str(exc)
    if "Timed out" in text or "timed out" in text or "timeout" in text.lower():
        return CommTimeoutError(f"{what} with {peer} timed out: {text.splitlines()[0]}")
    return PeerLostError(
        f"{what} with {peer} failed, the peer process is gone or its connection broke: "
        f"{text.splitlines()[0] if text else type(exc).__name__}"
    )


def as_flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's memory (any dtype, 0-d included)."""
    return t.reshape(-1).view(torch.uint8)


class GlooTransport(Transport):
    """Two-rank Gloo connection. Tensors of any dtype travel as bytes.

    Args:
        store: the rendezvous store (a prefix of it private to this connection).
        rank: 0 or 1.
        timeout: seconds the rendezvous may take.
        peer: how error messages name the other end.
        secret: the job's secret, proven by both ends before use (``None``: no proof,
            for transports between two ends of one test process).

    Raises:
        AuthenticationError: the other end did not prove it holds ``secret``.
    """

    name = "gloo"

    def __init__(
        self, store: dist.Store, rank: int, timeout: float, peer: str,
        secret: bytes | None = None,
    ):
        self._peer = peer
        try:
            self._pg = dist.ProcessGroupGloo(
                store, rank, 2, datetime.timedelta(seconds=timeout)
            )
        except RuntimeError as exc:
            raise classify_error(exc, "gloo rendezvous", peer) from exc
        self._other = 1 - rank
        if secret is not None:
            self._prove(secret, rank, timeout)

    def _prove(self, secret: bytes, rank: int, timeout: float) -> None:
        """Swap nonces, then MACs of them: each end shows it holds ``secret``."""
        mine = torch.frombuffer(bytearray(os.urandom(_NONCE)), dtype=torch.uint8)
        theirs = torch.empty(_NONCE, dtype=torch.uint8)
        self._exchange(mine, theirs, timeout)
        tag = hmac.new(secret, b"gloo" + bytes([rank]) + theirs.numpy().tobytes(), hashlib.sha256)
        proof = torch.frombuffer(bytearray(tag.digest()), dtype=torch.uint8)
        got = torch.empty(len(tag.digest()), dtype=torch.uint8)
        self._exchange(proof, got, timeout)
        want = hmac.new(
            secret, b"gloo" + bytes([self._other]) + mine.numpy().tobytes(), hashlib.sha256
        ).digest()
        if not hmac.compare_digest(got.numpy().tobytes(), want):
            self._pg = None  # type: ignore[assignment]
            raise AuthenticationError(
                f"gloo connection with {self._peer}: the other end did not prove it "
                "belongs to this job; refused"
            )

    def _exchange(self, out: torch.Tensor, into: torch.Tensor, timeout: float) -> None:
        try:
            works = [self._pg.send([out], self._other, 1), self._pg.recv([into], self._other, 1)]
        except RuntimeError as exc:
            raise classify_error(exc, "gloo handshake", self._peer) from exc
        self._wait(works, datetime.timedelta(seconds=timeout), "gloo handshake")

    def _wait(self, works: list, timeout: datetime.timedelta, what: str) -> None:
        try:
            for work in works:
                work.wait(timeout)
        except RuntimeError as exc:
            raise classify_error(exc, what, self._peer) from exc

    def send(self, tensors: Sequence[torch.Tensor], timeout: float) -> None:
        if self.broken:
            raise PeerLostError(f"gloo stream to {self._peer} is out of step after a failed send")
        try:
            works = [self._pg.send([as_flat_bytes(t)], self._other, 0) for t in tensors]
            self._wait(works, datetime.timedelta(seconds=timeout), "send")
        except RuntimeError as exc:
            self.broken = True  # Gloo cannot tell how much left: the stream is out of step
            raise classify_error(exc, "send", self._peer) from exc
        except CommError:
            self.broken = True
            raise

    def recv_into(self, tensors: Sequence[torch.Tensor], timeout: float | None) -> None:
        try:
            works = [self._pg.recv([as_flat_bytes(t)], self._other, 0) for t in tensors]
        except RuntimeError as exc:
            raise classify_error(exc, "recv", self._peer) from exc
        wait = FOREVER if timeout is None else datetime.timedelta(seconds=timeout)
        self._wait(works, wait, "recv")

    def close(self) -> None:
        self._pg = None  # type: ignore[assignment]
