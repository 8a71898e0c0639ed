"""Fixtures of the compatibility tests."""

from __future__ import annotations

import gc

import pytest


@pytest.fixture(autouse=True)
def _release_pools():
    """A resource pool gives its worker slots back when it is garbage collected: collect
    after each test, so that a pool a test dropped (in a reference cycle, say) does not
    hold slots that later test modules need."""
    yield
    gc.collect()
