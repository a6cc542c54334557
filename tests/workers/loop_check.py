"""A custom training loop with a check that its gradients were compressed.

Shared by tests/training/test_custom_loop.py (2 logical CPUs) and
tests/workers/custom_loop_worker.py (2 worker processes). The loop is the
pattern of TensorFlow's custom-training tutorials: a model and an optimizer
created in ``strategy.scope()``, ``strategy.run(step)`` in a ``tf.function``,
a per-example loss averaged with ``tf.nn.compute_average_loss``,
``optimizer.apply_gradients``, no ``fit`` and no ``optimizer.build``.

Plain SGD makes each update ``-learning_rate`` times the aggregated gradient,
so the first update shows what the replicas' gradients were reduced to. The
same gradients are gathered from every replica beforehand and reduced by the
reference math (:func:`tfdist.compression.reduce_compressed`): the loop's
update must equal that, and differ from the exact sum when the setting loses
information.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

LEARNING_RATE = 0.1
PER_REPLICA_BATCH = 16
FEATURES, HIDDEN, CLASSES = 12, 16, 3


def compression_of(setting):
    """The strategy's ``compression=`` for a setting name ("none": None).

    This loop's tensors are all smaller than top-k's and sign's default
    ``min_size`` (which sends small tensors whole), so those two get
    ``min_size=0``: every tensor is compressed, and the check can see it.
    """
    from tfdist.compression import SignCompressor, TopKCompressor

    if setting in (None, "none"):
        return None
    if setting.startswith("topk:"):
        return TopKCompressor(float(setting.split(":")[1]), min_size=0)
    if setting == "sign":
        return SignCompressor(min_size=0)
    return setting


def per_replica_data(num_replicas: int, steps: int, seed: int = 0):
    """Each replica's own examples: ``x[r]``, ``y[r]`` for replica ``r``,
    ``steps`` batches of them."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_replicas, steps * PER_REPLICA_BATCH, FEATURES)).astype("float32")
    w = rng.normal(size=(FEATURES, CLASSES)).astype("float32")
    return x, np.argmax(x @ w, axis=-1).astype("int32")


def _batch(strategy, array, step):
    def value(ctx):
        rows = array[ctx.replica_id_in_sync_group]
        return tf.constant(rows[step * PER_REPLICA_BATCH : (step + 1) * PER_REPLICA_BATCH])

    return strategy.experimental_distribute_values_from_function(value)


def run(strategy, steps: int = 12, seed: int = 0) -> dict:
    """Trains ``steps`` steps on one batch per replica (so the loss must
    fall); returns the updates, the reference and the losses.

    Returns:
        ``first_update``: the aggregated gradient of step 0, per variable;
        ``exact``: the exact sum of the replicas' step-0 gradients;
        ``gathered``: each replica's step-0 gradients ([replicas, ...]);
        ``last_update``: the aggregated gradient of the last step;
        ``losses``; ``weights``; ``optimizer``; ``model``.
    """
    import keras

    n = strategy.num_replicas_in_sync
    x, y = per_replica_data(n, 1, seed)
    global_batch = PER_REPLICA_BATCH * n
    with strategy.scope():
        keras.utils.set_random_seed(seed)
        model = keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras.layers.Dense(HIDDEN, activation="relu"),
                keras.layers.Dense(CLASSES),
            ]
        )
        optimizer = keras.optimizers.SGD(LEARNING_RATE)
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def loss_of(inputs, labels):
        return tf.nn.compute_average_loss(
            loss_object(labels, model(inputs, training=True)), global_batch_size=global_batch
        )

    @tf.function
    def gather_gradients(inputs, labels):
        def replica_fn(inputs, labels):
            with tf.GradientTape() as tape:
                loss = loss_of(inputs, labels)
            grads = tape.gradient(loss, model.trainable_variables)
            ctx = tf.distribute.get_replica_context()
            return [ctx.all_gather(g[None], axis=0) for g in grads]

        return strategy.run(replica_fn, args=(inputs, labels))

    def train_step(inputs, labels):
        with tf.GradientTape() as tape:
            loss = loss_of(inputs, labels)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def distributed_train_step(inputs, labels):
        losses = strategy.run(train_step, args=(inputs, labels))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    gathered = [
        strategy.experimental_local_results(g)[0].numpy()
        for g in gather_gradients(_batch(strategy, x, 0), _batch(strategy, y, 0))
    ]
    losses, updates = [], []
    for step in range(steps):
        before = [v.numpy() for v in model.trainable_variables]
        losses.append(float(distributed_train_step(_batch(strategy, x, 0), _batch(strategy, y, 0))))
        after = [v.numpy() for v in model.trainable_variables]
        if step in (0, steps - 1):
            updates.append([(b - a) / LEARNING_RATE for b, a in zip(before, after)])
    return {
        "first_update": updates[0],
        "last_update": updates[-1],
        "gathered": gathered,
        "exact": [g.sum(axis=0) for g in gathered],
        "losses": losses,
        "weights": [v.numpy() for v in model.trainable_variables],
        "optimizer": optimizer,
        "model": model,
    }


def reference(aggregator, gathered) -> list[np.ndarray] | None:
    """What the aggregator reduces step 0's gradients to, by the reference
    math; None for PowerSGD, whose first steps are a dense warm-up."""
    from tfdist.compression import reduce_compressed

    if aggregator is None:
        return [g.sum(axis=0) for g in gathered]
    compressor = getattr(aggregator, "compressor", None)
    if compressor is None:
        return None
    out = []
    for key, grads in enumerate(gathered):
        packed = [
            compressor.compress(tf.constant(g), step=tf.constant(0, tf.int64), key=key)
            for g in grads
        ]
        out.append(reduce_compressed(compressor, [p for p, _ in packed], packed[0][1]).numpy())
    return out


def check(strategy, result: dict) -> dict:
    """Compares the loop's first update with the reference and the exact sum.

    Returns:
        ``to_reference`` and ``to_exact``: the largest absolute difference of
        the first update from each; ``last_ranks``: the numerical rank of the
        last update of each kernel (PowerSGD sends rank-r matrices);
        ``compression``: the strategy's setting as it reads after the loop.
    """
    from tfdist.compression.keras_hook import strategy_aggregator

    aggregator = strategy_aggregator(strategy)
    chosen = getattr(aggregator, "chosen", aggregator)  # "auto" runs its choice.
    expected = reference(chosen, result["gathered"])
    update = result["first_update"]
    largest = lambda a, b: max(float(np.max(np.abs(u - v))) for u, v in zip(a, b))  # noqa: E731

    def rank(matrix):
        s = np.linalg.svd(matrix, compute_uv=False)
        return int(np.sum(s > 1e-4 * s[0]))

    return {
        "to_reference": None if expected is None else largest(update, expected),
        "to_exact": largest(update, result["exact"]),
        "last_ranks": [rank(u) for u in result["last_update"] if u.ndim == 2],
        "compression": str(strategy.compression),
        "loss_first": result["losses"][0],
        "loss_last": result["losses"][-1],
    }
