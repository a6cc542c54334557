"""Gradients of sharded weights: summed over their data-parallel group only.

Keras 3 sums every gradient over all replicas in
``TFOptimizer._all_reduce_sum_gradients`` (the method tfdist's compression
wraps). A shard's gradient must not be summed with the other shards of its
tensor group: :func:`install` wraps that method once more, outside the
compression wrapper, and

* hands the replicated weights' gradients to the method it wraps (Keras's
  all-replica sum, or tfdist's compressed one);
* sums each shard's gradient over the replicas holding the same shard (the
  data-parallel group, through :func:`tfdist.parallel.collectives.dp_all_reduce`),
  compressed by the strategy's aggregator when compression is on;
* leaves the gradient of a weight split over the data-parallel group too (a
  keras.distribution layout's FSDP) as it is: gathering the weight summed it
  over every replica already (:func:`tfdist.parallel.collectives.gather_blocks`).

Both kinds of gradient traffic are added to the mesh's byte counters
(:func:`tfdist.parallel.collectives.traffic`).
"""

from __future__ import annotations

import functools
from typing import Any

import tensorflow as tf

from tfdist.compat import keras_private
from tfdist.compression import keras_hook
from tfdist.compression.aggregate import Item
from tfdist.parallel import collectives, sharding
from tfdist.transport.traffic import all_reduce_bytes, nbytes


def _dense(g: Any, v: Any) -> tf.Tensor:
    if isinstance(g, tf.IndexedSlices):
        # A vocabulary shard's: gathered, by the aggregator as it does a
        # replicated table's, or by _dp_gather_slices.
        return g
    g = tf.convert_to_tensor(g)
    # The variable's static shape (a Dense kernel's gradient from a 3-D
    # input has none): the aggregator's compressors and byte counts need it.
    g.set_shape(v.shape)
    return g


def _reduce_sharded(optimizer, pairs, p: collectives.Placement) -> list:
    if p.mesh.dp < 2:  # Each shard is held once: nothing to sum.
        return [g for g, _ in pairs]
    aggregator = keras_hook.strategy_aggregator(tf.distribute.get_strategy())
    present = [(i, _dense(g, v), v) for i, (g, v) in enumerate(pairs) if g is not None]
    out: list = [None] * len(pairs)
    if aggregator is None:
        for i, (g, _) in enumerate(pairs):
            if isinstance(g, tf.IndexedSlices):
                out[i] = _dp_gather_slices(g, p)
        for i, g, _ in present:
            if out[i] is None:
                out[i] = collectives.dp_all_reduce(g, p)
        return out
    state = keras_hook.state_by_key(optimizer)
    keys = [keras_private.optimizer_variable_index(optimizer, v) for _, _, v in present]
    items = [Item(g, key, state.get(key, {})) for (_, g, _), key in zip(present, keys)]
    step = tf.convert_to_tensor(getattr(optimizer.iterations, "value", optimizer.iterations))
    comm = collectives.GroupComm(p)
    reduced = aggregator.aggregate(items, step, comm)
    p.runtime.sent["data_parallel"].assign_add(tf.constant(comm.sent(), tf.float64))
    for (i, _, _), g in zip(present, reduced):
        out[i] = g
    return out


def _dp_gather_slices(g: tf.IndexedSlices, p: collectives.Placement) -> tf.IndexedSlices:
    """A vocabulary shard's IndexedSlices gathered over its data-parallel
    group, as Keras's all-replica sum does for a replicated table: Adam's
    second moment squares the slices before their duplicates are summed, so a
    dense sum would train differently from Keras."""
    p.runtime.sent["data_parallel"].assign_add(
        tf.cast(
            tf.size(g.values) * g.values.dtype.size + tf.size(g.indices) * g.indices.dtype.size,
            tf.float64,
        )
        * (p.mesh.dp - 1)
    )
    return p.runtime.dp[p.replica].all_reduce_indexed_slices(g)


def _count_replicated(pairs, p: collectives.Placement) -> None:
    aggregator = keras_hook.strategy_aggregator(tf.distribute.get_strategy())
    dense = [
        (tuple(v.shape), v.dtype.name)
        for g, v in pairs
        if g is not None and not isinstance(g, tf.IndexedSlices)
    ]
    n = p.mesh.num_replicas
    if aggregator is not None:
        sent = aggregator.traffic(dense, n).sent
    else:
        sent = all_reduce_bytes(sum(nbytes(s, d) for s, d in dense), n)
    for g, _ in pairs:  # Sparse gradients: all-gathered, rows follow the batch.
        if isinstance(g, tf.IndexedSlices):
            p.runtime.sent["data_parallel"].assign_add(
                tf.cast(
                    tf.size(g.values) * g.values.dtype.size
                    + tf.size(g.indices) * g.indices.dtype.size,
                    tf.float64,
                )
                * (n - 1)
            )
    p.runtime.sent["data_parallel"].assign_add(tf.constant(sent, tf.float64))


def wrap_reduce(original):
    @functools.wraps(original)
    def _all_reduce_sum_gradients(self, grads_and_vars):
        pairs = list(grads_and_vars)
        p = collectives.current()
        if p is None:
            return original(self, pairs)
        sharded, complete = [], []
        for i, (_, v) in enumerate(pairs):
            spec = sharding.spec_of(v)
            if spec is not None:
                (complete if spec.over_data else sharded).append(i)
        chosen = set(sharded) | set(complete)
        rest = [pair for i, pair in enumerate(pairs) if i not in chosen]
        _count_replicated(rest, p)
        out: list = [None] * len(pairs)
        for i, pair in zip(
            [i for i in range(len(pairs)) if i not in chosen], original(self, rest) if rest else []
        ):
            out[i] = pair
        reduced = _reduce_sharded(self, [pairs[i] for i in sharded], p)
        for i, g in zip(sharded, reduced):
            out[i] = (g, pairs[i][1])
        for i in complete:  # Summed over every replica as the weight was gathered.
            out[i] = pairs[i]
        return out

    return _all_reduce_sum_gradients


def wrap_check_finite(original):
    @functools.wraps(original)
    def check_finite(self, grads):
        finite = original(self, grads)
        p = collectives.current()
        if p is None:
            return finite
        # Keras's LossScaleOptimizer takes replica 0's answer for every
        # replica, its local gradients standing for the all-reduced ones. A
        # shard's float16 overflow shows on its own replicas only: every
        # replica votes, or one applies inf and the model turns NaN.
        bad = tf.cast(tf.logical_not(tf.convert_to_tensor(finite)), tf.float32)
        bad = collectives.dp_all_reduce(collectives.tp_all_reduce(bad), p)
        return tf.equal(bad, 0.0)

    return check_finite


def install() -> None:
    """Wraps Keras's gradient sum (over tfdist's compression wrapper) and the
    loss scale optimizer's finiteness check: the registry's
    ``tensor_parallel``, with :mod:`tfdist.parallel.saving`; idempotent.

    Raises:
        tfdist.ConfigError: A target changed in this Keras and tensor
            parallelism was switched off (with a warning).
    """
    from tfdist import compat

    keras_hook.install()
    compat.install("tensor_parallel")
    compat.require("tensor_parallel", "model_parallel")
