"""A connection with one peer, in three parts: a sender, a bounded inbox, and a reader
with explicit states, driven by its own receiver thread or a shared selector."""

from rlcomm.comm.connection.connection import Connection, Life
from rlcomm.comm.connection.inbox import Inbox
from rlcomm.comm.connection.incoming import Incoming
from rlcomm.comm.connection.reader import Reader
from rlcomm.comm.connection.stream import LINGER, Lease, StreamState

__all__ = [
    "LINGER", "Connection", "Inbox", "Incoming", "Lease", "Life", "Reader", "StreamState",
]
