"""Where a channel's workers come from and where they go: create, look up, shut down.

Control plane only (Ray calls and the registry); :class:`ChannelInfo` is what a
:class:`~rlcomm.Channel` handle needs afterwards, and all a pickled handle carries.

A channel ``x`` runs as the worker group ``channel.x`` (see
:mod:`rlcomm.channel.actor`); group names are unique in the registry, so channel names
are too. Ray ends an actor once no handle on it is left, so the process that created a
channel keeps its group's handles: the channel lives as long as that process, or until
:func:`shut_down`.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import ray
from ray import cloudpickle

from rlcomm.channel.actor import group_name_of, start_actors
from rlcomm.channel.client import CONTROL_TIMEOUT, drop_links
from rlcomm.cluster import RLCOMM_NAMESPACE, Cluster
from rlcomm.comm.identity import actor_name, registry
from rlcomm.errors import ChannelClosedError, ChannelError, ChannelLostError
from rlcomm.settings import get_settings

logger = logging.getLogger(__name__)

# The actor handles of the channels this process created, by group name.
_owned_groups: dict[str, list[Any]] = {}
_owned_lock = threading.Lock()


@dataclass(frozen=True)
class ChannelInfo:
    """What a handle needs to reach a channel; this is all a pickled handle carries.

    Attributes:
        node_ids: the Ray node id of each channel worker, by rank.
        incarnation: a unique id of this creation of the channel (a channel re-created
            under the same name is another channel).
    """

    name: str
    maxsize: int
    item_type: Any
    distributed: bool
    group_name: str
    node_ids: tuple[str, ...]
    incarnation: str
    local: bool = False


def check_name(channel_name: str) -> None:
    if not isinstance(channel_name, str) or not channel_name or ":" in channel_name:
        raise ValueError(f"a channel name must be a non-empty str without ':', got {channel_name!r}")


def launch(
    channel_name: str,
    maxsize: int,
    distributed: bool,
    node_rank: int,
    item_type: Any,
    cluster: Cluster | None,
) -> ChannelInfo:
    """Start the channel workers of a new channel and record their group in the registry.

    Raises:
        ChannelError: a channel of that name exists already, or a worker did not start.
        ValueError: ``node_rank`` is not in the cluster.
    """
    cluster = cluster or Cluster()
    if not distributed and not 0 <= node_rank < cluster.num_nodes:
        raise ValueError(
            f"create_channel: node_rank {node_rank} is not in the cluster of "
            f"{cluster.num_nodes} node(s)"
        )
    ranks = list(range(cluster.num_nodes)) if distributed else [node_rank]
    node_ids = tuple(cluster.node(r).node_id for r in ranks)
    group_name = group_name_of(channel_name)
    if not ray.get(registry().reserve_group.remote(group_name), timeout=CONTROL_TIMEOUT):
        raise ChannelError(
            f"a channel named {channel_name!r} exists already; connect to it with "
            f"connect_channel({channel_name!r}) or pick another name"
        )
    incarnation = uuid.uuid4().hex[:12]
    # cloudpickle: an item_type defined in a script's __main__ travels by value.
    blob = cloudpickle.dumps(item_type) if item_type is not None else b""
    actors: list[Any] = []
    try:
        actors = start_actors(group_name, node_ids, channel_name, maxsize, blob, distributed,
                              incarnation)
        try:
            # The first call on each actor waits for its __init__ and surfaces its errors.
            workers = ray.get([a.channel_node_info.remote() for a in actors],
                              timeout=get_settings().launch_timeout)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            raise ChannelError(
                f"create_channel: the worker(s) of channel {channel_name!r} did not start: {exc}"
            ) from exc
        record = {"worker_cls_name": "ChannelActor", "world_size": len(ranks),
                  "node_ranks": ranks, "workers": workers}
        ray.get(registry().set_group.remote(group_name, record), timeout=CONTROL_TIMEOUT)
    except BaseException:
        ray.get(registry().drop_group.remote(group_name), timeout=CONTROL_TIMEOUT)
        for actor in actors:
            ray.kill(actor, no_restart=True)
        raise
    with _owned_lock:
        _owned_groups[group_name] = actors
    return ChannelInfo(channel_name, maxsize, item_type, distributed, group_name, node_ids,
                       incarnation)


def lookup(channel_name: str, timeout: float) -> ChannelInfo:
    """The info of a running channel, waiting up to ``timeout`` seconds for it.

    Raises:
        ChannelError: no such channel in time.
        ChannelLostError: its worker does not answer.
    """
    group_name = group_name_of(channel_name)
    deadline = time.monotonic() + timeout
    while True:
        group = ray.get(registry().get_group.remote(group_name), timeout=CONTROL_TIMEOUT)
        if group and not group.get("pending"):
            break
        if time.monotonic() >= deadline:
            raise ChannelError(
                f"connect_channel: no channel named {channel_name!r} appeared within "
                f"{timeout}s; create it first with create_channel({channel_name!r}, ...)"
            )
        time.sleep(0.1)
    try:
        actor = ray.get_actor(actor_name(group_name, 0), namespace=RLCOMM_NAMESPACE)
        desc = ray.get(actor.channel_describe.remote(), timeout=CONTROL_TIMEOUT)
    except (ValueError, AttributeError, ray.exceptions.RayError) as exc:
        raise ChannelLostError(
            f"connect_channel: the worker of channel {channel_name!r} does not answer: {exc}"
        ) from exc
    blob = desc["item_type_blob"]
    item_type = pickle.loads(blob) if blob else None
    node_ids = tuple(w["node_id"] for w in group["workers"])
    return ChannelInfo(channel_name, desc["maxsize"], item_type, desc["distributed"],
                       group_name, node_ids, desc["incarnation"])


def shut_down(info: ChannelInfo) -> None:
    """End the channel workers and free the name; this process's links fail from now."""
    with _owned_lock:
        actors = _owned_groups.pop(info.group_name, None)
    if actors is None:
        actors = []
        for rank in range(len(info.node_ids)):
            try:
                actors.append(ray.get_actor(actor_name(info.group_name, rank),
                                            namespace=RLCOMM_NAMESPACE))
            except ValueError:  # gone already
                pass
    for actor in actors:
        ray.kill(actor, no_restart=True)
    try:
        ray.get(registry().drop_group.remote(info.group_name), timeout=CONTROL_TIMEOUT)
    except ray.exceptions.RayError as exc:
        logger.warning("could not unregister channel group %s: %s", info.group_name, exc)
    drop_links(info.group_name, info.incarnation,
               ChannelClosedError(f"channel {info.name!r} was shut down"))


def worker_stats(info: ChannelInfo) -> list[dict[str, Any]]:
    """Each channel worker's counters and node id (Ray calls)."""
    actors = [
        ray.get_actor(actor_name(info.group_name, r), namespace=RLCOMM_NAMESPACE)
        for r in range(len(info.node_ids))
    ]
    return ray.get([a.channel_stats.remote() for a in actors], timeout=CONTROL_TIMEOUT)


def worker_peek(info: ChannelInfo, rank: int, key: Any) -> list[Any]:
    """The items queued on ``key`` at channel worker ``rank`` (a Ray call)."""
    actor = ray.get_actor(actor_name(info.group_name, rank), namespace=RLCOMM_NAMESPACE)
    return ray.get(actor.channel_peek_all.remote(key), timeout=CONTROL_TIMEOUT)
