"""One worker of the 2-worker XLA grid (tests/strategies/test_multi_worker.py).

For each setting in TFDIST_TEST_GRID (a JSON list of [policy, compression,
steps_per_execution, gradient_accumulation_steps]), creates a MultiWorkerMirrored strategy
through strategy_from_config and fits the same small model twice, with and
without ``jit_compile=True``. The first setting also evaluates and predicts.
Prints one "tfdist result:" line: per setting, the largest weight difference
between the two fits, both losses, the XLA weights' sha256 (equal on both
workers when the XLA run stayed synchronous) and what describe() said.
"""

import hashlib
import json
import os

import keras
import numpy as np
import tensorflow as tf

import tfdist
from protocol import result

GRID = json.loads(os.environ["TFDIST_TEST_GRID"])
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 8)).astype("float32")
y = x[:, :4].sum(axis=1, keepdims=True) - x[:, 4:].sum(axis=1, keepdims=True)


def batches(inputs, targets=None):
    # A global batch of 32: each worker reads half of it.
    data = inputs if targets is None else (inputs, targets)
    return tf.data.Dataset.from_tensor_slices(data).batch(32)


def fit(strategy, jit, steps, accumulation, validate):
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(128, activation="relu"),
                keras.layers.Dense(16, activation="tanh"),
                keras.layers.Dense(1),
            ]
        )
        model.compile(
            optimizer=keras.optimizers.SGD(
                0.02, momentum=0.9, gradient_accumulation_steps=accumulation
            ),
            loss="mse",
            metrics=["mae"],
            jit_compile=jit,
            steps_per_execution=steps,
        )
    history = model.fit(batches(x, y), epochs=2, verbose=0)
    run = {
        "weights": model.get_weights(),
        "loss": history.history["loss"],
        "optimizer": type(model.optimizer).__name__,
        "iterations": int(model.optimizer.iterations.numpy()),
    }
    if validate:
        run["evaluate"] = model.evaluate(batches(x, y), verbose=0)
        run["predict"] = model.predict(batches(x[:40]), verbose=0)
    return run


results = []
for index, (policy, compression, steps, accumulation) in enumerate(GRID):
    keras.mixed_precision.set_global_policy(policy)
    strategy = tfdist.strategy_from_config(register_timeout=60, compression=compression)
    plain, xla = (
        fit(strategy, jit, steps, accumulation, validate=index == 0) for jit in (False, True)
    )
    row = {
        "policy": policy,
        "compression": compression,
        "steps": steps,
        "accumulation": accumulation,
        "task": strategy.task,
        "replicas": strategy.num_replicas_in_sync,
        "optimizer": xla["optimizer"],
        "weights_diff": max(
            float(np.max(np.abs(a - b))) for a, b in zip(xla["weights"], plain["weights"])
        ),
        "loss": {"xla": xla["loss"], "plain": plain["loss"]},
        "iterations": {"xla": xla["iterations"], "plain": plain["iterations"]},
        "sha256": hashlib.sha256(b"".join(w.tobytes() for w in xla["weights"])).hexdigest(),
        "description": strategy.describe(),
    }
    if "evaluate" in xla:
        row["evaluate"] = {"xla": xla["evaluate"], "plain": plain["evaluate"]}
        row["predict_diff"] = float(np.max(np.abs(xla["predict"] - plain["predict"])))
    results.append(row)
keras.mixed_precision.set_global_policy("float32")
result({"grid": results})
