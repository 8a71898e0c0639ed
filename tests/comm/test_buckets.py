"""The bucket plan, the shards a receiver takes and where pieces land: pure, no I/O."""

from __future__ import annotations

import threading

import pytest
import torch

from rlcomm.comm import codec
from rlcomm.comm.bucket_iter import BucketIterator, Buckets, Handoff
from rlcomm.comm.buckets import (
    ALIGN,
    MIN_BUCKET,
    Landing,
    Piece,
    Shard,
    header_bucket,
    plan,
    selections,
)
from rlcomm.errors import CodecError, CommTimeoutError

MiB = 1 << 20


def _header(sd: dict[str, torch.Tensor]):
    header, _ = codec.encode(sd)
    return header


def _sd() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(1000, 256, generator=g),
        "layers.0.norm.weight": torch.randn(256, generator=g),
        "layers.0.q.weight": torch.randn(512, 256, generator=g).to(torch.bfloat16),
        "layers.0.o.weight": torch.randn(256, 512, generator=g).to(torch.bfloat16),
        "step": torch.tensor(7),
        "empty": torch.empty(0, 4),
        "big": torch.randn(3 * MiB // 4 + 5, generator=g),  # a 1-D tensor over a bucket
    }


def test_plan_covers_every_byte_once_in_aligned_bounded_buckets():
    header = _header(_sd())
    buckets = list(plan(header.tensors, MIN_BUCKET))
    seen: dict[int, list[tuple[int, int]]] = {}
    for k, bucket in enumerate(buckets):
        assert bucket.index == k
        assert 0 < bucket.nbytes <= MIN_BUCKET
        end = 0
        for piece in bucket.pieces:
            assert piece.offset % ALIGN == 0 and piece.offset >= end
            end = piece.offset + piece.nbytes
            seen.setdefault(piece.tensor, []).append((piece.start, piece.end))
        assert end == bucket.nbytes
    for i, meta in enumerate(header.tensors):
        ranges = seen.get(i, [])
        if meta.nbytes == 0:
            assert ranges == []
            continue
        assert ranges[0][0] == 0 and ranges[-1][1] == meta.nbytes
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_plan_cuts_small_rows_whole_and_refuses_tiny_buckets():
    header = _header({"w": torch.zeros(4096, 1000)})  # 4000-byte rows, 16 MB
    for bucket in plan(header.tensors, 2 * MiB):
        for piece in bucket.pieces:
            assert piece.start % 4000 == 0 and piece.end % 4000 == 0
    with pytest.raises(ValueError):
        next(plan(header.tensors, MIN_BUCKET - 1))


def _land(header, sd, landing, bucket_bytes, shuffle_cut=False):
    """Feed every bucket's pieces to ``landing`` as a transport would."""
    views = [codec.as_bytes(t.contiguous()) for t in sd.values()]
    for bucket in plan(header.tensors, bucket_bytes):
        for piece in bucket.pieces:
            data = views[piece.tensor][piece.start : piece.end]
            if shuffle_cut and piece.nbytes > 64:  # cut mid-row, as a foreign plan might
                item = header.tensors[piece.tensor]
                step = codec.dtype_of(item.dtype).itemsize
                cut = piece.start + (piece.nbytes // step // 3) * step
                for a, b in ((piece.start, cut), (cut, piece.end)):
                    if b > a:
                        landing.place(Piece(piece.tensor, a, b, 0), views[piece.tensor][a:b])
                continue
            landing.place(piece, data)


@pytest.mark.parametrize("shuffle_cut", [False, True])
def test_landing_takes_tp_shards_and_dtypes_equal_to_slicing(shuffle_cut):
    sd = _sd()
    header = _header(sd)
    rank, tp = 2, 4

    def tp_shards(name, shape):
        if name.endswith("q.weight") or name == "embed.weight":
            return Shard(0, rank, tp)
        if name.endswith("o.weight"):
            return Shard(1, rank, tp, dtype=torch.float32)
        return None

    sel = selections(header, tp_shards)
    landing = Landing(header, sel)
    _land(header, sd, landing, MIN_BUCKET, shuffle_cut)
    got = dict(zip(landing.names, landing.tensors()))
    assert torch.equal(got["embed.weight"], sd["embed.weight"].chunk(tp, 0)[rank])
    assert torch.equal(got["layers.0.q.weight"], sd["layers.0.q.weight"].chunk(tp, 0)[rank])
    want_o = sd["layers.0.o.weight"].chunk(tp, 1)[rank].float()
    assert got["layers.0.o.weight"].dtype == torch.float32
    assert torch.equal(got["layers.0.o.weight"], want_o)
    assert torch.equal(got["big"], sd["big"]) and int(got["step"]) == 7
    assert got["empty"].shape == (0, 4)
    sharded = sum(sd[n].numel() * sd[n].element_size()
                  for n in ("embed.weight", "layers.0.q.weight", "layers.0.o.weight"))
    rest = sum(t.numel() * t.element_size() for n, t in sd.items()
               if n not in ("embed.weight", "layers.0.q.weight", "layers.0.o.weight"))
    assert landing.bytes_read == sharded // tp + rest


def test_landing_into_targets_and_non_contiguous_ones():
    sd = _sd()
    header = _header(sd)
    into = {k: torch.zeros_like(v) for k, v in sd.items()}
    into["embed.weight"] = torch.zeros(256, 1000).t()  # not contiguous
    landing = Landing(header, [None] * len(sd), list(into.values()))
    _land(header, sd, landing, MIN_BUCKET)
    for k, v in sd.items():
        assert torch.equal(into[k], v), k
    assert landing.tensor(0) is into["embed.weight"]


def test_selections_refuse_what_does_not_fit():
    header = _header({"w": torch.zeros(10, 6)})
    with pytest.raises(CodecError, match="cannot be split in 4"):
        selections(header, {"w": Shard(0, 1, 4)})
    with pytest.raises(CodecError, match="2 dimensions"):
        selections(header, {"w": Shard(2, 0, 2)})
    with pytest.raises(CodecError, match="not a rlcomm.Shard"):
        selections(header, lambda name, shape: (0, 1))
    with pytest.raises(ValueError):
        Shard(0, 4, 4)
    header.stream = 10
    with pytest.raises(CodecError, match="buckets of 10 bytes"):
        header_bucket(header)


def test_iterator_holds_at_most_two_buckets_and_drops_the_rest_when_closed():
    handoff = Handoff("test", timeout=5)
    iterator = BucketIterator(handoff)
    assert handoff.put([("a", torch.zeros(1))])
    # The slot is taken: a second put waits until the caller takes the first.
    short = Handoff("short", timeout=0.05)
    short.put([("x", torch.zeros(1))])
    with pytest.raises(CommTimeoutError, match="took no bucket"):
        short.put([("y", torch.zeros(1))])
    assert next(iterator)[0] == "a" and handoff.taken == 1
    assert handoff.put([("b", torch.zeros(1))])
    iterator.close()
    assert not handoff.put([("c", torch.zeros(1))])  # dropped: the caller is gone
    with pytest.raises(StopIteration):
        next(iterator)


def test_dropping_the_iterator_closes_the_handoff():
    handoff = Handoff("test", timeout=5)
    iterator = BucketIterator(handoff, Buckets().transform)
    del iterator
    assert not handoff.wanted


def test_iterator_transform_renames_and_fuses_across_buckets():
    handoff = Handoff("test", timeout=5)
    held: dict[str, torch.Tensor] = {}

    def fuse(pairs):
        out = []
        for name, t in pairs:
            if name in ("q", "k", "v"):
                held[name] = t
                if len(held) == 3:
                    out.append(("qkv", torch.cat([held.pop(n) for n in "qkv"])))
            else:
                out.append((f"model.{name}", t))
        return out

    def produce():
        handoff.put([("q", torch.ones(2)), ("k", 2 * torch.ones(2))])
        handoff.put([("v", 3 * torch.ones(2)), ("norm", torch.zeros(1))])
        handoff.end()

    producer = threading.Thread(target=produce)
    producer.start()
    got = list(BucketIterator(handoff, fuse))
    producer.join()
    assert [n for n, _ in got] == ["qkv", "model.norm"]
    assert torch.equal(got[0][1], torch.tensor([1.0, 1, 2, 2, 3, 3]))


def test_a_producer_error_reaches_the_caller():
    handoff = Handoff("recv at a:0 from b:0", timeout=5)
    iterator = BucketIterator(handoff)
    handoff.put([("a", torch.zeros(1))])
    handoff.end(CommTimeoutError("bucket 2 did not come", peer="b:0", op="recv"))
    assert next(iterator)[0] == "a"
    with pytest.raises(CommTimeoutError, match="bucket 2") as info:
        next(iterator)
    assert info.value.peer == "b:0"


def test_a_streamed_message_carries_no_payload_in_its_frame():
    from rlcomm.comm import framing

    header, tensors = codec.encode({"w": torch.ones(4)})
    header.stream = MIN_BUCKET
    frame, payload = framing.pack(header, tensors)
    got, inline, offer = framing.unpack(frame)
    assert got.stream == MIN_BUCKET and got.inline == 0 and inline == b"" and offer == b""
    assert [p.numel() for p in payload] == [16]
