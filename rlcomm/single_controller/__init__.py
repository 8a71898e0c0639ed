"""verl's single-controller API on rlcomm workers.

``RayResourcePool``, ``RayClassWithInitArgs``, ``RayWorkerGroup``, ``merge_resource_pool``,
``split_resource_pool``, ``create_colocated_worker_cls`` and the ``@register`` decorator with its ``Dispatch`` /
``Execute`` modes, working on :class:`rlcomm.Worker` subclasses. ``Worker`` is re-exported
so verl code can import everything from here.
"""

from rlcomm.single_controller.colocated import create_colocated_worker_cls
from rlcomm.single_controller.decorator import (
    Dispatch,
    DispatchMode,
    Execute,
    collect_all_to_all,
    collect_dp_compute,
    collect_dp_compute_data_proto,
    collect_nd_compute,
    dispatch_all_to_all,
    dispatch_dp_compute,
    dispatch_dp_compute_data_proto,
    dispatch_nd_compute,
    dispatch_one_to_all,
    get_predefined_dispatch_fn,
    make_nd_compute_dataproto_dispatch_fn,
    make_nd_compute_dispatch_fn,
    register,
    register_dispatch_mode,
    update_dispatch_mode,
)
from rlcomm.single_controller.dispatched_call import DispatchFuture
from rlcomm.single_controller.ray_worker_group import (
    PROTECTED_WORKER_ENV,
    RayClassWithInitArgs,
    RayWorkerGroup,
)
from rlcomm.single_controller.resource_pool import (
    RayResourcePool,
    merge_resource_pool,
    split_resource_pool,
)
from rlcomm.worker.batch import (
    concat_batches,
    pad_batch,
    split_batch,
    split_sizes,
    strip_padding,
)
from rlcomm.worker.dispatch import MeshRegisteredError, collect_batches
from rlcomm.worker.worker import Worker

__all__ = [
    "PROTECTED_WORKER_ENV",
    "Dispatch",
    "DispatchFuture",
    "DispatchMode",
    "Execute",
    "MeshRegisteredError",
    "RayClassWithInitArgs",
    "RayResourcePool",
    "RayWorkerGroup",
    "Worker",
    "collect_all_to_all",
    "collect_batches",
    "collect_dp_compute",
    "collect_dp_compute_data_proto",
    "collect_nd_compute",
    "concat_batches",
    "create_colocated_worker_cls",
    "dispatch_all_to_all",
    "dispatch_dp_compute",
    "dispatch_dp_compute_data_proto",
    "dispatch_nd_compute",
    "dispatch_one_to_all",
    "get_predefined_dispatch_fn",
    "make_nd_compute_dataproto_dispatch_fn",
    "make_nd_compute_dispatch_fn",
    "merge_resource_pool",
    "pad_batch",
    "register",
    "register_dispatch_mode",
    "split_batch",
    "split_resource_pool",
    "split_sizes",
    "strip_padding",
    "update_dispatch_mode",
]
