"""Keras 3 callbacks that are safe under multi-worker training, one family per module.

Keras's own callbacks assume one process writes. Under a multi-worker
``MultiWorkerMirroredStrategy`` every worker runs them, so they race on the
same files (Keras 3's ``BackupAndRestore`` on a shared directory failed 3 runs
out of 3 here: a ``makedirs`` race or an HDF5 lock). The callbacks here write
from the chief only:

* :mod:`~tfdist.training.callbacks.backup`: :class:`BackupAndRestore`, fault-tolerant
  training state with a checked pointer, a mid-epoch resume and the workers'
  agreement on the backup (its files: :mod:`~tfdist.training.callbacks.files`);
* :mod:`~tfdist.training.callbacks.writers`: :class:`ModelCheckpoint` and
  :class:`TensorBoard`, Keras's, with the other workers writing into a scratch
  directory that is removed (:mod:`~tfdist.training.callbacks.workers`);
* :mod:`~tfdist.training.callbacks.learning_rate`: :class:`LearningRateWarmup`
  and :func:`scale_learning_rate`.

Under tfdist's own MultiWorkerMirrored strategy Keras's ModelCheckpoint,
BackupAndRestore and ``model.save`` are made safe too
(:mod:`tfdist.training.saving`); these classes also work under TensorFlow's
strategies.

Non-chief workers still *run* every save into a scratch directory. Under
MultiWorkerMirrored, saving a ``synchronization="on_read"`` variable (tfdist's
error-feedback state; Keras 3 does not save its metric variables) reads it
with an all-reduce across workers, and loading one broadcasts. A worker that
skipped the save leaves the others in a collective it never joins: measured
with top-k compression on 2 workers, the next training step then failed with
"Shape mismatch in the collective instance".
"""

from __future__ import annotations

from tfdist.training.callbacks.backup import BackupAndRestore
from tfdist.training.callbacks.files import BackupError, read_backup_pointer
from tfdist.training.callbacks.learning_rate import LearningRateWarmup, scale_learning_rate
from tfdist.training.callbacks.workers import is_chief, num_workers
from tfdist.training.callbacks.writers import (
    ModelCheckpoint,
    TensorBoard,
    TensorBoardNotInstalledError,
)

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
