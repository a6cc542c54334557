"""A small Horovod-style fit: ranks, a Sum all-reduce, broadcast, identical weights
(Slurm, HOROVOD_* variables)."""

import hashlib

import tfdist.horovod as hvd
from protocol import result

hvd.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

keras.utils.set_random_seed(hvd.rank())  # Different starts: the broadcast must align them.
x = np.random.RandomState(hvd.rank()).rand(32, 4).astype("float32")
y = x.sum(1, keepdims=True)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), "mse")
hvd.broadcast_variables(model.variables, root_rank=0)
model.fit(x, y, batch_size=8, epochs=2, verbose=0)
weights = np.concatenate([v.numpy().ravel() for v in model.trainable_variables])
result(
    {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "local_rank": hvd.local_rank(),
        "local_size": hvd.local_size(),
        "sum": float(hvd.allreduce(tf.constant(float(hvd.rank() + 1)), op=hvd.Sum).numpy()),
        "weights_sha256": hashlib.sha256(weights.tobytes()).hexdigest(),
    }
)
