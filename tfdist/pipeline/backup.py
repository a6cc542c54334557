"""Keras's BackupAndRestore under a pipeline: stage 0 writes the backup.

Every stage runs the user's callbacks, so every stage's BackupAndRestore
saves at the same batches, which keeps ``save_weights`` (a collective: each
stage writes its part of the weights file, which stage 0 joins, and its
optimizer state beside it) in step. The other files are stage 0's alone: on
the other stages, once the callback has restored from the shared backup at
the start of ``fit``, its position file, the previous backup's copy and the
deletion at the end go to a scratch folder of that stage, so that no two
processes write one file.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

import keras

from tfdist.compat.keras_private import backup_paths, set_backup_paths

__all__ = ["stage_callbacks"]


class _ScratchWrites(keras.callbacks.Callback):
    """Runs after ``backup`` at the start of fit: its later writes go to a
    scratch folder (removed at the end); its restore already happened."""

    def __init__(self, backup: keras.callbacks.BackupAndRestore, stage: int) -> None:
        super().__init__()
        self.backup = backup
        self.stage = stage
        self.scratch: str | None = None

    def on_train_begin(self, logs: Any = None) -> None:
        self.scratch = tempfile.mkdtemp(prefix=f"tfdist-pipeline-stage{self.stage}-")
        self.backup.backup_dir = self.scratch
        self.backup.double_checkpoint = False  # Its copy would be of the shared files.
        weights, _ = backup_paths(self.backup)  # Shared: save_weights is a collective.
        set_backup_paths(self.backup, weights, os.path.join(self.scratch, "training_metadata.json"))

    def on_train_end(self, logs: Any = None) -> None:
        if self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)


def stage_callbacks(callbacks: Sequence[Any] | None, stage: int) -> list[Any] | None:
    """The callbacks a stage's ``fit`` runs: the user's, and after each
    BackupAndRestore of a stage other than 0, its scratch redirection."""
    if callbacks is None or stage == 0:
        return None if callbacks is None else list(callbacks)
    out: list[Any] = []
    for callback in callbacks:
        out.append(callback)
        if isinstance(callback, keras.callbacks.BackupAndRestore):
            out.append(_ScratchWrites(callback, stage))
    return out
