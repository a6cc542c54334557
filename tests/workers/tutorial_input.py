"""TensorFlow's "Distributed input" tutorial, step by step
(tests/tutorials/test_tutorials_input.py).

tensorflow/docs site/en/tutorials/distribute/input.ipynb: the script splits
the CPU into 2 logical devices itself, before anything else, and then creates
its strategies with tfdist.strategy_from_config() where the tutorial calls
tf.distribute.MirroredStrategy(). Prints one 'tfdist result:' line with what
each step computed.
"""

import json

import numpy as np
import tensorflow as tf

import tfdist
from protocol import say

N_VIRTUAL_DEVICES = 2
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(N_VIRTUAL_DEVICES)]
)


def local(strategy, value):
    """A per-replica value as one list per replica."""
    return [np.asarray(v).tolist() for v in strategy.experimental_local_results(value)]


def tutorial(make_strategy) -> dict:
    """Runs the tutorial's steps, creating each strategy with make_strategy()."""
    result = {"strategies": []}

    def new_strategy():
        strategy = make_strategy()
        result["strategies"].append([type(strategy).__name__, strategy.num_replicas_in_sync])
        return strategy

    # A plain tf.data loop, no strategy.
    global_batch_size = 16
    dataset = tf.data.Dataset.from_tensors(([1.0], [1.0])).repeat(100).batch(global_batch_size)

    @tf.function
    def train_step(inputs):
        features, labels = inputs
        return labels - 0.3 * features

    result["plain_batches"] = [int(train_step(x).shape[0]) for x in dataset]

    # experimental_distribute_dataset: one global batch per step, split.
    mirrored_strategy = new_strategy()
    dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)
    features, _ = next(iter(dist_dataset))
    result["split_batch"] = [len(v) for v in local(mirrored_strategy, features)]

    # An explicit DATA sharding policy.
    dataset = tf.data.Dataset.from_tensors(([1.0], [1.0])).repeat(64).batch(16)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = dataset.with_options(options)

    # distribute_datasets_from_function: the per-replica batch from the context.
    mirrored_strategy = new_strategy()

    def dataset_fn(input_context):
        batch_size = input_context.get_per_replica_batch_size(global_batch_size)
        dataset = tf.data.Dataset.from_tensors(([1.0], [1.0])).repeat(64).batch(16)
        dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        dataset = dataset.batch(batch_size)
        return dataset.prefetch(2)

    dist_dataset = mirrored_strategy.distribute_datasets_from_function(dataset_fn)
    features, _ = next(iter(dist_dataset))
    result["from_function_shapes"] = [list(np.shape(v)) for v in local(mirrored_strategy, features)]

    # strategy.run over a distributed dataset: a for loop, then iter/next per epoch.
    mirrored_strategy = new_strategy()
    dataset = tf.data.Dataset.from_tensors(([1.0], [1.0])).repeat(100).batch(global_batch_size)
    dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)
    examples = 0
    for x in dist_dataset:
        loss = mirrored_strategy.run(train_step, args=(x,))
        examples += sum(len(v) for v in local(mirrored_strategy, loss))
    result["for_loop_examples"] = examples
    result["loss_value"] = local(mirrored_strategy, loss)[0][0]
    steps = 0
    for epoch in range(2):  # noqa: B007 - as in TensorFlow's tutorial
        dist_iterator = iter(dist_dataset)
        for step in range(5):  # noqa: B007 - as in TensorFlow's tutorial
            loss = mirrored_strategy.run(train_step, args=(next(dist_iterator),))
            steps += 1
    result["iter_steps"] = steps

    # get_next_as_optional ends a tf.function loop at the end of the data.
    steps_per_loop = 5
    strategy = new_strategy()
    dataset = tf.data.Dataset.range(9).batch(4)
    distributed_iterator = iter(strategy.experimental_distribute_dataset(dataset))

    @tf.function
    def train_fn(distributed_iterator):
        total = tf.constant(0, tf.int64)
        steps = tf.constant(0)
        for _ in tf.range(steps_per_loop):
            optional_data = distributed_iterator.get_next_as_optional()
            if not optional_data.has_value():
                break
            per_replica_results = strategy.run(
                lambda x: tf.reduce_sum(x), args=(optional_data.get_value(),)
            )
            total += strategy.reduce("SUM", per_replica_results, axis=None)
            steps += 1
        return total, steps

    total, steps = train_fn(distributed_iterator)
    result["optional"] = [int(total), int(steps)]

    # A tf.function with the distributed dataset's element_spec as its signature.
    mirrored_strategy = new_strategy()
    dataset = tf.data.Dataset.from_tensors(([1.0], [1.0])).repeat(100).batch(global_batch_size)
    dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)

    @tf.function(input_signature=[dist_dataset.element_spec])
    def signature_step(per_replica_inputs):
        return mirrored_strategy.run(lambda inputs: 2 * inputs, args=(per_replica_inputs,))

    iterator = iter(dist_dataset)
    output = signature_step(next(iterator))
    result["signature_features"] = local(mirrored_strategy, output[0])

    # A Keras preprocessing layer created in the scope, applied in dataset_fn.
    strategy = new_strategy()
    with strategy.scope():
        layer = tf.keras.layers.StringLookup(vocabulary=["a", "b", "c", "d", "f"])

    def kpl_dataset_fn(input_context):
        dataset = tf.data.Dataset.from_tensor_slices(["a", "c", "e"]).repeat()
        batch_size = input_context.get_per_replica_batch_size(4)
        dataset = dataset.batch(batch_size)
        dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        return dataset.map(lambda x: layer(x))

    kpl_iterator = iter(strategy.distribute_datasets_from_function(kpl_dataset_fn))
    result["kpl"] = [local(strategy, next(kpl_iterator)) for _ in range(3)]

    # Predictions matched to their inputs through enumerate's index.
    mirrored_strategy = new_strategy()
    dataset = tf.data.Dataset.range(24).enumerate().batch(6)
    dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)
    predicted = {}
    for index, inputs in dist_dataset:
        output_index, outputs = mirrored_strategy.run(lambda i, x: (i, 2 * x), args=(index, inputs))
        indices = [i for part in local(mirrored_strategy, output_index) for i in part]
        values = [v for part in local(mirrored_strategy, outputs) for v in part]
        predicted.update(zip(indices, values))
    result["predicted"] = sorted(predicted.items())

    # Values per replica from a function of the replica context.
    mirrored_strategy = new_strategy()
    distributed_values = mirrored_strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(ctx.replica_id_in_sync_group)
    )
    result["replica_values"] = local(
        mirrored_strategy, mirrored_strategy.run(lambda x: x, args=(distributed_values,))
    )

    # A generator dataset, distributed.
    mirrored_strategy = new_strategy()

    def input_gen():
        while True:
            yield np.random.rand(4)

    dataset = tf.data.Dataset.from_generator(
        input_gen, output_types=tf.float32, output_shapes=tf.TensorShape([4])
    )
    iterator = iter(mirrored_strategy.experimental_distribute_dataset(dataset))
    value = mirrored_strategy.run(lambda x: x, args=(next(iterator),))
    result["generator_shapes"] = [list(np.shape(v)) for v in local(mirrored_strategy, value)]

    return result


say(
    "tfdist result: "
    + json.dumps(
        {
            "logical_cpus": len(tf.config.list_logical_devices("CPU")),
            "tfdist": tutorial(tfdist.strategy_from_config),
            # The same steps with TensorFlow's own strategy, for comparison.
            "tensorflow": tutorial(tf.distribute.MirroredStrategy),
        }
    )
)
