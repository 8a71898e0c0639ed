"""NamedSharding and NeMo-RL style calls: sharded data, tied workers, configure hook, shutdown."""

import logging
import time

import numpy as np
import pytest
import ray

from rlcomm import MultiWorkerFuture, NamedSharding, NodePlacementStrategy, Worker, WorkerGroup
from rlcomm.cluster import RLCOMM_NAMESPACE
from rlcomm.errors import WorkerGroupError
from rlcomm.placement import BundlePlacementStrategy, NodeSpec
from rlcomm.worker.layout import RankLayout
from rlcomm.worker.sharded_calls import called_ranks
from rlcomm.worker.sharding import plan_sharded_call
from tests.markers import cpu_only_cluster
from tests.waiting import wait_for

DP_TP = [[0, 1], [2, 3]]

# -- pure ----------------------------------------------------------------------------------


def test_named_sharding_basics():
    s = NamedSharding(DP_TP, ["dp", "tp"])
    assert s.shape == {"dp": 2, "tp": 2} and s.size == 4 and s.ndim == 2 and s.names == ["dp", "tp"]
    assert s.get_ranks(dp=1) == [2, 3] and s.get_ranks(tp=1) == [1, 3] and s.get_ranks(dp=1, tp=0) == 2
    assert s.get_worker_coords(1) == {"dp": 0, "tp": 1}
    assert s.get_axis_size("tp") == 2 and s.get_axis_index("tp") == 1
    assert np.array_equal(s.layout, np.array(DP_TP))
    assert s == NamedSharding(np.array(DP_TP), ["dp", "tp"]) and s != NamedSharding(DP_TP, ["a", "b"])
    nemo = NamedSharding([[[0, 1, 2, 3], [4, 5, 6, 7]]], ["dp", "pp", "tp"])
    assert nemo.get_ranks(dp=0, pp=1) == [4, 5, 6, 7] and nemo.shape == {"dp": 1, "pp": 2, "tp": 4}


@pytest.mark.parametrize(
    "layout,names,match",
    [
        ([[0, 1], [2]], ["a", "b"], "regular|ints"),
        ([[0, 1], [1, 2]], ["a", "b"], "exactly once"),
        ([0, 1], ["a", "b"], "2 names"),
        ([[0, 1]], ["a", "a"], "distinct"),
        ([0.5, 1], ["a"], "ints"),
    ],
)
def test_named_sharding_rejects(layout, names, match):
    with pytest.raises(ValueError, match=match):
        NamedSharding(layout, names)


def test_named_sharding_bad_lookups():
    s = NamedSharding(DP_TP, ["dp", "tp"])
    with pytest.raises(ValueError, match="no axis 'pp'"):
        s.get_ranks(pp=0)
    with pytest.raises(ValueError, match="out of range"):
        s.get_ranks(dp=2)
    with pytest.raises(ValueError, match="not in the layout"):
        s.get_worker_coords(4)


# in_sharded, replicated, output_is_replicated, dummy ->
#   {rank: shard index or None for a dummy call}, [ranks whose output is returned]
SHARDED_TABLE = [
    (["dp", "tp"], [], None, False, {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)}, [0, 1, 2, 3]),
    (["tp", "dp"], [], None, False, {0: (0, 0), 1: (1, 0), 2: (0, 1), 3: (1, 1)}, [0, 1, 2, 3]),
    (["dp"], ["tp"], ["tp"], False, {0: (0,), 1: (0,), 2: (1,), 3: (1,)}, [0, 2]),
    (["dp"], ["tp"], None, False, {0: (0,), 1: (0,), 2: (1,), 3: (1,)}, [0, 1, 2, 3]),
    (["dp"], [], None, False, {0: (0,), 2: (1,)}, [0, 2]),
    (["dp"], [], None, True, {0: (0,), 1: None, 2: (1,), 3: None}, [0, 2]),
    (["tp"], ["dp"], ["dp"], False, {0: (0,), 1: (1,), 2: (0,), 3: (1,)}, [0, 1]),
    ([], ["dp", "tp"], ["dp", "tp"], False, {0: (), 1: (), 2: (), 3: ()}, [0]),
    ([], [], None, False, {0: ()}, [0]),
    ([], [], None, True, {0: (), 1: None, 2: None, 3: None}, [0]),
]


@pytest.mark.parametrize("sharded,replicated,out_rep,dummy,calls,returns", SHARDED_TABLE)
def test_plan_sharded_call_table(sharded, replicated, out_rep, dummy, calls, returns):
    plan = plan_sharded_call(NamedSharding(DP_TP, ["dp", "tp"]), sharded, replicated, out_rep, dummy)
    assert {e.rank: e.shard for e in plan} == calls
    assert [e.rank for e in plan if e.returns] == returns


def test_plan_sharded_call_rejects():
    s = NamedSharding(DP_TP, ["dp", "tp"])
    with pytest.raises(ValueError, match="both in_sharded_axes and replicate_on_axes"):
        plan_sharded_call(s, ["dp"], ["dp"])
    with pytest.raises(ValueError, match="unknown axes"):
        plan_sharded_call(s, ["data_parallel"])


def test_bundle_placement_strategy():
    nodes = [NodeSpec(0, 0, 4), NodeSpec(1, 0, 4)]
    placements = BundlePlacementStrategy([(0, [0, 1]), (1, [2]), (0, [3])]).get_placements(nodes)
    assert [(p.node_rank, p.local_rank, p.local_world_size) for p in placements] == [
        (0, 0, 3), (0, 1, 3), (1, 0, 1), (0, 2, 3)
    ]
    gpus = BundlePlacementStrategy([(1, [1, 0])]).get_placements([NodeSpec(0, 2, 8), NodeSpec(1, 2, 8)])
    assert [p.accelerator_ids for p in gpus] == [(1,), (0,)] and gpus[0].hardware_ranks == (3,)
    with pytest.raises(ValueError, match="used twice"):
        BundlePlacementStrategy([(0, [0]), (0, [0])])
    with pytest.raises(ValueError, match="node 2 has no local index 0"):
        BundlePlacementStrategy([(2, [0])]).get_placements(nodes)


def test_layout_without_launch():
    """A group's layout (what its ``tied_workers_groups``, ``dp_size`` and the like
    read) worked out from its bundles or its sharding, no workers launched."""
    layout = RankLayout(3, None, [(0, [0, 1]), (0, [2])])
    assert [list(g) for g in layout.tied_groups] == [[0, 1], [2]] and layout.sharding is None
    assert layout.dp_size() == 2 and layout.dp_leader(1) == 2
    with pytest.raises(ValueError, match="needs a group launched with sharding"):
        called_ranks(layout, 3, ["data_parallel"], "here")
    with pytest.raises(WorkerGroupError, match="no data-parallel axis"):
        RankLayout(4, NamedSharding(DP_TP, ["x", "y"]), None).dp_size()
    layout = RankLayout(4, None, [(0, [0, 1]), (0, [2, 3])])
    assert layout.sharding == NamedSharding(DP_TP, ["data_parallel", "tied_worker"])
    assert layout.dp_size() == 2 and layout.dp_leader(1) == 2
    layout = RankLayout(2, None, None)
    assert layout.dp_size() == 2 and layout.tied_group_index() == {0: 0, 1: 1}
    with pytest.raises(ValueError, match="has 4 ranks but the group has 2 workers"):
        RankLayout(2, NamedSharding(DP_TP, ["dp", "tp"]), None)
    group = WorkerGroup(ShardWorker)  # not launched: no workers, nothing tied
    assert group.tied_workers_groups == [] and group.sharding_annotations is None


# -- on Ray --------------------------------------------------------------------------------


class ShardWorker(Worker):
    def __init__(self, tag="user"):
        super().__init__()
        self.tag = tag
        self.calls = 0

    def echo(self, data, extra=None):
        self.calls += 1
        return (self.rank, data, extra)

    def count(self):
        return self.calls

    def hang(self):
        time.sleep(600)

    def info(self):
        import os

        return {"tag": self.tag, "FROM_WORKER": os.environ.get("FROM_WORKER"),
                "USER_ONLY": os.environ.get("USER_ONLY"), "RANK": os.environ["RANK"],
                "HOOK": os.environ.get("HOOK")}

    @classmethod
    def configure_worker(cls, num_gpus, bundle_indices=None):
        env = {"FROM_WORKER": "worker", "RANK": "99", "HOOK": f"{num_gpus}|{bundle_indices}"}
        return {"max_concurrency": 2}, env, {"tag": "hooked"}


def test_sharded_data_table_on_dp2_tp2(cluster):
    group = ShardWorker.create_group().launch(
        cluster, NodePlacementStrategy([0] * 4), name="shard_dp_tp",
        sharding=NamedSharding(DP_TP, ["dp", "tp"]),
    )
    try:
        assert group.dp_size == 2 and group.get_dp_leader_worker_idx(1) == 2
        assert [m["coords"] for m in group.worker_metadata][1] == {"dp": 0, "tp": 1}
        data = {  # data[i][j] by the order of in_sharded_axes
            2: [["d00", "d01"], ["d10", "d11"]],
            1: ["d0", "d1"],
            0: "whole",
        }
        for sharded, replicated, out_rep, dummy, calls, returns in SHARDED_TABLE:
            arg = data[len(sharded)]
            fut = group.run_all_workers_sharded_data(
                "echo", arg, in_sharded_axes=sharded, replicate_on_axes=replicated,
                output_is_replicated=out_rep, make_dummy_calls_to_free_axes=dummy,
                common_kwargs={"extra": "common"},
            )
            assert isinstance(fut, MultiWorkerFuture)
            assert fut.called_workers == sorted(calls) and fut.return_from_workers == returns
            received = {rank: got for rank, got, _ in ray.get(fut.futures)}

            def expected(shard, arg=arg):
                if shard is None:
                    return None
                value = arg
                for i in shard:
                    value = value[i]
                return value

            assert received == {r: expected(s) for r, s in calls.items()}, (sharded, replicated)
            results = group.get_all_worker_results(fut)
            assert [r for r, _, _ in results] == returns
            assert all(extra == "common" for _, _, extra in results)
        # Keyword sharded data, positional sharded data, and rank-0-only runs.
        fut = group.run_all_workers_sharded_data(
            "echo", data=["a", "b"], in_sharded_axes=["dp"], replicate_on_axes=["tp"],
            output_is_replicated=["tp"],
        )
        assert group.get_all_worker_results(fut) == [(0, "a", None), (2, "b", None)]
        refs = group.run_all_workers_single_data("echo", "s", run_rank_0_only_axes=["tp"])
        assert [r for r, _, _ in ray.get(refs)] == [0, 2]
        refs = group.run_all_workers_multiple_data("echo", ["w0", "w1", "w2", "w3"], extra=[0, 1, 2, 3])
        assert ray.get(refs) == [(0, "w0", 0), (1, "w1", 1), (2, "w2", 2), (3, "w3", 3)]
        refs = group.run_all_workers_multiple_data(
            "echo", ["w0", "w1", "w2", "w3"], run_rank_0_only_axes=["dp"], common_kwargs={"extra": 9}
        )
        assert ray.get(refs) == [(0, "w0", 9), (1, "w1", 9)]
        assert ray.get(group.run_single_worker_single_data("echo", 3, "one")) == (3, "one", None)

        # Wrong calls fail on the driver, naming the method, before any worker runs.
        before = ray.get(group.run_all_workers_single_data("count"))
        with pytest.raises(ValueError, match=r"run_all_workers_sharded_data\('echo'\).*argument 0 "
                           r"must be a nested list with 2 entries at depth 0.*got length 3"):
            group.run_all_workers_sharded_data("echo", ["a", "b", "c"], in_sharded_axes=["dp"])
        with pytest.raises(ValueError, match=r"data must be a nested list with 2 entries at depth 1"):
            group.run_all_workers_sharded_data("echo", data=[["a"], ["b"]], in_sharded_axes=["dp", "tp"])
        with pytest.raises(TypeError, match=r"run_all_workers_sharded_data\('echo'\) on ShardWorker "
                           r"group 'shard_dp_tp': wrong arguments: too many positional"):
            group.run_all_workers_sharded_data("echo", ["a", "b"], ["c", "d"], ["e", "f"], in_sharded_axes=["dp"])
        with pytest.raises(ValueError, match=r"argument 0 must be a list with one entry per worker \(4\), "
                           r"got length 2"):
            group.run_all_workers_multiple_data("echo", ["a", "b"])
        with pytest.raises(TypeError, match="missing a required argument"):
            group.run_all_workers_single_data("echo")
        with pytest.raises(AttributeError, match="has no method 'nope'"):
            group.run_all_workers_single_data("nope")
        with pytest.raises(ValueError, match="worker_idx 4 not in 0..3"):
            group.run_single_worker_single_data("echo", 4, "x")
        with pytest.raises(ValueError, match="unknown axes"):
            group.run_all_workers_single_data("echo", 1, run_rank_0_only_axes=["pp"])
        assert ray.get(group.run_all_workers_single_data("count")) == before
    finally:
        group.shutdown()


@cpu_only_cluster
def test_tied_workers_configure_hook_and_hanging_shutdown(cluster, caplog):
    caplog.set_level(logging.WARNING, logger="rlcomm.worker.configure")
    group = ShardWorker.create_group(tag="user").launch(
        cluster, name="tied", bundle_indices_list=[(0, [0, 1]), (0, [2, 3])],
        env_vars={"FROM_WORKER": "user", "USER_ONLY": "u"},
    )
    try:
        assert group.tied_workers_groups == [[0, 1], [2, 3]]
        assert group.dp_size == 2 and group.get_dp_leader_worker_idx(1) == 2
        meta = group.worker_metadata
        assert [m["bundle_indices"] for m in meta] == [(0, [0, 1]), None, (0, [2, 3]), None]
        assert [m["tied_group_idx"] for m in meta] == [0, 0, 1, 1]

        # Precedence: user < configure_worker < rlcomm; overrides are logged.
        infos = group.info().wait()
        assert [i["RANK"] for i in infos] == ["0", "1", "2", "3"]
        assert all(i["FROM_WORKER"] == "worker" and i["USER_ONLY"] == "u" for i in infos)
        assert all(i["tag"] == "hooked" for i in infos)
        assert [i["HOOK"] for i in infos] == ["0|(0, [0, 1])", "0|None", "0|(0, [2, 3])", "0|None"]
        text = caplog.text
        assert "configure_worker() overrides env var FROM_WORKER='user'" in text
        assert "rlcomm overrides env var RANK='99'" in text
        assert "overrides __init__ argument tag='user'" in text

        # Tied workers share one shard (per tied group) and count once.
        refs = group.run_all_workers_multiple_data("echo", ["g0", "g1"])
        assert [d for _, d, _ in ray.get(refs)] == ["g0", "g0", "g1", "g1"]
        bundle = MultiWorkerFuture(futures=refs, called_workers=[0, 1, 2, 3])
        assert group.get_all_worker_results(bundle) == [(0, "g0", None), (2, "g1", None)]
        fut = group.run_all_workers_sharded_data(
            "echo", ["s0", "s1"], in_sharded_axes=["data_parallel"], replicate_on_axes=["tied_worker"]
        )
        assert fut.return_from_workers == [0, 1, 2, 3]
        assert group.get_all_worker_results(fut) == [(0, "s0", None), (2, "s1", None)]

        # A cleanup method that hangs: shutdown returns after the timeout, actors gone.
        names = [m["name"] for m in meta]
        start = time.monotonic()
        assert group.shutdown(cleanup_method="hang", timeout=2.0) is False
        assert time.monotonic() - start < 2.0 + 5.0
        wait_for(lambda: not any(_actor_exists(n) for n in names), "the actors are gone", 15,
                 interval=0.2)
        with pytest.raises(WorkerGroupError, match="shut down"):
            group.run_all_workers_single_data("count")
        assert group.shutdown() is True
    finally:
        group.shutdown()


def _actor_exists(name):
    try:
        ray.get_actor(name, namespace=RLCOMM_NAMESPACE)
        return True
    except ValueError:
        return False
