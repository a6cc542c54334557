"""The wire encoding of the collectives: how payloads of any dtype travel.

TensorFlow's all-gather carries only float16, float32, float64, int32 and
int64 (:data:`~tfdist.transport.traffic.GATHER_DTYPES`); the compressors' 8-
and 16-bit payloads (uint8, int8, int16, bfloat16) are packed into int32 words
byte for byte, and an all-gather's tensors are flattened into one buffer of
words per wire dtype, so that one call is one collective.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tfdist.transport.traffic import GATHER_DTYPES

__all__ = ["slices_to_wire", "slices_from_wire", "to_wire", "to_words", "from_words"]


def slices_to_wire(t: Any) -> Any:
    """bfloat16 slices travel bit for bit as float16 (same size), which the
    collectives gather; everything else as it is."""
    if isinstance(t, tf.IndexedSlices) and t.values.dtype == tf.bfloat16:
        return tf.IndexedSlices(tf.bitcast(t.values, tf.float16), t.indices, t.dense_shape)
    return t


def slices_from_wire(out: Any, like: Any) -> Any:
    """Inverse of :func:`slices_to_wire`."""
    if isinstance(like, tf.IndexedSlices) and like.values.dtype == tf.bfloat16:
        return tf.IndexedSlices(tf.bitcast(out.values, tf.bfloat16), out.indices, out.dense_shape)
    return out


def to_wire(payload: tf.Tensor) -> tf.Tensor:
    """Packs a payload the collectives cannot gather (uint8, int8, int16,
    bfloat16) into int32 words, byte for byte: no bytes are added but the
    padding to a multiple of 4."""
    if payload.dtype.name in GATHER_DTYPES:
        return payload
    raw = tf.reshape(tf.bitcast(payload, tf.uint8), [-1])
    raw = tf.pad(raw, [[0, -raw.shape[0] % 4]])
    return tf.bitcast(tf.reshape(raw, [-1, 4]), tf.int32)


def to_words(payload: tf.Tensor) -> tf.Tensor:
    """A payload as a flat tensor the gather buffer can hold: float16 as it
    is, everything else as int32 words (bit for bit; the dtypes
    :func:`to_wire` packs are padded to a multiple of 4 bytes)."""
    name = payload.dtype.name
    if name in ("float16", "int32"):
        return tf.reshape(payload, [-1])
    if name in GATHER_DTYPES:  # float32, float64, int64: whole int32 words
        return tf.reshape(tf.bitcast(payload, tf.int32), [-1])
    return tf.reshape(to_wire(payload), [-1])


def from_words(rows: tf.Tensor, like: tf.Tensor) -> tf.Tensor:
    """Inverse of :func:`to_words` for every replica's row at once:
    ``rows`` is [N, words], the result [N, *like.shape] in like's dtype."""
    n = tf.shape(rows)[0]
    shape = tf.concat([[n], tf.constant(like.shape.as_list(), tf.int32)], axis=0)
    name = like.dtype.name
    if name in ("float16", "int32"):
        return tf.reshape(rows, shape)
    if name == "float32":
        return tf.reshape(tf.bitcast(rows, tf.float32), shape)
    if name in GATHER_DTYPES:  # 8-byte types: pairs of words
        pairs = tf.reshape(rows, [n, -1, like.dtype.size // 4])
        return tf.reshape(tf.bitcast(pairs, like.dtype), shape)
    size = like.dtype.size
    raw = tf.reshape(tf.bitcast(rows, tf.uint8), [n, -1])
    raw = raw[:, : like.shape.num_elements() * size]
    if size > 1:
        raw = tf.reshape(raw, [n, -1, size])
    return tf.reshape(tf.bitcast(raw, like.dtype), shape)
