""":class:`ModelCheckpoint` and :class:`TensorBoard`: Keras's, written by the chief only.

The other workers write into a scratch directory that is removed.
"""

from __future__ import annotations

import os
from typing import Any

import keras

from tfdist.errors import TfdistError
from tfdist.training.callbacks.workers import drop_scratch, is_chief, make_scratch, model_strategy

# --------------------------------------------------------------------------
# ModelCheckpoint and TensorBoard: chief writes, others write to scratch.


class ModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """``keras.callbacks.ModelCheckpoint`` that only the chief writes.

    Non-chief workers still save (a save reads on-read variables, which is
    a collective under MultiWorkerMirrored), into a temporary directory that
    is removed when ``fit`` ends, or at process exit if it does not. Under
    tfdist's MultiWorkerMirrored strategy Keras's own ModelCheckpoint does
    the same (:mod:`tfdist.training.saving`); this class also does it under
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
        drop_scratch(self.scratch_dir)
        self.scratch_dir = None
        self.filepath = self.chief_filepath
        if not is_chief(model_strategy(self.model)):
            self.scratch_dir = make_scratch("tfdist-ckpt-")
            self.filepath = os.path.join(self.scratch_dir, os.path.basename(self.chief_filepath))
        super().on_train_begin(logs)

    def on_train_end(self, logs: dict | None = None) -> None:
        super().on_train_end(logs)
        drop_scratch(self.scratch_dir)
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
                f"{self.INSTALL_HINT}",
                name="tensorboard",
            ) from error
        super().__init__(log_dir, **kwargs)
        self.chief_log_dir = self.log_dir
        self.scratch_dir: str | None = None

    def set_model(self, model: Any) -> None:
        # Keras derives the writers' directories from log_dir here.
        drop_scratch(self.scratch_dir)
        self.scratch_dir = None
        self.log_dir = self.chief_log_dir
        if not is_chief(model_strategy(model)):
            self.scratch_dir = make_scratch("tfdist-tensorboard-")
            self.log_dir = self.scratch_dir
        super().set_model(model)

    def on_train_end(self, logs: dict | None = None) -> None:
        super().on_train_end(logs)  # Closes the writers first.
        drop_scratch(self.scratch_dir)
        self.log_dir = self.chief_log_dir
