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
  (:mod:`tfdist.training.ps.preemption`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfdist.errors import ConfigError
from tfdist.strategies import ParameterServerStrategy as TfdistPS
from tfdist.training.ps.data import (
    PS,
    SOURCE,
    ParameterServerError,
    StepTimeoutError,
    build,
    check_model,
    check_positive_int,
    local_dataset,
    verbosity,
)
from tfdist.training.ps.loop import ParameterServerFit
from tfdist.training.ps.patches import shards
from tfdist.training.ps.steps import evaluate_on_coordinator, traced_steps

__all__ = ["fit", "evaluate", "predict", "shards", "ParameterServerError", "StepTimeoutError"]


# --------------------------------------------------------------------------
# Dispatch.


def _strategy_of(model: Any) -> tf.distribute.Strategy:
    return getattr(model, "_distribute_strategy", None) or tf.distribute.get_strategy()


def fit(
    model: keras.Model,
    x: Any = None,
    y: Any = None,
    batch_size: int | None = None,
    epochs: int = 1,
    verbose: Any = "auto",
    callbacks: list | None = None,
    validation_split: float = 0.0,
    validation_data: Any = None,
    shuffle: bool = True,
    class_weight: dict | None = None,
    sample_weight: Any = None,
    initial_epoch: int = 0,
    steps_per_epoch: int | None = None,
    validation_steps: int | None = None,
    validation_batch_size: int | None = None,
    validation_freq: int = 1,
    *,
    step_timeout: float | None = 600.0,
) -> keras.callbacks.History:
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
    # Every argument of Keras's fit, as given: to Keras's own fit off a
    # parameter-server strategy, to the coordinator's loop on one.
    arguments = dict(
        x=x,
        y=y,
        batch_size=batch_size,
        epochs=epochs,
        verbose=verbose,
        callbacks=callbacks,
        validation_split=validation_split,
        validation_data=validation_data,
        shuffle=shuffle,
        class_weight=class_weight,
        sample_weight=sample_weight,
        initial_epoch=initial_epoch,
        steps_per_epoch=steps_per_epoch,
        validation_steps=validation_steps,
        validation_batch_size=validation_batch_size,
        validation_freq=validation_freq,
    )
    strategy = _strategy_of(model)
    if not isinstance(strategy, PS):
        return model.fit(**arguments)
    return ParameterServerFit(model, strategy, step_timeout).run(**arguments)


def evaluate(
    model: keras.Model,
    x: Any = None,
    y: Any = None,
    batch_size: int | None = None,
    verbose: Any = "auto",
    sample_weight: Any = None,
    steps: int | None = None,
    callbacks: list | None = None,
    return_dict: bool = False,
) -> Any:
    """``model.evaluate`` that also works under ParameterServerStrategy.

    Under ParameterServerStrategy the evaluation runs inline on the
    coordinator: it reads the variables from the ps and goes through the
    data exactly once (``steps`` batches, or all). Elsewhere it is
    ``model.evaluate``.
    """
    strategy = _strategy_of(model)
    if not isinstance(strategy, PS):
        return model.evaluate(
            x,
            y,
            batch_size=batch_size,
            verbose=verbose,
            sample_weight=sample_weight,
            steps=steps,
            callbacks=callbacks,
            return_dict=return_dict,
        )
    check_model(model, strategy)
    data = local_dataset(x, y, sample_weight, batch_size, "x")
    build(model, strategy, data)
    callback_list = keras.callbacks.CallbackList(
        callbacks,
        add_progbar=verbose != 0,
        verbose=verbosity(verbose),
        epochs=1,
        steps=steps,
        model=model,
    )
    logs = evaluate_on_coordinator(model, data, steps, callback_list)
    if return_dict:
        return logs
    return [logs[name] for name in model.metrics_names if name in logs] or list(logs.values())


def predict(
    model: keras.Model,
    x: Any,
    batch_size: int | None = None,
    verbose: Any = "auto",
    steps: int | None = None,
    callbacks: list | None = None,
) -> Any:
    """``model.predict`` that also works under ParameterServerStrategy.

    Under ParameterServerStrategy the predictions are computed inline on the
    coordinator, with the variables read from the ps, over every batch of
    ``x`` once (``steps`` batches, or all). Elsewhere it is ``model.predict``.
    """
    strategy = _strategy_of(model)
    if not isinstance(strategy, PS):
        return model.predict(
            x, batch_size=batch_size, verbose=verbose, steps=steps, callbacks=callbacks
        )
    check_positive_int("steps", steps)
    data = local_dataset(x, None, None, batch_size, "x")
    traced = traced_steps(model)
    if traced.predict is None:
        traced.predict = tf.function(model.predict_step, reduce_retracing=True)
    step = traced.predict
    callback_list = keras.callbacks.CallbackList(
        callbacks,
        add_progbar=verbose != 0,
        verbose=verbosity(verbose),
        epochs=1,
        steps=steps,
        model=model,
    )
    callback_list.on_predict_begin()
    outputs = []
    for index, batch in enumerate(data.take(steps) if steps else data):
        callback_list.on_predict_batch_begin(index)
        outputs.append(tf.nest.map_structure(np.asarray, step(batch)))
        callback_list.on_predict_batch_end(index, {"outputs": outputs[-1]})
    callback_list.on_predict_end()
    if not outputs:
        raise ConfigError("x", "no batch", "data with at least one batch", source=SOURCE)
    return tf.nest.map_structure(lambda *parts: np.concatenate(parts), *outputs)


# The wrappers of Keras's Model.fit/evaluate/predict (tfdist.compat.registry):
# tfdist's above, under tfdist's parameter-server strategy; Keras's otherwise.
def _route(keras_method: Any, tfdist_function: Callable) -> Any:
    @functools.wraps(keras_method)
    def method(self, *args, **kwargs):
        if not isinstance(getattr(self, "_distribute_strategy", None), TfdistPS):
            return keras_method(self, *args, **kwargs)
        return tfdist_function(self, *args, **kwargs)

    return method


def wrap_fit(original: Any) -> Any:
    return _route(original, fit)


def wrap_evaluate(original: Any) -> Any:
    return _route(original, evaluate)


def wrap_predict(original: Any) -> Any:
    return _route(original, predict)
