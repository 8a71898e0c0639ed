"""Items as opaque payloads: encoded once by the producer, decoded once by the consumer.

:func:`encode_item` runs the codec (:mod:`rlcomm.comm.codec`) on an item and returns its
:class:`~rlcomm.channel.protocol.Payload` and the tensors that travel beside the frame. A
small CPU item (at most :data:`INLINE_ITEM_BYTES` of payload: a few KiB of ``bytes``, a
short tensor) rides in the frame as bytes, so a message of small items is one frame.
:func:`decode_item` turns a payload and its tensors back into the item.

Between the two, the channel worker holds a :class:`StoredItem`: the payload and its
tensors, never decoded, so the codec runs twice per item whatever the item is, and the
worker need not be able to import the item's classes.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

from rlcomm.channel.protocol import Payload
from rlcomm.comm import codec
from rlcomm.comm.codec import Kind

#: An item whose CPU payload is at most this many bytes rides in the frame.
INLINE_ITEM_BYTES = 8 << 10


class StoredItem:
    """An item as the channel worker holds it: its payload and its tensors (not decoded).

    ``taken`` is set once a reply hands the item out. Its tensors stay as they arrived
    (a large one is a view of the producer's shared memory; the transport bounds how many
    of a producer's segments this side may hold).
    """

    __slots__ = ("payload", "tensors", "taken")

    def __init__(self, payload: Payload, tensors: list[torch.Tensor]):
        self.payload = payload
        self.tensors = tensors
        self.taken = False

    def lend_cost(self) -> int | None:
        """The bytes this item costs a get that takes it ahead for its process
        (prefetch); ``None`` for an item of GPU tensors, which is never lent."""
        n = len(self.payload.data) + len(self.payload.header)
        for t in self.tensors:
            if t.is_cuda:
                return None
            n += t.numel() * t.element_size()
        return n

    @property
    def nbytes(self) -> int:
        return len(self.payload.data) + sum(t.numel() * t.element_size() for t in self.tensors)

    def decode(self) -> Any:
        """The item itself (for ``peek_all``, a debugging call)."""
        return decode_item(self.payload, self.tensors)


# decode() rebuilds an OBJECT item from its one buffer alone; the meta only counts it.
_OBJECT_HEADER = codec.MessageHeader(Kind.OBJECT, [codec.TensorMeta("uint8", (0,), "cpu")])


def _raw_bytes(t: torch.Tensor) -> bytes:
    try:
        return t.numpy().tobytes()
    except TypeError:  # a dtype numpy lacks (bfloat16, float8)
        return codec.as_bytes(t).numpy().tobytes()


#: Items the codec would pickle whole (kind ``OBJECT``) that need no walk for tensors: they
#: are pickled here directly, into the same form, without the detour through a tensor.
_PLAIN = frozenset((bytes, str, int, float, bool, type(None)))


def encode_item(item: Any) -> tuple[Payload, list[torch.Tensor]]:
    """The payload of ``item`` and the tensors that travel beside the frame.

    Raises:
        CodecError: the item cannot be encoded.
    """
    tp = type(item)
    if tp in _PLAIN and (tp is not bytes and tp is not str or len(item) <= INLINE_ITEM_BYTES):
        data = pickle.dumps(item, protocol=codec.PICKLE_PROTOCOL)
        if len(data) <= INLINE_ITEM_BYTES:
            return Payload(b"", data), []
    header, tensors = codec.encode(item)
    hb = codec.header_to_bytes(header)
    if not tensors:
        return Payload(hb), []
    if not tensors[0].is_cuda:
        total = 0
        for t in tensors:
            total += t.numel() * t.element_size()
        if total <= INLINE_ITEM_BYTES:
            return Payload(hb, b"".join([_raw_bytes(t) for t in tensors])), []
    return Payload(hb, b"", len(tensors)), tensors


def _split(header: codec.MessageHeader, data: bytes) -> list[Any]:
    """The tensors of an inline payload (an ``OBJECT`` item's pickle stays ``bytes``)."""
    if header.kind == Kind.OBJECT or header.kind == Kind.BYTES:
        return [data]
    out: list[Any] = []
    offset = 0
    for meta in header.tensors:
        n = meta.nbytes
        dtype = codec.dtype_of(meta.dtype)
        if n:
            flat = torch.frombuffer(bytearray(data[offset:offset + n]), dtype=dtype)
            out.append(flat if len(meta.shape) == 1 else flat.reshape(meta.shape))
        else:
            out.append(torch.empty(meta.shape, dtype=dtype))
        offset += n
    return out


def decode_item(payload: Payload, tensors: list[torch.Tensor]) -> Any:
    """The item of ``payload`` with its ``tensors``.

    Raises:
        CodecError: the payload is not a valid item here (a class this process cannot
            import, strict mode refusing a pickle, a corrupt header).
    """
    if not payload.header:  # the codec's OBJECT form: ``data`` is the item's pickle
        return codec.decode(_OBJECT_HEADER, [payload.data])
    header = codec.header_from_bytes(payload.header)
    if not payload.tensors:
        tensors = _split(header, payload.data)
    return codec.decode(header, tensors)


class TensorCursor:
    """Hands out a message's tensors to its payloads, in the order they own them."""

    __slots__ = ("_tensors", "_at")

    def __init__(self, tensors: list[torch.Tensor]):
        self._tensors = tensors
        self._at = 0

    def item(self, payload: Payload) -> StoredItem:
        """The stored item of ``payload`` with the next ``payload.tensors`` tensors.

        Raises:
            ValueError: the message holds fewer tensors.
        """
        n = payload.tensors
        if not n:
            return StoredItem(payload, [])
        at = self._at
        if at + n > len(self._tensors):
            raise ValueError(f"the message holds {len(self._tensors)} tensors; its items own more")
        self._at = at + n
        return StoredItem(payload, self._tensors[at:at + n])

    def check_done(self) -> None:
        """Raises ``ValueError`` if the message holds tensors no item owns."""
        if self._at != len(self._tensors):
            raise ValueError(f"the message holds {len(self._tensors)} tensors but its items "
                             f"own {self._at}")


def split_tensors(payloads: list[Payload], tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The tensors of a message, per payload (in the order the payloads own them).

    Raises:
        ValueError: the payloads own more or fewer tensors than the message holds.
    """
    cursor = TensorCursor(tensors)
    out = [cursor.item(p).tensors for p in payloads]
    cursor.check_done()
    return out
