"""The receiver thread: a reader's own driver.

Each attached connection starts one. It reads the stream whenever nobody else may (no
receive op wants it, the inbox is under its cap), so a peer's send never waits for this
worker's code to call ``recv``. While a :class:`~rlcomm.comm.connection.selector.Selector` drives
the reader instead, the thread only waits to be handed the stream back, or for the end.
It owns nothing but its loop: what the stream lets it do is the
:class:`~.stream.StreamState`'s to say (through the reader's driver methods).
"""

from __future__ import annotations

import logging
import threading

from rlcomm.comm.connection.reader import Reader
from rlcomm.errors import PeerLostError

logger = logging.getLogger(__name__)


def start_receiver_thread(reader: Reader) -> threading.Thread:
    """Start ``reader``'s receiver thread (once its transport is attached)."""
    thread = threading.Thread(
        target=_receive_loop, args=(reader,), name=f"rlcomm-recv-{reader.peer}", daemon=True
    )
    thread.start()
    return thread


def _receive_loop(reader: Reader) -> None:
    try:
        while True:
            transport = reader.wait_for_stream()
            if transport is None:
                return
            msg = None
            try:
                # Until a message comes, or the wake pipe says a receive op wants the stream.
                msg = reader.read_next(transport, None, wake=True)
            finally:
                reader.driver_leave(msg)
    except Exception as exc:  # noqa: BLE001 - any failure ends the stream, loudly
        logger.exception("receiver thread for %s failed", reader.peer)
        reader.fail(PeerLostError(f"receiving from {reader.peer} failed: {exc!r}"))
    finally:
        reader.receiver_ended()
