"""Custom training loops (strategy.run + apply_gradients, no fit) under tfdist.

On 2 logical CPUs in this process, and on 2 worker processes through
``tfdist launch`` (slow). Before tfdist's fixes (tfdist/training/loops.py):

* without compression, TensorFlow's custom-training tutorial loop failed with
  "You must feed a value for placeholder tensor 'cond/else/_1/cond/Placeholder'"
  (keras-team/keras#23085), as it still does under TensorFlow's own strategy;
* with any compression setting, the first apply_gradients failed with
  "Method requires being in cross-replica context" unless the user called
  ``optimizer.build`` before the loop.
"""

from __future__ import annotations

import numpy as np
import pytest

import tfdist
from canary import upstream_bug
from conftest import finish, result_line, results_by_task, start
from workers import loop_check

PER_REPLICA_BATCH = 16


def tutorial_loop(
    tf, strategy, checkpoint_dir, *, build_first: bool = False, epochs: int = 2
) -> dict:
    """The custom_training tutorial's loop on synthetic 28x28x1 images.

    A Conv/Dense model with L2 regularizers and no Input (it builds in its
    first call, inside strategy.run), Adam, accuracy metrics updated in the
    steps, a tf.train.Checkpoint per epoch, restored into a new model without
    a strategy. ``build_first`` is the workaround TensorFlow's own strategy
    needs: build the model and the optimizer before the loop.
    """
    import keras

    rng = np.random.default_rng(0)
    images = rng.random((256, 28, 28, 1)).astype("float32")
    labels = (images.reshape(256, -1)[:, :10].argmax(axis=1)).astype("int64")
    global_batch = PER_REPLICA_BATCH * strategy.num_replicas_in_sync
    train = tf.data.Dataset.from_tensor_slices((images[:192], labels[:192])).batch(global_batch)
    test = tf.data.Dataset.from_tensor_slices((images[192:], labels[192:])).batch(global_batch)
    train_dist = strategy.experimental_distribute_dataset(train)
    test_dist = strategy.experimental_distribute_dataset(test)

    def create_model():
        l2 = keras.regularizers.L2(1e-5)
        return keras.Sequential(
            [
                keras.layers.Conv2D(4, 3, activation="relu", kernel_regularizer=l2),
                keras.layers.MaxPooling2D(),
                keras.layers.Flatten(),
                keras.layers.Dense(16, activation="relu", kernel_regularizer=l2),
                keras.layers.Dense(10, kernel_regularizer=l2),
            ]
        )

    with strategy.scope():
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
        train_accuracy = keras.metrics.SparseCategoricalAccuracy(name="train_accuracy")
        test_accuracy = keras.metrics.SparseCategoricalAccuracy(name="test_accuracy")
        keras.utils.set_random_seed(0)
        model = create_model()
        optimizer = keras.optimizers.Adam(learning_rate=0.01)
        checkpoint = tf.train.Checkpoint(optimizer=optimizer, model=model)
        if build_first:
            model.build((None, 28, 28, 1))
            optimizer.build(model.trainable_variables)

    def train_step(inputs):
        x, y = inputs
        with tf.GradientTape() as tape:
            predictions = model(x, training=True)
            loss = tf.nn.compute_average_loss(
                loss_object(y, predictions), global_batch_size=global_batch
            )
            loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        train_accuracy.update_state(y, predictions)
        return loss

    def test_step(inputs):
        x, y = inputs
        test_accuracy.update_state(y, model(x, training=False))

    @tf.function
    def distributed_train_step(inputs):
        losses = strategy.run(train_step, args=(inputs,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    @tf.function
    def distributed_test_step(inputs):
        return strategy.run(test_step, args=(inputs,))

    result = {"loss": [], "train_accuracy": [], "test_accuracy": []}
    for _ in range(epochs):
        total, batches = 0.0, 0
        for batch in train_dist:
            total += float(distributed_train_step(batch))
            batches += 1
        for batch in test_dist:
            distributed_test_step(batch)
        checkpoint.save(str(checkpoint_dir / "ckpt"))
        result["loss"].append(total / batches)
        result["train_accuracy"].append(float(train_accuracy.result()))
        result["test_accuracy"].append(float(test_accuracy.result()))
        train_accuracy.reset_state()
        test_accuracy.reset_state()
    result["weights"] = [v.numpy() for v in model.trainable_variables]
    result["iterations"] = int(optimizer.iterations.numpy())

    # Restore the last checkpoint into a new model, without a strategy.
    restored = create_model()
    restored.build((None, 28, 28, 1))
    new_optimizer = keras.optimizers.Adam()
    tf.train.Checkpoint(optimizer=new_optimizer, model=restored).restore(
        tf.train.latest_checkpoint(str(checkpoint_dir))
    ).expect_partial()
    result["restored_weights"] = [v.numpy() for v in restored.trainable_variables]
    eval_accuracy = keras.metrics.SparseCategoricalAccuracy()
    for x, y in test:
        eval_accuracy.update_state(y, restored(x, training=False))
    result["restored_test_accuracy"] = float(eval_accuracy.result())
    return result


# The stock step fails while collectives run (tests/own_process.py).
@pytest.mark.own_process
def test_tensorflows_mirrored_fails_on_the_tutorial_loop(tf_cpus, tmp_path):
    # keras-team/keras#23085, upstream: tfdist's fix applies to its own
    # strategies only, so TensorFlow's strategy still shows the bug.
    tf = tf_cpus
    stock = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with upstream_bug(
        "loops.initialize",
        tf.errors.InvalidArgumentError,
        "must feed a value for placeholder tensor 'cond/",
    ):
        tutorial_loop(tf, stock, tmp_path)


def test_tutorial_loop_under_tfdist_trains_like_the_workaround(tf_cpus, tmp_path):
    tf = tf_cpus
    ours = tutorial_loop(tf, tfdist.strategy_from_config(cpu_replicas=2), tmp_path / "a")
    # TensorFlow's own strategy, with everything built before the loop.
    stock = tutorial_loop(
        tf, tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]), tmp_path / "b", build_first=True
    )
    assert ours["iterations"] == stock["iterations"] == 2 * 192 // 32
    assert ours["loss"][-1] < ours["loss"][0]
    np.testing.assert_allclose(ours["loss"], stock["loss"], rtol=1e-5)
    for a, b in zip(ours["weights"], stock["weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert ours["test_accuracy"] == pytest.approx(stock["test_accuracy"])
    # The checkpoint holds the trained weights: restored without a strategy,
    # the model scores what the loop measured.
    for a, b in zip(ours["restored_weights"], ours["weights"]):
        np.testing.assert_array_equal(a, b)
    assert ours["restored_test_accuracy"] == pytest.approx(ours["test_accuracy"][-1])


@pytest.mark.parametrize(
    "setting", [None, "bf16", "fp16", "topk:0.1", "randomk:0.25", "sign", "qsgd:16", "auto"]
)
def test_custom_loop_compresses_with_every_setting(tf_cpus, setting):
    strategy = tfdist.strategy_from_config(
        cpu_replicas=2, compression=loop_check.compression_of(setting)
    )
    result = loop_check.run(strategy, steps=3)
    found = loop_check.check(strategy, result)
    assert found["loss_last"] < found["loss_first"], found
    # The loop's first update is the setting's reduction of the replicas'
    # gradients...
    assert found["to_reference"] < 1e-6, found
    if setting is None or found["compression"] == "auto -> none":
        assert found["to_exact"] < 1e-6, found
    else:  # ...which is not the exact sum: the gradients were compressed.
        assert found["to_exact"] > 100 * max(found["to_reference"], 1e-8), found
    if setting == "auto":  # The choice was made when the loop built the optimizer.
        assert found["compression"].startswith("auto -> "), found


def test_custom_loop_with_powersgd_sends_rank_r_after_its_warm_up(tf_cpus):
    from tfdist.compression import PowerSGD, step_traffic

    strategy = tfdist.strategy_from_config(
        cpu_replicas=2, compression=PowerSGD(rank=1, warmup_steps=2)
    )
    result = loop_check.run(strategy, steps=3)
    found = loop_check.check(strategy, result)
    # Warm-up: the first step is the exact (dense) sum; after it, every
    # kernel's update is the rank-1 approximation PowerSGD sent.
    assert found["to_exact"] < 1e-6
    assert found["last_ranks"] == [1, 1], found
    assert np.linalg.matrix_rank(result["exact"][0]) > 1
    # The loop reads the bytes of its last step, as CommunicationStats does in fit.
    traffic = step_traffic(result["optimizer"])
    n = 2
    dense = 4 * sum(int(np.prod(v.shape)) for v in result["model"].trainable_variables)
    assert traffic.dense_sent == 2 * (n - 1) / n * dense
    # Rank 1: (12 + 16) and (16 + 3) floats for the kernels, biases dense.
    assert traffic.sent == 2 * (n - 1) / n * 4 * ((12 + 16) + (16 + 3) + 16 + 3)
    assert traffic.sent < traffic.dense_sent


@pytest.mark.slow
def test_custom_loop_on_two_workers_with_every_setting(tf_cpus):
    settings = "none,bf16,fp16,topk:0.1,randomk:0.25,sign,qsgd:16,powersgd:1,auto"
    proc = start(
        [
            "-m",
            "tfdist",
            "launch",
            "--workers",
            "2",
            "--show-all",
            "tests/workers/custom_loop_worker.py",
            settings,
        ]
    )
    [(code, out, err)] = finish([proc], timeout=900)
    assert code == 0, (out + err)[-4000:]
    results = results_by_task(out)
    assert sorted(results) == ["worker:0", "worker:1"], out[-3000:]
    chief, other = results["worker:0"], results["worker:1"]
    assert chief == other  # Synchronous: the same updates and weights on both.
    for setting, found in chief.items():
        assert found["replicas"] == 2
        assert found["loss_last"] < found["loss_first"], (setting, found)
        if setting == "powersgd:1":  # Dense warm-up, then rank-1 kernels.
            assert found["to_exact"] < 1e-6 and found["last_ranks"] == [1, 1], found
            continue
        assert found["to_reference"] < 1e-6, (setting, found)
        if setting == "none" or found["compression"] == "auto -> none":
            assert found["to_exact"] < 1e-6, (setting, found)
        else:
            assert found["to_exact"] > 100 * max(found["to_reference"], 1e-8), (setting, found)


TINY = ["--epochs=2", "--examples=1024"]


def test_custom_loop_script_accumulates_and_counts_its_bytes():
    from tfdist.compression import predict_traffic

    [(code, out, err)] = finish(
        [
            start(
                [
                    "strategies/custom_loop.py",
                    *TINY,
                    "--compression=powersgd:4",
                    "--gradient_accumulation_steps=2",
                ]
            )
        ],
        timeout=300,
    )
    assert code == 0, err[-4000:]
    assert "MirroredStrategy (mirrored): 2 replica(s) in sync" in out
    result = result_line(out)
    assert result["replicas"] == 2 and result["compression"] == "powersgd:4"
    assert result["loss"][-1] < 0.7 * result["loss"][0], result["loss"]
    total = result["comm_total"]
    # 2 epochs of 1024 / 64 steps; the optimizer applied (and sent) every 2nd.
    assert total["steps"] == 32 and total["updates"] == 16
    # PowerSGD's 10 dense warm-up updates, then 6 compressed ones.
    shapes = [((16, 64), "float32"), ((64,), "float32"), ((64, 3), "float32"), ((3,), "float32")]
    warm = predict_traffic(shapes, "powersgd:4", 2, step=0)
    compressed = predict_traffic(shapes, "powersgd:4", 2)
    assert total["bytes"] == pytest.approx(10 * warm.sent + 6 * compressed.sent)
    assert total["dense_bytes"] == pytest.approx(16 * warm.dense_sent)
    assert compressed.sent < warm.sent


@pytest.mark.slow
def test_custom_loop_script_through_tfdist_launch(tmp_path):
    proc = start(
        [
            "-m",
            "tfdist",
            "launch",
            "--workers",
            "2",
            "--show-all",
            "strategies/custom_loop.py",
            *TINY,
            "--compression=bf16",
            f"--model_dir={tmp_path}",
        ]
    )
    [(code, out, err)] = finish([proc], timeout=600)
    assert code == 0, (out + err)[-4000:]
    results = results_by_task(out)
    assert sorted(results) == ["worker:0", "worker:1"], out[-3000:]
    chief, other = results["worker:0"], results["worker:1"]
    assert chief["strategy"] == "MultiWorkerMirroredStrategy" and chief["replicas"] == 2
    assert chief["weights_sha256"] == other["weights_sha256"]
    assert chief["loss"][-1] < 0.7 * chief["loss"][0], chief["loss"]
    assert chief["comm_total"]["ratio"] == 2.0  # bf16 halves every float32 gradient.
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "checkpoint",
        "ckpt-1.data-00000-of-00001",
        "ckpt-1.index",
        "ckpt-2.data-00000-of-00001",
        "ckpt-2.index",
    ]
