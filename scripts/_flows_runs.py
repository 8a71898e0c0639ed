"""The driver side of ``bench_flows.py``'s worker-group flows, written once for rlcomm
and for RLinf (their ``create_group().launch(...)``, ``execute_on`` and handles match;
only ``wait`` differs: rlcomm's takes a timeout, RLinf's does not).

Each function launches its own worker groups and shuts them down before it returns.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

NTENSORS = 16
COLD = 3  # the first transfers of a fresh pair, reported on their own


@dataclass
class Runtime:
    """How one library launches a worker group of the flows' worker class on nodes,
    waits on a handle (bounded where it can be), makes a channel, and ends each."""

    launch: Callable[[str, list[int]], Any]
    close: Callable[[Any], None]
    wait: Callable[[Any], Any]
    make_channel: Callable[[str], Any]
    close_channel: Callable[[Any], None]


def warmup_items(n: int, batch: int) -> int:
    """Items in the warm-up round of a stream case: as many as a timed round (at least
    a batch), so that pools and segments have grown to what the stream needs before the
    clock starts (a channel's fresh worker otherwise pays for new memory in the first
    timed round)."""
    return max(n, batch)


def sync_record(path: str, receivers: int, nbytes: int, secs: list[float]) -> dict[str, Any]:
    return {"path": path, "receivers": receivers, "bytes": nbytes, "samples_s": secs,
            "median_s": statistics.median(secs), "min_s": min(secs), "max_s": max(secs)}


def rollout_record(path: str, nbytes: int, secs: list[float]) -> dict[str, Any]:
    """``secs``: every transfer of a fresh pair, in order (the first ``COLD`` are cold)."""
    cold, warm = secs[:COLD], secs[COLD:] or secs[-1:]
    return {"path": path, "bytes": nbytes, "samples_s": secs, "cold_s": cold,
            "cold_GBps": nbytes * len(cold) / sum(cold) / 1e9,
            "warm_median_s": statistics.median(warm),
            "warm_GBps": nbytes / statistics.median(warm) / 1e9}


def _pairs(starts: list[float], ends_per_rank: list[list[float]]) -> list[float]:
    """Seconds from each start to the moment the last receiver held that transfer."""
    return [max(col) - s for s, col in zip(starts, zip(*ends_per_rank))]


def weight_sync(rt: Runtime, prefix: str, label: str, receivers: list[int], nbytes: int,
                iters: int, raw_gloo: bool = False,
                handover: bool = False) -> list[dict[str, Any]]:
    """One trainer -> ``n`` receivers for each ``n``: ``broadcast``, ``send`` to each and,
    with ``raw_gloo``, a torch.distributed Gloo broadcast over the same processes; with
    ``handover``, both again with a state dict made by ``rlcomm.empty``. The first of
    ``iters`` transfers is a warm-up, not reported."""
    src, dst = f"{prefix}_trainer", f"{prefix}_rollout"
    nmax = max(receivers)
    wait = rt.wait
    trainer = rt.launch(src, [0])
    rollout = rt.launch(dst, [0] * nmax)
    out = []
    try:
        wait(trainer.setup_flows())
        wait(rollout.setup_flows())
        cases = [(False, "broadcast", "broadcast"), (False, "send", "send to each")]
        if handover:
            cases += [(True, "broadcast", "broadcast, rlcomm.empty"),
                      (True, "send", "send, rlcomm.empty")]
        for shared, how, name in cases:
            wait(trainer.make_payload(nbytes, NTENSORS, True, shared))
            for n in receivers:
                ranks = list(range(n))
                ends = rollout.execute_on(*ranks).sync_receiver(how, src, dst, ranks, iters)
                starts = trainer.sync_source(how, src, dst, ranks, iters)
                secs = _pairs(wait(starts)[0], wait(ends))[1:]
                out.append(sync_record(f"{label} {name}", n, nbytes, secs))
                print(f"  {label} {name:12s} -> {n} receivers: "
                      f"{out[-1]['median_s'] * 1e3:8.1f} ms", flush=True)
            wait(rollout.drop())
        if raw_gloo:
            wait(rollout.make_payload(nbytes, NTENSORS, False))
            addr, port = wait(trainer.free_endpoint())[0]
            inits = [trainer.init_gloo(addr, port, 0, nmax + 1, receivers)]
            inits += [rollout.execute_on(r).init_gloo(addr, port, r + 1, nmax + 1, receivers)
                      for r in range(nmax)]
            for h in inits:
                wait(h)
            for n in receivers:
                ends = rollout.execute_on(*range(n)).gloo_broadcast(n, iters)
                starts = trainer.gloo_broadcast(n, iters)
                secs = _pairs(wait(starts)[0], wait(ends))[1:]
                out.append(sync_record("raw gloo broadcast", n, nbytes, secs))
                print(f"  raw gloo broadcast    -> {n} receivers: "
                      f"{out[-1]['median_s'] * 1e3:8.1f} ms", flush=True)
            wait(trainer.gloo_teardown())
            wait(rollout.gloo_teardown())
    finally:
        rt.close(trainer)
        rt.close(rollout)
    return out


def rollout_pair(rt: Runtime, name: str, path: str, label: str, nbytes: int,
                 iters: int, handover: bool = False) -> dict[str, Any]:
    """A fresh pair (rank 0 produces, rank 1 consumes) moves the rollout dict ``iters``
    times over ``path`` ("send/recv", "channel" or "raw gloo"); with ``handover`` the
    dict is made by ``rlcomm.empty``."""
    wait = rt.wait
    pair = rt.launch(name, [0, 0])
    channel = None
    try:
        wait(pair.setup_flows())
        wait(pair.execute_on(0).make_payload(nbytes, NTENSORS, True, handover))
        if path == "raw gloo":
            wait(pair.execute_on(1).make_payload(nbytes, NTENSORS, False))
            wait(pair.init_gloo_pair())
        if path == "channel":
            channel = rt.make_channel(f"{name}_ch")
            wait(pair.use_channel(f"{name}_ch"))
        ends = pair.execute_on(1).roll_receiver(path, name, iters, f"{name}_ch")
        starts = pair.execute_on(0).roll_source(path, name, iters, f"{name}_ch")
        secs = _pairs(wait(starts)[0], wait(ends))
        if path == "raw gloo":
            wait(pair.gloo_teardown())
        wait(pair.drop())
    finally:
        rt.close(pair)
        if channel is not None:
            rt.close_channel(channel)
    rec = rollout_record(label, nbytes, secs)
    print(f"  {label:24s} cold {rec['cold_GBps']:6.2f} GB/s, warm {rec['warm_GBps']:6.2f} GB/s",
          flush=True)
    return rec
