"""``ChannelActor``: the worker that holds a channel's queues.

:meth:`Channel.create <rlcomm.Channel.create>` launches it as a :class:`~rlcomm.WorkerGroup`
named ``channel.<name>``: one rank on the chosen node, or one rank per node for a
distributed channel (rank ``r`` on node ``r``). Ray actor calls are its control plane
only (a client registers, ``connect`` reads the description, tests read counters); every
put, get and reply is an rlcomm message on the point-to-point layer, served by its
:class:`~rlcomm.channel.service.ChannelService`.
"""

from __future__ import annotations

from typing import Any

import ray

from rlcomm.channel.service import ChannelService
from rlcomm.worker.worker import Worker

#: Prefix of the worker group of a channel: the group of channel ``x`` is ``channel.x``.
GROUP_PREFIX = "channel."


def group_name_of(channel_name: str) -> str:
    return f"{GROUP_PREFIX}{channel_name}"


class ChannelActor(Worker):
    """One channel worker (see the module docstring).

    Args:
        channel_name: the channel's name.
        maxsize: items per key; 0 for unbounded.
        item_type_blob: the channel's ``item_type``, pickled by the creator (the worker
            never unpickles it; ``connect`` hands it to clients).
        distributed: whether this is one of several per-node workers.
        incarnation: a unique id of this channel's creation.
    """

    def __init__(
        self,
        channel_name: str,
        maxsize: int,
        item_type_blob: bytes,
        distributed: bool,
        incarnation: str,
    ):
        super().__init__()
        self._channel_name = channel_name
        self._maxsize = maxsize
        self._item_type_blob = item_type_blob
        self._distributed = distributed
        self._incarnation = incarnation
        self._service = ChannelService(
            channel_name, maxsize, distributed and self._rank == 0, str(self.worker_address)
        )

    # -- control plane (Ray actor calls) --------------------------------------------------

    def channel_describe(self) -> dict[str, Any]:
        """What a client needs to use the channel (``Channel.connect`` reads it)."""
        return {
            "name": self._channel_name,
            "maxsize": self._maxsize,
            "item_type_blob": self._item_type_blob,
            "distributed": self._distributed,
            "incarnation": self._incarnation,
        }

    def channel_register_client(self, client: str) -> None:
        """Start reading request messages from the process at address ``client``."""
        self._service.register_client(client)

    def channel_peek_all(self, key: Any) -> list[Any]:
        """The items queued on ``key``, head first, not taken (``Channel.peek_all``)."""
        return self._service.core.peek(key)

    def channel_stats(self) -> dict[str, Any]:
        """Counters of this worker: items accepted and handed out per key, its node, and
        the replies waiting for their clients (``replies``: ``queued``, per ``clients``)."""
        stats = self._service.core.stats()
        stats.update(
            rank=self._rank,
            node_id=ray.get_runtime_context().get_node_id(),
            clients=self._service.clients,
            replies=self._service.reply_stats(),
            homes=homes.snapshot() if (homes := self._service.homes) is not None else None,
        )
        return stats
