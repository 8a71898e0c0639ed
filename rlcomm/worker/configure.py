"""Which environment, actor options and ``__init__`` arguments a worker starts with.

Three parties set them, in this order of precedence (lowest first), as in NeMo-RL's
worker builder:

1. the user: ``launch(env_vars=..., max_concurrency=...)`` and ``create_group(**kwargs)``;
2. the worker class: an optional ``configure_worker(num_gpus, bundle_indices)`` classmethod
   or staticmethod returning ``(resources, env_vars, init_kwargs)`` (each a dict or
   ``None``); it may override the user, and a warning is logged when it does;
3. rlcomm itself: the identity variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...,
   ``CUDA_VISIBLE_DEVICES`` when isolating GPUs) and the actor's name, namespace and
   scheduling strategy. These always win; a warning is logged when they override a
   value from the user or the worker.

Pure: no Ray.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

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


def call_configure_hook(
    worker_cls: type, num_gpus: float, bundle_indices: tuple | None
) -> tuple[dict[str, Any], dict[str, str], dict[str, Any]]:
    """Run ``worker_cls.configure_worker`` if it has one.

    Returns:
        ``(resources, env_vars, init_kwargs)``, empty dicts where the hook gave ``None``
        or the class has no hook.

    Raises:
        TypeError: the hook did not return three dicts (or ``None``).
    """
    hook = getattr(worker_cls, CONFIGURE_HOOK, None)
    if hook is None:
        return {}, {}, {}
    result = hook(num_gpus=num_gpus, bundle_indices=bundle_indices)
    if not isinstance(result, tuple) or len(result) != 3:
        raise TypeError(
            f"{worker_cls.__name__}.{CONFIGURE_HOOK}() must return (resources, env_vars, "
            f"init_kwargs), each a dict or None; got {result!r}"
        )
    parts = []
    for label, part in zip(("resources", "env_vars", "init_kwargs"), result, strict=True):
        if part is None:
            part = {}
        if not isinstance(part, dict):
            raise TypeError(
                f"{worker_cls.__name__}.{CONFIGURE_HOOK}(): {label} must be a dict or None, "
                f"got {type(part).__name__}"
            )
        parts.append(dict(part))
    return parts[0], parts[1], parts[2]


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
        bundle_indices: ``(node_idx, [local indices])`` of its tied group for the group's
            first worker, else ``None``.
        user_env, user_actor_options, user_init_kwargs: the user's layer.
        builder_env, builder_actor_options: rlcomm's layer.
        where: names the worker in warnings, e.g. ``"group:3"``.
    """
    resources, worker_env, worker_kwargs = call_configure_hook(worker_cls, num_gpus, bundle_indices)
    hook = f"{worker_cls.__name__}.{CONFIGURE_HOOK}()"
    env = _layer(user_env, {k: str(v) for k, v in worker_env.items()}, "env var", "the user", hook, where)
    env = _layer(env, builder_env, "env var", "the user or the worker", "rlcomm", where)
    options = _layer(user_actor_options, resources, "actor option", "the user", hook, where)
    options = _layer(options, builder_actor_options, "actor option", "the user or the worker", "rlcomm", where)
    init_kwargs = _layer(user_init_kwargs, worker_kwargs, "__init__ argument", "the user", hook, where)
    return WorkerOptions(env, options, init_kwargs)
