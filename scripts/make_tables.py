#!/usr/bin/env python
"""Write the benchmark tables of the docs from the benchmarks' JSON, in one command.

Every table of figures in ``README.md`` and ``docs/*.md`` sits between two markers::

    <!-- make_tables: NAME -->
    ...written by this script...
    <!-- /make_tables -->

and is made from the JSON a benchmark script wrote (``docs/bench_*.json``) by the
renderer of that NAME below. So the README's headline and the full tables of
``docs/performance.md`` come from the same numbers and cannot drift apart: after a new
run (``python scripts/bench_loop.py --json docs/bench_loop.json``, say), run

    python scripts/make_tables.py            # rewrite every marked region
    python scripts/make_tables.py --check    # exit 1 if one is out of date (CI runs it)

One region is special: ``readme-compare`` holds the README's comparison table, whose
feature rows are written by hand. The script keeps those rows and rewrites only the rows
that start with ``Measured``.

Ratios are always taken within one run of one script, never across runs.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import sys
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
REGION = re.compile(
    r"(?P<open><!-- make_tables: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(?P<close><!-- /make_tables -->)",
    re.S,
)
#: Said of runs whose JSON does not describe the machine.
DEV_MACHINE = "the 2-core development machine (x86-64, 24 GiB)"
MIB = 1 << 20


def load(name: str) -> dict[str, Any]:
    with open(os.path.join(DOCS, name)) as f:
        return json.load(f)


def num(x: float | None) -> str:
    """A figure with about three significant digits."""
    if x is None:
        return "-"
    a = abs(x)
    if a >= 100:
        return f"{x:.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 1:
        return f"{x:.2f}"
    return f"{x:#.3g}"


def ratio(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.0f}x" if x >= 100 else f"{x:.1f}x"


def size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def machine_of(data: dict[str, Any], load: bool = True) -> str:
    """Where a run ran, from its JSON's ``machine`` (a phrase, or a dict of facts); with
    ``load``, the load average the JSON recorded."""
    m = data.get("machine")
    if isinstance(m, str):
        return m
    if not isinstance(m, dict):
        return DEV_MACHINE
    facts = [f"Python {m['python']}" if "python" in m else None,
             f"torch {m['torch']}" if "torch" in m else None,
             f"Ray {m['ray']}" if "ray" in m else None]
    load_avg = m.get("loadavg") or m.get("loadavg_start")
    if load_avg and load:
        end = m.get("loadavg_end")
        facts.append(f"load average {load_avg[0]:.1f} at the start"
                     + (f", {end[0]:.1f} at the end" if end else ""))
    text = ", ".join(f for f in facts if f)
    if m.get("note"):
        return f"{m['note']} ({text})"
    if m.get("cpus") == 2:
        return f"{DEV_MACHINE[:-1]}; {text})"
    return f"a machine of {m.get('cpus', '?')} cores ({text})"


def caption(script: str, json_name: str, data: dict[str, Any], extra: str = "") -> str:
    return (f"*One run of `scripts/{script}`{extra} on {machine_of(data)}; "
            f"`docs/{json_name}`.*\n\n")


# -- scripts/bench_p2p.py ----------------------------------------------------------------

P2P_BASELINES = ("raw gloo", "ray actor call", "ray zero-copy", "ray direct transport (gloo)",
                 "ray compiled graph")


def render_p2p() -> str:
    data = load("bench_p2p.json")
    recs = data["records"]
    by = {(r["path"], r["metric"], r["bytes"]): r["median"] for r in recs}
    paths = list(dict.fromkeys(r["path"] for r in recs if r["metric"] == "GB/s"))
    sizes = sorted({r["bytes"] for r in recs if r["metric"] == "GB/s" and r["bytes"] >= 64 << 10})
    out = caption("bench_p2p.py", "bench_p2p.json", data)
    out += table(["GB/s, median"] + [size(s) for s in sizes],
                 [[p] + [num(by.get((p, "GB/s", s))) for s in sizes] for p in paths])
    rows = []
    for base in P2P_BASELINES:
        cells = []
        for s in sizes:
            ours, theirs = by.get(("send/recv", "GB/s", s)), by.get((base, "GB/s", s))
            cells.append(ratio(ours / theirs) if ours and theirs else "-")
        rows.append([base] + cells)
    out += "\n\n" + table(["send/recv faster than"] + [size(s) for s in sizes], rows)
    lat_paths = list(dict.fromkeys(r["path"] for r in recs if r["metric"] == "latency_us"))
    lat_sizes = sorted({r["bytes"] for r in recs if r["metric"] == "latency_us"})
    out += "\n\n" + table(["one-way latency, µs (half a round trip)"] + [size(s) for s in lat_sizes],
                          [[p] + [num(by.get((p, "latency_us", s))) for s in lat_sizes]
                           for p in lat_paths])
    rows = []
    for ours, theirs in (("send/recv", "raw shm"), ("send/recv (bytes)", "raw shm"),
                         ("send/recv (dict)", "raw shm"), ("send_tensor/recv_tensor", "raw shm"),
                         ("ray compiled graph", "send/recv"),
                         ("ray compiled graph (bytes)", "send/recv (bytes)")):
        cells = []
        for s in lat_sizes:
            a, b = by.get((ours, "latency_us", s)), by.get((theirs, "latency_us", s))
            cells.append(ratio(a / b) if a and b else "-")
        if any(c != "-" for c in cells):
            rows.append([f"{ours} / {theirs}"] + cells)
    if rows:
        out += "\n\n" + table(["one-way latency, ratio"] + [size(s) for s in lat_sizes], rows)
    cold = [r for r in recs if r["metric"] == "cold_ms"]
    if cold:
        out += (f"\n\nThe first `send/recv` between a fresh pair (the connection made on "
                f"first contact included): {num(cold[0]['median'])} ms.")
    return out


# -- scripts/bench_copy.py ---------------------------------------------------------------

COPY_COLUMNS = (("torch copy_", "`torch` `copy_`"), ("memmove", "`memmove`"),
                ("stream", "non-temporal stores"),
                ("torch copy_, 2 threads (before)", "`copy_` split over 2 threads"),
                ("rlcomm bulk_copy, 2 threads", "rlcomm's copy (2 threads)"))


def render_copy() -> str:
    data = load("bench_copy.json")
    rows = []
    for case in data["seconds_per_copy"]:
        rows.append([case["case"]] + [num(case["bytes"] / case[key] / 1e9) if key in case else "-"
                                      for key, _ in COPY_COLUMNS])
    return (caption("bench_copy.py", "bench_copy.json", {}, f" ({data['rounds']} rounds)")
            + table(["GB/s, one copy"] + [label for _, label in COPY_COLUMNS], rows))


# -- scripts/bench_broadcast.py ----------------------------------------------------------


def render_broadcast() -> str:
    data = load("bench_broadcast.json")
    recs = data["records"]
    receivers = sorted({r["receivers"] for r in recs})
    by = {(r["path"], r["receivers"]): r for r in recs}
    paths = list(dict.fromkeys(r["path"] for r in recs))
    rows = [[f"`{p}`" if p.startswith("rlcomm") else p] + [
        f"{num(by[p, n]['median'] * 1e3)} ({num(by[p, n]['first'] * 1e3)})" if (p, n) in by else "-"
        for n in receivers] for p in paths]
    for base in ("rlcomm send to each", "ray put + zero-copy gets"):
        rows.append([f"`broadcast` faster than {base.removeprefix('rlcomm ')}"] + [
            ratio(by[base, n]["median"] / by["rlcomm broadcast", n]["median"])
            if (base, n) in by and ("rlcomm broadcast", n) in by else "-" for n in receivers])
    mib = recs[0]["bytes"] // MIB
    return (caption("bench_broadcast.py", "bench_broadcast.json", data)
            + table([f"ms, {mib} MiB state dict, median (first round)"]
                    + [f"1 → {n}" for n in receivers], rows))


def _find(records: list[dict], **match: Any) -> dict | None:
    return next((r for r in records if all(r.get(k) == v for k, v in match.items())), None)


def weight_sync_tables(data: dict[str, Any]) -> str:
    """The tables of ``bench_broadcast.py --sweep``: GB/s delivered by size and pool, the
    memory each case took, the broadcast against the default pool's, the TP case."""
    recs = data["records"]
    sized = [r for r in recs if r["sweep"] == "size"]
    sizes = sorted({r["bytes"] for r in sized})
    pools = list(dict.fromkeys(r["pool"] for r in sized))
    ways = list(dict.fromkeys(r["way"] for r in sized))
    cols = [f"{round(b / MIB)} MiB" for b in sizes]
    out = []

    def grid(cell: Callable[[dict], str]) -> list[list[str]]:
        """A row per way and pool, a cell per size (``-`` where nothing was measured)."""
        rows = []
        for way in ways:
            for pool in pools:
                found = [_find(sized, way=way, pool=pool, bytes=b) for b in sizes]
                rows.append([f"{way}, pool {pool}"] + ["-" if r is None else cell(r)
                                                       for r in found])
        return rows

    if sized:
        out.append(table(["GB/s delivered to 2 receivers (first round)"] + cols, grid(
            lambda r: f"{num(r['gbps'])} ({num(r['bytes'] / r['first'] / 1e9)})")))
        out.append(table(
            ["peak shared memory / each receiver's RSS beyond its dict, MiB"] + cols,
            grid(lambda r: f"{round(r['peak_shm'] / MIB)} / " + ", ".join(
                str(round(g / MIB)) for g in r["receiver_rss_growth"]))))
        if "default" in pools:
            rows = []
            for pool in pools:
                cells = []
                for b in sizes:
                    r = _find(sized, way=ways[0], pool=pool, bytes=b)
                    base = _find(sized, way=ways[0], pool="default", bytes=b)
                    cells.append(f"{r['gbps'] / base['gbps']:.2f}x" if r and base else "-")
                rows.append([f"pool {pool}"] + cells)
            out.append(table([f"{ways[0]}: GB/s against the default pool's"] + cols, rows))
    tp = [r for r in recs if r["sweep"] == "tp"]
    if tp:
        rows = [[r["way"], f"{num(r['median'])} ({num(r['first'])})", num(r["gbps"]),
                 ", ".join(str(round(b / MIB)) for b in r["receiver_bytes_read"])] for r in tp]
        out.append(table([f"{round(tp[0]['bytes'] / MIB)} MiB of 2-D weights to "
                          f"{tp[0]['receivers']} receivers", "seconds (first round)", "GB/s",
                          "MiB each receiver read out of shared memory"], rows))
    if not all(r.get("checked", True) for r in recs):
        out.append("**Some received values were wrong.**")
    return "\n\n".join(out)


def render_weight_sync() -> str:
    data = load("bench_weight_sync.json")
    return caption("bench_broadcast.py --sweep", "bench_weight_sync.json", data) + \
        weight_sync_tables(data)


def multinode_sync_table(data: dict[str, Any]) -> str:
    """The streamed weight sync of ``bench_multinode.py --sync-mib`` (empty: not run)."""
    sync = [r for r in data["records"] if r["sweep"] == "sync"]
    if not sync:
        return ""
    bound = next(r for r in sync if r["way"].startswith("bound"))
    streamed = [r for r in sync if r is not bound]
    rows = []
    for r in [*streamed, bound]:
        growth, links = r.get("receiver_rss_growth"), r.get("link_bytes")
        rows.append([r["way"], f"{num(r['median'])} ({num(r['first'])})",
                     num(r["bytes"] / r["median"] / 1e9),
                     "-" if growth is None else ", ".join(f"{g / MIB:.2f}" for g in growth),
                     "-" if links is None else ", ".join(f"{b / MIB:.0f}" for b in links)])
    for r in streamed:
        rows.append([f"{r['way']} / bound", f"{r['median'] / bound['median']:.2f}x", "", "",
                     ""])
    first = streamed[0]
    text = table([f"{round(first['bytes'] / MIB)} MiB to {first['nodes'] - 1} nodes, "
                  f"pool {round(first['pool'] / MIB)} MiB", "seconds (first round)", "GB/s",
                  "each receiver's peak RSS beyond its dict, MiB",
                  "each node's link carried, MiB"], rows)
    if not all(r.get("checked", True) for r in sync):
        text += "\n\n**Some received values were wrong.**"
    return text


PIPELINED, STAR, RAY, BOUND = (
    "rlcomm pipelined", "rlcomm star (Gloo)", "Ray object store", "bound: one node-to-node send",
)
MULTINODE_WAYS = [PIPELINED, STAR, RAY, BOUND]


def multinode_median(records: list[dict], sweep: str, way: str, **match: Any) -> float | None:
    """The median of ``bench_multinode.py``'s record of ``sweep`` and ``way`` that matches
    (None: none)."""
    for r in records:
        if r["sweep"] == sweep and r["way"] == way and all(r.get(k) == v for k, v in match.items()):
            return r["median"]
    return None


def _fixed(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def multinode_tables(result: dict) -> str:
    """The run's tables (markdown) and the acceptance figures under them."""
    records, args = result["records"], result["args"]
    if not any(r["sweep"] == "nodes" for r in records):
        return multinode_sync_table(result)
    counts = sorted({r["nodes"] for r in records if r["sweep"] == "nodes"})
    nbytes = next((r["bytes"] for r in records if r["sweep"] == "nodes"), 0)
    lines = [
        f"Seconds until the last of the N - 1 receiving nodes holds the {size(nbytes)} state "
        f"dict ({args['tensors']} float32 tensors), median of {args['repeats']} rounds "
        f"(first round in brackets), links shaped to {args['rate']} each way:",
        "",
        "| N (nodes) | " + " | ".join(str(n) for n in counts) + " |",
        "| --- |" + " --- |" * len(counts),
    ]
    for way in MULTINODE_WAYS:
        cells = []
        for n in counts:
            med = multinode_median(records, "nodes", way, nodes=n)
            first = next((r["first"] for r in records if r["sweep"] == "nodes"
                          and r["way"] == way and r["nodes"] == n), None)
            cells.append("-" if med is None else f"{med:.2f} ({first:.2f})")
        lines.append(f"| {way} | " + " | ".join(cells) + " |")
    ratio = [("pipelined / bound", PIPELINED, BOUND), ("star / pipelined", STAR, PIPELINED),
             ("Ray / pipelined", RAY, PIPELINED)]
    for name, a, b in ratio:
        cells = []
        for n in counts:
            x, y = multinode_median(records, "nodes", a, nodes=n), multinode_median(records, "nodes", b, nodes=n)
            cells.append("-" if not x or not y else f"{x / y:.2f}x")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    growth = []
    for prev, n in zip(counts, counts[1:]):
        x, y = multinode_median(records, "nodes", PIPELINED, nodes=n), multinode_median(records, "nodes", PIPELINED,
                                                                 nodes=prev)
        growth.append("-" if not x or not y else f"{(x / y - 1) * 100:+.0f} %")
    lines.append("| pipelined, change from N - 1 | - | " + " | ".join(growth) + " |")
    sw = sorted({r["bytes"] for r in records if r["sweep"] == "switch"})
    if sw:
        lines += ["", "Where the chain starts to pay (`RLCOMM_BCAST_CHAIN_MIN_BYTES`): "
                  "milliseconds, median:", "",
                  "| payload | " + " | ".join(size(b) for b in sw) + " |",
                  "| --- |" + " --- |" * len(sw)]
        for n in sorted({r["nodes"] for r in records if r["sweep"] == "switch"}):
            for way in (PIPELINED, STAR):
                lines.append(f"| {way}, N = {n} | " + " | ".join(_fixed(
                    (multinode_median(records, "switch", way, bytes=b, nodes=n) or 0) * 1e3, 1) for b in sw
                ) + " |")
    ch = sorted({r["chunk"] for r in records if r["sweep"] == "chunk"})
    if ch:
        n = max(r["nodes"] for r in records if r["sweep"] == "chunk")
        lines += ["", f"The chain's record size (`RLCOMM_BCAST_CHUNK_BYTES`), {size(nbytes)} to "
                  f"{n - 1} nodes, seconds, median:", "",
                  "| record | " + " | ".join(size(c) for c in ch) + " |",
                  "| --- |" + " --- |" * len(ch),
                  f"| {PIPELINED} | " + " | ".join(
                      _fixed(multinode_median(records, "chunk", PIPELINED, chunk=c), 3) for c in ch) + " |"]
    sync = multinode_sync_table(result)
    if sync:
        lines += ["", sync]
    return "\n".join(lines)


def multinode_acceptance(result: dict) -> dict[str, Any]:
    """The figures the docs quote from one run (None where a point is missing)."""
    records = result["records"]
    counts = sorted({r["nodes"] for r in records if r["sweep"] == "nodes"})
    last = counts[-1] if counts else None

    def at(way: str, n: int | None) -> float | None:
        return None if n is None else multinode_median(records, "nodes", way, nodes=n)

    pipe = {n: at(PIPELINED, n) for n in counts}
    steps = [pipe[b] / pipe[a] - 1 for a, b in zip(counts, counts[1:]) if pipe[a] and pipe[b]]
    out: dict[str, Any] = {"nodes": last}
    p, bound, ray_t = at(PIPELINED, last), at(BOUND, last), at(RAY, last)
    out["pipelined_over_bound"] = None if not p or not bound else p / bound
    # The bound is measured at every N: the median of all its rounds, for one noisy point.
    every = [x for r in records if r["sweep"] == "nodes" and r["way"] == BOUND
             for x in r["samples"]]
    out["bound_all_rounds"] = statistics.median(every) if every else None
    out["pipelined_over_bound_all_rounds"] = (
        None if not p or not every else p / statistics.median(every))
    out["growth_per_node_max"] = max(steps) if steps else None
    out["ray_over_pipelined"] = None if not p or not ray_t else ray_t / p
    return out


def render_multinode() -> str:
    return multinode_section(load("bench_multinode.json"))


def multinode_section(data: dict[str, Any]) -> str:
    """The figures section of ``docs/multinode.md``: ``bench_multinode.py``'s tables and
    the figures the page quotes."""
    host = data["host"]
    acc = multinode_acceptance(data)
    return (
        f"*One run of `scripts/bench_multinode.py`: emulated nodes (network namespaces, "
        f"`tc`-shaped links) on one {host['cpus']}-core machine, Python {host['python']}; "
        f"`docs/bench_multinode.json`.*\n\n{multinode_tables(data)}\n\n"
        f"At {acc['nodes']} nodes the pipelined broadcast took "
        f"{_fixed(acc['pipelined_over_bound'])}x one node-to-node transfer measured beside it "
        f"({_fixed(acc['pipelined_over_bound_all_rounds'])}x the median of all "
        f"{_fixed(acc['bound_all_rounds'])} s transfers of the run), Ray's object store "
        f"{_fixed(acc['ray_over_pipelined'])}x the pipelined broadcast; from one node count to "
        f"the next the pipelined broadcast grew by at most "
        f"{_fixed((acc['growth_per_node_max'] or 0) * 100, 0)} %."
    )


def render_multinode_sync() -> str:
    data = load("bench_multinode_sync.json")
    mib = round(data["records"][0]["bytes"] / MIB)
    return (caption(f"bench_multinode.py --sync-mib {mib}", "bench_multinode_sync.json", data)
            + multinode_sync_table(data))


# -- scripts/bench_channel.py ------------------------------------------------------------


def render_channel() -> str:
    data = load("bench_channel.json")
    tp = {(r["backend"], r["mode"], r["kind"]): r for r in data["throughput"]}
    kinds = list(dict.fromkeys(r["kind"] for r in data["throughput"]))
    rows = []
    for kind in kinds:
        for mode, label in (("one", "one at a time"), ("batched", "batches"),
                            ("pipelined", "async puts, one get at a time")):
            ours = tp.get(("rlcomm", mode, kind))
            theirs = tp.get(("ray", mode if mode != "pipelined" else "one", kind))
            if ours is None:
                continue
            what = f"{label} of {ours['batch']}" if mode == "batched" else label
            if mode == "pipelined":
                what += " (Ray: one at a time)"
            rows.append([f"{kind}, {what}", num(ours["items_per_s"]),
                         num(theirs["items_per_s"]) if theirs else "-",
                         ratio(ours["items_per_s"] / theirs["items_per_s"]) if theirs else "-"])
    out = caption("bench_channel.py", "bench_channel.json", data)
    out += table(["items/s", "rlcomm channel", "ray.util.queue", "rlcomm faster"], rows)
    graph_rows = []
    for kind in kinds:
        for mode, label in (("one", "one at a time"), ("pipelined", "pipelined")):
            ours, theirs = tp.get(("rlcomm", mode, kind)), tp.get(("ray compiled graph", mode, kind))
            if ours is not None and theirs is not None:
                if mode == "pipelined":
                    label += f" ({theirs['batch']} in flight; rlcomm: async puts)"
                graph_rows.append([f"{kind}, {label}", num(ours["items_per_s"]),
                                   num(theirs["items_per_s"]),
                                   ratio(ours["items_per_s"] / theirs["items_per_s"])])
    if graph_rows:
        out += "\n\n" + table(
            ["items/s", "rlcomm channel", "Ray Compiled Graph", "rlcomm faster"], graph_rows)
    lat = data.get("latency") or []
    if lat:
        out += "\n\n" + table(
            ["µs per item", "send + recv round trip", "channel `put` alone", "channel `get` alone",
             "Ray queue `put`", "Ray queue `get`"],
            [[r["kind"], num(r["p2p_round_trip_us"]), num(r["rlcomm_put_us"]),
              num(r["rlcomm_get_us"]), num(r["ray_put_us"]), num(r["ray_get_us"])] for r in lat])
    return out


# -- scripts/bench_flows.py --------------------------------------------------------------


def _flows_sync(data: dict[str, Any]) -> dict[tuple[str, int], float]:
    return {(r["path"], r["receivers"]): r["median_s"] for r in data["weight_sync"]}


def render_flows() -> str:
    data = load("bench_flows.json")
    sync = _flows_sync(data)
    receivers = sorted({n for _, n in sync})
    paths = list(dict.fromkeys(p for p, _ in sync))
    rows = [[p] + [num(sync[p, n] * 1e3) if (p, n) in sync else "-" for n in receivers]
            for p in paths]
    for ours, base in (("rlcomm broadcast", "ray zero-copy"),
                       ("rlcomm broadcast, rlcomm.empty", "ray zero-copy"),
                       ("rlcomm broadcast", "rlinf broadcast")):
        if any((base, n) in sync for n in receivers):
            rows.append([f"{ours} faster than {base}"] + [
                ratio(sync[base, n] / sync[ours, n]) if (base, n) in sync and (ours, n) in sync
                else "-" for n in receivers])
    mib = data["weight_sync"][0]["bytes"] // MIB
    out = caption("bench_flows.py", "bench_flows.json", data,
                  f" (`--repeats {data['args']['repeats']} --stream-scale "
                  f"{data['args']['stream_scale']}`)")
    out += table([f"weight sync, {mib} MiB, ms until all hold it"]
                 + [f"1 → {n}" for n in receivers], rows)
    roll = data["rollout"]
    gib = roll[0]["bytes"] / (1 << 30)
    out += "\n\n" + table(
        [f"rollout dict, {gib:g} GiB", "first three transfers, s", "warm, s", "warm GB/s"],
        [[r["path"], ", ".join(num(x) for x in r["cold_s"]), num(r["warm_median_s"]),
          num(r["warm_GBps"])] for r in roll])
    stream = {(r["path"], r["kind"], r["mode"]): r for r in data["stream"]}
    spaths = list(dict.fromkeys(r["path"] for r in data["stream"]))
    cases = list(dict.fromkeys((r["kind"], r["mode"], r["batch"]) for r in data["stream"]))
    srows = []
    for kind, mode, batch in cases:
        label = f"{kind}, one at a time" if mode == "one" else f"{kind}, batches of {batch}"
        srows.append([label] + [num(stream[p, kind, mode]["items_per_s"])
                                if (p, kind, mode) in stream else "-" for p in spaths])
    out += "\n\n" + table(["channel stream, items/s"] + spaths, srows)
    for s in data.get("skipped", []):
        out += f"\n\nSkipped: {s['path']} ({s['flow']}): {s['why']}."
    return out


# -- scripts/bench_codec.py -------------------------------------------------------------


def render_codec() -> str:
    data = load("bench_codec.json")
    facts = f"Python {data['python']}, torch {data['torch']}, msgspec {data['msgspec']}"
    if data.get("loadavg"):
        facts += f", load average {data['loadavg'][0]:.1f} at the end"
    rows = [[r["step"], num(r["us"]), str(r["bytes"]) if r["bytes"] else "-"]
            for r in data["rows"]]
    return (f"*One run of `scripts/bench_codec.py` on {DEV_MACHINE[:-1]}; {facts}); "
            f"`docs/bench_codec.json`. The message: a {data['message']}.*\n\n"
            + table(["per message", "µs", "header bytes"], rows))


# -- scripts/bench_gpu.py ----------------------------------------------------------------


def render_gpu_sync() -> str:
    """The weight sync and per-message figures of one run on a lent GPU machine."""
    data = load("bench_gpu_sync.json")
    ns = sorted({r["receivers"] for r in data["sync"]})
    by = {(r["path"], r["receivers"]): r["ms"] for r in data["sync"]}
    paths = list(dict.fromkeys(r["path"] for r in data["sync"]))
    bound = next(p for p in paths if p.startswith("bound"))
    handles = next(p for p in paths if p.startswith("CUDA IPC handles"))
    rows = [[p] + [num(by[p, n]) if (p, n) in by else "-" for n in ns] for p in paths]
    broadcast = paths[0]
    rows.append([f"{broadcast}: times the bound"]
                + [ratio(by[broadcast, n] / by[bound, n]) for n in ns])
    rows.append([f"{broadcast}: handles through Ray ÷ rlcomm (> 1: rlcomm faster)"]
                + [ratio(by[handles, n] / by[broadcast, n]) for n in ns])
    msgs = table(["per message, one GPU", "µs"],
                 [[r["path"], num(r["us"])] for r in data["message"]])
    return (f"*One run on {data['machine']}; `docs/bench_gpu_sync.json`. {data['note']}*\n\n"
            + table(["ms, 1 GiB bf16 state dict"] + [f"N = {n}" for n in ns], rows)
            + "\n\n" + msgs)


def render_gpu_handoff() -> str:
    """One small CUDA message between two processes of one GPU, with and without MPS
    (figures under MPS only from a ``scripts/gpu_check`` run that measured them)."""
    data = load("bench_gpu_sync.json")
    rows = [[f"rlcomm {r['path']}, two workers on {data['machine'].split(' (')[0]}",
             f"{num(r['us'])} µs",
             f"{num(r['mps_us'])} µs" if r.get("mps_us") is not None else "not measured"]
            for r in data["message"]]
    return ("*From `docs/bench_gpu_sync.json`; the rlcomm rows are the run of "
            "[Performance](performance.md#gpu).*\n\n"
            + table(["what was measured", "without MPS", "under MPS"], rows))


# -- scripts/bench_loop.py ---------------------------------------------------------------


def _loop_runs(data: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(r["policy"], r["loop"]): r for r in data["runs"]}


def _policy_label(run: dict[str, Any]) -> str:
    n, nbytes = run["parameters"], run["weight_bytes"]
    count = f"{num(n / 1e6)} M parameters" if n >= 1e6 else f"{n} parameters"
    weights = f"{nbytes / 1e6:.0f} MB" if nbytes >= 1e7 else f"{nbytes / 1e3:.1f} KB"
    return f"{run['policy']} ({count}, {weights})"


def loop_table(data: dict[str, Any]) -> str:
    """The full table of one ``bench_loop.py`` run (also printed by the script): each
    figure the median of the rounds with their range, then each loop's ratio to plain
    Ray, as rlcomm ÷ Ray (> 1: rlcomm better), with the range of the rounds' ratios
    (round i of a loop against round i of plain Ray; the loops ran in alternating order)."""
    runs = _loop_runs(data)
    policies = list(dict.fromkeys(p for p, _ in runs))
    loops = list(dict.fromkeys(lp for _, lp in runs))
    keys = (("env_steps_per_s", True), ("update_ms", False), ("weight_sync_ms", False),
            ("cpu_s_per_1k_steps", False))
    rows = []
    for policy in policies:
        for loop in loops:
            run = runs.get((policy, loop))
            if run is None:
                continue
            rows.append([_policy_label(run), loop]
                        + [_with_spread(run, key) for key, _ in keys]
                        + [num(run["summary"]["steps_per_update"])])
        base = runs.get((policy, "plain Ray"))
        for loop in loops:
            run = runs.get((policy, loop))
            if loop == "plain Ray" or run is None or base is None:
                continue
            rows.append(["", f"{loop} ÷ plain Ray"]
                        + [_ratio_spread(run, base, key, higher) for key, higher in keys] + [""])
    return table(["policy", "loop", "env steps/s", "update, ms", "weight sync, ms",
                  "CPU s per 1000 env steps", "env steps per update"], rows)


def _with_spread(run: dict[str, Any], key: str) -> str:
    """The median, and with several rounds the range of the rounds in parentheses."""
    values = [r["summary"][key] for r in run.get("rounds", []) if r["summary"].get(key)]
    text = num(run["summary"][key])
    return f"{text} ({num(min(values))}-{num(max(values))})" if len(values) > 1 else text


def _better(ours: float | None, theirs: float | None, higher: bool) -> float | None:
    """How many times better ``ours`` is than ``theirs`` (> 1: ours better)."""
    if not ours or not theirs:
        return None
    return ours / theirs if higher else theirs / ours


def _ratio_spread(run: dict[str, Any], base: dict[str, Any], key: str, higher: bool) -> str:
    """The ratio of the medians, and the range of the paired rounds' ratios."""
    text = ratio(_better(run["summary"].get(key), base["summary"].get(key), higher))
    pairs = [_better(a["summary"].get(key), b["summary"].get(key), higher)
             for a, b in zip(run.get("rounds", []), base.get("rounds", []))]
    pairs = [v for v in pairs if v is not None]
    if len(pairs) > 1:
        text += f" ({min(pairs):.1f}-{max(pairs):.1f})"
    return text


def render_loop() -> str:
    data = load("bench_loop.json")
    a = data["args"]
    rounds = a.get("rounds", 1)
    extra = (f" ({a['rollout_workers']} rollout workers, {a['trainers']} trainer ranks, "
             f"{a['updates']} updates of which the first {a['warmup']} are not timed"
             + (f"; {rounds} rounds of each loop in alternating order, medians" if rounds > 1
                else "") + ")")
    return (caption("bench_loop.py", "bench_loop.json", data, extra)
            + "*The rows \"÷ plain Ray\" are ratios, > 1 where the loop did better than "
            "plain Ray (more steps/s, fewer ms, less CPU): the ratio of the medians, then "
            "the range of the rounds' ratios.*\n\n" + loop_table(data))


# -- the README's comparison table -------------------------------------------------------


def measured_rows() -> list[list[str]]:
    """The comparison table's measured rows. On CPUs: `bench_flows.py`, one run, RLinf and
    plain Ray beside rlcomm (verl and NeMo-RL pass rollout data through Ray's object store,
    and sync weights only on GPUs, by CUDA IPC handles or NCCL), and `bench_multinode.py`.
    On one GPU: the lent machine's run, rlcomm beside CUDA IPC handles through Ray."""
    data = load("bench_flows.json")
    sync = _flows_sync(data)
    n = max(r for _, r in sync)
    mib = data["weight_sync"][0]["bytes"] // MIB
    roll = {r["path"]: r for r in data["rollout"]}
    stream = {(r["path"], r["kind"], r["mode"]): r["items_per_s"] for r in data["stream"]}

    def ms(path: str) -> str:
        return f"{num(sync[path, n] * 1e3)} ms" if (path, n) in sync else "-"

    def warm(path: str) -> str:
        return f"{num(roll[path]['warm_GBps'])} GB/s" if path in roll else "-"

    def items(path: str) -> str:
        v = stream.get((path, "1 KiB", "one"))
        return f"{num(v)}/s" if v else "-"

    gpu_only = "GPU only (CUDA IPC handles or NCCL)"
    return [
        [f"Measured: weight sync, {mib} MiB to {n} workers of one node, CPU",
         ms("rlinf broadcast"), gpu_only, gpu_only,
         f"{ms('rlcomm broadcast')}; {ms('rlcomm broadcast, rlcomm.empty')} with `rlcomm.empty` "
         f"(plain Ray: {ms('ray zero-copy')})"],
        ["Measured: a 1 GiB rollout dict, producer to consumer (warm)",
         warm("rlinf send/recv"), f"Ray: {warm('ray zero-copy')}", f"Ray: {warm('ray zero-copy')}",
         warm("rlcomm send/recv")],
        ["Measured: a channel of 1 KiB items, one put and one get at a time",
         items("rlinf channel"), "-", "-",
         f"{items('rlcomm channel')} (a Ray queue: {items('ray.util.queue')})"],
        multinode_row(),
        gpu_row(),
    ]


def gpu_row() -> list[str]:
    """Weight sync on one GPU from the lent machine's run, beside IPC handles through Ray."""
    data = load("bench_gpu_sync.json")
    n = max(r["receivers"] for r in data["sync"])
    at = {r["path"]: r["ms"] for r in data["sync"] if r["receivers"] == n}
    ours = next(v for p, v in at.items() if p.startswith("rlcomm broadcast"))
    handles = next(v for p, v in at.items() if p.startswith("CUDA IPC handles"))
    return [f"Measured: weight sync, 1 GiB bf16 to {n} workers on one GPU (H200)", "-",
            f"IPC handles through Ray: {num(handles)} ms", "-", f"{num(ours)} ms"]


def multinode_row() -> list[str]:
    """Weight sync from one node to the most nodes of `bench_multinode.py`'s run, beside
    Ray's object store and one node-to-node transfer of the same run."""
    data = load("bench_multinode.json")
    nodes = [r for r in data["records"] if r["sweep"] == "nodes"]
    n = max(r["nodes"] for r in nodes)
    mib = nodes[0]["bytes"] // MIB
    pipe, ray_s, bound = (multinode_median(nodes, "nodes", way, nodes=n)
                          for way in (PIPELINED, RAY, BOUND))
    return [f"Measured: weight sync, {mib} MiB from one node to {n - 1} others, "
            f"{data['args']['rate'].replace('gbit', ' Gbit/s').replace('mbit', ' Mbit/s')} links",
            "-", "GPU only (NCCL)", "GPU only (NCCL)",
            f"{num(pipe)} s, {pipe / bound:.2f}x one node-to-node transfer "
            f"(plain Ray: {num(ray_s)} s)"]


def rewrite_compare(body: str) -> str:
    lines = body.rstrip("\n").split("\n")
    kept = [ln for ln in lines if not ln.startswith("| Measured")]
    rows = ["| " + " | ".join(r) + " |" for r in measured_rows()]
    return "\n".join(kept + rows) + "\n"


RENDERERS: dict[str, Callable[[], str]] = {
    "p2p": render_p2p,
    "copy": render_copy,
    "broadcast": render_broadcast,
    "weight-sync": render_weight_sync,
    "multinode": render_multinode,
    "multinode-sync": render_multinode_sync,
    "channel": render_channel,
    "flows": render_flows,
    "gpu-sync": render_gpu_sync,
    "gpu-handoff": render_gpu_handoff,
    "codec": render_codec,
    "loop": render_loop,
}


def rewrite(text: str, where: str) -> str:
    def one(m: re.Match) -> str:
        name = m.group("name")
        if name == "readme-compare":
            body = rewrite_compare(m.group("body"))
        elif name in RENDERERS:
            body = RENDERERS[name]().rstrip("\n") + "\n"
        else:
            raise SystemExit(f"{where}: no renderer for region {name!r} "
                             f"(known: {', '.join(sorted(RENDERERS))}, readme-compare)")
        return m.group("open") + body + m.group("close")

    return REGION.sub(one, text)


def pages() -> list[str]:
    return [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(DOCS, "**", "*.md"),
                                                               recursive=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if a region is not what the JSON gives")
    args = parser.parse_args()
    stale = []
    for path in pages():
        with open(path) as f:
            text = f.read()
        if "<!-- make_tables:" not in text:
            continue
        new = rewrite(text, os.path.relpath(path, ROOT))
        if new == text:
            continue
        stale.append(os.path.relpath(path, ROOT))
        if not args.check:
            with open(path, "w") as f:
                f.write(new)
    if args.check and stale:
        print(f"make_tables: out of date with docs/bench_*.json: {', '.join(stale)}; "
              "run `python scripts/make_tables.py`", file=sys.stderr)
        return 1
    verb = "in sync" if args.check else ("rewrote " + ", ".join(stale) if stale else "nothing to do")
    print(f"make_tables: {verb}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

