"""The pure parts of channels: the queue state machine and item-type checks."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal, Optional

import msgspec
import pytest
import torch

from rlcomm.channel import protocol as P
from rlcomm.channel.itemtype import check_item, describe_type, validate_type
from rlcomm.channel.payload import decode_item, encode_item, split_tensors
from rlcomm.channel.routing import HomeTable, RouteCache
from rlcomm.channel.state import ChannelState

PUT, PUT_NOWAIT, GET, GET_NOWAIT, GET_BATCH, QSIZE, CLOSE, CANCEL, REQUEUE = range(9)


def make(op: int, rid: int, key, arg, timeout, item) -> P.Request:
    """The request struct of a test's ``(op, rid, key, arg, timeout)`` and item."""
    if op in (PUT, PUT_NOWAIT):
        return P.Put(rid, key, arg, timeout, item, nowait=op == PUT_NOWAIT)
    if op in (GET, GET_NOWAIT):
        return P.Get(rid, key, timeout, nowait=op == GET_NOWAIT)
    if op == GET_BATCH:
        return P.GetBatch(rid, key, arg, timeout)
    if op == QSIZE:
        return P.QSize(rid, key)
    if op == CLOSE:
        return P.Close(rid)
    if op == CANCEL:
        return P.Cancel(key, arg)
    return P.Requeue(key, item, arg)


class Harness:
    """Drives a ChannelState and collects the replies per request id."""

    def __init__(self, maxsize: int = 0):
        self.state = ChannelState("test", maxsize)
        self.rid = 0
        self.replies: dict[int, tuple] = {}
        self.now = 0.0
        self.ops: dict[int, int | None] = {}

    def req(self, op: int, key="k", arg=None, timeout=None, item=None, client="c") -> int:
        self.rid += 1
        self.ops[self.rid] = op
        out: list = []
        self.state.handle(client, make(op, self.rid, key, arg, timeout, item), self.now, out)
        self._collect(out)
        return self.rid

    def _collect(self, out: list) -> None:
        for d in out:
            assert d.rid not in self.replies, f"request {d.rid} answered twice"
            self.ops.setdefault(d.rid, None)
            value = d.value
            if d.key is not None and self.ops.get(d.rid) != GET_BATCH:
                value = value[0]  # a get's one item
            self.replies[d.rid] = (d.status, value, d.weights)

    def put(self, item, weight=1, key="k", nowait=False, timeout=None, client="c") -> int:
        return self.req(PUT_NOWAIT if nowait else PUT, key, weight, timeout, item, client)

    def expire(self, now: float) -> None:
        self.now = now
        out: list = []
        self.state.expire(now, out)
        self._collect(out)

    def status(self, rid: int):
        return self.replies.get(rid, (None,))[0]

    def item(self, rid: int):
        status, item, _ = self.replies[rid]
        assert status == P.OK, status
        return item


def test_fifo_and_nowait():
    h = Harness()
    for i in range(3):
        assert h.status(h.put(i)) == P.OK
    assert [h.item(h.req(GET)) for _ in range(2)] == [0, 1]
    assert h.item(h.req(GET_NOWAIT)) == 2
    assert h.status(h.req(GET_NOWAIT)) == P.EMPTY
    assert h.state.qsize("k") == 0
    assert h.status(h.req(QSIZE)) == P.OK


def test_keys_are_independent():
    h = Harness(maxsize=1)
    assert h.status(h.put("a", key="x")) == P.OK
    assert h.status(h.put("b", key="y")) == P.OK
    assert h.status(h.put("c", key="x", nowait=True)) == P.FULL
    assert h.item(h.req(GET, key="y")) == "b"


def test_backpressure_parks_puts_in_order():
    h = Harness(maxsize=2)
    first = [h.put(i) for i in range(2)]
    parked = [h.put(i) for i in range(2, 5)]
    assert all(h.status(r) == P.OK for r in first)
    assert all(h.status(r) is None for r in parked)
    # A nowait put does not jump the parked ones.
    assert h.status(h.put(99, nowait=True)) == P.FULL
    assert h.item(h.req(GET)) == 0
    assert h.status(parked[0]) == P.OK and h.status(parked[1]) is None
    assert [h.item(h.req(GET)) for _ in range(4)] == [1, 2, 3, 4]
    assert all(h.status(r) == P.OK for r in parked)


def test_get_parks_until_put():
    h = Harness()
    g = h.req(GET)
    assert h.status(g) is None
    h.put("x")
    assert h.item(g) == "x"


def test_get_batch_by_weight():
    h = Harness()
    g = h.req(GET_BATCH, arg=5)
    for i, w in enumerate([2, 2]):
        h.put(i, weight=w)
    assert h.status(g) is None
    h.put(2, weight=3)
    status, items, weights = h.replies[g]
    assert status == P.OK and items == [0, 1, 2] and weights == [2, 2, 3]
    # Items beyond the target stay queued.
    for i, w in enumerate([3, 3, 1]):
        h.put(i, weight=w)
    assert h.item(h.req(GET_BATCH, arg=4)) == [0, 1]
    assert h.state.qsize("k") == 1


def test_waiting_gets_are_served_in_arrival_order():
    h = Harness()
    big = h.req(GET_BATCH, arg=3)
    small = h.req(GET)
    h.put("a")
    assert h.status(big) is None and h.status(small) is None  # small waits behind big
    h.put("b", weight=2)
    assert h.item(big) == ["a", "b"]
    assert h.status(small) is None
    h.put("c")
    assert h.item(small) == "c"


def test_get_nowait_takes_what_is_there_even_behind_a_batch():
    h = Harness()
    big = h.req(GET_BATCH, arg=10)
    h.put("a")
    assert h.item(h.req(GET_NOWAIT)) == "a"
    assert h.status(big) is None


def test_full_key_gives_a_partial_batch():
    h = Harness(maxsize=3)
    for i in range(3):
        h.put(i, weight=1)
    parked = h.put(3, weight=1)
    assert h.item(h.req(GET_BATCH, arg=10)) == [0, 1, 2]
    assert h.status(parked) == P.OK


def test_close_semantics():
    h = Harness(maxsize=1)
    h.put("a")
    parked_put = h.put("b")
    h.req(GET)  # takes "a", admits "b"
    assert h.status(parked_put) == P.OK
    parked_put = h.put("c")
    h2 = h.req(CLOSE)
    assert h.status(h2) == P.OK
    assert h.status(parked_put) == P.CLOSED
    assert h.status(h.put("d")) == P.CLOSED
    assert h.item(h.req(GET)) == "b"  # drain
    assert h.status(h.req(GET)) == P.CLOSED
    assert h.status(h.req(GET_NOWAIT)) == P.CLOSED


def test_close_answers_waiting_batches_with_what_is_left():
    h = Harness()
    h.put("a", weight=1)
    batch = h.req(GET_BATCH, arg=5)
    other = h.req(GET, key="other")
    h.req(CLOSE)
    assert h.item(batch) == ["a"]
    assert h.status(other) == P.CLOSED
    assert h.status(h.req(GET_BATCH, arg=1)) == P.CLOSED


def test_deadlines():
    h = Harness(maxsize=1)
    g = h.req(GET, key="e", timeout=1.0)
    h.put("x")
    p = h.put("y", timeout=2.0)
    h.expire(0.5)
    assert h.status(g) is None and h.status(p) is None
    h.expire(1.0)
    assert h.status(g) == P.TIMEOUT and h.status(p) is None
    h.expire(5.0)
    assert h.status(p) == P.TIMEOUT
    assert h.state.qsize("k") == 1  # the timed-out put was not enqueued
    assert h.state.next_deadline() is None


def test_timed_out_head_lets_the_next_getter_through():
    h = Harness()
    big = h.req(GET_BATCH, arg=10, timeout=1.0)
    small = h.req(GET)
    h.put("a")
    h.expire(2.0)
    assert h.status(big) == P.TIMEOUT
    assert h.item(small) == "a"


def test_cancel_requeue_and_drop_client():
    h = Harness()
    g = h.req(GET, client="a")
    h.req(CANCEL, arg=g, client="a")
    assert h.status(g) == P.CANCELLED
    h.put("x")
    h.put("y")
    taken = h.item(h.req(GET))
    h.req(REQUEUE, arg=[1], item=[taken])
    assert h.item(h.req(GET)) == "x"
    gone = h.req(GET, key="z", client="dead")
    out: list = []
    h.state.drop_client("dead", out)
    assert out == []
    h.put("z", key="z")
    assert h.state.qsize("z") == 1 and h.status(gone) is None
    stats = h.state.stats()
    assert stats["keys"]["k"]["puts"] == 2 and stats["keys"]["k"]["gets"] == 1


def test_routing_tables():
    table = HomeTable()
    assert table.home("a", -1) == -1
    assert table.home("a", 1) == 1
    assert table.home("a", 0) == 1  # homes never move
    cache = RouteCache(["n0", "n1"], "n1")
    assert cache.local_rank == 1 and cache.get("a") is None
    cache.remember("a", 0)
    assert cache.get("a") == 0
    assert RouteCache(["n0"], "elsewhere").local_rank == 0


@dataclasses.dataclass
class Rollout:
    obs: torch.Tensor
    reward: float


class Step(msgspec.Struct):
    action: int


@pytest.mark.parametrize(
    "tp, ok, bad, fragment",
    [
        (int, 3, "3", "item is a str"),
        (float, 3, "x", "item is a str"),
        (torch.Tensor, torch.ones(2), [1.0], "item is a list"),
        (Rollout, Rollout(torch.ones(1), 1.0), {"obs": 1}, "item is a dict"),
        (Step, Step(1), (1,), "item is a tuple"),
        (list[Rollout], [Rollout(torch.ones(1), 0.0)], [Rollout(torch.ones(1), 0.0), 3],
         "item[1] is an int"),
        (dict[str, torch.Tensor], {"a": torch.ones(1)}, {"a": 1}, "item['a'] is an int"),
        (dict[str, int], {"a": 1}, {2: 1}, "key 2 of item is an int"),
        (int | None, None, 1.5, "item is a float"),
        (Optional[Step], Step(2), "s", "item is a str"),  # noqa: UP045 - the typing form
        (tuple[int, str], (1, "a"), (1, 2), "item[1] is an int"),
        (tuple[int, ...], (1, 2, 3), (1, "2"), "item[1] is a str"),
        (Literal["a", "b"], "a", "c", "item is 'c'"),
        (Annotated[int, "meta"], 1, "1", "item is a str"),
        (Any, object(), None, None),
    ],
)
def test_check_item(tp, ok, bad, fragment):
    validate_type(tp)
    assert check_item(ok, tp) is None
    if fragment is not None:
        problem = check_item(bad, tp)
        assert problem is not None and fragment in problem, problem


def test_describe_and_validate_type():
    assert describe_type(list[Rollout]) == "list[Rollout]"
    assert describe_type(dict[str, torch.Tensor]) == "dict[str, torch.Tensor]"
    assert describe_type(int | None) == "int | None"
    for bad in ("Rollout", 3, list["Rollout"]):
        with pytest.raises(TypeError, match="item_type"):
            validate_type(bad)


def test_frames_are_tagged_structs_and_items_opaque_payloads():
    rollout = Rollout(torch.arange(4.0), 1.0)
    big = torch.arange(1 << 16, dtype=torch.float32)
    items = [rollout, {"a": [torch.ones(2)], "b": 3}, big, b"x" * 10]
    encoded = [encode_item(item) for item in items]
    assert [len(t) for _, t in encoded] == [0, 0, 1, 0]  # only the large one travels apart
    reqs = [P.Put(i, "k", 1.0, None, p) for i, (p, _) in enumerate(encoded)]
    reqs += [P.Get(9, 3, 2.5, nowait=True), P.Cancel("k", 4), P.Route(10, "k", -1)]
    data = P.encode(P.ClientFrame(reqs, read=7))
    frame = P.decode_client_frame(data)
    assert frame.read == 7 and [type(r) for r in frame.requests] == [type(r) for r in reqs]
    assert [P.op_name(r) for r in frame.requests][-3:] == ["get_nowait", "cancel", "route"]
    tensors = [t for _, ts in encoded for t in ts]
    per_item = split_tensors(P.frame_payloads(frame), tensors)
    back = [decode_item(r.item, ts) for r, ts in zip(frame.requests[:4], per_item, strict=True)]
    assert torch.equal(back[0].obs, rollout.obs) and back[0].reward == 1.0
    assert back[1]["b"] == 3 and torch.equal(back[1]["a"][0], torch.ones(2))
    assert torch.equal(back[2], big) and back[3] == b"x" * 10
    replies = [P.Got(0, [encoded[3][0]], [1.0]), P.Done(1), P.Count(2, 5),
               P.Refused(3, P.ERROR, "boom")]
    again = P.decode_worker_frame(P.encode(P.WorkerFrame(replies))).replies
    assert again == replies and again[3].status is P.Status.ERROR
    with pytest.raises(msgspec.ValidationError):
        P.decode_client_frame(P.encode(P.WorkerFrame(replies)))
