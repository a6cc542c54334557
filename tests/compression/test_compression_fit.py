"""Compressed gradient aggregation in Keras 3 fit, on 2 logical CPU replicas."""

from __future__ import annotations

import numpy as np
import pytest

import tfdist
from test_strategies import fit_losses
from tfdist.compression import TopKCompressor, make_compressor, reduce_compressed
from tfdist.compression.aggregate import CompressorAggregator, Item
from tfdist.transport.comm import ReplicaComm

COMPRESSORS = ["none", "fp16", "bf16", "topk:0.1", "randomk:0.25", "sign", "qsgd:16"]


@pytest.mark.parametrize("setting", COMPRESSORS)
def test_hook_sums_what_the_reference_sums(tf_cpus, setting):
    tf = tf_cpus
    strategy = tfdist.strategy_from_config(cpu_replicas=2)
    compressor = make_compressor(setting)
    rng = np.random.default_rng(0)
    grads = [rng.normal(size=(37, 5)).astype("float32") for _ in range(2)]
    step = tf.constant(7, tf.int64)

    def replica_fn():
        rid = tf.distribute.get_replica_context().replica_id_in_sync_group
        grad = tf.gather(tf.constant(np.stack(grads)), rid)
        [summed] = CompressorAggregator(compressor).aggregate(
            [Item(grad, key=0)], step, ReplicaComm()
        )
        return summed

    results = strategy.experimental_local_results(strategy.run(tf.function(replica_fn)))
    packed = [compressor.compress(tf.constant(g), step=step, key=0) for g in grads]
    expected = reduce_compressed(compressor, [p for p, _ in packed], packed[0][1])
    for result in results:  # every replica sees the same sum
        np.testing.assert_allclose(result, expected, rtol=1e-6, atol=1e-6)
    if setting == "none":
        np.testing.assert_allclose(results[0], grads[0] + grads[1], rtol=1e-6)


@pytest.fixture(scope="module")
def uncompressed_losses(tf_cpus):
    return fit_losses(tfdist.strategy_from_config(cpu_replicas=2), epochs=3)["loss"]


@pytest.mark.parametrize("setting", COMPRESSORS[1:])
def test_fit_with_compression_trains(tf_cpus, uncompressed_losses, setting):
    strategy = tfdist.strategy_from_config(cpu_replicas=2, compression=setting)
    losses = fit_losses(strategy, epochs=3)["loss"]
    assert losses[-1] < 0.5 * losses[0], losses
    if setting in ("fp16", "bf16"):
        np.testing.assert_allclose(losses, uncompressed_losses, rtol=1e-2)
    else:  # Lossy without error feedback: slower, but it learns.
        assert losses[-1] < 3 * uncompressed_losses[-1], (losses, uncompressed_losses)


def test_embedding_gradients_pass_through(tf_cpus):
    import keras

    tf = tf_cpus
    strategy = tfdist.strategy_from_config(cpu_replicas=2, compression="topk:0.2")
    rng = np.random.default_rng(1)
    x = rng.integers(0, 50, size=(512, 4)).astype("int32")
    y = (x.sum(axis=1) % 2).astype("int32")
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((4,), dtype="int32"),
                keras.layers.Embedding(50, 8),
                keras.layers.Flatten(),
                keras.layers.Dense(2),
            ]
        )
        model.compile(
            optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(64, drop_remainder=True)
    history = model.fit(data, epochs=2, verbose=0)
    losses = history.history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_powersgd_on_two_replicas_matches_the_reference_math(tf_cpus):
    tf = tf_cpus
    from tfdist.compression import PowerSGD

    strategy = tfdist.strategy_from_config(cpu_replicas=2)
    agg = PowerSGD(rank=2, warmup_steps=0, min_compression_rate=0)
    rng = np.random.default_rng(6)
    grads = np.stack([rng.normal(size=(12, 9)).astype("float32") for _ in range(2)])
    with strategy.scope():
        q = tf.Variable(
            tf.random.stateless_normal((12, 2), seed=[0, 0]),
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        )
        residual = tf.Variable(
            tf.zeros((12, 9)),
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.MEAN,
        )
    q0 = q.numpy()

    def replica_fn():
        rid = tf.distribute.get_replica_context().replica_id_in_sync_group
        grad = tf.gather(tf.constant(grads), rid)
        [out] = agg.aggregate(
            [Item(grad, 0, {"q": q, "residual": residual})], tf.constant(0), ReplicaComm()
        )
        return out

    outs = strategy.experimental_local_results(strategy.run(tf.function(replica_fn)))
    # The paper's math on M = the kernel gradient transposed, (out, in) as
    # PyTorch stores a weight: P = M Q, Q = M^T P^, M ~ P^ Q^T.
    ms = [g.T for g in grads]
    p_hat, _ = np.linalg.qr(sum(m @ q0 for m in ms))
    q_parts = [m.T @ p_hat for m in ms]
    expected = (p_hat @ sum(q_parts).T).T
    for out in outs:
        np.testing.assert_allclose(out, expected, atol=1e-4)
    residuals = [r.numpy() for r in strategy.experimental_local_results(residual)]
    for m, part, res in zip(ms, q_parts, residuals):
        np.testing.assert_allclose(res, (m - p_hat @ part.T).T, atol=1e-4)
    for copy in strategy.experimental_local_results(q):
        np.testing.assert_allclose(copy, sum(q_parts), atol=1e-4)


def test_error_feedback_makes_top_k_learn_better(tf_cpus):
    with_ef = fit_losses(
        tfdist.strategy_from_config(cpu_replicas=2, compression="topk:0.02"), epochs=3
    )["loss"]
    without = fit_losses(
        tfdist.strategy_from_config(cpu_replicas=2, compression="topk:0.02", error_feedback=False),
        epochs=3,
    )["loss"]
    # Measured on this model: 0.368 with, 0.438 without (Adam, 3 epochs).
    assert with_ef[-1] < 0.9 * without[-1], (with_ef, without)


def test_powersgd_fit_tracks_uncompressed(tf_cpus, uncompressed_losses):
    strategy = tfdist.strategy_from_config(cpu_replicas=2, compression="powersgd:2")
    losses = fit_losses(strategy, epochs=3)["loss"]
    assert losses[-1] < 0.5 * losses[0]
    assert losses[-1] < 1.2 * uncompressed_losses[-1], (losses, uncompressed_losses)


def _small_model(tf, strategy, x, y):
    import keras

    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(2)]
        )
        model.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    return model


def test_save_and_load_resume_with_the_error_feedback_state(tf_cpus, tmp_path):
    import keras

    from tfdist.compression.keras_hook import state_variables

    tf = tf_cpus
    # min_size=0: this model's tensors are all small enough to be sent whole.
    strategy = tfdist.strategy_from_config(
        cpu_replicas=2, compression=TopKCompressor(0.1, min_size=0)
    )
    rng = np.random.default_rng(7)
    x = rng.normal(size=(512, 16)).astype("float32")
    y = (x[:, 0] * x[:, 1] > 0).astype("int32")
    model = _small_model(tf, strategy, x, y)
    model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    path = str(tmp_path / "compressed.keras")
    model.save(path)

    def copies(m):
        return [
            [c.numpy() for c in strategy.experimental_local_results(v.value)]
            for v in state_variables(m.optimizer)
        ]

    saved_state = copies(model)
    assert len(saved_state) == 4 and any(np.abs(c).sum() > 0 for v in saved_state for c in v)
    with strategy.scope():
        loaded = keras.models.load_model(path)
    for before, after in zip(saved_state, copies(loaded)):
        for b, a in zip(before, after):  # Each replica's residual, exactly.
            np.testing.assert_array_equal(a, b)

    with strategy.scope():
        zeroed = keras.models.load_model(path)
    for v in state_variables(zeroed.optimizer):
        v.assign(tf.zeros(v.shape))
    for m in (model, loaded, zeroed):
        m.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)
    # The residuals matter: dropping them changes the next epoch.
    diff = max(np.abs(a - b).max() for a, b in zip(model.get_weights(), zeroed.get_weights()))
    assert diff > 1e-4

    # Without compression the model still loads, with its own optimizer state.
    plain = tfdist.strategy_from_config(cpu_replicas=2)
    with plain.scope(), pytest.warns(UserWarning, match="4 compression state variables"):
        uncompressed = keras.models.load_model(path)
    assert int(uncompressed.optimizer.iterations.numpy()) == 8
    assert state_variables(uncompressed.optimizer) == []


def test_communication_stats_callback_reports_the_predicted_bytes(tf_cpus):
    from tfdist.compression import CommunicationStats, predict_traffic

    tf = tf_cpus
    topk = TopKCompressor(0.1, min_size=0)  # Compresses this model's small tensors too.
    strategy = tfdist.strategy_from_config(cpu_replicas=2, compression=topk)
    rng = np.random.default_rng(8)
    x = rng.normal(size=(256, 16)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    model = _small_model(tf, strategy, x, y)
    stats = CommunicationStats(every_batch=True)
    history = model.fit(x, y, batch_size=64, epochs=2, verbose=0, callbacks=[stats])
    expected = predict_traffic(model, topk, num_replicas=2)
    assert history.history["comm_ratio"] == [expected.ratio] * 2
    assert history.history["comm_bytes"][-1] == expected.sent
    assert stats.steps == 8 and stats.total_bytes == 8 * expected.sent
    assert expected.ratio > 4  # 10% of values plus indices, gathered among 2.


@pytest.mark.parametrize(
    "policy, setting",
    [("mixed_float16", "fp16"), ("mixed_bfloat16", "powersgd:2"), ("mixed_float16", "topk:0.1")],
)
def test_mixed_precision_fit_with_compression(tf_cpus, policy, setting):
    import keras

    from tfdist.compression.keras_hook import state_variables

    tf = tf_cpus
    rng = np.random.default_rng(9)
    x = rng.normal(size=(512, 16)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int32")
    keras.mixed_precision.set_dtype_policy(policy)
    try:
        fits = {}
        for name in ("none", setting):
            strategy = tfdist.strategy_from_config(cpu_replicas=2, compression=name)
            model = _small_model(tf, strategy, x, y)
            fits[name] = model, model.fit(x, y, batch_size=64, epochs=3, verbose=0)
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    model, history = fits[setting]
    losses, reference = history.history["loss"], fits["none"][1].history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.7 * losses[0], losses
    if setting == "fp16":
        np.testing.assert_allclose(losses, reference, rtol=1e-2)
    else:
        assert losses[-1] < 1.3 * reference[-1], (losses, reference)
    optimizer = model.optimizer
    if policy == "mixed_float16":
        assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        optimizer = optimizer.inner_optimizer
    # Stateful compression keeps its state on the optimizer that aggregates.
    assert bool(state_variables(optimizer)) == (setting != "fp16")
