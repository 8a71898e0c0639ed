"""A loopback-TCP transport, written only to prove the transport registry: this one file
and its :func:`~rlcomm.comm.transports.registry.register` call are all it takes for the
connection (its fast path, its receiver thread, a selector) to carry messages over it.

Rank 0 listens on 127.0.0.1 and publishes its port in the rendezvous store; rank 1
connects. Every tensor (and every frame) travels as an 8-byte length and its bytes. It is
pollable (:class:`~rlcomm.comm.transports.base.PollableTransport`): ``poll`` waits on the
socket. Not for real use: it authenticates nothing, so it registers ``explicit_only``
(chosen only when named, never by ``"auto"``).
"""

from __future__ import annotations

import select
import socket
import struct
from collections.abc import Sequence

import torch
import torch.distributed as dist

from rlcomm.comm.transports import registry
from rlcomm.comm.transports.base import Transport, deadline_of, map_error, remaining
from rlcomm.errors import PeerLostError

_LEN = struct.Struct("<Q")


class TcpLoopbackTransport(Transport):
    """Two ranks of one host over one TCP connection (see the module docstring)."""

    name = "tcp_loopback"
    pollable = True

    def __init__(self, store: dist.Store, rank: int, timeout: float, peer: str):
        self._peer = peer
        deadline = deadline_of(timeout)
        if rank == 0:
            server = socket.create_server(("127.0.0.1", 0))
            store.set("tcp/port", str(server.getsockname()[1]))
            server.settimeout(timeout)
            try:
                sock, _ = server.accept()
            except OSError as exc:
                raise map_error(exc, "tcp set-up", peer, deadline) from exc
            finally:
                server.close()
        else:
            store.wait(["tcp/port"])
            sock = socket.create_connection(("127.0.0.1", int(store.get("tcp/port"))), timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # One socket object per direction: a socket's timeout is the object's own.
        self._rx, self._tx = sock, sock.dup()
        self._closed = False

    # -- sending --------------------------------------------------------------------------------

    def _send_bytes(self, parts: Sequence[memoryview | bytes], timeout: float) -> None:
        """Send ``parts``; a timeout before the first byte sent nothing, a later failure
        leaves the stream out of step (:attr:`broken`)."""
        if self._closed or self.broken:
            raise PeerLostError(f"tcp stream to {self._peer} is closed or out of step")
        deadline = deadline_of(timeout)
        sent_any = False
        try:
            for part in parts:
                view = memoryview(part).cast("B")
                while view:
                    self._tx.settimeout(remaining(deadline, 0.0001))
                    n = self._tx.send(view)
                    sent_any = True
                    view = view[n:]
        except OSError as exc:
            self.broken = sent_any or not isinstance(exc, TimeoutError)
            raise map_error(exc, "tcp send", self._peer, deadline) from exc

    def send(self, tensors: Sequence[torch.Tensor], timeout: float) -> None:
        parts: list[memoryview | bytes] = []
        for t in tensors:
            data = t.reshape(-1).view(torch.uint8).numpy()
            parts += [_LEN.pack(data.size), memoryview(data)]
        self._send_bytes(parts, timeout)

    def send_frame(self, frame: bytes, payload: Sequence[torch.Tensor], timeout: float) -> None:
        self._send_bytes([_LEN.pack(len(frame)) + frame], timeout)
        if payload:
            self.send(payload, timeout)

    # -- receiving ------------------------------------------------------------------------------

    def _read_into(self, view: memoryview, deadline: float | None, what: str) -> None:
        if self._closed:
            raise PeerLostError(f"{what} from {self._peer}: the transport is closed")
        try:
            while view:
                self._rx.settimeout(remaining(deadline, 0.0001))
                n = self._rx.recv_into(view)
                if n == 0:
                    raise PeerLostError(f"{what} from {self._peer}: the peer closed the stream")
                view = view[n:]
        except OSError as exc:
            raise map_error(exc, what, self._peer, deadline) from exc

    def _read_len(self, deadline: float | None, what: str) -> int:
        head = bytearray(_LEN.size)
        self._read_into(memoryview(head), deadline, what)
        return _LEN.unpack(head)[0]

    def recv_frame(self, timeout: float | None, rest: float | None = None) -> bytes:
        n = self._read_len(deadline_of(timeout), "tcp recv")
        frame = bytearray(n)
        self._read_into(memoryview(frame), deadline_of(timeout if rest is None else rest),
                        "tcp recv")
        return bytes(frame)

    def recv_into(self, tensors: Sequence[torch.Tensor], timeout: float | None) -> None:
        deadline = deadline_of(timeout)
        for t in tensors:
            data = t.reshape(-1).view(torch.uint8).numpy()
            n = self._read_len(deadline, "tcp recv")
            if n != data.size:
                raise PeerLostError(
                    f"tcp stream with {self._peer} is out of step: expected {data.size} "
                    f"bytes, the peer sent {n}"
                )
            self._read_into(memoryview(data), deadline, "tcp recv")

    # -- polling (PollableTransport) ------------------------------------------------------------

    def has_data(self) -> bool:
        if self._closed:
            return True
        poller = select.poll()  # data, or the end of the stream (the read then raises)
        poller.register(self._rx.fileno(), select.POLLIN)
        return bool(poller.poll(0))

    def poll(self, timeout: float | None, wake_fd: int | None = None) -> bool:
        if self._closed:
            raise PeerLostError(f"tcp recv from {self._peer}: the transport is closed")
        return self.has_data() or _TcpWaiter().wait([self], deadline_of(timeout),
                                                    [] if wake_fd is None else [wake_fd])

    def waiter(self) -> _TcpWaiter:
        return _TcpWaiter()

    def close(self) -> None:
        self._closed = True
        for sock in (self._rx, self._tx):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


class _TcpWaiter:
    """A wait on many loopback transports: one ``poll`` of their sockets."""

    def wait(
        self, transports: Sequence[TcpLoopbackTransport], deadline: float | None,
        wake_fds: Sequence[int],
    ) -> bool:
        poller = select.poll()
        for t in transports:
            poller.register(t._rx.fileno(), select.POLLIN)
        for fd in wake_fds:
            poller.register(fd, select.POLLIN)
        socks = {t._rx.fileno() for t in transports}
        while True:
            left = remaining(deadline)
            if left is not None and left <= 0:
                return False
            events = poller.poll(None if left is None else left * 1000)
            if any(fd in socks for fd, _ in events):
                return True
            if events:  # a wake-up
                return False


def _tcp(setup: registry.TransportSetup) -> TcpLoopbackTransport:
    return TcpLoopbackTransport(setup.store, setup.rank, setup.timeout, setup.peer)


SPEC = registry.register(registry.TransportSpec(
    name=TcpLoopbackTransport.name, devices=frozenset({registry.CPU}), pollable=True,
    accepts=lambda facts: facts.same_node, factory=_tcp, explicit_only=True,
))
