"""Large copies into shared memory, split across threads.

One thread copies fresh memory at about 1 GB/s here: each new page faults and the
kernel zeroes it. Several threads fault pages in at once, and warm memory copies at
the sum of their bandwidth. :func:`copy` cuts a copy of at least
:data:`PARALLEL_BYTES` into page-aligned ranges: the calling thread copies the first
and a small process-wide pool the others (``torch``'s ``copy_`` releases the GIL). The
``copy_threads`` setting sets how many threads share one copy.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading

import torch

from rlcomm.settings import get_settings

#: Copies of at least this many bytes are split.
PARALLEL_BYTES = 8 << 20
#: Threads that share one copy, the caller included.
THREADS = get_settings().copy_threads or min(4, os.cpu_count() or 1)
_PAGE = 4096

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _helpers() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = concurrent.futures.ThreadPoolExecutor(THREADS - 1, "rlcomm-copy")
    return _pool


def _copy_range(dst: torch.Tensor, src: torch.Tensor, start: int, end: int) -> None:
    dst[start:end].copy_(src[start:end])


def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for two flat ``uint8`` tensors of one size, split across
    threads when it is large."""
    n = src.numel()
    if THREADS < 2 or n < PARALLEL_BYTES or src.is_cuda or dst.is_cuda:
        dst.copy_(src)
        return
    parts = min(THREADS, n // (PARALLEL_BYTES // 2))
    step = -(-n // parts)
    step += -step % _PAGE
    pool = _helpers()
    futures = [pool.submit(_copy_range, dst, src, start, min(n, start + step))
               for start in range(step, n, step)]
    try:
        dst[:step].copy_(src[:step])
    finally:
        for f in futures:
            f.result()
