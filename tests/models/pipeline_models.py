"""Models and data the pipeline tests train (tests/pipeline, tests/workers/pipeline_task.py).

The data are shaped like real data: an MLP's features on different scales
with skewed classes, images with a per-image colour shift, and a language
model's token ids drawn from a Zipf law with sequences of uneven length (a
padding mask).
"""

from __future__ import annotations

import numpy as np

#: Where the stages begin, for up to 4 stages (take the first p - 1).
SPLITS = {
    "mlp": ["d2", "d3", "d4"],
    "llama": ["transformer_layer_1", "transformer_layer_2", "transformer_layer_3"],
    "cnn": ["conv2", "head"],
}
BATCH = 16
VOCAB = 256
LENGTH = 12
CLASSES = 10


def make_model(name: str):
    """A model to pipeline, built with Keras's current seed."""
    import keras

    if name == "mlp":
        inp = keras.Input((24,), name="features")
        h = keras.layers.Dense(32, activation="relu", name="d1")(inp)
        h2 = keras.layers.Dense(32, activation="tanh", name="d2")(h)
        h3 = keras.layers.Dense(32, activation="relu", name="d3")(h2)
        h3 = keras.layers.Add(name="skip")([h2, h3])
        h4 = keras.layers.Dense(32, activation="relu", name="d4")(h3)
        out = keras.layers.Dense(CLASSES, name="logits")(h4)
        return keras.Model(inp, out, name="mlp")
    if name == "cnn":
        # No bias before a batch normalization, as real CNNs have it: its
        # gradient is 0 in theory, and Adam turns its float noise into steps
        # of about the learning rate (1e-5 apart after one step, either way).
        inp = keras.Input((8, 8, 3), name="image")
        h = keras.layers.Conv2D(8, 3, padding="same", use_bias=False, name="conv1")(inp)
        h = keras.layers.BatchNormalization(name="bn1")(h)
        h = keras.layers.Activation("relu", name="relu1")(h)
        h = keras.layers.Conv2D(8, 3, strides=2, use_bias=False, name="conv2")(h)
        h = keras.layers.BatchNormalization(name="bn2")(h)
        h = keras.layers.Activation("relu", name="relu2")(h)
        h = keras.layers.GlobalAveragePooling2D(name="pool")(h)
        return keras.Model(inp, keras.layers.Dense(CLASSES, name="head")(h), name="cnn")
    if name == "llama":
        import keras_hub

        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=VOCAB,
            num_layers=4,
            num_query_heads=4,
            num_key_value_heads=2,
            hidden_dim=32,
            intermediate_dim=64,
        )
        return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    raise ValueError(f"model: expected 'mlp' or 'llama'. Received: {name!r}")


def layout_map(name: str, shape: tuple[int, int]):
    """A ``keras.distribution.LayoutMap`` for ``name`` over a (batch, model)
    mesh of ``shape`` of this process's CPUs: the MLP's hidden layers split
    Megatron-style over "model" (a column layer, then a row layer) with
    their kernels' other axis over "batch" (FSDP); keras-hub's own map for
    the Llama."""
    import keras

    devices = keras.distribution.list_devices("cpu")[: shape[0] * shape[1]]
    mesh = keras.distribution.DeviceMesh(shape, ["batch", "model"], devices)
    if name == "llama":
        import keras_hub

        return keras_hub.models.LlamaBackbone.get_layout_map(mesh)
    layouts = keras.distribution.LayoutMap(mesh)
    layouts["d[13]/kernel"] = ("batch", "model")
    layouts["d[13]/bias"] = ("model",)
    layouts["d[24]/kernel"] = ("model", "batch")
    layouts["logits/kernel"] = (None, "model")
    return layouts


def batches(name: str, steps: int, seed: int = 3):
    """``(x, y)`` for ``steps`` batches of BATCH examples."""
    rng = np.random.default_rng(seed)
    n = steps * BATCH
    if name == "mlp":
        scales = np.geomspace(0.1, 10.0, 24).astype("float32")
        x = rng.standard_normal((n, 24)).astype("float32") * scales
        y = np.minimum(rng.zipf(1.6, n) - 1, CLASSES - 1).astype("int32")
        return x, y
    if name == "cnn":
        x = rng.standard_normal((n, 8, 8, 3)).astype("float32") + rng.uniform(-1, 1, (n, 1, 1, 3))
        y = np.minimum(rng.zipf(1.6, n) - 1, CLASSES - 1).astype("int32")
        return x.astype("float32"), y
    ids = np.minimum(rng.zipf(1.3, (n, LENGTH + 1)), VOCAB - 1).astype("int32")
    lengths = rng.integers(3, LENGTH + 1, n)
    mask = np.arange(LENGTH)[None, :] < lengths[:, None]
    x = {"token_ids": np.where(mask, ids[:, :-1], 0), "padding_mask": mask}
    y = np.where(mask, ids[:, 1:], 0).astype("int32")
    return x, y
