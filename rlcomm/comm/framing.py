"""Frames: the fixed-size opening of every message (header, and small payloads inline).

Layout of a frame of :data:`FRAME_BYTES` bytes: a little-endian u32 header length, the
msgspec header, then ``header.inline`` payload bytes when the whole payload fits. A
header longer than the frame continues in one extra message of exactly the missing
length. Pure: no I/O.
"""

from __future__ import annotations

import struct

import torch

from rlcomm.comm import codec
from rlcomm.comm.codec import MessageHeader

#: Bytes of the frame that opens every message.
FRAME_BYTES = 4096
_LEN = struct.Struct("<I")


def pack(
    header: MessageHeader, tensors: list[torch.Tensor], frame: torch.Tensor
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Fill ``frame`` for a message; return (extra header messages, payload messages).

    Sets ``header.inline``: CPU payloads that fit in the frame with the header ride
    inline, and the payload list is then empty. CUDA payloads never ride inline.
    """
    on_cuda = bool(tensors) and tensors[0].is_cuda
    total = sum(t.numel() * t.element_size() for t in tensors)
    header.inline = total if (total and not on_cuda and total < FRAME_BYTES) else 0
    hb = codec.header_to_bytes(header)
    if header.inline and _LEN.size + len(hb) + total > FRAME_BYTES:
        header.inline = 0
        hb = codec.header_to_bytes(header)
    head = _LEN.pack(len(hb)) + hb
    extra: list[torch.Tensor] = []
    if len(head) > FRAME_BYTES:
        extra.append(torch.frombuffer(bytearray(head[FRAME_BYTES:]), dtype=torch.uint8))
        head = head[:FRAME_BYTES]
    frame[: len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
    if header.inline:
        offset = len(head)
        for t in tensors:
            n = t.numel() * t.element_size()
            if n:
                frame[offset : offset + n].copy_(codec.as_bytes(t))
            offset += n
        return extra, []
    return extra, [codec.as_bytes(t) for t in tensors if t.numel()] if not on_cuda else []


def extra_header_bytes(frame: torch.Tensor) -> int:
    """How many header bytes follow the frame in an extra message (usually 0)."""
    (hlen,) = _LEN.unpack_from(frame[: _LEN.size].numpy().tobytes())
    return max(0, _LEN.size + hlen - FRAME_BYTES)


def unpack(frame: torch.Tensor, extra: torch.Tensor | None = None) -> tuple[MessageHeader, bytes]:
    """The header and inline payload bytes of a received frame (plus its extra part)."""
    raw = frame.numpy().tobytes()
    (hlen,) = _LEN.unpack_from(raw)
    start = _LEN.size
    if extra is not None:
        return codec.header_from_bytes(raw[start:] + extra.numpy().tobytes()), b""
    header = codec.header_from_bytes(raw[start : start + hlen])
    return header, raw[start + hlen : start + hlen + header.inline]


def split_inline(header: MessageHeader, inline: bytes) -> list[torch.Tensor]:
    """Rebuild a message's CPU tensors from its inline bytes."""
    tensors, offset = [], 0
    raw = torch.frombuffer(bytearray(inline), dtype=torch.uint8) if inline else None
    for meta in header.tensors:
        t = codec.empty_like_meta(meta, torch.device("cpu"))
        n = meta.nbytes
        if n:
            codec.as_bytes(t).copy_(raw[offset : offset + n])
        offset += n
        tensors.append(t)
    return tensors


def tensors_from_payload(header: MessageHeader, payload: list[torch.Tensor]) -> list[torch.Tensor]:
    """Typed tensors from the uint8 payload buffers of a message's non-empty tensors."""
    tensors, it = [], iter(payload)
    for meta in header.tensors:
        if meta.nbytes == 0:
            tensors.append(codec.empty_like_meta(meta, torch.device("cpu")))
        else:
            tensors.append(next(it).view(codec.dtype_of(meta.dtype)).reshape(meta.shape))
    return tensors
