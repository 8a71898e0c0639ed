"""Large copies into and out of shared memory: written around the caches, and split
across threads.

Why two kinds of copy:
- ``torch``'s ``copy_`` and the C library's ``memcpy`` write through the caches: each
  destination line is read before it is written. Once the destination has left the
  cache, that read costs as much memory traffic as the write. (``memcpy`` itself turns
  to non-temporal stores only for copies of a few hundred MiB.)
- Non-temporal stores (:mod:`~rlcomm.comm.transports._stream_copy`, a small C
  extension) write a line without reading it first, and two threads of them keep the
  memory bus busier than one.
- But the written data then is not in the cache either. A receiver that copies a small
  payload out at once reads it from memory instead of the cache, and a small cached copy
  fits the caches anyway, so below a few MiB the sender gains little and the receiver
  loses more.

So :func:`copy` writes around the caches when the copy is at least
:data:`PARALLEL_BYTES`, and leaves smaller ones to ``torch`` (which splits them across its
own threads where it has them). A large copy is cut into page-aligned ranges: the
calling thread copies the first and a small process-wide pool the others (the copy
releases the GIL). Fresh memory faults in page by page on the thread that first writes
it, so splitting helps there too. The ``copy_threads`` setting sets how many threads
share one copy. ``scripts/bench_copy.py`` measures the ways side by side; the figures of
a run, and what else was tried, are in ``docs/performance.md``.

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

#: Copies of at least this many bytes write around the caches, split across threads.
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


def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for two flat ``uint8`` tensors of one size that do not overlap;
    on the CPU, a large one written around the caches and split across threads."""
    n = src.numel()
    if dst.numel() != n:
        raise ValueError(f"bulk copy of {n} bytes into a buffer of {dst.numel()}")
    if (n < PARALLEL_BYTES  # small: torch's own copy
            or src.dtype != torch.uint8 or dst.dtype != torch.uint8 or src.is_cuda
            or dst.is_cuda or not (src.is_contiguous() and dst.is_contiguous())):
        dst.copy_(src)
        return
    to, frm = dst.data_ptr(), src.data_ptr()
    if THREADS < 2:
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
