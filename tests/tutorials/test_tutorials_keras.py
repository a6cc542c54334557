"""TensorFlow's "Distributed training with Keras" tutorial, as a test.

tensorflow/docs site/en/tutorials/distribute/keras.ipynb, step by step, with
tfdist.strategy_from_config as the only tfdist-specific line: MNIST-shaped
images (28x28x1 uint8 scaled to float) from a dataset that is mapped, cached,
shuffled and batched by the global batch size; a Conv2D/MaxPooling/Dense model
built and compiled in the strategy's scope with Adam; fit with TensorBoard,
ModelCheckpoint (weights only, one file per epoch), LearningRateScheduler and
a callback that reads the learning rate; the latest checkpoint loaded back;
evaluate; model.save to .keras; load_model outside the scope and inside it,
compile, evaluate. On 2 logical CPU replicas, with and without compression.
Synthetic data of the tutorial's shapes and a smaller scale.
"""

from __future__ import annotations

import numpy as np
import pytest

import tfdist
from workers.tutorial_data import flat_weights, mnist_like

PER_REPLICA_BATCH = 64
EPOCHS = 2


@pytest.mark.parametrize("compression", [None, "powersgd"])
def test_keras_tutorial_fit_checkpoints_and_reloads(tf_cpus, tmp_path, compression):
    tf = tf_cpus
    import keras

    strategy = tfdist.strategy_from_config(cpu_replicas=2, compression=compression)
    assert strategy.num_replicas_in_sync == 2

    # The tutorial's data pipeline on MNIST-shaped (image, label) pairs.
    train_images, train_labels = mnist_like(512, seed=0, channel=True)
    test_images, test_labels = mnist_like(128, seed=1, channel=True)
    global_batch = PER_REPLICA_BATCH * strategy.num_replicas_in_sync

    def scale(image, label):
        return tf.cast(image, tf.float32) / 255, label

    train_dataset = (
        tf.data.Dataset.from_tensor_slices((train_images, train_labels))
        .map(scale)
        .cache()
        .shuffle(1000, seed=0)
        .batch(global_batch)
    )
    eval_dataset = (
        tf.data.Dataset.from_tensor_slices((test_images, test_labels))
        .map(scale)
        .batch(global_batch)
    )

    def compile_args():
        return dict(
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            optimizer=keras.optimizers.Adam(learning_rate=0.001),
            metrics=["accuracy"],
        )

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input(shape=(28, 28, 1)),
                keras.layers.Conv2D(32, 3, activation="relu"),
                keras.layers.MaxPooling2D(),
                keras.layers.Flatten(),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
        model.compile(**compile_args())

    checkpoint_dir = tmp_path / "training_checkpoints"
    log_dir = tmp_path / "logs"

    def decay(epoch):  # The tutorial's step decay, over 2 epochs.
        return 1e-3 if epoch < 1 else 1e-4

    seen_rates = []

    class ReadLearningRate(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen_rates.append(float(model.optimizer.learning_rate.numpy()))

    callbacks = [
        keras.callbacks.TensorBoard(log_dir=str(log_dir)),
        keras.callbacks.ModelCheckpoint(
            filepath=str(checkpoint_dir / "ckpt_{epoch:04d}.weights.h5"), save_weights_only=True
        ),
        keras.callbacks.LearningRateScheduler(decay),
        ReadLearningRate(),
    ]
    history = model.fit(train_dataset, epochs=EPOCHS, callbacks=callbacks, verbose=0)

    losses = history.history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    np.testing.assert_allclose(seen_rates, [1e-3, 1e-4], rtol=1e-6)
    assert sorted(p.name for p in checkpoint_dir.iterdir()) == [
        "ckpt_0001.weights.h5",
        "ckpt_0002.weights.h5",
    ]
    assert any(p.name.startswith("events.out") for p in (log_dir / "train").iterdir())

    # The latest checkpoint holds the trained weights; the first one does not.
    trained = flat_weights(model)
    model.load_weights(str(checkpoint_dir / "ckpt_0001.weights.h5"))
    assert not np.allclose(flat_weights(model), trained)
    latest = sorted(checkpoint_dir.glob("*"))[-1]
    model.load_weights(str(latest))
    np.testing.assert_array_equal(flat_weights(model), trained)

    eval_loss, eval_acc = model.evaluate(eval_dataset, verbose=0)
    assert eval_acc > 0.5, eval_acc  # 10 classes: chance is 0.1.

    # Saved once, loaded without the strategy and with it: same weights, same
    # evaluation.
    path = str(tmp_path / "my_model.keras")
    model.save(path)
    unreplicated_model = keras.models.load_model(path)
    unreplicated_model.compile(**compile_args())
    np.testing.assert_array_equal(flat_weights(unreplicated_model), trained)
    loss, acc = unreplicated_model.evaluate(eval_dataset, verbose=0)
    assert loss == pytest.approx(eval_loss, rel=1e-5) and acc == pytest.approx(eval_acc)

    with strategy.scope():
        replicated_model = keras.models.load_model(path)
        replicated_model.compile(**compile_args())
        loss, acc = replicated_model.evaluate(eval_dataset, verbose=0)
    assert loss == pytest.approx(eval_loss, rel=1e-5) and acc == pytest.approx(eval_acc)
    assert replicated_model.distribute_strategy is strategy
