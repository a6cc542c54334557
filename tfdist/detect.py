"""Deprecated: ``tfdist.detect`` is now :mod:`tfdist.spec.detect` (works until the next release)."""

from tfdist._moved import moved

__getattr__, __dir__, __all__ = moved(__name__, [
    'tfdist.spec.detect',
])
