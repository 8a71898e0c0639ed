"""Large copies into and out of shared memory: written around the caches, and split
across threads.

Measured on the 2-core test machine (``scripts/bench_copy.py``):
- ``torch``'s ``copy_`` and the C library's ``memcpy`` write through the caches: each
  destination line is read before it is written, at about 7 GB/s once the destination
  is not in the cache. ``memcpy`` switches to non-temporal stores only past about
  200 MiB.
- Non-temporal stores (:mod:`~rlcomm.comm.transports._stream_copy`, a small C
  extension) write a line without reading it first: about 12 GB/s on one thread, and
  about 19 GB/s split over two (1 GiB in 0.055 s, against 0.09 s for ``copy_`` split
  over two).
- But a destination that *is* in the cache (a 1 MiB segment reused every few messages)
  takes a cached copy faster: 34 µs against 53 µs.

So :func:`copy` writes around the caches when the copy is large
(:data:`STREAM_BYTES`) or when the caller says the destination is cold (a pool segment
not written for a while), and otherwise leaves the copy to ``torch`` (which splits it
across its own threads where it has them). A copy of at least
:data:`PARALLEL_BYTES` is cut into page-aligned ranges: the calling thread copies the
first and a small process-wide pool the others (both copies release the GIL). Fresh
memory faults in at about 1 GB/s per thread, so splitting helps there too. The
``copy_threads`` setting sets how many threads share one copy.

Where the extension was not built (no C compiler at install), those copies go through
``memmove`` instead (:data:`STREAMS` is False).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import threading

import torch

from rlcomm.settings import get_settings

try:
    from rlcomm.comm.transports._stream_copy import STREAMS
    from rlcomm.comm.transports._stream_copy import copy as _stream
except ImportError:  # not built: memmove all the way
    STREAMS = False
    _stream = ctypes.memmove

#: Copies of at least this many bytes are split.
PARALLEL_BYTES = 8 << 20
#: Copies of at least this many bytes write around the caches, whatever the caller says.
STREAM_BYTES = 8 << 20
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


def copy(dst: torch.Tensor, src: torch.Tensor, cold: bool = False) -> None:
    """``dst.copy_(src)`` for two flat ``uint8`` tensors of one size that do not overlap.

    On the CPU it writes around the caches when the copy is large or ``cold`` (the
    caller knows ``dst`` has not been written for a while), and splits large copies
    across threads.
    """
    n = src.numel()
    if dst.numel() != n:
        raise ValueError(f"bulk copy of {n} bytes into a buffer of {dst.numel()}")
    if (not (cold or n >= STREAM_BYTES)  # small, into cached memory: torch's own copy
            or src.dtype != torch.uint8 or dst.dtype != torch.uint8 or src.is_cuda
            or dst.is_cuda or not (src.is_contiguous() and dst.is_contiguous())):
        dst.copy_(src)
        return
    if n == 0:
        return
    to, frm = dst.data_ptr(), src.data_ptr()
    if THREADS < 2 or n < PARALLEL_BYTES:
        _stream(to, frm, n)
        return
    parts = min(THREADS, n // (PARALLEL_BYTES // 2))
    step = -(-n // parts)
    step += -step % _PAGE
    pool = _helpers()
    futures = [pool.submit(_stream, to + start, frm + start, min(n, start + step) - start)
               for start in range(step, n, step)]
    try:
        _stream(to, frm, step)
    finally:
        for f in futures:
            f.result()
