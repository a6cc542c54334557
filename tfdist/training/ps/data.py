"""What :func:`tfdist.fit` trains on under a parameter-server strategy: the checks of
its arguments, and the per-worker datasets built from arrays, a dataset or a
``dataset_fn``; the errors it raises.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from tfdist.compat import keras_private
from tfdist.errors import ConfigError, TfdistError

PS = tf.distribute.experimental.ParameterServerStrategy
SOURCE = "tfdist.fit"
#: Closures kept in flight per worker: enough to keep every worker busy.
IN_FLIGHT_PER_WORKER = 4


class ParameterServerError(TfdistError, RuntimeError):
    """A parameter server (or the cluster) failed during training."""


class StepTimeoutError(TfdistError, RuntimeError):
    """No training step finished within ``step_timeout`` seconds."""


# --------------------------------------------------------------------------
# Checks and data.


def verbosity(verbose: Any) -> int:
    """Keras's ``verbose`` with ``"auto"`` as 1."""
    return 1 if verbose == "auto" else verbose


def check_model(model: Any, strategy: Any) -> None:
    """Raises ConfigError unless ``model`` was compiled under ``strategy``."""
    if not getattr(model, "compiled", False) or getattr(model, "optimizer", None) is None:
        raise ConfigError(
            "model",
            type(model).__name__,
            "a model compiled with an optimizer, inside strategy.scope()",
            source=SOURCE,
        )
    if getattr(model, "_distribute_strategy", None) is not strategy:
        raise ConfigError(
            "model",
            getattr(model, "name", type(model).__name__),
            "a model created and compiled inside strategy.scope() of the ParameterServerStrategy",
            source=SOURCE,
            hint="Under ParameterServerStrategy the variables live on the ps; "
            "build the model with `with strategy.scope(): model = ...; "
            "model.compile(...)`.",
        )


def is_dataset_fn(x: Any) -> bool:
    """Whether ``x`` is a dataset function rather than data."""
    return callable(x) and not isinstance(x, (tf.data.Dataset, np.ndarray, tf.Tensor))


def check_positive_int(field: str, value: Any, *, allow_none: bool = True) -> None:
    """Raises ConfigError unless ``value`` is an integer >= 1 (or None if allowed)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(
            field, value, "an integer >= 1" + (" or None" if allow_none else ""), source=SOURCE
        )


def _as_tuple(x: Any, y: Any, sample_weight: Any) -> tuple:
    parts = (x,) if y is None else (x, y) if sample_weight is None else (x, y, sample_weight)
    return parts


def _num_rows(x: Any) -> int:
    first = tf.nest.flatten(x)[0]
    return int(first.shape[0])


def local_dataset(
    x: Any, y: Any, sample_weight: Any, batch_size: int | None, field: str
) -> tf.data.Dataset:
    """A dataset the coordinator itself reads (validation, building)."""
    if isinstance(x, tf.data.Dataset):
        return x
    if is_dataset_fn(x):
        return x(tf.distribute.InputContext())
    if isinstance(x, tuple) and y is None and len(x) in (2, 3):
        x, y, *rest = x
        sample_weight = rest[0] if rest else sample_weight
    if x is None:
        raise ConfigError(
            field, None, "a tf.data.Dataset, a dataset function or arrays", source=SOURCE
        )
    data = tf.data.Dataset.from_tensor_slices(_as_tuple(x, y, sample_weight))
    return data.batch(batch_size or 32)


class TrainData:
    """Training data as the coordinator needs it: a per-worker dataset."""

    def __init__(
        self,
        x: Any,
        y: Any,
        sample_weight: Any,
        batch_size: int | None,
        shuffle: bool,
        steps_per_epoch: int | None,
    ) -> None:
        #: A dataset to copy to each worker, or None when ``make`` builds
        #: each worker's from its input context.
        self.dataset: tf.data.Dataset | None = None
        self.make: Callable | None = None
        if isinstance(x, tf.data.Dataset):
            steps_per_epoch = self._from_dataset(x, y, steps_per_epoch)
        elif is_dataset_fn(x):
            steps_per_epoch = self._from_function(x, steps_per_epoch)
        else:
            steps_per_epoch = self._from_arrays(
                x, y, sample_weight, batch_size, shuffle, steps_per_epoch
            )
        check_positive_int("steps_per_epoch", steps_per_epoch, allow_none=False)
        self.steps_per_epoch = int(steps_per_epoch)

    def _from_dataset(self, x: tf.data.Dataset, y: Any, steps_per_epoch: int | None) -> int:
        if y is not None:
            raise ConfigError(
                "y",
                type(y).__name__,
                "None when x is a dataset (the dataset yields (x, y))",
                source=SOURCE,
            )
        cardinality = int(x.cardinality())
        if steps_per_epoch is None:
            if cardinality < 0:
                raise ConfigError(
                    "steps_per_epoch",
                    None,
                    "a number of steps: this dataset's length is unknown or infinite",
                    source=SOURCE,
                    hint="Under ParameterServerStrategy an epoch is "
                    "steps_per_epoch steps over all workers.",
                )
            steps_per_epoch = cardinality
        # Serialized by the coordinator and rebuilt on each worker.
        self.dataset = x if cardinality == tf.data.INFINITE_CARDINALITY else x.repeat()
        self.sample = next(iter(x.take(1)))
        return steps_per_epoch

    def _from_function(self, fn: Callable, steps_per_epoch: int | None) -> int:
        if steps_per_epoch is None:
            raise ConfigError(
                "steps_per_epoch",
                None,
                "a number of steps when x is a dataset function",
                source=SOURCE,
            )

        def make(context):
            dataset = fn(context)
            if not isinstance(dataset, tf.data.Dataset):
                raise ConfigError(
                    "x",
                    f"a function returning {type(dataset).__name__}",
                    "a function returning a tf.data.Dataset",
                    source=SOURCE,
                )
            # (Traced: the length may only be known when it runs.)
            if tf.get_static_value(dataset.cardinality()) != tf.data.INFINITE_CARDINALITY:
                dataset = dataset.repeat()
            return dataset

        self.sample = next(iter(make(tf.distribute.InputContext()).take(1)))
        self.make = make
        return steps_per_epoch

    def _from_arrays(
        self,
        x: Any,
        y: Any,
        sample_weight: Any,
        batch_size: int | None,
        shuffle: bool,
        steps_per_epoch: int | None,
    ) -> int:
        if x is None:
            raise ConfigError(
                "x", None, "a tf.data.Dataset, a dataset function or arrays", source=SOURCE
            )
        batch = batch_size or 32
        check_positive_int("batch_size", batch)
        tensors = _as_tuple(x, y, sample_weight)
        rows = _num_rows(x)
        if steps_per_epoch is None:
            steps_per_epoch = max(1, math.ceil(rows / batch))

        def make(context):
            data = tf.data.Dataset.from_tensor_slices(tensors)
            data = data.shard(context.num_input_pipelines, context.input_pipeline_id)
            if shuffle:
                data = data.shuffle(
                    max(1, rows // context.num_input_pipelines),
                    seed=context.input_pipeline_id,
                    reshuffle_each_iteration=True,
                )
            return data.repeat().batch(batch).prefetch(2)

        self.sample = tf.nest.map_structure(lambda t: t[:batch], tensors)
        self.make = make
        return steps_per_epoch


def build(model: Any, strategy: Any, data: Any) -> None:
    """Creates every variable (model, optimizer, metrics) on the ps, now.

    Scheduled functions cannot create variables, so Keras's lazy building
    has to happen here, on the coordinator, from one batch.
    """
    if isinstance(data, tf.data.Dataset):
        data = next(iter(data.take(1)))
    with strategy.scope():
        keras_private.symbolic_build(model, data_batch=data)
