"""One worker of a 2-process keras.distribution job with compression
(tests/distribution/test_initialize.py).

tfdist.distribution.initialize(compression="bf16") joins the job from
TF_CONFIG; a ModelParallel on a 1-D batch mesh splits both kernels over the
2 processes (FSDP), so their gradients are reduce-scattered over the batch
axis, in bfloat16. A second initialize() with other options is refused.
Prints one "tfdist result:" line: losses, weights, bytes sent.
"""

import json

import keras
import numpy as np

import tfdist

tfdist.distribution.initialize(compression="bf16")
try:
    tfdist.distribution.initialize(compression="fp16")
    again = None
except tfdist.ConfigError as error:
    again = {"field": error.field, "message": str(error)}

mesh = keras.distribution.DeviceMesh((2,), ["batch"], keras.distribution.list_devices())
layout_map = keras.distribution.LayoutMap(mesh)
layout_map["dense_a/kernel"] = ("batch", None)
layout_map["dense_b/kernel"] = (None, "batch")
keras.distribution.set_distribution(
    keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
)

rng = np.random.default_rng(0)
x = rng.normal(size=(32, 6)).astype("float32")
y = rng.normal(size=(32, 4)).astype("float32")
model = keras.Sequential(
    [
        keras.Input((6,)),
        keras.layers.Dense(8, name="dense_a"),
        keras.layers.Dense(4, name="dense_b"),
    ]
)
model.set_weights([rng.normal(size=w.shape).astype("float32") * 0.3 for w in model.get_weights()])
model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
tfdist.parallel.reset_traffic(model.distribute_strategy)
history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
print(
    "tfdist result: "
    + json.dumps(
        {
            "task": model.distribute_strategy.task,
            "again": again,
            "loss": history.history["loss"],
            "weights": [w.tolist() for w in model.get_weights()],
            "sent": tfdist.parallel.traffic(model.distribute_strategy),
        }
    ),
    flush=True,
)
