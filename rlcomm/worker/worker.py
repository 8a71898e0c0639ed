"""The ``Worker`` base class: subclass it, launch it as a group, talk to other workers."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, TypeVar

from rlcomm.worker.address import WorkerAddress

if TYPE_CHECKING:
    from rlcomm.worker.group import WorkerGroup

W = TypeVar("W", bound="Worker")

#: Environment variable carrying the group name into a worker process.
GROUP_NAME_ENV = "RLCOMM_GROUP_NAME"


class Worker:
    """Base class of every rlcomm worker.

    Subclass it with a plain ``__init__`` and launch it with
    ``MyWorker.create_group(*args).launch(cluster, placement_strategy, name)``. Before your
    ``__init__`` runs, the process has ``MASTER_ADDR``, ``MASTER_PORT`` (a free port on
    rank 0's node), ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` and
    ``NODE_RANK`` set, so ``torch.distributed.init_process_group("gloo")`` works with no
    arguments, and ``self._rank``, ``self._world_size`` and ``self.worker_address`` are set.

    Args:
        parent_address: only for workers that are not launched by Ray (a sub-process
            forked by a worker): the parent's address, extended by ``rank``.
        world_size: with ``parent_address``: the number of sibling sub-workers.
        rank: with ``parent_address``: this sub-worker's rank among its siblings.
    """

    _rlcomm_bound: bool = False

    def __init__(
        self,
        parent_address: WorkerAddress | None = None,
        world_size: int | None = None,
        rank: int | None = None,
    ):
        if parent_address is not None:
            if rank is None or world_size is None:
                raise ValueError("Worker: a sub-worker needs parent_address, world_size and rank")
            self._bind_identity(parent_address.child(rank), world_size)
        elif not self._rlcomm_bound:
            group = os.environ.get(GROUP_NAME_ENV, "driver")
            self._bind_identity(
                WorkerAddress(group, (int(os.environ.get("RANK", 0)),)),
                int(os.environ.get("WORLD_SIZE", 1)),
            )

    def _bind_identity(self, address: WorkerAddress, world_size: int) -> None:
        self._worker_address = address
        self._rank = address.rank_path[-1]
        self._world_size = world_size
        self._rlcomm_bound = True

    @property
    def worker_address(self) -> WorkerAddress:
        """This worker's address: group name and rank path (``str()`` gives ``group:0``)."""
        return self._worker_address

    @property
    def worker_group_name(self) -> str:
        return self._worker_address.group_name

    @property
    def rank(self) -> int:
        """This worker's rank in its group (verl and NeMo-RL style alias of ``_rank``)."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The number of workers in this worker's group."""
        return self._world_size

    @classmethod
    def create_group(cls: type[W], *args: Any, **kwargs: Any) -> WorkerGroup[W]:
        """A not yet launched :class:`WorkerGroup` of this class; ``.launch(...)`` starts it.

        Args:
            args, kwargs: passed to every rank's ``__init__``.
        """
        from rlcomm.worker.group import WorkerGroup

        return WorkerGroup(cls, args, kwargs)
