"""RLinf (``rlinf.scheduler``) behaviours, checked on rlcomm with only the imports changed.

Each case names the RLinf behaviour it checks and the upstream test that asserts it
(RLinf ``tests/unit_tests/``). Written anew from what those tests assert.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
import torch

from rlcomm import (
    Channel,
    ChannelEmpty,
    ChannelFull,
    CollectiveGroupOptions,
    NodePlacementStrategy,
    Worker,
    WorkerAddress,
)


class Producer(Worker):
    def my_address(self) -> WorkerAddress:
        # RLinf test_comm.py compares its own address this way to find the source.
        assert self._worker_address == WorkerAddress(self.worker_group_name, ranks=self.rank)
        return self.worker_address

    def put_nowait(self, channel: Channel, item, key: str = "nowait") -> bool:
        channel.put_nowait(item, key=key)
        return True

    def send_to(self, group: str, rank: int, obj, max_ctas: int) -> bool:
        self.send(obj, group, rank, options=CollectiveGroupOptions(accel_max_ctas=max_ctas))
        return True


class Consumer(Worker):
    def get_nowait_or_none(self, channel: Channel, key: str = "nowait"):
        try:
            return channel.get_nowait(key=key)
        except asyncio.QueueEmpty:  # what RLinf code catches
            return None

    def recv_from(self, group: str, rank: int, min_ctas: int):
        options = CollectiveGroupOptions(accel_min_ctas=min_ctas, is_high_priority_stream=True)
        return self.recv(group, rank, options=options)


@pytest.fixture(scope="module")
def groups(cluster):
    suffix = uuid.uuid4().hex[:6]
    producer = Producer.create_group().launch(
        cluster, NodePlacementStrategy([0]), name=f"rlinf_producer_{suffix}"
    )
    consumer = Consumer.create_group().launch(
        cluster, NodePlacementStrategy([0]), name=f"rlinf_consumer_{suffix}"
    )
    yield producer, consumer
    producer.shutdown()
    consumer.shutdown()


def _channel(**kwargs) -> Channel:
    return Channel.create(f"rlinf_compat_{uuid.uuid4().hex[:8]}", **kwargs)


# -- channels: nowait errors (test_channel.py::test_channel_nowait) ------------------------


def test_get_nowait_on_empty_key_raises_asyncio_queue_empty_in_a_worker(groups):
    """RLinf test_channel.py::test_channel_nowait: a consumer's ``get_nowait`` on an empty
    key raises ``asyncio.QueueEmpty`` (caught, giving None); after a producer's
    ``put_nowait`` it returns the item."""
    producer, consumer = groups
    channel = _channel()
    try:
        assert consumer.get_nowait_or_none(channel).wait(timeout=60) == [None]
        producer.put_nowait(channel, "item_100").wait(timeout=60)
        assert consumer.get_nowait_or_none(channel).wait(timeout=60) == ["item_100"]
    finally:
        channel.shutdown()


def test_nowait_errors_are_asyncio_queue_errors():
    """RLinf Channel.put_nowait / get_nowait docstrings: ``asyncio.QueueFull`` on a full
    key, ``asyncio.QueueEmpty`` on an empty one; rlcomm's classes are subclasses."""
    assert issubclass(ChannelEmpty, asyncio.QueueEmpty)
    assert issubclass(ChannelFull, asyncio.QueueFull)
    channel = _channel(maxsize=1)
    try:
        with pytest.raises(asyncio.QueueEmpty):
            channel.get_nowait()
        channel.put_nowait("a")
        with pytest.raises(asyncio.QueueFull):
            channel.put_nowait("b")
        with pytest.raises(ChannelFull):  # rlcomm's own class still works
            channel.put_nowait("b")
        assert channel.get_nowait() == "a"
    finally:
        channel.shutdown()


def test_local_channel_nowait_errors_are_asyncio_queue_errors():
    """The same for RLinf's ``local=True`` channels (LocalChannel)."""
    channel = _channel(maxsize=1, local=True)
    try:
        with pytest.raises(asyncio.QueueEmpty):
            channel.get_nowait()
        channel.put_nowait(1)
        with pytest.raises(asyncio.QueueFull):
            channel.put_nowait(2)
    finally:
        channel.shutdown()


# -- channels: str(channel) (test_channel.py::test_peek_all) -------------------------------


@pytest.mark.parametrize("kind", ["regular", "distributed", "local"])
def test_str_of_channel_shows_queued_items(ray_local, kind):
    """RLinf test_channel.py::test_peek_all: after three puts, ``str(channel)`` contains
    every queued item; items stay queued (peek, not get)."""
    kwargs = {"distributed": kind == "distributed", "local": kind == "local"}
    channel = _channel(**kwargs)
    try:
        items = ["item1", "item2", "item3"]
        for item in items:
            channel.put(item)
        text = str(channel)
        assert all(item in text for item in items)
        assert channel.peek_all() == items
        assert channel.qsize() == 3
        assert channel.peek_all(key="never_used") == []
        assert [channel.get(timeout=30) for _ in items] == items
        assert str(channel) == "[]"
    finally:
        channel.shutdown()


def test_peek_all_of_tensor_items(ray_local):
    """``peek_all`` returns tensor items intact (RLinf's ChannelWorker.peek_all returns
    the queued objects)."""
    channel = _channel()
    try:
        channel.put({"x": torch.arange(4)}, key="k")
        [item] = channel.peek_all("k")
        assert torch.equal(item["x"], torch.arange(4))
        assert channel.qsize("k") == 1
    finally:
        channel.shutdown()


# -- WorkerAddress (rlinf.scheduler.manager.worker_manager.WorkerAddress) -------------------


def test_worker_address_rlinf_form():
    """RLinf test_worker.py::TestWorkerAddress::test_worker_address_naming, and
    WorkerAddress: ``WorkerAddress(root_group_name, ranks)`` with an int or a
    list; ``get_name()`` joins the ranks with ``:``; ``rank`` is the last rank."""
    addr = WorkerAddress("MyWorkerGroup", 5)
    assert addr.root_group_name == "MyWorkerGroup"
    assert addr.rank == 5 and list(addr.rank_path) == [5]
    assert addr.get_name() == "MyWorkerGroup:5"
    nested = WorkerAddress(root_group_name="G", ranks=[1, 3])
    assert nested.rank == 3 and nested.get_name() == "G:1:3"
    assert nested.get_parent_rank() == 1
    assert WorkerAddress("G", 2).get_parent_rank() == 0
    assert WorkerAddress("G", ranks=0) == WorkerAddress("G", (0,))  # test_comm.py's form


def test_worker_address_parent_and_child():
    """RLinf WorkerAddress.get_parent_address / get_child_address / from_name /
    from_parent_name_rank, with equality and hashing by (name, path)."""
    addr = WorkerAddress("G", [0])
    child = addr.get_child_address(2)
    assert child == WorkerAddress("G", [0, 2])
    assert child.get_parent_address() == addr
    assert addr.get_parent_address() == WorkerAddress("G", [])
    assert WorkerAddress("G", []).get_parent_address() is None
    assert WorkerAddress("G", []).rank == 0
    assert WorkerAddress.from_name("G:0:2") == child
    assert WorkerAddress.from_parent_name_rank("G:0", 2) == child
    assert len({child, WorkerAddress("G", (0, 2))}) == 1
    assert WorkerAddress("A", 1) < WorkerAddress("B", 0)
    assert str(child) == "G:0.2"  # rlcomm's own text form is unchanged


def test_worker_address_bad_input():
    with pytest.raises(ValueError, match="group name"):
        WorkerAddress("", 0)
    with pytest.raises(ValueError, match="ranks"):
        WorkerAddress("G", [-1])
    with pytest.raises(ValueError, match="from_name"):
        WorkerAddress.from_name("G:x")


def test_worker_address_of_a_launched_worker(groups):
    """A launched worker's ``worker_address`` is an RLinf address too."""
    producer, _ = groups
    [addr] = producer.my_address().wait(timeout=60)
    assert addr.get_name() == f"{producer.worker_group_name}:0"
    assert addr.rank == 0 and addr.root_group_name == producer.worker_group_name


# -- CollectiveGroupOptions (rlinf.scheduler.collective.collective_group) ------------------


def test_collective_group_options_accepts_rlinf_fields():
    """RLinf CollectiveGroupOptions: ``accel_cluster_size``, ``accel_max_ctas``,
    ``accel_min_ctas``, ``is_high_priority_stream``, ``use_ring_broadcast`` and
    ``is_empty_options()``."""
    assert CollectiveGroupOptions().is_empty_options()
    opts = CollectiveGroupOptions(
        accel_cluster_size=2,
        accel_max_ctas=8,
        accel_min_ctas=1,
        is_high_priority_stream=True,
        use_ring_broadcast=True,
    )
    assert not opts.is_empty_options()
    assert opts.accel_max_ctas == 8
    # Ignored fields do not define the group (no mismatch between ends over them).
    assert opts.group_fields() == CollectiveGroupOptions().group_fields()


@pytest.mark.parametrize(
    "kwargs, problem",
    [
        ({"accel_max_ctas": 0}, "accel_max_ctas"),
        ({"accel_min_ctas": "2"}, "accel_min_ctas"),
        ({"accel_min_ctas": 4, "accel_max_ctas": 2}, "above"),
        ({"is_high_priority_stream": "yes"}, "is_high_priority_stream"),
    ],
)
def test_collective_group_options_rejects_bad_rlinf_values(kwargs, problem):
    with pytest.raises(ValueError, match=problem):
        CollectiveGroupOptions(**kwargs)


def test_send_recv_with_rlinf_options_on_cpu(groups):
    """RLinf test_comm.py passes CollectiveGroupOptions to send/recv; on a CPU pair the
    NCCL knobs are ignored, and ends that set different ones still connect."""
    producer, consumer = groups
    received = consumer.recv_from(producer.worker_group_name, 0, 2)
    producer.send_to(consumer.worker_group_name, 0, torch.ones(3), 16).wait(timeout=60)
    [tensor] = received.wait(timeout=60)
    assert torch.equal(tensor, torch.ones(3))
