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
from rlcomm.worker.actor import catch_failure_default, group_methods
from rlcomm.worker.configure import unwrap_ray_remote
from rlcomm.worker.dispatch import check_signature
from rlcomm.worker.launch import check_launch_args, start_actors
from rlcomm.worker.layout import RankLayout
from rlcomm.worker.multi_worker_future import MultiWorkerFuture
from rlcomm.worker.result import GroupResult
from rlcomm.worker.sharded_calls import (
    called_ranks,
    check_common,
    multiple_data,
    sharded_data,
    share_value,
)
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
            raise AttributeError(
                f"{self._group.worker_cls_name} has no group method {name!r} (a group offers "
                "the public methods a Worker subclass adds, and gpu_info)"
            )
        ranks, self._ranks = self._ranks, None
        return _GroupMethod(self._group, name, ranks)


class WorkerGroup(Generic[W]):
    """A group of workers of one class, one Ray actor per rank.

    Made by ``Worker.create_group(*args, **kwargs)`` and started by :meth:`launch`. A
    group method runs on every rank (or, for one call, on the ranks named by
    :meth:`execute_on`) and returns a :class:`GroupResult`. The group methods are:

    - every public method (no leading ``_``) that the worker class adds to ``Worker``,
      ``async def`` ones too, but ``configure_worker`` (a launch hook);
    - ``gpu_info``, the one method of ``Worker`` itself that is a group method too (a
      subclass's override of it is what runs).

    The other methods of ``Worker`` (``send``, ``recv``, ``broadcast``,
    ``create_channel``, ...) are not group methods, nor is a subclass's method of the
    same name: they are called inside a worker. A worker class with a method named as
    one of the group's own (``shutdown``, ``launch``, ...) cannot be launched.

    NeMo-RL's calls (``run_all_workers_*``, ``get_all_worker_results``, ``dp_size``,
    ...) read the group's rank layout: its sharding and its tied workers.
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
        self._layout = RankLayout(0)

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
        methods = group_methods(self._worker_cls)
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
        self._layout = RankLayout(len(placements), sharding, bundle_indices_list)
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
                bundle_indices_of=self._layout.bundle_indices,
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

    # -- the rank layout ----------------------------------------------------------------------

    @property
    def sharding_annotations(self) -> NamedSharding | None:
        """The group's :class:`NamedSharding` (given to ``launch`` or the default)."""
        return self._layout.sharding

    @property
    def tied_workers_groups(self) -> list[list[int]]:
        """The worker indices of each tied group (one group per worker when untied)."""
        return [list(g) for g in self._layout.tied_groups]

    @property
    def worker_to_tied_group_index(self) -> dict[int, int]:
        return self._layout.tied_group_index()

    @property
    def dp_size(self) -> int:
        """The number of data-parallel shards (the tied groups when there is no sharding)."""
        return self._layout.dp_size()

    def get_dp_leader_worker_idx(self, dp_shard_idx: int) -> int:
        """The worker at data-parallel index ``dp_shard_idx`` and 0 on every other axis
        (without sharding: the first worker of tied group ``dp_shard_idx``)."""
        return self._layout.dp_leader(dp_shard_idx)

    @property
    def worker_metadata(self) -> list[dict[str, Any]]:
        """Per worker: rank, actor name, node, local rank, GPUs, tied group, coordinates."""
        return self._layout.metadata(self._name or "", self._placements)

    # -- NeMo-RL's calls ----------------------------------------------------------------------

    def _call_each(
        self,
        method: str,
        ranks: Sequence[int],
        args_per_rank: Sequence[Sequence[Any]],
        kwargs_per_rank: Sequence[dict[str, Any]],
        num_returns: int | None = None,
    ) -> list[Any]:
        """Call ``method`` on each of ``ranks`` with that rank's own arguments; the refs."""
        self._check_live()
        settle_all(CALL_SETTLE_TIMEOUT, report=False)  # the workers see our puts
        refs = []
        for rank, args, kwargs in zip(ranks, args_per_rank, kwargs_per_rank, strict=True):
            remote = getattr(self._actors[rank], method)
            if num_returns is not None:
                remote = remote.options(num_returns=num_returns)
            refs.append(remote.remote(*args, **kwargs))
        return refs

    def _where(self, op: str, method: str) -> str:
        return f"{op}({method!r}) on {self.worker_cls_name} group {self._name!r}"

    def run_single_worker_single_data(self, method_name: str, worker_idx: int, *args: Any, **kwargs: Any) -> Any:
        """Run a method on one worker.

        Returns:
            The Ray future of its result.

        Raises:
            ValueError: ``worker_idx`` is not in the group.
            AttributeError, TypeError: no such method, or arguments that do not fit it.
        """
        self._check_live()
        where = self._where("run_single_worker_single_data", method_name)
        if not isinstance(worker_idx, int) or not 0 <= worker_idx < len(self._actors):
            raise ValueError(f"{where}: worker_idx {worker_idx!r} not in 0..{len(self._actors) - 1}")
        check_signature(self._worker_cls, method_name, args, kwargs, where)
        return self._call_each(method_name, [worker_idx], [args], [kwargs])[0]

    def run_all_workers_single_data(
        self, method_name: str, *args: Any, run_rank_0_only_axes: list[str] | None = None, **kwargs: Any
    ) -> list[Any]:
        """Run a method on all workers with the same arguments.

        Arguments are put into the object store once and shared by the workers.

        Args:
            method_name: the worker method.
            *args: its positional arguments.
            **kwargs: its keyword arguments.
            run_rank_0_only_axes: call only the workers at coordinate 0 along these axes.

        Returns:
            One Ray future per called worker, by worker index.
        """
        self._check_live()
        where = self._where("run_all_workers_single_data", method_name)
        ranks = called_ranks(self._layout, len(self._actors), run_rank_0_only_axes, where)
        check_signature(self._worker_cls, method_name, args, kwargs, where)
        if len(ranks) > 1:
            args = tuple(share_value(a) for a in args)
            kwargs = {k: share_value(v) for k, v in kwargs.items()}
        return self._call_each(method_name, ranks, [args] * len(ranks), [kwargs] * len(ranks))

    def run_all_workers_multiple_data(
        self,
        method_name: str,
        *args: Any,
        run_rank_0_only_axes: list[str] | None = None,
        common_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Run a method on all workers, each with its own arguments.

        Every positional and keyword argument is a list with one entry per worker
        (length ``world_size``), or, when the group has tied workers, one entry per tied
        group (every worker of a tied group gets its group's entry), or, with
        ``run_rank_0_only_axes``, one entry per called worker (NeMo-RL's form).

        Args:
            method_name: the worker method.
            *args: per-worker (or per-tied-group) lists of positional arguments.
            **kwargs: per-worker (or per-tied-group) lists of keyword arguments.
            run_rank_0_only_axes: call only the workers at coordinate 0 along these axes
                (the entries of the others are ignored).
            common_kwargs: keyword arguments passed whole to every worker.

        Returns:
            One Ray future per called worker, by worker index.

        Raises:
            PerWorkerDataError: no per-worker argument, or one that is not a list of a
                valid length (a ``ValueError``, and the ``AssertionError`` of NeMo-RL).
            ValueError: a name is both in ``kwargs`` and ``common_kwargs``.
        """
        self._check_live()
        where = self._where("run_all_workers_multiple_data", method_name)
        common = dict(common_kwargs or {})
        check_common(kwargs, common, "per-worker", where)
        world = len(self._actors)
        ranks = called_ranks(self._layout, world, run_rank_0_only_axes, where)
        per_args, per_kwargs = multiple_data(
            self._layout, world, ranks, bool(run_rank_0_only_axes), args, kwargs, common, where)
        check_signature(self._worker_cls, method_name, args, {**kwargs, **common}, where)
        return self._call_each(method_name, ranks, per_args, per_kwargs)

    def run_all_workers_sharded_data(
        self,
        method_name: str,
        *args: Any,
        in_sharded_axes: list[str] | None = None,
        replicate_on_axes: list[str] | None = None,
        output_is_replicated: list[str] | None = None,
        make_dummy_calls_to_free_axes: bool = False,
        common_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> MultiWorkerFuture:
        """Run a method on all workers with data already split along named axes.

        Each positional and keyword argument is a nested list indexed by the worker's
        coordinates along ``in_sharded_axes``, in that order (``data[dp][pp]`` for
        ``in_sharded_axes=["dp", "pp"]``). Along ``replicate_on_axes`` every worker gets
        the same slice; each slice is put into the object store once and shared. Along
        the free axes (in neither list) only coordinate 0 is called, or, with
        ``make_dummy_calls_to_free_axes``, the others are called with ``None`` for every
        sharded argument. Results come back only from coordinate 0 along
        ``output_is_replicated`` and the free axes, and once per tied group; read them
        with :meth:`get_all_worker_results`.

        Args:
            method_name: the worker method.
            *args: the sharded data, as positional arguments.
            **kwargs: the sharded data, as keyword arguments.
            in_sharded_axes: axes the data is split along.
            replicate_on_axes: axes the data is replicated along.
            output_is_replicated: axes along which the outputs are equal (return one).
            make_dummy_calls_to_free_axes: call the other coordinates of free axes too.
            common_kwargs: keyword arguments passed whole to every called worker.

        Returns:
            A :class:`MultiWorkerFuture`.

        Raises:
            ValueError: unknown axes, an axis both sharded and replicated, or data that is
                not nested to the sharded axes' sizes.
        """
        self._check_live()
        where = self._where("run_all_workers_sharded_data", method_name)
        if self._layout.sharding is None:
            raise ValueError(f"{where}: the group has no sharding; launch it with sharding=")
        common = dict(common_kwargs or {})
        check_common(kwargs, common, "sharded", where)
        # Binding checks names and counts only, so the unsplit arguments stand in.
        check_signature(self._worker_cls, method_name, args, {**kwargs, **common}, where)
        ranks, returns, (per_args, per_kwargs) = sharded_data(
            self._layout, args, kwargs, common, in_sharded_axes, replicate_on_axes,
            output_is_replicated, make_dummy_calls_to_free_axes, where,
        )
        futures = self._call_each(method_name, ranks, per_args, per_kwargs)
        return MultiWorkerFuture(
            futures=futures, return_from_workers=returns, called_workers=ranks, method=method_name,
        )

    def get_all_worker_results(
        self, future_bundle: MultiWorkerFuture, return_generators_as_proxies: bool = False
    ) -> list[Any]:
        """The results of a :class:`MultiWorkerFuture`, deduplicated as it says.

        Raises:
            WorkerCallError: a worker raised or died.
        """
        return future_bundle.get_results(self, return_generators_as_proxies)

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
        group._methods = set(group_methods(group._worker_cls))
        group._master_addr, group._master_port = info.get("master", (None, None))
        group._layout = RankLayout(info["world_size"])
        group._bind_methods()
        return group

    def _adopt(self, other: WorkerGroup) -> None:
        """Become another handle on ``other``'s running workers: the same actors, layout
        and methods (a subclass's handle on a group found by name, or a view of it)."""
        self._name, self._actors, self._placements = other._name, other._actors, other._placements
        self._methods, self._layout = set(other._methods), other._layout
        self._master_addr, self._master_port = other._master_addr, other._master_port
        self._bind_methods()

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
