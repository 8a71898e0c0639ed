"""Fixtures of the comm tests."""

from __future__ import annotations

import pytest

from tests.comm.pairs import connection_pair, two_stores


@pytest.fixture
def conns():
    """An attached shared-memory connection pair: (rank 0 end, rank 1 end)."""
    a, b = connection_pair(two_stores(), "c")
    yield a, b
    a.close()
    b.close()
