"""The README's quickstart: two actors stream rollouts through a channel to a learner,
which sends weights back point-to-point. Run: ``python examples/quickstart.py``."""

import torch

from rlcomm import Channel, Cluster, NodePlacementStrategy, Worker


class Actor(Worker):
    def play(self, steps):
        out = self.connect_channel("rollouts")
        for i in range(steps):
            out.put({"obs": torch.randn(8, 4), "reward": torch.full((8,), float(i))}, weight=1)
        return self.recv("learner", 0)  # the learner's weights


class Learner(Worker):
    def learn(self, steps, actors):
        batch = self.connect_channel("rollouts").get_batch(target_weight=steps * actors)
        weights = {"w": torch.stack([b["reward"].mean() for b in batch])}
        for rank in range(actors):
            self.send(weights, "actors", rank)  # tensors travel raw, never pickled
        return len(batch)


cluster = Cluster(num_nodes=1)
Channel.create("rollouts", maxsize=16)
actors = Actor.create_group().launch(cluster, NodePlacementStrategy([0, 0]), name="actors")
learner = Learner.create_group().launch(cluster, name="learner")
played, learned = actors.play(4), learner.learn(4, 2)
print(learned.wait(), [w["w"].shape for w in played.wait()])  # [8] [torch.Size([8])] * 2
