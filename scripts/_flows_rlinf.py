"""RLinf 0.3.0 on ``bench_flows.py``'s flows: its ``broadcast``, ``send``, ``send/recv``
and ``Channel``, with the same worker code as rlcomm's run (``_flows_workers.FlowOps``).

Started by ``bench_flows.py`` as ``python _flows_rlinf.py CONFIG_JSON OUT_JSON`` with
``RAY_ADDRESS`` set to that run's Ray: RLinf's ``Cluster`` must make its own
``ray.init`` (and would otherwise join whatever Ray it finds). Writes its records to
OUT_JSON. Its actors belong to this process's Ray job and end with it.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _flows_runs  # noqa: E402
import _flows_workers  # noqa: E402
import bench_channel  # noqa: E402
import ray.cloudpickle  # noqa: E402
from _flows_workers import FlowOps  # noqa: E402
from rlinf.scheduler import Channel, Cluster, NodePlacementStrategy, Worker  # noqa: E402

for _module in (_flows_workers, bench_channel):
    ray.cloudpickle.register_pickle_by_value(_module)

KINDS = {"1 KiB": 1 << 10, "1 MiB": 1 << 20}


class RlinfFlowWorker(FlowOps, Worker):
    """An RLinf worker that runs the flows; RLinf's channel waits take no timeout."""

    channel_kwargs: dict[str, Any] = {}

    def __init__(self) -> None:
        super().__init__()


def _close_channel(channel: Any) -> None:
    channel._channel_worker_group._close()


def stream(rt: _flows_runs.Runtime, cases: list[list[Any]], repeats: int) -> list[dict[str, Any]]:
    """RLinf's channel stream: the same cases as bench_flows' (put/get, async puts +
    get_batch), one fresh channel per case, a tenth of the items (RLinf moves ~100 items/s
    here: the full counts would take most of an hour)."""
    cases = [[kind, mode, max(20, n // 10), batch] for kind, mode, n, batch in cases]
    pair = rt.launch("rlinf_flows_stream", [0, 0])
    out = []
    try:
        rt.wait(pair.setup_flows())
        for i, (kind, mode, n, batch) in enumerate(cases):
            name = f"rlinf_flows_stream_ch{i}"
            channel = rt.make_channel(name)
            try:
                rt.wait(pair.use_channel(name))
                rates = []
                for rep in range(repeats + 1):
                    count = n if rep else _flows_runs.warmup_items(n, batch)
                    end = pair.execute_on(1).stream_get(name, count, batch)
                    start = rt.wait(pair.execute_on(0).stream_put(name, kind, count, batch))[0]
                    if rep:
                        rates.append(count / (rt.wait(end)[0] - start))
                    else:
                        rt.wait(end)
            finally:
                _close_channel(channel)
            rate = statistics.median(rates)
            out.append({"path": "rlinf channel", "kind": kind, "mode": mode, "items": n,
                        "batch": batch, "items_per_s": rate, "GBps": rate * KINDS[kind] / 1e9})
            print(f"  rlinf channel {mode:8s} {kind}: {rate:10.0f} items/s", flush=True)
    finally:
        rt.close(pair)
    return out


def main() -> None:
    config, out_path = json.loads(sys.argv[1]), sys.argv[2]
    cluster = Cluster(num_nodes=1)
    rt = _flows_runs.Runtime(
        launch=lambda name, nodes: RlinfFlowWorker.create_group().launch(
            cluster, NodePlacementStrategy(nodes), name=name),
        close=lambda group: group._close(),
        wait=lambda handle: handle.wait(),
        make_channel=lambda name: Channel.create(name),
        close_channel=_close_channel,
    )
    results: dict[str, list[dict[str, Any]]] = {"weight_sync": [], "rollout": [], "stream": []}
    if "weight_sync" in config["flows"]:
        results["weight_sync"] = _flows_runs.weight_sync(
            rt, "rlinf_flows", "rlinf", config["receivers"], config["sync_mib"] << 20,
            config["repeats"] + 1)
    if "rollout" in config["flows"]:
        for i, (path, label) in enumerate((("send/recv", "rlinf send/recv"),
                                           ("channel", "rlinf channel"))):
            results["rollout"].append(_flows_runs.rollout_pair(
                rt, f"rlinf_flows_pair{i}", path, label, config["rollout_mib"] << 20,
                _flows_runs.COLD + config["repeats"]))
    if "stream" in config["flows"]:
        results["stream"] = stream(rt, config["stream_cases"], config["stream_repeats"])
    with open(out_path, "w") as f:
        json.dump(results, f)
    time.sleep(0.5)  # let RLinf's log lines flush before the driver prints its tables


if __name__ == "__main__":
    main()
