"""Keras's BackupAndRestore in a multi-worker job: the chief writes the backup.

The wrappers of its ``_save_model``, ``on_train_begin`` and ``on_train_end``
(:mod:`tfdist.compat.registry`), as :mod:`tfdist.training.saving` does for
``model.save`` and ModelCheckpoint: the chief writes atomically, with tfdist's
fields in the metadata (:func:`tfdist.training.fault_tolerance.fit_preemption.metadata`); the
other workers join the save's collectives under a private root, read what
the chief wrote, and leave its deletion to the chief.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile

from tfdist.training.chief_save import active, holds_split_weights, local
from tfdist.training.fault_tolerance.fit_preemption import metadata
from tfdist.training.saving import copy_atomically, scratch_root, write_json

__all__ = ["wrap_backup_save", "wrap_backup_begin", "wrap_backup_end"]


def wrap_backup_save(original):
    @functools.wraps(original)
    def _save_model(self):
        on, chief = active(self.model)
        if not (on or holds_split_weights(self.model)) or not local(str(self.backup_dir)):
            return original(self)
        if not chief:
            # The weight save may read on_read variables: a collective. Run
            # it under a private root: backup_dir may not exist yet (the
            # chief creates it), and the file name (the sync key) is kept.
            scratch = tempfile.mkdtemp(prefix="tfdist-backup-")
            path = scratch_root(self._weights_path, scratch)
            os.makedirs(os.path.dirname(path))
            try:
                return self.model.save_weights(filepath=path, overwrite=True)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
        os.makedirs(self.backup_dir, exist_ok=True)
        if self.double_checkpoint:
            for path, previous in (
                (self._weights_path, self._prev_weights_path),
                (self._training_metadata_path, self._prev_training_metadata_path),
            ):
                if os.path.exists(path):
                    copy_atomically(path, previous)
        self.model.save_weights(filepath=self._weights_path, overwrite=True)
        write_json(
            self._training_metadata_path,
            {"epoch": self._current_epoch, "batch": self._last_batch_seen, **metadata(self)},
        )

    return _save_model


def wrap_backup_begin(original):
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


def wrap_backup_end(original):
    @functools.wraps(original)
    def on_train_end(self, logs=None):
        on, chief = active(self.model)
        if on and not chief:
            return None  # The backup is the chief's; it deletes it.
        return original(self, logs)

    return on_train_end
