"""Keras's own ``BackupAndRestore`` in a multi-worker job: one backup that
every task resumes from, whether ``backup_dir`` is shared or one per task.

Under a tfdist multi-worker strategy only the chief writes Keras's backup;
the other workers run the save into a scratch directory
(:mod:`tfdist.training.saving`). With one ``backup_dir`` per task (hosts
without a shared filesystem, or ``f"/backup/task{index}"``) the other
tasks' directories then stayed empty, and after a restart the chief resumed
while the others started over (measured: worker 0 at epoch 2, worker 1 at
epoch 0, then "Socket closed" in worker 1's next collective). At the start
of ``fit`` :func:`decide` settles, on every task, before anything is loaded:

* **Who writes where.** Every task puts a probe file in its ``backup_dir``
  and the tasks exchange the probes' names (:mod:`tfdist.training.fault_tolerance.task_exchange`).
  The tasks whose probes a directory shows share it; the first of them
  writes there (the chief in its own), the others save into scratch. So
  a shared directory has one writer, and a directory of its own is written
  by its task (:func:`save_own`, atomically, with the sha256 of the weights
  in the metadata).
* **Where to resume.** Every task reports the points (epoch, batch) of the
  backups it can restore: its latest, and the previous one with
  ``double_checkpoint``; a weights file that does not match the sha256 its
  metadata recorded does not count. :func:`tfdist.training.fault_tolerance.backup_agreement.agree`
  picks the newest point every task holds, or every task fails at once,
  naming what each holds. A task that resumes from its previous backup
  makes it its latest again, as Keras does after a damaged save.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tfdist.compat import keras_private
from tfdist.training.callbacks.files import sha256
from tfdist.training.fault_tolerance import backup_agreement, task_exchange

__all__ = [
    "PROBE_PREFIX",
    "Decision",
    "decide",
    "held",
    "loading",
    "roll_back",
    "save_own",
    "weights_digest",
]

PROBE_PREFIX = ".tfdist-probe-"
_TMP_PREFIX = ".tfdist-save-"


@dataclass(frozen=True)
class Decision:
    """What :func:`decide` settled for this task.

    Attributes:
        point: The agreed (epoch, batch), or None for a fresh start.
        slot: This task's backup holding it: ``"latest"``, ``"previous"``
            or None.
        writes: This task writes its ``backup_dir`` (first of the tasks
            that share it).
    """

    point: backup_agreement.Point | None
    slot: str | None
    writes: bool


def _slots(callback: Any) -> dict[str, tuple[str, str]]:
    return {
        "latest": keras_private.backup_paths(callback),
        "previous": keras_private.previous_backup_paths(callback),
    }


def weights_digest(path: str) -> dict:
    """The fields that tie a metadata file to the weights file it describes."""
    return {"tfdist_weights_sha256": sha256(path), "tfdist_weights_size": os.path.getsize(path)}


def _point(weights: str, metadata: str) -> backup_agreement.Point | None:
    """The point of one backup, or None if it cannot be restored."""
    try:
        with open(metadata) as f:
            meta = json.load(f)
        if not os.path.exists(weights):
            return None
        if "tfdist_weights_sha256" in meta and (
            os.path.getsize(weights) != meta.get("tfdist_weights_size")
            or sha256(weights) != meta["tfdist_weights_sha256"]
        ):
            return None  # Torn: weights of one save, metadata of another.
        return int(meta["epoch"]), int(meta.get("tfdist_batches_done") or 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def held(callback: Any) -> dict[str, backup_agreement.Point]:
    """Slot -> point of each backup this task can restore (latest first)."""
    found = {}
    for slot, (weights, metadata) in _slots(callback).items():
        if slot == "previous" and not getattr(callback, "double_checkpoint", False):
            continue
        point = _point(weights, metadata)
        if point is not None:
            found[slot] = point
    return found


def decide(callback: Any, strategy: Any) -> Decision:
    """Settles, with every other training task, who writes which directory
    and where the job resumes. Call it on every task at the start of ``fit``.

    Raises:
        tfdist.training.fault_tolerance.backup_agreement.BackupDisagreementError: No point
            is held by every task (the same error on every task).
        tfdist.training.fault_tolerance.task_exchange.ExchangeError: A task did not report.
    """
    names, index = task_exchange.trainers(strategy)
    directory = os.path.abspath(str(callback.backup_dir))
    os.makedirs(directory, exist_ok=True)
    probe = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
    with open(os.path.join(directory, probe), "w"):
        pass
    try:
        mine = held(callback)
        records = task_exchange.exchange(
            strategy,
            "keras-backup",
            {
                "dir": directory,
                "host": socket.gethostname(),
                "probe": probe,
                "held": {slot: list(point) for slot, point in mine.items()},
            },
        )
        sharing = [
            i for i, r in enumerate(records) if os.path.exists(os.path.join(directory, r["probe"]))
        ]
        # Nobody removes its probe before every task has looked.
        task_exchange.exchange(strategy, "keras-backup-looked", {})
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(directory, probe))
    writes = min(sharing, default=index) == index
    if writes:
        _sweep_probes(directory, keep={r["probe"] for r in records})
    point = backup_agreement.agree(
        {names[i]: [tuple(p) for p in r["held"].values()] for i, r in enumerate(records)},
        where={names[i]: f"{r['dir']} on {r['host']}" for i, r in enumerate(records)},
    )
    slot = next((s for s, p in mine.items() if p == point), None)
    return Decision(point, slot, writes)


def _sweep_probes(directory: str, keep: set[str]) -> None:
    """Removes probes of earlier runs killed during :func:`decide` (not
    this run's: their tasks remove them)."""
    for name in os.listdir(directory):
        if name.startswith(PROBE_PREFIX) and name not in keep:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(directory, name))


@contextlib.contextmanager
def loading(callback: Any, slot: str) -> Iterator[None]:
    """Keras's load reads ``slot``'s files meanwhile. (Keras loads weights
    only from a ``.weights.h5`` name: the previous backup's are copied to
    one in a private directory, leaving ``backup_dir`` to its writer.)"""
    saved = keras_private.backup_paths(callback)
    weights, metadata = _slots(callback)[slot]
    scratch = None
    if slot == "previous":
        scratch = tempfile.mkdtemp(prefix="tfdist-backup-load-")
        shutil.copyfile(weights, os.path.join(scratch, os.path.basename(saved[0])))
        weights = os.path.join(scratch, os.path.basename(saved[0]))
    keras_private.set_backup_paths(callback, weights, metadata)  # Keras loads from the slot.
    try:
        yield
    finally:
        keras_private.set_backup_paths(callback, *saved)  # Its own paths, put back.
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def _atomic_file(target: str, suffix: str = "") -> Iterator[str]:
    """Yields a temporary path beside ``target``; once written, it is synced
    and renamed over ``target``, so a kill leaves the old file or the new
    one, never half of one. (``suffix``: Keras saves weights only to a
    ``.weights.h5`` name.)"""
    tmp = os.path.join(
        os.path.dirname(target), f"{_TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex}{suffix}"
    )
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _replace_with_copy(source: str, target: str) -> None:
    with _atomic_file(target) as tmp:
        shutil.copyfile(source, tmp)


def roll_back(callback: Any) -> None:
    """Makes the previous backup the latest again (the job resumed from it):
    the latest one is of a point the job abandoned."""
    (weights, metadata), (prev_weights, prev_metadata) = _slots(callback).values()
    with contextlib.suppress(FileNotFoundError):
        os.remove(metadata)  # A kill below leaves the previous backup alone valid.
    _replace_with_copy(prev_weights, weights)
    _replace_with_copy(prev_metadata, metadata)


def save_own(callback: Any, metadata: dict) -> None:
    """A non-chief task's save into the ``backup_dir`` it writes: the same
    weight save as every worker's (a collective for on-read variables),
    into a temporary file renamed into place, then the metadata.

    Args:
        callback: Keras's BackupAndRestore.
        metadata: tfdist's fields for the metadata (the weights' digest is
            added here).
    """
    from tfdist.training import saving as keras_saving
    from tfdist.training.chief_save import next_key

    directory = str(callback.backup_dir)
    os.makedirs(directory, exist_ok=True)
    weights, meta_path = keras_private.backup_paths(callback)
    if getattr(callback, "double_checkpoint", False):
        for path, previous in zip(
            (weights, meta_path), keras_private.previous_backup_paths(callback)
        ):
            if os.path.exists(path):
                _replace_with_copy(path, previous)
    with _atomic_file(weights, suffix=".weights.h5") as tmp:
        with keras_saving.unsynchronized():  # Its own file: nobody to wait for.
            callback.model.save_weights(filepath=tmp, overwrite=True)
        # The chief's coordinated save of this name counted one more.
        next_key(weights)
    epoch, batch = keras_private.backup_position(callback)
    keras_saving.write_json(
        meta_path,
        {
            "epoch": epoch,
            "batch": batch,
            **metadata,
            **weights_digest(weights),
        },
    )
