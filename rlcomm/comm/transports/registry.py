"""The transport registry: which transport carries a pair's messages.

Each transport module describes itself with a :class:`TransportSpec` and calls
:func:`register` when it is imported (importing :mod:`rlcomm.comm.transports` imports the
built-in ones: shm, gloo, nccl, cuda_ipc). Adding a transport is one file that does the
same.

The facts that decide are those of a pair (:class:`PairFacts`): whether both ends are on
one node and, for CUDA payloads, whether they use one physical GPU. The connection
computes them once, at the handshake (the GPU fact at the first CUDA payload, when the
device is known), and both ends compute the same facts, so :func:`select` picks the same
transport at both ends without telling each other.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from rlcomm.comm.transports.base import Transport
from rlcomm.errors import OptionsMismatchError

#: Devices a transport moves payloads of.
CPU, CUDA = "cpu", "cuda"


@dataclass(frozen=True)
class PairFacts:
    """What both ends of a pair know alike about it.

    Args:
        same_node: both ends run on one node (same Ray node id and address).
        same_gpu: both ends' CUDA devices are one physical GPU (``None``: not known yet;
            known once both swapped their GPU's UUID, at the first CUDA payload).
    """

    same_node: bool
    same_gpu: bool | None = None


@dataclass(frozen=True)
class TransportSetup:
    """What a transport's factory gets to make one end of a pair.

    Args:
        store: rendezvous store private to this transport of this pair.
        rank: this end's rank, 0 or 1 (the two ends differ).
        timeout: seconds the set-up may take.
        peer: how error messages name the other end.
        peer_pid: the peer's process id (``None``: not known).
        secret: the job's secret, for transports that authenticate (``None``: none).
        host: this node's address, for transports that bind a socket.
        device: the CUDA device of a CUDA transport's end.
    """

    store: dist.Store
    rank: int
    timeout: float
    peer: str
    peer_pid: int | None = None
    secret: bytes | None = field(default=None, repr=False)
    host: str | None = None
    device: torch.device | None = None


@dataclass(frozen=True)
class TransportSpec:
    """One transport, as the registry knows it.

    Args:
        name: its name (``CollectiveGroupOptions.transport`` names CPU transports by it).
        devices: the devices whose payloads it moves (:data:`CPU`, :data:`CUDA`).
        pollable: whether its ends are :class:`~.base.PollableTransport`.
        accepts: whether it can connect a pair with these facts.
        factory: makes one end (both ends call it, each with its rank).
        preference: among transports that accept a pair, the highest is chosen.
        explicit_only: chosen only when named (a transport for tests, say).
        memory_only: its sends wait only on the peer reading this node's memory (shared
            memory; the transport's own ``memory_only``). Broadcast hands a node's
            members one shared copy when the transport of a same-node pair is.
    """

    name: str
    devices: frozenset[str]
    pollable: bool
    accepts: Callable[[PairFacts], bool]
    factory: Callable[[TransportSetup], Transport]
    preference: int = 0
    explicit_only: bool = False
    memory_only: bool = False


_lock = threading.Lock()
_specs: dict[str, TransportSpec] = {}


def register(spec: TransportSpec) -> TransportSpec:
    """Add ``spec`` to the registry (again under the same name: replaced). Returns it."""
    with _lock:
        _specs[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove the transport named ``name`` (a test's own transport, when done)."""
    with _lock:
        _specs.pop(name, None)


def spec(name: str) -> TransportSpec:
    """The registered transport named ``name``.

    Raises:
        KeyError: none is registered under that name.
    """
    with _lock:
        return _specs[name]


def names(device: str = CPU) -> tuple[str, ...]:
    """The names of the registered transports of ``device``'s payloads."""
    with _lock:
        return tuple(sorted(n for n, s in _specs.items() if device in s.devices))


def select(facts: PairFacts, device: str = CPU, choice: str = "auto") -> TransportSpec:
    """The transport of a pair with ``facts`` for ``device``'s payloads: the one named
    ``choice``, or with ``"auto"`` the most preferred one that accepts the pair.

    Raises:
        OptionsMismatchError: the named transport does not exist, does not move
            ``device`` payloads, or cannot connect this pair; or none can.
    """
    with _lock:
        specs = [s for s in _specs.values() if device in s.devices]
    if choice != "auto":
        named = next((s for s in specs if s.name == choice), None)
        if named is None:
            raise OptionsMismatchError(
                f"no {device} transport named {choice!r} is registered "
                f"(registered: {sorted(s.name for s in specs)})"
            )
        if not named.accepts(facts):
            raise OptionsMismatchError(
                f"transport={choice!r} cannot connect this pair ({facts}): it needs both "
                "ends on one node (and, for shared memory, an x86-64 Linux node)"
            )
        return named
    fitting = [s for s in specs if not s.explicit_only and s.accepts(facts)]
    if not fitting:
        raise OptionsMismatchError(f"no registered {device} transport can connect {facts}")
    return max(fitting, key=lambda s: s.preference)
