"""Compressed cross-device reduction for a single-process MirroredStrategy.

:class:`CompressedCrossDeviceOps` is a ``tf.distribute.CrossDeviceOps`` that
compresses each replica's tensor on its own device, sums the compressed
payloads on one device (the math of :func:`reduce_compressed`) and broadcasts
the result, like ``tf.distribute.ReductionToOneDevice`` does::

    strategy = tf.distribute.MirroredStrategy(
        cross_device_ops=CompressedCrossDeviceOps("fp16"))

Where it applies (TF 2.21, read from ``mirrored_strategy.py``):

* Only ``MirroredStrategy`` accepts ``cross_device_ops``; under
  MultiWorkerMirroredStrategy use ``strategy_from_config(compression=...)``.
* Keras ``fit`` reaches it once per step, through
  ``ReplicaContext.all_reduce`` -> ``merge_call`` -> ``batch_reduce_to``.
* MirroredStrategy sends int32 values to a fresh ``ReductionToOneDevice``,
  and ``extended.reduce_to`` (hence ``strategy.reduce``) does the same
  whenever a destination is a CPU or differs from the value's devices; XLA
  contexts on GPUs use collectives. None of these reach this class.

Only stateless compressors fit here: a ``CrossDeviceOps`` sees tensors, not
variables, so it has nowhere to keep per-gradient state such as an error
feedback residual or PowerSGD's factor matrices.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

# Private, but it is where ReductionToOneDevice picks its reduce device; using
# the same helpers keeps both classes choosing the same device.
from tfdist.compat.tf_python import cross_device_ops as tf_cross_device_ops, resource_variable_ops
from tfdist.compression.aggregate import Aggregator, CompressorAggregator
from tfdist.compression.base import Compressor, reduce_compressed
from tfdist.compression.memory import ErrorFeedback
from tfdist.compression.registry import make_compressor
from tfdist.errors import ConfigError
from tfdist.spec.compression import parse_compression

__all__ = ["CompressedCrossDeviceOps"]

_SOURCE = "CompressedCrossDeviceOps"

_STATEFUL_HINT = (
    "A CrossDeviceOps keeps no per-gradient state across steps, so error "
    "feedback and PowerSGD (which keeps factor matrices) cannot run here. Use "
    "tfdist.strategy_from_config(compression=...), whose Keras hook keeps that "
    "state in optimizer variables, or subclass tf.distribute.ReductionToOneDevice "
    "and override reduce_implementation / batch_reduce_implementation"
)


def _stateless_compressor(compression: Any) -> Compressor:
    """Builds the compressor of a setting, refusing stateful ones.

    A :class:`CompressorAggregator` without error feedback is unwrapped to
    its compressor.

    Raises:
        ConfigError: The setting is invalid, or stateful: an ErrorFeedback
            object, an aggregator with error feedback, PowerSGD (by name or
            object), or a setting with ``error_feedback=True``. Field
            ``'compression'``.
    """

    def stateful() -> ConfigError:
        return ConfigError(
            "compression",
            compression,
            "a stateless compressor",
            source=_SOURCE,
            hint=_STATEFUL_HINT,
        )

    try:
        # ErrorFeedback and aggregators have a compressor name, so they
        # parse as settings: look at the object itself first.
        if isinstance(compression, CompressorAggregator) and compression.memory is None:
            return compression.compressor
        if isinstance(compression, (ErrorFeedback, Aggregator)):
            raise stateful()
        parsed = parse_compression(compression)
        if (
            parsed.name == "powersgd"
            or parsed.error_feedback
            or isinstance(parsed.compressor, (ErrorFeedback, Aggregator))
        ):
            raise stateful()
        return make_compressor(parsed)
    except ConfigError as err:
        if err.source == _SOURCE:
            raise
        # The parser names strategy_from_config as the source; name this class.
        raise ConfigError(
            err.field, err.value, err.expected, source=_SOURCE, hint=err.hint
        ) from None


class CompressedCrossDeviceOps(tf.distribute.ReductionToOneDevice):
    """Reduces to one device with each replica's tensor compressed first.

    Every replica compresses its value on its own device. Summable payloads
    (none, fp16, bf16, random-k; see :attr:`Compressor.summable`) are added
    element-wise on the reduce device and decompressed once; the others are
    decompressed one by one there and added. ``MEAN`` then divides by the
    number of replicas, and the result is copied to every destination device.

    Values go to the uncompressed ``ReductionToOneDevice`` path instead when
    compressing cannot work or cannot help: non-floating dtypes,
    ``IndexedSlices``, shapes that are not fully defined, empty tensors, and
    a single replica.

    Random-k and QSGD draw their randomness from ``(seed, step, key)``: the
    step is a counter that every ``reduce`` / ``batch_reduce`` call that
    compresses something increments once, so it is the same on all replicas
    and changes between calls; the key is the tensor's position in the batch.

    There is no error feedback here, whatever the compressor's default in
    ``strategy_from_config``: top-k, random-k and sign run without it.

    Args:
        compression: Anything :func:`tfdist.compression.make_compressor`
            accepts: ``"fp16"``, ``"topk:0.1"``, a compressor object... It
            must be stateless.
        reduce_to_device: The device to reduce on; None means the first
            destination device, as in ``ReductionToOneDevice``.

    Attributes:
        compressor: The compressor applied to every compressed value.
        step: The int64 ``tf.Variable`` counting the calls that compressed,
            on the host CPU. Its value after a call is the step that call
            used.

    Raises:
        ConfigError: ``compression`` is invalid or stateful (an
            ``ErrorFeedback`` object, or PowerSGD); field ``'compression'``.
    """

    def __init__(self, compression: Any = "fp16", reduce_to_device: str | None = None) -> None:
        self.compressor = _stateless_compressor(compression)
        super().__init__(reduce_to_device=reduce_to_device)
        # init_scope: a plain eager variable even if built in a tf.function.
        # ResourceVariable rather than tf.Variable: it skips the variable
        # creator scopes, so built under some strategy's scope the counter
        # still does not become that strategy's MirroredVariable (whose
        # assign_add in the ops' own strategy raises "Mixing different
        # tf.distribute.Strategy objects"). On the CPU: the stateless RNGs
        # read their seed from host memory.
        with tf.init_scope(), tf.device("/cpu:0"):
            self.step = resource_variable_ops.ResourceVariable(
                0, dtype=tf.int64, trainable=False, name="compressed_cross_device_ops_step"
            )

    def describe(self) -> str:
        """A one-line human-readable summary of this cross-device ops."""
        how = (
            "payloads summed, decompressed once"
            if self.compressor.summable
            else "payloads decompressed, then summed"
        )
        where = self.reduce_to_device or "the first destination device"
        return (
            f"CompressedCrossDeviceOps: compression {self.compressor.name} "
            f"({self.compressor!r}); {how} on {where}; uncompressed for "
            "non-float, IndexedSlices, dynamic or empty shapes, one replica"
        )

    def __repr__(self) -> str:
        return (
            f"CompressedCrossDeviceOps(compression={self.compressor!r}, "
            f"reduce_to_device={self.reduce_to_device!r})"
        )

    # ------------------------------------------------------------------
    # CrossDeviceOps implementation hooks.

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        """Reduces one value; compresses it when :meth:`_compressible`."""
        if not self._compressible(per_replica_value):
            return super().reduce_implementation(
                reduce_op, per_replica_value, destinations, options
            )
        return self._compressed_reduce(
            reduce_op, per_replica_value, destinations, self._next_step(), key=0
        )

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        """Reduces a batch with one shared step; each value's key is its index."""
        pairs = list(value_destination_pairs)
        step = None
        results = []
        for key, (value, destinations) in enumerate(pairs):
            if not self._compressible(value):
                results.append(
                    super().reduce_implementation(reduce_op, value, destinations, options)
                )
                continue
            if step is None:  # Once per call, and only if something is compressed.
                step = self._next_step()
            results.append(self._compressed_reduce(reduce_op, value, destinations, step, key=key))
        return results

    # ------------------------------------------------------------------
    # Helpers.

    def _next_step(self) -> tf.Tensor:
        """Increments the step counter and returns its new value."""
        return self.step.assign_add(1, read_value=True)

    @staticmethod
    def _compressible(per_replica_value: Any) -> bool:
        """Whether the compressed path applies to a value (static checks only)."""
        values: Sequence[Any] = getattr(per_replica_value, "values", None) or ()
        if len(values) < 2:
            return False  # Nothing to save by compressing for a single replica.
        for value in values:
            if isinstance(value, tf.IndexedSlices) or not isinstance(value, tf.Tensor):
                return False  # Already sparse; the compressors need dense tensors.
            if not value.dtype.is_floating:
                return False
            shape = value.shape
            if not shape.is_fully_defined() or shape.num_elements() == 0:
                return False  # Compressors need a static, non-empty shape.
        return True

    def _compressed_reduce(
        self,
        reduce_op: tf.distribute.ReduceOp,
        per_replica_value: Any,
        destinations: Any,
        step: tf.Tensor,
        key: int,
    ) -> Any:
        """Compresses per replica, reduces on one device, broadcasts."""
        if isinstance(reduce_op, str):  # As StrategyExtended.reduce_to allows.
            reduce_op = tf.distribute.ReduceOp(reduce_op.upper())
        if reduce_op not in (tf.distribute.ReduceOp.SUM, tf.distribute.ReduceOp.MEAN):
            raise ValueError(f"reduce_op must be SUM or MEAN; got {reduce_op!r}")
        values = per_replica_value.values
        payloads = []
        ctx = None
        for value in values:
            # Compress where the value lives, so only the payload is copied.
            with tf.device(value.device):
                payload, replica_ctx = self.compressor.compress(value, step=step, key=key)
            payloads.append(payload)
            # The context is the same on every replica (same shape, dtype,
            # step and key); keep the first.
            if ctx is None:
                ctx = replica_ctx
        with tf.device(self._reduce_device(per_replica_value, destinations)):
            reduced = reduce_compressed(self.compressor, payloads, ctx)
            if reduce_op == tf.distribute.ReduceOp.MEAN:
                reduced = reduced / len(values)
        return self.broadcast(reduced, destinations)

    def _reduce_device(self, per_replica_value: Any, destinations: Any) -> str:
        """The reduce device, chosen exactly as ReductionToOneDevice chooses it.

        ``reduce_to_device`` if set, else the first destination device, else
        (no destinations) the value's first device.
        """
        if self.reduce_to_device:
            return self.reduce_to_device
        target = (
            destinations
            if tf_cross_device_ops.check_destinations(destinations)
            else per_replica_value
        )
        return tf_cross_device_ops.get_devices_from(target, self._canonicalize_devices)[0]
