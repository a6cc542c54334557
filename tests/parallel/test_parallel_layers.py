"""VocabParallelEmbedding, ParallelMultiHeadAttention and TransformerBlock
against their unsharded Keras counterparts.

Each model is trained with plain ``model.fit`` and Adam, at T=2 on 2 logical
CPUs and at DP=2 x T=2 on 4, from the reference Keras model's initial
weights and on the same data: losses per epoch and every full weight after
the steps agree within 1e-5. Outside a strategy, and with T=1, each layer is
its Keras counterpart.
"""

from __future__ import annotations

import numpy as np
import pytest

V, L, D = 32, 6, 8  # vocabulary, sequence length, model width
ROWS, BATCH, EPOCHS = 64, 16, 2  # 8 Adam steps
TOL = 1e-5
KEY_BIAS_TOL = 1e-3  # See test_fit_matches_keras.


def _mirrored(n: int, tp: int, compression=None):
    import tfdist
    from tfdist import parallel

    strategy = tfdist.MirroredStrategy([f"/cpu:{i}" for i in range(n)], compression=compression)
    parallel.attach(strategy, tp)
    return strategy


#: (replicas, tensor-parallel group) of each mesh the fits run on.
MESHES = {"t2": (2, 2), "dp2xt2": (4, 2)}


@pytest.fixture(scope="module")
def meshes(tf_cpus):
    """``meshes(name)``: a Mirrored strategy over N logical CPUs with a
    (N/T) x T mesh, built once per module."""
    built = {}

    def get(name: str):
        if name not in built:
            built[name] = _mirrored(*MESHES[name])
        return built[name]

    return get


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(18)
    ids = rng.integers(1, V, size=(ROWS, L)).astype("int32")
    ids[::3, -2:] = 0  # Padding for mask_zero.
    return {
        "ids": ids,
        "x": rng.normal(size=(ROWS, L, D)).astype("float32"),
        "mask": (rng.random((ROWS, L, L)) > 0.3).astype("int32"),
        "y": rng.normal(size=(ROWS, 4)).astype("float32"),
        "labels": rng.integers(0, 3, size=(ROWS,)).astype("int32"),
    }


def _keras_block(num_heads: int, key_dim: int, ff_dim: int):
    """The block of keras-io's text classifier from Keras layers: what
    TransformerBlock is outside a mesh (same sub-layers, same order)."""
    import keras

    class KerasBlock(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.supports_masking = True

        def build(self, input_shape):
            d = int(input_shape[-1])
            self.attention = keras.layers.MultiHeadAttention(num_heads, key_dim, name="attention")
            self.dropout1 = keras.layers.Dropout(0.0)
            self.norm1 = keras.layers.LayerNormalization(epsilon=1e-6, name="norm1")
            self.ffn_in = keras.layers.Dense(ff_dim, activation="relu", name="ffn_in")
            self.ffn_out = keras.layers.Dense(d, name="ffn_out")
            self.dropout2 = keras.layers.Dropout(0.0)
            self.norm2 = keras.layers.LayerNormalization(epsilon=1e-6, name="norm2")
            shape = tuple(input_shape)
            self.attention.build(shape, shape)
            self.norm1.build(shape)
            self.ffn_in.build(shape)
            self.ffn_out.build(shape[:-1] + (ff_dim,))
            self.norm2.build(shape)

        def call(self, inputs, training=None):
            a = self.attention(inputs, inputs, training=training)
            x = self.norm1(inputs + self.dropout1(a, training=training))
            y = self.ffn_out(self.ffn_in(x))
            return self.norm2(x + self.dropout2(y, training=training))

    return KerasBlock()


def _embedding_model(parallel: bool):
    import keras

    from tfdist import parallel as tp

    emb = tp.VocabParallelEmbedding if parallel else keras.layers.Embedding
    ids = keras.Input((L,), dtype="int32")
    h = emb(V, D, mask_zero=True)(ids)
    h = keras.layers.GlobalAveragePooling1D()(h)  # Uses the mask.
    return keras.Model(ids, keras.layers.Dense(4)(h)), "mse"


def _attention_model(parallel: bool):
    """Self-attention with an explicit mask and its scores used in the loss,
    then cross-attention (query and value differ) with a causal mask."""
    import keras

    from tfdist import parallel as tp

    mha = tp.ParallelMultiHeadAttention if parallel else keras.layers.MultiHeadAttention
    x = keras.Input((L, D))
    mask = keras.Input((L, L), dtype="int32")
    a, scores = mha(4, 3, value_dim=5, name="self")(
        x, x, attention_mask=mask, return_attention_scores=True
    )
    b = mha(2, 4, use_bias=False, output_shape=6, name="cross")(a, x, use_causal_mask=True)
    h = keras.layers.Concatenate()(
        [keras.layers.GlobalAveragePooling1D()(b), keras.layers.Flatten()(scores)]
    )
    return keras.Model([x, mask], keras.layers.Dense(4)(h)), "mse"


def _block_model(parallel: bool):
    import keras

    from tfdist import parallel as tp

    ids = keras.Input((L,), dtype="int32")
    if parallel:
        h = tp.VocabParallelEmbedding(V, D, mask_zero=True)(ids)
        h = tp.TransformerBlock(2, 4, 16)(h)
    else:
        h = keras.layers.Embedding(V, D, mask_zero=True)(ids)
        h = _keras_block(2, 4, 16)(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return (
        keras.Model(ids, keras.layers.Dense(3)(h)),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )


MODELS = {
    "embedding": (_embedding_model, ("ids",), "y"),
    "attention": (_attention_model, ("x", "mask"), "y"),
    "block": (_block_model, ("ids",), "labels"),
}


def _compiled(kind: str, parallel: bool):
    import keras

    build, _, _ = MODELS[kind]
    model, loss = build(parallel)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss)
    return model


def _fit(model, kind, data):
    _, inputs, target = MODELS[kind]
    x = [data[k] for k in inputs]
    history = model.fit(
        x[0] if len(x) == 1 else x,
        data[target],
        batch_size=BATCH,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
    )
    return history.history["loss"], x


#: Each layer on a tensor-parallel pair; the block, which holds the vocabulary
#: embedding and the attention, also at DP=2 x T=2 (the data-parallel sums
#: are the layers'; the embedding's and attention's own fits there repeated
#: the block's paths, 40 s in a loaded run).
FITS = [("embedding", "t2"), ("attention", "t2"), ("block", "t2"), ("block", "dp2xt2")]


@pytest.mark.parametrize(("kind", "mesh_name"), FITS, ids=[f"{m}-{k}" for k, m in FITS])
def test_fit_matches_keras(kind, mesh_name, meshes, data):
    """Losses per epoch and all full weights after 8 Adam steps match the
    unsharded Keras model; the layers hold shards. (At DP=2 x T=2 the
    block's embedding also checks that a vocabulary shard's IndexedSlices
    gradient is gathered over its data-parallel group, as Keras does for a
    whole table: a dense sum changed Adam's second moment by ~4e-2.)"""
    import keras

    from tfdist import parallel as tp

    mesh = meshes(mesh_name)

    keras.utils.set_random_seed(1)
    ref = _compiled(kind, parallel=False)
    initial = ref.get_weights()
    with mesh.scope():
        model = _compiled(kind, parallel=True)
    assert len(model.weights) == len(initial)
    sharded = 0
    for v, w in zip(model.weights, initial):
        spec = tp.spec_of(v)
        if spec is not None:
            sharded += 1
            assert spec.full_shape == w.shape and v.shape[spec.axis] * 2 == w.shape[spec.axis]
        else:
            assert tuple(v.shape) == w.shape
        tp.assign_full(v, w)
    assert sharded == {"embedding": 1, "attention": 11, "block": 11}[kind]

    ref_losses, x = _fit(ref, kind, data)
    losses, _ = _fit(model, kind, data)
    np.testing.assert_allclose(losses, ref_losses, atol=TOL, rtol=0)
    assert not np.allclose(ref.get_weights()[0], initial[0])  # It trained.
    for v, w in zip(model.weights, ref.get_weights()):
        # A key bias adds q.b_k to every key's score of a query: softmax
        # cancels it, so its true gradient is 0 and Adam (eps 1e-7) turns
        # the gradient's rounding noise (~1e-9, summation order) into steps
        # of ~1e-5 per step, in the reference as here.
        tol = KEY_BIAS_TOL if v.path.endswith("key/bias") else TOL
        np.testing.assert_allclose(tp.full_value(v), w, atol=tol, rtol=0, err_msg=v.path)
    inputs = x[0] if len(x) == 1 else x
    expected = ref.predict(inputs, batch_size=BATCH, verbose=0)
    np.testing.assert_allclose(
        model.predict(inputs, batch_size=BATCH, verbose=0), expected, atol=TOL, rtol=0
    )
    # A direct call, outside the replica context, computes with full weights.
    np.testing.assert_allclose(np.asarray(model(inputs)), expected, atol=TOL, rtol=0)
    assert tp.traffic(mesh)["tensor_parallel"] > 0


def _same_weights(layer, keras_layer):
    assert [v.path.split("/", 1)[1] for v in layer.weights] == [
        v.path.split("/", 1)[1] for v in keras_layer.weights
    ]
    assert [tuple(v.shape) for v in layer.weights] == [tuple(v.shape) for v in keras_layer.weights]
    layer.set_weights(keras_layer.get_weights())


def test_outside_a_strategy_the_layers_are_keras(tf_cpus, data):
    """Same weights (names, shapes, order) and outputs as the Keras layers."""
    import keras

    from tfdist import parallel as tp

    keras.utils.set_random_seed(2)
    ids, x, mask = data["ids"][:8], data["x"][:8], data["mask"][:8]

    emb, ref_emb = (
        tp.VocabParallelEmbedding(V, D, mask_zero=True),
        keras.layers.Embedding(V, D, mask_zero=True),
    )
    assert isinstance(emb, keras.layers.Embedding)
    ref_out = ref_emb(ids)
    emb.build()
    _same_weights(emb, ref_emb)
    np.testing.assert_array_equal(emb(ids).numpy(), ref_out.numpy())
    np.testing.assert_array_equal(emb.compute_mask(ids).numpy(), ref_emb.compute_mask(ids).numpy())

    for kwargs, call in [
        ({}, {"attention_mask": mask, "return_attention_scores": True}),
        ({"value_dim": 3, "output_shape": 5, "use_bias": False}, {"use_causal_mask": True}),
    ]:
        mha = tp.ParallelMultiHeadAttention(4, 2, **kwargs)
        ref_mha = keras.layers.MultiHeadAttention(4, 2, **kwargs)
        assert isinstance(mha, keras.layers.MultiHeadAttention)
        expected = ref_mha(x, x, **call)
        mha(x, x, **call)
        _same_weights(mha, ref_mha)
        got = mha(x, x, **call)
        pairs = zip(got, expected) if isinstance(got, tuple) else [(got, expected)]
        for g, e in pairs:
            np.testing.assert_array_equal(g.numpy(), e.numpy())

    block, ref_block = tp.TransformerBlock(2, 4, 16), _keras_block(2, 4, 16)
    expected = ref_block(x)
    block(x)
    _same_weights(block, ref_block)
    np.testing.assert_array_equal(block(x).numpy(), expected.numpy())
    assert isinstance(block.ffn_in, keras.layers.Dense)


def test_model_parallel_1_is_keras(tf_cpus, data):
    """With T=1 nothing is sharded: the block classifier trains like Keras's
    under data parallelism alone."""
    import keras

    from tfdist import parallel as tp

    strategy = _mirrored(2, 1)
    assert tp.mesh_of(strategy) is None
    keras.utils.set_random_seed(3)
    ref = _compiled("block", parallel=False)
    with strategy.scope():
        model = _compiled("block", parallel=True)
    assert all(tp.spec_of(v) is None for v in model.weights)
    model.set_weights(ref.get_weights())
    ref_losses, _ = _fit(ref, "block", data)
    losses, _ = _fit(model, "block", data)
    np.testing.assert_allclose(losses, ref_losses, atol=TOL, rtol=0)
    for got, want in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


def test_widths_model_parallel_does_not_divide(pair):
    """A ConfigError naming the layer, the field and the value."""
    import keras

    from tfdist import parallel as tp
    from tfdist.errors import ConfigError

    strategy = pair
    ids = keras.Input((L,), dtype="int32")
    x = keras.Input((L, D))
    with strategy.scope():
        with pytest.raises(ConfigError, match=r"odd_vocab\.embeddings.*Received: 33"):
            tp.VocabParallelEmbedding(33, D, name="odd_vocab")(ids)
        with pytest.raises(ConfigError, match=r"odd_heads\.num_heads.*Received: 3"):
            tp.ParallelMultiHeadAttention(3, 4, name="odd_heads")
        with pytest.raises(ConfigError, match=r"odd_ff\.ff_dim.*Received: 15"):
            tp.TransformerBlock(2, 4, 15, name="odd_ff")(x)
        with pytest.raises(ConfigError, match=r"odd_block\.num_heads.*Received: 3"):
            tp.TransformerBlock(3, 4, 16, name="odd_block")(x)
        # Widths T divides build, with shards.
        layer = tp.VocabParallelEmbedding(34, D)
        layer(ids)
        assert tuple(layer.weights[0].shape) == (17, D)


def test_a_layer_without_build_holding_a_sharded_one(pair):
    """Keras builds such a layer by tracing its call symbolically, where
    variables are created uninitialized: the shards are filled and marked when
    Keras initializes them."""
    import keras

    from tfdist import parallel as tp

    strategy = pair

    class Wrapper(keras.layers.Layer):  # keras-io's layers often have no build().
        def __init__(self):
            super().__init__()
            self.inner = tp.VocabParallelEmbedding(V, D)

        def call(self, ids):
            return self.inner(ids)

    with strategy.scope():
        wrapper = Wrapper()
        wrapper(keras.Input((L,), dtype="int32"))
    table = wrapper.inner.weights[0]
    assert tp.spec_of(table.value) is not None  # The tf variable, as the optimizer sees it.
    full = tp.full_value(table)
    assert full.shape == (V, D) and np.abs(full).min() > 0
    shards = [c.numpy() for c in strategy.experimental_local_results(table.value)]
    np.testing.assert_array_equal(np.concatenate(shards), full)


@pytest.fixture(scope="module")
def pair(tf_cpus):
    """T=2 on 2 logical CPUs, for the tests that need one mesh."""
    return _mirrored(2, 2)


def _fit_under(policy, seed, pair, data):
    import keras

    from tfdist import parallel as tp

    keras.mixed_precision.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(seed)
        ref = _compiled("block", parallel=False)
        with pair.scope():
            model = _compiled("block", parallel=True)
        for v, w in zip(model.weights, ref.get_weights()):
            tp.assign_full(v, w)
        ref_losses, _ = _fit(ref, "block", data)
        losses, _ = _fit(model, "block", data)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert all(v.dtype == "float32" for v in model.weights)
    return ref, ref_losses, model, losses


def test_mixed_bfloat16(pair, data):
    """Losses and weights near the unsharded model's under the same policy
    (16-bit activations summed in another order; bfloat16 keeps 8 bits).
    TensorFlow's collectives take no bfloat16: the activations cross as
    float32."""
    from tfdist import parallel as tp

    ref, ref_losses, model, losses = _fit_under("mixed_bfloat16", 4, pair, data)
    np.testing.assert_allclose(losses, ref_losses, rtol=3e-2)
    for v, w in zip(model.weights, ref.get_weights()):
        # Adam turns the rounding into steps: close, not equal.
        np.testing.assert_allclose(tp.full_value(v), w, atol=0.1, rtol=0, err_msg=v.path)


def test_mixed_float16_skips_an_overflow_on_every_replica(pair, data):
    """Keras's loss scale optimizer judged the gradients by replica 0's
    alone: a step that overflowed in replica 1's shards only was applied
    there, and the model turned NaN. Every replica now votes. (Whether a step
    overflows can differ from the unsharded model's, whose sums run in
    another order, so the trajectories are not compared.)"""
    from tfdist import parallel as tp

    _, ref_losses, model, losses = _fit_under("mixed_float16", 4, pair, data)
    assert np.isfinite(ref_losses).all() and np.isfinite(losses).all(), losses
    for v in model.weights:
        assert np.isfinite(tp.full_value(v)).all(), v.path
    optimizer = model.optimizer
    assert 0 < int(optimizer.iterations.numpy()) < EPOCHS * ROWS // BATCH  # Some skipped.
    scales = {
        float(c.numpy()) for c in pair.experimental_local_results(optimizer.dynamic_scale.value)
    }
    assert len(scales) == 1, scales


def test_block_with_bf16_compression(tf_cpus, data):
    """DP=2 x T=2 with the data-parallel gradients compressed to bfloat16:
    the shards' gradients reach the aggregator with their static shapes (a
    Dense kernel's from a 3-D input had none, which its byte count could not
    take), and the vocabulary shard's IndexedSlices are gathered as Keras
    gathers a whole table's (summed dense, Adam's second moment differs: the
    losses were 1e-2 off). Close to the uncompressed unsharded model:
    bfloat16 rounding."""
    import keras

    from tfdist import parallel as tp

    strategy = _mirrored(4, 2, compression="bf16")
    keras.utils.set_random_seed(5)
    ref = _compiled("block", parallel=False)
    with strategy.scope():
        model = _compiled("block", parallel=True)
    for v, w in zip(model.weights, ref.get_weights()):
        tp.assign_full(v, w)
    ref_losses, _ = _fit(ref, "block", data)
    losses, _ = _fit(model, "block", data)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-3)
    for v, w in zip(model.weights, ref.get_weights()):
        np.testing.assert_allclose(tp.full_value(v), w, atol=2e-2, rtol=0, err_msg=v.path)
    assert tp.traffic(strategy)["data_parallel"] > 0


def test_block_saved_at_t2_loads_anywhere(pair, data, tmp_path):
    """model.save at T=2 stores full weights (the attention's sub-layers
    included); keras.models.load_model gives the same predictions with no
    strategy and again at T=2."""
    import keras

    from tfdist import parallel as tp

    keras.utils.set_random_seed(6)
    ref = _compiled("block", parallel=False)
    with pair.scope():
        model = _compiled("block", parallel=True)
    model.set_weights(ref.get_weights())
    ids = data["ids"][:BATCH]
    expected = ref.predict(ids, verbose=0)
    path = str(tmp_path / "block.keras")
    model.save(path)
    plain = keras.models.load_model(path)
    assert [w.shape for w in plain.get_weights()] == [w.shape for w in ref.get_weights()]
    np.testing.assert_allclose(plain.predict(ids, verbose=0), expected, atol=TOL, rtol=0)
    with pair.scope():
        again = keras.models.load_model(path)
    assert sum(tp.spec_of(v) is not None for v in again.weights) == 11
    np.testing.assert_allclose(
        again.predict(ids, batch_size=BATCH, verbose=0), expected, atol=TOL, rtol=0
    )
