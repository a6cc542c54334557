"""``tfdist.fit``: ``model.fit`` that also works under ParameterServerStrategy.

Keras 3's ``model.fit`` does not support ParameterServerStrategy
(keras-team/keras#18624): it fails with "To use this dataset, you need to
pass this dataset to ClusterCoordinator.create_per_worker_dataset" whatever
the data. ``tfdist.fit(model, ...)`` takes ``model.fit``'s arguments and

* under any other strategy calls ``model.fit`` unchanged, so one script
  serves every strategy;
* under a ParameterServerStrategy runs the training on the coordinator (the
  chief): per-worker datasets made with
  ``ClusterCoordinator.create_per_worker_dataset``, steps scheduled
  asynchronously on the workers, Keras callbacks (History, the progress bar,
  ModelCheckpoint, EarlyStopping, TensorBoard, BackupAndRestore) called on
  the coordinator, and validation run inline on the coordinator.

Semantics under ParameterServerStrategy, as in TensorFlow's own
parameter-server training:

* Steps are asynchronous: each worker reads the current variables from the
  ps, computes a gradient on its own batch and applies it. Increments
  (``optimizer.iterations``, metric totals) are atomic on the ps, so
  ``optimizer.iterations`` counts every step run.
* ``batch_size`` is the batch of one step on one worker.
* An epoch is ``steps_per_epoch`` steps over all workers together. Arrays
  are sharded over the workers; a ``tf.data.Dataset`` is copied to each
  worker (each worker reads its own copy, repeated); a dataset function
  ``fn(input_context)`` may shard it itself.
* Batch-level callbacks are called as steps finish (in the order they were
  scheduled), with the running metrics of the epoch; epoch-level logs are
  read from the ps after every scheduled step has finished.
* A worker that dies is left out until it comes back (its steps are run by
  the others); a step it was running may run again (at-least-once). A ps
  that dies ends training with :class:`ParameterServerError`; restart the
  cluster and resume from a backup (``tfdist.BackupAndRestore``).
* **Preemption.** With ``tfdist.BackupAndRestore`` (or Keras's under a tfdist
  strategy), SIGTERM to the coordinator stops the scheduling of new steps;
  the steps in flight finish (``coordinator.join()``), the backup is taken at
  that step boundary (so ``optimizer.iterations`` equals the steps it
  records), and the process exits with code 143. The next run resumes at
  that step, mid-epoch. SIGTERM to a ps server (:func:`tfdist.strategies.serve`)
  is passed on to the coordinator through ``$TFDIST_JOB_DIR`` (a notice file)
  and handled the same way while the ps still serves its variables. A
  worker server serves on until the coordinator saved or its grace period
  ends, then leaves (exit 143); the job goes on without it
  (:mod:`tfdist.training.ps_preemption`).
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import re
import socket
import time
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

from tfdist.training import ps_patches as keras_ps
from tfdist.errors import ConfigError, TfdistError, require_int
from tfdist.training.preemption import Preempted

__all__ = ["fit", "evaluate", "predict", "ParameterServerError", "StepTimeoutError"]

_PS = tf.distribute.experimental.ParameterServerStrategy
_SOURCE = "tfdist.fit"
#: Closures kept in flight per worker: enough to keep every worker busy.
_IN_FLIGHT_PER_WORKER = 4


class ParameterServerError(TfdistError, RuntimeError):
    """A parameter server (or the cluster) failed during training."""


class StepTimeoutError(TfdistError, RuntimeError):
    """No training step finished within ``step_timeout`` seconds."""


# --------------------------------------------------------------------------
# Dispatch.


def _strategy_of(model: Any) -> tf.distribute.Strategy:
    return getattr(model, "_distribute_strategy", None) or tf.distribute.get_strategy()


def fit(model: keras.Model, x: Any = None, y: Any = None, batch_size: int | None = None,
        epochs: int = 1, verbose: Any = "auto", callbacks: list | None = None,
        validation_split: float = 0.0, validation_data: Any = None,
        shuffle: bool = True, class_weight: dict | None = None,
        sample_weight: Any = None, initial_epoch: int = 0,
        steps_per_epoch: int | None = None, validation_steps: int | None = None,
        validation_batch_size: int | None = None, validation_freq: int = 1, *,
        step_timeout: float | None = 600.0) -> keras.callbacks.History:
    """Trains ``model`` like ``model.fit``, under any tfdist strategy.

    Takes ``model.fit``'s arguments, with the model first. Under a strategy
    other than ParameterServerStrategy this is ``model.fit(...)``.

    Under ParameterServerStrategy (the model created and compiled in its
    scope, this process the chief):

    Args:
        model: A compiled Keras model.
        x: A ``tf.data.Dataset`` (copied to each worker and repeated), a
            function ``fn(input_context) -> tf.data.Dataset`` (run on each
            worker), or arrays (sharded over the workers, with ``y``).
        y: Targets when ``x`` is arrays.
        batch_size: Batch of one step on one worker, for arrays (default 32).
        epochs: Epochs to train.
        verbose: As in ``model.fit``.
        callbacks: Keras callbacks, called on the coordinator.
        validation_split: For arrays: the fraction held out for validation.
        validation_data: A dataset, ``(x, y)`` arrays, or a dataset
            function, evaluated on the coordinator at the end of an epoch.
        shuffle: Shuffle arrays (each worker its shard, seeded per worker).
        class_weight: Not supported here; weight samples in the data.
        sample_weight: Per-sample weights, for arrays.
        initial_epoch: Epoch to start at (a backup may move it on).
        steps_per_epoch: Steps per epoch over all workers. Required for a
            dataset function or a dataset of unknown or infinite length;
            default for arrays: ``ceil(len(x) / batch_size)``.
        validation_steps: Batches of validation data (default: all).
        validation_batch_size: Batch size for validation arrays.
        validation_freq: Validate every this many epochs.
        step_timeout: Seconds to wait for a step to finish before giving up
            (all workers gone); None waits forever.

    Returns:
        The ``History`` callback, as ``model.fit`` does.

    Raises:
        ConfigError: An argument that cannot work here; the message names it.
        ParameterServerError: A ps died or the cluster failed.
        StepTimeoutError: No step finished within ``step_timeout``.
    """
    strategy = _strategy_of(model)
    if not isinstance(strategy, _PS):
        return model.fit(
            x, y, batch_size=batch_size, epochs=epochs, verbose=verbose,
            callbacks=callbacks, validation_split=validation_split,
            validation_data=validation_data, shuffle=shuffle,
            class_weight=class_weight, sample_weight=sample_weight,
            initial_epoch=initial_epoch, steps_per_epoch=steps_per_epoch,
            validation_steps=validation_steps,
            validation_batch_size=validation_batch_size,
            validation_freq=validation_freq)
    return _ParameterServerFit(model, strategy, step_timeout).run(
        x, y, batch_size=batch_size, epochs=epochs, verbose=verbose,
        callbacks=callbacks, validation_split=validation_split,
        validation_data=validation_data, shuffle=shuffle, class_weight=class_weight,
        sample_weight=sample_weight, initial_epoch=initial_epoch,
        steps_per_epoch=steps_per_epoch, validation_steps=validation_steps,
        validation_batch_size=validation_batch_size, validation_freq=validation_freq)


def evaluate(model: keras.Model, x: Any = None, y: Any = None,
             batch_size: int | None = None, verbose: Any = "auto",
             sample_weight: Any = None, steps: int | None = None,
             callbacks: list | None = None, return_dict: bool = False) -> Any:
    """``model.evaluate`` that also works under ParameterServerStrategy.

    Under ParameterServerStrategy the evaluation runs inline on the
    coordinator: it reads the variables from the ps and goes through the
    data exactly once (``steps`` batches, or all). Elsewhere it is
    ``model.evaluate``.
    """
    strategy = _strategy_of(model)
    if not isinstance(strategy, _PS):
        return model.evaluate(x, y, batch_size=batch_size, verbose=verbose,
                              sample_weight=sample_weight, steps=steps,
                              callbacks=callbacks, return_dict=return_dict)
    _check_model(model, strategy)
    data = _local_dataset(x, y, sample_weight, batch_size, "x")
    _build(model, strategy, data)
    callback_list = keras.callbacks.CallbackList(
        callbacks, add_progbar=verbose != 0, verbose=_verbose(verbose), epochs=1,
        steps=steps, model=model)
    logs = _evaluate(model, data, steps, callback_list)
    if return_dict:
        return logs
    return [logs[name] for name in model.metrics_names if name in logs] or \
        list(logs.values())


def predict(model: keras.Model, x: Any, batch_size: int | None = None,
            verbose: Any = "auto", steps: int | None = None,
            callbacks: list | None = None) -> Any:
    """``model.predict`` that also works under ParameterServerStrategy.

    Under ParameterServerStrategy the predictions are computed inline on the
    coordinator, with the variables read from the ps, over every batch of
    ``x`` once (``steps`` batches, or all). Elsewhere it is ``model.predict``.
    """
    strategy = _strategy_of(model)
    if not isinstance(strategy, _PS):
        return model.predict(x, batch_size=batch_size, verbose=verbose, steps=steps,
                             callbacks=callbacks)
    _check_positive_int("steps", steps)
    data = _local_dataset(x, None, None, batch_size, "x")
    step = getattr(model, "_tfdist_predict_step", None)
    if step is None:
        step = tf.function(model.predict_step, reduce_retracing=True)
        model._tfdist_predict_step = step
    callback_list = keras.callbacks.CallbackList(
        callbacks, add_progbar=verbose != 0, verbose=_verbose(verbose), epochs=1,
        steps=steps, model=model)
    callback_list.on_predict_begin()
    outputs = []
    for index, batch in enumerate(data.take(steps) if steps else data):
        callback_list.on_predict_batch_begin(index)
        outputs.append(tf.nest.map_structure(np.asarray, step(batch)))
        callback_list.on_predict_batch_end(index, {"outputs": outputs[-1]})
    callback_list.on_predict_end()
    if not outputs:
        raise ConfigError("x", "no batch", "data with at least one batch", source=_SOURCE)
    return tf.nest.map_structure(lambda *parts: np.concatenate(parts), *outputs)


# --------------------------------------------------------------------------
# Checks and data.


def _verbose(verbose: Any) -> int:
    return 1 if verbose == "auto" else verbose


def _check_model(model: Any, strategy: Any) -> None:
    if not getattr(model, "compiled", False) or getattr(model, "optimizer", None) is None:
        raise ConfigError("model", type(model).__name__,
                          "a model compiled with an optimizer, inside strategy.scope()",
                          source=_SOURCE)
    if getattr(model, "_distribute_strategy", None) is not strategy:
        raise ConfigError(
            "model", getattr(model, "name", type(model).__name__),
            "a model created and compiled inside strategy.scope() of the "
            "ParameterServerStrategy", source=_SOURCE,
            hint="Under ParameterServerStrategy the variables live on the ps; "
            "build the model with `with strategy.scope(): model = ...; "
            "model.compile(...)`.")


def _is_dataset_fn(x: Any) -> bool:
    return callable(x) and not isinstance(x, (tf.data.Dataset, np.ndarray, tf.Tensor))


def _check_positive_int(field: str, value: Any, *, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(field, value, "an integer >= 1" + (" or None" if allow_none else ""),
                          source=_SOURCE)


def _as_tuple(x: Any, y: Any, sample_weight: Any) -> tuple:
    parts = (x,) if y is None else (x, y) if sample_weight is None else (x, y, sample_weight)
    return parts


def _num_rows(x: Any) -> int:
    first = tf.nest.flatten(x)[0]
    return int(first.shape[0])


def _local_dataset(x: Any, y: Any, sample_weight: Any, batch_size: int | None,
                   field: str) -> tf.data.Dataset:
    """A dataset the coordinator itself reads (validation, building)."""
    if isinstance(x, tf.data.Dataset):
        return x
    if _is_dataset_fn(x):
        return x(tf.distribute.InputContext())
    if isinstance(x, tuple) and y is None and len(x) in (2, 3):
        x, y, *rest = x
        sample_weight = rest[0] if rest else sample_weight
    if x is None:
        raise ConfigError(field, None, "a tf.data.Dataset, a dataset function or "
                          "arrays", source=_SOURCE)
    data = tf.data.Dataset.from_tensor_slices(_as_tuple(x, y, sample_weight))
    return data.batch(batch_size or 32)


class _TrainData:
    """Training data as the coordinator needs it: a per-worker dataset."""

    def __init__(self, x: Any, y: Any, sample_weight: Any, batch_size: int | None,
                 shuffle: bool, steps_per_epoch: int | None) -> None:
        #: A dataset to copy to each worker, or None when ``make`` builds
        #: each worker's from its input context.
        self.dataset: tf.data.Dataset | None = None
        self.make: Callable | None = None
        if isinstance(x, tf.data.Dataset):
            if y is not None:
                raise ConfigError("y", type(y).__name__, "None when x is a dataset "
                                  "(the dataset yields (x, y))", source=_SOURCE)
            cardinality = int(x.cardinality())
            if steps_per_epoch is None:
                if cardinality < 0:
                    raise ConfigError(
                        "steps_per_epoch", None, "a number of steps: this dataset's "
                        "length is unknown or infinite", source=_SOURCE,
                        hint="Under ParameterServerStrategy an epoch is "
                        "steps_per_epoch steps over all workers.")
                steps_per_epoch = cardinality
            # Serialized by the coordinator and rebuilt on each worker.
            self.dataset = x if cardinality == tf.data.INFINITE_CARDINALITY else x.repeat()
            self.sample = next(iter(x.take(1)))
        elif _is_dataset_fn(x):
            if steps_per_epoch is None:
                raise ConfigError("steps_per_epoch", None, "a number of steps when x "
                                  "is a dataset function", source=_SOURCE)
            fn = x

            def make(context):
                dataset = fn(context)
                if not isinstance(dataset, tf.data.Dataset):
                    raise ConfigError("x", f"a function returning {type(dataset).__name__}",
                                      "a function returning a tf.data.Dataset",
                                      source=_SOURCE)
                # (Traced: the length may only be known when it runs.)
                if tf.get_static_value(dataset.cardinality()) != tf.data.INFINITE_CARDINALITY:
                    dataset = dataset.repeat()
                return dataset
            self.sample = next(iter(make(tf.distribute.InputContext()).take(1)))
            self.make = make
        else:
            if x is None:
                raise ConfigError("x", None, "a tf.data.Dataset, a dataset function "
                                  "or arrays", source=_SOURCE)
            batch = batch_size or 32
            _check_positive_int("batch_size", batch)
            tensors = _as_tuple(x, y, sample_weight)
            rows = _num_rows(x)
            if steps_per_epoch is None:
                steps_per_epoch = max(1, math.ceil(rows / batch))

            def make(context):
                data = tf.data.Dataset.from_tensor_slices(tensors)
                data = data.shard(context.num_input_pipelines, context.input_pipeline_id)
                if shuffle:
                    data = data.shuffle(max(1, rows // context.num_input_pipelines),
                                        seed=context.input_pipeline_id,
                                        reshuffle_each_iteration=True)
                return data.repeat().batch(batch).prefetch(2)
            self.sample = tf.nest.map_structure(lambda t: t[:batch], tensors)
            self.make = make
        _check_positive_int("steps_per_epoch", steps_per_epoch, allow_none=False)
        self.steps_per_epoch = int(steps_per_epoch)


def _build(model: Any, strategy: Any, data: Any) -> None:
    """Creates every variable (model, optimizer, metrics) on the ps, now.

    Scheduled functions cannot create variables, so Keras's lazy building
    has to happen here, on the coordinator, from one batch.
    """
    if isinstance(data, tf.data.Dataset):
        data = next(iter(data.take(1)))
    with strategy.scope():
        model._symbolic_build(data_batch=data)


# --------------------------------------------------------------------------
# The steps.


def _keras_train_step(model: Any, data: Any) -> dict:
    """Keras 3's TF ``train_step``, with gradients that work on sharded
    variables (see :func:`tfdist.training.ps_patches.gradients`)."""
    from keras.src import tree
    from keras.src.losses import loss as loss_module
    from keras.src.trainers import data_adapters

    x, y, sample_weight = data_adapters.data_adapter_utils.unpack_x_y_sample_weight(data)
    with tf.GradientTape() as tape:
        if model._call_has_training_arg:
            y_pred = model(x, training=True)
        else:
            y_pred = model(x)
        loss = model._compute_loss(x=x, y=y, y_pred=y_pred,
                                   sample_weight=sample_weight, training=True)
        model._loss_tracker.update_state(
            loss_module.unscale_loss_for_distribution(loss),
            sample_weight=tf.shape(next(i for i in tree.flatten(x) if i is not None))[0])
        if model.optimizer is not None:
            loss = model.optimizer.scale_loss(loss)
    if model.trainable_weights:
        weights = model.trainable_weights
        grads = keras_ps.gradients(tape, loss, weights)
        model.optimizer.apply_gradients(zip(grads, weights))
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def _step_fn(model: Any) -> Callable:
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
    own = type(model).train_step
    if own is TensorFlowTrainer.train_step:
        return lambda data: _keras_train_step(model, data)
    return model.train_step  # The user's own train_step.


def _wait(remote: Any, timeout: float | None, what: str) -> Any:
    """``remote.fetch()`` with a time limit."""
    event = getattr(remote, "_status_available_event", None)
    if timeout is not None and event is not None and not event.wait(timeout):
        raise StepTimeoutError(
            f"{what} did not finish within step_timeout={timeout:g}s: no worker "
            "ran it. Are all workers down? Restart them (they rejoin), or raise "
            "step_timeout.")
    return remote.fetch()


def _numpy_logs(logs: Any) -> dict:
    if not isinstance(logs, dict):
        return {}
    return {k: float(np.asarray(v)) if np.ndim(v) == 0 else np.asarray(v)
            for k, v in logs.items()}


def _cluster_spec(strategy: Any) -> dict:
    from tfdist.training.callbacks.workers import _cluster
    return _cluster(strategy)[0]


def _answers(address: str, timeout: float = 1.0) -> bool:
    """Whether something accepts a TCP connection at ``host:port``."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def _ps_failure(error: Exception, strategy: Any) -> ParameterServerError:
    ps = [str(a) for a in _cluster_spec(strategy).get("ps", [])]
    text = str(error)
    lost = [f"ps:{i} ({addr})" for i, addr in enumerate(ps)
            if f":{addr.rsplit(':', 1)[-1]}" in text or not _answers(addr)]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    detail = next((line for line in lines if re.search(
        r"connect|refused|socket closed|unavailable|reset", line, re.I)),
        lines[0] if lines else type(error).__name__)
    who = (", ".join(lost) + " is unreachable") if lost else \
        f"a parameter server is unreachable (ps: {', '.join(ps)})"
    return ParameterServerError(
        f"training stopped: {who}. {type(error).__name__}: {detail[:300]}. "
        "A ps holds its share of the variables, and they are gone with it: "
        "restart the cluster and resume from the last backup "
        "(tfdist.BackupAndRestore keeps only complete ones).")


def _evaluate(model: Any, data: tf.data.Dataset, steps: int | None,
              callbacks: Any) -> dict:
    """Evaluates on the coordinator: every batch once, variables read from the ps."""
    _check_positive_int("validation_steps", steps)
    test_step = getattr(model, "_tfdist_test_step", None)
    if test_step is None:
        test_step = tf.function(model.test_step, reduce_retracing=True)
        model._tfdist_test_step = test_step
    model.reset_metrics()
    callbacks.on_test_begin()
    logs: dict = {}
    data = data.take(steps) if steps else data
    for step, batch in enumerate(data):
        callbacks.on_test_batch_begin(step)
        logs = _numpy_logs(test_step(batch))
        callbacks.on_test_batch_end(step, logs)
    logs = _numpy_logs(model._get_metrics_result_or_logs(logs))
    callbacks.on_test_end(logs)
    return logs


class _ParameterServerFit:
    """One ``fit`` call under ParameterServerStrategy, run on the coordinator."""

    def __init__(self, model: Any, strategy: Any, step_timeout: float | None) -> None:
        if step_timeout is not None and (isinstance(step_timeout, bool) or not
                                         isinstance(step_timeout, (int, float))
                                         or step_timeout <= 0):
            raise ConfigError("step_timeout", step_timeout, "seconds > 0 or None",
                              source=_SOURCE)
        _check_model(model, strategy)
        keras_ps.install()
        self.model, self.strategy, self.step_timeout = model, strategy, step_timeout
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        self.num_workers = len(_cluster_spec(strategy).get("worker", ()))
        self._functions: dict[int, Callable] = {}

    def _train_function(self, steps: int) -> Callable:
        """A tf.function running ``steps`` steps on one worker."""
        if steps not in self._functions:
            step_fn = _step_fn(self.model)
            strategy = self.strategy

            @tf.function
            def train(iterator):
                logs = strategy.run(step_fn, args=(next(iterator),))
                for _ in tf.range(steps - 1):
                    logs = strategy.run(step_fn, args=(next(iterator),))
                return logs
            self._functions[steps] = train
        return self._functions[steps]

    def run(self, x, y, *, batch_size, epochs, verbose, callbacks, validation_split,
            validation_data, shuffle, class_weight, sample_weight, initial_epoch,
            steps_per_epoch, validation_steps, validation_batch_size,
            validation_freq) -> keras.callbacks.History:
        model = self.model
        if class_weight is not None:
            raise ConfigError("class_weight", class_weight, "None under "
                              "ParameterServerStrategy", source=_SOURCE,
                              hint="Put per-sample weights in the data instead.")
        require_int("epochs", epochs, minimum=0, source=_SOURCE)
        _check_positive_int("validation_freq", validation_freq, allow_none=False)
        _check_positive_int("steps_per_epoch", steps_per_epoch)
        if validation_split:
            if isinstance(x, tf.data.Dataset) or _is_dataset_fn(x):
                raise ConfigError("validation_split", validation_split,
                                  "0 unless x is arrays; pass validation_data",
                                  source=_SOURCE)
            from keras.src.trainers.data_adapters import array_slicing
            (x, y, sample_weight), validation_data = array_slicing.train_validation_split(
                (x, y, sample_weight), validation_split=validation_split)
        data = _TrainData(x, y, sample_weight, batch_size, shuffle, steps_per_epoch)
        steps = data.steps_per_epoch
        val_data = None
        if validation_data is not None:
            val_data = _local_dataset(validation_data, None, None,
                                      validation_batch_size or batch_size, "validation_data")
        _build(model, self.strategy, data.sample)

        strategy, make = self.strategy, data.make
        if data.dataset is not None:
            per_worker = self.coordinator.create_per_worker_dataset(
                strategy.experimental_distribute_dataset(data.dataset))
        else:
            per_worker = self.coordinator.create_per_worker_dataset(
                lambda: strategy.distribute_datasets_from_function(make))
        iterator = iter(per_worker)
        per_call = max(1, int(getattr(model, "steps_per_execution", 1) or 1))
        window = _IN_FLIGHT_PER_WORKER * max(1, self.num_workers)

        if not isinstance(callbacks, keras.callbacks.CallbackList):
            callbacks = keras.callbacks.CallbackList(
                callbacks, add_history=True, add_progbar=verbose != 0,
                verbose=_verbose(verbose), epochs=epochs, steps=steps, model=model)
        model.stop_training = False
        callbacks.on_train_begin()
        start_step = _resume_step(model)
        first_epoch = model._initial_epoch or initial_epoch
        training_logs = None
        try:
            with _training_marker(_watchers(callbacks)):
                for epoch in range(first_epoch, epochs):
                    model.reset_metrics()
                    callbacks.on_epoch_begin(epoch)
                    logs = self._run_epoch(iterator, callbacks, start_step, steps,
                                           per_call, window)
                    start_step = 0
                    epoch_logs = _numpy_logs(model._get_metrics_result_or_logs(logs))
                    if val_data is not None and model._should_eval(epoch, validation_freq):
                        val_logs = _evaluate(model, val_data, validation_steps, callbacks)
                        epoch_logs.update({f"val_{k}": v for k, v in val_logs.items()})
                    callbacks.on_epoch_end(epoch, epoch_logs)
                    training_logs = epoch_logs
                    if model.stop_training:
                        break
        except (tf.errors.UnavailableError, tf.errors.AbortedError,
                tf.errors.CancelledError) as error:
            raise _ps_failure(error, self.strategy) from error
        except Preempted:
            # Saved; the servers leave once they see the status record. Detach
            # from them first, or this process's exit tries to reach them for
            # each function it ran ("Failed to connect ... refused").
            from tfdist.strategies.coordinator import disconnect_coordinator
            disconnect_coordinator(_cluster_spec(self.strategy))
            raise
        callbacks.on_train_end(logs=training_logs)
        return model.history

    def _run_epoch(self, iterator, callbacks, first_step: int, steps: int,
                   per_call: int, window: int) -> dict:
        model = self.model
        pending: collections.deque = collections.deque()
        step, logs = first_step, {}
        watchers = _watchers(callbacks)
        notices = _PsNotices(watchers)
        while step < steps or pending:
            notices.poll()
            stopping = any(w.requested for w in watchers)
            if stopping and pending:
                # Preempted: no new step. The steps in flight finish, and the
                # callbacks see one batch end, of the last step scheduled:
                # the step boundary where a backup holds every update it
                # counts (as with steps_per_execution, the batch number jumps).
                self.coordinator.join()
                end_step, remote = pending[-1]
                pending.clear()
                logs = self._logs(remote, end_step, logs)
                callbacks.on_train_batch_end(end_step, logs)  # BackupAndRestore exits here.
                continue
            # When stopping with nothing in flight: one step, then its end.
            limit = 1 if stopping else window
            while step < steps and len(pending) < limit and not model.stop_training:
                count = min(per_call, steps - step)
                callbacks.on_train_batch_begin(step)
                remote = self.coordinator.schedule(self._train_function(count),
                                                   args=(iterator,))
                pending.append((step + count - 1, remote))
                step += count
            if not pending:
                break
            end_step, remote = pending.popleft()
            logs = self._logs(remote, end_step, logs)
            # With later steps in flight this is no step boundary: a backup
            # here would hold some of their updates and count none of them.
            with _no_stop(watchers) if pending else contextlib.nullcontext():
                callbacks.on_train_batch_end(end_step, logs)
        self.coordinator.join()  # Raises the error of a failed step, if any.
        return logs

    def _logs(self, remote: Any, end_step: int, previous: dict) -> dict:
        try:
            return _numpy_logs(_wait(remote, self.step_timeout, f"step {end_step}"))
        except tf.errors.UnavailableError:
            # The step ran, but its worker died before its logs were read
            # (they live on the worker). A failed ps or cluster is raised by
            # the next schedule() or by join().
            return previous


# --------------------------------------------------------------------------
# Preemption.


def _watchers(callbacks: Any) -> list:
    """The preemption watchers of the callbacks: ``tfdist.BackupAndRestore``'s,
    and Keras's BackupAndRestore's under a tfdist strategy
    (:mod:`tfdist.training.fit_preemption`). They exist from ``on_train_begin``."""
    found = []
    for callback in getattr(callbacks, "callbacks", callbacks or ()):
        watcher = (getattr(callback, "watcher", None)
                   or vars(callback).get("_tfdist_watcher"))
        if watcher is not None and hasattr(watcher, "should_stop"):
            found.append(watcher)
    return found


@contextlib.contextmanager
def _no_stop(watchers: list):
    """The watchers answer "go on" for the time of a batch end that is not a
    step boundary; a signal that comes meanwhile is acted on after it."""
    with contextlib.ExitStack() as stack:
        for watcher in watchers:
            stack.enter_context(watcher.held())
        yield


@contextlib.contextmanager
def _training_marker(watchers: list):
    """While this coordinator trains with a preemption watcher, a marker in
    the notice directory tells a signalled server to wait for the backup
    (:mod:`tfdist.training.ps_preemption`); without it, a server stops at once (the
    job is ending anyway)."""
    from tfdist.training.ps_preemption import TRAINING_MARKER, notice_dir
    directory = notice_dir() if watchers else None
    path = None
    if directory is not None:
        os.makedirs(directory, exist_ok=True)
        for name in os.listdir(directory):
            if name.endswith(".json"):  # A notice of an earlier run's ps.
                try:
                    os.remove(os.path.join(directory, name))
                except OSError:
                    pass
        path = os.path.join(directory, f"{TRAINING_MARKER}-{os.getpid()}")
        with open(path, "w") as f:
            f.write(str(time.time()))
    try:
        yield
    finally:
        if path is not None:
            try:
                os.remove(path)
            except OSError:
                pass


class _PsNotices:
    """Turns a ps server's preemption notice into a preemption of this
    coordinator: it must save while the ps still holds its variables."""

    INTERVAL = 0.2

    def __init__(self, watchers: list) -> None:
        from tfdist.training.ps_preemption import notice_dir
        self.watchers = watchers
        self.directory = notice_dir() if watchers else None
        self._next = 0.0

    def poll(self) -> None:
        if self.directory is None or time.monotonic() < self._next:
            return
        self._next = time.monotonic() + self.INTERVAL
        try:
            names = sorted(n for n in os.listdir(self.directory) if n.endswith(".json"))
        except OSError:
            return
        if names and not any(w.requested for w in self.watchers):
            try:
                with open(os.path.join(self.directory, names[0])) as f:
                    task = json.load(f).get("task", names[0])
            except (OSError, ValueError):
                task = names[0]
            from absl import logging
            logging.warning("tfdist.fit: %s was preempted; saving before its "
                            "variables are gone.", task)
            print(f"tfdist.fit: {task} was preempted: saving a backup at the next step "
                  "boundary before its variables are gone.", flush=True)
            for watcher in self.watchers:
                watcher.notify()


def _resume_step(model: Any) -> int:
    """Batches of the first epoch a tfdist backup already trained on.

    tfdist's BackupAndRestore hands them over as a wrapper around
    ``model.train_function`` that skips them; here the epoch simply starts
    at that step.
    """
    from tfdist.training.callbacks.backup import _SkipSteps, _unwrap_train_function
    fn = getattr(model, "train_function", None)
    skip = fn.remaining if isinstance(fn, _SkipSteps) else 0
    _unwrap_train_function(model)
    return int(skip)
