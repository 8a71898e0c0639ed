"""What every rlcomm process is doing: its report, the job's status, and the analysis
that a timeout's error carries.

**A process's report.** Every process with a :class:`~rlcomm.comm.manager.CommManager`
answers the ``status`` request of its mailbox store (:mod:`rlcomm.comm.store.client`) with
:func:`report`: who it is (address, node, pid), its ops under way with their age and the
last ones that ended (:mod:`rlcomm.comm.flight`), its connections (peer, transport,
state, bytes received and not yet read), its store's connections, and each channel it
serves (keys with their depth, parked getters and putters, clients). The report is made
on the store's status thread, never on the actor's method queue nor on the store's
loop, so a process busy in user code or stuck in an op still answers. Sections are
added by the layers that own them (:func:`add_section`: the manager, a channel worker),
so this module imports nothing above it; a section reads its owner's state without
taking the owner's locks, or takes one with a short timeout.

**The job's status.** :func:`job_status` asks every endpoint in the registry at once,
each with its own deadline, and returns a :class:`JobStatus` (a table with
:meth:`JobStatus.table`, plain data with :meth:`JobStatus.to_dict`). A process that does
not answer in time (stopped, or its store loop starved) is listed as not answering; one
whose mailbox is gone, as gone.

**Analysis.** When a point-to-point op fails with ``CommTimeoutError`` or
``PeerLostError``, the manager asks the peer for its ops under way (at most the
``hang_analysis_timeout`` setting, 1 s) and appends what it says to the error's message
(:func:`analysis`).
"""

from __future__ import annotations

import concurrent.futures
import copy
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from rlcomm.comm.flight import RECORDER, Op
from rlcomm.comm.identity.endpoint import Endpoint, decode_endpoint
from rlcomm.comm.store.link import StoreLink
from rlcomm.errors import CommError, CommTimeoutError, PeerLostError, RlcommError

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode

#: A report's detail: ``"ops"`` is the ops under way and the last one (for an analysis),
#: anything else the full report.
OPS = "ops"

#: Processes :func:`job_status` asks at once (each ask is a thread waiting on a socket).
_ASK_AT_ONCE = 128

#: ``name -> provider``: parts of this process's report (``provider()`` -> plain data).
_sections: dict[str, Callable[[], Any]] = {}


# A forked child reports about itself: its own manager adds its sections again.
os.register_at_fork(after_in_child=_sections.clear)


def add_section(name: str, provider: Callable[[], Any]) -> None:
    """Add (or replace) a part of this process's report: ``provider()`` returns plain
    data (dicts, lists, str, numbers). Sections named ``channel:<name>`` are listed
    under ``channels``. It runs on the store's status thread: it must not wait long on
    its owner's locks."""
    _sections[name] = provider


def remove_section(name: str) -> None:
    _sections.pop(name, None)


# -- a process's report ---------------------------------------------------------------------


def _op_dict(op: Op, now: float) -> dict[str, Any]:
    return {"op": op.op, "peer": str(op.peer), "bytes": op.nbytes,
            "age_s": round(now - op.began, 3)}


def _ended_dict(op: Op, now: float) -> dict[str, Any]:
    ended = op.ended if op.ended is not None else now
    return {"op": op.op, "peer": str(op.peer), "bytes": op.nbytes,
            "ago_s": round(now - ended, 3), "took_s": round(ended - op.began, 6),
            "error": op.error}


def report(detail: str = "") -> bytes:
    """This process's report (encoded; :func:`decode_report` reads it). ``detail``
    :data:`OPS`: only the ops under way and the last one that ended."""
    now = time.monotonic()
    out: dict[str, Any] = {"pid": os.getpid(), "time": time.time()}
    out["pending"] = [_op_dict(op, now) for op in RECORDER.under_way()]
    recent = RECORDER.recent()
    if detail == OPS:
        out["recent"] = [_ended_dict(e, now) for e in recent[-1:]]
        return _encode(out)
    out["recent"] = [_ended_dict(e, now) for e in recent]
    channels = []
    for name, provider in list(_sections.items()):
        try:
            value = provider()
        except Exception as exc:  # noqa: BLE001 - a section that fails says so in the report
            value = {"error": repr(exc)}
        if name.startswith("channel:"):
            channels.append(value)
        else:
            out[name] = value
    out["channels"] = channels
    return _encode(out)


def decode_report(data: bytes) -> dict[str, Any]:
    return _decode(data)


def process_status() -> dict[str, Any]:
    """This process's report, as ``rlcomm status`` gathers it from each worker: its ops
    under way and recent ones, and its sections (``process``: its connections and its
    mailbox store; ``channels``)."""
    return decode_report(report())


# -- asking a process -----------------------------------------------------------------------


def ask(endpoint: Endpoint, secret: bytes, detail: str, timeout: float) -> dict[str, Any]:
    """The report of the process at ``endpoint``, within ``timeout`` seconds.

    Raises:
        PeerLostError: nothing listens at its mailbox (its process is gone).
        CommTimeoutError: it did not answer in time (stopped, or too busy).
        AuthenticationError: the mailbox did not accept this process's proof.
    """
    deadline = time.monotonic() + timeout
    link = StoreLink(endpoint.host, endpoint.port, secret, timeout)
    try:
        data = link.status(detail, max(0.05, deadline - time.monotonic()))
    finally:
        link.close()
    if data is None:
        raise RlcommError(f"the process at {endpoint.host}:{endpoint.port} has no report")
    return decode_report(data)


def _why_not(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, PeerLostError):
        return "its process is gone (nothing listens at its mailbox)"
    if isinstance(exc, CommTimeoutError) or isinstance(exc, TimeoutError):
        return f"it did not answer within {timeout:g} s (stopped, or too busy to answer)"
    return f"{type(exc).__name__}: {exc}"


# -- analysis -------------------------------------------------------------------------------

_TOWARD = {"send": "to", "send_tensor": "to", "recv": "from", "recv_tensor": "from",
           "broadcast": "from"}


def op_text(op: str, peer: object) -> str:
    """``"send to trainer:1"``, ``"recv from rollout:3"``, ``"channel get on rollouts"``."""
    toward = _TOWARD.get(op, "on" if op.startswith("channel ") else "with")
    return f"{op} {toward} {peer}"


def _seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 10 else f"{s:.0f} s"


def peer_activity(peer: object, rep: dict[str, Any]) -> str:
    """What a report says its process is doing, in a sentence's words."""
    pending = rep.get("pending") or []
    if pending:
        parts = [f"{op_text(p['op'], p['peer'])} since {_seconds(p['age_s'])}"
                 for p in pending[:3]]
        more = f" (and {len(pending) - 3} more ops)" if len(pending) > 3 else ""
        return f"{peer} is in " + ", and in ".join(parts) + more
    recent = rep.get("recent") or []
    if recent:
        last = recent[-1]
        how = "failed with " + last["error"] if last.get("error") else "ended"
        return (f"{peer} is in no rlcomm op (busy in its own code, or idle); its last op, "
                f"{op_text(last['op'], last['peer'])}, {how} {_seconds(last['ago_s'])} ago")
    return f"{peer} is in no rlcomm op and has made none yet"


def analysis(me: object, op: str, peer: object, started: float | None,
             endpoint: Endpoint | None, secret: bytes, timeout: float) -> str:
    """``"analysis: trainer:0 is in recv from rollout:3 since 41 s; rollout:3 is in send
    to trainer:1 since 40 s"``: this process's op, and what ``peer`` says it is doing
    (asked for at most ``timeout`` seconds), or why it could not be asked."""
    mine = f"{me} is in {op_text(op, peer)}"
    if started is not None:
        mine += f" since {_seconds(time.monotonic() - started)}"
    if endpoint is None:
        return f"analysis: {mine}; {peer} could not be asked: it is not registered"
    try:
        theirs = peer_activity(peer, ask(endpoint, secret, OPS, timeout))
    except (CommError, RlcommError, OSError, msgspec.DecodeError) as exc:
        theirs = f"{peer} could not be asked: {_why_not(exc, timeout)}"
    return f"analysis: {mine}; {theirs}"


def with_analysis(exc: CommError, text: str) -> CommError:
    """A copy of ``exc`` (same class and fields) whose message ends with ``text``."""
    new = copy.copy(exc)
    new.args = (f"{exc}\n{text}",)
    new._rlcomm_analysis = True  # type: ignore[attr-defined]
    new.__cause__ = exc.__cause__
    new.__suppress_context__ = True
    return new.with_traceback(exc.__traceback__)


def has_analysis(exc: BaseException) -> bool:
    return getattr(exc, "_rlcomm_analysis", False)


# -- the job's status -----------------------------------------------------------------------


def _kind(address: str) -> str:
    if address.startswith("channel."):
        return "channel"
    if address.startswith("driver-"):
        return "driver"
    return "worker"


@dataclass
class JobStatus:
    """What every rlcomm process of a job said (see :func:`job_status`).

    Attributes:
        workers: one dict per endpoint, sorted by address: ``address``, ``group``,
            ``rank``, ``kind`` (``worker``, ``channel`` or ``driver``), ``host``,
            ``node_id``, ``pid``, ``state`` (``ok``, ``not answering``, ``gone`` or
            ``error``), ``problem`` (why it did not answer), ``answered_s``, and the
            process's report: ``pending``, ``recent``, ``process`` (connections, store)
            and ``channels``.
        took_s: seconds the gathering took.
    """

    workers: list[dict[str, Any]] = field(default_factory=list)
    took_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"took_s": round(self.took_s, 3), "workers": self.workers}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    def table(self, recent: int = 5) -> str:
        """The status as text tables: one row per process, then their connections, ops
        under way, channels, and the last ``recent`` ops each process ended."""
        return _format(self, recent)

    def __str__(self) -> str:
        return self.table()


def job_status(timeout: float = 1.0, secret: bytes | None = None,
               endpoints: dict[str, bytes] | None = None) -> JobStatus:
    """Ask every rlcomm process of the job on the attached Ray (workers, channel
    workers, drivers) for its report, all at once, each within ``timeout`` seconds.

    Args:
        timeout: seconds each process has to answer.
        secret: the job's secret (default: fetched from the registry).
        endpoints: the endpoints to ask, by address (default: the registry's).

    Raises:
        RlcommError: no Ray is attached and ``RAY_ADDRESS`` names none, or no rlcomm
            job runs on it.
    """
    import ray

    from rlcomm.cluster import connect_ray
    from rlcomm.comm.identity.registry import find_registry
    from rlcomm.settings import get_settings

    start = time.monotonic()
    if not ray.is_initialized():  # never start a Ray of our own: there is no job in it
        connect_ray(os.environ.get("RAY_ADDRESS") or None, get_settings().connect_timeout,
                    start_local=False)
    if endpoints is None or secret is None:
        reg = find_registry()
        got = ray.get([reg.endpoints.remote(), reg.secret.remote()], timeout=30)
        endpoints = got[0] if endpoints is None else endpoints
        secret = got[1] if secret is None else secret
    rows: dict[str, dict[str, Any]] = {}
    asks: dict[str, Endpoint] = {}
    for address, data in endpoints.items():
        group, _, rank = address.rpartition(":")
        row: dict[str, Any] = {"address": address, "group": group, "rank": rank,
                               "kind": _kind(address), "state": "error", "problem": ""}
        try:
            ep = decode_endpoint(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            row["problem"] = f"its endpoint cannot be read: {exc}"
        else:
            row.update(host=ep.host, node_id=ep.node_id, pid=ep.pid)
            asks[address] = ep
        rows[address] = row

    def one(ep: Endpoint) -> tuple[dict[str, Any] | None, BaseException | None, float]:
        t0 = time.monotonic()
        try:
            return ask(ep, secret, "", timeout), None, time.monotonic() - t0
        except Exception as exc:  # noqa: BLE001 - listed as the process's state
            return None, exc, time.monotonic() - t0

    if asks:
        pool = concurrent.futures.ThreadPoolExecutor(min(_ASK_AT_ONCE, len(asks)),
                                                   "rlcomm-status-ask")
        try:
            futures = {a: pool.submit(one, ep) for a, ep in asks.items()}
            for address, fut in futures.items():
                rep, exc, took = fut.result()
                row = rows[address]
                row["answered_s"] = round(took, 3)
                if rep is not None:
                    row["state"] = "ok"
                    row.update(rep)
                else:
                    row["state"] = (
                        "gone" if isinstance(exc, PeerLostError)
                        else "not answering" if isinstance(exc, (CommTimeoutError, TimeoutError))
                        else "error"
                    )
                    row["problem"] = _why_not(exc, timeout)  # type: ignore[arg-type]
        finally:
            pool.shutdown(wait=False)
    return JobStatus(sorted(rows.values(), key=_order), time.monotonic() - start)


def _order(row: dict[str, Any]) -> tuple:
    rank = row.get("rank", "")
    return (row["kind"] == "driver", row["group"],
            [int(p) for p in rank.split(".")] if rank.replace(".", "").isdigit() else [0])


# -- the table ------------------------------------------------------------------------------


def human_bytes(n: int | None) -> str:
    if n is None or n < 0:
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _grid(title: str, header: list[str], rows: list[list[Any]]) -> str:
    if not rows:
        return ""
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [title] if title else []
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join(lines)


def _format(status: JobStatus, recent: int) -> str:
    workers = status.workers
    answered = sum(1 for w in workers if w["state"] == "ok")
    head = (f"rlcomm status: {len(workers)} processes, {answered} answered "
            f"({status.took_s:.2f} s)")
    rows = []
    for w in workers:
        pending = w.get("pending") or []
        oldest = max(pending, key=lambda p: p["age_s"]) if pending else None
        state = w["state"] if w["state"] == "ok" else f"{w['state'].upper()}"
        rows.append([
            w["group"], w["rank"], w["kind"], w.get("host", "-"),
            (w.get("node_id") or "-")[:8], w.get("pid", "-"), state,
            len((w.get("process") or {}).get("connections") or []) if w["state"] == "ok" else "-",
            (f"{op_text(oldest['op'], oldest['peer'])} ({_seconds(oldest['age_s'])})"
             + (f" +{len(pending) - 1}" if len(pending) > 1 else "")) if oldest else
            ("-" if w["state"] == "ok" else w.get("problem", "")),
        ])
    out = [head + "\n" + _grid("", ["GROUP", "RANK", "KIND", "HOST", "NODE", "PID", "STATE",
                                     "CONNS", "IN OP (OLDEST)"], rows)]
    conns, ops, chans, ended = [], [], [], []
    for w in workers:
        name = w["address"]
        for c in (w.get("process") or {}).get("connections") or []:
            conns.append([name, c["peer"], c["transport"], c["state"],
                          human_bytes(c.get("unread_bytes")), c.get("unread_messages", 0)])
        for p in w.get("pending") or []:
            ops.append([name, p["op"], p["peer"], human_bytes(p["bytes"]), _seconds(p["age_s"])])
        for ch in w.get("channels") or []:
            clients = ch.get("clients") or []
            keys = ch.get("keys") or []
            if not keys:
                chans.append([ch.get("name", "?"), name, "-", 0, 0, 0, len(clients)])
            for k in keys:
                chans.append([ch.get("name", "?"), name, k["key"], k["depth"], k["getters"],
                              k["putters"], len(clients)])
        for e in (w.get("recent") or [])[-recent:] if recent else []:
            ended.append([name, e["op"], e["peer"], human_bytes(e["bytes"]),
                          f"{_seconds(e['ago_s'])} ago", f"{e['took_s'] * 1e3:.2f} ms",
                          e["error"] or "ok"])
    for title, header, rows in (
        ("CONNECTIONS", ["PROCESS", "PEER", "TRANSPORT", "STATE", "UNREAD", "MSGS"], conns),
        ("OPS UNDER WAY", ["PROCESS", "OP", "PEER", "SIZE", "SINCE"], ops),
        ("CHANNELS", ["CHANNEL", "PROCESS", "KEY", "DEPTH", "GETTERS", "PUTTERS", "CLIENTS"],
         chans),
        (f"LAST OPS (flight recorder, up to {recent} per process)",
         ["PROCESS", "OP", "PEER", "SIZE", "ENDED", "TOOK", "RESULT"], ended),
    ):
        text = _grid(title, header, rows)
        if text:
            out.append(text)
    return "\n\n".join(out) + "\n"
