"""Keras's own ``BackupAndRestore`` under a tfdist strategy: saves on
preemption, and resumes at the batch it saved.

Keras 3.15's callback, unchanged, loses work twice over: it never sees the
preemption signal (TensorFlow's coordination service takes SIGTERM), and a
resume restarts the saved epoch from its first batch, training those batches
again; its mid-epoch saves also record epoch 0 during the first epoch after a
resume (it counts epochs only in ``on_epoch_end``). Under a tfdist strategy
:func:`install` wraps the class so that, with no change to the script:

* a :class:`tfdist.training.fault_tolerance.preemption.PreemptionWatcher` runs during ``fit``; on a
  signal to any worker every worker stops after the same batch, the callback
  saves there (the chief writes, :mod:`tfdist.training.saving`), and the
  process exits with code 143;
* every save records the batches done in the epoch (``tfdist_batches_done``
  in Keras's ``training_metadata.json``, beside Keras's own fields), and a
  resume skips them (read, not trained), as :class:`tfdist.BackupAndRestore`
  does;
* in a multi-worker job, before anything is loaded, the tasks agree on the
  backup they all resume from, and each task whose ``backup_dir`` is its own
  (no shared filesystem) writes its backup there
  (:mod:`tfdist.training.fault_tolerance.backup_dirs`): workers never resume at different
  points; if their backups hold no point in common every task fails at once,
  naming what each holds (:mod:`tfdist.training.fault_tolerance.backup_agreement`).

Under TensorFlow's own strategies nothing changes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
from typing import Any

from absl import logging

from tfdist.compat import keras_private
from tfdist.record import attach, slot
from tfdist.training.fault_tolerance import preemption
from tfdist.training.fault_tolerance.preemption import PreemptionWatcher

__all__ = [
    "install",
    "wrap_begin",
    "wrap_epoch_begin",
    "wrap_batch_end",
    "wrap_epoch_end",
    "wrap_save",
    "wrap_end",
    "wrap_fit",
]


def _under_tfdist(model: Any) -> bool:
    import tensorflow as tf

    strategy = getattr(model, "_distribute_strategy", None) or tf.distribute.get_strategy()
    return type(strategy).__module__.startswith("tfdist.")


def _strategy(model: Any):
    import tensorflow as tf

    return getattr(model, "_distribute_strategy", None) or tf.distribute.get_strategy()


def _read_metadata(callback: Any) -> dict | None:
    try:
        with open(keras_private.backup_paths(callback)[1]) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


@dataclasses.dataclass
class FitProgress:
    """What tfdist keeps on a Keras BackupAndRestore during a ``fit``
    (a :mod:`tfdist.record` slot).

    Attributes:
        done: Batches of this epoch done: what a mid-epoch save records.
        calls: Batch ends seen, which the watcher's agreement counts.
        resume: ``(epoch, batches)`` a resumed fit skips, until that epoch begins.
        preempting: A stop was agreed on; the save it makes says so.
        watcher: The preemption watcher, from ``on_train_begin`` to ``on_train_end``.
        own_copy: This non-chief task writes its own backup (decided at train begin).
    """

    done: int = 0
    calls: int = 0
    resume: tuple[int, int] | None = None
    preempting: bool = False
    watcher: PreemptionWatcher | None = None
    own_copy: bool = False


def progress(callback: object) -> FitProgress:
    """``callback``'s progress in this fit (kept from its ``on_train_begin``)."""
    found = slot(callback, FitProgress)
    return found if found is not None else attach(callback, FitProgress())


def metadata(callback: Any, digest: bool | None = None) -> dict:
    """The fields tfdist adds to a save's ``training_metadata.json``.

    Args:
        callback: Keras's BackupAndRestore, after its weights were saved.
        digest: Add the weights file's sha256 and size (which tie the
            metadata to it); default: in a multi-worker job, where the
            workers check their backups against each other's at resume.
    """
    from tfdist.training import saving as keras_saving
    from tfdist.training.fault_tolerance import backup_dirs

    strategy = _strategy(callback.model)
    fields = {
        "tfdist_batches_done": progress(callback).done,
        "tfdist_preempted": progress(callback).preempting,
        "replicas": strategy.num_replicas_in_sync,
        "steps_per_epoch": (callback.params or {}).get("steps"),
    }
    if digest is None:
        digest = keras_saving.active(callback.model)[0]
    if digest:
        weights = keras_private.backup_paths(callback)[0]
        if os.path.exists(weights):
            fields.update(backup_dirs.weights_digest(weights))
    return fields


def _agreed_load(callback: Any, original: Any, logs: Any) -> dict | None:
    """A multi-worker job: the tasks agree on the backup (and on who writes
    which directory), then each loads its backup of the agreed point.

    Returns:
        The loaded backup's metadata, or None (a fresh start on every task).
    """
    from tfdist.training import saving as keras_saving
    from tfdist.training.fault_tolerance import backup_agreement, backup_dirs

    decision = backup_dirs.decide(callback, _strategy(callback.model))
    chief = keras_saving.active(callback.model)[1]
    progress(callback).own_copy = decision.writes and not chief
    if decision.slot is None:
        return None
    with backup_dirs.loading(callback, decision.slot):
        original(callback, logs)
        saved = _read_metadata(callback)
    if decision.slot == "previous" and decision.writes:
        backup_dirs.roll_back(callback)
    logging.info(
        "tfdist: the workers agreed to resume Keras's BackupAndRestore at %s "
        "(this task's %s backup in %s)",
        backup_agreement.describe(decision.point),
        decision.slot,
        callback.backup_dir,
    )
    return saved


def _agrees(callback: Any) -> bool:
    """Whether this fit's backups are agreed on across tasks (a tfdist
    multi-worker job with a local ``backup_dir``)."""
    from tfdist.training import saving as keras_saving
    from tfdist.training.chief_save import local

    return keras_saving.active(callback.model)[0] and local(str(callback.backup_dir))


def wrap_begin(original):
    @functools.wraps(original)
    def on_train_begin(self, logs=None):
        state = attach(self, FitProgress())
        if not _under_tfdist(self.model):
            return original(self, logs)
        from tfdist.training.callbacks.backup import SkipSteps, unwrap_train_function
        from tfdist.training.fault_tolerance import resume

        unwrap_train_function(self.model)
        if _agrees(self):
            # Keras loads what this task's directory holds; in a multi-worker
            # job that must be the same point on every task.
            saved = _agreed_load(self, original, logs)
        else:
            original(self, logs)
            saved = _read_metadata(self) if os.path.exists(self._weights_path) else None
        if saved and saved.get("tfdist_batches_done"):
            meta = {
                "step": saved["tfdist_batches_done"],
                "epoch": saved["epoch"],
                "replicas": saved.get("replicas"),
                "steps_per_epoch": saved.get("steps_per_epoch"),
            }
            done = resume.resize(
                meta,
                _strategy(self.model).num_replicas_in_sync,
                (self.params or {}).get("steps"),
                self.model.optimizer,
            )
            if done:
                self.model.train_function = SkipSteps(self.model, self.model.train_function, done)
                state.resume = (int(saved["epoch"]), done)
                logging.info(
                    "tfdist: Keras BackupAndRestore resumes at epoch %d, batch %d",
                    saved["epoch"],
                    done,
                )
        state.watcher = PreemptionWatcher(_strategy(self.model), name="fit").start()

    return on_train_begin


def wrap_epoch_begin(original):
    @functools.wraps(original)
    def on_epoch_begin(self, epoch, logs=None):
        # Keras only counts epochs at their end: a mid-epoch save in the
        # first epoch after a resume would record epoch 0.
        self._current_epoch = epoch
        state = progress(self)
        resumed = state.resume
        state.done = resumed[1] if resumed and resumed[0] == epoch else 0
        state.resume = None
        return original(self, epoch, logs)

    return on_epoch_begin


def wrap_batch_end(original):
    @functools.wraps(original)
    def on_train_batch_end(self, batch, logs=None):
        state = progress(self)
        state.done = max(batch + 1, state.done)
        original(self, batch, logs)
        watcher = state.watcher
        if watcher is None:
            return
        state.calls += 1
        if watcher.should_stop(state.calls):
            state.preempting = True
            self._last_batch_seen = batch
            self._save_model()
            watcher.exit(
                {
                    "epoch": self._current_epoch,
                    "batch": state.done,
                    "backup": str(self.backup_dir),
                }
            )

    return on_train_batch_end


def wrap_epoch_end(original):
    @functools.wraps(original)
    def on_epoch_end(self, epoch, logs=None):
        progress(self).done = 0  # An epoch-end save starts the next epoch.
        return original(self, epoch, logs)

    return on_epoch_end


def wrap_save(original):
    @functools.wraps(original)
    def _save_model(self):
        if progress(self).own_copy:
            # A non-chief task that writes its own backup_dir (decided at
            # train begin), instead of saving into scratch.
            from tfdist.training.fault_tolerance import backup_dirs

            return backup_dirs.save_own(self, metadata(self, digest=False))
        result = original(self)
        if not _under_tfdist(self.model):
            return result
        from tfdist.training import saving as keras_saving

        on, chief = keras_saving.active(self.model)
        if chief and not on:
            # Keras wrote its own fields; add tfdist's (atomically). (In a
            # multi-worker job tfdist's save writes them in one go.)
            saved = _read_metadata(self) or {
                "epoch": self._current_epoch,
                "batch": self._last_batch_seen,
            }
            keras_saving.write_json(self._training_metadata_path, {**saved, **metadata(self)})
        return result

    return _save_model


def wrap_end(original):
    @functools.wraps(original)
    def on_train_end(self, logs=None):
        state = progress(self)
        watcher, state.watcher = state.watcher, None
        if watcher is not None:
            watcher.stop()
        if _under_tfdist(self.model):
            from tfdist.training.callbacks.backup import unwrap_train_function

            unwrap_train_function(self.model)
        result = original(self, logs)
        own_copy, state.own_copy = state.own_copy, False
        if own_copy and self.delete_checkpoint:
            # The chief deletes its own; this task wrote this one.
            shutil.rmtree(str(self.backup_dir), ignore_errors=True)
        return result

    return on_train_end


def wrap_fit(original):
    @functools.wraps(original)
    def fit(self, *args, **kwargs):
        before = preemption.running()
        try:
            return original(self, *args, **kwargs)
        finally:
            # A fit that raised never reached on_train_end, where the
            # callbacks stop the watchers they started: stop those now, or
            # their handler, which only records the signal, outlives the fit
            # and the process no longer ends on SIGTERM.
            for watcher in reversed(preemption.running()):
                if watcher not in before:
                    watcher.stop()

    return fit


def install() -> None:
    """Wraps Keras's BackupAndRestore once (the registry's ``fit_preemption``,
    which composes outside :mod:`tfdist.training.saving`'s wrappers of the same
    methods); idempotent."""
    from tfdist import compat

    compat.install("fit_preemption")
