"""Which address a Gloo connection binds to: the host rlcomm passes (the node IP Ray
reports), unless the user set ``GLOO_SOCKET_IFNAME``. Two ranks on threads of this
process, no Ray. The two-node proof is ``tests/test_netns.py``."""

from __future__ import annotations

import concurrent.futures
import logging

import pytest
import torch
import torch.distributed as dist

from rlcomm.comm.transports import gloo
from rlcomm.comm.transports.gloo import GlooTransport

NOT_HERE = "198.18.0.254"  # an address no interface of this machine's namespace holds


def _pair(host: str) -> list[GlooTransport]:
    store = dist.HashStore()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(GlooTransport, store, r, 30, f"rank {1 - r}", host=host) for r in (0, 1)]
        return [f.result(timeout=60) for f in futs]


def _exchange(pair: list[GlooTransport]) -> torch.Tensor:
    out = torch.empty(4)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        recv = pool.submit(pair[1].recv_into, [out], 30)
        pair[0].send([torch.arange(4.0)], 30)
        recv.result(timeout=60)
    return out


@pytest.fixture
def no_ifname(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)


def test_binds_to_the_given_host(no_ifname):
    pair = _pair("127.0.0.1")
    try:
        assert _exchange(pair).tolist() == [0.0, 1.0, 2.0, 3.0]
    finally:
        for t in pair:
            t.close()


def test_a_host_this_machine_lacks_falls_back_to_gloos_choice(no_ifname, caplog, monkeypatch):
    """As without rlcomm (two ranks of one process reach each other wherever Gloo binds),
    with a warning naming the address (once per address and process)."""
    monkeypatch.setattr(gloo, "_unbindable_warned", set())
    with caplog.at_level(logging.WARNING, logger="rlcomm.comm.transports.gloo"):
        pair = _pair(NOT_HERE)
    try:
        assert _exchange(pair).tolist() == [0.0, 1.0, 2.0, 3.0]
    finally:
        for t in pair:
            t.close()
    assert f"Gloo cannot bind to {NOT_HERE}" in caplog.text
    assert "GLOO_SOCKET_IFNAME" in caplog.text


def test_gloo_socket_ifname_wins_over_the_host(monkeypatch):
    """With the variable set, the host is not used: the same unbindable host works."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    pair = _pair(NOT_HERE)
    try:
        assert _exchange(pair).tolist() == [0.0, 1.0, 2.0, 3.0]
    finally:
        for t in pair:
            t.close()
