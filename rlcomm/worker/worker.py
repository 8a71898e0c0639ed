"""The ``Worker`` base class: subclass it, launch it as a group, talk to other workers."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from rlcomm.comm.buckets import MIN_BUCKET
from rlcomm.comm.identity.address import RankLike, WorkerAddress
from rlcomm.comm.manager import CommManager
from rlcomm.comm.push import PushedWeights, WeightPusher, pushed_weights, weight_pusher
from rlcomm.settings import group_name_from_env
from rlcomm.worker.dispatch import MeshTable

if TYPE_CHECKING:
    from rlcomm.channel import Channel
    from rlcomm.comm.buckets import Shards
    from rlcomm.comm.options import CollectiveGroupOptions
    from rlcomm.comm.work import AsyncWork
    from rlcomm.worker.group import WorkerGroup

W = TypeVar("W", bound="Worker")


class _class_or_remote_method(classmethod):
    """A classmethod that, looked up on a ``@ray.remote`` class (an ``ActorClass``
    instance), binds to that object, which keeps the Ray options it was given."""

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is not None and getattr(obj, "__ray_metadata__", None) is not None:
            return self.__func__.__get__(obj)
        return super().__get__(obj, objtype)


class Worker:
    """Base class of every rlcomm worker.

    Subclass it with a plain ``__init__`` and launch it with
    ``MyWorker.create_group(*args).launch(cluster, placement_strategy, name)``. Before your
    ``__init__`` runs, the process has ``MASTER_ADDR``, ``MASTER_PORT`` (a free port on
    rank 0's node), ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` and
    ``NODE_RANK`` set, so ``torch.distributed.init_process_group("gloo")`` works with no
    arguments, and ``self._rank``, ``self._world_size`` and ``self.worker_address`` are set.

    Args:
        parent_address: only for workers that are not launched by Ray (a sub-process
            forked by a worker): the parent's address, extended by ``rank``.
        world_size: with ``parent_address``: the number of sibling sub-workers.
        rank: with ``parent_address``: this sub-worker's rank among its siblings.
    """

    _rlcomm_bound: bool = False

    def __init__(
        self,
        parent_address: WorkerAddress | None = None,
        world_size: int | None = None,
        rank: int | None = None,
    ):
        if parent_address is not None:
            if rank is None or world_size is None:
                raise ValueError("Worker: a sub-worker needs parent_address, world_size and rank")
            self._bind_identity(parent_address.child(rank), world_size)
            from rlcomm.comm.manager import CommManager

            CommManager.start(self._worker_address)
        elif not self._rlcomm_bound:
            group = group_name_from_env() or "driver"
            self._bind_identity(
                WorkerAddress(group, (int(os.environ.get("RANK", 0)),)),
                int(os.environ.get("WORLD_SIZE", 1)),
            )

    # -- verl's n-d dispatch: the meshes this worker belongs to --------------------------------

    def _mesh_table(self) -> MeshTable:
        """This worker's :class:`~rlcomm.worker.dispatch.MeshTable`, made on first use (a
        subclass's ``__init__`` need not call ``Worker.__init__`` first)."""
        table = self.__dict__.get("_rlcomm_meshes")
        if table is None:
            table = self.__dict__["_rlcomm_meshes"] = MeshTable()
        return table

    def _register_dispatch_collect_info(self, mesh_name: str, dp_rank: int, is_collect: bool) -> None:
        """Record this worker's data-parallel index and collect flag for ``mesh_name``.

        A worker that belongs to an n-d mesh (data x tensor x pipeline parallel, ...)
        calls this in its ``__init__``, once per mesh name; a worker group's
        ``make_nd_compute_dispatch_fn`` reads it back to send data-parallel chunk
        ``dp_rank`` to this worker and to return its output only when ``is_collect``.

        Raises:
            MeshRegisteredError: ``mesh_name`` was registered already on this worker (a
                ``ValueError``, as in verl).
        """
        self._mesh_table().register(mesh_name, dp_rank, is_collect)

    def get_dispatch_collect(self) -> dict[str, dict[str, Any]]:
        """Every registered mesh: ``{"dispatch_dp_rank": {mesh: dp_rank}, "collect_dp_rank":
        {mesh: is_collect}}`` (verl's form; a copy)."""
        return self._mesh_table().dispatch_collect()

    def set_dispatch_collect(
        self, mesh_name: str, dispatch_dp_rank: dict[str, int], collect_dp_rank: dict[str, bool]
    ) -> None:
        """Register ``mesh_name`` from another worker's :meth:`get_dispatch_collect`, as
        verl's fused workers do (a worker that plays two roles takes each role's mesh).

        The dp rank and collect flag are taken from the given dicts (verl reads their
        values; each should hold one mesh).

        Raises:
            MeshRegisteredError: ``mesh_name`` is registered already (an
                ``AssertionError``, as in verl).
            ValueError: the dicts do not hold exactly one entry each.
        """
        table = self._mesh_table()
        if table.get(mesh_name) is not None:
            table.register(mesh_name, 0, False, "set_dispatch_collect")  # raises: taken
        if len(dispatch_dp_rank) != 1 or len(collect_dp_rank) != 1:
            raise ValueError(
                "set_dispatch_collect: pass the get_dispatch_collect() of a worker that "
                f"registered one mesh; got {dispatch_dp_rank!r} and {collect_dp_rank!r}"
            )
        [dp_rank] = dispatch_dp_rank.values()
        [is_collect] = collect_dp_rank.values()
        table.register(mesh_name, dp_rank, is_collect)

    def query_collect_info(self, mesh_name: str) -> bool:
        """Whether this worker returns output for ``mesh_name`` (verl's name).

        Raises:
            KeyError: ``mesh_name`` is not registered on this worker.
        """
        info = self._query_mesh_info(mesh_name)
        if info is None:
            raise KeyError(f"mesh {mesh_name!r} is not registered on {type(self).__name__}")
        return info[1]

    def _query_mesh_info(self, mesh_name: str) -> tuple[int, bool] | None:
        """``(dp_rank, is_collect)`` registered for ``mesh_name``, or ``None``."""
        return self._mesh_table().get(mesh_name)

    def _query_dispatch_info(self, mesh_name: str) -> int | None:
        """The data-parallel index registered for ``mesh_name``, or ``None``."""
        info = self._query_mesh_info(mesh_name)
        return None if info is None else info[0]

    def _query_collect_info(self, mesh_name: str) -> bool | None:
        """Whether this worker returns output for ``mesh_name``, or ``None``."""
        info = self._query_mesh_info(mesh_name)
        return None if info is None else info[1]

    # -- identity ---------------------------------------------------------------------------

    def _bind_identity(self, address: WorkerAddress, world_size: int) -> None:
        self._worker_address = address
        self._rank = address.rank_path[-1]
        self._world_size = world_size
        self._rlcomm_bound = True

    @property
    def worker_address(self) -> WorkerAddress:
        """This worker's address: group name and rank path (``str()`` gives ``group:0``)."""
        return self._worker_address

    @property
    def worker_group_name(self) -> str:
        return self._worker_address.group_name

    @property
    def rank(self) -> int:
        """This worker's rank in its group (verl and NeMo-RL style alias of ``_rank``)."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The number of workers in this worker's group."""
        return self._world_size

    @_class_or_remote_method
    def create_group(cls: type[W], *args: Any, **kwargs: Any) -> WorkerGroup[W]:
        """A not yet launched :class:`WorkerGroup` of this class; ``.launch(...)`` starts it.

        Works on a class wrapped in ``@ray.remote`` too (as NeMo-RL's workers are): the
        group runs the user's class, with the ``runtime_env`` (and ``max_concurrency``)
        given to ``@ray.remote``.

        Args:
            *args: passed to every rank's ``__init__``.
            **kwargs: passed to every rank's ``__init__``.
        """
        from rlcomm.worker.group import WorkerGroup

        return WorkerGroup(cls, args, kwargs)

    def _rlcomm_apply(self, func: Any, with_self: bool, *args: Any, **kwargs: Any) -> Any:
        """Run a driver-supplied function here: ``func(self, *args, **kwargs)`` or, without
        ``with_self``, ``func(*args, **kwargs)`` (verl's ``execute_with_func_generator``
        and ``execute_func_rank_zero``)."""
        return func(self, *args, **kwargs) if with_self else func(*args, **kwargs)

    # -- communication ----------------------------------------------------------------------

    @property
    def _comm(self) -> CommManager:
        return CommManager.current()

    def send(
        self,
        object: Any,
        dst_group_name: str,
        dst_rank: RankLike,
        async_op: bool = False,
        options: CollectiveGroupOptions | None = None,
        piggyback_payload: Any = None,
        *,
        bucket_bytes: int | None = None,
    ) -> AsyncWork | None:
        """Send an object to the worker ``(dst_group_name, dst_rank)``.

        Tensors, lists of tensors, dicts of str -> tensor and dataclasses holding tensors
        travel as raw bytes (CPU tensors over shared memory or Gloo, CUDA tensors over
        NCCL, or CUDA IPC between workers on one GPU) behind a small msgspec header;
        any other picklable object is pickled.

        Unlike RLinf, this never hangs on call order: the first contact with a peer
        forms the connection in the background, both ends may post ``async_op=True``
        ops first, and a send completes as soon as the peer's process has the data,
        even before the peer calls :meth:`recv`. It is thread-safe: messages of
        concurrent senders never interleave.

        CUDA tensors to a worker on the same GPU travel by CUDA IPC, one device copy
        each way at most: a payload of up to ``RLCOMM_CUDA_SLOT_BYTES`` (1 MiB) is
        copied into a staging slot and the send returns at once; a larger one is *lent*:
        the receiver copies it straight out of these tensors, and the send returns once
        it has (this thread's current stream is then ordered after that copy: write the
        tensors from another stream only after synchronizing). With ``async_op=True``
        the returned work is done once the receiver's copy has finished. Two workers
        that both send lent payloads to each other before receiving still both go on,
        each taking in the other's payload while it waits.

        **Any size.** A CPU payload larger than a quarter of ``RLCOMM_SHM_POOL_BYTES``
        (1 GiB by default), or any when ``bucket_bytes`` is given, *streams*: its frame
        goes first, then buckets of ``bucket_bytes`` (``RLCOMM_BUCKET_BYTES``, 64 MiB, at
        most a quarter of the pool), each through one reused shared-memory segment on
        one node (the receiver copies a bucket out while the next one is written), or
        over Gloo. Such a send returns once the receiver took its last bucket, and its
        timeout bounds each bucket. The receiver takes it as :meth:`recv` says.

        Args:
            object: what to send. Do not mix CPU and CUDA tensors in one container.
            dst_group_name: the destination worker group.
            dst_rank: its rank, or a rank path (list of ints) for a sub-worker.
            async_op: return an :class:`AsyncWork` instead of blocking. Do not modify
                the sent tensors until it is done. A CUDA send is ordered after the work
                queued on the current stream before the call.
            options: options of the connection, used on first contact; their
                ``timeout`` applies to this call.
            piggyback_payload: any picklable object delivered beside ``object``; the
                receiver's ``recv`` then returns ``(object, payload)``.

        Returns:
            An :class:`AsyncWork` if ``async_op``, else None.

        Raises:
            PeerNotFoundError: no such group or rank (at once).
            CodecError: the object cannot be encoded.
            CommTimeoutError, PeerLostError, OptionsMismatchError: the send failed.
        """
        if bucket_bytes is not None:
            _check_bucket_bytes(bucket_bytes)
        dst = WorkerAddress.of(dst_group_name, dst_rank)
        return self._comm.send(object, dst, async_op, options, piggyback_payload,
                               bucket_bytes=bucket_bytes)

    def recv(
        self,
        src_group_name: str,
        src_rank: RankLike,
        async_op: bool = False,
        options: CollectiveGroupOptions | None = None,
        into: Any = None,
        *,
        shards: Shards | None = None,
    ) -> Any:
        """Receive the next object the worker ``(src_group_name, src_rank)`` sent.

        Returns the object rebuilt with its types, dtypes and shapes; CUDA tensors land
        on this thread's current CUDA device. With a piggyback payload it returns
        ``(object, payload)``. Receives from one peer are served in call order.

        With ``into``, the received tensors are copied into existing ones instead, and
        ``into`` is returned: a tensor for a sent tensor, a list of as many tensors for a
        list, a dict (a model's ``state_dict()``, say) holding every key of a sent dict;
        each with the sent dtype and shape. A weight sync is then one copy per receiver:
        between workers on one GPU, the CUDA payload is copied straight from the sender's
        memory into these tensors. (An extension of RLinf's ``recv``.)
        ``into=rlcomm.Buckets()`` returns an iterator of ``(name, tensor)`` instead, which
        yields each tensor as soon as it is whole, while the rest of a streamed message is
        on its way (see :class:`~rlcomm.Buckets`); ``shards`` takes a slice (and a dtype)
        of each tensor, by name (see :class:`~rlcomm.Shard`).

        A message that streams (see :meth:`send`) is taken bucket by bucket: into
        ``into``'s tensors whatever its size, as an iterator, or into new tensors up to
        ``RLCOMM_MAX_MESSAGE_BYTES``. One this receive cannot take (``into`` does not
        fit, over the limit) closes the connection, so that its sender fails at once
        rather than wait.

        CUDA payloads are ordered on this thread's current stream: work queued on it
        after ``recv`` returns sees the received values.

        Raises:
            ProtocolMismatchError: the next message was sent with ``send_tensor`` (it
                stays queued for a ``recv_tensor``), or does not fit ``into`` (it stays
                queued; the error names the key).
            CommTimeoutError: nothing arrived within the timeout (nothing is lost: a
                message that arrives later goes to the next receive).
            PeerLostError: the peer died; messages it sent before are still delivered.
        """
        src = WorkerAddress.of(src_group_name, src_rank)
        return self._comm.recv(src, async_op, options, into=into, shards=shards)

    def send_tensor(
        self,
        tensor: torch.Tensor,
        dst_group_name: str,
        dst_rank: RankLike,
        async_op: bool = False,
        options: CollectiveGroupOptions | None = None,
    ) -> AsyncWork | None:
        """Send one tensor to be received in place by :meth:`recv_tensor`.

        Pair it with ``recv_tensor`` only; the receiver checks dtype and shape against
        its buffer and raises :class:`ProtocolMismatchError` on a mismatch.
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"send_tensor needs a torch.Tensor, got {type(tensor).__name__}")
        dst = WorkerAddress.of(dst_group_name, dst_rank)
        return self._comm.send(tensor, dst, async_op, options, raw=True)

    def recv_tensor(
        self,
        tensor: torch.Tensor,
        src_group_name: str,
        src_rank: RankLike,
        async_op: bool = False,
        options: CollectiveGroupOptions | None = None,
    ) -> AsyncWork | None:
        """Receive a ``send_tensor`` message in place into ``tensor`` (contiguous,
        preallocated with the sender's dtype and shape).

        Raises:
            ProtocolMismatchError: the message was sent with ``send``, or its dtype or
                shape differ from ``tensor``'s; the message stays queued.
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"recv_tensor needs a torch.Tensor, got {type(tensor).__name__}")
        src = WorkerAddress.of(src_group_name, src_rank)
        return self._comm.recv(src, async_op, options, tensor=tensor)

    def broadcast(
        self,
        object: Any = None,
        groups: list[tuple[str, Any]] | None = None,
        src: tuple[str, RankLike] | None = None,
        async_op: bool = False,
        options: CollectiveGroupOptions | None = None,
        into: Any = None,
        *,
        shards: Shards | None = None,
        bucket_bytes: int | None = None,
    ) -> Any:
        """Broadcast an object from ``src`` to every worker listed in ``groups``.

        ``groups`` is a list of ``(group_name, ranks)``; ranks is an int, a list of
        ints, a tuple (a rank path) or a list of tuples. The expanded list's order gives
        the ranks of the broadcast group, created on first use. The source defaults to
        the first listed worker. Every participant calls this with identical ``groups``
        and ``src``, and gets the object back.

        Participants on the source's node get it through shared memory: the source
        copies the tensors once into a pooled segment and returns; each of them maps it
        and gets zero-copy tensors. Those tensors are *copy-on-write*: writing to one
        changes only this worker's copy (the written pages are copied then), never the
        source's or another receiver's. The segment goes back to the source's pool when
        every receiver has freed its tensors; a source whose receivers still hold
        ``RLCOMM_BCAST_MAX_SLOTS`` (4) earlier broadcasts waits (up to the timeout) for
        one to be freed. Participants on other nodes get it through their node's *relay*
        (the first of them there), which hands it to its node-mates as above. A CPU
        payload of at least ``RLCOMM_BCAST_CHAIN_MIN_BYTES`` (1 MiB) goes to the relays
        along a chain, pipelined in records of ``RLCOMM_BCAST_CHUNK_BYTES`` (1 MiB): each
        node forwards a record while the next arrives, so the last of ``n`` nodes has it
        about one transfer plus ``n - 2`` record times after the start. A smaller payload
        goes by Gloo's broadcast, a CUDA one by NCCL's. Along the chain, a relay that
        dies makes every member after it raise ``PeerLostError`` naming it (and one that
        stops, ``CommTimeoutError`` naming it); a relay receives a CPU payload straight
        into ``into``'s CPU tensors, which then hold part of it if the broadcast fails.

        CUDA tensors go by GPU: a participant on the source's node that sees the source's
        GPU (the same one, as colocated workers do) copies them straight from the
        source's memory on the device, one copy each, never through host memory; the
        source returns once all have (its current stream is then ordered after their
        copies: later work on it may write the tensors; with ``async_op`` the work is done
        once the copies have finished). Participants that do not see that GPU get them
        through shared memory as above.

        ``into`` (receivers only; an extension of RLinf's ``broadcast``): copy the
        received tensors into these existing ones and return ``into``, as
        :meth:`recv` does: a weight sync into the parameters is then one copy per
        receiver. The source ignores it. ``into=rlcomm.Buckets()`` returns an iterator
        of ``(name, tensor)`` instead, which yields each tensor as soon as it is whole
        while later buckets are on their way (see :class:`~rlcomm.Buckets`).

        **Any size.** A CPU payload larger than a quarter of ``RLCOMM_SHM_POOL_BYTES``
        (1 GiB by default), or than a receiver's ``RLCOMM_MAX_MESSAGE_BYTES``, or any
        payload when the source passes ``bucket_bytes``, *streams*: it goes in buckets of
        ``bucket_bytes`` (``RLCOMM_BUCKET_BYTES``, 64 MiB, at most a quarter of the pool)
        through at most two shared-memory slots on each node, and along the chain one
        bucket after the other; the source fills a bucket while receivers copy out the
        one before. Each receiver then takes it into ``into``'s tensors (no limit on the
        size), as an iterator, or into new tensors (up to its
        ``RLCOMM_MAX_MESSAGE_BYTES``). Every receiver says whether it takes a streamed
        message before any bucket goes: if one refuses (``into`` does not fit, over its
        limit), every member raises at once, naming it. A streamed broadcast's timeout
        bounds each bucket, not the whole transfer.

        ``shards`` (receivers only): what this receiver takes of each tensor, by name
        (a mapping of names to :class:`~rlcomm.Shard`, or a function of
        ``(name, shape)``): its tensor-parallel slice, and a dtype. Only the slice's
        bytes are read out of shared memory; the result (or ``into``'s tensors) has the
        slice's shape and dtype. ``bucket_bytes`` (the source only): stream in buckets
        of this many bytes (at least 1 MiB).

        Returns:
            The object on every participant (an :class:`AsyncWork` if ``async_op``). On
            the source, its own ``object``.

        Raises:
            PeerLostError: on the source (and on a relay), when a receiver's process is
                gone (the other receivers got the object); on a receiver, when the
                source's is, or a relay's before it.
            CommTimeoutError: nothing arrived within the timeout, or (on the source) a
                receiver did not join, or held every segment, in time.
        """
        if groups is None:
            raise ValueError("broadcast: groups is required, e.g. [('trainer', 0), ('rollout', [0, 1])]")
        if bucket_bytes is not None:
            _check_bucket_bytes(bucket_bytes)
        return self._comm.broadcast(object, groups, src, async_op, options, into, shards,
                                    bucket_bytes)

    def weight_pusher(
        self,
        tensors: Any,
        to: list[tuple[str, Any]],
        name: str = "weights",
        timeout: float | None = None,
    ) -> WeightPusher:
        """Become the source of a *pushed* weight sync to the workers ``to`` (a list of
        ``(group_name, ranks)``, as :meth:`broadcast`'s ``groups``), all on this worker's
        GPU: each :meth:`WeightPusher.push` writes their registered tensors from
        ``tensors`` (a dict of name to tensor, a list, or one tensor; contiguous CUDA
        tensors, a model's ``state_dict()`` say), on the GPU, from this process.

        Each receiver calls :meth:`pushed_weights` with the tensors it wants written
        (by the same names, of the same dtypes and shapes; a subset of the names is
        fine) and this worker's address, at about the same time: this call waits for
        each to register, up to ``timeout`` (the ``comm_timeout`` setting by default).
        ``name`` tells several syncs between the same workers apart.

        Beside ``broadcast(into=...)``, which has each receiver copy out of the source's
        memory in its own process, a push queues every copy from this one process (one
        batched copy per receiver), and a receiver's update costs a host wait and an
        event wait: the GPU runs the copies back to back as in one process, without
        switching between the receivers' contexts.

        Returns:
            The :class:`~rlcomm.comm.push.WeightPusher`.

        Raises:
            ValueError: a tensor is not a contiguous CUDA tensor, or a receiver is on
                another node.
            ProtocolMismatchError: a receiver's tensors do not match these (both ends
                raise, naming the tensor), or it is on another GPU.
            CommTimeoutError: a receiver did not register in time.
        """
        return weight_pusher(self._comm, tensors, to, name, timeout)

    def pushed_weights(
        self,
        tensors: Any,
        src: tuple[str, RankLike],
        name: str = "weights",
        timeout: float | None = None,
    ) -> PushedWeights:
        """Register ``tensors`` (contiguous CUDA tensors on this worker's GPU: its
        parameters, a dict by name) to be written by the source ``src`` of a pushed
        weight sync (see :meth:`weight_pusher`, which ``src`` calls at about the same
        time). Waits until the source took them, up to ``timeout``.

        Then each :meth:`PushedWeights.update` releases the version the tensors hold and
        waits for the next: work queued on this thread's current stream afterwards reads
        it. The source writes the tensors only after the work this worker queued on
        that stream before it released them, so a rollout calls ``update()`` between two
        generation steps and never sees a half-written version. The tensors stay
        registered (and alive) until :meth:`PushedWeights.close`.

        Returns:
            The :class:`~rlcomm.comm.push.PushedWeights`.

        Raises:
            ValueError: a tensor is not a contiguous CUDA tensor, or ``src`` is on
                another node.
            ProtocolMismatchError: the source refused them (the reason names the tensor).
            CommTimeoutError: the source did not take them in time.
        """
        return pushed_weights(self._comm, tensors, WorkerAddress.of(src[0], src[1]), name,
                              timeout)

    def gpu_info(self) -> dict[str, Any]:
        """What this worker uses of the GPUs, as a dict: ``device`` (its current CUDA
        device index), ``gpu`` (that GPU's UUID, the same in every process), ``visible``
        (the sorted UUIDs of the GPUs it sees) and ``mps`` (whether an NVIDIA MPS daemon
        serves it, a bool).

        ``device`` and ``gpu`` are ``None`` and ``visible`` is empty where CUDA is not
        available, or until this process has used CUDA (asking does not initialize it).
        Two workers whose ``gpu`` is equal talk over CUDA IPC.

        Under MPS, the processes on a GPU share one context. What that changes in the
        cost of a CUDA message has not been measured yet (see the GPU guide,
        ``docs/gpu.md``).

        A group has this method too (see :class:`WorkerGroup`):
        ``group.gpu_info().wait()`` gives one dict per rank, and
        ``group.execute_on(0).gpu_info().wait()`` rank 0's alone.
        """
        from rlcomm.comm.transports.gpus import gpu_info

        return gpu_info()

    # -- channels ---------------------------------------------------------------------------
    # The seam between workers and channels: a worker offers channels (RLinf's
    # Worker.create_channel / connect_channel), a channel knows nothing of workers (its
    # own worker is built from rlcomm.comm). These two methods are the only place
    # rlcomm.worker reaches into rlcomm.channel, at call time.

    def create_channel(
        self,
        channel_name: str,
        maxsize: int = 0,
        distributed: bool = False,
        node_rank: int = 0,
        local: bool = False,
        item_type: Any = None,
    ) -> Channel:
        """Create a new channel and return a handle on it; the arguments are those of
        :meth:`rlcomm.Channel.create` (RLinf's ``Worker.create_channel``).

        Raises:
            ChannelError: a channel of that name exists already.
        """
        from rlcomm.channel import Channel

        return Channel.create(channel_name, maxsize, distributed, node_rank, local, item_type)

    def connect_channel(self, channel_name: str, timeout: float = 60.0) -> Channel:
        """A handle on the existing channel ``channel_name``, waiting up to ``timeout``
        seconds for it to be created.

        Raises:
            ChannelError: no such channel in time.
        """
        from rlcomm.channel import Channel

        return Channel.connect(channel_name, timeout)


def _check_bucket_bytes(bucket_bytes: int | None) -> None:
    if bucket_bytes is not None and (
        not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool)
        or bucket_bytes < MIN_BUCKET
    ):
        raise ValueError(f"bucket_bytes must be an int of at least {MIN_BUCKET} (1 MiB), "
                         f"got {bucket_bytes!r}")
