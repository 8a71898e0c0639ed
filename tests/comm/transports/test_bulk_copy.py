"""Large copies split across threads (``bulk_copy``): every byte lands where a plain
``copy_`` would put it, for sizes that do and do not split evenly, into fresh shared
memory (a memfd segment, as the shm transport uses) and into ordinary memory."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from rlcomm.comm.transports import bulk_copy
from rlcomm.comm.transports.shm_memory import new_memfd

MIB = 1 << 20


@pytest.mark.parametrize(
    "nbytes",
    [0, 1, bulk_copy.PARALLEL_BYTES - 1, bulk_copy.PARALLEL_BYTES, 3 * bulk_copy.PARALLEL_BYTES + 4097],
)
def test_a_split_copy_equals_a_plain_copy(nbytes):
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.zeros(nbytes + 8, dtype=torch.uint8)
    bulk_copy.copy(dst[:nbytes], src)
    assert torch.equal(dst[:nbytes], src)
    assert not dst[nbytes:].any()  # nothing written past the end


def test_a_split_copy_into_fresh_shared_memory_uses_the_helper_threads():
    nbytes = 4 * bulk_copy.PARALLEL_BYTES + 123
    fd, mm = new_memfd("rlcomm-test-bulk", nbytes, populate=False)
    try:
        seg = torch.frombuffer(mm, dtype=torch.uint8)
        src = torch.arange(nbytes, dtype=torch.int64).remainder(251).to(torch.uint8)
        before = {t.name for t in threading.enumerate()}
        bulk_copy.copy(seg, src)
        assert torch.equal(seg, src)
        if bulk_copy.THREADS > 1:
            helpers = {t.name for t in threading.enumerate()} - before
            assert any(n.startswith("rlcomm-copy") for n in helpers | before)
        del seg
    finally:
        mm.close()
        os.close(fd)
