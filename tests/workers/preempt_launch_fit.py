"""A worker of the launcher's end-to-end preemption tests
(tests/engines/test_preempt_launch.py), run by ``tfdist launch``.

A small MLP on fixed data (512 examples in global batches of 32: 16 batches
an epoch at any number of workers), 3 epochs, SGD with momentum and a
decaying learning rate, ``tfdist.BackupAndRestore(DIR/backup, save_freq=8)``
(which saves on preemption by itself). Each batch sleeps
``TFDIST_TEST_BATCH_SLEEP`` seconds so that signals land mid-epoch.

Usage: preempt_launch_fit.py DIR. Writes DIR/TASK-ATTEMPT.pid, then
DIR/TASK-ATTEMPT.ready once the strategy and model are built (before fit), appends
"attempt epoch batch" to DIR/progress-TASK after every batch trained (not
those skipped on resume), and when fit
ends writes DIR/result-ATTEMPT-TASK.json.
"""

import json
import os
import sys
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

import tfdist
from protocol import write_pid

out = Path(sys.argv[1])
attempt = int(os.environ["TFDIST_LAUNCH_ATTEMPT"])
pause = float(os.environ.get("TFDIST_TEST_BATCH_SLEEP", "0.1"))
config = json.loads(os.environ["TF_CONFIG"])
task = f"{config['task']['type']}-{config['task']['index']}"
size = len(config["cluster"]["worker"])
write_pid(out / f"{task}-{attempt}.pid")

strategy = tfdist.strategy_from_config(register_timeout=90)
rng = np.random.default_rng(0)
x = rng.normal(size=(512, 20)).astype("float32")
y = (x[:, :3].sum(axis=1) > 0).astype("int32")
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
with strategy.scope():
    model = keras.Sequential(
        [
            keras.Input((20,)),
            keras.layers.Dense(
                64, activation="relu", kernel_initializer=keras.initializers.GlorotUniform(1)
            ),
            keras.layers.Dense(2, kernel_initializer=keras.initializers.GlorotUniform(2)),
        ]
    )
    schedule = keras.optimizers.schedules.ExponentialDecay(0.05, 10, 0.9)
    model.compile(
        optimizer=keras.optimizers.SGD(schedule, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
backup = tfdist.BackupAndRestore(out / "backup", save_freq=8)
# In the cluster (TensorFlow's coordination service holds SIGTERM now), not
# yet in fit (where the backup's watcher takes it over).
(out / f"{task}-{attempt}.ready").write_text("")
start_iterations = []


class Progress(keras.callbacks.Callback):
    epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self.before = int(model.optimizer.iterations.numpy())
        if not start_iterations:
            start_iterations.append(self.before)

    def on_train_batch_end(self, batch, logs=None):
        if int(model.optimizer.iterations.numpy()) == self.before:
            return  # A batch skipped on resume: not trained.
        with open(out / f"progress-{task}", "a") as f:
            f.write(f"{attempt} {self.epoch} {batch}\n")
        time.sleep(pause)


model.fit(data, epochs=3, verbose=0, shuffle=False, callbacks=[Progress(), backup])
(out / f"result-{attempt}-{task}.json").write_text(
    json.dumps(
        {
            "task": task,
            "attempt": attempt,
            "size": size,
            "start_iterations": start_iterations[0] if start_iterations else None,
            "iterations": int(model.optimizer.iterations.numpy()),
            "resumed_from": backup.resumed_from,
        }
    )
)
print(f"{task} done: {int(model.optimizer.iterations.numpy())} steps", flush=True)
