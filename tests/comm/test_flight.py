"""The flight recorder and the words of a status report, in this process: pure parts."""

from __future__ import annotations

import concurrent.futures
import os
import threading

import torch

from rlcomm.comm import status
from rlcomm.comm.flight import FlightRecorder, size_of
from rlcomm.comm.status import JobStatus, op_text, peer_activity
from rlcomm.errors import CommTimeoutError, PeerLostError


def test_ops_under_way_and_the_ring_of_the_last_ones():
    rec = FlightRecorder(4)
    first = rec.begin("recv", "rollout:3")
    keys = [rec.begin("send", f"trainer:{i}", 16) for i in range(6)]
    for k in keys:
        rec.end(k)
    # The recv is under way: kept although the ring moved on past it.
    assert [op.op for op in rec.under_way()] == ["recv"]
    ended = rec.recent()
    assert [op.peer for op in ended] == [f"trainer:{i}" for i in range(2, 6)]  # the last 4
    assert all(op.error is None and op.nbytes == 16 and op.ended >= op.began for op in ended)
    assert rec.find(first).peer == "rollout:3" and rec.find(keys[0]) is None  # overwritten
    rec.end(first, CommTimeoutError("nothing arrived"))
    assert rec.under_way() == [] and rec.find(first) is None  # its slot was reused


def test_a_failed_op_keeps_the_name_of_its_error():
    rec = FlightRecorder(8)
    k = rec.begin("recv", "b:0")
    rec.end(k, CommTimeoutError("nothing arrived"))
    assert [(op.op, op.error) for op in rec.recent()] == [("recv", "CommTimeoutError")]


def test_a_send_records_its_header_and_shows_its_bytes():
    from rlcomm.comm import codec

    header, _ = codec.encode({"a": torch.ones(4), "b": torch.ones(2, dtype=torch.float64)})
    rec = FlightRecorder(8)
    rec.end(rec.begin("send", "p", header))
    assert rec.recent()[0].nbytes == 4 * 4 + 2 * 8
    assert size_of(7) == 7 and size_of(object()) == -1


def test_a_small_send_records_its_frame_and_shows_its_payload_bytes():
    from rlcomm.comm.framing import small_frame

    rec = FlightRecorder(8)
    rec.end(rec.begin("send", "p", small_frame(torch.ones(3))))
    rec.end(rec.begin("send", "p", small_frame(b"abcde")))
    assert [op.nbytes for op in rec.recent()] == [12, 5]


def test_an_async_op_ends_with_its_future():
    rec = FlightRecorder(8)
    fut: concurrent.futures.Future = concurrent.futures.Future()
    key = rec.begin("send", "x")
    fut.add_done_callback(lambda f: rec.end_future(key, f))
    fut.set_exception(PeerLostError("gone"))
    cancelled: concurrent.futures.Future = concurrent.futures.Future()
    other = rec.begin("recv", "y")
    cancelled.add_done_callback(lambda f: rec.end_future(other, f))
    cancelled.cancel()
    assert [(op.op, op.error) for op in rec.recent()] == [("send", "PeerLostError"),
                                                          ("recv", None)]


def test_threads_record_at_once_and_nothing_is_lost():
    rec = FlightRecorder(100_000)

    def work() -> None:
        for _ in range(5000):
            rec.end(rec.begin("send", "p"))

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(rec.recent()) == 40_000 and not rec.pending


def test_a_recorder_of_size_zero_keeps_only_ops_under_way():
    rec = FlightRecorder(0)
    k = rec.begin("send", "p")
    assert rec.under_way()[0].op == "send"
    rec.end(k)
    assert rec.recent() == [] and rec.under_way() == []


def test_what_a_report_says_in_words():
    assert op_text("send", "trainer:1") == "send to trainer:1"
    assert op_text("recv_tensor", "a:0") == "recv_tensor from a:0"
    assert op_text("channel get", "rollouts") == "channel get on rollouts"
    busy = {"pending": [{"op": "send", "peer": "trainer:1", "bytes": 4, "age_s": 40.2}]}
    assert peer_activity("rollout:3", busy) == "rollout:3 is in send to trainer:1 since 40 s"
    idle = {"pending": [], "recent": [{"op": "recv", "peer": "t:0", "bytes": -1, "ago_s": 3.25,
                                       "took_s": 0.1, "error": None}]}
    assert peer_activity("r:1", idle) == (
        "r:1 is in no rlcomm op (busy in its own code, or idle); its last op, recv from t:0, "
        "ended 3.2 s ago")
    assert peer_activity("r:1", {"pending": [], "recent": []}) == (
        "r:1 is in no rlcomm op and has made none yet")


def test_an_error_with_its_analysis_keeps_its_class_and_fields():
    exc = CommTimeoutError("recv from b:0: nothing arrived within 3s", peer="b:0", op="recv")
    new = status.with_analysis(exc, "analysis: a:0 is in recv from b:0 since 3.0 s")
    assert type(new) is CommTimeoutError and (new.peer, new.op) == ("b:0", "recv")
    assert str(new).endswith("\nanalysis: a:0 is in recv from b:0 since 3.0 s")
    assert status.has_analysis(new) and not status.has_analysis(exc)
    assert str(exc) == "recv from b:0: nothing arrived within 3s"  # the original is unchanged


def test_the_status_table_lists_who_did_not_answer():
    workers = [
        {"address": "t:0", "group": "t", "rank": "0", "kind": "worker", "state": "ok",
         "host": "10.0.0.1", "node_id": "abcdef0123", "pid": 11, "problem": "",
         "pending": [{"op": "recv", "peer": "r:3", "bytes": -1, "age_s": 41.0}],
         "recent": [], "channels": [],
         "process": {"connections": [{"peer": "r:3", "transport": "gloo", "state": "open",
                                      "unread_bytes": 0, "unread_messages": 0}]}},
        {"address": "r:3", "group": "r", "rank": "3", "kind": "worker",
         "state": "not answering", "host": "10.0.0.2", "node_id": "99", "pid": 12,
         "problem": "it did not answer within 1 s"},
    ]
    text = JobStatus(workers, 1.0).table()
    assert "2 processes, 1 answered" in text
    assert "NOT ANSWERING" in text and "it did not answer within 1 s" in text
    assert "recv from r:3 (41 s)" in text and "CONNECTIONS" in text and "gloo" in text
    assert JobStatus(workers, 1.0).to_dict()["workers"][1]["state"] == "not answering"


def test_a_forked_child_starts_with_an_empty_recorder():
    from rlcomm.comm.flight import RECORDER

    key = RECORDER.begin("recv", "parent's peer")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what it holds, and go
        os.write(w, f"{len(RECORDER.pending)} {len(RECORDER.recent())}".encode())
        os._exit(0)
    try:
        os.waitpid(pid, 0)
        assert os.read(r, 64) == b"0 0"
        assert key in RECORDER.pending  # the parent's own is untouched
    finally:
        RECORDER.end(key)
        os.close(r)
        os.close(w)
