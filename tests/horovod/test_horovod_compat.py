"""Horovod-era Keras spellings in Keras 3 (tfdist.horovod.compat), one process.

Each spelling works, warns once per process, and Keras's own behaviour is
unchanged: other bad compile arguments still raise Keras's TypeError, and
``optimizer.variables`` is still a list to len, iteration, indexing, ``+``,
keras.tree and tf.nest, and to Keras's own saving and loss scaling.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from tfdist.horovod import compat


@pytest.fixture(scope="module")
def keras(tf_cpus):
    compat.install()
    import keras

    return keras


@pytest.fixture(autouse=True)
def fresh_warnings():
    """Each test sees every spelling as not yet warned about."""
    compat._warned.clear()
    yield
    compat._warned.clear()


def spelling_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, compat.HorovodSpellingWarning)]


def small_model(keras):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="d")])
    return model


def built_adam(keras, lr=0.01):
    opt = keras.optimizers.Adam(lr)
    opt.build([keras.Variable(np.zeros((2, 2), "float32"))])
    return opt


def test_install_is_idempotent(keras):
    compile_fn = keras.Model.compile
    variables_prop = keras.optimizers.Optimizer.variables
    compat.install()
    compat.install()
    assert compat.is_installed()
    assert keras.Model.compile is compile_fn
    # Installing the registry's feature again must not wrap twice either.
    from tfdist import compat as compat_layer
    from tfdist.compat.keras_src import BaseOptimizer

    assert compat_layer.install("horovod_spellings")
    assert keras.Model.compile is compile_fn
    assert BaseOptimizer.__dict__["variables"].fget is variables_prop.fget
    assert keras.Model.compile.__tfdist_patches__.count("horovod_spellings.compile") == 1


def test_compile_drops_experimental_run_tf_function_and_warns_once(keras):
    model = small_model(keras)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model.compile(optimizer="sgd", loss="mse", experimental_run_tf_function=False)
        model.compile(optimizer="sgd", loss="mse", experimental_run_tf_function=False)
    messages = spelling_warnings(record)
    assert len(messages) == 1
    assert "experimental_run_tf_function" in messages[0]
    assert record[0].filename == __file__  # points at the caller's line
    # The compile took effect: the model trains with the given loss and optimizer.
    assert model.loss == "mse"
    assert isinstance(model.optimizer, keras.optimizers.SGD)
    history = model.fit(
        np.ones((4, 3), "float32"), np.zeros((4, 2), "float32"), epochs=1, verbose=0
    )
    assert np.isfinite(history.history["loss"][0])


def test_compile_other_bad_argument_still_raises_keras_type_error(keras):
    model = small_model(keras)
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_arg'"):
        model.compile(optimizer="sgd", loss="mse", no_such_arg=1)
    # Also when the Horovod argument comes with it: only that one is forgiven.
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_arg'"):
        model.compile(
            optimizer="sgd", loss="mse", experimental_run_tf_function=False, no_such_arg=1
        )


def test_compile_signature_is_keras_s(keras):
    import inspect

    params = inspect.signature(keras.Model.compile).parameters
    assert "optimizer" in params and "jit_compile" in params
    assert compat.RUN_TF_FUNCTION_ARG not in params


def test_variables_call_returns_the_same_variables_and_warns_once(keras):
    opt = built_adam(keras)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        called = opt.variables()
        again = opt.variables()
    assert type(called) is list
    assert [id(v) for v in called] == [id(v) for v in opt.variables] == [id(v) for v in again]
    # iterations, learning rate, and Adam's two slots for the one variable.
    assert len(called) == 4
    messages = spelling_warnings(record)
    assert len(messages) == 1 and "variables()" in messages[0]
    assert record[0].filename == __file__


def test_variables_property_is_still_a_list(keras):
    import tensorflow as tf

    opt = built_adam(keras)
    variables = opt.variables
    assert isinstance(variables, list)
    names = [v.name for v in opt._variables]
    assert [v.name for v in variables] == names
    assert variables[0] is opt._variables[0]
    assert [v.name for v in variables[1:]] == names[1:]
    assert type(variables + [1]) is list and len(variables + [1]) == len(names) + 1
    assert type([1] + variables) is list and len([1] + variables) == len(names) + 1
    assert variables == list(opt._variables)
    # A copy, as in Keras: changing it leaves the optimizer alone.
    variables.append(None)
    assert len(opt.variables) == len(names)
    # Nested-structure tools see a list of variables, not one leaf.
    assert len(keras.tree.flatten(opt.variables)) == len(names)
    assert keras.tree.is_nested(opt.variables)
    shapes = keras.tree.map_structure(lambda v: tuple(v.shape), opt.variables)
    assert shapes == [tuple(v.shape) for v in opt._variables]
    assert len(tf.nest.flatten(opt.variables)) == len(names)


def test_loss_scale_optimizer_variables_callable(keras):
    inner = keras.optimizers.SGD(0.1, momentum=0.9)
    opt = keras.optimizers.LossScaleOptimizer(inner)
    opt.build([keras.Variable(np.zeros((3,), "float32"))])
    expected = opt._variables + inner.variables
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert [id(v) for v in opt.variables()] == [id(v) for v in expected]
    assert isinstance(opt.variables, list) and len(opt.variables) == len(expected)


def test_subclass_made_after_install_overriding_variables(keras):
    class Extra(keras.optimizers.SGD):
        @property
        def variables(self):
            return super().variables + [self.extra]

    opt = Extra(0.1)
    opt.build([keras.Variable(np.zeros((3,), "float32"))])
    opt.extra = keras.Variable(1.0)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        called = opt.variables()
    assert called[-1] is opt.extra
    assert len(called) == len(opt._variables) + 1


def test_optimizer_save_and_load_unchanged(keras, tmp_path):
    # Keras's own use of optimizer.variables (model saving) still works.
    model = small_model(keras)
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    x, y = np.ones((8, 3), "float32"), np.full((8, 2), 2.0, "float32")
    model.fit(x, y, epochs=2, verbose=0)
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    saved = [np.asarray(v) for v in model.optimizer.variables]
    restored = [np.asarray(v) for v in loaded.optimizer.variables]
    assert len(saved) == len(restored) and len(saved) > 2
    for a, b in zip(saved, restored):
        np.testing.assert_array_equal(a, b)


def test_lr_reads_and_assigns_learning_rate_and_warns_once(keras):
    opt = built_adam(keras, lr=0.01)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        opt.lr = 0.02  # the first use is an assignment
        assert opt.lr is opt.learning_rate  # the Variable itself, as in Keras 2
        np.testing.assert_allclose(float(opt.lr), 0.02, rtol=1e-6)
        opt.lr = 0.5
        np.testing.assert_allclose(float(opt.learning_rate), 0.5, rtol=1e-6)
        opt.lr.assign(0.25)  # Horovod's elastic reset callbacks
        np.testing.assert_allclose(float(opt.learning_rate), 0.25, rtol=1e-6)
    messages = spelling_warnings(record)
    assert len(messages) == 1 and "learning_rate" in messages[0]
    # Named at the script's line, also for the setter (behind Keras's __setattr__).
    assert [w.filename for w in record if w.category is compat.HorovodSpellingWarning] == [__file__]


def test_legacy_set_value_on_keras_variables(keras):
    import tensorflow as tf

    opt = built_adam(keras, lr=0.01)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        # Horovod's Keras elastic example resets the rate this way.
        tf.keras.backend.set_value(opt.learning_rate, 0.125)
        tf.keras.backend.set_value(opt.learning_rate, 0.0625)
    np.testing.assert_allclose(float(opt.learning_rate), 0.0625, rtol=1e-6)
    messages = spelling_warnings(record)
    assert len(messages) == 1 and "assign" in messages[0]
    assert record[0].filename == __file__
    tf.keras.backend.batch_set_value([(opt.learning_rate, 0.5), (opt.iterations, 7)])
    assert float(opt.learning_rate) == 0.5 and int(opt.iterations) == 7
    # TF variables keep working as before, without a warning.
    tf_var = tf.Variable(1.0)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        tf.keras.backend.set_value(tf_var, 3.0)
    assert float(tf_var) == 3.0 and not spelling_warnings(record)


def test_lr_with_a_schedule(keras):
    schedule = keras.optimizers.schedules.ExponentialDecay(1.0, decay_steps=1, decay_rate=0.5)
    opt = keras.optimizers.SGD(schedule)
    opt.build([keras.Variable(np.zeros((2,), "float32"))])
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        np.testing.assert_allclose(float(opt.lr), float(opt.learning_rate))
        # Keras's own rule holds through the alias: a schedule is not settable.
        with pytest.raises(TypeError, match="not settable"):
            opt.lr = 0.3
    assert opt._learning_rate is schedule


def test_unknown_attribute_still_raises(keras):
    opt = keras.optimizers.Adam(0.01)
    with pytest.raises(AttributeError, match="no attribute 'lrr'"):
        opt.lrr  # noqa: B018


def test_each_spelling_warns_independently(keras):
    opt = built_adam(keras)
    model = small_model(keras)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            opt.lr  # noqa: B018
            opt.variables()
            model.compile(optimizer="sgd", loss="mse", experimental_run_tf_function=True)
    messages = spelling_warnings(record)
    assert len(messages) == 3
    assert sum("lr" in m and "learning_rate" in m for m in messages) == 1
    assert sum("variables()" in m for m in messages) == 1
    assert sum("experimental_run_tf_function" in m for m in messages) == 1


def test_variables_call_inside_tf_function(keras):
    # Horovod's tape examples broadcast opt.variables() inside a tf.function.
    import tensorflow as tf

    opt = built_adam(keras)

    @tf.function
    def count():
        return tf.add_n([tf.cast(tf.size(v), tf.int32) for v in opt.variables()])

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        total = int(count())
    assert total == sum(int(np.prod(v.shape)) for v in opt._variables)
    named = [w.filename for w in record if w.category is compat.HorovodSpellingWarning]
    # The script's line that called the tf.function, not autograph's copy.
    assert named == [__file__]


def test_spellings_on_a_distributed_optimizer(keras):
    # The shim's own optimizer (a dynamic subclass) takes the same spellings.
    import tfdist.horovod as hvd

    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
    opt.build([keras.Variable(np.zeros((3,), "float32"))])
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert [id(v) for v in opt.variables()] == [id(v) for v in opt.variables]
        opt.lr = 0.05
    assert isinstance(opt, keras.optimizers.SGD)
    np.testing.assert_allclose(float(opt.learning_rate), 0.05, rtol=1e-6)
