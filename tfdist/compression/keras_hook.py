"""Compressed gradient aggregation inside Keras 3 ``fit``.

Keras 3 aggregates gradients in exactly one place:
``TFOptimizer._all_reduce_sum_gradients``, which all-reduces (SUM) in replica
context; the loss is already scaled by 1/num_replicas. :func:`install` wraps
that method once. The wrapper looks at the current strategy: when it carries
an enabled compression setting (``strategy_from_config(compression=...)``) it
sends compressed payloads with ``ReplicaContext.all_reduce`` (summable
payloads) or ``all_gather`` (the others) and returns the SUM; otherwise it
calls Keras's own method unchanged. Using only the replica context keeps the
same code working under Mirrored and multi-worker MultiWorkerMirrored.

This first version applies stateless compression (no error feedback).
"""

from __future__ import annotations

import functools
from typing import Any

import tensorflow as tf
from keras.src.backend.tensorflow.optimizer import TFOptimizer

_MARK = "_tfdist_wrapped"


def _is_compressible(grad: Any) -> bool:
    """Dense floating-point gradients are compressed; the rest go as they are.

    IndexedSlices (Embedding layers) and integer gradients use Keras's own
    all-reduce.
    """
    return (isinstance(grad, tf.Tensor) and grad.dtype.is_floating
            and grad.shape.is_fully_defined() and grad.shape.num_elements())


# Dtypes TensorFlow's collective all-gather carries as they are.
_GATHER_DTYPES = (tf.float16, tf.float32, tf.float64, tf.int32, tf.int64)


def _to_wire(payload: tf.Tensor) -> tf.Tensor:
    """Packs a payload the collectives cannot carry (uint8, int8, int16,
    bfloat16) into int32 words, byte for byte: no bytes are added but the
    padding to a multiple of 4."""
    if payload.dtype in _GATHER_DTYPES:
        return payload
    raw = tf.reshape(tf.bitcast(payload, tf.uint8), [-1])
    raw = tf.pad(raw, [[0, -raw.shape[0] % 4]])
    return tf.bitcast(tf.reshape(raw, [-1, 4]), tf.int32)


def _from_wire(words: tf.Tensor, like: tf.Tensor) -> tf.Tensor:
    """Inverse of :func:`_to_wire` for a payload shaped and typed like ``like``."""
    if like.dtype in _GATHER_DTYPES:
        return words
    size = like.dtype.size
    raw = tf.reshape(tf.bitcast(words, tf.uint8), [-1])
    raw = raw[:like.shape.num_elements() * size]
    if size > 1:
        raw = tf.reshape(raw, [-1, size])
    return tf.reshape(tf.bitcast(raw, like.dtype), like.shape)


def _reduce_one(ctx, compressor, grad, step, key):
    payload, meta = compressor.compress(grad, step=step, key=key)
    if compressor.summable:
        summed = ctx.all_reduce(tf.distribute.ReduceOp.SUM, list(payload))
        return compressor.decompress(tuple(summed), meta)
    # all_gather concatenates along axis 0; add a leading axis so that each
    # replica's payload comes back as one row.
    gathered = [ctx.all_gather(tf.expand_dims(_to_wire(p), 0), axis=0)
                for p in payload]
    total = None
    for replica in range(ctx.num_replicas_in_sync):
        part = compressor.decompress(
            tuple(_from_wire(g[replica], p) for g, p in zip(gathered, payload)),
            meta)
        total = part if total is None else total + part
    return total


def compressed_all_reduce_sum(grads_and_vars, compressor, step):
    """SUM-reduces gradients across replicas through ``compressor``.

    Args:
        grads_and_vars: (gradient, variable) pairs, in replica context.
        compressor: A :class:`tfdist.compression.base.Compressor`.
        step: The training step (random-k and QSGD seed from it).

    Returns:
        (summed gradient, variable) pairs; None gradients stay None.
    """
    ctx = tf.distribute.get_replica_context()
    pairs = list(grads_and_vars)
    dense_positions = [i for i, (g, _) in enumerate(pairs)
                       if g is not None and not _is_compressible(g)]
    out = [g for g, _ in pairs]
    if dense_positions:
        reduced = ctx.all_reduce(tf.distribute.ReduceOp.SUM,
                                 [pairs[i][0] for i in dense_positions])
        for i, r in zip(dense_positions, reduced):
            out[i] = r
    for i, (grad, _) in enumerate(pairs):
        if grad is not None and _is_compressible(grad):
            out[i] = _reduce_one(ctx, compressor, grad, step, key=i)
    return [(g, v) for g, (_, v) in zip(out, pairs)]


def _strategy_compressor(strategy):
    """The compressor of a tfdist strategy with compression on, else None."""
    setting = getattr(strategy, "compression", None)
    if setting is None or not setting.enabled:
        return None
    if strategy.num_replicas_in_sync < 2:
        return None  # Nothing to send.
    compressor = getattr(strategy, "_tfdist_compressor", None)
    if compressor is None:
        from tfdist.compression.registry import make_compressor
        compressor = make_compressor(setting)
        strategy._tfdist_compressor = compressor  # pylint: disable=protected-access
    return compressor


def install() -> None:
    """Wraps Keras's gradient aggregation once; idempotent."""
    original = TFOptimizer._all_reduce_sum_gradients
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def _all_reduce_sum_gradients(self, grads_and_vars):
        compressor = _strategy_compressor(tf.distribute.get_strategy())
        if compressor is None or not tf.distribute.get_replica_context():
            return original(self, grads_and_vars)
        step = tf.convert_to_tensor(getattr(self.iterations, "value",
                                            self.iterations))
        return compressed_all_reduce_sum(grads_and_vars, compressor, step)

    setattr(_all_reduce_sum_gradients, _MARK, True)
    TFOptimizer._all_reduce_sum_gradients = _all_reduce_sum_gradients
