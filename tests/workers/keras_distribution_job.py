"""One worker of a 2-process keras.distribution job (tests/distribution/test_initialize.py).

Written as Keras's docs write it for JAX: initialize(), list_devices(),
DataParallel over them, then build, compile and fit with no strategy in
sight. Worker 0 gets Keras's KERAS_DISTRIBUTION_* variables, worker 1 a
TF_CONFIG (as tfdist launch gives): the test sets one or the other. Then a
tfdist DataParallel with compression, which the strategy keras's
initialize() made without compression cannot take. Prints one "tfdist
result:" line.
"""

import hashlib

import keras
import numpy as np
import tensorflow as tf

import tfdist  # keras.distribution on TensorFlow
from protocol import result

keras.distribution.initialize()
devices = keras.distribution.list_devices()
keras.distribution.set_distribution(keras.distribution.DataParallel())

rng = np.random.default_rng(0)
x = rng.normal(size=(128, 8)).astype("float32")
y = x[:, :4].sum(axis=1, keepdims=True) - x[:, 4:].sum(axis=1, keepdims=True)
keras.utils.set_random_seed(1)
model = keras.Sequential(
    [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
)
model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
history = model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(32), epochs=2, verbose=0)
strategy = model.distribute_strategy
keras.distribution.set_distribution(None)
try:
    keras.distribution.set_distribution(tfdist.distribution.DataParallel(compression="bf16"))
    compressed = None
except tfdist.ConfigError as error:
    compressed = {"field": error.field, "message": str(error)}
result(
    {
        "devices": devices,
        "task": strategy.task,
        "kind": strategy.kind,
        "replicas": strategy.num_replicas_in_sync,
        "loss": history.history["loss"],
        "compressed": compressed,
        "sha256": hashlib.sha256(b"".join(w.tobytes() for w in model.get_weights())).hexdigest(),
    }
)
