"""Placement strategies, pure: no Ray."""

import pytest

from rlcomm import FlexiblePlacementStrategy, NodePlacementStrategy, PackedPlacementStrategy
from rlcomm.placement import NodeSpec

GPU_NODES = [NodeSpec(0, 4, 16), NodeSpec(1, 4, 16)]
CPU_NODES = [NodeSpec(0, 0, 8), NodeSpec(1, 0, 8)]


def test_packed_one_per_gpu_spans_nodes():
    ps = PackedPlacementStrategy(0, 7).get_placements(GPU_NODES)
    assert [p.rank for p in ps] == list(range(8))
    assert [p.node_rank for p in ps] == [0] * 4 + [1] * 4
    assert [p.local_rank for p in ps] == [0, 1, 2, 3] * 2
    assert [p.accelerator_ids for p in ps] == [(i,) for i in range(4)] * 2
    assert all(p.local_world_size == 4 for p in ps)


def test_packed_several_per_process_and_stride():
    ps = PackedPlacementStrategy(0, 7, num_hardware_per_process=2, stride=2).get_placements(
        GPU_NODES
    )
    assert [p.hardware_ranks for p in ps] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert [p.accelerator_ids for p in ps] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert [p.node_rank for p in ps] == [0, 0, 1, 1]


def test_packed_counts_cpu_slots_without_accelerators():
    ps = PackedPlacementStrategy(6, 9).get_placements(CPU_NODES)
    assert [(p.node_rank, p.local_rank) for p in ps] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(p.accelerator_ids == () for p in ps)


@pytest.mark.parametrize(
    "args, match",
    [
        ((3, 1), "start_hardware_rank <= end_hardware_rank"),
        ((-1, 2), "start_hardware_rank"),
        ((0, 2, 2), "not a multiple"),
        ((0, 3, 0), ">= 1"),
    ],
)
def test_packed_bad_specs(args, match):
    with pytest.raises(ValueError, match=match):
        PackedPlacementStrategy(*args)


def test_packed_out_of_range_and_spanning_nodes():
    with pytest.raises(ValueError, match="out of range"):
        PackedPlacementStrategy(0, 8).get_placements(GPU_NODES)
    with pytest.raises(ValueError, match="span several nodes"):
        PackedPlacementStrategy(2, 5, num_hardware_per_process=4).get_placements(GPU_NODES)


def test_flexible():
    ps = FlexiblePlacementStrategy([[4, 5], [0], [7]]).get_placements(GPU_NODES)
    assert [(p.node_rank, p.accelerator_ids) for p in ps] == [(1, (0, 1)), (0, (0,)), (1, (3,))]
    assert [p.local_rank for p in ps] == [0, 0, 1]
    assert [p.local_world_size for p in ps] == [2, 1, 2]


@pytest.mark.parametrize(
    "spec, match",
    [([], "non-empty"), ([[0], []], "non-empty"), ([[0, 1], [1]], "more than one"),
     ([[-2]], "negative")],
)
def test_flexible_bad_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        FlexiblePlacementStrategy(spec)


def test_flexible_out_of_range_and_span():
    with pytest.raises(ValueError, match="out of range"):
        FlexiblePlacementStrategy([[9]]).get_placements(GPU_NODES)
    with pytest.raises(ValueError, match="span several nodes"):
        FlexiblePlacementStrategy([[3, 4]]).get_placements(GPU_NODES)


def test_node_strategy():
    ps = NodePlacementStrategy([0, 1, 1]).get_placements(CPU_NODES)
    assert [(p.rank, p.node_rank, p.local_rank, p.local_world_size) for p in ps] == [
        (0, 0, 0, 1),
        (1, 1, 0, 2),
        (2, 1, 1, 2),
    ]
    assert all(p.accelerator_ids == () for p in ps)


@pytest.mark.parametrize("spec, match", [([], "must not be empty"), ([0, -1], ">= 0")])
def test_node_strategy_bad_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        NodePlacementStrategy(spec)


def test_node_strategy_missing_node():
    with pytest.raises(ValueError, match=r"node ranks \[2\] do not exist"):
        NodePlacementStrategy([0, 2]).get_placements(CPU_NODES)
