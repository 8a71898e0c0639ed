"""verl's ``@register``: a worker method becomes a worker-group method that dispatches,
runs and collects, by one of the modes of :mod:`~rlcomm.single_controller.dispatch_modes`
(whose names this module re-exports, at verl's import path).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlcomm.single_controller.dispatch_modes import (
    DISPATCH_MODE_FN_REGISTRY,
    Dispatch,
    DispatchMode,
    Execute,
    NdDispatch,
    UnknownDispatchModeError,
    collect_all_to_all,
    collect_dp_compute,
    collect_dp_compute_data_proto,
    collect_nd_compute,
    dispatch_all_to_all,
    dispatch_dp_compute,
    dispatch_dp_compute_data_proto,
    dispatch_nd_compute,
    dispatch_one_to_all,
    get_predefined_dispatch_fn,
    make_nd_compute_dataproto_dispatch_fn,
    make_nd_compute_dispatch_fn,
    mode_entry,
    register_dispatch_mode,
    update_dispatch_mode,
)
from rlcomm.single_controller.lazy_chunk import resolve_lazy, resolve_lazy_async
from rlcomm.worker.batch import batch_len

__all__ = [
    "DISPATCH_MODE_FN_REGISTRY",
    "Dispatch",
    "DispatchMode",
    "Execute",
    "collect_all_to_all",
    "collect_dp_compute",
    "collect_dp_compute_data_proto",
    "collect_nd_compute",
    "dispatch_all_to_all",
    "dispatch_dp_compute",
    "dispatch_dp_compute_data_proto",
    "dispatch_nd_compute",
    "dispatch_one_to_all",
    "get_predefined_dispatch_fn",
    "make_nd_compute_dataproto_dispatch_fn",
    "make_nd_compute_dispatch_fn",
    "register",
    "register_dispatch_mode",
    "update_dispatch_mode",
    "UnknownDispatchModeError",
]

#: Attribute that marks a registered method (holds its :class:`DispatchSpec`).
SPEC_ATTR = "_rlcomm_dispatch_spec"
#: Hidden keyword the worker group adds to ask a registered method for ``(output, length)``.
RETURN_LEN_KW = "_rlcomm_return_len"
#: Prefix of hidden keywords carrying object refs a call must wait for before it starts.
DEPENDENCY_KW_PREFIX = "_rlcomm_dep_"
#: Attribute holding the user's own signature of a registered method (checked on the driver).
USER_SIGNATURE_ATTR = "_rlcomm_user_signature"


@dataclass(frozen=True)
class DispatchSpec:
    """What ``@register`` recorded on a method."""

    dispatch_mode: DispatchMode | dict
    execute_mode: Execute
    blocking: bool
    pad: bool

    @property
    def mode_name(self) -> str:
        if isinstance(self.dispatch_mode, DispatchMode):
            return self.dispatch_mode.name
        fn = self.dispatch_mode["dispatch_fn"]
        if isinstance(fn, NdDispatch):
            return f"nd mesh {fn.mesh_name!r}"
        return f"custom {getattr(fn, '__name__', type(fn).__name__)}"

    def resolve(self) -> tuple[str, Callable, Callable, str | None]:
        """``(kind, dispatch_fn, collect_fn, mesh_name)``, looked up now."""
        if isinstance(self.dispatch_mode, DispatchMode):
            entry = mode_entry(self.dispatch_mode)
            return entry.kind, entry.dispatch_fn, entry.collect_fn, None
        fn, collect = self.dispatch_mode["dispatch_fn"], self.dispatch_mode["collect_fn"]
        if isinstance(fn, NdDispatch):
            return "nd", fn, collect, fn.mesh_name
        return "custom", fn, collect, None


def register(
    dispatch_mode: DispatchMode | dict = Dispatch.ALL_TO_ALL,
    execute_mode: Execute = Execute.ALL,
    blocking: bool = True,
    pad: bool = False,
) -> Callable[[Callable], Callable]:
    """Make a worker method a dispatching method of verl-style worker groups.

    On a :class:`~rlcomm.single_controller.RayWorkerGroup`, ``group.method(*args,
    **kwargs)`` dispatches the arguments by ``dispatch_mode``, runs on the ranks of
    ``execute_mode``, and collects the outputs. On the worker itself the method runs as
    written.

    Args:
        dispatch_mode: a :class:`Dispatch` mode, or ``{"dispatch_fn": f, "collect_fn": g}``.
        execute_mode: ``Execute.ALL``, or ``Execute.RANK_ZERO`` to run on rank 0 only
            (with the arguments as given for ONE_TO_ALL / ALL_TO_ALL, the whole batch
            for DP modes, element 0 of each dispatched list for custom modes; the result
            is rank 0's output, passed through ``collect_fn`` for custom modes).
        blocking: return the collected result; ``False`` returns what verl returns,
            Ray ``ObjectRef`` objects that ``ray.get`` accepts: with ``Execute.RANK_ZERO``
            rank 0's ``ObjectRef``; otherwise a
            :class:`~rlcomm.single_controller.DispatchFuture`, a list of the ranks'
            ``ObjectRef`` objects whose ``.get()`` collects (and which can be passed to
            another group's DP call without the driver fetching the data).
        pad: in DP and mesh modes, pad batches that do not divide by the number of
            chunks (repeating their first items) instead of splitting them unevenly; the
            padding is stripped from the result.

    Raises:
        TypeError: a bad ``dispatch_mode`` or ``execute_mode``.
    """
    if isinstance(dispatch_mode, dict):
        if set(dispatch_mode) != {"dispatch_fn", "collect_fn"} or not all(
            callable(f) for f in dispatch_mode.values()
        ):
            raise TypeError(
                "register: a custom dispatch_mode must be {'dispatch_fn': f, 'collect_fn': g} "
                f"with callables, got {dispatch_mode!r}"
            )
    elif not isinstance(dispatch_mode, DispatchMode) or dispatch_mode not in DISPATCH_MODE_FN_REGISTRY:
        raise TypeError(f"register: unknown dispatch_mode {dispatch_mode!r}; use a Dispatch.X mode or a dict")
    if not isinstance(execute_mode, Execute):
        raise TypeError(f"register: execute_mode must be Execute.ALL or Execute.RANK_ZERO, got {execute_mode!r}")
    spec = DispatchSpec(dispatch_mode, execute_mode, blocking, pad)
    kind = spec.resolve()[0]
    if kind == "nd" and execute_mode is Execute.RANK_ZERO:
        raise TypeError("register: a mesh dispatch mode runs on every rank; use Execute.ALL")
    if pad and kind not in ("dp", "dp_metric", "nd"):
        raise TypeError(f"register: pad=True applies to DP and mesh modes, not {spec.mode_name}")

    def decorate(fn: Callable) -> Callable:
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(self, *args, **kwargs):
                want_len = _pop_hidden(kwargs)
                args, kwargs = await resolve_lazy_async(args, kwargs)
                out = await fn(self, *args, **kwargs)
                return (out, _safe_len(out)) if want_len else out

            wrapper = async_wrapper
        else:

            @functools.wraps(fn)
            def sync_wrapper(self, *args, **kwargs):
                want_len = _pop_hidden(kwargs)
                args, kwargs = resolve_lazy(args, kwargs)
                out = fn(self, *args, **kwargs)
                return (out, _safe_len(out)) if want_len else out

            wrapper = sync_wrapper
        setattr(wrapper, SPEC_ATTR, spec)
        setattr(wrapper, USER_SIGNATURE_ATTR, inspect.signature(fn))
        # Ray checks call arguments against the signature of the innermost __wrapped__
        # function; end the chain here so it sees the hidden keywords too.
        wrapper.__signature__ = _with_hidden_kwargs(fn)  # type: ignore[attr-defined]
        del wrapper.__wrapped__  # type: ignore[attr-defined]
        return wrapper

    return decorate


class BadModeError(TypeError, AssertionError):
    """A ``dispatch_mode`` or ``execute_mode`` of the wrong kind: a ``TypeError``, and the
    ``AssertionError`` verl's checks raise."""


def _check_dispatch_mode(dispatch_mode: Any) -> None:
    """verl's check of a ``dispatch_mode`` argument: a named mode, or a dict that has
    ``dispatch_fn`` and ``collect_fn``. It checks the kind only: whether a named mode is
    registered is looked up when a call is made.

    Raises:
        BadModeError: anything else (an ``AssertionError``, as in verl).
    """
    if isinstance(dispatch_mode, DispatchMode):
        return
    if not isinstance(dispatch_mode, dict):
        raise BadModeError(f"dispatch_mode must be a Dispatch mode or a dict, got {dispatch_mode!r}")
    for key in ("dispatch_fn", "collect_fn"):
        if key not in dispatch_mode:
            raise BadModeError(f"a dict dispatch_mode needs the key {key!r}, got {sorted(dispatch_mode)}")


def _check_execute_mode(execute_mode: Any) -> None:
    """verl's check of an ``execute_mode`` argument.

    Raises:
        BadModeError: not an :class:`Execute` (an ``AssertionError``, as in verl).
    """
    if not isinstance(execute_mode, Execute):
        raise BadModeError(f"execute_mode must be an Execute mode, got {execute_mode!r}")


def _with_hidden_kwargs(fn: Callable) -> inspect.Signature:
    """``fn``'s signature plus the hidden keywords the group passes (Ray checks call
    arguments against the method's signature): the output-length flag, and the
    dependency refs (taken by a ``**kwargs`` added when ``fn`` has none)."""
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    hidden = inspect.Parameter(RETURN_LEN_KW, inspect.Parameter.KEYWORD_ONLY, default=False)
    if params and params[-1].kind is inspect.Parameter.VAR_KEYWORD:
        params.insert(len(params) - 1, hidden)
    else:
        params.append(hidden)
        params.append(inspect.Parameter("_rlcomm_deps", inspect.Parameter.VAR_KEYWORD))
    return sig.replace(parameters=params)


def _pop_hidden(kwargs: dict[str, Any]) -> bool:
    """Remove the hidden keywords from a call's kwargs; whether lengths were asked for."""
    for key in [k for k in kwargs if k.startswith(DEPENDENCY_KW_PREFIX)]:
        del kwargs[key]  # resolved by Ray before the call started; nothing more to do
    return bool(kwargs.pop(RETURN_LEN_KW, False))


def dispatch_spec_of(fn: Any) -> DispatchSpec | None:
    """The :class:`DispatchSpec` of a registered method, else ``None``."""
    return getattr(fn, SPEC_ATTR, None)


def _safe_len(out: Any) -> int | None:
    try:
        return batch_len(out)
    except ValueError:
        return None
