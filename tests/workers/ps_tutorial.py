"""TensorFlow's parameter-server tutorial, step for step, with tfdist's strategy line.

    python ps_tutorial.py SCENARIO WORKDIR [CLUSTER_JSON]

Scenarios (each prints one "tfdist result:" line):

* ``fit``: the tutorial's ``Model.fit`` path (a dataset function with
  ``steps_per_epoch``, ``steps_per_execution``, the stock TensorBoard,
  ModelCheckpoint and BackupAndRestore callbacks), then a plain dataset and
  ``model.evaluate``. The cluster is CLUSTER_JSON's workers and ps, handed to
  the strategy as the tutorial does: a ``SimpleClusterResolver`` without a
  chief; this process is the coordinator.
* ``ctl``: the tutorial's custom loop on the same kind of cluster: string
  lookups in the input pipeline, an embedding sharded over 2 ps by a
  ``MinSizePartitioner``, ``ClusterCoordinator.schedule``/``join``, a
  fetched loss, then direct and distributed evaluation.
* ``local_cluster``: ``strategy_from_config(tfdist.local_cluster(...))``, a
  short ``model.fit`` and the end of the ``with`` block, as a notebook does;
  the test reads this process's stderr.

The data is synthetic, of the tutorial's shapes.
"""

from __future__ import annotations

import json
import os
import random
import sys

from protocol import say

SCENARIO, WORKDIR = sys.argv[1], sys.argv[2]
CLUSTER = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None

import tfdist  # noqa: E402

if SCENARIO == "local_cluster":
    local = tfdist.local_cluster(workers=1, ps=1)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

NUM_PS = 2


def resolver():
    """The tutorial's resolver: the workers and ps, no chief."""
    spec = tf.train.ClusterSpec({job: CLUSTER[job] for job in ("worker", "ps")})
    return tf.distribute.cluster_resolver.SimpleClusterResolver(spec, rpc_layer="grpc")


def report(**result):
    say("tfdist result: " + json.dumps(result))


def value_of(weight):
    return np.asarray(tf.convert_to_tensor(weight.value))


# --------------------------------------------------------------------------


def fit_scenario():
    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=256 << 10, max_shards=NUM_PS
    )
    strategy = tfdist.strategy_from_config(resolver(), variable_partitioner=partitioner)

    rs = np.random.RandomState(1)
    features = rs.uniform(size=(10, 10)).astype("float32")
    # (10, 1), not the tutorial's (10,): Keras 3's mse does not broadcast a
    # (batch,) target against (batch, 10) as tf_keras did; (batch, 1) does.
    targets = rs.uniform(size=(10, 1)).astype("float32")

    def dataset_fn(input_context):
        batch = input_context.get_per_replica_batch_size(64)
        data = tf.data.Dataset.from_tensor_slices((features, targets)).shuffle(10).repeat()
        data = data.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        return data.batch(batch).prefetch(2)

    with strategy.scope():
        model = keras.models.Sequential([keras.layers.Dense(10)])
        model.compile(keras.optimizers.SGD(), loss="mse", steps_per_execution=10)

    work = os.path.join(WORKDIR, "work")
    callbacks = [
        keras.callbacks.TensorBoard(log_dir=os.path.join(work, "log")),
        keras.callbacks.ModelCheckpoint(filepath=os.path.join(work, "ckpt.keras")),
        keras.callbacks.BackupAndRestore(backup_dir=os.path.join(work, "backup")),
    ]
    history = model.fit(dataset_fn, epochs=5, steps_per_epoch=20, callbacks=callbacks)
    after_creator = int(model.optimizer.iterations.numpy())
    reloaded = keras.models.load_model(os.path.join(work, "ckpt.keras"))
    reloaded_equal = all(
        np.allclose(a, b) for a, b in zip(reloaded.get_weights(), model.get_weights())
    )

    # The same model, fed a plain dataset.
    plain = tf.data.Dataset.from_tensor_slices((features, targets)).repeat().batch(8)
    plain_history = model.fit(plain, epochs=2, steps_per_epoch=10, verbose=0)
    evaluated = model.evaluate(
        tf.data.Dataset.from_tensor_slices((features, targets)).batch(5),
        return_dict=True,
        verbose=0,
    )
    # What the coordinator computes itself from the weights on the ps.
    pred = model(features, training=False).numpy()
    predicted = model.predict(features, batch_size=4, verbose=0)
    reference = float(np.mean((pred - targets) ** 2))
    try:  # An argument tfdist.fit cannot honour under parameter servers.
        model.fit(dataset_fn, steps_per_epoch=1, class_weight={0: 1.0}, verbose=0)
        refused = None
    except tfdist.ConfigError as error:
        refused = error.field
    report(
        strategy=type(strategy).__module__ + "." + type(strategy).__name__,
        refused=refused,
        task=strategy.task,
        is_chief=strategy.is_chief,
        loss=history.history["loss"],
        plain_loss=plain_history.history["loss"],
        iterations_after_creator=after_creator,
        iterations=int(model.optimizer.iterations.numpy()),
        evaluate=evaluated,
        reference_loss=reference,
        predict_shape=list(predicted.shape),
        predict_gap=float(np.max(np.abs(predicted - pred))),
        reloaded_equal=reloaded_equal,
        tensorboard_files=sum(len(f) for _, _, f in os.walk(os.path.join(work, "log"))),
        backup_left=os.path.exists(os.path.join(work, "backup")),
    )


# --------------------------------------------------------------------------


FEATURE_VOCAB = ["avenger", "ironman", "batman", "hulk", "spiderman", "kingkong", "wonder_woman"]
LABEL_VOCAB = ["yes", "no"]


def examples(count, seed):
    rng = random.Random(seed)
    out = {"features": [], "label": []}
    for _ in range(count):
        picked = rng.sample(FEATURE_VOCAB, 3)
        out["features"].append(picked)
        out["label"].append(["yes"] if "avenger" in picked else ["no"])
    return out


def ctl_scenario():
    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=256 << 10, max_shards=NUM_PS
    )
    strategy = tfdist.strategy_from_config(resolver(), variable_partitioner=partitioner)

    with strategy.scope():
        feature_lookup = keras.layers.StringLookup(vocabulary=FEATURE_VOCAB, mask_token=None)
        label_lookup = keras.layers.StringLookup(
            vocabulary=LABEL_VOCAB, num_oov_indices=0, mask_token=None
        )

    # 192 examples, not the tutorial's 200: whole batches of 32 only, so
    # that the examples counted by the metric tell the steps applied.
    train_examples = examples(192, seed=0)

    def preprocess(x):
        # The lookup layers themselves: a Keras 3 functional model wrapped
        # around them would want a batch dimension, and this maps examples.
        return {"features": feature_lookup(x["features"])}, label_lookup(x["label"])

    def dataset_fn(_):
        data = tf.data.Dataset.from_tensor_slices(train_examples)
        return data.map(preprocess).shuffle(192).batch(32).repeat()

    with strategy.scope():
        model_input = keras.Input(shape=(3,), dtype="int64", name="model_input")
        emb_layer = keras.layers.Embedding(
            input_dim=len(feature_lookup.get_vocabulary()), output_dim=16384
        )
        emb_output = keras.ops.mean(emb_layer(model_input), axis=1)
        dense_output = keras.layers.Dense(units=1, activation="sigmoid")(emb_output)
        model = keras.Model({"features": model_input}, dense_output)
        optimizer = keras.optimizers.RMSprop(learning_rate=0.1)
        accuracy = keras.metrics.Accuracy()

    table = emb_layer.embeddings.value
    shards = list(getattr(table, "variables", [table]))
    before = [value_of(w) for w in model.trainable_weights]

    @tf.function
    def step_fn(iterator):
        def replica_fn(batch_data, labels):
            with tf.GradientTape() as tape:
                pred = model(batch_data, training=True)
                per_example_loss = keras.losses.BinaryCrossentropy(reduction="none")(labels, pred)
                loss = tf.nn.compute_average_loss(per_example_loss)
                gradients = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(gradients, model.trainable_variables))
            actual_pred = tf.cast(tf.greater(pred, 0.5), tf.int64)
            accuracy.update_state(labels, actual_pred)
            return loss

        batch_data, labels = next(iterator)
        losses = strategy.run(replica_fn, args=(batch_data, labels))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)

    @tf.function
    def per_worker_dataset_fn():
        return strategy.distribute_datasets_from_function(dataset_fn)

    per_worker_iterator = iter(coordinator.create_per_worker_dataset(per_worker_dataset_fn))
    epochs, steps_per_epoch = 4, 5
    epoch_losses, epoch_accuracy = [], []
    for _ in range(epochs):
        accuracy.reset_state()
        remote = [
            coordinator.schedule(step_fn, args=(per_worker_iterator,))
            for _ in range(steps_per_epoch)
        ]
        coordinator.join()
        epoch_losses.append(float(np.mean([r.fetch() for r in remote])))
        epoch_accuracy.append(float(accuracy.result().numpy()))
    final_loss = float(coordinator.schedule(step_fn, args=(per_worker_iterator,)).fetch())

    # Direct evaluation on the coordinator.
    eval_dataset = tf.data.Dataset.from_tensor_slices(examples(16, seed=1)).map(preprocess).batch(8)
    direct = keras.metrics.Accuracy()
    for batch_data, labels in eval_dataset:
        pred = model(batch_data, training=False)
        direct.update_state(labels, tf.cast(tf.greater(pred, 0.5), tf.int64))

    # Distributed evaluation on the workers.
    with strategy.scope():
        eval_accuracy = keras.metrics.Accuracy()

    @tf.function
    def eval_step(iterator):
        def replica_fn(batch_data, labels):
            pred = model(batch_data, training=False)
            eval_accuracy.update_state(labels, tf.cast(tf.greater(pred, 0.5), tf.int64))

        batch_data, labels = next(iterator)
        strategy.run(replica_fn, args=(batch_data, labels))

    eval_examples = examples(16, seed=1)

    def eval_dataset_fn():
        return (
            tf.data.Dataset.from_tensor_slices(eval_examples)
            .map(preprocess)
            .shuffle(16)
            .repeat()
            .batch(8)
        )

    eval_iterator = iter(coordinator.create_per_worker_dataset(eval_dataset_fn))
    for _ in range(2):
        coordinator.schedule(eval_step, args=(eval_iterator,))
    coordinator.join()

    after = [value_of(w) for w in model.trainable_weights]
    report(
        strategy=type(strategy).__name__,
        shard_devices=[s.device for s in shards],
        shard_rows=[int(s.shape[0]) for s in shards],
        changed=[bool(not np.allclose(a, b)) for a, b in zip(before, after)],
        epoch_losses=epoch_losses,
        epoch_accuracy=epoch_accuracy,
        final_loss=final_loss,
        iterations=int(optimizer.iterations.numpy()),
        accuracy_count=float(accuracy.count.numpy()),
        direct_accuracy=float(direct.result().numpy()),
        distributed_accuracy=float(eval_accuracy.result().numpy()),
        distributed_count=float(eval_accuracy.count.numpy()),
    )


# --------------------------------------------------------------------------


def local_cluster_scenario():
    with local:
        strategy = tfdist.strategy_from_config(local)
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile(keras.optimizers.SGD(0.05), loss="mse")
        rs = np.random.RandomState(0)
        x = rs.randn(256, 4).astype("float32")
        y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")
        history = model.fit(x, y, batch_size=32, epochs=2, verbose=0)
        iterations = int(model.optimizer.iterations.numpy())
        pids = [local.pid(task) for task in local.tasks]
    report(
        strategy=type(strategy).__name__,
        task=strategy.task,
        loss=history.history["loss"],
        iterations=iterations,
        server_pids=pids,
    )


{"fit": fit_scenario, "ctl": ctl_scenario, "local_cluster": local_cluster_scenario}[SCENARIO]()
