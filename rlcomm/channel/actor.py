"""``ChannelActor``: the process that holds a channel's queues, and how it is started.

A channel ``x`` runs as the rlcomm group ``channel.x``: one Ray actor on the chosen node,
or one per node for a distributed channel (rank ``r`` on node ``r``), each named by
:func:`~rlcomm.comm.identity.actor_name` like any worker. It is built from comm parts
only, not from :class:`~rlcomm.Worker`: :func:`~rlcomm.comm.process.start_process` gives
it its address and communication, and a
:class:`~rlcomm.channel.service.ChannelService` serves its clients. Ray actor calls are
its control plane only (a client registers, ``connect`` reads the description, tests
read counters); every put, get and reply is an rlcomm message on the point-to-point
layer.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlcomm.channel.service import ChannelService
from rlcomm.cluster import RLCOMM_NAMESPACE
from rlcomm.comm.identity import actor_name
from rlcomm.comm.process import ProcessContext, inherited_env, start_process
from rlcomm.settings import get_settings, live_changes

#: Prefix of the group of a channel: the group of channel ``x`` is ``channel.x``.
GROUP_PREFIX = "channel."


def group_name_of(channel_name: str) -> str:
    return f"{GROUP_PREFIX}{channel_name}"


class ChannelActor:
    """One channel worker (see the module docstring); Ray runs it, :func:`start_actors`
    makes it.

    Args:
        ctx: its identity in the group ``channel.<name>`` (and the launcher's settings).
        channel_name: the channel's name.
        maxsize: items per key; 0 for unbounded.
        item_type_blob: the channel's ``item_type``, pickled by the creator (the worker
            never unpickles it; ``connect`` hands it to clients).
        distributed: whether this is one of several per-node workers.
        incarnation: a unique id of this channel's creation.
    """

    def __init__(
        self,
        ctx: ProcessContext,
        channel_name: str,
        maxsize: int,
        item_type_blob: bytes,
        distributed: bool,
        incarnation: str,
    ):
        start_process(ctx)
        self._address = ctx.address
        self._rank = ctx.rank
        self._channel_name = channel_name
        self._maxsize = maxsize
        self._item_type_blob = item_type_blob
        self._distributed = distributed
        self._incarnation = incarnation
        self._service = ChannelService(
            channel_name, maxsize, distributed and ctx.rank == 0, str(self._address)
        )

    # -- control plane (Ray actor calls) --------------------------------------------------

    def channel_node_info(self) -> dict[str, Any]:
        """Where this worker runs (what the registry records of every group member)."""
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
        }

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


def start_actors(group_name: str, node_ids: Sequence[str], *args: Any) -> list[Any]:
    """Start rank ``r`` of the group ``group_name`` on node ``node_ids[r]``, each a
    :class:`ChannelActor` of ``args``; returns their Ray handles, by rank (their
    ``__init__`` may still be running)."""
    remote_cls = ray.remote(ChannelActor)
    env = inherited_env()
    settings = live_changes()
    actors = []
    for rank, node_id in enumerate(node_ids):
        ctx = ProcessContext(group_name, rank, len(node_ids), env=env, settings=settings)
        options = {
            "name": actor_name(group_name, rank),
            "namespace": RLCOMM_NAMESPACE,
            "num_cpus": get_settings().worker_num_cpus,
            "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False),
        }
        actors.append(remote_cls.options(**options).remote(ctx, *args))
    return actors
