"""How a launched process becomes an rlcomm endpoint: its environment, settings, logs and
communication, set up under one address before any user code runs.

Every process that rlcomm launches as a Ray actor (a worker of a
:class:`~rlcomm.WorkerGroup`, a channel worker) starts with a :class:`ProcessContext`
made by its launcher and calls :func:`start_process` first. The launcher side has
:func:`inherited_env`: the part of its own environment a launched process gets.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rlcomm.comm.identity.address import WorkerAddress
from rlcomm.comm.manager import CommManager
from rlcomm.settings import GROUP_NAME_ENV, get_settings, update_settings

#: Variables of the launching process that never go to launched processes: Ray's own,
#: the devices Ray or rlcomm assign per process, and rlcomm's group name.
_INHERIT_SKIP_PREFIXES = ("RAY_",)
_INHERIT_SKIP_SUFFIXES = ("_VISIBLE_DEVICES",)
_INHERIT_SKIP = frozenset({GROUP_NAME_ENV})

_LOG_HANDLER_NAME = "rlcomm-worker-stderr"


@dataclass
class ProcessContext:
    """What a launched process needs before its own ``__init__`` runs.

    Attributes:
        group_name: its group (a worker group, or ``channel.<name>``).
        rank: its rank in the group.
        world_size: the number of processes in the group.
        env: environment variables to set first.
        disable_distributed_log: skip passing rlcomm's log records on to stderr.
        settings: the live settings the launcher changed (``live_changes()``).
    """

    group_name: str
    rank: int
    world_size: int
    env: dict[str, str] = field(default_factory=dict)
    disable_distributed_log: bool = False
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def address(self) -> WorkerAddress:
        return WorkerAddress(self.group_name, (self.rank,))


def inherited_env(
    exclude: Mapping[str, str] = (), environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The launching process's environment, as NeMo-RL passes it to its workers:
    without Ray's ``RAY_*`` variables, the ``*_VISIBLE_DEVICES`` and the keys of
    ``exclude`` (identity variables the launcher sets itself)."""
    environ = os.environ if environ is None else environ
    return {
        k: v
        for k, v in environ.items()
        if k not in exclude
        and k not in _INHERIT_SKIP
        and not k.startswith(_INHERIT_SKIP_PREFIXES)
        and not k.endswith(_INHERIT_SKIP_SUFFIXES)
    }


def pass_on_rlcomm_logs(level: str) -> None:
    """Write the ``rlcomm`` logger's records of ``level`` and above to stderr, which Ray
    forwards to the driver. Only the ``rlcomm`` logger is touched (never the root
    logger), and only once per process."""
    rlcomm_logger = logging.getLogger("rlcomm")
    rlcomm_logger.setLevel(level)
    if any(h.get_name() == _LOG_HANDLER_NAME for h in rlcomm_logger.handlers):
        return
    handler = logging.StreamHandler()
    handler.set_name(_LOG_HANDLER_NAME)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    rlcomm_logger.addHandler(handler)


def start_process(ctx: ProcessContext) -> CommManager:
    """Set this process up as the endpoint ``ctx.address``: environment, the launcher's
    live settings, log forwarding, then its :class:`CommManager` (registered, reachable
    by peers from now on). Call it once, first thing in the launched process."""
    os.environ.update(ctx.env)
    os.environ[GROUP_NAME_ENV] = ctx.group_name
    if ctx.settings:
        update_settings(**ctx.settings)
    if not ctx.disable_distributed_log:
        pass_on_rlcomm_logs(get_settings().log_level)
    return CommManager.start(ctx.address)
