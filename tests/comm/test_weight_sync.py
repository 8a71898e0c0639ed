"""Weight syncs larger than the shared-memory pool: broadcast and send/recv stream in
buckets, each receiver takes them into its tensors, as new ones, as an iterator or as
its tensor-parallel shards; what cannot go through fails on every member at once.

Real Ray actors on one node. The main group's workers start with a pool of 8 MiB
(``launch(env_vars=...)``), so its buckets are 2 MiB and an 8.5 MiB state dict streams.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest
import torch

import rlcomm
from rlcomm import (
    Buckets,
    CollectiveGroupOptions,
    NodePlacementStrategy,
    Shard,
    Worker,
)
from rlcomm.comm.status import process_status
from tests.waiting import actor_pid, wait_process_gone

GROUP = "ws"
POOL = 8 << 20
BUCKET = POOL // 4
ALL = [(GROUP, [0, 1, 2, 3, 4])]
SRC = (GROUP, 0)
#: Well under every op's timeout: a failure that came this fast was not waited out.
FAST = 10.0


def weights(step: int) -> dict[str, torch.Tensor]:
    """A small transformer's shapes (8.5 MiB): 2-D weights of two dtypes, a 1-D tensor
    larger than a bucket, small ones, an empty one. Each value depends on its place."""
    def pattern(shape: tuple[int, ...], dtype: torch.dtype, k: int) -> torch.Tensor:
        n = math.prod(shape)
        return ((torch.arange(n, dtype=torch.int64) * 7 + k * 131 + step) % 251).to(
            dtype).reshape(shape)

    sd = {"embed.weight": pattern((1024, 512), torch.float32, 0)}
    for i in range(3):
        sd[f"layers.{i}.qkv.weight"] = pattern((768, 256), torch.bfloat16, 1 + i)
        sd[f"layers.{i}.o.weight"] = pattern((256, 256), torch.bfloat16, 10 + i)
        sd[f"layers.{i}.norm.weight"] = pattern((256,), torch.float32, 20 + i)
    sd["big"] = pattern(((5 << 20) // 4 + 3,), torch.float32, 30)
    sd["step"] = torch.tensor(step)
    sd["empty"] = torch.empty(0, 4)
    return sd


def layers(step: int) -> dict[str, torch.Tensor]:
    """Sixteen 1 MiB weights (16 MiB): every 2 MiB bucket completes two of them."""
    return {f"layers.{i}.weight": (torch.arange(1 << 18, dtype=torch.float32) + i * 7 + step)
            for i in range(16)}


def tiny(step: int) -> dict[str, torch.Tensor]:
    """A dict small enough to ride in a frame, were it not asked to stream."""
    return {"w": torch.arange(6.0).view(2, 3) + step, "step": torch.tensor(step)}


def tp_shards(rank: int, tp: int):
    """The tensor-parallel layout: column-parallel qkv and embeddings split along dim 0,
    row-parallel o along dim 1 (in float32 on the engine), the rest replicated."""
    def shard(name: str, shape: tuple[int, ...]) -> Shard | None:
        if name.endswith("qkv.weight") or name == "embed.weight":
            return Shard(0, rank, tp)
        if name.endswith("o.weight"):
            return Shard(1, rank, tp, dtype=torch.float32)
        return None
    return shard


def sliced(sd: dict[str, torch.Tensor], rank: int, tp: int) -> dict[str, torch.Tensor]:
    """What a TP rank's shards are, sliced on the source."""
    out = {}
    for name, t in sd.items():
        s = tp_shards(rank, tp)(name, tuple(t.shape))
        out[name] = t if s is None else t.chunk(s.parts, s.dim)[s.index].to(s.dtype or t.dtype)
    return out


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return set(got) == set(want) and all(
        got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)


def stats(members: list) -> dict:
    names = [f"{g}:{r}" for g, ranks in members for r in ranks]
    for group in process_status()["process"]["broadcasts"]:
        if group["members"] == names:
            return group
    raise AssertionError(f"no broadcast group {names}")


class Syncer(Worker):
    def __init__(self):
        super().__init__()
        self.iterator = None
        self.work = None

    # -- broadcast --------------------------------------------------------------------------

    def source(self, step, members=ALL, src=SRC, made=weights, **kw):
        self.broadcast(made(step), groups=members, src=src, **kw)
        return stats(members)

    def take(self, step, how, members=ALL, timeout=60.0, src=SRC, made=weights):
        """Receive a broadcast: into this worker's tensors, whole, as an iterator, or as
        TP shards (``("tp", rank, parts)``); True when every value is right."""
        options = CollectiveGroupOptions(timeout=timeout)
        want = made(step)
        if how == "into":
            into = {k: torch.zeros_like(v) for k, v in want.items()}
            got = self.broadcast(None, groups=members, src=src, options=options, into=into)
            return got is into and same(into, want)
        if how == "whole":
            return same(self.broadcast(None, groups=members, src=src, options=options), want)
        if how == "iter":
            pairs = list(self.broadcast(None, groups=members, src=src, options=options,
                                        into=Buckets()))
            return [n for n, _ in pairs] == list(want) and same(dict(pairs), want)
        _, rank, tp = how
        got = self.broadcast(None, groups=members, src=src, options=options,
                             shards=tp_shards(rank, tp))
        return same(got, sliced(want, rank, tp))

    def start_source(self, step):
        """Start a broadcast of :func:`layers` on the group's thread; returns the buckets
        sent before."""
        before = stats(ALL)["buckets_out"]
        self.work = self.broadcast(layers(step), groups=ALL, src=SRC, async_op=True)
        return before

    def source_state(self):
        return self.work.done(), stats(ALL)

    def finish_source(self):
        self.work.wait()
        return stats(ALL)

    def first_of_iterator(self):
        self.iterator = self.broadcast(None, groups=ALL, src=SRC, into=Buckets())
        self.first = next(self.iterator)
        return self.first[0], self.iterator.buckets_taken, self.iterator.buckets_handed

    def rest_of_iterator(self, step):
        got = dict([self.first])
        most_held = 0
        for name, t in self.iterator:
            got[name] = t
            most_held = max(most_held, self.iterator.buckets_handed - self.iterator.buckets_taken)
        return same(got, layers(step)), most_held

    def broadcast_stats(self, members=ALL):
        return stats(members)

    def first_then_hold(self, members, src, timeout):
        """Take the first tensor of a streamed broadcast and keep the rest waiting (this
        worker is then killed or stopped by the test)."""
        options = CollectiveGroupOptions(timeout=timeout)
        self.iterator = self.broadcast(None, groups=members, src=src, options=options,
                                       into=Buckets())
        return next(self.iterator)[0]

    def first_of_recv_then_hold(self, src_group, timeout):
        options = CollectiveGroupOptions(timeout=timeout)
        self.iterator = self.recv(src_group, 0, options=options, into=Buckets())
        return next(self.iterator)[0]

    # -- send/recv ---------------------------------------------------------------------------

    def send_to(self, step, dst, group=GROUP, made=weights, **kw):
        self.send(made(step), group, dst, **kw)
        return True

    def recv_as(self, step, how, timeout=60.0, group=GROUP, made=weights):
        options = CollectiveGroupOptions(timeout=timeout)
        want = made(step)
        if how == "into":
            into = {k: torch.zeros_like(v) for k, v in want.items()}
            return self.recv(group, 0, options=options, into=into) is into and same(into, want)
        if how == "whole":
            return same(self.recv(group, 0, options=options), want)
        if how == "iter":
            return same(dict(self.recv(group, 0, options=options, into=Buckets())), want)
        _, rank, tp = how
        return same(self.recv(group, 0, options=options, shards=tp_shards(rank, tp)),
                    sliced(want, rank, tp))

    # -- what cannot go through --------------------------------------------------------------

    def set_limit(self, nbytes):
        rlcomm.set_memory_limits(max_message=nbytes)
        return True

    def attempt(self, fn, *args, **kw):
        """``fn`` here, and how it failed: (error class, message, seconds), or None."""
        start = time.monotonic()
        try:
            getattr(self, fn)(*args, **kw)
        except Exception as exc:  # noqa: BLE001 - what the test looks at
            return type(exc).__name__, str(exc), time.monotonic() - start
        return None


@pytest.fixture(scope="module")
def group(cluster):
    g = Syncer.create_group().launch(
        cluster, NodePlacementStrategy([0] * 5), name=GROUP,
        env_vars={"RLCOMM_SHM_POOL_BYTES": str(POOL)},
    )
    yield g
    g.shutdown()


def _each(group, calls):
    """Run ``calls`` (rank -> (method, args, kwargs)) at once; their results by rank."""
    handles = {r: getattr(group.execute_on(r), m)(*a, **k) for r, (m, a, k) in calls.items()}
    return {r: h.wait(timeout=120)[0] for r, h in handles.items()}


def test_a_pushed_sync_of_cpu_tensors_is_refused_naming_the_tensor_and_what_to_use(group):
    one = group.execute_on(0)
    push = one.attempt("weight_pusher", {"w": torch.zeros(4)}, [("nobody", 0)]).wait(timeout=60)
    take = one.attempt("pushed_weights", [torch.zeros(4)], ("nobody", 0)).wait(timeout=60)
    assert push[0][0] == take[0][0] == "ValueError"
    assert "'w' is on cpu; a pushed weight sync writes CUDA tensors" in push[0][1]
    assert "use broadcast(into=...)" in push[0][1] and "'0' is on cpu" in take[0][1]


def test_a_broadcast_past_the_pool_streams_to_every_receiver_as_it_asks(group):
    got = _each(group, {
        0: ("source", (1,), {}),
        1: ("take", (1, "into"), {}),
        2: ("take", (1, "whole"), {}),
        3: ("take", (1, "iter"), {}),
        4: ("take", (1, ("tp", 1, 2)), {}),
    })
    assert [got[r] for r in (1, 2, 3, 4)] == [True] * 4
    source = got[0]
    total = sum(t.numel() * t.element_size() for t in weights(1).values())
    assert source["buckets_out"] >= total // BUCKET
    # The source's shared memory is two slots of a bucket, not the state dict.
    assert 0 < source["pool_bytes"] <= 2 * (BUCKET + (1 << 20))


def test_tp4_receivers_read_only_their_shards(group):
    """Four receivers take a quarter of every 2-D weight each: what each reads out of
    shared memory is that quarter plus the replicated tensors."""
    receivers = (1, 2, 3, 4)
    before = {r: group.execute_on(r).broadcast_stats().wait()[0]["bytes_in"] for r in receivers}
    got = _each(group, {0: ("source", (2,), {})} | {
        r: ("take", (2, ("tp", r - 1, 4)), {}) for r in receivers})
    assert [got[r] for r in receivers] == [True] * 4
    sd = weights(2)
    split = sum(t.numel() * t.element_size() for t in sd.values() if t.dim() == 2)
    rest = sum(t.numel() * t.element_size() for t in sd.values() if t.dim() != 2)
    for r in receivers:
        moved = group.execute_on(r).broadcast_stats().wait()[0]["bytes_in"] - before[r]
        assert split // 4 <= moved <= split // 4 + rest, (r, moved, split, rest)


def test_the_iterator_hands_out_the_first_bucket_before_the_source_is_done(group):
    """The first tensors are in the receiver's hands while the source still has buckets
    to write (it cannot finish: two slots, and this receiver holds what it took); the
    iterator's producer never holds more than one bucket beyond what was taken."""
    before = group.execute_on(0).start_source(4).wait()[0]
    others = [group.execute_on(r).take(4, "whole", made=layers) for r in (2, 3, 4)]
    name, taken, handed = group.execute_on(1).first_of_iterator().wait()[0]
    assert name == "layers.0.weight" and taken == 1 and handed - taken <= 1
    done, source = group.execute_on(0).source_state().wait()[0]
    total = rlcomm.comm.buckets.bucket_count(
        rlcomm.comm.codec.encode(layers(4))[0].tensors, BUCKET)
    assert total == 8
    assert not done and source["buckets_out"] - before < total, (done, source, before, total)
    ok, most_held = group.execute_on(1).rest_of_iterator(4).wait()[0]
    assert ok and most_held <= 1
    assert group.execute_on(0).finish_source().wait()[0]["buckets_out"] - before == total
    assert all(h.wait(timeout=60)[0] for h in others)


@pytest.mark.parametrize("how", ["into", "whole", "iter", ("tp", 3, 4)])
def test_send_past_the_pool_streams_to_the_receiver_as_it_asks(group, how):
    got = _each(group, {0: ("send_to", (5, 1), {}), 1: ("recv_as", (5, how), {})})
    assert got == {0: True, 1: True}


def test_a_small_payload_streams_when_the_source_asks(group):
    """``bucket_bytes=`` streams even a payload small enough to ride in its frame."""
    kw = {"made": tiny, "bucket_bytes": 1 << 20}
    got = _each(group, {0: ("source", (8,), kw),
                        1: ("take", (8, "iter"), {"made": tiny}),
                        2: ("take", (8, ("tp", 1, 3)), {"made": tiny}),
                        3: ("take", (8, "into"), {"made": tiny}),
                        4: ("take", (8, "whole"), {"made": tiny})})
    assert [got[r] for r in (1, 2, 3, 4)] == [True] * 4
    assert got[0]["buckets_out"] >= 1
    assert _each(group, {0: ("send_to", (9, 1), kw),
                         1: ("recv_as", (9, "into"), {"made": tiny})}) == {0: True, 1: True}


def test_a_receiver_over_its_limit_fails_every_member_at_once(group):
    """A receiver whose RLCOMM_MAX_MESSAGE_BYTES is under the state dict refuses it
    (it takes new tensors); the source learned that limit when the receiver joined, so
    the dict streams and every receiver answers first: nobody gets a bucket, each
    member raises naming the refusal, long before the timeout."""
    members = [(GROUP, [0, 1, 2])]
    assert group.execute_on(2).set_limit(4 << 20).wait() == [True]
    try:
        got = _each(group, {
            0: ("attempt", ("source", 6), {"members": members}),
            1: ("attempt", ("take", 6, "into"), {"members": members, "timeout": 60}),
            2: ("attempt", ("take", 6, "whole"), {"members": members, "timeout": 60}),
        })
        for r in (0, 1, 2):
            kind, text, seconds = got[r]
            assert kind == "CapacityError" and "RLCOMM_MAX_MESSAGE_BYTES" in text, got[r]
            assert f"{GROUP}:2" in text or r == 2, got[r]
            assert seconds < FAST, got[r]
        # The stream never began: the group goes on (into= takes any size).
        got = _each(group, {0: ("source", (7,), {"members": members}),
                            1: ("take", (7, "into"), {"members": members}),
                            2: ("take", (7, "into"), {"members": members})})
        assert got[1] and got[2]
    finally:
        group.execute_on(2).set_limit(32 << 30).wait()


def test_a_streamed_send_over_the_receivers_limit_fails_both_ends_at_once(group):
    assert group.execute_on(1).set_limit(4 << 20).wait() == [True]
    try:
        got = _each(group, {
            0: ("attempt", ("send_to", 8, 1), {"options": CollectiveGroupOptions(timeout=60)}),
            1: ("attempt", ("recv_as", 8, "whole"), {}),
        })
        kind, text, seconds = got[1]
        assert kind == "CapacityError" and "RLCOMM_MAX_MESSAGE_BYTES" in text and seconds < FAST
        kind, text, seconds = got[0]
        assert kind == "PeerLostError" and seconds < FAST, got[0]
    finally:
        group.execute_on(1).set_limit(32 << 30).wait()
    # The connection was closed: the next send makes a new one.
    assert _each(group, {0: ("send_to", (9, 1), {}), 1: ("recv_as", (9, "into"), {})}) == {
        0: True, 1: True}


@pytest.mark.parametrize("pool, what", [
    (2 << 20, "a pool too small to stream through"),
    (None, "a pool larger than the node's memory"),
])
def test_a_pool_that_cannot_carry_it_fails_every_member_at_once(cluster, pool, what):
    from rlcomm.comm.transports.shm_memory import node_memory

    if pool is None:
        pool = 4 * node_memory()[0]
    name = "ws_pool_small" if pool == 2 << 20 else "ws_pool_big"
    g = Syncer.create_group().launch(cluster, NodePlacementStrategy([0] * 2), name=name,
                                     env_vars={"RLCOMM_SHM_POOL_BYTES": str(pool)})
    members = [(name, [0, 1])]
    try:
        handles = [g.execute_on(0).attempt("source", 1, members=members, src=(name, 0)),
                   g.execute_on(1).attempt("take", 1, "into", members=members, timeout=60,
                                           src=(name, 0))]
        got = [h.wait(timeout=120)[0] for h in handles]
        for failure in got:
            assert failure is not None, what
            kind, text, seconds = failure
            assert kind == "CapacityError" and "RLCOMM_SHM_POOL_BYTES" in text, (what, failure)
            assert seconds < FAST, (what, failure)
    finally:
        g.shutdown()


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/unshare"),
                    reason="needs root and unshare for a mount namespace")
def test_a_64_mb_dev_shm_does_not_bound_the_shared_memory():
    """Docker gives a container 64 MB of /dev/shm: rlcomm's shared memory is memfd
    memory, so a 256 MiB stream of buckets goes through all the same (two processes,
    the fan-out, in a mount namespace whose /dev/shm is 64 MB)."""
    script = os.path.join(os.path.dirname(__file__), "devshm_stream.py")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run(
        ["unshare", "-m", "sh", "-c",
         f"mount -t tmpfs -o size=64m tmpfs /dev/shm && {sys.executable} {script}"],
        capture_output=True, text=True, timeout=120, cwd=root,
        env={**os.environ, "PYTHONPATH": root},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "dev_shm=67108864 streamed=268435456 ok" in out.stdout, out.stdout + out.stderr


def test_receivers_killed_or_stopped_mid_stream(group):
    """In the middle of a stream (each victim took its first tensor and holds the rest):
    a receiver of a `send` killed fails its sender at once; a receiver of a broadcast
    killed fails the source for it alone (the other receiver gets every bucket); one
    stopped, holding its buckets, makes the source and the receiver still waiting fail
    by the source's timeout, naming it.

    The dict is ``layers``: each bucket completes tensors, so a victim's iterator holds
    the next bucket and the one after (the producer's hand-over waits for it), and the
    rest cannot go through whenever the victim is killed or stopped. (A bucket that
    completes no tensor, inside one larger than a bucket, is read on without a hand-over:
    with such a dict the victim could take in every bucket before the signal.)

    It ends the module's group (ranks 2 to 4 killed): it is the module's last test."""
    import signal

    name, g = GROUP, group
    pids = {r: actor_pid(g.workers[r]) for r in (2, 3, 4)}
    src = (name, 0)
    try:
        # send: rank 3 is killed.
        sent = g.execute_on(0).attempt("send_to", 1, 3, group=name, made=layers,
                                       options=CollectiveGroupOptions(timeout=60))
        assert g.execute_on(3).first_of_recv_then_hold(name, 60).wait(timeout=60) == [
            "layers.0.weight"]
        os.kill(pids[3], signal.SIGKILL)
        kind, text, seconds = sent.wait(timeout=120)[0]
        assert kind == "PeerLostError" and seconds < FAST, (kind, text, seconds)

        # broadcast: rank 2 is killed, rank 1 gets it all.
        members = [(name, [0, 1, 2])]
        source = g.execute_on(0).attempt("source", 2, members=members, src=src, made=layers)
        other = g.execute_on(1).attempt("take", 2, "into", members=members, src=src,
                                        made=layers)
        assert g.execute_on(2).first_then_hold(members, src, 60).wait(timeout=60) == [
            "layers.0.weight"]
        os.kill(pids[2], signal.SIGKILL)
        kind, text, seconds = source.wait(timeout=120)[0]
        assert kind == "PeerLostError" and f"{name}:2" in text, text
        assert other.wait(timeout=60) == [None]

        # broadcast: rank 4 is stopped; the source's timeout is 2.5 s a bucket.
        members = [(name, [0, 1, 4])]
        source = g.execute_on(0).attempt("source", 3, members=members, src=src, made=layers,
                                         options=CollectiveGroupOptions(timeout=2.5))
        other = g.execute_on(1).attempt("take", 3, "into", members=members, src=src,
                                        made=layers)
        assert g.execute_on(4).first_then_hold(members, src, 60).wait(timeout=60) == [
            "layers.0.weight"]
        os.kill(pids[4], signal.SIGSTOP)
        kind, text, seconds = source.wait(timeout=120)[0]
        assert kind == "CommTimeoutError" and f"{name}:4 still held" in text, text
        kind, text, _ = other.wait(timeout=60)[0]
        assert kind == "CommTimeoutError" and "part-way" in text and f"{name}:4" in text, text
    finally:
        for pid in pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            wait_process_gone(pid)
