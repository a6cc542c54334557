"""The multi-worker Keras tutorial's saving steps, run by `tfdist launch`.

It does what TensorFlow's multi_worker_with_keras tutorial does, in our own
code, with synthetic MNIST-shaped data; the strategy line is the only tfdist
change:

1. the tutorial's CNN, compiled in the strategy's scope, trained with
   ``fit(steps_per_epoch=...)`` and Keras's own callbacks: BackupAndRestore,
   ModelCheckpoint of the whole model (``.keras``) and of the best weights
   (``.weights.h5``, ``save_best_only``);
2. ``model.save`` on every worker, the tutorial's way: the chief to the
   model path, the others to ``workertemp_<id>/`` under it, which they then
   delete; and ``load_model`` of the chief's path right after;
3. the naive way: every worker saves to the same ``.keras`` path, and to the
   same ``.weights.h5`` path, and loads it right after;
4. without compression, a save on the chief only.

Usage: keras_tutorial_save.py OUT_DIR. The compression comes from
TFDIST_TEST_COMPRESSION. With TFDIST_TEST_KILL=EPOCH:BATCH worker 1 kills
itself (SIGKILL) there on the launcher's first attempt. Prints one
'tfdist epoch:' line per epoch end, and one 'tfdist result:' line; a failed
step is recorded, not raised, so that every step runs.
"""

import hashlib
import json
import os
import signal
import sys
import traceback

import numpy as np
import tensorflow as tf

import tfdist
from protocol import say

out_dir = sys.argv[1]
attempt = int(os.environ.get("TFDIST_LAUNCH_ATTEMPT", "0"))
kill_at = os.environ.get("TFDIST_TEST_KILL")
EPOCHS, STEPS = 3, 6

per_worker_batch_size = 64
tf_config = json.loads(os.environ["TF_CONFIG"])
num_workers = len(tf_config["cluster"]["worker"])

strategy = tfdist.strategy_from_config(
    register_timeout=120, compression=os.environ.get("TFDIST_TEST_COMPRESSION")
)


def mnist_dataset(batch_size):
    rng = np.random.default_rng(0)
    x_train = rng.integers(0, 256, size=(2048, 28, 28)).astype(np.uint8)
    y_train = (x_train[:, 10:18, 10:18].mean(axis=(1, 2)) // 25.6).astype(np.int64)
    x_train = x_train / np.float32(255)
    return (
        tf.data.Dataset.from_tensor_slices((x_train, y_train))
        .shuffle(2048, seed=1)
        .repeat()
        .batch(batch_size)
    )


def build_and_compile_cnn_model():
    tf.keras.utils.set_random_seed(3)
    model = tf.keras.Sequential(
        [
            tf.keras.Input(shape=(28, 28)),
            tf.keras.layers.Reshape(target_shape=(28, 28, 1)),
            tf.keras.layers.Conv2D(32, 3, activation="relu"),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(128, activation="relu"),
            tf.keras.layers.Dense(10),
        ]
    )
    model.compile(
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=tf.keras.optimizers.SGD(learning_rate=0.001),
        metrics=["accuracy"],
    )
    return model


def digest(model):
    return hashlib.sha256(
        b"".join(np.ascontiguousarray(w).tobytes() for w in model.get_weights())
    ).hexdigest()


task_type, task_id = (strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id)
result = {"task": f"{task_type}:{task_id}", "attempt": attempt, "pid": os.getpid(), "errors": {}}


def step(name, fn):
    """Runs one step of the tutorial; records its error instead of raising."""
    try:
        return fn()
    except Exception as error:  # noqa: BLE001  (recorded for the test)
        result["errors"][name] = f"{type(error).__name__}: {error}"
        traceback.print_exc()
        return None


class Record(tf.keras.callbacks.Callback):
    """Weights after BackupAndRestore restored them, and at each epoch end."""

    epoch = 0

    def on_train_begin(self, logs=None):
        result["begin_digest"] = digest(self.model)
        result["begin_iterations"] = int(self.model.optimizer.iterations.numpy())

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (
            kill_at
            and attempt == 0
            and task_id == 1
            and (self.epoch, batch) == tuple(map(int, kill_at.split(":")))
        ):
            os.kill(os.getpid(), signal.SIGKILL)

    def on_epoch_end(self, epoch, logs=None):
        say(
            "tfdist epoch: "
            + json.dumps(
                {
                    "task": result["task"],
                    "attempt": attempt,
                    "epoch": epoch,
                    "digest": digest(self.model),
                    "loss": float(logs["loss"]),
                }
            )
        )


# 1. fit with Keras's own callbacks.
global_batch_size = per_worker_batch_size * num_workers
multi_worker_dataset = mnist_dataset(global_batch_size)
with strategy.scope():
    multi_worker_model = build_and_compile_cnn_model()
ckpt_dir = os.path.join(out_dir, "ckpt")
callbacks = [
    tf.keras.callbacks.BackupAndRestore(backup_dir=os.path.join(out_dir, "backup")),
    tf.keras.callbacks.ModelCheckpoint(os.path.join(ckpt_dir, "model-{epoch:02d}.keras")),
    tf.keras.callbacks.ModelCheckpoint(
        os.path.join(ckpt_dir, "best.weights.h5"),
        save_weights_only=True,
        save_best_only=True,
        monitor="loss",
    ),
    Record(),
]
history = step(
    "fit",
    lambda: multi_worker_model.fit(
        multi_worker_dataset, epochs=EPOCHS, steps_per_epoch=STEPS, callbacks=callbacks, verbose=0
    ),
)
if history is None:
    say("tfdist result: " + json.dumps(result))
    sys.exit(1)  # The job cannot go on; the launcher restarts it, if allowed.
result["epochs_run"] = history.epoch
result["iterations"] = int(multi_worker_model.optimizer.iterations.numpy())
result["trained_digest"] = digest(multi_worker_model)

# 2. The tutorial's save: the chief to model_path, the others to a temporary
# directory that they delete; then load the chief's model.
model_path = os.path.join(out_dir, "keras-model.keras")


def _is_chief(task_type, task_id):
    return (task_type == "worker" and task_id == 0) or task_type is None


def _get_temp_dir(dirpath, task_id):
    temp_dir = os.path.join(dirpath, "workertemp_" + str(task_id))
    tf.io.gfile.makedirs(temp_dir)
    return temp_dir


def write_filepath(filepath, task_type, task_id):
    dirpath, base = os.path.dirname(filepath), os.path.basename(filepath)
    if not _is_chief(task_type, task_id):
        dirpath = _get_temp_dir(dirpath, task_id)
    return os.path.join(dirpath, base)


write_model_path = write_filepath(model_path, task_type, task_id)
step("tutorial_save", lambda: multi_worker_model.save(write_model_path))
if not _is_chief(task_type, task_id):
    result["own_copy_existed"] = os.path.exists(write_model_path)
    tf.io.gfile.rmtree(os.path.dirname(write_model_path))
loaded = step("tutorial_load", lambda: tf.keras.models.load_model(model_path))
result["tutorial_digest"] = loaded and digest(loaded)

# 3. The naive way: every worker saves to the same path and loads it.
same_path = os.path.join(out_dir, "same", "model.keras")
os.makedirs(os.path.dirname(same_path), exist_ok=True)
step("same_save", lambda: multi_worker_model.save(same_path))
loaded = step("same_load", lambda: tf.keras.models.load_model(same_path))
result["same_digest"] = loaded and digest(loaded)

weights_path = os.path.join(out_dir, "same", "model.weights.h5")
step("weights_save", lambda: multi_worker_model.save_weights(weights_path))
fresh = build_and_compile_cnn_model()
step("weights_load", lambda: fresh.load_weights(weights_path))
result["weights_digest"] = digest(fresh)

# A save into a directory that does not exist fails on every worker alike
# (and none waits in a collective for another).
step(
    "missing_dir_save",
    lambda: multi_worker_model.save(os.path.join(out_dir, "no-such-dir", "model.keras")),
)

# 4. A save on the chief only (no collective in it without compression
# state) must not wait for the others.
if os.environ.get("TFDIST_TEST_COMPRESSION") is None and _is_chief(task_type, task_id):
    step(
        "chief_only_save",
        lambda: multi_worker_model.save(os.path.join(out_dir, "chief-only.keras")),
    )

say("tfdist result: " + json.dumps(result))
