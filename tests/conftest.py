"""Shared fixtures: one local Ray per test session, and a simulated two-node cluster.

Worker classes defined in test modules are imported by module name in the worker
processes, so the repository root goes on PYTHONPATH before Ray starts.
"""

from __future__ import annotations

import logging
import os
import sys

import pytest
import ray

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p
)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Where a name server drops a query now and then, glibc waits 5 s before it asks again.
# torch's TCPStore looks up its peer's host name on each connection it makes or accepts
# (tests and examples that use torch.distributed as a user would), so each lost query
# cost a test 5 s of waiting: ask again after 1 s. Processes started from here (Ray's
# too) inherit it. rlcomm's own stores and transports look no name up.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:4")

_state: dict[str, object] = {"kind": None, "cluster": None}


def _shutdown_current() -> None:
    if ray.is_initialized():
        ray.shutdown()
    cluster = _state.get("cluster")
    if cluster is not None:
        cluster.shutdown()
    _state.update(kind=None, cluster=None)


@pytest.fixture(scope="module")
def ray_local():
    """The shared single-node local Ray (started once, reused by every test)."""
    if _state["kind"] != "local" or not ray.is_initialized():
        _shutdown_current()
        # address="local": a Ray of this session's own, never one that another process
        # started on this machine (Ray attaches to the latest `ray start` cluster otherwise).
        ray.init(address="local", include_dashboard=False, logging_level=logging.WARNING,
                 num_cpus=2)
        _state["kind"] = "local"
    yield


@pytest.fixture(scope="module")
def cluster(ray_local):
    from rlcomm import Cluster

    return Cluster(num_nodes=1)


@pytest.fixture(scope="module")
def two_node_cluster():
    """A simulated two-node Ray cluster (two raylets on this machine), per test module."""
    from ray.cluster_utils import Cluster as RayTestCluster

    _shutdown_current()
    test_cluster = RayTestCluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    test_cluster.add_node(num_cpus=1)
    test_cluster.wait_for_nodes()
    ray.init(address=test_cluster.address, logging_level=logging.WARNING)
    _state.update(kind="two_node", cluster=test_cluster)
    from rlcomm import Cluster

    yield Cluster(num_nodes=2)
    _shutdown_current()


def pytest_sessionfinish(session, exitstatus):
    _shutdown_current()
