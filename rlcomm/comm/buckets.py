"""Messages that stream in buckets: the plan that cuts a payload into buckets, the parts
a receiver takes of each tensor (:class:`Shard`), and where each piece lands.

A payload larger than what shared memory should hold at once (a model's weights) goes
as a sequence of *buckets*: each bucket is at most ``bucket`` bytes, laid out as the
pieces of consecutive tensors (a tensor larger than a bucket is cut into several
pieces, at row boundaries where a row is small), each piece at an offset aligned to
:data:`ALIGN`. Both ends work the plan out from the message's header and the bucket
size in it (:func:`plan`), so nothing of it travels. The transports move one bucket at a
time through bounded staging (a shared-memory slot or segment, a chain's records); the
receiver copies each piece to where it belongs before the staging is reused.

Where a piece belongs is :class:`Landing`'s business: the receiver's own tensors
(``into=``), new ones, or the tensors an iterator hands out bucket by bucket
(:class:`~rlcomm.comm.bucket_iter.BucketIterator`); of each tensor, the receiver may take
a slice and a dtype (:class:`Shard`), and then only the bytes of that slice are read.

Pure: no I/O, no threads (:func:`stream_bucket` reads the settings).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from rlcomm.comm.codec import DictNode, Kind, MessageHeader, TensorMeta, dtype_of
from rlcomm.comm.transports.shm_memory import POOL_BYTES
from rlcomm.errors import CapacityError, CodecError
from rlcomm.settings import get_settings

#: Alignment of each piece in a bucket (a cache line; any dtype's element size divides it).
ALIGN = 64
#: Bucket sizes a receiver accepts from a sender.
MIN_BUCKET, MAX_BUCKET = 1 << 20, 1 << 40
#: A tensor whose rows are at most this share of a bucket is cut at row boundaries.
_ROW_SHARE = 8


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Piece(NamedTuple):
    """Bytes ``start:end`` of tensor ``tensor``, at ``offset`` in its bucket."""

    tensor: int
    start: int
    end: int
    offset: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class Bucket(NamedTuple):
    """One bucket of a plan: its pieces and the bytes it spans (aligned)."""

    index: int
    pieces: tuple[Piece, ...]
    nbytes: int

    @property
    def sizes(self) -> list[int]:
        return [p.nbytes for p in self.pieces]


def _unit(meta: TensorMeta, bucket: int) -> int:
    """The bytes a tensor's pieces are cut in multiples of: a row, when rows are small
    against the bucket; else an element."""
    item = dtype_of(meta.dtype).itemsize
    shape = meta.shape
    if len(shape) >= 1 and shape[0] > 0:
        row = math.prod(shape[1:]) * item
        if 0 < row <= bucket // _ROW_SHARE:
            return row
    return item


def plan(metas: Sequence[TensorMeta], bucket: int) -> Iterator[Bucket]:
    """The buckets of a payload of tensors ``metas``, at most ``bucket`` bytes each, in
    order (lazily: a plan of a forged header costs nothing until its buckets come).

    Every non-empty tensor's bytes appear once, in order; a bucket holds whole rows of
    each tensor it cuts, unless a row is larger than an eighth of a bucket (then whole
    elements). Raises ``ValueError`` for a bucket below :data:`MIN_BUCKET` bytes.
    """
    if bucket < MIN_BUCKET:
        raise ValueError(f"a bucket must hold at least {MIN_BUCKET} bytes, got {bucket}")
    pieces: list[Piece] = []
    used = 0
    index = 0
    for i, meta in enumerate(metas):
        size = meta.nbytes
        unit = _unit(meta, bucket)
        start = 0
        while start < size:
            offset = align(used)
            room = bucket - offset
            take = min(size - start, room // unit * unit)
            if take <= 0:  # not even one unit fits here: the next bucket
                yield Bucket(index, tuple(pieces), used)
                index, pieces, used = index + 1, [], 0
                continue
            pieces.append(Piece(i, start, start + take, offset))
            used = offset + take
            start += take
            if bucket - align(used) < ALIGN:
                yield Bucket(index, tuple(pieces), used)
                index, pieces, used = index + 1, [], 0
    if pieces:
        yield Bucket(index, tuple(pieces), used)


def stream_bucket(total: int, requested: int | None, limits: Sequence[int] = (),
                  strict: bool = True) -> int:
    """The bucket size a CPU payload of ``total`` bytes streams in (0: it goes whole):
    one that a quarter of the shared-memory pool cannot hold, one over a receiver's
    limit (``limits``), or any when the caller asked for buckets (``requested``). Its
    buckets are ``requested`` or ``RLCOMM_BUCKET_BYTES``, at most a quarter of the pool
    (and never under :data:`MIN_BUCKET`).

    Raises:
        CapacityError: the pool is too small to stream through (``strict``: the path has
            nothing else to go through; a connection has its ring).
    """
    cap = POOL_BYTES // 4
    if not (requested or total > cap or any(total > limit for limit in limits)):
        return 0
    bucket = min(requested or get_settings().bucket_bytes, cap)
    if bucket < MIN_BUCKET and strict:
        raise CapacityError(
            f"a payload of {describe(total)} ({total} bytes) must stream in buckets through "
            f"shared memory, and RLCOMM_SHM_POOL_BYTES={POOL_BYTES} leaves buckets of "
            f"{bucket} bytes, under the {MIN_BUCKET} a bucket takes at least: set it to "
            f"{4 * MIN_BUCKET} or more (256 MiB or more streams at full speed)")
    return max(MIN_BUCKET, bucket)


def bucket_count(metas: Sequence[TensorMeta], bucket: int) -> int:
    """How many buckets :func:`plan` makes (walks the plan)."""
    return sum(1 for _ in plan(metas, bucket))


# -- what a receiver takes of each tensor ---------------------------------------------------


@dataclass(frozen=True)
class Shard:
    """What a receiver takes of one tensor: part ``index`` of ``parts`` equal slices along
    dimension ``dim`` (the tensor-parallel layout: ``Shard(0, rank, tp)`` for a
    column-parallel weight, ``Shard(1, rank, tp)`` for a row-parallel one), converted to
    ``dtype`` when given. ``Shard(dtype=torch.float8_e4m3fn)`` takes the whole tensor,
    converted.

    Only the slice's bytes are read out of the shared staging; the slice arrives as a
    new contiguous tensor (or lands in the ``into=`` tensor, which then has the slice's
    shape and dtype).
    """

    dim: int = 0
    index: int = 0
    parts: int = 1
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in ("dim", "index", "parts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"Shard.{name} must be an int, got {value!r}")
        if self.parts < 1 or not 0 <= self.index < self.parts:
            raise ValueError(
                f"Shard: index {self.index} of {self.parts} parts (0 <= index < parts)")
        if self.dim < 0:
            raise ValueError(f"Shard.dim must be >= 0, got {self.dim}")
        if self.dtype is not None and not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"Shard.dtype must be a torch.dtype, got {self.dtype!r}")

    def shape_of(self, shape: tuple[int, ...], name: str) -> tuple[int, ...]:
        """The slice's shape for a tensor of ``shape`` (``name`` words the error)."""
        if self.parts == 1:
            return tuple(shape)
        if self.dim >= len(shape):
            raise CodecError(
                f"shards: {name} has {len(shape)} dimensions; it cannot be split along "
                f"dimension {self.dim}")
        if shape[self.dim] % self.parts:
            raise CodecError(
                f"shards: {name} of shape {tuple(shape)} cannot be split in {self.parts} "
                f"equal parts along dimension {self.dim}")
        out = list(shape)
        out[self.dim] //= self.parts
        return tuple(out)


#: What a receiver says of the tensors it takes: a mapping of names to shards (names
#: not in it are taken whole), or a function of ``(name, shape)`` (``None``: whole).
Shards = Mapping[str, Shard] | Callable[[str, tuple[int, ...]], Shard | None]


def names_of(header: MessageHeader) -> list[str]:
    """Each tensor's name: a dict's keys, else its position (``"0"``, ``"1"``, ...)."""
    if header.kind == Kind.TENSOR_DICT and type(header.structure) is DictNode:
        keys = header.structure.keys
        if len(keys) == len(header.tensors):
            return list(keys)
    return [str(i) for i in range(len(header.tensors))]


def selections(header: MessageHeader, shards: Shards | None) -> list[Shard | None]:
    """The :class:`Shard` taken of each tensor of a message (``None``: all of it).

    Raises:
        CodecError: a shard does not fit its tensor, or ``shards`` gave something else.
    """
    if shards is None:
        return [None] * len(header.tensors)
    out: list[Shard | None] = []
    for name, meta in zip(names_of(header), header.tensors, strict=True):
        if callable(shards) and not isinstance(shards, Mapping):
            sel = shards(name, tuple(meta.shape))
        else:
            sel = shards.get(name)
        if sel is not None and not isinstance(sel, Shard):
            raise CodecError(f"shards: {name!r} gave {sel!r}, not a rlcomm.Shard or None")
        if sel is not None:
            sel.shape_of(tuple(meta.shape), repr(name))
            if sel.parts == 1 and sel.dtype is None:
                sel = None
        out.append(sel)
    return out


def taken_meta(meta: TensorMeta, sel: Shard | None, name: str) -> tuple[tuple[int, ...], torch.dtype]:
    """The shape and dtype a receiver ends up with of a tensor."""
    dtype = dtype_of(meta.dtype)
    if sel is None:
        return tuple(meta.shape), dtype
    return sel.shape_of(tuple(meta.shape), repr(name)), sel.dtype or dtype


# -- where the pieces land --------------------------------------------------------------------


class Landing:
    """The tensors a received message's pieces land in, and the copies that put them
    there: the receiver's own (``targets``, in header order, each with the shape and
    dtype it takes), or new tensors made on ``device`` when a tensor's first piece
    arrives.

    Args:
        header: the message's header.
        selections: what is taken of each tensor (:func:`selections`).
        targets: the tensors to fill, or ``None`` to make new ones.
        device: where new tensors are made (default: the CPU).
    """

    def __init__(
        self, header: MessageHeader, selections: Sequence[Shard | None],
        targets: Sequence[torch.Tensor] | None = None, device: torch.device | None = None,
    ):
        self.header = header
        self.names = names_of(header)
        self._sel = list(selections)
        self._device = device or torch.device("cpu")
        metas = header.tensors
        self._taken = [taken_meta(m, s, n) for m, s, n in zip(metas, self._sel, self.names)]
        self._dtypes = [dtype_of(m.dtype) for m in metas]
        self._left = [m.nbytes for m in metas]
        self._out: list[torch.Tensor | None] = list(targets) if targets is not None else [None] * len(metas)
        self._given = targets is not None
        # A target that cannot take a flat piece (not contiguous) fills a staging copy,
        # copied into it once whole.
        self._staged: dict[int, torch.Tensor] = {}
        #: Bytes read out of the staging so far (what the transport moved to this
        #: receiver: only the slices of sharded tensors).
        self.bytes_read = 0

    @property
    def selections(self) -> list[Shard | None]:
        return list(self._sel)

    def taken_nbytes(self) -> int:
        """The bytes of every tensor as this receiver takes it (what it allocates when it
        makes new tensors)."""
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in self._taken)

    def largest_taken(self) -> int:
        """The bytes of the largest tensor as this receiver takes it."""
        return max((math.prod(s) * d.itemsize for s, d in self._taken), default=0)

    def tensor(self, i: int) -> torch.Tensor:
        """Tensor ``i`` as this receiver takes it (made on first use)."""
        t = self._out[i]
        if t is None:
            shape, dtype = self._taken[i]
            t = self._out[i] = torch.empty(shape, dtype=dtype, device=self._device)
        return t

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor (empty ones made now)."""
        return [self.tensor(i) for i in range(len(self._out))]

    def done(self, i: int) -> bool:
        return self._left[i] == 0

    def forget(self, i: int) -> None:
        """Drop this landing's reference to tensor ``i`` (handed over to an iterator)."""
        self._out[i] = None

    def direct(self, piece: Piece) -> torch.Tensor | None:
        """The uint8 bytes a piece may be received into directly (its tensor is taken
        whole, in its own dtype, contiguous on the CPU), or None when it must be staged
        and placed with :meth:`place`."""
        i = piece.tensor
        if self._sel[i] is not None:
            return None
        t = self.tensor(i)
        if t.device.type != "cpu" or not t.is_contiguous():
            return None
        return t.view(-1).view(torch.uint8)[piece.start : piece.end]

    def received_direct(self, piece: Piece) -> None:
        """A piece was received into :meth:`direct`'s bytes."""
        self.bytes_read += piece.nbytes
        self._finish(piece)

    def place(self, piece: Piece, data: torch.Tensor) -> None:
        """Copy a piece (``data``: its uint8 bytes) to where it belongs."""
        i = piece.tensor
        if data.numel() != piece.nbytes:
            raise CodecError(f"a piece of {data.numel()} bytes where {piece.nbytes} are due")
        if self._left[i] < piece.nbytes:
            raise CodecError(f"tensor {self.names[i]!r} received more bytes than it has")
        item = self._dtypes[i].itemsize
        src = data.view(self._dtypes[i])
        dst = self._flat(i)
        e0, e1 = piece.start // item, piece.end // item
        sel = self._sel[i]
        if sel is None or sel.parts == 1:
            dst[e0:e1].copy_(src)
            self.bytes_read += piece.nbytes
        else:
            self.bytes_read += self._place_slice(i, sel, e0, e1, src, dst) * item
        self._finish(piece)

    def _flat(self, i: int) -> torch.Tensor:
        t = self.tensor(i)
        if t.is_contiguous():
            return t.view(-1)
        staged = self._staged.get(i)
        if staged is None:
            staged = self._staged[i] = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        return staged.view(-1)

    def _finish(self, piece: Piece) -> None:
        i = piece.tensor
        self._left[i] -= piece.nbytes
        if self._left[i] == 0 and i in self._staged:
            self.tensor(i).copy_(self._staged.pop(i))

    def _place_slice(
        self, i: int, sel: Shard, e0: int, e1: int, src: torch.Tensor, dst: torch.Tensor
    ) -> int:
        """Copy the part of source elements ``e0:e1`` that falls in the shard; returns the
        elements copied."""
        shape = self.header.tensors[i].shape
        inner = math.prod(shape[sel.dim + 1 :])
        rows = shape[sel.dim] * inner
        run = rows // sel.parts
        return copy_slab(src, e0, e1, rows, sel.index * run, run, dst)


# -- the run of a slice in the flat tensor ----------------------------------------------------
#
# A slice along a dimension (a shard, or rows ``lo:hi`` of it) is, in the flat tensor, a
# run of ``run`` positions at ``off`` in every outer row of ``rows`` positions. Its own
# flat layout (the *slab*) puts those runs end to end: position ``r * rows + off + j``
# is slab position ``r * run + j``. Positions are elements or bytes, alike.


def slab_count(e0: int, e1: int, rows: int, off: int, run: int) -> int:
    """How many of the flat positions ``e0:e1`` fall in the slice."""
    def before(p: int) -> int:
        return p // rows * run + min(max(p % rows - off, 0), run)
    return before(e1) - before(e0)


def copy_slab(flat: torch.Tensor, e0: int, e1: int, rows: int, off: int, run: int,
              slab: torch.Tensor, base: int = 0, to_slab: bool = True) -> int:
    """Copy between the flat positions ``e0:e1`` (``flat[0]`` is position ``e0``) and the
    slab (``slab[0]`` is slab position ``base``), either way; only the positions in the
    slice. Returns how many were copied. Whole outer rows go in one strided copy; the
    partial ones at either end alone."""
    copied = 0
    r0, r1 = e0 // rows, -(-e1 // rows)
    full0 = r0 if e0 == r0 * rows else r0 + 1
    full1 = r1 if e1 == r1 * rows else r1 - 1
    if full1 > full0:
        n = full1 - full0
        block = flat[full0 * rows - e0 : full1 * rows - e0].view(n, rows)[:, off : off + run]
        part = slab[full0 * run - base : full1 * run - base].view(n, run)
        (part if to_slab else block).copy_(block if to_slab else part)
        copied += n * run
    for r in sorted({r0, r1 - 1}):
        if full0 <= r < full1:
            continue
        lo, hi = max(e0, r * rows + off), min(e1, r * rows + off + run)
        if hi > lo:
            d = r * run + (lo - r * rows - off) - base
            a, b = flat[lo - e0 : hi - e0], slab[d : d + hi - lo]
            (b if to_slab else a).copy_(a if to_slab else b)
            copied += hi - lo
    return copied


def header_bucket(header: MessageHeader) -> int:
    """The bucket size a header declares (0: the message does not stream), checked.

    Raises:
        CodecError: a bucket size outside what a receiver accepts.
    """
    bucket = header.stream
    if bucket and not MIN_BUCKET <= bucket <= MAX_BUCKET:
        raise CodecError(
            f"a message streams in buckets of {bucket} bytes; a receiver accepts "
            f"{MIN_BUCKET} to {MAX_BUCKET}")
    if bucket and any(m.device != "cpu" for m in header.tensors):
        raise CodecError("only CPU payloads stream in buckets")
    return bucket


def describe(n: int) -> str:
    """``n`` bytes, for error messages."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.4g} {unit}"
    return f"{n} B"
