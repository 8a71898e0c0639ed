"""``GroupResult``: the handle of a method call on some ranks of a worker group, an
:class:`~rlcomm.AsyncWork` over the calls' Ray object refs; and how a failed call becomes
a :class:`~rlcomm.WorkerCallError` (:func:`call_error`)."""

from __future__ import annotations

import concurrent.futures
import re
import threading
from collections.abc import Sequence
from typing import Any

import ray

from rlcomm.comm.work import AsyncWork
from rlcomm.errors import RlcommTimeoutError, WorkerCallError, worker_call_error
from rlcomm.settings import get_settings

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_RAY_HEADER = re.compile(r"^(ray\.exceptions\.\w+: )?ray::")
#: Frames of Ray itself and of rlcomm's actor wrapper, not of the user's code.
_INTERNAL_FRAME = re.compile(r"[/\\](site|dist)-packages[/\\]ray[/\\]|python/ray/|rlcomm[/\\]worker[/\\]actor\.py")
#: Most lines of a remote traceback a WorkerCallError keeps (the last ones).
TRACEBACK_LINES = 20


def strip_ansi(text: str) -> str:
    """``text`` without terminal colour codes."""
    return _ANSI.sub("", text)


def trim_traceback(text: str | None) -> str:
    """A remote traceback without colour codes, Ray's and rlcomm's own frames, caret
    lines, and all but its last :data:`TRACEBACK_LINES` lines."""
    lines = strip_ansi(text or "").rstrip().splitlines()
    kept: list[str] = []
    skip_source = False
    for line in lines:
        if _RAY_HEADER.match(line) or (line.strip() and not line.strip("^~ ")):
            continue  # Ray's header line; caret lines under source lines
        if skip_source and line.startswith("    ") and not line.startswith("  File"):
            continue
        skip_source = False
        if line.startswith("  File ") and _INTERNAL_FRAME.search(line):
            skip_source = True
            continue
        kept.append(line)
    if len(kept) > TRACEBACK_LINES:
        kept = ["  ..."] + kept[-TRACEBACK_LINES:]
    return "\n".join(kept)


def default_call_timeout() -> float:
    """Default seconds ``GroupResult.wait()`` waits (the ``call_timeout`` setting, 24 h:
    worker methods may train for hours)."""
    return get_settings().call_timeout


def call_error(group_name: str, method: str, rank: int, exc: BaseException) -> WorkerCallError:
    """The :class:`WorkerCallError` for what Ray raised for ``rank``'s call of ``method``:
    the remote exception (as its own class too, where it came back), or the actor's
    death."""
    if isinstance(exc, WorkerCallError):
        return exc
    if isinstance(exc, ray.exceptions.RayTaskError):
        if isinstance(exc.cause, WorkerCallError):
            return exc.cause
        cause = exc.cause
        if not isinstance(cause, Exception) or type(cause) is ray.exceptions.RayError:
            cause = None  # Ray could not bring the remote exception back
        text = trim_traceback(getattr(exc, "traceback_str", None) or str(exc))
        return worker_call_error(group_name, rank, method, text, cause)
    if isinstance(exc, ray.exceptions.RayActorError):
        text = f"the worker's actor died: {strip_ansi(str(exc))}"
    else:  # e.g. a remote exception that does not unpickle here
        text = trim_traceback(f"{type(exc).__name__}: {exc}")
    return WorkerCallError(group_name, rank, method, text)


def gather_calls(
    group_name: str, method: str, ranks: Sequence[int], refs: Sequence[Any]
) -> concurrent.futures.Future:
    """One future of the results of ``refs`` (Ray object refs of one call on ``ranks``),
    ordered like the ranks. It completes once every call has finished; if any raised,
    it fails with the :func:`call_error` of the first such rank (in rank order)."""
    out: concurrent.futures.Future = concurrent.futures.Future()
    parts = [ref.future() for ref in refs]
    left = [len(parts)]
    lock = threading.Lock()

    def finish() -> None:
        results = []
        for rank, part in zip(ranks, parts, strict=True):
            exc = part.exception()
            if exc is not None:
                out.set_exception(call_error(group_name, method, rank, exc))
                return
            results.append(part.result())
        out.set_result(results)

    def one_done(_part: concurrent.futures.Future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            finish()

    if not parts:
        out.set_result([])
    for part in parts:
        part.add_done_callback(one_done)
    return out


class GroupResult(AsyncWork):
    """The handle of a call on some ranks of a group: an :class:`~rlcomm.AsyncWork` whose
    result is the list of the ranks' results.

    ``wait()`` returns the results ordered like the ranks; ``done()`` polls;
    ``await handle`` or ``await handle.async_wait()`` waits from asyncio without blocking
    the event loop. A rank that raised makes ``wait`` raise :class:`WorkerCallError`
    naming the group, rank and method, with the remote traceback; it is also an instance
    of the remote exception's class (``except ValueError`` catches a remote
    ``ValueError``). Results are fetched only once someone waits for them (``refs`` may
    be passed on to other calls unfetched).

    Attributes:
        group_name: the called group.
        method: the called method.
        ranks: the called ranks, in order.
        refs: the Ray object ref of each rank's result.
    """

    def __init__(self, group_name: str, method: str, ranks: Sequence[int], refs: Sequence[Any]):
        super().__init__(None, f"{group_name}.{method}()")
        self.group_name = group_name
        self.method = method
        self.ranks = list(ranks)
        self.refs = list(refs)
        self._lock = threading.Lock()

    def _resolve_timeout(self, timeout: float | None) -> float | None:
        return default_call_timeout() if timeout is None else timeout

    def _result_future(self) -> concurrent.futures.Future:
        with self._lock:
            if self._future is None:
                self._future = gather_calls(self.group_name, self.method, self.ranks, self.refs)
            return self._future

    def _timeout_error(self, timeout: float | None) -> Exception:
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        pending = [r for r, ref in zip(self.ranks, self.refs, strict=True) if ref not in ready]
        return RlcommTimeoutError(
            f"{self.group_name}.{self.method}(): ranks {pending} not done after {timeout}s"
        )

    def wait(self, timeout: float | None = None) -> list[Any]:
        """The results, ordered like the ranks.

        Args:
            timeout: seconds; default ``RLCOMM_CALL_TIMEOUT`` (24 h).

        Raises:
            WorkerCallError: a rank raised or its actor died.
            RlcommTimeoutError: the results were not all ready in time.
        """
        return super().wait(timeout)

    def done(self) -> bool:
        """True once every rank has finished (successfully or not); fetches nothing."""
        if self._future is not None:
            return self._future.done()
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return len(ready) == len(self.refs)

    def __repr__(self) -> str:
        return f"GroupResult({self.group_name}.{self.method}, ranks={self.ranks})"
