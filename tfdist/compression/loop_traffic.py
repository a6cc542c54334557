"""Bytes a custom training loop sent for its last step.

:class:`~tfdist.compression.CommunicationStats` reports the traffic of each
``fit`` step; :func:`step_traffic` gives a custom loop the same figures.
Call it eagerly after each step::

    sent = 0.0
    for batch in dist_dataset:
        distributed_train_step(batch)
        sent += tfdist.compression.step_traffic(optimizer).sent

The bytes come from the strategy's aggregator and the gradients' shapes and
dtypes (:meth:`Aggregator.traffic`), at the step the optimizer just applied,
so PowerSGD's dense warm-up steps count as dense. With Keras's
``gradient_accumulation_steps=k`` only every k-th step sends anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tfdist.compression.applied import applies_this_step, own_reduction
from tfdist.compression.keras_hook import strategy_aggregator, traced_slices
from tfdist.compression.sparse import check_traced, model_gradients, rows_per_replica
from tfdist.errors import ConfigError
from tfdist.transport.traffic import Traffic

__all__ = ["step_traffic"]


def _aggregator_of(strategy: Any):
    aggregator = strategy_aggregator(strategy)
    if aggregator is None:
        from tfdist.compression.aggregate import CompressorAggregator
        from tfdist.compression.identity import NoneCompressor

        aggregator = CompressorAggregator(NoneCompressor())
    return aggregator


def step_traffic(
    optimizer: Any,
    variables: Sequence[Any] | None = None,
    *,
    strategy: Any = None,
    model: Any = None,
    batch_size: int | None = None,
) -> Traffic:
    """The bytes each replica sent for the gradients of ``optimizer``'s last step.

    Args:
        optimizer: The Keras optimizer the loop applies gradients with, after
            at least one step.
        variables: The variables the loop computes gradients for; default:
            those the optimizer was built with (``model.trainable_variables``
            in the usual loop).
        strategy: The strategy the loop runs under; default: the optimizer's.
        model: The Keras model being trained. Needed, with ``batch_size``,
            when it has Embedding layers: their gradients are IndexedSlices,
            one row per id looked up, so the bytes follow the batch.
        batch_size: The global batch size of the step (as the loop's
            dataset is batched).

    Returns:
        A :class:`Traffic`: ``sent`` (bytes a replica sent), ``dense_sent``
        (what a plain fp32 all-reduce sends), ``ratio``. A step that only
        accumulated gradients (``gradient_accumulation_steps``) sent nothing:
        ``sent`` and ``dense_sent`` are 0.

    Raises:
        ValueError: The optimizer has not applied a step yet.
        ConfigError: The step sent IndexedSlices and no ``model`` and
            ``batch_size`` say how many rows; or the model's Embedding tables
            do not match what was sent.
    """

    hvd = own_reduction(optimizer)
    strategy = (
        strategy
        or getattr(optimizer, "_distribution_strategy", None)
        or tf.distribute.get_strategy()
    )
    steps = int(getattr(optimizer, "_iterations", optimizer.iterations).numpy())
    if steps < 1:
        raise ValueError(
            "step_traffic: expected an optimizer that has taken a step. "
            "Received: an optimizer with iterations=0"
        )
    updates = int(optimizer.iterations.numpy())  # Applied steps, with accumulation.
    n = strategy.num_replicas_in_sync
    if hvd is not None:  # tfdist.horovod: one replica per process, its own aggregator.
        n = hvd.num_replicas
        if not hvd.sent_last_step(getattr(optimizer, "inner_optimizer", optimizer)):
            return Traffic(n)  # Accumulated locally; sent nothing.
    elif not applies_this_step(optimizer):
        return Traffic(n)
    traced = traced_slices(getattr(optimizer, "inner_optimizer", optimizer))
    if model is not None:
        examples = None if batch_size is None else rows_per_replica(batch_size, n)
        shapes = model_gradients(model, examples, traced)
        check_traced(shapes, traced)
    else:
        if traced:
            raise ConfigError(
                "model",
                None,
                "the model and the global batch_size for a step whose "
                "gradients include IndexedSlices",
                source="step_traffic",
                received=f"{len(traced)} IndexedSlices gradient(s) (Embedding tables) and no model",
                hint="Call step_traffic(optimizer, model=model, batch_size=GLOBAL_BATCH): "
                "an Embedding sends one row per id looked up, not its table.",
            )
        if variables is None:
            variables = getattr(optimizer, "_trainable_variables", None) or []
        shapes = [(tuple(int(d) for d in v.shape), tf.as_dtype(v.dtype).name) for v in variables]
    aggregator = hvd.aggregator if hvd is not None else _aggregator_of(strategy)
    return aggregator.traffic(shapes, n, step=updates - 1)
