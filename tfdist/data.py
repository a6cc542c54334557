"""Deprecated: ``tfdist.data`` is now :mod:`tfdist.training.data` (works until the next release)."""

from tfdist._moved import moved

__getattr__, __dir__, __all__ = moved(__name__, [
    'tfdist.training.data',
])
