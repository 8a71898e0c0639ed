#!/usr/bin/env python
"""The flows an RL loop runs, rlcomm beside what users would pick instead, in one run.

- **Weight sync**: a state dict (256 MiB, 16 float32 tensors) from 1 trainer to 1, 4 and
  8 rollout workers on one node, timed from the trainer's start until the last receiver
  holds it (each receiver keeps it until the next sync). rlcomm ``broadcast`` and
  ``send`` to each (async sends, then wait); Ray ``ray.put`` once and one ``ray.get`` per
  receiver, zero-copy (actors started with ``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1``) and
  default (the same calls without it: the tensors are unpickled, a copy each); a raw
  ``torch.distributed`` Gloo broadcast (tensor by tensor, into preallocated tensors)
  over the same processes as rlcomm's.
- **Rollout dict**: 1 GiB (16 tensors) producer -> consumer. rlcomm ``send/recv``, an
  rlcomm ``Channel`` (``put``/``get``), Ray zero-copy and default (as above), raw Gloo
  ``send/recv`` into a preallocated dict. Each path runs on a fresh pair of processes:
  COLD is the first three transfers (the receiver keeps each result until the next),
  WARM the median of the later ones.
- **Channel stream**: 1 KiB ``bytes`` and 1 MiB tensors, one at a time (``put``/``get``)
  and batched (async puts, ``get_batch``), items/s and GB/s: rlcomm ``Channel`` and
  ``ray.util.queue.Queue`` (both through ``bench_channel.py``'s producer and consumer),
  and pyzmq ipc PUSH/PULL (batched: multipart messages) as the floor, if installed.
- **RLinf 0.3.0**, if installed (``pip install --no-deps rlinf==0.3.0 omegaconf``): its
  ``broadcast``, ``send``, ``send/recv`` and ``Channel`` on the same flows, run by
  ``_flows_rlinf.py`` in a subprocess joined to this run's Ray (RLinf's ``Cluster`` makes
  its own ``ray.init``).

A transfer starts only once every receiver has said it is ready (a one-element message);
each figure is the median of ``--repeats`` transfers after a warm-up (in a stream, a
warm-up round as long as a timed one). A baseline that cannot run is skipped with a
note. Ratios are rlcomm over the baseline in speed (>1: rlcomm is faster). Every wait is
bounded; only the actors and the subprocess this run started are ended.

    python scripts/bench_flows.py --json bench_flows.json --plot bench_flows.png
    python scripts/bench_flows.py --quick      # small sizes, few repeats: a few minutes
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _flows_runs  # noqa: E402
import _flows_workers  # noqa: E402
import bench_channel  # noqa: E402
import ray  # noqa: E402
import ray.cloudpickle  # noqa: E402
import torch  # noqa: E402
from _flows_runs import rollout_record, sync_record  # noqa: E402
from _flows_workers import WAIT_S, FlowOps, RayFlowPeer, ZmqPeer  # noqa: E402
from bench_p2p import human_size  # noqa: E402

from rlcomm import Channel, Cluster, NodePlacementStrategy, Worker  # noqa: E402

# The worker processes cannot import scripts/ by name: ship these modules by value.
for _module in (_flows_workers, bench_channel):
    ray.cloudpickle.register_pickle_by_value(_module)

ZERO_COPY = {"env_vars": {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}}
RAY_PATHS = (("ray zero-copy", ZERO_COPY), ("ray default", None))
KINDS = {"1 KiB": 1 << 10, "1 MiB": 1 << 20}
FLOWS = ("weight_sync", "rollout", "stream", "rlinf")
FULL = {"sync_mib": 256, "receivers": [1, 4, 8], "rollout_mib": 1024, "repeats": 5,
        "stream_scale": 1.0, "stream_repeats": 3}
QUICK = {"sync_mib": 16, "receivers": [1, 2], "rollout_mib": 64, "repeats": 2,
         "stream_scale": 0.1, "stream_repeats": 1}


class FlowWorker(FlowOps, Worker):
    """An rlcomm worker that runs the flows (see ``_flows_workers.FlowOps``)."""


class FlowBench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.results: dict[str, list[dict[str, Any]]] = {
            "weight_sync": [], "rollout": [], "stream": [], "skipped": []}
        ray.init(address="local", include_dashboard=False, logging_level="ERROR")
        self.cluster = Cluster(num_nodes=1)
        self.rt = _flows_runs.Runtime(
            launch=lambda name, nodes: FlowWorker.create_group().launch(
                self.cluster, NodePlacementStrategy(nodes), name=name),
            close=lambda group: group.shutdown(),
            wait=lambda handle: handle.wait(timeout=WAIT_S),
            make_channel=lambda name: Channel.create(name, cluster=self.cluster),
            close_channel=lambda channel: channel.shutdown(),
        )

    def skip(self, flow: str, path: str, why: str) -> None:
        print(f"  skipped {path} ({flow}): {why}", flush=True)
        self.results["skipped"].append({"flow": flow, "path": path, "why": why})

    # -- the flows -----------------------------------------------------------------------

    def weight_sync(self) -> None:
        a = self.args
        nbytes, iters = a.sync_mib << 20, a.repeats + 1
        print(f"weight sync: {human_size(nbytes)} state dict, 1 -> {a.receivers}", flush=True)
        self.results["weight_sync"] += _flows_runs.weight_sync(
            self.rt, "flows", "rlcomm", a.receivers, nbytes, iters, raw_gloo=True,
            handover=True)
        for label, env in RAY_PATHS:
            actors = self._ray_actors(env, max(a.receivers) + 1)
            try:
                ray.get(actors[0].make_payload.remote(nbytes, _flows_runs.NTENSORS), timeout=WAIT_S)
                for n in a.receivers:
                    secs = ray.get(actors[0].push.remote(actors[1:n + 1], iters), timeout=WAIT_S)
                    self.results["weight_sync"].append(sync_record(label, n, nbytes, secs[1:]))
                    print(f"  {label:25s} -> {n} receivers: "
                          f"{statistics.median(secs[1:]) * 1e3:8.1f} ms", flush=True)
            finally:
                self._kill(actors)

    def rollout(self) -> None:
        a = self.args
        nbytes, iters = a.rollout_mib << 20, _flows_runs.COLD + a.repeats
        print(f"rollout dict: {human_size(nbytes)}, producer -> consumer", flush=True)
        for i, (path, label, shared) in enumerate((
                ("send/recv", "rlcomm send/recv", False),
                ("send/recv", "rlcomm send, rlcomm.empty", True),
                ("channel", "rlcomm channel", False),
                ("raw gloo", "raw gloo send/recv", False))):
            self.results["rollout"].append(_flows_runs.rollout_pair(
                self.rt, f"flows_pair{i}", path, label, nbytes, iters, shared))
        for label, env in RAY_PATHS:
            actors = self._ray_actors(env, 2)
            try:
                ray.get(actors[0].make_payload.remote(nbytes, _flows_runs.NTENSORS), timeout=WAIT_S)
                secs = ray.get(actors[0].push.remote(actors[1:], iters), timeout=WAIT_S)
            finally:
                self._kill(actors)
            rec = rollout_record(label, nbytes, secs)
            self.results["rollout"].append(rec)
            print(f"  {label:24s} cold {rec['cold_GBps']:6.2f} GB/s, "
                  f"warm {rec['warm_GBps']:6.2f} GB/s", flush=True)

    def stream(self) -> None:
        a = self.args
        print("channel stream (through bench_channel.py's producer and consumer)", flush=True)
        cases = stream_cases(a.stream_scale)
        chan = bench_channel.Bench(argparse.Namespace(repeats=a.stream_repeats))
        try:
            for kind, mode, n, batch in cases:
                for backend in ("rlcomm", "ray"):
                    chan.throughput(backend, mode, kind, n, batch,
                                    _flows_runs.warmup_items(n, batch))
        finally:
            chan.shutdown()
        self._p2p_stream(cases)
        for r in chan.records:
            path = "rlcomm channel" if r["backend"] == "rlcomm" else "ray.util.queue"
            self.results["stream"].append(stream_record(path, r["kind"], r["mode"], r["items"],
                                                        r["batch"], [r["items_per_s"]]))
        if importlib.util.find_spec("zmq") is None:
            self.skip("stream", "pyzmq ipc", "pyzmq is not installed (pip install pyzmq)")
            return
        address = f"ipc://{tempfile.gettempdir()}/rlcomm_flows_{os.getpid()}.ipc"
        pull, push = (ZmqPeer.options(num_cpus=0).remote(address) for _ in range(2))
        try:
            for kind, mode, n, batch in cases:
                rates = []
                for rep in range(a.stream_repeats + 1):
                    count = n if rep else _flows_runs.warmup_items(n, batch)
                    end = pull.pull.remote(count, batch)
                    start = ray.get(push.push.remote(kind, count, batch), timeout=WAIT_S)
                    if rep:
                        rates.append(count / (ray.get(end, timeout=WAIT_S) - start))
                    else:
                        ray.get(end, timeout=WAIT_S)
                self.results["stream"].append(stream_record("pyzmq ipc", kind, mode, n, batch,
                                                            rates))
                print(f"  pyzmq ipc {mode:8s} {kind}: {statistics.median(rates):10.0f} items/s",
                      flush=True)
        finally:
            ray.get([p.close.remote() for p in (pull, push)], timeout=60)
            self._kill([pull, push])

    def _p2p_stream(self, cases: list[tuple[str, str, int, int]]) -> None:
        """The one-at-a-time cases over plain send/recv (what a channel is held to)."""
        pair = self.rt.launch("flows_stream", [0, 0])
        try:
            self.rt.wait(pair.setup_flows())
            for kind, mode, n, batch in cases:
                if mode != "one":
                    continue
                rates = []
                for rep in range(self.args.stream_repeats + 1):
                    count = n if rep else _flows_runs.warmup_items(n, batch)
                    end = pair.execute_on(1).p2p_stream_get("flows_stream", count)
                    start = self.rt.wait(
                        pair.execute_on(0).p2p_stream_put("flows_stream", kind, count))[0]
                    stop = self.rt.wait(end)[0]
                    if rep:
                        rates.append(count / (stop - start))
                self.results["stream"].append(
                    stream_record("rlcomm send/recv", kind, mode, n, batch, rates))
                print(f"  rlcomm send/recv one      {kind}: {statistics.median(rates):10.0f} "
                      "items/s", flush=True)
        finally:
            self.rt.close(pair)

    def rlinf(self) -> None:
        """RLinf's paths, in a subprocess joined to this Ray (bounded, then ended)."""
        if self.args.no_rlinf:
            self.skip("all", "rlinf", "--no-rlinf")
            return
        if importlib.util.find_spec("rlinf") is None:
            self.skip("all", "rlinf", "RLinf is not installed "
                      "(pip install --no-deps rlinf==0.3.0 omegaconf)")
            return
        print("RLinf 0.3.0 (subprocess)", flush=True)
        config = {k: getattr(self.args, k) for k in (*FULL, "flows")}
        config["flows"] = [f for f in self.args.flows if f != "rlinf"] or list(FLOWS[:3])
        config["stream_cases"] = stream_cases(self.args.stream_scale)
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rlinf.json")
            env = dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address)
            script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_flows_rlinf.py")
            proc = subprocess.Popen([sys.executable, script, json.dumps(config), out], env=env,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=self.args.rlinf_timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=60)
                rc = None
            if rc != 0 or not os.path.exists(out):
                why = "timed out" if rc is None else f"exited with {rc}"
                self.skip("all", "rlinf", f"the RLinf run {why} (its output is above)")
                return
            with open(out) as f:
                got = json.load(f)
        for flow in ("weight_sync", "rollout", "stream"):
            self.results[flow] += got.get(flow, [])
        for note in got.get("skipped", []):
            self.skip(note["flow"], note["path"], note["why"])

    def _ray_actors(self, runtime_env: dict | None, n: int) -> list[Any]:
        actors = [RayFlowPeer.options(runtime_env=runtime_env).remote() for _ in range(n)]
        ray.get([p.ping.remote() for p in actors], timeout=WAIT_S)
        return actors

    @staticmethod
    def _kill(actors: list[Any]) -> None:
        for actor in actors:
            ray.kill(actor, no_restart=True)

    def run(self) -> None:
        for flow in self.args.flows:
            getattr(self, flow)()

    def dump(self, path: str) -> None:
        machine = {"cpus": os.cpu_count(), "loadavg": os.getloadavg(),
                   "python": platform.python_version(), "ray": ray.__version__,
                   "torch": torch.__version__}
        with open(path, "w") as f:
            json.dump({"args": vars(self.args), "machine": machine, **self.results}, f, indent=1)


def stream_cases(scale: float) -> list[tuple[str, str, int, int]]:
    """(kind, mode, items, batch): bench_channel.py's default counts times ``scale``, but
    1 MiB streams five and two times as long (at 100 items a round took 15-25 ms here:
    the start of a stream, not its steady rate)."""
    def n(x: int) -> int:
        return max(20, int(x * scale))

    return [("1 KiB", "one", n(2000), 1), ("1 KiB", "batched", n(20000), 100),
            ("1 MiB", "one", n(1000), 1), ("1 MiB", "batched", n(2000), 10)]


def stream_record(path: str, kind: str, mode: str, items: int, batch: int,
                  rates: list[float]) -> dict[str, Any]:
    rate = statistics.median(rates)
    return {"path": path, "kind": kind, "mode": mode, "items": items, "batch": batch,
            "items_per_s": rate, "GBps": rate * KINDS[kind] / 1e9}


# -- tables and the plot ----------------------------------------------------------------------

def _ratio(ours: float | None, theirs: float | None) -> str:
    return f"{ours / theirs:.2f}x" if ours and theirs else "-"


def tables(results: dict[str, list[dict[str, Any]]]) -> str:
    lines: list[str] = []
    sync = results["weight_sync"]
    if sync:
        ns = sorted({r["receivers"] for r in sync})
        paths = list(dict.fromkeys(r["path"] for r in sync))
        ms = {(r["path"], r["receivers"]): r["median_s"] * 1e3 for r in sync}
        size = human_size(sync[0]["bytes"])
        lines += [f"\nWeight sync, {size} state dict: ms until every receiver holds it (median)",
                  f"{'path':28s}" + "".join(f"{f'1 -> {n}':>12s}" for n in ns)]
        lines += [f"{p:28s}" + "".join(f"{ms[p, n]:12.1f}" if (p, n) in ms else f"{'-':>12s}"
                                       for n in ns) for p in paths]
        lines.append("rlcomm speed over each baseline (>1: rlcomm faster)")
        for ours in ("rlcomm broadcast", "rlcomm send to each",
                     "rlcomm broadcast, rlcomm.empty"):
            for base in (p for p in paths if not p.startswith("rlcomm")):
                lines.append(f"  {ours} vs {base:22s}"[:60].ljust(60) + "".join(
                    f"{_ratio(ms.get((base, n)), ms.get((ours, n))):>10s}" for n in ns))
    roll = results["rollout"]
    if roll:
        lines += [f"\nRollout dict, {human_size(roll[0]['bytes'])}, producer -> consumer "
                  "(cold: first three transfers of a fresh pair; warm: median of the rest)",
                  f"{'path':24s}{'cold 1, 2, 3 (s)':>24s}{'cold GB/s':>11s}{'warm s':>9s}"
                  f"{'warm GB/s':>11s}"]
        for r in roll:
            cold = ", ".join(f"{s:.3f}" for s in r["cold_s"])
            lines.append(f"{r['path']:24s}{cold:>24s}{r['cold_GBps']:11.2f}"
                         f"{r['warm_median_s']:9.3f}{r['warm_GBps']:11.2f}")
        by = {r["path"]: r for r in roll}
        lines.append("rlcomm speed over each baseline (cold, warm)")
        for ours in ("rlcomm send/recv", "rlcomm send, rlcomm.empty", "rlcomm channel"):
            for base in (p for p in by if not p.startswith("rlcomm")):
                if ours in by:
                    lines.append(f"  {ours} vs {base:24s}"[:56].ljust(56)
                                 + f"{_ratio(by[ours]['cold_GBps'], by[base]['cold_GBps']):>9s}"
                                 + f"{_ratio(by[ours]['warm_GBps'], by[base]['warm_GBps']):>9s}")
    stream = results["stream"]
    if stream:
        paths = list(dict.fromkeys(r["path"] for r in stream))
        cases = list(dict.fromkeys((r["kind"], r["mode"], r["batch"]) for r in stream))
        rate = {(r["path"], r["kind"], r["mode"]): r for r in stream}
        lines += ["\nChannel stream, producer -> consumer: items/s (GB/s)",
                  f"{'case':22s}" + "".join(f"{p:>22s}" for p in paths)]
        for kind, mode, batch in cases:
            label = f"{kind}, " + ("one at a time" if mode == "one" else f"batches of {batch}")
            cells = []
            for p in paths:
                r = rate.get((p, kind, mode))
                cells.append(f"{r['items_per_s']:.0f} ({r['GBps']:.3g})" if r else "-")
            lines.append(f"{label:22s}" + "".join(f"{c:>22s}" for c in cells))
        lines.append("rlcomm channel speed over each baseline")
        for base in (p for p in paths if p != "rlcomm channel"):
            cells = []
            for kind, mode, _ in cases:
                ours, theirs = rate.get(("rlcomm channel", kind, mode)), rate.get((base, kind, mode))
                cells.append(_ratio(ours and ours["items_per_s"], theirs and theirs["items_per_s"]))
            lines.append(f"  vs {base:18s}" + "".join(f"{c:>22s}" for c in cells))
    if results["skipped"]:
        lines.append("\nSkipped: " + "; ".join(f"{s['path']} ({s['why']})"
                                               for s in results["skipped"]))
    return "\n".join(lines)


def plot(results: dict[str, list[dict[str, Any]]], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for path in dict.fromkeys(r["path"] for r in results["weight_sync"]):
        pts = sorted((r["receivers"], r["median_s"] * 1e3) for r in results["weight_sync"]
                     if r["path"] == path)
        left.plot(*zip(*pts), "-o" if path.startswith("rlcomm") else "--s", label=path)
    if results["weight_sync"]:
        left.set_title(f"Weight sync, {human_size(results['weight_sync'][0]['bytes'])}")
    left.set_xlabel("receivers")
    left.set_yscale("log")  # the zero-copy paths sit orders of magnitude below the rest
    left.set_ylabel("ms until every receiver holds it (log)")
    left.grid(True, alpha=0.3)
    left.legend(fontsize=8)
    roll = results["rollout"]
    xs = range(len(roll))
    right.bar([x - 0.2 for x in xs], [r["cold_GBps"] for r in roll], 0.4, label="cold")
    right.bar([x + 0.2 for x in xs], [r["warm_GBps"] for r in roll], 0.4, label="warm")
    right.set_xticks(list(xs), [r["path"] for r in roll], rotation=30, ha="right", fontsize=8)
    right.set_yscale("log")
    right.set_ylabel("GB/s (log)")
    if roll:
        right.set_title(f"Rollout dict, {human_size(roll[0]['bytes'])}")
    right.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    parser.add_argument("--sync-mib", type=int, help="state dict size (default 256)")
    parser.add_argument("--receivers", type=lambda s: [int(x) for x in s.split(",")],
                        help="comma-separated receiver counts (default 1,4,8)")
    parser.add_argument("--rollout-mib", type=int, help="rollout dict size (default 1024)")
    parser.add_argument("--repeats", type=int, help="timed transfers per case (default 5)")
    parser.add_argument("--stream-scale", type=float,
                        help="channel stream item counts, times bench_channel.py's (default 1)")
    parser.add_argument("--stream-repeats", type=int, help="timed runs per stream case")
    parser.add_argument("--flows", type=lambda s: s.split(","),
                        default=list(FLOWS),
                        help="which of weight_sync,rollout,stream,rlinf to run")
    parser.add_argument("--no-rlinf", action="store_true", help="skip RLinf even if installed")
    parser.add_argument("--rlinf-timeout", type=float, default=1800,
                        help="seconds the RLinf subprocess may take")
    parser.add_argument("--json", help="write every number here")
    parser.add_argument("--plot", help="write a PNG here (weight sync vs receivers, rollout)")
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    args = parse_args(argv)
    start = time.monotonic()
    bench = FlowBench(args)
    try:
        bench.run()
    finally:
        print(tables(bench.results))
        if args.json:
            bench.dump(args.json)
        if args.plot:
            plot(bench.results, args.plot)
        print(f"\n({time.monotonic() - start:.0f} s, load average {os.getloadavg()[0]:.1f} "
              f"on {os.cpu_count()} CPUs)")
        ray.shutdown()


if __name__ == "__main__":
    main()
