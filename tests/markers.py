"""Markers shared by test modules."""

from __future__ import annotations

import pytest
import torch

#: For tests that count a cluster's hardware ranks as CPU slots, or expect it to have no
#: GPUs: on a node with GPUs, Ray sees them and hardware ranks are those GPUs.
cpu_only_cluster = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="assumes a cluster without GPUs (its hardware ranks are then CPU slots)",
)
