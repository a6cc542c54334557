"""Sharded weights: one full weight split over a tensor group.

A sharded weight is an ordinary Keras weight of the shard's shape, created
in the strategy's scope, so it is a MirroredVariable with one component per
local replica. Its components are then overwritten with *different* shards
of one full initial value: the component of the replica at tensor index
``t`` holds shard ``t``. The optimizer's slots (Adam's moments) are created
from it with the same shape and device, so they shard with it.

The trap this module exists for: Keras and TensorFlow read a MirroredVariable
from its first component, so ``get_weights()``, ``model.save`` and
``tf.train.Checkpoint`` would keep shard 0 only. :func:`full_value` and
:func:`assign_full` give and take the full weight; :mod:`tfdist.parallel.saving`
uses them for every way out.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfdist.compat import keras_private
from tfdist.errors import ConfigError
from tfdist.parallel import collectives
from tfdist.parallel.spec import (
    DATA,
    TENSOR,
    ShardSpec,
    inner_variable,
    is_sharded,
    mark,
    spec_of,
)

__all__ = [
    "ShardSpec",
    "TENSOR",
    "DATA",
    "add_sharded_weight",
    "spec_of",
    "full_value",
    "full_tensor",
    "write_blocks",
    "first_workers_blocks",
    "assign_blocks",
    "assign_full",
    "check_full_shape",
    "shard_of",
    "register_like",
    "local_full_tensor",
    "is_sharded",
    "inner_variable",
    "mark",
    "cover",
]


def register_like(slot: Any, reference: Any) -> None:
    """Marks ``slot`` (created from ``reference``, same shape and devices) as
    sharded like ``reference``."""
    spec = spec_of(reference)
    if spec is not None:
        mark(slot, spec)


def shard_of(value: Any, spec: ShardSpec, t: int) -> np.ndarray:
    """The ``t``-th shard of a full value split over the tensor group only."""
    return spec.block(np.asarray(value), t)


def _components(variable: Any, spec: ShardSpec) -> list:
    return list(spec.strategy.experimental_local_results(inner_variable(variable)))


def _local_blocks(variable: Any, spec: ShardSpec) -> dict | None:
    """This process's components holding every block once, by block index,
    or None when other processes hold some. Every replica holding a block
    holds the same values (they get the same updates)."""
    runtime = spec.runtime
    if not spec.every_process_covers(len(runtime.devices)):
        return None
    cover = spec.local_cover(runtime.first, len(runtime.devices))
    components = _components(variable, spec)
    return {index: components[i] for index, i in cover.items()}


def _gathered_blocks(variable: Any, spec: ShardSpec) -> dict:
    """Every block, gathered from every replica (a collective: every worker
    must call it at the same point)."""
    strategy, runtime = spec.strategy, spec.runtime
    components = _components(variable, spec)
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.expand_dims(
            tf.convert_to_tensor(components[ctx.replica_id_in_sync_group - runtime.first]), 0
        )
    )
    everything = strategy.gather(per_replica, axis=0)
    blocks: dict = {}
    for r in range(spec.mesh.num_replicas):
        blocks.setdefault(spec.index(r), everything[r])
    return blocks


#: The largest piece of a block moved by one collective, in bytes. A collective
#: over gRPC takes several times its message in temporaries, and TensorFlow's
#: oneDNN CPU allocator (its default on x86) keeps its peak for the life of the
#: process (a 64 MiB all-reduce: +250 MB of resident set on each of 4 workers;
#: 4 MiB: +20 MB), so blocks move in pieces.
PIECE_BYTES = 4 * 2**20


def _pieces(shape: tuple[int, ...], itemsize: int) -> list[slice]:
    """Row ranges of a block of ``shape`` (its first axis) of at most
    :data:`PIECE_BYTES` each (one row may be larger)."""
    rows = shape[0] if shape else 1
    row_bytes = max(1, int(np.prod(shape[1:], dtype=np.int64)) * itemsize)
    step = max(1, PIECE_BYTES // row_bytes)
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


def _sent_by(strategy: Any, sender: int, piece: Any) -> np.ndarray:
    """``piece(ctx)`` of global replica ``sender``, received by every process: a
    sum over the replicas where every other gives zeros (exact: x + 0 = x).
    A collective: every worker calls it at the same point."""

    def given(ctx):
        value = tf.convert_to_tensor(piece(ctx))
        return value if ctx.replica_id_in_sync_group == sender else tf.zeros_like(value)

    summed = strategy.reduce(
        tf.distribute.ReduceOp.SUM,
        strategy.experimental_distribute_values_from_function(given),
        axis=None,
    )
    return summed.numpy()


def _relative(where: tuple[slice, ...], rows: slice) -> tuple[slice, ...]:
    """The slices of rows ``rows`` of the block at ``where`` in the full value."""
    first = where[0] if where else slice(None)
    start = (first.start or 0) + rows.start
    return (slice(start, start + rows.stop - rows.start), *where[1:])


def write_blocks(variable: Any, write: Any) -> None:
    """Hands the full weight to ``write(slices, piece)`` a piece of a block at
    a time (``slices`` index the full value), so no process ever holds it
    whole.

    When other processes hold some blocks, each piece comes from its block's
    owner to every process (:func:`_sent_by`): a collective, every worker must
    call this at the same point, as for :func:`full_value`.
    """
    spec = spec_of(variable)
    if spec is None:
        write((), np.asarray(variable.numpy()))
        return
    blocks = _local_blocks(variable, spec)
    if blocks is not None:
        for index, component in blocks.items():
            write(spec.slices(index), np.asarray(component.numpy()))
        return
    strategy, runtime = spec.strategy, spec.runtime
    components = _components(variable, spec)
    itemsize = components[0].dtype.size
    for index in spec.blocks():
        owner, where = spec.owner(index), spec.slices(index)
        for rows in _pieces(spec.shard_shape, itemsize):

            def piece(ctx, rows=rows):
                return components[ctx.replica_id_in_sync_group - runtime.first][rows]

            write(_relative(where, rows), _sent_by(strategy, owner, piece))


def first_workers_blocks(spec: ShardSpec, full: np.ndarray) -> dict:
    """This process's blocks of worker 0's ``full`` (every worker passes its
    own; the initializers of the workers may draw differently), by index.

    Each block comes from global replica 0 (worker 0's first device) to
    every process a piece at a time (:func:`_sent_by`); each process keeps its
    own blocks. A collective: every worker calls it at the same point.
    """
    strategy, runtime = spec.strategy, spec.runtime
    mine = {spec.index(runtime.first + i) for i in range(len(runtime.devices))}
    blocks = {}
    for index in spec.blocks():
        block = full[spec.slices(index)]
        pieces = []
        for rows in _pieces(spec.shard_shape, full.dtype.itemsize):
            piece = np.ascontiguousarray(block[rows])
            pieces.append(_sent_by(strategy, 0, lambda ctx, piece=piece: piece))
        if index in mine:
            blocks[index] = np.concatenate(pieces) if len(pieces) > 1 else pieces[0]
    return blocks


def assign_blocks(variable: Any, blocks: dict) -> None:
    """Gives each local component its block, from ``blocks`` by index."""
    spec = spec_of(variable)
    for i, component in enumerate(_components(variable, spec)):
        block = blocks[spec.index(spec.runtime.first + i)]
        component.assign(block.astype(component.dtype.as_numpy_dtype, copy=False))


def full_value(variable: Any) -> np.ndarray:
    """The full weight, from one replica of each block.

    Under MultiWorkerMirrored with the blocks spread over processes this is
    a collective: every worker must call it at the same point.
    """
    spec = spec_of(variable)
    if spec is None:
        return np.asarray(variable.numpy())
    blocks = _local_blocks(variable, spec)
    if blocks is None:
        blocks = _gathered_blocks(variable, spec)
    return spec.assemble(
        {k: np.asarray(v.numpy()) for k, v in blocks.items()},
        lambda parts, axis: np.concatenate(parts, axis=axis),
    )


def full_tensor(variable: Any) -> tf.Tensor:
    """The full weight as a tensor; graph-safe (a multi-task checkpoint saves
    inside a tf.function). A collective when the blocks span processes."""
    spec = spec_of(variable)
    blocks = _local_blocks(variable, spec)
    return _assemble_tensor(
        spec, blocks if blocks is not None else _gathered_blocks(variable, spec)
    )


def _assemble_tensor(spec: ShardSpec, blocks: dict) -> tf.Tensor:
    return spec.assemble(
        {k: tf.convert_to_tensor(v) for k, v in blocks.items()},
        lambda parts, axis: tf.concat(parts, axis=axis),
    )


def local_full_tensor(variable: Any) -> tf.Tensor:
    """The full weight as a tensor, for a call outside the replica context
    (a symbolic build, or ``model(x)`` in the strategy's scope)."""
    spec = spec_of(variable)
    if spec is None:
        return variable
    blocks = _local_blocks(variable, spec)
    if blocks is None:
        from tfdist.compat.keras_src import in_symbolic_scope

        if in_symbolic_scope():
            # Keras infers shapes (compute_output_spec, fit's symbolic
            # build): the values are never read.
            return tf.zeros(spec.full_shape, inner_variable(variable).dtype)
        raise RuntimeError(
            "tfdist.parallel: a sharded weight was read outside the replica "
            "context, and its shards are held by other processes. Expected: call the "
            "model through fit/evaluate/predict or strategy.run. Received: a direct call "
            "under MultiWorkerMirroredStrategy"
        )
    return _assemble_tensor(spec, blocks)


def check_full_shape(variable: Any, value: Any, what: str = "a value") -> None:
    """Raises ValueError unless ``value`` has the full shape of a sharded
    variable."""
    spec = spec_of(variable)
    shape = tuple(np.shape(value)) if not tf.is_tensor(value) else tuple(value.shape)
    if spec is not None and shape != spec.full_shape:
        raise ValueError(
            f"tfdist.parallel: expected {what} of the full shape "
            f"{spec.full_shape} for {getattr(variable, 'path', variable.name)}. "
            f"Received: shape {shape}"
        )


def assign_full(variable: Any, value: Any) -> None:
    """Writes a full value: each local component gets its replica's block.

    Raises:
        ValueError: ``value`` does not have the full shape.
    """
    spec = spec_of(variable)
    if spec is None:
        variable.assign(value)
        return
    if not (hasattr(value, "shape") and hasattr(value, "__getitem__")):
        value = np.asarray(value)
    check_full_shape(variable, value)
    # Indexed block by block: a lazy value (a dataset of the weights file) is
    # read only where this process's devices hold blocks; and piece by piece
    # (PIECE_BYTES), so a block read from the file never sits in memory
    # beside its copies (numpy's, the tensor's) whole.
    for i, component in enumerate(_components(variable, spec)):
        where = spec.slices(spec.index(spec.runtime.first + i))
        dtype = component.dtype.as_numpy_dtype
        pieces = _pieces(spec.shard_shape, np.dtype(dtype).itemsize)
        if len(pieces) == 1:
            component.assign(np.asarray(value[where]).astype(dtype, copy=False))
            continue
        for rows in pieces:
            piece = np.asarray(value[_relative(where, rows)]).astype(dtype, copy=False)
            _write_rows(component, rows, piece)


def _write_rows(component: Any, rows: slice, piece: np.ndarray) -> None:
    """``component[rows] = piece``, in place. ``component[rows].assign`` reads
    the whole variable first, and TensorFlow copies a variable's buffer on a
    write while a read of it is alive: one more block in memory at the first
    piece (a 64 MiB block peaked at 136 MiB that way, at 75 MiB this way)."""
    shape = tuple(component.shape)
    tf.raw_ops.ResourceStridedSliceAssign(
        ref=component.handle,
        begin=[rows.start] + [0] * (len(shape) - 1),
        end=[rows.stop, *shape[1:]],
        strides=[1] * len(shape),
        value=piece,
    )


def _seeded(initializer: Any, seed: int | None) -> Any:
    """The initializer with a fixed seed if it takes one and has none."""
    config = initializer.get_config() if hasattr(initializer, "get_config") else {}
    if seed is None or "seed" not in config or config["seed"] is not None:
        return initializer
    return type(initializer).from_config({**config, "seed": seed})


def _shared_seed(strategy: Any, runtime: Any) -> int | None:
    """A seed every worker agrees on, when the groups span processes: a
    variable created in a MultiWorkerMirrored scope takes worker 0's value."""
    if getattr(strategy, "kind", "") != "multi_worker_mirrored":
        return None
    with tf.init_scope(), strategy.scope():
        drawn = int(np.random.default_rng().integers(1, 2**31 - 1))
        seed = tf.Variable(drawn, dtype=tf.int64, trainable=False)
        return int(strategy.experimental_local_results(seed)[0].numpy())


def cover(cls: type) -> None:
    """Makes ``cls.save_own_variables`` / ``load_own_variables`` write and read
    full values of its sharded variables; idempotent (also for subclasses of
    a covered class).

    ``Layer`` and ``BaseOptimizer`` are covered by
    :func:`tfdist.parallel.saving.install`; a
    subclass that defines its own method (Keras's ``Dense`` does) gets the
    registry's dynamic ``tensor_parallel.save_subclass`` / ``load_subclass``
    on the class that defines it.
    """
    from tfdist import compat

    for method, patch in (
        ("save_own_variables", "tensor_parallel.save_subclass"),
        ("load_own_variables", "tensor_parallel.load_subclass"),
    ):
        definer = next((klass for klass in cls.__mro__ if method in vars(klass)), None)
        if definer is None or definer.__module__.startswith("tfdist."):
            continue
        if getattr(definer, "__name__", "") in (
            "Layer",
            "BaseOptimizer",
        ) and definer.__module__.startswith("keras."):
            continue  # The static patches of install().
        compat.apply_to(patch, definer, method)


def add_sharded_weight(
    layer: Any,
    name: str,
    shape: tuple[int, ...],
    axis: int,
    initializer: Any,
    regularizer: Any = None,
    constraint: Any = None,
    dtype: Any = None,
    trainable: bool = True,
) -> Any:
    """Adds a weight of full shape ``shape`` to ``layer``, split on ``axis``.

    Under a strategy with a mesh of T > 1 the weight has the shard's shape;
    otherwise this is ``layer.add_weight`` with the full shape.

    Raises:
        ConfigError: T does not divide ``shape[axis]``; the message names the
            layer.
    """
    import keras

    strategy = tf.distribute.get_strategy()
    runtime = collectives.runtime_of(strategy)
    shape = tuple(int(s) for s in shape)
    if runtime is None:
        return layer.add_weight(
            name=name,
            shape=shape,
            initializer=initializer,
            regularizer=regularizer,
            constraint=constraint,
            dtype=dtype,
            trainable=trainable,
        )
    tp = runtime.mesh.tp
    axis = axis % len(shape)
    if shape[axis] % tp:
        raise ConfigError(
            f"{layer.name}.{name}",
            shape[axis],
            f"a width that model_parallel={tp} divides (the {type(layer).__name__} "
            f"'{layer.name}' splits its {name} of shape {shape} on axis {axis})",
            source="tfdist.parallel",
        )
    spec = ShardSpec.on_tensor_axis(axis, shape, runtime, strategy)
    cover(type(layer))  # Its save/load then write and read full values.
    variable = layer.add_weight(
        name=name,
        shape=spec.shard_shape,
        initializer="zeros",
        regularizer=None,
        constraint=constraint,
        dtype=dtype,
        trainable=trainable,
    )
    mark(variable, spec)
    init = _seeded(keras.initializers.get(initializer), _shared_seed(strategy, runtime))
    with tf.init_scope(), tf.device("/cpu:0"):
        full = keras.ops.convert_to_numpy(init(shape, dtype=variable.dtype))
    if getattr(variable, "_value", True) is None:
        # Created in a symbolic trace (a layer without build() holding this
        # one): Keras creates the tf variable when the trace ends. Mark and
        # fill it then.
        deferred = keras_private.deferred_initializer(variable)

        def _deferred_initialize():
            deferred()
            mark(variable, spec)
            assign_full(variable, full)

        keras_private.set_deferred_initializer(variable, _deferred_initialize)
    else:
        assign_full(variable, full)
    if regularizer is not None:
        variable.regularizer = _GroupRegularizer(keras.regularizers.get(regularizer))
    return variable


class _GroupRegularizer(keras.regularizers.Regularizer):
    """A regularizer of a sharded weight: the tensor group's sum of each
    shard's penalty, which is the full weight's penalty for the ones Keras
    has (L1, L2: sums over elements).

    A ``Regularizer``: Keras 3.10 to 3.14 accept nothing else as a
    variable's regularizer."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, x):
        return collectives.tp_all_reduce(self.inner(x))

    def get_config(self):
        return self.inner.get_config()
