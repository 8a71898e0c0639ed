"""NeMo-RL style calls on a :class:`~rlcomm.worker.group.WorkerGroup`.

:class:`ShardedCallsMixin` gives ``WorkerGroup`` NeMo-RL's ``RayWorkerGroup`` methods:
``run_single_worker_single_data``, ``run_all_workers_single_data``,
``run_all_workers_multiple_data``, ``run_all_workers_sharded_data`` (returning a
:class:`MultiWorkerFuture`), ``get_all_worker_results``, ``dp_size``,
``get_dp_leader_worker_idx`` and ``worker_metadata``, with tied worker groups. Unlike
NeMo-RL, positional arguments are accepted everywhere, and argument errors are raised
before anything runs remotely.

The rank layout (a :class:`~rlcomm.worker.sharding.NamedSharding` given to ``launch``, or
the default one, and the tied groups) is :mod:`rlcomm.worker.layout`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import ray

from rlcomm.channel.client import CALL_SETTLE_TIMEOUT, settle_all
from rlcomm.worker.dispatch import check_signature
from rlcomm.worker.layout import RankLayoutMixin
from rlcomm.worker.multi_worker_future import MultiWorkerFuture
from rlcomm.worker.sharding import pick_shard, plan_sharded_call, ranks_at_zero


class PerWorkerDataError(ValueError, AssertionError):
    """A per-worker argument list of ``run_all_workers_multiple_data`` that does not fit
    the workers. A ``ValueError``, and an ``AssertionError`` as NeMo-RL raises there."""


_PLAIN = (int, float, str, bool, bytes, type(None))


class ShardedCallsMixin(RankLayoutMixin):
    """The NeMo-RL calls; mixed into ``WorkerGroup``, which owns the actors."""

    # -- calls ------------------------------------------------------------------------------

    def _call_each(
        self,
        method: str,
        ranks: Sequence[int],
        args_per_rank: Sequence[Sequence[Any]],
        kwargs_per_rank: Sequence[dict[str, Any]],
        num_returns: int | None = None,
    ) -> list[Any]:
        """Call ``method`` on each of ``ranks`` with that rank's own arguments; the refs."""
        self._check_live()  # type: ignore[attr-defined]
        settle_all(CALL_SETTLE_TIMEOUT, report=False)  # the workers see our puts
        refs = []
        for rank, args, kwargs in zip(ranks, args_per_rank, kwargs_per_rank, strict=True):
            remote = getattr(self._actors[rank], method)  # type: ignore[attr-defined]
            if num_returns is not None:
                remote = remote.options(num_returns=num_returns)
            refs.append(remote.remote(*args, **kwargs))
        return refs

    def _where(self, op: str, method: str) -> str:
        return f"{op}({method!r}) on {self._worker_cls.__name__} group {self._name!r}"  # type: ignore[attr-defined]

    def run_single_worker_single_data(self, method_name: str, worker_idx: int, *args: Any, **kwargs: Any) -> Any:
        """Run a method on one worker.

        Returns:
            The Ray future of its result.

        Raises:
            ValueError: ``worker_idx`` is not in the group.
            AttributeError, TypeError: no such method, or arguments that do not fit it.
        """
        self._check_live()  # type: ignore[attr-defined]
        where = self._where("run_single_worker_single_data", method_name)
        if not isinstance(worker_idx, int) or not 0 <= worker_idx < len(self._actors):  # type: ignore[attr-defined]
            raise ValueError(f"{where}: worker_idx {worker_idx!r} not in 0..{len(self._actors) - 1}")  # type: ignore[attr-defined]
        check_signature(self._worker_cls, method_name, args, kwargs, where)  # type: ignore[attr-defined]
        return self._call_each(method_name, [worker_idx], [args], [kwargs])[0]

    def _called_ranks(self, axes: Sequence[str] | None, where: str) -> list[int]:
        if not axes:
            return list(range(len(self._actors)))  # type: ignore[attr-defined]
        if self._sharding is None:
            raise ValueError(f"{where}: run_rank_0_only_axes needs a group launched with sharding=")
        return ranks_at_zero(self._sharding, axes, where)

    def run_all_workers_single_data(
        self, method_name: str, *args: Any, run_rank_0_only_axes: list[str] | None = None, **kwargs: Any
    ) -> list[Any]:
        """Run a method on all workers with the same arguments.

        Arguments are put into the object store once and shared by the workers.

        Args:
            method_name: the worker method.
            args, kwargs: its arguments.
            run_rank_0_only_axes: call only the workers at coordinate 0 along these axes.

        Returns:
            One Ray future per called worker, by worker index.
        """
        self._check_live()  # type: ignore[attr-defined]
        where = self._where("run_all_workers_single_data", method_name)
        ranks = self._called_ranks(run_rank_0_only_axes, where)
        check_signature(self._worker_cls, method_name, args, kwargs, where)  # type: ignore[attr-defined]
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
            args, kwargs: per-worker (or per-tied-group) lists of arguments.
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
        self._check_live()  # type: ignore[attr-defined]
        where = self._where("run_all_workers_multiple_data", method_name)
        world = len(self._actors)  # type: ignore[attr-defined]
        groups = self._tied_groups or [[r] for r in range(world)]
        tied_of = self.worker_to_tied_group_index
        common = dict(common_kwargs or {})
        both = sorted(set(common) & set(kwargs))
        if both:
            raise ValueError(f"{where}: {both} given both as per-worker kwargs and in common_kwargs")
        if not args and not kwargs:
            raise PerWorkerDataError(
                f"{where}: give at least one per-worker argument (a list with one entry per "
                "worker), or use run_all_workers_single_data"
            )
        ranks = self._called_ranks(run_rank_0_only_axes, where)
        valid = sorted({world, len(groups)} | ({len(ranks)} if run_rank_0_only_axes else set()))
        for name, value in [(f"argument {i}", a) for i, a in enumerate(args)] + list(kwargs.items()):
            if not isinstance(value, (list, tuple)) or len(value) not in valid:
                got = f"length {len(value)}" if isinstance(value, (list, tuple)) else type(value).__name__
                per = "one entry per worker" + (
                    f" ({world}) or per tied group ({len(groups)})" if len(groups) != world else f" ({world})"
                )
                if run_rank_0_only_axes:
                    per += f" or per called worker ({len(ranks)})"
                raise PerWorkerDataError(f"{where}: {name} must be a list with {per}, got {got}")
        check_signature(self._worker_cls, method_name, args, {**kwargs, **common}, where)  # type: ignore[attr-defined]
        position = {r: i for i, r in enumerate(ranks)}

        def pick(value: Sequence[Any], rank: int) -> Any:
            if len(value) == world:
                return value[rank]
            if len(value) == len(groups):
                return value[tied_of[rank]]
            return value[position[rank]]

        per_args = [tuple(pick(a, r) for a in args) for r in ranks]
        per_kwargs = [{**{k: pick(v, r) for k, v in kwargs.items()}, **common} for r in ranks]
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
            args, kwargs: the sharded data.
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
        self._check_live()  # type: ignore[attr-defined]
        where = self._where("run_all_workers_sharded_data", method_name)
        if self._sharding is None:
            raise ValueError(f"{where}: the group has no sharding; launch it with sharding=")
        common = dict(common_kwargs or {})
        both = sorted(set(common) & set(kwargs))
        if both:
            raise ValueError(f"{where}: {both} given both as sharded kwargs and in common_kwargs")
        # Binding checks names and counts only, so the unsplit arguments stand in.
        check_signature(self._worker_cls, method_name, args, {**kwargs, **common}, where)  # type: ignore[attr-defined]
        plan = plan_sharded_call(
            self._sharding,
            in_sharded_axes,
            replicate_on_axes,
            output_is_replicated,
            make_dummy_calls_to_free_axes,
            where,
        )
        sizes = [self._sharding.get_axis_size(a) for a in in_sharded_axes or []]
        named = [(f"argument {i}", a) for i, a in enumerate(args)] + list(kwargs.items())
        # One object per distinct (argument, slice), shared by every worker that gets it.
        users: dict[tuple[int, tuple[int, ...]], int] = {}
        for entry in plan:
            if entry.shard is not None:
                for i in range(len(named)):
                    users[(i, entry.shard)] = users.get((i, entry.shard), 0) + 1
        slices: dict[tuple[int, tuple[int, ...]], Any] = {}
        for (i, shard), count in users.items():
            name, value = named[i]
            data = pick_shard(value, shard, sizes, name, where)
            slices[(i, shard)] = share_value(data) if count > 1 else data
        per_args, per_kwargs = [], []
        n_pos = len(args)
        for entry in plan:
            if entry.shard is None:
                values = [None] * len(named)
            else:
                values = [slices[(i, entry.shard)] for i in range(len(named))]
            per_args.append(tuple(values[:n_pos]))
            per_kwargs.append({**dict(zip(kwargs, values[n_pos:], strict=True)), **common})
        ranks = [e.rank for e in plan]
        futures = self._call_each(method_name, ranks, per_args, per_kwargs)
        return MultiWorkerFuture(
            futures=futures,
            return_from_workers=[e.rank for e in plan if e.returns],
            called_workers=ranks,
            method=method_name,
        )

    def get_all_worker_results(
        self, future_bundle: MultiWorkerFuture, return_generators_as_proxies: bool = False
    ) -> list[Any]:
        """The results of a :class:`MultiWorkerFuture`, deduplicated as it says.

        Raises:
            WorkerCallError: a worker raised or died.
        """
        return future_bundle.get_results(self, return_generators_as_proxies)


def share_value(value: Any) -> Any:
    """``value`` put into the object store once, for several workers to receive.

    Returns an ``ObjectRef`` (Ray resolves it back to the value when it is a top-level
    argument), or ``value`` itself when it is trivial to send (numbers, strings, None,
    refs).
    """
    if isinstance(value, _PLAIN) or isinstance(value, (ray.ObjectRef, ray.ObjectRefGenerator)):
        return value
    if isinstance(value, np.generic):
        return value
    return ray.put(value)
