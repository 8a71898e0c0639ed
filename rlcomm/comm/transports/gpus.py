"""Which physical GPU a CUDA device is, named by UUID (the same in every process, unlike
device indices: ``CUDA_VISIBLE_DEVICES`` differs between Ray actors), and the swap of
UUIDs by which the two ends of a pair learn whether they share one GPU."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from rlcomm.comm.transports.base import as_timedelta, deadline_of, map_error
from rlcomm.errors import CommError, CommTimeoutError


def gpu_uuid(device: torch.device) -> str:
    """The UUID of the physical GPU behind ``device`` (the same in every process)."""
    return str(torch.cuda.get_device_properties(device).uuid)


@functools.cache
def local_gpus() -> dict[str, int]:
    """This process's CUDA device index of each GPU it can see, by UUID."""
    return {
        str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())
    }


def exchange_gpu_uuids(
    store: dist.Store, rank: int, mine: str, timeout: float, peer: str
) -> str:
    """Publish this end's GPU UUID under ``cuda_uuid/<rank>`` of ``store`` and return
    the peer's, once it published it too.

    Raises:
        CommTimeoutError: the peer did not reach its first CUDA send or receive within
            ``timeout`` seconds.
        PeerLostError: the store is gone (the peer that holds it died).
    """
    what = "choosing the CUDA transport"
    key = f"cuda_uuid/{1 - rank}"
    deadline = deadline_of(timeout)
    try:
        store.set(f"cuda_uuid/{rank}", mine)
        store.wait([key], as_timedelta(timeout))
        return store.get(key).decode()
    except (RuntimeError, CommError) as exc:  # torch's stores, and rlcomm's own
        error = map_error(exc, what, peer, deadline)
        if isinstance(error, CommTimeoutError):
            error = CommTimeoutError(
                f"{what} with {peer}: the peer did not start its first CUDA send or receive "
                f"within {timeout}s (both ends of a connection must reach one)"
            )
        raise error from exc
