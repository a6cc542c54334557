"""One worker of the 2-process sparse-gradient test (tests/compression/test_sparse_gradients.py).

Under tfdist's MultiWorkerMirroredStrategy with ``compression="bf16"``:

* reduces an IndexedSlices of its own (worker 0 holds 3 rows, worker 1
  holds 5, so TensorFlow pads) through ReplicaComm, uncompressed and bf16,
  and reports the densified sums and the rows recorded;
* fits an Embedding model for one epoch (batches of 64, 64 and 32) with
  CommunicationStats, and reports the bytes it counted per batch beside
  predict_traffic's, the loss and a checksum of the weights.

Prints one 'tfdist result:' line.
"""

import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf

import tfdist
from protocol import say
from tfdist.compression import CommunicationStats, make_aggregator, predict_traffic
from tfdist.compression.aggregate import Item
from tfdist.transport.comm import ReplicaComm

strategy = tfdist.strategy_from_config(register_timeout=90, compression="bf16")
task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
result = {"replicas": strategy.num_replicas_in_sync, "task": task}


def worker_slices(index):
    """Worker 0: 3 rows, worker 1: 5 rows of a (20, 8) table, duplicate ids."""
    rows = 3 + 2 * index
    values = np.arange(rows * 8, dtype="float32").reshape(rows, 8) / 7.0 + index + 0.1
    ids = (np.arange(rows) * 3 + index) % 7
    return values, ids.astype("int64")


values, ids = worker_slices(task)
aggregators = {"none": make_aggregator("none"), "bf16": make_aggregator("bf16")}


@tf.function
def reduce_slices():
    def fn():
        out = {}
        for name, agg in aggregators.items():
            comm = ReplicaComm()
            grad = tf.IndexedSlices(tf.constant(values), tf.constant(ids), tf.constant([20, 8]))
            [summed] = agg.aggregate([Item(grad, 0)], tf.constant(0, tf.int64), comm)
            [(_, dtype, _, count)] = comm.sliced
            out[name] = (tf.convert_to_tensor(summed), count)
            result[f"{name}_wire"] = dtype
        return out

    return strategy.run(fn)


reduced = reduce_slices()
for name, (dense, count) in reduced.items():
    result[name] = dense.numpy().tolist()
    result[f"{name}_rows"] = int(count)

keras.utils.set_random_seed(0)
with strategy.scope():
    model = keras.Sequential(
        [
            keras.Input((4,), dtype="int64"),
            keras.layers.Embedding(2000, 32),
            keras.layers.Flatten(),
            keras.layers.Dense(3),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.05),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
rng = np.random.default_rng(2)
x = rng.integers(0, 50, size=(160, 4)).astype("int64")
y = rng.integers(0, 3, size=160)
stats = CommunicationStats(every_batch=True)
counted = []


class Record(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        counted.append(logs["comm_bytes"])


history = model.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[stats, Record()])
result["counted"] = counted
result["predicted"] = [
    predict_traffic(model, "bf16", num_replicas=2, batch_size=b).sent for b in (64, 64, 32)
]
result["loss"] = history.history["loss"]
result["weights"] = float(sum(np.abs(w).sum() for w in model.get_weights()))
say("tfdist result: " + json.dumps(result))
sys.exit(0)
