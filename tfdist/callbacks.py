"""Deprecated: ``tfdist.callbacks`` is now :mod:`tfdist.training.callbacks` (works until the next release)."""

from tfdist._moved import moved

__getattr__, __dir__, __all__ = moved(__name__, [
    'tfdist.training.callbacks',
    'tfdist.training.callbacks.backup',
    'tfdist.training.callbacks.files',
    'tfdist.training.callbacks.workers',
    'tfdist.training.callbacks.writers',
    'tfdist.training.callbacks.learning_rate',
])
