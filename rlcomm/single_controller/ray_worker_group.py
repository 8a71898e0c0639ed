"""verl's ``RayWorkerGroup`` on rlcomm workers.

A :class:`RayWorkerGroup` is an rlcomm :class:`~rlcomm.worker.group.WorkerGroup` placed on
a :class:`~rlcomm.single_controller.RayResourcePool`, with verl's calls
(``execute_all_sync`` and friends) and its ``@register`` methods bound as dispatching
group methods. Everything of ``WorkerGroup`` (``execute_on``, ``run_all_workers_*``,
``shutdown``, ...) works on it too.
"""

from __future__ import annotations

import random
import string
from collections.abc import Sequence
from typing import Any

from rlcomm.cluster import Cluster
from rlcomm.placement import NodeSpec, Placement, PlacementStrategy
from rlcomm.single_controller.decorator import dispatch_spec_of
from rlcomm.single_controller.dispatched_call import DispatchedMethod
from rlcomm.single_controller.resource_pool import RayResourcePool
from rlcomm.worker.dispatch import NdLayout, check_signature, nd_layout
from rlcomm.worker.group import WorkerGroup, actor_name
from rlcomm.worker.result import GroupResult
from rlcomm.worker.worker import Worker

__all__ = ["RayClassWithInitArgs", "RayWorkerGroup"]


class RayClassWithInitArgs:
    """A worker class and the arguments of its ``__init__`` (verl's spelling).

    Args:
        cls: a :class:`~rlcomm.Worker` subclass, plain or wrapped in ``@ray.remote``.
        *args: passed to every rank's ``__init__``.
        **kwargs: passed to every rank's ``__init__``.
    """

    def __init__(self, cls: type, *args: Any, **kwargs: Any):
        self.cls = cls
        self.args = args
        self.kwargs = kwargs

    def __repr__(self) -> str:
        return f"RayClassWithInitArgs({getattr(self.cls, '__name__', self.cls)!r})"


class _FixedPlacements(PlacementStrategy):
    def __init__(self, placements: list[Placement]):
        self._placements = placements

    def get_placements(self, nodes: Sequence[NodeSpec]) -> list[Placement]:
        return list(self._placements)


def _registered_methods(worker_cls: type) -> dict[str, Any]:
    return {
        name: spec
        for name in dir(worker_cls)
        if not name.startswith("__")
        and (spec := dispatch_spec_of(getattr(worker_cls, name, None))) is not None
    }


def _random_prefix() -> str:
    return "".join(random.choices(string.ascii_letters + string.digits, k=6))


class RayWorkerGroup(WorkerGroup):
    """verl's worker group: one rlcomm worker per slot of a resource pool.

    Rank ``i`` runs on the pool's slot ``i``, so groups built on one pool are colocated.
    Methods decorated with ``@register`` become dispatching methods of the group; every
    public method is also callable through :meth:`execute_all_sync` and the other
    ``execute_*`` calls.

    Args:
        resource_pool: where the workers run.
        ray_cls_with_init: the worker class (a :class:`~rlcomm.Worker` subclass, with or
            without ``@ray.remote``) and its ``__init__`` arguments.
        name_prefix: prefix of the group name (default: 6 random characters); the group
            is named ``name_prefix + class name`` and its workers ``<group>:<rank>``.
        cluster: the cluster (default: the running Ray's).
        launch_options: more keyword arguments of :meth:`WorkerGroup.launch`
            (``env_vars``, ``max_concurrency``, ...).

    Raises:
        TypeError: the class is not a ``Worker`` subclass.
        WorkerGroupError: the name is taken, or the pool has ``max_colocate_count``
            live groups.
        ValueError: the pool does not fit the cluster.
    """

    def __init__(
        self,
        resource_pool: RayResourcePool,
        ray_cls_with_init: RayClassWithInitArgs,
        name_prefix: str | None = None,
        cluster: Cluster | None = None,
        **launch_options: Any,
    ):
        super().__init__(ray_cls_with_init.cls, ray_cls_with_init.args, ray_cls_with_init.kwargs)
        if not (isinstance(self._worker_cls, type) and issubclass(self._worker_cls, Worker)):
            raise TypeError(f"RayWorkerGroup: {self._worker_cls!r} is not a rlcomm Worker subclass")
        self._resource_pool: RayResourcePool | None = resource_pool
        self._mesh_layouts: dict[str, NdLayout] = {}
        self._dispatch_specs = _registered_methods(self._worker_cls)
        cluster = cluster or Cluster()
        placements = resource_pool.placements(cluster)
        prefix = _random_prefix() if name_prefix is None else name_prefix
        resource_pool._acquire_group()
        try:
            self.launch(
                cluster,
                _FixedPlacements(placements),
                name=f"{prefix}{self.worker_cls_name}",
                **launch_options,
            )
        except BaseException:
            resource_pool._release_group()
            raise

    def _bind_methods(self) -> None:
        super()._bind_methods()
        for name, spec in self._dispatch_specs.items():
            setattr(self, name, DispatchedMethod(self, name, spec))

    @classmethod
    def from_group_name(cls, worker_cls: type, group_name: str) -> RayWorkerGroup:
        """Reconnect to a running group by name, with its ``@register`` methods bound.

        The result has no resource pool; shutting it down ends the group's actors.

        Raises:
            WorkerGroupError: no group of that name is running.
        """
        base = WorkerGroup.from_group_name(worker_cls, group_name)
        group = cls.__new__(cls)
        group.__dict__.update(base.__dict__)
        group._resource_pool = None
        group._mesh_layouts = {}
        group._dispatch_specs = _registered_methods(group._worker_cls)
        group._bind_methods()
        return group

    @property
    def resource_pool(self) -> RayResourcePool | None:
        """The pool the group runs on (``None`` for a group found by name)."""
        return self._resource_pool

    @property
    def worker_names(self) -> list[str]:
        """The Ray actor names of the workers, by rank (namespace ``rlcomm``)."""
        return [actor_name(self._name, r) for r in range(self.world_size)]  # type: ignore[arg-type]

    def _mesh_layout(self, mesh_name: str) -> NdLayout:
        """The ranks' registered ``(dp_rank, is_collect)`` for ``mesh_name`` (asked once)."""
        if mesh_name not in self._mesh_layouts:
            ranks = list(range(self.world_size))
            refs = self._call_each("_query_mesh_info", ranks, [(mesh_name,)] * len(ranks), [{}] * len(ranks))
            infos = GroupResult(self._name, "_query_mesh_info", ranks, refs).wait(timeout=120)  # type: ignore[arg-type]
            missing = [r for r, info in enumerate(infos) if info is None]
            if missing:
                raise ValueError(
                    f"mesh {mesh_name!r}: ranks {missing} of group {self._name!r} did not register "
                    "it; call self._register_dispatch_collect_info(mesh_name, dp_rank, is_collect) "
                    "in the worker's __init__"
                )
            self._mesh_layouts[mesh_name] = nd_layout(infos, mesh_name)
        return self._mesh_layouts[mesh_name]

    # -- verl's execute_* -----------------------------------------------------------------

    def execute_all_async(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Run a method on every rank; the Ray futures, by rank.

        An argument that is a list with one entry per rank is split (entry ``i`` to rank
        ``i``); any other argument goes whole to every rank.

        Raises:
            AttributeError, TypeError: no such method, or arguments that do not fit it.
        """
        self._check_live()
        where = f"execute_all({method_name!r}) on group {self._name!r}"
        check_signature(self._worker_cls, method_name, args, kwargs, where)
        n = self.world_size

        def pick(v: Any, r: int) -> Any:
            return v[r] if isinstance(v, list) and len(v) == n else v

        per_args = [tuple(pick(a, r) for a in args) for r in range(n)]
        per_kwargs = [{k: pick(v, r) for k, v in kwargs.items()} for r in range(n)]
        return self._call_each(method_name, list(range(n)), per_args, per_kwargs)

    execute_all = execute_all_async

    def execute_all_sync(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Like :meth:`execute_all_async`, and wait: the results, by rank.

        Raises:
            WorkerCallError: a rank raised or died.
        """
        refs = self.execute_all_async(method_name, *args, **kwargs)
        return GroupResult(self._name, method_name, list(range(len(refs))), refs).wait()  # type: ignore[arg-type]

    def execute_rank_zero_async(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """Run a method on rank 0 only; its Ray future."""
        self._check_live()
        check_signature(self._worker_cls, method_name, args, kwargs, f"execute_rank_zero({method_name!r})")
        return self._call_each(method_name, [0], [args], [kwargs])[0]

    execute_rank_zero = execute_rank_zero_async

    def execute_rank_zero_sync(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """Run a method on rank 0 only and return its result.

        Raises:
            WorkerCallError: rank 0 raised or died.
        """
        ref = self.execute_rank_zero_async(method_name, *args, **kwargs)
        return GroupResult(self._name, method_name, [0], [ref]).wait()[0]  # type: ignore[arg-type]

    def shutdown(
        self, cleanup_method: str | None = None, timeout: float | None = 30.0, force: bool = False
    ) -> bool:
        """Like :meth:`WorkerGroup.shutdown`; also frees this group's place on the pool."""
        first = not self._shut_down
        clean = super().shutdown(cleanup_method, timeout, force)
        if first and self._resource_pool is not None:
            self._resource_pool._release_group()
        return clean
