"""The train_fn of the Spark tests (tests/engines/test_spark.py).

Spark pickles :func:`train` by reference, so the executors import this
module: the test session puts tests/workers and strategies/ on their
PYTHONPATH. TensorFlow is imported inside the function, so that the pytest
process (the Spark driver) does not load it.

:func:`train` fits the scripts' small model under ``ctx.strategy``, with
tfdist's BackupAndRestore when the job has a backup directory, and returns,
on the chief, what every task reported (gathered with ``ctx.all_gather``).
:func:`hang` never finishes on worker 1 (the timeout test).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path


def train(
    ctx,
    *,
    epochs: int = 3,
    pid_dir: str | None = None,
    fail_task: int | None = None,
    fail_epoch: int = 1,
    fail_once_marker: str | None = None,
) -> dict:
    """Fits the model; the chief returns every task's report.

    Args:
        ctx: The tfdist.spark.TrainContext.
        epochs: Epochs to fit.
        pid_dir: Where each task writes ``task-N.pid`` (its process id).
        fail_task: The worker that raises at the start of ``fail_epoch``.
        fail_epoch: See ``fail_task``.
        fail_once_marker: If set, ``fail_task`` fails only while this file
            does not exist, and creates it when it fails (so a retry passes).
    """
    import keras
    import numpy as np
    import tensorflow as tf

    import _common
    from tfdist.training.callbacks import BackupAndRestore
    from tfdist.training.data import distribute_dataset

    strategy = ctx.strategy
    if pid_dir:
        Path(pid_dir, f"task-{ctx.worker_index}.pid").write_text(str(os.getpid()))

    class FailOnPurpose(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if ctx.worker_index != fail_task or epoch != fail_epoch:
                return
            if fail_once_marker:
                if os.path.exists(fail_once_marker):
                    return
                Path(fail_once_marker).write_text(f"attempt {ctx.attempt}")
            raise RuntimeError(f"task {ctx.worker_index} fails on purpose at epoch {epoch}")

    epochs_run: list[int] = []

    class Record(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            epochs_run.append(epoch)

    x, y = _common.make_data(1024, 3)
    data = distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)), strategy, per_replica_batch=32, distribute=False
    )
    with strategy.scope():
        model = _common.build_model(0.01, 3)
    backup = BackupAndRestore(ctx.backup_dir) if ctx.backup_dir else None
    callbacks = [c for c in (backup, Record(), FailOnPurpose()) if c]
    history = model.fit(data, epochs=epochs, verbose=0, shuffle=False, callbacks=callbacks)

    weights = np.concatenate([w.ravel() for w in model.get_weights()])
    report = {
        "worker_index": ctx.worker_index,
        "task": strategy.task,
        "is_chief": ctx.is_chief,
        "strategy_is_chief": strategy.is_chief,
        "attempt": ctx.attempt,
        "compression": str(strategy.compression),
        "pid": os.getpid(),
        "loss": [float(v) for v in history.history["loss"]],
        "epochs_run": epochs_run,
        "resumed_from": backup.resumed_from if backup else None,
        "weights_sha256": hashlib.sha256(weights.astype("<f4").tobytes()).hexdigest(),
    }
    reports = [json.loads(r) for r in ctx.all_gather(json.dumps(report))]
    return {
        "tasks": reports,
        "strategy": type(strategy).__module__ + "." + type(strategy).__name__,
        "replicas": strategy.num_replicas_in_sync,
        "compression": str(strategy.compression),
        "description": strategy.describe(),
        "tf_config": ctx.tf_config,
        "env_TF_CONFIG": json.loads(os.environ["TF_CONFIG"]),
    }


def hang(ctx, *, pid_dir: str) -> None:
    """Worker 1 sleeps for an hour; the others wait for it at a barrier."""
    Path(pid_dir, f"task-{ctx.worker_index}.pid").write_text(str(os.getpid()))
    if ctx.worker_index == 1:
        time.sleep(3600)
    ctx.barrier()


def train_own_strategy(epochs: int = 2) -> dict:
    """spark-tensorflow-distributor's convention: no context argument, and
    train_fn makes its strategy itself, with ``tfdist.strategy_from_config()``.
    """
    import numpy as np

    import _common
    import tfdist
    import tfdist.spark

    strategy = tfdist.strategy_from_config()
    ctx = tfdist.spark.context()
    x, y = _common.make_data(512, 3)
    with strategy.scope():
        model = _common.build_model(0.01, 3)
    history = model.fit(x, y, batch_size=64, epochs=epochs, verbose=0, shuffle=False)
    weights = np.concatenate([w.ravel() for w in model.get_weights()])
    report = {
        "task": strategy.task,
        "is_ctx_strategy": strategy is ctx.strategy,
        "compression": str(strategy.compression),
        "variables_mirrored": type(model.trainable_variables[0].value).__name__,
        "loss": [float(v) for v in history.history["loss"]],
        "weights_sha256": hashlib.sha256(weights.astype("<f4").tobytes()).hexdigest(),
    }
    return [json.loads(r) for r in ctx.all_gather(json.dumps(report))]
