"""Resource pools without Ray: slot assignment, real-layout ranks, merge and split."""

import pytest

from rlcomm.placement import NodeSpec
from rlcomm.single_controller import RayResourcePool, merge_resource_pool, split_resource_pool
from rlcomm.single_controller.resource_pool import assign_pool_slots, pool_placements


def _flat(assigned, nodes, use_gpu=False):
    slots = []
    for node, local in assigned:
        base = sum((n.num_accelerators if use_gpu else n.num_cpu_slots) for n in nodes if n.node_rank < node)
        slots.extend((node, s, base + s) for s in local)
    return slots


def test_local_rank_lists():
    pool = RayResourcePool([2, 4], use_gpu=False)
    assert pool.world_size == 6 and pool.store == [2, 4]
    assert pool.local_rank_list() == [0, 1, 0, 1, 2, 3]
    assert pool.local_world_size_list() == [2, 2, 4, 4, 4, 4]


def test_uneven_nodes_rank_by_the_real_layout():
    nodes = [NodeSpec(0, 0, 4), NodeSpec(1, 0, 4)]
    taken: dict[int, set[int]] = {}
    assigned = assign_pool_slots([2, 4], nodes, False, taken)
    assert assigned == [(0, [0, 1]), (1, [0, 1, 2, 3])]
    placements = pool_placements(_flat(assigned, nodes), use_gpu=False)
    assert [p.node_rank for p in placements] == [0, 0, 1, 1, 1, 1]
    assert [p.local_rank for p in placements] == [0, 1, 0, 1, 2, 3]
    assert [p.local_world_size for p in placements] == [2, 2, 4, 4, 4, 4]
    assert [p.hardware_ranks for p in placements] == [(0,), (1,), (4,), (5,), (6,), (7,)]
    # A second pool gets the free slots; node 1 is full, so its entry 1 falls back to node 0.
    assert assign_pool_slots([1, 1], nodes, False, taken) == [(0, [2]), (0, [3])]
    with pytest.raises(ValueError, match="no node has 1 free CPU worker slots"):
        assign_pool_slots([1], nodes, False, taken)


def test_one_node_holds_both_entries():
    nodes = [NodeSpec(0, 8, 32)]
    assigned = assign_pool_slots([2, 4], nodes, True, {})
    assert assigned == [(0, [0, 1]), (0, [2, 3, 4, 5])]
    placements = pool_placements(_flat(assigned, nodes, True), use_gpu=True)
    assert [p.accelerator_ids for p in placements] == [(0,), (1,), (2,), (3,), (4,), (5,)]
    assert [p.local_rank for p in placements] == [0, 1, 2, 3, 4, 5]
    assert {p.local_world_size for p in placements} == {6}
    with pytest.raises(ValueError, match="no node has 4 free GPUs"):
        assign_pool_slots([4], nodes, True, {0: {0, 1, 2, 3, 4}})


def test_merge_and_split():
    a, b = RayResourcePool([4], use_gpu=False), RayResourcePool([2], use_gpu=False, name_prefix="b")
    merged = merge_resource_pool(a, b)
    assert merged.store == [4, 2] and merged.local_rank_list() == [0, 1, 2, 3, 0, 1]
    with pytest.raises(ValueError, match="GPU pool with a CPU pool"):
        merge_resource_pool(a, RayResourcePool([1], use_gpu=True))
    first, second = split_resource_pool(RayResourcePool([2, 4], use_gpu=False), [3, 3])
    assert first.store == [2, 1] and second.store == [3]
    assert first.local_rank_list() == [0, 1, 0] and second.local_world_size_list() == [3, 3, 3]
    assert [p.store for p in split_resource_pool(merged, 2)] == [[2], [2], [2]]
    with pytest.raises(ValueError, match="does not divide"):
        split_resource_pool(merged, 4)
    with pytest.raises(ValueError, match="sum to 6"):
        split_resource_pool(merged, [3, 2])


def test_pool_rejects():
    with pytest.raises(ValueError, match="counts >= 1"):
        RayResourcePool([])
    with pytest.raises(ValueError, match="counts >= 1"):
        RayResourcePool([2, 0])
    with pytest.raises(ValueError, match="max_colocate_count"):
        RayResourcePool([1], max_colocate_count=0)


def test_a_dropped_pool_in_a_reference_cycle_gives_its_slots_back(cluster):
    """Pools free their slots when collected; one caught in a reference cycle is
    collected when a later pool would not fit otherwise."""
    import gc

    from rlcomm.single_controller.resource_pool import _ALLOCATOR

    gc.collect()
    node = cluster.nodes[0]
    free = node.num_cpu_slots - len(_ALLOCATOR._taken.get((node.node_id, "cpu"), ()))
    gc.disable()
    try:
        pool = RayResourcePool([free], use_gpu=False)
        assert len(pool.placements(cluster)) == free
        pool.cycle = pool  # only the cycle collector can free it now
        del pool
        again = RayResourcePool([free], use_gpu=False)
        assert len(again.placements(cluster)) == free
    finally:
        gc.enable()
