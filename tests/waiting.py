"""Waiting in tests on observable state, with a deadline, never on a sleep that hopes the
other side got there (on a slow machine such a test passes without testing anything).

``wait_for`` polls a predicate until it holds and raises naming what it waited for;
the others are the waits several tests need: a process gone, an op of a worker under
way (its flight recorder, through :func:`rlcomm.job_status`).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], what: str, timeout: float = 30.0,
             interval: float = 0.01) -> T:
    """Until ``predicate()`` is true, at most ``timeout`` seconds; returns its value.

    Raises:
        AssertionError: naming ``what`` and the timeout, if it never held.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(interval)


async def await_for(predicate: Callable[[], T], what: str, timeout: float = 30.0,
                    interval: float = 0.005) -> T:
    """:func:`wait_for` on an event loop (the loop runs while it polls)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(interval)


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` has exited: gone, or a zombie whose every thread has
    ended (its files, sockets among them, are closed then; a killed process's main
    thread shows as a zombie while its other threads still exit)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return True
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue  # that thread ended and is gone
        if state not in ("Z", "X"):
            return False
    return True


def wait_process_gone(pid: int, timeout: float = 30.0) -> None:
    """Until process ``pid`` has exited (after a kill: its sockets are closed)."""
    wait_for(lambda: process_gone(pid), f"process {pid} exits", timeout)


def pending_ops(address: str) -> list[dict[str, Any]]:
    """The ops under way in the rlcomm process ``address`` ("group:rank"), as its
    status report shows them (``op``, ``peer``, ...); [] if it does not answer."""
    import rlcomm

    for row in rlcomm.job_status().workers:
        if row["address"] == address:
            return list(row.get("pending") or [])
    return []


def wait_op_under_way(address: str, op: str, peer: str, timeout: float = 60.0) -> None:
    """Until process ``address`` is in ``op`` ("recv", "send", ...) with ``peer``."""
    wait_for(
        lambda: any(p["op"] == op and p["peer"] == peer for p in pending_ops(address)),
        f"{address} is in {op} with {peer}", timeout, interval=0.05,
    )


def actor_pid(actor: Any) -> int:
    """The process id of Ray actor ``actor`` (asked through Ray, not the actor's API)."""
    import ray

    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)
