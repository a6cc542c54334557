"""tfdist.pipeline.balance: the split that makes the costliest stage cheapest,
among the splits split_model accepts; and a ConfigError naming the argument
for each bad one."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tests.models.pipeline_models import batches, make_model

#: Keras runs in this process: the suite's logical CPUs first (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("tf_cpus")


def _graph(widths: list[int], skips: list[int]):
    """A chain of Dense layers ``d0, d1, ...``; before layer ``i`` with
    ``skips[i] = j > 0``, a Concatenate ``c{i}`` also takes the output of
    layer ``i - 1 - j`` (a branch that may cross several cuts)."""
    import keras

    inp = keras.Input((5,), name="x")
    outs = [inp]
    for i, width in enumerate(widths):
        h = outs[-1]
        back = len(outs) - 2 - skips[i]
        if skips[i] and back >= 0:
            h = keras.layers.Concatenate(name=f"c{i}")([h, outs[back]])
        outs.append(keras.layers.Dense(width, name=f"d{i}")(h))
    return keras.Model(inp, outs[-1])


def _best_by_brute_force(model, stages: int) -> float:
    """The smallest costliest stage (weight values) over every split that
    split_model accepts: the oracle balance's programme must match."""
    from tfdist.errors import ConfigError
    from tfdist.pipeline import split_model

    names = [layer.name for layer in model.layers[1:]]  # Computing order.
    best = math.inf
    for points in itertools.combinations(names[1:], stages - 1):
        try:
            cut = split_model(model, list(points))
        except ConfigError:
            continue
        worst = max(sum(math.prod(v.shape) for v in s.variables) for s in cut)
        best = min(best, worst)
    return best


@settings(max_examples=10, deadline=None)
@given(
    widths=st.lists(st.sampled_from([1, 3, 16, 40]), min_size=3, max_size=5),
    skips=st.lists(st.integers(0, 3), min_size=5, max_size=5),
    stages=st.integers(2, 3),
)
def test_by_parameters_it_finds_the_best_split_split_model_accepts(widths, skips, stages):
    from tfdist.errors import ConfigError
    from tfdist.pipeline import balance, split_model

    model = _graph(widths, skips)
    best = _best_by_brute_force(model, stages)
    if best == math.inf:
        with pytest.raises(ConfigError) as err:
            balance(model, stages, by="parameters")
        assert err.value.field == "stages"
        return
    found = balance(model, stages, by="parameters")
    assert max(found.costs) == best
    cut = split_model(model, list(found.split_points))
    assert [sum(math.prod(v.shape) for v in s.variables) for s in cut] == list(found.costs)
    assert found.layers == tuple(s.layers for s in cut)


def test_a_layer_called_twice_on_one_weight_stays_in_one_stage():
    """The cheapest split (at ``b``) would train the shared kernel in two
    stages; the best one that keeps it in one is at ``c``."""
    import keras

    from tfdist.pipeline import balance

    shared = keras.layers.Dense(16, name="shared")
    x = keras.Input((16,))
    h = keras.layers.Dense(16, name="a")(x)
    h = keras.layers.Dense(16, name="b")(shared(h))
    h = keras.layers.Dense(16, name="c")(shared(h))
    model = keras.Model(x, keras.layers.Dense(4, name="head")(h))
    found = balance(model, 2, by="parameters")
    assert found.split_points == ("c",)
    # Its kernel counted once per call: each call computes.
    assert found.costs == (4 * 272, 272 + 68)


def test_by_time_a_costly_pair_of_layers_is_cut_between_them():
    """Two layers 32 times dearer than the rest, in the middle of a chain:
    cutting between them is the only split whose stages each hold one,
    whatever the timer's noise; an even count of layers would put both in
    the first stage."""
    import keras

    from tfdist.pipeline import balance

    keras.utils.set_random_seed(0)
    light = [keras.layers.Dense(32, activation="relu", name=f"l{i}") for i in range(9)]
    model = keras.Sequential(
        [
            keras.Input((32,)),
            *light[:3],
            keras.layers.Dense(1024, activation="relu", name="wide"),
            keras.layers.Dense(32, activation="relu", name="narrow"),
            *light[3:],
            keras.layers.Dense(10, name="head"),
        ]
    )
    x = np.random.default_rng(0).standard_normal((256, 32)).astype("float32")
    found = balance(model, 2, x=x)
    assert found.split_points == ("narrow",)
    assert found.by == "time" and all(c > 0 for c in found.costs)
    # Each stage holds one dear layer: the two differ by far less than one.
    assert found.imbalance < 0.5
    assert found.layers[0][-1] == "wide" and found.layers[1][-1] == "head"


def test_a_keras_hub_llama_is_balanced_with_its_loss_at_the_end():
    import keras

    from tfdist.pipeline import balance, split_model

    keras.utils.set_random_seed(1)
    model = make_model("llama")
    x, y = batches("llama", 1)
    found = balance(model, 3, x=x, y=y, loss="sparse_categorical_crossentropy", repeats=3)
    assert len(found.split_points) == 2 and len(found.costs) == 3
    # The embedding looks up in the first stage and gives the logits in the last.
    assert found.layers[0][0] == "token_embedding" == found.layers[-1][-1]
    assert sum(len(s) for s in found.layers) == sum(
        len(s.layers) for s in split_model(model, list(found.split_points))
    )
    assert all(c > 0 for c in found.costs)


def test_by_parameters_a_builder_s_weights_get_no_value():
    """The model too large for one process: balanced from its shapes alone."""
    from tfdist.compat.deferred import is_materialized
    from tfdist.pipeline import balance

    built = []

    def build():
        built.append(make_model("llama"))
        return built[-1]

    found = balance(build, 2, by="parameters")
    (model,) = built
    assert not any(is_materialized(v) for v in model.weights)
    # Each weight counted once: the stages' sum is the model's.
    assert sum(found.costs) == sum(math.prod(v.shape) for v in model.weights)
    # Four equal blocks and an untied embedding at both ends: two blocks each.
    assert found.split_points == ("transformer_layer_2",)
    assert found.imbalance < 0.01


@pytest.mark.parametrize(
    "kwargs, field, words",
    [
        ({"stages": 1}, "stages", "an integer >= 2"),
        ({"stages": True}, "stages", "an integer >= 2"),
        ({"stages": "2"}, "stages", "an integer >= 2"),
        ({"by": "flops"}, "by", "one of ('time', 'parameters')"),
        ({"by": "time"}, "x", "one micro-batch"),
        ({"by": "time", "x": "X", "repeats": 0}, "repeats", "an integer >= 1"),
        ({"by": "time", "x": "X", "y": "Y"}, "y", "y and loss together"),
        ({"by": "time", "x": "X", "loss": "mse"}, "loss", "y and loss together"),
        ({"by": "parameters", "x": "X"}, "x", 'None with by="parameters"'),
        ({"by": "time", "x": np.zeros((4, 7), "float32")}, "x", "a batch of the model's inputs"),
        ({"stages": 7}, "stages", "at most 6: the model has 5 places to cut"),
        ({"stages": 6}, "stages", "no cuts of this model into that many"),
    ],
)
def test_bad_arguments_are_refused_naming_them(kwargs, field, words):
    from tfdist.errors import ConfigError
    from tfdist.pipeline import balance

    x, _ = batches("mlp", 1)
    args = {"stages": 2, "by": "parameters", **kwargs}
    stand_in = {"X": x, "Y": np.zeros(len(x), "int32")}
    args = {k: stand_in.get(v, v) if isinstance(v, str) else v for k, v in args.items()}
    with pytest.raises(ConfigError) as err:
        balance(make_model("mlp"), **args)
    assert err.value.field == field
    assert words in str(err.value)


def test_a_model_without_a_graph_is_refused():
    import keras

    from tfdist.errors import ConfigError
    from tfdist.pipeline import balance

    class Net(keras.Model):
        def call(self, x):
            return x

    with pytest.raises(ConfigError) as err:
        balance(Net(), 2, by="parameters")
    assert err.value.field == "model"
