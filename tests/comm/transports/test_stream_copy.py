"""Copies that write around the caches (the ``_stream_copy`` C extension): every byte
lands, nothing past the ends is touched, the GIL is released, and bad arguments are
refused."""

from __future__ import annotations

import platform
import threading
import time

import pytest
import torch

from rlcomm.comm.transports import bulk_copy, shm  # noqa: F401 - shm gives the rings' layout
from rlcomm.comm.transports.shm_memory import CTRL_BYTES, HEAD, SLEEPING, TAIL
from rlcomm.comm.transports.shm_ring import FRAME, INLINE, RECORD
from tests.waiting import wait_for

_stream_copy = pytest.importorskip("rlcomm.comm.transports._stream_copy")


def test_the_extension_is_built_and_streams_on_x86_64():
    # setup.py builds it optionally; a machine with a C compiler (CI) must have it.
    assert bulk_copy.STREAMS == (platform.machine() == "x86_64")


@pytest.mark.parametrize("nbytes", [0, 1, 63, 64, 65, 4095, 4096 + 17, (1 << 20) + 3])
@pytest.mark.parametrize("dst_off", [0, 1, 33, 63])
@pytest.mark.parametrize("src_off", [0, 7])
def test_every_byte_lands_and_nothing_around_it_is_written(nbytes, dst_off, src_off):
    src = torch.randint(0, 256, (nbytes + 64,), dtype=torch.uint8)
    dst = torch.zeros(nbytes + 128, dtype=torch.uint8)
    _stream_copy.copy(dst.data_ptr() + dst_off, src.data_ptr() + src_off, nbytes)
    assert torch.equal(dst[dst_off : dst_off + nbytes], src[src_off : src_off + nbytes])
    assert not dst[:dst_off].any() and not dst[dst_off + nbytes :].any()


def test_overlapping_ranges_copy_as_memmove_does():
    buf = torch.arange(10_000, dtype=torch.int64).remainder(256).to(torch.uint8)
    want = buf.clone()
    want[100:9100] = buf[0:9000].clone()
    _stream_copy.copy(buf.data_ptr() + 100, buf.data_ptr(), 9000)
    assert torch.equal(buf, want)


@pytest.mark.parametrize("args", [(), (1, 2), (1, 2, 3, 4), ("a", 0, 1), (0, 0, -1)])
def test_bad_arguments_are_refused(args):
    with pytest.raises((TypeError, OverflowError)):
        _stream_copy.copy(*args)


@pytest.mark.timeout(60)
def test_a_copy_releases_the_gil():
    n = 512 << 20
    src = torch.ones(n, dtype=torch.uint8)
    dst = torch.empty(n, dtype=torch.uint8)
    ticks: list[float] = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.perf_counter())

    t = threading.Thread(target=ticker)
    t.start()
    wait_for(lambda: ticks, "the ticker ticking", 10, interval=0.001)
    start = time.perf_counter()
    _stream_copy.copy(dst.data_ptr(), src.data_ptr(), n)
    end = time.perf_counter()
    stop.set()
    t.join()
    # The other thread ran in the middle of the copy: with the GIL held it could only run
    # at its ends (in one switch interval).
    third = (end - start) / 3
    assert end - start > 0.015
    assert any(start + third < x < end - third for x in ticks)
    assert bool(dst.all())


def test_a_large_bulk_copy_streams_and_lands_every_byte():
    n = bulk_copy.PARALLEL_BYTES + (3 << 20) + 5
    src = torch.randint(0, 256, (n,), dtype=torch.uint8)
    dst = torch.zeros(n + 10, dtype=torch.uint8)
    bulk_copy.copy(dst[3 : 3 + n], src)
    assert torch.equal(dst[3 : 3 + n], src) and not dst[:3].any() and not dst[3 + n :].any()


@pytest.mark.parametrize("nbytes", [0, 1, 4, 4000])
def test_joined_is_the_head_then_the_bytes_at_an_address(nbytes):
    src = torch.randint(0, 256, (nbytes + 8,), dtype=torch.uint8)
    got = _stream_copy.joined(b"head", src.data_ptr() + 3, nbytes)
    assert type(got) is bytes and got == b"head" + bytes(src[3 : 3 + nbytes].tolist())


def test_joined_takes_several_addresses_in_turn():
    a = torch.arange(5, dtype=torch.uint8)
    b = torch.arange(100, 107, dtype=torch.uint8)
    got = _stream_copy.joined(b"hd", a.data_ptr(), 5, b.data_ptr() + 2, 4, a.data_ptr(), 0)
    assert got == b"hd" + bytes([0, 1, 2, 3, 4, 102, 103, 104, 105])


@pytest.mark.parametrize("args", [
    (bytearray(b"h"), 0, 0), (b"h", 0), (b"h", 0, -1), (b"h", "x", 1), (b"h", 0, 0, 0),
    (b"h", 0, 0, 0, -1), (b"h", 0, 0, "x", 1), (b"h", 0, 1 << 62, 0, 1 << 62),
])
def test_joined_refuses_bad_arguments(args):
    with pytest.raises((TypeError, ValueError, OverflowError)):
        _stream_copy.joined(*args)


# -- a small frame put into and taken from a ring (ring_put / ring_take, laid out as shm.py
# lays its rings out: shm.py gives the layout on import) ----------------------------------------

RING = 256


@pytest.fixture
def ring():
    mem = torch.zeros(CTRL_BYTES + RING, dtype=torch.uint8)
    words = mem[:CTRL_BYTES].view(torch.int64)
    return mem, words, mem.data_ptr(), CTRL_BYTES


def _record(mem, ctrl, pos):
    return RECORD.unpack(bytes(mem[ctrl + pos : ctrl + pos + RECORD.size].tolist()))


def test_a_frame_put_into_a_ring_is_a_frame_record_and_is_taken_whole(ring):
    mem, words, base, ctrl = ring
    assert _stream_copy.ring_take(base, RING) is None  # empty
    assert _stream_copy.ring_put(base, RING, b"hello") == 0
    assert _stream_copy.ring_put(base, RING, b"x" * 40) == 0
    assert int(words[HEAD // 8]) == 2 * 16 + 45 and int(words[TAIL // 8]) == 0
    assert _record(mem, ctrl, 0) == (FRAME, 0, 5)
    assert bytes(mem[ctrl + 16 : ctrl + 21].tolist()) == b"hello"
    assert _stream_copy.ring_take(base, RING) == b"hello"
    assert int(words[TAIL // 8]) == 21
    assert _stream_copy.ring_take(base, RING) == b"x" * 40
    assert _stream_copy.ring_take(base, RING) is None
    assert int(words[TAIL // 8]) == int(words[HEAD // 8])


def test_a_put_says_whether_the_reader_sleeps(ring):
    _, words, base, _ = ring
    words[SLEEPING // 8] = 1
    assert _stream_copy.ring_put(base, RING, b"wake") == 1
    words[SLEEPING // 8] = 0
    assert _stream_copy.ring_put(base, RING, b"on") == 0


def test_a_put_that_would_cross_the_end_or_overfill_writes_nothing(ring):
    mem, words, base, _ = ring
    # Near the end: the record would wrap, which only the general way writes.
    words[HEAD // 8] = words[TAIL // 8] = RING - 20
    before = mem.clone()
    assert _stream_copy.ring_put(base, RING, b"12345") == -1
    assert torch.equal(mem, before)
    assert _stream_copy.ring_put(base, RING, b"1234") == 0  # exactly to the end fits
    # Full: unread bytes leave no room, wherever the head is.
    words[HEAD // 8] = 2 * RING
    words[TAIL // 8] = RING + 10
    before = mem.clone()
    assert _stream_copy.ring_put(base, RING, b"a") == -1
    assert _stream_copy.ring_put(base, RING, b"a" * (RING + 1)) == -1
    assert torch.equal(mem, before)


def test_a_take_leaves_what_is_not_a_whole_frame_before_the_end(ring):
    mem, words, base, ctrl = ring

    def write(pos, kind, n, head):
        fits = min(RECORD.size, RING - pos)  # a record head at the end is cut there
        mem[ctrl + pos : ctrl + pos + fits] = torch.frombuffer(
            bytearray(RECORD.pack(kind, 0, n)[:fits]), dtype=torch.uint8)
        words[TAIL // 8] = pos
        words[HEAD // 8] = head

    write(0, INLINE, 8, 24)  # a payload record: the general way reads it
    assert _stream_copy.ring_take(base, RING) is None
    write(0, FRAME, 8, 20)  # half published
    assert _stream_copy.ring_take(base, RING) is None
    write(RING - 20, FRAME, 8, RING + 4)  # its bytes wrap
    assert _stream_copy.ring_take(base, RING) is None
    write(RING - 8, FRAME, 0, RING + 8)  # its record head wraps
    assert _stream_copy.ring_take(base, RING) is None
    assert int(words[TAIL // 8]) == RING - 8  # nothing was taken


def test_counters_no_writer_would_leave_are_never_used_as_addresses(ring):
    # The peer maps the ring too: whatever it writes there, neither call touches memory
    # outside the ring (the general path then says what is wrong).
    mem, words, base, _ = ring
    for head, tail in ((-RING, -RING), (-16, -40), (RING + 50, -10), (0, 100), (3 * RING, 0)):
        words[HEAD // 8], words[TAIL // 8] = head, tail
        before = mem.clone()
        assert _stream_copy.ring_put(base, RING, b"x") == -1
        assert _stream_copy.ring_take(base, RING) is None
        assert torch.equal(mem, before)


@pytest.mark.parametrize("call", [
    lambda: _stream_copy.ring_put(0, RING, b"x"),
    lambda: _stream_copy.ring_put(1 << 20, 8, b"x"),
    lambda: _stream_copy.ring_put(1 << 20, RING, bytearray(b"x")),
    lambda: _stream_copy.ring_put(1 << 20, RING),
    lambda: _stream_copy.ring_take(0, RING),
    lambda: _stream_copy.ring_take("x", RING),
    lambda: _stream_copy.ring_layout(0, 8, 24, 4096),
    lambda: _stream_copy.ring_layout(0, 8, 4092, 4096, 3),
    lambda: _stream_copy.ring_layout(0, 9, 24, 4096, 3),
    lambda: _stream_copy.ring_layout(0, 8, 4096, 4096, 3),  # a word just past the block
    lambda: _stream_copy.ring_layout(8, 16, 24, 16, 3),  # a block too small for its words
])
def test_the_ring_calls_refuse_bad_arguments(call):
    with pytest.raises((TypeError, ValueError)):
        call()
