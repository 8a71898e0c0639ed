"""The broadcast chain (:mod:`rlcomm.comm.broadcast.chain`) without Ray: its pure parts
as tables, and chains of real sockets on loopback, with members in threads and, for the
member that dies or stops, in a process of its own (killed with SIGKILL, stopped with
SIGSTOP in the middle of the stream)."""

from __future__ import annotations

import concurrent.futures
import hashlib
import hmac
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from rlcomm.comm.broadcast import chain as bc
from rlcomm.comm.broadcast.chain import (
    ABORT,
    DATA,
    DONE,
    LOST,
    RECORD,
    REFUSED,
    TIMEOUT,
    WAIT,
    ChainListener,
    ChainRun,
    check_record,
    group_key,
    pack_failures,
    plan_records,
    unpack_failures,
)
from rlcomm.errors import ProtocolMismatchError
from tests.waiting import wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEY = group_key(b"s" * 32, "test group")
RUN = 0x1234_5678_9ABC


# -- pure parts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("sizes, chunk, want", [
    ([10], 4, [[(0, 0, 4)], [(0, 4, 8)], [(0, 8, 10)]]),
    ([8], 4, [[(0, 0, 4)], [(0, 4, 8)]]),
    ([3, 0, 3], 4, [[(0, 0, 3), (2, 0, 1)], [(2, 1, 3)]]),
    ([1, 1, 1], 8, [[(0, 0, 1), (1, 0, 1), (2, 0, 1)]]),
    ([], 4, []),
    ([0], 4, []),
])
def test_records_cut_the_tensors_laid_end_to_end(sizes, chunk, want):
    records = plan_records(sizes, chunk)
    assert records == want
    assert sum(bc.record_bytes(r) for r in records) == sum(sizes)
    assert all(bc.record_bytes(r) == chunk for r in records[:-1])


def test_a_payload_not_a_multiple_of_the_chunk_ends_with_a_short_record():
    sizes = [(3 << 20) + 5, 7, (1 << 20) - 1]
    records = plan_records(sizes, 1 << 20)
    assert [bc.record_bytes(r) for r in records] == [1 << 20] * 4 + [11]


@pytest.mark.parametrize("payload, hops, largest, want", [
    (256 << 20, 4, 1 << 20, 1 << 20),  # plenty of records: the setting's size
    (4 << 20, 4, 1 << 20, 512 << 10),  # two records per link
    (1 << 20, 31, 1 << 20, bc.MIN_RECORD),  # never finer than MIN_RECORD
    (100, 1, 1 << 20, bc.MIN_RECORD),
    (1 << 20, 2, 16 << 10, 16 << 10),  # a setting below MIN_RECORD is kept
])
def test_small_payloads_are_cut_in_two_records_per_link(payload, hops, largest, want):
    assert bc.record_size(payload, hops, largest) == want


def _check(kind, index=0, length=0, reason=0, downstream=True, next_record=0,
           lengths=(16, 16, 5)):
    check_record(kind, reason, index, length, downstream=downstream, members=4,
                 next_record=next_record, lengths=lengths)


@pytest.mark.parametrize("args", [
    dict(kind=DATA, index=1, length=16, next_record=0),  # out of order
    dict(kind=DATA, index=0, length=17),  # not the planned length
    dict(kind=DATA, index=3, length=5, next_record=3),  # past the last record
    dict(kind=DONE, index=1, length=8),  # DONE comes from downstream only
    dict(kind=WAIT, index=4),  # no member 4 in a group of 4
    dict(kind=WAIT, index=1, length=1 << 40),  # WAIT has no body
    dict(kind=ABORT, index=1, reason=9),
    dict(kind=DATA, index=0, length=16, downstream=False),  # DATA goes downstream only
    dict(kind=DONE, index=5, length=40, downstream=False),  # more failures than members
    dict(kind=DONE, index=1, length=1 << 30, downstream=False),  # a body not of its count
    dict(kind=77),
])
def test_records_a_link_cannot_have_meant_are_refused(args):
    with pytest.raises(ProtocolMismatchError):
        _check(**args)


def test_records_a_link_may_carry_pass():
    _check(DATA, 2, 5, next_record=2)
    _check(WAIT, 3)
    _check(ABORT, 1, reason=LOST)
    _check(WAIT, 0, downstream=False)
    _check(DONE, 2, 2 * bc.FAILURE.size, downstream=False)


@pytest.mark.parametrize("count, report_bytes, length, ok", [
    (2, 5, 1 * 8 + 2 * (4 + 5), True),  # a failure and two reports
    (0, 5, 8, True),  # a run that asks for reports, and none came yet
    (2, 0, 8 + 8, False),  # reports in a run that asks for none
    (5, 5, 8 + 5 * 9, False),  # more reports than members
    (2, 5, 8 + 2 * 9 + 1, False),  # a body not of its counts
])
def test_a_done_carries_reports_only_of_the_size_the_run_asks(count, report_bytes, length, ok):
    def check():
        check_record(DONE, 0, 1, length, downstream=False, members=4, next_record=0,
                     lengths=(), count=count, report_bytes=report_bytes)
    if ok:
        check()
    else:
        with pytest.raises(ProtocolMismatchError):
            check()
    with pytest.raises(ProtocolMismatchError):  # only a DONE counts reports
        check_record(WAIT, 0, 1, 0, downstream=False, members=4, next_record=0, lengths=(),
                     count=1, report_bytes=report_bytes or 1)


def test_reports_round_trip_and_are_checked():
    reports = {3: b"ccc", 1: b"aaa"}
    assert bc.unpack_reports(bc.pack_reports(reports), 2, 3, 4) == reports
    with pytest.raises(ProtocolMismatchError):  # no member 7 in a group of 4
        bc.unpack_reports(bc.pack_reports({7: b"xxx"}), 1, 3, 4)
    with pytest.raises(ProtocolMismatchError):  # one member twice
        bc.unpack_reports(bc.pack_reports({1: b"aaa"}) * 2, 2, 3, 4)


def test_failures_round_trip_and_are_checked():
    failures = {2: LOST, 3: TIMEOUT, 1: REFUSED}
    assert unpack_failures(pack_failures(failures), 4) == failures
    with pytest.raises(ProtocolMismatchError):
        unpack_failures(pack_failures({7: LOST}), 4)
    with pytest.raises(ProtocolMismatchError):
        unpack_failures(bc.FAILURE.pack(1, 200), 4)


def test_keys_differ_by_group_and_secret():
    assert group_key(b"a" * 32, "g") != group_key(b"b" * 32, "g")
    assert group_key(b"a" * 32, "g") != group_key(b"a" * 32, "h")


# -- chains on loopback ------------------------------------------------------------------------


class Chain:
    """``n`` members on 127.0.0.1: member 0 the source, member ``i`` downstream of
    ``i - 1``. Each receiver has its own listener; ``run(i)`` runs member ``i``."""

    def __init__(self, n: int, sizes: list[int], chunk: int, timeout: float = 30.0,
                 members: int | None = None):
        self.n, self.sizes, self.chunk, self.timeout = n, sizes, chunk, timeout
        self.members = members or n  # the group's size (members past n: node-mates)
        gen = torch.Generator().manual_seed(n * 1000 + len(sizes))
        self.data = [torch.randint(0, 256, (s,), dtype=torch.uint8, generator=gen) for s in sizes]
        self.got = {i: [torch.zeros(s, dtype=torch.uint8) for s in sizes] for i in range(1, n)}
        self.listeners = {i: ChainListener("127.0.0.1") for i in range(1, n)}
        self.runs: dict[int, ChainRun] = {}
        self.outcomes: dict[int, bc.ChainOutcome] = {}
        self.ended: dict[int, float] = {}
        self.deadline = time.monotonic() + timeout

    def make(self, i: int, **kwargs) -> ChainRun:
        views = [memoryview(t.numpy()) for t in (self.data if i == 0 else self.got[i])]
        down = i + 1 if i + 1 < self.n else None
        run = ChainRun(
            index=i, src=0, upstream=i - 1 if i else None, downstream=down,
            members=self.members, run_id=RUN, key=KEY,
            records=plan_records(self.sizes, self.chunk), views=views,
            listener=self.listeners.get(i),
            downstream_address=(lambda: self.listeners[down].address) if down else None,
            host="127.0.0.1", deadline=self.deadline, slack=0.3, heartbeat=0.1,
            upstream_address=(lambda: self.listeners[i - 1].address) if i > 1 else None,
            **kwargs,
        )
        self.runs[i] = run
        return run

    def run(self, i: int, **kwargs) -> None:
        self.outcomes[i] = self.make(i, **kwargs).run()
        self.ended[i] = time.monotonic()

    def start(self, members, options: dict | None = None) -> list[threading.Thread]:
        """Run ``members`` each on a thread (``options``: extra arguments by member)."""
        options = options or {}
        threads = [threading.Thread(target=self.run, args=(i,), kwargs=options.get(i, {}))
                   for i in members]
        for t in threads:
            t.start()
        return threads

    def holds_all(self, i: int) -> bool:
        return all(torch.equal(a, b) for a, b in zip(self.data, self.got[i]))

    def spawn(self, i: int, stop_after: int, linked: bool = True) -> subprocess.Popen:
        """Member ``i`` in a process of its own, which stops itself once it holds
        ``stop_after`` records (see ``tests/comm/chain_member.py``). The chain's deadline
        starts once that process is ready."""
        listener = self.listeners[i]
        spec = dict(
            fd=listener.sock.fileno(), index=i, src=0, upstream=i - 1,
            downstream=i + 1 if i + 1 < self.n else None, members=self.n, run_id=RUN,
            key=KEY.hex(), sizes=self.sizes, chunk=self.chunk, stop_after=stop_after,
            linked=linked,
            down_address=self.listeners[i + 1].address if i + 1 < self.n else None,
        )
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.comm.chain_member", json.dumps(spec)],
            pass_fds=[listener.sock.fileno()], cwd=ROOT, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True,
        )
        listener.close()  # the child's now: it goes with the child's process
        assert proc.stdout.readline().strip() == "READY"  # type: ignore[union-attr]
        self.deadline = time.monotonic() + self.timeout
        proc.stdin.write(f"{self.deadline!r}\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        return proc

    def close(self) -> None:
        for listener in self.listeners.values():
            listener.close()


@pytest.fixture
def chains():
    made: list[Chain] = []

    def make(*args, **kwargs) -> Chain:
        made.append(Chain(*args, **kwargs))
        return made[-1]

    yield make
    for chain in made:
        chain.close()


def _join(threads, timeout=60):
    for t in threads:
        t.join(timeout)
        assert not t.is_alive()


def _everyone_got_it(chain: Chain) -> None:
    """Every receiver holds the payload, and every member's run ended without a failure."""
    assert all(chain.holds_all(i) for i in range(1, chain.n))
    assert all(o == bc.ChainOutcome() for o in chain.outcomes.values()), chain.outcomes


def _wait_stopped(proc: subprocess.Popen) -> None:
    """Until the process stopped itself (SIGSTOP): the kernel says so."""
    _, status = os.waitpid(proc.pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status), status


def test_every_member_gets_an_odd_sized_payload_in_order(chains):
    chain = chains(4, [(1 << 20) + 3, 0, 17, 3 << 19], chunk=1 << 18)
    _join(chain.start(range(4)))
    _everyone_got_it(chain)
    assert [chain.runs[i].forwarded for i in range(3)] == [chain.runs[0].total] * 3


def test_each_relay_s_report_reaches_the_source_in_done(chains):
    chain = chains(4, [1 << 16], chunk=1 << 14)
    reports = {i: bytes([i]) * 6 for i in (1, 2, 3)}
    _join(chain.start(range(4), {0: dict(report_bytes=6)} | {
        i: dict(report_bytes=6, report=r) for i, r in reports.items()}))
    assert all(chain.holds_all(i) for i in (1, 2, 3))
    assert chain.outcomes[0].reports == reports
    assert chain.outcomes[2].reports == {2: reports[2], 3: reports[3]}
    assert not any(o.failures or o.upstream_error for o in chain.outcomes.values())


def test_a_relay_that_refuses_still_reports_and_stops_the_rest(chains):
    chain = chains(4, [1 << 16], chunk=1 << 14)
    reports = {i: bytes([i]) * 6 for i in (1, 2, 3)}
    _join(chain.start(range(4), {0: dict(report_bytes=6)} | {
        i: dict(report_bytes=6, report=r, refuse=i == 2) for i, r in reports.items()}))
    assert chain.outcomes[0].failures == {2: REFUSED}
    assert chain.outcomes[0].reports == {1: reports[1], 2: reports[2]}
    assert chain.outcomes[3].upstream_error == (2, REFUSED)


def test_a_member_that_comes_late_gets_it_and_so_do_those_after_it(chains):
    chain = chains(4, [4 << 20], chunk=1 << 20)
    threads = chain.start([0, 1, 3])
    # Member 2 is not there yet: member 1 holds everything, member 3 nothing.
    wait_for(lambda: chain.runs.get(1) is not None
             and chain.runs[1].received == chain.runs[1].total, "member 1 holds it all", 30,
             interval=0.001)
    assert chain.runs[3].received == 0 if 3 in chain.runs else True
    threads += chain.start([2])
    _join(threads)
    _everyone_got_it(chain)


def test_a_relay_killed_midway_is_named_by_every_member_after_and_before_it(chains):
    chain = chains(4, [16 << 20], chunk=1 << 16, timeout=30)
    victim = chain.spawn(2, stop_after=4)  # stops itself midway through the stream
    try:
        threads = chain.start([0, 1, 3])
        _wait_stopped(victim)
        assert chain.runs[3].received < chain.runs[0].total
        victim.kill()  # SIGKILL, in the middle of the stream
        victim.wait(30)
        _join(threads)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait(30)
    assert chain.outcomes[3].upstream_error == (2, LOST)
    assert chain.outcomes[1].failures == {2: LOST}
    assert chain.outcomes[0].failures == {2: LOST}  # told by member 1's DONE
    assert chain.holds_all(1) and not chain.holds_all(3)
    assert chain.ended[3] < chain.deadline - 5  # at once, not at the deadline


def test_a_relay_killed_midway_stops_the_members_after_it_by_abort(chains):
    chain = chains(5, [16 << 20], chunk=1 << 16, timeout=30)
    victim = chain.spawn(1, stop_after=3)
    try:
        threads = chain.start([0, 2, 3, 4])
        _wait_stopped(victim)
        victim.kill()
        victim.wait(30)
        _join(threads)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait(30)
    # Member 2 saw the link break; 3 and 4 got ABORT naming member 1.
    assert [chain.outcomes[i].upstream_error for i in (2, 3, 4)] == [(1, LOST)] * 3
    assert chain.outcomes[0].failures == {1: LOST}
    assert all(chain.ended[i] < chain.deadline - 5 for i in (2, 3, 4))


def test_a_relay_killed_before_it_linked_on_is_found_gone_by_the_next(chains):
    """The relay dies before it made its link to the next member: that member finds its
    listener refusing (a probe at each heartbeat), not the deadline."""
    chain = chains(4, [16 << 20], chunk=1 << 16, timeout=30)
    victim = chain.spawn(2, stop_after=1, linked=False)
    try:
        threads = chain.start([0, 1])
        _wait_stopped(victim)
        victim.kill()
        victim.wait(30)
        threads += chain.start([3])
        _join(threads)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait(30)
    assert chain.outcomes[3].upstream_error == (2, LOST)
    assert chain.ended[3] < chain.deadline - 5
    assert chain.outcomes[0].failures == {2: LOST}


def test_a_stopped_relay_is_named_by_every_member_when_they_time_out(chains):
    chain = chains(5, [16 << 20], chunk=1 << 16, timeout=5)
    frozen = chain.spawn(2, stop_after=3)
    try:
        threads = chain.start([0, 1, 3, 4])
        _wait_stopped(frozen)  # and left stopped past the timeout
        _join(threads)
    finally:
        frozen.kill()
        frozen.wait(30)
    # Member 3 waited on member 2; member 4 heard from member 3 whom it waited on.
    assert chain.outcomes[3].upstream_error == (2, TIMEOUT)
    assert chain.outcomes[4].upstream_error == (2, TIMEOUT)
    assert chain.outcomes[1].failures == {2: TIMEOUT}
    assert chain.outcomes[0].failures == {2: TIMEOUT}  # member 1's WAIT named it
    assert chain.holds_all(1)
    assert max(chain.ended.values()) <= chain.deadline + 1.0


def test_the_end_of_the_chain_refusing_tells_the_source(chains):
    chain = chains(3, [1 << 20], chunk=1 << 16)
    _join(chain.start([0, 1, 2], {2: dict(refuse=True)}))
    assert chain.outcomes[2].upstream_error == (2, REFUSED)
    assert chain.outcomes[1].failures == {2: REFUSED}
    assert chain.outcomes[0].failures == {2: REFUSED}
    assert chain.holds_all(1)


def test_node_mates_failures_travel_up_in_done(chains):
    """The end of the chain hands the payload to its node-mates (members 3 and 4 of the
    group); member 4 is gone: member 0 learns it through member 1."""
    chain = chains(3, [1 << 20], chunk=1 << 18, members=5)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        hand_off = {2: dict(on_received=lambda: pool.submit(lambda: {4: LOST}))}
        _join(chain.start(range(3), hand_off))
    assert chain.outcomes[2].failures == {4: LOST}
    assert chain.outcomes[0].failures == {4: LOST}
    assert chain.holds_all(2)


def test_a_stranger_on_the_listener_is_dropped_and_the_broadcast_goes_on(chains):
    chain = chains(3, [2 << 20], chunk=1 << 18)
    threads = chain.start([1, 2])  # member 1 takes connections while its upstream is not there
    host, port = chain.listeners[1].address.split(":")
    strangers = []
    for hello in (b"\0" * (bc.HELLO.size + bc.NONCE + bc.MAC), b"junk"):
        s = socket.create_connection((host, int(port)))
        s.sendall(hello)
        strangers.append(s)
    # One that knows the protocol but not the key.
    s = socket.create_connection((host, int(port)))
    nonce = s.recv(bc.NONCE)
    hello = bc.HELLO.pack(RUN, 0, 0, 1)
    mine = os.urandom(bc.NONCE)
    s.sendall(hello + mine + hmac.new(b"wrong", b"up" + nonce + hello + mine,
                                     hashlib.sha256).digest())
    strangers.append(s)
    try:
        assert s.recv(1) == b""  # refused: closed unanswered
        _join(threads + chain.start([0]))
    finally:
        for s in strangers:
            s.close()
    _everyone_got_it(chain)


def test_silent_connections_cannot_hold_the_listener(chains):
    """More silent connections than a member keeps unproven: the oldest are dropped, and
    the chain's own link still gets in."""
    chain = chains(3, [2 << 20], chunk=1 << 18)
    threads = chain.start([1, 2])
    host, port = chain.listeners[1].address.split(":")
    silent = []
    try:
        for _ in range(3 * bc.MAX_PENDING):
            s = socket.create_connection((host, int(port)), timeout=30)
            silent.append(s)
        first = silent[0]
        assert len(first.recv(bc.NONCE)) == bc.NONCE  # accepted, then dropped unproven:
        first.settimeout(5)  # its handshake's own deadline is 10 s: not what drops it
        assert first.recv(1) == b""  # closed unanswered
        _join(threads + chain.start([0]))
    finally:
        for s in silent:
            s.close()
    _everyone_got_it(chain)


def test_a_record_out_of_plan_from_upstream_is_refused(chains):
    """An upstream end that proved itself but then sends a record of a length not in
    the plan: the member refuses it (it allocates nothing for it) and names it."""
    chain = chains(2, [1 << 16], chunk=1 << 16)
    host, port = chain.listeners[1].address.split(":")
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(o=chain.make(1).run()))
    thread.start()
    s = socket.create_connection((host, int(port)))
    try:
        nonce = s.recv(bc.NONCE)
        hello = bc.HELLO.pack(RUN, 0, 0, 1)
        mine = os.urandom(bc.NONCE)
        s.sendall(hello + mine + bc.upstream_proof(KEY, nonce, hello, mine))
        assert len(s.recv(bc.MAC)) == bc.MAC
        s.sendall(RECORD.pack(DATA, 0, 0, 0, 1 << 40))
        thread.join(30)
    finally:
        s.close()
    assert out["o"].upstream_error == (0, REFUSED)
