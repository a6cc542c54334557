"""Collectives over the mesh's sub-groups, with their gradients.

``ReplicaContext.all_reduce`` only reduces over every replica. A tensor group
(or a data-parallel group) needs its own collective group:
TensorFlow's ``CollectiveReplicaLauncher`` (the class its own
``CollectiveAllReduce`` uses), one per (group, local device), with a group
key of its own. Raw ``collective_ops.all_reduce_v2`` without the launcher's
ordering token timed out (DeadlineExceeded), even for a full group.

The layers' two collectives are each other's gradient (Megatron's layout,
with rows instead of a shared batch):

* :func:`gather_rows`: all-gather the tensor group's rows. Backward: sum the
  group's gradients, keep this replica's rows.
* :func:`scatter_rows`: sum over the tensor group, keep this replica's rows.
  Backward: all-gather.

Every collective also adds the bytes this replica sends (ring algorithms, as
:mod:`tfdist.compression.traffic` counts them) to a counter per kind: the
tensor-parallel activations and the data-parallel gradients
(:func:`traffic`).

Private TensorFlow APIs used here are checked when a mesh is attached
(:func:`check_tensorflow`), so that an upgrade fails loudly there.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import tensorflow as tf

from tfdist.compat import tf_private
from tfdist.compression import keras_hook
from tfdist.compression.aggregate import Item
from tfdist.parallel.mesh import Mesh
from tfdist.parallel.spec import spec_of
from tfdist.record import record_of
from tfdist.transport.comm import ReplicaComm
from tfdist.transport.traffic import all_gather_bytes, all_reduce_bytes, nbytes, wire_nbytes

__all__ = [
    "Placement",
    "first_local_replica",
    "Runtime",
    "current",
    "gather_rows",
    "scatter_rows",
    "tp_all_reduce",
    "tp_all_gather",
    "gather_blocks",
    "block_gradient",
    "dp_all_reduce",
    "GroupComm",
    "cast_aggregator",
    "compressed_group_sum",
    "traffic",
    "reset_traffic",
]

#: Group keys of the mesh's groups start this far above the strategy's own
#: collective key base (tfdist gives each strategy a range of 100000).
_GROUP_KEY_OFFSET = 50_000
_INSTANCE_KEY_START = 100
KINDS = ("tensor_parallel", "data_parallel")


def check_tensorflow() -> None:
    """Fails loudly when this TensorFlow lacks the private APIs used here.

    Raises:
        RuntimeError: Naming the missing API and the TensorFlow version.
    """
    from tfdist.compat.tf_python import collective_util, cross_device_utils

    needs = [(cross_device_utils, "CollectiveReplicaLauncher"), (collective_util, "Options")]
    for module, name in needs:
        if not hasattr(module, name):
            raise RuntimeError(
                f"tfdist.parallel needs {module.__name__}.{name}, which "
                f"TensorFlow {tf.__version__} does not have; use the "
                "TensorFlow range pyproject.toml pins"
            )
    launcher = cross_device_utils.CollectiveReplicaLauncher
    for method in ("all_reduce", "_all_gather", "all_reduce_indexed_slices"):
        if not callable(getattr(launcher, method, None)):
            raise RuntimeError(
                f"tfdist.parallel needs CollectiveReplicaLauncher.{method}, "
                f"which TensorFlow {tf.__version__} does not have"
            )


class _InstanceKeys:
    """Instance keys per (group key, device): what the launcher asks for.

    Members of a group on different devices (or hosts) issue their
    collectives in the same order, so their counters agree.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next: dict[tuple[int, str], int] = {}

    def get_instance_key(self, group_key: int, device: str) -> int:
        with self._lock:
            key = self._next.get((group_key, device), _INSTANCE_KEY_START)
            self._next[(group_key, device)] = key + 1
            return key


def first_local_replica(strategy: Any) -> int:
    """The global replica id of this process's first local replica."""
    if getattr(strategy, "kind", "") != "multi_worker_mirrored":
        return 0
    extended = strategy.extended
    index = getattr(extended, "_id_in_cluster", None)
    if index is None:
        raise RuntimeError(
            "tfdist.parallel needs MultiWorkerMirroredStrategy's "
            f"extended._id_in_cluster, which TensorFlow {tf.__version__} "
            "does not have"
        )
    return int(index) * len(extended.worker_devices)


class Runtime:
    """A strategy's mesh and the collectives of its local replicas.

    Args:
        strategy: The strategy (Mirrored or MultiWorkerMirrored), outside its
            scope.
        mesh: Its mesh.
    """

    def __init__(self, strategy: Any, mesh: Mesh) -> None:
        from tfdist.compat.tf_python import (
            collective_util,
            cross_device_utils,
            resource_variable_ops,
        )

        check_tensorflow()
        self.mesh = mesh
        self.devices = tuple(strategy.extended.worker_devices)
        self.first = first_local_replica(strategy)
        base = int(getattr(strategy, "_collective_key_base", 0)) + _GROUP_KEY_OFFSET
        keys = _InstanceKeys()
        options = collective_util.Options()
        launcher = cross_device_utils.CollectiveReplicaLauncher
        self.tp: dict[int, Any] = {}
        self.dp: dict[int, Any] = {}
        with tf.init_scope():
            for i, device in enumerate(self.devices):
                d, t = mesh.coords(self.first + i)
                self.tp[self.first + i] = launcher(base + d, mesh.tp, keys, device, options)
                if mesh.dp > 1:
                    self.dp[self.first + i] = launcher(
                        base + mesh.dp + t, mesh.dp, keys, device, options
                    )
            # Bytes sent, summed over the local replicas. Plain variables
            # (not mirrored): created directly, outside the strategy's creator.
            self.sent = {
                kind: resource_variable_ops.ResourceVariable(
                    tf.zeros([], tf.float64), trainable=False, name=f"tfdist_{kind}_bytes"
                )
                for kind in KINDS
            }

    def local_replicas(self) -> int:
        return len(self.devices)

    def traffic(self) -> dict[str, float]:
        """Bytes one replica sent so far, per kind (see :func:`traffic`)."""
        return {kind: float(v.numpy()) / self.local_replicas() for kind, v in self.sent.items()}

    def dense_gradient_bytes(self, model: Any, replicas: int) -> float:
        """What data parallelism alone would send per step: the full model's
        gradients all-reduced over ``replicas``. For
        :class:`~tfdist.compression.CommunicationStats`, which reaches the mesh
        through this runtime (compression does not import tfdist.parallel)."""
        full = 0.0
        for v in model.trainable_variables:
            spec = spec_of(v)
            full += nbytes(spec.full_shape if spec else v.shape, v.dtype)
        return all_reduce_bytes(full, replicas)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the current replica sits in the mesh."""

    runtime: Runtime
    replica: int
    d: int
    t: int

    @property
    def mesh(self) -> Mesh:
        return self.runtime.mesh

    @property
    def tp(self) -> int:
        return self.runtime.mesh.tp


def runtime_of(strategy: Any = None) -> Runtime | None:
    """The mesh runtime of ``strategy`` (default: the current strategy);
    None without a mesh."""
    if strategy is None:
        strategy = tf.distribute.get_strategy()
    return record_of(strategy).mesh


def current() -> Placement | None:
    """This replica's place in the mesh; None without a mesh (no strategy,
    T = 1), in cross-replica context, or in a symbolic build."""
    ctx = tf.distribute.get_replica_context()
    if ctx is None:
        return None
    runtime = runtime_of(ctx.strategy)
    if runtime is None:
        return None
    replica = tf.get_static_value(ctx.replica_id_in_sync_group)
    if replica is None:
        raise RuntimeError(
            "tfdist.parallel: the replica id is not a constant in this "
            "replica context; tensor-parallel layers run under Mirrored "
            "and MultiWorkerMirrored strategies"
        )
    d, t = runtime.mesh.coords(int(replica))
    return Placement(runtime, int(replica), d, t)


def _count(p: Placement, kind: str, x: tf.Tensor, gather: bool, n: int) -> None:
    """Adds the bytes this replica sends for one collective over n members."""
    if n < 2:
        return
    size = tf.cast(tf.size(x), tf.float64) * x.dtype.size
    factor = float(n - 1) if gather else 2.0 * (n - 1) / n
    p.runtime.sent[kind].assign_add(size * factor)


def _wire(x: tf.Tensor) -> tf.Tensor:
    # TensorFlow's collectives take no bfloat16 (mixed_bfloat16 activations).
    return tf.cast(x, tf.float32) if x.dtype == tf.bfloat16 else x


def _tp_reduce(p: Placement, x: tf.Tensor) -> tf.Tensor:
    y = _wire(x)
    _count(p, "tensor_parallel", y, False, p.tp)
    return tf.cast(p.runtime.tp[p.replica].all_reduce(y), x.dtype)


def _tp_gather(p: Placement, x: tf.Tensor) -> tf.Tensor:
    y = _wire(x)
    _count(p, "tensor_parallel", y, True, p.tp)
    return tf.cast(tf_private.launcher_all_gather(p.runtime.tp[p.replica], y), x.dtype)


def _rows(x: tf.Tensor, start: tf.Tensor, size: tf.Tensor) -> tf.Tensor:
    return x[start : start + size]


def gather_rows(x: tf.Tensor) -> tf.Tensor:
    """All-gathers the tensor group's rows: ``[b, ...]`` -> ``[T*b, ...]``.

    Identity without a mesh. Every member must hold the same number of rows.
    """
    p = current()
    if p is None:
        return x

    @tf.custom_gradient
    def op(x):
        def grad(dy):
            b = tf.shape(x)[0]
            return _rows(_tp_reduce(p, dy), p.t * b, b)

        return _tp_gather(p, x), grad

    return op(x)


def scatter_rows(y: tf.Tensor) -> tf.Tensor:
    """Sums ``[T*b, ...]`` over the tensor group and keeps this replica's
    ``b`` rows. Identity without a mesh."""
    p = current()
    if p is None:
        return y

    @tf.custom_gradient
    def op(y):
        b = tf.shape(y)[0] // p.tp

        def grad(dy):
            return _tp_gather(p, dy)

        return _rows(_tp_reduce(p, y), p.t * b, b), grad

    return op(y)


def tp_all_reduce(x: tf.Tensor) -> tf.Tensor:
    """Sums over the tensor group; its gradient is the same sum (each
    member's copy feeds a different loss). Identity without a mesh."""
    p = current()
    if p is None:
        return x

    @tf.custom_gradient
    def op(x):
        return _tp_reduce(p, x), lambda dy: _tp_reduce(p, dy)

    return op(x)


def tp_all_gather(x: tf.Tensor, axis: int = -1) -> tf.Tensor:
    """Concatenates the tensor group's tensors along ``axis`` (tensor-index
    order). Gradient: the group's sum, this member's part. Identity without
    a mesh."""
    p = current()
    if p is None:
        return x
    axis = axis % x.shape.rank

    @tf.custom_gradient
    def op(x):
        stacked = tf.reshape(_tp_gather(p, x), tf.concat([[p.tp], tf.shape(x)], 0))
        parts = tf.unstack(stacked, num=p.tp, axis=0)
        out = tf.concat(parts, axis=axis)

        def grad(dy):
            width = tf.shape(x)[axis]
            begin = [0] * x.shape.rank
            size = [-1] * x.shape.rank
            summed = _tp_reduce(p, dy)
            begin = tf.tensor_scatter_nd_update(tf.constant(begin), [[axis]], [p.t * width])
            size = tf.tensor_scatter_nd_update(tf.constant(size), [[axis]], [width])
            return tf.slice(summed, begin, size)

        return out, grad

    return op(x)


def _group(p: Placement, kind: str) -> tuple[Any, int, int, str]:
    """The launcher, size and this replica's index of its tensor ("tensor")
    or data-parallel ("data") group, and the byte counter's kind."""
    if kind == "tensor":
        return p.runtime.tp[p.replica], p.tp, p.t, "tensor_parallel"
    return p.runtime.dp.get(p.replica), p.mesh.dp, p.d, "data_parallel"


def _concat_gathered(gathered: tf.Tensor, x: tf.Tensor, n: int, axis: int) -> tf.Tensor:
    stacked = tf.reshape(gathered, tf.concat([[n], tf.shape(x)], 0))
    return tf.concat(tf.unstack(stacked, num=n, axis=0), axis=axis)


def _slice_along(x: tf.Tensor, axis: int, index: int, width: Any) -> tf.Tensor:
    begin = [0] * x.shape.rank
    size = [-1] * x.shape.rank
    begin = tf.tensor_scatter_nd_update(tf.constant(begin), [[axis]], [index * width])
    size = tf.tensor_scatter_nd_update(tf.constant(size), [[axis]], [width])
    return tf.slice(x, begin, size)


def _live(splits: tuple[tuple[int, str], ...], p: Placement) -> list:
    return [(dim, kind) for dim, kind in splits if _group(p, kind)[1] > 1]


def gather_blocks(
    x: tf.Tensor, splits: tuple[tuple[int, str], ...], p: Placement | None = None
) -> tf.Tensor:
    """The full weight from this replica's block: all-gathered along each
    split dimension over its group (``(dimension, "tensor" | "data")``
    pairs, as :class:`tfdist.parallel.spec.ShardSpec` has them).

    The gradient is :func:`block_gradient`'s. Identity without a mesh.
    """
    p = p or current()
    if p is None:
        return x
    live = _live(splits, p)

    @tf.custom_gradient
    def op(x):
        y = x
        for dim, kind in live:
            launcher, n, _, counter = _group(p, kind)
            wire = _wire(y)
            _count(p, counter, wire, True, n)
            gathered = tf_private.launcher_all_gather(launcher, wire)
            y = tf.cast(_concat_gathered(gathered, wire, n, dim), x.dtype)
        return y, lambda dy: block_gradient(dy, splits, p, tuple(x.shape))

    return op(x)


def block_gradient(
    dy: Any,
    splits: tuple[tuple[int, str], ...],
    p: Placement,
    block_shape: tuple[int, ...],
    summed_over_tensor: bool = False,
) -> Any:
    """A full weight's gradient on this replica, summed over each split's
    group with this replica's block kept: over both groups, the sum over
    every replica, which the optimizer applies as it is (a reduce-scatter
    done as an all-reduce and a slice: TensorFlow's launcher has no
    reduce-scatter). A lookup's sparse gradient stays sparse
    (:func:`_block_of_slices`). ``summed_over_tensor``: ``dy`` already holds
    the tensor group's rows (a tensor-parallel layer's block)."""
    live = _live(splits, p)
    # Split over the data axis alone, the block is replicated over the tensor
    # group, whose members' gradients (of other rows) are summed whole too.
    replicated_over_tensor = (
        any(kind == "data" for _, kind in live)
        and not any(kind == "tensor" for _, kind in live)
        and p.tp > 1
        and not summed_over_tensor
    )
    if isinstance(dy, tf.IndexedSlices):
        if replicated_over_tensor:
            live = [(None, "tensor")] + live
        return _block_of_slices(p, dy, live, block_shape)
    dy = tf.convert_to_tensor(dy)
    if replicated_over_tensor:
        wire = _wire(dy)
        _count(p, "tensor_parallel", wire, False, p.tp)
        dy = tf.cast(p.runtime.tp[p.replica].all_reduce(wire), dy.dtype)
    # The static shape at each stage (a gradient from the tape may have lost
    # it; compressors and byte counts need it).
    shape = list(block_shape)
    for dim, kind in live:
        shape[dim] *= _group(p, kind)[1]
    dy.set_shape(shape)
    for dim, kind in reversed(live):
        launcher, n, index, counter = _group(p, kind)
        aggregator = None
        if kind == "data":  # The data-axis sum takes the strategy's cast compression.
            aggregator = cast_aggregator(tf.distribute.get_strategy())
        if aggregator is not None:
            summed = compressed_group_sum(dy, p, aggregator)
        else:
            wire = _wire(dy)
            _count(p, counter, wire, False, n)
            summed = tf.cast(launcher.all_reduce(wire), dy.dtype)
        shape[dim] //= n
        dy = _slice_along(summed, dim, index, shape[dim])
        dy.set_shape(shape)
    return dy


def _block_of_slices(
    p: Placement, dy: tf.IndexedSlices, live: list, block_shape: tuple
) -> tf.IndexedSlices:
    """A gathered table's sparse gradient (a lookup's), for this replica's
    block: every replica's slices, gathered as Keras's all-replica sum does
    for a whole table, then the rows and columns of the block. Kept sparse
    because Adam squares the slices before their duplicates are summed:
    a dense sum would train differently from the same model unsharded.

    Each member first adds one zero slice at index -1, dropped after the
    gathers: a member whose batch hit no row of its block has no slices, and
    TensorFlow's all-gather of a group whose tensors are all empty crashes
    the process (a segmentation fault on TF 2.21), as a vocabulary block
    that no id of the batch falls in gave before the vocabulary-parallel
    lookup read every id (tfdist.distribution.megatron); an uneven last batch
    can still leave a replica no rows."""
    if live:
        dy = _with_sentinel(dy)
    for _, kind in live:
        launcher, n, _, counter = _group(p, kind)
        p.runtime.sent[counter].assign_add(
            tf.cast(
                tf.size(dy.values) * dy.values.dtype.size
                + tf.size(dy.indices) * dy.indices.dtype.size,
                tf.float64,
            )
            * (n - 1)
        )
        dy = launcher.all_reduce_indexed_slices(dy)
    values, indices = dy.values, dy.indices
    if live:
        kept = indices >= 0
        values, indices = tf.boolean_mask(values, kept), tf.boolean_mask(indices, kept)
    for dim, kind in live:
        if dim is None:  # Gathered whole: no block of this group's.
            continue
        _, _, index, _ = _group(p, kind)
        width = block_shape[dim]
        if dim == 0:
            start = tf.cast(index * width, indices.dtype)
            mine = tf.logical_and(indices >= start, indices < start + width)
            values, indices = tf.boolean_mask(values, mine), tf.boolean_mask(indices, mine) - start
        else:
            values = _slice_along(values, dim, index, width)
    return tf.IndexedSlices(values, indices, tf.constant(block_shape, tf.int64))


def _with_sentinel(dy: tf.IndexedSlices) -> tf.IndexedSlices:
    """``dy`` with one more slice: zeros at index -1 (never a real row)."""
    zeros = tf.zeros(tf.concat([[1], tf.shape(dy.values)[1:]], 0), dy.values.dtype)
    return tf.IndexedSlices(
        tf.concat([dy.values, zeros], 0),
        tf.concat([dy.indices, tf.constant([-1], dy.indices.dtype)], 0),
        dy.dense_shape,
    )


# --- An aggregator's collectives over the data-parallel group ---------------


class GroupComm(ReplicaComm):
    """An aggregator's collectives over this replica's data-parallel group."""

    def __init__(self, placement: Placement) -> None:
        super().__init__(placement.mesh.dp)

    # The placement is looked up per call, as ReplicaComm looks up its
    # context: under MirroredStrategy on CPU, cond() runs both branches for
    # every replica from one replica's closure.
    def reduce_sum(self, tensors):
        p = current()
        launcher = p.runtime.dp[p.replica]
        # IndexedSlices (a vocabulary shard's) are gathered, as the replica
        # context's all_reduce does.
        return [
            launcher.all_reduce_indexed_slices(t)
            if isinstance(t, tf.IndexedSlices)
            else launcher.all_reduce(tf.convert_to_tensor(t))
            for t in tensors
        ]

    def gather_rows(self, rows):
        p = current()
        return tf_private.launcher_all_gather(p.runtime.dp[p.replica], rows)

    def sent(self) -> float:
        """Bytes this replica sent in the collectives recorded so far."""
        reduced = sum(nbytes(s, d) for s, d in self.reduced)
        gathered = sum(wire_nbytes(s, d) for s, d in self.gathered)
        return all_reduce_bytes(reduced, self.num_replicas) + all_gather_bytes(
            gathered, self.num_replicas
        )


#: Compressors a reduce-scatter can use: elementwise casts, no state.
CAST_COMPRESSORS = ("fp16", "bf16")


def cast_aggregator(strategy: Any) -> Any:
    """The strategy's aggregator when it is a cast without error feedback
    (what a weight split over the data-parallel group can use), else None."""
    aggregator = keras_hook.strategy_aggregator(strategy)
    if (
        aggregator is None
        or getattr(aggregator, "memory", True) is not None
        or getattr(aggregator, "name", None) not in CAST_COMPRESSORS
    ):
        return None
    return aggregator


def compressed_group_sum(dy: tf.Tensor, p: Placement, aggregator: Any) -> tf.Tensor:
    """``dy`` summed over this replica's data-parallel group through a cast
    aggregator (its bytes counted as data-parallel traffic)."""
    comm = GroupComm(p)
    [summed] = aggregator.aggregate([Item(dy, 0, {})], tf.constant(0, tf.int64), comm)
    p.runtime.sent["data_parallel"].assign_add(tf.constant(comm.sent(), tf.float64))
    return summed


def dp_all_reduce(x: tf.Tensor, p: Placement | None = None) -> tf.Tensor:
    """Sums over the data-parallel group (the replicas holding the same
    shards). For gradients: no gradient of its own."""
    p = p or current()
    if p is None:
        return x
    if p.mesh.dp < 2:
        return tf.identity(x)
    _count(p, "data_parallel", x, False, p.mesh.dp)
    return p.runtime.dp[p.replica].all_reduce(x)


def count_replicated(x: tf.Tensor, p: Placement) -> None:
    """Counts the all-replica all-reduce of a replicated weight's gradient."""
    _count(p, "data_parallel", x, False, p.mesh.num_replicas)


def traffic(strategy: Any) -> dict[str, float]:
    """Bytes one replica sent so far, per kind (the mean over this process's
    replicas): ``tensor_parallel`` (activations and their gradients) and
    ``data_parallel`` (gradients). Empty without a mesh."""
    runtime = runtime_of(strategy)
    return runtime.traffic() if runtime is not None else {}


def reset_traffic(strategy: Any) -> None:
    """Sets the byte counters to zero."""
    runtime = runtime_of(strategy)
    if runtime is not None:
        for v in runtime.sent.values():
            v.assign(tf.zeros([], tf.float64))
