"""The training loop of :func:`tfdist.fit` under a parameter-server strategy: epochs of
steps in flight on every worker, Keras's callbacks, and the preemption notices
(the coordinator saves at one step, and the servers leave after it).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import time
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from tfdist.compat import keras_private
from tfdist.errors import ConfigError, require_int
from tfdist.record import slot
from tfdist.training.fault_tolerance.fit_preemption import FitProgress
from tfdist.training.fault_tolerance.preemption import Preempted
from tfdist.training.ps import patches as keras_ps
from tfdist.training.ps.data import (
    IN_FLIGHT_PER_WORKER,
    SOURCE,
    TrainData,
    build,
    check_model,
    check_positive_int,
    is_dataset_fn,
    local_dataset,
    verbosity,
)
from tfdist.training.ps.steps import (
    cluster_spec,
    evaluate_on_coordinator,
    numpy_logs,
    ps_failure,
    train_step_fn,
    wait,
)


class ParameterServerFit:
    """One ``fit`` call under ParameterServerStrategy, run on the coordinator."""

    def __init__(self, model: Any, strategy: Any, step_timeout: float | None) -> None:
        if step_timeout is not None and (
            isinstance(step_timeout, bool)
            or not isinstance(step_timeout, (int, float))
            or step_timeout <= 0
        ):
            raise ConfigError("step_timeout", step_timeout, "seconds > 0 or None", source=SOURCE)
        check_model(model, strategy)
        keras_ps.install()
        self.model, self.strategy, self.step_timeout = model, strategy, step_timeout
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        self.num_workers = len(cluster_spec(strategy).get("worker", ()))
        self._functions: dict[int, Callable] = {}

    def _train_function(self, steps: int) -> Callable:
        """A tf.function running ``steps`` steps on one worker."""
        if steps not in self._functions:
            step_fn = train_step_fn(self.model)
            strategy = self.strategy

            @tf.function
            def train(iterator):
                logs = strategy.run(step_fn, args=(next(iterator),))
                for _ in tf.range(steps - 1):
                    logs = strategy.run(step_fn, args=(next(iterator),))
                return logs

            self._functions[steps] = train
        return self._functions[steps]

    def run(
        self,
        x,
        y,
        *,
        batch_size,
        epochs,
        verbose,
        callbacks,
        validation_split,
        validation_data,
        shuffle,
        class_weight,
        sample_weight,
        initial_epoch,
        steps_per_epoch,
        validation_steps,
        validation_batch_size,
        validation_freq,
    ) -> keras.callbacks.History:
        model = self.model
        _check_fit(class_weight, epochs, validation_freq, steps_per_epoch)
        if validation_split:
            (x, y, sample_weight), validation_data = _split(x, y, sample_weight, validation_split)
        data = TrainData(x, y, sample_weight, batch_size, shuffle, steps_per_epoch)
        steps = data.steps_per_epoch
        val_data = None
        if validation_data is not None:
            val_data = local_dataset(
                validation_data, None, None, validation_batch_size or batch_size, "validation_data"
            )
        build(model, self.strategy, data.sample)

        iterator = self._per_worker_iterator(data)
        per_call = max(1, int(getattr(model, "steps_per_execution", 1) or 1))
        window = IN_FLIGHT_PER_WORKER * max(1, self.num_workers)

        callbacks = _callback_list(callbacks, verbose, epochs, steps, model)
        model.stop_training = False
        callbacks.on_train_begin()
        start_step = _resume_step(model)
        first_epoch = keras_private.initial_epoch(model) or initial_epoch
        training_logs = None
        try:
            with _training_marker(_watchers(callbacks)):
                for epoch in range(first_epoch, epochs):
                    model.reset_metrics()
                    callbacks.on_epoch_begin(epoch)
                    logs = self._run_epoch(iterator, callbacks, start_step, steps, per_call, window)
                    start_step = 0
                    epoch_logs = numpy_logs(keras_private.result_logs(model, logs))
                    if val_data is not None and keras_private.should_eval(
                        model, epoch, validation_freq
                    ):
                        val_logs = evaluate_on_coordinator(
                            model, val_data, validation_steps, callbacks
                        )
                        epoch_logs.update({f"val_{k}": v for k, v in val_logs.items()})
                    callbacks.on_epoch_end(epoch, epoch_logs)
                    training_logs = epoch_logs
                    if model.stop_training:
                        break
        except (
            tf.errors.UnavailableError,
            tf.errors.AbortedError,
            tf.errors.CancelledError,
        ) as error:
            raise ps_failure(error, self.strategy) from error
        except Preempted:
            # Saved; the servers leave once they see the status record. Detach
            # from them first, or this process's exit tries to reach them for
            # each function it ran ("Failed to connect ... refused").
            from tfdist.strategies.coordinator import disconnect_coordinator

            disconnect_coordinator(cluster_spec(self.strategy))
            raise
        callbacks.on_train_end(logs=training_logs)
        return model.history

    def _per_worker_iterator(self, data: TrainData) -> Any:
        """An iterator over each worker's copy of the training data."""
        strategy, make = self.strategy, data.make
        if data.dataset is not None:
            per_worker = self.coordinator.create_per_worker_dataset(
                strategy.experimental_distribute_dataset(data.dataset)
            )
        else:
            per_worker = self.coordinator.create_per_worker_dataset(
                lambda: strategy.distribute_datasets_from_function(make)
            )
        return iter(per_worker)

    def _run_epoch(
        self, iterator, callbacks, first_step: int, steps: int, per_call: int, window: int
    ) -> dict:
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
                remote = self.coordinator.schedule(self._train_function(count), args=(iterator,))
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
            return numpy_logs(wait(remote, self.step_timeout, f"step {end_step}"))
        except tf.errors.UnavailableError:
            # The step ran, but its worker died before its logs were read
            # (they live on the worker). A failed ps or cluster is raised by
            # the next schedule() or by join().
            return previous


def _callback_list(callbacks: Any, verbose: Any, epochs: int, steps: int, model: Any) -> Any:
    """``callbacks`` as Keras's fit wraps them (History, the progress bar)."""
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks
    return keras.callbacks.CallbackList(
        callbacks,
        add_history=True,
        add_progbar=verbose != 0,
        verbose=verbosity(verbose),
        epochs=epochs,
        steps=steps,
        model=model,
    )


def _check_fit(
    class_weight: object, epochs: object, validation_freq: object, steps_per_epoch: object
) -> None:
    if class_weight is not None:
        raise ConfigError(
            "class_weight",
            class_weight,
            "None under ParameterServerStrategy",
            source=SOURCE,
            hint="Put per-sample weights in the data instead.",
        )
    require_int("epochs", epochs, minimum=0, source=SOURCE)
    check_positive_int("validation_freq", validation_freq, allow_none=False)
    check_positive_int("steps_per_epoch", steps_per_epoch)


def _split(x: Any, y: Any, sample_weight: Any, validation_split: float) -> tuple:
    """``((x, y, sample_weight), validation_data)``, as Keras's fit splits arrays."""
    if isinstance(x, tf.data.Dataset) or is_dataset_fn(x):
        raise ConfigError(
            "validation_split",
            validation_split,
            "0 unless x is arrays; pass validation_data",
            source=SOURCE,
        )
    from tfdist.compat.keras_src import array_slicing

    return array_slicing.train_validation_split(
        (x, y, sample_weight), validation_split=validation_split
    )


# --------------------------------------------------------------------------
# Preemption.


def _watchers(callbacks: Any) -> list:
    """The preemption watchers of the callbacks: ``tfdist.BackupAndRestore``'s,
    and Keras's BackupAndRestore's under a tfdist strategy
    (:mod:`tfdist.training.fault_tolerance.fit_preemption`). They exist from ``on_train_begin``."""
    found = []
    for callback in getattr(callbacks, "callbacks", callbacks or ()):
        kept = slot(callback, FitProgress)
        watcher = getattr(callback, "watcher", None) or (kept.watcher if kept else None)
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
    (:mod:`tfdist.training.ps.preemption`); without it, a server stops at once (the
    job is ending anyway)."""
    from tfdist.training.ps.preemption import TRAINING_MARKER, notice_dir

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
        from tfdist.training.ps.preemption import notice_dir

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

            logging.warning(
                "tfdist.fit: %s was preempted; saving before its variables are gone.", task
            )
            print(
                f"tfdist.fit: {task} was preempted: saving a backup at the next step "
                "boundary before its variables are gone.",
                flush=True,
            )
            for watcher in self.watchers:
                watcher.notify()


def _resume_step(model: Any) -> int:
    """Batches of the first epoch a tfdist backup already trained on.

    tfdist's BackupAndRestore hands them over as a wrapper around
    ``model.train_function`` that skips them; here the epoch simply starts
    at that step.
    """
    from tfdist.training.callbacks.backup import SkipSteps, unwrap_train_function

    fn = getattr(model, "train_function", None)
    skip = fn.remaining if isinstance(fn, SkipSteps) else 0
    unwrap_train_function(model)
    return int(skip)
