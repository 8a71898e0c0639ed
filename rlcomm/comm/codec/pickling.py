"""Pickled parts of a message: objects that are not tensor containers, piggyback
payloads, and strict mode, which refuses pickles that could run code on the receiver."""

from __future__ import annotations

import io
import pickle
import threading
from collections import ChainMap
from typing import Any

import cloudpickle
import torch

from rlcomm.comm.codec.header import _DTYPE_NAMES, _dtype_of
from rlcomm.comm.codec.tensors import as_bytes, prepare
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
} | {(__name__, "_rebuild_tensor"), ("_codecs", "encode")}


class StrictUnpickler(pickle.Unpickler):
    """Refuses every global outside :data:`_STRICT_GLOBALS` (strict mode)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _STRICT_GLOBALS:
            raise CodecError(
                f"strict mode: the message names {module}.{name}, which strict mode does "
                "not unpickle (only plain values, tensors and importable dataclasses travel)"
            )
        return super().find_class(module, name)
def _reduce_tensor(t: torch.Tensor) -> tuple:
    """Pickle a tensor as its bytes: torch's own reduce cannot load float8, uint16, ..."""
    if (
        t.layout is not torch.strided
        or t.is_nested
        or t.dtype not in _DTYPE_NAMES
        or not (t.is_cpu or t.is_cuda)
    ):
        return t.__reduce_ex__(PICKLE_PROTOCOL)  # torch's own way, or its own error
    meta, t = prepare(t)
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


def pickle_object(obj: Any, what: str) -> bytes:
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


def unpickle(data: bytes | torch.Tensor, what: str) -> Any:
    try:
        if isinstance(data, torch.Tensor):  # a zero-copy buffer for pickle
            is_flat_bytes = data.dtype is torch.uint8 and data.dim() == 1 and data.is_cpu
            data = data.numpy() if is_flat_bytes else as_bytes(data).cpu().numpy()
        if strict_mode():
            return StrictUnpickler(io.BytesIO(data)).load()
        return pickle.loads(data)
    except CodecError:
        raise
    except Exception as exc:
        raise CodecError(f"cannot unpickle the received {what}: {exc}") from exc


