"""Broadcast groups: one per distinct ordered set of participating workers.

A broadcast from member ``src`` splits its members in two, alike on every member:

- *local* receivers, on the source's node (where shared memory works): the source
  encodes the object once, copies its tensors once into a pooled shared-memory slot and
  hands the slot to each of them (:mod:`~rlcomm.comm.transports.shm_fanout`); each maps
  it copy-on-write and decodes zero-copy views. The slot goes back to the source's pool
  when every local receiver has freed its views. CUDA tensors are planned by GPU
  (:mod:`~rlcomm.comm.broadcast_device`): a receiver that sees the source's GPU copies
  them straight from the source's memory on the device, one copy, never through host
  memory; the others get them through a slot.
- *remote* receivers, on other nodes: one of them per node is that node's *relay* (the
  first member there, in member order). The payload crosses the network once per node,
  over a Gloo process group of the source and the relays (NCCL for CUDA payloads), made
  on first use; each relay then hands it to its node-mates as the source does to its
  own (a shared-memory fan-out, one copy). So a broadcast to ``n`` nodes of ``k``
  members each costs ``n - 1`` network transfers and one local copy per node, whatever
  ``k``.

Broadcasts on one group run one at a time, in call order (one thread for async calls),
so every member sees the same sequence. Each source numbers its messages, so a receiver
that timed out on a broadcast skips that message when it arrives late.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from rlcomm.comm import codec, framing
from rlcomm.comm.broadcast_device import SETUP, DeviceFanout
from rlcomm.comm.broadcast_gloo import GlooBroadcast
from rlcomm.comm.identity.address import WorkerAddress, normalize_rank
from rlcomm.comm.options import max_message_bytes
from rlcomm.comm.store import sub_store
from rlcomm.comm.transports import registry
from rlcomm.comm.transports.shm_fanout import FanoutSource
from rlcomm.comm.transports.shm_fanout_sink import FanoutSink
from rlcomm.errors import (
    CodecError,
    CommError,
    CommTimeoutError,
    OptionsMismatchError,
    PeerLostError,
    ProtocolMismatchError,
)

GroupsSpec = Sequence[tuple[str, Any]]


def expand_groups(groups: GroupsSpec) -> list[WorkerAddress]:
    """The ordered, duplicate-free member list of a ``groups`` argument.

    Each entry is ``(group_name, ranks)`` where ranks is an int, a list of ints, a tuple
    (one rank path) or a list of tuples (several rank paths).

    Raises:
        ValueError: on an empty spec, a malformed entry, or a worker listed twice.
    """
    if not groups:
        raise ValueError("broadcast: groups must list at least one (group_name, ranks) entry")
    members: list[WorkerAddress] = []
    for entry in groups:
        if not isinstance(entry, (tuple, list)) or len(entry) != 2:
            raise ValueError(f"broadcast: each groups entry is (group_name, ranks), got {entry!r}")
        name, ranks = entry
        if isinstance(ranks, int) or isinstance(ranks, tuple):
            items = [ranks]
        elif isinstance(ranks, list):
            items = ranks
        else:
            raise ValueError(f"broadcast: bad ranks {ranks!r} for group {name!r}")
        members.extend(WorkerAddress(name, normalize_rank(r)) for r in items)
    if len(set(members)) != len(members):
        raise ValueError(f"broadcast: a worker is listed twice in {[str(m) for m in members]}")
    return members


class BroadcastGroup:
    """The broadcasts among ``members``; this process is ``members[index]``.

    Args:
        connect_store: ``connect_store(indices)`` makes an authenticated store shared by
            the members at those indices (the same one on each of them).
        members: the ordered member list.
        index: this process's place in it.
        nodes: each member's node (members with equal entries share memory).
        pids: each member's process id (checked on the shared-memory sockets).
        host: this node's IP, for Gloo sockets.
    """

    def __init__(
        self, connect_store: Callable[[tuple[int, ...]], dist.Store],
        members: list[WorkerAddress], index: int, nodes: Sequence[Any], pids: Sequence[int],
        host: str | None = None,
    ):
        self.members = members
        self.index = index
        self._nodes = list(nodes)
        self._pids = list(pids)
        self._host = host
        self._connect_store = connect_store
        self._label = f"broadcast group {[str(m) for m in members]}"
        self._lock = threading.Lock()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "rlcomm-bcast")
        self._store: dist.Store | None = None  # of all members: the fan-out sockets' names
        self._gloo: dict[tuple[int, ...], GlooBroadcast] = {}
        self._source: FanoutSource | None = None  # this member's, as a source
        self._source_waited = False  # its first broadcast waited for every receiver
        self._seq_out = 0
        self._sinks: dict[int, FanoutSink] = {}  # by source index
        self._seq_in: dict[int, int] = {}
        self._device = DeviceFanout(self._group_store, index, self._pids,
                                    [str(m) for m in members])

    @staticmethod
    def _shared_copy() -> bool:
        """Whether members on one node share one copy: the registry's transport for a
        same-node pair is shared memory (what the fan-out needs)."""
        try:
            return registry.select(registry.PairFacts(same_node=True)).memory_only
        except OptionsMismatchError:
            return False

    def plan(self, src: int) -> tuple[list[int], list[int]]:
        """The local and remote receivers of a broadcast from ``src``."""
        others = [i for i in range(len(self.members)) if i != src]
        if not self._shared_copy():
            return [], others
        local = [i for i in others if self._nodes[i] == self._nodes[src]]
        return local, [i for i in others if i not in local]

    def relays(self, src: int) -> dict[int, list[int]]:
        """The relay of each other node of a broadcast from ``src``, and the members it
        hands the payload to (every member is its own relay without shared memory)."""
        _, remote = self.plan(src)
        if not self._shared_copy():
            return {i: [] for i in remote}
        by_node: dict[Any, list[int]] = {}
        for i in remote:
            by_node.setdefault(self._nodes[i], []).append(i)
        return {ids[0]: ids[1:] for ids in by_node.values()}

    @property
    def pool_bytes(self) -> int:
        """Shared memory this member holds as a broadcast source."""
        return 0 if self._source is None else self._source.pool_bytes

    def submit(
        self, obj: Any, src: int, timeout: float, into: Any = None,
        cuda: tuple[torch.device, Any] | None = None, host_wait: bool = False,
    ) -> concurrent.futures.Future:
        """Run :meth:`broadcast` on the group's thread (in call order). ``cuda``: the
        caller's CUDA device and stream, which the broadcast's CUDA work is ordered on."""
        if cuda is None:
            return self._executor.submit(self.broadcast, obj, src, timeout, into)

        def on_callers_stream() -> Any:
            with torch.cuda.device(cuda[0]), torch.cuda.stream(cuda[1]):
                return self.broadcast(obj, src, timeout, into, host_wait)

        return self._executor.submit(on_callers_stream)

    def broadcast(
        self, obj: Any, src: int, timeout: float, into: Any = None, host_wait: bool = False
    ) -> Any:
        """Send ``obj`` from member ``src`` to all; every member returns the object (a
        receiver given ``into`` gets the tensors copied into it, and returns it).
        ``host_wait``: a source of CUDA tensors returns once every receiver's copy of them
        is done, not only ordered on its current stream."""
        deadline = time.monotonic() + timeout
        local, _ = self.plan(src)
        relays = self.relays(src)
        with self._lock:
            if self.index == src:
                self._send(obj, local, list(relays), deadline, timeout, host_wait)
                return obj
            if self.index in local:
                return self._recv_local(src, deadline, into)
            if self.index in relays:
                got = self._recv_remote(src, list(relays), timeout)
                if relays[self.index]:
                    self._send(got, relays[self.index], [], deadline, timeout)
                return got if into is None else self._fill(got, into, src)
            relay = next(r for r, mates in relays.items() if self.index in mates)
            return self._recv_local(relay, deadline, into)

    def _fill(self, got: Any, into: Any, src: int) -> Any:
        """``into`` with the tensors of the received object ``got`` copied in."""
        header, tensors = codec.encode(got)
        for target, tensor in zip(self._targets(header, into, src), tensors, strict=True):
            target.copy_(tensor)
        return into

    def _targets(self, header: Any, into: Any, src: int) -> list[torch.Tensor]:
        try:
            return codec.destinations(header, into)
        except CodecError as exc:
            raise ProtocolMismatchError(
                f"broadcast at {self.members[self.index]} from {self.members[src]} into the "
                f"given tensors: {exc}", peer=self.members[src], op="broadcast",
            ) from exc

    def _next_seq(self) -> int:
        seq = self._seq_out
        self._seq_out += 1
        return seq

    # -- the source ------------------------------------------------------------------------

    def _send(
        self, obj: Any, local: list[int], relays: list[int], deadline: float, timeout: float,
        host_wait: bool = False,
    ) -> None:
        """Hand ``obj`` to this node's ``local`` members (shared memory, or the device for
        CUDA tensors) and to the ``relays`` of other nodes (one Gloo transfer each)."""
        header, tensors = codec.encode(obj)
        frame, payload = framing.pack(header, tensors)
        failures: dict[int, Exception] = {}
        if local:
            on_cuda = bool(payload) and payload[0].is_cuda
            source = self._fanout_source(local, deadline)
            if on_cuda:
                order = torch.cuda.current_stream(payload[0].device)
                failures.update(self._device.send(
                    frame, [t for t in tensors if t.numel()], local, source, self._next_seq,
                    order, deadline, host_wait,
                ))
            else:
                failures.update(source.publish(self._next_seq(), frame, payload, deadline))
            for member in source.missing():
                failures.setdefault(member, CommTimeoutError(
                    f"{self._label}: {self.members[member]} did not join within {timeout}s",
                    peer=self.members[member], op="broadcast",
                ))
        if relays:
            self._gloo_group((self.index, *relays)).send(frame, payload, 0, timeout)
        if failures:
            names = ", ".join(f"{self.members[m]} ({exc})" for m, exc in sorted(failures.items()))
            kind = PeerLostError if any(
                isinstance(e, PeerLostError) for e in failures.values()
            ) else CommTimeoutError
            raise kind(
                f"broadcast from {self.members[self.index]}: the other members got it, but not "
                f"{names}",
                peer=self.members[min(failures)] if len(failures) == 1 else None,
                op="broadcast",
            )

    def _fanout_source(self, local: list[int], deadline: float) -> FanoutSource:
        if self._source is None:
            source = FanoutSource({m: self._pids[m] for m in local}, self._label)
            try:
                self._group_store().set(f"fanout/{self.index}", source.name.encode())
            except BaseException:
                source.close()
                raise
            self._source = source
        # The first broadcast waits for every local receiver to connect (as a Gloo
        # rendezvous would); later ones take whoever came meanwhile and go on.
        self._source.accept(deadline if not self._source_waited else time.monotonic())
        self._source_waited = True
        return self._source

    # -- receivers ---------------------------------------------------------------------------

    def _recv_local(self, src: int, deadline: float, into: Any = None) -> Any:
        sink = self._sink(src, deadline)
        while True:
            msg = self._next_message(sink, src, deadline)
            header, inline, offer = framing.unpack(msg.frame)
            if not offer.startswith(SETUP):
                break
            self._device.set_up(src, offer, deadline)  # then the broadcast's own message
        metas = header.tensors
        sizes = [m.nbytes for m in metas if m.nbytes]
        if sum(sizes) > max_message_bytes():
            if offer:
                self._device.refuse(src, offer, "over the receiver's RLCOMM_MAX_MESSAGE_BYTES")
            raise ProtocolMismatchError(
                f"a broadcast from {self.members[src]} declares {sum(sizes)} bytes, over this "
                f"worker's limit of {max_message_bytes()} (RLCOMM_MAX_MESSAGE_BYTES)"
            )
        try:
            targets = None if into is None else self._targets(header, into, src)
        except ProtocolMismatchError as exc:
            if offer:
                self._device.refuse(src, offer, f"the receiver's tensors do not fit: {exc}")
            raise
        if header.inline or not metas:
            tensors = framing.split_inline(header, inline)
        elif offer:
            tensors = self._device_tensors(src, header, offer, targets)
        else:
            tensors = framing.tensors_from_payload(header, msg.payload(sizes))
            if metas[0].device.startswith("cuda") and targets is None:
                device = torch.device("cuda", torch.cuda.current_device())
                tensors = [t.to(device) for t in tensors]
        if targets is None:
            return codec.decode(header, tensors)
        if tensors is not targets:
            for target, tensor in zip(targets, tensors, strict=True):
                target.copy_(tensor)
        return into

    def _device_tensors(
        self, src: int, header: Any, offer: bytes, targets: list[torch.Tensor] | None
    ) -> list[torch.Tensor]:
        """The CUDA tensors a source offered: copied on the device into ``targets`` (when
        they lie on a GPU) or into new tensors on this thread's device."""
        device = torch.device("cuda", torch.cuda.current_device())
        direct = targets is not None and all(t.is_cuda and t.is_contiguous() for t in targets)
        sizes = [m.nbytes for m in header.tensors]
        order = torch.cuda.current_stream(targets[0].device if direct else device)  # type: ignore[index]
        try:
            buffers = self._device.receive(src, offer, sizes, targets if direct else None,
                                           device, order)
        except CommError as exc:
            raise type(exc)(
                f"broadcast at {self.members[self.index]} from {self.members[src]}: {exc}",
                peer=self.members[src], op="broadcast",
            ) from exc
        return targets if direct else framing.tensors_from_payload(header, buffers, device)  # type: ignore[return-value]

    def _next_message(self, sink: FanoutSink, src: int, deadline: float) -> Any:
        """The next message from ``src`` (older ones are late messages of broadcasts that
        timed out here: skipped)."""
        expected = self._seq_in.get(src, 0)
        while True:
            try:
                msg = sink.recv(deadline)
            except CommError as exc:
                if isinstance(exc, PeerLostError):
                    self._drop_sink(src)
                raise type(exc)(
                    f"broadcast at {self.members[self.index]} from {self.members[src]}: {exc}",
                    peer=self.members[src], op="broadcast",
                ) from exc
            if msg.seq >= expected:
                self._seq_in[src] = msg.seq + 1
                return msg

    def _sink(self, src: int, deadline: float) -> FanoutSink:
        sink = self._sinks.get(src)
        if sink is None:
            store = self._group_store()
            key = f"fanout/{src}"
            store.wait([key], datetime.timedelta(seconds=max(0.01, deadline - time.monotonic())))
            sink = FanoutSink(
                store.get(key).decode(), self.index, self._pids[src], deadline,
                f"broadcast from {self.members[src]}",
            )
            self._sinks[src] = sink
        return sink

    def _drop_sink(self, src: int) -> None:
        sink = self._sinks.pop(src, None)
        if sink is not None:
            sink.close()

    def _recv_remote(self, src: int, relays: list[int], timeout: float) -> Any:
        gloo = self._gloo_group((src, *relays))
        header, tensors = gloo.recv(0, timeout)
        return codec.decode(header, tensors)

    # -- stores and Gloo groups ----------------------------------------------------------------

    def _group_store(self) -> dist.Store:
        if self._store is None:
            self._store = self._connect_store(tuple(range(len(self.members))))
        return self._store

    def _gloo_group(self, indices: tuple[int, ...]) -> GlooBroadcast:
        group = self._gloo.get(indices)
        if group is None:
            label = f"broadcast group {[str(self.members[i]) for i in indices]}"
            group = GlooBroadcast(
                lambda: sub_store(self._connect_store(indices), "gloo"), indices.index(self.index), len(indices),
                label, self._host,
            )
            self._gloo[indices] = group
        return group

    def close(self) -> None:
        """Stop taking broadcasts and free the shared memory (not under the group's lock:
        a broadcast in flight may hold it until its deadline)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._device.close()
        source, self._source = self._source, None
        if source is not None:
            source.close()
        for src in list(self._sinks):
            self._drop_sink(src)
