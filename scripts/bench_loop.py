#!/usr/bin/env python
"""The demo's RL loop end to end: on rlcomm and on plain Ray, in one run.

The loop is ``examples/rollout_to_trainer.py``'s. Rollout workers play CartPole-v1 with
a torch policy and stream finished episodes (one per item) to a data-parallel trainer,
two ranks that all-reduce their gradients over ``torch.distributed`` (Gloo). Unlike the
demo, an update trains on a fixed number of env steps (``--steps-per-update``, items
weighed by their steps), so that every update does the same work however long the
episodes grow as the policy learns, and the loops compare like with like. After every
update trainer rank 0 sends the new weights to every rollout worker; a worker takes them
between episodes and keeps playing meanwhile. The loop runs four ways, with the same
workers, policy, seeds and settings:

- ``rlcomm``: a typed ``Channel`` for episodes (``put``, ``get_batch``) and
  ``broadcast`` for weights: trainer rank 0 broadcasts its live state dict with
  ``async_op=True`` and waits for that broadcast before its next optimizer step (the
  broadcast reads the parameters while it copies them), as the weight-sync guide
  advises;
- ``rlcomm, clone``: the same channel; the weights as a clone of the state dict each
  update, broadcast with ``async_op=True`` after waiting for the previous one;
- ``rlcomm, rlcomm.empty``: the same, with the state dict copied into a new block of
  handed-over memory (``rlcomm.empty``) instead of a clone, so the broadcast itself
  copies nothing;
- ``plain Ray``: the loop as it is written without rlcomm. ``ray.util.queue.Queue`` for
  episodes; for weights, ``ray.put`` of the state dict and one actor call per rollout
  worker that takes the reference (Ray fetches the object before the call runs), after
  waiting for the previous calls. Every actor, the queue's included, runs with
  ``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1``. The trainer ranks set up Gloo from an
  address and port they agree on through the driver.

On each side weights arrive while a rollout worker plays (rlcomm: a broadcast posted with
``async_op=True``, as the demo does; Ray: a call on the actor's second concurrency slot),
and the worker notes the time they arrive, so a weight sync is timed until the weights
are there, not until the next episode ends.

Two policies: ``small``, the demo's (two 64-unit MLPs, 835 parameters), and
``50M``, the demo's with an embedding table of 50 M float32 parameters (200 MB) beside
it. Acting reads one row of the table per step (a hashed bucket of the observation), so
acting stays cheap while the weights are those of a mid-sized model; the trainers
all-reduce the table's full gradient, as data-parallel training of such a model does.

Reported per policy and loop, over the updates after ``--warmup`` (with ``--rounds``,
the median of the rounds, whose order alternates):

- env steps/s: env steps trained on, over the trainer's time for those updates;
- update: the median time of one update at trainer rank 0, from taking one batch to
  taking the next (waiting for episodes, the step, its share of the weight sync);
- weight sync: the median time from trainer rank 0 starting to send a version (the
  clone or copy included) until the last rollout worker holds it. Every process sits on
  one node and notes the wall clock.

- CPU per 1000 env steps: the CPU time (user and system) that every process of the run
  used over those updates (Ray's own processes, the workers, the queue or channel
  actor; read from ``/proc``), per 1000 env steps trained on. On a machine shared with
  other work, this figure moves much less with the others' load than the rates do.

It also prints where trainer rank 0's time goes (waiting for episodes, the step, sending
weights); the JSON keeps every update's times.

    python scripts/bench_loop.py --json docs/bench_loop.json
    python scripts/bench_loop.py --quick      # small policy, a few updates: a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
import torch
import torch.distributed as dist
from ray.util.queue import Full, Queue
from torch import nn

import rlcomm
from rlcomm import Channel, ChannelClosedError, Cluster, NodePlacementStrategy, Worker

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_tables  # noqa: E402

TRAINER, ROLLOUT = "loop_trainer", "loop_rollout"
LOOPS = ("rlcomm", "rlcomm, clone", "rlcomm, rlcomm.empty", "plain Ray")
#: Rows of the 50M policy's embedding table (64 float32 columns each): 50 M parameters.
POLICIES = {"small": 0, "50M": 781_250}
# Ray warns, once per process, that zero-copy tensors are read-only: known, and noise here.
ZERO_COPY = {"env_vars": {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1",
                          "PYTHONWARNINGS": "ignore"}}
WAIT_S = 600.0
STAGING = {"rlcomm": "live", "rlcomm, clone": "clone", "rlcomm, rlcomm.empty": "handover"}
STOP = -1  # the version that tells rollout workers' weight threads to end


@dataclass
class EpisodeBatch:
    """Finished episodes of one rollout worker, flattened over their steps."""

    obs: torch.Tensor  # (T, 4)
    actions: torch.Tensor  # (T,)
    returns: torch.Tensor  # (T,) discounted reward-to-go
    episodes: int
    policy_version: int


class Policy(nn.Module):
    """The demo's policy, with an optional embedding table read one row per step."""

    def __init__(self, table_rows: int, hidden: int = 64, dim: int = 64):
        super().__init__()
        self.rows = table_rows
        self.table = nn.Embedding(table_rows, dim) if table_rows else None
        if self.table is not None:
            nn.init.normal_(self.table.weight, std=0.01)
        width = 4 + (dim if table_rows else 0)
        self.pi = nn.Sequential(nn.Linear(width, hidden), nn.Tanh(), nn.Linear(hidden, 2))
        self.v = nn.Sequential(nn.Linear(width, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def features(self, obs: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            return obs
        # 16 bins per coordinate, hashed over the table's rows.
        bins = ((obs.clamp(-2.4, 2.4) + 2.4) / 4.8 * 15.999).long()
        code = ((bins[..., 0] * 16 + bins[..., 1]) * 16 + bins[..., 2]) * 16 + bins[..., 3]
        return torch.cat([obs, self.table((code * 2654435761) % self.rows)], dim=-1)

    def dist(self, x: torch.Tensor) -> torch.distributions.Categorical:
        return torch.distributions.Categorical(logits=self.pi(x))


def count_parameters(table_rows: int, hidden: int = 64, dim: int = 64) -> int:
    """The parameters of ``Policy(table_rows)``, counted without making one."""
    width = 4 + (dim if table_rows else 0)
    mlps = (width * hidden + hidden) * 2 + (hidden * 2 + 2) + (hidden + 1)
    return table_rows * dim + mlps


class Player:
    """What a rollout worker does, whichever way its data travels."""

    def setup(self, table_rows: int, episodes_per_item: int, seed: int, rank: int) -> None:
        import gymnasium as gym

        torch.set_num_threads(1)
        torch.manual_seed(seed)
        self.env = gym.make("CartPole-v1")
        self.seed = seed * 1000 + rank
        self.policy = Policy(table_rows)
        self.version = 0
        self.episodes_per_item = episodes_per_item
        self.episode = 0
        self.steps = 0
        self.arrivals: dict[int, float] = {}
        self._latest: tuple[int, dict] | None = None
        self._lock = threading.Lock()

    def offer(self, version: int, state: dict) -> None:
        """Called when weights arrive: note the time and keep them for the next episode."""
        now = time.time()
        with self._lock:
            self.arrivals[version] = now
            self._latest = (version, state)

    def _take_weights(self) -> None:
        with self._lock:
            latest, self._latest = self._latest, None
        if latest is not None and latest[0] > self.version:
            self.version = latest[0]
            self.policy.load_state_dict(latest[1])

    def _play_one(self) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
        obs, _ = self.env.reset(seed=self.seed + 7919 * self.episode)
        self.episode += 1
        rows, acts, rews = [], [], []
        done = False
        with torch.no_grad():
            while not done:
                o = torch.as_tensor(obs, dtype=torch.float32)
                a = self.policy.dist(self.policy.features(o)).sample()
                obs, r, terminated, truncated, _ = self.env.step(int(a))
                rows.append(o)
                acts.append(a)
                rews.append(float(r))
                done = terminated or truncated
        return torch.stack(rows), torch.stack(acts), rews

    def next_item(self, gamma: float = 0.99) -> EpisodeBatch:
        obs, acts, rets = [], [], []
        for _ in range(self.episodes_per_item):
            self._take_weights()
            o, a, rews = self._play_one()
            ret, running = [0.0] * len(rews), 0.0
            for t in reversed(range(len(rews))):
                running = rews[t] + gamma * running
                ret[t] = running
            obs.append(o)
            acts.append(a)
            rets.append(torch.tensor(ret))
        item = EpisodeBatch(torch.cat(obs), torch.cat(acts), torch.cat(rets),
                            self.episodes_per_item, self.version)
        self.steps += item.obs.shape[0]
        return item

    def report(self) -> dict[str, Any]:
        return {"episodes": self.episode, "steps": self.steps, "arrivals": self.arrivals}


class Learner:
    """What a trainer rank does, whichever way its data travels."""

    def setup(self, table_rows: int, lr: float, seed: int) -> None:
        torch.set_num_threads(1)
        torch.manual_seed(seed)  # the same initial weights on every rank
        self.policy = Policy(table_rows)
        self.opt = torch.optim.Adam(self.policy.parameters(), lr=lr)
        self.version = 0
        self.records: list[dict[str, float]] = []

    def step(self, batches: list[EpisodeBatch], world: int,
             before_update: Callable[[], None] | None = None) -> int:
        """One REINFORCE step with a learned baseline, gradients averaged over the ranks;
        the env steps trained on, summed over the ranks. ``before_update`` runs just
        before the optimizer changes the weights."""
        obs = torch.cat([b.obs for b in batches])
        acts = torch.cat([b.actions for b in batches])
        rets = torch.cat([b.returns for b in batches])
        x = self.policy.features(obs)
        value = self.policy.v(x).squeeze(-1)
        adv = rets - value.detach()
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        loss = -(self.policy.dist(x).log_prob(acts) * adv).mean()
        loss = loss + 0.5 * ((value - rets) ** 2).mean() / max(1.0, float(rets.var()))
        self.opt.zero_grad()
        loss.backward()
        for p in self.policy.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        if before_update is not None:
            before_update()
        self.opt.step()
        self.version += 1
        steps = torch.tensor([float(obs.shape[0])])
        dist.all_reduce(steps)
        return int(steps.item())

    def note(self, start: float, got: float, stepped: float, steps: int,
             sync_start: float | None) -> None:
        """One update's times (wall clock): started, got its batch, stepped, began its
        weight sync (-1 on ranks that send none), and the record's end."""
        self.records.append({"version": self.version, "start": start, "got": got,
                             "stepped": stepped, "end": time.time(), "steps": steps,
                             "sync_start": sync_start if sync_start is not None else -1.0})


# -- rlcomm ------------------------------------------------------------------------------


def _weight_groups(num_rollout: int) -> list:
    return [(TRAINER, 0), (ROLLOUT, list(range(num_rollout)))]


class RlcommRollout(Player, Worker):
    def __init__(self, table_rows: int, episodes_per_item: int, seed: int):
        super().__init__()
        self.setup(table_rows, episodes_per_item, seed, self._rank)
        self.channel = self.connect_channel("loop_episodes")

    def _arrived(self, future) -> None:
        """A broadcast's completion: note the weights' arrival (on rlcomm's thread)."""
        if future.cancelled() or future.exception() is not None:
            return
        state = future.result()
        version = int(state["__version__"])
        if version != STOP:
            self.offer(version, {k: v for k, v in state.items() if k != "__version__"})

    def _post(self, groups: list) -> Any:
        work = self.broadcast(None, groups=groups, src=(TRAINER, 0), async_op=True)
        work.future.add_done_callback(self._arrived)
        return work

    @staticmethod
    def _says_stop(work: Any) -> bool:
        return int(work.wait()["__version__"]) == STOP

    def run(self, num_rollout: int) -> dict[str, Any]:
        # As the demo does: the next broadcast is posted with async_op=True and looked at
        # between episodes. (A thread blocked in a blocking receive slowed this process's
        # playing thread to about half its rate: see docs/performance.md.)
        groups = _weight_groups(num_rollout)
        pending = self._post(groups)
        try:
            while True:
                if pending is not None and pending.done():
                    pending = None if self._says_stop(pending) else self._post(groups)
                item = self.next_item()
                self.channel.put(item, weight=item.obs.shape[0])  # weighed in env steps
        except ChannelClosedError:
            pass
        while pending is not None:  # the trainer's last broadcast says stop
            pending = None if self._says_stop(pending) else self._post(groups)
        return self.report()


class RlcommTrainer(Learner, Worker):
    def __init__(self, table_rows: int, lr: float, seed: int):
        super().__init__()
        if not dist.is_initialized():
            dist.init_process_group("gloo")  # MASTER_ADDR/PORT, RANK, WORLD_SIZE from rlcomm
        self.setup(table_rows, lr, seed)
        self.channel = self.connect_channel("loop_episodes")

    def _staged(self, how: str) -> dict[str, torch.Tensor]:
        """The weights to send. ``live``: the parameters themselves (the broadcast copies
        them; the optimizer waits for it). ``clone``: a fresh copy each update.
        ``handover``: a copy into a new block of handed-over memory (a sender must not
        write to memory it handed over, so each version gets its own)."""
        state = self.policy.state_dict()
        if how == "live":
            return dict(state)
        if how == "clone":
            return {k: v.clone() for k, v in state.items()}
        block = rlcomm.empty(sum(v.numel() for v in state.values()), dtype=torch.float32)
        out, at = {}, 0
        for k, v in state.items():
            view = block[at:at + v.numel()].view(v.shape)
            view.copy_(v)
            out[k] = view
            at += v.numel()
        return out

    def train(self, updates: int, steps_per_rank: int, num_rollout: int,
              how: str) -> list[dict[str, float]]:
        groups = _weight_groups(num_rollout)
        sent = None

        def settle() -> None:  # the previous weights reached every rollout worker
            if sent is not None:
                sent.wait()

        for _ in range(updates):
            start = time.time()
            batches = self.channel.get_batch(steps_per_rank)
            got = time.time()
            # Sent from the live parameters, a broadcast reads them until it is done.
            steps = self.step(batches, self._world_size, settle if how == "live" else None)
            stepped = time.time()
            sync_start = None
            if self._rank == 0:
                settle()
                sync_start = time.time()
                weights = self._staged(how)
                weights["__version__"] = torch.tensor(self.version)
                sent = self.broadcast(weights, groups=groups, src=(TRAINER, 0), async_op=True)
            self.note(start, got, stepped, steps, sync_start)
        if self._rank == 0:
            settle()
            self.broadcast({"__version__": torch.tensor(STOP)}, groups=groups, src=(TRAINER, 0))
        return self.records


# -- plain Ray ---------------------------------------------------------------------------


class RayRollout(Player):
    def __init__(self, table_rows: int, episodes_per_item: int, seed: int, rank: int, queue):
        self.setup(table_rows, episodes_per_item, seed, rank)
        self.queue = queue
        self.stopped = threading.Event()

    def set_weights(self, state: dict, version: int) -> None:
        self.offer(version, state)

    def stop(self) -> None:
        self.stopped.set()

    def run(self) -> dict[str, Any]:
        while not self.stopped.is_set():
            item = self.next_item()
            while not self.stopped.is_set():
                try:
                    self.queue.put(item, timeout=0.5)
                    break
                except Full:
                    continue
        return self.report()


class RayTrainer(Learner):
    def __init__(self, table_rows: int, lr: float, seed: int, queue):
        self.setup(table_rows, lr, seed)
        self.queue = queue

    def address(self) -> tuple[str, int]:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init_dist(self, addr: str, port: int, rank: int, world: int) -> None:
        dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank,
                                world_size=world)
        self.rank, self.world = rank, world

    def _take(self, steps: int) -> list[EpisodeBatch]:
        """Items until they hold ``steps`` env steps (``get_batch``'s rule)."""
        batches, got = [], 0
        while got < steps:
            item = self.queue.get(timeout=WAIT_S)
            batches.append(item)
            got += item.obs.shape[0]
        return batches

    def train(self, updates: int, steps_per_rank: int, rollouts: list) -> list[dict]:
        pending: list = []
        for _ in range(updates):
            start = time.time()
            batches = self._take(steps_per_rank)
            got = time.time()
            steps = self.step(batches, self.world)
            stepped = time.time()
            sync_start = None
            if self.rank == 0:
                ray.get(pending, timeout=WAIT_S)  # the previous weights reached every worker
                sync_start = time.time()
                ref = ray.put(self.policy.state_dict())
                pending = [r.set_weights.remote(ref, self.version) for r in rollouts]
            self.note(start, got, stepped, steps, sync_start)
        ray.get(pending, timeout=WAIT_S)
        return self.records


# -- the run -----------------------------------------------------------------------------


def summarize(records: list[dict], reports: list[dict], warmup: int) -> dict[str, Any]:
    """The figures of one loop from trainer rank 0's records and the workers' reports."""
    timed = records[warmup:]
    if len(timed) < 2:
        raise ValueError(f"need at least {warmup + 2} updates to time {warmup} warm-up ones")
    span = timed[-1]["start"] - timed[0]["start"]
    periods = [b["start"] - a["start"] for a, b in zip(timed, timed[1:], strict=False)]
    syncs = []
    for r in records:
        arrivals = [rep["arrivals"].get(r["version"]) for rep in reports]
        if r["sync_start"] >= 0 and all(a is not None for a in arrivals):
            r["sync_ms"] = (max(arrivals) - r["sync_start"]) * 1e3
            if r in timed:
                syncs.append(r["sync_ms"] / 1e3)

    def median_ms(a: str, b: str) -> float:
        return statistics.median(r[b] - r[a] for r in timed) * 1e3

    return {
        "updates_timed": len(periods),
        "env_steps_per_s": sum(r["steps"] for r in timed[:-1]) / span,
        "update_ms": statistics.median(periods) * 1e3,
        "weight_sync_ms": statistics.median(syncs) * 1e3 if syncs else None,
        "weight_sync_samples": len(syncs),
        "steps_per_update": statistics.mean(r["steps"] for r in timed),
        "waiting_for_episodes_ms": median_ms("start", "got"),
        "step_ms": median_ms("got", "stepped"),
        "sending_weights_ms": median_ms("stepped", "end"),
    }


def tree_cpu_s(root: int) -> float | None:
    """CPU seconds (user and system) the descendants of process ``root`` have used, from
    ``/proc``: Ray's own processes, the workers, the actors. ``None`` without ``/proc``."""
    if not os.path.isdir("/proc"):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    used: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        # fields[1]: ppid; [11], [12]: utime, stime; [13], [14]: of its reaped children
        children.setdefault(int(fields[1]), []).append(int(entry))
        used[int(entry)] = sum(int(x) for x in fields[11:15]) / tick
    total, todo = 0.0, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        total += used.get(pid, 0.0)
        todo += children.get(pid, [])
    return total


class CpuSampler:
    """Samples :func:`tree_cpu_s` of this process's descendants on a thread of its own,
    so the CPU used between two wall-clock times can be read afterwards."""

    def __init__(self, every_s: float = 0.25):
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._every = every_s
        self._thread = threading.Thread(target=self._run, name="loop-cpu", daemon=True)

    def _run(self) -> None:
        while True:
            cpu = tree_cpu_s(os.getpid())
            if cpu is not None:
                self.samples.append((time.time(), cpu))
            if self._stop.wait(self._every):
                return

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, start: float, end: float) -> float | None:
        """CPU seconds used from ``start`` to ``end`` (linear between samples)."""
        def at(t: float) -> float | None:
            for (t0, c0), (t1, c1) in zip(self.samples, self.samples[1:], strict=False):
                if t0 <= t <= t1:
                    return c0 + (c1 - c0) * (t - t0) / (t1 - t0) if t1 > t0 else c0
            return None

        a, b = at(start), at(end)
        return None if a is None or b is None else b - a


def _median(values: list[Any]) -> Any:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


class LoopBench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        ray.init(address="local", include_dashboard=False, logging_level="ERROR")
        self.cluster = Cluster(num_nodes=1)

    def run_rlcomm(self, table_rows: int, how: str) -> tuple[list, list]:
        a = self.args
        channel = Channel.create("loop_episodes", maxsize=a.queue_items,
                                 item_type=EpisodeBatch)
        rollout = RlcommRollout.create_group(table_rows, a.episodes_per_item, a.seed).launch(
            self.cluster, NodePlacementStrategy([0] * a.rollout_workers), name=ROLLOUT)
        trainer = RlcommTrainer.create_group(table_rows, a.lr, a.seed).launch(
            self.cluster, NodePlacementStrategy([0] * a.trainers), name=TRAINER)
        try:
            play = rollout.run(a.rollout_workers)
            records = trainer.train(a.updates, a.steps_per_update // a.trainers,
                                    a.rollout_workers, how).wait(timeout=WAIT_S)[0]
            channel.close()
            reports = play.wait(timeout=WAIT_S)
        finally:
            channel.close()
            trainer.shutdown()
            rollout.shutdown()
            channel.shutdown()
        return records, reports

    def run_ray(self, table_rows: int) -> tuple[list, list]:
        a = self.args
        queue = Queue(maxsize=a.queue_items,
                      actor_options={"num_cpus": 0, "runtime_env": ZERO_COPY})
        opts = {"num_cpus": 0, "runtime_env": ZERO_COPY}
        rollouts = [ray.remote(RayRollout).options(max_concurrency=2, **opts).remote(
            table_rows, a.episodes_per_item, a.seed, rank, queue)
            for rank in range(a.rollout_workers)]
        trainers = [ray.remote(RayTrainer).options(**opts).remote(table_rows, a.lr, a.seed, queue)
                    for _ in range(a.trainers)]
        try:
            addr, port = ray.get(trainers[0].address.remote(), timeout=WAIT_S)
            ray.get([t.init_dist.remote(addr, port, rank, a.trainers)
                     for rank, t in enumerate(trainers)], timeout=WAIT_S)
            play = [r.run.remote() for r in rollouts]
            train = [t.train.remote(a.updates, a.steps_per_update // a.trainers, rollouts)
                     for t in trainers]
            records = ray.get(train, timeout=WAIT_S)[0]
            ray.get([r.stop.remote() for r in rollouts], timeout=WAIT_S)
            reports = ray.get(play, timeout=WAIT_S)
        finally:
            for actor in (*rollouts, *trainers):
                ray.kill(actor)
            queue.shutdown()
        return records, reports

    def run(self) -> dict[str, Any]:
        a = self.args
        runs: dict[tuple[str, str], dict[str, Any]] = {}
        load_start = os.getloadavg()
        for policy in a.policies:
            rows = POLICIES[policy]
            params = count_parameters(rows)
            print(f"policy {policy}: {params} parameters, {params * 4} bytes of weights",
                  flush=True)
            for rnd in range(a.rounds):
                # Alternate the order, so that no loop always runs first (or last) while
                # the machine's load drifts.
                for loop in a.loops if rnd % 2 == 0 else a.loops[::-1]:
                    run = runs.setdefault((policy, loop), {
                        "policy": policy, "loop": loop, "parameters": params,
                        "weight_bytes": params * 4, "rounds": []})
                    run["rounds"].append(self._one(rows, loop, rnd))
            for loop in a.loops:
                run = runs[policy, loop]
                run["summary"] = {
                    key: _median([r["summary"][key] for r in run["rounds"]])
                    for key in run["rounds"][0]["summary"]}
        machine = {"cpus": os.cpu_count(), "loadavg_start": load_start,
                   "loadavg_end": os.getloadavg(), "python": platform.python_version(),
                   "ray": ray.__version__, "torch": torch.__version__,
                   "note": a.machine_note}
        return {"args": vars(a), "machine": machine, "runs": list(runs.values())}

    def _one(self, rows: int, loop: str, rnd: int) -> dict[str, Any]:
        t0 = time.monotonic()
        with CpuSampler() as cpu:
            if loop == "plain Ray":
                records, reports = self.run_ray(rows)
            else:
                records, reports = self.run_rlcomm(rows, STAGING[loop])
        summary = summarize(records, reports, self.args.warmup)
        timed = records[self.args.warmup:]
        used = cpu.between(timed[0]["start"], timed[-1]["start"])
        steps = sum(r["steps"] for r in timed[:-1])
        summary["cpu_s_per_1k_steps"] = used / steps * 1e3 if used is not None else None
        sync = summary["weight_sync_ms"]
        print(f"  round {rnd + 1} {loop:22s} {summary['env_steps_per_s']:8.0f} env steps/s, "
              f"update {summary['update_ms']:7.1f} ms, weight sync "
              f"{'-' if sync is None else f'{sync:.1f}'} ms; rank 0 per update: "
              f"{summary['waiting_for_episodes_ms']:.0f} ms waiting for episodes, "
              f"{summary['step_ms']:.0f} ms stepping, "
              f"{summary['sending_weights_ms']:.0f} ms sending weights; "
              f"{summary['cpu_s_per_1k_steps'] or float('nan'):.2f} CPU s per 1000 env steps "
              f"({time.monotonic() - t0:.0f} s)", flush=True)
        return {"summary": summary, "records": records,
                "workers": [{k: v for k, v in r.items() if k != "arrivals"} for r in reports]}

    def shutdown(self) -> None:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", type=lambda s: s.split(","), default=list(POLICIES),
                        help=f"comma-separated, of {', '.join(POLICIES)}")
    parser.add_argument("--loops", type=lambda s: s.split(","), default=list(LOOPS),
                        help=f"comma-separated, of {', '.join(LOOPS)}")
    parser.add_argument("--rollout-workers", type=int, default=4)
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--updates", type=int, default=30, help="updates per loop")
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of each loop, in alternating order; figures are medians")
    parser.add_argument("--warmup", type=int, default=5, help="first updates left out")
    parser.add_argument("--steps-per-update", type=int, default=2048,
                        help="env steps an update trains on, over all trainer ranks")
    parser.add_argument("--episodes-per-item", type=int, default=1)
    parser.add_argument("--queue-items", type=int, default=256,
                        help="bound of the episode queue (both loops), in items")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--machine-note", default="", help="said of the machine in the JSON")
    parser.add_argument("--quick", action="store_true", help="small policy, 6 updates")
    parser.add_argument("--json", help="write every number here")
    args = parser.parse_args()
    if args.quick:
        args.policies, args.updates, args.warmup, args.rounds = ["small"], 6, 2, 1
    for name in args.policies:
        if name not in POLICIES:
            parser.error(f"unknown policy {name!r}")
    for name in args.loops:
        if name not in LOOPS:
            parser.error(f"unknown loop {name!r}")
    start = time.monotonic()
    bench = LoopBench(args)
    try:
        results = bench.run()
    finally:
        bench.shutdown()
    print()
    print(make_tables.loop_table(results))
    print(f"\n({time.monotonic() - start:.0f} s, load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cores)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
