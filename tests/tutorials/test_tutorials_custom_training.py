"""TensorFlow's "Custom training with tf.distribute.Strategy" tutorial, as a test.

tensorflow/docs site/en/tutorials/distribute/custom_training.ipynb, step by
step, with tfdist.strategy_from_config as the only tfdist-specific line:

* Fashion-MNIST-shaped numpy arrays (28x28 uint8 -> (28, 28, 1) float in
  [0, 1]), shuffled and batched by the global batch, distributed with
  ``experimental_distribute_dataset``;
* a Conv/Conv/Dense model with L2 regularizers and no Input layer (it builds
  on its first call, inside ``strategy.run``), Adam, metrics and a
  ``tf.train.Checkpoint``, all created in the scope;
* a per-example loss (reduction None) averaged with
  ``tf.nn.compute_average_loss`` plus ``scale_regularization_loss``;
* ``strategy.run(train_step)`` with ``optimizer.apply_gradients`` and a SUM
  reduce, in a ``tf.function``, and a test step; a checkpoint every 2 epochs;
* the checkpoint restored into a new model without a strategy, evaluated;
* the loop again with an explicit iterator, and a whole epoch inside one
  ``tf.function``.

Run on 2 logical CPU replicas, with and without compression. Both fail on
Keras 3.15 before tfdist's fixes: without compression on keras-team/keras#23085
("You must feed a value for placeholder tensor"), with it on the compression
hook's lazy build ("Method requires being in cross-replica context").
"""

from __future__ import annotations

import numpy as np
import pytest

import tfdist
from workers.tutorial_data import flat_weights, mnist_like, scaled

PER_REPLICA_BATCH = 32
EPOCHS = 2
_RUNS: dict = {}  # compression -> result, to compare compressed runs with plain.


def run_tutorial(tf, compression, tmp_path) -> dict:
    import keras

    train_images, train_labels = mnist_like(384, seed=0)
    test_images, test_labels = mnist_like(128, seed=1)
    train_images = scaled(train_images[..., None])
    test_images = scaled(test_images[..., None])

    strategy = tfdist.strategy_from_config(cpu_replicas=2, compression=compression)
    assert strategy.num_replicas_in_sync == 2

    global_batch = PER_REPLICA_BATCH * strategy.num_replicas_in_sync
    train_dataset = (
        tf.data.Dataset.from_tensor_slices((train_images, train_labels))
        .shuffle(len(train_images), seed=0)
        .batch(global_batch)
    )
    test_dataset = tf.data.Dataset.from_tensor_slices((test_images, test_labels)).batch(
        global_batch
    )
    train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
    test_dist_dataset = strategy.experimental_distribute_dataset(test_dataset)

    def create_model():
        l2 = keras.regularizers.L2(1e-5)
        return keras.Sequential(
            [
                keras.layers.Conv2D(32, 3, activation="relu", kernel_regularizer=l2),
                keras.layers.MaxPooling2D(),
                keras.layers.Conv2D(64, 3, activation="relu", kernel_regularizer=l2),
                keras.layers.MaxPooling2D(),
                keras.layers.Flatten(),
                keras.layers.Dense(64, activation="relu", kernel_regularizer=l2),
                keras.layers.Dense(10, kernel_regularizer=l2),
            ]
        )

    checkpoint_prefix = str(tmp_path / "training_checkpoints" / "ckpt")

    with strategy.scope():
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

        def compute_loss(labels, predictions, model_losses):
            loss = tf.nn.compute_average_loss(loss_object(labels, predictions))
            if model_losses:
                loss += tf.nn.scale_regularization_loss(tf.add_n(model_losses))
            return loss

        test_loss = keras.metrics.Mean(name="test_loss")
        train_accuracy = keras.metrics.SparseCategoricalAccuracy(name="train_accuracy")
        test_accuracy = keras.metrics.SparseCategoricalAccuracy(name="test_accuracy")

        keras.utils.set_random_seed(0)
        model = create_model()
        optimizer = keras.optimizers.Adam(learning_rate=0.001)
        checkpoint = tf.train.Checkpoint(optimizer=optimizer, model=model)

    def train_step(inputs):
        images, labels = inputs
        with tf.GradientTape() as tape:
            predictions = model(images, training=True)
            loss = compute_loss(labels, predictions, model.losses)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        train_accuracy.update_state(labels, predictions)
        return loss

    def test_step(inputs):
        images, labels = inputs
        predictions = model(images, training=False)
        test_loss.update_state(loss_object(labels, predictions))
        test_accuracy.update_state(labels, predictions)

    @tf.function
    def distributed_train_step(dataset_inputs):
        per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)

    @tf.function
    def distributed_test_step(dataset_inputs):
        return strategy.run(test_step, args=(dataset_inputs,))

    result = {"loss": [], "train_accuracy": [], "test_accuracy": []}
    for epoch in range(EPOCHS):
        total_loss, num_batches = 0.0, 0
        for x in train_dist_dataset:
            total_loss += distributed_train_step(x)
            num_batches += 1
        for x in test_dist_dataset:
            distributed_test_step(x)
        if epoch % 2 == 0:
            checkpoint.save(checkpoint_prefix)
            result["saved_weights"] = flat_weights(model)
            result["saved_test_accuracy"] = float(test_accuracy.result())
        result["loss"].append(float(total_loss / num_batches))
        result["train_accuracy"].append(float(train_accuracy.result()))
        result["test_accuracy"].append(float(test_accuracy.result()))
        test_loss.reset_state()
        train_accuracy.reset_state()
        test_accuracy.reset_state()

    # Restore the checkpoint into a new model, without a strategy.
    eval_accuracy = keras.metrics.SparseCategoricalAccuracy(name="eval_accuracy")
    new_model = create_model()
    new_optimizer = keras.optimizers.Adam()

    @tf.function
    def eval_step(images, labels):
        eval_accuracy.update_state(labels, new_model(images, training=False))

    restored = tf.train.Checkpoint(optimizer=new_optimizer, model=new_model)
    restored.restore(tf.train.latest_checkpoint(str(tmp_path / "training_checkpoints")))
    for images, labels in test_dataset:
        eval_step(images, labels)
    result["restored_weights"] = flat_weights(new_model)
    result["restored_accuracy"] = float(eval_accuracy.result())

    # The loop again, with an explicit iterator and a fixed number of steps.
    for _ in range(EPOCHS):
        train_iter = iter(train_dist_dataset)
        total = sum(float(distributed_train_step(next(train_iter))) for _ in range(2))
        result["loss"].append(total / 2)
        train_accuracy.reset_state()

    # And a whole epoch inside one tf.function.
    @tf.function
    def distributed_train_epoch(dataset):
        total_loss, num_batches = 0.0, 0
        for x in dataset:
            per_replica_losses = strategy.run(train_step, args=(x,))
            total_loss += strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)
            num_batches += 1
        return total_loss / tf.cast(num_batches, dtype=tf.float32)

    for _ in range(EPOCHS):
        result["loss"].append(float(distributed_train_epoch(train_dist_dataset)))
        result["train_accuracy"].append(float(train_accuracy.result()))
        train_accuracy.reset_state()

    # Synchronous training: every replica holds the same weights.
    result["replicas_equal"] = all(
        all(np.array_equal(copies[0], c) for c in copies[1:])
        for copies in (
            [np.asarray(c) for c in strategy.experimental_local_results(v)]
            for v in model.trainable_variables
        )
    )
    result["weights"] = flat_weights(model)
    return result


@pytest.mark.parametrize("compression", [None, "bf16", "powersgd"])
def test_custom_training_tutorial(tf_cpus, tmp_path, compression):
    result = run_tutorial(tf_cpus, compression, tmp_path)
    _RUNS[compression] = result
    losses = result["loss"]
    assert np.all(np.isfinite(losses)), losses
    assert losses[-1] < 0.9 * losses[0], losses
    # 10 classes: chance is 0.1.
    assert result["train_accuracy"][-1] > 0.3, result["train_accuracy"]
    assert result["replicas_equal"]
    # The checkpoint restored into a model without a strategy has the saved
    # weights, and evaluates as the distributed test loop did then.
    np.testing.assert_array_equal(result["restored_weights"], result["saved_weights"])
    assert result["restored_accuracy"] == pytest.approx(result["saved_test_accuracy"])

    if compression is None:
        return
    plain = _RUNS.get(None) or run_tutorial(tf_cpus, None, tmp_path / "plain")
    # The compressed all-reduce really ran: the weights differ from plain
    # training from the same start and data order...
    assert not np.array_equal(result["weights"], plain["weights"])
    if compression == "bf16":  # ...by bf16 rounding only.
        np.testing.assert_allclose(losses, plain["loss"], rtol=0.1)
