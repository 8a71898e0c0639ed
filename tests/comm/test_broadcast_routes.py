"""What each node takes of a streamed broadcast, and the bytes its link carries
(:mod:`rlcomm.comm.broadcast.routes`): pure parts, as tables and against slicing."""

from __future__ import annotations

import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcomm.comm import codec
from rlcomm.comm.broadcast.routes import (
    ENTRY,
    MAX_VERDICT_NEED,
    Route,
    Slab,
    from_verdict,
    need_of,
    pack_need,
    pack_report,
    report_bytes,
    routes,
    union,
    unpack_need,
    unpack_report,
    verdict_body,
)
from rlcomm.comm.buckets import MIN_BUCKET, Landing, Shard, copy_slab, plan, slab_count
from rlcomm.comm.transports.shm_fanout import OVER_LIMIT, TAKES
from rlcomm.errors import CodecError


def metas_of(sd: dict[str, torch.Tensor]):
    header, _ = codec.encode(sd)
    return header, header.tensors


def state_dict() -> dict[str, torch.Tensor]:
    """Split along rows and columns, a tensor with rows larger than an eighth of a bucket
    (cut between elements), one cut in several buckets, small and empty ones."""
    gen = torch.Generator().manual_seed(7)
    return {
        "embed": torch.randn(512, 256, generator=gen),  # 512 KiB
        "qkv": torch.randn(384, 128, generator=gen).to(torch.bfloat16),
        "o": torch.randn(128, 384, generator=gen).to(torch.bfloat16),
        "wide": torch.randn(4, 96 << 10, generator=gen),  # rows of 384 KiB
        "tall": torch.randn(3 << 17, 4, generator=gen),  # 6 MiB: several buckets
        "norm": torch.randn(128, generator=gen),
        "empty": torch.empty(0, 4),
    }


def shards(rank: int, parts: int):
    def shard(name, shape):
        if name in ("embed", "qkv", "tall"):
            return Shard(0, rank, parts)
        if name in ("o", "wide"):
            return Shard(1, rank, parts)
        return None
    return shard


@pytest.mark.parametrize("slabs, want", [
    ([Slab(0, 2, 4), Slab(0, 4, 6)], Slab(0, 2, 6)),  # parts 1 and 2 of 4 (n = 8)
    ([Slab(0, 0, 2), Slab(0, 4, 6)], Slab(0, 0, 6)),  # parts 0 and 2: the run covering both
    ([Slab(0, 0, 4), Slab(0, 4, 8)], None),  # every row: all of it
    ([Slab(0, 0, 4), None], None),  # one member takes it whole
    ([Slab(0, 0, 4), Slab(1, 0, 2)], None),  # along two dimensions
    ([Slab(1, 1, 2)], Slab(1, 1, 2)),
])
def test_a_node_needs_the_run_of_rows_that_covers_its_members(slabs, want):
    _, metas = metas_of({"w": torch.zeros(8, 4)})
    assert union(metas, [[s] for s in slabs]) == [want]


def test_a_need_round_trips_and_a_forged_one_is_refused():
    _, metas = metas_of({"a": torch.zeros(8, 4), "b": torch.zeros(3)})
    need = [Slab(1, 1, 3), None]
    assert unpack_need(pack_need(need), metas) == need
    for forged in (pack_need(need)[:-1], pack_need([Slab(2, 0, 1), None]),
                   pack_need([Slab(0, 4, 9), None]), pack_need([Slab(0, 3, 3), None]),
                   ENTRY.pack(-1, 0, 1) + ENTRY.pack(-1, 0, 0)):
        with pytest.raises(CodecError):
            unpack_need(forged, metas)


def test_a_report_says_whether_the_node_takes_it_and_what():
    _, metas = metas_of({"a": torch.zeros(8, 4), "b": torch.zeros(3)})
    need = [Slab(0, 2, 4), None]
    report = pack_report(OVER_LIMIT, "over RLCOMM_MAX_MESSAGE_BYTES " + "x" * 1000, need)
    assert len(report) == report_bytes(metas)
    verdict, why, got = unpack_report(report, metas)
    assert (verdict, got) == (OVER_LIMIT, need) and why.startswith("over RLCOMM_MAX")
    assert unpack_report(pack_report(TAKES, "", need), metas) == (TAKES, "", need)
    for forged in (report[:-1], b"\x09" + report[1:], report[:1] + b"\xff\xff" + report[3:]):
        with pytest.raises(CodecError):
            unpack_report(forged, metas)


def test_a_verdict_s_need_is_inflated_no_further_than_one_need():
    _, metas = metas_of({"a": torch.zeros(8, 4), "b": torch.zeros(3)})
    need = [Slab(0, 2, 4), None]
    assert from_verdict(verdict_body(need), metas) == need
    assert verdict_body([None, None]) == b""  # takes everything: says nothing
    assert from_verdict(b"", metas) == [None, None]
    with pytest.raises(CodecError):  # a bomb: far more than a need of two tensors
        from_verdict(zlib.compress(bytes(10 << 20)), metas)
    with pytest.raises(CodecError):
        from_verdict(b"not zlib", metas)
    # A need too large to say in a verdict is not said: the node takes everything.
    _, many = metas_of({f"w{i}": torch.zeros(4, 4) for i in range(20_000)})
    big = [Slab(0, i % 3, i % 3 + 1) for i in range(20_000)]
    body = verdict_body(big)
    assert body == b"" or len(body) <= MAX_VERDICT_NEED


def test_relays_with_one_need_share_a_chain_in_chain_order():
    a, b = pack_need([Slab(0, 0, 2)]), pack_need([None])
    assert routes([3, 5, 7, 9], [a, b, a, b]) == [[3, 7], [5, 9]]
    assert routes([3, 5], [b, b]) == [[3, 5]]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5), st.integers(1, 6), st.integers(0, 5), st.integers(1, 6),
       st.data())
def test_copy_slab_moves_exactly_the_slice_both_ways(outer, n, lo, width, data):
    inner = 3
    lo = min(lo, n - 1)
    hi = min(n, lo + width)
    t = torch.arange(outer * n * inner, dtype=torch.int32).view(outer, n, inner)
    want = t[:, lo:hi].reshape(-1)
    rows, off, run = n * inner, lo * inner, (hi - lo) * inner
    flat = t.reshape(-1)
    e0 = data.draw(st.integers(0, flat.numel() - 1))
    e1 = data.draw(st.integers(e0 + 1, flat.numel()))
    base = slab_count(0, e0, rows, off, run)
    count = slab_count(e0, e1, rows, off, run)
    slab = torch.full((count,), -1, dtype=torch.int32)
    assert copy_slab(flat[e0:e1], e0, e1, rows, off, run, slab, base=base) == count
    assert torch.equal(slab, want[base : base + count])
    back = torch.full((e1 - e0,), -1, dtype=torch.int32)
    copy_slab(back, e0, e1, rows, off, run, slab, base=base, to_slab=False)
    in_slice = ((torch.arange(e0, e1) % rows) >= off) & ((torch.arange(e0, e1) % rows) < off + run)
    assert torch.equal(back[in_slice], flat[e0:e1][in_slice])
    assert bool((back[~in_slice] == -1).all())


@pytest.mark.parametrize("takers", [[(1, 4), (2, 4)], [(0, 2)], [(0, 4), (2, 4)], [(1, 3)]])
def test_a_relay_s_bucket_gives_its_members_the_values_of_slicing(takers):
    """The source packs each bucket for a node whose members take ``takers`` (index,
    parts); the relay unpacks it into a bucket of its own; each member's landing reads
    its shards out of that: they equal slicing on the source, and the link carried
    exactly the need's bytes."""
    sd = state_dict()
    if any(parts == 3 for _, parts in takers):
        sd = {k: v for k, v in sd.items() if k not in ("embed", "qkv", "o", "tall")}
        sd["w3"] = torch.randn(6, 1 << 16)  # 1.5 MiB, split along dim 0 in 3

        def pick(rank, parts):
            return lambda name, shape: (Shard(0, rank, parts) if name == "w3" else
                                        Shard(1, rank, 2) if name == "wide" and rank < 2
                                        else None)
    else:
        pick = shards
    header, metas = metas_of(sd)
    tensors = [codec.as_bytes(t.contiguous()) for t in sd.values()]
    landings = [Landing(header, [pick(i, p)(n, tuple(m.shape))
                                 for n, m in zip(sd, metas)]) for i, p in takers]
    need = union(metas, [need_of(metas, la.selections) for la in landings])
    route = Route(metas, need)
    bucket_bytes = MIN_BUCKET
    crossed = 0
    packed = torch.zeros(bucket_bytes, dtype=torch.uint8)
    for bucket in plan(metas, bucket_bytes):
        pieces = [tensors[p.tensor][p.start : p.end] for p in bucket.pieces]
        sent = route.send_views(bucket, pieces, packed)
        assert [s.numel() for s in sent] == route.sizes(bucket)
        staging = torch.full((bucket.nbytes,), 0xEE, dtype=torch.uint8)
        buffers = [staging[p.offset : p.offset + p.nbytes] for p in bucket.pieces]
        landed_in = route.receive_views(bucket, buffers, torch.zeros(bucket_bytes,
                                                                     dtype=torch.uint8))
        for dst, src in zip(landed_in, sent):  # what the link carries
            dst.copy_(src)
        route.unpack(bucket, landed_in, buffers)
        for landing in landings:
            landing_buffers = [b.clone() for b in buffers]
            for piece, view in zip(bucket.pieces, landing_buffers):
                landing.place(piece, view)
        crossed += sum(route.sizes(bucket))
    want = sum(m.nbytes if s is None else
               m.nbytes // m.shape[s.dim] * (s.hi - s.lo) for m, s in zip(metas, need))
    assert crossed == want < sum(m.nbytes for m in metas)
    for (index, parts), landing in zip(takers, landings):
        sel = pick(index, parts)
        for name, got in zip(sd, landing.tensors()):
            s = sel(name, tuple(sd[name].shape))
            expect = sd[name] if s is None else sd[name].chunk(s.parts, s.dim)[s.index]
            assert torch.equal(got, expect), (name, index, parts)
