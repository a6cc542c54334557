"""``train_on_batch``, ``test_on_batch`` and ``predict_on_batch`` of a
tensor-parallel model against the unsharded Keras model on one device.

Keras hands these methods' batch to every replica whole (``fit`` splits it):
an embedding's IndexedSlices gradient then holds each lookup once per
replica, and Adam's second moment (it squares the slices before summing
duplicates) trained differently (here the losses were 1.1e-3 off at T=2 and
2.3e-3 at DP=2 x T=2; 4 steps of another model left weights 3e-2 and 6e-2
off), and ``predict_on_batch`` returned each row once per replica. tfdist
splits the batch as ``fit`` does (tfdist/training/on_batch.py).
"""

from __future__ import annotations

import numpy as np
import pytest

V, L, D, H, B, STEPS = 32, 6, 8, 16, 16, 3
#: Measured with the split, at T=2 and DP=2 x T=2: losses 6.0e-8, weights
#: 3.0e-8 and 4.5e-8, predictions 1.1e-8 and 1.9e-8, test loss 0 (float32
#: sums in another order).
TOL = 1e-6


def _model(parallel: bool):
    """Embedding, mean over the sequence, a column/row dense pair; Adam."""
    import keras

    from tfdist import parallel as tp

    emb = tp.VocabParallelEmbedding if parallel else keras.layers.Embedding
    column = tp.ColumnParallelDense if parallel else keras.layers.Dense
    row = tp.RowParallelDense if parallel else keras.layers.Dense
    ids = keras.Input((L,), dtype="int32")
    h = keras.layers.GlobalAveragePooling1D()(emb(V, D)(ids))
    model = keras.Model(ids, row(4)(column(H, activation="relu")(h)))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(7)
    return (
        rng.integers(0, V, size=(B * STEPS, L)).astype("int32"),
        rng.normal(size=(B * STEPS, 4)).astype("float32"),
        rng.random(B * STEPS).astype("float32"),
    )


def _train(model, data) -> list[float]:
    """STEPS train_on_batch calls; the second with sample weights."""
    ids, y, weights = data
    losses = []
    for step in range(STEPS):
        rows = slice(step * B, (step + 1) * B)
        sample_weight = weights[rows] if step == 1 else None
        losses.append(float(model.train_on_batch(ids[rows], y[rows], sample_weight=sample_weight)))
    return losses


@pytest.fixture(scope="module")
def reference(tf_cpus, data):
    """The unsharded model on one device: initial weights, losses, trained
    model, and its first test_on_batch and predict_on_batch (Keras 3.10's
    test_on_batch does not reset its metrics: a second call differs)."""
    import keras

    keras.utils.set_random_seed(11)
    model = _model(parallel=False)
    initial = model.get_weights()
    losses = _train(model, data)
    ids, y, weights = data
    return (
        initial,
        losses,
        model,
        model.test_on_batch(ids[:B], y[:B], sample_weight=weights[:B]),
        model.predict_on_batch(ids[:B]),
    )


@pytest.mark.parametrize("replicas", [2, 4], ids=["t2", "dp2xt2"])
def test_on_batch_matches_the_unsharded_model(replicas, reference, data):
    import tfdist
    from tfdist import parallel as tp

    initial, ref_losses, ref, ref_test, ref_predicted = reference
    strategy = tfdist.strategy_from_config(cpu_replicas=replicas, model_parallel=2)
    with strategy.scope():
        model = _model(parallel=True)
    # The table, the column kernel and bias, the row kernel.
    assert sum(tp.spec_of(v) is not None for v in model.weights) == 4
    for v, w in zip(model.weights, initial):
        tp.assign_full(v, w)

    np.testing.assert_allclose(_train(model, data), ref_losses, atol=TOL, rtol=0)
    assert not np.allclose(ref.get_weights()[0], initial[0])  # It trained.
    for v, w in zip(model.weights, ref.get_weights()):
        np.testing.assert_allclose(tp.full_value(v), w, atol=TOL, rtol=0, err_msg=v.path)

    ids, y, weights = data
    np.testing.assert_allclose(
        model.test_on_batch(ids[:B], y[:B], sample_weight=weights[:B]), ref_test, atol=TOL, rtol=0
    )
    predicted = model.predict_on_batch(ids[:B])
    assert predicted.shape == (B, 4)  # Not once per replica.
    np.testing.assert_allclose(predicted, ref_predicted, atol=TOL, rtol=0)


def test_stock_keras_hands_every_replica_the_whole_batch(reference, data):
    """The canary of the registry's ``on_batch`` patches: under TensorFlow's
    own MirroredStrategy, Keras's predict_on_batch returns every row once
    per replica and train_on_batch trains an embedding differently from one
    device. When this fails, Keras splits the batch itself and the patches
    can go for that version."""
    import tensorflow as tf

    initial, _, ref, _, _ = reference
    # Reduced through one device: two stock MirroredStrategies over the same
    # devices reuse TF's collective keys, and a later one's all-reduce met this
    # one's stale instance in the shared test process ("Shape mismatch in the
    # collective instance 100", tests/training/test_custom_loop.py).
    strategy = tf.distribute.MirroredStrategy(
        ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
    with strategy.scope():
        model = _model(parallel=False)
    model.set_weights(initial)
    _train(model, data)
    off = max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), ref.get_weights()))
    assert off > 1e-3, f"stock train_on_batch matches one device within {off}"
    assert model.predict_on_batch(data[0][:B]).shape == (2 * B, 4)
