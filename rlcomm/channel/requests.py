"""How a :class:`~rlcomm.Channel` handle sends its requests through a
:class:`~rlcomm.channel.requester.ChannelLink`: the timeouts, a request and its
:class:`~rlcomm.AsyncWork`, a put (written behind where it may be) and a ``get_batch``
that takes the items this process took ahead first (:mod:`~rlcomm.channel.prefetch`).

Plain functions of the requester that serves the request's key: the handle holds no
state of its own beyond its channel's layout and routes.
"""

from __future__ import annotations

from typing import Any

from rlcomm.channel import protocol as P
from rlcomm.channel.prefetch import batch_with
from rlcomm.channel.requester import ChannelLink
from rlcomm.channel.routing import REPLY_GRACE
from rlcomm.comm.flight import RECORDER
from rlcomm.comm.options import default_timeout
from rlcomm.comm.work import AsyncWork

#: What an async put that gets no reply returns (one for all: a finished work is never
#: changed by waiting on it).
_SENT = AsyncWork.completed(None, "put")
#: ``(request class, nowait) -> "channel get"``: the flight recorder's names of requests.
_OP_NAMES: dict[tuple[type, bool], str] = {}


def timeout_of(timeout: float | None) -> float:
    """A call's ``timeout`` argument, checked (default: rlcomm's op timeout)."""
    if timeout is None:
        return default_timeout()
    if timeout < 0:
        raise ValueError(f"timeout must be >= 0 seconds, got {timeout}")
    return float(timeout)


def get_batch(requester: ChannelLink, key: P.Key, target: float, timeout: float,
              async_op: bool) -> Any:
    """A get_batch: the items this process took ahead first, then the worker's."""
    local = requester.prefetched_upto(key, target)
    have = sum(w for _, w in local)
    if local and have >= target:
        items = [i.decode() for i, _ in local]
        return AsyncWork.completed(items, "get_batch") if async_op else items
    req = P.GetBatch(P.NO_REPLY, key, target - have, timeout)
    work = request(requester, req, timeout, bool(local) or async_op)
    if local:
        work = batch_with(local, work, lambda e: requester.unget(key, e),
                          f"channel {requester.channel!r}: get_batch on key {key!r}",
                          timeout + REPLY_GRACE)
        return work if async_op else work.wait()
    return work


def put(requester: ChannelLink, req: P.Put, timeout: float, async_op: bool,
        inline: bool = True) -> Any:
    """Encode the put's item (in a channel with a worker) and send it; ``inline``
    False: an async put never sends from this thread (an asyncio event loop's)."""
    req.item, tensors = requester.prepare_item(req.item)
    if not req.nowait and requester.writes_behind:
        if not async_op:
            requester.put_behind(req, tensors)
            return None
        if not tensors:  # nothing the caller could change under it: held, unanswered
            try:
                requester.put_behind(req, tensors, hold=True, inline=inline)
            except Exception as exc:  # noqa: BLE001 - an async op reports it in wait()
                return AsyncWork.failed(exc, "put")
            return _SENT
    return request(requester, req, timeout, async_op, tensors)


def request(
    requester: ChannelLink, req: P.Request, timeout: float, async_op: bool,
    tensors: list | None = None,
) -> Any:
    """Send ``req``; its :class:`~rlcomm.AsyncWork` with ``async_op``, else its result.

    ``timeout`` is the request's own; the work waits :data:`REPLY_GRACE` longer for
    the worker's answer, then withdraws the request.
    """
    work = requester.request(req, timeout + REPLY_GRACE, tensors, not async_op)
    if async_op:
        return work
    # A blocking request is an op this process waits in: the flight recorder shows it.
    kind = (type(req), getattr(req, "nowait", False))
    name = _OP_NAMES.get(kind)
    if name is None:
        name = _OP_NAMES[kind] = f"channel {P.op_name(req)}"
    key = RECORDER.begin(name, requester.channel)
    try:
        result = work.wait()
    except BaseException as exc:
        RECORDER.end(key, exc)
        raise
    RECORDER.end(key)
    return result
