"""verl's dispatch modes: how a registered method's arguments go to the ranks
(``dispatch_fn``) and how their outputs come back (``collect_fn``); ``@register``
(:mod:`~rlcomm.single_controller.decorator`) names one per method.

Built-in dispatch modes (``Dispatch.X``):

==================  ===============================================  =============================
mode                dispatch                                         collect
==================  ===============================================  =============================
ONE_TO_ALL          every argument to every rank                     list of outputs, by rank
ALL_TO_ALL          each argument is a list, element ``i`` to rank i list of outputs, by rank
DP_COMPUTE          batches split along dim 0 over the ranks         outputs concatenated
DP_COMPUTE_PROTO    the same, for batch objects (``chunk``/``concat``) outputs concatenated
DP_COMPUTE_METRIC   split like DP_COMPUTE                            list of outputs, by rank
==================  ===============================================  =============================

Batches are lists, tuples, tensors, arrays, dicts of those, and objects with ``chunk(n)``
and ``concat(list)`` (see :mod:`rlcomm.worker.dispatch`); other arguments go whole to
every rank. Batches that do not divide are split unevenly (10 over 3 ranks: 4, 3, 3), or
padded with ``register(..., pad=True)``; padding is always stripped from the result.

The 3D modes of HybridFlow (3D_PROTO, 3D_ALL_MICRO_DP, 3D_PP_ONLY) are, as in current
verl, mesh dispatches made by :func:`make_nd_compute_dispatch_fn`: each worker registers
per mesh name its data-parallel index and whether it returns output
(``self._register_dispatch_collect_info(mesh, dp_rank, is_collect)``):

- 3D_PROTO: ``dp_rank`` = the worker's dp coordinate, ``is_collect`` = tp == 0 and pp
  is the last stage;
- 3D_ALL_MICRO_DP: ``dp_rank`` = the worker's micro-dp group, ``is_collect`` = it is
  local rank 0 of that group;
- 3D_PP_ONLY: ``dp_rank`` = 0 everywhere (broadcast), ``is_collect`` = tp == 0 and
  dp == 0 (one output per pipeline stage).

A dict ``{"dispatch_fn": f, "collect_fn": g}`` gives a custom mode, with verl's
signatures ``f(worker_group, *args, **kwargs) -> (args, kwargs)`` (each argument a list
with one entry per rank) and ``g(worker_group, outputs) -> result``;
:func:`register_dispatch_mode` names one for reuse.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from rlcomm.worker.dispatch import collect_batches, split_call_args


class DispatchMode:
    """A named dispatch mode (the values of :class:`Dispatch`)."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"Dispatch.{self.name}"

    def __reduce__(self) -> tuple:
        # Unpickle as the mode of that name in the receiving process (the registry is
        # keyed by identity), as verl's DynamicEnum does.
        return (_mode_named, (self.name,))


def _mode_named(name: str) -> DispatchMode:
    mode = getattr(Dispatch, name, None)
    return mode if isinstance(mode, DispatchMode) else DispatchMode(name)


class Dispatch:
    """The dispatch modes by name; :func:`register_dispatch_mode` adds more and
    :meth:`remove` takes an added one away again (verl's ``Dispatch.remove``)."""

    ONE_TO_ALL = DispatchMode("ONE_TO_ALL")
    ALL_TO_ALL = DispatchMode("ALL_TO_ALL")
    DP_COMPUTE = DispatchMode("DP_COMPUTE")
    DP_COMPUTE_PROTO = DispatchMode("DP_COMPUTE_PROTO")
    DP_COMPUTE_METRIC = DispatchMode("DP_COMPUTE_METRIC")

    @classmethod
    def remove(cls, name: str) -> DispatchMode:
        """Remove a mode added with :func:`register_dispatch_mode` (its name upper-cased,
        as verl's ``Dispatch.remove`` does) and its entry of
        :data:`DISPATCH_MODE_FN_REGISTRY`; returns the mode.

        Raises:
            KeyError: no added mode of that name. Built-in modes cannot be removed (verl
                lets them go, and every later call of theirs would fail).
        """
        key = name.upper()
        mode = cls.__dict__.get(key)
        if not isinstance(mode, DispatchMode) or mode.name in _BUILTIN_MODES:
            raise KeyError(f"Dispatch.remove: {key!r} is not a mode added by register_dispatch_mode")
        delattr(cls, key)
        DISPATCH_MODE_FN_REGISTRY.pop(mode, None)
        return mode


_BUILTIN_MODES = frozenset(
    name for name, value in vars(Dispatch).items() if isinstance(value, DispatchMode)
)


class Execute(Enum):
    """Where a registered method runs: on every rank, or on rank 0 only."""

    ALL = "ALL"
    RANK_ZERO = "RANK_ZERO"


# -- built-in dispatch and collect functions (verl signatures) -----------------------------


def _transpose(world: int, per_rank_args: list[tuple], per_rank_kwargs: list[dict]) -> tuple[tuple, dict]:
    n_args = len(per_rank_args[0]) if per_rank_args else 0
    args = tuple([per_rank_args[r][i] for r in range(world)] for i in range(n_args))
    keys = per_rank_kwargs[0].keys() if per_rank_kwargs else ()
    kwargs = {k: [per_rank_kwargs[r][k] for r in range(world)] for k in keys}
    return args, kwargs


def dispatch_one_to_all(worker_group: Any, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
    """Every argument repeated once per rank."""
    n = worker_group.world_size
    return tuple([a] * n for a in args), {k: [v] * n for k, v in kwargs.items()}


def dispatch_all_to_all(worker_group: Any, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
    """The arguments unchanged: each is already a list with one entry per rank."""
    return args, kwargs


def collect_all_to_all(worker_group: Any, output: Any) -> Any:
    """The outputs unchanged: a list with one entry per rank."""
    return output


def dispatch_dp_compute(worker_group: Any, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
    """Batches split along dim 0 over the ranks (unevenly if needed), other values copied."""
    n = worker_group.world_size
    per_args, per_kwargs, _ = split_call_args(args, kwargs, n, where="dispatch_dp_compute")
    return _transpose(n, per_args, per_kwargs)


def collect_dp_compute(worker_group: Any, output: Any) -> Any:
    """The per-rank outputs concatenated (a list when they are not batches)."""
    return collect_batches(output)


dispatch_dp_compute_data_proto = dispatch_dp_compute
collect_dp_compute_data_proto = collect_dp_compute


def dispatch_nd_compute(
    dp_rank_mapping: list[int], dp_size: int, worker_group: Any, *args: Any, **kwargs: Any
) -> tuple[tuple, dict]:
    """Batches split into ``dp_size`` chunks; rank ``r`` gets chunk ``dp_rank_mapping[r]``."""
    per_args, per_kwargs, _ = split_call_args(args, kwargs, dp_size, where="dispatch_nd_compute")
    world = len(dp_rank_mapping)
    return _transpose(
        world,
        [per_args[dp_rank_mapping[r]] for r in range(world)],
        [per_kwargs[dp_rank_mapping[r]] for r in range(world)],
    )


def collect_nd_compute(collect_mask: list[bool], worker_group: Any, output: Any) -> Any:
    """The outputs of the ranks with ``collect_mask[r]``, concatenated."""
    return collect_batches([o for o, keep in zip(output, collect_mask, strict=True) if keep])


class NdDispatch:
    """Mesh dispatch for one mesh name (the ``dispatch_fn`` of an nd mode)."""

    def __init__(self, mesh_name: str):
        self.mesh_name = mesh_name

    def __call__(self, worker_group: Any, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        layout = worker_group._mesh_layout(self.mesh_name)
        return dispatch_nd_compute(list(layout.dp_rank_of), layout.dp_size, worker_group, *args, **kwargs)


class _NdCollect:
    """Mesh collect for one mesh name (the ``collect_fn`` of an nd mode)."""

    def __init__(self, mesh_name: str):
        self.mesh_name = mesh_name

    def __call__(self, worker_group: Any, output: Any) -> Any:
        layout = worker_group._mesh_layout(self.mesh_name)
        return collect_batches([output[r] for r in layout.collect_ranks])


def make_nd_compute_dispatch_fn(mesh_name: str) -> dict[str, Callable]:
    """The dispatch mode of mesh ``mesh_name`` (verl's ``make_nd_compute_dataproto_dispatch_fn``).

    Batches are split into one chunk per data-parallel index; each chunk is put into the
    object store once and sent to every rank that registered that index; outputs come
    back from the ranks registered with ``is_collect=True``, ordered by dp index, and are
    concatenated. Workers register with
    ``self._register_dispatch_collect_info(mesh_name, dp_rank, is_collect)``.
    """
    return {"dispatch_fn": NdDispatch(mesh_name), "collect_fn": _NdCollect(mesh_name)}


make_nd_compute_dataproto_dispatch_fn = make_nd_compute_dispatch_fn


@dataclass
class ModeEntry:
    dispatch_fn: Callable
    collect_fn: Callable
    kind: str  # one_to_all | all_to_all | dp | dp_metric | custom


#: The named modes' functions, ``{mode: {"dispatch_fn": f, "collect_fn": g}}``, under
#: verl's name. It is the one table a call looks its mode up in, when the call is made:
#: changing an entry, or restoring the whole table from a copy as verl's tests do
#: (``clear()`` then ``update(saved)``), changes what later calls do.
DISPATCH_MODE_FN_REGISTRY: dict[DispatchMode, dict[str, Callable]] = {
    Dispatch.ONE_TO_ALL: {"dispatch_fn": dispatch_one_to_all, "collect_fn": collect_all_to_all},
    Dispatch.ALL_TO_ALL: {"dispatch_fn": dispatch_all_to_all, "collect_fn": collect_all_to_all},
    Dispatch.DP_COMPUTE: {"dispatch_fn": dispatch_dp_compute, "collect_fn": collect_dp_compute},
    Dispatch.DP_COMPUTE_PROTO: {
        "dispatch_fn": dispatch_dp_compute_data_proto,
        "collect_fn": collect_dp_compute_data_proto,
    },
    Dispatch.DP_COMPUTE_METRIC: {"dispatch_fn": dispatch_dp_compute, "collect_fn": collect_all_to_all},
}

# The built-in pairs of functions run on the worker group's own paths (batches split on
# the driver and put once per chunk, rank-zero calls, padding stripped); any other pair
# is called as verl calls it. The kind follows from the functions rather than from the
# mode, so a mode given its built-in functions back runs its built-in way again.
_BUILTIN_KINDS: dict[tuple[Callable, Callable], str] = {
    (dispatch_one_to_all, collect_all_to_all): "one_to_all",
    (dispatch_all_to_all, collect_all_to_all): "all_to_all",
    (dispatch_dp_compute, collect_dp_compute): "dp",
    (dispatch_dp_compute, collect_all_to_all): "dp_metric",
}


def mode_entry(dispatch_mode: DispatchMode) -> ModeEntry:
    """The functions of a named mode as the table holds them now, and how they run.

    Raises:
        KeyError: a mode that is not in :data:`DISPATCH_MODE_FN_REGISTRY`.
    """
    fns = DISPATCH_MODE_FN_REGISTRY[dispatch_mode]
    dispatch_fn, collect_fn = fns["dispatch_fn"], fns["collect_fn"]
    return ModeEntry(dispatch_fn, collect_fn, _BUILTIN_KINDS.get((dispatch_fn, collect_fn), "custom"))


def get_predefined_dispatch_fn(dispatch_mode: DispatchMode) -> dict[str, Callable]:
    """``{"dispatch_fn": ..., "collect_fn": ...}`` of a named mode: its entry of
    :data:`DISPATCH_MODE_FN_REGISTRY` itself, as in verl.

    Raises:
        KeyError: an unknown mode.
    """
    return DISPATCH_MODE_FN_REGISTRY[dispatch_mode]


def register_dispatch_mode(dispatch_mode_name: str, dispatch_fn: Callable, collect_fn: Callable) -> DispatchMode:
    """Add a named mode ``Dispatch.<NAME>`` with these functions; the name is
    upper-cased, as verl does (``"my_mode"`` makes ``Dispatch.MY_MODE``).

    Raises:
        ValueError: the name is taken or not an identifier.
    """
    key = dispatch_mode_name.upper()
    if not key.isidentifier() or hasattr(Dispatch, key):
        raise ValueError(f"register_dispatch_mode: {key!r} is taken or not an identifier")
    mode = DispatchMode(key)
    setattr(Dispatch, key, mode)
    DISPATCH_MODE_FN_REGISTRY[mode] = {"dispatch_fn": dispatch_fn, "collect_fn": collect_fn}
    return mode


class UnknownDispatchModeError(KeyError, AssertionError):
    """``update_dispatch_mode`` of a mode that was never registered: a ``KeyError``, and
    the ``AssertionError`` verl raises there."""


def update_dispatch_mode(dispatch_mode: DispatchMode, dispatch_fn: Callable, collect_fn: Callable) -> None:
    """Replace the functions of an existing named mode. Giving a built-in mode its own
    functions back restores its built-in behaviour.

    Raises:
        UnknownDispatchModeError: an unknown mode (a ``KeyError`` and an
            ``AssertionError``, as in verl).
    """
    if dispatch_mode not in DISPATCH_MODE_FN_REGISTRY:
        raise UnknownDispatchModeError(f"update_dispatch_mode: unknown mode {dispatch_mode!r}")
    DISPATCH_MODE_FN_REGISTRY[dispatch_mode] = {"dispatch_fn": dispatch_fn, "collect_fn": collect_fn}
