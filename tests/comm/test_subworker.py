"""Rank paths: a sub-worker forked by a worker is addressed as (group, [rank, child])."""

from __future__ import annotations

import multiprocessing as mp

import torch

from rlcomm import NodePlacementStrategy, Worker
from rlcomm.comm.identity.address import WorkerAddress


class Child(Worker):
    """A sub-worker: not a Ray actor, it joins Ray to find its peers."""


def _child_main(parent: WorkerAddress, address: str, conn) -> None:
    import ray

    ray.init(address=address, namespace="rlcomm", logging_level="ERROR")
    child = Child(parent_address=parent, world_size=1, rank=0)
    conn.send(str(child.worker_address))
    msg = child.recv("sub_parent", 0)
    child.send(msg * 3, "sub_parent", 0)
    conn.recv()  # stay alive until the parent is done


class Parent(Worker):
    def spawn_and_talk(self, ray_address: str) -> tuple[str, list[float]]:
        ctx = mp.get_context("spawn")
        here, there = ctx.Pipe()
        proc = ctx.Process(target=_child_main, args=(self.worker_address, ray_address, there))
        proc.start()
        try:
            child_address = here.recv()
            self.send(torch.ones(2), "sub_parent", [0, 0])
            reply = self.recv("sub_parent", [0, 0])
            return child_address, reply.tolist()
        finally:
            here.send("bye")
            proc.join(timeout=30)


def test_send_to_a_sub_worker_by_rank_path(cluster):
    import ray

    group = Parent.create_group().launch(cluster, NodePlacementStrategy([0]), name="sub_parent")
    try:
        address = ray.get_runtime_context().gcs_address
        child, reply = group.spawn_and_talk(address).wait(timeout=90)[0]
        assert child == "sub_parent:0.0"
        assert reply == [3.0, 3.0]
    finally:
        group.shutdown()
