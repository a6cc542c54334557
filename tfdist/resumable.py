"""Deprecated: ``tfdist.resumable`` is now :mod:`tfdist.training.resumable` (works until the next release)."""

from tfdist._moved import moved

__getattr__, __dir__, __all__ = moved(__name__, [
    'tfdist.training.resumable',
])
