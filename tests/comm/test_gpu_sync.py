"""Weight sync between workers on one GPU: CUDA IPC messages (staged and lent), receives
into parameters, the device-side broadcast, ordering on the caller's stream, memory over
many syncs and after a peer is killed. Needs a CUDA device (the protocol itself is tested
on CPU in test_cuda_ipc.py and test_broadcast_device.py)."""

from __future__ import annotations

import os
import signal

import pytest
import torch

import rlcomm
from rlcomm import CollectiveGroupOptions, PackedPlacementStrategy, Worker
from rlcomm.comm.identity.address import WorkerAddress
from tests.waiting import wait_for

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

LENT = 4 << 20  # bytes of a lent tensor (above RLCOMM_CUDA_SLOT_BYTES)


def _params(step: float, n: int = 8) -> dict[str, torch.Tensor]:
    return {f"layer{i}": torch.full((LENT // 2,), step + i, dtype=torch.bfloat16, device="cuda")
            for i in range(n)}


class Syncer(Worker):
    """One worker on GPU 0 (every group here is placed on hardware rank 0)."""

    def __init__(self):
        super().__init__()
        torch.cuda.set_device(0)
        self.params = _params(0.0)

    def _conn(self, group, rank):
        return self._comm.connection(WorkerAddress.of(group, rank), None)

    def cuda_stats(self, group, rank):
        """The CUDA transport's stats of the connection with the peer (the connection
        is kept here, so that it can still be read once the peer is gone)."""
        if not hasattr(self, "_kept"):
            self._kept = self._conn(group, rank)
        cuda = self._kept._cuda
        return None if cuda is None else {"name": cuda.name, **cuda.stats()}

    def pid(self):
        return os.getpid()

    def memory(self):
        torch.cuda.synchronize()
        torch.cuda.ipc_collect()
        return torch.cuda.memory_allocated()

    # -- the trainer's side -------------------------------------------------------------

    def push(self, group, rank, steps, async_op=False):
        """Send fresh values of the same parameters ``steps`` times."""
        for step in range(steps):
            for i, p in enumerate(self.params.values()):
                p.fill_(step + i)
            work = self.send(self.params, group, rank, async_op=async_op)
            if work is not None:
                work.wait()
        return True

    def push_small(self, group, rank, count):
        for i in range(count):
            self.send({"i": torch.tensor([i], device="cuda"), "v": torch.ones(16, device="cuda")},
                      group, rank)
        return True

    def push_after_slow_kernel(self, group, rank, nbytes):
        """Queue a slow kernel, then write the payload on the same stream, then send it
        with async_op: the receiver must see the written values, not the old ones."""
        t = torch.zeros(nbytes // 4, device="cuda")
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the write
        t.fill_(42.0)
        work = self.send(t, group, rank, async_op=True)
        work.wait()
        return True

    def cast(self, groups, src, step):
        for i, p in enumerate(self.params.values()):
            p.fill_(step + i)
        return self.broadcast(self.params, groups=groups, src=src) is self.params

    # -- a receiver's side ---------------------------------------------------------------

    def pull(self, group, rank, steps, into=True):
        """Receive ``steps`` syncs (into the parameters, or fresh tensors); check each."""
        ok = True
        for step in range(steps):
            got = self.recv(group, rank, into=self.params if into else None)
            if into:
                ok = ok and got is self.params
            ok = ok and all(bool((v == step + i).all()) for i, v in enumerate(got.values()))
        return ok

    def pull_parts(self, group, rank):
        """Receive one sync as an iterator, then one as shards (half of each layer's
        elements, in float32): check both against the values push() sends (step 0)."""
        named = dict(self.recv(group, rank, into=rlcomm.Buckets()))
        whole = all(bool((named[f"layer{i}"] == i).all()) for i in range(len(named)))
        shards = {f"layer{i}": rlcomm.Shard(0, 1, 2, dtype=torch.float32) for i in range(8)}
        got = self.recv(group, rank, shards=shards)
        halves = all(v.dtype == torch.float32 and v.numel() == LENT // 4
                     and bool((v == i).all()) for i, v in enumerate(got.values()))
        return whole, halves

    def pull_small(self, group, rank, count):
        return [int(self.recv(group, rank)["i"]) for _ in range(count)] == list(range(count))

    def pull_one(self, group, rank, nbytes):
        got = self.recv(group, rank)
        return bool((got == 42.0).all()) and got.numel() == nbytes // 4

    def take_cast(self, groups, src, step, into):
        target = {k: torch.zeros_like(v) for k, v in self.params.items()} if into else None
        got = self.broadcast(None, groups=groups, src=src, into=target)
        links = sum(len(group._device._links) for group in self._comm._bcast.values())
        return (all(bool((v == step + i).all()) for i, v in enumerate(got.values())),
                (got is target) if into else True, links)

    # -- a pushed sync ---------------------------------------------------------------------

    def make_pusher(self, to):
        self.pusher = self.weight_pusher(self.params, to=to, timeout=60)
        return sorted(self.pusher.receivers)

    def make_target(self, src):
        self.target = self.pushed_weights(self.params, src=src, timeout=60)
        return self.target.version

    def add_receivers(self, to):
        self.pusher.add_receivers(to, timeout=60)
        return sorted(self.pusher.receivers)

    def push_versions(self, count):
        """Push ``count`` versions: version k holds k + i in layer i. Returns the
        versions, or the error of the push that failed (its type and peer)."""
        versions = []
        for _ in range(count):
            k = self.pusher.version + 1
            for i, p in enumerate(self.params.values()):
                p.fill_(k + i)
            try:
                versions.append(self.pusher.push(timeout=60))
            except Exception as exc:  # noqa: BLE001 - the test looks at it
                versions.append((type(exc).__name__, exc.peer))
        return versions

    def take_versions(self, count, hold=False):
        """Update ``count`` times, checking each version's values on this stream (the
        check is queued after the update, as a rollout's forward pass is)."""
        ok = True
        for _ in range(count):
            k = self.target.update(timeout=60)
            ok = ok and all(bool((v == k + i).all()) for i, v in enumerate(self.params.values()))
        if not hold:
            self.target.release()
        return ok, self.target.version

    def send_and_receive(self, group, rank, nbytes, value):
        """Send a lent payload of ``value`` to the peer before receiving its own (both do)."""
        mine = torch.full((nbytes // 4,), float(value), device="cuda")
        self.send(mine, group, rank, options=CollectiveGroupOptions(timeout=60))
        got = self.recv(group, rank, options=CollectiveGroupOptions(timeout=60))
        return float(got[0])


def _launch(cluster, name, count=1):
    return [Syncer.create_group().launch(cluster, PackedPlacementStrategy(0, 0), name=f"{name}_{i}")
            for i in range(count)]


@pytest.fixture
def pair(cluster):
    groups = _launch(cluster, "gsync", 2)
    yield groups
    for g in groups:
        g.shutdown()


def test_a_weight_sync_lands_in_the_receivers_parameters(pair):
    trainer, rollout = pair
    pulled = rollout.pull("gsync_0", 0, 5)
    assert trainer.push("gsync_1", 0, 5).wait(timeout=120) == [True]
    assert pulled.wait(timeout=120) == [True]
    stats = trainer.cuda_stats("gsync_1", 0).wait(timeout=30)[0]
    # Lent: nothing staged for these 32 MiB, each allocation shared once.
    assert stats["name"] == "cuda_ipc" and stats["acked"] == 5 and stats["lent"] == 8
    # From the second sync into the same parameters, the trainer wrote them itself.
    assert stats["targets"] == 1
    # Fresh tensors, and small messages that go through the staging slots.
    pulled = rollout.pull("gsync_0", 0, 2, into=False)
    assert trainer.push("gsync_1", 0, 2, async_op=True).wait(timeout=120) == [True]
    assert pulled.wait(timeout=120) == [True]
    assert trainer.push_small("gsync_1", 0, 50).wait(timeout=120) == [True]  # no receiver yet
    assert rollout.pull_small("gsync_0", 0, 50).wait(timeout=120) == [True]


def test_a_cuda_sync_is_taken_as_an_iterator_and_as_shards(pair):
    trainer, rollout = pair
    parts = rollout.pull_parts("gsync_0", 0)
    assert trainer.push("gsync_1", 0, 1).wait(timeout=120) == [True]
    assert trainer.push("gsync_1", 0, 1).wait(timeout=120) == [True]
    assert parts.wait(timeout=120) == [(True, True)]


@pytest.mark.parametrize("nbytes", [4096, 64 << 20], ids=["staged", "lent"])
def test_an_async_send_is_ordered_after_the_callers_stream(pair, nbytes):
    trainer, rollout = pair
    got = rollout.pull_one("gsync_0", 0, nbytes)
    assert trainer.push_after_slow_kernel("gsync_1", 0, nbytes).wait(timeout=120) == [True]
    assert got.wait(timeout=120) == [True]


def test_two_workers_that_both_send_cuda_first_both_go_on(pair):
    a, b = pair
    # Each is rank 0 of its own group: the values tell the two payloads apart.
    ra = a.send_and_receive("gsync_1", 0, 16 << 20, 1.0)
    rb = b.send_and_receive("gsync_0", 0, 16 << 20, 2.0)
    assert ra.wait(timeout=120) == [2.0] and rb.wait(timeout=120) == [1.0]


def test_no_gpu_memory_growth_over_a_thousand_syncs(pair):
    trainer, rollout = pair
    for _ in range(2):  # warm: connection, caches, allocator
        pulled = rollout.pull("gsync_0", 0, 10)
        trainer.push("gsync_1", 0, 10).wait(timeout=120)
        pulled.wait(timeout=120)
    before = [g.memory().wait(timeout=30)[0] for g in pair]
    pulled = rollout.pull("gsync_0", 0, 1000)
    assert trainer.push("gsync_1", 0, 1000).wait(timeout=600) == [True]
    assert pulled.wait(timeout=600) == [True]
    after = [g.memory().wait(timeout=30)[0] for g in pair]
    assert after == before, (before, after)


def test_staging_and_lent_memory_are_released_when_the_peer_is_killed(cluster):
    trainer, victim = _launch(cluster, "gkill", 2)
    try:
        base = trainer.memory().wait(timeout=30)[0]
        pulled = victim.pull("gkill_0", 0, 1)
        trainer.push("gkill_1", 0, 1).wait(timeout=120)
        pulled.wait(timeout=120)  # the trainer's parameters are lent to the victim now
        # A stopped victim cannot copy staged payloads out (its reader would, at once,
        # as their frames arrive, and ack them without any recv): they hold slots.
        pid = victim.pid().wait(timeout=30)[0]
        os.kill(pid, signal.SIGSTOP)
        trainer.push_small("gkill_1", 0, 4).wait(timeout=120)
        held = trainer.cuda_stats("gkill_1", 0).wait(timeout=30)[0]
        assert held["staging_bytes"] > 0 and held["in_flight"] == 4 and held["lent"] > 0
        os.kill(pid, signal.SIGKILL)
        # The trainer's connection sees the death and releases everything.
        wait_for(lambda: (lambda s: s["staging_bytes"] == 0 and s["lent"] == 0)(
            trainer.cuda_stats("gkill_1", 0).wait(timeout=30)[0]),
            "the trainer releases the staging and lent memory of the dead victim", 30, 0.2)
        # Nothing of the trainer's GPU memory stays pinned for the dead process.
        assert trainer.memory().wait(timeout=30)[0] == base
    finally:
        trainer.shutdown()
        victim.shutdown()


def test_a_broadcast_on_one_gpu_copies_on_the_device(cluster):
    groups = _launch(cluster, "gcast", 3)
    members = [("gcast_0", 0), ("gcast_1", 0), ("gcast_2", 0)]
    try:
        for step, into in ((1.0, True), (2.0, False), (3.0, True)):
            takes = [g.take_cast(members, ("gcast_0", 0), step, into) for g in groups[1:]]
            assert groups[0].cast(members, ("gcast_0", 0), step).wait(timeout=120) == [True]
            results = [t.wait(timeout=120)[0] for t in takes]
            # Every receiver copied on the device, over its link with the source.
            assert all(ok and same and links == 1 for ok, same, links in results), results
    finally:
        for g in groups:
            g.shutdown()


def test_a_pushed_sync_writes_each_receivers_parameters_from_the_trainer(cluster):
    trainer, *rollouts = _launch(cluster, "gpush", 3)
    try:
        targets = [r.make_target(("gpush_0", 0)) for r in rollouts]
        made = trainer.make_pusher([("gpush_1", 0), ("gpush_2", 0)])
        assert made.wait(timeout=120) == [["gpush_1:0", "gpush_2:0"]]
        assert [t.wait(timeout=120) for t in targets] == [[0], [0]]
        takes = [r.take_versions(20) for r in rollouts]
        assert trainer.push_versions(20).wait(timeout=300) == [list(range(1, 21))]
        assert [t.wait(timeout=300) for t in takes] == [[(True, 20)], [(True, 20)]]
        before = [g.memory().wait(timeout=30)[0] for g in (trainer, *rollouts)]
        takes = [r.take_versions(200) for r in rollouts]
        assert trainer.push_versions(200).wait(timeout=300)[0][-1] == 220
        assert [t.wait(timeout=300) for t in takes] == [[(True, 220)], [(True, 220)]]
        assert [g.memory().wait(timeout=30)[0] for g in (trainer, *rollouts)] == before
    finally:
        for g in (trainer, *rollouts):
            g.shutdown()


def test_a_pushed_sync_goes_on_without_a_receiver_that_was_killed(cluster):
    groups = _launch(cluster, "gpkill", 3)
    trainer, victim, rollout = groups
    try:
        targets = [r.make_target(("gpkill_0", 0)) for r in (victim, rollout)]
        trainer.make_pusher([("gpkill_1", 0), ("gpkill_2", 0)]).wait(timeout=120)
        [t.wait(timeout=120) for t in targets]
        takes = [r.take_versions(1) for r in (victim, rollout)]
        assert trainer.push_versions(1).wait(timeout=120) == [[1]]
        assert [t.wait(timeout=120) for t in takes] == [[(True, 1)], [(True, 1)]]
        os.kill(victim.pid().wait(timeout=30)[0], signal.SIGKILL)
        taken = rollout.take_versions(2)
        pushed = trainer.push_versions(2).wait(timeout=120)[0]
        assert pushed == [("PeerLostError", "gpkill_1:0"), 3], pushed
        assert taken.wait(timeout=120) == [(True, 3)]
        # A rollout in the victim's place joins: it gets the next push on.
        (late,) = _launch(cluster, "gpkill_late", 1)
        groups.append(late)
        target = late.make_target(("gpkill_0", 0))
        assert trainer.add_receivers([("gpkill_late_0", 0)]).wait(timeout=120) == [
            ["gpkill_2:0", "gpkill_late_0:0"]]
        assert target.wait(timeout=120) == [3]
        takes = [r.take_versions(1) for r in (rollout, late)]
        assert trainer.push_versions(1).wait(timeout=120) == [[4]]
        assert [t.wait(timeout=120) for t in takes] == [[(True, 4)], [(True, 4)]]
    finally:
        for g in groups:
            g.shutdown()
