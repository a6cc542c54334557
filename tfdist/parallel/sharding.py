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

import dataclasses
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfdist.errors import ConfigError
from tfdist.parallel import collectives
from tfdist.parallel.mesh import Mesh

__all__ = ["ShardSpec", "add_sharded_weight", "spec_of", "full_value", "assign_full",
           "shard_of", "register_like", "local_full_tensor", "is_sharded", "inner_variable"]

_ATTR = "_tfdist_shard"


@dataclasses.dataclass(frozen=True, eq=False)
class ShardSpec:
    """How a weight is split.

    Attributes:
        axis: The axis split over the tensor group.
        tp: The number of shards (T).
        full_shape: The full weight's shape.
        runtime: The strategy's mesh runtime.
        strategy: The strategy the weight lives under.
    """

    axis: int
    tp: int
    full_shape: tuple[int, ...]
    runtime: Any
    strategy: Any

    @property
    def mesh(self) -> Mesh:
        return self.runtime.mesh

    @property
    def shard_shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        shape[self.axis] //= self.tp
        return tuple(shape)


def inner_variable(variable: Any) -> Any:
    """The tf.Variable behind a Keras variable (a MirroredVariable here)."""
    inner = getattr(variable, "_value", None)
    return inner if inner is not None else variable


def spec_of(variable: Any) -> ShardSpec | None:
    """The ShardSpec of a Keras variable (or of its tf value), or None."""
    spec = getattr(variable, _ATTR, None)
    if spec is None and hasattr(variable, "_value"):
        spec = getattr(variable._value, _ATTR, None)
    return spec


def is_sharded(variable: Any) -> bool:
    return spec_of(variable) is not None


def _mark(variable: Any, spec: ShardSpec) -> None:
    setattr(variable, _ATTR, spec)
    inner = getattr(variable, "_value", None)
    if inner is not None:
        try:
            setattr(inner, _ATTR, spec)
        except AttributeError:
            pass


def register_like(slot: Any, reference: Any) -> None:
    """Marks ``slot`` (created from ``reference``, same shape and devices) as
    sharded like ``reference``."""
    spec = spec_of(reference)
    if spec is not None:
        _mark(slot, spec)


def shard_of(value: Any, spec: ShardSpec, t: int) -> np.ndarray:
    """The ``t``-th shard of a full value."""
    value = np.asarray(value)
    width = spec.full_shape[spec.axis] // spec.tp
    index = [slice(None)] * value.ndim
    index[spec.axis] = slice(t * width, (t + 1) * width)
    return value[tuple(index)]


def _components(variable: Any, spec: ShardSpec) -> list:
    return list(spec.strategy.experimental_local_results(inner_variable(variable)))


def holds_whole_groups(first: int, local: int, tp: int) -> bool:
    """Whether a process whose ``local`` replicas start at global replica
    ``first`` holds whole tensor groups. Under MultiWorkerMirrored every
    worker has as many replicas, so all workers agree: either all read their
    own group, or all join the collective."""
    return local % tp == 0 and first % tp == 0


def _local_group(variable: Any, spec: ShardSpec) -> list | None:
    """The shards of this process's first tensor group when it holds whole
    groups, else None. Every group holds the same full weight (the replicas
    of one shard get the same updates)."""
    runtime = spec.runtime
    if not holds_whole_groups(runtime.first, len(runtime.devices), spec.tp):
        return None
    return _components(variable, spec)[:spec.tp]


def full_value(variable: Any) -> np.ndarray:
    """The full weight, from the shards of one tensor group.

    Under MultiWorkerMirrored with the groups spread over processes this is
    a collective: every worker must call it at the same point.
    """
    spec = spec_of(variable)
    if spec is None:
        return np.asarray(variable.numpy())
    local = _local_group(variable, spec)
    if local is not None:
        return np.concatenate([c.numpy() for c in local], axis=spec.axis)
    strategy, runtime = spec.strategy, spec.runtime
    components = _components(variable, spec)
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda ctx: components[ctx.replica_id_in_sync_group - runtime.first])
    everything = strategy.gather(per_replica, axis=spec.axis).numpy()
    parts = np.split(everything, spec.mesh.num_replicas, axis=spec.axis)
    return np.concatenate(parts[:spec.tp], axis=spec.axis)


def local_full_tensor(variable: Any) -> tf.Tensor:
    """The full weight as a tensor, for a call outside the replica context
    (a symbolic build, or ``model(x)`` in the strategy's scope)."""
    spec = spec_of(variable)
    if spec is None:
        return variable
    local = _local_group(variable, spec)
    if local is None:
        from tfdist.compat.keras_src import in_symbolic_scope
        if in_symbolic_scope():
            # Keras infers shapes (compute_output_spec, fit's symbolic
            # build): the values are never read.
            return tf.zeros(spec.full_shape, inner_variable(variable).dtype)
        raise RuntimeError(
            "tfdist.parallel: a tensor-parallel layer was called outside the replica "
            "context, and its shards are held by other processes. Expected: call the "
            "model through fit/evaluate/predict or strategy.run. Received: a direct call "
            "under MultiWorkerMirroredStrategy")
    return tf.concat([tf.convert_to_tensor(c) for c in local], axis=spec.axis)


def assign_full(variable: Any, value: Any) -> None:
    """Writes a full value: each local component gets its replica's shard.

    Raises:
        ValueError: ``value`` does not have the full shape.
    """
    spec = spec_of(variable)
    if spec is None:
        variable.assign(value)
        return
    value = np.asarray(value)
    if tuple(value.shape) != spec.full_shape:
        raise ValueError(f"tfdist.parallel: expected a value of the full shape "
                         f"{spec.full_shape} for {getattr(variable, 'path', variable.name)}. "
                         f"Received: shape {tuple(value.shape)}")
    for i, component in enumerate(_components(variable, spec)):
        _, t = spec.mesh.coords(spec.runtime.first + i)
        component.assign(shard_of(value, spec, t).astype(component.dtype.as_numpy_dtype))


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


def add_sharded_weight(layer: Any, name: str, shape: tuple[int, ...], axis: int,
                       initializer: Any, regularizer: Any = None, constraint: Any = None,
                       dtype: Any = None, trainable: bool = True) -> Any:
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
        return layer.add_weight(name=name, shape=shape, initializer=initializer,
                                regularizer=regularizer, constraint=constraint,
                                dtype=dtype, trainable=trainable)
    tp = runtime.mesh.tp
    axis = axis % len(shape)
    if shape[axis] % tp:
        raise ConfigError(f"{layer.name}.{name}", shape[axis],
                          f"a width that model_parallel={tp} divides (the {type(layer).__name__} "
                          f"'{layer.name}' splits its {name} of shape {shape} on axis {axis})",
                          source="tfdist.parallel")
    spec = ShardSpec(axis, tp, shape, runtime, strategy)
    from tfdist.parallel import saving
    saving.cover(type(layer))  # Its save/load then write and read full values.
    variable = layer.add_weight(name=name, shape=spec.shard_shape, initializer="zeros",
                                regularizer=None, constraint=constraint, dtype=dtype,
                                trainable=trainable)
    _mark(variable, spec)
    init = _seeded(keras.initializers.get(initializer), _shared_seed(strategy, runtime))
    with tf.init_scope(), tf.device("/cpu:0"):
        full = keras.ops.convert_to_numpy(init(shape, dtype=variable.dtype))
    if getattr(variable, "_value", True) is None:
        # Created in a symbolic trace (a layer without build() holding this
        # one): Keras creates the tf variable when the trace ends. Mark and
        # fill it then.
        deferred = variable._deferred_initialize

        def _deferred_initialize():
            deferred()
            _mark(variable, spec)
            assign_full(variable, full)
        variable._deferred_initialize = _deferred_initialize
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
