"""Deprecated: ``tfdist.options`` is now :mod:`tfdist.spec.options` (works until the next release)."""

from tfdist._moved import moved

__getattr__, __dir__, __all__ = moved(__name__, [
    'tfdist.spec.options',
])
