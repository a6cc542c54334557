"""Synthetic stand-ins for the datasets the TF distribution tutorials download.

MNIST and Fashion-MNIST are 28x28 uint8 images with int labels 0-9. Here each
class is a fixed random pattern plus noise, so a small model learns it in an
epoch or two and accuracy well above chance (0.1) shows that training worked.
Sizes are tiny: the tutorials' patterns matter here, not their scale.
"""

from __future__ import annotations

import numpy as np

CLASSES = 10


def mnist_like(examples: int, seed: int, channel: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Returns ``(images, labels)``: uint8 ``(examples, 28, 28[, 1])``, int64 labels."""
    patterns = np.random.default_rng(12345).random((CLASSES, 28, 28)) > 0.6
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, CLASSES, size=examples)
    noise = rng.integers(0, 90, size=(examples, 28, 28))
    images = (patterns[labels] * 160 + noise).clip(0, 255).astype(np.uint8)
    if channel:
        images = images[..., None]
    return images, labels.astype(np.int64)


def scaled(images: np.ndarray) -> np.ndarray:
    """uint8 pixels as float32 in [0, 1], as the tutorials scale them."""
    return images.astype(np.float32) / np.float32(255)


def flat_weights(model) -> np.ndarray:
    """All of a model's weights as one float64 vector (for comparisons)."""
    return np.concatenate([np.asarray(w, np.float64).ravel() for w in model.get_weights()])
