"""Aggregators: gradients in, SUM-reduced gradients out.

An aggregator is the top abstraction of compressed communication (as in
epfml/powersgd): PowerSGD's two rounds with an orthogonalisation in between
do not fit one compress/decompress pair, so the hook asks an aggregator for
the reduced gradients and lets it talk to the other replicas through a
:class:`Comm`. Each aggregator also declares the per-variable state it needs
(:class:`StateSpec`: error-feedback residuals, PowerSGD's Q), which the Keras
hook creates as per-replica optimizer variables, and predicts its own traffic
(:meth:`Aggregator.traffic`).

:class:`CompressorAggregator` drives any :class:`~tfdist.compression.base.Compressor`,
optionally with :class:`~tfdist.compression.memory.ErrorFeedback`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from tfdist.compression.base import Compressor
from tfdist.compression.memory import ErrorFeedback
from tfdist.compression.sparse import add_sparse, slices_nbytes, split_sparse
from tfdist.compression.traffic import GATHER_DTYPES, Traffic, dtype_name, nbytes, wire_nbytes
from tfdist.errors import ConfigError

__all__ = [
    "StateSpec",
    "Item",
    "Comm",
    "LocalComm",
    "ReplicaComm",
    "Aggregator",
    "CompressorAggregator",
]


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


class Comm:
    """The collectives an aggregator may use, recording what it sends.

    ``reduced`` and ``gathered`` list the (shape, dtype name) of every
    tensor handed to an all-reduce / all-gather, so tests can compare what
    was really sent with :meth:`Aggregator.traffic`. ``sliced`` lists every
    IndexedSlices handed to :meth:`all_reduce`, which TensorFlow all-gathers
    (see :mod:`tfdist.compression.sparse`): ``(row shape, values dtype,
    indices dtype, rows)``, ``rows`` being this replica's number of slices
    as a tensor (dynamic inside ``fit``).
    """

    num_replicas: int

    def __init__(self) -> None:
        self.reduced: list[tuple[tuple[int, ...], str]] = []
        self.gathered: list[tuple[tuple[int, ...], str]] = []
        self.sliced: list[tuple[tuple[int, ...], str, str, tf.Tensor]] = []

    def all_reduce(self, tensors: Sequence[Any]) -> list[Any]:
        """SUM over replicas of each tensor; IndexedSlices are all-gathered
        (their slices concatenated, as TensorFlow reduces them)."""
        tensors = list(tensors)
        for t in tensors:
            if isinstance(t, tf.IndexedSlices):
                self.sliced.append(
                    (
                        tuple(t.values.shape.as_list()[1:]),
                        t.values.dtype.name,
                        t.indices.dtype.name,
                        tf.shape(t.indices)[0],
                    )
                )
            elif isinstance(t, tf.Tensor):
                self.reduced.append(_spec(t))
        return self._all_reduce(tensors) if tensors else []

    def all_gather(self, tensors: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """Every replica's copy of each tensor, stacked on a new axis 0."""
        tensors = list(tensors)
        self.gathered.extend(_spec(t) for t in tensors)
        return self._all_gather(tensors) if tensors else []

    def cond(self, pred: tf.Tensor, true_fn: Callable, false_fn: Callable, args: tuple) -> Any:
        """``tf.cond`` whose branches may use the collectives.

        ``pred`` must be the same on every replica.
        """
        return tf.cond(pred, lambda: true_fn(*args), lambda: false_fn(*args))

    def traffic(
        self, dense: int, dense_gather: int = 0, rows: Sequence[int] | None = None
    ) -> Traffic:
        """The recorded payloads as a :class:`Traffic`.

        Args:
            dense: The reference all-reduce payload (see :class:`Traffic`).
            dense_gather: The reference all-gather payload of sparse gradients.
            rows: The slices every replica sent for each entry of ``sliced``:
                the largest number any replica held (TensorFlow pads to it).
                None: the static row counts recorded (eager, one replica).
        """
        if rows is None:
            rows = []
            for _shape, _, _, count in self.sliced:
                value = tf.get_static_value(count)
                if value is None:
                    raise ConfigError(
                        "rows",
                        None,
                        "the rows each IndexedSlices sent (the "
                        "largest over replicas): inside a tf.function they are "
                        "dynamic",
                        source="Comm.traffic",
                    )
                rows.append(int(value))
        if len(rows) != len(self.sliced):
            raise ConfigError(
                "rows",
                rows,
                f"{len(self.sliced)} counts, one per IndexedSlices sent",
                source="Comm.traffic",
            )
        sparse = sum(
            slices_nbytes(int(r), math.prod(shape), values, indices)
            for (shape, values, indices, _), r in zip(self.sliced, rows)
        )
        return Traffic(
            self.num_replicas,
            dense=dense,
            dense_gather=dense_gather,
            all_reduce=sum(nbytes(s, d) for s, d in self.reduced),
            all_gather=sum(wire_nbytes(s, d) for s, d in self.gathered) + sparse,
        )

    def _all_reduce(self, tensors):
        raise NotImplementedError

    def _all_gather(self, tensors):
        raise NotImplementedError


def _spec(t: tf.Tensor) -> tuple[tuple[int, ...], str]:
    return tuple(t.shape.as_list()), t.dtype.name


class LocalComm(Comm):
    """Collectives of a single replica: the sum of one is itself.

    Runs an aggregator's full math (and its byte recording) in one process.
    """

    num_replicas = 1

    def _all_reduce(self, tensors):
        return [t if isinstance(t, tf.IndexedSlices) else tf.identity(t) for t in tensors]

    def _all_gather(self, tensors):
        return [tf.expand_dims(t, 0) for t in tensors]


class ReplicaComm(Comm):
    """Collectives through the current replica context.

    Works under MirroredStrategy and MultiWorkerMirroredStrategy alike. The
    tensors of one call go in one collective per dtype (an all-gather: one
    for float16, one for everything else, packed as int32 words).
    """

    def __init__(self) -> None:
        super().__init__()
        self.num_replicas = tf.distribute.get_replica_context().num_replicas_in_sync

    # The context is looked up per call: a branch of cond() may run in a
    # fresh replica context (MirroredStrategy's call_for_each_replica).
    def _all_reduce(self, tensors):
        sent = [_slices_to_wire(t) for t in tensors]
        # One call per dtype: inside a tf.function TensorFlow packs a call's
        # dense tensors into one concat, which fails on mixed dtypes (a
        # cast's 16-bit payloads beside a float32 or integer gradient sent
        # as it is). IndexedSlices, gathered apart anyway, go in one call.
        groups: dict[str, list[int]] = {}
        for i, t in enumerate(sent):
            key = "slices" if isinstance(t, tf.IndexedSlices) else t.dtype.name
            groups.setdefault(key, []).append(i)
        out: list[Any] = [None] * len(sent)
        for members in groups.values():
            for i, o in zip(members, self._sum([sent[i] for i in members])):
                out[i] = o
        return [_slices_from_wire(o, t) for o, t in zip(out, tensors)]

    def _sum(self, tensors: list) -> list:
        """SUM over replicas of each tensor (IndexedSlices: gathered)."""
        return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, tensors)

    def _gather_rows(self, rows: tf.Tensor) -> tf.Tensor:
        """Every replica's [1, n] row, stacked in replica order: [N, n]."""
        return tf.distribute.get_replica_context().all_gather(rows, axis=0)

    def _all_gather(self, tensors):
        # One collective per wire dtype, whatever the number of tensors:
        # every payload is flattened into int32 words (float16 stays float16,
        # which needs no padding) and concatenated; all_gather stacks each
        # replica's buffer as a row. Handing all_gather a list instead makes
        # one collective per tensor: one more round trip each, between
        # processes.
        words = [_to_words(t) for t in tensors]
        groups: dict[str, list[int]] = {}
        for i, w in enumerate(words):
            groups.setdefault(w.dtype.name, []).append(i)
        out: list[Any] = [None] * len(tensors)
        for members in groups.values():
            packed = tf.concat([words[i] for i in members], axis=0)
            rows = self._gather_rows(tf.expand_dims(packed, 0))
            offset = 0
            for i in members:
                size = int(words[i].shape[0])
                out[i] = _from_words(rows[:, offset : offset + size], tensors[i])
                offset += size
        return out

    def cond(self, pred, true_fn, false_fn, args):
        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            return super().cond(pred, true_fn, false_fn, args)

        # MirroredStrategy on CPU all-reduces through merge_call, which a
        # tf.cond in replica context cannot contain: branch in cross-replica
        # context and run each branch on every replica (as Keras's
        # LossScaleOptimizer does).
        def merged(distribution, pred, *args):
            pred = distribution.experimental_local_results(pred)[0]
            run = distribution.extended.call_for_each_replica
            return tf.cond(pred, lambda: run(true_fn, args), lambda: run(false_fn, args))

        return tf.distribute.get_replica_context().merge_call(merged, args=(pred, *args))


def _slices_to_wire(t: Any) -> Any:
    """bfloat16 slices travel bit for bit as float16 (same size), which the
    collectives gather; everything else as it is."""
    if isinstance(t, tf.IndexedSlices) and t.values.dtype == tf.bfloat16:
        return tf.IndexedSlices(tf.bitcast(t.values, tf.float16), t.indices, t.dense_shape)
    return t


def _slices_from_wire(out: Any, like: Any) -> Any:
    """Inverse of :func:`_slices_to_wire`."""
    if isinstance(like, tf.IndexedSlices) and like.values.dtype == tf.bfloat16:
        return tf.IndexedSlices(tf.bitcast(out.values, tf.bfloat16), out.indices, out.dense_shape)
    return out


def _to_wire(payload: tf.Tensor) -> tf.Tensor:
    """Packs a payload the collectives cannot gather (uint8, int8, int16,
    bfloat16) into int32 words, byte for byte: no bytes are added but the
    padding to a multiple of 4."""
    if payload.dtype.name in GATHER_DTYPES:
        return payload
    raw = tf.reshape(tf.bitcast(payload, tf.uint8), [-1])
    raw = tf.pad(raw, [[0, -raw.shape[0] % 4]])
    return tf.bitcast(tf.reshape(raw, [-1, 4]), tf.int32)


def _to_words(payload: tf.Tensor) -> tf.Tensor:
    """A payload as a flat tensor the gather buffer can hold: float16 as it
    is, everything else as int32 words (bit for bit; the dtypes
    :func:`_to_wire` packs are padded to a multiple of 4 bytes)."""
    name = payload.dtype.name
    if name in ("float16", "int32"):
        return tf.reshape(payload, [-1])
    if name in GATHER_DTYPES:  # float32, float64, int64: whole int32 words
        return tf.reshape(tf.bitcast(payload, tf.int32), [-1])
    return tf.reshape(_to_wire(payload), [-1])


def _from_words(rows: tf.Tensor, like: tf.Tensor) -> tf.Tensor:
    """Inverse of :func:`_to_words` for every replica's row at once:
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
    from tfdist.compression.setting import default_error_feedback

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
