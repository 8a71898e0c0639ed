"""Reused receive buffers for transports that receive into fresh memory (Gloo).

Fresh memory is slow: the first write to each page faults, so a new 256 MiB buffer fills
at 1-2 GB/s where a reused one fills at memory speed. :func:`take` hands out a uint8
tensor of ``n`` bytes backed by a pooled buffer; the buffer returns to the pool when the
last tensor viewing it is freed (a finalizer on the NumPy array the tensors are built
on, which every torch view keeps alive). Buffers below :data:`MIN_BYTES` are not pooled.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np
import torch

from rlcomm.settings import get_settings

#: Payloads smaller than this are received into fresh tensors.
MIN_BYTES = 1 << 20
#: Most bytes of free buffers kept per process (``RLCOMM_RECV_POOL_BYTES``).
POOL_BYTES = get_settings().recv_pool_bytes

_lock = threading.Lock()
_free: dict[int, list[np.ndarray]] = {}  # capacity -> free buffers
_free_bytes = 0


def take(n: int) -> torch.Tensor:
    """A uint8 tensor of ``n`` bytes, from the pool when ``n`` is large."""
    if n < MIN_BYTES:
        return torch.empty(n, dtype=torch.uint8)
    capacity = 1 << (n - 1).bit_length()
    global _free_bytes
    with _lock:
        free = _free.get(capacity)
        buf = free.pop() if free else None
        if buf is not None:
            _free_bytes -= capacity
    if buf is None:
        buf = np.empty(capacity, dtype=np.uint8)
    view = buf[:n]
    weakref.finalize(view, _give_back, buf)
    return torch.from_numpy(view)


def _give_back(buf: np.ndarray) -> None:
    global _free_bytes
    with _lock:
        if _free_bytes + buf.nbytes <= POOL_BYTES:
            _free.setdefault(buf.nbytes, []).append(buf)
            _free_bytes += buf.nbytes
