"""The wire form of a message's description: :class:`MessageHeader` and its parts
(msgspec structs, one encoder and decoder per process), and the names of dtypes on the
wire."""

from __future__ import annotations

import math
from enum import IntEnum
from typing import Annotated, Literal

import msgspec
import torch

from rlcomm.errors import CodecError

# Every torch dtype by its short name ("float32", "bfloat16", "float8_e4m3fn", ...),
# except the quantized ones, whose scale and zero point a header cannot carry.
_DTYPE_NAMES: dict[torch.dtype, str] = {
    dt: str(dt).removeprefix("torch.")
    for dt in vars(torch).values()
    if isinstance(dt, torch.dtype) and not str(dt).startswith("torch.q")
}
_DTYPES: dict[str, torch.dtype] = {name: dt for dt, name in _DTYPE_NAMES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype (``"bfloat16"``).

    Raises:
        CodecError: a dtype a header cannot carry (a quantized one).
    """
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise CodecError(f"{dtype} cannot travel in a tensor meta") from None


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype of a :class:`TensorMeta` dtype name."""
    return _dtype_of(name)


def _dtype_of(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise CodecError(f"unknown dtype {name!r} in a tensor meta") from None



class Kind(IntEnum):
    """What a message holds, hence how :func:`decode` rebuilds it."""

    TENSOR = 0  #: one tensor
    TENSOR_LIST = 1  #: a ``list`` of tensors
    TENSOR_DICT = 2  #: a ``dict`` of ``str`` to tensors
    DATACLASS = 3  #: a dataclass instance, see :class:`DataclassNode`
    OBJECT = 4  #: anything else, pickled into one ``uint8`` CPU tensor
    RAW = 5  #: one tensor for ``send_tensor``/``recv_tensor``; the header is not sent
    BYTES = 6  #: a large ``bytes`` object, its content as one ``uint8`` CPU tensor
    FRAMED = 7  #: tensors and a component's own frame bytes (in ``piggyback``; no pickle)


class TensorMeta(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Dtype, shape and device type of one tensor of a message.

    ``device`` is the device *type*: the receiver allocates on its own current device.
    """

    dtype: str
    shape: tuple[Annotated[int, msgspec.Meta(ge=0)], ...]
    device: Literal["cpu", "cuda"]

    @property
    def nbytes(self) -> int:
        """Size of the tensor's memory in bytes."""
        return math.prod(self.shape) * _dtype_of(self.dtype).itemsize


# The structure of a DATACLASS or TENSOR_DICT message, a tree whose leaves are an ``int``
# (index of a tensor in ``MessageHeader.tensors``) or ``bytes`` (a pickled value; tensors
# inside it are pickle persistent ids, again indices into ``MessageHeader.tensors``).
class ListNode(msgspec.Struct, array_like=True, tag=0):
    """A ``list`` holding at least one tensor."""

    items: list[Node]


class TupleNode(msgspec.Struct, array_like=True, tag=1):
    """An exact ``tuple`` holding at least one tensor."""

    items: list[Node]


class DictNode(msgspec.Struct, array_like=True, tag=2):
    """A ``dict`` with ``str`` keys holding at least one tensor."""

    keys: list[str]
    values: list[Node]


class DataclassNode(msgspec.Struct, array_like=True, tag=3):
    """A dataclass instance: ``"module:qualname"`` of its class, attribute names, values.

    It is rebuilt like pickle does, ``cls.__new__(cls)`` then each attribute set, so
    ``__init__`` and ``__post_init__`` are not run and frozen or slotted classes work.
    """

    cls: str
    names: list[str]
    values: list[Node]
    #: the class pickled by value, when ``cls`` does not import on the receiver
    by_value: bytes | None = None


Node = int | bytes | ListNode | TupleNode | DictNode | DataclassNode


class MessageHeader(msgspec.Struct, array_like=True):
    """Everything the receiver needs besides the tensors' memory.

    Attributes:
        kind: how to rebuild the object.
        tensors: one :class:`TensorMeta` per tensor, in send order.
        structure: a :class:`DictNode` for ``TENSOR_DICT``, a :class:`DataclassNode`
            for ``DATACLASS``, else ``None``.
        piggyback: the pickled piggyback payload, ``None`` when there is none.
        inline: leading payload bytes the transport carries inline (the codec ignores it).
        stream: the bytes of each bucket when the payload streams in buckets (0: it
            does not; see :mod:`rlcomm.comm.buckets`; the codec ignores it).
    """

    kind: Kind
    tensors: list[TensorMeta]
    structure: Node | None = None
    piggyback: bytes | None = None
    inline: Annotated[int, msgspec.Meta(ge=0)] = 0
    stream: Annotated[int, msgspec.Meta(ge=0)] = 0


_HEADER_ENCODER = msgspec.msgpack.Encoder()
_HEADER_DECODER = msgspec.msgpack.Decoder(MessageHeader)


def header_to_bytes(header: MessageHeader) -> bytes:
    """The msgpack bytes of a header."""
    return _HEADER_ENCODER.encode(header)


def header_from_bytes(data: bytes | bytearray | memoryview) -> MessageHeader:
    """Parse and validate header bytes from :func:`header_to_bytes`.

    Raises:
        CodecError: the bytes are not a valid header (truncated, garbage, unknown dtype).
    """
    try:
        header = _HEADER_DECODER.decode(data)
    except (msgspec.DecodeError, ValueError) as exc:  # ValueError: bad UTF-8 in a str
        raise CodecError(f"invalid message header ({len(data)} bytes): {exc}") from exc
    for meta in header.tensors:
        if meta.dtype not in _DTYPES:
            raise CodecError(f"invalid message header: unknown dtype {meta.dtype!r}")
    return header


