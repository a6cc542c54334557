"""The train_fn of the Spark preemption test (tests/engines/test_preempt_spark.py).

Spark pickles :func:`train` by reference; the executors import this module
(tests/workers is on their PYTHONPATH). TensorFlow is imported inside the
function, so that the driver (the pytest process) does not load it.

:func:`train` fits the scripts' model for 3 epochs of 20 steps under
``ctx.strategy`` with ``tfdist.BackupAndRestore(ctx.backup_dir)``. Each task
writes its process id to ``PID_DIR/task-N.pid`` and, after every step it
trains, its optimizer step count to ``PID_DIR/attempt-A/task-N.step`` (the
test signals a task once the chief is mid-epoch). The chief returns every
task's report: the first batch this attempt trained (epoch, index in the
epoch, step count before it, time), the steps it trained, the final step
count, the backup it resumed from and a sha256 of the weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

EPOCHS = 3
STEPS_PER_EPOCH = 20
PER_REPLICA_BATCH = 16


def train(ctx, *, pid_dir: str, step_sleep: float = 0.15) -> dict:
    import keras
    import numpy as np
    import tensorflow as tf

    import _common
    import tfdist
    from tfdist.training.data import distribute_dataset

    strategy = ctx.strategy
    Path(pid_dir, f"task-{ctx.worker_index}.pid").write_text(str(os.getpid()))
    progress_dir = Path(pid_dir, f"attempt-{ctx.attempt}")
    progress_dir.mkdir(exist_ok=True)
    progress = progress_dir / f"task-{ctx.worker_index}.step"
    x, y = _common.make_data(STEPS_PER_EPOCH * PER_REPLICA_BATCH * ctx.num_workers, 3)
    data = distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)),
        strategy,
        per_replica_batch=PER_REPLICA_BATCH,
        distribute=False,
    )
    with strategy.scope():
        model = _common.build_model(0.01, 3)
    run = {"first": None, "trained": 0, "epoch": 0}

    class Record(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            run["epoch"] = epoch

        def on_train_batch_begin(self, batch, logs=None):
            run["before"] = int(self.model.optimizer.iterations.numpy())

        def on_train_batch_end(self, batch, logs=None):
            step = int(self.model.optimizer.iterations.numpy())
            if step == run["before"]:
                return  # Skipped on resume: read from the data, not trained.
            run["trained"] += step - run["before"]
            if run["first"] is None:
                run["first"] = {
                    "iterations": run["before"],
                    "epoch": run["epoch"],
                    "batch": batch,
                    "time": time.time(),
                }
            tmp = progress.with_suffix(".tmp")
            tmp.write_text(str(step))
            os.replace(tmp, progress)
            time.sleep(step_sleep)

    backup = tfdist.BackupAndRestore(ctx.backup_dir)
    model.fit(data, epochs=EPOCHS, verbose=0, shuffle=False, callbacks=[backup, Record()])
    weights = np.concatenate([w.ravel() for w in model.get_weights()])
    report = {
        "worker_index": ctx.worker_index,
        "attempt": ctx.attempt,
        "planned_steps": EPOCHS * STEPS_PER_EPOCH,
        "first": run["first"],
        "trained": run["trained"],
        "iterations": int(model.optimizer.iterations.numpy()),
        "resumed_from": backup.resumed_from,
        "weights_sha256": hashlib.sha256(weights.astype("<f4").tobytes()).hexdigest(),
    }
    return [json.loads(r) for r in ctx.all_gather(json.dumps(report))]
