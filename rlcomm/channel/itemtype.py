"""Typed channels: checking an item against a declared ``item_type``, in the producer.

``item_type`` may be a class (a dataclass, a msgspec ``Struct``, ``torch.Tensor``, ``int``,
...; checked with ``isinstance``) or a typing form over such classes:

- ``list[X]``, ``set[X]``, ``frozenset[X]``, ``tuple[X, ...]``, ``tuple[X, Y]`` and the
  ``collections.abc`` forms (``Sequence[X]``, ``Mapping[K, V]``, ...): the container
  type, then every element;
- ``dict[K, V]``: every key and value;
- ``X | Y``, ``Optional[X]``, ``Union[...]``; ``Literal[...]``; ``Annotated[X, ...]``
  (checks ``X``); ``Any`` (anything);
- any other parameterized class ``C[...]``: ``isinstance(item, C)``.

As in type checkers, an ``int`` passes for ``float`` (and ints and floats for
``complex``). Fields of dataclasses and Structs are not checked beyond their class.
"""

from __future__ import annotations

import collections.abc
import types
import typing
from typing import Any

from rlcomm.errors import ChannelTypeError

_UNION_ORIGINS = (typing.Union, types.UnionType)
_SEQUENCE_ORIGINS = (
    list, set, frozenset, collections.abc.Sequence, collections.abc.MutableSequence,
    collections.abc.Set, collections.abc.MutableSet, collections.abc.Collection,
    collections.abc.Iterable,
)
_MAPPING_ORIGINS = (dict, collections.abc.Mapping, collections.abc.MutableMapping)
_NUMERIC = {float: (int, float), complex: (int, float, complex)}


def describe_type(tp: Any) -> str:
    """A short readable name of a type or typing form: ``list[Rollout]``, ``int | None``."""
    if tp is None or tp is type(None):
        return "None"
    if tp is Any:
        return "Any"
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in _UNION_ORIGINS:
        return " | ".join(describe_type(a) for a in args)
    if origin is typing.Literal:
        return f"Literal[{', '.join(map(repr, args))}]"
    if origin is typing.Annotated:
        return describe_type(args[0])
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else describe_type(a) for a in args)
        return f"{describe_type(origin)}[{inner}]"
    if isinstance(tp, type):
        module = tp.__module__
        if module == "builtins":
            return tp.__qualname__
        if module.startswith("torch"):
            return f"torch.{tp.__qualname__}"
        return tp.__qualname__
    return repr(tp)


def validate_type(tp: Any) -> None:
    """Check that ``tp`` is a form :func:`check_item` understands.

    Raises:
        TypeError: a string (forward reference), a ``TypeVar`` or an object that is
            neither a class nor a typing form.
    """
    if tp is None or tp is Any or tp is type(None):
        return
    origin = typing.get_origin(tp)
    if origin is not None:
        args = typing.get_args(tp)
        if origin is typing.Literal:
            return
        if origin is typing.Annotated:
            validate_type(args[0])
            return
        for a in args:
            if a is not Ellipsis:
                validate_type(a)
        return
    if isinstance(tp, type):
        return
    raise TypeError(
        f"item_type must be a class or a typing form over classes (list[X], dict[str, X], "
        f"X | None, ...), got {tp!r} of type {type(tp).__name__}"
    )


def check_item(item: Any, tp: Any) -> str | None:
    """``None`` if ``item`` conforms to ``tp``, else what does not (``"item[2] is a str"``)."""
    return _check(item, tp, "item")


def _what(value: Any) -> str:
    if value is None:
        return "None"
    name = describe_type(type(value))
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _check(value: Any, tp: Any, path: str) -> str | None:
    if tp is Any:
        return None
    if tp is None or tp is type(None):
        return None if value is None else f"{path} is {_what(value)}"
    origin = typing.get_origin(tp)
    if origin is None:
        if isinstance(tp, type):
            ok = isinstance(value, _NUMERIC.get(tp, tp))
            return None if ok else f"{path} is {_what(value)}"
        return None  # validated at creation; nothing else reaches here
    args = typing.get_args(tp)
    if origin in _UNION_ORIGINS:
        problems = [_check(value, a, path) for a in args]
        if all(p is not None for p in problems):
            return f"{path} is {_what(value)}"
        return None
    if origin is typing.Literal:
        return None if value in args else f"{path} is {value!r}"
    if origin is typing.Annotated:
        return _check(value, args[0], path)
    if not isinstance(value, origin):
        return f"{path} is {_what(value)}"
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return _first(_check(v, args[0], f"{path}[{i}]") for i, v in enumerate(value))
        if args == ((),):  # tuple[()]
            args = ()
        if len(value) != len(args):
            return f"{path} is a tuple of {len(value)} items, not {len(args)}"
        return _first(_check(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin in _MAPPING_ORIGINS and len(args) == 2:
        return _first(
            _check(k, args[0], f"key {k!r} of {path}") or _check(v, args[1], f"{path}[{k!r}]")
            for k, v in value.items()
        )
    if origin in _SEQUENCE_ORIGINS and len(args) == 1:
        return _first(_check(v, args[0], f"{path}[{i}]") for i, v in enumerate(value))
    return None


def _first(problems: Any) -> str | None:
    for p in problems:
        if p is not None:
            return p
    return None


def check_put(channel: str, item_type: Any, item: Any, key: Any, op: str) -> None:
    """Check a put's key, and its item against the channel's ``item_type`` (``None``: any).

    Raises:
        TypeError: the key is not a ``str`` or an ``int``.
        ChannelTypeError: the item does not match (nothing was enqueued).
    """
    if not isinstance(key, str | int) or isinstance(key, bool):
        raise TypeError(f"channel {channel!r}: a key must be a str or an int, got {key!r}")
    if item_type is None:
        return
    problem = check_item(item, item_type)
    if problem is not None:
        raise ChannelTypeError(
            f"channel {channel!r}: {op} on key {key!r}: expected an item of type "
            f"{describe_type(item_type)}, but {problem}; nothing was enqueued"
        )
