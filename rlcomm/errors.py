"""The error classes of rlcomm, all under one root, :class:`RlcommError`.

Every message names what failed (the group and rank of the peer, the op) and, where
there is one, what to do about it.
"""

from __future__ import annotations

import asyncio
import re

#: The last line of a Python traceback: ``ValueError: ...`` or ``pkg.mod.Error: ...``.
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(: |$)")


class RlcommError(Exception):
    """Root of every error rlcomm raises on purpose."""


class WorkerCallError(RlcommError):
    """A worker method raised on a remote rank.

    When the remote exception could be brought back, the error the driver sees is also
    an instance of the remote exception's class (as Ray's errors are), so both
    ``except WorkerCallError`` and ``except ValueError`` catch a ``ValueError`` raised in a
    worker; the remote exception's attributes are copied onto it. Its message starts
    with the remote message, then names the group, rank and method, then the remote
    traceback (trimmed, without colour codes).

    Attributes:
        group_name: the worker group whose rank failed.
        rank: the failing rank.
        method: the method that was called.
        remote_traceback: the traceback text from the remote process.
        cause: the remote exception, or None when it could not be brought back (an
            actor that died, an exception that does not unpickle).
    """

    def __init__(
        self,
        group_name: str,
        rank: int,
        method: str,
        remote_traceback: str,
        cause: BaseException | None = None,
    ):
        self.group_name = group_name
        self.rank = rank
        self.method = method
        self.remote_traceback = remote_traceback
        self.cause = cause
        where = f"{group_name}[rank {rank}].{method}()"
        lines = remote_traceback.strip().splitlines() if remote_traceback else []
        if cause is not None or (len(lines) > 1 and _EXCEPTION_LINE.match(lines[-1])):
            # The exception's own line first, then where it was raised, then the traceback.
            first = lines[-1] if cause is None else (
                f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
            )
            text = f"{first}\n(raised in {where} on the remote worker)"
            if lines:
                text += f"\nremote traceback:\n{remote_traceback}"
        else:  # one line of text (an actor that died): no traceback to show
            text = f"{where} failed on the remote worker" + (f": {lines[0]}" if lines else "")
        self._message = text
        # Exception's own __init__: the remote class's may take other arguments.
        Exception.__init__(self, text)

    def __str__(self) -> str:
        return self._message

    def __reduce__(self):
        return (
            worker_call_error,
            (self.group_name, self.rank, self.method, self.remote_traceback, self.cause),
        )


_typed_error_classes: dict[type, type] = {}


def worker_call_error(
    group_name: str,
    rank: int,
    method: str,
    remote_traceback: str,
    cause: BaseException | None = None,
) -> WorkerCallError:
    """A :class:`WorkerCallError` that is also an instance of ``type(cause)`` where
    Python allows such a class (not for ``BaseException`` subclasses outside
    ``Exception``, nor classes whose layout clashes); a plain one otherwise."""
    if cause is None or isinstance(cause, WorkerCallError):
        return WorkerCallError(group_name, rank, method, remote_traceback, cause)
    cause_cls = type(cause)
    cls = _typed_error_classes.get(cause_cls)
    if cls is None and issubclass(cause_cls, Exception):
        try:
            cls = type(
                f"WorkerCallError({cause_cls.__name__})",
                (WorkerCallError, cause_cls),
                {"__module__": __name__, "__init__": WorkerCallError.__init__,
                 "__str__": WorkerCallError.__str__},
            )
        except TypeError:  # layout conflict, final class
            cls = None
        if cls is not None:
            _typed_error_classes[cause_cls] = cls
    if cls is None:
        return WorkerCallError(group_name, rank, method, remote_traceback, cause)
    try:
        err = cls.__new__(cls, str(cause))
        for key, value in getattr(cause, "__dict__", {}).items():
            setattr(err, key, value)
        WorkerCallError.__init__(err, group_name, rank, method, remote_traceback, cause)
    except Exception:  # the remote class's __new__ or attributes do not fit
        return WorkerCallError(group_name, rank, method, remote_traceback, cause)
    return err


class WorkerGroupError(RlcommError):
    """A worker group could not be launched, found or used (bad name, shut down, ...)."""


class RlcommTimeoutError(RlcommError, TimeoutError):
    """A bounded wait ran out of time."""


class CommError(RlcommError):
    """A point-to-point or broadcast operation failed.

    Errors are told apart by their class; who and what failed are fields, not only
    text in the message (which names them too).

    Args:
        *args: the message, as for any exception.
        peer: the other end: its :class:`~rlcomm.WorkerAddress` (or that address's
            text, ``"group:0"``); ``None`` where no single peer is to blame.
        op: the operation that failed (``"send"``, ``"recv"``, ``"broadcast"``,
            ``"connect"``, ...); ``None`` where unknown.

    Attributes:
        peer: as given (``None`` by default).
        op: as given (``None`` by default).
    """

    def __init__(self, *args: object, peer: object = None, op: str | None = None):
        super().__init__(*args)
        self.peer = peer
        self.op = op


class CommTimeoutError(CommError, RlcommTimeoutError):
    """A communication op did not complete within its timeout (``peer`` names the
    peer waited for, ``op`` the op)."""


class PeerLostError(CommError):
    """The peer process of a communication died or closed its connection (``peer``
    names it, ``op`` what was under way)."""


class AuthenticationError(CommError):
    """A connection did not prove it belongs to this job (it lacks the job's secret),
    or a peer's claimed identity does not match the registry."""


class PeerNotFoundError(CommError):
    """The destination/source group or rank does not exist."""


class OptionsMismatchError(CommError):
    """The two ends of a collective group were given different options."""


class ProtocolMismatchError(CommError):
    """The two ends used ops that do not pair, e.g. ``send`` with ``recv_tensor``,
    or a ``recv_tensor`` buffer whose shape/dtype differs from the sent tensor."""


class CapacityError(ProtocolMismatchError):
    """A payload cannot go through with the limits set: a receiver's
    ``RLCOMM_MAX_MESSAGE_BYTES``, a shared-memory pool too small to stream through, a
    pool larger than the node's memory. The message names the setting, the sizes and
    what to change; every member of the op raises it (or an error naming the member
    that did)."""


class CodecError(RlcommError):
    """An object cannot be encoded or decoded (unpicklable, mixed devices, bad header)."""


class ChannelError(RlcommError):
    """Root of the channel errors."""


class ChannelFull(ChannelError, asyncio.QueueFull):
    """``put_nowait`` on a channel key that holds ``maxsize`` items.

    Also an :class:`asyncio.QueueFull`, which is what RLinf's ``put_nowait`` raises, so
    code that catches that keeps working.
    """


class ChannelEmpty(ChannelError, asyncio.QueueEmpty):
    """``get_nowait`` on an empty channel key.

    Also an :class:`asyncio.QueueEmpty`, which is what RLinf's ``get_nowait`` raises, so
    code that catches that keeps working.
    """


class ChannelClosedError(ChannelError):
    """The channel was closed: no more puts; gets fail once the queue is drained."""


class ChannelTypeError(ChannelError, TypeError):
    """An item put into a typed channel does not match its declared ``item_type``."""


class ChannelLostError(ChannelError):
    """The actor that holds the channel died."""
