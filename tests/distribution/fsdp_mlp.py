"""The FSDP MLP that tests/distribution/test_initialize.py trains on 2 logical
CPUs and tests/workers/keras_compressed_job.py on 2 processes: both kernels
split over a 1-D batch mesh, the same data and initial weights, SGD."""

from __future__ import annotations

from typing import Any

import numpy as np


def model_parallel(keras, devices: list[str], **options: Any):
    """A ModelParallel (tfdist's with ``options``, else Keras's) splitting
    both kernels over the batch axis of ``devices``."""
    mesh = keras.distribution.DeviceMesh((len(devices),), ["batch"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["dense_a/kernel"] = ("batch", None)
    layout_map["dense_b/kernel"] = (None, "batch")
    if options:
        import tfdist

        return tfdist.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch", **options
        )
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def fit(keras) -> tuple[Any, list, list, dict]:
    """Builds and fits the MLP under the distribution set now: the model, its
    losses, its weights and the bytes its strategy sent."""
    import tfdist

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
    model.set_weights(
        [rng.normal(size=w.shape).astype("float32") * 0.3 for w in model.get_weights()]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    tfdist.parallel.reset_traffic(model.distribute_strategy)
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    sent = tfdist.parallel.traffic(model.distribute_strategy)
    return model, history.history["loss"], model.get_weights(), sent
