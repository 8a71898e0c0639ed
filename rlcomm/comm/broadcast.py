"""Broadcast groups: one lazily created Gloo (and, for CUDA payloads, NCCL) process
group per distinct ordered set of participating workers."""

from __future__ import annotations

import concurrent.futures
import datetime
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from rlcomm.comm import codec, framing
from rlcomm.comm.store import sub_store
from rlcomm.comm.transports.base import FRAME_BYTES, fixed_frames, frame_rest
from rlcomm.comm.transports.gloo import FOREVER, classify_error, new_gloo_group
from rlcomm.worker.address import WorkerAddress, normalize_rank

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
    """A process group over ``members``; this process is ``members[index]``.

    Broadcasts on one group run one at a time, in call order (its own thread for async
    calls), so every member sees the same sequence. Its Gloo sockets bind to ``host``
    (this node's IP; ``None``: Gloo's own choice, see ``new_gloo_group``).
    """

    def __init__(
        self, connect_store: Callable[[], dist.Store], members: list[WorkerAddress], index: int,
        host: str | None = None,
    ):
        self.members = members
        self._host = host
        self.index = index
        self._connect_store = connect_store
        self._store: dist.Store | None = None
        self._label = f"broadcast group {[str(m) for m in members]}"
        self._pg: Any = None
        self._nccl: Any = None
        self._lock = threading.Lock()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "rlcomm-bcast")

    def submit(self, obj: Any, src: int, timeout: float) -> concurrent.futures.Future:
        return self._executor.submit(self.broadcast, obj, src, timeout)

    def _run(self, pg: Any, tensors: list[torch.Tensor], src: int, timeout: float) -> None:
        try:
            works = [pg.broadcast(t, src) for t in tensors]
            for work in works:
                work.wait(datetime.timedelta(seconds=timeout) if timeout else FOREVER)
        except RuntimeError as exc:
            raise classify_error(exc, "broadcast", self._label) from exc

    def _nccl_group(self, device: torch.device, timeout: float) -> Any:
        if self._nccl is None:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = datetime.timedelta(seconds=timeout)
            self._nccl = dist.ProcessGroupNCCL(
                sub_store(self._store, "nccl"), self.index, len(self.members), opts
            )
        return self._nccl

    def _connect(self, timeout: float) -> None:
        """Create the Gloo group on first use (every member must reach this)."""
        self._store = self._connect_store()
        try:
            self._pg = new_gloo_group(
                self._store, self.index, len(self.members), datetime.timedelta(seconds=timeout),
                self._host,
            )
        except RuntimeError as exc:
            raise classify_error(exc, "broadcast rendezvous", self._label) from exc

    def broadcast(self, obj: Any, src: int, timeout: float) -> Any:
        """Send ``obj`` from member ``src`` to all; every member returns the object."""
        with self._lock:
            if self._pg is None:
                self._connect(timeout)
            if self.index == src:
                header, tensors = codec.encode(obj)
                frame, payload = framing.pack(header, tensors)
                frames = fixed_frames(frame)
                on_cuda = bool(tensors) and tensors[0].is_cuda
                self._run(self._pg, [*frames, *([] if on_cuda else payload)], src, timeout)
                if on_cuda:
                    self._broadcast_cuda(payload, src, timeout)
                return obj
            first = torch.empty(FRAME_BYTES, dtype=torch.uint8)
            self._run(self._pg, [first], src, timeout)
            frame, rest = frame_rest(first)
            if rest:
                more = torch.empty(rest, dtype=torch.uint8)
                self._run(self._pg, [more], src, timeout)
                frame += more.numpy().tobytes()
            header, inline = framing.unpack(frame)
            metas = header.tensors
            if header.inline or not metas:
                tensors = framing.split_inline(header, inline)
            elif metas[0].device.startswith("cuda"):
                device = torch.device("cuda", torch.cuda.current_device())
                tensors = [codec.empty_like_meta(m, device) for m in metas]
                self._broadcast_cuda(tensors, src, timeout)
            else:
                tensors = [codec.empty_like_meta(m, torch.device("cpu")) for m in metas]
                self._run(
                    self._pg, [codec.as_bytes(t) for t in tensors if t.numel()], src, timeout
                )
            return codec.decode(header, tensors)

    def _broadcast_cuda(self, tensors: list[torch.Tensor], src: int, timeout: float) -> None:
        device = tensors[0].device
        with torch.cuda.device(device):
            self._run(self._nccl_group(device, timeout), tensors, src, timeout)
            torch.cuda.current_stream().synchronize()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

