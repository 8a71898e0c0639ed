"""The pure parts of a channel worker's replies: message sizes, the read window, the
outbox's hand-off to a client's own thread."""

from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass

import pytest
import torch

from rlcomm.channel import outbox as outbox_module
from rlcomm.channel import protocol as P
from rlcomm.channel.outbox import Outbox
from rlcomm.channel.payload import encode_item
from rlcomm.channel.replies import ReadWindow, message_bytes
from rlcomm.comm import framing
from rlcomm.comm.endpoint import encode_message
from tests.waiting import wait_for

RECORD = 16  # a ring record (kind, segment id, size) before each frame and payload tensor


@dataclass
class Step:
    obs: torch.Tensor
    reward: float
    note: str


def _ring_bytes(header, tensors) -> int:
    """The bytes a message takes in a shared-memory ring (every payload through the ring)."""
    frame, payload = framing.pack(header, list(tensors))
    return RECORD + len(frame) + sum(RECORD + t.numel() for t in payload)


ITEMS = [
    None, 3, 2.5, b"x" * 1024, "é" * 300, bytes(100_000),
    torch.ones(3), torch.arange(1 << 18, dtype=torch.float32), torch.zeros(0),
    (7, torch.full((1 << 18,), 7.0)), {"obs": torch.randn(4, 4), "ids": [1, 2, 3]},
    Step(torch.ones(8), 1.0, "done"), [Step(torch.ones(2), float(i), "x" * i) for i in range(50)],
    [bytes([i]) * 1024 for i in range(100)], [("k", i, None) for i in range(200)], 10**400,
]


@pytest.mark.parametrize("item", ITEMS, ids=lambda x: type(x).__name__)
def test_message_bytes_covers_what_a_reply_takes_in_the_ring(item):
    payload, item_tensors = encode_item(item)
    replies = [P.Got(5, [payload], [1.0]), P.Got(6, [payload], [1.0]), P.Done(7)]
    header, tensors = encode_message(P.encode(P.WorkerFrame(replies)), item_tensors * 2)
    actual = _ring_bytes(header, tensors)
    assert actual <= message_bytes(header, tensors) <= 1.05 * actual + 1024 + 32 * len(tensors)


def test_the_read_window_counts_what_the_client_did_not_read():
    window = ReadWindow(max_bytes=1000, max_messages=3)
    assert window.admits(1000) and not window.admits(1001)
    window.sent(600)
    assert window.admits(400) and not window.admits(401)
    window.sent(100)
    window.sent(100)
    assert window.unread == (3, 800)
    assert not window.admits(1)  # three messages unread: the message cap
    window.read(1)  # the client read the first message
    assert window.unread == (2, 200) and window.admits(800)
    window.read(1)  # an old report changes nothing
    assert window.unread == (2, 200)
    window.read(3)
    assert window.unread == (0, 0)
    window.read(9)  # more than was recorded: nothing left, nothing negative
    assert window.unread == (0, 0)


def test_an_outbox_hands_what_may_not_go_inline_to_its_own_thread_in_order():
    sent: list[tuple[str, list[int]]] = []
    failed: list[tuple[list[int], str]] = []
    executor = concurrent.futures.ThreadPoolExecutor(1, "test-reply")
    release = threading.Event()
    entered = threading.Event()
    may_inline = {"yes": True}

    def send(batch: list[int]) -> None:
        name = threading.current_thread().name
        if name.startswith("test-reply"):
            entered.set()
            assert release.wait(10)
        sent.append((name, list(batch)))

    outbox = Outbox(send, lambda batch, exc: failed.append((batch, str(exc))), executor,
                    lambda batch: may_inline["yes"])
    try:
        outbox.post([0, 1])
        assert sent == [(threading.current_thread().name, [0, 1])]  # inline, on this thread
        may_inline["yes"] = False
        outbox.post([2])  # handed off: the reply thread waits for `release`
        may_inline["yes"] = True
        outbox.post([3])  # queued behind [2], even though it may go inline
        outbox.post([4, 5])
        assert outbox.pending == 4 and len(sent) == 1
        release.set()
        pause = threading.Event()
        for _ in range(200):
            if outbox.pending == 0:
                break
            pause.wait(0.05)
        assert [x for _, batch in sent for x in batch] == [0, 1, 2, 3, 4, 5]
        assert all(name.startswith("test-reply") for name, _ in sent[1:])
        outbox.post([6])  # the thread is done: inline again
        assert sent[-1] == (threading.current_thread().name, [6])

        may_inline["yes"] = False
        release.clear()
        entered.clear()
        outbox.post([7])
        assert entered.wait(10)  # the reply thread is sending [7]
        outbox.post([8])
        outbox.close(RuntimeError("gone"))
        outbox.post([9])
        release.set()
        executor.shutdown(wait=True)
        # [7] was being sent when it closed; [8] was queued and [9] came after: both failed.
        assert sent[-1][1] == [7]
        assert failed == [([8], "gone"), ([9], "gone")]
        assert outbox.pending == 0
    finally:
        release.set()
        executor.shutdown(wait=False)


def test_held_entries_wait_for_company_and_leave_within_the_hold_time(monkeypatch):
    # The hold timers run on a pool of this test's: shutting it down waits for them.
    timers = concurrent.futures.ThreadPoolExecutor(1, "test-hold-timer")
    monkeypatch.setattr(outbox_module, "_flush_pool", lambda: timers)
    sent: list[list[int]] = []
    outbox = Outbox(lambda batch: sent.append(list(batch)), lambda batch, exc: None)
    n = outbox_module.HOLD_ENTRIES
    # The timer thread is busy until the gate opens: the held entries' timer (200 us)
    # cannot fire before the check below, however loaded the machine.
    gate = threading.Event()
    timers.submit(gate.wait, 10)
    outbox.post(list(range(n - 1)), hold=True)  # fewer than HOLD_ENTRIES: nothing sent yet
    assert sent == [] and outbox.pending == n - 1
    gate.set()
    wait_for(lambda: sent, "the timer sends the held entries", 10)
    assert sent == [list(range(n - 1))]

    sent.clear()
    gate = threading.Event()  # again, the timers wait until the checks are done
    timers.submit(gate.wait, 10)
    for i in range(n):  # the HOLD_ENTRIES-th holding post sends them all, from its thread
        outbox.post([i], hold=True)
    assert sent == [list(range(n))]
    outbox.post([100], hold=True)
    outbox.post([101])  # a post that sends takes the held ones with it, first
    assert sent[-1] == [100, 101] and outbox.pending == 0
    gate.set()
    timers.shutdown(wait=True)  # the timers armed meanwhile ran, and found nothing
    assert len(sent) == 2
