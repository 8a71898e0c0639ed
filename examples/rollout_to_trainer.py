"""Rollouts streamed to a data-parallel trainer: CartPole solved with rlcomm.

What it shows:
- a rollout WorkerGroup (default 4 CPU workers) plays CartPole-v1 with a small torch
  policy and ``put``s each finished batch of episodes, a dataclass of tensors, into a
  typed Channel (tensors travel raw over rlcomm's transport, never pickled by Ray);
- a trainer WorkerGroup (default 2 ranks) ``get_batch``es from the channel and runs
  REINFORCE with a learned baseline, data-parallel: the ranks all-reduce gradients with
  plain torch.distributed (Gloo), set up from the environment rlcomm gives each worker;
- after each update trainer rank 0 ``broadcast``s the weights (a dict of tensors) to all
  rollout workers, which pick them up between episodes (async, no stop-the-world) and
  tag their next batches with the policy version, so the trainer reports staleness.

Run it with ``scripts/demo`` or ``python examples/rollout_to_trainer.py [--quick]``.
Writes ``learning_curve.png`` (mean return vs update). A full run solves CartPole (mean
return >= 195 over 5 updates) in a few dozen updates; ``--quick`` runs 5 updates with 2
rollout workers to show that everything works end to end, and never solves it.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from rlcomm import Channel, ChannelClosedError, Cluster, NodePlacementStrategy, Worker

SOLVED = 195.0
TRAINER, ROLLOUT = "trainer", "rollout"


@dataclass
class EpisodeBatch:
    """Finished episodes of one rollout worker, flattened over time steps."""

    obs: torch.Tensor  # (T, 4) float32
    actions: torch.Tensor  # (T,) int64
    rewards: torch.Tensor  # (T,) float32
    returns: torch.Tensor  # (T,) discounted reward-to-go
    log_probs: torch.Tensor  # (T,) log-prob of the action under the acting policy
    episode_returns: torch.Tensor  # (E,) undiscounted return of each episode
    policy_version: int
    worker: int


class Policy(nn.Module):
    def __init__(self, hidden: int = 64):
        super().__init__()
        self.pi = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 2))
        self.v = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def dist(self, obs: torch.Tensor) -> torch.distributions.Categorical:
        return torch.distributions.Categorical(logits=self.pi(obs))


def _weights_groups(num_rollout: int) -> list:
    return [(TRAINER, 0), (ROLLOUT, list(range(num_rollout)))]


class RolloutWorker(Worker):
    def __init__(self, channel_name: str, episodes_per_batch: int, gamma: float, seed: int):
        super().__init__()
        import gymnasium as gym

        torch.set_num_threads(1)
        torch.manual_seed(seed)
        self.env = gym.make("CartPole-v1")
        self.seed = seed * 1000 + self._rank
        self.policy = Policy()
        self.version = 0
        self.channel = self.connect_channel(channel_name)
        self.episodes_per_batch = episodes_per_batch
        self.gamma = gamma

    def _episode(self, episode: int) -> dict[str, torch.Tensor]:
        obs, _ = self.env.reset(seed=self.seed + 7919 * episode)
        rows, acts, rews, logps = [], [], [], []
        done = False
        with torch.no_grad():
            while not done:
                o = torch.as_tensor(obs, dtype=torch.float32)
                d = self.policy.dist(o)
                a = d.sample()
                obs, r, terminated, truncated, _ = self.env.step(int(a))
                rows.append(o)
                acts.append(a)
                rews.append(float(r))
                logps.append(d.log_prob(a))
                done = terminated or truncated
        ret, running = [0.0] * len(rews), 0.0
        for t in reversed(range(len(rews))):
            running = rews[t] + self.gamma * running
            ret[t] = running
        return {
            "obs": torch.stack(rows), "actions": torch.stack(acts),
            "rewards": torch.tensor(rews), "returns": torch.tensor(ret),
            "log_probs": torch.stack(logps), "total": torch.tensor([sum(rews)]),
        }

    def run(self, num_rollout: int) -> dict[str, float]:
        """Play and stream batches until the channel closes; apply weights as they come."""
        groups = _weights_groups(num_rollout)
        pending = self.broadcast(None, groups=groups, src=(TRAINER, 0), async_op=True)
        episode, steps, batches = 0, 0, 0
        try:
            while True:
                eps = []
                for _ in range(self.episodes_per_batch):
                    if pending.done():  # new weights: take them between episodes
                        state = pending.wait()
                        self.version = int(state.pop("__version__"))
                        self.policy.load_state_dict(state)
                        pending = self.broadcast(None, groups=groups, src=(TRAINER, 0),
                                                 async_op=True)
                    eps.append(self._episode(episode))
                    episode += 1
                batch = EpisodeBatch(
                    obs=torch.cat([e["obs"] for e in eps]),
                    actions=torch.cat([e["actions"] for e in eps]),
                    rewards=torch.cat([e["rewards"] for e in eps]),
                    returns=torch.cat([e["returns"] for e in eps]),
                    log_probs=torch.cat([e["log_probs"] for e in eps]),
                    episode_returns=torch.cat([e["total"] for e in eps]),
                    policy_version=self.version,
                    worker=self._rank,
                )
                steps += batch.obs.shape[0]
                self.channel.put(batch, weight=len(eps))
                batches += 1
        except ChannelClosedError:
            pass
        return {"episodes": episode, "steps": steps, "batches": batches}


class Trainer(Worker):
    def __init__(self, channel_name: str, metrics_name: str, lr: float, seed: int):
        super().__init__()
        torch.set_num_threads(1)
        if not dist.is_initialized():
            dist.init_process_group("gloo")  # MASTER_ADDR/PORT, RANK, WORLD_SIZE from rlcomm
        torch.manual_seed(seed)  # same initial weights on every rank
        self.policy = Policy()
        self.opt = torch.optim.Adam(self.policy.parameters(), lr=lr)
        self.channel = self.connect_channel(channel_name)
        self.metrics = self.connect_channel(metrics_name)
        self.version = 0

    def _weights(self) -> dict[str, torch.Tensor]:
        """The live parameters (no copy): the broadcast reads them while the next
        gradients are computed, and the optimizer waits for it before changing them."""
        return dict(self.policy.state_dict(), __version__=torch.tensor(self.version))

    def train(self, iterations: int, episodes_per_rank: int, num_rollout: int,
              solved_window: int) -> dict[str, float]:
        groups = _weights_groups(num_rollout)
        sent = None
        history: list[float] = []
        params = list(self.policy.parameters())
        weight_bytes = sum(p.numel() * p.element_size() for p in params)
        for it in range(1, iterations + 1):
            batches: list[EpisodeBatch] = self.channel.get_batch(episodes_per_rank)
            obs = torch.cat([b.obs for b in batches])
            acts = torch.cat([b.actions for b in batches])
            rets = torch.cat([b.returns for b in batches])
            value = self.policy.v(obs).squeeze(-1)
            adv = rets - value.detach()
            adv = (adv - adv.mean()) / (adv.std() + 1e-8)
            loss = -(self.policy.dist(obs).log_prob(acts) * adv).mean()
            loss = loss + 0.5 * ((value - rets) ** 2).mean() / max(1.0, float(rets.var()))
            self.opt.zero_grad()
            loss.backward()
            for p in params:  # data-parallel: average gradients across trainer ranks
                dist.all_reduce(p.grad)
                p.grad /= self._world_size
            if sent is not None:
                sent.wait()  # the last broadcast has read the parameters: they may change
            self.opt.step()
            self.version += 1
            # Statistics, summed over the ranks.
            ep_returns = torch.cat([b.episode_returns for b in batches])
            stale = torch.tensor([float(self.version - 1 - b.policy_version) for b in batches])
            nbytes = sum(
                t.numel() * t.element_size()
                for b in batches
                for t in (b.obs, b.actions, b.rewards, b.returns, b.log_probs, b.episode_returns)
            )
            stats = torch.tensor([ep_returns.sum(), len(ep_returns), obs.shape[0], nbytes,
                                  stale.sum(), len(stale), stale.max()], dtype=torch.float64)
            maxed = stats[6].clone()
            dist.all_reduce(stats)
            dist.all_reduce(maxed, op=dist.ReduceOp.MAX)
            mean_return = float(stats[0] / stats[1])
            history.append(mean_return)
            recent = sum(history[-solved_window:]) / len(history[-solved_window:])
            solved = len(history) >= solved_window and recent >= SOLVED
            if self._rank == 0:
                sent = self.broadcast(self._weights(), groups=groups, src=(TRAINER, 0),
                                      async_op=True)
                self.metrics.put({
                    "iteration": it, "mean_return": mean_return, "recent": recent,
                    "episodes": int(stats[1]), "steps": int(stats[2]),
                    "channel_bytes": int(stats[3]),
                    "broadcast_bytes": weight_bytes * num_rollout,
                    "staleness_mean": float(stats[4] / stats[5]), "staleness_max": float(maxed),
                    "loss": loss.item(),
                })
            flag = torch.tensor([1.0 if solved else 0.0])
            dist.broadcast(flag, 0)  # every rank stops at the same iteration
            if flag.item():
                break
        if self._rank == 0 and sent is not None:
            sent.wait()
        return {"iterations": it, "final_mean_return": history[-1], "recent": recent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollout-workers", type=int, default=4)
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=150)
    parser.add_argument("--episodes-per-batch", type=int, default=2,
                        help="episodes a rollout worker puts in the channel at a time")
    parser.add_argument("--episodes-per-update", type=int, default=16,
                        help="episodes per update, over all trainer ranks")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--solved-window", type=int, default=5,
                        help="stop once the mean return over this many updates >= 195")
    parser.add_argument("--quick", action="store_true", help="a short run (a few updates)")
    parser.add_argument("--plot", default="learning_curve.png")
    args = parser.parse_args()
    if args.quick:
        args.iterations = min(args.iterations, 5)
        args.rollout_workers = min(args.rollout_workers, 2)

    from tqdm import tqdm

    start = time.monotonic()
    cluster = Cluster(num_nodes=1)
    channel = Channel.create("rollouts", maxsize=4 * args.rollout_workers, item_type=EpisodeBatch)
    metrics = Channel.create("metrics")
    rollout = RolloutWorker.create_group(
        "rollouts", args.episodes_per_batch, args.gamma, args.seed
    ).launch(cluster, NodePlacementStrategy([0] * args.rollout_workers), name=ROLLOUT)
    trainer = Trainer.create_group("rollouts", "metrics", args.lr, args.seed).launch(
        cluster, NodePlacementStrategy([0] * args.trainers), name=TRAINER
    )
    launch_s = time.monotonic() - start
    print(f"launched {args.rollout_workers} rollout workers and {args.trainers} trainer ranks "
          f"in {launch_s:.1f}s", flush=True)
    print(_INTRO, flush=True)
    if args.quick:
        print(_QUICK_NOTE, flush=True)

    def stop(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    rows: list[dict] = []
    try:
        play = rollout.run(args.rollout_workers)
        per_rank = max(1, args.episodes_per_update // args.trainers)
        train = trainer.train(args.iterations, per_rank, args.rollout_workers,
                              args.solved_window)
        t0, moved = time.monotonic(), 0
        t_end = None
        bar = tqdm(total=args.iterations, unit="it", file=sys.stdout, dynamic_ncols=True)
        while not train.done():
            try:
                m = metrics.get(timeout=1.0)
            except TimeoutError:
                continue
            rows.append(m)
            moved += m["channel_bytes"] + m["broadcast_bytes"]
            steps = sum(r["steps"] for r in rows)
            bar.update(1)
            bar.set_postfix(ret=f"{m['mean_return']:.0f}", steps_s=f"{steps / (time.monotonic() - t0):.0f}",
                            moved=_human_bytes(moved), stale=f"{m['staleness_mean']:.2f}")
        t_end = time.monotonic()
        while not metrics.empty():
            rows.append(metrics.get(timeout=5))
            bar.update(1)
        bar.close()
        result = train.wait(timeout=60)[0]
        channel.close()
        played = play.wait(timeout=60)
    except KeyboardInterrupt:
        print("\ninterrupted: shutting down", flush=True)
        result, played = None, []
    finally:
        channel.close()
        trainer.shutdown()
        rollout.shutdown()
        metrics.close()

    elapsed = time.monotonic() - start
    if rows:
        train_s = (t_end or time.monotonic()) - t0
        _summary(rows, played, launch_s, train_s, elapsed)
        _plot(rows, args.plot)
        print(f"wrote {args.plot} (mean return per update)")
    if result is not None:
        solved = result["recent"] >= SOLVED
        verdict = "SOLVED" if solved else "not solved"
        if not solved and args.quick:
            verdict += " (expected: --quick runs 5 updates; solving takes a few dozen)"
        print(f"{verdict}: mean return {result['recent']:.1f} over the "
              f"last {args.solved_window} updates after {result['iterations']} updates, "
              f"{elapsed:.0f}s")


_INTRO = """\
Each update: the trainer ranks take finished episodes from the 'rollouts' channel, run
one REINFORCE step (gradients all-reduced over Gloo), and rank 0 broadcasts the new
weights to the rollout workers, which keep playing meanwhile. The progress bar shows the
mean episode return of the last update (ret; CartPole counts one per step balanced, up to
500; 195 counts as solved), env steps trained per second (steps_s), data moved so far
(channel plus weights) and the mean policy staleness of the episodes (stale: how many
updates behind the newest weights the acting policy was)."""

_QUICK_NOTE = """\
--quick: 5 updates with 2 rollout workers, to show that everything runs end to end. It
never solves CartPole (that takes a few dozen updates); run without --quick for that."""


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _summary(rows: list[dict], played: list[dict], launch_s: float, train_s: float,
             elapsed: float) -> None:
    steps = sum(r["steps"] for r in rows)
    episodes = sum(r["episodes"] for r in rows)
    channel_bytes = sum(r["channel_bytes"] for r in rows)
    bcast_bytes = sum(r["broadcast_bytes"] for r in rows)
    last = rows[-1]
    lines = [
        ("updates", f"{len(rows)}"),
        ("policy version reached", f"{rows[-1]['iteration']}"),
        ("episodes trained on", f"{episodes}"),
        ("env steps trained on", f"{steps}"),
        ("episodes played (all workers)", f"{sum(p['episodes'] for p in played) if played else '-'}"),
        ("final mean return", f"{last['mean_return']:.1f}"),
        ("mean return, last updates", f"{last['recent']:.1f}"),
        ("policy staleness (mean / max)", f"{sum(r['staleness_mean'] for r in rows) / len(rows):.2f} / "
                                          f"{max(r['staleness_max'] for r in rows):.0f}"),
        ("episodes through the channel", _human_bytes(channel_bytes)),
        ("weights broadcast (to all workers)", _human_bytes(bcast_bytes)),
        ("env steps/s (trained)", f"{steps / train_s:.0f}"),
        ("training time", f"{train_s:.1f}s"),
        ("launch time", f"{launch_s:.1f}s"),
        ("wall time", f"{elapsed:.1f}s"),
    ]
    width = max(len(k) for k, _ in lines)
    print("\nSummary (env steps/s: steps trained on over the training time alone, launch "
          "not counted; staleness: updates between the acting policy and the one trained)")
    print("-" * (width + 16))
    for k, v in lines:
        print(f"{k:<{width}}  {v:>12}")


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["iteration"] for r in rows], [r["mean_return"] for r in rows], label="mean return")
    ax.axhline(SOLVED, color="gray", linestyle="--", label="solved (195)")
    ax.set_xlabel("update")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("mean episode return")
    ax.set_title("CartPole-v1, REINFORCE with baseline, rlcomm workers")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
