"""Worker and WorkerGroup on a real local Ray."""

import asyncio
import os
import threading

import pytest
import torch
import torch.distributed as dist

from rlcomm import (
    NodePlacementStrategy,
    PackedPlacementStrategy,
    RlcommTimeoutError,
    Worker,
    WorkerCallError,
    WorkerGroup,
    WorkerGroupError,
)
from tests.markers import cpu_only_cluster


class AllReduceWorker(Worker):
    def __init__(self):
        super().__init__()

    def initialize(self):
        if not dist.is_initialized():
            dist.init_process_group(backend="gloo")
        t = torch.ones(size=(1, 1), dtype=torch.float32)
        dist.all_reduce(t)
        return t

    def hello(self):
        return self._rank

    def env(self):
        keys = ["MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                "LOCAL_WORLD_SIZE", "NODE_RANK"]
        return {k: os.environ[k] for k in keys}

    def address(self):
        return str(self.worker_address), self.rank, self.world_size

    def fail(self, msg):
        raise ValueError(msg)

    async def async_hello(self, x):
        await asyncio.sleep(0.01)
        return self._rank * x


class Caller(Worker):
    def call_other(self, group_name):
        other = WorkerGroup.from_group_name(AllReduceWorker, group_name)
        return other.execute_on(1).hello().wait()


@cpu_only_cluster
def test_seed_example_on_cpu(cluster):
    group = AllReduceWorker.create_group().launch(
        cluster, PackedPlacementStrategy(0, 3), name="seed_example"
    )
    try:
        results = group.initialize().wait()
        assert [r.item() for r in results] == [4.0] * 4
        assert group.execute_on(0, 3).hello().wait() == [0, 3]
        assert group.hello().wait() == [0, 1, 2, 3]
        envs = group.env().wait()
        assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
        assert {e["MASTER_PORT"] for e in envs} == {envs[0]["MASTER_PORT"]}
        assert all(e["WORLD_SIZE"] == "4" and e["LOCAL_WORLD_SIZE"] == "4" for e in envs)
        assert group.address().wait()[2] == ("seed_example:2", 2, 4)
        assert asyncio.run(group.async_hello(10).async_wait()) == [0, 10, 20, 30]
    finally:
        group.shutdown()


def test_two_groups_and_from_group_name_inside_worker(cluster):
    first = AllReduceWorker.create_group().launch(cluster, NodePlacementStrategy([0, 0]), name="first")
    second = Caller.create_group().launch(cluster, name="second")
    try:
        assert second.call_other("first").wait() == [[1]]
        again = WorkerGroup.from_group_name(AllReduceWorker, "first")
        assert again.hello().wait() == [0, 1]
    finally:
        first.shutdown()
        second.shutdown()


def test_remote_exception_names_group_rank_method(cluster):
    group = AllReduceWorker.create_group().launch(cluster, NodePlacementStrategy([0, 0]), name="errs")
    try:
        with pytest.raises(WorkerCallError) as info:
            group.execute_on(1).fail("boom-42").wait()
        err = info.value
        assert (err.group_name, err.rank, err.method) == ("errs", 1, "fail")
        assert "errs[rank 1].fail()" in str(err) and "boom-42" in str(err)
        assert "ValueError" in err.remote_traceback
    finally:
        group.shutdown()


def test_execute_on_is_per_caller_and_thread_safe(cluster):
    group = AllReduceWorker.create_group().launch(cluster, NodePlacementStrategy([0] * 3), name="ts")
    try:
        out = {}

        def run(key, ranks):
            for _ in range(5):
                out.setdefault(key, []).append(group.execute_on(*ranks).hello().wait())

        threads = [threading.Thread(target=run, args=(k, r)) for k, r in (("a", [0]), ("b", [2, 1]))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert out["a"] == [[0]] * 5 and out["b"] == [[2, 1]] * 5
        with pytest.raises(ValueError, match="not in group"):
            group.execute_on(7)
    finally:
        group.shutdown()


def test_names_unique_shutdown_and_clash(cluster):
    group = AllReduceWorker.create_group().launch(cluster, name="unique")
    with pytest.raises(WorkerGroupError, match="exists already"):
        AllReduceWorker.create_group().launch(cluster, name="unique")
    group.shutdown()
    with pytest.raises(WorkerGroupError, match="shut down"):
        group.hello()
    # The name is free again after shutdown.
    AllReduceWorker.create_group().launch(cluster, name="unique").shutdown()

    class Clashing(Worker):
        def shutdown(self):
            return 1

    with pytest.raises(WorkerGroupError, match="clash"):
        Clashing.create_group().launch(cluster, name="clash")
    with pytest.raises(WorkerGroupError, match="no running worker group"):
        WorkerGroup.from_group_name(AllReduceWorker, "never_launched")


class Sleeper(Worker):
    def nap(self, seconds):
        import time

        time.sleep(seconds)
        return seconds


def test_wait_timeout_and_done(cluster):
    group = Sleeper.create_group().launch(cluster, name="sleepy")
    try:
        handle = group.nap(1)
        assert not handle.done()
        with pytest.raises(RlcommTimeoutError):
            handle.wait(timeout=0.2)
        assert handle.wait(timeout=30) == [1]
        assert handle.done()
    finally:
        group.shutdown()


def test_many_workers_on_two_cores(cluster):
    group = AllReduceWorker.create_group().launch(
        cluster, NodePlacementStrategy([0] * 8), name="eight"
    )
    try:
        assert group.hello().wait() == list(range(8))
    finally:
        group.shutdown()


class Quitter(Worker):
    def quit(self, code):
        import sys

        sys.exit(code)

    def pid(self):
        return os.getpid()


def test_sys_exit_is_logged_with_the_worker_address(caplog):
    from rlcomm.worker.actor import make_actor_class

    cls = make_actor_class(Quitter, catch_system_failure=True)
    worker = cls.__new__(cls)
    worker._bind_identity(__import__("rlcomm").WorkerAddress("quitters", (2,)), 4)
    with caplog.at_level("ERROR", logger="rlcomm.worker.actor"), pytest.raises(SystemExit):
        worker.quit(3)
    assert "worker quitters:2 called sys.exit(3) in quit()" in caplog.text


def test_a_worker_that_exits_fails_the_call_with_its_address(cluster):
    group = Quitter.create_group().launch(cluster, NodePlacementStrategy([0, 0]), name="quitters")
    try:
        with pytest.raises(WorkerCallError, match=r"quitters\[rank 1\]\.quit\(\)"):
            group.execute_on(1).quit(3).wait(timeout=60)
        assert len(group.execute_on(0).pid().wait(timeout=30)) == 1
    finally:
        group.shutdown()


UNTRACED = ("send", "recv", "send_tensor", "recv_tensor", "broadcast")


class SelfCaller(Worker):
    """Rank 0 sends to rank 1 through a call a subclass does not override (``send``),
    rank 1 receives through one it does (``recv``)."""

    def recv(self, *args, **kwargs):
        self.overridden_recvs = getattr(self, "overridden_recvs", 0) + 1
        return super().recv(*args, **kwargs)

    def bound(self):
        return {name: getattr(getattr(self, name).__func__, "__ray_tracing_wrapped__", False)
                for name in UNTRACED}

    def traced_on_class(self):
        return getattr(type(self).send, "__ray_tracing_wrapped__", False)

    def pass_on(self):
        if self._rank == 0:
            self.send(b"abcd", self.worker_group_name, 1)
            return None
        return self.recv(self.worker_group_name, 0), self.overridden_recvs


@cpu_only_cluster
def test_a_worker_calls_its_own_comm_methods_without_rays_tracing_wrappers(cluster):
    """Ray wraps every method of an actor class for tracing (two wrappers a call); the
    calls a worker makes of itself per message are bound on it without them, its
    subclass's overrides kept, while the class Ray runs remote calls from keeps them."""
    group = SelfCaller.create_group().launch(cluster, NodePlacementStrategy([0, 0]),
                                             name="untraced")
    try:
        assert group.traced_on_class().wait() == [True, True]  # what Ray calls is unchanged
        assert group.bound().wait() == [dict.fromkeys(UNTRACED, False)] * 2
        assert group.pass_on().wait() == [None, (b"abcd", 1)]
    finally:
        group.shutdown()
