"""``RayClassWithInitArgs``: a worker class and the arguments of its ``__init__``."""

from __future__ import annotations

from typing import Any

__all__ = ["RayClassWithInitArgs"]


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
