"""A worker of the BackupAndRestore tests (tests/training/test_callbacks.py).

Fits the scripts' model for TFDIST_TEST_EPOCHS epochs with tfdist's
BackupAndRestore in TFDIST_TEST_BACKUP_DIR (every TFDIST_TEST_SAVE_FREQ
batches, default every epoch), plus ModelCheckpoint and TensorBoard when
TFDIST_TEST_CKPT_PATH and TFDIST_TEST_TB_DIR are set, with the compression
TFDIST_TEST_COMPRESSION if set. Without TF_CONFIG it
runs alone (the SIGKILL test). With TFDIST_TEST_INTERRUPT=N, every worker
raises at the start of epoch N (the same point on both, so no peer is left
waiting in a collective). Prints one 'tfdist result:' line.
"""

import importlib.util
import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf

import _common
import tfdist
from protocol import say
from tfdist.training.callbacks import BackupAndRestore, ModelCheckpoint, TensorBoard
from tfdist.training.data import distribute_dataset

backup_dir = os.environ["TFDIST_TEST_BACKUP_DIR"]
ckpt_path = os.environ.get("TFDIST_TEST_CKPT_PATH")
tb_dir = os.environ.get("TFDIST_TEST_TB_DIR")
save_freq = os.environ.get("TFDIST_TEST_SAVE_FREQ", "epoch")
save_freq = int(save_freq) if save_freq.isdigit() else save_freq
epochs = int(os.environ.get("TFDIST_TEST_EPOCHS", "4"))
interrupt = int(os.environ.get("TFDIST_TEST_INTERRUPT", "-1"))


class Interrupt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == interrupt:
            raise RuntimeError(f"interrupted at epoch {epoch}")


strategy = tfdist.strategy_from_config(
    register_timeout=90, compression=os.environ.get("TFDIST_TEST_COMPRESSION")
)
x, y = _common.make_data(1024, 3)
data = distribute_dataset(
    tf.data.Dataset.from_tensor_slices((x, y)), strategy, per_replica_batch=32, distribute=False
)
with strategy.scope():
    model = _common.build_model(0.01, 3)

backup = BackupAndRestore(backup_dir, save_freq=save_freq)
ckpt = ModelCheckpoint(ckpt_path) if ckpt_path else None
board = TensorBoard(tb_dir, write_graph=False) if tb_dir else None
if board and importlib.util.find_spec("tensorboard") is None:
    # Without the tensorboard package tf.summary.scalar raises; the event
    # files (created with the writers, where this test looks) still appear.
    board.on_epoch_end = lambda epoch, logs=None: None
    board.on_train_batch_end = lambda batch, logs=None: None
epochs_run = []


class Record(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        epochs_run.append(epoch)


result = {
    "task": strategy.task,
    "chief": strategy.is_chief,
    "pid": os.getpid(),
    "interrupted": None,
}
try:
    history = model.fit(
        data,
        epochs=epochs,
        verbose=0,
        shuffle=False,
        callbacks=[c for c in (backup, ckpt, board, Record(), Interrupt()) if c],
    )
    result["loss"] = [float(v) for v in history.history["loss"]]
except RuntimeError as error:
    if "interrupted at epoch" not in str(error):
        raise
    result["interrupted"] = str(error)
    result["loss"] = None

weights = np.concatenate([w.ravel() for w in model.get_weights()])
result.update(
    epochs_run=epochs_run,
    resumed_from=backup.resumed_from,
    saves_written=backup.saves_written,
    saves_discarded=backup.saves_discarded,
    backup_scratch=backup.scratch_dirs,
    ckpt_scratch=ckpt and ckpt.scratch_dir,
    tb_scratch=board and board.scratch_dir,
    scratch_left=[
        p
        for p in backup.scratch_dirs + [ckpt and ckpt.scratch_dir, board and board.scratch_dir]
        if p and os.path.exists(p)
    ],
    weights=weights.tolist(),
)
say("tfdist result: " + json.dumps(result))
sys.exit(0)
