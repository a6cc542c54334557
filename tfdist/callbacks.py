"""Keras 3 callbacks that are safe under multi-worker training.

Keras's own callbacks assume one process writes. Under a multi-worker
``MultiWorkerMirroredStrategy`` every worker runs them, so they race on the
same files (Keras 3's ``BackupAndRestore`` on a shared directory failed 3 runs
out of 3 here: a ``makedirs`` race or an HDF5 lock). The callbacks here write
from the chief only:

* :class:`BackupAndRestore`: fault-tolerant training state. The chief writes
  atomically (temp file, fsync, rename, then a JSON pointer naming the latest
  good backup); every worker resumes from what the pointer names.
* :class:`ModelCheckpoint` and :class:`TensorBoard`: Keras's, with the
  non-chief workers writing into a temporary directory that is removed.
  Under tfdist's own MultiWorkerMirrored strategy Keras's ModelCheckpoint,
  BackupAndRestore and ``model.save`` are made safe too
  (:mod:`tfdist.keras_saving`); these classes also work under TensorFlow's
  strategies, and :class:`BackupAndRestore` adds a checked pointer, a
  mid-epoch resume and the workers' agreement on the backup.
* :class:`LearningRateWarmup` and :func:`scale_learning_rate`: the linear
  scaling rule with gradual warm-up (Goyal et al. 2017, as Horovod does it).

Non-chief workers still *run* every save into a scratch directory. Under
MultiWorkerMirrored, saving a ``synchronization="on_read"`` variable (tfdist's
error-feedback state; Keras 3 does not save its metric variables) reads it
with an all-reduce across workers, and loading one broadcasts. A worker that
skipped the save leaves the others in a collective it never joins: measured
with top-k compression on 2 workers, the next training step then failed with
"Shape mismatch in the collective instance".
"""

from __future__ import annotations

import atexit
import hashlib
import json
import math
import os
import shutil
import socket
import tempfile
import time
import uuid
from typing import Any

import keras
import tensorflow as tf
from absl import logging
from tensorflow.python.distribute import multi_worker_util

from tfdist import keras_saving, resume
from tfdist.errors import ConfigError, TfdistError, require_int
from tfdist.preemption import PreemptionWatcher

__all__ = [
    "BackupError",
    "BackupAndRestore",
    "ModelCheckpoint",
    "TensorBoard",
    "TensorBoardNotInstalledError",
    "LearningRateWarmup",
    "scale_learning_rate",
    "is_chief",
    "num_workers",
    "read_backup_pointer",
]


class BackupError(TfdistError, RuntimeError):
    """A backup cannot be resumed from (damaged, or workers disagree)."""


# --------------------------------------------------------------------------
# Who is the chief.


def _resolver(strategy: Any):
    # ParameterServerStrategy keeps its resolver private.
    return (getattr(strategy, "cluster_resolver", None)
            or getattr(strategy, "_cluster_resolver", None)
            or getattr(getattr(strategy, "extended", None), "_cluster_resolver", None))


def _cluster(strategy: Any) -> tuple[dict, str | None, int | None]:
    resolver = _resolver(strategy)
    if resolver is None or not getattr(resolver, "task_type", None):
        return {}, None, None
    return (resolver.cluster_spec().as_dict(), resolver.task_type,
            resolver.task_id)


def is_chief(strategy: Any = None) -> bool:
    """Whether this task writes checkpoints and logs for the job.

    tfdist strategies answer themselves (``strategy.is_chief``). For
    TensorFlow's own strategies the answer comes from the cluster resolver,
    as ``multi_worker_util.is_chief`` decides it (the ``chief`` task, else
    ``worker:0``); without a cluster (one process) it is True.

    Args:
        strategy: The strategy; default: the one in scope.
    """
    strategy = strategy or tf.distribute.get_strategy()
    own = getattr(strategy, "is_chief", None)
    if isinstance(own, bool):
        return own
    spec, task_type, task_id = _cluster(strategy)
    if not spec or task_type is None:
        return True
    return multi_worker_util.is_chief(spec, task_type, task_id)


def num_workers(strategy: Any = None) -> int:
    """Worker processes that train in sync (``chief`` + ``worker`` tasks), >= 1."""
    strategy = strategy or tf.distribute.get_strategy()
    spec, _, _ = _cluster(strategy)
    return max(1, len(spec.get("chief", ())) + len(spec.get("worker", ())))


def _task_name(strategy: Any) -> str:
    _, task_type, task_id = _cluster(strategy)
    return f"{task_type}:{task_id}" if task_type else "local"


def _model_strategy(model: Any):
    return getattr(model, "distribute_strategy", None) or tf.distribute.get_strategy()


# --------------------------------------------------------------------------
# Scratch directories for non-chief writers.

_SCRATCH: set[str] = set()


def _remove_scratch() -> None:
    for path in list(_SCRATCH):
        shutil.rmtree(path, ignore_errors=True)
        _SCRATCH.discard(path)


atexit.register(_remove_scratch)


def _make_scratch(prefix: str) -> str:
    """A temporary directory, removed at process exit if not before."""
    path = tempfile.mkdtemp(prefix=prefix)
    _SCRATCH.add(path)
    return path


def _drop_scratch(path: str | None) -> None:
    if path:
        shutil.rmtree(path, ignore_errors=True)
        _SCRATCH.discard(path)


# --------------------------------------------------------------------------
# Atomic file writes.


def _fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    # Makes a rename durable; some filesystems refuse directory fsync.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_json_atomically(path: str, data: dict) -> None:
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, f"{_TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex}.json")
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    _fsync_dir(directory)


# --------------------------------------------------------------------------
# BackupAndRestore.

#: Name of the pointer file in a backup directory.
POINTER = "checkpoint.json"
_TMP_PREFIX = ".tmp-"
_CKPT_PREFIX = "ckpt-"
_CKPT_SUFFIX = ".weights.h5"
_POINTER_KEYS = ("file", "sha256", "size", "epoch", "step", "save_count")


def read_backup_pointer(backup_dir: str | os.PathLike) -> dict | None:
    """Reads the pointer of a :class:`BackupAndRestore` directory.

    Returns:
        The pointer's fields (``file``, ``sha256``, ``size``, ``epoch`` = the
        epoch to resume at, ``step`` = batches of that epoch already trained,
        ``save_count``, ``writer``...), or None when there is no backup.

    Raises:
        BackupError: The pointer exists but cannot be read.
    """
    path = os.path.join(os.fspath(backup_dir), POINTER)
    try:
        with open(path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise BackupError(f"{path}: cannot read the backup pointer ({error}). "
                          "Remove the backup directory to start over.") from None
    missing = ([k for k in _POINTER_KEYS if k not in meta]
               if isinstance(meta, dict) else list(_POINTER_KEYS))
    if missing:
        raise BackupError(f"{path}: the backup pointer lacks {missing}.")
    return meta


def _check_backup_dir(value: Any) -> str:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip():
        raise ConfigError("backup_dir", value, "a non-empty directory path",
                          source="BackupAndRestore")
    if "://" in value:
        raise ConfigError("backup_dir", value, "a local or mounted directory "
                          "(the backup relies on an atomic rename)",
                          source="BackupAndRestore",
                          hint="Mount the bucket (e.g. gcsfuse) or back up to "
                          "a shared POSIX filesystem.")
    return value


class _SkipSteps:
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


def _unwrap_train_function(model: Any) -> None:
    fn = getattr(model, "train_function", None)
    while isinstance(fn, _SkipSteps):
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
            (SIGTERM, or ``$TFDIST_PREEMPT_SIGNAL``; :mod:`tfdist.preemption`):
            on a signal to any worker, every worker stops after the same
            step, the chief backs up there (pointer marked ``preempted``),
            and the process exits with code 143
            (:data:`tfdist.preemption.PREEMPTED_EXIT_CODE`). The next run
            resumes at that batch.

    Attributes:
        resumed_from: The pointer loaded at the start of the last ``fit``
            (None if it started from scratch).
        saves_written: Backups this worker wrote to ``backup_dir``.
        saves_discarded: Saves this worker ran into a scratch directory.
        scratch_dirs: Scratch directories this worker used (all removed).
    """

    def __init__(self, backup_dir: str | os.PathLike, save_freq: str | int = "epoch",
                 delete_checkpoint: bool = True, save_on_preemption: bool = True) -> None:
        super().__init__()
        self.backup_dir = _check_backup_dir(backup_dir)
        if save_freq != "epoch" and (isinstance(save_freq, bool)
                                     or not isinstance(save_freq, int)
                                     or save_freq < 1):
            raise ConfigError("save_freq", save_freq,
                              "'epoch' or a number of batches >= 1",
                              source="BackupAndRestore")
        if not isinstance(delete_checkpoint, bool):
            raise ConfigError("delete_checkpoint", delete_checkpoint, "True or False",
                              source="BackupAndRestore")
        if not isinstance(save_on_preemption, bool):
            raise ConfigError("save_on_preemption", save_on_preemption, "True or False",
                              source="BackupAndRestore")
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
        strategy = _model_strategy(model)
        self._chief = is_chief(strategy)
        _unwrap_train_function(model)
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
                strategy, tf.distribute.experimental.ParameterServerStrategy):
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
            model._initial_epoch = None
            self._resume_epoch, self._resume_step = None, 0
            return
        epoch = int(meta["epoch"])
        step = resume.resize(meta, strategy.num_replicas_in_sync, self.params.get("steps"),
                             model.optimizer)
        model._initial_epoch = epoch
        self._resume_epoch, self._resume_step = epoch, step
        if step > 0:
            model.train_function = _SkipSteps(model, model.train_function, step)
        logging.info("tfdist BackupAndRestore: resuming at epoch %d, batch %d "
                     "from %s", epoch, step, meta["file"])

    def _verify(self, meta: dict) -> None:
        """Checks that the backup the pointer names is there and complete."""
        path = self._path(meta["file"])
        if not os.path.exists(path):
            raise BackupError(f"{self.backup_dir}: the pointer names {meta['file']}, "
                              "which does not exist here. Is backup_dir a directory "
                              "that every worker sees?")
        size, digest = os.path.getsize(path), _sha256(path)
        if size != meta["size"] or digest != meta["sha256"]:
            raise BackupError(f"{path} is damaged (size {size}, expected "
                              f"{meta['size']}; sha256 mismatch: "
                              f"{digest != meta['sha256']}). Remove the backup "
                              "directory to start over.")

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
                resume.load_replica_state(model.optimizer, strategy, self.backup_dir,
                                          meta["file"], _task_name(strategy), saved)

    @staticmethod
    def _multi_worker(strategy: Any) -> bool:
        return num_workers(strategy) > 1 and not isinstance(
            strategy, tf.distribute.experimental.ParameterServerStrategy)

    def _check_agreement(self, strategy: Any, meta: dict | None,
                         error: Exception | None) -> None:
        """One all-reduce: did every worker find the same, complete backup?

        Each replica contributes (ok, epoch, step, save_count) and their
        squares; all values agree exactly when n * sum(v^2) == sum(v)^2.
        Every worker computes the same answer, so all fail together rather
        than one training on while the others wait in a collective.
        """
        values = [0.0 if error else 1.0,
                  float(meta["epoch"]) if meta else -1.0,
                  float(meta["step"]) if meta else -1.0,
                  float(int(meta["save_count"]) % (1 << 20)) if meta else -1.0]
        local = tf.constant(values + [v * v for v in values], tf.float64)

        @tf.function  # Run eagerly, MultiWorkerMirrored warns of overhead.
        def all_reduce():
            return strategy.reduce("SUM", strategy.run(lambda: tf.identity(local)),
                                   axis=None)

        total = all_reduce().numpy()
        n = strategy.num_replicas_in_sync
        sums, squares = total[:4], total[4:]
        if error is None and all(n * q == s * s for s, q in zip(sums, squares)):
            return
        mine = (f"this worker ({_task_name(strategy)}) "
                + (f"failed: {error}" if error else
                   f"read epoch={values[1]:g} step={values[2]:g}"
                   if meta else "found no backup"))
        raise BackupError(
            f"The workers did not find the same backup in {self.backup_dir} "
            f"({int(sums[0])} of {n} replicas read theirs without error); "
            f"{mine}. backup_dir must be one directory that every worker "
            "sees (a shared filesystem).") from error

    def _sweep(self, keep: str | None) -> None:
        """Removes leftovers of interrupted saves: temp files, orphan backups."""
        kept = keep.split(".", 1)[0] if keep else None  # "ckpt-000003"
        for name in os.listdir(self.backup_dir):
            # A checkpoint, or a worker's state file of one, not kept.
            orphan = name.startswith(_CKPT_PREFIX) and name.split(".", 1)[0] != kept
            if name.startswith(_TMP_PREFIX) or orphan:
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
        self.watcher.exit({"step": self._global_step, "epoch": epoch, "batch": step,
                           "backup": self._path(self._current_file or "") if self._chief
                           else None, "saved_time": saved})

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
        name = f"{_CKPT_PREFIX}{self._save_count:06d}{_CKPT_SUFFIX}"
        strategy = _model_strategy(self.model)
        if self._multi_worker(strategy):
            # Each worker's own replicas, before the weights save: that save
            # is a collective the chief completes only after every worker
            # joined it, so its pointer never names a backup whose state
            # files are not all written.
            resume.save_replica_state(self.model.optimizer, strategy, self.backup_dir, name,
                                      _task_name(strategy))
        if not self._chief:
            scratch = _make_scratch("tfdist-backup-")
            self.scratch_dirs.append(scratch)
            try:
                with keras_saving.unsynchronized():  # Coordinated here.
                    self.model.save_weights(os.path.join(scratch, name))
            finally:
                _drop_scratch(scratch)
            self.saves_discarded += 1
            return

        os.makedirs(self.backup_dir, exist_ok=True)
        tmp = self._path(f"{_TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex}{_CKPT_SUFFIX}")
        final = self._path(name)
        try:
            with keras_saving.unsynchronized():  # Its own temp file and rename.
                self.model.save_weights(tmp)
            _fsync_file(tmp)
            os.replace(tmp, final)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        _fsync_dir(self.backup_dir)
        meta = {"file": name, "sha256": _sha256(final),
                "size": os.path.getsize(final), "save_count": self._save_count}
        self._write_pointer(meta, epoch, step, preempted=preempted)
        previous, self._current_file = self._current_file, name
        if previous and previous != name:
            self._sweep(keep=name)  # Only once the pointer moved on.
        self.saves_written += 1

    def _write_pointer(self, meta: dict, epoch: int, step: int,
                       preempted: bool = False) -> None:
        strategy = _model_strategy(self.model)
        meta = dict(meta, epoch=epoch, step=step, format=1, preempted=preempted,
                    global_step=self._global_step, steps_per_epoch=self.params.get("steps"),
                    writer=_task_name(strategy), host=socket.gethostname(),
                    pid=os.getpid(), time=time.time(),
                    replicas=strategy.num_replicas_in_sync)
        _write_json_atomically(self._path(POINTER), meta)
        self._pointer_meta = meta

    # -- train end -----------------------------------------------------------

    def on_train_end(self, logs: dict | None = None) -> None:
        if self.watcher is not None:
            self.watcher.stop()
            self.watcher = None
        _unwrap_train_function(self.model)
        self.model._initial_epoch = None  # Keras 3 leaves it set for the next fit.
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


# --------------------------------------------------------------------------
# ModelCheckpoint and TensorBoard: chief writes, others write to scratch.


class ModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """``keras.callbacks.ModelCheckpoint`` that only the chief writes.

    Non-chief workers still save (a save reads on-read variables, which is
    a collective under MultiWorkerMirrored), into a temporary directory that
    is removed when ``fit`` ends, or at process exit if it does not. Under
    tfdist's MultiWorkerMirrored strategy Keras's own ModelCheckpoint does
    the same (:mod:`tfdist.keras_saving`); this class also does it under
    TensorFlow's own MultiWorkerMirroredStrategy.

    Args:
        filepath: As for Keras; the chief writes there.
        **kwargs: Keras ``ModelCheckpoint`` arguments.
    """

    def __init__(self, filepath: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__(filepath, **kwargs)
        self.chief_filepath = self.filepath
        self.scratch_dir: str | None = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        _drop_scratch(self.scratch_dir)
        self.scratch_dir = None
        self.filepath = self.chief_filepath
        if not is_chief(_model_strategy(self.model)):
            self.scratch_dir = _make_scratch("tfdist-ckpt-")
            self.filepath = os.path.join(self.scratch_dir,
                                         os.path.basename(self.chief_filepath))
        super().on_train_begin(logs)

    def on_train_end(self, logs: dict | None = None) -> None:
        super().on_train_end(logs)
        _drop_scratch(self.scratch_dir)
        self.filepath = self.chief_filepath


class TensorBoardNotInstalledError(TfdistError, ImportError):
    """The ``tensorboard`` package, which writes the summaries, is missing."""


class TensorBoard(keras.callbacks.TensorBoard):
    """``keras.callbacks.TensorBoard`` whose logs only the chief writes.

    Non-chief workers log into a temporary directory that is removed when
    ``fit`` ends (after the writers are closed), or at process exit.

    Needs the ``tensorboard`` package (``pip install 'tfdist[tensorboard]'``):
    TensorFlow 2.21 no longer installs it, and without it ``tf.summary.scalar``
    fails when Keras writes the first step's logs.

    Args:
        log_dir: As for Keras; the chief writes there.
        **kwargs: Keras ``TensorBoard`` arguments.

    Raises:
        TensorBoardNotInstalledError: tensorboard is not installed.
    """

    #: How to install what this callback needs.
    INSTALL_HINT = "pip install 'tfdist[tensorboard]' (or: pip install tensorboard)"

    def __init__(self, log_dir: str | os.PathLike = "logs", **kwargs: Any) -> None:
        try:
            # What tf.summary.scalar/histogram/image import when called.
            import tensorboard.summary.v2  # noqa: F401
        except ImportError as error:
            raise TensorBoardNotInstalledError(
                "tfdist.TensorBoard needs the 'tensorboard' package, which is "
                f"not installed ({error}): Keras's TensorBoard callback writes "
                "its logs with tf.summary, whose scalar, histogram and image "
                "summaries TensorFlow takes from tensorboard, and would fail "
                "after the first training step. Install it with: "
                f"{self.INSTALL_HINT}", name="tensorboard") from error
        super().__init__(log_dir, **kwargs)
        self.chief_log_dir = self.log_dir
        self.scratch_dir: str | None = None

    def set_model(self, model: Any) -> None:
        # Keras derives the writers' directories from log_dir here.
        _drop_scratch(self.scratch_dir)
        self.scratch_dir = None
        self.log_dir = self.chief_log_dir
        if not is_chief(_model_strategy(model)):
            self.scratch_dir = _make_scratch("tfdist-tensorboard-")
            self.log_dir = self.scratch_dir
        super().set_model(model)

    def on_train_end(self, logs: dict | None = None) -> None:
        super().on_train_end(logs)  # Closes the writers first.
        _drop_scratch(self.scratch_dir)
        self.log_dir = self.chief_log_dir


# --------------------------------------------------------------------------
# Learning rate: linear scaling and warm-up.


def _replicas(strategy: Any, field: str = "strategy", source: str = "") -> int:
    count = getattr(strategy, "num_replicas_in_sync", None)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ConfigError(field, strategy, "a tf.distribute strategy "
                          "(something with num_replicas_in_sync >= 1)",
                          source=source or None)
    return count


def _positive_number(field: str, value: Any, source: str, *,
                     allow_zero: bool = False) -> float:
    ok = (not isinstance(value, bool) and isinstance(value, (int, float))
          and math.isfinite(value) and (value >= 0 if allow_zero else value > 0))
    if not ok:
        raise ConfigError(field, value, "a number >= 0" if allow_zero
                          else "a number > 0", source=source)
    return float(value)



def scale_learning_rate(base_lr: float, strategy: Any, base_batch: int | None = None,
                        per_replica_batch: int | None = None) -> float:
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
        raise ConfigError(missing, None, "an integer >= 1 when "
                          f"{'per_replica_batch' if base_batch is None else 'base_batch'}"
                          f"={given!r} is given (or neither)", source=source)
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

    def __init__(self, warmup_epochs: float = 5, initial_lr: float | None = None,
                 target_lr: float | None = None, steps_per_epoch: int | None = None,
                 verbose: int = 0) -> None:
        super().__init__()
        source = "LearningRateWarmup"
        self.warmup_epochs = _positive_number("warmup_epochs", warmup_epochs, source)
        self.initial_lr = (None if initial_lr is None else
                           _positive_number("initial_lr", initial_lr, source,
                                            allow_zero=True))
        self.target_lr = (None if target_lr is None else
                          _positive_number("target_lr", target_lr, source))
        self.steps_per_epoch = (None if steps_per_epoch is None else
                                require_int("steps_per_epoch", steps_per_epoch, 1, source))
        self.verbose = verbose
        self._seen_target: float | None = None
        self._epoch = 0
        self._done = False
        self._steps = 1
        self._initial = self._target = 0.0

    def _optimizer_lr(self, model: Any) -> float:
        optimizer = getattr(model, "optimizer", None)
        schedule = getattr(optimizer, "_learning_rate", None)
        if optimizer is None or isinstance(
                schedule, keras.optimizers.schedules.LearningRateSchedule) or callable(schedule):
            raise ConfigError("optimizer.learning_rate", schedule,
                              "a float rate that can be set per batch",
                              source="LearningRateWarmup",
                              hint="Put the warm-up into the schedule itself, or "
                              "compile with a float learning rate.")
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
        replicas = _model_strategy(self.model).num_replicas_in_sync
        self._initial = (self._target / replicas if self.initial_lr is None
                         else self.initial_lr)
        steps = self.steps_per_epoch or (self.params or {}).get("steps")
        if not steps:
            raise ConfigError("steps_per_epoch", steps, "an integer >= 1 (fit does "
                              "not know the number of batches per epoch)",
                              source="LearningRateWarmup",
                              hint="Pass steps_per_epoch= to LearningRateWarmup.")
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
                print(f"\nEpoch {self._epoch + 1}: finished gradual learning "
                      f"rate warm-up to {lr:g}.", flush=True)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is not None:
            logs["learning_rate"] = float(
                keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
