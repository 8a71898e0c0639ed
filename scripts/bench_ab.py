"""Same-run A/B of a benchmark across source trees (git worktrees of two commits, say).

    python scripts/bench_ab.py p2p --trees before=../wt-old,after=. --rounds 2 --out /tmp/ab \
        -- --sizes 4,1024,1048576 --repeats 5 --cold-repeats 1

Runs each tree's own ``scripts/bench_p2p.py`` (or ``bench_channel.py``) in turn, alternating
the order every round, with this Python and ``PYTHONPATH`` set to the tree (Ray workers
started by the benchmark inherit it, so they import that tree's rlcomm too). Then prints
every case's median over the rounds per tree, and each tree's ratio to the first.
Figures on a shared machine swing: compare only within one such run.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
from typing import Any

SCRIPTS = {"p2p": "scripts/bench_p2p.py", "channel": "scripts/bench_channel.py"}
VALUES = ("median", "min", "max", "items_per_s", "GBps", "seconds")


def records(path: str) -> list[dict[str, Any]]:
    """A benchmark JSON's records, latency figures of bench_channel included."""
    with open(path) as f:
        data = json.load(f)
    if "throughput" not in data:
        return data["records"]
    out = list(data["throughput"])
    for lat in data.get("latency") or []:
        out += [{"kind": lat["kind"], "metric": k, "median": v}
                for k, v in lat.items() if k.endswith("_us")]
    return out


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bench", choices=sorted(SCRIPTS))
    parser.add_argument("--trees", required=True, help="name=path,name=path,...")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="bench_ab")
    args = parser.parse_args(argv)
    trees = dict(x.split("=", 1) for x in args.trees.split(","))
    os.makedirs(args.out, exist_ok=True)
    for r in range(args.rounds):
        for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
            tree = os.path.abspath(trees[name])
            path = f"{args.out}/{args.bench}-{name}-{r}.json"
            cmd = [sys.executable, f"{tree}/{SCRIPTS[args.bench]}", "--json", path, *extra]
            print(name, r, " ".join(cmd), flush=True)
            env = dict(os.environ, PYTHONPATH=tree)
            done = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True)
            with open(f"{args.out}/{args.bench}-{name}-{r}.log", "w") as f:
                f.write(done.stdout + done.stderr)
            if done.returncode:
                print(f"  failed (exit {done.returncode}): see the .log", flush=True)
    vals: dict[tuple, dict[str, list[float]]] = collections.defaultdict(
        lambda: collections.defaultdict(list))
    for name in trees:
        for r in range(args.rounds):
            path = f"{args.out}/{args.bench}-{name}-{r}.json"
            if not os.path.exists(path):
                continue
            for rec in records(path):
                key = tuple((k, rec[k]) for k in sorted(rec)
                            if isinstance(rec[k], (str, int)) and k not in VALUES)
                value = rec.get("median", rec.get("items_per_s"))
                if isinstance(value, (int, float)):
                    vals[key][name].append(value)
    names = list(trees)
    print(f"{'case':70s}" + "".join(f"{n:>12s}" for n in names)
          + "".join(f"{n + '/' + names[0]:>16s}" for n in names[1:]))
    for key, by_tree in vals.items():
        if not all(by_tree.get(n) for n in names):
            continue
        med = [statistics.median(by_tree[n]) for n in names]
        label = ", ".join(f"{k}={v}" for k, v in key)
        print(f"{label[:70]:70s}" + "".join(f"{m:12.4g}" for m in med)
              + "".join(f"{m / med[0] if med[0] else float('nan'):16.2f}" for m in med[1:]))


if __name__ == "__main__":
    main()
