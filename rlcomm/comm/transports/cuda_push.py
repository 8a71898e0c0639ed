"""Pushed weight sync on one GPU: the source writes its receivers' tensors itself.

A receiver (a rollout engine) *registers* the tensors it wants written, its parameters
say, once: it shares their storages by CUDA IPC handle and makes one interprocess event,
*free*. The source (the trainer) opens those storages once. From then on, one sync is:

1. The source waits on the host until every receiver has released the version it holds
   (a *free* message on the pair's link; the receiver recorded *free* on its stream just
   before, after the last work it queued that reads the tensors).
2. On the source's push stream, ordered after the caller's stream (the values are
   written) and after each receiver's *free* event, the source issues every copy itself:
   one batched copy per receiver, from its tensors straight into the receiver's.
3. It records one event, *ready*, orders the caller's stream after it (writes to the
   source's tensors on that stream come after the copies), and sends each receiver the
   new *version* number over its link.
4. A receiver waiting for the next version (:meth:`PushTarget.update`) orders its stream
   after *ready* and goes on: work it queues afterwards reads the new values.

No copy runs in a receiver's process, so all of a sync's copies are queued from one
process, one after the other, as the bound of N device copies in one process is; a
receiver's cost is a host wait and one event wait. One event per end serves every sync:
a receiver records *free* again only after the next version came, and the source records
*ready* again only after every receiver released the last one, so a wait on either always
means the record just announced.

The link is one ``AF_UNIX`` ``SOCK_SEQPACKET`` socket per pair, on an abstract name the
source publishes in the pair's store and whose peer process is checked (``SO_PEERCRED``).
The registration travels in the store, which only the job's members can reach; it is
decoded once the store has proved it belongs to the job, and checked (sizes, bounds,
names, dtypes and shapes against the source's tensors) before anything is opened.

Lifetimes: a receiver's registered tensors stay alive while it is registered. A receiver
that closes tells the source, which closes what it opened and leaves that receiver out of
later syncs; a source that closes tells its receivers, whose next :meth:`~PushTarget.update`
raises. A peer seen gone (its link closed without a word) fails the waiting call with
:class:`~rlcomm.errors.PeerLostError`; a receiver then releases its shares on the dead
source's behalf, so nothing stays pinned.
"""

from __future__ import annotations

import datetime
import logging
import os
import select
import socket
import struct
import threading
import time
import uuid
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from rlcomm.comm.transports.cuda_device import CUDA, DeviceOps, Share
from rlcomm.comm.transports.cuda_ipc import (
    byte_views,
    connect_link,
    pieces_outside,
    recv_within,
    sub_store_of,
)
from rlcomm.errors import (
    CommError,
    CommTimeoutError,
    PeerLostError,
    ProtocolMismatchError,
)

logger = logging.getLogger(__name__)

#: A link message: its kind and a version number.
_MESSAGE = struct.Struct("<BQ")
_VERSION, _FREE, _CLOSE, _BASE = 1, 2, 3, 4  # _BASE: the version a receiver starts at
#: The most tensors one registration may name.
MAX_TENSORS = 1 << 20


class TensorSpec(msgspec.Struct, array_like=True, frozen=True):
    """One registered tensor: its name, dtype and shape, and where its bytes lie (the
    index of its storage's share, the byte offset in that storage, the bytes)."""

    name: str
    dtype: str
    shape: list[int]
    share: int
    offset: int
    nbytes: int


class Registration(msgspec.Struct, array_like=True, frozen=True):
    """What a receiver puts in the pair's store: who it is (a token naming this
    registration's link, its process), its GPU, its *free* event and its tensors."""

    token: str
    pid: int
    gpu: str
    free: bytes
    shares: list[Share]
    tensors: list[TensorSpec]


class Answer(msgspec.Struct, array_like=True, frozen=True):
    """The source's hello on the link: its *ready* event, or why it refused."""

    ready: bytes
    refusal: str = ""


_encode = msgspec.msgpack.Encoder().encode
_decode_registration = msgspec.msgpack.Decoder(Registration).decode
_decode_answer = msgspec.msgpack.Decoder(Answer).decode


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def named_tensors(tensors: Any, what: str) -> dict[str, torch.Tensor]:
    """``tensors`` (a dict of name to tensor, a list or tuple, or one tensor) as a dict
    whose names are the dict's keys, the list's indices as text, or ``""``.

    Raises:
        TypeError: ``tensors`` holds something else than tensors.
        ValueError: it holds none.
    """
    if isinstance(tensors, torch.Tensor):
        named = {"": tensors}
    elif isinstance(tensors, dict):
        named = {str(k): v for k, v in tensors.items()}
        if len(named) != len(tensors):
            raise ValueError(f"{what}: two keys of the dict have the same text")
    elif isinstance(tensors, (list, tuple)):
        named = {str(i): t for i, t in enumerate(tensors)}
    else:
        raise TypeError(f"{what}: expected a dict of tensors, a list of tensors or a tensor, "
                        f"got {type(tensors).__name__}")
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: {name!r} is a {type(t).__name__}, not a tensor")
    if not named:
        raise ValueError(f"{what}: no tensors")
    return named


def check_registration(
    reg: Registration, sources: dict[str, torch.Tensor], gpu: str,
) -> str:
    """Why the source cannot write ``reg``'s tensors from ``sources`` on ``gpu`` (""
    when it can): every registered name is one of the source's, of its dtype and shape,
    and every piece lies inside its share."""
    if reg.gpu != gpu:
        return (f"the receiver's tensors lie on GPU {reg.gpu}, the source's on {gpu}; a "
                "pushed sync needs both on one GPU (use broadcast between GPUs)")
    if len(reg.tensors) > MAX_TENSORS:
        return f"{len(reg.tensors)} tensors is more than {MAX_TENSORS}"
    seen: set[str] = set()
    for spec in reg.tensors:
        src = sources.get(spec.name)
        if src is None:
            return f"the source has no tensor named {spec.name!r} (it has {sorted(sources)[:8]})"
        if spec.name in seen:
            return f"{spec.name!r} is registered twice"
        seen.add(spec.name)
        if spec.dtype != _dtype_name(src.dtype) or list(spec.shape) != list(src.shape):
            return (f"{spec.name!r} is {spec.dtype} {tuple(spec.shape)} at the receiver but "
                    f"{_dtype_name(src.dtype)} {tuple(src.shape)} at the source")
        if spec.nbytes != src.numel() * src.element_size():
            return f"{spec.name!r}: {spec.nbytes} bytes do not fit its dtype and shape"
        pieces = [(spec.share, spec.offset, spec.nbytes)] if spec.nbytes else []
        outside = pieces_outside(reg.shares, pieces)
        if outside:
            return f"{spec.name!r}: {outside}"
    return ""


def _take(store: dist.Store, key: str, deadline: float) -> bytes:
    """Wait for ``key``, remove it and return its value."""
    timeout = datetime.timedelta(seconds=max(0.01, deadline - time.monotonic()))
    take = getattr(store, "take", None)
    if take is not None:
        return take(key, timeout)
    store.wait([key], timeout)
    value = store.get(key)
    store.delete_key(key)
    return value


class _Link:
    """One pair's socket: small messages, each a kind and a version."""

    def __init__(self, sock: socket.socket, peer: str):
        self.sock = sock
        self.peer = peer
        self.closed_by_peer = False  # a close message came
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)

    def post(self, kind: int, version: int) -> None:
        # At most a message or two wait on either side: a full link means a stuck peer.
        try:
            self.sock.send(_MESSAGE.pack(kind, version), socket.MSG_DONTWAIT)
        except OSError as exc:
            raise PeerLostError(f"weight push with {self.peer}: the peer is gone ({exc})",
                                peer=self.peer, op="push") from exc

    def read(self, deadline: float | None, what: str) -> tuple[int, int]:
        """The next message, waiting until ``deadline`` (``(0, 0)`` when none came by a
        deadline already past at the call: a look at what has come).

        Raises:
            CommTimeoutError: none came in time (a deadline still ahead at the call).
            PeerLostError: the link closed (the peer's process is gone).
            ProtocolMismatchError: the message is malformed.
        """
        looked = deadline is not None and deadline <= time.monotonic()
        try:
            data = recv_within(self.sock, self._poller, deadline)
        except OSError as exc:
            raise PeerLostError(f"{what}: the link to {self.peer} broke ({exc})",
                                peer=self.peer, op="push") from exc
        if data is None:
            if looked:
                return 0, 0
            raise CommTimeoutError(f"{what}: {self.peer} did not answer in time",
                                   peer=self.peer, op="push")
        if not data:
            raise PeerLostError(f"{what}: {self.peer}'s process is gone", peer=self.peer,
                                op="push")
        if len(data) != _MESSAGE.size:
            raise ProtocolMismatchError(f"{what}: a malformed message from {self.peer}",
                                        peer=self.peer, op="push")
        kind, version = _MESSAGE.unpack(data)
        if kind == _CLOSE:
            self.closed_by_peer = True
        return kind, version

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a wait on it
        except OSError:
            pass
        self.sock.close()


# -- the source's side ---------------------------------------------------------------------


class _Receiver:
    """What the source holds of one receiver: the link, the receiver's memory as opened
    here, its *free* event, and the version it released last."""

    def __init__(self, link: _Link, pairs: list[tuple[str, torch.Tensor]], free: Any):
        self.link = link
        self.pairs = pairs  # (source name, the receiver's bytes: views that keep them open)
        self.free = free
        self.released = 0


class PushSource:
    """The source's end of a pushed sync: its tensors and its receivers (see the module
    docstring).

    Args:
        tensors: the tensors it writes from, by name (contiguous, on ``device``).
        device: the GPU they lie on.
        ops: the device layer (a fake in the protocol's CPU tests).
    """

    def __init__(self, tensors: dict[str, torch.Tensor], device: torch.device, ops: DeviceOps = CUDA):
        self._ops = ops
        self._device = device
        self._gpu = ops.gpu_uuid(device)
        self._names = list(tensors)
        self._views = dict(zip(self._names, byte_views(list(tensors.values()), "weight push", ops),
                               strict=True))
        self._tensors = dict(tensors)
        self._stream = ops.new_stream(device)
        self._ready, self._ready_handle = ops.new_ipc_event(device)
        self._mark = ops.new_event()  # see DeviceOps.wait_stream
        self._lock = threading.Lock()
        self._receivers: dict[str, _Receiver] = {}
        self._version = 0
        self._closed = False

    def __repr__(self) -> str:
        return (f"PushSource(version={self._version}, receivers={sorted(self._receivers)}, "
                f"tensors={len(self._names)})")

    @property
    def version(self) -> int:
        """The last version pushed (0 before the first push)."""
        return self._version

    @property
    def device(self) -> torch.device:
        """The GPU the source's tensors lie on."""
        return self._device

    @property
    def receivers(self) -> list[str]:
        """The receivers the next push writes to."""
        return list(self._receivers)

    def attach(self, store: dist.Store, peer: str, peer_pid: int | None, deadline: float) -> None:
        """Take in the registration of receiver ``peer`` from ``store`` and link with it.
        A receiver that registers after some pushes starts at the next one.

        Raises:
            CommTimeoutError: it did not register by ``deadline``.
            ProtocolMismatchError: its tensors do not match this source's (it is told
                why, and raises the same).
        """
        what = f"weight push set-up with {peer}"
        while True:
            try:
                raw = _take(store, "registration", deadline)
            except (RuntimeError, CommError) as exc:
                raise CommTimeoutError(f"{what}: {peer} did not register in time ({exc})",
                                       peer=peer, op="push") from exc
            try:
                reg = _decode_registration(raw)
            except (msgspec.DecodeError, ValueError) as exc:
                raise ProtocolMismatchError(f"{what}: a malformed registration ({exc})",
                                            peer=peer, op="push") from exc
            if peer_pid is None or reg.pid == peer_pid:
                break
            logger.warning("%s: a registration of process %d, not %d (a stale one), was "
                           "dropped", what, reg.pid, peer_pid)
        refusal = check_registration(reg, self._tensors, self._gpu)
        pairs, free = [], None
        if not refusal:
            try:
                opened = [self._ops.open(s, self._device) for s in reg.shares]
                pairs = [(spec.name, opened[spec.share][spec.offset : spec.offset + spec.nbytes])
                         for spec in reg.tensors if spec.nbytes]
                free = self._ops.open_ipc_event(reg.free, self._device)
            except (RuntimeError, ValueError) as exc:
                refusal = f"the source could not open the receiver's memory ({exc})"
        hello = _encode(Answer(self._ready_handle, refusal))
        sock, _ = connect_link(sub_store_of(store, reg.token), 0, hello, deadline, peer, peer_pid)
        link = _Link(sock, peer)
        if refusal:
            link.close()
            raise ProtocolMismatchError(f"{what}: refused: {refusal}", peer=peer, op="push")
        with self._lock:
            if self._closed:
                link.close()
                raise PeerLostError(f"{what}: the source was closed", peer=peer, op="push")
            old = self._receivers.pop(peer, None)
            receiver = _Receiver(link, pairs, free)
            # It holds the last version's number from now on (nothing of it yet: its
            # first update is the next push).
            receiver.released = self._version
            try:
                link.post(_BASE, self._version)
            except PeerLostError:
                link.close()
                raise
            self._receivers[peer] = receiver
        if old is not None:
            old.link.close()

    def push(self, order: Any, deadline: float | None, tensors: dict[str, torch.Tensor] | None = None) -> int:
        """Write every receiver's tensors from this source's (or from ``tensors``, of the
        same names, dtypes and shapes), ordered after the work queued on ``order`` (the
        caller's stream), which is ordered after the copies. Returns the new version.

        Raises:
            CommTimeoutError: a receiver did not release its last version by
                ``deadline`` (nothing was written).
            PeerLostError: receivers are gone; they are left out from now on, and the
                others got the version (the error names the gone).
        """
        ops = self._ops
        views = self._views if tensors is None else self._checked_views(tensors)
        with self._lock:
            if self._closed:
                raise PeerLostError("weight push: the source was closed", op="push")
            version = self._version + 1
            failed: dict[str, CommError] = {}
            for name, receiver in list(self._receivers.items()):
                try:
                    self._take_in(name, receiver, version - 1, deadline)
                    self._take_in(name, receiver, version - 1, 0.0)  # a close behind it
                except (PeerLostError, ProtocolMismatchError) as exc:
                    failed[name] = exc
                if name in failed or receiver.link.closed_by_peer:
                    self._drop(name)  # gone, or closed: no longer written
            receivers = list(self._receivers.values())
            ops.wait_stream(self._stream, order, self._mark)  # the source's values are written
            for receiver in receivers:
                # The receiver's reads of its last version are done.
                ops.wait_event(self._stream, receiver.free)
                ops.copy([dst for _, dst in receiver.pairs],
                         [views[name] for name, _ in receiver.pairs], self._stream)
            ops.record(self._ready, self._stream)
            ops.wait_event(order, self._ready)  # later writes to the source come after
            for name, receiver in list(self._receivers.items()):
                try:
                    receiver.link.post(_VERSION, version)
                except PeerLostError as exc:
                    try:  # a receiver that closed meanwhile is no failure
                        self._take_in(name, receiver, -1, 0.0)
                    except CommError:
                        pass
                    if not receiver.link.closed_by_peer:
                        failed[name] = exc
                    self._drop(name)
            self._version = version
        if failed:
            names = sorted(failed)
            lost = any(isinstance(e, PeerLostError) for e in failed.values())
            raise (PeerLostError if lost else ProtocolMismatchError)(
                f"weight push of version {version}: {', '.join(names)} "
                f"{'is' if len(names) == 1 else 'are'} left out from now on "
                f"({'; '.join(f'{n}: {failed[n]}' for n in names)}); the others got it",
                peer=names[0], op="push")
        return version

    def _checked_views(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for name in self._names:
            t, mine = tensors.get(name), self._tensors[name]
            if t is None:
                raise ValueError(f"weight push: no tensor named {name!r} among those given")
            if t.dtype != mine.dtype or t.shape != mine.shape:
                raise ValueError(f"weight push: {name!r} is {t.dtype} {tuple(t.shape)}, "
                                 f"registered as {mine.dtype} {tuple(mine.shape)}")
        given = [tensors[n] for n in self._names]
        return dict(zip(self._names, byte_views(given, "weight push", self._ops), strict=True))

    def _take_in(self, name: str, receiver: _Receiver, version: int,
                 deadline: float | None) -> None:
        """Take in ``receiver``'s messages until it released ``version`` (waiting until
        ``deadline``), or it closed; a deadline already past takes in what has come."""
        what = f"weight push of version {version + 1} to {name}"
        while not receiver.link.closed_by_peer:
            if receiver.released >= version and not (deadline is not None
                                                     and deadline <= time.monotonic()):
                return
            try:
                kind, got = receiver.link.read(deadline, what)
            except CommTimeoutError as exc:
                raise CommTimeoutError(
                    f"{what}: it has not released version {version} (a receiver releases "
                    "its version by calling update() for the next one, or release())",
                    peer=name, op="push") from exc
            if kind == 0:  # nothing more has come
                return
            if kind == _FREE:
                if got != receiver.released + 1 or got > self._version:
                    raise ProtocolMismatchError(
                        f"{what}: it released version {got} after {receiver.released}",
                        peer=name, op="push")
                receiver.released = got
            elif kind != _CLOSE:
                raise ProtocolMismatchError(f"{what}: a message of kind {kind} came",
                                            peer=name, op="push")

    def _drop(self, name: str) -> None:
        receiver = self._receivers.pop(name, None)
        if receiver is not None:
            receiver.link.close()
            receiver.pairs.clear()  # closed here (each close synchronizes this stream)

    def close(self) -> None:
        """Tell every receiver this source is done, and close what it opened."""
        self._closed = True
        for receiver in list(self._receivers.values()):
            try:
                receiver.link.post(_CLOSE, self._version)
            except PeerLostError:
                pass
            receiver.link.close()  # wakes a push waiting on it
        with self._lock:
            for name in list(self._receivers):
                self._drop(name)


# -- the receiver's side -------------------------------------------------------------------


class PushTarget:
    """A receiver's end of a pushed sync: its registered tensors (see the module
    docstring). Made by :func:`register`."""

    def __init__(self, ops: DeviceOps, link: _Link, tensors: dict[str, torch.Tensor],
                 free: Any, ready: Any, shares: list[Share], peer: str, version: int = 0):
        self._ops = ops
        self._link = link
        self._tensors = tensors  # kept alive while registered
        self._free = free
        self._ready = ready
        self._shares = shares
        self._peer = peer
        self._lock = threading.Lock()
        self._version = version  # the last version pushed before it registered, or 0
        self._released = True  # registering released the tensors for the first push
        self._failed: CommError | None = None
        self._closed = False

    def __repr__(self) -> str:
        return (f"PushTarget(source={self._peer!r}, version={self._version}, "
                f"released={self._released}, tensors={len(self._tensors)})")

    @property
    def version(self) -> int:
        """The version the tensors hold (0 before the first)."""
        return self._version

    def release(self, order: Any) -> None:
        """Let the source write the tensors again once the work queued on ``order`` (the
        caller's stream) now is done. Until the next :meth:`update` returns, nothing
        may read them. Does nothing when released already."""
        with self._lock:
            self._check("release")
            self._release(order)

    def _release(self, order: Any) -> None:
        if self._released:
            return
        # The source's next copies into the tensors wait for the reads queued so far.
        self._ops.record(self._free, order)
        self._post(_FREE, self._version)
        self._released = True

    def update(self, order: Any, deadline: float | None) -> int:
        """Release the tensors (as :meth:`release`) and wait for the next version; the
        work queued on ``order`` afterwards reads it. Returns the version.

        Raises:
            CommTimeoutError: no version came by ``deadline`` (the tensors stay
                released; call again).
            PeerLostError: the source closed, or its process is gone.
        """
        with self._lock:
            self._check("update")
            self._release(order)
            what = f"weight update from {self._peer} (holding version {self._version})"
            try:
                kind, version = self._link.read(deadline, what)
            except PeerLostError as exc:
                self._lose(exc)
                raise
            if kind == _CLOSE:
                self._failed = PeerLostError(f"{what}: the source closed its weight push",
                                             peer=self._peer, op="update")
                raise self._failed
            if kind != _VERSION or version != self._version + 1:
                self._failed = ProtocolMismatchError(
                    f"{what}: message {kind} of version {version} came", peer=self._peer,
                    op="update")
                raise self._failed
            self._ops.wait_event(order, self._ready)  # the source's copies are done first
            self._version = version
            self._released = False
            return version

    def _post(self, kind: int, version: int) -> None:
        try:
            self._link.post(kind, version)
        except PeerLostError as exc:
            self._lose(exc)
            raise

    def _lose(self, exc: PeerLostError) -> None:
        """The source is gone: what it held open of this end's memory is let go here."""
        self._failed = exc
        for share in self._shares:
            self._ops.release(share)
        self._shares = []

    def _check(self, what: str) -> None:
        if self._closed:
            raise PeerLostError(f"weight {what}: this receiver was closed", peer=self._peer, op=what)
        if self._failed is not None:
            raise PeerLostError(f"weight {what}: the push from {self._peer} failed earlier "
                                f"({self._failed})", peer=self._peer, op=what)

    def close(self) -> None:
        """Leave the sync: the source stops writing here and closes what it opened."""
        if self._closed:
            return
        self._closed = True
        if self._failed is None:
            try:
                self._link.post(_CLOSE, self._version)
            except PeerLostError:
                for share in self._shares:
                    self._ops.release(share)
        self._link.close()
        with self._lock:
            self._tensors = {}


def register(
    store: dist.Store, tensors: dict[str, torch.Tensor], order: Any, peer: str,
    peer_pid: int | None, deadline: float, ops: DeviceOps = CUDA,
) -> PushTarget:
    """Register ``tensors`` (contiguous, on one GPU) to be written by the source
    ``peer`` through ``store`` (the pair's), and wait until it took them. The source
    writes them first after the work queued on ``order`` (the caller's stream) now.

    Raises:
        ValueError: a tensor is not contiguous, or not on the GPU.
        ProtocolMismatchError: the source refused them (the reason says why).
        CommTimeoutError: the source did not take them by ``deadline``.
    """
    names = list(tensors)
    views = byte_views(list(tensors.values()), f"weight registration with {peer}", ops)
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        raise ValueError(f"weight registration with {peer}: the tensors lie on "
                         f"{sorted(map(str, devices))}; register tensors of one GPU")
    device = next(iter(devices))
    free, free_handle = ops.new_ipc_event(device)
    shares: list[Share] = []
    index: dict[tuple[int, int], int] = {}
    specs = []
    for name, t, view in zip(names, tensors.values(), views, strict=True):
        share_at, offset = -1, 0
        if view.numel():
            key = ops.storage_key(view)
            share_at = index.get(key, -1)
            if share_at < 0:
                share_at = index[key] = len(shares)
                shares.append(ops.share(view))
            offset = ops.storage_offset(view)
        specs.append(TensorSpec(name, _dtype_name(t.dtype), list(t.shape), share_at, offset,
                                view.numel()))
    ops.record(free, order)  # the source's first copies come after the work queued so far
    token = uuid.uuid4().hex
    store.set("registration", _encode(Registration(token, os.getpid(), ops.gpu_uuid(device),
                                                   free_handle, shares, specs)))
    try:
        sock, theirs = connect_link(sub_store_of(store, token), 1, b"hello", deadline, peer, peer_pid)
    except CommError:
        for share in shares:
            ops.release(share)
        raise
    link = _Link(sock, peer)
    try:
        answer = _decode_answer(theirs)
        if answer.refusal:
            raise ProtocolMismatchError(
                f"weight registration with {peer}: the source refused it: {answer.refusal}",
                peer=peer, op="register")
        ready = ops.open_ipc_event(answer.ready, device)
    except (msgspec.DecodeError, ValueError, RuntimeError, ProtocolMismatchError) as exc:
        link.close()
        for share in shares:
            ops.release(share)
        if isinstance(exc, ProtocolMismatchError):
            raise
        raise ProtocolMismatchError(f"weight registration with {peer}: a bad answer ({exc})",
                                    peer=peer, op="register") from exc
    try:
        kind, base = link.read(deadline, f"weight registration with {peer}")
        if kind != _BASE:
            raise ProtocolMismatchError(f"weight registration with {peer}: a message of kind "
                                        f"{kind} came before the version to start at",
                                        peer=peer, op="register")
    except CommError:
        link.close()
        for share in shares:
            ops.release(share)
        raise
    return PushTarget(ops, link, dict(tensors), free, ready, shares, peer, base)
