"""One worker of a custom training loop that saves on preemption
(tests/training/test_preempt_ctl.py).

    python preempt_ctl.py MODE WORKDIR

MODE:
* ``tf_handler``: TensorFlow's own ``PreemptionCheckpointHandler(cluster_resolver,
  checkpoint_manager)`` and ``handler.run(train_step, iterator)``, as in its
  documentation; nothing of tfdist but the strategy.
* ``watcher``: ``tfdist.PreemptionWatcher`` with a ``tf.train.CheckpointManager``
  (every worker calls ``manager.save``; only the chief writes).
* ``plain``: the same loop without preemption handling (the reference run).

The loop trains a small regression model with Adam under an exponential
learning-rate decay (its state is the optimizer's iteration count) on data
read from one iterator over a seeded, reshuffled, repeated dataset; the
checkpoint holds the model, the optimizer, the dataset iterator and the step.
After every step it prints ``tfdist step: N`` (N = global steps done), and
sleeps ``TFDIST_TEST_STEP_SLEEP`` seconds, so that a test can signal it
mid-epoch. At the end: one ``tfdist result:`` line.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

from protocol import say

MODE, WORKDIR = sys.argv[1], sys.argv[2]
TOTAL_STEPS = int(os.environ.get("TFDIST_TEST_TOTAL_STEPS", "48"))
STEPS_PER_EPOCH = int(os.environ.get("TFDIST_TEST_STEPS_PER_EPOCH", "16"))
SLEEP = float(os.environ.get("TFDIST_TEST_STEP_SLEEP", "0.05"))
GLOBAL_BATCH = 16

import tfdist  # noqa: E402

strategy = tfdist.strategy_from_config(register_timeout=60)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

resolver = strategy.cluster_resolver
TASK = f"{resolver.task_type}:{resolver.task_id}"


def dataset():
    rs = np.random.RandomState(0)
    x = rs.normal(size=(512, 8)).astype("float32")
    y = (x @ rs.normal(size=(8, 1)) + 0.1 * rs.normal(size=(512, 1))).astype("float32")
    return (
        tf.data.Dataset.from_tensor_slices((x, y))
        .shuffle(512, seed=1, reshuffle_each_iteration=True)
        .repeat()
        .batch(GLOBAL_BATCH)
    )


with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)]
    )
    schedule = keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=10, decay_rate=0.8)
    optimizer = keras.optimizers.Adam(schedule)
    optimizer.build(model.trainable_variables)
    step_var = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")

iterator = tfdist.CheckpointableIterator(dataset(), strategy)


@tf.function
def train_step(iterator):
    def step_fn(inputs):
        x, y = inputs
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(
                tf.square(model(x, training=True) - y)[:, 0], global_batch_size=GLOBAL_BATCH
            )
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    losses = strategy.run(step_fn, args=(next(iterator),))
    return strategy.reduce("SUM", losses, axis=None)


checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, iterator=iterator, step=step_var)
manager = tf.train.CheckpointManager(checkpoint, os.path.join(WORKDIR, "ckpt"), max_to_keep=2)


def weights():
    return [w.tolist() for w in model.get_weights()]


def sha():
    digest = hashlib.sha256()
    for w in model.get_weights():
        digest.update(np.ascontiguousarray(w).tobytes())
    return digest.hexdigest()


def report(**extra):
    result = {
        "task": TASK,
        "mode": MODE,
        "step": int(step_var.numpy()),
        "iterations": int(optimizer.iterations.numpy()),
        "weights": weights(),
        "sha": sha(),
        **extra,
    }
    say("tfdist result: " + json.dumps(result))


def after_step(loss):
    step_var.assign_add(1)
    say(f"tfdist step: {int(step_var.numpy())} loss={float(loss):.6f}")
    if SLEEP:
        time.sleep(SLEEP)


if MODE == "tf_handler":
    # TensorFlow's documented use: the handler restores the latest checkpoint
    # of the manager when it is created, and saves and exits when any worker
    # got SIGTERM (its own exit is sys.exit(42) off Google Cloud; under a
    # tfdist strategy 143, with a status record: tfdist.training.fault_tolerance.tf_handler).
    handler = tf.distribute.experimental.PreemptionCheckpointHandler(resolver, manager)
    start = int(step_var.numpy())
    say(f"tfdist start: {start} restored={manager.latest_checkpoint}")
    while step_var.numpy() < TOTAL_STEPS:
        after_step(handler.run(train_step, iterator))
    report(start=start)
elif MODE == "watcher":
    restored = manager.restore_or_initialize()
    start = int(step_var.numpy())
    say(f"tfdist start: {start} restored={restored}")
    with tfdist.PreemptionWatcher(strategy, name="ctl") as watcher:
        for step in range(start, TOTAL_STEPS):
            after_step(train_step(iterator))
            if watcher.should_stop(step + 1 - start):
                manager.save(checkpoint_number=step + 1)
                watcher.exit(
                    {
                        "step": step + 1,
                        "epoch": (step + 1) // STEPS_PER_EPOCH,
                        "batch": (step + 1) % STEPS_PER_EPOCH,
                        "backup": manager.latest_checkpoint,
                    }
                )
    report(start=start)
elif MODE == "plain":
    while step_var.numpy() < TOTAL_STEPS:
        after_step(train_step(iterator))
    report(start=0)
else:
    raise SystemExit(f"unknown mode {MODE!r}")
