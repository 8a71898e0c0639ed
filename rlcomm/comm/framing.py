"""Frames: the opening of every message, the header and small payloads inline.

A frame is a byte string: a little-endian u32 header length, the msgspec header, then
``header.inline`` payload bytes when the whole CPU payload is small enough to ride
along. A device payload that a one-sided transport (CUDA IPC) offers adds its *offer*
after that: where the receiver reads the payload from. Transports move frames with ``send_frame`` / ``recv_frame`` (shared memory as a
record of its own length, Gloo as fixed-size messages). Pure: no I/O.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from rlcomm.comm import codec
from rlcomm.comm.codec import Kind, MessageHeader

#: Payloads up to this many bytes (all tensors of a message together) ride in the frame.
INLINE_BYTES = 4000
_LEN = struct.Struct("<I")


def _raw_bytes(t: torch.Tensor) -> bytes:
    try:  # numpy's view of the tensor skips two torch reshapes (small frames are hot)
        return t.numpy().tobytes()
    except TypeError:  # a dtype numpy lacks (bfloat16, float8)
        return codec.as_bytes(t).numpy().tobytes()


def pack(header: MessageHeader, tensors: list[torch.Tensor]) -> tuple[bytes, list[torch.Tensor]]:
    """The frame of a message and the payload tensors that follow it (as uint8 views).

    Sets ``header.inline``: a CPU payload of at most :data:`INLINE_BYTES` rides in the
    frame and the payload list is then empty, unless the message streams in buckets.
    CUDA payloads never ride inline; their tensors are returned as they are, for the
    accelerator transport.
    """
    on_cuda = bool(tensors) and tensors[0].is_cuda
    total = sum(t.numel() * t.element_size() for t in tensors)
    if total and not on_cuda and total <= INLINE_BYTES and not header.stream:
        header.inline = total
        hb = codec.header_to_bytes(header)
        return b"".join([_LEN.pack(len(hb)), hb, *(_raw_bytes(t) for t in tensors)]), []
    header.inline = 0
    hb = codec.header_to_bytes(header)
    if on_cuda:
        return _LEN.pack(len(hb)) + hb, list(tensors)
    return _LEN.pack(len(hb)) + hb, [codec.as_bytes(t) for t in tensors if t.numel()]


def unpack(frame: bytes) -> tuple[MessageHeader, bytes, bytes]:
    """The header, inline payload bytes and offer of a received frame (the offer is what
    a one-sided transport appended for a device payload: empty for every other)."""
    (hlen,) = _LEN.unpack_from(frame)
    start = _LEN.size + hlen
    header = codec.header_from_bytes(frame[_LEN.size : start])
    end = start + header.inline
    return header, frame[start:end], frame[end:]


def split_inline(
    header: MessageHeader, inline: bytes, sizes: list[int] | None = None
) -> list[torch.Tensor | bytes]:
    """Rebuild a message's CPU tensors from its inline bytes (the one "tensor" of an
    ``OBJECT`` or ``BYTES`` message stays ``bytes``: :func:`codec.decode` takes it so).
    ``sizes``: each tensor's bytes, when the caller has them already."""
    if header.kind == Kind.OBJECT or header.kind == Kind.BYTES:
        return [inline]
    tensors: list[torch.Tensor | bytes] = []
    offset = 0
    if sizes is None:
        sizes = [meta.nbytes for meta in header.tensors]
    for meta, n in zip(header.tensors, sizes):
        if n:
            flat = torch.frombuffer(
                bytearray(inline[offset : offset + n]), dtype=codec.dtype_of(meta.dtype)
            )
            shape = meta.shape
            tensors.append(flat if len(shape) == 1 else flat.reshape(shape))
        else:
            tensors.append(codec.empty_like_meta(meta, torch.device("cpu")))
        offset += n
    return tensors


def copy_inline_into(tensor: torch.Tensor, inline: bytes) -> None:
    """Copy a one-tensor inline payload into ``tensor`` (contiguous, same byte size)."""
    if inline:
        codec.as_bytes(tensor).numpy()[:] = np.frombuffer(inline, dtype=np.uint8)


def tensors_from_payload(
    header: MessageHeader, payload: list[torch.Tensor], device: torch.device | None = None
) -> list[torch.Tensor]:
    """Typed tensors from the uint8 payload buffers of a message's non-empty tensors (its
    empty ones are made on ``device``, default the CPU)."""
    tensors, it = [], iter(payload)
    for meta in header.tensors:
        if meta.nbytes == 0:
            tensors.append(codec.empty_like_meta(meta, device or torch.device("cpu")))
        else:
            tensors.append(next(it).view(codec.dtype_of(meta.dtype)).reshape(meta.shape))
    return tensors
