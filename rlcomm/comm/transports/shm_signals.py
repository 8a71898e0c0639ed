"""The signalling beside the shared memory: two ``AF_UNIX`` ``SOCK_SEQPACKET`` sockets.

Per connection, ``out`` carries this side's wake-up tokens and new segment fds to the
peer (and the peer's ring-space tokens back); ``inn`` the same the other way. They are
bound to an abstract name (nothing in the file system) that rank 0 publishes in the
rendezvous store, and each ring's memfd is passed over them once (SCM_RIGHTS). A closed
socket is how a peer's death is seen. Both ends check the other's credentials as the
kernel reports them (``SO_PEERCRED``): this user, and the peer's expected process.
"""

from __future__ import annotations

import datetime
import errno
import logging
import os
import select
import socket
import struct
import threading
import time
import uuid

import torch.distributed as dist

from rlcomm.errors import (
    AuthenticationError,
    CommTimeoutError,
    PeerLostError,
    ProtocolMismatchError,
)

logger = logging.getLogger(__name__)
_CRED = struct.Struct("3i")  # pid, uid, gid

_TOKEN = b"t"
_PEEK = int(socket.MSG_PEEK | socket.MSG_DONTWAIT)  # an int: IntFlag arithmetic is slow
_FD_BYTES = 4  # a C int
_FD_SPACE = socket.CMSG_SPACE(_FD_BYTES)  # room for one file descriptor per message
_SEGMENT = struct.Struct("<IQ")  # segment id, size: the data of an fd message after b"f"
_HANDED = struct.Struct("<QQ")  # offset, bytes: the data of an fd message after b"h"
#: The segment id :meth:`SignalSockets.read` reports for a handed-over block
#: (:mod:`~rlcomm.comm.transports.shm_handover`); its "size" is then ``(offset, nbytes)``.
HANDED = -1


def seqpacket() -> socket.socket:
    return socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def credentials_ok(sock: socket.socket, peer_pid: int | None) -> bool:
    """Whether the process at the other end of ``sock`` runs as this user and, when
    ``peer_pid`` is given, is that process."""
    pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return uid == os.getuid() and (peer_pid is None or pid == peer_pid)


def connect_published(
    store: dist.Store, key: str, prefix: str, deadline: float, peer: str,
    peer_pid: int | None, what: str,
) -> tuple[socket.socket, str]:
    """Connect to the abstract socket the peer named under ``key`` of ``store`` (a name
    that starts with ``prefix``), and check that the process at the other end is this
    user's ``peer_pid``. Returns the socket and the name.

    Raises:
        AuthenticationError: the name is not one of ours, or the socket is another
            process's.
        OSError, RuntimeError: the peer did not name it, or refused, by ``deadline``.
    """
    store.wait([key], datetime.timedelta(seconds=max(0.01, deadline - time.monotonic())))
    name = store.get(key).decode()
    if not name.startswith(prefix):
        raise AuthenticationError(f"{what} set-up with {peer}: unexpected socket name {name!r}")
    sock = seqpacket()
    sock.settimeout(max(0.01, deadline - time.monotonic()))
    sock.connect(name)
    if not credentials_ok(sock, peer_pid):
        sock.close()
        raise AuthenticationError(f"{what} set-up with {peer}: the socket belongs to another process")
    return sock, name


def _fds_of(ancillary: list) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % _FD_BYTES
            fds.extend(struct.unpack(f"{usable // _FD_BYTES}i", data[:usable]))
    return fds


class SignalSockets:
    """The two sockets of one shared-memory connection (see the module docstring).

    Args:
        out: to the peer (tokens after data, segment fds).
        inn: from the peer.
        peer: how error messages name the other end.
    """

    def __init__(self, out: socket.socket, inn: socket.socket, peer: str):
        self.out, self.inn, self._peer = out, inn, peer
        for sock in (out, inn):
            sock.settimeout(None)
        self._pollers: dict[tuple[int, int | None], select.poll] = {}
        self._quiet = select.poll()  # peer_gone's first look: nothing came in at all
        self._quiet.register(inn.fileno(), select.POLLIN)
        self._quiet_lock = threading.Lock()  # one poll() at a time on a poll object

    # -- set-up -----------------------------------------------------------------------------

    @classmethod
    def rendezvous(
        cls, store: dist.Store, rank: int, out_fd: int, deadline: float, peer: str,
        peer_pid: int | None = None,
    ) -> tuple[SignalSockets, int]:
        """Connect the pair (rank 0 listens) and swap ring memfds: ``out_fd`` goes to the
        peer; returns the sockets and the peer's ring fd (the caller closes it).
        Connections from any process but ``peer_pid`` of this user are refused."""
        try:
            if rank == 0:
                return cls._listen(store, out_fd, deadline, peer, peer_pid)
            return cls._connect(store, out_fd, deadline, peer, peer_pid)
        except (TimeoutError, OSError, RuntimeError) as exc:
            raise CommTimeoutError(f"shm rendezvous with {peer} failed: {exc}") from exc

    @classmethod
    def _listen(
        cls, store: dist.Store, out_fd: int, deadline: float, peer: str, peer_pid: int | None
    ):
        server = seqpacket()
        name = f"\0rlcomm-shm-{uuid.uuid4().hex}"
        server.bind(name)
        server.listen(2)
        store.set("shm/addr", name.encode())
        socks: dict[bytes, socket.socket] = {}
        in_fd = -1
        try:
            while len(socks) < 2:
                server.settimeout(max(0.01, deadline - time.monotonic()))
                conn, _ = server.accept()
                if not credentials_ok(conn, peer_pid):
                    logger.warning("shm set-up for %s: a connection from another process "
                                   "was refused", peer)
                    conn.close()
                    continue
                conn.settimeout(max(0.01, deadline - time.monotonic()))
                role, fds, _, _ = socket.recv_fds(conn, 16, 1)
                if role not in (b"peer->me", b"me->peer") or role in socks:
                    for fd in fds:
                        os.close(fd)
                    conn.close()
                    raise AuthenticationError(f"shm set-up with {peer}: unexpected role {role!r}")
                socks[role] = conn
                if role == b"peer->me":  # carries the peer's ring fd
                    in_fd = fds[0]
            socket.send_fds(socks[b"me->peer"], [b"ring"], [out_fd])
        finally:
            server.close()
        return cls(socks[b"me->peer"], socks[b"peer->me"], peer), in_fd

    @classmethod
    def _connect(
        cls, store: dist.Store, out_fd: int, deadline: float, peer: str, peer_pid: int | None
    ):
        # Roles are named from the listener's side.
        mine_out, name = connect_published(store, "shm/addr", "\0rlcomm-shm-", deadline,
                                           peer, peer_pid, "shm")
        socket.send_fds(mine_out, [b"peer->me"], [out_fd])
        mine_in = seqpacket()
        mine_in.settimeout(max(0.01, deadline - time.monotonic()))
        mine_in.connect(name)
        mine_in.sendall(b"me->peer")
        _, fds, _, _ = socket.recv_fds(mine_in, 16, 1)
        return cls(mine_out, mine_in, peer), fds[0]

    # -- use ---------------------------------------------------------------------------------

    def lost(self, what: str) -> PeerLostError:
        return PeerLostError(f"{what} with {self._peer} failed: the peer process is gone")

    def peer_gone(self) -> bool:
        """Whether the peer closed its end (it ended), seen without waiting or reading:
        a poll that returns at once, and a non-blocking peek when something came in
        (several times cheaper than the peek alone, which raises when nothing did)."""
        if self._quiet_lock.acquire(blocking=False):
            try:
                quiet = not self._quiet.poll(0)
            finally:
                self._quiet_lock.release()
            if quiet:
                return False
        try:
            return not self.inn.recv(1, _PEEK)
        except BlockingIOError:
            return False
        except OSError as exc:
            return exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR)

    def notify(self, sock: socket.socket) -> None:
        """Send a token on ``sock`` (dropped when the peer has plenty unread already)."""
        try:
            sock.send(_TOKEN, socket.MSG_DONTWAIT)
        except BlockingIOError:
            pass
        except OSError as exc:
            raise self.lost("shm notify") from exc

    def send_fd(self, seg_id: int, size: int, fd: int, deadline: float) -> None:
        """Pass a new segment's memfd to the peer."""
        self._send_with_fd(b"f" + _SEGMENT.pack(seg_id, size), fd, deadline)

    def send_handed(self, fd: int, offset: int, nbytes: int, deadline: float) -> None:
        """Pass a handed-over block's memfd, and the range of it that is sent, to the peer."""
        self._send_with_fd(b"h" + _HANDED.pack(offset, nbytes), fd, deadline)

    def _send_with_fd(self, data: bytes, fd: int, deadline: float) -> None:
        try:
            self.out.settimeout(max(0.01, deadline - time.monotonic()))
            socket.send_fds(self.out, [data], [fd])
        except TimeoutError as exc:
            raise CommTimeoutError(f"shm send to {self._peer} timed out") from exc
        except OSError as exc:
            raise self.lost("shm send") from exc
        finally:
            self.out.settimeout(None)

    def poller(self, sock: socket.socket, wake_fd: int | None = None) -> select.poll:
        """A cached poll object on ``sock`` (and ``wake_fd``)."""
        key = (sock.fileno(), wake_fd)
        poller = self._pollers.get(key)
        if poller is None:
            poller = select.poll()  # not select.select: Ray processes have fds past 1024
            for fd in key:
                if fd is not None:
                    poller.register(fd, select.POLLIN)
            self._pollers[key] = poller
        return poller

    def read(
        self, sock: socket.socket, block: bool, deadline: float | None, what: str
    ) -> tuple[bool, tuple[int, int | tuple[int, int], int] | None]:
        """Read one message (a token, a segment fd or a handed-over fd) from ``sock``.

        Returns:
            Whether a message was there, and ``(segment id, size, fd)`` when it was a
            new segment, ``(HANDED, (offset, nbytes), fd)`` for a handed-over block (the
            caller maps and closes the fd).
        """
        if block:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise CommTimeoutError(f"{what} with {self._peer} timed out")
            if not self.poller(sock).poll(None if remaining is None else remaining * 1000):
                raise CommTimeoutError(f"{what} with {self._peer} timed out")
        try:
            data, ancillary, _, _ = sock.recvmsg(64, _FD_SPACE, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False, None
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                return False, None
            raise self.lost(what) from exc
        if not data:
            raise self.lost(what)
        fds = _fds_of(ancillary) if ancillary else None
        if not fds:
            return True, None
        for extra in fds[1:]:
            os.close(extra)
        try:
            if data[:1] == b"h":
                return True, (HANDED, _HANDED.unpack(data[1 : 1 + _HANDED.size]), fds[0])
            seg_id, size = _SEGMENT.unpack(data[1 : 1 + _SEGMENT.size])
        except struct.error as exc:
            os.close(fds[0])
            raise ProtocolMismatchError(
                f"{what} with {self._peer}: a malformed fd message; the connection is closed"
            ) from exc
        return True, (seg_id, size, fds[0])

    def close(self) -> None:
        for sock in (self.out, self.inn):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
