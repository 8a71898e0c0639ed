"""Whole messages: :func:`encode` an object into ``(MessageHeader, tensors)`` and
:func:`decode` it back (see :mod:`rlcomm.comm.codec` for which objects travel how)."""

from __future__ import annotations

import collections
import dataclasses
import warnings
from typing import Any

import torch

from rlcomm.comm.codec.header import (
    _DTYPE_NAMES,
    DataclassNode,
    DictNode,
    Kind,
    MessageHeader,
    TensorMeta,
)
from rlcomm.comm.codec.pickling import pickle_object, unpickle
from rlcomm.comm.codec.structure import Walker, build, render
from rlcomm.comm.codec.tensors import check_one_device, prepare
from rlcomm.errors import CodecError

#: A ``bytes`` object of at least this many bytes travels as its content (kind ``BYTES``),
#: not pickled: the sender copies nothing, the receiver copies once into the new object
#: (a small one rides in the frame and is the object itself). The empty one is pickled.
BYTES_MIN = 1


def _bytes_view(data: bytes) -> torch.Tensor:
    """A zero-copy uint8 view of ``data`` (read-only memory: a transport only reads it)."""
    global _FROMBUFFER_WARNED
    if _FROMBUFFER_WARNED and not torch.is_warn_always_enabled():
        return torch.frombuffer(data, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "the given buffer is not writable"
        view = torch.frombuffer(data, dtype=torch.uint8)
    _FROMBUFFER_WARNED = True
    return view


#: torch warns once per process about a view of read-only memory (unless warnings are
#: set to always); once that warning was silenced here, later views skip the
#: ``catch_warnings`` (3 µs of a 4 B message's send).
_FROMBUFFER_WARNED = False


def encode(obj: Any, piggyback: Any = None) -> tuple[MessageHeader, list[torch.Tensor]]:
    """Split an object into a header and the tensors to send (contiguous, header order).

    Args:
        obj: the object; see the module docstring for which kinds have tensors extracted.
        piggyback: an optional extra object pickled into the header; ``None`` means none.

    Caveats: extracted tensors travel independently (views of one storage, or one tensor
    twice, arrive as separate copies) and arrive as plain detached tensors (an
    ``nn.Parameter`` arrives as a ``torch.Tensor``). A dataclass that the receiver cannot
    import as ``module:qualname`` (defined in a script or a function) travels by value.

    Raises:
        CodecError: CPU and CUDA tensors mixed, something unpicklable, a dataclass defined
            in a function, or a tensor that is not dense, CPU or CUDA.
    """
    pb = None if piggyback is None else pickle_object(piggyback, "piggyback payload")
    if isinstance(obj, torch.Tensor):
        meta, t = prepare(obj)
        return MessageHeader(Kind.TENSOR, [meta], None, pb), [t]
    tp = type(obj)
    is_dict = tp is dict or tp is collections.OrderedDict  # what Module.state_dict() gives
    values = obj if tp is list else obj.values() if is_dict else None
    if (
        values is not None
        and all(isinstance(v, torch.Tensor) for v in values)
        and (tp is list or all(type(k) is str for k in obj))
    ):
        keys = list(obj) if is_dict else list(range(len(obj)))
        pairs = [prepare(v) for v in values]
        metas = [m for m, _ in pairs]
        check_one_device(metas, lambda i: f"obj[{keys[i]!r}]")
        kind = Kind.TENSOR_LIST if tp is list else Kind.TENSOR_DICT
        node = None if tp is list else DictNode(keys, list(range(len(keys))))
        return MessageHeader(kind, metas, node, pb), [t for _, t in pairs]
    if tp is bytes and len(obj) >= BYTES_MIN:
        meta = TensorMeta("uint8", (len(obj),), "cpu")
        return MessageHeader(Kind.BYTES, [meta], None, pb), [_bytes_view(obj)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        walker = Walker()
        try:
            node = walker.walk(obj, ("obj",), top=True)
        except RecursionError as exc:
            raise CodecError(f"{tp.__qualname__} is nested too deeply or cyclic") from exc
        check_one_device(walker.metas, lambda i: render(walker.paths[i]))
        return MessageHeader(Kind.DATACLASS, walker.metas, node, pb), walker.tensors
    data = pickle_object(obj, "object")
    meta = TensorMeta("uint8", (len(data),), "cpu")
    return MessageHeader(Kind.OBJECT, [meta], None, pb), [_bytes_view(data)]


def encode_framed(frame: bytes, tensors: list[torch.Tensor]) -> tuple[MessageHeader, list[torch.Tensor]]:
    """The header (kind ``FRAMED``) and sendable tensors of a component's message: its
    own ``frame`` bytes (a msgspec frame, say) and ``tensors``. Nothing is pickled:
    :func:`decode` returns ``(tensors, frame)``.

    Raises:
        CodecError: the tensors mix CPU and CUDA, or one cannot be sent.
    """
    if type(frame) is not bytes:
        raise CodecError(f"a frame must be bytes, got {type(frame).__qualname__}")
    pairs = [prepare(t) for t in tensors]
    metas = [m for m, _ in pairs]
    if len(metas) > 1:
        check_one_device(metas, lambda i: f"tensors[{i}]")
    return MessageHeader(Kind.FRAMED, metas, None, frame), [t for _, t in pairs]


def encode_raw(tensor: torch.Tensor) -> tuple[MessageHeader, list[torch.Tensor]]:
    """The header (kind ``RAW``) and sendable form of one tensor, for ``send_tensor``."""
    if not isinstance(tensor, torch.Tensor):
        raise CodecError(f"send_tensor needs a torch.Tensor, got {type(tensor).__qualname__}")
    meta, t = prepare(tensor)
    return MessageHeader(Kind.RAW, [meta]), [t]


# The kinds :func:`decode` looks for first, as plain ints (an enum member's lookup costs
# about 50 ns, a tenth of decoding a small message).
_TENSOR, _BYTES, _DICT = int(Kind.TENSOR), int(Kind.BYTES), int(Kind.TENSOR_DICT)
#: ``list(range(n))``, by ``n``: the values of a flat dict's node, each key's tensor in
#: turn (what :func:`encode` makes of a dict of tensors).
_IN_TURN = [list(range(n)) for n in range(17)]


def decode(header: MessageHeader, tensors: list[torch.Tensor]) -> Any:
    """Rebuild the sent object from its header and the received tensors (header order).

    Returns:
        The object, or ``(object, piggyback)`` when the header carries a piggyback.

    Raises:
        CodecError: the tensors do not match the header, the structure is inconsistent, a
            dataclass cannot be imported here, or unpickling fails.
    """
    kind, n = header.kind, len(header.tensors)
    if header.piggyback is None and len(tensors) == n:  # the commonest messages
        if n == 1 and kind == _TENSOR:
            return tensors[0]
        if n == 1 and kind == _BYTES and type(tensors[0]) is bytes:
            return tensors[0]
        if kind == _DICT and type(header.structure) is DictNode:
            node = header.structure
            # A flat dict (a batch of rewards, a state dict) without a walk of its nodes.
            if n < len(_IN_TURN) and node.values == _IN_TURN[n] and len(node.keys) == n:
                return dict(zip(node.keys, tensors))
            return _built(node, tensors)
    if len(tensors) != n or (
        n != 1 and kind in (Kind.TENSOR, Kind.RAW, Kind.OBJECT, Kind.BYTES)
    ):
        raise CodecError(
            f"a {Kind(kind).name} message declaring {n} tensors cannot be decoded "
            f"with {len(tensors)} tensors"
        )
    if kind == Kind.FRAMED:
        if header.piggyback is None or header.structure is not None:
            raise CodecError("a FRAMED message carries no frame")
        return list(tensors), header.piggyback
    if kind == Kind.TENSOR or kind == Kind.RAW:
        obj: Any = tensors[0]
    elif kind == Kind.TENSOR_LIST:
        obj = list(tensors)
    elif kind == Kind.OBJECT:
        obj = unpickle(tensors[0], "object")
    elif kind == Kind.BYTES:
        obj = _to_bytes(tensors[0], header.tensors[0])
    elif type(header.structure) is (DictNode if kind == Kind.TENSOR_DICT else DataclassNode):
        obj = _built(header.structure, tensors)
    else:
        raise CodecError(f"a {Kind(kind).name} message has structure {header.structure!r}")
    if header.piggyback is not None:
        return obj, unpickle(header.piggyback, "piggyback payload")
    return obj


def _built(structure: DictNode | DataclassNode, tensors: list[torch.Tensor]) -> Any:
    try:
        return build(structure, tensors)
    except RecursionError as exc:
        raise CodecError("the message structure is nested too deeply") from exc


def destinations(header: MessageHeader, into: Any) -> list[torch.Tensor]:
    """The tensors of ``into`` that receive a message's tensors, in header order: a
    receive *into* existing tensors (a weight sync into a model's parameters).

    ``into`` matches the message's shape of object: a tensor for a tensor, a list (or
    tuple) of as many tensors for a list, a mapping holding every key of a dict (keys the
    message lacks are left alone). Each tensor must have the sent dtype and shape; its
    device may differ.

    Raises:
        CodecError: ``into`` does not fit the message; the error names where.
    """
    kind, metas = header.kind, header.tensors
    if kind == Kind.TENSOR or kind == Kind.RAW:
        targets, names = [into], ["the tensor"]
    elif kind == Kind.TENSOR_LIST:
        if not isinstance(into, (list, tuple)) or len(into) != len(metas):
            raise CodecError(
                f"into= must be a list of {len(metas)} tensors for this message (a list), "
                f"got {_describe(into)}"
            )
        targets, names = list(into), [f"into[{i}]" for i in range(len(metas))]
    elif kind == Kind.TENSOR_DICT and type(header.structure) is DictNode:
        keys = header.structure.keys
        if not hasattr(into, "keys") or not hasattr(into, "__getitem__"):
            raise CodecError(f"into= must be a dict for this message (a dict), got {_describe(into)}")
        missing = [k for k in keys if k not in into]
        if missing:
            raise CodecError(f"into= lacks keys {missing[:8]} of the received dict"
                             f"{' (and more)' if len(missing) > 8 else ''}")
        targets, names = [into[k] for k in keys], [f"into[{k!r}]" for k in keys]
    else:
        raise CodecError(
            f"a {Kind(kind).name} message cannot be received into tensors: into= takes a "
            "tensor, a list of tensors or a dict of str to tensors"
        )
    for target, name, meta in zip(targets, names, metas, strict=True):
        if not isinstance(target, torch.Tensor):
            raise CodecError(f"{name} is a {type(target).__qualname__}, not a tensor")
        got = _DTYPE_NAMES.get(target.dtype)
        if (got, tuple(target.shape)) != (meta.dtype, tuple(meta.shape)):
            raise CodecError(
                f"{name} is {got} of shape {tuple(target.shape)} but the sender sent "
                f"{meta.dtype} of shape {tuple(meta.shape)}"
            )
    return targets


def _describe(obj: Any) -> str:
    return f"a {type(obj).__qualname__}" + (f" of {len(obj)}" if hasattr(obj, "__len__") else "")


def _to_bytes(data: torch.Tensor | bytes, meta: TensorMeta) -> bytes:
    """The ``bytes`` object of a ``BYTES`` message (inline bytes stay as they are)."""
    if isinstance(data, bytes):
        return data
    if meta.dtype != "uint8" or data.dtype is not torch.uint8 or data.dim() != 1 or not data.is_cpu:
        raise CodecError(f"a BYTES message carries a {meta.dtype} {data.dtype} tensor, not "
                         "flat uint8 CPU bytes")
    return data.numpy().tobytes()
