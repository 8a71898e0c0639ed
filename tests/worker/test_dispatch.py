"""Dispatch math without Ray: splits, padding, joins, chunk plans, mesh layouts."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlcomm import Worker
from rlcomm.worker.batch import (
    batch_len,
    concat_batches,
    is_batch,
    pad_amount,
    pad_batch,
    split_batch,
    split_sizes,
    strip_padding,
    take_range,
)
from rlcomm.worker.dispatch import (
    check_signature,
    chunk_ranges,
    collect_batches,
    nd_layout,
    plan_part_fetch,
    split_call_args,
)


class Batch:
    """A minimal verl DataProto stand-in: chunk(n), concat(list), len, slicing."""

    def __init__(self, items):
        self.items = list(items)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, s):
        return Batch(self.items[s])

    def chunk(self, n):
        assert len(self) % n == 0, "even chunks only"
        k = len(self) // n
        return [Batch(self.items[i * k:(i + 1) * k]) for i in range(n)]

    @staticmethod
    def concat(batches):
        return Batch([x for b in batches for x in b.items])

    def __eq__(self, other):
        return isinstance(other, Batch) and self.items == other.items


class ChunkOnly:
    """A batch object without __len__ or slicing: only its own chunk(n)."""

    def __init__(self, items):
        self._items = list(items)

    def chunk(self, n):
        k = len(self._items) // n
        return [ChunkOnly(self._items[i * k:(i + 1) * k]) for i in range(n)]

    @classmethod
    def concat(cls, parts):
        return cls([x for p in parts for x in p._items])


def test_split_sizes_uneven():
    assert split_sizes(10, 3) == [4, 3, 3]
    assert split_sizes(10, 4) == [3, 3, 2, 2]
    assert split_sizes(2, 4) == [1, 1, 0, 0]
    assert split_sizes(0, 2) == [0, 0]
    assert pad_amount(10, 4) == 2 and pad_amount(8, 4) == 0 and pad_amount(0, 3) == 0
    with pytest.raises(ValueError, match="parts"):
        split_sizes(3, 0)


def test_batch_kinds():
    assert is_batch([1]) and is_batch((1,)) and is_batch(torch.zeros(2)) and is_batch(np.zeros(2))
    assert not is_batch(torch.tensor(1.0)) and not is_batch(3) and not is_batch("abc") and not is_batch(None)
    assert is_batch({"a": torch.zeros(3), "meta": "x"}) and not is_batch({"lr": 0.1})
    assert is_batch(Batch([1])) and is_batch(ChunkOnly([1]))
    assert batch_len({"a": torch.zeros(3), "b": [1, 2, 3], "meta": 1}) == 3
    with pytest.raises(ValueError, match="different lengths"):
        batch_len({"a": torch.zeros(3), "b": [1, 2]})


def test_split_list_tensor_array_dict_uneven():
    chunks, pad = split_batch(list(range(10)), 3)
    assert chunks == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]] and pad == 0
    t = torch.arange(10)
    tc, _ = split_batch(t, 3)
    assert [c.tolist() for c in tc] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert tc[0].untyped_storage().nbytes() == 4 * 8  # a copy, not a view of all 10
    ac, _ = split_batch(np.arange(10), 3)
    assert [len(c) for c in ac] == [4, 3, 3]
    dc, _ = split_batch({"x": torch.arange(5), "y": list("abcde"), "cfg": 7}, 2)
    assert dc[0]["x"].tolist() == [0, 1, 2] and dc[1]["y"] == ["d", "e"] and dc[1]["cfg"] == 7
    assert split_batch((1, 2, 3), 2)[0] == [(1, 2), (3,)]


def test_split_and_join_round_trip():
    for value in (list(range(7)), torch.arange(7), np.arange(7), {"a": torch.arange(7), "k": "v"}):
        chunks, _ = split_batch(value, 3)
        joined = concat_batches(chunks)
        if isinstance(value, dict):
            assert torch.equal(joined["a"], value["a"]) and joined["k"] == "v"
        elif isinstance(value, list):
            assert joined == value
        else:
            assert (joined == value).all()


def test_padding_and_stripping():
    padded, pad = pad_batch(list(range(10)), 4)
    assert pad == 2 and padded == list(range(10)) + [0, 1]
    chunks, pad = split_batch(list(range(10)), 4, pad=True)
    assert chunks == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 0, 1]] and pad == 2
    assert collect_batches(chunks, pad) == list(range(10))
    # Padding longer than the batch wraps around it.
    chunks, pad = split_batch([7], 3, pad=True)
    assert chunks == [[7], [7], [7]] and pad == 2
    assert strip_padding(concat_batches(chunks), pad) == [7]
    tchunks, pad = split_batch(torch.arange(5), 4, pad=True)
    assert [c.tolist() for c in tchunks] == [[0, 1], [2, 3], [4, 0], [1, 2]] and pad == 3
    assert collect_batches(tchunks, pad).tolist() == [0, 1, 2, 3, 4]
    assert split_batch([1, 2, 3, 4], 2, pad=True)[1] == 0


def test_batch_objects():
    chunks, _ = split_batch(Batch(range(10)), 3)  # sliceable: uneven, not its chunk()
    assert [c.items for c in chunks] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert collect_batches(chunks) == Batch(range(10))
    chunks, pad = split_batch(Batch(range(5)), 2, pad=True)
    assert [c.items for c in chunks] == [[0, 1, 2], [3, 4, 0]] and pad == 1
    assert collect_batches(chunks, pad) == Batch(range(5))
    only = split_batch(ChunkOnly(range(6)), 3)[0]
    assert [c._items for c in only] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(TypeError, match="padding needs __len__"):
        split_batch(ChunkOnly(range(5)), 2, pad=True)
    with pytest.raises(TypeError, match="cannot slice"):
        take_range(ChunkOnly(range(3)), 0, 1)


def test_collect_non_batches_returns_list():
    assert collect_batches([None, None]) == [None, None]
    assert collect_batches([{"loss": 0.5}, {"loss": 0.25}]) == [{"loss": 0.5}, {"loss": 0.25}]
    assert collect_batches([[1], (2,)]) == [[1], (2,)]  # mixed kinds: untouched
    assert collect_batches([[1, 2], [3]]) == [1, 2, 3]


def test_split_call_args_mixes_batches_and_scalars():
    args, kwargs, pad = split_call_args(
        (list(range(5)), 0.5), {"mask": torch.ones(5), "name": "run"}, 2, where="W.f() [DP]"
    )
    assert args[0] == ([0, 1, 2], 0.5) and args[1] == ([3, 4], 0.5)
    assert kwargs[1]["mask"].shape == (2,) and kwargs[0]["name"] == "run" and pad == 0
    with pytest.raises(ValueError, match=r"W\.f\(\) \[DP\]: the batch arguments have different lengths"):
        split_call_args(([1, 2, 3],), {"y": [1, 2]}, 2, where="W.f() [DP]")
    _, _, pad = split_call_args(([1, 2, 3],), {}, 2, pad=True)
    assert pad == 1


def test_chunk_ranges_and_part_fetch():
    # 10 items over 3 chunks: 4, 3, 3.
    assert [chunk_ranges(10, 3, i) for i in range(3)] == [[(0, 4)], [(4, 7)], [(7, 10)]]
    # Padding wraps to the start: 10 over 4 padded to 12 -> last chunk 9, 0, 1.
    assert chunk_ranges(10, 4, 3, pad=True) == [(9, 10), (0, 2)]
    assert chunk_ranges(1, 3, 2, pad=True) == [(0, 1)]
    # Parts of lengths 3,3,2,2 (a 4-rank output); chunk 1 of 3 (items 4..7) reads parts 1 and 2.
    plan = plan_part_fetch([3, 3, 2, 2], chunk_ranges(10, 3, 1))
    assert plan == [(1, 1, 3), (2, 0, 1)]
    assert {i for i, _, _ in plan_part_fetch([5, 5], chunk_ranges(10, 2, 0))} == {0}
    assert plan_part_fetch([3, 3], [(0, 0)]) == []


@given(st.integers(0, 40), st.integers(1, 7), st.booleans())
def test_chunks_cover_the_batch(total, parts, pad):
    data = list(range(total))
    chunks, added = split_batch(data, parts, pad=pad)
    assert strip_padding(concat_batches(chunks), added) == data
    sizes = [len(c) for c in chunks]
    assert max(sizes) - min(sizes) <= 1
    if pad and total:
        assert len(set(sizes)) == 1
    lengths = [len(c) for c in chunks]
    for i in range(parts):
        ranges = chunk_ranges(total, parts, i, pad)
        assert [data[j] for a, b in ranges for j in range(a, b)] == chunks[i]
        got = [x for p, a, b in plan_part_fetch(lengths, ranges) for x in chunks[p][a:b]]
        assert got == chunks[i]


def test_nd_layout():
    # dp=2, tp=2: ranks 0,1 in dp 0; 2,3 in dp 1; tp rank 0 collects.
    layout = nd_layout([(0, True), (0, False), (1, True), (1, False)], "actor")
    assert layout.dp_size == 2 and layout.dp_rank_of == (0, 0, 1, 1)
    assert layout.collect_ranks == (0, 2) and layout.ranks_of_dp(1) == [2, 3]
    # Collect order follows the dp index, not the rank.
    assert nd_layout([(1, True), (0, True)]).collect_ranks == (1, 0)
    with pytest.raises(ValueError, match=r"no rank registered dp ranks \[1\]"):
        nd_layout([(0, True), (2, True)], "m")
    with pytest.raises(ValueError, match="is_collect=True"):
        nd_layout([(0, False)])


def test_a_worker_registers_its_meshes():
    class W(Worker):
        pass

    w = W()
    assert w._query_mesh_info("actor") is None
    w._register_dispatch_collect_info("actor", 1, True)
    assert w._query_dispatch_info("actor") == 1 and w._query_collect_info("actor") is True
    with pytest.raises(ValueError, match="registered already"):
        w._register_dispatch_collect_info("actor", 0, False)


def test_check_signature():
    class W:
        def f(self, x, y=1):
            pass

        @staticmethod
        def s(a):
            pass

    check_signature(W, "f", (1,), {"y": 2}, "here")
    check_signature(W, "s", (1,), {}, "here")
    with pytest.raises(TypeError, match=r"here: wrong arguments: missing a required"):
        check_signature(W, "f", (), {}, "here")
    with pytest.raises(TypeError, match="too many positional"):
        check_signature(W, "f", (1, 2, 3), {}, "here")
    with pytest.raises(TypeError, match="unexpected keyword"):
        check_signature(W, "f", (1,), {"z": 3}, "here")
    with pytest.raises(AttributeError, match="has no method 'g'"):
        check_signature(W, "g", (), {}, "here")
