"""``MultiWorkerFuture``: the futures of one call on several workers, and whose results count.

NeMo-RL's container: ``run_all_workers_sharded_data`` returns one, and
``get_all_worker_results`` (or :meth:`MultiWorkerFuture.get_results`) reads it, returning
results only from ``return_from_workers`` and once per tied worker group. Its waiting is a
:class:`~rlcomm.GroupResult`'s (an :class:`~rlcomm.AsyncWork`) over the chosen futures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ray

from rlcomm.worker.result import GroupResult, call_error

__all__ = ["MultiWorkerFuture"]


@dataclass
class MultiWorkerFuture:
    """The futures of one call on several workers, and whose results count.

    Attributes:
        futures: one Ray future (or ``ObjectRefGenerator``) per called worker.
        return_from_workers: the workers whose results are returned (``None``: all).
        called_workers: the worker index of each future, in order.
        method: the called method (for error messages).
    """

    futures: list[Any]
    return_from_workers: list[int] | None = None
    called_workers: list[int] | None = None
    method: str = field(default="?", compare=False)

    def get_results(
        self,
        worker_group: Any,
        return_generators_as_proxies: bool = False,
        timeout: float | None = None,
    ) -> list[Any]:
        """Wait for the results; one per tied worker group, only from ``return_from_workers``.

        Args:
            worker_group: the group that made the call (for its tied groups).
            return_generators_as_proxies: return an ``ObjectRefGenerator`` as is instead
                of reading it to a list.
            timeout: seconds to wait (default ``RLCOMM_CALL_TIMEOUT``).

        Raises:
            WorkerCallError: a worker raised or died.
            RlcommTimeoutError: not done in time.
        """
        called = self.called_workers or list(range(len(self.futures)))
        wanted = None if self.return_from_workers is None else set(self.return_from_workers)
        tied_of = worker_group.worker_to_tied_group_index
        seen: set[int] = set()
        chosen = []
        for worker, fut in zip(called, self.futures, strict=True):
            if wanted is not None and worker not in wanted:
                continue
            group = tied_of.get(worker, worker)
            if group in seen:
                continue
            seen.add(group)
            chosen.append((worker, fut))
        name = worker_group.worker_group_name
        plain = [(w, f) for w, f in chosen if not isinstance(f, ray.ObjectRefGenerator)]
        values = iter(GroupResult(name, self.method, [w for w, _ in plain], [f for _, f in plain])
                      .wait(timeout))
        results = []
        for worker, fut in chosen:
            if not isinstance(fut, ray.ObjectRefGenerator):
                results.append(next(values))
            elif return_generators_as_proxies:
                results.append(fut)
            else:
                try:
                    results.append([ray.get(r) for r in fut])
                except ray.exceptions.RayError as exc:
                    raise call_error(name, self.method, worker, exc) from None
        return results
