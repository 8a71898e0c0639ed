"""Dataclass messages: walking an object for its tensors into a structure tree
(:class:`~rlcomm.comm.codec.header.DataclassNode` and friends), and rebuilding it."""

from __future__ import annotations

import dataclasses
import importlib
import io
import pickle
from typing import Any

import cloudpickle
import torch

from rlcomm.comm.codec.header import (
    DataclassNode,
    DictNode,
    ListNode,
    Node,
    TensorMeta,
    TupleNode,
)
from rlcomm.comm.codec.pickling import PICKLE_PROTOCOL, StrictUnpickler, strict_mode
from rlcomm.comm.codec.tensors import prepare
from rlcomm.errors import CodecError

_CLASS_INFO: dict[type, tuple[str, bytes | None, tuple[str, ...]]] = {}
_CLASSES: dict[str | bytes, type] = {}


class _Attr(str):
    """An attribute name in a path: rendered ``.name`` where keys render ``['key']``."""


def render(path: tuple) -> str:
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
        # A script's __main__ imports back in the sender only: the receiver's __main__ is
        # another program, so such a class goes by value too.
        if cls.__module__ == "__main__" or "<locals>" in path or _importable(path) is not cls:
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

    def __init__(self, file: io.BytesIO, walker: Walker, path: tuple):
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
            return StrictUnpickler.find_class(self, module, name)  # type: ignore[arg-type]
        return super().find_class(module, name)


class Walker:
    """Extracts the tensors of one dataclass message and builds its structure tree."""

    def __init__(self) -> None:
        self.metas: list[TensorMeta] = []
        self.tensors: list[torch.Tensor] = []
        self.paths: list[tuple] = []  # where each tensor was found, for error messages

    def tensor(self, t: torch.Tensor, path: tuple) -> int:
        meta, t = prepare(t)
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
                f"cannot pickle {render(path)} of type {type(value).__qualname__}: {exc}"
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


def build(node: Any, tensors: list[torch.Tensor]) -> Any:
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
        items = [build(n, tensors) for n in node.items]
        return items if tp is ListNode else tuple(items)
    if tp is not DictNode and tp is not DataclassNode:
        raise CodecError(f"invalid node {node!r} in a message structure")
    names = node.keys if tp is DictNode else node.names
    if len(names) != len(node.values):
        raise CodecError(f"message structure has {len(names)} names, {len(node.values)} values")
    values = [build(v, tensors) for v in node.values]
    if tp is DictNode:
        return dict(zip(names, values, strict=True))
    cls = _resolve_class(node.by_value or node.cls)
    obj = cls.__new__(cls)
    for name, value in zip(names, values, strict=True):
        object.__setattr__(obj, name, value)
    return obj
