"""Which environment, actor options and ``__init__`` arguments a worker starts with.

They are set in this order of precedence (lowest first), as NeMo-RL documents it for
environment variables (``docs/design-docs/env-vars.md``) and its worker builder:

0. the worker class's ``@ray.remote(runtime_env=...)`` (kept as the actor's
   ``runtime_env``, so Ray applies it when the process starts, under everything below);
1. the environment of the launching process (:func:`driver_env`: without Ray's own
   variables, the ``*_VISIBLE_DEVICES`` and the identity variables of item 3);
2. the user: ``launch(env_vars=..., max_concurrency=...)`` and ``create_group(**kwargs)``;
3. the worker class: an optional ``configure_worker(num_gpus, bundle_indices[,
   num_gpus_per_node])`` classmethod or staticmethod returning ``(resources, env_vars,
   init_kwargs)`` or NeMo-RL's ``(resources, env_vars, init_kwargs,
   runtime_env_overrides)`` (each a dict or ``None``); it may override the user, and a
   warning is logged when it does. Every worker gets ``bundle_indices``: ``(node_rank,
   [local index])`` for a worker on its own, ``(node_idx, [local indices])`` of its tied
   group for a tied group's first worker, ``None`` for the other tied workers;
4. rlcomm itself: the identity variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...,
   ``CUDA_VISIBLE_DEVICES`` when isolating GPUs) and the actor's name, namespace and
   scheduling strategy. These always win; a warning is logged when they override a
   value from the user or the worker.

Pure: no Ray calls.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rlcomm.comm.process import inherited_env

logger = logging.getLogger(__name__)

#: The name of the optional hook on a worker class.
CONFIGURE_HOOK = "configure_worker"


@dataclass
class WorkerOptions:
    """What one worker actor is started with.

    Attributes:
        env: the process environment variables rlcomm sets.
        actor_options: keyword arguments for Ray's ``.options(...)``.
        init_kwargs: keyword arguments for the worker's ``__init__``.
    """

    env: dict[str, str]
    actor_options: dict[str, Any]
    init_kwargs: dict[str, Any]


#: Ray options of a ``@ray.remote`` class that a group keeps (the others, such as
#: ``num_gpus`` or ``resources``, would fight rlcomm's own placement and are dropped).
_KEPT_CLASS_OPTIONS = ("runtime_env", "max_concurrency", "concurrency_groups")

def unwrap_ray_remote(cls: Any) -> tuple[type, dict[str, Any]]:
    """The user's class behind a ``@ray.remote`` class, and the Ray options it was given
    that a group keeps (``runtime_env``, ``max_concurrency``); ``(cls, {})`` for a plain
    class."""
    meta = getattr(cls, "__ray_metadata__", None)
    if meta is None:
        # The type of a ``@ray.remote`` class (what a classmethod called on one gets)
        # inherits Ray's modified class, which names the user's class.
        original = getattr(cls, "__ray_actor_class__", None)
        return (cls, {}) if original is None else (original, {})
    modified = meta.modified_class
    original = getattr(modified, "__ray_actor_class__", None) or modified.__mro__[1]
    options = dict(getattr(cls, "_default_options", None) or {})
    return original, {k: options[k] for k in _KEPT_CLASS_OPTIONS if options.get(k) is not None}


#: The launching process's environment, as NeMo-RL passes it to its workers (without
#: Ray's ``RAY_*`` variables, the ``*_VISIBLE_DEVICES`` and rlcomm's identity variables);
#: channel workers get the same (:func:`rlcomm.comm.process.inherited_env`).
driver_env = inherited_env


def merge_options(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` updated with ``top``, dicts merged recursively (``top`` wins)."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge_options(dict(out[key]), value)
        else:
            out[key] = value
    return out


def _hook_takes(hook: Any, name: str) -> bool:
    try:
        params = inspect.signature(hook).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def call_configure_hook(
    worker_cls: type,
    num_gpus: float,
    bundle_indices: tuple | None,
    num_gpus_per_node: int | None = None,
) -> tuple[dict[str, Any], dict[str, str], dict[str, Any], dict[str, Any]]:
    """Run ``worker_cls.configure_worker`` if it has one.

    The hook gets ``num_gpus`` and ``bundle_indices``, and ``num_gpus_per_node`` when it
    takes that argument (NeMo-RL's current signature).

    Returns:
        ``(resources, env_vars, init_kwargs, runtime_env_overrides)``, empty dicts where
        the hook gave ``None``, returned a 3-tuple, or the class has no hook.

    Raises:
        TypeError: the hook did not return three or four dicts (or ``None``).
    """
    hook = getattr(worker_cls, CONFIGURE_HOOK, None)
    if hook is None:
        return {}, {}, {}, {}
    kwargs: dict[str, Any] = {"num_gpus": num_gpus, "bundle_indices": bundle_indices}
    if _hook_takes(hook, "num_gpus_per_node"):
        kwargs["num_gpus_per_node"] = num_gpus_per_node
    result = hook(**kwargs)
    if not isinstance(result, tuple) or len(result) not in (3, 4):
        raise TypeError(
            f"{worker_cls.__name__}.{CONFIGURE_HOOK}() must return (resources, env_vars, "
            "init_kwargs) or (resources, env_vars, init_kwargs, runtime_env_overrides), "
            f"each a dict or None; got {result!r}"
        )
    labels = ("resources", "env_vars", "init_kwargs", "runtime_env_overrides")
    parts = []
    for label, part in zip(labels[: len(result)], result, strict=True):
        if part is None:
            part = {}
        if not isinstance(part, dict):
            raise TypeError(
                f"{worker_cls.__name__}.{CONFIGURE_HOOK}(): {label} must be a dict or None, "
                f"got {type(part).__name__}"
            )
        parts.append(dict(part))
    if len(parts) == 3:
        parts.append({})
    return parts[0], parts[1], parts[2], parts[3]


def _layer(
    base: dict[str, Any], top: dict[str, Any], what: str, base_owner: str, top_owner: str, where: str
) -> dict[str, Any]:
    merged = dict(base)
    for key, value in top.items():
        if key in merged and merged[key] != value:
            logger.warning(
                "%s: %s overrides %s %s=%r set by %s with %r",
                where, top_owner, what, key, merged[key], base_owner, value,
            )
        merged[key] = value
    return merged


def resolve_worker_options(
    worker_cls: type,
    *,
    num_gpus: float,
    bundle_indices: tuple | None,
    num_gpus_per_node: int | None = None,
    user_env: dict[str, str],
    user_actor_options: dict[str, Any],
    user_init_kwargs: dict[str, Any],
    builder_env: dict[str, str],
    builder_actor_options: dict[str, Any],
    where: str,
) -> WorkerOptions:
    """Merge the three layers (user < worker's ``configure_worker`` < rlcomm).

    Args:
        worker_cls: the user's worker class (its ``configure_worker`` is called, if any).
        num_gpus: GPUs this worker gets.
        bundle_indices: ``(node_idx, [local indices])``: its own for a worker on its
            own, its tied group's for a tied group's first worker; ``None`` for the
            other tied workers.
        num_gpus_per_node: GPUs per node of the cluster (for NeMo-RL's hook).
        user_env: the user's layer of environment variables (the launching process's
            environment already under them).
        user_actor_options: the user's layer of Ray actor options.
        user_init_kwargs: the user's layer of ``__init__`` keyword arguments.
        builder_env: rlcomm's layer of environment variables.
        builder_actor_options: rlcomm's layer of Ray actor options.
        where: names the worker in warnings, e.g. ``"group:3"``.
    """
    resources, worker_env, worker_kwargs, runtime_env = call_configure_hook(
        worker_cls, num_gpus, bundle_indices, num_gpus_per_node
    )
    hook = f"{worker_cls.__name__}.{CONFIGURE_HOOK}()"
    if runtime_env:
        # Its env_vars join the hook's (applied in the process, above the user's); the
        # rest (nsight, ...) is merged into the actor's runtime_env.
        runtime_env = dict(runtime_env)
        worker_env = {**worker_env, **(runtime_env.pop("env_vars", None) or {})}
        if runtime_env:
            resources = merge_options(
                resources,
                {"runtime_env": merge_options(user_actor_options.get("runtime_env") or {}, runtime_env)},
            )
    env = _layer(user_env, {k: str(v) for k, v in worker_env.items()}, "env var", "the user", hook, where)
    env = _layer(env, builder_env, "env var", "the user or the worker", "rlcomm", where)
    options = _layer(user_actor_options, resources, "actor option", "the user", hook, where)
    options = _layer(options, builder_actor_options, "actor option", "the user or the worker", "rlcomm", where)
    init_kwargs = _layer(user_init_kwargs, worker_kwargs, "__init__ argument", "the user", hook, where)
    return WorkerOptions(env, options, init_kwargs)
