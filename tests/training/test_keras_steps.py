"""steps_per_execution > 1 under tfdist's Mirrored (2 logical CPUs).

Keras 3.15 fails there under TensorFlow's own strategy
(keras-team/keras#19246); tfdist traces the step inline. The 2-process
MultiWorkerMirrored case is in test_multi_worker.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import tfdist
from canary import upstream_bug


def _fit(strategy, steps_per_execution, keras):
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
        )
        model.compile(
            optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
            loss="mse",
            metrics=["mae"],
            steps_per_execution=steps_per_execution,
        )
    rng = np.random.default_rng(0)
    x = rng.random((250, 8)).astype("float32")  # 8 steps of 32: the last one partial.
    y = x.sum(axis=1, keepdims=True)
    history = model.fit(
        x, y, batch_size=32, epochs=2, verbose=0, shuffle=False, validation_data=(x[:64], y[:64])
    )
    return {
        "history": history.history,
        "iterations": int(model.optimizer.iterations.numpy()),
        "weights": model.get_weights(),
        "evaluate": model.evaluate(x, y, verbose=0),
    }


# The stock step fails while collectives run (tests/own_process.py).
@pytest.mark.own_process
def test_stock_keras_fails_with_several_steps_per_execution_under_mirrored(tf_cpus):
    import keras

    stock = tf_cpus.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with upstream_bug(
        "inline_steps.make_function", tf_cpus.errors.InvalidArgumentError, "must feed a value"
    ):
        _fit(stock, 4, keras)


@pytest.mark.parametrize("steps_per_execution,compression", [(4, None), (3, "powersgd:2")])
def test_several_steps_per_execution_train_like_one(tf_cpus, steps_per_execution, compression):
    import keras

    one = _fit(tfdist.strategy_from_config(cpu_replicas=2, compression=compression), 1, keras)
    many = _fit(
        tfdist.strategy_from_config(cpu_replicas=2, compression=compression),
        steps_per_execution,
        keras,
    )
    assert one["iterations"] == many["iterations"] == 2 * 8
    assert many["history"]["loss"][-1] < 0.5 * many["history"]["loss"][0]
    for key in ("loss", "mae", "val_loss", "val_mae"):
        np.testing.assert_allclose(many["history"][key], one["history"][key], rtol=1e-6)
    for a, b in zip(many["weights"], one["weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(many["evaluate"], one["evaluate"], rtol=1e-6)
