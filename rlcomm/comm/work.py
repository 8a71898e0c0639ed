"""``AsyncWork``: the one handle of every asynchronous result in rlcomm.

A point-to-point op started with ``async_op=True``, a channel op, and a method call on
a worker group all return one (the group's handles, :class:`~rlcomm.GroupResult`,
``MultiWorkerFuture`` and ``DispatchFuture``, are thin adapters with their seed names).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from typing import Any

from rlcomm.errors import CommError, CommTimeoutError


def _while_progressing(future: concurrent.futures.Future, timeout: float,
                       progress: Callable[[], object], look: float = 0.5) -> bool:
    """Wait for ``future`` until it is done (True), or until ``progress()`` has not
    changed for ``timeout`` seconds (False)."""
    mark = progress()
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        done, _ = concurrent.futures.wait([future], timeout=min(left, look))
        if done:
            return True
        now = progress()
        if now != mark:
            mark, deadline = now, time.monotonic() + timeout


def _raised_by_op(future: concurrent.futures.Future, exc: BaseException) -> bool:
    """Whether ``exc`` (a TimeoutError) is the op's own error rather than the wait's."""
    return future.done() and not future.cancelled() and future.exception() is exc


class AsyncWork:
    """A running op: ``wait()`` blocks for its result, ``async_wait()`` awaits it.

    ``wait`` returns what the blocking op would have returned (the received object for a
    receive, ``None`` for a send). Errors raised inside the op (timeout, lost peer,
    mismatch) are raised by ``wait`` / ``async_wait``. ``async_wait`` never blocks the
    event-loop thread and works under the default loop and under uvloop.

    Adapters that have no future until someone waits (a group call's results are not
    fetched unless asked for) override :meth:`_result_future`; their timeout error is
    :meth:`_timeout_error`.

    Args:
        future: completes with the op's result (``None`` only in an adapter that
            overrides :meth:`_result_future`).
        description: names the op and the peer, for timeout messages (any object whose
            ``str`` does; it is formatted only when a message is written).
        timeout: default seconds for ``wait`` when none is given.
        waiter: ``waiter(future, timeout) -> done``: how ``wait`` blocks, for an op whose
            waiting thread can drive it (read its own reply); default: block on the future.
        cancellable: an op that abandoning its wait withdraws: a ``wait`` or
            ``async_wait`` that times out or is interrupted (an asyncio task cancelled,
            ``KeyboardInterrupt``) cancels the future. Default: the op goes on.
        on_cancel: called (once per abandoned wait) after a ``cancellable`` op's future
            was cancelled, to withdraw the op where it runs.
        explain: ``explain(error, waited)`` turns a ``CommError`` that ``wait`` is about
            to raise into the error raised (one with an analysis of what the peer was
            doing; see :meth:`rlcomm.comm.manager.CommManager.explain`); ``waited`` is
            the seconds of the wait that timed out, ``None`` for the op's own error.
        progress: for an op whose timeout bounds a stall rather than the whole op (a
            message streamed in buckets): gives a value that changes whenever the op
            moves on; a wait then times out only when it has not changed for the
            timeout.
    """

    #: See ``explain`` and ``progress`` above (class defaults: adapters may not call
    #: ``__init__``).
    _explain: Callable[[CommError, float | None], CommError] | None = None
    _progress: Callable[[], object] | None = None

    def __init__(
        self,
        future: concurrent.futures.Future | None,
        description: object = "op",
        timeout: float | None = None,
        *,
        waiter: Callable[[concurrent.futures.Future, float | None], bool] | None = None,
        cancellable: bool = False,
        on_cancel: Callable[[], None] | None = None,
        explain: Callable[[CommError, float | None], CommError] | None = None,
        progress: Callable[[], object] | None = None,
    ):
        self._future = future
        self._progress = progress
        self._description = description
        self._timeout = timeout
        self._waiter = waiter
        self._cancellable = cancellable
        self._on_cancel = on_cancel
        self._explain = explain

    def _result_future(self) -> concurrent.futures.Future:
        """The future of the op's result (an adapter may make it on first use)."""
        assert self._future is not None, "AsyncWork without a future"
        return self._future

    def _timeout_error(self, timeout: float | None) -> Exception:
        """What ``wait`` raises when the op is not done within ``timeout`` seconds."""
        return CommTimeoutError(f"{self._description} did not complete within {timeout}s")

    @classmethod
    def completed(cls, value: Any = None, description: str = "op") -> AsyncWork:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(value)
        return cls(fut, description)

    @classmethod
    def failed(cls, exc: BaseException, description: str = "op") -> AsyncWork:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_exception(exc)
        return cls(fut, description)

    @classmethod
    def run_in(
        cls,
        executor: concurrent.futures.Executor,
        fn: Callable[[], Any],
        description: str,
        timeout: float | None = None,
    ) -> AsyncWork:
        return cls(executor.submit(fn), description, timeout)

    def _resolve_timeout(self, timeout: float | None) -> float | None:
        return self._timeout if timeout is None else timeout

    def wait(self, timeout: float | None = None) -> Any:
        """The op's result.

        Args:
            timeout: seconds; default the op's own timeout.

        Raises:
            CommTimeoutError: not done in time (the op itself goes on).
            Exception: whatever the op raised.
        """
        timeout = self._resolve_timeout(timeout)
        future = self._result_future()
        try:
            if (self._waiter is not None and not future.done()
                    and not self._waiter(future, timeout)):
                raise concurrent.futures.TimeoutError
            if (self._progress is not None and timeout is not None and not future.done()
                    and not _while_progressing(future, timeout, self._progress)):
                raise concurrent.futures.TimeoutError
            return future.result(timeout=timeout)
        except (concurrent.futures.TimeoutError, TimeoutError) as exc:
            if _raised_by_op(future, exc):
                raise self._explained(exc, None)  # noqa: B904 - the op's own error
            self._abandon()
            raise self._explained(self._timeout_error(timeout), timeout) from None
        except CommError as exc:
            self._abandon()  # a no-op when the op itself failed
            raise self._explained(exc, None)  # noqa: B904 - the op's own error
        except BaseException:
            self._abandon()  # interrupted; a no-op when the op itself failed
            raise

    def _explained(self, exc: BaseException, waited: float | None) -> BaseException:
        if self._explain is None or not isinstance(exc, CommError):
            return exc
        return self._explain(exc, waited)

    def _abandon(self) -> None:
        if (self._cancellable and self._future is not None and self._future.cancel()
                and self._on_cancel is not None):
            self._on_cancel()

    def done(self) -> bool:
        """True once the op finished, successfully or not."""
        return self._result_future().done()

    async def async_wait(self, timeout: float | None = None) -> Any:
        """Await the op's result from asyncio (see :meth:`wait`)."""
        timeout = self._resolve_timeout(timeout)
        future = self._result_future()
        try:
            waited = asyncio.wrap_future(future)
            if not self._cancellable:
                # shield: a timed-out await must not cancel an op still queued behind others.
                waited = asyncio.shield(waited)
            if self._progress is not None and timeout is not None:
                mark = self._progress()
                while True:  # the timeout bounds a stall: each time it moved on, anew
                    try:
                        return await asyncio.wait_for(asyncio.shield(waited), timeout)
                    except (asyncio.TimeoutError, TimeoutError):
                        now = self._progress()
                        if now == mark or future.done():
                            raise
                        mark = now
            return await asyncio.wait_for(waited, timeout)
        except asyncio.CancelledError:
            self._abandon()
            raise
        except (asyncio.TimeoutError, TimeoutError) as exc:
            if _raised_by_op(future, exc):
                raise await self._explained_off_loop(exc, None)  # noqa: B904 - the op's own
            self._abandon()
            raise await self._explained_off_loop(self._timeout_error(timeout), timeout) from None
        except CommError as exc:
            raise await self._explained_off_loop(exc, None)  # noqa: B904 - the op's own error

    async def _explained_off_loop(self, exc: BaseException, waited: float | None) -> BaseException:
        """:meth:`_explained` on a thread: asking the peer must not block the event loop."""
        if self._explain is None or not isinstance(exc, CommError):
            return exc
        return await asyncio.get_running_loop().run_in_executor(
            None, self._explained, exc, waited)

    def __await__(self):
        return self.async_wait().__await__()

    def then(self, fn: Callable[[Any], Any]) -> AsyncWork:
        """A work whose result is ``fn(result)``, computed when this one completes."""
        out: concurrent.futures.Future = concurrent.futures.Future()

        def chain(fut: concurrent.futures.Future) -> None:
            try:
                out.set_result(fn(fut.result()))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                out.set_exception(exc)

        self._result_future().add_done_callback(chain)
        return AsyncWork(out, self._description, self._timeout)

    @property
    def future(self) -> concurrent.futures.Future:
        """The future the work completes (cancelling it cancels a ``cancellable`` op)."""
        return self._result_future()

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"AsyncWork({self._description}, {state})"
