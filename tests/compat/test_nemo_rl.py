"""NeMo-RL (``nemo_rl.distributed.worker_groups``) behaviours, checked on rlcomm with only
the imports changed and GPUs off.

Each case names the NeMo-RL behaviour it checks and the upstream test that asserts it
(NeMo-RL ``tests/unit/distributed/test_worker_groups.py``). Written anew from what those
tests assert. rlcomm's group is ``Worker.create_group().launch(...)`` where NeMo-RL has
``RayWorkerGroup(cluster, RayWorkerBuilder(fqn), ...)``.
"""

from __future__ import annotations

import os
import uuid

import pytest
import ray

from rlcomm import NamedSharding, NodePlacementStrategy, Worker
from rlcomm.worker.sharded_calls import PerWorkerDataError
from tests.markers import cpu_only_cluster


@ray.remote
class RecordingActor(Worker):
    def __init__(self, *args, **kwargs):
        super().__init__()
        self.init_args, self.init_kwargs = args, kwargs
        self.env = dict(os.environ)
        self.records = []

    def identity(self):
        return tuple(self.env.get(k) for k in ("RANK", "WORLD_SIZE", "NODE_RANK", "LOCAL_RANK"))

    def master(self):
        return self.env.get("MASTER_ADDR"), self.env.get("MASTER_PORT")

    def get_env_var(self, name):
        return self.env.get(name)

    def hook_effect(self):
        return (
            self.init_kwargs.get("configured_gpus", "not_set"),
            self.init_kwargs.get("bundle_indices_seen", "not_set"),
            self.init_kwargs.get("gpus_per_node", "not_set"),
            self.env.get("CONFIGURED_WORKER_CALLED"),
        )

    def record_call(self, data=None, *args, **kwargs):
        self.records.append((data, args, kwargs))
        return self.rank, data

    @staticmethod
    def configure_worker(num_gpus, bundle_indices, num_gpus_per_node=None):
        init_kwargs = {
            "configured_gpus": num_gpus,
            "bundle_indices_seen": bundle_indices,
            "gpus_per_node": num_gpus_per_node,
        }
        return {"num_gpus": num_gpus}, {"CONFIGURED_WORKER_CALLED": "1"}, init_kwargs, {}


@ray.remote(
    runtime_env={
        "env_vars": {
            "COMPAT_VAR_1": "ray_remote_value",
            "COMPAT_VAR_3": "ray_remote_value",
            "COMPAT_RAY_REMOTE_VAR": "ray_remote_only",
        }
    }
)
class PrecedenceActor(Worker):
    def get_env_var(self, name):
        return os.environ.get(name)

    @classmethod
    def configure_worker(cls, num_gpus, bundle_indices=None, num_gpus_per_node=None):
        env = {"COMPAT_VAR_1": "configure_worker_value", "COMPAT_WORKER_VAR": "worker_only"}
        return {"num_gpus": num_gpus}, env, {}, {"env_vars": {"COMPAT_FROM_OVERRIDES": "yes"}}


def _name(tag: str) -> str:
    return f"nemo_{tag}_{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="module")
def two_workers(cluster):
    """NeMo-RL's worker_group_1d_sharding: two workers on one node."""
    group = RecordingActor.create_group().launch(
        cluster, NodePlacementStrategy([0, 0]), name=_name("pair"),
        sharding=NamedSharding([0, 1], ["data"]),
    )
    yield group
    group.shutdown(force=True)


def test_remote_wrapped_worker_class_launches(two_workers):
    """NeMo-RL workers are ``@ray.remote`` classes; create_group on one works (it raised
    an MRO TypeError before)."""
    assert two_workers.world_size == 2
    assert two_workers.worker_cls_name == "RecordingActor"


def test_environment_variables_setup(two_workers):
    """test_worker_groups.py::test_environment_variables_setup: RANK, WORLD_SIZE,
    NODE_RANK, LOCAL_RANK per worker; MASTER_ADDR / MASTER_PORT equal the group's
    master_address / master_port."""
    group = two_workers
    assert group.identity().wait(timeout=60) == [("0", "2", "0", "0"), ("1", "2", "0", "1")]
    for addr, port in group.master().wait(timeout=60):
        assert addr == group.master_address and port == str(group.master_port)
    assert isinstance(group.master_port, int) and group.master_address


@cpu_only_cluster
def test_configure_worker_interaction(two_workers):
    """test_worker_groups.py::test_configure_worker_interaction: the hook's num_gpus (0 on
    CPU), bundle_indices for every worker (a worker on its own is its own group), its
    env var and init kwargs; the 4-tuple return and num_gpus_per_node are accepted."""
    effects = two_workers.hook_effect().wait(timeout=60)
    assert [e[0] for e in effects] == [0, 0]
    assert [e[1] for e in effects] == [(0, [0]), (0, [1])]
    assert all(e[2] == 0 and e[3] == "1" for e in effects)
    assert [m["bundle_indices"] for m in two_workers.worker_metadata] == [(0, [0]), (0, [1])]


def test_custom_environment_variables_override_existing(cluster, monkeypatch):
    """test_worker_groups.py::test_custom_environment_variables and
    ::test_custom_environment_variables_override_existing: the caller's env_vars reach
    every worker and override the driver's environment."""
    monkeypatch.setenv("COMPAT_DUMMY_PATH", "/original/path")
    monkeypatch.setenv("COMPAT_DRIVER_ONLY", "driver")
    group = RecordingActor.create_group().launch(
        cluster, NodePlacementStrategy([0]), name=_name("env"),
        env_vars={"COMPAT_DUMMY_PATH": "/overridden/path", "COMPAT_CUSTOM": "custom"},
    )
    try:
        assert group.get_env_var("COMPAT_DUMMY_PATH").wait(timeout=60) == ["/overridden/path"]
        assert group.get_env_var("COMPAT_CUSTOM").wait(timeout=60) == ["custom"]
        assert group.get_env_var("COMPAT_DRIVER_ONLY").wait(timeout=60) == ["driver"]
        assert group.identity().wait(timeout=60) == [("0", "1", "0", "0")]
    finally:
        group.shutdown(force=True)


def test_environment_variable_precedence_full(cluster, monkeypatch):
    """test_worker_groups.py::test_environment_variable_precedence_full, highest first:
    configure_worker, the group's env_vars, the driver's environment, the class's
    @ray.remote runtime_env."""
    for i in (1, 2, 3, 4):
        monkeypatch.setenv(f"COMPAT_VAR_{i}", "system_value")
    group = PrecedenceActor.create_group().launch(
        cluster, NodePlacementStrategy([0]), name=_name("precedence"),
        env_vars={"COMPAT_VAR_1": "group_value", "COMPAT_VAR_2": "group_value"},
    )
    try:
        def env(name):
            return group.get_env_var(name).wait(timeout=60)[0]

        assert env("COMPAT_VAR_1") == "configure_worker_value"
        assert env("COMPAT_VAR_2") == "group_value"
        assert env("COMPAT_VAR_3") == "system_value"
        assert env("COMPAT_VAR_4") == "system_value"
        assert env("COMPAT_WORKER_VAR") == "worker_only"
        assert env("COMPAT_RAY_REMOTE_VAR") == "ray_remote_only"
        assert env("COMPAT_FROM_OVERRIDES") == "yes"  # the 4th element's env_vars
    finally:
        group.shutdown(force=True)


def test_driver_environment_skips_ray_and_identity_variables():
    """What goes from the launching process: not Ray's own variables, not the devices,
    not the identity variables rlcomm sets."""
    from rlcomm.worker.configure import driver_env

    env = driver_env(
        exclude={"RANK": "0"},
        environ={"A": "1", "RAY_JOB_ID": "x", "CUDA_VISIBLE_DEVICES": "0", "RANK": "5"},
    )
    assert env == {"A": "1"}


# -- malformed per-worker lists (test_run_all_workers_multiple_data_*) ---------------------


def test_multiple_data_fewer_data_than_workers(two_workers):
    """test_worker_groups.py::test_run_all_workers_multiple_data_fewer_data_than_workers:
    a per-worker list shorter than the workers raises AssertionError (NeMo-RL's type)."""
    with pytest.raises(AssertionError):
        two_workers.run_all_workers_multiple_data("record_call", data=["only one"])
    with pytest.raises(AssertionError):
        two_workers.run_all_workers_multiple_data("record_call", data=["a", "b"], x=["c"])
    with pytest.raises(AssertionError):
        two_workers.run_all_workers_multiple_data("record_call")
    assert issubclass(PerWorkerDataError, ValueError)


def test_multiple_data_kwargs_and_positional_extension(two_workers):
    """test_worker_groups.py::test_run_all_workers_multiple_data_1d_sharding with kwargs;
    rlcomm's extension keeps positional per-worker lists (NeMo-RL asserts on them)."""
    refs = two_workers.run_all_workers_multiple_data(
        "record_call", data=["w0", "w1"], common_kwargs={"common": "c"}
    )
    assert ray.get(refs, timeout=60) == [(0, "w0"), (1, "w1")]
    refs = two_workers.run_all_workers_multiple_data("record_call", ["p0", "p1"])
    assert ray.get(refs, timeout=60) == [(0, "p0"), (1, "p1")]
    refs = two_workers.run_all_workers_single_data("record_call", "same", "extra")
    assert ray.get(refs, timeout=60) == [(0, "same"), (1, "same")]


def test_multiple_data_with_rank_0_only_axes_takes_one_entry_per_called_worker(cluster):
    """NeMo-RL's run_all_workers_multiple_data with run_rank_0_only_axes: the lists hold
    one entry per called worker."""
    group = RecordingActor.create_group().launch(
        cluster, NodePlacementStrategy([0] * 4), name=_name("dp_tp"),
        sharding=NamedSharding([[0, 1], [2, 3]], ["dp", "tp"]),
    )
    try:
        refs = group.run_all_workers_multiple_data(
            "record_call", data=["d0", "d1"], run_rank_0_only_axes=["tp"]
        )
        assert ray.get(refs, timeout=60) == [(0, "d0"), (2, "d1")]
        refs = group.run_all_workers_multiple_data(  # per-worker lists still work
            "record_call", data=["a", "b", "c", "d"], run_rank_0_only_axes=["tp"]
        )
        assert ray.get(refs, timeout=60) == [(0, "a"), (2, "c")]
        with pytest.raises(AssertionError):
            group.run_all_workers_multiple_data("record_call", data=["x"], run_rank_0_only_axes=["tp"])
    finally:
        group.shutdown(force=True)


def test_sharded_data_malformed_raises_value_error(two_workers):
    """NeMo-RL's run_all_workers_sharded_data raises ValueError for axes that are both
    sharded and replicated, and for unknown axes."""
    with pytest.raises(ValueError):
        two_workers.run_all_workers_sharded_data(
            "record_call", data=["a", "b"], in_sharded_axes=["data"], replicate_on_axes=["data"]
        )
    with pytest.raises(ValueError):
        two_workers.run_all_workers_sharded_data("record_call", data=["a", "b"], in_sharded_axes=["nope"])
