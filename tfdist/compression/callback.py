"""A Keras callback that reports gradient traffic per step."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from tfdist.compression.applied import applies_this_step, own_reduction
from tfdist.compression.keras_hook import strategy_aggregator
from tfdist.record import record_of
from tfdist.transport.traffic import Traffic


def _mesh_runtime(strategy: Any) -> Any:
    """The tensor-parallel mesh runtime a strategy carries (set by
    :func:`tfdist.parallel.attach.attach`), or None."""
    return record_of(strategy).mesh


class CommunicationStats(keras.callbacks.Callback):
    """Adds the bytes each replica sends per step to the training logs.

    At the end of every epoch (and, with ``every_batch=True``, every batch)
    the logs get ``comm_bytes`` (bytes a replica sent for the last step's
    gradients), ``comm_dense_bytes`` (what a plain fp32 all-reduce would have
    sent) and ``comm_ratio``; the progress bar and ``History`` show them when
    this callback comes before them (Keras adds its own at the end of the
    list). ``self.total_bytes`` and ``self.total_dense_bytes`` accumulate over
    all steps.

    The figures come from the strategy's aggregator and the model's gradient
    shapes and dtypes (:meth:`Aggregator.traffic`), so PowerSGD's dense
    warm-up steps count as dense. Without compression, or with one replica,
    ``comm_bytes`` equals ``comm_dense_bytes`` for N replicas (0 for one).
    With Keras's ``gradient_accumulation_steps=k`` gradients are sent every
    k-th step only: the other steps add nothing to the totals, and the logs
    show the last step that sent. A custom loop gets the same figures from
    :func:`~tfdist.compression.step_traffic`.

    Args:
        strategy: The strategy ``fit`` runs under; default: the model's.
        every_batch: Also add the figures to every batch's logs.
        batch_size: The global batch size, for a model with Embedding layers
            (sparse gradients, one row per id looked up); None: each step's
            examples as Keras counted them (see
            :class:`~tfdist.compression.sparse.StepGradients`).
    """

    def __init__(
        self, strategy: Any = None, every_batch: bool = False, batch_size: int | None = None
    ) -> None:
        super().__init__()
        self._strategy = strategy
        self.every_batch = every_batch
        self.total_bytes = 0.0
        self.total_dense_bytes = 0.0
        self.steps = 0
        self.last: Traffic | None = None
        self._shapes: Any = None
        self.batch_size = batch_size

    def _traffic(self, step: int) -> Traffic:
        strategy = (
            self._strategy
            or getattr(self.model, "distribute_strategy", None)
            or tf.distribute.get_strategy()
        )
        if self._shapes is None:
            from tfdist.compression.sparse import StepGradients

            self._shapes = StepGradients(self.model, strategy, self.batch_size)
        n = strategy.num_replicas_in_sync
        aggregator = strategy_aggregator(strategy)
        hvd = own_reduction(self.model.optimizer)
        if hvd is not None:  # hvd.DistributedOptimizer: its own aggregator and ranks.
            n, aggregator = hvd.num_replicas, hvd.aggregator
        if aggregator is None:
            from tfdist.compression.aggregate import CompressorAggregator
            from tfdist.compression.identity import NoneCompressor

            aggregator = CompressorAggregator(NoneCompressor())
        return aggregator.traffic(self._shapes(aggregator), n, step=step)

    def _strategy_now(self) -> Any:
        return (
            self._strategy
            or getattr(self.model, "distribute_strategy", None)
            or tf.distribute.get_strategy()
        )

    def _mesh_traffic(self, runtime: Any, strategy: Any) -> dict[str, float]:
        """Under a (data, tensor) mesh: the bytes counted by the collectives
        since the last call, split by kind, and the dense reference (the full
        model's gradients all-reduced over every replica, as data
        parallelism alone would send)."""
        now = runtime.traffic()
        before = getattr(self, "_mesh_seen", None) or {k: 0.0 for k in now}
        self._mesh_seen = now
        sent = {k: now[k] - before.get(k, 0.0) for k in now}
        dense = runtime.dense_gradient_bytes(self.model, strategy.num_replicas_in_sync)
        total = sent["tensor_parallel"] + sent["data_parallel"]
        return {
            "comm_bytes": total,
            "comm_dense_bytes": dense,
            "comm_ratio": dense / total if total else float("inf"),
            "comm_tensor_parallel_bytes": sent["tensor_parallel"],
            "comm_data_parallel_bytes": sent["data_parallel"],
        }

    def on_train_begin(self, logs: dict | None = None) -> None:
        runtime = _mesh_runtime(self._strategy_now())
        self._mesh_seen = runtime.traffic() if runtime is not None else None

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.steps += 1
        strategy = self._strategy_now()
        runtime = _mesh_runtime(strategy)
        if runtime is not None:
            # Measured by the collectives: the activations' traffic as well
            # as the gradients'.
            self.mesh_logs = self._mesh_traffic(runtime, strategy)
            self.total_bytes += self.mesh_logs["comm_bytes"]
            self.total_dense_bytes += self.mesh_logs["comm_dense_bytes"]
            if self.every_batch and logs is not None:
                logs.update(self.mesh_logs)
            return
        optimizer = self.model.optimizer
        hvd = own_reduction(optimizer)
        if not (
            hvd.sent_last_step(getattr(optimizer, "inner_optimizer", optimizer))
            if hvd is not None
            else applies_this_step(optimizer)
        ):
            return  # Only accumulated: nothing was sent.
        step = int(self.model.optimizer.iterations.numpy()) - 1  # The step just taken.
        self.last = self._traffic(step)
        self.total_bytes += self.last.sent
        self.total_dense_bytes += self.last.dense_sent
        if self.every_batch and logs is not None:
            logs.update(self.last.as_logs())

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is not None and getattr(self, "mesh_logs", None) is not None:
            logs.update(self.mesh_logs)
        elif logs is not None and self.last is not None:
            logs.update(self.last.as_logs())
