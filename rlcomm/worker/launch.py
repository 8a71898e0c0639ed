"""How a :class:`~rlcomm.worker.group.WorkerGroup` starts: its ``launch`` arguments
checked, one Ray actor per placement with rlcomm's identity environment and the
precedence of :mod:`~rlcomm.worker.configure`, every ``__init__`` waited for, and the
group recorded in the registry."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlcomm.cluster import RLCOMM_NAMESPACE, Cluster
from rlcomm.comm.identity import actor_name, check_group_name, registry
from rlcomm.placement import Placement, PlacementStrategy
from rlcomm.settings import ENV_PREFIX, GROUP_NAME_ENV, get_settings, live_changes
from rlcomm.worker.actor import WorkerContext, find_free_port, free_port_on_node, make_actor_class
from rlcomm.worker.configure import driver_env, resolve_worker_options
from rlcomm.worker.result import GroupResult


def check_launch_args(cluster: object, placement_strategy: object, name: object,
                       max_concurrency: object, env_vars: object) -> None:
    if not isinstance(cluster, Cluster):
        hint = ""
        if isinstance(cluster, PlacementStrategy):
            hint = "; the placement strategy goes second: launch(cluster, placement_strategy)"
        elif cluster is None:
            hint = "; make one with Cluster(num_nodes=1) (it attaches to or starts Ray)"
        raise TypeError(f"launch: the first argument must be an rlcomm.Cluster, got "
                        f"{type(cluster).__name__} {cluster!r}{hint}")
    if placement_strategy is not None and not isinstance(placement_strategy, PlacementStrategy):
        raise TypeError(
            "launch: placement_strategy must be a PlacementStrategy (PackedPlacementStrategy, "
            "FlexiblePlacementStrategy, NodePlacementStrategy) or None, got "
            f"{type(placement_strategy).__name__} {placement_strategy!r}"
        )
    if name is not None:
        check_group_name(name, "launch")
    if max_concurrency is not None and (
        not isinstance(max_concurrency, int) or isinstance(max_concurrency, bool)
        or max_concurrency < 1
    ):
        raise ValueError(f"launch: max_concurrency must be an int >= 1 or None, got {max_concurrency!r}")
    if env_vars is not None and (
        not isinstance(env_vars, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in env_vars.items())
    ):
        raise TypeError(f"launch: env_vars must be a dict of str to str, got {env_vars!r}")


@dataclass
class StartedActors:
    """A launched group's actors, by rank, and its ``(MASTER_ADDR, MASTER_PORT)``."""

    actors: list[Any]
    master: tuple[str, int]


def start_actors(
    worker_cls: type,
    class_options: dict[str, Any],
    args: tuple,
    kwargs: dict[str, Any],
    cluster: Cluster,
    placements: list[Placement],
    name: str,
    *,
    max_concurrency: int | None,
    isolate_gpu: bool,
    catch_system_failure: bool,
    disable_distributed_log: bool,
    env_vars: dict[str, str],
    extra_env: dict[str, str],
    bundle_indices_of: Callable[[int, Placement], Any],
) -> StartedActors:
    """Start rank ``p.rank`` of the group ``name`` for each placement ``p``, wait for
    every ``__init__`` and record the group in the registry (whose name the caller
    reserved). On failure the started actors are killed.

    Raises:
        WorkerCallError: a worker's ``__init__`` failed.
        RlcommTimeoutError: not every worker started within the ``launch_timeout`` setting.
    """
    master = cluster.node(placements[0].node_rank)
    if master.node_id == ray.get_runtime_context().get_node_id():
        master_port = find_free_port()
    else:
        _, master_port = ray.get(
            free_port_on_node.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(master.node_id, soft=False)
            ).remote()
        )
    actor_cls = ray.remote(make_actor_class(worker_cls, catch_system_failure))
    num_cpus = get_settings().worker_num_cpus
    gpus_per_node = max((n.num_gpus for n in cluster.nodes), default=0)
    actors: list[Any] = []
    try:
        for p in placements:
            node = cluster.node(p.node_rank)
            env = {
                "MASTER_ADDR": master.ip,
                "MASTER_PORT": str(master_port),
                "RANK": str(p.rank),
                "LOCAL_RANK": str(p.local_rank),
                "WORLD_SIZE": str(len(placements)),
                "LOCAL_WORLD_SIZE": str(p.local_world_size),
                "NODE_RANK": str(p.node_rank),
                # What verl's workers read beside the above.
                "RAY_LOCAL_WORLD_SIZE": str(p.local_world_size),
                "WG_BACKEND": "ray",
                **extra_env,
            }
            if isolate_gpu and p.accelerator_ids:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, p.accelerator_ids))
            user_options: dict[str, Any] = {"num_cpus": num_cpus, **class_options}
            if max_concurrency is not None:
                user_options["max_concurrency"] = max_concurrency
            resolved = resolve_worker_options(
                worker_cls,
                num_gpus=len(p.accelerator_ids),
                bundle_indices=bundle_indices_of(p.rank, p),
                num_gpus_per_node=gpus_per_node,
                user_env={**driver_env(exclude=env), **env_vars},
                user_actor_options=user_options,
                user_init_kwargs=kwargs,
                builder_env=env,
                builder_actor_options={
                    "name": actor_name(name, p.rank),
                    "namespace": RLCOMM_NAMESPACE,
                    "scheduling_strategy": NodeAffinitySchedulingStrategy(node.node_id, soft=False),
                },
                where=actor_name(name, p.rank),
            )
            env = resolved.env
            actor_options = _born_with_settings(resolved.actor_options, env)
            ctx = WorkerContext(
                group_name=name,
                rank=p.rank,
                world_size=len(placements),
                env=env,
                catch_system_failure=catch_system_failure,
                disable_distributed_log=disable_distributed_log,
                settings=live_changes(),
            )
            actors.append(
                actor_cls.options(**actor_options).remote(
                    ctx, *args, **resolved.init_kwargs
                )
            )
        # The first call on each actor waits for its __init__ and surfaces its errors.
        infos = GroupResult(name, "__init__", [p.rank for p in placements], [
            a._rlcomm_node_info.remote() for a in actors
        ]).wait(timeout=get_settings().launch_timeout)
        record = {
            "worker_cls_name": worker_cls.__name__,
            "world_size": len(placements),
            "node_ranks": [p.node_rank for p in placements],
            "master": (master.ip, master_port),
            "workers": infos,
        }
        ray.get(registry().set_group.remote(name, record))
    except BaseException:
        for actor in actors:
            ray.kill(actor)
        raise
    return StartedActors(actors, (master.ip, master_port))


def _born_with_settings(actor_options: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """``actor_options`` whose ``runtime_env`` sets the ``RLCOMM_*`` variables of ``env``:
    settings read once, when rlcomm is imported (the shared-memory pool, say), then hold
    in the worker too, since its process starts with them."""
    settings_env = {k: v for k, v in env.items()
                    if k.startswith(ENV_PREFIX) and k != GROUP_NAME_ENV}
    if not settings_env:
        return actor_options
    runtime_env = dict(actor_options.get("runtime_env") or {})
    runtime_env["env_vars"] = {**(runtime_env.get("env_vars") or {}), **settings_env}
    return {**actor_options, "runtime_env": runtime_env}
