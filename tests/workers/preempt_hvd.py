"""A Horovod-API elastic loop for tests/horovod/test_preempt_hvd.py.

Usage: ``tfdist launch --workers 2 --max-restarts 1 preempt_hvd.py OUT_DIR``.

A custom loop (Horovod's TF2 elastic example's calls): a
``TensorFlowKerasState(model, opt, batch=0)``, DistributedGradientTape,
SGD with momentum, a commit after every batch. Each rank appends
"attempt pid batch" to OUT_DIR/progress after each batch and sleeps a
little, so that the test can SIGTERM a rank mid-run. At the end it prints a
'tfdist result:' line with the weights and the batch this attempt started at.
"""

import os
import sys
import time
from pathlib import Path

import numpy as np

import tfdist.horovod as hvd
from protocol import result

hvd.init()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

out = Path(sys.argv[1])
rank = hvd.rank()
attempt = int(os.environ.get("TFDIST_LAUNCH_ATTEMPT", "0"))
STEPS, BATCH = 30, 8
pause = float(os.environ.get("TFDIST_TEST_BATCH_SLEEP", "0.05"))

rng = np.random.default_rng(rank)  # Each rank its own data.
x = rng.normal(size=(STEPS * BATCH, 4)).astype("float32")
y = np.sin(x @ np.array([[1.0], [2.0], [-1.0], [0.5]])).astype("float32")
glorot = keras.initializers.GlorotUniform
model = keras.Sequential(
    [
        keras.Input((4,)),
        keras.layers.Dense(8, activation="tanh", kernel_initializer=glorot(1)),
        keras.layers.Dense(1, kernel_initializer=glorot(2)),
    ]
)
opt = keras.optimizers.SGD(0.05, momentum=0.9)
loss_fn = keras.losses.MeanSquaredError()


@tf.function
def step(xb, yb):
    with tf.GradientTape() as tape:
        loss = loss_fn(yb, model(xb, training=True))
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return loss


state = hvd.elastic.TensorFlowKerasState(model, opt, batch=0)
started = {}


@hvd.elastic.run
def train(state):
    started["batch"] = state.batch
    for i in range(state.batch, STEPS):
        step(x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH])
        state.batch = i + 1
        with open(out / "progress", "a") as f:
            f.write(f"{attempt} {rank} {os.getpid()} {i}\n")
        time.sleep(pause)
        state.commit()


train(state)
weights = np.concatenate([w.ravel() for w in model.get_weights()])
result(
    {
        "rank": rank,
        "attempt": attempt,
        "started": started["batch"],
        "iterations": int(opt.iterations.numpy()),
        "weights": weights.tolist(),
    }
)
