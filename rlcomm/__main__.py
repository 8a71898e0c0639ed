"""``python -m rlcomm status``: what every rlcomm process of a running job is doing.

Attaches to the Ray at ``RAY_ADDRESS`` (or ``--address``; the Ray started on this machine
when neither is given), asks every worker, channel worker and driver of the rlcomm job
there for its report at once (see :mod:`rlcomm.comm.status`), and prints them as tables,
or as JSON with ``--json``. A process that does not answer within ``--timeout`` seconds is
listed as not answering. Exit status: 0 when every process answered, 1 when some did
not, 2 when no job could be looked at.
"""

from __future__ import annotations

import argparse
import os
import sys

from rlcomm.errors import RlcommError


def _token_auth_if_token_found() -> None:
    """Ray turns token authentication on for a cluster ``ray.init()`` starts, and a
    process that attaches by ``"auto"`` finds the token itself; one that attaches to an
    address it was given sends the token only under ``RAY_AUTH_MODE=token``. So, as the
    auto path does, a token this user has (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``
    or ``~/.ray/auth_token``) turns token mode on, unless ``RAY_AUTH_MODE`` says how."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    if os.environ.get("RAY_AUTH_TOKEN") or os.path.isfile(path):
        os.environ["RAY_AUTH_MODE"] = "token"


def _status(args: argparse.Namespace) -> int:
    _token_auth_if_token_found()  # before Ray is imported: it reads its mode then
    import ray

    from rlcomm.cluster import connect_ray
    from rlcomm.comm.status import job_status
    from rlcomm.settings import get_settings

    address = args.address or os.environ.get("RAY_ADDRESS") or "auto"
    try:
        # No worker's logs are wanted here: the output is the status alone.
        connect_ray(address, get_settings().connect_timeout, {"log_to_driver": False},
                    start_local=False)
    except RlcommError as exc:
        print(f"rlcomm status: {exc}", file=sys.stderr)
        return 2
    try:
        status = job_status(timeout=args.timeout)
        if args.json:
            print(status.to_json())
        else:
            print(status.table(recent=args.recent), end="")
        sys.stdout.flush()
    except RlcommError as exc:
        print(f"rlcomm status: {exc}", file=sys.stderr)
        return 2
    finally:
        # Detached now, Ray's exit hook does not wait its half second for logs to print.
        ray.shutdown()
    return 0 if all(w["state"] == "ok" for w in status.workers) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlcomm", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    status = commands.add_parser(
        "status", help="show what every rlcomm process of the running job is doing")
    status.add_argument("--address", help="the Ray to attach to (default: RAY_ADDRESS, else "
                        "the Ray started on this machine)")
    status.add_argument("--timeout", type=float, default=1.0,
                        help="seconds each process has to answer (default 1)")
    status.add_argument("--json", action="store_true", help="print JSON instead of tables")
    status.add_argument("--recent", type=int, default=5,
                        help="ended ops shown per process from its flight recorder (default 5)")
    args = parser.parse_args(argv)
    if args.command == "status":
        return _status(args)
    return 2  # pragma: no cover - argparse refuses other commands


if __name__ == "__main__":
    sys.exit(main())
