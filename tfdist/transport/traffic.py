"""Byte accounting: what each replica sends per step, dense and compressed.

Counts follow the ring algorithms TensorFlow's CPU/GPU collectives use among
N replicas, for a payload of S bytes per replica:

* all-reduce (reduce-scatter, then all-gather): each replica sends
  ``2 (N - 1) / N * S`` bytes;
* all-gather: each replica forwards every other replica's payload once, so it
  sends ``(N - 1) * S`` bytes.

The dense reference is what Keras sends without compression: the all-reduce
of every dense gradient in its own dtype (float32 for a float32 model), and
the all-gather of every sparse one (``tf.IndexedSlices``, an Embedding
table's gradient: one row per id looked up, see
:mod:`tfdist.compression.sparse`), whose size depends on the batch.
Payloads that the collectives cannot gather as they are (uint8, int8, int16,
bfloat16) are packed into int32 words, so each is padded to a multiple of 4
bytes; :func:`wire_nbytes` counts that padding.

This module runs no TensorFlow op, so the counts (and
:func:`tfdist.compression.predict.predict_traffic`) work before training,
from shapes and dtypes alone. It sits with the transports, whose
:class:`~tfdist.transport.comm.Comm` counts what it sends;
:mod:`tfdist.compression.traffic` keeps its public path.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

#: Dtype names all-gather carries without packing.
GATHER_DTYPES = frozenset({"float16", "float32", "float64", "int32", "int64"})


def all_reduce_bytes(payload: int, num_replicas: int) -> float:
    """Bytes one replica sends in a ring all-reduce of ``payload`` bytes."""
    return 2.0 * (num_replicas - 1) / num_replicas * payload


def all_gather_bytes(payload: int, num_replicas: int) -> float:
    """Bytes one replica sends in a ring all-gather of ``payload`` bytes each."""
    return float((num_replicas - 1) * payload)


def dtype_name(dtype: Any) -> str:
    """The name of ``dtype`` (a TensorFlow/numpy dtype or a string)."""
    return getattr(dtype, "name", str(dtype))


def itemsize(dtype: Any) -> int:
    """Bytes per element of ``dtype`` (bfloat16: 2)."""
    size = getattr(dtype, "size", None)
    if size is None:
        import numpy as np  # Plain dtype strings, e.g. "float32".

        size = np.dtype(dtype).itemsize if dtype_name(dtype) != "bfloat16" else 2
    return int(size)


#: Bytes of the row count each replica all-gathers before an IndexedSlices' slices.
LENGTH_BYTES = 4


def slices_nbytes(rows: int, row_size: int, value_dtype: str, index_dtype: str) -> int:
    """Bytes one replica contributes to the all-gathers of one IndexedSlices:
    its row count, then ``rows`` slices of ``row_size`` values in
    ``value_dtype`` and their indices."""
    return LENGTH_BYTES + rows * (row_size * itemsize(value_dtype) + itemsize(index_dtype))


def nbytes(shape: Iterable[int], dtype: Any) -> int:
    """Bytes of a dense tensor."""
    return math.prod(int(d) for d in shape) * itemsize(dtype)


def wire_nbytes(shape: Iterable[int], dtype: Any) -> int:
    """Bytes of one all-gathered payload tensor, with its int32 padding."""
    size = nbytes(shape, dtype)
    if dtype_name(dtype) in GATHER_DTYPES:
        return size
    return -(-size // 4) * 4


@dataclasses.dataclass
class Traffic:
    """Payload bytes per replica for one step, by collective.

    Attributes:
        num_replicas: N, the replicas in sync.
        dense: Bytes of the dense gradients uncompressed (the reference
            all-reduce payload).
        all_reduce: Bytes each replica contributes to all-reduces.
        all_gather: Bytes each replica contributes to all-gathers.
        collectives: How many collective calls a step makes (TensorFlow
            gathers each IndexedSlices in three: row count, values, indices).
        dense_gather: Bytes each replica contributes to the all-gathers of
            sparse gradients (IndexedSlices) without compression: the
            reference payload of the gradients that are not all-reduced.
    """

    num_replicas: int
    dense: int = 0
    all_reduce: int = 0
    all_gather: int = 0
    collectives: int = 0
    dense_gather: int = 0

    @property
    def dense_sent(self) -> float:
        """Bytes a replica would send without compression: dense gradients
        all-reduced, sparse ones all-gathered."""
        return all_reduce_bytes(self.dense, self.num_replicas) + all_gather_bytes(
            self.dense_gather, self.num_replicas
        )

    @property
    def sent(self) -> float:
        """Bytes a replica sends with compression."""
        return all_reduce_bytes(self.all_reduce, self.num_replicas) + all_gather_bytes(
            self.all_gather, self.num_replicas
        )

    @property
    def ratio(self) -> float:
        """How many times fewer bytes than dense (inf if nothing is sent)."""
        return self.dense_sent / self.sent if self.sent else math.inf

    def as_logs(self) -> dict[str, float]:
        """The figures a Keras callback puts in the logs."""
        return {
            "comm_bytes": self.sent,
            "comm_dense_bytes": self.dense_sent,
            "comm_ratio": self.ratio,
        }

    def __str__(self) -> str:
        reference = (
            "uncompressed, sparse gradients all-gathered"
            if self.dense_gather
            else "dense fp32 all-reduce"
        )
        return (
            f"{self.sent:,.0f} bytes sent per replica per step "
            f"({reference}: {self.dense_sent:,.0f}; "
            f"{self.ratio:.1f}x fewer) among {self.num_replicas} replicas"
        )
