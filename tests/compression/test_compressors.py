"""Tests of the gradient compressors (tfdist.compression), eager TF on CPU."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tensorflow as tf

# Splits the CPU into logical devices before this module's eager ops start
# TensorFlow, whatever order the test files run in.
pytestmark = pytest.mark.usefixtures("tf_cpus")

from tfdist.compression import (  # noqa: E402
    BF16Compressor,
    ErrorFeedback,
    FP16Compressor,
    NoneCompressor,
    QSGDCompressor,
    RandomKCompressor,
    SignCompressor,
    TopKCompressor,
    default_error_feedback,
    make_aggregator,
    make_compressor,
    reduce_compressed,
)
from tfdist.errors import ConfigError  # noqa: E402

# The small tensors of these tests are below top-k's and sign's default
# min_size (sent whole): min_size=0 compresses them; both forms are tested.
ALL = [
    NoneCompressor(),
    FP16Compressor(),
    BF16Compressor(),
    TopKCompressor(0.1, min_size=0),
    TopKCompressor(0.1),
    RandomKCompressor(0.1),
    RandomKCompressor(0.1, unbiased=False),
    SignCompressor(min_size=0),
    SignCompressor(),
    QSGDCompressor(16),
]


def _data(shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _roundtrip(comp, x, step=0, key=0):
    payload, ctx = comp.compress(tf.constant(x), step=step, key=key)
    return payload, ctx, comp.decompress(payload, ctx).numpy()


def _wire_bytes(payload):
    return sum(p.shape.num_elements() * p.dtype.size for p in payload)


@pytest.mark.parametrize("comp, rtol", [(FP16Compressor(), 1e-3), (BF16Compressor(), 1e-2)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_casting_roundtrip(comp, rtol, dtype):
    x = _data((3, 5), dtype=dtype)
    payload, _, y = _roundtrip(comp, x)
    assert y.dtype == dtype and y.shape == x.shape
    assert payload[0].dtype in (tf.float16, tf.bfloat16)
    np.testing.assert_allclose(y, x, rtol=rtol, atol=1e-6)
    assert comp.payload_bytes((3, 5), "float32") * 2 == 15 * 4 == 2 * _wire_bytes(payload)


def test_fp16_huge_values_stay_finite_and_prescale_undone():
    x = np.array([1e6, -1e6, 3.0], np.float32)
    _, _, y = _roundtrip(FP16Compressor(), x)
    assert np.all(np.isfinite(y))
    np.testing.assert_allclose(y, [65504, -65504, 3.0])
    _, _, y = _roundtrip(FP16Compressor(prescale=0.25), np.array([1000.0, -2.0], np.float32))
    np.testing.assert_allclose(y, [1000.0, -2.0], rtol=1e-3)


def test_topk_keeps_largest_magnitudes():
    x = _data((10, 7))
    comp = TopKCompressor(0.1, min_size=0)
    k = math.ceil(0.1 * 70)
    payload, _, y = _roundtrip(comp, x)
    expected = np.argsort(-np.abs(x.ravel()))[:k]
    assert sorted(payload[1].numpy()) == sorted(expected)
    dense = np.zeros(70, np.float32)
    dense[expected] = x.ravel()[expected]
    np.testing.assert_array_equal(y, dense.reshape(10, 7))
    assert comp.payload_bytes((10, 7), tf.float32) == k * (4 + 4) == _wire_bytes(payload)


def test_topk_k_has_no_float_error():
    assert TopKCompressor(0.07, min_size=0).payload_bytes((100,), "float32") == 7 * 8
    assert TopKCompressor(1e-9, min_size=0).payload_bytes((5,), "float32") == 8  # k >= 1


def test_randomk_replicas_agree_and_sum():
    a, b = RandomKCompressor(0.2, seed=3), RandomKCompressor(0.2, seed=3)
    x1, x2 = _data((50,), 1), _data((50,), 2)
    p1, c1 = a.compress(tf.constant(x1), step=5, key=2)
    p2, c2 = b.compress(tf.constant(x2), step=5, key=2)
    np.testing.assert_array_equal(c1.indices.numpy(), c2.indices.numpy())
    assert len(set(c1.indices.numpy())) == 10  # Distinct.
    _, c3 = b.compress(tf.constant(x2), step=6, key=2)
    assert set(c3.indices.numpy()) != set(c1.indices.numpy())
    _, c4 = b.compress(tf.constant(x2), step=5, key=3)
    assert set(c4.indices.numpy()) != set(c1.indices.numpy())
    summed = a.decompress((p1[0] + p2[0],), c1).numpy()
    each = a.decompress(p1, c1).numpy() + b.decompress(p2, c2).numpy()
    np.testing.assert_allclose(summed, each, rtol=1e-6)
    assert a.payload_bytes((50,), "float32") == 10 * 4 == _wire_bytes(p1)


@pytest.mark.parametrize("n", [1, 8, 13, 64, 67])
def test_sign(n):
    x = _data((n,), n)
    x[x == 0] = 1.0
    comp = SignCompressor(min_size=0)
    payload, _, y = _roundtrip(comp, x)
    np.testing.assert_allclose(y, np.mean(np.abs(x)) * np.sign(x), rtol=1e-6)
    assert comp.payload_bytes((n,), "float32") == math.ceil(n / 8) + 4 == _wire_bytes(payload)
    assert payload[0].dtype == tf.uint8 and payload[1].dtype == tf.float32


@pytest.mark.parametrize("comp", [TopKCompressor(0.01), SignCompressor()], ids=["topk", "sign"])
def test_small_tensors_are_sent_whole(comp):
    assert comp.min_size == 1024
    small = _data((64, 10))  # 640 entries: e.g. a 64-unit layer's 10-class output kernel.
    payload, _, y = _roundtrip(comp, small)
    np.testing.assert_array_equal(y, small)
    assert len(payload) == 1 and _wire_bytes(payload) == 640 * 4
    assert comp.payload_bytes((64, 10), "float32") == 640 * 4
    large = _data((32, 32))  # 1024 entries: compressed.
    payload, _, y = _roundtrip(comp, large)
    assert not np.array_equal(y, large) and len(payload) == 2
    assert comp.payload_bytes((32, 32), "float32") == _wire_bytes(payload) < 1024 * 4 / 8


def test_randomk_is_unbiased_by_default():
    x = _data((40,))
    comp = RandomKCompressor(0.25)
    assert comp.unbiased and not comp.contractive
    total = np.zeros_like(x)
    runs = 400
    for step in range(runs):
        _, ctx, y = _roundtrip(comp, x, step=step)
        kept = ctx.indices.numpy()
        np.testing.assert_allclose(y[kept], 4 * x[kept], rtol=1e-6)  # n / k = 40 / 10
        assert np.count_nonzero(y) == 10
        total += y
    # Each entry is 4x or 0 with probability 1/4: std sqrt(3)|x|; the mean of
    # `runs` draws is within 5 standard errors of x.
    np.testing.assert_allclose(
        total / runs, x, atol=5 * math.sqrt(3) * np.abs(x).max() / math.sqrt(runs)
    )
    _, _, y = _roundtrip(RandomKCompressor(0.25, unbiased=False), x)
    assert set(y[y != 0]) <= set(x)  # Unscaled: the kept values as they are.


def test_error_feedback_refuses_unbiased_randomk():
    with pytest.raises(ConfigError) as info:
        ErrorFeedback(RandomKCompressor(0.1))
    assert info.value.field == "compressor" and "contractive" in str(info.value)
    assert "unbiased=False" in str(info.value)
    for setting in ("randomk", "randomk:0.01", RandomKCompressor(0.01)):
        with pytest.raises(ConfigError) as info:
            make_aggregator(setting, error_feedback=True)
        assert info.value.field == "error_feedback" and "unbiased=False" in str(info.value)
    # The unscaled form takes error feedback, and gets it by default.
    ef = make_aggregator(RandomKCompressor(0.01, unbiased=False))
    assert ef.memory is not None and ef.memory.compressor.ratio == 0.01
    assert make_aggregator("randomk").memory is None
    assert make_aggregator("randomk:0.01").memory is None


def test_qsgd_on_grid_and_unbiased():
    x = _data((40,))
    comp = QSGDCompressor(4, seed=1)
    norm = np.linalg.norm(x)
    total = np.zeros_like(x)
    runs = 400
    for step in range(runs):
        payload, _, y = _roundtrip(comp, x, step=step)
        if step == 0:
            assert payload[1].dtype == tf.int8
            levels = y / norm * 4
            np.testing.assert_allclose(levels, np.round(levels), atol=1e-4)
            assert np.all(np.abs(levels) <= 4 + 1e-4)
        total += y
    # Each entry's rounding error has std <= norm / (2 s); its mean over
    # `runs` draws is well within 5 standard errors.
    np.testing.assert_allclose(total / runs, x, atol=5 * norm / 8 / math.sqrt(runs))
    assert comp.payload_bytes((40,), "float32") == 4 + 40 == _wire_bytes(payload)
    assert QSGDCompressor(200).payload_bytes((40,), "float32") == 4 + 80


def test_qsgd_buckets_have_their_own_norms():
    x = _data((1000,), seed=3)
    x[:500] *= 100.0  # One loud bucket must not drown the quiet one.
    comp = QSGDCompressor(8, bucket_size=500)
    payload, _, y = _roundtrip(comp, x, step=1)
    np.testing.assert_allclose(
        payload[0], [np.linalg.norm(x[:500]), np.linalg.norm(x[500:])], rtol=1e-5
    )
    levels = y[500:] / np.linalg.norm(x[500:]) * 8
    np.testing.assert_allclose(levels, np.round(levels), atol=1e-3)
    one_norm = QSGDCompressor(8, bucket_size=10**9)
    # The quiet bucket's rounding variance (squared error) shrinks with its norm.
    err_buckets = np.square(y[500:] - x[500:]).mean()
    err_one = np.square(_roundtrip(one_norm, x, step=1)[2][500:] - x[500:]).mean()
    assert err_buckets < 0.1 * err_one, (err_buckets, err_one)
    # 3 buckets of 400, 400 and 200: 3 norms and 1000 int8 levels.
    assert QSGDCompressor(8, bucket_size=400).payload_bytes((1000,), "float32") == 3 * 4 + 1000


def test_error_feedback_residual_and_telescoping():
    ef = ErrorFeedback(TopKCompressor(0.1))
    residual = None
    sent = np.zeros((6, 5), np.float32)
    inputs = np.zeros((6, 5), np.float32)
    for step in range(8):
        g = _data((6, 5), step)
        corrected = ef.compensate(tf.constant(g), residual)
        payload, ctx, new = ef.compress(tf.constant(g), residual, step=step)
        decoded = ef.decompress(payload, ctx).numpy()
        np.testing.assert_array_equal(new.numpy(), corrected.numpy() - decoded)
        residual = new
        sent += decoded
        inputs += g
    np.testing.assert_allclose(sent + residual.numpy(), inputs, atol=1e-5)


def test_error_feedback_nan_resets_memory():
    ef = ErrorFeedback(SignCompressor())
    g = np.array([1.0, np.nan, -2.0], np.float32)
    _, _, residual = ef.compress(tf.constant(g), tf.ones([3]))
    np.testing.assert_array_equal(residual.numpy(), np.zeros(3))
    _, _, residual = ef.compress(tf.constant([np.inf, 1.0, 2.0]), None)
    assert np.all(np.isfinite(residual.numpy()))


@pytest.mark.parametrize(
    "make, field, value",
    [
        (lambda: TopKCompressor(0), "ratio", 0),
        (lambda: TopKCompressor(1.5), "ratio", 1.5),
        (lambda: RandomKCompressor(-0.1), "ratio", -0.1),
        (lambda: RandomKCompressor(0.1, unbiased=1), "unbiased", 1),
        (lambda: TopKCompressor(0.1, min_size=-1), "min_size", -1),
        (lambda: SignCompressor(min_size=1.5), "min_size", 1.5),
        (lambda: QSGDCompressor(0), "levels", 0),
        (lambda: FP16Compressor(prescale=0), "prescale", 0),
        (lambda: make_compressor("zip"), "compression", "zip"),
        (lambda: make_compressor("powersgd"), "compression", "powersgd"),
        (lambda: ErrorFeedback(NoneCompressor()), "compressor", NoneCompressor()),
    ],
)
def test_bad_arguments(make, field, value):
    with pytest.raises(ConfigError) as info:
        make()
    assert isinstance(info.value, ValueError)
    assert info.value.field == field
    assert repr(value) in str(info.value)


def test_make_compressor_and_defaults():
    assert make_compressor("topk").ratio == 0.01 and make_compressor("topk").min_size == 1024
    assert make_compressor("sign").min_size == 1024
    assert make_compressor("randomk").ratio == 0.25 and make_compressor("randomk").unbiased
    assert make_compressor("randomk:0.5").ratio == 0.5
    assert make_compressor("qsgd").levels == 16
    assert make_compressor(None).name == "none"
    comp = SignCompressor()
    assert make_compressor(comp) is comp
    for name in ["none", "fp16", "bf16", "topk", "randomk", "sign", "qsgd"]:
        assert make_compressor(name).name == name
    assert [default_error_feedback(n) for n in ("topk", "sign")] == [True] * 2
    assert not any(default_error_feedback(n) for n in ("none", "fp16", "bf16", "qsgd", "randomk"))
    assert not default_error_feedback(RandomKCompressor())
    assert default_error_feedback(RandomKCompressor(unbiased=False))


@pytest.mark.parametrize("comp", ALL, ids=lambda c: c.name)
def test_works_in_tf_function(comp):
    traces = []

    @tf.function
    def roundtrip(x, step):
        traces.append(1)
        payload, ctx = comp.compress(x, step=step, key=1)
        return comp.decompress(payload, ctx)

    x = tf.constant(_data((4, 6)))
    eager = comp.decompress(*comp.compress(x, step=tf.constant(3, tf.int64), key=1)).numpy()
    first = roundtrip(x, tf.constant(3, tf.int64)).numpy()
    roundtrip(x, tf.constant(4, tf.int64))
    assert len(traces) == 1
    assert first.shape == (4, 6)
    np.testing.assert_allclose(first, eager, rtol=1e-6)  # Same seed => same result.


@pytest.mark.parametrize("comp", ALL, ids=lambda c: c.name)
def test_reduce_compressed_matches_decompress_each(comp):
    xs = [_data((3, 7), seed) for seed in range(3)]
    payloads, ctxs = zip(*(comp.compress(tf.constant(x), step=2, key=4) for x in xs))
    reduced = reduce_compressed(comp, list(payloads), ctxs[0]).numpy()
    each = sum(comp.decompress(p, c).numpy() for p, c in zip(payloads, ctxs))
    # fp16/bf16 payloads are summed in 16 bits: a few ulps of rounding.
    tol = 2e-2 if comp.name in ("fp16", "bf16") else 1e-5
    np.testing.assert_allclose(reduced, each, rtol=tol, atol=tol)


@pytest.mark.parametrize("comp", ALL, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_payload_bytes_match_the_payload(comp, dtype):
    x = _data((5, 9), dtype=dtype)
    payload, _, y = _roundtrip(comp, x)
    assert y.dtype == dtype and y.shape == (5, 9)
    assert comp.payload_bytes((5, 9), tf.as_dtype(dtype)) == _wire_bytes(payload)


def test_qsgd_zero_tensor_decodes_to_zero():
    _, _, y = _roundtrip(QSGDCompressor(), np.zeros((4,), np.float32))
    np.testing.assert_array_equal(y, np.zeros(4))
