"""TensorFlow's "Save and load a model using a distribution strategy", as a test.

tensorflow/docs site/en/tutorials/distribute/save_and_load.ipynb, step by
step, on Keras 3, with tfdist.strategy_from_config as the only
tfdist-specific line (the tutorial's MirroredStrategy and OneDeviceStrategy
lines): the Conv/Dense MNIST model built and compiled in a Mirrored scope,
fit on a mapped, cached, shuffled, batched dataset; ``model.save`` to
``.keras`` and ``load_model`` without a strategy and under another strategy,
each fit again; ``tf.saved_model.save`` and ``tf.saved_model.load`` with the
``serving_default`` signature called directly and through ``strategy.run`` on
a distributed dataset; Keras 3's ``model.export`` in place of Keras 2's
``model.save(dir)``; save and load options with ``experimental_io_device``;
a subclassed model fit and saved. Keras 2-only steps (tensorflow_hub's
KerasLayer, ``save_spec``) have no Keras 3 equivalent and are left out.
On 2 logical CPU replicas, with and without compression.
"""

from __future__ import annotations

import numpy as np
import pytest

import tfdist
from workers.tutorial_data import flat_weights, mnist_like

PER_REPLICA_BATCH = 32


@pytest.mark.parametrize("compression", [None, "powersgd"])
def test_save_and_load_tutorial(tf_cpus, tmp_path, compression):
    tf = tf_cpus
    import keras

    mirrored_strategy = tfdist.strategy_from_config(cpu_replicas=2, compression=compression)
    assert mirrored_strategy.num_replicas_in_sync == 2

    def get_data():
        batch = PER_REPLICA_BATCH * mirrored_strategy.num_replicas_in_sync

        def scale(image, label):
            return tf.cast(image, tf.float32) / 255, label

        train = tf.data.Dataset.from_tensor_slices(mnist_like(256, seed=0, channel=True))
        test = tf.data.Dataset.from_tensor_slices(mnist_like(128, seed=1, channel=True))
        return (
            train.map(scale).cache().shuffle(1000, seed=0).batch(batch),
            test.map(scale).batch(batch),
        )

    def get_model():
        with mirrored_strategy.scope():
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
            model.compile(
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                optimizer=keras.optimizers.Adam(),
                metrics=[keras.metrics.SparseCategoricalAccuracy()],
            )
            return model

    keras.utils.set_random_seed(0)
    model = get_model()
    train_dataset, eval_dataset = get_data()
    history = model.fit(train_dataset, epochs=2, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0], history.history
    images = next(iter(eval_dataset.map(lambda image, label: image)))
    expected = model.predict(images, verbose=0)

    # The Keras format, loaded without a strategy and under another one.
    keras_model_path = str(tmp_path / "keras_save.keras")
    model.save(keras_model_path)
    restored_keras_model = keras.models.load_model(keras_model_path)
    np.testing.assert_allclose(
        restored_keras_model.predict(images, verbose=0), expected, rtol=1e-5, atol=1e-5
    )
    restored_history = restored_keras_model.fit(train_dataset, epochs=1, verbose=0)
    assert restored_history.history["loss"][0] < history.history["loss"][0]

    saved_weights = flat_weights(model)
    another_strategy = tfdist.strategy_from_config(strategy="one_device")
    with another_strategy.scope():
        restored_keras_model_ds = keras.models.load_model(keras_model_path)
        loaded_weights = flat_weights(restored_keras_model_ds)
        restored_keras_model_ds.fit(train_dataset, epochs=1, verbose=0)
    np.testing.assert_array_equal(loaded_weights, saved_weights)
    assert restored_keras_model_ds.distribute_strategy is another_strategy

    # tf.saved_model: a fresh model, saved and served by its signature.
    model = get_model()
    fresh = model.predict(images, verbose=0)
    saved_model_path = str(tmp_path / "tf_save")
    tf.saved_model.save(model, saved_model_path)
    loaded = tf.saved_model.load(saved_model_path)
    inference_func = loaded.signatures["serving_default"]
    [served] = inference_func(images).values()
    np.testing.assert_allclose(served, fresh, rtol=1e-5, atol=1e-5)

    # The same signature under another Mirrored strategy, on a distributed
    # dataset: each replica serves its half of the batch.
    predict_dataset = eval_dataset.map(lambda image, label: image)
    another_strategy = tfdist.strategy_from_config(cpu_replicas=2)
    with another_strategy.scope():
        loaded = tf.saved_model.load(saved_model_path)
        inference_func = loaded.signatures["serving_default"]
        dist_predict_dataset = another_strategy.experimental_distribute_dataset(predict_dataset)
        for batch in dist_predict_dataset:
            result = another_strategy.run(inference_func, args=(batch,))
            break
    halves = [next(iter(r.values())) for r in another_strategy.experimental_local_results(result)]
    assert len(halves) == 2
    np.testing.assert_allclose(np.concatenate(halves), fresh, rtol=1e-5, atol=1e-5)

    # Keras 3 writes a SavedModel with model.export; loaded with the low-level
    # API under a strategy, and with an I/O device on both sides.
    model = get_model()
    fresh = model.predict(images, verbose=0)
    exported_path = str(tmp_path / "exported")
    model.export(exported_path)
    with tfdist.strategy_from_config(cpu_replicas=2).scope():
        exported = tf.saved_model.load(exported_path)
    np.testing.assert_allclose(exported.serve(images), fresh, rtol=1e-5, atol=1e-5)

    localhost_path = str(tmp_path / "tf_save_localhost")
    tf.saved_model.save(
        model,
        localhost_path,
        options=tf.saved_model.SaveOptions(experimental_io_device="/job:localhost"),
    )
    with tfdist.strategy_from_config(cpu_replicas=2).scope():
        loaded = tf.saved_model.load(
            localhost_path,
            options=tf.saved_model.LoadOptions(experimental_io_device="/job:localhost"),
        )
    [served] = loaded.signatures["serving_default"](images).values()
    np.testing.assert_allclose(served, fresh, rtol=1e-5, atol=1e-5)

    # A subclassed model, with the tutorial's batch per replica, fit and saved.
    class SubclassedModel(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self._dense_layer = keras.layers.Dense(5, dtype="float32", name="output_layer")

        def call(self, inputs):
            return self._dense_layer(inputs)

    my_model = SubclassedModel()
    batch_size = 4 * mirrored_strategy.num_replicas_in_sync
    features = targets = tf.range(5, dtype=tf.float32)
    dataset = tf.data.Dataset.from_tensors((features, targets)).repeat(100).batch(batch_size)
    my_model.compile(optimizer="adam", loss="mean_squared_error")
    my_history = my_model.fit(dataset, epochs=2, verbose=0)
    assert my_history.history["loss"][-1] < my_history.history["loss"][0]
    subclassed_path = str(tmp_path / "subclassed.keras")
    my_model.save(subclassed_path)
    reloaded = keras.models.load_model(
        subclassed_path, custom_objects={"SubclassedModel": SubclassedModel}
    )
    probe = np.arange(10, dtype="float32").reshape(2, 5)
    np.testing.assert_allclose(
        reloaded.predict(probe, verbose=0), my_model.predict(probe, verbose=0), rtol=1e-6
    )
