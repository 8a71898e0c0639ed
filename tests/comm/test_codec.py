"""Tests of the pure message codec: round trips of every kind, errors, header bytes, fuzzing.

``_transfer`` plays the transport: header to bytes and back, one buffer allocated per
TensorMeta, the payload copied as bytes, then decode.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import pickle
import threading
import warnings
from typing import Any

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlcomm.comm import codec
from rlcomm.comm.codec import (
    DataclassNode,
    DictNode,
    Kind,
    MessageHeader,
    TensorMeta,
    as_bytes,
    decode,
    empty_like_meta,
    encode,
    encode_raw,
    header_from_bytes,
    header_to_bytes,
)
from rlcomm.comm.codec import message as codec_message
from rlcomm.comm.codec import structure as codec_structure
from rlcomm.comm.codec import tensors as codec_tensors
from rlcomm.comm.codec.header import _DTYPE_NAMES, _DTYPES
from rlcomm.errors import CodecError

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ALL_DTYPES = sorted(_DTYPES.items())
COMMON_DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
    torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2,
]  # fmt: skip


@dataclasses.dataclass
class Pair:
    a: Any
    b: Any = None


@dataclasses.dataclass(frozen=True)
class FrozenBox:
    value: Any
    note: str = "frozen"


@dataclasses.dataclass(slots=True)
class SlotBox:
    value: Any


@dataclasses.dataclass
class Rollout:
    obs: torch.Tensor
    actions: list
    extras: dict
    step: int = 0
    cache: Any = dataclasses.field(default=None, init=False)

    def __post_init__(self):
        raise AssertionError("decode must not run __post_init__")


Point = collections.namedtuple("Point", "x y")


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bit patterns of any dtype (NaNs included), compared bitwise by ``same``."""
    g = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    n = math.prod(shape) * dtype.itemsize
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)


def _transfer(obj: Any, piggyback: Any = None, inline: int = 0) -> tuple[MessageHeader, Any]:
    header, tensors = encode(obj, piggyback)
    header.inline = inline
    assert len(tensors) == len(header.tensors)
    for meta, t in zip(header.tensors, tensors, strict=True):
        assert t.is_contiguous() and not t.requires_grad
        assert (_DTYPE_NAMES[t.dtype], tuple(t.shape), t.device.type) == (
            meta.dtype, meta.shape, meta.device)  # fmt: skip
        assert meta.nbytes == t.numel() * t.element_size()
    received = header_from_bytes(header_to_bytes(header))
    assert received == header
    buffers = [empty_like_meta(m) for m in received.tensors]
    for buf, t in zip(buffers, tensors, strict=True):
        as_bytes(buf).copy_(as_bytes(t))
    return received, decode(received, buffers)


def same(a: Any, b: Any) -> None:
    """Assert ``b`` equals ``a`` in type and value; tensors bitwise, detached, contiguous."""
    assert type(b) is (torch.Tensor if isinstance(a, torch.Tensor) else type(a)), (a, b)
    if isinstance(a, torch.Tensor):
        assert (b.dtype, b.shape, b.device.type) == (a.dtype, a.shape, a.device.type)
        assert not b.requires_grad
        a = a.detach().resolve_conj().resolve_neg().contiguous()
        assert torch.equal(as_bytes(a), as_bytes(b))
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            same(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            same(a[k], b[k])
    elif dataclasses.is_dataclass(a) and not isinstance(a, type):
        for f in dataclasses.fields(a):
            same(getattr(a, f.name), getattr(b, f.name))
    else:
        assert a == b


def count_tensors(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return 1
    if isinstance(x, dict):
        x = list(x.values())
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        x = [getattr(x, f.name) for f in dataclasses.fields(x)]
    return sum(map(count_tensors, x)) if isinstance(x, list | tuple) else 0


# --- kinds -------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "dtype"), ALL_DTYPES, ids=[n for n, _ in ALL_DTYPES])
def test_every_dtype_round_trips(name, dtype):
    t = random_tensor(dtype, (2, 3), seed=1)
    header, out = _transfer(t)
    assert header.kind == Kind.TENSOR and header.tensors == [TensorMeta(name, (2, 3), "cpu")]
    same(t, out)


@pytest.mark.parametrize("shape", [(), (0,), (2, 0, 3), (1,), (4, 1, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bool, torch.complex128, torch.bfloat16])
def test_zero_dim_and_empty_tensors(shape, dtype):
    t = random_tensor(dtype, shape)
    same(t, _transfer(t)[1])
    same([t, t], _transfer([t, t])[1])


def test_non_contiguous_tensors_are_made_contiguous():
    base = torch.arange(24.0).reshape(2, 3, 4)
    views = [
        base.transpose(0, 2),
        base[:, ::2],
        torch.ones(3, 1).expand(3, 5),
        torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
    ]
    header, out = _transfer(views)
    assert header.kind == Kind.TENSOR_LIST
    same(views, out)


def test_requires_grad_and_lazy_conj_neg_bits():
    g = torch.randn(3, requires_grad=True)
    z = torch.randn(3, dtype=torch.complex64)
    header, out = _transfer({"g": g * 2, "conj": z.conj(), "neg": z.conj().imag})
    assert header.kind == Kind.TENSOR_DICT
    assert torch.equal(out["g"], (g * 2).detach()) and not out["g"].requires_grad
    assert torch.equal(out["conj"], z.conj().resolve_conj())
    assert torch.equal(out["neg"], -z.imag)


def test_tensor_list_and_dict_keep_order():
    ts = [random_tensor(d, (3,), i) for i, d in enumerate(COMMON_DTYPES)]
    header, out = _transfer(ts)
    assert header.kind == Kind.TENSOR_LIST and header.structure is None
    same(ts, out)
    d = {f"k{i}": t for i, t in reversed(list(enumerate(ts)))}
    header, out = _transfer(d)
    assert header.kind == Kind.TENSOR_DICT and isinstance(header.structure, DictNode)
    same(d, out)


def test_a_state_dict_travels_as_a_dict_of_tensors():
    """``Module.state_dict()`` is an OrderedDict: its tensors go raw, and it arrives as a
    dict (so a receiver can take it ``into=`` its own tensors)."""
    state = torch.nn.Linear(3, 2).state_dict()
    assert type(state) is collections.OrderedDict
    header, out = _transfer(state)
    assert header.kind == Kind.TENSOR_DICT and type(out) is dict
    same(dict(state), out)


def test_empty_containers():
    for obj in ([], {}):
        header, out = _transfer(obj)
        assert header.tensors == [] and out == obj and type(out) is type(obj)


def test_dataclass_with_nested_containers_and_plain_fields():
    t = torch.arange(6).reshape(2, 3)
    obj = Rollout.__new__(Rollout)  # skip __post_init__, which only guards decode
    obj.obs, obj.step, obj.cache = t.float(), 7, {"note": "x"}
    obj.actions = [t, "str", (t[0], 5), Pair(t.T, FrozenBox(t.bool())), SlotBox(1.5)]
    obj.extras = {"a": {"b": [t.double()]}, 3: t, "p": Point(t, 2), "s": {1, 2}}
    header, out = _transfer(obj)
    assert header.kind == Kind.DATACLASS and isinstance(header.structure, DataclassNode)
    assert len(header.tensors) == count_tensors(obj) == 8  # also those in pickled leaves
    same(obj, out)
    assert out.cache == {"note": "x"} and type(out.extras["p"]) is Point


def test_dataclass_variants():
    t = torch.ones(2)
    for obj in (FrozenBox(t), SlotBox([t, {"x": t}]), Pair(Pair(t, 1), None), Pair(1, "none")):
        header, out = _transfer(obj)
        assert header.kind == Kind.DATACLASS
        same(obj, out)
    unset = Rollout.__new__(Rollout)  # init=False fields never set are skipped
    unset.obs = t
    out = _transfer(unset)[1]
    assert torch.equal(out.obs, t) and not hasattr(out, "step") or out.step == 0


def test_dataclass_extra_instance_attributes_travel():
    obj = Pair(torch.ones(1))
    obj.added_later = torch.zeros(2)
    out = _transfer(obj)[1]
    assert torch.equal(out.added_later, torch.zeros(2))


@pytest.mark.parametrize(
    "obj",
    [
        "hello",
        12,
        None,
        (torch.ones(2), 1),
        {"a": {"b": torch.ones(1)}},
        {1: torch.ones(1)},
        {"a": torch.ones(1), "b": 2},
        [torch.ones(1), "x"],
        {1, 2, 3},
        Point(torch.ones(2), 3),
        Pair,
    ],
    ids=repr,
)
def test_everything_else_is_one_pickled_cpu_tensor(obj):
    header, out = _transfer(obj)
    assert header.kind == Kind.OBJECT and header.structure is None
    (meta,) = header.tensors
    assert meta.dtype == "uint8" and meta.device == "cpu" and len(meta.shape) == 1
    same(obj, out)


@pytest.mark.parametrize("size", [1, 4, 1 << 10, (64 << 10) + 3])
def test_bytes_travel_as_their_content_without_a_copy(size):
    data = (bytes(range(256)) * (size // 256 + 1))[:size]
    header, tensors = encode(data)
    assert header.kind == Kind.BYTES and len(tensors) == 1
    (t,) = tensors
    assert t.numel() == len(data) and t.data_ptr() == _address_of(data)  # a view, no copy
    header, out = _transfer(data)
    assert type(out) is bytes and out == data
    assert decode(header, [data]) == data  # inline bytes (framing) are the object itself
    assert encode(b"")[0].kind == Kind.OBJECT and _transfer(b"")[1] == b""  # pickled
    with pytest.raises(CodecError, match="flat uint8 CPU bytes"):
        decode(header, [torch.zeros(len(data) // 4, dtype=torch.float32)])
    with pytest.raises(CodecError, match="cannot be decoded"):
        decode(header, [])


def test_a_framed_message_carries_its_frame_unpickled():
    frame = b"\x93\x01\x02\x03 a component's msgspec frame"
    ts = [torch.arange(6, dtype=torch.int32), torch.ones(2, 2)]
    header, tensors = codec.encode_framed(frame, ts)
    assert header.kind == Kind.FRAMED and header.piggyback == frame  # as it is: no pickle
    received = header_from_bytes(header_to_bytes(header))
    out, got_frame = decode(received, [t.clone() for t in tensors])
    assert got_frame == frame and all(torch.equal(a, b) for a, b in zip(out, ts, strict=True))
    assert decode(*codec.encode_framed(b"", [])) == ([], b"")
    with pytest.raises(CodecError, match="must be bytes"):
        codec.encode_framed("text", [])
    forged = MessageHeader(Kind.FRAMED, [], None, None)
    with pytest.raises(CodecError, match="carries no frame"):
        decode(forged, [])


def _address_of(data: bytes) -> int:
    import ctypes

    return ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value


def test_tensors_inside_pickled_objects_travel_detached_and_contiguous():
    ts = [random_tensor(dtype, (3, 2), 5) for _, dtype in ALL_DTYPES]  # float8, uint16, ...
    grad = torch.randn(2, 3, requires_grad=True)
    obj = ("mixed", ts, {"t": grad.T, 1: torch.nn.Parameter(torch.ones(2))}, torch.ones(0))
    header, out = _transfer(obj)
    assert header.kind == Kind.OBJECT
    same(obj[:2], out[:2])
    assert out[2]["t"].is_contiguous() and not out[2]["t"].requires_grad
    assert torch.equal(out[2]["t"], grad.T) and out[3].shape == (0,)
    assert type(out[2][1]) is torch.nn.Parameter  # subclasses pickle their own way


def test_raw_tensor():
    t = torch.randn(4, 5).T
    header, tensors = encode_raw(t)
    assert header.kind == Kind.RAW and header.tensors == [TensorMeta("float32", (5, 4), "cpu")]
    assert tensors[0].is_contiguous()
    same(t, decode(header, [empty_like_meta(header.tensors[0]).copy_(tensors[0])]))
    with pytest.raises(CodecError, match="list"):
        encode_raw([t])


@pytest.mark.parametrize("payload", [{"step": 3}, 0, "", [], (1, torch.ones(1))])
def test_piggyback_comes_back_as_a_tuple(payload):
    for obj in (torch.ones(2), [torch.ones(1)], {"x": torch.ones(1)}, Pair(torch.ones(1)), "o"):
        header, out = _transfer(obj, piggyback=payload)
        assert header.piggyback is not None and isinstance(out, tuple) and len(out) == 2
        same(obj, out[0])
        same(payload, out[1])
    assert not isinstance(_transfer(torch.ones(1), piggyback=None)[1], tuple)


# --- errors ------------------------------------------------------------------------------


@pytest.fixture
def fake_cuda(monkeypatch):
    """Tensors marked ``t._fake_cuda = True`` get a ``cuda`` TensorMeta (CPU-only hosts)."""
    prepare = codec_tensors.prepare

    def fake(t):
        meta, out = prepare(t)
        if getattr(t, "_fake_cuda", False):
            meta = TensorMeta(meta.dtype, meta.shape, "cuda")
        return meta, out

    # Both users of prepare: whole messages and dataclass walking.
    monkeypatch.setattr(codec_message, "prepare", fake)
    monkeypatch.setattr(codec_structure, "prepare", fake)

    def make(*shape):
        t = torch.ones(*shape)
        t._fake_cuda = True
        return t

    return make


def test_mixing_cpu_and_cuda_is_rejected(fake_cuda):
    cpu, gpu = torch.ones(1), fake_cuda(1)
    with pytest.raises(CodecError, match=r"mix CPU and CUDA.*obj\[0\].*cpu.*obj\[1\].*cuda"):
        encode([cpu, gpu])
    with pytest.raises(CodecError, match=r"obj\['a'\] is on cuda but obj\['b'\] is on cpu"):
        encode({"a": gpu, "b": cpu})
    with pytest.raises(CodecError, match=r"obj\.a is on cpu but obj\.b\[1\]\['k'\] is on cuda"):
        encode(Pair(cpu, [1, {"k": gpu}]))
    with pytest.raises(CodecError, match=r"obj\.b\.<pickled> is on cuda"):
        encode(Pair(cpu, Point(gpu, 1)))
    assert encode([gpu, fake_cuda(2)])[0].tensors[1].device == "cuda"


@pytest.mark.parametrize(
    "obj", [threading.Lock(), {"f": threading.Lock()}, Pair(torch.ones(1), threading.Lock())]
)
def test_unpicklable_objects_are_named(obj):
    with pytest.raises(CodecError, match=r"cannot pickle.*(dict|lock|Lock|Pair)") as info:
        encode(obj)
    assert "lock" in str(info.value).lower()
    with pytest.raises(CodecError, match="piggyback payload of type"):
        encode(torch.ones(1), piggyback=obj)


def test_functions_and_local_dataclasses_travel_by_value():
    @dataclasses.dataclass
    class Local:
        x: torch.Tensor
        scale: float

    header, tensors = encode(Local(torch.ones(2), 3.0))
    assert header.kind == Kind.DATACLASS and header.structure.by_value is not None
    back = decode(header_from_bytes(header_to_bytes(header)), tensors)
    assert type(back) is Local and torch.equal(back.x, torch.ones(2)) and back.scale == 3.0
    offset = 5
    fn = decode(*encode(lambda v: v + offset))
    assert fn(1) == 6


def test_a_dataclass_of_a_scripts_main_travels_by_value():
    """A class of the sender's ``__main__`` imports back there, but a receiver's
    ``__main__`` is another program: it goes by value, not as ``__main__:Name``."""
    import __main__

    @dataclasses.dataclass
    class Prompt:
        ids: torch.Tensor

    Prompt.__module__, Prompt.__qualname__ = "__main__", "Prompt"
    had = getattr(__main__, "Prompt", None)
    __main__.Prompt = Prompt
    try:
        header, tensors = encode(Prompt(torch.arange(3)))
    finally:
        if had is None:
            del __main__.Prompt
        else:
            __main__.Prompt = had
    assert header.kind == Kind.DATACLASS and header.structure.by_value is not None
    back = decode(header_from_bytes(header_to_bytes(header)), tensors)
    assert torch.equal(back.ids, torch.arange(3))


def test_unimportable_dataclass_is_rejected_at_decode():
    header = MessageHeader(Kind.DATACLASS, [], DataclassNode("no_such_mod_xyz:Thing", [], []))
    with pytest.raises(CodecError, match="cannot import dataclass no_such_mod_xyz:Thing"):
        decode(header, [])
    header.structure = DataclassNode("collections:OrderedDict", [], [])
    with pytest.raises(CodecError, match="not a dataclass"):
        decode(header, [])


def test_cyclic_dataclass_is_rejected():
    obj = Pair(torch.ones(1))
    obj.b = [obj]
    with pytest.raises(CodecError, match="too deeply or cyclic"):
        encode(obj)


def test_unsupported_tensors_are_rejected():
    with pytest.raises(CodecError, match="tensor on meta"):
        encode(torch.ones(2, device="meta"))
    with pytest.raises(CodecError, match="dense"):
        encode([torch.eye(2).to_sparse()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8)
    with pytest.raises(CodecError, match="quint8 tensor"):
        encode_raw(q)


def test_decode_rejects_inconsistent_inputs():
    header, tensors = encode({"a": torch.ones(1), "b": torch.ones(2)})
    with pytest.raises(CodecError, match="declaring 2 tensors"):
        decode(header, tensors[:1])
    header.structure = DictNode(["a", "b"], [0, 5])
    with pytest.raises(CodecError, match="tensor 5 of 2"):
        decode(header, tensors)
    header.structure = DictNode(["a"], [0, 1])
    with pytest.raises(CodecError, match="1 names, 2 values"):
        decode(header, tensors)
    header.structure = None
    with pytest.raises(CodecError, match="structure None"):
        decode(header, tensors)
    bad = MessageHeader(Kind.OBJECT, [TensorMeta("uint8", (3,), "cpu")])
    with pytest.raises(CodecError, match="unpickle the received object"):
        decode(bad, [torch.tensor([1, 2, 3], dtype=torch.uint8)])
    bad = MessageHeader(Kind.TENSOR, [TensorMeta("uint8", (1,), "cpu")], piggyback=b"junk")
    with pytest.raises(CodecError, match="piggyback"):
        decode(bad, [torch.zeros(1, dtype=torch.uint8)])


# --- header bytes and helpers ------------------------------------------------------------


def test_header_bytes_round_trip_for_every_kind():
    t = torch.ones(2, 3, dtype=torch.bfloat16)
    for obj in (t, [t, t], {"x": t}, Pair(t, [t, 1]), ("tuple", 1)):
        header, _ = encode(obj, piggyback={"p": 1})
        header.inline = 12
        data = header_to_bytes(header)
        assert isinstance(data, bytes)
        for form in (data, memoryview(data), bytearray(data)):
            assert header_from_bytes(form) == header
    raw = encode_raw(t)[0]
    assert header_from_bytes(header_to_bytes(raw)) == raw


def test_header_is_msgpack_not_pickle():
    header, _ = encode({"x": torch.ones(1)})
    data = header_to_bytes(header)
    assert msgspec.msgpack.decode(data) == [2, [["float32", [1], "cpu"]], [2, ["x"], [0]], None, 0, 0]
    # Not a pickle: read as one, its bytes are a bad opcode or an absurd length.
    with pytest.raises((pickle.UnpicklingError, MemoryError)):
        pickle.loads(data)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x00",
        b"garbage bytes",
        b"\x93\x01",
        msgspec.msgpack.encode([9, [], None, None, 0]),  # unknown kind
        msgspec.msgpack.encode([0, [["float33", [1], "cpu"]], None, None, 0]),
        msgspec.msgpack.encode([0, [["float32", [-1], "cpu"]], None, None, 0]),
        msgspec.msgpack.encode([0, [["float32", [1], "tpu"]], None, None, 0]),
        msgspec.msgpack.encode([3, [], [7, "x"], None, 0]),  # unknown node tag
        msgspec.msgpack.encode([0, [], None, None, -1]),
        msgspec.msgpack.encode({"kind": 0}),
    ],
)
def test_garbage_header_bytes_raise_codec_error(data):
    with pytest.raises(CodecError, match="invalid message header"):
        header_from_bytes(data)


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=48))
def test_fuzzed_header_bytes_give_a_header_or_codec_error(data):
    try:
        assert isinstance(header_from_bytes(data), MessageHeader)
    except CodecError:
        pass


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_mutated_headers_decode_or_raise_codec_error(data):
    t = torch.arange(4.0)
    obj = data.draw(st.sampled_from([t, [t, t], {"a": t}, Pair(t, [t, "s"]), ("o", 1)]))
    raw = bytearray(header_to_bytes(encode(obj)[0]))
    for _ in range(data.draw(st.integers(1, 3))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    try:
        header = header_from_bytes(bytes(raw))
    except CodecError:
        return
    if sum(m.nbytes for m in header.tensors) > 1 << 20:
        return
    try:
        decode(header, [empty_like_meta(m) for m in header.tensors])
    except CodecError:
        pass


def test_tensor_meta_nbytes_and_empty_like_meta():
    for name, dtype in ALL_DTYPES:
        meta = TensorMeta(name, (2, 3, 0) if name == "int8" else (2, 3), "cpu")
        buf = empty_like_meta(meta)
        assert (buf.dtype, tuple(buf.shape), buf.device.type) == (dtype, meta.shape, "cpu")
        assert meta.nbytes == buf.numel() * buf.element_size() == as_bytes(buf).numel()
    assert TensorMeta("float64", (), "cpu").nbytes == 8
    with pytest.raises(CodecError, match="unknown dtype"):
        empty_like_meta(TensorMeta("nope", (1,), "cpu"))
    assert empty_like_meta(TensorMeta("float32", (2,), "cuda"), device="cpu").device.type == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_empty_like_meta_for_cuda_without_cuda():
    with pytest.raises(CodecError, match="CUDA is not available"):
        empty_like_meta(TensorMeta("float32", (2,), "cuda"))


def test_as_bytes_views_memory_of_every_shape_and_dtype():
    for t in (torch.tensor(1.5), torch.tensor(True), torch.ones(0, 3), torch.ones(2, 2).bfloat16()):
        view = as_bytes(t)
        assert view.dtype == torch.uint8 and view.dim() == 1
        assert view.numel() == t.numel() * t.element_size()
        view.fill_(0)
        assert not t.any()
    z = torch.tensor([1 + 2j], dtype=torch.complex64)
    assert as_bytes(z).numel() == 8
    with pytest.raises(CodecError, match="contiguous"):
        as_bytes(torch.ones(2, 3).T)
    with pytest.raises(CodecError, match="conj"):
        as_bytes(z.conj())
    assert as_bytes(torch.ones(2, requires_grad=True)).numel() == 8


# --- property test -----------------------------------------------------------------------


@st.composite
def tensors(draw) -> torch.Tensor:
    dtype = draw(st.sampled_from(COMMON_DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    t = random_tensor(dtype, shape, draw(st.integers(0, 2**31)))
    how = draw(st.sampled_from(["plain", "transposed", "grad"]))
    if how == "transposed" and t.dim() >= 2:
        t = t.transpose(0, 1)
    elif how == "grad" and dtype in (torch.float32, torch.float64):
        t = t.clone().requires_grad_(True)
    return t


PLAIN = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=4)
VALUES = st.recursive(
    tensors() | PLAIN,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=3), inner, max_size=3)
        | st.dictionaries(st.integers(0, 9), inner, max_size=2)
        | st.tuples(inner, inner)
        | st.builds(Pair, inner, inner)
        | st.builds(FrozenBox, inner)
        | st.builds(SlotBox, inner)
    ),
    max_leaves=8,
)


def expected_kind(obj: Any) -> Kind:
    if isinstance(obj, torch.Tensor):
        return Kind.TENSOR
    if type(obj) is list and all(isinstance(x, torch.Tensor) for x in obj):
        return Kind.TENSOR_LIST
    if type(obj) is dict and all(type(k) is str and isinstance(v, torch.Tensor) for k, v in obj.items()):
        return Kind.TENSOR_DICT
    return Kind.DATACLASS if dataclasses.is_dataclass(obj) else Kind.OBJECT


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(VALUES, st.none() | PLAIN)
def test_nested_containers_round_trip(obj, piggyback):
    header, out = _transfer(obj, piggyback)
    assert header.kind == expected_kind(obj)
    if header.kind != Kind.OBJECT:  # every tensor extracted, none pickled
        assert len(header.tensors) == count_tensors(obj)
    if piggyback is not None:
        out, back = out
        same(piggyback, back)
    same(obj, out)


# --- CUDA --------------------------------------------------------------------------------


@cuda_only
def test_cuda_round_trips():
    t = torch.randn(3, 4, device="cuda")
    for obj in (t, [t, t.T], {"a": t.half()}, Pair(t, [t.bfloat16(), 1])):
        header, out = _transfer(obj)
        assert all(m.device == "cuda" for m in header.tensors)
        same(obj, out)
    header, out = _transfer((t, 1))  # OBJECT: pickled, comes back on the same device
    assert header.tensors[0].device == "cpu" and out[0].device == t.device


@cuda_only
def test_cuda_mixing_is_rejected():
    with pytest.raises(CodecError, match="mix CPU and CUDA"):
        encode([torch.ones(1), torch.ones(1, device="cuda")])
    with pytest.raises(CodecError, match="mix CPU and CUDA"):
        encode(Pair(torch.ones(1), {"g": torch.ones(1, device="cuda")}))


@cuda_only
def test_cuda_as_bytes_and_empty_like_meta():
    buf = empty_like_meta(TensorMeta("bfloat16", (2, 3), "cuda"))
    assert buf.device.type == "cuda" and as_bytes(buf).device == buf.device
    assert as_bytes(buf).numel() == 12


class _EncodesWhilePickled:
    """Its pickling encodes another object: the codec's per-thread pickler is re-entered."""

    def __reduce__(self):
        header, tensors = codec.encode({"inner": object.__new__(_Plain)})
        return (str, (f"inner-{header.kind}-{len(tensors)}",))


class _Plain:
    pass


def test_pickling_reentered_from_a_reduce_and_reused_across_messages():
    header, tensors = codec.encode([_EncodesWhilePickled(), 1])
    assert codec.decode(header, tensors)[0].startswith("inner-")
    # The reused pickler carries nothing from one message to the next.
    first = codec.encode({"a": [1, 2]})
    second = codec.encode({"a": [1, 2]})
    assert first[1][0].numpy().tobytes() == second[1][0].numpy().tobytes()
    assert codec.decode(*second) == {"a": [1, 2]}


def test_a_dict_decodes_to_the_tensors_its_node_names_in_any_order():
    """A flat dict (each key's tensor in turn) is rebuilt without walking its node; a
    node naming the tensors in another order is walked, and means what it says."""
    a, b = torch.ones(1), torch.zeros(2)
    header, tensors = encode({"a": a, "b": b})
    assert header.structure.values == [0, 1]
    out = decode(header, [a, b])
    assert list(out) == ["a", "b"] and out["a"] is a and out["b"] is b
    swapped = MessageHeader(header.kind, header.tensors[::-1], DictNode(["a", "b"], [1, 0]))
    out = decode(swapped, [b, a])
    assert list(out) == ["a", "b"] and out["a"] is a and out["b"] is b
    with pytest.raises(CodecError, match="refers to tensor 2"):
        decode(MessageHeader(header.kind, header.tensors, DictNode(["a", "b"], [0, 2])), [a, b])
