"""Pooled receive buffers: reused once every view of them is gone, never before."""

from __future__ import annotations

import gc

import torch

from rlcomm.comm.transports import pool


def test_a_buffer_comes_back_only_after_its_last_view_is_freed():
    n = 3 << 20
    first = pool.take(n)
    assert first.numel() == n and first.dtype == torch.uint8
    ptr = first.data_ptr()
    typed = first.view(torch.float32).reshape(3, -1)  # as a received tensor is rebuilt
    del first
    gc.collect()
    second = pool.take(n)
    assert second.data_ptr() != ptr  # `typed` still uses the first buffer
    typed.fill_(1.0)
    assert torch.all(typed == 1.0)
    del typed
    gc.collect()
    third = pool.take(n - 5)  # same capacity class (4 MiB)
    assert third.data_ptr() == ptr
    assert third.numel() == n - 5
    del second, third


def test_small_payloads_are_not_pooled():
    small = pool.take(100)
    assert small.numel() == 100
    assert pool.MIN_BYTES > 100
