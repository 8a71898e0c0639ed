"""rlcomm: communication between distributed RL workers, on Ray and torch.distributed."""

from rlcomm._version import __version__
from rlcomm.channel import Channel
from rlcomm.cluster import Cluster
from rlcomm.comm.codec import set_strict_mode
from rlcomm.comm.identity.address import WorkerAddress
from rlcomm.comm.options import CollectiveGroupOptions, set_default_timeout, set_memory_limits
from rlcomm.comm.status import JobStatus, job_status
from rlcomm.comm.transports.shm_handover import empty, empty_like
from rlcomm.comm.work import AsyncWork
from rlcomm.errors import (
    AuthenticationError,
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
    "RlcommError",
    "RlcommTimeoutError",
    "Worker",
    "WorkerAddress",
    "WorkerCallError",
    "WorkerGroup",
    "WorkerGroupError",
    "job_status",
]
