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
            and grad.shape.is_fully_defined() and grad.shape.num_elements() > 0)


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


def compressed_all_reduce_sum(grads_and_vars, compressor, step):
    """SUM-reduces gradients across replicas through ``compressor``.

    All summable payloads and uncompressed gradients go in one all-reduce,
    and all other payloads in one all-gather, so that a step issues two
    collectives whatever the number of variables.

    Args:
        grads_and_vars: (gradient, variable) pairs, in replica context.
        compressor: A :class:`tfdist.compression.base.Compressor`.
        step: The training step (random-k and QSGD seed from it).

    Returns:
        (summed gradient, variable) pairs; None gradients stay None.
    """
    ctx = tf.distribute.get_replica_context()
    pairs = list(grads_and_vars)
    to_sum, to_gather = [], []
    # Per gradient: (position, payload, meta, offset into to_sum/to_gather).
    plan = []
    for i, (grad, _) in enumerate(pairs):
        if grad is None:
            continue
        if not _is_compressible(grad):
            plan.append((i, None, None, len(to_sum)))
            to_sum.append(grad)
            continue
        payload, meta = compressor.compress(grad, step=step, key=i)
        if compressor.summable:
            plan.append((i, payload, meta, len(to_sum)))
            to_sum.extend(payload)
        else:
            plan.append((i, payload, meta, len(to_gather)))
            # all_gather concatenates along axis 0; a leading axis makes each
            # replica's payload come back as one row.
            to_gather.extend(tf.expand_dims(_to_wire(p), 0) for p in payload)
    summed = ctx.all_reduce(tf.distribute.ReduceOp.SUM, to_sum) if to_sum else []
    gathered = ctx.all_gather(to_gather, axis=0) if to_gather else []

    out = [g for g, _ in pairs]
    for i, payload, meta, at in plan:
        if payload is None:
            out[i] = summed[at]
        elif compressor.summable:
            out[i] = compressor.decompress(tuple(summed[at:at + len(payload)]), meta)
        else:
            rows = gathered[at:at + len(payload)]
            out[i] = tf.add_n([
                compressor.decompress(
                    tuple(_from_wire(g[r], p) for g, p in zip(rows, payload)), meta)
                for r in range(ctx.num_replicas_in_sync)])
    return [(g, v) for g, (_, v) in zip(out, pairs)]


def _strategy_compressor(strategy):
    """The compressor of a tfdist strategy with compression on, else None.

    tfdist's Mirrored and MultiWorkerMirrored strategies build it when the
    setting is enabled; one replica has nothing to send.
    """
    compressor = getattr(strategy, "_tfdist_compressor", None)
    if compressor is None or strategy.num_replicas_in_sync < 2:
        return None
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
