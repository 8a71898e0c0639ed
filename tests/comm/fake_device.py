"""A device layer on CPU memory, for testing the CUDA IPC protocols without a GPU.

It keeps :class:`~rlcomm.comm.transports.cuda_device.DeviceOps`' contract with CPU
tensors as "device memory": sharing registers a storage under a fresh handle in a table
common to every :class:`FakeDevice` of the process (the "driver"), opening looks it up,
streams and events only count what is done to them, copies are real copies. Two
transports of one process, each with its own ``FakeDevice``, stand for two processes.

It also keeps torch's reference counting of shared memory: a share's counter starts at
one, the receiver's close of what it opened takes it down, and :meth:`release` does on
behalf of a dead receiver; :meth:`held` lists the shares still counted.
"""

from __future__ import annotations

import itertools
import threading
import uuid
import weakref
from typing import Any

import torch

from rlcomm.comm.transports.cuda_device import DeviceOps, Share

_lock = threading.Lock()
_memory: dict[bytes, torch.Tensor] = {}  # handle -> the shared storage, as uint8
_counters: dict[tuple[bytes, int], int] = {}
_events: dict[bytes, FakeEvent] = {}
_offsets = itertools.count()


class FakeStream:
    def __init__(self, name: str):
        self.name = name
        self.waits = 0

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class FakeEvent:
    def __init__(self) -> None:
        self.records = 0
        self.waited = 0


class FakeDevice(DeviceOps):
    """One "process"'s view of a fake GPU (see the module docstring).

    Args:
        gpu: the UUID of the GPU this process uses.
        visible: the UUIDs it can see (default: ``gpu`` only).
    """

    name = "fake"

    def __init__(self, gpu: str = "GPU-fake", visible: tuple[str, ...] | None = None):
        self.gpu = gpu
        self.visible = {u: i for i, u in enumerate(visible or (gpu,))}
        self.default = FakeStream("default")
        self.copies = 0  # copy launches (one batched copy counts once)
        self.copied = 0  # bytes copied
        self.shares = 0
        self.opened = 0  # live opened storages
        self.allocated = 0  # bytes of new tensors made by empty()

    # -- what a process sees ------------------------------------------------------------

    def is_device(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu"

    def gpu_uuid(self, device: torch.device) -> str:
        return self.gpu

    def local_gpus(self) -> dict[str, int]:
        return dict(self.visible)

    def device(self, index: int) -> torch.device:
        return torch.device("cpu")

    # -- streams and events -------------------------------------------------------------

    def new_stream(self, device: torch.device) -> FakeStream:
        return FakeStream("own")

    def current_stream(self, device: torch.device) -> FakeStream:
        return self.default

    def new_event(self) -> FakeEvent:
        return FakeEvent()

    def new_ipc_event(self, device: torch.device) -> tuple[FakeEvent, bytes]:
        event, handle = FakeEvent(), uuid.uuid4().bytes * 4
        with _lock:
            _events[handle] = event
        return event, handle

    def open_ipc_event(self, handle: bytes, device: torch.device) -> FakeEvent:
        with _lock:
            return _events[handle]

    def record(self, event: Any, stream: Any) -> None:
        event.records += 1

    def wait_event(self, stream: Any, event: Any) -> None:
        if stream is not None:
            stream.waits += 1
            event.waited += 1

    def wait_stream(self, stream: Any, other: Any) -> None:
        if stream is not None and other is not None:
            stream.waits += 1

    def synchronize(self, event: Any) -> None:
        event.waited += 1

    # -- memory ---------------------------------------------------------------------------

    def share(self, t: torch.Tensor) -> Share:
        storage = t.untyped_storage()
        whole = torch.empty(0, dtype=torch.uint8).set_(storage)
        handle = uuid.uuid4().bytes * 4
        key = (b"/fake_counters", next(_offsets))
        with _lock:
            _memory[handle] = whole
            _counters[key] = 1
        self.shares += 1
        return Share(handle, storage.nbytes(), 0, *key)

    def open(self, share: Share, device: torch.device) -> torch.Tensor:
        with _lock:
            whole = _memory[share.handle]
        # A view of its own: its death is the receiver's close.
        view = whole[share.offset : share.offset + share.nbytes].view(torch.uint8)
        self.opened += 1
        weakref.finalize(view, self._closed, (share.ref_counter, share.ref_counter_offset))
        return view

    def _closed(self, key: tuple[bytes, int]) -> None:
        self.opened -= 1
        with _lock:
            if key in _counters:
                _counters[key] -= 1

    def release(self, share: Share) -> None:
        with _lock:
            key = (share.ref_counter, share.ref_counter_offset)
            if key in _counters:  # collected already: nothing holds it
                _counters[key] -= 1

    def collect(self) -> None:
        with _lock:
            for key in [k for k, n in _counters.items() if n <= 0]:
                del _counters[key]

    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        self.allocated += nbytes
        return torch.empty(nbytes, dtype=torch.uint8)

    def keep_until_done(self, tensors: list[torch.Tensor], stream: Any) -> None:
        pass  # the fake's copies are done when copy() returns

    def copy(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], stream: Any) -> None:
        self.copies += 1
        for dst, src in zip(dsts, srcs, strict=True):
            dst.copy_(src)
            self.copied += src.numel()


def held(share: Share) -> int:
    """The counter of ``share`` now (0 once released or collected)."""
    with _lock:
        return _counters.get((share.ref_counter, share.ref_counter_offset), 0)
