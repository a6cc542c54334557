"""Gradient accumulation against a k times larger batch, in a custom loop.

Shared by tests/training/test_grad_accumulation.py (2 logical CPUs) and
tests/workers/accumulation_worker.py (2 worker processes). Each replica gets
its own examples (``experimental_distribute_values_from_function``), so the
k micro-batches a replica accumulates are exactly the batch it gets in the
reference run: with compression the two runs compress the same sums.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

PER_REPLICA_BATCH = 8
FEATURES = 8


def data(num_replicas: int, examples: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_replicas, examples, FEATURES)).astype("float32")
    y = (x.sum(axis=-1, keepdims=True) > 0).astype("float32")
    return x, y


def train(strategy, *, k: int, micro_steps: int, seed: int = 0) -> dict:
    """``micro_steps`` steps of PER_REPLICA_BATCH examples per replica with
    ``gradient_accumulation_steps=k`` (k >= 2). SGD with momentum, so the
    number of updates matters as well as their size.

    Returns:
        ``weights``, ``iterations``, and ``states``: after each step, whether
        the compression state (residuals, PowerSGD's Q) changed, and whether
        the step applied (per :func:`tfdist.training.accumulation.applies_this_step`);
        ``sent``: the bytes of each step (:func:`tfdist.compression.step_traffic`);
        ``examples``: how many examples all replicas saw.
    """
    import keras

    from tfdist.compression.applied import applies_this_step
    from tfdist.compression.keras_hook import state_variables

    n = strategy.num_replicas_in_sync
    x, y = data(n, micro_steps * PER_REPLICA_BATCH, seed)
    with strategy.scope():
        keras.utils.set_random_seed(seed)
        model = keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(1),
            ]
        )
        optimizer = keras.optimizers.SGD(0.05, momentum=0.9, gradient_accumulation_steps=k)
    return _loop(
        strategy,
        model,
        optimizer,
        x,
        y,
        PER_REPLICA_BATCH,
        micro_steps,
        applies_this_step,
        state_variables,
    )


def reference(strategy, *, k: int, micro_steps: int, seed: int = 0) -> dict:
    """The same examples in micro_steps / k steps of k times the batch, no accumulation."""
    import keras

    from tfdist.compression.applied import applies_this_step
    from tfdist.compression.keras_hook import state_variables

    n = strategy.num_replicas_in_sync
    x, y = data(n, micro_steps * PER_REPLICA_BATCH, seed)
    with strategy.scope():
        keras.utils.set_random_seed(seed)
        model = keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(1),
            ]
        )
        optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    return _loop(
        strategy,
        model,
        optimizer,
        x,
        y,
        k * PER_REPLICA_BATCH,
        micro_steps // k,
        applies_this_step,
        state_variables,
    )


def _loop(strategy, model, optimizer, x, y, batch, steps, applies_this_step, state_variables):
    import keras

    from tfdist.compression import step_traffic

    global_batch = batch * strategy.num_replicas_in_sync

    def train_step(inputs, labels):
        with tf.GradientTape() as tape:
            per_example = keras.losses.binary_crossentropy(labels, model(inputs), from_logits=True)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def distributed_train_step(inputs, labels):
        return strategy.run(train_step, args=(inputs, labels))

    def per_replica(array, step):
        def value(ctx):
            rows = array[ctx.replica_id_in_sync_group]
            return tf.constant(rows[step * batch : (step + 1) * batch])

        return strategy.experimental_distribute_values_from_function(value)

    def state():
        return [
            np.concatenate(
                [np.ravel(c.numpy()) for c in strategy.experimental_local_results(v.value)]
            )
            for v in state_variables(optimizer)
        ]

    states, sent = [], []
    for step in range(steps):
        before = state()
        distributed_train_step(per_replica(x, step), per_replica(y, step))
        after = state()
        changed = any(not np.array_equal(a, b) for a, b in zip(before, after))
        states.append({"state_changed": changed, "applied": applies_this_step(optimizer)})
        sent.append(step_traffic(optimizer).sent)
    return {
        "weights": [v.numpy() for v in model.trainable_variables],
        "iterations": int(optimizer.iterations.numpy()),
        "states": states,
        "sent": sent,
        "examples": steps * global_batch,
    }
