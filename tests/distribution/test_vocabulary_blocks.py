"""A table split along its vocabulary trains on any batch (issue 38, part 1).

Real text at a real vocabulary touches few of its rows: most vocabulary
blocks of a split table see no id of a batch. Before this was handled, such
a block crashed the process (an all-gather of empty tensors). A
property-based generator draws the batches: ids in one block, ids in a
prefix of the vocabulary (as text gives), one id repeated, a block hit by a
single id, Zipf-like ids, or anything at all; with mesh shapes (2, 2),
(1, 4) and (4, 1), vocabularies from 4 to 4,096, Keras's Embedding and
keras-hub's ReversibleEmbedding tied and untied, Adam and SGD. Each case
trains unsharded and under ``ModelParallel`` from the same weights on the
same batches, and must end within 1e-5 of it: losses and every weight.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

import tfdist  # keras.distribution on TensorFlow

keras_hub = pytest.importorskip("keras_hub")

TOLERANCE = 1e-5
ROWS, SEQ, WIDTH, BATCH = 16, 6, 8, 8  # Two steps: Adam's second sees the first's moments.
MESHES = ((2, 2), (1, 4), (4, 1))
LAYERS = ("embedding", "tied", "untied")
PATTERNS = ("one_block", "prefix", "repeated", "lone", "zipf", "any")


def _ids(pattern: str, vocabulary: int, blocks: int, draw) -> np.ndarray:
    """ROWS x (SEQ + 1) token ids drawn as ``pattern`` says."""
    n = ROWS * (SEQ + 1)
    width = vocabulary // blocks
    if pattern == "one_block":
        b = draw(st.integers(0, blocks - 1), label="block")
        ids = draw(st.lists(st.integers(b * width, (b + 1) * width - 1), min_size=n, max_size=n))
    elif pattern == "prefix":  # As text does: the first few ids of a big vocabulary.
        top = draw(st.integers(1, max(1, vocabulary // 8)), label="prefix")
        ids = draw(st.lists(st.integers(0, top - 1), min_size=n, max_size=n))
    elif pattern == "repeated":
        ids = [draw(st.integers(0, vocabulary - 1), label="id")] * n
    elif pattern == "lone":  # One block hit by exactly one id, the others by many.
        b = draw(st.integers(0, blocks - 1), label="block")
        others = [i for i in range(vocabulary) if i // width != b] or [b * width]
        ids = draw(st.lists(st.sampled_from(others), min_size=n, max_size=n))
        ids[draw(st.integers(0, n - 1), label="where")] = draw(
            st.integers(b * width, (b + 1) * width - 1), label="lone id"
        )
    elif pattern == "zipf":
        seed = draw(st.integers(0, 2**16), label="seed")
        ids = np.random.default_rng(seed).zipf(1.3, n) - 1
        ids = list(np.minimum(ids, vocabulary - 1))
    else:
        ids = draw(st.lists(st.integers(0, vocabulary - 1), min_size=n, max_size=n))
    return np.asarray(ids, "int32").reshape(ROWS, SEQ + 1)


def _model(keras, layer: str, vocabulary: int, optimizer: str):
    ids = keras.Input((SEQ,), dtype="int32")
    if layer == "embedding":
        x = keras.layers.Embedding(vocabulary, WIDTH, name="emb")(ids)
        logits = keras.layers.Dense(vocabulary, name="head")(x)
    else:
        emb = keras_hub.layers.ReversibleEmbedding(
            vocabulary, WIDTH, tie_weights=layer == "tied", name="emb"
        )
        x = keras.layers.Dense(WIDTH, activation="tanh", name="mix")(emb(ids))
        logits = emb(x, reverse=True)
    model = keras.Model(ids, logits)
    model.compile(
        keras.optimizers.Adam(0.01) if optimizer == "adam" else keras.optimizers.SGD(0.5),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def _distribution(keras, shape):
    dist = keras.distribution
    mesh = dist.DeviceMesh(shape, ["batch", "model"], dist.list_devices("cpu")[:4])
    layout_map = dist.LayoutMap(mesh)
    # As keras-hub's maps lay out a table: its vocabulary over "model".
    layout_map["emb/embeddings"] = ("model", "batch")
    layout_map["emb/reverse_embeddings"] = ("batch", "model")
    layout_map["head/kernel"] = ("batch", "model")
    return dist.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def _train(keras, build, ids, distribution=None, initial=None):
    keras.distribution.set_distribution(distribution)
    model = build()
    if initial is not None:
        model.set_weights(initial)
    start = model.get_weights()
    history = model.fit(
        ids[:, :-1], ids[:, 1:], batch_size=BATCH, epochs=1, shuffle=False, verbose=0
    )
    return start, history.history["loss"], model


def _case(keras, shape, layer, vocabulary, optimizer, ids):
    def build():
        return _model(keras, layer, vocabulary, optimizer)

    keras.utils.set_random_seed(0)
    initial, want_loss, reference = _train(keras, build, ids)
    _, loss, model = _train(keras, build, ids, _distribution(keras, shape), initial)
    where = f"mesh {shape}, {layer}, vocabulary {vocabulary}, {optimizer}, ids {np.unique(ids)}"
    np.testing.assert_allclose(loss, want_loss, rtol=0, atol=TOLERANCE, err_msg=where)
    for v, got, want in zip(model.weights, model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE, err_msg=f"{where}: {v.path}")
    # The table really is split: each device holds its block of it.
    table = model.get_layer("emb").embeddings
    blocks = model.distribute_strategy.experimental_local_results(table.value)
    assert [tuple(b.shape) for b in blocks] == [(vocabulary // shape[1], WIDTH // shape[0])] * 4
    if layer == "untied" and shape[1] > 1:
        # The logits table computes with its block too, never gathered whole.
        row = tfdist.distribution.report(model).row("emb/reverse_embeddings")
        assert row.how == "tensor-parallel (logits)", row
    return initial, model


@st.composite
def _cases(draw):
    shape = draw(st.sampled_from(MESHES), label="mesh")
    layer = draw(st.sampled_from(LAYERS), label="layer")
    optimizer = draw(st.sampled_from(("adam", "sgd")), label="optimizer")
    vocabulary = draw(st.sampled_from((4, 16, 64, 256, 4096)), label="vocabulary")
    pattern = draw(st.sampled_from(PATTERNS), label="pattern")
    return shape, layer, optimizer, vocabulary, _ids(pattern, vocabulary, shape[1], draw)


def _fixed(shape, layer, optimizer, vocabulary, rows):
    """An explicit case: the rows' ids repeated to ROWS x (SEQ + 1)."""
    ids = np.resize(np.asarray(rows, "int32"), (ROWS, SEQ + 1))
    return (shape, layer, optimizer, vocabulary, ids)


@settings(
    max_examples=6,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(case=_cases())
# The cases the issue names, each on its own mesh: no id in the last block
# (text's prefix of a big vocabulary), every id in one block, one id
# repeated, a block hit by one id only.
@example(case=_fixed((2, 2), "embedding", "adam", 4096, range(0, 512, 7)))
@example(case=_fixed((1, 4), "tied", "adam", 256, range(64, 128, 3)))
@example(case=_fixed((4, 1), "untied", "sgd", 64, [5]))
@example(case=_fixed((2, 2), "untied", "adam", 16, [0, 1, 2, 3, 9]))
@example(case=_fixed((1, 4), "embedding", "sgd", 64, [7] * 20 + [63]))
def test_any_batch_trains_as_one_device(keras_mod, case):
    shape, layer, optimizer, vocabulary, ids = case
    _case(keras_mod, shape, layer, vocabulary, optimizer, ids)


# The failing lookup can abort the process's collectives (tests/own_process.py).
@pytest.mark.own_process
@pytest.mark.parametrize("shape", [(2, 2), (4, 1)], ids=["2x2", "4x1"])
def test_an_id_outside_the_vocabulary_fails_as_on_one_device(keras_mod, shape):
    """One device's lookup raises on an id past the vocabulary; so does the
    split table's (it would otherwise read zeros), naming the id and the
    range."""
    import tensorflow as tf

    keras = keras_mod
    ids = np.resize(np.arange(0, 64, 3, dtype="int32"), (ROWS, SEQ + 1))
    ids[3, 2] = 64  # An input id only: the labels stay in range.
    keras.utils.set_random_seed(0)
    model = _model(keras, "embedding", 64, "sgd")
    with pytest.raises(tf.errors.InvalidArgumentError) as one:
        model.predict(ids[:, :-1], verbose=0)
    assert "64 is not in [0, 64)" in str(one.value)
    keras.distribution.set_distribution(_distribution(keras, shape))
    model = _model(keras, "embedding", 64, "sgd")
    with pytest.raises(tf.errors.InvalidArgumentError) as split:
        model.predict(ids[:, :-1], batch_size=BATCH, verbose=0)
    text = str(split.value)
    assert "64" in text and "[0, 64)" in text, text
