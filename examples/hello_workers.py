"""The simplest tour of rlcomm: launch two worker groups, run methods on all or some
ranks, let the workers use plain torch.distributed, send objects and tensors between
workers of different groups, and reconnect to a group by name.

Run it with ``scripts/demo`` (sets up .venv first) or ``python examples/hello_workers.py``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from rlcomm import Cluster, NodePlacementStrategy, Worker, WorkerGroup


class Greeter(Worker):
    """Each rank all-reduces a ones tensor with plain torch.distributed (Gloo)."""

    def __init__(self, greeting: str):
        super().__init__()
        self.greeting = greeting

    def all_reduce_ones(self) -> float:
        if not dist.is_initialized():
            dist.init_process_group("gloo")  # MASTER_ADDR/PORT, RANK, WORLD_SIZE are set
        t = torch.ones(1)
        dist.all_reduce(t)
        return t.item()

    def hello(self) -> str:
        return f"{self.greeting} from {self.worker_address}"

    def reply_to(self, group: str) -> str:
        """Receive a message and a tensor from a visitor, answer with the tensor doubled."""
        note = self.recv(group, 0)
        tensor = self.recv(group, 0)
        self.send(tensor * 2, group, 0)
        return note


class Visitor(Worker):
    """Finds the Greeter group by name from inside a worker and calls it."""

    def visit(self, group_name: str) -> list[str]:
        greeters = WorkerGroup.from_group_name(Greeter, group_name)
        return greeters.execute_on(0).hello().wait()

    def talk(self, group_name: str, rank: int) -> list[float]:
        """Point-to-point: an object, then a tensor, then the peer's reply."""
        self.send(f"hi from {self.worker_address}", group_name, rank)
        self.send(torch.arange(4.0), group_name, rank)
        return self.recv(group_name, rank).tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()

    start = time.monotonic()
    cluster = Cluster(num_nodes=1)
    print(f"cluster: {cluster.num_nodes} node(s), {cluster.nodes[0].num_cpus} CPUs, "
          f"{cluster.num_gpus} GPUs")
    greeters = Greeter.create_group("hello").launch(
        cluster, NodePlacementStrategy([0] * args.workers), name="greeters"
    )
    visitors = Visitor.create_group().launch(cluster, name="visitors")
    print(f"launched {greeters.world_size} greeters and 1 visitor in "
          f"{time.monotonic() - start:.1f}s")

    sums = greeters.all_reduce_ones().wait()
    print(f"all_reduce of ones on every rank -> {sums}")
    print(f"execute_on(0, {args.workers - 1}).hello() -> "
          f"{greeters.execute_on(0, args.workers - 1).hello().wait()}")
    print(f"hello() on all ranks -> {greeters.hello().wait()}")
    print(f"a visitor worker reached the greeters by name -> {visitors.visit('greeters').wait()}")
    last = args.workers - 1
    answer = greeters.execute_on(last).reply_to("visitors")
    doubled = visitors.talk("greeters", last).wait()[0]
    print(f"visitors:0 sent a note and arange(4) to greeters:{last}: it got "
          f"{answer.wait()[0]!r} and replied {doubled}")

    visitors.shutdown()
    greeters.shutdown()
    print(f"done in {time.monotonic() - start:.1f}s")


if __name__ == "__main__":
    main()
