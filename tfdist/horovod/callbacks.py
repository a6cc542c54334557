"""Horovod's Keras callbacks (``hvd.callbacks``) for Keras 3 on tfdist.

The same names, arguments and semantics as ``horovod.tensorflow.keras.callbacks``:

* :class:`BroadcastGlobalVariablesCallback`: after the first batch, every rank
  takes the root rank's model *and optimizer* variables. Keras 3 creates an
  optimizer's variables lazily, at its first ``apply``; a broadcast at
  ``on_train_begin`` would miss them, so (as Horovod does) it runs at the end
  of batch 0, and builds the optimizer first if it still is not built.
* :class:`MetricAverageCallback`: at the end of each epoch the logs every rank
  sees (and later callbacks, ``History`` and the progress bar print) become the
  mean over the ranks. One all-reduce of all numeric metrics, in sorted-name
  order; ranks whose metric names differ get an error, not a hang.
* :class:`LearningRateScheduleCallback` and :class:`LearningRateWarmupCallback`:
  ``lr = initial_lr * multiplier(epoch)``, per epoch (``staircase``) or per
  batch with a fractional epoch; the warm-up ramps ``initial_lr / size()`` up
  to ``initial_lr`` (Goyal et al. 2017) exactly as Horovod's formula does.

Differences from Horovod, forced by Keras 3:

* The rate is set through the optimizer's ``learning_rate`` variable. An
  optimizer built with a ``LearningRateSchedule`` (or a callable) has no
  settable rate: a :class:`~tfdist.errors.ConfigError` says so when ``fit``
  starts, instead of Keras's TypeError mid-epoch.
* Momentum correction: Horovod multiplies ``optimizer.momentum`` by
  ``new_lr / old_lr`` for one batch. Keras 3 bakes the float momentum into the
  traced train step, so changing it has no effect. Here the velocity buffers
  are multiplied by ``new_lr / old_lr`` instead, which is the same update for
  SGD and RMSprop (their velocity carries the rate); with ``nesterov=True`` the
  look-ahead term uses the plain momentum. Optimizers without a momentum
  buffer (Adam...) get no correction, as in Horovod.
* ``steps_per_epoch=None`` is read from ``fit``'s ``params['steps']``;
  ``fit`` on a dataset of unknown length without ``steps_per_epoch`` raises a
  ConfigError asking for it.
"""

from __future__ import annotations

import numbers
import warnings
import zlib
from collections.abc import Callable, Iterable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfdist.compat import keras_private
from tfdist.errors import ConfigError
from tfdist.horovod import collectives, runtime

__all__ = [
    "BroadcastGlobalVariablesCallback",
    "MetricAverageCallback",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "broadcast_model",
    "average_logs",
    "model_state_variables",
]


def _check_rank(field: str, value: Any, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ConfigError(field, value, "an integer rank >= 0", source=source)
    return int(value)


def _number(field: str, value: Any, source: str, *, positive: bool = False) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not np.isfinite(value)
        or (positive and value <= 0)
        or value < 0
    ):
        expected = "a finite number > 0" if positive else "a finite number >= 0"
        raise ConfigError(field, value, expected, source=source)
    return float(value)


def model_state_variables(model: Any) -> list:
    """The model's variables without Keras 3's random-seed states.

    Keras 3 keeps a Dropout's (any SeedGenerator's) stream in a variable of
    ``model.variables``. Horovod broadcasts weights, not random streams
    (tf.keras 2 had none in its variables): leaving them out keeps each rank's
    dropout masks its own.
    """
    return [v for v in model.variables if getattr(v, "name", None) != "seed_generator_state"]


def _optimizer_variables(model: Any) -> list:
    """The model's optimizer variables, building the optimizer if it is not yet.

    Keras 3 builds an optimizer at its first ``apply``; building it here with
    the model's trainable variables creates the same slots that apply would.
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return []
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    return list(optimizer.variables)


def broadcast_model(
    model: Any, root_rank: int = 0, *, exclude: Iterable[int] = (), device: str = ""
) -> None:
    """Assigns the root rank's model and optimizer variables on every rank.

    Every rank must call it (it issues collectives in the same order on all).

    Args:
        model: A Keras model, compiled (its optimizer's variables are
            broadcast too) or not.
        root_rank: The rank whose values win.
        exclude: ``id()`` of variables to leave alone (rank-local ones).
        device: A device to run the broadcast on ("" for the default).
    """
    variables = [v for v in model_state_variables(model) if id(v) not in exclude]
    with tf.device(device):
        if variables:
            collectives.broadcast_variables(variables, root_rank=root_rank)
        optimizer_variables = _optimizer_variables(model)
        if optimizer_variables:
            collectives.broadcast_variables(optimizer_variables, root_rank=root_rank)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcasts the model's and optimizer's variables from ``root_rank``.

    Makes every rank start from the same weights, whether they were
    initialised at random (each rank differently) or loaded on the root rank
    only. The broadcast runs once, at the end of the first batch of the first
    ``fit``: by then Keras 3 has created the optimizer's slots, so they are
    broadcast too (the optimizer is built first if it still is not). Random
    seed states (Dropout's) stay per rank, as in Horovod.

    Args:
        root_rank: The rank whose variables every rank takes.
        device: Device to run the broadcast on ("" for the default).
        local_variables: Variables (one or a list) that stay per rank.

    Raises:
        ConfigError: A bad ``root_rank`` (also one >= ``size()`` when the
            broadcast runs) or a ``local_variables`` entry that is not a
            variable.
    """

    def __init__(self, root_rank: int, device: str = "", local_variables: Any = None) -> None:
        super().__init__()
        self.root_rank = _check_rank("root_rank", root_rank, "BroadcastGlobalVariablesCallback")
        self.device = device
        self.broadcast_done = False
        self._local_ids: set[int] = set()
        if local_variables is None:
            local_variables = []
        elif _is_variable(local_variables):
            local_variables = [local_variables]
        for var in local_variables:
            self.register_local_var(var)

    def register_local_var(self, var: Any) -> None:
        """Keeps ``var`` out of the broadcast (a Keras or tf.Variable)."""
        if not _is_variable(var):
            raise ConfigError(
                "local_variables",
                var,
                "Keras or TensorFlow variables",
                source="BroadcastGlobalVariablesCallback",
            )
        self._local_ids.add(id(var))
        # A tf.Variable behind a Keras variable, and the other way round.
        backing = getattr(var, "value", None) if isinstance(var, keras.Variable) else None
        if isinstance(backing, tf.Variable):
            self._local_ids.add(id(backing))

    def _excluded(self) -> set[int]:
        ids = set(self._local_ids)
        for var in self.model.variables:
            if isinstance(var, keras.Variable) and id(getattr(var, "value", None)) in ids:
                ids.add(id(var))
        return ids

    def on_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self.broadcast_done:
            return
        size = runtime.size()
        if self.root_rank >= size:
            raise ConfigError(
                "root_rank",
                self.root_rank,
                f"a rank in [0, {size - 1}]",
                source="BroadcastGlobalVariablesCallback",
            )
        broadcast_model(self.model, self.root_rank, exclude=self._excluded(), device=self.device)
        self.broadcast_done = True


def _is_variable(value: Any) -> bool:
    return isinstance(value, (keras.Variable, tf.Variable))


def average_logs(logs: dict, device: str = "") -> dict:
    """Replaces every numeric entry of ``logs`` with its mean over the ranks.

    Every rank must call it with the same metric names. The names are sorted
    and the values sent in one all-reduce, so ranks agree on the order. A
    check first compares the names (one small all-gather): ranks with
    different names all raise, rather than average unrelated numbers or hang.

    Returns:
        ``logs``, changed in place.

    Raises:
        ValueError: The ranks' metric names differ (every rank raises).
    """
    names = sorted(
        k
        for k, v in logs.items()
        if (isinstance(v, numbers.Real) and not isinstance(v, bool))
        or (isinstance(v, np.ndarray) and v.size == 1)
    )
    if runtime.size() == 1:
        return logs
    with tf.device(device):
        digest = float(zlib.crc32("\0".join(names).encode()))
        digests = collectives.allgather(tf.constant([digest], tf.float64)).numpy()
        if np.any(digests != digest):
            everyone = collectives.allgather_object(names)
            shown = "; ".join(f"rank {r}: {n}" for r, n in enumerate(everyone))
            raise ValueError(
                "MetricAverageCallback: the ranks log different metrics, "
                f"so they cannot be averaged ({shown}). Add the callback "
                "before any callback that logs on some ranks only."
            )
        if not names:
            return logs
        values = tf.constant([float(np.asarray(logs[k])) for k in names], tf.float64)
        mean = collectives.allreduce(values, op=collectives.Average).numpy()
    for name, value in zip(names, mean):
        logs[name] = float(value)
    return logs


class MetricAverageCallback(keras.callbacks.Callback):
    """Averages the epoch's metrics over the ranks at the end of every epoch.

    The logs are changed in place, so every callback after this one
    (``ReduceLROnPlateau``, ``TensorBoard``, ``History``, the progress bar)
    sees the means; put it before them in the list, as in Horovod.

    Args:
        device: Device to run the all-reduce on ("" for the default).
    """

    def __init__(self, device: str = "") -> None:
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is not None:
            average_logs(logs, self.device)


def _unwrap(optimizer: Any) -> Any:
    """The optimizer that holds the rate (inside a LossScaleOptimizer)."""
    while getattr(optimizer, "inner_optimizer", None) is not None:
        optimizer = optimizer.inner_optimizer
    return optimizer


def _rate_variable(model: Any, source: str) -> Any:
    """The optimizer's learning-rate variable, or a ConfigError."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        raise ConfigError("model.optimizer", None, "a compiled model", source=source)
    rate = getattr(_unwrap(optimizer), "_learning_rate", None)
    if not isinstance(rate, keras.Variable):
        raise ConfigError(
            "optimizer.learning_rate",
            rate,
            "a float rate that can be set per batch",
            source=source,
            hint="Build the optimizer with a float learning_rate; a "
            "LearningRateSchedule or callable cannot be assigned (put the schedule "
            "into it instead of using this callback)",
        )
    return rate


def _velocity_slots(optimizer: Any) -> list | None:
    """The buffers that carry ``lr * gradient`` in SGD and RMSprop with momentum.

    None when the optimizer has no momentum buffer (nothing to correct).
    """
    optimizer = _unwrap(optimizer)
    if not getattr(optimizer, "momentum", 0) or not optimizer.built:
        return None
    if isinstance(optimizer, keras.optimizers.SGD):
        return list(optimizer.momentums)
    if isinstance(optimizer, keras.optimizers.RMSprop):
        return list(keras_private.rmsprop_momentums(optimizer))
    _warn_once(
        f"tfdist.horovod: no momentum correction for {type(optimizer).__name__} "
        "(only SGD's and RMSprop's momentum buffers are known)"
    )
    return None


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets the rate to ``initial_lr * multiplier(epoch)`` in ``[start_epoch, end_epoch)``.

    With ``staircase=True`` the rate is set before the first batch of each
    epoch, with an integer epoch. With ``staircase=False`` it is set before
    every batch, with ``epoch + batch / steps_per_epoch``.

    Args:
        initial_lr: The rate the multiplier scales (usually the optimizer's
            rate, already scaled by ``size()``).
        multiplier: A number ``m`` (then ``m ** (epoch - start_epoch)``) or a
            function of the (possibly fractional) epoch.
        start_epoch: First epoch adjusted.
        end_epoch: First epoch no longer adjusted (None: no end).
        staircase: Per epoch (True) or per batch (False).
        momentum_correction: When the rate changes, scale the momentum
            buffers by ``new_lr / old_lr`` (SGD and RMSprop with momentum).
        steps_per_epoch: Batches per epoch; None reads ``fit``'s
            ``params['steps']``. Needed only with ``staircase=False``.

    Raises:
        ConfigError: Bad arguments; when ``fit`` starts, an optimizer whose
            rate cannot be set, or no way to know the steps per epoch.
    """

    _source = "LearningRateScheduleCallback"

    def __init__(
        self,
        initial_lr: float,
        multiplier: float | Callable[[float], float],
        start_epoch: int = 0,
        end_epoch: int | None = None,
        staircase: bool = True,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
    ) -> None:
        super().__init__()
        self.initial_lr = _number("initial_lr", initial_lr, self._source)
        self.start_epoch = _number("start_epoch", start_epoch, self._source)
        self.end_epoch = (
            None if end_epoch is None else _number("end_epoch", end_epoch, self._source)
        )
        self.staircase = bool(staircase)
        self.momentum_correction = bool(momentum_correction)
        self.steps_per_epoch = (
            None
            if steps_per_epoch is None
            else int(_number("steps_per_epoch", steps_per_epoch, self._source, positive=True))
        )
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            factor = _number("multiplier", multiplier, self._source)
            self.multiplier = lambda epoch: factor ** (epoch - self.start_epoch)
        self.current_epoch = 0

    def on_train_begin(self, logs: dict | None = None) -> None:
        _rate_variable(self.model, self._source)  # Fail now, not mid-epoch.
        if not self.staircase and not self.steps_per_epoch:
            steps = (self.params or {}).get("steps")
            if not steps:
                raise ConfigError(
                    "steps_per_epoch",
                    steps,
                    "an integer >= 1 (fit does not know the number of batches per epoch)",
                    source=self._source,
                    hint=f"Pass steps_per_epoch= to {type(self).__name__}, or to fit",
                )
            self.steps_per_epoch = int(steps)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.current_epoch = epoch

    def on_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        epoch = self.current_epoch
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._set_rate(epoch)
        else:
            self._set_rate(epoch + batch / self.steps_per_epoch)

    def _set_rate(self, epoch: float) -> None:
        rate = _rate_variable(self.model, self._source)
        old = float(keras.ops.convert_to_numpy(rate))
        new = self.initial_lr * float(self.multiplier(epoch))
        rate.assign(new)
        if self.momentum_correction and old > 0 and new != old:
            for slot in _velocity_slots(self.model.optimizer) or ():
                slot.assign(slot * (new / old))

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is not None:
            logs["lr"] = float(keras.ops.convert_to_numpy(_rate_variable(self.model, self._source)))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Gradual warm-up from ``initial_lr / size()`` to ``initial_lr`` (Goyal et al. 2017).

    Before each batch of the first ``warmup_epochs`` epochs the rate is::

        e = epoch + (batch + 1) / steps_per_epoch
        lr = initial_lr / size() * (e * (size() - 1) / warmup_epochs + 1)

    so it reaches ``initial_lr`` on the last batch of the warm-up (Horovod's
    formula, with its one-batch shift). Afterwards the rate is left alone.

    Args:
        initial_lr: The rate at the end of the warm-up (the scaled rate).
        warmup_epochs: Epochs the ramp lasts.
        momentum_correction: See :class:`LearningRateScheduleCallback`.
        steps_per_epoch: Batches per epoch; None reads ``fit``'s.
        verbose: 1 prints a line on rank 0 when the warm-up ends.
    """

    _source = "LearningRateWarmupCallback"

    def __init__(
        self,
        initial_lr: float,
        warmup_epochs: float = 5,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
        verbose: int = 0,
    ) -> None:
        self.warmup_epochs = _number("warmup_epochs", warmup_epochs, self._source, positive=True)

        def multiplier(epoch: float) -> float:
            size = runtime.size()
            epoch += 1.0 / self.steps_per_epoch
            return 1.0 / size * (epoch * (size - 1) / self.warmup_epochs + 1)

        super().__init__(
            initial_lr,
            multiplier,
            start_epoch=0,
            end_epoch=warmup_epochs,
            staircase=False,
            momentum_correction=momentum_correction,
            steps_per_epoch=steps_per_epoch,
        )
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        super().on_epoch_end(epoch, logs)
        if self.verbose and epoch == self.end_epoch - 1 and runtime.rank() == 0:
            rate = float(keras.ops.convert_to_numpy(_rate_variable(self.model, self._source)))
            print(
                f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {rate:g}.",
                flush=True,
            )


def _warn_once(message: str, _seen: set = set()) -> None:  # noqa: B006 (a memo on purpose)
    if message not in _seen:
        _seen.add(message)
        warnings.warn(message, stacklevel=3)
