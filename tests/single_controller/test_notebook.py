"""verl's single-controller notebook (seed 002), cell by cell, on CPU workers.

The seed runs on 8 GPUs; here the pools use ``use_gpu=False`` (CPU worker slots) and the
values are CPU tensors. The printed results of the seed are asserted exactly.
"""

import re

import ray
import torch

from rlcomm.single_controller import (
    Dispatch,
    Execute,
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    Worker,
    collect_all_to_all,
    merge_resource_pool,
    register,
)


@ray.remote
class Accumulator:
    def __init__(self):
        self.value = 0

    def add(self, x):
        self.value += x

    def get_value(self):
        return self.value


@ray.remote
class GPUAccumulator(Worker):
    def __init__(self) -> None:
        super().__init__()
        # The initial value of each rank is the same as the rank (CPU instead of cuda).
        self.value = torch.zeros(size=(1,)) + self.rank

    def add(self, x):
        self.value += x
        return self.value.cpu()


@ray.remote
class GPUAccumulatorDecorator(Worker):
    def __init__(self) -> None:
        super().__init__()
        self.value = torch.zeros(size=(1,)) + self.rank

    @register(Dispatch.ONE_TO_ALL)
    def add(self, x):
        self.value = self.value + x
        return self.value.cpu()


def two_to_all_dispatch_fn(worker_group, *args, **kwargs):
    """Assume the input is a list of 2. Duplicate the input interleaved and pass to each worker."""
    for arg in args:
        assert len(arg) == 2
        for i in range(worker_group.world_size - 2):
            arg.append(arg[i % 2])
    for v in kwargs.values():
        assert len(v) == 2
        for i in range(worker_group.world_size - 2):
            v.append(v[i % 2])
    return args, kwargs


@ray.remote
class TestActor(Worker):
    def __init__(self, x) -> None:
        super().__init__()
        self._x = x

    def foo(self, y):
        return self._x + y

    @register(dispatch_mode=Dispatch.ALL_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def foo_rank_zero(self, x, y):
        return self._x + y + x

    @register(dispatch_mode={"dispatch_fn": two_to_all_dispatch_fn, "collect_fn": collect_all_to_all})
    def foo_custom(self, x, y):
        return self._x + y + x


def tensors(values):
    return [torch.tensor([float(v)]) for v in values]


def assert_tensors(got, values):
    assert len(got) == len(values)
    for g, v in zip(got, tensors(values), strict=True):
        assert torch.equal(g, v), (got, values)


def test_plain_ray_accumulator(cluster):
    accumulator = Accumulator.remote()
    try:
        assert ray.get(accumulator.get_value.remote()) == 0
        accumulator.add.remote(10)
        assert ray.get(accumulator.get_value.remote()) == 10
    finally:
        ray.kill(accumulator)


def test_notebook_cells(cluster):
    groups = []
    try:
        resource_pool = RayResourcePool([4], use_gpu=False)
        class_with_args = RayClassWithInitArgs(cls=GPUAccumulator)
        worker_group = RayWorkerGroup(resource_pool, class_with_args)
        groups.append(worker_group)
        assert_tensors(worker_group.execute_all_sync("add", x=[1, 1, 1, 1]), [1, 2, 3, 4])

        assert resource_pool.local_rank_list() == [0, 1, 2, 3]
        assert resource_pool.local_world_size_list() == [4, 4, 4, 4]

        assert len(worker_group.workers) == 4
        assert all(isinstance(w, ray.actor.ActorHandle) for w in worker_group.workers)
        names = worker_group.worker_names
        assert [n.rsplit(":", 1)[1] for n in names] == ["0", "1", "2", "3"]
        assert all(re.fullmatch(r"[A-Za-z0-9]{6}GPUAccumulator:\d", n) for n in names), names

        resource_pool_new = RayResourcePool([4], use_gpu=False, name_prefix="a")
        resource_pool_merge = merge_resource_pool(resource_pool, resource_pool_new)
        assert resource_pool_new.local_rank_list() == [0, 1, 2, 3]
        assert resource_pool_merge.local_rank_list() == [0, 1, 2, 3, 0, 1, 2, 3]

        worker_group_new = RayWorkerGroup(resource_pool_new, class_with_args)
        groups.append(worker_group_new)
        worker_group_merge = RayWorkerGroup(resource_pool_merge, class_with_args)
        groups.append(worker_group_merge)
        # Colocation: rank i of the merged group sits on slot i of the pools it merges.
        slots = [p.hardware_ranks for p in worker_group_merge.placements]
        assert slots[:4] == [p.hardware_ranks for p in worker_group.placements]
        assert slots[4:] == [p.hardware_ranks for p in worker_group_new.placements]
        assert len(set(slots)) == 8

        assert_tensors(worker_group_new.execute_all_sync("add", x=[2, 2, 2, 2]), [2, 3, 4, 5])
        assert_tensors(
            worker_group_merge.execute_all_sync("add", x=[3, 3, 3, 3, 3, 3, 3, 3]),
            [3, 4, 5, 6, 7, 8, 9, 10],
        )
        for g in groups:
            g.shutdown()

        class_with_args = RayClassWithInitArgs(cls=GPUAccumulatorDecorator)
        gpu_accumulator_decorator = RayWorkerGroup(resource_pool_merge, class_with_args)
        groups.append(gpu_accumulator_decorator)
        assert_tensors(gpu_accumulator_decorator.add(x=10), [10, 11, 12, 13, 14, 15, 16, 17])
        gpu_accumulator_decorator.shutdown()

        class_with_args = RayClassWithInitArgs(cls=TestActor, x=2)
        worker_group = RayWorkerGroup(resource_pool, class_with_args)
        groups.append(worker_group)
        output_ref = worker_group.foo_custom(x=[1, 2], y=[5, 6])
        assert output_ref == [8, 10, 8, 10]
        output_ref = worker_group.foo_rank_zero(x=1, y=2)
        assert output_ref == 5
        assert worker_group.execute_rank_zero_sync("foo", 3) == 5
        assert worker_group.execute_all_sync("foo", [0, 1, 2, 3]) == [2, 3, 4, 5]
        assert ray.get(worker_group.execute_all_async("foo", y=1)) == [3, 3, 3, 3]
    finally:
        for g in groups:
            g.shutdown()
