"""rlcomm: communication between distributed RL workers, on Ray and torch.distributed.

The public names are imported on first use (PEP 562), so that a tool that needs few of
them (``python -m rlcomm status``) does not import torch; ``from rlcomm import Worker``
and ``rlcomm.Worker`` work as usual.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from rlcomm._version import __version__

if TYPE_CHECKING:  # the same names, for type checkers and the API reference
    from rlcomm.channel import Channel
    from rlcomm.cluster import Cluster
    from rlcomm.comm.bucket_iter import BucketIterator, Buckets
    from rlcomm.comm.buckets import Shard
    from rlcomm.comm.codec import set_strict_mode
    from rlcomm.comm.identity.address import WorkerAddress
    from rlcomm.comm.options import CollectiveGroupOptions, set_default_timeout, set_memory_limits
    from rlcomm.comm.push import PushedWeights, WeightPusher
    from rlcomm.comm.status import JobStatus, job_status
    from rlcomm.comm.transports.shm_handover import empty, empty_like
    from rlcomm.comm.work import AsyncWork
    from rlcomm.errors import (
        AuthenticationError,
        CapacityError,
        ChannelClosedError,
        ChannelEmpty,
        ChannelError,
        ChannelFull,
        ChannelLostError,
        ChannelTypeError,
        CodecError,
        CommError,
        CommTimeoutError,
        OptionsMismatchError,
        PeerLostError,
        PeerNotFoundError,
        ProtocolMismatchError,
        RlcommError,
        RlcommTimeoutError,
        WorkerCallError,
        WorkerGroupError,
    )
    from rlcomm.placement import (
        FlexiblePlacementStrategy,
        NodePlacementStrategy,
        PackedPlacementStrategy,
        Placement,
        PlacementStrategy,
    )
    from rlcomm.settings import Settings, SettingsError, get_settings, update_settings
    from rlcomm.worker.group import WorkerGroup
    from rlcomm.worker.multi_worker_future import MultiWorkerFuture
    from rlcomm.worker.result import GroupResult
    from rlcomm.worker.sharding import NamedSharding
    from rlcomm.worker.worker import Worker

#: Each public name, and the module it comes from.
_MODULE_OF = {
    "Channel": "rlcomm.channel",
    "Cluster": "rlcomm.cluster",
    "BucketIterator": "rlcomm.comm.bucket_iter",
    "Buckets": "rlcomm.comm.bucket_iter",
    "Shard": "rlcomm.comm.buckets",
    "set_strict_mode": "rlcomm.comm.codec",
    "WorkerAddress": "rlcomm.comm.identity.address",
    "CollectiveGroupOptions": "rlcomm.comm.options",
    "set_default_timeout": "rlcomm.comm.options",
    "set_memory_limits": "rlcomm.comm.options",
    "PushedWeights": "rlcomm.comm.push",
    "WeightPusher": "rlcomm.comm.push",
    "JobStatus": "rlcomm.comm.status",
    "job_status": "rlcomm.comm.status",
    "empty": "rlcomm.comm.transports.shm_handover",
    "empty_like": "rlcomm.comm.transports.shm_handover",
    "AsyncWork": "rlcomm.comm.work",
    "AuthenticationError": "rlcomm.errors",
    "CapacityError": "rlcomm.errors",
    "ChannelClosedError": "rlcomm.errors",
    "ChannelEmpty": "rlcomm.errors",
    "ChannelError": "rlcomm.errors",
    "ChannelFull": "rlcomm.errors",
    "ChannelLostError": "rlcomm.errors",
    "ChannelTypeError": "rlcomm.errors",
    "CodecError": "rlcomm.errors",
    "CommError": "rlcomm.errors",
    "CommTimeoutError": "rlcomm.errors",
    "OptionsMismatchError": "rlcomm.errors",
    "PeerLostError": "rlcomm.errors",
    "PeerNotFoundError": "rlcomm.errors",
    "ProtocolMismatchError": "rlcomm.errors",
    "RlcommError": "rlcomm.errors",
    "RlcommTimeoutError": "rlcomm.errors",
    "WorkerCallError": "rlcomm.errors",
    "WorkerGroupError": "rlcomm.errors",
    "FlexiblePlacementStrategy": "rlcomm.placement",
    "NodePlacementStrategy": "rlcomm.placement",
    "PackedPlacementStrategy": "rlcomm.placement",
    "Placement": "rlcomm.placement",
    "PlacementStrategy": "rlcomm.placement",
    "Settings": "rlcomm.settings",
    "SettingsError": "rlcomm.settings",
    "get_settings": "rlcomm.settings",
    "update_settings": "rlcomm.settings",
    "WorkerGroup": "rlcomm.worker.group",
    "MultiWorkerFuture": "rlcomm.worker.multi_worker_future",
    "GroupResult": "rlcomm.worker.result",
    "NamedSharding": "rlcomm.worker.sharding",
    "Worker": "rlcomm.worker.worker",
}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups find it without this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))


__all__ = [
    "__version__",
    "empty",
    "empty_like",
    "Settings",
    "SettingsError",
    "get_settings",
    "update_settings",
    "AsyncWork",
    "CollectiveGroupOptions",
    "set_default_timeout",
    "set_memory_limits",
    "set_strict_mode",
    "AuthenticationError",
    "BucketIterator",
    "Buckets",
    "CapacityError",
    "Channel",
    "ChannelClosedError",
    "ChannelEmpty",
    "ChannelError",
    "ChannelFull",
    "ChannelLostError",
    "ChannelTypeError",
    "Cluster",
    "CodecError",
    "CommError",
    "CommTimeoutError",
    "FlexiblePlacementStrategy",
    "GroupResult",
    "JobStatus",
    "MultiWorkerFuture",
    "NamedSharding",
    "NodePlacementStrategy",
    "OptionsMismatchError",
    "PackedPlacementStrategy",
    "PeerLostError",
    "PeerNotFoundError",
    "Placement",
    "PlacementStrategy",
    "ProtocolMismatchError",
    "PushedWeights",
    "RlcommError",
    "RlcommTimeoutError",
    "Shard",
    "WeightPusher",
    "Worker",
    "WorkerAddress",
    "WorkerCallError",
    "WorkerGroup",
    "WorkerGroupError",
    "job_status",
]
