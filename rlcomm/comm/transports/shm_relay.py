"""Relayed segments: a process that forwards what it received passes the sender's memory
on, not a copy of it.

A channel worker receives a large item as a zero-copy view of its producer's segment and
later sends it to a consumer. Copying it into the worker's own segment for that is the
worker's main cost. A process that only forwards, and never writes to what it received,
calls :func:`enable`; from then on:

- each segment a peer passes it stays registered here with its memfd (:func:`register`)
  for as long as the connection lives;
- when one of its shared-memory writers sends a tensor that starts at the start of such
  a segment, it sends the segment instead: the memfd goes to the receiver once per
  *relay slot* (:class:`RelaySlots`, the top :data:`RELAY_SLOTS` segment states of that
  writer's ring), and each message after that is just a ``SEGMENT`` record naming the
  slot. The receiver maps it like any segment of the writer's, keeps the mapping, and
  clears the slot's state byte when it is done with the payload, as for any segment;
- the writer holds the forwarded tensor (and so the original sender's segment) until
  the receiver clears that byte; a sweep (at each relayed send, and every
  :data:`SWEEP_SECONDS` on a process-wide thread while any is held) lets it go, and the
  original sender then reuses its segment.

A relay id is the slot plus a generation above :data:`MAX_SEGMENTS`: a slot that is
given another memfd gets a new id, so a receiver never reads a record through a mapping
it replaced. Everything here stays inside the transports: a view's memory is found by
its address, as :mod:`~rlcomm.comm.transports.shm_handover` finds handed-over blocks.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import weakref
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from rlcomm.comm.transports.shm_memory import FIRST_RELAY_SLOT, MAX_SEGMENTS, RELAY_SLOTS

__all__ = ["FIRST_RELAY_SLOT", "RELAY_SLOTS", "Mapped", "RelaySlots", "enable", "find"]

#: Seconds between sweeps of held relayed tensors, while any is held.
SWEEP_SECONDS = 0.005
_MAX_GENERATION = (1 << 32) // MAX_SEGMENTS - 1

_enabled = False
_lock = threading.Lock()
#: Payloads this process relayed (sent as a peer's segment rather than copied).
relayed = 0
_keys = itertools.count(1)


class Mapped:
    """A peer's segment mapped in this process: its memfd and size, and a key that no
    other mapping ever gets."""

    __slots__ = ("fd", "size", "key", "alive", "_mapping")

    def __init__(self, fd: int, size: int, mapping: Any):
        self.fd, self.size, self.key = fd, size, next(_keys)
        self.alive = True  # until forgotten (its fd is then closed)
        # Held so that the address stays this mapping's for as long as it is registered
        # (an unmapped range could be reused by other memory, found here by mistake).
        self._mapping = mapping


_mapped: dict[int, Mapped] = {}  # by the address the mapping starts at


def enable() -> None:
    """This process forwards received payloads without writing to them: its
    shared-memory writers may relay peers' segments (see the module docstring)."""
    global _enabled
    _enabled = True


def enabled() -> bool:
    return _enabled


def active() -> bool:
    """Whether a send may find a relayable tensor at all."""
    return _enabled and bool(_mapped)


def register(base: int, fd: int, size: int, mapping: Any) -> None:
    """Keep ``fd`` (now owned here) for the peer segment ``mapping`` (an mmap) mapped at
    address ``base``; the mapping is kept alive until :func:`forget`."""
    with _lock:
        old = _mapped.pop(base, None)
        _mapped[base] = Mapped(fd, size, mapping)
        if old is not None:
            old.alive = False
            os.close(old.fd)


def forget(bases: Iterable[int]) -> None:
    """The connection of these mappings is closed: close their fds (views of them are
    then sent as copies)."""
    with _lock:
        for b in bases:
            m = _mapped.pop(b, None)
            if m is not None:
                m.alive = False
                m._mapping = None
                os.close(m.fd)


def find(t: torch.Tensor) -> Mapped | None:
    """The registered segment ``t`` covers from its start (contiguous, on the CPU)."""
    if t.device.type != "cpu":
        return None
    m = _mapped.get(t.untyped_storage().data_ptr())
    if m is None or t.data_ptr() != t.untyped_storage().data_ptr() or not t.is_contiguous():
        return None
    return m if t.numel() * t.element_size() <= m.size else None


def _dup(m: Mapped) -> int | None:
    """A new fd for ``m``'s memfd, or None once it was forgotten (its connection closed)."""
    with _lock:
        return os.dup(m.fd) if m.alive else None


class RelaySlots:
    """One writer's relay slots: which peer segment each carries, and the tensors held
    until the receiver is done with them.

    Args:
        states: the segment state bytes of the writer's ring.
        send_fd: passes ``(relay id, size, fd, deadline)`` to the receiver.
    """

    def __init__(self, states: np.ndarray, send_fd: Any):
        self._states = states
        self._send_fd = send_fd
        self._lock = threading.Lock()
        self._held: dict[int, torch.Tensor] = {}  # slot -> the relayed tensor
        self._slot_of: dict[int, int] = {}  # mapping key -> slot
        self._key_of: dict[int, int] = {}  # slot -> mapping key
        self._ids: dict[int, int] = {}  # slot -> its relay id now
        self._generation = 0

    def take(self, m: Mapped, t: torch.Tensor, deadline: float) -> int | None:
        """The relay id to write in a ``SEGMENT`` record for ``t`` (a view of ``m``),
        now marked in flight and held; None when no slot is free (send a copy)."""
        with self._lock:
            self._sweep_locked()
            slot = self._slot_of.get(m.key)
            if slot is None or slot in self._held:
                slot = self._free_slot()
                if slot is None:
                    return None
                fd = _dup(m)
                if fd is None:
                    return None
                self._generation = self._generation % _MAX_GENERATION + 1
                relay_id = self._generation * MAX_SEGMENTS + slot
                try:
                    self._send_fd(relay_id, m.size, fd, deadline)
                finally:
                    os.close(fd)
                old = self._key_of.pop(slot, None)
                if old is not None:
                    self._slot_of.pop(old, None)
                self._ids[slot], self._slot_of[m.key], self._key_of[slot] = relay_id, slot, m.key
            self._held[slot] = t
            self._states[slot] = 1
            relay_id = self._ids[slot]
            global relayed
            relayed += 1
        _sweeper.watch(self)
        return relay_id

    def _free_slot(self) -> int | None:
        """A slot holding nothing: one never used first, else one whose mapping goes."""
        spare = None
        for slot in range(FIRST_RELAY_SLOT, MAX_SEGMENTS):
            if slot in self._held:
                continue
            if slot not in self._key_of:
                return slot
            spare = slot if spare is None else spare
        return spare

    def _sweep_locked(self) -> None:
        states = self._states
        for slot in [s for s in self._held if states[s] == 0]:
            del self._held[slot]

    def sweep(self) -> bool:
        """Let go of the tensors the receiver is done with; whether any is still held."""
        with self._lock:
            self._sweep_locked()
            return bool(self._held)


class _Sweeper:
    """One thread per process that sweeps writers holding relayed tensors, so that the
    original senders get their segments back even when no relayed send comes."""

    def __init__(self) -> None:
        self._slots: weakref.WeakSet[RelaySlots] = weakref.WeakSet()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, slots: RelaySlots) -> None:
        if slots not in self._slots:
            with self._lock:
                self._slots.add(slots)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, daemon=True,
                                                    name="rlcomm-shm-relay-sweep")
                    self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                slots = list(self._slots)
            held = False
            for s in slots:
                held |= s.sweep()
            if held:
                self._wake.set()
                time.sleep(SWEEP_SECONDS)


_sweeper = _Sweeper()
