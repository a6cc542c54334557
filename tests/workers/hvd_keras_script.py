"""A Horovod-style Keras `fit` script on tfdist.horovod (run by `tfdist launch`).

It makes the API calls of Horovod's Keras MNIST example, in the same order:
hvd.init before the GPU set-up, the learning rate scaled by size(),
DistributedOptimizer, compile(experimental_run_tf_function=False),
BroadcastGlobalVariablesCallback, MetricAverageCallback,
LearningRateWarmupCallback, a rank-0-only ModelCheckpoint, progress output on
rank 0 only, steps divided by size(). Each rank starts from different weights
(its own seed) and shuffles its own copy of the data, as under Horovod; only
the broadcast and the all-reduce can make the ranks end equal. Two recording
callbacks of ours sit between Horovod's: the metrics before averaging, and the
learning rate of each batch after the warm-up set it.

Usage: hvd_keras_script.py OUT_DIR   (checkpoints go to OUT_DIR, as the
example writes them to its working directory). Prints one
"tfdist result: {json}" line per rank.
"""

import hashlib
import json
import os
import sys

import numpy as np
import tensorflow as tf

import tfdist.horovod as hvd
from protocol import say

EXAMPLES, BATCH, CLASSES = 512, 32, 10
STEPS, EPOCHS, WARMUP_EPOCHS, BASE_LR = 16, 3, 2, 0.002


def synthetic_images(seed=0):
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (EXAMPLES, 8, 8), dtype=np.uint8)
    # Labels follow the images, so the loss can fall.
    labels = (images.reshape(EXAMPLES, -1).mean(axis=1) // 26).astype(np.uint8) % CLASSES
    return images, labels


def checksum(weights):
    flat = b"".join(np.ascontiguousarray(w, dtype=np.float32).tobytes() for w in weights)
    return hashlib.sha256(flat).hexdigest()[:16], float(sum(np.abs(w).sum() for w in weights))


class LocalRecorder(tf.keras.callbacks.Callback):
    """This rank's weights before the broadcast and its metrics before averaging.

    Keras 3 builds the model in the first step, and the broadcast runs at the
    end of it; placed first, this sees the weights of that step before it.
    """

    def __init__(self):
        super().__init__()
        self.initial, self.local_logs = None, []

    def on_train_batch_end(self, batch, logs=None):
        if self.initial is None:
            self.initial = checksum(self.model.get_weights())[0]

    def on_epoch_end(self, epoch, logs=None):
        self.local_logs.append({k: float(v) for k, v in (logs or {}).items()})


class RateRecorder(tf.keras.callbacks.Callback):
    """The learning rate each batch runs with (after the warm-up set it)."""

    def __init__(self):
        super().__init__()
        self.rates = []

    def on_train_batch_begin(self, batch, logs=None):
        self.rates.append(float(self.model.optimizer.learning_rate))


def main(out_dir):
    hvd.init()

    gpus = tf.config.experimental.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")

    # Different initial weights and dropout masks on each rank.
    tf.keras.utils.set_random_seed(1000 + hvd.rank())

    images, labels = synthetic_images()
    dataset = tf.data.Dataset.from_tensor_slices(
        (tf.cast(images[..., tf.newaxis] / 255.0, tf.float32), tf.cast(labels, tf.int64))
    )
    dataset = dataset.repeat().shuffle(256, seed=hvd.rank()).batch(BATCH)

    model = tf.keras.Sequential(
        [
            tf.keras.layers.Conv2D(4, [3, 3], activation="relu"),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(16, activation="relu"),
            tf.keras.layers.Dropout(0.25),
            tf.keras.layers.Dense(CLASSES, activation="softmax"),
        ]
    )

    scaled_lr = BASE_LR * hvd.size()
    opt = tf.optimizers.Adam(scaled_lr)
    opt = hvd.DistributedOptimizer(
        opt, backward_passes_per_step=1, average_aggregated_gradients=True
    )
    model.compile(
        loss=tf.losses.SparseCategoricalCrossentropy(),
        optimizer=opt,
        metrics=["accuracy"],
        experimental_run_tf_function=False,
    )

    local, rates = LocalRecorder(), RateRecorder()
    callbacks = [
        local,
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(
            initial_lr=scaled_lr, warmup_epochs=WARMUP_EPOCHS, verbose=1
        ),
        rates,
    ]

    if hvd.rank() == 0:
        callbacks.append(
            tf.keras.callbacks.ModelCheckpoint(os.path.join(out_dir, "checkpoint-{epoch}.keras"))
        )

    verbose = 1 if hvd.rank() == 0 else 0
    history = model.fit(
        dataset,
        steps_per_epoch=STEPS // hvd.size(),
        callbacks=callbacks,
        epochs=EPOCHS,
        verbose=verbose,
    )

    digest, total = checksum(model.get_weights())
    result = {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "local_rank": hvd.local_rank(),
        "initial": local.initial,
        "final": digest,
        "abs_sum": total,
        "loss": [float(v) for v in history.history["loss"]],
        "accuracy": [float(v) for v in history.history["accuracy"]],
        "local_logs": local.local_logs,
        "rates": rates.rates,
        "lr": float(model.optimizer.learning_rate),
        "scaled_lr": scaled_lr,
        "iterations": int(model.optimizer.iterations),
        "checkpoint_callbacks": sum(
            isinstance(c, tf.keras.callbacks.ModelCheckpoint) for c in callbacks
        ),
    }
    say("tfdist result: " + json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
