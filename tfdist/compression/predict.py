"""Predicting a model's gradient traffic per step before training."""

from __future__ import annotations

from typing import Any

from tfdist.compression.registry import make_aggregator
from tfdist.compression.sparse import SparseGradient, model_gradients, rows_per_replica
from tfdist.errors import ConfigError
from tfdist.transport.traffic import Traffic, dtype_name

__all__ = ["predict_traffic"]


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
            An Embedding whose input length the model leaves open
            (keras-hub's BERT) counts the ids per example of the step its
            optimizer last traced, so it needs a ``fit`` step first.

    Returns:
        A :class:`Traffic`.

    Raises:
        ConfigError: Bad compression setting, ``num_replicas`` < 1, or a
            model with Embedding layers and no (or a bad) ``batch_size``.
    """
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ConfigError("num_replicas", num_replicas, "an integer >= 1")
    shapes = _shapes_of(variables, batch_size, num_replicas)
    aggregator = make_aggregator(compression, error_feedback=error_feedback)
    return aggregator.traffic(shapes, num_replicas, step=step)


def _shapes_of(variables: Any, batch_size: int | None = None, num_replicas: int = 1) -> list:
    """Gradient specs of a model, variables, or specs: ``(shape, dtype name)``
    pairs, and :class:`SparseGradient` entries for a model's Embedding tables."""
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
        out.append((tuple(int(d) for d in shape), dtype_name(dtype)))
    return out
