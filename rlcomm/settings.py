"""Every ``RLCOMM_*`` setting, read from the environment in this one module.

A setting named ``comm_timeout`` is read from ``RLCOMM_COMM_TIMEOUT``, once, when rlcomm
is imported. :func:`get_settings` returns the current values (a frozen
:class:`Settings`); :func:`update_settings` changes them at run time in this process,
and workers launched afterwards start with the changed values.

Some settings size structures made once per process (shared-memory rings, buffer
pools): they are marked ``live=False``, are read at import only, and must be set in the
environment before the process starts (``RLCOMM_SHM_RING_BYTES=... python train.py``);
:func:`update_settings` refuses to change them.

To add a setting, add one field to :class:`Settings` with :func:`_setting` (its default,
its one-line effect, whether it may change at run time, and its bounds) and one row to
``docs/settings.md``; a test checks that every field has its row.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rlcomm.errors import RlcommError

#: The prefix of every environment variable rlcomm reads.
ENV_PREFIX = "RLCOMM_"

#: Set by rlcomm in each worker process: the name of the worker's group (not a setting).
GROUP_NAME_ENV = "RLCOMM_GROUP_NAME"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class SettingsError(RlcommError, ValueError):
    """A setting has a value rlcomm cannot use (wrong type, out of range, unknown name)."""


def _setting(default: Any, doc: str, *, live: bool = True, minimum: float | None = None,
             choices: tuple[str, ...] | None = None) -> Any:
    """One field of :class:`Settings`: its default, its effect (``doc``), whether it may
    change at run time (``live``), and its bounds."""
    return dataclasses.field(
        default=default,
        metadata={"doc": doc, "live": live, "minimum": minimum, "choices": choices},
    )


@dataclass(frozen=True)
class Settings:
    """The values of every rlcomm setting (frozen: change them with :func:`update_settings`).

    Each field ``name`` is read from the environment variable ``RLCOMM_<NAME>``;
    ``docs/settings.md`` says what each one does.
    """

    comm_timeout: float = _setting(
        180.0, "default seconds a send, recv, broadcast or channel op may take", minimum=1e-3)
    call_timeout: float = _setting(
        24 * 3600.0, "default seconds `GroupResult.wait()` waits for a worker method",
        minimum=1e-3)
    launch_timeout: float = _setting(
        300.0, "seconds `WorkerGroup.launch` waits for every worker's `__init__`", minimum=1e-3)
    connect_timeout: float = _setting(
        30.0, "seconds `Cluster()` and `WorkerGroup.from_group_name` wait to attach to Ray",
        minimum=1e-3)
    worker_num_cpus: float = _setting(
        0.0, "CPUs each worker actor reserves in Ray (0: any number of workers fit a node)",
        minimum=0)
    catch_failure: bool = _setting(
        True, "default of `launch(catch_system_failure=)`: log fatal signals and `sys.exit` "
        "in workers with the worker's address")
    log_level: str = _setting(
        "WARNING", "level of the `rlcomm` log records a worker passes on (Ray forwards a "
        "worker's stderr to the driver); INFO or DEBUG shows more", choices=_LEVELS)
    shm_spin_us: float = _setting(
        200.0, "most microseconds a receiver on shared memory spins before it sleeps "
        "(0: never spin)", live=False, minimum=0)
    shm_ring_bytes: int = _setting(
        8 << 20, "bytes of each shared-memory ring (one per direction of a same-node pair)",
        live=False, minimum=1 << 16)
    shm_segment_threshold: int = _setting(
        256 << 10, "messages of at least this many bytes go through a pooled shared-memory "
        "segment instead of the ring", live=False, minimum=1)
    shm_pool_bytes: int = _setting(
        4 << 30, "most bytes of shared-memory segments a connection keeps per direction "
        "(and of slots a broadcast source keeps); a CPU payload over a quarter of it streams "
        "in buckets", live=False, minimum=0)
    copy_threads: int = _setting(
        0, "threads that share one large copy into shared memory (0: as many as CPUs, "
        "at most 4; 1: no splitting)", live=False, minimum=0)
    shm_max_in_flight: int = _setting(
        64, "most shared-memory segments a sender has in flight per connection", live=False,
        minimum=2)
    strict: bool = _setting(
        False, "strict mode: received pickles may build only plain values and tensors "
        "(no other class or function); see docs/security.md")
    max_unread_bytes: int = _setting(
        1 << 30, "received-but-unread bytes one connection holds before it stops reading "
        "(the sender then waits, and times out); read when a connection is made", minimum=1)
    max_message_bytes: int = _setting(
        32 << 30, "most bytes a receiver allocates for one message (all its tensors as it "
        "takes them; as rlcomm.Buckets, the largest); a message received into= existing "
        "tensors may be larger when it streams", minimum=1)
    channel_reply_timeout: float = _setting(
        3600.0, "seconds a channel worker's reply may wait for a client that stopped "
        "reading (a frozen process) before the worker ends that client's connection",
        minimum=1e-3)
    channel_write_behind: bool = _setting(
        True, "a blocking put on an unbounded channel returns once its message is sent, "
        "without waiting for the channel worker's answer (see Channel.put)", live=False)
    bcast_max_slots: int = _setting(
        4, "shared-memory segments a broadcast source keeps per group for same-node "
        "receivers (receivers holding views of all of them make it wait)", live=False,
        minimum=1)
    bucket_bytes: int = _setting(
        64 << 20, "bytes of each bucket of a message that streams (a CPU payload larger "
        "than a quarter of shm_pool_bytes, or than a receiver's max_message_bytes, on "
        "every path; a broadcast to other nodes larger than one bucket, in one bucket "
        "while a quarter of the pool holds it); the sender's "
        "value holds, capped at a quarter of its pool",
        minimum=1 << 20)
    bcast_chunk_bytes: int = _setting(
        1 << 20, "bytes of each record of a broadcast passed along the chain of nodes: a "
        "node forwards a record as soon as it holds it, while the next one arrives",
        minimum=1 << 12)
    bcast_chain_min_bytes: int = _setting(
        1 << 20, "CPU payloads of at least this many bytes go to other nodes along the "
        "chain of their relays (pipelined); smaller ones go from the source over Gloo's "
        "broadcast (a very large value keeps every broadcast on Gloo)", minimum=0)
    cuda_slot_bytes: int = _setting(
        1 << 20, "CUDA payloads up to this many bytes to a worker on the same GPU are copied "
        "into a staging slot (the send returns at once); larger ones are lent (the receiver "
        "copies them from the sender's tensors); read when a connection's CUDA path is made",
        minimum=0)
    cuda_staging_slots: int = _setting(
        8, "staging slots one direction of a same-GPU connection has (its GPU memory cap is "
        "cuda_slot_bytes times this; 0: every CUDA payload is lent)", minimum=0)
    cuda_idle_release: float = _setting(
        10.0, "seconds without a CUDA message after which a same-GPU connection releases its "
        "staging slots and closes the peer's memory it opened", minimum=1e-3)
    store_auth_timeout: float = _setting(
        2.0, "seconds a new connection to an rlcomm store (a worker's mailbox) has to "
        "prove it belongs to the job before it is dropped; read when the store starts",
        minimum=1e-3)
    store_max_connections: int = _setting(
        4096, "most connections one rlcomm store keeps open; past it the oldest that has "
        "not proven itself is dropped; read when the store starts", minimum=2)
    flight_recorder_ops: int = _setting(
        256, "ended ops (point-to-point, broadcast, waited-for channel requests) each "
        "process remembers for `rlcomm status` (0: none)", live=False, minimum=0)
    hang_analysis_timeout: float = _setting(
        1.0, "seconds a timed-out or failed op asks its peer what it is doing, for the "
        "error's analysis (0: never ask)", minimum=0)
    recv_pool_bytes: int = _setting(
        2 << 30, "most bytes of free receive buffers (Gloo) a process keeps for reuse",
        live=False, minimum=0)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Settings from ``environ`` (default ``os.environ``); unset ones take defaults.

        Raises:
            SettingsError: a variable holds a value of the wrong type or out of range.
        """
        environ = os.environ if environ is None else environ
        values = {}
        for f in dataclasses.fields(cls):
            raw = environ.get(env_name(f.name))
            if raw is not None and raw.strip() != "":
                values[f.name] = _parse(f, raw, env_name(f.name))
        return cls(**values)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check(f, getattr(self, f.name), f.name)

    def changed(self) -> dict[str, Any]:
        """The fields whose values differ from their defaults."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != f.default
        }


def env_name(field_name: str) -> str:
    """The environment variable of a setting: ``comm_timeout`` -> ``RLCOMM_COMM_TIMEOUT``."""
    return ENV_PREFIX + field_name.upper()


def _parse(f: dataclasses.Field, raw: str, where: str) -> Any:
    text = raw.strip()
    kind = type(f.default)
    if kind is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise SettingsError(f"{where}={raw!r}: expected one of {_TRUE + _FALSE}")
    if kind is str:
        return text.upper() if f.metadata["choices"] == _LEVELS else text
    try:
        return kind(text)
    except ValueError:
        raise SettingsError(f"{where}={raw!r}: expected a number ({kind.__name__})") from None


def _check(f: dataclasses.Field, value: Any, where: str) -> None:
    kind = type(f.default)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise SettingsError(f"{where}: expected {kind.__name__}, got {value!r}")
    minimum = f.metadata["minimum"]
    if minimum is not None and value < minimum:
        raise SettingsError(f"{where}: must be >= {minimum}, got {value!r}")
    choices = f.metadata["choices"]
    if choices is not None and value not in choices:
        raise SettingsError(f"{where}: expected one of {choices}, got {value!r}")


_FIELDS = {f.name: f for f in dataclasses.fields(Settings)}
_current = Settings.from_env()


def get_settings() -> Settings:
    """The settings of this process now."""
    return _current


def update_settings(**changes: Any) -> Settings:
    """Change settings of this process at run time; returns the new settings.

    Workers launched afterwards start with them too (the driver passes every changed
    live setting to the workers it launches). ``log_level`` also sets the level of the
    ``rlcomm`` logger here.

    Raises:
        SettingsError: an unknown name, a bad value, or a setting that is read at import
            only (``live=False``: set its environment variable before the process starts).
    """
    global _current
    for name, value in changes.items():
        f = _FIELDS.get(name)
        if f is None:
            raise SettingsError(f"update_settings: no setting named {name!r}; "
                                f"the settings are {sorted(_FIELDS)}")
        if not f.metadata["live"] and value != getattr(_current, name):
            raise SettingsError(
                f"update_settings: {name} is read once when rlcomm is imported; set "
                f"{env_name(name)} in the environment before the process starts instead"
            )
        if type(f.default) is float and isinstance(value, int) and not isinstance(value, bool):
            changes[name] = float(value)
        if name == "log_level" and isinstance(value, str):
            changes[name] = value.upper()
    _current = dataclasses.replace(_current, **changes)
    if "log_level" in changes:
        logging.getLogger("rlcomm").setLevel(_current.log_level)
    return _current


def live_changes() -> dict[str, Any]:
    """The live settings that differ from their defaults (what a launch passes on)."""
    return {k: v for k, v in _current.changed().items() if _FIELDS[k].metadata["live"]}


def group_name_from_env() -> str | None:
    """The worker group of this process, as rlcomm set it in a worker (None elsewhere)."""
    return os.environ.get(GROUP_NAME_ENV)
