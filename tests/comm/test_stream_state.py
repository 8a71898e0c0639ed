"""The read side's state machine (``StreamState``), as tables: no threads, no sockets,
``now`` passed in."""

from __future__ import annotations

import pytest

from rlcomm.comm.codec import Kind, MessageHeader, TensorMeta
from rlcomm.comm.connection.incoming import Incoming, Payload, classify
from rlcomm.comm.connection.stream import (
    LINGER,
    NOTHING,
    Action,
    Do,
    Lease,
    StreamState,
)
from rlcomm.errors import CommError, PeerLostError, ProtocolMismatchError

FAR = 1e9  # a deadline that never comes
TRANSPORT = object()  # the state machine holds the transport, never touches it
SELECTOR = object()
CALLERS = Action(callers=True)
EVERYONE = Action(callers=True, driver=True)


def _msg(nbytes: int = 10, deferred: bool = False) -> Incoming:
    header = MessageHeader(Kind.TENSOR, [TensorMeta("uint8", (nbytes,), "cpu")])
    msg = Incoming(header, b"", payload=Payload.IN_STREAM if deferred else Payload.READ)
    msg.nbytes = nbytes
    return msg


def _state(pollable: bool = True, max_unread: int = 100) -> StreamState:
    state = StreamState("peer:0", max_unread=max_unread)
    state.attach(TRANSPORT, pollable)
    return state


def _wait(until: float | None = None) -> Action:
    return Action(Do.WAIT, until=until)


# -- the driver --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setup", "now", "expected", "lease"),
    [
        # An idle stream is the driver's.
        ("idle", 10.0, Action(Do.READ), Lease.IDLE),
        # A receive op read last: the driver leaves it to ops for the linger time.
        ("caller read at 10", 10.0 + LINGER / 2, _wait(10.0 + LINGER / 2 + LINGER), Lease.IDLE),
        ("caller read at 10", 10.0 + LINGER, Action(Do.READ), Lease.IDLE),
        # A receive op was served from the inbox: the same (a caller receiving in a loop
        # reads on itself, rather than sharing each message with the driver's thread).
        ("op served at 10", 10.0 + LINGER / 2, _wait(10.0 + LINGER / 2 + LINGER), Lease.IDLE),
        ("op served at 10", 10.0 + LINGER, Action(Do.READ), Lease.IDLE),
        # ... unless receive ops wait behind it (async ones): the driver reads ahead.
        ("op served at 10, one waits", 10.0 + LINGER / 2, Action(Do.READ), Lease.IDLE),
        # An op asked for the stream (and waits still): the driver waits.
        ("an op asked", 10.0, _wait(10.0 + LINGER), Lease.IDLE),
        # The inbox is at its cap: the driver stops reading.
        ("inbox full", 10.0, _wait(10.0 + LINGER), Lease.IDLE),
        # Somebody else holds it.
        ("stalled", 10.0, _wait(10.0 + LINGER), Lease.STALLED),
        # A selector drives it: the receiver thread waits until woken.
        ("selected", 10.0, _wait(), Lease.IDLE),
        ("failed", 10.0, Action(Do.STOP), Lease.IDLE),
    ],
)
def test_the_receiver_thread_takes_the_stream(setup, now, expected, lease):
    state = _state()
    if setup == "caller read at 10":
        assert state.want(10.0, FAR, state.take_ticket()).do is Do.READ
        state.leave(None, 10.0, by_caller=True)
    elif setup.startswith("op served at 10"):
        state.inbox.put(_msg())
        ticket = state.take_ticket()
        if setup.endswith("one waits"):
            state.take_ticket()
        assert state.want(10.0, FAR, ticket) == Action(Do.SERVE)
        state.served(ticket, consumed=True, now=10.0)
    elif setup == "an op asked":
        state.lease = Lease.DRIVER
        assert state.want(now, FAR, state.take_ticket()) == Action(Do.WAIT, poke=True)
        state.leave(None, now, by_caller=False)
    elif setup == "inbox full":
        state.inbox.put(_msg(100))
    elif setup == "stalled":
        state.leave(_msg(deferred=True), now, by_caller=False)
    elif setup == "selected":
        state.select(SELECTOR)
    elif setup == "failed":
        state.fail(PeerLostError("gone"))
    before = state.lease
    assert state.driver_take(now) == expected
    assert state.lease is (Lease.DRIVER if expected.do is Do.READ else before)
    assert before is lease


def test_an_unpollable_stream_has_no_linger_and_no_callers_reading():
    state = _state(pollable=False)
    ticket = state.take_ticket()
    assert state.want(0.0, FAR, ticket) == _wait()  # never READ
    assert state.driver_take(0.0).do is Do.READ
    state.leave(None, 0.0, by_caller=False)
    state.leave(_msg(deferred=True), 0.0, by_caller=False)
    assert state.driver_take(0.0) == _wait()  # stalled: wait to be woken
    state.claim_stall()
    # The stall ends: the receiver thread, blocked on its turn, must be woken.
    assert state.leave(None, 0.0, by_caller=True) == EVERYONE
    assert state.driver_take(0.0).do is Do.READ


def test_the_receiver_thread_closes_the_wake_pipe_unless_a_selector_polls_it():
    state = _state()
    assert state.receiver_ended() == Action(close_pipe=True)
    state.select(SELECTOR)
    assert state.receiver_ended() == NOTHING


# -- a selector -----------------------------------------------------------------------------------


def test_a_selector_takes_pollable_streams_and_lets_go_of_others():
    state = StreamState("p")
    state.select(SELECTOR)
    assert state.selector_take(SELECTOR, 0.0) == _wait()  # not attached
    assert state.attach(TRANSPORT, pollable=False) == Action(driver=True)  # the selector looks
    # Its receiver thread is woken to drive it.
    assert state.selector_take(SELECTOR, 0.0) == Action(Do.LET_GO, driver=True)
    assert state.selector is None
    assert state.selector_take(SELECTOR, 0.0).do is Do.STOP  # no longer its stream
    state = _state()
    assert state.select(SELECTOR) == Action(driver=True)  # nobody in poll: no poke owed
    assert state.selector_take(object(), 0.0).do is Do.STOP  # another selector's
    assert state.selector_take(SELECTOR, 0.0).do is Do.READ
    # Nothing to hand over, nobody wants it: it keeps the stream.
    assert state.selector_served(None, 0.0).do is Do.READ
    assert state.lease is Lease.DRIVER
    assert state.want(0.0, FAR, state.take_ticket()).poke  # an op asks for the stream
    assert state.selector_served(None, 0.0) == CALLERS  # it leaves
    assert state.lease is Lease.IDLE
    assert state.selector_take(SELECTOR, 0.0) == _wait(LINGER)  # the op waits for it
    assert state.unselect(object(), holding=False, now=0.0) == NOTHING  # not its stream
    assert state.unselect(SELECTOR, holding=False, now=0.0) == Action(driver=True)
    assert state.lease is Lease.IDLE and state.selector is None
    state.select(SELECTOR)
    state.fail(PeerLostError("gone"))
    # A failed stream is nobody's to drive: the selector, polling the wake pipe, closes it.
    assert state.selector_take(SELECTOR, 0.0) == Action(Do.STOP, close_pipe=True)
    assert state.selector is None


def test_a_selector_that_ends_holding_the_stream_leaves_it():
    state = _state()
    state.select(SELECTOR)
    assert state.selector_take(SELECTOR, 0.0).do is Do.READ
    assert state.selector_served(_msg(), 0.0) == CALLERS  # a message for the inbox: it leaves
    assert state.selector_take(SELECTOR, 0.0).do is Do.READ
    assert state.unselect(SELECTOR, holding=True, now=0.0) == EVERYONE
    assert state.lease is Lease.IDLE
    state.select(SELECTOR)
    state.fail(PeerLostError("gone"))
    assert state.unselect(SELECTOR, holding=False, now=0.0) == Action(driver=True, close_pipe=True)


def test_selecting_a_stream_the_receiver_thread_polls_owes_it_a_poke():
    state = _state()
    state.driver_take(0.0)
    assert state.select(SELECTOR) == Action(driver=True, poke=True)


# -- receive ops ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setup", "now", "expected", "lease"),
    [
        ("message queued", 1.0, Action(Do.SERVE), Lease.IDLE),
        ("failed", 1.0, Action(Do.FAIL), Lease.IDLE),
        ("failed, message queued", 1.0, Action(Do.SERVE), Lease.IDLE),  # it still gets it
        ("idle", 1.0, Action(Do.READ), Lease.CALLER),  # the fast path: it reads itself
        ("driver polls", 1.0, Action(Do.WAIT, poke=True), Lease.DRIVER),  # it asks
        ("driver polls, asked", 1.0, _wait(), Lease.DRIVER),  # once
        ("stalled", 1.0, _wait(), Lease.STALLED),
        ("not its turn", 1.0, _wait(), Lease.IDLE),
        ("idle", 5.0, Action(Do.TIMEOUT), Lease.IDLE),  # deadline 5.0
        ("message queued", 5.0, Action(Do.SERVE), Lease.IDLE),  # there in time
    ],
)
def test_a_receive_op_asks_what_to_do(setup, now, expected, lease):
    state = _state()
    first = state.take_ticket()
    ticket = state.take_ticket() if setup == "not its turn" else first
    if setup.startswith("message queued") or setup == "failed, message queued":
        state.inbox.put(_msg())
    if setup.startswith("failed"):
        state.fail(CommError("broken"))
    if setup.startswith("driver polls"):
        state.driver_take(0.0)
    if setup.endswith("asked"):
        assert state.want(now, 5.0, ticket).poke
    if setup == "stalled":
        state.leave(_msg(deferred=True), 0.0, by_caller=False)
        state.served(first, consumed=True, now=0.0)
        ticket = state.take_ticket()
    assert state.want(now, 5.0, ticket) == expected
    assert state.lease is lease
    assert state.wanting == (1 if setup.startswith("driver polls") else 0)


def test_an_ask_stands_until_its_op_ends():
    state = _state()
    t0, t1 = state.take_ticket(), state.take_ticket()
    state.driver_take(0.0)
    assert state.want(0.0, FAR, t0).poke
    assert state.want(0.0, FAR, pumper=9).poke  # a pump asks too
    assert state.wanting == 2
    state.leave(None, 0.0, by_caller=False)
    assert state.driver_take(1.0) == _wait(1.0 + LINGER)  # they still wait for it
    state.pump_done(9, hand_back=False)
    state.inbox.put(_msg())
    assert state.want(1.0, FAR, t0).do is Do.SERVE
    state.served(t0, consumed=True, now=1.0)
    assert state.wanting == 0
    state.driver_take(1.0)
    assert state.want(1.0, FAR, t1).poke
    state.failed_op(t1)  # an op that raised asks no more
    assert state.wanting == 0


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
    assert state.want(10.0, FAR, ticket) == Action(Do.READ)
    assert state.lease is Lease.CALLER
    assert state.served_own(_msg(deferred=deferred), ticket, consumed, now=10.0) == CALLERS
    assert state.lease is lease and len(state.inbox) == queued
    nxt = state.take_ticket()  # the next op's turn has come
    assert state.want(10.0, FAR, nxt).do is (Do.SERVE if queued else
                                             Do.WAIT if deferred else Do.READ)
    if not deferred and not queued:  # the driver keeps off for the linger time
        state.leave(None, 10.0, by_caller=True)
        assert state.driver_take(10.0 + LINGER / 2).do is Do.WAIT


def test_receive_ops_are_served_in_ticket_order_and_skip_abandoned_ones():
    state = _state()
    t0, t1, t2 = (state.take_ticket() for _ in range(3))
    state.inbox.put(_msg())
    assert state.want(0.0, FAR, t1) == _wait()
    assert state.release_ticket(t0) == CALLERS  # t0 gave up before its turn: t1's turn
    assert state.release_ticket(t0) == NOTHING  # idempotent
    assert state.want(0.0, FAR, t1) == Action(Do.SERVE)
    assert state.served(t1, consumed=True, now=0.0) == CALLERS
    assert state.want(0.0, FAR, t2).do is Do.READ  # its turn, inbox empty
    state.leave(None, 0.0, by_caller=True)
    assert state.failed_op(t2) == CALLERS  # it raised in its turn: the next one's turn begins
    t3 = state.take_ticket()
    state.inbox.put(_msg())
    assert state.want(0.0, FAR, t3) == Action(Do.SERVE)


def test_an_op_that_raises_before_its_turn_is_skipped_later():
    state = _state()
    t0, t1 = state.take_ticket(), state.take_ticket()
    state.failed_op(t1)  # not its turn yet: abandoned
    state.inbox.put(_msg())
    state.served(t0, consumed=True, now=0.0)
    t2 = state.take_ticket()
    state.inbox.put(_msg())
    assert state.want(0.0, FAR, t2) == Action(Do.SERVE)


def test_taking_a_message_below_the_cap_wakes_the_driver():
    state = _state(max_unread=15)
    ticket = state.take_ticket()
    state.inbox.put(_msg(10))
    state.inbox.put(_msg(10))
    assert state.inbox.full
    assert state.served(ticket, consumed=True, now=0.0) == EVERYONE
    assert state.served(state.take_ticket(), consumed=False, now=0.0) == CALLERS


def test_an_offer_taken_in_is_counted_against_the_cap():
    state = _state(max_unread=15)
    msg = Incoming(MessageHeader(Kind.TENSOR, [TensorMeta("uint8", (12,), "cuda:0")]), b"",
                   b"offer", payload=Payload.OFFERED, device=True)
    state.leave(msg, 0.0, by_caller=False)
    assert state.inbox.unread == 5 and not state.inbox.full
    tensors: list = []
    assert state.took_in(msg, tensors, 12) == NOTHING
    assert msg.payload is Payload.TAKEN and msg.tensors is tensors and msg.offer == b""
    assert state.inbox.unread == 17 and state.inbox.full  # the driver stops reading
    assert state.driver_take(0.0).do is Do.WAIT


# -- leaving, stalls, claimants ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("holder", "msg", "lease", "action"),
    [
        (Lease.DRIVER, None, Lease.IDLE, CALLERS),
        (Lease.DRIVER, "plain", Lease.IDLE, CALLERS),
        (Lease.CALLER, "deferred", Lease.STALLED, CALLERS),
        (Lease.CLAIMANT, None, Lease.IDLE, CALLERS),  # pollable: no wake owed the driver
    ],
)
def test_the_holder_leaves_the_stream(holder, msg, lease, action):
    state = _state()
    state.lease = holder
    got = None if msg is None else _msg(deferred=msg == "deferred")
    assert state.leave(got, 3.0, by_caller=holder is not Lease.DRIVER) == action
    assert state.lease is lease
    assert len(state.inbox) == (0 if msg is None else 1)


def test_only_a_stalled_stream_can_be_claimed():
    state = _state()
    with pytest.raises(RuntimeError, match="not stalled"):
        state.claim_stall()
    state.leave(_msg(deferred=True), 0.0, by_caller=False)
    assert state.claim_stall() == NOTHING
    assert state.lease is Lease.CLAIMANT


# -- pumps, listeners, failure ------------------------------------------------------------------


def test_a_pump_reads_as_the_caller_and_hands_the_stream_back():
    state = _state()
    assert state.listen(object()) == NOTHING
    assert state.want(0.0, FAR, pumper=7) == Action(Do.READ)
    assert state.pumper == 7 and state.lease is Lease.CALLER
    # Its future got done on another thread: poked out of its poll.
    assert state.wake_pumper(7) == Action(callers=True, poke=True)
    assert state.wake_pumper(8) == CALLERS  # not the one reading
    state.leave(None, 1.0, by_caller=True)
    assert state.pumper is None
    assert state.driver_take(1.0).do is Do.WAIT  # lingering
    assert state.pump_done(7, hand_back=False) == NOTHING  # other replies awaited
    assert state.driver_take(1.0).do is Do.WAIT
    assert state.pump_done(7, hand_back=True) == Action(driver=True)
    assert state.driver_take(1.0) == Action(Do.READ)
    assert state.want(2.0, 1.5, pumper=7) == Action(Do.TIMEOUT)


def test_a_stream_in_use_cannot_be_listened():
    state = _state()
    state.take_ticket()
    with pytest.raises(RuntimeError, match="already in use"):
        state.listen(object())
    state = _state()
    state.listen(object())
    with pytest.raises(RuntimeError, match="already in use"):
        state.listen(object())
    state = _state()
    state.fail(PeerLostError("gone"))
    assert state.listen(object()) == Action(Do.FAIL)  # the listener is told at once


def test_the_first_error_stays_and_repr_shows_the_state():
    unattached = StreamState("p")
    # Nobody will poll the wake pipe of a stream that never got a transport: it closes.
    assert unattached.fail(PeerLostError("gone")) == Action(
        Do.STOP, callers=True, driver=True, close_pipe=True)
    state = _state()
    first, second = PeerLostError("gone"), CommError("later")
    assert state.fail(first) == Action(Do.STOP, callers=True, driver=True)
    assert state.fail(second) == NOTHING
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
        (_header(nbytes=4, inline=4), b"abcd", b"\x93offer", "device offer but no CUDA tensors"),
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
