"""The read side's state machine (``StreamState``), as tables: no threads, no sockets,
``now`` passed in."""

from __future__ import annotations

import pytest

from rlcomm.comm.codec import Kind, MessageHeader, TensorMeta
from rlcomm.comm.connection.incoming import Incoming, Payload, classify
from rlcomm.comm.connection.stream import (
    LINGER,
    DriverTurn,
    Lease,
    StreamState,
    Turn,
    Wakes,
)
from rlcomm.errors import CommError, PeerLostError, ProtocolMismatchError

FAR = 1e9  # a deadline that never comes


def _msg(nbytes: int = 10, deferred: bool = False) -> Incoming:
    header = MessageHeader(Kind.TENSOR, [TensorMeta("uint8", (nbytes,), "cpu")])
    msg = Incoming(header, b"", payload=Payload.IN_STREAM if deferred else Payload.READ)
    msg.nbytes = nbytes
    return msg


def _state(pollable: bool = True, max_unread: int = 100) -> StreamState:
    state = StreamState("peer:0", max_unread=max_unread)
    state.attach(pollable)
    return state


# -- the driver --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setup", "now", "expected", "lease"),
    [
        # An idle stream is the driver's.
        ("idle", 10.0, (DriverTurn.READ, None), Lease.IDLE),
        # A receive op read last: the driver leaves it to ops for the linger time.
        ("caller read at 10", 10.0 + LINGER / 2, (DriverTurn.LATER, 10.0 + LINGER / 2 + LINGER),
         Lease.IDLE),
        ("caller read at 10", 10.0 + LINGER, (DriverTurn.READ, None), Lease.IDLE),
        # A receive op was served from the inbox: the same (a caller receiving in a loop
        # reads on itself, rather than sharing each message with the driver's thread).
        ("op served at 10", 10.0 + LINGER / 2, (DriverTurn.LATER, 10.0 + LINGER / 2 + LINGER),
         Lease.IDLE),
        ("op served at 10", 10.0 + LINGER, (DriverTurn.READ, None), Lease.IDLE),
        # ... unless receive ops wait behind it (async ones): the driver reads ahead.
        ("op served at 10, one waits", 10.0 + LINGER / 2, (DriverTurn.READ, None), Lease.IDLE),
        # An op asked for the stream: the driver waits.
        ("an op asked", 10.0, (DriverTurn.LATER, 10.0 + LINGER), Lease.IDLE),
        # The inbox is at its cap: the driver stops reading.
        ("inbox full", 10.0, (DriverTurn.LATER, 10.0 + LINGER), Lease.IDLE),
        # Somebody else holds it.
        ("stalled", 10.0, (DriverTurn.LATER, 10.0 + LINGER), Lease.STALLED),
        # A selector drives it: the receiver thread waits until woken.
        ("selected", 10.0, (DriverTurn.LATER, None), Lease.IDLE),
        ("failed", 10.0, (DriverTurn.STOP, None), Lease.IDLE),
    ],
)
def test_the_receiver_thread_takes_the_stream(setup, now, expected, lease):
    state = _state()
    if setup == "caller read at 10":
        state.want(10.0, FAR, False, state.take_ticket())
        state.leave(None, 10.0, by_caller=True)
    elif setup.startswith("op served at 10"):
        state.inbox.put(_msg())
        ticket = state.take_ticket()
        if setup.endswith("one waits"):
            state.take_ticket()
        assert state.want(10.0, FAR, False, ticket) == (Turn.SERVE, False)
        state.served(ticket, consumed=True, now=10.0)
    elif setup == "an op asked":
        state.lease = Lease.DRIVER
        assert state.want(now, FAR, False, state.take_ticket()) == (Turn.ASK, True)
        state.leave(None, now, by_caller=False)
    elif setup == "inbox full":
        state.inbox.put(_msg(100))
    elif setup == "stalled":
        state.leave(_msg(deferred=True), now, by_caller=False)
    elif setup == "selected":
        state.select()
    elif setup == "failed":
        state.fail(PeerLostError("gone"))
    before = state.lease
    assert state.driver_take(now) == expected
    assert state.lease is (Lease.DRIVER if expected[0] is DriverTurn.READ else before)
    assert before is lease


def test_an_unpollable_stream_has_no_linger_and_no_callers_reading():
    state = _state(pollable=False)
    ticket = state.take_ticket()
    assert state.want(0.0, FAR, False, ticket) == (Turn.WAIT, False)  # never READ
    assert state.driver_take(0.0) == (DriverTurn.READ, None)
    state.leave(None, 0.0, by_caller=False)
    state.leave(_msg(deferred=True), 0.0, by_caller=False)
    assert state.driver_take(0.0) == (DriverTurn.LATER, None)  # stalled: wait to be woken
    state.claim_stall()
    # The stall ends: the receiver thread, blocked on its turn, must be woken.
    assert state.leave(None, 0.0, by_caller=True) == Wakes(True, True)
    assert state.driver_take(0.0) == (DriverTurn.READ, None)


# -- a selector -----------------------------------------------------------------------------------


def test_a_selector_takes_pollable_streams_and_lets_go_of_others():
    state = StreamState("p")
    state.select()
    assert state.driver_take(0.0, selector=True) == (DriverTurn.LATER, None)  # not attached
    state.attach(pollable=False)
    assert state.driver_take(0.0, selector=True) == (DriverTurn.LET_GO, None)
    assert not state.selected
    state = _state()
    assert not state.select()  # nobody in poll: no poke owed
    assert state.driver_take(0.0, selector=True) == (DriverTurn.READ, None)
    assert state.driver_keeps(read=False)  # nothing to hand over, nobody wants it
    assert not state.driver_keeps(read=True)  # a message for the inbox
    state.want(0.0, FAR, False, state.take_ticket())
    assert not state.driver_keeps(read=False)  # an op asked for the stream
    assert state.unselect(holding=True, now=0.0) == Wakes(True, True)
    assert state.lease is Lease.IDLE and not state.selected
    state.select()
    state.fail(PeerLostError("gone"))
    assert state.driver_take(0.0, selector=True) == (DriverTurn.STOP, None)
    assert not state.selected  # a failed stream is nobody's to drive


def test_selecting_a_stream_the_receiver_thread_polls_owes_it_a_poke():
    state = _state()
    state.driver_take(0.0)
    assert state.select()


# -- receive ops ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setup", "now", "expected", "lease"),
    [
        ("message queued", 1.0, (Turn.SERVE, False), Lease.IDLE),
        ("failed", 1.0, (Turn.FAIL, False), Lease.IDLE),
        ("failed, message queued", 1.0, (Turn.SERVE, False), Lease.IDLE),  # it still gets it
        ("idle", 1.0, (Turn.READ, False), Lease.CALLER),  # the fast path: it reads itself
        ("driver polls", 1.0, (Turn.ASK, True), Lease.DRIVER),
        ("driver polls, asked", 1.0, (Turn.WAIT, True), Lease.DRIVER),
        ("stalled", 1.0, (Turn.WAIT, False), Lease.STALLED),
        ("not its turn", 1.0, (Turn.WAIT, False), Lease.IDLE),
        ("idle", 5.0, (Turn.TIMEOUT, False), Lease.IDLE),  # deadline 5.0
        ("message queued", 5.0, (Turn.SERVE, False), Lease.IDLE),  # there in time
    ],
)
def test_a_receive_op_asks_what_to_do(setup, now, expected, lease):
    state = _state()
    first = state.take_ticket()
    ticket = state.take_ticket() if setup == "not its turn" else first
    asked = setup.endswith("asked")
    if setup.startswith("message queued") or setup == "failed, message queued":
        state.inbox.put(_msg())
    if setup.startswith("failed"):
        state.fail(CommError("broken"))
    if setup.startswith("driver polls"):
        state.driver_take(0.0)
    if setup == "stalled":
        state.leave(_msg(deferred=True), 0.0, by_caller=False)
        state.served(first, consumed=True, now=0.0)
        ticket = state.take_ticket()
    assert state.want(now, 5.0, asked, ticket) == expected
    assert state.lease is lease
    assert state.wanting == (1 if expected == (Turn.ASK, True) else 0)


@pytest.mark.parametrize(
    ("deferred", "consumed", "lease", "queued"),
    [
        (False, True, Lease.IDLE, 0),  # read and taken: never queued
        (True, True, Lease.STALLED, 0),  # its payload follows: the stream stalls on it
        (False, False, Lease.IDLE, 1),  # refused to be taken: queued for the next op
    ],
)
def test_a_receive_op_served_its_own_message(deferred, consumed, lease, queued):
    state = _state()
    ticket = state.take_ticket()
    assert state.want(10.0, FAR, False, ticket) == (Turn.READ, False)
    assert state.lease is Lease.CALLER
    assert state.served_own(_msg(deferred=deferred), ticket, consumed, now=10.0) == Wakes(True, False)
    assert state.lease is lease and len(state.inbox) == queued
    nxt = state.take_ticket()  # the next op's turn has come
    assert state.want(10.0, FAR, False, nxt)[0] is (Turn.SERVE if queued else
                                                    Turn.WAIT if deferred else Turn.READ)
    if not deferred and not queued:  # the driver keeps off for the linger time
        state.leave(None, 10.0, by_caller=True)
        assert state.driver_take(10.0 + LINGER / 2)[0] is DriverTurn.LATER


def test_receive_ops_are_served_in_ticket_order_and_skip_abandoned_ones():
    state = _state()
    t0, t1, t2 = (state.take_ticket() for _ in range(3))
    state.inbox.put(_msg())
    assert state.want(0.0, FAR, False, t1) == (Turn.WAIT, False)
    assert state.release_ticket(t0)  # t0 gave up before its turn
    assert not state.release_ticket(t0)  # idempotent
    assert state.want(0.0, FAR, False, t1) == (Turn.SERVE, False)
    assert state.served(t1, consumed=True, now=0.0) == Wakes(True, False)
    assert state.want(0.0, FAR, False, t2)[0] is Turn.READ  # its turn, inbox empty
    state.leave(None, 0.0, by_caller=True)
    state.failed_op(t2)  # it raised in its turn: the next one's turn begins
    t3 = state.take_ticket()
    state.inbox.put(_msg())
    assert state.want(0.0, FAR, False, t3) == (Turn.SERVE, False)


def test_an_op_that_raises_before_its_turn_is_skipped_later():
    state = _state()
    t0, t1 = state.take_ticket(), state.take_ticket()
    state.failed_op(t1)  # not its turn yet: abandoned
    state.inbox.put(_msg())
    state.served(t0, consumed=True, now=0.0)
    t2 = state.take_ticket()
    state.inbox.put(_msg())
    assert state.want(0.0, FAR, False, t2) == (Turn.SERVE, False)


def test_taking_a_message_below_the_cap_wakes_the_driver():
    state = _state(max_unread=15)
    ticket = state.take_ticket()
    state.inbox.put(_msg(10))
    state.inbox.put(_msg(10))
    assert state.inbox.full
    assert state.served(ticket, consumed=True, now=0.0) == Wakes(True, True)
    assert state.served(state.take_ticket(), consumed=False, now=0.0) == Wakes(True, False)


# -- leaving, stalls, claimants ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("holder", "msg", "lease", "wakes"),
    [
        (Lease.DRIVER, None, Lease.IDLE, Wakes(True, False)),
        (Lease.DRIVER, "plain", Lease.IDLE, Wakes(True, False)),
        (Lease.CALLER, "deferred", Lease.STALLED, Wakes(True, False)),
        (Lease.CLAIMANT, None, Lease.IDLE, Wakes(True, False)),  # pollable: no wake owed
    ],
)
def test_the_holder_leaves_the_stream(holder, msg, lease, wakes):
    state = _state()
    state.lease = holder
    got = None if msg is None else _msg(deferred=msg == "deferred")
    assert state.leave(got, 3.0, by_caller=holder is not Lease.DRIVER) == wakes
    assert state.lease is lease
    assert len(state.inbox) == (0 if msg is None else 1)


def test_only_a_stalled_stream_can_be_claimed():
    state = _state()
    with pytest.raises(RuntimeError, match="not stalled"):
        state.claim_stall()
    state.leave(_msg(deferred=True), 0.0, by_caller=False)
    state.claim_stall()
    assert state.lease is Lease.CLAIMANT


# -- pumps, listeners, failure ------------------------------------------------------------------


def test_a_pump_reads_as_the_caller_and_hands_the_stream_back():
    state = _state()
    state.listen()
    assert state.want(0.0, FAR, False, pumper=7) == (Turn.READ, False)
    assert state.pumper == 7 and state.lease is Lease.CALLER
    state.leave(None, 1.0, by_caller=True)
    assert state.pumper is None
    assert state.driver_take(1.0)[0] is DriverTurn.LATER  # lingering
    assert state.hand_back() == Wakes(False, True)
    assert state.driver_take(1.0) == (DriverTurn.READ, None)
    assert state.want(2.0, 1.5, False, pumper=7) == (Turn.TIMEOUT, False)


def test_a_stream_in_use_cannot_be_listened():
    state = _state()
    state.take_ticket()
    with pytest.raises(RuntimeError, match="already in use"):
        state.listen()
    state = _state()
    state.listen()
    with pytest.raises(RuntimeError, match="already in use"):
        state.listen()


def test_the_first_error_stays_and_repr_shows_the_state():
    state = _state()
    first, second = PeerLostError("gone"), CommError("later")
    assert state.fail(first) and not state.fail(second)
    assert state.error is first
    state.inbox.put(_msg(7))
    text = repr(state)
    assert "idle" in text and "failed" in text and "inbox=1/7B" in text


# -- a message's kind, decided once ---------------------------------------------------------------


def _header(kind=Kind.TENSOR, device="cpu", nbytes=40, inline=0) -> MessageHeader:
    return MessageHeader(kind, [TensorMeta("uint8", (nbytes,), device)], inline=inline)


@pytest.mark.parametrize(
    ("header", "inline", "offer", "payload", "device"),
    [
        (_header(nbytes=4, inline=4), b"abcd", b"", Payload.INLINE, False),
        (MessageHeader(Kind.TENSOR_LIST, []), b"", b"", Payload.INLINE, False),
        (_header(), b"", b"", Payload.READ, False),  # a CPU payload follows: read now
        (_header(Kind.RAW), b"", b"", Payload.IN_STREAM, False),  # send_tensor: for its op
        (_header(device="cuda"), b"", b"", Payload.IN_STREAM, True),  # NCCL, or an offer behind
        (_header(Kind.RAW, "cuda"), b"", b"\x93offer", Payload.OFFERED, True),
    ],
)
def test_where_a_received_payload_is(header, inline, offer, payload, device):
    msg = classify(header, inline, offer, "peer:0")
    assert (msg.payload, msg.device) == (payload, device)
    assert msg.deferred == (payload is Payload.IN_STREAM)
    assert msg.nbytes == len(inline) + len(offer)


@pytest.mark.parametrize(
    ("header", "inline", "offer", "text"),
    [
        (_header(nbytes=1 << 40), b"", b"", "over this worker's limit"),
        (_header(), b"", b"\x93offer", "device offer but no CUDA tensors"),
        (_header(nbytes=4, inline=4), b"abc", b"", "carries 4 inline"),
        (_header(nbytes=4, inline=3), b"abc", b"", "declares 4 bytes"),
    ],
)
def test_a_message_that_does_not_check_out_is_refused_before_anything_is_allocated(
    header, inline, offer, text
):
    with pytest.raises(ProtocolMismatchError, match=text):
        classify(header, inline, offer, "peer:0")


@pytest.mark.parametrize(
    ("header", "inline", "text"),
    [
        (_header(nbytes=1 << 40), b"", "over this worker's limit"),
        (_header(nbytes=4, inline=4), b"abc", "carries 4 inline"),
    ],
)
def test_a_broadcast_frame_is_checked_as_a_message_is(header, inline, text):
    """The Gloo route of a broadcast reads a payload through the same check as a
    connection: refused before its group is made or anything is allocated."""
    from rlcomm.comm.broadcast.gloo import GlooBroadcast

    def no_store():
        raise AssertionError("the group was made for a refused broadcast")

    gloo = GlooBroadcast(no_store, rank=1, size=2, label="group bc")
    with pytest.raises(ProtocolMismatchError, match=text) as info:
        gloo.recv_payload(header, inline, 0, timeout=5)
    assert "a broadcast from rank 0 of group bc" in str(info.value)
    assert "nothing of its payload was read" in str(info.value)
