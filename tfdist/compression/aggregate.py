"""Aggregators: gradients in, SUM-reduced gradients out.

An aggregator is the top abstraction of compressed communication (as in
epfml/powersgd): PowerSGD's two rounds with an orthogonalisation in between
do not fit one compress/decompress pair, so the hook asks an aggregator for
the reduced gradients and lets it talk to the other replicas through a
:class:`~tfdist.transport.comm.Comm` (the transport's). Each aggregator also
declares the per-variable state it needs (:class:`StateSpec`: error-feedback
residuals, PowerSGD's Q), which the Keras hook creates as per-replica
optimizer variables, and predicts its own traffic (:meth:`Aggregator.traffic`).

:class:`CompressorAggregator` drives any :class:`~tfdist.compression.base.Compressor`,
optionally with :class:`~tfdist.compression.memory.ErrorFeedback`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tensorflow as tf

from tfdist.compression.base import Compressor
from tfdist.compression.memory import ErrorFeedback
from tfdist.compression.sparse import add_sparse, split_sparse
from tfdist.errors import ConfigError
from tfdist.transport.comm import Comm, LocalComm, ReplicaComm
from tfdist.transport.traffic import Traffic, dtype_name, nbytes, wire_nbytes

__all__ = [
    "StateSpec",
    "Item",
    "Comm",
    "LocalComm",
    "ReplicaComm",
    "Aggregator",
    "CompressorAggregator",
]
# Comm, LocalComm and ReplicaComm are the transport's (tfdist.transport.comm);
# named here too, where an aggregator's callers have always found them.


@dataclasses.dataclass(frozen=True)
class StateSpec:
    """One per-replica state variable an aggregator needs for a gradient.

    Attributes:
        name: Short name, e.g. ``"residual"`` or ``"q"``.
        shape: Static shape.
        dtype: Dtype name.
        initializer: ``"zeros"`` or a callable ``(shape, dtype) -> Tensor``.
        aggregation: How a checkpoint reads the per-replica copies:
            ``"mean"`` (residuals: the mean keeps their sum, which is the
            gradient still owed, when restored to every replica) or
            ``"only_first_replica"`` (state that is the same on every
            replica, such as PowerSGD's Q).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    initializer: Any = "zeros"
    aggregation: str = "mean"


@dataclasses.dataclass
class Item:
    """One gradient to reduce.

    Attributes:
        grad: A Tensor, IndexedSlices or None.
        key: A stable per-variable integer (the optimizer's variable index);
            seeds random-k and QSGD, the same on every replica.
        state: The variables made from the aggregator's state specs, by name.
    """

    grad: Any
    key: int
    state: dict[str, Any] = dataclasses.field(default_factory=dict)


def is_compressible(grad: Any) -> bool:
    """Dense floating-point gradients with a static, non-empty shape.

    Integer gradients are reduced as they are; IndexedSlices (Embedding
    layers) are all-gathered, with 16-bit values under a cast (see
    :mod:`tfdist.compression.sparse`).
    """
    return (
        isinstance(grad, tf.Tensor)
        and grad.dtype.is_floating
        and grad.shape.is_fully_defined()
        and grad.shape.num_elements() > 0
    )


class Aggregator:
    """Reduces a step's gradients across replicas (SUM).

    Attributes:
        name: The compressor name this aggregator stands for.
    """

    name: str = ""

    def state_specs(self, shape: tuple[int, ...], dtype: str, key: int) -> list[StateSpec]:
        """The per-replica state one variable's gradient needs (may be empty)."""
        return []

    def aggregate(self, items: list[Item], step: tf.Tensor, comm: Comm) -> list[Any]:
        """Returns the SUM over replicas of each item's gradient.

        Args:
            items: The gradients, with their keys and state variables.
            step: The training step (the same on every replica).
            comm: The collectives to use.

        Returns:
            One reduced gradient per item; None stays None.
        """
        raise NotImplementedError

    def traffic(
        self, shapes: list[tuple[tuple[int, ...], str]], num_replicas: int, step: int | None = None
    ) -> Traffic:
        """Bytes per replica per step for gradients of these shapes/dtypes."""
        raise NotImplementedError

    def describe(self) -> str:
        """One line for logs and ``strategy.describe()``."""
        return repr(self)


def scale_gradient(grad: Any, factor: float) -> Any:
    """``grad`` times ``factor``; an IndexedSlices keeps its indices."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(
            grad.values * tf.cast(factor, grad.values.dtype), grad.indices, grad.dense_shape
        )
    return grad * tf.cast(factor, grad.dtype)


def is_float(dtype: str) -> bool:
    """Whether a dtype name is a floating-point type."""
    return dtype in ("float16", "bfloat16", "float32", "float64")


class CompressorAggregator(Aggregator):
    """Aggregates through one stateless compressor, with optional error feedback.

    Summable payloads (and gradients that are not compressed) go in one
    all-reduce per step, the other payloads in one all-gather, whatever the
    number of variables.

    Sparse gradients (IndexedSlices, from Embedding layers) are all-gathered
    as Keras would (see :mod:`tfdist.compression.sparse`), with their
    values in 16 bits when the compressor is a cast (fp16, bf16); no other
    compressor applies to them: top-k, random-k, sign and QSGD need a
    fixed-size dense tensor, and error feedback a dense residual.

    Args:
        compressor: The compressor all replicas use.
        error_feedback: Keep a per-replica residual of what compression
            dropped and add it to the next step's gradient (see
            :class:`~tfdist.compression.memory.ErrorFeedback`).

    Raises:
        ConfigError: ``error_feedback`` with a lossless compressor.
    """

    def __init__(self, compressor: Compressor, error_feedback: bool = False) -> None:
        self.compressor = compressor
        self.memory = ErrorFeedback(compressor) if error_feedback else None
        self.name = compressor.name

    def __repr__(self) -> str:
        return (
            f"CompressorAggregator({self.compressor!r}, error_feedback={self.memory is not None})"
        )

    def describe(self) -> str:
        return f"{self.compressor!r}, error_feedback={self.memory is not None}"

    def state_specs(self, shape, dtype, key):
        if self.memory is None or not is_float(dtype) or not shape or 0 in shape:
            return []
        return [StateSpec("residual", tuple(shape), dtype, "zeros", "mean")]

    def aggregate(self, items, step, comm):
        comp = self.compressor
        to_sum, to_gather = [], []
        plan = []  # (item index, payload or None, ctx, offset)
        for i, item in enumerate(items):
            grad = item.grad
            if grad is None:
                continue
            if isinstance(grad, tf.IndexedSlices):
                plan.append((i, None, "slices", len(to_sum)))
                to_sum.append(self._encode_slices(grad))
                continue
            if not is_compressible(grad):
                plan.append((i, None, None, len(to_sum)))
                to_sum.append(grad)
                continue
            residual = item.state.get("residual") if self.memory is not None else None
            if residual is not None:
                payload, ctx, new_residual = self.memory.compress(
                    grad, tf.convert_to_tensor(residual), step=step, key=item.key
                )
                residual.assign(new_residual)
            else:
                payload, ctx = comp.compress(grad, step=step, key=item.key)
            plan.append((i, payload, ctx, len(to_sum if comp.summable else to_gather)))
            (to_sum if comp.summable else to_gather).extend(payload)
        summed = comm.all_reduce(to_sum)
        gathered = comm.all_gather(to_gather)

        out = [item.grad for item in items]
        for i, payload, ctx, at in plan:
            if ctx == "slices":
                out[i] = self._decode_slices(summed[at], items[i].grad)
            elif payload is None:
                out[i] = summed[at]
            elif comp.summable:
                out[i] = comp.decompress(tuple(summed[at : at + len(payload)]), ctx)
            else:
                rows = gathered[at : at + len(payload)]
                out[i] = tf.add_n(
                    [
                        comp.decompress(tuple(r[n] for r in rows), ctx)
                        for n in range(comm.num_replicas)
                    ]
                )
        return out

    @property
    def slice_dtype(self) -> str | None:
        """What sparse gradients' values are sent as: the cast's 16-bit
        dtype, or None (as they are)."""
        return getattr(self.compressor, "slice_dtype", None)

    def _encode_slices(self, grad: tf.IndexedSlices) -> tf.IndexedSlices:
        if self.slice_dtype is None or not grad.values.dtype.is_floating:
            return grad
        return tf.IndexedSlices(self.compressor.encode(grad.values), grad.indices, grad.dense_shape)

    def _decode_slices(self, summed: tf.IndexedSlices, grad: tf.IndexedSlices):
        if summed.values.dtype == grad.values.dtype:
            return summed
        return tf.IndexedSlices(
            self.compressor.decode(summed.values, grad.values.dtype),
            summed.indices,
            summed.dense_shape,
        )

    def traffic(self, shapes, num_replicas, step=None):
        t = Traffic(num_replicas)
        shapes, sparse = split_sparse(shapes)
        # The dtypes each collective carries: ReplicaComm makes one call per
        # all-reduced dtype and per gathered word dtype.
        reduced: set[str] = set()
        gathered: set[str] = set()
        for shape, dtype in shapes:
            size = nbytes(shape, dtype)
            t.dense += size
            if not is_float(dtype) or not shape or 0 in shape:
                t.all_reduce += size
                reduced.add(dtype_name(dtype))
                continue
            spec = self.compressor.payload_spec(shape, dtype)
            if self.compressor.summable:
                t.all_reduce += sum(nbytes(s, d) for s, d in spec)
                reduced.update(dtype_name(d) for _, d in spec)
            else:
                t.all_gather += sum(wire_nbytes(s, d) for s, d in spec)
                gathered.update(
                    "float16" if dtype_name(d) == "float16" else "int32" for _, d in spec
                )
        t.collectives = len(reduced) + len(gathered)
        return add_sparse(t, sparse, self.slice_dtype)


def check_error_feedback(compressor: Compressor, error_feedback: bool | None) -> bool:
    """Resolves the error-feedback setting for a compressor.

    None means the default for that compressor; True with a lossless
    compressor raises.
    """
    from tfdist.spec.compression import default_error_feedback

    if error_feedback is None:
        return default_error_feedback(compressor)
    if not isinstance(error_feedback, bool):
        raise ConfigError("error_feedback", error_feedback, "True, False or None")
    if error_feedback and not compressor.lossy:
        raise ConfigError(
            "error_feedback",
            error_feedback,
            "False or None with a lossless compressor",
            received=f"error_feedback=True with {compressor!r}",
            hint="Error feedback only helps a compressor that loses information.",
        )
    return error_feedback
