"""CUDA paths (NCCL between GPUs). Skipped without at least two CUDA devices."""

from __future__ import annotations

import pytest
import torch

from rlcomm import PackedPlacementStrategy, Worker

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs two CUDA devices",
)


class GpuPeer(Worker):
    def exchange(self):
        torch.cuda.set_device(0)  # CUDA_VISIBLE_DEVICES shows this worker's GPU only
        peer = 1 - self._rank
        if self._rank == 0:
            self.send(torch.arange(1 << 20, device="cuda", dtype=torch.float32), "gpu_p2p", peer)
            self.send([torch.ones(3, device="cuda"), torch.zeros(2, device="cuda")], "gpu_p2p", peer)
            self.send({"w": torch.full((4,), 2.0, device="cuda")}, "gpu_p2p", peer)
            self.send_tensor(torch.full((5,), 7.0, device="cuda"), "gpu_p2p", peer)
            return True
        big = self.recv("gpu_p2p", peer)
        lst = self.recv("gpu_p2p", peer)
        dct = self.recv("gpu_p2p", peer)
        buf = torch.empty(5, device="cuda")
        self.recv_tensor(buf, "gpu_p2p", peer)
        return (
            big.is_cuda and torch.equal(big.cpu(), torch.arange(1 << 20, dtype=torch.float32)),
            [t.device.type for t in lst],
            dct["w"].sum().item(),
            buf.cpu().tolist(),
        )

    def broadcast_cuda(self):
        torch.cuda.set_device(0)
        obj = {"w": torch.arange(10.0, device="cuda")} if self._rank == 0 else None
        got = self.broadcast(obj, groups=[("gpu_p2p", [0, 1])], src=("gpu_p2p", 0))
        return got["w"].device.type, got["w"].sum().item()

    def mixed_devices(self):
        from rlcomm import CodecError

        try:
            self.send([torch.ones(1), torch.ones(1, device="cuda")], "gpu_p2p", 1 - self._rank)
        except CodecError as exc:
            return str(exc)
        return ""


def test_cuda_send_recv_over_nccl(cluster):
    group = GpuPeer.create_group().launch(cluster, PackedPlacementStrategy(0, 1), name="gpu_p2p")
    try:
        results = group.exchange().wait(timeout=120)
        ok, devices, total, in_place = results[1]
        assert ok and devices == ["cuda", "cuda"] and total == 8.0 and in_place == [7.0] * 5
        assert group.broadcast_cuda().wait(timeout=120) == [("cuda", 45.0)] * 2
        assert "cuda" in group.execute_on(0).mixed_devices().wait(timeout=60)[0]
    finally:
        group.shutdown()
