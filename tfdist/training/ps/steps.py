"""One step of parameter-server training, scheduled on a worker by the coordinator:
Keras's train step, waiting for its result with a timeout, and a failed ps
turned into a :class:`~tfdist.training.ps.data.ParameterServerError` naming it.
"""

from __future__ import annotations

import dataclasses
import re
import socket
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from tfdist.compat import keras_private
from tfdist.record import attach, slot
from tfdist.training.ps import patches as keras_ps
from tfdist.training.ps.data import ParameterServerError, StepTimeoutError, check_positive_int

# --------------------------------------------------------------------------
# The steps.


@dataclasses.dataclass
class TracedSteps:
    """A model's steps traced for the coordinator, kept between calls (a
    :mod:`tfdist.record` slot)."""

    test: Callable | None = None
    predict: Callable | None = None


def traced_steps(model: object) -> TracedSteps:
    """``model``'s traced coordinator steps (none yet on first use)."""
    found = slot(model, TracedSteps)
    return found if found is not None else attach(model, TracedSteps())


def _keras_train_step(model: Any, data: Any) -> dict:
    """Keras 3's TF ``train_step``, with gradients that work on sharded
    variables (see :func:`tfdist.training.ps.patches.gradients`)."""
    from tfdist.compat.keras_src import data_adapters, loss_module, tree

    x, y, sample_weight = data_adapters.data_adapter_utils.unpack_x_y_sample_weight(data)
    with tf.GradientTape() as tape:
        if keras_private.call_has_training_arg(model):
            y_pred = model(x, training=True)
        else:
            y_pred = model(x)
        loss = keras_private.compute_loss(
            model, x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
        )
        keras_private.loss_tracker(model).update_state(
            loss_module.unscale_loss_for_distribution(loss),
            sample_weight=tf.shape(next(i for i in tree.flatten(x) if i is not None))[0],
        )
        if model.optimizer is not None:
            loss = model.optimizer.scale_loss(loss)
    if model.trainable_weights:
        weights = model.trainable_weights
        grads = keras_ps.gradients(tape, loss, weights)
        model.optimizer.apply_gradients(zip(grads, weights))
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def train_step_fn(model: Any) -> Callable:
    """The train step the workers run: Keras's, or the model's own."""
    from tfdist.compat.keras_src import TensorFlowTrainer

    own = type(model).train_step
    if own is TensorFlowTrainer.train_step:
        return lambda data: _keras_train_step(model, data)
    return model.train_step  # The user's own train_step.


def wait(remote: Any, timeout: float | None, what: str) -> Any:
    """``remote.fetch()`` with a time limit."""
    event = getattr(remote, "_status_available_event", None)
    if timeout is not None and event is not None and not event.wait(timeout):
        raise StepTimeoutError(
            f"{what} did not finish within step_timeout={timeout:g}s: no worker "
            "ran it. Are all workers down? Restart them (they rejoin), or raise "
            "step_timeout."
        )
    return remote.fetch()


def numpy_logs(logs: Any) -> dict:
    """``logs`` with numpy values (floats for scalars)."""
    if not isinstance(logs, dict):
        return {}
    return {k: float(np.asarray(v)) if np.ndim(v) == 0 else np.asarray(v) for k, v in logs.items()}


def cluster_spec(strategy: Any) -> dict:
    """The cluster spec dict of ``strategy``."""
    from tfdist.training.callbacks.workers import cluster

    return cluster(strategy)[0]


def _answers(address: str, timeout: float = 1.0) -> bool:
    """Whether something accepts a TCP connection at ``host:port``."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def ps_failure(error: Exception, strategy: Any) -> ParameterServerError:
    """The ParameterServerError of ``error``, naming the unreachable ps."""
    ps = [str(a) for a in cluster_spec(strategy).get("ps", [])]
    text = str(error)
    lost = [
        f"ps:{i} ({addr})"
        for i, addr in enumerate(ps)
        if f":{addr.rsplit(':', 1)[-1]}" in text or not _answers(addr)
    ]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    detail = next(
        (
            line
            for line in lines
            if re.search(r"connect|refused|socket closed|unavailable|reset", line, re.I)
        ),
        lines[0] if lines else type(error).__name__,
    )
    who = (
        (", ".join(lost) + " is unreachable")
        if lost
        else f"a parameter server is unreachable (ps: {', '.join(ps)})"
    )
    return ParameterServerError(
        f"training stopped: {who}. {type(error).__name__}: {detail[:300]}. "
        "A ps holds its share of the variables, and they are gone with it: "
        "restart the cluster and resume from the last backup "
        "(tfdist.BackupAndRestore keeps only complete ones)."
    )


def evaluate_on_coordinator(
    model: Any, data: tf.data.Dataset, steps: int | None, callbacks: Any
) -> dict:
    """Evaluates on the coordinator: every batch once, variables read from the ps."""
    check_positive_int("validation_steps", steps)
    traced = traced_steps(model)
    if traced.test is None:
        traced.test = tf.function(model.test_step, reduce_retracing=True)
    test_step = traced.test
    model.reset_metrics()
    callbacks.on_test_begin()
    logs: dict = {}
    data = data.take(steps) if steps else data
    for step, batch in enumerate(data):
        callbacks.on_test_batch_begin(step)
        logs = numpy_logs(test_step(batch))
        callbacks.on_test_batch_end(step, logs)
    logs = numpy_logs(keras_private.result_logs(model, logs))
    callbacks.on_test_end(logs)
    return logs
