""":func:`scale_learning_rate` and :class:`LearningRateWarmup`: the linear scaling
rule with gradual warm-up (Goyal et al. 2017, as Horovod does it).
"""

from __future__ import annotations

import math
from typing import Any

import keras

from tfdist.errors import ConfigError, require_int
from tfdist.training.callbacks.workers import model_strategy

# --------------------------------------------------------------------------
# Learning rate: linear scaling and warm-up.


def _replicas(strategy: Any, field: str = "strategy", source: str = "") -> int:
    count = getattr(strategy, "num_replicas_in_sync", None)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ConfigError(
            field,
            strategy,
            "a tf.distribute strategy (something with num_replicas_in_sync >= 1)",
            source=source or None,
        )
    return count


def _positive_number(field: str, value: Any, source: str, *, allow_zero: bool = False) -> float:
    ok = (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and (value >= 0 if allow_zero else value > 0)
    )
    if not ok:
        raise ConfigError(
            field, value, "a number >= 0" if allow_zero else "a number > 0", source=source
        )
    return float(value)


def scale_learning_rate(
    base_lr: float,
    strategy: Any,
    base_batch: int | None = None,
    per_replica_batch: int | None = None,
) -> float:
    """The linear scaling rule (Goyal et al. 2017): lr grows with the batch.

    Without batch sizes, each replica is taken to keep the batch of the
    single-device run, so the global batch, and the rate, grow by the number
    of replicas: ``base_lr * num_replicas_in_sync``. With both batch sizes:
    ``base_lr * per_replica_batch * num_replicas_in_sync / base_batch``.

    Large rates early in training diverge; pair this with
    :class:`LearningRateWarmup`.

    Args:
        base_lr: Rate tuned for ``base_batch`` on one device.
        strategy: The strategy training runs under.
        base_batch: Batch size ``base_lr`` was tuned for.
        per_replica_batch: Batch size of each replica.

    Raises:
        ConfigError: A non-positive rate or batch, or only one batch size.
    """
    source = "scale_learning_rate"
    base_lr = _positive_number("base_lr", base_lr, source)
    replicas = _replicas(strategy, source=source)
    if base_batch is None and per_replica_batch is None:
        return base_lr * replicas
    if base_batch is None or per_replica_batch is None:
        missing = "base_batch" if base_batch is None else "per_replica_batch"
        given = per_replica_batch if base_batch is None else base_batch
        raise ConfigError(
            missing,
            None,
            "an integer >= 1 when "
            f"{'per_replica_batch' if base_batch is None else 'base_batch'}"
            f"={given!r} is given (or neither)",
            source=source,
        )
    base_batch = require_int("base_batch", base_batch, 1, source)
    per_replica_batch = require_int("per_replica_batch", per_replica_batch, 1, source)
    return base_lr * per_replica_batch * replicas / base_batch


class LearningRateWarmup(keras.callbacks.Callback):
    """Gradual learning-rate warm-up (Goyal et al. 2017; Horovod's semantics).

    Before every batch of the first ``warmup_epochs`` epochs the optimizer's
    rate is set to::

        initial_lr + (target_lr - initial_lr) * min(1, (epoch + (batch + 1)
                                                        / steps_per_epoch)
                                                       / warmup_epochs)

    so it rises linearly per batch and reaches ``target_lr`` exactly on the
    last batch of the warm-up (Horovod's ``LearningRateWarmupCallback``
    shifts by one batch the same way). Afterwards the rate is left at
    ``target_lr``; other schedules callbacks may take over from there.
    Horovod's momentum correction is not done: Keras 3 optimizers bake a
    float momentum into the traced step.

    Args:
        warmup_epochs: Epochs the ramp lasts (may be fractional).
        initial_lr: Rate of the start of the ramp. Default, as in Horovod:
            ``target_lr / num_replicas_in_sync``, i.e. the single-replica rate
            when ``target_lr`` was scaled with :func:`scale_learning_rate`.
        target_lr: Rate at the end of the ramp. Default: the optimizer's
            rate when the callback first sees the model (before a
            :class:`BackupAndRestore` restores a mid-ramp rate).
        steps_per_epoch: Batches per epoch; default: what ``fit`` reports.
        verbose: 1 prints when the warm-up ends.

    Raises:
        ConfigError: Bad arguments; or, when ``fit`` starts, an optimizer
            whose rate is a ``LearningRateSchedule`` (it cannot be set), or
            an unknown number of steps per epoch.
    """

    def __init__(
        self,
        warmup_epochs: float = 5,
        initial_lr: float | None = None,
        target_lr: float | None = None,
        steps_per_epoch: int | None = None,
        verbose: int = 0,
    ) -> None:
        super().__init__()
        source = "LearningRateWarmup"
        self.warmup_epochs = _positive_number("warmup_epochs", warmup_epochs, source)
        self.initial_lr = (
            None
            if initial_lr is None
            else _positive_number("initial_lr", initial_lr, source, allow_zero=True)
        )
        self.target_lr = (
            None if target_lr is None else _positive_number("target_lr", target_lr, source)
        )
        self.steps_per_epoch = (
            None
            if steps_per_epoch is None
            else require_int("steps_per_epoch", steps_per_epoch, 1, source)
        )
        self.verbose = verbose
        self._seen_target: float | None = None
        self._epoch = 0
        self._done = False
        self._steps = 1
        self._initial = self._target = 0.0

    def _optimizer_lr(self, model: Any) -> float:
        optimizer = getattr(model, "optimizer", None)
        schedule = getattr(optimizer, "_learning_rate", None)
        if (
            optimizer is None
            or isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule)
            or callable(schedule)
        ):
            raise ConfigError(
                "optimizer.learning_rate",
                schedule,
                "a float rate that can be set per batch",
                source="LearningRateWarmup",
                hint="Put the warm-up into the schedule itself, or "
                "compile with a float learning rate.",
            )
        return float(keras.ops.convert_to_numpy(optimizer.learning_rate))

    def set_model(self, model: Any) -> None:
        super().set_model(model)
        if self.target_lr is None and self._seen_target is None:
            try:
                self._seen_target = self._optimizer_lr(model)
            except ConfigError:
                pass  # Reported at on_train_begin.

    def on_train_begin(self, logs: dict | None = None) -> None:
        current = self._optimizer_lr(self.model)  # Also checks it is settable.
        self._target = self.target_lr or self._seen_target or current
        replicas = model_strategy(self.model).num_replicas_in_sync
        self._initial = self._target / replicas if self.initial_lr is None else self.initial_lr
        steps = self.steps_per_epoch or (self.params or {}).get("steps")
        if not steps:
            raise ConfigError(
                "steps_per_epoch",
                steps,
                "an integer >= 1 (fit does not know the number of batches per epoch)",
                source="LearningRateWarmup",
                hint="Pass steps_per_epoch= to LearningRateWarmup.",
            )
        self._steps = int(steps)
        self._done = False

    def rate(self, epoch: int, batch: int) -> float:
        """The rate set before ``batch`` (0-based) of ``epoch`` (0-based)."""
        progress = (epoch + (batch + 1) / self._steps) / self.warmup_epochs
        if progress >= 1:
            return self._target  # Exactly, not initial + (target - initial).
        return self._initial + (self._target - self._initial) * progress

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self._done:
            return
        lr = self.rate(self._epoch, batch)
        self.model.optimizer.learning_rate = lr
        if lr == self._target:
            self._done = True
            if self.verbose:
                print(
                    f"\nEpoch {self._epoch + 1}: finished gradual learning rate warm-up to {lr:g}.",
                    flush=True,
                )

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is not None:
            logs["learning_rate"] = float(
                keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)
            )
