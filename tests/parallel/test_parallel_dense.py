"""ColumnParallelDense and RowParallelDense under plain Keras ``fit``, on logical CPUs.

Every check compares against the unsharded Keras model (Dense layers) with
the same initial weights and data, trained the same way: T=2 on 2 replicas,
and DP=2 x T=2 on 4.
"""

from __future__ import annotations

import numpy as np
import pytest

import tfdist
from tfdist import parallel as tp
from tfdist.errors import ConfigError

TOL = 1e-5


def mesh_strategy(replicas: int, model_parallel: int, **kwargs):
    strategy = tfdist.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)], **kwargs)
    tp.attach(strategy, model_parallel)
    return strategy


def data(rows=64, features=8, outputs=4, seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(rows, features)).astype("float32"),
        rng.normal(size=(rows, outputs)).astype("float32"),
    )


def mlp(column, row, hidden=16, optimizer=None, row_bias=True, **compile_kwargs):
    """``optimizer``: a function making it (called here, in the caller's scope)."""
    import keras

    model = keras.Sequential(
        [keras.Input((8,)), column(hidden, activation="relu"), row(4, use_bias=row_bias)]
    )
    model.compile(
        optimizer=optimizer() if optimizer else keras.optimizers.Adam(0.01),
        loss="mse",
        **compile_kwargs,
    )
    return model


def dense_mlp(**kwargs):
    import keras

    return mlp(keras.layers.Dense, keras.layers.Dense, **kwargs)


def parallel_mlp(strategy, weights, **kwargs):
    with strategy.scope():
        model = mlp(tp.ColumnParallelDense, tp.RowParallelDense, **kwargs)
    for variable, value in zip(model.weights, weights):
        tp.assign_full(variable, value)
    return model


def full_weights(model):
    return [tp.full_value(v) for v in model.weights]


def assert_close(actual, expected, tol=TOL):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, atol=tol, rtol=tol)


@pytest.fixture(scope="module")
def t2(tf_cpus):
    return mesh_strategy(2, 2)


@pytest.fixture(scope="module")
def dp2_tp2(tf_cpus):
    return mesh_strategy(4, 2)


def fit_both(strategy, epochs=2, batch_size=16, make_optimizer=None, fit_kwargs=None, **kwargs):
    """(reference history, reference, parallel history, parallel model)."""
    x, y = data()
    reference = dense_mlp(optimizer=make_optimizer, **kwargs)
    model = parallel_mlp(strategy, reference.get_weights(), optimizer=make_optimizer, **kwargs)
    options = dict(
        batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, **(fit_kwargs or {})
    )
    expected = reference.fit(x, y, **options).history
    got = model.fit(x, y, **options).history
    return expected, reference, got, model


@pytest.mark.parametrize("mesh", ["t2", "dp2_tp2"])
def test_fit_matches_the_unsharded_model(request, mesh):
    strategy = request.getfixturevalue(mesh)
    expected, reference, got, model = fit_both(strategy, epochs=3)
    np.testing.assert_allclose(got["loss"], expected["loss"], rtol=TOL)
    assert got["loss"][-1] < got["loss"][0]  # It trained.
    assert_close(full_weights(model), reference.get_weights())
    # The weights are shards: half the hidden units on each replica.
    assert [tuple(v.shape) for v in model.weights] == [(8, 8), (8,), (8, 4), (4,)]
    x, y = data(seed=1)
    np.testing.assert_allclose(
        model.predict(x, batch_size=16, verbose=0),
        reference.predict(x, batch_size=16, verbose=0),
        atol=TOL,
    )
    np.testing.assert_allclose(
        model.evaluate(x, y, batch_size=16, verbose=0),
        reference.evaluate(x, y, batch_size=16, verbose=0),
        rtol=TOL,
    )
    # A direct call in the scope's cross-replica context uses the full weights.
    np.testing.assert_allclose(model(x).numpy(), reference(x).numpy(), atol=TOL)


def test_each_replica_holds_a_different_shard(t2):
    import keras

    reference = dense_mlp()
    model = parallel_mlp(t2, reference.get_weights())
    kernel = model.layers[0].kernel
    first, second = t2.experimental_local_results(kernel.value)
    full = reference.layers[0].kernel.numpy()
    np.testing.assert_array_equal(first.numpy(), full[:, :8])
    np.testing.assert_array_equal(second.numpy(), full[:, 8:])
    assert isinstance(model.layers[0], keras.layers.Dense)
    assert tp.spec_of(model.layers[1].bias) is None  # The row layer's bias is whole.


@pytest.mark.parametrize("name", ["sgd_momentum", "rmsprop", "adamw", "adagrad", "lion"])
def test_every_optimizer_matches(dp2_tp2, name):
    import keras

    make = {
        "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
        "rmsprop": lambda: keras.optimizers.RMSprop(0.01),
        "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
        "adagrad": lambda: keras.optimizers.Adagrad(0.1),
        "lion": lambda: keras.optimizers.Lion(0.003),
    }[name]
    expected, reference, got, model = fit_both(dp2_tp2, epochs=1, make_optimizer=make)
    np.testing.assert_allclose(got["loss"], expected["loss"], rtol=TOL)
    assert_close(full_weights(model), reference.get_weights())


def test_steps_per_execution_and_callbacks(dp2_tp2, tmp_path):
    import keras

    log = tmp_path / "log.csv"

    def callbacks():
        return [
            keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=1, factor=0.5),
            keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.9),
            keras.callbacks.EarlyStopping(monitor="loss", patience=5),
            keras.callbacks.CSVLogger(str(log)),
        ]

    x, y = data()
    reference = dense_mlp(steps_per_execution=2)
    model = parallel_mlp(dp2_tp2, reference.get_weights(), steps_per_execution=2)
    options = dict(batch_size=16, epochs=3, shuffle=False, verbose=0)
    expected = reference.fit(x, y, callbacks=callbacks(), **options).history
    got = model.fit(x, y, callbacks=callbacks(), **options).history
    np.testing.assert_allclose(got["loss"], expected["loss"], rtol=TOL)
    np.testing.assert_allclose(got["learning_rate"], expected["learning_rate"], rtol=TOL)
    assert_close(full_weights(model), reference.get_weights())
    assert len(log.read_text().splitlines()) == 1 + 3  # CSVLogger saw every epoch.


def test_regularizers_count_the_full_weight(t2):
    import keras

    x, y = data()

    def build(column, row):
        model = keras.Sequential(
            [
                keras.Input((8,)),
                column(
                    16,
                    activation="relu",
                    kernel_regularizer=keras.regularizers.L2(0.01),
                    bias_regularizer=keras.regularizers.L1(0.01),
                ),
                row(4, kernel_regularizer=keras.regularizers.L2(0.01)),
            ]
        )
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        return model

    reference = build(keras.layers.Dense, keras.layers.Dense)
    with t2.scope():
        model = build(tp.ColumnParallelDense, tp.RowParallelDense)
    for variable, value in zip(model.weights, reference.get_weights()):
        tp.assign_full(variable, value)
    options = dict(batch_size=16, epochs=2, shuffle=False, verbose=0)
    expected = reference.fit(x, y, **options).history["loss"]
    got = model.fit(x, y, **options).history["loss"]
    np.testing.assert_allclose(got, expected, rtol=TOL)
    assert_close(full_weights(model), reference.get_weights())


def test_gathered_output_and_whole_input_variants_equal_dense(dp2_tp2):
    import keras

    x, y = data()

    def build(first, second):
        model = keras.Sequential(
            [
                keras.Input((8,)),
                first(12, activation="tanh"),
                keras.layers.LayerNormalization(),
                second(4),
            ]
        )
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        return model

    reference = build(keras.layers.Dense, keras.layers.Dense)
    with dp2_tp2.scope():
        model = build(
            lambda u, **k: tp.ColumnParallelDense(u, gather_output=True, **k),
            lambda u, **k: tp.RowParallelDense(u, input_is_parallel=False, **k),
        )
    for variable, value in zip(model.weights, reference.get_weights()):
        tp.assign_full(variable, value)
    options = dict(batch_size=16, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(
        model.fit(x, y, **options).history["loss"],
        reference.fit(x, y, **options).history["loss"],
        rtol=TOL,
    )
    assert_close(full_weights(model), reference.get_weights())


def test_without_a_mesh_the_layers_are_dense(tf_cpus):
    import keras

    x, _ = data()
    for scope in (None, tfdist.MirroredStrategy(["/cpu:0", "/cpu:1"])):
        if scope is not None:
            assert tp.attach(scope, 1) is None and tp.mesh_of(scope) is None
        with scope.scope() if scope else _null():
            column = tp.ColumnParallelDense(6, activation="relu", name="c")
            row = tp.RowParallelDense(3, name="r")
            out = row(column(x[:4]))
        plain_c, plain_r = keras.layers.Dense(6, activation="relu"), keras.layers.Dense(3)
        plain_c.build((None, 8))
        plain_r.build((None, 6))
        plain_c.set_weights(column.get_weights())
        plain_r.set_weights(row.get_weights())
        np.testing.assert_array_equal(out, plain_r(plain_c(x[:4])))
        assert [w.shape for w in column.weights] == [(8, 6), (6,)]
        assert tp.spec_of(column.kernel) is None


def _null():
    import contextlib

    return contextlib.nullcontext()


def test_a_width_the_group_does_not_divide_names_the_layer(t2):
    import keras

    with t2.scope():
        layer = tp.ColumnParallelDense(7, name="ffn_in")
        with pytest.raises(ConfigError) as error:
            layer(keras.Input((8,)))
    assert "ffn_in" in str(error.value) and "7" in str(error.value)
    assert "model_parallel=2" in str(error.value)


def test_a_group_size_that_does_not_divide_the_replicas(tf_cpus):
    strategy = tfdist.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"])
    with pytest.raises(ConfigError) as error:
        tp.attach(strategy, 2)
    assert "model_parallel" in str(error.value) and "3 replicas" in str(error.value)
    for bad in (0, -2, "two", 1.5, True):
        with pytest.raises(ConfigError, match="model_parallel"):
            tp.attach(strategy, bad)


def test_the_wire_bytes_split_into_activations_and_gradients(dp2_tp2):
    # Counted per replica per step by the collectives themselves, checked
    # here against the ring formulas applied to the layer shapes.
    x, y = data()
    model = parallel_mlp(dp2_tp2, dense_mlp().get_weights())
    model.fit(x[:16], y[:16], batch_size=16, epochs=1, verbose=0)  # Traced and built.
    tp.reset_traffic(dp2_tp2)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)  # 4 steps.
    sent = tp.traffic(dp2_tp2)
    b, t, n, dp, steps, f32 = 4, 2, 4, 2, 4, 4
    gather = (t - 1) * f32
    reduce = 2 * (t - 1) / t * f32
    # gather_rows of the input (data: its gradient is never computed), and
    # scatter_rows of the output and its gradient.
    per_step_tp = gather * b * 8 + reduce * t * b * 4 + gather * b * 4
    shard = (8 * 8 + 8 + 8 * 4) * f32  # column kernel, bias; row kernel
    whole = 4 * f32  # the row bias, all replicas
    per_step_dp = 2 * (dp - 1) / dp * shard + 2 * (n - 1) / n * whole
    assert sent["tensor_parallel"] == pytest.approx(steps * per_step_tp)
    assert sent["data_parallel"] == pytest.approx(steps * per_step_dp)
    # The Keras callback logs the same per step, beside the dense reference
    # (the full model's gradients all-reduced over the 4 replicas).
    from tfdist.compression import CommunicationStats

    stats = CommunicationStats(every_batch=True)
    logs = model.fit(
        x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[stats]
    ).history
    assert logs["comm_tensor_parallel_bytes"] == [pytest.approx(per_step_tp)]
    assert logs["comm_data_parallel_bytes"] == [pytest.approx(per_step_dp)]
    full = (8 * 16 + 16 + 16 * 4 + 4) * f32
    assert logs["comm_dense_bytes"] == [pytest.approx(2 * (n - 1) / n * full)]
    assert stats.total_bytes == pytest.approx(steps * (per_step_tp + per_step_dp))


def test_compression_applies_to_the_data_parallel_sums(tf_cpus):
    # With every weight sharded (no row bias) and an elementwise compressor,
    # DP=2 x T=2 is the unsharded model on DP=2 with the same compression:
    # tensor group d holds the rows that replica d holds there.
    x, y = data()
    sums = {}
    for setting in ("fp16", "none"):
        mesh = mesh_strategy(4, 2, compression=setting)
        plain = tfdist.MirroredStrategy(["/cpu:0", "/cpu:1"], compression=setting)
        with plain.scope():
            reference = dense_mlp(row_bias=False)
        model = parallel_mlp(mesh, reference.get_weights(), row_bias=False)
        options = dict(batch_size=16, epochs=2, shuffle=False, verbose=0)
        expected = reference.fit(x, y, **options).history["loss"]
        tp.reset_traffic(mesh)
        got = model.fit(x, y, **options).history["loss"]
        np.testing.assert_allclose(got, expected, rtol=TOL)
        assert_close(full_weights(model), reference.get_weights())
        sums[setting] = tp.traffic(mesh)
    assert sums["fp16"]["data_parallel"] == pytest.approx(sums["none"]["data_parallel"] / 2)
    assert sums["fp16"]["tensor_parallel"] == sums["none"]["tensor_parallel"]


@pytest.mark.parametrize("setting", ["topk:0.25", "powersgd:2"])
def test_lossy_compression_composes_and_trains(dp2_tp2, setting):
    x, y = data()
    strategy = mesh_strategy(4, 2, compression=setting)
    model = parallel_mlp(strategy, dense_mlp().get_weights())
    losses = model.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0).history["loss"]
    assert losses[-1] < 0.8 * losses[0], losses


def test_mixed_precision(dp2_tp2):
    import keras

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        expected, reference, got, model = fit_both(dp2_tp2, epochs=2)
        assert model.layers[0].compute_dtype == "float16"
    finally:
        keras.mixed_precision.set_global_policy("float32")
    np.testing.assert_allclose(got["loss"], expected["loss"], rtol=1e-2)
    assert_close(full_weights(model), reference.get_weights(), tol=1e-2)


def test_private_tensorflow_apis_are_checked(tf_cpus, monkeypatch):
    from tensorflow.python.distribute import cross_device_utils

    from tfdist.parallel import collectives

    collectives.check_tensorflow()  # This TensorFlow has them.
    monkeypatch.delattr(cross_device_utils.CollectiveReplicaLauncher, "_all_gather")
    with pytest.raises(RuntimeError, match="CollectiveReplicaLauncher._all_gather"):
        tp.attach(tfdist.MirroredStrategy(["/cpu:0", "/cpu:1"]), 2)
