"""An aggregator's collectives run in Python by a host transport: :class:`HostComm`.

MPI (:class:`tfdist.transport.MpiTransport`) and the pipeline's rings of
stage replicas (:class:`tfdist.transport.ring.RingGroup`) sum and gather
numpy arrays outside TensorFlow's collectives. :class:`HostComm` hands them
an aggregator's tensors through ``tf.numpy_function``, chained by control
dependencies in the order they are made, so that every process calls the
same collectives in the same order whatever TensorFlow's executor
schedules (and eagerly, one after the other).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import tensorflow as tf

from tfdist.transport.comm import ReplicaComm
from tfdist.transport.ring import SUMMABLE_DTYPES

__all__ = ["HostCollectives", "HostComm", "SUMMABLE"]

#: dtypes a host transport sums as they are (MPI's and the ring's alike);
#: 16-bit floats are gathered and summed here in float32 (MPI has no 16-bit
#: float sum).
SUMMABLE = SUMMABLE_DTYPES


class HostCollectives(Protocol):
    """What a host transport offers :class:`HostComm`: numpy in, numpy out."""

    size: int

    def allreduce(self, *arrays: np.ndarray) -> list[np.ndarray]:
        """The sum over the processes of each array."""

    def allgather(self, flat: np.ndarray) -> np.ndarray:
        """Every process's ``flat``, stacked on a new axis 0."""

    def allgatherv(self, rows: np.ndarray) -> np.ndarray:
        """Every process's rows (their counts may differ), concatenated."""


class HostComm(ReplicaComm):
    """A :class:`~tfdist.transport.comm.ReplicaComm` whose primitives
    (:meth:`reduce_sum`, :meth:`gather_rows`) call a host transport.

    Args:
        transport: The host transport.
        num_replicas: The replicas the collectives span (default: the
            transport's processes).
    """

    def __init__(self, transport: HostCollectives, num_replicas: int | None = None) -> None:
        super().__init__(transport.size if num_replicas is None else num_replicas)
        self.transport = transport
        self._last: tf.Tensor | None = None

    def _host_call(
        self, fn: Callable, inputs: Sequence[tf.Tensor], dtypes: Sequence[tf.DType]
    ) -> list[tf.Tensor]:
        deps = [] if self._last is None else [self._last]
        with tf.control_dependencies(deps):
            outs = tf.numpy_function(fn, list(inputs), list(dtypes), stateful=True)
        outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        self._last = outs[0]
        return outs

    def reduce_sum(self, tensors: list) -> list:
        if not tensors:
            return []
        if isinstance(tensors[0], tf.IndexedSlices):
            return [self._gather_slices(t) for t in tensors]
        dtype = tensors[0].dtype
        if dtype.name in SUMMABLE:
            outs = self._host_call(self.transport.allreduce, tensors, [dtype] * len(tensors))
            for out, t in zip(outs, tensors):
                out.set_shape(t.shape)
            return outs
        # 16-bit floats: gathered in one buffer, then summed in float32 here.
        flat = tf.concat([tf.reshape(t, [-1]) for t in tensors], axis=0)
        (rows,) = self._host_call(self.transport.allgather, [flat], [dtype])
        summed = tf.cast(tf.reduce_sum(tf.cast(rows, tf.float32), axis=0), dtype)
        summed = tf.reshape(summed, flat.shape)
        out, offset = [], 0
        for t in tensors:
            size = t.shape.num_elements()
            out.append(tf.reshape(summed[offset : offset + size], tf.shape(t)))
            offset += size
        return out

    def _gather_slices(self, t: tf.IndexedSlices) -> tf.IndexedSlices:
        values, indices = self._host_call(
            lambda v, i: (self.transport.allgatherv(v), self.transport.allgatherv(i)),
            [t.values, t.indices],
            [t.values.dtype, t.indices.dtype],
        )
        values.set_shape(tf.TensorShape([None]).concatenate(t.values.shape[1:]))
        indices.set_shape([None])
        return tf.IndexedSlices(values, indices, t.dense_shape)

    def gather_rows(self, rows: tf.Tensor) -> tf.Tensor:
        (out,) = self._host_call(lambda r: self.transport.allgather(r[0]), [rows], [rows.dtype])
        out.set_shape([self.num_replicas, rows.shape[1]])
        return out

    def cond(self, pred, true_fn, false_fn, args):
        # Both branches may call the transport: each starts after the calls
        # made before the cond, and the calls made after it wait for its result.
        before = self._last

        def branch(fn):
            def run():
                self._last = before
                return fn(*args)

            return run

        out = tf.cond(pred, branch(true_fn), branch(false_fn))
        tensors = [t for t in tf.nest.flatten(out) if isinstance(t, tf.Tensor)]
        self._last = tensors[0] if tensors else before
        return out
