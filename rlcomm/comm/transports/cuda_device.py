"""The CUDA operations under rlcomm's IPC protocols, behind one small interface.

:class:`DeviceOps` is everything the CUDA IPC transport (:mod:`.cuda_ipc`) and the
device-side broadcast ask of a GPU: streams, interprocess events, sharing memory by IPC
handle and opening it in another process, copies. :data:`CUDA` is the real one, on
torch's CUDA API; the protocol above it never calls ``torch.cuda`` itself, so its tests
run it on CPU over a fake (``tests/comm/fake_device.py``) that keeps the same contract.

Sharing follows torch's own machinery (``UntypedStorage._share_cuda_`` and
``_new_shared_cuda``, as ``torch.multiprocessing`` does), including its reference
counting: an allocation the sender frees while a receiver still has it open is kept
aside (torch's *limbo*) until that receiver closes it, so the sender's allocator never
hands it out again too early. The counter of one sharing starts at one (the one receiver
it is made for); the receiver's close takes it down, and a sender whose receiver died
takes it down on its behalf (:meth:`DeviceOps.release`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import msgspec
import torch

logger = logging.getLogger(__name__)


class Share(msgspec.Struct, array_like=True, frozen=True):
    """One allocation as another process opens it: ``_share_cuda_()``'s fields without
    the device index and the sharing event (the protocol orders copies with its own
    events): the IPC handle of the allocation's block, the storage's size and offset in
    it, and where its reference counter lies."""

    handle: bytes
    nbytes: int
    offset: int
    ref_counter: bytes
    ref_counter_offset: int


class DeviceOps:
    """The CUDA operations of the IPC protocols (see the module docstring).

    Streams and events are torch's objects; every method that takes one accepts what the
    same object's methods returned.
    """

    name = "cuda"

    def is_device(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lies in device memory this layer moves."""
        return t.is_cuda

    def gpu_uuid(self, device: torch.device) -> str:
        """The UUID of the physical GPU behind ``device`` (the same in every process)."""
        return str(torch.cuda.get_device_properties(device).uuid)

    @functools.cache  # noqa: B019 - one DeviceOps per process; the GPUs do not change
    def local_gpus(self) -> dict[str, int]:
        """This process's device index of each GPU it can see, by UUID."""
        return {
            str(torch.cuda.get_device_properties(i).uuid): i
            for i in range(torch.cuda.device_count())
        }

    def device(self, index: int) -> torch.device:
        return torch.device("cuda", index)

    # -- streams and events ---------------------------------------------------------------

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def new_event(self) -> Any:
        """An event of this process only (cheap; timing off)."""
        return torch.cuda.Event()

    def new_ipc_event(self, device: torch.device) -> tuple[Any, bytes]:
        """An interprocess event on ``device`` and its IPC handle."""
        with torch.cuda.device(device):
            event = torch.cuda.Event(interprocess=True)
            # A handle can only be taken of an event that exists on the device: the
            # first record makes it.
            event.record(torch.cuda.current_stream(device))
            return event, bytes(event.ipc_handle())

    def open_ipc_event(self, handle: bytes, device: torch.device) -> Any:
        """The peer's interprocess event named by ``handle``, opened on ``device``."""
        return torch.cuda.Event.from_ipc_handle(device, handle)

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def wait_event(self, stream: Any, event: Any) -> None:
        """Order ``stream``'s later work after ``event``'s last record (no host wait)."""
        stream.wait_event(event)

    def wait_stream(self, stream: Any, other: Any, mark: Any) -> None:
        """Order ``stream``'s later work after what ``other`` (a stream, or an event
        recorded on one) has queued now. A stream of ``stream``'s device is waited on
        through ``mark``, an event of the caller's own (:meth:`new_event`, kept for good,
        recorded on that device's streams only, and recorded and waited on under one
        lock hold): torch's ``Stream.wait_stream`` makes and drops an event per call."""
        if isinstance(other, torch.cuda.Event):
            stream.wait_event(other)
        elif other is not None and stream != other:
            if other.device != stream.device:  # an event records on one device's streams
                stream.wait_stream(other)
                return
            mark.record(other)
            stream.wait_event(mark)

    def synchronize(self, event: Any) -> None:
        """Wait on the host until ``event``'s last record has happened."""
        event.synchronize()

    # -- memory ---------------------------------------------------------------------------

    def storage_key(self, t: torch.Tensor) -> tuple[int, int]:
        """The storage ``t`` lies in, as ``(data pointer, bytes)``."""
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()

    def storage_offset(self, t: torch.Tensor) -> int:
        """Where ``t``'s first byte lies in its storage."""
        return t.storage_offset() * t.element_size()

    def weak_ref(self, t: torch.Tensor) -> Any:
        """A reference to ``t``'s storage that does not keep its memory alive."""
        return t.untyped_storage()._weak_ref()

    def expired(self, ref: Any) -> bool:
        return torch.UntypedStorage._expired(ref)

    def free_weak_ref(self, ref: Any) -> None:
        torch.UntypedStorage._free_weak_ref(ref)

    def share(self, t: torch.Tensor) -> Share:
        """Share the storage ``t`` lies in with one receiver (once per storage and
        receiver: each call wraps the storage in a new reference count)."""
        (_device, handle, nbytes, offset, counter, counter_offset, _event, _sync) = (
            t.untyped_storage()._share_cuda_()
        )
        return Share(bytes(handle), int(nbytes), int(offset), bytes(counter), int(counter_offset))

    def open(self, share: Share, device: torch.device) -> torch.Tensor:
        """The peer's storage named by ``share``, opened here as a flat uint8 tensor.
        Dropping the tensor closes it (and takes the sender's counter down)."""
        storage = torch.UntypedStorage._new_shared_cuda(
            device.index, share.handle, share.nbytes, share.offset, share.ref_counter,
            share.ref_counter_offset, b"", False,
        )
        return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)

    def release(self, share: Share) -> None:
        """Take the counter of ``share`` down on behalf of a receiver that died."""
        try:
            torch.UntypedStorage._release_ipc_counter_cuda(share.ref_counter, share.ref_counter_offset)
        except RuntimeError:  # the counter's file is gone: nothing holds the memory
            logger.debug("releasing a CUDA IPC counter failed", exc_info=True)

    def collect(self) -> None:
        """Free the allocations freed here that no receiver holds any more."""
        torch.cuda.ipc_collect()

    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def keep_until_done(self, tensors: list[torch.Tensor], stream: Any) -> None:
        """Keep the allocator from handing ``tensors``' memory out again, once freed,
        before the work queued on ``stream`` now is done."""
        for t in tensors:
            t.record_stream(stream)

    def copy(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], stream: Any) -> None:
        """Copy each uint8 ``srcs[i]`` into ``dsts[i]`` on ``stream`` (queued, not waited),
        as one batched launch where torch has it."""
        with torch.cuda.stream(stream):
            # Many small tensors: one launch for all; large ones copy at full speed alone.
            if len(dsts) > 1 and _FOREACH_COPY is not None and sum(
                    d.numel() for d in dsts) <= len(dsts) * _FOREACH_MAX:
                _FOREACH_COPY(dsts, srcs, non_blocking=True)
            else:
                for dst, src in zip(dsts, srcs, strict=True):
                    dst.copy_(src, non_blocking=True)


_FOREACH_COPY = getattr(torch, "_foreach_copy_", None)
#: Mean bytes per tensor up to which a list of copies goes as one batched launch.
_FOREACH_MAX = 1 << 20

#: The real device layer.
CUDA = DeviceOps()
