"""Frames of small messages: the one-frame form that a send builds without the codec,
and the cache of received headers, each against the general path it stands in for."""

from __future__ import annotations

import collections

import pytest
import torch

from rlcomm.comm import codec, framing
from rlcomm.comm.connection.incoming import classify
from rlcomm.errors import CodecError

SMALL = [
    pytest.param(b"abcd", id="bytes"),
    pytest.param(b"x", id="one-byte"),
    pytest.param(b"y" * framing.INLINE_BYTES, id="bytes-at-the-limit"),
    pytest.param(torch.tensor([1.5]), id="float32"),
    pytest.param(torch.tensor(7), id="0-d"),
    pytest.param(torch.arange(6).view(2, 3), id="int64-2d"),
    pytest.param(torch.ones(4, dtype=torch.bfloat16), id="bfloat16"),
    pytest.param(torch.ones(3).to(torch.float8_e4m3fn), id="float8"),
    pytest.param(torch.tensor([True, False]), id="bool"),
    pytest.param(torch.arange(10.0)[3:7], id="a-view-with-an-offset"),
    pytest.param(torch.ones(framing.INLINE_BYTES // 4), id="float32-at-the-limit"),
    pytest.param({"reward": torch.ones(1)}, id="dict"),
    pytest.param({"reward": torch.ones(2, 3), "done": torch.tensor([True]),
                  "step": torch.tensor(4), "logp": torch.ones(5, dtype=torch.bfloat16)},
                 id="dict-of-four"),
    pytest.param({"a": torch.ones(framing.INLINE_BYTES // 8),
                  "b": torch.ones(framing.INLINE_BYTES // 8)}, id="dict-at-the-limit"),
    pytest.param({str(i): torch.tensor([i]) for i in range(framing._DICT_ENTRIES)},
                 id="dict-of-the-most-entries"),
    # The general path detaches it: the same header and bytes.
    pytest.param(torch.ones(2, requires_grad=True), id="requires-grad"),
    pytest.param({"a": torch.ones(2, requires_grad=True)}, id="dict-requires-grad"),
]

GENERAL = [
    pytest.param(b"", id="empty-bytes"),
    pytest.param(b"z" * (framing.INLINE_BYTES + 1), id="bytes-over-the-limit"),
    pytest.param(torch.ones(framing.INLINE_BYTES // 4 + 1), id="tensor-over-the-limit"),
    pytest.param(torch.ones(0), id="empty-tensor"),
    pytest.param(torch.ones(3, 3).t(), id="non-contiguous"),
    pytest.param(torch.ones(2, dtype=torch.complex64).conj(), id="lazy-conj"),
    pytest.param(torch.ones(2, dtype=torch.complex64).conj().imag, id="lazy-neg"),
    pytest.param(torch.nested.nested_tensor([torch.ones(1), torch.ones(2)]), id="nested"),
    pytest.param(torch.ones(2).to_sparse(), id="sparse"),
    pytest.param(torch.nn.Parameter(torch.ones(2)), id="parameter"),
    pytest.param(bytearray(b"abcd"), id="bytearray"),
    pytest.param(1.0, id="float"),
    pytest.param({}, id="empty-dict"),
    pytest.param({1: torch.ones(1)}, id="dict-by-int"),
    pytest.param({"a": torch.ones(1), "b": 2}, id="dict-with-a-number"),
    pytest.param({"a": torch.nn.Parameter(torch.ones(2))}, id="dict-of-a-parameter"),
    pytest.param({"a": torch.ones(0)}, id="dict-with-an-empty-tensor"),
    pytest.param({"a": torch.ones(3, 3).t()}, id="dict-non-contiguous"),
    pytest.param({"a": torch.ones(framing.INLINE_BYTES // 8),
                  "b": torch.ones(framing.INLINE_BYTES // 8 + 1)}, id="dict-over-the-limit"),
    pytest.param({str(i): torch.tensor([i]) for i in range(framing._DICT_ENTRIES + 1)},
                 id="dict-of-too-many-entries"),
    pytest.param(collections.OrderedDict(a=torch.ones(1)), id="ordered-dict"),
]


@pytest.fixture(params=["joined", "ctypes"])
def join(request, monkeypatch):
    """A tensor's frame joined by the C helper (where it is built), and without it."""
    if request.param == "ctypes":
        monkeypatch.setattr(framing, "_joined", None)
    elif framing._joined is None:
        pytest.skip("the C extension is not built here")


@pytest.mark.parametrize("obj", SMALL)
def test_a_small_frame_is_the_frame_the_general_path_makes(obj, join):
    frame = framing.small_frame(obj)
    header, tensors = codec.encode(obj)
    general, payload = framing.pack(header, tensors)
    assert frame == general and payload == [] and framing.payload_bytes(frame) == header.inline
    assert framing.small_frame(obj) == frame  # its opening cached now, the same frame


@pytest.mark.parametrize("obj", GENERAL)
def test_other_messages_have_no_small_frame(obj):
    assert framing.small_frame(obj) is None


def test_a_known_dtype_and_shape_still_has_each_tensor_looked_at():
    """The opening is kept by dtype and shape; whether a tensor's memory is its bytes
    is looked at for each tensor."""
    square = torch.arange(9.0).view(3, 3)
    assert framing.small_frame(square) is not None
    assert framing.small_frame(square.t()) is None
    pair = torch.ones(2, dtype=torch.complex64)
    assert framing.small_frame(pair.imag.contiguous()) is not None
    assert framing.small_frame(pair.conj().imag) is None  # a lazy negative


def test_a_small_frame_carries_the_tensor_as_it_is_now(join):
    t = torch.zeros(2)
    first = framing.small_frame(t)
    t += 1
    header, sizes, inline, _ = framing.unpack_sized(framing.small_frame(t))
    assert first != framing.small_frame(t)
    assert codec.decode(header, framing.split_inline(header, inline, sizes)).tolist() == [1, 1]


def test_a_received_header_is_decoded_once_and_shared():
    frame = framing.small_frame(torch.arange(4, dtype=torch.int32))
    h1, sizes1, inline1, offer1 = framing.unpack_sized(frame)
    h2, sizes2, inline2, _ = framing.unpack_sized(frame)
    assert h1 is h2 and sizes1 is sizes2 and sizes1 == [16]
    assert inline1 == inline2 and offer1 == b""
    msg = classify(h1, inline1, offer1, "peer", sizes=sizes1)
    assert msg.tensors[0].tolist() == [0, 1, 2, 3]
    assert framing.unpack(frame)[0] is h1


def test_headers_with_a_piggyback_are_decoded_each_time():
    header, tensors = codec.encode(torch.ones(1), piggyback={"version": 3})
    frame, _ = framing.pack(header, tensors)
    assert framing.unpack_sized(frame)[0] is not framing.unpack_sized(frame)[0]


def test_the_header_cache_stays_bounded(monkeypatch):
    monkeypatch.setattr(framing, "_KNOWN", {})
    monkeypatch.setattr(framing, "_KNOWN_MAX", 8)
    for n in range(1, 20):
        header, sizes, inline, _ = framing.unpack_sized(framing.small_frame(b"q" * n))
        assert sizes == [n] and inline == b"q" * n
    assert len(framing._KNOWN) == 8


class _NoLookups(dict):
    def get(self, key, default=None):
        raise AssertionError(f"a {len(key)}-byte header was looked up")


def test_a_header_too_large_to_keep_is_decoded_without_a_lookup(monkeypatch):
    # A component's frame rides in the header (a channel's batch of puts: 100 KiB and
    # more); hashing it for a lookup that cannot hit cost more than decoding it.
    monkeypatch.setattr(framing, "_KNOWN", _NoLookups())
    frame_bytes = bytes(range(256)) * 400
    header, tensors = codec.encode_framed(frame_bytes, [torch.arange(3)])
    frame, _ = framing.pack(header, tensors)
    got, sizes, inline, offer = framing.unpack_sized(frame)
    assert type(got.piggyback) is bytes and got.piggyback == frame_bytes
    assert sizes == [24] and offer == b"" and inline == frame[len(frame) - 24:]
    assert framing.unpack_sized(frame)[0] is not got


def test_a_bad_header_raises_every_time():
    frame = framing.small_frame(b"abcd")
    (hlen,) = framing._LEN.unpack_from(frame)
    bad = frame[:4] + b"\xc1" * hlen + frame[4 + hlen:]
    for _ in range(2):
        with pytest.raises(CodecError):
            framing.unpack_sized(bad)


def _received(obj):
    """``obj`` sent as one frame and taken in: the object a receive returns."""
    header, sizes, inline, offer = framing.unpack_sized(framing.small_frame(obj))
    return codec.decode(header, classify(header, inline, offer, "peer", sizes=sizes).tensors)


@pytest.fixture
def no_spares(monkeypatch):
    monkeypatch.setattr(framing, "_SPARES", {})
    monkeypatch.setattr(framing, "_SPARE_FOR", [None])


def test_the_next_tensor_of_a_known_header_is_made_ahead(no_spares):
    first = _received(torch.tensor([1.0, 2.0]))
    framing.spare_ahead()
    (made,) = framing._SPARES.values()
    spare = made[1]
    second = _received(torch.tensor([3.0, 4.0]))
    assert second is spare and second.tolist() == [3.0, 4.0] and not framing._SPARES
    framing.spare_ahead()
    third = _received(torch.tensor([5.0, 6.0]))
    # Each message has a tensor of its own: a later one never writes an earlier one's.
    assert third is not second and third.data_ptr() != second.data_ptr()
    assert (first.tolist(), second.tolist(), third.tolist()) == ([1, 2], [3, 4], [5, 6])
    second += 1  # the receiver's to change, like any received tensor
    assert _received(torch.tensor([7.0, 8.0])).tolist() == [7, 8]


def test_a_dict_of_one_tensor_gets_a_tensor_made_ahead_too(no_spares):
    first = _received({"reward": torch.tensor([1.0])})
    framing.spare_ahead()
    (made,) = framing._SPARES.values()
    second = _received({"reward": torch.tensor([2.0])})
    assert list(second) == ["reward"] and second["reward"] is made[1]
    assert first["reward"].tolist() == [1.0] and second["reward"].tolist() == [2.0]
    framing.spare_ahead()
    # Another key, the same tensor: another header, another spare, not this one.
    assert _received({"value": torch.tensor([3.0])}) == {"value": torch.tensor([3.0])}
    assert _received({"reward": torch.tensor([4.0])})["reward"] is not second["reward"]


def test_a_spare_of_one_shape_is_not_taken_by_another(no_spares):
    _received(torch.arange(6, dtype=torch.int32).view(2, 3))
    framing.spare_ahead()
    assert len(framing._SPARES) == 1
    got = _received(torch.arange(6, dtype=torch.int32))  # the same bytes, another shape
    assert got.shape == (6,) and len(framing._SPARES) == 1
    framing.spare_ahead()  # now the 1-d one's too, the 2-d one still there
    assert len(framing._SPARES) == 2
    got = _received(torch.arange(6, dtype=torch.int32).view(2, 3) * 2)
    assert got.shape == (2, 3) and got.flatten().tolist() == [0, 2, 4, 6, 8, 10]


def test_no_spare_is_made_for_a_header_decoded_each_time(no_spares):
    header, tensors = codec.encode(torch.ones(2), piggyback={"version": 3})
    frame, _ = framing.pack(header, tensors)
    for _ in range(2):
        header, sizes, inline, offer = framing.unpack_sized(frame)
        tensor, piggyback = codec.decode(
            header, classify(header, inline, offer, "peer", sizes=sizes).tensors)
        assert tensor.tolist() == [1, 1] and piggyback == {"version": 3}
        framing.spare_ahead()
        assert framing._SPARES == {}


def test_the_spares_stay_bounded(no_spares, monkeypatch):
    monkeypatch.setattr(framing, "_SPARES_MAX", 3)
    for n in range(1, 10):
        _received(torch.ones(n))
        framing.spare_ahead()
        assert 1 <= len(framing._SPARES) <= 3


def test_threads_taking_in_at_once_never_share_a_spare(no_spares):
    import sys
    import threading

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as CPython allows
    got: dict[int, list[torch.Tensor]] = {k: [] for k in range(4)}

    def take_in(k: int) -> None:
        for i in range(300):
            framing.spare_ahead()
            got[k].append(_received(torch.tensor([float(k), float(i)])))

    threads = [threading.Thread(target=take_in, args=(k,)) for k in got]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        sys.setswitchinterval(old)
    assert not any(t.is_alive() for t in threads)
    for k, tensors in got.items():
        assert [t.tolist() for t in tensors] == [[k, i] for i in range(300)]
    ptrs = [t.data_ptr() for tensors in got.values() for t in tensors]
    assert len(set(ptrs)) == len(ptrs)
