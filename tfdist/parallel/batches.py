"""Uneven batches inside a tensor group: a ConfigError that says what to change.

tfdist.parallel's layers all-gather the rows of their tensor group on input
(:func:`tfdist.parallel.collectives.gather_rows`), so the T replicas of a
group must hold the same number of rows. Keras splits each global batch over
the replicas, and a batch that does not split evenly (the last batch of a
dataset whose size is not a multiple of the global batch, batched without
``drop_remainder``) gives members different row counts. TensorFlow's
collective then fails deep in the graph (measured on TF 2.21, 2 logical
CPUs, T=2, 67 examples in batches of 32)::

    InvalidArgumentError: ... Shape mismatch in the collective instance 106.
    Op at device .../device:CPU:1 expected shape [2,8] but another member in
    the group expected shape [4,8]. ...

Two guards, both raising a :class:`~tfdist.errors.ConfigError` that names
the replicas, the group and the fix:

* **ahead**, where the sizes are known: ``fit``, ``evaluate`` and
  ``predict`` given arrays and a batch size (:func:`check_arrays`). Nothing
  has run, and the process stays usable. This matters most for ``predict``
  on a (2, 2) mesh: a replica given no rows crashed the process
  (segmentation fault in TF 2.21) after the collective's error;
* **after**, for datasets, whose batch sizes are known only as they come:
  the train, test and predict functions turn TF's error into the
  ConfigError. TensorFlow has aborted this process's collectives by then,
  so the message says to start again. Checking ahead inside the step would
  need the row counts of every member, one more collective in every step.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import tensorflow as tf

from tfdist.compat.built_functions import around_built_functions
from tfdist.errors import ConfigError
from tfdist.parallel.collectives import runtime_of

__all__ = [
    "check_arrays",
    "uneven_batch_error",
    "wrap_entry",
    "wrap_make_function",
    "wrap_make_predict_function",
]

_MISMATCH = re.compile(
    r"Shape mismatch in the collective instance \d+\. Op at device "
    r"(\S+) expected shape (\[[^\]]*\]) but another member in the group "
    r"expected shape (\[[^\]]*\])"
)


def uneven_batch_error(error: Exception, strategy: Any) -> ConfigError | None:
    """The ConfigError for TF's collective shape mismatch under a mesh, or None."""
    runtime = runtime_of(strategy)
    match = _MISMATCH.search(str(error))
    if runtime is None or runtime.mesh.tp < 2 or match is None:
        return None
    device, mine, other = match.groups()
    replicas = strategy.num_replicas_in_sync
    return ConfigError(
        "batch_size",
        None,
        f"global batches that split evenly over the {replicas} replicas, so that the "
        f"{runtime.mesh.tp} replicas of each tensor-parallel group hold as many rows",
        source="tfdist.parallel",
        received=f"a batch whose rows differ within a tensor group: the group's all-gather "
        f"on {device} expected shape {mine}, another member {other}",
        hint="Batch the dataset with drop_remainder=True, or make the number of "
        f"examples a multiple of the global batch size and that a multiple of "
        f"{replicas}. TensorFlow has aborted this process's collectives after the "
        "mismatch: start the process again",
    )


def check_arrays(model: Any, x: Any, batch_size: Any) -> None:
    """Refuses arrays whose batches would split unevenly inside a tensor group.

    Raises:
        ConfigError: The global batch size, or the last batch, is not a
            multiple of the number of replicas.
    """
    if x is None or isinstance(x, tf.data.Dataset) or not _under_mesh(model):
        return
    leaves = tf.nest.flatten(x)
    rows = getattr(leaves[0], "shape", [None])[0] if leaves else None
    if rows is None or not isinstance(batch_size or 32, int):
        return  # A generator, a PyDataset or a tensor of unknown length.
    batch = batch_size or 32  # Keras's default for arrays.
    replicas = model.distribute_strategy.num_replicas_in_sync
    last = int(rows) % batch
    uneven = [size for size in (batch, last) if size % replicas]
    if not uneven:
        return
    runtime = runtime_of(model.distribute_strategy)
    raise ConfigError(
        "batch_size",
        batch_size,
        f"batches that split evenly over the {replicas} replicas, so that the "
        f"{runtime.mesh.tp} replicas of each tensor-parallel group hold as many rows",
        source="tfdist.parallel",
        received=f"{int(rows)} examples in batches of {batch}, which leave "
        f"{'a batch' if uneven[0] == batch else 'a last batch'} of {uneven[0]}",
        hint=f"Use a batch size that is a multiple of {replicas}, and a number of "
        f"examples that is a multiple of it (or drop the last {last})",
    )


def wrap_entry(original):
    @functools.wraps(original)
    def entry(self, x=None, *args, **kwargs):
        batch_size = kwargs.get("batch_size")
        if batch_size is None and args:
            # fit(x, y, batch_size) and evaluate(x, y, batch_size); predict(x, batch_size).
            position = 0 if original.__name__ == "predict" else 1
            batch_size = args[position] if len(args) > position else None
        check_arrays(self, x, batch_size)
        return original(self, x, *args, **kwargs)

    return entry


def _converting(function, model):
    @functools.wraps(function)
    def call(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except tf.errors.InvalidArgumentError as error:
            named = uneven_batch_error(error, model.distribute_strategy)
            if named is None:
                raise
            raise named from error

    return call


def _under_mesh(model: Any) -> bool:
    runtime = runtime_of(
        getattr(model, "_distribute_strategy", None) or tf.distribute.get_strategy()
    )
    return runtime is not None and runtime.mesh.tp > 1


_AROUND = around_built_functions(lambda model, function: _converting(function, model), _under_mesh)


def wrap_make_function(original):
    """Keras's train and test functions, naming an uneven batch under a mesh."""
    return _AROUND[0](original)


def wrap_make_predict_function(original):
    """Keras's predict function, the same."""
    return _AROUND[1](original)
