"""tfdist.horovod.callbacks: Horovod's Keras callbacks on Keras 3.

Single-process tests (size() == 1, no environment) check the learning-rate
schedules against a numpy SGD with Horovod's momentum correction, and the
errors. The slow test runs one 2-worker job (tests/workers/hvd_callbacks.py)
under ``tfdist launch`` that checks the broadcast, the metric average and the
warm-up formula at once.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from conftest import REPO

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

from tfdist.errors import ConfigError  # noqa: E402
from tfdist.horovod import callbacks as hvd_callbacks  # noqa: E402

STEPS, BATCH, EPOCHS = 4, 4, 2
RNG = np.random.default_rng(7)
X = RNG.normal(size=(STEPS * BATCH, 3)).astype("float32")
Y = RNG.normal(size=(STEPS * BATCH, 1)).astype("float32")
W0 = np.array([[0.5], [-0.25], [1.0]], "float32")


@pytest.fixture(autouse=True, scope="module")
def one_rank():
    """hvd.init() with no launcher variables: one rank."""
    import tfdist.horovod as hvd

    hvd.init()
    assert hvd.size() == 1 and hvd.rank() == 0


class RateRecorder(keras.callbacks.Callback):
    """Records the optimizer's rate before every batch (put it after the schedule)."""

    def __init__(self):
        super().__init__()
        self.rates = []
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        rate = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
        self.rates.append((self.epoch, batch, rate))


def linear_model(optimizer):
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(
                1, use_bias=False, kernel_initializer=keras.initializers.Constant(W0)
            ),
        ]
    )
    model.compile(optimizer=optimizer, loss="mse")
    return model


def numpy_sgd(rates, momentum, start_lr, correction):
    """Keras 3 SGD (m = momentum*m - lr*g; w += m) on the linear model, in numpy,
    with Horovod's momentum correction: the step after a rate change from
    ``old`` to ``new`` uses ``momentum * new / old``."""
    w = W0.astype("float64")
    m = np.zeros_like(w)
    old = start_lr
    for epoch, batch, _ in rates:
        new = rates[epoch * STEPS + batch][2]
        xb = X[batch * BATCH : (batch + 1) * BATCH].astype("float64")
        yb = Y[batch * BATCH : (batch + 1) * BATCH].astype("float64")
        grad = 2.0 / BATCH * xb.T @ (xb @ w - yb)
        mom = momentum * new / old if correction and old > 0 and new != old else momentum
        m = mom * m - new * grad
        w = w + m
        old = new
    return w


@pytest.mark.parametrize("correction", [True, False])
def test_schedule_per_batch_with_momentum_correction_matches_numpy(correction):
    start_lr, momentum, initial = 0.05, 0.9, 0.1
    model = linear_model(keras.optimizers.SGD(start_lr, momentum=momentum))
    schedule = hvd_callbacks.LearningRateScheduleCallback(
        initial_lr=initial,
        multiplier=lambda epoch: 1.0 / (1.0 + epoch),
        staircase=False,
        momentum_correction=correction,
    )
    recorder = RateRecorder()
    history = model.fit(
        X,
        Y,
        batch_size=BATCH,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=[schedule, recorder],
    )
    # The rate before each batch: initial * multiplier(epoch + batch / steps).
    expected = [initial / (1.0 + e + b / STEPS) for e in range(EPOCHS) for b in range(STEPS)]
    np.testing.assert_allclose([r for _, _, r in recorder.rates], expected, rtol=1e-6)
    assert history.history["lr"] == pytest.approx([expected[STEPS - 1], expected[-1]], rel=1e-6)
    want = numpy_sgd(recorder.rates, momentum, start_lr, correction)
    np.testing.assert_allclose(model.get_weights()[0], want, rtol=1e-5, atol=1e-6)
    # The correction changes the result: the comparison above can tell.
    other = numpy_sgd(recorder.rates, momentum, start_lr, not correction)
    assert np.abs(other - want).max() > 1e-3


def test_staircase_schedule_with_a_constant_multiplier():
    model = linear_model(keras.optimizers.Adam(0.01))
    schedule = hvd_callbacks.LearningRateScheduleCallback(
        initial_lr=0.02, multiplier=0.5, start_epoch=1, end_epoch=3
    )
    recorder = RateRecorder()
    model.fit(
        X, Y, batch_size=BATCH, epochs=4, shuffle=False, verbose=0, callbacks=[schedule, recorder]
    )
    by_epoch = {}
    for epoch, _, rate in recorder.rates:
        by_epoch.setdefault(epoch, set()).add(round(rate, 9))
    # Epoch 0: untouched; 1 and 2: 0.02 * 0.5 ** (epoch - 1); 3: left as it was.
    assert by_epoch == {0: {0.01}, 1: {0.02}, 2: {0.01}, 3: {0.01}}


def test_warmup_on_one_process_keeps_the_rate_and_reports_it(capsys):
    model = linear_model(keras.optimizers.SGD(0.3, momentum=0.5))
    warmup = hvd_callbacks.LearningRateWarmupCallback(initial_lr=0.3, warmup_epochs=1, verbose=1)
    recorder = RateRecorder()
    history = model.fit(
        X, Y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[warmup, recorder]
    )
    # size() == 1: initial_lr / 1 * (e * 0 / warmup + 1) = initial_lr.
    assert {round(r, 7) for _, _, r in recorder.rates} == {0.3}
    assert history.history["lr"] == pytest.approx([0.3, 0.3])
    assert "Epoch 1: finished gradual learning rate warmup to 0.3." in capsys.readouterr().out


def test_the_rate_of_a_loss_scale_optimizer_is_its_inner_optimizers():
    inner = keras.optimizers.SGD(0.05, momentum=0.9)
    model = linear_model(keras.optimizers.LossScaleOptimizer(inner))
    schedule = hvd_callbacks.LearningRateScheduleCallback(initial_lr=0.2, multiplier=0.5)
    history = model.fit(
        X, Y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[schedule]
    )
    assert history.history["lr"] == pytest.approx([0.2, 0.1])
    assert float(inner.learning_rate) == pytest.approx(0.1)


def test_a_learning_rate_schedule_cannot_be_set():
    rate = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)
    model = linear_model(keras.optimizers.SGD(rate))
    warmup = hvd_callbacks.LearningRateWarmupCallback(initial_lr=0.1)
    with pytest.raises(ConfigError, match="optimizer.learning_rate") as info:
        model.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[warmup])
    assert "LearningRateWarmupCallback" in str(info.value)
    assert "ExponentialDecay" in str(info.value)


def test_unknown_steps_per_epoch_asks_for_it():
    data = tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH).filter(lambda x, y: True)
    model = linear_model(keras.optimizers.SGD(0.1))
    warmup = hvd_callbacks.LearningRateWarmupCallback(initial_lr=0.1)
    with pytest.raises(ConfigError, match="steps_per_epoch") as info:
        model.fit(data, epochs=1, verbose=0, callbacks=[warmup])
    assert "Received: None" in str(info.value)
    # Given explicitly, it runs and sets 0.1 * (...) with size() == 1: 0.1.
    warmup = hvd_callbacks.LearningRateWarmupCallback(initial_lr=0.1, steps_per_epoch=STEPS)
    model.fit(data, epochs=1, verbose=0, callbacks=[warmup])
    assert float(model.optimizer.learning_rate) == pytest.approx(0.1)


def test_bad_arguments_name_the_field():
    cases = [
        (lambda: hvd_callbacks.BroadcastGlobalVariablesCallback(-1), "root_rank"),
        (
            lambda: hvd_callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[3]),
            "local_variables",
        ),
        (lambda: hvd_callbacks.LearningRateWarmupCallback(None), "initial_lr"),
        (lambda: hvd_callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=0), "warmup_epochs"),
        (lambda: hvd_callbacks.LearningRateScheduleCallback(0.1, multiplier="x"), "multiplier"),
    ]
    for make, field in cases:
        with pytest.raises(ConfigError, match=f"field '{field}'"):
            make()


def test_broadcast_callback_builds_the_optimizer_and_runs_once():
    model = linear_model(keras.optimizers.Adam(0.01))
    callback = hvd_callbacks.BroadcastGlobalVariablesCallback(0)
    model.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[callback])
    assert callback.broadcast_done and model.optimizer.built
    # A root rank past size() is refused when the broadcast would run.
    late = hvd_callbacks.BroadcastGlobalVariablesCallback(1)
    with pytest.raises(ConfigError, match=r"a rank in \[0, 0\]"):
        model.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[late])


def test_metric_average_on_one_process_keeps_the_logs():
    logs = {"loss": 0.25, "accuracy": 0.5, "note": "text"}
    assert hvd_callbacks.average_logs(dict(logs)) == logs


@pytest.mark.slow
def test_two_workers_broadcast_average_and_warm_up(tmp_path):
    """One 2-worker job: broadcast (model and optimizer slots), metric mean, warm-up."""
    from tfdist.engines.launch import launch

    out = io.StringIO()
    result = launch(
        str(REPO / "tests" / "workers" / "hvd_callbacks.py"),
        [str(tmp_path)],
        workers=2,
        output=out,
        handle_signals=False,
        stop_timeout=3,
    )
    assert result.ok, out.getvalue()[-4000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    size, steps, warmup, initial = (
        ranks[0][k] for k in ("size", "steps", "warmup_epochs", "initial_lr")
    )
    assert size == 2

    # Broadcast: different before training (weights and the optimizer slots that
    # rank 0 alone had set up), identical right after batch 0 and at the end.
    before = [r["digest_train_begin"] for r in ranks]
    assert before[0]["model"] != before[1]["model"]
    assert before[0]["optimizer"] != before[1]["optimizer"]
    for when in ("digest_after_batch_0", "digest_end"):
        for what in ("model", "optimizer"):
            assert ranks[0][when][what] == ranks[1][when][what], (when, what)
        # Dropout's random stream stays each rank's own, as in Horovod.
        assert ranks[0][when]["seed_state"] != ranks[1][when]["seed_state"], when
    np.testing.assert_array_equal(ranks[0]["weights"], ranks[1]["weights"])

    # Metric average: every rank's logs (and History) hold the mean of the
    # values the ranks computed themselves.
    for epoch in range(len(ranks[0]["raw_logs"])):
        own = [r["raw_logs"][epoch] for r in ranks]
        assert own[0]["loss"] != pytest.approx(own[1]["loss"])  # The ranks differ.
        for rank in ranks:
            averaged = rank["averaged_logs"][epoch]
            for name in ("loss", "mean_absolute_error"):
                mean = (own[0][name] + own[1][name]) / 2
                assert averaged[name] == pytest.approx(mean, rel=1e-6), (epoch, name)
                assert rank["history"][name][epoch] == pytest.approx(mean, rel=1e-6)

    # Warm-up: the rate before each batch follows Horovod's formula.
    for rank in ranks:
        for epoch, batch, rate in rank["rates"]:
            if epoch < warmup:
                e = epoch + batch / steps + 1 / steps
                want = initial / size * (e * (size - 1) / warmup + 1)
            else:
                want = initial  # Left where the warm-up ended.
            assert rate == pytest.approx(want, rel=1e-6), (epoch, batch)
        assert rank["rates"][0][2] == pytest.approx(
            initial / size * (1 + 1 / (steps * warmup)), rel=1e-6
        )

    # Different metric names on the ranks: an error on every rank, naming both.
    for rank in ranks:
        assert (
            "rank 0: ['loss', 'only_on_rank_0']; rank 1: ['loss', 'only_on_rank_1']"
            in rank["mismatch"]
        )
