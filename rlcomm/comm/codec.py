"""The message codec: a Python object in, ``(MessageHeader, tensors)`` out, and back.

Pure: no I/O, no Ray, no torch.distributed. A transport sends :func:`header_to_bytes` then
each tensor's memory (:func:`as_bytes`); the receiver parses :func:`header_from_bytes`,
allocates buffers with :func:`empty_like_meta`, receives into them and calls :func:`decode`.

- a tensor, a ``list`` of tensors, a ``dict`` of ``str`` to tensors and a dataclass
  instance (its fields walked through lists, tuples, str-keyed dicts and nested
  dataclasses) have their tensors *extracted*: never pickled, sent as raw memory, so CUDA
  tensors can go through NCCL. Non-tensor parts of a dataclass are pickled into the header;
  a tensor hidden in a pickled part (say a namedtuple) is extracted as well.
- anything else (tuples, nested dicts, dicts with non-``str`` keys, strings, ...) is
  pickled (protocol 5) into ONE ``uint8`` CPU tensor, kind ``OBJECT``. Tensors inside it
  are copied into the pickle; CUDA ones come back on the same device index (``cuda:1``).

A message may carry zero tensors (an empty list or dict, a dataclass without tensors).

*Strict mode* (:func:`set_strict_mode`, or ``RLCOMM_STRICT=1`` in the environment when
rlcomm is imported) unpickles nothing that can run code: pickled parts may only build
plain values (numbers, strings, bytes, lists, tuples, dicts, sets, ``None``) and tensors;
any other class or function named in a pickle, and dataclasses sent by value, are
refused with :class:`~rlcomm.errors.CodecError`. Tensors, containers of them, importable
dataclasses and plain values still travel.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import math
import pickle
import threading
from collections import ChainMap
from enum import IntEnum
from typing import Annotated, Any, Literal

import cloudpickle
import msgspec
import torch

from rlcomm.errors import CodecError
from rlcomm.settings import get_settings, update_settings

PICKLE_PROTOCOL = 5


def set_strict_mode(strict: bool) -> None:
    """Refuse (True) or allow (False) received pickles that name any class or function
    beyond plain values and tensors, in this process (see the module docstring); the
    ``strict`` setting, so workers launched afterwards get it too."""
    update_settings(strict=bool(strict))


def strict_mode() -> bool:
    """Whether strict mode is on in this process."""
    return get_settings().strict


#: What a strict unpickler may build besides the opcodes for plain values.
_STRICT_GLOBALS = {
    ("builtins", name)
    for name in ("int", "float", "complex", "bool", "str", "bytes", "bytearray", "list",
                 "tuple", "dict", "set", "frozenset", "slice", "range")
} | {("rlcomm.comm.codec", "_rebuild_tensor"), ("_codecs", "encode")}


class _StrictUnpickler(pickle.Unpickler):
    """Refuses every global outside :data:`_STRICT_GLOBALS` (strict mode)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _STRICT_GLOBALS:
            raise CodecError(
                f"strict mode: the message names {module}.{name}, which strict mode does "
                "not unpickle (only plain values, tensors and importable dataclasses travel)"
            )
        return super().find_class(module, name)
# Every torch dtype by its short name ("float32", "bfloat16", "float8_e4m3fn", ...),
# except the quantized ones, whose scale and zero point a header cannot carry.
_DTYPE_NAMES: dict[torch.dtype, str] = {
    dt: str(dt).removeprefix("torch.")
    for dt in vars(torch).values()
    if isinstance(dt, torch.dtype) and not str(dt).startswith("torch.q")
}
_DTYPES: dict[str, torch.dtype] = {name: dt for dt, name in _DTYPE_NAMES.items()}


class Kind(IntEnum):
    """What a message holds, hence how :func:`decode` rebuilds it."""

    TENSOR = 0  #: one tensor
    TENSOR_LIST = 1  #: a ``list`` of tensors
    TENSOR_DICT = 2  #: a ``dict`` of ``str`` to tensors
    DATACLASS = 3  #: a dataclass instance, see :class:`DataclassNode`
    OBJECT = 4  #: anything else, pickled into one ``uint8`` CPU tensor
    RAW = 5  #: one tensor for ``send_tensor``/``recv_tensor``; the header is not sent


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
    """

    kind: Kind
    tensors: list[TensorMeta]
    structure: Node | None = None
    piggyback: bytes | None = None
    inline: Annotated[int, msgspec.Meta(ge=0)] = 0


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


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype of a :class:`TensorMeta` dtype name."""
    return _dtype_of(name)


def meta_of(t: torch.Tensor) -> TensorMeta:
    """The :class:`TensorMeta` describing a cpu or cuda tensor as it would be sent."""
    return TensorMeta(_DTYPE_NAMES[t.dtype], tuple(t.shape), "cuda" if t.is_cuda else "cpu")


def _dtype_of(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise CodecError(f"unknown dtype {name!r} in a tensor meta") from None


def empty_like_meta(meta: TensorMeta, device: torch.device | str | None = None) -> torch.Tensor:
    """Allocate an uninitialised receive buffer for the tensor that ``meta`` describes.

    Args:
        meta: the tensor's metadata from a received header.
        device: where to allocate; by default ``cpu`` or this process's current CUDA device.

    Raises:
        CodecError: unknown dtype, or a CUDA tensor arrives where CUDA is not available.
    """
    if device is None:
        if meta.device == "cuda" and not torch.cuda.is_available():
            raise CodecError(
                "the sender sent a CUDA tensor but CUDA is not available in this process; "
                "send CPU tensors or give the receiving worker a GPU"
            )
        device = meta.device
    return torch.empty(meta.shape, dtype=_dtype_of(meta.dtype), device=device)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a contiguous tensor's memory (any dtype, 0-d included).

    Writing into the view writes into ``t``, so a transport can receive any dtype as bytes.

    Raises:
        CodecError: ``t`` is not contiguous, or has a lazy conjugate/negative bit.
    """
    if not t.is_contiguous() or t.is_conj() or t.is_neg():
        raise CodecError(
            f"as_bytes needs a contiguous tensor without lazy conj/neg bits, got shape "
            f"{tuple(t.shape)} strides {t.stride()}; call .contiguous() / .resolve_conj() first"
        )
    if t.requires_grad:
        t = t.detach()
    return t.reshape(-1).view(torch.uint8)


def _prepare(t: torch.Tensor) -> tuple[TensorMeta, torch.Tensor]:
    """The meta and the sendable form of a tensor: detached, resolved, contiguous."""
    device = "cpu" if t.is_cpu else "cuda" if t.is_cuda else None  # t.device.type is slower
    name = _DTYPE_NAMES.get(t.dtype)
    if device is None or name is None or t.layout is not torch.strided or t.is_nested:
        raise CodecError(
            f"cannot send a {'nested ' * t.is_nested}{t.layout} {t.dtype} tensor on {t.device}: "
            "only dense, non-quantized cpu and cuda tensors can be sent; convert it first "
            "(.cpu(), .cuda(), .to_dense(), .dequantize())"
        )
    if t.requires_grad:
        t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    return TensorMeta(name, tuple(t.shape), device), t


def _reduce_tensor(t: torch.Tensor) -> tuple:
    """Pickle a tensor as its bytes: torch's own reduce cannot load float8, uint16, ..."""
    if (
        t.layout is not torch.strided
        or t.is_nested
        or t.dtype not in _DTYPE_NAMES
        or not (t.is_cpu or t.is_cuda)
    ):
        return t.__reduce_ex__(PICKLE_PROTOCOL)  # torch's own way, or its own error
    meta, t = _prepare(t)
    data = as_bytes(t).cpu().numpy().tobytes()
    return _rebuild_tensor, (data, meta.dtype, meta.shape, str(t.device))


def _rebuild_tensor(data: bytes, dtype: str, shape: tuple[int, ...], device: str) -> torch.Tensor:
    t = torch.empty(shape, dtype=_dtype_of(dtype))
    if data:
        as_bytes(t).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    return t if device == "cpu" else t.to(device)


# Looked up by exact type, so tensor subclasses (nn.Parameter) keep their own pickling.
_OBJECT_DISPATCH = ChainMap({torch.Tensor: _reduce_tensor}, cloudpickle.Pickler.dispatch_table)


class _ObjectPickler(cloudpickle.Pickler):
    """cloudpickle (classes and functions of ``__main__`` travel by value) with tensors
    pickled as their bytes. A subclass attribute: cloudpickle's own shadows an instance one."""

    dispatch_table = _OBJECT_DISPATCH


class _ReusedPickler(threading.local):
    """One pickler per thread, reset between uses (making one costs more than a small
    message's whole pickling)."""

    def __init__(self) -> None:
        self.buf = io.BytesIO()
        self.pickler = _ObjectPickler(self.buf, protocol=PICKLE_PROTOCOL)
        self.in_use = False


_reused = _ReusedPickler()


def _pickle(obj: Any, what: str) -> bytes:
    """Pickle ``obj``; tensors in it travel detached and contiguous, on the same device."""
    state = _reused
    if state.in_use:  # re-entered from inside a pickling: a fresh pickler
        buf = io.BytesIO()
        pickler = _ObjectPickler(buf, protocol=PICKLE_PROTOCOL)
    else:
        state.in_use = True
        buf, pickler = state.buf, state.pickler
    try:
        pickler.dump(obj)
        return buf.getvalue()
    except Exception as exc:
        raise CodecError(
            f"cannot pickle the {what} of type {type(obj).__qualname__}: {exc}"
        ) from exc
    finally:
        if buf is state.buf:
            buf.seek(0)
            buf.truncate()
            pickler.clear_memo()
            pickler.globals_ref = {}  # cloudpickle's per-pickling state
            state.in_use = False


def _unpickle(data: bytes | torch.Tensor, what: str) -> Any:
    try:
        if isinstance(data, torch.Tensor):  # a zero-copy buffer for pickle
            is_flat_bytes = data.dtype is torch.uint8 and data.dim() == 1 and data.is_cpu
            data = data.numpy() if is_flat_bytes else as_bytes(data).cpu().numpy()
        if strict_mode():
            return _StrictUnpickler(io.BytesIO(data)).load()
        return pickle.loads(data)
    except CodecError:
        raise
    except Exception as exc:
        raise CodecError(f"cannot unpickle the received {what}: {exc}") from exc


def _check_one_device(metas: list[TensorMeta], where: Any) -> None:
    """Raise if ``metas`` mix CPU and CUDA; ``where(i)`` describes tensor ``i``."""
    if len({m.device for m in metas}) > 1:
        first = metas[0].device
        i = next(i for i, m in enumerate(metas) if m.device != first)
        raise CodecError(
            f"cannot mix CPU and CUDA tensors in one message: {where(0)} is on {first} "
            f"but {where(i)} is on {metas[i].device}; move them to one device first"
        )


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
    pb = None if piggyback is None else _pickle(piggyback, "piggyback payload")
    if isinstance(obj, torch.Tensor):
        meta, t = _prepare(obj)
        return MessageHeader(Kind.TENSOR, [meta], None, pb), [t]
    tp = type(obj)
    values = obj if tp is list else obj.values() if tp is dict else None
    if (
        values is not None
        and all(isinstance(v, torch.Tensor) for v in values)
        and (tp is list or all(type(k) is str for k in obj))
    ):
        keys = list(obj) if tp is dict else list(range(len(obj)))
        pairs = [_prepare(v) for v in values]
        metas = [m for m, _ in pairs]
        _check_one_device(metas, lambda i: f"obj[{keys[i]!r}]")
        kind = Kind.TENSOR_LIST if tp is list else Kind.TENSOR_DICT
        node = None if tp is list else DictNode(keys, list(range(len(keys))))
        return MessageHeader(kind, metas, node, pb), [t for _, t in pairs]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        walker = _Walker()
        try:
            node = walker.walk(obj, ("obj",), top=True)
        except RecursionError as exc:
            raise CodecError(f"{tp.__qualname__} is nested too deeply or cyclic") from exc
        _check_one_device(walker.metas, lambda i: _render(walker.paths[i]))
        return MessageHeader(Kind.DATACLASS, walker.metas, node, pb), walker.tensors
    data = _pickle(obj, "object")
    meta = TensorMeta("uint8", (len(data),), "cpu")
    return MessageHeader(Kind.OBJECT, [meta], None, pb), [
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
    ]


def encode_raw(tensor: torch.Tensor) -> tuple[MessageHeader, list[torch.Tensor]]:
    """The header (kind ``RAW``) and sendable form of one tensor, for ``send_tensor``."""
    if not isinstance(tensor, torch.Tensor):
        raise CodecError(f"send_tensor needs a torch.Tensor, got {type(tensor).__qualname__}")
    meta, t = _prepare(tensor)
    return MessageHeader(Kind.RAW, [meta]), [t]


def decode(header: MessageHeader, tensors: list[torch.Tensor]) -> Any:
    """Rebuild the sent object from its header and the received tensors (header order).

    Returns:
        The object, or ``(object, piggyback)`` when the header carries a piggyback.

    Raises:
        CodecError: the tensors do not match the header, the structure is inconsistent, a
            dataclass cannot be imported here, or unpickling fails.
    """
    kind, n = header.kind, len(header.tensors)
    if len(tensors) != n or (n != 1 and kind in (Kind.TENSOR, Kind.RAW, Kind.OBJECT)):
        raise CodecError(
            f"a {Kind(kind).name} message declaring {n} tensors cannot be decoded "
            f"with {len(tensors)} tensors"
        )
    if kind == Kind.TENSOR or kind == Kind.RAW:
        obj: Any = tensors[0]
    elif kind == Kind.TENSOR_LIST:
        obj = list(tensors)
    elif kind == Kind.OBJECT:
        obj = _unpickle(tensors[0], "object")
    elif type(header.structure) is (DictNode if kind == Kind.TENSOR_DICT else DataclassNode):
        try:
            obj = _build(header.structure, tensors)
        except RecursionError as exc:
            raise CodecError("the message structure is nested too deeply") from exc
    else:
        raise CodecError(f"a {Kind(kind).name} message has structure {header.structure!r}")
    if header.piggyback is not None:
        return obj, _unpickle(header.piggyback, "piggyback payload")
    return obj


# --- dataclass walking and rebuilding ----------------------------------------------------

_CLASS_INFO: dict[type, tuple[str, bytes | None, tuple[str, ...]]] = {}
_CLASSES: dict[str | bytes, type] = {}


class _Attr(str):
    """An attribute name in a path: rendered ``.name`` where keys render ``['key']``."""


def _render(path: tuple) -> str:
    """``("obj", _Attr("field"), 0, "key")`` -> ``obj.field[0]['key']``."""
    return str(path[0]) + "".join(f".{p}" if isinstance(p, _Attr) else f"[{p!r}]" for p in path[1:])


def _class_info(cls: type) -> tuple[str, bytes | None, tuple[str, ...]]:
    """How the receiver finds a dataclass, and its field names (cached per class).

    ``"module:qualname"``, plus, when that does not import back to the class (a class
    defined in a script's ``__main__`` or in a function), the class pickled by value with
    cloudpickle, which gives one class object per process however often it arrives.
    """
    info = _CLASS_INFO.get(cls)
    if info is None:
        path = f"{cls.__module__}:{cls.__qualname__}"
        by_value = None
        if "<locals>" in path or _importable(path) is not cls:
            try:
                by_value = cloudpickle.dumps(cls, protocol=PICKLE_PROTOCOL)
            except Exception as exc:
                raise CodecError(f"cannot send dataclass {path}: cannot pickle it ({exc})") from exc
        info = _CLASS_INFO[cls] = (path, by_value, tuple(f.name for f in dataclasses.fields(cls)))
    return info


def _importable(path: str) -> type | None:
    try:
        return _resolve_class(path, cached=False)
    except CodecError:
        return None


def _resolve_class(path: str | bytes, cached: bool = True) -> type:
    cls = _CLASSES.get(path) if cached else None
    if cls is None:
        if isinstance(path, bytes):
            if strict_mode():
                raise CodecError(
                    "strict mode: a dataclass sent by value (defined in a script or a "
                    "function) is refused; define it in an importable module"
                )
            try:
                found: Any = cloudpickle.loads(path)
            except Exception as exc:
                raise CodecError(f"cannot unpickle a dataclass sent by value: {exc}") from exc
        else:
            module, _, qualname = path.partition(":")
            try:
                found = importlib.import_module(module)
                for part in qualname.split("."):
                    found = getattr(found, part)
            except Exception as exc:
                raise CodecError(
                    f"cannot import dataclass {path} to rebuild a message ({exc}); the sending "
                    "and the receiving process must both be able to import it"
                ) from exc
        if not (isinstance(found, type) and dataclasses.is_dataclass(found)):
            raise CodecError(f"{path!r:.80} named in a message header is not a dataclass")
        cls = _CLASSES[path] = found
    return cls


def _tensor_at(tensors: list[torch.Tensor], index: Any) -> torch.Tensor:
    if type(index) is not int or not 0 <= index < len(tensors):
        raise CodecError(f"message structure refers to tensor {index!r} of {len(tensors)}")
    return tensors[index]


class _LeafPickler(cloudpickle.Pickler):
    """Pickles a value, extracting every tensor inside it as a persistent id."""

    def __init__(self, file: io.BytesIO, walker: _Walker, path: tuple):
        super().__init__(file, protocol=PICKLE_PROTOCOL)
        self._walker, self._path = walker, (*path, _Attr("<pickled>"))

    def persistent_id(self, obj: Any) -> int | None:
        return self._walker.tensor(obj, self._path) if isinstance(obj, torch.Tensor) else None


class _LeafUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]):
        super().__init__(file)
        self.persistent_load = lambda pid: _tensor_at(tensors, pid)

    def find_class(self, module: str, name: str) -> Any:
        if strict_mode():
            return _StrictUnpickler.find_class(self, module, name)  # type: ignore[arg-type]
        return super().find_class(module, name)


class _Walker:
    """Extracts the tensors of one dataclass message and builds its structure tree."""

    def __init__(self) -> None:
        self.metas: list[TensorMeta] = []
        self.tensors: list[torch.Tensor] = []
        self.paths: list[tuple] = []  # where each tensor was found, for error messages

    def tensor(self, t: torch.Tensor, path: tuple) -> int:
        meta, t = _prepare(t)
        self.metas.append(meta)
        self.tensors.append(t)
        self.paths.append(path)
        return len(self.tensors) - 1

    def leaf(self, value: Any, path: tuple) -> bytes:
        buf = io.BytesIO()
        try:
            _LeafPickler(buf, self, path).dump(value)
        except CodecError:
            raise
        except Exception as exc:
            raise CodecError(
                f"cannot pickle {_render(path)} of type {type(value).__qualname__}: {exc}"
            ) from exc
        return buf.getvalue()

    def walk(self, x: Any, path: tuple, top: bool = False) -> Node | None:
        """The node for ``x``; ``None`` if it holds no tensor (its parent pickles it)."""
        if isinstance(x, torch.Tensor):
            return self.tensor(x, path)
        tp = type(x)
        if tp is list or tp is tuple:
            keys: list[Any] = list(range(len(x)))
            values = list(x)
        elif tp is dict and all(type(k) is str for k in x):
            keys, values = list(x), list(x.values())
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            cls_path, by_value, fields = _class_info(tp)
            extra = [n for n in getattr(x, "__dict__", ()) if n not in fields]
            keys = [_Attr(n) for n in (*fields, *extra) if hasattr(x, n)]
            values = [getattr(x, n) for n in keys]
        else:
            return None
        nodes = [self.walk(v, (*path, k)) for k, v in zip(keys, values, strict=True)]
        if not top and all(n is None for n in nodes):
            return None
        nodes = [
            self.leaf(v, (*path, k)) if n is None else n
            for k, v, n in zip(keys, values, nodes, strict=True)
        ]
        if tp is list or tp is tuple:
            return ListNode(nodes) if tp is list else TupleNode(nodes)
        if tp is dict:
            return DictNode(keys, nodes)
        return DataclassNode(cls_path, [str(k) for k in keys], nodes, by_value)


def _build(node: Any, tensors: list[torch.Tensor]) -> Any:
    """Rebuild a value from its structure node."""
    tp = type(node)
    if tp is int:
        return _tensor_at(tensors, node)
    if tp is bytes:
        try:
            return _LeafUnpickler(io.BytesIO(node), tensors).load()
        except CodecError:
            raise
        except Exception as exc:
            raise CodecError(f"cannot unpickle a value of the received message: {exc}") from exc
    if tp is ListNode or tp is TupleNode:
        items = [_build(n, tensors) for n in node.items]
        return items if tp is ListNode else tuple(items)
    if tp is not DictNode and tp is not DataclassNode:
        raise CodecError(f"invalid node {node!r} in a message structure")
    names = node.keys if tp is DictNode else node.names
    if len(names) != len(node.values):
        raise CodecError(f"message structure has {len(names)} names, {len(node.values)} values")
    values = [_build(v, tensors) for v in node.values]
    if tp is DictNode:
        return dict(zip(names, values, strict=True))
    cls = _resolve_class(node.by_value or node.cls)
    obj = cls.__new__(cls)
    for name, value in zip(names, values, strict=True):
        object.__setattr__(obj, name, value)
    return obj
