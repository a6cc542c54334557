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

This module runs no TensorFlow op: :func:`predict_traffic` works before
training, from shapes and dtypes alone.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable

#: Dtype names all-gather carries without packing.
GATHER_DTYPES = frozenset({"float16", "float32", "float64", "int32", "int64"})


def all_reduce_bytes(payload: int, num_replicas: int) -> float:
    """Bytes one replica sends in a ring all-reduce of ``payload`` bytes."""
    return 2.0 * (num_replicas - 1) / num_replicas * payload


def all_gather_bytes(payload: int, num_replicas: int) -> float:
    """Bytes one replica sends in a ring all-gather of ``payload`` bytes each."""
    return float((num_replicas - 1) * payload)


def _dtype_name(dtype: Any) -> str:
    return getattr(dtype, "name", str(dtype))


def _itemsize(dtype: Any) -> int:
    size = getattr(dtype, "size", None)
    if size is None:
        import numpy as np  # Plain dtype strings, e.g. "float32".

        size = np.dtype(dtype).itemsize if _dtype_name(dtype) != "bfloat16" else 2
    return int(size)


def nbytes(shape: Iterable[int], dtype: Any) -> int:
    """Bytes of a dense tensor."""
    return math.prod(int(d) for d in shape) * _itemsize(dtype)


def wire_nbytes(shape: Iterable[int], dtype: Any) -> int:
    """Bytes of one all-gathered payload tensor, with its int32 padding."""
    size = nbytes(shape, dtype)
    if _dtype_name(dtype) in GATHER_DTYPES:
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
        return (all_reduce_bytes(self.dense, self.num_replicas)
                + all_gather_bytes(self.dense_gather, self.num_replicas))

    @property
    def sent(self) -> float:
        """Bytes a replica sends with compression."""
        return (all_reduce_bytes(self.all_reduce, self.num_replicas)
                + all_gather_bytes(self.all_gather, self.num_replicas))

    @property
    def ratio(self) -> float:
        """How many times fewer bytes than dense (inf if nothing is sent)."""
        return self.dense_sent / self.sent if self.sent else math.inf

    def as_logs(self) -> dict[str, float]:
        """The figures a Keras callback puts in the logs."""
        return {"comm_bytes": self.sent, "comm_dense_bytes": self.dense_sent,
                "comm_ratio": self.ratio}

    def __str__(self) -> str:
        reference = ("uncompressed, sparse gradients all-gathered" if self.dense_gather
                     else "dense fp32 all-reduce")
        return (f"{self.sent:,.0f} bytes sent per replica per step "
                f"({reference}: {self.dense_sent:,.0f}; "
                f"{self.ratio:.1f}x fewer) among {self.num_replicas} replicas")


def predict_traffic(
    variables: Any,
    compression: Any,
    num_replicas: int,
    *,
    error_feedback: bool | None = None,
    step: int | None = None,
    batch_size: int | None = None,
) -> Traffic:
    """Predicts the bytes per step of a model's gradients, before training.

    Args:
        variables: A Keras model (its trainable variables are used; its
            Embedding tables have sparse gradients), a list of variables
            (all dense), or a list of ``(shape, dtype)`` pairs and
            :class:`~tfdist.compression.sparse.SparseGradient` entries.
        compression: Anything ``strategy_from_config(compression=...)``
            accepts, e.g. ``"topk:0.01"`` or ``"powersgd:4"``.
        num_replicas: N, the number of replicas in sync (workers times
            devices per worker).
        error_feedback: As in ``strategy_from_config``; it changes nothing
            on the wire but is validated the same way.
        step: The training step, for aggregators whose traffic changes with
            it (PowerSGD sends dense gradients during its warm-up); None
            means after any warm-up.
        batch_size: The global batch of the step (``fit``'s
            ``batch_size``); needed for a model with Embedding layers. Their
            gradients are IndexedSlices, all-gathered with one row per id
            looked up (duplicates included) by the replica holding the most
            examples, ``ceil(batch_size / num_replicas)`` of them: e.g. an
            ``Embedding(2000, 32)`` fed 4 ids per example, a batch of 64 on
            2 replicas, sends 128 rows of 32 float32 values and their int32
            indices, plus one int32 row count, from each replica.

    Returns:
        A :class:`Traffic`.

    Raises:
        ConfigError: Bad compression setting, ``num_replicas`` < 1, or a
            model with Embedding layers and no (or a bad) ``batch_size``.
    """
    from tfdist.compression.registry import make_aggregator
    from tfdist.errors import ConfigError

    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ConfigError("num_replicas", num_replicas, "an integer >= 1")
    shapes = _shapes_of(variables, batch_size, num_replicas)
    aggregator = make_aggregator(compression, error_feedback=error_feedback)
    return aggregator.traffic(shapes, num_replicas, step=step)


def _shapes_of(variables: Any, batch_size: int | None = None,
               num_replicas: int = 1) -> list:
    """Gradient specs of a model, variables, or specs: ``(shape, dtype name)``
    pairs, and :class:`SparseGradient` entries for a model's Embedding tables."""
    from tfdist.compression.sparse import SparseGradient, model_gradients, rows_per_replica

    if hasattr(variables, "trainable_variables"):
        examples = None if batch_size is None else rows_per_replica(batch_size, num_replicas)
        return model_gradients(variables, examples)
    out = []
    for v in variables:
        if isinstance(v, SparseGradient):
            out.append(v)
            continue
        if isinstance(v, tuple) and len(v) == 2:
            shape, dtype = v
        else:
            shape, dtype = v.shape, v.dtype
        out.append((tuple(int(d) for d in shape), _dtype_name(dtype)))
    return out
