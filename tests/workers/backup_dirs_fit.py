"""A worker of tests/training/test_backup_agreement.py: Keras's own
``keras.callbacks.BackupAndRestore`` with one backup directory per task (as
on hosts without a shared filesystem), under ``tfdist launch`` or plain
TF_CONFIG processes.

Usage: backup_dirs_fit.py DIR. The backup goes to DIR/task<index>
(``save_freq="epoch"``, ``double_checkpoint`` and ``delete_checkpoint`` from
TFDIST_TEST_DOUBLE / TFDIST_TEST_DELETE, "1" or "0"). Fits a small MLP on
fixed data for TFDIST_TEST_EPOCHS epochs (default 4) of 8 batches, sleeping
TFDIST_TEST_BATCH_SLEEP seconds a batch. Writes DIR/TASK-ATTEMPT.pid, appends
"attempt epoch batch" to DIR/progress-TASK after every batch, and when fit
ends prints one 'tfdist result:' line and writes DIR/result-ATTEMPT-TASK.json.
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
from protocol import say, write_pid

out = Path(sys.argv[1])
attempt = int(os.environ.get("TFDIST_LAUNCH_ATTEMPT", "0"))
pause = float(os.environ.get("TFDIST_TEST_BATCH_SLEEP", "0"))
epochs = int(os.environ.get("TFDIST_TEST_EPOCHS", "4"))
config = json.loads(os.environ["TF_CONFIG"])
index = int(config["task"]["index"])
task = f"{config['task']['type']}-{index}"
write_pid(out / f"{task}-{attempt}.pid")

strategy = tfdist.strategy_from_config(register_timeout=90)
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 20)).astype("float32")
y = (x[:, :3].sum(axis=1) > 0).astype("int32")
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
with strategy.scope():
    model = keras.Sequential(
        [
            keras.Input((20,)),
            keras.layers.Dense(
                16, activation="relu", kernel_initializer=keras.initializers.GlorotUniform(1)
            ),
            keras.layers.Dense(2, kernel_initializer=keras.initializers.GlorotUniform(2)),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
backup = keras.callbacks.BackupAndRestore(
    str(out / f"task{index}"),
    save_freq="epoch",
    double_checkpoint=os.environ.get("TFDIST_TEST_DOUBLE", "0") == "1",
    delete_checkpoint=os.environ.get("TFDIST_TEST_DELETE", "1") == "1",
)
epochs_run = []


class Progress(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        epochs_run.append(epoch)

    def on_train_batch_end(self, batch, logs=None):
        with open(out / f"progress-{task}", "a") as f:
            f.write(f"{attempt} {epochs_run[-1]} {batch}\n")
        time.sleep(pause)


model.fit(data, epochs=epochs, verbose=0, shuffle=False, callbacks=[backup, Progress()])
result = {
    "task": task,
    "attempt": attempt,
    "epochs_run": epochs_run,
    "iterations": int(model.optimizer.iterations.numpy()),
    "weights": np.concatenate([w.ravel() for w in model.get_weights()]).tolist(),
}
(out / f"result-{attempt}-{task}.json").write_text(json.dumps(result))
say("tfdist result: " + json.dumps(result))
