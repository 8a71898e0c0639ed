"""Listening: a connection whose messages go to a callback instead of receive ops.

The channel's client and worker listen to their connections: every message, decoded, is
handed to ``on_message`` on the thread that read it (the reader's driver, or a
:meth:`~rlcomm.comm.connection.reader.Reader.pump` caller), in order. ``on_error`` is
called once when the connection fails.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from rlcomm.comm import codec
from rlcomm.comm.connection.incoming import Incoming
from rlcomm.errors import CodecError, CommError

logger = logging.getLogger(__name__)


class Listener:
    """The callbacks of a listened connection.

    Args:
        on_message: gets each message's object.
        on_error: gets the connection's error, once.
    """

    def __init__(
        self, on_message: Callable[[Any], None], on_error: Callable[[CommError], None]
    ):
        self.on_message = on_message
        self.on_error = on_error

    def deliver(self, peer: str, msg: Incoming) -> None:
        """Decode ``msg`` (its payload read already) and hand it to ``on_message`` (on
        the thread that read it, no lock held). A message that cannot be decoded is
        logged and dropped; a failing ``on_message`` is logged and the stream goes on."""
        try:
            obj = codec.decode(msg.header, msg.tensors)
        except CodecError:
            logger.exception("a message from %s cannot be decoded; dropped", peer)
            return
        try:
            self.on_message(obj)
        except Exception:  # noqa: BLE001 - the listener's failure must not end the stream
            logger.exception("the listener of %s failed on a message", peer)
