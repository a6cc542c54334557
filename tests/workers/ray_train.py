"""Ray Train's TensorflowTrainer running a Keras fit through tfdist.

    python ray_train.py STORAGE COMPRESSION

A local Ray cluster (2 CPUs) runs 2 workers; Ray writes each one's
TF_CONFIG, and ``train_loop_per_worker`` calls ``tfdist.strategy_from_config``
with the compression passed through the train-loop config. Each epoch
reports the loss and a checkpoint through ``ray.train.report``. Worker 1
kills itself once, after epoch 1's checkpoint is committed;
``FailureConfig(max_failures=1)`` restarts the group, which resumes from
``ray.train.get_checkpoint()`` at epoch 2.
Prints one "tfdist result:" line.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile

from protocol import say

STORAGE, COMPRESSION = sys.argv[1], sys.argv[2]
# A one-machine Ray on the loopback. Ray's workers otherwise take the address
# of the host's outgoing interface, for themselves and for the TF_CONFIG that
# TensorflowTrainer writes (ray._private.services.get_node_ip_address); this
# switch makes them answer 127.0.0.1. The workers inherit it.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
EPOCHS = 4


def train_loop_per_worker(config):
    import keras
    import numpy as np
    import ray.train
    import tensorflow as tf

    import tfdist

    strategy = tfdist.strategy_from_config(compression=config["compression"], register_timeout=90)
    rank = ray.train.get_context().get_world_rank()
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(2)]
        )
        model.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as folder:
            model.load_weights(os.path.join(folder, "model.weights.h5"))
            with open(os.path.join(folder, "epoch")) as f:
                start = int(f.read()) + 1
    with open(os.path.join(config["log"], f"start-{rank}-{os.getpid()}"), "w") as f:
        json.dump({"start": start, "tf_config": json.loads(os.environ["TF_CONFIG"])}, f)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(64)

    class Report(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            with tempfile.TemporaryDirectory() as folder:
                # Every task saves (a collective under tfdist); the chief writes.
                self.model.save_weights(os.path.join(folder, "model.weights.h5"))
                with open(os.path.join(folder, "epoch"), "w") as f:
                    f.write(str(epoch))
                ray.train.report(
                    {
                        "epoch": epoch,
                        "loss": float(logs["loss"]),
                        "compression": str(strategy.compression),
                    },
                    checkpoint=ray.train.Checkpoint.from_directory(folder) if rank == 0 else None,
                )
            marker = os.path.join(config["log"], "killed")
            if epoch == 1 and rank == 1 and not os.path.exists(marker):
                # report() returns once this worker's result has left its
                # queue, not once the controller has it: the poll that took it
                # may still be answering, and a round's checkpoint is committed
                # only when every rank's result has arrived. Killed now, the
                # group could restart from no checkpoint at all. Wait until the
                # controller has committed every report of this worker.
                ray.train.get_all_reported_checkpoints(
                    consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED
                )
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)

    model.fit(data, epochs=EPOCHS, initial_epoch=start, verbose=0, callbacks=[Report()])


def main():
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    log = os.path.join(STORAGE, "log")
    os.makedirs(log, exist_ok=True)
    # Everything on the loopback: Ray would otherwise use the host's address
    # for its workers and for the TF_CONFIG it writes.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    try:
        trainer = TensorflowTrainer(
            train_loop_per_worker,
            train_loop_config={"compression": COMPRESSION, "log": log},
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
            run_config=RunConfig(
                storage_path=STORAGE, name="tfdist", failure_config=FailureConfig(max_failures=1)
            ),
        )
        result = trainer.fit()
    finally:
        ray.shutdown()
    starts, addresses = {}, set()
    for name in os.listdir(log):
        if name.startswith("start-"):
            with open(os.path.join(log, name)) as f:
                record = json.load(f)
            starts.setdefault(name.split("-")[1], []).append(record["start"])
            addresses.update(a.rsplit(":", 1)[0] for a in record["tf_config"]["cluster"]["worker"])
    with result.checkpoint.as_directory() as folder, open(os.path.join(folder, "epoch")) as f:
        checkpoint_epoch = int(f.read())
    history = result.metrics_dataframe
    say(
        "tfdist result: "
        + json.dumps(
            {
                "metrics": {k: result.metrics[k] for k in ("epoch", "loss", "compression")},
                "losses": [float(v) for v in history["loss"]],
                "epochs": [int(v) for v in history["epoch"]],
                "checkpoint_epoch": checkpoint_epoch,
                "error": repr(result.error),
                "starts": {rank: sorted(v) for rank, v in starts.items()},
                "hosts": sorted(addresses),
                "killed": os.path.exists(os.path.join(log, "killed")),
            }
        )
    )


if __name__ == "__main__":
    main()
