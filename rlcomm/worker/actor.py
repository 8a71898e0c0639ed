"""How a ``Worker`` subclass becomes a Ray actor: process set-up and failure reporting.

The actor class is a subclass of the user's class, made once per launch. Its
constructor takes a :class:`WorkerContext` first, sets the environment and the worker's
identity, and only then runs the user's ``__init__``. Public methods are wrapped: before
one returns, the channel puts it made without waiting are settled (so its caller sees
the items queued), and a ``sys.exit`` inside one is logged with the worker's address
before the process ends. The calls a worker makes of itself per message are bound on it
without Ray's tracing wrappers (:data:`CALLED_INSIDE`).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import logging
import os
import signal
import socket
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import ray

from rlcomm.channel.client import settle_all
from rlcomm.comm.identity.address import WorkerAddress
from rlcomm.comm.process import ProcessContext, start_process
from rlcomm.settings import get_settings
from rlcomm.worker.configure import CONFIGURE_HOOK
from rlcomm.worker.worker import Worker

logger = logging.getLogger(__name__)


@dataclass
class WorkerContext(ProcessContext):
    """Everything a worker process needs before the user's ``__init__`` runs: a
    :class:`~rlcomm.comm.process.ProcessContext` and the failure reporting asked for."""

    catch_system_failure: bool = True


def catch_failure_default() -> bool:
    return get_settings().catch_failure


def find_free_port() -> int:
    """A TCP port free on this node right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


@ray.remote(num_cpus=0)
def free_port_on_node() -> tuple[str, int]:
    """Run with node affinity: this node's IP and a free port on it."""
    return ray.util.get_node_ip_address(), find_free_port()


def _install_failure_hooks(address: WorkerAddress) -> None:
    import faulthandler

    faulthandler.enable()

    def on_signal(signum: int, _frame: Any) -> None:
        logger.error("worker %s received %s; exiting", address, signal.Signals(signum).name)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            signal.signal(sig, on_signal)
        except ValueError:  # not the main thread of the process
            break
    atexit.register(lambda: logger.debug("worker %s process exiting", address))


def _settle_puts(name: str, failed: bool) -> None:
    """After a method: wait until the channel workers hold the items it put without
    waiting (:func:`~rlcomm.channel.client.settle_all`), so its caller sees them. A
    method that raised keeps its own error; a refused put is then only logged."""
    if failed:
        try:
            settle_all()
        except Exception as exc:  # noqa: BLE001 - the method's own error comes first
            logger.warning("after %s() raised, its channel puts failed too: %s", name, exc)
    else:
        settle_all()


@contextlib.contextmanager
def _method_end(worker: Any, name: str, log_exit: bool) -> Iterator[None]:
    """Around a method's body: settle its channel puts once it returned (or raised),
    and (``log_exit``) log a ``sys.exit`` inside it with the worker's address."""
    try:
        yield
    except SystemExit as exc:
        if log_exit:
            logger.error("worker %s called sys.exit(%s) in %s()",
                         worker.worker_address, exc.code, name)
        raise
    except BaseException:
        _settle_puts(name, True)
        raise
    _settle_puts(name, False)


def _wrap_method(name: str, fn: Any, log_exit: bool) -> Any:
    """``fn`` that settles its channel puts before it returns, and (``log_exit``) logs a
    ``sys.exit`` inside it with the worker's address."""
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def async_wrapper(self, *args, **kwargs):
            with _method_end(self, name, log_exit):
                return await fn(self, *args, **kwargs)

        return async_wrapper

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        with _method_end(self, name, log_exit):
            return fn(self, *args, **kwargs)

    return wrapper


def public_methods(worker_cls: type) -> list[str]:
    """Names of the public methods a subclass adds: no leading ``_``, and not a name
    that ``Worker`` itself defines."""
    base = set(dir(Worker))
    names = []
    for name in dir(worker_cls):
        if name.startswith("_") or name in base:
            continue
        if callable(inspect.getattr_static(worker_cls, name, None)):
            names.append(name)
    return names


#: The methods of ``Worker`` itself that a group offers too: those that take no peer and
#: mean the same on every rank. The others (``send``, ``recv``, ``broadcast``,
#: ``create_channel``, the mesh calls, ...) name a peer, a channel or a mesh that is one
#: rank's own, and are called inside a worker.
WORKER_GROUP_METHODS = ("gpu_info",)


def group_methods(worker_cls: type) -> list[str]:
    """Names of the methods a group of ``worker_cls`` offers: :func:`public_methods`
    but the ``configure_worker`` hook, and :data:`WORKER_GROUP_METHODS` (a subclass's
    override of one is what runs)."""
    names = [m for m in public_methods(worker_cls) if m != CONFIGURE_HOOK]
    return sorted(names + [m for m in WORKER_GROUP_METHODS if m not in names])


#: The ``Worker`` calls a worker makes of itself per message. Ray wraps every method of
#: an actor class for tracing, twice over (1.4-1.7 µs a call on the development
#: machine, a tenth of a small message's one-way time, paid by the sender's ``send`` and
#: the receiver's ``recv``); these are never called through Ray (a group does not offer
#: them), so each worker binds them on itself without the wrappers
#: (:func:`_bind_untraced`).
CALLED_INSIDE = ("send", "recv", "send_tensor", "recv_tensor", "broadcast")


def _untraced(fn: Any) -> Any:
    """``fn`` without Ray's tracing wrappers (its own decorators stay)."""
    while getattr(fn, "__ray_tracing_wrapped__", False):
        fn = fn.__wrapped__
    return fn


def _bind_untraced(worker: Any) -> None:
    """Bind :data:`CALLED_INSIDE` on ``worker`` itself, untraced, where Ray wrapped them
    (a subclass's override is what is bound). Ray runs an actor's methods from the
    functions of its class, so calls through Ray are unchanged."""
    cls = type(worker)
    for name in CALLED_INSIDE:
        fn = inspect.getattr_static(cls, name, None)
        plain = _untraced(fn)
        if plain is not fn and inspect.isfunction(plain):
            setattr(worker, name, types.MethodType(plain, worker))


def make_actor_class(worker_cls: type[Worker], catch_system_failure: bool) -> type:
    """The actor-side subclass of ``worker_cls`` (not yet wrapped by ``ray.remote``)."""

    def __init__(self, _rlcomm_ctx: WorkerContext, *args: Any, **kwargs: Any) -> None:
        ctx = _rlcomm_ctx
        if ctx.catch_system_failure:
            _install_failure_hooks(ctx.address)
        self._bind_identity(ctx.address, ctx.world_size)
        _bind_untraced(self)
        start_process(ctx)
        worker_cls.__init__(self, *args, **kwargs)

    def _rlcomm_node_info(self) -> dict[str, Any]:
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
        }

    namespace: dict[str, Any] = {
        "__init__": __init__,
        "_rlcomm_node_info": _rlcomm_node_info,
        "__module__": worker_cls.__module__,
        # A qualname that does not resolve makes cloudpickle ship the subclass by value.
        "__qualname__": f"{worker_cls.__qualname__}.<rlcomm actor>",
    }
    for name in public_methods(worker_cls):
        namespace[name] = _wrap_method(name, getattr(worker_cls, name), catch_system_failure)
    return type(worker_cls.__name__, (worker_cls,), namespace)
