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


@pytest.mark.parametrize("nbytes", [4097, 3 * bulk_copy.PARALLEL_BYTES + 11])
def test_a_copy_between_views_at_odd_offsets_touches_only_its_bytes(nbytes):
    # memmove works on addresses: a view's storage offset must be honoured on both sides.
    base = torch.randint(0, 256, (nbytes + 16,), dtype=torch.uint8)
    out = torch.zeros(nbytes + 16, dtype=torch.uint8)
    bulk_copy.copy(out[5 : 5 + nbytes], base[3 : 3 + nbytes])
    assert torch.equal(out[5 : 5 + nbytes], base[3 : 3 + nbytes])
    assert not out[:5].any() and not out[5 + nbytes :].any()


def test_a_strided_source_is_copied_element_by_element():
    src = torch.arange(2 * 5000, dtype=torch.int64).remainder(256).to(torch.uint8)[::2]
    assert not src.is_contiguous()
    dst = torch.zeros(5000, dtype=torch.uint8)
    bulk_copy.copy(dst, src)
    assert torch.equal(dst, src)


def test_a_size_mismatch_is_refused():
    with pytest.raises(ValueError, match="bulk copy of 10 bytes into a buffer of 9"):
        bulk_copy.copy(torch.zeros(9, dtype=torch.uint8), torch.ones(10, dtype=torch.uint8))
