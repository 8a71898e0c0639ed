"""Channels: typed, bounded, node-local or distributed queues between workers.

``Channel`` is the client handle (``channel.py``, its asyncio methods in ``aio.py``);
``ChannelActor`` the worker that holds the queues (``actor.py``, its data plane in
``service.py``); the queue rules are in ``state.py``, the wire protocol (tagged msgspec
structs) in ``protocol.py``, items as opaque encoded payloads in ``payload.py``, the
client's requests and links in ``requester.py`` / ``client.py`` / ``local.py``, and the
key routing of a distributed channel in ``routing.py``.
"""

from rlcomm.channel.channel import Channel

__all__ = ["Channel"]
