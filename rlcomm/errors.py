"""The error classes of rlcomm, all under one root, :class:`RlcommError`.

Every message names what failed (the group and rank of the peer, the op) and, where
there is one, what to do about it.
"""

from __future__ import annotations

import asyncio


class RlcommError(Exception):
    """Root of every error rlcomm raises on purpose."""


class WorkerCallError(RlcommError):
    """A worker method raised on a remote rank.

    Attributes:
        group_name: the worker group whose rank failed.
        rank: the failing rank.
        method: the method that was called.
        remote_traceback: the traceback text from the remote process.
    """

    def __init__(self, group_name: str, rank: int, method: str, remote_traceback: str):
        self.group_name = group_name
        self.rank = rank
        self.method = method
        self.remote_traceback = remote_traceback
        super().__init__(
            f"{group_name}[rank {rank}].{method}() failed on the remote worker:\n{remote_traceback}"
        )

    def __reduce__(self):
        return (type(self), (self.group_name, self.rank, self.method, self.remote_traceback))


class WorkerGroupError(RlcommError):
    """A worker group could not be launched, found or used (bad name, shut down, ...)."""


class RlcommTimeoutError(RlcommError, TimeoutError):
    """A bounded wait ran out of time."""


class CommError(RlcommError):
    """A point-to-point or broadcast operation failed."""


class CommTimeoutError(CommError, RlcommTimeoutError):
    """A communication op did not complete within its timeout."""


class PeerLostError(CommError):
    """The peer process of a communication died or closed its connection."""


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
