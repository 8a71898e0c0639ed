"""@register dispatch modes on real Ray workers: DP splits, padding, batch objects, mesh
(3D) modes, custom modes, non-blocking results, driver-free chaining, early errors."""

import asyncio

import pytest
import torch

from rlcomm.errors import WorkerGroupError
from rlcomm.single_controller import (
    Dispatch,
    DispatchFuture,
    Execute,
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    Worker,
    collect_all_to_all,
    make_nd_compute_dispatch_fn,
    register,
    register_dispatch_mode,
    split_resource_pool,
)
from tests.markers import cpu_only_cluster
from tests.worker.test_dispatch import Batch  # the shared verl DataProto stand-in


def _reverse_dispatch(worker_group, *args, **kwargs):
    """Each argument is a list of one entry per rank; send them in reverse rank order."""
    return tuple(list(reversed(a)) for a in args), {k: list(reversed(v)) for k, v in kwargs.items()}


def _sum_collect(worker_group, outputs):
    return sum(outputs)


REVERSED = register_dispatch_mode("REVERSED_SUM", _reverse_dispatch, _sum_collect)


def _short_dispatch(worker_group, *args, **kwargs):
    return args, kwargs  # leaves the lists as given: wrong lengths get caught


class DPWorker(Worker):
    def __init__(self):
        super().__init__()
        self.calls = 0
        self.last = None
        dp, tp = divmod(self.rank, 2)
        # 3D_PROTO on dp=2 x tp=2 (one pipeline stage): split by dp, collect from tp 0.
        self._register_dispatch_collect_info("train", dp_rank=dp, is_collect=tp == 0)
        # 3D_ALL_MICRO_DP: micro-dp groups {0, 2} and {1, 3}; local rank 0 of each collects.
        self._register_dispatch_collect_info("infer", dp_rank=self.rank % 2, is_collect=self.rank < 2)
        # 3D_PP_ONLY on pp=2 x tp=2: broadcast, collect from tp 0 (dp 0) of each stage.
        self._register_dispatch_collect_info("pp_only", dp_rank=0, is_collect=tp == 0)

    def _record(self, x):
        self.calls += 1
        self.last = x

    def count(self):
        return self.calls

    def last_input(self):
        return self.last

    def local_env(self):
        import os

        return os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"]

    @register(Dispatch.DP_COMPUTE)
    def double(self, x, scale=1):
        self._record(x)
        if isinstance(x, dict):
            return {k: v * 2 * scale for k, v in x.items()}
        if isinstance(x, torch.Tensor):
            return x * 2 * scale
        return [v * 2 * scale for v in x]

    @register(Dispatch.DP_COMPUTE)
    def sizes(self, x):
        self._record(x)
        return [(self.rank, len(x))] * len(x)

    @register(Dispatch.DP_COMPUTE, pad=True)
    def padded(self, x):
        self._record(x)
        return [(self.rank, len(x), v) for v in x]

    @register(Dispatch.DP_COMPUTE, blocking=False, pad=True)
    def padded_async(self, x):
        self._record(x)
        return [v + 1000 for v in x]

    @register(Dispatch.DP_COMPUTE, blocking=False)
    def stage(self, x):
        self._record(x)
        return [v + 1 for v in x]

    @register(Dispatch.DP_COMPUTE)
    async def async_double(self, x):
        await asyncio.sleep(0)
        return [v * 2 for v in x]

    @register(Dispatch.DP_COMPUTE_PROTO)
    def proto(self, batch):
        self._record(batch)
        return Batch([v + 100 for v in batch.items])

    @register(Dispatch.DP_COMPUTE_METRIC)
    def metric(self, x):
        return {"n": len(x), "rank": self.rank}

    @register(Dispatch.DP_COMPUTE, execute_mode=Execute.RANK_ZERO)
    def whole(self, x):
        return (self.rank, x)

    @register(Dispatch.ALL_TO_ALL)
    def per_rank(self, x):
        return (self.rank, x)

    @register(REVERSED)
    def ident(self, x):
        return x

    @register({"dispatch_fn": _short_dispatch, "collect_fn": collect_all_to_all})
    def short(self, x):
        return x

    @register(make_nd_compute_dispatch_fn("train"))
    def train_step(self, x):
        self._record(x)
        return [(self.rank, v) for v in x]

    @register(make_nd_compute_dispatch_fn("infer"))
    def infer_step(self, x):
        self._record(x)
        return [(self.rank, v) for v in x]

    @register(make_nd_compute_dispatch_fn("pp_only"))
    def weight_names(self, prefix):
        self._record(prefix)
        return [f"{prefix}.pp{self.rank // 2}.weight"]

    @register(make_nd_compute_dispatch_fn("train"), pad=True)
    def train_padded(self, x):
        return [(len(x), v) for v in x]


def _by_rank_sizes(pairs):
    sizes = {}
    for rank, n in pairs:
        sizes[rank] = n
    return [sizes[r] for r in sorted(sizes)]


def test_dispatch_modes_and_chaining(cluster):
    pool = RayResourcePool([1, 3], use_gpu=False)
    cls = RayClassWithInitArgs(DPWorker)
    a = RayWorkerGroup(pool, cls, name_prefix="dpA_")
    b = None
    try:
        # Pools with different counts per entry: LOCAL_* follow the real layout (one node).
        assert pool.local_rank_list() == [0, 0, 1, 2]
        assert a.execute_all_sync("local_env") == [(str(i), "4") for i in range(4)]
        b_pool = split_resource_pool(pool, [3, 1])[0]
        b = RayWorkerGroup(b_pool, cls, name_prefix="dpB_")
        assert [p.hardware_ranks for p in b.placements] == [p.hardware_ranks for p in a.placements[:3]]

        data = list(range(10))
        # Uneven splits: 10 over 3 ranks is 4, 3, 3; over 4 ranks 3, 3, 2, 2.
        assert _by_rank_sizes(b.sizes(data)) == [4, 3, 3]
        assert _by_rank_sizes(a.sizes(x=data)) == [3, 3, 2, 2]
        assert a.double(data) == [v * 2 for v in data]
        assert a.double(data, 3) == [v * 6 for v in data]
        assert torch.equal(a.double(torch.arange(10), scale=2), torch.arange(10) * 4)
        out = a.double(x={"ids": torch.arange(6), "mask": torch.ones(6)})
        assert torch.equal(out["ids"], torch.arange(6) * 2) and out["mask"].shape == (6,)
        assert b.async_double(data) == [v * 2 for v in data]
        assert b.proto(Batch(data)).items == [v + 100 for v in data]
        assert b.metric(data) == [{"n": 4, "rank": 0}, {"n": 3, "rank": 1}, {"n": 3, "rank": 2}]
        assert b.whole(data) == (0, data)
        assert a.per_rank(["a", "b", "c", "d"]) == [(0, "a"), (1, "b"), (2, "c"), (3, "d")]
        assert a.ident([1, 2, 3, 4]) == 4 + 3 + 2 + 1
        assert a.ident([10, 20, 30, 40]) == 100

        # Padding on request: equal chunks, padding stripped (also when non-blocking).
        padded = a.padded(data)
        assert [v for _, _, v in padded] == data and {n for _, n, _ in padded} == {3}
        fut = a.padded_async(data)
        assert isinstance(fut, DispatchFuture) and fut.pad == 2
        assert fut.get() == [v + 1000 for v in data]

        # 3D_PROTO: split by dp, every tp rank of a dp group gets the same chunk, tp 0 returns.
        assert a.train_step(data) == [(0, v) for v in range(5)] + [(2, v) for v in range(5, 10)]
        assert a.execute_all_sync("last_input") == [data[:5], data[:5], data[5:], data[5:]]
        # 3D_ALL_MICRO_DP: groups {0, 2} and {1, 3}; rank 0 and 1 return.
        assert a.infer_step(data) == [(0, v) for v in range(5)] + [(1, v) for v in range(5, 10)]
        assert a.execute_all_sync("last_input") == [data[:5], data[5:], data[:5], data[5:]]
        # 3D_PP_ONLY: broadcast; one output per pipeline stage.
        assert a.weight_names("model") == ["model.pp0.weight", "model.pp1.weight"]
        assert a.execute_all_sync("last_input") == ["model"] * 4
        # Mesh dispatch with padding: 7 items over dp=2 -> 4 + 4, padding stripped.
        assert a.train_padded(list(range(7))) == [(4, v) for v in range(7)]

        # Driver-free chaining: A's non-blocking result feeds B's DP call (and back).
        staged = a.stage(data)  # 4 parts of 3, 3, 2, 2 items, never fetched by the driver
        assert b.double(staged) == [(v + 1) * 2 for v in data]
        assert b.execute_all_sync("last_input") == [
            [v + 1 for v in data[:4]], [v + 1 for v in data[4:7]], [v + 1 for v in data[7:]]
        ]
        assert staged._done is False  # the driver has not collected it
        ranks = [0] * 4 + [1] * 4 + [2] * 2  # 10 padded to 12: 4, 4, 4 (the last 2 are padding)
        assert b.padded(x=staged) == [(r, 4, v + 1) for r, v in zip(ranks, data, strict=True)]
        back = b.stage(a.stage(data))
        assert a.train_step(back) == [(0, v + 2) for v in range(5)] + [(2, v + 2) for v in range(5, 10)]
        padded_fut = b.padded_async(a.stage(list(range(4))))  # 4 over 3 padded to 6, stripped
        chained = a.double(padded_fut)
        assert chained == [(v + 1 + 1000) * 2 for v in range(4)]
        assert staged.get() == [v + 1 for v in data]

        # Found by name (e.g. from another worker), registered methods still dispatch.
        again = RayWorkerGroup.from_group_name(DPWorker, a.worker_group_name)
        assert again.double([1, 2, 3]) == [2, 4, 6] and again.resource_pool is None

        # Wrong calls fail on the driver, naming method and mode, before anything runs.
        before = a.execute_all_sync("count")
        with pytest.raises(TypeError, match=r"DPWorker\.double\(\) \[dispatch DP_COMPUTE, execute ALL\].*missing"):
            a.double()
        with pytest.raises(TypeError, match=r"DPWorker\.double\(\) \[dispatch DP_COMPUTE.*too many"):
            a.double(data, 1, 2)
        with pytest.raises(ValueError, match=r"DPWorker\.double\(\) \[dispatch DP_COMPUTE.*different lengths"):
            a.double(data, scale=[1, 2])
        with pytest.raises(ValueError, match=r"per_rank\(\) \[dispatch ALL_TO_ALL.*one entry per rank \(4\), got length 3"):
            a.per_rank(["a", "b", "c"])
        with pytest.raises(ValueError, match=r"short\(\) \[dispatch custom _short_dispatch.*output of _short_dispatch"):
            a.short([1, 2])
        with pytest.raises(TypeError, match=r"train_step\(\) \[dispatch nd mesh 'train', execute ALL\]: wrong arguments"):
            a.train_step(y=data)
        with pytest.raises(TypeError, match="result of .*cannot be split"):
            a.double(_NotChainable(a))
        assert a.execute_all_sync("count") == before
    finally:
        a.shutdown()
        if b is not None:
            b.shutdown()


class _NotChainable(DispatchFuture):
    """A DispatchFuture of an ALL_TO_ALL call: it cannot be split."""

    def __init__(self, group):
        from rlcomm.single_controller.decorator import DispatchSpec

        spec = DispatchSpec(Dispatch.ALL_TO_ALL, Execute.ALL, False, False)
        super().__init__(group, "per_rank", "DPWorker.per_rank() [dispatch ALL_TO_ALL]", "all_to_all",
                         spec, collect_all_to_all, [0], [], None, 0, None)


@cpu_only_cluster
def test_pool_limits(cluster):
    with pytest.raises(ValueError, match="use_gpu=True but the cluster has no GPUs"):
        RayWorkerGroup(RayResourcePool([1], use_gpu=True), RayClassWithInitArgs(DPWorker))
    pool = RayResourcePool([1], use_gpu=False, max_colocate_count=1)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(DPWorker))
    try:
        with pytest.raises(WorkerGroupError, match="max_colocate_count"):
            RayWorkerGroup(pool, RayClassWithInitArgs(DPWorker))
    finally:
        group.shutdown()
    with pytest.raises(TypeError, match="not a rlcomm Worker subclass"):
        RayWorkerGroup(pool, RayClassWithInitArgs(Batch))
