"""What each node takes of a streamed broadcast, and the routes its buckets take there.

A receiver that takes only shards of a state dict (``shards=``) reads only their bytes
out of its node's staging. Across nodes, the bytes that cross a link are what that node
takes: its *need*, one :class:`Slab` per tensor (rows ``lo:hi`` along one dimension),
or ``None`` where some member takes the whole tensor (or slices along two dimensions).
A node's need is the union of its members' (its relay's, and each node-mate's, told in
its verdict on the opening), cut to one run of rows: members that take parts 0 and 1 of
4 need rows ``0:n/2``; parts 0 and 2, rows ``0:3n/4``.

Before the first bucket, each relay reports its node's need up the chain (in the
``DONE`` of an empty run, :mod:`~rlcomm.comm.broadcast.chain`), and the source passes
every relay's need down the chain (a run of its own). Every member then works out the
same *routes*: the relays grouped by need, in chain order, each group a chain of its own
from the source (:func:`routes`). Nodes that take everything form one chain, as without
shards; a node that takes a shard no other takes gets its own link from the source,
which carries only that shard's bytes. Each bucket then goes along each route in turn:
the source packs the slices of each piece end to end (:meth:`Route.send_views`), and
each relay receives them into a bucket of its own, laid out as the source's
(:meth:`Route.receive_views`, then :meth:`Route.unpack`), so that its node-mates and
itself take their parts as on the source's node. Bytes outside the node's need are left
as they were: nobody there reads them.

Pure: no I/O, no threads.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Sequence
from typing import NamedTuple

import torch

from rlcomm.comm.buckets import Bucket, Shard, copy_slab, slab_count
from rlcomm.comm.codec import TensorMeta, dtype_of
from rlcomm.comm.transports.shm_fanout import OVER_LIMIT, REFUSES, TAKES
from rlcomm.errors import CodecError

#: One tensor's need: dimension (-1: all of it), rows ``lo:hi``.
ENTRY = struct.Struct("<bqq")
#: A relay's report opens with its verdict (as a fan-out receiver's: ``TAKES``,
#: ``REFUSES``, ``OVER_LIMIT``) and why not, in UTF-8 text padded to :data:`REPORT_TEXT`
#: bytes; its node's need follows.
REPORT_HEAD = struct.Struct("<BH")
REPORT_TEXT = 1024
#: Most bytes of a node-mate's need in its verdict (compressed); past it, it says
#: nothing and its node takes everything.
MAX_VERDICT_NEED = 48 << 10


class Slab(NamedTuple):
    """Rows ``lo:hi`` along dimension ``dim`` of a tensor."""

    dim: int
    lo: int
    hi: int


#: A node's need: per tensor of the message, a :class:`Slab`, or ``None`` (all of it).
Need = list[Slab | None]


def slab_of(sel: Shard | None, shape: Sequence[int]) -> Slab | None:
    """The rows a receiver's selection takes of a tensor (``None``: all its bytes)."""
    if sel is None or sel.parts == 1:
        return None
    part = shape[sel.dim] // sel.parts
    return Slab(sel.dim, sel.index * part, (sel.index + 1) * part)


def need_of(metas: Sequence[TensorMeta], selections: Sequence[Shard | None]) -> Need:
    """One receiver's need."""
    return [slab_of(s, m.shape) for m, s in zip(metas, selections, strict=True)]


def union(metas: Sequence[TensorMeta], needs: Sequence[Need]) -> Need:
    """The need of members whose needs are ``needs``: per tensor, the run of rows that
    covers all of theirs, or ``None`` when one takes it whole, they cut it along
    different dimensions, or the run is every row."""
    out: Need = []
    for i, meta in enumerate(metas):
        slabs = [need[i] for need in needs]
        if not slabs or any(s is None for s in slabs) or len({s.dim for s in slabs}) > 1:
            out.append(None)
            continue
        lo, hi = min(s.lo for s in slabs), max(s.hi for s in slabs)
        dim = slabs[0].dim
        out.append(None if lo == 0 and hi == meta.shape[dim] else Slab(dim, lo, hi))
    return out


def whole(need: Need) -> bool:
    return all(s is None for s in need)


def pack_need(need: Need) -> bytes:
    """A need as bytes (:data:`ENTRY` per tensor)."""
    return b"".join(ENTRY.pack(-1, 0, 0) if s is None else ENTRY.pack(*s) for s in need)


def unpack_need(data: bytes | memoryview, metas: Sequence[TensorMeta]) -> Need:
    """The need :func:`pack_need` made, checked against the message's tensors.

    Raises:
        CodecError: the wrong size, or a slab no tensor of the message has.
    """
    if len(data) != ENTRY.size * len(metas):
        raise CodecError(f"a need of {len(data)} bytes for {len(metas)} tensors")
    out: Need = []
    for i, meta in enumerate(metas):
        dim, lo, hi = ENTRY.unpack_from(data, i * ENTRY.size)
        if dim == -1 and lo == hi == 0:
            out.append(None)
        elif 0 <= dim < len(meta.shape) and 0 <= lo < hi <= meta.shape[dim]:
            out.append(Slab(dim, lo, hi))
        else:
            raise CodecError(f"a need of rows {lo}:{hi} along dimension {dim} of a tensor "
                             f"of shape {tuple(meta.shape)}")
    return out


def report_bytes(metas: Sequence[TensorMeta]) -> int:
    """The size of a relay's report on a message of tensors ``metas``."""
    return REPORT_HEAD.size + REPORT_TEXT + ENTRY.size * len(metas)


def pack_report(verdict: int, why: str, need: Need) -> bytes:
    """A relay's report: whether its node takes the message (and why not), and what of
    it."""
    text = why.encode()[:REPORT_TEXT]
    return (REPORT_HEAD.pack(verdict, len(text)) + text.ljust(REPORT_TEXT, b"\0")
            + pack_need(need))


def unpack_report(data: bytes, metas: Sequence[TensorMeta]) -> tuple[int, str, Need]:
    """``(verdict, why not, need)`` of a report (checked as :func:`unpack_need`).

    Raises:
        CodecError: not a report on this message.
    """
    if len(data) != report_bytes(metas):
        raise CodecError(f"a report of {len(data)} bytes for {len(metas)} tensors")
    verdict, length = REPORT_HEAD.unpack_from(data)
    if verdict not in (TAKES, REFUSES, OVER_LIMIT) or length > REPORT_TEXT:
        raise CodecError(f"a report with verdict {verdict} and {length} bytes of text")
    text = bytes(data[REPORT_HEAD.size : REPORT_HEAD.size + length]).decode("utf-8", "replace")
    return verdict, text, unpack_need(data[REPORT_HEAD.size + REPORT_TEXT :], metas)


def verdict_body(need: Need) -> bytes:
    """What a node-mate says of its need with its verdict (empty: everything)."""
    if whole(need):
        return b""
    body = zlib.compress(pack_need(need), 6)
    return body if len(body) <= MAX_VERDICT_NEED else b""


def from_verdict(body: bytes, metas: Sequence[TensorMeta]) -> Need:
    """The need of a node-mate's verdict (checked; at most one need's bytes are ever
    inflated).

    Raises:
        CodecError: not a need of this message.
    """
    if not body:
        return [None] * len(metas)
    want = ENTRY.size * len(metas)
    try:
        inflater = zlib.decompressobj()
        data = inflater.decompress(body, want)
        if inflater.unconsumed_tail or not inflater.eof:
            raise CodecError("a need larger than the message's tensors")
    except zlib.error as exc:
        raise CodecError(f"a need that does not inflate: {exc}") from exc
    return unpack_need(data, metas)


def routes(relays: Sequence[int], needs: Sequence[bytes]) -> list[list[int]]:
    """The relays grouped by need (``needs[i]``: relay ``relays[i]``'s, packed), in chain
    order: each group a chain from the source, in the order of its first relay."""
    groups: dict[bytes, list[int]] = {}
    for relay, need in zip(relays, needs, strict=True):
        groups.setdefault(need, []).append(relay)
    return list(groups.values())


class _Cut(NamedTuple):
    """Where a tensor's slab lies in its flat bytes (see :func:`copy_slab`)."""

    rows: int
    off: int
    run: int


class Route:
    """The bytes of each bucket that go to nodes with one need.

    Args:
        metas: the message's tensors.
        need: what the nodes on this route take.
    """

    def __init__(self, metas: Sequence[TensorMeta], need: Need):
        self.whole = whole(need)
        self._cuts: list[_Cut | None] = []
        for meta, slab in zip(metas, need, strict=True):
            if slab is None:
                self._cuts.append(None)
                continue
            item = dtype_of(meta.dtype).itemsize
            inner = math.prod(meta.shape[slab.dim + 1 :]) * item
            self._cuts.append(_Cut(meta.shape[slab.dim] * inner, slab.lo * inner,
                                   (slab.hi - slab.lo) * inner))

    def sizes(self, bucket: Bucket) -> list[int]:
        """The bytes of each piece of ``bucket`` that go along this route."""
        out = []
        for p in bucket.pieces:
            cut = self._cuts[p.tensor]
            out.append(p.nbytes if cut is None else slab_count(p.start, p.end, *cut))
        return out

    def send_views(self, bucket: Bucket, pieces: Sequence[torch.Tensor],
                   packed: torch.Tensor) -> list[torch.Tensor]:
        """What the source sends of each piece (``pieces``: their uint8 bytes): a whole
        piece as it is, the slices of one packed into ``packed``."""
        out, at = [], 0
        for p, view, n in zip(bucket.pieces, pieces, self.sizes(bucket), strict=True):
            cut = self._cuts[p.tensor]
            if cut is None:
                out.append(view)
                continue
            dst = packed[at : at + n]
            base = slab_count(0, p.start, *cut)
            copy_slab(view, p.start, p.end, *cut, dst, base=base)
            out.append(dst)
            at += n
        return out

    def receive_views(self, bucket: Bucket, buffers: Sequence[torch.Tensor],
                      packed: torch.Tensor) -> list[torch.Tensor]:
        """Where a relay receives each piece: a whole piece in its place in ``buffers``
        (the bucket as the source lays it out), a sliced one in ``packed``, until
        :meth:`unpack` puts it in place."""
        out, at = [], 0
        for p, buf, n in zip(bucket.pieces, buffers, self.sizes(bucket), strict=True):
            if self._cuts[p.tensor] is None:
                out.append(buf)
            else:
                out.append(packed[at : at + n])
                at += n
        return out

    def unpack(self, bucket: Bucket, received: Sequence[torch.Tensor],
               buffers: Sequence[torch.Tensor]) -> None:
        """Put each sliced piece received (:meth:`receive_views`) in its place in
        ``buffers``."""
        for p, got, buf in zip(bucket.pieces, received, buffers, strict=True):
            cut = self._cuts[p.tensor]
            if cut is not None and got.numel():
                copy_slab(buf, p.start, p.end, *cut, got, base=slab_count(0, p.start, *cut),
                          to_slab=False)
