"""Casting to 16-bit floats: half the bytes of float32, summable."""

from __future__ import annotations

import math

import tensorflow as tf

from tfdist.compression.base import Compressor, Context, context_of
from tfdist.errors import ConfigError

FP16_MAX = 65504.0
#: Largest finite bfloat16 (slightly below float32's max, so float32 inputs
#: near the top of their range would otherwise round to inf).
BF16_MAX = float(tf.bfloat16.max)


class _CastCompressor(Compressor):
    summable = True
    lossy = True
    _wire: tf.DType
    _limit: float

    def __init__(self, prescale: float = 1.0) -> None:
        if (
            isinstance(prescale, bool)
            or not isinstance(prescale, (int, float))
            or not math.isfinite(prescale)
            or prescale <= 0
        ):
            raise ConfigError("prescale", prescale, "a finite number > 0")
        self.prescale = float(prescale)

    @property
    def slice_dtype(self) -> str:
        """What the values of sparse gradients (IndexedSlices) are sent as:
        the same 16 bits as dense ones."""
        return self._wire.name

    def compress(self, tensor, step=0, key=0):
        ctx = context_of(tensor)
        return (self.encode(tensor),), ctx

    def decompress(self, payload, ctx: Context) -> tf.Tensor:
        return self.decode(payload[0], ctx.dtype)

    def encode(self, tensor) -> tf.Tensor:
        """The 16-bit tensor sent for ``tensor`` (any shape, static or not)."""
        x = tf.convert_to_tensor(tensor)
        if self.prescale != 1.0:
            x = x * tf.cast(self.prescale, x.dtype)
        # Clip after scaling so the cast never makes inf (NaN stays NaN).
        limit = min(self._limit, float(x.dtype.max))
        x = tf.clip_by_value(x, tf.cast(-limit, x.dtype), tf.cast(limit, x.dtype))
        return tf.cast(x, self._wire)

    def decode(self, payload: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
        """Inverse of :meth:`encode`, back in ``dtype``."""
        x = tf.cast(payload, dtype)
        if self.prescale != 1.0:
            x = x / tf.cast(self.prescale, dtype)
        return x

    def payload_spec(self, shape, dtype):
        return ((tuple(shape), self._wire),)


class FP16Compressor(_CastCompressor):
    """Sends float16.

    Values are clipped to the float16 finite range (±65504) after the
    prescale, so one payload never holds inf. The sum of N replicas' float16
    payloads can still overflow; a prescale of ``1 / num_replicas`` avoids
    that (decompress divides it back out, also after summing).

    Args:
        prescale: Multiplies the tensor before the cast; divided out after.
    """

    name = "fp16"
    _wire = tf.float16
    _limit = FP16_MAX


class BF16Compressor(_CastCompressor):
    """Sends bfloat16 (float32's range, 8 bits of mantissa).

    Args:
        prescale: Multiplies the tensor before the cast; divided out after.
    """

    name = "bf16"
    _wire = tf.bfloat16
    _limit = BF16_MAX
