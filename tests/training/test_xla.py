"""``compile(jit_compile=True)`` under tfdist's Mirrored (2 logical CPUs).

Stock Keras compiles ``strategy.run`` whole and fails; tfdist compiles each
replica's step and all-reduces outside XLA (tfdist.training.xla). An XLA
fit must equal the fit without XLA on the same data: the tolerances below
are what was measured, with a margin. The 2-worker case is in
tests/strategies/test_multi_worker.py, GPT-2 in tests/models.
"""

from __future__ import annotations

import gc
import logging

import numpy as np
import pytest

import tfdist
from canary import upstream_bug
from tfdist.errors import ConfigError

#: (weights' absolute, metrics' relative) tolerance of an XLA fit against the
#: fit without it, 16 steps of a 8-128-16-1 MLP (wide enough that top-k and
#: sign compress its two kernels: tensors under 1024 entries go whole).
#: Measured on TF 2.21 + Keras 3.15, the same under Mirrored and on 2 workers:
#: float32 weights within 1.8e-7 and metrics 2.2e-7 for every compression
#: setting but the 16-bit casts: fp16 7.6e-5 and 2.8e-5, bf16 5.3e-4 and
#: 2.4e-5 (a gradient XLA computed an ulp apart rounds to the next 16-bit
#: float, and momentum carries it); mixed_float16 1.6e-3 and 2.8e-4,
#: mixed_bfloat16 3.1e-3 and 6.6e-3 (XLA fuses the 16-bit casts
#: differently; bfloat16's step is 2**-8).
TOLERANCE = {
    "float32": (1e-6, 1e-6),
    "fp16": (5e-4, 2e-4),
    "bf16": (3e-3, 2e-4),
    "mixed_float16": (1e-2, 2e-3),
    "mixed_bfloat16": (2e-2, 3e-2),
}


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype("float32")
    return x, (x[:, :4].sum(axis=1, keepdims=True) - x[:, 4:].sum(axis=1, keepdims=True))


def _model(keras):
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(1),
        ]
    )


def _batches(x, y=None, batch=32):
    # Datasets read to their end: a fit stopped short leaves its iterator to
    # the garbage collector (see collect_failed_fit).
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices(x if y is None else (x, y)).batch(batch)


def _fit(
    strategy, keras, *, jit, steps_per_execution=1, accumulation=None, epochs=2, validate=False
):
    x, y = _data()
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = _model(keras)
        model.compile(
            optimizer=keras.optimizers.SGD(
                0.02, momentum=0.9, gradient_accumulation_steps=accumulation
            ),
            loss="mse",
            metrics=["mae"],
            jit_compile=jit,
            steps_per_execution=steps_per_execution,
        )
    history = model.fit(
        _batches(x, y),
        epochs=epochs,
        verbose=0,
        validation_data=_batches(x[:64], y[:64]) if validate else None,
    )
    result = {
        "model": model,
        "history": history.history,
        "weights": model.get_weights(),
        "iterations": int(model.optimizer.iterations.numpy()),
    }
    if validate:  # Evaluate and predict, each compiled per replica too.
        result["evaluate"] = model.evaluate(_batches(x, y), verbose=0)
        result["predict"] = model.predict(_batches(x[:40], batch=16), verbose=0)
    return result


def _assert_equal(xla, plain, tolerance):
    weights, metrics = tolerance
    assert xla["iterations"] == plain["iterations"]
    for a, b in zip(xla["weights"], plain["weights"]):
        np.testing.assert_allclose(a, b, atol=weights, rtol=0)
    for key in plain["history"]:
        np.testing.assert_allclose(xla["history"][key], plain["history"][key], rtol=metrics)
    if "evaluate" in plain:
        np.testing.assert_allclose(xla["evaluate"], plain["evaluate"], rtol=metrics)
        np.testing.assert_allclose(xla["predict"], plain["predict"], atol=10 * weights)


@pytest.fixture
def collect_failed_fit():
    """Destroys, at teardown, the iterator of a fit the test made raise.

    A fit stopped by an exception leaves Keras's epoch iterator in a
    reference cycle with its generator (``EpochIterator._enumerate_iterator``,
    suspended at its ``yield``), holding the distributed dataset's iterator
    until some later full collection, in another test. Destroying a tf.data
    iterator waits for its autotuning thread, which on TF 2.21 can miss the
    wake-up and sleep out its period: up to 60 s for an iterator a minute
    old, per pipeline (the host's and each replica's). In a full suite that
    was 2 minutes idle in a later test. Collected here, it is seconds old.
    """
    yield
    gc.collect()


@pytest.fixture
def policy(request):
    import keras

    before = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(request.param)
    yield request.param
    keras.mixed_precision.set_global_policy(before)


@pytest.mark.usefixtures("collect_failed_fit")
# The stock step fails while collectives run (tests/own_process.py).
@pytest.mark.own_process
def test_stock_keras_fails_with_jit_compile_under_mirrored(tf_cpus):
    import keras

    stock = tf_cpus.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with upstream_bug("xla.make_function", tf_cpus.errors.InvalidArgumentError, "from device"):
        _fit(stock, keras, jit=True, epochs=1)


@pytest.fixture(scope="module")
def uncompressed_loss(tf_cpus):
    import keras

    return _fit(tfdist.strategy_from_config(cpu_replicas=2), keras, jit=False)["history"]["loss"]


@pytest.mark.parametrize(
    "compression",
    [None, "fp16", "bf16", "topk:0.25", "randomk:0.25", "sign", "qsgd:16", "powersgd:2", "auto"],
)
def test_xla_fit_equals_the_fit_without_xla(tf_cpus, caplog, compression, uncompressed_loss):
    import keras

    caplog.set_level(logging.INFO, logger="absl")
    runs = {
        jit: _fit(
            tfdist.strategy_from_config(cpu_replicas=2, compression=compression),
            keras,
            jit=jit,
            validate=compression in (None, "powersgd:2"),
        )
        for jit in (False, True)
    }
    assert runs[True]["model"].jit_compile is True  # Still what the user asked for.
    said = [r.getMessage() for r in caplog.records if "fits with XLA" in r.getMessage()]
    assert said == [
        f"tfdist: {runs[True]['model'].name} fits with XLA: each replica's "
        "forward and backward pass is compiled; the all-reduce and the optimizer "
        "run outside XLA"
    ]
    assert runs[True]["history"]["loss"][-1] < runs[True]["history"]["loss"][0]
    if compression not in (None, "auto"):  # The compression was in effect.
        assert runs[False]["history"]["loss"] != uncompressed_loss
    _assert_equal(runs[True], runs[False], TOLERANCE.get(compression, TOLERANCE["float32"]))


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"], indirect=True)
@pytest.mark.parametrize("compression", [None, "powersgd:2"])
def test_xla_under_mixed_precision_equals_the_fit_without_xla(tf_cpus, policy, compression):
    import keras

    runs = {
        jit: _fit(
            tfdist.strategy_from_config(cpu_replicas=2, compression=compression),
            keras,
            jit=jit,
            validate=compression is None,
        )
        for jit in (False, True)
    }
    if policy == "mixed_float16":  # Keras wraps the optimizer: the loss-scale path.
        assert isinstance(runs[True]["model"].optimizer, keras.optimizers.LossScaleOptimizer)
    _assert_equal(runs[True], runs[False], TOLERANCE[policy])


@pytest.mark.parametrize("steps_per_execution,accumulation", [(3, None), (1, 2), (2, 2)])
def test_xla_with_several_steps_per_execution_or_accumulation(
    tf_cpus, steps_per_execution, accumulation
):
    import keras

    runs = {
        jit: _fit(
            tfdist.strategy_from_config(cpu_replicas=2),
            keras,
            jit=jit,
            steps_per_execution=steps_per_execution,
            accumulation=accumulation,
        )
        for jit in (False, True)
    }
    _assert_equal(runs[True], runs[False], TOLERANCE["float32"])


@pytest.mark.usefixtures("collect_failed_fit")
def test_the_replica_step_runs_under_xla(tf_cpus):
    # An op XLA cannot compile inside the model fails the step only if the
    # step is compiled: it is, and the error names the op.
    import keras
    import tensorflow as tf

    class Hashing(keras.layers.Layer):
        def call(self, x):
            hashed = tf.strings.to_hash_bucket_fast(tf.strings.as_string(x), 7)
            return x + tf.cast(hashed, x.dtype) * 0.0

    x, y = _data()
    with tfdist.strategy_from_config(cpu_replicas=2).scope():
        model = keras.Sequential([keras.Input((8,)), Hashing(), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    with pytest.raises(ConfigError) as caught:
        model.fit(_batches(x, y), epochs=1, verbose=0)
    assert caught.value.field == "jit_compile"
    assert "AsString" in str(caught.value) or "StringToHashBucketFast" in str(caught.value)
    with tfdist.strategy_from_config(cpu_replicas=2).scope():
        model = keras.Sequential([keras.Input((8,)), Hashing(), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse", jit_compile=False)
    assert np.isfinite(model.fit(_batches(x, y), epochs=1, verbose=0).history["loss"][0])


def test_a_layer_without_xla_support_is_refused_at_compile(tf_cpus):
    import keras

    class NoJit(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.supports_jit = False

        def call(self, x):
            return x

    with tfdist.strategy_from_config(cpu_replicas=2).scope():
        model = keras.Sequential([keras.Input((8,)), NoJit(name="lookup"), keras.layers.Dense(1)])
        with pytest.raises(ConfigError) as caught:
            model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    assert caught.value.field == "jit_compile" and "lookup (NoJit)" in str(caught.value)
    assert "tf.data" in str(caught.value)


def test_synchronized_batch_norm_is_refused_at_compile(tf_cpus):
    import keras

    with tfdist.strategy_from_config(cpu_replicas=2).scope():
        model = keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(4),
                keras.layers.BatchNormalization(synchronized=True, name="bn"),
                keras.layers.Dense(1),
            ]
        )
        with pytest.raises(ConfigError) as caught:
            model.compile(optimizer="sgd", loss="mse", jit_compile=True)
        message = str(caught.value)
        assert "bn (BatchNormalization(synchronized=True))" in message
        assert "synchronized=False" in message
        model.compile(optimizer="sgd", loss="mse", jit_compile=False)  # Still compiles.
    assert model.compiled and model.jit_compile is False


@pytest.mark.usefixtures("collect_failed_fit")
def test_a_step_that_applies_twice_is_refused(tf_cpus):
    import keras
    import tensorflow as tf

    class TwoOptimizers(keras.Model):
        def __init__(self):
            super().__init__()
            self.a, self.b = keras.layers.Dense(4), keras.layers.Dense(1)
            self.second = keras.optimizers.SGD(0.01)

        def call(self, x):
            return self.b(self.a(x))

        def train_step(self, data):
            x, y = data
            for optimizer, layer in ((self.optimizer, self.a), (self.second, self.b)):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean((self(x) - y) ** 2)
                grads = tape.gradient(loss, layer.trainable_weights)
                optimizer.apply_gradients(zip(grads, layer.trainable_weights))
            return {"loss": loss}

    x, y = _data()
    with tfdist.strategy_from_config(cpu_replicas=2).scope():
        model = TwoOptimizers()
        model(x[:1])
        model.second.build(model.b.trainable_weights)
        model.compile(optimizer=keras.optimizers.SGD(0.01), jit_compile=True)
    with pytest.raises(ConfigError) as caught:
        model.fit(_batches(x, y), epochs=1, verbose=0)
    assert "applied gradients 2 times" in str(caught.value)


def test_auto_resolves_as_keras_does_without_a_strategy(tf_cpus, caplog):
    # On CPU replicas Keras chooses no XLA without a strategy, and so does
    # tfdist; describe() and the fit's log line say so. (A GPU, where both
    # choose XLA, is untested.)
    import keras

    caplog.set_level(logging.INFO, logger="absl")
    strategy = tfdist.strategy_from_config(cpu_replicas=2)
    with strategy.scope():
        model = _model(keras)
        model.compile(optimizer="sgd", loss="mse")
    alone = _model(keras)
    alone.compile(optimizer="sgd", loss="mse")
    assert model.jit_compile is alone.jit_compile is False
    assert "jit_compile='auto' resolves to off (CPU replicas" in strategy.describe()
    x, y = _data()
    model.fit(_batches(x, y), epochs=2, verbose=0)
    said = [r.getMessage() for r in caplog.records if "fits without XLA" in r.getMessage()]
    assert said == [
        f"tfdist: {model.name} fits without XLA (jit_compile='auto' resolves to "
        "off: CPU replicas, as Keras without a strategy)"
    ]  # Once per compile.
    with strategy.scope():
        model.compile(optimizer="sgd", loss="mse", jit_compile=False)
    model.fit(_batches(x, y), epochs=1, verbose=0)
    said = [r.getMessage() for r in caplog.records if "fits without XLA" in r.getMessage()]
    assert said[-1] == f"tfdist: {model.name} fits without XLA (jit_compile=False)"


def test_tpu_is_refused_at_compile(tf_cpus):
    # No TPU here: tfdist's TPUStrategy class itself, never connected, is
    # enough for the check (it reads the strategy's kind).
    import keras

    from tfdist.strategies.tpu import TPUStrategy
    from tfdist.training import xla

    strategy = object.__new__(TPUStrategy)
    with pytest.raises(ConfigError) as caught:
        xla.check_compile(_model(keras), strategy)
    assert caught.value.field == "jit_compile"
    assert "TPUStrategy compiles every step with XLA already" in str(caught.value)


def test_sharded_layers_are_refused_only_when_sharded(tf_cpus):
    # tfdist.parallel's layers all-reduce in their forward pass under
    # model_parallel > 1; without a mesh they are plain Dense layers.
    import keras

    from tfdist import parallel as tp

    def build():
        return keras.Sequential(
            [
                keras.Input((8,)),
                tp.ColumnParallelDense(8, name="ffn_in"),
                tp.RowParallelDense(1, name="ffn_out"),
            ]
        )

    with tfdist.strategy_from_config(cpu_replicas=2, model_parallel=2).scope():
        model = build()
        with pytest.raises(ConfigError) as caught:
            model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    assert "ffn_in (ColumnParallelDense, sharded by tfdist.parallel)" in str(caught.value)
    x, y = _data()
    with tfdist.strategy_from_config(cpu_replicas=2).scope():
        model = build()
        model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    assert np.isfinite(model.fit(_batches(x, y), epochs=1, verbose=0).history["loss"][0])
