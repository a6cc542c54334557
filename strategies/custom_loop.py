"""A custom training loop (no ``fit``) under any tfdist strategy.

The loop of TensorFlow's custom-training tutorials, with the strategy line
swapped: the model and the optimizer created in ``strategy.scope()``, a
``tf.function`` step that calls ``strategy.run``, a per-example loss averaged
with ``tf.nn.compute_average_loss`` over the global batch,
``optimizer.apply_gradients``, and ``strategy.experimental_distribute_dataset``.
No ``optimizer.build`` before the loop is needed, with or without
compression. On one machine it mirrors over 2 logical CPUs:

    python strategies/custom_loop.py --compression=powersgd:4 --epochs=3
    python strategies/custom_loop.py --gradient_accumulation_steps=4
    tfdist launch --workers 2 strategies/custom_loop.py --compression=bf16

After each step the loop reads the bytes it sent
(``tfdist.compression.step_traffic``); the result line has the totals. With
``--gradient_accumulation_steps=k`` the optimizer applies (and sends) every
k-th step only. With ``--model_dir`` the chief writes a ``tf.train.Checkpoint``
per epoch and ``results.json`` there.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from absl import app, flags

import _common
from tfdist.errors import TfdistError

_common.define_flags()
flags.DEFINE_integer(
    "gradient_accumulation_steps",
    None,
    "Keras optimizers' gradient_accumulation_steps (>= 2): apply "
    "the mean gradient of this many steps; default: every step.",
)
flags.FLAGS.set_default("strategy", "auto")
flags.FLAGS.set_default("cpu_replicas", 2)
FLAGS = flags.FLAGS


def train_loop(
    strategy,
    *,
    epochs: int,
    per_replica_batch_size: int,
    examples: int,
    learning_rate: float,
    seed: int,
    accumulation: int | None = None,
    checkpoint_dir: str | None = None,
) -> dict:
    """Trains the scripts' model with a custom loop; returns the final metrics.

    Args:
        strategy: The strategy to train under.
        epochs: Epochs to train.
        per_replica_batch_size: Examples per replica per step.
        examples: Examples to make (see :func:`_common.make_data`).
        learning_rate: Adam's learning rate.
        seed: Seeds the data and the initial weights.
        accumulation: Keras's ``gradient_accumulation_steps``, or None.
        checkpoint_dir: Where to write a ``tf.train.Checkpoint`` per epoch.

    Returns:
        What :func:`_common.train` returns, plus the traffic: ``comm_total``
        (``steps``, ``updates``, ``bytes``, ``dense_bytes``, ``ratio``).
    """
    import keras
    import numpy as np
    import tensorflow as tf

    from tfdist.compression import step_traffic

    global_batch = per_replica_batch_size * strategy.num_replicas_in_sync
    x, y = _common.make_data(examples, seed)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch, drop_remainder=True)
    options = tf.data.Options()
    # Every worker makes the same data, so shard by element, explicitly.
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dist_data = strategy.experimental_distribute_dataset(data.with_options(options))

    with strategy.scope():
        keras.utils.set_random_seed(seed)
        model = keras.Sequential(
            [keras.Input((16,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(3)]
        )
        optimizer = keras.optimizers.Adam(learning_rate, gradient_accumulation_steps=accumulation)
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
        accuracy = keras.metrics.SparseCategoricalAccuracy()
        checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)

    def train_step(inputs):
        features, labels = inputs
        with tf.GradientTape() as tape:
            logits = model(features, training=True)
            loss = tf.nn.compute_average_loss(
                loss_object(labels, logits), global_batch_size=global_batch
            )
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        accuracy.update_state(labels, logits)
        return loss

    @tf.function
    def distributed_train_step(inputs):
        losses = strategy.run(train_step, args=(inputs,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    chief = getattr(strategy, "is_chief", True)
    losses, sent, dense, steps = [], 0.0, 0.0, 0
    for epoch in range(epochs):
        total, batches = 0.0, 0
        for batch in dist_data:
            total += float(distributed_train_step(batch))
            batches += 1
            traffic = step_traffic(optimizer)
            sent, dense, steps = sent + traffic.sent, dense + traffic.dense_sent, steps + 1
        losses.append(total / batches)
        # Reading a metric is a collective under MultiWorkerMirrored: every
        # worker reads it, the chief prints it.
        epoch_accuracy = float(accuracy.result())
        if chief:
            print(
                f"epoch {epoch + 1}: loss {losses[-1]:.4f}, accuracy "
                f"{epoch_accuracy:.4f}, {sent:,.0f} bytes sent per replica "
                f"so far ({dense:,.0f} dense)",
                flush=True,
            )
        if checkpoint_dir:
            # Saving is a collective under MultiWorkerMirrored: every worker
            # saves, the others into a directory they remove.
            where = checkpoint_dir if chief else tempfile.mkdtemp(prefix="tfdist-ckpt-")
            checkpoint.save(os.path.join(where, "ckpt"))
            if not chief:
                shutil.rmtree(where, ignore_errors=True)
        if epoch < epochs - 1:
            accuracy.reset_state()
    final = [v.numpy() for v in model.trainable_variables]
    weights = np.concatenate([w.ravel() for w in final])
    return {
        "strategy": type(strategy).__name__,
        "replicas": strategy.num_replicas_in_sync,
        "global_batch": global_batch,
        "loss": losses,
        "accuracy": float(accuracy.result()),
        "params": int(weights.size),
        "weights_sha256": _common.weights_sha256(final),
        "comm_total": {
            "steps": steps,
            "updates": int(optimizer.iterations.numpy()),
            "bytes": sent,
            "dense_bytes": dense,
            "ratio": dense / sent if sent else None,
        },
    }


def main(_argv: list[str]) -> None:
    """Builds the strategy from the flags, runs the custom loop, and reports."""
    strategy = _common.strategy_from_flags()
    _common.print_settings(strategy)
    try:
        result = train_loop(
            strategy,
            epochs=FLAGS.epochs,
            per_replica_batch_size=FLAGS.per_replica_batch_size,
            examples=FLAGS.examples,
            learning_rate=FLAGS.learning_rate,
            seed=FLAGS.seed,
            accumulation=FLAGS.gradient_accumulation_steps,
            checkpoint_dir=(
                os.path.join(FLAGS.model_dir, "checkpoints") if FLAGS.model_dir else None
            ),
        )
    except (TfdistError, ValueError) as error:
        _common.exit_with(error)
    result["compression"] = str(strategy.compression)
    total = result["comm_total"]
    print(
        f"whole run ({total['steps']} steps, {total['updates']} updates): "
        f"{total['bytes']:,.0f} bytes sent per replica instead of "
        f"{total['dense_bytes']:,.0f} without compression",
        flush=True,
    )
    _common.report(result, strategy)


if __name__ == "__main__":
    app.run(main)
