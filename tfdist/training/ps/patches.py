"""What Keras 3 needs to train under ParameterServerStrategy.

The fixes, installed once by tfdist's ``ParameterServerStrategy``:

* **Atomic increments.** Keras 3's ``Variable.assign_add`` is
  ``assign(self + value)``: a read, then a write. Workers of a
  parameter-server job run steps concurrently against the same ps
  variables, so increments are lost (measured: 200 steps left
  ``optimizer.iterations`` at 160, and metric totals short). Under a
  parameter-server strategy the patched methods send one
  ``AssignAddVariableOp`` to the ps, which applies it atomically.
* **Sharded variables.** With a ``variable_partitioner`` a Keras variable
  holds a ``ShardedVariable``, which has no ``handle``: ``tape.gradient``
  on it fails, and so do ``strategy.extended.update`` and saving
  (``numpy()``/``__array__``). ``GradientTape.gradient`` is wrapped so
  that a sharded source (a Keras variable holding a ShardedVariable, or a
  ShardedVariable) is differentiated shard by shard and the shards'
  gradients are joined (:func:`gradients`), in ``tfdist.fit`` and in a
  user's own ``ClusterCoordinator`` loop alike; any other call goes to
  TensorFlow's method unchanged. The optimizer update of a sharded variable
  is applied directly (``ShardedVariable.assign_sub`` splits the update
  over the shards); reads for saving concatenate the shards.

* **``model.fit``, ``evaluate`` and ``predict``.** Keras 3's fail under
  ParameterServerStrategy (keras-team/keras#18624: "To use this dataset, you
  need to pass this dataset to ClusterCoordinator.create_per_worker_dataset").
  For a model created under tfdist's ParameterServerStrategy they run
  :func:`tfdist.fit` / ``evaluate`` / ``predict``, which take the same
  arguments, so a script that calls ``model.fit`` works unchanged.

Everywhere else (other strategies, symbolic and stateless scopes) Keras's
own code runs unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfdist.compat.keras_src import (
    base_optimizer_module as base_optimizer,
    in_stateless_scope,
    in_symbolic_scope,
)
from tfdist.compat.tf_python import ShardedVariable

__all__ = [
    "install",
    "gradients",
    "is_sharded",
    "raw_variable",
    "shards",
    "wrap_assign_add",
    "wrap_assign_sub",
    "wrap_numpy",
    "wrap_array",
    "wrap_update_step",
    "wrap_slot_from_reference",
    "wrap_tape_gradient",
]

_PS = tf.distribute.experimental.ParameterServerStrategy


def _under_parameter_server() -> bool:
    return isinstance(tf.distribute.get_strategy(), _PS)


def _atomic(method: str, keras_method: Any) -> Any:
    @functools.wraps(keras_method)
    def assign(self, value):
        if (
            self._value is None
            or in_stateless_scope()
            or in_symbolic_scope()
            or not _under_parameter_server()
        ):
            return keras_method(self, value)
        value = tf.cast(value, self._value.dtype)
        getattr(self._value, method)(value, read_value=False)
        return self._value

    return assign


def _update_step(keras_method: Any) -> Any:
    @functools.wraps(keras_method)
    def update(self, distribution, grads_and_vars, learning_rate):
        plain = []
        for grad, var in grads_and_vars:
            if isinstance(var, ShardedVariable):
                # extended.update cannot colocate with a ShardedVariable;
                # its assign ops place each shard's update on its own ps.
                self.update_step(grad, var, learning_rate)
            else:
                plain.append((grad, var))
        return keras_method(self, distribution, plain, learning_rate)

    return update


def _slot_from_reference(keras_method: Any) -> Any:
    @functools.wraps(keras_method)
    def add_variable_from_reference(self, reference_variable, name=None, initializer="zeros"):
        if _shards(reference_variable) is None:
            return keras_method(self, reference_variable, name=name, initializer=initializer)
        # Keras colocates the slot with its variable, which a ShardedVariable
        # refuses inside a function (the optimizer builds lazily in the
        # user's first scheduled step). Create it eagerly instead, out of
        # the function (as keras#23087 does for every optimizer variable):
        # the strategy's partitioner shards it like its variable.
        with tf.init_scope():
            return base_optimizer.BaseOptimizer.add_variable_from_reference(
                self, reference_variable, name=name, initializer=initializer
            )

    return add_variable_from_reference


def _whole(keras_method: Any, to_numpy: Any) -> Any:
    @functools.wraps(keras_method)
    def read(self, *args, **kwargs):
        if isinstance(self._value, ShardedVariable):
            return to_numpy(tf.convert_to_tensor(self._value).numpy(), *args, **kwargs)
        return keras_method(self, *args, **kwargs)

    return read


def _tape_gradient(tf_method: Any) -> Any:
    @functools.wraps(tf_method)
    def gradient(
        self,
        target,
        sources,
        output_gradients=None,
        unconnected_gradients=tf.UnconnectedGradients.NONE,
    ):
        flat = tf.nest.flatten(sources)
        shards = [_shards(source) for source in flat]
        if not any(shards):
            return tf_method(self, target, sources, output_gradients, unconnected_gradients)
        expanded = [parts if parts else source for parts, source in zip(shards, flat)]
        grads = tf_method(self, target, expanded, output_gradients, unconnected_gradients)
        joined = [
            _join(grad, [int(v.shape[0]) for v in parts]) if parts else grad
            for parts, grad in zip(shards, grads)
        ]
        return tf.nest.pack_sequence_as(sources, joined)

    return gradient


def _shards(source: Any) -> list | None:
    """The shard variables behind a sharded source, else None.

    Reads Keras's ``_value`` rather than ``value``: no autocast, no scope.
    """
    raw = getattr(source, "_value", source) if isinstance(source, keras.Variable) else source
    return list(raw.variables) if isinstance(raw, ShardedVariable) else None


def install() -> None:
    """Installs the fixes (the registry's ``parameter_server``); idempotent."""
    from tfdist import compat

    compat.install("parameter_server")


# The wrappers the registry names (tfdist.compat.registry), one per target.
def wrap_assign_add(original: Any) -> Any:
    return _atomic("assign_add", original)


def wrap_assign_sub(original: Any) -> Any:
    return _atomic("assign_sub", original)


def wrap_numpy(original: Any) -> Any:
    # Saving reads variables with numpy()/__array__, which ShardedVariable
    # lacks: read the whole value instead.
    return _whole(original, lambda value: value)


def wrap_array(original: Any) -> Any:
    return _whole(original, lambda value, dtype=None, **_: np.asarray(value, dtype))


def wrap_update_step(original: Any) -> Any:
    return _update_step(original)


def wrap_slot_from_reference(original: Any) -> Any:
    return _slot_from_reference(original)


def wrap_tape_gradient(original: Any) -> Any:
    return _tape_gradient(original)


def raw_variable(weight: Any) -> Any:
    """The tf.Variable (or ShardedVariable) behind a Keras variable."""
    return weight.value if isinstance(weight, keras.Variable) else weight


def is_sharded(weight: Any) -> bool:
    return isinstance(raw_variable(weight), ShardedVariable)


def shards(weight: Any) -> list[tf.Variable]:
    """The variables that hold ``weight``, one per shard, in row order.

    Keras 3 keeps one ``keras.Variable`` per layer weight: under a
    ``variable_partitioner``, ``layer.weights`` lists one variable of the
    whole shape (an Embedding's ``(8, 16384)`` table), and the partitioner's
    shards are behind it. TF-Keras listed the shards themselves in
    ``layer.weights``, which TensorFlow's parameter-server tutorial checks.

    Args:
        weight: A Keras variable, a ``tf.Variable`` or a ``ShardedVariable``.

    Returns:
        Its shard variables (each with its ``shape`` and the ``device`` of
        its ps), or ``[variable]`` for one that is not sharded.
    """
    parts = _shards(weight)
    if parts is not None:
        return parts
    return [getattr(weight, "_value", weight) if isinstance(weight, keras.Variable) else weight]


def _join(parts: Sequence[Any], shard_rows: Sequence[int]) -> Any:
    """One gradient for a sharded variable from its shards' gradients."""
    if all(p is None for p in parts):
        return None
    if any(isinstance(p, tf.IndexedSlices) for p in parts):
        # Rows of shard i are rows offset_i.. of the whole variable.
        values, indices, offset = [], [], 0
        for part, rows in zip(parts, shard_rows):
            if isinstance(part, tf.IndexedSlices):
                values.append(part.values)
                indices.append(tf.cast(part.indices, tf.int64) + offset)
            elif part is not None:
                values.append(part)
                indices.append(tf.range(offset, offset + rows, dtype=tf.int64))
            offset += rows
        dense_shape = tf.TensorShape([offset]).concatenate(values[0].shape[1:])
        return tf.IndexedSlices(
            tf.concat(values, 0),
            tf.concat(indices, 0),
            tf.constant(dense_shape.as_list(), tf.int64),
        )
    template = next(p for p in parts if p is not None)
    return tf.concat(
        [
            p if p is not None else tf.zeros([rows, *template.shape[1:]], template.dtype)
            for p, rows in zip(parts, shard_rows)
        ],
        0,
    )


def gradients(tape: tf.GradientTape, target: Any, weights: Sequence[Any]) -> list:
    """``tape.gradient(target, weights)`` that also works on sharded variables.

    Args:
        tape: The tape that recorded the forward pass.
        target: The (scaled) loss.
        weights: Keras or tf variables; some may hold a ShardedVariable.

    Returns:
        One gradient per weight, shaped like the whole variable (dense, or
        IndexedSlices over the whole variable's rows).
    """
    sources = []
    for weight in weights:
        raw = raw_variable(weight)
        sources.append(list(raw.variables) if isinstance(raw, ShardedVariable) else raw)
    grads = tape.gradient(target, sources)
    joined = []
    for source, grad in zip(sources, grads):
        if isinstance(source, list):
            rows = [int(s.shape[0]) for s in source]
            grad = _join(grad, rows)
        joined.append(grad)
    return joined
