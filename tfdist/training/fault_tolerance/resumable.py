"""A distributed dataset iterator that a ``tf.train.Checkpoint`` can hold.

A custom loop that saves on preemption mid-epoch must resume with the next
batch, not the epoch's first. TensorFlow 2.21 cannot checkpoint the iterator
of a distributed dataset: ``tf.train.Checkpoint(iterator=iter(dist_dataset))``
raises "Checkpoint was expecting iterator to be a trackable object ... got
DistributedIterator", under TensorFlow's MultiWorkerMirroredStrategy and
tfdist's alike. Only a plain ``tf.data`` iterator is trackable, and its
state is this worker's alone: under multi-worker training the checkpoint is
written by the chief (TensorFlow's pattern, and tfdist's), so the other
workers' positions would be lost.

:class:`CheckpointableIterator` keeps what every worker agrees on instead:
how many batches the job has taken from the iterator (synchronous training
takes one per step on every worker). Restoring a checkpoint rebuilds the
iterator over ``dataset.skip(batches)``, distributed as before, so each
worker continues with its own next batch. That is exact when the dataset
gives the same sequence on every run (a seeded shuffle, no random
augmentation without a seed); the skip runs inside tf.data, reading the
skipped batches without training on them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from tfdist.compat.tf_python import trackable_base as trackable
from tfdist.errors import ConfigError, TfdistError

__all__ = ["CheckpointableIterator", "IteratorRestoreError"]

_SOURCE = "CheckpointableIterator"


class IteratorRestoreError(TfdistError, RuntimeError):
    """The iterator was restored after a ``tf.function`` had used it."""


def _kind(data: Any) -> str:
    if isinstance(data, tf.data.Dataset):
        return "dataset"
    if isinstance(data, tf.distribute.DistributedDataset):
        return "distributed"
    if callable(data):
        return "function"
    raise ConfigError(
        "data",
        type(data).__name__,
        "a tf.data.Dataset, a function input_context -> tf.data.Dataset "
        "(as for strategy.distribute_datasets_from_function), or a "
        "distributed dataset",
        source=_SOURCE,
    )


class CheckpointableIterator(trackable.Trackable):
    """An iterator over a distributed dataset whose position is checkpointed.

    Use it where the loop used ``iter(strategy.experimental_distribute_dataset(
    dataset))``, and put it in the checkpoint::

        iterator = tfdist.CheckpointableIterator(dataset, strategy)
        checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer,
                                         iterator=iterator)
        manager = tf.train.CheckpointManager(checkpoint, directory, max_to_keep=2)
        manager.restore_or_initialize()    # Before the first step.
        ...
        train_step(iterator)               # next(iterator) inside, as before

    Args:
        data: The dataset, batched by the global batch (it is distributed with
            ``strategy.experimental_distribute_dataset``); or a function
            ``input_context -> tf.data.Dataset`` (distributed with
            ``strategy.distribute_datasets_from_function``); or an already
            distributed dataset (restoring then calls ``next`` once per
            skipped batch, eagerly: slower).
        strategy: The strategy; default: the one in scope.

    Attributes:
        batches: Batches taken from the iterator since training started
            (restored with the checkpoint).

    Raises:
        ConfigError: ``data`` is none of the above, or the strategy is a
            ParameterServerStrategy (its datasets are per-worker datasets of
            a ``ClusterCoordinator``).
    """

    def __init__(self, data: Any, strategy: tf.distribute.Strategy | None = None) -> None:
        self._kind = _kind(data)
        self._data = data
        self._strategy = strategy or tf.distribute.get_strategy()
        if isinstance(self._strategy, tf.distribute.experimental.ParameterServerStrategy):
            raise ConfigError(
                "strategy",
                type(self._strategy).__name__,
                "a strategy that trains in sync (Mirrored, MultiWorkerMirrored, one device)",
                source=_SOURCE,
                hint="Under ParameterServerStrategy use tfdist.fit with "
                "tfdist.BackupAndRestore, which resumes mid-epoch.",
            )
        with tf.init_scope():
            self._count = tf.Variable(0, dtype=tf.int64, trainable=False, name="batches_taken")
        self._used_in_function = False
        # Made at the first batch or restore, not now: a second iterator over
        # a dataset reshuffled each iteration gets a different order.
        self._iterator: Any = None

    # -- the iterator --------------------------------------------------------

    def _make(self, skip: int) -> Any:
        strategy = self._strategy
        if self._kind == "dataset":
            dataset = self._data.skip(skip) if skip else self._data
            return iter(strategy.experimental_distribute_dataset(dataset))
        if self._kind == "function":
            fn: Callable = self._data
            return iter(
                strategy.distribute_datasets_from_function(
                    lambda context: fn(context).skip(skip) if skip else fn(context)
                )
            )
        iterator = iter(self._data)
        for _ in range(skip):
            next(iterator)
        return iterator

    @property
    def batches(self) -> int:
        return int(self._count.numpy())

    def _current(self) -> Any:
        if self._iterator is None:
            with tf.init_scope():  # Eagerly, also while a step traces.
                self._iterator = self._make(self.batches)
        return self._iterator

    @property
    def element_spec(self) -> Any:
        return self._current().element_spec

    def __iter__(self) -> CheckpointableIterator:
        return self

    def __next__(self) -> Any:
        if tf.inside_function():
            self._used_in_function = True
        batch = next(self._current())
        self._count.assign_add(1)
        return batch

    def get_next(self) -> Any:
        return self.__next__()

    # -- checkpointing ---------------------------------------------------------

    def _serialize_to_tensors(self) -> dict:
        return {"batches": self._count.read_value()}

    def _restore_from_tensors(self, restored_tensors: dict) -> Any:
        if not tf.executing_eagerly():
            raise IteratorRestoreError(
                "CheckpointableIterator can only be restored eagerly (call "
                "checkpoint.restore / manager.restore_or_initialize outside a "
                "tf.function)."
            )
        batches = int(restored_tensors["batches"])
        if self._used_in_function and batches != self.batches:
            # A traced step holds the old iterator: it would go on reading it.
            raise IteratorRestoreError(
                f"the checkpoint moves the iterator to batch {batches}, but a "
                f"tf.function has already read from it (at batch {self.batches}). "
                "Restore the checkpoint before the first training step."
            )
        if self._iterator is not None and batches != self.batches:
            self._iterator = None  # Made again at the next batch, skipping.
        return self._count.assign(batches)
