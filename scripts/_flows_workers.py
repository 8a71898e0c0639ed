"""The worker-side halves of ``bench_flows.py``'s flows (one module, shared by the rlcomm
run and the RLinf run in ``_flows_rlinf.py``).

Every timed method returns wall-clock stamps (``time.time()``, one machine): the sending
side the moment it starts a transfer, the receiving side the moment it holds the result.
Before each transfer the receiver sends a one-element "ready" message, so a transfer
starts only when every receiver waits for it; the driver pairs the stamps up.
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import time
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist
from bench_channel import make_item, put_windowed

WAIT_S = 600.0  # the bound on every wait inside the workers


def tensor_dict(nbytes: int, ntensors: int, fill: bool = True,
                handover: bool = False) -> dict[str, torch.Tensor]:
    """``ntensors`` float32 tensors of ``nbytes`` in all (a state dict or a rollout dict);
    with ``handover``, made by ``rlcomm.empty`` (same-node sends pass their memory)."""
    each = max(1, nbytes // ntensors // 4)
    if handover:
        import rlcomm

        out = {f"t{i:02d}": rlcomm.empty(each) for i in range(ntensors)}
        for t in out.values():
            t.fill_(1.0 if fill else 0.0)
        return out
    make = torch.ones if fill else torch.empty
    return {f"t{i:02d}": make(each, dtype=torch.float32) for i in range(ntensors)}


def _ready() -> torch.Tensor:
    return torch.zeros(1)


class FlowOps:
    """Mixed into an rlcomm (or RLinf) ``Worker``: the flows over its send/recv,
    broadcast and channels, and raw ``torch.distributed`` Gloo over the same processes.

    ``channel_kwargs`` holds the keyword arguments that bound a channel wait (rlcomm's
    ``timeout``; RLinf's channel takes none).
    """

    channel_kwargs: dict[str, Any] = {"timeout": WAIT_S}

    def setup_flows(self) -> bool:
        torch.set_num_threads(1)
        self._payload: dict[str, torch.Tensor] | None = None
        self._held: Any = None
        self._channels: dict[str, Any] = {}
        self._gloo_groups: dict[int, Any] = {}
        return True

    def make_payload(self, nbytes: int, ntensors: int, fill: bool = True,
                     handover: bool = False) -> bool:
        self._payload = None
        self._payload = tensor_dict(nbytes, ntensors, fill, handover)
        return True

    def drop(self) -> bool:
        """Free what the last case left behind."""
        self._payload = self._held = None
        self._channels = {}
        gc.collect()
        return True

    # -- weight sync: one source, receivers of another group ------------------------------

    def sync_source(self, how: str, me: str, dst: str, ranks: list[int], iters: int) -> list[float]:
        """Send the payload to ``(dst, ranks)`` ``iters`` times; ``how`` is "broadcast" or
        "send" (async sends to each, then wait). Returns the start stamps."""
        groups = [(me, 0), (dst, list(ranks))]
        starts = []
        for _ in range(iters):
            for r in ranks:
                self.recv(dst, r)
            starts.append(time.time())
            if how == "broadcast":
                self.broadcast(self._payload, groups=groups, src=(me, 0))
            else:
                works = [self.send(self._payload, dst, r, async_op=True) for r in ranks]
                for w in works:
                    w.wait()
        return starts

    def sync_receiver(self, how: str, src: str, me: str, ranks: list[int], iters: int) -> list[float]:
        """The receiving half of :meth:`sync_source`; keeps each result until the next
        arrives. Returns the stamps at which it held each."""
        groups = [(src, 0), (me, list(ranks))]
        ends = []
        for _ in range(iters):
            self.send(_ready(), src, 0)
            if how == "broadcast":
                got = self.broadcast(None, groups=groups, src=(src, 0))
            else:
                got = self.recv(src, 0)
            ends.append(time.time())
            self._held = got
        return ends

    # -- rollout dict: rank 0 of a pair group sends to rank 1 -----------------------------

    def use_channel(self, name: str) -> bool:
        deadline = time.monotonic() + 60
        while True:
            try:
                self._channels[name] = self.connect_channel(name)
                return True
            except AssertionError:  # RLinf's "Worker group ... not found": not registered yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def roll_source(self, path: str, group: str, iters: int, channel: str = "") -> list[float]:
        """``path``: "send/recv", "channel" or "raw gloo". Returns the start stamps."""
        starts = []
        for _ in range(iters):
            self.recv(group, 1)
            starts.append(time.time())
            if path == "send/recv":
                self.send(self._payload, group, 1)
            elif path == "channel":
                self._channels[channel].put(self._payload, **self.channel_kwargs)
            else:
                for t in self._payload.values():
                    dist.send(t, 1)
        return starts

    def roll_receiver(self, path: str, group: str, iters: int, channel: str = "") -> list[float]:
        """The receiving half of :meth:`roll_source`; keeps each result until the next
        (raw Gloo receives into the preallocated payload)."""
        ends = []
        for _ in range(iters):
            self.send(_ready(), group, 0)
            if path == "send/recv":
                got = self.recv(group, 0)
            elif path == "channel":
                got = self._channels[channel].get(**self.channel_kwargs)
            else:
                for t in self._payload.values():
                    dist.recv(t, 0)
                got = self._payload
            ends.append(time.time())
            self._held = got
        return ends

    # -- raw torch.distributed Gloo over the same processes -------------------------------

    def free_endpoint(self) -> tuple[str, int]:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init_gloo(self, addr: str, port: int, rank: int, world: int, subgroups: list[int]) -> bool:
        """A default Gloo group over ``world`` processes, and one subgroup of ranks
        ``0..n`` for each ``n`` in ``subgroups`` (every member makes them all, in order)."""
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank,
                                    world_size=world, timeout=timedelta(seconds=WAIT_S))
        for n in subgroups:
            self._gloo_groups[n] = dist.new_group(list(range(n + 1)))
        return True

    def init_gloo_pair(self) -> bool:
        """The default Gloo group of a two-worker group (rlcomm set its env)."""
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=timedelta(seconds=WAIT_S))
        return True

    def gloo_broadcast(self, n: int, iters: int) -> list[float]:
        """Raw Gloo broadcast of the payload, tensor by tensor, from rank 0 to ranks
        1..n; receivers broadcast into their preallocated payload. Rank 0 returns start
        stamps, the others end stamps."""
        group = self._gloo_groups[n]
        stamps = []
        for _ in range(iters):
            dist.barrier(group=group)
            if dist.get_rank() == 0:
                stamps.append(time.time())
            for t in self._payload.values():
                dist.broadcast(t, 0, group=group)
            if dist.get_rank() != 0:
                stamps.append(time.time())
        return stamps

    def gloo_teardown(self) -> bool:
        if dist.is_initialized():
            dist.destroy_process_group()
        self._gloo_groups = {}
        return True

    # -- channel stream (used for RLinf; rlcomm's runs through bench_channel) -------------

    def stream_put(self, channel: str, kind: str, n: int, batch: int) -> float:
        item = stream_item(kind)
        ch = self._channels[channel]
        start = time.time()
        if batch == 1:
            for _ in range(n):
                ch.put(item, weight=1)
        else:
            put_windowed(lambda: ch.put(item, weight=1, async_op=True), n, batch)
        return start

    def stream_get(self, channel: str, n: int, batch: int) -> float:
        ch = self._channels[channel]
        got = 0
        while got < n:
            if batch == 1:
                ch.get()
                got += 1
            else:
                got += len(ch.get_batch(min(batch, n - got)))
        return time.time()


    # -- the same stream over plain send/recv: the reference a channel is held to ----------

    def p2p_stream_put(self, group: str, kind: str, n: int) -> float:
        """Send ``n`` items to rank 1 of ``group``, one at a time; the start stamp."""
        item = stream_item(kind)
        self.recv(group, 1)
        start = time.time()
        for _ in range(n):
            self.send(item, group, 1)
        return start

    def p2p_stream_get(self, group: str, n: int) -> float:
        """Receive ``n`` items from rank 0 of ``group``; the stamp when the last came."""
        self.send(_ready(), group, 0)
        for _ in range(n):
            self.recv(group, 0)
        return time.time()


def stream_item(kind: str) -> Any:
    """A channel-stream item: 1 KiB of bytes, or a 1 MiB float32 tensor (bench_channel's)."""
    return make_item(kind)


@ray.remote(num_cpus=0)
class RayFlowPeer:
    """A plain Ray actor for the Ray baselines: ``ray.put`` once, each receiver
    ``ray.get``s (zero-copy when the actor's runtime env sets
    ``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1``)."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self._payload: dict[str, torch.Tensor] | None = None
        self._held: Any = None

    def ping(self) -> bool:
        return True

    def make_payload(self, nbytes: int, ntensors: int) -> bool:
        self._payload = None
        self._payload = tensor_dict(nbytes, ntensors)
        return True

    def hold(self, refs: list[Any]) -> float:
        got = ray.get(refs[0], timeout=WAIT_S)
        stamp = time.time()
        self._held = got
        return stamp

    def push(self, peers: list[Any], iters: int) -> list[float]:
        """``iters`` times: put the payload, every peer gets it; seconds until the last
        peer held it, each time."""
        out = []
        for _ in range(iters):
            start = time.time()
            ref = ray.put(self._payload)
            ends = ray.get([p.hold.remote([ref]) for p in peers], timeout=WAIT_S)
            del ref
            out.append(max(ends) - start)
        return out

    def drop(self) -> bool:
        self._payload = self._held = None
        gc.collect()
        return True


@ray.remote(num_cpus=0)
class ZmqPeer:
    """pyzmq ipc PUSH/PULL, the floor under a channel stream (no broker, no ack)."""

    def __init__(self, address: str) -> None:
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context()
        self._address = address
        self._sock: Any = None

    def pull(self, n: int, batch: int) -> float:
        if self._sock is None:
            self._sock = self._ctx.socket(self._zmq.PULL)
            self._sock.setsockopt(self._zmq.RCVTIMEO, int(WAIT_S * 1000))
            self._sock.bind(self._address)
        got = 0
        while got < n:
            frames = self._sock.recv_multipart(copy=False)
            for f in frames:
                if len(f.buffer) >= 4096:
                    torch.frombuffer(f.buffer, dtype=torch.float32)
            got += len(frames)
        return time.time()

    def push(self, kind: str, n: int, batch: int) -> float:
        if self._sock is None:
            self._sock = self._ctx.socket(self._zmq.PUSH)
            self._sock.setsockopt(self._zmq.SNDTIMEO, int(WAIT_S * 1000))
            self._sock.connect(self._address)
        item = stream_item(kind)
        frame = item.numpy() if isinstance(item, torch.Tensor) else item
        start = time.time()
        for i in range(0, n, batch):
            self._sock.send_multipart([frame] * min(batch, n - i), copy=False)
        return start

    def close(self) -> bool:
        if self._sock is not None:
            self._sock.close(linger=0)
        self._ctx.term()
        if self._address.startswith("ipc://"):  # both ends close at once: either unlinks
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._address[6:])
        return True
