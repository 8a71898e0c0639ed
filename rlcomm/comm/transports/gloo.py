"""Gloo transport: a two-rank ``ProcessGroupGloo`` over TCP, built on a given store.

Before it carries anything, each end proves to the other that it holds the job's secret
over the new Gloo pair itself (an HMAC of the other end's random nonce): a process that
got into the rendezvous without the secret is refused before a byte of it is decoded.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from rlcomm.comm.transports import registry
from rlcomm.comm.transports.base import Transport, as_timedelta, deadline_of, map_error
from rlcomm.errors import AuthenticationError, CommError, PeerLostError

_NONCE = 32

logger = logging.getLogger(__name__)

_unbindable_warned: set[str] = set()


def _warn_unbindable(host: str, exc: RuntimeError) -> None:
    if host not in _unbindable_warned:
        _unbindable_warned.add(host)
        logger.warning(
            "Gloo cannot bind to %s, the node IP Ray reports (%s); Gloo picks the address "
            "itself, which peers on other nodes may not reach: start Ray with this node's "
            "address (ray start --node-ip-address) or set GLOO_SOCKET_IFNAME",
            host, str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
        )


def new_gloo_group(
    store: dist.Store, rank: int, size: int, timeout: datetime.timedelta, host: str | None
) -> dist.ProcessGroupGloo:
    """A ``ProcessGroupGloo`` whose sockets bind to ``host``.

    Left alone, Gloo binds to the address this machine's hostname resolves to (often a
    loopback address, or one that only some network namespace of the machine has)
    unless ``GLOO_SOCKET_IFNAME`` names interfaces. rlcomm passes the node IP that Ray
    reports, so peers on other nodes can reach it with no variable set. A
    ``GLOO_SOCKET_IFNAME`` the user sets still wins (torch's own handling). A ``host``
    that is no address of this machine (a node IP behind NAT, say) cannot be bound: then
    Gloo picks, as without rlcomm, and a warning says so.

    Args:
        store: the rendezvous store.
        rank, size: this process's rank and the group's size.
        timeout: the group's timeout (rendezvous and default op timeout).
        host: the address to bind to; ``None`` or ``""`` leaves the choice to Gloo.

    Raises:
        RuntimeError: from torch, when the rendezvous fails (callers classify it).
    """
    if not host or os.environ.get("GLOO_SOCKET_IFNAME"):
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    try:
        device = dist.ProcessGroupGloo.create_device(hostname=host)
    except RuntimeError as exc:
        _warn_unbindable(host, exc)
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [device]
    opts._threads = 2  # what torch picks for one device
    opts._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, size, opts)


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
        host: the local address Gloo binds to (the node IP Ray reports); ``None`` leaves
            the choice to Gloo (see :func:`new_gloo_group`).

    Raises:
        AuthenticationError: the other end did not prove it holds ``secret``.
    """

    name = "gloo"

    def __init__(
        self, store: dist.Store, rank: int, timeout: float, peer: str,
        *, secret: bytes | None = None, host: str | None = None,
    ):
        self._peer = peer
        deadline = deadline_of(timeout)
        try:
            self._pg = new_gloo_group(store, rank, 2, datetime.timedelta(seconds=timeout), host)
        except RuntimeError as exc:
            raise map_error(exc, "gloo rendezvous", peer, deadline) from exc
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
            raise map_error(exc, "gloo handshake", self._peer) from exc
        self._wait(works, timeout, "gloo handshake")

    def _wait(self, works: list, timeout: float | None, what: str) -> None:
        deadline = deadline_of(timeout)
        try:
            for work in works:
                work.wait(as_timedelta(timeout))
        except RuntimeError as exc:
            raise map_error(exc, what, self._peer, deadline) from exc

    def send(self, tensors: Sequence[torch.Tensor], timeout: float) -> None:
        if self.broken:
            raise PeerLostError(f"gloo stream to {self._peer} is out of step after a failed send")
        try:
            works = [self._pg.send([as_flat_bytes(t)], self._other, 0) for t in tensors]
            self._wait(works, timeout, "send")
        except RuntimeError as exc:
            self.broken = True  # Gloo cannot tell how much left: the stream is out of step
            raise map_error(exc, "send", self._peer) from exc
        except CommError:
            self.broken = True
            raise

    def recv_into(self, tensors: Sequence[torch.Tensor], timeout: float | None) -> None:
        try:
            works = [self._pg.recv([as_flat_bytes(t)], self._other, 0) for t in tensors]
        except RuntimeError as exc:
            raise map_error(exc, "recv", self._peer) from exc
        self._wait(works, timeout, "recv")

    def close(self) -> None:
        self._pg = None  # type: ignore[assignment]


def _gloo(setup: registry.TransportSetup) -> GlooTransport:
    return GlooTransport(
        setup.store, setup.rank, setup.timeout, setup.peer, secret=setup.secret, host=setup.host
    )


#: Gloo connects any pair (over TCP); shared memory is preferred where it can.
SPEC = registry.register(registry.TransportSpec(
    name=GlooTransport.name, devices=frozenset({registry.CPU}), pollable=False,
    accepts=lambda facts: True, factory=_gloo, preference=0,
))
