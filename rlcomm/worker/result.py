"""``GroupResult``: the handle of a method call on some ranks of a worker group."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Sequence
from typing import Any

import ray

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


class GroupResult:
    """The handle of a call on some ranks of a group.

    ``wait()`` returns the results ordered like the ranks; ``done()`` polls;
    ``await handle`` or ``await handle.async_wait()`` waits from asyncio without blocking
    the event loop. A rank that raised makes ``wait`` raise :class:`WorkerCallError`
    naming the group, rank and method, with the remote traceback; it is also an instance
    of the remote exception's class (``except ValueError`` catches a remote
    ``ValueError``).
    """

    def __init__(self, group_name: str, method: str, ranks: Sequence[int], refs: Sequence[Any]):
        self.group_name = group_name
        self.method = method
        self.ranks = list(ranks)
        self.refs = list(refs)

    def _error(self, rank: int, exc: BaseException) -> WorkerCallError:
        if isinstance(exc, ray.exceptions.RayTaskError):
            if isinstance(exc.cause, WorkerCallError):
                return exc.cause
            cause = exc.cause
            if not isinstance(cause, Exception) or type(cause) is ray.exceptions.RayError:
                cause = None  # Ray could not bring the remote exception back
            return worker_call_error(
                self.group_name, rank, self.method, trim_traceback(getattr(exc, "traceback_str", None) or str(exc)), cause
            )
        if isinstance(exc, ray.exceptions.RayActorError):
            text = f"the worker's actor died: {strip_ansi(str(exc))}"
        else:  # e.g. a remote exception that does not unpickle here
            text = trim_traceback(f"{type(exc).__name__}: {exc}")
        return WorkerCallError(self.group_name, rank, self.method, text)

    def wait(self, timeout: float | None = None) -> list[Any]:
        """The results, ordered like the ranks.

        Args:
            timeout: seconds; default ``RLCOMM_CALL_TIMEOUT`` (24 h).

        Raises:
            WorkerCallError: a rank raised or its actor died.
            RlcommTimeoutError: the results were not all ready in time.
        """
        timeout = default_call_timeout() if timeout is None else timeout
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=timeout)
        if len(ready) < len(self.refs):
            pending = [r for r, ref in zip(self.ranks, self.refs, strict=True) if ref not in ready]
            raise RlcommTimeoutError(
                f"{self.group_name}.{self.method}(): ranks {pending} not done after {timeout}s"
            )
        results = []
        for rank, ref in zip(self.ranks, self.refs, strict=True):
            try:
                results.append(ray.get(ref))
            except ray.exceptions.RayError as exc:
                raise self._error(rank, exc) from None
        return results

    def done(self) -> bool:
        """True once every rank has finished (successfully or not)."""
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return len(ready) == len(self.refs)

    async def async_wait(self, timeout: float | None = None) -> list[Any]:
        """Like :meth:`wait`, awaitable from asyncio (default loop or uvloop)."""
        timeout = default_call_timeout() if timeout is None else timeout
        results = []
        deadline = time.monotonic() + timeout
        for rank, ref in zip(self.ranks, self.refs, strict=True):
            try:
                remaining = max(0.0, deadline - time.monotonic())
                results.append(await asyncio.wait_for(asyncio.wrap_future(ref.future()), remaining))
            except asyncio.TimeoutError:
                raise RlcommTimeoutError(
                    f"{self.group_name}.{self.method}(): rank {rank} not done after {timeout}s"
                ) from None
            except ray.exceptions.RayError as exc:
                raise self._error(rank, exc) from None
        return results

    def __await__(self):
        return self.async_wait().__await__()

    def __repr__(self) -> str:
        return f"GroupResult({self.group_name}.{self.method}, ranks={self.ranks})"
