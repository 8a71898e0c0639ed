"""Tensors as a message carries them: their :class:`~rlcomm.comm.codec.header.TensorMeta`,
their sendable form (:func:`prepare`), receive buffers and byte views."""

from __future__ import annotations

from typing import Any

import torch

from rlcomm.comm.codec.header import _DTYPE_NAMES, TensorMeta, _dtype_of
from rlcomm.errors import CodecError


def meta_of(t: torch.Tensor) -> TensorMeta:
    """The :class:`TensorMeta` describing a cpu or cuda tensor as it would be sent."""
    return TensorMeta(_DTYPE_NAMES[t.dtype], tuple(t.shape), "cuda" if t.is_cuda else "cpu")


def empty_like_meta(meta: TensorMeta, device: torch.device | str | None = None) -> torch.Tensor:
    """Allocate an uninitialised receive buffer for the tensor that ``meta`` describes.

    Args:
        meta: the tensor's metadata from a received header.
        device: where to allocate; by default ``cpu`` or this process's current CUDA device.

    Raises:
        CodecError: unknown dtype, or a CUDA tensor arrives where CUDA is not available.
    """
    if device is None:
        if meta.device == "cuda" and not torch.cuda.is_available():
            raise CodecError(
                "the sender sent a CUDA tensor but CUDA is not available in this process; "
                "send CPU tensors or give the receiving worker a GPU"
            )
        device = meta.device
    return torch.empty(meta.shape, dtype=_dtype_of(meta.dtype), device=device)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a contiguous tensor's memory (any dtype, 0-d included).

    Writing into the view writes into ``t``, so a transport can receive any dtype as bytes.

    Raises:
        CodecError: ``t`` is not contiguous, or has a lazy conjugate/negative bit.
    """
    if not t.is_contiguous() or t.is_conj() or t.is_neg():
        raise CodecError(
            f"as_bytes needs a contiguous tensor without lazy conj/neg bits, got shape "
            f"{tuple(t.shape)} strides {t.stride()}; call .contiguous() / .resolve_conj() first"
        )
    if t.requires_grad:
        t = t.detach()
    return t.reshape(-1).view(torch.uint8)


def prepare(t: torch.Tensor) -> tuple[TensorMeta, torch.Tensor]:
    """The meta and the sendable form of a tensor: detached, resolved, contiguous."""
    device = "cpu" if t.is_cpu else "cuda" if t.is_cuda else None  # t.device.type is slower
    name = _DTYPE_NAMES.get(t.dtype)
    if device is None or name is None or t.layout is not torch.strided or t.is_nested:
        raise CodecError(
            f"cannot send a {'nested ' * t.is_nested}{t.layout} {t.dtype} tensor on {t.device}: "
            "only dense, non-quantized cpu and cuda tensors can be sent; convert it first "
            "(.cpu(), .cuda(), .to_dense(), .dequantize())"
        )
    if t.requires_grad:
        t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    return TensorMeta(name, tuple(t.shape), device), t



def check_one_device(metas: list[TensorMeta], where: Any) -> None:
    """Raise if ``metas`` mix CPU and CUDA; ``where(i)`` describes tensor ``i``."""
    if len({m.device for m in metas}) > 1:
        first = metas[0].device
        i = next(i for i, m in enumerate(metas) if m.device != first)
        raise CodecError(
            f"cannot mix CPU and CUDA tensors in one message: {where(0)} is on {first} "
            f"but {where(i)} is on {metas[i].device}; move them to one device first"
        )


