"""Taking a message bucket by bucket: :class:`Buckets`, what a receiver passes as
``into=``, and :class:`BucketIterator`, the ``(name, tensor)`` iterator it gets back.

One thread *produces* (it reads the buckets off the transport and makes the tensors
completed in each), the caller *consumes*. They meet in one slot: the producer hands a
bucket's tensors over and waits until the slot is free before it hands the next, so
rlcomm holds at most two buckets of tensors at once (the one handed over, the one being
made) besides what the caller keeps. A consumer that stops early (``close()``, or drops
the iterator) lets the producer go on without handing anything over: it reads the rest
of the message and drops it, so the stream stays in step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from rlcomm.errors import CommError, CommTimeoutError

Pairs = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class Buckets:
    """Receive a message as an iterator of ``(name, tensor)``, bucket by bucket: pass
    ``into=rlcomm.Buckets()`` to :meth:`~rlcomm.Worker.recv` or
    :meth:`~rlcomm.Worker.broadcast`. The iterator yields each tensor once it is whole,
    while later buckets are still on their way (the shape of vLLM's
    ``model.load_weights(weights)``).

    Args:
        transform: called with the ``(name, tensor)`` pairs completed in each bucket (in
            the caller's thread), returns the pairs to yield instead: rename trainer
            names to engine names, fuse ``q``/``k``/``v`` into ``qkv``. It may keep
            tensors back and return them with a later bucket's (a fused weight whose
            parts fall in two buckets).

    A message that was not sent in buckets (smaller than the source's bucket size) is
    iterated all the same, once it has arrived.
    """

    transform: Callable[[Pairs], Iterable[tuple[str, torch.Tensor]]] | None = None


class Handoff:
    """The slot where the producer hands buckets to the consumer (see the module
    docstring). The producer holds this; the caller holds the :class:`BucketIterator`
    around it, so that dropping the iterator closes the hand-off.

    Args:
        what: how errors name the receive (``"recv at ... from ..."``).
        timeout: seconds the consumer waits for the next bucket, and the producer for
            the consumer to take one, before ``CommTimeoutError``.
    """

    def __init__(self, what: str, timeout: float):
        self.what = what
        self.timeout = timeout
        self._cond = threading.Condition()
        self._pending: Pairs | None = None
        self._ended = False
        self._error: BaseException | None = None
        self._closed = False
        #: Buckets handed over, and taken, so far (any thread may read them).
        self.handed = 0
        self.taken = 0

    def __repr__(self) -> str:
        state = ("failed" if self._error is not None else "ended" if self._ended
                 else "closed" if self._closed else "open")
        return f"Handoff({self.what}: {state}, handed {self.handed}, taken {self.taken})"

    # -- the producer ------------------------------------------------------------------------

    def put(self, pairs: Pairs) -> bool:
        """Hand one bucket's tensors over, once the previous one was taken. Returns
        False when the consumer is gone (the producer drops the rest).

        Raises:
            CommTimeoutError: the consumer took nothing within the timeout.
        """
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while self._pending is not None and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeoutError(
                        f"{self.what}: the caller took no bucket of the iterator within "
                        f"{self.timeout}s; the rest of the message is dropped")
                self._cond.wait(left)
            if self._closed:
                return False
            self._pending = pairs
            self.handed += 1
            self._cond.notify_all()
            return True

    def end(self, error: BaseException | None = None) -> None:
        """The message is all handed over (or failed with ``error``)."""
        with self._cond:
            if error is not None and self._error is None:
                self._error = error
            self._ended = True
            self._cond.notify_all()

    @property
    def wanted(self) -> bool:
        """Whether the consumer still iterates (the producer may skip making tensors)."""
        return not self._closed

    # -- the consumer ------------------------------------------------------------------------

    def take(self) -> Pairs | None:
        """The next bucket's pairs; None at the end.

        Raises:
            the producer's error; CommTimeoutError: nothing came within the timeout.
        """
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while True:
                if self._pending is not None:
                    pairs, self._pending = self._pending, None
                    self.taken += 1
                    self._cond.notify_all()
                    return pairs
                if self._error is not None:
                    error = self._error
                    if isinstance(error, CommError):
                        raise type(error)(str(error), peer=error.peer, op=error.op) from error
                    raise error
                if self._ended or self._closed:
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeoutError(
                        f"{self.what}: no bucket arrived within {self.timeout}s")
                self._cond.wait(left)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._pending = None
            self._cond.notify_all()


class BucketIterator:
    """The ``(name, tensor)`` pairs of a message taken bucket by bucket (see the module
    docstring): iterate it once; ``close()`` it (or drop it) to stop early, and what
    has not come yet is dropped as it arrives.

    Iterating raises what the receive would (``PeerLostError``,
    ``ProtocolMismatchError``), and ``CommTimeoutError`` when no bucket came within the
    receive's timeout. Finish (or close) it before the next receive from the same peer
    or broadcast of the same group: those wait for it.
    """

    def __init__(self, handoff: Handoff,
                 transform: Callable[[Pairs], Iterable[tuple[str, torch.Tensor]]] | None = None):
        self._handoff = handoff
        self._transform = transform
        self._current: Iterator[tuple[str, torch.Tensor]] | None = None

    def __repr__(self) -> str:
        return f"BucketIterator({self._handoff!r})"

    @property
    def buckets_taken(self) -> int:
        """How many buckets this iterator has taken so far."""
        return self._handoff.taken

    @property
    def buckets_handed(self) -> int:
        """How many buckets its producer has handed over so far (at most one more than
        it took: rlcomm holds that one, and the one being made)."""
        return self._handoff.handed

    def __iter__(self) -> BucketIterator:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        while True:
            if self._current is not None:
                try:
                    return next(self._current)
                except StopIteration:
                    self._current = None
            pairs = self._handoff.take()
            if pairs is None:
                raise StopIteration
            self._current = iter(self._transform(pairs) if self._transform else pairs)

    def close(self) -> None:
        """Stop iterating: what has not been taken is dropped."""
        self._current = None
        self._handoff.close()

    def __del__(self) -> None:
        try:
            self._handoff.close()
        except Exception:  # noqa: BLE001 - at interpreter exit the lock may be gone
            pass
