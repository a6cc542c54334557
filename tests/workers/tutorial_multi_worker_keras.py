"""TensorFlow's "Multi-worker training with Keras" tutorial, one worker of it.

Run by tests/tutorials/test_tutorials_multi_worker.py as every task of
``tfdist launch --workers 2 tests/workers/tutorial_multi_worker_keras.py WORKDIR``.
It follows tensorflow/docs site/en/tutorials/distribute/multi_worker_with_keras.ipynb
step by step, with tfdist.strategy_from_config as the only tfdist-specific
line (compression from TFDIST_TEST_COMPRESSION):

1. ``main.py``: the strategy first, then a shuffled, repeated MNIST-shaped
   dataset batched by the global batch, the tutorial's Conv/Dense model
   (InputLayer, Reshape) compiled with SGD in the scope, ``fit`` with
   ``steps_per_epoch``;
2. the fault-tolerance section, on every worker as a multi-worker job runs
   it: ``model.save`` by all workers (the chief to the real path, the others
   to a temporary directory they then delete), ``load_model`` of the chief's
   file and a fit of the loaded model; a ``tf.train.CheckpointManager`` saved
   the same way and restored from the chief's directory, then fit; the stock
   ``keras.callbacks.BackupAndRestore`` at epoch and at step frequency, with
   one shared directory, as the tutorial passes it;
3. the stock ``keras.callbacks.ModelCheckpoint`` (weights ``.h5`` and
   ``.keras``), which the tutorial suggests for saving checkpoints.

WORKDIR is the job's shared directory (the tutorial's /tmp). SECTIONS (the
second argument, comma-separated; default all) picks what runs. Each section
records its figures, or its error, in one 'tfdist result:' line; the script
goes on after an error, so one launch checks several sections (an error in
a collective on one worker only can make the next sections fail too).
"""

import json
import os
import sys
import time
import traceback

import numpy as np
import tensorflow as tf

import tfdist
from protocol import say
from tutorial_data import mnist_like, scaled

WORKDIR = sys.argv[1]
ALL = "fit,save,checkpoint,backup_epoch,backup_steps,model_checkpoint"
SECTIONS = (sys.argv[2] if len(sys.argv) > 2 else ALL).split(",")
STEPS = 3  # Per epoch (the tutorial: 70).

per_worker_batch_size = 64
tf_config = json.loads(os.environ["TF_CONFIG"])
num_workers = len(tf_config["cluster"]["worker"])

strategy = tfdist.strategy_from_config(
    compression=os.environ.get("TFDIST_TEST_COMPRESSION") or None
)

result = {
    "task": strategy.task if hasattr(strategy, "task") else None,
    "replicas": strategy.num_replicas_in_sync,
    "errors": {},
}


def mnist_dataset(batch_size):
    images, labels = mnist_like(1024, seed=0)
    return (
        tf.data.Dataset.from_tensor_slices((scaled(images), labels))
        .shuffle(60000, seed=0)
        .repeat()
        .batch(batch_size)
    )


def build_and_compile_cnn_model():
    # Not in the tutorial: seeded, so that every run starts from the same
    # weights (the test checks that the loss falls, which an unseeded draw
    # made a matter of chance in the custom-loop tutorial's worker).
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential(
        [
            tf.keras.layers.InputLayer(shape=(28, 28)),
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


def checksum(model):
    return float(np.sum([np.sum(np.abs(w.astype(np.float64))) for w in model.get_weights()]))


def section(name):
    """Runs a section if it was asked for; its error is recorded under its name."""

    def run(fn):
        if name not in SECTIONS:
            return fn
        try:
            fn()
        except Exception as error:  # noqa: BLE001 - recorded for the test
            result["errors"][name] = f"{type(error).__name__}: {error}"[:600]
            traceback.print_exc()
        return fn

    return run


global_batch_size = per_worker_batch_size * num_workers
multi_worker_dataset = mnist_dataset(global_batch_size)
with strategy.scope():
    multi_worker_model = build_and_compile_cnn_model()


@section("fit")
def fit():
    result["initial_checksum"] = checksum(multi_worker_model)
    history = multi_worker_model.fit(
        multi_worker_dataset, epochs=3, steps_per_epoch=STEPS, verbose=0
    )
    result["fit"] = {"loss": history.history["loss"], "checksum": checksum(multi_worker_model)}


# --- The tutorial's saving and loading, run on every worker.
def _is_chief(task_type, task_id):
    return (task_type == "worker" and task_id == 0) or task_type is None


def _get_temp_dir(dirpath, task_id):
    temp_dir = os.path.join(dirpath, "workertemp_" + str(task_id))
    tf.io.gfile.makedirs(temp_dir)
    return temp_dir


def write_filepath(filepath, task_type, task_id):
    dirpath = os.path.dirname(filepath)
    base = os.path.basename(filepath)
    if not _is_chief(task_type, task_id):
        dirpath = _get_temp_dir(dirpath, task_id)
    return os.path.join(dirpath, base)


task_type, task_id = strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id


@section("save")
def save_and_load():
    model_path = os.path.join(WORKDIR, "keras-model.keras")  # Keras 3 needs .keras.
    write_model_path = write_filepath(model_path, task_type, task_id)
    multi_worker_model.save(write_model_path)
    if not _is_chief(task_type, task_id):
        tf.io.gfile.rmtree(os.path.dirname(write_model_path))
    loaded_model = tf.keras.models.load_model(model_path)
    result["save"] = {
        "loaded_checksum": checksum(loaded_model),
        "model_checksum": checksum(multi_worker_model),
        "temp_left": os.path.exists(os.path.join(WORKDIR, f"workertemp_{task_id}")),
    }
    history = loaded_model.fit(mnist_dataset(64), epochs=1, steps_per_epoch=2, verbose=0)
    result["save"]["loaded_fit_loss"] = history.history["loss"]


@section("checkpoint")
def checkpoint_manager_section():
    checkpoint_dir = os.path.join(WORKDIR, "ckpt")
    checkpoint = tf.train.Checkpoint(model=multi_worker_model)
    write_checkpoint_dir = write_filepath(checkpoint_dir, task_type, task_id)
    checkpoint_manager = tf.train.CheckpointManager(
        checkpoint, directory=write_checkpoint_dir, max_to_keep=1
    )
    checkpoint_manager.save()
    if not _is_chief(task_type, task_id):
        tf.io.gfile.rmtree(write_checkpoint_dir)
    saved = checksum(multi_worker_model)
    latest_checkpoint = tf.train.latest_checkpoint(checkpoint_dir)
    # Move the weights away, so that the restore has something to undo.
    for variable in multi_worker_model.trainable_variables:
        variable.assign(tf.zeros_like(variable))
    checkpoint.restore(latest_checkpoint)
    result["checkpoint"] = {
        "latest": latest_checkpoint and os.path.basename(latest_checkpoint),
        "saved_checksum": saved,
        "restored_checksum": checksum(multi_worker_model),
    }
    history = multi_worker_model.fit(multi_worker_dataset, epochs=1, steps_per_epoch=2, verbose=0)
    result["checkpoint"]["loss"] = history.history["loss"]


def backup_and_restore(name, **kwargs):
    @section(name)
    def run():
        backup_dir = os.path.join(WORKDIR, "backup")
        callbacks = [tf.keras.callbacks.BackupAndRestore(backup_dir=backup_dir, **kwargs)]
        with strategy.scope():
            model = build_and_compile_cnn_model()
        epochs_run = []
        callbacks.append(
            tf.keras.callbacks.LambdaCallback(
                on_epoch_begin=lambda epoch, logs: epochs_run.append(epoch)
            )
        )
        history = model.fit(
            multi_worker_dataset, epochs=2, steps_per_epoch=STEPS, callbacks=callbacks, verbose=0
        )
        # The chief deletes the shared backup once training has finished; the
        # other worker may get here first (seen once), so it waits up to 30 s.
        deadline = time.monotonic() + 30
        while os.path.exists(backup_dir) and time.monotonic() < deadline:
            time.sleep(0.1)
        result[name] = {
            "epochs_run": epochs_run,
            "loss": history.history["loss"],
            "checksum": checksum(model),
            "backup_left": os.path.exists(backup_dir),
        }


backup_and_restore("backup_epoch")
backup_and_restore("backup_steps", save_freq=2)


@section("model_checkpoint")
def model_checkpoint_section():
    directory = os.path.join(WORKDIR, "model_checkpoint")
    callbacks = [
        tf.keras.callbacks.ModelCheckpoint(
            filepath=os.path.join(directory, "ckpt_{epoch:04d}.weights.h5"), save_weights_only=True
        ),
        tf.keras.callbacks.ModelCheckpoint(filepath=os.path.join(directory, "model.keras")),
    ]
    with strategy.scope():
        model = build_and_compile_cnn_model()
    model.fit(multi_worker_dataset, epochs=2, steps_per_epoch=STEPS, callbacks=callbacks, verbose=0)
    trained = checksum(model)
    files = sorted(os.listdir(directory))
    with strategy.scope():
        from_weights = build_and_compile_cnn_model()
    from_weights.load_weights(os.path.join(directory, "ckpt_0002.weights.h5"))
    result["model_checkpoint"] = {
        "files": files,
        "checksum": trained,
        "weights_file_checksum": checksum(from_weights),
        "model_file_checksum": checksum(
            tf.keras.models.load_model(os.path.join(directory, "model.keras"))
        ),
    }


say("tfdist result: " + json.dumps(result))
