"""``Selector``: one thread reading many connections over real shared-memory pairs in one
process, and the multi-transport wait under it."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from rlcomm.comm.connection.selector import Selector
from rlcomm.comm.transports.gloo import GlooTransport
from rlcomm.comm.transports.shm import SHM_SUPPORTED, ShmTransport
from rlcomm.comm.transports.shm_memory import SLEEPING
from rlcomm.comm.transports.shm_wait import SPIN_SECONDS, Spin, wait_for_data
from rlcomm.errors import PeerLostError
from tests.comm.pairs import (
    connection_pair,
    receive,
    send,
    send_past_the_ring,
    transport_pair,
    two_stores,
)
from tests.comm.tcp_loopback import TcpLoopbackTransport
from tests.waiting import wait_for

pytestmark = pytest.mark.skipif(not SHM_SUPPORTED, reason="shared memory needs x86-64 Linux")


@pytest.fixture
def stores():
    return two_stores()


@pytest.fixture(params=["shm", "tcp_loopback"])
def pairs(stores, request):
    """Three connected pairs: (served end, peer end), over shared memory or over the
    registry proof's loopback TCP (:mod:`tests.comm.tcp_loopback`)."""
    kind = ShmTransport if request.param == "shm" else TcpLoopbackTransport
    made = [connection_pair(stores, f"p{i}", kind) for i in range(3)]
    yield made
    for a, b in made:
        a.close()
        b.close()


@pytest.fixture
def selector():
    """A selector whose thread is named "test-selector", closed after the test."""
    sel = Selector("test-selector")
    yield sel
    sel.close()


def _asleep(sender) -> bool:
    """Whether the receiving end of ``sender`` (a shared-memory transport, or a
    connection over one) sleeps: its flag in the ring's shared memory says so. Other
    transports have no such flag: True."""
    transport = getattr(sender, "_transport", sender)
    ring = getattr(transport, "_out", None)
    return ring is None or bool(ring.words[SLEEPING // 8])


@pytest.mark.timeout(60)
def test_one_thread_reads_every_listened_connection_in_order(pairs, selector):
    got: dict[int, list[int]] = {i: [] for i in range(3)}
    threads: set[str] = set()

    def on_message(i: int, obj) -> None:
        threads.add(threading.current_thread().name)
        got[i].append(int(obj))

    for i, (a, _) in enumerate(pairs):
        a.listen(lambda obj, i=i: on_message(i, obj), lambda exc: None)
        selector.add(a)
    # A message that comes while a receiver thread still hands its connection over
    # may be read by that thread; from the next one on, the selector reads.
    for _, b in pairs:
        send(b, torch.tensor([-1]))
    wait_for(lambda: all(v == [-1] for v in got.values()), "the state", 10, interval=0.005)
    got = {i: [] for i in range(3)}
    threads.clear()
    for n in range(300):  # interleaved, with pauses in which the selector goes to sleep
        for _, b in pairs:
            send(b, torch.tensor([n]))
        if n % 50 == 0:  # everything so far read, and (on shared memory) asleep
            wait_for(lambda n=n: all(len(v) == n + 1 for v in got.values())
                     and all(_asleep(b) for _, b in pairs), "the burst read, the selector asleep",
                     10, interval=0.005)
    wait_for(lambda: all(len(v) == 300 for v in got.values()), "the state", 10, interval=0.005)
    assert all(v == list(range(300)) for v in got.values())
    assert threads == {"test-selector"}
    assert selector.connections == 3


@pytest.mark.timeout(60)
def test_receive_ops_take_a_selected_connection_and_give_it_back(pairs, selector):
    a, b = pairs[0]
    selector.add(a)
    for i in range(100):  # the receive op asks the selector for the role each time
        send(b, i)
        assert receive(a) == i
    # Nobody receives: the selector reads into the inbox, past the ring's size.
    send_past_the_ring(b, a, torch.ones(1 << 20, dtype=torch.uint8), 12)


@pytest.mark.timeout(60)
def test_a_lost_peer_fails_its_connection_only(pairs, selector):
    errors: list[BaseException] = []
    got: list[str] = []
    for a, _ in pairs:
        a.listen(got.append, errors.append)
        selector.add(a)
    wait_for(lambda: selector.connections == 3, "the state", 10, interval=0.005)
    pairs[1][1].close()  # the peer of connection 1 goes away
    wait_for(lambda: len(errors) == 1, "the state", 10, interval=0.005)
    assert isinstance(errors[0], PeerLostError)
    wait_for(lambda: selector.connections == 2, "the state", 10, interval=0.005)
    send(pairs[0][1], "still here")
    send(pairs[2][1], "me too")
    wait_for(lambda: len(got) == 2, "the state", 10, interval=0.005)
    assert sorted(got) == ["me too", "still here"]


@pytest.mark.timeout(60)
def test_closing_the_selector_hands_connections_back(pairs, selector):
    got: list[int] = []
    a, b = pairs[0]
    a.listen(got.append, lambda exc: None)
    selector.add(a)
    send(b, 1)
    wait_for(lambda: got == [1], "the state", 10, interval=0.005)
    selector.close()
    send(b, 2)  # read by the connection's receiver thread now
    wait_for(lambda: got == [1, 2], "the state", 10, interval=0.005)
    with pytest.raises(RuntimeError, match="closed"):
        selector.add(pairs[1][0])


@pytest.mark.timeout(60)
def test_a_connection_it_cannot_poll_stays_with_its_receiver_thread(stores, selector):
    a, b = connection_pair(stores, "g", GlooTransport)
    got: list[tuple[str, str]] = []
    try:
        a.listen(lambda obj: got.append((obj, threading.current_thread().name)), lambda e: None)
        selector.add(a)
        # let go: Gloo cannot be polled
        wait_for(lambda: selector.connections == 0, "the state", 10, interval=0.005)
        send(b, "over gloo")
        wait_for(lambda: len(got) == 1, "the state", 10, interval=0.005)
        assert got == [("over gloo", "rlcomm-recv-b")]
    finally:
        a.close()
        b.close()


@pytest.mark.skipif(SPIN_SECONDS <= 0, reason="spinning is turned off here")
def test_a_spin_cut_short_is_set_back_by_data_that_came_within_the_longest_spin():
    """A peer that answers after a spin ran out, but within the longest spin of the
    wait's start (a 64 KiB message's turn), is spun for again, not slept on each time;
    one that answers later leaves the spin short."""
    spin = Spin()
    assert not spin.until(lambda: 0, None)  # ran out: halved
    assert spin.seconds == SPIN_SECONDS / 2
    spin.began = time.monotonic() + 1  # the data came at once (the clock read after)
    spin.slept()
    assert spin.seconds == SPIN_SECONDS
    assert not spin.until(lambda: 0, None)
    spin.began = time.monotonic() - 1  # it came a second after the wait began
    spin.slept()
    assert spin.seconds == SPIN_SECONDS / 2


@pytest.mark.timeout(60)
def test_wait_for_data_watches_several_transports(stores):
    pairs = [transport_pair(stores, f"w{i}") for i in range(2)]
    mine = [p[0] for p in pairs]
    spin = Spin()
    r, w = os.pipe()
    try:
        start = time.monotonic()
        assert not wait_for_data(mine, time.monotonic() + 0.05, [r], spin)
        assert time.monotonic() - start >= 0.04  # waited for the deadline

        def later(fn) -> threading.Thread:
            # Once the wait below sleeps (its flag in both rings says so).
            def run() -> None:
                wait_for(lambda: all(_asleep(p[1]) for p in pairs), "the wait sleeps", 10,
                         interval=0.001)
                fn()
            t = threading.Thread(target=run)
            t.start()
            return t

        t = later(lambda: pairs[1][1].send([torch.ones(4, dtype=torch.uint8)], 5))
        assert wait_for_data(mine, time.monotonic() + 5, [r], spin)  # woken by the 2nd
        t.join()
        assert mine[1].available() > 0 and mine[0].available() == 0
        out = torch.empty(4, dtype=torch.uint8)
        mine[1].recv_into([out], 5)

        t = later(lambda: os.write(w, b"x"))
        assert not wait_for_data(mine, time.monotonic() + 5, [r], spin)  # the wake fd
        t.join()

        pairs[0][1].close()  # a lost peer: marked, and the wait ends for it
        assert wait_for_data(mine, time.monotonic() + 5, [], spin)
        assert mine[0].lost and not mine[1].lost
        with pytest.raises(PeerLostError):
            mine[0].recv_frame(1)
    finally:
        os.close(r)
        os.close(w)
        for a, b in pairs:
            a.close()
            b.close()
