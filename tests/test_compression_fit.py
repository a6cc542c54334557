"""Compressed gradient aggregation in Keras 3 fit, on 2 logical CPU replicas."""

from __future__ import annotations

import numpy as np
import pytest

import tfdist
from tfdist.compression import make_compressor, reduce_compressed
from tfdist.compression.keras_hook import compressed_all_reduce_sum
from test_strategies import fit_losses

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
        [(summed, _)] = compressed_all_reduce_sum([(grad, None)], compressor, step)
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
        model = keras.Sequential([keras.Input((4,), dtype="int32"),
                                  keras.layers.Embedding(50, 8),
                                  keras.layers.Flatten(), keras.layers.Dense(2)])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True))
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(64, drop_remainder=True)
    history = model.fit(data, epochs=2, verbose=0)
    losses = history.history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_unavailable_compressor_fails_when_the_strategy_is_built(tf_cpus):
    with pytest.raises(tfdist.ConfigError) as info:
        tfdist.strategy_from_config(cpu_replicas=2, compression="powersgd:4")
    assert info.value.field == "compression" and "'powersgd" in str(info.value)
