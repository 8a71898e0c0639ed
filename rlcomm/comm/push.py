"""A weight sync the source pushes, between workers on one GPU: the handles a worker
gets (:class:`WeightPusher` on the trainer, :class:`PushedWeights` on each rollout) over
the pair protocol of :mod:`~rlcomm.comm.transports.cuda_push`.

Each pair meets in a store in the source's mailbox (under ``push/<name>/<receiver>``),
which only the job's members can reach; the link between them accepts no process but the
peer's. Both ends make their handle at about the same time: the source waits for each
receiver's registration, each receiver for the source to take it.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from rlcomm.comm.broadcast.group import expand_groups
from rlcomm.comm.identity.address import WorkerAddress
from rlcomm.comm.manager import CommManager
from rlcomm.comm.options import default_timeout
from rlcomm.comm.transports.cuda_push import PushSource, PushTarget, named_tensors, register


def _check_cuda(named: dict[str, torch.Tensor], what: str) -> torch.device:
    """The one GPU ``named``'s tensors lie on (each contiguous).

    Raises:
        ValueError: a tensor is not a contiguous CUDA tensor, or they lie on two devices.
    """
    devices = set()
    for name, t in named.items():
        if not t.is_cuda:
            raise ValueError(
                f"{what}: {name!r} is on {t.device}; a pushed weight sync writes CUDA "
                "tensors between workers on one GPU (use broadcast(into=...) or "
                "recv(into=...) for others)")
        if not t.is_contiguous():
            raise ValueError(f"{what}: {name!r} is not contiguous; call .contiguous() first")
        devices.add(t.device)
    if len(devices) > 1:
        raise ValueError(f"{what}: the tensors lie on {sorted(map(str, devices))}; use one GPU")
    return next(iter(devices))


def _deadline(timeout: float | None) -> float:
    return time.monotonic() + (default_timeout() if timeout is None else timeout)


def _same_node(manager: CommManager, peer: WorkerAddress, ep: Any, what: str) -> None:
    if ep.node_id != manager.endpoint.node_id or ep.host != manager.endpoint.host:
        raise ValueError(f"{what}: {peer} is on another node; a pushed weight sync works "
                         "between workers on one GPU (use broadcast between nodes)")


class WeightPusher:
    """The source's end of a pushed weight sync (made by
    :meth:`rlcomm.Worker.weight_pusher`): each :meth:`push` writes the registered
    receivers' tensors from this worker's, on the GPU, from this process."""

    def __init__(self, source: PushSource, manager: CommManager, name: str):
        self._source = source
        self._manager = manager
        self._address = manager.address
        self._name = name

    def __repr__(self) -> str:
        return f"WeightPusher({self._name!r} at {self._address}, {self._source!r})"

    def add_receivers(self, to: list[tuple[str, Any]], timeout: float | None = None) -> None:
        """Take in the registrations of the workers ``to`` (a list of ``(group_name,
        ranks)``, as :meth:`~rlcomm.Worker.broadcast`'s ``groups``; each calls
        :meth:`~rlcomm.Worker.pushed_weights` meanwhile): a receiver that joins late, or
        comes back after a restart. Each gets the next push on; one registered already is
        replaced.

        Raises:
            ValueError: a worker is on another node.
            ProtocolMismatchError: its tensors do not match these (both ends raise).
            CommTimeoutError: it did not register within ``timeout``.
        """
        what = f"weight_pusher {self._name!r} at {self._address}"
        deadline = _deadline(timeout)
        manager = self._manager
        for peer in expand_groups(to):
            ep = manager.peer_endpoint(peer)
            _same_node(manager, peer, ep, what)
            store, _ = manager.pair_store(self._address, f"push/{self._name}/{peer}",
                                          max(0.01, deadline - time.monotonic()))
            try:
                self._source.attach(store, str(peer), ep.pid, deadline)
            finally:
                _close(store)

    @property
    def version(self) -> int:
        """The last version pushed (0 before the first push)."""
        return self._source.version

    @property
    def receivers(self) -> list[str]:
        """The receivers the next push writes (those that closed or died are left out)."""
        return self._source.receivers

    def push(self, tensors: Any = None, timeout: float | None = None) -> int:
        """Write every receiver's registered tensors from this worker's (those given to
        :meth:`~rlcomm.Worker.weight_pusher`, or ``tensors`` of the same names, dtypes
        and shapes), and return the new version number.

        Waits on the host until each receiver has released the version it holds (see
        :meth:`PushedWeights.update`); then the copies are queued on the GPU, after the
        work queued on this thread's current stream (the new values), and that stream
        is ordered after them: later work on it may write the tensors. The call returns
        without waiting for the copies.

        Raises:
            CommTimeoutError: a receiver did not release its version within ``timeout``
                (the ``comm_timeout`` setting by default); nothing was written.
            PeerLostError: receivers died (named); the others got the version, and the
                dead are left out from now on.
        """
        named = None
        if tensors is not None:
            named = named_tensors(tensors, "weight push")
            _check_cuda(named, "weight push")
        device = self._source.device
        order = torch.cuda.current_stream(device)
        return self._source.push(order, _deadline(timeout), named)

    def close(self) -> None:
        """Stop: receivers waiting in :meth:`PushedWeights.update` raise
        ``PeerLostError`` saying the source closed."""
        self._source.close()


class PushedWeights:
    """A receiver's end of a pushed weight sync (made by
    :meth:`rlcomm.Worker.pushed_weights`): its registered tensors, which the source
    writes; :meth:`update` waits for the next version."""

    def __init__(self, target: PushTarget, device: torch.device, source: WorkerAddress, name: str):
        self._target = target
        self._device = device
        self._source = source
        self._name = name

    def __repr__(self) -> str:
        return f"PushedWeights({self._name!r} from {self._source}, {self._target!r})"

    @property
    def version(self) -> int:
        """The version the tensors hold (0 before the first update)."""
        return self._target.version

    def update(self, timeout: float | None = None) -> int:
        """Release the version the tensors hold and wait for the next one; returns its
        number. Work queued on this thread's current stream afterwards reads the new
        values; the source writes them only after the work queued on it before the call.

        Raises:
            CommTimeoutError: no new version within ``timeout`` (the ``comm_timeout``
                setting by default); call again (the tensors stay released).
            PeerLostError: the source closed, or its process died.
        """
        return self._target.update(torch.cuda.current_stream(self._device), _deadline(timeout))

    def release(self) -> None:
        """Let the source write the tensors once the work queued on this thread's
        current stream now is done (a push then need not wait for :meth:`update`). Until
        the next :meth:`update` returns, nothing may read them."""
        self._target.release(torch.cuda.current_stream(self._device))

    def close(self) -> None:
        """Leave the sync: the source writes here no more."""
        self._target.close()


def weight_pusher(
    manager: CommManager, tensors: Any, receivers: list[tuple[str, Any]], name: str,
    timeout: float | None,
) -> WeightPusher:
    """See :meth:`rlcomm.Worker.weight_pusher`."""
    what = f"weight_pusher {name!r} at {manager.address}"
    named = named_tensors(tensors, what)
    device = _check_cuda(named, what)
    if not receivers:
        raise ValueError(f"{what}: no receivers")
    pusher = WeightPusher(PushSource(named, device), manager, name)
    try:
        pusher.add_receivers(receivers, timeout)
    except BaseException:
        pusher.close()
        raise
    return pusher


def _close(store: Any) -> None:
    close = getattr(store, "close", None)
    if close is not None:
        close()


def pushed_weights(
    manager: CommManager, tensors: Any, src: WorkerAddress, name: str, timeout: float | None,
) -> PushedWeights:
    """See :meth:`rlcomm.Worker.pushed_weights`."""
    what = f"pushed_weights {name!r} at {manager.address} from {src}"
    named = named_tensors(tensors, what)
    device = _check_cuda(named, what)
    deadline = _deadline(timeout)
    _same_node(manager, src, manager.peer_endpoint(src), what)
    store, ep = manager.pair_store(src, f"push/{name}/{manager.address}",
                                   max(0.01, deadline - time.monotonic()))
    try:
        target = register(store, named, torch.cuda.current_stream(device), str(src), ep.pid,
                          deadline)
    finally:
        _close(store)
    return PushedWeights(target, device, src, name)
