"""The store server: its sessions as a pure state machine (a table with ``now`` passed
in), and the server itself with real sockets in this process: idle and garbage
connections cost no thread and hold nobody up, waits never block the loop, the
connection bound drops the oldest unproven connection first, ``status`` runs off the loop.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading

import pytest

from rlcomm.comm.store.client import StoreClient, StoreServer
from rlcomm.comm.store.session import Phase, Session
from rlcomm.comm.store.wire import (
    HANDSHAKE_SECONDS,
    LEN,
    MAGIC,
    MAX_FRAME,
    NONCE,
    PROOF,
    encode,
    mac,
)
from rlcomm.errors import AuthenticationError, CommTimeoutError
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(60)

SECRET = b"s" * 32
SERVER_NONCE = b"n" * NONCE
CLIENT_NONCE = b"c" * NONCE


def _proof(secret: bytes = SECRET) -> bytes:
    return MAGIC + CLIENT_NONCE + mac(secret, b"client", SERVER_NONCE, CLIENT_NONCE)


def _frame(request: list) -> bytes:
    body = encode(request)
    return LEN.pack(len(body)) + body


def _proven(now: float = 0.0) -> Session:
    s = Session(SECRET, SERVER_NONCE, now, 2.0)
    assert s.received(_proof(), now) == mac(SECRET, b"server", CLIENT_NONCE, SERVER_NONCE)
    return s


# -- the session, pure ----------------------------------------------------------------------


def test_a_session_reads_nothing_past_the_proof_before_checking_it():
    s = Session(SECRET, SERVER_NONCE, 0.0, 2.0)
    assert s.greeting() == MAGIC + SERVER_NONCE
    assert s.want() == PROOF
    assert s.received(_proof()[:10], 0.5) is None and s.want() == PROOF - 10
    assert s.received(_proof()[10:], 0.9) is not None
    assert s.phase is Phase.PROVEN and s.deadline is None


@pytest.mark.parametrize(
    ("chunks", "why"),
    [
        ([_proof(b"t" * 32)], "did not prove"),
        ([b"GET / HTTP/1.1\r\n" * 4], "did not prove"),  # garbage of the proof's size
        ([b""], "closed by the client"),
    ],
)
def test_a_session_without_a_valid_proof_ends(chunks, why):
    s = Session(SECRET, SERVER_NONCE, 0.0, 2.0)
    for chunk in chunks:
        s.received(chunk[:PROOF], 0.1)
    assert s.phase is Phase.ENDED and why in s.why


def test_an_unproven_session_expires_at_its_deadline():
    s = Session(SECRET, SERVER_NONCE, 10.0, 2.0)
    s.received(_proof()[:5], 11.0)  # a few bytes do not extend the deadline
    assert not s.expired(11.99)
    assert s.expired(12.0) and s.phase is Phase.ENDED and "no proof in time" in s.why


def test_a_proven_session_serves_one_request_at_a_time():
    s = _proven()
    s.received(_frame([0, "a", b"1"]) + _frame([1, "a", 0.0]), 1.0)
    first = s.next_request(1.0)
    assert first is not None and s.busy
    assert s.next_request(1.0) is None  # busy: the second waits for the reply
    s.served(1.1)
    assert s.next_request(1.1) is not None


def test_a_proven_session_with_a_partial_frame_has_a_deadline():
    s = _proven()
    frame = _frame([0, "a", b"1"])
    s.received(frame[:3], 5.0)
    assert s.next_request(5.0) is None and s.deadline == 5.0 + HANDSHAKE_SECONDS
    s.received(frame[3:], 6.0)
    assert s.next_request(6.0) is not None and s.deadline is None
    s.served(6.0)
    s.received(frame[:2], 7.0)
    assert s.expired(7.0 + HANDSHAKE_SECONDS) and "unfinished" in s.why


def test_a_frame_over_the_limit_ends_the_session():
    s = _proven()
    s.received(LEN.pack(MAX_FRAME + 1), 1.0)
    assert s.next_request(1.0) is None and s.phase is Phase.ENDED and "limit" in s.why


# -- the server, in this process ------------------------------------------------------------


def _store_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("rlcomm-st")]


def _read_to_end(sock: socket.socket) -> bytes:
    """What the server sent before it closed ``sock`` (a reset, for bytes it left
    unread, ends it too)."""
    sock.settimeout(10)
    data = b""
    try:
        while chunk := sock.recv(64):
            data += chunk
    except ConnectionResetError:
        pass
    return data


@pytest.fixture
def server():
    srv = StoreServer("127.0.0.1", SECRET, status=lambda detail: f"report {detail}".encode(),
                      max_connections=400, auth_timeout=1.0)
    yield srv
    srv.close()


def test_idle_connections_cost_no_thread_and_hold_nobody_up(server):
    before = _store_threads()
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(300)]
    try:
        wait_for(lambda: server.stats()["unproven"] == 300, "the idle connections were not accepted")
        clients = [StoreClient("127.0.0.1", server.port, SECRET, 5) for _ in range(20)]
        for i, c in enumerate(clients):
            c.set(f"k{i}", b"v")
        assert clients[0].get("k19") == b"v"
        assert server.stats()["proven"] == 20
        assert _store_threads() == before  # one loop thread, whatever the clients
        # Unproven connections are dropped at their deadline; proven ones stay.
        wait_for(lambda: server.stats()["unproven"] == 0, "idle connections were kept")
        assert server.counts["no_proof_in_time"] == 300
        assert all(len(_read_to_end(s)) == len(MAGIC) + NONCE for s in idle[:5])
        assert clients[5].get("k0") == b"v"
    finally:
        for s in idle:
            s.close()


def test_over_the_bound_the_oldest_unproven_connection_is_dropped():
    srv = StoreServer("127.0.0.1", SECRET, max_connections=50, auth_timeout=30.0)
    try:
        proven = StoreClient("127.0.0.1", srv.port, SECRET, 5)
        idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(60)]
        wait_for(lambda: srv.counts["evicted"] == 11, "the oldest were not dropped")
        assert srv.stats()["connections"] == 50
        assert len(_read_to_end(idle[0])) == len(MAGIC) + NONCE  # greeted, then closed
        # A new client still gets in (it drops the oldest idle one), and the proven one
        # was never dropped.
        assert StoreClient("127.0.0.1", srv.port, SECRET, 5).num_keys() == 0
        proven.set("still", b"here")
        for s in idle:
            s.close()
    finally:
        srv.close()


def test_a_wrong_proof_is_closed_unanswered_and_counted(server):
    with pytest.raises(AuthenticationError):
        StoreClient("127.0.0.1", server.port, b"t" * 32, 5)
    raw = socket.create_connection(("127.0.0.1", server.port))
    raw.settimeout(5)
    assert len(raw.recv(64)) == len(MAGIC) + NONCE
    raw.sendall(os.urandom(PROOF + 100))  # more than a proof: nothing past it is read
    assert _read_to_end(raw) == b""
    wait_for(lambda: server.counts["wrong_proof"] == 2, "wrong proofs not counted")


def test_waits_are_parked_and_never_block_the_loop(server):
    waiter, setter = (StoreClient("127.0.0.1", server.port, SECRET, 5) for _ in range(2))
    out: dict[str, object] = {}

    def wait_both() -> None:
        out["wait"] = waiter.wait(["a", "b"], datetime.timedelta(seconds=20))

    t = threading.Thread(target=wait_both)
    t.start()
    wait_for(lambda: server.stats()["parked"] == 1, "the wait was not parked")
    setter.set("a", b"1")  # served while the wait is parked
    assert setter.get("a") == b"1" and server.stats()["parked"] == 1
    setter.set("b", b"2")
    t.join(timeout=10)
    assert not t.is_alive() and out["wait"] is None
    with pytest.raises(CommTimeoutError):
        waiter.take("missing", datetime.timedelta(seconds=0.2))
    assert setter.add("n", 3) == 3 and setter.compare_set("n", b"3", b"7") == b"7"
    assert setter.num_keys() == 3 and setter.delete_key("n") and not setter.check(["n"])


def test_one_set_answers_every_get_and_one_take(server):
    c = [StoreClient("127.0.0.1", server.port, SECRET, 5) for _ in range(5)]
    got: dict[int, object] = {}

    def take(i: int) -> None:
        try:
            got[i] = c[i].take("t", datetime.timedelta(seconds=1.5))
        except CommTimeoutError:
            got[i] = None

    def get(i: int) -> None:
        got[i] = c[i].get("g")

    threads = [threading.Thread(target=take, args=(i,)) for i in (0, 1)]
    threads += [threading.Thread(target=get, args=(i,)) for i in (2, 3)]
    for t in threads:
        t.start()
    wait_for(lambda: server.stats()["parked"] == 4, "not all parked")
    c[4].set("g", b"v")
    c[4].set("t", b"w")
    for t in threads:
        t.join(timeout=10)
    assert got[2] == got[3] == b"v"
    assert sorted(map(repr, (got[0], got[1]))) == ["None", "b'w'"]
    assert not c[4].check(["t"]) and c[4].check(["g"])


def test_status_runs_off_the_loop(server):
    release = threading.Event()

    def slow(detail: str) -> bytes:
        release.wait(20)
        return b"late " + detail.encode()

    srv = StoreServer("127.0.0.1", SECRET, status=slow)
    try:
        asker, other = (StoreClient("127.0.0.1", srv.port, SECRET, 5) for _ in range(2))
        out: dict[str, object] = {}
        t = threading.Thread(target=lambda: out.update(r=asker.status("ops", 30)))
        t.start()
        other.set("k", b"v")  # served while the report is being made
        assert other.get("k") == b"v"
        release.set()
        t.join(timeout=10)
        assert out["r"] == b"late ops"
    finally:
        srv.close()
    assert StoreClient("127.0.0.1", server.port, SECRET, 5).status("x") == b"report x"


def test_a_gloo_group_rendezvouses_on_the_store(server):
    import torch
    import torch.distributed as dist

    results: dict[int, torch.Tensor] = {}

    def rank(r: int) -> None:
        store = StoreClient("127.0.0.1", server.port, SECRET, 30).prefixed("pg")
        pg = dist.ProcessGroupGloo(store, r, 2, datetime.timedelta(seconds=30))
        t = torch.full((4,), float(r + 1))
        pg.allreduce([t]).wait()
        results[r] = t

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=45)
    assert all(torch.equal(results[r], torch.full((4,), 3.0)) for r in (0, 1))
