"""A device layer on CPU memory that behaves like CUDA where ordering bugs hide, for
testing the CUDA IPC protocols without a GPU.

It keeps :class:`~rlcomm.comm.transports.cuda_device.DeviceOps`' contract; each
:class:`FakeDevice` stands for one process's view of a GPU, and two transports of this
process, each with its own ``FakeDevice``, stand for two processes. What it shares with
CUDA, so that a missing wait or a missing ``record_stream`` corrupts data here as on a GPU:

- **Streams run asynchronously.** Work queued on a stream runs later, in order, on a
  thread of the stream's own, each operation after ``latency`` seconds (a device busy
  with earlier work). The host goes on at once.
- **Events.** A record is queued on a stream and happens when the stream gets to it. A
  stream's wait on an event waits for the record last queued before the wait was asked
  (``cudaStreamWaitEvent``); an event never recorded is no wait at all. Interprocess
  events are found by handle from every ``FakeDevice``. Events made are counted
  (:attr:`FakeDevice.events_made`).
- **A caching allocator.** :meth:`FakeDevice.empty` carves blocks out of *segments*; a
  block freed goes back to the pool of the stream it was allocated on, and the next
  allocation of its size on that stream gets it at once (last freed, first out). A block
  also used on other streams (:meth:`keep_until_done`, torch's ``record_stream``) comes
  back only once the work queued on them when it was freed is done. A block shared with
  a receiver that still holds it is kept aside (torch's *limbo*) until the receiver lets
  go and :meth:`collect` runs. Queued work does not keep memory alive, as a kernel does
  not: it reads and writes the segment's bytes.
- **IPC handles name a segment and an offset.** A share names the segment the storage
  lies in and where in it; every ``FakeDevice`` opens the same memory, at the same
  addresses (one address space: an address says nothing about who owns the memory).
- **Closing what was opened synchronizes**: dropping the last view of an opened share
  waits on the host for this device's current stream, as torch's close path does, and
  counts it (:attr:`FakeDevice.closes`).

Tensors a test makes itself with ``torch`` stand for device memory outside the
allocator (never reused while alive). Writes and reads that a test means as kernels go
through :meth:`FakeDevice.launch` and :meth:`FakeDevice.read`. Anything that went wrong
on a stream's thread (a wait past its deadline, an exception) is kept in
:attr:`FakeDevice.errors`.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from rlcomm.comm.transports.cuda_device import DeviceOps, Share

#: How long queued work waits on an event or a stream before it is reported and skipped.
WAIT_LIMIT = 20.0
#: A stream's thread ends after this many idle seconds (the next work starts another).
_IDLE_END = 0.5
#: Blocks are multiples of this many bytes; segments hold at least this many.
_ROUND, _SEGMENT = 512, 1 << 20

_lock = threading.RLock()  # a finalizer may run wherever a reference drops
_memory: dict[bytes, torch.Tensor] = {}  # handle -> the segment, as uint8
_segments: list[_Segment] = []  # every FakeDevice's, by address
_addresses: list[int] = []
_counters: dict[tuple[bytes, int], int] = {}
_events: dict[bytes, FakeEvent] = {}
_offsets = itertools.count()
_stream_threads = threading.local()


def _deadline_wait(cond: threading.Condition, ready: Callable[[], bool]) -> bool:
    """Wait on ``cond`` (held) until ``ready()``, at most :data:`WAIT_LIMIT` seconds."""
    end = time.monotonic() + WAIT_LIMIT
    while not ready():
        left = end - time.monotonic()
        if left <= 0:
            return False
        cond.wait(left)
    return True


class FakeStream:
    """A queue of work run in order, later, by a thread of its own."""

    def __init__(self, device: FakeDevice, name: str):
        self.device, self.name = device, name
        #: Seconds each operation waits before it runs (``None``: the device's latency);
        #: a test slows one stream to make the work of another come first.
        self.latency: float | None = None
        self.queued = 0  # operations queued so far
        self.ran = 0  # operations done so far
        self._work: deque[Callable[[], None]] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"FakeStream({self.name}, queued={self.queued}, ran={self.ran})"

    def enqueue(self, fn: Callable[[], None]) -> int:
        """Queue ``fn``; returns its place (the stream has done it once ``ran`` reaches it)."""
        with self._cond:
            self._work.append(fn)
            self.queued += 1
            place = self.queued
            self._cond.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"fake-{self.name}",
                                                daemon=True)
                self._thread.start()
            return place

    def wait_ran(self, place: int) -> bool:
        """Wait until the stream has done its first ``place`` operations."""
        with self._cond:
            return _deadline_wait(self._cond, lambda: self.ran >= place)

    def synchronize(self) -> None:
        """Wait on the host for everything queued so far (``torch.cuda.Stream.synchronize``)."""
        if getattr(_stream_threads, "stream", None) is self:
            return  # its own thread: what it runs now is all that is left before this
        if not self.wait_ran(self.queued):
            self.device.errors.append(f"{self!r}: synchronize waited {WAIT_LIMIT}s")

    def _run(self) -> None:
        _stream_threads.stream = self
        while True:
            with self._cond:
                if not self._work and not self._cond.wait_for(lambda: bool(self._work),
                                                              _IDLE_END):
                    self._thread = None
                    return
                fn = self._work.popleft()
            latency = self.device.latency if self.latency is None else self.latency
            if latency:
                time.sleep(latency)
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - reported to the test through errors
                self.device.errors.append(f"{self!r}: {exc!r}")
            finally:
                del fn  # queued work holds no memory once done
                with self._cond:
                    self.ran += 1
                    self._cond.notify_all()


class FakeEvent:
    """Counts its records as queued (``issued``) and as done (``reached``)."""

    def __init__(self) -> None:
        self.issued = 0
        self.reached = 0
        self._cond = threading.Condition()

    def __repr__(self) -> str:
        return f"FakeEvent(issued={self.issued}, reached={self.reached})"

    def reach(self, n: int) -> None:
        with self._cond:
            self.reached = max(self.reached, n)
            self._cond.notify_all()

    def wait_reached(self, n: int) -> bool:
        with self._cond:
            return _deadline_wait(self._cond, lambda: self.reached >= n)


class _Segment:
    """One allocation of the fake GPU, carved into blocks."""

    def __init__(self, nbytes: int):
        self.array = np.zeros(nbytes, dtype=np.uint8)
        self.memory = torch.from_numpy(self.array)
        self.address = self.memory.data_ptr()
        self.nbytes = nbytes
        self.used = 0
        self.handle = uuid.uuid4().bytes * 4
        with _lock:
            _memory[self.handle] = self.memory
            at = bisect.bisect(_addresses, self.address)
            _addresses.insert(at, self.address)
            _segments.insert(at, self)


class _Block:
    __slots__ = ("segment", "offset", "nbytes", "stream", "uses", "counters")

    def __init__(self, segment: _Segment, offset: int, nbytes: int, stream: FakeStream):
        self.segment, self.offset, self.nbytes, self.stream = segment, offset, nbytes, stream
        self.uses: set[FakeStream] = set()
        self.counters: list[tuple[bytes, int]] = []


class FakeDevice(DeviceOps):
    """One "process"'s view of a fake GPU (see the module docstring).

    Args:
        gpu: the UUID of the GPU this process uses.
        visible: the UUIDs it can see (default: ``gpu`` only).
        latency: seconds each queued operation waits before it runs.
    """

    name = "fake"

    def __init__(self, gpu: str = "GPU-fake", visible: tuple[str, ...] | None = None,
                 latency: float = 0.001):
        self.gpu = gpu
        self.visible = {u: i for i, u in enumerate(visible or (gpu,))}
        self.latency = latency
        self.default = FakeStream(self, f"{gpu}/default")
        #: The stream work goes on unless told otherwise (torch's current stream).
        self.current = self.default
        self.streams: list[FakeStream] = [self.default]
        self.errors: list[str] = []
        self.copies = 0  # copy launches (one batched copy counts once)
        self.copied = 0  # bytes copied
        self.shares = 0
        self.opened = 0  # live opened shares
        self.closes = 0  # opened shares closed (each synchronized the current stream)
        self.events_made = 0  # events made, interprocess or not
        self.allocated = 0  # bytes handed out by empty()
        self.reused = 0  # allocations served by a freed block
        self._alloc = threading.RLock()  # a block's finalizer may run under it
        self._segments: list[_Segment] = []
        self._live: dict[int, _Block] = {}  # address -> a block handed out
        self._free: dict[tuple[int, int], list[_Block]] = {}  # (stream id, bytes) -> blocks
        self._pending: list[tuple[_Block, list[tuple[FakeStream, int]]]] = []
        self._limbo: list[_Block] = []

    def __repr__(self) -> str:
        return f"FakeDevice({self.gpu})"

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
        stream = FakeStream(self, f"{self.gpu}/{len(self.streams)}")
        self.streams.append(stream)
        return stream

    def current_stream(self, device: torch.device) -> FakeStream:
        return self.current

    def new_event(self) -> FakeEvent:
        self.events_made += 1
        return FakeEvent()

    def new_ipc_event(self, device: torch.device) -> tuple[FakeEvent, bytes]:
        self.events_made += 1
        event, handle = FakeEvent(), uuid.uuid4().bytes * 4
        with _lock:
            _events[handle] = event
        return event, handle

    def open_ipc_event(self, handle: bytes, device: torch.device) -> FakeEvent:
        with _lock:
            return _events[handle]

    def record(self, event: Any, stream: Any) -> None:
        with event._cond:
            event.issued += 1
            n = event.issued
        stream.enqueue(lambda: event.reach(n))

    def wait_event(self, stream: Any, event: Any) -> None:
        if stream is None:
            return
        n = event.issued  # the record last queued now
        if n == 0:
            return

        def wait() -> None:
            if not event.wait_reached(n):
                self.errors.append(f"{stream!r} waited {WAIT_LIMIT}s on {event!r} for {n}")

        stream.enqueue(wait)

    def wait_stream(self, stream: Any, other: Any, mark: Any) -> None:
        if stream is None or other is None:
            return
        if isinstance(other, FakeEvent):
            self.wait_event(stream, other)
            return
        if other is stream:
            return
        # As the real layer does: record the caller's own event on the other stream, and
        # wait on that record.
        self.record(mark, other)
        self.wait_event(stream, mark)

    def synchronize(self, event: Any) -> None:
        if not event.wait_reached(event.issued):
            self.errors.append(f"the host waited {WAIT_LIMIT}s on {event!r}")

    # -- memory ---------------------------------------------------------------------------

    def empty(self, nbytes: int, device: torch.device | None = None) -> torch.Tensor:
        """New device memory from the caching allocator, on the current stream."""
        self.allocated += nbytes
        size = max(_ROUND, -(-nbytes // _ROUND) * _ROUND)
        stream = self.current
        with self._alloc:
            self._reclaim()
            free = self._free.get((id(stream), size))
            if free:
                block = free.pop()
                self.reused += 1
            else:
                block = self._carve(size, stream)
            self._live[block.segment.address + block.offset] = block
        segment = block.segment
        view = segment.array[block.offset : block.offset + nbytes]
        weakref.finalize(view, self._freed, block)
        return torch.from_numpy(view)

    def _carve(self, size: int, stream: FakeStream) -> _Block:
        for segment in self._segments:
            if segment.nbytes - segment.used >= size:
                break
        else:
            segment = _Segment(max(size, _SEGMENT))
            self._segments.append(segment)
        block = _Block(segment, segment.used, size, stream)
        segment.used += size
        return block

    def _freed(self, block: _Block) -> None:
        """The last tensor on ``block`` is gone (any thread)."""
        with self._alloc:
            self._live.pop(block.segment.address + block.offset, None)
            uses = [(s, s.queued) for s in block.uses if s is not block.stream]
            block.uses = set()
            if uses:
                self._pending.append((block, uses))
            else:
                self._back(block)

    def _back(self, block: _Block) -> None:
        with _lock:
            held = any(_counters.get(key, 0) > 0 for key in block.counters)
        if held:
            self._limbo.append(block)
            return
        block.counters = []
        self._free.setdefault((id(block.stream), block.nbytes), []).append(block)

    def _reclaim(self) -> None:
        """Blocks whose other streams have done what was queued on them when freed."""
        still = []
        for block, uses in self._pending:
            if all(s.ran >= place for s, place in uses):
                self._back(block)
            else:
                still.append((block, uses))
        self._pending = still

    def _block_of(self, t: torch.Tensor) -> _Block | None:
        return self._live.get(t.untyped_storage().data_ptr())

    def _raw(self, t: torch.Tensor) -> torch.Tensor:
        """The bytes of the flat uint8 ``t`` without keeping its storage alive, when it
        lies in a segment, this device's or an opened one (queued work holds memory as a
        kernel does: not at all); a test's own tensor as it is."""
        address = t.data_ptr()
        with _lock:
            at = bisect.bisect(_addresses, address) - 1
            segment = _segments[at] if at >= 0 else None
        if segment is None or address >= segment.address + segment.nbytes:
            return t
        start = address - segment.address
        return segment.memory[start : start + t.numel()]

    def keep_until_done(self, tensors: list[torch.Tensor], stream: Any) -> None:
        with self._alloc:
            for t in tensors:
                block = self._block_of(t)
                if block is not None:
                    block.uses.add(stream)

    def share(self, t: torch.Tensor) -> Share:
        self.shares += 1
        key = (b"/fake_counters", next(_offsets))
        storage = t.untyped_storage()
        with self._alloc:
            block = self._live.get(storage.data_ptr())
            if block is not None:
                block.counters.append(key)
        if block is not None:
            handle, offset = block.segment.handle, block.offset
        else:  # memory outside the allocator: a segment of its own
            handle, offset = uuid.uuid4().bytes * 4, 0
            with _lock:
                _memory[handle] = torch.empty(0, dtype=torch.uint8).set_(storage)
        with _lock:
            _counters[key] = 1
        return Share(handle, storage.nbytes(), offset, *key)

    def open(self, share: Share, device: torch.device) -> torch.Tensor:
        with _lock:
            segment = _memory[share.handle]
        array = segment.numpy()[share.offset : share.offset + share.nbytes]
        self.opened += 1
        weakref.finalize(array, self._closed, (share.ref_counter, share.ref_counter_offset))
        return torch.from_numpy(array)

    def _closed(self, key: tuple[bytes, int]) -> None:
        self.opened -= 1
        self.closes += 1
        if getattr(_stream_threads, "stream", None) is None:  # a stream never waits on one
            self.current.synchronize()
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
        with self._alloc:
            limbo, self._limbo = self._limbo, []
            for block in limbo:
                self._back(block)

    def copy(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], stream: Any) -> None:
        self.copies += 1
        pairs = [(self._raw(d), self._raw(s)) for d, s in zip(dsts, srcs, strict=True)]
        self.copied += sum(s.numel() for _, s in pairs)

        def run() -> None:
            for dst, src in pairs:
                dst.copy_(src)

        stream.enqueue(run)

    # -- what a test does as kernels and host reads -----------------------------------------

    def launch(self, fn: Callable[[], None], stream: FakeStream | None = None) -> None:
        """Queue ``fn`` (a kernel: it writes or reads device memory) on ``stream``
        (default: the current one)."""
        (stream or self.current).enqueue(fn)

    def tensor(self, data: torch.Tensor) -> torch.Tensor:
        """A copy of ``data`` in new device memory, written on the current stream (as
        ``torch.tensor(..., device="cuda")``)."""
        data = data.contiguous()
        out = self.empty(data.numel() * data.element_size()).view(data.dtype).reshape(data.shape)
        raw = self._raw(out.reshape(-1).view(torch.uint8))
        source = data.reshape(-1).view(torch.uint8).clone()
        self.launch(lambda: raw.copy_(source))
        return out

    def read(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as the host sees it after the current stream's work (``.cpu()``)."""
        self.current.synchronize()
        return t.clone()

    def synchronize_all(self) -> None:
        """Wait for every stream of this device (``torch.cuda.synchronize``)."""
        for stream in list(self.streams):
            stream.synchronize()


def held(share: Share) -> int:
    """The counter of ``share`` now (0 once released or collected)."""
    with _lock:
        return _counters.get((share.ref_counter, share.ref_counter_offset), 0)
