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

from rlcomm.comm.transports.base import FOREVER, Transport, classify_error


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

    def __init__(
        self, store: dist.Store, rank: int, timeout: float, peer: str, device: torch.device
    ):
        self._peer = peer
        self._device = device
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=timeout)
        try:
            self._pg = dist.ProcessGroupNCCL(store, rank, 2, opts)
        except RuntimeError as exc:
            raise classify_error(exc, "nccl init", peer) from exc
        self._other = 1 - rank

    def _run(self, op, tensors: Sequence[torch.Tensor], timeout, what: str) -> None:
        try:
            with torch.cuda.device(self._device):
                works = [op([t], self._other, 0) for t in tensors]
                for work in works:
                    work.wait(timeout)
                torch.cuda.current_stream().synchronize()
        except RuntimeError as exc:
            raise classify_error(exc, what, self._peer) from exc

    def send(self, tensors: Sequence[torch.Tensor], timeout: float) -> None:
        self._run(self._pg.send, tensors, datetime.timedelta(seconds=timeout), "nccl send")

    def recv_into(self, tensors: Sequence[torch.Tensor], timeout: float | None) -> None:
        wait = FOREVER if timeout is None else datetime.timedelta(seconds=timeout)
        self._run(self._pg.recv, tensors, wait, "nccl recv")

    def close(self) -> None:
        pg, self._pg = self._pg, None
        if pg is not None and hasattr(pg, "shutdown"):
            pg.shutdown()
