"""@register and the built-in dispatch functions, without Ray."""

import asyncio
import inspect

import pytest

from rlcomm.single_controller import (
    Dispatch,
    Execute,
    collect_all_to_all,
    collect_dp_compute,
    collect_nd_compute,
    dispatch_all_to_all,
    dispatch_dp_compute,
    dispatch_nd_compute,
    dispatch_one_to_all,
    get_predefined_dispatch_fn,
    make_nd_compute_dispatch_fn,
    register,
    register_dispatch_mode,
    update_dispatch_mode,
)
from rlcomm.single_controller.decorator import RETURN_LEN_KW, dispatch_spec_of
from rlcomm.worker.dispatch import check_signature


class FourRanks:
    world_size = 4


def test_builtin_dispatch_functions():
    g = FourRanks()
    assert dispatch_one_to_all(g, 1, y="a") == (([1] * 4,), {"y": ["a"] * 4})
    assert dispatch_all_to_all(g, [1, 2, 3, 4]) == (([1, 2, 3, 4],), {})
    assert collect_all_to_all(g, [1, 2]) == [1, 2]
    args, kwargs = dispatch_dp_compute(g, list(range(10)), scale=2)
    assert args == ([[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]],) and kwargs == {"scale": [2] * 4}
    assert collect_dp_compute(g, [[0], [1, 2], [3]]) == [0, 1, 2, 3]
    args, _ = dispatch_nd_compute([0, 0, 1, 1], 2, g, list(range(4)))
    assert args == ([[0, 1], [0, 1], [2, 3], [2, 3]],)
    assert collect_nd_compute([True, False, True, False], g, [[0], [9], [1], [9]]) == [0, 1]
    fns = get_predefined_dispatch_fn(Dispatch.ONE_TO_ALL)
    assert fns == {"dispatch_fn": dispatch_one_to_all, "collect_fn": collect_all_to_all}


def test_register_validates_early():
    with pytest.raises(TypeError, match="unknown dispatch_mode"):
        register("ONE_TO_ALL")
    with pytest.raises(TypeError, match="custom dispatch_mode must be"):
        register({"dispatch_fn": dispatch_one_to_all})
    with pytest.raises(TypeError, match="execute_mode must be"):
        register(Dispatch.ONE_TO_ALL, execute_mode="all")
    with pytest.raises(TypeError, match="mesh dispatch mode runs on every rank"):
        register(make_nd_compute_dispatch_fn("m"), execute_mode=Execute.RANK_ZERO)
    with pytest.raises(TypeError, match="pad=True applies to DP and mesh modes, not ONE_TO_ALL"):
        register(Dispatch.ONE_TO_ALL, pad=True)


def test_register_dispatch_mode_names_a_mode():
    mode = register_dispatch_mode("TEST_FIRST_ONLY", dispatch_one_to_all, collect_all_to_all)
    assert Dispatch.TEST_FIRST_ONLY is mode and repr(mode) == "Dispatch.TEST_FIRST_ONLY"
    with pytest.raises(ValueError, match="taken"):
        register_dispatch_mode("TEST_FIRST_ONLY", dispatch_one_to_all, collect_all_to_all)
    update_dispatch_mode(mode, dispatch_all_to_all, collect_all_to_all)
    assert get_predefined_dispatch_fn(mode)["dispatch_fn"] is dispatch_all_to_all


def test_registered_method_runs_as_written_and_reports_lengths():
    class W:
        @register(Dispatch.DP_COMPUTE, blocking=False)
        def f(self, x, *, scale=1, **extra):
            return [v * scale for v in x]

        @register(Dispatch.DP_COMPUTE)
        async def g(self, x):
            return x

    w = W()
    assert w.f([1, 2], scale=3) == [3, 6]
    assert w.f([1, 2], **{RETURN_LEN_KW: True}) == ([1, 2], 2)
    assert asyncio.run(w.g((1,), **{RETURN_LEN_KW: True})) == ((1,), 1)
    spec = dispatch_spec_of(W.f)
    assert spec.mode_name == "DP_COMPUTE" and spec.blocking is False
    params = list(inspect.signature(W.f).parameters)
    assert params == ["self", "x", "scale", RETURN_LEN_KW, "extra"]
    assert inspect.iscoroutinefunction(W.g)
    # Without **kwargs of its own, the wrapper takes the hidden dependency keywords...
    assert list(inspect.signature(W.g).parameters)[-1] == "_rlcomm_deps"
    assert asyncio.run(W.g(w, [1], _rlcomm_dep_0=3)) == [1]
    # ...but the driver checks calls against the user's signature.
    with pytest.raises(TypeError, match="unexpected keyword argument 'y'"):
        check_signature(W, "g", ([1],), {"y": 2}, "W.g()")
    assert dispatch_spec_of(make_nd_compute_dispatch_fn) is None
