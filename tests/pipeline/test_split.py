"""tfdist.pipeline.split_model: stages that compute the model, own its
weights once each, and a ConfigError naming the layer for every bad split."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tests.models.pipeline_models import SPLITS, batches, make_model

#: Keras runs in this process: the suite's logical CPUs first (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("tf_cpus")


def _run(stages, x):
    """The stages one after another, as the pipeline runs them."""
    import keras
    import tensorflow as tf

    flat = [tf.convert_to_tensor(v) for v in keras.tree.flatten(x)]
    sent = []
    for stage in stages:
        out = stage.model([flat[i] for i in stage.model_inputs] + sent)
        sent = list(out) if isinstance(out, (list, tuple)) else [out]
    return sent


def _partition(model, stages):
    """Each stage's weights, by path; asserts every weight is owned once."""
    owned = [[v.path for v in s.variables] for s in stages]
    every = [p for paths in owned for p in paths]
    assert sorted(every) == sorted(v.path for v in model.weights)
    assert len(set(every)) == len(every)
    return owned


@pytest.mark.parametrize("name", ["mlp", "llama"])
@pytest.mark.parametrize("count", [2, 4])
def test_the_stages_compute_the_model_and_own_each_weight_once(name, count):
    import keras

    from tfdist.pipeline import split_model

    keras.utils.set_random_seed(1)
    model = make_model(name)
    x, _ = batches(name, 1)
    stages = split_model(model, SPLITS[name][: count - 1])
    assert [s.index for s in stages] == list(range(count))
    (got,) = _run(stages, x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(model(x)))
    owned = _partition(model, stages)
    assert stages[0].receives == 0 and all(s.receives >= 1 for s in stages[1:])
    if name == "llama":
        # The embedding's lookup table in the first stage, its reverse (the
        # logits) in the last: one layer in two stages, each weight in one.
        assert "token_embedding/embeddings" in owned[0]
        assert "token_embedding/reverse_embeddings" in owned[-1]
        assert stages[-1].layers[-1] == "token_embedding"
        # Every stage takes the padding mask (position 0 of the sorted dict).
        assert all(0 in s.model_inputs for s in stages)


def test_a_sequential_model_splits_at_its_layer_names():
    import keras

    from tfdist.pipeline import split_model

    keras.utils.set_random_seed(2)
    model = keras.Sequential(
        [keras.Input((6,))] + [keras.layers.Dense(5, name=f"l{i}") for i in range(5)]
    )
    stages = split_model(model, ["l2", "l4"])
    assert [s.layers for s in stages] == [("l0", "l1"), ("l2", "l3"), ("l4",)]
    x = np.random.default_rng(0).standard_normal((3, 6)).astype("float32")
    (got,) = _run(stages, x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(model(x)))


@settings(max_examples=12, deadline=None)
@given(
    widths=st.lists(st.integers(1, 9), min_size=2, max_size=7),
    data=st.data(),
)
def test_any_increasing_split_of_a_chain_computes_the_same(widths, data):
    import keras

    from tfdist.pipeline import split_model

    layers = [keras.layers.Dense(w, name=f"h{i}") for i, w in enumerate(widths)]
    model = keras.Sequential([keras.Input((3,)), *layers])
    cuts = data.draw(
        st.lists(st.integers(1, len(widths) - 1), min_size=1, max_size=3, unique=True).map(sorted)
    )
    stages = split_model(model, [f"h{c}" for c in cuts])
    assert len(stages) == len(cuts) + 1
    x = np.linspace(-1, 1, 12, dtype="float32").reshape(4, 3)
    (got,) = _run(stages, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(model(x)), rtol=0, atol=1e-6)
    _partition(model, stages)


def _two_outputs():
    import keras

    inp = keras.Input((4,))
    a = keras.layers.Dense(3, name="a")(inp)
    b = keras.layers.Dense(3, name="b")(a)
    c = keras.layers.Dense(3, name="c")(b)
    return keras.Model(inp, [a, c])


def _skip_over_two():
    import keras

    inp = keras.Input((4,))
    a = keras.layers.Dense(4, name="a")(inp)
    b = keras.layers.Dense(4, name="b")(a)
    c = keras.layers.Dense(4, name="c")(b)
    return keras.Model(inp, keras.layers.Add(name="join")([a, c]))


@pytest.mark.parametrize(
    "points, field, value, words",
    [
        (["nope"], "split_points[0]", "nope", "the name of a layer the model calls"),
        (["a"], "split_points[0]", "a", "no stage is empty"),
        (["c", "b"], "split_points[1]", "b", "after the previous split point 'c'"),
        (["b", "b"], "split_points[1]", "b", "no stage is empty"),
        (["b", "c"], "split_points", "a", "would cross 2 stage boundaries"),
        ([], "split_points", [], "at least one layer name"),
        ("b", "split_points", "b", "a list of layer names"),
        ([3], "split_points[0]", 3, "the name of a layer"),
    ],
)
def test_a_bad_split_names_the_layer(points, field, value, words):
    from tfdist.errors import ConfigError
    from tfdist.pipeline import split_model

    with pytest.raises(ConfigError) as caught:
        split_model(_skip_over_two(), points)
    assert caught.value.field == field and caught.value.value == value
    assert words in str(caught.value)


def test_an_output_made_before_the_last_stage_is_refused():
    from tfdist.errors import ConfigError
    from tfdist.pipeline import split_model

    with pytest.raises(ConfigError, match="layer 'a' is made in stage 0") as caught:
        split_model(_two_outputs(), ["b"])
    assert caught.value.value == "a"


def test_tied_weights_across_stages_are_refused_naming_the_weight():
    import keras_hub

    from tfdist.errors import ConfigError
    from tfdist.pipeline import split_model

    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=64,
        num_layers=2,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=8,
        intermediate_dim=16,
        tie_word_embeddings=True,
    )
    lm = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    with pytest.raises(ConfigError, match="'token_embedding/embeddings'") as caught:
        split_model(lm, ["transformer_layer_1"])
    assert caught.value.value == "token_embedding"
    assert "tied weights" in str(caught.value)


def test_a_model_without_a_graph_is_refused():
    import keras

    from tfdist.errors import ConfigError
    from tfdist.pipeline import split_model

    class Net(keras.Model):
        def call(self, x):
            return x

    with pytest.raises(ConfigError, match="a functional or built Sequential"):
        split_model(Net(), ["x"])
    with pytest.raises(ConfigError, match="a keras.Model"):
        split_model("model", ["x"])
