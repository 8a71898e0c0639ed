"""The message codec: a Python object in, ``(MessageHeader, tensors)`` out, and back.

Pure: no I/O, no Ray, no torch.distributed. A transport sends :func:`header_to_bytes` then
each tensor's memory (:func:`as_bytes`); the receiver parses :func:`header_from_bytes`,
allocates buffers with :func:`empty_like_meta`, receives into them and calls :func:`decode`.

- a tensor, a ``list`` of tensors, a ``dict`` of ``str`` to tensors (an ``OrderedDict``
  too, as ``Module.state_dict()`` returns; it arrives as a ``dict``) and a dataclass
  instance (its fields walked through lists, tuples, str-keyed dicts and nested
  dataclasses) have their tensors *extracted*: never pickled, sent as raw memory, so CUDA
  tensors can go through NCCL. Non-tensor parts of a dataclass are pickled into the header;
  a tensor hidden in a pickled part (say a namedtuple) is extracted as well.
- anything else (tuples, nested dicts, dicts with non-``str`` keys, strings, ...) is
  pickled (protocol 5) into ONE ``uint8`` CPU tensor, kind ``OBJECT``. Tensors inside it
  are copied into the pickle; CUDA ones come back on the same device index (``cuda:1``).

- a non-empty ``bytes`` object (:data:`~rlcomm.comm.codec.message.BYTES_MIN`) travels as
  its content, kind ``BYTES``, never pickled: the sender copies nothing, the receiver
  copies it once into the new ``bytes`` (a small one rides in the frame).

- a component's message (a channel's) is kind ``FRAMED``: its tensors, and its own
  frame bytes in the header, which the codec never unpickles
  (:func:`~rlcomm.comm.codec.message.encode_framed`).

A message may carry zero tensors (an empty list or dict, a dataclass without tensors).

*Strict mode* (:func:`set_strict_mode`, or ``RLCOMM_STRICT=1`` in the environment when
rlcomm is imported) unpickles nothing that can run code: pickled parts may only build
plain values (numbers, strings, bytes, lists, tuples, dicts, sets, ``None``) and tensors;
any other class or function named in a pickle, and dataclasses sent by value, are
refused with :class:`~rlcomm.errors.CodecError`. Tensors, containers of them, importable
dataclasses and plain values still travel.
"""

from rlcomm.comm.codec.header import (
    DataclassNode,
    DictNode,
    Kind,
    ListNode,
    MessageHeader,
    Node,
    TensorMeta,
    TupleNode,
    dtype_of,
    header_from_bytes,
    header_to_bytes,
)
from rlcomm.comm.codec.message import decode, destinations, encode, encode_framed, encode_raw
from rlcomm.comm.codec.pickling import PICKLE_PROTOCOL, set_strict_mode, strict_mode
from rlcomm.comm.codec.tensors import as_bytes, empty_like_meta, meta_of

__all__ = [
    "PICKLE_PROTOCOL",
    "DataclassNode",
    "DictNode",
    "Kind",
    "ListNode",
    "MessageHeader",
    "Node",
    "TensorMeta",
    "TupleNode",
    "as_bytes",
    "decode",
    "destinations",
    "dtype_of",
    "empty_like_meta",
    "encode",
    "encode_framed",
    "encode_raw",
    "header_from_bytes",
    "header_to_bytes",
    "meta_of",
    "set_strict_mode",
    "strict_mode",
]
