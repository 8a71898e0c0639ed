"""Transports: move plain tensors between the two ranks of a connection.

Importing this package registers the built-in transports with
:mod:`~rlcomm.comm.transports.registry` (each module registers itself).
"""

from rlcomm.comm.transports import cuda_ipc, gloo, nccl, shm  # noqa: F401 - they register
