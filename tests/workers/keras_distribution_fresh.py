"""A fresh process: keras.distribution before any tfdist strategy.

Prints ``tfdist result: {...}`` with what happened at each step:

1. ``set_distribution(ModelParallel)`` first, with the Dense kernels laid out
   over a "model" axis of 2 logical CPUs, then a model built with no
   strategy: its kernel's shape and type (the fact the guard rests on;
   Keras < 3.15 cannot build the distribution on TensorFlow at all);
2. a tfdist strategy created while that distribution is set;
3. the distribution reset, ``set_distribution(ModelParallel)`` with no
   strategy alive, and a model built under it: its kernel's shape, full
   shape and the devices of its blocks (tfdist honours the layout);
4. a strategy created, then ``set_distribution`` called in its scope
   through the public API, and through a reference imported before tfdist
   (which the guard cannot wrap), followed by ``compile``.
"""

from __future__ import annotations

import json
import os

from protocol import say

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import tensorflow as tf
from keras.distribution import set_distribution as early_set

tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2
)


def outcome(fn):
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - reported in the result
        return {"error": type(error).__name__, "message": str(error)}
    return {"error": None}


def model_parallel():
    dist = keras.distribution
    mesh = dist.DeviceMesh((1, 2), ("batch", "model"), dist.list_devices("cpu"))
    layouts = dist.LayoutMap(mesh)
    layouts[".*dense.*kernel"] = (None, "model")
    return dist.ModelParallel(layout_map=layouts, batch_dim_name="batch")


result = {}
try:
    keras.distribution.set_distribution(model_parallel())
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16)])
    kernel = model.layers[0].kernel
    result["unguarded_kernel"] = {
        "shape": list(kernel.shape),
        "type": type(kernel.value).__name__,
        "device": kernel.value.device,
    }
except AttributeError as error:  # Keras < 3.15 builds none on TensorFlow.
    result["unguarded_kernel"] = {"error": str(error)}

import tfdist  # noqa: E402

if "error" in result["unguarded_kernel"]:
    early_set(model_parallel())  # Buildable now; set as Keras alone would.

result["strategy_after_distribution"] = outcome(lambda: tfdist.strategy_from_config(cpu_replicas=2))
keras.distribution.set_distribution(None)
result["model_parallel_alone"] = outcome(
    lambda: keras.distribution.set_distribution(model_parallel())
)
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16)])
kernel = model.layers[0].kernel
blocks = model.distribute_strategy.experimental_local_results(kernel.value)
result["laid_out_kernel"] = {
    "shape": list(kernel.shape),
    "full": list(model.get_weights()[0].shape),
    "devices": [b.device for b in blocks],
    "distinct": not bool((blocks[0].numpy() == blocks[1].numpy()).all()),
}
keras.distribution.set_distribution(None)
result["distribution_after_alone"] = repr(keras.distribution.distribution())
strategy = tfdist.strategy_from_config(cpu_replicas=2)
with strategy.scope():
    result["public_set_after_strategy"] = outcome(
        lambda: keras.distribution.set_distribution(model_parallel())
    )
result["distribution_after_refusal"] = repr(keras.distribution.distribution())
early_set(model_parallel())  # Not wrapped: taken before tfdist was imported.
with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16)])
result["compile_with_early_set"] = outcome(lambda: model.compile("sgd", "mse"))
say("tfdist result: " + json.dumps(result))
