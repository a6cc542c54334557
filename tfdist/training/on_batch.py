"""``train_on_batch``, ``test_on_batch`` and ``predict_on_batch`` under Mirrored.

Keras 3.15's TensorFlow trainer hands these methods' batch to
``strategy.run`` as it is: every replica gets the whole batch, where ``fit``
gives each replica its share. A dense gradient comes out the same (each
replica's copy is scaled by 1/replicas and the copies are summed), but an
embedding's IndexedSlices gradient then holds every lookup once per replica,
at 1/replicas of its value, and Adam squares the slices before their
duplicates are summed: the second moment, and the weights, differ from
``fit``'s (2.4e-2 after 4 steps on 2 replicas with a Keras Embedding,
3.1e-2 with :class:`tfdist.parallel.VocabParallelEmbedding` at T=2). ``predict_on_batch``
returns each row once per replica.

:func:`install` wraps the functions Keras builds so that a batch handed to
them as it is (not from a distributed iterator) is split over this worker's
replicas first, as ``fit`` splits it, under tfdist's Mirrored and
MultiWorkerMirrored strategies. Nothing else changes.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import tensorflow as tf

from tfdist import compat
from tfdist.compat.built_functions import around_built_functions

__all__ = ["install", "wrap_make_function", "wrap_make_predict_function"]


def _local_replicas(model: Any) -> int:
    """This worker's replicas when ``model`` runs under tfdist's Mirrored or
    MultiWorkerMirrored strategy; 1 otherwise (nothing to split)."""
    from tfdist.strategies import TfdistStrategy

    strategy = getattr(model, "_distribute_strategy", None) or tf.distribute.get_strategy()
    if not isinstance(strategy, TfdistStrategy) or strategy.kind not in (
        "mirrored",
        "multi_worker_mirrored",
    ):
        return 1
    return len(strategy.extended.worker_devices)


def _splittable(element: Any) -> bool:
    """Whether ``element`` is a plain batch: arrays and eager tensors with a
    common first dimension (None for a missing y or sample weight). Anything
    else (already distributed values, ragged or sparse tensors) is left to
    Keras."""
    leaves = tf.nest.flatten(element)
    rows = set()
    for leaf in leaves:
        if leaf is None:
            continue
        if (
            not isinstance(leaf, (np.ndarray, tf.Tensor))
            or isinstance(leaf, tf.distribute.DistributedValues)
            or len(leaf.shape) == 0
        ):
            return False
        rows.add(int(leaf.shape[0]))
    return len(rows) == 1


def _split(strategy: Any, local: int, element: Any) -> Any:
    """``element`` as per-replica values: replica ``i`` of this worker holds
    rows ``[i*b/n, (i+1)*b/n)`` in order, as ``fit`` splits an even batch
    (an uneven one: the first ``b % n`` replicas one row more)."""
    rows = next(int(leaf.shape[0]) for leaf in tf.nest.flatten(element) if leaf is not None)
    sizes = [rows // local + (1 if i < rows % local else 0) for i in range(local)]
    starts = np.cumsum([0] + sizes)

    def part(context):
        # Global replica ids run worker by worker, each worker holding `local`.
        i = context.replica_id_in_sync_group % local
        return tf.nest.map_structure(
            lambda leaf: (
                None if leaf is None else tf.convert_to_tensor(leaf[starts[i] : starts[i + 1]])
            ),
            element,
        )

    return strategy.experimental_distribute_values_from_function(part)


def _distributing(model: Any, function: Any) -> Any:
    """``function`` (Keras's train, test or predict function), which splits
    each plain batch it is handed over the replicas first."""

    @functools.wraps(function)
    def call(data):
        local = _local_replicas(model)
        if local < 2 or isinstance(data, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            return function(data)
        strategy = model.distribute_strategy
        split = (_split(strategy, local, e) if _splittable(e) else e for e in data)
        # The predict function indexes its list; the others take as many
        # elements as they run steps.
        return function(list(split) if isinstance(data, list) else split)

    return call


_AROUND = around_built_functions(lambda model, function: _distributing(model, function))


def wrap_make_function(original):
    """Keras's train and test functions, splitting a plain batch first."""
    return _AROUND[0](original)


def wrap_make_predict_function(original):
    """Keras's predict function, the same."""
    return _AROUND[1](original)


def install() -> None:
    """Installs the registry's ``on_batch`` patches; idempotent.

    Raises:
        tfdist.compat.PatchError: A target changed in this Keras.
    """
    compat.install("on_batch")
