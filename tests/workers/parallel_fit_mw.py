"""One worker of the DP=2 x T=2 multi-process check (tests/parallel/test_parallel_multiworker.py).

Four MultiWorkerMirrored workers (one CPU replica each: TensorFlow gives a
worker without GPUs one replica) form a 2 x 2 mesh through
``strategy_from_config(model_parallel=2)``. Each worker also trains the
unsharded Keras MLP on its own, from the same initial weights and batches,
and prints one 'tfdist result:' line with both runs' losses and the largest
weight difference.
"""

import keras
import numpy as np
import tensorflow as tf

import tfdist
from protocol import result
from tfdist import parallel as tp

strategy = tfdist.strategy_from_config(register_timeout=90, model_parallel=2)
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 8)).astype("float32")
y = rng.normal(size=(64, 4)).astype("float32")


def build(column, row):
    model = keras.Sequential(
        [
            keras.Input((8,)),
            column(16, activation="relu"),
            row(8, activation="tanh"),
            keras.layers.Dense(4),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


keras.utils.set_random_seed(1)
reference = build(keras.layers.Dense, keras.layers.Dense)
initial = reference.get_weights()
with strategy.scope():
    model = build(tp.ColumnParallelDense, tp.RowParallelDense)
model.set_weights(initial)  # Full shapes in; each replica keeps its shard.
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
expected = reference.fit(data, epochs=3, verbose=0).history["loss"]
got = model.fit(data, epochs=3, verbose=0).history["loss"]
full = model.get_weights()  # A gather every worker joins.
result(
    {
        "task": strategy.task,
        "mesh": tp.mesh_of(strategy).describe(),
        "shard": list(model.layers[0].kernel.shape),
        "expected": expected,
        "got": got,
        "weights": max(float(np.abs(a - b).max()) for a, b in zip(full, reference.get_weights())),
        "traffic": tp.traffic(strategy),
    }
)
