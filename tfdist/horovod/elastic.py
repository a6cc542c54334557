"""Horovod's elastic API (``hvd.elastic``) on tfdist's restart-and-resume.

The calls are Horovod's::

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    state.register_reset_callbacks([on_state_reset])

    @hvd.elastic.run
    def train(state):
        ...  # state.commit() every few batches, or the Keras callbacks:
             # UpdateEpochStateCallback, UpdateBatchStateCallback, CommitStateCallback

    train(state)

What they do here:

* ``state.commit()`` snapshots the state in memory on every rank (so
  ``state.restore()`` undoes what came after) and rank 0 writes it to disk
  atomically (:mod:`tfdist.horovod.commits`: temp file, fsync, rename; a
  reader never sees half a commit). It involves no collective: the other
  ranks' copies are the same as rank 0's, synchronous training saw to that.
* When a worker fails, ``tfdist launch --max-restarts N`` stops every task
  and restarts the whole job. Entering ``elastic.run`` then: rank 0 reads the
  last commit and loads it; if there was one, every rank calls the reset
  callbacks; then ``state.sync()`` broadcasts rank 0's variables and
  attributes to every rank (as on every entry, so ranks also start equal from
  different initialisations). Training resumes from the last commit.
* Commits go to ``TFDIST_ELASTIC_DIR`` if set (kept, so a later launch
  resumes too), else to the launch's scratch directory ``$TFDIST_JOB_DIR``
  (kept across restarts, removed when the launch ends), else they stay in
  memory. Only rank 0 reads and writes them; under several hosts the
  directory need not be shared unless rank 0 may move to another host.

Differences from Horovod:

* No in-process recovery: Horovod catches a failed collective, rolls back to
  the last commit in memory and re-forms the ring without restarting
  processes. Here the processes restart and the commit comes from disk, so
  the script's start-up (imports, model build, the warm-up step) runs again.
* No host discovery script and no ``min_np``/``max_np`` in the script: the
  launcher changes the size (``tfdist launch --workers MIN:MAX``) by
  restarting the job. ``HostsUpdatedInterrupt`` never happens; reset
  callbacks run once after each restart that resumed from a commit.
* Preemption: inside :func:`run`, SIGTERM to any rank makes every rank stop
  at the same commit (the next one), written, and exit with code 143; the
  restarted job resumes there (:meth:`State.check_host_updates`). The ranks
  must commit at the same points (the commit callbacks do).
* Reset callbacks run on a restarted job's ranks before ``sync()``, as in
  Horovod; they must not depend on objects that only existed before the
  restart.
* ``commit()`` does not synchronise the ranks, so a rank may commit a
  different number of times than another (Horovod's commit broadcasts).
* Every attribute must be picklable (Horovod broadcasts them by pickling too),
  and commits hold numpy copies of the variables: a commit per batch of a large
  model costs a disk write per batch on rank 0. Measured here (CPU, one
  process): MobileNetV2 with SGD, a 14.2 MB commit took 42 ms (12 ms of it
  the in-memory copy every rank makes) against 398 ms for a batch-8 step.
* Reset callbacks do not run on a job's first attempt, only after a restart
  that resumed from a commit; a commit made before the state first enters
  ``elastic.run`` never replaces one this process did not write.
* Keras 3's random-seed states (Dropout's) are neither committed nor synced:
  each rank keeps its own stream, and a restarted job starts new ones (Horovod
  keeps no random state either). A model with dropout therefore resumes close
  to, not exactly on, the path of an uninterrupted run.
* Several states in one script each get their own file, named by the order in
  which they were created (``state-0``, ``state-1``...); create them in the
  same order on every run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import keras

from tfdist.errors import ConfigError
from tfdist.horovod import runtime
from tfdist.horovod.elastic_state import (
    KerasState,
    ObjectState,
    State,
    TensorFlowKerasState,
    TensorFlowState,
)
from tfdist.training.fault_tolerance.preemption import PreemptionWatcher

__all__ = [
    "State",
    "ObjectState",
    "TensorFlowKerasState",
    "KerasState",
    "TensorFlowState",
    "run",
    "CommitStateCallback",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
]


def run(func: Callable) -> Callable:
    """Decorates ``func(state, ...)``: resume from the last commit, sync, run.

    On entry, rank 0 loads the last commit if there is one (after a restart
    by ``tfdist launch --max-restarts``), every rank then runs the reset
    callbacks, and :meth:`State.sync` gives every rank rank 0's state. Errors
    propagate: a failed worker ends its process, and the launcher restarts
    the job (no in-process recovery; see the module docstring).

    Raises:
        ConfigError: The first argument is not a State.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(state, State):
            raise ConfigError(
                "state",
                state,
                "a tfdist.horovod.elastic State (KerasState, "
                "TensorFlowKerasState, TensorFlowState, ObjectState)",
                source=f"elastic.run({getattr(func, '__name__', func)})",
            )
        state._enter()  # noqa: SLF001 - tfdist's own entry hook, kept out of Horovod's public State API
        # Commits are the step boundaries at which a preemption is agreed.
        watcher = PreemptionWatcher(
            name="elastic",
            task=f"rank:{runtime.rank()}",
            index=runtime.rank(),
            workers=runtime.size(),
        )
        state.__dict__["_watcher"] = watcher
        try:
            with watcher:
                return func(state, *args, **kwargs)
        finally:
            state.__dict__.pop("_watcher", None)

    return wrapper


class CommitStateCallback(keras.callbacks.Callback):
    """Commits ``state`` every ``batches_per_commit`` batches and at each epoch's end.

    Args:
        state: The state to commit.
        batches_per_commit: Batches between commits.
    """

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        if (
            isinstance(batches_per_commit, bool)
            or not isinstance(batches_per_commit, int)
            or batches_per_commit < 1
        ):
            raise ConfigError(
                "batches_per_commit",
                batches_per_commit,
                "an integer >= 1",
                source="CommitStateCallback",
            )
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.batches_remaining = self.batches_per_commit

    def on_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Sets ``state.batch`` to the batch just finished; back to 0 at each epoch's end.

    As in Horovod, when ``fit`` knows its steps per epoch, the first epoch
    after a resume announces ``steps - state.batch`` steps in
    ``params['steps']``. Keras 3's ``fit`` runs the steps it was given
    regardless, so this changes what callbacks read, not how many batches run.
    """

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self.steps_per_epoch = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        params = self.params or {}
        if params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = params["steps"]
            params["steps"] = self.steps_per_epoch - self.state.batch

    def on_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.state.batch = batch

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Sets ``state.epoch`` to the number of epochs finished, across restarts.

    Keras counts epochs from ``initial_epoch`` in every ``fit``; the state
    counts from the epoch it held when training began, so a script that runs
    ``fit(epochs=total - state.epoch)`` after a resume finishes at ``total``.
    """

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        # +1: a resume after this epoch's commit starts with the next epoch.
        self.state.epoch = self.initial_epoch + epoch + 1
