"""A worker of the engine preemption tests (tests/engines/test_preempt_slurm.py).

Started once per task by the engine (``srun -n2 python preempt_engine_fit.py
BACKUP_DIR PROGRESS_DIR``), with no TF_CONFIG: the strategy comes from the
environment through ``strategy_from_config()``. Fits the scripts' model for
EPOCHS epochs of STEPS_PER_EPOCH steps under tfdist's MultiWorkerMirrored with
``tfdist.BackupAndRestore(BACKUP_DIR)`` (a backup per epoch; preemption saves
come from BackupAndRestore itself). Each step sleeps a little, so that a
signal lands mid-epoch.

While it trains, each task writes its optimizer step count to
``PROGRESS_DIR/<task>.step`` (the test waits on it before it signals). At the
end it prints one 'tfdist result:' line: the first batch this run trained
(its epoch, its index in the epoch, the optimizer step count before it), the
steps it trained, the final step count, and a sha256 of the weights. A
preempted run prints no result: BackupAndRestore ends it with the preempted
exit code.
"""

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

import _common
import tfdist
from protocol import say
from tfdist.training.data import distribute_dataset

EPOCHS = 3
STEPS_PER_EPOCH = 20
PER_REPLICA_BATCH = 16
#: Seconds each step sleeps (a real step's compute; keeps a signal mid-epoch).
STEP_SLEEP = float(os.environ.get("TFDIST_TEST_STEP_SLEEP", "0.15"))

#: "mlp5.8m": the benchmarks' 256-2048-2048-512-10 MLP (5.8M parameters), to
#: measure the save time of a bigger model; default: the scripts' small MLP.
MODEL = os.environ.get("TFDIST_TEST_MODEL", "small")

backup_dir, progress_dir = sys.argv[1], Path(sys.argv[2])
strategy = tfdist.strategy_from_config(register_timeout=90)
replicas = strategy.num_replicas_in_sync
examples = STEPS_PER_EPOCH * PER_REPLICA_BATCH * replicas
if MODEL == "mlp5.8m":
    rng = np.random.default_rng(3)
    x = rng.normal(size=(examples, 256)).astype("float32")
    y = rng.integers(0, 10, size=examples).astype("int32")
else:
    x, y = _common.make_data(examples, 3)
data = distribute_dataset(
    tf.data.Dataset.from_tensor_slices((x, y)),
    strategy,
    per_replica_batch=PER_REPLICA_BATCH,
    distribute=False,
)
with strategy.scope():
    if MODEL == "mlp5.8m":
        keras.utils.set_random_seed(3)
        model = keras.Sequential(
            [keras.Input((256,))]
            + [keras.layers.Dense(units, activation="relu") for units in (2048, 2048, 512)]
            + [keras.layers.Dense(10)]
        )
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    else:
        model = _common.build_model(0.01, 3)

task = strategy.task.replace(":", "-")
progress = progress_dir / f"{task}.step"
run = {"first": None, "trained": 0, "epochs": []}


class Record(keras.callbacks.Callback):
    """Where this run started training, what it trained; the step count for
    the test. On a resume, Keras also reports the batches BackupAndRestore
    skips; only the batches that moved the optimizer count."""

    def on_epoch_begin(self, epoch, logs=None):
        run["epochs"].append(epoch)
        run["epoch"] = epoch

    def on_train_batch_begin(self, batch, logs=None):
        run["before"] = int(self.model.optimizer.iterations.numpy())

    def on_train_batch_end(self, batch, logs=None):
        step = int(self.model.optimizer.iterations.numpy())
        if step == run["before"]:
            return  # Skipped on resume: read from the data, not trained.
        run["trained"] += step - run["before"]
        if run["first"] is None:
            run["first"] = {"iterations": run["before"], "epoch": run["epoch"], "batch": batch}
        tmp = progress.with_suffix(".tmp")
        tmp.write_text(str(step))
        os.replace(tmp, progress)
        time.sleep(STEP_SLEEP)


backup = tfdist.BackupAndRestore(backup_dir)
model.fit(data, epochs=EPOCHS, verbose=0, shuffle=False, callbacks=[backup, Record()])
weights = np.concatenate([w.ravel() for w in model.get_weights()])
result = {
    "task": strategy.task,
    "replicas": replicas,
    "planned_steps": EPOCHS * STEPS_PER_EPOCH,
    "first": run["first"],
    "trained": run["trained"],
    "epochs": run["epochs"],
    "iterations": int(model.optimizer.iterations.numpy()),
    "resumed_from": backup.resumed_from,
    "restart_count": os.environ.get("SLURM_RESTART_COUNT"),
    "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
    "slurm_step_id": os.environ.get("SLURM_STEP_ID"),
    "weights_sha256": hashlib.sha256(weights.astype("<f4").tobytes()).hexdigest(),
}
say("tfdist result: " + json.dumps(result))
