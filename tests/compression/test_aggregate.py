"""Aggregators (error feedback, PowerSGD) and byte accounting, in one process.

LocalComm runs an aggregator's whole math with one replica, and records the
real payload tensors it sends; traffic predictions are checked against them.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist.compression import (
    ErrorFeedback,
    PowerSGD,
    TopKCompressor,
    make_aggregator,
    predict_traffic,
)
from tfdist.compression.aggregate import CompressorAggregator, Item
from tfdist.transport.comm import LocalComm

# Configures the logical CPUs before this module's eager ops start TF.
pytestmark = pytest.mark.usefixtures("tf_cpus")

SETTINGS = [
    "none",
    "fp16",
    "bf16",
    "topk:0.01",
    "randomk:0.01",
    "sign",
    "qsgd:16",
    "qsgd:200",
    "powersgd:4",
]


def state_for(aggregator, shape, key=0, dtype="float32"):
    """Plain tf.Variables made from an aggregator's state specs."""
    state = {}
    for spec in aggregator.state_specs(tuple(shape), dtype, key):
        init = (
            tf.zeros(spec.shape, spec.dtype)
            if spec.initializer == "zeros"
            else spec.initializer(spec.shape, spec.dtype)
        )
        state[spec.name] = tf.Variable(init)
    return state


def test_powersgd_reconstructs_a_rank_r_matrix_exactly():
    rng = np.random.default_rng(0)
    m = (rng.normal(size=(64, 3)) @ rng.normal(size=(3, 48))).astype("float32")
    agg = PowerSGD(rank=3, warmup_steps=0, min_compression_rate=0)
    state = state_for(agg, m.shape)
    [out] = agg.aggregate([Item(tf.constant(m), 0, state)], tf.constant(0), LocalComm())
    np.testing.assert_allclose(out, m, atol=1e-4 * np.abs(m).max())
    assert np.abs(state["residual"].numpy()).max() < 1e-4 * np.abs(m).max()


def test_powersgd_error_feedback_keeps_what_the_approximation_missed():
    rng = np.random.default_rng(1)
    g1, g2 = (rng.normal(size=(32, 24)).astype("float32") for _ in range(2))
    agg = PowerSGD(rank=2, warmup_steps=0, min_compression_rate=0)
    state = state_for(agg, g1.shape)
    [out1] = agg.aggregate([Item(tf.constant(g1), 0, state)], tf.constant(0), LocalComm())
    assert np.abs(out1 - g1).max() > 0.1  # Rank 2 of a full-rank matrix: lossy.
    np.testing.assert_allclose(state["residual"].numpy(), g1 - out1.numpy(), atol=1e-5)
    # The next step compresses gradient + residual, and the new residual is
    # again what was not sent.
    [out2] = agg.aggregate([Item(tf.constant(g2), 0, state)], tf.constant(1), LocalComm())
    np.testing.assert_allclose(
        state["residual"].numpy(), g2 + (g1 - out1.numpy()) - out2.numpy(), atol=1e-5
    )


def test_powersgd_warm_start_improves_the_approximation():
    rng = np.random.default_rng(2)
    u, _ = np.linalg.qr(rng.normal(size=(40, 40)))
    v, _ = np.linalg.qr(rng.normal(size=(30, 30)))
    s = np.diag(2.0 ** -np.arange(30))  # Decaying spectrum.
    m = (u[:, :30] @ s @ v.T).astype("float32")
    agg = PowerSGD(rank=2, warmup_steps=0, min_compression_rate=0, error_feedback=False)
    state = state_for(agg, m.shape)
    q0 = state["q"].numpy()
    errors = []
    for step in range(4):
        [out] = agg.aggregate([Item(tf.constant(m), 0, state)], tf.constant(step), LocalComm())
        errors.append(float(np.linalg.norm(out - m)))
    assert not np.allclose(state["q"].numpy(), q0)  # Q was carried over.
    assert errors[-1] < errors[0]
    best = float(np.linalg.norm(s[2:, 2:]))  # Eckart-Young: the best rank-2 error.
    assert errors[-1] < 1.05 * best, (errors, best)


def test_powersgd_sends_vectors_small_matrices_and_warm_up_steps_dense():
    rng = np.random.default_rng(3)
    kernel = rng.normal(size=(16, 12)).astype("float32")
    bias = rng.normal(size=(12,)).astype("float32")
    small = rng.normal(size=(4, 4)).astype("float32")
    agg = PowerSGD(rank=2, warmup_steps=3, min_compression_rate=2.0)
    assert agg.compresses((16, 12)) and not agg.compresses((12,))
    assert not agg.compresses((4, 4))  # 16 < 2 * (4 + 4) * 2
    states = [state_for(agg, g.shape, key) for key, g in enumerate((kernel, bias, small))]
    assert states[1] == states[2] == {}

    def run(step):
        comm = LocalComm()
        items = [
            Item(tf.constant(g), k, s)
            for k, (g, s) in enumerate(zip((kernel, bias, small), states))
        ]
        return agg.aggregate(items, tf.constant(step, tf.int64), comm), comm

    (k_out, b_out, s_out), _ = run(0)  # Warm-up: everything dense, exactly.
    np.testing.assert_array_equal(k_out, kernel)
    assert not states[0]["residual"].numpy().any()
    (k_out, b_out, s_out), comm = run(3)  # Compressed from step 3 on.
    assert np.abs(k_out.numpy() - kernel).max() > 1e-3
    np.testing.assert_array_equal(b_out, bias)
    np.testing.assert_array_equal(s_out, small)
    # Both branches were built; P, Q and the dense tensors were recorded.
    assert ((16, 2), "float32") in comm.reduced and ((12, 2), "float32") in comm.reduced


def test_powersgd_bfloat16_warm_up_sends_half_the_bytes_of_float32_gradients():
    rng = np.random.default_rng(4)
    kernel = rng.normal(size=(16, 12)).astype("float32")
    ids = np.arange(5, dtype="int32")  # Not float32: sent as it is.
    agg = PowerSGD(rank=2, warmup_steps=2, warmup_dtype="bfloat16")
    states = [state_for(agg, kernel.shape, 0), {}]
    comm = LocalComm()
    items = [Item(tf.constant(kernel), 0, states[0]), Item(tf.constant(ids), 1, {})]
    k_out, i_out = agg.aggregate(items, tf.constant(0, tf.int64), comm)
    # The warm-up sum went through bfloat16 and came back as float32.
    assert k_out.dtype == tf.float32 and i_out.dtype == tf.int32
    np.testing.assert_array_equal(k_out, tf.cast(tf.cast(kernel, tf.bfloat16), tf.float32).numpy())
    assert not np.array_equal(k_out.numpy(), kernel)
    np.testing.assert_array_equal(i_out, ids)
    assert ((16, 12), "bfloat16") in comm.reduced and ((5,), "int32") in comm.reduced
    # The traffic formula says what the warm-up branch really sent.
    shapes = [((16, 12), "float32"), ((5,), "int32")]
    warm = agg.traffic(shapes, 2, step=0)
    assert warm.all_reduce == 16 * 12 * 2 + 5 * 4
    assert warm.all_reduce == sum(
        math.prod(s) * tf.as_dtype(d).size
        for s, d in comm.reduced
        if (s, d) in (((16, 12), "bfloat16"), ((5,), "int32"))
    )
    assert PowerSGD(2, warmup_steps=2).traffic(shapes, 2, step=0).all_reduce == 16 * 12 * 4 + 20
    assert "warmup_dtype='bfloat16'" in repr(agg)


def test_non_finite_gradients_reset_the_memory():
    bad = np.ones((8, 6), "float32")
    bad[0, 0] = np.nan
    topk = CompressorAggregator(TopKCompressor(0.25), error_feedback=True)
    state = state_for(topk, bad.shape)
    state["residual"].assign(tf.ones(bad.shape))
    topk.aggregate([Item(tf.constant(bad), 0, state)], tf.constant(0), LocalComm())
    assert np.all(state["residual"].numpy() == 0)

    psgd = PowerSGD(rank=2, warmup_steps=0, min_compression_rate=0)
    state = state_for(psgd, bad.shape)
    q0 = state["q"].numpy()
    [out] = psgd.aggregate([Item(tf.constant(bad), 0, state)], tf.constant(0), LocalComm())
    assert not np.all(np.isfinite(out))  # Still sent: a loss scaler sees it.
    assert np.all(state["residual"].numpy() == 0)
    np.testing.assert_array_equal(state["q"].numpy(), q0)  # Q not poisoned.


def test_compressor_error_feedback_residual_is_input_minus_sent():
    rng = np.random.default_rng(4)
    g1, g2 = (rng.normal(size=(10, 10)).astype("float32") for _ in range(2))
    comp = TopKCompressor(0.1)
    agg = CompressorAggregator(comp, error_feedback=True)
    state = state_for(agg, g1.shape)
    [out1] = agg.aggregate([Item(tf.constant(g1), 0, state)], tf.constant(0), LocalComm())
    payload, ctx = comp.compress(tf.constant(g1))
    np.testing.assert_allclose(out1, comp.decompress(payload, ctx))
    np.testing.assert_allclose(state["residual"].numpy(), g1 - out1.numpy())
    [out2] = agg.aggregate([Item(tf.constant(g2), 0, state)], tf.constant(1), LocalComm())
    corrected = g2 + g1 - out1.numpy()
    top = np.argsort(-np.abs(corrected).ravel())[:10]
    np.testing.assert_allclose(np.sort(out2.numpy().ravel()[top]), np.sort(corrected.ravel()[top]))
    np.testing.assert_allclose(state["residual"].numpy(), corrected - out2.numpy(), atol=1e-6)


SHAPES = [
    ((1024, 1024), "float32"),
    ((1024,), "float32"),
    ((64, 1024), "float32"),
    ((3, 3, 8, 16), "float32"),
    ((5,), "int32"),
    ((7,), "float16"),
]


@pytest.mark.parametrize("setting", SETTINGS)
def test_predicted_traffic_equals_the_payloads_really_sent(setting):
    agg = make_aggregator(setting)
    if isinstance(agg, PowerSGD):
        agg = PowerSGD(agg.rank, warmup_steps=0)
    rng = np.random.default_rng(5)
    items = []
    for key, (shape, dtype) in enumerate(SHAPES):
        value = rng.normal(size=shape) if dtype != "int32" else rng.integers(0, 9, shape)
        items.append(Item(tf.constant(value.astype(dtype)), key, state_for(agg, shape, key, dtype)))
    comm = LocalComm()
    agg.aggregate(items, tf.constant(7, tf.int64), comm)
    predicted = agg.traffic(SHAPES, num_replicas=1)
    dense = sum(math.prod(s) * np.dtype(d).itemsize for s, d in SHAPES)
    recorded = comm.traffic(dense)
    assert (predicted.all_reduce, predicted.all_gather, predicted.dense) == (
        recorded.all_reduce,
        recorded.all_gather,
        recorded.dense,
    )
    assert predicted.sent == 0  # One replica sends nothing.


def ratio(setting, shapes, n=2):
    return make_aggregator(setting).traffic(shapes, n).ratio


def test_byte_ratios_meet_the_targets():
    floats = [s for s in SHAPES if s[1] == "float32"]
    assert ratio("fp16", floats) == 2.0 == ratio("bf16", floats)
    # Top-k at 1%, values and int32 indices all-gathered among 2: 50x.
    assert ratio("topk:0.01", [((1000, 100), "float32")]) == 50.0
    assert ratio("topk:0.01", floats) >= 25
    # PowerSGD rank 4 on an n x m matrix sends (n + m) * 4 numbers: 32x at
    # 256 x 256, 128x at 1024 x 1024.
    assert ratio("powersgd:4", [((256, 256), "float32")]) == 32.0
    mlp = [
        ((64, 1024), "float32"),
        ((1024,), "float32"),
        ((1024, 1024), "float32"),
        ((1024,), "float32"),
        ((1024, 1024), "float32"),
        ((1024,), "float32"),
        ((1024, 10), "float32"),
        ((10,), "float32"),
    ]
    assert ratio("powersgd:4", mlp) >= 50
    # Formulas among N: all-reduce 2(N-1)/N * S, all-gather (N-1) * S.
    t = make_aggregator("topk:0.01").traffic([((1000, 100), "float32")], 4)
    assert t.dense_sent == 2 * 3 / 4 * 400000 and t.sent == 3 * 1000 * 8


def test_predict_traffic_from_a_model_before_training():
    import keras

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(512), keras.layers.Dense(10)])
    t = predict_traffic(model, "powersgd:4", num_replicas=2)
    assert t.dense == (64 * 512 + 512 + 512 * 10 + 10) * 4
    assert t.all_reduce == ((64 + 512) * 4 + 512 + (512 + 10) * 4 + 10) * 4
    assert t.collectives == 2
    warm = predict_traffic(model, "powersgd:4", num_replicas=2, step=0)
    assert warm.ratio == 1.0 and warm.collectives == 1
    with pytest.raises(tfdist.ConfigError) as info:
        predict_traffic(model, "fp16", num_replicas=0)
    assert info.value.field == "num_replicas"


def test_error_feedback_defaults_and_bad_pairings():
    assert make_aggregator("topk").memory is not None
    assert make_aggregator("sign").memory is not None
    assert make_aggregator("fp16").memory is None
    assert make_aggregator("qsgd").memory is None
    assert make_aggregator("powersgd").error_feedback is True
    assert make_aggregator("topk", error_feedback=False).memory is None
    assert make_aggregator(ErrorFeedback(TopKCompressor(0.1))).memory is not None
    with pytest.raises(tfdist.ConfigError) as info:
        make_aggregator("none", error_feedback=True)
    assert info.value.field == "error_feedback"
    with pytest.raises(tfdist.ConfigError) as info:
        make_aggregator("topk", error_feedback="yes")
    assert info.value.field == "error_feedback" and "'yes'" in str(info.value)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"rank": 0}, "rank"),
        ({"rank": 2.5}, "rank"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"warmup_dtype": "float16"}, "warmup_dtype"),
        ({"min_compression_rate": -1.0}, "min_compression_rate"),
        ({"min_compression_rate": float("nan")}, "min_compression_rate"),
    ],
)
def test_powersgd_bad_arguments_name_the_field(kwargs, field):
    with pytest.raises(tfdist.ConfigError) as info:
        PowerSGD(**kwargs)
    assert info.value.field == field
    assert repr(next(iter(kwargs.values()))) in str(info.value)


def test_powersgd_setting_strings():
    assert make_aggregator("powersgd:2").rank == 2
    with pytest.raises(tfdist.ConfigError) as info:
        make_aggregator("powersgd:0")
    assert info.value.field == "compression" and "'powersgd:0'" in str(info.value)


@pytest.mark.parametrize("setting", SETTINGS)
def test_sparse_gradients_are_gathered_and_counted_beside_dense_ones(setting):
    # An IndexedSlices among dense gradients: 6 lookups (duplicates kept) of
    # a (100, 7) table with int32 ids. TensorFlow all-gathers it; only a
    # cast changes its values' dtype; the bytes predicted are those recorded.
    from tfdist.compression.sparse import SparseGradient

    agg = make_aggregator(setting)
    if isinstance(agg, PowerSGD):
        agg = PowerSGD(agg.rank, warmup_steps=0)
    rng = np.random.default_rng(3)
    values = rng.normal(size=(6, 7)).astype("float32")
    slices = tf.IndexedSlices(
        tf.constant(values), tf.constant([4, 9, 4, 0, 99, 9]), tf.constant([100, 7])
    )
    dense = [((64, 32), "float32"), ((32,), "float32")]
    items = [Item(slices, 0, state_for(agg, (100, 7), 0))]
    for key, (shape, dtype) in enumerate(dense, start=1):
        items.append(
            Item(
                tf.constant(rng.normal(size=shape).astype(dtype)),
                key,
                state_for(agg, shape, key, dtype),
            )
        )
    comm = LocalComm()
    out = agg.aggregate(items, tf.constant(7, tf.int64), comm)
    specs = [SparseGradient((100, 7), "float32", rows=6, index_dtype="int32"), *dense]
    predicted = agg.traffic(specs, num_replicas=1)
    recorded = comm.traffic(predicted.dense, predicted.dense_gather)
    assert (predicted.all_reduce, predicted.all_gather) == (
        recorded.all_reduce,
        recorded.all_gather,
    )
    wire = {"fp16": "float16", "bf16": "bfloat16"}.get(setting, "float32")
    assert comm.sliced[0][:3] == ((7,), wire, "int32")
    assert predicted.dense_gather == 4 + 6 * (7 * 4 + 4)  # Row count, values, indices.
    if setting in ("none", "fp16", "bf16", "randomk:0.01", "powersgd:4"):  # Nothing else gathered.
        assert predicted.all_gather == 4 + 6 * (7 * (4 if wire == "float32" else 2) + 4)
    assert predicted.dense == (64 * 32 + 32) * 4  # The table is not all-reduced.
    assert isinstance(out[0], tf.IndexedSlices)
    np.testing.assert_array_equal(out[0].indices, [4, 9, 4, 0, 99, 9])
    np.testing.assert_allclose(out[0].values, values, rtol=0 if wire == "float32" else 1e-2)
