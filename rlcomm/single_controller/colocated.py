"""verl's colocated workers: several worker classes in one process per rank.

:func:`create_colocated_worker_cls` makes one worker class that builds an instance of
every given class in its ``__init__`` (its *roles*) and exposes each role's public
methods under ``<role>_<method>``, ``@register`` dispatch kept. A
:class:`~rlcomm.single_controller.RayWorkerGroup` of it runs one process per rank;
``group.spawn(roles)`` gives one group per role with the role's own method names, all
sharing those processes (so the roles of one rank share its memory and devices).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from rlcomm.single_controller.class_with_init import RayClassWithInitArgs
from rlcomm.worker.actor import public_methods
from rlcomm.worker.configure import CONFIGURE_HOOK, unwrap_ray_remote
from rlcomm.worker.group import WorkerGroup
from rlcomm.worker.worker import Worker

#: A group whose class came from :func:`create_colocated_worker_cls` (a ``RayWorkerGroup``).
G = TypeVar("G", bound=WorkerGroup)

__all__ = ["create_colocated_worker_cls", "spawn_roles"]

#: Attribute of a colocated worker instance: role name -> the role's worker instance.
ROLES_ATTR = "worker_dict"


def _delegate(role: str, name: str, fn: Callable) -> Callable:
    """A method that calls ``name`` on the instance of ``role``, keeping ``fn``'s
    signature and ``@register`` marks (so the group dispatches it as the role would)."""
    if inspect.iscoroutinefunction(fn):

        async def method(self, *args: Any, **kwargs: Any) -> Any:
            return await getattr(getattr(self, ROLES_ATTR)[role], name)(*args, **kwargs)

    else:

        def method(self, *args: Any, **kwargs: Any) -> Any:
            return getattr(getattr(self, ROLES_ATTR)[role], name)(*args, **kwargs)

    functools.update_wrapper(method, fn)
    method.__name__ = method.__qualname__ = f"{role}_{name}"
    method.__signature__ = inspect.signature(fn)  # type: ignore[attr-defined]
    method.__dict__.pop("__wrapped__", None)
    return method


def create_colocated_worker_cls(class_dict: Mapping[str, RayClassWithInitArgs]) -> RayClassWithInitArgs:
    """One worker class holding an instance of each class of ``class_dict`` (verl's name).

    Args:
        class_dict: role name -> :class:`RayClassWithInitArgs` of a
            :class:`~rlcomm.Worker` subclass (plain or ``@ray.remote``) and its
            ``__init__`` arguments.

    Returns:
        A :class:`RayClassWithInitArgs` of the combined class: build a
        :class:`~rlcomm.single_controller.RayWorkerGroup` with it, then
        ``group.spawn(class_dict.keys())`` for one group per role. On the combined
        group, role ``r``'s method ``m`` is ``group.r_m``. Inside a worker, the
        instances are ``self.worker_dict[role]``.

    Raises:
        TypeError: a class is not a ``Worker`` subclass.
        ValueError: no roles, or a role name that is not an identifier.
    """
    if not class_dict:
        raise ValueError("create_colocated_worker_cls: give at least one role")
    roles: dict[str, tuple[type, tuple, dict]] = {}
    for role, spec in class_dict.items():
        if not isinstance(role, str) or not role.isidentifier():
            raise ValueError(f"create_colocated_worker_cls: role {role!r} must be an identifier")
        inner, _ = unwrap_ray_remote(spec.cls)
        if not (isinstance(inner, type) and issubclass(inner, Worker)):
            raise TypeError(f"create_colocated_worker_cls: {role!r}: {inner!r} is not a rlcomm Worker subclass")
        roles[role] = (inner, tuple(spec.args), dict(spec.kwargs))

    def __init__(self) -> None:
        Worker.__init__(self)
        # Each role is built as a plain object in this process; it takes this worker's
        # identity (rank, group, communication) from the environment.
        setattr(self, ROLES_ATTR, {r: cls(*a, **kw) for r, (cls, a, kw) in roles.items()})

    namespace: dict[str, Any] = {
        "__init__": __init__,
        "_rlcomm_roles": {r: cls.__name__ for r, (cls, _, _) in roles.items()},
        "__doc__": f"verl's colocated worker of roles {sorted(roles)}.",
    }
    for role, (inner, _, _) in roles.items():
        for name in public_methods(inner):
            if name == CONFIGURE_HOOK:
                continue
            namespace[f"{role}_{name}"] = _delegate(role, name, getattr(inner, name))
    combined = type("WorkerDict", (Worker,), namespace)
    return RayClassWithInitArgs(combined)


def spawn_roles(group: G, prefix_set: Iterable[str]) -> dict[str, G]:
    """``group.spawn(prefix_set)``: per role, a view of ``group`` (same workers) whose
    attribute ``m`` is the combined group's ``<role>_m``. Shutting a view down ends the
    shared workers; the combined group holds the place on the resource pool.

    Raises:
        ValueError: ``group``'s class is not from :func:`create_colocated_worker_cls`,
            or a prefix is not one of its roles.
    """
    roles = getattr(group._worker_cls, "_rlcomm_roles", None)
    if roles is None:
        raise ValueError(
            f"spawn: {group.worker_cls_name} is not a colocated worker class; make it with "
            "create_colocated_worker_cls({role: RayClassWithInitArgs(...)})"
        )
    out = {}
    for prefix in prefix_set:
        if prefix not in roles:
            raise ValueError(f"spawn: {prefix!r} is not one of the roles {sorted(roles)}")
        view = type(group)(
            None, group.ray_cls_with_init, name_prefix=group.name_prefix,
            device_name=group.device_name, worker_names=group.worker_names,
        )
        view._adopt(group)  # the same layout and methods as the group it views
        view.sub_cls_name = prefix
        head = f"{prefix}_"
        for name in list(group._methods):
            if name.startswith(head):
                setattr(view, name[len(head):], getattr(view, name))
        out[prefix] = view
    return out
