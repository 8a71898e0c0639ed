"""Which physical GPU a CUDA device is, named by UUID (the same in every process, unlike
device indices: ``CUDA_VISIBLE_DEVICES`` differs between Ray actors), and the swap of
UUIDs by which the two ends of a pair learn whether they share one GPU."""

from __future__ import annotations

import functools
import os

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


#: Where the MPS control daemon's pipes are when ``CUDA_MPS_PIPE_DIRECTORY`` is not set.
MPS_PIPE_DIRECTORY = "/tmp/nvidia-mps"


def mps_running(pipe_dir: str | None = None, proc: str = "/proc") -> bool:
    """Whether an NVIDIA MPS control daemon serves the pipe directory this process's
    CUDA would use (``CUDA_MPS_PIPE_DIRECTORY``, else :data:`MPS_PIPE_DIRECTORY`): its
    control pipe is there and a ``nvidia-cuda-mps-control`` process runs. CUDA contexts
    made while it runs share the GPU through one MPS server, which cut a bare hand-off
    between two processes of one GPU, measured outside rlcomm, to about a tenth; rlcomm's
    own cost under MPS has not been measured. Nothing needs it."""
    pipe_dir = pipe_dir or os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_PIPE_DIRECTORY
    if not os.path.exists(os.path.join(pipe_dir, "control")):
        return False
    try:
        entries = list(os.scandir(proc))
    except OSError:
        return False
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            with open(os.path.join(entry.path, "comm")) as f:
                # The kernel keeps 15 characters of a command's name.
                if f.read().strip().startswith("nvidia-cuda-mps"):
                    return True
        except OSError:
            continue  # ended meanwhile, or not ours to read
    return False


def gpu_info() -> dict:
    """What this process uses of the GPUs: its current device, that GPU's UUID, the
    UUIDs it sees, and whether an MPS daemon serves it (:func:`mps_running`). Empty
    GPU fields where CUDA is not available; CUDA is not initialized by asking."""
    info: dict = {"device": None, "gpu": None, "visible": [], "mps": mps_running()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        index = torch.cuda.current_device()
        info.update(device=index, gpu=gpu_uuid(torch.device("cuda", index)),
                    visible=sorted(local_gpus()))
    return info
