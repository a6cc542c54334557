"""Keras's ``gradient_accumulation_steps`` under tfdist's strategies.

Under TensorFlow's MirroredStrategy, Keras 3.15 fails to trace an optimizer
with gradient accumulation (keras-team/keras#20582: "`merge_call` called
while defining a new graph or a tf.function"), in fit and in custom loops;
tfdist's strategies fix it (tfdist/training/accumulation.py). k accumulated
steps must equal one step on a k times larger batch, and with compression
the accumulated gradient is compressed and sent once every k steps.
"""

from __future__ import annotations

import numpy as np
import pytest

import tfdist
from canary import upstream_bug
from conftest import finish, results_by_task, start
from tfdist.compat.versions import installed, satisfies
from workers import accumulation_check, loop_check

K = 4


def _fit(strategy, batch_size, accumulation, callbacks=(), examples=256):
    import keras

    rng = np.random.default_rng(0)
    x = rng.normal(size=(examples, 8)).astype("float32")
    y = (x.sum(axis=1, keepdims=True) > 0).astype("float32")
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
        )
        model.compile(
            optimizer=keras.optimizers.SGD(
                0.05, momentum=0.9, gradient_accumulation_steps=accumulation
            ),
            loss=keras.losses.BinaryCrossentropy(from_logits=True),
        )
    history = model.fit(
        x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0, callbacks=list(callbacks)
    )
    return {
        "weights": model.get_weights(),
        "loss": history.history["loss"],
        "iterations": int(model.optimizer.iterations.numpy()),
    }


def test_stock_mirrored_fails_with_gradient_accumulation(tf_cpus):
    stock = tf_cpus.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    keras_version = installed()["keras"]
    patch = "accumulation.ops" if satisfies(keras_version, "<3.16") else "accumulation.backend"
    with upstream_bug(patch, RuntimeError, "merge_call"):
        _fit(stock, 16, K)


@pytest.mark.parametrize("compression", [None, "topk:0.1"])
def test_fit_with_accumulation_equals_a_k_times_larger_batch(tf_cpus, compression):
    from tfdist.compression import CommunicationStats

    def strategy():
        return tfdist.strategy_from_config(cpu_replicas=2, compression=compression)

    small, accumulated, large = CommunicationStats(), CommunicationStats(), CommunicationStats()
    plain = _fit(strategy(), 16, None, [small])
    ours = _fit(strategy(), 16, K, [accumulated])
    reference = _fit(strategy(), 16 * K, None, [large])
    # 2 epochs of 256 examples: 32 steps of 16, 8 updates of 4 x 16.
    assert plain["iterations"] == 32 and ours["iterations"] == reference["iterations"] == 8
    assert accumulated.steps == 32 and large.steps == 8
    if compression is None:
        # Keras splits each batch of 16 between the replicas, so the sums
        # are the same but added in another order.
        for a, b in zip(ours["weights"], reference["weights"]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # Gradients go over the wire once per update: per example, k times
    # fewer bytes than without accumulation, as many as with the large batch.
    assert accumulated.total_bytes == large.total_bytes > 0
    assert small.total_bytes == K * accumulated.total_bytes
    assert accumulated.last.sent == small.last.sent


@pytest.mark.parametrize("setting", [None, "bf16", "powersgd", "topk:0.2"])
def test_custom_loop_accumulation_equals_a_k_times_larger_batch(tf_cpus, setting):
    from tfdist.compression import PowerSGD

    def strategy():
        compression = (
            PowerSGD(rank=1, warmup_steps=1)
            if setting == "powersgd"
            else loop_check.compression_of(setting)
        )
        return tfdist.strategy_from_config(cpu_replicas=2, compression=compression)

    ours = accumulation_check.train(strategy(), k=K, micro_steps=4 * K)
    reference = accumulation_check.reference(strategy(), k=K, micro_steps=4 * K)
    assert ours["iterations"] == reference["iterations"] == 4
    # Each replica accumulates what it gets in one large step, so even the
    # compressed runs reduce the same sums: the same weights.
    for a, b in zip(ours["weights"], reference["weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    applied = [s["applied"] for s in ours["states"]]
    assert applied == [(i + 1) % K == 0 for i in range(4 * K)]
    # The aggregation (which updates residuals and PowerSGD's Q) ran only in
    # the steps that applied...
    assert not any(s["state_changed"] for s in ours["states"] if not s["applied"])
    if setting in ("powersgd", "topk:0.2"):
        assert any(s["state_changed"] for s in ours["states"])
    # ...and only those sent bytes: as many, for the same examples, as the
    # k-times-larger batch (PowerSGD's dense warm-up step included).
    assert [sent > 0 for sent in ours["sent"]] == applied
    assert ours["examples"] == reference["examples"]
    assert sum(ours["sent"]) == sum(reference["sent"]) > 0


@pytest.mark.slow
def test_accumulation_on_two_workers(tf_cpus):
    proc = start(
        [
            "-m",
            "tfdist",
            "launch",
            "--workers",
            "2",
            "--show-all",
            "tests/workers/accumulation_worker.py",
            "none,powersgd",
        ]
    )
    [(code, out, err)] = finish([proc], timeout=900)
    assert code == 0, (out + err)[-4000:]
    results = results_by_task(out)
    assert sorted(results) == ["worker:0", "worker:1"], out[-3000:]
    chief, other = results["worker:0"], results["worker:1"]
    assert chief == other  # Synchronous: bit-identical results on both workers.
    for setting, found in chief.items():
        assert found["replicas"] == 2
        assert found["iterations"] == [4, 4], (setting, found)
        assert found["max_weight_difference"] < 1e-5, (setting, found)
        assert found["sent_steps"] == [i for i in range(4 * K) if (i + 1) % K == 0]
        assert found["state_changed_without_applying"] is False
        assert found["bytes_ratio"] == pytest.approx(1.0), (setting, found)


def test_compression_benchmark_records_bytes_per_example_with_accumulation(tmp_path):
    import json
    import subprocess
    import sys

    from conftest import REPO, subprocess_env

    args = [
        sys.executable,
        "benchmarks/compression.py",
        "--mode=replicas",
        "--epochs=2",
        "--examples=1024",
        "--hidden=32",
        "--global_batch=64",
        "--settings=plain,topk:0.1,topk:0.1/acc4",
        f"--results_dir={tmp_path}",
    ]
    done = subprocess.run(
        args, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    by = {
        r["setting"]: r
        for r in json.loads((tmp_path / "compression_replicas.json").read_text())["rows"]
    }
    plain, accumulated = by["topk:0.1"], by["topk:0.1/acc4"]
    assert (plain["updates"], accumulated["updates"]) == (32, 8)
    # The same compressed bytes per update, 4 times fewer per example.
    assert accumulated["callback_bytes"] == plain["callback_bytes"] == plain["bytes_sent"]
    assert accumulated["bytes_per_example"] == plain["bytes_per_example"] / 4
    assert "| topk:0.1/acc4 | 4 | 8 |" in (tmp_path / "compression_replicas.md").read_text()


def test_step_traffic_needs_a_step(tf_cpus):
    import keras

    from tfdist.compression import step_traffic

    strategy = tfdist.strategy_from_config(cpu_replicas=2, compression="bf16")
    with strategy.scope():
        optimizer = keras.optimizers.SGD(0.1)
    with pytest.raises(ValueError, match="Received: an optimizer with iterations=0"):
        step_traffic(optimizer)
