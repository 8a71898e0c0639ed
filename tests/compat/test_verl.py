"""verl (``verl.single_controller``) behaviours, checked on rlcomm with only the imports
changed and the GPU set to CPU.

Each case names the verl behaviour it checks and the upstream test that asserts it
(verl ``tests/single_controller/``). Written anew from what those tests assert.
"""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest
import ray
import torch

import rlcomm.single_controller.decorator as decorator_module
from rlcomm.single_controller import (
    Dispatch,
    DispatchFuture,
    Execute,
    MeshRegisteredError,
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    Worker,
    collect_all_to_all,
    create_colocated_worker_cls,
    dispatch_one_to_all,
    get_predefined_dispatch_fn,
    register,
    register_dispatch_mode,
    update_dispatch_mode,
)
from rlcomm.single_controller.decorator import (
    DISPATCH_MODE_FN_REGISTRY,
    DispatchMode,
    _check_dispatch_mode,
    _check_execute_mode,
)
from rlcomm.single_controller.dispatch_modes import mode_entry


def duplicate_two(worker_group, *args, **kwargs):
    """A custom dispatch: lists of two, repeated over the ranks (0, 1, 0, 1, ...)."""
    n = worker_group.world_size
    return (
        tuple([a[i % 2] for i in range(n)] for a in args),
        {k: [v[i % 2] for i in range(n)] for k, v in kwargs.items()},
    )


@ray.remote
class Adder(Worker):
    def __init__(self, x) -> None:
        super().__init__()
        self._x = x

    def foo(self, y):
        return self._x + y

    def getenv(self, key):
        return os.environ.get(key, f"{key} not set")

    @register(dispatch_mode=Dispatch.ALL_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def foo_rank_zero(self, x, y):
        return self._x + y + x

    @register(Dispatch.ALL_TO_ALL, execute_mode=Execute.RANK_ZERO, blocking=False)
    def foo_rank_zero_async(self, x, y):
        return self._x + y + x

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def foo_one_to_all(self, x, y):
        return self._x + y + x

    @register(Dispatch.ALL_TO_ALL, blocking=False)
    def foo_all_to_all(self, x, y):
        return self._x + y + x

    @register(dispatch_mode={"dispatch_fn": duplicate_two, "collect_fn": collect_all_to_all})
    def foo_custom(self, x, y):
        return self._x + y + x

    @register(Dispatch.DP_COMPUTE_PROTO)
    def dp_add(self, data):
        return {"output": data["input"] + self._x + self.rank}

    @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
    async def dp_add_async(self, data):
        await asyncio.sleep(0.01)
        return {"output": data["input"] * 2 + self._x + self.rank}


@ray.remote
class RoleA(Worker):
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def add(self, data):
        return {"a": data["a"] + self.rank}

    def whoami(self):
        return ("A", self.rank)


@ray.remote
class RoleB(Worker):
    def __init__(self, config) -> None:
        super().__init__()
        self.config = config

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    async def sub(self, data):
        return {"a": data["a"] - self.config["b"]}


def add_one(data):
    return data + 1


def count_rows(worker, data):
    return {"rows": data["ids"], "count": torch.full((len(data["ids"]),), worker.rank)}


@ray.remote(num_cpus=0)
def attach_and_call(worker_names):
    """verl test_worker_group_basics.py::remote_call_wg: from_detached in another task."""
    group = RayWorkerGroup.from_detached(
        worker_names=worker_names, ray_cls_with_init=RayClassWithInitArgs(cls=Adder, x=2)
    )
    return group.foo_custom(x=[1, 2], y=[5, 6]), group.foo_rank_zero(x=1, y=2), group.worker_names


@pytest.fixture(scope="module")
def adders(ray_local):
    pool = RayResourcePool([4], use_gpu=False)
    prefix = f"verl_basics_{uuid.uuid4().hex[:4]}"
    group = RayWorkerGroup(
        resource_pool=pool,
        ray_cls_with_init=RayClassWithInitArgs(cls=Adder, x=2),
        name_prefix=prefix,
        device_name="cpu",
        worker_env={"test_key": "test_value"},
    )
    yield group, pool, prefix
    group.shutdown()


# -- test_worker_group_basics.py::test_basics ----------------------------------------------


def test_execute_all_and_registered_calls(adders):
    """verl test_worker_group_basics.py::test_basics: execute_all_sync / execute_all_async
    (refs for ray.get), ONE_TO_ALL and ALL_TO_ALL with blocking=False give ObjectRefs
    that ray.get accepts, a custom dispatch, ALL_TO_ALL on RANK_ZERO."""
    group, _, _ = adders
    assert group.world_size == 4
    assert group.execute_all_sync("foo", y=3) == [5, 5, 5, 5]
    refs = group.execute_all_async("foo", y=4)
    assert ray.get(refs) == [6, 6, 6, 6]
    refs = group.foo_one_to_all(x=1, y=2)
    assert all(isinstance(r, ray.ObjectRef) for r in refs)
    assert ray.get(refs) == [5, 5, 5, 5]
    refs = group.foo_all_to_all(x=[1, 2, 3, 4], y=[5, 6, 7, 8])
    assert ray.get(refs) == [8, 10, 12, 14]
    assert refs.get() == [8, 10, 12, 14]  # rlcomm's DispatchFuture API still works
    assert group.foo_custom(x=[1, 2], y=[5, 6]) == [8, 10, 8, 10]
    assert group.foo_rank_zero(x=1, y=2) == 5
    ref = group.foo_rank_zero_async(x=1, y=2)
    assert isinstance(ref, ray.ObjectRef) and ray.get(ref) == 5


def test_from_detached_in_another_task(adders):
    """verl test_worker_group_basics.py::remote_call_wg: a task attaches to the group by
    its worker_names and calls its registered methods."""
    group, _, _ = adders
    custom, rank_zero, names = ray.get(attach_and_call.remote(group.worker_names), timeout=120)
    assert custom == [8, 10, 8, 10] and rank_zero == 5
    assert names == group.worker_names and len(names) == 4


def test_execute_func_rank_zero(adders):
    """verl test_worker_group_basics.py: execute_func_rank_zero(add_one, tensor)."""
    group, _, _ = adders
    out = group.execute_func_rank_zero(add_one, torch.ones(2, 2))
    torch.testing.assert_close(out, torch.ones(2, 2) + 1)


# -- test_ray_local_envs_on_cpu.py ---------------------------------------------------------


def test_worker_env_variables(adders):
    """verl test_ray_local_envs_on_cpu.py::test_basics / test_customized_worker_env:
    RAY_LOCAL_WORLD_SIZE on every worker, worker_env added, WG_BACKEND / WG_PREFIX."""
    group, _, prefix = adders
    assert group.execute_all_sync("getenv", key="RAY_LOCAL_WORLD_SIZE") == ["4"] * 4
    assert group.execute_all_sync("getenv", key="test_key") == ["test_value"] * 4
    assert group.execute_all_sync("getenv", key="WG_BACKEND") == ["ray"] * 4
    assert group.execute_all_sync("getenv", key="WG_PREFIX") == [prefix] * 4
    assert group.device_name == "cpu"


def test_worker_env_cannot_override_system_variables(ray_local):
    """verl test_ray_local_envs_on_cpu.py::test_customized_worker_env: worker_env that sets
    WORLD_SIZE raises ValueError naming it."""
    pool = RayResourcePool([1], use_gpu=False)
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        RayWorkerGroup(
            resource_pool=pool,
            ray_cls_with_init=RayClassWithInitArgs(cls=Adder, x=0),
            worker_env={"WORLD_SIZE": "100"},
        )


def test_bad_device_name_and_detached(ray_local):
    pool = RayResourcePool([1], use_gpu=False)
    cls = RayClassWithInitArgs(cls=Adder, x=0)
    with pytest.raises(ValueError, match="device_name"):
        RayWorkerGroup(pool, cls, device_name="tpu")
    with pytest.raises(ValueError, match="detached"):
        RayWorkerGroup(pool, cls, detached=True)
    with pytest.raises(ValueError, match="worker_names"):
        RayWorkerGroup(None, cls)


# -- test_decorator_on_cpu.py --------------------------------------------------------------


def test_dp_compute_proto_sync_and_async(adders):
    """verl test_decorator_on_cpu.py::test_decorator_dp_compute and
    ::test_decorator_async_function: DP_COMPUTE_PROTO splits the batch over the ranks;
    an ``async def`` method with blocking=False returns a future whose get() collects."""
    group, _, _ = adders
    data = {"input": torch.arange(8, dtype=torch.float32)}
    out = group.dp_add(data)
    expected = torch.arange(8, dtype=torch.float32) + 2 + torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    torch.testing.assert_close(out["output"], expected)
    future = group.dp_add_async(data)
    assert isinstance(future, DispatchFuture)
    result = future.get()
    expected = torch.arange(8, dtype=torch.float32) * 2 + 2 + torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    torch.testing.assert_close(result["output"], expected)
    per_rank = ray.get(future)  # as verl's refs: one output per rank
    assert len(per_rank) == 4 and per_rank[1]["output"].tolist() == [7.0, 9.0]


# -- test_driverfunc_to_worker.py ----------------------------------------------------------


def test_execute_with_func_generator(adders):
    """verl test_driverfunc_to_worker.py::test: execute_with_func_generator(func, batch)
    splits the batch, runs func(worker, chunk) on each rank and concatenates, equal to
    running func on the whole batch."""
    group, _, _ = adders
    data = {"ids": torch.arange(8)}
    out = group.execute_with_func_generator(count_rows, data)
    assert out["rows"].tolist() == list(range(8))
    assert out["count"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


# -- test_get_set_dispatch_collect_cpu.py --------------------------------------------------


def test_get_set_dispatch_collect(monkeypatch):
    """verl test_get_set_dispatch_collect_cpu.py: a worker takes another's mesh info with
    set_dispatch_collect(mesh, **other.get_dispatch_collect()); a name already registered
    raises AssertionError; registering a mesh twice raises ValueError."""
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2",
                       "MASTER_ADDR": "localhost", "MASTER_PORT": "12345"}.items():
        monkeypatch.setenv(key, value)
    ref, actor, both = Worker(), Worker(), Worker()
    ref._register_dispatch_collect_info(mesh_name="actor", dp_rank=0, is_collect=True)
    actor._register_dispatch_collect_info(mesh_name="actor", dp_rank=1, is_collect=False)
    both.set_dispatch_collect(mesh_name="ref", **ref.get_dispatch_collect())
    both.set_dispatch_collect(mesh_name="actor", **actor.get_dispatch_collect())
    assert both._query_dispatch_info("ref") == 0 and both._query_collect_info("ref")
    assert both._query_dispatch_info("actor") == 1 and not both._query_collect_info("actor")
    assert both.query_collect_info("ref") is True
    other = Worker()
    other._register_dispatch_collect_info(mesh_name="actor", dp_rank=1, is_collect=False)
    with pytest.raises(AssertionError):
        both.set_dispatch_collect(mesh_name="actor", **other.get_dispatch_collect())
    with pytest.raises(ValueError):
        other._register_dispatch_collect_info(mesh_name="actor", dp_rank=0, is_collect=True)
    assert issubclass(MeshRegisteredError, ValueError)


# -- base/test_decorator.py ----------------------------------------------------------------


@pytest.fixture
def saved_registry():
    """As verl's test does: a copy of the module's registry, put back with clear and update."""
    saved = decorator_module.DISPATCH_MODE_FN_REGISTRY.copy()
    yield saved
    decorator_module.DISPATCH_MODE_FN_REGISTRY.clear()
    decorator_module.DISPATCH_MODE_FN_REGISTRY.update(saved)


def test_register_new_dispatch_mode(saved_registry):
    """verl base/test_decorator.py::test_register_new_dispatch_mode: a new mode becomes a
    Dispatch member that _check_dispatch_mode accepts, its functions sit in
    DISPATCH_MODE_FN_REGISTRY as a two-key dict, and Dispatch.remove takes it away."""

    def my_dispatch(worker_group, *args, **kwargs):
        return args, kwargs

    def my_collect(worker_group, output):
        return output

    register_dispatch_mode("COMPAT_TEST_MODE", my_dispatch, my_collect)
    try:
        _check_dispatch_mode(Dispatch.COMPAT_TEST_MODE)
        assert DISPATCH_MODE_FN_REGISTRY[Dispatch.COMPAT_TEST_MODE] == {
            "dispatch_fn": my_dispatch, "collect_fn": my_collect,
        }
        assert get_predefined_dispatch_fn(Dispatch.COMPAT_TEST_MODE) is (
            DISPATCH_MODE_FN_REGISTRY[Dispatch.COMPAT_TEST_MODE])
        with pytest.raises(ValueError):  # verl's DynamicEnum.register: a taken name
            register_dispatch_mode("COMPAT_TEST_MODE", my_dispatch, my_collect)
    finally:
        removed = Dispatch.remove("COMPAT_TEST_MODE")
    assert repr(removed) == "Dispatch.COMPAT_TEST_MODE"
    assert not hasattr(Dispatch, "COMPAT_TEST_MODE")
    # verl upper-cases mode names, on the way in and in remove.
    lower = register_dispatch_mode("compat_lower", my_dispatch, my_collect)
    assert Dispatch.COMPAT_LOWER is lower and Dispatch.remove("compat_lower") is lower
    with pytest.raises(KeyError):
        Dispatch.remove("ONE_TO_ALL")  # built-in modes stay (rlcomm's choice)


def test_check_dispatch_mode_asserts_like_verl():
    """verl decorator._check_dispatch_mode / _check_execute_mode: a mode or a dict with
    both keys passes; anything else raises AssertionError."""
    _check_dispatch_mode(Dispatch.ONE_TO_ALL)
    _check_dispatch_mode({"dispatch_fn": dispatch_one_to_all, "collect_fn": collect_all_to_all})
    for bad in ("ONE_TO_ALL", None, {"dispatch_fn": dispatch_one_to_all}):
        with pytest.raises(AssertionError):
            _check_dispatch_mode(bad)
    _check_execute_mode(Execute.RANK_ZERO)
    with pytest.raises(AssertionError):
        _check_execute_mode("ALL")


def test_update_existing_dispatch_mode(saved_registry):
    """verl base/test_decorator.py::test_update_existing_dispatch_mode: the registry
    holds the new functions; restoring the registry (the fixture) gives ONE_TO_ALL its
    built-in behaviour back."""

    def new_dispatch(worker_group, *args, **kwargs):
        return args, kwargs

    def new_collect(worker_group, output):
        return output

    update_dispatch_mode(Dispatch.ONE_TO_ALL, new_dispatch, new_collect)
    assert DISPATCH_MODE_FN_REGISTRY[Dispatch.ONE_TO_ALL]["dispatch_fn"] is new_dispatch
    assert DISPATCH_MODE_FN_REGISTRY[Dispatch.ONE_TO_ALL]["collect_fn"] is new_collect
    assert mode_entry(Dispatch.ONE_TO_ALL).kind == "custom"
    with pytest.raises(AssertionError):  # verl asserts the mode exists
        update_dispatch_mode(DispatchMode("NEVER_REGISTERED"), new_dispatch, new_collect)
    decorator_module.DISPATCH_MODE_FN_REGISTRY.clear()
    decorator_module.DISPATCH_MODE_FN_REGISTRY.update(saved_registry)
    assert get_predefined_dispatch_fn(Dispatch.ONE_TO_ALL)["dispatch_fn"] is dispatch_one_to_all
    assert mode_entry(Dispatch.ONE_TO_ALL).kind == "one_to_all"


# -- test_colocated_workers.py -------------------------------------------------------------


def test_colocated_workers(ray_local):
    """verl test_colocated_workers.py::test_colocated_workers: two roles in one process
    per rank (create_colocated_worker_cls + spawn) give the results of separate groups."""
    pool = RayResourcePool(process_on_nodes=[2], use_gpu=False)
    a_cls = RayClassWithInitArgs(cls=RoleA)
    b_cls = RayClassWithInitArgs(cls=RoleB, config={"b": 10})
    data = {"a": torch.zeros(10)}
    a_group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=a_cls, device_name="cpu")
    b_group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=b_cls, device_name="cpu")
    both = None
    try:
        expected_a, expected_b = a_group.add(data), b_group.sub(data)
        both = RayWorkerGroup(
            resource_pool=pool,
            ray_cls_with_init=create_colocated_worker_cls({"actor": a_cls, "critic": b_cls}),
            device_name="cpu",
        )
        spawned = both.spawn(prefix_set={"actor", "critic"}.__iter__())
        torch.testing.assert_close(spawned["actor"].add(data)["a"], expected_a["a"], atol=0, rtol=0)
        torch.testing.assert_close(spawned["critic"].sub(data)["a"], expected_b["a"], atol=0, rtol=0)
        # The prefixed names on the combined group, and one process per rank for both roles.
        assert both.actor_whoami().wait(timeout=60) == [("A", 0), ("A", 1)]
        pids = both.execute_all_sync("actor_whoami")
        assert pids == spawned["actor"].whoami().wait(timeout=60)
        with pytest.raises(ValueError, match="roles"):
            both.spawn(["nope"])
    finally:
        for g in (a_group, b_group, both):
            if g is not None:
                g.shutdown()


def test_colocated_rejects_non_workers():
    class Plain:
        pass

    with pytest.raises(TypeError, match="Worker"):
        create_colocated_worker_cls({"x": RayClassWithInitArgs(cls=Plain)})


# -- RayResourcePool.get_placement_groups (test_split_resource_pool.py, ...) ---------------


def test_get_placement_groups(ray_local):
    """verl test_split_resource_pool.py / test_high_level_scheduling_api.py call
    pool.get_placement_groups() (one group per pool node, one bundle per worker); the
    pool still runs groups afterwards."""
    pool = RayResourcePool([2], use_gpu=False)
    pgs = pool.get_placement_groups(device_name="cpu")
    assert len(pgs) == 1 and pgs[0].bundle_count == 2
    assert pool.get_placement_groups() == pgs and pool.pgs == pgs
    group = RayWorkerGroup(pool, RayClassWithInitArgs(cls=Adder, x=1), device_name="cpu")
    try:
        assert group.execute_all_sync("foo", y=1) == [2, 2]
    finally:
        group.shutdown()
        for pg in pgs:
            ray.util.remove_placement_group(pg)
