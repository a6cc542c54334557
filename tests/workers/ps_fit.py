"""Parameter-server training scenarios, one per run; prints one "tfdist result:" line.

Each run is the chief of its own ``tfdist.local_cluster`` (server
subprocesses on 127.0.0.1), except ``mirrored``, which runs the same
``tfdist.fit`` call on 2 logical CPUs.

    python ps_fit.py SCENARIO WORKDIR

Scenarios: basic, partition, worker_kill, ps_kill, resume, mirrored.
"""

from __future__ import annotations

import json
import os
import sys
import time

from protocol import say

SCENARIO, WORKDIR = sys.argv[1], sys.argv[2]
STEPS, EPOCHS, BATCH = 24, 3, 32

import tfdist  # noqa: E402

if SCENARIO == "mirrored":
    strategy = tfdist.strategy_from_config(cpu_replicas=2)
    cluster = None
else:
    ps = 2 if SCENARIO == "partition" else 1
    cluster = tfdist.local_cluster(workers=2, ps=ps, log_dir=os.path.join(WORKDIR, "logs"))
    strategy = tfdist.strategy_from_config(
        cluster.tf_config, variable_partitioner="min_size:1024" if SCENARIO == "partition" else None
    )

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def data(rows=STEPS * BATCH):
    rs = np.random.RandomState(0)
    x = rs.randint(0, 64, (rows, 4)).astype("int32")
    y = ((x[:, 0] < 32) ^ (x[:, 1] < 16)).astype("int32")
    return x, y


def make_model(steps_per_execution=1):
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((4,), dtype="int32"),
                keras.layers.Embedding(64, 16),
                keras.layers.Flatten(),
                keras.layers.Dense(32, activation="relu"),
                keras.layers.Dense(2),
            ]
        )
        model.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            steps_per_execution=steps_per_execution,
        )
    return model


class Kill(keras.callbacks.Callback):
    """Kills a server at one batch; restarts it (if asked) at a later one."""

    def __init__(self, task, at, restart_at=None):
        super().__init__()
        self.task, self.at, self.restart_at = task, at, restart_at
        self.epoch, self.killed_at, self.restarted_at = 0, None, None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            cluster.kill(self.task)
            self.killed_at = time.monotonic()
        if self.restart_at is not None and (self.epoch, batch) == self.restart_at:
            self.restarted_at = time.monotonic()
            cluster.restart(self.task)


def weights_sha(model):
    import hashlib

    digest = hashlib.sha256()
    for w in model.get_weights():
        digest.update(np.ascontiguousarray(w).tobytes())
    return digest.hexdigest()


result = {"scenario": SCENARIO, "strategy": type(strategy).__name__}
x, y = data()
backup = os.path.join(WORKDIR, "backup")
try:
    # partition also runs 4 steps per scheduled function.
    model = make_model(4 if SCENARIO == "partition" else 1)
    if SCENARIO in ("basic", "mirrored"):
        x_val, y_val = data(256)
        callbacks = [
            keras.callbacks.ModelCheckpoint(os.path.join(WORKDIR, "best.keras")),
            keras.callbacks.EarlyStopping(monitor="loss", patience=10),
            keras.callbacks.TensorBoard(os.path.join(WORKDIR, "tb")),
            tfdist.BackupAndRestore(backup, delete_checkpoint=False),
        ]
        history = tfdist.fit(
            model,
            x,
            y,
            batch_size=BATCH,
            epochs=EPOCHS,
            validation_data=(x_val, y_val),
            callbacks=callbacks,
            verbose=2,
        )
        result["history"] = history.history
        result["evaluate"] = tfdist.evaluate(model, x_val, y_val, return_dict=True, verbose=0)
        reloaded = keras.models.load_model(os.path.join(WORKDIR, "best.keras"))
        result["reloaded_equal"] = weights_sha(reloaded) == weights_sha(model)
        result["tensorboard_files"] = sum(
            len(f) for _, _, f in os.walk(os.path.join(WORKDIR, "tb"))
        )
    elif SCENARIO == "partition":
        # A tf.data.Dataset: each worker reads its own copy, repeated.
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(256, seed=1).batch(BATCH)
        history = tfdist.fit(model, dataset, epochs=EPOCHS, verbose=2)
        result["history"] = history.history
        emb = model.layers[0].embeddings
        from tfdist.training.ps import patches as keras_ps

        raw = keras_ps.raw_variable(emb)
        result["sharded"] = keras_ps.is_sharded(emb)
        result["shard_devices"] = sorted({v.device for v in getattr(raw, "variables", [raw])})
        result["shard_rows"] = [int(v.shape[0]) for v in getattr(raw, "variables", [raw])]
        path = os.path.join(WORKDIR, "partitioned.keras")
        model.save(path)
        result["reloaded_equal"] = weights_sha(keras.models.load_model(path)) == weights_sha(model)
        # XLA cannot compile steps against variables on parameter servers.
        try:
            with strategy.scope():
                model.compile(optimizer="adam", loss="mse", jit_compile=True)
            result["jit_refused"] = None
        except tfdist.ConfigError as error:
            result["jit_refused"] = str(error)
    elif SCENARIO == "worker_kill":
        # TensorFlow logs when a restarted worker is back in the cluster.
        import logging

        recovered = []

        class Recovered(logging.Handler):
            def emit(self, record):
                if "Cluster successfully recovered" in record.getMessage():
                    recovered.append(time.monotonic())

        tf.get_logger().addHandler(Recovered())
        tf.get_logger().setLevel(logging.INFO)

        class WaitForRejoin(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                if epoch == 2:
                    deadline = time.monotonic() + 60
                    while not recovered and time.monotonic() < deadline:
                        time.sleep(0.2)

        # worker:1 dies in epoch 0 and comes back in epoch 1; once it is back
        # in the cluster, worker:0 dies for good in epoch 2: the job only
        # finishes if worker:1 rejoined and ran the remaining steps.
        first, second = Kill("worker:1", at=(0, 5), restart_at=(1, 5)), Kill("worker:0", at=(2, 2))

        def dataset_fn(context):  # Runs on each worker: its own shard.
            return (
                tf.data.Dataset.from_tensor_slices((x, y))
                .shard(context.num_input_pipelines, context.input_pipeline_id)
                .shuffle(256)
                .repeat()
                .batch(BATCH)
            )

        history = tfdist.fit(
            model,
            dataset_fn,
            epochs=EPOCHS,
            steps_per_epoch=STEPS,
            callbacks=[first, WaitForRejoin(), second],
            verbose=2,
            step_timeout=60,
        )
        result["history"] = history.history
        result["rejoined_after"] = recovered[0] - first.restarted_at if recovered else None
        result["iterations"] = int(model.optimizer.iterations.numpy())
        result["loss_count"] = float(model._loss_tracker.count.numpy())
        # With every worker gone, fit fails within step_timeout, not never.
        cluster.kill("worker:1")
        started = time.monotonic()
        try:
            tfdist.fit(model, x, y, batch_size=BATCH, epochs=1, verbose=0, step_timeout=10)
            result["timeout_error"] = None
        except tfdist.StepTimeoutError as error:
            result["timeout_error"] = str(error)
        result["timeout_after"] = time.monotonic() - started
        result["steps_per_epoch"] = STEPS
        result["weights_sha256"] = weights_sha(model)
        raise SystemExit(0)
    elif SCENARIO == "ps_kill":
        kill = Kill("ps:0", at=(1, 10))
        started = time.monotonic()
        try:
            tfdist.fit(
                model,
                x,
                y,
                batch_size=BATCH,
                epochs=EPOCHS,
                callbacks=[tfdist.BackupAndRestore(backup), kill],
                verbose=2,
            )
            result["error"] = None
        except tfdist.ParameterServerError as error:
            result["error"] = str(error)
            result["error_after"] = time.monotonic() - (kill.killed_at or started)
        from tfdist.training.callbacks import read_backup_pointer

        result["pointer"] = read_backup_pointer(backup)
        raise SystemExit(0)  # The ps is gone, and the variables with it.
    elif SCENARIO == "resume":
        seen = []
        record = keras.callbacks.LambdaCallback(on_epoch_begin=lambda e, logs: seen.append(e))
        history = tfdist.fit(
            model,
            x,
            y,
            batch_size=BATCH,
            epochs=EPOCHS,
            callbacks=[tfdist.BackupAndRestore(backup), record],
            verbose=2,
        )
        result["epochs_run"] = seen
        result["history"] = history.history
    result["iterations"] = int(model.optimizer.iterations.numpy())
    # Examples the loss metric counted in the last epoch (validation resets
    # it, so only runs without validation_data report it).
    result["loss_count"] = float(model._loss_tracker.count.numpy())
    result["steps_per_epoch"] = STEPS
    result["weights_sha256"] = weights_sha(model)
except SystemExit:
    pass
except BaseException:  # noqa: BLE001 - any failure is printed for the test, as below
    # Print it where the test looks, then skip TensorFlow's teardown (which
    # floods stderr with errors about the servers just stopped).
    import traceback

    print("tfdist scenario failed:\n" + traceback.format_exc(), flush=True)
    result["failed"] = True
finally:
    if cluster is not None:
        result["servers_alive"] = {t: cluster.alive(t) for t in cluster.tasks}
        result["server_pids"] = [cluster.pid(t) for t in cluster.tasks]
        cluster.stop()
if result.get("failed"):
    os._exit(1)
say("tfdist result: " + json.dumps(result, default=str))
# Skip TensorFlow's teardown: its remote-function cleanup logs errors for
# the servers that were just stopped.
sys.stdout.flush()
os._exit(0)
