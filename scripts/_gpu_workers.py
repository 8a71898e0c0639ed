"""The workers of ``bench_gpu.py``'s weight-sync and per-message cases (a module of its
own: Ray imports a worker's class by module name in the worker processes).

Every worker here runs on GPU 0 of its node (the bench places them all on hardware rank
0, as Ray actors with fractional ``num_gpus`` share a GPU). Times are ``perf_counter``
readings, which are one clock for every process of a Linux machine, so a receiver's end
and the trainer's start of a round can be subtracted.
"""

from __future__ import annotations

import time
from multiprocessing import shared_memory
from typing import Any

import ray
import torch
from _handoff import NBYTES as HANDOFF_BYTES
from _handoff import HandOff

from rlcomm import Worker


def make_params(total: int, count: int, device: str = "cuda") -> dict[str, torch.Tensor]:
    """``count`` bf16 tensors of ``total`` bytes in all, on this process's GPU (or CPU)."""
    numel = total // count // 2
    return {f"layer{i}.weight": torch.ones(numel, dtype=torch.bfloat16, device=device)
            for i in range(count)}


class SyncWorker(Worker):
    """The trainer or one receiver of a weight sync: each holds a state dict on GPU 0
    (``device="cpu"``: in host memory, to try the case's code without a GPU; memory
    figures are then ``None``)."""

    def __init__(self, total: int, count: int, device: str = "cuda"):
        super().__init__()
        self.cuda = device == "cuda"
        if self.cuda:
            torch.cuda.set_device(0)
        self.params = make_params(total, count, device)

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _fill(self, value: float) -> None:
        for p in self.params.values():
            p.fill_(value)
        self._sync()

    def _peak_from_here(self) -> int | None:
        """Start counting the peak of this process's GPU tensors; returns what they
        hold now (``None`` on the CPU)."""
        if not self.cuda:
            return None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def _peak_extra(self, start: int | None) -> int | None:
        """Bytes of GPU tensors this process held at most, beyond ``start``."""
        if start is None:
            return None
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start

    def memory(self) -> dict[str, int | None]:
        """This process's GPU memory now: its tensors (``allocated``), what torch's
        allocator keeps (``reserved``), and the GPU's used bytes, every process's
        (``device_used``). ``None`` each on the CPU."""
        if not self.cuda:
            return {"allocated": None, "reserved": None, "device_used": None}
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return {"allocated": torch.cuda.memory_allocated(),
                "reserved": torch.cuda.memory_reserved(), "device_used": total - free}

    # -- rlcomm -------------------------------------------------------------------------

    def trainer_rounds(self, path: str, receivers: list[tuple[str, int]], rounds: int,
                       members: list | None = None) -> tuple[list[float], int | None]:
        """``rounds`` syncs to ``receivers`` by ``path``; the start time of each, and the
        bytes of GPU tensors this process held at most beyond its own parameters (its
        staging, say). A round ends when every receiver said it holds the values (a small
        CPU message each)."""
        start = self._peak_from_here()
        starts = []
        if path == "push":
            self._pusher(receivers)
        for k in range(rounds):
            self._fill(float(k % 100))
            starts.append(time.perf_counter())
            if path == "broadcast":
                self.broadcast(self.params, groups=members, src=members[0])
            elif path == "send_tensor":
                for group, rank in receivers:
                    for p in self.params.values():
                        self.send_tensor(p, group, rank)
            elif path == "push":  # set up once, before the first round's start
                self._pusher(receivers).push()
            else:  # send into params, or into fresh tensors
                for group, rank in receivers:
                    self.send(self.params, group, rank)
            for group, rank in receivers:
                self.recv(group, rank)
        return starts, self._peak_extra(start)

    def receiver_rounds(self, path: str, trainer: tuple[str, int], rounds: int,
                        members: list | None = None) -> tuple[list[float], bool, int | None]:
        """The receiving side of :meth:`trainer_rounds`: the time each round's values
        were in this worker's memory, whether the last ones were right, and the bytes of
        GPU tensors this process held at most beyond its parameters (for ``send_fresh``,
        the fresh tensors among them)."""
        start = self._peak_from_here()
        ends, got = [], self.params
        if path == "push":
            self._pushed(trainer)
        for k in range(rounds):
            if path == "broadcast":
                got = self.broadcast(None, groups=members, src=members[0], into=self.params)
            elif path == "send_tensor":
                for p in self.params.values():
                    self.recv_tensor(p, *trainer)
            elif path == "send":
                got = self.recv(*trainer, into=self.params)
            elif path == "push":  # releases the last version, waits for the next
                self._pushed(trainer).update()
            else:  # send_fresh: new tensors, not loaded
                got = self.recv(*trainer)
            self._sync()
            ends.append(time.perf_counter())
            self.send(k, *trainer)
        last = float((rounds - 1) % 100)
        ok = all(bool((t == last).all()) for t in got.values())
        return ends, ok, self._peak_extra(start)

    def _pusher(self, receivers: list[tuple[str, int]]) -> Any:
        """The pushed sync's source (made once; it waits for each receiver to register)."""
        if getattr(self, "pusher", None) is None:
            self.pusher = self.weight_pusher(self.params, to=receivers, name="bench")
        return self.pusher

    def _pushed(self, trainer: tuple[str, int]) -> Any:
        """This receiver's end of the pushed sync (made once: it registers the params)."""
        if getattr(self, "pushed", None) is None:
            self.pushed = self.pushed_weights(self.params, src=trainer, name="bench")
        return self.pushed

    # -- the baseline: CUDA IPC handles through Ray (verl, SGLang) ---------------------

    def handle_rounds(self, actors: list[Any], rounds: int) -> list[float]:
        """``rounds`` syncs the way verl and SGLang make them: ``reduce_tensor`` handles
        of every tensor, passed to each receiver in a Ray call, rebuilt there and loaded
        into its parameters. Seconds of each, until every receiver returned."""
        from torch.multiprocessing.reductions import reduce_tensor

        took = []
        for k in range(rounds):
            self._fill(float(k % 100))
            start = time.perf_counter()
            handles = {name: reduce_tensor(p) for name, p in self.params.items()}
            ray.get([a.load_handles.remote(handles) for a in actors])
            took.append(time.perf_counter() - start)
        return took

    def load_handles(self, handles: dict[str, Any]) -> bool:
        for name, (rebuild, args) in handles.items():
            self.params[name].copy_(rebuild(*args))
        torch.cuda.synchronize()
        return True

    # -- the bound ----------------------------------------------------------------------

    def bound_rounds(self, copies: int, rounds: int) -> list[float]:
        """``copies`` device copies of the state dict inside this process, per round
        (into one target, ``copies`` times: the same bytes moved as into ``copies``
        targets, the state dicts being far larger than the GPU's caches, in the memory
        of one copy, so that a 16 GiB dict to 4 receivers fits beside the receivers)."""
        target = {k: torch.empty_like(v) for k, v in self.params.items()}
        took = []
        for _ in range(rounds):
            self._sync()
            start = time.perf_counter()
            for _ in range(copies):
                for name, p in self.params.items():
                    target[name].copy_(p)
            self._sync()
            took.append(time.perf_counter() - start)
        return took


class MessageWorker(Worker):
    """One end of the per-message case: rlcomm's CUDA messages, and the hand-off floor
    (two processes, buffer and events opened once, a flag in shared host memory)."""

    SLOTS = 8  # the floor's depth in the streamed mode (rlcomm's staging slots)

    def __init__(self) -> None:
        super().__init__()
        torch.cuda.set_device(0)
        self._floor: dict[str, Any] = {}

    # -- rlcomm -------------------------------------------------------------------------

    def stream(self, peer: tuple[str, int], send: bool, nbytes: int, iters: int) -> float:
        """``iters`` messages one way, then one back; seconds per message (sender)."""
        t = torch.ones(max(1, nbytes // 4), device="cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        if send:
            for _ in range(iters):
                self.send(t, *peer)
            self.recv(*peer)
        else:
            for _ in range(iters):
                self.recv(*peer)
            torch.cuda.synchronize()
            self.send(1, *peer)
        return (time.perf_counter() - start) / iters

    def latency(self, peer: tuple[str, int], first: bool, nbytes: int, iters: int) -> float:
        """Ping-pong: each side receives (its copy done) before it sends the message
        back; half the round trip."""
        t = torch.ones(max(1, nbytes // 4), device="cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            if first:
                self.send(t, *peer)
                self.recv(*peer)
            else:
                self.recv(*peer)
            torch.cuda.synchronize()
            if not first:
                self.send(t, *peer)
        return (time.perf_counter() - start) / iters / 2

    # -- the floor ------------------------------------------------------------------------

    def floor_open(self, nbytes: int) -> dict[str, Any]:
        """As the floor's sender: the buffer (one slot per message in flight), its
        events, the flags; returns what the receiver opens."""
        slots = self.SLOTS
        buf = torch.empty(slots * max(nbytes, 512), dtype=torch.uint8, device="cuda")
        ready = [torch.cuda.Event(interprocess=True) for _ in range(slots)]
        for e in ready:
            e.record()
        flags = shared_memory.SharedMemory(create=True, size=HANDOFF_BYTES)
        self._floor = {"buf": buf, "ready": ready, "flags": flags, "slot": max(nbytes, 512),
                       "src": torch.ones(nbytes, dtype=torch.uint8, device="cuda")}
        torch.cuda.synchronize()
        return {"share": buf.untyped_storage()._share_cuda_(),
                "ready": [bytes(e.ipc_handle()) for e in ready], "flags": flags.name,
                "slot": max(nbytes, 512)}

    def floor_attach(self, opened: dict[str, Any], nbytes: int) -> list[bytes]:
        """As the floor's receiver: open the sender's buffer, events and flags; returns
        the handles of its own events (the sender reuses a slot after them)."""
        storage = torch.UntypedStorage._new_shared_cuda(*opened["share"])
        buf = torch.empty(0, dtype=torch.uint8, device="cuda").set_(storage)
        done = [torch.cuda.Event(interprocess=True) for _ in range(self.SLOTS)]
        for e in done:
            e.record()
        torch.cuda.synchronize()
        self._floor = {
            "buf": buf, "ready": [torch.cuda.Event.from_ipc_handle(0, h) for h in opened["ready"]],
            "done": done, "flags": shared_memory.SharedMemory(name=opened["flags"]),
            "slot": opened["slot"], "dst": torch.empty(nbytes, dtype=torch.uint8, device="cuda"),
        }
        return [bytes(e.ipc_handle()) for e in done]

    def floor_peer_events(self, handles: list[bytes]) -> bool:
        self._floor["done"] = [torch.cuda.Event.from_ipc_handle(0, h) for h in handles]
        return True

    def floor_run(self, sender: bool, nbytes: int, iters: int, serial: bool, run: int) -> float:
        """Run ``run`` (a new id each call, the same on both sides): ``iters``
        hand-offs; ``serial``: each waits for the last one's copy to be done on the
        receiver (latency), else up to :data:`SLOTS` in flight (stream). Seconds per
        hand-off, on the sender."""
        f = self._floor
        flags = HandOff(f["flags"].buf)
        depth = 1 if serial else self.SLOTS
        stream = torch.cuda.current_stream()
        slot = f["slot"]
        torch.cuda.synchronize()
        if sender:
            flags.start_sending(run)
        else:
            flags.start_receiving(run)
        start = time.perf_counter()
        for i in range(iters):
            k = i % self.SLOTS
            view = f["buf"][k * slot : k * slot + nbytes]
            if sender:
                flags.wait_room(i, depth)
                stream.wait_event(f["done"][k])
                view.copy_(f["src"], non_blocking=True)
                f["ready"][k].record(stream)
                flags.sent(i)
            else:
                flags.wait_sent(i)
                stream.wait_event(f["ready"][k])
                f["dst"].copy_(view, non_blocking=True)
                f["done"][k].record(stream)
                if serial:
                    stream.synchronize()
                flags.taken(i)
        if sender:
            flags.wait_finished(iters)
        else:
            torch.cuda.synchronize()
            flags.finish(iters)
        return (time.perf_counter() - start) / iters

    def floor_close(self) -> bool:
        flags = self._floor.pop("flags", None)
        if flags is not None:
            flags.close()
            if "src" in self._floor:
                flags.unlink()
        self._floor = {}
        return True
