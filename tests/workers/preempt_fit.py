"""A worker of the preemption tests (tests/training/test_preempt_fit.py).

Fits a small MLP on fixed data (no shuffle, no random ops: a resumed run can
match an uninterrupted one exactly) for TFDIST_TEST_EPOCHS epochs of 16
batches, with a BackupAndRestore in TFDIST_TEST_BACKUP_DIR:

* TFDIST_TEST_CALLBACK=tfdist (default) or keras: tfdist's or Keras's own;
* TFDIST_TEST_COMPRESSION: the strategy's compression;
* TFDIST_TEST_PROGRESS: a file this worker appends "epoch batch" to after
  every batch (the test signals when it sees a batch there);
* TFDIST_TEST_BATCH_SLEEP: seconds each batch sleeps (so signals land
  mid-epoch);
* TFDIST_TEST_SIGNAL_IN_SAVE=N: the process SIGTERMs itself while its Nth
  backup is being written; TFDIST_TEST_KILL_IN_SAVE=N: it SIGKILLs itself
  inside its Nth save, after the weights file was written but before it
  was renamed and the pointer moved; TFDIST_TEST_SELF_SIGNAL="E B": it
  SIGTERMs itself after batch B of epoch E.

Prints one 'tfdist result:' line when fit ends; a preemption ends the
process with tfdist's preempted exit code (143) instead.
"""

import json
import os
import signal
import sys
import time

import keras
import numpy as np
import tensorflow as tf

import tfdist
from protocol import say

backup_dir = os.environ["TFDIST_TEST_BACKUP_DIR"]
epochs = int(os.environ.get("TFDIST_TEST_EPOCHS", "3"))
progress = os.environ.get("TFDIST_TEST_PROGRESS")
pause = float(os.environ.get("TFDIST_TEST_BATCH_SLEEP", "0"))
which = os.environ.get("TFDIST_TEST_CALLBACK", "tfdist")

strategy = tfdist.strategy_from_config(
    register_timeout=90, compression=os.environ.get("TFDIST_TEST_COMPRESSION")
)
rng = np.random.default_rng(0)
x = rng.normal(size=(512, 20)).astype("float32")
y = (x[:, :3].sum(axis=1) > 0).astype("int32")
global_batch = 32
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)
glorot = keras.initializers.GlorotUniform
with strategy.scope():
    model = keras.Sequential(
        [
            keras.Input((20,)),
            keras.layers.Dense(64, activation="relu", kernel_initializer=glorot(1)),
            keras.layers.Dense(2, kernel_initializer=glorot(2)),
        ]
    )
    schedule = keras.optimizers.schedules.ExponentialDecay(0.05, 10, 0.9)
    model.compile(
        optimizer=keras.optimizers.SGD(schedule, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )

signal_in_save = int(os.environ.get("TFDIST_TEST_SIGNAL_IN_SAVE", "0"))
kill_in_save = int(os.environ.get("TFDIST_TEST_KILL_IN_SAVE", "0"))
self_signal = tuple(map(int, os.environ.get("TFDIST_TEST_SELF_SIGNAL", "-1 -1").split()))
if signal_in_save or kill_in_save:
    original_save, saves = model.save_weights, []

    def save_weights(path, *args, **kwargs):
        saves.append(path)
        if len(saves) == signal_in_save:
            os.kill(os.getpid(), signal.SIGTERM)
        result = original_save(path, *args, **kwargs)
        if len(saves) == kill_in_save:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    model.save_weights = save_weights

if which == "keras":
    backup = keras.callbacks.BackupAndRestore(backup_dir, save_freq=8)
else:
    backup = tfdist.BackupAndRestore(backup_dir, save_freq=8)


class Progress(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if progress:
            with open(progress, "a") as f:
                f.write(f"{self.epoch} {batch}\n")
        if (self.epoch, batch) == self_signal:
            os.kill(os.getpid(), signal.SIGTERM)
        if pause:
            time.sleep(pause)


start_iterations = None


class First(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        global start_iterations
        if start_iterations is None:
            start_iterations = int(model.optimizer.iterations.numpy())


history = model.fit(
    data, epochs=epochs, verbose=0, shuffle=False, callbacks=[Progress(), First(), backup]
)
weights = np.concatenate([w.ravel() for w in model.get_weights()])
result = {
    "task": strategy.task if hasattr(strategy, "task") else None,
    "iterations": int(model.optimizer.iterations.numpy()),
    "start_iterations": start_iterations,
    "resumed_from": getattr(backup, "resumed_from", None),
    "weights": weights.tolist(),
}
say("tfdist result: " + json.dumps(result))
sys.exit(0)
