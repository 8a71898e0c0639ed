"""The transport contract.

A transport moves plain, contiguous tensors between two ranks (``rank`` 0 and 1) of a
connection, in order. It knows nothing about workers, codecs or channels.

Both operations are two-sided: a ``send`` is matched by the peer's ``recv_into`` of
buffers of the same sizes, in the same order. Messages of one direction are delivered in
the order they were sent. One thread may send while another receives; two threads must
not send (or receive) on one transport at once — the connection above serializes them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch


class Transport(ABC):
    """A two-party, ordered, two-sided tensor transport."""

    #: Short name used in logs and benchmarks ("gloo", "nccl", "shm").
    name: str = "?"

    @abstractmethod
    def send(self, tensors: Sequence[torch.Tensor], timeout: float) -> None:
        """Send ``tensors`` to the peer, in order.

        Blocks until the data left this side's buffers (the tensors may then be reused).

        Raises:
            CommTimeoutError: not done within ``timeout`` seconds.
            PeerLostError: the connection to the peer broke.
        """

    @abstractmethod
    def recv_into(self, tensors: Sequence[torch.Tensor], timeout: float | None) -> None:
        """Fill ``tensors`` in place, in order, from the peer's sends.

        Args:
            timeout: seconds, or ``None`` to wait as long as the peer is alive.

        Raises:
            CommTimeoutError, PeerLostError: as for :meth:`send`.
        """

    def recv_new(self, sizes: Sequence[int], timeout: float | None) -> list[torch.Tensor]:
        """Receive payloads of ``sizes`` bytes into new uint8 tensors.

        Transports that can hand out received memory without a copy (shared memory)
        override this; the default allocates and calls :meth:`recv_into`.
        """
        tensors = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        self.recv_into(tensors, timeout)
        return tensors

    @abstractmethod
    def close(self) -> None:
        """Release the connection's resources; later calls fail."""
