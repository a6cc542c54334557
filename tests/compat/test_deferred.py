"""tfdist.compat.deferred: a model built without its weights' values, whose
values made later equal a full build's, and the variables a call reads."""

from __future__ import annotations

import numpy as np
import pytest

from tests.models.pipeline_models import make_model

#: Keras runs in this process: the suite's logical CPUs first (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("tf_cpus")


@pytest.mark.parametrize("name", ["mlp", "cnn", "llama"])
def test_values_made_later_equal_a_full_build_s(name):
    import keras

    from tfdist.compat.deferred import deferred_build, is_materialized, materialize

    keras.utils.set_random_seed(7)
    full = make_model(name)
    keras.utils.set_random_seed(7)
    lazy, deferred = deferred_build(lambda: make_model(name))
    weights = {id(v) for v in lazy.weights}
    # Every weight waits for its value (keras-hub's task also makes metric
    # state, deferred too, and an optimizer counter given a value: made).
    assert weights <= {id(v) for v in deferred}
    assert not any(is_materialized(v) for v in lazy.weights)
    # A later Keras scope (shape inference) does not make them behind our back.
    with keras.StatelessScope():
        keras.layers.Dense(2).build((None, 3))
    assert not any(is_materialized(v) for v in lazy.weights)
    # Made in another order than Keras's, each gets a full build's value.
    for variable in reversed(lazy.weights):
        materialize(variable)
    for a, b in zip(full.weights, lazy.weights):
        assert a.path == b.path
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_materialize_takes_a_value_and_assigns_one_made():
    import keras

    from tfdist.compat.deferred import deferred_build, materialize

    layer, [kernel, bias] = deferred_build(lambda: _built(keras.layers.Dense(3)))
    materialize(kernel, np.full((2, 3), 0.5, "float32"))
    np.testing.assert_array_equal(layer.kernel.numpy(), np.full((2, 3), 0.5))
    materialize(kernel, np.ones((2, 3), "float32"))
    np.testing.assert_array_equal(layer.kernel.numpy(), np.ones((2, 3)))
    materialize(bias)
    np.testing.assert_array_equal(layer.bias.numpy(), np.zeros(3))


def test_borrowed_values_are_dropped_after_and_made_again_as_before():
    import keras

    from tfdist.compat.deferred import borrowed, deferred_build, is_materialized, materialize

    keras.utils.set_random_seed(3)
    full = _built(keras.layers.Dense(3))
    keras.utils.set_random_seed(3)
    layer, [kernel, bias] = deferred_build(lambda: _built(keras.layers.Dense(3)))
    materialize(bias, np.full(3, 2.0, "float32"))
    given = np.full((2, 3), 0.25, "float32")
    with borrowed([kernel, bias], [given, np.ones(3, "float32")]):
        np.testing.assert_array_equal(layer(np.ones((1, 2), "float32")), [[1.5, 1.5, 1.5]])
    # The kernel was deferred: it is again, and its initializer is its own
    # (the full build's value), not the value lent. The bias had a value:
    # it keeps the one assigned.
    assert not is_materialized(kernel) and is_materialized(bias)
    np.testing.assert_array_equal(bias.numpy(), np.ones(3))
    with borrowed([kernel]):
        np.testing.assert_array_equal(kernel.numpy(), full.kernel.numpy())
    assert not is_materialized(kernel)


def _built(layer):
    layer.build((None, 2))
    return layer


def test_variables_read_notes_reads_of_values_made_or_not():
    import keras
    import tensorflow as tf

    from tfdist.compat.deferred import deferred_build, materialize, variables_read

    embedding, _ = deferred_build(lambda: _built_embedding(keras))
    materialize(embedding.reverse_embeddings)  # One made, one not.

    def trace(reverse):
        fn = tf.function(
            lambda: embedding(
                tf.zeros((1, 4) if reverse else (1, 3), "float32" if reverse else "int32"),
                reverse=reverse,
            ),
            autograph=False,
        )
        with variables_read() as read:
            fn.get_concrete_function()
        return {v.path for v in embedding.weights if id(v) in read}

    assert trace(False) == {embedding.embeddings.path}
    assert trace(True) == {embedding.reverse_embeddings.path}


def _built_embedding(keras):
    import keras_hub

    layer = keras_hub.layers.ReversibleEmbedding(10, 4, tie_weights=False)
    layer.build((None, 3))
    return layer
