"""The MLP that both frameworks train, its initial weights and its synthetic data.

numpy only, so that the TensorFlow and the PyTorch workers start from the same
weights and see the same rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def mlp_shapes(layers: Sequence[int]) -> list[tuple[tuple[int, ...], str]]:
    """(shape, dtype) of an MLP's kernels and biases, in Keras's order."""
    shapes = []
    for a, b in zip(layers[:-1], layers[1:]):
        shapes += [((a, b), "float32"), ((b,), "float32")]
    return shapes


def param_count(layers: Sequence[int]) -> int:
    """Parameters of an MLP with these widths."""
    return sum(math.prod(s) for s, _ in mlp_shapes(layers))


def initial_weights(layers: Sequence[int], seed: int = 1) -> list:
    """Glorot-uniform kernels and zero biases (numpy), the same in both frameworks."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for a, b in zip(layers[:-1], layers[1:]):
        limit = math.sqrt(6.0 / (a + b))
        out += [rng.uniform(-limit, limit, size=(a, b)).astype("float32"), np.zeros(b, "float32")]
    return out


def make_data(examples: int, test_examples: int, features: int, classes: int, seed: int = 0):
    """Synthetic data labelled by a random 2-layer teacher (64 tanh units)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    w1 = rng.normal(size=(features, 64)) / math.sqrt(features)
    w2 = rng.normal(size=(64, classes))
    x = rng.normal(size=(examples + test_examples, features)).astype("float32")
    y = np.argmax(np.tanh(x @ w1) @ w2, axis=1).astype("int64")
    return (x[:examples], y[:examples]), (x[examples:], y[examples:])


def worker_slice(x, y, rank: int, world: int, batch: int):
    """This worker's rows: for each global batch of ``world * batch`` rows, its ``batch``."""
    steps = len(x) // (world * batch)
    idx = steps * world * batch
    xs = x[:idx].reshape(steps, world, batch, -1)[:, rank].reshape(steps * batch, -1)
    ys = y[:idx].reshape(steps, world, batch)[:, rank].reshape(-1)
    return xs, ys


def accuracy(weights: Sequence[Any], x, y) -> float:
    """Held-out accuracy of the MLP (ReLU between layers) with numpy weights."""
    import numpy as np

    h = x
    for i in range(0, len(weights), 2):
        h = h @ weights[i] + weights[i + 1]
        if i + 2 < len(weights):
            h = np.maximum(h, 0)
    return float(np.mean(np.argmax(h, axis=1) == y))
