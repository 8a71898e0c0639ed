"""A broadcast that streams in buckets to the members of one node: :class:`LocalStream`.

The source (or a node's relay) publishes the message's *opening* (its frame, whose
header says the bucket size) on the fan-out, and waits until every receiver answered
whether it takes the message (a receiver refuses one whose ``into=`` does not fit, or
that is over its ``RLCOMM_MAX_MESSAGE_BYTES``). If one refuses, nobody gets a bucket:
the others get a *stream note* naming who refused and why, and raise at once, as the
sender does. Else each bucket goes through at most two slots of the pool, so the source
fills bucket ``k + 1`` while the receivers copy bucket ``k`` out; a bucket's frame is
empty. A failure part-way (a receiver that stops reading, the source's own) sends the
others a stream note too.

A stream note is a frame: an empty message's header, then :data:`STREAM_NOTE`, the
member to blame, the reason (:data:`~rlcomm.comm.broadcast.chain.REASONS`, or
:data:`OVER_LIMIT`) and a few words of text.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Sequence

import torch

from rlcomm.comm import codec, framing
from rlcomm.comm.broadcast.chain import LOST, REFUSED, TIMEOUT
from rlcomm.comm.buckets import Bucket
from rlcomm.comm.transports.shm_fanout import OVER_LIMIT as LIMIT_VERDICT
from rlcomm.comm.transports.shm_fanout import TAKES, FanoutSource
from rlcomm.errors import (
    CapacityError,
    CommError,
    CommTimeoutError,
    PeerLostError,
    ProtocolMismatchError,
)

#: The opening of a stream note's offer part (a :data:`NOTE` and UTF-8 text follow).
STREAM_NOTE = b"\x00rlcomm-stream-note:"
NOTE = struct.Struct("<IB")
MAX_NOTE_TEXT = 1024
#: The culprit of a note that blames no member (the sender's own failure).
NOBODY = 0xFFFFFFFF
#: A note's reason beside the chain's: a member refused it over a limit it has.
OVER_LIMIT = 4


def note_frame(culprit: int, reason: int, text: str) -> bytes:
    """The frame of a stream note."""
    return (framing.pack(*codec.encode(None))[0] + STREAM_NOTE + NOTE.pack(culprit, reason)
            + text.encode()[:MAX_NOTE_TEXT])


def parse_note(offer: bytes, members: int) -> tuple[int, int, str] | None:
    """``(culprit, reason, text)`` of a stream note's offer part; None if malformed."""
    body = offer[len(STREAM_NOTE):]
    if len(body) < NOTE.size or len(body) > NOTE.size + MAX_NOTE_TEXT:
        return None
    culprit, reason = NOTE.unpack_from(body)
    if (culprit >= members and culprit != NOBODY) or reason not in (
            LOST, TIMEOUT, REFUSED, OVER_LIMIT):
        return None
    return culprit, reason, body[NOTE.size:].decode("utf-8", "replace")


class LocalStream:
    """One streamed message from this member to ``local`` members of its node.

    Args:
        source: this member's fan-out source (its receivers connected).
        local: the members it goes to.
        next_seq: gives the fan-out's next message number.
        name: names a member for errors.
        timeout: seconds each step (the verdicts, each bucket) may take.
        label: how errors name the broadcast.
    """

    def __init__(self, source: FanoutSource, local: Sequence[int], next_seq: Callable[[], int],
                 name: Callable[[int], str], timeout: float, label: str):
        self._source = source
        self.takers = list(local)
        self._next_seq = next_seq
        self._name = name
        self._timeout = timeout
        self._label = label
        self.failures: dict[int, Exception] = {}
        #: What came with each receiver's ``TAKES`` (its need, from a relay's node-mate).
        self.bodies: dict[int, bytes] = {}

    def open(self, frame: bytes) -> None:
        """Publish the opening and wait for every receiver's verdict.

        Raises:
            ProtocolMismatchError: a receiver refused it (the others were told).
        """
        seq = self._next_seq()
        deadline = time.monotonic() + self._timeout
        self._fail(self._source.publish(seq, frame, [], deadline, only=self.takers))
        verdicts = self._source.verdicts(seq, self.takers, deadline)
        refused: dict[int, tuple[int, str]] = {}
        for member, verdict in verdicts.items():
            if verdict is None:
                gone = member in self._source.missing()
                self._fail({member: (PeerLostError if gone else CommTimeoutError)(
                    f"{self._label}: {self._name(member)} "
                    f"{'is gone' if gone else 'did not answer within the timeout'}",
                    peer=self._name(member), op="broadcast")})
            elif verdict[0] != TAKES:
                refused[member] = (verdict[0], verdict[1].decode("utf-8", "replace"))
            else:
                self.bodies[member] = verdict[1]
        if refused:
            first = min(refused)
            over = any(v == LIMIT_VERDICT for v, _ in refused.values())
            self.takers = [m for m in self.takers if m not in refused]  # they know
            self.abort(first, OVER_LIMIT if refused[first][0] == LIMIT_VERDICT else REFUSED,
                       refused[first][1])
            raise (CapacityError if over else ProtocolMismatchError)(
                f"{self._label}: nothing was sent: " + "; ".join(
                    f"{self._name(m)} refused it: {why}"
                    for m, (_, why) in sorted(refused.items())),
                peer=self._name(first), op="broadcast")

    def send(self, bucket: Bucket, pieces: Sequence[torch.Tensor], bucket_bytes: int) -> None:
        """Hand one bucket (its pieces' uint8 bytes) to the receivers still taking it.

        Raises:
            CommTimeoutError: no slot came free within the timeout (the receivers were
                told).
        """
        if not self.takers:
            return
        deadline = time.monotonic() + self._timeout
        try:
            failures = self._source.publish(self._next_seq(), b"", pieces, deadline,
                                            only=self.takers, bucket=bucket_bytes)
        except CommTimeoutError as exc:
            held = list(getattr(exc, "holders", []))
            names = [self._name(m) for m in held]
            text = (f"bucket {bucket.index} found no free slot within {self._timeout}s: "
                    + (f"{', '.join(names)} still held the buckets before it (stopped, or "
                       "not reading)" if names else str(exc)))
            self.abort(held[0] if held else None, TIMEOUT, text)
            raise CommTimeoutError(f"{self._label}: {text}", op="broadcast",
                                   peer=names[0] if names else None) from exc
        self._fail(failures)

    def abort(self, culprit: int | None, reason: int, text: str) -> None:
        """Tell the receivers still taking it that it ends here (best effort)."""
        takers, self.takers = self.takers, []
        if not takers:
            return
        frame = note_frame(culprit if culprit is not None else NOBODY, reason, text)
        try:
            self._source.publish(self._next_seq(), frame, [], time.monotonic() + 1.0,
                                 only=takers)
        except CommError:  # they time out instead, naming the source
            pass

    def _fail(self, failures: dict[int, Exception]) -> None:
        for member, exc in failures.items():
            self.failures.setdefault(member, exc)
            if member in self.takers:
                self.takers.remove(member)


def reason_of(exc: BaseException) -> int:
    if isinstance(exc, PeerLostError):
        return LOST
    if isinstance(exc, CapacityError):
        return OVER_LIMIT
    return TIMEOUT if isinstance(exc, CommTimeoutError) else REFUSED


def verdict_of(exc: BaseException) -> int:
    """The verdict a receiver that refuses with ``exc`` gives."""
    from rlcomm.comm.transports.shm_fanout import REFUSES
    return LIMIT_VERDICT if isinstance(exc, CapacityError) else REFUSES
