"""Which methods a WorkerGroup offers: the public methods a Worker subclass adds, and
``gpu_info`` from Worker itself (the docs call ``group.gpu_info().wait()``)."""

import pytest
import torch

from rlcomm import NodePlacementStrategy, Worker, WorkerGroup
from rlcomm.worker.actor import WORKER_GROUP_METHODS, group_methods

GPU_INFO_KEYS = {"device", "gpu", "visible", "mps"}


class Plain(Worker):
    def hello(self):
        return self.rank

    async def ahello(self):
        return self.rank

    @staticmethod
    def configure_worker(num_gpus, bundle_indices=None):
        return None, None, None

    def _private(self):
        return None


class OwnGpuInfo(Worker):
    def gpu_info(self):
        return {**super().gpu_info(), "own": self.rank}


def test_group_methods_are_the_added_ones_and_gpu_info():
    assert WORKER_GROUP_METHODS == ("gpu_info",)
    assert group_methods(Worker) == ["gpu_info"]
    assert group_methods(Plain) == ["ahello", "gpu_info", "hello"]
    assert group_methods(OwnGpuInfo) == ["gpu_info"]


def check_gpu_info(info):
    assert GPU_INFO_KEYS <= set(info)
    assert isinstance(info["mps"], bool)
    assert isinstance(info["visible"], list)
    if not torch.cuda.is_available():
        # No CUDA: no device, no GPU, nothing visible.
        assert (info["device"], info["gpu"], info["visible"]) == (None, None, [])
    else:
        assert info["device"] is None or isinstance(info["device"], int)


def test_gpu_info_on_a_group_and_on_some_ranks(cluster):
    group = Plain.create_group().launch(cluster, NodePlacementStrategy([0, 0]), name="gpuinfo")
    try:
        infos = group.gpu_info().wait(timeout=60)
        assert len(infos) == 2
        for info in infos:
            check_gpu_info(info)
        some = group.execute_on(1).gpu_info()
        assert hasattr(some, "wait") and hasattr(some, "done")  # a handle, as other calls
        [only] = some.wait(timeout=60)
        check_gpu_info(only)
        assert group.hello().wait(timeout=60) == [0, 1]
        assert group.ahello().wait(timeout=60) == [0, 1]
        # A handle found by name offers the same methods.
        again = WorkerGroup.from_group_name(Plain, "gpuinfo")
        assert len(again.gpu_info().wait(timeout=60)) == 2
        # Worker's peer-naming methods and the launch hook are not group methods.
        for name in ("send", "recv", "broadcast", "create_channel", "configure_worker", "_private"):
            assert not hasattr(group, name), name
            with pytest.raises(AttributeError, match="no group method"):
                getattr(group.execute_on(0), name)
    finally:
        group.shutdown()


def test_an_override_of_gpu_info_is_what_the_group_runs(cluster):
    group = OwnGpuInfo.create_group().launch(cluster, NodePlacementStrategy([0]), name="owngpuinfo")
    try:
        infos = group.gpu_info().wait(timeout=60)
        assert [i["own"] for i in infos] == [0]
        for info in infos:
            check_gpu_info(info)
    finally:
        group.shutdown()
