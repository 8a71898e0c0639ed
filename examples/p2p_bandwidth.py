"""A quick point-to-point bandwidth table: rlcomm beside raw Gloo and the Ray object
store, sizes 4 B to 16 MiB (a short run of ``scripts/bench_p2p.py``; run that script for
the full sweep to 1 GiB, JSON output and the plot).

Run: ``python examples/p2p_bandwidth.py``.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))

import bench_p2p  # noqa: E402
import ray.cloudpickle  # noqa: E402

# The worker processes cannot import scripts/ by name: ship the module's classes by value.
ray.cloudpickle.register_pickle_by_value(bench_p2p)

if __name__ == "__main__":
    bench_p2p.main(
        ["--sizes", "4,1024,65536,1048576,16777216", "--repeats", "3", "--latency-repeats", "5",
         "--cold-repeats", "1", "--target-bytes", str(64 << 20), *sys.argv[1:]]
    )
