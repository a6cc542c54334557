"""A batch that splits unevenly inside a tensor group gets a ConfigError.

A dataset's uneven batch is named after TF's collective fails, which aborts
every collective of the process; arrays are refused before any step. So
each case runs in a fresh process of its own (the two run side by side).
"""

from __future__ import annotations

import pytest

from conftest import finish, result_line, start

pytestmark = pytest.mark.slow

SCRIPT = """
import json, sys
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 4)
import keras, numpy as np, tfdist
from tfdist import parallel as tp

replicas, first = int(sys.argv[1]), sys.argv[2]
rng = np.random.default_rng(0)
x = rng.normal(size=(67, 8)).astype("float32")
y = rng.normal(size=(67, 4)).astype("float32")
with tfdist.strategy_from_config(cpu_replicas=replicas, model_parallel=2).scope():
    model = keras.Sequential([keras.Input((8,)), tp.ColumnParallelDense(16, activation="relu"),
                              tp.RowParallelDense(4)])
    model.compile(optimizer="adam", loss="mse")
result = {}


def attempt(name, call):
    try:
        call()
        result[name] = None
    except Exception as error:
        result[name] = {"type": type(error).__name__, "field": getattr(error, "field", None),
                        "message": str(error)}


def batches(rows):
    return tf.data.Dataset.from_tensor_slices((x[:rows], y[:rows])).batch(32)


if first == "fit":
    # A dataset of 64 examples split evenly: trains. 67 leave a last batch of 3.
    attempt("even", lambda: model.fit(batches(64), epochs=1, verbose=0))
    attempt("uneven", lambda: model.fit(batches(67), epochs=1, verbose=0))
else:
    # Arrays: refused before any step (TF 2.21 crashed on this one), so the
    # process can still predict, evaluate and fit afterwards.
    attempt("even", lambda: model.predict(x[:64], batch_size=32, verbose=0))
    attempt("uneven", lambda: model.predict(x, batch_size=32, verbose=0))
    attempt("uneven_fit", lambda: model.fit(x, y, 30, epochs=1, verbose=0))
    attempt("after", lambda: model.evaluate(x[:64], y[:64], batch_size=16, verbose=0))
print("tfdist result: " + json.dumps(result), flush=True)
"""


def test_an_uneven_last_batch_is_named_in_fit_and_predict():
    # Without tfdist's message: "InvalidArgumentError: ... Shape mismatch in
    # the collective instance ..." from inside the graph.
    procs = [
        start(["-c", SCRIPT, replicas, first]) for replicas, first in ((2, "fit"), (4, "predict"))
    ]
    results = finish(procs, timeout=240)
    for (code, out, err), case in zip(results, ("fit", "predict")):
        assert code == 0, f"{case}: {err[-3000:]}"
        result = result_line(out)
        assert result["even"] is None, (case, result["even"])
        uneven = result["uneven"]
        assert uneven is not None, f"{case}: 67 examples in batches of 32 raised nothing"
        assert uneven["type"] == "ConfigError" and uneven["field"] == "batch_size", uneven
        message = uneven["message"]
        replicas = 2 if case == "fit" else 4
        assert f"split evenly over the {replicas} replicas" in message
        if case == "fit":  # After TF's collective failed.
            assert "expected shape [" in message and "another member [" in message
            assert "start the process again" in message and "drop_remainder=True" in message
        else:  # Before any step.
            assert "67 examples in batches of 32, which leave a last batch of 3" in message
            assert "a batch size that is a multiple of 4" in message
            fit = result["uneven_fit"]
            assert fit["type"] == "ConfigError" and "batches of 30" in fit["message"], fit
            assert result["after"] is None, result["after"]
