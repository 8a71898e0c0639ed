"""The device path of a broadcast: a CUDA payload to the members on the source's node,
planned by GPU.

A member that can see the source's GPU (the same GPU, or another of the node that its
process sees, where CUDA IPC between the two works) copies the payload straight out of
the source's tensors into its own, on the GPU: one device copy per receiver, nothing
through host memory. The source *lends* its tensors to each such member over a CUDA IPC
link of that pair (:mod:`~rlcomm.comm.transports.cuda_ipc`), and carries each member's
offer in a message of its own on the node's shared-memory fan-out. Members that cannot
see the GPU get a host copy over the fan-out, as CPU payloads do.

Which members see the source's GPU is learnt once per source and GPU: the first CUDA
broadcast sends those not known yet a *set-up* message (the GPU's UUID and a link
generation); each answers in the group's store whether it sees that GPU and, if it does,
makes its end of the link. Each broadcast then costs one fan-out message per member.

The source returns once every member took the payload: its current stream is then
ordered after their copies (an ``async_op`` broadcast's host waits for them), so writing
the tensors afterwards on that stream is safe.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from rlcomm.comm import codec
from rlcomm.comm.store.client import sub_store
from rlcomm.comm.transports import registry
from rlcomm.comm.transports.base import OneSidedTransport
from rlcomm.comm.transports.cuda_device import CUDA, DeviceOps
from rlcomm.comm.transports.registry import PairFacts, TransportSetup
from rlcomm.comm.transports.shm_fanout import FanoutSource
from rlcomm.errors import CommError, CommTimeoutError, PeerLostError, ProtocolMismatchError

logger = logging.getLogger(__name__)

#: The first bytes of a set-up message's offer part (what follows is a :class:`Setup`).
SETUP = b"\x00rlcomm-setup:"


class Setup(msgspec.Struct, array_like=True, frozen=True):
    """A set-up message's content: the source's GPU and the generation of the links."""

    gpu: str
    generation: int


_encode_setup = msgspec.msgpack.Encoder().encode
_decode_setup = msgspec.msgpack.Decoder(Setup).decode


def plan_by_gpu(
    local: Sequence[int], sees: dict[int, bool | None]
) -> tuple[list[int], list[int], list[int]]:
    """The members on the source's node split by what they see of its GPU: those to set
    up first (not known yet), those that copy on the device, those that get host memory."""
    unknown = [m for m in local if sees.get(m) is None]
    device = [m for m in local if sees.get(m) is True]
    host = [m for m in local if sees.get(m) is False]
    return unknown, device, host


class DeviceFanout:
    """The device path of one broadcast group's member (see the module docstring).

    Args:
        store: the group's store (the set-up answers, the links' rendezvous).
        index: this member's place in the group.
        pids: each member's process id (the links accept no other process).
        names: each member's name, for messages.
        ops: the device layer.
    """

    def __init__(
        self, store: Callable[[], dist.Store], index: int, pids: Sequence[int],
        names: Sequence[str], ops: DeviceOps = CUDA,
    ):
        self._store = store
        self.index = index
        self._pids = list(pids)
        self._names = list(names)
        self._ops = ops
        self._sees: dict[tuple[int, str], bool] = {}  # (member, GPU) -> it sees that GPU
        self._links: dict[tuple[int, int], OneSidedTransport] = {}  # (src, other) -> link
        self._generation: dict[int, int] = {}  # member -> the generation of our link
        self._announced: set[str] = set()

    # -- links ---------------------------------------------------------------------------

    def _link(
        self, src: int, other: int, generation: int, device: torch.device, deadline: float,
    ) -> OneSidedTransport:
        """This end of the link between source ``src`` and member ``other`` (made once
        per generation; both ends make it at once)."""
        key = (src, other)
        link = self._links.get(key)
        if link is not None:
            return link
        spec = registry.select(PairFacts(same_node=True, same_gpu=True), registry.CUDA)
        peer = other if self.index == src else src
        store = sub_store(self._store(), f"ipc/{src}/{other if self.index == src else self.index}/{generation}")
        made = spec.factory(TransportSetup(
            store, 0 if self.index == src else 1, max(0.01, deadline - time.monotonic()),
            self._names[peer], peer_pid=self._pids[peer], device=device,
        ))
        link = made.as_one_sided()
        if link is None:
            raise ProtocolMismatchError(f"broadcast: {spec.name} cannot carry a device fan-out")
        self._links[key] = link
        return link

    def _drop(self, key: tuple[int, int], lost: bool) -> None:
        link = self._links.pop(key, None)
        if link is not None:
            link.close(lost=lost)
            if key[0] == self.index:  # a source's link: set the member up anew next time
                self._sees = {k: v for k, v in self._sees.items() if k[0] != key[1]}

    # -- the source -------------------------------------------------------------------------

    def send(
        self, frame: bytes, payload: list[torch.Tensor], local: list[int], fanout: FanoutSource,
        next_seq: Callable[[], int], order: Any, deadline: float, host_wait: bool,
    ) -> dict[int, Exception]:
        """Hand the CUDA ``payload`` of a broadcast (its ``frame``) to the ``local``
        members through ``fanout``: on the device to those that see this GPU, a host
        copy to the others. Returns the failures by member."""
        ops = self._ops
        device = payload[0].device
        gpu = ops.gpu_uuid(device)
        failures: dict[int, Exception] = {}
        sees = {m: self._sees.get((m, gpu)) for m in local}
        unknown, _, _ = plan_by_gpu(local, sees)
        if unknown:
            self._set_up(frame, gpu, unknown, fanout, next_seq(), deadline, sees, failures)
        _, on_device, on_host = plan_by_gpu([m for m in local if m not in failures], sees)
        offers = {}
        for member in on_device:
            try:
                link = self._link(self.index, member, self._generation.get(member, 0), device, deadline)
                offers[member] = (link, link.offer(payload, order, deadline, lend=True))
            except CommError as exc:
                failures[member] = exc
                self._drop((self.index, member), isinstance(exc, PeerLostError))
        seq = next_seq()
        for member, (_, out) in offers.items():
            failures.update(fanout.publish(seq, frame + out.offer, [], deadline, only=(member,)))
        if on_host:
            host = [codec.as_bytes(t).cpu() for t in payload if t.numel()]
            failures.update(fanout.publish(seq, frame, host, deadline, only=on_host))
        for member, (link, out) in offers.items():
            if member in failures:
                link.withdraw(out)
                continue
            try:
                link.complete(out, order, deadline, host=host_wait)
            except CommError as exc:
                failures[member] = exc
                if not link.usable:  # a refusal keeps the link in step
                    self._drop((self.index, member), isinstance(exc, PeerLostError))
        return failures

    def _set_up(
        self, frame: bytes, gpu: str, members: list[int], fanout: FanoutSource, seq: int,
        deadline: float, sees: dict[int, bool | None], failures: dict[int, Exception],
    ) -> None:
        """Ask ``members`` whether they see ``gpu`` (a set-up message each, with a new
        link generation), and wait for their answers in the store."""
        store = self._store()
        for member in members:
            generation = self._generation.get(member, -1) + 1
            self._generation[member] = generation
            self._drop((self.index, member), False)
            note = SETUP + _encode_setup(Setup(gpu, generation))
            failures.update(fanout.publish(seq, frame + note, [], deadline, only=(member,)))
        for member in members:
            if member in failures:
                continue
            key = f"sees/{self.index}/{member}/{self._generation[member]}"
            try:
                store.wait([key], datetime.timedelta(seconds=max(0.01, deadline - time.monotonic())))
                answer = store.get(key) == b"1"
            except (RuntimeError, CommError) as exc:
                failures[member] = CommTimeoutError(
                    f"broadcast from {self._names[self.index]}: {self._names[member]} did not "
                    f"say in time whether it sees GPU {gpu} ({exc})",
                    peer=self._names[member], op="broadcast",
                )
                continue
            sees[member] = self._sees[(member, gpu)] = answer

    # -- a receiver -------------------------------------------------------------------------

    def set_up(self, src: int, note: bytes, deadline: float) -> None:
        """Answer a set-up message from ``src``: whether this process sees its GPU, and,
        if it does, make this end of the link."""
        try:
            setup = _decode_setup(note[len(SETUP):])
        except (msgspec.DecodeError, ValueError) as exc:
            raise ProtocolMismatchError(
                f"broadcast from {self._names[src]}: a malformed set-up message ({exc})"
            ) from exc
        local = self._ops.local_gpus().get(setup.gpu)
        self._store().set(f"sees/{src}/{self.index}/{setup.generation}",
                          b"0" if local is None else b"1")
        self._drop((src, self.index), False)
        if local is not None:
            self._link(src, self.index, setup.generation, self._ops.device(local), deadline)

    def receive(
        self, src: int, offer: bytes, sizes: list[int], targets: list[torch.Tensor] | None,
        device: torch.device | None, order: Any,
    ) -> list[torch.Tensor]:
        """Copy the payload ``src`` offered (tensors of ``sizes`` bytes) into ``targets``
        (on the device, contiguous) or new tensors on ``device``; returns the buffers."""
        link = self._links.get((src, self.index))
        if link is None:
            raise ProtocolMismatchError(
                f"broadcast from {self._names[src]}: an offer came before its set-up"
            )
        try:
            return link.accept(offer, sizes, targets, device, order)
        except CommError as exc:
            if not link.usable:
                self._drop((src, self.index), isinstance(exc, PeerLostError))
            raise

    def refuse(self, src: int, offer: bytes, reason: str) -> None:
        """Turn down the payload ``src`` offered (its send then raises ``reason``)."""
        link = self._links.get((src, self.index))
        if link is not None:
            link.refuse(offer, reason)

    def close(self) -> None:
        for key in list(self._links):
            self._drop(key, False)
