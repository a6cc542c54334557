"""A multi-worker script that does TensorFlow work before creating its strategy
(tests/strategies/test_late_strategy.py), as a script ported from the Keras multi-worker
tutorial's notebook may: it builds its tf.data pipeline first (mode
``dataset``), or also a Keras model (mode ``model``, which must fail with a
message saying what to move). Prints one 'tfdist result:' line.
"""

import sys

import keras
import numpy as np
import tensorflow as tf

import tfdist
from protocol import result

mode = sys.argv[1]
rng = np.random.default_rng(0)
x = rng.normal(size=(512, 28, 28)).astype("float32")  # MNIST-shaped images
y = (x[:, :14].sum(axis=(1, 2)) > x[:, 14:].sum(axis=(1, 2))).astype("int64")
base = tf.data.Dataset.from_tensor_slices((x, y))
train = base.shuffle(512, seed=1).repeat().batch(64)
counts = tf.data.Dataset.from_generator(
    lambda: iter(range(3)), output_signature=tf.TensorSpec((), tf.int64)
)
if mode == "model":  # e.g. trained on one worker first, as in a notebook
    first_model = keras.Sequential(
        [keras.Input((28, 28)), keras.layers.Flatten(), keras.layers.Dense(2)]
    )

strategy = tfdist.strategy_from_config(register_timeout=90)
with strategy.scope():
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((28, 28)),
            keras.layers.Flatten(),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(2),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.05),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
history = model.fit(train, epochs=4, steps_per_epoch=8, verbose=0)
first_x, first_y = next(iter(base.batch(4)))
result(
    {
        "task": strategy.task,
        "replicas": strategy.num_replicas_in_sync,
        "loss": history.history["loss"],
        "accuracy": history.history["accuracy"],
        "kernel_sum": float(np.sum(model.get_weights()[0])),
        "base_matches": bool(
            np.array_equal(first_x.numpy(), x[:4]) and np.array_equal(first_y.numpy(), y[:4])
        ),
        "base_device": first_x.device,
        "generated": [int(v) for v in counts],
    }
)
