"""``WorkerGroup``: one Ray actor per placement, and calls that run on every rank."""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import ray

from rlcomm.channel.client import CALL_SETTLE_TIMEOUT, settle_all
from rlcomm.cluster import RLCOMM_NAMESPACE, Cluster, connect_ray
from rlcomm.comm.identity import actor_name, check_group_name, registry
from rlcomm.errors import WorkerGroupError
from rlcomm.placement import (
    BundlePlacementStrategy,
    NodePlacementStrategy,
    PackedPlacementStrategy,
    Placement,
    PlacementStrategy,
)
from rlcomm.settings import get_settings
from rlcomm.worker.actor import (
    catch_failure_default,
    public_methods,
)
from rlcomm.worker.configure import (
    CONFIGURE_HOOK,
    unwrap_ray_remote,
)
from rlcomm.worker.launch import check_launch_args, start_actors
from rlcomm.worker.result import GroupResult
from rlcomm.worker.sharded_calls import ShardedCallsMixin
from rlcomm.worker.sharding import NamedSharding
from rlcomm.worker.worker import Worker

logger = logging.getLogger(__name__)

W = TypeVar("W", bound=Worker)

class _GroupMethod:
    """A worker method bound on a group (or on a one-shot rank selection)."""

    def __init__(self, group: WorkerGroup, name: str, ranks: Sequence[int] | None = None):
        self._group = group
        self._name = name
        self._ranks = ranks

    def __call__(self, *args: Any, **kwargs: Any) -> GroupResult:
        return self._group._call(self._name, self._ranks, args, kwargs)

    def __repr__(self) -> str:
        return f"<{self._group.worker_group_name}.{self._name}>"


class _RankSelection:
    """What ``execute_on(*ranks)`` returns: the next method call runs on those ranks only.

    One-shot and private to the caller, so two threads that use one group never see each
    other's selection.
    """

    def __init__(self, group: WorkerGroup, ranks: Sequence[int]):
        self._group = group
        self._ranks: list[int] | None = list(ranks)

    def __getattr__(self, name: str) -> _GroupMethod:
        if name not in self._group._methods:
            raise AttributeError(f"{self._group.worker_cls_name} has no public method {name!r}")
        ranks, self._ranks = self._ranks, None
        return _GroupMethod(self._group, name, ranks)


class WorkerGroup(ShardedCallsMixin, Generic[W]):
    """A group of workers of one class, one Ray actor per rank.

    Made by ``Worker.create_group(*args, **kwargs)`` and started by :meth:`launch`. Every
    public method of the worker class becomes a method of the group that runs on every
    rank and returns a :class:`GroupResult`. NeMo-RL's calls (``run_all_workers_*``,
    ``get_all_worker_results``, ``dp_size``, ...) come from
    :class:`~rlcomm.worker.sharded_calls.ShardedCallsMixin`.
    """

    def __init__(self, worker_cls: type[W], args: tuple = (), kwargs: dict | None = None):
        worker_cls, self._class_options = unwrap_ray_remote(worker_cls)
        self._worker_cls = worker_cls
        self._args = tuple(args)
        self._kwargs = dict(kwargs or {})
        self._name: str | None = None
        self._actors: list[Any] = []
        self._placements: list[Placement] = []
        self._methods: set[str] = set()
        self._shut_down = False
        self._lock = threading.Lock()
        self._master_addr: str | None = None
        self._master_port: int | None = None

    # -- properties -------------------------------------------------------------------------

    @property
    def worker_cls_name(self) -> str:
        return self._worker_cls.__name__

    @property
    def worker_group_name(self) -> str:
        self._check_live()
        return self._name  # type: ignore[return-value]

    @property
    def world_size(self) -> int:
        return len(self._actors)

    @property
    def workers(self) -> list[Any]:
        """The Ray actor handles, by rank."""
        return list(self._actors)

    @property
    def worker_info_list(self) -> list[dict[str, Any]]:
        """Per rank: its actor handle and placement."""
        return [
            {"rank": p.rank, "actor": a, "placement": p}
            for p, a in zip(self._placements, self._actors, strict=False)
        ]

    @property
    def placements(self) -> list[Placement]:
        return list(self._placements)

    @property
    def master_address(self) -> str | None:
        """``MASTER_ADDR`` of the workers: the IP of rank 0's node (NeMo-RL's name)."""
        return self._master_addr

    @property
    def master_port(self) -> int | None:
        """``MASTER_PORT`` of the workers: a port free on rank 0's node at launch."""
        return self._master_port

    # -- launch -----------------------------------------------------------------------------

    def launch(
        self,
        cluster: Cluster,
        placement_strategy: PlacementStrategy | None = None,
        name: str | None = None,
        max_concurrency: int | None = None,
        isolate_gpu: bool = True,
        catch_system_failure: bool | None = None,
        disable_distributed_log: bool = False,
        env_vars: dict[str, str] | None = None,
        sharding: NamedSharding | None = None,
        bundle_indices_list: list[tuple[int, list[int]]] | None = None,
    ) -> WorkerGroup[W]:
        """Start one actor per placement and return this group, launched.

        Args:
            cluster: where to run.
            placement_strategy: default one worker per GPU, or one CPU worker without GPUs.
            name: the group's unique name (default: class name plus a random suffix).
            max_concurrency: Ray's ``max_concurrency`` for each actor (threaded, or the
                async concurrency for classes with ``async def`` methods).
            isolate_gpu: set ``CUDA_VISIBLE_DEVICES`` to the worker's GPUs only.
            catch_system_failure: log fatal signals and ``sys.exit`` with the worker's
                address; default from ``RLCOMM_CATCH_FAILURE`` (on).
            disable_distributed_log: skip the worker-side logging set-up (by default a
                worker writes rlcomm's records at the ``log_level`` setting, WARNING, and
                above to its stderr, which Ray forwards to the driver).
            env_vars: extra environment variables for every worker. A worker class may
                adjust them (and its Ray resources and ``__init__`` kwargs) with a
                ``configure_worker(num_gpus, bundle_indices)`` hook. Precedence, as
                NeMo-RL documents it (lowest first): the class's ``@ray.remote``
                ``runtime_env``, this process's environment, ``env_vars``,
                ``configure_worker``, rlcomm's identity variables; see
                :mod:`rlcomm.worker.configure`.
            sharding: a :class:`NamedSharding` naming the axes of the ranks (e.g.
                ``NamedSharding([[0, 1], [2, 3]], ["dp", "tp"])``) for
                ``run_all_workers_sharded_data``, ``dp_size`` and
                ``get_dp_leader_worker_idx``. Its size must equal the number of workers.
            bundle_indices_list: NeMo-RL's tied worker groups, ``[(node_rank, [local
                indices]), ...]``: one worker per local index (GPU, or CPU slot without
                GPUs), each tuple a tied group that shares one shard of data and whose
                results count once. Replaces ``placement_strategy``.

        Raises:
            WorkerGroupError: the name is taken, a worker method clashes with a group
                method, or a worker's ``__init__`` failed.
            TypeError: an argument of the wrong type (a placement strategy where the
                cluster goes, a non-str name, ...).
            ValueError: a name with ``:``, the placement strategy does not fit the
                cluster, or the sharding does not fit the workers.
        """
        if self._actors or self._shut_down:
            raise WorkerGroupError(f"group {self._name} was launched already")
        check_launch_args(cluster, placement_strategy, name, max_concurrency, env_vars)
        methods = [m for m in public_methods(self._worker_cls) if m != CONFIGURE_HOOK]
        clashes = sorted(m for m in methods if hasattr(type(self), m))
        if clashes:
            raise WorkerGroupError(
                f"{self.worker_cls_name} defines {clashes}, which clash with WorkerGroup's own "
                "methods; rename them"
            )
        if bundle_indices_list is not None:
            if placement_strategy is not None:
                raise ValueError("launch: give placement_strategy or bundle_indices_list, not both")
            placement_strategy = BundlePlacementStrategy(bundle_indices_list)
        if placement_strategy is None:
            placement_strategy = (
                PackedPlacementStrategy(0, cluster.num_gpus - 1)
                if cluster.num_gpus
                else NodePlacementStrategy([0])
            )
        placements = placement_strategy.get_placements(cluster.node_specs())
        self._set_layout(len(placements), sharding, bundle_indices_list)
        name = name or f"{self.worker_cls_name}_{uuid.uuid4().hex[:6]}"
        if not ray.get(registry().reserve_group.remote(name)):
            raise WorkerGroupError(
                f"a worker group named {name!r} exists already; pick another name or shut it down"
            )
        try:
            started = start_actors(
                self._worker_cls,
                self._class_options,
                self._args,
                self._kwargs,
                cluster,
                placements,
                name,
                max_concurrency=max_concurrency,
                isolate_gpu=isolate_gpu,
                catch_system_failure=(
                    catch_failure_default() if catch_system_failure is None else catch_system_failure
                ),
                disable_distributed_log=disable_distributed_log,
                env_vars=env_vars or {},
                extra_env=self._extra_builder_env(),
                bundle_indices_of=self._worker_bundle_indices,
            )
        except BaseException:
            ray.get(registry().drop_group.remote(name))
            raise
        self._actors, self._placements, self._name = started.actors, placements, name
        self._master_addr, self._master_port = started.master
        self._methods = set(methods)
        self._bind_methods()
        return self

    def _extra_builder_env(self) -> dict[str, str]:
        """More identity variables a subclass sets on every worker (rlcomm's layer)."""
        return {}

    def _bind_methods(self) -> None:
        for method in self._methods:
            setattr(self, method, _GroupMethod(self, method))

    # -- calls ------------------------------------------------------------------------------

    def _check_live(self) -> None:
        if self._shut_down:
            raise WorkerGroupError(f"worker group {self._name!r} was shut down")
        if not self._actors:
            raise WorkerGroupError(
                f"the {self.worker_cls_name} group is not launched; call .launch(cluster, ...)"
            )

    def _call(
        self, method: str, ranks: Sequence[int] | None, args: tuple, kwargs: dict
    ) -> GroupResult:
        self._check_live()
        settle_all(CALL_SETTLE_TIMEOUT, report=False)  # the workers see our puts
        ranks = list(range(len(self._actors))) if ranks is None else list(ranks)
        refs = [getattr(self._actors[r], method).remote(*args, **kwargs) for r in ranks]
        return GroupResult(self._name, method, ranks, refs)  # type: ignore[arg-type]

    def execute_on(self, *ranks: int) -> WorkerGroup[W]:
        """The next method call (on the returned object) runs on ``ranks`` only.

        Thread-safe: the selection belongs to the returned object, not to the group.

        Raises:
            ValueError: a rank outside the group.
        """
        self._check_live()
        if not ranks:
            return self
        bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < len(self._actors)]
        if bad:
            raise ValueError(
                f"execute_on: ranks {bad} are not in group {self._name!r} of size {len(self._actors)}"
            )
        return _RankSelection(self, ranks)  # type: ignore[return-value]

    # -- lookup and shutdown ----------------------------------------------------------------

    @classmethod
    def from_group_name(cls, worker_cls: type[W], group_name: str) -> WorkerGroup[W]:
        """Reconnect to a running group by name (from the driver or from a worker).

        Looks in the Ray this process is attached to, else attaches to ``RAY_ADDRESS``
        (bounded by the ``connect_timeout`` setting); it never starts a new Ray.

        Raises:
            WorkerGroupError: no group of that name is running.
            RlcommError: no Ray is attached and ``RAY_ADDRESS`` is unset or unreachable.
        """
        check_group_name(group_name, "from_group_name")
        if not ray.is_initialized():
            connect_ray(os.environ.get("RAY_ADDRESS") or None, get_settings().connect_timeout,
                        start_local=False)
        info = ray.get(registry().get_group.remote(group_name), timeout=get_settings().connect_timeout)
        if not info or info.get("pending"):
            raise WorkerGroupError(
                f"no running worker group named {group_name!r} in the Ray at "
                f"{ray.get_runtime_context().gcs_address}; launch it first, or attach to the "
                "Ray where it runs (RAY_ADDRESS)"
            )
        group = cls(worker_cls)
        group._name = group_name
        group._actors = [
            ray.get_actor(actor_name(group_name, r), namespace=RLCOMM_NAMESPACE)
            for r in range(info["world_size"])
        ]
        group._methods = {m for m in public_methods(group._worker_cls) if m != CONFIGURE_HOOK}
        group._master_addr, group._master_port = info.get("master", (None, None))
        group._set_layout(info["world_size"], None, None)
        group._bind_methods()
        return group

    def shutdown(
        self, cleanup_method: str | None = None, timeout: float | None = 30.0, force: bool = False
    ) -> bool:
        """End every actor of the group; later calls on it raise :class:`WorkerGroupError`.

        Args:
            cleanup_method: a worker method to call on every rank first (graceful).
            timeout: seconds the cleanup may take (``None``: no limit); then the actors
                are killed anyway, so this returns within about ``timeout`` seconds.
            force: kill at once, skipping ``cleanup_method``.

        Returns:
            True if the cleanup (when asked) finished without error on every rank in
            time; the actors are killed either way.
        """
        with self._lock:
            if self._shut_down:
                return True
            self._shut_down = True
        clean = True
        if cleanup_method and not force:
            refs = [getattr(a, cleanup_method).remote() for a in self._actors]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
            clean = len(ready) == len(refs)
            if not clean:
                logger.warning(
                    "%s.%s() did not finish within %ss; killing the workers",
                    self._name, cleanup_method, timeout,
                )
            for rank, ref in enumerate(refs):
                if ref in ready:
                    try:
                        ray.get(ref)
                    except ray.exceptions.RayError as exc:
                        clean = False
                        logger.warning("%s[rank %d].%s() failed: %s", self._name, rank, cleanup_method, exc)
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        try:
            ray.get(registry().drop_group.remote(self._name), timeout=10)
        except ray.exceptions.RayError as exc:
            logger.warning("could not unregister group %s: %s", self._name, exc)
        return clean

    def __enter__(self) -> WorkerGroup[W]:
        """``with Worker.create_group().launch(cluster) as group:`` shuts the group down
        (:meth:`shutdown`, default arguments) on exit, also when the block raised."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"WorkerGroup({self.worker_cls_name}, name={self._name!r}, world_size={self.world_size})"
