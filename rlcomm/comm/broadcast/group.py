"""Broadcast groups: one per distinct ordered set of participating workers.

A broadcast from member ``src`` splits its members in two, alike on every member:

- *local* receivers, on the source's node (where shared memory works): the source
  encodes the object once, copies its tensors once into a pooled shared-memory slot and
  hands the slot to each of them (:mod:`~rlcomm.comm.transports.shm_fanout`); each maps
  it copy-on-write and decodes zero-copy views. The slot goes back to the source's pool
  when every local receiver has freed its views. CUDA tensors are planned by GPU
  (:mod:`~rlcomm.comm.broadcast.device`): a receiver that sees the source's GPU copies
  them straight from the source's memory on the device, one copy, never through host
  memory; the others get them through a slot.
- *remote* receivers, on other nodes: one of them per node is that node's *relay* (the
  first member there, in member order). The source and the relays form a Gloo process
  group, made on first use, which carries each broadcast's frame (and its *route*). A
  CPU payload of at least ``RLCOMM_BCAST_CHAIN_MIN_BYTES`` then goes along the *chain*
  of the source and the relays (:mod:`~rlcomm.comm.broadcast.chain`): each relay
  forwards each record of ``RLCOMM_BCAST_CHUNK_BYTES`` as soon as it holds it, so each
  node's link carries the payload once and the last node has it about one transfer plus
  one record time per node after the start. A smaller payload goes by Gloo's own
  broadcast in that group, and a CUDA payload by NCCL's. Each relay then hands the
  payload to its node-mates as the source does to its own (a shared-memory fan-out, one
  copy). So a broadcast to ``n`` nodes of ``k`` members each costs one local copy per
  node, whatever ``k``, and (along the chain) about one network transfer, whatever ``n``.

A CPU payload larger than a quarter of the shared-memory pool (or than a local
receiver's limit, or, to other nodes, than one bucket, or any the caller asks to)
*streams* in buckets (:mod:`~rlcomm.comm.buckets`): to the local receivers, an opening
they each answer, then the buckets through two reused slots
(:mod:`~rlcomm.comm.broadcast.stream`); to other nodes, once the relays said what their
nodes take and the routes are agreed (:mod:`~rlcomm.comm.broadcast.routes`), one run of
each route's chain per bucket, carrying only what its nodes take, each relay handing
each bucket on to its node-mates as it arrives. Each receiver takes what it asked for
(:class:`~rlcomm.comm.taking.Taking`: ``into=``, new tensors, an iterator, shards).

Broadcasts on one group run one at a time, in call order (one thread for async calls),
so every member sees the same sequence. Each source numbers its messages, so a receiver
that timed out on a broadcast skips that message when it arrives late. Along a chain,
a member that fails makes every member after it raise naming it (a relay passes the
failure on to its node-mates with a note on the fan-out), and every member before it
learns it too (see :mod:`~rlcomm.comm.broadcast.chain`).
"""

from __future__ import annotations

import concurrent.futures
import datetime
import os
import struct
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from rlcomm.comm import codec, framing
from rlcomm.comm.broadcast.chain import (
    LOST,
    REASONS,
    REFUSED,
    TIMEOUT,
    ChainListener,
    ChainOutcome,
    ChainRun,
    group_key,
    plan_records,
    record_size,
)
from rlcomm.comm.broadcast.device import SETUP, DeviceFanout
from rlcomm.comm.broadcast.gloo import GlooBroadcast
from rlcomm.comm.broadcast.routes import (
    Need,
    Route,
    from_verdict,
    need_of,
    pack_need,
    pack_report,
    report_bytes,
    routes,
    union,
    unpack_report,
    verdict_body,
)
from rlcomm.comm.broadcast.stream import (
    OVER_LIMIT,
    STREAM_NOTE,
    LocalStream,
    parse_note,
    reason_of,
    verdict_of,
)
from rlcomm.comm.buckets import (
    ALIGN,
    Bucket,
    Shards,
    header_bucket,
    plan,
    stream_bucket,
)
from rlcomm.comm.connection.incoming import Payload, classify
from rlcomm.comm.identity.address import WorkerAddress, normalize_rank
from rlcomm.comm.options import max_message_bytes
from rlcomm.comm.store.client import sub_store
from rlcomm.comm.taking import Taking
from rlcomm.comm.transports import pool, registry
from rlcomm.comm.transports.shm_fanout import OVER_LIMIT as LIMIT_VERDICT
from rlcomm.comm.transports.shm_fanout import TAKES, FanoutSource
from rlcomm.comm.transports.shm_fanout_sink import FanoutSink
from rlcomm.comm.transports.shm_memory import POOL_BYTES, check_memory
from rlcomm.errors import (
    CapacityError,
    CodecError,
    CommError,
    CommTimeoutError,
    OptionsMismatchError,
    PeerLostError,
    ProtocolMismatchError,
)
from rlcomm.settings import get_settings

GroupsSpec = Sequence[tuple[str, Any]]

#: What the frame a source sends over the group's Gloo broadcast begins with: how the
#: payload follows (:data:`GLOO` or :data:`CHAIN`), the broadcast's random id and the
#: chain's record size.
ROUTE = struct.Struct("<BQI")
#: ``NOTED``: nothing follows; the source could not send the payload and the rest of
#: the frame says why (a relay tells its node-mates, and raises).
GLOO, CHAIN, NOTED = 0, 1, 2
#: Record sizes a receiver accepts from a source.
MIN_CHUNK, MAX_CHUNK = 1 << 12, 1 << 30
#: The opening of the offer part of a note on the fan-out that tells a relay's node-mates
#: that the chain failed before their relay (a :data:`NOTE` follows: member, reason).
ABORT_NOTE = b"\x00rlcomm-chain-abort:"
NOTE = struct.Struct("<IB")


_reason = reason_of


def _bucket_run(run_id: int, bucket: int, route: int, routes: int) -> int:
    """The id of the run that carries ``bucket`` along ``route`` (of ``routes``): past
    the two runs of the agreement."""
    return (run_id + 3 + bucket * routes + route) % (1 << 64)


class _NothingSent(Exception):
    """A member of the chain failed before the first bucket: ``error`` is what this
    member raises (``None``: its own refusal), naming ``culprit``."""

    def __init__(self, error: Exception | None, culprit: int | None = None):
        super().__init__(str(error))
        self.error, self.culprit = error, culprit


def expand_groups(groups: GroupsSpec) -> list[WorkerAddress]:
    """The ordered, duplicate-free member list of a ``groups`` argument.

    Each entry is ``(group_name, ranks)`` where ranks is an int, a list of ints, a tuple
    (one rank path) or a list of tuples (several rank paths).

    Raises:
        ValueError: on an empty spec, a malformed entry, or a worker listed twice.
    """
    if not groups:
        raise ValueError("broadcast: groups must list at least one (group_name, ranks) entry")
    members: list[WorkerAddress] = []
    for entry in groups:
        if not isinstance(entry, (tuple, list)) or len(entry) != 2:
            raise ValueError(f"broadcast: each groups entry is (group_name, ranks), got {entry!r}")
        name, ranks = entry
        if isinstance(ranks, int) or isinstance(ranks, tuple):
            items = [ranks]
        elif isinstance(ranks, list):
            items = ranks
        else:
            raise ValueError(f"broadcast: bad ranks {ranks!r} for group {name!r}")
        members.extend(WorkerAddress(name, normalize_rank(r)) for r in items)
    if len(set(members)) != len(members):
        raise ValueError(f"broadcast: a worker is listed twice in {[str(m) for m in members]}")
    return members


class BroadcastGroup:
    """The broadcasts among ``members``; this process is ``members[index]``.

    Args:
        connect_store: ``connect_store(indices)`` makes an authenticated store shared by
            the members at those indices (the same one on each of them).
        members: the ordered member list.
        index: this process's place in it.
        nodes: each member's node (members with equal entries share memory).
        pids: each member's process id (checked on the shared-memory sockets).
        host: this node's IP, for Gloo sockets and the chain's listener.
        secret: the job's secret, from which the chain's links prove themselves
            (``None``: a random one, for groups of one process's tests).
    """

    def __init__(
        self, connect_store: Callable[[tuple[int, ...]], dist.Store],
        members: list[WorkerAddress], index: int, nodes: Sequence[Any], pids: Sequence[int],
        host: str | None = None, secret: bytes | None = None,
    ):
        self.members = members
        self.index = index
        self._nodes = list(nodes)
        self._pids = list(pids)
        self._host = host
        self._connect_store = connect_store
        self._label = f"broadcast group {[str(m) for m in members]}"
        self._lock = threading.Lock()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "rlcomm-bcast")
        self._store: dist.Store | None = None  # of all members: the fan-out sockets' names
        self._gloo: dict[tuple[int, ...], GlooBroadcast] = {}
        self._source: FanoutSource | None = None  # this member's, as a source
        self._source_waited = False  # its first broadcast waited for every receiver
        self._seq_out = 0
        self._sinks: dict[int, FanoutSink] = {}  # by source index
        self._seq_in: dict[int, int] = {}
        self._device = DeviceFanout(self._group_store, index, self._pids,
                                    [str(m) for m in members])
        self._key = group_key(secret or os.urandom(32), "|".join(str(m) for m in members))
        self._listener: ChainListener | None = None
        self._helper_pool: concurrent.futures.ThreadPoolExecutor | None = None
        #: What this member is doing (``idle``, ``frame``, ``chain``, ``local``) and the
        #: chain run of its latest broadcast along a chain: for :meth:`progress`.
        self.phase = "idle"
        self._run: ChainRun | None = None
        #: Buckets of streamed broadcasts this member handed on (to its node-mates) and
        #: took in, and the bytes it took in of broadcasts (what the transports moved to
        #: it: of a sharded tensor, its slice): for :meth:`stats`.
        self.buckets_out = 0
        self.buckets_in = 0
        self.bytes_in = 0

    @staticmethod
    def _shared_copy() -> bool:
        """Whether members on one node share one copy: the registry's transport for a
        same-node pair is shared memory (what the fan-out needs)."""
        try:
            return registry.select(registry.PairFacts(same_node=True)).memory_only
        except OptionsMismatchError:
            return False

    def plan(self, src: int) -> tuple[list[int], list[int]]:
        """The local and remote receivers of a broadcast from ``src``."""
        others = [i for i in range(len(self.members)) if i != src]
        if not self._shared_copy():
            return [], others
        local = [i for i in others if self._nodes[i] == self._nodes[src]]
        return local, [i for i in others if i not in local]

    def relays(self, src: int) -> dict[int, list[int]]:
        """The relay of each other node of a broadcast from ``src``, and the members it
        hands the payload to (every member is its own relay without shared memory)."""
        _, remote = self.plan(src)
        if not self._shared_copy():
            return {i: [] for i in remote}
        by_node: dict[Any, list[int]] = {}
        for i in remote:
            by_node.setdefault(self._nodes[i], []).append(i)
        return {ids[0]: ids[1:] for ids in by_node.values()}

    def progress(self) -> dict[str, Any]:
        """Where this member's current (or latest) broadcast is: its ``phase`` and, for
        one along a chain, the records ``received`` and ``forwarded`` of ``total``
        (any thread may ask, while a broadcast runs)."""
        run = self._run
        out: dict[str, Any] = {"phase": self.phase}
        if run is not None:
            out.update(received=run.received, forwarded=run.forwarded, total=run.total)
        return out

    def progress_mark(self) -> tuple[int, ...]:
        """A value that changes whenever this member's broadcasts move on (a bucket in or
        out, a record along the chain): a wait for a streamed broadcast times out only
        when it has not changed for the timeout."""
        run = self._run
        along = (run.received, run.forwarded) if run is not None else (0, 0)
        return (self.buckets_in, self.buckets_out, *along)

    def stats(self) -> dict[str, Any]:
        """This member's counters (any thread may ask): its members, phase, buckets out
        and in, bytes in, and the shared memory it holds as a source."""
        return {"members": [str(m) for m in self.members], "phase": self.phase,
                "buckets_out": self.buckets_out, "buckets_in": self.buckets_in,
                "bytes_in": self.bytes_in, "pool_bytes": self.pool_bytes}

    @property
    def pool_bytes(self) -> int:
        """Shared memory this member holds as a broadcast source."""
        return 0 if self._source is None else self._source.pool_bytes

    def submit(
        self, obj: Any, src: int, timeout: float, into: Any = None,
        cuda: tuple[torch.device, Any] | None = None, host_wait: bool = False,
        shards: Shards | None = None, bucket: int | None = None,
    ) -> concurrent.futures.Future:
        """Run :meth:`broadcast` on the group's thread (in call order). ``cuda``: the
        caller's CUDA device and stream, which the broadcast's CUDA work is ordered on.

        A receiver taking the message as an iterator (``into=Buckets()``) gets the
        iterator as soon as the message opened; the group's thread goes on reading its
        buckets (later broadcasts on the group wait for that)."""
        user: concurrent.futures.Future = concurrent.futures.Future()

        def opened(result: Any) -> None:
            if not user.done():
                user.set_result(result)

        def run() -> None:
            try:
                if cuda is None:
                    result = self.broadcast(obj, src, timeout, into, host_wait, shards, bucket,
                                            opened)
                else:
                    with torch.cuda.device(cuda[0]), torch.cuda.stream(cuda[1]):
                        result = self.broadcast(obj, src, timeout, into, host_wait, shards,
                                                bucket, opened)
            except BaseException as exc:
                if not user.done():
                    user.set_exception(exc)
                return
            opened(result)

        def cancelled(task: concurrent.futures.Future) -> None:
            if task.cancelled() and not user.done():
                user.set_exception(CommError(f"{self._label}: closed before the broadcast ran",
                                             op="broadcast"))

        self._executor.submit(run).add_done_callback(cancelled)
        return user

    def broadcast(
        self, obj: Any, src: int, timeout: float, into: Any = None, host_wait: bool = False,
        shards: Shards | None = None, bucket: int | None = None,
        opened: Callable[[Any], None] | None = None,
    ) -> Any:
        """Send ``obj`` from member ``src`` to all; every member returns the object (a
        receiver given ``into`` gets the tensors copied into it, and returns it; given
        ``into=Buckets()``, an iterator, passed to ``opened`` as soon as it exists).
        ``host_wait``: a source of CUDA tensors returns once every receiver's copy of them
        is done, not only ordered on its current stream. ``shards``: what a receiver takes
        of each tensor. ``bucket``: the source streams the payload in buckets of that
        many bytes."""
        deadline = time.monotonic() + timeout
        local, _ = self.plan(src)
        relays = self.relays(src)
        with self._lock:
            try:
                if self.index == src:
                    self._send(obj, local, list(relays), deadline, timeout, host_wait, bucket)
                    return obj
                taking = Taking(into, shards,
                                f"broadcast at {self.members[self.index]} from {self.members[src]}",
                                self.members[src], timeout, "broadcast")
                if self.index in local:
                    return self._recv_local(src, deadline, taking, opened=opened)
                if self.index in relays:
                    return self._recv_remote(src, relays, deadline, timeout, taking, opened)
                relay = next(r for r, mates in relays.items() if self.index in mates)
                return self._recv_local(relay, deadline, taking, origin=src, opened=opened)
            finally:
                self.phase = "idle"

    def _targets(self, header: Any, into: Any, src: int) -> list[torch.Tensor]:
        try:
            return codec.destinations(header, into)
        except CodecError as exc:
            raise ProtocolMismatchError(
                f"broadcast at {self.members[self.index]} from {self.members[src]} into the "
                f"given tensors: {exc}", peer=self.members[src], op="broadcast",
            ) from exc

    def _next_seq(self) -> int:
        seq = self._seq_out
        self._seq_out += 1
        return seq

    # -- the source ------------------------------------------------------------------------

    def _send(
        self, obj: Any, local: list[int], relays: list[int], deadline: float, timeout: float,
        host_wait: bool = False, bucket: int | None = None,
    ) -> None:
        """Hand ``obj`` to this node's ``local`` members (shared memory, or the device for
        CUDA tensors) and to the ``relays`` of other nodes: along the chain, or by Gloo's
        (NCCL's) broadcast; see the module docstring. A large CPU payload streams in
        buckets (:func:`stream_bucket`)."""
        header, tensors = codec.encode(obj)
        on_cuda = bool(tensors) and tensors[0].is_cuda
        total = sum(m.nbytes for m in header.tensors)
        if not on_cuda and total:
            limits = self._fanout_source(local, deadline).limits() if local else {}
            settings = get_settings()
            if (relays and bucket is None and total > settings.bucket_bytes
                    and total >= settings.bcast_chain_min_bytes):
                # Across nodes it streams, so that each node's link carries what it takes;
                # in one bucket where a quarter of the pool holds it (one run of the
                # chain, pipelined end to end: the chain drains between buckets).
                whole = total + ALIGN * len(header.tensors)
                bucket = whole if whole <= POOL_BYTES // 4 else settings.bucket_bytes
            try:
                header.stream = stream_bucket(total, bucket, list(limits.values()))
            except CapacityError as exc:
                self._fail_everyone(local, relays, exc, timeout)
                raise type(exc)(f"broadcast from {self.members[self.index]}: {exc}",
                                op="broadcast") from exc
        frame, payload = framing.pack(header, tensors)
        settings = get_settings()
        if header.stream:
            views = [codec.as_bytes(t) for t in tensors]
            if relays:
                failures, routes = self._send_chain_stream(frame, header, views, local, relays,
                                                           timeout)
                if failures:
                    self._raise_failures(failures, [self.index, *relays], routes)
            else:
                failures = self._stream_local(frame, header, views, local, timeout)
        elif relays and not on_cuda and sum(t.numel() for t in payload) >= max(
            1, settings.bcast_chain_min_bytes
        ):
            failures = self._send_chain(frame, payload, local, relays, deadline, timeout)
        else:
            failures = self._hand_local(frame, payload, tensors, local, deadline, timeout,
                                        host_wait) if local else {}
            if relays:
                gloo = self._gloo_group((self.index, *relays))
                self.phase = "frame"
                gloo.send_frame(ROUTE.pack(GLOO, 0, 0) + frame, 0, timeout)
                gloo.send_payload(payload, 0, timeout)
        if failures:
            self._raise_failures(failures, [self.index, *relays])

    def _hand_local(
        self, frame: bytes, payload: list[torch.Tensor], tensors: list[torch.Tensor],
        local: list[int], deadline: float, timeout: float, host_wait: bool = False,
    ) -> dict[int, Exception]:
        """Hand a message to this node's ``local`` members; returns the failures."""
        failures: dict[int, Exception] = {}
        self.phase = "local"
        on_cuda = bool(payload) and payload[0].is_cuda
        source = self._fanout_source(local, deadline)
        if on_cuda:
            order = torch.cuda.current_stream(payload[0].device)
            failures.update(self._device.send(
                frame, [t for t in tensors if t.numel()], local, source, self._next_seq,
                order, deadline, host_wait,
            ))
        else:
            failures.update(source.publish(self._next_seq(), frame, payload, deadline))
        for member in source.missing():
            failures.setdefault(member, CommTimeoutError(
                f"{self._label}: {self.members[member]} did not join within {timeout}s",
                peer=self.members[member], op="broadcast",
            ))
        return failures

    def _raise_failures(self, failures: dict[int, Exception], chain: list[int],
                        routes: Sequence[list[int]] = ()) -> None:
        """Raise for the members that did not get a broadcast from this member (which
        hands it on along ``chain``, or, streamed, along each of ``routes``: chains from
        the same source): ``PeerLostError`` if one is gone, else ``CommTimeoutError``
        (``ProtocolMismatchError`` when all refused it)."""
        names = ", ".join(f"{self.members[m]} ({exc})" for m, exc in sorted(failures.items()))
        relays = self.relays(chain[0])
        broken = []
        for route in routes or [chain]:
            cut = next((r for r in route if r in failures), None)
            if cut is None:
                continue
            broken.append(cut)
            after = [m for relay in route[route.index(cut) + 1 :]
                     for m in (relay, *relays.get(relay, []))]
            if after:
                names += (f"; nor did the members after {self.members[cut]} along the "
                          f"chain ({', '.join(str(self.members[m]) for m in after)})")
        errors = list(failures.values())
        if any(isinstance(e, PeerLostError) for e in errors):
            kind: type[CommError] = PeerLostError
        elif all(isinstance(e, ProtocolMismatchError) for e in errors):
            kind = ProtocolMismatchError
        else:
            kind = CommTimeoutError
        first = min(broken, key=chain.index) if broken else min(failures)
        where = f"broadcast from {self.members[chain[0]]}"
        if chain[0] != self.index:
            where += f", passed on by {self.members[self.index]}"
        raise kind(
            f"{where}: the other members got it, but not {names}",
            peer=self.members[first] if len(failures) == 1 or broken else None,
            op="broadcast",
        )

    def _chain_failure(self, member: int, reason: int, what: str, upstream: bool) -> Exception:
        """The error of a chain failure at ``member`` (``upstream``: one before this member,
        which got nothing more; else one after it, which did not take the payload)."""
        kind = {LOST: PeerLostError, TIMEOUT: CommTimeoutError}.get(reason, ProtocolMismatchError)
        if reason == TIMEOUT:
            why = ("passed nothing more on within the timeout (a stopped, or overloaded, "
                   "process)" if upstream else "did not take it within the timeout")
        else:
            why = REASONS[reason]
        return kind(f"{what} {why}", peer=self.members[member], op="broadcast")

    # -- along the chain (a CPU payload to other nodes) ---------------------------------------

    def _send_chain(
        self, frame: bytes, payload: list[torch.Tensor], local: list[int], relays: list[int],
        deadline: float, timeout: float,
    ) -> dict[int, Exception]:
        """As the source: the frame over Gloo, the payload along the chain, and to this
        node's members meanwhile (on the helper thread). Returns the failures."""
        chain = [self.index, *relays]
        sizes = [t.numel() for t in payload]
        chunk = record_size(sum(sizes), len(relays), get_settings().bcast_chunk_bytes)
        run_id = int.from_bytes(os.urandom(8), "little")
        self.phase = "frame"
        self._gloo_group(tuple(chain)).send_frame(ROUTE.pack(CHAIN, run_id, chunk) + frame, 0, timeout)
        local_errors: dict[int, Exception] = {}

        def hand_local() -> concurrent.futures.Future | None:
            if not local:
                return None
            return self._helper().submit(
                self._hand_cpu, frame, payload, local, deadline, timeout, local_errors
            )

        outcome = self._run_chain(
            chain, run_id, sizes, [memoryview(t.numpy()) for t in payload], deadline, timeout,
            hand_local, chunk=chunk,
        )
        failures: dict[int, Exception] = dict(local_errors)
        for member, reason in outcome.failures.items():
            failures.setdefault(member, self._chain_failure(member, reason, "it", False))
        return failures

    def _run_chain(
        self, chain: list[int], run_id: int, sizes: list[int], views: list[memoryview],
        deadline: float, timeout: float,
        on_received: Callable[[], concurrent.futures.Future | None], refuse: bool = False,
        chunk: int | None = None, report_bytes: int = 0, report: bytes | None = None,
    ) -> Any:
        """Run this member's part of a broadcast along ``chain``; returns its outcome,
        once the hand-off to this member's node-mates (if it began) ended too."""
        place = chain.index(self.index)
        downstream = chain[place + 1] if place + 1 < len(chain) else None
        upstream = chain[place - 1] if place else None
        run = ChainRun(
            index=self.index, src=chain[0], upstream=upstream,
            downstream=downstream, members=len(self.members), run_id=run_id, key=self._key,
            records=plan_records(sizes, chunk or get_settings().bcast_chunk_bytes),
            views=views, listener=self._listener if place else None,
            downstream_address=(
                None if downstream is None
                else lambda: self._chain_address(downstream, deadline)  # type: ignore[arg-type]
            ),
            host=self._host, deadline=deadline, slack=min(1.0, 0.1 * timeout),
            heartbeat=min(1.0, max(0.05, timeout / 20)), on_received=on_received,
            refuse=refuse, report_bytes=report_bytes, report=report,
            upstream_address=(  # the source has no listener
                None if upstream is None or upstream == chain[0]
                else lambda: self._chain_address(upstream, deadline)  # type: ignore[arg-type]
            ),
        )
        self._run, self.phase = run, "chain"
        outcome = run.run()
        if outcome.local is not None:  # it keeps its own deadline: this wait is short
            try:
                outcome.local.result(timeout=max(0.0, deadline - time.monotonic()) + 5)
            except Exception:  # noqa: BLE001 - its failures are its members'; raised below
                pass
            run._merge_local()
        return outcome

    def _hand_cpu(
        self, frame: bytes, payload: list[torch.Tensor], local: list[int], deadline: float,
        timeout: float, errors: dict[int, Exception],
    ) -> dict[int, int]:
        """On the helper thread: hand a CPU message to ``local`` members; their failures
        go into ``errors``, and by reason into the result."""
        try:
            failures = self._hand_local(frame, payload, [], local, deadline, timeout)
        except CommError as exc:
            failures = dict.fromkeys(local, exc)
        errors.update(failures)
        return {m: _reason(e) for m, e in failures.items()}

    # -- streamed in buckets (a payload larger than the pool should hold at once) --------

    def _stream_to(self, local: list[int], timeout: float) -> LocalStream:
        """A stream of buckets from this member to its node-mates ``local``."""
        source = self._fanout_source(local, time.monotonic() + timeout)
        return LocalStream(source, local, self._next_seq, lambda m: str(self.members[m]),
                           timeout, f"broadcast from {self.members[self.index]}")

    def _stream_local(
        self, frame: bytes, header: Any, views: list[torch.Tensor], local: list[int],
        timeout: float,
    ) -> dict[int, Exception]:
        """As the source: a streamed message to this node's ``local`` members (the
        tensors' uint8 ``views``, in header order). Returns the failures."""
        self.phase = "local"
        stream = self._stream_to(local, timeout)
        stream.open(frame)
        for bucket in plan(header.tensors, header.stream):
            self._send_bucket(stream, bucket, self._pieces(bucket, views), header.stream)
        for member in stream.takers:
            stream.failures.pop(member, None)
        return stream.failures

    def _send_bucket(self, stream: LocalStream, bucket: Bucket, pieces: list[torch.Tensor],
                     bucket_bytes: int) -> None:
        stream.send(bucket, pieces, bucket_bytes)
        self.buckets_out += 1

    @staticmethod
    def _pieces(bucket: Bucket, views: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [views[p.tensor][p.start : p.end] for p in bucket.pieces]

    def _fail_everyone(self, local: list[int], relays: list[int], exc: Exception,
                       timeout: float) -> None:
        """As the source that cannot send a payload: tell every receiver why (they raise
        at once, rather than wait for their deadline)."""
        if local:
            try:
                self._stream_to(local, min(timeout, 1.0)).abort(self.index, reason_of(exc),
                                                                str(exc))
            except CommError:  # they time out instead
                pass
        if relays:
            self._gloo_group((self.index, *relays)).send_frame(
                ROUTE.pack(NOTED, 0, 0) + str(exc).encode()[:2000], 0, timeout)

    def _send_chain_stream(
        self, frame: bytes, header: Any, views: list[torch.Tensor], local: list[int],
        relays: list[int], timeout: float,
    ) -> tuple[dict[int, Exception], list[list[int]]]:
        """As the source: a streamed payload to the other nodes, and to this node's
        members meanwhile (on the helper thread). The relays first agree on the routes
        (:meth:`_agree_routes`); then each bucket goes along each route in turn, one run
        of its chain, carrying what its nodes take (each relay hands each bucket to its
        node-mates, and takes the next). Returns the failures, and the routes (each a
        chain from this member)."""
        chain = [self.index, *relays]
        bucket_bytes = header.stream
        chunk = record_size(bucket_bytes, len(relays), get_settings().bcast_chunk_bytes)
        run_id = int.from_bytes(os.urandom(8), "little")
        self.phase = "frame"
        self._gloo_group(tuple(chain)).send_frame(ROUTE.pack(CHAIN, run_id, chunk) + frame, 0,
                                                  timeout)
        helper = (self._helper().submit(self._stream_local, frame, header, views, local, timeout)
                  if local else None)
        failures: dict[int, Exception] = {}
        stopped: Exception | None = None
        ways: list[tuple[list[int], Route]] = []
        try:
            ways = self._agree_routes(chain, run_id, chunk, header, timeout)
            cut = [False] * len(ways)
            packed: torch.Tensor | None = None
            for bucket in plan(header.tensors, bucket_bytes):
                pieces = self._pieces(bucket, views)
                for g, (members, route) in enumerate(ways):
                    sizes = route.sizes(bucket)
                    if cut[g] or not any(sizes):
                        continue
                    if not route.whole and packed is None:
                        packed = pool.take(bucket_bytes)
                    send = pieces if route.whole else route.send_views(bucket, pieces, packed)
                    outcome = self._run_chain(
                        [self.index, *members], _bucket_run(run_id, bucket.index, g, len(ways)),
                        sizes, [memoryview(p.numpy()) for p in send], time.monotonic() + timeout,
                        timeout, lambda: None, chunk=chunk,
                    )
                    for member, reason in outcome.failures.items():
                        failures.setdefault(member, self._chain_failure(member, reason, "it",
                                                                        False))
                    if members[0] in failures or REFUSED in outcome.failures.values():
                        cut[g] = True  # nothing more gets along this route
                if all(cut):
                    break
        except _NothingSent as exc:
            stopped = exc.error
        finally:
            if helper is not None:
                try:
                    failures.update(helper.result(timeout=timeout + 5))
                except ProtocolMismatchError:
                    raise
                except Exception as exc:  # noqa: BLE001 - the node-mates' failure, raised below
                    failures.update(dict.fromkeys(local, exc))
        if stopped is not None:
            if failures:
                stopped.args = (f"{stopped.args[0]}; nor did "
                                + ", ".join(f"{self.members[m]} ({e})"
                                            for m, e in sorted(failures.items())),)
            raise stopped
        return failures, [[self.index, *members] for members, _ in ways]

    def _agree_routes(
        self, chain: list[int], run_id: int, chunk: int, header: Any, timeout: float,
        report: bytes | None = None, refuse: bool = False,
    ) -> list[tuple[list[int], Route]]:
        """Two runs of the whole chain before the first bucket: each relay reports what
        its node takes (``report``, in its ``DONE``), then the source passes every
        relay's report down. Every member then works out the same routes (see
        :mod:`~rlcomm.comm.broadcast.routes`): ``(relays, Route)`` each.

        Raises:
            _NothingSent: a member failed: nothing goes past the source (the run told
                every member of the chain).
        """
        metas = header.tensors
        relays = chain[1:]
        size = report_bytes(metas)
        token = bytearray(8)
        outcome = self._run_chain(chain, (run_id + 1) % (1 << 64), [len(token)],
                                  [memoryview(token)], time.monotonic() + timeout, timeout,
                                  lambda: None, refuse=refuse, chunk=chunk, report_bytes=size,
                                  report=report)
        self._check_agreement(chain, outcome, refuse, metas)
        table = bytearray(size * len(relays))
        if self.index == chain[0]:
            try:
                table[:] = b"".join(outcome.reports[r] for r in relays)
            except KeyError as exc:
                raise ProtocolMismatchError(
                    f"{self._label}: {self.members[exc.args[0]]} said nothing of what its "
                    "node takes", peer=self.members[exc.args[0]], op="broadcast") from exc
        outcome = self._run_chain(chain, (run_id + 2) % (1 << 64), [len(table)],
                                  [memoryview(table)], time.monotonic() + timeout, timeout,
                                  lambda: None, chunk=chunk)
        self._check_agreement(chain, outcome, False, metas)
        needs: list[Need] = []
        for i, relay in enumerate(relays):
            try:
                needs.append(unpack_report(table[i * size : (i + 1) * size], metas)[2])
            except CodecError as exc:
                raise ProtocolMismatchError(
                    f"{self._label}: what {self.members[relay]} takes: {exc}",
                    peer=self.members[relay], op="broadcast") from exc
        return [(members, Route(metas, needs[relays.index(members[0])]))
                for members in routes(relays, [pack_need(n) for n in needs])]

    def _check_agreement(self, chain: list[int], outcome: Any, refused: bool,
                         metas: Sequence[Any]) -> None:
        """Raise :class:`_NothingSent` (or a refusal of this member's own, ``refused``)
        when a run of the agreement failed anywhere (a relay that refused it says why
        in its report)."""
        where = (f"broadcast from {self.members[chain[0]]}" if self.index == chain[0]
                 else f"broadcast at {self.members[self.index]} from {self.members[chain[0]]}")
        if outcome.upstream_error is not None:
            if refused:
                raise _NothingSent(None)
            culprit, reason = outcome.upstream_error
            raise _NothingSent(self._chain_failure(culprit, reason,
                                                   self._along(chain[0], culprit), True),
                               culprit)
        if outcome.failures:
            culprit = next((m for m in chain if m in outcome.failures), min(outcome.failures))
            reason = outcome.failures[culprit]
            what = f"{where}: nothing went to the other nodes: {self.members[culprit]}"
            try:
                verdict, why, _ = unpack_report(outcome.reports[culprit], metas)
            except (KeyError, CodecError):
                verdict, why = TAKES, ""
            if reason == REFUSED and verdict != TAKES:
                kind = CapacityError if verdict == LIMIT_VERDICT else ProtocolMismatchError
                raise _NothingSent(kind(f"{what} refused it: {why}",
                                        peer=self.members[culprit], op="broadcast"), culprit)
            raise _NothingSent(self._chain_failure(culprit, reason, what, False), culprit)

    def _recv_chain_stream(
        self, src: int, chain: list[int], mates: list[int], header: Any, frame: bytes,
        run_id: int, chunk: int, timeout: float, taking: Taking,
        opened: Callable[[Any], None] | None,
    ) -> Any:
        """As a relay: a streamed payload along the chain. This member and its node-mates
        say what they take; once the routes are agreed, each bucket comes along this
        member's route, lands in this member's own tensors (straight, when they take it
        whole on the CPU; else through one bucket of staging), goes on to the next relay
        of the route, and to this node's ``mates`` (a stream of its own through the
        fan-out)."""
        refusal: ProtocolMismatchError | None = None
        receipt = None
        try:
            header_bucket(header)
            receipt = taking.stream(header)
        except CodecError as exc:
            refusal = ProtocolMismatchError(f"{taking.what}: {exc}", peer=self.members[src],
                                            op="broadcast")
        except ProtocolMismatchError as exc:
            refusal = exc
        stream = None
        if mates:
            stream = self._stream_to(mates, timeout)
            if refusal is not None:
                stream.abort(self.index, reason_of(refusal), str(refusal))
            else:
                try:
                    stream.open(frame)
                except ProtocolMismatchError as exc:
                    refusal = exc
        metas = header.tensors
        needs: list[Need] = [[None] * len(metas)]
        if refusal is None:
            needs = [need_of(metas, receipt.landing.selections)]  # type: ignore[union-attr]
            for body in (stream.bodies.values() if stream is not None else ()):
                try:
                    needs.append(from_verdict(body, metas))
                except CodecError:
                    needs.append([None] * len(metas))  # said nothing usable: everything
        try:
            verdict = TAKES if refusal is None else verdict_of(refusal)
            ways = self._agree_routes(chain, run_id, chunk, header, timeout,
                                      report=pack_report(verdict, str(refusal or ""),
                                                         union(metas, needs)),
                                      refuse=refusal is not None)
        except _NothingSent as exc:
            if refusal is not None:
                raise refusal from None
            if stream is not None:
                stream.abort(exc.culprit, reason_of(exc.error), str(exc.error))
            if receipt is not None:
                receipt.fail(exc.error)
            raise exc.error from None
        except BaseException as exc:
            if stream is not None:
                stream.abort(None, reason_of(exc), str(exc))
            raise
        g = next(i for i, (members, _) in enumerate(ways) if self.index in members)
        members, route = ways[g]
        assert receipt is not None
        if receipt.iterator is not None and opened:
            opened(receipt.iterator)
        staging: torch.Tensor | None = None
        packed: torch.Tensor | None = None
        failures: dict[int, Exception] = {}
        try:
            for bucket in plan(metas, header.stream):
                sizes = route.sizes(bucket)
                direct = receipt.direct(bucket) if route.whole else None
                if direct is not None:
                    buffers = got = direct
                else:
                    if staging is None:
                        staging = pool.take(header.stream)
                    buffers = [staging[p.offset : p.offset + p.nbytes] for p in bucket.pieces]
                    got = buffers
                    if not route.whole:
                        if packed is None:
                            packed = pool.take(header.stream)
                        got = route.receive_views(bucket, buffers, packed)

                def hand_to_mates(b: Bucket = bucket, bufs: list = buffers, into: list = got
                                  ) -> concurrent.futures.Future | None:
                    if not route.whole:
                        route.unpack(b, into, bufs)
                    if stream is None or not stream.takers:
                        return None
                    return self._helper().submit(self._send_bucket, stream, b, bufs,
                                                 header.stream)

                if any(sizes):
                    outcome = self._run_chain(
                        [src, *members], _bucket_run(run_id, bucket.index, g, len(ways)),
                        sizes, [memoryview(b.numpy()) for b in got],
                        time.monotonic() + timeout, timeout, hand_to_mates, chunk=chunk,
                    )
                else:  # nothing of it for this node: its mates read none of its bytes
                    outcome = ChainOutcome(local=hand_to_mates())
                    if outcome.local is not None:
                        try:
                            outcome.local.result(timeout=timeout + 5)
                        except Exception:  # noqa: BLE001 - the stream's failures, raised below
                            pass
                if outcome.upstream_error is not None:
                    culprit, reason = outcome.upstream_error
                    error = self._chain_failure(culprit, reason, self._along(src, culprit), True)
                    if stream is not None:
                        stream.abort(culprit, reason, str(error))
                    raise error
                for member, reason in outcome.failures.items():
                    failures.setdefault(member, self._chain_failure(member, reason, "it", False))
                self.buckets_in += 1
                self.bytes_in += sum(sizes)
                if direct is not None:
                    receipt.landed(bucket)
                else:
                    receipt.land(bucket, buffers)
        except BaseException as exc:
            receipt.fail(exc)
            raise
        if stream is not None:
            for member, exc in stream.failures.items():
                failures.setdefault(member, exc)
        if failures:
            self._raise_failures(failures, [src, *members])
        return receipt.result()

    def _helper(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._helper_pool is None:
            self._helper_pool = concurrent.futures.ThreadPoolExecutor(1, "rlcomm-bcast-local")
        return self._helper_pool

    def _chain_listener(self) -> ChainListener:
        """This member's chain listener, made and published on first use."""
        if self._listener is None:
            listener = ChainListener(self._host or "127.0.0.1")
            try:
                self._group_store().set(f"chain/{self.index}", listener.address.encode())
            except BaseException:
                listener.close()
                raise
            self._listener = listener
        return self._listener

    def _chain_address(self, member: int, deadline: float) -> str:
        """The address of ``member``'s chain listener (it made it before it took the
        broadcast's frame, so it is there). Raises ``TimeoutError`` when it is not."""
        store, key = self._group_store(), f"chain/{member}"
        try:
            store.wait([key], datetime.timedelta(seconds=max(0.01, deadline - time.monotonic())))
            return store.get(key).decode()
        except (RuntimeError, CommError) as exc:
            raise TimeoutError(f"{self.members[member]} published no chain listener: {exc}") from exc

    def _fanout_source(self, local: list[int], deadline: float) -> FanoutSource:
        if self._source is None:
            source = FanoutSource({m: self._pids[m] for m in local}, self._label)
            try:
                self._group_store().set(f"fanout/{self.index}", source.name.encode())
            except BaseException:
                source.close()
                raise
            self._source = source
        # The first broadcast waits for every local receiver to connect (as a Gloo
        # rendezvous would); later ones take whoever came meanwhile and go on.
        self._source.accept(deadline if not self._source_waited else time.monotonic())
        self._source_waited = True
        return self._source

    # -- receivers ---------------------------------------------------------------------------

    def _recv_local(
        self, src: int, deadline: float, taking: Taking, origin: int | None = None,
        opened: Callable[[Any], None] | None = None,
    ) -> Any:
        """As a member of ``src``'s node (``src``: the source, or this node's relay of a
        broadcast from ``origin``): the message through the fan-out."""
        self.phase = "local"
        sink = self._sink(src, deadline)
        while True:
            msg = self._next_message(sink, src, deadline)
            header, inline, offer = framing.unpack(msg.frame)
            if offer.startswith(ABORT_NOTE):
                raise self._note_error(src, src if origin is None else origin, offer)
            if offer.startswith(STREAM_NOTE):
                raise self._stream_note_error(src, src if origin is None else origin, offer)
            if not offer.startswith(SETUP):
                break
            self._device.set_up(src, offer, deadline)  # then the broadcast's own message
        if header.stream:
            return self._recv_local_stream(sink, src, msg.seq, header, taking,
                                           src if origin is None else origin, opened)
        into = taking.into if taking.plain else None
        try:
            incoming = classify(header, inline, offer, self.members[src], "a broadcast",
                                then="nothing of it was read")
            targets = None if into is None else self._targets(header, into, src)
        except ProtocolMismatchError as exc:
            if offer:
                self._device.refuse(src, offer, f"the receiver refused it: {exc}")
            raise
        if incoming.payload is Payload.INLINE:
            tensors = incoming.tensors or framing.split_inline(header, inline)
        elif incoming.payload is Payload.OFFERED:
            tensors = self._device_tensors(src, header, offer, targets)
        else:  # in the fan-out's segment (a CUDA payload staged through host memory too)
            sizes = [m.nbytes for m in header.tensors if m.nbytes]
            tensors = framing.tensors_from_payload(header, msg.payload(sizes))
            if incoming.on_device and targets is None:
                device = torch.device("cuda", torch.cuda.current_device())
                tensors = [t.to(device) for t in tensors]
        if not taking.plain:
            result = taking.whole(header, tensors)
            self.bytes_in += taking.bytes_read
            return result
        self.bytes_in += sum(m.nbytes for m in header.tensors)
        if targets is None:
            return codec.decode(header, tensors)
        if tensors is not targets:
            for target, tensor in zip(targets, tensors, strict=True):
                target.copy_(tensor)
        return into

    def _recv_local_stream(
        self, sink: FanoutSink, src: int, seq: int, header: Any, taking: Taking, origin: int,
        opened: Callable[[Any], None] | None,
    ) -> Any:
        """A message that streams in buckets through the fan-out (see
        :mod:`~rlcomm.comm.broadcast.stream`): say whether this member takes it, then
        copy each bucket out as it comes. A failure of this member's own (a bucket that
        does not check out, an iterator's caller who took nothing in time) drains the
        rest, so the source is never left waiting on it."""
        try:
            header_bucket(header)
            receipt = taking.stream(header)
        except (CodecError, ProtocolMismatchError) as exc:
            sink.verdict(seq, verdict_of(exc), str(exc))
            if isinstance(exc, CodecError):
                raise ProtocolMismatchError(f"{taking.what}: {exc}", peer=self.members[src],
                                            op="broadcast") from exc
            raise
        # A node-mate of a relay says what it takes: its node's link carries only that.
        sink.verdict(seq, TAKES, body=b"" if origin == src else verdict_body(
            need_of(header.tensors, receipt.landing.selections)))
        if receipt.iterator is not None and opened is not None:
            opened(receipt.iterator)
        failure: BaseException | None = None
        read_before = 0
        try:
            for bucket in plan(header.tensors, header.stream):
                msg = self._next_message(sink, src, time.monotonic() + taking.timeout,
                                         stream=True)
                if msg.frame:  # a stream note: it ends here
                    _, _, offer = framing.unpack(msg.frame)
                    raise self._stream_note_error(src, origin, offer)
                self.buckets_in += 1
                if failure is not None:
                    continue  # draining: the views are dropped unread
                try:
                    receipt.land(bucket, msg.payload(bucket.sizes))
                except (CodecError, CommError, PeerLostError) as exc:
                    failure = exc
                del msg
                self.bytes_in += receipt.landing.bytes_read - read_before
                read_before = receipt.landing.bytes_read
        except BaseException as exc:
            receipt.fail(exc)
            traceback.clear_frames(exc.__traceback__)  # no view of a slot stays held
            raise
        if failure is not None:
            receipt.fail(failure)
            raise failure
        return receipt.result()

    def _stream_note_error(self, src: int, origin: int, offer: bytes) -> Exception:
        """The error a member raises for a stream note from ``src`` (the source, or this
        node's relay of a broadcast from ``origin``)."""
        note = parse_note(offer, len(self.members))
        if note is None:
            return ProtocolMismatchError(f"a malformed stream note from {self.members[src]}",
                                         peer=self.members[src], op="broadcast")
        culprit, reason, text = note
        where = f"broadcast at {self.members[self.index]} from {self.members[origin]}"
        blame = self.members[culprit] if culprit < len(self.members) else self.members[src]
        if reason in (REFUSED, OVER_LIMIT):
            kind: type[CommError] = (CapacityError if reason == OVER_LIMIT
                                     else ProtocolMismatchError)
            return kind(f"{where}: nothing was sent: {blame} refused it: {text}",
                        peer=blame, op="broadcast")
        kind = PeerLostError if reason == LOST else CommTimeoutError
        return kind(f"{where}: it ended part-way: {text}", peer=blame, op="broadcast")

    def _device_tensors(
        self, src: int, header: Any, offer: bytes, targets: list[torch.Tensor] | None
    ) -> list[torch.Tensor]:
        """The CUDA tensors a source offered: copied on the device into ``targets`` (when
        they lie on a GPU) or into new tensors on this thread's device."""
        device = torch.device("cuda", torch.cuda.current_device())
        direct = targets is not None and all(t.is_cuda and t.is_contiguous() for t in targets)
        sizes = [m.nbytes for m in header.tensors]
        order = torch.cuda.current_stream(targets[0].device if direct else device)  # type: ignore[index]
        try:
            buffers = self._device.receive(src, offer, sizes, targets if direct else None,
                                           device, order)
        except CommError as exc:
            raise type(exc)(
                f"broadcast at {self.members[self.index]} from {self.members[src]}: {exc}",
                peer=self.members[src], op="broadcast",
            ) from exc
        return targets if direct else framing.tensors_from_payload(header, buffers, device)  # type: ignore[return-value]

    def _next_message(self, sink: FanoutSink, src: int, deadline: float,
                      stream: bool = False) -> Any:
        """The next message from ``src`` (older ones are late messages of broadcasts that
        timed out here: skipped). ``stream``: a bucket of a stream."""
        expected = self._seq_in.get(src, 0)
        while True:
            try:
                msg = sink.recv(deadline, stream)
            except CommError as exc:
                if isinstance(exc, PeerLostError):
                    self._drop_sink(src)
                raise type(exc)(
                    f"broadcast at {self.members[self.index]} from {self.members[src]}: {exc}",
                    peer=self.members[src], op="broadcast",
                ) from exc
            if msg.seq >= expected:
                self._seq_in[src] = msg.seq + 1
                return msg

    def _sink(self, src: int, deadline: float) -> FanoutSink:
        sink = self._sinks.get(src)
        if sink is None:
            check_memory()  # as the source does: fail with it rather than wait for it
            store = self._group_store()
            key = f"fanout/{src}"
            store.wait([key], datetime.timedelta(seconds=max(0.01, deadline - time.monotonic())))
            sink = FanoutSink(
                store.get(key).decode(), self.index, self._pids[src], deadline,
                f"broadcast from {self.members[src]}",
            )
            self._sinks[src] = sink
        return sink

    def _drop_sink(self, src: int) -> None:
        sink = self._sinks.pop(src, None)
        if sink is not None:
            sink.close()

    def _recv_remote(
        self, src: int, relays: dict[int, list[int]], deadline: float, timeout: float,
        taking: Taking, opened: Callable[[Any], None] | None = None,
    ) -> Any:
        """As a relay: the frame over Gloo, then the payload as its route says; hands it
        to this node's members (``relays[self.index]``)."""
        chain = [src, *relays]
        mates = relays[self.index]
        self._chain_listener()  # before the frame: the member before this one looks it up
        gloo = self._gloo_group(tuple(chain))
        self.phase = "frame"
        data = gloo.recv_frame(0, timeout)
        if len(data) < ROUTE.size:
            raise ProtocolMismatchError(f"{self._label}: a broadcast frame of {len(data)} bytes")
        route, run_id, chunk = ROUTE.unpack_from(data)
        frame = data[ROUTE.size :]
        if route == NOTED:  # the source cannot send it: nor can this relay's node-mates
            why = frame[:2000].decode(errors="replace")
            if mates:
                self._stream_to(mates, timeout).abort(src, OVER_LIMIT, why)
            raise CapacityError(f"broadcast at {self.members[self.index]} from "
                                f"{self.members[src]}: nothing was sent: {why}",
                                peer=self.members[src], op="broadcast")
        header, inline, _ = framing.unpack(frame)
        if route == CHAIN and MIN_CHUNK <= chunk <= MAX_CHUNK and not header.inline:
            if header.stream:
                return self._recv_chain_stream(src, chain, mates, header, frame, run_id, chunk,
                                               timeout, taking, opened)
            return self._recv_chain(src, chain, mates, header, frame, run_id, chunk, deadline,
                                    timeout, taking)
        if route != GLOO or header.stream:
            raise ProtocolMismatchError(
                f"{self._label}: a broadcast from {self.members[src]} on route {route} with "
                f"records of {chunk} bytes"
            )
        tensors = gloo.recv_payload(header, inline, 0, timeout)
        if mates:
            self._send(codec.decode(header, tensors), mates, [], deadline, timeout)
        return taking.whole(header, tensors)

    def _recv_chain(
        self, src: int, chain: list[int], mates: list[int], header: Any, frame: bytes,
        run_id: int, chunk: int, deadline: float, timeout: float, taking: Taking,
    ) -> Any:
        """As a relay: the payload along the chain (into ``into``'s tensors themselves
        when they are CPU tensors), passed on, and handed to ``mates``."""
        into = taking.into if taking.plain else None
        metas = header.tensors
        total = sum(m.nbytes for m in metas)
        refused = total > max_message_bytes()
        targets, misfit = None, None
        if into is not None and not refused:
            try:
                targets = self._targets(header, into, src)
            except ProtocolMismatchError as exc:
                misfit = exc  # raised once the payload went on to the others
        direct = targets is not None and all(
            t.device.type == "cpu" and t.is_contiguous() for t in targets
        )
        if refused:
            buffers: list[torch.Tensor] = []
        elif direct:
            buffers = [codec.as_bytes(t) for t in targets if t.numel()]  # type: ignore[union-attr]
        else:  # reused memory: fresh pages would fault in as the records land
            buffers = [pool.take(m.nbytes) for m in metas if m.nbytes]
        mate_errors: dict[int, Exception] = {}

        def hand_to_mates() -> concurrent.futures.Future | None:
            if not mates:
                return None
            return self._helper().submit(
                self._hand_cpu, frame, buffers, mates, deadline, timeout, mate_errors
            )

        outcome = self._run_chain(
            chain, run_id, [] if refused else [m.nbytes for m in metas if m.nbytes],
            [memoryview(b.numpy()) for b in buffers], deadline, timeout, hand_to_mates,
            refuse=refused, chunk=chunk,
        )
        if outcome.upstream_error is not None:
            culprit, reason = outcome.upstream_error
            if mates:
                self._note_to_mates(mates, culprit, reason, deadline)
            if refused:
                raise CapacityError(
                    f"a broadcast from {self.members[src]} declares {total} bytes, over this "
                    f"worker's limit of {max_message_bytes()} (RLCOMM_MAX_MESSAGE_BYTES)",
                    peer=self.members[src], op="broadcast",
                )
            raise self._chain_failure(culprit, reason, self._along(src, culprit), True)
        failures: dict[int, Exception] = dict(mate_errors)
        for member, reason in outcome.failures.items():
            failures.setdefault(member, self._chain_failure(member, reason, "it", False))
        if failures:
            self._raise_failures(failures, chain)
        if misfit is not None:
            raise misfit
        if direct:
            return into
        return taking.whole(header, framing.tensors_from_payload(header, buffers))

    def _along(self, src: int, culprit: int) -> str:
        """How a member's error names the member of the chain that failed before it."""
        if culprit == src:
            what = f"its source {self.members[src]}"
        else:
            what = f"{self.members[culprit]}, a member before it along the chain,"
        return (f"broadcast at {self.members[self.index]} from {self.members[src]}: the payload "
                f"did not come: {what}")

    def _note_to_mates(self, mates: list[int], culprit: int, reason: int, deadline: float) -> None:
        """Tell this node's ``mates`` that the chain failed at ``culprit`` (a fan-out note:
        they raise naming it rather than wait for their deadline)."""
        note = framing.pack(*codec.encode(None))[0] + ABORT_NOTE + NOTE.pack(culprit, reason)
        try:
            self._fanout_source(mates, deadline).publish(self._next_seq(), note, [], deadline)
        except CommError:  # they time out instead, naming this relay
            pass

    def _note_error(self, relay: int, origin: int, offer: bytes) -> Exception:
        """The error a member raises for a relay's note (checked before it is believed:
        the relay is a member of this group, proven on the fan-out's socket)."""
        body = offer[len(ABORT_NOTE):]
        if len(body) != NOTE.size:
            return ProtocolMismatchError(f"a malformed chain note from {self.members[relay]}")
        culprit, reason = NOTE.unpack(body)
        if culprit >= len(self.members) or reason not in REASONS:
            return ProtocolMismatchError(f"a malformed chain note from {self.members[relay]}")
        if reason == REFUSED and culprit == relay:
            return ProtocolMismatchError(
                f"broadcast at {self.members[self.index]} from {self.members[origin]}: this "
                f"node's relay {self.members[relay]} refused the payload (over its size "
                "limit)", peer=self.members[relay], op="broadcast",
            )
        return self._chain_failure(culprit, reason, self._along(origin, culprit), True)

    # -- stores and Gloo groups ----------------------------------------------------------------

    def _group_store(self) -> dist.Store:
        if self._store is None:
            self._store = self._connect_store(tuple(range(len(self.members))))
        return self._store

    def _gloo_group(self, indices: tuple[int, ...]) -> GlooBroadcast:
        group = self._gloo.get(indices)
        if group is None:
            label = f"broadcast group {[str(self.members[i]) for i in indices]}"
            group = GlooBroadcast(
                lambda: sub_store(self._connect_store(indices), "gloo"), indices.index(self.index), len(indices),
                label, self._host,
            )
            self._gloo[indices] = group
        return group

    def close(self) -> None:
        """Stop taking broadcasts and free the shared memory (not under the group's lock:
        a broadcast in flight may hold it until its deadline)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._helper_pool is not None:
            self._helper_pool.shutdown(wait=False, cancel_futures=True)
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        self._device.close()
        source, self._source = self._source, None
        if source is not None:
            source.close()
        for src in list(self._sinks):
            self._drop_sink(src)
