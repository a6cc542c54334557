"""TensorFlow's "Parameter server training" tutorial, step by step.

Run by tests/tutorials/test_tutorials_parameter_server.py in its own process (the
coordinator's TensorFlow context cannot share the pytest process). It follows
tensorflow/docs site/en/tutorials/distribute/parameter_server_training.ipynb
on Keras 3, with tfdist.strategy_from_config as the only tfdist-specific line:

1. the tutorial's in-process cluster: 3 worker and 2 ps ``tf.distribute.Server``
   objects in this process (workers with num_workers + 1 inter-op threads on
   a small machine), a ``SimpleClusterResolver`` with no chief (this process
   is the coordinator), a ``MinSizePartitioner`` over the 2 ps;
2. ``model.fit`` of a Dense(10) model on a repeated, batched, prefetched
   dataset, with ``steps_per_execution`` and the TensorBoard, ModelCheckpoint
   and BackupAndRestore callbacks;
3. the custom loop: StringLookup preprocessing models created in the scope,
   a ``dataset_fn`` mapping them, an Embedding(vocabulary, 16384) that the
   partitioner shards over both ps, RMSprop and an Accuracy metric; a
   ``ClusterCoordinator`` scheduling a ``tf.function`` step over a per-worker
   dataset, joined at epoch ends; a scheduled step's loss fetched;
4. evaluation inline on the coordinator, then distributed through the
   coordinator with a metric created in the scope.

Every section records its figures, or its error, in one 'tfdist result:' line.
Keras 3 ports of Keras 2 code: the tutorial's ``optimizers.legacy.SGD`` and
``RMSprop`` are Keras 3's; ModelCheckpoint needs a ``.keras`` path; the
regression labels have shape (10, 1), since Keras 3's "mse" does not
broadcast (batch,) labels against (batch, 10) outputs; the functional model
averages with ``keras.ops.mean`` (a TF op on a KerasTensor fails); the
preprocessing models map batches, not single examples (Keras 3 functional
models need the batch dimension), so the datasets batch before they map.
"""

import json
import multiprocessing
import os
import random
import sys
import traceback

import tensorflow as tf

import tfdist
from protocol import say
from tfdist.engines.net import free_ports

WORKDIR = sys.argv[1]
result = {"errors": {}}


def section(name):
    """Runs a section; its error, if any, is recorded under its name."""

    def run(fn):
        try:
            fn()
        except Exception as error:  # noqa: BLE001 - recorded for the test
            result["errors"][name] = f"{type(error).__name__}: {error}"[:800]
            traceback.print_exc()
        return fn

    return run


def create_in_process_cluster(num_workers, num_ps):
    """Starts local servers in this process; returns their cluster resolver."""
    ports = free_ports(num_workers + num_ps)
    cluster_dict = {"worker": ["localhost:%s" % p for p in ports[:num_workers]]}
    if num_ps > 0:
        cluster_dict["ps"] = ["localhost:%s" % p for p in ports[num_workers:]]
    cluster_spec = tf.train.ClusterSpec(cluster_dict)
    worker_config = tf.compat.v1.ConfigProto()
    if multiprocessing.cpu_count() < num_workers + 1:
        worker_config.inter_op_parallelism_threads = num_workers + 1
    for i in range(num_workers):
        tf.distribute.Server(
            cluster_spec, job_name="worker", task_index=i, config=worker_config, protocol="grpc"
        )
    for i in range(num_ps):
        tf.distribute.Server(cluster_spec, job_name="ps", task_index=i, protocol="grpc")
    return tf.distribute.cluster_resolver.SimpleClusterResolver(cluster_spec, rpc_layer="grpc")


os.environ["GRPC_FAIL_FAST"] = "use_caller"
NUM_WORKERS, NUM_PS = 3, 2
cluster_resolver = create_in_process_cluster(NUM_WORKERS, NUM_PS)
variable_partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
    min_shard_bytes=(256 << 10), max_shards=NUM_PS
)

strategy = tfdist.strategy_from_config(cluster_resolver, variable_partitioner=variable_partitioner)
result["strategy"] = type(strategy).__name__


@section("fit")
def fit():
    global_batch_size = 64
    x = tf.random.uniform((10, 10), seed=1)
    y = tf.random.uniform((10, 1), seed=2)  # Keras 3 does not broadcast (64,) to (64, 10).
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(10).repeat()
    dataset = dataset.batch(global_batch_size).prefetch(2)
    with strategy.scope():
        model = tf.keras.models.Sequential([tf.keras.layers.Dense(10)])
        model.compile(tf.keras.optimizers.SGD(), loss="mse", steps_per_execution=10)
    working_dir = os.path.join(WORKDIR, "my_working_dir")
    log_dir = os.path.join(working_dir, "log")
    ckpt_filepath = os.path.join(working_dir, "ckpt.keras")
    backup_dir = os.path.join(working_dir, "backup")
    callbacks = [
        tf.keras.callbacks.TensorBoard(log_dir=log_dir),
        tf.keras.callbacks.ModelCheckpoint(filepath=ckpt_filepath),
        tf.keras.callbacks.BackupAndRestore(backup_dir=backup_dir),
    ]
    history = model.fit(dataset, epochs=2, steps_per_epoch=10, callbacks=callbacks, verbose=0)
    weights = [w.tolist() for w in model.get_weights()]
    reloaded = tf.keras.models.load_model(ckpt_filepath)
    result["fit"] = {
        "loss": history.history["loss"],
        "iterations": int(model.optimizer.iterations.numpy()),
        "checkpoint_equal": [w.tolist() for w in reloaded.get_weights()] == weights,
        "tensorboard_files": sum(len(f) for _, _, f in os.walk(log_dir)),
        "backup_left": os.path.exists(backup_dir),
    }


feature_vocab = ["avenger", "ironman", "batman", "hulk", "spiderman", "kingkong", "wonder_woman"]
label_vocab = ["yes", "no"]
random.seed(0)

with strategy.scope():
    feature_lookup_layer = tf.keras.layers.StringLookup(vocabulary=feature_vocab, mask_token=None)
    label_lookup_layer = tf.keras.layers.StringLookup(
        vocabulary=label_vocab, num_oov_indices=0, mask_token=None
    )
    raw_feature_input = tf.keras.layers.Input(shape=(3,), dtype=tf.string, name="feature")
    feature_preprocess_stage = tf.keras.Model(
        {"features": raw_feature_input}, feature_lookup_layer(raw_feature_input)
    )
    raw_label_input = tf.keras.layers.Input(shape=(1,), dtype=tf.string, name="label")
    label_preprocess_stage = tf.keras.Model(
        {"label": raw_label_input}, label_lookup_layer(raw_label_input)
    )


def feature_and_label_gen(num_examples=200):
    examples = {"features": [], "label": []}
    for _ in range(num_examples):
        features = random.sample(feature_vocab, 3)
        examples["features"].append(features)
        examples["label"].append(["yes"] if "avenger" in features else ["no"])
    return examples


examples = feature_and_label_gen()


def preprocess(x):
    return (
        {"features": feature_preprocess_stage(x["features"])},
        label_preprocess_stage(x["label"]),
    )


def dataset_fn(_):
    raw_dataset = tf.data.Dataset.from_tensor_slices(examples)
    return raw_dataset.shuffle(200).batch(32).map(preprocess).repeat()


with strategy.scope():
    model_input = tf.keras.layers.Input(shape=(3,), dtype=tf.int64, name="model_input")
    emb_layer = tf.keras.layers.Embedding(
        input_dim=len(feature_lookup_layer.get_vocabulary()), output_dim=16384
    )
    emb_output = tf.keras.ops.mean(emb_layer(model_input), axis=1)  # Keras 3: ops on KerasTensors.
    dense_output = tf.keras.layers.Dense(
        units=1, activation="sigmoid", kernel_regularizer=tf.keras.regularizers.L2(1e-4)
    )(emb_output)
    model = tf.keras.Model({"features": model_input}, dense_output)
    optimizer = tf.keras.optimizers.RMSprop(learning_rate=0.1)
    accuracy = tf.keras.metrics.Accuracy()

# The tutorial checks that the embedding is split in two (4, 16384) shards on
# the 2 ps, in emb_layer.weights. Keras 3 keeps one weight per layer variable
# (TF-Keras listed the shards): tfdist.shards gives the partitioner's shards.
table = emb_layer.embeddings
result["layer_weights"] = [list(w.shape) for w in emb_layer.weights]
result["shards"] = [[list(s.shape), s.device] for s in tfdist.shards(table)]
# What the partitioner itself asks for, for this variable's shape and dtype.
result["partitions"] = [
    int(n)
    for n in variable_partitioner(shape=tf.TensorShape(table.shape), dtype=tf.as_dtype(table.dtype))
]


@tf.function
def step_fn(iterator):
    def replica_fn(batch_data, labels):
        with tf.GradientTape() as tape:
            pred = model(batch_data, training=True)
            per_example_loss = tf.keras.losses.BinaryCrossentropy(reduction=None)(labels, pred)
            loss = tf.nn.compute_average_loss(per_example_loss)
            model_losses = model.losses
            if model_losses:
                loss += tf.nn.scale_regularization_loss(tf.add_n(model_losses))
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        actual_pred = tf.cast(tf.greater(pred, 0.5), tf.int64)
        accuracy.update_state(labels, actual_pred)
        return loss

    batch_data, labels = next(iterator)
    losses = strategy.run(replica_fn, args=(batch_data, labels))
    return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)


coordinator = None


@section("loop")
def loop():
    global coordinator, per_worker_iterator
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)

    @tf.function
    def per_worker_dataset_fn():
        return strategy.distribute_datasets_from_function(dataset_fn)

    per_worker_dataset = coordinator.create_per_worker_dataset(per_worker_dataset_fn)
    per_worker_iterator = iter(per_worker_dataset)
    accuracies = []
    for _ in range(4):
        accuracy.reset_state()
        for _ in range(5):
            coordinator.schedule(step_fn, args=(per_worker_iterator,))
        coordinator.join()
        accuracies.append(float(accuracy.result().numpy()))
    loss = coordinator.schedule(step_fn, args=(per_worker_iterator,))
    final_loss = float(loss.fetch())
    # The fetched loss adds the kernel's L2 term, which RMSprop's fixed-size
    # steps grow; the fit itself is the cross-entropy on the training examples.
    features, labels = preprocess({k: tf.constant(v) for k, v in examples.items()})
    pred = model(features, training=False)
    data_loss = tf.keras.losses.BinaryCrossentropy()(labels, pred)
    data_accuracy = tf.reduce_mean(
        tf.cast(tf.equal(tf.cast(tf.greater(pred, 0.5), tf.int64), labels), tf.float32)
    )
    result["loop"] = {
        "accuracy": accuracies,
        "final_loss": final_loss,
        "data_loss": float(data_loss),
        "data_accuracy": float(data_accuracy),
        "regularization": float(tf.add_n(model.losses)),
        "iterations": int(optimizer.iterations.numpy()),
        # RMSprop's slot of the table, built in a scheduled step.
        "slot_shards": [
            [list(s.shape) for s in tfdist.shards(v)]
            for v in optimizer.variables
            if tuple(v.shape) == tuple(table.shape)
        ],
    }


@section("inline_eval")
def inline_eval():
    random.seed(1)
    eval_dataset = (
        tf.data.Dataset.from_tensor_slices(feature_and_label_gen(num_examples=16))
        .batch(8)
        .map(preprocess)
    )
    eval_accuracy = tf.keras.metrics.Accuracy()
    for batch_data, labels in eval_dataset:
        pred = model(batch_data, training=False)
        eval_accuracy.update_state(labels, tf.cast(tf.greater(pred, 0.5), tf.int64))
    result["inline_eval"] = float(eval_accuracy.result())


@section("distributed_eval")
def distributed_eval():
    with strategy.scope():
        eval_accuracy = tf.keras.metrics.Accuracy()

    @tf.function
    def eval_step(iterator):
        def replica_fn(batch_data, labels):
            pred = model(batch_data, training=False)
            eval_accuracy.update_state(labels, tf.cast(tf.greater(pred, 0.5), tf.int64))

        batch_data, labels = next(iterator)
        strategy.run(replica_fn, args=(batch_data, labels))

    def eval_dataset_fn():
        return (
            tf.data.Dataset.from_tensor_slices(feature_and_label_gen(num_examples=16))
            .shuffle(16)
            .repeat()
            .batch(8)
            .map(preprocess)
        )

    per_worker_eval_iterator = iter(coordinator.create_per_worker_dataset(eval_dataset_fn))
    for _ in range(2):
        coordinator.schedule(eval_step, args=(per_worker_eval_iterator,))
    coordinator.join()
    result["distributed_eval"] = {
        "accuracy": float(eval_accuracy.result()),
        "count": float(eval_accuracy.count.numpy()),
    }


say("tfdist result: " + json.dumps(result))
