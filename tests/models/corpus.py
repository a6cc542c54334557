"""Tiny configurations of the models users train, built with nothing downloaded.

Each entry builds a keras-hub task model or a keras.applications backbone
from a config small enough to train a few steps on a CPU, and deterministic
data for it. Dropout is off everywhere so that a distributed run can be
compared with a one-device run on the same global batches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

VOCABULARY = 256
SEQUENCE = 16
#: MobileNetV2 with per-replica BatchNorm learns in a few steps from 64x64
#: images; at 32x32 its last blocks are 1x1 and 8 examples' statistics are noise.
IMAGE = 64
SMALL_IMAGE = 32
CLASSES = 4


@dataclasses.dataclass(frozen=True)
class Case:
    """One model of the corpus.

    Attributes:
        name: Short id used in test ids.
        build: Makes the uncompiled model (call inside a strategy's scope).
        data: ``data(examples, seed)`` -> (x, y, sample_weight or None), numpy.
        exact_steps: How many steps 2 replicas equal one device on the same
            global batches within 1e-5; 0 where they cannot (per-replica
            BatchNorm statistics).
        hub: Whether it comes from keras-hub (an optional test dependency).
        learning_rate: SGD's rate for this model.
        adam_rate: Adam's rate for this model. BERT learns its task slowly
            under SGD (one device, 18 steps: 1.095 -> 0.937); Adam(1e-2)
            takes it to 0.53 in 12. The CNNs' BatchNorm swings at 1e-2.
    """

    name: str
    build: Callable[[], object]
    data: Callable[[int, int], tuple]
    exact_steps: int
    hub: bool
    learning_rate: float
    adam_rate: float = 1e-2


def _tokens(examples: int, seed: int, *, causal: bool):
    # A learnable sequence: each row counts up by a row-specific stride, so
    # the next token follows from the last two.
    rng = np.random.default_rng(seed)
    start = rng.integers(0, VOCABULARY, size=(examples, 1))
    stride = rng.integers(1, 4, size=(examples, 1))
    ids = ((start + stride * np.arange(SEQUENCE + 1)) % VOCABULARY).astype("int32")
    mask = np.ones((examples, SEQUENCE), "int32")
    mask[::4, -3:] = 0  # Some padding, equal in every half of a batch.
    if causal:
        x = {"token_ids": ids[:, :-1], "padding_mask": mask}
        return x, ids[:, 1:], mask.astype("float32")
    x = {"token_ids": ids[:, :-1], "padding_mask": mask, "segment_ids": np.zeros_like(mask)}
    return x, (stride[:, 0] - 1).astype("int32"), None


def _images(examples: int, seed: int, size: int):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, CLASSES, size=examples).astype("int32")
    x = rng.normal(size=(examples, size, size, 3)).astype("float32") * 0.5
    x[..., 0] += y[:, None, None] * 0.5  # The class shows in the red channel.
    return x, y, None


def gpt2():
    import keras_hub

    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCABULARY,
        num_layers=2,
        num_heads=2,
        hidden_dim=32,
        intermediate_dim=64,
        max_sequence_length=SEQUENCE,
        dropout=0.0,
    )
    return keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)


def bert(layers: int = 2):
    import keras_hub

    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCABULARY,
        num_layers=layers,
        num_heads=2,
        hidden_dim=32,
        intermediate_dim=64,
        max_sequence_length=SEQUENCE,
        dropout=0.0,
    )
    return keras_hub.models.BertTextClassifier(
        backbone, num_classes=3, preprocessor=None, dropout=0.0
    )


def gemma():
    import keras_hub

    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=VOCABULARY,
        num_layers=2,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=32,
        intermediate_dim=64,
        head_dim=16,
        dropout=0.0,
    )
    return keras_hub.models.GemmaCausalLM(backbone, preprocessor=None)


def mobilenet_v2():
    import keras

    return keras.applications.MobileNetV2(
        input_shape=(IMAGE, IMAGE, 3), alpha=0.35, weights=None, classes=CLASSES
    )


def mobilenet_v3_synchronized():
    """MobileNetV3Small with every BatchNormalization synchronized across replicas."""
    import keras

    model = keras.applications.MobileNetV3Small(
        input_shape=(SMALL_IMAGE, SMALL_IMAGE, 3),
        alpha=0.75,
        minimalistic=True,
        weights=None,
        classes=CLASSES,
        dropout_rate=0.0,
        include_preprocessing=False,
    )

    def synchronized(layer):
        config = layer.get_config()
        if isinstance(layer, keras.layers.BatchNormalization):
            config["synchronized"] = True
        return layer.__class__.from_config(config)

    return keras.models.clone_model(model, clone_function=synchronized)


# Synchronized BatchNorm equals one device through its first update only:
# Keras computes the synchronized variance as E[x^2] - E[x]^2 (keras
# backend/tensorflow/nn.py, _compute_moments_sync), and on channels with
# little variance over 16 examples that amplifies the order of a sum
# (measured: weights within 4e-7 after one update, 2e-3 after two; 64x64
# images do no better).
CASES = {
    "gpt2": Case(
        "gpt2",
        gpt2,
        lambda n, s: _tokens(n, s, causal=True),
        exact_steps=6,
        hub=True,
        learning_rate=0.5,
    ),
    "bert": Case(
        "bert",
        bert,
        lambda n, s: _tokens(n, s, causal=False),
        exact_steps=6,
        hub=True,
        learning_rate=0.1,
    ),
    "gemma": Case(
        "gemma",
        gemma,
        lambda n, s: _tokens(n, s, causal=True),
        exact_steps=6,
        hub=True,
        learning_rate=0.5,
    ),
    "mobilenet_v2": Case(
        "mobilenet_v2",
        mobilenet_v2,
        lambda n, s: _images(n, s, IMAGE),
        exact_steps=0,
        hub=False,
        learning_rate=0.01,
        adam_rate=1e-3,
    ),
    "mobilenet_v3_sync": Case(
        "mobilenet_v3_sync",
        mobilenet_v3_synchronized,
        lambda n, s: _images(n, s, SMALL_IMAGE),
        exact_steps=1,
        hub=False,
        learning_rate=0.01,
        adam_rate=1e-3,
    ),
}


def loss_for(case: Case):
    """The loss a user compiles this model with."""
    import keras

    return keras.losses.SparseCategoricalCrossentropy(
        from_logits=case.name in ("gpt2", "bert", "gemma")
    )


def dataset(case: Case, global_batch: int, steps: int, seed: int = 0):
    """``steps`` global batches of ``case``'s data, the same on every call."""
    import tensorflow as tf

    x, y, weight = case.data(global_batch * steps, seed)
    items = (x, y) if weight is None else (x, y, weight)
    return tf.data.Dataset.from_tensor_slices(items).batch(global_batch, drop_remainder=True)


def train(
    case: Case,
    strategy,
    *,
    steps: int = 3,
    epochs: int = 2,
    global_batch: int = 16,
    optimizer: str = "sgd",
    accumulation: int | None = None,
    jit_compile: bool | str = "auto",
) -> dict:
    """Builds, compiles and fits ``case`` under ``strategy``, from seed 0.

    Returns:
        ``{"losses": [loss after each step], "epochs": [each epoch's mean],
        "weights": [numpy arrays], "trainable": [whether each weight is]}``.
        Keras reports a running mean within an epoch; ``losses`` turns it
        back into each step's loss.
    """
    import keras

    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = case.build()
        if optimizer == "sgd":
            opt = keras.optimizers.SGD(
                case.learning_rate, momentum=0.9, gradient_accumulation_steps=accumulation
            )
        elif optimizer == "adam":
            opt = keras.optimizers.Adam(case.adam_rate, gradient_accumulation_steps=accumulation)
        else:
            raise ValueError(f"optimizer: expected 'sgd' or 'adam', got {optimizer!r}")
        model.compile(optimizer=opt, loss=loss_for(case), jit_compile=jit_compile)
    running = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: running.append((batch, logs["loss"]))
    )
    history = model.fit(
        dataset(case, global_batch, steps), epochs=epochs, verbose=0, callbacks=[record]
    )
    losses = [
        (n + 1) * mean - n * previous if n else mean
        for (n, mean), (_, previous) in zip(running, [(0, 0.0)] + running)
    ]
    return {
        "losses": [float(v) for v in losses],
        "epochs": [float(v) for v in history.history["loss"]],
        "weights": [v.numpy() for v in model.weights],
        "trainable": [bool(v.trainable) for v in model.weights],
    }


def exact_run(case: Case) -> dict:
    """``train``'s steps and epochs over which ``case`` can equal one device."""
    if case.exact_steps >= 6:
        return {"steps": 3, "epochs": 2}
    return {"steps": case.exact_steps, "epochs": 1}


def max_difference(a: list, b: list) -> float:
    """Largest absolute difference between two lists of weights."""
    import numpy as np

    assert [w.shape for w in a] == [w.shape for w in b]
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


HUB_MISSING = (
    "keras-hub is not installed. It needs tensorflow-text built for this "
    "TensorFlow minor version (pip install keras-hub tensorflow-text==<TF "
    "minor>.*); .ci/matrix installs it where one exists"
)
