""":class:`BackupAndRestore`: fault-tolerant training state that every worker agrees on.

The chief writes atomically (temp file, fsync, rename, then a JSON pointer naming
the latest good backup); every worker resumes from what the pointer names, in the
middle of an epoch if the job was preempted there.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from typing import Any

import keras
import tensorflow as tf
from absl import logging

from tfdist.compat import keras_private
from tfdist.errors import ConfigError
from tfdist.training import saving as keras_saving
from tfdist.training.callbacks.files import (
    CKPT_PREFIX,
    CKPT_SUFFIX,
    POINTER,
    TMP_PREFIX,
    BackupError,
    check_backup_dir,
    fsync_dir,
    fsync_file,
    read_backup_pointer,
    sha256,
    write_json_atomically,
)
from tfdist.training.callbacks.workers import (
    drop_scratch,
    is_chief,
    make_scratch,
    model_strategy,
    num_workers,
    task_name,
)
from tfdist.training.fault_tolerance import resume, task_exchange
from tfdist.training.fault_tolerance.preemption import PreemptionWatcher


class SkipSteps:
    """Stands in for ``model.train_function`` for the first calls of a
    resumed epoch: it consumes the batches the backup already trained on,
    without training, so that the epoch goes on with the next batch.

    Keras 3's own BackupAndRestore records the batch but restarts the epoch
    from its first batch, training the saved weights on those batches again.
    """

    def __init__(self, model: Any, original: Any, batches: int) -> None:
        self.model = model
        self.original = original
        self.remaining = batches
        self.per_call = max(1, int(getattr(model, "steps_per_execution", 1) or 1))

    def __call__(self, iterator: Any) -> dict:
        count = min(self.per_call, self.remaining)
        # TF's trainer passes the (distributed) iterator; other paths pass the
        # batches already fetched, which are then simply not trained on.
        if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            for _ in range(count):
                next(iterator)
        self.remaining -= count
        if self.remaining <= 0:
            self.model.train_function = self.original
        return {}


def unwrap_train_function(model: Any) -> None:
    """Restores ``model.train_function`` from under any SkipSteps wrappers."""
    fn = getattr(model, "train_function", None)
    while isinstance(fn, SkipSteps):
        fn = fn.original
    if fn is not getattr(model, "train_function", None):
        model.train_function = fn


class BackupAndRestore(keras.callbacks.Callback):
    """Backs up the training state so that ``fit`` resumes after a failure.

    Works in one process and under multi-worker MultiWorkerMirrored with one
    ``backup_dir`` that every worker sees (a shared filesystem):

    * Only the chief writes to ``backup_dir``, atomically: the weights and
      the optimizer state (``model.save_weights``, which includes the
      optimizer's variables: iterations, moments, learning rate, tfdist's
      error-feedback state) go to a temporary file in the same directory,
      are fsynced and renamed to ``ckpt-NNNNNN.weights.h5``; then a small
      ``checkpoint.json`` pointer (file name, sha256, size, epoch, step) is
      atomically replaced, and only then are older backups deleted. A kill
      at any moment leaves the pointer naming a complete backup.
    * The other workers run the same save into a temporary directory that
      is removed at once: saving on-read variables (tfdist's compression
      state) is a collective every worker must join.
    * At the start of ``fit`` every worker reads the pointer, checks the
      file's size and sha256, loads it and sets ``model._initial_epoch``
      (the mechanism of Keras 3's own ``BackupAndRestore``), so that ``fit``
      continues at the saved epoch. A backup taken in the middle of an
      epoch (``save_freq`` an integer) resumes after the batches it had
      trained on: they are read from the data and skipped. With several
      workers, they check with one all-reduce, before loading, that they all
      found the same complete backup, and fail together otherwise (e.g. a
      ``backup_dir`` that is not shared) instead of training from different
      states.

    Resuming is exact when each epoch's data come in the same order on every
    run (no reshuffling, or a shuffle seeded by the epoch; note that with
    ``steps_per_epoch`` Keras carries one iterator across epochs) and the
    model uses no random ops. After a mid-epoch resume, that epoch's metrics cover
    only the batches trained after the resume.

    Args:
        backup_dir: Directory for the backups, used by nothing else. Local
            or mounted (atomic rename is required), shared by all workers.
        save_freq: ``"epoch"``: back up at the end of every epoch; an integer
            N: every N batches (a backup on an epoch's last batch is then
            marked, without another save, as the start of the next epoch).
        delete_checkpoint: Delete the backups when ``fit`` ends normally.
        save_on_preemption: Watch for the preemption signal during ``fit``
            (SIGTERM, or ``$TFDIST_PREEMPT_SIGNAL``;
            :mod:`tfdist.training.fault_tolerance.preemption`):
            on a signal to any worker, every worker stops after the same
            step, the chief backs up there (pointer marked ``preempted``),
            and the process exits with code 143
            (:data:`tfdist.training.fault_tolerance.preemption.PREEMPTED_EXIT_CODE`). The next run
            resumes at that batch.

    Attributes:
        resumed_from: The pointer loaded at the start of the last ``fit``
            (None if it started from scratch).
        saves_written: Backups this worker wrote to ``backup_dir``.
        saves_discarded: Saves this worker ran into a scratch directory.
        scratch_dirs: Scratch directories this worker used (all removed).
    """

    def __init__(
        self,
        backup_dir: str | os.PathLike,
        save_freq: str | int = "epoch",
        delete_checkpoint: bool = True,
        save_on_preemption: bool = True,
    ) -> None:
        super().__init__()
        self.backup_dir = check_backup_dir(backup_dir)
        if save_freq != "epoch" and (
            isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1
        ):
            raise ConfigError(
                "save_freq",
                save_freq,
                "'epoch' or a number of batches >= 1",
                source="BackupAndRestore",
            )
        if not isinstance(delete_checkpoint, bool):
            raise ConfigError(
                "delete_checkpoint", delete_checkpoint, "True or False", source="BackupAndRestore"
            )
        if not isinstance(save_on_preemption, bool):
            raise ConfigError(
                "save_on_preemption", save_on_preemption, "True or False", source="BackupAndRestore"
            )
        self.save_freq = save_freq
        self.delete_checkpoint = delete_checkpoint
        self.save_on_preemption = save_on_preemption
        # Batch hooks only matter with an integer save_freq or a preemption
        # watch (which must exit from the main thread); declaring the callback
        # async-safe otherwise keeps Keras's async batch dispatch.
        self.async_safe = save_freq == "epoch" and not save_on_preemption
        self.watcher: PreemptionWatcher | None = None
        self._global_step = 0
        self._calls = 0
        self.resumed_from: dict | None = None
        self.saves_written = 0
        self.saves_discarded = 0
        self.scratch_dirs: list[str] = []
        self._chief = True
        self._save_count = 0
        self._current_file: str | None = None
        self._epoch = 0
        self._steps_done = 0
        self._since_save = 0
        self._last_save: tuple[int, int] | None = None
        self._resume_epoch: int | None = None
        self._resume_step = 0
        self._pointer_meta: dict = {}

    # -- paths ---------------------------------------------------------------

    def _path(self, name: str) -> str:
        return os.path.join(self.backup_dir, name)

    # -- train begin: restore ------------------------------------------------

    def on_train_begin(self, logs: dict | None = None) -> None:
        model = self.model
        strategy = model_strategy(model)
        self._chief = is_chief(strategy)
        unwrap_train_function(model)
        if self._chief:
            os.makedirs(self.backup_dir, exist_ok=True)

        # Check the backup with file reads only, agree, and only then load:
        # loading may run collectives (tfdist's compression state), which
        # must not happen on some workers only.
        meta, error = None, None
        try:
            meta = read_backup_pointer(self.backup_dir)
            if meta is not None:
                self._verify(meta)
        except (BackupError, OSError, ValueError) as caught:
            error = caught
        if num_workers(strategy) > 1 and not isinstance(
            strategy, tf.distribute.experimental.ParameterServerStrategy
        ):
            # (Under a ParameterServerStrategy only the coordinator runs
            # callbacks: there is nobody to agree with.)
            self._check_agreement(strategy, meta, error)
        elif error is not None:
            raise error
        if meta is not None:
            self._load(meta, strategy)

        if self._chief:
            self._sweep(keep=meta["file"] if meta else None)
        self.resumed_from = meta
        self._save_count = int(meta["save_count"]) if meta else 0
        self._current_file = meta["file"] if meta else None
        self._since_save = 0
        self._last_save = None
        self._global_step = int(meta.get("global_step", 0)) if meta else 0
        self._calls = 0
        if self.save_on_preemption:
            self.watcher = PreemptionWatcher(strategy, name="fit").start()
        if meta is None:
            keras_private.set_initial_epoch(model, None)
            self._resume_epoch, self._resume_step = None, 0
            return
        epoch = int(meta["epoch"])
        steps_per_epoch = (self.params or {}).get("steps")
        step = resume.resize(meta, strategy.num_replicas_in_sync, steps_per_epoch, model.optimizer)
        keras_private.set_initial_epoch(model, epoch)
        self._resume_epoch, self._resume_step = epoch, step
        if step > 0:
            model.train_function = SkipSteps(model, model.train_function, step)
        logging.info(
            "tfdist BackupAndRestore: resuming at epoch %d, batch %d from %s",
            epoch,
            step,
            meta["file"],
        )

    def _verify(self, meta: dict) -> None:
        """Checks that the backup the pointer names is there and complete."""
        path = self._path(meta["file"])
        if not os.path.exists(path):
            raise BackupError(
                f"{self.backup_dir}: the pointer names {meta['file']}, "
                "which does not exist here. Is backup_dir a directory "
                "that every worker sees?"
            )
        size, digest = os.path.getsize(path), sha256(path)
        if size != meta["size"] or digest != meta["sha256"]:
            raise BackupError(
                f"{path} is damaged (size {size}, expected "
                f"{meta['size']}; sha256 mismatch: "
                f"{digest != meta['sha256']}). Remove the backup "
                "directory to start over."
            )

    def _load(self, meta: dict, strategy: Any) -> None:
        model = self.model
        path = self._path(meta["file"])
        with strategy.scope():
            if model.optimizer is not None and not model.optimizer.built:
                # Keras only loads optimizer variables that exist.
                model.optimizer.build(model.trainable_variables)
            model.load_weights(path)
            saved = int(meta.get("replicas") or strategy.num_replicas_in_sync)
            if self._multi_worker(strategy) or saved != strategy.num_replicas_in_sync:
                # (One process holding every replica already has each copy in
                # the weights file.)
                resume.load_replica_state(
                    model.optimizer,
                    strategy,
                    self.backup_dir,
                    meta["file"],
                    task_name(strategy),
                    saved,
                )

    @staticmethod
    def _multi_worker(strategy: Any) -> bool:
        return num_workers(strategy) > 1 and not isinstance(
            strategy, tf.distribute.experimental.ParameterServerStrategy
        )

    def _check_agreement(self, strategy: Any, meta: dict | None, error: Exception | None) -> None:
        """One all-reduce: did every worker find the same, complete backup?

        Each replica contributes (ok, epoch, step, save_count) and their
        squares; all values agree exactly when n * sum(v^2) == sum(v)^2.
        Every worker computes the same answer, so all fail together rather
        than one training on while the others wait in a collective.
        """
        values = [
            0.0 if error else 1.0,
            float(meta["epoch"]) if meta else -1.0,
            float(meta["step"]) if meta else -1.0,
            float(int(meta["save_count"]) % (1 << 20)) if meta else -1.0,
        ]
        local = tf.constant(values + [v * v for v in values], tf.float64)

        @tf.function  # Run eagerly, MultiWorkerMirrored warns of overhead.
        def all_reduce():
            return strategy.reduce("SUM", strategy.run(lambda: tf.identity(local)), axis=None)

        total = all_reduce().numpy()
        n = strategy.num_replicas_in_sync
        sums, squares = total[:4], total[4:]
        if error is None and all(n * q == s * s for s, q in zip(sums, squares)):
            return
        mine = (
            f"failed: {error}"
            if error
            else f"read epoch={values[1]:g} step={values[2]:g} (save {meta['save_count']})"
            if meta
            else "found no backup"
        )
        try:
            # Every worker is here (they all saw the same sums): tell each
            # other what each found, for one message naming them all.
            views = task_exchange.exchange(
                strategy, "tfdist-backup-disagree", {"task": task_name(strategy), "view": mine}
            )
            found = "; ".join(f"{v['task']} {v['view']}" for v in views)
        except task_exchange.ExchangeError:
            found = f"this worker ({task_name(strategy)}) {mine}"
        raise BackupError(
            f"The workers did not find the same backup in {self.backup_dir}: expected "
            f"every worker to read one complete backup (or none), received: {found} "
            f"({int(sums[0])} of {n} replicas read theirs without error). Nothing was "
            "loaded. backup_dir must be one directory that every worker sees (a shared "
            "filesystem)."
        ) from error

    def _sweep(self, keep: str | None) -> None:
        """Removes leftovers of interrupted saves: temp files, orphan backups."""
        kept = keep.split(".", 1)[0] if keep else None  # "ckpt-000003"
        for name in os.listdir(self.backup_dir):
            # A checkpoint, or a worker's state file of one, not kept.
            orphan = name.startswith(CKPT_PREFIX) and name.split(".", 1)[0] != kept
            if name.startswith(TMP_PREFIX) or orphan:
                try:
                    os.remove(self._path(name))
                except OSError:
                    pass

    # -- progress ------------------------------------------------------------

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch
        self._steps_done = self._resume_step if epoch == self._resume_epoch else 0

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        done = batch + 1
        if done > self._steps_done:  # Not a batch skipped on resume.
            self._since_save += done - self._steps_done
            self._global_step += done - self._steps_done
            self._steps_done = done
            if self.save_freq != "epoch" and self._since_save >= self.save_freq:
                self._save(self._epoch, done)
        if self.watcher is not None:
            # Every worker counts the same calls, skipped ones included.
            self._calls += 1
            if self.watcher.should_stop(self._calls):
                self._save_and_exit()

    def _save_and_exit(self) -> None:
        """The agreed step: back up here (unless the last backup is this
        step), then exit with the preempted code."""
        epoch, step = self._epoch, self._steps_done
        if self._last_save != (epoch, step):
            self._save(epoch, step, preempted=True)
        elif self._chief:
            self._write_pointer(self._pointer_meta, epoch, step, preempted=True)
        saved = time.time()
        self.watcher.exit(
            {
                "step": self._global_step,
                "epoch": epoch,
                "batch": step,
                "backup": self._path(self._current_file or "") if self._chief else None,
                "saved_time": saved,
            }
        )

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._resume_epoch = None
        if self.save_freq == "epoch":
            self._save(epoch + 1, 0)
        elif self._last_save == (epoch, self._steps_done) and self._chief:
            # The last backup holds the whole epoch: say so, so that a resume
            # starts the next epoch instead of skipping through this one.
            self._write_pointer(self._pointer_meta, epoch + 1, 0)

    # -- save ----------------------------------------------------------------

    def _save(self, epoch: int, step: int, preempted: bool = False) -> None:
        self._since_save = 0
        self._save_count += 1
        self._last_save = (epoch, step)
        name = f"{CKPT_PREFIX}{self._save_count:06d}{CKPT_SUFFIX}"
        strategy = model_strategy(self.model)
        if self._multi_worker(strategy):
            # Each worker's own replicas, before the weights save: that save
            # is a collective the chief completes only after every worker
            # joined it, so its pointer never names a backup whose state
            # files are not all written.
            resume.save_replica_state(
                self.model.optimizer, strategy, self.backup_dir, name, task_name(strategy)
            )
        if not self._chief:
            scratch = make_scratch("tfdist-backup-")
            self.scratch_dirs.append(scratch)
            try:
                with keras_saving.unsynchronized():  # Coordinated here.
                    self.model.save_weights(os.path.join(scratch, name))
            finally:
                drop_scratch(scratch)
            self.saves_discarded += 1
            return

        os.makedirs(self.backup_dir, exist_ok=True)
        tmp = self._path(f"{TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex}{CKPT_SUFFIX}")
        final = self._path(name)
        try:
            with keras_saving.unsynchronized():  # Its own temp file and rename.
                self.model.save_weights(tmp)
            fsync_file(tmp)
            os.replace(tmp, final)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        fsync_dir(self.backup_dir)
        meta = {
            "file": name,
            "sha256": sha256(final),
            "size": os.path.getsize(final),
            "save_count": self._save_count,
        }
        self._write_pointer(meta, epoch, step, preempted=preempted)
        previous, self._current_file = self._current_file, name
        if previous and previous != name:
            self._sweep(keep=name)  # Only once the pointer moved on.
        self.saves_written += 1

    def _write_pointer(self, meta: dict, epoch: int, step: int, preempted: bool = False) -> None:
        strategy = model_strategy(self.model)
        meta = dict(
            meta,
            epoch=epoch,
            step=step,
            format=1,
            preempted=preempted,
            global_step=self._global_step,
            steps_per_epoch=(self.params or {}).get("steps"),
            writer=task_name(strategy),
            host=socket.gethostname(),
            pid=os.getpid(),
            time=time.time(),
            replicas=strategy.num_replicas_in_sync,
        )
        write_json_atomically(self._path(POINTER), meta)
        self._pointer_meta = meta

    # -- train end -----------------------------------------------------------

    def on_train_end(self, logs: dict | None = None) -> None:
        if self.watcher is not None:
            self.watcher.stop()
            self.watcher = None
        unwrap_train_function(self.model)
        keras_private.set_initial_epoch(self.model, None)  # Keras 3 leaves it set for the next fit.
        if not (self.delete_checkpoint and self._chief):
            return
        # The pointer goes first: a kill during the cleanup leaves no pointer
        # (a fresh start) rather than a pointer to a deleted file.
        pointer = self._path(POINTER)
        if os.path.exists(pointer):
            os.remove(pointer)
        if os.path.isdir(self.backup_dir):
            self._sweep(keep=None)
            try:
                os.rmdir(self.backup_dir)
            except OSError:
                pass  # Not empty: someone else's files; leave them.
