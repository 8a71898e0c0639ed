"""``MultiWorkerFuture``: the futures of one call on several workers, and whose results count.

NeMo-RL's container: ``run_all_workers_sharded_data`` returns one, and
``get_all_worker_results`` (or :meth:`MultiWorkerFuture.get_results`) reads it, returning
results only from ``return_from_workers`` and once per tied worker group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ray

from rlcomm.errors import RlcommTimeoutError

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
        from rlcomm.worker.result import GroupResult, default_call_timeout

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
        timeout = default_call_timeout() if timeout is None else timeout
        plain = [(w, f) for w, f in chosen if not isinstance(f, ray.ObjectRefGenerator)]
        ready, _ = ray.wait([f for _, f in plain], num_returns=len(plain), timeout=timeout)
        if len(ready) < len(plain):
            raise RlcommTimeoutError(
                f"{worker_group.worker_group_name}.{self.method}(): not done after {timeout}s"
            )
        handle = GroupResult(worker_group.worker_group_name, self.method, [], [])
        results = []
        for worker, fut in chosen:
            try:
                if isinstance(fut, ray.ObjectRefGenerator):
                    results.append(fut if return_generators_as_proxies else [ray.get(r) for r in fut])
                else:
                    results.append(ray.get(fut))
            except ray.exceptions.RayError as exc:
                raise handle._error(worker, exc) from None
        return results
