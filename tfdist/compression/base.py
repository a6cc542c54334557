"""The compressor interface and the reference reduction of compressed payloads.

A compressor turns one gradient tensor into a *payload* (the tensors sent on
the wire) plus a *context* (local metadata that is never sent: shape, dtype,
and for random-k the indices every replica recomputes). Compressors keep no
state of their own; error feedback keeps its residual explicitly, see
:mod:`tfdist.compression.memory`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import tensorflow as tf

from tfdist.errors import ConfigError

__all__ = ["Compressor", "Context", "reduce_compressed"]


@dataclasses.dataclass(frozen=True)
class Context:
    """Local metadata of one compressed tensor; never goes on the wire.

    Attributes:
        shape: The static shape of the original tensor.
        dtype: The dtype of the original tensor.
        indices: For compressors that recompute their indices on every replica
            (random-k), the flat int32 indices of the kept entries; else None.
    """

    shape: tf.TensorShape
    dtype: tf.DType
    indices: tf.Tensor | None = None

    @property
    def numel(self) -> int:
        """Number of entries of the original tensor."""
        return self.shape.num_elements()


class Compressor:
    """Compresses one gradient tensor for sending.

    Subclasses set the class attributes and implement :meth:`compress`,
    :meth:`decompress` and :meth:`payload_bytes`. All TF code works inside
    ``tf.function`` and needs static shapes.

    Attributes:
        name: One of :data:`tfdist.compression.COMPRESSOR_NAMES`.
        summable: True if payloads from replicas can be summed element-wise
            (all-reduce) and decompressed once; False means all-gather,
            decompress each payload, then sum.
        lossy: Whether decompress(compress(x)) may differ from x, i.e. whether
            error feedback makes sense.
        contractive: Whether ``x - decompress(compress(x))`` is never larger
            than ``x``, which error feedback needs: its residual is then
            bounded. False for compressors that scale up what they keep to be
            unbiased (random-k by default): paired with error feedback,
            their residual grows without bound, so that pairing raises.
    """

    name: str = ""
    summable: bool = False
    lossy: bool = True
    contractive: bool = True

    def compress(
        self, tensor: tf.Tensor, step: tf.Tensor | int = 0, key: int = 0
    ) -> tuple[tuple[tf.Tensor, ...], Context]:
        """Compresses a tensor.

        Args:
            tensor: A floating-point tensor with a fully defined shape.
            step: The training step; seeds the randomness of random-k and QSGD
                (the same on all replicas).
            key: A per-tensor integer (e.g. the variable's index) so that
                different tensors of one step use different random streams.

        Returns:
            ``(payload, ctx)``: the tensors to send, and local metadata.
        """
        raise NotImplementedError

    def decompress(self, payload: tuple[tf.Tensor, ...], ctx: Context) -> tf.Tensor:
        """Returns the dense tensor, with the original shape and dtype."""
        raise NotImplementedError

    def payload_spec(
        self, shape: tuple[int, ...], dtype: tf.DType | str
    ) -> tuple[tuple[tuple[int, ...], tf.DType], ...]:
        """The (shape, dtype) of each payload tensor for one input tensor.

        Runs no TF op; byte accounting predicts traffic from it.
        """
        raise NotImplementedError

    def payload_bytes(self, shape: tuple[int, ...], dtype: tf.DType | str) -> int:
        """Exact payload size in bytes for one tensor; runs no TF op."""
        return sum(numel(s) * itemsize(d) for s, d in self.payload_spec(shape, dtype))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"


def reduce_compressed(
    compressor: Compressor,
    payloads_per_replica: list[tuple[tf.Tensor, ...]],
    ctx: Context,
) -> tf.Tensor:
    """Sums compressed gradients of several replicas (reference math).

    Summable compressors add payloads element-wise (what an all-reduce does)
    and decompress once; the others decompress every payload (what follows an
    all-gather) and add the dense results.

    Args:
        compressor: The compressor all replicas used.
        payloads_per_replica: One payload per replica.
        ctx: A context of the tensor. It must not depend on the replica: true
            for all built-in compressors (shape and dtype, plus random-k's
            indices, which are the same on every replica).

    Returns:
        The dense sum, with the original shape and dtype.
    """
    if not payloads_per_replica:
        raise ValueError("reduce_compressed needs at least one payload")
    if compressor.summable:
        summed = tuple(tf.add_n(list(parts)) for parts in zip(*payloads_per_replica))
        return compressor.decompress(summed, ctx)
    return tf.add_n([compressor.decompress(p, ctx) for p in payloads_per_replica])


# Helpers shared by the compressor modules.


def context_of(tensor: tf.Tensor) -> Context:
    """The context of a float tensor with a static shape; raises otherwise."""
    tensor = tf.convert_to_tensor(tensor)
    if not tensor.shape.is_fully_defined():
        raise ValueError(f"compressors need a static shape; got {tensor.shape}")
    if not tensor.dtype.is_floating:
        raise TypeError(f"compressors need a floating-point tensor; got {tensor.dtype.name}")
    return Context(tensor.shape, tensor.dtype)


def numel(shape: tuple[int, ...] | tf.TensorShape) -> int:
    """Number of entries of a static shape."""
    return math.prod(int(d) for d in tf.TensorShape(shape).as_list())


def itemsize(dtype: tf.DType | str) -> int:
    """Bytes per entry of a dtype."""
    return tf.as_dtype(dtype).size


def check_ratio(ratio: Any) -> float:
    """Validates a kept fraction in (0, 1]."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 < ratio <= 1.0:
        raise ConfigError("ratio", ratio, "a number in (0, 1]")
    return float(ratio)


def check_int(field: str, value: Any, low: int, high: int) -> int:
    """Validates an integer in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(field, value, f"an integer in [{low}, {high}]")
    return value


def check_min_size(min_size: Any) -> int:
    """Validates ``min_size``: tensors with fewer entries are sent whole."""
    return check_int("min_size", min_size, 0, 2**62)


def kept_count(ratio: float, n: int) -> int:
    """k = max(1, ceil(ratio * n)), at most n.

    Rounded to 6 decimals first so that float error (0.07 * 100 ==
    7.000000000000001) does not add an entry.
    """
    return min(n, max(1, math.ceil(round(ratio * n, 6))))


def seed_of(seed: int, step: tf.Tensor | int, key: int) -> tf.Tensor:
    """A stateless-RNG seed from (seed, step, key), the same on every process.

    Philox is named explicitly: "auto_select" may pick a device-dependent
    algorithm, and replicas must draw the same numbers.
    """
    base = tf.constant([seed, key], dtype=tf.int64)
    return tf.random.experimental.stateless_fold_in(base, tf.cast(step, tf.int64), alg="philox")
