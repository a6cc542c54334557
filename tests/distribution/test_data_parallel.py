"""keras.distribution.DataParallel trains on tfdist's Mirrored strategy
(tfdist.distribution.data_parallel), on 2 logical CPUs."""

from __future__ import annotations

import numpy as np
import pytest

import tfdist
from conftest import finish, start


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 8)).astype("float32")
    return x, x[:, :4].sum(axis=1, keepdims=True) - x[:, 4:].sum(axis=1, keepdims=True)


def _fit(keras, widths=(16,)):
    """Builds, compiles and fits under whatever is current; the model and losses."""
    x, y = _data()
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((8,))]
        + [keras.layers.Dense(w, activation="relu") for w in widths]
        + [keras.layers.Dense(1)]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    import tensorflow as tf

    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)  # As the 2-process job.
    return model, model.fit(data, epochs=2, verbose=0).history["loss"]


def test_data_parallel_trains_on_tfdists_mirrored(keras_mod):
    keras = keras_mod
    import tensorflow as tf

    distribution = keras.distribution.DataParallel(devices=["cpu:0", "cpu:1"])
    keras.distribution.set_distribution(distribution)
    model, losses = _fit(keras)
    strategy = model.distribute_strategy
    keras.distribution.set_distribution(None)
    # Keras alone trains on one device here; the model is replicated instead.
    assert isinstance(strategy, tfdist.MirroredStrategy)
    assert strategy.num_replicas_in_sync == 2
    assert type(model.layers[0].kernel.value).__name__ == "MirroredVariable"
    assert not tf.distribute.has_strategy()  # Cleared with the distribution.
    # As a scope, the form Keras's docs use; the same object keeps its strategy.
    with distribution.scope():
        again, _ = _fit(keras)
    assert again.distribute_strategy is strategy
    assert keras.distribution.distribution() is None and not tf.distribute.has_strategy()
    # The same run as tfdist's Mirrored strategy itself.
    with tfdist.strategy_from_config(cpu_replicas=2).scope():
        reference, reference_losses = _fit(keras)
    assert losses == reference_losses
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_data_parallel_with_tfdists_compression(keras_mod):
    from tfdist.distribution import DataParallel

    keras = keras_mod
    # Top-k (no warm-up) compresses the 8 x 128 and 128 x 16 kernels (it
    # sends tensors under 1024 entries whole).
    keras.distribution.set_distribution(
        DataParallel(devices=["cpu:0", "cpu:1"], compression="topk:0.25")
    )
    model, losses = _fit(keras, widths=(128, 16))
    keras.distribution.set_distribution(None)
    assert str(model.distribute_strategy.compression).startswith("topk")
    with tfdist.strategy_from_config(cpu_replicas=2, compression="topk:0.25").scope():
        reference = _fit(keras, widths=(128, 16))[1]
    np.testing.assert_allclose(losses, reference, rtol=1e-6)
    with tfdist.strategy_from_config(cpu_replicas=2).scope():  # The same, uncompressed.
        uncompressed = _fit(keras, widths=(128, 16))[1]
    assert losses != uncompressed


def test_a_mesh_of_devices_this_process_lacks_is_named(keras_mod):
    keras = keras_mod
    import tensorflow as tf

    good = keras.distribution.DataParallel(devices=["cpu:0", "cpu:1"])
    keras.distribution.set_distribution(good)
    with pytest.raises(tfdist.ConfigError) as caught:
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(devices=["cpu:0", "cpu:9"])
        )
    assert caught.value.field == "device_mesh"
    assert "/cpu:9 not found" in str(caught.value)
    # Nothing changed: the distribution set before is still in force.
    assert keras.distribution.distribution() is good
    assert tf.distribute.get_strategy() is tfdist.distribution.data_parallel.strategy_of(good)


def test_a_distribution_tfdist_does_not_know_is_refused(keras_mod):
    # DataParallel and ModelParallel are honoured (test_model_parallel.py);
    # any other Distribution would train unsharded, so it is refused.
    keras = keras_mod
    from tfdist.compat.keras_src import distribution_lib

    class Custom(distribution_lib.Distribution):  # Keras exports no base class.
        def get_data_layout(self, data_shape):
            return None

        def get_variable_layout(self, variable):
            return None

        def get_tensor_layout(self, path):
            return None

    mesh = keras.distribution.DeviceMesh((2,), ("batch",), ["cpu:0", "cpu:1"])
    with pytest.raises(tfdist.KerasDistributionError) as caught:
        keras.distribution.set_distribution(Custom(mesh))
    assert "keras.distribution.Custom " in str(caught.value)
    assert keras.distribution.distribution() is None


def test_tfdist_imported_before_keras_wraps_set_distribution():
    # import tfdist loads no Keras; Keras's import then installs the wrapper.
    code = (
        "import sys, tfdist; loaded = 'keras' in sys.modules; import keras; "
        "print(loaded, hasattr(keras.distribution.set_distribution, '__wrapped__'))"
    )
    proc = start(["-c", code], fresh=True)  # The import order is the point.
    [(status, out, err)] = finish([proc], timeout=120)
    assert status == 0, err[-3000:]
    assert out.split()[-2:] == ["False", "True"], out
