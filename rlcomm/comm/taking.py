"""What a receive op takes of a message, and how: :class:`Taking`.

A receive (``recv``, or ``broadcast`` at a receiver) says where the tensors go
(``into=``: the caller's tensors, :class:`~rlcomm.comm.bucket_iter.Buckets` for an
iterator, or nothing for new ones) and what it takes of each tensor (``shards=``). The
same answer serves a message that came whole (:meth:`Taking.whole`) and one that
streams in buckets (:meth:`Taking.stream`, a :class:`Receipt` fed bucket by bucket by
the transport's driver). The checks a receiver makes before it takes anything (does
``into`` fit, is it over ``RLCOMM_MAX_MESSAGE_BYTES``) raise
:class:`~rlcomm.errors.ProtocolMismatchError` here, before a byte is copied.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlcomm.comm import codec
from rlcomm.comm.bucket_iter import BucketIterator, Buckets, Handoff
from rlcomm.comm.buckets import (
    Bucket,
    Landing,
    Piece,
    Shards,
    describe,
    names_of,
    selections,
    taken_meta,
)
from rlcomm.comm.codec import MessageHeader, TensorMeta
from rlcomm.comm.codec.header import dtype_name
from rlcomm.comm.options import max_message_bytes
from rlcomm.errors import CapacityError, CodecError, ProtocolMismatchError


class Taking:
    """What one receive op takes of the message it gets.

    Args:
        into: the caller's tensors (see :func:`codec.destinations`), a
            :class:`~rlcomm.comm.bucket_iter.Buckets`, or ``None`` (new tensors).
        shards: what it takes of each tensor (:data:`~rlcomm.comm.buckets.Shards`).
        what: how errors name the op (``"recv at a:0 from b:0"``).
        peer: the sender, for errors.
        timeout: the op's timeout (a streamed message's timeout bounds each bucket).
        op: the op's name for errors' ``op`` field.
    """

    def __init__(self, into: Any, shards: Shards | None, what: str, peer: Any,
                 timeout: float, op: str):
        self.into = into
        self.shards = shards
        self.what = what
        self.peer = peer
        self.timeout = timeout
        self.op = op
        #: Bytes read out of what arrived (of a sharded tensor, its slice), once taken.
        self.bytes_read = 0

    @property
    def iterates(self) -> bool:
        return isinstance(self.into, Buckets)

    @property
    def plain(self) -> bool:
        """Whether it takes the message as it came (no shards, no iterator)."""
        return self.shards is None and not self.iterates

    def _refuse(self, why: str, kind: type[ProtocolMismatchError] = ProtocolMismatchError
                ) -> ProtocolMismatchError:
        return kind(f"{self.what}: {why}", peer=self.peer, op=self.op)

    def landing(self, header: MessageHeader, device: torch.device | None = None,
                limit_whole: bool = True) -> Landing:
        """Where the message's tensors land, checked: ``into`` fits what is taken, and
        what this receive allocates stays under ``RLCOMM_MAX_MESSAGE_BYTES``
        (``limit_whole``: the whole taken message counts; else, bucket by bucket, the
        largest tensor).

        Raises:
            ProtocolMismatchError: it does not fit, or is over the limit.
        """
        try:
            sel = selections(header, self.shards)
        except CodecError as exc:
            raise self._refuse(str(exc)) from exc
        targets = None
        if self.into is not None and not self.iterates:
            targets = self._targets(header, sel)
        landing = Landing(header, sel, targets, device)
        limit = max_message_bytes()
        if targets is None:
            need = landing.taken_nbytes() if limit_whole else landing.largest_taken()
            if need > limit:
                whole = "the message" if limit_whole else "its largest tensor"
                raise self._refuse(
                    f"{whole} takes {describe(need)} ({need} bytes) here, over this worker's "
                    f"limit of {describe(limit)} (RLCOMM_MAX_MESSAGE_BYTES); receive it "
                    "into= existing tensors or as rlcomm.Buckets(), or raise the limit "
                    "(rlcomm.set_memory_limits)", CapacityError)
        return landing

    def _targets(self, header: MessageHeader, sel: Sequence[Any]) -> list[torch.Tensor]:
        """``into``'s tensors for the message as this receive takes it."""
        names = names_of(header)
        taken = [taken_meta(m, s, n) for m, s, n in zip(header.tensors, sel, names)]
        as_taken = MessageHeader(
            header.kind, [TensorMeta(dtype_name(d), shape, m.device)
                          for (shape, d), m in zip(taken, header.tensors)],
            header.structure)
        try:
            return codec.destinations(as_taken, self.into)
        except CodecError as exc:
            raise self._refuse(f"into the given tensors: {exc}") from exc

    # -- a message that came whole ---------------------------------------------------------

    def whole(self, header: MessageHeader, tensors: list[torch.Tensor]) -> Any:
        """The result of this receive for a message that came whole, as ``tensors``
        (typed, header order): the object, ``into`` filled, or an iterator.

        Raises:
            ProtocolMismatchError: as :meth:`landing` (before anything is copied).
        """
        if self.plain:
            if self.into is None:
                return codec.decode(header, tensors)
            targets = self._targets(header, [None] * len(tensors))
            for target, tensor in zip(targets, tensors, strict=True):
                if target is not tensor:
                    target.copy_(tensor)
            return self._with_piggyback(header, tensors)
        device = tensors[0].device if tensors else None
        if self.shards is None:  # an iterator over the tensors as they came
            pairs = list(zip(names_of(header), tensors, strict=True))
            self.bytes_read = sum(t.numel() * t.element_size() for t in tensors)
            return self._iterator_of([pairs])
        landing = self.landing(header, device, limit_whole=not self.iterates)
        for i, t in enumerate(tensors):
            if t.numel():
                landing.place(Piece(i, 0, t.numel() * t.element_size(), 0),
                              codec.as_bytes(t.contiguous()))
        self.bytes_read = landing.bytes_read
        return self.finish(header, landing, [list(zip(landing.names, landing.tensors()))])

    def finish(self, header: MessageHeader, landing: Landing,
               iterated: list[list[tuple[str, torch.Tensor]]] | None = None) -> Any:
        """The result once every piece landed (``iterated``: the pairs an iterator
        yields, for one that has not been made yet)."""
        if self.iterates:
            return self._iterator_of(iterated or [])
        tensors = landing.tensors()
        if self.into is not None:
            return self._with_piggyback(header, tensors)
        return codec.decode(header, tensors)

    def _with_piggyback(self, header: MessageHeader, tensors: list[torch.Tensor]) -> Any:
        if header.piggyback is not None:
            return self.into, codec.decode(header, tensors)[1]
        return self.into

    def _iterator_of(self, buckets: list[list[tuple[str, torch.Tensor]]]) -> BucketIterator:
        handoff = Handoff(self.what, self.timeout)
        iterator = BucketIterator(handoff, self.into.transform)
        for pairs in buckets:  # a message that came whole: one bucket
            handoff.put(pairs)
            break
        handoff.end()
        return iterator

    # -- a message that streams -------------------------------------------------------------

    def stream(self, header: MessageHeader) -> Receipt:
        """A receipt for a message that streams in buckets (checked as :meth:`landing`).

        Raises:
            ProtocolMismatchError: it does not fit, or is over the limit.
        """
        landing = self.landing(header, limit_whole=not self.iterates)
        handoff = Handoff(self.what, self.timeout) if self.iterates else None
        return Receipt(self, header, landing, handoff)


class Receipt:
    """A streamed message being taken: fed one bucket at a time (:meth:`land`, or
    :meth:`direct` and :meth:`landed` for a transport that receives straight into the
    tensors), then :meth:`result`. With an iterator, each bucket's completed tensors
    are handed over as they complete (:attr:`iterator` is what the caller gets at once).
    """

    def __init__(self, taking: Taking, header: MessageHeader, landing: Landing,
                 handoff: Handoff | None):
        self.taking = taking
        self.header = header
        self.landing = landing
        self._handoff = handoff
        self.iterator = (None if handoff is None
                         else BucketIterator(handoff, taking.into.transform))
        self._next = 0  # the first tensor not yet handed over

    @property
    def wanted(self) -> bool:
        """Whether the pieces still matter (an iterator's caller may have stopped)."""
        return self._handoff is None or self._handoff.wanted

    def direct(self, bucket: Bucket) -> list[torch.Tensor] | None:
        """Where a transport may receive each piece of ``bucket`` straight (the uint8
        bytes of its destination), or None when the bucket must be staged and given to
        :meth:`land`."""
        if not self.wanted:
            return None
        views = [self.landing.direct(p) for p in bucket.pieces]
        return None if any(v is None for v in views) else views  # type: ignore[return-value]

    def landed(self, bucket: Bucket) -> None:
        """The pieces of ``bucket`` were received into :meth:`direct`'s bytes."""
        for piece in bucket.pieces:
            self.landing.received_direct(piece)
        self._hand_over()

    def land(self, bucket: Bucket, views: Sequence[torch.Tensor]) -> None:
        """Copy the pieces of ``bucket`` (``views``: their uint8 bytes) to where they
        belong, and hand over what completed."""
        if not self.wanted:
            return
        for piece, view in zip(bucket.pieces, views, strict=True):
            self.landing.place(piece, view)
        self._hand_over()

    def _hand_over(self) -> None:
        if self._handoff is None or not self._handoff.wanted:
            return
        landing, n = self.landing, len(self.header.tensors)
        pairs = []
        while self._next < n and landing.done(self._next):
            pairs.append((landing.names[self._next], landing.tensor(self._next)))
            landing.forget(self._next)
            self._next += 1
        if pairs:
            self._handoff.put(pairs)

    def result(self) -> Any:
        """What the receive returns once every bucket landed."""
        if self._handoff is not None:
            self._hand_over()
            self._handoff.end()
            return self.iterator
        return self.taking.finish(self.header, self.landing)

    def fail(self, error: BaseException) -> None:
        """The message did not come whole: an iterator's caller gets ``error``."""
        if self._handoff is not None:
            self._handoff.end(error)
