"""Trust: authenticated stores and transports, no hangs, fast failures, bounded memory.

Real Ray workers, real sockets, shared memory and Gloo: forged and malformed notes, a
process outside the job, kills and relaunches, stalled and forged messages, a receiver
that never reads. Each case ends in a named error within its timeout, or works.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import ray
import torch

from rlcomm import CollectiveGroupOptions, NodePlacementStrategy, Worker
from rlcomm.comm import codec
from rlcomm.comm.codec import Kind, MessageHeader, TensorMeta
from rlcomm.comm.identity.address import WorkerAddress
from rlcomm.comm.identity.endpoint import decode_endpoint
from rlcomm.comm.identity.registry import job_secret, registry
from rlcomm.comm.status import process_status
from rlcomm.comm.store.client import StoreClient, StoreServer
from rlcomm.comm.store.rendezvous import Note, post
from rlcomm.comm.transports.gloo import GlooTransport
from rlcomm.comm.transports.shm import ShmTransport
from rlcomm.errors import (
    AuthenticationError,
    CommError,
    CommTimeoutError,
    PeerLostError,
    ProtocolMismatchError,
)
from tests.comm.pairs import receive, send, two_stores
from tests.waiting import wait_for, wait_process_gone

pytestmark = pytest.mark.timeout(180)

A, B = "trust_a", "trust_b"
SHORT = CollectiveGroupOptions(timeout=3)
MARKER = f"/tmp/rlcomm-trust-pwned-{os.getpid()}"


class Planted:
    """Unpickling this creates ``MARKER``'s file: code run on the receiver."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


class TrustPeer(Worker):
    def pid(self):
        return os.getpid()

    def send_one(self, obj, group, rank, timeout=30):
        self.send(obj, group, rank, options=CollectiveGroupOptions(timeout=timeout))

    def send_tensor_one(self, t, group, rank):
        self.send_tensor(t, group, rank, options=CollectiveGroupOptions(timeout=30))

    def recv_one(self, group, rank, timeout=30):
        return self.recv(group, rank, options=CollectiveGroupOptions(timeout=timeout))

    def recv_tensor_one(self, shape, group, rank, timeout=30):
        buf = torch.empty(shape)
        self.recv_tensor(buf, group, rank, options=CollectiveGroupOptions(timeout=timeout))
        return buf

    def expect_error(self, method, *args, **kwargs):
        start = time.monotonic()
        try:
            getattr(self, method)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            return type(exc).__name__, str(exc), time.monotonic() - start
        return None, "no error", time.monotonic() - start

    def recv_into_strided(self, group, rank):
        buf = torch.empty(4, 4).t()  # not contiguous
        self.recv_tensor(buf, group, rank, options=CollectiveGroupOptions(timeout=5))

    def rejected(self):
        return process_status()["process"]["store"]["rejected"]

    def _connection(self, group, rank):
        peer = str(WorkerAddress.of(group, rank))
        rows = [c for c in process_status()["process"]["connections"] if c["peer"] == peer]
        return rows[0] if rows else None

    def transport_with(self, group, rank):
        conn = self._connection(group, rank)
        return None if conn is None else conn["transport"]

    def limit_unread(self, nbytes):
        from rlcomm.comm.options import set_memory_limits

        set_memory_limits(max_unread=nbytes)

    def unread_from(self, group, rank):
        return self._connection(group, rank)["unread_bytes"]

    def send_until_timeout(self, group, rank, count, nbytes):
        """Send ``count`` tensors numbered 0.. with a short timeout; returns how many
        went and the first error."""
        for i in range(count):
            try:
                self.send(torch.full((nbytes // 4,), float(i)), group, rank, options=SHORT)
            except CommError as exc:
                return i, type(exc).__name__, str(exc)
        return count, None, ""

    def recv_numbered(self, group, rank, count):
        return [self.recv(group, rank, options=SHORT)[0].item() for _ in range(count)]

    def send_planted(self, path, group, rank):
        """Sends a pickle that would create ``path`` when unpickled (built here: the
        test must not pass it through Ray, which would unpickle it on the way)."""
        self.send({"x": Planted(path)}, group, rank, options=SHORT)

    def forge_half_message(self, group, rank):
        """Send a frame whose 1 MiB payload never follows (as a sender frozen
        mid-message would leave it)."""
        from rlcomm.comm.identity.address import WorkerAddress
        from rlcomm.comm.manager import CommManager

        conn = CommManager.current().connection(WorkerAddress.of(group, rank), None)
        conn.wait_ready(30)
        conn._transport.send_frame(_frame([TensorMeta("float32", (1 << 18,), "cpu")]), [], 5)

    def strict(self, on):
        codec.set_strict_mode(on)


@pytest.fixture(scope="module")
def peers(cluster):
    a = TrustPeer.create_group().launch(cluster, NodePlacementStrategy([0, 0]), name=A)
    b = TrustPeer.create_group().launch(cluster, NodePlacementStrategy([0, 0]), name=B)
    yield a, b
    a.shutdown()
    b.shutdown()


def _endpoint(address: str):
    return decode_endpoint(ray.get(registry().get_endpoint.remote(address), timeout=30))


_OUTSIDER = textwrap.dedent(
    """
    import datetime, json, socket, sys, time
    host, port, marker = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    out = {}
    # 1. torch's TCPStore client, as the attack on the old mailboxes did.
    import torch.distributed as dist
    start = time.monotonic()
    try:
        s = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=2))
        n = s.add("inbox/count", 1)
        s.set(f"inbox/{n}", b"forged")
        out["tcpstore"] = "wrote a note"
    except Exception as exc:
        out["tcpstore"] = "refused: " + type(exc).__name__
    out["tcpstore_s"] = time.monotonic() - start
    # 2. the store's own protocol, with a guessed secret.
    from rlcomm.comm.store.client import StoreClient
    from rlcomm.errors import AuthenticationError
    try:
        c = StoreClient(host, port, b"guess" * 8, 4)
        out["guess"] = "read: %r" % c.check(["inbox/count"])
    except AuthenticationError as exc:
        out["guess"] = "refused: AuthenticationError"
    except Exception as exc:
        out["guess"] = "refused: " + type(exc).__name__
    # 3. raw bytes: what does the server say before any proof?
    sock = socket.create_connection((host, port), timeout=4)
    hello = sock.recv(64)
    sock.sendall(b"RLCS1" + b"\\0" * 48)
    sock.settimeout(12)
    try:
        rest = sock.recv(64)
    except Exception as exc:
        rest = type(exc).__name__.encode()
    out["raw_hello"] = len(hello)
    out["raw_after"] = rest.decode(errors="replace")
    print(json.dumps(out))
    """
)


def test_a_process_outside_the_job_gets_nothing(peers, tmp_path):
    """The attack of the issue, from a plain process with no Ray and no secret: it can
    neither leave a note nor read a key of a worker's mailbox, and nothing runs."""
    a, b = peers
    ep = _endpoint(f"{A}:0")
    before = a.execute_on(0).rejected().wait(timeout=30)[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    proc = subprocess.run(
        [sys.executable, "-c", _OUTSIDER, ep.host, str(ep.port), MARKER],
        capture_output=True, text=True, timeout=90, env=env,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["tcpstore"].startswith("refused"), out
    assert out["guess"] == "refused: AuthenticationError", out
    assert out["raw_hello"] == 21  # magic and nonce: nothing of the store's contents
    assert out["raw_after"] in ("", "ConnectionResetError"), out  # closed unanswered
    assert not os.path.exists(MARKER)
    wait_for(lambda: a.execute_on(0).rejected().wait(timeout=30)[0] >= before + 2,
             "the worker counts the refused clients", 20, interval=0.2)
    # The worker goes on serving its real peers.
    b.execute_on(0).send_one("after the attack", A, 0).wait(timeout=60)
    assert a.execute_on(0).recv_one(B, 0).wait(timeout=60) == ["after the attack"]


def test_forged_and_malformed_notes_are_dropped(peers):
    """A job member's forged notes (wrong incarnation, asking for Gloo; unknown sender;
    unknown kind; undecodable bytes) are dropped, and the mailbox keeps reading."""
    a, b = peers
    ep = _endpoint(f"{A}:1")
    client = StoreClient(ep.host, ep.port, job_secret(), 10)
    n = client.add("inbox/count", 1)
    client.set(f"inbox/{n}", b"\xc1 not msgpack")
    forged = Note("request", f"{B}:1", "0" * 12, f"pair/{A}:1/{B}:1/x/y/0", {"transport": "gloo"})
    post(client, forged)
    post(client, Note("request", "nobody:0", "1" * 12, "pair/x", None))
    post(client, Note("gossip", f"{B}:1"))
    post(client, Note("request", "::", "", "", {"transport": 7}))
    client.close()
    b.execute_on(1).send_one("real", A, 1).wait(timeout=60)
    assert a.execute_on(1).recv_one(B, 1).wait(timeout=60) == ["real"]
    # The forged note did not pick the transport: two workers of one node use shm.
    assert a.execute_on(1).transport_with(B, 1).wait(timeout=30) == ["shm"]


def test_rejected_recv_tensor_buffer_does_not_poison_the_pair(peers):
    a, b = peers
    b.execute_on(0).send_tensor_one(torch.arange(16.0).view(4, 4), A, 0).wait(timeout=60)
    name, text, took = a.execute_on(0).expect_error("recv_into_strided", B, 0).wait(timeout=60)[0]
    assert name == "ValueError" and "contiguous" in text
    got = a.execute_on(0).recv_tensor_one((4, 4), B, 0, timeout=10).wait(timeout=60)[0]
    assert torch.equal(got, torch.arange(16.0).view(4, 4))


def test_relaunch_under_the_same_name_with_an_unread_message(cluster, peers):
    """The survivor holds an unread send_tensor message from a group that is then
    relaunched under its name: the new group's request replaces the old connection
    (no deadlock), and the survivor's recv returns within its timeout."""
    a, _ = peers
    old = TrustPeer.create_group().launch(cluster, NodePlacementStrategy([0]), name="trust_c")
    old.send_tensor_one(torch.ones(8), A, 0).wait(timeout=60)  # never received
    old.shutdown()
    new = TrustPeer.create_group().launch(cluster, NodePlacementStrategy([0]), name="trust_c")
    try:
        new.send_one("from the new one", A, 0).wait(timeout=60)
        start = time.monotonic()
        got = a.execute_on(0).recv_one("trust_c", 0, timeout=10).wait(timeout=60)[0]
        assert got == "from the new one" and time.monotonic() - start < 20
    finally:
        new.shutdown()


def test_a_killed_peer_fails_fast_without_any_connection(cluster, peers):
    """An op on a peer killed with SIGKILL (still in the registry, never connected)
    raises PeerLostError within seconds, not after the 180 s default timeout."""
    a, _ = peers
    victim = TrustPeer.create_group().launch(cluster, NodePlacementStrategy([0]), name="trust_d")
    try:
        pid = victim.pid().wait(timeout=30)[0]
        os.kill(pid, signal.SIGKILL)
        wait_process_gone(pid)
        # trust_a:0 < trust_d:0: a send initiates; a recv invites. Both must fail fast.
        for method, args in (("send", ("x", "trust_d", 0)), ("recv", ("trust_d", 0))):
            fn = "send_one" if method == "send" else "recv_one"
            kwargs = {"timeout": 180}
            name, text, took = a.execute_on(0).expect_error(fn, *args, **kwargs).wait(
                timeout=60
            )[0]
            assert name == "PeerLostError" and "trust_d:0" in text, (method, name, text)
            assert took < 10, (method, took)
    finally:
        victim.shutdown()


class _PortSquatter:
    """A listener on a dead worker's port that answers every connection with ``hello``
    (another job's store opens with rlcomm's magic; another service with its own), reads
    what comes, and closes unanswered."""

    def __init__(self, host: str, port: int, hello: bytes):
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

        def bound() -> bool:
            try:
                self.sock.bind((host, port))
            except OSError as exc:  # the port is still, or again, in use for a moment
                self.why = f"{exc}: " + subprocess.run(
                    ["ss", "-tanp", f"sport = :{port}"], capture_output=True, text=True
                ).stdout
                return False
            return True

        self.why = ""
        try:
            wait_for(bound, f"the dead worker's port {port} free to take", 15, interval=0.1)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; {self.why}") from None
        self.sock.listen(8)
        self.answered = 0
        self.hello = hello  # what it answers each connection with (the test may change it)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            with conn:
                conn.settimeout(5)
                try:
                    conn.sendall(self.hello)
                    conn.recv(256)
                except OSError:
                    pass
            self.answered += 1

    def close(self) -> None:
        # A thread blocked in accept() is woken by shutdown(), not by close() alone.
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self._thread.join(10)
        assert not self._thread.is_alive(), "the squatter's thread did not end"


def test_a_dead_peer_whose_port_answers_as_another_is_named_gone(cluster, peers):
    """The peer was killed before first contact, and its port was taken by another
    process (another job's store, then another service): an op on it raises
    PeerLostError naming the peer (its process is gone), not an authentication error
    sending the user after another job."""
    a, _ = peers
    victim = TrustPeer.create_group().launch(cluster, NodePlacementStrategy([0]), name="trust_g")
    try:
        ep = _endpoint("trust_g:0")
        pid = victim.pid().wait(timeout=30)[0]
        os.kill(pid, signal.SIGKILL)
        wait_process_gone(pid)
        squatter = _PortSquatter(ep.host, ep.port, b"")
        try:
            for hello in (b"RLCS1" + bytes(16), b"SSH-2.0-OpenSSH_9.6\r\n"):
                squatter.hello, before = hello, squatter.answered
                for fn, args in (("send_one", ("x", "trust_g", 0)),
                                 ("recv_one", ("trust_g", 0))):
                    name, text, took = a.execute_on(0).expect_error(
                        fn, *args, timeout=180).wait(timeout=60)[0]
                    assert name == "PeerLostError" and "trust_g:0" in text, (hello, fn, text)
                    assert "another job" not in text and took < 10, (hello, fn, text, took)
                # The squatter, not an empty port, answered.
                wait_for(lambda before=before: squatter.answered > before, "the squatter", 10)
        finally:
            squatter.close()
    finally:
        victim.shutdown()


def test_a_receiver_that_never_reads_holds_bounded_memory(cluster, peers):
    """The receiver stops reading at its unread-bytes cap; the sender then times out
    with a clear error having sent nothing of that message, the stream stays intact,
    and everything sent before arrives."""
    a, _ = peers
    rx = TrustPeer.create_group().launch(cluster, NodePlacementStrategy([0]), name="trust_e")
    try:
        cap, size = 16 << 20, 8 << 20
        rx.limit_unread(cap).wait(timeout=30)
        # More messages than the sender may have segments in flight (shm_max_in_flight).
        sent, name, text = a.execute_on(1).send_until_timeout("trust_e", 0, 120, size).wait(
            timeout=170
        )[0]
        assert name == "CommTimeoutError" and "nothing of it was sent" in text, text
        assert 0 < sent < 120
        unread = rx.unread_from(A, 1).wait(timeout=30)[0]
        assert unread <= cap + size
        got = rx.recv_numbered(A, 1, sent).wait(timeout=120)[0]
        assert got == [float(i) for i in range(sent)]
        a.execute_on(1).send_one("after", "trust_e", 0).wait(timeout=60)
        assert rx.recv_one(A, 1).wait(timeout=60) == ["after"]
    finally:
        rx.shutdown()


def test_strict_mode_refuses_code_in_pickles(cluster, peers):
    a, _ = peers
    rx = TrustPeer.create_group().launch(cluster, NodePlacementStrategy([0]), name="trust_f")
    try:
        rx.strict(True).wait(timeout=30)
        a.execute_on(0).send_planted(MARKER, "trust_f", 0).wait(timeout=60)
        name, text, _ = rx.expect_error("recv_one", A, 0).wait(timeout=60)[0]
        assert name == "CodecError" and "strict mode" in text and "open" in text
        assert not os.path.exists(MARKER)
        plain = {"step": 3, "tags": ["a", "b"], "obs": torch.ones(2)}
        a.execute_on(0).send_one(plain, "trust_f", 0).wait(timeout=60)
        got = rx.recv_one(A, 0).wait(timeout=60)[0]
        assert got["step"] == 3 and got["tags"] == ["a", "b"] and torch.equal(got["obs"], torch.ones(2))
    finally:
        rx.shutdown()


def test_a_sender_frozen_mid_message_does_not_hold_a_receive(cluster, peers):
    """A worker leaves half a message and is then stopped (SIGSTOP): the receiver's
    recv ends with CommTimeoutError within its timeout."""
    a, _ = peers
    frozen = TrustPeer.create_group().launch(cluster, NodePlacementStrategy([0]), name="trust_g")
    pid = frozen.pid().wait(timeout=30)[0]
    try:
        frozen.send_one("first", A, 1).wait(timeout=60)
        assert a.execute_on(1).recv_one("trust_g", 0).wait(timeout=60) == ["first"]
        frozen.forge_half_message(A, 1).wait(timeout=60)
        os.kill(pid, signal.SIGSTOP)
        name, text, took = a.execute_on(1).expect_error("recv_one", "trust_g", 0, timeout=1.5).wait(
            timeout=60
        )[0]
        assert name == "CommTimeoutError" and "trust_g:0" in text, (name, text)
        assert took < 8
    finally:
        os.kill(pid, signal.SIGCONT)
        frozen.shutdown()


# -- in one process: real transports, forged frames --------------------------------------------


def _frame(metas: list[TensorMeta], kind: Kind = Kind.TENSOR) -> bytes:
    header = MessageHeader(kind, metas)
    header.inline = 0
    hb = codec.header_to_bytes(header)
    return len(hb).to_bytes(4, "little") + hb


def test_a_header_declaring_a_huge_message_is_refused_before_allocating(conns):
    a, b = conns
    a._transport.send_frame(_frame([TensorMeta("float32", (1 << 40,), "cpu")]), [], 5)
    start = time.monotonic()
    with pytest.raises(ProtocolMismatchError, match="over this worker's limit"):
        receive(b, timeout=10)
    assert time.monotonic() - start < 5
    assert b.error is not None  # the stream is out of step: the connection is closed


def test_a_sender_stalled_mid_message_does_not_hold_the_receive(conns):
    a, b = conns
    a._transport.send_frame(_frame([TensorMeta("float32", (1 << 18,), "cpu")]), [], 5)
    start = time.monotonic()
    with pytest.raises(CommTimeoutError):
        receive(b, timeout=2)
    assert time.monotonic() - start < 6
    # The reader waits for the rest only until its own deadline (the default op
    # timeout); when the rest comes before that, the message is whole.
    a._transport.send([torch.zeros(1 << 20, dtype=torch.uint8)], 5)
    assert torch.equal(receive(b), torch.zeros(1 << 18))


def test_a_send_that_fails_part_way_closes_the_connection(conns):
    a, b = conns
    b.reader.inbox.max_unread = 1  # b reads one message, then stops
    big = [torch.ones(1 << 18) for _ in range(40)]  # 40 MiB in 40 tensors: written as it goes
    with pytest.raises(CommTimeoutError, match="part-way"):
        for _ in range(20):
            a.send_inline(*codec.encode(big), timeout=1)
    assert a.error is not None
    with pytest.raises(CommError):
        send(a, "never half-framed")


def test_a_clean_send_timeout_keeps_the_stream(conns):
    a, b = conns
    b.reader.inbox.max_unread = 4 << 20
    sent = 0
    with pytest.raises(CommTimeoutError, match="nothing of it was sent"):
        for sent in range(100):  # noqa: B007 - counted
            a.send_inline(*codec.encode(torch.full((1 << 20,), float(sent))), timeout=1)
    assert a.error is None and b.error is None
    assert [receive(b)[0].item() for _ in range(sent)] == [float(i) for i in range(sent)]
    send(a, "next")
    assert receive(b) == "next"


def _errors_of_both_ends(make, join_timeout: float) -> dict[int, BaseException]:
    """Make both ends of a transport (rank 1 on a thread) with ``make(store, rank)``;
    the CommError each end raised, by rank."""
    stores = two_stores()
    errors: dict[int, BaseException] = {}

    def end(rank: int) -> None:
        try:
            make(stores[rank], rank)
        except CommError as exc:
            errors[rank] = exc

    t = threading.Thread(target=end, args=(1,))
    t.start()
    end(0)
    t.join(timeout=join_timeout)
    return errors


def test_the_shm_setup_socket_refuses_other_processes():
    def make(store, rank):
        # Rank 0 expects a process that is not this one: this process's connection
        # must be refused.
        pid = os.getppid() if rank == 0 else None
        ShmTransport(store, rank, 3, f"end{1 - rank}", peer_pid=pid).close()

    errors = _errors_of_both_ends(make, 20)
    assert isinstance(errors.get(0), CommTimeoutError)


def test_a_gloo_pair_without_the_secret_is_refused():
    def make(store, rank):
        secret = (b"a" if rank == 0 else b"b") * 32
        GlooTransport(store, rank, 10, f"end{1 - rank}", secret=secret)

    errors = _errors_of_both_ends(make, 30)
    assert isinstance(errors.get(0), AuthenticationError)
    assert isinstance(errors.get(1), AuthenticationError)


def test_the_store_serves_only_clients_with_the_secret():
    server = StoreServer("127.0.0.1", b"s" * 32)
    try:
        with pytest.raises(AuthenticationError):
            StoreClient("127.0.0.1", server.port, b"t" * 32, 5)
        good = StoreClient("127.0.0.1", server.port, b"s" * 32, 5)
        good.set("k", b"v")
        assert good.get("k") == b"v" and good.add("n", 2) == 2
        view = good.prefixed("p")
        view.set("k", b"w")
        assert view.get("k") == b"w" and good.get("p/k") == b"w"
        with pytest.raises(CommTimeoutError):
            good.wait(["missing"], __import__("datetime").timedelta(seconds=0.2))
        assert server.rejected == 1
    finally:
        server.close()
    with pytest.raises(PeerLostError):
        StoreClient("127.0.0.1", server.port, b"s" * 32, 5)


@pytest.mark.timeout(60)
def test_a_store_take_waits_for_its_key_and_removes_it():
    server = StoreServer("127.0.0.1", b"s" * 32)
    try:
        setter, taker = (StoreClient("127.0.0.1", server.port, b"s" * 32, 5) for _ in range(2))
        late = threading.Timer(0.3, setter.set, ("p/k", b"v"))
        start = time.monotonic()
        late.start()
        assert taker.prefixed("p").take("k") == b"v"  # it waited for the set
        assert time.monotonic() - start >= 0.25
        assert not setter.check(["p/k"]) and setter.num_keys() == 0  # and removed the key
        with pytest.raises(CommTimeoutError):
            taker.take("k", datetime.timedelta(seconds=0.2))
        setter.set("k", b"w")  # a take that timed out leaves the stream in step
        assert taker.take("k") == b"w"
    finally:
        server.close()
