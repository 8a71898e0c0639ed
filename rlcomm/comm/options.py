"""``CollectiveGroupOptions``: knobs of a lazily created collective group, and timeouts."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from rlcomm.comm.transports import registry
from rlcomm.settings import get_settings, update_settings

#: RLinf's NCCL tuning fields: accepted, validated, ignored (see the class docstring).
_IGNORED_FIELDS = (
    "accel_cluster_size",
    "accel_max_ctas",
    "accel_min_ctas",
    "is_high_priority_stream",
    "use_ring_broadcast",
)



def set_default_timeout(seconds: float) -> None:
    """Set the process-wide default timeout of communication ops (seconds, > 0).

    The same as ``rlcomm.update_settings(comm_timeout=seconds)``.
    """
    if seconds <= 0:
        raise ValueError(f"the default timeout must be > 0 seconds, got {seconds}")
    update_settings(comm_timeout=float(seconds))


def default_timeout() -> float:
    """The process-wide default op timeout: the ``comm_timeout`` setting
    (``RLCOMM_COMM_TIMEOUT``, 180 s unless set)."""
    return get_settings().comm_timeout


@dataclass(frozen=True)
class CollectiveGroupOptions:
    """Options of the collective group two (or more) workers create on first contact.

    Args:
        timeout: seconds each op may take, including the first contact's rendezvous;
            ``None`` takes the process default (:func:`default_timeout`). Unlike the
            other fields it applies per call and need not match between the ends.
        transport: CPU payload path: ``"auto"`` (shared memory between workers of one
            node where available, else Gloo), ``"gloo"``, ``"shm"`` (same node only), or
            the name of another registered CPU transport
            (:mod:`~rlcomm.comm.transports.registry`).

    RLinf's fields are accepted too, so RLinf code that builds options runs unchanged.
    They tune an NCCL communicator (``ProcessGroupNCCL.Options``), which rlcomm does not
    expose: **they are ignored** on every pair, CPU pairs included, and do not take part
    in the options-mismatch check. They are validated (types, ranges) all the same.

    Args (RLinf's, ignored):
        accel_cluster_size: NCCL ``cluster_size`` (an int > 0 or ``None``).
        accel_max_ctas: NCCL ``max_ctas`` (an int > 0 or ``None``).
        accel_min_ctas: NCCL ``min_ctas`` (an int > 0 or ``None``, at most ``accel_max_ctas``).
        is_high_priority_stream: run NCCL on a high-priority CUDA stream.
        use_ring_broadcast: force RLinf's ring broadcast of tensor lists (rlcomm's
            broadcast picks its own algorithm).

    The fields other than ``timeout`` and RLinf's define the group: when both ends pass
    options on first contact and they differ, both ends get
    :class:`~rlcomm.OptionsMismatchError`. Later calls reuse the group; their options
    only change the timeout.
    """

    timeout: float | None = None
    transport: str = "auto"
    accel_cluster_size: int | None = None
    accel_max_ctas: int | None = None
    accel_min_ctas: int | None = None
    is_high_priority_stream: bool = False
    use_ring_broadcast: bool = False

    def __post_init__(self) -> None:
        for name in ("accel_cluster_size", "accel_max_ctas", "accel_min_ctas"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value <= 0
            ):
                raise ValueError(f"CollectiveGroupOptions.{name} must be an int > 0 or None, got {value!r}")
        if (
            self.accel_min_ctas is not None
            and self.accel_max_ctas is not None
            and self.accel_min_ctas > self.accel_max_ctas
        ):
            raise ValueError(
                f"CollectiveGroupOptions: accel_min_ctas ({self.accel_min_ctas}) is above "
                f"accel_max_ctas ({self.accel_max_ctas})"
            )
        for name in ("is_high_priority_stream", "use_ring_broadcast"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"CollectiveGroupOptions.{name} must be a bool, got {getattr(self, name)!r}")
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError(f"CollectiveGroupOptions.timeout must be > 0, got {self.timeout}")
        choices = ("auto", *registry.names(registry.CPU))
        if self.transport not in choices:
            raise ValueError(
                f"CollectiveGroupOptions.transport must be one of {choices}, "
                f"got {self.transport!r}"
            )

    def is_empty_options(self) -> bool:
        """Whether every field has its default (RLinf's name)."""
        return self == CollectiveGroupOptions()

    def effective_timeout(self) -> float:
        return default_timeout() if self.timeout is None else self.timeout

    def group_fields(self) -> dict[str, Any]:
        """The fields that define the group and must match between the ends."""
        data = asdict(self)
        for name in ("timeout", *_IGNORED_FIELDS):
            data.pop(name)
        return data

    @classmethod
    def from_group_fields(cls, data: dict[str, Any]) -> CollectiveGroupOptions:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def max_unread_bytes() -> int:
    """The cap on a connection's received-but-unread bytes (``RLCOMM_MAX_UNREAD_BYTES``)."""
    return get_settings().max_unread_bytes


def max_message_bytes() -> int:
    """The largest message a receiver accepts (``RLCOMM_MAX_MESSAGE_BYTES``)."""
    return get_settings().max_message_bytes


def set_memory_limits(max_unread: int | None = None, max_message: int | None = None) -> None:
    """Change this process's memory limits: ``max_unread`` bytes held unread per
    connection (connections made from now on), ``max_message`` bytes per message."""
    changes = {}
    for key, value in (("max_unread_bytes", max_unread), ("max_message_bytes", max_message)):
        if value is not None:
            if value <= 0:
                raise ValueError(f"memory limits must be > 0 bytes, got {value}")
            changes[key] = int(value)
    update_settings(**changes)


def op_timeout(options: CollectiveGroupOptions | None) -> float:
    if options is None or options.timeout is None:
        return get_settings().comm_timeout  # default_timeout(), on every op's path
    return options.timeout
