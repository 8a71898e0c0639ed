"""Channels: typed, bounded, node-local or distributed queues between workers.

``Channel`` is the client handle (``channel.py``); ``ChannelActor`` the worker that holds
the queues (``actor.py``); the queue rules are in ``state.py`` and the key routing of a
distributed channel in ``routing.py``.
"""

from rlcomm.channel.channel import Channel

__all__ = ["Channel"]
