"""CompressedCrossDeviceOps under a MirroredStrategy on 2 logical CPUs.

The strategies here pass their own cross-device ops, so they use no
collectives and need no fresh collective key range.
"""

from __future__ import annotations

import numpy as np
import pytest

from tfdist.compression import (
    CompressionSetting,
    ErrorFeedback,
    make_aggregator,
    make_compressor,
    reduce_compressed,
)
from tfdist.compression.cross_device_ops import CompressedCrossDeviceOps
from tfdist.errors import ConfigError

COMPRESSORS = ["none", "fp16", "bf16", "topk:0.25", "randomk:0.5", "sign", "qsgd:16"]

RNG = np.random.default_rng(0)
# Two tensors of one shape (so that per-tensor keys show) and one of another;
# index [tensor][replica].
ARRAYS = [
    [RNG.normal(size=shape).astype("float32") for _ in range(2)]
    for shape in [(37, 5), (37, 5), (16,)]
]


def every_tensor(compression):
    """The setting, with top-k and sign compressing even these small tensors
    (by default they send tensors under 1024 entries whole), and random-k
    unscaled, so that its kept sums are exact."""
    from tfdist.compression import RandomKCompressor, SignCompressor, TopKCompressor

    name, _, param = str(compression).partition(":")
    if name == "topk" and param:
        return TopKCompressor(float(param), min_size=0)
    if name == "randomk" and param:
        return RandomKCompressor(float(param), unbiased=False)
    if name == "sign":
        return SignCompressor(min_size=0)
    return compression


def mirrored(tf, devices, compression):
    """A plain MirroredStrategy with CompressedCrossDeviceOps; returns both."""
    ops = CompressedCrossDeviceOps(every_tensor(compression))
    return tf.distribute.MirroredStrategy(devices=devices, cross_device_ops=ops), ops


def per_replica(strategy, tf, arrays):
    """A PerReplica holding ``arrays[i]`` on replica i's device."""

    def value_fn(ctx):
        # MirroredStrategy calls value_fn with no device scope, and an eager
        # tf.constant stays on CPU:0 even in one: copy with an op placed there.
        rid = ctx.replica_id_in_sync_group
        with tf.device(strategy.extended.worker_devices[rid]):
            return tf.identity(tf.constant(arrays[rid]))

    return strategy.experimental_distribute_values_from_function(value_fn)


def local(strategy, value):
    """The per-device numpy results of a Mirrored value."""
    return [np.asarray(v) for v in strategy.experimental_local_results(value)]


def reference(tf, compressor, arrays, step, key):
    """reduce_compressed of both replicas' payloads, computed independently."""
    packed = [
        compressor.compress(tf.constant(a), step=tf.constant(step, tf.int64), key=key)
        for a in arrays
    ]
    return np.asarray(reduce_compressed(compressor, [p for p, _ in packed], packed[0][1]))


@pytest.fixture(scope="module")
def devices(tf_cpus):
    return [d.name for d in tf_cpus.config.list_logical_devices("CPU")[:2]]


@pytest.mark.parametrize("setting", COMPRESSORS)
def test_batch_reduce_matches_reference_math(tf_cpus, devices, setting):
    tf = tf_cpus
    strategy, ops = mirrored(tf, devices, setting)
    values = [per_replica(strategy, tf, arrays) for arrays in ARRAYS]
    # Each replica's value lives on its own device.
    assert [v.device for v in values[0].values] == list(strategy.extended.worker_devices)

    sums = strategy.extended.batch_reduce_to("SUM", [(v, v) for v in values])
    sum_step = int(ops.step.numpy())
    means = strategy.extended.batch_reduce_to("MEAN", [(v, v) for v in values])
    mean_step = int(ops.step.numpy())
    assert mean_step == sum_step + 1  # One step per batch_reduce call.

    for key, (arrays, total, mean) in enumerate(zip(ARRAYS, sums, means)):
        results = local(strategy, total)
        assert [r.device for r in strategy.experimental_local_results(total)] == [
            v.device for v in values[key].values
        ]  # Broadcast to every replica.
        expected = reference(tf, ops.compressor, arrays, sum_step, key)
        for result in results:
            assert result.shape == arrays[0].shape and result.dtype == np.float32
            np.testing.assert_allclose(result, expected, rtol=1e-6, atol=1e-6)
        expected_mean = reference(tf, ops.compressor, arrays, mean_step, key) / 2
        for result in local(strategy, mean):
            np.testing.assert_allclose(result, expected_mean, rtol=1e-6, atol=1e-6)
        exact = arrays[0] + arrays[1]
        if setting == "none":
            np.testing.assert_array_equal(results[0], exact)
        else:  # The compression really happened.
            assert not np.array_equal(results[0], exact)


def test_randomk_keeps_shared_indices_that_change_with_step_and_key(tf_cpus, devices):
    tf = tf_cpus
    strategy, ops = mirrored(tf, devices, "randomk:0.5")
    values = [per_replica(strategy, tf, arrays) for arrays in ARRAYS[:2]]
    first = strategy.extended.batch_reduce_to("SUM", [(v, v) for v in values])
    second = strategy.extended.batch_reduce_to("SUM", [(v, v) for v in values])
    k = int(np.ceil(0.5 * ARRAYS[0][0].size))

    kept = {}
    for call, results in (("first", first), ("second", second)):
        for key, (arrays, total) in enumerate(zip(ARRAYS, results)):
            result = local(strategy, total)[0]
            exact = arrays[0] + arrays[1]
            nonzero = result != 0
            # Both replicas kept the same k entries: their sum is exact there.
            assert nonzero.sum() == k
            np.testing.assert_array_equal(result[nonzero], exact[nonzero])
            kept[call, key] = set(np.flatnonzero(nonzero))
    assert kept["first", 0] != kept["first", 1]  # The key differs per tensor.
    assert kept["first", 0] != kept["second", 0]  # The step differs per call.


def test_cross_device_ops_reduce_uses_key_zero(tf_cpus, devices):
    # strategy.extended.reduce_to never reaches a custom CrossDeviceOps when a
    # destination is a CPU (it builds a ReductionToOneDevice), so call the
    # CrossDeviceOps API directly.
    tf = tf_cpus
    strategy, ops = mirrored(tf, devices, "qsgd:4")
    value = per_replica(strategy, tf, ARRAYS[0])
    total = ops.reduce(tf.distribute.ReduceOp.SUM, value, value)
    expected = reference(tf, ops.compressor, ARRAYS[0], int(ops.step.numpy()), key=0)
    for result in local(strategy, total):
        np.testing.assert_allclose(result, expected, rtol=1e-6, atol=1e-6)
    assert int(ops.step.numpy()) == 1


def _fit(tf, strategy, steps=8):
    """Fits a linear Dense model with SGD; returns (losses, weights)."""
    import keras

    rng = np.random.default_rng(1)
    x = rng.normal(size=(16 * steps, 8)).astype("float32")
    y = x @ rng.normal(size=(8, 1)).astype("float32") + 0.5
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(1, kernel_initializer="zeros", bias_initializer="zeros"),
            ]
        )
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    losses = model.fit(data, epochs=2, verbose=0, shuffle=False).history["loss"]
    return losses, np.concatenate([w.ravel() for w in model.get_weights()])


@pytest.fixture(scope="module")
def uncompressed_fit(tf_cpus, devices):
    import tfdist

    strategy = tfdist.strategy_from_config(cpu_replicas=2)  # Default collectives.
    assert strategy.num_replicas_in_sync == 2
    return _fit(tf_cpus, strategy)


def test_fit_with_fp16_matches_uncompressed(tf_cpus, devices, uncompressed_fit):
    strategy, ops = mirrored(tf_cpus, devices, "fp16")
    losses, weights = _fit(tf_cpus, strategy)
    assert losses[-1] < 0.5 * losses[0], losses
    np.testing.assert_allclose(weights, uncompressed_fit[1], atol=1e-3)
    # Gradients went through batch_reduce_implementation once per step
    # (8 steps per epoch, 2 epochs).
    assert int(ops.step.numpy()) == 16


def test_fit_with_topk_differs_from_uncompressed(tf_cpus, devices, uncompressed_fit):
    strategy, ops = mirrored(tf_cpus, devices, "topk:0.1")
    losses, weights = _fit(tf_cpus, strategy)
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    assert np.max(np.abs(weights - uncompressed_fit[1])) > 1e-2
    assert int(ops.step.numpy()) == 16


class _FakePowerSGD:
    name = "powersgd"


STATEFUL = {
    "powersgd": lambda: "powersgd",
    "powersgd:4": lambda: "powersgd:4",
    "object named powersgd": _FakePowerSGD,
    "ErrorFeedback": lambda: ErrorFeedback(make_compressor("topk:0.1")),
    "PowerSGD aggregator": lambda: make_aggregator("powersgd:2"),
    "aggregator with error feedback": lambda: make_aggregator("sign", error_feedback=True),
    "setting with error feedback": lambda: CompressionSetting("sign", error_feedback=True),
}


@pytest.mark.parametrize("kind", STATEFUL)
def test_stateful_compression_is_refused(tf_cpus, kind):
    setting = STATEFUL[kind]()
    with pytest.raises(ConfigError) as info:
        CompressedCrossDeviceOps(setting)
    assert info.value.field == "compression"
    assert info.value.value is setting
    assert info.value.source == "CompressedCrossDeviceOps"
    assert "ReductionToOneDevice" in str(info.value)


def test_aggregator_without_error_feedback_is_unwrapped(tf_cpus):
    aggregator = make_aggregator("sign", error_feedback=False)
    assert CompressedCrossDeviceOps(aggregator).compressor is aggregator.compressor


def test_invalid_setting_names_this_class(tf_cpus):
    with pytest.raises(ConfigError) as info:
        CompressedCrossDeviceOps("topk:2")
    assert info.value.field == "compression" and info.value.value == "topk:2"
    assert str(info.value).startswith("CompressedCrossDeviceOps:")


def test_describe_and_repr_name_the_compressor(tf_cpus):
    ops = CompressedCrossDeviceOps("topk:0.25", reduce_to_device="/cpu:3")
    assert ops.compressor.name == "topk" and ops.compressor.ratio == 0.25
    assert "TopKCompressor(ratio=0.25, min_size=1024)" in repr(ops) and "'/cpu:3'" in repr(ops)
    assert "topk" in ops.describe() and "/cpu:3" in ops.describe()


def test_int32_passes_through_and_float_in_the_same_batch_is_compressed(tf_cpus, devices):
    tf = tf_cpus
    strategy, ops = mirrored(tf, devices, "sign")
    ints = [np.arange(12, dtype="int32").reshape(3, 4) * (r + 2) - 7 for r in range(2)]
    int_value = per_replica(strategy, tf, ints)
    float_value = per_replica(strategy, tf, ARRAYS[2])
    # MirroredStrategy itself routes int32 to a fresh ReductionToOneDevice;
    # call the ops directly to exercise its own pass-through.
    int_sum, float_sum = ops.batch_reduce(
        tf.distribute.ReduceOp.SUM, [(int_value, int_value), (float_value, float_value)]
    )
    for result in local(strategy, int_sum):
        assert result.dtype == np.int32
        np.testing.assert_array_equal(result, ints[0] + ints[1])
    expected = reference(tf, ops.compressor, ARRAYS[2], int(ops.step.numpy()), key=1)
    for result in local(strategy, float_sum):
        np.testing.assert_allclose(result, expected, rtol=1e-6, atol=1e-6)
    assert int(ops.step.numpy()) == 1

    (only_ints,) = ops.batch_reduce(tf.distribute.ReduceOp.SUM, [(int_value, int_value)])
    np.testing.assert_array_equal(local(strategy, only_ints)[0], ints[0] + ints[1])
    assert int(ops.step.numpy()) == 1  # Nothing compressed, no step taken.


def test_indexed_slices_pass_through_in_replica_all_reduce(tf_cpus, devices):
    tf = tf_cpus
    strategy, ops = mirrored(tf, devices, "topk:0.25")
    rows = [[0, 2], [2, 3]]
    parts = [RNG.normal(size=(2, 3)).astype("float32") for _ in range(2)]
    dense = RNG.normal(size=(4, 3)).astype("float32")

    def step():
        ctx = tf.distribute.get_replica_context()
        rid = ctx.replica_id_in_sync_group
        slices = tf.IndexedSlices(
            tf.gather(tf.constant(np.stack(parts)), rid),
            tf.gather(tf.constant(rows), rid),
            tf.constant([4, 3]),
        )
        other = tf.constant(dense) * tf.cast(rid + 1, tf.float32)
        return ctx.all_reduce("SUM", [slices, other])

    slices_sums, dense_sums = zip(*strategy.experimental_local_results(strategy.run(step)))
    exact = np.zeros((4, 3), "float32")
    for r in range(2):
        np.add.at(exact, rows[r], parts[r])
    for result in slices_sums:
        assert isinstance(result, tf.IndexedSlices)
        np.testing.assert_array_equal(tf.convert_to_tensor(result), exact)
    # The dense value of the same all-reduce went through this ops, compressed.
    expected = reference(tf, ops.compressor, [dense, 2 * dense], int(ops.step.numpy()), key=1)
    for result in dense_sums:
        np.testing.assert_allclose(result, expected, rtol=1e-6, atol=1e-6)
    assert int(ops.step.numpy()) == 1


def test_empty_and_dynamic_shapes_and_one_replica_pass_through(tf_cpus, devices):
    tf = tf_cpus
    strategy, ops = mirrored(tf, devices, "topk:0.25")
    empty = per_replica(strategy, tf, [np.zeros((0, 5), "float32")] * 2)
    (total,) = ops.batch_reduce(tf.distribute.ReduceOp.SUM, [(empty, empty)])
    assert local(strategy, total)[0].shape == (0, 5)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)] * 2)
    def dynamic(a, b):
        value = strategy.experimental_distribute_values_from_function(
            lambda ctx: [a, b][ctx.replica_id_in_sync_group] + 0.0
        )
        return strategy.experimental_local_results(
            ops.reduce(tf.distribute.ReduceOp.SUM, value, value)
        )

    arrays = ARRAYS[2]
    for result in dynamic(tf.constant(arrays[0]), tf.constant(arrays[1])):
        np.testing.assert_array_equal(result, arrays[0] + arrays[1])

    # One replica whose destination is another device: not the base class's
    # shortcut, so reduce_implementation sees a single value.
    with tf.device(devices[0]):
        one = tf.identity(tf.constant(arrays[0]))
    moved = ops.reduce(tf.distribute.ReduceOp.SUM, one, devices[1])
    assert moved.device.endswith("CPU:1"), moved.device
    np.testing.assert_array_equal(moved, arrays[0])
    assert int(ops.step.numpy()) == 0


def test_ops_built_in_another_strategys_scope_keep_a_plain_step(tf_cpus, devices):
    tf = tf_cpus
    others = [d.name for d in tf.config.list_logical_devices("CPU")[2:]]
    outer = tf.distribute.MirroredStrategy(
        devices=others, cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
    with outer.scope():
        ops = CompressedCrossDeviceOps("fp16")
    # A MirroredVariable of `outer` would raise "Mixing different
    # tf.distribute.Strategy objects" on assign_add below.
    assert not isinstance(ops.step, tf.distribute.DistributedValues)
    strategy = tf.distribute.MirroredStrategy(devices=devices, cross_device_ops=ops)
    value = per_replica(strategy, tf, ARRAYS[2])
    (total,) = strategy.extended.batch_reduce_to("SUM", [(value, value)])
    expected = reference(tf, ops.compressor, ARRAYS[2], 1, key=0)
    np.testing.assert_allclose(local(strategy, total)[0], expected, rtol=1e-6, atol=1e-6)
    assert int(ops.step.numpy()) == 1
