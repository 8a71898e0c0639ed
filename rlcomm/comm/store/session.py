"""One client connection of a store server, without its socket: the handshake and the
framing as a pure state machine (no socket, thread or clock inside; ``now`` is an
argument), driven by the server's event loop (:mod:`rlcomm.comm.store.server`).

A session starts *unproven*. The server greets it (:meth:`Session.greeting`), and the
session accepts exactly :data:`~rlcomm.comm.store.wire.PROOF` bytes from it and nothing
more: the magic, the client's nonce and its MAC over both nonces. Those bytes must all
come before the *proof deadline* (the ``store_auth_timeout`` setting, counted from the
accept). Nothing of what an unproven client sends is decoded: the proof is compared
(in constant time) with the MAC the session expects, and a wrong one ends the session.

A *proven* session reads length-prefixed frames. Each frame is one request; a frame that
has begun must arrive whole within :data:`~rlcomm.comm.store.wire.HANDSHAKE_SECONDS`,
and one that declares more than :data:`~rlcomm.comm.store.wire.MAX_FRAME` bytes ends
the session. The session serves one request at a time (``busy`` while the server works
on it or its reply is unsent), which is the clients' protocol: one request, one reply.
"""

from __future__ import annotations

import enum
import hmac

from rlcomm.comm.store.wire import (
    HANDSHAKE_SECONDS,
    LEN,
    MAGIC,
    MAX_FRAME,
    NONCE,
    PROOF,
    mac,
)

#: Most bytes a proven session reads at once (the server reads every session in turn).
READ_CHUNK = 256 << 10


class Phase(enum.Enum):
    UNPROVEN = "unproven"  # greeted; its proof has not come whole
    PROVEN = "proven"  # serves requests
    ENDED = "ended"  # to be closed


class Session:
    """One client connection's protocol state (see the module docstring).

    Args:
        secret: the job's secret.
        nonce: the server's random nonce for this connection.
        now: the time of the accept (monotonic seconds).
        auth_seconds: how long the client has to send its proof whole.
    """

    __slots__ = ("_secret", "_nonce", "_buf", "phase", "deadline", "busy", "why", "since")

    def __init__(self, secret: bytes, nonce: bytes, now: float, auth_seconds: float):
        self._secret = secret
        self._nonce = nonce
        self._buf = bytearray()
        self.phase = Phase.UNPROVEN
        #: When the bytes expected now must have come (None: nothing is expected: a
        #: proven session between requests, or one that is busy).
        self.deadline: float | None = now + auth_seconds
        self.busy = False
        #: Why the session ended (for the server's log and counters).
        self.why = ""
        self.since = now

    def __repr__(self) -> str:
        return f"Session({self.phase.value}, busy={self.busy}, buffered={len(self._buf)})"

    def greeting(self) -> bytes:
        """What the server sends first: the magic and its nonce."""
        return MAGIC + self._nonce

    def want(self) -> int:
        """How many bytes the server may read from the client now (0: none)."""
        if self.phase is Phase.UNPROVEN:
            return PROOF - len(self._buf)  # never a byte past the proof before it is checked
        if self.phase is Phase.PROVEN and len(self._buf) <= MAX_FRAME + LEN.size:
            return READ_CHUNK
        return 0

    def received(self, data: bytes, now: float) -> bytes | None:
        """Take bytes read from the client. Returns the server's proof to send when they
        completed a valid client proof; ends the session (``phase`` ENDED, ``why``) when
        they did not prove anything, or broke the framing."""
        if self.phase is Phase.ENDED:
            return None
        if not data:
            self._end("closed by the client")
            return None
        self._buf += data
        if self.phase is Phase.UNPROVEN:
            if len(self._buf) < PROOF:
                return None
            proof = bytes(self._buf)
            self._buf.clear()
            theirs = proof[len(MAGIC) : len(MAGIC) + NONCE]
            if proof[: len(MAGIC)] != MAGIC or not hmac.compare_digest(
                proof[len(MAGIC) + NONCE :], mac(self._secret, b"client", self._nonce, theirs)
            ):
                self._end("did not prove it belongs to this job")
                return None
            self.phase = Phase.PROVEN
            self.deadline = None
            return mac(self._secret, b"server", theirs, self._nonce)
        self._frame_deadline(now)
        return None

    def next_request(self, now: float) -> bytes | None:
        """The next whole request frame's payload, if the session is proven, idle and
        has one (the session is then ``busy`` until :meth:`served`). A frame over the
        size limit ends the session."""
        if self.phase is not Phase.PROVEN or self.busy or len(self._buf) < LEN.size:
            return None
        (n,) = LEN.unpack_from(self._buf)
        if n > MAX_FRAME:
            self._end(f"sent a {n}-byte frame, over the {MAX_FRAME}-byte limit")
            return None
        if len(self._buf) < LEN.size + n:
            return None
        payload = bytes(self._buf[LEN.size : LEN.size + n])
        del self._buf[: LEN.size + n]
        self.busy = True
        self.deadline = None
        return payload

    def served(self, now: float) -> None:
        """The reply to the current request has been sent whole."""
        self.busy = False
        self._frame_deadline(now)

    def expired(self, now: float) -> bool:
        """Whether the bytes the session waits for are overdue (the session then ends)."""
        if self.deadline is None or now < self.deadline or self.phase is Phase.ENDED:
            return False
        if self.phase is Phase.UNPROVEN:
            self._end("sent no proof in time")
        else:
            self._end(f"left a request frame unfinished for {HANDSHAKE_SECONDS}s")
        return True

    def end(self, why: str) -> None:
        """End the session from outside (the server dropped it)."""
        self._end(why)

    def _frame_deadline(self, now: float) -> None:
        """A proven, idle session with part of a frame buffered: it must come whole
        within :data:`HANDSHAKE_SECONDS` (from its first bytes)."""
        if self.busy or not self._buf:
            self.deadline = None
        elif self.deadline is None:
            self.deadline = now + HANDSHAKE_SECONDS

    def _end(self, why: str) -> None:
        if self.phase is not Phase.ENDED:
            self.phase = Phase.ENDED
            self.why = why
            self.deadline = None
