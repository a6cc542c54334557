"""``hvd.Compression``: Horovod's compressors, and every tfdist setting beside them.

Horovod's interface is a class with ``compress(tensor) -> (tensor, ctx)``
and ``decompress(tensor, ctx)``; ``Compression.none`` and
``Compression.fp16`` are such classes, and a user's own compressor written
for Horovod works too. Wherever ``compression=`` is taken
(``DistributedOptimizer``, ``DistributedGradientTape``, ``allreduce``),
tfdist's settings are accepted as well: ``"bf16"``, ``"topk:0.01"``,
``"powersgd:4"``, a compressor or aggregator object. The optimizer and the
tape reduce through tfdist's aggregators (:mod:`tfdist.compression`), so
error feedback, PowerSGD's state and byte accounting work as under a tfdist
strategy. A single ``allreduce`` takes only stateless settings whose payload
can be summed (none, fp16, bf16).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tfdist.errors import ConfigError

__all__ = [
    "Compressor",
    "NoneCompressor",
    "FP16Compressor",
    "Compression",
    "aggregator_for",
    "as_horovod_compressor",
]


class Compressor:
    """Horovod's compressor interface: static ``compress``/``decompress``."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        """Returns the tensor to send and what ``decompress`` needs."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        """Inverse of :meth:`compress` on the reduced tensor."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16 (half the bytes of float32).

    Values beyond float16's range (±65504) are clipped, where Horovod's cast
    gives inf.
    """

    @staticmethod
    def compress(tensor):
        from tfdist.compression.casting import FP16Compressor as Cast

        if not tensor.dtype.is_floating or tensor.dtype == tf.float16:
            return tensor, None
        return Cast().encode(tensor), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tf.cast(tensor, ctx)


class Compression:
    """``hvd.Compression.none`` and ``hvd.Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor


def _is_horovod_style(obj: Any) -> bool:
    return (
        (isinstance(obj, type) and issubclass(obj, Compressor))
        or isinstance(obj, Compressor)
        or (
            callable(getattr(obj, "compress", None))
            and callable(getattr(obj, "decompress", None))
            and not _is_tfdist(obj)
        )
    )


def _is_tfdist(obj: Any) -> bool:
    from tfdist.compression.aggregate import Aggregator
    from tfdist.compression.base import Compressor as TfdistCompressor
    from tfdist.compression.memory import ErrorFeedback

    return isinstance(obj, (Aggregator, TfdistCompressor, ErrorFeedback))


class _HorovodStyle:
    """A user's Horovod-style compressor as a summable tfdist compressor."""

    def __new__(cls, horovod_compressor):
        from tfdist.compression.base import Compressor as TfdistCompressor, context_of

        class Adapter(TfdistCompressor):
            name = "none"
            summable = True
            lossy = True

            def __repr__(self):
                return (
                    f"horovod-style {getattr(horovod_compressor, '__name__', horovod_compressor)}"
                )

            def compress(self, tensor, step=0, key=0):
                sent, ctx = horovod_compressor.compress(tensor)
                return (sent,), (context_of(tensor), ctx)

            def decompress(self, payload, ctx):
                return horovod_compressor.decompress(payload[0], ctx[1])

            def payload_spec(self, shape, dtype):
                sent, _ = horovod_compressor.compress(tf.zeros(shape, dtype))
                return ((tuple(shape), sent.dtype),)

        return Adapter()


def aggregator_for(compression: Any, source: str = "hvd.DistributedOptimizer"):
    """The tfdist aggregator that reduces with ``compression``.

    Raises:
        ConfigError: An unknown setting, or ``"auto"`` (it measures the link
            through a tfdist strategy).
    """
    from tfdist.compression import casting, identity
    from tfdist.compression.aggregate import CompressorAggregator
    from tfdist.compression.registry import make_aggregator

    if (
        compression is None
        or compression is NoneCompressor
        or isinstance(compression, NoneCompressor)
    ):
        return CompressorAggregator(identity.NoneCompressor())
    if compression is FP16Compressor or isinstance(compression, FP16Compressor):
        return CompressorAggregator(casting.FP16Compressor())
    if _is_horovod_style(compression):
        return CompressorAggregator(_HorovodStyle(compression))
    try:
        aggregator = make_aggregator(compression)
    except ConfigError as error:
        raise ConfigError(
            "compression",
            compression,
            "hvd.Compression.none, "
            "hvd.Compression.fp16, a Horovod-style compressor or a tfdist "
            "setting such as 'bf16', 'topk:0.01', 'powersgd:4'",
            source=source,
            hint=str(error),
        ) from None
    return aggregator


def as_horovod_compressor(compression: Any, source: str = "hvd.allreduce"):
    """``compression`` as a Horovod-style compressor, for a single all-reduce.

    Raises:
        ConfigError: A setting that keeps state or cannot be summed.
    """
    if compression is None:
        return NoneCompressor
    if _is_horovod_style(compression):
        return compression
    aggregator = aggregator_for(compression, source)
    comp = getattr(aggregator, "compressor", None)
    if comp is None or not comp.summable or getattr(aggregator, "memory", None) is not None:
        raise ConfigError(
            "compression",
            compression,
            "hvd.Compression.none/fp16, 'bf16' or "
            "another setting whose payload is summed and keeps no state",
            source=source,
            hint="Compressors with state or all-gathered payloads (top-k, "
            "PowerSGD, error feedback) work in hvd.DistributedOptimizer "
            "and hvd.DistributedGradientTape.",
        )

    class _Cast(Compressor):
        @staticmethod
        def compress(tensor):
            if not (tensor.dtype.is_floating and tensor.shape.is_fully_defined()):
                return tensor, None
            payload, ctx = comp.compress(tensor)
            return payload[0], ctx

        @staticmethod
        def decompress(tensor, ctx):
            return tensor if ctx is None else comp.decompress((tensor,), ctx)

    return _Cast
