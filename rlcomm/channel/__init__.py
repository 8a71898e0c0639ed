"""Channels: typed, bounded, node-local or distributed queues between workers.

``Channel`` is the client handle (``channel.py``, blocking and asyncio methods alike);
``ChannelActor`` the worker that holds the queues (``actor.py``, its data plane in
``service.py``); the queue rules are in ``state.py``, the wire protocol (tagged msgspec
structs) in ``protocol.py``, items as opaque encoded payloads in ``payload.py``, the
client's links in ``client.py`` / ``local.py`` (each holding a ``requester.py``
``Requester``; a worker's link a ``writebehind.py`` ``WriteBehind`` too), and the
key routing of a distributed channel in ``routing.py``.
"""

from rlcomm.channel.channel import Channel

__all__ = ["Channel"]
