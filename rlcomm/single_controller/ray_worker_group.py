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
from rlcomm.comm.identity import actor_name
from rlcomm.errors import WorkerGroupError
from rlcomm.placement import NodeSpec, Placement, PlacementStrategy
from rlcomm.settings import GROUP_NAME_ENV
from rlcomm.single_controller.class_with_init import RayClassWithInitArgs
from rlcomm.single_controller.colocated import spawn_roles
from rlcomm.single_controller.decorator import dispatch_spec_of
from rlcomm.single_controller.dispatched_call import DispatchedMethod
from rlcomm.single_controller.resource_pool import RayResourcePool
from rlcomm.worker.dispatch import (
    NdLayout,
    check_signature,
    collect_batches,
    nd_layout,
    split_call_args,
)
from rlcomm.worker.group import WorkerGroup
from rlcomm.worker.result import GroupResult
from rlcomm.worker.worker import Worker

__all__ = ["PROTECTED_WORKER_ENV", "RayClassWithInitArgs", "RayWorkerGroup"]

#: The variables rlcomm sets on every worker; ``worker_env`` may not set them (verl
#: raises ``ValueError`` for its own list, which this one contains).
PROTECTED_WORKER_ENV = frozenset({
    "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR",
    "MASTER_PORT", "RAY_LOCAL_WORLD_SIZE", "WG_PREFIX", "WG_BACKEND", GROUP_NAME_ENV,
})

#: ``device_name=`` values verl passes; on a CPU pool every one of them means CPU.
_DEVICE_NAMES = ("cuda", "cpu", "npu", "gpu")


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
    Methods decorated with ``@register`` become dispatching methods of the group; the
    other group methods are those of :class:`~rlcomm.WorkerGroup` (the public methods
    the worker class adds, and ``gpu_info``). Any method of the worker class, by name,
    can be called through :meth:`execute_all_sync` and the other ``execute_*`` calls.

    Args:
        resource_pool: where the workers run.
        ray_cls_with_init: the worker class (a :class:`~rlcomm.Worker` subclass, with or
            without ``@ray.remote``) and its ``__init__`` arguments.
        name_prefix: prefix of the group name (default: 6 random characters); the group
            is named ``name_prefix + class name`` and its workers ``<group>:<rank>``.
        cluster: the cluster (default: the running Ray's).
        worker_env: verl's extra environment variables for every worker (the user
            layer of ``launch(env_vars=...)``).
        device_name: verl's accelerator name (``"cuda"``, ``"npu"``, ``"cpu"``); kept
            as ``self.device_name``. rlcomm finds GPUs itself, so on a CPU pool
            (``use_gpu=False``) the value changes nothing.
        worker_names: with ``resource_pool=None``, attach to the running workers of
            these names (verl's detached form; see :meth:`from_detached`).
        worker_handles: verl's argument, accepted and not used.
        bin_pack: verl's argument, accepted and ignored (the pool's slots decide
            placement).
        detached: verl's argument; ``True`` is refused (an rlcomm group lives with its
            creator).
        ray_wait_register_center_timeout: verl's argument, accepted and not used.
        **launch_options: more keyword arguments of :meth:`WorkerGroup.launch`
            (``env_vars``, ``max_concurrency``, ...).

    Raises:
        TypeError: the class is not a ``Worker`` subclass.
        WorkerGroupError: the name is taken, or the pool has ``max_colocate_count``
            live groups.
        ValueError: the pool does not fit the cluster; ``worker_env`` sets a variable
            rlcomm sets (:data:`PROTECTED_WORKER_ENV`; verl raises ``ValueError`` too);
            an unknown ``device_name``; ``detached=True``.
    """

    def __init__(
        self,
        resource_pool: RayResourcePool | None = None,
        ray_cls_with_init: RayClassWithInitArgs | None = None,
        name_prefix: str | None = None,
        cluster: Cluster | None = None,
        *,
        worker_env: dict[str, str] | None = None,
        device_name: str = "cuda",
        worker_names: Sequence[str] | None = None,
        worker_handles: Sequence[Any] | None = None,
        bin_pack: bool = True,
        detached: bool = False,
        ray_wait_register_center_timeout: int = 300,
        **launch_options: Any,
    ):
        if ray_cls_with_init is None:
            raise TypeError("RayWorkerGroup: ray_cls_with_init is required")
        if not isinstance(device_name, str) or device_name.lower() not in _DEVICE_NAMES:
            raise ValueError(f"RayWorkerGroup: device_name must be one of {_DEVICE_NAMES}, got {device_name!r}")
        if detached:
            raise ValueError(
                "RayWorkerGroup: detached=True is not supported; an rlcomm group lives as long "
                "as the process that made it. Attach from elsewhere with from_detached(worker_names=...)"
            )
        super().__init__(ray_cls_with_init.cls, ray_cls_with_init.args, ray_cls_with_init.kwargs)
        if not (isinstance(self._worker_cls, type) and issubclass(self._worker_cls, Worker)):
            raise TypeError(f"RayWorkerGroup: {self._worker_cls!r} is not a rlcomm Worker subclass")
        self.device_name = device_name
        self.ray_cls_with_init = ray_cls_with_init
        self.sub_cls_name = ""
        self._resource_pool: RayResourcePool | None = resource_pool
        self._mesh_layouts: dict[str, NdLayout] = {}
        self._dispatch_specs = _registered_methods(self._worker_cls)
        if resource_pool is None:
            if not worker_names:
                raise ValueError(
                    "RayWorkerGroup: give a resource_pool, or worker_names of running workers to attach to"
                )
            self._attach(worker_names)
            self.name_prefix = name_prefix or ""
            return
        if worker_env:
            clash = sorted(set(worker_env) & PROTECTED_WORKER_ENV)
            if clash:
                raise ValueError(
                    f"RayWorkerGroup: worker_env cannot override the variables rlcomm sets: {clash}"
                )
            launch_options["env_vars"] = {**launch_options.get("env_vars", {}), **worker_env}
        cluster = cluster or Cluster()
        placements = resource_pool.placements(cluster)
        prefix = _random_prefix() if name_prefix is None else name_prefix
        self.name_prefix = prefix
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

    def _extra_builder_env(self) -> dict[str, str]:
        return {"WG_PREFIX": self.name_prefix}

    def _attach(self, worker_names: Sequence[str]) -> None:
        """Become a handle on the running group whose workers have these actor names."""
        groups = {str(n).rsplit(":", 1)[0] for n in worker_names}
        if len(groups) != 1:
            raise ValueError(
                f"RayWorkerGroup: worker_names {list(worker_names)!r} are not the workers of one "
                "group (expected '<group>:<rank>' names, as worker_names gives them)"
            )
        base = WorkerGroup.from_group_name(self._worker_cls, groups.pop())
        if base.world_size != len(worker_names):
            raise WorkerGroupError(
                f"RayWorkerGroup: group {base._name!r} has {base.world_size} workers, "
                f"{len(worker_names)} names were given"
            )
        self._adopt(base)

    @classmethod
    def from_detached(
        cls,
        name_prefix: str | None = None,
        worker_names: Sequence[str] | None = None,
        worker_handles: Sequence[Any] | None = None,
        ray_cls_with_init: RayClassWithInitArgs | None = None,
        **kwargs: Any,
    ) -> RayWorkerGroup:
        """A handle on running workers, from any process of the Ray cluster (verl's name).

        Args:
            worker_names: the :attr:`worker_names` of the group.
            ray_cls_with_init: its worker class (the arguments are not used).
            name_prefix: verl's argument, accepted and not needed.
            worker_handles: verl's argument, accepted and not needed.
            **kwargs: more arguments of the :class:`RayWorkerGroup` constructor.

        Raises:
            ValueError: no names, or names of several groups.
            WorkerGroupError: no such running group.
        """
        return cls(
            None,
            ray_cls_with_init,
            name_prefix=name_prefix,
            worker_names=worker_names,
            worker_handles=worker_handles,
            **kwargs,
        )

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
        names = [actor_name(group_name, r) for r in range(base.world_size)]
        return cls(None, RayClassWithInitArgs(worker_cls), worker_names=names)

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

    def execute_func_rank_zero(self, func: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``func(*args, **kwargs)`` in rank 0's process and return its result (verl).

        ``func`` must be picklable (module-level functions are; closures go by value).

        Raises:
            WorkerCallError: it raised on rank 0.
        """
        self._check_live()
        refs = self._call_each("_rlcomm_apply", [0], [(func, False, *args)], [kwargs])
        return GroupResult(self._name, getattr(func, "__name__", "func"), [0], refs).wait()[0]  # type: ignore[arg-type]

    def execute_with_func_generator(self, func: Any, *args: Any, **kwargs: Any) -> Any:
        """Split the batch arguments over the ranks, run ``func(worker, *chunk_args,
        **chunk_kwargs)`` on each, and concatenate the outputs (verl's
        ``DP_COMPUTE_PROTO_WITH_FUNC``). Non-batch arguments go whole to every rank.

        Raises:
            WorkerCallError: a rank raised.
            ValueError: batch arguments of different lengths.
        """
        self._check_live()
        where = f"execute_with_func_generator({getattr(func, '__name__', func)!r}) on group {self._name!r}"
        n = self.world_size
        per_args, per_kwargs, pad = split_call_args(args, kwargs, n, False, where)
        ranks = list(range(n))
        refs = self._call_each("_rlcomm_apply", ranks, [(func, True, *a) for a in per_args], per_kwargs)
        outputs = GroupResult(self._name, "execute_with_func_generator", ranks, refs).wait()  # type: ignore[arg-type]
        return collect_batches(outputs, pad)

    def spawn(self, prefix_set: Any) -> dict[str, RayWorkerGroup]:
        """verl's colocated groups: one group per role of a group made from
        :func:`~rlcomm.single_controller.create_colocated_worker_cls`, sharing its
        workers; group ``d[role]`` has the role's methods under their own names.

        Raises:
            ValueError: this group's class is not colocated, or a prefix is not a role.
        """
        return spawn_roles(self, prefix_set)

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
