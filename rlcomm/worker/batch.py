"""Batches: what dispatch splits along the first dimension, and how.

Pure: no Ray, no I/O. What counts as a *batch*:

- ``list`` and ``tuple``;
- ``torch.Tensor`` and ``numpy.ndarray`` with at least one dimension;
- a ``dict`` with at least one batch value (its batch values are split, the other values
  are copied into every chunk; all batch values must have the same length);
- a *batch object*: anything with a ``chunk(n)`` method and a ``concat(list)`` classmethod
  or staticmethod (verl's ``DataProto`` protocol). If it also has ``__len__`` and slicing
  (``obj[a:b]``) it is split unevenly and can be padded; otherwise its own ``chunk(n)``
  decides.

Everything else (numbers, strings, ``None``, objects) is not a batch: dispatch passes it
whole to every rank.

Splits are uneven when the batch does not divide: 10 items over 3 ranks give 4, 3, 3. On
request they are padded instead: the batch is extended with copies of its first items up
to the next multiple, and the padding is stripped again from the joined result.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = [
    "batch_kind",
    "batch_len",
    "concat_batches",
    "is_batch",
    "pad_amount",
    "pad_batch",
    "split_batch",
    "split_sizes",
    "strip_padding",
    "take_range",
]


# -- sizes ---------------------------------------------------------------------------------


def split_sizes(total: int, parts: int) -> list[int]:
    """Chunk sizes for ``total`` items over ``parts`` ranks, as even as possible.

    The first ``total % parts`` chunks get one item more: ``split_sizes(10, 3) == [4, 3, 3]``.

    Raises:
        ValueError: ``parts < 1`` or ``total < 0``.
    """
    if parts < 1:
        raise ValueError(f"split_sizes: parts must be >= 1, got {parts}")
    if total < 0:
        raise ValueError(f"split_sizes: total must be >= 0, got {total}")
    base, extra = divmod(total, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def pad_amount(total: int, parts: int) -> int:
    """Items to add so ``total`` divides by ``parts`` (0 for an empty batch)."""
    if total == 0:
        return 0
    return -total % parts


# -- batch kinds ---------------------------------------------------------------------------


def _is_batch_object(x: Any) -> bool:
    return (
        not isinstance(x, (torch.Tensor, np.ndarray))
        and callable(getattr(x, "chunk", None))
        and callable(getattr(type(x), "concat", None))
    )


def _sliceable(x: Any) -> bool:
    return hasattr(x, "__len__") and hasattr(x, "__getitem__")


def is_batch(x: Any) -> bool:
    """True when dispatch splits ``x`` along its first dimension (see the module doc)."""
    if isinstance(x, (list, tuple)):
        return True
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return x.ndim > 0
    if isinstance(x, dict):
        return any(is_batch(v) for v in x.values())
    return _is_batch_object(x)


def batch_len(x: Any) -> int | None:
    """The batch size of ``x``, or ``None`` when ``x`` is not a batch (or has no length).

    Raises:
        ValueError: a dict whose batch values have different lengths.
    """
    if isinstance(x, (list, tuple)):
        return len(x)
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return int(x.shape[0]) if x.ndim > 0 else None
    if isinstance(x, dict):
        lengths = {k: batch_len(v) for k, v in x.items() if is_batch(v)}
        known = {n for n in lengths.values() if n is not None}
        if len(known) > 1:
            raise ValueError(f"dict batch values have different lengths: {lengths}")
        return known.pop() if known else None
    if _is_batch_object(x) and hasattr(x, "__len__"):
        return len(x)
    return None


def batch_kind(x: Any) -> str:
    """A name for the kind of batch ``x`` is (``list``, ``tensor``, ``object:<type>``, ...)."""
    if isinstance(x, list):
        return "list"
    if isinstance(x, tuple):
        return "tuple"
    if isinstance(x, torch.Tensor):
        return "tensor"
    if isinstance(x, np.ndarray):
        return "ndarray"
    if isinstance(x, dict):
        return "dict"
    return f"object:{type(x).__module__}.{type(x).__qualname__}"


def take_range(x: Any, start: int, stop: int) -> Any:
    """Items ``start:stop`` of batch ``x`` as a batch of the same kind.

    Tensors and arrays are copied, so a chunk never drags its parent's storage along
    when it is serialised.

    Raises:
        TypeError: ``x`` is not a batch, or is a batch object without slicing.
    """
    if isinstance(x, (list, tuple)):
        return x[start:stop]
    if isinstance(x, torch.Tensor):
        return x[start:stop].clone()
    if isinstance(x, np.ndarray):
        return x[start:stop].copy()
    if isinstance(x, dict):
        return {k: take_range(v, start, stop) if is_batch(v) else v for k, v in x.items()}
    if _is_batch_object(x) and _sliceable(x):
        return x[start:stop]
    raise TypeError(
        f"cannot slice a {type(x).__qualname__}: a batch object needs __len__ and "
        "__getitem__ with slices for uneven splits, padding and chaining"
    )


def concat_batches(items: Sequence[Any]) -> Any:
    """Join batches of one kind along the first dimension (the inverse of a split).

    Dict values that are not batches are taken from the first item.

    Raises:
        TypeError: the items are not batches of one kind.
        ValueError: no items, or dicts with different keys.
    """
    if not items:
        raise ValueError("concat_batches: nothing to concatenate")
    kinds = {batch_kind(x) for x in items}
    if len(kinds) > 1 or not all(is_batch(x) for x in items):
        raise TypeError(f"concat_batches: items are not batches of one kind: {sorted(kinds)}")
    first = items[0]
    if isinstance(first, list):
        return [v for x in items for v in x]
    if isinstance(first, tuple):
        return tuple(v for x in items for v in x)
    if isinstance(first, torch.Tensor):
        return torch.cat(list(items), dim=0)
    if isinstance(first, np.ndarray):
        return np.concatenate(list(items), axis=0)
    if isinstance(first, dict):
        keys = list(first)
        if any(list(x) != keys for x in items[1:]):
            raise ValueError("concat_batches: dicts have different keys")
        return {
            k: concat_batches([x[k] for x in items]) if is_batch(first[k]) else first[k]
            for k in keys
        }
    return type(first).concat(list(items))


def pad_batch(x: Any, parts: int) -> tuple[Any, int]:
    """``x`` extended with copies of its first items up to a multiple of ``parts``.

    Returns:
        ``(padded, pad)`` where ``pad`` is the number of items added (0: ``x`` itself).
    """
    n = batch_len(x)
    if n is None:
        raise TypeError(f"pad_batch: a {type(x).__qualname__} is not a batch")
    pad = pad_amount(n, parts)
    if pad == 0:
        return x, 0
    pieces = [x]
    left = pad
    while left:
        take = min(left, n)
        pieces.append(take_range(x, 0, take))
        left -= take
    return concat_batches(pieces), pad


def split_batch(x: Any, parts: int, pad: bool = False) -> tuple[list[Any], int]:
    """Cut batch ``x`` into ``parts`` chunks.

    Args:
        x: a batch (see the module doc).
        parts: the number of chunks.
        pad: pad to a multiple of ``parts`` first (every chunk the same size).

    Returns:
        ``(chunks, pad)``: the chunks, and the number of padding items at the end.
    """
    n = batch_len(x)
    if n is None and _is_batch_object(x):
        if pad:
            raise TypeError(
                f"cannot pad a {type(x).__qualname__}: padding needs __len__ and slicing"
            )
        return list(x.chunk(parts)), 0
    if n is None:
        raise TypeError(f"split_batch: a {type(x).__qualname__} is not a batch")
    added = 0
    if pad:
        x, added = pad_batch(x, parts)
        n += added
    if _is_batch_object(x) and not _sliceable(x):
        return list(x.chunk(parts)), added
    chunks, start = [], 0
    for size in split_sizes(n, parts):
        chunks.append(take_range(x, start, start + size))
        start += size
    return chunks, added


def strip_padding(x: Any, pad: int) -> Any:
    """``x`` without its last ``pad`` items."""
    if not pad:
        return x
    n = batch_len(x)
    if n is None:
        raise TypeError(f"strip_padding: a {type(x).__qualname__} is not a batch")
    return take_range(x, 0, max(0, n - pad))
