"""keras-io's "Multi-GPU distributed training with TensorFlow" guide, as a test.

keras-team/keras-io guides/distributed_training_with_tensorflow.py, step by
step, with tfdist.strategy_from_config as the only tfdist-specific line: a
784-256-256-10 MLP compiled with Adam on MNIST-shaped data flattened to 784
floats (float labels), batched by 32 with a validation split; model built,
fit with validation data and evaluated inside the strategy's scope; then the
guide's fault-tolerance pattern: ``run_training`` creates a new strategy,
restores the newest ``.keras`` file by ctime (or builds a fresh model) and
fits with ``ModelCheckpoint("ckpt-{epoch}.keras")``; called twice, the second
call resumes from the first's file. On 2 logical CPU replicas, with and
without compression.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import tfdist
from workers.tutorial_data import flat_weights, mnist_like, scaled


@pytest.mark.parametrize("compression", [None, "powersgd"])
def test_keras_io_guide_fit_and_resume_from_model_checkpoint(tf_cpus, tmp_path, compression):
    tf = tf_cpus
    import keras

    def get_compiled_model():
        inputs = keras.Input(shape=(784,))
        x = keras.layers.Dense(256, activation="relu")(inputs)
        x = keras.layers.Dense(256, activation="relu")(x)
        outputs = keras.layers.Dense(10)(x)
        model = keras.Model(inputs, outputs)
        model.compile(
            optimizer=keras.optimizers.Adam(),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=[keras.metrics.SparseCategoricalAccuracy()],
        )
        return model

    def get_dataset():
        batch_size, num_val_samples = 32, 128
        (x_train, y_train), (x_test, y_test) = mnist_like(512, seed=0), mnist_like(128, seed=1)
        x_train = scaled(x_train.reshape(-1, 784))
        x_test = scaled(x_test.reshape(-1, 784))
        y_train, y_test = y_train.astype("float32"), y_test.astype("float32")
        x_val, y_val = x_train[-num_val_samples:], y_train[-num_val_samples:]
        x_train, y_train = x_train[:-num_val_samples], y_train[:-num_val_samples]
        return (
            tf.data.Dataset.from_tensor_slices((x_train, y_train)).batch(batch_size),
            tf.data.Dataset.from_tensor_slices((x_val, y_val)).batch(batch_size),
            tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(batch_size),
        )

    strategy = tfdist.strategy_from_config(cpu_replicas=2, compression=compression)
    assert strategy.num_replicas_in_sync == 2
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = get_compiled_model()
        train_dataset, val_dataset, test_dataset = get_dataset()
        history = model.fit(train_dataset, epochs=2, validation_data=val_dataset, verbose=0)
        test_loss, test_accuracy = model.evaluate(test_dataset, verbose=0)
    losses = history.history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    assert history.history["val_sparse_categorical_accuracy"][-1] > 0.5, history.history
    assert test_accuracy > 0.5, test_accuracy  # 10 classes: chance is 0.1.

    checkpoint_dir = str(tmp_path / "ckpt")
    os.makedirs(checkpoint_dir)
    started_from = []  # (checkpoint or None, weights) at the start of each run

    def make_or_restore_model():
        checkpoints = [checkpoint_dir + "/" + name for name in os.listdir(checkpoint_dir)]
        if checkpoints:
            latest = max(checkpoints, key=os.path.getctime)
            restored = keras.models.load_model(latest)
            started_from.append((os.path.basename(latest), flat_weights(restored)))
            return restored
        fresh = get_compiled_model()
        started_from.append((None, flat_weights(fresh)))
        return fresh

    runs = []

    def run_training(epochs=1):
        strategy = tfdist.strategy_from_config(cpu_replicas=2, compression=compression)
        with strategy.scope():
            model = make_or_restore_model()
            callbacks = [
                keras.callbacks.ModelCheckpoint(
                    filepath=checkpoint_dir + "/ckpt-{epoch}.keras", save_freq="epoch"
                )
            ]
            history = model.fit(
                train_dataset,
                epochs=epochs,
                callbacks=callbacks,
                validation_data=val_dataset,
                verbose=0,
            )
        runs.append((model, history.history))

    run_training(epochs=1)
    after_first = flat_weights(keras.models.load_model(checkpoint_dir + "/ckpt-1.keras"))
    np.testing.assert_array_equal(after_first, flat_weights(runs[0][0]))
    run_training(epochs=1)

    # The first call built a new model; the second resumed from the first
    # call's checkpoint, with its weights, and trained on from there.
    assert started_from[0][0] is None
    assert started_from[1][0] == "ckpt-1.keras"
    np.testing.assert_array_equal(started_from[1][1], after_first)
    first_loss, second_loss = runs[0][1]["loss"][0], runs[1][1]["loss"][0]
    assert second_loss < first_loss, (first_loss, second_loss)
    # Its own checkpoint (epoch 1 again) replaced the file.
    assert os.listdir(checkpoint_dir) == ["ckpt-1.keras"]
    np.testing.assert_array_equal(
        flat_weights(keras.models.load_model(checkpoint_dir + "/ckpt-1.keras")),
        flat_weights(runs[1][0]),
    )
