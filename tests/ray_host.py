"""A Ray of its own for processes that attach to it (``RAY_ADDRESS``), held by this
helper process, which uses no rlcomm: a job attached to it makes rlcomm's registry, and
the registry ends with that job, as on a cluster where each job is its own driver.

    python -m tests.ray_host

Prints, as JSON on the first line, the Ray's address and the ``RAY_AUTH_*`` variables
that ``ray.init`` set (an attaching process needs them to send this user's token), then
answers each line ``named`` read from stdin with the JSON list of the named actors alive
(``[namespace, name]`` pairs). At the end of stdin it shuts its Ray down and exits.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    import ray

    ray.init(address="local", include_dashboard=False, logging_level="ERROR", num_cpus=2)
    try:
        auth = {k: v for k, v in os.environ.items() if k.startswith("RAY_AUTH_")}
        print(json.dumps({"address": ray.get_runtime_context().gcs_address, "env": auth}),
              flush=True)
        for line in sys.stdin:
            if line.strip() == "named":
                named = ray.util.list_named_actors(all_namespaces=True)
                print(json.dumps(sorted([a["namespace"], a["name"]] for a in named)),
                      flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
