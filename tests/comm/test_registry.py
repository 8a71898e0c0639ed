"""The transport registry: the choice from a pair's facts, named choices, registration,
and the error mapping of the transports' base."""

from __future__ import annotations

import dataclasses
import time

import pytest

from rlcomm.comm.options import CollectiveGroupOptions
from rlcomm.comm.transports import registry
from rlcomm.comm.transports.base import deadline_of, map_error
from rlcomm.comm.transports.registry import CPU, CUDA, PairFacts
from rlcomm.comm.transports.shm import SHM_SUPPORTED
from rlcomm.errors import CommTimeoutError, OptionsMismatchError, PeerLostError
from tests.comm import tcp_loopback


def test_every_built_in_transport_registered_itself():
    assert {"gloo", "shm"} <= set(registry.names(CPU))
    assert set(registry.names(CUDA)) == {"cuda_ipc", "nccl"}
    assert registry.spec("shm").pollable and not registry.spec("gloo").pollable


@pytest.mark.skipif(not SHM_SUPPORTED, reason="shared memory needs x86-64 Linux")
def test_the_choice_follows_the_pair_facts():
    assert registry.select(PairFacts(same_node=True)).name == "shm"
    assert registry.select(PairFacts(same_node=False)).name == "gloo"
    assert registry.select(PairFacts(same_node=True), CPU, "gloo").name == "gloo"
    with pytest.raises(OptionsMismatchError, match="cannot connect this pair"):
        registry.select(PairFacts(same_node=False), CPU, "shm")
    with pytest.raises(OptionsMismatchError, match="no cpu transport named 'nccl'"):
        registry.select(PairFacts(same_node=True), CPU, "nccl")


def test_a_test_transport_is_chosen_only_by_name():
    assert registry.spec("tcp_loopback") is tcp_loopback.SPEC
    assert registry.select(PairFacts(same_node=True)).name != "tcp_loopback"
    assert registry.select(PairFacts(same_node=True), CPU, "tcp_loopback") is tcp_loopback.SPEC
    assert CollectiveGroupOptions(transport="tcp_loopback").transport == "tcp_loopback"
    with pytest.raises(ValueError, match="must be one of"):
        CollectiveGroupOptions(transport="carrier-pigeon")


def test_a_registered_transport_joins_and_leaves_the_choice():
    favourite = dataclasses.replace(tcp_loopback.SPEC, name="favourite", explicit_only=False,
                                    preference=100)
    registry.register(favourite)
    try:
        assert registry.select(PairFacts(same_node=True)) is favourite
        assert registry.select(PairFacts(same_node=False)).name == "gloo"  # it needs one node
    finally:
        registry.unregister("favourite")
    assert "favourite" not in registry.names(CPU)


def test_errors_are_mapped_by_type_and_deadline_with_the_peer_attached():
    lost = map_error(ConnectionResetError("reset"), "recv", "g:1", deadline_of(10))
    assert isinstance(lost, PeerLostError) and lost.peer == "g:1"
    assert isinstance(map_error(TimeoutError("t"), "recv", "g:1"), CommTimeoutError)
    # Gloo raises a plain RuntimeError for both: the op's deadline tells them apart.
    early = map_error(RuntimeError("Connection closed by peer"), "recv", "g:1", deadline_of(10))
    assert isinstance(early, PeerLostError)
    late = map_error(RuntimeError("Timed out waiting"), "recv", "g:1", time.monotonic() - 1)
    assert isinstance(late, CommTimeoutError) and late.peer == "g:1" and "g:1" in str(late)
    # No deadline: the op waited for as long as the peer lived, so the peer failed.
    assert isinstance(map_error(RuntimeError("x"), "recv", "g:1", None), PeerLostError)
