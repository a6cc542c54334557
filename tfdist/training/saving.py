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

One process alone saving a model with split weights (tensor parallelism,
``keras.distribution.ModelParallel``) writes atomically as the chief does, its
``BackupAndRestore`` too: such saves are large, and a save killed midway
must leave the previous file whole. Other single-worker training, and every
other strategy, are unchanged.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any

from tfdist.compat import tf_private
from tfdist.training.atomic import fsync, replacing
from tfdist.training.chief_save import (
    STATE,
    TMP_PREFIX,
    WAIT_SECONDS,
    ChiefSaveError,
    active,
    coordinated,
    local,
    multi_worker,
    next_key,
    publish,
    publishing,
    unsynchronized,
    wait,
)

__all__ = [
    "ChiefSaveError",
    "install",
    "active",
    "unsynchronized",
    "WAIT_SECONDS",
    "wrap_save_model",
    "wrap_save_weights",
    "wrap_save_h5",
    "wrap_checkpoint_save",
    "wrap_manager_save",
    "write_json",
    "copy_atomically",
    "scratch_root",
]


# --------------------------------------------------------------------------
# The wrapped Keras functions.


def wrap_save_model(original):
    @functools.wraps(original)
    def save_model(model, filepath, *args, **kwargs):
        return coordinated(filepath, model, lambda p: original(model, p, *args, **kwargs))

    return save_model


def wrap_save_weights(original):
    @functools.wraps(original)
    def save_weights_only(model, filepath, *args, **kwargs):
        return coordinated(filepath, model, lambda p: original(model, p, *args, **kwargs))

    return save_weights_only


def wrap_save_h5(original):
    @functools.wraps(original)
    def save_model_to_hdf5(model, filepath, *args, **kwargs):
        return coordinated(filepath, model, lambda p: original(model, p, *args, **kwargs))

    return save_model_to_hdf5


def scratch_root(path: str, scratch: str) -> str:
    """``path`` re-rooted under the directory ``scratch``."""
    return os.path.join(scratch, os.path.abspath(path).lstrip(os.sep))


def wrap_checkpoint_save(original):
    @functools.wraps(original)
    def _save_model(self, epoch, batch, logs):
        on, chief = active(self.model)
        if not on or chief or not local(str(self.filepath)):
            return original(self, epoch, batch, logs)
        # The same save under a private root: the directories Keras creates
        # are this worker's own, and the file name (the sync key) is kept.
        filepath, scratch = self.filepath, tempfile.mkdtemp(prefix="tfdist-ckpt-")
        self.filepath = scratch_root(os.fspath(filepath), scratch)
        try:
            return original(self, epoch, batch, logs)
        finally:
            self.filepath = filepath
            shutil.rmtree(scratch, ignore_errors=True)

    return _save_model


def write_json(path: str, data: dict) -> None:
    """Writes ``data`` to ``path`` as JSON through a temporary file and a rename."""
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, f"{TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex}.json")
    with replacing(path, tmp, open(tmp, "w")) as f:
        f.write(json.dumps(data))
    fsync(directory)


def copy_atomically(source: str, target: str) -> None:
    """Copies ``source`` over ``target`` through a temporary file and a rename."""
    tmp = os.path.join(
        os.path.dirname(target) or ".", f"{TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
    )
    try:
        shutil.copyfile(source, tmp)
        fsync(tmp)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


#: The newest tfdist multi-worker strategy of this process, for saves made
#: outside its scope (the tutorials call CheckpointManager.save there).
_JOB_STRATEGY: Callable[[], Any] = lambda: None  # noqa: E731 - stands in for the weakref.ref that set_job_strategy stores


def set_job_strategy(strategy: Any) -> None:
    """Records ``strategy`` as this process's multi-worker strategy."""
    global _JOB_STRATEGY
    _JOB_STRATEGY = weakref.ref(strategy)


def _same_directory(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b) if local(a) and local(b) else a == b


def _manager_save_to_scratch(
    manager: Any, original: Callable, chief_dir: str, args: tuple, kwargs: dict
) -> str:
    """Runs ``manager``'s save into a private directory that is removed.

    The save must still run here (saving on-read variables is a collective,
    and it advances ``save_counter`` as on the chief), but the directory is
    the chief's: two writers there race (measured: "ckpt-1_temp/part-00000
    ... not found" in MergeV2Checkpoints). The manager's bookkeeping is kept
    as it was, except that its latest checkpoint is the chief's of that name.
    """
    scratch = tempfile.mkdtemp(prefix="tfdist-ckpt-")
    try:
        with tf_private.manager_saving_to(manager, scratch):
            path = original(manager, *args, **kwargs)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if path:
        path = os.path.join(chief_dir, os.path.basename(path))
        tf_private.set_latest_checkpoint(manager, path)  # The chief's file.
    return path


def wrap_manager_save(original):
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
        on, chief = (
            (False, True)
            if strategy is None or getattr(STATE, "off", False)
            else multi_worker(strategy)
        )
        if not on:
            return original(self, *args, **kwargs)
        key = next_key("tf.train.CheckpointManager.save")
        if chief:
            publish(f"{key}/directory", {"path": str(self.directory)})
            with publishing(key, {"path": str(self.directory)}):
                return original(self, *args, **kwargs)
        started = time.monotonic()
        chief_dir = wait(f"{key}/directory", str(self.directory), 0.0)
        if chief_dir is not None and _same_directory(chief_dir["path"], str(self.directory)):
            value = _manager_save_to_scratch(self, original, chief_dir["path"], args, kwargs)
        else:
            value = original(self, *args, **kwargs)
        record = wait(key, str(self.directory), time.monotonic() - started)
        if record is not None and not record["ok"]:
            raise ChiefSaveError(
                f"The chief failed to save a checkpoint in {record['path']} "
                f"({record.get('error')}); this worker's CheckpointManager.save fails with it."
            )
        return value

    return save


def install() -> None:
    """Wraps Keras's save functions and checkpoint callbacks once (the
    registry's ``saving``); idempotent.

    Raises:
        tfdist.compat.PatchError: This Keras lacks a function tfdist wraps,
            or its signature changed (the message names it).
    """
    from tfdist import compat

    compat.install("saving")
