"""NCCL transport: a two-rank ``ProcessGroupNCCL`` for CUDA tensors.

The communicator is created on the first op of the pair (NCCL's lazy init), so both
ends must reach their first send/recv; the connection above guarantees that by sending
the message header over its CPU transport first.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist

from rlcomm.comm.transports import registry
from rlcomm.comm.transports.base import Transport, as_timedelta, deadline_of, map_error


class NcclTransport(Transport):
    """Two-rank NCCL connection on ``device``.

    Args:
        store: the rendezvous store (a prefix private to this connection).
        rank: 0 or 1.
        timeout: seconds the communicator's ops may take.
        peer: how error messages name the other end.
        device: the CUDA device this end sends from / receives to.
    """

    name = "nccl"
    close_on_teardown = False  # its shutdown may wait on a dead peer

    def __init__(
        self, store: dist.Store, rank: int, timeout: float, peer: str, device: torch.device
    ):
        self._peer = peer
        self._device = device
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=timeout)
        deadline = deadline_of(timeout)
        try:
            self._pg = dist.ProcessGroupNCCL(store, rank, 2, opts)
        except RuntimeError as exc:
            raise map_error(exc, "nccl init", peer, deadline) from exc
        self._other = 1 - rank

    def _run(self, op, tensors: Sequence[torch.Tensor], timeout: float | None, what: str) -> None:
        deadline = deadline_of(timeout)
        try:
            with torch.cuda.device(self._device):
                works = [op([t], self._other, 0) for t in tensors]
                for work in works:
                    work.wait(as_timedelta(timeout))
                torch.cuda.current_stream().synchronize()
        except RuntimeError as exc:
            raise map_error(exc, what, self._peer, deadline) from exc

    def send(self, tensors: Sequence[torch.Tensor], timeout: float) -> None:
        self._run(self._pg.send, tensors, timeout, "nccl send")

    def recv_into(self, tensors: Sequence[torch.Tensor], timeout: float | None) -> None:
        self._run(self._pg.recv, tensors, timeout, "nccl recv")

    def close(self) -> None:
        pg, self._pg = self._pg, None
        if pg is not None and hasattr(pg, "shutdown"):
            pg.shutdown()


def _nccl(setup: registry.TransportSetup) -> NcclTransport:
    if setup.device is None:
        raise ValueError("the nccl transport needs the CUDA device of its end")
    return NcclTransport(setup.store, setup.rank, setup.timeout, setup.peer, setup.device)


#: NCCL connects CUDA payloads of any pair but two ends on one GPU (it refuses those).
SPEC = registry.register(registry.TransportSpec(
    name=NcclTransport.name, devices=frozenset({registry.CUDA}), pollable=False,
    accepts=lambda facts: not facts.same_gpu, factory=_nccl, preference=0,
))
