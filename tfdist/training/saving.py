"""Keras's own saving and checkpoint callbacks under multi-worker training.

Under MultiWorkerMirrored every worker runs the same script, so every worker
calls ``model.save`` and runs ``ModelCheckpoint`` and ``BackupAndRestore``.
Keras 3.15 then writes the same files from every process. On a shared
filesystem (or one machine) that fails: the second ``h5py`` writer gets
"unable to lock file" (BlockingIOError), two ``.keras`` writers interleave
into one zip (BadZipFile: Bad CRC-32), and a worker that loads right after
its own save can read the chief's file before it is complete.

TensorFlow's documented pattern is that the chief writes the real file and
the other workers still run the save (it may read ``on_read`` variables,
which is a collective every worker must join) into a temporary location
they delete. :func:`install`, called by tfdist's MultiWorkerMirroredStrategy,
makes Keras do that itself, only while the model's strategy is a tfdist
multi-worker strategy of two or more workers:

* **The chief writes atomically.** The save goes into a temporary directory
  next to the target (same filesystem), is fsynced, and is renamed into
  place; a sharded save's shards move first and its ``.weights.json`` last.
  A reader sees the old file or the new one, never a partial one.
* **The other workers save into a private temporary directory** (same file
  name), which is removed. When a worker's own path differs from the chief's
  (the tutorial's ``workertemp_<id>/`` pattern), its file is then moved
  there, as the user asked; when it is the chief's path, nothing is written
  there by this worker.
* **A save returns once the chief's file is complete.** The chief publishes
  each save in TensorFlow's coordination service (key: file name and how
  many saves of that name this task made); the other workers wait for it at
  the end of their save. So ``load_model`` right after ``model.save`` reads
  the chief's complete file on every worker. The chief never waits: a save
  on the chief alone does not hang. The rule: call a save on every worker
  (as TensorFlow's tutorial does; Keras callbacks run on every worker) or on
  the chief only. A worker waiting for a save the chief never makes gives
  up after :data:`WAIT_SECONDS` (plus twice its own save time) with a
  warning. If the chief's save fails, the others' save raises too.
* **Callbacks.** ``ModelCheckpoint``: the other workers run it with the path
  under a private directory (no race creating the directory).
  ``BackupAndRestore``: the chief writes the weights and the
  ``training_metadata.json`` atomically and deletes the backup at the end;
  the others only run the weight save, and on restart every worker loads
  the chief's backup.
* **``tf.train.CheckpointManager.save``** (the tutorials' TensorFlow
  checkpoints, saved by the chief in the real directory and by the others in
  their own): TensorFlow writes atomically already; a worker's save returns
  once the chief's save of the same count is done, so its
  ``tf.train.latest_checkpoint`` of the chief's directory finds it. A worker
  whose manager has the chief's directory (one script, one path) saves into
  a private directory that is removed: only the chief writes there.

Single-worker training, and every other strategy, are unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
import weakref
from typing import Any, Callable

from absl import logging

from tfdist.errors import TfdistError

__all__ = ["ChiefSaveError", "install", "active", "unsynchronized", "WAIT_SECONDS"]

#: Seconds a non-chief worker waits for the chief's matching save, on top of
#: twice the time its own save took.
WAIT_SECONDS = 120.0

_MARK = "_tfdist_multi_worker_saving"
_KEY_PREFIX = "tfdist/keras_saving"
_TMP_PREFIX = ".tfdist-save-"
_STATE = threading.local()
_COUNTS: dict[str, int] = {}
_COUNTS_LOCK = threading.Lock()


class ChiefSaveError(TfdistError, RuntimeError):
    """The chief's save failed, so this worker's matching save fails too."""


# --------------------------------------------------------------------------
# When the patch acts.


@contextlib.contextmanager
def unsynchronized():
    """Saves inside run as Keras runs them (for callers that coordinate
    their writers themselves, e.g. :class:`tfdist.BackupAndRestore`)."""
    previous = getattr(_STATE, "off", False)
    _STATE.off = True
    try:
        yield
    finally:
        _STATE.off = previous


def _multi_worker(strategy: Any) -> tuple[bool, bool]:
    """(tfdist multi-worker strategy of >= 2 workers, this task is the chief)."""
    from tfdist.strategies import MultiWorkerMirroredStrategy
    if not isinstance(strategy, MultiWorkerMirroredStrategy):
        return False, True
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or resolver.task_type is None:
        return False, True
    spec = resolver.cluster_spec().as_dict()
    workers = len(spec.get("chief", ())) + len(spec.get("worker", ()))
    return workers > 1, bool(strategy.is_chief)


def active(model: Any = None) -> tuple[bool, bool]:
    """Whether saves of ``model`` are coordinated here, and whether this
    task is the chief: (False, True) outside a tfdist multi-worker job."""
    if getattr(_STATE, "off", False):
        return False, True
    import tensorflow as tf
    strategy = getattr(model, "_distribute_strategy", None) or tf.distribute.get_strategy()
    return _multi_worker(strategy)


def _local(path: str) -> bool:
    from keras.src.utils import file_utils
    return not (file_utils.is_remote_path(path) or path.startswith("hf://"))


# --------------------------------------------------------------------------
# Coordination: the chief publishes each save, the others wait for it.


def _next_key(path: str) -> str:
    name = os.path.basename(path.rstrip("/")) or path
    with _COUNTS_LOCK:
        count = _COUNTS.get(name, 0) + 1
        _COUNTS[name] = count
    return f"{_KEY_PREFIX}/{name}/{count}"


def _coordination():
    from tensorflow.python.eager import context
    ctx = context.context()
    return ctx if ctx.coordination_service is not None else None


def _publish(key: str, record: dict) -> None:
    ctx = _coordination()
    if ctx is not None:
        ctx.set_config_key_value(key, json.dumps(record))


def _wait(key: str, path: str, own_seconds: float) -> dict | None:
    """The chief's record for ``key``; None if it did not come in time."""
    ctx = _coordination()
    if ctx is None:
        logging.warning("tfdist: no coordination service; %s may be read before the "
                        "chief has finished writing it", path)
        return None
    import tensorflow as tf
    timeout = WAIT_SECONDS + 2 * own_seconds
    try:
        return json.loads(ctx.get_config_key_value(key, int(timeout * 1000)))
    except tf.errors.DeadlineExceededError:
        logging.warning(
            "tfdist: the chief made no save matching this worker's save of %s within "
            "%.0f s; going on without it. Call model.save (and save_weights) on every "
            "worker with the same file name, or on the chief only.", path, timeout)
    except tf.errors.OpError as error:
        # The service lives in the chief's process: the chief has exited (it
        # may be ahead: it waits for nobody). Its files are complete anyway.
        logging.warning("tfdist: cannot ask the chief about its save of %s (%s); "
                        "going on without it.", path, str(error).splitlines()[0])
    return None


# --------------------------------------------------------------------------
# Files.


def _fsync(path: str) -> None:
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) if os.path.isdir(path) else os.O_RDONLY
    try:
        fd = os.open(path, flags)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # Some filesystems refuse to fsync a directory.
    finally:
        os.close(fd)


def _sweep(directory: str) -> None:
    """Removes temporary directories of earlier saves killed on this host."""
    mark = f"{_TMP_PREFIX}{socket.gethostname()}-"
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if not name.startswith(mark):
            continue
        pid = name[len(mark):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _move_into(staging: str, name: str, directory: str) -> None:
    """Moves what a save wrote in ``staging`` into ``directory``: the files
    other than ``name`` (shards) first, ``name`` itself last."""
    entries = sorted(os.listdir(staging), key=lambda entry: entry == name)
    for entry in entries:
        source, target = os.path.join(staging, entry), os.path.join(directory, entry)
        if os.path.isdir(source) and os.path.isdir(target):
            old = os.path.join(staging, f"{entry}.old")
            os.replace(target, old)  # An unzipped model directory.
            os.replace(source, target)
            shutil.rmtree(old, ignore_errors=True)
        elif os.stat(staging).st_dev == os.stat(directory).st_dev:
            os.replace(source, target)
        else:
            tmp = os.path.join(directory, f"{_TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
            shutil.move(source, tmp)
            os.replace(tmp, target)
    _fsync(directory)


def _staged(path: str, save: Callable[[str], Any], directory: str) -> Any:
    """Runs ``save(staged_path)`` in a fresh directory inside ``directory``."""
    staging = os.path.join(directory, f"{_TMP_PREFIX}{socket.gethostname()}-"
                                      f"{os.getpid()}-{uuid.uuid4().hex}")
    os.mkdir(staging)
    name = os.path.basename(path)
    try:
        value = save(os.path.join(staging, name))
        for entry in os.listdir(staging):
            _fsync(os.path.join(staging, entry))
        _move_into(staging, name, os.path.dirname(path) or ".")
        return value
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _chief_save(path: str, save: Callable[[str], Any]) -> Any:
    key = _next_key(path)
    directory = os.path.dirname(os.path.abspath(path))
    record = {"path": os.path.abspath(path) if _local(path) else path, "ok": False}
    try:
        if _local(path) and os.path.isdir(directory):
            _sweep(directory)
            value = _staged(os.path.abspath(path), save, directory)
        else:  # Remote (object stores replace whole objects), or Keras's own error.
            value = save(path)
        record["ok"] = True
        return value
    except BaseException as error:
        record["error"] = f"{type(error).__name__}: {error}"
        raise
    finally:
        _publish(key, record)


def _worker_save(path: str, save: Callable[[str], Any]) -> Any:
    key = _next_key(path)
    if _local(path) and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        # The chief fails on this path before any collective: fail alike,
        # rather than wait in one (scratch would have let the save start).
        return save(path)
    scratch = tempfile.mkdtemp(prefix="tfdist-save-")
    try:
        started = time.monotonic()
        value = save(os.path.join(scratch, os.path.basename(path.rstrip("/"))))
        record = _wait(key, path, time.monotonic() - started)
        if record is not None and not record["ok"]:
            raise ChiefSaveError(
                f"The chief failed to save {record['path']} ({record.get('error')}); "
                f"this worker's save of {path} fails with it.")
        mine = os.path.abspath(path) if _local(path) else path
        if record is None:
            # The chief's path is unknown: write only where nothing is yet.
            own = _local(path) and not os.path.exists(mine)
        else:
            own = _local(path) and record["path"] != mine
        if own:
            # Its own path (e.g. the tutorial's workertemp_<id>/): as asked.
            _move_into(scratch, os.path.basename(path), os.path.dirname(mine))
        return value
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _coordinated(path: Any, model: Any, save: Callable[[str], Any]) -> Any:
    on, chief = active(model)
    if not on or not isinstance(path, (str, os.PathLike)):
        return save(path)  # File objects are private to the caller.
    path = os.fspath(path)
    return (_chief_save if chief else _worker_save)(path, save)


# --------------------------------------------------------------------------
# The wrapped Keras functions.


def _wrap_save_model(original):
    @functools.wraps(original)
    def save_model(model, filepath, *args, **kwargs):
        return _coordinated(filepath, model, lambda p: original(model, p, *args, **kwargs))
    return save_model


def _wrap_save_weights(original):
    @functools.wraps(original)
    def save_weights_only(model, filepath, *args, **kwargs):
        return _coordinated(filepath, model, lambda p: original(model, p, *args, **kwargs))
    return save_weights_only


def _wrap_save_h5(original):
    @functools.wraps(original)
    def save_model_to_hdf5(model, filepath, *args, **kwargs):
        return _coordinated(filepath, model, lambda p: original(model, p, *args, **kwargs))
    return save_model_to_hdf5


def _scratch_root(path: str, scratch: str) -> str:
    return os.path.join(scratch, os.path.abspath(path).lstrip(os.sep))


def _wrap_checkpoint_save(original):
    @functools.wraps(original)
    def _save_model(self, epoch, batch, logs):
        on, chief = active(self.model)
        if not on or chief or not _local(str(self.filepath)):
            return original(self, epoch, batch, logs)
        # The same save under a private root: the directories Keras creates
        # are this worker's own, and the file name (the sync key) is kept.
        filepath, scratch = self.filepath, tempfile.mkdtemp(prefix="tfdist-ckpt-")
        self.filepath = _scratch_root(os.fspath(filepath), scratch)
        try:
            return original(self, epoch, batch, logs)
        finally:
            self.filepath = filepath
            shutil.rmtree(scratch, ignore_errors=True)
    return _save_model


def _write_json(path: str, data: dict) -> None:
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, f"{_TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex}.json")
    try:
        with open(tmp, "w") as f:
            f.write(json.dumps(data))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    _fsync(directory)


def _copy_atomically(source: str, target: str) -> None:
    tmp = os.path.join(os.path.dirname(target) or ".",
                       f"{_TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
    try:
        shutil.copyfile(source, tmp)
        _fsync(tmp)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _wrap_backup_save(original):
    @functools.wraps(original)
    def _save_model(self):
        on, chief = active(self.model)
        if not on or not _local(str(self.backup_dir)):
            return original(self)
        if not chief:
            # The weight save may read on_read variables: a collective. Run
            # it under a private root: backup_dir may not exist yet (the
            # chief creates it), and the file name (the sync key) is kept.
            scratch = tempfile.mkdtemp(prefix="tfdist-backup-")
            path = _scratch_root(self._weights_path, scratch)
            os.makedirs(os.path.dirname(path))
            try:
                return self.model.save_weights(filepath=path, overwrite=True)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
        os.makedirs(self.backup_dir, exist_ok=True)
        if self.double_checkpoint:
            for path, previous in ((self._weights_path, self._prev_weights_path),
                                   (self._training_metadata_path,
                                    self._prev_training_metadata_path)):
                if os.path.exists(path):
                    _copy_atomically(path, previous)
        self.model.save_weights(filepath=self._weights_path, overwrite=True)
        from tfdist.training.fit_preemption import metadata
        _write_json(self._training_metadata_path,
                    {"epoch": self._current_epoch, "batch": self._last_batch_seen,
                     **metadata(self)})
    return _save_model


def _wrap_backup_begin(original):
    @functools.wraps(original)
    def on_train_begin(self, logs=None):
        on, chief = active(self.model)
        if not on or chief:
            return original(self, logs)
        # Keras repairs a damaged backup by copying the previous one over
        # it; that is the chief's to do. This worker reads what it reads.
        try:
            return self._load_model()
        except OSError:
            if not os.path.exists(self._prev_weights_path):
                raise
            paths = self._weights_path, self._training_metadata_path
            self._weights_path = self._prev_weights_path
            self._training_metadata_path = self._prev_training_metadata_path
            try:
                return self._load_model()
            finally:
                self._weights_path, self._training_metadata_path = paths
    return on_train_begin


def _wrap_backup_end(original):
    @functools.wraps(original)
    def on_train_end(self, logs=None):
        on, chief = active(self.model)
        if on and not chief:
            return None  # The backup is the chief's; it deletes it.
        return original(self, logs)
    return on_train_end


#: The newest tfdist multi-worker strategy of this process, for saves made
#: outside its scope (the tutorials call CheckpointManager.save there).
_JOB_STRATEGY: Callable[[], Any] = lambda: None


def set_job_strategy(strategy: Any) -> None:
    """Records ``strategy`` as this process's multi-worker strategy."""
    global _JOB_STRATEGY
    _JOB_STRATEGY = weakref.ref(strategy)


def _same_directory(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b) if _local(a) and _local(b) else a == b


def _manager_save_to_scratch(manager: Any, original: Callable, chief_dir: str,
                             args: tuple, kwargs: dict) -> str:
    """Runs ``manager``'s save into a private directory that is removed.

    The save must still run here (saving on-read variables is a collective,
    and it advances ``save_counter`` as on the chief), but the directory is
    the chief's: two writers there race (measured: "ckpt-1_temp/part-00000
    ... not found" in MergeV2Checkpoints). The manager's bookkeeping is kept
    as it was, except that its latest checkpoint is the chief's of that name.
    """
    import collections
    saved = (manager._directory, manager._checkpoint_prefix, manager._maybe_delete,
             manager._latest_checkpoint)
    scratch = tempfile.mkdtemp(prefix="tfdist-ckpt-")
    manager._directory = scratch
    manager._checkpoint_prefix = os.path.join(scratch, os.path.basename(saved[1]))
    # Its sweep must not delete the chief's older checkpoints.
    manager._maybe_delete = collections.OrderedDict()
    try:
        path = original(manager, *args, **kwargs)
    finally:
        (manager._directory, manager._checkpoint_prefix, manager._maybe_delete,
         manager._latest_checkpoint) = saved
        shutil.rmtree(scratch, ignore_errors=True)
    if path:
        path = os.path.join(chief_dir, os.path.basename(path))
        manager._latest_checkpoint = path
    return path


def _wrap_manager_save(original):
    @functools.wraps(original)
    def save(self, *args, **kwargs):
        # TensorFlow writes a checkpoint and its state file atomically, but a
        # worker that saved to its own directory (the tutorial's
        # write_filepath) may read the chief's latest_checkpoint before the
        # chief has written it: the workers wait for the chief's save of the
        # same count, as for model.save. A worker whose manager points at the
        # chief's directory (the same script on every worker) saves into a
        # private directory instead: only the chief writes there.
        strategy = _JOB_STRATEGY()
        on, chief = ((False, True) if strategy is None or getattr(_STATE, "off", False)
                     else _multi_worker(strategy))
        if not on:
            return original(self, *args, **kwargs)
        key = _next_key("tf.train.CheckpointManager.save")
        if chief:
            _publish(f"{key}/directory", {"path": str(self.directory)})
            record = {"path": str(self.directory), "ok": False}
            try:
                value = original(self, *args, **kwargs)
                record["ok"] = True
                return value
            except BaseException as error:
                record["error"] = f"{type(error).__name__}: {error}"
                raise
            finally:
                _publish(key, record)
        started = time.monotonic()
        chief_dir = _wait(f"{key}/directory", str(self.directory), 0.0)
        if chief_dir is not None and _same_directory(chief_dir["path"], str(self.directory)):
            value = _manager_save_to_scratch(self, original, chief_dir["path"], args, kwargs)
        else:
            value = original(self, *args, **kwargs)
        record = _wait(key, str(self.directory), time.monotonic() - started)
        if record is not None and not record["ok"]:
            raise ChiefSaveError(
                f"The chief failed to save a checkpoint in {record['path']} "
                f"({record.get('error')}); this worker's CheckpointManager.save fails with it.")
        return value
    return save


def install() -> None:
    """Wraps Keras's save functions and checkpoint callbacks once; idempotent.

    Raises:
        RuntimeError: This Keras lacks a function tfdist wraps (the message
            names it), or is not Keras 3.
    """
    import keras
    import tensorflow as tf
    from keras.src.callbacks.backup_and_restore import BackupAndRestore
    from keras.src.callbacks.model_checkpoint import ModelCheckpoint
    from keras.src.legacy.saving import legacy_h5_format
    from keras.src.saving import saving_lib

    from tfdist.compression.keras_hook import wrap_once

    if not keras.__version__.startswith("3."):
        raise RuntimeError(f"tfdist's multi-worker saving needs Keras 3; found Keras "
                           f"{keras.__version__}")
    wrap_once((
        (tf.train.CheckpointManager, "save", _wrap_manager_save),
        (saving_lib, "save_model", _wrap_save_model),
        (saving_lib, "save_weights_only", _wrap_save_weights),
        (legacy_h5_format, "save_model_to_hdf5", _wrap_save_h5),
        (ModelCheckpoint, "_save_model", _wrap_checkpoint_save),
        (BackupAndRestore, "_save_model", _wrap_backup_save),
        (BackupAndRestore, "on_train_begin", _wrap_backup_begin),
        (BackupAndRestore, "on_train_end", _wrap_backup_end),
    ), mark=_MARK, needed_by="tfdist's multi-worker saving")
