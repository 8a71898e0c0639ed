"""The registry: one small named actor that knows every live worker group.

It holds, per group, the worker class name, the world size, the Ray actor names of its
ranks and each worker's communication endpoint. It is control plane only: looked up
once per peer and cached, never on a message's data path.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import ray

from rlcomm.cluster import RLCOMM_NAMESPACE, connect_ray
from rlcomm.errors import RlcommError
from rlcomm.settings import get_settings

REGISTRY_NAME = "rlcomm.registry"


class _Registry:
    def __init__(self) -> None:
        self._groups: dict[str, dict[str, Any]] = {}
        self._endpoints: dict[str, Any] = {}
        # The job's secret: every rlcomm store and transport handshake proves it. Only
        # processes that can call this actor (members of the Ray cluster, behind Ray's
        # own authentication) can get it.
        self._secret = os.urandom(32)

    def secret(self) -> bytes:
        return self._secret

    def reserve_group(self, name: str) -> bool:
        if name in self._groups:
            return False
        self._groups[name] = {"pending": True}
        return True

    def set_group(self, name: str, info: dict[str, Any]) -> None:
        self._groups[name] = info

    def drop_group(self, name: str) -> None:
        self._groups.pop(name, None)
        prefix = f"{name}:"
        for key in [k for k in self._endpoints if k.startswith(prefix)]:
            del self._endpoints[key]

    def get_group(self, name: str) -> dict[str, Any] | None:
        return self._groups.get(name)

    def set_endpoint(self, address: str, endpoint: Any) -> None:
        self._endpoints[address] = endpoint

    def get_endpoint(self, address: str) -> Any:
        return self._endpoints.get(address)

    def endpoints(self) -> dict[str, Any]:
        """Every registered endpoint, by address (``rlcomm status`` asks each one)."""
        return dict(self._endpoints)


_handle: tuple[str, Any] | None = None
_handle_lock = threading.Lock()


def registry():
    """The registry actor handle, created on first use (cached per Ray job of this process).

    In a process with no Ray attached it attaches to ``RAY_ADDRESS`` (bounded by the
    ``connect_timeout`` setting) and never starts a new Ray: a lookup in a new, empty Ray
    would only find nothing.

    Raises:
        RlcommError: no Ray is attached and ``RAY_ADDRESS`` is unset or unreachable.
    """
    global _handle
    if not ray.is_initialized():
        connect_ray(os.environ.get("RAY_ADDRESS") or None, get_settings().connect_timeout,
                    start_local=False)
    ctx = ray.get_runtime_context()
    job = f"{ctx.gcs_address}/{ctx.get_job_id()}"
    with _handle_lock:
        if _handle is None or _handle[0] != job:
            actor = (
                ray.remote(_Registry)
                .options(
                    name=REGISTRY_NAME,
                    namespace=RLCOMM_NAMESPACE,
                    get_if_exists=True,
                    num_cpus=0,
                )
                .remote()
            )
            _handle = (job, actor)
        return _handle[1]


def find_registry() -> Any:
    """The registry actor of the rlcomm job running on the attached Ray, without making
    one (a tool that looks at a job must not start an empty registry).

    Raises:
        RlcommError: no rlcomm job has run on this Ray (there is no registry).
    """
    try:
        return ray.get_actor(REGISTRY_NAME, namespace=RLCOMM_NAMESPACE)
    except ValueError:
        raise RlcommError(
            "no rlcomm job runs on this Ray (there is no rlcomm registry actor); is "
            "RAY_ADDRESS the address of the job's Ray?"
        ) from None


_secret: tuple[str, bytes] | None = None


def job_secret() -> bytes:
    """The job's secret (fetched from the registry once per Ray job of this process)."""
    global _secret
    ctx = ray.get_runtime_context()
    job = f"{ctx.gcs_address}/{ctx.get_job_id()}"
    cached = _secret
    if cached is not None and cached[0] == job:
        return cached[1]
    value = ray.get(registry().secret.remote(), timeout=60)
    _secret = (job, value)
    return value
