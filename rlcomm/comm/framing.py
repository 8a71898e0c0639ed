"""Frames: the opening of every message, the header and small payloads inline.

A frame is a byte string: a little-endian u32 header length, the msgspec header, then
``header.inline`` payload bytes when the whole CPU payload is small enough to ride
along. A device payload that a one-sided transport (CUDA IPC) offers adds its *offer*
after that: where the receiver reads the payload from. Transports move frames with ``send_frame`` / ``recv_frame`` (shared memory as a
record of its own length, Gloo as fixed-size messages). Pure: no I/O.
"""

from __future__ import annotations

import ctypes
import struct

import numpy as np
import torch

from rlcomm.comm import codec
from rlcomm.comm.codec import DictNode, Kind, MessageHeader, TensorMeta

try:  # the opening and a tensor's bytes in one C call (the module is optional: setup.py)
    from rlcomm.comm.transports._stream_copy import joined as _joined
except ImportError:
    _joined = None

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
    accelerator transport. ``tensors`` are as :func:`codec.encode` returns them
    (contiguous, detached, without lazy conj or neg bits): each is viewed as bytes
    without the looks of :func:`codec.as_bytes` (four torch calls a tensor).
    """
    on_cuda = bool(tensors) and tensors[0].is_cuda
    total = sum(t.nbytes for t in tensors)
    if total and not on_cuda and total <= INLINE_BYTES and not header.stream:
        header.inline = total
        hb = codec.header_to_bytes(header)
        return b"".join([_LEN.pack(len(hb)), hb, *(_raw_bytes(t) for t in tensors)]), []
    header.inline = 0
    hb = codec.header_to_bytes(header)
    if on_cuda:
        return _LEN.pack(len(hb)) + hb, list(tensors)
    return _LEN.pack(len(hb)) + hb, [t.reshape(-1).view(torch.uint8) for t in tensors if t.nbytes]


#: The opening (length and header) of the frames :func:`small_frame` builds, by the
#: length of a ``bytes`` object, or by ``("dict", key, dtype, shape, ...)`` of a dict
#: (a tensor's: :data:`_TENSOR_OPENINGS`): a small message's header differs from the
#: last one of its kind only in its payload. At most :data:`_OPENINGS_MAX` are kept (then
#: new ones are built each time).
_OPENINGS: dict[object, bytes] = {}
_OPENINGS_MAX = 1024
#: What :func:`_sized` keeps of a tensor, by ``(dtype, shape)``.
_TENSOR_OPENINGS: dict[tuple[torch.dtype, torch.Size],
                       tuple[tuple[torch.dtype, torch.Size], bytes, int]] = {}
#: Dicts of at most this many tensors have a one-frame form (a batch of rewards or an
#: episode's metadata; a state dict is not small).
_DICT_ENTRIES = 16


def small_frame(obj: object) -> bytes | None:
    """The whole frame of a message that is one small CPU tensor, one small ``bytes``
    object or a small dict of CPU tensors by ``str`` keys (without a piggyback), or None
    for any other message (:func:`pack` frames those). The frame is byte for byte the
    one :func:`pack` makes of ``codec.encode(obj)``; its opening comes from a cache and
    its payload is copied once, so that the commonest small messages skip the codec
    (about 10 µs of a 4 B send on the development machine)."""
    tp = type(obj)
    if tp is bytes:
        n = len(obj)  # type: ignore[arg-type]
        if not 0 < n <= INLINE_BYTES:
            return None
        opening = _OPENINGS.get(n)
        if opening is None:
            opening = _remember(n, MessageHeader(
                Kind.BYTES, [TensorMeta("uint8", (n,), "cpu")], inline=n))
        return opening + obj  # type: ignore[operator]
    if tp is torch.Tensor:
        t: torch.Tensor = obj  # type: ignore[assignment]
        known = _sized(t)
        if known is None:
            return None
        _, opening, n = known
        # Dense, contiguous and alive: its n bytes start at data_ptr().
        if _joined is not None:
            return _joined(opening, t.data_ptr(), n)
        return opening + ctypes.string_at(t.data_ptr(), n)
    if tp is dict and 0 < len(obj) <= _DICT_ENTRIES:  # type: ignore[arg-type]
        return _dict_frame(obj)  # type: ignore[arg-type]
    return None


def payload_bytes(frame: bytes) -> int:
    """The payload bytes a frame of :func:`small_frame` carries (what follows its
    opening)."""
    return len(frame) - _LEN.size - _LEN.unpack_from(frame)[0]


def _sized(t: torch.Tensor) -> tuple[tuple[torch.dtype, torch.Size], bytes, int] | None:
    """``((dtype, shape), opening, bytes)`` of a tensor that a one-frame message carries
    as it is (a dense, contiguous CPU tensor of 1 to :data:`INLINE_BYTES` bytes), its
    opening that of a message of it alone; else None.

    Each look at a tensor is a call into torch, dearer where a message goes than in a
    loop (0.2-0.4 µs each on the development machine): the opening is kept with the
    tensor's size, and only the looks that decide its bytes are taken. What
    :func:`codec.prepare` would refuse, or change in its bytes, goes the general way (it
    detaches a tensor that requires grad: the same bytes and header)."""
    if not t.is_cpu or t.layout is not torch.strided or t.is_nested:
        return None  # (a nested tensor's shape cannot be read)
    dtype = t.dtype
    known = _TENSOR_OPENINGS.get((dtype, t.shape))
    if known is None:
        known = _tensor_opening(t)
        if known is None:
            return None
    if not t.is_contiguous() or t.is_neg() or (dtype.is_complex and t.is_conj()):
        return None
    return known


def _tensor_opening(t: torch.Tensor) -> tuple[tuple[torch.dtype, torch.Size], bytes, int] | None:
    """:func:`_sized` of a dense CPU tensor whose dtype and shape are not kept yet (kept
    now), or None where it is not small or its dtype is one a header cannot carry."""
    n = t.nbytes
    if not 0 < n <= INLINE_BYTES:
        return None
    opening = _opening_of(None, Kind.TENSOR, [t], None, n)
    if opening is None:
        return None
    key = (t.dtype, t.shape)
    known = key, opening, n
    if len(_TENSOR_OPENINGS) < _OPENINGS_MAX:
        _TENSOR_OPENINGS[key] = known
    return known


def _opening_of(key: object, kind: Kind, tensors: list[torch.Tensor],
                structure: DictNode | None, inline: int) -> bytes | None:
    """The opening of a one-frame message of ``tensors`` (kept by ``key``), or None
    where a dtype is one a header cannot carry (the general path says so)."""
    try:
        metas = [codec.meta_of(t) for t in tensors]
    except KeyError:
        return None
    return _remember(key, MessageHeader(kind, metas, structure, inline=inline))


def _dict_frame(obj: dict) -> bytes | None:
    """:func:`small_frame` of a dict: each value a tensor as :func:`_sized` takes it, by
    a ``str`` key, all of them at most :data:`INLINE_BYTES`."""
    key: list[object] = ["dict"]
    parts: list[int] = []  # each tensor's address and bytes
    total = 0
    for name, t in obj.items():
        if type(name) is not str or type(t) is not torch.Tensor:
            return None
        known = _sized(t)
        if known is None:
            return None
        tkey, _, n = known
        key += (name, tkey)
        parts += (t.data_ptr(), n)
        total += n
    if total > INLINE_BYTES:
        return None
    opening = _OPENINGS.get(tuple(key))
    if opening is None:
        opening = _opening_of(tuple(key), Kind.TENSOR_DICT, list(obj.values()),
                              DictNode(list(obj), list(range(len(obj)))), total)
        if opening is None:
            return None
    if _joined is not None:
        return _joined(opening, *parts)
    string_at = ctypes.string_at
    return b"".join([opening, *(string_at(parts[i], parts[i + 1])
                                for i in range(0, len(parts), 2))])


def _remember(key: object, header: MessageHeader) -> bytes:
    """The opening of ``header``'s frames, kept by ``key`` (``None``: by the caller)."""
    hb = codec.header_to_bytes(header)
    opening = _LEN.pack(len(hb)) + hb
    if key is not None and len(_OPENINGS) < _OPENINGS_MAX:
        _OPENINGS[key] = opening
    return opening


#: Headers of received frames, decoded and checked, with each tensor's bytes, by the
#: header's bytes: the commonest small messages repeat their header, and decoding and
#: checking it again costs more than the rest of their frame. Headers up to
#: :data:`_KNOWN_HEADER_BYTES` without a piggyback are kept, at most :data:`_KNOWN_MAX`
#: (then the others are decoded each time). A header from here is shared by every
#: message that had it: nothing on the receiving side changes a header.
_KNOWN: dict[bytes, tuple[MessageHeader, list[int]]] = {}
#: The headers of :data:`_KNOWN` by ``id``.
_KNOWN_IDS: dict[int, MessageHeader] = {}
_KNOWN_MAX = 1024
_KNOWN_HEADER_BYTES = 256


def unpack_sized(frame: bytes) -> tuple[MessageHeader, list[int], bytes, bytes]:
    """The header, each tensor's bytes (the list is shared: read it only), inline
    payload bytes and offer of a received frame (the offer is what a one-sided
    transport appended for a device payload: empty for every other).

    Raises:
        CodecError: the header is not valid.
    """
    (hlen,) = _LEN.unpack_from(frame)
    start = _LEN.size + hlen
    if hlen > _KNOWN_HEADER_BYTES:
        # Never kept, so never looked up: hashing a component's frame of 100 KiB (a
        # channel's batch of puts) costs 20-25 µs, a view of it to decode nothing.
        header = codec.header_from_bytes(memoryview(frame)[_LEN.size : start])
        sizes = [m.nbytes for m in header.tensors]
    else:
        hb = frame[_LEN.size : start]
        known = _KNOWN.get(hb)
        if known is None:
            header = codec.header_from_bytes(hb)
            known = header, [m.nbytes for m in header.tensors]
            if header.piggyback is None and len(_KNOWN) < _KNOWN_MAX:
                _KNOWN[hb] = known
                _KNOWN_IDS[id(header)] = header
        header, sizes = known
    end = start + header.inline
    return header, sizes, frame[start:end], frame[end:]


def kept(header: MessageHeader) -> bool:
    """Whether ``header`` is one that :func:`unpack_sized` decodes its bytes to for good
    (so that its ``id`` names it while the process lives)."""
    return _KNOWN_IDS.get(id(header)) is header


def unpack(frame: bytes) -> tuple[MessageHeader, bytes, bytes]:
    """The header, inline payload bytes and offer of a received frame (see
    :func:`unpack_sized`)."""
    header, _, inline, offer = unpack_sized(frame)
    return header, inline, offer


#: Tensors made ahead for the next one-tensor message (a tensor, or a dict or list of
#: one) of a known header, by the header's ``id`` (a known header is one object, kept
#: for good: :data:`_KNOWN_IDS`), each as ``(bytearray, tensor)``, the tensor a view of
#: the bytearray. A receiver makes the one for the last such message taken in before it
#: waits (:func:`spare_ahead`): right after a message arrives, making a small tensor took
#: 8-9 µs on the development machine (a tenth of a 4 B tensor's one-way time there), and
#: made while waiting it costs the message nothing. At most :data:`_SPARES_MAX` are kept.
_SPARES: dict[int, tuple[bytearray, torch.Tensor]] = {}
_SPARES_MAX = 8
_SPARE_FOR: list[MessageHeader | None] = [None]


def spare_ahead() -> None:
    """Make the tensor of the next message like the last one-tensor message taken in,
    unless it is made (a receiver calls this before it waits; see :data:`_SPARES`)."""
    header = _SPARE_FOR[0]
    if header is None or id(header) in _SPARES:
        return
    if len(_SPARES) >= _SPARES_MAX:
        _SPARES.clear()
    meta = header.tensors[0]
    buf = bytearray(header.inline)
    flat = torch.frombuffer(buf, dtype=codec.dtype_of(meta.dtype))
    _SPARES[id(header)] = buf, flat if len(meta.shape) == 1 else flat.reshape(meta.shape)


def _take_spare(header: MessageHeader, inline: bytes) -> torch.Tensor | None:
    """The made-ahead tensor of a one-tensor message (its bytes ``inline``) filled in,
    or None."""
    spare = _SPARES.pop(id(header), None)  # atomic: two receiving threads never share one
    if spare is None:
        return None
    # The same length, as its header says (a bytearray that a tensor views cannot be
    # resized: ``inline`` of another length would raise, not spill).
    spare[0][:] = inline
    _SPARE_FOR[0] = header
    return spare[1]


# The kinds split_inline tells apart, as plain ints (every small message is split: an
# enum member's lookup costs about 60 ns on Python 3.11, two of them a fifth of it).
_OBJECT, _BYTES = int(Kind.OBJECT), int(Kind.BYTES)


def split_inline(
    header: MessageHeader, inline: bytes, sizes: list[int] | None = None
) -> list[torch.Tensor | bytes]:
    """Rebuild a message's CPU tensors from its inline bytes (the one "tensor" of an
    ``OBJECT`` or ``BYTES`` message stays ``bytes``: :func:`codec.decode` takes it so).
    ``sizes``: each tensor's bytes, when the caller has them already."""
    kind = header.kind
    if kind == _BYTES or kind == _OBJECT:
        return [inline]
    one = len(header.tensors) == 1  # a tensor, or a dict or list of one
    if one and inline:
        spare = _take_spare(header, inline)
        if spare is not None:
            return [spare]
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
    if one and inline and kept(header):
        _SPARE_FOR[0] = header  # made once: the next one is made ahead
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
            flat = next(it).view(codec.dtype_of(meta.dtype))
            tensors.append(flat if len(meta.shape) == 1 else flat.reshape(meta.shape))
    return tensors
