"""Markers shared by test modules."""

from __future__ import annotations

import os

import pytest
import torch

#: For tests that count a cluster's hardware ranks as CPU slots, or expect it to have no
#: GPUs: on a node with GPUs, Ray sees them and hardware ranks are those GPUs.
cpu_only_cluster = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="assumes a cluster without GPUs (its hardware ranks are then CPU slots)",
)


def bench_smoke(what: str) -> pytest.MarkDecorator:
    """For a benchmark's end-to-end run, slow and opt-in (``BENCH_SMOKE=1``): ``what``
    says what it starts."""
    return pytest.mark.skipif(
        os.environ.get("BENCH_SMOKE") != "1",
        reason=f"starts {what} (minutes on 2 cores); run with BENCH_SMOKE=1",
    )
