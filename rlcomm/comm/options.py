"""``CollectiveGroupOptions``: knobs of a lazily created collective group, and timeouts."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from rlcomm.settings import get_settings, update_settings

_TRANSPORTS = ("auto", "gloo", "shm")


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
            node where available, else Gloo), ``"gloo"`` or ``"shm"`` (same node only).

    The fields other than ``timeout`` define the group: when both ends pass options on
    first contact and they differ, both ends get :class:`~rlcomm.OptionsMismatchError`.
    Later calls reuse the group; their options only change the timeout.
    """

    timeout: float | None = None
    transport: str = "auto"

    def __post_init__(self) -> None:
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError(f"CollectiveGroupOptions.timeout must be > 0, got {self.timeout}")
        if self.transport not in _TRANSPORTS:
            raise ValueError(
                f"CollectiveGroupOptions.transport must be one of {_TRANSPORTS}, "
                f"got {self.transport!r}"
            )

    def effective_timeout(self) -> float:
        return default_timeout() if self.timeout is None else self.timeout

    def group_fields(self) -> dict[str, Any]:
        """The fields that define the group and must match between the ends."""
        data = asdict(self)
        data.pop("timeout")
        return data

    @classmethod
    def from_group_fields(cls, data: dict[str, Any]) -> CollectiveGroupOptions:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def op_timeout(options: CollectiveGroupOptions | None) -> float:
    if options is None or options.timeout is None:
        return default_timeout()
    return options.timeout
