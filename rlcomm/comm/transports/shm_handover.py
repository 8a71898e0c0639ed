"""Handed-over memory: tensors that same-node transports pass on without copying a byte.

:func:`empty` makes a CPU tensor whose memory is a sealed ``memfd`` of its own. When such
a tensor, or a contiguous slice of it, is sent to a process of the same node over shared
memory (``send``, ``send_tensor``, a same-node ``broadcast``), only its file descriptor
travels (SCM_RIGHTS over the connection's signal socket). The receiver maps the same
pages copy-on-write and gets a view of them: no copy on either side, however large the
tensor. The kernel frees the memory when the last mapping goes, the sender's tensor and
every receiver's view alike; a process that dies gives up its mappings with it.

Who may write, and when:

- The sender hands the memory over. After a send it must not write to the tensor, or to
  any view of it, again: a receiver reads the pages as they are at the moment it touches
  them, so a later write by the sender may show through. Make a new tensor with
  :func:`empty` for the next batch instead (or send a copy).
- A receiver's view is private (``MAP_PRIVATE``): what it writes is copied into its own
  memory first, so no other receiver, nor the sender, ever sees it.

A receiver accepts a handed-over fd only when it is a memfd sealed against shrinking and
growing (so no mapping can run past its end, which would crash the reader with
``SIGBUS``), and only from a peer that proved to be the expected process
(:mod:`~rlcomm.comm.transports.shm_signals`).

Tensors on the GPU and tensors from anywhere else (``torch.empty``, a pool) take the
transport's copying path as before; nothing changes for them.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from rlcomm.comm.transports.shm_memory import checked_size, sealed_memfd
from rlcomm.errors import ProtocolMismatchError


class _Block:
    """One memfd of handed-over memory and the address its mapping starts at."""

    __slots__ = ("fd", "size", "base", "__weakref__")

    def __init__(self, fd: int, size: int, base: int):
        self.fd, self.size, self.base = fd, size, base


#: The live blocks of this process by the address their mapping starts at (the
#: ``data_ptr`` of every tensor's untyped storage made by :func:`empty`).
_blocks: dict[int, _Block] = {}
_lock = threading.Lock()


def _forget(block: _Block) -> None:
    """The block's mapping is gone: close its fd and drop it from the table."""
    with _lock:
        if _blocks.get(block.base) is block:
            del _blocks[block.base]
    os.close(block.fd)


def has_blocks() -> bool:
    """Whether this process holds any handed-over memory (else no lookup is needed)."""
    return bool(_blocks)


def empty(
    *size: int | Sequence[int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """A new CPU tensor in memory that same-node sends hand over without a copy.

    Like ``torch.empty``: the contents are undefined until written. The pages are
    faulted in as they are first written, like any fresh memory.

    Args:
        size: the shape, as ints or one sequence of ints.
        dtype: the element type.

    Returns:
        A contiguous tensor. Sending it (or a contiguous slice of it) to a worker of the
        same node passes its memory, not its bytes; see the module's rules on who may
        write after a send.
    """
    shape = tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else size
    if any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in shape):
        raise ValueError(f"rlcomm.empty: a shape is ints >= 0, got {shape!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"rlcomm.empty: dtype must be a torch.dtype, got {dtype!r}")
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    fd = sealed_memfd("rlcomm-handover", nbytes)
    try:
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    except BaseException:
        os.close(fd)
        raise
    flat = torch.frombuffer(mm, dtype=dtype, count=numel)
    block = _Block(fd, nbytes, flat.untyped_storage().data_ptr())
    with _lock:
        _blocks[block.base] = block
    # The storage holds ``mm`` until the last view of it is freed; then the fd goes too.
    weakref.finalize(mm, _forget, block)
    return flat.view(shape)


def empty_like(tensor: torch.Tensor) -> torch.Tensor:
    """:func:`empty` with the shape and dtype of ``tensor``."""
    return empty(tuple(tensor.shape), dtype=tensor.dtype)


def is_handed_over(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s memory was made by :func:`empty` in this process."""
    return find(tensor) is not None


def find(tensor: torch.Tensor) -> tuple[int, int, int] | None:
    """``(fd, offset, nbytes)`` of a contiguous CPU tensor whose memory is a block of
    :func:`empty`, else None. The fd stays owned by the block (do not close it)."""
    if not _blocks or tensor.device.type != "cpu":
        return None
    storage = tensor.untyped_storage()
    block = _blocks.get(storage.data_ptr())
    if block is None or not tensor.is_contiguous():
        return None
    nbytes = tensor.numel() * tensor.element_size()
    offset = tensor.data_ptr() - block.base
    if offset < 0 or offset + nbytes > block.size:
        return None
    return block.fd, offset, nbytes


def map_received(fd: int, offset: int, nbytes: int, what: str) -> torch.Tensor:
    """A private, copy-on-write uint8 view of ``nbytes`` at ``offset`` of a handed-over
    memfd received from a peer. The caller closes ``fd`` afterwards.

    Raises:
        AuthenticationError: the fd is not a sealed memfd.
        ProtocolMismatchError: the range runs past the end of the memfd.
    """
    size = checked_size(fd, what)
    if offset < 0 or nbytes <= 0 or offset + nbytes > size:
        raise ProtocolMismatchError(
            f"{what}: a handed-over block of {size} bytes cannot hold {nbytes} bytes at "
            f"offset {offset}; the connection is closed"
        )
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    mm = mmap.mmap(fd, offset + nbytes - start, flags=mmap.MAP_PRIVATE,
                   prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
    return torch.from_numpy(np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=offset - start))
