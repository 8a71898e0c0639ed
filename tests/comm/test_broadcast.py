"""Broadcast between workers of one node: real Ray actors, shared memory fan-out."""

from __future__ import annotations

import time

import pytest
import ray
import torch

from rlcomm import CollectiveGroupOptions, NodePlacementStrategy, Worker
from tests.waiting import actor_pid, wait_process_gone

GROUP, VICTIM = "bc", "bc_victim"
MEMBERS = [(GROUP, [0, 1, 2, 3, 4])]


def _weights(step: int, numel: int = 1 << 16) -> dict[str, torch.Tensor]:
    return {
        f"layer{i}.w": torch.full((numel,), float(step + i), dtype=torch.float32)
        for i in range(4)
    } | {"step": torch.tensor(step), "mask": torch.ones(3, dtype=torch.bool)}


def _matches(got: dict, step: int, numel: int = 1 << 16) -> bool:
    want = _weights(step, numel)
    return set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


class Caster(Worker):
    def __init__(self):
        super().__init__()
        self.held = []

    def cast(self, step, groups, src, source, hold=False, timeout=60.0):
        obj = _weights(step) if source else None
        got = self.broadcast(obj, groups=groups, src=src,
                             options=CollectiveGroupOptions(timeout=timeout))
        if hold:
            self.held.append(got)
        return _matches(got, step)

    def cast_into(self, step, groups, src, source):
        """Receive a broadcast into tensors of this worker's (the source sends)."""
        if source:
            self.broadcast(_weights(step), groups=groups, src=src)
            return True
        into = {k: torch.zeros_like(v) for k, v in _weights(0).items()}
        got = self.broadcast(None, groups=groups, src=src, into=into)
        return got is into and _matches(into, step)

    def cast_object(self, obj, groups, src):
        return self.broadcast(obj, groups=groups, src=src)

    def cast_many(self, steps, numel, groups, src, source):
        """Broadcast ``steps`` times; each receiver checks, then writes into its views
        (copy-on-write: no other member may see it) and drops them."""
        ok = True
        for step in range(steps):
            got = self.broadcast(_weights(step, numel) if source else None, groups=groups, src=src)
            ok = ok and _matches(got, step, numel)
            if not source:
                for t in got.values():
                    t.logical_not_() if t.dtype == torch.bool else t.add_(1)
            del got
        return ok, self.broadcast_pool_bytes()

    def broadcast_plan(self, groups, src_index):
        """The local and remote receivers this member's group computes for a source."""
        from rlcomm.comm.broadcast.group import expand_groups

        group = self._comm._bcast[tuple(expand_groups(groups))]
        return group.plan(src_index)

    def broadcast_relays(self, groups, src_index):
        """Each other node's relay and the members it fans out to, for a source."""
        from rlcomm.comm.broadcast.group import expand_groups

        return self._comm._bcast[tuple(expand_groups(groups))].relays(src_index)

    def broadcast_progress(self, groups):
        """This member's group's ``progress()`` (its latest broadcast)."""
        from rlcomm.comm.broadcast.group import expand_groups

        return self._comm._bcast[tuple(expand_groups(groups))].progress()

    def broadcast_pool_bytes(self):
        return sum(g.pool_bytes for g in self._comm._bcast.values())

    def expect_error(self, method, *args, **kwargs):
        start = time.monotonic()
        try:
            getattr(self, method)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return type(exc).__name__, str(exc), time.monotonic() - start
        return None, "", time.monotonic() - start


@pytest.fixture(scope="module")
def casters(cluster):
    group = Caster.create_group().launch(cluster, NodePlacementStrategy([0] * 5), name=GROUP)
    yield group
    group.shutdown()


def _cast(group, ranks, src_rank, *args, **kwargs):
    """Start ``method`` on every rank of ``ranks``; the source is ``src_rank``."""
    method, rest = args[0], args[1:]
    handles = []
    for rank in ranks:
        handles.append(getattr(group.execute_on(rank), method)(*rest, source=rank == src_rank,
                                                                 **kwargs))
    return handles


def test_dict_of_tensors_to_four_receivers(casters):
    src = (GROUP, 0)
    handles = _cast(casters, range(5), 0, "cast", 3, MEMBERS, src)
    assert [h.wait(timeout=120)[0] for h in handles] == [True] * 5
    # Another source, on the same group.
    handles = _cast(casters, range(5), 2, "cast", 4, MEMBERS, (GROUP, 2))
    assert [h.wait(timeout=120)[0] for h in handles] == [True] * 5
    # Small and non-tensor objects ride in the datagram; the src's object comes back.
    obj = {"lr": 0.1, "names": ["a", "b"]}
    first = casters.execute_on(0).cast_object(obj, MEMBERS, None)
    others = casters.execute_on(1, 2, 3, 4).cast_object(None, MEMBERS, None)
    assert first.wait(timeout=60) == [obj] and others.wait(timeout=60) == [obj] * 4


def test_receivers_take_a_broadcast_into_their_own_tensors(casters):
    handles = _cast(casters, range(5), 0, "cast_into", 6, MEMBERS, (GROUP, 0))
    assert [h.wait(timeout=120)[0] for h in handles] == [True] * 5


def test_segment_is_reused_after_receivers_drop_views(casters):
    numel = 1 << 20  # 4 MiB per tensor, 16 MiB a broadcast
    members = [(GROUP, [1, 0, 2, 3])]
    handles = _cast(casters, [1, 0, 2, 3], 1, "cast_many", 30, numel, members, (GROUP, 1))
    results = [h.wait(timeout=300)[0] for h in handles]
    assert all(ok for ok, _ in results), results
    pool = results[0][1]
    # Bounded: a few slots of ~16 MiB (receivers drop views; the source may run ahead
    # of the slowest by a broadcast or two), not 30 of them.
    assert 0 < pool <= 4 * 18 * (1 << 20), pool


def test_killed_receiver_does_not_hang_the_others(cluster, casters):
    victim = Caster.create_group().launch(cluster, NodePlacementStrategy([0]), name=VICTIM)
    members = [(GROUP, [0, 1, 2]), (VICTIM, 0)]
    src = (GROUP, 0)
    try:
        handles = _cast(casters, [0, 1, 2], 0, "cast", 1, members, src, timeout=20)
        handles.append(victim.cast(1, members, src, source=False, hold=True, timeout=20))
        assert [h.wait(timeout=120)[0] for h in handles] == [True] * 4
        pid = actor_pid(victim.workers[0])
        ray.kill(victim.workers[0], no_restart=True)
        wait_process_gone(pid)
        for step in (2, 3):  # the victim's held slot does not pin the pool either
            err = casters.execute_on(0).expect_error(
                "cast", step, members, src, source=True, timeout=20
            )
            ok = casters.execute_on(1, 2).cast(step, members, src, source=False, timeout=20)
            name, text, took = err.wait(timeout=120)[0]
            assert name == "PeerLostError" and f"{VICTIM}:0" in text, text
            assert took < 25
            assert ok.wait(timeout=120) == [True, True]
    finally:
        victim.shutdown()
